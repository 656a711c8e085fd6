//! The activations: the gated units SwiGLU (`silu(g) ⊙ u`) and GeGLU (`gelu_tanh(g) ⊙ u`), and
//! SiLU, each with its backward.
//!
//! Invariants: elementwise over fixed blocks of [`super::BLOCK`] elements, one pass forward and
//! one backward, no allocation inside the loops; every element's arithmetic is independent of
//! the split, so the bits do not depend on the thread count.

use super::{same_shape, BLOCK};
use crate::error::TensorError;
use crate::fastmath::{sigmoid, vectorized};
use crate::parallel::{filled, for_each_chunk, for_each_chunk2, kernel_threads, Work};
use crate::tensor::Tensor;

/// The activation of a gated MLP unit `act(g) ⊙ u`: SwiGLU's SiLU or GeGLU's GELU in its tanh
/// form (Gemma's `gelu_pytorch_tanh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GluActivation {
    /// `silu(g) = g·σ(g)`.
    Silu,
    /// `gelu(g) = ½g(1 + tanh(√(2/π)(g + 0.044715g³)))`, computed as `g·σ(2√(2/π)(g +
    /// 0.044715g³))` (the same function: `½(1 + tanh y) = σ(2y)`), on the vectorized `exp`.
    GeluTanh,
}

impl GluActivation {
    /// The unit's name, as its op and its kernels' profiler spans carry it: `swiglu`, `geglu`.
    pub fn name(self) -> &'static str {
        match self {
            GluActivation::Silu => "swiglu",
            GluActivation::GeluTanh => "geglu",
        }
    }

    /// The profiler's names of the forward and backward kernels ([`GluActivation::name`], and
    /// `swiglu_backward`, `geglu_backward`).
    pub(crate) fn span_names(self) -> (&'static str, &'static str) {
        let backward = match self {
            GluActivation::Silu => "swiglu_backward",
            GluActivation::GeluTanh => "geglu_backward",
        };
        (self.name(), backward)
    }
}

/// `√(2/π)`, the tanh GELU's factor.
const GELU_K: f32 = 0.797_884_6;
/// The tanh GELU's cubic coefficient.
const GELU_C: f32 = 0.044_715;

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

/// One element of GeGLU: `gelu(g)·u` with `gelu(g) = g·σ(z)`, `z = 2√(2/π)(g + 0.044715g³)`.
/// Shared with the bf16 kernel.
#[inline(always)]
pub(crate) fn geglu_value(g: f32, u: f32) -> f32 {
    let z = 2.0 * GELU_K * (g + GELU_C * g * g * g);
    g * sigmoid(z) * u
}

/// One element of GeGLU's backward: `dg = dy·u·gelu'(g)` with `gelu'(g) = s·(1 + g·(1 −
/// s)·2√(2/π)(1 + 3·0.044715g²))`, `s = σ(z)`, and `du = dy·gelu(g)`. Shared with the bf16
/// kernel.
#[inline(always)]
pub(crate) fn geglu_grads(g: f32, u: f32, dy: f32) -> (f32, f32) {
    let z = 2.0 * GELU_K * (g + GELU_C * g * g * g);
    let s = sigmoid(z);
    let dz = 2.0 * GELU_K * (1.0 + 3.0 * GELU_C * g * g);
    (dy * u * s * (1.0 + g * (1.0 - s) * dz), dy * g * s)
}

/// The SwiGLU activation `silu(g) ⊙ u`, one pass ([`glu`] with [`GluActivation::Silu`]).
///
/// # Errors
/// Shapes differ.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor, TensorError> {
    glu(g, u, GluActivation::Silu)
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
    glu_backward(g, u, dy, GluActivation::Silu)
}

/// A gated unit's activation `act(g) ⊙ u`, one pass over `g` and `u` (no `act(g)` stored).
///
/// # Errors
/// Shapes differ.
pub fn glu(g: &Tensor, u: &Tensor, act: GluActivation) -> Result<Tensor, TensorError> {
    match act {
        GluActivation::Silu => glu_with(g, u, act, swiglu_value),
        GluActivation::GeluTanh => glu_with(g, u, act, geglu_value),
    }
}

/// Backward of [`glu`], one pass: `dg = dy·u·act'(g)`, `du = dy·act(g)`.
///
/// # Errors
/// Shapes differ.
pub fn glu_backward(
    g: &Tensor,
    u: &Tensor,
    dy: &Tensor,
    act: GluActivation,
) -> Result<(Tensor, Tensor), TensorError> {
    match act {
        GluActivation::Silu => glu_backward_with(g, u, dy, act, swiglu_grads),
        GluActivation::GeluTanh => glu_backward_with(g, u, dy, act, geglu_grads),
    }
}

/// [`glu`] with `act`'s element function `value` (monomorphized, so the loop vectorizes).
fn glu_with(
    g: &Tensor,
    u: &Tensor,
    act: GluActivation,
    value: impl Fn(f32, f32) -> f32 + Copy + Sync,
) -> Result<Tensor, TensorError> {
    let name = act.span_names().0;
    let _span = ferrotext_profile::span(name).map(|s| s.bytes((12 * g.len()) as f64));
    same_shape(g, u, name)?;
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
                            o.write(value(a, b));
                        }
                    },
                );
            })
        })
    };
    Tensor::new(g.shape().to_vec(), y)
}

/// [`glu_backward`] with `act`'s element function `grads`.
fn glu_backward_with(
    g: &Tensor,
    u: &Tensor,
    dy: &Tensor,
    act: GluActivation,
    grads: impl Fn(f32, f32, f32) -> (f32, f32) + Copy + Sync,
) -> Result<(Tensor, Tensor), TensorError> {
    let name = act.span_names().1;
    let _span = ferrotext_profile::span(name).map(|s| s.bytes((20 * g.len()) as f64));
    same_shape(g, u, name)?;
    same_shape(g, dy, name)?;
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
                                let (g, u) = grads(gs[i], us[i], dys[i]);
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
