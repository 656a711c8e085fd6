//! The `dot_general` type rule (R3.8–R3.14): output `[batch, lhs free, rhs free]`.
//!
//! Invariants: operands are never unreduced (R3.8); with the output sharding inferred, batch
//! dims sharded on both sides agree (R3.9) and contracting dims are not sharded on both sides;
//! with an `out_sharding`, its unreduced axes are exactly the contracted ones; reduced is never
//! propagated through a dot (R3.14).

use std::collections::BTreeSet;

use ferrotext_sharding::{ArrayType, AxisSet, DimSpec, PartitionSpec};
use ferrotext_tensor::DotDims;

use super::{
    attribute, check_optional_out_sharding, dims_spec, err, fs, make_type, same_dtype, target_type,
    unreduced, TypeResult,
};
use crate::error::TypeErrorKind as K;

fn tuple_repr(dims: &[DimSpec]) -> String {
    ferrotext_sharding::PartitionsRepr(dims.to_vec()).to_string()
}

/// `dot_general` (R3.8–R3.14): output `[batch, lhs free, rhs free]`.
pub fn dot_general_type(
    lhs: &ArrayType,
    rhs: &ArrayType,
    dims: &DotDims,
    out_sharding: Option<&PartitionSpec>,
) -> TypeResult<ArrayType> {
    const OP: &str = "dot_general";
    // R1.13/R1.14/R1.17 first: the reduced set is dropped below (R3.14), but a tag on a
    // non-Explicit axis is still an invalid spec.
    check_optional_out_sharding(OP, lhs, out_sharding)?;
    same_dtype(OP, lhs, rhs)?;
    let shape = dims
        .output_shape(lhs.shape(), rhs.shape())
        .map_err(|e| err(K::ShapeError, OP, &[lhs, rhs], e.to_string()))?;
    if !unreduced(lhs).is_empty() || !unreduced(rhs).is_empty() {
        return Err(err(
            K::UnreducedOperand,
            OP,
            &[lhs, rhs],
            "lhs or rhs passed to dot_general cannot be unreduced (R3.8); reshard it first",
        ));
    }
    let (bl, br) = (
        dims_spec(lhs, &dims.lhs_batch),
        dims_spec(rhs, &dims.rhs_batch),
    );
    // R3.9 binds when the output sharding is inferred (an explicit `out_sharding` decides, as
    // in JAX 0.10.2): a batch dim sharded on both sides must be sharded alike. A batch dim
    // sharded on one side only is accepted, and the output takes the *lhs*'s batch partition,
    // replicated when only the rhs is sharded there (checked on JAX 0.10.2:
    // `[4,8@fsdp,8]·[4@data,8,4]` → `f32[4,8@fsdp,4]`). The op computes such a batch slice by
    // slice and gathers it (`aligned_dot_types` in `dot/layout.rs`).
    let conflicting = bl
        .iter()
        .zip(&br)
        .any(|(l, r)| !l.is_replicated() && !r.is_replicated() && l != r);
    if conflicting && out_sharding.is_none() {
        return Err(err(
            K::BatchMismatch,
            OP,
            &[lhs, rhs],
            format!(
                "dot_general requires lhs batch dimensions and rhs batch dimensions to have the \
                 consistent sharding, got {} and {}.",
                tuple_repr(&bl),
                tuple_repr(&br)
            ),
        ));
    }
    let (cl, cr) = (
        dims_spec(lhs, &dims.lhs_contracting),
        dims_spec(rhs, &dims.rhs_contracting),
    );
    match out_sharding {
        None => dot_inferred_type(lhs, rhs, dims, shape, bl, (&cl, &cr)),
        Some(target) => dot_target_type(lhs, rhs, shape, target, (&cl, &cr)),
    }
}

/// [`dot_general_type`] without `out_sharding`: contracting dims may not both be sharded, the
/// output takes the lhs's batch partitions (`bl`) and each side's free partitions, untagged.
fn dot_inferred_type(
    lhs: &ArrayType,
    rhs: &ArrayType,
    dims: &DotDims,
    shape: Vec<usize>,
    bl: Vec<DimSpec>,
    (cl, cr): (&[DimSpec], &[DimSpec]),
) -> TypeResult<ArrayType> {
    const OP: &str = "dot_general";
    for (l, r) in cl.iter().zip(cr) {
        if !l.is_replicated() && !r.is_replicated() {
            let message = if l == r {
                format!(
                    "Contracting dimensions are sharded and it is ambiguous how the output \
                     should be sharded. Please specify the output sharding via the \
                     `out_sharding` parameter. Got lhs_contracting_spec={} and \
                     rhs_contracting_spec={}",
                    tuple_repr(cl),
                    tuple_repr(cr)
                )
            } else {
                format!(
                    "dot_general requires contracting dimensions to have consistent \
                     sharding, got {} and {}.",
                    tuple_repr(cl),
                    tuple_repr(cr)
                )
            };
            return Err(err(K::AmbiguousContraction, OP, &[lhs, rhs], message));
        }
    }
    let lf = DotDims::free(lhs.rank(), &dims.lhs_batch, &dims.lhs_contracting);
    let rf = DotDims::free(rhs.rank(), &dims.rhs_batch, &dims.rhs_contracting);
    // R3.9: the lhs's batch partitions, whatever the rhs's (checked compatible above).
    let partitions: Vec<DimSpec> = bl
        .into_iter()
        .chain(dims_spec(lhs, &lf))
        .chain(dims_spec(rhs, &rf))
        .collect();
    let mut seen = BTreeSet::new();
    if partitions
        .iter()
        .flat_map(|p| p.axis_names())
        .any(|a| !seen.insert(a.clone()))
    {
        return Err(err(
            K::ShardingMismatch,
            OP,
            &[lhs, rhs],
            format!(
                "dot_general operation produces an illegally sharded result (partitions {}); \
                 pass `out_sharding` or reshard an operand",
                PartitionSpec::new(partitions)
            ),
        ));
    }
    // R3.14: reduced is neither propagated nor checked; the output is untagged.
    make_type(OP, lhs, shape, Ok(PartitionSpec::new(partitions)))
}

/// [`dot_general_type`] with `out_sharding` (`target`): the target decides, its reduced set
/// dropped (R3.14); unreduced axes must be exactly the contracted ones, sharded alike.
fn dot_target_type(
    lhs: &ArrayType,
    rhs: &ArrayType,
    shape: Vec<usize>,
    target: &PartitionSpec,
    (cl, cr): (&[DimSpec], &[DimSpec]),
) -> TypeResult<ArrayType> {
    const OP: &str = "dot_general";
    // R3.14: reduced is not propagated through a dot, not even from `out_sharding`.
    let target = target
        .with_reduced_set(AxisSet::new())
        .map_err(|e| attribute(OP, e.into()))?;
    let out = target_type(OP, lhs, shape, &target)?;
    let u = unreduced(&out);
    if !u.is_empty() {
        if cl != cr {
            return Err(err(
                K::ContractingMismatch,
                OP,
                &[lhs, rhs],
                format!(
                    "lhs and rhs contracting dims should be sharded identically when \
                     out_sharding provided to dot_general mentions unreduced_axes. Got \
                     lhs_contracting_spec={}, rhs_contracting_spec={}",
                    tuple_repr(cl),
                    tuple_repr(cr)
                ),
            ));
        }
        let contracted: AxisSet = cl
            .iter()
            .flat_map(|d| d.axis_names().iter().cloned())
            .collect();
        if *u != contracted {
            return Err(err(
                K::UnreducedNotContracting,
                OP,
                &[lhs, rhs],
                format!(
                    "out_sharding's unreduced axes should be equal to the contracting \
                     specs. Got unreduced axes={} and contracting spec={}",
                    fs(u),
                    tuple_repr(cl)
                ),
            ));
        }
    }
    Ok(out)
}
