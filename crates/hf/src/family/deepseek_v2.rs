//! `deepseek_v2` (`DeepseekV2ForCausalLM`, DeepSeek-V2 and V2-Lite): multi-head latent attention
//! (queries through a latent, or in one `q_proj` with `q_lora_rank: null` as in V2-Lite), RoPE on
//! interleaved pairs (its complex-number rotation), a softmax router whose top-k weights are
//! scaled by `routed_scaling_factor` and never renormalised (`norm_topk_prob` is not read by its
//! router), `greedy` top-k or `group_limited_greedy` (groups scored by their best expert),
//! shared experts, the first `first_k_dense_replace` layers dense; YaRN as DeepSeek-V3 reads it.
//!
//! Refused: other `topk_method`s, biases, the router's loss through `output_router_logits`.

use ferrotext_models::decoder::{Config, GroupLimit, MoeSettings};
use ferrotext_models::deepseek::MlaSettings;
use ferrotext_models::moe::RouterScore;
use ferrotext_models::router::GroupScore;
use serde_json::{json, Value};

use super::common::{
    block_misfit, common_config, deepseek_yarn_json, latent_eps_misfit, no_llama3, no_mtp,
    MLA_LATENT_NORM_EPS,
};
use super::reader::num;
use super::table::{DECODER, GENERIC};
use super::{no_extra_tensor, same_rope_view, Family, KeyUse, Keys, Preset};
use crate::ROUTER;
use KeyUse::{Irrelevant, Read, Refused};

/// The family.
pub(super) const FAMILY: Family = Family {
    model_type: "deepseek_v2",
    keys: &[KEYS, DECODER, GENERIC],
    defaults: DEFAULTS,
    rope_types: &["yarn"],
    deepseek_yarn: true,
    rope_view: same_rope_view,
    read,
    misfit,
    write,
    extra_tensor: no_extra_tensor,
    rename: super::no_rename,
    presets: PRESETS,
    kept_f32: &[ROUTER],
};

/// DeepSeek-V2-Lite's shape (queries without a latent, 64 experts top-6, YaRN 40×), and the
/// same blocks at CPU size.
const PRESETS: &[Preset] = &[
    Preset {
        name: "deepseek2-lite",
        about: "DeepSeek-V2-Lite's config.json",
        config: r#"{"vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": null, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": false, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        "tie_word_embeddings": false}"#,
    },
    Preset {
        name: "deepseek2-tiny",
        about: "CPU-sized (byte vocabulary): MLA without the query latent, 8 experts top-2 and a shared one, the first layer dense",
        config: r#"{"vocab_size": 256, "hidden_size": 128, "intermediate_size": 384,
        "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "q_lora_rank": null, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "topk_method": "greedy", "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "tie_word_embeddings": false}"#,
    },
];

const KEYS: &[(&str, KeyUse)] = &[
    ("tie_word_embeddings", Read { probe: "true" }),
    ("head_dim", Irrelevant("transformers sets it to qk_rope_head_dim")),
    ("qk_head_dim", Irrelevant("transformers sets it to qk_nope_head_dim + qk_rope_head_dim")),
    ("q_lora_rank", Read { probe: "8" }),
    ("kv_lora_rank", Read { probe: "8" }),
    ("qk_nope_head_dim", Read { probe: "64" }),
    ("qk_rope_head_dim", Read { probe: "32" }),
    ("v_head_dim", Read { probe: "64" }),
    ("n_routed_experts", Read { probe: "12" }),
    ("num_experts", Read { probe: "12" }),
    ("n_shared_experts", Read { probe: "2" }),
    ("num_experts_per_tok", Read { probe: "4" }),
    ("moe_intermediate_size", Read { probe: "40" }),
    ("first_k_dense_replace", Read { probe: "0" }),
    ("routed_scaling_factor", Read { probe: "1.5" }),
    ("topk_method", Read { probe: "\"group_limited_greedy\"" }),
    ("n_group", Irrelevant("read only with topk_method group_limited_greedy")),
    ("topk_group", Irrelevant("read only with topk_method group_limited_greedy")),
    (
        "norm_topk_prob",
        Irrelevant("DeepseekV2's router never renormalises its top-k weights (either generation)"),
    ),
    (
        "mlp_bias",
        Refused {
            bad: "true",
            reason: "MLP biases are not built for MLA families",
        },
    ),
    ("aux_loss_alpha", Irrelevant("DeepSeek's own training loss weight; the forward does not read it")),
    ("seq_aux", Irrelevant("DeepSeek's own training loss switch; the forward does not read it")),
    (
        "rope_scaling",
        Read {
            probe: "{\"type\": \"yarn\", \"factor\": 16.0, \"original_max_position_embeddings\": 256, \
                \"beta_fast\": 32.0, \"beta_slow\": 1.0, \"mscale\": 0.707, \"mscale_all_dim\": 0.707}",
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
    (&["hidden_size"], "4096"),
    (&["intermediate_size"], "11008"),
    (&["num_hidden_layers"], "32"),
    (&["num_attention_heads"], "32"),
    (&["rms_norm_eps"], "1e-6"),
    (&["tie_word_embeddings"], "false"),
    (&["q_lora_rank"], "1536"),
    (&["kv_lora_rank"], "512"),
    (&["qk_nope_head_dim"], "128"),
    (&["qk_rope_head_dim"], "64"),
    (&["v_head_dim"], "128"),
    (&["n_routed_experts", "num_experts"], "64"),
    (&["n_shared_experts"], "2"),
    (&["moe_intermediate_size"], "1407"),
    (&["first_k_dense_replace"], "0"),
    (&["routed_scaling_factor"], "1.0"),
    (&["topk_method"], "\"greedy\""),
];

fn read(k: &mut Keys<'_>) -> Result<Config, String> {
    let mut cfg = common_config(k)?;
    let qk_rope_head_dim = k.usize("qk_rope_head_dim")?;
    cfg.head_dim = qk_rope_head_dim;
    cfg.mla = Some(MlaSettings {
        // `null`: queries in one projection, `q_proj` (0, as MaxText writes it).
        q_lora_rank: k.usize_or("q_lora_rank", 0)?,
        kv_lora_rank: k.usize("kv_lora_rank")?,
        qk_nope_head_dim: k.usize("qk_nope_head_dim")?,
        qk_rope_head_dim,
        v_head_dim: k.usize("v_head_dim")?,
        rope_interleave: true, // Not `rms_norm_eps`: transformers builds the latent norms with RMSNorm's default.
        latent_norm_eps: MLA_LATENT_NORM_EPS,
    });
    let groups = match k.get("topk_method").and_then(Value::as_str) {
        None | Some("greedy") => GroupLimit::default(),
        Some("group_limited_greedy") => GroupLimit {
            n_routing_groups: k.usize("n_group")?,
            topk_routing_group: k.usize("topk_group")?,
            score: GroupScore::Max,
        },
        Some(other) => {
            k.unsupported.push(format!(
                "topk_method=\"{other}\" (deepseek_v2 routes greedy or group_limited_greedy)"
            ));
            GroupLimit::default()
        }
    };
    cfg.moe = Some(MoeSettings {
        num_experts: k.usize_alias("n_routed_experts", "num_experts")?,
        num_experts_per_tok: k.usize("num_experts_per_tok")?,
        moe_mlp_dim: k.usize("moe_intermediate_size")?,
        shared_experts: k.usize_or("n_shared_experts", 0)?,
        first_num_dense_layers: k.usize_or("first_k_dense_replace", 0)?,
        score: RouterScore::Softmax,
        norm_topk_prob: false,
        routed_scaling_factor: k.positive_or("routed_scaling_factor", 1.0)?,
        groups,
        ..MoeSettings::default()
    });
    Ok(cfg)
}

fn misfit(cfg: &Config) -> Vec<String> {
    let mut out = Vec::new();
    match &cfg.mla {
        None => out.push("GQA attention (deepseek_v2 has MLA)".into()),
        Some(a) if !a.rope_interleave => {
            out.push("rotate-half RoPE pairs (deepseek_v2 turns interleaved pairs)".into())
        }
        Some(_) => {}
    }
    match &cfg.moe {
        None => out.push("MLA without MoE layers (deepseek_v2 has MoE)".into()),
        Some(m) => {
            let ours = m.score == RouterScore::Softmax
                && !m.norm_topk_prob
                && !m.routed_bias
                && (!m.groups.is_active() || m.groups.score == GroupScore::Max);
            if !ours {
                out.push(
                    "a router other than softmax top-k, unnormalised, groups by their best \
                     expert (deepseek_v2's)"
                        .into(),
                );
            }
        }
    }
    no_llama3(cfg, "deepseek_v2", &mut out);
    latent_eps_misfit(cfg, "deepseek_v2", &mut out);
    no_mtp(cfg, "deepseek_v2", &mut out);
    if cfg.rope_scaling.is_some() {
        out.push("linear or dynamic RoPE (deepseek_v2 reads YaRN)".into());
    }
    block_misfit(cfg, "deepseek_v2", &[], &mut out);
    out
}

fn write(cfg: &Config) -> Value {
    let (Some(m), Some(a)) = (&cfg.moe, &cfg.mla) else {
        return json!({});
    };
    let rope_scaling = deepseek_yarn_json(cfg);
    let max_pos = cfg.rope_yarn.as_ref().map_or(4096, |y| {
        (y.original_max_position as f64 * f64::from(y.factor)) as usize
    });
    let grouped = m.groups.is_active();
    json!({
        "architectures": ["DeepseekV2ForCausalLM"],
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
        "routed_scaling_factor": num(m.routed_scaling_factor),
        "topk_method": if grouped { "group_limited_greedy" } else { "greedy" },
        "n_group": m.groups.n_routing_groups,
        "topk_group": m.groups.topk_routing_group,
    })
}
