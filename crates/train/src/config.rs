//! The training config: MaxText's key names, a TOML file plus `key=value` overrides, validated
//! once at the edge so the trainer never branches on a bad combination.

use std::path::Path;
use std::sync::Arc;

use ferrotext_models::qwen3;
use ferrotext_sharding::{AxisType, Mesh};
use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// `shard_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardMode {
    /// Every mesh axis `Explicit`: shardings are types and tags are legal.
    Explicit,
    /// Every mesh axis `Auto`. ferrotext has no automatic partitioner: layouts still come from
    /// the logical rules, but the axes are not part of the types, so no tags and no deferral.
    Auto,
}

/// `opt_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptType {
    /// AdamW with decoupled weight decay on matrices.
    Adamw,
    /// Plain SGD.
    Sgd,
}

/// `dataset_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetType {
    /// The bundled corpus ferrotext generates itself (byte-level tokens).
    Corpus,
    /// Deterministic arithmetic token sequences with 10% noise (the JAX peer's data).
    Synthetic,
    /// A text file (`dataset_path`), byte-level tokens.
    Text,
    /// A pre-tokenized binary file of little-endian `u16` or `u32` ids (`token_dtype`), read whole
    /// into memory when the run opens it (not mapped; see the `data` module docs).
    Tokens,
}

/// `nan_policy`: what a non-finite loss or gradient norm does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NanPolicy {
    /// Stop the run with an error naming the step (nothing of the step is applied).
    Stop,
    /// Drop the step's update (parameters and optimizer state unchanged), count it in the
    /// summary, and go on.
    SkipStep,
}

/// `dataset_order`: how `text` and `tokens` data are cut into sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetOrder {
    /// Windows at pseudo-random offsets (seeded by `data_shuffle_seed`; they may overlap).
    Random,
    /// Consecutive, non-overlapping windows of `max_target_length + 1` tokens in file order,
    /// wrapping at the end of the file (each wrap is one epoch).
    Sequential,
}

/// `resume`: what a run does with the checkpoints already under its `run_name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Continue from the checkpoint `latest` names; a `latest` that cannot be read, or names a
    /// checkpoint that cannot be loaded, is an error (nothing is overwritten).
    Auto,
    /// Start at step 0; an existing checkpoint directory is moved aside (never deleted).
    Fresh,
}

/// Every key `ferrotext train` accepts, with MaxText's names and ferrotext's defaults (the
/// README's main command: `qwen3-tiny` on a data=4 in-process mesh, GA 4, explicit).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Model preset (`qwen3-tiny`, `qwen3-peer`, `qwen3-0.6b`).
    pub model_name: String,
    /// Override of the preset's vocabulary size.
    pub vocab_size: Option<usize>,
    /// Override of the model width.
    pub base_emb_dim: Option<usize>,
    /// Override of the layer count.
    pub base_num_decoder_layers: Option<usize>,
    /// Override of the query heads.
    pub base_num_query_heads: Option<usize>,
    /// Override of the key/value heads.
    pub base_num_kv_heads: Option<usize>,
    /// Override of the head width.
    pub head_dim: Option<usize>,
    /// Override of the MLP width.
    pub base_mlp_dim: Option<usize>,
    /// Override of the tied LM head.
    pub logits_via_embedding: Option<bool>,
    /// Routed experts: turns the preset's feed-forward layers into MoE blocks (or overrides the
    /// count of an MoE preset).
    pub num_experts: Option<usize>,
    /// Experts per token (top-k).
    pub num_experts_per_tok: Option<usize>,
    /// Hidden width of each expert.
    pub moe_mlp_dim: Option<usize>,
    /// Shared experts (each `moe_mlp_dim` wide, run on every token).
    pub shared_experts: Option<usize>,
    /// Leading dense layers of an MoE model.
    pub first_num_dense_layers: Option<usize>,
    /// Router score: `softmax` or `sigmoid`.
    pub routed_score_func: Option<String>,
    /// Factor on the routed experts' output.
    pub routed_scaling_factor: Option<f64>,
    /// Renormalise the chosen experts' scores.
    pub norm_topk_prob: Option<bool>,
    /// Weight of the MoE load-balance loss (0 disables).
    pub load_balance_loss_weight: Option<f64>,
    /// Diagnostic mirror, for tests and the MoE benchmark: drop the expert weights' `reduced`
    /// tags before the MoE region, as a spec rebuilt from logical rules would — their gradients
    /// are then all-reduced inside every micro-batch (numerics unchanged).
    pub moe_withhold_tags: bool,
    /// Weight of the z-loss `(log Z)²` per token (0 disables).
    pub z_loss_multiplier: f64,
    /// Devices (threads) in each process.
    pub local_devices: usize,
    /// Processes of the job; the mesh has `num_processes × local_devices` devices. Set by the
    /// launcher (`mpirun -n P` gives `P`); 1 for an in-process run.
    pub num_processes: usize,
    /// Size of the `data` axis (−1 fills).
    pub ici_data_parallelism: i64,
    /// Size of the `fsdp` axis (−1 fills).
    pub ici_fsdp_parallelism: i64,
    /// Size of the `tensor` axis (−1 fills).
    pub ici_tensor_parallelism: i64,
    /// Size of the `expert` axis (−1 fills): MoE experts are split over it (expert
    /// parallelism), and so is the batch; dense weights stay whole over it.
    pub ici_expert_parallelism: i64,
    /// `explicit` or `auto`.
    pub shard_mode: ShardMode,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Sequences per device per micro-batch (may be fractional, as in MaxText, as long as the
    /// micro-batch is a whole number of sequences divisible by the batch axes).
    pub per_device_batch_size: f64,
    /// Tokens per sequence.
    pub max_target_length: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Fraction of the steps spent in linear warmup.
    pub warmup_steps_fraction: f64,
    /// Final learning rate of the cosine decay, as a fraction of the peak.
    pub learning_rate_final_fraction: f64,
    /// `adamw` or `sgd`.
    pub opt_type: OptType,
    /// AdamW β1.
    pub adam_b1: f64,
    /// AdamW β2.
    pub adam_b2: f64,
    /// AdamW ε.
    pub adam_eps: f64,
    /// AdamW decoupled weight decay (matrices only).
    pub adam_weight_decay: f64,
    /// ZeRO-1: shard the optimizer state over `data` (not with FSDP).
    pub shard_optimizer_over_data: bool,
    /// Global-norm clipping threshold (0 disables).
    pub gradient_clipping_threshold: f64,
    /// Where the data comes from.
    pub dataset_type: DatasetType,
    /// The file for `text` and `tokens`.
    pub dataset_path: String,
    /// `u16` or `u32` for `tokens` files.
    pub token_dtype: String,
    /// An HF `tokenizer.json` for `corpus` and `text` data (empty: byte-level tokens).
    pub tokenizer_path: String,
    /// Seed of the parameter initialisation.
    pub init_weights_seed: u64,
    /// Seed of the data order.
    pub data_shuffle_seed: u64,
    /// Parameters to start from: a safetensors file (HF names and orientation), or a Hugging Face
    /// model directory (`config.json` + `model.safetensors` or shards with
    /// `model.safetensors.index.json`; F32/BF16/F16), whose `config.json` then sets the model in
    /// place of `model_name` (dimension keys still override it, and must then fit the tensors).
    pub load_parameters_path: String,
    /// Where to save the final parameters (empty: don't): a path ending in `.safetensors` is one
    /// F32 file; any other path a Hugging Face model directory (`save_parameters_dtype`).
    pub save_parameters_path: String,
    /// The dtype of a saved Hugging Face directory's tensors: `f32` or `bf16`.
    pub save_parameters_dtype: String,
    /// Directory for run outputs (checkpoints, metrics). A relative path is relative to the
    /// current directory of the command, resolved once when the run is planned and printed
    /// absolute ([`crate::RunPlan::output_dir`]).
    pub base_output_directory: String,
    /// The run's name (its outputs go to `base_output_directory/run_name`).
    pub run_name: String,
    /// Save checkpoints (and resume from the latest one of the same run name).
    pub enable_checkpointing: bool,
    /// Steps between checkpoints (the last step is always saved).
    pub checkpoint_period: usize,
    /// Also checkpoint inside a step, after every this many micro-batches (0: only at step
    /// boundaries). A resumed run continues from the saved micro-batch.
    pub checkpoint_micro_batch_period: usize,
    /// Per-step metrics as JSON lines (empty: `base_output_directory/run_name/metrics.jsonl`).
    pub metrics_file: String,
    /// Also write the per-step scalars as TensorBoard event files into the run directory's
    /// `tensorboard/`.
    pub tensorboard: bool,
    /// Checkpoints to keep (the newest ones; 0 keeps all).
    pub checkpoint_keep: usize,
    /// `auto` (continue from `latest`) or `fresh` (start over, moving old checkpoints aside).
    pub resume: ResumeMode,
    /// `stop` or `skip_step` on a non-finite loss or gradient.
    pub nan_policy: NanPolicy,
    /// `random` or `sequential` windows for `text` and `tokens` data.
    pub dataset_order: DatasetOrder,
    /// Seconds a device waits in a collective before the run fails.
    pub collective_timeout_seconds: f64,
    /// Size of a gradient bucket in MiB: the update reduces the gradients (and ZeRO-1 gathers
    /// the parameters) one bucket per collective instead of one collective per parameter
    /// (PyTorch DDP's default is 25).
    pub grad_bucket_mb: f64,
    /// Start each bucket's reduction during a backward pass, as soon as every gradient in it is
    /// final, on a background stream: with deferral, the step's reduction during the last
    /// micro-batch's backward (the update waits for it); with the gate closed by
    /// `shard_mode=auto`, each micro-batch's reduction during its own backward (PyTorch DDP's
    /// schedule). Bitwise the same weights either way. Its buckets are at most 1/8 of the
    /// gradient bytes (at least 1 MiB), so a small model still has several to overlap.
    pub overlap_grad_reduce: bool,
    /// Compute every matrix product on the portable kernel (each element one chain of fused
    /// multiply-adds in index order), so the run's numbers are the same on any processor and
    /// any matrix library the machine has; without it products run on the fastest library
    /// found (MKL, OpenBLAS), whose order of addition follows the processor.
    pub deterministic: bool,
    /// Sum each step's gradient and loss in one fixed tree over units of one device's
    /// micro-batch (unit `device × GA + micro-batch`), so the run's numbers do not depend on
    /// how the global batch is laid out: data=4 × GA 1, data=2 × GA 2, data=1 × GA 4, in one
    /// process or over MPI, give the same bits. Needs `deterministic=true`, a data-parallel
    /// mesh, a power-of-two `gradient_accumulation_steps`; see `RunPlan` for what it refuses.
    /// The `Trainer` cuts the data into units itself; a caller of `Engine::fwd_bwd` feeds each
    /// device its own unit's rows.
    pub layout_invariant: bool,
    /// Steps between evaluations on held-out data (0: never); the last step always evaluates
    /// when this is set. Needs held-out data: `eval_dataset_path`, `eval_split`, or synthetic
    /// data (whose eval sequences come from their own stream).
    pub eval_interval: usize,
    /// Batches of `per_device_batch_size × devices` sequences per evaluation (the same batches
    /// every time, so evaluations compare).
    pub eval_steps: usize,
    /// A file of held-out data, read like `dataset_path` (same `dataset_type` and `token_dtype`;
    /// for `corpus` data, a text file).
    pub eval_dataset_path: String,
    /// The fraction of the data file (or the bundled corpus) held out for evaluation: training
    /// reads only the first `1 − eval_split` of it, evaluation only the rest (0: none).
    pub eval_split: f64,
    /// Record every op of the steps in `profile_steps` on every device thread, and print a
    /// table and write a Chrome trace at the end (`profile.txt`, `profile-trace.json`).
    pub profile: bool,
    /// The steps `profile` records, `a:b` (from step `a` up to, not including, `b`; `b` past
    /// the last step stops there). Empty: steps 1 to 3 (step 0 pays for warm-up), or step 0 of
    /// a one-step run.
    pub profile_steps: String,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            model_name: "qwen3-tiny".into(),
            vocab_size: None,
            base_emb_dim: None,
            base_num_decoder_layers: None,
            base_num_query_heads: None,
            base_num_kv_heads: None,
            head_dim: None,
            base_mlp_dim: None,
            logits_via_embedding: None,
            num_experts: None,
            num_experts_per_tok: None,
            moe_mlp_dim: None,
            shared_experts: None,
            first_num_dense_layers: None,
            routed_score_func: None,
            routed_scaling_factor: None,
            norm_topk_prob: None,
            load_balance_loss_weight: None,
            moe_withhold_tags: false,
            z_loss_multiplier: 0.0,
            local_devices: 4,
            num_processes: 1,
            ici_data_parallelism: -1,
            ici_fsdp_parallelism: 1,
            ici_tensor_parallelism: 1,
            ici_expert_parallelism: 1,
            shard_mode: ShardMode::Explicit,
            gradient_accumulation_steps: 4,
            per_device_batch_size: 2.0,
            max_target_length: 128,
            steps: 300,
            learning_rate: 3e-3,
            warmup_steps_fraction: 0.1,
            learning_rate_final_fraction: 0.1,
            opt_type: OptType::Adamw,
            adam_b1: 0.9,
            adam_b2: 0.95,
            adam_eps: 1e-8,
            adam_weight_decay: 0.1,
            shard_optimizer_over_data: false,
            gradient_clipping_threshold: 1.0,
            dataset_type: DatasetType::Corpus,
            dataset_path: String::new(),
            token_dtype: "u16".into(),
            tokenizer_path: String::new(),
            init_weights_seed: 0,
            data_shuffle_seed: 0,
            load_parameters_path: String::new(),
            save_parameters_path: String::new(),
            save_parameters_dtype: "f32".into(),
            base_output_directory: "ferrotext_runs".into(),
            run_name: "default".into(),
            metrics_file: String::new(),
            tensorboard: false,
            enable_checkpointing: false,
            checkpoint_period: 100,
            checkpoint_micro_batch_period: 0,
            checkpoint_keep: 0,
            resume: ResumeMode::Auto,
            nan_policy: NanPolicy::Stop,
            dataset_order: DatasetOrder::Random,
            collective_timeout_seconds: 300.0,
            grad_bucket_mb: 25.0,
            overlap_grad_reduce: false,
            deterministic: false,
            layout_invariant: false,
            eval_interval: 0,
            eval_steps: 1,
            eval_dataset_path: String::new(),
            eval_split: 0.0,
            profile: false,
            profile_steps: String::new(),
        }
    }
}

/// A `key=value` override's value as TOML: integer, float, boolean, or string.
fn parse_value(text: &str) -> toml::Value {
    if let Ok(i) = text.parse::<i64>() {
        return toml::Value::Integer(i);
    }
    if let Ok(f) = text.parse::<f64>() {
        return toml::Value::Float(f);
    }
    match text {
        "true" | "True" => toml::Value::Boolean(true),
        "false" | "False" => toml::Value::Boolean(false),
        _ => toml::Value::String(text.to_string()),
    }
}

/// The key whose value failed to deserialize and `err`'s message naming it (serde's message
/// names the expected type but not the field): each key is tried alone to find it.
fn name_the_key(table: &toml::Table, err: &toml::de::Error) -> (String, String) {
    let message = err.message().replace('\n', " ");
    for (key, value) in table {
        let alone: toml::Table = [(key.clone(), value.clone())].into_iter().collect();
        if let Err(e) = toml::Value::Table(alone).try_into::<TrainConfig>() {
            let first = e.message().lines().next().unwrap_or_default().to_string();
            if first.starts_with("unknown field") {
                // serde lists every field; the user wants the one they meant.
                return (key.clone(), crate::keys::unknown_key_message(key));
            }
            let form = crate::keys::find(key)
                .map_or(String::new(), |k| format!(" (`{key}` takes {})", k.form));
            return (key.clone(), format!("{key} = {value}: {first}{form}"));
        }
    }
    (String::new(), message)
}

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
    /// The config from an optional TOML file and `key=value` overrides (later ones win),
    /// validated.
    ///
    /// # Errors
    /// [`TrainError::Config`] with one line naming the key: an unknown key, a value of the wrong
    /// type, an unreadable file, or any [`TrainConfig::validate`] failure.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<TrainConfig, TrainError> {
        let config = TrainConfig::parse(file, overrides)?;
        config.validate()?;
        Ok(config)
    }

    /// The config from an optional TOML file and `key=value` overrides (later ones win), each
    /// value of the right type but not yet checked together: [`TrainConfig::plan`] does that.
    ///
    /// # Errors
    /// [`TrainError::Usage`] naming the key (an unknown key, a value of the wrong type);
    /// [`TrainError::Config`] for an unreadable file or an argument that is not `key=value`.
    pub fn parse(file: Option<&Path>, overrides: &[String]) -> Result<TrainConfig, TrainError> {
        let mut table = match file {
            Some(path) => {
                let bytes = ferrotext_hf::files::read_named(path)
                    .map_err(|e| TrainError::Config(format!("config: {e}")))?;
                let text = String::from_utf8(bytes).map_err(|_| {
                    TrainError::Config(format!("config {} is not UTF-8 text", path.display()))
                })?;
                text.parse::<toml::Table>().map_err(|e| {
                    TrainError::Config(format!("config {}: {}", path.display(), e.message()))
                })?
            }
            None => toml::Table::new(),
        };
        for item in overrides {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| TrainError::Config(format!("`{item}` is not `key=value`")))?;
            table.insert(key.trim().to_string(), parse_value(value.trim()));
        }
        let config: TrainConfig =
            toml::Value::Table(table.clone())
                .try_into()
                .map_err(|e: toml::de::Error| {
                    let (key, reason) = name_the_key(&table, &e);
                    TrainError::usage(key, reason)
                })?;
        Ok(config)
    }

    /// The decoder's config: the preset with the overrides applied. Only
    /// [`TrainConfig::plan`] calls it (once); everything else reads the plan's decoder.
    ///
    /// # Errors
    /// An unknown preset, MoE keys that do not fit the preset, or a Hugging Face directory
    /// whose `config.json` is not usable.
    pub(crate) fn model(&self) -> Result<qwen3::Config, TrainError> {
        let hf_dir = Path::new(&self.load_parameters_path);
        let mut m = if !self.load_parameters_path.is_empty() && hf_dir.is_dir() {
            ferrotext_hf::read_config(hf_dir)?
        } else {
            qwen3::Config::preset(&self.model_name).ok_or_else(|| {
                TrainError::usage(
                    "model_name",
                    format!(
                        "model_name `{}` is not a preset (one of {})",
                        self.model_name,
                        qwen3::Config::PRESETS.join(", ")
                    ),
                )
            })?
        };
        let set = |field: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut m.vocab_size, self.vocab_size);
        set(&mut m.base_emb_dim, self.base_emb_dim);
        set(&mut m.base_num_decoder_layers, self.base_num_decoder_layers);
        set(&mut m.base_num_query_heads, self.base_num_query_heads);
        set(&mut m.base_num_kv_heads, self.base_num_kv_heads);
        set(&mut m.head_dim, self.head_dim);
        set(&mut m.base_mlp_dim, self.base_mlp_dim);
        if let Some(t) = self.logits_via_embedding {
            m.logits_via_embedding = t;
        }
        m.z_loss_multiplier = self.z_loss_multiplier as f32;
        self.apply_moe(&mut m)?;
        Ok(m)
    }

    /// The MoE keys on top of the preset's feed-forward.
    fn apply_moe(&self, m: &mut qwen3::Config) -> Result<(), TrainError> {
        let any_key = self.num_experts.is_some()
            || self.num_experts_per_tok.is_some()
            || self.moe_mlp_dim.is_some()
            || self.shared_experts.is_some()
            || self.first_num_dense_layers.is_some()
            || self.routed_score_func.is_some()
            || self.routed_scaling_factor.is_some()
            || self.norm_topk_prob.is_some()
            || self.load_balance_loss_weight.is_some()
            || self.moe_withhold_tags;
        if m.moe.is_none() && self.num_experts.is_none() {
            if any_key {
                return Err(TrainError::usage(
                    "num_experts",
                    format!(
                        "MoE keys need an MoE model: set num_experts or pick an MoE preset \
                         (model_name `{}` is dense)",
                        self.model_name
                    ),
                ));
            }
            return Ok(());
        }
        let mut moe = m.moe.clone().unwrap_or(qwen3::MoeSettings {
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_mlp_dim: m.base_mlp_dim,
            shared_experts: 0,
            first_num_dense_layers: 0,
            score: ferrotext_models::moe::RouterScore::Softmax,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
            load_balance_loss_weight: 0.0,
            withhold_tags: false,
        });
        let set = |field: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut moe.num_experts, self.num_experts);
        set(&mut moe.num_experts_per_tok, self.num_experts_per_tok);
        set(&mut moe.moe_mlp_dim, self.moe_mlp_dim);
        set(&mut moe.shared_experts, self.shared_experts);
        set(&mut moe.first_num_dense_layers, self.first_num_dense_layers);
        if let Some(f) = &self.routed_score_func {
            moe.score = match f.as_str() {
                "softmax" => ferrotext_models::moe::RouterScore::Softmax,
                "sigmoid" => ferrotext_models::moe::RouterScore::Sigmoid,
                other => {
                    return Err(TrainError::usage(
                        "routed_score_func",
                        format!("routed_score_func must be `softmax` or `sigmoid`, got `{other}`"),
                    ))
                }
            };
        }
        if let Some(f) = self.routed_scaling_factor {
            moe.routed_scaling_factor = f as f32;
        }
        if let Some(n) = self.norm_topk_prob {
            moe.norm_topk_prob = n;
        }
        if let Some(w) = self.load_balance_loss_weight {
            if !(w >= 0.0 && w.is_finite()) {
                return Err(TrainError::usage(
                    "load_balance_loss_weight",
                    format!("load_balance_loss_weight must be ≥ 0, got {w}"),
                ));
            }
            moe.load_balance_loss_weight = w as f32;
        }
        moe.withhold_tags = self.moe_withhold_tags;
        m.moe = Some(moe);
        Ok(())
    }

    /// Devices of the whole mesh: `num_processes × local_devices` (saturating; `validate`
    /// bounds both).
    pub fn devices(&self) -> usize {
        self.num_processes.saturating_mul(self.local_devices)
    }

    /// The mesh `data × fsdp × tensor` over [`TrainConfig::devices`], each −1 filled, every axis typed by
    /// `shard_mode`.
    ///
    /// # Errors
    /// More than one −1, a size that is 0 or below −1, or a product that is not the device count.
    pub fn mesh(&self) -> Result<Arc<Mesh>, TrainError> {
        let named = [
            ("data", self.ici_data_parallelism),
            ("fsdp", self.ici_fsdp_parallelism),
            ("tensor", self.ici_tensor_parallelism),
            ("expert", self.ici_expert_parallelism),
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
                        "mesh data×fsdp×tensor×expert = {}×{}×{}×{} is larger than the {} devices",
                        named[0].1,
                        named[1].1,
                        named[2].1,
                        named[3].1,
                        self.devices()
                    ),
                )
            })?;
        let devices = self.devices() as i64;
        let sizes: Vec<(String, usize)> = named
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
                    "mesh data×fsdp×tensor×expert = {}×{}×{}×{} = {product} does not match local_devices = {}{processes}",
                    sizes[0].1, sizes[1].1, sizes[2].1, sizes[3].1, self.local_devices
                ),
            ));
        }
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
            || self.dataset_type == DatasetType::Synthetic;
        if self.eval_interval > 0 && !held_out {
            return Err(TrainError::usage(
                "eval_interval",
                "eval_interval needs held-out data: set eval_split (e.g. 0.1) or eval_dataset_path"
                    .to_string(),
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

    /// The steps `profile` records (`profile_steps`, validated by [`TrainConfig::validate`]).
    pub fn profile_step_range(&self) -> std::ops::Range<usize> {
        self.parse_profile_steps().unwrap_or(0..0)
    }

    fn parse_profile_steps(&self) -> Result<std::ops::Range<usize>, TrainError> {
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
        ] {
            if v == 0 {
                return Err(TrainError::usage(key, format!("{key} must be at least 1")));
            }
        }
        self.check_floats()?;
        self.parse_profile_steps()?;
        self.check_eval()?;
        if ferrotext_hf::SaveDtype::parse(&self.save_parameters_dtype).is_none() {
            return Err(TrainError::usage(
                "save_parameters_dtype",
                format!(
                    "save_parameters_dtype must be f32 or bf16, got `{}`",
                    self.save_parameters_dtype
                ),
            ));
        }
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

    /// The combinations that need the model and the mesh: ZeRO-1 and expert parallelism, the
    /// batch over its axes, heads over `tensor`, the data source.
    pub(crate) fn check_combinations(
        &self,
        model: &qwen3::Config,
        mesh: &Mesh,
    ) -> Result<(), TrainError> {
        let bad = |key: &str, m: String| Err(TrainError::usage(key, m));
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
            if n % tensor != 0 {
                return bad(
                    what,
                    format!("{what} = {n} is not divisible by ici_tensor_parallelism = {tensor}"),
                );
            }
        }
        match self.dataset_type {
            DatasetType::Text | DatasetType::Tokens if self.dataset_path.is_empty() => {
                return bad(
                    "dataset_path",
                    format!("dataset_type={:?} needs dataset_path", self.dataset_type)
                        .to_lowercase(),
                );
            }
            DatasetType::Tokens if self.token_dtype != "u16" && self.token_dtype != "u32" => {
                return bad(
                    "token_dtype",
                    format!("token_dtype must be u16 or u32, got `{}`", self.token_dtype),
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
}

/// What [`crate::RunPlan::memory_estimate`] counts, in bytes per process.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryEstimate {
    /// Parameters, accumulator, reduced gradients and optimizer state of the process's
    /// devices, plus the host copy of the parameters.
    pub parameter_and_optimizer_bytes: f64,
    /// One micro-batch's activations on each of the process's devices.
    pub activation_bytes: f64,
}

/// What [`crate::RunPlan::memory_per_device`] counts for one device, in bytes (`f32` values), with
/// the element counts the optimizer's cost is computed from. `total_bytes` is the sum of the five
/// byte fields.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DeviceMemory {
    /// Parameters of the whole model.
    pub parameter_elements: f64,
    /// Parameter elements this device holds (÷ `fsdp × tensor`).
    pub local_parameter_elements: f64,
    /// Elements the optimizer steps on this device (÷ `data` more under ZeRO-1).
    pub optimizer_stepped_elements: f64,
    /// The device's parameters.
    pub parameter_bytes: f64,
    /// The gradient accumulator (the micro-batches' partial sums).
    pub accumulator_bytes: f64,
    /// The reduced gradients `update` produces (a slice under ZeRO-1).
    pub gradient_bytes: f64,
    /// The optimizer state (AdamW's two moments; none for SGD; ÷ `data` under ZeRO-1).
    pub optimizer_bytes: f64,
    /// One micro-batch's activations kept for the backward pass.
    pub activation_bytes: f64,
    /// The sum of the five above.
    pub total_bytes: f64,
}

impl MemoryEstimate {
    /// The sum.
    pub fn total(&self) -> f64 {
        self.parameter_and_optimizer_bytes + self.activation_bytes
    }
}

/// `bytes` in GiB with one decimal (`12.0 GiB`), as memory figures are printed.
pub fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / f64::from(1u32 << 30))
}

/// `MemTotal` from `/proc/meminfo`, in bytes (`None` where it cannot be read).
pub fn machine_memory_bytes() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: f64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(items: &[&str]) -> Result<TrainConfig, TrainError> {
        TrainConfig::load(
            None,
            &items.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn defaults_are_the_readme_main_job() {
        let c = load(&[]).unwrap();
        assert_eq!(c.model_name, "qwen3-tiny");
        let mesh = c.mesh().unwrap();
        assert_eq!(
            mesh.to_string(),
            "Mesh('data': 4, 'fsdp': 1, 'tensor': 1, 'expert': 1, axis_types=(Explicit, Explicit, Explicit, Explicit))"
        );
        assert_eq!(c.gradient_accumulation_steps, 4);
    }

    #[test]
    fn overrides_and_fill() {
        let c = load(&[
            "ici_data_parallelism=2",
            "ici_tensor_parallelism=-1",
            "opt_type=sgd",
            "learning_rate=0.5",
        ])
        .unwrap();
        assert_eq!(c.mesh().unwrap().axis_size("tensor").unwrap(), 2);
        assert_eq!(c.opt_type, OptType::Sgd);
        assert_eq!(c.learning_rate, 0.5);
    }

    #[test]
    fn bad_input_is_one_clear_line() {
        let msg = |items: &[&str]| load(items).unwrap_err().to_string();
        assert!(msg(&["no_such_key=1"]).contains("unknown key `no_such_key`"));
        assert!(msg(&["stepz=1"]).contains("unknown key `stepz`; did you mean `steps`?"));
        assert!(msg(&["steps=abc"]).contains("invalid type"));
        assert!(msg(&["ici_data_parallelism=3"]).contains("does not match local_devices = 4"));
        assert!(msg(&["shard_mode=manual"]).contains("unknown variant `manual`"));
        assert!(msg(&["gradient_accumulation_steps=0"])
            .contains("gradient_accumulation_steps must be at least 1"));
        assert!(msg(&["per_device_batch_size=0.5"])
            .contains("is not divisible by data×fsdp×expert = 4"));
        assert!(msg(&["per_device_batch_size=0.3"]).contains("whole number of sequences"));
        assert!(msg(&["model_name=gpt5"]).contains("is not a preset"));
        assert!(msg(&["dataset_type=text"]).contains("needs dataset_path"));
        for m in [msg(&["steps=abc"]), msg(&["no_such_key=1"])] {
            assert_eq!(m.lines().count(), 1, "{m}");
        }
    }

    /// The message once had a run of stray spaces from a line continuation inside the string.
    #[test]
    fn moe_keys_on_a_dense_model_name_the_remedy_in_one_sentence() {
        let err = load(&["moe_mlp_dim=64"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "MoE keys need an MoE model: set num_experts or pick an MoE preset (model_name \
             `qwen3-tiny` is dense)"
        );
        assert!(matches!(&err, TrainError::Usage { key, .. } if key == "num_experts"));
    }

    /// Every bad value is the usage class and names its key.
    #[test]
    fn bad_values_are_usage_errors_naming_the_key() {
        for (items, key) in [
            (&["steps=0"][..], "steps"),
            (&["learning_rate=-1"], "learning_rate"),
            (&["steps=abc"], "steps"),
            (&["no_such_key=1"], "no_such_key"),
            (
                &["ici_tensor_parallelism=2", "base_num_kv_heads=1"],
                "base_num_kv_heads",
            ),
        ] {
            let err = load(items).unwrap_err();
            assert!(err.is_usage(), "{items:?}: {err}");
            assert!(
                matches!(&err, TrainError::Usage { key: k, .. } if k == key),
                "{items:?}: {err:?}"
            );
        }
    }
}
