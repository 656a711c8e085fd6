//! The backward pass: per (batch, kv head), per key block, per query head of the group, per
//! query block that sees the key block, the tile's scores again and its five products (see the
//! module docs of `flash`). The task owns its kv head's `dk`, `dv` rows and its query heads'
//! `dq` rows, and adds each tile into them in that fixed order.

use super::elem::{rows_per_store, Elem, View};
use super::{logit, packs_once, with_tiles, Dims, KeyRanges, Scores, KEY_BLOCK, QUERY_BLOCK};
use crate::error::TensorError;
use crate::fastmath::{exp, lane_sum2, vectorized};
use crate::operand::Store;
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
    d.check_backward([out.shape(), dout.shape(), lse.shape()], op)?;
    backward(
        d,
        [q.data(), k.data(), v.data(), out.data(), dout.data()],
        lse.data(),
        ranges,
        scores,
        threads,
        (op, |grads| grads),
    )
}

/// The backward on operands of any [`Elem`] (shapes checked as `d`; `out` and `dout` are
/// `[B, Tq, H, dv]`, `lse` `[B, H, Tq]`), under a profiler span named `op`: `finish` of the
/// `f32` cotangents, inside the span (a bf16 caller's rounding of them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: Elem, R>(
    d: Dims,
    [q, k, v, out, dout]: [&[T]; 5],
    lse: &[f32],
    ranges: &KeyRanges,
    scores: Scores,
    threads: usize,
    (op, finish): (&'static str, impl FnOnce((Tensor, Tensor, Tensor)) -> R),
) -> Result<R, TensorError> {
    ranges.check(d.b, d.tq, d.tk, op)?;
    // Bytes: the operands, output, its cotangent and log-sum-exp read once, the three `f32`
    // cotangents written once.
    let _span = ferrotext_profile::span(op).map(|s| {
        let read = q.len() + k.len() + v.len() + out.len() + dout.len();
        s.flops(d.tile_flops(ranges, 3 * d.dk + 2 * d.dv)).bytes(
            (std::mem::size_of::<T>() * read + 4 * (lse.len() + q.len() + k.len() + v.len()))
                as f64,
        )
    });
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
            q,
            k,
            v,
            dout,
            lse,
            ranges,
            scores,
        };
        task.row_dots(out, dots);
        // SAFETY: the gradients hold `q`'s, `k`'s and `v`'s lengths; this task's rows of
        // them (its kv head's, its query heads') are written by no other task.
        unsafe { task.run(dots, grads) };
    });
    Ok(finish((
        Tensor::new(vec![d.b, d.tq, d.h, d.dk], dq)?,
        Tensor::new(vec![d.b, d.tk, d.kv, d.dk], dk)?,
        Tensor::new(vec![d.b, d.tk, d.kv, d.dv], dv)?,
    )))
}

impl Dims {
    /// `out` and `dout` are `[B, Tq, H, dv]` and `lse` `[B, H, Tq]`, as the backward named `op`
    /// needs.
    pub(crate) fn check_backward(
        &self,
        [out, dout, lse]: [&[usize]; 3],
        op: &'static str,
    ) -> Result<(), TensorError> {
        let d = self;
        let out_shape = [d.b, d.tq, d.h, d.dv];
        if out != out_shape || dout != out_shape || lse != [d.b, d.h, d.tq] {
            return Err(TensorError::shape(
                op,
                format!(
                    "out and dout must be {out_shape:?} and lse [{}, {}, {}], got {out:?}, \
                     {dout:?}, {lse:?}",
                    d.b, d.h, d.tq
                ),
            ));
        }
        Ok(())
    }
}

/// The gradient buffers' addresses (shared by the tasks, each writing rows of its own).
#[derive(Clone, Copy)]
struct Grads {
    dq: usize,
    dk: usize,
    dv: usize,
}

/// One (batch, kv head) of the backward: its operands.
struct Task<'a, T> {
    d: Dims,
    b: usize,
    kvh: usize,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    dout: &'a [T],
    lse: &'a [f32],
    ranges: &'a KeyRanges,
    scores: Scores,
}

/// Where a product's `b` is a block of a packed operand: its packing (if any) and the block's
/// first row and column in it.
fn at<P>(packing: &Option<P>, first: (usize, usize)) -> Option<(&P, (usize, usize))> {
    packing.as_ref().map(|p| (p, first))
}

/// A task's operands packed once for its tiles ([`Task::packings`]); `None` (or empty) where
/// each tile packs its block itself.
struct Packed<T: Elem> {
    /// The kv head's keys as `kᵀ` (`[dk, Tk]`), for the scores.
    keys_t: Option<T::Packing>,
    /// Its values as `vᵀ` (`[dv, Tk]`), for `dP`.
    values_t: Option<T::Packing>,
    /// Its keys (`[Tk, dk]`), for `dq`.
    keys: Option<T::Packing>,
    /// Each of the group's heads' queries (`[Tq, dk]`), for `dk`.
    queries: Vec<Option<T::Packing>>,
    /// Each of the group's heads' output cotangents (`[Tq, dv]`), for `dv`.
    douts: Vec<Option<T::Packing>>,
}

/// A tile's scratch: `P` and `dP`/`dS` (`Dims::tile_len` each, from the thread's kept tiles),
/// the logits' derivative under soft-capping (empty without it), and `P` and `dS` as the
/// products read them.
struct Scratch<'a, T> {
    p: &'a mut [f32],
    ds: &'a mut [f32],
    slope: Vec<f32>,
    p_elem: Vec<T>,
    ds_elem: Vec<T>,
}

impl<T: Elem> Task<'_, T> {
    /// `D = rowsum(dout ⊙ out)` for each query head of the group and each row, into `dots`
    /// (`[group, Tq]`).
    fn row_dots(&self, out: &[T], dots: &mut [f32]) {
        let d = self.d;
        for (g, head_dots) in dots.chunks_mut(d.tq).enumerate() {
            let h = self.kvh * d.group() + g;
            for (i, dot) in head_dots.iter_mut().enumerate() {
                let at = Dims::row_at(d.tq, d.h, d.dv, self.b, h, i);
                let (o, g) = (&out[at..at + d.dv], &self.dout[at..at + d.dv]);
                *dot = vectorized(
                    #[inline(always)]
                    || lane_sum2(o, g, |a: T, b: T| a.widen() * b.widen()),
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
        let len = self.d.tile_len();
        with_tiles(2 * len, |tiles| {
            let (p, ds) = tiles.split_at_mut(len);
            let mut scratch = Scratch {
                p,
                ds,
                slope: match self.scores.softcap {
                    Some(_) => vec![1.0; len],
                    None => Vec::new(),
                },
                p_elem: Vec::new(),
                ds_elem: Vec::new(),
            };
            T::size_stored(&mut scratch.p_elem, len);
            T::size_stored(&mut scratch.ds_elem, len);
            // SAFETY: the caller's contract.
            unsafe { self.run_in(dots, grads, &mut scratch) }
        })
    }

    /// [`Task::run`] on `scratch`.
    ///
    /// # Safety
    /// As [`Task::run`].
    unsafe fn run_in(&self, dots: &[f32], grads: Grads, scratch: &mut Scratch<'_, T>) {
        let d = self.d;
        let packed = self.packings();
        for c0 in (0..d.tk).step_by(KEY_BLOCK) {
            let block = c0..(c0 + KEY_BLOCK).min(d.tk);
            for g in 0..d.group() {
                for rows in d.query_blocks() {
                    let (lo, hi) = self.ranges.span(self.b, rows.clone());
                    let cols = block.start.max(lo)..block.end.min(hi);
                    if cols.is_empty() {
                        continue;
                    }
                    let dots = &dots[g * d.tq + rows.start..g * d.tq + rows.end];
                    // SAFETY: the caller's contract.
                    unsafe { self.tile((g, rows), cols, dots, (scratch, &packed), grads) };
                }
            }
        }
    }

    /// The operands this task's tiles read blocks of, packed once where several tiles read
    /// each block ([`packs_once`]): the kv head's keys and values by every query block of the
    /// group's heads, each head's queries and output cotangent by every key block.
    fn packings(&self) -> Packed<T> {
        let d = self.d;
        let whole = |data, heads, dw, head, t| Dims::rows(data, t, heads, dw, self.b, head, 0..t);
        let keys = whole(self.k, d.kv, d.dk, self.kvh, d.tk);
        let values = whole(self.v, d.kv, d.dv, self.kvh, d.tk);
        let mut packed = Packed {
            keys_t: None,
            values_t: None,
            keys: None,
            queries: Vec::new(),
            douts: Vec::new(),
        };
        if packs_once(d.group() * d.tq.div_ceil(QUERY_BLOCK)) {
            packed.keys_t = T::pack(keys.t());
            packed.values_t = T::pack(values.t());
            packed.keys = T::pack(keys);
        }
        if packs_once(d.tk.div_ceil(KEY_BLOCK)) {
            for g in 0..d.group() {
                let h = self.kvh * d.group() + g;
                packed
                    .queries
                    .push(T::pack(whole(self.q, d.h, d.dk, h, d.tq)));
                packed
                    .douts
                    .push(T::pack(whole(self.dout, d.h, d.dv, h, d.tq)));
            }
        }
        packed
    }

    /// One tile: query rows `rows` of the group's head `g` against keys `cols`.
    ///
    /// # Safety
    /// As [`Task::run`].
    unsafe fn tile(
        &self,
        (g, rows): (usize, std::ops::Range<usize>),
        cols: std::ops::Range<usize>,
        dots: &[f32],
        (s, packed): (&mut Scratch<'_, T>, &Packed<T>),
        grads: Grads,
    ) {
        let d = self.d;
        let h = self.kvh * d.group() + g;
        // The query rows' block of the head's packed queries and output cotangent.
        let query_rows = (rows.start, 0);
        let (n, w) = (rows.len(), cols.len());
        let view = |data, heads, dw, head, r: std::ops::Range<usize>, tlen| {
            Dims::rows(data, tlen, heads, dw, self.b, head, r)
        };
        let qv: View<T> = view(self.q, d.h, d.dk, h, rows.clone(), d.tq);
        let gv: View<T> = view(self.dout, d.h, d.dv, h, rows.clone(), d.tq);
        let kv: View<T> = view(self.k, d.kv, d.dk, self.kvh, cols.clone(), d.tk);
        let vv: View<T> = view(self.v, d.kv, d.dv, self.kvh, cols.clone(), d.tk);
        // P [n, w] = exp(logit(q·kᵀ) − lse), 0 where a row does not see the key
        // SAFETY: the scratch holds `tile_len() ≥ n·w` elements.
        unsafe {
            let keys_t = at(&packed.keys_t, (0, cols.start));
            T::product_from(s.p.as_mut_ptr(), w, (qv, kv.t()), Store::Overwrite, keys_t)
        };
        let lse = &self.lse[(self.b * d.h + h) * d.tq..];
        let group = rows_per_store(w);
        for r in 0..n {
            let i = rows.start + r;
            let (a, z) = self.ranges.range(self.b, i);
            let visible = a.max(cols.start).min(cols.end) - cols.start
                ..z.min(cols.end).max(cols.start) - cols.start;
            let row = &mut s.p[r * w..(r + 1) * w];
            let slope = s.slope.get_mut(r * w..(r + 1) * w).unwrap_or_default();
            probabilities(row, slope, visible, self.scores, lse[i]);
            if (r + 1) % group == 0 || r + 1 == n {
                let first = r - r % group;
                T::store_rows(&s.p[first * w..(r + 1) * w], &mut s.p_elem, first * w);
            }
        }
        let p = View::block(T::stored(s.p, &s.p_elem, n * w), n, w, w);
        let row_at = |heads, dw, head, row| Dims::row_at(d.tk, heads, dw, self.b, head, row);
        // SAFETY: rows of this task's kv head's `dv` (the caller's contract); the scratch holds
        // the tile.
        unsafe {
            // dv[cols] += Pᵀ · dout_rows
            let dv = (grads.dv as *mut f32).add(row_at(d.kv, d.dv, self.kvh, cols.start));
            let douts = packed.douts.get(g).and_then(|p| at(p, query_rows));
            T::product_from(dv, d.kv * d.dv, (p.t(), gv), Store::Accumulate, douts);
            // dP [n, w] = dout_rows · v_colsᵀ
            let values_t = at(&packed.values_t, (0, cols.start));
            T::product_from(
                s.ds.as_mut_ptr(),
                w,
                (gv, vv.t()),
                Store::Overwrite,
                values_t,
            );
        }
        // dS = scale · slope ⊙ P ⊙ (dP − D); without soft-capping the slope is 1, and
        // `scale · 1` is `scale` exactly: the same bits without reading it.
        let scale = self.scores.scale;
        for (r, &dot) in dots.iter().enumerate().take(n) {
            let at = r * w..(r + 1) * w;
            let (ds, pr) = (&mut s.ds[at.clone()], &s.p[at.clone()]);
            match s.slope.get(at) {
                Some(sl) => vectorized(
                    #[inline(always)]
                    || {
                        for ((x, &pv), &sv) in ds.iter_mut().zip(pr).zip(sl) {
                            *x = scale * sv * pv * (*x - dot);
                        }
                    },
                ),
                None => vectorized(
                    #[inline(always)]
                    || {
                        for (x, &pv) in ds.iter_mut().zip(pr) {
                            *x = scale * pv * (*x - dot);
                        }
                    },
                ),
            }
            if (r + 1) % group == 0 || r + 1 == n {
                let first = r - r % group;
                T::store_rows(&s.ds[first * w..(r + 1) * w], &mut s.ds_elem, first * w);
            }
        }
        let ds = View::block(T::stored(s.ds, &s.ds_elem, n * w), n, w, w);
        // SAFETY: rows of this task's kv head's `dk` and of its query head's `dq` (the caller's
        // contract); the scratch holds the tile.
        unsafe {
            // dk[cols] += dSᵀ · q_rows
            let dk = (grads.dk as *mut f32).add(row_at(d.kv, d.dk, self.kvh, cols.start));
            let queries = packed.queries.get(g).and_then(|p| at(p, query_rows));
            T::product_from(dk, d.kv * d.dk, (ds.t(), qv), Store::Accumulate, queries);
            // dq[rows] += dS · k_cols
            let dq =
                (grads.dq as *mut f32).add(Dims::row_at(d.tq, d.h, d.dk, self.b, h, rows.start));
            let keys = at(&packed.keys, (cols.start, 0));
            T::product_from(dq, d.h * d.dk, (ds, kv), Store::Accumulate, keys);
        }
    }
}

/// A tile row's scores become its probabilities `exp(logit − lse)` over the `visible` columns
/// (0 elsewhere), and `slope` the logits' derivative there under soft-capping (`1 − tanh²`;
/// empty, and untouched, without it).
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
        Some(_) => vectorized(
            #[inline(always)]
            || {
                for (s, sl) in live.iter_mut().zip(&mut slope[visible.clone()]) {
                    let (x, dx) = logit(*s, scores);
                    *s = exp(x - lse);
                    *sl = dx;
                }
            },
        ),
    }
    row[..visible.start].fill(0.0);
    row[visible.end..].fill(0.0);
}
