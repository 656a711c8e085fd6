//! `layout_invariant=true`: the same global batch trained as data=4 × GA 1, data=2 × GA 2 and
//! data=1 × GA 4 gives the same losses, grad norms and final weights to the bit — dense and
//! MoE, SGD and AdamW with clipping, ZeRO-1 on and off — and a checkpoint resumes on another
//! layout bitwise. The
//! mirror: without the key the layouts differ. (Over MPI: `crates/ferrotext/tests/mpi.rs`.)

use std::path::{Path, PathBuf};

use ferrotext_train::{train, RunOptions, TrainConfig, TrainReport};

mod common;
use common::{small_config, SMALL};

/// (data, local devices, GA): four sequences a step, one a device's micro-batch.
const LAYOUTS: [(usize, usize); 3] = [(4, 1), (2, 2), (1, 4)];

/// `small_config`'s model with 4 routed experts, no auxiliary loss.
const MOE: [&str; 6] = [
    "num_experts=4",
    "num_experts_per_tok=2",
    "moe_mlp_dim=24",
    "shared_experts=1",
    "first_num_dense_layers=1",
    "load_balance_loss_weight=0",
];

fn layout_keys((data, ga): (usize, usize)) -> Vec<String> {
    vec![
        format!("ici_data_parallelism={data}"),
        format!("local_devices={data}"),
        format!("gradient_accumulation_steps={ga}"),
    ]
}

fn config(layout: (usize, usize), extra: &[&str]) -> TrainConfig {
    let keys = layout_keys(layout);
    let mut all: Vec<&str> = keys.iter().map(String::as_str).collect();
    all.extend_from_slice(&["steps=4", "deterministic=true"]);
    all.extend_from_slice(extra);
    small_config(&all)
}

/// True when `FERROTEXT_MATMUL` forced this process's products onto a library (as
/// `.ci/kernel-paths` does): then `deterministic=true`, which these runs need, must be refused,
/// and that refusal is what a test checks instead.
fn kernel_forced_elsewhere() -> bool {
    let forced = std::env::var("FERROTEXT_MATMUL").unwrap_or_default();
    if forced.is_empty() || forced == "portable" {
        return false;
    }
    let err = train(&config(LAYOUTS[0], &[]), &RunOptions::default()).unwrap_err();
    assert!(err.is_usage(), "{err}");
    assert!(
        err.to_string()
            .starts_with("deterministic=true needs the portable matmul kernel"),
        "{err}"
    );
    true
}

fn run(cfg: &TrainConfig) -> TrainReport {
    train(
        cfg,
        &RunOptions {
            return_params: true,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Every step's loss and grad norm, and every final weight, as bits.
fn bits(r: &TrainReport) -> (Vec<u64>, Vec<u64>, Vec<Vec<u32>>) {
    (
        r.metrics.iter().map(|m| m.loss.to_bits()).collect(),
        r.metrics.iter().map(|m| m.grad_norm.to_bits()).collect(),
        r.values
            .as_ref()
            .unwrap()
            .iter()
            .map(|t| t.data().iter().map(|x| x.to_bits()).collect())
            .collect(),
    )
}

#[test]
fn every_layout_of_the_global_batch_gives_the_same_bits() {
    if kernel_forced_elsewhere() {
        return;
    }
    let sgd: &[&str] = &["opt_type=sgd", "learning_rate=0.05"];
    let adamw: &[&str] = &["opt_type=adamw", "gradient_clipping_threshold=0.5"];
    for (model, model_keys) in [("dense", &[][..]), ("moe", &MOE[..])] {
        for (opt, opt_keys) in [("sgd", sgd), ("adamw+clip", adamw)] {
            let mut extra = vec!["layout_invariant=true"];
            extra.extend_from_slice(model_keys);
            extra.extend_from_slice(opt_keys);
            let want = bits(&run(&config(LAYOUTS[0], &extra)));
            assert_eq!(want.0.len(), 4);
            for layout in &LAYOUTS[1..] {
                let got = bits(&run(&config(*layout, &extra)));
                assert_eq!(got.0, want.0, "{model} {opt} {layout:?}: losses");
                assert_eq!(got.1, want.1, "{model} {opt} {layout:?}: grad norms");
                assert!(got.2 == want.2, "{model} {opt} {layout:?}: final weights");
            }
        }
    }
}

/// ZeRO-1 on every layout gives the bits of ZeRO-1 off: the gradients are all-reduced whole
/// under the key (so the norm is the whole gradient's) and AdamW steps on each device's slice.
#[test]
fn zero1_gives_the_same_bits_on_every_layout() {
    if kernel_forced_elsewhere() {
        return;
    }
    let plain = [
        "layout_invariant=true",
        "opt_type=adamw",
        "gradient_clipping_threshold=0.5",
    ];
    let want = bits(&run(&config(LAYOUTS[0], &plain)));
    let mut zero1 = plain.to_vec();
    zero1.push("shard_optimizer_over_data=true");
    for layout in LAYOUTS {
        let report = run(&config(layout, &zero1));
        if layout.0 > 1 {
            assert!(report.zero1.is_open(), "{layout:?}: ZeRO-1 on");
        }
        assert!(bits(&report) == want, "{layout:?}: ZeRO-1");
    }
}

/// Eight units a step: three levels of the tree, cut three ways (every device's micro-batches
/// one subtree of 1, 4 or 8 units).
#[test]
fn eight_units_cut_three_ways_give_the_same_bits() {
    if kernel_forced_elsewhere() {
        return;
    }
    let extra = ["layout_invariant=true", "opt_type=adamw"];
    let want = bits(&run(&config((8, 1), &extra)));
    for layout in [(2, 4), (1, 8)] {
        assert!(bits(&run(&config(layout, &extra))) == want, "{layout:?}");
    }
}

/// The mirror: the same runs without the key (the portable kernel still on) differ between
/// layouts, so the comparison above can see a difference.
#[test]
fn without_the_key_the_layouts_differ() {
    if kernel_forced_elsewhere() {
        return;
    }
    let runs: Vec<_> = LAYOUTS
        .iter()
        .map(|&l| bits(&run(&config(l, &["opt_type=sgd"]))))
        .collect();
    assert!(
        runs[1] != runs[0] || runs[2] != runs[0],
        "three layouts agreed to the bit without layout_invariant"
    );
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-layout-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// A checkpoint at a step boundary written on data=4 × GA 1 continues on data=1 × GA 4 and on
/// data=2 × GA 2 to the bit of the uninterrupted run (elastic resume).
#[test]
fn a_checkpoint_resumes_on_another_layout_bitwise() {
    if kernel_forced_elsewhere() {
        return;
    }
    let base = scratch("resume");
    let keys = |run: &str, base: &Path| {
        vec![
            format!("base_output_directory={}", base.display()),
            format!("run_name={run}"),
        ]
    };
    let with_keys = |layout, run: &str, more: &[&str]| {
        let k = keys(run, &base);
        let mut extra: Vec<&str> = k.iter().map(String::as_str).collect();
        extra.extend_from_slice(&[
            "layout_invariant=true",
            "opt_type=adamw",
            "enable_checkpointing=true",
            "checkpoint_period=1",
        ]);
        extra.extend_from_slice(more);
        config(layout, &extra)
    };
    let with = |layout, run: &str| with_keys(layout, run, &[]);
    let whole = run(&with(LAYOUTS[0], "whole"));
    for to in &LAYOUTS[1..] {
        let name = format!("to-{}", to.0);
        let first = train(
            &with(LAYOUTS[0], &name),
            &RunOptions {
                stop_after_steps: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        let rest = run(&with(*to, &name));
        assert_eq!(rest.first_step, 2);
        let losses: Vec<u64> = first
            .metrics
            .iter()
            .chain(&rest.metrics)
            .map(|m| m.loss.to_bits())
            .collect();
        assert_eq!(losses, bits(&whole).0, "{to:?}: losses");
        assert!(bits(&rest).2 == bits(&whole).2, "{to:?}: final weights");
    }
    // The same global batch as one device's micro-batch of 4 sequences: the tree's units are
    // other sequences, so the resume is refused naming the key (the layouts above, which keep
    // per_device_batch_size, are the mirror).
    let name = "to-pdb";
    train(
        &with(LAYOUTS[0], name),
        &RunOptions {
            stop_after_steps: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let err = train(
        &with_keys((1, 1), name, &["per_device_batch_size=4"]),
        &RunOptions::default(),
    )
    .unwrap_err();
    assert!(err.is_usage(), "{err}");
    assert!(
        err.to_string()
            .contains("per_device_batch_size sequences, 1 when saved, now 4"),
        "{err}"
    );
    std::fs::remove_dir_all(&base).ok();
}

/// Copies checkpoint `name` of `from` into `to`'s checkpoint root and makes it `to`'s latest:
/// the state a job killed just after that checkpoint leaves.
fn resume_point(from: &Path, to: &Path, name: &str) {
    let dest = to.join(name);
    std::fs::create_dir_all(&dest).unwrap();
    for entry in std::fs::read_dir(from.join(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dest.join(entry.file_name())).unwrap();
    }
    std::fs::write(to.join("latest"), name).unwrap();
}

/// A checkpoint inside a step keeps the step's unit tree: resumed from after any micro-batch of
/// a step on data=2 × GA 4 (trees of one unit, one subtree of two, and subtrees of two and
/// one), the run is bitwise the uninterrupted one. The mirror: the same checkpoint resumed
/// without the key (the step's sum so far as one accumulator) runs, but the tree, not the
/// accumulator, is what makes the bits.
#[test]
fn a_checkpoint_inside_a_step_resumes_bitwise() {
    if kernel_forced_elsewhere() {
        return;
    }
    let base = scratch("mid-step");
    let with = |run: &str, invariant: bool| {
        let keys = [
            format!("base_output_directory={}", base.display()),
            format!("run_name={run}"),
            format!("layout_invariant={invariant}"),
        ];
        let mut extra: Vec<&str> = keys.iter().map(String::as_str).collect();
        extra.extend_from_slice(&[
            "opt_type=adamw",
            "enable_checkpointing=true",
            "checkpoint_micro_batch_period=1",
            "checkpoint_keep=0",
        ]);
        config((2, 4), &extra)
    };
    let whole = run(&with("whole", true));
    let saved = base.join("whole/checkpoints");
    for micro in 1..4 {
        let name = format!("step_00000001_micro_{micro:03}");
        let run_name = format!("from-{micro}");
        resume_point(&saved, &base.join(&run_name).join("checkpoints"), &name);
        let rest = run(&with(&run_name, true));
        assert_eq!(rest.first_step, 1, "{name}");
        assert_eq!(
            bits(&rest).0,
            bits(&whole).0[1..],
            "{name}: losses after the resume"
        );
        assert!(bits(&rest).2 == bits(&whole).2, "{name}: final weights");
    }
    // The tree's checkpoint, continued as one accumulator (the key off): it resumes, and
    // finishes with the step's gradient summed in another order.
    let name = "step_00000001_micro_003";
    resume_point(&saved, &base.join("accumulated/checkpoints"), name);
    let rest = run(&with("accumulated", false));
    assert_eq!(rest.first_step, 1);
    assert!(
        bits(&rest).2 != bits(&whole).2,
        "the accumulator's order gave the tree's bits"
    );
    std::fs::remove_dir_all(&base).ok();
}

/// A checkpoint inside a step that kept no tree (written without the key) cannot continue a
/// step under it: one usage error naming the key.
#[test]
fn a_step_without_its_tree_is_refused_under_the_key() {
    if kernel_forced_elsewhere() {
        return;
    }
    let base = scratch("no-tree");
    let with = |invariant: bool| {
        let keys = [
            format!("base_output_directory={}", base.display()),
            format!("layout_invariant={invariant}"),
        ];
        let mut extra: Vec<&str> = keys.iter().map(String::as_str).collect();
        extra.extend_from_slice(&[
            "run_name=r",
            "enable_checkpointing=true",
            "checkpoint_micro_batch_period=1",
            "checkpoint_keep=0",
        ]);
        config((2, 2), &extra)
    };
    train(
        &with(false),
        &RunOptions {
            stop_after_steps: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let root = base.join("r/checkpoints");
    std::fs::write(root.join("latest"), "step_00000000_micro_001").unwrap();
    let err = train(&with(true), &RunOptions::default()).unwrap_err();
    assert!(err.is_usage(), "{err}");
    let text = err.to_string();
    assert!(text.starts_with("layout_invariant"), "{text}");
    assert!(text.contains("unit tree"), "{text}");
    std::fs::remove_dir_all(&base).ok();
}

/// What the tree cannot cover is refused before anything runs, naming the key and the reason.
#[test]
fn what_the_tree_cannot_cover_is_refused_naming_the_key() {
    let cases: &[(&[&str], &str)] = &[
        (&["deterministic=false"], "needs deterministic=true"),
        (
            &["ici_data_parallelism=2", "ici_fsdp_parallelism=2"],
            "needs a data-parallel mesh, got fsdp=2",
        ),
        (&["shard_mode=auto"], "needs the deferral gate open"),
        (
            &["gradient_accumulation_steps=3"],
            "power-of-two gradient_accumulation_steps",
        ),
        (&["overlap_grad_reduce=true"], "overlap_grad_reduce"),
        (
            &[
                "num_experts=4",
                "num_experts_per_tok=2",
                "load_balance_loss_weight=0.01",
            ],
            "load_balance_loss_weight",
        ),
        (
            &[
                "num_experts=4",
                "num_experts_per_tok=2",
                "moe_withhold_tags=true",
            ],
            "moe_withhold_tags",
        ),
    ];
    for (keys, needle) in cases {
        let mut all = vec!["layout_invariant=true", "deterministic=true"];
        all.extend_from_slice(keys);
        let all: Vec<String> = SMALL
            .iter()
            .chain(all.iter())
            .map(|s| s.to_string())
            .collect();
        let err = TrainConfig::load(None, &all)
            .and_then(|c| c.plan().map(|_| ()))
            .unwrap_err();
        assert!(err.is_usage(), "{keys:?}: {err}");
        let text = err.to_string();
        assert!(
            text.starts_with("layout_invariant=true"),
            "{keys:?}: {text}"
        );
        assert!(text.contains(needle), "{keys:?}: {text}");
    }
}

/// The families of issue 44 keep the bits too: Gemma 3 (sandwich norms, GeGLU, a sliding layer
/// with its own RoPE, the `1 + w` QK-norm) and Qwen2-MoE (softmax top-k unnormalised, a
/// sigmoid-gated shared expert), from their `-tiny` presets at `small_config`'s sizes.
#[test]
fn new_families_keep_the_bits_on_every_layout() {
    if kernel_forced_elsewhere() {
        return;
    }
    for model in ["model_name=gemma3-tiny", "model_name=qwen2-moe-tiny"] {
        let extra = [
            model,
            "layout_invariant=true",
            "opt_type=adamw",
            "gradient_clipping_threshold=0.5",
        ];
        let want = bits(&run(&config(LAYOUTS[0], &extra)));
        for layout in &LAYOUTS[1..] {
            assert!(
                bits(&run(&config(*layout, &extra))) == want,
                "{model} {layout:?}"
            );
        }
    }
}
