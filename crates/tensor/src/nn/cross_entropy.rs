//! Cross-entropy over the last dimension with a token mask and optional z-loss, and its
//! backward.
//!
//! Invariants: the loss is a masked *sum* (the caller divides); rows are computed independently
//! and their terms summed in row order afterwards, so the bits do not depend on the thread count.

use super::last_dim;
use crate::error::TensorError;
use crate::fastmath::{exp, lane_max, lane_sum_f64, vectorized};
use crate::parallel::{filled, for_each_chunk, for_each_chunk2, kernel_threads, Work};
use crate::tensor::Tensor;

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
    let _span =
        ferrotext_profile::span("cross_entropy").map(|s| s.bytes((8 * logits.len()) as f64));
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
    let _span = ferrotext_profile::span("cross_entropy_backward")
        .map(|s| s.bytes((8 * ce.probs.len()) as f64));
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
