//! The trainer against independent baselines: the collective schedule (and its mirror with the
//! gate closed), deferred vs untagged weights, GA vs one big batch, data=4 vs data=1, the gate
//! on every mesh, a dropped tag, and learning on the bundled corpus.

use ferrotext_comm::{CollectiveKind, PhasePattern};
mod common;

use common::{max_rel_diff, run, small_config as config};
use ferrotext_train::{train, Deferral, RunOptions};

#[test]
fn deferred_step_reduces_gradients_once_per_step() {
    // One bucket per parameter (a bucket smaller than any gradient), then the default 25 MiB
    // buckets: the same bytes, the same weights, one collective per bucket.
    let per_param = run(&["gradient_accumulation_steps=4", "grad_bucket_mb=1e-9"]);
    let bucketed = run(&["gradient_accumulation_steps=4"]);
    let update = PhasePattern::new("update");
    for (r, per_step) in [(&per_param, per_param.params.len()), (&bucketed, 1)] {
        assert_eq!(
            r.gate,
            Deferral::Open {
                axes: vec!["data".to_string()]
            }
        );
        let mb = PhasePattern::new("micro_batch*");
        let big = r.trace.all_reduces_larger_than(1, &mb);
        assert!(big.is_empty(), "all-reduces inside micro-batches: {big:?}");
        assert_eq!(
            r.trace.count(CollectiveKind::AllReduce, &update),
            per_step * 3,
            "one all-reduce per bucket per step"
        );
        let elements: usize = r
            .params
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        assert_eq!(
            r.trace.bytes(CollectiveKind::AllReduce, &update),
            elements * 4 * 3,
            "every gradient reduced once per step"
        );
    }
    assert_eq!(per_param.values, bucketed.values, "bitwise equal weights");
}

#[test]
fn mirror_gate_closed_reduces_in_every_micro_batch() {
    let r = run(&[
        "gradient_accumulation_steps=4",
        "shard_mode=auto",
        "head_dim=16",
    ]);
    assert!(matches!(&r.gate, Deferral::Closed(why) if why.to_string().contains("auto")));
    for micro in 0..4 {
        let phase = PhasePattern::new(format!("micro_batch {micro}"));
        let big = r.trace.all_reduces_larger_than(1, &phase);
        // every parameter's gradient once in every step (the tied embedding too: its lookup
        // and head contributions are summed before the one reduction)
        assert_eq!(big.len(), r.params.len() * 3, "micro-batch {micro}");
        let reduced: usize = big.iter().map(|e| e.elements).sum();
        let all: usize = r
            .params
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum::<usize>();
        assert_eq!(reduced, all * 3);
    }
}

#[test]
fn deferred_and_untagged_sgd_give_the_same_weights() {
    let deferred = run(&[
        "opt_type=sgd",
        "learning_rate=0.5",
        "gradient_clipping_threshold=0",
    ]);
    let untagged = run(&[
        "opt_type=sgd",
        "learning_rate=0.5",
        "gradient_clipping_threshold=0",
        "shard_mode=auto",
    ]);
    assert!(deferred.gate.is_open() && !untagged.gate.is_open());
    let d = max_rel_diff(&deferred, &untagged);
    assert!(d <= 1e-6, "max relative weight difference {d}");
}

#[test]
fn accumulation_equals_one_big_batch() {
    // GA 4 × 4 sequences vs GA 1 × 16 sequences: the same 16 sequences per step.
    let ga = run(&[
        "gradient_accumulation_steps=4",
        "per_device_batch_size=1",
        "opt_type=sgd",
        "learning_rate=0.5",
    ]);
    let big = run(&[
        "gradient_accumulation_steps=1",
        "per_device_batch_size=4",
        "opt_type=sgd",
        "learning_rate=0.5",
    ]);
    for (a, b) in ga.metrics.iter().zip(&big.metrics) {
        assert_eq!(a.tokens, b.tokens);
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * b.loss.abs(),
            "loss {} vs {}",
            a.loss,
            b.loss
        );
        assert!(
            (a.grad_norm - b.grad_norm).abs() <= 1e-5 * b.grad_norm.abs(),
            "grad norm {} vs {}",
            a.grad_norm,
            b.grad_norm
        );
    }
}

#[test]
fn data4_equals_data1_on_the_same_global_batch() {
    let four = run(&[
        "local_devices=4",
        "per_device_batch_size=2",
        "opt_type=sgd",
        "learning_rate=0.5",
    ]);
    let one = run(&[
        "local_devices=1",
        "per_device_batch_size=8",
        "opt_type=sgd",
        "learning_rate=0.5",
    ]);
    assert!(matches!(&one.gate, Deferral::Closed(why) if why.to_string().contains("size 1")));
    for (a, b) in four.metrics.iter().zip(&one.metrics) {
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * b.loss.abs(),
            "loss {} vs {}",
            a.loss,
            b.loss
        );
        assert!((a.grad_norm - b.grad_norm).abs() <= 1e-5 * b.grad_norm.abs());
    }
    assert!(max_rel_diff(&four, &one) <= 1e-4);
}

#[test]
fn gate_closes_on_fsdp_and_tensor_meshes_which_still_train() {
    for mesh in [
        ["ici_data_parallelism=2", "ici_fsdp_parallelism=2"],
        ["ici_data_parallelism=2", "ici_tensor_parallelism=2"],
    ] {
        let mut items = vec!["steps=12", "learning_rate=0.01", "dataset_type=corpus"];
        items.extend(mesh);
        let r = run(&items);
        let axis = if mesh[1].contains("fsdp") {
            "`fsdp`"
        } else {
            "`tensor`"
        };
        assert!(
            matches!(&r.gate, Deferral::Closed(why) if why.to_string().contains(axis)),
            "{:?}",
            r.gate
        );
        let (first, last) = (r.metrics[0].loss, r.metrics.last().unwrap().loss);
        assert!(last < first - 0.3, "{mesh:?}: loss {first} -> {last}");
    }
}

/// Uses the `fault-injection` test hook (on in the README's test command).
#[cfg(feature = "fault-injection")]
#[test]
fn a_dropped_tag_is_caught_not_silently_reduced_early() {
    let cfg = config(&["gradient_accumulation_steps=2"]);
    let name = "model.layers.0.mlp.up_proj.weight".to_string();
    let options = RunOptions {
        inside_spec_override: Some((
            name.clone(),
            ferrotext_sharding::PartitionSpec::new([None::<&str>, None]),
        )),
        ..Default::default()
    };
    let err = train(&cfg, &options).unwrap_err();
    match &err {
        ferrotext_train::TrainError::AccumulatorType {
            param,
            expected,
            got,
            ..
        } => {
            assert_eq!(param, &name);
            assert_eq!(expected, "f32[32,64]{U:data}");
            assert_eq!(got, "f32[32,64]");
        }
        other => panic!("expected an accumulator-type error, got {other}"),
    }
    assert!(err
        .to_string()
        .contains("dropped the parameter's reduced tag"));
}

#[test]
fn loss_falls_on_the_bundled_corpus() {
    // Stated margin: from ln(256) ≈ 5.55 to below 3.0 within 40 steps.
    let r = train(
        &config(&[
            "dataset_type=corpus",
            "steps=40",
            "base_emb_dim=64",
            "base_mlp_dim=128",
            "head_dim=16",
            "max_target_length=32",
            "learning_rate=0.01",
        ]),
        &RunOptions::default(),
    )
    .unwrap();
    let (first, last) = (r.metrics[0].loss, r.metrics.last().unwrap().loss);
    assert!(first > 5.0, "{first}");
    assert!(last < 3.0, "loss {first} -> {last}");
}

#[test]
fn overlapped_reduction_gives_bitwise_the_same_weights_and_starts_in_the_last_micro_batch() {
    // Small buckets, so the reduction has several to overlap; AdamW with clipping engaged and
    // ZeRO-1 (reduce-scatter buckets) as well as plain data parallelism.
    for zero1 in ["false", "true"] {
        let items = |overlap: &str| {
            [
                "gradient_accumulation_steps=4".to_string(),
                "grad_bucket_mb=0.01".into(),
                format!("shard_optimizer_over_data={zero1}"),
                format!("overlap_grad_reduce={overlap}"),
            ]
        };
        let plain_items = items("false");
        let overlap_items = items("true");
        let plain = run(&plain_items.iter().map(String::as_str).collect::<Vec<_>>());
        let overlapped = run(&overlap_items.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(
            plain.values, overlapped.values,
            "zero1={zero1}: bitwise weights"
        );
        let losses = |r: &ferrotext_train::TrainReport| -> Vec<u64> {
            r.metrics.iter().map(|m| m.loss.to_bits()).collect()
        };
        assert_eq!(losses(&plain), losses(&overlapped));
        let kind = if zero1 == "true" {
            CollectiveKind::ReduceScatter
        } else {
            CollectiveKind::AllReduce
        };
        let (last, update) = (
            PhasePattern::new("micro_batch 3"),
            PhasePattern::new("update"),
        );
        // Without overlap the buckets run in update; with it, they are issued during the last
        // micro-batch's backward and update only collects them: the same buckets, the same bytes.
        // Gradient collectives: more than 8 elements (the loss all-reduce has one).
        let big = |r: &ferrotext_train::TrainReport, phase: &PhasePattern| -> (usize, usize) {
            let events: Vec<_> = r
                .trace
                .events()
                .iter()
                .filter(|e| e.kind == kind && e.elements > 8 && phase.matches(&e.phase))
                .collect();
            (events.len(), events.iter().map(|e| e.bytes).sum())
        };
        let (buckets, bytes) = big(&plain, &update);
        assert!(buckets > 3, "several buckets: {buckets}");
        assert_eq!(big(&plain, &last).0, 0);
        assert_eq!(big(&overlapped, &last), (buckets, bytes));
        assert_eq!(big(&overlapped, &update).0, 0);
        // The earlier micro-batches still reduce nothing.
        for micro in 0..3 {
            let phase = PhasePattern::new(format!("micro_batch {micro}"));
            assert!(overlapped
                .trace
                .all_reduces_larger_than(1, &phase)
                .is_empty());
        }
    }
}

#[test]
fn with_the_gate_closed_overlap_reduces_each_micro_batch_in_buckets_during_its_backward() {
    // `shard_mode=auto` closes the gate; with overlap the engine still tags the parameters and
    // reduces each micro-batch's gradients bucket by bucket as its backward finishes them (DDP).
    // The baseline is the untagged run, whose transposed dots all-reduce every gradient alone.
    let common = [
        "gradient_accumulation_steps=4",
        "shard_mode=auto",
        "grad_bucket_mb=0.01",
    ];
    let untagged = run(&common);
    let ddp = run(&[&common[..], &["overlap_grad_reduce=true"]].concat());
    assert!(matches!(&ddp.gate, Deferral::Closed(_)));
    assert_eq!(untagged.values, ddp.values, "bitwise weights");
    let losses = |r: &ferrotext_train::TrainReport| -> Vec<u64> {
        r.metrics.iter().map(|m| m.loss.to_bits()).collect()
    };
    assert_eq!(losses(&untagged), losses(&ddp));
    let all: usize = ddp
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    for micro in 0..4 {
        let phase = PhasePattern::new(format!("micro_batch {micro}"));
        let (per_param, buckets) = (
            untagged.trace.all_reduces_larger_than(1, &phase),
            ddp.trace.all_reduces_larger_than(1, &phase),
        );
        // The same bytes in every micro-batch (3 steps), in fewer, larger collectives.
        let elements =
            |v: &[&ferrotext_comm::TraceEvent]| v.iter().map(|e| e.elements).sum::<usize>();
        assert_eq!(elements(&per_param), all * 3);
        assert_eq!(elements(&buckets), all * 3);
        assert_eq!(per_param.len(), untagged.params.len() * 3);
        assert!(
            buckets.len() > 3 && buckets.len() < per_param.len(),
            "micro-batch {micro}: {} buckets against {} gradients",
            buckets.len(),
            per_param.len()
        );
    }
    // The update reduces nothing more.
    let update = PhasePattern::new("update");
    assert!(ddp.trace.all_reduces_larger_than(8, &update).is_empty());
}
