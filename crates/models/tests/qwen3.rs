//! The decoder's gradients against central finite differences of its own loss, on tiny configs
//! (Qwen3 tied and untied; DeepSeek-style MLA + YaRN + MoE), single device; the same loss on
//! data=2 and data=1; and the DeepSeek presets' parameter counts against MaxText's.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::decoder::{Config, Decoder, MoeSettings};
use ferrotext_models::init_normal;
use ferrotext_models::moe::RouterScore;
use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;
use ferrotext_tensor::Yarn;
mod common;

fn tiny(tied: bool) -> Decoder {
    Decoder::new(Config {
        vocab_size: 11,
        base_emb_dim: 8,
        base_num_decoder_layers: 2,
        base_num_query_heads: 2,
        base_num_kv_heads: 1,
        head_dim: 4,
        base_mlp_dim: 12,
        logits_via_embedding: tied,
        qk_norm: true,
        z_loss_multiplier: 1e-2,
        ..Config::default()
    })
    .unwrap()
}

const B: usize = 2;
const T: usize = 5;

fn tokens() -> (Vec<u32>, Vec<u32>) {
    let seq: Vec<u32> = (0..B * (T + 1))
        .map(|i| ((i * 7 + 3) % 11) as u32)
        .collect();
    let inputs = (0..B)
        .flat_map(|b| seq[b * (T + 1)..b * (T + 1) + T].to_vec())
        .collect();
    let mut targets: Vec<u32> = (0..B)
        .flat_map(|b| seq[b * (T + 1) + 1..(b + 1) * (T + 1)].to_vec())
        .collect();
    targets[3] = ferrotext_spmd::IGNORE_INDEX; // one ignored token
    (inputs, targets)
}

/// Loss and gradients (reduced to plain) with `values` as parameters, on `devices` devices.
fn loss_and_grads(model: &Decoder, values: &[Tensor], devices: usize) -> (f32, Vec<Tensor>) {
    let mesh = Arc::new(Mesh::explicit([("data", devices)]).unwrap());
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let params: Vec<Array> = values
            .iter()
            .map(|v| {
                cx.from_global(
                    v,
                    NamedSharding::new(mesh.clone(), PartitionSpec::replicated()).unwrap(),
                )
            })
            .collect::<Result<_, _>>()?;
        let (inputs, targets) = tokens();
        let batch = PartitionSpec::new([Some("data"), None]);
        let ids = cx.ids_from_global(&[B, T], batch.clone(), &inputs)?;
        let tgt = cx.ids_from_global(&[B, T], batch, &targets)?;
        let (loss, grads) =
            cx.value_and_grad(&params, |cx, ps| model.loss_sum(cx, ps, &ids, &tgt))?;
        let grads = grads
            .iter()
            .map(|g| cx.to_host(g))
            .collect::<Result<Vec<_>, _>>()?;
        Ok::<_, SpmdError>((loss.scalar()?, grads))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// MLA (low-rank q/kv, decoupled rope dims, interleaved YaRN) and MoE layers (sigmoid router,
/// top-2 of 4, a shared expert) after one dense layer; untied head.
fn tiny_deepseek() -> Decoder {
    let mut cfg = common::with_mla(tiny(false).config().clone());
    cfg.base_num_decoder_layers = 2;
    cfg.rope_yarn = Some(Yarn {
        factor: 4.0,
        original_max_position: 8,
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        attention_factor: 1.0,
    });
    cfg.moe = Some(MoeSettings {
        num_experts: 4,
        num_experts_per_tok: 2,
        moe_mlp_dim: 6,
        shared_experts: 1,
        first_num_dense_layers: 1,
        score: RouterScore::Sigmoid,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
        load_balance_loss_weight: 0.01,
        groups: ferrotext_models::decoder::GroupLimit::default(),
        routed_bias: false,
        withhold_tags: false,
        ..MoeSettings::default()
    });
    Decoder::new(cfg).unwrap()
}

fn check_against_finite_differences(tied: bool) {
    check_model_against_finite_differences(&tiny(tied));
}

fn check_model_against_finite_differences(model: &Decoder) {
    let infos = model.params();
    let values: Vec<Tensor> = infos
        .iter()
        .enumerate()
        .map(|(i, p)| init_normal(p, 3, i))
        .collect();
    let (l0, grads) = loss_and_grads(model, &values, 1);
    for (k, info) in infos.iter().enumerate() {
        let n = values[k].len();
        for e in [0, n / 3, n - 1] {
            // Routing is piecewise constant: a step that crosses a top-k boundary shows as two
            // one-sided slopes that disagree; shrink the step until it does not.
            let mut h = 1e-3f32;
            let fd = loop {
                let mut plus = values.clone();
                let mut minus = values.clone();
                plus[k].data_mut()[e] += h;
                minus[k].data_mut()[e] -= h;
                let up = loss_and_grads(model, &plus, 1).0 - l0;
                let down = l0 - loss_and_grads(model, &minus, 1).0;
                let smooth = (up - down).abs() <= 0.2 * (up.abs() + down.abs()) + 1e-4;
                if smooth || h < 2e-5 {
                    break (up + down) / (2.0 * h);
                }
                h /= 4.0;
            };
            let g = grads[k].data()[e];
            assert!(
                (g - fd).abs() <= 5e-3 + 2e-2 * fd.abs(),
                "{} [{e}]: autodiff {g}, finite difference {fd} (step {h})",
                info.name
            );
        }
    }
}

#[test]
fn gradients_match_finite_differences_tied() {
    check_against_finite_differences(true);
}

#[test]
fn gradients_match_finite_differences_untied() {
    check_against_finite_differences(false);
}

#[test]
fn gradients_match_finite_differences_deepseek_style() {
    check_model_against_finite_differences(&tiny_deepseek());
}

/// Independent baseline: MaxText's counts (its model configs and GA integration test):
/// deepseek3-tiny ~33.7M; the ~1.3B variant 1.518B total, of which 2 × 132.4M untied embeddings.
#[test]
fn deepseek_presets_have_maxtexts_parameter_counts() {
    let tiny = Decoder::new(Config::preset("deepseek3-tiny").unwrap()).unwrap();
    assert!(
        (tiny.param_count() as f64 / 33.7e6 - 1.0).abs() < 0.002,
        "{}",
        tiny.param_count()
    );
    let big = Decoder::new(Config::preset("deepseek3-1.3b").unwrap()).unwrap();
    assert!(
        (big.param_count() as f64 / 1.518e9 - 1.0).abs() < 0.001,
        "{}",
        big.param_count()
    );
    let embeddings = 2 * 129_280 * 1024;
    let non_embedding = (big.param_count() - embeddings) as f64;
    assert!(
        (non_embedding / 1.253e9 - 1.0).abs() < 0.001,
        "{non_embedding}"
    );
}

#[test]
fn data2_equals_data1() {
    let model = tiny(true);
    let values: Vec<Tensor> = model
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| init_normal(p, 5, i))
        .collect();
    let (l1, g1) = loss_and_grads(&model, &values, 1);
    let (l2, g2) = loss_and_grads(&model, &values, 2);
    assert!((l1 - l2).abs() <= 1e-5 * l1.abs());
    for (a, b) in g1.iter().zip(&g2) {
        for (x, y) in a.data().iter().zip(b.data()) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()));
        }
    }
}
