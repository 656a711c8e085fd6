//! `mistral` (`MistralForCausalLM`): Llama's blocks (GQA without QK-norm or biases, SwiGLU) with
//! a sliding window on every layer (`sliding_window`, `null` for none, as Mistral v0.3); RoPE
//! `linear`, `dynamic`, `yarn`, `llama3`.
//!
//! Its class has no bias keys; `layer_types` is not read (transformers warns and slides every
//! layer).

use ferrotext_models::decoder::{Config, SlidingWindow};
use serde_json::{json, Value};

use super::common::{block_misfit, dense_misfit, gqa_json, merged, sizes};
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys, Preset};
use KeyUse::{Irrelevant, Read};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "mistral",
    keys: &[KEYS, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: GQA_ROPE_TYPES,
    deepseek_yarn: false,
    rope_view: same_rope_view,
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
    rename: super::no_rename,
    presets: PRESETS,
    kept_f32: &[],
};

/// Mistral 7B v0.1's shape (its sliding window of 4096 on every layer), and the same blocks at
/// CPU size with a window of 8 (a window shorter than the test sequences, so it matters there).
const PRESETS: &[Preset] = &[
    Preset {
        name: "mistral-7b",
        about: "Mistral-7B-v0.1's config.json",
        config: r#"{"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": false}"#,
    },
    Preset {
        name: "mistral-tiny",
        about: "CPU-sized (byte vocabulary), a window of 8 on every layer",
        config: r#"{"vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": 8,
        "tie_word_embeddings": false}"#,
    },
];

/// `MistralConfig`'s own keys (the Mixtral class shares them).
pub(super) const KEYS: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "8" }),
    ("tie_word_embeddings", Read { probe: "true" }),
    ("sliding_window", Read { probe: "5" }),
    (
        "layer_types",
        Irrelevant("MistralModel slides every layer by sliding_window, whatever layer_types says"),
    ),
    (
        "attention_bias",
        Irrelevant("not a key of Mistral's class: its projections have no bias"),
    ),
    (
        "rope_scaling",
        Read {
            probe: "{\"rope_type\": \"linear\", \"factor\": 2.0}",
        },
    ),
    (
        "rope_parameters",
        Read {
            probe: "{\"rope_type\": \"default\", \"rope_theta\": 12345.0}",
        },
    ),
];

const DEFAULTS: &[super::defaults::ClassDefault] = &[
    (&["vocab_size"], "32000"),
    (&["hidden_size"], "4096"),
    (&["intermediate_size"], "14336"),
    (&["num_hidden_layers"], "32"),
    (&["num_attention_heads"], "32"),
    (&["num_key_value_heads"], "8"),
    (&["rms_norm_eps"], "1e-6"),
    (&["tie_word_embeddings"], "false"),
    (&["sliding_window"], "4096"),
];

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = sizes(k)?;
    k.only("hidden_act", json!("silu"));
    cfg.sliding_window = match k.get("sliding_window") {
        None => None,
        Some(_) => Some(SlidingWindow {
            size: k.usize("sliding_window")?,
            layers: Vec::new(),
        }),
    };
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "mistral", false, false);
    block_misfit(cfg, "mistral", &["window"], &mut out);
    if cfg
        .sliding_window
        .as_ref()
        .is_some_and(|w| !w.layers.is_empty())
    {
        out.push("sliding windows on some layers only (mistral slides every layer)".into());
    }
    out
}

fn write(cfg: &Config) -> Value {
    let mut v = merged(&[
        json!({
            "architectures": ["MistralForCausalLM"],
            "sliding_window": cfg.sliding_window.as_ref().map(|w| w.size),
        }),
        gqa_json(cfg, 32768),
    ]);
    if let Some(o) = v.as_object_mut() {
        o.remove("attention_bias");
    }
    v
}
