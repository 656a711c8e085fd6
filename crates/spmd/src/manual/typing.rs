//! The type rules inside a `shard_map` region (docs/sharding-rules.md §6.2–§6.3): the per-axis
//! states of a value ([`AxisState`]: varying, invarying, unreduced, reduced, carried by
//! [`ManualTags`]), and the result types of the local ops — elementwise (R6.9, R6.11, R6.12),
//! `dot_general` (R3.14: reduced is not propagated) and the shape ops, which keep their operand's
//! tags.
//!
//! Every function here is pure: it checks types and builds types, never data or collectives.

use std::sync::Arc;

use ferrotext_sharding::{ArrayType, AxisSet, AxisType, ManualTags, Mesh, PartitionSpec};
use ferrotext_tensor::{DotDims, Tensor};

use crate::array::Array;
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::rules::{self, BinaryOp};

/// The state of a value along some manual axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisState {
    /// Devices hold different values.
    Varying,
    /// Devices hold the same value.
    Invarying,
    /// Devices hold partial sums.
    Unreduced,
    /// Devices hold the same value; its gradient is unreduced.
    Reduced,
}

impl AxisState {
    pub(super) fn name(self) -> &'static str {
        match self {
            AxisState::Varying => "varying",
            AxisState::Invarying => "invarying",
            AxisState::Unreduced => "unreduced",
            AxisState::Reduced => "reduced",
        }
    }
}

pub(super) fn set(axes: &[String]) -> AxisSet {
    axes.iter().cloned().collect()
}

pub(super) fn type_error(
    kind: K,
    op: &str,
    x: &ArrayType,
    message: impl Into<String>,
) -> SpmdError {
    ShardingTypeError::new(kind, op, &[x], message).into()
}

/// The state of `t` along `axes` (all must agree).
pub(super) fn state_of(op: &str, t: &ArrayType, axes: &[String]) -> Result<AxisState, SpmdError> {
    let m = t.manual_tags();
    let state = |a: &String| {
        if m.varying().contains(a) {
            AxisState::Varying
        } else if m.unreduced().contains(a) {
            AxisState::Unreduced
        } else if m.reduced().contains(a) {
            AxisState::Reduced
        } else {
            AxisState::Invarying
        }
    };
    let first = axes.first().map(state).unwrap_or(AxisState::Invarying);
    if axes.iter().any(|a| state(a) != first) {
        return Err(type_error(
            K::InvalidSpec,
            op,
            t,
            format!(
                "`{op}` can only accept axis names which all correspond to one of varying, \
                 unreduced, reduced or invarying state of the input; got axes {axes:?}"
            ),
        ));
    }
    Ok(first)
}

/// `t`'s tags with `axes` moved to `state`.
pub(super) fn with_state(
    t: &ArrayType,
    axes: &[String],
    state: AxisState,
) -> Result<ManualTags, SpmdError> {
    let m = t.manual_tags();
    let axes = set(axes);
    let strip = |s: &AxisSet| -> AxisSet { s.difference(&axes).cloned().collect() };
    let (mut v, mut u, mut r) = (strip(m.varying()), strip(m.unreduced()), strip(m.reduced()));
    match state {
        AxisState::Varying => v.extend(axes),
        AxisState::Unreduced => u.extend(axes),
        AxisState::Reduced => r.extend(axes),
        AxisState::Invarying => {}
    }
    Ok(ManualTags::new(v, u, r)?)
}

pub(super) fn manual_type(
    template: &ArrayType,
    shape: Vec<usize>,
    tags: ManualTags,
) -> Result<ArrayType, SpmdError> {
    Ok(ArrayType::manual(
        template.dtype(),
        shape,
        template.sharding().mesh().clone(),
        tags,
    )?)
}

/// The mesh with every axis `Manual`.
pub(super) fn manual_mesh(mesh: &Mesh) -> Result<Arc<Mesh>, SpmdError> {
    Ok(Arc::new(mesh.with_all_axis_types(AxisType::Manual)))
}

pub(crate) fn manual_unary_type(
    op: &str,
    linear: bool,
    x: &ArrayType,
) -> Result<ArrayType, SpmdError> {
    if !linear && !x.manual_tags().unreduced().is_empty() {
        return Err(type_error(
            K::UnreducedOperand,
            op,
            x,
            format!("unreduced rule for {op} is not implemented (only linear ops take unreduced values, R6.12)"),
        ));
    }
    Ok(x.clone())
}

/// The type of the elementwise `op` of `a` and `b` inside a region: equal varying axes (R6.9),
/// the reduced rules of R3.1/R3.2, and the unreduced rules of R6.12 per op.
///
/// # Errors
/// `shape_error`, `sharding_mismatch`, `reduced_conflict`, `unreduced_mismatch` or
/// `unreduced_operand`, naming the op.
pub(crate) fn manual_binary_type(
    op: BinaryOp,
    a: &ArrayType,
    b: &ArrayType,
) -> Result<ArrayType, SpmdError> {
    let name = op.name();
    crate::rules::same_dtype(name, a, b)?;
    let shape = ferrotext_tensor::broadcast_shapes(a.shape(), b.shape())
        .map_err(|e| ShardingTypeError::new(K::ShapeError, name, &[a, b], e.to_string()))?;
    let (ma, mb) = (a.manual_tags(), b.manual_tags());
    if ma.varying() != mb.varying() {
        return Err(ShardingTypeError::new(
            K::ShardingMismatch,
            name,
            &[a, b],
            format!("Primitive {name} requires varying manual axes to match (R6.9)"),
        )
        .into());
    }
    // R3.1/R3.2 inside (R6.11).
    let r = common_reduced(name, (a, b), (ma, mb))?;
    let (ua, ub) = (ma.unreduced(), mb.unreduced());
    let (u, r) = match op {
        BinaryOp::Add | BinaryOp::Sub => {
            if ua != ub {
                return Err(ShardingTypeError::new(
                    K::UnreducedMismatch,
                    name,
                    &[a, b],
                    format!("lhs and rhs to `{name}` must be unreduced along the same mesh axes"),
                )
                .into());
            }
            (ua.clone(), r)
        }
        BinaryOp::Mul | BinaryOp::Div => {
            if !ub.is_empty() && (op == BinaryOp::Div || !ua.is_empty()) {
                return Err(ShardingTypeError::new(
                    K::UnreducedOperand,
                    name,
                    &[a, b],
                    format!("`{name}` cannot take these unreduced operands"),
                )
                .into());
            }
            let (u, other_r) = if !ua.is_empty() {
                (ua, mb.reduced())
            } else {
                (ub, ma.reduced())
            };
            if !u.is_empty() && u != other_r {
                return Err(ShardingTypeError::new(
                    K::UnreducedMismatch,
                    name,
                    &[a, b],
                    "the other operand should be reduced along the same axes this one is unreduced on",
                )
                .into());
            }
            (u.clone(), r.difference(u).cloned().collect())
        }
        BinaryOp::Max => {
            if !ua.is_empty() || !ub.is_empty() {
                return Err(ShardingTypeError::new(
                    K::UnreducedOperand,
                    name,
                    &[a, b],
                    "`max` cannot take an unreduced operand",
                )
                .into());
            }
            (AxisSet::new(), r)
        }
    };
    manual_type(a, shape, ManualTags::new(ma.varying().clone(), u, r)?)
}

/// The reduced axes of a binary op's result inside a region (R3.1/R3.2 via R6.11): the
/// operands' nonempty reduced sets must agree, and no operand may be replicated (neither
/// reduced nor unreduced) on an axis the other is reduced on.
fn common_reduced(
    name: &str,
    (a, b): (&ArrayType, &ArrayType),
    (ma, mb): (&ManualTags, &ManualTags),
) -> Result<AxisSet, SpmdError> {
    let nonempty: Vec<&AxisSet> = [ma.reduced(), mb.reduced()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    if nonempty.len() == 2 && nonempty[0] != nonempty[1] {
        return Err(ShardingTypeError::new(
            K::ReducedConflict,
            name,
            &[a, b],
            "All inputs should be reduced across the same mesh axes",
        )
        .into());
    }
    let r: AxisSet = nonempty.first().map(|s| (*s).clone()).unwrap_or_default();
    for m in [ma, mb] {
        if r.iter()
            .any(|x| !m.reduced().contains(x) && !m.unreduced().contains(x))
        {
            return Err(ShardingTypeError::new(
                K::ReducedConflict,
                name,
                &[a, b],
                "Inputs cannot be replicated on the same axes that another input is reduced on",
            )
            .into());
        }
    }
    Ok(r)
}

/// The type of `dot_general(lhs, rhs, dims)` inside a region: neither operand unreduced, equal
/// varying axes (R6.9), and no reduced axes on the result (R3.14).
///
/// # Errors
/// `unreduced_operand`, `sharding_mismatch` (varying axes differ) or `shape_error`.
pub(crate) fn manual_dot_type(
    l: &ArrayType,
    r: &ArrayType,
    dims: &DotDims,
) -> Result<ArrayType, SpmdError> {
    if !l.manual_tags().unreduced().is_empty() || !r.manual_tags().unreduced().is_empty() {
        return Err(ShardingTypeError::new(
            K::UnreducedOperand,
            "dot_general",
            &[l, r],
            "lhs or rhs passed to dot_general cannot be unreduced",
        )
        .into());
    }
    if l.manual_tags().varying() != r.manual_tags().varying() {
        return Err(ShardingTypeError::new(
            K::ShardingMismatch,
            "dot_general",
            &[l, r],
            "varying manual axes must match (R6.9)",
        )
        .into());
    }
    let shape = dims.output_shape(l.shape(), r.shape()).map_err(|e| {
        ShardingTypeError::new(K::ShapeError, "dot_general", &[l, r], e.to_string())
    })?;
    // R3.14: reduced is not propagated through a dot.
    let tags = ManualTags::new(
        l.manual_tags().varying().clone(),
        AxisSet::new(),
        AxisSet::new(),
    )?;
    manual_type(l, shape, tags)
}

/// A local op's result inside a region: `shape` and `local`, with `x`'s tags.
pub(crate) fn manual_local(
    x: &Array,
    shape: Vec<usize>,
    local: Option<Tensor>,
) -> Result<Array, SpmdError> {
    Ok(Array::new(
        manual_type(x.ty(), shape, x.ty().manual_tags().clone())?,
        local,
    ))
}

/// Inside a region every op is local: an output sharding has no meaning there. A tag on a Manual
/// axis is still first of all an invalid spec (R1.13, R1.14), as it is outside a region.
pub(crate) fn manual_without_out_sharding(
    op: &'static str,
    x: &Array,
    out_sharding: Option<&PartitionSpec>,
) -> Result<(), SpmdError> {
    match out_sharding {
        None => Ok(()),
        Some(spec) => {
            rules::check_out_sharding(op, x.ty().sharding().mesh(), spec)?;
            Err(SpmdError::OutShardingInManual {
                op,
                spec: spec.to_string(),
            })
        }
    }
}
