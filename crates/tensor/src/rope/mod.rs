//! Rotary position embeddings: the frequency table (plain, or YaRN-extended) and the rotation
//! (rotate-half or interleaved pairs) on `x: [.., seq, heads, head_dim]`.
//!
//! Pair `i` of position `p` turns by `p·f_i`. Plain RoPE has `f_i = θ^(−2i/dim)`. YaRN (DeepSeek
//! V3, MaxText `rope_type: yarn`) keeps the high frequencies, divides the low ones by `factor`,
//! and ramps linearly between them over the pairs whose wavelength falls between `beta_fast` and
//! `beta_slow` rotations of the original context. The attention's softmax scale correction
//! (`mscale`) is not part of the rotation: [`Rope::attention_scale_factor`] gives it. Llama 3
//! (`rope_type: llama3`) divides the pairs whose wavelength exceeds `original / low_freq_factor`
//! positions by `factor`, keeps those shorter than `original / high_freq_factor`, and blends
//! between them by `original / wavelength`. A [`Rope`] has at most one of the two extensions.
//!
//! The frequencies, the rotation tables' sines and cosines and YaRN's scale come from
//! `fixed_math` (pure Rust), never the C library: their bits are the same on every processor.

use std::mem::MaybeUninit;
use std::sync::Arc;

use crate::error::TensorError;
use crate::fastmath::vectorized;
use crate::fixed_math::{ln_f64 as ln, pow_f64 as pow};
use crate::nn::RowOut;
use crate::parallel::{for_each_chunk, kernel_threads, Work};
use crate::tensor::Tensor;

/// YaRN context extension of a RoPE table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// Context extension factor (`rope_factor`).
    pub factor: f32,
    /// The pre-training context (`original_max_position_embeddings`).
    pub original_max_position: usize,
    /// Rotations above which a pair keeps its frequency (`beta_fast`).
    pub beta_fast: f32,
    /// Rotations below which a pair is fully interpolated (`beta_slow`).
    pub beta_slow: f32,
    /// `mscale` of the attention scale correction (HF `mscale_all_dim`; 0: none).
    pub mscale: f32,
    /// The factor on the rotation's `sin` and `cos` (HF `attention_factor`: transformers
    /// derives it as `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`, 1 when
    /// the two mscales are equal). Scales the rotated dims of queries and keys alike.
    pub attention_factor: f32,
}

/// Llama 3's frequency scaling of a RoPE table (transformers' `rope_type: llama3`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3 {
    /// Division of the low frequencies (`factor`).
    pub factor: f32,
    /// Wavelengths above `original_max_position / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f32,
    /// Wavelengths below `original_max_position / high_freq_factor` are kept.
    pub high_freq_factor: f32,
    /// The pre-training context (`original_max_position_embeddings`).
    pub original_max_position: usize,
}

/// The position scalings of transformers' `rope_type: linear` and `dynamic` (any family whose
/// rotary embedding reads `ROPE_INIT_FUNCTIONS`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PositionScaling {
    /// `linear`: every frequency divided by `factor` (positions interpolated).
    Linear {
        /// The divisor (`factor`).
        factor: f32,
    },
    /// `dynamic` (NTK-aware): for a call whose last position is `L − 1`, θ becomes
    /// `θ·(factor·L'/max − (factor − 1))^(dim/(dim − 2))` with `L' = max(L, max)`: plain RoPE up
    /// to `max` positions, a larger θ past them, recomputed for each call's length as
    /// transformers' `dynamic_rope_update` does (positions already in a key/value cache keep the
    /// rotation they were given).
    Dynamic {
        /// `factor`.
        factor: f32,
        /// `max_position_embeddings`.
        max_position: usize,
    },
}

/// A RoPE variant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Base θ (`rope_max_timescale`).
    pub theta: f32,
    /// Pairs are `(2i, 2i+1)` (DeepSeek) instead of `(i, i + dim/2)` (rotate-half).
    pub interleaved: bool,
    /// YaRN extension, if any.
    pub yarn: Option<Yarn>,
    /// Llama 3 frequency scaling, if any (never together with `yarn`).
    pub llama3: Option<Llama3>,
    /// `linear` or `dynamic` position scaling, if any (never with `yarn` or `llama3`).
    pub scaling: Option<PositionScaling>,
}

impl Rope {
    /// Plain rotate-half RoPE with base `theta`.
    pub fn standard(theta: f32) -> Rope {
        Rope {
            theta,
            interleaved: false,
            yarn: None,
            llama3: None,
            scaling: None,
        }
    }

    /// The frequency of each of the `dim/2` pairs (for `dynamic` scaling: at lengths up to
    /// `max_position`; see [`Rope::frequencies_at`]).
    pub fn frequencies(&self, dim: usize) -> Vec<f32> {
        self.frequencies_at(dim, 0)
    }

    /// The frequency of each of the `dim/2` pairs in a call whose positions end at `len − 1`
    /// (only `dynamic` scaling reads `len`).
    pub fn frequencies_at(&self, dim: usize, len: usize) -> Vec<f32> {
        let half = dim / 2;
        let theta = match self.scaling {
            Some(PositionScaling::Dynamic {
                factor,
                max_position,
            }) => {
                let (f, max) = (f64::from(factor), max_position.max(1) as f64);
                let len = (len as f64).max(max);
                let grow = pow(f * len / max - (f - 1.0), dim as f64 / (dim as f64 - 2.0));
                f64::from(self.theta) * grow
            }
            _ => f64::from(self.theta),
        };
        let base: Vec<f64> = (0..half)
            .map(|i| pow(theta, -((2 * i) as f64) / dim as f64))
            .collect();
        if let Some(PositionScaling::Linear { factor }) = self.scaling {
            return base
                .iter()
                .map(|&f| (f / f64::from(factor)) as f32)
                .collect();
        }
        if let Some(l) = self.llama3 {
            return base.iter().map(|&f| l.scale(f) as f32).collect();
        }
        let Some(y) = self.yarn else {
            return base.iter().map(|&f| f as f32).collect();
        };
        // The pair index at which a wavelength makes `rotations` turns over the original context.
        let correction = |rotations: f32| -> f64 {
            let max = y.original_max_position as f64;
            dim as f64 * ln(max / (f64::from(rotations) * 2.0 * std::f64::consts::PI))
                / (2.0 * ln(f64::from(self.theta)))
        };
        let low = correction(y.beta_fast).floor().max(0.0);
        let high = correction(y.beta_slow).ceil().min(dim as f64 - 1.0);
        let high = if high == low { high + 0.001 } else { high };
        base.iter()
            .enumerate()
            .map(|(i, &f)| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp; // 1: keep the frequency (fast pairs), 0: interpolate
                (f / f64::from(y.factor) * (1.0 - keep) + f * keep) as f32
            })
            .collect()
    }

    /// The factor YaRN puts on the attention's softmax scale: `(0.1·mscale·ln(factor) + 1)²`
    /// (1 without YaRN or for `factor ≤ 1`).
    pub fn attention_scale_factor(&self) -> f32 {
        match self.yarn {
            Some(y) if y.factor > 1.0 => {
                let m = 0.1 * y.mscale * ln(f64::from(y.factor)) as f32 + 1.0;
                m * m
            }
            _ => 1.0,
        }
    }
}

impl Llama3 {
    /// The scaled frequency of a pair of frequency `f` (transformers'
    /// `_compute_llama3_parameters`).
    fn scale(&self, f: f64) -> f64 {
        let original = self.original_max_position as f64;
        let (low, high) = (
            f64::from(self.low_freq_factor),
            f64::from(self.high_freq_factor),
        );
        let factor = f64::from(self.factor);
        let wavelen = 2.0 * std::f64::consts::PI / f;
        if wavelen < original / high {
            f
        } else if wavelen > original / low {
            f / factor
        } else {
            let smooth = (original / wavelen - low) / (high - low);
            (1.0 - smooth) * f / factor + smooth * f
        }
    }
}

/// The rotation `rope` on `x: [.., seq, heads, even head_dim]` at `positions` (one per sequence
/// index, or one per row and index: packed documents' positions restart at each), scaled by YaRN's `attention_factor` when it has one. `inverse` turns the other way
/// with the same scale: the transpose, which is the backward (the inverse too when the factor
/// is 1).
///
/// # Errors
/// Rank below 3, odd head_dim, or `positions` of the wrong length.
pub fn rope_with(
    x: &Tensor,
    positions: &[usize],
    rope: &Rope,
    inverse: bool,
) -> Result<Tensor, TensorError> {
    rope_tail(x, positions, rope, inverse, 0)
}

/// [`rope_with`] on the last `head_dim − pass` elements of each head only, the first `pass`
/// passed through unchanged: DeepSeek's query heads are `[nope | rope]`, and rotating the tail
/// in place of slicing it off, rotating it and concatenating it back moves the head once instead
/// of four times. The rotated elements have the bits of [`rope_with`] on the tail alone.
///
/// # Errors
/// Rank below 3, `pass` above head_dim or an odd `head_dim − pass`, or `positions` of the wrong
/// length.
pub fn rope_tail(
    x: &Tensor,
    positions: &[usize],
    rope: &Rope,
    inverse: bool,
    pass: usize,
) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("rope_with").map(|s| s.bytes((8 * x.len()) as f64));
    let y =
        rope_tail_slices::<f32, f32>(x.data(), x.shape(), positions, rope, (inverse, pass), |v| v)?;
    Tensor::new(x.shape().to_vec(), y)
}

/// [`rope_tail`] on the elements of `x` (of `shape`), each read through `load` and each
/// position's heads stored through [`RowOut`]: the whole of [`rope_tail`] (`f32`) and of its
/// bf16 form (`load` widens, a position's heads are rounded at once), so the two share one
/// arithmetic.
pub(crate) fn rope_tail_slices<X: Copy + Sync, Y: RowOut>(
    x: &[X],
    shape: &[usize],
    positions: &[usize],
    rope: &Rope,
    (inverse, pass): (bool, usize),
    load: impl Fn(X) -> f32 + Copy + Sync,
) -> Result<Vec<Y>, TensorError> {
    let r = shape.len();
    let head_dim = if r < 3 { 0 } else { shape[r - 1] };
    // One position per sequence index (every row alike), or one per (row, index): packed
    // documents restart their positions at each document start.
    let rows_times_seq: usize = shape[..r.saturating_sub(2)].iter().product();
    if r < 3
        || pass > head_dim
        || !(head_dim - pass).is_multiple_of(2)
        || (positions.len() != shape[r - 3] && positions.len() != rows_times_seq)
    {
        return Err(TensorError::shape(
            "rope",
            format!(
                "x {shape:?} with {} positions, the first {pass} of each head passed through (need \
                 [.., seq, heads, head_dim] with an even head_dim − {pass})",
                positions.len()
            ),
        ));
    }
    let (seq, heads) = (shape[r - 3], shape[r - 2]);
    let dim = head_dim - pass;
    let half = dim / 2;
    let table = rotation_table(rope, dim, positions, inverse);
    let per_position = heads * head_dim;
    // A chunk is a run of (batch row, position)s, about `ROTATION_CHUNK` elements: every head
    // of a position turns by the same table row, each written from `x` into the output (no
    // copy of `x` first). A chunk is one vector-compiled call with one scratch (a head is
    // short: 32 elements at qwen3-peer, so a call a position cost more than its arithmetic).
    let positions_per_chunk = (ROTATION_CHUNK / per_position.max(1)).max(1);
    let chunk = positions_per_chunk * per_position;
    // SAFETY: every chunk is visited, and each writes all of its elements (the passed-through
    // head of every head and every pair of its tail).
    let y = unsafe {
        crate::parallel::filled(x.len(), |y| {
            for_each_chunk(y, chunk.max(1), kernel_threads(), Work::Light, |c, out| {
                let src = &x[c * chunk..];
                let mut scratch = Y::Scratch::default();
                vectorized(
                    #[inline(always)]
                    || {
                        Y::store_row(
                            out,
                            &mut scratch,
                            #[inline(always)]
                            |out| {
                                for (i, (position, xs)) in out
                                    .chunks_mut(per_position)
                                    .zip(src.chunks(per_position))
                                    .enumerate()
                                {
                                    let at = c * positions_per_chunk + i;
                                    let s = if positions.len() == seq { at % seq } else { at };
                                    let row = s * half..(s + 1) * half;
                                    let rot = (&table.sin[row.clone()], &table.cos[row]);
                                    for (head, xs) in
                                        position.chunks_mut(head_dim).zip(xs.chunks(head_dim))
                                    {
                                        rotate_head(
                                            head,
                                            xs,
                                            (pass, half),
                                            rot,
                                            rope.interleaved,
                                            load,
                                        )
                                    }
                                }
                            },
                        );
                    },
                );
            })
        })
    };
    Ok(y)
}

/// Elements a chunk of [`rope_tail_slices`] rotates, about (whole positions, at least one).
const ROTATION_CHUNK: usize = 4096;

/// One head of [`rope_tail_slices`]: its first `pass` elements copied, the rest turned pair by
/// pair by `(sin, cos)` (rotate-half, or interleaved pairs), every element of `head` written.
/// Each element is its pair's formula alone (`x0·cos − x1·sin`, `x1·cos + x0·sin`), so how
/// the pairs are grouped into vectors does not change a bit.
#[inline(always)]
fn rotate_head<X: Copy>(
    head: &mut [MaybeUninit<f32>],
    xs: &[X],
    (pass, half): (usize, usize),
    (sin, cos): (&[f32], &[f32]),
    interleaved: bool,
    load: impl Fn(X) -> f32,
) {
    let (kept, head) = head.split_at_mut(pass);
    let (xkept, xs) = xs.split_at(pass);
    for (k, &x) in kept.iter_mut().zip(xkept) {
        k.write(load(x));
    }
    if interleaved {
        for ((pair, xp), (&sin, &cos)) in head
            .chunks_exact_mut(2)
            .zip(xs.chunks_exact(2))
            .zip(sin.iter().zip(cos))
        {
            let (x0, x1) = (load(xp[0]), load(xp[1]));
            pair[0].write(x0 * cos - x1 * sin);
            pair[1].write(x1 * cos + x0 * sin);
        }
        return;
    }
    let (lo, hi) = head.split_at_mut(half);
    let (xlo, xhi) = xs.split_at(half);
    // Whole blocks of `LANES` pairs computed into arrays (a vector each, with no alias checks
    // against the output: a head is one or a few blocks, and those checks, made per head, cost
    // more than its arithmetic), then the pairs left over one at a time.
    let blocks = half / LANES * LANES;
    let (lo_blocks, lo_rest) = lo.split_at_mut(blocks);
    let (hi_blocks, hi_rest) = hi.split_at_mut(blocks);
    for (at, (a, b)) in lo_blocks
        .chunks_exact_mut(LANES)
        .zip(hi_blocks.chunks_exact_mut(LANES))
        .enumerate()
    {
        let block = at * LANES..(at + 1) * LANES;
        let (ya, yb) = rotate_block(
            (&xlo[block.clone()], &xhi[block.clone()]),
            (&sin[block.clone()], &cos[block]),
            &load,
        );
        for (o, v) in a.iter_mut().zip(ya) {
            o.write(v);
        }
        for (o, v) in b.iter_mut().zip(yb) {
            o.write(v);
        }
    }
    for (((a, b), (&x0, &x1)), (&sin, &cos)) in lo_rest
        .iter_mut()
        .zip(hi_rest.iter_mut())
        .zip(xlo[blocks..].iter().zip(&xhi[blocks..]))
        .zip(sin[blocks..].iter().zip(&cos[blocks..]))
    {
        let (x0, x1) = (load(x0), load(x1));
        a.write(x0 * cos - x1 * sin);
        b.write(x1 * cos + x0 * sin);
    }
}

/// The pairs per block of [`rotate_head`]: an AVX-512 vector of `f32`.
const LANES: usize = 16;

/// `LANES` rotate-half pairs: `(x0·cos − x1·sin, x1·cos + x0·sin)`, each slice at least
/// `LANES` long.
#[inline(always)]
fn rotate_block<X: Copy>(
    (x0, x1): (&[X], &[X]),
    (sin, cos): (&[f32], &[f32]),
    load: &impl Fn(X) -> f32,
) -> ([f32; LANES], [f32; LANES]) {
    let (x0, x1, sin, cos) = (&x0[..LANES], &x1[..LANES], &sin[..LANES], &cos[..LANES]);
    let (mut a, mut b) = ([0.0f32; LANES], [0.0f32; LANES]);
    for i in 0..LANES {
        let (p, q) = (load(x0[i]), load(x1[i]));
        a[i] = p * cos[i] - q * sin[i];
        b[i] = q * cos[i] + p * sin[i];
    }
    (a, b)
}

/// What a rotation table is computed from.
#[derive(PartialEq)]
struct TableKey {
    rope: Rope,
    dim: usize,
    inverse: bool,
    positions: Vec<usize>,
}

/// Tables this thread computed last, newest first: a step rotates the same positions forward
/// and back dozens of times (every layer, queries and keys), so it computes each table once.
const CACHED_TABLES: usize = 4;

/// The `sin` and `cos` of every position × pair (`positions × dim/2`, row-major), apart, so a
/// block of pairs loads each as one vector.
struct Rotations {
    sin: Box<[f32]>,
    cos: Box<[f32]>,
}

/// A shared [`Rotations`] table.
type Table = Arc<Rotations>;

thread_local! {
    static TABLES: std::cell::RefCell<Vec<(TableKey, Table)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// The `sin` and `cos` of every position × pair (`positions.len() × dim/2`, row-major), shared by
/// every head and batch row; from this thread's cache when it computed the same table lately.
/// A cached table has the same bits as a fresh one: it is the same computation.
fn rotation_table(rope: &Rope, dim: usize, positions: &[usize], inverse: bool) -> Table {
    let hit = TABLES.with(|t| {
        let mut t = t.borrow_mut();
        let at = t.iter().position(|(k, _)| {
            k.rope == *rope && k.dim == dim && k.inverse == inverse && k.positions == positions
        })?;
        let entry = t.remove(at);
        let table = entry.1.clone();
        t.insert(0, entry);
        Some(table)
    });
    if let Some(table) = hit {
        return table;
    }
    let len = positions.iter().max().map_or(0, |p| p + 1);
    let freqs = rope.frequencies_at(dim, len);
    let sign = if inverse { -1.0 } else { 1.0 };
    let scale = rope.yarn.map_or(1.0, |y| y.attention_factor);
    let (sin, cos): (Vec<f32>, Vec<f32>) = positions
        .iter()
        .flat_map(|&p| {
            freqs.iter().map(move |&f| {
                let (sin, cos) = crate::fixed_math::sin_cos(sign * p as f32 * f);
                if scale == 1.0 {
                    (sin, cos)
                } else {
                    (sin * scale, cos * scale)
                }
            })
        })
        .unzip();
    let table: Table = Arc::new(Rotations {
        sin: sin.into(),
        cos: cos.into(),
    });
    TABLES.with(|t| {
        let mut t = t.borrow_mut();
        t.truncate(CACHED_TABLES - 1);
        let key = TableKey {
            rope: *rope,
            dim,
            inverse,
            positions: positions.to_vec(),
        };
        t.insert(0, (key, table.clone()));
    });
    table
}

#[cfg(test)]
mod tests;
