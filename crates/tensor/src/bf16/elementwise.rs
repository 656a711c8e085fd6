//! Elementwise maps and equal-shape binary ops on bf16 tensors: each element widened, the `f32`
//! function applied, the result rounded once.
//!
//! Invariant: the output is, bit for bit, `round_bf16` of [`Tensor::map`] (or
//! [`Tensor::zip_with`]) with the same function on the widened inputs: the same IEEE operations
//! per element, in fixed blocks on the kernel thread budget, compiled for AVX-512 alike. Shapes
//! must be equal (a broadcast goes through the `f32` op: the callers widen for it).

use super::{rounded_blocks, widen_bf16, Bf16Tensor};
use crate::error::TensorError;
use crate::fastmath::vectorized;
use crate::parallel::{filled, for_each_chunk, kernel_threads, Work};

/// Elements per block on the kernel thread budget (as `f32` maps).
const BLOCK: usize = 1 << 14;

/// `f(x)` for every element of bf16 `x`, in `f32` on the widened value, rounded to bf16.
pub fn map_bf16(x: &Bf16Tensor, f: impl Fn(f32) -> f32 + Sync) -> Bf16Tensor {
    let _span = ferrotext_profile::span("elementwise_bf16").map(|s| s.bytes((4 * x.len()) as f64));
    // SAFETY: the blocks cover the output, and `x` is as long, so each writes all of its own.
    let data = unsafe {
        filled(x.len(), |data| {
            for_each_chunk(data, BLOCK, kernel_threads(), Work::Light, |c, run| {
                rounded_blocks(run, |at, block| {
                    let src = &x.data()[c * BLOCK + at..];
                    vectorized(
                        #[inline(always)]
                        || {
                            for (o, &v) in block.iter_mut().zip(src) {
                                *o = f(widen_bf16(v));
                            }
                        },
                    );
                });
            })
        })
    };
    // The data has the shape's element count: it is `x`'s.
    Bf16Tensor {
        shape: x.shape().to_vec(),
        data: std::sync::Arc::new(data),
        packings: None,
    }
}

/// `f(a, b)` elementwise for bf16 tensors of one shape, in `f32` on the widened values, rounded
/// to bf16.
///
/// # Errors
/// The shapes differ (no broadcasting here).
pub fn zip_bf16(
    a: &Bf16Tensor,
    b: &Bf16Tensor,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Result<Bf16Tensor, TensorError> {
    if a.shape() != b.shape() {
        return Err(TensorError::shape(
            "zip_bf16",
            format!("{:?} vs {:?} (equal shapes only)", a.shape(), b.shape()),
        ));
    }
    let _span = ferrotext_profile::span("elementwise_bf16")
        .map(|s| s.bytes((6 * a.len().max(b.len())) as f64));
    // SAFETY: the blocks cover the output, and `a`, `b` are as long, so each writes all of its
    // own.
    let data = unsafe {
        filled(a.len(), |data| {
            for_each_chunk(data, BLOCK, kernel_threads(), Work::Light, |c, run| {
                rounded_blocks(run, |at, block| {
                    let from = c * BLOCK + at;
                    let (x, y) = (&a.data()[from..], &b.data()[from..]);
                    vectorized(
                        #[inline(always)]
                        || {
                            for ((o, &p), &q) in block.iter_mut().zip(x).zip(y) {
                                *o = f(widen_bf16(p), widen_bf16(q));
                            }
                        },
                    );
                });
            })
        })
    };
    Bf16Tensor::new(a.shape().to_vec(), data)
}

/// `a ⊙ b` elementwise on bf16 tensors of one shape (the product in `f32`, rounded).
///
/// # Errors
/// As [`zip_bf16`].
pub fn mul_bf16(a: &Bf16Tensor, b: &Bf16Tensor) -> Result<Bf16Tensor, TensorError> {
    zip_bf16(a, b, |p, q| p * q)
}

/// `k·x` elementwise on a bf16 tensor (the product in `f32`, rounded).
pub fn scale_bf16(x: &Bf16Tensor, k: f32) -> Bf16Tensor {
    map_bf16(x, |v| k * v)
}
