//! `dot_general`: batched matrix products over arbitrary batch and contracting dimensions, on
//! MKL or OpenBLAS when the machine has one and the `gemm` crate otherwise ([`crate::blas`]).
//!
//! Layout: the output is `[batch..., lhs free..., rhs free...]`, row-major. Each operand is viewed
//! as a strided `[B, M, K]` (lhs) or `[B, K, N]` (rhs) matrix stack *without copying* whenever
//! each group of dimensions (batch, free, contracting) is contiguous in memory in the order the
//! caller lists it — which covers `x·W`, `x·Wᵀ`, `xᵀ·dy` and the attention products (batch
//! dims keep one stride each, so `[B, T, H, d]` batched over B and H is a view too). Only other
//! layouts pay a transpose copy, which is O(size) next to the product's O(M·N·K).
//!
//! Here: [`DotDims`], the operand views as matrix stacks and the public products; in `views`:
//! the strided views the grouped products and fused attention multiply in place (the same
//! kernel calls, so the same bits); in `tests`: the triple-loop reference checks.

use gemm::Parallelism;

use crate::blas::Element;
use crate::operand::{Operand, Product, Store};

use crate::error::TensorError;
use crate::tensor::{strides, Tensor};

mod portable_route;
#[cfg(test)]
mod tests;
mod views;

pub(crate) use views::{gemm_views_accumulate, gemm_views_uninit, MatView};

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
pub(crate) struct MatStack<'a, T: Clone = f32> {
    pub(crate) data: std::borrow::Cow<'a, [T]>,
    batch: Vec<(usize, isize)>,
    pub(crate) rows: (usize, isize),
    pub(crate) cols: (usize, isize),
}

impl<T: Clone> MatStack<'_, T> {
    /// Batch entry 0 as a matrix of its data (where a packing kept with the tensor finds it)
    /// and as an operand reading it.
    pub(crate) fn first_matrix(&self) -> (crate::packings::MatrixAt, Operand<T>) {
        let at = crate::packings::MatrixAt {
            offset: self.offset(0),
            rs: self.rows.1,
            cs: self.cols.1,
            k: self.rows.0,
            n: self.cols.0,
        };
        let operand = Operand {
            // SAFETY: batch entry 0's offset lies inside the stack's data (its strides come
            // from its shape).
            ptr: unsafe { self.data.as_ptr().offset(at.offset) },
            rs: at.rs,
            cs: at.cs,
        };
        (at, operand)
    }

    /// The element offset of batch entry `i` (row-major over the batch dims).
    pub(crate) fn offset(&self, mut i: usize) -> isize {
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
    as_stack_of(t.shape(), t.data(), batch, rows, cols, |perm| {
        Ok(t.transpose(perm)?.into_data())
    })
}

/// [`as_stack`] for a row-major array of any element type of `shape` in `data`; `transpose`
/// copies it into the order of the given dimension permutation when its layout is not a view.
pub(crate) fn as_stack_of<'a, T: Clone>(
    shape: &[usize],
    data: &'a [T],
    batch: &[usize],
    rows: &[usize],
    cols: &[usize],
    transpose: impl FnOnce(&[usize]) -> Result<Vec<T>, TensorError>,
) -> Result<MatStack<'a, T>, TensorError> {
    let st = strides(shape);
    if let (Some(r), Some(c)) = (flatten(rows, shape, &st), flatten(cols, shape, &st)) {
        let batch = match flatten(batch, shape, &st) {
            Some(b) => vec![b],
            None => batch.iter().map(|&d| (shape[d], st[d] as isize)).collect(),
        };
        return Ok(MatStack {
            data: std::borrow::Cow::Borrowed(data),
            batch,
            rows: r,
            cols: c,
        });
    }
    // Copy into [batch, rows, cols] order.
    let perm: Vec<usize> = batch.iter().chain(rows).chain(cols).copied().collect();
    let moved = transpose(&perm)?;
    let size = |dims: &[usize]| dims.iter().map(|&d| shape[d]).product::<usize>();
    let (b, r, c) = (size(batch), size(rows), size(cols));
    Ok(MatStack {
        data: std::borrow::Cow::Owned(moved),
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
    let route = portable_route::route(rhs, &stacks, threads);
    // SAFETY: `products` (or the route's `product`) runs the kernel on every block of the
    // output, and the kernel writes every element of its block (or the whole output is
    // zero-filled for an empty contraction).
    let out = unsafe {
        crate::parallel::filled(len, |dst| match &route {
            Some((isa, panels)) => {
                portable_route::product(&stacks, (*isa, panels), threads, dst, Store::Overwrite)
            }
            None => products(&stacks, threads, stacks.all_rows(), dst, Store::Overwrite),
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
pub(crate) struct Stacks<'a, T: Clone = f32> {
    pub(crate) a: MatStack<'a, T>,
    pub(crate) b: MatStack<'a, T>,
    pub(crate) batch: usize,
}

impl<T: Clone> Stacks<'_, T> {
    /// Every row of the result seen as `[batch · m, n]`.
    pub(crate) fn all_rows(&self) -> std::ops::Range<usize> {
        0..self.batch * self.a.rows.0
    }
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
pub(crate) fn products<T: Element>(
    stacks: &Stacks<'_, T>,
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
            let p = Product {
                m: entry_rows.len(),
                n,
                k,
                a: Operand {
                    ptr: a
                        .data
                        .as_ptr()
                        .offset(a.offset(i) + entry_rows.start as isize * a.rows.1),
                    rs: a.rows.1,
                    cs: a.cols.1,
                },
                b: Operand {
                    ptr: b.data.as_ptr().offset(b.offset(i)),
                    rs: b.rows.1,
                    cs: b.cols.1,
                },
                dst: dst.as_mut_ptr().cast::<f32>(),
                ldc: n,
                store,
            };
            T::product(p, parallelism);
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
