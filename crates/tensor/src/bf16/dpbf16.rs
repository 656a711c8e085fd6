//! ferrotext's bf16 × bf16 → f32 product on AVX512_BF16 (`vdpbf16ps`): for processors whose
//! BLAS does not use their bf16 instructions (MKL on AMD EPYC runs its bf16 product at the f32
//! rate: measured with `examples/bf16.rs`).
//!
//! Invariants:
//! * Element `(i, j)` is one chain over the contraction in pairs `(2p, 2p + 1)`, `p` in order,
//!   from `+0` (the first block overwriting, or from the destination when accumulating): each
//!   `vdpbf16ps` adds the pair's two products (exact in `f32`), rounding to nearest with inputs
//!   and outputs that are subnormal taken as zero (the instruction's DAZ/FTZ). The contraction is
//!   cut into blocks of [`KC`] at fixed offsets, and a block's chain continues in `dst`. So an
//!   element's bits depend only on its row of `a` and column of `b` (not on `m`, `n`, the row
//!   block or the thread count), but they may differ from the portable kernel's chain (the pair
//!   rounding and DAZ/FTZ); the tests bound the difference by the order of addition.
//! * Operands of any strides are packed, per block of [`KC`] of the contraction: all of `a`'s
//!   rows once, [`MR`]-row tiles of pairs; `b` a [`NC`]-column block at a time in pairs (`k/2 ×
//!   NR × 2`, zero past `k` and `n`).

use std::arch::x86_64::{
    __m512, __m512bh, __m512i, _mm512_dpbf16_ps, _mm512_loadu_ps, _mm512_loadu_si512,
    _mm512_set1_epi32, _mm512_setzero_ps, _mm512_storeu_ps,
};

use half::bf16;

use crate::blas::{Operand, Store};

/// Rows of `a` a register tile covers.
const MR: usize = 8;
/// Columns of `b` a register tile covers: two registers of 16 `f32`.
const NR: usize = 32;
/// Columns of `b` packed at once (a block stays in L2 while every row tile runs over it).
const NC: usize = 512;
/// Contraction elements per block (even; a block's panel of `NR` columns is 32 KiB).
const KC: usize = 512;

/// True when this CPU has AVX512_BF16 (and AVX-512F).
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512f")
}

/// `dst = a · b` (or `+=`, per `store`) for bf16 `a` m×k and `b` k×n into `dst`'s `m` rows of
/// `n` `f32` elements `ldc` apart, on this thread.
///
/// # Safety
/// As [`crate::blas::sgemm`]; the CPU has AVX512_BF16 ([`available`]).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    ldc: usize,
    a: Operand<bf16>,
    b: Operand<bf16>,
    store: Store,
) {
    if m == 0 || n == 0 {
        return;
    }
    let tiles = m.div_ceil(MR);
    let mut bpack = vec![0u32; KC.div_ceil(2) * NC.div_ceil(NR) * NR];
    let mut apack = vec![0u32; KC.div_ceil(2) * MR * tiles];
    for l0 in (0..k.max(1)).step_by(KC) {
        let kc = KC.min(k - l0.min(k));
        let kp = kc.div_ceil(2);
        // All of `a`'s rows for this block of the contraction, packed once, tile after tile.
        for (t, tile_pack) in apack.chunks_mut(kp * MR).take(tiles).enumerate() {
            let i0 = t * MR;
            // SAFETY: rows i0..i0+rows, columns l0..l0+kc of `a` are inside the operand.
            unsafe { pack_a(a, i0, MR.min(m - i0), l0, kc, tile_pack) };
        }
        // The first block stores per `store`; later ones continue the chain in `dst`.
        let first = l0 == 0 && store == Store::Overwrite;
        for j0 in (0..n).step_by(NC) {
            let nc = NC.min(n - j0);
            // SAFETY: rows l0..l0+kc and columns j0..j0+nc of `b` are inside the operand.
            unsafe { pack_b(b, l0, kc, j0, nc, &mut bpack) };
            for (t, tile_pack) in apack.chunks(kp * MR).take(tiles).enumerate() {
                let i0 = t * MR;
                let rows = MR.min(m - i0);
                for (p, jp) in (0..nc).step_by(NR).enumerate() {
                    let cols = NR.min(nc - jp);
                    let panel = &bpack[p * kp * NR..(p + 1) * kp * NR];
                    // SAFETY: the CPU has the features (the caller's contract); rows
                    // i0..i0+rows, columns j0+jp..+cols of `dst` are the caller's.
                    unsafe {
                        tile(
                            rows,
                            kp,
                            tile_pack,
                            panel,
                            dst.add(i0 * ldc + j0 + jp),
                            ldc,
                            cols,
                            first,
                        )
                    };
                }
            }
        }
    }
}

/// Packs rows `l0..l0 + kc` × columns `j0..j0 + nc` of `b`: panel `p` (columns `p·NR..`) holds
/// for each pair `q` the `NR` columns' `(b[l0+2q, c], b[l0+2q+1, c])`, zeros past `k` and `n`.
///
/// # Safety
/// Those elements of `b` are readable.
unsafe fn pack_b(b: Operand<bf16>, l0: usize, kc: usize, j0: usize, nc: usize, out: &mut [u32]) {
    let kp = kc.div_ceil(2);
    let at = |l: usize, j: usize| -> u32 {
        if l < kc && j < nc {
            // SAFETY: (l0 + l, j0 + j) is inside `b`, by the caller's contract.
            u32::from(
                unsafe {
                    *b.ptr
                        .offset((l0 + l) as isize * b.rs + (j0 + j) as isize * b.cs)
                }
                .to_bits(),
            )
        } else {
            0
        }
    };
    for (p, panel) in out.chunks_mut(kp * NR).take(nc.div_ceil(NR)).enumerate() {
        for (q, row) in panel.chunks_mut(NR).enumerate() {
            for (c, slot) in row.iter_mut().enumerate() {
                let j = p * NR + c;
                *slot = at(2 * q, j) | (at(2 * q + 1, j) << 16);
            }
        }
    }
}

/// Packs rows `i0..i0 + rows` × columns `l0..l0 + kc` of `a` as pairs: `out[q·MR + r] =
/// (a[i0+r, l0+2q], a[i0+r, l0+2q+1])`, zero past `k`.
///
/// # Safety
/// Those elements of `a` are readable.
unsafe fn pack_a(a: Operand<bf16>, i0: usize, rows: usize, l0: usize, kc: usize, out: &mut [u32]) {
    let at = |r: usize, l: usize| -> u32 {
        if l < kc {
            // SAFETY: (i0 + r, l0 + l) is inside `a`, by the caller's contract.
            u32::from(
                unsafe {
                    *a.ptr
                        .offset((i0 + r) as isize * a.rs + (l0 + l) as isize * a.cs)
                }
                .to_bits(),
            )
        } else {
            0
        }
    };
    for (q, pairs) in out.chunks_mut(MR).take(kc.div_ceil(2)).enumerate() {
        for (r, slot) in pairs.iter_mut().enumerate().take(rows) {
            *slot = at(r, 2 * q) | (at(r, 2 * q + 1) << 16);
        }
    }
}

/// One tile of `rows ≤ MR` rows × `cols ≤ NR` columns over `kp` pairs, into `dst`.
///
/// # Safety
/// The CPU has AVX512_BF16; `dst`'s `rows` rows of `cols` elements `ldc` apart are writable
/// (initialised unless `first`).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile(
    rows: usize,
    kp: usize,
    apack: &[u32],
    panel: &[u32],
    dst: *mut f32,
    ldc: usize,
    cols: usize,
    first: bool,
) {
    // SAFETY: the caller's contract; each arm's `R` is `rows`.
    unsafe {
        match rows {
            8 => tile_r::<8>(kp, apack, panel, dst, ldc, cols, first),
            7 => tile_r::<7>(kp, apack, panel, dst, ldc, cols, first),
            6 => tile_r::<6>(kp, apack, panel, dst, ldc, cols, first),
            5 => tile_r::<5>(kp, apack, panel, dst, ldc, cols, first),
            4 => tile_r::<4>(kp, apack, panel, dst, ldc, cols, first),
            3 => tile_r::<3>(kp, apack, panel, dst, ldc, cols, first),
            2 => tile_r::<2>(kp, apack, panel, dst, ldc, cols, first),
            _ => tile_r::<1>(kp, apack, panel, dst, ldc, cols, first),
        }
    }
}

/// [`tile`] with `R` rows: `R × 2` accumulators, one `vdpbf16ps` per (row, half, pair).
///
/// # Safety
/// As [`tile`], with `R = rows`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_r<const R: usize>(
    kp: usize,
    apack: &[u32],
    panel: &[u32],
    dst: *mut f32,
    ldc: usize,
    cols: usize,
    first: bool,
) {
    let mut acc: [[__m512; 2]; R] = [[_mm512_setzero_ps(); 2]; R];
    if !first {
        for (r, acc) in acc.iter_mut().enumerate() {
            let mut row = [0.0f32; NR];
            // SAFETY: row r of the caller's block, `cols` initialised elements.
            unsafe { std::ptr::copy_nonoverlapping(dst.add(r * ldc), row.as_mut_ptr(), cols) };
            // SAFETY: `row` holds 32 floats.
            *acc = unsafe {
                [
                    _mm512_loadu_ps(row.as_ptr()),
                    _mm512_loadu_ps(row.as_ptr().add(16)),
                ]
            };
        }
    }
    for q in 0..kp {
        let bp = &panel[q * NR..(q + 1) * NR];
        // SAFETY: `bp` holds 32 u32 (64 bf16): two 512-bit loads; `__m512bh` is the same 512
        // bits read as 32 bf16.
        let (b0, b1): (__m512bh, __m512bh) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bp.as_ptr().cast())),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    bp.as_ptr().add(16).cast(),
                )),
            )
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            // The pair (a[r, 2q], a[r, 2q+1]) in every 32-bit lane.
            // SAFETY: a 512-bit integer vector read as 32 bf16, as above.
            let x: __m512bh = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                    apack[q * MR + r] as i32,
                ))
            };
            acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut row = [0.0f32; NR];
        // SAFETY: `row` holds 32 floats.
        unsafe {
            _mm512_storeu_ps(row.as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(row.as_mut_ptr().add(16), acc[1]);
        }
        // SAFETY: row r of the caller's block, `cols` writable elements.
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), dst.add(r * ldc), cols) };
    }
}

/// `b` (k×n) packed whole for [`gemm_rounded`]: each [`NR`]-column panel over the whole
/// contraction in pairs (`k/2 × NR × 2`, zero past `k` and `n`), panel after panel.
pub(crate) struct PackedB {
    data: Vec<u32>,
    k: usize,
    n: usize,
}

/// Packs all of `b` (k×n) once, for every row block of a product to share.
///
/// # Safety
/// `b`'s `k` rows of `n` elements are readable.
pub(crate) unsafe fn pack_b_whole(b: Operand<bf16>, k: usize, n: usize) -> PackedB {
    let mut data = vec![0u32; k.div_ceil(2) * n.div_ceil(NR) * NR];
    // SAFETY: rows 0..k and columns 0..n of `b` are inside the operand (the caller's contract).
    unsafe { pack_b(b, 0, k, 0, n, &mut data) };
    PackedB { data, k, n }
}

/// `dst = round_bf16(a · b)` for bf16 `a` m×k and `b` packed by [`pack_b_whole`], into `dst`'s
/// `m` rows of `n` bf16 elements `ldc` apart, on this thread. Each register tile runs the whole
/// contraction and is rounded as it is stored: no `f32` result. Its chain is [`gemm`]'s (pairs
/// in order from `+0`; [`gemm`] continues it through `dst` at each block of [`KC`], an exact
/// store and load, and [`KC`] is even so the pairs are the same), so each element is, bit for
/// bit, `round_bf16` of what [`gemm`] stores. `a` is packed whole once; then per panel of `b`
/// (kept in L2) every row tile runs over it.
///
/// # Safety
/// As [`gemm`], with `dst` bf16; the CPU has AVX512_BF16 ([`available`]); `k > 0`.
pub(crate) unsafe fn gemm_rounded(
    m: usize,
    a: Operand<bf16>,
    b: &PackedB,
    dst: *mut bf16,
    ldc: usize,
) {
    let (k, n) = (b.k, b.n);
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let (kp, tiles) = (k.div_ceil(2), m.div_ceil(MR));
    let mut apack = vec![0u32; kp * MR * tiles];
    for (t, tile_pack) in apack.chunks_mut(kp * MR).enumerate() {
        // SAFETY: rows t·MR.., all columns of `a` are inside the operand.
        unsafe { pack_a(a, t * MR, MR.min(m - t * MR), 0, k, tile_pack) };
    }
    let mut acc = [0.0f32; MR * NR];
    for (p, panel) in b.data.chunks(kp * NR).enumerate() {
        let (j0, cols) = (p * NR, NR.min(n - p * NR));
        for (t, tile_pack) in apack.chunks(kp * MR).enumerate() {
            let rows = MR.min(m - t * MR);
            // SAFETY: the CPU has the features (the caller's contract); `acc` holds `MR` rows
            // of `NR`.
            unsafe { tile(rows, kp, tile_pack, panel, acc.as_mut_ptr(), NR, cols, true) };
            for (r, row) in acc.chunks(NR).take(rows).enumerate() {
                // SAFETY: row t·MR + r, columns j0..j0+cols of the caller's `dst`.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(dst.add((t * MR + r) * ldc + j0), cols)
                };
                super::round_slice(&row[..cols], out);
            }
        }
    }
}
