//! The one error type of the `generate` crate, in the classes a caller acts on: the user's input
//! ([`GenerateError::Usage`], `ferrotext` exits 2), a broken call contract, an internal bug, a
//! refused read or write, or a failed op (all exit 1).

use ferrotext_comm::RunError;
use ferrotext_sharding::ShardingError;
use ferrotext_spmd::SpmdError;

/// Everything generation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GenerateError {
    /// A bad option, prompt or tokenizer (the user's input). The message is the whole sentence;
    /// it names the key.
    #[error("{reason}")]
    Usage {
        /// The key or argument at fault (`prompt`, `tokenizer_path`, `temperature`, ...).
        key: String,
        /// What is wrong, naming the key and the value.
        reason: String,
    },
    /// A caller broke the API's contract (parameters that do not fit the decoder).
    #[error("{call}: {reason}")]
    Misuse {
        /// The call that was misused.
        call: &'static str,
        /// What the contract requires.
        reason: String,
    },
    /// An internal invariant broke: a bug in ferrotext.
    #[error("internal error (a bug in ferrotext): {0}")]
    Internal(String),
    /// Writing a token's text (or reading a file) failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or stream.
        path: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// The device thread panicked or could not start.
    #[error(
        "device {device} failed (a bug in ferrotext, or the machine refused a resource): {message}"
    )]
    DeviceFailed {
        /// The device.
        device: usize,
        /// The panic message or the OS error.
        message: String,
    },
    /// An op failed.
    #[error(transparent)]
    Spmd(#[from] SpmdError),
    /// A mesh or spec error.
    #[error(transparent)]
    Sharding(#[from] ShardingError),
}

impl GenerateError {
    /// A usage error naming `key`.
    pub fn usage(key: impl Into<String>, reason: impl Into<String>) -> GenerateError {
        GenerateError::Usage {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// Whether this is the user's to fix (exit code 2), rather than a failure (exit code 1).
    pub fn is_usage(&self) -> bool {
        matches!(self, GenerateError::Usage { .. })
    }
}

impl From<RunError<GenerateError>> for GenerateError {
    /// The device's own error, or the runner's failure in this crate's terms.
    fn from(err: RunError<GenerateError>) -> GenerateError {
        match err {
            RunError::Device { error, .. } => error,
            RunError::Panicked { device, message } => {
                GenerateError::DeviceFailed { device, message }
            }
            placement @ RunError::Placement { .. } => {
                GenerateError::Internal(placement.to_string())
            }
        }
    }
}
