//! `ferrotext export CHECKPOINT OUT_DIR`: a checkpoint's parameters as a Hugging Face model
//! directory ([`ferrotext_train::export::export_checkpoint`]). The checkpoint is only read; `OUT_DIR`
//! appears complete or not at all.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ferrotext_hf as hf;
use ferrotext_sharding::DType;
use ferrotext_train::TrainError;

use crate::common::{dtype_flag, UsageError};

/// `ferrotext export CHECKPOINT OUT_DIR [--dtype float32|bfloat16] [--step N] [--max-shard-bytes B]`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint directory (`step_SSSSSSSS_micro_MMM`), a checkpoint root (the one `latest`
    /// names is exported), or a run directory (`base_output_directory/run_name`: its
    /// `checkpoints/`).
    checkpoint: PathBuf,
    /// The Hugging Face directory to write. An existing one is replaced only if it is a model
    /// directory (holds `config.json`).
    out: PathBuf,
    /// The dtype of the written tensors: `float32` (exact) or `bfloat16` (rounded to nearest
    /// even); `f32`, `bf16` also.
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Export the step-boundary checkpoint of this step instead of the latest.
    #[arg(long)]
    step: Option<usize>,
    /// Shard the weights into files of at most this many bytes (HF's `max_shard_size`).
    #[arg(long, default_value_t = hf::DEFAULT_SHARD_BYTES)]
    max_shard_bytes: u64,
}

/// Runs `ferrotext export`.
pub fn run(args: &ExportArgs) -> Result<()> {
    let dtype = dtype_flag(&args.dtype, &[DType::F32, DType::BF16])?;
    if args.max_shard_bytes == 0 {
        return Err(UsageError("--max-shard-bytes must be at least 1".into()).into());
    }
    // An output that cannot be written is the user's input, found before anything is read.
    ferrotext_train::io::check_output_path("OUT_DIR", &args.out, true)?;
    let done = ferrotext_train::export::export_checkpoint(
        &args.checkpoint,
        args.step,
        &args.out,
        dtype,
        args.max_shard_bytes,
    )
    .map_err(|e| -> anyhow::Error {
        // A checkpoint the user named that cannot be used is their input, as a bad
        // `load_parameters_path` is: exit 2, not a failed run.
        match e {
            TrainError::Checkpoint { .. } => UsageError(e.to_string()).into(),
            other => other.into(),
        }
    })?;
    let micro = if done.micro_steps > 0 {
        format!(" micro-step {}", done.micro_steps)
    } else {
        String::new()
    };
    println!(
        "exported step {}{micro} of {} to {}: {} ({}), {} tensors",
        done.step,
        done.checkpoint.display(),
        args.out.display(),
        done.model_type.name(),
        dtype.name(),
        done.tensors
    );
    Ok(())
}
