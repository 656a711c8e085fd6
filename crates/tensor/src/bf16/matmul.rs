//! bf16 × bf16 → f32 products: [`dot_general_bf16`] on MKL's `cblas_gemm_bf16bf16f32` or
//! OpenBLAS's `cblas_sbgemm` when the process's library has it, else on the portable kernel
//! with bf16 panels widened as they are packed.
//!
//! Invariants:
//! * The bf16 kernel follows the `f32` one ([`crate::matmul_kernel`]), chosen once per
//!   process: a library with a bf16 product runs it; the portable kernel runs bf16 too (its bits
//!   are those of the `f32` portable product of the widened operands); a library without one
//!   (`gemm`, an OpenBLAS built without `BUILD_BFLOAT16`) hands bf16 products to the portable
//!   kernel when it was picked automatically, and refuses them ([`TensorError::NoBf16Product`])
//!   when `FERROTEXT_MATMUL` named it, unless [`allow_bf16_fallback`] came first.
//! * The operand views, batch handling and threading are `dot_general`'s (the same code, generic
//!   over the element), so the layouts that avoid a copy are the same.

use std::sync::OnceLock;

use half::bf16;

use super::{permuted, Bf16Tensor};
use crate::blas::{kernel, Kernel, Store};
use crate::error::TensorError;
use crate::matmul::{as_stack_of, products, DotDims, Stacks};
use crate::parallel::filled;
use crate::portable::Isa;
use crate::tensor::Tensor;

/// Which kernel computes this process's bf16 products.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// The library's own bf16 product: its description and the symbol.
    Library(String, &'static str),
    /// The portable kernel, widening bf16 to f32: because it is the process's kernel (`None`),
    /// or in place of a kernel without a bf16 product (its description).
    Portable(Isa, Option<String>),
    /// A kernel without a bf16 product that the user named: its description.
    Refused(String),
}

impl Choice {
    fn describe(&self) -> Result<String, TensorError> {
        match self {
            Choice::Library(what, symbol) => Ok(format!("{what}: {symbol}")),
            Choice::Portable(isa, None) => Ok(format!(
                "the portable kernel ({}, fixed order), bf16 widened to f32",
                isa.name()
            )),
            Choice::Portable(isa, Some(instead)) => Ok(format!(
                "the portable kernel ({}, fixed order), bf16 widened to f32, as {instead} has no \
                 bf16 product",
                isa.name()
            )),
            Choice::Refused(kernel) => Err(TensorError::NoBf16Product {
                kernel: kernel.clone(),
            }),
        }
    }
}

/// The bf16 kernel for the process's `f32` kernel: `named` says the user chose that kernel
/// (`FERROTEXT_MATMUL`), `fallback` that they allow the portable kernel in its place.
pub(crate) fn choose(kernel: &Kernel, named: bool, fallback: bool) -> Choice {
    match kernel {
        Kernel::Blas(blas) => match blas.bf16 {
            Some((_, symbol)) => Choice::Library(blas.description.clone(), symbol),
            None if named && !fallback => Choice::Refused(kernel.describe()),
            None => Choice::Portable(Isa::detect(), Some(kernel.describe())),
        },
        Kernel::Portable(isa) => Choice::Portable(*isa, None),
        Kernel::Gemm if named && !fallback => Choice::Refused(kernel.describe()),
        Kernel::Gemm => Choice::Portable(Isa::detect(), Some(kernel.describe())),
    }
}

static CHOICE: OnceLock<Choice> = OnceLock::new();

/// True when `FERROTEXT_MATMUL` names a kernel.
fn named() -> bool {
    std::env::var("FERROTEXT_MATMUL").is_ok_and(|v| !v.is_empty())
}

fn choice(fallback: bool) -> &'static Choice {
    CHOICE.get_or_init(|| choose(kernel(), named(), fallback))
}

/// What computes this process's bf16 products, for run headers and benchmarks: `Intel MKL
/// 2026.2 (sequential, one thread per call): cblas_gemm_bf16bf16f32`, or the portable kernel
/// (saying which kernel it stands in for).
///
/// # Errors
/// [`TensorError::NoBf16Product`]: `FERROTEXT_MATMUL` named a kernel without a bf16 product
/// and [`allow_bf16_fallback`] was not called first.
pub fn bf16_matmul_kernel() -> Result<String, TensorError> {
    choice(false).describe()
}

/// Lets bf16 products run on the portable kernel when `FERROTEXT_MATMUL` named a kernel that
/// has no bf16 product (what a user asks for explicitly). Call it before any bf16 product;
/// calling it again is harmless. Returns what will compute bf16 products.
///
/// # Errors
/// [`TensorError::NoBf16Product`]: a bf16 product (or [`bf16_matmul_kernel`]) already fixed
/// the choice as refused.
pub fn allow_bf16_fallback() -> Result<String, TensorError> {
    choice(true).describe()
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

/// The profiler's span for a bf16 product (2 bytes an operand element, 4 an output one).
fn span(s: &Stacks<'_, bf16>, lhs: &[usize], rhs: &[usize]) -> Option<ferrotext_profile::Span> {
    let (m, k, n, batch) = (s.a.rows.0, s.a.cols.0, s.b.cols.0, s.batch);
    ferrotext_profile::span("dot_general_bf16").map(|span| {
        span.flops(2.0 * (batch * m * n) as f64 * k as f64)
            .bytes((batch * (2 * (m * k + k * n) + 4 * m * n)) as f64)
            .shapes(|| format!("bf16{lhs:?} x bf16{rhs:?}"))
    })
}

/// `dot_general` of bf16 operands, accumulated and returned in `f32`: the output is `[batch...,
/// lhs free..., rhs free...]`, on up to `threads` threads, on [`bf16_matmul_kernel`]'s kernel.
/// Each element differs from the `f32` `dot_general` of the widened operands only by the order
/// of addition (every widened product is exact in `f32`); on the portable kernel not at all.
///
/// # Errors
/// [`TensorError::Shape`] when the dimension numbers do not fit the shapes;
/// [`TensorError::NoBf16Product`] as [`bf16_matmul_kernel`].
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
    let _span = span(&stacks, lhs.shape(), rhs.shape());
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
    let _span = span(&stacks, lhs.shape(), rhs.shape());
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

#[cfg(test)]
mod tests;
