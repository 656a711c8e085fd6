//! The forward pass: per (batch, query head), per query block, the online softmax over the key
//! tiles its rows see (see the module docs of `flash`).

use std::mem::MaybeUninit;

use super::elem::{rows_per_store, Elem, View};
use super::{
    logit, masked, packs_once, with_tiles, Dims, KeyRanges, Scores, KEY_BLOCK, QUERY_BLOCK,
};
use crate::error::TensorError;
use crate::fastmath::{exp, lane_max, map_sum, vectorized};
use crate::operand::Store;
use crate::parallel::{filled, for_each_index, Work};
use crate::tensor::Tensor;

/// What [`flash_attention`] returns.
#[derive(Clone, Debug)]
pub struct Flash {
    /// `softmax(logits over the visible keys)·v`, `[B, Tq, H, dv]`.
    pub out: Tensor,
    /// Each row's log-sum-exp of its logits, `[B, H, Tq]`: all the backward keeps besides the
    /// operands and the output.
    pub lse: Tensor,
}

/// Attention of `q: [B, Tq, H, dk]` over `k: [B, Tk, KV, dk]`, `v: [B, Tk, KV, dv]`, each query
/// row seeing the keys `ranges` gives it, with logits as `scores` says: the output and the
/// rows' log-sum-exps (see the module docs). One (batch, query head) per task on up to
/// `threads` threads; the result does not depend on `threads`.
///
/// # Errors
/// Shapes that do not fit the layouts or `ranges`.
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    ranges: &KeyRanges,
    scores: Scores,
    threads: usize,
) -> Result<Flash, TensorError> {
    let op = "flash_attention";
    let d = Dims::of(q.shape(), k.shape(), v.shape(), op)?;
    forward(
        d,
        [q.data(), k.data(), v.data()],
        ranges,
        scores,
        threads,
        (op, |flash| flash),
    )
}

/// The forward on operands of any [`Elem`] (their shapes checked as `d`), under a profiler
/// span named `op` that also covers `finish`, which makes the caller's result of it (a bf16
/// output's rounding: the op's own work, not time between ops).
pub(crate) fn forward<T: Elem, R>(
    d: Dims,
    [q, k, v]: [&[T]; 3],
    ranges: &KeyRanges,
    scores: Scores,
    threads: usize,
    (op, finish): (&'static str, impl FnOnce(Flash) -> R),
) -> Result<R, TensorError> {
    ranges.check(d.b, d.tq, d.tk, op)?;
    // Bytes: each operand read once, the output and log-sum-exp written once (the least a
    // fused attention moves; its tiles re-read keys and values from cache).
    let _span = ferrotext_profile::span(op).map(|s| {
        s.flops(d.tile_flops(ranges, d.dk + d.dv)).bytes(
            (std::mem::size_of::<T>() * (q.len() + k.len() + v.len())
                + 4 * d.b * d.h * d.tq * (d.dv + 1)) as f64,
        )
    });
    let (out_len, lse_len) = (d.b * d.tq * d.h * d.dv, d.b * d.h * d.tq);
    let mut lse = Vec::with_capacity(lse_len);
    let lse_at = lse.spare_capacity_mut().as_mut_ptr() as usize;
    let heads = |out: &mut [MaybeUninit<f32>]| {
        let out_at = out.as_mut_ptr() as usize;
        for_each_index(d.b * d.h, d.cells(), threads, Work::Heavy, |bh| {
            let (b, h) = (bh / d.h, bh % d.h);
            let head = Head { d, b, h, q, k, v };
            // SAFETY: `lse` holds `B·H·Tq` elements, those of (b, h) this task's alone; `out`
            // holds `B·Tq·H·dv`, rows `(b, ·, h)` this task's alone.
            unsafe {
                let lse_rows = (lse_at as *mut f32).add(bh * d.tq);
                head.forward(ranges, scores, out_at as *mut f32, lse_rows)
            };
        });
    };
    // SAFETY: every head writes each of its output rows and log-sum-exps (`Head::forward`), and
    // the heads cover every (batch, query head): all `out_len` elements are written.
    let out = unsafe { filled(out_len, heads) };
    // SAFETY: the heads wrote all `B·H·Tq` log-sum-exps (above).
    unsafe { lse.set_len(lse_len) };
    Ok(finish(Flash {
        out: Tensor::new(vec![d.b, d.tq, d.h, d.dv], out)?,
        lse: Tensor::new(vec![d.b, d.h, d.tq], lse)?,
    }))
}

/// One (batch, query head) of a call: its operands.
struct Head<'a, T> {
    d: Dims,
    b: usize,
    h: usize,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
}

/// The online softmax's state for one query block: per row, the running maximum logit and the
/// running sum of `exp(logit − max)`, and the unnormalised output rows `[rows, dv]`.
struct Running {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl<T: Elem> Head<'_, T> {
    /// The forward of this head: every output row and its log-sum-exp, each written once
    /// (neither needs to be initialised).
    ///
    /// # Safety
    /// `out` is the whole `[B, Tq, H, dv]` output and `lse` this head's `Tq` log-sum-exps; this
    /// head's rows of both are written by no one else meanwhile.
    unsafe fn forward(&self, ranges: &KeyRanges, scores: Scores, out: *mut f32, lse: *mut f32) {
        with_tiles(self.d.tile_len(), |tile| {
            // SAFETY: the caller's contract.
            unsafe { self.forward_in(ranges, scores, (out, lse), tile) }
        })
    }

    /// [`Head::forward`] with `tile` (`tile_len()` elements) for the scores and probabilities.
    ///
    /// # Safety
    /// As [`Head::forward`].
    unsafe fn forward_in(
        &self,
        ranges: &KeyRanges,
        scores: Scores,
        (out, lse): (*mut f32, *mut f32),
        tile: &mut [f32],
    ) {
        let d = self.d;
        let kvh = self.h / d.group();
        // The keys (as `kᵀ`, `[dk, Tk]`) and values (`[Tk, dv]`) packed once for every query
        // block's tiles, where there are several.
        let keys = Dims::rows(self.k, d.tk, d.kv, d.dk, self.b, kvh, 0..d.tk).t();
        let values = Dims::rows(self.v, d.tk, d.kv, d.dv, self.b, kvh, 0..d.tk);
        let (keys, values) = if packs_once(d.tq.div_ceil(QUERY_BLOCK)) {
            (T::pack(keys), T::pack(values))
        } else {
            (None, None)
        };
        let mut probs: Vec<T> = Vec::new();
        T::size_stored(&mut probs, d.tile_len());
        let mut run = Running {
            max: vec![0.0; d.block_rows()],
            sum: vec![0.0; d.block_rows()],
            acc: vec![0.0; d.block_rows() * d.dv],
        };
        for rows in d.query_blocks() {
            let n = rows.len();
            run.max[..n].fill(f32::NEG_INFINITY);
            run.sum[..n].fill(0.0);
            run.acc[..n * d.dv].fill(0.0);
            let qv = Dims::rows(self.q, d.tq, d.h, d.dk, self.b, self.h, rows.clone());
            let (lo, hi) = ranges.span(self.b, rows.clone());
            let mut c0 = lo - lo % KEY_BLOCK;
            while c0 < hi {
                let cols = c0.max(lo)..(c0 + KEY_BLOCK).min(hi);
                let w = cols.len();
                let kv = Dims::rows(self.k, d.tk, d.kv, d.dk, self.b, kvh, cols.clone());
                // scores [rows, w] = q_rows · k_colsᵀ
                // SAFETY: `tile` holds `tile_len() ≥ n·w` elements (`n` rows of a block, `w` keys of
                // one).
                unsafe {
                    let keys = keys.as_ref().map(|p| (p, (0, cols.start)));
                    T::product_from(tile.as_mut_ptr(), w, (qv, kv.t()), Store::Overwrite, keys)
                };
                let visible = |r: usize| {
                    let (a, z) = ranges.range(self.b, rows.start + r);
                    a.max(cols.start).min(cols.end) - cols.start
                        ..z.min(cols.end).max(cols.start) - cols.start
                };
                online_tile(&mut tile[..n * w], w, visible, scores, (&mut run, d.dv));
                // Rounded after the whole tile: the same bits as row by row, and measured
                // faster than rounding each group of rows inside the sweeps.
                let group = rows_per_store(w) * w;
                for (i, done) in tile[..n * w].chunks(group).enumerate() {
                    T::store_rows(done, &mut probs, i * group);
                }
                // acc[rows] += P[rows, w] · v_cols
                let vv = Dims::rows(self.v, d.tk, d.kv, d.dv, self.b, kvh, cols.clone());
                let p = View::block(T::stored(tile, &probs, n * w), n, w, w);
                // SAFETY: `run.acc` holds `n` rows of `dv`, initialised.
                unsafe {
                    let values = values.as_ref().map(|p| (p, (cols.start, 0)));
                    T::product_from(
                        run.acc.as_mut_ptr(),
                        d.dv,
                        (p, vv),
                        Store::Accumulate,
                        values,
                    )
                };
                c0 += KEY_BLOCK;
            }
            for r in 0..n {
                let i = rows.start + r;
                let inv = 1.0 / run.sum[r];
                let at = Dims::row_at(d.tq, d.h, d.dv, self.b, self.h, i);
                // SAFETY: row `(b, i, h)` of the output, this task's (the caller's contract).
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(out.add(at).cast::<MaybeUninit<f32>>(), d.dv)
                };
                for (o, a) in dst.iter_mut().zip(&run.acc[r * d.dv..(r + 1) * d.dv]) {
                    *o = MaybeUninit::new(a * inv);
                }
                // SAFETY: this head's log-sum-exp of row `i < Tq` (the caller's contract).
                unsafe {
                    lse.add(i)
                        .write(run.max[r] + crate::fixed_math::ln(run.sum[r]))
                };
            }
        }
    }
}

/// One tile through the online softmax: its scores (`rows × w`, row-major) become `P =
/// exp(logit − max)` over each row's `visible` columns (0 elsewhere), each row's running
/// maximum and sum in `run` are updated, and its partial output (`dv` wide) rescaled to the new
/// maximum. Three sweeps, all in one [`vectorized`] call (a row is a few vectors of work, which
/// a call and a loop set-up per row outweighed): per row the logits, masked by index (`−∞`
/// where the row does not see the key), and their maximum; then each whole row's exponentials
/// (`exp(−∞) = 0` where masked: cheaper, measured, than a visible slice's tail and zero fills)
/// and their sum; then per row the running state.
#[inline(always)]
fn online_tile(
    tile: &mut [f32],
    w: usize,
    visible: impl Fn(usize) -> std::ops::Range<usize>,
    scores: Scores,
    (run, dv): (&mut Running, usize),
) {
    let n = tile.len() / w;
    vectorized(
        #[inline(always)]
        || {
            // What each row's exponentials subtract: its new maximum, or `+∞` for a row that
            // sees none of these keys (its logits are `−∞`: every `P` is 0).
            let mut shift = [0.0f32; QUERY_BLOCK];
            for (r, row) in tile.chunks_exact_mut(w).enumerate() {
                let visible = visible(r);
                shift[r] = if visible.is_empty() {
                    row.fill(f32::NEG_INFINITY);
                    f32::INFINITY
                } else {
                    match scores.softcap {
                        None => {
                            let scale = scores.scale;
                            for (i, s) in row.iter_mut().enumerate() {
                                *s = masked(i, &visible, scale * *s);
                            }
                        }
                        Some(_) => {
                            for (i, s) in row.iter_mut().enumerate() {
                                *s = masked(i, &visible, logit(*s, scores).0);
                            }
                        }
                    }
                    run.max[r].max(lane_max(row))
                };
            }
            let mut sums = [0.0f32; QUERY_BLOCK];
            for (r, row) in tile.chunks_exact_mut(w).enumerate() {
                let m = shift[r];
                sums[r] = map_sum(row, |_, x| exp(x - m));
            }
            for r in 0..n {
                let (max, new_max) = (run.max[r], shift[r]);
                if new_max == f32::INFINITY {
                    continue;
                }
                if max == f32::NEG_INFINITY && new_max != f32::NEG_INFINITY {
                    // The row's first visible keys: its sum and output so far are zero, and
                    // `exp(−∞ − new_max)` would be 0, so there is nothing to rescale.
                    run.sum[r] = sums[r];
                } else {
                    let correction = exp(max - new_max);
                    run.sum[r] = run.sum[r] * correction + sums[r];
                    if correction != 1.0 {
                        let acc = &mut run.acc[r * dv..(r + 1) * dv];
                        acc.iter_mut().for_each(|a| *a *= correction);
                    }
                }
                run.max[r] = new_max;
            }
        },
    );
}
