use super::*;
use crate::moe::RouterScore;

fn tiny_moe_mla() -> Config {
    let mut c = Config::preset("qwen3-tiny").unwrap();
    c.base_num_decoder_layers = 2;
    c.logits_via_embedding = false;
    c.qk_norm = false;
    c.mla = Some(MlaSettings {
        q_lora_rank: 6,
        kv_lora_rank: 4,
        qk_nope_head_dim: 4,
        qk_rope_head_dim: 2,
        v_head_dim: 3,
        rope_interleave: true,
    });
    c.moe = Some(MoeSettings {
        num_experts: 3,
        num_experts_per_tok: 2,
        moe_mlp_dim: 5,
        shared_experts: 1,
        first_num_dense_layers: 1,
        score: RouterScore::Sigmoid,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
        load_balance_loss_weight: 0.0,
        groups: GroupLimit::default(),
        routed_bias: false,
        withhold_tags: false,
        ..MoeSettings::default()
    });
    c
}

/// Regression (issue 13): the message had a run of stray spaces from a broken line.
#[test]
fn moe_range_error_reads_as_one_sentence() {
    let mut c = tiny_moe_mla();
    if let Some(m) = c.moe.as_mut() {
        m.num_experts_per_tok = 5;
    }
    let err = Decoder::new(c).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid model config: MoE needs experts, a positive moe_mlp_dim and 1 ≤ \
         num_experts_per_tok ≤ num_experts; got 3 experts, top-5, width 5"
    );
}

/// A key/value head count that does not divide the query heads is refused where attention
/// groups heads by it, and not for MLA, which never reads it (transformers' DeepSeek-V3
/// class defaults it to 128 whatever the head count).
#[test]
fn the_kv_head_count_is_checked_only_where_attention_reads_it() {
    let mut mla = tiny_moe_mla();
    mla.base_num_kv_heads = mla.base_num_query_heads * 32 + 1;
    let weights = |c: &Config| Decoder::new(c.clone()).map(|d| d.params().len());
    let mut same = mla.clone();
    same.base_num_kv_heads = same.base_num_query_heads;
    assert_eq!(weights(&mla), weights(&same));
    assert!(weights(&mla).is_ok());
    let mut dense = mla.clone();
    dense.mla = None;
    dense.moe = None;
    let err = Decoder::new(dense).unwrap_err().to_string();
    assert!(
        err.contains("must be a multiple of base_num_kv_heads"),
        "{err}"
    );
}

/// The flat order is the one the trainer has always used (written out by hand here).
#[test]
fn params_come_in_the_historical_order() {
    let names: Vec<String> = Decoder::new(tiny_moe_mla())
        .unwrap()
        .params()
        .into_iter()
        .map(|p| p.name)
        .collect();
    let mut want = vec!["model.embed_tokens.weight".to_string()];
    for i in 0..2 {
        let l = |s: &str| format!("model.layers.{i}.{s}");
        want.push(l("input_layernorm.weight"));
        for s in [
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        ] {
            want.push(l(&format!("self_attn.{s}.weight")));
        }
        want.push(l("post_attention_layernorm.weight"));
        if i == 0 {
            for s in ["gate_proj", "up_proj", "down_proj"] {
                want.push(l(&format!("mlp.{s}.weight")));
            }
        } else {
            want.push(l("mlp.gate.weight"));
            for s in ["gate_proj", "up_proj", "down_proj"] {
                want.push(l(&format!("mlp.experts.{s}")));
            }
            for s in ["gate_proj", "up_proj", "down_proj"] {
                want.push(l(&format!("mlp.shared_expert.{s}.weight")));
            }
        }
    }
    want.push("model.norm.weight".into());
    want.push("lm_head.weight".into());
    assert_eq!(names, want);
}

/// Every matrix is HF `[out, in]`, including the two the old suffix rule missed, and the
/// stacked experts unstack to one `[out, in]` tensor per expert.
#[test]
fn hf_layouts_declare_orientation_and_unstacked_experts() {
    let d = Decoder::new(tiny_moe_mla()).unwrap();
    let params = d.params();
    let find = |n: &str| params.iter().find(|p| p.name == n).unwrap().hf_tensors();
    assert_eq!(
        find("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"),
        vec![(
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight".to_string(),
            vec![6, 128]
        )]
    );
    assert_eq!(
        find("model.layers.1.mlp.gate.weight"),
        vec![("model.layers.1.mlp.gate.weight".to_string(), vec![3, 128])]
    );
    assert_eq!(
        find("model.layers.1.mlp.experts.down_proj"),
        (0..3)
            .map(|e| (
                format!("model.layers.1.mlp.experts.{e}.down_proj.weight"),
                vec![128, 5]
            ))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        find("model.layers.1.mlp.shared_expert.up_proj.weight")[0].0,
        "model.layers.1.mlp.shared_experts.up_proj.weight"
    );
    assert_eq!(
        find("model.norm.weight"),
        vec![("model.norm.weight".to_string(), vec![128])]
    );
}
