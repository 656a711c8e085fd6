//! What every family's reader and writer share: the sizes and the norm every decoder config
//! has, the refusals of what no family reads (yet), the checks of the features a family has
//! not, and the `config.json` keys every family writes.

use ferrotext_models::decoder::{Config, MlpActivation, NormPlacement, SlidingWindow};
use serde_json::{json, Value};

use ferrotext_tensor::PositionScaling;

use super::reader::{num, Keys};

/// The keys every family shares: sizes, tied embeddings, the norm's ε (a dense decoder without
/// MoE, MLA or RoPE scaling; θ is read with the other RoPE keys); activations, biases and
/// sliding windows only as the decoder has them (refused otherwise, named with the value).
pub(super) fn common_config(k: &mut Keys<'_>) -> Result<Config, String> {
    k.only("hidden_act", json!("silu"));
    refuse_biases(k);
    refuse_windows(k);
    sizes(k)
}

/// The sizes and the norm's ε, and the refusals of what no family builds: partial RoPE,
/// dropout, transformers' router loss.
pub(super) fn sizes(k: &mut Keys<'_>) -> Result<Config, String> {
    let heads = k.usize("num_attention_heads")?;
    let hidden = k.usize("hidden_size")?;
    k.only_number("partial_rotary_factor", 1.0);
    k.only_number("attention_dropout", 0.0);
    k.only("output_router_logits", json!(false));
    let vocab = k.usize("vocab_size")?;
    Ok(Config {
        vocab_size: vocab,
        pad_token_id: padding_row(k.get("pad_token_id"), vocab),
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

/// The embedding row transformers builds as `nn.Embedding`'s `padding_idx` from `pad_token_id`:
/// an integer in `-vocab..vocab` (a negative one counts from the end, as torch counts it);
/// `None` for none (`null`, absent, or a value transformers could not build a model with).
fn padding_row(pad: Option<&Value>, vocab: usize) -> Option<u32> {
    let pad = pad?.as_i64()?;
    let vocab = i64::try_from(vocab).ok()?;
    let row = if pad < 0 { vocab + pad } else { pad };
    (0..vocab)
        .contains(&row)
        .then(|| u32::try_from(row).ok())
        .flatten()
}

/// `attention_bias` and `mlp_bias` refused unless false (a family that builds neither).
pub(super) fn refuse_biases(k: &mut Keys<'_>) {
    if let Some(b) = k.get("attention_bias").filter(|b| **b != json!(false)) {
        k.unsupported.push(format!(
            "attention_bias={b} (biases on q, k, v and o: the output projection's bias is not \
             built)"
        ));
    }
    k.only("mlp_bias", json!(false));
}

/// `attention_bias` (q, k, v and o) and `mlp_bias` (gate, up, down) read into `cfg`.
pub(super) fn read_biases(k: &mut Keys<'_>, cfg: &mut Config) -> Result<(), String> {
    let attention = k.bool_or("attention_bias", false)?;
    cfg.qkv_bias |= attention;
    cfg.attention_out_bias = attention;
    cfg.mlp_bias = k.bool_or("mlp_bias", false)?;
    Ok(())
}

/// Sliding windows refused (`use_sliding_window`, `layer_types` other than all full).
pub(super) fn refuse_windows(k: &mut Keys<'_>) {
    k.only("use_sliding_window", json!(false));
    if let Some(types) = k.get("layer_types") {
        let all_full = types
            .as_array()
            .is_some_and(|a| a.iter().all(|t| t == "full_attention"));
        if !all_full {
            k.unsupported
                .push(format!("layer_types={types} (only full_attention layers)"));
        }
    }
}

/// `layer_types` as the sliding layers (`true` for `sliding_attention`), or `default(i)` for
/// each layer when the config has none; another type, or a list of another length, refused.
pub(super) fn layer_types(
    k: &mut Keys<'_>,
    layers: usize,
    default: impl Fn(usize) -> bool,
) -> Vec<bool> {
    let Some(types) = k.get("layer_types") else {
        return (0..layers).map(default).collect();
    };
    let read: Option<Vec<bool>> = types.as_array().and_then(|a| {
        a.iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Some(true),
                Some("full_attention") => Some(false),
                _ => None,
            })
            .collect()
    });
    match read.filter(|l| l.len() == layers) {
        Some(l) => l,
        None => {
            k.unsupported.push(format!(
                "layer_types={types} (one sliding_attention or full_attention per layer)"
            ));
            Vec::new()
        }
    }
}

/// The Qwen families' windows (`qwen2`, `qwen3`, as transformers reads them): with
/// `use_sliding_window`, `sliding_window` on the layers `layer_types` marks (by default the
/// layers from `max_window_layers` on); without it, none.
pub(super) fn qwen_windows(k: &mut Keys<'_>, cfg: &mut Config) -> Result<(), String> {
    if !k.bool_or("use_sliding_window", false)? {
        refuse_windows(k);
        return Ok(());
    }
    // An explicit `null` window is none; an absent one is the class's 4096.
    let size = match k.v.get("sliding_window") {
        Some(Value::Null) => return Ok(()),
        None => 4096,
        Some(_) => k.usize("sliding_window")?,
    };
    let from = k.usize_or("max_window_layers", 28)?;
    let layers = layer_types(k, cfg.base_num_decoder_layers, |i| i >= from);
    if layers.contains(&true) {
        cfg.sliding_window = Some(SlidingWindow { size, layers });
    }
    Ok(())
}

/// The `config.json` keys every family writes for `cfg` (`model_type` `name`, `torch_dtype`
/// `dtype`).
pub(super) fn base_json(cfg: &Config, name: &str, dtype: &str) -> Value {
    let mut v = json!({
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
    });
    // The pad token's row; none is written `null` only where the class's default is a row
    // (Gemma's 0, OLMo 2's 1), which an absent key would mean.
    let class_has_pad = super::ModelType::from_name(name).is_some_and(|k| {
        k.family()
            .defaults
            .iter()
            .any(|(names, _)| names.contains(&"pad_token_id"))
    });
    match cfg.pad_token_id {
        Some(pad) => v["pad_token_id"] = json!(pad),
        None if class_has_pad => v["pad_token_id"] = Value::Null,
        None => {}
    }
    v
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
/// `qkv_bias` (an output bias only with them), no MTP module.
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
    if cfg.attention_out_bias && !cfg.qkv_bias {
        out.push("an output bias without q/k/v biases (no family has it)".into());
    }
    no_mtp(cfg, name, out);
}

/// The blocks only some families have, each named unless `has` lists it: `"out_bias"`,
/// `"mlp_bias"`, `"window"`, `"gemma"` (the `1 + w` norms, √d embedding, GeGLU, the attention
/// scalar, the sandwich norms, the sliding layers' own θ), `"softcap"`, `"post_norm"` (OLMo 2's
/// norms and QK-norm over all heads), `"moe_step"`, `"shared_gate"`.
pub(super) fn block_misfit(cfg: &Config, name: &str, has: &[&str], out: &mut Vec<String>) {
    let mut not = |block: &str, present: bool, what: &str| {
        if present && !has.contains(&block) {
            out.push(format!("{what} ({name} has none)"));
        }
    };
    not(
        "out_bias",
        cfg.attention_out_bias,
        "an output projection bias",
    );
    not("mlp_bias", cfg.mlp_bias, "MLP biases");
    not("window", cfg.sliding_window.is_some(), "sliding windows");
    let gemma_norms = cfg.norm_placement == NormPlacement::PrePost;
    not("gemma", gemma_norms, "pre and post sub-layer norms");
    not("gemma", cfg.norm_plus_one, "(1 + w) norms");
    not("gemma", cfg.scale_embedding, "a scaled embedding");
    not(
        "gemma",
        cfg.mlp_activation == MlpActivation::GeluTanh,
        "GeGLU",
    );
    not(
        "gemma",
        cfg.query_pre_attn_scalar.is_some(),
        "query_pre_attn_scalar",
    );
    not(
        "gemma",
        cfg.sliding_rope_theta.is_some(),
        "a RoPE θ of its own on sliding layers",
    );
    let capped = cfg.attn_logit_softcapping.is_some() || cfg.final_logit_softcapping.is_some();
    not("softcap", capped, "soft-capping");
    not(
        "post_norm",
        cfg.norm_placement == NormPlacement::Post,
        "post-norms only",
    );
    not(
        "post_norm",
        cfg.qk_norm_all_heads,
        "a QK-norm over all heads",
    );
    let moe = cfg.moe.as_ref();
    let step = moe.is_some_and(|m| m.interleave_moe_layer_step != 1);
    not("moe_step", step, "MoE layers every other layer");
    let gated = moe.is_some_and(|m| m.shared_expert_gate || m.shared_mlp_dim.is_some());
    not(
        "shared_gate",
        gated,
        "a gated shared expert of its own width",
    );
}

/// The ε of MLA's latent norms (`q_a_layernorm`, `kv_a_layernorm`) in transformers' DeepSeek-V2
/// and V3: RMSNorm's default, never `rms_norm_eps` (both generations build them without it).
pub(super) const MLA_LATENT_NORM_EPS: f32 = 1e-6;

/// MLA latent norms with another ε than transformers' fixed [`MLA_LATENT_NORM_EPS`].
pub(super) fn latent_eps_misfit(cfg: &Config, name: &str, out: &mut Vec<String>) {
    if let Some(a) = cfg.mla.filter(|a| a.latent_norm_eps != MLA_LATENT_NORM_EPS) {
        out.push(format!(
            "latent_norm_eps={} ({name} fixes the latent norms' epsilon at 1e-6)",
            a.latent_norm_eps
        ));
    }
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

/// The RoPE scaling of `cfg` as 4.x's `rope_scaling` object (`null` for plain RoPE) and the
/// `max_position_embeddings` it implies, if any (`dynamic` reads it; Llama 3 and YaRN extend
/// the original context by their factor).
pub(super) fn rope_json(cfg: &Config) -> (Value, Option<usize>) {
    let extended = |orig: usize, f: f32| (orig as f64 * f64::from(f)) as usize;
    if let Some(l) = &cfg.rope_llama3 {
        return (
            json!({
                "rope_type": "llama3",
                "factor": num(l.factor),
                "low_freq_factor": num(l.low_freq_factor),
                "high_freq_factor": num(l.high_freq_factor),
                "original_max_position_embeddings": l.original_max_position,
            }),
            Some(extended(l.original_max_position, l.factor)),
        );
    }
    if let Some(y) = cfg.rope_yarn.as_ref().filter(|_| cfg.mla.is_none()) {
        return (
            json!({
                "rope_type": "yarn",
                "factor": num(y.factor),
                "original_max_position_embeddings": y.original_max_position,
                "beta_fast": num(y.beta_fast),
                "beta_slow": num(y.beta_slow),
                "attention_factor": num(y.attention_factor),
            }),
            Some(extended(y.original_max_position, y.factor)),
        );
    }
    match cfg.rope_scaling {
        Some(PositionScaling::Linear { factor }) => {
            (json!({"rope_type": "linear", "factor": num(factor)}), None)
        }
        Some(PositionScaling::Dynamic {
            factor,
            max_position,
        }) => (
            json!({"rope_type": "dynamic", "factor": num(factor)}),
            Some(max_position),
        ),
        None => (Value::Null, None),
    }
}

/// DeepSeek's YaRN object (`rope_scaling`, `type: yarn`; `null` without YaRN): the softmax's
/// `mscale_all_dim`, the rotation's `attention_factor`, and an `mscale` from which readers that
/// derive the rotation's factor from the two mscales get the same factor
/// ([`rope::mscale_for_rotation`](super::rope)).
pub(super) fn deepseek_yarn_json(cfg: &Config) -> Value {
    match &cfg.rope_yarn {
        None => Value::Null,
        Some(y) => json!({
            "type": "yarn",
            "factor": num(y.factor),
            "original_max_position_embeddings": y.original_max_position,
            "beta_fast": num(y.beta_fast),
            "beta_slow": num(y.beta_slow),
            "mscale": num(super::rope::mscale_for_rotation(y)),
            "mscale_all_dim": num(y.mscale),
            "attention_factor": num(y.attention_factor),
        }),
    }
}

/// The keys of `cfg`'s GQA RoPE and attention biases every Qwen/Llama-style class writes:
/// `rope_scaling`, `max_position_embeddings` (`default` unless the scaling implies one),
/// `attention_bias`, `head_dim`.
pub(super) fn gqa_json(cfg: &Config, default_max: usize) -> Value {
    let (rope_scaling, max) = rope_json(cfg);
    json!({
        "attention_bias": cfg.attention_out_bias,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": max.unwrap_or(default_max),
        "rope_scaling": rope_scaling,
    })
}

/// The Qwen classes' window keys: `use_sliding_window`, `sliding_window`, `layer_types` (which
/// layers slide, what transformers reads) and `max_window_layers`: the first sliding layer when
/// every layer from it on slides, so that readers of the older key alone (sliding from it on)
/// slide the same layers; else the layer count (no older form says it).
pub(super) fn qwen_window_json(cfg: &Config) -> Value {
    match &cfg.sliding_window {
        // Transformers' own keys, inert without use_sliding_window.
        None => {
            json!({"use_sliding_window": false, "sliding_window": 4096, "max_window_layers": 0})
        }
        Some(w) => {
            let n = cfg.base_num_decoder_layers;
            let slides = |i: usize| cfg.window_of(i).is_some();
            let first = (0..n).find(|&i| slides(i)).unwrap_or(n);
            let from = if (first..n).all(slides) { first } else { n };
            json!({
                "use_sliding_window": true,
                "sliding_window": w.size,
                "max_window_layers": from,
                "layer_types": layer_types_json(cfg),
            })
        }
    }
}

/// `layer_types` of `cfg`: `sliding_attention` where its window applies, else
/// `full_attention`.
pub(super) fn layer_types_json(cfg: &Config) -> Value {
    let types: Vec<&str> = (0..cfg.base_num_decoder_layers)
        .map(|i| match cfg.window_of(i) {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    json!(types)
}

/// Merges the objects of `parts` into one (later keys win).
pub(super) fn merged(parts: &[Value]) -> Value {
    let mut out = serde_json::Map::new();
    for p in parts {
        if let Value::Object(m) = p {
            out.extend(m.clone());
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::padding_row;
    use serde_json::json;

    /// `pad_token_id` as torch takes `padding_idx`: a row in `0..vocab`, a negative index
    /// counted from the end; none for `null`, an absent key, a value past either end or not an
    /// integer (transformers could not build that embedding).
    #[test]
    fn the_pad_row_is_torchs_padding_idx() {
        let row = |v: Option<serde_json::Value>| padding_row(v.as_ref(), 10);
        assert_eq!(row(Some(json!(0))), Some(0));
        assert_eq!(row(Some(json!(9))), Some(9));
        assert_eq!(row(Some(json!(-1))), Some(9));
        assert_eq!(row(Some(json!(-10))), Some(0));
        for none in [json!(10), json!(-11), json!(null), json!(1.5), json!("0")] {
            assert_eq!(row(Some(none.clone())), None, "{none}");
        }
        assert_eq!(row(None), None);
    }
}
