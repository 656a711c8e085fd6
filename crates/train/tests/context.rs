//! `ici_context_parallelism`: one sequence split over 4 devices trains the losses of the
//! one-device run (within 1e-6), in order and load-balanced, plain and packed; the trace has
//! the keys' gathers and their cotangents' reduce-scatters inside the micro-batches and no
//! gradient all-reduce there (the weights' gradients stay partial sums over `context` until the
//! update: one reduction a step); and the sizes that do not split are refused by name.

mod common;
use common::small_config;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_train::{train, RunOptions, TrainReport};

fn run(extra: &[&str]) -> TrainReport {
    let mut all = vec![
        "steps=3",
        "gradient_accumulation_steps=2",
        "max_target_length=32",
    ];
    all.extend_from_slice(extra);
    train(&small_config(&all), &RunOptions::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn losses(r: &TrainReport) -> Vec<f64> {
    r.metrics.iter().map(|m| m.loss).collect()
}

const FOUR: [&str; 4] = [
    "local_devices=4",
    "ici_context_parallelism=4",
    "ici_data_parallelism=1",
    "per_device_batch_size=0.25",
];
const ONE: [&str; 3] = [
    "local_devices=1",
    "ici_data_parallelism=1",
    "per_device_batch_size=1",
];

#[test]
fn four_way_context_trains_the_one_device_losses() {
    let one = run(&ONE);
    for balance in ["true", "false"] {
        let key = format!("context_parallel_load_balance={balance}");
        let mut four = FOUR.to_vec();
        four.push(&key);
        let split = run(&four);
        for (a, b) in losses(&split).iter().zip(losses(&one)) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "balance={balance}: {a} vs {b}"
            );
        }
        let micro = PhasePattern::new("micro_batch*");
        let t = &split.trace;
        assert!(
            t.count(CollectiveKind::AllGather, &micro) > 0,
            "the keys' gathers"
        );
        assert!(
            t.count(CollectiveKind::ReduceScatter, &micro) > 0,
            "their cotangents'"
        );
        // Deferred over `context`: no weight gradient is reduced inside a micro-batch (only
        // the loss's one-element all-reduce), and the update reduces them.
        assert!(
            t.all_reduces_larger_than(1, &micro).is_empty(),
            "balance={balance}"
        );
        let update = PhasePattern::new("update*");
        assert!(!t.all_reduces_larger_than(1, &update).is_empty());
    }
}

/// The mirror of the deferral probe: in auto mode (no tags) the same split all-reduces its
/// weights' gradients inside every micro-batch.
#[test]
fn untagged_context_reduces_gradients_every_micro_batch() {
    let mut four = FOUR.to_vec();
    four.push("shard_mode=auto");
    let split = run(&four);
    let micro = PhasePattern::new("micro_batch*");
    assert!(!split.trace.all_reduces_larger_than(1, &micro).is_empty());
}

#[test]
fn sizes_that_do_not_split_are_refused_by_name() {
    let load = |extra: &[&str]| {
        let mut all: Vec<String> = common::SMALL.iter().map(|s| s.to_string()).collect();
        all.extend(FOUR.iter().chain(extra).map(|s| s.to_string()));
        ferrotext_train::TrainConfig::load(None, &all).and_then(|c| c.plan().map(|_| ()))
    };
    let refused = |extra: &[&str]| {
        let err = load(extra).unwrap_err();
        assert!(err.is_usage(), "{err}");
        err.to_string()
    };
    // 8 chunks of 36 do not exist; 4 do (load balancing off).
    let msg = refused(&["max_target_length=36"]);
    assert!(msg.starts_with("ici_context_parallelism"), "{msg}");
    assert!(msg.contains("8 equal chunks"), "{msg}");
    assert!(load(&[
        "max_target_length=36",
        "context_parallel_load_balance=false"
    ])
    .is_ok());
    let msg = refused(&["num_experts=4", "num_experts_per_tok=2", "moe_mlp_dim=8"]);
    assert!(msg.contains("MoE"), "{msg}");
}
