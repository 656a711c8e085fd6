//! Start-up of a checkpoint root, and which checkpoint (and which config) a run may resume.
//!
//! Invariants: resume is strict — [`latest`] is read as a plain file naming a complete
//! checkpoint directly under the root, and anything else is an error naming the remedy, never a
//! silent fresh start. Only the writer process ([`prepare_resume`]'s `writer`) changes files:
//! it moves a root aside for `resume=fresh` (never deletes it), removes what killed saves left
//! and finishes an interrupted replacement. A config may differ from the saved one only in
//! [`RESUMABLE_KEYS`] and, keeping the global batch, in the layout keys ([`is_layout_key`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::problem::list_changes;
use super::{
    ckpt_err, io_err, is_layout_key, is_plain_name, parse_checkpoint_name, sync_dir,
    CheckpointProblem, ConfigChange, LatestProblem, RESUMABLE_KEYS,
};
use crate::config::{ResumeMode, TrainConfig};
use crate::error::TrainError;

/// The directory a checkpoint path means: a checkpoint directory itself, or a root whose
/// `latest` names one (read strictly, see [`latest`]).
///
/// # Errors
/// Neither a checkpoint nor a root with `latest`, or a `latest` that cannot be used.
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    latest(path)?.ok_or_else(|| ckpt_err(path, CheckpointProblem::NotACheckpoint))
}

/// A checkpoint directory and its (step, micro-step).
pub(super) type CheckpointDir = ((usize, usize), PathBuf);

/// The checkpoint directories directly under `root` with a manifest, by (step, micro), oldest
/// first. Symlinks and other names are not checkpoints.
pub(super) fn checkpoints_in(root: &Path) -> Result<Vec<CheckpointDir>, TrainError> {
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
                    Err(latest_err(
                        &path,
                        LatestProblem::Missing {
                            count: found.len(),
                            newest,
                        },
                    ))
                }
            };
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    if meta.file_type().is_symlink() {
        return Err(latest_err(&path, LatestProblem::Symlink));
    }
    if !meta.is_file() {
        return Err(latest_err(&path, LatestProblem::NotAFile));
    }
    let bytes = super::read_file(&path)?;
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return Err(latest_err(&path, LatestProblem::NotText));
    };
    let name = text.trim();
    if name.is_empty() {
        return Err(latest_err(&path, LatestProblem::Empty));
    }
    if !is_plain_name(name) {
        return Err(latest_err(
            &path,
            LatestProblem::Outside { name: name.into() },
        ));
    }
    if parse_checkpoint_name(name).is_none() {
        return Err(latest_err(
            &path,
            LatestProblem::NotACheckpointName { name: name.into() },
        ));
    }
    let dir = root.join(name);
    if !dir.is_dir() {
        return Err(latest_err(
            &path,
            LatestProblem::NamesNothing { name: name.into() },
        ));
    }
    match std::fs::metadata(dir.join("manifest.json")) {
        Ok(meta) if meta.is_file() => {}
        // A directory it may not read is not one without a manifest: say which.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(ckpt_err(
                &dir,
                CheckpointProblem::Unreadable {
                    error: e.to_string(),
                },
            ))
        }
        _ => return Err(ckpt_err(&dir, CheckpointProblem::NamedWithoutManifest)),
    }
    Ok(Some(dir))
}

/// A [`TrainError::Checkpoint`] for `latest` at `path`.
fn latest_err(path: &Path, problem: LatestProblem) -> TrainError {
    ckpt_err(path, CheckpointProblem::Latest(problem))
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
        return Err(ckpt_err(root, CheckpointProblem::NotADirectory));
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

/// The sentence a run prints when it will resume (`resume=auto`, checkpointing on) from a
/// checkpoint of `root` saved with another `dtype`: a resume may change `dtype`
/// ([`RESUMABLE_KEYS`]), since the master weights and the optimizer state are float32 in every
/// dtype; the run says so rather than change precision silently. `None` when there is nothing
/// to resume, the dtype is the same, or the checkpoint cannot be read (the resume itself then
/// reports why).
pub fn dtype_change(config: &TrainConfig, root: &Path) -> Option<String> {
    if !config.enable_checkpointing || config.resume != ResumeMode::Auto || !root.is_dir() {
        return None;
    }
    let dir = latest(root).ok()??;
    let saved = super::read_manifest(&dir).ok()?.config;
    (saved.dtype != config.dtype).then(|| {
        format!(
            "resuming from {} saved with dtype={}, now dtype={}: the master weights and the \
             optimizer state are float32 in both and continue exactly; from here activations and \
             matmul inputs are {}",
            dir.display(),
            saved.dtype.name(),
            config.dtype.name(),
            config.dtype.name()
        )
    })
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

/// The saved config against the current one: only [`RESUMABLE_KEYS`] may differ, and the
/// layout keys as [`is_layout_key`] says (the same global batch; inside a step, the same
/// micro-batches). Compared as JSON, so a new key is
/// strict until it is listed.
pub(super) fn check_config(
    dir: &Path,
    saved: &TrainConfig,
    now: &TrainConfig,
    micro_steps: usize,
) -> Result<(), TrainError> {
    let as_object = |c: &TrainConfig| match serde_json::to_value(c) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(ckpt_err(dir, CheckpointProblem::ConfigNotAnObject)),
        Err(e) => Err(ckpt_err(
            dir,
            CheckpointProblem::ConfigNotComparable {
                error: e.to_string(),
            },
        )),
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
        let change = ConfigChange {
            key: key.clone(),
            was: was.to_string(),
            now: is.to_string(),
        };
        if is_layout_key(key) {
            layout.push(change);
        } else {
            strict.push(change);
        }
    }
    if !strict.is_empty() {
        return Err(ckpt_err(
            dir,
            CheckpointProblem::ConfigChanged { changes: strict },
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
                list_changes(&layout)
            ),
        ));
    }
    // Under `layout_invariant` a unit of the step's tree is one device's micro-batch: its
    // sequences set the tree, so only the devices and the accumulation may trade places.
    if now.layout_invariant && saved.per_device_batch_size != now.per_device_batch_size {
        return Err(TrainError::usage(
            "per_device_batch_size",
            format!(
                "checkpoint {}: under layout_invariant=true a unit of the step's sum is one \
                 device's micro-batch of per_device_batch_size sequences, {} when saved, now {}; \
                 keep it and change the devices or gradient_accumulation_steps instead",
                dir.display(),
                saved.per_device_batch_size,
                now.per_device_batch_size
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
                list_changes(&layout)
            ),
        ));
    }
    Ok(())
}
