//! What is wrong with a checkpoint: [`CheckpointProblem`], the `problem` of
//! [`TrainError::Checkpoint`](crate::TrainError::Checkpoint), which names the file or directory.
//!
//! Invariants: every variant carries the values its sentence names (the file, the expected and
//! found checksum, shape, dtype, format version, step, key, count), so a caller matches on them
//! instead of parsing text; its `Display` is the one-line sentence printed after
//! `checkpoint <path>: `. A problem of `latest` ([`LatestProblem`]) ends with the remedy
//! (`resume=fresh`). The manifest's own numbers disagreeing with each other are
//! [`ManifestMismatch`]. None of these is the user's input: the error class stays *failure*.

use ferrotext_models::decoder::ConfigError;
use ferrotext_models::HfLayoutError;
use safetensors::tensor::Dtype;

use super::format::{MANIFEST_SEAL, RESUMABLE_KEYS};
use crate::config::DatasetOrder;
use crate::optim::OptType;

/// The remedy every problem of `latest` ends with.
const START_OVER: &str =
    "(to start over instead, set resume=fresh: the checkpoints are moved aside, not deleted)";

/// Why a checkpoint (or a checkpoint root, or one of its files) cannot be used; each prints after
/// the path ("… checksum mismatch: …").
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointProblem {
    /// A directory was wanted (a checkpoint root, or a checkpoint) and something else is there.
    #[error("is not a directory")]
    NotADirectory,
    /// A path to resume from holds neither `manifest.json` nor `latest`.
    #[error("no manifest.json and no `latest` here: not a checkpoint")]
    NotACheckpoint,
    /// A path to export from holds no checkpoint in any of the places looked at.
    #[error("holds no checkpoint (neither manifest.json, nor `latest`, nor checkpoints/)")]
    NoCheckpoint,
    /// The checkpoint named is of another step than the one asked for (`--step`).
    #[error("is the checkpoint of step {found}, not of --step {asked}")]
    OtherStep {
        /// The checkpoint's step.
        found: usize,
        /// The step asked for.
        asked: usize,
    },
    /// The root has no checkpoint of the step asked for at a step boundary.
    #[error(
        "has no checkpoint of step {step} at a step boundary (steps here: {})",
        list_steps(.present)
    )]
    NoSuchStep {
        /// The step asked for.
        step: usize,
        /// The (step, micro-step) of every checkpoint there, in order.
        present: Vec<(usize, usize)>,
    },
    /// The file cannot be read (missing, not a regular file, refused).
    #[error("cannot read: {error}")]
    Unreadable {
        /// The operating system's error.
        error: String,
    },
    /// The run took its model's shape from a Hugging Face directory that is gone.
    #[error(
        "the run took its model's shape from the Hugging Face directory `{model_dir}` \
         (load_parameters_path), which is no longer there"
    )]
    ModelDirectoryGone {
        /// The directory (`load_parameters_path`).
        model_dir: String,
    },
    /// The saved config builds no model.
    #[error("{0}")]
    Model(ConfigError),
    /// `latest` cannot be used (see [`LatestProblem`]).
    #[error("{} {}", .0, START_OVER)]
    Latest(LatestProblem),
    /// The checkpoint named by `latest` has no manifest.
    #[error("named by `latest`, has no manifest.json {}", START_OVER)]
    NamedWithoutManifest,
    /// The config differs from the saved one in keys a resume may not change.
    #[error(
        "{}; only {} may change on resume (and the layout keys local_devices, num_processes, \
         ici_*_parallelism, shard_mode, shard_optimizer_over_data, per_device_batch_size, \
         gradient_accumulation_steps, as long as the global batch stays the same)",
        list_changes(.changes),
        RESUMABLE_KEYS.join(", ")
    )]
    ConfigChanged {
        /// The keys that changed, in key order.
        changes: Vec<ConfigChange>,
    },
    /// A config did not serialise as a JSON object, so it cannot be compared key by key.
    #[error("a config is not a JSON object")]
    ConfigNotAnObject,
    /// A config could not be serialised for the comparison.
    #[error("cannot compare configs: {error}")]
    ConfigNotComparable {
        /// serde_json's error.
        error: String,
    },
    /// `manifest.json` is not JSON, or not a manifest's fields.
    #[error("not a manifest: {error}")]
    ManifestUnparsable {
        /// serde_json's error (it names the line or the field).
        error: String,
    },
    /// `manifest.json` has no `format_version`.
    #[error("not a manifest: no format_version")]
    NoFormatVersion,
    /// The manifest's format is newer than this build reads.
    #[error("format version {found} is newer than this ferrotext reads ({supported})")]
    NewerFormat {
        /// The manifest's `format_version`.
        found: u64,
        /// The version this build reads ([`FORMAT_VERSION`](super::format::FORMAT_VERSION)).
        supported: u32,
    },
    /// The manifest's format is older than this build reads.
    #[error(
        "format version {found} {} (this ferrotext reads {supported}); start the run over with \
         resume=fresh",
        older_format_why(*.found)
    )]
    OlderFormat {
        /// The manifest's `format_version`.
        found: u64,
        /// The version this build reads ([`FORMAT_VERSION`](super::format::FORMAT_VERSION)).
        supported: u32,
    },
    /// The seal (`manifest.sha256`) cannot be read.
    #[error("cannot read ({error}): manifest.json cannot be verified")]
    SealUnreadable {
        /// The operating system's error.
        error: String,
    },
    /// The seal is not `<sha256>  manifest.json`.
    #[error("is not `<sha256>  manifest.json`: manifest.json cannot be verified")]
    SealMalformed,
    /// The manifest's SHA-256 is not the one its seal holds.
    #[error(
        "checksum mismatch with {}: the manifest is corrupt or was modified",
        MANIFEST_SEAL
    )]
    SealMismatch {
        /// The SHA-256 the seal holds (hex).
        expected: String,
        /// The manifest's SHA-256 (hex).
        found: String,
    },
    /// The manifest names a file outside its directory.
    #[error("points outside its directory: `{file}`")]
    OutsideDirectory {
        /// The name as the manifest gives it.
        file: String,
    },
    /// The manifest's numbers disagree with each other, its files or its directory.
    #[error("{0}")]
    Manifest(ManifestMismatch),
    /// The saved `dataset_order` is not the current config's.
    #[error("dataset_order was {saved:?} when saved, now {now:?}")]
    DatasetOrderChanged {
        /// When saved.
        saved: DatasetOrder,
        /// Now.
        now: DatasetOrder,
    },
    /// The saved data position is not where the current config puts the saved step.
    #[error(
        "sequences_consumed is {found}, but step {step} micro-step {micro_steps} of this config \
         is at sequence {expected}"
    )]
    DataPositionMoved {
        /// The manifest's `sequences_consumed`.
        found: u64,
        /// The manifest's step.
        step: usize,
        /// The manifest's micro-steps.
        micro_steps: usize,
        /// The sequences the current config consumes up to there.
        expected: u64,
    },
    /// The file is not a safetensors file.
    #[error("not a safetensors file: {error}")]
    NotSafetensors {
        /// The safetensors reader's error.
        error: String,
    },
    /// A parameter does not fit its Hugging Face layout (names, count, shapes of the parts).
    #[error("{0}")]
    HfLayout(HfLayoutError),
    /// The state could not be encoded for writing (JSON or safetensors).
    #[error("{error}")]
    Encode {
        /// The encoder's error.
        error: String,
    },
    /// The file is not listed in the manifest, so it cannot be verified.
    #[error("is not listed in the manifest")]
    NotListed,
    /// The file's SHA-256 is not the one the manifest lists.
    #[error("checksum mismatch: the file is corrupt or was modified")]
    ChecksumMismatch {
        /// The SHA-256 the manifest lists (hex).
        expected: String,
        /// The file's SHA-256 (hex).
        found: String,
    },
    /// The file has no tensor of that name.
    #[error("has no tensor `{name}`")]
    NoTensor {
        /// The tensor's name.
        name: String,
    },
    /// A tensor is not F32.
    #[error("`{name}` is {found:?}, expected F32")]
    WrongDtype {
        /// The tensor's name.
        name: String,
        /// Its dtype.
        found: Dtype,
    },
    /// A tensor's shape is not the one the model needs.
    #[error("`{name}` has shape {found:?}, the model needs {expected:?}")]
    WrongShape {
        /// The tensor's name.
        name: String,
        /// Its shape in the file.
        found: Vec<usize>,
        /// The shape the model needs.
        expected: Vec<usize>,
    },
    /// A parameter or optimizer moment holds NaN or ±∞: no run writes one (a step that makes
    /// one is not applied), so the file was modified.
    #[error("`{name}` holds a non-finite value (element {index}): the checkpoint was modified")]
    NonFinite {
        /// The tensor's name.
        name: String,
        /// The first non-finite element's index.
        index: usize,
    },
    /// A mid-step checkpoint of a run that updates router biases lacks the step's expert loads.
    #[error(
        "a mid-step checkpoint of a run with routed_bias_update_rate > 0 has no \
         pending_expert_loads"
    )]
    NoExpertLoads,
    /// The pending expert loads do not fit the model's MoE layers and experts.
    #[error(
        "pending_expert_loads has {values} values for {layers} MoE layers × {experts} experts"
    )]
    ExpertLoadsCount {
        /// The values saved.
        values: usize,
        /// The model's MoE layers.
        layers: usize,
        /// Experts per layer.
        experts: usize,
    },
}

/// Why `latest` in a checkpoint root cannot be used; each prints after its path and before the
/// remedy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LatestProblem {
    /// `latest` is missing while the root holds checkpoints.
    #[error(
        "is missing but the directory holds {count} checkpoint(s), the newest {newest}; write \
         the name of the one to resume from into `latest`"
    )]
    Missing {
        /// The checkpoints in the root.
        count: usize,
        /// The newest one's name.
        newest: String,
    },
    /// `latest` is a symlink.
    #[error("is a symlink; ferrotext writes `latest` as a plain file holding a checkpoint's name")]
    Symlink,
    /// `latest` is not a regular file.
    #[error("is not a file")]
    NotAFile,
    /// `latest` is not UTF-8 text.
    #[error("is not text")]
    NotText,
    /// `latest` is empty (or only whitespace).
    #[error("is empty")]
    Empty,
    /// `latest` names something outside its directory.
    #[error("names `{}`, which is outside its directory", .name.escape_debug())]
    Outside {
        /// The name it holds.
        name: String,
    },
    /// `latest` holds a name that is not a checkpoint's.
    #[error(
        "names `{}`, which is not a checkpoint name (step_SSSSSSSS_micro_MMM)",
        .name.escape_debug()
    )]
    NotACheckpointName {
        /// The name it holds.
        name: String,
    },
    /// `latest` names a checkpoint that does not exist.
    #[error("names `{name}`, which does not exist")]
    NamesNothing {
        /// The name it holds.
        name: String,
    },
}

/// One config key that changed between the saved run and this one (values as JSON).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigChange {
    /// The key.
    pub key: String,
    /// Its value when saved.
    pub was: String,
    /// Its value now.
    pub now: String,
}

/// The manifest's numbers disagree with each other, the files it lists, its config or its
/// directory's name: a corrupt or hand-edited manifest. Each prints after `manifest.json`'s path.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestMismatch {
    /// More pending micro-steps than a step has.
    #[error("micro_steps {micro_steps} is not below gradient_accumulation_steps {accumulation}")]
    MicroSteps {
        /// The manifest's micro-steps.
        micro_steps: usize,
        /// Its config's `gradient_accumulation_steps`.
        accumulation: usize,
    },
    /// A token denominator at a step boundary.
    #[error("token_denominator {0} at a step boundary (micro_steps 0) must be 0")]
    DenominatorAtBoundary(u64),
    /// A token denominator inside a step that the pending micro-batches cannot hold.
    #[error(
        "token_denominator {denominator} is outside 1..={most} (micro_steps {micro_steps} × \
         {rows} rows × {tokens} tokens)"
    )]
    DenominatorRange {
        /// The manifest's token denominator.
        denominator: u64,
        /// The most tokens the pending micro-batches hold.
        most: u64,
        /// The manifest's micro-steps.
        micro_steps: usize,
        /// Rows per micro-batch.
        rows: usize,
        /// Tokens per row (`max_target_length`).
        tokens: usize,
    },
    /// A pending loss sum that is not finite.
    #[error("pending_loss_sum {0} is not finite")]
    LossNotFinite(f64),
    /// A pending loss sum at a step boundary.
    #[error("pending_loss_sum {0} at a step boundary (micro_steps 0) must be 0")]
    LossAtBoundary(f64),
    /// The readable pending loss sum and its bits are different numbers.
    #[error("pending_loss_sum {readable} disagrees with pending_loss_sum_bits ({bits})")]
    LossBits {
        /// `pending_loss_sum`.
        readable: f64,
        /// The value of `pending_loss_sum_bits`.
        bits: f64,
    },
    /// Unit-tree levels that do not describe the micro-steps.
    #[error(
        "unit_tree_levels {levels:?} do not describe micro_steps {micro_steps} under \
         layout_invariant={layout_invariant} (falling levels whose units add up to the \
         micro-steps)"
    )]
    UnitTree {
        /// The levels.
        levels: Vec<u32>,
        /// The manifest's micro-steps.
        micro_steps: usize,
        /// Its config's `layout_invariant`.
        layout_invariant: bool,
    },
    /// More optimizer steps than steps.
    #[error("optimizer_steps {optimizer_steps} is more than step {step}")]
    OptimizerAhead {
        /// The manifest's optimizer steps.
        optimizer_steps: u64,
        /// The manifest's step.
        step: usize,
    },
    /// Optimizer steps under an optimizer that keeps no state (SGD).
    #[error("optimizer_steps {optimizer_steps} for opt_type {opt_type:?}, which keeps no state")]
    StatelessSteps {
        /// The manifest's optimizer steps.
        optimizer_steps: u64,
        /// Its config's `opt_type`.
        opt_type: OptType,
    },
    /// A file the checkpoint needs is not listed.
    #[error(
        "does not list {file}, which this checkpoint needs (opt_type {opt_type:?}, micro_steps \
         {micro_steps}): it is incomplete"
    )]
    FileMissing {
        /// The file.
        file: &'static str,
        /// Its config's `opt_type`.
        opt_type: OptType,
        /// The manifest's micro-steps.
        micro_steps: usize,
    },
    /// The manifest's tensor list disagrees with a file it describes: an entry the file does
    /// not hold with that shape, one listed twice, or a tensor of the file not listed.
    #[error("its tensor list {problem} ({file})")]
    TensorList {
        /// The file.
        file: String,
        /// What disagrees, naming the tensor.
        problem: String,
    },
    /// A file listed that such a checkpoint does not have.
    #[error(
        "lists {file}, which a checkpoint with opt_type {opt_type:?} and micro_steps \
         {micro_steps} does not have"
    )]
    FileExtra {
        /// The file.
        file: String,
        /// Its config's `opt_type`.
        opt_type: OptType,
        /// The manifest's micro-steps.
        micro_steps: usize,
    },
    /// The directory's name is another step's checkpoint.
    #[error(
        "says step {step} micro-step {micro_steps}, but its directory is `{dir_name}` (step \
         {dir_step} micro-step {dir_micro})"
    )]
    DirectoryStep {
        /// The manifest's step.
        step: usize,
        /// The manifest's micro-steps.
        micro_steps: usize,
        /// The directory's name.
        dir_name: String,
        /// The step in the name.
        dir_step: usize,
        /// The micro-step in the name.
        dir_micro: usize,
    },
    /// The directory's name is not a checkpoint name.
    #[error("is in `{dir_name}`, which is not a checkpoint name ({expected})")]
    DirectoryName {
        /// The directory's name.
        dir_name: String,
        /// The name it should have.
        expected: String,
    },
    /// The manifest's `dataset_order` is not its config's.
    #[error("dataset_order {manifest:?} disagrees with its config's {config:?}")]
    DatasetOrder {
        /// The manifest's.
        manifest: DatasetOrder,
        /// Its config's.
        config: DatasetOrder,
    },
    /// The manifest's data position is not where its config puts its step.
    #[error(
        "sequences_consumed {found} does not match step {step} micro-step {micro_steps} of its \
         config ({expected})"
    )]
    SequencesConsumed {
        /// The manifest's `sequences_consumed`.
        found: u64,
        /// The manifest's step.
        step: usize,
        /// The manifest's micro-steps.
        micro_steps: usize,
        /// The sequences its config consumes up to there.
        expected: u64,
    },
}

/// The steps of `present` as `NoSuchStep` lists them ("none", or "3, 4 (micro-step 1)").
fn list_steps(present: &[(usize, usize)]) -> String {
    if present.is_empty() {
        return "none".into();
    }
    let steps: Vec<String> = present
        .iter()
        .map(|&(s, m)| {
            if m == 0 {
                s.to_string()
            } else {
                format!("{s} (micro-step {m})")
            }
        })
        .collect();
    steps.join(", ")
}

/// The changes as `ConfigChanged` lists them ("steps was 3 when saved, now 4; …").
pub(super) fn list_changes(changes: &[ConfigChange]) -> String {
    let each: Vec<String> = changes
        .iter()
        .map(|c| format!("{} was {} when saved, now {}", c.key, c.was, c.now))
        .collect();
    each.join("; ")
}

/// Why a manifest of an older format `version` cannot be read.
fn older_format_why(version: u64) -> &'static str {
    if version < 2 {
        "has no manifest seal and cannot be verified"
    } else {
        "stores MoE and MLA weights in an orientation this ferrotext no longer reads"
    }
}
