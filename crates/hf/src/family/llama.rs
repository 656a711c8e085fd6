//! `llama` (`LlamaForCausalLM`, Llama 3.x): a dense decoder of GQA without QK-norm or biases,
//! SwiGLU, Llama 3's RoPE frequency scaling (`rope_type: llama3`).
//!
//! Refused: biases (`attention_bias`, `mlp_bias`), RoPE types other than `default` and `llama3`.

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::common::{common_config, dense_misfit};
use super::reader::num;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, Family, KeyUse, Keys};
use KeyUse::{Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "llama",
    keys: &[KEYS, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: &["llama3"],
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
};

const KEYS: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    (
        "mlp_bias",
        Refused {
            bad: "true",
            reason: "MLP biases are not built (Llama 3 has none)",
        },
    ),
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
    common_config(k)
}

fn misfit(cfg: &Config) -> Vec<String> {
    dense_misfit(cfg, "llama", false, false)
}

/// Its Llama 3 rope scaling and bias flags.
fn write(cfg: &Config) -> Value {
    let (rope_scaling, max_pos) = match &cfg.rope_llama3 {
        None => (Value::Null, 8192),
        Some(l) => (
            json!({
                "rope_type": "llama3",
                "factor": num(l.factor),
                "low_freq_factor": num(l.low_freq_factor),
                "high_freq_factor": num(l.high_freq_factor),
                "original_max_position_embeddings": l.original_max_position,
            }),
            (l.original_max_position as f64 * f64::from(l.factor)) as usize,
        ),
    };
    json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": max_pos,
        "rope_scaling": rope_scaling,
        "mlp_bias": false,
        "pretraining_tp": 1,
    })
}
