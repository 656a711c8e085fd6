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
    /// bf16 products were asked of a matrix-product kernel that has none (named by
    /// `FERROTEXT_MATMUL`), and the fallback to the portable kernel was not allowed.
    #[error(
        "{kernel} has no bf16 × bf16 → f32 product; use FERROTEXT_MATMUL=mkl or portable, or \
         allow the fallback to the portable kernel"
    )]
    NoBf16Product {
        /// The kernel, as `matmul_kernel` describes it.
        kernel: String,
    },
}

impl TensorError {
    pub(crate) fn shape(op: &'static str, reason: String) -> TensorError {
        TensorError::Shape { op, reason }
    }
}
