//! A ferrotext checkpoint's parameters as a Hugging Face directory (`ferrotext export`).
//!
//! The checkpoint is read and verified exactly as a restore reads it (format version, manifest
//! seal, the manifest's numbers, the checksum of `params.safetensors`, dtypes and shapes) and is
//! never written to; the directory is then written by [`save_directory_declaring`], which
//! builds it beside the target and renames it into place. A model loaded from a Hugging Face
//! directory keeps what that directory declared beyond the decoder (its special tokens, context,
//! `generation_config.json` and tokenizer files: [`ferrotext_hf::Declared`]), as long as the
//! directory is there.

use std::path::{Path, PathBuf};

use ferrotext_models::decoder::Decoder;

use crate::checkpoint::{
    checkpoint_name, latest, parse_checkpoint_name, read_manifest, read_params, validate_manifest,
    verify_listed_files, CheckpointProblem,
};
use crate::error::TrainError;
use ferrotext_hf::{save_directory_declaring, selection_bias, ModelType};
use ferrotext_sharding::DType;

/// What [`export_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Exported {
    /// The checkpoint directory read.
    pub checkpoint: PathBuf,
    /// Its optimizer steps completed.
    pub step: usize,
    /// Its micro-step (0 at a step boundary; a mid-step checkpoint holds the parameters of
    /// `step`, before the pending update).
    pub micro_steps: usize,
    /// The `model_type` of the written `config.json`.
    pub model_type: ModelType,
    /// HF tensors written (every parameter's, plus any zero router selection bias).
    pub tensors: usize,
}

fn ckpt_err(path: &Path, problem: CheckpointProblem) -> TrainError {
    TrainError::Checkpoint {
        path: path.display().to_string(),
        problem,
    }
}

/// The checkpoint directory `path` names: a checkpoint itself (it holds `manifest.json`), or a
/// checkpoint root (`base_output_directory/run_name/checkpoints`), or a run directory whose
/// `checkpoints/` is the root. In a root, `step` picks the step-boundary checkpoint of that
/// step; without it, the one `latest` names (read strictly, see [`latest`]).
///
/// # Errors
/// [`TrainError::Checkpoint`]: no checkpoint there, no checkpoint of `step` (the steps there
/// are listed), a `step` that disagrees with the checkpoint named, or a `latest` that cannot
/// be used.
pub fn find_checkpoint(path: &Path, step: Option<usize>) -> Result<PathBuf, TrainError> {
    if !path.is_dir() {
        return Err(ckpt_err(path, CheckpointProblem::NotADirectory));
    }
    if path.join("manifest.json").is_file() {
        let named = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(parse_checkpoint_name);
        return match (step, named) {
            (Some(s), Some((at, _))) if s != at => Err(ckpt_err(
                path,
                CheckpointProblem::OtherStep {
                    found: at,
                    asked: s,
                },
            )),
            _ => Ok(path.to_path_buf()),
        };
    }
    let nested = path.join("checkpoints");
    let root = if nested.is_dir() { nested } else { path.into() };
    let Some(step) = step else {
        return latest(&root)?.ok_or_else(|| ckpt_err(path, CheckpointProblem::NoCheckpoint));
    };
    let dir = root.join(checkpoint_name(step, 0));
    if dir.join("manifest.json").is_file() {
        return Ok(dir);
    }
    let mut found: Vec<(usize, usize)> = std::fs::read_dir(&root)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().to_str().and_then(parse_checkpoint_name))
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    Err(ckpt_err(
        &root,
        CheckpointProblem::NoSuchStep {
            step,
            present: found,
        },
    ))
}

/// Writes the parameters of the checkpoint `path` names ([`find_checkpoint`]) as the HF
/// directory `out`: `config.json` of the model's `model_type`, every tensor under its HF name
/// and orientation in `dtype`, sharded above `shard_bytes`, with what the model's source
/// directory declared ([`save_directory_declaring`]).
///
/// The checkpoint is only read. Everything is checked before anything is written, and `out`
/// appears complete or not at all; an existing `out` is replaced only when it is a model
/// directory (it holds `config.json`).
///
/// # Errors
/// [`TrainError::Checkpoint`] for a checkpoint that cannot be found or used (as a restore would
/// refuse it); [`TrainError::Params`] for a model no HF `model_type` expresses, or an `out` that
/// lies inside the checkpoint or exists and is not a model directory; [`TrainError::Io`] when
/// writing fails.
pub fn export_checkpoint(
    path: &Path,
    step: Option<usize>,
    out: &Path,
    dtype: DType,
    shard_bytes: u64,
) -> Result<Exported, TrainError> {
    let dir = find_checkpoint(path, step)?;
    let out_err = |reason: String| TrainError::Params {
        path: out.display().to_string(),
        reason,
    };
    // The checkpoints are never written: not even a temporary directory beside this one.
    let ckpt = dir.canonicalize().map_err(|e| {
        ckpt_err(
            &dir,
            CheckpointProblem::Unreadable {
                error: e.to_string(),
            },
        )
    })?;
    let root = ckpt.parent().unwrap_or(&ckpt);
    if resolved(out).starts_with(root) {
        return Err(out_err(format!(
            "lies inside the checkpoint directory {}, which export does not write to: choose a \
             directory outside it",
            root.display()
        )));
    }
    // 1. the manifest and the parameters, verified as a restore verifies them
    let manifest = read_manifest(&dir)?;
    validate_manifest(&dir, &manifest)?;
    // Every file a restore reads, not only the parameters: a checkpoint a resume refuses is
    // not exported either.
    verify_listed_files(&dir, &manifest)?;
    let config = &manifest.config;
    let from = Path::new(&config.load_parameters_path);
    if !config.load_parameters_path.is_empty()
        && from.extension().is_none_or(|e| e != "safetensors")
        && !from.is_dir()
    {
        return Err(ckpt_err(
            &dir.join("manifest.json"),
            CheckpointProblem::ModelDirectoryGone {
                model_dir: config.load_parameters_path.clone(),
            },
        ));
    }
    let decoder = Decoder::new(config.model()?)
        .map_err(|e| ckpt_err(&dir.join("manifest.json"), CheckpointProblem::Model(e)))?;
    let infos = decoder.params();
    let values = read_params(&dir, &manifest, &infos)?;
    // 2. the directory
    let model_type = ModelType::of(decoder.config()).map_err(out_err)?;
    // Every parameter's tensors, the zero selection biases and the MTP layer's copies.
    let tensors = infos
        .iter()
        .map(|i| {
            i.hf_tensors().len() + usize::from(selection_bias(model_type, i, &infos).is_some())
        })
        .sum::<usize>()
        + ferrotext_models::mtp::stored_copies(&infos).len();
    let declared = config.source_declarations()?;
    save_directory_declaring(
        out,
        decoder.config(),
        &infos,
        &values,
        dtype,
        shard_bytes,
        &declared,
    )?;
    Ok(Exported {
        checkpoint: dir,
        step: manifest.step,
        micro_steps: manifest.micro_steps,
        model_type,
        tensors,
    })
}

/// `path` made absolute with its longest existing ancestor's symlinks and `..` resolved (the
/// rest may not exist yet).
fn resolved(path: &Path) -> PathBuf {
    let Ok(abs) = std::path::absolute(path) else {
        return path.to_path_buf();
    };
    let mut rest = Vec::new();
    let mut at = abs.as_path();
    loop {
        if let Ok(real) = at.canonicalize() {
            return rest.iter().rev().fold(real, |p, c| p.join(c));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                at = parent;
            }
            _ => return abs,
        }
    }
}
