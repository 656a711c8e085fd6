//! `num_vocab_tiling`: the loss and every gradient computed over tiles of the tokens equal the
//! untiled head's within 1e-6 (relative to the largest value; f32), on data=2 with the weights
//! tagged `{R:data}`, tied and untied, for tile counts that divide the tokens and that do not;
//! in bf16 within bf16's resolution (the tiled head keeps its weight gradient in f32). The
//! tiled op really runs: the cross-entropy kernel runs once per tile forward and again per tile
//! backward, against once for the untiled head (the mirror).

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::decoder::{Config, Decoder};
use ferrotext_models::init_normal;
use ferrotext_sharding::{DType, Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
mod common;

use common::tiny_gqa;

fn config(tied: bool) -> Config {
    let mut c = tiny_gqa(97, 2);
    c.logits_via_embedding = tied;
    c.z_loss_multiplier = 1e-3;
    c
}

const B: usize = 4;
const T: usize = 11;

/// Device 0's loss and its gradients' local values, and how many cross-entropy kernels ran.
fn run(model: &Decoder) -> (f32, Vec<Vec<f32>>, usize) {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let vocab = model.config().vocab_size as u32;
    ferrotext_profile::enable();
    let mut out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let reduced = PartitionSpec::replicated().with_reduced(["data"]).unwrap();
        let sharding = NamedSharding::new(mesh.clone(), reduced).unwrap();
        let params: Vec<Array> = model
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| cx.from_global(&init_normal(p, 5, i), sharding.clone()))
            .collect::<Result<_, _>>()?;
        let tokens: Vec<u32> = (0..B * T).map(|i| (i as u32 * 7 + 3) % vocab).collect();
        let mut targets: Vec<u32> = (0..B * T).map(|i| (i as u32 * 5 + 1) % vocab).collect();
        targets[4] = ferrotext_spmd::IGNORE_INDEX;
        let batch = PartitionSpec::new([Some("data"), None]);
        let ids = cx.ids_from_global(&[B, T], batch.clone(), &tokens)?;
        let tgt = cx.ids_from_global(&[B, T], batch, &targets)?;
        ferrotext_profile::begin_thread(dev_index(&cx));
        ferrotext_profile::set_step(Some(0));
        let (loss, grads) =
            cx.value_and_grad(&params, |cx, ps| model.loss_sum(cx, ps, &ids, &tgt))?;
        let kernels = ferrotext_profile::end_thread()
            .iter()
            .filter(|e| e.kind == "cross_entropy")
            .count();
        let grads = grads
            .iter()
            .map(|g| Ok(g.local()?.data().to_vec()))
            .collect::<Result<_, SpmdError>>()?;
        Ok::<_, SpmdError>((loss.scalar()?, grads, kernels))
    })
    .unwrap();
    out.swap_remove(0)
}

fn dev_index(cx: &Ctx<'_>) -> usize {
    cx.device()
}

fn close(a: &[f32], b: &[f32], rel: f32, what: &str) {
    let scale = b.iter().fold(1e-30f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= rel * scale,
        "{what}: {worst:e} apart, largest {scale:e}"
    );
}

fn check(tied: bool, dtype: DType, rel: f32) {
    check_config(config(tied), dtype, rel);
}

fn check_config(cfg: Config, dtype: DType, rel: f32) {
    // A library kernel without a bf16 product (`.ci/kernel-paths`' gemm and OpenBLAS paths)
    // hands bf16 products to ferrotext's own kernel, as `matmul_bf16_fallback=true` does.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let tied = cfg.logits_via_embedding;
    let build = |tiles| {
        Decoder::new(cfg.clone())
            .unwrap()
            .with_compute_dtype(dtype)
            .unwrap()
            .with_vocab_tiling(tiles)
    };
    let (loss, grads, kernels) = run(&build(1));
    assert_eq!(kernels, 1, "the untiled head runs the kernel once");
    // 22 rows a device: 2 and 11 divide them, 4 and 5 do not.
    for tiles in [2, 4, 5, 11] {
        let (l, g, k) = run(&build(tiles));
        let at = format!("tied {tied}, {dtype}, {tiles} tiles");
        close(&[l], &[loss], rel, &format!("{at}: loss"));
        for (i, (a, b)) in g.iter().zip(&grads).enumerate() {
            close(a, b, rel, &format!("{at}: gradient {i}"));
        }
        assert_eq!(
            k,
            2 * tiles,
            "{at}: the kernel once per tile, forward and backward"
        );
    }
}

#[test]
fn tiles_give_the_untiled_loss_and_gradients_within_1e_6() {
    check(true, DType::F32, 1e-6);
    check(false, DType::F32, 1e-6);
}

#[test]
fn tiles_give_the_untiled_loss_and_gradients_in_bf16() {
    check(true, DType::BF16, 1e-2);
    check(false, DType::BF16, 1e-2);
}

/// Gemma 2's final-logit soft-cap is applied to each tile's logits (and its derivative to
/// their cotangent) as to the untiled logits: the same loss, and gradients within 3e-5 of the
/// largest (the products over tiles round in another order, as above; under this strong cap
/// the gradients are sums of terms that mostly cancel, so their rounding is large beside them:
/// the worst measured is 3.8e-6 on MKL and 1.03e-5 on OpenBLAS's Haswell kernel; a skipped cap
/// or a wrong derivative is off by O(1)). The mirror: the cap (small on purpose) moves the loss by 7.5e-4 relative, far past the 1e-6 a
/// tiled head that skipped it would have to hide in.
#[test]
fn tiles_keep_the_final_logit_softcap() {
    let capped = |tied| Config {
        final_logit_softcapping: Some(0.05),
        ..config(tied)
    };
    check_config(capped(true), DType::F32, 3e-5);
    check_config(capped(false), DType::F32, 3e-5);
    check_config(capped(false), DType::BF16, 1e-2);
    let loss = |cfg: Config| run(&Decoder::new(cfg).unwrap()).0;
    let (with, without) = (loss(capped(true)), loss(config(true)));
    assert!(
        (with - without).abs() > 1e-4 * without.abs(),
        "{with} vs {without}"
    );
}
