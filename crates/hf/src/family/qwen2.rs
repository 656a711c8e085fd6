//! `qwen2` (`Qwen2ForCausalLM`, Qwen2 and Qwen2.5): a dense decoder of GQA without QK-norm,
//! with biases on the q, k and v projections (not a key: `Qwen2Attention` always has them).
//! Sliding windows with `use_sliding_window` (as `qwen3`); RoPE `linear`, `dynamic`, `yarn`
//! (Qwen2.5's long-context recipe) and `llama3`.

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::common::{
    block_misfit, dense_misfit, gqa_json, merged, qwen_window_json, qwen_windows, refuse_biases,
    sizes,
};
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC, QWEN_WINDOW};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys};
use KeyUse::Read;

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "qwen2",
    keys: &[KEYS, QWEN_WINDOW, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: GQA_ROPE_TYPES,
    deepseek_yarn: false,
    rope_view: same_rope_view,
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
    rename: super::no_rename,
    presets: &[],
    kept_f32: &[],
};

const KEYS: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    (
        "rope_scaling",
        Read {
            probe: "{\"type\": \"yarn\", \"factor\": 4.0, \
                \"original_max_position_embeddings\": 32768}",
        },
    ),
    (
        "rope_parameters",
        Read {
            probe: "{\"rope_type\": \"default\", \"rope_theta\": 12345.0}",
        },
    ),
];

const DEFAULTS: &[super::defaults::ClassDefault] = defaults!(
    ("151936", "4096", "22016", "32", "32"),
    ["num_key_value_heads"] => "32",
);

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = sizes(k)?;
    k.only("hidden_act", json!("silu"));
    cfg.qkv_bias = true;
    refuse_biases(k);
    qwen_windows(k, &mut cfg)?;
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "qwen2", false, true);
    block_misfit(cfg, "qwen2", &["window"], &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    let mut v = merged(&[
        json!({"architectures": ["Qwen2ForCausalLM"]}),
        gqa_json(cfg, 32768),
        qwen_window_json(cfg),
    ]);
    // Qwen2's q/k/v biases are not a key: `Qwen2Attention` always has them.
    if let Some(o) = v.as_object_mut() {
        o.remove("attention_bias");
    }
    v
}
