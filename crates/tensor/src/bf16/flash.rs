//! Memory-efficient attention on bf16 `q`, `k`, `v` (and the output cotangent): the `f32`
//! kernel ([`flash_attention`], [`flash_attention_backward`]) on the widened inputs, its
//! results rounded to bf16.
//!
//! Invariants:
//! * The output is, bit for bit, `round_bf16` of the `f32` kernel's on the widened inputs; the
//!   log-sum-exps are that kernel's, in `f32`. The cotangents are `round_bf16` of the `f32`
//!   backward on the widened inputs and the widened stored (rounded) output, whose row sums
//!   with the cotangent enter `dS` — as FlashAttention reads its stored output.
//! * Inside, everything is `f32`: the products, the online softmax, the tiles' sums.
//! * The widened inputs are transient `f32` copies made and dropped inside the call: linear in
//!   the sequence, like everything the kernel keeps.
//! * The bits do not depend on `threads` (the `f32` kernel's guarantee).
//!
//! [`flash_attention`]: crate::flash_attention
//! [`flash_attention_backward`]: crate::flash_attention_backward

use super::Bf16Tensor;
use crate::error::TensorError;
use crate::flash::{flash_attention, flash_attention_backward, Flash, KeyRanges, Scores};
use crate::tensor::Tensor;

/// [`flash_attention`](crate::flash_attention) on bf16 `q: [B, Tq, H, dk]`, `k: [B, Tk, KV,
/// dk]`, `v: [B, Tk, KV, dv]`: the output `[B, Tq, H, dv]` rounded to bf16 and the rows'
/// log-sum-exps `[B, H, Tq]` in `f32` (see the module docs for the bits).
///
/// # Errors
/// Shapes that do not fit the layouts or `ranges`.
pub fn flash_attention_bf16(
    q: &Bf16Tensor,
    k: &Bf16Tensor,
    v: &Bf16Tensor,
    ranges: &KeyRanges,
    scores: Scores,
    threads: usize,
) -> Result<(Bf16Tensor, Tensor), TensorError> {
    let _span = ferrotext_profile::span("flash_attention_bf16");
    let Flash { out, lse } = flash_attention(
        &q.widened(),
        &k.widened(),
        &v.widened(),
        ranges,
        scores,
        threads,
    )?;
    Ok((Bf16Tensor::rounded(&out), lse))
}

/// [`flash_attention_backward`](crate::flash_attention_backward) on bf16 `q`, `k`, `v`, the
/// stored bf16 output `out` and output cotangent `dout` `[B, Tq, H, dv]`, with the forward's
/// `f32` log-sum-exps: `(dq, dk, dv)` rounded to bf16 (see the module docs for the bits).
///
/// # Errors
/// Shapes that do not fit the layouts, `ranges`, `out`, `lse` or `dout`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_bf16(
    q: &Bf16Tensor,
    k: &Bf16Tensor,
    v: &Bf16Tensor,
    out: &Bf16Tensor,
    lse: &Tensor,
    dout: &Bf16Tensor,
    ranges: &KeyRanges,
    scores: Scores,
    threads: usize,
) -> Result<(Bf16Tensor, Bf16Tensor, Bf16Tensor), TensorError> {
    let _span = ferrotext_profile::span("flash_attention_backward_bf16");
    let (dq, dk, dv) = flash_attention_backward(
        &q.widened(),
        &k.widened(),
        &v.widened(),
        &out.widened(),
        lse,
        &dout.widened(),
        ranges,
        scores,
        threads,
    )?;
    Ok((
        Bf16Tensor::rounded(&dq),
        Bf16Tensor::rounded(&dk),
        Bf16Tensor::rounded(&dv),
    ))
}
