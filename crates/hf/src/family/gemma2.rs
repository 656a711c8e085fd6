//! `gemma2` (`Gemma2ForCausalLM`): GQA without QK-norm, norms before and after each sub-layer
//! (`input_layernorm`/`post_attention_layernorm` around attention,
//! `pre_feedforward_layernorm`/`post_feedforward_layernorm` around the MLP), every RMSNorm
//! scaling by `1 + w`, the embedding times `√hidden_size`, GeGLU (`gelu_pytorch_tanh`), the
//! attention scaled by `query_pre_attn_scalar^−½`, attention-logit and final-logit soft-capping,
//! sliding windows on the layers `layer_types` marks (by default every other one, from the first);
//! q/k/v/o biases with `attention_bias`; RoPE `linear`, `dynamic`, `yarn`, `llama3`. `gemma3_text`
//! builds on the reader here.
//!
//! Refused: another activation than `gelu_pytorch_tanh`, bidirectional attention.

use ferrotext_models::decoder::{Config, MlpActivation, NormPlacement, SlidingWindow};
use serde_json::{json, Value};

use super::common::{
    block_misfit, dense_misfit, gqa_json, layer_types, layer_types_json, merged, read_biases, sizes,
};
use super::reader::num;
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys, Preset};
use KeyUse::{Irrelevant, Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "gemma2",
    keys: &[KEYS, GEMMA, DECODER, GENERIC],
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

/// Gemma 2 2B's shape (soft-caps 50 and 30, a window of 4096 on every other layer), and the
/// same blocks at CPU size with a window of 8 and soft-caps of 5 and 3 (small, so that each
/// changes the numbers of a random model at that size).
const PRESETS: &[Preset] = &[
    Preset {
        name: "gemma2-2b",
        about: "gemma-2-2b's config.json",
        config: r#"{"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}"#,
    },
    Preset {
        name: "gemma2-tiny",
        about: "CPU-sized (byte vocabulary): window 8 on the first layer, soft-caps 5 and 3",
        config: r#"{"vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": true}"#,
    },
];

const KEYS: &[(&str, KeyUse)] = &[
    ("attn_logit_softcapping", Read { probe: "20.0" }),
    ("final_logit_softcapping", Read { probe: "20.0" }),
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

/// The keys Gemma 2 and 3's classes share.
pub(super) const GEMMA: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "8" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    ("attention_bias", Read { probe: "true" }),
    ("query_pre_attn_scalar", Read { probe: "64" }),
    ("sliding_window", Read { probe: "3" }),
    (
        "layer_types",
        Read {
            probe: "[\"full_attention\", \"sliding_attention\"]",
        },
    ),
    (
        "hidden_activation",
        Refused {
            bad: "\"gelu\"",
            reason: "the MLP's gate is the tanh GELU (gelu_pytorch_tanh) only",
        },
    ),
    (
        "hidden_act",
        Irrelevant("not read by Gemma's classes: hidden_activation is"),
    ),
    (
        "use_bidirectional_attention",
        Refused {
            bad: "true",
            reason: "attention is causal",
        },
    ),
];

const DEFAULTS: &[super::defaults::ClassDefault] = &[
    (&["vocab_size"], "256000"),
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
    (&["attn_logit_softcapping"], "50.0"),
    (&["final_logit_softcapping"], "30.0"),
    (&["pad_token_id"], "0"),
];

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = gemma(k, |i| (i + 1) % 2 != 0)?;
    cfg.attn_logit_softcapping = optional(k, "attn_logit_softcapping")?;
    cfg.final_logit_softcapping = optional(k, "final_logit_softcapping")?;
    Ok(cfg)
}

/// A positive number under `key`, `None` when absent or `null`.
pub(super) fn optional(k: &Keys<'_>, key: &str) -> Result<Option<f32>, String> {
    match k.get(key) {
        None => Ok(None),
        Some(_) => k.positive_or(key, 1.0).map(Some),
    }
}

/// What Gemma 2 and 3 read alike: the sandwich of `1 + w` norms, the scaled embedding, GeGLU,
/// the attention scalar, biases, and the sliding layers (`layer_types`, else `sliding(i)`).
pub(super) fn gemma(k: &mut Keys<'_>, sliding: impl Fn(usize) -> bool) -> Result<Config, String> {
    let mut cfg = sizes(k)?;
    k.only("hidden_activation", json!("gelu_pytorch_tanh"));
    k.only("use_bidirectional_attention", json!(false));
    read_biases(k, &mut cfg)?;
    cfg.mlp_bias = false;
    cfg.norm_placement = NormPlacement::PrePost;
    cfg.norm_plus_one = true;
    cfg.scale_embedding = true;
    cfg.mlp_activation = MlpActivation::GeluTanh;
    cfg.query_pre_attn_scalar = Some(k.positive_or("query_pre_attn_scalar", 256.0)?);
    let layers = layer_types(k, cfg.base_num_decoder_layers, sliding);
    cfg.sliding_window = match k.get("sliding_window") {
        Some(_) if layers.contains(&true) => Some(SlidingWindow {
            size: k.usize("sliding_window")?,
            layers,
        }),
        _ => None,
    };
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "gemma2", false, cfg.attention_out_bias);
    gemma_misfit(cfg, "gemma2", &mut out);
    block_misfit(
        cfg,
        "gemma2",
        &["out_bias", "window", "gemma", "softcap"],
        &mut out,
    );
    if cfg.sliding_rope_theta.is_some() {
        out.push("a RoPE θ of its own on sliding layers (gemma2 has none)".into());
    }
    out
}

/// The blocks every Gemma has: each one named when `cfg` lacks it.
pub(super) fn gemma_misfit(cfg: &Config, name: &str, out: &mut Vec<String>) {
    let all = cfg.norm_placement == NormPlacement::PrePost
        && cfg.norm_plus_one
        && cfg.scale_embedding
        && cfg.mlp_activation == MlpActivation::GeluTanh
        && cfg.query_pre_attn_scalar.is_some();
    if !all {
        out.push(format!(
            "not every Gemma block (sandwich 1 + w norms, √d embedding, GeGLU, \
             query_pre_attn_scalar; {name} has all)"
        ));
    }
}

/// The keys Gemma 2 and 3 write alike.
pub(super) fn gemma_json(cfg: &Config) -> Value {
    let window = cfg.sliding_window.as_ref();
    merged(&[
        gqa_json(cfg, 8192),
        json!({
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            // An int in transformers' class (5.x validates the type).
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar.map(|q| match q.fract() {
                0.0 => json!(q as u64),
                _ => num(q),
            }),
            "sliding_window": window.map(|w| w.size),
            "layer_types": layer_types_json(cfg),
            "attn_logit_softcapping": cfg.attn_logit_softcapping.map(num),
            "final_logit_softcapping": cfg.final_logit_softcapping.map(num),
        }),
    ])
}

fn write(cfg: &Config) -> Value {
    merged(&[
        json!({"architectures": ["Gemma2ForCausalLM"]}),
        gemma_json(cfg),
    ])
}
