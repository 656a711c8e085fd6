//! Helpers shared by the train integration tests.
#![allow(dead_code)]

pub mod one_device;
pub mod packed;
pub mod scratch;

use ferrotext_spmd::Ctx;
use ferrotext_train::data::{micro_batch, TokenSource};
use ferrotext_train::{train, Engine, RunOptions, TrainConfig, TrainError, TrainReport};

/// The small model's keys, its batch and its data (synthetic): [`small_config`]'s.
pub const SMALL: [&str; 11] = [
    "vocab_size=256",
    "base_emb_dim=32",
    "base_num_decoder_layers=2",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=8",
    "base_mlp_dim=64",
    "max_target_length=16",
    "per_device_batch_size=1",
    "steps=3",
    "dataset_type=synthetic",
];

/// A small, fast qwen3 (d 32, 2 layers, 4/2 heads of 8, MLP 64) on 16-token synthetic
/// sequences, one per device per micro-batch, 3 steps — plus `extra` overrides.
pub fn small_config(extra: &[&str]) -> TrainConfig {
    let mut all: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    all.extend(extra.iter().map(|s| s.to_string()));
    TrainConfig::load(None, &all).unwrap_or_else(|e| panic!("{e}"))
}

/// A whole run of `small_config(extra)`, returning the final weights too.
pub fn run(extra: &[&str]) -> TrainReport {
    train(
        &small_config(extra),
        &RunOptions {
            return_params: true,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// The AdamW ε for comparing two runs whose products may differ in their last bits (ZeRO-1
/// against the replicated optimizer, on a kernel whose bits follow where the buffers lie, as
/// OpenBLAS's AVX2 kernels do on an AMD EPYC Zen 1). AdamW divides a gradient by its running
/// size plus ε, so a gradient far below ε moves its weight by `learning_rate × g / ε`: with the
/// default ε = 1e-8 a last-bit gradient difference became a 3.5e-5 weight difference. With
/// ε = 1e-3 that factor is 10 rather than 10⁶, while a weight whose gradient is above 1e-3 still
/// moves by about the learning rate each step.
pub const COMPARABLE_ADAM_EPS: &str = "adam_eps=1e-3";

/// The largest weight difference two AdamW runs with [`COMPARABLE_ADAM_EPS`] may show and still
/// be the same computation: a ten-thousandth of the learning rate (OpenBLAS on Zen 1: at most
/// 1.4e-7 at 0.01), where a shard updated wrongly, twice or not at all moves weights by about
/// the learning rate itself. `new_families.rs` checks that a learning rate 1% off exceeds it.
pub fn adamw_weight_bound(learning_rate: f64) -> f64 {
    1e-4 * learning_rate
}

/// Asserts two routes to the same step gave the same weights (`got` and `want`, one vector per
/// parameter): bit for bit where the products' bits follow their operands alone (the portable
/// kernel, `ferrotext_tensor::matmul_order_is_fixed`), and within 1e-6 of each parameter's
/// largest weight elsewhere: a library's bits may also follow where the buffers lie (OpenBLAS's
/// AVX2 kernels on an AMD EPYC Zen 1), which ZeRO-1 and the overlapped reduction move.
/// `.ci/kernel-paths` runs the training tests on the portable kernel too, so the bitwise claim
/// is checked on every CI run.
pub fn assert_same_weights(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    if ferrotext_tensor::matmul_order_is_fixed() {
        assert!(got == want, "{what}: the same bits");
        return;
    }
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = g
            .iter()
            .zip(w)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-6 * scale,
            "{what}: parameter {i} differs by {diff} (largest weight {scale})"
        );
    }
}

/// The largest absolute difference between two runs' weights, over every element of every
/// parameter.
pub fn max_abs_diff(a: &TrainReport, b: &TrainReport) -> f64 {
    let (va, vb) = (a.values.as_ref().unwrap(), b.values.as_ref().unwrap());
    va.iter()
        .zip(vb)
        .flat_map(|(x, y)| x.data().iter().zip(y.data()).map(|(p, q)| (p - q).abs()))
        .fold(0.0f32, f32::max)
        .into()
}

/// The largest per-tensor relative difference `‖a − b‖∞ / ‖b‖∞` of two runs' final weights.
pub fn max_rel_diff(a: &TrainReport, b: &TrainReport) -> f64 {
    let (va, vb) = (a.values.as_ref().unwrap(), b.values.as_ref().unwrap());
    va.iter()
        .zip(vb)
        .map(|(x, y)| {
            let diff = x
                .data()
                .iter()
                .zip(y.data())
                .map(|(p, q)| (p - q).abs())
                .fold(0.0f32, f32::max);
            let scale = y.data().iter().map(|q| q.abs()).fold(0.0f32, f32::max);
            f64::from(diff / scale)
        })
        .fold(0.0, f64::max)
}

/// Feeds micro-batch `micro` of step `step` (the trainer's data order) to `engine`.
pub fn feed(
    cx: &mut Ctx<'_>,
    engine: &mut Engine,
    source: &dyn TokenSource,
    cfg: &TrainConfig,
    step: u64,
    micro: usize,
) -> Result<(), TrainError> {
    let rows = micro_batch(
        source,
        step,
        micro,
        cfg.gradient_accumulation_steps,
        cfg.micro_batch_rows(),
        cfg.max_target_length,
    );
    let batch = engine.batch(cx, &rows)?;
    engine.fwd_bwd(cx, &batch)?;
    Ok(())
}
