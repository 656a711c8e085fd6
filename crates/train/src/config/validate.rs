//! The checks on a config's values: alone (counts, floats, sizes, the eval and profile keys) and
//! in combination with the model and the mesh.
//!
//! Invariant: every failure is a [`TrainError::Usage`] naming the key to change, one line; the
//! size bounds keep every product of counts exact in `usize` before any is multiplied.

use ferrotext_models::decoder;
use ferrotext_sharding::Mesh;
use ferrotext_tensor::PositionScaling;

use super::{DatasetType, TrainConfig};
use crate::error::TrainError;

/// The largest value accepted for each model dimension, for `local_devices` and for the layer
/// and expert counts: far beyond any real model, small enough that every size product below is
/// exact in `usize`.
const MAX_DIM: usize = 1 << 24;
const MAX_LAYERS: usize = 4096;
const MAX_LOCAL_DEVICES: usize = 1024;
const MAX_PROCESSES: usize = 1 << 16;
/// The longest collective timeout accepted: one week.
const MAX_TIMEOUT_SECONDS: f64 = 7.0 * 86_400.0;

/// A float key that must be finite and within `[lo, hi]` (`lo_open`: strictly above `lo`).
fn check_float(key: &str, v: f64, lo: f64, lo_open: bool, hi: f64) -> Result<(), TrainError> {
    let above = if lo_open { v > lo } else { v >= lo };
    if v.is_finite() && above && v <= hi {
        return Ok(());
    }
    let low = if lo_open { "(" } else { "[" };
    let high = if hi.is_finite() {
        format!("{hi}]")
    } else {
        "∞)".into()
    };
    Err(TrainError::usage(
        key,
        format!("{key} must be a finite number in {low}{lo}, {high}, got {v}"),
    ))
}

impl TrainConfig {
    /// Checks every value and combination once: [`TrainConfig::plan`], keeping only the verdict.
    ///
    /// # Errors
    /// As [`TrainConfig::plan`]: [`TrainError::Usage`] naming the key.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.plan().map(drop)
    }

    /// The eval keys: a split in [0, 0.5], at least one eval batch, and held-out data when
    /// evaluation is on.
    fn check_eval(&self) -> Result<(), TrainError> {
        if !(self.eval_split.is_finite() && (0.0..=0.5).contains(&self.eval_split)) {
            return Err(TrainError::usage(
                "eval_split",
                format!(
                    "eval_split must be a fraction in [0, 0.5], got {}",
                    self.eval_split
                ),
            ));
        }
        if self.eval_steps == 0 {
            return Err(TrainError::usage(
                "eval_steps",
                "eval_steps must be at least 1".to_string(),
            ));
        }
        let held_out = !self.eval_dataset_path.is_empty()
            || self.eval_split > 0.0
            || !self.eval_shards.trim().is_empty()
            || self.dataset_type == DatasetType::Synthetic;
        if self.eval_interval > 0 && !held_out {
            return Err(TrainError::usage(
                "eval_interval",
                "eval_interval needs held-out data: set eval_split (e.g. 0.1) or eval_dataset_path"
                    .to_string(),
            ));
        }
        if !self.eval_shards.trim().is_empty() && self.dataset_type != DatasetType::Shards {
            return Err(TrainError::usage(
                "eval_shards",
                format!(
                    "eval_shards names shards of a shard directory; dataset_type is {:?}",
                    self.dataset_type
                )
                .to_lowercase(),
            ));
        }
        if self.eval_split > 0.0 && self.dataset_type == DatasetType::Synthetic {
            return Err(TrainError::usage(
                "eval_split",
                "eval_split splits a data file; synthetic data has none (its eval sequences come from their own stream)".to_string(),
            ));
        }
        Ok(())
    }

    /// `profile_steps` as the range of steps it names (`a:b`, clipped to the run), or the
    /// default `1..4` (clipped) when empty.
    pub(super) fn parse_profile_steps(&self) -> Result<std::ops::Range<usize>, TrainError> {
        let text = self.profile_steps.trim();
        if text.is_empty() {
            let first = usize::from(self.steps > 1);
            return Ok(first..(first + 3).min(self.steps));
        }
        let bad = || {
            TrainError::usage(
                "profile_steps",
                format!(
                    "profile_steps must be `a:b` with a < b and a < steps ({}), got `{text}`",
                    self.steps
                ),
            )
        };
        let (a, b) = text.split_once(':').ok_or_else(bad)?;
        let a: usize = a.trim().parse().map_err(|_| bad())?;
        let b: usize = b.trim().parse().map_err(|_| bad())?;
        if a >= b || a >= self.steps {
            return Err(bad());
        }
        Ok(a..b.min(self.steps))
    }

    /// `run_name` names one directory under `base_output_directory`: not empty, not `.` or `..`,
    /// no `/` (or NUL) — a run's outputs never land beside or above its base directory.
    fn check_run_name(&self) -> Result<(), TrainError> {
        let name = self.run_name.as_str();
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
            return Err(TrainError::usage(
                "run_name",
                format!(
                    "run_name must name one directory under base_output_directory (no `/`, not \
                     empty, `.` or `..`), got `{}`",
                    name.escape_debug()
                ),
            ));
        }
        Ok(())
    }

    /// Counts that must be positive, the floats, and a whole micro-batch.
    pub(crate) fn check_scalars(&self) -> Result<(), TrainError> {
        for (key, v) in [
            ("local_devices", self.local_devices),
            ("num_processes", self.num_processes),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("max_target_length", self.max_target_length),
            ("steps", self.steps),
            ("checkpoint_period", self.checkpoint_period),
            ("num_vocab_tiling", self.num_vocab_tiling),
        ] {
            if v == 0 {
                return Err(TrainError::usage(key, format!("{key} must be at least 1")));
            }
        }
        self.check_floats()?;
        self.check_run_name()?;
        self.parse_profile_steps()?;
        self.check_eval()?;
        super::precision::built("save_parameters_dtype", self.save_parameters_dtype)?;
        let rows = self.per_device_batch_size * self.devices() as f64;
        if !(rows >= 1.0 && (rows - rows.round()).abs() < 1e-9) {
            return Err(TrainError::usage(
                "per_device_batch_size",
                format!(
                    "per_device_batch_size × devices = {rows} must be a whole number of sequences ≥ 1"
                ),
            ));
        }
        Ok(())
    }

    /// `rope_type: dynamic` grows θ with the length of the sequence it rotates (transformers:
    /// the largest position + 1); packed documents restart their positions and a context
    /// device rotates only its slice of them, so neither sees the sequence's length.
    fn check_dynamic_rope(
        &self,
        model: &decoder::Config,
        context: usize,
    ) -> Result<(), TrainError> {
        if !matches!(model.rope_scaling, Some(PositionScaling::Dynamic { .. })) {
            return Ok(());
        }
        let why = "dynamic RoPE scaling (rope_type `dynamic`): its frequencies follow the \
                   sequence's last position";
        if self.packing {
            return Err(TrainError::usage(
                "packing",
                format!("packing=true cannot be used with {why}, which packed documents restart"),
            ));
        }
        if context > 1 {
            return Err(TrainError::usage(
                "ici_context_parallelism",
                format!(
                    "ici_context_parallelism = {context} cannot be used with {why}, which a \
                     device holding a slice of the sequence does not see"
                ),
            ));
        }
        Ok(())
    }

    /// The combinations that need the model and the mesh: ZeRO-1 and expert parallelism, the
    /// batch over its axes, heads over `tensor`, the data source.
    pub(crate) fn check_combinations(
        &self,
        model: &decoder::Config,
        mesh: &Mesh,
    ) -> Result<(), TrainError> {
        let bad = |key: &str, m: String| Err(TrainError::usage(key, m));
        if self.packing && self.dataset_type != DatasetType::Shards {
            return bad(
                "packing",
                format!(
                    "packing=true needs data whose documents are delimited (dataset_type=shards, \
                     each document ending in EOS); dataset_type={} has no document boundaries",
                    format!("{:?}", self.dataset_type).to_lowercase()
                ),
            );
        }
        self.check_context(model, mesh)?;
        if self.shard_optimizer_over_data && mesh.axis_size("expert")? > 1 {
            return bad(
                "shard_optimizer_over_data",
                "`shard_optimizer_over_data` (ZeRO-1) cannot be combined with expert parallelism yet"
                    .into(),
            );
        }
        if mesh.axis_size("expert")? > 1 && model.moe.is_none() {
            return bad(
                "ici_expert_parallelism",
                format!(
                    "ici_expert_parallelism > 1 needs an MoE model; `{}` is dense",
                    self.model_name
                ),
            );
        }
        if self.shard_optimizer_over_data && mesh.axis_size("fsdp")? > 1 {
            return bad(
                "shard_optimizer_over_data",
                "`shard_optimizer_over_data` (ZeRO-1) cannot be combined with FSDP".into(),
            );
        }
        let batch_parts = mesh.axes_size(&["data", "fsdp", "expert"])?;
        if !self.micro_batch_rows().is_multiple_of(batch_parts) {
            return bad(
                "per_device_batch_size",
                format!(
                    "the micro-batch of {} sequences (per_device_batch_size × devices) is not divisible by data×fsdp×expert = {batch_parts}",
                    self.micro_batch_rows()
                ),
            );
        }
        let tensor = mesh.axis_size("tensor")?;
        for (what, n) in [
            ("base_num_query_heads", model.base_num_query_heads),
            ("base_num_kv_heads", model.base_num_kv_heads),
            ("base_mlp_dim", model.base_mlp_dim),
        ] {
            // MLA's keys and values have one head per query head; it never reads the count.
            let unread = what == "base_num_kv_heads" && model.mla.is_some();
            if n % tensor != 0 && !unread {
                return bad(
                    what,
                    format!("{what} = {n} is not divisible by ici_tensor_parallelism = {tensor}"),
                );
            }
        }
        self.check_data_source(model)
    }

    /// Context parallelism: its axis divides the sequence, and the model has no MoE layer or
    /// multi-token prediction.
    fn check_context(&self, model: &decoder::Config, mesh: &Mesh) -> Result<(), TrainError> {
        let bad = |key: &str, m: String| Err(TrainError::usage(key, m));
        let context = mesh.axis("context").map_or(1, |a| a.size());
        self.check_dynamic_rope(model, context)?;
        if context > 1 {
            let parts = if self.context_parallel_load_balance {
                2 * context
            } else {
                context
            };
            if !self.max_target_length.is_multiple_of(parts) {
                return bad(
                    "ici_context_parallelism",
                    format!(
                        "ici_context_parallelism = {context} needs max_target_length = {} to \
                         split into {parts} equal chunks (each device holds an equal part of \
                         every sequence{})",
                        self.max_target_length,
                        if self.context_parallel_load_balance {
                            ", two chunks under context_parallel_load_balance"
                        } else {
                            ""
                        }
                    ),
                );
            }
            if model.moe.is_some() || model.mtp_num_layers > 0 {
                return bad(
                    "ici_context_parallelism",
                    format!(
                        "ici_context_parallelism = {context} is not supported with {} yet",
                        if model.moe.is_some() {
                            "MoE layers"
                        } else {
                            "multi-token prediction"
                        }
                    ),
                );
            }
        }
        Ok(())
    }

    /// The data source: a path exactly for the types that read one, and byte-level data on a
    /// vocabulary of at least 256.
    fn check_data_source(&self, model: &decoder::Config) -> Result<(), TrainError> {
        let bad = |key: &str, m: String| Err(TrainError::usage(key, m));
        match self.dataset_type {
            DatasetType::Text | DatasetType::Tokens | DatasetType::Shards
                if self.dataset_path.is_empty() =>
            {
                return bad(
                    "dataset_path",
                    format!("dataset_type={:?} needs dataset_path", self.dataset_type)
                        .to_lowercase(),
                );
            }
            // Set without the type that reads it, it would train on other data without a word.
            DatasetType::Corpus | DatasetType::Synthetic if !self.dataset_path.is_empty() => {
                return bad(
                    "dataset_path",
                    format!(
                        "dataset_path names the data of dataset_type text, tokens or shards; \
                         dataset_type is {}, which reads none: set dataset_type, or leave \
                         dataset_path out",
                        if self.dataset_type == DatasetType::Corpus {
                            "corpus"
                        } else {
                            "synthetic"
                        }
                    ),
                );
            }
            _ => {}
        }
        if matches!(self.dataset_type, DatasetType::Corpus | DatasetType::Text)
            && self.tokenizer_path.is_empty()
            && model.vocab_size < 256
        {
            return bad(
                "vocab_size",
                format!(
                    "byte-level data needs vocab_size ≥ 256, got {}",
                    model.vocab_size
                ),
            );
        }
        Ok(())
    }

    /// Every float key finite and within its range.
    fn check_floats(&self) -> Result<(), TrainError> {
        const INF: f64 = f64::INFINITY;
        check_float("learning_rate", self.learning_rate, 0.0, true, INF)?;
        if !(0.0..1.0).contains(&self.warmup_steps_fraction) {
            return Err(TrainError::usage(
                "warmup_steps_fraction",
                format!(
                    "warmup_steps_fraction must be in [0, 1), got {}",
                    self.warmup_steps_fraction
                ),
            ));
        }
        check_float(
            "learning_rate_final_fraction",
            self.learning_rate_final_fraction,
            0.0,
            false,
            1.0,
        )?;
        check_float(
            "gradient_clipping_threshold",
            self.gradient_clipping_threshold,
            0.0,
            false,
            INF,
        )?;
        for (key, v) in [("adam_b1", self.adam_b1), ("adam_b2", self.adam_b2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(TrainError::usage(
                    key,
                    format!("{key} must be in [0, 1), got {v}"),
                ));
            }
        }
        check_float("adam_eps", self.adam_eps, 0.0, true, INF)?;
        check_float("adam_weight_decay", self.adam_weight_decay, 0.0, false, INF)?;
        check_float("z_loss_multiplier", self.z_loss_multiplier, 0.0, false, INF)?;
        if let Some(f) = self.routed_scaling_factor {
            check_float("routed_scaling_factor", f, 0.0, true, INF)?;
        }
        check_float(
            "routed_bias_update_rate",
            self.routed_bias_update_rate,
            0.0,
            false,
            INF,
        )?;
        if let Some(w) = self.load_balance_loss_weight {
            check_float("load_balance_loss_weight", w, 0.0, false, INF)?;
        }
        check_float(
            "per_device_batch_size",
            self.per_device_batch_size,
            0.0,
            true,
            MAX_DIM as f64,
        )?;
        check_float("grad_bucket_mb", self.grad_bucket_mb, 0.0, true, 1e6)?;
        check_float(
            "collective_timeout_seconds",
            self.collective_timeout_seconds,
            0.0,
            true,
            MAX_TIMEOUT_SECONDS,
        )
    }

    /// Every count and size within the bounds that keep the size products exact, before any of
    /// them is multiplied (the model, the mesh and the batch are built from these).
    pub(crate) fn check_sizes(&self) -> Result<(), TrainError> {
        let over = |key: &str, v: usize, max: usize| -> Result<(), TrainError> {
            if v > max {
                return Err(TrainError::usage(
                    key,
                    format!("{key} = {v} is larger than the largest supported value, {max}"),
                ));
            }
            Ok(())
        };
        over("local_devices", self.local_devices, MAX_LOCAL_DEVICES)?;
        over("num_processes", self.num_processes, MAX_PROCESSES)?;
        over("max_target_length", self.max_target_length, MAX_DIM)?;
        over("num_vocab_tiling", self.num_vocab_tiling, MAX_DIM)?;
        over(
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            MAX_DIM,
        )?;
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("base_emb_dim", self.base_emb_dim),
            ("base_num_query_heads", self.base_num_query_heads),
            ("base_num_kv_heads", self.base_num_kv_heads),
            ("head_dim", self.head_dim),
            ("base_mlp_dim", self.base_mlp_dim),
            ("moe_mlp_dim", self.moe_mlp_dim),
        ] {
            over(key, v.unwrap_or(0), MAX_DIM)?;
        }
        for (key, v) in [
            ("base_num_decoder_layers", self.base_num_decoder_layers),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("shared_experts", self.shared_experts),
            ("first_num_dense_layers", self.first_num_dense_layers),
        ] {
            over(key, v.unwrap_or(0), MAX_LAYERS)?;
        }
        for (key, v) in [
            ("ici_data_parallelism", self.ici_data_parallelism),
            ("ici_fsdp_parallelism", self.ici_fsdp_parallelism),
            ("ici_tensor_parallelism", self.ici_tensor_parallelism),
            ("ici_expert_parallelism", self.ici_expert_parallelism),
        ] {
            if v > (MAX_LOCAL_DEVICES * MAX_PROCESSES) as i64 {
                return Err(TrainError::usage(
                    key,
                    format!("{key} = {v} is larger than the largest supported mesh"),
                ));
            }
        }
        Ok(())
    }
}
