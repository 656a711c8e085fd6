//! `qwen3` (`Qwen3ForCausalLM`): a dense decoder of GQA with QK-norm (a per-head RMSNorm of the
//! queries and keys before RoPE), SwiGLU, θ 1e6 in the published models.
//!
//! Refused: sliding windows, biases, RoPE scaling.

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::common::{common_config, dense_misfit, no_llama3};
use super::table::{DECODER, GENERIC, QWEN_WINDOW};
use super::{no_extra_tensor, Family, KeyUse, Keys};
use KeyUse::{Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "qwen3",
    keys: &[KEYS, QWEN_WINDOW, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: &[],
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
};

/// `Qwen3Config`'s own keys.
pub(super) const KEYS: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    (
        "rope_scaling",
        Refused {
            bad: "{\"rope_type\": \"linear\", \"factor\": 2.0}",
            reason: "qwen3 reads default RoPE only",
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
    Ok(Config {
        qk_norm: true,
        ..common_config(k)?
    })
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "qwen3", true, false);
    no_llama3(cfg, "qwen3", &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": false,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": 40960,
        "rope_scaling": null,
        "use_sliding_window": false,
    })
}
