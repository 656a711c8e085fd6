//! Softmax over the last dimension, its causal (masked) form and their backward, as whole-tensor
//! kernels and as the row functions the fused attention reuses.
//!
//! Invariants: each row is stable (its max is subtracted first) and is computed by the same row
//! code on any thread; masked entries are exactly zero; the fused attention's bits equal these
//! kernels' because it calls the same row functions.

use super::{last_dim, same_shape};
use crate::error::TensorError;
use crate::fastmath::{exp, lane_max, lane_sum, lane_sum2, vectorized};
use crate::parallel::{for_each_chunk, kernel_threads, Work};
use crate::tensor::Tensor;

/// Softmax over the last dim, stable (the row max is subtracted first).
///
/// # Errors
/// An empty last dimension.
pub fn softmax_last(x: &Tensor) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("softmax_last").map(|s| s.bytes((8 * x.len()) as f64));
    let n = last_dim(x, "softmax")?;
    let mut y = x.clone();
    for_each_chunk(y.data_mut(), n, kernel_threads(), Work::Heavy, |_, row| {
        softmax_row(row)
    });
    Ok(y)
}

/// One row of [`softmax_last`], in place.
fn softmax_row(row: &mut [f32]) {
    // The max, the exponentials and their sum (in lanes), then the scaling: vector passes.
    vectorized(
        #[inline(always)]
        || {
            let max = lane_max(row);
            row.iter_mut().for_each(|v| *v = exp(*v - max));
            let inv = 1.0 / lane_sum(row);
            row.iter_mut().for_each(|v| *v *= inv);
        },
    );
}

/// Causal softmax over the last dim of `scale·x` for `x: [.., Tq, Tk]` with `Tk ≥ Tq`: the
/// queries are the last `Tq` of the `Tk` key positions (bottom-right aligned), so row `i` of
/// each block attends to columns `0..=Tk−Tq+i` and the rest become exact zeros. Square blocks
/// are training's mask; `Tq < Tk` is a decoder step over a key/value cache. Fusing the mask and
/// the `1/√d` scale saves two passes over the scores and a `-∞` bias the size of the scores.
///
/// # Errors
/// Rank below 2, or fewer keys than queries.
pub fn causal_softmax(x: &Tensor, scale: f32) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("causal_softmax").map(|s| s.bytes((8 * x.len()) as f64));
    let r = x.rank();
    if r < 2 || x.shape()[r - 1] < x.shape()[r - 2] {
        return Err(TensorError::shape(
            "causal_softmax",
            format!("needs [.., Tq, Tk] with Tk ≥ Tq, got {:?}", x.shape()),
        ));
    }
    let (tq, tk) = (x.shape()[r - 2], x.shape()[r - 1]);
    let past = tk - tq;
    let mut y = x.clone();
    for_each_chunk(y.data_mut(), tk, kernel_threads(), Work::Heavy, |k, row| {
        causal_softmax_row(row, past + k % tq + 1, scale);
    });
    Ok(y)
}

/// One row of [`causal_softmax`] in place: softmax of `scale·row[..keep]`, zeros after.
fn causal_softmax_row(row: &mut [f32], keep: usize, scale: f32) {
    let (live, masked) = row.split_at_mut(keep);
    vectorized(
        #[inline(always)]
        || {
            let max = lane_max(live);
            live.iter_mut().for_each(|v| *v = exp((*v - max) * scale));
            let inv = 1.0 / lane_sum(live);
            live.iter_mut().for_each(|v| *v *= inv);
        },
    );
    masked.fill(0.0);
}

/// Backward of `y = softmax(x)`: `dx = y ⊙ (dy − Σⱼ dyⱼ·yⱼ)` per row (with `scale` = 1; the
/// backward of [`causal_softmax`] passes its scale, and its masked entries have `y = 0`).
///
/// # Errors
/// Shapes differ.
pub fn softmax_last_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor, TensorError> {
    let _span =
        ferrotext_profile::span("softmax_last_backward").map(|s| s.bytes((12 * y.len()) as f64));
    softmax_backward_scaled(y, dy, 1.0)
}

/// Backward of `y = softmax(scale·x)`: `dx = scale · y ⊙ (dy − Σⱼ dyⱼ·yⱼ)` per row.
///
/// # Errors
/// Shapes differ.
pub fn softmax_backward_scaled(y: &Tensor, dy: &Tensor, scale: f32) -> Result<Tensor, TensorError> {
    let _span =
        ferrotext_profile::span("softmax_backward_scaled").map(|s| s.bytes((12 * y.len()) as f64));
    same_shape(y, dy, "softmax_backward")?;
    let n = last_dim(y, "softmax_backward")?;
    let mut dx = dy.clone();
    for_each_chunk(
        dx.data_mut(),
        n,
        kernel_threads(),
        Work::Light,
        |i, drow| {
            softmax_backward_row(drow, &y.data()[i * n..(i + 1) * n], scale);
        },
    );
    Ok(dx)
}

/// One row of [`softmax_backward_scaled`]: `drow` holds dy and becomes dx.
fn softmax_backward_row(drow: &mut [f32], yrow: &[f32], scale: f32) {
    vectorized(
        #[inline(always)]
        || {
            let dot = lane_sum2(drow, yrow, |d, y| d * y);
            for (d, &yv) in drow.iter_mut().zip(yrow) {
                *d = scale * yv * (*d - dot);
            }
        },
    );
}
