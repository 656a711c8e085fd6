//! `dot_general`: batched matrix products over arbitrary batch and contracting dimensions, on
//! MKL or OpenBLAS when the machine has one and the `gemm` crate otherwise ([`crate::blas`]).
//!
//! Layout: the output is `[batch..., lhs free..., rhs free...]`, row-major. Each operand is viewed
//! as a strided `[B, M, K]` (lhs) or `[B, K, N]` (rhs) matrix stack *without copying* whenever
//! each group of dimensions (batch, free, contracting) is contiguous in memory in the order the
//! caller lists it — which covers `x·W`, `x·Wᵀ`, `xᵀ·dy` and the attention products (batch
//! dims keep one stride each, so `[B, T, H, d]` batched over B and H is a view too). Only other
//! layouts pay a transpose copy, which is O(size) next to the product's O(M·N·K).

use gemm::Parallelism;

use crate::blas::{Operand, Store};

use crate::error::TensorError;
use crate::tensor::{strides, Tensor};

/// Which dimensions of each operand are batch and contracting dimensions (XLA's
/// `DotDimensionNumbers`); every other dimension is free.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DotDims {
    /// Contracting dimensions of the lhs.
    pub lhs_contracting: Vec<usize>,
    /// Contracting dimensions of the rhs, paired with `lhs_contracting`.
    pub rhs_contracting: Vec<usize>,
    /// Batch dimensions of the lhs.
    pub lhs_batch: Vec<usize>,
    /// Batch dimensions of the rhs, paired with `lhs_batch`.
    pub rhs_batch: Vec<usize>,
}

impl DotDims {
    /// A plain matrix product of a rank-`lhs_rank` lhs contracting its last dimension with the
    /// first dimension of the rhs (`x·W`).
    pub fn matmul(lhs_rank: usize) -> DotDims {
        DotDims {
            lhs_contracting: vec![lhs_rank - 1],
            rhs_contracting: vec![0],
            ..DotDims::default()
        }
    }

    /// The free dimensions of an operand of `rank` with these batch and contracting dimensions.
    pub fn free(rank: usize, batch: &[usize], contracting: &[usize]) -> Vec<usize> {
        (0..rank)
            .filter(|d| !batch.contains(d) && !contracting.contains(d))
            .collect()
    }

    /// The output shape for operands of these shapes.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when dimensions repeat, are out of range, or paired sizes differ.
    pub fn output_shape(&self, lhs: &[usize], rhs: &[usize]) -> Result<Vec<usize>, TensorError> {
        self.check(lhs, rhs)?;
        let lf = DotDims::free(lhs.len(), &self.lhs_batch, &self.lhs_contracting);
        let rf = DotDims::free(rhs.len(), &self.rhs_batch, &self.rhs_contracting);
        Ok(self
            .lhs_batch
            .iter()
            .map(|&d| lhs[d])
            .chain(lf.iter().map(|&d| lhs[d]))
            .chain(rf.iter().map(|&d| rhs[d]))
            .collect())
    }

    fn check(&self, lhs: &[usize], rhs: &[usize]) -> Result<(), TensorError> {
        let bad = |reason: String| Err(TensorError::shape("dot_general", reason));
        let unique = |dims: &[usize], rank: usize| {
            let mut seen = vec![false; rank];
            dims.iter()
                .all(|&d| d < rank && !std::mem::replace(&mut seen[d], true))
        };
        let lhs_dims: Vec<usize> = self
            .lhs_batch
            .iter()
            .chain(&self.lhs_contracting)
            .copied()
            .collect();
        let rhs_dims: Vec<usize> = self
            .rhs_batch
            .iter()
            .chain(&self.rhs_contracting)
            .copied()
            .collect();
        if self.lhs_batch.len() != self.rhs_batch.len()
            || self.lhs_contracting.len() != self.rhs_contracting.len()
            || !unique(&lhs_dims, lhs.len())
            || !unique(&rhs_dims, rhs.len())
        {
            return bad(format!(
                "invalid dimension numbers {self:?} for {lhs:?} · {rhs:?}"
            ));
        }
        for (&l, &r) in lhs_dims.iter().zip(&rhs_dims) {
            if lhs[l] != rhs[r] {
                return bad(format!(
                    "lhs dimension {l} (size {}) is paired with rhs dimension {r} (size {}) in {lhs:?} · {rhs:?}",
                    lhs[l], rhs[r]
                ));
            }
        }
        Ok(())
    }
}

/// A group of dimensions flattened to one (size, stride), if memory allows it without a copy.
fn flatten(dims: &[usize], shape: &[usize], st: &[usize]) -> Option<(usize, isize)> {
    let size = dims.iter().map(|&d| shape[d]).product();
    let Some(&last) = dims.last() else {
        return Some((1, 0));
    };
    // Consecutive listed dims must nest: stride[d_i] == stride[d_{i+1}] * size[d_{i+1}], ignoring
    // size-1 dims, whose stride never matters.
    let real: Vec<usize> = dims.iter().copied().filter(|&d| shape[d] != 1).collect();
    for w in real.windows(2) {
        if st[w[0]] != st[w[1]] * shape[w[1]] {
            return None;
        }
    }
    let inner = real.last().copied().unwrap_or(last);
    Some((size, st[inner] as isize))
}

/// One operand as a strided matrix stack `[batch..., rows, cols]`: its data, each batch dim as
/// (size, stride) in the caller's order, and the flattened rows and columns.
struct MatStack<'a> {
    data: std::borrow::Cow<'a, [f32]>,
    batch: Vec<(usize, isize)>,
    rows: (usize, isize),
    cols: (usize, isize),
}

impl MatStack<'_> {
    /// The element offset of batch entry `i` (row-major over the batch dims).
    fn offset(&self, mut i: usize) -> isize {
        let mut off = 0;
        for &(size, stride) in self.batch.iter().rev() {
            off += (i % size) as isize * stride;
            i /= size;
        }
        off
    }
}

/// Batch dims need not nest: each keeps its own stride (attention's `[B, T, H, d]` operands
/// batch over B and H around T), so only rows and columns must flatten to avoid a copy.
fn as_stack<'a>(
    t: &'a Tensor,
    batch: &[usize],
    rows: &[usize],
    cols: &[usize],
) -> Result<MatStack<'a>, TensorError> {
    let st = strides(t.shape());
    if let (Some(r), Some(c)) = (flatten(rows, t.shape(), &st), flatten(cols, t.shape(), &st)) {
        let batch = match flatten(batch, t.shape(), &st) {
            Some(b) => vec![b],
            None => batch
                .iter()
                .map(|&d| (t.shape()[d], st[d] as isize))
                .collect(),
        };
        return Ok(MatStack {
            data: std::borrow::Cow::Borrowed(t.data()),
            batch,
            rows: r,
            cols: c,
        });
    }
    // Copy into [batch, rows, cols] order.
    let perm: Vec<usize> = batch.iter().chain(rows).chain(cols).copied().collect();
    let moved = t.transpose(&perm)?;
    let size = |dims: &[usize]| dims.iter().map(|&d| t.shape()[d]).product::<usize>();
    let (b, r, c) = (size(batch), size(rows), size(cols));
    Ok(MatStack {
        data: std::borrow::Cow::Owned(moved.into_data()),
        batch: vec![(b, (r * c) as isize)],
        rows: (r, c as isize),
        cols: (c, 1),
    })
}

/// Below this many multiply-adds a product runs on one thread inside gemm.
const GEMM_PARALLEL_MIN: usize = 64 * 64 * 64;

/// `dot_general(lhs, rhs)` with output `[batch..., lhs free..., rhs free...]`, using up to
/// `threads` threads: inside gemm for a large product, across the batch for many small ones
/// (attention's heads). Either way each output block is computed by the same gemm call, so the
/// result does not depend on `threads`.
///
/// # Errors
/// [`TensorError::Shape`] when the dimension numbers do not fit the shapes.
pub fn dot_general(
    lhs: &Tensor,
    rhs: &Tensor,
    dims: &DotDims,
    threads: usize,
) -> Result<Tensor, TensorError> {
    let out_shape = dims.output_shape(lhs.shape(), rhs.shape())?;
    let len: usize = out_shape.iter().product();
    let stacks = Stacks::of(lhs, rhs, dims)?;
    let _span = stacks.span((lhs, rhs));
    // SAFETY: `products` runs the kernel on every block of the output, and the kernel writes
    // every element of its block (or the whole output is zero-filled for an empty
    // contraction).
    let out = unsafe {
        crate::parallel::filled(len, |dst| {
            products(&stacks, threads, stacks.all_rows(), dst, Store::Overwrite);
        })
    };
    Tensor::new(out_shape, out)
}

/// `out += dot_general(lhs, rhs)`, with `out` the row-major result (`[batch..., lhs free...,
/// rhs free...]`): the kernel adds each tile of the product into `out` as it computes it
/// (BLAS `beta = 1`), so a gradient accumulator takes a weight's gradient without the product
/// being stored and read back. The sum is the product's to within the kernel's rounding (the
/// tile sums are added to `out` as they finish rather than once at the end); the result does
/// not depend on `threads`.
///
/// # Errors
/// [`TensorError::Shape`] when the dimension numbers do not fit the shapes or `out` is not the
/// result's size.
pub fn dot_general_accumulate(
    lhs: &Tensor,
    rhs: &Tensor,
    dims: &DotDims,
    threads: usize,
    out: &mut [f32],
) -> Result<(), TensorError> {
    // One part holds whole rows, so the product always goes in.
    dot_general_accumulate_parts(lhs, rhs, dims, threads, &mut [out]).map(|_| ())
}

/// [`dot_general_accumulate`] into a result held in `parts` of equal length, in order: part
/// `k` holds elements `k·len/p .. (k+1)·len/p` of the row-major result (as a reduce-scatter
/// bucket keeps chunk `k` of a value in its segment `k`). Each part takes its rows of the
/// product from its own kernel calls, so nothing is copied into or out of the parts. Returns
/// `false`, having touched nothing, when a part does not hold whole rows of the product (rows
/// of `[batch · lhs free, rhs free]`); the caller then adds the product itself.
///
/// A part's rows are computed by the kernel on those rows of the lhs alone, which may round
/// differently from the same rows of one call over all of them (a smaller product may take
/// another kernel); the result does not depend on `threads`.
///
/// # Errors
/// [`TensorError::Shape`] when the dimension numbers do not fit the shapes or the parts do not
/// add up to the result's size.
pub fn dot_general_accumulate_parts(
    lhs: &Tensor,
    rhs: &Tensor,
    dims: &DotDims,
    threads: usize,
    parts: &mut [&mut [f32]],
) -> Result<bool, TensorError> {
    let out_shape = dims.output_shape(lhs.shape(), rhs.shape())?;
    let len: usize = out_shape.iter().product();
    let held: usize = parts.iter().map(|p| p.len()).sum();
    if held != len {
        return Err(TensorError::shape(
            "dot_general_accumulate",
            format!("an output of {held} elements for a result {out_shape:?}"),
        ));
    }
    let stacks = Stacks::of(lhs, rhs, dims)?;
    let row = stacks.b.cols.0;
    let part = parts.first().map_or(0, |p| p.len());
    if row == 0 || part == 0 {
        // No elements (every part is empty, since they add up to the result).
        return Ok(true);
    }
    if !part.is_multiple_of(row) || parts.iter().any(|p| p.len() != part) {
        return Ok(false);
    }
    let _span = stacks.span((lhs, rhs));
    let rows_per_part = part / row;
    for (k, out) in parts.iter_mut().enumerate() {
        // SAFETY: `[f32]` and `[MaybeUninit<f32>]` have one layout; under `Store::Accumulate`
        // the kernel reads each element before it writes it, and every element is initialised.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                out.as_mut_ptr().cast::<std::mem::MaybeUninit<f32>>(),
                out.len(),
            )
        };
        let rows = k * rows_per_part..(k + 1) * rows_per_part;
        products(&stacks, threads, rows, dst, Store::Accumulate);
    }
    Ok(true)
}

/// Both operands of a product as matrix stacks (views when their layouts allow), and the
/// batch size.
struct Stacks<'a> {
    a: MatStack<'a>,
    b: MatStack<'a>,
    batch: usize,
}

impl<'a> Stacks<'a> {
    fn of(lhs: &'a Tensor, rhs: &'a Tensor, dims: &DotDims) -> Result<Stacks<'a>, TensorError> {
        let lf = DotDims::free(lhs.rank(), &dims.lhs_batch, &dims.lhs_contracting);
        let rf = DotDims::free(rhs.rank(), &dims.rhs_batch, &dims.rhs_contracting);
        Ok(Stacks {
            a: as_stack(lhs, &dims.lhs_batch, &lf, &dims.lhs_contracting)?,
            b: as_stack(rhs, &dims.rhs_batch, &dims.rhs_contracting, &rf)?,
            batch: dims.lhs_batch.iter().map(|&d| lhs.shape()[d]).product(),
        })
    }

    /// Every row of the result seen as `[batch · m, n]`.
    fn all_rows(&self) -> std::ops::Range<usize> {
        0..self.batch * self.a.rows.0
    }

    /// The profiler's span for the whole product of `lhs` and `rhs`.
    fn span(&self, (lhs, rhs): (&Tensor, &Tensor)) -> Option<ferrotext_profile::Span> {
        let (m, k, n) = (self.a.rows.0, self.a.cols.0, self.b.cols.0);
        let batch = self.batch;
        ferrotext_profile::span("dot_general").map(|s| {
            s.flops(2.0 * (batch * m * n) as f64 * k as f64)
                .bytes(4.0 * (batch * (m * k + k * n + m * n)) as f64)
                .shapes(|| format!("{:?} x {:?}", lhs.shape(), rhs.shape()))
        })
    }
}

/// Rows `rows` of the products of [`dot_general`] — the result seen as `[batch · m, n]` —
/// into `dst` (those rows, row-major: `rows.len() · n` elements, checked by the caller against
/// the shapes), stored per `store`. All rows take one kernel call per batch entry (or the
/// entries spread over the threads); a band of rows takes one call per entry it crosses, on
/// those rows of the lhs.
fn products(
    stacks: &Stacks<'_>,
    threads: usize,
    rows: std::ops::Range<usize>,
    dst: &mut [std::mem::MaybeUninit<f32>],
    store: Store,
) {
    let Stacks { a, b, batch } = stacks;
    let batch = *batch;
    let (m, k, n) = (a.rows.0, a.cols.0, b.cols.0);
    if m == 0 || n == 0 || batch == 0 || rows.is_empty() {
        return;
    }
    let dst = &mut dst[..rows.len() * n];
    if k == 0 {
        // An empty contraction: the product is zero.
        if store == Store::Overwrite {
            dst.fill(std::mem::MaybeUninit::new(0.0));
        }
        return;
    }
    // Rows `entry_rows` of batch entry `i` into `dst` (those rows of its m×n block).
    let one = |i: usize,
               entry_rows: std::ops::Range<usize>,
               dst: &mut [std::mem::MaybeUninit<f32>],
               parallelism: Parallelism| {
        // SAFETY: `a`'s strides come from its shape, so batch entry `i`'s offset plus
        // `(m-1)·rows.1 + (k-1)·cols.1` stays inside its data (likewise `b`), and its rows
        // `entry_rows` lie within its `m`; `dst` holds those rows of the entry's m×n row-major
        // block of the output, which the kernel only writes (`Overwrite`) or reads initialised
        // and writes (`Accumulate`).
        unsafe {
            crate::blas::sgemm(
                entry_rows.len(),
                n,
                k,
                dst.as_mut_ptr().cast::<f32>(),
                n,
                Operand {
                    ptr: a
                        .data
                        .as_ptr()
                        .offset(a.offset(i) + entry_rows.start as isize * a.rows.1),
                    rs: a.rows.1,
                    cs: a.cols.1,
                },
                Operand {
                    ptr: b.data.as_ptr().offset(b.offset(i)),
                    rs: b.rows.1,
                    cs: b.cols.1,
                },
                parallelism,
                store,
            );
        }
    };
    let inside = |r: usize| {
        if threads > 1 && r * n * k >= GEMM_PARALLEL_MIN {
            Parallelism::Rayon(threads)
        } else {
            Parallelism::None
        }
    };
    let block = m * n;
    if rows != stacks.all_rows() {
        // A band: entry by entry, each piece on its rows of the lhs.
        let mut at = rows.start;
        let mut dst = dst;
        while at < rows.end {
            let (i, r0) = (at / m, at % m);
            let r1 = m.min(r0 + rows.end - at);
            let (here, rest) = dst.split_at_mut((r1 - r0) * n);
            one(i, r0..r1, here, inside(r1 - r0));
            dst = rest;
            at += r1 - r0;
        }
    } else if threads > 1 && m * n * k >= GEMM_PARALLEL_MIN {
        for (i, dst) in dst.chunks_mut(block).enumerate() {
            one(i, 0..m, dst, Parallelism::Rayon(threads));
        }
    } else if threads > 1 && batch > 1 && batch * m * n * k >= GEMM_PARALLEL_MIN {
        use rayon::prelude::*;
        let per_task = batch.div_ceil(threads.min(batch));
        dst.par_chunks_mut(per_task * block)
            .enumerate()
            .for_each(|(task, run)| {
                for (j, dst) in run.chunks_mut(block).enumerate() {
                    one(task * per_task + j, 0..m, dst, Parallelism::None);
                }
            });
    } else {
        for (i, dst) in dst.chunks_mut(block).enumerate() {
            one(i, 0..m, dst, Parallelism::None);
        }
    }
}

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
/// place. Uses the same kernel call, and so gives the same bits, as [`dot_general`] on copies of
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
        crate::blas::sgemm(
            m,
            n,
            k,
            dst,
            n,
            a.operand(),
            b.operand(),
            parallelism,
            store,
        );
    }
}

/// `dst = a · b` for views `a` (m×k) and `b` (k×n) into `m` rows of `n` elements `ldc` apart
/// from `dst`, on the caller's thread: a block of a larger output whose rows interleave with
/// other blocks' (attention writes each head's rows straight into `[B, T, H, d]`). The same
/// kernel call as [`gemm_views_uninit`] with another row stride, so the same bits.
///
/// # Safety
/// `dst` must be valid for writes of `(m − 1)·ldc + n` elements, `ldc ≥ n`, and no one else may
/// access the `m` rows written meanwhile.
///
/// # Panics
/// When the views do not fit their slices (a bug in the caller).
pub(crate) unsafe fn gemm_views_into_rows(
    dst: *mut f32,
    ldc: usize,
    a: MatView<'_>,
    b: MatView<'_>,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert!(a.fits() && b.fits() && b.rows == k && ldc >= n); // ok: caller's invariant
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            // SAFETY: row `i` of the caller's rows (written, not read: uninitialised is fine).
            let row = unsafe {
                std::slice::from_raw_parts_mut(
                    dst.add(i * ldc).cast::<std::mem::MaybeUninit<f32>>(),
                    n,
                )
            };
            row.fill(std::mem::MaybeUninit::new(0.0));
        }
        return;
    }
    // SAFETY: `fits` checked every operand offset against its slice; the caller guarantees the
    // destination rows.
    unsafe {
        crate::blas::sgemm(
            m,
            n,
            k,
            dst,
            ldc,
            a.operand(),
            b.operand(),
            Parallelism::None,
            Store::Overwrite,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain triple loop over the same dimension numbers.
    fn reference(lhs: &Tensor, rhs: &Tensor, dims: &DotDims) -> Tensor {
        let out_shape = dims.output_shape(lhs.shape(), rhs.shape()).unwrap();
        let lf = DotDims::free(lhs.rank(), &dims.lhs_batch, &dims.lhs_contracting);
        let rf = DotDims::free(rhs.rank(), &dims.rhs_batch, &dims.rhs_contracting);
        let ls = strides(lhs.shape());
        let rs = strides(rhs.shape());
        let csizes: Vec<usize> = dims
            .lhs_contracting
            .iter()
            .map(|&d| lhs.shape()[d])
            .collect();
        let ccount: usize = csizes.iter().product();
        Tensor::from_fn(&out_shape, |flat| {
            let mut idx = vec![0; out_shape.len()];
            let mut rest = flat;
            for d in (0..out_shape.len()).rev() {
                idx[d] = rest % out_shape[d];
                rest /= out_shape[d];
            }
            let nb = dims.lhs_batch.len();
            let mut acc = 0.0f64;
            for c in 0..ccount {
                let mut cidx = vec![0; csizes.len()];
                let mut r = c;
                for j in (0..csizes.len()).rev() {
                    cidx[j] = r % csizes[j];
                    r /= csizes[j];
                }
                let mut lo = 0;
                let mut ro = 0;
                for (j, (&l, &rr)) in dims.lhs_batch.iter().zip(&dims.rhs_batch).enumerate() {
                    lo += idx[j] * ls[l];
                    ro += idx[j] * rs[rr];
                }
                for (j, &l) in lf.iter().enumerate() {
                    lo += idx[nb + j] * ls[l];
                }
                for (j, &r2) in rf.iter().enumerate() {
                    ro += idx[nb + lf.len() + j] * rs[r2];
                }
                for (j, (&l, &r2)) in dims
                    .lhs_contracting
                    .iter()
                    .zip(&dims.rhs_contracting)
                    .enumerate()
                {
                    lo += cidx[j] * ls[l];
                    ro += cidx[j] * rs[r2];
                }
                acc += lhs.data()[lo] as f64 * rhs.data()[ro] as f64;
            }
            acc as f32
        })
    }

    fn rand(shape: &[usize], seed: u32) -> Tensor {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        Tensor::from_fn(shape, |_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 2000) as f32 / 1000.0 - 1.0
        })
    }

    fn close(a: &Tensor, b: &Tensor) {
        assert_eq!(a.shape(), b.shape());
        for (x, y) in a.data().iter().zip(b.data()) {
            assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn matches_reference_on_layouts_that_need_and_do_not_need_copies() {
        let cases: Vec<(Vec<usize>, Vec<usize>, DotDims)> = vec![
            // x·W
            (vec![5, 7], vec![7, 3], DotDims::matmul(2)),
            // x·Wᵀ
            (
                vec![5, 7],
                vec![3, 7],
                DotDims {
                    lhs_contracting: vec![1],
                    rhs_contracting: vec![1],
                    ..Default::default()
                },
            ),
            // xᵀ·dy over two leading (batch, seq) dims: the weight gradient
            (
                vec![2, 3, 4],
                vec![2, 3, 5],
                DotDims {
                    lhs_contracting: vec![0, 1],
                    rhs_contracting: vec![0, 1],
                    ..Default::default()
                },
            ),
            // attention scores: [B,H,T,D]·[B,H,S,D] over D, batch (B,H)
            (
                vec![2, 3, 4, 5],
                vec![2, 3, 6, 5],
                DotDims {
                    lhs_contracting: vec![3],
                    rhs_contracting: vec![3],
                    lhs_batch: vec![0, 1],
                    rhs_batch: vec![0, 1],
                },
            ),
            // a permuted layout that needs a copy: batch in the middle
            (
                vec![4, 2, 3],
                vec![3, 2, 5],
                DotDims {
                    lhs_contracting: vec![2],
                    rhs_contracting: vec![0],
                    lhs_batch: vec![1],
                    rhs_batch: vec![1],
                },
            ),
            // outer product and an empty contraction
            (vec![3], vec![4], DotDims::default()),
            (vec![3, 0], vec![0, 2], DotDims::matmul(2)),
        ];
        for (i, (ls, rs, dims)) in cases.into_iter().enumerate() {
            let a = rand(&ls, i as u32);
            let b = rand(&rs, 100 + i as u32);
            for threads in [1, 2] {
                close(
                    &dot_general(&a, &b, &dims, threads).unwrap(),
                    &reference(&a, &b, &dims),
                );
            }
        }
        // A big enough product to run multithreaded.
        let a = rand(&[96, 80], 7);
        let b = rand(&[80, 72], 8);
        close(
            &dot_general(&a, &b, &DotDims::matmul(2), 2).unwrap(),
            &reference(&a, &b, &DotDims::matmul(2)),
        );
    }

    /// A weight gradient's dimension numbers: `xᵀ·dy` contracting batch and sequence.
    fn weight_gradient() -> DotDims {
        DotDims {
            lhs_contracting: vec![0, 1],
            rhs_contracting: vec![0, 1],
            ..Default::default()
        }
    }

    /// `dot_general_accumulate` adds the product into what the output held: against
    /// `start + reference` on a weight gradient's layout (large enough to split over threads),
    /// a batched one and an empty contraction, the same bits on 1, 2 and 3 threads; and a
    /// wrongly sized output is an error that leaves it untouched.
    #[test]
    fn accumulating_adds_the_product_into_the_output() {
        let wgrad = weight_gradient();
        let batched = DotDims {
            lhs_contracting: vec![3],
            rhs_contracting: vec![3],
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 1],
        };
        let cases = [
            (vec![4, 64, 96], vec![4, 64, 80], wgrad),
            (vec![2, 3, 40, 24], vec![2, 3, 36, 24], batched),
            (vec![3, 0], vec![0, 2], DotDims::matmul(2)),
        ];
        for (i, (ls, rs, dims)) in cases.into_iter().enumerate() {
            let a = rand(&ls, 10 + i as u32);
            let b = rand(&rs, 20 + i as u32);
            let want = reference(&a, &b, &dims);
            let start = rand(want.shape(), 30 + i as u32);
            let sum = Tensor::new(
                want.shape().to_vec(),
                want.data()
                    .iter()
                    .zip(start.data())
                    .map(|(w, c)| w + c)
                    .collect(),
            )
            .unwrap();
            let mut first: Option<Vec<f32>> = None;
            for threads in [1, 2, 3] {
                let mut out = start.data().to_vec();
                dot_general_accumulate(&a, &b, &dims, threads, &mut out).unwrap();
                close(
                    &Tensor::new(want.shape().to_vec(), out.clone()).unwrap(),
                    &sum,
                );
                match &first {
                    None => first = Some(out),
                    Some(f) => assert_eq!(&out, f, "threads {threads}"),
                }
            }
        }
        let (a, b) = (rand(&[5, 7], 1), rand(&[7, 3], 2));
        let mut short = vec![1.0f32; 14];
        assert!(dot_general_accumulate(&a, &b, &DotDims::matmul(2), 1, &mut short).is_err());
        assert!(short.iter().all(|&x| x == 1.0));
    }

    /// A result held in equal parts (a reduce-scatter bucket's segments) takes the product part
    /// by part when every part holds whole rows — rows of a plain product, and bands that
    /// cross batch entries — and is left untouched (`false`) when a part would cut a row.
    #[test]
    fn accumulating_into_parts_adds_each_part_its_rows_or_touches_nothing() {
        let wgrad = weight_gradient();
        let batched = DotDims {
            lhs_contracting: vec![2],
            rhs_contracting: vec![1],
            lhs_batch: vec![0],
            rhs_batch: vec![0],
        };
        // (lhs, rhs, dims, parts): the weight gradient [96, 80] in 4 parts of 24 rows; a batch
        // of 3 entries of 6 rows in 2 parts of 9 rows (each crossing an entry's end).
        let cases = [
            (vec![4, 64, 96], vec![4, 64, 80], wgrad.clone(), 4),
            (vec![3, 6, 70], vec![3, 70, 40], batched, 2),
            (vec![4, 64, 96], vec![4, 64, 80], wgrad.clone(), 1),
        ];
        for (i, (ls, rs, dims, p)) in cases.into_iter().enumerate() {
            let a = rand(&ls, 40 + i as u32);
            let b = rand(&rs, 50 + i as u32);
            let want = reference(&a, &b, &dims);
            let start = rand(want.shape(), 60 + i as u32);
            let mut first: Option<Vec<f32>> = None;
            for threads in [1, 2, 3] {
                let mut out = start.data().to_vec();
                let part = out.len() / p;
                let mut parts: Vec<&mut [f32]> = out.chunks_mut(part).collect();
                assert!(dot_general_accumulate_parts(&a, &b, &dims, threads, &mut parts).unwrap());
                for ((o, w), s) in out.iter().zip(want.data()).zip(start.data()) {
                    assert!((o - (w + s)).abs() <= 1e-4 * (1.0 + w.abs()), "case {i}");
                }
                match &first {
                    None => first = Some(out),
                    Some(f) => assert_eq!(&out, f, "case {i}, threads {threads}"),
                }
            }
        }
        // 96·80 elements in 3 parts of 2560: 32 rows of 80 each, whole rows; in 5 parts of 1536
        // (19.2 rows) a part would cut a row.
        let (a, b) = (rand(&[4, 64, 96], 1), rand(&[4, 64, 80], 2));
        let mut out = vec![1.0f32; 96 * 80];
        let mut parts: Vec<&mut [f32]> = out.chunks_mut(2560).collect();
        assert!(dot_general_accumulate_parts(&a, &b, &wgrad, 1, &mut parts).unwrap());
        let mut out = vec![1.0f32; 96 * 80];
        let mut parts: Vec<&mut [f32]> = out.chunks_mut(1536).collect();
        assert!(!dot_general_accumulate_parts(&a, &b, &wgrad, 1, &mut parts).unwrap());
        assert!(out.iter().all(|&x| x == 1.0), "nothing touched");
        // Parts that do not add up to the result are an error.
        let mut short = vec![1.0f32; 80];
        assert!(dot_general_accumulate_parts(&a, &b, &wgrad, 1, &mut [&mut short]).is_err());
    }

    /// Attention's operands batched over (B, H) of `[B, T, H, d]` are strided views: the result
    /// is the reference's, equal to multiplying explicitly transposed copies (to the bit on the
    /// portable kernel; another layout may take another BLAS kernel), and the same bits on 1 or
    /// 3 threads (the batch runs in parallel, one call per entry).
    #[test]
    fn strided_batch_dims_need_no_copy_and_do_not_depend_on_threads() {
        let (b, t, h, d) = (3, 17, 5, 7);
        let q = rand(&[b, t, h, d], 11);
        let k = rand(&[b, t, h, d], 12);
        let qk = DotDims {
            lhs_contracting: vec![3],
            rhs_contracting: vec![3],
            lhs_batch: vec![0, 2],
            rhs_batch: vec![0, 2],
        };
        let st = strides(q.shape());
        let stack = as_stack(&q, &[0, 2], &[1], &[3]).unwrap();
        assert!(
            matches!(stack.data, std::borrow::Cow::Borrowed(_)),
            "no copy"
        );
        assert_eq!(stack.batch, vec![(b, st[0] as isize), (h, st[2] as isize)]);
        let y = dot_general(&q, &k, &qk, 1).unwrap();
        close(&y, &reference(&q, &k, &qk));
        let qt = q.transpose(&[0, 2, 1, 3]).unwrap();
        let kt = k.transpose(&[0, 2, 1, 3]).unwrap();
        let contiguous = DotDims {
            lhs_contracting: vec![3],
            rhs_contracting: vec![3],
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 1],
        };
        crate::portable::assert_equal_across_routes(
            &dot_general(&qt, &kt, &contiguous, 1).unwrap(),
            &y,
            "transposed copies",
        );
        // probs·v over the key index, with v strided: [B,H,T,T]·[B,T,H,d]
        let p = rand(&[b, h, t, t], 13);
        let pv = DotDims {
            lhs_contracting: vec![3],
            rhs_contracting: vec![1],
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
        };
        let out = dot_general(&p, &k, &pv, 1).unwrap();
        close(&out, &reference(&p, &k, &pv));
        for threads in [2, 3, 8] {
            assert_eq!(dot_general(&q, &k, &qk, threads).unwrap(), y);
            assert_eq!(dot_general(&p, &k, &pv, threads).unwrap(), out);
        }
        // big enough that the batch loop runs in parallel
        let q = rand(&[2, 64, 8, 32], 14);
        let k = rand(&[2, 64, 8, 32], 15);
        let one = dot_general(&q, &k, &qk, 1).unwrap();
        close(&one, &reference(&q, &k, &qk));
        for threads in [2, 5] {
            assert_eq!(dot_general(&q, &k, &qk, threads).unwrap(), one);
        }
    }

    #[test]
    fn bad_dimension_numbers_are_errors() {
        let a = Tensor::zeros(&[2, 3]);
        let b = Tensor::zeros(&[4, 2]);
        assert!(dot_general(&a, &b, &DotDims::matmul(2), 1).is_err());
        let dup = DotDims {
            lhs_contracting: vec![1, 1],
            rhs_contracting: vec![0, 1],
            ..Default::default()
        };
        assert!(dot_general(&a, &Tensor::zeros(&[3, 3]), &dup, 1).is_err());
    }
}
