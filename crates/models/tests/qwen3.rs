//! The Qwen3 model's gradients against central finite differences of its own loss, on a tiny
//! config, single device; and the same loss on data=2 and data=1.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::init_normal;
use ferrotext_models::qwen3::{Config, Qwen3};
use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;

fn tiny(tied: bool) -> Qwen3 {
    Qwen3::new(Config {
        vocab_size: 11,
        base_emb_dim: 8,
        base_num_decoder_layers: 2,
        base_num_query_heads: 2,
        base_num_kv_heads: 1,
        head_dim: 4,
        base_mlp_dim: 12,
        logits_via_embedding: tied,
        rope_max_timescale: 10_000.0,
        normalization_layer_epsilon: 1e-6,
        z_loss_multiplier: 1e-2,
        moe: None,
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
    targets[3] = u32::MAX; // one ignored token
    (inputs, targets)
}

/// Loss and gradients (reduced to plain) with `values` as parameters, on `devices` devices.
fn loss_and_grads(model: &Qwen3, values: &[Tensor], devices: usize) -> (f32, Vec<Tensor>) {
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

fn check_against_finite_differences(tied: bool) {
    let model = tiny(tied);
    let infos = model.params();
    let values: Vec<Tensor> = infos
        .iter()
        .enumerate()
        .map(|(i, p)| init_normal(p, 3, i))
        .collect();
    let (_, grads) = loss_and_grads(&model, &values, 1);
    let h = 1e-3f32;
    for (k, info) in infos.iter().enumerate() {
        let n = values[k].len();
        for e in [0, n / 3, n - 1] {
            let mut plus = values.clone();
            let mut minus = values.clone();
            plus[k].data_mut()[e] += h;
            minus[k].data_mut()[e] -= h;
            let fd = (loss_and_grads(&model, &plus, 1).0 - loss_and_grads(&model, &minus, 1).0)
                / (2.0 * h);
            let g = grads[k].data()[e];
            assert!(
                (g - fd).abs() <= 5e-3 + 2e-2 * fd.abs(),
                "{} [{e}]: autodiff {g}, finite difference {fd}",
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
