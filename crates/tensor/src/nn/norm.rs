//! RMSNorm and its backward, and the standard-RoPE wrapper over [`crate::rope`].
//!
//! Invariants: a row's mean square is summed in the fixed lane order of `crate::fastmath`; the
//! scale's gradient is summed per fixed group of rows ([`super::rows_per_chunk`]) and the groups
//! in order, so its bits do not depend on the thread count.

use std::mem::MaybeUninit;

use super::{last_dim, rows_per_chunk, same_shape};
use crate::error::TensorError;
use crate::fastmath::{lane_sum2, lane_sum3, vectorized};
use crate::parallel::{filled, for_each_chunk2, kernel_threads, Work};
use crate::rope::{rope_with, Rope};
use crate::tensor::Tensor;

/// RMSNorm over the last dim: `y = x · rsqrt(mean(x²) + eps) · scale`. Returns `y` and each row's
/// `rsqrt(mean(x²) + eps)` for the backward.
///
/// # Errors
/// `scale` is not the last dim's length.
pub fn rms_norm(x: &Tensor, scale: &Tensor, eps: f32) -> Result<(Tensor, Vec<f32>), TensorError> {
    let _span = ferrotext_profile::span("rms_norm").map(|s| s.bytes((8 * x.len()) as f64));
    let n = last_dim(x, "rms_norm")?;
    if scale.shape() != [n] {
        return Err(TensorError::shape(
            "rms_norm",
            format!("scale {:?} for rows of {n}", scale.shape()),
        ));
    }
    let (y, inv) = rms_norm_slices::<f32, f32>(x.data(), scale.data(), eps, |v| v);
    Ok((Tensor::new(x.shape().to_vec(), y)?, inv))
}

/// Backward of [`rms_norm`]. With `n = x·r` (r the row's inverse RMS):
/// `dscale = Σ_rows dy ⊙ n`, `dx = r · (g − n · mean(g ⊙ n))` where `g = dy ⊙ scale`. `dscale`
/// sums each group of rows (as many as make about `BLOCK` elements) in row order, then the
/// groups in order: the same bits on any thread budget.
///
/// # Errors
/// Shapes disagree.
pub fn rms_norm_backward(
    x: &Tensor,
    scale: &Tensor,
    inv_rms: &[f32],
    dy: &Tensor,
) -> Result<(Tensor, Tensor), TensorError> {
    let _span =
        ferrotext_profile::span("rms_norm_backward").map(|s| s.bytes((12 * x.len()) as f64));
    same_shape(x, dy, "rms_norm_backward")?;
    let n = last_dim(x, "rms_norm_backward")?;
    statistics_fit(x.len(), n, scale, inv_rms, "rms_norm_backward")?;
    let (dx, dscale) =
        rms_norm_backward_slices::<f32, f32>((x.data(), dy.data()), scale.data(), inv_rms, |v| v);
    Ok((
        Tensor::new(x.shape().to_vec(), dx)?,
        Tensor::new(vec![n], dscale)?,
    ))
}

/// Checks that one row statistic per row of `len` elements in rows of `n`, and a scale of `n`,
/// go with the rows RMSNorm's backward (`op`) is given.
pub(crate) fn statistics_fit(
    len: usize,
    n: usize,
    scale: &Tensor,
    inv_rms: &[f32],
    op: &'static str,
) -> Result<(), TensorError> {
    if inv_rms.len() * n != len || scale.shape() != [n] {
        return Err(TensorError::shape(op, "row statistics do not fit".into()));
    }
    Ok(())
}

/// How a row kernel stores its `f32` results: `f32` as they are computed, bf16 (in
/// `crate::bf16`) computed into scratch and rounded a run of rows at a time (the rounding then
/// runs on AVX512_BF16 where the CPU has it; the same bits as rounding each element as it is
/// stored). The kernels hand over a whole chunk of rows: rounding a QK-norm row of 32 on its
/// own was a call, its setup and a wait on the row's chain of dependent operations (43% of the
/// kernel's samples in `perf`).
pub(crate) trait RowOut: Sized + Send {
    /// Scratch a chunk of rows keeps between its rows (none for `f32`).
    type Scratch: Default;

    /// `out` (one or more rows) written from `fill`, which writes every element of the `f32`
    /// rows it is given.
    fn store_row(
        out: &mut [MaybeUninit<Self>],
        scratch: &mut Self::Scratch,
        fill: impl FnOnce(&mut [MaybeUninit<f32>]),
    );
}

impl RowOut for f32 {
    type Scratch = ();

    #[inline(always)]
    fn store_row(
        out: &mut [MaybeUninit<f32>],
        _: &mut (),
        fill: impl FnOnce(&mut [MaybeUninit<f32>]),
    ) {
        fill(out);
    }
}

/// Elements of `f32` scratch a bf16 row kernel rounds at once, about (1 KiB: in L1 between
/// the kernel writing it and the rounding reading it).
const STORE_ELEMENTS: usize = 256;

/// Whole rows of `n` handed to one [`RowOut::store_row`]: about [`STORE_ELEMENTS`], at least one.
fn rows_per_store(n: usize) -> usize {
    (STORE_ELEMENTS / n.max(1)).max(1)
}

/// RMSNorm over rows of `scale.len()` elements of `x`: `y` and each row's inverse RMS — the
/// whole of [`rms_norm`] (`load` the identity, `Y = f32`) and of its bf16 form (`load` widens,
/// `Y = bf16` rounds), so the two share one arithmetic. One pass: each row read from `x`,
/// written into the output (no copy first, in `f32`); rows in groups of about `BLOCK`
/// elements, one vector-compiled call per group (a QK-norm row is only `head_dim` long), on
/// the kernel budget.
pub(crate) fn rms_norm_slices<X: Copy + Sync, Y: RowOut>(
    x: &[X],
    scale: &[f32],
    eps: f32,
    load: impl Fn(X) -> f32 + Copy + Sync,
) -> (Vec<Y>, Vec<f32>) {
    let n = scale.len().max(1);
    let rows = rows_per_chunk(n);
    let mut inv = vec![0.0f32; x.len() / n];
    // SAFETY: every chunk is visited, and each writes all `n` elements of each of its rows.
    let y = unsafe {
        filled(x.len(), |y| {
            for_each_chunk2(
                y,
                rows * n,
                &mut inv,
                rows,
                kernel_threads(),
                Work::Light,
                |c, out, r_out| {
                    let x = &x[c * rows * n..];
                    let mut scratch = Y::Scratch::default();
                    vectorized(
                        #[inline(always)]
                        || {
                            let group = rows_per_store(n);
                            for ((out, x), r_out) in out
                                .chunks_mut(group * n)
                                .zip(x.chunks(group * n))
                                .zip(r_out.chunks_mut(group))
                            {
                                Y::store_row(
                                    out,
                                    &mut scratch,
                                    #[inline(always)]
                                    |out| {
                                        for ((out, row), r_out) in
                                            out.chunks_mut(n).zip(x.chunks(n)).zip(r_out.iter_mut())
                                        {
                                            let ms = lane_sum2(row, row, |a, b| load(a) * load(b))
                                                / n as f32;
                                            let r = 1.0 / (ms + eps).sqrt();
                                            for ((o, &v), &s) in out.iter_mut().zip(row).zip(scale)
                                            {
                                                o.write(load(v) * (r * s));
                                            }
                                            *r_out = r;
                                        }
                                    },
                                );
                            }
                        },
                    );
                },
            )
        })
    };
    (y, inv)
}

/// The backward of [`rms_norm_slices`] (of [`rms_norm_backward`] and its bf16 form): `dx`, and
/// `dscale` summed per group of rows in row order, then the groups in order (a fixed order: the
/// groups depend only on the shape), so the same bits on any thread budget.
pub(crate) fn rms_norm_backward_slices<X: Copy + Sync, Y: RowOut>(
    (x, dy): (&[X], &[X]),
    scale: &[f32],
    inv_rms: &[f32],
    load: impl Fn(X) -> f32 + Copy + Sync,
) -> (Vec<Y>, Vec<f32>) {
    let n = scale.len().max(1);
    let rows = rows_per_chunk(n);
    let groups = inv_rms.len().div_ceil(rows);
    let mut partial = vec![0.0f32; groups * n];
    // SAFETY: every chunk is visited, and each writes all `n` elements of each of its rows.
    let dx = unsafe {
        filled(x.len(), |dx| {
            for_each_chunk2(
                dx,
                rows * n,
                &mut partial,
                n,
                kernel_threads(),
                Work::Light,
                |c, dxrows, ds| {
                    let first = c * rows;
                    let (x, dy) = (&x[first * n..], &dy[first * n..]);
                    let mut scratch = Y::Scratch::default();
                    vectorized(
                        #[inline(always)]
                        || {
                            let group = rows_per_store(n);
                            for (g, dxrows) in dxrows.chunks_mut(group * n).enumerate() {
                                let at = g * group * n;
                                let (x, dy) = (&x[at..], &dy[at..]);
                                let inv_rms = &inv_rms[first + g * group..];
                                Y::store_row(
                                    dxrows,
                                    &mut scratch,
                                    #[inline(always)]
                                    |dxrows| {
                                        for (((dxrow, xrow), dyrow), &r) in dxrows
                                            .chunks_mut(n)
                                            .zip(x.chunks(n))
                                            .zip(dy.chunks(n))
                                            .zip(inv_rms)
                                        {
                                            let mean_gn =
                                                lane_sum3(dyrow, scale, xrow, |d, sc, xv| {
                                                    load(d) * sc * (load(xv) * r)
                                                }) / n as f32;
                                            for ((((dx, ds), &d), &sc), &xv) in dxrow
                                                .iter_mut()
                                                .zip(ds.iter_mut())
                                                .zip(dyrow)
                                                .zip(scale)
                                                .zip(xrow)
                                            {
                                                let (d, xv) = (load(d), load(xv));
                                                dx.write(r * (d * sc - xv * r * mean_gn));
                                                *ds += d * (xv * r);
                                            }
                                        }
                                    },
                                );
                            }
                        },
                    );
                },
            )
        })
    };
    let mut dscale = vec![0.0f32; n];
    vectorized(
        #[inline(always)]
        || {
            for group in partial.chunks(n) {
                for (d, &p) in dscale.iter_mut().zip(group) {
                    *d += p;
                }
            }
        },
    );
    (dx, dscale)
}

/// Rotary position embedding, rotate-half form with base `theta` (see [`rope_with`]).
///
/// # Errors
/// As [`rope_with`].
pub fn rope(
    x: &Tensor,
    positions: &[usize],
    theta: f32,
    inverse: bool,
) -> Result<Tensor, TensorError> {
    rope_with(x, positions, &Rope::standard(theta), inverse)
}
