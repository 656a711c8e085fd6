//! Fused causal self-attention for the training shapes, forward beside backward.
//!
//! Layouts (row-major): `q: [B, T, H, dk]`, `k: [B, T, KV, dk]`, `v: [B, T, KV, dv]`, `H` a
//! multiple of `KV` (grouped-query attention: query head `h` reads kv head `h / (H/KV)`).
//! Output `[B, T, H, dv]`, the layout the output projection reads, and the probabilities
//! `[B, H, T, T]` the backward needs.
//!
//! What the fusion saves against `dot_general` + `causal_softmax` + `dot_general` +
//! `transpose` on k and v broadcast to H heads: the broadcast k and v (and their gradients'
//! reduction over the group), the separate scores buffer (scores become probabilities in place),
//! all operand copies (q, k, v and the output gradient are read as strided views, the output and
//! dq written in place), and the masked half of the products: the scores are computed in row
//! blocks of [`ROW_BLOCK`] rows over only the columns their rows can see, and the backward's
//! `dk`/`dv` in column blocks over only the rows below them (what is skipped is exactly zero in
//! the probabilities and in `dS`). Time goes to two gemms per (batch, head) and row block forward
//! and four backward, one (batch, head) per task on the thread budget.
//!
//! Bits: each row of every product adds the same nonzero terms as the unfused op's, the
//! causal-softmax and softmax-backward rows are the same row code, and a GQA group's kv
//! gradients are summed in f64 in head order from -0.0, as `sum_axes` does. On the portable
//! kernel (`crate::portable`: each element one chain over the contraction, zero terms at either
//! end changing nothing) the results are therefore the unfused composition's bit for bit, and
//! the tests check that. A BLAS sums a shorter contraction in an order of its choosing (MKL on
//! an AMD EPYC does so differently from the full product; OpenBLAS's Haswell kernel too), so
//! there the results agree within a float tolerance. On every kernel the bits do not depend on
//! the thread count: threads share out whole (batch, head) blocks.

use crate::error::TensorError;
use crate::fastmath::vectorized;
use crate::matmul::{gemm_views_into_rows, MatView};
use crate::nn::{causal_softmax_row, softmax_backward_row};
use crate::parallel::{filled, for_each_chunk, Work};
use crate::tensor::Tensor;

/// What [`causal_attention`] returns.
#[derive(Clone, Debug)]
pub struct Attention {
    /// `softmax(scale·q·kᵀ, causal)·v`, `[B, T, H, dv]`.
    pub out: Tensor,
    /// The attention probabilities `[B, H, T, T]` (zero above the diagonal), for the backward.
    pub probs: Tensor,
}

/// Rows of the scores computed together: a row block's products cover only the columns its
/// rows can see, so a sequence of `T` rows computes about `(T/ROW_BLOCK + 1) / (2·T/ROW_BLOCK)`
/// of the full `T × T` block (62.5% at 256, 53% at 1024). A sequence of at most this many rows is
/// one block: the full products.
const ROW_BLOCK: usize = 64;

/// One row block of the scores: its rows and the columns they see (`0..live`).
struct RowBlock {
    rows: std::ops::Range<usize>,
    live: usize,
}

/// The sizes of one attention call, checked once.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) t: usize,
    pub(crate) h: usize,
    pub(crate) kv: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
}

impl Dims {
    /// FLOPs of products over the computed cells of `[T, T]` (the row blocks' live columns, see
    /// [`Dims::blocks`]) by `[T, w]` (or the transposes) for every (batch, query head), with
    /// `widths` the sum of their `w`.
    pub(crate) fn product_flops(&self, widths: usize) -> f64 {
        let cells: usize = self.blocks().map(|b| b.rows.len() * b.live).sum();
        2.0 * (self.b * self.h * cells) as f64 * widths as f64
    }

    /// The row blocks of a `[T, T]` score matrix, `ROW_BLOCK` rows each, with the columns a
    /// causal row in them can see (`live`: up to the block's last row).
    fn blocks(&self) -> impl Iterator<Item = RowBlock> {
        let t = self.t;
        (0..t).step_by(ROW_BLOCK).map(move |r0| {
            let r1 = (r0 + ROW_BLOCK).min(t);
            RowBlock {
                rows: r0..r1,
                live: r1,
            }
        })
    }

    /// The sizes of `q`, `k` and `v` of these shapes, or an error naming `op`.
    pub(crate) fn of(
        q: &[usize],
        k: &[usize],
        v: &[usize],
        op: &'static str,
    ) -> Result<Dims, TensorError> {
        let bad = || {
            TensorError::shape(
                op,
                format!(
                    "needs q [B,T,H,dk], k [B,T,KV,dk], v [B,T,KV,dv] with H a multiple of KV, got {:?}, {:?}, {:?}",
                    q, k, v
                ),
            )
        };
        let (&[b, t, h, dk], &[kb, kt, kv, kdk], &[vb, vt, vkv, dv]) = (q, k, v) else {
            return Err(bad());
        };
        if (kb, kt, kdk) != (b, t, dk) || (vb, vt, vkv) != (b, t, kv) || kv == 0 || h % kv != 0 {
            return Err(bad());
        }
        Ok(Dims {
            b,
            t,
            h,
            kv,
            dk,
            dv,
        })
    }

    /// Where head `h`'s first row (position 0) of batch row `b` starts in a `[B, T, H, d]`
    /// tensor; its rows are `H·d` apart.
    pub(crate) fn row_start(&self, b: usize, h: usize, d: usize) -> usize {
        (b * self.t * self.h + h) * d
    }

    /// The kv head query head `h` reads.
    pub(crate) fn kv_head(&self, h: usize) -> usize {
        h / (self.h / self.kv)
    }

    /// Rows `T` of head `head` of batch row `b` in a `[B, T, heads, d]` tensor, as a view.
    pub(crate) fn rows<'a>(
        &self,
        data: &'a [f32],
        b: usize,
        head: usize,
        heads: usize,
        d: usize,
    ) -> MatView<'a> {
        MatView {
            data: &data[(b * self.t * heads + head) * d..],
            rows: self.t,
            cols: d,
            rs: heads * d,
            cs: 1,
        }
    }
}

/// `block` (rows of `width` elements) with its first `live` columns set to `a · b` and the rest
/// to zero, returned initialised: a row block of scores (or of `dP`) over the columns its rows
/// can see.
fn live_product<'a>(
    block: &'a mut [std::mem::MaybeUninit<f32>],
    width: usize,
    live: usize,
    a: MatView<'_>,
    b: MatView<'_>,
) -> &'a mut [f32] {
    assert!(a.rows * width == block.len() && b.cols == live && live <= width); // ok: caller's invariant
                                                                               // SAFETY: `block` holds `a.rows` rows of `width ≥ live` elements, and nothing else touches
                                                                               // it meanwhile.
    unsafe { gemm_views_into_rows(block.as_mut_ptr().cast::<f32>(), width, a, b) };
    for row in block.chunks_mut(width.max(1)) {
        row[live..].fill(std::mem::MaybeUninit::new(0.0));
    }
    // SAFETY: every element was written just above (`[MaybeUninit<f32>]` and `[f32]` share a
    // layout).
    unsafe { &mut *(block as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) }
}

/// Rows `range` of a view.
fn rows_of(m: MatView<'_>, range: std::ops::Range<usize>) -> MatView<'_> {
    MatView {
        data: &m.data[range.start * m.rs..],
        rows: range.len(),
        ..m
    }
}

/// Rows `rows` and columns `0..cols` of a row-major matrix whose rows are `stride` apart.
fn sub_block(
    data: &[f32],
    rows: std::ops::Range<usize>,
    cols: usize,
    stride: usize,
) -> MatView<'_> {
    MatView {
        data: &data[rows.start * stride..],
        rows: rows.len(),
        cols,
        rs: stride,
        cs: 1,
    }
}

/// The transpose of a view.
fn t(m: MatView<'_>) -> MatView<'_> {
    MatView {
        rows: m.cols,
        cols: m.rows,
        rs: m.cs,
        cs: m.rs,
        ..m
    }
}

/// Causal (grouped-query) self-attention `softmax(scale·q·kᵀ, causal)·v`, fused: see the module
/// docs for layouts. Runs one (batch, head) block per task on up to `threads` threads; the
/// result does not depend on `threads`.
///
/// # Errors
/// Shapes that do not fit the layouts.
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    threads: usize,
) -> Result<Attention, TensorError> {
    let d = Dims::of(q.shape(), k.shape(), v.shape(), "causal_attention")?;
    // Two products per (batch, head), over each row block's live columns (see `ROW_BLOCK`).
    let _span =
        ferrotext_profile::span("causal_attention").map(|s| s.flops(d.product_flops(d.dk + d.dv)));
    let (tt, heads) = (d.t * d.t, d.b * d.h);
    // Both outputs are written whole by the products (no zeroing first); each head's output
    // rows go straight into their places in `[B, T, H, dv]` (no transpose after).
    let mut out: Vec<f32> = Vec::with_capacity(heads * d.t * d.dv);
    let out_at = out.as_mut_ptr() as usize;
    let heads_into = |probs: &mut [std::mem::MaybeUninit<f32>]| {
        for_each_chunk(probs, tt.max(1), threads, Work::Heavy, |bh, p| {
            let (b, h) = (bh / d.h, bh % d.h);
            let kvh = d.kv_head(h);
            let qv = d.rows(q.data(), b, h, d.h, d.dk);
            let kv = d.rows(k.data(), b, kvh, d.kv, d.dk);
            let vv = d.rows(v.data(), b, kvh, d.kv, d.dv);
            // SAFETY: `out` holds `B·T·H·dv` elements; rows `(b, s, h)` for every `s` belong
            // to this (batch, head) alone.
            let o = unsafe { (out_at as *mut f32).add(d.row_start(b, h, d.dv)) };
            // SAFETY: as above; those rows are `H·dv` apart.
            unsafe { head_forward(d, [qv, kv, vv], p, (o, d.h * d.dv), scale) };
        });
    };
    // SAFETY: every (batch, head) chunk is visited, and its products write all of its
    // probabilities.
    let probs = unsafe { filled(heads * tt, heads_into) };
    // SAFETY: the chunks above wrote every (batch, position, head) row of the output.
    unsafe { out.set_len(heads * d.t * d.dv) };
    let out = Tensor::new(vec![d.b, d.t, d.h, d.dv], out)?;
    Ok(Attention {
        out,
        probs: Tensor::new(vec![d.b, d.h, d.t, d.t], probs)?,
    })
}

/// One (batch, query head) of the forward, on its rows of `q`, `k` and `v` as views: per row
/// block, the scores `q_rows · k_liveᵀ` in place of its probabilities `p` (`[T, T]`, every
/// element written), the causal softmax, and `out[rows] = P[rows, live] · v_live` into its `T`
/// output rows at `out`.
///
/// # Safety
/// `out.0` points at `T` rows of `dv` writable elements, `out.1` apart, which no one else
/// writes meanwhile.
pub(crate) unsafe fn head_forward(
    d: Dims,
    [qv, kv, vv]: [MatView<'_>; 3],
    p: &mut [std::mem::MaybeUninit<f32>],
    out: RowsOut,
    scale: f32,
) {
    for RowBlock { rows, live } in d.blocks() {
        // scores [rows, live] = q_rows · k_liveᵀ, in place of the probabilities
        let block = live_product(
            &mut p[rows.start * d.t..rows.end * d.t],
            d.t,
            live,
            rows_of(qv, rows.clone()),
            t(rows_of(kv, 0..live)),
        );
        for (i, row) in block.chunks_mut(d.t).enumerate() {
            causal_softmax_row(row, rows.start + i + 1, scale);
        }
        // out[rows] = probs[rows, live] · v_live
        // SAFETY: rows `rows` of this head's output (the caller's contract).
        unsafe {
            gemm_views_into_rows(
                out.0.add(rows.start * out.1),
                out.1,
                sub_block(block, 0..rows.len(), live, d.t),
                rows_of(vv, 0..live),
            );
        }
    }
}

/// The cotangents `(dq, dk, dv)` of [`causal_attention`] for an output cotangent `dout`
/// `[B, T, H, dv]`, from the forward's `probs` `P`. Per (batch, head):
/// `dP = dout·vᵀ`, `dS = scale·P ⊙ (dP − rowsum(dP ⊙ P))` (the softmax backward),
/// `dq = dS·k`, `dk = dSᵀ·q`, `dv = Pᵀ·dout`; under GQA a kv head's `dk`, `dv` sum over the
/// query heads that read it.
///
/// # Errors
/// Shapes that do not fit the layouts or `probs`.
pub fn causal_attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    probs: &Tensor,
    dout: &Tensor,
    scale: f32,
    threads: usize,
) -> Result<(Tensor, Tensor, Tensor), TensorError> {
    let d = Dims::of(q.shape(), k.shape(), v.shape(), "causal_attention_backward")?;
    // dP, dq, dk and dv: four products per (batch, head) over the row blocks' live columns.
    let _span = ferrotext_profile::span("causal_attention_backward")
        .map(|s| s.flops(d.product_flops(2 * (d.dk + d.dv))));
    d.check_backward_operands(probs.shape(), dout.shape())?;
    let (tt, heads) = (d.t * d.t, d.b * d.h);
    // Per (batch, query head), contiguous: [dk_h | dv_h | dS scratch] under GQA (its group's
    // heads are summed after), only dS otherwise; its dq rows, and without GQA its dk and dv
    // rows, go straight into their places in `[B, T, heads, w]`.
    let grouped = d.h != d.kv;
    let rest = if grouped {
        d.t * d.dk + d.t * d.dv + tt
    } else {
        tt
    };
    let mut dq: Vec<f32> = Vec::with_capacity(heads * d.t * d.dk);
    let dq_at = dq.as_mut_ptr() as usize;
    let direct = |w: usize| Vec::<f32>::with_capacity(if grouped { 0 } else { heads * d.t * w });
    let (mut dk_direct, mut dv_direct) = (direct(d.dk), direct(d.dv));
    let (dk_at, dv_at) = (
        dk_direct.as_mut_ptr() as usize,
        dv_direct.as_mut_ptr() as usize,
    );
    let heads_into = |per_head: &mut [std::mem::MaybeUninit<f32>]| {
        for_each_chunk(per_head, rest.max(1), threads, Work::Heavy, |bh, r| {
            let (b, h) = (bh / d.h, bh % d.h);
            let kvh = d.kv_head(h);
            // Where this head's dk and dv rows go, and how far apart.
            let (dk_rows, dv_rows, ds) = if grouped {
                let (dkb, r) = r.split_at_mut(d.t * d.dk);
                let (dvb, ds) = r.split_at_mut(d.t * d.dv);
                let at = |b: &mut [std::mem::MaybeUninit<f32>]| b.as_mut_ptr().cast::<f32>();
                ((at(dkb), d.dk), (at(dvb), d.dv), ds)
            } else {
                let at = |base: usize, w: usize| {
                    // SAFETY: `base` is a `[B, T, H, w]` buffer; head `h`'s rows start here.
                    unsafe { (base as *mut f32).add(d.row_start(b, h, w)) }
                };
                (
                    (at(dk_at, d.dk), d.h * d.dk),
                    (at(dv_at, d.dv), d.h * d.dv),
                    r,
                )
            };
            let x = HeadInputs {
                p: &probs.data()[bh * tt..(bh + 1) * tt],
                dout: d.rows(dout.data(), b, h, d.h, d.dv),
                v: d.rows(v.data(), b, kvh, d.kv, d.dv),
                k: d.rows(k.data(), b, kvh, d.kv, d.dk),
                q: d.rows(q.data(), b, h, d.h, d.dk),
            };
            // SAFETY: `dq` holds `B·T·H·dk` elements; this (batch, head)'s rows of it, `H·dk`
            // apart, which no other chunk writes.
            let dq_rows = unsafe { ((dq_at as *mut f32).add(d.row_start(b, h, d.dk)), d.h * d.dk) };
            // SAFETY: as above.
            unsafe { head_ds_dq(d, &x, ds, dq_rows, scale) };
            // SAFETY: the row blocks above wrote every element of dS.
            let ds = unsafe { &*(ds as *const [_] as *const [f32]) };
            // SAFETY: rows of this head's dk and dv, which no other (batch, head) writes.
            unsafe { head_dk_dv(d, &x, ds, dk_rows, dv_rows) };
        });
    };
    // SAFETY: every (batch, head) chunk is visited, and its products write all of its dS (and
    // under GQA its dk and dv) elements.
    let per_head = unsafe { filled(heads * rest, heads_into) };
    // SAFETY: the chunks above wrote every (batch, position, head) row of dq.
    unsafe { dq.set_len(heads * d.t * d.dk) };
    let dq = Tensor::new(vec![d.b, d.t, d.h, d.dk], dq)?;
    if !grouped {
        // SAFETY: without GQA the chunks above wrote every (batch, position, head) row of dk
        // and dv.
        unsafe {
            dk_direct.set_len(heads * d.t * d.dk);
            dv_direct.set_len(heads * d.t * d.dv);
        }
        return Ok((
            dq,
            Tensor::new(vec![d.b, d.t, d.kv, d.dk], dk_direct)?,
            Tensor::new(vec![d.b, d.t, d.kv, d.dv], dv_direct)?,
        ));
    }
    let dk = group_sum(&per_head, rest, 0, d.dk, d, threads)?;
    let dv = group_sum(&per_head, rest, d.t * d.dk, d.dv, d, threads)?;
    Ok((dq, dk, dv))
}

impl Dims {
    /// `probs` is `[B, H, T, T]` and `dout` `[B, T, H, dv]`, as [`causal_attention_backward`]
    /// needs.
    pub(crate) fn check_backward_operands(
        &self,
        probs: &[usize],
        dout: &[usize],
    ) -> Result<(), TensorError> {
        let d = self;
        if probs != [d.b, d.h, d.t, d.t] || dout != [d.b, d.t, d.h, d.dv] {
            return Err(TensorError::shape(
                "causal_attention_backward",
                format!(
                    "probs must be [{b}, {h}, {t}, {t}] and dout [{b}, {t}, {h}, {dv}], got {:?} and {:?}",
                    probs,
                    dout,
                    b = d.b,
                    h = d.h,
                    t = d.t,
                    dv = d.dv
                ),
            ));
        }
        Ok(())
    }
}

/// One (batch, query head)'s inputs to the backward: its probabilities `[T, T]` and its rows of
/// `dout`, `v`, `k` and `q` as views.
pub(crate) struct HeadInputs<'a> {
    pub(crate) p: &'a [f32],
    pub(crate) dout: MatView<'a>,
    pub(crate) v: MatView<'a>,
    pub(crate) k: MatView<'a>,
    pub(crate) q: MatView<'a>,
}

/// Where a head's output, `dq`, `dk` or `dv` rows go: its first row, and how many elements
/// apart they are.
pub(crate) type RowsOut = (*mut f32, usize);

/// The backward's row phase for one (batch, query head): per row block,
/// `dP[rows, live] = dout_rows · v_liveᵀ`, `dS` in place over the live columns (beyond them `P`
/// is 0, and so is `dS`), and `dq[rows] = dS[rows, live] · k_live`. Writes every element of `ds`.
///
/// # Safety
/// `dq.0` points at the head's `T` rows of `dk` writable elements, `dq.1` apart, which no one
/// else writes meanwhile.
pub(crate) unsafe fn head_ds_dq(
    d: Dims,
    x: &HeadInputs<'_>,
    ds: &mut [std::mem::MaybeUninit<f32>],
    dq: RowsOut,
    scale: f32,
) {
    for RowBlock { rows, live } in d.blocks() {
        let block = live_product(
            &mut ds[rows.start * d.t..rows.end * d.t],
            d.t,
            live,
            rows_of(x.dout, rows.clone()),
            t(rows_of(x.v, 0..live)),
        );
        let p_rows = &x.p[rows.start * d.t..rows.end * d.t];
        for (drow, prow) in block.chunks_mut(d.t).zip(p_rows.chunks(d.t)) {
            softmax_backward_row(&mut drow[..live], &prow[..live], scale);
        }
        // SAFETY: rows `rows` of this head's dq (the caller's contract).
        unsafe {
            gemm_views_into_rows(
                dq.0.add(rows.start * dq.1),
                dq.1,
                sub_block(block, 0..rows.len(), live, d.t),
                rows_of(x.k, 0..live),
            );
        }
    }
}

/// The backward's column phase for one head: per column block, `dS` and `P` are zero in it above
/// its first row, so `dk[cols] = dS[below, cols]ᵀ · q_below` and
/// `dv[cols] = P[below, cols]ᵀ · dout_below`.
///
/// # Safety
/// `dk_rows` and `dv_rows` point at this head's `T` rows of `dk` and `dv` (in its own block under
/// GQA, else in the `[B, T, H, w]` outputs), which no other (batch, head) writes.
pub(crate) unsafe fn head_dk_dv(
    d: Dims,
    x: &HeadInputs<'_>,
    ds: &[f32],
    dk_rows: RowsOut,
    dv_rows: RowsOut,
) {
    for RowBlock { rows: cols, .. } in d.blocks() {
        let below = cols.start..d.t;
        // SAFETY: rows `cols` of this head's dk and dv (in its own block under GQA, else
        // in the `[B, T, H, w]` outputs), which no other (batch, head) writes.
        unsafe {
            gemm_views_into_rows(
                dk_rows.0.add(cols.start * dk_rows.1),
                dk_rows.1,
                t(sub_block(&ds[cols.start..], below.clone(), cols.len(), d.t)),
                rows_of(x.q, below.clone()),
            );
            gemm_views_into_rows(
                dv_rows.0.add(cols.start * dv_rows.1),
                dv_rows.1,
                t(sub_block(
                    &x.p[cols.start..],
                    below.clone(),
                    cols.len(),
                    d.t,
                )),
                rows_of(x.dout, below.clone()),
            );
        }
    }
}

/// Elements of a kv head's row summed together in [`group_sum`] (one AVX-512 register of f64
/// holds 8; two registers per lane group keep the adds independent).
const GROUP_LANES: usize = 16;

/// `[B, T, KV, w]` from per-(batch, query head) blocks `[T, w]` at `offset` in chunks of
/// `stride`: each kv head's value is the sum over its group's query heads, in head order, in
/// f64 from -0.0 (as `sum_axes` sums the broadcast's cotangent), or the block itself when
/// every group has one head.
pub(crate) fn group_sum(
    per_head: &[f32],
    stride: usize,
    offset: usize,
    w: usize,
    d: Dims,
    threads: usize,
) -> Result<Tensor, TensorError> {
    let g = d.h / d.kv;
    let rows_into = |out: &mut [std::mem::MaybeUninit<f32>]| {
        // One chunk per (batch, position): its KV heads' rows.
        for_each_chunk(out, (d.kv * w).max(1), threads, Work::Light, |bt, row| {
            let (b, s) = (bt / d.t, bt % d.t);
            for (kvh, dst) in row.chunks_mut(w.max(1)).enumerate() {
                let src = |j: usize| {
                    let bh = b * d.h + kvh * g + j;
                    &per_head[bh * stride + offset + s * w..][..w]
                };
                if g == 1 {
                    for (o, &x) in dst.iter_mut().zip(src(0)) {
                        o.write(x);
                    }
                    continue;
                }
                // Lanes of 16 elements, each summed over the group in head order: the same
                // sums as one element at a time, in vector registers.
                for (lane, dst) in dst.chunks_mut(GROUP_LANES).enumerate() {
                    let at = lane * GROUP_LANES;
                    vectorized(
                        #[inline(always)]
                        || {
                            let mut acc = [-0.0f64; GROUP_LANES];
                            for j in 0..g {
                                for (a, &x) in acc.iter_mut().zip(&src(j)[at..at + dst.len()]) {
                                    *a += f64::from(x);
                                }
                            }
                            for (o, &a) in dst.iter_mut().zip(&acc) {
                                o.write(a as f32);
                            }
                        },
                    );
                }
            }
        });
    };
    // SAFETY: every (batch, position) chunk is visited and writes every element of its rows.
    let out = unsafe { filled(d.b * d.t * d.kv * w, rows_into) };
    Tensor::new(vec![d.b, d.t, d.kv, w], out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::{dot_general, DotDims};
    use crate::nn::{causal_softmax, softmax_backward_scaled};

    fn rand(shape: &[usize], seed: u32) -> Tensor {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        Tensor::from_fn(shape, |_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2000) as f32 / 1000.0 - 1.0
        })
    }

    fn dims(lc: usize, rc: usize, lb: [usize; 2], rb: [usize; 2]) -> DotDims {
        DotDims {
            lhs_contracting: vec![lc],
            rhs_contracting: vec![rc],
            lhs_batch: lb.to_vec(),
            rhs_batch: rb.to_vec(),
        }
    }

    /// The unfused composition the models run today (models::nn::attention and the
    /// transposes autodiff takes), forward and backward.
    fn unfused(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        dout: &Tensor,
        scale: f32,
    ) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
        let (b, t, h, _) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
        let kv = k.shape()[2];
        let g = h / kv;
        let wide = |x: &Tensor| {
            let w = x.shape()[3];
            x.broadcast_in_dim(&[b, t, kv, g, w], &[0, 1, 2, 4])
                .unwrap()
                .reshape(&[b, t, h, w])
                .unwrap()
        };
        let (kw, vw) = (wide(k), wide(v));
        let scores = dot_general(q, &kw, &dims(3, 3, [0, 2], [0, 2]), 1).unwrap();
        let probs = causal_softmax(&scores, scale).unwrap();
        let out = dot_general(&probs, &vw, &dims(3, 1, [0, 1], [0, 2]), 1)
            .unwrap()
            .transpose(&[0, 2, 1, 3])
            .unwrap();
        // backward: dP = dout·vᵀ over (B, H), contracting dv
        let dp = dot_general(dout, &vw, &dims(3, 3, [0, 2], [0, 2]), 1).unwrap();
        let ds = softmax_backward_scaled(&probs, &dp, scale).unwrap();
        let back = |x: Tensor| x.transpose(&[0, 2, 1, 3]).unwrap();
        let dq = back(dot_general(&ds, &kw, &dims(3, 1, [0, 1], [0, 2]), 1).unwrap());
        let dkw = back(dot_general(&ds, q, &dims(2, 1, [0, 1], [0, 2]), 1).unwrap());
        let dvw = back(dot_general(&probs, dout, &dims(2, 1, [0, 1], [0, 2]), 1).unwrap());
        let narrow = |x: Tensor| {
            let w = x.shape()[3];
            if g == 1 {
                return x;
            }
            x.reshape(&[b, t, kv, g, w])
                .unwrap()
                .sum_axes(&[3])
                .unwrap()
        };
        (out, probs, dq, narrow(dkw), narrow(dvw))
    }

    /// The unfused composition, on odd sizes, with and without GQA (bit for bit on the portable
    /// kernel, within a tolerance on the others), and the same bits on 1 to 3 threads on every
    /// kernel: threads only share out whole (batch, head) blocks.
    #[test]
    fn fused_attention_is_the_unfused_composition() {
        for &(b, t, h, kv, dk, dv) in &[
            (1, 1, 1, 1, 1, 1),
            (2, 5, 3, 3, 4, 3),
            (3, 13, 6, 2, 7, 5),
            (2, 64, 8, 4, 32, 32),
            (2, 150, 4, 2, 24, 16),
            (1, 256, 2, 2, 32, 32),
        ] {
            let q = rand(&[b, t, h, dk], 1);
            let k = rand(&[b, t, kv, dk], 2);
            let v = rand(&[b, t, kv, dv], 3);
            let dout = rand(&[b, t, h, dv], 4);
            let scale = 1.0 / (dk as f32).sqrt();
            let (out, probs, dq, dk_, dv_) = unfused(&q, &k, &v, &dout, scale);
            let one = causal_attention(&q, &k, &v, scale, 1).unwrap();
            let grads = causal_attention_backward(&q, &k, &v, &one.probs, &dout, scale, 1).unwrap();
            let at = format!("{b}×{t}×{h}/{kv}×{dk}/{dv}");
            crate::portable::assert_equal_across_routes(&one.out, &out, &format!("out {at}"));
            crate::portable::assert_equal_across_routes(&one.probs, &probs, &format!("probs {at}"));
            crate::portable::assert_equal_across_routes(&grads.0, &dq, &format!("dq {at}"));
            crate::portable::assert_equal_across_routes(&grads.1, &dk_, &format!("dk {at}"));
            crate::portable::assert_equal_across_routes(&grads.2, &dv_, &format!("dv {at}"));
            for threads in [2, 3] {
                let a = causal_attention(&q, &k, &v, scale, threads).unwrap();
                assert_eq!(a.out, one.out, "out {at} on {threads}");
                assert_eq!(a.probs, one.probs, "probs {at} on {threads}");
                let g =
                    causal_attention_backward(&q, &k, &v, &a.probs, &dout, scale, threads).unwrap();
                assert_eq!(g, grads, "gradients {at} on {threads}");
            }
        }
    }

    /// The backward against central differences of `Σ out ⊙ w` (f64 objective), GQA on.
    #[test]
    fn backward_matches_finite_differences() {
        let (b, t, h, kv, dk, dv) = (1, 4, 4, 2, 3, 2);
        let q = rand(&[b, t, h, dk], 5);
        let k = rand(&[b, t, kv, dk], 6);
        let v = rand(&[b, t, kv, dv], 7);
        let w = rand(&[b, t, h, dv], 8);
        let obj = |q: &Tensor, k: &Tensor, v: &Tensor| -> f64 {
            let a = causal_attention(q, k, v, 0.5, 1).unwrap();
            a.out
                .data()
                .iter()
                .zip(w.data())
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum()
        };
        let a = causal_attention(&q, &k, &v, 0.5, 1).unwrap();
        let (gq, gk, gv) = causal_attention_backward(&q, &k, &v, &a.probs, &w, 0.5, 1).unwrap();
        let h_ = 1e-2f32;
        for (which, x, g) in [(0, &q, &gq), (1, &k, &gk), (2, &v, &gv)] {
            for i in 0..x.len() {
                let (mut p, mut m) = (x.clone(), x.clone());
                p.data_mut()[i] += h_;
                m.data_mut()[i] -= h_;
                let f = |y: &Tensor| match which {
                    0 => obj(y, &k, &v),
                    1 => obj(&q, y, &v),
                    _ => obj(&q, &k, y),
                };
                let fd = (f(&p) - f(&m)) / (2.0 * f64::from(h_));
                assert!(
                    (fd - f64::from(g.data()[i])).abs() < 1e-3,
                    "operand {which} [{i}]"
                );
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let q = Tensor::zeros(&[1, 2, 3, 4]);
        let k = Tensor::zeros(&[1, 2, 2, 4]); // 3 heads over 2 kv heads
        assert!(causal_attention(&q, &k, &k, 1.0, 1).is_err());
        let k = Tensor::zeros(&[1, 2, 1, 4]);
        let a = causal_attention(&q, &k, &k, 1.0, 1).unwrap();
        assert!(causal_attention_backward(
            &q,
            &k,
            &k,
            &a.probs,
            &Tensor::zeros(&[1, 2, 3, 5]),
            1.0,
            1
        )
        .is_err());
    }
}
