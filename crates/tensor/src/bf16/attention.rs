//! Fused causal attention on bf16 `q`, `k`, `v` (and the output cotangent): the `f32` kernel's
//! own per-head code (`crate::attention`) on each head's rows widened as its task starts, with
//! the results rounded to bf16 as they are stored.
//!
//! Invariants:
//! * Each output is, bit for bit, `round_bf16` of the `f32` kernel ([`causal_attention`],
//!   [`causal_attention_backward`]) on the widened inputs wherever the product kernel's sums do
//!   not depend on the operands' strides (the portable kernel: every element one chain); the
//!   tests check that, and a float tolerance on the libraries. Inside, everything is `f32`:
//!   the products, the softmax and its backward, the probabilities (kept in `f32` for the
//!   backward) and a GQA group's `dk`, `dv` sums (in f64, in head order, as the `f32` kernel).
//! * No `f32` copy of a whole input is made: a (batch, head) task widens its `T` rows of `q`
//!   (and `dout`) and of its kv head's `k` and `v` into contiguous scratch (`4·T·d` floats),
//!   and rounds its `T` output rows straight into their places in `[B, T, H, d]`.
//! * The bits do not depend on `threads`: threads share out whole (batch, head) blocks.
//!
//! [`causal_attention`]: crate::causal_attention
//! [`causal_attention_backward`]: crate::causal_attention_backward

use std::mem::MaybeUninit;

use half::bf16;

use super::{round_slice, widen_into, Bf16Tensor};
use crate::attention::{group_sum, head_dk_dv, head_ds_dq, head_forward, Dims, HeadInputs};
use crate::error::TensorError;
use crate::matmul::MatView;
use crate::parallel::{filled, for_each_chunk, Work};
use crate::tensor::Tensor;

/// The `T` rows of head `head` of batch row `b` in a `[B, T, heads, w]` bf16 tensor, widened
/// into a contiguous `[T, w]`.
fn widened_head(
    data: &[bf16],
    d: &Dims,
    b: usize,
    head: usize,
    heads: usize,
    w: usize,
) -> Vec<f32> {
    // SAFETY: the rows cover `out`, and `widen_into` writes each whole.
    unsafe {
        filled(d.t * w, |out| {
            for (s, row) in out.chunks_mut(w.max(1)).enumerate() {
                let at = ((b * d.t + s) * heads + head) * w;
                widen_into(&data[at..at + w], row);
            }
        })
    }
}

/// A contiguous `[T, w]` as a view.
fn view(data: &[f32], t: usize, w: usize) -> MatView<'_> {
    MatView {
        data,
        rows: t,
        cols: w,
        rs: w,
        cs: 1,
    }
}

/// Rounds a head's contiguous `[T, w]` rows into its rows of a `[B, T, heads, w]` bf16 buffer
/// at address `base`.
///
/// # Safety
/// `base` holds `B·T·heads·w` elements, and rows `(b, s, head)` for every `s` are this
/// caller's alone meanwhile.
unsafe fn round_head(
    src: &[f32],
    base: usize,
    d: &Dims,
    (b, head, heads): (usize, usize, usize),
    w: usize,
) {
    for (s, row) in src.chunks(w.max(1)).enumerate() {
        let at = ((b * d.t + s) * heads + head) * w;
        // SAFETY: the caller's contract.
        let out = unsafe { std::slice::from_raw_parts_mut((base as *mut bf16).add(at), w) };
        round_slice(row, out);
    }
}

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
    let d = Dims::of(q.shape(), k.shape(), v.shape(), "causal_attention_bf16")?;
    let _span = ferrotext_profile::span("causal_attention_bf16")
        .map(|s| s.flops(d.product_flops(d.dk + d.dv)));
    let (tt, heads) = (d.t * d.t, d.b * d.h);
    let mut out = vec![bf16::ZERO; heads * d.t * d.dv];
    let out_at = out.as_mut_ptr() as usize;
    let heads_into = |probs: &mut [MaybeUninit<f32>]| {
        for_each_chunk(probs, tt.max(1), threads, Work::Heavy, |bh, p| {
            let (b, h) = (bh / d.h, bh % d.h);
            let kvh = d.kv_head(h);
            let qf = widened_head(q.data(), &d, b, h, d.h, d.dk);
            let kf = widened_head(k.data(), &d, b, kvh, d.kv, d.dk);
            let vf = widened_head(v.data(), &d, b, kvh, d.kv, d.dv);
            let mut o = vec![0.0f32; d.t * d.dv];
            let views = [
                view(&qf, d.t, d.dk),
                view(&kf, d.t, d.dk),
                view(&vf, d.t, d.dv),
            ];
            // SAFETY: `o` holds this head's `T` rows of `dv`.
            unsafe { head_forward(d, views, p, (o.as_mut_ptr(), d.dv), scale) };
            // SAFETY: `out` holds `B·T·H·dv` elements; rows `(b, s, h)` are this task's alone.
            unsafe { round_head(&o, out_at, &d, (b, h, d.h), d.dv) };
        });
    };
    // SAFETY: every (batch, head) chunk is visited, and its products write all of its
    // probabilities.
    let probs = unsafe { filled(heads * tt, heads_into) };
    Ok((
        Bf16Tensor::new(vec![d.b, d.t, d.h, d.dv], out)?,
        Tensor::new(vec![d.b, d.h, d.t, d.t], probs)?,
    ))
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
    let _span = ferrotext_profile::span(op).map(|s| s.flops(d.product_flops(2 * (d.dk + d.dv))));
    let (tt, heads) = (d.t * d.t, d.b * d.h);
    // Per (batch, query head), as the `f32` kernel: [dk_h | dv_h | dS] under GQA (the group's
    // heads are summed after, in `f32`), only dS otherwise.
    let grouped = d.h != d.kv;
    let kept = if grouped { d.t * (d.dk + d.dv) } else { 0 };
    let rest = kept + tt;
    let mut dq = vec![bf16::ZERO; heads * d.t * d.dk];
    let direct = |w: usize| vec![bf16::ZERO; if grouped { 0 } else { heads * d.t * w }];
    let (mut dk_direct, mut dv_direct) = (direct(d.dk), direct(d.dv));
    let (dq_at, dk_at, dv_at) = (
        dq.as_mut_ptr() as usize,
        dk_direct.as_mut_ptr() as usize,
        dv_direct.as_mut_ptr() as usize,
    );
    let heads_into = |per_head: &mut [MaybeUninit<f32>]| {
        for_each_chunk(per_head, rest.max(1), threads, Work::Heavy, |bh, r| {
            let (b, h) = (bh / d.h, bh % d.h);
            let kvh = d.kv_head(h);
            let (qf, kf) = (
                widened_head(q.data(), &d, b, h, d.h, d.dk),
                widened_head(k.data(), &d, b, kvh, d.kv, d.dk),
            );
            let (vf, df) = (
                widened_head(v.data(), &d, b, kvh, d.kv, d.dv),
                widened_head(dout.data(), &d, b, h, d.h, d.dv),
            );
            let x = HeadInputs {
                p: &probs.data()[bh * tt..(bh + 1) * tt],
                dout: view(&df, d.t, d.dv),
                v: view(&vf, d.t, d.dv),
                k: view(&kf, d.t, d.dk),
                q: view(&qf, d.t, d.dk),
            };
            let (keep, ds) = r.split_at_mut(kept);
            let mut dqf = vec![0.0f32; d.t * d.dk];
            // SAFETY: `dqf` holds this head's `T` rows of `dk`.
            unsafe { head_ds_dq(d, &x, ds, (dqf.as_mut_ptr(), d.dk), scale) };
            // SAFETY: `dq` holds `B·T·H·dk` elements; rows `(b, s, h)` are this task's alone.
            unsafe { round_head(&dqf, dq_at, &d, (b, h, d.h), d.dk) };
            // SAFETY: the row blocks above wrote every element of dS.
            let ds = unsafe { &*(ds as *const [_] as *const [f32]) };
            if grouped {
                let (dkb, dvb) = keep.split_at_mut(d.t * d.dk);
                let at = |b: &mut [MaybeUninit<f32>]| b.as_mut_ptr().cast::<f32>();
                // SAFETY: this head's own blocks of `T` rows of `dk` and `dv`.
                unsafe { head_dk_dv(d, &x, ds, (at(dkb), d.dk), (at(dvb), d.dv)) };
                return;
            }
            let (mut dkf, mut dvf) = (vec![0.0f32; d.t * d.dk], vec![0.0f32; d.t * d.dv]);
            // SAFETY: `dkf` and `dvf` hold this head's `T` rows of `dk` and `dv`.
            unsafe {
                head_dk_dv(
                    d,
                    &x,
                    ds,
                    (dkf.as_mut_ptr(), d.dk),
                    (dvf.as_mut_ptr(), d.dv),
                )
            };
            // SAFETY: without GQA `dk`, `dv` are `[B, T, H, w]`; rows `(b, s, h)` are this
            // task's alone.
            unsafe {
                round_head(&dkf, dk_at, &d, (b, h, d.h), d.dk);
                round_head(&dvf, dv_at, &d, (b, h, d.h), d.dv);
            }
        });
    };
    // SAFETY: every (batch, head) chunk is visited; its products write all of its dS and under
    // GQA its dk and dv blocks.
    let per_head = unsafe { filled(heads * rest, heads_into) };
    let dq = Bf16Tensor::new(vec![d.b, d.t, d.h, d.dk], dq)?;
    if !grouped {
        return Ok((
            dq,
            Bf16Tensor::new(vec![d.b, d.t, d.kv, d.dk], dk_direct)?,
            Bf16Tensor::new(vec![d.b, d.t, d.kv, d.dv], dv_direct)?,
        ));
    }
    let dk = group_sum(&per_head, rest, 0, d.dk, d, threads)?;
    let dv = group_sum(&per_head, rest, d.t * d.dk, d.dv, d, threads)?;
    Ok((dq, Bf16Tensor::from_f32(&dk), Bf16Tensor::from_f32(&dv)))
}
