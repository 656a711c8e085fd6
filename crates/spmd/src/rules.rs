//! The explicit-sharding type rules: for each op, its output type from its operand types, or the
//! typed error. Pure functions of types: the same in real and abstract mode, raised before any
//! compute or communication.
//!
//! Rule ids (R3.x) are those of `docs/sharding-rules.md`; where ferrotext deviates from JAX
//! (docs/design.md §4, items 1–5) the code says which item.

use std::collections::BTreeSet;
use std::sync::Arc;

use ferrotext_sharding::{ArrayType, AxisSet, DimSpec, Mesh, NamedSharding, PartitionSpec};
use ferrotext_tensor::DotDims;

use crate::error::{ShardingTypeError, TypeErrorKind as K};

type TypeResult<T> = Result<T, ShardingTypeError>;

fn err(
    kind: K,
    op: &str,
    operands: &[&ArrayType],
    message: impl Into<String>,
) -> ShardingTypeError {
    ShardingTypeError::new(kind, op, operands, message)
}

/// Python-style frozenset text for messages.
fn fs(set: &AxisSet) -> String {
    let items: Vec<String> = set.iter().map(|a| format!("'{a}'")).collect();
    format!("frozenset({{{}}})", items.join(", "))
}

/// Axes used by partitions.
pub(crate) fn sharded_axes(t: &ArrayType) -> AxisSet {
    t.sharding()
        .spec()
        .partition_axes()
        .map(str::to_string)
        .collect()
}

fn unreduced(t: &ArrayType) -> &AxisSet {
    t.sharding().spec().unreduced()
}

fn reduced(t: &ArrayType) -> &AxisSet {
    t.sharding().spec().reduced()
}

/// Builds a type, mapping sharding errors to typed ones attributed to `op`.
pub(crate) fn make_type(
    op: &str,
    template: &ArrayType,
    shape: Vec<usize>,
    spec: TypeResult<PartitionSpec>,
) -> TypeResult<ArrayType> {
    let named = NamedSharding::new(template.sharding().mesh().clone(), spec?)
        .map_err(|e| attribute(op, e.into()))?;
    ArrayType::new(template.dtype(), shape, named).map_err(|e| attribute(op, e.into()))
}

fn attribute(op: &str, mut e: ShardingTypeError) -> ShardingTypeError {
    e.op = op.to_string();
    e
}

fn spec_of(
    op: &str,
    partitions: Vec<DimSpec>,
    u: AxisSet,
    r: AxisSet,
) -> TypeResult<PartitionSpec> {
    PartitionSpec::tagged(partitions, u, r).map_err(|e| attribute(op, e.into()))
}

/// Checks a user-given target sharding (an `out_sharding`, a `reshard` target) against `mesh`
/// alone: every axis exists (R1.11, R1.12, R1.15), tags name only `Explicit` axes (R1.13,
/// R1.14), no axis is used twice (R1.16), and partitions name only `Explicit` axes (R1.17).
///
/// Every op that takes an `out_sharding` calls this first, before its own rules (and before
/// its shape checks): JAX canonicalises the sharding at the API boundary, so a tag on an Auto or
/// Manual axis is an `invalid_spec` whatever else is wrong with the call.
///
/// # Errors
/// `invalid_spec`, attributed to `op`, with the texts of R1.11–R1.17.
pub fn check_out_sharding(op: &str, mesh: &Arc<Mesh>, spec: &PartitionSpec) -> TypeResult<()> {
    let named =
        NamedSharding::new(mesh.clone(), spec.clone()).map_err(|e| attribute(op, e.into()))?;
    named
        .check_explicit_for(op)
        .map_err(|e| attribute(op, e.into()))
}

/// [`check_out_sharding`] for an optional `out_sharding` on `template`'s mesh.
fn check_optional_out_sharding(
    op: &str,
    template: &ArrayType,
    out_sharding: Option<&PartitionSpec>,
) -> TypeResult<()> {
    match out_sharding {
        Some(spec) => check_out_sharding(op, template.sharding().mesh(), spec),
        None => Ok(()),
    }
}

/// Checks a user-given target sharding (`out_sharding`, a `reshard` target) on `mesh` for an array
/// of `shape`: valid (R1.7–R1.16), explicit axes only (R1.17), fits the shape
/// (docs/sharding-rules.md §1.4).
pub(crate) fn target_type(
    op: &str,
    template: &ArrayType,
    shape: Vec<usize>,
    spec: &PartitionSpec,
) -> TypeResult<ArrayType> {
    let named = NamedSharding::new(template.sharding().mesh().clone(), spec.clone())
        .map_err(|e| attribute(op, e.into()))?;
    named
        .check_explicit_for(op)
        .map_err(|e| attribute(op, e.into()))?;
    ArrayType::new(template.dtype(), shape, named).map_err(|e| attribute(op, e.into()))
}

// ---------------------------------------------------------------------------------------------
// Elementwise

/// Unary ops: reduced passes through (R4.13); unreduced only for linear ops (docs/design.md §4.1:
/// `neg`, scaling by a constant), everything else rejects it (R3.0, docs/sharding-rules.md §3.2).
pub fn unary_type(op: &str, linear: bool, x: &ArrayType) -> TypeResult<ArrayType> {
    if !linear && !unreduced(x).is_empty() {
        return Err(err(
            K::UnreducedOperand,
            op,
            &[x],
            format!(
                "`{op}` cannot take an unreduced operand (only linear ops can); call `reshard` to \
                 reduce it first"
            ),
        ));
    }
    Ok(x.clone())
}

/// The binary elementwise ops and how they treat unreduced operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`: unreduced sets must be equal (docs/sharding-rules.md §3.2).
    Add,
    /// `a - b`: typed like `add` (docs/design.md §4.1).
    Sub,
    /// `a * b`: bilinear; an unreduced side needs the other reduced on the same axes
    /// (docs/sharding-rules.md §3.2).
    Mul,
    /// `a / b`: like `mul`, and the denominator may not be unreduced (docs/sharding-rules.md §3.2,
    /// div).
    Div,
    /// `max(a, b)`: rejects unreduced (R3.6).
    Max,
}

impl BinaryOp {
    /// The op's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Max => "max",
        }
    }
}

/// The typing of a binary op: the output type, and the shape both operands are broadcast to.
#[derive(Clone, Debug)]
pub struct BinaryTyping {
    /// The result type.
    pub out: ArrayType,
}

/// Binary elementwise ops with NumPy broadcasting (docs/sharding-rules.md §3.1, §3.2, with
/// docs/design.md §4.1–4.2).
pub fn binary_type(op: BinaryOp, a: &ArrayType, b: &ArrayType) -> TypeResult<BinaryTyping> {
    let name = op.name();
    // 0. Shapes broadcast (right-aligned).
    let shape = ferrotext_tensor::broadcast_shapes(a.shape(), b.shape()).map_err(|_| {
        err(
            K::ShapeError,
            name,
            &[a, b],
            format!(
                "shapes {:?} and {:?} do not broadcast",
                a.shape(),
                b.shape()
            ),
        )
    })?;
    let rank = shape.len();
    // 1. Partitions: a dimension sharded on one side takes that sharding; sharded differently
    //    on both sides is an error, as is an axis used twice in the result.
    let dim_of = |t: &ArrayType, d: usize| -> DimSpec {
        match (d + t.rank()).checked_sub(rank) {
            Some(i) if t.shape()[i] == shape[d] => t.sharding().spec().dim(i).clone(),
            _ => DimSpec::Replicated,
        }
    };
    let mut partitions = Vec::with_capacity(rank);
    let mut illegal = false;
    for d in 0..rank {
        let (x, y) = (dim_of(a, d), dim_of(b, d));
        partitions.push(match (x.is_replicated(), y.is_replicated()) {
            (_, true) => x,
            (true, false) => y,
            (false, false) => {
                if x != y {
                    illegal = true;
                }
                x
            }
        });
    }
    let mut seen = BTreeSet::new();
    illegal |= partitions
        .iter()
        .flat_map(|p| p.axis_names())
        .any(|axis| !seen.insert(axis.clone()));
    if illegal {
        let shown = PartitionSpec::new(partitions.clone());
        return Err(err(
            K::ShardingMismatch,
            name,
            &[a, b],
            format!(
                "{name} operation produces an illegally sharded result (partitions {shown}); \
                 reshard one operand so both agree"
            ),
        ));
    }
    // 2. Reduced (R3.1–R3.5). docs/design.md §4.2: a reduced operand next to an operand sharded
    //    on the same axis is sliced locally, so that axis leaves its reduced set first.
    let (sa, sb) = (sharded_axes(a), sharded_axes(b));
    let scalar_promotes = |t: &ArrayType| t.rank() == 0 && !t.sharding().spec().is_tagged();
    let mut ra: AxisSet = reduced(a).difference(&sb).cloned().collect();
    let mut rb: AxisSet = reduced(b).difference(&sa).cloned().collect();
    // R3.4: a rank-0 untagged operand is cast to the other's reduced set (free).
    if scalar_promotes(a) && !rb.is_empty() {
        ra = rb.clone();
    }
    if scalar_promotes(b) && !ra.is_empty() {
        rb = ra.clone();
    }
    let nonempty: Vec<&AxisSet> = [&ra, &rb].into_iter().filter(|s| !s.is_empty()).collect();
    if nonempty.len() == 2 && nonempty[0] != nonempty[1] {
        return Err(err(
            K::ReducedConflict,
            name,
            &[a, b],
            format!(
                "All inputs should be reduced across the same mesh axes. Got specs: {{{}, {}}}",
                fs(&ra),
                fs(&rb)
            ),
        ));
    }
    let r: AxisSet = nonempty.first().map(|s| (*s).clone()).unwrap_or_default();
    for (t, rt) in [(a, &ra), (b, &rb)] {
        let replicated_on_r = r
            .iter()
            .any(|axis| !rt.contains(axis) && !unreduced(t).contains(axis));
        if replicated_on_r {
            return Err(err(
                K::ReducedConflict,
                name,
                &[a, b],
                format!(
                    "Inputs cannot be replicated on the same axes that another input is reduced on \
                     (its gradient would need a hidden reduction). Got input type: {t} and reduced \
                     spec: {}",
                    fs(&r)
                ),
            ));
        }
    }
    // 3. Unreduced, per op.
    let (ua, ub) = (unreduced(a), unreduced(b));
    let (u, r) = match op {
        BinaryOp::Add | BinaryOp::Sub => {
            if ua != ub {
                let message = match (ua.is_empty(), ub.is_empty()) {
                    (false, true) | (true, false) => {
                        let side = if ub.is_empty() {
                            ("lhs", "rhs")
                        } else {
                            ("rhs", "lhs")
                        };
                        format!(
                            "{} is unreduced while {} is not. `{name}` operation does not allow \
                             this because there will be implicit communication. Please reduce {} \
                             via `reshard` before calling `{name}`.",
                            side.0, side.1, side.0
                        )
                    }
                    _ => format!(
                        "lhs and rhs to `{name}` must be unreduced along the same mesh axes. Got \
                         lhs={}, rhs={}",
                        fs(ua),
                        fs(ub)
                    ),
                };
                return Err(err(K::UnreducedMismatch, name, &[a, b], message));
            }
            (ua.clone(), r)
        }
        BinaryOp::Mul | BinaryOp::Div => {
            if op == BinaryOp::Div && !ub.is_empty() {
                return Err(err(
                    K::UnreducedOperand,
                    name,
                    &[a, b],
                    "The denominator cannot be unreduced passed to `div`",
                ));
            }
            if !ua.is_empty() && !ub.is_empty() {
                return Err(err(
                    K::UnreducedOperand,
                    name,
                    &[a, b],
                    format!(
                        "lhs and rhs to `{name}` cannot be unreduced since {name} is bilinear. Got \
                         lhs={}, rhs={}",
                        fs(ua),
                        fs(ub)
                    ),
                ));
            }
            let (u, other_reduced, which) = if !ua.is_empty() {
                (ua, &rb, ("RHS", "LHS"))
            } else {
                (ub, &ra, ("LHS", "RHS"))
            };
            if !u.is_empty() && u != other_reduced {
                return Err(err(
                    K::UnreducedMismatch,
                    name,
                    &[a, b],
                    format!(
                        "{} should be reduced along the same axes {} is unreduced on (scaling a \
                         partial sum by anything else changes its sum)",
                        which.0, which.1
                    ),
                ));
            }
            let r = r.difference(u).cloned().collect();
            (u.clone(), r)
        }
        BinaryOp::Max => {
            if !ua.is_empty() || !ub.is_empty() {
                return Err(err(
                    K::UnreducedOperand,
                    name,
                    &[a, b],
                    format!("`{name}` cannot take an unreduced operand; call `reshard` first"),
                ));
            }
            (AxisSet::new(), r)
        }
    };
    let out = make_type(name, a, shape, spec_of(name, partitions, u, r))?;
    Ok(BinaryTyping { out })
}

// ---------------------------------------------------------------------------------------------
// dot_general

fn dims_spec(t: &ArrayType, dims: &[usize]) -> Vec<DimSpec> {
    dims.iter()
        .map(|&d| t.sharding().spec().dim(d).clone())
        .collect()
}

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
    // slice and gathers it (ops::aligned_dot_types).
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
        None => {
            for (l, r) in cl.iter().zip(&cr) {
                if !l.is_replicated() && !r.is_replicated() {
                    let message = if l == r {
                        format!(
                            "Contracting dimensions are sharded and it is ambiguous how the output \
                             should be sharded. Please specify the output sharding via the \
                             `out_sharding` parameter. Got lhs_contracting_spec={} and \
                             rhs_contracting_spec={}",
                            tuple_repr(&cl),
                            tuple_repr(&cr)
                        )
                    } else {
                        format!(
                            "dot_general requires contracting dimensions to have consistent \
                             sharding, got {} and {}.",
                            tuple_repr(&cl),
                            tuple_repr(&cr)
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
        Some(target) => {
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
                            tuple_repr(&cl),
                            tuple_repr(&cr)
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
                            tuple_repr(&cl)
                        ),
                    ));
                }
            }
            Ok(out)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// reduce_sum

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
        if sharded.len() > 1 || major_in != Some(d) {
            return None;
        }
        let target = major_out?;
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

/// `transpose`: partitions permute, tags pass through (docs/sharding-rules.md §3.5).
pub fn transpose_type(x: &ArrayType, perm: &[usize]) -> TypeResult<ArrayType> {
    const OP: &str = "transpose";
    let mut seen = vec![false; x.rank()];
    if perm.len() != x.rank()
        || perm
            .iter()
            .any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true))
    {
        return Err(err(
            K::ShapeError,
            OP,
            &[x],
            format!("{perm:?} is not a permutation of {} dimensions", x.rank()),
        ));
    }
    let spec = x.sharding().spec();
    let partitions: Vec<DimSpec> = perm.iter().map(|&p| spec.dim(p).clone()).collect();
    let shape = perm.iter().map(|&p| x.shape()[p]).collect();
    make_type(
        OP,
        x,
        shape,
        spec_of(
            OP,
            partitions,
            spec.unreduced().clone(),
            spec.reduced().clone(),
        ),
    )
}

/// `reshard` (R5.1): any transition is legal; the target must be valid, explicit and fit.
pub fn reshard_type(x: &ArrayType, target: &PartitionSpec) -> TypeResult<ArrayType> {
    check_out_sharding("reshard", x.sharding().mesh(), target)?;
    target_type("reshard", x, x.shape().to_vec(), target)
}

/// The type of an operand or a leaf from its parts (conformance and tests).
///
/// # Errors
/// The sharding error, typed.
pub fn array_type(
    mesh: &Arc<Mesh>,
    dtype: ferrotext_sharding::DType,
    shape: Vec<usize>,
    spec: PartitionSpec,
) -> TypeResult<ArrayType> {
    let named = NamedSharding::new(mesh.clone(), spec).map_err(|e| attribute("spec", e.into()))?;
    ArrayType::new(dtype, shape, named).map_err(|e| attribute("spec", e.into()))
}

#[cfg(test)]
mod tests {
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
}
