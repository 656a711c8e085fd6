//! Checkpoints of the engine's whole state, between any two calls — also in the middle of a
//! step.
//!
//! A checkpoint is a directory `step_SSSSSSSS_micro_MMM` under a root, holding
//! `params.safetensors` (HF names and orientation, as `load_parameters_path` reads),
//! `optimizer.safetensors` (the optimizer's state, slot by slot: AdamW's moments `m/<name>`,
//! `v/<name>`; none for SGD), `accumulator.safetensors`
//! (mid-step only: the *reduced* gradient totals `acc/<name>`), and `manifest.json` (format
//! version, config, step, micro-step count, token denominator, mesh, per-tensor shardings, and
//! the SHA-256 of every file, the data position), sealed by `manifest.sha256` (the manifest's
//! own SHA-256, in `sha256sum` format). `latest` in the root names the newest checkpoint.
//!
//! Invariants: a checkpoint is written into a hidden temporary directory, every file fsynced,
//! then renamed into place, and only then is `latest` replaced (write + rename) — a crash at any
//! point leaves the previous checkpoint as `latest`, and a partial directory is never named by
//! it. Saving to a name that exists moves the old directory aside (`.old_<name>`) only once the
//! new one is complete, renames the new one in, and then removes the old one; start-up
//! ([`prepare_resume`]) puts back an old directory whose replacement never arrived. Loading
//! validates everything (version, the manifest's seal, its numbers against the files and the
//! config, the config against the current one, file names, checksums, dtypes, shapes) and builds
//! the whole state before touching the engine: an error never leaves a half-restored engine.
//!
//! Resume is strict: a `latest` that is not a plain file naming a complete checkpoint is an
//! error, never a silent fresh start (`resume=fresh` starts over and moves the old checkpoint
//! directory aside). Only the keys in [`RESUMABLE_KEYS`] (and the layout keys, see
//! [`is_layout_key`], as long as the global batch is the same) may differ between the run
//! that saved a checkpoint and the one that restores it.
//!
//! Mid-step: saving reduces the pending accumulator on the way out (one all-reduce per gradient,
//! in trace phase `checkpoint`) and stores the true totals; restoring re-splits them onto the
//! layout the current gate expects (the value on the index-0 device of each `data` group, zeros
//! elsewhere), so the pending reduction reproduces them exactly — whatever mesh or mode the
//! checkpoint came from. The file also keeps every device's own partial block: restored onto
//! the same mesh and layout, each device takes its block back, so the rest of the step sums in
//! the same order as an uninterrupted run and the weights come out bit for bit the same.

//!
//! # Files
//!
//! | file | what it owns |
//! |---|---|
//! | `mod.rs` | checkpoint names, the small I/O helpers every part shares |
//! | `format.rs` | the format's constants, [`RESUMABLE_KEYS`] and [`is_layout_key`]: what a checkpoint is and which config changes a resume allows |
//! | `manifest.rs` | [`Manifest`]: reading it (version, then seal, then fields) and checking its numbers against its files, config and directory |
//! | `save.rs` | [`Engine::save_checkpoint`](crate::Engine::save_checkpoint): gathering the state, the temporary directory, fsync, rename, `latest`, pruning |
//! | `verify.rs` | reading a file verified: listed, plain name, checksum, tensor list, dtype, shape, finite values |
//! | `load.rs` | [`Engine::restore_checkpoint`](crate::Engine::restore_checkpoint) and [`read_parameters`]: verified files → the whole state → the engine |
//! | `resume.rs` | [`prepare_resume`], [`latest`], [`resolve`]: start-up of a checkpoint root, and which config changes a resume allows |
//! | `problem.rs` | [`CheckpointProblem`]: what is wrong with a checkpoint, as values (file, checksum, shape, version, step, key) |

use std::io::Write;
use std::path::Path;

use crate::config::TrainConfig;
use crate::engine::EngineState;
use crate::error::TrainError;

mod format;
mod load;
mod manifest;
pub(crate) mod problem;
mod resume;
mod save;
mod verify;

pub use format::{is_layout_key, FORMAT_VERSION, MANIFEST_SEAL, RESUMABLE_KEYS};
pub use load::read_parameters;
pub(crate) use load::read_params;
pub(crate) use manifest::{read_manifest, validate_manifest};
pub use manifest::{Manifest, TensorEntry};
pub use problem::{CheckpointProblem, ConfigChange, LatestProblem, ManifestMismatch};
pub use resume::{dtype_change, latest, prepare_resume, resolve};
pub(crate) use verify::verify_listed_files;

/// Maps an I/O failure on `path` to [`TrainError::Io`].
fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A [`TrainError::Checkpoint`] naming `path` and the problem.
fn ckpt_err(path: &Path, problem: CheckpointProblem) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        problem,
    }
}

/// The bytes of the checkpoint file `path`, opened by `ferrotext_files`' rule (a regular file).
fn read_file(path: &Path) -> Result<Vec<u8>, TrainError> {
    ferrotext_files::read_regular(path).map_err(|e| {
        ckpt_err(
            path,
            CheckpointProblem::Unreadable {
                error: e.to_string(),
            },
        )
    })
}

/// Writes `bytes` to `path` and fsyncs the file.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

/// Fsyncs the directory `path` (a rename or removal in it is durable after this).
fn sync_dir(path: &Path) -> Result<(), TrainError> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io_err(path))
}

/// Lower-case hex of `bytes` (as `sha256sum` prints a digest).
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A file name that stays inside its directory.
fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && !name.contains(['/', '\\'])
        && name != "."
        && name != ".."
        && !name.starts_with('.')
}

/// The name of checkpoint `step`, `micro`: `step_SSSSSSSS_micro_MMM`.
pub fn checkpoint_name(step: usize, micro: usize) -> String {
    format!("step_{step:08}_micro_{micro:03}")
}

/// The step and micro-step a checkpoint directory name stands for (only the exact form
/// [`checkpoint_name`] writes).
pub fn parse_checkpoint_name(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("step_")?;
    let (step, micro) = rest.split_once("_micro_")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(step) || !digits(micro) {
        return None;
    }
    let parsed = (step.parse().ok()?, micro.parse().ok()?);
    (checkpoint_name(parsed.0, parsed.1) == name).then_some(parsed)
}

/// Sequences the data layer has handed out at `step`, `micro`: the index of the next one.
/// Saturating: the step comes from a file, and an absurd one must not overflow.
fn sequences_consumed(config: &TrainConfig, step: usize, micro: usize) -> u64 {
    let rows = config.micro_batch_rows() as u64;
    (step as u64)
        .saturating_mul(config.gradient_accumulation_steps as u64)
        .saturating_add(micro as u64)
        .saturating_mul(rows)
}

/// The mesh a state's accumulator lives on, as the manifest records it.
fn mesh_description(state: &EngineState<'_>) -> String {
    state
        .promised
        .first()
        .map_or_else(String::new, |t| t.mesh().to_string())
}

/// The devices of a state's mesh.
fn device_count(state: &EngineState<'_>) -> usize {
    state
        .promised
        .first()
        .map_or(1, |t| t.mesh().device_count())
}
