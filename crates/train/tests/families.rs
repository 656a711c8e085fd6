//! Llama 3 and Qwen2 in the trainer, with the same typed sharding and deferral as Qwen3: Qwen2's
//! q/k/v biases are parameters whose gradients stay unreduced (`{U:data}`) until the update,
//! like the weights' (one all-reduce per parameter per step, none inside the micro-batches;
//! the mirror with the gate closed reduces them in every micro-batch); deferred and untagged
//! runs give the same weights; tensor parallelism splits the biases with their projections.

use ferrotext_comm::{CollectiveKind, PhasePattern};
mod common;

use common::{max_rel_diff, run};
use ferrotext_train::Deferral;

/// `model_name` with the small model's sizes (the common keys apply on top of the preset).
fn family(model: &str, extra: &[&str]) -> Vec<String> {
    let mut all = vec![format!("model_name={model}")];
    all.extend(extra.iter().map(|s| s.to_string()));
    all
}

fn run_family(model: &str, extra: &[&str]) -> ferrotext_train::TrainReport {
    let items = family(model, extra);
    let refs: Vec<&str> = items.iter().map(String::as_str).collect();
    run(&refs)
}

const BIASES: [&str; 3] = ["q_proj.bias", "k_proj.bias", "v_proj.bias"];

#[test]
fn qwen2_biases_are_parameters_reduced_once_per_step_like_the_weights() {
    let r = run_family(
        "qwen2-tiny",
        &["gradient_accumulation_steps=4", "grad_bucket_mb=1e-9"],
    );
    assert_eq!(
        r.gate,
        Deferral::Open {
            axes: vec!["data".to_string()]
        }
    );
    // The biases are there, [out] each: q 4·8, k and v 2·8, in every layer.
    let biases: Vec<_> = r
        .params
        .iter()
        .filter(|p| BIASES.iter().any(|b| p.name.ends_with(b)))
        .collect();
    assert_eq!(
        biases.len(),
        2 * 3,
        "{:?}",
        r.params.iter().map(|p| &p.name).collect::<Vec<_>>()
    );
    let q = biases
        .iter()
        .find(|p| p.name.ends_with("q_proj.bias"))
        .unwrap();
    assert_eq!(q.shape, vec![32]);
    assert!(
        r.params.iter().all(|p| !p.name.contains("q_norm")),
        "no QK-norm"
    );
    let mb = PhasePattern::new("micro_batch*");
    let big = r.trace.all_reduces_larger_than(1, &mb);
    assert!(big.is_empty(), "all-reduces inside micro-batches: {big:?}");
    let update = PhasePattern::new("update");
    assert_eq!(
        r.trace.count(CollectiveKind::AllReduce, &update),
        r.params.len() * 3,
        "one all-reduce per parameter (biases included) per step"
    );
    let elements: usize = r
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    assert_eq!(
        r.trace.bytes(CollectiveKind::AllReduce, &update),
        elements * 4 * 3
    );
    // The biases learned: they start at zero and moved.
    let values = r.values.as_ref().unwrap();
    for (p, v) in r.params.iter().zip(values) {
        if BIASES.iter().any(|b| p.name.ends_with(b)) {
            assert!(v.data().iter().any(|x| *x != 0.0), "{} stayed zero", p.name);
        }
    }
}

/// Mirror: with the gate closed, every parameter — each bias too — is reduced in every
/// micro-batch.
#[test]
fn mirror_gate_closed_reduces_the_biases_in_every_micro_batch() {
    let r = run_family(
        "qwen2-tiny",
        &[
            "gradient_accumulation_steps=4",
            "shard_mode=auto",
            "head_dim=16",
        ],
    );
    assert!(!r.gate.is_open());
    let bias_elements: usize = r
        .params
        .iter()
        .filter(|p| BIASES.iter().any(|b| p.name.ends_with(b)))
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    assert!(bias_elements > 0);
    for micro in 0..4 {
        let phase = PhasePattern::new(format!("micro_batch {micro}"));
        let big = r.trace.all_reduces_larger_than(1, &phase);
        assert_eq!(big.len(), r.params.len() * 3, "micro-batch {micro}");
    }
}

#[test]
fn deferred_and_untagged_runs_give_the_same_weights_for_llama_and_qwen2() {
    for model in ["llama3-tiny", "qwen2-tiny"] {
        let keys = [
            "opt_type=sgd",
            "learning_rate=0.5",
            "gradient_clipping_threshold=0",
        ];
        let deferred = run_family(model, &keys);
        let mut untagged_keys = keys.to_vec();
        untagged_keys.push("shard_mode=auto");
        let untagged = run_family(model, &untagged_keys);
        assert!(
            deferred.gate.is_open() && !untagged.gate.is_open(),
            "{model}"
        );
        // The same sums in another order (per device, then across devices): a few f32 ulps
        // (Qwen3's run stays within 1e-6; a bias is one small vector summed over every token).
        let d = max_rel_diff(&deferred, &untagged);
        assert!(d <= 4e-6, "{model}: max relative weight difference {d}");
    }
}

/// Tensor parallelism splits each bias with its projection's output; the model still learns and
/// matches the data-parallel run's first loss (the same model, laid out differently).
#[test]
fn qwen2_trains_under_tensor_parallelism_with_split_biases() {
    let keys = ["steps=6", "learning_rate=0.01", "dataset_type=corpus"];
    let mut tp = keys.to_vec();
    tp.extend(["ici_data_parallelism=2", "ici_tensor_parallelism=2"]);
    let split = run_family("qwen2-tiny", &tp);
    let plain = run_family("qwen2-tiny", &keys);
    let (first, last) = (split.metrics[0].loss, split.metrics.last().unwrap().loss);
    assert!(last < first - 0.1, "loss {first} -> {last}");
    let p = plain.metrics[0].loss;
    assert!(
        (first - p).abs() <= 1e-4 * p.abs(),
        "first loss {first} vs {p}"
    );
}

/// A bias whose reduced tag is dropped inside the step is caught by its accumulator's type, as
/// a weight's is. Uses the `fault-injection` test hook (on in the README's test command).
#[cfg(feature = "fault-injection")]
#[test]
fn a_bias_with_a_dropped_tag_is_caught_not_silently_reduced_early() {
    let items = family("qwen2-tiny", &["gradient_accumulation_steps=2"]);
    let cfg = common::small_config(&items.iter().map(String::as_str).collect::<Vec<_>>());
    let name = "model.layers.0.self_attn.k_proj.bias".to_string();
    let options = ferrotext_train::RunOptions {
        inside_spec_override: Some((
            name.clone(),
            ferrotext_sharding::PartitionSpec::new([None::<&str>]),
        )),
        ..Default::default()
    };
    match ferrotext_train::train(&cfg, &options).unwrap_err() {
        ferrotext_train::TrainError::AccumulatorType {
            param,
            expected,
            got,
            ..
        } => {
            assert_eq!(param, name);
            assert_eq!(expected, "f32[16]{U:data}");
            assert_eq!(got, "f32[16]");
        }
        other => panic!("expected an accumulator-type error, got {other}"),
    }
}
