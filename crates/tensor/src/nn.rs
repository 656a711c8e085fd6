//! The model kernels, each forward next to its backward: softmax, RMSNorm, RoPE, SiLU,
//! cross-entropy with a token mask, gather / scatter-add along an axis, top-k.
//!
//! Layouts are row-major; "rows" are every dimension but the last. These are memory-bound loops:
//! one pass over the data for the forward, one or two for the backward; no allocation inside
//! the row loops. They run on this thread's kernel budget ([`crate::set_kernel_threads`]),
//! rows (or fixed blocks of elements) split across tasks; every row is computed by the same
//! code on any thread and sums across rows run in row order afterwards, so the bits do not
//! depend on the thread count.

use crate::error::TensorError;
use crate::fastmath::{
    exp, lane_max, lane_sum, lane_sum2, lane_sum3, lane_sum_f64, sigmoid, vectorized,
};
use crate::parallel::{filled, for_each_chunk, for_each_chunk2, kernel_threads, Work};
use crate::rope::{rope_with, Rope};
use crate::tensor::Tensor;

fn last_dim(x: &Tensor, op: &'static str) -> Result<usize, TensorError> {
    match x.shape().last() {
        Some(&n) if n > 0 => Ok(n),
        _ => Err(TensorError::shape(
            op,
            format!("needs a non-empty last dimension, got {:?}", x.shape()),
        )),
    }
}

fn same_shape(a: &Tensor, b: &Tensor, op: &'static str) -> Result<(), TensorError> {
    if a.shape() != b.shape() {
        return Err(TensorError::shape(
            op,
            format!("{:?} vs {:?}", a.shape(), b.shape()),
        ));
    }
    Ok(())
}

/// Softmax over the last dim, stable (the row max is subtracted first).
///
/// # Errors
/// An empty last dimension.
pub fn softmax_last(x: &Tensor) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("softmax_last");
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
    let _span = ferrotext_profile::span("causal_softmax");
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
pub(crate) fn causal_softmax_row(row: &mut [f32], keep: usize, scale: f32) {
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
    let _span = ferrotext_profile::span("softmax_last_backward");
    softmax_backward_scaled(y, dy, 1.0)
}

/// Backward of `y = softmax(scale·x)`: `dx = scale · y ⊙ (dy − Σⱼ dyⱼ·yⱼ)` per row.
///
/// # Errors
/// Shapes differ.
pub fn softmax_backward_scaled(y: &Tensor, dy: &Tensor, scale: f32) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("softmax_backward_scaled");
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
pub(crate) fn softmax_backward_row(drow: &mut [f32], yrow: &[f32], scale: f32) {
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

/// RMSNorm over the last dim: `y = x · rsqrt(mean(x²) + eps) · scale`. Returns `y` and each row's
/// `rsqrt(mean(x²) + eps)` for the backward.
///
/// # Errors
/// `scale` is not the last dim's length.
pub fn rms_norm(x: &Tensor, scale: &Tensor, eps: f32) -> Result<(Tensor, Vec<f32>), TensorError> {
    let _span = ferrotext_profile::span("rms_norm");
    let n = last_dim(x, "rms_norm")?;
    if scale.shape() != [n] {
        return Err(TensorError::shape(
            "rms_norm",
            format!("scale {:?} for rows of {n}", scale.shape()),
        ));
    }
    let mut inv = vec![0.0f32; x.len() / n];
    // One pass: each row read from `x`, written into the output (no copy of `x` first); rows in
    // groups of about `BLOCK` elements, one vector-compiled call per group (a QK-norm row is
    // only `head_dim` long).
    let rows = rows_per_chunk(n);
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
                    let x = &x.data()[c * rows * n..];
                    vectorized(
                        #[inline(always)]
                        || {
                            for ((out, row), r_out) in
                                out.chunks_mut(n).zip(x.chunks(n)).zip(r_out.iter_mut())
                            {
                                let ms = lane_sum2(row, row, |a, b| a * b) / n as f32;
                                let r = 1.0 / (ms + eps).sqrt();
                                for ((o, &v), &s) in out.iter_mut().zip(row).zip(scale.data()) {
                                    o.write(v * (r * s));
                                }
                                *r_out = r;
                            }
                        },
                    );
                },
            )
        })
    };
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
    let _span = ferrotext_profile::span("rms_norm_backward");
    same_shape(x, dy, "rms_norm_backward")?;
    let n = last_dim(x, "rms_norm_backward")?;
    if inv_rms.len() * n != x.len() || scale.shape() != [n] {
        return Err(TensorError::shape(
            "rms_norm_backward",
            "row statistics do not fit".into(),
        ));
    }
    let s = scale.data();
    // One pass: rows in groups (as in `rms_norm`) split across the budget; each group writes its
    // rows of dx and sums its rows' `dy ⊙ n` into a partial dscale of its own (in row order).
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
                    let (x, dy) = (&x.data()[first * n..], &dy.data()[first * n..]);
                    vectorized(
                        #[inline(always)]
                        || {
                            for (((dxrow, xrow), dyrow), &r) in dxrows
                                .chunks_mut(n)
                                .zip(x.chunks(n))
                                .zip(dy.chunks(n))
                                .zip(&inv_rms[first..])
                            {
                                let mean_gn =
                                    lane_sum3(dyrow, s, xrow, |d, sc, xv| d * sc * (xv * r))
                                        / n as f32;
                                for ((((dx, ds), &d), &sc), &xv) in dxrow
                                    .iter_mut()
                                    .zip(ds.iter_mut())
                                    .zip(dyrow)
                                    .zip(s)
                                    .zip(xrow)
                                {
                                    dx.write(r * (d * sc - xv * r * mean_gn));
                                    *ds += d * (xv * r);
                                }
                            }
                        },
                    );
                },
            )
        })
    };
    let dx = Tensor::new(x.shape().to_vec(), dx)?;
    // dscale: the groups' partial sums added in group order (a fixed order: the groups depend
    // only on the shape).
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
    Ok((dx, Tensor::new(vec![n], dscale)?))
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

/// The SwiGLU activation `silu(g) ⊙ u`, one pass.
///
/// # Errors
/// Shapes differ.
pub fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("swiglu");
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
                            o.write(a * sigmoid(a) * b);
                        }
                    },
                );
            })
        })
    };
    Tensor::new(g.shape().to_vec(), y)
}

/// Elementwise kernels split their data into blocks of this many elements (a fixed size, so
/// the split never depends on the thread count).
const BLOCK: usize = 4096;

/// Rows of `n` elements a row kernel takes per chunk: about [`BLOCK`] elements, at least one
/// row, so short rows (QK-norm's `head_dim`) share one call instead of paying one each.
fn rows_per_chunk(n: usize) -> usize {
    (BLOCK / n.max(1)).max(1)
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
    let _span = ferrotext_profile::span("swiglu_backward");
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
                                let (a, b, d) = (gs[i], us[i], dys[i]);
                                let s = sigmoid(a);
                                dg.write(d * b * s * (1.0 + a * (1.0 - s)));
                                du.write(d * a * s);
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
    let _span = ferrotext_profile::span("silu");
    let mut y = x.clone();
    for_each_chunk(
        y.data_mut(),
        BLOCK,
        kernel_threads(),
        Work::Heavy,
        |_, c| {
            c.iter_mut().for_each(|v| *v *= sigmoid(*v));
        },
    );
    y
}

/// Backward of [`silu`]: `dx = dy · σ(x)·(1 + x·(1 − σ(x)))`.
///
/// # Errors
/// Shapes differ.
pub fn silu_backward(x: &Tensor, dy: &Tensor) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("silu_backward");
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
            for (d, &v) in ds.iter_mut().zip(&x.data()[c * BLOCK..]) {
                *d = f(v, *d);
            }
        },
    );
    Ok(dx)
}

/// What [`cross_entropy`] returns: the masked loss sum (cross-entropy plus z-loss), the token
/// count (sum of the mask), and what the backward needs (softmax probabilities, each row's
/// log-partition `log Z`).
#[derive(Clone, Debug)]
pub struct CrossEntropy {
    /// Σ mask·(log Z − logit\[target\] + z_loss·(log Z)²).
    pub loss_sum: f32,
    /// Σ mask.
    pub count: f32,
    /// softmax(logits).
    pub probs: Tensor,
    /// log Z per row.
    pub log_z: Vec<f32>,
}

/// Cross-entropy of `logits: [N, V]` against `targets` (N class ids), weighted by `mask` (N
/// weights, 0 = ignore), plus MaxText's optional z-loss `z_loss·(log Z)²` per token. The loss is
/// computed as `log Z − logit[target]` (no log of a rounded probability).
///
/// # Errors
/// Shapes disagree or a target is out of range.
pub fn cross_entropy(
    logits: &Tensor,
    targets: &[u32],
    mask: &[f32],
    z_loss: f32,
) -> Result<CrossEntropy, TensorError> {
    let _span = ferrotext_profile::span("cross_entropy");
    let v = last_dim(logits, "cross_entropy")?;
    let n = logits.len() / v;
    if logits.rank() != 2 || targets.len() != n || mask.len() != n {
        return Err(TensorError::shape(
            "cross_entropy",
            format!(
                "logits {:?}, {} targets, {} mask weights",
                logits.shape(),
                targets.len(),
                mask.len()
            ),
        ));
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= v) {
        return Err(TensorError::shape(
            "cross_entropy",
            format!("target {t} out of range for {v} classes"),
        ));
    }
    // Per row, in parallel: the probabilities (f32, as softmax_last), log Z and the row's loss
    // term (f64); the terms are then summed in row order. Each row's exponentials are written
    // straight from the logits into the output (no copy of the logits first).
    let mut stats = vec![(0.0f32, 0.0f64); n];
    // SAFETY: every chunk is visited, and each writes all `v` elements of its row first.
    let probs = unsafe {
        filled(logits.len(), |probs| {
            for_each_chunk2(
                probs,
                v,
                &mut stats,
                1,
                kernel_threads(),
                Work::Heavy,
                |i, prow, stat| {
                    let row = &logits.data()[i * v..(i + 1) * v];
                    // One vectorised pass of exponentials, summed in f64 (in lanes) for log Z
                    // and normalised into the probabilities.
                    let (max, sum, prow) = vectorized(
                        #[inline(always)]
                        || {
                            let max = lane_max(row);
                            for (p, &x) in prow.iter_mut().zip(row) {
                                p.write(exp(x - max));
                            }
                            // SAFETY (inside `filled`'s block): the loop above wrote every element
                            // of the row.
                            let prow =
                                std::slice::from_raw_parts_mut(prow.as_mut_ptr().cast::<f32>(), v);
                            (max, lane_sum_f64(prow), prow)
                        },
                    );
                    let lz = max as f64 + sum.ln();
                    let m = mask[i];
                    let term = if m != 0.0 {
                        m as f64 * (lz - row[targets[i] as usize] as f64 + z_loss as f64 * lz * lz)
                    } else {
                        0.0
                    };
                    stat[0] = (lz as f32, term);
                    let inv = (1.0 / sum) as f32;
                    vectorized(
                        #[inline(always)]
                        || prow.iter_mut().for_each(|p| *p *= inv),
                    );
                },
            )
        })
    };
    let probs = Tensor::new(logits.shape().to_vec(), probs)?;
    let mut loss = 0.0f64;
    for (&(_, term), &m) in stats.iter().zip(mask) {
        if m != 0.0 {
            loss += term;
        }
    }
    let log_z = stats.iter().map(|&(lz, _)| lz).collect();
    Ok(CrossEntropy {
        loss_sum: loss as f32,
        count: mask.iter().sum(),
        probs,
        log_z,
    })
}

/// Backward of [`cross_entropy`]'s loss sum:
/// `dlogits = dloss · mask ⊙ (probs − onehot(targets) + 2·z_loss·log Z·probs)`.
///
/// # Errors
/// Shapes disagree.
pub fn cross_entropy_backward(
    ce: &CrossEntropy,
    targets: &[u32],
    mask: &[f32],
    z_loss: f32,
    dloss: f32,
) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("cross_entropy_backward");
    let probs = &ce.probs;
    let v = last_dim(probs, "cross_entropy_backward")?;
    if targets.len() * v != probs.len()
        || mask.len() != targets.len()
        || ce.log_z.len() != targets.len()
    {
        return Err(TensorError::shape(
            "cross_entropy_backward",
            "targets do not fit".into(),
        ));
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= v) {
        return Err(TensorError::shape(
            "cross_entropy_backward",
            format!("target {t} out of range for {v} classes"),
        ));
    }
    // Each row written from the probabilities (no copy of them first).
    // SAFETY: every chunk is visited, and each writes all `v` elements of its row before it
    // reads one back.
    let d = unsafe {
        filled(probs.len(), |d| {
            for_each_chunk(d, v, kernel_threads(), Work::Light, |i, row| {
                let k = dloss * mask[i];
                let kp = k * (1.0 + 2.0 * z_loss * ce.log_z[i]);
                let prow = &probs.data()[i * v..(i + 1) * v];
                vectorized(
                    #[inline(always)]
                    || {
                        for (x, &p) in row.iter_mut().zip(prow) {
                            x.write(p * kp);
                        }
                    },
                );
                let t = targets[i] as usize;
                row[t].write(prow[t] * kp - k);
            })
        })
    };
    Tensor::new(probs.shape().to_vec(), d)
}

/// `out = x` indexed by `indices` along `axis` (XLA's gather of whole slices): the result has
/// `indices.len()` entries along `axis`.
///
/// # Errors
/// `axis` out of range or an index out of bounds.
pub fn gather(x: &Tensor, axis: usize, indices: &[u32]) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("gather");
    let extent = *x
        .shape()
        .get(axis)
        .ok_or_else(|| TensorError::shape("gather", format!("no axis {axis}")))?;
    if let Some(i) = indices.iter().find(|&&i| i as usize >= extent) {
        return Err(TensorError::shape(
            "gather",
            format!("index {i} out of bounds for {extent}"),
        ));
    }
    let outer: usize = x.shape()[..axis].iter().product();
    let inner: usize = x.shape()[axis + 1..].iter().product();
    let mut shape = x.shape().to_vec();
    shape[axis] = indices.len();
    let mut data = Vec::with_capacity(outer * indices.len() * inner);
    for o in 0..outer {
        for &i in indices {
            let start = (o * extent + i as usize) * inner;
            data.extend_from_slice(&x.data()[start..start + inner]);
        }
    }
    Tensor::new(shape, data)
}

/// Backward of [`gather`]: a zero tensor of `shape` with each slice of `src` added at its index
/// along `axis` (repeated indices accumulate, in order).
///
/// # Errors
/// Shapes disagree or an index is out of bounds.
pub fn scatter_add(
    shape: &[usize],
    axis: usize,
    indices: &[u32],
    src: &Tensor,
) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("scatter_add");
    let extent = *shape
        .get(axis)
        .ok_or_else(|| TensorError::shape("scatter_add", format!("no axis {axis}")))?;
    let mut want = shape.to_vec();
    want[axis] = indices.len();
    if src.shape() != want.as_slice() || indices.iter().any(|&i| i as usize >= extent) {
        return Err(TensorError::shape(
            "scatter_add",
            format!(
                "src {:?} with {} indices into {shape:?}",
                src.shape(),
                indices.len()
            ),
        ));
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = Tensor::zeros(shape);
    for o in 0..outer {
        for (k, &i) in indices.iter().enumerate() {
            let dst = (o * extent + i as usize) * inner;
            let s = (o * indices.len() + k) * inner;
            for (d, &v) in out.data_mut()[dst..dst + inner]
                .iter_mut()
                .zip(&src.data()[s..s + inner])
            {
                *d += v;
            }
        }
    }
    Ok(out)
}

/// `dest += scatter_add(src)` along axis 0, bit for bit: the source rows bound for each table
/// row (`indices[k]` for row `k` of `src`, `indices.len()` rows of `width`) are summed first,
/// in order from `0.0`, as [`scatter_add`] sums them into a zero table, and that sum is added
/// into the row of `dest`; for a gradient accumulator that takes an embedding table's gradient
/// without a zero table.
///
/// # Errors
/// `dest` or `src` not a whole number of rows of `width`, a length mismatch, or an index out of
/// bounds (then nothing is added).
pub fn scatter_add_into(
    dest: &mut [f32],
    width: usize,
    indices: &[u32],
    src: &[f32],
) -> Result<(), TensorError> {
    // One part holds whole rows whenever `dest` does (checked inside).
    scatter_add_into_parts(&mut [dest], width, indices, src).map(|_| ())
}

/// [`scatter_add_into`] into a table held in `parts` of equal length, in order (part `j` holds
/// elements `j·len/p .. (j+1)·len/p`, as a reduce-scatter bucket keeps a value's chunk `j` in
/// its segment `j`): each row's sum goes into the part holding that row, with the same bits.
/// Returns `false`, having touched nothing, when the parts are unequal or a part does not hold
/// whole rows.
///
/// # Errors
/// As [`scatter_add_into`], for the table the parts make up.
pub fn scatter_add_into_parts(
    parts: &mut [&mut [f32]],
    width: usize,
    indices: &[u32],
    src: &[f32],
) -> Result<bool, TensorError> {
    let _span = ferrotext_profile::span("scatter_add");
    let part = parts.first().map_or(0, |p| p.len());
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if width == 0 && len == 0 && src.is_empty() {
        return Ok(true);
    }
    let rows = len.checked_div(width).unwrap_or(0);
    if width == 0
        || len != rows * width
        || src.len() != indices.len() * width
        || indices.iter().any(|&i| i as usize >= rows)
    {
        return Err(TensorError::shape(
            "scatter_add_into",
            format!(
                "{} source elements at {} indices into {len} elements in rows of {width}",
                src.len(),
                indices.len(),
            ),
        ));
    }
    if indices.is_empty() {
        return Ok(true);
    }
    if !part.is_multiple_of(width) || parts.iter().any(|p| p.len() != part) {
        return Ok(false);
    }
    // Every index is below `rows` ≥ 1, so the parts hold at least one row each.
    let rows_per_part = part / width;
    // Source rows grouped by table row, each group in source order (a stable sort).
    let mut order: Vec<usize> = (0..indices.len()).collect();
    order.sort_by_key(|&k| indices[k]);
    let mut sum = vec![0.0f32; width];
    for group in order.chunk_by(|&a, &b| indices[a] == indices[b]) {
        sum.fill(0.0);
        for &k in group {
            for (s, &v) in sum.iter_mut().zip(&src[k * width..(k + 1) * width]) {
                *s += v;
            }
        }
        let row = indices[group[0]] as usize;
        let at = (row % rows_per_part) * width;
        let dest = &mut parts[row / rows_per_part][at..at + width];
        for (d, &s) in dest.iter_mut().zip(&sum) {
            *d += s;
        }
    }
    Ok(true)
}

/// Up to this `k`, [`top_k`] keeps the best k in a sorted buffer; above, it selects then sorts.
const TOP_K_INSERTION_MAX: usize = 16;

/// The `k` largest entries of each row (last dim), descending; ties go to the lower index.
/// Returns the values `[.., k]` and their indices.
///
/// # Errors
/// `k` is 0 or larger than the row.
pub fn top_k(x: &Tensor, k: usize) -> Result<(Tensor, Vec<u32>), TensorError> {
    let _span = ferrotext_profile::span("top_k");
    let n = last_dim(x, "top_k")?;
    if k == 0 || k > n {
        return Err(TensorError::shape(
            "top_k",
            format!("k = {k} for rows of {n}"),
        ));
    }
    let rows = x.len() / n;
    let mut values = Vec::with_capacity(rows * k);
    let mut indices = Vec::with_capacity(rows * k);
    // The order is total (value by `total_cmp`, descending, then index ascending), so a partial
    // selection gives exactly the first k of a full sort: for small k an insertion into the
    // k best so far (O(n·k), no allocation per row), else a select-nth then a sort of k.
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    let mut order: Vec<u32> = Vec::new();
    for row in x.data().chunks(n) {
        if k <= TOP_K_INSERTION_MAX {
            best.clear();
            for (i, &v) in row.iter().enumerate() {
                // Later indices lose ties, so a candidate must beat strictly.
                if best.len() == k && v.total_cmp(&best[k - 1].0).is_le() {
                    continue;
                }
                let at = best.partition_point(|&(b, _)| v.total_cmp(&b).is_le());
                best.insert(at, (v, i as u32));
                best.truncate(k);
            }
            values.extend(best.iter().map(|&(v, _)| v));
            indices.extend(best.iter().map(|&(_, i)| i));
        } else {
            let before =
                |&a: &u32, &b: &u32| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b));
            order.clear();
            order.extend(0..n as u32);
            if k < n {
                order.select_nth_unstable_by(k - 1, before);
            }
            order[..k].sort_unstable_by(before);
            for &i in &order[..k] {
                values.push(row[i as usize]);
                indices.push(i);
            }
        }
    }
    let mut shape = x.shape().to_vec();
    *shape.last_mut().unwrap_or(&mut 0) = k; // ok: rank ≥ 1 checked by last_dim
    Ok((Tensor::new(shape, values)?, indices))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], data: &[f32]) -> Tensor {
        Tensor::new(shape.to_vec(), data.to_vec()).unwrap()
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "{x} vs {y}\n{a:?}\n{b:?}"
            );
        }
    }

    /// Central differences of a scalar function of a tensor, in f64 around f32 data.
    fn numeric_grad(x: &Tensor, f: impl Fn(&Tensor) -> f64) -> Vec<f32> {
        let h = 1e-3f32;
        (0..x.len())
            .map(|i| {
                let mut p = x.clone();
                let mut m = x.clone();
                p.data_mut()[i] += h;
                m.data_mut()[i] -= h;
                ((f(&p) - f(&m)) / (2.0 * h as f64)) as f32
            })
            .collect()
    }

    fn weighted_sum(y: &Tensor, w: &Tensor) -> f64 {
        y.data()
            .iter()
            .zip(w.data())
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum()
    }

    #[test]
    fn softmax_is_stable_and_its_backward_matches_finite_differences() {
        let x = t(&[2, 3], &[1000., 1001., 1002., -1., 0., 1.]);
        let y = softmax_last(&x).unwrap();
        let e = [(-2f32).exp(), (-1f32).exp(), 1.0];
        let s: f32 = e.iter().sum();
        close(&y.data()[..3], &[e[0] / s, e[1] / s, e[2] / s], 1e-6);
        close(&y.data()[3..], &[e[0] / s, e[1] / s, e[2] / s], 1e-6);
        let x = t(&[2, 3], &[0.1, -0.4, 0.3, 0.9, 0.2, -0.5]);
        let w = t(&[2, 3], &[1., 2., -1., 0.5, -2., 3.]);
        let dx = softmax_last_backward(&softmax_last(&x).unwrap(), &w).unwrap();
        close(
            dx.data(),
            &numeric_grad(&x, |x| weighted_sum(&softmax_last(x).unwrap(), &w)),
            1e-2,
        );
    }

    #[test]
    fn causal_softmax_matches_masked_softmax() {
        let x = Tensor::from_fn(&[2, 3, 3], |i| ((i * 7) % 5) as f32 * 0.3);
        let y = causal_softmax(&x, 1.0).unwrap();
        let masked = x
            .map(|v| v)
            .zip_with(
                &Tensor::from_fn(&[3, 3], |i| if i % 3 > i / 3 { -1e30 } else { 0.0 }),
                |a, b| a + b,
            )
            .unwrap();
        close(y.data(), softmax_last(&masked).unwrap().data(), 1e-6);
        assert!(causal_softmax(&Tensor::zeros(&[3, 2]), 1.0).is_err());
        // the scale is folded in, and its backward matches finite differences
        let w = Tensor::from_fn(&[2, 3, 3], |i| (i % 4) as f32 - 1.5);
        let ys = causal_softmax(&x, 0.5).unwrap();
        close(
            ys.data(),
            causal_softmax(&x.scale(0.5), 1.0).unwrap().data(),
            1e-6,
        );
        let dx = softmax_backward_scaled(&ys, &w, 0.5).unwrap();
        close(
            dx.data(),
            &numeric_grad(&x, |x| weighted_sum(&causal_softmax(x, 0.5).unwrap(), &w)),
            1e-2,
        );
    }

    #[test]
    fn rms_norm_forward_and_backward() {
        let x = t(&[2, 4], &[1., 2., 3., 4., -1., 0.5, 0., 2.]);
        let s = t(&[4], &[1., 0.5, 2., -1.]);
        let (y, inv) = rms_norm(&x, &s, 1e-6).unwrap();
        let r0 = 1.0 / (30.0f32 / 4.0 + 1e-6).sqrt();
        close(
            &y.data()[..4],
            &[r0, 0.5 * 2. * r0, 2. * 3. * r0, -4. * r0],
            1e-6,
        );
        let w = t(&[2, 4], &[0.3, -1., 2., 0.5, 1., 1., -0.5, 0.25]);
        let (dx, ds) = rms_norm_backward(&x, &s, &inv, &w).unwrap();
        close(
            dx.data(),
            &numeric_grad(&x, |x| weighted_sum(&rms_norm(x, &s, 1e-6).unwrap().0, &w)),
            1e-2,
        );
        close(
            ds.data(),
            &numeric_grad(&s, |s| weighted_sum(&rms_norm(&x, s, 1e-6).unwrap().0, &w)),
            1e-2,
        );
    }

    #[test]
    fn rope_rotates_pairs_and_inverts() {
        // one sequence of 2 positions, 1 head, head_dim 4
        let x = t(&[2, 1, 4], &[1., 2., 3., 4., 1., 2., 3., 4.]);
        let y = rope(&x, &[0, 1], 10000.0, false).unwrap();
        close(&y.data()[..4], &[1., 2., 3., 4.], 1e-6); // position 0: identity
        let (f0, f1) = (1.0f32, 10000f32.powf(-0.5));
        let (s0, c0) = f0.sin_cos();
        let (s1, c1) = f1.sin_cos();
        close(
            &y.data()[4..],
            &[
                1. * c0 - 3. * s0,
                2. * c1 - 4. * s1,
                3. * c0 + 1. * s0,
                4. * c1 + 2. * s1,
            ],
            1e-6,
        );
        let back = rope(&y, &[0, 1], 10000.0, true).unwrap();
        close(back.data(), x.data(), 1e-6);
        assert!(rope(&t(&[2, 3], &[0.; 6]), &[0, 1], 1e4, false).is_err());
    }

    #[test]
    fn swiglu_and_its_backward() {
        let g = t(&[4], &[-2., -0.3, 0.5, 3.]);
        let u = t(&[4], &[1., -1., 2., 0.5]);
        let w = t(&[4], &[0.5, 1., -1., 2.]);
        close(
            swiglu(&g, &u).unwrap().data(),
            silu(&g).mul(&u).unwrap().data(),
            1e-6,
        );
        let (dg, du) = swiglu_backward(&g, &u, &w).unwrap();
        close(
            dg.data(),
            &numeric_grad(&g, |g| weighted_sum(&swiglu(g, &u).unwrap(), &w)),
            1e-2,
        );
        close(
            du.data(),
            &numeric_grad(&u, |u| weighted_sum(&swiglu(&g, u).unwrap(), &w)),
            1e-2,
        );
    }

    #[test]
    fn silu_backward_matches_finite_differences() {
        let x = t(&[5], &[-3., -0.5, 0., 0.7, 4.]);
        let w = t(&[5], &[1., 2., 3., -1., 0.5]);
        let dx = silu_backward(&x, &w).unwrap();
        close(
            dx.data(),
            &numeric_grad(&x, |x| weighted_sum(&silu(x), &w)),
            1e-2,
        );
    }

    #[test]
    fn cross_entropy_sums_masked_losses_and_its_backward_matches() {
        let logits = t(
            &[3, 4],
            &[0.1, 2., -1., 0.5, 1., 1., 1., 1., 3., 0., 0., -2.],
        );
        let targets = [1, 2, 3];
        let mask = [1., 0., 1.];
        let ce = cross_entropy(&logits, &targets, &mask, 0.0).unwrap();
        let lse = |r: &[f32]| r.iter().map(|v| v.exp()).sum::<f32>().ln();
        let want = (lse(&logits.data()[..4]) - 2.) + (lse(&logits.data()[8..]) + 2.);
        assert!(
            (ce.loss_sum - want).abs() < 1e-5,
            "{} vs {want}",
            ce.loss_sum
        );
        assert_eq!(ce.count, 2.0);
        for z in [0.0, 0.1] {
            let ce = cross_entropy(&logits, &targets, &mask, z).unwrap();
            let d = cross_entropy_backward(&ce, &targets, &mask, z, 1.0).unwrap();
            let num = numeric_grad(&logits, |l| {
                cross_entropy(l, &targets, &mask, z).unwrap().loss_sum as f64
            });
            close(d.data(), &num, 1e-2);
            assert!(
                d.data()[4..8].iter().all(|&v| v == 0.0),
                "masked row has no gradient"
            );
        }
        let with_z = cross_entropy(&logits, &targets, &mask, 0.5)
            .unwrap()
            .loss_sum;
        let z_term = 0.5 * (lse(&logits.data()[..4]).powi(2) + lse(&logits.data()[8..]).powi(2));
        assert!((with_z - want - z_term).abs() < 1e-4);
        assert!(cross_entropy(&logits, &[1, 2, 4], &mask, 0.0).is_err());
    }

    #[test]
    fn gather_and_scatter_add_are_adjoint() {
        let x = Tensor::from_fn(&[2, 3, 2], |i| i as f32);
        let g = gather(&x, 1, &[2, 0, 2]).unwrap();
        assert_eq!(g.shape(), &[2, 3, 2]);
        assert_eq!(&g.data()[..6], &[4., 5., 0., 1., 4., 5.]);
        let s = scatter_add(&[2, 3, 2], 1, &[2, 0, 2], &Tensor::full(&[2, 3, 2], 1.0)).unwrap();
        assert_eq!(&s.data()[..6], &[1., 1., 0., 0., 2., 2.]);
        // <gather(x), y> == <x, scatter_add(y)>
        let y = Tensor::from_fn(&[2, 3, 2], |i| (i as f32).sin());
        let lhs = weighted_sum(&g, &y);
        let rhs = weighted_sum(&x, &scatter_add(&[2, 3, 2], 1, &[2, 0, 2], &y).unwrap());
        assert!((lhs - rhs).abs() < 1e-5);
        assert!(gather(&x, 1, &[3]).is_err());
    }

    /// `scatter_add_into` adds rows into what `dest` holds (hand values), with the bits of
    /// `dest + scatter_add(src)` where repeated rows round differently summed one by one into
    /// `dest`; a bad index or size is an error that adds nothing.
    #[test]
    fn scatter_add_into_adds_rows_into_the_destination() {
        let mut dest = vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
        let src = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        scatter_add_into(&mut dest, 2, &[2, 0, 2], &src).unwrap();
        assert_eq!(dest, [13.0, 24.0, 30.0, 40.0, 56.0, 68.0]);
        // 1 + 2⁻²⁴ + 2⁻²⁴: one by one the halves of an ulp round away; summed first they count.
        let tiny = f32::EPSILON / 2.0;
        let mut one = vec![1.0f32];
        scatter_add_into(&mut one, 1, &[0, 0], &[tiny, tiny]).unwrap();
        let table = scatter_add(
            &[1, 1],
            0,
            &[0, 0],
            &Tensor::new(vec![2, 1], vec![tiny, tiny]).unwrap(),
        )
        .unwrap();
        assert_eq!(one[0], 1.0 + table.data()[0]);
        assert_ne!(one[0], 1.0 + tiny + tiny);
        let before = dest.clone();
        assert!(scatter_add_into(&mut dest, 2, &[3, 0, 1], &src).is_err());
        assert!(scatter_add_into(&mut dest, 2, &[0, 1], &src).is_err());
        assert!(scatter_add_into(&mut dest, 4, &[0], &src[..4]).is_err());
        assert_eq!(dest, before);
        assert!(scatter_add_into(&mut [], 0, &[], &[]).is_ok());
    }

    /// A table in parts of whole rows (a reduce-scatter bucket's segments) takes each row's sum
    /// in the part holding it, with the bits of the whole table; parts that would cut a row
    /// (the mirror) or are unequal are left untouched (`false`); a bad index is an error.
    #[test]
    fn scatter_add_into_parts_adds_each_row_into_the_part_holding_it() {
        let (width, rows) = (3, 6);
        let start: Vec<f32> = (0..rows * width).map(|i| i as f32 * 0.31 - 2.0).collect();
        let indices = [5, 0, 2, 5, 3, 0, 5];
        let src: Vec<f32> = (0..indices.len() * width)
            .map(|i| (i as f32 * 0.77).sin())
            .collect();
        let mut whole = start.clone();
        scatter_add_into(&mut whole, width, &indices, &src).unwrap();
        for p in [1, 2, 3, 6] {
            let mut table = start.clone();
            let mut parts: Vec<&mut [f32]> = table.chunks_mut(rows * width / p).collect();
            assert!(scatter_add_into_parts(&mut parts, width, &indices, &src).unwrap());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&table), bits(&whole), "{p} parts");
        }
        // Unequal parts (4 rows and 2), and rows of 2 in two parts of 9 elements (4.5 rows).
        let mut table = start.clone();
        let (a, b) = table.split_at_mut(width * 4);
        let mut unequal: Vec<&mut [f32]> = vec![a, b];
        assert!(!scatter_add_into_parts(&mut unequal, width, &indices, &src).unwrap());
        let mut halves: Vec<&mut [f32]> = table.chunks_mut(9).collect();
        assert!(!scatter_add_into_parts(&mut halves, 2, &[0], &[1.0, 2.0]).unwrap());
        assert_eq!(table, start, "untouched");
        let mut parts: Vec<&mut [f32]> = table.chunks_mut(9).collect();
        assert!(scatter_add_into_parts(&mut parts, width, &[6], &src[..3]).is_err());
    }

    fn rand(shape: &[usize], seed: u32) -> Tensor {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        Tensor::from_fn(shape, |_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 4000) as f32 / 1000.0 - 2.0
        })
    }

    /// Plain serial versions of the row kernels, written out here as the baseline.
    mod reference {
        use super::Tensor;
        use crate::fastmath::exp;

        /// The order the kernels sum a row in, written out: term `i` into partial `i mod 16`,
        /// the partials folded `j + 8`, `+ 4`, `+ 2`, `+ 1`.
        pub fn lanes(terms: impl Iterator<Item = f32>) -> f32 {
            let mut p = [0.0f32; 16];
            for (i, t) in terms.enumerate() {
                p[i % 16] += t;
            }
            for w in [8, 4, 2, 1] {
                for j in 0..w {
                    p[j] += p[j + w];
                }
            }
            p[0]
        }

        /// As [`lanes`], in `f64` with 8 partials.
        pub fn lanes_f64(terms: impl Iterator<Item = f32>) -> f64 {
            let mut p = [0.0f64; 8];
            for (i, t) in terms.enumerate() {
                p[i % 8] += f64::from(t);
            }
            for w in [4, 2, 1] {
                for j in 0..w {
                    p[j] += p[j + w];
                }
            }
            p[0]
        }

        pub fn softmax(x: &Tensor, n: usize, causal: Option<f32>) -> Vec<f32> {
            let mut y = x.data().to_vec();
            for (k, row) in y.chunks_mut(n).enumerate() {
                let (keep, scale) = causal.map_or((n, 1.0), |s| (k % n + 1, s));
                let (live, masked) = row.split_at_mut(keep);
                let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for v in live.iter_mut() {
                    *v = if causal.is_some() {
                        exp((*v - max) * scale)
                    } else {
                        exp(*v - max)
                    };
                }
                let inv = 1.0 / lanes(live.iter().copied());
                live.iter_mut().for_each(|v| *v *= inv);
                masked.fill(0.0);
            }
            y
        }

        pub fn rms_norm(x: &[f32], s: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
            let n = s.len();
            let (mut y, mut inv) = (Vec::new(), Vec::new());
            for row in x.chunks(n) {
                let ms = lanes(row.iter().map(|v| v * v)) / n as f32;
                let r = 1.0 / (ms + eps).sqrt();
                y.extend(row.iter().zip(s).map(|(v, s)| v * (r * s)));
                inv.push(r);
            }
            (y, inv)
        }

        /// dscale's order written out: each group of `4096 / n` rows (at least one) summed in
        /// row order from zero, then the groups' sums added in group order.
        pub fn rms_norm_backward(x: &[f32], s: &[f32], inv: &[f32], dy: &[f32]) -> Vec<f32> {
            let n = s.len();
            let group = (4096 / n).max(1);
            let mut dx = vec![0.0; x.len()];
            let mut ds = vec![0.0f32; n];
            let mut part = vec![0.0f32; n];
            for (row, &r) in inv.iter().enumerate() {
                let (xr, dyr) = (&x[row * n..][..n], &dy[row * n..][..n]);
                for i in 0..n {
                    part[i] += dyr[i] * (xr[i] * r);
                }
                if row % group == group - 1 || row == inv.len() - 1 {
                    for i in 0..n {
                        ds[i] += part[i];
                    }
                    part.fill(0.0);
                }
                let mean_gn = lanes((0..n).map(|i| dyr[i] * s[i] * (xr[i] * r))) / n as f32;
                for i in 0..n {
                    dx[row * n + i] = r * (dyr[i] * s[i] - xr[i] * r * mean_gn);
                }
            }
            dx.extend(ds);
            dx
        }
    }

    /// Every threaded kernel gives the serial reference's bits on odd shapes (1, primes,
    /// sizes that are not multiples of the chunk) and on 1, 2 or 3 threads.
    #[test]
    fn threaded_row_kernels_match_serial_references_bitwise() {
        let shapes: &[(usize, usize)] = &[(1, 1), (3, 7), (37, 131), (257, 131), (1031, 64)];
        for &(rows, n) in shapes {
            let x = rand(&[rows, n], 1);
            let w = rand(&[rows, n], 2);
            let s = rand(&[n], 3);
            let targets: Vec<u32> = (0..rows as u32).map(|i| (i * 31) % n as u32).collect();
            let mask: Vec<f32> = (0..rows).map(|i| [1.0, 0.0, 0.5][i % 3]).collect();
            for threads in [1, 2, 3] {
                crate::set_kernel_threads(threads);
                let at = format!("{rows}×{n} on {threads} threads");
                let sm = softmax_last(&x).unwrap();
                assert_eq!(sm.data(), reference::softmax(&x, n, None), "softmax {at}");
                let back = softmax_backward_scaled(&sm, &w, 0.7).unwrap();
                let want: Vec<f32> = w
                    .data()
                    .chunks(n)
                    .zip(sm.data().chunks(n))
                    .flat_map(|(d, y)| {
                        let dot = reference::lanes(d.iter().zip(y).map(|(d, y)| d * y));
                        d.iter().zip(y).map(move |(d, y)| 0.7 * y * (d - dot))
                    })
                    .collect();
                assert_eq!(back.data(), want, "softmax backward {at}");
                let sq = rand(&[rows, n, n], 4);
                assert_eq!(
                    causal_softmax(&sq, 0.3).unwrap().data(),
                    reference::softmax(&sq, n, Some(0.3)),
                    "causal softmax {at}"
                );
                let (y, inv) = rms_norm(&x, &s, 1e-6).unwrap();
                let (wy, winv) = reference::rms_norm(x.data(), s.data(), 1e-6);
                assert_eq!((y.data(), &inv), (wy.as_slice(), &winv), "rms_norm {at}");
                let (dx, ds) = rms_norm_backward(&x, &s, &inv, &w).unwrap();
                let want = reference::rms_norm_backward(x.data(), s.data(), &inv, w.data());
                assert_eq!(dx.data(), &want[..x.len()], "rms_norm dx {at}");
                assert_eq!(ds.data(), &want[x.len()..], "rms_norm dscale {at}");
                let silu_want: Vec<f32> = x.data().iter().map(|&v| v * sigmoid(v)).collect();
                assert_eq!(silu(&x).data(), silu_want, "silu {at}");
                let sw = swiglu(&x, &w).unwrap();
                let sw_want: Vec<f32> =
                    silu_want.iter().zip(w.data()).map(|(a, b)| a * b).collect();
                let sw_want2: Vec<f32> = x
                    .data()
                    .iter()
                    .zip(w.data())
                    .map(|(&a, &b)| a * sigmoid(a) * b)
                    .collect();
                assert_eq!(sw.data(), sw_want2, "swiglu {at}");
                close(sw.data(), &sw_want, 1e-6);
                let (dg, du) = swiglu_backward(&x, &w, &sm).unwrap();
                let silu_dx = silu_backward(&x, &w).unwrap();
                for i in 0..x.len() {
                    let (a, b, d) = (x.data()[i], w.data()[i], sm.data()[i]);
                    let sg = sigmoid(a);
                    assert_eq!(dg.data()[i], d * b * sg * (1.0 + a * (1.0 - sg)), "dg {at}");
                    assert_eq!(du.data()[i], d * a * sg, "du {at}");
                    let want = w.data()[i] * sg * (1.0 + a * (1.0 - sg));
                    assert_eq!(silu_dx.data()[i], want, "silu' {at}");
                }
                for z in [0.0, 1e-4] {
                    let ce = cross_entropy(&x, &targets, &mask, z).unwrap();
                    let mut loss = 0.0f64;
                    for (i, row) in x.data().chunks(n).enumerate() {
                        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let e: Vec<f32> = row.iter().map(|&v| exp(v - max)).collect();
                        let sum = reference::lanes_f64(e.iter().copied());
                        let probs: Vec<f32> = e.iter().map(|&v| v * (1.0 / sum) as f32).collect();
                        assert_eq!(&ce.probs.data()[i * n..][..n], probs, "ce probs {at}");
                        let lz = max as f64 + sum.ln();
                        assert_eq!(ce.log_z[i], lz as f32, "log Z {at}");
                        if mask[i] != 0.0 {
                            let t = targets[i] as usize;
                            loss += mask[i] as f64 * (lz - row[t] as f64 + z as f64 * lz * lz);
                        }
                    }
                    assert_eq!(ce.loss_sum, loss as f32, "ce loss {at}");
                    let d = cross_entropy_backward(&ce, &targets, &mask, z, 0.5).unwrap();
                    for (i, row) in d.data().chunks(n).enumerate() {
                        let k = 0.5 * mask[i];
                        let kp = k * (1.0 + 2.0 * z * ce.log_z[i]);
                        for (j, &g) in row.iter().enumerate() {
                            let mut want = ce.probs.data()[i * n + j] * kp;
                            if j == targets[i] as usize {
                                want -= k;
                            }
                            assert_eq!(g, want, "ce backward {at}");
                        }
                    }
                }
            }
        }
        crate::set_kernel_threads(1);
    }

    /// RoPE on 1, 2 or 3 threads gives the bits of a plain loop over (batch, position, head).
    #[test]
    fn threaded_rope_matches_a_serial_loop_bitwise() {
        for &(b, seq, heads, dim) in &[(1, 1, 1, 2), (3, 7, 5, 6), (2, 131, 7, 64)] {
            let x = rand(&[b, seq, heads, dim], 9);
            let positions: Vec<usize> = (0..seq).map(|p| p * 3 + 1).collect();
            for interleaved in [false, true] {
                let rope = Rope {
                    theta: 1e4,
                    interleaved,
                    yarn: None,
                };
                let freqs = rope.frequencies(dim);
                let half = dim / 2;
                let mut want = x.data().to_vec();
                for bi in 0..b {
                    for (s, &p) in positions.iter().enumerate() {
                        for h in 0..heads {
                            let at = ((bi * seq + s) * heads + h) * dim;
                            for (i, &f) in freqs.iter().enumerate() {
                                let (sin, cos) = (p as f32 * f).sin_cos();
                                let (j0, j1) = if interleaved {
                                    (at + 2 * i, at + 2 * i + 1)
                                } else {
                                    (at + i, at + half + i)
                                };
                                let (x0, x1) = (x.data()[j0], x.data()[j1]);
                                want[j0] = x0 * cos - x1 * sin;
                                want[j1] = x1 * cos + x0 * sin;
                            }
                        }
                    }
                }
                for threads in [1, 2, 3] {
                    crate::set_kernel_threads(threads);
                    let y = rope_with(&x, &positions, &rope, false).unwrap();
                    assert_eq!(y.data(), want, "{b}×{seq}×{heads}×{dim} on {threads}");
                }
            }
        }
        crate::set_kernel_threads(1);
    }

    #[test]
    fn top_k_is_descending_with_ties_to_the_lower_index() {
        let x = t(&[2, 4], &[0.5, 2., 2., -1., 3., 1., 0., 3.]);
        let (v, i) = top_k(&x, 2).unwrap();
        assert_eq!(v.data(), &[2., 2., 3., 3.]);
        assert_eq!(i, vec![1, 2, 0, 3]);
        assert!(top_k(&x, 5).is_err());
    }

    /// Both selection paths against a full stable sort, on rows with many ties, NaNs, signed
    /// zeros and infinities, for every k.
    #[test]
    fn top_k_matches_a_full_sort() {
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
        ];
        for n in [1usize, 2, 7, 16, 31, 67] {
            let x = Tensor::from_fn(&[3, n], |i| {
                if i % 11 == 5 {
                    specials[i % specials.len()]
                } else {
                    ((i * 7919) % 9) as f32 - 4.0
                }
            });
            for k in 1..=n {
                let (v, idx) = top_k(&x, k).unwrap();
                for (r, row) in x.data().chunks(n).enumerate() {
                    let mut order: Vec<u32> = (0..n as u32).collect();
                    order.sort_by(|&a, &b| {
                        row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b))
                    });
                    assert_eq!(&idx[r * k..(r + 1) * k], &order[..k], "n {n} k {k}");
                    for (j, &i) in order[..k].iter().enumerate() {
                        assert_eq!(v.data()[r * k + j].to_bits(), row[i as usize].to_bits());
                    }
                }
            }
        }
    }

    #[test]
    fn causal_softmax_over_a_cache_is_the_last_rows_of_the_square_mask() {
        // 7 keys; the last 3 are the new queries: their rows must equal the square mask's
        // last rows, and a single query sees every key.
        let (tk, tq) = (7, 3);
        let square = rand(&[2, tk, tk], 9);
        let full = causal_softmax(&square, 0.4).unwrap();
        let tail = square.slice(&[0..2, tk - tq..tk, 0..tk]).unwrap();
        let step = causal_softmax(&tail, 0.4).unwrap();
        let want = full.slice(&[0..2, tk - tq..tk, 0..tk]).unwrap();
        assert_eq!(step.data(), want.data());
        let one = causal_softmax(&square.slice(&[0..1, tk - 1..tk, 0..tk]).unwrap(), 0.4).unwrap();
        assert!(one.data().iter().all(|&p| p > 0.0), "{:?}", one.data());
        let err = causal_softmax(&rand(&[4, 3], 1), 1.0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("Tk ≥ Tq"), "{err}");
    }
}
