//! `qwen3` (`Qwen3ForCausalLM`): a dense decoder of GQA with QK-norm (a per-head RMSNorm of the
//! queries and keys before RoPE), SwiGLU, θ 1e6 in the published models; q/k/v/o biases with
//! `attention_bias`; sliding windows with `use_sliding_window` (on `layer_types`' layers, by
//! default those from `max_window_layers` on); RoPE `linear`, `dynamic`, `yarn` (Qwen3's own
//! recipe past 32k) and `llama3`.

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::common::{
    block_misfit, dense_misfit, gqa_json, merged, qwen_window_json, qwen_windows, read_biases,
    sizes,
};
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC, QWEN_WINDOW};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys};
use KeyUse::Read;

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "qwen3",
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

/// `Qwen3Config`'s own keys.
pub(super) const KEYS: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    ("attention_bias", Read { probe: "true" }),
    (
        "rope_scaling",
        Read {
            probe: "{\"rope_type\": \"yarn\", \"factor\": 4.0, \
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
    ["head_dim"] => "128",
);

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = sizes(k)?;
    k.only("hidden_act", json!("silu"));
    cfg.qk_norm = true;
    read_biases(k, &mut cfg)?;
    k.only("mlp_bias", json!(false));
    qwen_windows(k, &mut cfg)?;
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    // biases come as q, k, v and o together (`attention_bias`)
    let mut out = dense_misfit(cfg, "qwen3", true, cfg.attention_out_bias);
    block_misfit(cfg, "qwen3", &["out_bias", "window"], &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    merged(&[
        json!({"architectures": ["Qwen3ForCausalLM"]}),
        gqa_json(cfg, 40960),
        qwen_window_json(cfg),
    ])
}
