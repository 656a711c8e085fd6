//! Memory-efficient attention: tiled over queries and keys with an online softmax, keeping only
//! the output and each row's log-sum-exp for the backward, which recomputes the scores tile by
//! tile (FlashAttention-2's schedule, on the CPU). Memory linear in the sequence length.
//!
//! Layouts (row-major): `q: [B, Tq, H, dk]`, `k: [B, Tk, KV, dk]`, `v: [B, Tk, KV, dv]`, `H` a
//! multiple of `KV` (grouped-query attention: query head `h` reads kv head `h / (H/KV)`).
//! Output `[B, Tq, H, dv]` (the layout the output projection reads) and the log-sum-exp
//! `[B, H, Tq]`. `Tq` and `Tk` differ when the queries are a slice of the keys' sequence
//! (context parallelism).
//!
//! Which keys a query sees is a contiguous range per row ([`KeyRanges`]): causal masking, a
//! sliding window, packed documents and a query block of a longer sequence all reduce to one.
//! The scores are `x = scale·q·kᵀ`, optionally soft-capped (`cap·tanh(x/cap)`, Gemma 2's
//! attention-logit soft-capping), then softmax over the visible keys.
//!
//! Schedule. Forward: one (batch, query head) per task; per block of [`QUERY_BLOCK`] query
//! rows, the key blocks of [`KEY_BLOCK`] columns its rows can see, in order: scores by one
//! product, the running row maximum and sum updated, the partial output rescaled and the
//! block's `P·v` added by a second product. Backward: one (batch, kv head) per task; per key
//! block, per query head of the group, per query block that sees it: the scores again,
//! `P = exp(x − lse)`, `dv += Pᵀ·dout`, `dP = dout·vᵀ`, `dS = P ⊙ (dP − D)` (`D` the row sums
//! of `dout ⊙ out`), `dk += dSᵀ·q`, `dq += dS·k`. Every output element is owned by one task and
//! summed in that task's fixed block order, so the bits do not depend on the thread count; on
//! the portable product kernel (`deterministic=true`) they do not depend on the processor
//! either. Blocks are fixed by the shapes alone: [`QUERY_BLOCK`] rows by [`KEY_BLOCK`] columns,
//! aligned at 0.
//!
//! Cost: the forward's two products per live tile; the backward's five (the scores again, and
//! `dP`, `dv`, `dk`, `dq`). A sequence of at most [`KEY_BLOCK`] keys is one key block: the
//! forward is then the plain two-pass softmax on one tile. An operand that several of a task's
//! tiles read (the keys and values by every query block, backward also a head's queries and
//! output cotangent by every key block) is packed for the product kernel once per task where
//! its kernel packs ([`packs_once`]), and each tile reads its block from there: the same bits
//! as a tile packing its own block, which a tile whose keys start inside a pair or panel of the
//! packing still does.

mod backward;
mod elem;
mod forward;
mod mask;

pub(crate) use backward::backward;
pub use backward::flash_attention_backward;
pub(crate) use forward::forward;
pub use forward::{flash_attention, Flash};
pub use mask::KeyRanges;

use crate::error::TensorError;
use elem::View;

/// Query rows per tile: the online softmax's row block.
pub(crate) const QUERY_BLOCK: usize = 64;

/// Key columns per tile: the scores of a tile (`QUERY_BLOCK × KEY_BLOCK` f32, 64 KiB) and the
/// tile of keys and values (`KEY_BLOCK × d` each) stay in the core's L2 cache.
pub(crate) const KEY_BLOCK: usize = 256;

/// How the scores become logits: `x = scale·(q·k)`, then `cap·tanh(x/cap)` when `softcap` is
/// set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    /// The factor on `q·k` (`1/√dk` by default; `query_pre_attn_scalar^-½` for Gemma).
    pub scale: f32,
    /// Attention-logit soft-capping (Gemma 2's `attn_logit_softcapping`); `None`: off.
    pub softcap: Option<f32>,
}

/// The sizes of one attention call, checked once.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) tq: usize,
    pub(crate) tk: usize,
    pub(crate) h: usize,
    pub(crate) kv: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
}

impl Dims {
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
                    "needs q [B,Tq,H,dk], k [B,Tk,KV,dk], v [B,Tk,KV,dv] with H a multiple of KV, \
                     got {q:?}, {k:?}, {v:?}"
                ),
            )
        };
        let (&[b, tq, h, dk], &[kb, tk, kv, kdk], &[vb, vt, vkv, dv]) = (q, k, v) else {
            return Err(bad());
        };
        if (kb, kdk) != (b, dk) || (vb, vt, vkv) != (b, tk, kv) || kv == 0 || h % kv != 0 {
            return Err(bad());
        }
        Ok(Dims {
            b,
            tq,
            tk,
            h,
            kv,
            dk,
            dv,
        })
    }

    /// Query heads per kv head.
    pub(crate) fn group(&self) -> usize {
        self.h / self.kv
    }

    /// Rows `rows` of head `head` of batch row `b` in a `[B, T, heads, d]` tensor (`t` rows a
    /// batch row), as a view.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rows<T>(
        data: &[T],
        t: usize,
        heads: usize,
        d: usize,
        b: usize,
        head: usize,
        rows: std::ops::Range<usize>,
    ) -> View<'_, T> {
        View {
            data: &data[((b * t + rows.start) * heads + head) * d..],
            rows: rows.len(),
            cols: d,
            rs: heads * d,
            cs: 1,
        }
    }

    /// Where row `row` of head `head` of batch row `b` starts in a `[B, T, heads, d]` tensor.
    pub(crate) fn row_at(
        t: usize,
        heads: usize,
        d: usize,
        b: usize,
        head: usize,
        row: usize,
    ) -> usize {
        ((b * t + row) * heads + head) * d
    }

    /// The score cells of one key tile's width per query row, over every (batch, query head):
    /// the size of the work a call is split by.
    pub(crate) fn cells(&self) -> usize {
        self.b * self.h * self.tq * self.tk.min(KEY_BLOCK)
    }

    /// Rows of the largest query block: `QUERY_BLOCK`, or all of `Tq` when shorter.
    pub(crate) fn block_rows(&self) -> usize {
        QUERY_BLOCK.min(self.tq)
    }

    /// Elements of the largest tile (`block_rows × min(KEY_BLOCK, Tk)`): a task's scratch is
    /// sized by it, not by the fixed `QUERY_BLOCK × KEY_BLOCK` (64 KiB of `f32` a buffer).
    pub(crate) fn tile_len(&self) -> usize {
        self.block_rows() * KEY_BLOCK.min(self.tk)
    }

    /// The query blocks: `QUERY_BLOCK` rows each from 0, the last shorter.
    pub(crate) fn query_blocks(&self) -> impl Iterator<Item = std::ops::Range<usize>> {
        let tq = self.tq;
        (0..tq)
            .step_by(QUERY_BLOCK)
            .map(move |r| r..(r + QUERY_BLOCK).min(tq))
    }

    /// FLOPs of `products` products of a tile's size over the live tiles of every (batch, query
    /// head), each `width` wide (the profiler's figure).
    pub(crate) fn tile_flops(&self, ranges: &KeyRanges, width: usize) -> f64 {
        let mut cells = 0usize;
        for b in 0..self.b {
            for rows in self.query_blocks() {
                let (lo, hi) = ranges.span(b, rows.clone());
                cells += rows.len() * (hi - lo);
            }
        }
        2.0 * (self.h * cells) as f64 * width as f64
    }
}

/// Whether a task packs an operand once for its tiles ([`elem::Elem::pack`]) rather than each
/// tile packing its block of it: where `tiles` tiles read each block (a causal head's keys at
/// 2,048 tokens: 16 query blocks on average). Off in tests that compare the two.
pub(crate) fn packs_once(tiles: usize) -> bool {
    #[cfg(test)]
    if tests::tiles_pack_alone() {
        return false;
    }
    tiles > 1
}

thread_local! {
    /// A thread's `f32` tiles (scores and probabilities, `dP` and `dS`), kept between calls:
    /// zeroed afresh for every task they were a `memset` of up to 128 KiB a task, which no tile
    /// needs (a product writes each element of a tile before anything reads it).
    static TILES: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Runs `f` on `len` `f32` elements of this thread's kept tile buffer ([`TILES`], grown as
/// needed). Their contents are whatever the buffer's last use left: every tile is written by a
/// product before it is read. A nested use gets a buffer of its own.
pub(crate) fn with_tiles<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buffer = TILES.take();
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    let out = f(&mut buffer[..len]);
    TILES.set(buffer);
    out
}

/// The logit of a raw score `s = q·k`: `scale·s`, soft-capped when asked. Also returns
/// `d logit / d (scale·s)` (1 without a cap), which the backward multiplies `dS` by.
#[inline(always)]
pub(crate) fn logit(s: f32, scores: Scores) -> (f32, f32) {
    let x = scores.scale * s;
    match scores.softcap {
        None => (x, 1.0),
        Some(cap) => {
            // `fixed_math`'s tanh: the same bits on every processor (the C library's is not).
            let th = crate::fixed_math::tanh(x / cap);
            (cap * th, 1.0 - th * th)
        }
    }
}

/// A tile row's value at column `i`: `x` where the row sees the key (`i` in `visible`), `−∞`
/// where it does not, so that `exp(x − m)` is exactly 0 there for any finite `m`. Lets a tile's
/// row be computed whole, in vector lanes, instead of its visible part and zero fills.
#[inline(always)]
pub(crate) fn masked(i: usize, visible: &std::ops::Range<usize>, x: f32) -> f32 {
    // One unsigned comparison on 32-bit lanes (a tile row is at most `KEY_BLOCK` wide): `i −
    // start` wraps past `len` below the range.
    let (start, len) = (visible.start as u32, visible.len() as u32);
    if (i as u32).wrapping_sub(start) < len {
        x
    } else {
        f32::NEG_INFINITY
    }
}

#[cfg(test)]
mod tests;
