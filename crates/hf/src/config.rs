//! `config.json` ↔ the decoder's [`Config`], for the five HF families the decoder runs, in both
//! config generations (transformers 4.x and 5).
//!
//! Invariant: every key a family's transformers config class defines is read, refused when its
//! value asks for math the decoder does not do (named with the value), or irrelevant to the
//! math; `keys.rs` lists each with its reason and a test walks transformers' own key lists.
//! Keys a class does not define are ignored, as transformers ignores them. A key the file leaves
//! out takes the class's default, as `from_pretrained` gives it (`defaults.rs`). The RoPE keys,
//! in either generation, are read in `rope.rs`.

mod defaults;
mod keys;
mod rope;

pub use defaults::class_defaults;
pub use keys::{key_use, listed_keys, KeyUse};

use std::path::Path;

use ferrotext_models::decoder::{Config, GroupLimit, MoeSettings};
use ferrotext_models::deepseek::MlaSettings;
use ferrotext_models::moe::RouterScore;
use serde_json::{json, Value};

use crate::error::HfError;

/// The HF `model_type`s the decoder runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelType {
    /// `qwen3` (`Qwen3ForCausalLM`): dense, GQA with QK-norm.
    Qwen3,
    /// `qwen3_moe` (`Qwen3MoeForCausalLM`): softmax router, no shared experts.
    Qwen3Moe,
    /// `deepseek_v3` (`DeepseekV3ForCausalLM`): MLA, sigmoid router, shared experts.
    DeepseekV3,
    /// `llama` (`LlamaForCausalLM`, Llama 3.x): dense, GQA without QK-norm, Llama 3 RoPE.
    Llama,
    /// `qwen2` (`Qwen2ForCausalLM`, Qwen2/2.5): dense, GQA with q/k/v biases, no QK-norm.
    Qwen2,
}

impl ModelType {
    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        match self {
            ModelType::Qwen3 => "qwen3",
            ModelType::Qwen3Moe => "qwen3_moe",
            ModelType::DeepseekV3 => "deepseek_v3",
            ModelType::Llama => "llama",
            ModelType::Qwen2 => "qwen2",
        }
    }

    /// The type named `name` (`config.json`'s `model_type`).
    pub fn from_name(name: &str) -> Option<ModelType> {
        Some(match name {
            "qwen3" => ModelType::Qwen3,
            "qwen3_moe" => ModelType::Qwen3Moe,
            "deepseek_v3" => ModelType::DeepseekV3,
            "llama" => ModelType::Llama,
            "qwen2" => ModelType::Qwen2,
            _ => return None,
        })
    }

    /// Every type, in the order the messages list them.
    pub const ALL: [ModelType; 5] = [
        ModelType::Qwen3,
        ModelType::Qwen3Moe,
        ModelType::DeepseekV3,
        ModelType::Llama,
        ModelType::Qwen2,
    ];

    /// The family a decoder config belongs to in HF's terms.
    ///
    /// # Errors
    /// A config no HF family expresses, naming the features.
    pub fn of(cfg: &Config) -> Result<ModelType, String> {
        let mut unsupported = Vec::new();
        let kind = match (&cfg.mla, &cfg.moe) {
            (Some(_), None) => {
                unsupported.push("MLA without MoE layers (deepseek_v3 has MoE)".to_string());
                ModelType::DeepseekV3
            }
            (Some(_), Some(m)) => {
                if m.score != RouterScore::Sigmoid {
                    unsupported.push("a softmax router with MLA (deepseek_v3 uses sigmoid)".into());
                }
                ModelType::DeepseekV3
            }
            (None, Some(m)) => {
                if m.score != RouterScore::Softmax {
                    unsupported
                        .push("a sigmoid router without MLA (qwen3_moe uses softmax)".into());
                }
                if m.shared_experts > 0 {
                    unsupported.push(format!(
                        "shared_experts={} (qwen3_moe has none)",
                        m.shared_experts
                    ));
                }
                if m.routed_scaling_factor != 1.0 {
                    unsupported.push(format!(
                        "routed_scaling_factor={} (qwen3_moe has none)",
                        m.routed_scaling_factor
                    ));
                }
                if m.groups.is_active() {
                    unsupported.push(format!(
                        "n_routing_groups={} (qwen3_moe routes without groups)",
                        m.groups.n_routing_groups
                    ));
                }
                if m.routed_bias {
                    unsupported.push("routed_bias=true (qwen3_moe has no selection bias)".into());
                }
                ModelType::Qwen3Moe
            }
            (None, None) => match (cfg.qk_norm, cfg.qkv_bias) {
                (true, false) => ModelType::Qwen3,
                (false, false) => ModelType::Llama,
                (false, true) => ModelType::Qwen2,
                (true, true) => {
                    unsupported.push("QK-norm with q/k/v biases (no dense family has both)".into());
                    ModelType::Qwen3
                }
            },
        };
        if cfg.mla.is_none() && cfg.rope_yarn.is_some() {
            unsupported.push("YaRN RoPE without MLA".into());
        }
        if cfg.moe.is_some() && cfg.mla.is_none() && (!cfg.qk_norm || cfg.qkv_bias) {
            unsupported
                .push("MoE layers with Llama/Qwen2 attention (qwen3_moe has QK-norm)".into());
        }
        if kind != ModelType::DeepseekV3 && cfg.mtp_num_layers > 0 {
            unsupported.push(format!(
                "mtp_num_layers={} in {} (transformers has a multi-token-prediction layer only \
                 in deepseek_v3)",
                cfg.mtp_num_layers,
                kind.name()
            ));
        }
        if kind != ModelType::Llama && cfg.rope_llama3.is_some() {
            unsupported.push(format!("Llama 3 RoPE scaling in {}", kind.name()));
        }
        if unsupported.is_empty() {
            Ok(kind)
        } else {
            Err(format!(
                "no Hugging Face model_type fits this model: {}",
                unsupported.join("; ")
            ))
        }
    }
}

/// The decoder config of the HF directory `dir` (its `config.json`).
///
/// # Errors
/// [`HfError::Params`] naming `config.json`: unreadable, not JSON, an unknown `model_type`,
/// a missing or mistyped key, or features the decoder does not have (all named in one error).
///
/// A declared multi-token-prediction layer (`num_nextn_predict_layers` = 1) is kept
/// (`mtp_num_layers` = 1) only when the directory's weights hold a tensor under
/// `model.layers.{num_hidden_layers}.`: transformers 5 writes 1 without the layer, and such a
/// directory is the main model alone. A partial layer is then named, missing, at load.
pub fn read_config(dir: &Path) -> Result<Config, HfError> {
    let path = dir.join(super::CONFIG_FILE);
    let err = |reason: String| HfError::Params {
        path: path.display().to_string(),
        reason,
    };
    let text = ferrotext_files::read_regular_to_string(&path)
        .map_err(|e| err(format!("cannot read: {e}")))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| err(format!("is not JSON: {e}")))?;
    let mut cfg = decoder_config(&value).map_err(err)?;
    if cfg.mtp_num_layers > 0 {
        let prefix = format!("model.layers.{}.", cfg.base_num_decoder_layers);
        let names = crate::read::tensor_names(dir).map_err(|reason| HfError::Params {
            path: dir.display().to_string(),
            reason,
        })?;
        if names.is_some_and(|n| !n.iter().any(|n| n.starts_with(&prefix))) {
            cfg.mtp_num_layers = 0;
        }
    }
    Ok(cfg)
}

/// The decoder config of a parsed `config.json` (what [`read_config`] reads from a file).
///
/// # Errors
/// As [`read_config`], as one sentence: an unknown `model_type`, a missing or mistyped key, or
/// every feature the decoder does not have, each named with its value.
pub fn config_from_json(v: &Value) -> Result<Config, String> {
    decoder_config(v)
}

/// Reads keys of one `config.json`, remembering what it cannot use.
struct Keys<'a> {
    v: &'a Value,
    unsupported: Vec<String>,
}

impl<'a> Keys<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|x| !x.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize, String> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| format!("`{key}` is missing or not a non-negative integer"))
    }

    /// An integer written under `key` (4.x) or `alias` (5.x); both only when equal.
    fn usize_alias(&mut self, key: &str, alias: &str) -> Result<usize, String> {
        match (self.get(key), self.get(alias)) {
            (Some(_), Some(_)) => {
                let (a, b) = (self.usize(key)?, self.usize(alias)?);
                if a != b {
                    self.unsupported
                        .push(format!("{key}={a} and {alias}={b} (two different counts)"));
                }
                Ok(a)
            }
            (None, Some(_)) => self.usize(alias),
            _ => self.usize(key),
        }
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize, String> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize(key),
        }
    }

    /// A finite number (as f32), `default` when absent.
    fn f32_or(&self, key: &str, default: f32) -> Result<f32, String> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => {
                let v = x
                    .as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| format!("`{key}` is not a number"))?;
                if v.is_finite() {
                    Ok(v)
                } else {
                    Err(format!("`{key}` = {x} is not a finite 32-bit float"))
                }
            }
        }
    }

    /// A positive finite number, `default` when absent: the scales and rates a model divides by
    /// or raises to a power (a zero or negative one trains on NaN, not an error).
    fn positive_or(&self, key: &str, default: f32) -> Result<f32, String> {
        let v = self.f32_or(key, default)?;
        if v > 0.0 {
            Ok(v)
        } else {
            Err(format!("`{key}` must be a positive number, got {v}"))
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| format!("`{key}` is not a boolean")),
        }
    }

    /// Records `key=value` as unsupported unless it is absent or the number `allowed` (`0` and
    /// `0.0` alike).
    fn only_number(&mut self, key: &str, allowed: f64) {
        if let Some(x) = self.get(key) {
            if x.as_f64() != Some(allowed) {
                self.unsupported.push(format!("{key}={x}"));
            }
        }
    }

    /// Records `key=value` as unsupported unless it is absent or equal to `allowed`.
    fn only(&mut self, key: &str, allowed: Value) {
        if let Some(x) = self.get(key) {
            if *x != allowed {
                self.unsupported.push(format!("{key}={x}"));
            }
        }
    }
}

/// The decoder config of a parsed `config.json`: the family's `model_type`, the keys every
/// family shares, then the family's own; the features the decoder does not have are collected
/// and refused together.
fn decoder_config(v: &Value) -> Result<Config, String> {
    let model_type = v
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or("`model_type` is missing")?;
    let kind = ModelType::from_name(model_type).ok_or_else(|| {
        format!(
            "model_type `{model_type}` is not supported (qwen3, qwen3_moe, deepseek_v3, llama \
             or qwen2)"
        )
    })?;
    // A key the file leaves out means what it means to transformers: its class's default.
    let v = &defaults::with_class_defaults(kind, v);
    let mut k = Keys {
        v,
        unsupported: Vec::new(),
    };
    let mut cfg = common_config(&mut k, kind)?;
    match kind {
        ModelType::Qwen3 | ModelType::Llama | ModelType::Qwen2 => {}
        ModelType::Qwen3Moe => cfg.moe = Some(qwen3_moe_settings(&mut k)?),
        ModelType::DeepseekV3 => deepseek_v3(&mut k, &mut cfg)?,
    }
    let rope = rope::read(&mut k, kind)?;
    cfg.rope_max_timescale = rope.theta.unwrap_or(cfg.rope_max_timescale);
    cfg.rope_yarn = rope.yarn;
    cfg.rope_llama3 = rope.llama3;

    if !k.unsupported.is_empty() {
        return Err(format!(
            "model_type `{model_type}` with features the decoder does not have: {}",
            k.unsupported.join(", ")
        ));
    }
    Ok(cfg)
}

/// The keys every family shares: sizes, tied embeddings, the norm's ε (a dense decoder without
/// MoE, MLA or RoPE scaling; θ is read with the other RoPE keys); the family's attention (QK-norm
/// for the Qwen3 families, q/k/v biases for Qwen2); activations, other biases and sliding
/// windows only as the decoder has them.
fn common_config(k: &mut Keys<'_>, kind: ModelType) -> Result<Config, String> {
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
    let qwen3_attention = matches!(kind, ModelType::Qwen3 | ModelType::Qwen3Moe);
    Ok(Config {
        vocab_size: k.usize("vocab_size")?,
        base_emb_dim: hidden,
        base_num_decoder_layers: k.usize("num_hidden_layers")?,
        base_num_query_heads: heads,
        base_num_kv_heads: k.usize_or("num_key_value_heads", heads)?,
        head_dim: k.usize_or("head_dim", hidden / heads.max(1))?,
        base_mlp_dim: k.usize("intermediate_size")?,
        logits_via_embedding: k.bool_or("tie_word_embeddings", false)?,
        rope_max_timescale: 10_000.0,
        rope_llama3: None,
        qk_norm: qwen3_attention,
        qkv_bias: kind == ModelType::Qwen2,
        normalization_layer_epsilon: k.positive_or("rms_norm_eps", 1e-6)?,
        z_loss_multiplier: 0.0,
        moe: None,
        mla: None,
        rope_yarn: None,
        mtp_num_layers: 0,
        mtp_loss_scaling_factor: 0.1,
    })
}

/// `qwen3_moe`'s MoE layers: a softmax router, no shared experts, dense layers only as a
/// leading run (`mlp_only_layers`).
fn qwen3_moe_settings(k: &mut Keys<'_>) -> Result<MoeSettings, String> {
    k.only("decoder_sparse_step", json!(1));
    let dense = match k.get("mlp_only_layers") {
        None => 0,
        Some(list) => {
            let layers: Vec<u64> = list
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            let prefix = layers.iter().enumerate().all(|(i, &l)| l == i as u64);
            if !prefix || list.as_array().map_or(0, Vec::len) != layers.len() {
                k.unsupported.push(format!(
                    "mlp_only_layers={list} (only a leading run 0, 1, .. of dense layers)"
                ));
            }
            layers.len()
        }
    };
    Ok(MoeSettings {
        num_experts: k.usize_alias("num_experts", "num_local_experts")?,
        num_experts_per_tok: k.usize("num_experts_per_tok")?,
        moe_mlp_dim: k.usize("moe_intermediate_size")?,
        shared_experts: 0,
        first_num_dense_layers: dense,
        score: RouterScore::Softmax,
        norm_topk_prob: k.bool_or("norm_topk_prob", false)?,
        routed_scaling_factor: 1.0,
        load_balance_loss_weight: 0.0,
        groups: GroupLimit::default(),
        routed_bias: false,
        withhold_tags: false,
    })
}

/// `deepseek_v3` on top of the shared keys: MLA (queries through a latent), a sigmoid router
/// with shared experts in one group, its RoPE pairs interleaved or not (`rope_interleave`); its
/// YaRN is read with the other RoPE keys.
fn deepseek_v3(k: &mut Keys<'_>, cfg: &mut Config) -> Result<(), String> {
    k.only("scoring_func", json!("sigmoid"));
    // The multi-token-prediction depth as declared; transformers 5 writes 1 even without the
    // layer's tensors, so `read_config` keeps it only when the weights hold the layer.
    let has_key = k.get("num_nextn_predict_layers").is_some() || k.get("num_mtp_layers").is_some();
    let mtp = if has_key {
        k.usize_alias("num_nextn_predict_layers", "num_mtp_layers")?
    } else {
        0
    };
    if mtp > 1 {
        k.unsupported.push(format!(
            "num_nextn_predict_layers={mtp} (one multi-token-prediction layer is built, as \
             the published model and transformers have)"
        ));
    }
    cfg.mtp_num_layers = mtp;
    k.only("moe_layer_freq", json!(1));
    if k.get("q_lora_rank").is_none() {
        k.unsupported
            .push("q_lora_rank=null (queries without a latent)".into());
    }
    let qk_rope_head_dim = k.usize("qk_rope_head_dim")?;
    cfg.head_dim = qk_rope_head_dim;
    cfg.mla = Some(MlaSettings {
        q_lora_rank: k.usize_or("q_lora_rank", 0)?,
        kv_lora_rank: k.usize("kv_lora_rank")?,
        qk_nope_head_dim: k.usize("qk_nope_head_dim")?,
        qk_rope_head_dim,
        v_head_dim: k.usize("v_head_dim")?,
        rope_interleave: k.bool_or("rope_interleave", true)?,
    });
    cfg.moe = Some(MoeSettings {
        num_experts: k.usize_alias("n_routed_experts", "num_local_experts")?,
        num_experts_per_tok: k.usize("num_experts_per_tok")?,
        moe_mlp_dim: k.usize("moe_intermediate_size")?,
        shared_experts: k.usize_or("n_shared_experts", 0)?,
        first_num_dense_layers: k.usize_or("first_k_dense_replace", 0)?,
        score: RouterScore::Sigmoid,
        norm_topk_prob: k.bool_or("norm_topk_prob", false)?,
        routed_scaling_factor: k.positive_or("routed_scaling_factor", 1.0)?,
        load_balance_loss_weight: 0.0,
        // `DeepseekV3TopkRouter`: groups scored by their best two, and the selection bias
        // (`e_score_correction_bias`, a buffer every checkpoint carries).
        groups: GroupLimit {
            n_routing_groups: k.usize_or("n_group", 1)?,
            topk_routing_group: k.usize_or("topk_group", 1)?,
        },
        routed_bias: true,
        withhold_tags: false,
    });
    Ok(())
}

/// A float as JSON, written in its shortest round-tripping decimal form (`1e-6`, not
/// `9.99999997e-7`).
fn num(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map_or(Value::Null, Value::from)
}

/// The `config.json` of `cfg` (`torch_dtype` set to `dtype`, e.g. `bfloat16`).
///
/// # Errors
/// A config no HF family expresses (see [`ModelType::of`]).
pub fn hf_config_json(cfg: &Config, dtype: &str) -> Result<Value, String> {
    let kind = ModelType::of(cfg)?;
    let mut v = json!({
        "model_type": kind.name(),
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
        "attention_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": dtype,
    });
    let extra = match (kind, &cfg.moe, &cfg.mla) {
        (ModelType::Qwen3, _, _) => json!({
            "architectures": ["Qwen3ForCausalLM"],
            "head_dim": cfg.head_dim,
            "max_position_embeddings": 40960,
            "rope_scaling": null,
            "use_sliding_window": false,
        }),
        (ModelType::Llama, _, _) => llama_extra(cfg),
        (ModelType::Qwen2, _, _) => json!({
            "architectures": ["Qwen2ForCausalLM"],
            "head_dim": cfg.head_dim,
            "max_position_embeddings": 32768,
            "rope_scaling": null,
            "use_sliding_window": false,
        }),
        (ModelType::Qwen3Moe, Some(m), _) => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "head_dim": cfg.head_dim,
            "max_position_embeddings": 40960,
            "rope_scaling": null,
            "use_sliding_window": false,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_mlp_dim,
            "decoder_sparse_step": 1,
            "mlp_only_layers": (0..m.first_num_dense_layers).collect::<Vec<_>>(),
            "norm_topk_prob": m.norm_topk_prob,
            "router_aux_loss_coef": num(m.load_balance_loss_weight),
            "output_router_logits": false,
        }),
        (ModelType::DeepseekV3, Some(m), Some(a)) => deepseek_v3_extra(cfg, m, a),
        _ => return Err("no Hugging Face model_type fits this model".into()),
    };
    if let (Some(obj), Value::Object(more)) = (v.as_object_mut(), extra) {
        obj.extend(more);
        if kind == ModelType::Qwen2 {
            // Qwen2's q/k/v biases are not a key: `Qwen2Attention` always has them.
            obj.remove("attention_bias");
        }
    }
    Ok(v)
}

/// The `config.json` keys only `llama` writes: its Llama 3 rope scaling and bias flags.
fn llama_extra(cfg: &Config) -> Value {
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
        "head_dim": cfg.head_dim,
        "max_position_embeddings": max_pos,
        "rope_scaling": rope_scaling,
        "mlp_bias": false,
        "pretraining_tp": 1,
    })
}

/// The `config.json` keys only `deepseek_v3` writes: MLA, the router and YaRN.
fn deepseek_v3_extra(cfg: &Config, m: &MoeSettings, a: &MlaSettings) -> Value {
    let rope_scaling = match &cfg.rope_yarn {
        None => Value::Null,
        Some(y) => json!({
            "type": "yarn",
            "factor": num(y.factor),
            "original_max_position_embeddings": y.original_max_position,
            "beta_fast": num(y.beta_fast),
            "beta_slow": num(y.beta_slow),
            "mscale": num(y.mscale),
            "mscale_all_dim": num(y.mscale),
            "attention_factor": num(y.attention_factor),
        }),
    };
    let max_pos = cfg.rope_yarn.as_ref().map_or(4096, |y| {
        (y.original_max_position as f64 * y.factor as f64) as usize
    });
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "max_position_embeddings": max_pos,
        "rope_scaling": rope_scaling,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.shared_experts,
        "num_experts_per_tok": m.num_experts_per_tok,
        "moe_intermediate_size": m.moe_mlp_dim,
        "first_k_dense_replace": m.first_num_dense_layers,
        "moe_layer_freq": 1,
        "norm_topk_prob": m.norm_topk_prob,
        "routed_scaling_factor": num(m.routed_scaling_factor),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": m.groups.n_routing_groups,
        "topk_group": m.groups.topk_routing_group,
        "rope_interleave": a.rope_interleave,
        "num_nextn_predict_layers": cfg.mtp_num_layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(name: &str) {
        let cfg = Config::preset(name).unwrap();
        let v = hf_config_json(&cfg, "float32").unwrap();
        assert_eq!(decoder_config(&v).unwrap(), cfg, "{name}: {v}");
    }

    #[test]
    fn presets_survive_config_json() {
        for name in [
            "qwen3-tiny",
            "qwen3-0.6b",
            "llama3-tiny",
            "llama3.2-1b",
            "qwen2-tiny",
            "qwen2.5-0.5b",
        ] {
            roundtrip(name);
        }
        let mut moe = Config::preset("qwen3-moe-tiny").unwrap();
        if let Some(m) = moe.moe.as_mut() {
            m.shared_experts = 0;
        }
        let v = hf_config_json(&moe, "float32").unwrap();
        assert_eq!(decoder_config(&v).unwrap(), moe);
        let mut ds = Config::preset("deepseek3-tiny").unwrap();
        ds.head_dim = ds.mla.unwrap().qk_rope_head_dim;
        let v = hf_config_json(&ds, "bfloat16").unwrap();
        assert_eq!(decoder_config(&v).unwrap(), ds);
        if let Some(m) = ds.mla.as_mut() {
            m.rope_interleave = false;
        }
        let v = hf_config_json(&ds, "bfloat16").unwrap();
        assert_eq!(v["rope_interleave"], json!(false));
        assert_eq!(decoder_config(&v).unwrap(), ds);
    }

    #[test]
    fn unknown_model_types_and_features_are_named() {
        let err = decoder_config(&json!({"model_type": "gpt2"})).unwrap_err();
        assert_eq!(
            err,
            "model_type `gpt2` is not supported (qwen3, qwen3_moe, deepseek_v3, llama or qwen2)"
        );
        let mut v = hf_config_json(&Config::preset("qwen3-tiny").unwrap(), "float32").unwrap();
        v["attention_bias"] = json!(true);
        v["use_sliding_window"] = json!(true);
        assert_eq!(
            decoder_config(&v).unwrap_err(),
            "model_type `qwen3` with features the decoder does not have: attention_bias=true \
             (biases on q, k, v and o: the output projection's bias is not built), \
             use_sliding_window=true"
        );
        let mut v = hf_config_json(&Config::preset("qwen3-tiny").unwrap(), "float32").unwrap();
        v["rope_theta"] = json!(-1.0);
        assert_eq!(
            decoder_config(&v).unwrap_err(),
            "`rope_theta` must be a positive number, got -1"
        );
        v["rope_theta"] = json!(1e300);
        assert_eq!(
            decoder_config(&v).unwrap_err(),
            "`rope_theta` = 1e+300 is not a finite 32-bit float"
        );
        let moe = Config::preset("qwen3-moe-tiny").unwrap();
        assert!(ModelType::of(&moe)
            .unwrap_err()
            .contains("shared_experts=1 (qwen3_moe has none)"));
    }
}
