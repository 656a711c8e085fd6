//! The training config: MaxText's key names, a TOML file plus `key=value` overrides, validated
//! once at the edge so the trainer never branches on a bad combination.
//!
//! # Files
//!
//! | file | what it owns |
//! |---|---|
//! | `mod.rs` | [`TrainConfig`]: every key and its default, and the enums of the keys that name a choice |
//! | `load.rs` | [`TrainConfig::load`] and [`TrainConfig::parse`]: a TOML file plus `key=value` overrides → a config, each value of the right type |
//! | `validate.rs` | the checks on values alone and on their combinations with the model and the mesh, each failure a usage error naming its key |
//! | `derived.rs` | what a config implies: device count, mesh, micro-batch rows, bucket bytes, output paths, profiled steps |
//! | `model.rs` | the decoder's config: a preset (or a Hugging Face `config.json`) with the model and MoE keys applied |
//! | `memory.rs` | [`MemoryEstimate`], [`DeviceMemory`] and how memory figures are printed |
//! | `precision.rs` | the precision keys (`dtype`, `weight_dtype`, `grad_dtype`) as a [`Precision`], and the process's bf16 kernel |
//!
//! Invariant: a [`TrainConfig`] is plain data; every check lives in `validate.rs` and runs once,
//! from [`TrainConfig::plan`], so the rest of the trainer never branches on a bad combination.

use ferrotext_data::TokenWidth;
use ferrotext_models::RematPolicy;
use ferrotext_sharding::DType;
use serde::{Deserialize, Serialize};

use crate::optim::OptType;

mod derived;
mod load;
pub(crate) mod memory;
mod model;
mod precision;
mod validate;

pub use memory::{gib, machine_memory_bytes, DeviceMemory, MemoryEstimate};
pub use precision::Precision;

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
    /// A directory of token shards `ferrotext tokenize` wrote (`dataset_path`), verified and
    /// memory-mapped; documents separated by EOS, read as one stream.
    Shards,
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
    /// Model preset: the decoder's (`qwen3-tiny`, `qwen3-peer`, `qwen3-0.6b`, ...) or a model
    /// family's (`mistral-7b`, `gemma2-tiny`, ...; `ferrotext_hf::presets`).
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
    /// A selection-only router bias per MoE layer (DeepSeek-V3's `e_score_correction_bias`).
    pub routed_bias: Option<bool>,
    /// Expert groups of group-limited routing (1: none).
    pub n_routing_groups: Option<usize>,
    /// Groups a token may route to (of `n_routing_groups`).
    pub topk_routing_group: Option<usize>,
    /// Aux-loss-free balancing: after each step every selection bias moves by
    /// `rate · sign(mean load − load)` per expert (0: the biases stay as loaded).
    pub routed_bias_update_rate: f64,
    /// Diagnostic mirror, for tests and the MoE benchmark: drop the expert weights' `reduced`
    /// tags before the MoE region, as a spec rebuilt from logical rules would — their gradients
    /// are then all-reduced inside every micro-batch (numerics unchanged).
    pub moe_withhold_tags: bool,
    /// Weight of the z-loss `(log Z)²` per token (0 disables).
    pub z_loss_multiplier: f64,
    /// What the backward keeps of each decoder layer (MaxText's `remat_policy`; the rest is
    /// recomputed from the layer's input, with the same bits). ferrotext's default is `none`,
    /// not MaxText's `full`: a run that does not fit is refused before it starts, naming the
    /// policy that would fit, and recomputing costs a third more compute on a machine where
    /// memory is rarely the limit at the lengths most runs use.
    pub remat_policy: RematPolicy,
    /// Tiles of each device's tokens the LM head's loss is computed over (MaxText's
    /// `num_vocab_tiling`, which tiles the tokens too): the `[tokens, vocab]` logits never exist
    /// whole, and the backward recomputes each tile's. 1: untiled. Need not divide the tokens
    /// (the last tile is shorter).
    pub num_vocab_tiling: usize,
    /// Windows hold several documents (MaxText's `packing`): each token attends only within its
    /// document, RoPE positions restart at each, and the target that would cross into the next
    /// document is not scored. Needs delimited documents (`dataset_type=shards`).
    pub packing: bool,
    /// Multi-token-prediction depth (MaxText's `mtp_num_layers`): 0 none, 1 DeepSeek-V3's module
    /// after the last layer, trained beside the main loss.
    pub mtp_num_layers: usize,
    /// Weight of the MTP loss's per-token mean in the loss (MaxText's `mtp_loss_scaling_factor`).
    pub mtp_loss_scaling_factor: f64,
    /// Devices (threads) in each process.
    pub local_devices: usize,
    /// Processes of the job; the mesh has `num_processes × local_devices` devices. Set by the
    /// launcher (`mpirun -n P` gives `P`); 1 for an in-process run.
    pub num_processes: usize,
    /// Size of the `data` axis (−1 fills).
    pub ici_data_parallelism: i64,
    /// Size of the `fsdp` axis (−1 fills).
    pub ici_fsdp_parallelism: i64,
    /// Size of the `context` axis (−1 fills): context parallelism, each sequence split over its
    /// devices; attention gathers the keys and values over it.
    pub ici_context_parallelism: i64,
    /// Under context parallelism, cut every row into `2 × context` chunks and give device `i`
    /// chunks `i` and `2·context − 1 − i` (MaxText's `context_parallel_load_balance`): causal
    /// attention then costs every device the same (in order, the last device's queries see
    /// every key and the first's only its own).
    pub context_parallel_load_balance: bool,
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
    /// The optimizer (`adamw`, `sgd`, ...: [`OptType`]).
    pub opt_type: OptType,
    /// AdamW β1 (what each optimizer reads: [`crate::Hyper`]).
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
    pub token_dtype: TokenWidth,
    /// An HF `tokenizer.json` for `corpus` and `text` data (empty: byte-level tokens).
    pub tokenizer_path: String,
    /// Seed of the parameter initialisation.
    pub init_weights_seed: u64,
    /// The dtype of the activations between ops and of the matmul inputs: `float32` or
    /// `bfloat16` (MaxText's names, or `f32`, `bf16`; MaxText's default is `bfloat16`,
    /// ferrotext's `float32`).
    pub dtype: DType,
    /// The dtype of the master weights and the optimizer state: `float32` (the only one built).
    pub weight_dtype: DType,
    /// The dtype of the deferred gradient reduction: `float32`, or `bfloat16` on the wire (the
    /// accumulator is float32 either way).
    pub grad_dtype: DType,
    /// With `dtype=bfloat16` on a kernel without a bf16 product (`FERROTEXT_MATMUL=gemm`, an
    /// OpenBLAS built without it): run bf16 products on ferrotext's own kernel instead of
    /// refusing the run.
    pub matmul_bf16_fallback: bool,
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
    /// The dtype of a saved Hugging Face directory's tensors: `float32` or `bfloat16`.
    pub save_parameters_dtype: DType,
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
    /// reads only the first `1 − eval_split` of it, evaluation only the rest (0: none). For
    /// `shards`, whole shards: the last `⌈eval_split × shards⌉`.
    pub eval_split: f64,
    /// `shards` data: the shards held out for evaluation, a comma list of shard numbers (`3,4`;
    /// empty: `eval_split` decides). A TOML file may also give one number or an array.
    #[serde(deserialize_with = "crate::data::shard_list_from_any")]
    pub eval_shards: String,
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
            routed_bias: None,
            n_routing_groups: None,
            topk_routing_group: None,
            routed_bias_update_rate: 0.0,
            moe_withhold_tags: false,
            z_loss_multiplier: 0.0,
            remat_policy: RematPolicy::None,
            num_vocab_tiling: 1,
            packing: false,
            mtp_num_layers: 0,
            mtp_loss_scaling_factor: 0.1,
            local_devices: 4,
            num_processes: 1,
            ici_data_parallelism: -1,
            ici_fsdp_parallelism: 1,
            ici_context_parallelism: 1,
            context_parallel_load_balance: true,
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
            token_dtype: TokenWidth::U16,
            tokenizer_path: String::new(),
            init_weights_seed: 0,
            dtype: DType::F32,
            weight_dtype: DType::F32,
            grad_dtype: DType::F32,
            matmul_bf16_fallback: false,
            data_shuffle_seed: 0,
            load_parameters_path: String::new(),
            save_parameters_path: String::new(),
            save_parameters_dtype: DType::F32,
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
            eval_shards: String::new(),
            profile: false,
            profile_steps: String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TrainError;

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
            (&["run_name=../elsewhere"], "run_name"),
            (&["run_name=a/b"], "run_name"),
            (&["run_name="], "run_name"),
            (&["run_name=.."], "run_name"),
        ] {
            let err = load(items).unwrap_err();
            assert!(err.is_usage(), "{items:?}: {err}");
            assert!(
                matches!(&err, TrainError::Usage { key: k, .. } if k == key),
                "{items:?}: {err:?}"
            );
        }
        // The mirror: a run name with dots and dashes is one directory.
        assert!(load(&["run_name=run-1.v2..b"]).is_ok());
    }
}
