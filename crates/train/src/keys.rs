//! The front door's list of `ferrotext train` keys: each key's group, the form of its value and
//! one line of meaning, and the nearest valid names for a key that does not exist.
//!
//! Invariant: [`KEYS`] names exactly the fields of [`TrainConfig`] (a test compares it with the
//! serialized default config), so the list cannot drift from what the parser accepts. Defaults
//! are read from `TrainConfig::default()`, never written twice.

use std::fmt::Write as _;

use crate::config::TrainConfig;

/// The sections `ferrotext keys` prints, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Group {
    /// The model's preset and shape.
    Model,
    /// The dtypes of activations, weights and gradients, and the bf16 kernel.
    Precision,
    /// Devices, processes and the mesh.
    Mesh,
    /// Batch shape, steps and the data.
    Data,
    /// The optimizer and the learning-rate schedule.
    Optimizer,
    /// Checkpoints, resuming and parameter files.
    Checkpoints,
    /// Where output goes, and the run's failure policies.
    Output,
}

impl Group {
    /// The section heading.
    pub fn title(self) -> &'static str {
        match self {
            Group::Model => "model",
            Group::Precision => "precision",
            Group::Mesh => "mesh",
            Group::Data => "data",
            Group::Optimizer => "optimizer",
            Group::Checkpoints => "checkpoints",
            Group::Output => "output",
        }
    }
}

/// One key of `ferrotext train`.
#[derive(Clone, Copy, Debug)]
pub struct Key {
    /// The key (MaxText's name where MaxText has one).
    pub name: &'static str,
    /// Its section.
    pub group: Group,
    /// The form of its value (`integer`, `float`, `true|false`, `adamw|sgd`, ...).
    pub form: &'static str,
    /// One line of meaning.
    pub meaning: &'static str,
}

const fn key(name: &'static str, group: Group, form: &'static str, meaning: &'static str) -> Key {
    Key {
        name,
        group,
        form,
        meaning,
    }
}

use Group::{Checkpoints, Data, Mesh, Model, Optimizer, Output, Precision};

/// Every key `ferrotext train` accepts, grouped.
pub const KEYS: &[Key] = &[
    key("model_name", Model, "preset name", "model preset (qwen3-tiny, qwen3-0.6b, qwen3-moe-tiny, deepseek3-tiny, llama3.2-1b, mistral-7b, mixtral-8x7b, gemma2-2b, gemma3-1b, deepseek2-lite, qwen1.5-moe-a2.7b, olmo2-1b, each family's <name>-tiny, ...)"),
    key("vocab_size", Model, "integer", "override of the preset's vocabulary size"),
    key("base_emb_dim", Model, "integer", "override of the model width"),
    key("base_num_decoder_layers", Model, "integer", "override of the layer count"),
    key("base_num_query_heads", Model, "integer", "override of the query heads"),
    key("base_num_kv_heads", Model, "integer", "override of the key/value heads"),
    key("head_dim", Model, "integer", "override of the head width"),
    key("base_mlp_dim", Model, "integer", "override of the MLP width"),
    key("logits_via_embedding", Model, "true|false", "tie the LM head to the embedding"),
    key("num_experts", Model, "integer", "routed experts (turns the feed-forward layers into MoE blocks)"),
    key("num_experts_per_tok", Model, "integer", "experts per token (top-k)"),
    key("moe_mlp_dim", Model, "integer", "hidden width of each expert"),
    key("shared_experts", Model, "integer", "shared experts, run on every token"),
    key("first_num_dense_layers", Model, "integer", "leading dense layers of an MoE model"),
    key("routed_score_func", Model, "softmax|sigmoid", "router score function"),
    key("routed_scaling_factor", Model, "float", "factor on the routed experts' output"),
    key("norm_topk_prob", Model, "true|false", "renormalise the chosen experts' scores"),
    key("load_balance_loss_weight", Model, "float ≥ 0", "weight of the MoE load-balance loss (0 disables)"),
    key("routed_bias", Model, "true|false", "a selection-only router bias per MoE layer (DeepSeek-V3's e_score_correction_bias)"),
    key("n_routing_groups", Model, "integer ≥ 1", "expert groups of group-limited routing (1: none)"),
    key("topk_routing_group", Model, "integer ≥ 1", "groups a token may route to"),
    key("routed_bias_update_rate", Optimizer, "float ≥ 0", "aux-loss-free balancing: bias += rate·sign(mean load − load) after each step (0: off)"),
    key("moe_withhold_tags", Model, "true|false", "diagnostic: drop the expert weights' reduced tags (gradients all-reduced every micro-batch)"),
    key("z_loss_multiplier", Model, "float ≥ 0", "weight of the z-loss (log Z)² per token (0 disables)"),
    key("remat_policy", Model, "none|full|minimal|save_dot_except_mlp|save_dot_except_mlpwi|save_qkv_proj|save_out_proj", "what the backward keeps of each layer (the rest is recomputed, same bits): none everything, full only the layer's input, minimal the projections' outputs"),
    key("num_vocab_tiling", Model, "integer ≥ 1", "tiles of each device's tokens the LM head's loss is computed over: the [tokens, vocab] logits never exist whole (1: untiled)"),
    key("mtp_num_layers", Model, "0|1", "multi-token prediction: 1 trains DeepSeek-V3's module (model.layers.{L}.*) predicting the token two ahead; 0 none"),
    key("mtp_loss_scaling_factor", Model, "float ≥ 0", "weight of the MTP loss (per-token mean) added to the main loss"),
    key("dtype", Precision, "bfloat16|float32", "activations between ops and matmul inputs (MaxText's default: bfloat16; every dtype key also takes bf16, f32); norms' statistics, logits, loss, router scores and the optimizer stay float32"),
    key("weight_dtype", Precision, "float32", "master weights and optimizer state (converted to dtype at use)"),
    key("grad_dtype", Precision, "bfloat16|float32", "the deferred gradient reduction (bfloat16: each device's f32 sum rounded once per step, half the bytes on the wire; not with layout_invariant=true)"),
    key("matmul_bf16_fallback", Precision, "true|false", "dtype=bfloat16 on a FERROTEXT_MATMUL kernel without a bf16 product: use ferrotext's own bf16 kernel instead of refusing"),
    key("local_devices", Mesh, "integer ≥ 1", "devices (threads) in each process"),
    key("num_processes", Mesh, "integer ≥ 1", "processes of the job (set by the launcher under mpirun)"),
    key("ici_data_parallelism", Mesh, "integer, -1 fills", "size of the data axis"),
    key("ici_fsdp_parallelism", Mesh, "integer, -1 fills", "size of the fsdp axis"),
    key("ici_tensor_parallelism", Mesh, "integer, -1 fills", "size of the tensor axis"),
    key("ici_context_parallelism", Mesh, "integer, -1 fills", "size of the context axis (each sequence split over it; attention gathers the keys and values)"),
    key("context_parallel_load_balance", Mesh, "true|false", "under context parallelism, give each device two chunks of every sequence, one from each end (causal attention then costs every device the same)"),
    key("ici_expert_parallelism", Mesh, "integer, -1 fills", "size of the expert axis (experts and the batch split over it)"),
    key("shard_mode", Mesh, "explicit|auto", "explicit: shardings are types and gradients may stay unreduced; auto: no tags, no deferral"),
    key("collective_timeout_seconds", Mesh, "float > 0", "seconds a device waits in a collective before the run fails"),
    key("grad_bucket_mb", Mesh, "float > 0", "gradient bucket size in MiB (one collective per bucket)"),
    key("overlap_grad_reduce", Mesh, "true|false", "start each bucket's reduction during the backward (the last micro-batch's, or each one's with the gate closed)"),
    key("layout_invariant", Mesh, "true|false", "sum each step's gradient in one tree over (device, micro-batch) units: the same bits on data=4 × GA 1, data=2 × GA 2, data=1 × GA 4 and over MPI (needs deterministic=true)"),
    key("deterministic", Mesh, "true|false", "every matrix product on the portable fixed-order kernel: the same bits on any processor, at a cost in step time"),
    key("gradient_accumulation_steps", Data, "integer ≥ 1", "micro-batches per optimizer step"),
    key("per_device_batch_size", Data, "float > 0", "sequences per device per micro-batch (may be fractional)"),
    key("max_target_length", Data, "integer ≥ 1", "tokens per sequence"),
    key("steps", Data, "integer", "optimizer steps"),
    key("dataset_type", Data, "corpus|synthetic|text|tokens|shards", "where the data comes from (shards: a directory `ferrotext tokenize` wrote)"),
    key("dataset_path", Data, "path", "the file for text and tokens data, the directory for shards"),
    key("packing", Data, "true|false", "windows hold several documents: attention stays inside each, positions restart at each, the target across a boundary is not scored (needs dataset_type=shards)"),
    key("token_dtype", Data, "u16|u32", "id width of a tokens file"),
    key("tokenizer_path", Data, "path", "an HF tokenizer.json for corpus and text data (empty: byte-level tokens)"),
    key("data_shuffle_seed", Data, "integer", "seed of the data order"),
    key("dataset_order", Data, "random|sequential", "random windows, or contiguous sequences in file order"),
    key("eval_interval", Data, "integer", "steps between evaluations on held-out data (0: never)"),
    key("eval_steps", Data, "integer ≥ 1", "batches per evaluation (the same ones every time)"),
    key("eval_dataset_path", Data, "path", "a held-out data file, read like dataset_path"),
    key("eval_split", Data, "float in [0, 0.5]", "fraction of the data held out from training for evaluation (shards: whole shards, the last ⌈split × shards⌉)"),
    key("eval_shards", Data, "comma list of shard numbers", "shards data: the shards held out for evaluation (empty: eval_split decides)"),
    key("learning_rate", Optimizer, "float > 0", "peak learning rate"),
    key("warmup_steps_fraction", Optimizer, "float in [0, 1]", "fraction of the steps in linear warmup"),
    key("learning_rate_final_fraction", Optimizer, "float in [0, 1]", "final learning rate of the cosine decay, as a fraction of the peak"),
    key("opt_type", Optimizer, crate::optim::OPT_TYPE_FORM, "the optimizer"),
    key("adam_b1", Optimizer, "float in [0, 1)", "AdamW β1; Lion's interpolation of momentum and gradient"),
    key("adam_b2", Optimizer, "float in [0, 1)", "AdamW β2; Lion's momentum decay"),
    key("adam_eps", Optimizer, "float > 0", "AdamW ε"),
    key("adam_weight_decay", Optimizer, "float ≥ 0", "AdamW and Lion decoupled weight decay (matrices only)"),
    key("shard_optimizer_over_data", Optimizer, "true|false", "ZeRO-1: shard the optimizer state over data"),
    key("gradient_clipping_threshold", Optimizer, "float ≥ 0", "global-norm clipping threshold (0 disables)"),
    key("init_weights_seed", Optimizer, "integer", "seed of the parameter initialisation"),
    key("load_parameters_path", Checkpoints, "path", "parameters to start from: a safetensors file or a Hugging Face model directory"),
    key("save_parameters_path", Checkpoints, "path", "where to save the final parameters: a .safetensors file or a Hugging Face directory (empty: don't)"),
    key("save_parameters_dtype", Checkpoints, "bfloat16|float32", "dtype of a saved Hugging Face directory's tensors"),
    key("enable_checkpointing", Checkpoints, "true|false", "save checkpoints and resume from the latest one"),
    key("checkpoint_period", Checkpoints, "integer ≥ 1", "steps between checkpoints (the last step is always saved)"),
    key("checkpoint_micro_batch_period", Checkpoints, "integer", "also checkpoint every this many micro-batches inside a step (0: off)"),
    key("checkpoint_keep", Checkpoints, "integer", "checkpoints to keep, newest first (0 keeps all)"),
    key("resume", Checkpoints, "auto|fresh", "continue from latest, or start over moving old checkpoints aside"),
    key("base_output_directory", Output, "path", "directory for run outputs"),
    key("run_name", Output, "name", "the run's name, one directory (no `/`): outputs go to base_output_directory/run_name"),
    key("tensorboard", Output, "bool", "also write each step's scalars as TensorBoard event files into the run directory's tensorboard/"),
    key("metrics_file", Output, "path", "per-step metrics as JSON lines (empty: the run directory's metrics.jsonl)"),
    key("profile", Output, "true|false", "record every op of the profiled steps: a table and a Chrome trace in the run directory"),
    key("profile_steps", Output, "a:b", "the steps profile records, a up to b (empty: steps 1 to 3)"),
    key("nan_policy", Output, "stop|skip_step", "what a non-finite loss or gradient does"),
];

/// The key named `name`, if it exists.
pub fn find(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|k| k.name == name)
}

/// Up to three valid keys nearest to `unknown`, nearest first: the keys within a small edit
/// distance of it, or, when none is, the keys that contain it (or that it contains).
pub fn nearest(unknown: &str) -> Vec<&'static str> {
    let unknown = unknown.trim().to_ascii_lowercase();
    let mut close: Vec<(usize, &'static str)> = KEYS
        .iter()
        .map(|k| (strsim::damerau_levenshtein(&unknown, k.name), k.name))
        .filter(|(d, name)| *d <= (name.len().max(unknown.len()) / 3).max(2))
        .collect();
    close.sort();
    if let Some(&(best, _)) = close.first() {
        // Only the nearest (and any as near, give or take one edit).
        return close
            .into_iter()
            .take_while(|(d, _)| *d <= best + 1)
            .take(3)
            .map(|(_, name)| name)
            .collect();
    }
    if unknown.len() < 3 {
        return Vec::new();
    }
    KEYS.iter()
        .filter(|k| k.name.contains(&unknown) || unknown.contains(k.name))
        .take(3)
        .map(|k| k.name)
        .collect()
}

/// The message for an unknown key: the key and the nearest valid names, or a pointer to the
/// list when nothing is near.
pub fn unknown_key_message(unknown: &str) -> String {
    let near = nearest(unknown);
    match near.as_slice() {
        [] => format!("unknown key `{unknown}` (`ferrotext keys` lists every key)"),
        [one] => format!("unknown key `{unknown}`; did you mean `{one}`?"),
        many => format!(
            "unknown key `{unknown}`; did you mean {}?",
            many.iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(" or ")
        ),
    }
}

/// The default of every key as text (`-` for an unset override, `""` for an empty string).
fn defaults() -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(TrainConfig::default()) {
        Ok(serde_json::Value::Object(map)) => map,
        // A struct of plain fields always serializes to an object.
        _ => serde_json::Map::new(),
    }
}

fn shown(value: Option<&serde_json::Value>) -> String {
    match value {
        None | Some(serde_json::Value::Null) => "-".into(),
        Some(serde_json::Value::String(s)) if s.is_empty() => "\"\"".into(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Every key with its form, default and meaning, grouped, as `ferrotext keys` prints it.
pub fn table() -> String {
    let defaults = defaults();
    let mut out = String::new();
    let mut groups: Vec<Group> = KEYS.iter().map(|k| k.group).collect();
    groups.sort();
    groups.dedup();
    for group in groups {
        let _ = writeln!(out, "{}:", group.title());
        for k in KEYS.iter().filter(|k| k.group == group) {
            let _ = writeln!(
                out,
                "  {:<30} {:<30} default {:<14} {}",
                k.name,
                k.form,
                shown(defaults.get(k.name)),
                k.meaning
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_names_exactly_the_config_keys() {
        let mut listed: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
        listed.sort();
        let before = listed.len();
        listed.dedup();
        assert_eq!(before, listed.len(), "a key is listed twice");
        let mut fields: Vec<String> = defaults().keys().cloned().collect();
        fields.sort();
        assert_eq!(listed, fields);
    }

    #[test]
    fn typos_get_the_nearest_names() {
        assert_eq!(nearest("step")[0], "steps");
        assert_eq!(nearest("stpes")[0], "steps");
        assert_eq!(nearest("learning_rat")[0], "learning_rate");
        assert!(nearest("bucket").contains(&"grad_bucket_mb"));
        assert!(nearest("zzzzzzzzzz").is_empty());
        assert_eq!(
            unknown_key_message("stepz"),
            "unknown key `stepz`; did you mean `steps`?"
        );
        assert_eq!(
            unknown_key_message("qqqqqqqqq"),
            "unknown key `qqqqqqqqq` (`ferrotext keys` lists every key)"
        );
    }

    #[test]
    fn the_table_shows_defaults_from_the_config() {
        let table = table();
        let line = |name: &str| {
            table
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{name} ")))
                .unwrap_or_default()
                .to_string()
        };
        assert!(line("steps").contains("default 300"), "{table}");
        assert!(line("vocab_size").contains("default -"), "{table}");
        assert!(line("opt_type").contains("default adamw"), "{table}");
        let sections: Vec<&str> = table.lines().filter(|l| !l.starts_with(' ')).collect();
        assert_eq!(
            sections,
            [
                "model:",
                "precision:",
                "mesh:",
                "data:",
                "optimizer:",
                "checkpoints:",
                "output:"
            ]
        );
    }
}
