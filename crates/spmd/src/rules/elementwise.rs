//! The elementwise type rules: unary ops and the binary ops with NumPy broadcasting
//! (docs/sharding-rules.md §3.1–3.2, docs/design.md §4.1–4.2).
//!
//! Invariants: a binary op's checks run in a fixed order — shapes broadcast, partitions agree,
//! reduced sets agree (R3.1–R3.5), then the op's own unreduced rule — so the first error a
//! caller sees does not depend on which step was split out; only linear ops take unreduced
//! operands.

use std::collections::BTreeSet;

use ferrotext_sharding::{ArrayType, AxisSet, DimSpec, PartitionSpec};

use super::{
    err, fs, make_type, reduced, same_dtype, sharded_axes, spec_of, unreduced, TypeResult,
};
use crate::error::TypeErrorKind as K;

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

/// Elementwise unary ops.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// `-x` (linear: accepts unreduced, docs/design.md §4.1).
    Neg,
    /// `k·x` for a constant `k` that is not differentiated (linear: accepts unreduced).
    Scale(f32),
    /// `eˣ`.
    Exp,
    /// `ln x`.
    Log,
    /// `sin x`.
    Sin,
    /// `cos x`.
    Cos,
    /// `tanh x`.
    Tanh,
    /// `x²`.
    Square,
    /// `1/√x`.
    Rsqrt,
    /// `x·σ(x)` (SiLU).
    Silu,
    /// `σ(x) = 1/(1+e⁻ˣ)` (DeepSeek's router score).
    Sigmoid,
    /// `x + c` for a constant `c` that is not differentiated (Gemma's `1 + w` norm scale). Not
    /// linear: `c` would be added once per partial sum, so an unreduced operand is refused.
    Shift(f32),
    /// GELU with the tanh approximation, `½x(1 + tanh(√(2/π)(x + 0.044715x³)))` (Gemma's
    /// `gelu_pytorch_tanh`).
    GeluTanh,
    /// Soft-capping `c·tanh(x/c)` for a constant `c > 0` (Gemma 2's logits).
    Softcap(f32),
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
    same_dtype(name, a, b)?;
    let shape = broadcast_shape(name, a, b)?;
    let partitions = binary_partitions(name, a, b, &shape)?;
    let (ra, rb, r) = binary_reduced(name, a, b)?;
    let (u, r) = binary_unreduced(op, a, b, (&ra, &rb), r)?;
    let out = make_type(name, a, shape, spec_of(name, partitions, u, r))?;
    Ok(BinaryTyping { out })
}

/// Step 0 of [`binary_type`]: the shapes broadcast (right-aligned).
fn broadcast_shape(name: &str, a: &ArrayType, b: &ArrayType) -> TypeResult<Vec<usize>> {
    ferrotext_tensor::broadcast_shapes(a.shape(), b.shape()).map_err(|_| {
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
    })
}

/// Step 1 of [`binary_type`]: the partitions. A dimension sharded on one side takes that
/// sharding; sharded differently on both sides is an error, as is an axis used twice in the
/// result.
fn binary_partitions(
    name: &str,
    a: &ArrayType,
    b: &ArrayType,
    shape: &[usize],
) -> TypeResult<Vec<DimSpec>> {
    let rank = shape.len();
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
    Ok(partitions)
}

/// Step 2 of [`binary_type`]: each side's reduced set after local slicing, and the result's
/// (R3.1–R3.5).
fn binary_reduced(
    name: &str,
    a: &ArrayType,
    b: &ArrayType,
) -> TypeResult<(AxisSet, AxisSet, AxisSet)> {
    // docs/design.md §4.2: a reduced operand next to an operand sharded on the same axis is
    // sliced locally, so that axis leaves its reduced set first.
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
    Ok((ra, rb, r))
}

/// Step 3 of [`binary_type`]: the unreduced set, per op, and the reduced set `r` less the axes
/// a product's unreduced side consumes.
fn binary_unreduced(
    op: BinaryOp,
    a: &ArrayType,
    b: &ArrayType,
    (ra, rb): (&AxisSet, &AxisSet),
    r: AxisSet,
) -> TypeResult<(AxisSet, AxisSet)> {
    let name = op.name();
    let (ua, ub) = (unreduced(a), unreduced(b));
    Ok(match op {
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
                (ua, rb, ("RHS", "LHS"))
            } else {
                (ub, ra, ("LHS", "RHS"))
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
    })
}
