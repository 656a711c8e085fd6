//! Hugging Face model directories in and out.
//!
//! A HF directory holds `config.json` (the model's `model_type` and dimensions) and its weights
//! as one `model.safetensors`, or as shards listed by `model.safetensors.index.json`.
//! [`read_config`] maps `config.json` to the decoder's [`Config`] through the file of its
//! family (`family/<model_type>.rs`: `qwen3`, `qwen3_moe`, `deepseek_v3`, `llama`, `qwen2`, as
//! transformers 4.x or 5 writes them; see [`ModelType::all`]; anything else is refused in one
//! error naming it, and so is every key whose value asks for math the decoder does not do:
//! [`key_use`] says what happens to each key), [`load_directory`] reads
//! every parameter by the HF tensors its [`ParamInfo::hf`] declares, and [`save_directory`] writes
//! the same layout back ([`save_directory_declaring`] also what the source directory declared
//! beyond the decoder: its special tokens, context, generation defaults and tokenizer,
//! [`Declared`]; a
//! checkpoint's export lives in `ferrotext-train`, which knows checkpoints). Every file is opened by `ferrotext_files`' rule (no FIFO,
//! device or directory is read).
//!
//! # Invariants
//! - Loading checks every header before converting anything: the set of tensor names (missing
//!   and unexpected ones are listed together), each dtype (F32, BF16 or F16, converted to f32)
//!   and each shape against `config.json`.
//! - Shards are memory-mapped; each stored tensor is converted in one pass straight into its
//!   parameter's f32 buffer (widened, and transposed in tiles for `[out, in]` matrices) and its
//!   file pages are released once converted, so a model loads holding its f32 values and about
//!   one tensor's file bytes per thread.
//! - `deepseek_v3` directories carry each router's `mlp.gate.e_score_correction_bias`: a
//!   parameter of the model (`routed_bias`, which `read_config` sets for `deepseek_v3`), read
//!   and written with its values; a model built without it writes zeros and refuses a nonzero
//!   one on load.
//! - DeepSeek-V3's multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is a
//!   part of the model exactly when `read_config` finds `num_nextn_predict_layers` 1 and the
//!   weights hold the layer (`mtp_num_layers` 1); a model without it refuses a directory with
//!   it, naming it, and export writes it back with `num_nextn_predict_layers`. Its
//!   `embed_tokens` and `shared_head.head` are copies of the main model's embedding and head,
//!   which the module shares (`tied.rs`): a copy is read as the sharing, a layer whose copies
//!   hold values of their own is refused, named, and export writes the copies from the main
//!   model's tensors.
//! - A tied config whose weights hold `lm_head.weight` anyway is read as transformers 5 reads
//!   it (`tied.rs`): a copy of the embedding, value for value, is the tie; a head of its own
//!   makes the model untied. A model tied by hand refuses such a head, named.
//! - Stored RoPE frequencies (`…rotary_emb.inv_freq`, older conversions) are skipped, as
//!   transformers skips them: the model computes its frequencies from `config.json`.
//! - Writing goes to a temporary directory beside the target, renamed into place when complete:
//!   a failed save leaves nothing that looks like a model.
//!
//! [`Config`]: ferrotext_models::decoder::Config
//! [`ParamInfo::hf`]: ferrotext_models::ParamInfo::hf

mod convert;
mod declared;
mod error;
mod family;
mod read;
mod shards;
mod tied;
mod write;

pub use declared::{Declared, DECLARED_FILES, DECLARED_KEYS, GENERATION_CONFIG_FILE};
pub use error::HfError;
pub use family::{
    class_defaults, config_from_json, hf_config_json, key_use, listed_keys, preset, presets,
    read_config, KeyUse, ModelType, PresetInfo,
};
pub use read::{load_directory, load_file};
pub use tied::head_untied_by_its_weights;
pub use write::{save_directory, save_directory_declaring, selection_bias, DEFAULT_SHARD_BYTES};

/// The config file of a HF directory.
pub const CONFIG_FILE: &str = "config.json";
/// The single weights file of an unsharded HF directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index of a sharded HF directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The suffix of a MoE layer's router weight, `model.layers.N.mlp.gate.weight` (`[experts, d]`).
const ROUTER: &str = "mlp.gate.weight";
/// The suffix of DeepSeek-V3's router selection bias, `model.layers.N.mlp.gate.e_score_correction_bias`
/// (`[experts]`): a parameter under `routed_bias`; otherwise written as zeros and accepted on load
/// only when zero.
const SELECTION_BIAS: &str = "mlp.gate.e_score_correction_bias";

/// The suffix of the RoPE frequencies older conversions store per layer
/// (`model.layers.N.self_attn.rotary_emb.inv_freq`): a buffer the model computes from
/// `config.json`, which transformers (4.x and 5) skips by name on load, as the loader does.
const ROPE_FREQUENCIES: &str = "rotary_emb.inv_freq";

/// At most `n` items of a list, then "and k more".
fn listed(items: &[String], n: usize) -> String {
    let shown: Vec<String> = items.iter().take(n).map(|s| format!("`{s}`")).collect();
    if items.len() > n {
        format!("{} and {} more", shown.join(", "), items.len() - n)
    } else {
        shown.join(", ")
    }
}
