//! `plan --cluster`'s calibrated compute term: a micro-batch of the planned model, run on one
//! in-process device, gives the throughput the prediction prices compute with. No wall-clock
//! thresholds: the checks are the arithmetic that ties the measurement to the prediction.

use ferrotext_train::cost::{self, effective_gflops, measure_micro_batch};
use ferrotext_train::{TrainConfig, TrainError};
mod common;

use common::small_config;

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
    assert!(matches!(err, TrainError::Config(_)), "{err}");
}
