//! `mixtral` (`MixtralForCausalLM`): Mistral's attention (a sliding window on every layer when
//! `sliding_window` is set) and a sparse MoE feed-forward on every layer: softmax router, top-k,
//! always renormalised, no shared expert. Its checkpoints name the block `block_sparse_moe` and
//! the experts' projections `w1` (gate), `w3` (up) and `w2` (down): [`rename`] maps the
//! decoder's names onto them, on load and on export.
//!
//! Refused: router jitter (`router_jitter_noise`, training-time noise), the router's loss through
//! `output_router_logits`.

use ferrotext_models::decoder::{Config, MoeSettings, SlidingWindow};
use ferrotext_models::moe::RouterScore;
use serde_json::{json, Value};

use super::common::{block_misfit, gqa_json, gqa_misfit, merged, sizes};
use super::reader::num;
use super::rope::GQA_ROPE_TYPES;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, Family, KeyUse, Keys, Preset};
use KeyUse::{Irrelevant, Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "mixtral",
    keys: &[KEYS, super::mistral::KEYS, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: GQA_ROPE_TYPES,
    deepseek_yarn: false,
    rope_view,
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
    rename,
    presets: PRESETS,
    kept_f32: &[],
};

/// Mixtral 8x7B's shape, and the same blocks at CPU size.
const PRESETS: &[Preset] = &[
    Preset {
        name: "mixtral-8x7b",
        about: "Mixtral-8x7B-v0.1's config.json",
        config: r#"{"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": null,
        "tie_word_embeddings": false}"#,
    },
    Preset {
        name: "mixtral-tiny",
        about: "CPU-sized (byte vocabulary): 8 experts of width 96, top-2",
        config: r#"{"vocab_size": 256, "hidden_size": 128, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": null, "tie_word_embeddings": false}"#,
    },
];

const KEYS: &[(&str, KeyUse)] = &[
    ("num_local_experts", Read { probe: "6" }),
    ("num_experts", Read { probe: "6" }),
    ("num_experts_per_tok", Read { probe: "3" }),
    (
        "router_jitter_noise",
        Refused {
            bad: "0.1",
            reason: "training-time noise on the router's input is not built",
        },
    ),
    (
        "router_aux_loss_coef",
        Irrelevant("weighs the load-balance loss, added only with output_router_logits (refused)"),
    ),
];

const DEFAULTS: &[super::defaults::ClassDefault] = &[
    (&["vocab_size"], "32000"),
    (&["hidden_size"], "4096"),
    (&["intermediate_size"], "14336"),
    (&["num_hidden_layers"], "32"),
    (&["num_attention_heads"], "32"),
    (&["num_key_value_heads"], "8"),
    (&["rms_norm_eps"], "1e-5"),
    (&["tie_word_embeddings"], "false"),
    (&["num_local_experts", "num_experts"], "8"),
    (&["num_experts_per_tok"], "2"),
];

/// The config with the class's θ (1e6, not the shared reader's 10000) where it names none.
fn rope_view(v: &Value) -> Option<Value> {
    let named = v.get("rope_theta").is_some()
        || v.get("rope_parameters")
            .is_some_and(|p| p.get("rope_theta").is_some());
    if named {
        return None;
    }
    let mut view = v.clone();
    view["rope_theta"] = 1_000_000.0.into();
    Some(view)
}

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = sizes(k)?;
    k.only("hidden_act", json!("silu"));
    k.only_number("router_jitter_noise", 0.0);
    if k.get("sliding_window").is_some() {
        cfg.sliding_window = Some(SlidingWindow {
            size: k.usize("sliding_window")?,
            layers: Vec::new(),
        });
    }
    cfg.moe = Some(MoeSettings {
        num_experts: k.usize_alias("num_local_experts", "num_experts")?,
        num_experts_per_tok: k.usize("num_experts_per_tok")?,
        moe_mlp_dim: cfg.base_mlp_dim,
        score: RouterScore::Softmax,
        norm_topk_prob: true,
        ..MoeSettings::default()
    });
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    if cfg.mla.is_some() {
        out.push("MLA attention (mixtral has GQA)".into());
    }
    match &cfg.moe {
        None => out.push("no MoE layers (mixtral has them)".into()),
        Some(m) => {
            let plain = m.score == RouterScore::Softmax
                && m.norm_topk_prob
                && m.shared_experts == 0
                && m.first_num_dense_layers == 0
                && m.routed_scaling_factor == 1.0
                && !m.groups.is_active()
                && !m.routed_bias
                && m.moe_mlp_dim == cfg.base_mlp_dim;
            if !plain {
                out.push(
                    "MoE other than softmax top-k renormalised on every layer, experts as wide \
                     as intermediate_size (mixtral's)"
                        .into(),
                );
            }
        }
    }
    gqa_misfit(cfg, "mixtral", false, false, &mut out);
    block_misfit(cfg, "mixtral", &["window"], &mut out);
    if cfg
        .sliding_window
        .as_ref()
        .is_some_and(|w| !w.layers.is_empty())
    {
        out.push("sliding windows on some layers only (mixtral slides every layer)".into());
    }
    out
}

fn write(cfg: &Config) -> Value {
    let m = cfg.moe.clone().unwrap_or_default();
    let mut v = merged(&[
        json!({
            "architectures": ["MixtralForCausalLM"],
            "sliding_window": cfg.sliding_window.as_ref().map(|w| w.size),
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.num_experts_per_tok,
            "router_aux_loss_coef": num(m.load_balance_loss_weight),
            "router_jitter_noise": 0.0,
            "output_router_logits": false,
        }),
        gqa_json(cfg, 32768),
    ]);
    if let Some(o) = v.as_object_mut() {
        o.remove("attention_bias");
    }
    v
}

/// Mixtral's checkpoint name of a decoder HF name: `mlp.gate` → `block_sparse_moe.gate`,
/// `mlp.experts.{e}.{gate,up,down}_proj` → `block_sparse_moe.experts.{e}.{w1,w3,w2}`.
pub(super) fn rename(name: &str) -> Option<String> {
    let (layer, rest) = name.split_once(".mlp.")?;
    if rest == "gate.weight" {
        return Some(format!("{layer}.block_sparse_moe.gate.weight"));
    }
    let rest = rest.strip_prefix("experts.")?;
    let (expert, proj) = rest.split_once('.')?;
    let w = match proj {
        "gate_proj.weight" => "w1",
        "up_proj.weight" => "w3",
        "down_proj.weight" => "w2",
        _ => return None,
    };
    Some(format!(
        "{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
    ))
}
