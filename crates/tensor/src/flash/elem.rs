//! The element types the tiled attention reads its operands as ([`Elem`]: `f32`, or bf16 on the
//! bf16 product kernel) and the strided views its tile products take ([`View`]).
//!
//! On bf16 operands every product multiplies bf16 values into an `f32` result: `q·kᵀ` and
//! `dout·vᵀ` read the operands as stored; the probabilities (for `P·v` and `Pᵀ·dout`) and `dS`
//! (for `dS·k` and `dSᵀ·q`) are computed in `f32` and rounded to bf16 for their products, as
//! FlashAttention does in half precision: in groups of rows as they are computed (the
//! backward), or after the whole tile (the forward's softmax, whose sweeps run over the tile).
//! Rounding is elementwise, so when changes no bit. The online softmax, the row sums, the
//! log-sum-exps and every accumulation stay `f32`.

use half::bf16;

use crate::bf16::BlockPacking;
use crate::operand::{Operand, Product, Store, Widen};

/// One strided matrix inside a slice: element `(i, j)` is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl<'a, T> View<'a, T> {
    /// Rows `0..rows` and columns `0..cols` of a row-major block whose rows are `stride` apart.
    pub(crate) fn block(data: &'a [T], rows: usize, cols: usize, stride: usize) -> View<'a, T> {
        View {
            data,
            rows,
            cols,
            rs: stride,
            cs: 1,
        }
    }

    /// The transpose.
    pub(crate) fn t(self) -> View<'a, T> {
        View {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// True when every element's offset lies inside `data`.
    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }

    fn operand(&self) -> Operand<T> {
        Operand {
            ptr: self.data.as_ptr(),
            rs: self.rs as isize,
            cs: self.cs as isize,
        }
    }
}

/// An element type the tiled attention reads `q`, `k`, `v` and `dout` as (see the module docs).
pub(crate) trait Elem: Widen {
    /// `dst = a · b` (`Overwrite`) or `dst += a · b` (`Accumulate`) into `a.rows` rows of
    /// `b.cols` `f32` elements `ldc` apart, on the caller's thread.
    ///
    /// # Safety
    /// `dst` is valid for `(a.rows − 1)·ldc + b.cols` elements (initialised when accumulating),
    /// `ldc ≥ b.cols`, and no one else touches those rows meanwhile.
    ///
    /// # Panics
    /// When a view does not fit its slice or the shapes disagree (a bug in the caller).
    unsafe fn product(
        dst: *mut f32,
        ldc: usize,
        a: View<'_, Self>,
        b: View<'_, Self>,
        store: Store,
    );

    /// An operand of many tile products packed once ([`Elem::pack`]).
    type Packing;

    /// `b` packed once for the tile products that each read a block of it, where this type's
    /// product kernel packs its operands (bf16 on the AVX512_BF16 kernel); `None` where each
    /// product reads its operands as stored (`f32`'s kernel; bf16 on a library's or the
    /// portable kernel).
    fn pack(b: View<'_, Self>) -> Option<Self::Packing>;

    /// [`Elem::product`] with `b` rows `at.0..` and columns `at.1..` of the view `packing` was
    /// made of: read from the packing where it holds the block's words, else as
    /// [`Elem::product`]. The same bits either way.
    ///
    /// # Safety
    /// As [`Elem::product`]; `b` is that block of `packing`'s view.
    ///
    /// # Panics
    /// As [`Elem::product`].
    unsafe fn product_from(
        dst: *mut f32,
        ldc: usize,
        (a, b): (View<'_, Self>, View<'_, Self>),
        store: Store,
        from: Option<(&Self::Packing, (usize, usize))>,
    ) {
        let _ = from;
        // SAFETY: the caller's contract.
        unsafe { Self::product(dst, ldc, a, b, store) }
    }

    /// Sizes `stored` to hold `len` elements of a tile as the products read it: bf16 rows are
    /// rounded into it; `f32` keeps none (the products read the `f32` tile itself).
    fn size_stored(stored: &mut Vec<Self>, len: usize);

    /// Whole rows of an `f32` tile (probabilities, `dS`) that start at its element `at`, as the
    /// products read them: rounded into `stored` for bf16; nothing for `f32`. Callers hand over
    /// [`rows_per_store`] rows at a time (about 1 KiB of `f32`: in the backward, while they are
    /// still in the core's L1 cache).
    fn store_rows(rows: &[f32], stored: &mut [Self], at: usize);

    /// The tile's first `len` elements as the products read them: the `f32` tile itself, or the
    /// bf16 rows [`Elem::store_row`] stored.
    fn stored<'s>(tile: &'s [f32], stored: &'s [Self], len: usize) -> &'s [Self];
}

/// Tile rows of `w` rounded by one [`Elem::store_rows`]: about 256 elements (1 KiB of `f32`),
/// at least one row. A rounding call per row of a small head's tile (64 keys) was a call, its
/// setup and a wait on the row's softmax before it.
pub(crate) fn rows_per_store(w: usize) -> usize {
    (256 / w.max(1)).max(1)
}

/// The shared part of [`Elem::product`]: checks the views, zeroes the destination of an empty
/// contraction (when overwriting), and returns the product to run, `None` when there is
/// nothing to multiply.
///
/// # Safety
/// As [`Elem::product`]'s.
unsafe fn prepare<T>(
    dst: *mut f32,
    ldc: usize,
    a: View<'_, T>,
    b: View<'_, T>,
    store: Store,
) -> Option<Product<T>> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(a.fits() && b.fits() && b.rows == k && ldc >= n); // ok: caller's invariant
    if m == 0 || n == 0 || k == 0 {
        if store == Store::Overwrite && m > 0 && n > 0 {
            // SAFETY: the caller's contract: the rows are writable.
            unsafe { zero_rows(dst, ldc, m, n) };
        }
        return None;
    }
    Some(Product {
        m,
        n,
        k,
        a: a.operand(),
        b: b.operand(),
        dst,
        ldc,
        store,
    })
}

impl Elem for f32 {
    unsafe fn product(dst: *mut f32, ldc: usize, a: View<'_, f32>, b: View<'_, f32>, store: Store) {
        // SAFETY: the caller's contract, passed on.
        if let Some(p) = unsafe { prepare(dst, ldc, a, b, store) } {
            // SAFETY: `prepare` checked every operand offset; the caller guarantees the rows.
            unsafe { crate::blas::sgemm(p, gemm::Parallelism::None) }
        }
    }

    type Packing = ();

    fn pack(_: View<'_, f32>) -> Option<()> {
        None
    }

    fn size_stored(_: &mut Vec<f32>, _: usize) {}

    fn store_rows(_: &[f32], _: &mut [f32], _: usize) {}

    fn stored<'s>(tile: &'s [f32], _: &'s [f32], len: usize) -> &'s [f32] {
        &tile[..len]
    }
}

impl Elem for bf16 {
    unsafe fn product(
        dst: *mut f32,
        ldc: usize,
        a: View<'_, bf16>,
        b: View<'_, bf16>,
        store: Store,
    ) {
        // SAFETY: the caller's contract, passed on.
        if let Some(p) = unsafe { prepare(dst, ldc, a, b, store) } {
            // SAFETY: `prepare` checked every operand offset; the caller guarantees the rows.
            unsafe { crate::bf16::product(p, gemm::Parallelism::None) }
        }
    }

    type Packing = BlockPacking;

    fn pack(b: View<'_, bf16>) -> Option<BlockPacking> {
        assert!(b.fits()); // ok: caller's invariant
                           // SAFETY: every element of the view lies inside its slice (checked above).
        unsafe { BlockPacking::of(b.operand(), b.rows, b.cols) }
    }

    unsafe fn product_from(
        dst: *mut f32,
        ldc: usize,
        (a, b): (View<'_, bf16>, View<'_, bf16>),
        store: Store,
        from: Option<(&BlockPacking, (usize, usize))>,
    ) {
        // SAFETY: the caller's contract, passed on.
        let Some(p) = (unsafe { prepare(dst, ldc, a, b, store) }) else {
            return;
        };
        // SAFETY: `prepare` checked every operand offset; the caller guarantees the rows and
        // that `b` is the block `at` of the packing's view.
        unsafe {
            match from {
                Some((packing, at)) => crate::bf16::product_in(p, packing, at),
                None => crate::bf16::product(p, gemm::Parallelism::None),
            }
        }
    }

    fn size_stored(stored: &mut Vec<bf16>, len: usize) {
        if stored.len() < len {
            stored.resize(len, bf16::ZERO);
        }
    }

    fn store_rows(rows: &[f32], stored: &mut [bf16], at: usize) {
        crate::bf16::round_slice(rows, &mut stored[at..at + rows.len()]);
    }

    fn stored<'s>(_: &'s [f32], stored: &'s [bf16], len: usize) -> &'s [bf16] {
        &stored[..len]
    }
}

/// Writes zeros into `rows` rows of `cols` elements `ldc` apart.
///
/// # Safety
/// As [`Elem::product`]'s destination.
unsafe fn zero_rows(dst: *mut f32, ldc: usize, rows: usize, cols: usize) {
    for i in 0..rows {
        // SAFETY: row `i` of the caller's rows.
        unsafe { std::slice::from_raw_parts_mut(dst.add(i * ldc), cols) }.fill(0.0);
    }
}
