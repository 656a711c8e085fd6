//! The backward pass: per (batch, kv head), per key block, per query head of the group, per
//! query block that sees the key block, the tile's scores again and its five products (see the
//! module docs of `flash`). The task owns its kv head's `dk`, `dv` rows and its query heads'
//! `dq` rows, and adds each tile into them in that fixed order.

use super::{block_view, logit, t, Dims, KeyRanges, Scores, KEY_BLOCK, QUERY_BLOCK};
use crate::error::TensorError;
use crate::fastmath::{exp, lane_sum2, vectorized};
use crate::matmul::{gemm_views_accumulate_rows, gemm_views_into_rows, MatView};
use crate::parallel::{for_each_index, Work};
use crate::tensor::Tensor;

/// The cotangents `(dq, dk, dv)` of [`flash_attention`](super::flash_attention) for an output
/// cotangent `dout` `[B, Tq, H, dv]`, from the forward's output `out` and log-sum-exp `lse`
/// (`[B, H, Tq]`): the scores are recomputed tile by tile. Under GQA a kv head's `dk`, `dv` sum
/// over its group's query heads. One (batch, kv head) per task; the result does not depend on
/// `threads`.
///
/// # Errors
/// Shapes that do not fit the layouts, `ranges`, `out`, `lse` or `dout`.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    ranges: &KeyRanges,
    scores: Scores,
    threads: usize,
) -> Result<(Tensor, Tensor, Tensor), TensorError> {
    let op = "flash_attention_backward";
    let d = Dims::of(q.shape(), k.shape(), v.shape(), op)?;
    ranges.check(d.b, d.tq, d.tk, op)?;
    let out_shape = [d.b, d.tq, d.h, d.dv];
    if out.shape() != out_shape || dout.shape() != out_shape || lse.shape() != [d.b, d.h, d.tq] {
        return Err(TensorError::shape(
            op,
            format!(
                "out and dout must be {out_shape:?} and lse [{}, {}, {}], got {:?}, {:?}, {:?}",
                d.b,
                d.h,
                d.tq,
                out.shape(),
                dout.shape(),
                lse.shape()
            ),
        ));
    }
    let _span =
        ferrotext_profile::span(op).map(|s| s.flops(d.tile_flops(ranges, 3 * d.dk + 2 * d.dv)));
    let mut dq = vec![0.0f32; q.len()];
    let mut dk = vec![0.0f32; k.len()];
    let mut dv = vec![0.0f32; v.len()];
    let at = |x: &mut Vec<f32>| x.as_mut_ptr() as usize;
    let grads = Grads {
        dq: at(&mut dq),
        dk: at(&mut dk),
        dv: at(&mut dv),
    };
    // Per (batch, kv head): its query heads' `D = rowsum(dout ⊙ out)`, `[group, Tq]`.
    let mut row_dots = vec![0.0f32; d.b * d.kv * d.group() * d.tq];
    let dots_at = row_dots.as_mut_ptr() as usize;
    for_each_index(d.b * d.kv, d.cells(), threads, Work::Heavy, |bk| {
        let span = d.group() * d.tq;
        // SAFETY: `row_dots` holds `B·KV·group·Tq` elements; those of (b, kv head) are this
        // task's alone.
        let dots =
            unsafe { std::slice::from_raw_parts_mut((dots_at as *mut f32).add(bk * span), span) };
        let task = Task {
            d,
            b: bk / d.kv,
            kvh: bk % d.kv,
            q: q.data(),
            k: k.data(),
            v: v.data(),
            dout: dout.data(),
            lse: lse.data(),
            ranges,
            scores,
        };
        task.row_dots(out.data(), dots);
        // SAFETY: the gradients hold `q`'s, `k`'s and `v`'s lengths; this task's rows of
        // them (its kv head's, its query heads') are written by no other task.
        unsafe { task.run(dots, grads) };
    });
    Ok((
        Tensor::new(q.shape().to_vec(), dq)?,
        Tensor::new(k.shape().to_vec(), dk)?,
        Tensor::new(v.shape().to_vec(), dv)?,
    ))
}

/// The gradient buffers' addresses (shared by the tasks, each writing rows of its own).
#[derive(Clone, Copy)]
struct Grads {
    dq: usize,
    dk: usize,
    dv: usize,
}

/// One (batch, kv head) of the backward: its operands.
struct Task<'a> {
    d: Dims,
    b: usize,
    kvh: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
    ranges: &'a KeyRanges,
    scores: Scores,
}

/// A tile's scratch: `P` and `dP`/`dS` (`QUERY_BLOCK × KEY_BLOCK` each), and the logits'
/// derivative under soft-capping.
struct Scratch {
    p: Vec<f32>,
    ds: Vec<f32>,
    slope: Vec<f32>,
}

impl Task<'_> {
    /// `D = rowsum(dout ⊙ out)` for each query head of the group and each row, into `dots`
    /// (`[group, Tq]`).
    fn row_dots(&self, out: &[f32], dots: &mut [f32]) {
        let d = self.d;
        for (g, head_dots) in dots.chunks_mut(d.tq).enumerate() {
            let h = self.kvh * d.group() + g;
            for (i, dot) in head_dots.iter_mut().enumerate() {
                let at = Dims::row_at(d.tq, d.h, d.dv, self.b, h, i);
                let (o, g) = (&out[at..at + d.dv], &self.dout[at..at + d.dv]);
                *dot = vectorized(
                    #[inline(always)]
                    || lane_sum2(o, g, |a, b| a * b),
                );
            }
        }
    }

    /// Every tile this task owns, in its fixed order (see the module docs).
    ///
    /// # Safety
    /// `grads` point at whole zero-initialised `dq`, `dk`, `dv` buffers of `q`'s, `k`'s and
    /// `v`'s shapes; this task's rows are written by no one else meanwhile.
    unsafe fn run(&self, dots: &[f32], grads: Grads) {
        let d = self.d;
        let mut scratch = Scratch {
            p: vec![0.0; QUERY_BLOCK * KEY_BLOCK],
            ds: vec![0.0; QUERY_BLOCK * KEY_BLOCK],
            slope: vec![1.0; QUERY_BLOCK * KEY_BLOCK],
        };
        for c0 in (0..d.tk).step_by(KEY_BLOCK) {
            let block = c0..(c0 + KEY_BLOCK).min(d.tk);
            for g in 0..d.group() {
                let h = self.kvh * d.group() + g;
                for rows in d.query_blocks() {
                    let (lo, hi) = self.ranges.span(self.b, rows.clone());
                    let cols = block.start.max(lo)..block.end.min(hi);
                    if cols.is_empty() {
                        continue;
                    }
                    let dots = &dots[g * d.tq + rows.start..g * d.tq + rows.end];
                    // SAFETY: the caller's contract.
                    unsafe { self.tile(h, rows, cols, dots, &mut scratch, grads) };
                }
            }
        }
    }

    /// One tile: query rows `rows` of head `h` against keys `cols`.
    ///
    /// # Safety
    /// As [`Task::run`].
    unsafe fn tile(
        &self,
        h: usize,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        dots: &[f32],
        s: &mut Scratch,
        grads: Grads,
    ) {
        let d = self.d;
        let (n, w) = (rows.len(), cols.len());
        let view = |data, heads, dw, head, r: std::ops::Range<usize>, tlen| {
            Dims::rows(data, tlen, heads, dw, self.b, head, r)
        };
        let qv: MatView = view(self.q, d.h, d.dk, h, rows.clone(), d.tq);
        let gv: MatView = view(self.dout, d.h, d.dv, h, rows.clone(), d.tq);
        let kv: MatView = view(self.k, d.kv, d.dk, self.kvh, cols.clone(), d.tk);
        let vv: MatView = view(self.v, d.kv, d.dv, self.kvh, cols.clone(), d.tk);
        // P [n, w] = exp(logit(q·kᵀ) − lse), 0 where a row does not see the key
        // SAFETY: the scratch holds `QUERY_BLOCK·KEY_BLOCK ≥ n·w` elements.
        unsafe { gemm_views_into_rows(s.p.as_mut_ptr(), w, qv, t(kv)) };
        let lse = &self.lse[(self.b * d.h + h) * d.tq..];
        for r in 0..n {
            let i = rows.start + r;
            let (a, z) = self.ranges.range(self.b, i);
            let visible = a.max(cols.start).min(cols.end) - cols.start
                ..z.min(cols.end).max(cols.start) - cols.start;
            let row = &mut s.p[r * w..(r + 1) * w];
            let slope = &mut s.slope[r * w..(r + 1) * w];
            probabilities(row, slope, visible, self.scores, lse[i]);
        }
        let p = block_view(&s.p, n, w, w);
        let row_at = |heads, dw, head, row| Dims::row_at(d.tk, heads, dw, self.b, head, row);
        // SAFETY: rows of this task's kv head's `dv` (the caller's contract); the scratch holds
        // the tile.
        unsafe {
            // dv[cols] += Pᵀ · dout_rows
            let dv = (grads.dv as *mut f32).add(row_at(d.kv, d.dv, self.kvh, cols.start));
            gemm_views_accumulate_rows(dv, d.kv * d.dv, t(p), gv);
            // dP [n, w] = dout_rows · v_colsᵀ
            gemm_views_into_rows(s.ds.as_mut_ptr(), w, gv, t(vv));
        }
        // dS = scale · slope ⊙ P ⊙ (dP − D)
        let scale = self.scores.scale;
        for (r, &dot) in dots.iter().enumerate().take(n) {
            let at = r * w..(r + 1) * w;
            let (ds, pr, sl) = (&mut s.ds[at.clone()], &s.p[at.clone()], &s.slope[at]);
            vectorized(
                #[inline(always)]
                || {
                    for ((x, &pv), &sv) in ds.iter_mut().zip(pr).zip(sl) {
                        *x = scale * sv * pv * (*x - dot);
                    }
                },
            );
        }
        let ds = block_view(&s.ds, n, w, w);
        // SAFETY: rows of this task's kv head's `dk` and of its query head's `dq` (the caller's
        // contract); the scratch holds the tile.
        unsafe {
            // dk[cols] += dSᵀ · q_rows
            let dk = (grads.dk as *mut f32).add(row_at(d.kv, d.dk, self.kvh, cols.start));
            gemm_views_accumulate_rows(dk, d.kv * d.dk, t(ds), qv);
            // dq[rows] += dS · k_cols
            let dq_at = Dims::row_at(d.tq, d.h, d.dk, self.b, h, rows.start);
            gemm_views_accumulate_rows((grads.dq as *mut f32).add(dq_at), d.h * d.dk, ds, kv);
        }
    }
}

/// A tile row's scores become its probabilities `exp(logit − lse)` over the `visible` columns
/// (0 elsewhere), and `slope` the logits' derivative there (soft-capping's `1 − tanh²`; left
/// at 1 without it).
#[inline]
fn probabilities(
    row: &mut [f32],
    slope: &mut [f32],
    visible: std::ops::Range<usize>,
    scores: Scores,
    lse: f32,
) {
    let live = &mut row[visible.clone()];
    match scores.softcap {
        None => vectorized(
            #[inline(always)]
            || {
                live.iter_mut()
                    .for_each(|s| *s = exp(logit(*s, scores).0 - lse))
            },
        ),
        Some(_) => {
            for (s, sl) in live.iter_mut().zip(&mut slope[visible.clone()]) {
                let (x, dx) = logit(*s, scores);
                *s = exp(x - lse);
                *sl = dx;
            }
        }
    }
    row[..visible.start].fill(0.0);
    row[visible.end..].fill(0.0);
}
