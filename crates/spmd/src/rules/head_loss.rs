//! The type rule of the tiled LM head's cross-entropy ([`crate::Ctx::head_cross_entropy`]): its
//! options ([`HeadLoss`]) and the operand types it takes. See `head_loss.rs` for the op.

use ferrotext_sharding::{ArrayType, DType, DimSpec};

use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};

/// The op's name in type errors.
pub(crate) const OP: &str = "head_cross_entropy";

/// How [`Ctx::head_cross_entropy`](crate::Ctx::head_cross_entropy) reads its weight and tiles its tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadLoss {
    /// The weight is `[V, d]` (a tied embedding table) rather than `[d, V]`.
    pub transposed: bool,
    /// Weight of the z-loss `(log Z)²` per token (0: none).
    pub z_loss: f32,
    /// Tiles the tokens are cut into (each device's rows, the last tile shorter; at least 1).
    pub tiles: usize,
    /// Each device's own sum (`{U:batch axes}`) instead of the plain total.
    pub partial: bool,
    /// Final-logit soft-capping: each tile's logits become `cap·tanh(z/cap)` before the loss
    /// (Gemma 2), as [`UnaryOp::Softcap`](crate::UnaryOp::Softcap) on the untiled logits.
    pub softcap: Option<f32>,
}

fn type_error(kind: K, xs: &[&ArrayType], message: impl Into<String>) -> SpmdError {
    ShardingTypeError::new(kind, OP, xs, message).into()
}

/// Checks the operand types of the op: `h [.., d]`, `w [d, V]` (or `[V, d]` transposed) whole
/// and f32, targets of `h`'s leading shape and sharding, nothing unreduced.
pub(crate) fn check_types(
    h: &ArrayType,
    w: &ArrayType,
    targets: &ArrayType,
    spec: &HeadLoss,
) -> Result<(), SpmdError> {
    let all = [h, w, targets];
    let d = *h.shape().last().unwrap_or(&0);
    let width = if spec.transposed { 1 } else { 0 };
    if h.rank() < 2
        || w.rank() != 2
        || w.shape()[width] != d
        || targets.shape() != &h.shape()[..h.rank() - 1]
    {
        return Err(type_error(
            K::ShapeError,
            &all,
            "needs h [.., d], w [d, V] (or [V, d] transposed) and targets of h's leading shape",
        ));
    }
    if w.dtype() != DType::F32 {
        return Err(type_error(
            K::ShapeError,
            &all,
            "takes the f32 master weight (it casts it to h's dtype itself)",
        ));
    }
    if h.sharding().dim_parts(h.rank() - 1)? > 1
        || w.sharding()
            .spec()
            .partitions()
            .iter()
            .any(|p| !p.is_replicated())
    {
        return Err(type_error(
            K::ShardingMismatch,
            &all,
            "needs h's width and the whole weight on every device; gather them first",
        ));
    }
    if !h.sharding().spec().unreduced().is_empty() || !w.sharding().spec().unreduced().is_empty() {
        return Err(type_error(
            K::UnreducedOperand,
            &all,
            "cannot take an unreduced operand",
        ));
    }
    let lead = |t: &ArrayType, n: usize| -> Vec<DimSpec> {
        (0..n).map(|i| t.sharding().spec().dim(i).clone()).collect()
    };
    if lead(h, h.rank() - 1) != lead(targets, targets.rank()) {
        return Err(type_error(
            K::ShardingMismatch,
            &all,
            "targets must have h's leading shape and sharding",
        ));
    }
    Ok(())
}
