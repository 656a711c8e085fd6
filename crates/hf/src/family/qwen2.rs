//! `qwen2` (`Qwen2ForCausalLM`, Qwen2 and Qwen2.5): a dense decoder of GQA without QK-norm,
//! with biases on the q, k and v projections (not a key: `Qwen2Attention` always has them).
//!
//! Refused: sliding windows, RoPE scaling (Qwen2.5's long-context YaRN).

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::common::{common_config, dense_misfit, no_llama3};
use super::table::{DECODER, GENERIC, QWEN_WINDOW};
use super::{no_extra_tensor, Family, KeyUse, Keys};
use KeyUse::{Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "qwen2",
    keys: &[KEYS, QWEN_WINDOW, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: &[],
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
};

const KEYS: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    (
        "rope_scaling",
        Refused {
            bad:
                "{\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}",
            reason: "qwen2 reads default RoPE only (Qwen2.5's long-context YaRN is not built)",
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
    Ok(Config {
        qkv_bias: true,
        ..common_config(k)?
    })
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "qwen2", false, true);
    no_llama3(cfg, "qwen2", &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"],
        "head_dim": cfg.head_dim,
        "max_position_embeddings": 32768,
        "rope_scaling": null,
        "use_sliding_window": false,
    })
}
