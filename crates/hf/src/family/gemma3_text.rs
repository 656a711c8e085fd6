//! `gemma3_text` (`Gemma3ForCausalLM`, the text decoder of Gemma 3): Gemma 2's blocks (see
//! `gemma2.rs`) with a per-head QK-norm (scaling by `1 + w`), no soft-capping by default, one
//! full-attention layer every `sliding_window_pattern` (6) by default, and a RoPE per layer type:
//! the full layers' (θ `rope_theta`, scaled as `rope_scaling` says, e.g. `linear` 8 in the 4B+
//! models), the sliding layers' plain RoPE of θ `rope_local_base_freq` (transformers 5: one
//! `rope_parameters` object per layer type).
//!
//! Refused: a scaled RoPE on the sliding layers, and what `gemma2.rs` refuses.

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::common::{block_misfit, dense_misfit, merged};
use super::gemma2::{gemma, gemma_json, gemma_misfit, optional, GEMMA};
use super::reader::num;
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, Family, KeyUse, Keys, Preset};
use KeyUse::{Irrelevant, Read};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "gemma3_text",
    keys: &[KEYS, GEMMA, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: GQA_ROPE_TYPES,
    deepseek_yarn: false,
    rope_view,
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
    rename: super::no_rename,
    presets: PRESETS,
    kept_f32: &[],
};

/// Gemma 3 1B's shape (five sliding layers of window 512 to one full, a local θ of its own),
/// and the same blocks at CPU size.
const PRESETS: &[Preset] = &[
    Preset {
        name: "gemma3-1b",
        about: "gemma-3-1b-pt's config.json",
        config: r#"{"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": null,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}"#,
    },
    Preset {
        name: "gemma3-tiny",
        about:
            "CPU-sized (byte vocabulary): a sliding layer (window 8, θ 10⁴) then a full one (θ 10⁶)",
        config: r#"{"vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
        "sliding_window_pattern": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": true}"#,
    },
];

const KEYS: &[(&str, KeyUse)] = &[
    (
        "attn_logit_softcapping",
        Irrelevant(
            "Gemma3Attention stores it but never passes it to the attention (4.57 and 5.x): no \
             attention soft-cap",
        ),
    ),
    ("final_logit_softcapping", Read { probe: "20.0" }),
    ("rope_local_base_freq", Read { probe: "20000.0" }),
    (
        "_sliding_window_pattern",
        Irrelevant("written beside layer_types, which says the same; read when it is absent"),
    ),
    (
        "sliding_window_pattern",
        Irrelevant("read (as transformers does) only when layer_types is absent"),
    ),
    (
        "rope_scaling",
        Read {
            probe: "{\"rope_type\": \"linear\", \"factor\": 8.0}",
        },
    ),
    (
        "rope_parameters",
        Read {
            probe: "{\"full_attention\": {\"rope_type\": \"linear\", \"factor\": 8.0, \
                \"rope_theta\": 1000000.0}, \"sliding_attention\": {\"rope_type\": \"default\", \
                \"rope_theta\": 10000.0}}",
        },
    ),
];

const DEFAULTS: &[super::defaults::ClassDefault] = &[
    (&["vocab_size"], "262208"),
    (&["hidden_size"], "2304"),
    (&["intermediate_size"], "9216"),
    (&["num_hidden_layers"], "26"),
    (&["num_attention_heads"], "8"),
    (&["num_key_value_heads"], "4"),
    (&["head_dim"], "256"),
    (&["rms_norm_eps"], "1e-6"),
    (&["tie_word_embeddings"], "true"),
    (&["query_pre_attn_scalar"], "256"),
    (&["sliding_window"], "4096"),
    (&["pad_token_id"], "0"),
];

/// The config with `rope_parameters` narrowed to its full-attention layers' object (5.x), so
/// the shared RoPE reader reads the full layers' θ and scaling; 4.x configs are read as they
/// are (`rope_theta`, `rope_scaling` are the full layers'), θ defaulting to the class's 1e6.
fn rope_view(v: &Value) -> Option<Value> {
    let mut view = v.clone();
    match v
        .get("rope_parameters")
        .and_then(|p| p.get("full_attention"))
    {
        Some(full) => view["rope_parameters"] = full.clone(),
        // 4.x without θ: the class's global default, 1e6 (not the shared reader's 10000).
        None if v.get("rope_theta").is_none() => view["rope_theta"] = 1_000_000.0.into(),
        None => return None,
    }
    Some(view)
}

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let pattern = ["sliding_window_pattern", "_sliding_window_pattern"]
        .iter()
        .find_map(|key| k.get(key).and_then(Value::as_u64))
        .unwrap_or(6)
        .max(1) as usize;
    let mut cfg = gemma(k, |i| (i + 1) % pattern != 0)?;
    cfg.qk_norm = true;
    // transformers' Gemma3Attention keeps attn_logit_softcapping but never applies it.
    cfg.attn_logit_softcapping = None;
    cfg.final_logit_softcapping = optional(k, "final_logit_softcapping")?;
    let local = k
        .get("rope_parameters")
        .and_then(|p| p.get("sliding_attention"));
    let theta = match local {
        Some(l) => {
            let t = l
                .get("rope_type")
                .and_then(Value::as_str)
                .unwrap_or("default");
            if t != "default" {
                k.unsupported.push(format!(
                    "rope_parameters.sliding_attention.rope_type=\"{t}\" (the sliding layers' \
                     RoPE is plain)"
                ));
            }
            l.get("rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0) as f32
        }
        None => k.positive_or("rope_local_base_freq", 10_000.0)?,
    };
    if cfg.sliding_window.is_some() {
        cfg.sliding_rope_theta = Some(theta);
    }
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "gemma3_text", true, cfg.attention_out_bias);
    gemma_misfit(cfg, "gemma3_text", &mut out);
    let has = ["out_bias", "window", "gemma", "softcap"];
    block_misfit(cfg, "gemma3_text", &has, &mut out);
    if cfg.attn_logit_softcapping.is_some() {
        out.push("an attention soft-cap (gemma3_text's attention ignores it)".into());
    }
    out
}

fn write(cfg: &Config) -> Value {
    merged(&[
        json!({
            "architectures": ["Gemma3ForCausalLM"],
            "rope_local_base_freq": num(cfg.sliding_rope_theta.unwrap_or(cfg.rope_max_timescale)),
        }),
        gemma_json(cfg),
    ])
}
