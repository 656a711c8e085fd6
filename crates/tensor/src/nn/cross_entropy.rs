//! Cross-entropy over the last dimension with a token mask and optional z-loss, and its
//! backward.
//!
//! Invariants: the loss is a masked *sum* (the caller divides); rows are computed independently
//! and their terms summed in row order afterwards, so the bits do not depend on the thread count.

use super::last_dim;
use crate::error::TensorError;
use crate::fastmath::{exp, lane_max, vectorized, write_sum_f64};
use crate::parallel::{filled, for_each_chunk, for_each_chunk2, kernel_threads, Work};
use crate::tensor::Tensor;

/// What [`cross_entropy`] returns: the masked loss sum (cross-entropy plus z-loss), the token
/// count (sum of the mask), and what the backward needs (the softmax probabilities, kept as
/// each row's exponentials and the inverse of their sum: [`CrossEntropy::probs`]; each row's
/// log-partition `log Z`).
#[derive(Clone, Debug)]
pub struct CrossEntropy {
    /// Σ mask·(log Z − logit\[target\] + z_loss·(log Z)²).
    pub loss_sum: f32,
    /// Σ mask.
    pub count: f32,
    /// `exp(logit − max)` per element, its row's maximum subtracted.
    exps: Tensor,
    /// Per row, `1 / Σ exp(logit − max)` (the sum in `f64`, its inverse rounded to `f32`).
    inv_sums: Vec<f32>,
    /// log Z per row.
    pub log_z: Vec<f32>,
}

impl CrossEntropy {
    /// softmax(logits): each element is its exponential times its row's inverse sum, the
    /// product [`cross_entropy_backward`] computes from them (so its `probs · k` is this
    /// tensor's element times `k`, bit for bit).
    pub fn probs(&self) -> Tensor {
        let v = self.exps.shape().last().copied().unwrap_or(0).max(1);
        let mut probs = self.exps.clone();
        for (row, &inv) in probs.data_mut().chunks_mut(v).zip(&self.inv_sums) {
            vectorized(
                #[inline(always)]
                || row.iter_mut().for_each(|p| *p *= inv),
            );
        }
        probs
    }
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
    // Per row, in parallel: the exponentials (written straight from the logits, no copy of
    // them first) and their sum from the same pass, log Z, the inverse sum, and the row's loss
    // term (f64); the terms are then summed in row order. The probabilities are not formed here:
    // the backward multiplies each exponential by its row's inverse sum as it reads it (a pass
    // over the `[N, V]` logits' size less: 311 MB a micro-batch at qwen3-0.6b).
    let mut stats = vec![(0.0f32, 0.0f32, 0.0f64); n];
    // SAFETY: every chunk is visited, and each writes all `v` elements of its row.
    let exps = unsafe {
        filled(logits.len(), |exps| {
            for_each_chunk2(
                exps,
                v,
                &mut stats,
                1,
                kernel_threads(),
                Work::Heavy,
                |i, erow, stat| {
                    let row = &logits.data()[i * v..(i + 1) * v];
                    let (max, sum) = vectorized(
                        #[inline(always)]
                        || {
                            let max = lane_max(row);
                            (max, write_sum_f64(row, erow, |x| exp(x - max)))
                        },
                    );
                    let lz = max as f64 + crate::fixed_math::ln_f64(sum);
                    let m = mask[i];
                    let term = if m != 0.0 {
                        m as f64 * (lz - row[targets[i] as usize] as f64 + z_loss as f64 * lz * lz)
                    } else {
                        0.0
                    };
                    stat[0] = (lz as f32, (1.0 / sum) as f32, term);
                },
            )
        })
    };
    let exps = Tensor::new(logits.shape().to_vec(), exps)?;
    let mut loss = 0.0f64;
    for (&(_, _, term), &m) in stats.iter().zip(mask) {
        if m != 0.0 {
            loss += term;
        }
    }
    Ok(CrossEntropy {
        loss_sum: loss as f32,
        count: mask.iter().sum(),
        exps,
        inv_sums: stats.iter().map(|&(_, inv, _)| inv).collect(),
        log_z: stats.iter().map(|&(lz, _, _)| lz).collect(),
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
        .map(|s| s.bytes((8 * ce.exps.len()) as f64));
    let exps = &ce.exps;
    let v = last_dim(exps, "cross_entropy_backward")?;
    if targets.len() * v != exps.len()
        || mask.len() != targets.len()
        || ce.log_z.len() != targets.len()
        || ce.inv_sums.len() != targets.len()
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
    // Each row written from the exponentials, each made its probability (`e · inv`, as
    // `CrossEntropy::probs` gives it) and scaled in one pass, no copy of them first.
    // SAFETY: every chunk is visited, and each writes all `v` elements of its row.
    let d = unsafe {
        filled(exps.len(), |d| {
            for_each_chunk(d, v, kernel_threads(), Work::Light, |i, row| {
                let k = dloss * mask[i];
                let kp = k * (1.0 + 2.0 * z_loss * ce.log_z[i]);
                let inv = ce.inv_sums[i];
                let erow = &exps.data()[i * v..(i + 1) * v];
                vectorized(
                    #[inline(always)]
                    || {
                        for (x, &e) in row.iter_mut().zip(erow) {
                            x.write(e * inv * kp);
                        }
                    },
                );
                let t = targets[i] as usize;
                row[t].write(erow[t] * inv * kp - k);
            })
        })
    };
    Tensor::new(exps.shape().to_vec(), d)
}
