//! `plan --cluster`'s calibrated compute term: a micro-batch of the planned model, run on one
//! in-process device, gives the throughput the prediction prices compute with. No wall-clock
//! thresholds: the checks are the arithmetic that ties the measurement to the prediction.

use ferrotext_cost::{self as cost, effective_gflops, measure_micro_batch, CostError};
use ferrotext_train::TrainConfig;

/// A small, fast qwen3 (d 32, 2 layers, 4/2 heads of 8, MLP 64) on 16-token synthetic
/// sequences, one per device per micro-batch — plus `extra` overrides.
fn small_config(extra: &[&str]) -> TrainConfig {
    let small = [
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
    let all: Vec<String> = small.iter().chain(extra).map(|s| s.to_string()).collect();
    TrainConfig::load(None, &all).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_measured_micro_batch_predicts_its_own_time() {
    let cfg = small_config(&["ici_data_parallelism=4", "gradient_accumulation_steps=2"]);
    let m = measure_micro_batch(&cfg, 1, 2, 1, 3).expect("measures");
    // small_config: one 16-token sequence per device per micro-batch; two devices side by side.
    assert_eq!(
        (m.tokens, m.threads, m.concurrent, m.warmup, m.timed),
        (16, 1, 2, 1, 3)
    );
    assert!(m.seconds > 0.0);
    let plan = cfg.plan().expect("plans");
    assert_eq!(m.flops_per_token, plan.decoder().flops_per_token(16));
    let g = effective_gflops(m.flops_per_token, 16.0, m.seconds).expect("positive");
    assert_eq!(m.gflops, g);
    let cluster: cost::ClusterSpec = "hosts=2,devices_per_host=2,link=1gbit,10us"
        .parse()
        .expect("a cluster");
    let p = cost::predict(&cfg, &cluster, m.gflops).expect("predicts");
    let want = m.seconds * 1e3;
    assert!(
        (p.compute_ms_per_micro_batch - want).abs() <= 1e-9 * want,
        "{} vs {want}",
        p.compute_ms_per_micro_batch
    );
}

#[test]
fn no_timed_micro_batch_is_an_error() {
    let cfg: TrainConfig = small_config(&[]);
    let err = measure_micro_batch(&cfg, 1, 1, 1, 0).expect_err("nothing timed");
    assert!(matches!(err, CostError::NothingTimed), "{err}");
    assert!(err.is_usage());
}
