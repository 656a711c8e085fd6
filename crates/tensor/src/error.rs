//! The one error type of the `tensor` layer.

/// A kernel was called with shapes or arguments that do not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// Shapes or parameters do not fit the kernel.
    #[error("`{op}`: {reason}")]
    Shape {
        /// The kernel.
        op: &'static str,
        /// What does not fit.
        reason: String,
    },
}

impl TensorError {
    pub(crate) fn shape(op: &'static str, reason: String) -> TensorError {
        TensorError::Shape { op, reason }
    }
}
