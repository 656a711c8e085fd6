//! The type rules of the shape ops: `reduce_sum` (R3.16–R3.18), `broadcast_in_dim` (R3.22) and
//! `reshape` (R3.23), with the reshape grouping the ops use to keep shards local.
//!
//! Invariants: none of these ops changes an operand's unreduced set behind the caller's back
//! (docs/design.md §4.3, §4.5): an `out_sharding` must carry the sets the rule derives, and a
//! reshape that would move data between devices has no local partitions (`None`).

use ferrotext_sharding::{ArrayType, AxisSet, DimSpec, Mesh, PartitionSpec};

use super::{
    check_optional_out_sharding, dims_spec, err, fs, make_type, reduced, spec_of, target_type,
    unreduced, TypeResult,
};
use crate::error::TypeErrorKind as K;

/// `reduce_sum` over `axes` (R3.16–R3.18, with docs/design.md §4.3: an `out_sharding` that lists
/// unreduced axes must list all of the operand's).
pub fn reduce_sum_type(
    x: &ArrayType,
    axes: &[usize],
    out_sharding: Option<&PartitionSpec>,
) -> TypeResult<ArrayType> {
    const OP: &str = "reduce_sum";
    check_optional_out_sharding(OP, x, out_sharding)?;
    let mut summed = vec![false; x.rank()];
    for &a in axes {
        if a >= x.rank() || std::mem::replace(&mut summed[a], true) {
            return Err(err(
                K::ShapeError,
                OP,
                &[x],
                format!("axes {axes:?} do not fit rank {}", x.rank()),
            ));
        }
    }
    let kept: Vec<usize> = (0..x.rank()).filter(|&d| !summed[d]).collect();
    let shape: Vec<usize> = kept.iter().map(|&d| x.shape()[d]).collect();
    let ux = unreduced(x);
    match out_sharding {
        None => {
            let partitions = dims_spec(x, &kept);
            make_type(
                OP,
                x,
                shape,
                spec_of(OP, partitions, ux.clone(), reduced(x).clone()),
            )
        }
        Some(target) => {
            let u_out = target.unreduced();
            if u_out.is_empty() {
                // R3.18: the operand's unreduced set propagates; its reduced set too.
                let mut r = target.reduced().clone();
                r.extend(reduced(x).iter().cloned());
                let spec = spec_of(OP, target.partitions().to_vec(), ux.clone(), r);
                let spec = spec?;
                return target_type(OP, x, shape, &spec);
            }
            let summed_over: AxisSet = axes
                .iter()
                .flat_map(|&d| x.sharding().spec().dim(d).axis_names().iter().cloned())
                .collect();
            if u_out
                .iter()
                .any(|a| !summed_over.contains(a) && !ux.contains(a))
            {
                return Err(err(
                    K::UnreducedNotContracting,
                    OP,
                    &[x],
                    format!(
                        "out_sharding's unreduced axes should be in operand's specs that were \
                         summed over. Got axes={axes:?}, unreduced_spec={}",
                        fs(u_out)
                    ),
                ));
            }
            if !ux.is_subset(u_out) {
                return Err(err(
                    K::UnreducedMismatch,
                    OP,
                    &[x],
                    format!(
                        "out_sharding {} omits some of the operand's unreduced axes; reducing them \
                         here would be a hidden all-reduce (docs/design.md §4.3): call `reshard` \
                         first",
                        target
                    ),
                ));
            }
            let mut r = target.reduced().clone();
            r.extend(reduced(x).iter().cloned());
            let spec = spec_of(OP, target.partitions().to_vec(), u_out.clone(), r)?;
            target_type(OP, x, shape, &spec)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// broadcast_in_dim

/// `broadcast_in_dim` (R3.22, with docs/design.md §4.3 and §4.5: the output's unreduced set must
/// equal the operand's — resharding it here would be hidden communication or a wrong sum).
pub fn broadcast_in_dim_type(
    x: &ArrayType,
    shape: &[usize],
    broadcast_dims: &[usize],
    out_sharding: Option<&PartitionSpec>,
) -> TypeResult<ArrayType> {
    const OP: &str = "broadcast_in_dim";
    check_optional_out_sharding(OP, x, out_sharding)?;
    let bad_dims = broadcast_dims.len() != x.rank()
        || broadcast_dims.windows(2).any(|w| w[0] >= w[1])
        || broadcast_dims
            .iter()
            .zip(x.shape())
            .any(|(&d, &n)| d >= shape.len() || (n != shape[d] && n != 1));
    if bad_dims {
        return Err(err(
            K::ShapeError,
            OP,
            &[x],
            format!(
                "{:?} with dimensions {broadcast_dims:?} does not broadcast to {shape:?}",
                x.shape()
            ),
        ));
    }
    match out_sharding {
        None => {
            let mut partitions = vec![DimSpec::Replicated; shape.len()];
            for (i, &d) in broadcast_dims.iter().enumerate() {
                if x.shape()[i] == shape[d] {
                    partitions[d] = x.sharding().spec().dim(i).clone();
                }
            }
            let spec = spec_of(OP, partitions, unreduced(x).clone(), reduced(x).clone());
            make_type(OP, x, shape.to_vec(), spec)
        }
        Some(target) => {
            let out = target_type(OP, x, shape.to_vec(), target)?;
            let (ux, uo) = (unreduced(x), unreduced(&out));
            if ux != uo {
                let why = if ux.is_subset(uo) {
                    "every replica would hold a full copy, so the sum would be wrong \
                     (docs/design.md §4.5); use `reshard`, which zeroes the other replicas"
                } else {
                    "the operand's unreduced axes would be reduced by a hidden all-reduce \
                     (docs/design.md §4.3); call `reshard` first"
                };
                return Err(err(
                    K::UnreducedMismatch,
                    OP,
                    &[x],
                    format!("out_sharding {target} is unreduced over other axes than the operand: {why}"),
                ));
            }
            Ok(out)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// reshape

/// Groups of input and output dims with equal products, in order; size-1 dims left over at the
/// end join the last group. Each group is `(input dims, output dims)`.
pub(crate) fn reshape_groups(
    from: &[usize],
    to: &[usize],
) -> Option<Vec<(Vec<usize>, Vec<usize>)>> {
    let mut groups: Vec<(Vec<usize>, Vec<usize>)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < from.len() && j < to.len() {
        let (mut gi, mut gj) = (vec![i], vec![j]);
        let (mut pi, mut pj) = (from[i], to[j]);
        i += 1;
        j += 1;
        while pi != pj {
            if pi < pj {
                pi *= *from.get(i)?;
                gi.push(i);
                i += 1;
            } else {
                pj *= *to.get(j)?;
                gj.push(j);
                j += 1;
            }
        }
        groups.push((gi, gj));
    }
    let rest_from: Vec<usize> = (i..from.len()).collect();
    let rest_to: Vec<usize> = (j..to.len()).collect();
    if rest_from.iter().any(|&d| from[d] != 1) || rest_to.iter().any(|&d| to[d] != 1) {
        return None;
    }
    if !rest_from.is_empty() || !rest_to.is_empty() {
        match groups.last_mut() {
            Some(last) => {
                last.0.extend(rest_from);
                last.1.extend(rest_to);
            }
            None => groups.push((rest_from, rest_to)),
        }
    }
    Some(groups)
}

/// The output partitions of a reshape that keeps every shard local: within a group of merged or
/// split dims only the first non-1 input dim may be sharded, and its sharding moves to the first
/// non-1 output dim when that dim's size is divisible. `None` when the reshape would move data
/// between devices.
pub(crate) fn local_reshape_partitions(x: &ArrayType, new_sizes: &[usize]) -> Option<Vec<DimSpec>> {
    let groups = reshape_groups(x.shape(), new_sizes)?;
    let spec = x.sharding().spec();
    let mut out = vec![DimSpec::Replicated; new_sizes.len()];
    for (gi, gj) in groups {
        let sharded: Vec<usize> = gi
            .iter()
            .copied()
            .filter(|&d| !spec.dim(d).is_replicated())
            .collect();
        let Some(&d) = sharded.first() else { continue };
        let major_in = gi.iter().copied().find(|&k| x.shape()[k] != 1);
        let major_out = gj.iter().copied().find(|&k| new_sizes[k] != 1);
        if sharded.len() > 1 {
            return None;
        }
        let target = match major_in {
            // A group of size-1 dims only (`1@data` on a one-device axis, a batch of one):
            // every shard is the whole group, and its sharding stays on the group's first
            // output dim, so the batch dim keeps its axis.
            None => *gj.first()?,
            Some(m) if m == d => major_out?,
            Some(_) => return None,
        };
        if !new_sizes[target].is_multiple_of(mesh_parts(x.mesh(), spec.dim(d))) {
            return None;
        }
        out[target] = spec.dim(d).clone();
    }
    Some(out)
}

fn mesh_parts(mesh: &Mesh, dim: &DimSpec) -> usize {
    dim.axis_names()
        .iter()
        .filter_map(|a| mesh.axis(a).map(|x| x.size()))
        .product()
}

/// `reshape` (R3.23): tags are kept; an `out_sharding` must carry the same sets.
pub fn reshape_type(
    x: &ArrayType,
    new_sizes: &[usize],
    out_sharding: Option<&PartitionSpec>,
) -> TypeResult<ArrayType> {
    const OP: &str = "reshape";
    check_optional_out_sharding(OP, x, out_sharding)?;
    if new_sizes.iter().product::<usize>() != x.element_count() {
        return Err(err(
            K::ShapeError,
            OP,
            &[x],
            format!("cannot reshape {:?} to {new_sizes:?}", x.shape()),
        ));
    }
    let (ux, rx) = (unreduced(x), reduced(x));
    match out_sharding {
        None => {
            let partitions = local_reshape_partitions(x, new_sizes).ok_or_else(|| {
                err(
                    K::ShardingMismatch,
                    OP,
                    &[x],
                    format!(
                        "This reshape is not supported. Please specify the sharding of the output \
                         via the `out_sharding` argument. Got new sizes: {new_sizes:?}"
                    ),
                )
            })?;
            make_type(
                OP,
                x,
                new_sizes.to_vec(),
                spec_of(OP, partitions, ux.clone(), rx.clone()),
            )
        }
        Some(target) => {
            let out = target_type(OP, x, new_sizes.to_vec(), target)?;
            if ux.is_empty() && !unreduced(&out).is_empty() {
                return Err(err(
                    K::UnreducedMismatch,
                    OP,
                    &[x],
                    format!("out_sharding passed to `reshape` cannot contain unreduced axes. Got {target}"),
                ));
            }
            if ux != unreduced(&out) {
                return Err(err(
                    K::UnreducedMismatch,
                    OP,
                    &[x],
                    format!(
                        "out_sharding passed to reshape must be unreduced over the same mesh axes \
                         as operand. Got out_sharding: {target}"
                    ),
                ));
            }
            if rx != reduced(&out) {
                return Err(err(
                    K::ReducedConflict,
                    OP,
                    &[x],
                    format!(
                        "out_sharding passed to reshape must be reduced over the same mesh axes as \
                         operand. Got out_sharding: {target}"
                    ),
                ));
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use ferrotext_sharding::{AxisType, NamedSharding};

    use super::*;

    #[test]
    fn reshape_groups_pair_equal_products() {
        assert_eq!(
            reshape_groups(&[2, 4, 4], &[8, 4]).unwrap(),
            vec![(vec![0, 1], vec![0]), (vec![2], vec![1])]
        );
        assert_eq!(
            reshape_groups(&[16], &[2, 8]).unwrap(),
            vec![(vec![0], vec![0, 1])]
        );
        assert_eq!(
            reshape_groups(&[1, 8, 4], &[8, 4]).unwrap(),
            vec![(vec![0, 1], vec![0]), (vec![2], vec![1])]
        );
        assert_eq!(
            reshape_groups(&[8, 4], &[8, 4, 1]).unwrap(),
            vec![(vec![0], vec![0]), (vec![1], vec![1, 2])]
        );
        assert_eq!(reshape_groups(&[], &[1]).unwrap(), vec![(vec![], vec![0])]);
        assert!(reshape_groups(&[6], &[4]).is_none());
    }

    fn typed(mesh: &Arc<Mesh>, shape: &[usize], spec: PartitionSpec) -> ArrayType {
        let sharding = NamedSharding::new(mesh.clone(), spec).unwrap();
        ArrayType::new(ferrotext_sharding::DType::F32, shape.to_vec(), sharding).unwrap()
    }

    /// A batch of one sharded over a one-device `data` axis (`f32[1@data,8,64]`) splits its last
    /// dim locally and keeps `@data` on the batch dim, as a batch of two does; merging a sharded
    /// minor dim into its major neighbour still needs data from other devices and is refused.
    #[test]
    fn a_batch_of_one_keeps_its_axis_through_a_reshape() {
        let one = Arc::new(Mesh::new([("data", 1, AxisType::Explicit)]).unwrap());
        let two = Arc::new(Mesh::new([("data", 2, AxisType::Explicit)]).unwrap());
        let batch = PartitionSpec::new([DimSpec::from("data")]);
        for (mesh, rows) in [(&one, 1), (&two, 2)] {
            let x = typed(mesh, &[rows, 8, 64], batch.clone());
            let y = reshape_type(&x, &[rows, 8, 4, 16], None).unwrap();
            assert_eq!(y.to_string(), format!("f32[{rows}@data,8,4,16]"));
        }
        let x = typed(
            &two,
            &[2, 8],
            PartitionSpec::new([DimSpec::Replicated, "data".into()]),
        );
        assert!(reshape_type(&x, &[16], None).is_err(), "{x}");
    }
}
