//! The activations: SwiGLU (`silu(g) ⊙ u`) and SiLU, each with its backward.
//!
//! Invariants: elementwise over fixed blocks of [`super::BLOCK`] elements, one pass forward and
//! one backward, no allocation inside the loops; every element's arithmetic is independent of
//! the split, so the bits do not depend on the thread count.

use super::{same_shape, BLOCK};
use crate::error::TensorError;
use crate::fastmath::{sigmoid, vectorized};
use crate::parallel::{filled, for_each_chunk, for_each_chunk2, kernel_threads, Work};
use crate::tensor::Tensor;

/// One element of [`swiglu`]: `silu(g)·u`. Shared with the bf16 kernel, so both compute the
/// same bits from the same `f32` inputs.
#[inline(always)]
pub(crate) fn swiglu_value(g: f32, u: f32) -> f32 {
    g * sigmoid(g) * u
}

/// One element of [`swiglu_backward`]: `(dg, du)` for `g`, `u` and the output cotangent `dy`.
/// Shared with the bf16 kernel, as [`swiglu_value`].
#[inline(always)]
pub(crate) fn swiglu_grads(g: f32, u: f32, dy: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s)
}

/// The SwiGLU activation `silu(g) ⊙ u`, one pass.
///
/// # Errors
/// Shapes differ.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("swiglu").map(|s| s.bytes((12 * g.len()) as f64));
    same_shape(g, u, "swiglu")?;
    // SAFETY: every block is visited, and `g` and `u` are as long as the output, so each
    // writes all its elements.
    let y = unsafe {
        filled(g.len(), |y| {
            for_each_chunk(y, BLOCK, kernel_threads(), Work::Heavy, |c, out| {
                let (gs, us) = (&g.data()[c * BLOCK..], &u.data()[c * BLOCK..]);
                vectorized(
                    #[inline(always)]
                    || {
                        for ((o, &a), &b) in out.iter_mut().zip(gs).zip(us) {
                            o.write(swiglu_value(a, b));
                        }
                    },
                );
            })
        })
    };
    Tensor::new(g.shape().to_vec(), y)
}

/// Backward of [`swiglu`], one pass: `dg = dy·u·silu'(g)`, `du = dy·silu(g)`.
///
/// # Errors
/// Shapes differ.
pub fn swiglu_backward(
    g: &Tensor,
    u: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor), TensorError> {
    let _span = ferrotext_profile::span("swiglu_backward").map(|s| s.bytes((20 * g.len()) as f64));
    same_shape(g, u, "swiglu_backward")?;
    same_shape(g, dy, "swiglu_backward")?;
    let n = g.len();
    let mut du: Vec<f32> = Vec::with_capacity(n);
    // SAFETY: every block of both outputs is visited, and `g`, `u` and `dy` are as long as
    // they are, so each block writes all its elements of `dg` and of `du` (whose length is set
    // only after).
    let dg = unsafe {
        filled(n, |dg| {
            for_each_chunk2(
                dg,
                BLOCK,
                &mut du.spare_capacity_mut()[..n],
                BLOCK,
                kernel_threads(),
                Work::Heavy,
                |c, dgs, dus| {
                    let at = c * BLOCK;
                    let (gs, us, dys) = (&g.data()[at..], &u.data()[at..], &dy.data()[at..]);
                    vectorized(
                        #[inline(always)]
                        || {
                            for (i, (dg, du)) in dgs.iter_mut().zip(dus.iter_mut()).enumerate() {
                                let (g, u) = swiglu_grads(gs[i], us[i], dys[i]);
                                dg.write(g);
                                du.write(u);
                            }
                        },
                    );
                },
            )
        })
    };
    // SAFETY: as above, every element of `du` was written.
    unsafe { du.set_len(n) };
    Ok((
        Tensor::new(g.shape().to_vec(), dg)?,
        Tensor::new(g.shape().to_vec(), du)?,
    ))
}

/// `silu(x) = x·σ(x)`.
pub fn silu(x: &Tensor) -> Tensor {
    let _span = ferrotext_profile::span("silu").map(|s| s.bytes((8 * x.len()) as f64));
    let mut y = x.clone();
    for_each_chunk(
        y.data_mut(),
        BLOCK,
        kernel_threads(),
        Work::Heavy,
        |_, c| {
            vectorized(
                #[inline(always)]
                || c.iter_mut().for_each(|v| *v *= sigmoid(*v)),
            )
        },
    );
    y
}

/// Backward of [`silu`]: `dx = dy · σ(x)·(1 + x·(1 − σ(x)))`.
///
/// # Errors
/// Shapes differ.
pub fn silu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("silu_backward").map(|s| s.bytes((12 * x.len()) as f64));
    let f = |v: f32, d: f32| {
        let s = sigmoid(v);
        d * s * (1.0 + v * (1.0 - s))
    };
    if x.shape() != dy.shape() {
        return x.zip_with(dy, f); // broadcasting: the general path
    }
    let mut dx = dy.clone();
    for_each_chunk(
        dx.data_mut(),
        BLOCK,
        kernel_threads(),
        Work::Heavy,
        |c, ds| {
            vectorized(
                #[inline(always)]
                || {
                    for (d, &v) in ds.iter_mut().zip(&x.data()[c * BLOCK..]) {
                        *d = f(v, *d);
                    }
                },
            )
        },
    );
    Ok(dx)
}
