//! The AVX512_BF16 kernel's product of a few rows (a decoded token's `x·W`, and `x·Eᵀ` of a
//! tied head or `q·Kᵀ`): each row of `a` runs over `b` as stored, with no packing. A row-major
//! `b` has two of its rows interleaved in registers; a column-major one has each column's pair
//! gathered (16 columns a register). Packing `b` for a single row of `a` read and wrote all of `b` once more than the
//! product reads it, and cost more than the product (`examples/decode_dtype.rs`).
//!
//! Invariant: each element is the chain of [`super::gemm`] — pairs `(2p, 2p + 1)` in order, one
//! `vdpbf16ps` each with the same operands (the pair of `a` broadcast, the pair of `b`), from
//! `+0` or from the destination — so its bits are those [`super::gemm`] stores
//! (`tests::one_row_is_the_packed_products_bits`). The registers hold the columns permuted (the
//! interleave works within 128-bit lanes); they are put back in order when stored.

use std::arch::x86_64::{
    __m512, __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_ps, _mm512_loadu_si512,
    _mm512_mask_i32gather_epi32, _mm512_mask_storeu_ps, _mm512_maskz_loadu_epi16,
    _mm512_maskz_loadu_ps, _mm512_mullo_epi32, _mm512_set1_epi32, _mm512_setr_epi32,
    _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps, _mm512_unpackhi_epi16,
    _mm512_unpacklo_epi16,
};

use half::bf16;

use crate::operand::Operand;

/// The most rows of `a` this path takes; more amortise packing `b`.
pub(crate) const MAX_ROWS: usize = 2;

/// Register lane `l` of the low (`high = false`) or high interleave holds this column of a
/// 32-column chunk: 128-bit lane `t = l / 4` covers columns `8t..8t + 8`, the low interleave
/// its first four.
fn column(l: usize, high: bool) -> usize {
    8 * (l / 4) + usize::from(high) * 4 + l % 4
}

/// The pairs of a row of `a` (`k` elements `acs` apart) as `pack_a` makes them, the last one's
/// high half zero when `k` is odd.
///
/// # Safety
/// The row's `k` elements are readable.
unsafe fn row_pairs(k: usize, a_row: *const bf16, acs: isize) -> Vec<i32> {
    let at = |l: usize| -> u32 {
        if l < k {
            // SAFETY: element l of the row (the caller's contract).
            u32::from(unsafe { *a_row.offset(l as isize * acs) }.to_bits())
        } else {
            0
        }
    };
    (0..k.div_ceil(2))
        .map(|q| (at(2 * q) | (at(2 * q + 1) << 16)) as i32)
        .collect()
}

/// `out = a_row · b` (or `out += a_row · b` when `accumulate`) for one bf16 row of `a` (`k`
/// elements `acs` apart) and a row-major bf16 `b` (k×n, `b.cs == 1`), into `n` `f32`.
///
/// # Safety
/// The CPU has AVX512_BF16 and AVX-512BW ([`super::available`]); `a_row`'s `k` elements and
/// `b`'s k×n are readable, `out`'s `n` writable (and initialised when `accumulate`).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn row_times(
    n: usize,
    k: usize,
    a_row: *const bf16,
    acs: isize,
    b: Operand<bf16>,
    out: *mut f32,
    accumulate: bool,
) {
    // SAFETY: the row's `k` elements are readable (the caller's contract).
    let pairs = unsafe { row_pairs(k, a_row, acs) };
    for j in (0..n).step_by(32) {
        let cols = 32.min(n - j);
        let mask = if cols == 32 {
            u32::MAX
        } else {
            (1u32 << cols) - 1
        };
        // The chunk's start, permuted into the two registers' lanes.
        let mut start = [[0.0f32; 16]; 2];
        if accumulate {
            for (h, lanes) in start.iter_mut().enumerate() {
                for (l, slot) in lanes.iter_mut().enumerate() {
                    let c = column(l, h == 1);
                    if c < cols {
                        // SAFETY: column j + c < n of `out`, initialised (the caller's contract).
                        *slot = unsafe { *out.add(j + c) };
                    }
                }
            }
        }
        // SAFETY: 16 floats each.
        let (mut lo, mut hi): (__m512, __m512) = unsafe {
            (
                _mm512_loadu_ps(start[0].as_ptr()),
                _mm512_loadu_ps(start[1].as_ptr()),
            )
        };
        let load = |l: usize| -> __m512i {
            if l < k {
                // SAFETY: row l of `b`, columns j..j + cols (the mask reads no further).
                unsafe {
                    _mm512_maskz_loadu_epi16(
                        mask,
                        b.ptr.offset(l as isize * b.rs + j as isize).cast(),
                    )
                }
            } else {
                _mm512_setzero_si512()
            }
        };
        for (q, &pair) in pairs.iter().enumerate() {
            let (r0, r1) = (load(2 * q), load(2 * q + 1));
            // SAFETY: 512-bit integer vectors read as 32 bf16 (the same bits).
            let (x, blo, bhi): (__m512bh, __m512bh, __m512bh) = unsafe {
                (
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair)),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_unpacklo_epi16(r0, r1)),
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_unpackhi_epi16(r0, r1)),
                )
            };
            lo = _mm512_dpbf16_ps(lo, x, blo);
            hi = _mm512_dpbf16_ps(hi, x, bhi);
        }
        let mut sums = [[0.0f32; 16]; 2];
        // SAFETY: 16 floats each.
        unsafe {
            _mm512_storeu_ps(sums[0].as_mut_ptr(), lo);
            _mm512_storeu_ps(sums[1].as_mut_ptr(), hi);
        }
        for (h, lanes) in sums.iter().enumerate() {
            for (l, &sum) in lanes.iter().enumerate() {
                let c = column(l, h == 1);
                if c < cols {
                    // SAFETY: column j + c < n of `out` (the caller's contract).
                    unsafe { *out.add(j + c) = sum };
                }
            }
        }
    }
}

/// [`row_times`] for a column-major `b` (`b.rs == 1`: each column's `k` elements contiguous,
/// `b.cs` apart): 16 columns a register, each lane's pair `(b[2q, c], b[2q + 1, c])` gathered
/// as one word (the last pair of an odd `k` read as one element, its high half zero).
///
/// # Safety
/// As [`row_times`], with `b.rs == 1` and `16 · b.cs` below `2^31`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn row_times_columns(
    n: usize,
    k: usize,
    a_row: *const bf16,
    acs: isize,
    b: Operand<bf16>,
    out: *mut f32,
    accumulate: bool,
) {
    // SAFETY: the row's `k` elements are readable (the caller's contract).
    let pairs = unsafe { row_pairs(k, a_row, acs) };
    let whole = k / 2;
    // Lane c reads column c of the group: `c · cs` elements from the group's first.
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(b.cs as i32),
    );
    for j in (0..n).step_by(16) {
        let cols = 16.min(n - j);
        let mask: u16 = if cols == 16 {
            u16::MAX
        } else {
            (1u16 << cols) - 1
        };
        let mut acc = if accumulate {
            // SAFETY: columns j..j + cols of `out` (the mask touches no others), initialised
            // when accumulating.
            unsafe { _mm512_maskz_loadu_ps(mask, out.add(j)) }
        } else {
            _mm512_setzero_ps()
        };
        // SAFETY: column j's first element (inside `b`).
        let base = unsafe { b.ptr.offset(j as isize * b.cs) };
        for (q, &pair) in pairs.iter().enumerate() {
            let words = if q < whole {
                // SAFETY: elements 2q and 2q + 1 < k of columns j..j + cols (masked lanes read
                // nothing); offsets in bytes are `2 · (c · cs + 2q)`, scale 2.
                unsafe {
                    _mm512_mask_i32gather_epi32::<2>(
                        _mm512_setzero_si512(),
                        mask,
                        offsets,
                        base.add(2 * q).cast(),
                    )
                }
            } else {
                // The last pair of an odd `k`: element k - 1 alone.
                let mut last = [0u32; 16];
                for (c, slot) in last.iter_mut().enumerate().take(cols) {
                    // SAFETY: element k - 1 of column j + c.
                    *slot = u32::from(
                        unsafe { *base.offset(c as isize * b.cs + 2 * q as isize) }.to_bits(),
                    );
                }
                // SAFETY: 16 words.
                unsafe { _mm512_loadu_si512(last.as_ptr().cast()) }
            };
            // SAFETY: 512-bit integer vectors read as 32 bf16 (the same bits).
            let (x, w): (__m512bh, __m512bh) = unsafe {
                (
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair)),
                    std::mem::transmute::<__m512i, __m512bh>(words),
                )
            };
            acc = _mm512_dpbf16_ps(acc, x, w);
        }
        // SAFETY: columns j..j + cols of `out`.
        unsafe { _mm512_mask_storeu_ps(out.add(j), mask, acc) };
    }
}
