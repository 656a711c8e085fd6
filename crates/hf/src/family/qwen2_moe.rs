//! `qwen2_moe` (`Qwen2MoeForCausalLM`, Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (GQA with
//! q/k/v biases, `qkv_bias`) and a sparse MoE feed-forward: softmax router, top-k, renormalised
//! when `norm_topk_prob`, a shared expert of its own width (`shared_expert_intermediate_size`)
//! gated by `sigmoid(x·shared_expert_gate)`, MoE every `decoder_sparse_step`-th layer past a
//! leading run of dense ones (`mlp_only_layers`).
//!
//! Refused: sliding windows, dense layers other than a leading run, the router's loss through
//! `output_router_logits`.

use ferrotext_models::decoder::{Config, MoeSettings};
use ferrotext_models::moe::RouterScore;
use serde_json::{json, Value};

use super::common::{block_misfit, common_config, gqa_json, gqa_misfit, merged};
use super::reader::num;
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC, QWEN_MOE_WINDOW};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys, Preset};
use KeyUse::{Irrelevant, Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "qwen2_moe",
    keys: &[KEYS, QWEN_MOE_WINDOW, DECODER, GENERIC],
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

/// Qwen1.5-MoE-A2.7B's shape (60 experts top-4 and a gated shared expert), and the same blocks
/// at CPU size.
const PRESETS: &[Preset] = &[
    Preset {
        name: "qwen1.5-moe-a2.7b",
        about: "Qwen1.5-MoE-A2.7B's config.json",
        config: r#"{"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": false,
        "decoder_sparse_step": 1, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "use_sliding_window": false, "tie_word_embeddings": false}"#,
    },
    Preset {
        name: "qwen2-moe-tiny",
        about: "CPU-sized (byte vocabulary): 8 experts of width 64, top-2, a gated shared expert of width 96",
        config: r#"{"vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": false,
        "decoder_sparse_step": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": false}"#,
    },
];

const KEYS: &[(&str, KeyUse)] = &[
    ("tie_word_embeddings", Read { probe: "true" }),
    ("num_experts", Read { probe: "6" }),
    ("num_experts_per_tok", Read { probe: "3" }),
    ("moe_intermediate_size", Read { probe: "40" }),
    ("shared_expert_intermediate_size", Read { probe: "40" }),
    ("norm_topk_prob", Read { probe: "true" }),
    ("decoder_sparse_step", Read { probe: "2" }),
    ("mlp_only_layers", Read { probe: "[0]" }),
    (
        "qkv_bias",
        Refused {
            bad: "false",
            reason: "Qwen2-MoE's attention has q/k/v biases",
        },
    ),
    (
        "router_aux_loss_coef",
        Irrelevant("weighs the load-balance loss, added only with output_router_logits (refused)"),
    ),
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
    (&["vocab_size"], "151936"),
    (&["hidden_size"], "2048"),
    (&["intermediate_size"], "5632"),
    (&["num_hidden_layers"], "24"),
    (&["num_attention_heads"], "16"),
    (&["num_key_value_heads"], "16"),
    (&["rms_norm_eps"], "1e-6"),
    (&["tie_word_embeddings"], "false"),
    (&["num_experts"], "60"),
    (&["num_experts_per_tok"], "4"),
    (&["moe_intermediate_size"], "1408"),
    (&["shared_expert_intermediate_size"], "5632"),
    (&["norm_topk_prob"], "false"),
    (&["decoder_sparse_step"], "1"),
];

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = common_config(k)?;
    cfg.qkv_bias = true;
    k.only("qkv_bias", json!(true));
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
    cfg.moe = Some(MoeSettings {
        num_experts: k.usize("num_experts")?,
        num_experts_per_tok: k.usize("num_experts_per_tok")?,
        moe_mlp_dim: k.usize("moe_intermediate_size")?,
        shared_experts: 1,
        shared_mlp_dim: Some(k.usize("shared_expert_intermediate_size")?),
        shared_expert_gate: true,
        first_num_dense_layers: dense,
        score: RouterScore::Softmax,
        norm_topk_prob: k.bool_or("norm_topk_prob", false)?,
        interleave_moe_layer_step: k.usize_or("decoder_sparse_step", 1)?.max(1),
        ..MoeSettings::default()
    });
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    if cfg.mla.is_some() {
        out.push("MLA attention (qwen2_moe has GQA)".into());
    }
    match &cfg.moe {
        None => out.push("no MoE layers (qwen2_moe has them)".into()),
        Some(m) => {
            let ours = m.score == RouterScore::Softmax
                && m.shared_experts == 1
                && m.shared_expert_gate
                && m.routed_scaling_factor == 1.0
                && !m.groups.is_active()
                && !m.routed_bias;
            if !ours {
                out.push(
                    "MoE other than softmax top-k with one sigmoid-gated shared expert \
                     (qwen2_moe's)"
                        .into(),
                );
            }
        }
    }
    gqa_misfit(cfg, "qwen2_moe", false, true, &mut out);
    block_misfit(cfg, "qwen2_moe", &["moe_step", "shared_gate"], &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    let m = cfg.moe.clone().unwrap_or_default();
    let mut v = merged(&[
        json!({
            "architectures": ["Qwen2MoeForCausalLM"],
            "use_sliding_window": false,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_mlp_dim,
            "shared_expert_intermediate_size": cfg.shared_mlp_dim(),
            "decoder_sparse_step": m.interleave_moe_layer_step,
            "mlp_only_layers": (0..m.first_num_dense_layers).collect::<Vec<_>>(),
            "norm_topk_prob": m.norm_topk_prob,
            "router_aux_loss_coef": num(m.load_balance_loss_weight),
            "output_router_logits": false,
            "qkv_bias": true,
        }),
        gqa_json(cfg, 32768),
    ]);
    if let Some(o) = v.as_object_mut() {
        o.remove("attention_bias");
        // The class has no such key, but its attention and RoPE read one (`getattr`) in both
        // generations; 4.x refuses a value other than hidden_size / heads, so it is written only
        // then (a directory 4.x refuses, as it refused the one the model came from).
        if cfg.head_dim * cfg.base_num_query_heads == cfg.base_emb_dim {
            o.remove("head_dim");
        }
    }
    v
}
