//! Checkpoints of the engine's whole state, between any two calls — also in the middle of a
//! step.
//!
//! A checkpoint is a directory `step_SSSSSSSS_micro_MMM` under a root, holding
//! `params.safetensors` (HF names and orientation, as `load_parameters_path` reads),
//! `optimizer.safetensors` (AdamW moments `m/<name>`, `v/<name>`), `accumulator.safetensors`
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

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use ferrotext_models::ParamInfo;
use ferrotext_sharding::NamedSharding;
use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::{DatasetOrder, OptType, ResumeMode, TrainConfig};
use crate::engine::{
    Engine, EngineState, PendingState, PendingSum, Restored, RestoredPending, TreeNodeState,
};
use crate::error::TrainError;

/// The manifest format this build writes and the only one it reads (3: every parameter is stored
/// under its Hugging Face names and orientation, MoE experts unstacked; 2 stored the router and
/// `kv_a_proj_with_mqa` in ferrotext's own orientation and stacked experts, which a square matrix
/// would load silently transposed; 1 had no manifest seal). Older formats are refused.
pub const FORMAT_VERSION: u32 = 3;

/// The manifest's seal: `<sha256 hex>  manifest.json`, as `sha256sum` writes it.
pub const MANIFEST_SEAL: &str = "manifest.sha256";

/// Config keys that may differ between the run that saved a checkpoint and the run that restores
/// it: the length and learning-rate schedule, paths and outputs, checkpoint cadence, and run
/// policy. Every other key (model, data, batch, optimizer, seeds, tokenizer) must be equal;
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
/// ([`TrainConfig::micro_batch_rows`] × `gradient_accumulation_steps`) is the same — a job that
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

/// One tensor of a checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorEntry {
    /// The file (within the checkpoint directory).
    pub file: String,
    /// The tensor's name in that file.
    pub name: String,
    /// Its global shape (as stored).
    pub shape: Vec<usize>,
    /// The sharding it had when saved, printed.
    pub sharding: String,
}

/// `manifest.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version (see [`FORMAT_VERSION`]).
    pub format_version: u32,
    /// The config of the run that saved it.
    pub config: TrainConfig,
    /// Optimizer steps completed.
    pub step: usize,
    /// Micro-batches accumulated since the last update (0 at a step boundary).
    pub micro_steps: usize,
    /// Target tokens of those micro-batches (the pending division's denominator).
    pub token_denominator: u64,
    /// Σ loss of those micro-batches (readable; [`Manifest::pending_loss_sum_bits`] is exact).
    pub pending_loss_sum: f64,
    /// The same sum's `f64` bits: what a restore uses, so a resumed step's loss is bit for bit
    /// the uninterrupted one.
    pub pending_loss_sum_bits: u64,
    /// AdamW's step count (0 for SGD).
    pub optimizer_steps: u64,
    /// How the data is cut into sequences (`dataset_order`).
    pub dataset_order: DatasetOrder,
    /// Sequences consumed so far: `step × micro_batch_rows × GA + micro_steps ×
    /// micro_batch_rows` (the data layer is deterministic in this index).
    pub sequences_consumed: u64,
    /// The mesh it was saved from, printed.
    pub mesh: String,
    /// The deferral gate's decision at save time.
    pub deferral: String,
    /// The accumulator's types at save time (mid-step only), printed.
    #[serde(default)]
    pub accumulator_types: Vec<String>,
    /// Mid-step under `layout_invariant=true`: the levels of the step's unit tree's complete
    /// subtrees, oldest first (`node/<n>/...` in `accumulator.safetensors`); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unit_tree_levels: Vec<u32>,
    /// Every tensor.
    pub tensors: Vec<TensorEntry>,
    /// SHA-256 (hex) of every file.
    pub files: BTreeMap<String, String>,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn ckpt_err(path: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// Writes `entries` as one safetensors file, fsynced; returns its SHA-256.
fn write_tensors(path: &Path, entries: &[(String, Tensor)]) -> Result<String, TrainError> {
    let stored: Vec<(String, Vec<usize>, Vec<u8>)> = entries
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                t.shape().to_vec(),
                t.data().iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = stored
        .iter()
        .map(|(n, s, b)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<Result<_, _>>()
        .map_err(|e| ckpt_err(path, e.to_string()))?;
    let bytes = safetensors::serialize(views, &None).map_err(|e| ckpt_err(path, e.to_string()))?;
    write_synced(path, &bytes)?;
    Ok(hex(&Sha256::digest(&bytes)))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let mut f = std::fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

fn sync_dir(path: &Path) -> Result<(), TrainError> {
    std::fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io_err(path))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The directory a checkpoint path means: a checkpoint directory itself, or a root whose
/// `latest` names one (read strictly, see [`latest`]).
///
/// # Errors
/// Neither a checkpoint nor a root with `latest`, or a `latest` that cannot be used.
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    latest(path)?.ok_or_else(|| {
        ckpt_err(
            path,
            "no manifest.json and no `latest` here: not a checkpoint",
        )
    })
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

const START_OVER: &str =
    "(to start over instead, set resume=fresh: the checkpoints are moved aside, not deleted)";

/// A checkpoint directory and its (step, micro-step).
type CheckpointDir = ((usize, usize), PathBuf);

/// The checkpoint directories directly under `root` with a manifest, by (step, micro), oldest
/// first. Symlinks and other names are not checkpoints.
fn checkpoints_in(root: &Path) -> Result<Vec<CheckpointDir>, TrainError> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io_err(root))? {
        let entry = entry.map_err(io_err(root))?;
        let Some(key) = entry.file_name().to_str().and_then(parse_checkpoint_name) else {
            continue;
        };
        let path = entry.path();
        let is_dir = entry.file_type().map_err(io_err(&path))?.is_dir();
        if is_dir && path.join("manifest.json").is_file() {
            found.push((key, path));
        }
    }
    found.sort();
    Ok(found)
}

/// The checkpoint `latest` in `root` names, read strictly: `Ok(None)` only when neither `root`
/// nor `latest` exists and `root` holds no checkpoint.
///
/// # Errors
/// [`TrainError::Checkpoint`], one line: `latest` is a symlink, not a file, empty, not text, a
/// name that is not a checkpoint's (or leads outside `root`), names a directory that does not
/// exist or has no manifest; or `latest` is missing while `root` holds checkpoints.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, TrainError> {
    if !root.exists() {
        return Ok(None);
    }
    let path = root.join("latest");
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let found = checkpoints_in(root)?;
            return match found.last() {
                None => Ok(None),
                Some((_, newest)) => {
                    let newest = newest
                        .file_name()
                        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
                    Err(ckpt_err(
                        &path,
                        format!(
                            "is missing but the directory holds {} checkpoint(s), the newest \
                             {newest}; write the name of the one to resume from into `latest` \
                             {START_OVER}",
                            found.len(),
                        ),
                    ))
                }
            };
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    if meta.file_type().is_symlink() {
        return Err(ckpt_err(
            &path,
            format!(
                "is a symlink; ferrotext writes `latest` as a plain file holding a \
                 checkpoint's name {START_OVER}"
            ),
        ));
    }
    if !meta.is_file() {
        return Err(ckpt_err(&path, format!("is not a file {START_OVER}")));
    }
    let bytes = ferrotext_hf::files::read_regular(&path)
        .map_err(|e| ckpt_err(&path, format!("cannot read: {e}")))?;
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return Err(ckpt_err(&path, format!("is not text {START_OVER}")));
    };
    let name = text.trim();
    if name.is_empty() {
        return Err(ckpt_err(&path, format!("is empty {START_OVER}")));
    }
    if !is_plain_name(name) {
        return Err(ckpt_err(
            &path,
            format!(
                "names `{}`, which is outside its directory {START_OVER}",
                name.escape_debug()
            ),
        ));
    }
    if parse_checkpoint_name(name).is_none() {
        return Err(ckpt_err(
            &path,
            format!(
                "names `{}`, which is not a checkpoint name (step_SSSSSSSS_micro_MMM) {START_OVER}",
                name.escape_debug()
            ),
        ));
    }
    let dir = root.join(name);
    if !dir.is_dir() {
        return Err(ckpt_err(
            &path,
            format!("names `{name}`, which does not exist {START_OVER}"),
        ));
    }
    if !dir.join("manifest.json").is_file() {
        return Err(ckpt_err(
            &dir,
            format!("named by `latest`, has no manifest.json {START_OVER}"),
        ));
    }
    Ok(Some(dir))
}

/// Start-up of a run's checkpoint directory `root`, before anything is trained: returns the
/// checkpoint to resume from, `None` to start at step 0.
///
/// * `enable_checkpointing=false`, or no `root` (a first run): `None`, nothing touched.
/// * `resume=fresh`: `None`; when `writer`, an existing `root` is renamed to
///   `<root>.replaced_<unix seconds>` beside it (never deleted).
/// * `resume=auto`: when `writer`, stale temporaries of killed saves (`.tmp_*`, `.latest.tmp`)
///   are removed and an old checkpoint whose replacement never arrived (`.old_<name>`) is put
///   back (or removed, when the replacement is in place); then `latest` is read strictly
///   ([`latest`]).
///
/// `writer` is the one process that changes files (process 0); the others only read.
///
/// # Errors
/// [`TrainError::Checkpoint`] for a `latest` that cannot be used; I/O failures.
pub fn prepare_resume(
    config: &TrainConfig,
    root: &Path,
    writer: bool,
) -> Result<Option<PathBuf>, TrainError> {
    if !config.enable_checkpointing || !root.exists() {
        return Ok(None);
    }
    if !root.is_dir() {
        return Err(ckpt_err(root, "is not a directory"));
    }
    if config.resume == ResumeMode::Fresh {
        if writer {
            move_aside(root)?;
        }
        return Ok(None);
    }
    if writer {
        tidy(root)?;
    }
    latest(root)
}

/// Renames `root` to `<root>.replaced_<unix seconds>[_n]`; returns the new path.
fn move_aside(root: &Path) -> Result<PathBuf, TrainError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = root.file_name().map_or_else(
        || "checkpoints".to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let parent = match root.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut n = 0;
    let target = loop {
        let suffix = if n == 0 {
            String::new()
        } else {
            format!("_{n}")
        };
        let candidate = parent.join(format!("{base}.replaced_{secs}{suffix}"));
        if !candidate.exists() {
            break candidate;
        }
        n += 1;
    };
    std::fs::rename(root, &target).map_err(io_err(root))?;
    sync_dir(parent)?;
    Ok(target)
}

/// Removes what killed saves left behind and finishes an interrupted replacement (see
/// [`prepare_resume`]).
fn tidy(root: &Path) -> Result<(), TrainError> {
    for entry in std::fs::read_dir(root).map_err(io_err(root))? {
        let entry = entry.map_err(io_err(root))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let path = entry.path();
        let kind = entry.file_type().map_err(io_err(&path))?;
        if name.starts_with(".tmp_") && kind.is_dir() {
            std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
        } else if name == ".latest.tmp" && kind.is_file() {
            std::fs::remove_file(&path).map_err(io_err(&path))?;
        } else if let Some(original) = name.strip_prefix(".old_") {
            if parse_checkpoint_name(original).is_none() || !kind.is_dir() {
                continue;
            }
            let target = root.join(original);
            if target.exists() {
                std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
            } else {
                std::fs::rename(&path, &target).map_err(io_err(&target))?;
            }
        }
    }
    sync_dir(root)
}

/// Keeps the newest `keep` checkpoints under `root` (by step and micro-step) and the one
/// `latest` names; removes the other checkpoint directories. Anything else is left alone.
fn prune(root: &Path, keep: usize, current: &str) -> Result<(), TrainError> {
    if keep == 0 {
        return Ok(());
    }
    let found = checkpoints_in(root)?;
    let excess = found.len().saturating_sub(keep);
    for (_, path) in &found[..excess] {
        if path.file_name().and_then(|n| n.to_str()) == Some(current) {
            continue;
        }
        std::fs::remove_dir_all(path).map_err(io_err(path))?;
    }
    sync_dir(root)
}

/// Everything a checkpoint holds, validated, before it touches an engine.
struct Loaded {
    manifest: Manifest,
    params: Vec<Tensor>,
    moments: Option<(Vec<Tensor>, Vec<Tensor>)>,
    accumulator: Option<Vec<Tensor>>,
    /// Per device, per parameter: the partial blocks (mid-step, on the mesh and layout that
    /// saved them).
    partials: Option<Vec<Vec<Tensor>>>,
    /// The unit tree's subtrees (mid-step under `layout_invariant=true`, on the mesh and layout
    /// that saved them), oldest first.
    tree: Option<Vec<LoadedNode>>,
}

/// A subtree of a unit tree as a checkpoint holds it.
struct LoadedNode {
    level: u32,
    /// Per device, per parameter: the subtree's blocks.
    blocks: Vec<Vec<Tensor>>,
    /// Per device: its loss partial sum.
    losses: Vec<f32>,
}

fn read_verified(dir: &Path, manifest: &Manifest, file: &str) -> Result<Vec<u8>, TrainError> {
    if !is_plain_name(file) {
        return Err(ckpt_err(
            &dir.join("manifest.json"),
            format!("points outside its directory: `{file}`"),
        ));
    }
    let path = dir.join(file);
    let bytes = ferrotext_hf::files::read_regular(&path)
        .map_err(|e| ckpt_err(&path, format!("cannot read: {e}")))?;
    let want = manifest
        .files
        .get(file)
        .ok_or_else(|| ckpt_err(&path, "is not listed in the manifest"))?;
    if &hex(&Sha256::digest(&bytes)) != want {
        return Err(ckpt_err(
            &path,
            "checksum mismatch: the file is corrupt or was modified",
        ));
    }
    Ok(bytes)
}

fn tensor(
    path: &Path,
    file: &SafeTensors<'_>,
    name: &str,
    shape: &[usize],
) -> Result<Tensor, TrainError> {
    let view = file
        .tensor(name)
        .map_err(|_| ckpt_err(path, format!("has no tensor `{name}`")))?;
    if view.dtype() != Dtype::F32 {
        return Err(ckpt_err(
            path,
            format!("`{name}` is {:?}, expected F32", view.dtype()),
        ));
    }
    if view.shape() != shape {
        return Err(ckpt_err(
            path,
            format!(
                "`{name}` has shape {:?}, the model needs {shape:?}",
                view.shape()
            ),
        ));
    }
    let data = view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok(Tensor::new(shape.to_vec(), data)?)
}

/// `params.safetensors` of checkpoint `dir` (checksum verified) as the parameters `infos`
/// declare, in their order.
pub(crate) fn read_params(
    dir: &Path,
    manifest: &Manifest,
    infos: &[ParamInfo],
) -> Result<Vec<Tensor>, TrainError> {
    let bytes = read_verified(dir, manifest, "params.safetensors")?;
    let path = dir.join("params.safetensors");
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| ckpt_err(&path, format!("not a safetensors file: {e}")))?;
    let mut params = Vec::with_capacity(infos.len());
    for info in infos {
        let parts = info
            .hf_tensors()
            .iter()
            .map(|(name, shape)| tensor(&path, &file, name, shape))
            .collect::<Result<Vec<_>, _>>()?;
        params.push(
            info.from_hf(parts)
                .map_err(|e| ckpt_err(&path, e.to_string()))?,
        );
    }
    Ok(params)
}

/// The parameters of the checkpoint at `path` (a checkpoint directory, or a root whose `latest`
/// names one) with the config of the run that saved them: every file's checksum and the
/// manifest checked as a resume checks them. The checkpoint is only read.
///
/// # Errors
/// As a resume: not a checkpoint, a manifest or file that fails its checks, a config that no
/// longer plans.
pub fn read_parameters(path: &Path) -> Result<(TrainConfig, Vec<Tensor>), TrainError> {
    let dir = resolve(path)?;
    let manifest = read_manifest(&dir)?;
    validate_manifest(&dir, &manifest)?;
    let plan = manifest.config.plan()?;
    let params = read_params(&dir, &manifest, plan.params())?;
    Ok((manifest.config, params))
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

/// `manifest.json` of `dir`: its format version, then its seal, then its fields.
pub(crate) fn read_manifest(dir: &Path) -> Result<Manifest, TrainError> {
    let manifest_path = dir.join("manifest.json");
    let text = ferrotext_hf::files::read_regular(&manifest_path)
        .map_err(|e| ckpt_err(&manifest_path, format!("cannot read: {e}")))?;
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| ckpt_err(&manifest_path, format!("not a manifest: {e}")))?;
    let version = value
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| ckpt_err(&manifest_path, "not a manifest: no format_version"))?;
    if version > u64::from(FORMAT_VERSION) {
        return Err(ckpt_err(
            &manifest_path,
            format!(
                "format version {version} is newer than this ferrotext reads ({FORMAT_VERSION})"
            ),
        ));
    }
    if version < u64::from(FORMAT_VERSION) {
        let why = if version < 2 {
            "has no manifest seal and cannot be verified"
        } else {
            "stores MoE and MLA weights in an orientation this ferrotext no longer reads"
        };
        return Err(ckpt_err(
            &manifest_path,
            format!(
                "format version {version} {why} (this ferrotext reads {FORMAT_VERSION}); start \
                 the run over with resume=fresh"
            ),
        ));
    }
    let seal_path = dir.join(MANIFEST_SEAL);
    let seal = ferrotext_hf::files::read_regular_to_string(&seal_path).map_err(|e| {
        ckpt_err(
            &seal_path,
            format!("cannot read ({e}): manifest.json cannot be verified"),
        )
    })?;
    let want = seal.split_whitespace().next().unwrap_or_default();
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ckpt_err(
            &seal_path,
            "is not `<sha256>  manifest.json`: manifest.json cannot be verified",
        ));
    }
    if !hex(&Sha256::digest(&text)).eq_ignore_ascii_case(want) {
        return Err(ckpt_err(
            &manifest_path,
            format!(
                "checksum mismatch with {MANIFEST_SEAL}: the manifest is corrupt or was modified"
            ),
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ckpt_err(&manifest_path, format!("not a manifest: {e}")))
}

/// Every number of the manifest against the files it lists, the config it carries and the
/// directory's name.
pub(crate) fn validate_manifest(dir: &Path, m: &Manifest) -> Result<(), TrainError> {
    let path = dir.join("manifest.json");
    let bad = |reason: String| Err(ckpt_err(&path, reason));
    for file in m.files.keys().chain(m.tensors.iter().map(|t| &t.file)) {
        if !is_plain_name(file) {
            return bad(format!("points outside its directory: `{file}`"));
        }
    }
    let cfg = &m.config;
    let ga = cfg.gradient_accumulation_steps;
    if m.micro_steps >= ga {
        return bad(format!(
            "micro_steps {} is not below gradient_accumulation_steps {ga}",
            m.micro_steps
        ));
    }
    let most = (m.micro_steps as u64)
        .saturating_mul(cfg.micro_batch_rows() as u64)
        .saturating_mul(cfg.max_target_length as u64);
    if m.micro_steps == 0 && m.token_denominator != 0 {
        return bad(format!(
            "token_denominator {} at a step boundary (micro_steps 0) must be 0",
            m.token_denominator
        ));
    }
    if m.micro_steps > 0 && !(1..=most).contains(&m.token_denominator) {
        return bad(format!(
            "token_denominator {} is outside 1..={most} (micro_steps {} × {} rows × {} tokens)",
            m.token_denominator,
            m.micro_steps,
            cfg.micro_batch_rows(),
            cfg.max_target_length
        ));
    }
    let loss = f64::from_bits(m.pending_loss_sum_bits);
    if !loss.is_finite() {
        return bad(format!("pending_loss_sum {loss} is not finite"));
    }
    if m.micro_steps == 0 && loss != 0.0 {
        return bad(format!(
            "pending_loss_sum {loss} at a step boundary (micro_steps 0) must be 0"
        ));
    }
    if (loss - m.pending_loss_sum).abs() > 1e-12 * loss.abs().max(1.0) {
        return bad(format!(
            "pending_loss_sum {} disagrees with pending_loss_sum_bits ({loss})",
            m.pending_loss_sum
        ));
    }
    if !m.unit_tree_levels.is_empty() {
        let levels = &m.unit_tree_levels;
        let falling = levels.windows(2).all(|w| w[0] > w[1]);
        let units = levels
            .iter()
            .try_fold(0usize, |n, &l| n.checked_add(1usize.checked_shl(l)?));
        if !cfg.layout_invariant || !falling || units != Some(m.micro_steps) {
            return bad(format!(
                "unit_tree_levels {levels:?} do not describe micro_steps {} under \
                 layout_invariant={} (falling levels whose units add up to the micro-steps)",
                m.micro_steps, cfg.layout_invariant
            ));
        }
    }
    if m.optimizer_steps > m.step as u64 {
        return bad(format!(
            "optimizer_steps {} is more than step {}",
            m.optimizer_steps, m.step
        ));
    }
    if cfg.opt_type == OptType::Sgd && m.optimizer_steps != 0 {
        return bad(format!(
            "optimizer_steps {} for SGD, which keeps no state",
            m.optimizer_steps
        ));
    }
    let mut needed = BTreeSet::from(["params.safetensors"]);
    if cfg.opt_type == OptType::Adamw {
        needed.insert("optimizer.safetensors");
    }
    if m.micro_steps > 0 {
        needed.insert("accumulator.safetensors");
    }
    for file in &needed {
        if !m.files.contains_key(*file) {
            return bad(format!(
                "does not list {file}, which this checkpoint needs (opt_type {:?}, micro_steps \
                 {}): it is incomplete",
                cfg.opt_type, m.micro_steps
            ));
        }
    }
    if let Some(extra) = m.files.keys().find(|f| !needed.contains(f.as_str())) {
        return bad(format!(
            "lists {extra}, which a checkpoint with opt_type {:?} and micro_steps {} does not have",
            cfg.opt_type, m.micro_steps
        ));
    }
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    match parse_checkpoint_name(name) {
        Some((step, micro)) if (step, micro) == (m.step, m.micro_steps) => {}
        Some((step, micro)) => {
            return bad(format!(
                "says step {} micro-step {}, but its directory is `{name}` (step {step} \
                 micro-step {micro})",
                m.step, m.micro_steps
            ))
        }
        None => {
            return bad(format!(
                "is in `{name}`, which is not a checkpoint name ({})",
                checkpoint_name(m.step, m.micro_steps)
            ))
        }
    }
    if m.dataset_order != cfg.dataset_order {
        return bad(format!(
            "dataset_order {:?} disagrees with its config's {:?}",
            m.dataset_order, cfg.dataset_order
        ));
    }
    let consumed = sequences_consumed(cfg, m.step, m.micro_steps);
    if m.sequences_consumed != consumed {
        return bad(format!(
            "sequences_consumed {} does not match step {} micro-step {} of its config ({consumed})",
            m.sequences_consumed, m.step, m.micro_steps
        ));
    }
    Ok(())
}

/// The saved config against the current one: only [`RESUMABLE_KEYS`] may differ, and the
/// layout keys as [`is_layout_key`] says (the same global batch; inside a step, the same
/// micro-batches). Compared as JSON, so a new key is
/// strict until it is listed.
fn check_config(
    dir: &Path,
    saved: &TrainConfig,
    now: &TrainConfig,
    micro_steps: usize,
) -> Result<(), TrainError> {
    let as_object = |c: &TrainConfig| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(ckpt_err(dir, "a config is not a JSON object")),
        Err(e) => Err(ckpt_err(dir, format!("cannot compare configs: {e}"))),
    };
    let (a, b) = (as_object(saved)?, as_object(now)?);
    let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let null = serde_json::Value::Null;
    let mut strict = Vec::new();
    let mut layout = Vec::new();
    for key in keys {
        let (was, is) = (a.get(key).unwrap_or(&null), b.get(key).unwrap_or(&null));
        if was == is || RESUMABLE_KEYS.contains(&key.as_str()) {
            continue;
        }
        let change = format!("{key} was {was} when saved, now {is}");
        if is_layout_key(key) {
            layout.push(change);
        } else {
            strict.push(change);
        }
    }
    if !strict.is_empty() {
        return Err(ckpt_err(
            dir,
            format!(
                "{}; only {} may change on resume (and the layout keys local_devices, \
                 num_processes, ici_*_parallelism, shard_mode, shard_optimizer_over_data, \
                 per_device_batch_size, gradient_accumulation_steps, as long as the global batch \
                 stays the same)",
                strict.join("; "),
                RESUMABLE_KEYS.join(", ")
            ),
        ));
    }
    let per_step = |c: &TrainConfig| c.micro_batch_rows() * c.gradient_accumulation_steps;
    if per_step(saved) != per_step(now) {
        return Err(TrainError::usage(
            "gradient_accumulation_steps",
            format!(
                "checkpoint {}: the global batch (per_device_batch_size × devices × \
                 gradient_accumulation_steps) was {} sequences a step when saved, now {} ({}); \
                 the layout may change on resume only if it stays the same",
                dir.display(),
                per_step(saved),
                per_step(now),
                layout.join("; ")
            ),
        ));
    }
    let same_micro_batches = saved.micro_batch_rows() == now.micro_batch_rows()
        && saved.gradient_accumulation_steps == now.gradient_accumulation_steps;
    if micro_steps > 0 && !same_micro_batches {
        return Err(TrainError::usage(
            "gradient_accumulation_steps",
            format!(
                "checkpoint {} was taken inside a step, after {micro_steps} of {} micro-batches of \
                 {} sequences: it resumes only with the same micro-batches, now {} of {} ({}); \
                 resume from a checkpoint at a step boundary, where the split of a step may \
                 change",
                dir.display(),
                saved.gradient_accumulation_steps,
                saved.micro_batch_rows(),
                now.gradient_accumulation_steps,
                now.micro_batch_rows(),
                layout.join("; ")
            ),
        ));
    }
    Ok(())
}

/// A step's gradients so far, gathered for device 0 to write.
struct GatheredPending {
    /// The reduced totals (what `update`'s reduction would give), per parameter.
    totals: Vec<Tensor>,
    /// Per parameter: the local block's shape and every device's block, in device order (this
    /// device's sum so far).
    partials: Vec<DeviceBlocks>,
    /// The unit tree's subtrees (`layout_invariant=true`), oldest first: level, the blocks as
    /// in `partials`, every device's loss partial sum.
    tree: Vec<(u32, Vec<DeviceBlocks>, Vec<f32>)>,
    micro_steps: usize,
    tokens: u64,
    loss_sum: f64,
}

/// One value's local block shape and every device's block, concatenated in device order.
type DeviceBlocks = (Vec<usize>, Vec<f32>);

/// Gathers a step's gradients so far (every device takes part): the reduction `update` would
/// do, on a copy (the live sums stay partial), and every device's own blocks, so a restore onto
/// the same mesh and layout continues bit for bit (the sum's association is kept).
fn gather_pending(
    cx: &mut Ctx<'_>,
    state: &EngineState<'_>,
    p: &PendingState,
) -> Result<GatheredPending, TrainError> {
    let summed;
    let (grads, nodes): (&[ferrotext_spmd::Array], &[TreeNodeState]) = match &p.sum {
        PendingSum::Accumulator(grads) => (grads, &[]),
        PendingSum::Tree(nodes) => {
            summed = sum_tree_nodes(cx, nodes)?;
            (&summed, nodes)
        }
    };
    let mut totals = Vec::with_capacity(grads.len());
    for (g, layout) in grads.iter().zip(state.plan.layouts()) {
        let reduced = cx.reshard(g, &layout.plain)?;
        totals.push(cx.to_host(&reduced)?);
    }
    let partials = gather_device_blocks(cx, grads)?;
    let mut tree = Vec::with_capacity(nodes.len());
    for node in nodes {
        let blocks = gather_device_blocks(cx, &node.grads)?;
        let (_, losses) = gather_device_blocks(cx, std::slice::from_ref(&node.loss))?
            .pop()
            .ok_or_else(|| TrainError::Internal("a gathered loss is missing".into()))?;
        tree.push((node.level, blocks, losses));
    }
    Ok(GatheredPending {
        totals,
        partials,
        tree,
        micro_steps: p.micro_steps,
        tokens: p.tokens,
        loss_sum: p.loss_sum,
    })
}

/// A device's sum of its unit tree's subtrees, as `update` adds them (from the newest back).
fn sum_tree_nodes(
    cx: &mut Ctx<'_>,
    nodes: &[TreeNodeState],
) -> Result<Vec<ferrotext_spmd::Array>, TrainError> {
    let (newest, older) = nodes
        .split_last()
        .ok_or_else(|| TrainError::Internal("a pending tree without subtrees".into()))?;
    let mut right = newest.grads.clone();
    for left in older.iter().rev() {
        right = left
            .grads
            .iter()
            .zip(&right)
            .map(|(l, r)| cx.add(l, r))
            .collect::<Result<_, _>>()?;
    }
    Ok(right)
}

/// Every device's local block of each of `values`, gathered onto every device.
fn gather_device_blocks(
    cx: &mut Ctx<'_>,
    values: &[ferrotext_spmd::Array],
) -> Result<Vec<DeviceBlocks>, TrainError> {
    let all_axes: Vec<String> = cx.mesh().axis_names().map(str::to_string).collect();
    let devices = cx.mesh().device_count();
    let mut out = Vec::with_capacity(values.len());
    for v in values {
        let local = v.local()?;
        let mut all = vec![0.0f32; local.len() * devices];
        cx.comm().all_gather(&all_axes, local.data(), &mut all)?;
        out.push((local.shape().to_vec(), all));
    }
    Ok(out)
}

/// Appends `<prefix>/<device>/<parameter>` for every device's block of every parameter.
fn push_device_blocks(
    stored: &mut Vec<(String, Tensor)>,
    prefix: &str,
    infos: &[ParamInfo],
    blocks: &[DeviceBlocks],
    devices: usize,
) -> Result<(), TrainError> {
    for (info, (shape, all)) in infos.iter().zip(blocks) {
        let block = all.len() / devices.max(1);
        for d in 0..devices {
            let t = Tensor::new(shape.clone(), all[d * block..(d + 1) * block].to_vec())?;
            stored.push((format!("{prefix}/{d}/{}", info.name), t));
        }
    }
    Ok(())
}

/// This device's subtrees of a checkpoint's unit tree, typed as the engine promises (the loss
/// partial sums unreduced over the batch's axes, as the loss leaves the model).
fn restore_tree(
    cx: &mut Ctx<'_>,
    state: &EngineState<'_>,
    nodes: &[LoadedNode],
) -> Result<Vec<TreeNodeState>, TrainError> {
    let loss_spec = ferrotext_sharding::PartitionSpec::replicated()
        .with_unreduced(state.plan.batch_spec().partition_axes())?;
    let loss_ty = cx.array_type(&[], loss_spec)?;
    let d = cx.device();
    nodes
        .iter()
        .map(|node| {
            let (Some(blocks), Some(&loss)) = (node.blocks.get(d), node.losses.get(d)) else {
                return Err(TrainError::Internal(format!(
                    "a checkpoint's unit tree has no blocks for device {d}"
                )));
            };
            let grads = blocks
                .iter()
                .zip(state.promised)
                .map(|(block, ty)| cx.from_local(ty.clone(), block.clone()))
                .collect::<Result<_, _>>()?;
            let loss = Tensor::new(vec![], vec![loss])?;
            Ok(TreeNodeState {
                level: node.level,
                grads,
                loss: cx.from_local(loss_ty.clone(), loss)?,
            })
        })
        .collect()
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

impl Engine {
    /// Saves the whole state under `root` (see the module docs) and returns the checkpoint's
    /// directory. Every device takes part (gathers); device 0 writes.
    ///
    /// # Errors
    /// An I/O failure (the previous checkpoint stays `latest`); a collective failure.
    ///
    /// # Collectives
    /// All-gathers of split parameters and moments; mid-step, one all-reduce per gradient in
    /// phase `checkpoint` (the reduction `update` would have done). A barrier at the end.
    pub fn save_checkpoint(&self, cx: &mut Ctx<'_>, root: &Path) -> Result<PathBuf, TrainError> {
        self.save_checkpoint_with_hook(cx, root, &|_| Ok(()))
    }

    /// [`Engine::save_checkpoint`] calling `after_file(name)` after each file is written and
    /// after each step of publishing it (`aside`: an existing checkpoint of the same name moved
    /// aside; `rename`: the new one renamed into place; `latest`) — the test hook for injecting a
    /// failure at every point of a save.
    ///
    /// # Errors
    /// As [`Engine::save_checkpoint`], or the hook's error (the save stops there).
    pub fn save_checkpoint_with_hook(
        &self,
        cx: &mut Ctx<'_>,
        root: &Path,
        after_file: &dyn Fn(&str) -> std::io::Result<()>,
    ) -> Result<PathBuf, TrainError> {
        cx.comm().push_phase("checkpoint");
        let result = self.save_inner(cx, root, after_file);
        cx.comm().pop_phase();
        result
    }

    fn save_inner(
        &self,
        cx: &mut Ctx<'_>,
        root: &Path,
        after_file: &dyn Fn(&str) -> std::io::Result<()>,
    ) -> Result<PathBuf, TrainError> {
        let state = self.state()?;
        let config = state.plan.config();
        let infos = state.plan.params();
        // 1. gather everything (every device)
        let params: Vec<Tensor> = state
            .params
            .iter()
            .map(|p| cx.to_host(p))
            .collect::<Result<_, _>>()?;
        let moments = match state.moments {
            Some((m, v, t)) => {
                let mut gm = Vec::with_capacity(m.len());
                let mut gv = Vec::with_capacity(v.len());
                for (ty, (mi, vi)) in state.moment_types.iter().zip(m.iter().zip(v)) {
                    gm.push(cx.to_host(&cx.from_local(ty.clone(), mi.clone())?)?);
                    gv.push(cx.to_host(&cx.from_local(ty.clone(), vi.clone())?)?);
                }
                Some((gm, gv, t))
            }
            None => None,
        };
        let pending = match &state.pending {
            Some(p) => Some(gather_pending(cx, &state, p)?),
            None => None,
        };
        // 2. device 0 writes: temporary directory, fsync, rename, then `latest`
        let micro = pending.as_ref().map_or(0, |p| p.micro_steps);
        let name = checkpoint_name(state.step, micro);
        let final_dir = root.join(&name);
        if cx.device() == 0 {
            std::fs::create_dir_all(root).map_err(io_err(root))?;
            let tmp = root.join(format!(".tmp_{name}_{}", std::process::id()));
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
            }
            std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
            let mut files = BTreeMap::new();
            let mut tensors = Vec::new();
            let mut entry = |file: &str, name: String, t: &Tensor, sharding: String| {
                tensors.push(TensorEntry {
                    file: file.into(),
                    name,
                    shape: t.shape().to_vec(),
                    sharding,
                });
            };
            // HF names and orientation, as each parameter declares (experts unstacked).
            let mut stored_params: Vec<(String, Tensor)> = Vec::new();
            for ((info, t), p) in infos.iter().zip(&params).zip(state.params) {
                let parts = info.to_hf(t).map_err(|e| ckpt_err(&tmp, e.to_string()))?;
                for (n, part) in parts {
                    entry("params.safetensors", n.clone(), &part, p.ty().to_string());
                    stored_params.push((n, part));
                }
            }
            files.insert(
                "params.safetensors".to_string(),
                write_tensors(&tmp.join("params.safetensors"), &stored_params)?,
            );
            after_file("params.safetensors").map_err(io_err(&tmp))?;
            let mut optimizer_steps = 0;
            if let Some((m, v, t)) = &moments {
                optimizer_steps = *t;
                let mut stored = Vec::new();
                for (info, (mi, vi)) in infos.iter().zip(m.iter().zip(v)) {
                    stored.push((format!("m/{}", info.name), mi.clone()));
                    stored.push((format!("v/{}", info.name), vi.clone()));
                }
                for (n, t) in &stored {
                    entry("optimizer.safetensors", n.clone(), t, "replicated".into());
                }
                files.insert(
                    "optimizer.safetensors".to_string(),
                    write_tensors(&tmp.join("optimizer.safetensors"), &stored)?,
                );
                after_file("optimizer.safetensors").map_err(io_err(&tmp))?;
            }
            let (mut token_denominator, mut pending_loss_sum) = (0, 0.0);
            if let Some(p) = &pending {
                token_denominator = p.tokens;
                pending_loss_sum = p.loss_sum;
                let mut stored: Vec<(String, Tensor)> = infos
                    .iter()
                    .zip(&p.totals)
                    .map(|(i, t)| (format!("acc/{}", i.name), t.clone()))
                    .collect();
                let devices = cx.mesh().device_count();
                push_device_blocks(&mut stored, "partial", infos, &p.partials, devices)?;
                for (n, (_, grads, losses)) in p.tree.iter().enumerate() {
                    push_device_blocks(&mut stored, &format!("node/{n}"), infos, grads, devices)?;
                    stored.push((
                        format!("node/{n}/loss"),
                        Tensor::new(vec![losses.len()], losses.clone())?,
                    ));
                }
                for (n, t) in &stored {
                    entry(
                        "accumulator.safetensors",
                        n.clone(),
                        t,
                        "reduced total".into(),
                    );
                }
                files.insert(
                    "accumulator.safetensors".to_string(),
                    write_tensors(&tmp.join("accumulator.safetensors"), &stored)?,
                );
                after_file("accumulator.safetensors").map_err(io_err(&tmp))?;
            }
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                config: config.clone(),
                step: state.step,
                micro_steps: micro,
                token_denominator,
                pending_loss_sum,
                pending_loss_sum_bits: pending_loss_sum.to_bits(),
                optimizer_steps,
                dataset_order: config.dataset_order,
                sequences_consumed: sequences_consumed(config, state.step, micro),
                mesh: mesh_description(&state),
                accumulator_types: state.pending.as_ref().map_or_else(Vec::new, |_| {
                    state.promised.iter().map(ToString::to_string).collect()
                }),
                unit_tree_levels: pending
                    .as_ref()
                    .map(|p| p.tree.iter().map(|(level, _, _)| *level).collect())
                    .unwrap_or_default(),
                deferral: state.plan.deferral().describe(),
                tensors,
                files,
            };
            let json =
                serde_json::to_vec_pretty(&manifest).map_err(|e| ckpt_err(&tmp, e.to_string()))?;
            write_synced(&tmp.join("manifest.json"), &json)?;
            write_synced(
                &tmp.join(MANIFEST_SEAL),
                format!("{}  manifest.json\n", hex(&Sha256::digest(&json))).as_bytes(),
            )?;
            after_file("manifest.json").map_err(io_err(&tmp))?;
            sync_dir(&tmp)?;
            // A checkpoint of the same name is replaced only once the new one is complete: the
            // old one moves aside, the new one in, then the old one goes (start-up puts an old
            // one back if the new one never arrived).
            let aside = root.join(format!(".old_{name}"));
            let replacing = final_dir.exists();
            if replacing {
                if aside.exists() {
                    // A leftover of an earlier replacement that finished: `final_dir` is whole.
                    std::fs::remove_dir_all(&aside).map_err(io_err(&aside))?;
                }
                std::fs::rename(&final_dir, &aside).map_err(io_err(&aside))?;
                sync_dir(root)?;
                after_file("aside").map_err(io_err(root))?;
            }
            std::fs::rename(&tmp, &final_dir).map_err(io_err(&final_dir))?;
            sync_dir(root)?;
            after_file("rename").map_err(io_err(root))?;
            let latest_tmp = root.join(".latest.tmp");
            write_synced(&latest_tmp, name.as_bytes())?;
            std::fs::rename(&latest_tmp, root.join("latest")).map_err(io_err(root))?;
            sync_dir(root)?;
            after_file("latest").map_err(io_err(root))?;
            if replacing {
                std::fs::remove_dir_all(&aside).map_err(io_err(&aside))?;
                sync_dir(root)?;
            }
            prune(root, config.checkpoint_keep, &name)?;
        }
        // Nobody reads or overwrites the checkpoint before it is complete.
        let all_axes: Vec<String> = cx.mesh().axis_names().map(str::to_string).collect();
        cx.comm().barrier(&all_axes)?;
        Ok(final_dir)
    }

    fn load(&self, dir: &Path) -> Result<Loaded, TrainError> {
        let state = self.state()?;
        let config = state.plan.config();
        let infos = state.plan.params();
        let manifest = read_manifest(dir)?;
        validate_manifest(dir, &manifest)?;
        check_config(dir, &manifest.config, config, manifest.micro_steps)?;
        // The data position the current config implies for this step and micro-step.
        let manifest_path = dir.join("manifest.json");
        if manifest.dataset_order != config.dataset_order {
            return Err(ckpt_err(
                &manifest_path,
                format!(
                    "dataset_order was {:?} when saved, now {:?}",
                    manifest.dataset_order, config.dataset_order
                ),
            ));
        }
        let expected = sequences_consumed(config, manifest.step, manifest.micro_steps);
        if manifest.sequences_consumed != expected {
            return Err(ckpt_err(
                &manifest_path,
                format!(
                    "sequences_consumed is {}, but step {} micro-step {} of this config is at \
                     sequence {expected}",
                    manifest.sequences_consumed, manifest.step, manifest.micro_steps
                ),
            ));
        }
        let params = read_params(dir, &manifest, infos)?;
        // `validate_manifest` and `check_config` made sure the file is listed when the
        // optimizer keeps state: a missing one is an error, never a silent reset.
        let moments = if state.moments.is_some() {
            let bytes = read_verified(dir, &manifest, "optimizer.safetensors")?;
            let path = dir.join("optimizer.safetensors");
            let file = SafeTensors::deserialize(&bytes)
                .map_err(|e| ckpt_err(&path, format!("not a safetensors file: {e}")))?;
            let mut m = Vec::new();
            let mut v = Vec::new();
            for info in infos {
                m.push(tensor(
                    &path,
                    &file,
                    &format!("m/{}", info.name),
                    &info.shape,
                )?);
                v.push(tensor(
                    &path,
                    &file,
                    &format!("v/{}", info.name),
                    &info.shape,
                )?);
            }
            Some((m, v))
        } else {
            None
        };
        let (accumulator, partials, tree) = if manifest.micro_steps > 0 {
            let bytes = read_verified(dir, &manifest, "accumulator.safetensors")?;
            let path = dir.join("accumulator.safetensors");
            let file = SafeTensors::deserialize(&bytes)
                .map_err(|e| ckpt_err(&path, format!("not a safetensors file: {e}")))?;
            let totals = infos
                .iter()
                .map(|i| tensor(&path, &file, &format!("acc/{}", i.name), &i.shape))
                .collect::<Result<Vec<_>, _>>()?;
            // Partial blocks are only usable on the mesh and layout they came from.
            let same_layout = manifest.mesh == mesh_description(&state)
                && manifest.accumulator_types
                    == state
                        .promised
                        .iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>();
            let devices = device_count(&state);
            let blocks = |prefix: &str| -> Result<Vec<Vec<Tensor>>, TrainError> {
                (0..devices)
                    .map(|d| {
                        infos
                            .iter()
                            .zip(state.promised)
                            .map(|(info, t)| {
                                let name = format!("{prefix}/{d}/{}", info.name);
                                tensor(&path, &file, &name, &t.shard_shape())
                            })
                            .collect()
                    })
                    .collect()
            };
            let partials = if same_layout {
                Some(blocks("partial")?)
            } else {
                None
            };
            let tree = if same_layout && !manifest.unit_tree_levels.is_empty() {
                let mut nodes = Vec::with_capacity(manifest.unit_tree_levels.len());
                for (n, &level) in manifest.unit_tree_levels.iter().enumerate() {
                    let name = format!("node/{n}/loss");
                    nodes.push(LoadedNode {
                        level,
                        blocks: blocks(&format!("node/{n}"))?,
                        losses: tensor(&path, &file, &name, &[devices])?.data().to_vec(),
                    });
                }
                Some(nodes)
            } else {
                None
            };
            (Some(totals), partials, tree)
        } else {
            (None, None, None)
        };
        Ok(Loaded {
            manifest,
            params,
            moments,
            accumulator,
            partials,
            tree,
        })
    }

    /// Restores the state saved at `path` (a checkpoint directory, or a root whose `latest`
    /// names one) onto this engine, whatever mesh it was saved from.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming the file and the problem (missing, corrupt, truncated,
    /// a shape the model does not have, a newer format, a name outside the directory); the
    /// engine is untouched then. A collective failure.
    ///
    /// # Collectives
    /// None: every device reads the files and keeps its shards.
    pub fn restore_checkpoint(
        &mut self,
        cx: &mut Ctx<'_>,
        path: &Path,
    ) -> Result<usize, TrainError> {
        let dir = resolve(path)?;
        let loaded = self.load(&dir)?;
        let state = self.state()?;
        let layouts = state.plan.layouts();
        // Build the new state completely, then swap it in.
        let mut params = Vec::with_capacity(loaded.params.len());
        for (value, layout) in loaded.params.iter().zip(layouts) {
            let named = NamedSharding::new(cx.mesh().clone(), layout.plain.clone())?;
            params.push(cx.from_global(value, named)?);
        }
        let moments = match &loaded.moments {
            Some((m, v)) => {
                let shard = |cx: &Ctx<'_>,
                             t: &Tensor,
                             ty: &ferrotext_sharding::ArrayType|
                 -> Result<Tensor, TrainError> {
                    Ok(cx.from_global(t, ty.sharding().clone())?.local()?.clone())
                };
                let mut lm = Vec::new();
                let mut lv = Vec::new();
                for ((mi, vi), ty) in m.iter().zip(v).zip(state.moment_types) {
                    lm.push(shard(cx, mi, ty)?);
                    lv.push(shard(cx, vi, ty)?);
                }
                Some((lm, lv, loaded.manifest.optimizer_steps))
            }
            None => None,
        };
        let pending = match &loaded.accumulator {
            Some(totals) => {
                // Re-split each total onto the layout the current gate promises: plain → U puts
                // the value on the index-0 device and zeros elsewhere, so the pending reduction
                // gives the total back exactly.
                let mut grads = Vec::with_capacity(totals.len());
                match &loaded.partials {
                    // Same mesh and layout: every device takes back its own partial block.
                    Some(per_device) => {
                        for (block, promised) in per_device[cx.device()].iter().zip(state.promised)
                        {
                            grads.push(cx.from_local(promised.clone(), block.clone())?);
                        }
                    }
                    None => {
                        for ((t, layout), promised) in
                            totals.iter().zip(layouts).zip(state.promised)
                        {
                            let plain = cx.from_global(
                                t,
                                NamedSharding::new(cx.mesh().clone(), layout.plain.clone())?,
                            )?;
                            grads.push(cx.reshard(&plain, promised.sharding().spec())?);
                        }
                    }
                }
                let tree = match &loaded.tree {
                    Some(nodes) => Some(restore_tree(cx, &state, nodes)?),
                    None => None,
                };
                Some(RestoredPending {
                    grads,
                    tree,
                    loss_sum: f64::from_bits(loaded.manifest.pending_loss_sum_bits),
                    tokens: loaded.manifest.token_denominator,
                    micro_steps: loaded.manifest.micro_steps,
                })
            }
            None => None,
        };
        let step = loaded.manifest.step;
        self.install(
            cx,
            Restored {
                params,
                moments,
                pending,
                step,
            },
        )?;
        Ok(step)
    }
}
