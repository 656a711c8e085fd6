//! Evaluation on held-out data: when it runs, that it leaves training untouched (bitwise), that
//! it issues no gradient collective (with a mirror where the micro-batches do), that its loss
//! does not depend on the layout, and that a split keeps the two parts apart.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

mod common;

use common::{run, small_config};
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_train::{data, TrainConfig};

#[test]
fn eval_runs_every_interval_and_at_the_last_step_and_changes_nothing() {
    let with = run(&["steps=5", "eval_interval=2", "eval_steps=2"]);
    let without = run(&["steps=5"]);
    let evaluated: Vec<usize> = with
        .metrics
        .iter()
        .filter(|m| m.eval_loss.is_some())
        .map(|m| m.step)
        .collect();
    // After steps 2 and 4 (indices 1, 3) and after the last (index 4).
    assert_eq!(evaluated, [1, 3, 4]);
    for m in &with.metrics {
        if let (Some(l), Some(p)) = (m.eval_loss, m.eval_perplexity) {
            assert!(l.is_finite() && l > 0.0, "{l}");
            assert!((p - l.exp()).abs() <= 1e-9 * p);
        }
    }
    let losses = |r: &ferrotext_train::TrainReport| -> Vec<f64> {
        r.metrics.iter().map(|m| m.loss).collect()
    };
    assert_eq!(
        losses(&with),
        losses(&without),
        "training losses bitwise equal"
    );
    assert_eq!(with.values, without.values, "weights bitwise equal");
}

#[test]
fn eval_issues_no_gradient_collective_even_when_the_micro_batches_do() {
    for extra in [&[][..], &["shard_mode=auto"][..]] {
        let mut args = vec![
            "steps=2",
            "eval_interval=1",
            "gradient_accumulation_steps=2",
        ];
        args.extend_from_slice(extra);
        let r = run(&args);
        let eval = PhasePattern::new("eval");
        let eval_events: Vec<_> = r
            .trace
            .events()
            .iter()
            .filter(|e| e.phase == "eval")
            .collect();
        assert!(
            !eval_events.is_empty(),
            "the eval loss is summed over the batch"
        );
        assert!(
            r.trace.all_reduces_larger_than(1, &eval).is_empty(),
            "{extra:?}: {eval_events:?}"
        );
        assert!(
            eval_events.iter().all(|e| e.elements <= 8),
            "{eval_events:?}"
        );
        if extra.is_empty() {
            // Mirror 1: the deferred step still reduces its gradients, in `update`.
            let update = PhasePattern::new("update");
            assert!(!r.trace.all_reduces_larger_than(1, &update).is_empty());
        } else {
            // Mirror 2: with the gate closed the micro-batches reduce gradients; eval does not.
            let mb = PhasePattern::new("micro_batch*");
            assert!(!r.trace.all_reduces_larger_than(1, &mb).is_empty());
            assert!(r.trace.bytes(CollectiveKind::AllReduce, &mb) > 1000);
        }
    }
}

#[test]
fn the_eval_loss_does_not_depend_on_the_mesh() {
    let four = run(&["steps=2", "eval_interval=1", "eval_steps=2"]);
    let one = run(&[
        "steps=2",
        "eval_interval=1",
        "eval_steps=2",
        "local_devices=1",
        "per_device_batch_size=4",
    ]);
    for (a, b) in four.metrics.iter().zip(&one.metrics) {
        let (x, y) = (a.eval_loss.expect("eval"), b.eval_loss.expect("eval"));
        assert!((x - y).abs() <= 1e-6 * y.abs(), "{x} vs {y}");
    }
}

#[test]
fn a_split_keeps_training_and_evaluation_apart() {
    // 900 bytes of 'a' then 100 of 'b': with eval_split=0.1 training sees only 'a', eval only 'b'.
    let path = std::env::temp_dir().join(format!("ferrotext-split-{}.txt", std::process::id()));
    let mut text = vec![b'a'; 900];
    text.extend(vec![b'b'; 100]);
    std::fs::write(&path, &text).expect("write");
    let config = TrainConfig::load(
        None,
        &[
            "dataset_type=text".to_string(),
            format!("dataset_path={}", path.display()),
            "max_target_length=16".to_string(),
            "eval_split=0.1".to_string(),
            "eval_interval=1".to_string(),
        ],
    )
    .expect("config");
    let train = data::source_for(&config, 256).expect("train source");
    let eval = data::eval_source_for(&config, 256)
        .expect("eval source")
        .expect("eval is on");
    for i in 0..500 {
        assert!(
            train.sequence(i, 17).iter().all(|&t| t == u32::from(b'a')),
            "train {i}"
        );
        assert!(
            eval.sequence(i, 17).iter().all(|&t| t == u32::from(b'b')),
            "eval {i}"
        );
    }
    std::fs::remove_file(&path).ok();
}

#[test]
fn eval_without_held_out_data_and_bad_eval_keys_name_the_key() {
    let err = |args: &[&str]| {
        let all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        TrainConfig::load(None, &all)
            .expect_err("refused")
            .to_string()
    };
    assert!(err(&["eval_interval=5"]).contains("eval_interval needs held-out data"));
    assert!(err(&["eval_split=0.9"]).contains("eval_split must be a fraction in [0, 0.5]"));
    assert!(err(&["eval_steps=0", "eval_split=0.1"]).contains("eval_steps must be at least 1"));
    assert!(err(&["dataset_type=synthetic", "eval_split=0.1"]).contains("synthetic data has none"));
    // The small config's synthetic data needs nothing more.
    let _ = small_config(&["eval_interval=1"]);
}
