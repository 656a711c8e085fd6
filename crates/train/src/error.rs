//! The one error type of the `train` layer, in four classes a caller can act on
//! ([`TrainError::class`]):
//!
//! * **usage** — the user's input is wrong (a key, a value, a combination, a file the user
//!   named): fix the input and run again. `ferrotext` exits with code 2.
//! * **misuse** — a caller of the engine API broke its contract (`update` with nothing
//!   accumulated, `fwd_bwd` after the step was closed, initial values that do not fit): a bug
//!   in that caller.
//! * **io** — the machine refused a read or write that was valid when the run started.
//! * **failure** — the run failed: a device panicked (a bug in ferrotext), an op or collective
//!   failed, a checkpoint cannot be used, a step diverged, an internal invariant broke.
//!
//! Every class but usage exits with code 1: a bug in ferrotext is never reported as the user's
//! mistake.

use ferrotext_comm::RunError;
use ferrotext_sharding::ShardingError;
use ferrotext_spmd::SpmdError;

/// Everything training can fail with. See the module docs for the four classes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A bad value or combination of config keys (caught before anything runs). The message is
    /// the whole sentence; it names the key.
    #[error("{reason}")]
    Usage {
        /// The key at fault (the first one, for a combination).
        key: String,
        /// What is wrong, as one sentence naming the key and the value.
        reason: String,
    },
    /// A command-line argument that is not `key=value` (usage class).
    #[error("`{argument}` is not `key=value`")]
    NotKeyValue {
        /// The argument as given.
        argument: String,
    },
    /// A config file that cannot be read: missing, not a regular file, refused (usage class).
    #[error("config: {reason}")]
    ConfigUnreadable {
        /// The file.
        path: String,
        /// Why it cannot be read; names the file.
        reason: String,
    },
    /// A config file that is not UTF-8 text (usage class).
    #[error("config {path} is not UTF-8 text")]
    ConfigNotUtf8 {
        /// The file.
        path: String,
    },
    /// A config file that is not valid TOML (usage class).
    #[error("config {path}: {message}")]
    ConfigSyntax {
        /// The file.
        path: String,
        /// The TOML parser's message (it names the line).
        message: String,
    },
    /// A key whose value is not one of its choices (usage class).
    #[error("{key} must be {choices}, got `{value}`")]
    NotAChoice {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// The choices, in words (`f32 or bf16`).
        choices: &'static str,
    },
    /// A precision key whose value names a dtype but a combination that is not built (usage
    /// class): `weight_dtype` narrower than `dtype` or not float32, `grad_dtype=bfloat16` with
    /// `layout_invariant=true`, or
    /// `dtype=bfloat16` on a kernel without a bf16 product.
    #[error("{key}={value} {problem}")]
    Precision {
        /// The key (`dtype`, `weight_dtype`, `grad_dtype`).
        key: &'static str,
        /// The value given.
        value: String,
        /// Why it is refused, and what to set instead.
        problem: PrecisionProblem,
    },
    /// An output of the run (named by `key`) at a path that cannot take it (usage class).
    #[error("{key}: {path} {problem}")]
    Output {
        /// The key that names the output (`metrics_file`).
        key: &'static str,
        /// The path.
        path: String,
        /// What is wrong with it.
        problem: OutputProblem,
    },
    /// Data that cannot be used (usage class: the user named it); the [`DataError`] names the
    /// path, the shard, the field, the expected and found values.
    ///
    /// [`DataError`]: ferrotext_data::DataError
    #[error("data: {0}")]
    Data(#[from] ferrotext_data::DataError),
    /// A parameter file that cannot be used (usage class: the user named it).
    #[error("parameters {path}: {reason}")]
    Params {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A caller of the engine API broke its contract: a bug in the caller, not bad input.
    #[error("{call}: {reason}")]
    Misuse {
        /// The call that was misused (`Engine::update`).
        call: &'static str,
        /// What the contract requires.
        reason: String,
    },
    /// An internal invariant of ferrotext broke: a bug in ferrotext.
    #[error("internal error (a bug in ferrotext): {0}")]
    Internal(String),
    /// A checkpoint that cannot be used (missing file, bad checksum, wrong shape, newer format,
    /// a name outside its directory).
    #[error("checkpoint {path}: {problem}")]
    Checkpoint {
        /// The file or directory.
        path: String,
        /// What is wrong, with the values it names.
        problem: crate::checkpoint::problem::CheckpointProblem,
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
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl From<ferrotext_hf::HfError> for TrainError {
    /// The same error in this layer's terms (the same message and class: a model file the user
    /// named is usage, a refused read or write is io).
    fn from(e: ferrotext_hf::HfError) -> TrainError {
        match e {
            ferrotext_hf::HfError::Params { path, reason } => TrainError::Params { path, reason },
            ferrotext_hf::HfError::Io { path, source } => TrainError::Io { path, source },
            other => TrainError::Internal(other.to_string()),
        }
    }
}

/// Why a precision key's value is refused; each prints after `key=value`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrecisionProblem {
    /// `weight_dtype` keeps fewer mantissa bits than `dtype`.
    #[error(
        "is narrower than dtype={dtype}: the master weights must hold at least the compute \
         precision; set weight_dtype=float32"
    )]
    NarrowerThanDtype {
        /// The compute dtype.
        dtype: &'static str,
    },
    /// `weight_dtype` other than float32.
    #[error(
        "is not built: the master weights and the optimizer state are float32 (the model \
         converts the weights to dtype at use); set weight_dtype=float32"
    )]
    MasterWeightsAreFloat32,
    /// `grad_dtype=bfloat16` with `layout_invariant=true`.
    #[error(
        "with layout_invariant=true cannot hold its promise: each device's partial gradient sum \
         is rounded to bf16 once per step, and where that rounding falls depends on how the \
         batch is split over devices, so the bits differ between layouts; set \
         grad_dtype=float32 or layout_invariant=false"
    )]
    NotLayoutInvariant,
    /// `dtype=bfloat16` on a matrix-product kernel without a bf16 product.
    #[error(
        "needs a bf16 × bf16 → f32 matrix product and {kernel} (FERROTEXT_MATMUL) has none: set \
         matmul_bf16_fallback=true to run bf16 products on ferrotext's own kernel, or \
         FERROTEXT_MATMUL=mkl or portable, or dtype=float32"
    )]
    NoBf16Product {
        /// The kernel, as `ferrotext_tensor::matmul_kernel` describes it.
        kernel: String,
    },
}

/// Why an output path cannot be written; each prints after the path ("… is a directory").
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutputProblem {
    /// A name component longer than file systems allow.
    #[error("has a name component of {bytes} bytes; file systems allow {max}")]
    NameTooLong {
        /// The component's length.
        bytes: usize,
        /// The longest name allowed.
        max: usize,
    },
    /// The path is empty.
    #[error("is empty")]
    Empty,
    /// A directory was wanted and something else is there.
    #[error("exists and is not a directory")]
    NotADirectory,
    /// A file was wanted and a directory is there.
    #[error("is a directory")]
    IsADirectory,
    /// A file was wanted and something that is not a regular file is there.
    #[error("is not a regular file")]
    NotARegularFile,
    /// A model directory (replaced whole) was wanted and another directory is there.
    #[error(
        "exists and is not a model directory (no config.json); name a new directory, or a file \
         ending in .safetensors"
    )]
    NotAModelDirectory,
    /// The nearest existing ancestor is not a directory.
    #[error("cannot be created: {ancestor} is not a directory")]
    AncestorNotADirectory {
        /// The ancestor.
        ancestor: String,
    },
    /// An existing file that is not one of ferrotext's metrics files: it is not overwritten.
    #[error(
        "exists and its line {line} is not a metrics line (a JSON object with a `step`): it is \
         not overwritten; name another file, or move this one away"
    )]
    NotAMetricsFile {
        /// The first line that is not a metrics line (1-based).
        line: usize,
    },
    /// The directory refused a new file (a read-only mount, no permission, a full disk).
    #[error("cannot be written: {dir} refuses new files ({error})")]
    Refused {
        /// The directory probed.
        dir: String,
        /// The operating system's error.
        error: String,
    },
}

/// The class of a [`TrainError`]: what the caller can do about it (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
    /// The user's input is wrong.
    Usage,
    /// A caller broke the engine API's contract.
    Misuse,
    /// A read or write failed.
    Io,
    /// The run failed (a device panic, an op, a checkpoint, divergence, an internal bug).
    Failure,
}

impl TrainError {
    /// A [`TrainError::Usage`] for `key`.
    pub fn usage(key: impl Into<String>, reason: impl Into<String>) -> TrainError {
        TrainError::Usage {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// What kind of failure this is (a run left behind is classed by its first failure).
    pub fn class(&self) -> ErrorClass {
        match self {
            TrainError::Usage { .. }
            | TrainError::NotKeyValue { .. }
            | TrainError::ConfigUnreadable { .. }
            | TrainError::ConfigNotUtf8 { .. }
            | TrainError::ConfigSyntax { .. }
            | TrainError::NotAChoice { .. }
            | TrainError::Precision { .. }
            | TrainError::Output { .. }
            | TrainError::Data(_)
            | TrainError::Params { .. } => ErrorClass::Usage,
            TrainError::Misuse { .. } => ErrorClass::Misuse,
            TrainError::Io { .. } => ErrorClass::Io,
            TrainError::LeftRunning { .. }
            | TrainError::Internal(_)
            | TrainError::Checkpoint { .. }
            | TrainError::AccumulatorType { .. }
            | TrainError::NonFinite { .. }
            | TrainError::DeviceFailed { .. }
            | TrainError::Spmd(_)
            | TrainError::Sharding(_) => ErrorClass::Failure,
        }
    }

    /// True for bad user input (the usage class): `ferrotext` exits with code 2.
    pub fn is_usage(&self) -> bool {
        self.class() == ErrorClass::Usage
    }
}

impl From<RunError<TrainError>> for TrainError {
    fn from(err: RunError<TrainError>) -> TrainError {
        match err {
            RunError::Device { error, .. } => error,
            RunError::Panicked { device, message } => TrainError::DeviceFailed { device, message },
            // The mesh the user asked for cannot be split over the processes started.
            placement @ RunError::Placement { .. } => {
                TrainError::usage("num_processes", placement.to_string())
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_decide_the_exit_code() {
        assert!(TrainError::usage("steps", "steps must be at least 1").is_usage());
        assert_eq!(
            TrainError::usage("steps", "steps must be at least 1").to_string(),
            "steps must be at least 1"
        );
        let misuse = TrainError::Misuse {
            call: "Engine::update",
            reason: "no fwd_bwd since the last update".into(),
        };
        assert_eq!(misuse.class(), ErrorClass::Misuse);
        assert_eq!(
            misuse.to_string(),
            "Engine::update: no fwd_bwd since the last update"
        );
        let panic = TrainError::DeviceFailed {
            device: 3,
            message: "boom".into(),
        };
        assert_eq!(panic.class(), ErrorClass::Failure);
        let left = TrainError::LeftRunning {
            error: Box::new(panic),
            devices: vec![1],
        };
        assert!(!left.is_usage());
        let io = TrainError::Io {
            path: "x".into(),
            source: std::io::Error::other("full"),
        };
        assert_eq!(io.class(), ErrorClass::Io);
    }
}
