//! `llama` (`LlamaForCausalLM`, Llama 2/3.x): a dense decoder of GQA without QK-norm, SwiGLU;
//! q/k/v/o biases with `attention_bias` and MLP biases with `mlp_bias`; RoPE `llama3`,
//! `linear`, `dynamic` and `yarn`.

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::common::{
    block_misfit, dense_misfit, gqa_json, merged, read_biases, refuse_windows, sizes,
};
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys};
use KeyUse::Read;

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "llama",
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
    presets: &[],
    kept_f32: &[],
};

const KEYS: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    ("attention_bias", Read { probe: "true" }),
    ("mlp_bias", Read { probe: "true" }),
    (
        "rope_scaling",
        Read {
            probe: "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, \
                \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}",
        },
    ),
    (
        "rope_parameters",
        Read {
            probe: "{\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, \
                \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \
                \"original_max_position_embeddings\": 8192}",
        },
    ),
];

const DEFAULTS: &[super::defaults::ClassDefault] =
    defaults!(("32000", "4096", "11008", "32", "32"));

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = sizes(k)?;
    k.only("hidden_act", json!("silu"));
    read_biases(k, &mut cfg)?;
    refuse_windows(k);
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "llama", false, cfg.attention_out_bias);
    block_misfit(cfg, "llama", &["out_bias", "mlp_bias"], &mut out);
    out
}

/// Its RoPE scaling and bias flags.
fn write(cfg: &Config) -> Value {
    merged(&[
        json!({
            "architectures": ["LlamaForCausalLM"],
            "mlp_bias": cfg.mlp_bias,
            "pretraining_tp": 1,
        }),
        gqa_json(cfg, 8192),
    ])
}
