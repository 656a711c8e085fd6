//! An MoE model through the trainer (the seed's `test_deepseek_zero1_reduces_gradients_once_per_step`
//! at CPU scale): data=4, GA=4, ZeRO-1 off and on — no all-reduce larger than 8 elements in any
//! micro-batch, the MoE region included; the mirror with the expert weights' tags withheld in
//! the region finds the per-micro-batch expert reductions; deferred vs untagged SGD weights; the
//! loss falls on the bundled corpus.

use ferrotext_comm::{CollectiveKind, PhasePattern};
mod common;

use common::{max_rel_diff, run, small_config as config};
use ferrotext_train::{train, RunOptions};

/// `small_config`'s model with 4 routed experts (top-2, width 24), one shared expert, the first
/// layer dense; `E·d·f = 4·32·24` per expert kernel.
const MOE: [&str; 5] = [
    "num_experts=4",
    "num_experts_per_tok=2",
    "moe_mlp_dim=24",
    "shared_experts=1",
    "first_num_dense_layers=1",
];
const EXPERT_KERNEL: usize = 4 * 32 * 24;

fn moe_run(extra: &[&str]) -> ferrotext_train::TrainReport {
    let mut all: Vec<&str> = MOE.to_vec();
    // One bucket per gradient, so each parameter's reduction shows in the trace by itself.
    all.extend_from_slice(&[
        "gradient_accumulation_steps=4",
        "local_devices=4",
        "grad_bucket_mb=1e-9",
    ]);
    all.extend_from_slice(extra);
    run(&all)
}

#[test]
fn moe_gradients_are_reduced_once_per_step_with_and_without_zero1() {
    for zero1 in [
        "shard_optimizer_over_data=false",
        "shard_optimizer_over_data=true",
    ] {
        let r = moe_run(&[zero1]);
        assert!(r.gate.is_open(), "{zero1}");
        assert!(
            r.params
                .iter()
                .any(|p| p.name.ends_with("mlp.experts.gate_proj")),
            "the model has expert kernels"
        );
        let mb = PhasePattern::new("micro_batch*");
        let big = r.trace.all_reduces_larger_than(1, &mb);
        assert!(
            big.is_empty(),
            "{zero1}: all-reduces inside micro-batches: {big:?}"
        );
        // The step's reductions happen in `update`: one per parameter per step (an all-reduce,
        // or with ZeRO-1 a reduce-scatter).
        let update = PhasePattern::new("update*");
        let kind = if zero1.ends_with("true") {
            CollectiveKind::ReduceScatter
        } else {
            CollectiveKind::AllReduce
        };
        assert_eq!(r.trace.count(kind, &update), r.params.len() * 3, "{zero1}");
    }
}

#[test]
fn mirror_tags_withheld_in_the_region_reduce_experts_in_every_micro_batch() {
    let tagged = moe_run(&["opt_type=sgd", "gradient_clipping_threshold=0"]);
    let withheld = moe_run(&[
        "opt_type=sgd",
        "gradient_clipping_threshold=0",
        "moe_withhold_tags=true",
    ]);
    for micro in 0..4 {
        let phase = PhasePattern::new(format!("micro_batch {micro}"));
        let experts = withheld
            .trace
            .all_reduces_larger_than(1, &phase)
            .into_iter()
            .filter(|e| e.elements == EXPERT_KERNEL)
            .count();
        // gate_proj, up_proj, down_proj of the one MoE layer, in each of the 3 steps.
        assert_eq!(experts, 3 * 3, "micro-batch {micro}");
        assert!(tagged.trace.all_reduces_larger_than(1, &phase).is_empty());
    }
    // Silent: the numbers do not change, only where the reduction happens.
    let d = max_rel_diff(&tagged, &withheld);
    assert!(d <= 1e-6, "max relative weight difference {d}");
}

#[test]
fn deferred_and_untagged_sgd_give_the_same_moe_weights() {
    let sgd = [
        "opt_type=sgd",
        "learning_rate=0.5",
        "gradient_clipping_threshold=0",
    ];
    let deferred = moe_run(&sgd);
    let mut untagged_args = sgd.to_vec();
    untagged_args.push("shard_mode=auto");
    let untagged = moe_run(&untagged_args);
    assert!(deferred.gate.is_open() && !untagged.gate.is_open());
    // The two sum each gradient in different orders (per use inside the backward, or once per
    // step), and SGD at lr 0.5 carries the rounding through three steps: 1.2e-6 on the
    // portable kernel with the collectives' tree order. A wrong gradient moves weights by far
    // more.
    let d = max_rel_diff(&deferred, &untagged);
    assert!(d <= 2e-6, "max relative weight difference {d}");
}

#[test]
fn moe_loss_falls_on_the_bundled_corpus() {
    let mut args: Vec<&str> = MOE.to_vec();
    args.extend_from_slice(&[
        "dataset_type=corpus",
        "steps=40",
        "max_target_length=32",
        "learning_rate=0.01",
    ]);
    let r = train(&config(&args), &RunOptions::default()).unwrap();
    let (first, last) = (
        r.metrics[0].loss,
        r.metrics.last().map_or(f64::NAN, |m| m.loss),
    );
    assert!(first > 5.0, "{first}");
    assert!(last < 3.0, "loss {first} -> {last}");
}

#[test]
fn moe_keys_on_a_dense_model_need_num_experts() {
    let err =
        ferrotext_train::TrainConfig::load(None, &["moe_mlp_dim=16".to_string()]).unwrap_err();
    assert!(
        err.to_string().contains("MoE keys need an MoE model"),
        "{err}"
    );
    let err = ferrotext_train::TrainConfig::load(
        None,
        &[
            "num_experts=4".to_string(),
            "num_experts_per_tok=5".to_string(),
        ],
    )
    .unwrap_err();
    assert!(err.to_string().contains("num_experts_per_tok"), "{err}");
}

/// The seed's repro at CPU scale: `model_name=deepseek3-tiny shard_mode=explicit
/// shard_optimizer_over_data=true gradient_accumulation_steps=4` on data=4 (MLA, YaRN, sigmoid
/// top-8 of 16 experts, a shared expert), with reduced depth and vocabulary. Its mirror withholds
/// the expert weights' tags in the region and finds their reductions in every micro-batch.
#[test]
fn test_deepseek_zero1_reduces_gradients_once_per_step() {
    let items = |withhold: bool| -> Vec<String> {
        [
            "model_name=deepseek3-tiny",
            "base_num_decoder_layers=2",
            "first_num_dense_layers=1",
            "vocab_size=64",
            "max_target_length=16",
            "per_device_batch_size=1",
            "local_devices=4",
            "ici_data_parallelism=-1",
            "shard_mode=explicit",
            "shard_optimizer_over_data=true",
            "gradient_accumulation_steps=4",
            "dataset_type=synthetic",
            "steps=2",
            "grad_bucket_mb=1e-9",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("moe_withhold_tags={withhold}")])
        .collect()
    };
    let run = |withhold: bool| {
        let config = ferrotext_train::TrainConfig::load(None, &items(withhold)).unwrap();
        train(&config, &RunOptions::default()).unwrap()
    };
    let tagged = run(false);
    assert!(tagged.gate.is_open());
    assert!(
        matches!(tagged.zero1, ferrotext_train::Zero1::Open { .. }),
        "{:?}",
        tagged.zero1
    );
    let mb = PhasePattern::new("micro_batch*");
    let big = tagged.trace.all_reduces_larger_than(1, &mb);
    assert!(big.is_empty(), "all-reduces inside micro-batches: {big:?}");
    let update = PhasePattern::new("update*");
    assert_eq!(
        tagged.trace.count(CollectiveKind::ReduceScatter, &update),
        tagged.params.len() * 2,
        "one reduce-scatter per parameter per step"
    );

    let withheld = run(true);
    let expert_kernel = 16 * 64 * 64;
    let in_micro_batches = withheld
        .trace
        .all_reduces_larger_than(1, &mb)
        .into_iter()
        .filter(|e| e.elements == expert_kernel)
        .count();
    // 3 kernels × 1 MoE layer × 4 micro-batches × 2 steps.
    assert_eq!(in_micro_batches, 3 * 4 * 2);
    let (a, b) = (&tagged.metrics, &withheld.metrics);
    for (x, y) in a.iter().zip(b.iter()) {
        assert!(
            (x.loss - y.loss).abs() <= 1e-6 * x.loss.abs(),
            "{} vs {}",
            x.loss,
            y.loss
        );
    }
}

/// Expert parallelism through the trainer: data2×expert2 (each device holds half the experts;
/// the batch is split over both axes) gives the weights of data=4 (same global batch), with
/// tokens travelling by all_to_all in every micro-batch and still no gradient all-reduce there;
/// the expert kernels are reduced in the update over `data` only, half a kernel each.
#[test]
fn expert_parallel_training_equals_data_parallel() {
    let sgd = [
        "opt_type=sgd",
        "learning_rate=0.5",
        "gradient_clipping_threshold=0",
    ];
    let data4 = moe_run(&sgd);
    let mut ep_args = sgd.to_vec();
    ep_args.extend_from_slice(&["ici_data_parallelism=2", "ici_expert_parallelism=2"]);
    let ep = moe_run(&ep_args);
    assert!(ep.gate.is_open());
    let d = max_rel_diff(&ep, &data4);
    assert!(d <= 1e-5, "max relative weight difference {d}");
    for micro in 0..4 {
        let phase = PhasePattern::new(format!("micro_batch {micro}"));
        assert!(ep.trace.all_reduces_larger_than(1, &phase).is_empty());
        assert!(
            ep.trace.count(CollectiveKind::AllToAll, &phase) >= 5 * 3,
            "micro-batch {micro}"
        );
    }
    let update = PhasePattern::new("update");
    let halves = ep
        .trace
        .all_reduces_larger_than(1, &update)
        .into_iter()
        .filter(|e| e.elements == EXPERT_KERNEL / 2 && e.axes == ["data"])
        .count();
    assert_eq!(halves, 3 * 3, "three expert kernels, three steps");
}

#[test]
fn expert_parallelism_needs_an_moe_model_and_no_zero1() {
    let load = |items: &[&str]| {
        let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        ferrotext_train::TrainConfig::load(None, &items)
            .unwrap_err()
            .to_string()
    };
    assert!(
        load(&["ici_expert_parallelism=2", "ici_data_parallelism=2"])
            .contains("needs an MoE model")
    );
    let err = load(&[
        "model_name=qwen3-moe-tiny",
        "ici_expert_parallelism=2",
        "ici_data_parallelism=2",
        "shard_optimizer_over_data=true",
    ]);
    assert!(err.contains("expert parallelism"), "{err}");
}

/// Overlap with the gate closed (`shard_mode=auto`) on data2×expert2: each micro-batch reduces
/// its own gradients through the bucketed path, the expert kernels over `data` only (tagged
/// `{R:data}`, split over `expert`), and the weights are the untagged run's.
#[test]
fn per_micro_batch_overlap_keeps_expert_parallel_weights() {
    let ep = [
        "opt_type=sgd",
        "learning_rate=0.5",
        "gradient_clipping_threshold=0",
        "ici_data_parallelism=2",
        "ici_expert_parallelism=2",
        "shard_mode=auto",
    ];
    let untagged = moe_run(&ep);
    let ddp = moe_run(&[&ep[..], &["overlap_grad_reduce=true"]].concat());
    assert!(!ddp.gate.is_open());
    let d = max_rel_diff(&ddp, &untagged);
    assert!(d <= 1e-6, "max relative weight difference {d}");
    for micro in 0..4 {
        let phase = PhasePattern::new(format!("micro_batch {micro}"));
        let halves = |r: &ferrotext_train::TrainReport| {
            r.trace
                .all_reduces_larger_than(1, &phase)
                .into_iter()
                .filter(|e| e.elements == EXPERT_KERNEL / 2 && e.axes == ["data"])
                .count()
        };
        // One bucket per gradient (`grad_bucket_mb=1e-9`): three expert kernels, three steps.
        assert_eq!(halves(&untagged), 3 * 3, "micro-batch {micro}");
        assert_eq!(halves(&ddp), 3 * 3, "micro-batch {micro}");
    }
}
