//! The model kernels, each forward next to its backward: softmax, RMSNorm, RoPE, SiLU,
//! cross-entropy with a token mask, gather / scatter-add along an axis, top-k.
//!
//! Layouts are row-major; "rows" are every dimension but the last. These are memory-bound loops:
//! one pass over the data for the forward, one or two for the backward; no allocation inside
//! the row loops. They run on this thread's kernel budget ([`crate::set_kernel_threads`]),
//! rows (or fixed blocks of elements) split across tasks; every row is computed by the same
//! code on any thread and sums across rows run in row order afterwards, so the bits do not
//! depend on the thread count.
//!
//! One file per job: [`softmax`] (softmax, causal softmax, their backward), [`norm`] (RMSNorm,
//! RoPE), [`activation`] (SwiGLU, SiLU), [`cross_entropy`], [`index`] (gather, scatter-add,
//! top-k). Shared here: the shape checks and the fixed block size every split uses.

use crate::error::TensorError;
use crate::tensor::Tensor;

mod activation;
mod cross_entropy;
mod index;
mod norm;
mod softmax;
#[cfg(test)]
mod tests;

pub(crate) use activation::{geglu_grads, geglu_value, swiglu_grads, swiglu_value};
pub use activation::{
    glu, glu_backward, silu, silu_backward, swiglu, swiglu_backward, GluActivation,
};
pub use cross_entropy::{cross_entropy, cross_entropy_backward, CrossEntropy};
pub use index::{gather, scatter_add, scatter_add_into, scatter_add_into_parts, top_k};
pub use norm::{rms_norm, rms_norm_backward, rope};
pub(crate) use norm::{rms_norm_backward_slices, rms_norm_slices, statistics_fit, RowOut};
pub use softmax::{causal_softmax, softmax_backward_scaled, softmax_last, softmax_last_backward};

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

/// Elementwise kernels split their data into blocks of this many elements (a fixed size, so
/// the split never depends on the thread count).
const BLOCK: usize = 4096;

/// Rows of `n` elements a row kernel takes per chunk: about [`BLOCK`] elements, at least one
/// row, so short rows (QK-norm's `head_dim`) share one call instead of paying one each.
fn rows_per_chunk(n: usize) -> usize {
    (BLOCK / n.max(1)).max(1)
}
