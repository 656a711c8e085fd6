//! The portable matrix product: ferrotext's own kernel, whose bits depend only on the operands'
//! values, never on the processor, the shapes around them, or the thread count.
//!
//! A BLAS picks its kernel — and so the order in which it adds each element's products — by
//! processor, cache sizes and matrix shape: MKL takes another path on an AMD EPYC than on a
//! Xeon, OpenBLAS another on Haswell than on SkylakeX, and a product cut into row blocks or
//! padded with zero columns need not give the whole product's bits. Here every element is
//! computed one way.
//!
//! Invariants (what `deterministic=true` and the bitwise tests rest on):
//! * Element `(i, j)` is one chain of fused multiply-adds over the contraction in index order,
//!   started from `+0`: `acc = fma(a[i,l], b[l,j], acc)` for `l = 0..k`. Overwriting stores
//!   `acc`; accumulating stores `dst + acc` (one rounding, so adding into a buffer has the bits
//!   of computing the product and adding it after).
//! * So the bits of `(i, j)` depend only on row `i` of `a` and column `j` of `b`: not on `m` or
//!   `n`, the strides, which row block or thread computed it, or the instruction set. A fused
//!   multiply-add is exactly rounded, so the AVX-512, AVX2 and scalar (`f32::mul_add`) paths
//!   give the same bits; the lanes of a vector are different elements, never parts of one sum.
//! * Zero terms at either end of the contraction change nothing: a chain from `+0` stays `+0`
//!   through leading zero products, and `acc + (±0) = acc` after it (up to the sign of a zero
//!   result). So a product over the columns a causal row can see equals the full product with
//!   the masked probabilities (exact zeros) included.
//!
//! * bf16 operands are widened to f32 as they are read (exactly), so a bf16 product has the
//!   bits of the f32 product of the widened operands, on every instruction set.
//!
//! Where the time goes: `b` is packed [`NR`] columns at a time (`k × NR`, contiguous, zero past
//! `n`), then every row tile of `a` runs over that panel with its accumulators in registers
//! (`MR_AVX512` rows × 32 columns in 16 AVX-512 registers; [`MR`] rows elsewhere, on AVX2 in two
//! passes of 16 columns, 12 registers each). A right operand packed whole beforehand
//! ([`Panels`]: a step's weight kept packed, `crate::packings`) is read from its panels instead:
//! the same words, so the same bits. Where `b` spans several panels, the vector tiles read `a`
//! from a row-major `f32` copy when it is bf16 or transposed (`RowMajorA`, up to 32 MiB), made
//! once per product. No blocking of the contraction: that would split the chain.
//! Measured here (AMD EPYC, one thread, `ferrotext bench kernels`): see the README's kernel table.

pub(crate) use crate::isa::Isa;
use crate::operand::{Operand, Product, Store, Widen};

/// Rows of `a` a register tile covers on AVX2 and the scalar route.
const MR: usize = 6;
/// Rows of `a` an AVX-512 register tile covers: 16 accumulators of its 32 registers, the
/// broadcast and the panel's two loads beside them.
#[cfg(target_arch = "x86_64")]
const MR_AVX512: usize = 8;
/// Columns of `b` a packed panel (and a register tile) covers: two AVX-512 registers.
pub(crate) const NR: usize = 32;
/// Columns the AVX2 tile covers in one pass over the panel: two AVX2 registers (a whole
/// panel's `MR × 4` accumulators would not fit AVX2's 16 registers).
#[cfg(target_arch = "x86_64")]
const HALF: usize = NR / 2;

/// The product `job` on this thread, on `isa`, with the operands' elements widened to f32 as
/// they are read. The bits are this module's invariants'.
///
/// # Safety
/// As [`crate::blas::sgemm`]; `isa` must be one this CPU has ([`Isa::detect`] gives one).
pub(crate) unsafe fn gemm<T: Widen>(isa: Isa, job: Product<T>) {
    // SAFETY: the caller's contract.
    unsafe { gemm_kept(isa, job, None) }
}

/// [`gemm`] with `b` read from `kept`, its panels packed beforehand, when given: the same
/// bits, without packing `b` again.
///
/// # Safety
/// As [`gemm`]; `kept`, when given, is [`Panels::pack`] of the job's `b` (its `k` and `n`).
pub(crate) unsafe fn gemm_kept<T: Widen>(isa: Isa, job: Product<T>, kept: Option<&Panels>) {
    debug_assert!(kept.is_none_or(|p| p.k == job.k && p.n == job.n));
    // SAFETY: the caller's contract; each path needs only the features `isa` names, and `a`
    // (the copy's or the job's) holds the job's `a`.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx2 => match RowMajorA::of(&job) {
                Some(copy) => run_vector(isa, copy.operand(), &job, kept),
                None => run_vector(isa, job.a, &job, kept),
            },
            _ => job.run(kept),
        }
    }
}

/// A right operand (`k × n`) packed whole into the panels the tiles read: panel `p` holds
/// columns `p·NR .. (p+1)·NR` as `k` rows of [`NR`] widened values, zero past `n` — the words
/// a product packs for itself, panel by panel.
pub(crate) struct Panels {
    values: Vec<f32>,
    k: usize,
    n: usize,
}

impl Panels {
    /// `b` packed whole, its panels in up to `threads` groups on the rayon pool (each panel's
    /// words do not depend on the group that packed it).
    ///
    /// # Safety
    /// `b`'s `k` rows of `n` elements are readable.
    pub(crate) unsafe fn pack<T: Widen>(
        b: Operand<T>,
        k: usize,
        n: usize,
        threads: usize,
    ) -> Panels {
        /// The operand crossing threads: every group only reads it.
        struct Shared<T>(Operand<T>);
        // SAFETY: see the struct's doc; `T` is a plain element read through the pointer.
        unsafe impl<T: Sync> Sync for Shared<T> {}
        let panels = n.div_ceil(NR);
        let size = (k * NR).max(1);
        let mut values = vec![0.0f32; panels * k * NR];
        let per_group = panels.div_ceil(threads.clamp(1, panels.max(1))).max(1);
        let shared = Shared(b);
        let pack_group = |(g, group): (usize, &mut [f32])| {
            let b = &shared;
            for (i, panel) in group.chunks_exact_mut(size).enumerate() {
                let j0 = (g * per_group + i) * NR;
                // SAFETY: columns j0..j0 + cols of `b`, rows 0..k: inside it, by the caller's
                // contract.
                unsafe { pack_panel(b.0, k, j0, NR.min(n - j0), panel) };
            }
        };
        if per_group >= panels {
            values
                .chunks_mut(per_group * size)
                .enumerate()
                .for_each(pack_group);
        } else {
            use rayon::prelude::*;
            values
                .par_chunks_mut(per_group * size)
                .with_max_len(1)
                .enumerate()
                .for_each(pack_group);
        }
        Panels { values, k, n }
    }

    /// The panel holding columns `j0 .. j0 + NR` (`j0` a multiple of [`NR`] below `n`).
    fn panel(&self, j0: usize) -> &[f32] {
        let size = self.k * NR;
        &self.values[j0 / NR * size..(j0 / NR + 1) * size]
    }
}

/// [`Product::run`] with `isa`'s register tile (AVX-512, else AVX2), reading the left operand
/// from `a` (the job's, or its [`RowMajorA`]).
///
/// # Safety
/// As [`gemm_kept`]; `isa` is a vector set this CPU has; `a` holds the values of the job's `a`.
#[cfg(target_arch = "x86_64")]
unsafe fn run_vector<A: Widen, T: Widen>(
    isa: Isa,
    a: Operand<A>,
    job: &Product<T>,
    kept: Option<&Panels>,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match isa {
            Isa::Avx512 => run_avx512(a, job, kept),
            _ => run_avx2(a, job, kept),
        }
    }
}

/// [`run_vector`] on AVX-512.
///
/// # Safety
/// The CPU has AVX-512F and FMA; as [`run_vector`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn run_avx512<A: Widen, T: Widen>(a: Operand<A>, job: &Product<T>, kept: Option<&Panels>) {
    let full = |job: &Product<T>, i0, j0, cols, panel: &[f32]| {
        // SAFETY: the CPU has the features (the caller checked); `run_with` hands this
        // closure rows and columns inside the job's operands, which `a` holds.
        unsafe { avx512_tile::<A, T, MR_AVX512>(a, job, i0, j0, cols, panel) }
    };
    let rest = |job: &Product<T>, rows, i0, j0, cols, panel: &[f32]| {
        // SAFETY: as for `full`.
        unsafe { avx512_tile_rows(a, job, rows, i0, j0, cols, panel) }
    };
    // SAFETY: the caller's contract.
    unsafe { job.run_with::<MR_AVX512>(full, rest, kept) }
}

/// [`avx512_tile`] for the last `rows < MR_AVX512` rows.
///
/// # Safety
/// As [`avx512_tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn avx512_tile_rows<A: Widen, T: Widen>(
    a: Operand<A>,
    job: &Product<T>,
    rows: usize,
    i0: usize,
    j0: usize,
    cols: usize,
    panel: &[f32],
) {
    // SAFETY: the caller's contract.
    unsafe {
        match rows {
            7 => avx512_tile::<A, T, 7>(a, job, i0, j0, cols, panel),
            6 => avx512_tile::<A, T, 6>(a, job, i0, j0, cols, panel),
            5 => avx512_tile::<A, T, 5>(a, job, i0, j0, cols, panel),
            4 => avx512_tile::<A, T, 4>(a, job, i0, j0, cols, panel),
            3 => avx512_tile::<A, T, 3>(a, job, i0, j0, cols, panel),
            2 => avx512_tile::<A, T, 2>(a, job, i0, j0, cols, panel),
            _ => avx512_tile::<A, T, 1>(a, job, i0, j0, cols, panel),
        }
    }
}

/// [`Product::tile`] in AVX-512 registers, reading the left operand from `a`: `R × 2`
/// accumulators of 16 lanes, one `_mm512_fmadd_ps` per (row, half, `l`) — the same chain per
/// element as `f32::mul_add`.
///
/// # Safety
/// The CPU has AVX-512F and FMA; as [`Product::tile`], with `a` holding the job's `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn avx512_tile<A: Widen, T: Widen, const R: usize>(
    a: Operand<A>,
    job: &Product<T>,
    i0: usize,
    j0: usize,
    cols: usize,
    panel: &[f32],
) {
    use std::arch::x86_64::{
        _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_setzero_ps, _mm512_storeu_ps,
    };
    let Operand { ptr, rs, cs } = a;
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    let rows: [*const A; R] = std::array::from_fn(|r| ptr.wrapping_offset((i0 + r) as isize * rs));
    for (l, brow) in panel.chunks_exact(NR).enumerate() {
        // SAFETY: `brow` holds NR = 32 floats: two unaligned 16-lane loads.
        let (b0, b1) = unsafe {
            (
                _mm512_loadu_ps(brow.as_ptr()),
                _mm512_loadu_ps(brow.as_ptr().add(16)),
            )
        };
        for r in 0..R {
            // SAFETY: (i0 + r, l) is inside `a`, by the caller's contract.
            let x = _mm512_set1_ps(unsafe { *rows[r].wrapping_offset(l as isize * cs) }.widen());
            acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
        }
    }
    let mut out = [[0.0f32; NR]; R];
    for (o, a) in out.iter_mut().zip(&acc) {
        // SAFETY: `o` holds 32 floats.
        unsafe {
            _mm512_storeu_ps(o.as_mut_ptr(), a[0]);
            _mm512_storeu_ps(o.as_mut_ptr().add(16), a[1]);
        }
    }
    // SAFETY: the caller's contract.
    unsafe { job.store(i0, j0, cols, &out) };
}

/// [`run_vector`] on AVX2.
///
/// # Safety
/// The CPU has AVX2 and FMA; as [`run_vector`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<A: Widen, T: Widen>(a: Operand<A>, job: &Product<T>, kept: Option<&Panels>) {
    let full = |job: &Product<T>, i0, j0, cols, panel: &[f32]| {
        // SAFETY: the CPU has the features (the caller checked); `run_with` hands this
        // closure rows and columns inside the job's operands, which `a` holds.
        unsafe { avx2_tile::<A, T, MR>(a, job, i0, j0, cols, panel) }
    };
    let rest = |job: &Product<T>, rows, i0, j0, cols, panel: &[f32]| {
        // SAFETY: as for `full`.
        unsafe {
            match rows {
                5 => avx2_tile::<A, T, 5>(a, job, i0, j0, cols, panel),
                4 => avx2_tile::<A, T, 4>(a, job, i0, j0, cols, panel),
                3 => avx2_tile::<A, T, 3>(a, job, i0, j0, cols, panel),
                2 => avx2_tile::<A, T, 2>(a, job, i0, j0, cols, panel),
                _ => avx2_tile::<A, T, 1>(a, job, i0, j0, cols, panel),
            }
        }
    };
    // SAFETY: the caller's contract.
    unsafe { job.run_with::<MR>(full, rest, kept) }
}

/// [`Product::tile`] in AVX2 registers, reading the left operand from `a`, one half of the panel ([`HALF`] columns) at a time:
/// `R × 2` accumulators of 8 lanes (12 of the 16 registers at `R = MR`), one
/// `_mm256_fmadd_ps` per (row, quarter, `l`) — the same chain per element as `f32::mul_add`.
/// The second half is skipped when the panel's columns past `n` are all it would compute.
///
/// # Safety
/// The CPU has AVX2 and FMA; as [`Product::tile`], with `a` holding the job's `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_tile<A: Widen, T: Widen, const R: usize>(
    a: Operand<A>,
    job: &Product<T>,
    i0: usize,
    j0: usize,
    cols: usize,
    panel: &[f32],
) {
    use std::arch::x86_64::{
        _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let Operand { ptr, rs, cs } = a;
    let rows: [*const A; R] = std::array::from_fn(|r| ptr.wrapping_offset((i0 + r) as isize * rs));
    let mut out = [[0.0f32; NR]; R];
    for half in 0..cols.div_ceil(HALF) {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (l, brow) in panel.chunks_exact(NR).enumerate() {
            let brow = &brow[half * HALF..(half + 1) * HALF];
            // SAFETY: `brow` holds HALF = 16 floats: two unaligned 8-lane loads.
            let (b0, b1) = unsafe {
                (
                    _mm256_loadu_ps(brow.as_ptr()),
                    _mm256_loadu_ps(brow.as_ptr().add(8)),
                )
            };
            for r in 0..R {
                // SAFETY: (i0 + r, l) is inside `a`, by the caller's contract.
                let x =
                    _mm256_set1_ps(unsafe { *rows[r].wrapping_offset(l as isize * cs) }.widen());
                acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            // SAFETY: `o` holds NR = 32 floats; this half's 16 start at `half * HALF`.
            unsafe {
                _mm256_storeu_ps(o.as_mut_ptr().add(half * HALF), a[0]);
                _mm256_storeu_ps(o.as_mut_ptr().add(half * HALF + 8), a[1]);
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { job.store(i0, j0, cols, &out) };
}

/// The largest [`RowMajorA`] a product makes: its memory is outside what a run's plan counts,
/// so it stays small beside a step's (a bf16 logits gradient, 512 tokens × a 151,936-word
/// vocabulary, would be a 311 MB copy; it is read in place instead).
#[cfg(target_arch = "x86_64")]
const ROW_MAJOR_A_MAX_BYTES: usize = 32 << 20;

/// A product's left operand copied once, widened to `f32` and row-major, for the vector tiles
/// to read in place of the operand itself: a tile reads each element of `a` once per panel of
/// `b`, so a `bf16` element is widened (four instructions before its broadcast, against one
/// load for an `f32`) and a transposed `a` is read across rows (a cache line for every `l`)
/// once per panel. Made only where `b` has more than one panel; the values, and so the bits,
/// are the operand's.
#[cfg(target_arch = "x86_64")]
struct RowMajorA {
    values: Vec<f32>,
    k: usize,
}

#[cfg(target_arch = "x86_64")]
impl RowMajorA {
    /// The copy of `job`'s `a`, or `None` when the tiles read the operand as cheaply (an `f32`
    /// operand whose rows are contiguous), read it only once (`b` is one panel), or the copy
    /// would take more than [`ROW_MAJOR_A_MAX_BYTES`].
    ///
    /// # Safety
    /// `job.a` is readable for `m` rows and `k` columns.
    unsafe fn of<T: Widen>(job: &Product<T>) -> Option<RowMajorA> {
        let Operand { ptr, rs, cs } = job.a;
        let bytes = job.m.saturating_mul(job.k).saturating_mul(size_of::<f32>());
        if job.n <= NR || (!T::WIDENS && cs == 1) || job.k == 0 || bytes > ROW_MAJOR_A_MAX_BYTES {
            return None;
        }
        let (m, k) = (job.m, job.k);
        let mut values = vec![0.0f32; m * k];
        if cs == 1 {
            for (i, row) in values.chunks_exact_mut(k).enumerate() {
                for (l, v) in row.iter_mut().enumerate() {
                    // SAFETY: (i, l) is inside `a`, by the caller's contract.
                    *v = unsafe { *ptr.offset(i as isize * rs + l as isize) }.widen();
                }
            }
        } else {
            // Down each column of the copy, along a row of a transposed `a`'s memory.
            for l in 0..k {
                for (i, v) in values.iter_mut().skip(l).step_by(k).enumerate() {
                    // SAFETY: (i, l) is inside `a`, by the caller's contract.
                    *v = unsafe { *ptr.offset(i as isize * rs + l as isize * cs) }.widen();
                }
            }
        }
        Some(RowMajorA { values, k })
    }

    /// The copy as an operand: row `i` at `i · k`, contiguous.
    fn operand(&self) -> Operand<f32> {
        Operand {
            ptr: self.values.as_ptr(),
            rs: self.k as isize,
            cs: 1,
        }
    }
}

/// `panel[l·NR + c] = b[l, j0 + c]` (widened) for `c < cols` and `l < k`, zero for the columns
/// past `cols`: one panel of `b`, as a product packs it and [`Panels::pack`] keeps it. A
/// transposed `b` (`dy·Wᵀ`'s, each column contiguous) is gathered [`GATHER_ROWS`] rows at a
/// time, so the panel's block stays in L1 while each column is read along memory.
///
/// # Safety
/// Columns `j0..j0 + cols` of `b` are readable for rows `0..k`; `panel` holds `k · NR` values.
#[inline(always)]
unsafe fn pack_panel<T: Widen>(b: Operand<T>, k: usize, j0: usize, cols: usize, panel: &mut [f32]) {
    let Operand { ptr, rs, cs } = b;
    let first = ptr.wrapping_offset(j0 as isize * cs);
    if rs == 1 && cs != 1 {
        for (block, l0) in panel
            .chunks_mut(GATHER_ROWS * NR)
            .zip((0..k).step_by(GATHER_ROWS))
        {
            let rows = block.len() / NR;
            for c in 0..NR {
                if c >= cols {
                    block
                        .iter_mut()
                        .skip(c)
                        .step_by(NR)
                        .for_each(|slot| *slot = 0.0);
                    continue;
                }
                // SAFETY: column j0 + c, rows l0..l0 + rows: inside `b` (`rs` is 1), by the
                // caller's contract.
                let column = unsafe {
                    std::slice::from_raw_parts(
                        first.wrapping_offset(c as isize * cs + l0 as isize),
                        rows,
                    )
                };
                for (slot, &x) in block.iter_mut().skip(c).step_by(NR).zip(column) {
                    *slot = x.widen();
                }
            }
        }
        return;
    }
    for (l, row) in panel.chunks_exact_mut(NR).enumerate().take(k) {
        let at = first.wrapping_offset(l as isize * rs);
        let (values, past) = row.split_at_mut(cols);
        if cs == 1 {
            // SAFETY: row l, columns j0..j0 + cols: inside `b` (`cs` is 1), by the caller's
            // contract.
            let src = unsafe { std::slice::from_raw_parts(at, cols) };
            for (slot, &x) in values.iter_mut().zip(src) {
                *slot = x.widen();
            }
        } else {
            for (c, slot) in values.iter_mut().enumerate() {
                // SAFETY: (l, j0 + c) is inside `b`, by the caller's contract.
                *slot = unsafe { *at.wrapping_offset(c as isize * cs) }.widen();
            }
        }
        past.fill(0.0);
    }
}

/// Rows of a transposed `b` a panel is gathered by at a time (`64 × NR` values: 8 KiB).
const GATHER_ROWS: usize = 64;

impl<T: Widen> Product<T> {
    /// Panel by panel of `b`, tile by tile of `a`, with the portable tiles: the scalar set's
    /// route, where each `mul_add` is a call to libm's `fmaf`. (A closure does not take the
    /// target features of the function it is inlined into, so a vector set needs tiles of its
    /// own, `#[target_feature]` functions: through this route an AVX2 product ran at
    /// 0.5 GFLOP/s, one `fmaf` call per multiply-add.)
    ///
    /// # Safety
    /// As [`gemm_kept`].
    #[inline(always)]
    unsafe fn run(&self, kept: Option<&Panels>) {
        let full = |job: &Product<T>, i0, j0, cols, panel: &[f32]| {
            // SAFETY: `run_with` hands this closure rows and columns inside the job's
            // operands, by the caller's contract.
            unsafe { job.tile::<MR>(i0, j0, cols, panel) }
        };
        let rest = |job: &Product<T>, rows, i0, j0, cols, panel: &[f32]| {
            // SAFETY: as for `full`.
            unsafe {
                match rows {
                    5 => job.tile::<5>(i0, j0, cols, panel),
                    4 => job.tile::<4>(i0, j0, cols, panel),
                    3 => job.tile::<3>(i0, j0, cols, panel),
                    2 => job.tile::<2>(i0, j0, cols, panel),
                    _ => job.tile::<1>(i0, j0, cols, panel),
                }
            }
        };
        // SAFETY: the caller's contract.
        unsafe { self.run_with::<MR>(full, rest, kept) }
    }

    /// Panel by panel of `b` (packed once, or read from `kept`), every whole tile of `FULL`
    /// rows by `full`, the last rows by `rest`.
    ///
    /// # Safety
    /// As [`gemm_kept`]; `full` and `rest` compute the rows and columns they are given, as
    /// [`Product::tile`] does.
    #[inline(always)]
    unsafe fn run_with<const FULL: usize>(
        &self,
        full: impl Fn(&Product<T>, usize, usize, usize, &[f32]),
        rest: impl Fn(&Product<T>, usize, usize, usize, usize, &[f32]),
        kept: Option<&Panels>,
    ) {
        if self.m == 0 || self.n == 0 {
            return;
        }
        let mut own = Vec::new();
        for j0 in (0..self.n).step_by(NR) {
            let cols = NR.min(self.n - j0);
            let panel = match kept {
                Some(kept) => kept.panel(j0),
                None => {
                    own.resize(self.k * NR, 0.0);
                    // SAFETY: columns j0..j0+cols of `b`, rows 0..k: inside the caller's
                    // operand.
                    unsafe { pack_panel(self.b, self.k, j0, cols, &mut own) };
                    &own[..]
                }
            };
            let whole = self.m - self.m % FULL;
            for i0 in (0..whole).step_by(FULL) {
                full(self, i0, j0, cols, panel);
            }
            if whole < self.m {
                rest(self, self.m - whole, whole, j0, cols, panel);
            }
        }
    }

    /// Rows `i0..i0 + R` × columns `j0..j0 + cols` of the product: `R × NR` chains over `k`.
    ///
    /// # Safety
    /// Those rows of `a` and that block of `dst` are inside the caller's operands.
    #[inline(always)]
    unsafe fn tile<const R: usize>(&self, i0: usize, j0: usize, cols: usize, panel: &[f32]) {
        let Operand { ptr, rs, cs } = self.a;
        let mut acc = [[0.0f32; NR]; R];
        for (l, brow) in panel.chunks_exact(NR).enumerate() {
            let brow: &[f32; NR] = brow.try_into().unwrap_or(&[0.0; NR]);
            for (r, acc_row) in acc.iter_mut().enumerate() {
                // SAFETY: (i0 + r, l) is inside `a`, by the caller's contract.
                let x = unsafe { *ptr.offset((i0 + r) as isize * rs + l as isize * cs) }.widen();
                for (acc, &y) in acc_row.iter_mut().zip(brow) {
                    *acc = x.mul_add(y, *acc);
                }
            }
        }
        // SAFETY: the caller's contract.
        unsafe { self.store(i0, j0, cols, &acc) };
    }

    /// Writes a finished tile's first `cols` columns into rows `i0..` of `dst`: overwriting, or
    /// adding each element once (`dst + acc`, one rounding).
    ///
    /// # Safety
    /// Rows `i0..i0 + R`, columns `j0..j0 + cols` of `dst` are inside the caller's block.
    #[inline(always)]
    unsafe fn store<const R: usize>(
        &self,
        i0: usize,
        j0: usize,
        cols: usize,
        acc: &[[f32; NR]; R],
    ) {
        for (r, acc_row) in acc.iter().enumerate() {
            // SAFETY: row i0 + r of `dst`, columns j0..j0 + cols: inside the caller's block.
            let out = unsafe {
                std::slice::from_raw_parts_mut(self.dst.add((i0 + r) * self.ldc + j0), cols)
            };
            match self.store {
                Store::Overwrite => out.copy_from_slice(&acc_row[..cols]),
                Store::Accumulate => {
                    for (o, &v) in out.iter_mut().zip(acc_row) {
                        *o += v;
                    }
                }
            }
        }
    }
}

/// For tests that compare two routes through the matrix-product kernel (row blocks against the
/// whole product, strided views against copies, a shorter contraction against a zero-padded
/// one): `got` equals `want` to the bit on the portable kernel, whose invariants promise it,
/// and within a float tolerance on a BLAS or `gemm`, whose order of addition follows the
/// processor and the shape.
#[cfg(test)]
pub(crate) fn assert_equal_across_routes(got: &crate::Tensor, want: &crate::Tensor, what: &str) {
    if crate::matmul_order_is_fixed() {
        assert_eq!(got, want, "{what}");
        return;
    }
    assert_eq!(got.shape(), want.shape(), "{what}");
    for (i, (x, y)) in got.data().iter().zip(want.data()).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{what} [{i}]: {x} vs {y}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 9) as f32
                    / 8_388_608.0
                    - 0.5
            })
            .collect()
    }

    /// The invariant written out: each element one `mul_add` chain from +0, in index order.
    fn chains(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for l in 0..k {
                    acc = a[i * k + l].mul_add(b[l * n + j], acc);
                }
                out[i * n + j] = acc;
            }
        }
        out
    }

    fn run(isa: Isa, (m, n, k): (usize, usize, usize), a: Operand, b: Operand, dst: &mut [f32]) {
        run_stored(isa, (m, n, k), (a, b), dst, Store::Overwrite);
    }

    fn run_stored(
        isa: Isa,
        (m, n, k): (usize, usize, usize),
        (a, b): (Operand, Operand),
        dst: &mut [f32],
        store: Store,
    ) {
        assert!(dst.len() >= m * n);
        let p = Product {
            m,
            n,
            k,
            a,
            b,
            dst: dst.as_mut_ptr(),
            ldc: n,
            store,
        };
        // SAFETY: callers pass operands covering m×k and k×n, and `dst` holds m×n.
        unsafe { gemm(isa, p) };
    }

    /// Every instruction set this CPU runs; the ones it lacks are reported skipped (`test`
    /// names the check).
    fn isas(test: &str) -> Vec<Isa> {
        let all = [Isa::Scalar, Isa::Avx2, Isa::Avx512];
        let best = Isa::best();
        let here: Vec<Isa> = all
            .into_iter()
            .filter(|&isa| match (isa, best) {
                (Isa::Scalar, _) | (_, Isa::Avx512) => true,
                (Isa::Avx2, best) => best == Isa::Avx2,
                (Isa::Avx512, _) => false,
            })
            .collect();
        for isa in all.iter().filter(|i| !here.contains(i)) {
            crate::report_skipped(
                &format!("tensor portable::tests::{test} on {}", isa.name()),
                "this processor does not have it",
            );
        }
        here
    }

    /// `x` (rows × cols, row-major) transposed.
    fn transposed<T: Copy>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
        (0..rows * cols)
            .map(|i| x[(i % rows) * cols + i / rows])
            .collect()
    }

    /// The operands reading a rows × cols matrix from `x` (row-major) and `xt` (its transpose).
    fn layouts<T>(x: &[T], xt: &[T], rows: usize, cols: usize) -> [Operand<T>; 2] {
        [
            Operand {
                ptr: x.as_ptr(),
                rs: cols as isize,
                cs: 1,
            },
            Operand {
                ptr: xt.as_ptr(),
                rs: 1,
                cs: rows as isize,
            },
        ]
    }

    /// Every instruction set gives the chains' bits, on sizes that leave partial tiles and
    /// panels (and span several panels, where the vector tiles read a copy of `a` when it is
    /// transposed or bf16), with `a` and `b` row-major and transposed, in `f32` and in bf16
    /// (whose chains are the `f32` chains of the widened values).
    #[test]
    fn every_instruction_set_gives_the_chains_bits() {
        for (m, n, k) in [(1, 1, 1), (7, 33, 5), (13, 70, 129), (64, 96, 300)] {
            let bf16 = |x: Vec<f32>| -> Vec<half::bf16> {
                x.into_iter().map(half::bf16::from_f32).collect()
            };
            let (a16, b16) = (bf16(data(m * k, 1)), bf16(data(k * n, 2)));
            let (a, b): (Vec<f32>, Vec<f32>) = (
                a16.iter().map(|x| x.to_f32()).collect(),
                b16.iter().map(|x| x.to_f32()).collect(),
            );
            let want = chains(m, n, k, &a, &b);
            let (at, bt) = (transposed(&a, m, k), transposed(&b, k, n));
            let (at16, bt16) = (transposed(&a16, m, k), transposed(&b16, k, n));
            for isa in isas("every_instruction_set_gives_the_chains_bits") {
                for (i, a_op) in layouts(&a, &at, m, k).into_iter().enumerate() {
                    for (j, b_op) in layouts(&b, &bt, k, n).into_iter().enumerate() {
                        let mut out = vec![f32::NAN; m * n];
                        run(isa, (m, n, k), a_op, b_op, &mut out);
                        assert_eq!(out, want, "{isa:?} f32 {m}×{n}×{k}, layouts {i} {j}");
                    }
                }
                for (i, a_op) in layouts(&a16, &at16, m, k).into_iter().enumerate() {
                    for (j, b_op) in layouts(&b16, &bt16, k, n).into_iter().enumerate() {
                        let mut out = vec![f32::NAN; m * n];
                        let p = Product {
                            m,
                            n,
                            k,
                            a: a_op,
                            b: b_op,
                            dst: out.as_mut_ptr(),
                            ldc: n,
                            store: Store::Overwrite,
                        };
                        // SAFETY: the operands cover m×k and k×n, and `out` holds m×n.
                        unsafe { gemm(isa, p) };
                        assert_eq!(out, want, "{isa:?} bf16 {m}×{n}×{k}, layouts {i} {j}");
                    }
                }
            }
        }
    }

    /// The product of `a` (m×k) and `b` (k×n, packed as `panels`) on `isa`, overwriting.
    fn with_panels<T: Widen>(
        isa: Isa,
        (m, n, k): (usize, usize, usize),
        a: Operand<T>,
        b: Operand<T>,
        panels: &Panels,
    ) -> Vec<f32> {
        let mut out = vec![f32::NAN; m * n];
        let p = Product {
            m,
            n,
            k,
            a,
            b,
            dst: out.as_mut_ptr(),
            ldc: n,
            store: Store::Overwrite,
        };
        // SAFETY: callers pass operands covering m×k and k×n and `b`'s panels; `out` holds
        // m×n.
        unsafe { gemm_kept(isa, p, Some(panels)) };
        out
    }

    /// A right operand packed whole beforehand ([`Panels`]) gives the chains' bits on every
    /// instruction set, `b` row-major and transposed (`x·W`'s and `dy·Wᵀ`'s layouts), in `f32`
    /// and bf16 (and an `f32` `b` strided on both axes), for the whole product and for a block of
    /// its rows reading the same panels, on
    /// sizes that leave partial tiles (of 8 rows and of 6) and a partial last panel. Mirror:
    /// panels packed from another `b` give other values, so the tiles do read them.
    #[test]
    fn kept_panels_give_the_chains_bits() {
        for (m, n, k) in [
            (1, 1, 1),
            (7, 33, 5),
            (13, 70, 129),
            (64, 96, 300),
            (9, 40, 17),
        ] {
            let bf16 = |x: Vec<f32>| -> Vec<half::bf16> {
                x.into_iter().map(half::bf16::from_f32).collect()
            };
            let (a16, b16) = (bf16(data(m * k, 11)), bf16(data(k * n, 12)));
            let widened = |x: &[half::bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
            let (a, b) = (widened(&a16), widened(&b16));
            let want = chains(m, n, k, &a, &b);
            let (bt, bt16) = (transposed(&b, k, n), transposed(&b16, k, n));
            let a_op = Operand {
                ptr: a.as_ptr(),
                rs: k as isize,
                cs: 1,
            };
            // A third layout, strided on both axes: `b`'s columns every other one of a wider
            // matrix's.
            let wide: Vec<f32> = (0..k * 2 * n)
                .map(|i| if i % 2 == 0 { b[i / 2] } else { f32::NAN })
                .collect();
            let strided = Operand {
                ptr: wide.as_ptr(),
                rs: 2 * n as isize,
                cs: 2,
            };
            for isa in isas("kept_panels_give_the_chains_bits") {
                let [row_major, column_major] = layouts(&b, &bt, k, n);
                for (j, b_op) in [row_major, column_major, strided].into_iter().enumerate() {
                    // SAFETY: `b_op` covers k×n.
                    let panels = unsafe { Panels::pack(b_op, k, n, 1 + j % 2) };
                    let out = with_panels(isa, (m, n, k), a_op, b_op, &panels);
                    assert_eq!(out, want, "{isa:?} f32 {m}×{n}×{k}, b layout {j}");
                    // Rows 1..m alone, reading the same panels.
                    if m > 1 {
                        let rows = Operand {
                            ptr: a[k..].as_ptr(),
                            ..a_op
                        };
                        let out = with_panels(isa, (m - 1, n, k), rows, b_op, &panels);
                        assert_eq!(out, want[n..], "{isa:?} rows 1..{m}, b layout {j}");
                    }
                }
                let a16_op = Operand {
                    ptr: a16.as_ptr(),
                    rs: k as isize,
                    cs: 1,
                };
                for (j, b_op) in layouts(&b16, &bt16, k, n).into_iter().enumerate() {
                    // SAFETY: `b_op` covers k×n.
                    let panels = unsafe { Panels::pack(b_op, k, n, 1 + j % 2) };
                    let out = with_panels(isa, (m, n, k), a16_op, b_op, &panels);
                    assert_eq!(out, want, "{isa:?} bf16 {m}×{n}×{k}, b layout {j}");
                }
                // Mirror: another operand's panels, another product.
                let other: Vec<f32> = b.iter().map(|x| x + 1.0).collect();
                // SAFETY: `other` holds k×n, row-major.
                let wrong = unsafe { Panels::pack(layouts(&other, &other, k, n)[0], k, n, 2) };
                let out = with_panels(isa, (m, n, k), a_op, row_major, &wrong);
                assert_eq!(out, chains(m, n, k, &a, &other), "{isa:?} panels are read");
                assert_ne!(out, want, "{isa:?} the mirror differs");
            }
        }
    }

    /// The vector tiles run at vector speed: on each vector set this CPU has, a 192³ product of
    /// `f32` and of bf16 operands runs at more than a tenth of the FMA probe's rate for one
    /// core (a sound tile reaches 60–95% of it). A tile compiled without its set's features
    /// calls libm's `fmaf` for each multiply-add: that way an AVX2 product ran at 0.5 GFLOP/s,
    /// an 80th of the probe, and this fails.
    #[test]
    fn the_vector_tiles_run_at_vector_speed() {
        const TEST: &str = "tensor portable::tests::the_vector_tiles_run_at_vector_speed";
        let vector: Vec<Isa> = isas("the_vector_tiles_run_at_vector_speed")
            .into_iter()
            .filter(|&isa| isa != Isa::Scalar)
            .collect();
        let probe = crate::cpu_peak().probes.f32;
        let (Some(probe), false) = (probe, vector.is_empty()) else {
            crate::report_skipped(TEST, "this processor has no vector set with FMA");
            return;
        };
        let side = 192;
        let (a, b) = (data(side * side, 6), data(side * side, 7));
        let (a16, b16): (Vec<half::bf16>, Vec<half::bf16>) = (
            a.iter().map(|&x| half::bf16::from_f32(x)).collect(),
            b.iter().map(|&x| half::bf16::from_f32(x)).collect(),
        );
        let mut dst = vec![0.0f32; side * side];
        let mut rate = |product: &mut dyn FnMut(&mut [f32])| {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let start = std::time::Instant::now();
                product(&mut dst);
                best = best.min(start.elapsed().as_secs_f64());
            }
            2.0 * (side * side * side) as f64 / best.max(1e-9)
        };
        fn job<T>(side: usize, a: &[T], b: &[T], dst: &mut [f32]) -> Product<T> {
            let op = |p: &[T]| Operand {
                ptr: p.as_ptr(),
                rs: side as isize,
                cs: 1,
            };
            Product {
                m: side,
                n: side,
                k: side,
                a: op(a),
                b: op(b),
                dst: dst.as_mut_ptr(),
                ldc: side,
                store: Store::Overwrite,
            }
        }
        for isa in vector {
            // SAFETY: each operand holds side × side elements, and so does `dst`.
            let f32_rate = rate(&mut |dst| unsafe { gemm(isa, job(side, &a, &b, dst)) });
            // SAFETY: as above.
            let bf16_rate = rate(&mut |dst| unsafe { gemm(isa, job(side, &a16, &b16, dst)) });
            for (what, got) in [("f32", f32_rate), ("bf16", bf16_rate)] {
                assert!(
                    got > 0.1 * probe.flops_per_core,
                    "{isa:?} {what}: {:.2} GFLOP/s against the probe's {:.1}",
                    got / 1e9,
                    probe.flops_per_core / 1e9
                );
            }
        }
    }

    /// Rows computed in any block, and a contraction padded with zero terms at either end,
    /// give the whole product's bits; accumulating adds the product after it is formed.
    #[test]
    fn row_blocks_zero_padding_and_accumulation_keep_the_bits() {
        let (m, n, k) = (20, 40, 50);
        let (a, b) = (data(m * k, 3), data(k * n, 4));
        let want = chains(m, n, k, &a, &b);
        let op = |p: &[f32], rs: usize| Operand {
            ptr: p.as_ptr(),
            rs: rs as isize,
            cs: 1,
        };
        for isa in isas("row_blocks_zero_padding_and_accumulation_keep_the_bits") {
            // Rows 5..12 alone.
            let mut block = vec![0.0; 7 * n];
            run(isa, (7, n, k), op(&a[5 * k..], k), op(&b, n), &mut block);
            assert_eq!(block, want[5 * n..12 * n], "{isa:?} rows 5..12");
            // Zeros before and after the contraction: a padded with zero columns, b with rows.
            let pad = 9;
            let kp = k + 2 * pad;
            let mut ap = vec![0.0f32; m * kp];
            let mut bp = vec![0.0f32; kp * n];
            for i in 0..m {
                ap[i * kp + pad..i * kp + pad + k].copy_from_slice(&a[i * k..(i + 1) * k]);
            }
            bp[pad * n..(pad + k) * n].copy_from_slice(&b);
            let mut padded = vec![0.0; m * n];
            run(isa, (m, n, kp), op(&ap, kp), op(&bp, n), &mut padded);
            assert_eq!(padded, want, "{isa:?} zero-padded contraction");
            // Accumulating: dst + (the product), one rounding.
            let start = data(m * n, 5);
            let mut acc = start.clone();
            let ops = (op(&a, k), op(&b, n));
            run_stored(isa, (m, n, k), ops, &mut acc, Store::Accumulate);
            let added: Vec<f32> = start.iter().zip(&want).map(|(s, w)| s + w).collect();
            assert_eq!(acc, added, "{isa:?} accumulate");
        }
    }
}
