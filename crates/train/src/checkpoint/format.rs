//! The checkpoint format's constants and which config keys a resume may change: facts the
//! manifest, the problems that name them and the resume check all read, in a file that imports
//! nothing of the crate.

/// The manifest format this build writes and the only one it reads (3: every parameter is stored
/// under its Hugging Face names and orientation, MoE experts unstacked; 2 stored the router and
/// `kv_a_proj_with_mqa` in ferrotext's own orientation and stacked experts, which a square matrix
/// would load silently transposed; 1 had no manifest seal). Older formats are refused.
pub const FORMAT_VERSION: u32 = 3;

/// The manifest's seal: `<sha256 hex>  manifest.json`, as `sha256sum` writes it.
pub const MANIFEST_SEAL: &str = "manifest.sha256";

/// Config keys that may differ between the run that saved a checkpoint and the run that restores
/// it: the length and learning-rate schedule, paths and outputs, checkpoint cadence, run
/// policy, and the compute `dtype` (master weights and optimizer state are float32 in every
/// dtype; [`dtype_change`](super::dtype_change) words the change for the run's output). Every other key (model, data, batch, optimizer, seeds, tokenizer) must be equal;
/// the layout keys ([`is_layout_key`]) may change as long as the global batch of a step stays
/// the same (and, inside a step, its micro-batches).
pub const RESUMABLE_KEYS: &[&str] = &[
    "steps",
    "learning_rate",
    "warmup_steps_fraction",
    "learning_rate_final_fraction",
    "dataset_path",
    "load_parameters_path",
    "save_parameters_path",
    "save_parameters_dtype",
    "dtype",
    "remat_policy",
    "num_vocab_tiling",
    "matmul_bf16_fallback",
    "base_output_directory",
    "run_name",
    "metrics_file",
    "tensorboard",
    "enable_checkpointing",
    "checkpoint_period",
    "checkpoint_micro_batch_period",
    "checkpoint_keep",
    "resume",
    "collective_timeout_seconds",
    "nan_policy",
    "grad_bucket_mb",
    "overlap_grad_reduce",
    "deterministic",
    "layout_invariant",
    "profile",
    "profile_steps",
    "eval_interval",
    "eval_steps",
    "eval_dataset_path",
];

/// The layout keys: a checkpoint taken at a step boundary restores onto another mesh, mode or
/// split of the step into micro-batches as long as the global batch of a step
/// ([`TrainConfig::micro_batch_rows`](crate::TrainConfig::micro_batch_rows) × `gradient_accumulation_steps`) is the same — a job that
/// lost a host resumes on fewer devices with more micro-batches and reads the same sequences.
/// A checkpoint taken inside a step also needs the same micro-batches (global micro-batch and
/// `gradient_accumulation_steps`), since its pending gradients cover the ones already run.
pub fn is_layout_key(key: &str) -> bool {
    matches!(
        key,
        "local_devices"
            | "num_processes"
            | "shard_mode"
            | "shard_optimizer_over_data"
            | "per_device_batch_size"
            | "gradient_accumulation_steps"
    ) || (key.starts_with("ici_") && key.ends_with("_parallelism"))
}
