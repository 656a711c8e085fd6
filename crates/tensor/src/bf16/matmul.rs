//! bf16 × bf16 → f32 products: [`dot_general_bf16`] on ferrotext's AVX512_BF16 kernel
//! (`super::dpbf16`), MKL's `cblas_gemm_bf16bf16f32` or OpenBLAS's `cblas_sbgemm`, or the
//! portable kernel with bf16 panels widened as they are packed; which one is `super::choice`'s.
//!
//! Invariants:
//! * The bf16 kernel is chosen once per process (`choice.rs`), from the `f32` one
//!   ([`crate::matmul_kernel`]):
//!   - the portable kernel (`FERROTEXT_MATMUL=portable`, `deterministic=true`) runs bf16 too: its
//!     bits are those of the `f32` portable product of the widened operands;
//!   - a library the user named (`FERROTEXT_MATMUL=mkl|openblas|gemm`) runs its own bf16
//!     product; one without (`gemm`, an OpenBLAS built without `BUILD_BFLOAT16`) refuses bf16
//!     products ([`TensorError::NoBf16Product`]) unless [`allow_bf16_fallback`] came first, and
//!     then hands them to ferrotext's AVX512_BF16 kernel where the CPU has one, else the portable
//!     kernel;
//!   - picked automatically: MKL's bf16 product where the CPU has AMX tiles the OS lets
//!     programs use (MKL runs bf16 products on them: 420–590 GFLOP/s on 2 Sapphire Rapids cores
//!     at the qwen3-peer shapes, against 161 for the AVX512_BF16 kernel and 278 for MKL's f32
//!     product), else the AVX512_BF16 kernel where the CPU has it (MKL's bf16 product runs at
//!     its f32 rate on AMD EPYC: `examples/bf16.rs`), else the library's bf16 product, else
//!     the portable kernel.
//! * The operand views, batch handling and threading are `dot_general`'s (the same code, generic
//!   over the element), so the layouts that avoid a copy are the same.
//! * On the AVX512_BF16 kernel a right operand that keeps its packings
//!   ([`Bf16Tensor::keeping_packings`]) is packed once per matrix and layout, the packing kept
//!   with it (`kept_packing`); the words, and so the bits, are the ones a product packs itself.

use std::mem::MaybeUninit;
#[cfg(target_arch = "x86_64")]
use std::sync::Arc;

use half::bf16;

use super::choice::{choice, products_on_tiles, Choice};
use super::{add_rounded, permuted, round_into, Bf16Tensor};
use crate::blas::{gemm_on, kernel, Blas, Cblas, Element, Kernel, MIN_BLOCK_ROWS};
use crate::error::TensorError;
use crate::matmul::{as_stack_of, products, DotDims, Stacks};
use crate::operand::{Operand, Product, Store};
use crate::parallel::{filled, for_each_chunk, Work};
use crate::portable;
use crate::portable::Isa;
use crate::tensor::Tensor;

/// A bf16 product on this process's choice (the public products checked it is not refused; a
/// refused choice runs the portable kernel, so `dst` is always written).
///
/// # Safety
/// As [`crate::blas::sgemm`].
pub(crate) unsafe fn product(p: Product<bf16>, parallelism: gemm::Parallelism) {
    match choice(false) {
        Choice::Library(..) => {
            // SAFETY: the caller's contract.
            unsafe { gemm_on(kernel(), p, parallelism) }
        }
        #[cfg(target_arch = "x86_64")]
        Choice::Own(_) => {
            // SAFETY: the caller's contract; `Own` is chosen only where the CPU has
            // AVX512_BF16.
            unsafe { own(p, parallelism) }
        }
        Choice::Portable(isa, _) => {
            let portable = Kernel::Portable(*isa);
            // SAFETY: the caller's contract.
            unsafe { gemm_on(&portable, p, parallelism) }
        }
        _ => {
            let portable = Kernel::Portable(Isa::detect());
            // SAFETY: the caller's contract.
            unsafe { gemm_on(&portable, p, parallelism) }
        }
    }
}

/// The AVX512_BF16 kernel, in row blocks on the rayon pool under `Rayon(t)` (each element's
/// chain does not depend on its block: the same bits on any thread count).
///
/// # Safety
/// As [`crate::blas::sgemm`]; the CPU has AVX512_BF16.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn own(p: Product<bf16>, parallelism: gemm::Parallelism) {
    // SAFETY: the caller's contract.
    if unsafe { super::dpbf16::few_rows(p.into_bytes(), false) } {
        return;
    }
    let t = match parallelism {
        gemm::Parallelism::Rayon(t) => t.min(p.m / MIN_BLOCK_ROWS),
        gemm::Parallelism::None => 1,
    };
    if t <= 1 {
        // SAFETY: the caller's contract.
        unsafe { super::dpbf16::gemm(p) };
        return;
    }
    // SAFETY: the caller's contract (`b` is k×n).
    let Some(packed) = (unsafe { shared_packing(p.b, p.k, p.n, t) }) else {
        let block = |block| {
            // SAFETY: a block of rows of the caller's product.
            unsafe { super::dpbf16::gemm(block) }
        };
        // SAFETY: the caller's contract; each block writes its own rows of `dst`.
        unsafe { p.for_each_row_block(p.m.div_ceil(t), block) };
        return;
    };
    // SAFETY: the caller's contract; `packed` is `p.b`'s packing.
    unsafe { own_packed(p, &packed, t) };
}

/// [`own`] against `b` already packed whole, in up to `threads` row blocks of at least
/// [`MIN_BLOCK_ROWS`] (the same bits: each element's chain does not depend on its block).
///
/// # Safety
/// As [`own`]; `packed` is `p.b`'s packing ([`super::dpbf16::pack_b_whole`] or
/// [`super::dpbf16::pack_b_kept`]).
#[cfg(target_arch = "x86_64")]
unsafe fn own_packed(p: Product<bf16>, packed: &super::dpbf16::PackedB, threads: usize) {
    let t = threads.min(p.m / MIN_BLOCK_ROWS).max(1);
    if t == 1 {
        // SAFETY: the caller's contract.
        unsafe { super::dpbf16::gemm_packed(p, packed) };
        return;
    }
    let block = |block| {
        // SAFETY: a block of rows of the caller's product; `packed` is its `b`'s packing.
        unsafe { super::dpbf16::gemm_packed(block, packed) }
    };
    // SAFETY: the caller's contract; each block writes its own rows of `dst`.
    unsafe { p.for_each_row_block(p.m.div_ceil(t), block) };
}

/// The product of batch entry `i` of `s` (all its rows) into `dst` (`m` rows of `n`), stored
/// per `store`.
///
/// # Safety
/// `i < s.batch`; `dst` holds `m × n` elements; the stacks' views are in bounds (their
/// invariant).
#[cfg(target_arch = "x86_64")]
unsafe fn entry_product<D>(
    s: &Stacks<'_, bf16>,
    i: usize,
    dst: *mut D,
    store: Store,
) -> Product<bf16, D> {
    let operand = |stack: &crate::matmul::MatStack<'_, bf16>| Operand {
        // SAFETY: entry `i`'s offset lies inside the stack's data (as in `products`).
        ptr: unsafe { stack.data.as_ptr().offset(stack.offset(i)) },
        rs: stack.rows.1,
        cs: stack.cols.1,
    };
    Product {
        m: s.a.rows.0,
        n: s.b.cols.0,
        k: s.a.cols.0,
        a: operand(&s.a),
        b: operand(&s.b),
        dst,
        ldc: s.b.cols.0,
        store,
    }
}

/// The packing of `s.b` that `rhs` keeps ([`Bf16Tensor::keeping_packings`]), packed now on up
/// to `threads` threads if it is not kept yet: on the AVX512_BF16 kernel, for one matrix of
/// `b` read in place from `rhs`'s storage, against more rows of `a` than the kernel takes
/// without packing (`few_rows`: a decoded token). `None` otherwise: the product packs as it
/// would.
#[cfg(target_arch = "x86_64")]
fn kept_packing(
    rhs: &Bf16Tensor,
    s: &Stacks<'_, bf16>,
    threads: usize,
) -> Option<Arc<super::dpbf16::PackedB>> {
    let packings = rhs.packings()?;
    let (m, k, n) = (s.a.rows.0, s.a.cols.0, s.b.cols.0);
    let in_place =
        matches!(&s.b.data, std::borrow::Cow::Borrowed(d) if d.as_ptr() == rhs.data().as_ptr());
    if !matches!(choice(false), Choice::Own(_))
        || s.batch != 1
        || !in_place
        || k == 0
        || n == 0
        || m <= super::dpbf16::row::MAX_ROWS
    {
        return None;
    }
    let (at, b) = s.b.first_matrix();
    // SAFETY: `b` is a k×n matrix at these strides inside `rhs`'s storage (the stack's
    // invariant); `Own` is chosen only where the CPU has AVX512_BF16.
    Some(packings.get_or_pack(at, || unsafe {
        super::dpbf16::pack_b_kept(b, k, n, threads)
    }))
}

/// `b` (k×n) packed whole on up to `threads` threads, for the row blocks or bands of one
/// product to share (each packed all of `b` for itself before: as many packings as blocks);
/// `None` when the packing would not stay in a thread's kept buffer (an LM head's `b`: each
/// block then packs a block of it at a time).
///
/// # Safety
/// `b`'s `k` rows of `n` elements are readable; the CPU has AVX512_BF16.
#[cfg(target_arch = "x86_64")]
unsafe fn shared_packing(
    b: Operand<bf16>,
    k: usize,
    n: usize,
    threads: usize,
) -> Option<super::dpbf16::PackedB> {
    (k > 0 && super::dpbf16::whole_words(k, n) <= super::dpbf16::KEEP_WORDS)
        // SAFETY: the caller's contract.
        .then(|| unsafe { super::dpbf16::pack_b_whole(b, k, n, threads) })
}

/// `dst = round_bf16(a · b)` on the AVX512_BF16 kernel: `b` packed once (or its `kept`
/// packing), the rows in up to `threads` blocks on the rayon pool (each element's chain does
/// not depend on its block).
///
/// # Safety
/// As [`own`], with `dst` the bf16 rows (`ldc` apart) and `store` [`Store::Overwrite`]; the CPU
/// has AVX512_BF16; `kept` is `p.b`'s packing.
#[cfg(target_arch = "x86_64")]
unsafe fn own_rounded(
    p: Product<bf16, bf16>,
    threads: usize,
    kept: Option<&super::dpbf16::PackedB>,
) {
    // SAFETY: the caller's contract.
    if unsafe { super::dpbf16::few_rows(p.into_bytes(), true) } {
        return;
    }
    let t = threads.min(p.m / MIN_BLOCK_ROWS).max(1);
    let fresh;
    let packed = match kept {
        Some(kept) => kept,
        None => {
            // SAFETY: the caller's contract (`b` is k×n).
            fresh = unsafe { super::dpbf16::pack_b_whole(p.b, p.k, p.n, t) };
            &fresh
        }
    };
    if t == 1 {
        // SAFETY: the caller's contract.
        unsafe { super::dpbf16::gemm_rounded(p.m, p.a, packed, p.dst, p.ldc) };
        return;
    }
    let block = |block: Product<bf16, bf16>| {
        // SAFETY: a block of rows of the caller's `a` and `dst`.
        unsafe { super::dpbf16::gemm_rounded(block.m, block.a, packed, block.dst, block.ldc) }
    };
    // SAFETY: the caller's contract; each block writes its own rows of `dst`.
    unsafe { p.for_each_row_block(p.m.div_ceil(t), block) };
}

/// Both operands as matrix stacks, views where the layouts allow (as `dot_general`).
fn stacks<'a>(
    lhs: &'a Bf16Tensor,
    rhs: &'a Bf16Tensor,
    dims: &DotDims,
) -> Result<Stacks<'a, bf16>, TensorError> {
    let lf = DotDims::free(lhs.shape().len(), &dims.lhs_batch, &dims.lhs_contracting);
    let rf = DotDims::free(rhs.shape().len(), &dims.rhs_batch, &dims.rhs_contracting);
    let side = |t: &'a Bf16Tensor, batch: &[usize], rows: &[usize], cols: &[usize]| {
        as_stack_of(t.shape(), t.data(), batch, rows, cols, |perm| {
            Ok(permuted(t.shape(), t.data(), perm))
        })
    };
    Ok(Stacks {
        a: side(lhs, &dims.lhs_batch, &lf, &dims.lhs_contracting)?,
        b: side(rhs, &dims.rhs_batch, &dims.rhs_contracting, &rf)?,
        batch: dims.lhs_batch.iter().map(|&d| lhs.shape()[d]).product(),
    })
}

/// The profiler's span for a bf16 product: 2 bytes an operand element read once, `out_bytes`
/// an output element (4 stored in `f32`, 2 rounded to bf16, 8 added into an `f32`
/// accumulator: read and written).
fn span(
    s: &Stacks<'_, bf16>,
    lhs: &[usize],
    rhs: &[usize],
    out_bytes: usize,
) -> Option<ferrotext_profile::Span> {
    let (m, k, n, batch) = (s.a.rows.0, s.a.cols.0, s.b.cols.0, s.batch);
    ferrotext_profile::span("dot_general_bf16").map(|span| {
        span.flops(2.0 * (batch * m * n) as f64 * k as f64)
            .bytes((batch * (2 * (m * k + k * n) + out_bytes * m * n)) as f64)
            .shapes(|| format!("bf16{lhs:?} x bf16{rhs:?}"))
    })
}

/// `dot_general` of bf16 operands, accumulated and returned in `f32`: the output is `[batch...,
/// lhs free..., rhs free...]`, on up to `threads` threads, on [`bf16_matmul_kernel`](crate::bf16_matmul_kernel)'s kernel.
/// Each element differs from the `f32` `dot_general` of the widened operands only by the order
/// of addition (every widened product is exact in `f32`); on the portable kernel not at all.
///
/// # Errors
/// [`TensorError::Shape`] when the dimension numbers do not fit the shapes;
/// [`TensorError::NoBf16Product`] as [`bf16_matmul_kernel`](crate::bf16_matmul_kernel).
pub fn dot_general_bf16(
    lhs: &Bf16Tensor,
    rhs: &Bf16Tensor,
    dims: &DotDims,
    threads: usize,
) -> Result<Tensor, TensorError> {
    choice(false).describe()?;
    let out_shape = dims.output_shape(lhs.shape(), rhs.shape())?;
    let len: usize = out_shape.iter().product();
    let stacks = stacks(lhs, rhs, dims)?;
    let _span = span(&stacks, lhs.shape(), rhs.shape(), 4);
    #[cfg(target_arch = "x86_64")]
    if let Some(packed) = kept_packing(rhs, &stacks, threads) {
        // SAFETY: the one matrix of each operand (`kept_packing` checked `batch == 1`) and the
        // output's `m × n`, which `own_packed` writes whole; `packed` is `b`'s packing.
        let out = unsafe {
            filled(len, |dst| {
                let p = entry_product(&stacks, 0, dst.as_mut_ptr().cast::<f32>(), Store::Overwrite);
                own_packed(p, &packed, threads);
            })
        };
        return Tensor::new(out_shape, out);
    }
    // SAFETY: `products` runs the kernel on every block of the output, and the kernel writes
    // every element of its block (or the whole output is zero-filled for an empty contraction).
    let out = unsafe {
        filled(len, |dst| {
            products(&stacks, threads, stacks.all_rows(), dst, Store::Overwrite);
        })
    };
    Tensor::new(out_shape, out)
}

/// `out += dot_general_bf16(lhs, rhs)` with `out` the row-major `f32` result: the kernel adds
/// each tile into `out` as it computes it (BLAS `beta = 1`), so a weight's gradient in
/// `grad_dtype=f32` takes a bf16 product without it being stored first.
///
/// # Errors
/// As [`dot_general_bf16`], and [`TensorError::Shape`] when `out` is not the result's size.
pub fn dot_general_bf16_accumulate(
    lhs: &Bf16Tensor,
    rhs: &Bf16Tensor,
    dims: &DotDims,
    threads: usize,
    out: &mut [f32],
) -> Result<(), TensorError> {
    choice(false).describe()?;
    let out_shape = dims.output_shape(lhs.shape(), rhs.shape())?;
    let len: usize = out_shape.iter().product();
    if out.len() != len {
        return Err(TensorError::shape(
            "dot_general_bf16_accumulate",
            format!(
                "an output of {} elements for a result {out_shape:?}",
                out.len()
            ),
        ));
    }
    let stacks = stacks(lhs, rhs, dims)?;
    let _span = span(&stacks, lhs.shape(), rhs.shape(), 8);
    // SAFETY: `[f32]` and `[MaybeUninit<f32>]` have one layout; under `Store::Accumulate` the
    // kernel reads each element before it writes it, and every element is initialised.
    let dst = unsafe {
        std::slice::from_raw_parts_mut(
            out.as_mut_ptr().cast::<std::mem::MaybeUninit<f32>>(),
            out.len(),
        )
    };
    products(&stacks, threads, stacks.all_rows(), dst, Store::Accumulate);
    Ok(())
}

/// The longest contraction [`dot_general_bf16_rounded`] rounds in the kernel's registers: a
/// register tile's rows of `a` (16 KiB) and a panel of `b` (64 KiB) over the whole contraction
/// stay in L1 and L2. Longer ones (`dx = dy·Wᵀ` of a wide layer, the lm_head) ran 12–20% slower
/// that way than as the `f32` product and a rounding pass (two runs of `examples/bf16.rs`), so
/// they go that way.
const ROUNDED_MAX_K: usize = 1024;

/// [`dot_general_bf16`] rounded to bf16 where the product is stored: an activation's product
/// (`x·W`, `dx = dy·Wᵀ`) without an `f32` result the size of the output and a rounding pass
/// over it. Each element is, bit for bit, `round_bf16` of [`dot_general_bf16`]'s on the
/// AVX512_BF16 kernel and the portable one (the same chains). The AVX512_BF16 kernel rounds each
/// register tile as it stores it for contractions up to 1024 elements; other contractions
/// and kernels compute the `f32` product a band of rows at a time on each thread and round the
/// band while it is in cache (`rounded_by_bands`: with MKL on AMX, a qwen3-peer bf16 step went
/// from 206 to 196 ms, the separate rounding pass having taken 13 ms of it), or, below 128 rows
/// and where a band would not have the whole product's bits (`bands_keep_bits`: MKL off its AMX
/// tiles), the whole product and then round it.
///
/// # Errors
/// As [`dot_general_bf16`].
pub fn dot_general_bf16_rounded(
    lhs: &Bf16Tensor,
    rhs: &Bf16Tensor,
    dims: &DotDims,
    threads: usize,
) -> Result<Bf16Tensor, TensorError> {
    choice(false).describe()?;
    #[cfg(target_arch = "x86_64")]
    if matches!(choice(false), Choice::Own(_))
        && dims
            .lhs_contracting
            .iter()
            .map(|&d| lhs.shape()[d])
            .product::<usize>()
            <= ROUNDED_MAX_K
    {
        let out_shape = dims.output_shape(lhs.shape(), rhs.shape())?;
        let stacks = stacks(lhs, rhs, dims)?;
        let _span = span(&stacks, lhs.shape(), rhs.shape(), 2);
        let kept = kept_packing(rhs, &stacks, threads);
        // SAFETY: `own_rounded_stacks` writes every element (zeros for an empty contraction).
        let out = unsafe {
            filled(out_shape.iter().product(), |out| {
                own_rounded_stacks(&stacks, threads, out, kept.as_deref())
            })
        };
        return Bf16Tensor::new(out_shape, out);
    }
    let stacks = stacks(lhs, rhs, dims)?;
    if stacks.all_rows().len() >= 2 * MIN_BLOCK_ROWS && stacks.a.cols.0 > 0 && bands_keep_bits() {
        let out_shape = dims.output_shape(lhs.shape(), rhs.shape())?;
        let _span = span(&stacks, lhs.shape(), rhs.shape(), 2);
        // SAFETY: `rounded_by_bands` writes every element (its bands cover the output, `k > 0`).
        let out = unsafe {
            filled(out_shape.iter().product(), |out| {
                rounded_by_bands(&stacks, threads, out, rhs)
            })
        };
        return Bf16Tensor::new(out_shape, out);
    }
    Ok(Bf16Tensor::from_f32(&dot_general_bf16(
        lhs, rhs, dims, threads,
    )?))
}

/// `parts += widen(dot_general_bf16_rounded(lhs, rhs))`, with `parts` the row-major `f32`
/// result in consecutive equal parts of whole rows (a gradient buffer, as the `f32`
/// `dot_general_accumulate_parts` takes it): a bf16 weight copy's gradient, rounded to bf16 as
/// its cotangent is, added into the master weight's `f32` accumulator without the bf16 result
/// being stored and read back. Each element gets one addition of exactly the value
/// [`dot_general_bf16_rounded`] gives it, so the bits are those of that product followed by a
/// widening add. On ferrotext's AVX512_BF16 kernel with `rhs` packed once, each register tile
/// is rounded and added as it leaves the registers (`dpbf16::gemm_rounded_accumulate`), a run
/// of rows per thread; otherwise the products are computed a band of rows at a time into
/// scratch, as `rounded_by_bands` does, each band at least `MIN_BLOCK_ROWS` rows, or the whole
/// product at once where the parts hold fewer than twice that. Returns `false`, touching
/// nothing, where the parts cut a row or the contraction is empty (the caller takes the
/// unfused path).
///
/// # Errors
/// As [`dot_general_bf16`], and [`TensorError::Shape`] when the parts do not hold the result.
pub fn dot_general_bf16_rounded_accumulate_parts(
    lhs: &Bf16Tensor,
    rhs: &Bf16Tensor,
    dims: &DotDims,
    threads: usize,
    parts: &mut [&mut [f32]],
) -> Result<bool, TensorError> {
    choice(false).describe()?;
    let out_shape = dims.output_shape(lhs.shape(), rhs.shape())?;
    let len: usize = out_shape.iter().product();
    let held: usize = parts.iter().map(|p| p.len()).sum();
    if held != len {
        return Err(TensorError::shape(
            "dot_general_bf16_rounded_accumulate",
            format!("an output of {held} elements for a result {out_shape:?}"),
        ));
    }
    let stacks = stacks(lhs, rhs, dims)?;
    let (k, n) = (stacks.a.cols.0, stacks.b.cols.0);
    let part = parts.first().map_or(0, |p| p.len());
    if n == 0 || part == 0 {
        // No elements (every part is empty, since they add up to the result).
        return Ok(true);
    }
    if k == 0 || !part.is_multiple_of(n) || parts.iter().any(|p| p.len() != part) {
        return Ok(false);
    }
    let _span = span(&stacks, lhs.shape(), rhs.shape(), 8);
    let rows = part / n;
    if rows < 2 * MIN_BLOCK_ROWS || !bands_keep_bits() {
        // Small parts, or a kernel whose bands change bits: the whole product in one piece, as
        // `dot_general_bf16_rounded` computes it (a library's rows are its rows of the whole
        // product only in blocks above its small-matrix kernels: one row at a time, MKL gave
        // other bits).
        // SAFETY: `products` writes every element of the product (`k > 0`, checked above).
        let whole = unsafe {
            filled(len, |dst| {
                products(&stacks, threads, stacks.all_rows(), dst, Store::Overwrite);
            })
        };
        for (out, src) in parts.iter_mut().zip(whole.chunks(part)) {
            add_rounded(src, out);
        }
        return Ok(true);
    }
    let bands = Bands::new(&stacks, threads, None);
    let band = if bands.rounds_in_registers() {
        // No scratch to keep in cache: a run of whole row tiles per thread.
        rows.div_ceil(threads.max(1))
            .next_multiple_of(super::dpbf16::MR)
            .min(rows)
    } else {
        band_rows(rows, n, k, threads)
    };
    for (p, out) in parts.iter_mut().enumerate() {
        for_each_chunk(out, band * n, threads, Work::Heavy, |c, out| {
            let first = p * rows + c * band;
            // SAFETY: `out` holds whole rows of the product from `first` (`k > 0`, checked
            // above).
            if unsafe { bands.add_rounded_band(first, out) } {
                return;
            }
            // SAFETY: `band` writes every element of its rows (`k > 0`, checked above).
            let scratch = unsafe { filled(out.len(), |dst| bands.band(first, dst)) };
            add_rounded(&scratch, out);
        });
    }
    Ok(true)
}

/// True when a band of rows computed alone has the bits of those rows of the whole product on
/// this process's bf16 kernel, so products may be rounded a band at a time: ferrotext's kernels
/// (each element one chain, by construction) and MKL on AMX tiles (the tests compare bands with
/// the whole product). Not MKL without tiles: its AVX-512 bf16 product (a processor with
/// AVX-512 but no AMX, as `MKL_ENABLE_INSTRUCTIONS=AVX512` makes this one) gave a band of rows
/// other bits than the whole product; nor a library not measured so.
fn bands_keep_bits() -> bool {
    !matches!(choice(false), Choice::Library(..)) || products_on_tiles()
}

/// The `f32` output bytes a band of [`rounded_by_bands`] aims at: its product is rounded while
/// it is still in the core's L2.
const BAND_BYTES: usize = 256 << 10;

/// The fewest rows of a band of [`rounded_by_bands`] when `b` is too large to stay in cache
/// between bands ([`CACHED_RHS_BYTES`]): each band's call packs the whole of `b` again, from
/// memory (on a library's kernel, or on ferrotext's when `b` is over the 16 MiB a shared packing
/// takes: [`Bands`]), so narrow bands spend the products' time re-packing (the qwen3-0.6b lm_head,
/// `[512, 1024] × [1024, 151936]`, in bands of 64 rows: each of 8 calls packed all 151936
/// columns, and it ran at 248 GFLOP/s against 600 for the layers' products; with bands of 256
/// rows a 0.6b bf16 step went from 9.6 to 6.7 s).
const MIN_BAND_ROWS: usize = 256;

/// The largest `b` (bytes of bf16) that bands of [`MIN_BLOCK_ROWS`] rows may re-pack: it is
/// re-read from the core's cache. At qwen3-peer (its layers' `b` at most 384 KiB) bands of 64
/// rows made the forward's products 32 ms a step against 41 ms with bands of 256 (one profiled
/// run each); at qwen3-0.6b the smallest `b`, the lm_head gradient's 1 MiB `x`, took 234 ms a
/// micro-batch in bands of 64 rows and 138 ms in bands of 256.
const CACHED_RHS_BYTES: usize = 512 << 10;

/// Rows per band of a rounded product of `rows × n` with a `k × n` rhs: [`BAND_BYTES`] of
/// output, but at least [`MIN_BAND_ROWS`] when `b` does not stay in cache, at most a
/// `threads`-th of the rows and at least [`MIN_BLOCK_ROWS`], in a multiple of `threads` bands
/// so each thread gets as many.
fn band_rows(rows: usize, n: usize, k: usize, threads: usize) -> usize {
    let threads = threads.max(1);
    let floor = if 2 * k * n <= CACHED_RHS_BYTES {
        MIN_BLOCK_ROWS
    } else {
        MIN_BAND_ROWS
    };
    let want = (BAND_BYTES / (4 * n.max(1))).max(floor);
    let count = rows.div_ceil(want).div_ceil(threads) * threads;
    rows.div_ceil(count.max(1))
        .max(MIN_BLOCK_ROWS.min(rows))
        .max(1)
}

/// Every row of `s`'s products (`[batch · m, n]`) rounded into `out`, a band of rows at a time
/// ([`band_rows`]): each band's `f32` product goes into scratch on its thread and is rounded
/// from there, so no `f32` result of the whole output is made at once. A band's rows are those
/// of the whole product: a library's rows of a block are its rows of the whole product, as
/// `dot_general`'s threads rely on (bands of columns are not: MKL's AVX2 bf16 product gave
/// other bits for a band of 150 columns); the portable kernel's by construction. `rhs` is
/// `s.b`'s tensor, whose kept packing the bands share when it keeps one.
fn rounded_by_bands(
    s: &Stacks<'_, bf16>,
    threads: usize,
    out: &mut [MaybeUninit<bf16>],
    rhs: &Bf16Tensor,
) {
    let (rows, n) = (s.all_rows().len(), s.b.cols.0);
    let band = band_rows(rows, n, s.a.cols.0, threads);
    let bands = Bands::new(s, threads, Some(rhs));
    for_each_chunk(out, band * n, threads, Work::Heavy, |c, out| {
        let first = c * band;
        // SAFETY: `band` writes every element of its rows (`k > 0`, checked by the caller).
        let scratch = unsafe { filled(out.len(), |dst| bands.band(first, dst)) };
        round_into(&scratch, out);
    });
}

/// How a product's bands of rows are computed: each by `products` on its thread, or, on the
/// AVX512_BF16 kernel with one matrix of `b`, against `b` packed once for all the bands
/// ([`shared_packing`], or the packing `b`'s tensor keeps: `kept_packing`): the same bits
/// either way (each element's chain does not depend on its band or on who packed `b`).
struct Bands<'s, 'a> {
    stacks: &'s Stacks<'a, bf16>,
    #[cfg(target_arch = "x86_64")]
    packed: Option<Arc<super::dpbf16::PackedB>>,
}

impl<'s, 'a> Bands<'s, 'a> {
    /// The bands of `stacks`' product on up to `threads` threads; `rhs`, when given, is `b`'s
    /// tensor (its kept packing is used where it keeps one).
    fn new(stacks: &'s Stacks<'a, bf16>, threads: usize, rhs: Option<&Bf16Tensor>) -> Self {
        #[cfg(target_arch = "x86_64")]
        if let Some(kept) = rhs.and_then(|rhs| kept_packing(rhs, stacks, threads)) {
            return Bands {
                stacks,
                packed: Some(kept),
            };
        }
        #[cfg(target_arch = "x86_64")]
        {
            let (k, n) = (stacks.a.cols.0, stacks.b.cols.0);
            let own = matches!(choice(false), Choice::Own(_)) && stacks.batch == 1;
            let b = Operand {
                // SAFETY: batch entry 0's offset lies inside the stack's data (as in
                // `products`).
                ptr: unsafe { stacks.b.data.as_ptr().offset(stacks.b.offset(0)) },
                rs: stacks.b.rows.1,
                cs: stacks.b.cols.1,
            };
            let packed = if own {
                // SAFETY: batch entry 0 of `b` is a k×n matrix at these strides inside its
                // data (the stack's invariant, as `products` relies on); `Own` is chosen only
                // where the CPU has AVX512_BF16.
                unsafe { shared_packing(b, k, n, threads) }.map(Arc::new)
            } else {
                None
            };
            Bands { stacks, packed }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (threads, rhs);
            Bands { stacks }
        }
    }

    /// Whether [`Bands::add_rounded_band`] adds bands from the kernel's registers (ferrotext's
    /// AVX512_BF16 kernel with `b` packed once), not through an `f32` band in scratch.
    fn rounds_in_registers(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.packed.is_some();
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// `dst += widen(round_bf16(rows first..first + dst.len() / n of the product))` straight
    /// from the kernel's register tiles ([`super::dpbf16::gemm_rounded_accumulate`]: the bits
    /// of the band computed, rounded and then added), when [`Bands::rounds_in_registers`];
    /// `false`, `dst` untouched, otherwise.
    ///
    /// # Safety
    /// `dst` holds whole rows of the product inside it; `k > 0`.
    unsafe fn add_rounded_band(&self, first: usize, dst: &mut [f32]) -> bool {
        #[cfg(target_arch = "x86_64")]
        if let Some(packed) = &self.packed {
            let n = self.stacks.b.cols.0;
            // SAFETY: `dst`'s rows from `first` are rows of the product (the caller's
            // contract); `packed` is this `b`'s packing (made on the AVX512_BF16 kernel), `dst`
            // the band's initialised rows.
            unsafe {
                super::dpbf16::gemm_rounded_accumulate(
                    dst.len() / n.max(1),
                    self.a_from(first),
                    packed,
                    dst.as_mut_ptr(),
                    n,
                )
            };
            return true;
        }
        let _ = (first, dst);
        false
    }

    /// `a` from its row `first` (of the one batch entry), at its strides.
    ///
    /// # Safety
    /// `first` is a row of `a`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn a_from(&self, first: usize) -> Operand<bf16> {
        let a = &self.stacks.a;
        Operand {
            // SAFETY: row `first` of the one batch entry lies inside `a` (the caller's
            // contract).
            ptr: unsafe {
                a.data
                    .as_ptr()
                    .offset(a.offset(0) + first as isize * a.rows.1)
            },
            rs: a.rows.1,
            cs: a.cols.1,
        }
    }

    /// Rows `first..first + dst.len() / n` of the product into `dst`, overwritten.
    ///
    /// # Safety
    /// `dst` holds whole rows of the product inside it; `k > 0`.
    unsafe fn band(&self, first: usize, dst: &mut [MaybeUninit<f32>]) {
        let s = self.stacks;
        let (k, n) = (s.a.cols.0, s.b.cols.0);
        let rows = dst.len() / n.max(1);
        #[cfg(target_arch = "x86_64")]
        if let Some(packed) = &self.packed {
            let p = Product {
                m: rows,
                n,
                k,
                // SAFETY: rows `first..first + rows` are rows of the product (the caller's
                // contract).
                a: unsafe { self.a_from(first) },
                b: Operand {
                    // SAFETY: as in `Bands::new`.
                    ptr: unsafe { s.b.data.as_ptr().offset(s.b.offset(0)) },
                    rs: s.b.rows.1,
                    cs: s.b.cols.1,
                },
                dst: dst.as_mut_ptr().cast::<f32>(),
                ldc: n,
                store: Store::Overwrite,
            };
            // SAFETY: as above; `packed` is this `b`'s packing; `dst` holds the rows.
            unsafe { super::dpbf16::gemm_packed(p, packed) };
            return;
        }
        products(s, 1, first..first + rows, dst, Store::Overwrite);
    }
}

/// Every batch entry of `stacks` rounded into `out` (`[batch, m, n]`, row-major) on the
/// AVX512_BF16 kernel: one entry at a time on up to `threads` row blocks when an entry is large,
/// else the entries shared out over the threads in runs. `kept`: `b`'s packing, for a stack of
/// one entry. Every element of `out` is written (not read first: the output is allocated
/// uninitialised, no zeroing pass over it).
#[cfg(target_arch = "x86_64")]
fn own_rounded_stacks(
    s: &Stacks<'_, bf16>,
    threads: usize,
    out: &mut [MaybeUninit<bf16>],
    kept: Option<&super::dpbf16::PackedB>,
) {
    let (m, k, n) = (s.a.rows.0, s.a.cols.0, s.b.cols.0);
    if out.is_empty() {
        return;
    }
    if k == 0 {
        // An empty contraction: the product is zero.
        out.fill(MaybeUninit::new(bf16::ZERO));
        return;
    }
    let entry = |i: usize, dst: &mut [MaybeUninit<bf16>], threads: usize| {
        // SAFETY: `own_rounded` is called only when the CPU has AVX512_BF16 (`Choice::Own`);
        // entry `i`'s operands are m×k and k×n inside their stacks, and `dst` holds its m×n.
        unsafe {
            let p = entry_product(s, i, dst.as_mut_ptr().cast::<bf16>(), Store::Overwrite);
            own_rounded(p, threads, kept)
        };
    };
    let block = m * n;
    if s.batch == 1 || m >= 2 * MIN_BLOCK_ROWS {
        for (i, dst) in out.chunks_mut(block).enumerate() {
            entry(i, dst, threads);
        }
    } else {
        use rayon::prelude::*;
        let per_task = s.batch.div_ceil(threads.clamp(1, s.batch));
        out.par_chunks_mut(per_task * block)
            .enumerate()
            .for_each(|(task, run)| {
                for (j, dst) in run.chunks_mut(block).enumerate() {
                    entry(task * per_task + j, dst, 1);
                }
            });
    }
}

/// bf16 operands: the library's bf16 product where it has one, else this file's choice.
impl Element for half::bf16 {
    fn cblas(blas: &Blas) -> Option<Cblas<half::bf16>> {
        blas.bf16.map(|(f, _)| f)
    }
    unsafe fn product(p: Product<half::bf16>, parallelism: gemm::Parallelism) {
        // SAFETY: the caller's contract.
        unsafe { product(p, parallelism) }
    }
    unsafe fn without_blas(p: Product<half::bf16>, _parallelism: gemm::Parallelism) {
        // SAFETY: the caller's contract, which is the portable kernel's; `detect` gives an
        // instruction set this CPU has.
        unsafe { portable::gemm(Isa::detect(), p) }
    }
}

#[cfg(test)]
mod tests;
