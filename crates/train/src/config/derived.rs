//! What a config implies: the device count, the mesh, the rows of a micro-batch, the gradient
//! bucket in bytes, where outputs go, and the steps `profile` records.
//!
//! Invariant: these read the config and compute; the ones that can fail ([`TrainConfig::mesh`])
//! fail with a usage error naming the key, and the others assume [`TrainConfig::validate`] has
//! passed (they saturate or fall back rather than panic when it has not).

use std::path::Path;
use std::sync::Arc;

use ferrotext_sharding::{AxisType, Mesh};

use super::{ShardMode, TrainConfig};
use crate::error::TrainError;
use crate::optim::Hyper;

impl TrainConfig {
    /// The optimizer keys (`adam_b1`, `adam_b2`, `adam_eps`, `adam_weight_decay`).
    pub fn optimizer_hyper(&self) -> Hyper {
        Hyper {
            b1: self.adam_b1,
            b2: self.adam_b2,
            eps: self.adam_eps,
            weight_decay: self.adam_weight_decay,
        }
    }

    /// Devices of the whole mesh: `num_processes × local_devices` (saturating; `validate`
    /// bounds both).
    pub fn devices(&self) -> usize {
        self.num_processes.saturating_mul(self.local_devices)
    }

    /// The mesh `data × fsdp × [context ×] tensor × expert` over [`TrainConfig::devices`], each
    /// −1 filled, every axis typed by `shard_mode` (`context` only when larger than 1).
    ///
    /// # Errors
    /// More than one −1, a size that is 0 or below −1, or a product that is not the device count.
    pub fn mesh(&self) -> Result<Arc<Mesh>, TrainError> {
        let named = [
            ("data", self.ici_data_parallelism),
            ("fsdp", self.ici_fsdp_parallelism),
            ("tensor", self.ici_tensor_parallelism),
            ("expert", self.ici_expert_parallelism),
            ("context", self.ici_context_parallelism),
        ];
        if named.iter().any(|&(_, s)| s == 0 || s < -1) {
            return Err(TrainError::usage(
                "ici_*_parallelism",
                "ici_*_parallelism values must be positive or -1 (fill)",
            ));
        }
        let fills = named.iter().filter(|&&(_, s)| s == -1).count();
        if fills > 1 {
            return Err(TrainError::usage(
                "ici_*_parallelism",
                "at most one ici_*_parallelism may be -1",
            ));
        }
        let known = named
            .iter()
            .filter(|&&(_, s)| s > 0)
            .try_fold(1i64, |acc, &(_, s)| acc.checked_mul(s))
            .filter(|&k| k <= self.devices() as i64)
            .ok_or_else(|| {
                TrainError::usage(
                    "ici_*_parallelism",
                    format!(
                        "mesh data×fsdp×tensor×expert×context = {}×{}×{}×{}×{} is larger than the {} devices",
                        named[0].1,
                        named[1].1,
                        named[2].1,
                        named[3].1,
                        named[4].1,
                        self.devices()
                    ),
                )
            })?;
        let devices = self.devices() as i64;
        let mut sizes: Vec<(String, usize)> = named
            .iter()
            .map(|&(n, s)| {
                (
                    n.to_string(),
                    if s == -1 {
                        (devices / known.max(1)).max(1) as usize
                    } else {
                        s as usize
                    },
                )
            })
            .collect();
        let product: usize = sizes.iter().map(|(_, s)| s).product();
        if product != self.devices() {
            let processes = if self.num_processes > 1 {
                format!(" × num_processes = {}", self.num_processes)
            } else {
                String::new()
            };
            return Err(TrainError::usage(
                "ici_*_parallelism",
                format!(
                    "mesh data×fsdp×tensor×expert×context = {}×{}×{}×{}×{} = {product} does not match local_devices = {}{processes}",
                    sizes[0].1, sizes[1].1, sizes[2].1, sizes[3].1, sizes[4].1, self.local_devices
                ),
            ));
        }
        // The context axis joins the mesh only where it splits something (a size-1 axis would
        // change every mesh's description for nothing); it follows fsdp, as MaxText orders it.
        let context = sizes.pop().filter(|(_, s)| *s > 1);
        sizes.splice(2..2, context);
        let axis_type = match self.shard_mode {
            ShardMode::Explicit => AxisType::Explicit,
            ShardMode::Auto => AxisType::Auto,
        };
        Ok(Arc::new(Mesh::new(
            sizes.into_iter().map(|(n, s)| (n, s, axis_type)),
        )?))
    }

    /// Sequences per micro-batch over the whole mesh.
    pub fn micro_batch_rows(&self) -> usize {
        (self.per_device_batch_size * self.devices() as f64).round() as usize
    }

    /// [`TrainConfig::grad_bucket_mb`] in bytes (at least one).
    pub fn grad_bucket_bytes(&self) -> usize {
        ((self.grad_bucket_mb * f64::from(1u32 << 20)) as usize).max(1)
    }

    /// Where this run's checkpoints live: `base_output_directory/run_name/checkpoints`, as given
    /// (relative to the current directory when relative; [`crate::RunPlan::checkpoint_root`] is
    /// the run's absolute one).
    pub fn checkpoint_root(&self) -> std::path::PathBuf {
        Path::new(&self.base_output_directory)
            .join(&self.run_name)
            .join("checkpoints")
    }

    /// Where per-step metrics go, as given (see [`TrainConfig::checkpoint_root`];
    /// [`crate::RunPlan::metrics_path`] is the run's absolute one).
    pub fn metrics_path(&self) -> std::path::PathBuf {
        if self.metrics_file.is_empty() {
            Path::new(&self.base_output_directory)
                .join(&self.run_name)
                .join("metrics.jsonl")
        } else {
            self.metrics_file.clone().into()
        }
    }
    /// The steps `profile` records (`profile_steps`, validated by [`TrainConfig::validate`]).
    pub fn profile_step_range(&self) -> std::ops::Range<usize> {
        self.parse_profile_steps().unwrap_or(0..0)
    }
}
