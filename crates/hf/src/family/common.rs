//! What every family's reader and writer share: the sizes and the norm every decoder config
//! has, the refusals of what no family reads (yet), the checks of the features a family has
//! not, and the `config.json` keys every family writes.

use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

use super::reader::{num, Keys};

/// The keys every family shares: sizes, tied embeddings, the norm's ε (a dense decoder without
/// MoE, MLA or RoPE scaling; θ is read with the other RoPE keys); activations, biases and
/// sliding windows only as the decoder has them (refused otherwise, named with the value).
pub(super) fn common_config(k: &mut Keys<'_>) -> Result<Config, String> {
    let heads = k.usize("num_attention_heads")?;
    let hidden = k.usize("hidden_size")?;
    k.only("hidden_act", json!("silu"));
    if let Some(b) = k.get("attention_bias").filter(|b| **b != json!(false)) {
        k.unsupported.push(format!(
            "attention_bias={b} (biases on q, k, v and o: the output projection's bias is not \
             built)"
        ));
    }
    k.only("mlp_bias", json!(false));
    k.only("use_sliding_window", json!(false));
    k.only_number("partial_rotary_factor", 1.0);
    k.only_number("attention_dropout", 0.0);
    k.only("output_router_logits", json!(false));
    if let Some(types) = k.get("layer_types") {
        let all_full = types
            .as_array()
            .is_some_and(|a| a.iter().all(|t| t == "full_attention"));
        if !all_full {
            k.unsupported
                .push(format!("layer_types={types} (only full_attention layers)"));
        }
    }
    Ok(Config {
        vocab_size: k.usize("vocab_size")?,
        base_emb_dim: hidden,
        base_num_decoder_layers: k.usize("num_hidden_layers")?,
        base_num_query_heads: heads,
        base_num_kv_heads: k.usize_or("num_key_value_heads", heads)?,
        head_dim: k.usize_or("head_dim", hidden / heads.max(1))?,
        base_mlp_dim: k.usize("intermediate_size")?,
        logits_via_embedding: k.bool_or("tie_word_embeddings", false)?,
        normalization_layer_epsilon: k.positive_or("rms_norm_eps", 1e-6)?,
        ..Config::default()
    })
}

/// The `config.json` keys every family writes for `cfg` (`model_type` `name`, `torch_dtype`
/// `dtype`).
pub(super) fn base_json(cfg: &Config, name: &str, dtype: &str) -> Value {
    json!({
        "model_type": name,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.base_emb_dim,
        "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers,
        "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": num(cfg.normalization_layer_epsilon),
        "rope_theta": num(cfg.rope_max_timescale),
        "tie_word_embeddings": cfg.logits_via_embedding,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": dtype,
    })
}

/// The features of `cfg` that a dense GQA family (`name`, with QK-norm as `qk_norm` says and
/// q/k/v biases as `qkv_bias` says) does not express.
pub(super) fn dense_misfit(cfg: &Config, name: &str, qk_norm: bool, qkv_bias: bool) -> Vec<String> {
    let mut out = Vec::new();
    if cfg.mla.is_some() {
        out.push(format!("MLA attention ({name} has GQA)"));
    }
    if cfg.moe.is_some() {
        out.push(format!("MoE layers ({name} is dense)"));
    }
    gqa_misfit(cfg, name, qk_norm, qkv_bias, &mut out);
    out
}

/// GQA attention as `name` has it: QK-norm exactly when `qk_norm`, q/k/v biases exactly when
/// `qkv_bias`, no YaRN, no MTP module.
pub(super) fn gqa_misfit(
    cfg: &Config,
    name: &str,
    qk_norm: bool,
    qkv_bias: bool,
    out: &mut Vec<String>,
) {
    if cfg.mla.is_none() && cfg.qk_norm != qk_norm {
        out.push(format!("qk_norm={} ({name} has {qk_norm})", cfg.qk_norm));
    }
    if cfg.mla.is_none() && cfg.qkv_bias != qkv_bias {
        out.push(format!("qkv_bias={} ({name} has {qkv_bias})", cfg.qkv_bias));
    }
    if cfg.rope_yarn.is_some() {
        out.push("YaRN RoPE without MLA".into());
    }
    no_mtp(cfg, name, out);
}

/// No multi-token-prediction module: transformers has one only in `deepseek_v3`.
pub(super) fn no_mtp(cfg: &Config, name: &str, out: &mut Vec<String>) {
    if cfg.mtp_num_layers > 0 {
        out.push(format!(
            "mtp_num_layers={} in {name} (transformers has a multi-token-prediction layer only \
             in deepseek_v3)",
            cfg.mtp_num_layers
        ));
    }
}

/// No Llama 3 RoPE scaling (every family but `llama`).
pub(super) fn no_llama3(cfg: &Config, name: &str, out: &mut Vec<String>) {
    if cfg.rope_llama3.is_some() {
        out.push(format!("Llama 3 RoPE scaling in {name}"));
    }
}
