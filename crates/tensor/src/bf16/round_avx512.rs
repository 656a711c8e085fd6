//! [`round_into`](super::round_into) on AVX512_BF16: `vcvtne2ps2bf16` rounds 32 `f32` to bf16
//! in one instruction, where the integer form of [`round_bf16`] takes about eight.
//!
//! Invariant: the bits are [`round_bf16`]'s for every input. The instruction rounds to nearest
//! even and makes a NaN quiet (its top half with the quiet bit set) exactly as `round_bf16`
//! does, but it takes a subnormal input as zero; a block of 32 holding one is rounded by
//! `round_bf16` element by element instead (tested over every bf16 pattern with the dropped
//! halves that decide rounding: `tests::the_instruction_rounds_as_round_bf16_does`).

use std::arch::x86_64::{
    __m256i, __m512, __m512i, _mm512_add_ps, _mm512_castps_si512, _mm512_castsi512_ps,
    _mm512_cvtepu16_epi32, _mm512_cvtne2ps_pbh, _mm512_cvtneps_pbh, _mm512_loadu_ps,
    _mm512_mask_storeu_epi16, _mm512_mask_storeu_ps, _mm512_mask_test_epi32_mask,
    _mm512_maskz_loadu_ps, _mm512_set1_epi32, _mm512_slli_epi32, _mm512_storeu_si512,
    _mm512_testn_epi32_mask,
};
use std::mem::MaybeUninit;

use half::bf16;

use super::{round_bf16, widen_bf16};

/// Elements a step rounds: two registers of 16 `f32` into one of 32 bf16.
const STEP: usize = 32;

/// Each element of `src` rounded into `dst` (as long).
///
/// # Safety
/// The CPU has AVX512_BF16, AVX-512F and BW (`super::dpbf16::available`); `src` and `dst` are
/// as long.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn round_into(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
    let exponent = _mm512_set1_epi32(0x7f80_0000);
    let mantissa = _mm512_set1_epi32(0x007f_ffff);
    // Lanes holding a subnormal: exponent bits all zero, mantissa not.
    let subnormal = |x: __m512| {
        let bits = _mm512_castps_si512(x);
        _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(bits, exponent), bits, mantissa)
    };
    let whole = src.len() / STEP * STEP;
    for (s, d) in src[..whole]
        .chunks_exact(STEP)
        .zip(dst[..whole].chunks_exact_mut(STEP))
    {
        // SAFETY: `s` holds 32 readable `f32`.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_ps(s.as_ptr()),
                _mm512_loadu_ps(s.as_ptr().add(16)),
            )
        };
        if subnormal(lo) | subnormal(hi) != 0 {
            for (o, &x) in d.iter_mut().zip(s) {
                o.write(round_bf16(x));
            }
            continue;
        }
        // SAFETY: a 512-bit value reinterpreted as another; `d` holds 32 writable bf16.
        unsafe {
            let rounded: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(d.as_mut_ptr().cast(), rounded);
        }
    }
    for (o, &x) in dst[whole..].iter_mut().zip(&src[whole..]) {
        o.write(round_bf16(x));
    }
}

/// A tile's row (`src`, its first `cols ≤ 32` elements live) in two registers, with the mask
/// of its live lanes; `None` when a live lane holds a subnormal, which the instruction would
/// take as zero (the caller then rounds with `round_bf16`, element by element).
///
/// # Safety
/// The CPU has AVX-512F and BW.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn row_registers(src: &[f32; STEP], cols: usize) -> Option<(__m512, __m512, u32)> {
    assert!(cols <= STEP); // ok: a tile's row
    let live: u32 = if cols == STEP {
        u32::MAX
    } else {
        (1 << cols) - 1
    };
    let exponent = _mm512_set1_epi32(0x7f80_0000);
    let mantissa = _mm512_set1_epi32(0x007f_ffff);
    let subnormal = |x: __m512| {
        let bits = _mm512_castps_si512(x);
        _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(bits, exponent), bits, mantissa)
    };
    // SAFETY: `src` holds 32 readable `f32`.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_ps(src.as_ptr()),
            _mm512_loadu_ps(src.as_ptr().add(16)),
        )
    };
    let flushed = (u32::from(subnormal(lo)) | u32::from(subnormal(hi)) << 16) & live != 0;
    (!flushed).then_some((lo, hi, live))
}

/// A tile's row of `f32` (`src`: 32 elements, the first `dst.len() ≤ 32` of them live)
/// rounded into `dst`, with [`round_into`]'s bits (the instruction, or `round_bf16` element by
/// element when a live lane holds a subnormal), in one masked store: `gemm_rounded` called
/// [`round_into`] on each tile row, a call and its setup for 32 elements.
///
/// # Safety
/// The CPU has AVX512_BF16, AVX-512F and BW (`super::dpbf16::available`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn round_row(src: &[f32; STEP], dst: &mut [MaybeUninit<bf16>]) {
    // SAFETY: the caller's contract.
    let Some((lo, hi, live)) = (unsafe { row_registers(src, dst.len()) }) else {
        for (o, &x) in dst.iter_mut().zip(src) {
            o.write(round_bf16(x));
        }
        return;
    };
    // SAFETY: a 512-bit value reinterpreted as another; the mask keeps the store to `dst`'s
    // `cols` elements.
    unsafe {
        let rounded: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_mask_storeu_epi16(dst.as_mut_ptr().cast(), live, rounded);
    }
}

/// A tile's row of `f32` (`src`: 32 elements, the first `dst.len() ≤ 32` of them live) rounded
/// to bf16 and added, widened, into `dst`: each element `dst[c] + widen(round_bf16(src[c]))`,
/// one `f32` addition, the bits of [`round_row`] followed by `super::add_rounded`'s add. A
/// weight gradient's rounded product goes into its `f32` accumulator from the register tile
/// this way, with no rounded or `f32` copy of the product in between.
///
/// # Safety
/// The CPU has AVX512_BF16, AVX-512F and BW (`super::dpbf16::available`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn add_rounded_row(src: &[f32; STEP], dst: &mut [f32]) {
    // SAFETY: the caller's contract.
    let Some((lo, hi, live)) = (unsafe { row_registers(src, dst.len()) }) else {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d += widen_bf16(round_bf16(x));
        }
        return;
    };
    // Rounded (16 bf16 in 256 bits), then widened: each bf16 the top half of an `f32`.
    let widened = |x: __m512| {
        // SAFETY: a 256-bit value reinterpreted as another.
        let half: __m256i = unsafe { std::mem::transmute(_mm512_cvtneps_pbh(x)) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
    };
    let (low, high) = (live as u16, (live >> 16) as u16);
    // SAFETY: the masks keep the loads and stores to `dst`'s `cols` elements.
    unsafe {
        let out = dst.as_mut_ptr();
        let sum = _mm512_add_ps(_mm512_maskz_loadu_ps(low, out), widened(lo));
        _mm512_mask_storeu_ps(out, low, sum);
        let out = out.wrapping_add(16);
        let sum = _mm512_add_ps(_mm512_maskz_loadu_ps(high, out), widened(hi));
        _mm512_mask_storeu_ps(out, high, sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bf16 pattern (each sign, exponent and kept mantissa: normals, subnormals, zeros,
    /// infinities, NaNs) with dropped halves on both sides of every rounding boundary, in blocks
    /// with and without subnormals, and an odd tail: `round_into` (this instruction, called
    /// directly) gives `round_bf16`'s bits. A CPU without AVX512_BF16 cannot run it, and the
    /// test reports itself skipped there (the slice rounding it would otherwise reach is
    /// `round_bf16` itself, which would compare with itself).
    #[test]
    fn rounding_a_slice_gives_round_bf16_bits() {
        if !super::super::dpbf16::available() {
            crate::report_skipped(
                "tensor bf16::round_avx512::tests::rounding_a_slice_gives_round_bf16_bits",
                "this processor has no AVX512_BF16",
            );
            return;
        }
        let round = |src: &[f32], dst: &mut [bf16]| {
            let out = dst.len();
            assert_eq!(src.len(), out);
            // SAFETY: the CPU has the features (checked above); `dst` is as long as `src`, and
            // `bf16` and `MaybeUninit<bf16>` have the same layout.
            unsafe {
                round_into(
                    src,
                    std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), out),
                )
            }
        };
        let lows: [u32; 9] = [0, 1, 0x3fff, 0x7fff, 0x8000, 0x8001, 0xbfff, 0xfffe, 0xffff];
        let src: Vec<f32> = (0..=u32::from(u16::MAX))
            .flat_map(|high| {
                lows.iter()
                    .map(move |&low| f32::from_bits(high << 16 | low))
            })
            .chain([1.5, -2.25, 3.0e-39])
            .collect();
        let mut got = vec![bf16::ZERO; src.len()];
        round(&src, &mut got);
        for (i, (x, &s)) in got.iter().zip(&src).enumerate() {
            assert_eq!(
                x.to_bits(),
                round_bf16(s).to_bits(),
                "[{i}] {:#010x}",
                s.to_bits()
            );
        }
        // The mirror: the instruction alone flushes a subnormal to zero, which the guard catches
        // (a block of them rounds to the smallest bf16 subnormal, not to zero).
        let lone = [f32::from_bits(0x0000_8001); STEP];
        let mut out = [bf16::ZERO; STEP];
        round(&lone, &mut out);
        assert!(out.iter().all(|x| x.to_bits() == 0x0001), "{out:?}");

        // A tile's row: the same patterns 32 at a time, cut to widths from 0 to 32, give
        // `round_bf16`'s bits in the live lanes and leave the rest as they were; and a live
        // subnormal is caught (the instruction alone would flush it).
        let sentinel = bf16::from_bits(0x7e57);
        for (r, row) in src.chunks_exact(STEP).enumerate().step_by(97) {
            let row: &[f32; STEP] = row.try_into().expect("32 elements");
            for cols in [0, 1, 7, 16, 17, 31, 32] {
                let mut out = [sentinel; STEP];
                // SAFETY: the CPU has the features (checked above); `out` holds `cols` bf16,
                // laid out as `MaybeUninit<bf16>`.
                unsafe {
                    round_row(
                        row,
                        std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), cols),
                    )
                };
                for (i, (x, &s)) in out.iter().zip(row).enumerate() {
                    let want = if i < cols { round_bf16(s) } else { sentinel };
                    assert_eq!(x.to_bits(), want.to_bits(), "row {r}, {cols} live, [{i}]");
                }
            }
        }
        let mut row = [1.5f32; STEP];
        row[20] = f32::from_bits(0x0000_8001);
        let mut out = [sentinel; STEP];
        // SAFETY: as above.
        unsafe {
            round_row(
                &row,
                std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), 21),
            )
        };
        assert_eq!(
            out[20].to_bits(),
            0x0001,
            "a live subnormal rounds as round_bf16"
        );
        assert_eq!(out[21], sentinel);
    }

    /// A tile's row rounded and added into `f32` (`add_rounded_row`): over the same patterns
    /// (every bf16 pattern with the dropped halves that decide rounding, NaNs and infinities
    /// among them), added into accumulators of both signs and magnitudes, cut to widths from 0
    /// to 32: each live element is `acc + widen(round_bf16(x))` to the bit, the lanes past the
    /// width are untouched; a row with a live subnormal is caught (the instruction alone
    /// flushes it to zero: the mirror shows the two differ on it).
    #[test]
    fn adding_a_rounded_row_is_rounding_then_adding() {
        if !super::super::dpbf16::available() {
            crate::report_skipped(
                "tensor bf16::round_avx512::tests::adding_a_rounded_row_is_rounding_then_adding",
                "this processor has no AVX512_BF16",
            );
            return;
        }
        let lows: [u32; 5] = [0, 0x7fff, 0x8000, 0x8001, 0xffff];
        let src: Vec<f32> = (0..=u32::from(u16::MAX))
            .step_by(3)
            .flat_map(|high| {
                lows.iter()
                    .map(move |&low| f32::from_bits(high << 16 | low))
            })
            .collect();
        let sentinel = f32::from_bits(0x7e57_7e57);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, row) in src.chunks_exact(STEP).enumerate().step_by(13) {
            let row: &[f32; STEP] = row.try_into().expect("32 elements");
            let start: Vec<f32> = (0..STEP)
                .map(|i| [1.0, -3.5e-3, 7.0e5, -0.0, 0.0][(r + i) % 5])
                .collect();
            for cols in [0, 1, 7, 16, 17, 31, 32] {
                let mut got = [sentinel; STEP];
                got[..cols].copy_from_slice(&start[..cols]);
                let mut want = got;
                for (w, &x) in want.iter_mut().zip(row).take(cols) {
                    *w += widen_bf16(round_bf16(x));
                }
                // SAFETY: the CPU has the features (checked above).
                unsafe { add_rounded_row(row, &mut got[..cols]) };
                assert_eq!(bits(&got), bits(&want), "row {r}, {cols} live");
            }
        }
        let mut row = [1.5f32; STEP];
        row[20] = f32::from_bits(0x0000_8001);
        let mut got = [0.0f32; STEP];
        // SAFETY: as above.
        unsafe { add_rounded_row(&row, &mut got[..21]) };
        let smallest = widen_bf16(bf16::from_bits(0x0001));
        assert_eq!(got[20], smallest, "a live subnormal rounds as round_bf16");
        // The mirror: the instruction alone, on the same row, gives zero there.
        // SAFETY: as above.
        let flushed: [u16; STEP] = unsafe {
            std::mem::transmute(_mm512_cvtne2ps_pbh(
                _mm512_loadu_ps(row.as_ptr().add(16)),
                _mm512_loadu_ps(row.as_ptr()),
            ))
        };
        assert_eq!(flushed[20], 0, "the instruction flushes the subnormal");
    }
}
