//! Fused causal attention on bf16 `q`, `k`, `v` (and the output cotangent): the `f32` kernel
//! ([`causal_attention`], [`causal_attention_backward`]) on the widened inputs, its results
//! rounded to bf16.
//!
//! Invariants:
//! * Each output is, bit for bit, `round_bf16` of the `f32` kernel on the widened inputs, on
//!   every product kernel (it is that kernel). Inside, everything is `f32`: the products, the
//!   softmax and its backward, the probabilities (kept in `f32` for the backward) and a GQA
//!   group's `dk`, `dv` sums.
//! * The widened inputs are transient `f32` copies of `q`, `k`, `v` (and `dout`), made and
//!   dropped inside the call: together they are `4·T·(H·dk + KV·(dk + dv))` bytes a batch row,
//!   a fraction of the `f32` probabilities (`4·H·T²`) the forward keeps. Widening whole tensors
//!   (vectorized, on the kernel budget) and running the `f32` kernel's strided views cost less
//!   than widening each head into scratch of its own: at qwen3-peer that per-head version took
//!   20.3 ms a step against 13.6 ms for the `f32` kernel.
//! * The bits do not depend on `threads` (the `f32` kernel's guarantee).
//! * The widening and rounding are the kernel's own work, counted in its profiler span (not as
//!   `widen_bf16` / `round_bf16`, which mark a caller converting a whole value).
//!
//! [`causal_attention`]: crate::causal_attention
//! [`causal_attention_backward`]: crate::causal_attention_backward

use super::Bf16Tensor;
use crate::attention::{causal_attention, causal_attention_backward, Attention, Dims};
use crate::error::TensorError;
use crate::tensor::Tensor;

/// [`causal_attention`](crate::causal_attention) on bf16 `q: [B, T, H, dk]`, `k: [B, T, KV,
/// dk]`, `v: [B, T, KV, dv]`: the output `[B, T, H, dv]` rounded to bf16 and the probabilities
/// `[B, H, T, T]` in `f32` for the backward (see the module docs for the bits).
///
/// # Errors
/// Shapes that do not fit the layouts.
pub fn causal_attention_bf16(
    q: &Bf16Tensor,
    k: &Bf16Tensor,
    v: &Bf16Tensor,
    scale: f32,
    threads: usize,
) -> Result<(Bf16Tensor, Tensor), TensorError> {
    Dims::of(q.shape(), k.shape(), v.shape(), "causal_attention_bf16")?;
    let _span = ferrotext_profile::span("causal_attention_bf16");
    let Attention { out, probs } =
        causal_attention(&q.widened(), &k.widened(), &v.widened(), scale, threads)?;
    Ok((Bf16Tensor::rounded(&out), probs))
}

/// [`causal_attention_backward`](crate::causal_attention_backward) on bf16 `q`, `k`, `v` and
/// output cotangent `dout` `[B, T, H, dv]`, with the forward's `f32` probabilities: `(dq, dk,
/// dv)` rounded to bf16 (see the module docs for the bits).
///
/// # Errors
/// Shapes that do not fit the layouts or `probs`.
pub fn causal_attention_backward_bf16(
    q: &Bf16Tensor,
    k: &Bf16Tensor,
    v: &Bf16Tensor,
    probs: &Tensor,
    dout: &Bf16Tensor,
    scale: f32,
    threads: usize,
) -> Result<(Bf16Tensor, Bf16Tensor, Bf16Tensor), TensorError> {
    let op = "causal_attention_backward_bf16";
    let d = Dims::of(q.shape(), k.shape(), v.shape(), op)?;
    d.check_backward_operands(probs.shape(), dout.shape())?;
    let _span = ferrotext_profile::span(op);
    let (dq, dk, dv) = causal_attention_backward(
        &q.widened(),
        &k.widened(),
        &v.widened(),
        probs,
        &dout.widened(),
        scale,
        threads,
    )?;
    Ok((
        Bf16Tensor::rounded(&dq),
        Bf16Tensor::rounded(&dk),
        Bf16Tensor::rounded(&dv),
    ))
}
