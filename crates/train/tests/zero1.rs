//! ZeRO-1 (`shard_optimizer_over_data`): the same weights as the replicated optimizer, 1/data of
//! the state per device, one reduce-scatter and one all-gather per parameter in `update`, and
//! the gate × ZeRO-1 table.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions};
use ferrotext_spmd::Ctx;
use ferrotext_train::data::{micro_batch, source_for, TokenSource};
use ferrotext_train::{Deferral, Engine, TrainConfig, TrainError, TrainReport, Zero1};

mod common;

use common::{adamw_weight_bound, max_abs_diff, max_rel_diff, small_config, COMPARABLE_ADAM_EPS};

const BASE: [&str; 3] = [
    "gradient_accumulation_steps=2",
    "learning_rate=0.01",
    "steps=3",
];

fn config(extra: &[&str]) -> TrainConfig {
    let mut all = BASE.to_vec();
    all.extend_from_slice(extra);
    small_config(&all)
}

fn run(extra: &[&str]) -> TrainReport {
    let mut all = BASE.to_vec();
    all.extend_from_slice(extra);
    common::run(&all)
}

/// ZeRO-1's AdamW gives the replicated optimizer's weights (within [`adamw_weight_bound`], for
/// kernels whose bits follow where the buffers lie: [`COMPARABLE_ADAM_EPS`]) and its grad norms.
#[test]
fn zero1_adamw_matches_the_replicated_optimizer() {
    let plain = run(&[COMPARABLE_ADAM_EPS]);
    let zero1 = run(&[COMPARABLE_ADAM_EPS, "shard_optimizer_over_data=true"]);
    let d = max_abs_diff(&zero1, &plain);
    assert!(
        d <= adamw_weight_bound(0.01),
        "max absolute weight difference {d}"
    );
    for (a, b) in zero1.metrics.iter().zip(&plain.metrics) {
        assert!(
            (a.grad_norm - b.grad_norm).abs() <= 1e-6 * b.grad_norm,
            "grad norm {} vs {} (no √N under-count)",
            a.grad_norm,
            b.grad_norm
        );
    }
}

#[test]
fn zero1_collectives_and_state_sizes() {
    zero1_collectives(
        &["shard_optimizer_over_data=true", "grad_bucket_mb=1e-9"],
        None,
    );
    // Default buckets: the whole model in one reduce-scatter and one all-gather.
    zero1_collectives(&["shard_optimizer_over_data=true"], Some(1));
}

/// One ZeRO-1 step: its collectives in update (per parameter, or `buckets` of each kind) and
/// the state each device holds.
fn zero1_collectives(items: &[&str], buckets: Option<usize>) {
    let cfg = config(items);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let out = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, &plan, None)?;
            assert!(
                matches!(e.zero1(), Zero1::Open { replicated } if replicated.is_empty()),
                "{:?}",
                e.zero1()
            );
            for micro in 0..2 {
                cx.comm().push_phase(format!("micro_batch {micro}"));
                let rows = micro_batch(
                    source.as_ref(),
                    0,
                    micro,
                    2,
                    cfg.micro_batch_rows(),
                    cfg.max_target_length,
                );
                let b = e.batch(&cx, &rows)?;
                e.fwd_bwd(&mut cx, &b)?;
                cx.comm().pop_phase();
            }
            cx.comm().push_phase("update");
            e.update(&mut cx)?;
            cx.comm().pop_phase();
            let sizes: Vec<(usize, usize)> = e
                .param_infos()
                .iter()
                .zip(&e.optimizer_state().unwrap()[0])
                .map(|(p, m)| (p.shape.iter().product::<usize>(), m.len()))
                .collect();
            Ok((sizes, e.param_infos().len(), cx.comm().take_trace()))
        },
    )
    .unwrap();
    let (sizes, n_params, trace) = &out[0];
    for (full, local) in sizes {
        assert_eq!(
            full / 4,
            *local,
            "each device holds a quarter of every moment"
        );
    }
    let update = PhasePattern::new("update");
    let per_step = buckets.unwrap_or(*n_params);
    assert_eq!(
        trace.count(CollectiveKind::ReduceScatter, &update),
        per_step,
        "one reduce-scatter per bucket of gradients"
    );
    assert_eq!(
        trace.count(CollectiveKind::AllGather, &update),
        per_step,
        "one all-gather per bucket of parameters"
    );
    // (the gradient norm's all-reduce of per-member slots has one element per device)
    assert!(
        trace.all_reduces_larger_than(8, &update).is_empty(),
        "no full all-reduce in update"
    );
    assert!(trace
        .all_reduces_larger_than(1, &PhasePattern::new("micro_batch*"))
        .is_empty());
}

#[test]
fn gate_and_zero1_table() {
    let z = ["shard_optimizer_over_data=true"];
    // pure DP: both on
    let r = run(&z);
    assert!(r.gate.is_open());
    // auto: both off
    let r = run(&[z[0], "shard_mode=auto"]);
    assert!(matches!(r.gate, Deferral::Closed(_)));
    // data=1: off
    let r = run(&[z[0], "local_devices=1", "per_device_batch_size=4"]);
    assert!(matches!(r.gate, Deferral::Closed(_)));
    // data2×fsdp2: deferral off, ZeRO-1 rejected by the config
    let items: Vec<String> = [z[0], "ici_data_parallelism=2", "ici_fsdp_parallelism=2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let err = TrainConfig::load(None, &items).unwrap_err().to_string();
    assert_eq!(
        err,
        "`shard_optimizer_over_data` (ZeRO-1) cannot be combined with FSDP"
    );
    // data2×tensor2: deferral off, ZeRO-1 on — and the same weights as without it
    let tp = ["ici_data_parallelism=2", "ici_tensor_parallelism=2"];
    let with = run(&[z[0], tp[0], tp[1]]);
    let without = run(&tp);
    assert!(matches!(&with.gate, Deferral::Closed(why) if why.to_string().contains("`tensor`")));
    // Deferral off: gradients were all-reduced in the micro-batches, so `update` slices them
    // locally (no reduce-scatter) and all-gathers the stepped parameters.
    let update = PhasePattern::new("update");
    assert_eq!(with.trace.count(CollectiveKind::ReduceScatter, &update), 0);
    assert!(
        with.trace.count(CollectiveKind::AllGather, &update) > 0,
        "ZeRO-1 active"
    );
    assert!(max_rel_diff(&with, &without) <= 1e-5);
}

/// Engine-level check that a ZeRO-1 run's modes agree: auto vs explicit, both with ZeRO-1 flag.
#[test]
fn zero1_engine_reports_its_decision() {
    let cfg = config(&["shard_optimizer_over_data=true", "shard_mode=auto"]);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let out = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let e = Engine::new(&mut cx, &plan, None)?;
            Ok(e.zero1().describe())
        },
    )
    .unwrap();
    assert!(
        out[0].contains("off: ZeRO-1 needs explicit sharding"),
        "{}",
        out[0]
    );
}
