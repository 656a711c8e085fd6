//! The engine API: a caller driving `fwd_bwd` and `update` itself gets exactly the trainer's
//! weights; the accumulator stays partial across calls; misuse is an error.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions};
use ferrotext_spmd::Ctx;
use ferrotext_train::data::{micro_batch, source_for, TokenSource};
use ferrotext_train::{Engine, TrainConfig, TrainError, Trainer};

fn config() -> TrainConfig {
    let items: Vec<String> = [
        "base_emb_dim=32",
        "base_mlp_dim=64",
        "head_dim=8",
        "max_target_length=16",
        "per_device_batch_size=1",
        "gradient_accumulation_steps=3",
        "dataset_type=synthetic",
        "steps=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    TrainConfig::load(None, &items).unwrap()
}

#[test]
fn engine_driven_by_hand_equals_the_trainer() {
    let cfg = config();
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut trainer = Trainer::new(&mut cx, &plan, source.clone(), None)?;
            let mut engine = Engine::new(&mut cx, &plan, None)?;
            let (mut t_losses, mut e_losses) = (Vec::new(), Vec::new());
            for step in 0..2u64 {
                t_losses.push(trainer.step(&mut cx)?.loss);
                cx.comm().take_trace();
                for micro in 0..3 {
                    cx.comm().push_phase(format!("micro_batch {micro}"));
                    let rows = micro_batch(
                        source.as_ref(),
                        step,
                        micro,
                        3,
                        cfg.micro_batch_rows(),
                        cfg.max_target_length,
                    );
                    let batch = engine.batch(&cx, &rows)?;
                    engine.fwd_bwd(&mut cx, &batch)?;
                    assert_eq!(engine.pending_micro_steps(), micro + 1);
                    cx.comm().pop_phase();
                }
                // The accumulator stayed partial across the three calls.
                assert!(cx
                    .comm()
                    .trace()
                    .all_reduces_larger_than(1, &PhasePattern::new("micro_batch*"))
                    .is_empty());
                e_losses.push(engine.update(&mut cx)?.loss);
                assert_eq!(engine.pending_micro_steps(), 0);
            }
            let t = trainer.engine().params_to_host(&mut cx)?;
            let e = engine.params_to_host(&mut cx)?;
            Ok((t_losses, e_losses, t, e))
        },
    )
    .unwrap();
    let (tl, el, t, e) = &results[0];
    assert_eq!(tl, el);
    assert_eq!(t, e, "bitwise equal weights");
}

#[test]
fn update_without_micro_batches_is_an_error_and_eval_changes_nothing() {
    let cfg = config();
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut engine = Engine::new(&mut cx, &plan, None)?;
            let err = engine.update(&mut cx).err().map(|e| e.to_string());
            let rows = micro_batch(
                source.as_ref(),
                0,
                0,
                1,
                cfg.micro_batch_rows(),
                cfg.max_target_length,
            );
            let batch = engine.batch(&cx, &rows)?;
            let before = engine.params_to_host(&mut cx)?;
            let eval = engine.eval_step(&mut cx, &batch)?;
            let after = engine.params_to_host(&mut cx)?;
            let fb = engine.fwd_bwd(&mut cx, &batch)?;
            cx.comm().push_phase("update");
            engine.update(&mut cx)?;
            let updates = cx
                .comm()
                .trace()
                .count(CollectiveKind::AllReduce, &PhasePattern::new("update"));
            Ok((err, eval, fb, before == after, updates))
        },
    )
    .unwrap();
    let (err, eval, fb, unchanged, updates) = &results[0];
    assert!(err
        .as_ref()
        .unwrap()
        .contains("no fwd_bwd since the last update"));
    assert_eq!(eval, fb, "eval and fwd_bwd see the same loss");
    assert!(unchanged);
    assert!(*updates > 0);
}

#[test]
fn a_micro_batch_after_the_final_one_is_an_error_until_update() {
    let cfg = config();
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut engine = Engine::new(&mut cx, &plan, None)?;
            let rows = micro_batch(source.as_ref(), 0, 0, 1, cfg.micro_batch_rows(), 16);
            let batch = engine.batch(&cx, &rows)?;
            engine.fwd_bwd_final(&mut cx, &batch)?;
            let err = engine.fwd_bwd(&mut cx, &batch).err().map(|e| e.to_string());
            engine.update(&mut cx)?;
            // A new step opens again.
            engine.fwd_bwd(&mut cx, &batch)?;
            Ok(err)
        },
    )
    .unwrap();
    assert!(results[0]
        .as_deref()
        .is_some_and(|e| e.contains("fwd_bwd after fwd_bwd_final")));
}

/// A micro-batch with a token past the vocabulary (an input, then the last target) is refused
/// by `batch` on every device at once, and changes nothing: the step's other micro-batches give
/// the weights and loss of a step that never saw it, bit for bit. Made by hand past `batch`'s
/// check, the same rows failed in one device's lookup only and left the others waiting in a
/// collective (a mismatch error for the whole mesh).
#[test]
fn a_batch_past_the_vocabulary_is_refused_on_every_device_and_loses_nothing() {
    let cfg = config();
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    assert!(
        mesh.device_count() > 1,
        "the bad row sits on one device of several"
    );
    let vocab = plan.decoder().config().vocab_size as u32;
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let run = |with_bad_batches: bool| {
        run_spmd(
            &mesh,
            &SpmdOptions::default(),
            |dev| -> Result<_, TrainError> {
                let mut cx = Ctx::new(dev.comm(), 1);
                let mut engine = Engine::new(&mut cx, &plan, None)?;
                let rows = |micro| {
                    micro_batch(
                        source.as_ref(),
                        0,
                        micro,
                        3,
                        cfg.micro_batch_rows(),
                        cfg.max_target_length,
                    )
                };
                let mut errors = Vec::new();
                for micro in 0..3 {
                    if with_bad_batches && micro == 1 {
                        for at in [0, cfg.max_target_length] {
                            let mut bad = rows(micro);
                            bad[0][at] = vocab + 7;
                            let err = engine.batch(&cx, &bad).err().map(|e| e.to_string());
                            errors.push((err, engine.pending_micro_steps()));
                        }
                    }
                    let batch = engine.batch(&cx, &rows(micro))?;
                    engine.fwd_bwd(&mut cx, &batch)?;
                }
                let loss = engine.update(&mut cx)?.loss;
                Ok((errors, loss, engine.params_to_host(&mut cx)?))
            },
        )
        .unwrap()
    };
    let with_bad = run(true);
    let clean = run(false);
    for (device, ((errors, loss, params), (_, clean_loss, clean_params))) in
        with_bad.iter().zip(&clean).enumerate()
    {
        assert_eq!(errors.len(), 2);
        for ((err, pending), role) in errors.iter().zip(["an input", "a target"]) {
            let err = err.as_deref().unwrap_or_default();
            assert!(
                err.contains(&format!("token {} ({role}) is past", vocab + 7)),
                "device {device}: {err}"
            );
            assert_eq!(*pending, 1, "the refused batch is not counted");
        }
        assert_eq!(loss, clean_loss);
        assert_eq!(
            params, clean_params,
            "bitwise the step without the refused batch"
        );
    }
}
