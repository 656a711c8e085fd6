//! bf16 runs (issue 30 item 4): a `dtype=bfloat16` run trains other numbers than a float32 one
//! (the dtype reaches the model), resumes bit for bit at a step boundary and inside a step (the
//! master weights and optimizer state are f32 in the checkpoint; the bf16 copies are recomputed
//! from them), and a resume may change `dtype`, which the run says in one sentence.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_spmd::Ctx;
use ferrotext_train::checkpoint::dtype_change;
use ferrotext_train::data::{source_for, TokenSource};
use ferrotext_train::{train, Engine, RunOptions, TrainConfig, TrainError, TrainReport};

mod common;
use common::{feed, small_config};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-bf16run-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

fn losses(r: &TrainReport) -> Vec<u64> {
    r.metrics.iter().map(|m| m.loss.to_bits()).collect()
}

fn run_config(base: &Path, run: &str, extra: &[&str]) -> TrainConfig {
    let dir = format!("base_output_directory={}", base.display());
    let run = format!("run_name={run}");
    let mut all = vec![
        dir.as_str(),
        run.as_str(),
        "gradient_accumulation_steps=2",
        "steps=4",
        "learning_rate=0.01",
    ];
    all.extend_from_slice(extra);
    small_config(&all)
}

/// A bf16 run stopped after two steps and resumed gives the uninterrupted bf16 run's losses bit
/// for bit; and bf16 is really on: its losses are not the float32 run's.
#[test]
fn a_bf16_run_resumes_at_a_step_boundary_bit_for_bit() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let base = scratch("resume");
    let bf16 = ["dtype=bfloat16"];
    let whole = train(&run_config(&base, "whole", &bf16), &RunOptions::default()).unwrap();
    let f32 = train(&run_config(&base, "f32", &[]), &RunOptions::default()).unwrap();
    assert_ne!(
        losses(&whole),
        losses(&f32),
        "dtype=bfloat16 trained the float32 numbers: the dtype did not reach the model"
    );
    let ckpt = [
        "dtype=bfloat16",
        "enable_checkpointing=true",
        "checkpoint_period=1",
    ];
    let cfg = run_config(&base, "split", &ckpt);
    let first = train(
        &cfg,
        &RunOptions {
            stop_after_steps: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let root = base.join("split/checkpoints");
    assert_eq!(dtype_change(&cfg, &root), None);
    // The manifest records the dtype (in its config); the stored tensors are f32.
    let saved = ferrotext_train::checkpoint::latest(&root).unwrap().unwrap();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(saved.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["config"]["dtype"], "bfloat16");
    let bytes = std::fs::read(saved.join("params.safetensors")).unwrap();
    let params = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert!(params
        .tensors()
        .iter()
        .all(|(_, v)| v.dtype() == safetensors::Dtype::F32));
    let rest = train(&cfg, &RunOptions::default()).unwrap();
    assert_eq!(rest.metrics.first().unwrap().step, 2);
    let mut resumed = losses(&first);
    resumed.extend(losses(&rest));
    assert_eq!(resumed, losses(&whole));
    std::fs::remove_dir_all(&base).ok();
}

/// A float32 checkpoint resumed with dtype=bfloat16: allowed (the master weights are float32),
/// said in one sentence, and the continued steps are the bf16 ones.
#[test]
fn a_resume_may_change_dtype_and_says_so() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let base = scratch("change");
    let ckpt = ["enable_checkpointing=true", "checkpoint_period=1"];
    let f32_cfg = run_config(&base, "run", &ckpt);
    let stop = RunOptions {
        stop_after_steps: Some(2),
        ..Default::default()
    };
    train(&f32_cfg, &stop).unwrap();
    let bf16_cfg = run_config(&base, "run", &[ckpt[0], ckpt[1], "dtype=bfloat16"]);
    let root = base.join("run/checkpoints");
    let said = dtype_change(&bf16_cfg, &root).expect("a dtype change is said");
    assert!(
        said.contains("saved with dtype=float32, now dtype=bfloat16")
            && said.contains("master weights and the optimizer state are float32"),
        "{said}"
    );
    assert_eq!(said.lines().count(), 1);
    // The mirror: the same dtype says nothing.
    assert_eq!(dtype_change(&f32_cfg, &root), None);
    let rest = train(&bf16_cfg, &RunOptions::default()).unwrap();
    assert_eq!(rest.metrics.first().unwrap().step, 2);
    std::fs::remove_dir_all(&base).ok();
}

/// 1.5 bf16 steps, a mid-step save, a fresh engine restores and finishes: the weights are the
/// uninterrupted bf16 run's, bit for bit.
#[test]
fn a_bf16_mid_step_round_trip_is_bitwise_equal() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let cfg = small_config(&["gradient_accumulation_steps=2", "dtype=bfloat16"]);
    let root = scratch("mid");
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut a = Engine::new(&mut cx, &plan, None)?;
            for step in 0..2u64 {
                for micro in 0..2 {
                    feed(&mut cx, &mut a, source.as_ref(), &cfg, step, micro)?;
                }
                a.update(&mut cx)?;
            }
            let mut b = Engine::new(&mut cx, &plan, None)?;
            for micro in 0..2 {
                feed(&mut cx, &mut b, source.as_ref(), &cfg, 0, micro)?;
            }
            b.update(&mut cx)?;
            feed(&mut cx, &mut b, source.as_ref(), &cfg, 1, 0)?;
            b.save_checkpoint(&mut cx, &root)?;
            drop(b);
            let mut c = Engine::new(&mut cx, &plan, None)?;
            c.restore_checkpoint(&mut cx, &root)?;
            feed(&mut cx, &mut c, source.as_ref(), &cfg, 1, 1)?;
            c.update(&mut cx)?;
            Ok((a.params_to_host(&mut cx)?, c.params_to_host(&mut cx)?))
        },
    )
    .unwrap();
    let (a, c) = &results[0];
    assert_eq!(a, c, "bf16 weights after a mid-step save and restore");
    std::fs::remove_dir_all(&root).ok();
}
