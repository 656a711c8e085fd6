//! The explicit-sharding type rules: for each op, its output type from its operand types, or the
//! typed error. Pure functions of types: the same in real and abstract mode, raised before any
//! compute or communication.
//!
//! Rule ids (R3.x) are those of `docs/sharding-rules.md`; where ferrotext deviates from JAX
//! (docs/design.md §4, items 1–5) the code says which item.
//!
//! One file per op family: `elementwise` (unary, binary), `dot` (`dot_general`), `shape`
//! (`reduce_sum`, `broadcast_in_dim`, `reshape`); here, the helpers they share, the target checks
//! of `out_sharding` / `reshard`, and `transpose`. Every rule is a pure function of types and
//! checks in a fixed order, so the first error reported does not depend on the file layout.

use std::sync::Arc;

use ferrotext_sharding::{ArrayType, AxisSet, DType, DimSpec, Mesh, NamedSharding, PartitionSpec};

use crate::error::{ShardingTypeError, TypeErrorKind as K};

mod dot;
mod elementwise;
pub(crate) mod head_loss;
mod shape;

pub use dot::dot_general_type;
pub use elementwise::{binary_type, unary_type, BinaryOp, BinaryTyping, UnaryOp};
pub(crate) use shape::local_reshape_partitions;
pub use shape::{broadcast_in_dim_type, reduce_sum_type, reshape_type};

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

/// `e` reported as `op`'s own: a rule borrowed by another op (a fused op's `mul`), or a
/// sharding built for it.
pub(crate) fn attribute(op: &str, mut e: ShardingTypeError) -> ShardingTypeError {
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

/// The partitions of `t`'s dimensions `dims`, in order.
fn dims_spec(t: &ArrayType, dims: &[usize]) -> Vec<DimSpec> {
    dims.iter()
        .map(|&d| t.sharding().spec().dim(d).clone())
        .collect()
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

/// Operands of one dtype, as the binary ops and `dot_general` take them: mixed precision
/// converts explicitly (`Ctx::convert`), so every rounding is visible in the program.
pub(crate) fn same_dtype(op: &str, a: &ArrayType, b: &ArrayType) -> TypeResult<()> {
    if a.dtype() == b.dtype() {
        return Ok(());
    }
    Err(err(
        K::DTypeMismatch,
        op,
        &[a, b],
        format!(
            "operands are {} and {}: convert one first (there is no implicit promotion)",
            a.dtype(),
            b.dtype()
        ),
    ))
}

/// `cast`'s type: `x` with `dtype`, between `f32` and `bf16` only (the dtypes ferrotext computes
/// in).
pub(crate) fn cast_type(x: &ArrayType, dtype: DType) -> TypeResult<ArrayType> {
    let computes = |d: DType| matches!(d, DType::F32 | DType::BF16);
    if computes(x.dtype()) && computes(dtype) {
        return Ok(x.with_dtype(dtype));
    }
    Err(err(
        K::DTypeMismatch,
        "cast",
        &[x],
        format!(
            "{} to {dtype} is not a conversion ferrotext computes (f32 and bf16 only)",
            x.dtype()
        ),
    ))
}
