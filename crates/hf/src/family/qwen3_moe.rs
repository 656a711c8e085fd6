//! `qwen3_moe` (`Qwen3MoeForCausalLM`): Qwen3's attention (GQA with QK-norm) and a sparse MoE
//! feed-forward: softmax router, top-k, renormalised when `norm_topk_prob`, no shared expert;
//! dense layers only as a leading run (`mlp_only_layers`).
//!
//! MoE layers every `decoder_sparse_step`-th layer; RoPE `linear`, `dynamic`, `yarn`, `llama3`.
//!
//! Refused: dense layers other than a leading run, biases, sliding windows, the router's
//! load-balance loss through `output_router_logits`.

use ferrotext_models::decoder::{Config, MoeSettings};
use ferrotext_models::moe::RouterScore;
use serde_json::{json, Value};

use super::common::{block_misfit, common_config, gqa_json, gqa_misfit, merged};
use super::reader::num;
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC, QWEN_MOE_WINDOW};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys};
use KeyUse::{Irrelevant, Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "qwen3_moe",
    keys: &[KEYS, QWEN_MOE_WINDOW, super::qwen3::KEYS, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: GQA_ROPE_TYPES,
    deepseek_yarn: false,
    rope_view: same_rope_view,
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
    rename: super::no_rename,
    presets: &[],
    kept_f32: &[],
};

const KEYS: &[(&str, KeyUse)] = &[
    ("num_experts", Read { probe: "6" }),
    ("num_local_experts", Read { probe: "6" }),
    ("num_experts_per_tok", Read { probe: "3" }),
    ("moe_intermediate_size", Read { probe: "40" }),
    ("norm_topk_prob", Read { probe: "false" }),
    ("mlp_only_layers", Read { probe: "[]" }),
    ("decoder_sparse_step", Read { probe: "2" }),
    (
        "attention_bias",
        Refused {
            bad: "true",
            reason: "biases are read for the dense Qwen families only",
        },
    ),
    (
        "rope_scaling",
        Read {
            probe: "{\"rope_type\": \"linear\", \"factor\": 2.0}",
        },
    ),
    (
        "router_aux_loss_coef",
        Irrelevant("weighs the load-balance loss, added only with output_router_logits (refused)"),
    ),
];

const DEFAULTS: &[super::defaults::ClassDefault] = defaults!(
    ("151936", "2048", "6144", "24", "32"),
    ["num_key_value_heads"] => "4",
    ["num_experts", "num_local_experts"] => "128",
    ["num_experts_per_tok"] => "8",
    ["moe_intermediate_size"] => "768",
    ["norm_topk_prob"] => "false",
);

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let cfg = common_config(k)?;
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
    let moe = MoeSettings {
        num_experts: k.usize_alias("num_experts", "num_local_experts")?,
        num_experts_per_tok: k.usize("num_experts_per_tok")?,
        moe_mlp_dim: k.usize("moe_intermediate_size")?,
        first_num_dense_layers: dense,
        score: RouterScore::Softmax,
        norm_topk_prob: k.bool_or("norm_topk_prob", false)?,
        interleave_moe_layer_step: k.usize_or("decoder_sparse_step", 1)?.max(1),
        ..MoeSettings::default()
    };
    Ok(Config {
        qk_norm: true,
        moe: Some(moe),
        ..cfg
    })
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    if cfg.mla.is_some() {
        out.push("MLA attention (qwen3_moe has GQA)".into());
    }
    match &cfg.moe {
        None => out.push("no MoE layers (qwen3_moe has them)".into()),
        Some(m) => {
            if m.score != RouterScore::Softmax {
                out.push("a sigmoid router (qwen3_moe uses softmax)".into());
            }
            if m.shared_experts > 0 {
                out.push(format!(
                    "shared_experts={} (qwen3_moe has none)",
                    m.shared_experts
                ));
            }
            if m.routed_scaling_factor != 1.0 {
                out.push(format!(
                    "routed_scaling_factor={} (qwen3_moe has none)",
                    m.routed_scaling_factor
                ));
            }
            if m.groups.is_active() {
                out.push(format!(
                    "n_routing_groups={} (qwen3_moe routes without groups)",
                    m.groups.n_routing_groups
                ));
            }
            if m.routed_bias {
                out.push("routed_bias=true (qwen3_moe has no selection bias)".into());
            }
        }
    }
    gqa_misfit(cfg, "qwen3_moe", true, false, &mut out);
    block_misfit(cfg, "qwen3_moe", &["moe_step"], &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    let Some(m) = &cfg.moe else {
        return json!({});
    };
    let base = merged(&[
        json!({"architectures": ["Qwen3MoeForCausalLM"], "use_sliding_window": false}),
        gqa_json(cfg, 40960),
    ]);
    let moe = json!({
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.num_experts_per_tok,
        "moe_intermediate_size": m.moe_mlp_dim,
        "decoder_sparse_step": m.interleave_moe_layer_step,
        "mlp_only_layers": (0..m.first_num_dense_layers).collect::<Vec<_>>(),
        "norm_topk_prob": m.norm_topk_prob,
        "router_aux_loss_coef": num(m.load_balance_loss_weight),
        "output_router_logits": false,
    });
    merged(&[base, moe])
}
