//! `deepseek_v3` (`DeepseekV3ForCausalLM`): multi-head latent attention (queries through a
//! latent, `q_lora_rank`), RoPE pairs interleaved or not (`rope_interleave`) with YaRN, a sigmoid
//! router with its selection bias (`e_score_correction_bias`, a buffer every checkpoint carries)
//! over groups scored by their best two, shared experts, the first `first_k_dense_replace` layers
//! dense; the multi-token-prediction layer when the weights hold it.
//!
//! Queries without a latent (`q_lora_rank: null`, Moonlight's layout) come through `q_proj`.
//!
//! Refused: a softmax router, MoE layers other than after a leading dense run, MTP depths above
//! 1.

use ferrotext_models::decoder::{Config, GroupLimit, MoeSettings};
use ferrotext_models::deepseek::MlaSettings;
use ferrotext_models::moe::RouterScore;
use ferrotext_models::ParamInfo;
use serde_json::{json, Value};

use super::common::{
    block_misfit, common_config, deepseek_yarn_json, latent_eps_misfit, no_llama3,
    MLA_LATENT_NORM_EPS,
};
use super::reader::num;
use super::table::{DECODER, GENERIC};
use super::{same_rope_view, Family, KeyUse, Keys};
use crate::{ROUTER, SELECTION_BIAS};
use KeyUse::{Irrelevant, Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "deepseek_v3",
    keys: &[KEYS, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: &["yarn"],
    deepseek_yarn: true,
    rope_view: same_rope_view,
    read,
    misfit,
    write,
    extra_tensor: selection_bias,
    rename: super::no_rename,
    presets: &[],
    kept_f32: &[ROUTER, SELECTION_BIAS],
};

const KEYS: &[(&str, KeyUse)] = &[
    ("max_position_embeddings", Refused {
        bad: "12345",
        reason: "with YaRN, transformers 4.x takes the factor from max_position_embeddings / \
                 original_max_position_embeddings and 5 the rope factor as written: they must \
                 agree",
    }),
    ("tie_word_embeddings", Read { probe: "true" }),
    ("head_dim", Irrelevant("transformers sets it to qk_rope_head_dim")),
    ("qk_head_dim", Irrelevant("transformers sets it to qk_nope_head_dim + qk_rope_head_dim")),
    // The MTP depth (2 and more refused); `read_config` keeps it only when the weights hold
    // the layer, since transformers 5 writes 1 without it.
    ("num_nextn_predict_layers", Read { probe: "1" }),
    ("num_mtp_layers", Read { probe: "1" }),
    ("q_lora_rank", Read { probe: "8" }),
    ("kv_lora_rank", Read { probe: "8" }),
    ("qk_nope_head_dim", Read { probe: "64" }),
    ("qk_rope_head_dim", Read { probe: "32" }),
    ("v_head_dim", Read { probe: "64" }),
    ("rope_interleave", Read { probe: "false" }),
    ("n_routed_experts", Read { probe: "12" }),
    ("num_local_experts", Read { probe: "12" }),
    ("n_shared_experts", Read { probe: "2" }),
    ("num_experts_per_tok", Read { probe: "4" }),
    ("moe_intermediate_size", Read { probe: "40" }),
    ("first_k_dense_replace", Read { probe: "1" }),
    ("norm_topk_prob", Read { probe: "false" }),
    ("routed_scaling_factor", Read { probe: "1.5" }),
    ("n_group", Read { probe: "4" }),
    ("topk_group", Read { probe: "2" }),
    ("scoring_func", Refused {
        bad: "\"softmax\"",
        reason: "deepseek_v3's router is sigmoid",
    }),
    ("moe_layer_freq", Refused {
        bad: "2",
        reason: "MoE layers only after a leading run of dense ones",
    }),
    ("ep_size", Irrelevant("DeepSeek's own expert-parallel degree; transformers' forward does not read it")),
    ("aux_loss_alpha", Irrelevant("DeepSeek's own training loss weight; transformers' forward does not read it")),
    ("seq_aux", Irrelevant("DeepSeek's own training loss switch; transformers' forward does not read it")),
    ("rope_scaling", Read {
        probe: "{\"type\": \"yarn\", \"factor\": 40.0, \"original_max_position_embeddings\": 4096, \
                \"beta_fast\": 16.0, \"beta_slow\": 1.0, \"mscale\": 1.0, \"mscale_all_dim\": 0.8}",
    }),
    ("rope_parameters", Read {
        probe: "{\"rope_type\": \"yarn\", \"rope_theta\": 10000.0, \"factor\": 40.0, \
                \"original_max_position_embeddings\": 4096, \"beta_fast\": 16.0, \
                \"beta_slow\": 1.0, \"mscale\": 1.0, \"mscale_all_dim\": 1.0}",
    }),
];

const DEFAULTS: &[super::defaults::ClassDefault] = defaults!(
    ("129280", "7168", "18432", "61", "128"),
    ["q_lora_rank"] => "1536",
    ["kv_lora_rank"] => "512",
    ["qk_nope_head_dim"] => "128",
    ["qk_rope_head_dim"] => "64",
    ["v_head_dim"] => "128",
    ["rope_interleave"] => "true",
    ["n_routed_experts", "num_local_experts"] => "256",
    ["n_shared_experts"] => "1",
    ["num_experts_per_tok"] => "8",
    ["moe_intermediate_size"] => "2048",
    ["first_k_dense_replace"] => "3",
    ["norm_topk_prob"] => "true",
    ["routed_scaling_factor"] => "2.5",
    ["n_group"] => "8",
    ["topk_group"] => "4",
    ["max_position_embeddings"] => "4096",
);

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = common_config(k)?;
    deepseek_v3(k, &mut cfg)?;
    Ok(cfg)
}

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
    let qk_rope_head_dim = k.usize("qk_rope_head_dim")?;
    cfg.head_dim = qk_rope_head_dim;
    cfg.mla = Some(MlaSettings {
        // `null`: queries in one projection, `q_proj` (0, as MaxText writes it).
        q_lora_rank: k.usize_or("q_lora_rank", 0)?,
        kv_lora_rank: k.usize("kv_lora_rank")?,
        qk_nope_head_dim: k.usize("qk_nope_head_dim")?,
        qk_rope_head_dim,
        v_head_dim: k.usize("v_head_dim")?,
        rope_interleave: k.bool_or("rope_interleave", true)?, // Not `rms_norm_eps`: transformers builds the latent norms with RMSNorm's default.
        latent_norm_eps: MLA_LATENT_NORM_EPS,
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
            ..GroupLimit::default()
        },
        routed_bias: true,
        ..MoeSettings::default()
    });
    Ok(())
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    if cfg.mla.is_none() {
        out.push("GQA attention (deepseek_v3 has MLA)".into());
    }
    match &cfg.moe {
        None => out.push("MLA without MoE layers (deepseek_v3 has MoE)".into()),
        Some(m) if m.score != RouterScore::Sigmoid => {
            out.push("a softmax router with MLA (deepseek_v3 uses sigmoid)".into())
        }
        Some(_) => {}
    }
    no_llama3(cfg, "deepseek_v3", &mut out);
    latent_eps_misfit(cfg, "deepseek_v3", &mut out);
    if cfg.rope_scaling.is_some() {
        out.push("linear or dynamic RoPE (deepseek_v3 reads YaRN)".into());
    }
    block_misfit(cfg, "deepseek_v3", &[], &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    match (&cfg.moe, &cfg.mla) {
        (Some(m), Some(a)) => deepseek_v3_extra(cfg, m, a),
        _ => json!({}),
    }
}

fn deepseek_v3_extra(cfg: &Config, m: &MoeSettings, a: &MlaSettings) -> Value {
    let rope_scaling = deepseek_yarn_json(cfg);
    let max_pos = cfg.rope_yarn.as_ref().map_or(4096, |y| {
        (y.original_max_position as f64 * y.factor as f64) as usize
    });
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": false,
        "max_position_embeddings": max_pos,
        "rope_scaling": rope_scaling,
        "q_lora_rank": (a.q_lora_rank > 0).then_some(a.q_lora_rank),
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

/// Each router's selection bias `mlp.gate.e_score_correction_bias` (`[n_routed_experts]`), which
/// `DeepseekV3TopkRouter` adds to the sigmoid scores to pick the top-k experts (`noaux_tc`) and
/// its checkpoints carry, after the router `info`. A model with `routed_bias` declares it among
/// `all` (then it is written as that parameter, and this returns `None`); one without has no
/// such bias, and it is written as zeros, under which both routers pick the same experts.
fn selection_bias(info: &ParamInfo, all: &[ParamInfo]) -> Option<(String, Vec<usize>)> {
    let (name, shape) = info.hf_tensors().into_iter().next()?;
    let layer = name.strip_suffix(ROUTER)?;
    let experts = *shape.first()?;
    let bias = format!("{layer}{SELECTION_BIAS}");
    let declared = all
        .iter()
        .any(|p| p.hf_tensors().iter().any(|(n, _)| *n == bias));
    (!declared).then(|| (bias, vec![experts]))
}
