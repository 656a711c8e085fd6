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
//!   NR × 2`, zero past `k` and `n`). Row- and column-major operands are packed a slice at a
//!   time, other strides element by element, to the same words. The packing buffers are the
//!   thread's, kept between products (up to 16 MiB each). A `b` packed whole beforehand
//!   ([`pack_b_whole`], [`pack_b_kept`]) is read in place of a block's packing, whole or a
//!   [`Window`] of it (a block of the packed operand starting at a pair and a panel), to the
//!   same words.
//! * Up to [`row::MAX_ROWS`] rows of `a` against a row- or column-major `b` (decoding one
//!   token) run without packing ([`few_rows`]), to the same bits.

use std::arch::x86_64::{
    __m512, __m512bh, __m512i, __mmask16, _mm512_dpbf16_ps, _mm512_loadu_si512,
    _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps, _mm512_set1_epi32, _mm512_setzero_ps,
};

use std::mem::MaybeUninit;

use half::bf16;

use crate::operand::{Operand, Product, Store};

/// Rows of `a` a register tile covers.
pub(crate) const MR: usize = 8;
/// Columns of `b` a register tile covers: two registers of 16 `f32`.
const NR: usize = 32;
/// Columns of `b` packed at once (a block stays in L2 while every row tile runs over it).
const NC: usize = 512;
/// Contraction elements per block (even; a block's panel of `NR` columns is 32 KiB).
const KC: usize = 512;

/// True when this CPU has AVX512_BF16 (and AVX-512F and BW, which the packing uses).
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

/// The bf16 product `p` (`dst = a · b`, or `+=`, per its `store`) into `f32` rows, on this
/// thread.
///
/// # Safety
/// As [`crate::blas::sgemm`]; the CPU has AVX512_BF16 ([`available`]).
pub(crate) unsafe fn gemm(p: Product<bf16>) {
    let (m, n, k) = (p.m, p.n, p.k);
    if m == 0 || n == 0 {
        return;
    }
    let kp_max = KC.min(k).div_ceil(2);
    let b_len = kp_max * NC.min(n).div_ceil(NR) * NR;
    with_scratch(&B_SCRATCH, b_len, |bpack| {
        if reads_a_in_place(&p) {
            // SAFETY: the caller's contract; the buffer holds a block of `b`.
            return unsafe { gemm_blocks(p, Lhs::InPlace, Rhs::Blocks(bpack)) };
        }
        let whole_a = packs_a_whole(m, k);
        with_scratch(&A_SCRATCH, a_words(m, k, whole_a), |apack| {
            // SAFETY: the caller's contract; the buffers hold `a`'s packing and a block of `b`.
            unsafe { gemm_blocks(p, Lhs::Packed(apack, whole_a), Rhs::Blocks(bpack)) }
        })
    });
}

/// Whether [`gemm_blocks`] reads `a`'s pairs where they are stored instead of packing them:
/// a row-major `a` (whose pairs are adjacent elements) over an even contraction (no last pair
/// to pad with zero), in a product of one column block ([`NC`]), whose row tiles each run over
/// at most `NC / NR` panels. There a packing is copied once and read a few times: the tiled
/// attention's products (`q·kᵀ`, `P·v`, `dout·vᵀ`, `dS·k`: 64 rows by a head's 32–256), where
/// `pack_a` took a tenth of the time (`perf record` of `examples/flash`). The same words reach
/// the same tiles in the same order: the same bits.
fn reads_a_in_place(p: &Product<bf16>) -> bool {
    p.a.cs == 1 && p.k.is_multiple_of(2) && p.n <= NC
}

/// [`gemm`] with `p.b` already packed whole ([`pack_b_whole`] of the same `b`, `k` and `n`):
/// the row blocks of one product share one packing instead of each packing all of `b`. The
/// same bits as [`gemm`] (the same words reach the same tiles in the same order).
///
/// # Safety
/// As [`gemm`]; `b` is `p.b` packed by [`pack_b_whole`] (`b.k == p.k`, `b.n == p.n`).
pub(crate) unsafe fn gemm_packed(p: Product<bf16>, b: &PackedB) {
    debug_assert!(b.k == p.k && b.n == p.n, "a packing of this product's b");
    // SAFETY: the caller's contract; the whole packing is a window of itself.
    unsafe { gemm_window(p, Window::whole(b)) }
}

/// [`gemm`] with `p.b` read from a [`Window`] of a packing made once for many products (the
/// tiled attention's keys and values, packed once per head instead of once per tile). The same
/// bits as [`gemm`]: the window's words are those [`pack_b`] makes of `p.b` in every column the
/// product stores ([`PackedB::window`]).
///
/// # Safety
/// As [`gemm`]; `b` is a window of a packing of `p.b`'s matrix: `p.b` is rows `b.row0..` and
/// columns `b.col0..` of the `k`×`n` operand packed, and `b` came from
/// [`PackedB::window`]`(row0, col0, p.k, p.n)`.
pub(crate) unsafe fn gemm_window(p: Product<bf16>, b: Window<'_>) {
    if p.m == 0 || p.n == 0 {
        return;
    }
    if reads_a_in_place(&p) {
        // SAFETY: the caller's contract.
        return unsafe { gemm_blocks(p, Lhs::InPlace, Rhs::Whole(b)) };
    }
    let whole_a = packs_a_whole(p.m, p.k);
    with_scratch(&A_SCRATCH, a_words(p.m, p.k, whole_a), |apack| {
        // SAFETY: the caller's contract; the buffer holds `a`'s packing.
        unsafe { gemm_blocks(p, Lhs::Packed(apack, whole_a), Rhs::Whole(b)) }
    });
}

/// Rows from an even `2·pair0` and columns from panel `panel0` of a [`PackedB`]: the `b` of a
/// product over a block of the packed operand, read where the packing holds it.
#[derive(Clone, Copy)]
pub(crate) struct Window<'a> {
    packed: &'a PackedB,
    /// The window's first pair of rows.
    pair0: usize,
    /// The window's first panel of [`NR`] columns.
    panel0: usize,
}

impl<'a> Window<'a> {
    /// All of `packed`.
    fn whole(packed: &'a PackedB) -> Window<'a> {
        Window {
            packed,
            pair0: 0,
            panel0: 0,
        }
    }

    /// The window's words of pair `pair` (of the product's contraction) in the panel of
    /// columns from `col` (of the product's, a multiple of [`NR`]): `kp · NR` words.
    fn panel(&self, col: usize, pair: usize, kp: usize) -> &'a [u32] {
        let stride = self.packed.k.div_ceil(2) * NR;
        let at = (self.panel0 + col / NR) * stride + (self.pair0 + pair) * NR;
        &self.packed.data[at..at + kp * NR]
    }
}

/// Where [`gemm_blocks`] reads `a`'s pairs.
enum Lhs<'a> {
    /// Packed into this buffer ([`a_words`]): all of `a` when the flag is set, else a block
    /// of the contraction at a time.
    Packed(&'a mut [u32], bool),
    /// Where they are stored ([`reads_a_in_place`]).
    InPlace,
}

/// Words [`pack_b_whole`] makes of a `k`×`n` operand.
pub(crate) fn whole_words(k: usize, n: usize) -> usize {
    k.div_ceil(2) * n.div_ceil(NR) * NR
}

/// Where [`gemm_blocks`] finds its panels of `b`.
enum Rhs<'a> {
    /// Packed a block at a time into this buffer (a block of `b`'s panels).
    Blocks(&'a mut [u32]),
    /// Packed whole beforehand: a block's panel is a slice of a window's panel.
    Whole(Window<'a>),
}

thread_local! {
    /// A thread's packing buffers, kept between products: a fresh one per call was a large
    /// zeroed allocation that the allocator returned to the kernel each time, and faulting its
    /// pages in again cost as much as packing a small product (`examples/bf16.rs`, 128 rows).
    /// Each holds a block of `b` (512 KiB) or all of `a` (2 bytes an element; one block of the
    /// contraction, 2 KiB a row, where all of it is over [`KEEP_WORDS`]).
    static A_SCRATCH: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
    /// As [`A_SCRATCH`], for `b`'s blocks.
    static B_SCRATCH: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Runs `f` on `len` words of this thread's buffer `key` (grown as needed, its old contents
/// left: every packing writes each word a tile reads). A nested use of the same buffer gets a
/// fresh one.
fn with_scratch<R>(
    key: &'static std::thread::LocalKey<std::cell::Cell<Vec<u32>>>,
    len: usize,
    f: impl FnOnce(&mut [u32]) -> R,
) -> R {
    let mut buffer = key.take();
    if buffer.len() < len {
        buffer.resize(len, 0);
    }
    let out = f(&mut buffer[..len]);
    keep(key, buffer);
    out
}

/// The most words a thread keeps in a packing buffer between products (16 MiB).
pub(crate) const KEEP_WORDS: usize = 1 << 22;

/// Returns `buffer` to this thread's `key` unless it is larger than [`KEEP_WORDS`].
fn keep(key: &'static std::thread::LocalKey<std::cell::Cell<Vec<u32>>>, buffer: Vec<u32>) {
    if buffer.len() <= KEEP_WORDS {
        key.set(buffer);
    }
}

/// Words of [`gemm_blocks`]'s packing of `a` (m×k): all of `a` (`whole`), else one block of
/// the contraction.
fn a_words(m: usize, k: usize, whole: bool) -> usize {
    let rows = m.div_ceil(MR) * MR;
    if whole {
        k.div_ceil(2) * rows
    } else {
        KC.min(k).div_ceil(2) * rows
    }
}

/// Whether [`gemm_blocks`] packs all of `a` (m×k) at once: when it stays in a thread's kept
/// buffer ([`KEEP_WORDS`]).
fn packs_a_whole(m: usize, k: usize) -> bool {
    k.div_ceil(2) * m.div_ceil(MR) * MR <= KEEP_WORDS
}

/// [`gemm`] with its packing buffers: `apack` ([`a_words`]: all of `a`'s row tiles over the
/// whole contraction, block after block, when `whole_a`, else one block of it), and `b`'s
/// panels ([`Rhs`]).
///
/// Columns run outer and the contraction's blocks inner, so the destination's block of
/// [`NC`] columns is still in cache when the next block of the contraction continues its
/// chains, rather than back from memory for every block of the contraction, as a wide one's
/// was (on one core, 512×1024 by 1024×3072 and 1024×18992: 3–5% faster). `a` is packed once
/// when whole, else again for each block of columns (only where `a` is over 16 MiB and `b`
/// wider than [`NC`]). Each element's chain is the same blocks in the same order either way.
///
/// # Safety
/// As [`gemm`] (and [`gemm_packed`] for a whole packing).
unsafe fn gemm_blocks(p: Product<bf16>, lhs: Lhs<'_>, mut rhs: Rhs<'_>) {
    let Product {
        m,
        n,
        k,
        a,
        b,
        dst,
        ldc,
        store,
    } = p;
    let tiles = m.div_ceil(MR);
    // Packs all of `a`'s rows for the block of the contraction from `l0`, tile after tile.
    let pack_block = |l0: usize, out: &mut [u32]| {
        let kp = KC.min(k - l0.min(k)).div_ceil(2);
        for (t, tile_pack) in out.chunks_mut(kp * MR).take(tiles).enumerate() {
            let i0 = t * MR;
            // SAFETY: rows i0..i0+rows, columns l0..l0+kc of `a` are inside the operand.
            unsafe { pack_a(a, i0, MR.min(m - i0), l0, KC.min(k - l0.min(k)), tile_pack) };
        }
    };
    // Where the block from `l0` starts in a whole packing (every earlier block has `KC / 2`
    // pairs).
    let block_at = |l0: usize| (l0 / 2) * MR * tiles;
    let (apack, whole_a, in_place): (&mut [u32], bool, bool) = match lhs {
        Lhs::Packed(apack, whole) => (apack, whole, false),
        Lhs::InPlace => (&mut [], false, true),
    };
    if whole_a {
        for l0 in (0..k).step_by(KC) {
            pack_block(l0, &mut apack[block_at(l0)..]);
        }
    }
    for j0 in (0..n).step_by(NC) {
        let nc = NC.min(n - j0);
        for l0 in (0..k.max(1)).step_by(KC) {
            let kc = KC.min(k - l0.min(k));
            let kp = kc.div_ceil(2);
            let ablock: &[u32] = if in_place {
                &[]
            } else if whole_a {
                &apack[block_at(l0)..block_at(l0) + kp * MR * tiles]
            } else {
                pack_block(l0, apack);
                &apack[..kp * MR * tiles]
            };
            // The first block stores per `store`; later ones continue the chain in `dst`.
            let first = l0 == 0 && store == Store::Overwrite;
            if let Rhs::Blocks(bpack) = &mut rhs {
                // SAFETY: rows l0..l0+kc and columns j0..j0+nc of `b` are inside the operand.
                unsafe { pack_b(b, l0, kc, j0, nc, slots(bpack)) };
            }
            for t in 0..tiles {
                let i0 = t * MR;
                let rows = MR.min(m - i0);
                let tile_pack = ablock.get(t * kp * MR..(t + 1) * kp * MR).unwrap_or(&[]);
                for (p, jp) in (0..nc).step_by(NR).enumerate() {
                    let cols = NR.min(nc - jp);
                    let panel = match &rhs {
                        Rhs::Blocks(bpack) => &bpack[p * kp * NR..(p + 1) * kp * NR],
                        // The window's panel's pairs from `l0 / 2` (`KC` is even, so a
                        // block's pairs are the whole packing's, its last pair zero-padded
                        // alike: see `PackedB::window`).
                        Rhs::Whole(window) => window.panel(j0 + jp, l0 / 2, kp),
                    };
                    let out = (dst.wrapping_add(i0 * ldc + j0 + jp), ldc);
                    // SAFETY: the CPU has the features (the caller's contract); rows
                    // i0..i0+rows, columns j0+jp..+cols of `dst` are the caller's; in place,
                    // rows i0..i0+rows and columns l0..l0+kc (`kc` even) of `a` are inside it.
                    unsafe {
                        if in_place {
                            let row0 = a.ptr.wrapping_offset(i0 as isize * a.rs + l0 as isize);
                            let a = InPlace { row0, rs: a.rs };
                            tile_from(rows, kp, a, panel, out, cols, first)
                        } else {
                            tile_from(rows, kp, Packed(tile_pack), panel, out, cols, first)
                        }
                    };
                }
            }
        }
    }
}

/// Packs rows `l0..l0 + kc` × columns `j0..j0 + nc` of `b`: panel `p` (columns `p·NR..`) holds
/// for each pair `q` the `NR` columns' `(b[l0+2q, c], b[l0+2q+1, c])`, zeros past `k` and `n`.
/// A row-major `b` (`x·W`) interleaves two rows at a time and a column-major one (`dy·Wᵀ`, a
/// tied head) reads each column's pairs in place, both as whole slices the compiler
/// vectorises; other strides take the element-wise [`pack_b_strided`]. All three write the
/// same words (`tests::packing_is_the_element_wise_packing`). Every word of the
/// `nc.div_ceil(NR)` panels of `kc.div_ceil(2) · NR` words at the start of `out` is written
/// (none is read), so `out` may be uninitialised.
///
/// # Safety
/// Those elements of `b` are readable; the CPU has AVX-512F/BW ([`available`]).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_b(
    b: Operand<bf16>,
    l0: usize,
    kc: usize,
    j0: usize,
    nc: usize,
    out: &mut [MaybeUninit<u32>],
) {
    let kp = kc.div_ceil(2);
    if b.cs != 1 && b.rs != 1 {
        // SAFETY: the caller's contract.
        unsafe { pack_b_strided(b, l0, kc, j0, nc, out) };
        return;
    }
    for (p, panel) in out.chunks_mut(kp * NR).take(nc.div_ceil(NR)).enumerate() {
        let (jp, cols) = (j0 + p * NR, NR.min(nc - p * NR));
        if b.cs == 1 {
            for (q, slot) in panel.chunks_mut(NR).enumerate() {
                // SAFETY: rows l0+2q (and l0+2q+1 when inside the block), columns jp..jp+cols
                // of `b`, contiguous as `cs` is 1 (the caller's contract).
                let row = |l: usize| unsafe {
                    std::slice::from_raw_parts(
                        b.ptr.offset((l0 + l) as isize * b.rs + jp as isize),
                        cols,
                    )
                };
                let second = if 2 * q + 1 < kc {
                    Some(row(2 * q + 1))
                } else {
                    None
                };
                interleave(row(2 * q), second, &mut slot[..cols]);
                // Only a last, partial panel has columns to zero: `fill` on an empty slice
                // still called `memset`, once a pair (a tenth of a qwen3-peer step's packing).
                if cols < NR {
                    slot[cols..].fill(MaybeUninit::new(0));
                }
            }
        } else {
            // A column's pairs are consecutive words: whole groups of 8 columns by 8 pairs are
            // transposed as blocks, the rest (a group's last pairs, the last columns) by pairs.
            let (groups, vector_pairs) = (cols / 8, kc / 2 / 8 * 8);
            for g in 0..groups {
                // SAFETY: columns jp+8g.. of `b` from row l0, contiguous as `rs` is 1.
                let columns: [*const u32; 8] = std::array::from_fn(|c| unsafe {
                    b.ptr
                        .offset((jp + 8 * g + c) as isize * b.cs + l0 as isize)
                        .cast()
                });
                for q0 in (0..vector_pairs).step_by(8) {
                    let out = &mut panel[q0 * NR + 8 * g..(q0 + 7) * NR + 8 * g + 8];
                    // SAFETY: pairs q0..q0+8 of those columns are inside the block (`2·(q0 +
                    // 8) ≤ kc`); `out` holds 8 rows of `NR` from its start.
                    unsafe { transpose8(columns.map(|c| c.add(q0)), out, NR) };
                }
            }
            for c in 0..cols {
                let from = if c < 8 * groups { vector_pairs } else { 0 };
                if kc == 2 * from {
                    continue;
                }
                // SAFETY: column jp+c, rows l0+2·from..l0+kc of `b`, contiguous as `rs` is 1.
                let line = unsafe {
                    std::slice::from_raw_parts(
                        b.ptr
                            .offset((jp + c) as isize * b.cs + (l0 + 2 * from) as isize),
                        kc - 2 * from,
                    )
                };
                pair_line(line, &mut panel[from * NR + c..], NR);
            }
            if cols < NR {
                for slot in panel.chunks_mut(NR) {
                    slot[cols..].fill(MaybeUninit::new(0));
                }
            }
        }
    }
}

/// [`pack_b`] element by element, for any strides.
///
/// # Safety
/// As [`pack_b`].
unsafe fn pack_b_strided(
    b: Operand<bf16>,
    l0: usize,
    kc: usize,
    j0: usize,
    nc: usize,
    out: &mut [MaybeUninit<u32>],
) {
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
                *slot = MaybeUninit::new(at(2 * q, j) | (at(2 * q + 1, j) << 16));
            }
        }
    }
}

/// `out[c] = (first[c], second[c])` as one word (the low half first), `second` zero when absent.
#[inline]
fn interleave(first: &[bf16], second: Option<&[bf16]>, out: &mut [MaybeUninit<u32>]) {
    match second {
        Some(second) => {
            for ((o, x), y) in out.iter_mut().zip(first).zip(second) {
                *o = MaybeUninit::new(u32::from(x.to_bits()) | (u32::from(y.to_bits()) << 16));
            }
        }
        None => {
            for (o, x) in out.iter_mut().zip(first) {
                *o = MaybeUninit::new(u32::from(x.to_bits()));
            }
        }
    }
}

/// `words` as slots to write: only initialised words are written through the view, so `words`
/// stays initialised (the packers take slots so a new buffer need not be zeroed first).
fn slots(words: &mut [u32]) -> &mut [MaybeUninit<u32>] {
    // SAFETY: `MaybeUninit<u32>` has `u32`'s layout, and every write through the view is of
    // an initialised `u32` (the packers never write `MaybeUninit::uninit()`).
    unsafe { &mut *(std::ptr::from_mut(words) as *mut [MaybeUninit<u32>]) }
}

/// `out[j·stride + i] = words[i][j]` for `i, j < 8`: eight runs of eight 32-bit words (pairs
/// of bf16, read unaligned) transposed, each output row one 256-bit store (the element-wise
/// loop stored one word at a time, strided: a sixth of a bf16 step's time at qwen3-peer went to
/// packing).
///
/// # Safety
/// Each of `words` points at 8 readable words; the CPU has AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(words: [*const u32; 8], out: &mut [MaybeUninit<u32>], stride: usize) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_permute2x128_si256, _mm256_storeu_si256,
        _mm256_unpackhi_epi32, _mm256_unpackhi_epi64, _mm256_unpacklo_epi32, _mm256_unpacklo_epi64,
    };
    assert!(out.len() >= 7 * stride + 8); // ok: the callers' slices are sized for it
                                          // SAFETY: the caller's contract: 8 words (256 bits) at each pointer.
    let r = words.map(|w| unsafe { _mm256_loadu_si256(w.cast::<__m256i>()) });
    // Pairs of runs interleaved by words (`t[2p]`, `t[2p + 1]`: runs 2p and 2p + 1, low and high
    // words of each 128-bit lane), then those by pairs of words: `u[j]` holds word j of runs
    // 0–3 in its low 128 bits and word j + 4 in its high; `u[4 + j]` the same of runs 4–7.
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (x, y) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(x, y)
        } else {
            _mm256_unpackhi_epi32(x, y)
        }
    });
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let at = i / 4 * 4 + i % 4 / 2;
        if i % 2 == 0 {
            _mm256_unpacklo_epi64(t[at], t[at + 2])
        } else {
            _mm256_unpackhi_epi64(t[at], t[at + 2])
        }
    });
    for j in 0..4 {
        // Word j of all eight runs (low halves), and word j + 4 (high halves).
        let low = _mm256_permute2x128_si256::<0x20>(u[j], u[4 + j]);
        let high = _mm256_permute2x128_si256::<0x31>(u[j], u[4 + j]);
        // SAFETY: rows j and j + 4 of `out` hold 8 words each (asserted above).
        unsafe {
            _mm256_storeu_si256(out[j * stride..].as_mut_ptr().cast::<__m256i>(), low);
            _mm256_storeu_si256(out[(j + 4) * stride..].as_mut_ptr().cast::<__m256i>(), high);
        }
    }
}

/// [`interleave`] of two runs of 8 (`first` and `second` hold at least 8, `out` 8 words), as
/// two 128-bit unpacks: a column-major `a` (`xᵀ·dy`) packed 1.4 words a ns element-wise.
///
/// # Safety
/// The CPU has AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn interleave8(first: &[bf16], second: &[bf16], out: &mut [u32]) {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi16, _mm_unpacklo_epi16,
    };
    let (first, second, out) = (&first[..8], &second[..8], &mut out[..8]);
    // SAFETY: each slice holds 128 bits (checked by the slicing above).
    unsafe {
        let x = _mm_loadu_si128(first.as_ptr().cast::<__m128i>());
        let y = _mm_loadu_si128(second.as_ptr().cast::<__m128i>());
        _mm_storeu_si128(out.as_mut_ptr().cast::<__m128i>(), _mm_unpacklo_epi16(x, y));
        _mm_storeu_si128(
            out[4..].as_mut_ptr().cast::<__m128i>(),
            _mm_unpackhi_epi16(x, y),
        );
    }
}

/// `out[q·stride] = (line[2q], line[2q + 1])` for each pair of `line`, the last one's high
/// half zero when `line` is odd.
#[inline]
fn pair_line(line: &[bf16], out: &mut [MaybeUninit<u32>], stride: usize) {
    let pairs = line.chunks_exact(2);
    let last = pairs.remainder().first().map(|x| u32::from(x.to_bits()));
    let mut slots = out.iter_mut().step_by(stride);
    for (pair, slot) in pairs.zip(slots.by_ref()) {
        *slot =
            MaybeUninit::new(u32::from(pair[0].to_bits()) | (u32::from(pair[1].to_bits()) << 16));
    }
    if let (Some(x), Some(slot)) = (last, slots.next()) {
        *slot = MaybeUninit::new(x);
    }
}

/// Packs rows `i0..i0 + rows` × columns `l0..l0 + kc` of `a` as pairs: `out[q·MR + r] =
/// (a[i0+r, l0+2q], a[i0+r, l0+2q+1])`, zero past `k`. A row-major `a` reads each row's pairs
/// in place and a column-major one (`xᵀ·dy`) interleaves two of its stored rows; other strides
/// go element by element ([`pack_a_strided`]), all to the same words.
///
/// # Safety
/// Those elements of `a` are readable; the CPU has AVX-512F/BW ([`available`]).
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_a(a: Operand<bf16>, i0: usize, rows: usize, l0: usize, kc: usize, out: &mut [u32]) {
    if a.cs == 1 {
        // A row's pairs are consecutive words: a whole tile's rows are transposed in blocks of
        // 8 pairs, the rest (the last pairs, a partial tile) by pairs.
        let from = if rows == MR { kc / 2 / 8 * 8 } else { 0 };
        // Rows i0..i0+MR of `a` from column l0 (read only when `from > 0`, when all of a
        // tile's rows are the caller's).
        let lines: [*const u32; MR] = std::array::from_fn(|r| {
            a.ptr
                .wrapping_offset((i0 + r) as isize * a.rs + l0 as isize)
                .cast()
        });
        for q0 in (0..from).step_by(8) {
            // SAFETY: pairs q0..q0+8 of those rows are inside the block (`2·(q0 + 8) ≤ kc`);
            // `out` holds the tile's pairs.
            unsafe {
                transpose8(
                    lines.map(|l| l.add(q0)),
                    slots(&mut out[q0 * MR..(q0 + 8) * MR]),
                    MR,
                )
            };
        }
        let tail = if kc > 2 * from { 0..rows } else { 0..0 };
        for r in tail {
            // SAFETY: row i0+r, columns l0+2·from..l0+kc of `a`, contiguous as `cs` is 1.
            let line = unsafe {
                std::slice::from_raw_parts(
                    a.ptr
                        .offset((i0 + r) as isize * a.rs + (l0 + 2 * from) as isize),
                    kc - 2 * from,
                )
            };
            pair_line(line, slots(&mut out[from * MR + r..]), MR);
        }
    } else if a.rs == 1 {
        for (q, pairs) in out.chunks_mut(MR).take(kc.div_ceil(2)).enumerate() {
            // SAFETY: column l0+2q (and l0+2q+1 when inside the block), rows i0..i0+rows of
            // `a`, contiguous as `rs` is 1.
            let column = |l: usize| unsafe {
                std::slice::from_raw_parts(
                    a.ptr.offset((l0 + l) as isize * a.cs + i0 as isize),
                    rows,
                )
            };
            if rows == MR && 2 * q + 1 < kc {
                // SAFETY: both columns hold the tile's `MR` rows (as above).
                unsafe { interleave8(column(2 * q), column(2 * q + 1), pairs) };
                continue;
            }
            let second = if 2 * q + 1 < kc {
                Some(column(2 * q + 1))
            } else {
                None
            };
            interleave(column(2 * q), second, slots(&mut pairs[..rows]));
        }
    } else {
        // SAFETY: the caller's contract.
        unsafe { pack_a_strided(a, i0, rows, l0, kc, out) };
    }
}

/// [`pack_a`] element by element, for any strides.
///
/// # Safety
/// As [`pack_a`].
unsafe fn pack_a_strided(
    a: Operand<bf16>,
    i0: usize,
    rows: usize,
    l0: usize,
    kc: usize,
    out: &mut [u32],
) {
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
    // SAFETY: the caller's contract.
    unsafe { tile_from(rows, kp, Packed(apack), panel, (dst, ldc), cols, first) }
}

/// Where a register tile reads `a`'s pairs: `word(q, r)` is `(a[r, 2q], a[r, 2q + 1])` of the
/// tile's rows as one 32-bit word, low half first.
trait APairs: Copy {
    /// Pair `q` of row `r`.
    ///
    /// # Safety
    /// `r` is one of the tile's rows and `q` one of its pairs.
    unsafe fn word(self, q: usize, r: usize) -> u32;
}

/// A tile of [`pack_a`]'s packing: pair `q` of row `r` at `q·MR + r`.
#[derive(Clone, Copy)]
struct Packed<'a>(&'a [u32]);

impl APairs for Packed<'_> {
    #[inline(always)]
    unsafe fn word(self, q: usize, r: usize) -> u32 {
        self.0[q * MR + r]
    }
}

/// A row-major `a`'s tile read where it is stored (its first row at `row0`, rows `rs` elements
/// apart): a pair is two adjacent elements, one unaligned 32-bit load, the very word
/// [`pack_a`] would have copied.
#[derive(Clone, Copy)]
struct InPlace {
    row0: *const bf16,
    rs: isize,
}

impl APairs for InPlace {
    #[inline(always)]
    unsafe fn word(self, q: usize, r: usize) -> u32 {
        // SAFETY: the caller's contract: elements 2q and 2q + 1 of row r are inside `a`.
        unsafe {
            self.row0
                .offset(r as isize * self.rs + 2 * q as isize)
                .cast::<u32>()
                .read_unaligned()
        }
    }
}

/// [`tile`] over any [`APairs`] source.
///
/// # Safety
/// As [`tile`]; `a` holds the tile's `rows` rows over `kp` pairs.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_from<A: APairs>(
    rows: usize,
    kp: usize,
    a: A,
    panel: &[u32],
    (dst, ldc): (*mut f32, usize),
    cols: usize,
    first: bool,
) {
    // SAFETY: the caller's contract; each arm's `R` is `rows`.
    unsafe {
        match rows {
            8 => tile_r::<8, A>(kp, a, panel, dst, ldc, cols, first),
            7 => tile_r::<7, A>(kp, a, panel, dst, ldc, cols, first),
            6 => tile_r::<6, A>(kp, a, panel, dst, ldc, cols, first),
            5 => tile_r::<5, A>(kp, a, panel, dst, ldc, cols, first),
            4 => tile_r::<4, A>(kp, a, panel, dst, ldc, cols, first),
            3 => tile_r::<3, A>(kp, a, panel, dst, ldc, cols, first),
            2 => tile_r::<2, A>(kp, a, panel, dst, ldc, cols, first),
            _ => tile_r::<1, A>(kp, a, panel, dst, ldc, cols, first),
        }
    }
}

/// [`tile`] with `R` rows: `R × 2` accumulators, one `vdpbf16ps` per (row, half, pair).
///
/// # Safety
/// As [`tile`], with `R = rows`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_r<const R: usize, A: APairs>(
    kp: usize,
    a: A,
    panel: &[u32],
    dst: *mut f32,
    ldc: usize,
    cols: usize,
    first: bool,
) {
    // The tile's columns as two 16-lane masks: a row is loaded and stored in place, the lanes
    // past `cols` neither read nor written (a copy through a buffer on the stack called
    // `memmove` twice a row: 5% of a qwen3-peer bf16 step's CPU time).
    let lanes = |from: usize| -> __mmask16 {
        let n = cols.saturating_sub(from).min(16);
        ((1u32 << n) - 1) as __mmask16
    };
    let (low, high) = (lanes(0), lanes(16));
    let mut acc: [[__m512; 2]; R] = [[_mm512_setzero_ps(); 2]; R];
    if !first {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row r of the caller's block, `cols` initialised elements (the masks keep
            // the loads to them).
            *acc = unsafe {
                let row = dst.add(r * ldc);
                [
                    _mm512_maskz_loadu_ps(low, row),
                    _mm512_maskz_loadu_ps(high, row.wrapping_add(16)),
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
            // SAFETY: row r < R and pair q < kp of the tile (the caller's contract); a 512-bit
            // integer vector read as 32 bf16, as above.
            let x: __m512bh = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(a.word(q, r) as i32))
            };
            acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row r of the caller's block, `cols` writable elements (the masks keep the
        // stores to them).
        unsafe {
            let row = dst.add(r * ldc);
            _mm512_mask_storeu_ps(row, low, acc[0]);
            _mm512_mask_storeu_ps(row.wrapping_add(16), high, acc[1]);
        }
    }
}

/// `b` (k×n) packed whole for [`gemm_rounded`]: each [`NR`]-column panel over the whole
/// contraction in pairs (`k/2 × NR × 2`, zero past `k` and `n`), panel after panel, in the
/// packing thread's `b` buffer, which it returns there when dropped ([`pack_b_whole`]), or in a
/// buffer of its own ([`pack_b_kept`]).
pub(crate) struct PackedB {
    /// The packing in its first [`whole_words`] words (a thread's buffer may hold more).
    data: Vec<u32>,
    k: usize,
    n: usize,
    /// Whether `data` is a thread's `b` buffer, returned to the dropping thread's.
    scratch: bool,
}

/// Packs all of `b` (k×n) once, for every row block of a product to share, its panels shared
/// out over up to `threads` tasks on the rayon pool, runs of whole panels each (the same words
/// on any number: a panel's packing does not depend on its neighbours). A product rounded as it
/// is stored packs its `b` before its row blocks start; on one thread the other cores waited
/// meanwhile (qwen3-peer bf16, data=1, GA 4: the step 3–5% longer).
///
/// # Safety
/// `b`'s `k` rows of `n` elements are readable.
pub(crate) unsafe fn pack_b_whole(b: Operand<bf16>, k: usize, n: usize, threads: usize) -> PackedB {
    // SAFETY: the caller's contract.
    unsafe { pack_b_into(b, k, n, threads, B_SCRATCH.take(), true) }
}

/// [`pack_b_whole`] into a buffer of its own, for a tensor to keep
/// ([`crate::packings::Packings`]): none of a thread's buffers is held meanwhile, nor grows to
/// the packing's size when it is dropped.
///
/// # Safety
/// As [`pack_b_whole`].
pub(crate) unsafe fn pack_b_kept(b: Operand<bf16>, k: usize, n: usize, threads: usize) -> PackedB {
    // SAFETY: the caller's contract.
    unsafe { pack_b_into(b, k, n, threads, Vec::new(), false) }
}

/// [`pack_b_whole`] into `data` (resized), which the packing returns to a thread's buffer
/// when dropped if `scratch`.
///
/// # Safety
/// As [`pack_b_whole`].
unsafe fn pack_b_into(
    b: Operand<bf16>,
    k: usize,
    n: usize,
    threads: usize,
    mut data: Vec<u32>,
    scratch: bool,
) -> PackedB {
    let (kp, panels) = (k.div_ceil(2), n.div_ceil(NR));
    let words = kp * panels * NR;
    // A buffer too short is grown without zeroing (the packing writes every word: zeroing a
    // kept packing first was `memset`, 0.4% of a qwen3-peer bf16 step's CPU time). Its length
    // only grows: a thread's buffer cut to a smaller packing and grown again by
    // `with_scratch` zeroed the difference each time (0.4% of a qwen3-0.6b step).
    let grown = data.len() < words;
    if grown {
        data.clear();
        data.reserve(words);
    }
    let out: &mut [MaybeUninit<u32>] = if grown {
        &mut data.spare_capacity_mut()[..words]
    } else {
        slots(&mut data[..words])
    };
    // SAFETY: rows 0..k and columns 0..n of `b` are inside the operand (the caller's
    // contract); `out` holds the packing's `words`.
    unsafe { pack_b_slots(b, (k, n), threads, out) };
    if grown {
        // SAFETY: `pack_b_slots` wrote every one of the first `words` words (`pack_b`'s
        // contract, over its panels), within the capacity reserved above.
        unsafe { data.set_len(words) };
    }
    PackedB {
        data,
        k,
        n,
        scratch,
    }
}

/// Every panel of `b` (k×n) into `out` (`k.div_ceil(2) · n.div_ceil(NR) · NR` words, each
/// written), shared out over up to `threads` tasks in runs of whole panels.
///
/// # Safety
/// As [`pack_b_whole`]; `out` holds the packing's words.
unsafe fn pack_b_slots(
    b: Operand<bf16>,
    (k, n): (usize, usize),
    threads: usize,
    out: &mut [MaybeUninit<u32>],
) {
    let (kp, panels) = (k.div_ceil(2), n.div_ceil(NR));
    let per_task = panels.div_ceil(threads.max(1)).max(1);
    if threads <= 1 || panels < 2 || kp == 0 {
        // SAFETY: rows 0..k and columns 0..n of `b` are inside the operand (the caller's
        // contract).
        unsafe { pack_b(b, 0, k, 0, n, out) };
    } else {
        /// The operand crossing threads: only read, each task its own columns.
        struct Shared(Operand<bf16>);
        // SAFETY: see the struct's doc.
        unsafe impl Sync for Shared {}
        let shared = Shared(b);
        use rayon::prelude::*;
        out.par_chunks_mut(per_task * kp * NR)
            .with_max_len(1)
            .enumerate()
            .for_each(|(task, out)| {
                let j0 = task * per_task * NR;
                let b = &shared;
                // SAFETY: rows 0..k and columns j0..j0+nc of `b` are inside the operand; `out`
                // holds this run's panels.
                unsafe { pack_b(b.0, 0, k, j0, (per_task * NR).min(n - j0), out) };
            });
    }
}

impl PackedB {
    /// The window of rows `row0..row0 + k` and columns `col0..col0 + n` of the packed operand,
    /// as [`gemm_window`] reads it, where its words are [`pack_b`]'s of that block in every
    /// column a product stores: `row0` even (its pairs are the packing's), `col0` a multiple of
    /// [`NR`] (its panels are), and `k` even or reaching the last row (a last odd row's pair
    /// is padded with zero there, as [`pack_b`] pads it, not with the next row). Columns past
    /// `n` in its last panel hold the packing's next columns, which only lanes a tile does not
    /// store read. `None` otherwise, or outside the operand.
    pub(crate) fn window(
        &self,
        row0: usize,
        col0: usize,
        k: usize,
        n: usize,
    ) -> Option<Window<'_>> {
        let aligned = row0.is_multiple_of(2) && col0.is_multiple_of(NR);
        let inside = row0 + k <= self.k && col0 + n <= self.n;
        let pairs_match = k.is_multiple_of(2) || row0 + k == self.k;
        (aligned && inside && pairs_match).then_some(Window {
            packed: self,
            pair0: row0 / 2,
            panel0: col0 / NR,
        })
    }
}

impl Drop for PackedB {
    /// A thread's buffer goes back to the dropping thread's `b` scratch, for the next product.
    fn drop(&mut self) {
        if self.scratch {
            keep(&B_SCRATCH, std::mem::take(&mut self.data));
        }
    }
}

/// Where [`gemm_rounded`] and [`gemm_rounded_accumulate`] put each rounded element: row `i`
/// of the output starts `i · ldc` elements from the pointer.
#[derive(Clone, Copy)]
enum RoundedOut {
    /// Stored as bf16.
    Store(*mut bf16, usize),
    /// Widened and added into `f32` (a weight gradient's accumulator).
    AddWidened(*mut f32, usize),
}

/// `dst = round_bf16(a · b)` for bf16 `a` m×k and `b` packed by [`pack_b_whole`], into `dst`'s
/// `m` rows of `n` bf16 elements `ldc` apart, on this thread. Each register tile runs the whole
/// contraction and is rounded as it is stored: no `f32` result. Its chain is [`gemm`]'s (pairs
/// in order from `+0`; [`gemm`] continues it through `dst` at each block of [`KC`], an exact
/// store and load, and [`KC`] is even so the pairs are the same), so each element is, bit for
/// bit, `round_bf16` of what [`gemm`] stores. `a` is packed [`ROUNDED_CHUNK_WORDS`] at a time
/// (whole tiles over the whole contraction); per chunk, per panel of `b`, every row tile of the
/// chunk runs over it.
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
    // SAFETY: the caller's contract.
    unsafe { gemm_rounded_into(m, a, b, RoundedOut::Store(dst, ldc)) }
}

/// `dst += widen(round_bf16(a · b))` into `dst`'s `m` rows of `n` `f32` elements `ldc` apart:
/// [`gemm_rounded`]'s product, each element rounded as its tile leaves the registers and added
/// (one `f32` addition) into `dst`, with no product stored in between. So each element gets
/// the bits of [`gemm_rounded`] widened and added after it: a weight gradient's rounded product
/// added into its accumulator.
///
/// # Safety
/// As [`gemm`] with [`Store::Accumulate`] (`dst` initialised); the CPU has AVX512_BF16
/// ([`available`]); `k > 0`.
pub(crate) unsafe fn gemm_rounded_accumulate(
    m: usize,
    a: Operand<bf16>,
    b: &PackedB,
    dst: *mut f32,
    ldc: usize,
) {
    // SAFETY: the caller's contract.
    unsafe { gemm_rounded_into(m, a, b, RoundedOut::AddWidened(dst, ldc)) }
}

/// [`gemm_rounded`] or [`gemm_rounded_accumulate`], per `out`.
///
/// # Safety
/// As those.
unsafe fn gemm_rounded_into(m: usize, a: Operand<bf16>, b: &PackedB, out: RoundedOut) {
    let (k, n) = (b.k, b.n);
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let tile_words = k.div_ceil(2) * MR;
    let chunk = (ROUNDED_CHUNK_WORDS / tile_words).clamp(1, m.div_ceil(MR));
    with_scratch(&A_SCRATCH, chunk * tile_words, |apack| {
        // SAFETY: the caller's contract; `apack` holds `chunk` tiles.
        unsafe { rounded_tiles(m, a, b, (apack, chunk), out) }
    });
}

/// Words of `a`'s packing [`gemm_rounded`] holds at once (256 KiB: a quarter of a core's L2,
/// re-read for every panel of `b`). All of `a` at once was streamed from memory once a panel
/// where it was large: the tied qwen3-0.6b head's weight gradient (151,936 rows, 78 MB packed
/// on each of 2 threads, 32 panels) ran at 330–340 GFLOP/s against 383–425 for the same
/// product stored in `f32`.
const ROUNDED_CHUNK_WORDS: usize = 1 << 16;

/// [`gemm_rounded_into`] with `apack` holding `chunk` row tiles over the whole contraction: the
/// rows in chunks of that many tiles, each packed, then per panel of `b` every tile of the chunk
/// (each tile's chain is the whole contraction, so the order of tiles changes no bits).
///
/// # Safety
/// As [`gemm_rounded_into`]; `apack` holds `chunk ≥ 1` tiles' words.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn rounded_tiles(
    m: usize,
    a: Operand<bf16>,
    b: &PackedB,
    (apack, chunk): (&mut [u32], usize),
    out: RoundedOut,
) {
    let kp = b.k.div_ceil(2);
    for first in (0..m.div_ceil(MR)).step_by(chunk) {
        let tiles = chunk.min(m.div_ceil(MR) - first);
        let packed = &mut apack[..tiles * kp * MR];
        for (t, tile_pack) in packed.chunks_mut(kp * MR).enumerate() {
            let i0 = (first + t) * MR;
            // SAFETY: rows i0.., all columns of `a` are inside the operand.
            unsafe { pack_a(a, i0, MR.min(m - i0), 0, b.k, tile_pack) };
        }
        // SAFETY: the caller's contract, for the chunk's rows.
        unsafe { rounded_chunk(m, first, packed, b, out) };
    }
}

/// The tiles from `first` whose packing is `packed`, against every panel of `b`, rounded into
/// `out` (see [`rounded_tiles`]). Stored, per panel of `b` every tile (the panel stays in L1);
/// added into `f32`, per block of [`NC`] columns every tile across the block's panels, so each
/// tile reads and writes its rows of the accumulator a block-wide run at a time (per panel
/// every tile had each of the chunk's rows touched for 32 columns, a row of the accumulator
/// apart: 0.81–0.85 of the product alone at qwen3-0.6b's weight gradients, against 0.93 for
/// the same rows through a band in scratch).
///
/// # Safety
/// As [`rounded_tiles`].
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn rounded_chunk(m: usize, first: usize, packed: &[u32], b: &PackedB, out: RoundedOut) {
    let (k, n) = (b.k, b.n);
    let kp = k.div_ceil(2);
    let (panels, tiles) = (n.div_ceil(NR), packed.len() / (kp * MR));
    let mut acc = [0.0f32; MR * NR];
    // Tile `t` of the chunk against panel `p`, rounded into `out`.
    let mut run = |t: usize, p: usize| {
        let (j0, cols) = (p * NR, NR.min(n - p * NR));
        let i0 = (first + t) * MR;
        let rows = MR.min(m - i0);
        let tile_pack = &packed[t * kp * MR..(t + 1) * kp * MR];
        let panel = &b.data[p * kp * NR..(p + 1) * kp * NR];
        // SAFETY: the CPU has the features (the caller's contract); `acc` holds `MR` rows of
        // `NR`.
        unsafe { tile(rows, kp, tile_pack, panel, acc.as_mut_ptr(), NR, cols, true) };
        for (r, row) in acc.as_chunks::<NR>().0.iter().take(rows).enumerate() {
            let i = i0 + r;
            // SAFETY: row i, columns j0..j0+cols of the caller's `out` (as `MaybeUninit` where
            // stored: the same layout; initialised where added into); the CPU has the
            // features.
            unsafe {
                match out {
                    RoundedOut::Store(dst, ldc) => super::round_avx512::round_row(
                        row,
                        std::slice::from_raw_parts_mut(dst.add(i * ldc + j0).cast(), cols),
                    ),
                    RoundedOut::AddWidened(dst, ldc) => super::round_avx512::add_rounded_row(
                        row,
                        std::slice::from_raw_parts_mut(dst.add(i * ldc + j0), cols),
                    ),
                }
            }
        }
    };
    match out {
        RoundedOut::Store(..) => {
            for p in 0..panels {
                for t in 0..tiles {
                    run(t, p);
                }
            }
        }
        RoundedOut::AddWidened(..) => {
            for block in (0..panels).step_by(NC / NR) {
                for t in 0..tiles {
                    for p in block..(block + NC / NR).min(panels) {
                        run(t, p);
                    }
                }
            }
        }
    }
}

/// `dst = a · b` (or `+=`, per `store`) as [`gemm`] (the same bits), for at most
/// [`row::MAX_ROWS`] rows of `a` and a row- or column-major `b`, without packing; `false`
/// (nothing written) for other shapes. `round`: `dst` holds bf16 rows and each element is rounded as it
/// is stored, as [`gemm_rounded`] (`store` must be [`Store::Overwrite`] then).
///
/// # Safety
/// As [`gemm`] (with `dst` bf16 when `round`).
pub(crate) unsafe fn few_rows(p: Product<bf16, u8>, round: bool) -> bool {
    let Product {
        m,
        n,
        k,
        a,
        b,
        dst,
        ldc,
        store,
    } = p;
    let columns = b.cs != 1;
    if m > row::MAX_ROWS
        || (columns && (b.rs != 1 || b.cs.unsigned_abs() > (i32::MAX as usize) / 16 || b.cs < 0))
        || (round && store == Store::Accumulate)
    {
        return false;
    }
    let product = if columns {
        row::row_times_columns
    } else {
        row::row_times
    };
    let mut sums = vec![0.0f32; if round { n } else { 0 }];
    for i in 0..m {
        // SAFETY: row i of `a`, all of `b`, and row i of `dst` (`n` elements of its type), by
        // the caller's contract; the CPU has the features.
        unsafe {
            let a_row = a.ptr.offset(i as isize * a.rs);
            if round {
                product(n, k, a_row, a.cs, b, sums.as_mut_ptr(), false);
                let out = std::slice::from_raw_parts_mut(dst.cast::<bf16>().add(i * ldc), n);
                super::round_slice(&sums, out);
            } else {
                let out = dst.cast::<f32>().add(i * ldc);
                product(n, k, a_row, a.cs, b, out, store == Store::Accumulate);
            }
        }
    }
    true
}

pub(crate) mod row;

#[cfg(test)]
mod tests;
