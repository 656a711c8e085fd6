//! bfloat16 storage for activations and matrix-product inputs, with `f32` arithmetic inside
//! every kernel (MaxText's `dtype=bfloat16` beside `weight_dtype=float32`).
//!
//! [`Bf16Tensor`] is a type of its own beside [`Tensor`], not a storage variant of it: every
//! existing caller of `Tensor::data()` keeps its `&[f32]`, and code that handles bf16 says so in
//! its types. A bf16 value becomes `f32` by widening (exact: its bits are the top half of an
//! `f32`'s), and an `f32` becomes bf16 by [`round_bf16`] only: round to nearest, ties to even.
//!
//! Invariants:
//! * Rounding is the one lossy step, and happens where a kernel writes a [`Bf16Tensor`]: once
//!   per value written, never inside a kernel's sums. Products take bf16 operands and return
//!   `f32` (the widened terms are exact in `f32`, so a bf16 product differs from the `f32`
//!   product of the widened operands only in the order of addition); row kernels widen a row,
//!   run the `f32` row code, and round what they store. So each bf16 row kernel's output is,
//!   bit for bit, `round_bf16` of the `f32` kernel on the widened input (the tests check this).
//! * [`round_bf16`]: finite values round to nearest even (the halfway case goes to the even
//!   mantissa); values beyond bf16's largest finite round to ±∞ exactly as IEEE rounding
//!   does; subnormals round in the same way (bf16 has `f32`'s exponent range); ±0 and ±∞ are
//!   kept; a NaN stays a NaN with its sign and top payload bits, made quiet.
//! * Which product kernel runs for bf16 is chosen once per process ([`bf16_matmul_kernel`]).

use std::mem::MaybeUninit;
use std::sync::Arc;

use half::bf16;

use crate::error::TensorError;
use crate::fastmath::vectorized;
use crate::parallel::{filled, for_each_chunk, kernel_threads, Work};
use crate::tensor::{strides, Tensor};
/// What a bf16 tensor keeps: the AVX512_BF16 kernel's packings (nothing off x86-64).
#[cfg(target_arch = "x86_64")]
type Packings = crate::packings::Packings<dpbf16::PackedB>;
#[cfg(not(target_arch = "x86_64"))]
type Packings = crate::packings::Packings<std::convert::Infallible>;

mod block_packing;
mod choice;
#[cfg(target_arch = "x86_64")]
mod dpbf16;
mod elementwise;
mod flash;
mod matmul;
#[cfg(target_arch = "x86_64")]
mod round_avx512;
mod rows;

pub(crate) use block_packing::{product_in, BlockPacking};
pub(crate) use choice::products_on_tiles;
pub(crate) use matmul::product;

pub use choice::{allow_bf16_fallback, bf16_matmul_kernel, bf16_products_keep_packings};
pub use elementwise::{map_bf16, mul_bf16, scale_bf16, zip_bf16};
pub use flash::{flash_attention_backward_bf16, flash_attention_bf16};
pub use matmul::{
    dot_general_bf16, dot_general_bf16_accumulate, dot_general_bf16_rounded,
    dot_general_bf16_rounded_accumulate_parts,
};
pub use rows::{
    add_bf16, causal_softmax_bf16, glu_backward_bf16, glu_bf16, rms_norm_backward_bf16,
    rms_norm_bf16, rope_bf16, rope_tail_bf16, silu_bf16, softmax_backward_bf16, softmax_last_bf16,
    swiglu_backward_bf16, swiglu_bf16,
};

/// `x` rounded to bfloat16: to nearest, ties to even; NaN kept (quiet). Branch-free on the
/// bits, so loops over slices of it compile to vector code.
#[inline(always)]
pub fn round_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    // Adding 0x7fff plus the lowest kept bit carries into the kept half exactly when the
    // dropped half is above one half, or equal to it with the kept half odd.
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = (b >> 16) as u16 | 0x0040;
    let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    bf16::from_bits(if is_nan { quiet_nan } else { rounded })
}

/// `x` widened to `f32` (exact).
#[inline(always)]
pub fn widen_bf16(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// Rounds `src` into `dst` elementwise ([`round_bf16`]).
///
/// # Panics
/// When the lengths differ (a bug in the caller).
pub fn round_slice(src: &[f32], dst: &mut [bf16]) {
    // SAFETY: `[bf16]` and `[MaybeUninit<bf16>]` share a layout, and `round_into` writes only
    // initialised values.
    let dst = unsafe { &mut *(dst as *mut [bf16] as *mut [MaybeUninit<bf16>]) };
    round_into(src, dst);
}

/// [`round_slice`] into storage not yet written (a new tensor's, from [`filled`]): every
/// element of `dst` is written.
///
/// # Panics
/// When the lengths differ (a bug in the caller).
pub(crate) fn round_into(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
    assert_eq!(src.len(), dst.len()); // ok: caller's invariant
    #[cfg(target_arch = "x86_64")]
    if dpbf16::available() {
        // SAFETY: the CPU has AVX512_BF16, F and BW (what the product kernel needs too), checked
        // just above; the lengths are equal.
        unsafe { round_avx512::round_into(src, dst) };
        return;
    }
    vectorized(
        #[inline(always)]
        || {
            for (d, &s) in dst.iter_mut().zip(src) {
                d.write(round_bf16(s));
            }
        },
    );
}

/// Elements of the `f32` block [`rounded_blocks`] computes before rounding it (4 KiB: stays in
/// L1 between the kernel's loop and the rounding).
const ROUND_BLOCK: usize = 1024;

/// `out` written a block at a time: `compute(offset, block)` fills an `f32` block with the
/// values of `out[offset..offset + block.len()]`, which [`round_into`] then rounds into `out`
/// (the rounding on AVX512_BF16 where the CPU has it, 32 elements an instruction, instead of
/// [`round_bf16`]'s integer steps per element inside the kernel's loop; the same bits).
pub(crate) fn rounded_blocks(
    out: &mut [MaybeUninit<bf16>],
    mut compute: impl FnMut(usize, &mut [f32]),
) {
    let mut block = [0.0f32; ROUND_BLOCK];
    for (i, out) in out.chunks_mut(ROUND_BLOCK).enumerate() {
        let block = &mut block[..out.len()];
        compute(i * ROUND_BLOCK, block);
        round_into(block, out);
    }
}

/// [`rounded_blocks`] for a kernel with two outputs of one length (`compute` fills a block of
/// each).
pub(crate) fn rounded_blocks2(
    (a, b): (&mut [MaybeUninit<bf16>], &mut [MaybeUninit<bf16>]),
    mut compute: impl FnMut(usize, &mut [f32], &mut [f32]),
) {
    let (mut block_a, mut block_b) = ([0.0f32; ROUND_BLOCK], [0.0f32; ROUND_BLOCK]);
    for (i, (a, b)) in a
        .chunks_mut(ROUND_BLOCK)
        .zip(b.chunks_mut(ROUND_BLOCK))
        .enumerate()
    {
        let (block_a, block_b) = (&mut block_a[..a.len()], &mut block_b[..b.len()]);
        compute(i * ROUND_BLOCK, block_a, block_b);
        round_into(block_a, a);
        round_into(block_b, b);
    }
}

/// [`widen_slice`] into storage not yet written: every element of `dst` is written.
///
/// # Panics
/// When the lengths differ (a bug in the caller).
pub(crate) fn widen_into(src: &[bf16], dst: &mut [MaybeUninit<f32>]) {
    assert_eq!(src.len(), dst.len()); // ok: caller's invariant
    vectorized(
        #[inline(always)]
        || {
            for (d, &s) in dst.iter_mut().zip(src) {
                d.write(widen_bf16(s));
            }
        },
    );
}

/// Widens `src` into `dst` elementwise ([`widen_bf16`]).
///
/// # Panics
/// When the lengths differ (a bug in the caller).
pub fn widen_slice(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len()); // ok: caller's invariant
    vectorized(
        #[inline(always)]
        || {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = widen_bf16(s);
            }
        },
    );
}

/// `dst += widen(src)` elementwise, on the kernel thread budget: a bf16 cotangent added into an
/// f32 gradient without an f32 copy of it first (the same bits as widening, then adding).
///
/// # Panics
/// When the lengths differ (a bug in the caller).
pub fn widen_add_slice(src: &[bf16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len()); // ok: caller's invariant
    for_each_chunk(
        dst,
        CONVERT_BLOCK,
        kernel_threads(),
        Work::Light,
        |c, out| {
            let (at, len) = (c * CONVERT_BLOCK, out.len());
            vectorized(
                #[inline(always)]
                || {
                    for (d, &s) in out.iter_mut().zip(&src[at..at + len]) {
                        *d += widen_bf16(s);
                    }
                },
            );
        },
    );
}

/// `dst += widen(round_bf16(src))` elementwise: an `f32` value rounded to bf16 as it would be
/// stored, added into an `f32` accumulator (the bits of rounding, storing, then
/// [`widen_add_slice`]).
///
/// # Panics
/// When the lengths differ (a bug in the caller).
pub(crate) fn add_rounded(src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len()); // ok: caller's invariant

    // A block at a time through bf16 scratch: the rounding is [`round_into`]'s (32 an
    // instruction on AVX512_BF16).
    let mut rounded = [MaybeUninit::new(bf16::ZERO); ROUND_BLOCK];
    for (s, d) in src.chunks(ROUND_BLOCK).zip(dst.chunks_mut(ROUND_BLOCK)) {
        let rounded = &mut rounded[..s.len()];
        round_into(s, rounded);
        // SAFETY: `round_into` wrote every element (they started initialised too);
        // `[MaybeUninit<bf16>]` and `[bf16]` share a layout.
        let rounded = unsafe { &*(rounded as *const [MaybeUninit<bf16>] as *const [bf16]) };
        vectorized(
            #[inline(always)]
            || {
                for (d, &r) in d.iter_mut().zip(rounded) {
                    *d += widen_bf16(r);
                }
            },
        );
    }
}

/// Elements per block when a conversion is split over the kernel threads.
const CONVERT_BLOCK: usize = 1 << 14;

/// A dense row-major bfloat16 tensor: activations and matrix-product inputs in `dtype=bf16`.
/// Its elements are the `shape.iter().product()` values of its storage, in order. The storage
/// is shared: a clone or a [`Bf16Tensor::reshaped`] copies no element, and never changes.
#[derive(Clone)]
pub struct Bf16Tensor {
    shape: Vec<usize>,
    data: Arc<Vec<bf16>>,
    /// The packings its products keep, when it keeps them ([`Bf16Tensor::keeping_packings`]).
    packings: Option<Arc<Packings>>,
}

impl PartialEq for Bf16Tensor {
    /// Equal shapes and elements (whether packings are kept does not count).
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape && self.data == other.data
    }
}

impl std::fmt::Debug for Bf16Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bf16Tensor")
            .field("shape", &self.shape)
            .field("data", &self.data)
            .field("packings", &self.packings)
            .finish()
    }
}

impl Bf16Tensor {
    /// `data` as a tensor of `shape`.
    ///
    /// # Errors
    /// The element count does not match the shape.
    pub fn new(shape: Vec<usize>, data: Vec<bf16>) -> Result<Bf16Tensor, TensorError> {
        let want: usize = shape.iter().product();
        if want != data.len() {
            return Err(TensorError::shape(
                "Bf16Tensor::new",
                format!("{} elements for shape {shape:?}", data.len()),
            ));
        }
        Ok(Bf16Tensor {
            shape,
            data: Arc::new(data),
            packings: None,
        })
    }

    /// `x` rounded to bf16 ([`round_bf16`] per element), on the kernel thread budget.
    pub fn from_f32(x: &Tensor) -> Bf16Tensor {
        let _span = ferrotext_profile::span("round_bf16").map(|s| s.bytes((6 * x.len()) as f64));
        Bf16Tensor::rounded(x)
    }

    /// [`Bf16Tensor::from_f32`] without a profiler span of its own: a kernel's rounding of
    /// its `f32` result, counted in the kernel's span.
    pub(crate) fn rounded(x: &Tensor) -> Bf16Tensor {
        let src = x.data();
        // SAFETY: the chunks cover `data`, and `round_into` writes each of theirs whole.
        let data = unsafe {
            filled(x.len(), |data| {
                for_each_chunk(
                    data,
                    CONVERT_BLOCK,
                    kernel_threads(),
                    Work::Light,
                    |c, out| {
                        let at = c * CONVERT_BLOCK;
                        round_into(&src[at..at + out.len()], out);
                    },
                );
            })
        };
        Bf16Tensor {
            shape: x.shape().to_vec(),
            data: Arc::new(data),
            packings: None,
        }
    }

    /// The values widened to `f32` (exact), on the kernel thread budget.
    pub fn to_f32(&self) -> Tensor {
        let _span = ferrotext_profile::span("widen_bf16").map(|s| s.bytes((6 * self.len()) as f64));
        self.widened()
    }

    /// [`Bf16Tensor::to_f32`] without a profiler span of its own: a kernel's widened copy of
    /// its input, counted in the kernel's span.
    pub(crate) fn widened(&self) -> Tensor {
        // SAFETY: the chunks cover `out`, and `widen_into` writes each of theirs whole.
        let out = unsafe {
            filled(self.data.len(), |out| {
                for_each_chunk(
                    out,
                    CONVERT_BLOCK,
                    kernel_threads(),
                    Work::Light,
                    |c, out| {
                        let at = c * CONVERT_BLOCK;
                        widen_into(&self.data[at..at + out.len()], out);
                    },
                );
            })
        };
        Tensor::owned(self.shape.clone(), out)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element count.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The elements, row-major.
    pub fn data(&self) -> &[bf16] {
        &self.data
    }

    /// The same elements under another shape of the same count (no copy).
    ///
    /// # Errors
    /// The element counts differ.
    pub fn reshape(self, shape: &[usize]) -> Result<Bf16Tensor, TensorError> {
        Bf16Tensor::new(shape.to_vec(), self.into_data())
    }

    /// The same elements under another shape of the same count, sharing the storage (no copy).
    ///
    /// # Errors
    /// The element counts differ.
    pub fn reshaped(&self, shape: &[usize]) -> Result<Bf16Tensor, TensorError> {
        if shape.iter().product::<usize>() != self.len() {
            return Err(TensorError::shape(
                "Bf16Tensor::reshaped",
                format!("{} elements for shape {shape:?}", self.len()),
            ));
        }
        Ok(Bf16Tensor {
            shape: shape.to_vec(),
            data: Arc::clone(&self.data),
            packings: self.packings.clone(),
        })
    }

    /// This tensor (its storage shared, not copied) keeping the packings that products make of
    /// it as their right operand, for as long as any clone of the result lives: a product on
    /// a kernel that packs its operands (ferrotext's AVX512_BF16 kernel) packs each matrix of
    /// it once and reuses the packing after — for a step's bf16 weight copy, which every
    /// micro-batch multiplies by (`x·W` and `dy·Wᵀ`: two packings, each about the tensor's
    /// size). The products' bits are the same either way.
    pub fn keeping_packings(&self) -> Bf16Tensor {
        Bf16Tensor {
            packings: Some(self.packings.clone().unwrap_or_default()),
            ..self.clone()
        }
    }

    /// How many packings of this tensor its products keep ([`Bf16Tensor::keeping_packings`];
    /// 0 when it keeps none).
    pub fn kept_packings(&self) -> usize {
        self.packings.as_ref().map_or(0, |p| p.len())
    }

    /// The packings kept, when this tensor keeps them.
    pub(crate) fn packings(&self) -> Option<&Packings> {
        self.packings.as_deref()
    }

    /// The elements, row-major (copied only when the storage is shared).
    pub fn into_data(self) -> Vec<bf16> {
        Arc::try_unwrap(self.data).unwrap_or_else(|shared| shared.as_ref().clone())
    }

    /// The elements with dimensions in the order `perm` (a copy): `out[.., i_perm[d], ..] =
    /// self[.., i_d, ..]`, as [`Tensor::transpose`].
    ///
    /// # Errors
    /// `perm` is not a permutation of the dimensions.
    pub fn transpose(&self, perm: &[usize]) -> Result<Bf16Tensor, TensorError> {
        let _span =
            ferrotext_profile::span("transpose_bf16").map(|s| s.bytes(4.0 * self.len() as f64));
        let mut seen = vec![false; self.shape.len()];
        if perm.len() != self.shape.len()
            || !perm
                .iter()
                .all(|&d| d < seen.len() && !std::mem::replace(&mut seen[d], true))
        {
            return Err(TensorError::shape(
                "Bf16Tensor::transpose",
                format!("{perm:?} is not a permutation of {:?}", self.shape),
            ));
        }
        Ok(Bf16Tensor {
            shape: perm.iter().map(|&d| self.shape[d]).collect(),
            data: Arc::new(permuted(&self.shape, &self.data, perm)),
            packings: None,
        })
    }
}

/// `data` (row-major, of `shape`) with its dimensions reordered to `perm` (checked by the
/// caller): rows of the output's innermost dimension (a straight copy where that dimension is
/// the input's innermost too), in blocks of about [`CONVERT_BLOCK`] elements on the kernel
/// thread budget.
fn permuted<T: Copy + Default + Send + Sync>(
    shape: &[usize],
    data: &[T],
    perm: &[usize],
) -> Vec<T> {
    let st = strides(shape);
    let out_shape: Vec<usize> = perm.iter().map(|&d| shape[d]).collect();
    let src_st: Vec<usize> = perm.iter().map(|&d| st[d]).collect();
    let mut out = vec![T::default(); data.len()];
    let Some((&inner, outer)) = out_shape.split_last() else {
        out.copy_from_slice(data);
        return out;
    };
    if data.is_empty() {
        return out;
    }
    let step = src_st[outer.len()];
    let rows = (CONVERT_BLOCK / inner).max(1);
    for_each_chunk(
        &mut out,
        rows * inner,
        kernel_threads(),
        Work::Light,
        |c, block| {
            // The chunk's first row as an index into the outer dimensions, then stepped.
            let mut index = vec![0usize; outer.len()];
            let mut first = c * rows;
            for (i, &n) in index.iter_mut().zip(outer).rev() {
                *i = first % n;
                first /= n;
            }
            for out_row in block.chunks_mut(inner) {
                let base: usize = index.iter().zip(&src_st).map(|(i, s)| i * s).sum();
                if step == 1 {
                    out_row.copy_from_slice(&data[base..base + inner]);
                } else {
                    for (j, o) in out_row.iter_mut().enumerate() {
                        *o = data[base + j * step];
                    }
                }
                for d in (0..index.len()).rev() {
                    index[d] += 1;
                    if index[d] < outer[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
        },
    );
    out
}

#[cfg(test)]
mod tests;
