//! `manifest.json`: what a checkpoint holds, and the checks that make it trustworthy.
//!
//! Invariants: [`read_manifest`] reads the format version before anything else (an older or
//! newer format is refused with the reason, never half-parsed), then verifies the manifest's
//! seal ([`MANIFEST_SEAL`]), and only then parses the fields. [`validate_manifest`] checks every
//! number of a sealed manifest against the files it lists, the config it carries and the name of
//! its directory, so that a loader can trust each of them; it reads no other file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{
    checkpoint_name, ckpt_err, hex, is_plain_name, parse_checkpoint_name, sequences_consumed,
    CheckpointProblem, ManifestMismatch, FORMAT_VERSION, MANIFEST_SEAL,
};
use crate::config::{DatasetOrder, TrainConfig};
use crate::error::TrainError;

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
    /// Mid-step with `routed_bias_update_rate` > 0: the step's expert loads so far, summed over
    /// the devices, `[MoE layers · experts]` (token counts, exact in JSON); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending_expert_loads: Vec<f32>,
    /// AdamW's step count (0 for SGD).
    pub optimizer_steps: u64,
    /// How the data is cut into sequences (`dataset_order`).
    pub dataset_order: DatasetOrder,
    /// Sequences consumed so far: `step × micro_batch_rows × GA + micro_steps ×
    /// micro_batch_rows` (the data layer is deterministic in this index).
    pub sequences_consumed: u64,
    /// `shards` data: the SHA-256 of the shard directory's manifest (`data::fingerprint`),
    /// which names its whole content; a resume reading other data is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_fingerprint: Option<String>,
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

/// `manifest.json` of `dir`: its format version, then its seal, then its fields.
pub(crate) fn read_manifest(dir: &Path) -> Result<Manifest, TrainError> {
    let manifest_path = dir.join("manifest.json");
    let text = ferrotext_files::read_regular(&manifest_path).map_err(|e| {
        ckpt_err(
            &manifest_path,
            CheckpointProblem::Unreadable {
                error: e.to_string(),
            },
        )
    })?;
    let unparsable = |e: serde_json::Error| {
        ckpt_err(
            &manifest_path,
            CheckpointProblem::ManifestUnparsable {
                error: e.to_string(),
            },
        )
    };
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(unparsable)?;
    check_version(&manifest_path, &value)?;
    check_seal(dir, &text)?;
    serde_json::from_value(value).map_err(unparsable)
}

/// The manifest's `format_version` is [`FORMAT_VERSION`]: a newer one is refused as newer, an
/// older one with the reason it cannot be read.
fn check_version(manifest_path: &Path, value: &serde_json::Value) -> Result<(), TrainError> {
    let version = value
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| ckpt_err(manifest_path, CheckpointProblem::NoFormatVersion))?;
    if version > u64::from(FORMAT_VERSION) {
        return Err(ckpt_err(
            manifest_path,
            CheckpointProblem::NewerFormat {
                found: version,
                supported: FORMAT_VERSION,
            },
        ));
    }
    if version < u64::from(FORMAT_VERSION) {
        return Err(ckpt_err(
            manifest_path,
            CheckpointProblem::OlderFormat {
                found: version,
                supported: FORMAT_VERSION,
            },
        ));
    }
    Ok(())
}

/// The SHA-256 of the manifest's bytes `text` is the one [`MANIFEST_SEAL`] of `dir` holds.
fn check_seal(dir: &Path, text: &[u8]) -> Result<(), TrainError> {
    let manifest_path = dir.join("manifest.json");
    let seal_path = dir.join(MANIFEST_SEAL);
    let seal = ferrotext_files::read_regular_to_string(&seal_path).map_err(|e| {
        ckpt_err(
            &seal_path,
            CheckpointProblem::SealUnreadable {
                error: e.to_string(),
            },
        )
    })?;
    let want = seal.split_whitespace().next().unwrap_or_default();
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ckpt_err(&seal_path, CheckpointProblem::SealMalformed));
    }
    let found = hex(&Sha256::digest(text));
    if !found.eq_ignore_ascii_case(want) {
        return Err(ckpt_err(
            &manifest_path,
            CheckpointProblem::SealMismatch {
                expected: want.to_ascii_lowercase(),
                found,
            },
        ));
    }
    Ok(())
}

/// Every number of the manifest against the files it lists, the config it carries and the
/// directory's name. The checks run in this order, and the first failure is the error.
pub(crate) fn validate_manifest(dir: &Path, m: &Manifest) -> Result<(), TrainError> {
    let path = dir.join("manifest.json");
    check_file_names(m)
        .and_then(|()| check_pending(m))
        .and_then(|()| check_optimizer_steps(m))
        .and_then(|()| check_files_listed(m))
        .and_then(|()| check_directory_name(dir, m))
        .and_then(|()| check_data_position(m))
        .map_err(|problem| ckpt_err(&path, problem))
}

/// Every file the manifest names stays inside its directory.
fn check_file_names(m: &Manifest) -> Result<(), CheckpointProblem> {
    for file in m.files.keys().chain(m.tensors.iter().map(|t| &t.file)) {
        if !is_plain_name(file) {
            return Err(CheckpointProblem::OutsideDirectory { file: file.clone() });
        }
    }
    Ok(())
}

/// The pending micro-batches: fewer than a step's, their token denominator and loss sum zero at
/// a step boundary and within bounds inside a step, the unit tree's levels adding up to them.
fn check_pending(m: &Manifest) -> Result<(), CheckpointProblem> {
    let cfg = &m.config;
    let ga = cfg.gradient_accumulation_steps;
    if m.micro_steps >= ga {
        return Err(CheckpointProblem::Manifest(ManifestMismatch::MicroSteps {
            micro_steps: m.micro_steps,
            accumulation: ga,
        }));
    }
    let most = (m.micro_steps as u64)
        .saturating_mul(cfg.micro_batch_rows() as u64)
        .saturating_mul(cfg.max_target_length as u64);
    if m.micro_steps == 0 && m.token_denominator != 0 {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::DenominatorAtBoundary(m.token_denominator),
        ));
    }
    if m.micro_steps > 0 && !(1..=most).contains(&m.token_denominator) {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::DenominatorRange {
                denominator: m.token_denominator,
                most,
                micro_steps: m.micro_steps,
                rows: cfg.micro_batch_rows(),
                tokens: cfg.max_target_length,
            },
        ));
    }
    check_pending_loss(m)?;
    check_unit_tree(m)
}

/// The pending loss sum: finite, zero at a step boundary, its bits and its readable value the
/// same number.
fn check_pending_loss(m: &Manifest) -> Result<(), CheckpointProblem> {
    let loss = f64::from_bits(m.pending_loss_sum_bits);
    if !loss.is_finite() {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::LossNotFinite(loss),
        ));
    }
    if m.micro_steps == 0 && loss != 0.0 {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::LossAtBoundary(loss),
        ));
    }
    if (loss - m.pending_loss_sum).abs() > 1e-12 * loss.abs().max(1.0) {
        return Err(CheckpointProblem::Manifest(ManifestMismatch::LossBits {
            readable: m.pending_loss_sum,
            bits: loss,
        }));
    }
    Ok(())
}

/// `unit_tree_levels`, when present: `layout_invariant=true`, falling levels whose units add up
/// to the micro-steps.
fn check_unit_tree(m: &Manifest) -> Result<(), CheckpointProblem> {
    if m.unit_tree_levels.is_empty() {
        return Ok(());
    }
    let levels = &m.unit_tree_levels;
    let falling = levels.windows(2).all(|w| w[0] > w[1]);
    let units = levels
        .iter()
        .try_fold(0usize, |n, &l| n.checked_add(1usize.checked_shl(l)?));
    if !m.config.layout_invariant || !falling || units != Some(m.micro_steps) {
        return Err(CheckpointProblem::Manifest(ManifestMismatch::UnitTree {
            levels: levels.clone(),
            micro_steps: m.micro_steps,
            layout_invariant: m.config.layout_invariant,
        }));
    }
    Ok(())
}

/// The optimizer's step count: at most the step, and 0 for SGD.
fn check_optimizer_steps(m: &Manifest) -> Result<(), CheckpointProblem> {
    if m.optimizer_steps > m.step as u64 {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::OptimizerAhead {
                optimizer_steps: m.optimizer_steps,
                step: m.step,
            },
        ));
    }
    if !m.config.opt_type.keeps_state() && m.optimizer_steps != 0 {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::StatelessSteps {
                optimizer_steps: m.optimizer_steps,
                opt_type: m.config.opt_type,
            },
        ));
    }
    Ok(())
}

/// The files listed are exactly those this checkpoint needs: the parameters, the optimizer
/// state when the optimizer keeps one, the accumulator inside a step.
fn check_files_listed(m: &Manifest) -> Result<(), CheckpointProblem> {
    let cfg = &m.config;
    let mut needed = BTreeSet::from(["params.safetensors"]);
    if let Some(file) = cfg.opt_type.checkpoint_file() {
        needed.insert(file);
    }
    if m.micro_steps > 0 {
        needed.insert("accumulator.safetensors");
    }
    for file in &needed {
        if !m.files.contains_key(*file) {
            return Err(CheckpointProblem::Manifest(ManifestMismatch::FileMissing {
                file,
                opt_type: cfg.opt_type,
                micro_steps: m.micro_steps,
            }));
        }
    }
    if let Some(extra) = m.files.keys().find(|f| !needed.contains(f.as_str())) {
        return Err(CheckpointProblem::Manifest(ManifestMismatch::FileExtra {
            file: extra.clone(),
            opt_type: cfg.opt_type,
            micro_steps: m.micro_steps,
        }));
    }
    Ok(())
}

/// The directory's name is [`checkpoint_name`] of the manifest's step and micro-step.
fn check_directory_name(dir: &Path, m: &Manifest) -> Result<(), CheckpointProblem> {
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    match parse_checkpoint_name(name) {
        Some((step, micro)) if (step, micro) == (m.step, m.micro_steps) => Ok(()),
        Some((step, micro)) => Err(CheckpointProblem::Manifest(
            ManifestMismatch::DirectoryStep {
                step: m.step,
                micro_steps: m.micro_steps,
                dir_name: name.into(),
                dir_step: step,
                dir_micro: micro,
            },
        )),
        None => Err(CheckpointProblem::Manifest(
            ManifestMismatch::DirectoryName {
                dir_name: name.into(),
                expected: checkpoint_name(m.step, m.micro_steps),
            },
        )),
    }
}

/// The data position: the config's `dataset_order`, and the sequences its step and micro-step
/// have consumed.
fn check_data_position(m: &Manifest) -> Result<(), CheckpointProblem> {
    let cfg = &m.config;
    if m.dataset_order != cfg.dataset_order {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::DatasetOrder {
                manifest: m.dataset_order,
                config: cfg.dataset_order,
            },
        ));
    }
    let consumed = sequences_consumed(cfg, m.step, m.micro_steps);
    if m.sequences_consumed != consumed {
        return Err(CheckpointProblem::Manifest(
            ManifestMismatch::SequencesConsumed {
                found: m.sequences_consumed,
                step: m.step,
                micro_steps: m.micro_steps,
                expected: consumed,
            },
        ));
    }
    Ok(())
}
