//! Helpers shared by the train integration tests.
#![allow(dead_code)]

pub mod packed;

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
