//! Checkpoints: a mid-step round trip bitwise equal to an uninterrupted run (deferral on and
//! off), resume at a step boundary, a failure after every file of a save, and corrupt files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions};
use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;
use ferrotext_train::checkpoint::{latest, prepare_resume};
use ferrotext_train::data::{source_for, TokenSource};
mod common;

use common::{feed, small_config};
use ferrotext_train::{train, Engine, RunOptions, TrainConfig, TrainError};

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
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            // Uninterrupted.
            let mut a = Engine::new(&mut cx, &plan, None)?;
            let mut a_losses = Vec::new();
            for step in 0..3u64 {
                for micro in 0..2 {
                    feed(&mut cx, &mut a, source.as_ref(), &cfg, step, micro)?;
                }
                a_losses.push(a.update(&mut cx)?.loss.to_bits());
            }
            // Interrupted in the middle of step 1.
            let mut b = Engine::new(&mut cx, &plan, None)?;
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
            let mut c = Engine::new(&mut cx, &plan, None)?;
            c.restore_checkpoint(&mut cx, &root)?;
            assert_eq!(c.pending_micro_steps(), 1);
            feed(&mut cx, &mut c, source.as_ref(), &cfg, 1, 1)?;
            // The pending loss sum and tokens came back exactly: the step's loss is the same.
            assert_eq!(c.update(&mut cx)?.loss.to_bits(), a_losses[1]);
            for micro in 0..2 {
                feed(&mut cx, &mut c, source.as_ref(), &cfg, 2, micro)?;
            }
            assert_eq!(c.update(&mut cx)?.loss.to_bits(), a_losses[2]);
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

/// Gate closed with overlap: the accumulator holds reduced gradients (each micro-batch reduced
/// its own), and they come back as they were.
#[test]
fn mid_step_round_trip_with_per_micro_batch_overlap_is_bitwise_equal() {
    mid_step_round_trip(&["shard_mode=auto", "overlap_grad_reduce=true"]);
}

/// A checkpoint from a deferred data=4 run restored onto data=1: the total is re-split onto the
/// new layout and the step finishes with the same gradient (to float tolerance).
#[test]
fn mid_step_checkpoint_moves_to_another_mesh() {
    let root = scratch("cross-mesh");
    // SGD: the weights are linear in the gradient, so they show the gradient's float-level
    // difference between meshes as it is (AdamW's first step divides each element by its own
    // magnitude and turns a 1e-7 difference in a near-zero gradient into a visible one).
    let four = config(&["opt_type=sgd"]);
    let one = config(&["local_devices=1", "per_device_batch_size=4", "opt_type=sgd"]);
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&four, 256).unwrap());
    let finish = |cfg: &TrainConfig, restore: bool| -> Vec<Tensor> {
        let plan = cfg.plan().unwrap();
        let mesh = plan.compute_mesh().clone();
        run_spmd(
            &mesh,
            &SpmdOptions::default(),
            |dev| -> Result<_, TrainError> {
                let mut cx = Ctx::new(dev.comm(), 1);
                let mut e = Engine::new(&mut cx, &plan, None)?;
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

/// A step-boundary checkpoint written on data=4 × GA 1 resumes on data=2 × GA 2 and on
/// data=1 × GA 4 (a job that lost devices continues with more micro-batches): the step reads the
/// same sequences, so every continued loss agrees with the uninterrupted run's to rounding (a
/// different sequence would move it by far more). Equal bits across layouts need a gradient sum
/// whose order does not depend on the layout, which ferrotext does not have yet. The mirrors: a
/// resume that changes the global batch is a usage error naming the key, and so is a checkpoint
/// taken inside a step resumed with other micro-batches.
#[test]
fn a_step_boundary_checkpoint_resumes_on_another_split_of_the_global_batch() {
    let base = scratch("elastic");
    let dir = format!("base_output_directory={}", base.display());
    // (data, GA, local devices): the same 4 sequences a step.
    let layout = |(data, ga, devices): (usize, usize, usize), run: &str| {
        let keys = [
            format!("ici_data_parallelism={data}"),
            format!("gradient_accumulation_steps={ga}"),
            format!("local_devices={devices}"),
            format!("run_name={run}"),
        ];
        let mut all: Vec<&str> = keys.iter().map(String::as_str).collect();
        all.extend([
            dir.as_str(),
            "enable_checkpointing=true",
            "checkpoint_period=1",
        ]);
        config(&all)
    };
    let four = (4, 1, 4);
    let whole = train(&layout(four, "whole"), &RunOptions::default()).unwrap();
    for to in [(2, 2, 2), (1, 4, 1)] {
        let run = format!("from-4-to-{}", to.0);
        let first = train(
            &layout(four, &run),
            &RunOptions {
                stop_after_steps: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(first.metrics.len(), 2);
        let rest = train(&layout(to, &run), &RunOptions::default()).unwrap();
        assert_eq!(
            rest.first_step, 2,
            "{to:?}: resumed after the two saved steps"
        );
        let losses: Vec<f64> = first
            .metrics
            .iter()
            .chain(&rest.metrics)
            .map(|m| m.loss)
            .collect();
        assert_eq!(losses.len(), whole.metrics.len());
        for (step, (got, want)) in losses
            .iter()
            .zip(whole.metrics.iter().map(|m| m.loss))
            .enumerate()
        {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "{to:?}, step {step}: {got} vs {want}"
            );
        }
        // The mirror: another global batch a step is refused before anything runs.
        let mut other = layout((to.0, 1, to.2), &run);
        other.steps = 6;
        let err = train(&other, &RunOptions::default()).unwrap_err();
        assert!(err.is_usage(), "{err}");
        assert!(err.to_string().contains("the global batch"), "{err}");
    }
    std::fs::remove_dir_all(&base).ok();
}

/// Saves step 1, then fails after each file of the step-2 save in turn: the previous checkpoint
/// stays `latest` and loads; the partial one is never picked up.
#[test]
fn a_failure_after_any_file_of_a_save_leaves_the_previous_checkpoint() {
    let cfg = config(&[]);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
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
                let mut e = Engine::new(&mut cx, &plan, None)?;
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
        let newest = latest(&root)
            .unwrap()
            .expect("a checkpoint is still named by `latest`");
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
                let mut e = Engine::new(&mut cx, &plan, None)?;
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
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, &plan, None)?;
            feed(&mut cx, &mut e, source.as_ref(), &cfg, 0, 0)?;
            e.save_checkpoint(&mut cx, root)
        },
    )
    .unwrap()
    .remove(0)
}

fn restore_error(cfg: &TrainConfig, path: &Path) -> String {
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let out = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, &plan, None)?;
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
    // wrong shape: a (sealed) manifest that claims a wider model
    let (root, dir) = fresh("shape");
    edit_manifest(&dir, true, |m| m["config"]["base_emb_dim"] = 48.into());
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
        .replace("\"format_version\": 3", "\"format_version\": 99");
    std::fs::write(&m, text).unwrap();
    assert!(restore_error(&cfg, &root)
        .contains("format version 99 is newer than this ferrotext reads (3)"));
    // a manifest of format 2 (MoE/MLA weights in the old orientation): refused, named
    let (root, dir) = fresh("older");
    let m = dir.join("manifest.json");
    let text = std::fs::read_to_string(&m)
        .unwrap()
        .replace("\"format_version\": 3", "\"format_version\": 2");
    std::fs::write(&m, text).unwrap();
    assert!(restore_error(&cfg, &root).contains(
        "format version 2 stores MoE and MLA weights in an orientation this ferrotext no longer reads"
    ));
    // a manifest pointing outside its directory
    let (root, dir) = fresh("outside");
    let m = dir.join("manifest.json");
    let text = std::fs::read_to_string(&m)
        .unwrap()
        .replace("\"params.safetensors\"", "\"../params.safetensors\"");
    std::fs::write(&m, text).unwrap();
    seal(&dir);
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
        "older",
        "outside",
        "latest",
    ] {
        std::fs::remove_dir_all(scratch(name)).ok();
    }
}

/// Lion's one state slot is saved, sharded over `data` under ZeRO-1 and restored like AdamW's
/// two.
#[test]
fn mid_step_round_trip_with_lion_and_zero1_is_bitwise_equal() {
    mid_step_round_trip(&["opt_type=lion", "shard_optimizer_over_data=true"]);
}

#[test]
fn mid_step_round_trip_with_zero1_is_bitwise_equal() {
    mid_step_round_trip(&["shard_optimizer_over_data=true"]);
}

/// Rewrites `manifest.sha256` to match `manifest.json` (as a deliberate editor would).
fn seal(dir: &Path) {
    use sha2::Digest;
    let bytes = std::fs::read(dir.join("manifest.json")).unwrap();
    let hash: String = sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    std::fs::write(
        dir.join("manifest.sha256"),
        format!("{hash}  manifest.json\n"),
    )
    .unwrap();
}

/// Edits `manifest.json` of `dir` as JSON; `reseal` also fixes its seal.
fn edit_manifest(dir: &Path, reseal: bool, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut m);
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    if reseal {
        seal(dir);
    }
}

/// Every file under `root` (symlinks as their target text), by relative path.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                out.insert(rel, format!("-> {}", target.display()).into_bytes());
            } else if meta.is_dir() {
                out.insert(rel, b"<dir>".to_vec());
                todo.push(path);
            } else {
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let dest = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &dest);
        } else {
            std::fs::copy(&path, &dest).unwrap();
        }
    }
}

/// A run's config under `base` with checkpoints every step.
fn run_config(base: &Path, run: &str, extra: &[&str]) -> TrainConfig {
    let dir = format!("base_output_directory={}", base.display());
    let run = format!("run_name={run}");
    let mut all = vec![
        dir.as_str(),
        run.as_str(),
        "enable_checkpointing=true",
        "checkpoint_period=1",
    ];
    all.extend_from_slice(extra);
    config(&all)
}

fn train_steps(cfg: &TrainConfig, steps: Option<usize>) -> Result<Vec<usize>, TrainError> {
    let report = train(
        cfg,
        &RunOptions {
            stop_after_steps: steps,
            ..Default::default()
        },
    )?;
    Ok(report.metrics.iter().map(|m| m.step).collect())
}

/// Every way `latest` can be unreadable: the run stops with a checkpoint error naming it, and
/// not one byte of the checkpoint directory changes (before: a silent fresh run from step 0
/// that overwrote `step_00000001_micro_000` and `step_00000002_micro_000`).
#[test]
fn an_unreadable_latest_is_an_error_and_nothing_is_overwritten() {
    let base = scratch("bad-latest");
    let template = run_config(&base, "template", &[]);
    assert_eq!(train_steps(&template, Some(2)).unwrap(), vec![0, 1]);
    let template_root = template.checkpoint_root();
    type Spoil = fn(&Path);
    let variants: [(&str, Spoil, &str); 7] = [
        (
            "empty",
            |r| std::fs::write(r.join("latest"), "").unwrap(),
            "latest: is empty",
        ),
        (
            "garbage",
            |r| std::fs::write(r.join("latest"), "\u{0}zz garbage\n").unwrap(),
            "which is not a checkpoint name",
        ),
        (
            "binary",
            |r| std::fs::write(r.join("latest"), [0xff, 0xfe, 0x00]).unwrap(),
            "latest: is not text",
        ),
        (
            "missing-step",
            |r| std::fs::write(r.join("latest"), "step_00000009_micro_000").unwrap(),
            "names `step_00000009_micro_000`, which does not exist",
        ),
        (
            "symlink",
            |r| {
                std::fs::write(r.join("latest.real"), "step_00000002_micro_000").unwrap();
                std::fs::remove_file(r.join("latest")).unwrap();
                std::os::unix::fs::symlink("latest.real", r.join("latest")).unwrap();
            },
            "latest: is a symlink",
        ),
        (
            "no-manifest",
            |r| std::fs::remove_file(r.join("step_00000002_micro_000/manifest.json")).unwrap(),
            "step_00000002_micro_000: named by `latest`, has no manifest.json",
        ),
        (
            "no-latest",
            |r| std::fs::remove_file(r.join("latest")).unwrap(),
            "latest: is missing but the directory holds 2 checkpoint(s)",
        ),
    ];
    for (name, spoil, expected) in variants {
        let cfg = run_config(&base, name, &[]);
        let root = cfg.checkpoint_root();
        copy_dir(&template_root, &root);
        spoil(&root);
        let before = snapshot(&root);
        let err = train_steps(&cfg, None).expect_err(name);
        let msg = err.to_string();
        assert!(
            matches!(err, TrainError::Checkpoint { .. }),
            "{name}: {msg}"
        );
        assert!(msg.contains(expected), "{name}: {msg}");
        assert!(msg.contains("resume=fresh"), "{name}: {msg}");
        assert_eq!(msg.lines().count(), 1, "{name}: {msg}");
        assert!(snapshot(&root) == before, "{name}: the checkpoints changed");
    }
    // A checkpoint that `latest` names but that does not load (a bad seal) stops the run too.
    let cfg = run_config(&base, "unsealed", &[]);
    let root = cfg.checkpoint_root();
    copy_dir(&template_root, &root);
    std::fs::write(root.join("step_00000002_micro_000/manifest.sha256"), "0").unwrap();
    let before = snapshot(&root);
    let msg = train_steps(&cfg, None).unwrap_err().to_string();
    assert!(msg.contains("cannot be verified"), "{msg}");
    assert!(snapshot(&root) == before);
    std::fs::remove_dir_all(&base).ok();
}

/// `resume=fresh` starts at step 0 — even over an unreadable `latest` — and moves the old
/// checkpoint directory aside, byte for byte.
#[test]
fn resume_fresh_starts_over_and_moves_the_old_checkpoints_aside() {
    let base = scratch("fresh");
    let cfg = run_config(&base, "run", &[]);
    train_steps(&cfg, Some(2)).unwrap();
    let root = cfg.checkpoint_root();
    std::fs::write(root.join("latest"), "garbage").unwrap();
    let old = snapshot(&root);
    let fresh = run_config(&base, "run", &["resume=fresh"]);
    assert_eq!(train_steps(&fresh, Some(1)).unwrap(), vec![0]);
    let moved: Vec<PathBuf> = std::fs::read_dir(base.join("run"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("checkpoints.replaced_")
        })
        .collect();
    assert_eq!(moved.len(), 1, "{moved:?}");
    assert!(
        snapshot(&moved[0]) == old,
        "the old checkpoints moved intact"
    );
    assert!(latest(&root)
        .unwrap()
        .unwrap()
        .ends_with("step_00000001_micro_000"));
    assert!(!root.join("step_00000002_micro_000").exists());
    // Back to `auto`: it continues from the new run's step 1.
    assert_eq!(train_steps(&cfg, Some(1)).unwrap(), vec![1]);
    std::fs::remove_dir_all(&base).ok();
}

/// A mid-step checkpoint at step 1, micro-step 1 (AdamW, so all four files).
fn mid_step_checkpoint(root: &Path) -> PathBuf {
    let cfg = config(&[]);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, &plan, None)?;
            for micro in 0..2 {
                feed(&mut cx, &mut e, source.as_ref(), &cfg, 0, micro)?;
            }
            e.update(&mut cx)?;
            feed(&mut cx, &mut e, source.as_ref(), &cfg, 1, 0)?;
            e.save_checkpoint(&mut cx, root)
        },
    )
    .unwrap()
    .remove(0)
}

/// Each tampering with the manifest — sealed again, or not — is an error naming the problem
/// (before: all of them loaded, e.g. a zero denominator doubled the step's loss and a dropped
/// optimizer file reset the Adam moments).
#[test]
fn manifest_tampering_is_an_error_naming_the_problem() {
    let cfg = config(&[]);
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, bool, Edit, &str); 10] = [
        (
            "step+1",
            true,
            |m| m["step"] = 2.into(),
            "says step 2 micro-step 1, but its directory is `step_00000001_micro_001`",
        ),
        (
            "step-1",
            true,
            |m| m["step"] = 0.into(),
            "optimizer_steps 1 is more than step 0",
        ),
        (
            "micro>=ga",
            true,
            |m| m["micro_steps"] = 2.into(),
            "micro_steps 2 is not below gradient_accumulation_steps 2",
        ),
        (
            "zero-denominator",
            true,
            |m| m["token_denominator"] = 0.into(),
            "token_denominator 0 is outside 1..=64",
        ),
        (
            "big-denominator",
            true,
            |m| m["token_denominator"] = 65.into(),
            "token_denominator 65 is outside 1..=64",
        ),
        (
            "no-optimizer",
            true,
            |m| {
                m["files"]
                    .as_object_mut()
                    .unwrap()
                    .remove("optimizer.safetensors");
            },
            "does not list optimizer.safetensors",
        ),
        (
            "position",
            true,
            |m| m["sequences_consumed"] = 13.into(),
            "sequences_consumed 13 does not match step 1 micro-step 1 of its config (12)",
        ),
        (
            "loss-nan",
            true,
            |m| m["pending_loss_sum_bits"] = f64::NAN.to_bits().into(),
            "pending_loss_sum NaN is not finite",
        ),
        (
            "unsealed-edit",
            false,
            |m| m["pending_loss_sum"] = 1.0.into(),
            "manifest.json: checksum mismatch with manifest.sha256",
        ),
        (
            "unsealed-config",
            false,
            |m| m["config"]["gradient_accumulation_steps"] = 4.into(),
            "manifest.json: checksum mismatch with manifest.sha256",
        ),
    ];
    for (name, reseal, edit, expected) in cases {
        let root = scratch(&format!("tamper-{name}"));
        let dir = mid_step_checkpoint(&root);
        edit_manifest(&dir, reseal, edit);
        // Loaded through `latest` and by its own directory alike.
        for path in [&root, &dir] {
            let err = restore_error(&cfg, path);
            assert!(err.contains(expected), "{name}: {err}");
        }
        std::fs::remove_dir_all(&root).ok();
    }
    // No seal at all.
    let root = scratch("tamper-no-seal");
    let dir = mid_step_checkpoint(&root);
    std::fs::remove_file(dir.join("manifest.sha256")).unwrap();
    let err = restore_error(&cfg, &dir);
    assert!(
        err.contains("manifest.sha256: cannot read") && err.contains("cannot be verified"),
        "{err}"
    );
    std::fs::remove_dir_all(&root).ok();
}

/// A mid-step checkpoint restored under a changed config: keys that change the data, the
/// model or the optimizer are errors naming the key and both values; the schedule may change.
#[test]
fn a_changed_config_on_resume_is_an_error_naming_the_key() {
    let root = scratch("changed-config");
    mid_step_checkpoint(&root);
    for (change, expected) in [
        (
            "gradient_accumulation_steps=4",
            "the global batch (per_device_batch_size × devices × gradient_accumulation_steps) \
             was 8 sequences a step when saved, now 16",
        ),
        (
            "vocab_size=128",
            "vocab_size was 256 when saved, now 128; only steps, learning_rate",
        ),
        (
            "max_target_length=8",
            "max_target_length was 16 when saved, now 8",
        ),
        (
            "per_device_batch_size=2",
            "the global batch (per_device_batch_size × devices × gradient_accumulation_steps) \
             was 8 sequences a step when saved, now 16 (per_device_batch_size was 1.0 when \
             saved, now 2.0)",
        ),
        (
            "data_shuffle_seed=7",
            "data_shuffle_seed was 0 when saved, now 7",
        ),
        (
            "opt_type=sgd",
            "opt_type was \"adamw\" when saved, now \"sgd\"",
        ),
        (
            "dataset_order=sequential",
            "dataset_order was \"random\" when saved",
        ),
    ] {
        let err = restore_error(&config(&[change]), &root);
        assert!(err.contains(expected), "{change}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // The same global batch cut into other micro-batches: fine at a step boundary, refused
    // inside a step.
    let err = restore_error(
        &config(&["gradient_accumulation_steps=1", "per_device_batch_size=2"]),
        &root,
    );
    assert!(
        err.contains(
            "was taken inside a step, after 1 of 2 micro-batches of 4 sequences: it resumes \
             only with the same micro-batches, now 1 of 8"
        ),
        "{err}"
    );
    // The schedule and the cadence may change.
    let cfg = config(&[
        "steps=10",
        "learning_rate=0.05",
        "checkpoint_keep=3",
        "collective_timeout_seconds=60",
    ]);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let restored = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut e = Engine::new(&mut cx, &plan, None)?;
            e.restore_checkpoint(&mut cx, &root)?;
            Ok((e.steps_taken(), e.pending_micro_steps()))
        },
    )
    .unwrap();
    assert_eq!(restored[0], (1, 1));
    std::fs::remove_dir_all(&root).ok();
}

/// What killed saves leave behind (`.tmp_*` directories, `.latest.tmp`) is removed when the
/// next run starts, which then resumes normally.
#[test]
fn start_up_removes_stale_temporaries() {
    let base = scratch("stale");
    let cfg = run_config(&base, "run", &[]);
    train_steps(&cfg, Some(2)).unwrap();
    let root = cfg.checkpoint_root();
    let stale = root.join(".tmp_step_00000003_micro_000_424242");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("params.safetensors"), b"half a file").unwrap();
    std::fs::write(root.join(".latest.tmp"), "step_0000").unwrap();
    assert_eq!(train_steps(&cfg, Some(1)).unwrap(), vec![2]);
    assert!(!stale.exists(), "the stale temporary directory is gone");
    assert!(!root.join(".latest.tmp").exists());
    std::fs::remove_dir_all(&base).ok();
}

/// `checkpoint_keep=2`: after every save only the two newest checkpoints remain; other
/// directories under the root are left alone.
#[test]
fn checkpoint_keep_leaves_exactly_the_two_newest() {
    let base = scratch("keep");
    let cfg = run_config(&base, "run", &["checkpoint_keep=2"]);
    let root = cfg.checkpoint_root();
    std::fs::create_dir_all(root.join("notes")).unwrap();
    std::fs::create_dir_all(root.join("step_00000000_micro_000.bak")).unwrap();
    assert_eq!(train_steps(&cfg, None).unwrap(), vec![0, 1, 2, 3]);
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "latest",
            "notes",
            "step_00000000_micro_000.bak",
            "step_00000003_micro_000",
            "step_00000004_micro_000",
        ]
    );
    std::fs::remove_dir_all(&base).ok();
}

/// Saving again under a name that exists, failing at every point of the save: at each point a
/// complete checkpoint of that name is in place or set aside, and after start-up the one
/// `latest` names loads with the saved weights (before: the old directory was deleted before
/// the new one was renamed in).
#[test]
fn re_saving_the_same_name_keeps_a_loadable_checkpoint_at_every_point() {
    let cfg = config(&[]);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let name = "step_00000001_micro_000";
    for fail_at in [
        "params.safetensors",
        "optimizer.safetensors",
        "manifest.json",
        "aside",
        "rename",
        "latest",
    ] {
        let root = scratch(&format!("resave-{fail_at}"));
        let whole = Mutex::new(Vec::new());
        let outcome = run_spmd(
            &mesh,
            &SpmdOptions::default(),
            |dev| -> Result<_, TrainError> {
                let mut cx = Ctx::new(dev.comm(), 1);
                let mut e = Engine::new(&mut cx, &plan, None)?;
                for micro in 0..2 {
                    feed(&mut cx, &mut e, source.as_ref(), &cfg, 0, micro)?;
                }
                e.update(&mut cx)?;
                e.save_checkpoint(&mut cx, &root)?;
                let hook = |point: &str| {
                    // A complete checkpoint of this name exists at every point of the save.
                    let in_place = root.join(name).join("manifest.json").is_file();
                    let aside = root.join(format!(".old_{name}/manifest.json")).is_file();
                    whole
                        .lock()
                        .unwrap()
                        .push((point.to_string(), in_place || aside));
                    if point == fail_at {
                        Err(std::io::Error::other(format!("injected after {point}")))
                    } else {
                        Ok(())
                    }
                };
                let failed = e.save_checkpoint_with_hook(&mut cx, &root, &hook);
                Ok((
                    e.params_to_host(&mut cx)?,
                    failed.err().map(|e| e.to_string()),
                ))
            },
        )
        .unwrap();
        let (saved, err) = &outcome[0];
        let err = err.clone().unwrap_or_default();
        assert!(
            err.contains(&format!("injected after {fail_at}")),
            "{fail_at}: {err}"
        );
        for (point, ok) in whole.lock().unwrap().iter() {
            assert!(ok, "{fail_at}: no complete checkpoint at `{point}`");
        }
        // Start-up finishes or undoes the replacement; the checkpoint loads.
        let dir = prepare_resume(&run_like(&cfg), &root, true)
            .unwrap()
            .expect("a checkpoint to resume from");
        assert!(dir.ends_with(name), "{fail_at}: {}", dir.display());
        assert!(!root.join(format!(".old_{name}")).exists());
        let restored = run_spmd(
            &mesh,
            &SpmdOptions::default(),
            |dev| -> Result<_, TrainError> {
                let mut cx = Ctx::new(dev.comm(), 1);
                let mut e = Engine::new(&mut cx, &plan, None)?;
                e.restore_checkpoint(&mut cx, &dir)?;
                Ok((e.steps_taken(), e.params_to_host(&mut cx)?))
            },
        )
        .unwrap();
        assert_eq!(restored[0].0, 1);
        assert!(&restored[0].1 == saved, "{fail_at}: the weights came back");
        std::fs::remove_dir_all(&root).ok();
    }
}

/// `cfg` with checkpointing on (what [`prepare_resume`] looks at).
fn run_like(cfg: &TrainConfig) -> TrainConfig {
    TrainConfig {
        enable_checkpointing: true,
        ..cfg.clone()
    }
}
