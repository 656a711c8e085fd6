//! `olmo2` (`Olmo2ForCausalLM`): GQA with a QK-norm over all heads at once (`q_norm` is
//! `[heads·head_dim]`, applied before the heads are split), post-norms only (`x + norm(f(x))`,
//! `post_attention_layernorm` and `post_feedforward_layernorm`), SwiGLU; q/k/v/o biases with
//! `attention_bias`; RoPE `linear`, `dynamic`, `yarn`, `llama3`.

use ferrotext_models::decoder::{Config, NormPlacement};
use serde_json::{json, Value};

use super::common::{block_misfit, dense_misfit, gqa_json, merged, read_biases, sizes};
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys, Preset};
use KeyUse::Read;

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "olmo2",
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

/// OLMo 2 1B's shape (OLMo-2-0425-1B), and the same blocks at CPU size.
const PRESETS: &[Preset] = &[
    Preset {
        name: "olmo2-1b",
        about: "OLMo-2-0425-1B's config.json",
        config: r#"{"vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "attention_bias": false, "tie_word_embeddings": false}"#,
    },
    Preset {
        name: "olmo2-tiny",
        about: "CPU-sized (byte vocabulary)",
        config: r#"{"vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "tie_word_embeddings": false}"#,
    },
];

const KEYS: &[(&str, KeyUse)] = &[
    ("tie_word_embeddings", Read { probe: "true" }),
    ("attention_bias", Read { probe: "true" }),
    // Not a key of OLMo 2's class, but Olmo2Attention reads it with getattr (4.57 and 5.x).
    ("head_dim", Read { probe: "16" }),
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
    (&["vocab_size"], "50304"),
    (&["hidden_size"], "4096"),
    (&["intermediate_size"], "11008"),
    (&["num_hidden_layers"], "32"),
    (&["num_attention_heads"], "32"),
    (&["rms_norm_eps"], "1e-5"),
    (&["tie_word_embeddings"], "false"),
    (&["attention_bias"], "false"),
    (&["pad_token_id"], "1"),
];

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = sizes(k)?;
    k.only("hidden_act", json!("silu"));
    read_biases(k, &mut cfg)?;
    cfg.mlp_bias = false;
    cfg.qk_norm = true;
    cfg.qk_norm_all_heads = true;
    cfg.norm_placement = NormPlacement::Post;
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = dense_misfit(cfg, "olmo2", true, cfg.attention_out_bias);
    if !cfg.qk_norm_all_heads || cfg.norm_placement != NormPlacement::Post {
        out.push("norms other than OLMo 2's post-norms and QK-norm over all heads".into());
    }
    block_misfit(cfg, "olmo2", &["out_bias", "post_norm"], &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    let mut v = merged(&[
        json!({"architectures": ["Olmo2ForCausalLM"]}),
        gqa_json(cfg, 4096),
    ]);
    // Written only where it is not the quotient transformers derives.
    if cfg.head_dim * cfg.base_num_query_heads == cfg.base_emb_dim {
        if let Some(o) = v.as_object_mut() {
            o.remove("head_dim");
        }
    }
    v
}
