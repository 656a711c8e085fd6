//! `remat_policy`: every policy gives the loss and every gradient of `none` bit for bit (the
//! replay repeats the same arithmetic), on data=2 with the weights tagged `{R:data}` (their
//! gradients per-device partial sums), in f32 and bf16, for a dense Qwen3 (tied and untied) and a
//! DeepSeek-style model (MLA, YaRN, MoE with a load-balance loss: a layer with two outputs). The
//! mirror: a model whose layers differ (another seed) gives other bits, so the comparison can
//! fail.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::decoder::{Config, Decoder, GroupLimit, MoeSettings};
use ferrotext_models::moe::RouterScore;
use ferrotext_models::{init_normal, RematPolicy};
use ferrotext_sharding::{DType, Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Yarn;
mod common;

use common::{tiny_gqa, with_mla};

fn qwen3(tied: bool) -> Config {
    let mut c = tiny_gqa(17, 3);
    c.logits_via_embedding = tied;
    c
}

fn deepseek() -> Config {
    let mut c = with_mla(qwen3(false));
    c.rope_yarn = Some(Yarn {
        factor: 4.0,
        original_max_position: 8,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        attention_factor: 1.0,
    });
    c.moe = Some(MoeSettings {
        num_experts: 4,
        num_experts_per_tok: 2,
        moe_mlp_dim: 6,
        shared_experts: 1,
        first_num_dense_layers: 1,
        score: RouterScore::Sigmoid,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
        load_balance_loss_weight: 0.01,
        groups: GroupLimit::default(),
        routed_bias: false,
        withhold_tags: false,
        ..MoeSettings::default()
    });
    c
}

const B: usize = 4;
const T: usize = 9;

/// Each device's loss bits and its gradients' local bits (partial sums over `data`).
fn run(model: &Decoder, seed: u64) -> Vec<(u32, Vec<Vec<u32>>)> {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let vocab = model.config().vocab_size as u32;
    run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let reduced = PartitionSpec::replicated().with_reduced(["data"]).unwrap();
        let sharding = NamedSharding::new(mesh.clone(), reduced).unwrap();
        let params: Vec<Array> = model
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| cx.from_global(&init_normal(p, seed, i), sharding.clone()))
            .collect::<Result<_, _>>()?;
        let tokens: Vec<u32> = (0..B * T).map(|i| (i as u32 * 7 + 3) % vocab).collect();
        let targets: Vec<u32> = (0..B * T).map(|i| (i as u32 * 5 + 1) % vocab).collect();
        let batch = PartitionSpec::new([Some("data"), None]);
        let ids = cx.ids_from_global(&[B, T], batch.clone(), &tokens)?;
        let tgt = cx.ids_from_global(&[B, T], batch, &targets)?;
        let (loss, grads) =
            cx.value_and_grad(&params, |cx, ps| model.loss_sum(cx, ps, &ids, &tgt))?;
        let bits = |a: &Array| -> Result<Vec<u32>, SpmdError> {
            Ok(a.local()?.data().iter().map(|v| v.to_bits()).collect())
        };
        let grads = grads.iter().map(bits).collect::<Result<_, _>>()?;
        Ok::<_, SpmdError>((loss.scalar()?.to_bits(), grads))
    })
    .unwrap()
}

fn check(cfg: Config, dtype: DType) {
    // A library kernel without a bf16 product (`.ci/kernel-paths`' gemm and OpenBLAS paths)
    // hands bf16 products to ferrotext's own kernel, as `matmul_bf16_fallback=true` does.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let build = |p| {
        Decoder::new(cfg.clone())
            .unwrap()
            .with_compute_dtype(dtype)
            .unwrap()
            .with_remat(p)
    };
    let none = run(&build(RematPolicy::None), 3);
    for policy in RematPolicy::ALL {
        assert_eq!(
            run(&build(policy), 3),
            none,
            "{policy} differs from none ({dtype})"
        );
    }
    // The mirror: other weights, other bits.
    assert_ne!(run(&build(RematPolicy::Full), 4), none);
}

#[test]
fn every_policy_gives_the_bits_of_none_dense_f32_and_bf16() {
    check(qwen3(true), DType::F32);
    check(qwen3(false), DType::BF16);
}

#[test]
fn every_policy_gives_the_bits_of_none_mla_moe() {
    check(deepseek(), DType::F32);
    check(deepseek(), DType::BF16);
}

/// What the backward recomputes, counted by hand for a dense layer (d 16, q 16, kv 8, f 24,
/// 3 layers, vocab 17, at 9 tokens): `full` the seven projections' forward (2 per weight) and
/// the attention's forward products; `minimal` the attention's only; `none` nothing; and a
/// tiled head its logits again.
#[test]
fn recomputed_flops_are_the_unsaved_forward_products() {
    let cfg = qwen3(false);
    let (d, q, kv, f, layers) = (16usize, 16, 8, 24, 3);
    let per_layer = d * q + 2 * d * kv + q * d + 3 * d * f;
    let attention = 2 * layers * 9 * 4 * (4 + 4);
    let flops = |p: RematPolicy, tiles: usize| {
        Decoder::new(cfg.clone())
            .unwrap()
            .with_remat(p)
            .with_vocab_tiling(tiles)
            .recompute_flops_per_token(9)
    };
    assert_eq!(flops(RematPolicy::None, 1), 0.0);
    assert_eq!(
        flops(RematPolicy::Full, 1),
        (2 * layers * per_layer + attention) as f64
    );
    assert_eq!(flops(RematPolicy::Minimal, 1), attention as f64);
    let out_proj_saved = 2 * layers * (per_layer - q * d) + attention;
    assert_eq!(flops(RematPolicy::SaveOutProj, 1), out_proj_saved as f64);
    assert_eq!(flops(RematPolicy::None, 3), (2 * 17 * d) as f64);
}
