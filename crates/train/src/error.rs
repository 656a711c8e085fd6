//! The one error type of the `train` layer.

use ferrotext_comm::RunError;
use ferrotext_sharding::ShardingError;
use ferrotext_spmd::SpmdError;

/// Everything training can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A bad config value or combination (caught before anything runs).
    #[error("{0}")]
    Config(String),
    /// A data file that cannot be used.
    #[error("data: {0}")]
    Data(String),
    /// A parameter file that cannot be used.
    #[error("parameters {path}: {reason}")]
    Params {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint that cannot be used (missing file, bad checksum, wrong shape, newer format,
    /// a name outside its directory).
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or directory.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A gradient arrived typed differently from what the gate promised its accumulator —
    /// typically a helper rebuilt the parameter's spec without its reduced tag — and the step
    /// stops instead of reducing early.
    #[error(
        "gradient of `{param}` arrived as `{got}` but its accumulator is `{expected}`: the \
         deferral gate promised unreduced {expected_unreduced:?}; a spec rebuilt somewhere dropped \
         the parameter's reduced tag (use `carry_reduced`)"
    )]
    AccumulatorType {
        /// The parameter.
        param: String,
        /// The accumulator's type.
        expected: String,
        /// The gradient's type.
        got: String,
        /// The unreduced axes promised.
        expected_unreduced: Vec<String>,
    },
    /// A step whose loss or gradient norm is not finite, under `nan_policy=stop`: nothing of
    /// the step was applied.
    #[error(
        "step {step}: the loss ({loss}) or the gradient norm ({grad_norm}) is not finite; the \
         step was not applied (nan_policy=skip_step drops such steps and goes on)"
    )]
    NonFinite {
        /// The step (0-based).
        step: usize,
        /// Its mean token loss.
        loss: f64,
        /// Its global gradient norm.
        grad_norm: f64,
    },
    /// A device thread panicked or could not start: a bug in ferrotext or a resource the
    /// machine refused, never the user's input.
    #[error(
        "device {device} failed (a bug in ferrotext, or the machine refused a resource): {message}"
    )]
    DeviceFailed {
        /// The device.
        device: usize,
        /// The panic message or the OS error.
        message: String,
    },
    /// The run failed, and some device threads were still busy a collective timeout later: they
    /// were left running and the run returned without them.
    #[error("{error}; devices {devices:?} were still running and were left behind")]
    LeftRunning {
        /// The first failure.
        error: Box<TrainError>,
        /// The devices left running.
        devices: Vec<usize>,
    },
    /// An op failed (type error, collective failure).
    #[error(transparent)]
    Spmd(#[from] SpmdError),
    /// A mesh or spec error.
    #[error(transparent)]
    Sharding(#[from] ShardingError),
    /// Writing outputs failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl From<RunError<TrainError>> for TrainError {
    fn from(err: RunError<TrainError>) -> TrainError {
        match err {
            RunError::Device { error, .. } => error,
            RunError::Panicked { device, message } => TrainError::DeviceFailed { device, message },
            placement @ RunError::Placement { .. } => TrainError::Config(placement.to_string()),
        }
    }
}

impl From<ferrotext_comm::RunFailure<TrainError>> for TrainError {
    fn from(failure: ferrotext_comm::RunFailure<TrainError>) -> TrainError {
        let error = TrainError::from(failure.error);
        if failure.left_running.is_empty() {
            return error;
        }
        TrainError::LeftRunning {
            error: Box::new(error),
            devices: failure.left_running,
        }
    }
}

impl From<ferrotext_comm::CommError> for TrainError {
    fn from(err: ferrotext_comm::CommError) -> TrainError {
        TrainError::Spmd(err.into())
    }
}

impl From<ferrotext_tensor::TensorError> for TrainError {
    fn from(err: ferrotext_tensor::TensorError) -> TrainError {
        TrainError::Spmd(err.into())
    }
}
