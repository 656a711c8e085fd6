//! Where a walk's gradients go: the [`GradientSink`] trait (a gradient accumulator, which may
//! offer buffers for the backward's kernels to add into), and the sink without buffers that
//! `vjp` / `value_and_grad` use.

use ferrotext_sharding::ArrayType;

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;

/// Where [`Ctx::value_and_grad_into`](crate::Ctx::value_and_grad_into) delivers each parameter's gradient: a gradient
/// accumulator, which may offer buffers for the backward's kernels to add into in place.
pub trait GradientSink {
    /// A buffer holding parameter `k`'s running sum as a row-major local block of `ty` (the
    /// gradient's type), that the backward may add `k`'s whole gradient into, given as
    /// consecutive parts of equal length — part `j` of `p` holds elements `j·len/p ..
    /// (j+1)·len/p` of the block: one part for a contiguous buffer, one per segment where the
    /// buffer keeps the block in segments (a reduce-scatter bucket's); `None` to be handed the
    /// gradient instead. Must return `None` for a type other than the buffer's.
    fn buffer(&mut self, k: usize, ty: &ArrayType) -> Option<Vec<&mut [f32]>>;

    /// Parameter `k`'s gradient is final: `Some(grad)` when it is handed over, `None` when it
    /// was added into [`GradientSink::buffer`]`(k)`. Called once per parameter.
    ///
    /// # Errors
    /// The sink's own (the walk stops there).
    fn finished(
        &mut self,
        cx: &mut Ctx<'_>,
        k: usize,
        grad: Option<&Array>,
    ) -> Result<(), SpmdError>;
}

/// A sink without buffers that hands every gradient to a callback.
pub(super) struct Handed<'f>(
    pub(super) &'f mut dyn FnMut(&mut Ctx<'_>, usize, &Array) -> Result<(), SpmdError>,
);

impl GradientSink for Handed<'_> {
    fn buffer(&mut self, _: usize, _: &ArrayType) -> Option<Vec<&mut [f32]>> {
        None
    }

    fn finished(
        &mut self,
        cx: &mut Ctx<'_>,
        k: usize,
        grad: Option<&Array>,
    ) -> Result<(), SpmdError> {
        match grad {
            Some(g) => (self.0)(cx, k, g),
            None => Err(SpmdError::Internal {
                op: "value_and_grad",
                invariant: "a gradient went into a buffer the sink did not offer",
            }),
        }
    }
}

/// The gradients of a walk whose sink had no buffers: every one was handed over.
pub(super) fn all_handed(grads: Vec<Option<Array>>) -> Result<Vec<Array>, SpmdError> {
    grads
        .into_iter()
        .map(|g| {
            g.ok_or(SpmdError::Internal {
                op: "value_and_grad",
                invariant: "a gradient missing from a walk without buffers",
            })
        })
        .collect()
}
