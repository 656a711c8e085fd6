//! Checkpoints: a mid-step round trip bitwise equal to an uninterrupted run (deferral on and
//! off), resume at a step boundary, a failure after every file of a save, and corrupt files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions};
use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;
use ferrotext_train::checkpoint::latest;
use ferrotext_train::data::{source_for, TokenSource};
mod common;

use common::{feed, small_config};
use ferrotext_train::{compute_mesh, train, Engine, RunOptions, TrainConfig, TrainError};

fn config(extra: &[&str]) -> TrainConfig {
    let mut all = vec![
        "gradient_accumulation_steps=2",
        "steps=4",
        "learning_rate=0.01",
    ];
    all.extend_from_slice(extra);
    small_config(&all)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-ckpt-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// 1.5 steps, save, a fresh engine restores, finish the step and one more; vs uninterrupted.
fn mid_step_round_trip(extra: &[&str]) {
    let cfg = config(extra);
    let root = scratch(&format!("mid-{}", extra.join("-")));
    let mesh = compute_mesh(&cfg).unwrap();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            // Uninterrupted.
            let mut a = Engine::new(&mut cx, &cfg, None)?;
            for step in 0..3u64 {
                for micro in 0..2 {
                    feed(&mut cx, &mut a, source.as_ref(), &cfg, step, micro)?;
                }
                a.update(&mut cx)?;
            }
            // Interrupted in the middle of step 1.
            let mut b = Engine::new(&mut cx, &cfg, None)?;
            for micro in 0..2 {
                feed(&mut cx, &mut b, source.as_ref(), &cfg, 0, micro)?;
            }
            b.update(&mut cx)?;
            feed(&mut cx, &mut b, source.as_ref(), &cfg, 1, 0)?;
            cx.comm().take_trace();
            b.save_checkpoint(&mut cx, &root)?;
            let checkpoint_reductions = cx
                .comm()
                .trace()
                .count(CollectiveKind::AllReduce, &PhasePattern::new("checkpoint"));
            drop(b);
            let mut c = Engine::new(&mut cx, &cfg, None)?;
            c.restore_checkpoint(&mut cx, &root)?;
            assert_eq!(c.pending_micro_steps(), 1);
            feed(&mut cx, &mut c, source.as_ref(), &cfg, 1, 1)?;
            c.update(&mut cx)?;
            for micro in 0..2 {
                feed(&mut cx, &mut c, source.as_ref(), &cfg, 2, micro)?;
            }
            c.update(&mut cx)?;
            Ok((
                a.params_to_host(&mut cx)?,
                c.params_to_host(&mut cx)?,
                checkpoint_reductions,
            ))
        },
    )
    .unwrap();
    let (a, c, reductions) = &results[0];
    assert_eq!(
        a, c,
        "weights after a mid-step save and restore are bitwise equal"
    );
    if extra.is_empty() {
        assert!(
            *reductions > 0,
            "the checkpoint reduced the partial accumulator (phase `checkpoint`)"
        );
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn mid_step_round_trip_with_deferral_is_bitwise_equal() {
    mid_step_round_trip(&[]);
}

#[test]
fn mid_step_round_trip_without_deferral_is_bitwise_equal() {
    mid_step_round_trip(&["shard_mode=auto"]);
}

/// A checkpoint from a deferred data=4 run restored onto data=1: the total is re-split onto the
/// new layout and the step finishes with the same gradient (to float tolerance).
#[test]
fn mid_step_checkpoint_moves_to_another_mesh() {
    let root = scratch("cross-mesh");
    let four = config(&[]);
    let one = config(&["local_devices=1", "per_device_batch_size=4"]);
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&four, 256).unwrap());
    let finish = |cfg: &TrainConfig, restore: bool| -> Vec<Tensor> {
        let mesh = compute_mesh(cfg).unwrap();
        run_spmd(
            &mesh,
            &SpmdOptions::default(),
            |dev| -> Result<_, TrainError> {
                let mut cx = Ctx::new(dev.comm(), 1);
                let mut e = Engine::new(&mut cx, cfg, None)?;
                if restore {
                    e.restore_checkpoint(&mut cx, &root)?;
                } else {
                    feed(&mut cx, &mut e, source.as_ref(), cfg, 0, 0)?;
                    e.save_checkpoint(&mut cx, &root)?;
                }
                feed(&mut cx, &mut e, source.as_ref(), cfg, 0, 1)?;
                e.update(&mut cx)?;
                e.params_to_host(&mut cx)
            },
        )
        .unwrap()
        .remove(0)
    };
    let on_four = finish(&four, false);
    let on_one = finish(&one, true);
    for (a, b) in on_four.iter().zip(&on_one) {
        for (x, y) in a.data().iter().zip(b.data()) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn trainer_resumes_at_a_step_boundary_with_a_bitwise_equal_loss_curve() {
    let base = scratch("resume");
    let dir = format!("base_output_directory={}", base.display());
    let whole = train(&config(&[&dir, "run_name=whole"]), &RunOptions::default()).unwrap();
    let interrupted = RunOptions {
        stop_after_steps: Some(2),
        ..Default::default()
    };
    let first = train(
        &config(&[
            &dir,
            "run_name=split",
            "enable_checkpointing=true",
            "checkpoint_period=1",
        ]),
        &interrupted,
    )
    .unwrap();
    assert_eq!(first.metrics.len(), 2);
    let rest = train(
        &config(&[
            &dir,
            "run_name=split",
            "enable_checkpointing=true",
            "checkpoint_period=1",
        ]),
        &RunOptions::default(),
    )
    .unwrap();
    let losses = |r: &ferrotext_train::TrainReport| {
        r.metrics
            .iter()
            .map(|m| m.loss.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        rest.metrics.first().unwrap().step,
        2,
        "resumed after the two saved steps"
    );
    let mut resumed = losses(&first);
    resumed.extend(losses(&rest));
    assert_eq!(resumed, losses(&whole));
    std::fs::remove_dir_all(&base).ok();
}

/// Saves step 1, then fails after each file of the step-2 save in turn: the previous checkpoint
/// stays `latest` and loads; the partial one is never picked up.
#[test]
fn a_failure_after_any_file_of_a_save_leaves_the_previous_checkpoint() {
    let cfg = config(&[]);
    let mesh = compute_mesh(&cfg).unwrap();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    for fail_at in [
        "params.safetensors",
        "optimizer.safetensors",
        "accumulator.safetensors",
        "manifest.json",
    ] {
        let root = scratch(&format!("crash-{fail_at}"));
        let outcome = run_spmd(
            &mesh,
            &SpmdOptions::default(),
            |dev| -> Result<_, TrainError> {
                let mut cx = Ctx::new(dev.comm(), 1);
                let mut e = Engine::new(&mut cx, &cfg, None)?;
                for micro in 0..2 {
                    feed(&mut cx, &mut e, source.as_ref(), &cfg, 0, micro)?;
                }
                e.update(&mut cx)?;
                let good = e.save_checkpoint(&mut cx, &root)?;
                feed(&mut cx, &mut e, source.as_ref(), &cfg, 1, 0)?; // mid-step: all four files
                let hook = |name: &str| {
                    if name == fail_at {
                        Err(std::io::Error::other(format!("injected after {name}")))
                    } else {
                        Ok(())
                    }
                };
                let failed = e.save_checkpoint_with_hook(&mut cx, &root, &hook);
                Ok((good, failed.err().map(|e| e.to_string())))
            },
        );
        // Device 0 failed its save (the others, at the final barrier, see it leave).
        let err = outcome.unwrap()[0].1.clone().unwrap_or_default();
        assert!(
            err.contains(&format!("injected after {fail_at}")),
            "{fail_at}: {err}"
        );
        let newest = latest(&root).expect("a checkpoint is still named by `latest`");
        assert!(
            newest.ends_with("step_00000001_micro_000"),
            "{fail_at}: latest is {}",
            newest.display()
        );
        // ...and it loads.
        let restored = run_spmd(
            &mesh,
            &SpmdOptions::default(),
            |dev| -> Result<_, TrainError> {
                let mut cx = Ctx::new(dev.comm(), 1);
                let mut e = Engine::new(&mut cx, &cfg, None)?;
                e.restore_checkpoint(&mut cx, &root)
            },
        )
        .unwrap();
        assert_eq!(restored[0], 1);
        std::fs::remove_dir_all(&root).ok();
    }
}

fn saved_checkpoint(root: &Path) -> PathBuf {
    let cfg = config(&[]);
    let mesh = compute_mesh(&cfg).unwrap();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, &cfg, None)?;
            feed(&mut cx, &mut e, source.as_ref(), &cfg, 0, 0)?;
            e.save_checkpoint(&mut cx, root)
        },
    )
    .unwrap()
    .remove(0)
}

fn restore_error(cfg: &TrainConfig, path: &Path) -> String {
    let mesh = compute_mesh(cfg).unwrap();
    let out = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, cfg, None)?;
            let before = e.params_to_host(&mut cx)?;
            let err = e
                .restore_checkpoint(&mut cx, path)
                .err()
                .map(|e| e.to_string());
            // Nothing was half-restored.
            assert_eq!(e.params_to_host(&mut cx)?, before);
            assert_eq!(e.steps_taken(), 0);
            Ok(err)
        },
    )
    .unwrap();
    out[0].clone().expect("restore must fail")
}

#[test]
fn corrupt_checkpoints_are_clear_errors() {
    let cfg = config(&[]);
    let fresh = |name: &str| {
        let root = scratch(name);
        (root.clone(), saved_checkpoint(&root))
    };
    // truncated tensor file
    let (root, dir) = fresh("truncated");
    let f = dir.join("params.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    assert!(restore_error(&cfg, &root).contains("params.safetensors: checksum mismatch"));
    // one flipped byte
    let (root, dir) = fresh("flipped");
    let f = dir.join("optimizer.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&f, bytes).unwrap();
    assert!(restore_error(&cfg, &root).contains("optimizer.safetensors: checksum mismatch"));
    // wrong shape: restored into a wider model
    let (root, _) = fresh("shape");
    let wider = config(&["base_emb_dim=48"]);
    let err = restore_error(&wider, &root);
    assert!(
        err.contains("params.safetensors")
            && err.contains("has shape [256, 32], the model needs [256, 48]"),
        "{err}"
    );
    // missing file
    let (root, dir) = fresh("missing");
    std::fs::remove_file(dir.join("accumulator.safetensors")).unwrap();
    assert!(restore_error(&cfg, &root).contains("accumulator.safetensors: cannot read"));
    // a manifest from a newer format
    let (root, dir) = fresh("newer");
    let m = dir.join("manifest.json");
    let text = std::fs::read_to_string(&m)
        .unwrap()
        .replace("\"format_version\": 1", "\"format_version\": 99");
    std::fs::write(&m, text).unwrap();
    assert!(restore_error(&cfg, &root)
        .contains("format version 99 is newer than this ferrotext reads (1)"));
    // a manifest pointing outside its directory
    let (root, dir) = fresh("outside");
    let m = dir.join("manifest.json");
    let text = std::fs::read_to_string(&m)
        .unwrap()
        .replace("\"params.safetensors\"", "\"../params.safetensors\"");
    std::fs::write(&m, text).unwrap();
    assert!(restore_error(&cfg, &root)
        .contains("points outside its directory: `../params.safetensors`"));
    // `latest` naming something outside
    let (root, _) = fresh("latest");
    std::fs::write(root.join("latest"), "../elsewhere").unwrap();
    assert!(restore_error(&cfg, &root).contains("outside its directory"));
    for name in [
        "truncated",
        "flipped",
        "shape",
        "missing",
        "newer",
        "outside",
        "latest",
    ] {
        std::fs::remove_dir_all(scratch(name)).ok();
    }
}

#[test]
fn mid_step_round_trip_with_zero1_is_bitwise_equal() {
    mid_step_round_trip(&["shard_optimizer_over_data=true"]);
}
