//! Strided matrix views ([`MatView`]) and the products on them that write into caller-owned
//! memory: the grouped (MoE) products and the fused attention multiply slices of their inputs in
//! place through these.
//!
//! Invariants: a view's every element lies inside its slice (checked, a panic otherwise: a bug in
//! the caller); each function makes the same kernel call as [`dot_general`](super::dot_general)
//! on copies of the views, so the bits are the same.

use gemm::Parallelism;

use super::GEMM_PARALLEL_MIN;
use crate::operand::{Operand, Product, Store};

/// One strided matrix operand inside a slice: element `(i, j)` is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatView<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl MatView<'_> {
    /// The view as a kernel operand (its first element and strides).
    fn operand(&self) -> Operand {
        Operand {
            ptr: self.data.as_ptr(),
            rs: self.rs as isize,
            cs: self.cs as isize,
        }
    }

    /// True when every element's offset lies inside `data`.
    fn fits(&self) -> bool {
        self.rows == 0
            || self.cols == 0
            || (self.rows - 1) * self.rs + (self.cols - 1) * self.cs < self.data.len()
    }
}

/// `dst = a · b` for views `a` (m×k) and `b` (k×n) into a row-major m×n `dst`, uninitialised
/// before and written whole (an output block needs no zeroing first), without copying the
/// operands: the grouped (MoE) products and fused attention multiply slices of their inputs in
/// place. Uses the same kernel call, and so gives the same bits, as [`dot_general`](super::dot_general) on copies of
/// the views. Returns `dst` initialised.
///
/// # Panics
/// When the views do not fit their slices or `dst` is not m×n (a bug in the caller).
pub(crate) fn gemm_views_uninit<'d>(
    dst: &'d mut [std::mem::MaybeUninit<f32>],
    a: MatView<'_>,
    b: MatView<'_>,
    threads: usize,
) -> &'d mut [f32] {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(a.fits() && b.fits() && b.rows == k && dst.len() == m * n); // ok: caller's invariant
    if k == 0 {
        dst.fill(std::mem::MaybeUninit::new(0.0));
    } else if m > 0 && n > 0 {
        // SAFETY: `fits` checked every operand offset against its slice, and `dst` is exactly
        // m×n row-major; the kernel writes every element of it.
        unsafe {
            gemm_views_store(
                dst.as_mut_ptr().cast::<f32>(),
                a,
                b,
                threads,
                Store::Overwrite,
            )
        };
    }
    // SAFETY: every element was written above (or `dst` is empty).
    unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<f32>(), dst.len()) }
}

/// `dst += a · b` for views `a` (m×k) and `b` (k×n) into a row-major m×n `dst`: the kernel adds
/// each tile of the product into `dst` as it computes it (BLAS `beta = 1`), as
/// [`dot_general_accumulate`] does, so an accumulator takes a product (an expert's weight
/// gradient) without it being stored first.
///
/// # Panics
/// When the views do not fit their slices or `dst` is not m×n (a bug in the caller).
pub(crate) fn gemm_views_accumulate(
    dst: &mut [f32],
    a: MatView<'_>,
    b: MatView<'_>,
    threads: usize,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(a.fits() && b.fits() && b.rows == k && dst.len() == m * n); // ok: caller's invariant
    if m == 0 || n == 0 || k == 0 {
        // An empty product adds nothing.
        return;
    }
    // SAFETY: `fits` checked every operand offset against its slice, and `dst` is exactly m×n
    // row-major and initialised; the kernel reads and writes only its elements.
    unsafe { gemm_views_store(dst.as_mut_ptr(), a, b, threads, Store::Accumulate) };
}

/// `a · b` (m×k by k×n, all three nonzero) stored into the row-major m×n block at `dst` per
/// `store`, inside the kernel over `threads` when the product is large enough.
///
/// # Safety
/// The views fit their slices, `dst` is valid for m×n elements (initialised under
/// [`Store::Accumulate`]) and touched by no one else meanwhile.
unsafe fn gemm_views_store(
    dst: *mut f32,
    a: MatView<'_>,
    b: MatView<'_>,
    threads: usize,
    store: Store,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let parallelism = if threads > 1 && m * n * k >= GEMM_PARALLEL_MIN {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the caller's contract.
    unsafe {
        let p = Product {
            m,
            n,
            k,
            a: a.operand(),
            b: b.operand(),
            dst,
            ldc: n,
            store,
        };
        crate::blas::sgemm(p, parallelism);
    }
}
