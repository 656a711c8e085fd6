//! The one error type of the cost model, [`CostError`], and its classes: the same as
//! [`ferrotext_train::TrainError`]'s, so `ferrotext plan --cluster` exits as it did when the
//! cost model returned `TrainError` (2 for the user's input, 1 for everything else).
//!
//! Invariant: every variant carries the values it names (the cluster's layout, the throughput,
//! the measured numbers); a training-layer error inside keeps its own class.

use ferrotext_sharding::ShardingError;
use ferrotext_train::{ErrorClass, TrainError};

use crate::ClusterSpecError;

/// Everything the cost model can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CostError {
    /// The `--cluster` text does not parse (usage class).
    #[error(transparent)]
    ClusterSpec(#[from] ClusterSpecError),
    /// The config does not fit the cluster: its mesh's axes do not form `hosts ×
    /// devices_per_host` devices, or another value is invalid there (usage class).
    #[error(
        "on --cluster hosts={hosts},devices_per_host={devices_per_host} ({devices} devices): \
         {error}"
    )]
    NotOnCluster {
        /// The cluster's hosts.
        hosts: usize,
        /// Devices on each host.
        devices_per_host: usize,
        /// `hosts × devices_per_host`.
        devices: usize,
        /// What the config's validation said.
        error: Box<TrainError>,
    },
    /// A device throughput that is not positive and finite (usage class).
    #[error("the device throughput must be positive and finite, got {gflops} GFLOP/s")]
    BadThroughput {
        /// The throughput given, GFLOP/s.
        gflops: f64,
    },
    /// A measurement from which no positive, finite throughput follows (usage class).
    #[error(
        "no effective throughput from {tokens} tokens × {flops_per_token} FLOP in {seconds} s"
    )]
    NoThroughput {
        /// Tokens measured.
        tokens: f64,
        /// Training FLOPs per token.
        flops_per_token: f64,
        /// The time they took, seconds.
        seconds: f64,
    },
    /// A micro-batch measurement asked to time nothing (usage class).
    #[error("measuring a micro-batch needs at least one timed run")]
    NothingTimed,
    /// A device thread measuring a micro-batch panicked: a bug in ferrotext (failure class).
    #[error("device {device} measuring a micro-batch panicked (a bug in ferrotext)")]
    MeasurePanicked {
        /// The measuring device.
        device: usize,
    },
    /// A kernel refused a matmul measurement: a bug for valid sizes (failure class).
    #[error("measuring a {n}×{n} matmul: {error}")]
    Kernel {
        /// The matmul's size.
        n: usize,
        /// The kernel's error.
        error: ferrotext_tensor::TensorError,
    },
    /// A mesh axis the trace names and the mesh lacks: a bug in planning (failure class).
    #[error(transparent)]
    Sharding(#[from] ShardingError),
    /// Planning, validating or running the training layer failed (its own class).
    #[error(transparent)]
    Train(#[from] TrainError),
}

impl CostError {
    /// What kind of failure this is, in the training layer's classes.
    pub fn class(&self) -> ErrorClass {
        match self {
            CostError::ClusterSpec(_)
            | CostError::NotOnCluster { .. }
            | CostError::BadThroughput { .. }
            | CostError::NoThroughput { .. }
            | CostError::NothingTimed => ErrorClass::Usage,
            CostError::MeasurePanicked { .. }
            | CostError::Kernel { .. }
            | CostError::Sharding(_) => ErrorClass::Failure,
            CostError::Train(e) => e.class(),
        }
    }

    /// True for bad user input (the usage class): `ferrotext` exits with code 2.
    pub fn is_usage(&self) -> bool {
        self.class() == ErrorClass::Usage
    }
}
