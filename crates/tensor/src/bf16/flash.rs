//! Memory-efficient attention on bf16 `q`, `k`, `v` (and the output cotangent): the tiled
//! kernel ([`flash_attention`], [`flash_attention_backward`]) reading the bf16 operands as
//! stored, its products on the bf16 product kernel.
//!
//! Invariants:
//! * Every product multiplies bf16 values into `f32` (each term exact): `q·kᵀ` and `dout·vᵀ`
//!   on the operands as stored; the probabilities and `dS` computed in `f32` and rounded to
//!   bf16 for their products (`P·v`, `Pᵀ·dout`, `dS·k`, `dSᵀ·q`), as FlashAttention does in
//!   half precision. The online softmax, the row sums `rowsum(dout ⊙ out)` (of the stored,
//!   rounded output), the log-sum-exps and every accumulation are `f32`; the output and the
//!   cotangents are rounded to bf16 once, on store.
//! * No widened copy of an operand: the kernel reads bf16 (half the bytes of the `f32`
//!   kernel's operands), and its products run at the bf16 kernel's rate.
//! * The bits do not depend on `threads` (each output element is one task's, in a fixed
//!   order); on the portable product kernel not on the processor either.
//!
//! [`flash_attention`]: crate::flash_attention
//! [`flash_attention_backward`]: crate::flash_attention_backward

use super::Bf16Tensor;
use crate::error::TensorError;
use crate::flash::{backward, forward, Dims, Flash, KeyRanges, Scores};
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
    let op = "flash_attention_bf16";
    let d = Dims::of(q.shape(), k.shape(), v.shape(), op)?;
    let round = |Flash { out, lse }| (Bf16Tensor::rounded(&out), lse);
    forward(
        d,
        [q.data(), k.data(), v.data()],
        ranges,
        scores,
        threads,
        (op, round),
    )
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
    let op = "flash_attention_backward_bf16";
    let d = Dims::of(q.shape(), k.shape(), v.shape(), op)?;
    d.check_backward([out.shape(), dout.shape(), lse.shape()], op)?;
    let operands = [q.data(), k.data(), v.data(), out.data(), dout.data()];
    let round = |(dq, dk, dv): (Tensor, Tensor, Tensor)| {
        (
            Bf16Tensor::rounded(&dq),
            Bf16Tensor::rounded(&dk),
            Bf16Tensor::rounded(&dv),
        )
    };
    backward(
        d,
        operands,
        lse.data(),
        ranges,
        scores,
        threads,
        (op, round),
    )
}
