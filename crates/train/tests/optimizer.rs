//! The optimizer against its definition. Several steps of the engine (AdamW with weight decay on
//! and off, SGD, Lion; global-norm clipping engaged) are checked against an f64 implementation
//! written here from the formulas — optax's `adamw`: moments of the gradient divided by the
//! step's tokens and clipped, bias correction, ε outside the root, decoupled weight decay
//! `lr·wd·w` on matrices; optax's `lion`: the sign of `β1·m + (1−β1)·g`, the same decay, `m`
//! decayed by β2 — fed by gradients computed independently: one device, the whole step's
//! sequences in one batch, the model's loss differentiated directly (no engine, no accumulator).

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_sharding::{NamedSharding, PartitionSpec};
use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;
use ferrotext_train::data::{micro_batch, source_for, TokenSource};
use ferrotext_train::{learning_rate, Engine, OptType, TrainConfig, TrainError};

mod common;

/// The step's gradient sum (f64, per parameter, flat), its target-token count and loss sum,
/// computed at `params` on one device from the step's rows in one batch.
fn reference_gradient(
    cx: &mut Ctx<'_>,
    engine: &Engine,
    params: &[Tensor],
    rows: &[Vec<u32>],
) -> Result<(Vec<Vec<f64>>, f64), TrainError> {
    let len = rows[0].len() - 1;
    let inputs: Vec<u32> = rows.iter().flat_map(|r| r[..len].to_vec()).collect();
    let targets: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    let shape = [rows.len(), len];
    let inputs = cx.ids_from_global(&shape, PartitionSpec::replicated(), &inputs)?;
    let targets_ids = cx.ids_from_global(&shape, PartitionSpec::replicated(), &targets)?;
    let arrays = params
        .iter()
        .map(|p| {
            cx.from_global(
                p,
                NamedSharding::new(cx.mesh().clone(), PartitionSpec::replicated())?,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let model = engine.plan().decoder();
    let (_, grads) = cx.value_and_grad(&arrays, |cx, ps| {
        model.loss_sum(cx, ps, &inputs, &targets_ids)
    })?;
    let grads = grads
        .iter()
        .map(|g| {
            Ok(cx
                .to_host(g)?
                .data()
                .iter()
                .map(|&x| f64::from(x))
                .collect())
        })
        .collect::<Result<Vec<Vec<f64>>, TrainError>>()?;
    Ok((grads, targets.len() as f64))
}

/// AdamW, SGD or Lion in f64, from the definitions.
struct Reference {
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    t: i32,
}

impl Reference {
    /// One step from `w` with the raw gradient sum `g` over `tokens` target tokens; returns the
    /// new weights and the global norm of `g / tokens`.
    fn step(
        &mut self,
        cfg: &TrainConfig,
        step: usize,
        w: &[Tensor],
        g: &[Vec<f64>],
        tokens: f64,
    ) -> (Vec<Vec<f64>>, f64) {
        let lr = learning_rate(cfg, step);
        let norm = g
            .iter()
            .flatten()
            .map(|x| (x / tokens) * (x / tokens))
            .sum::<f64>()
            .sqrt();
        let thr = cfg.gradient_clipping_threshold;
        let clip = if thr > 0.0 && norm > thr {
            thr / norm
        } else {
            1.0
        };
        self.t += 1;
        let mut out = Vec::with_capacity(w.len());
        for (i, (wi, gi)) in w.iter().zip(g).enumerate() {
            let decay = if wi.shape().len() >= 2 {
                cfg.adam_weight_decay
            } else {
                0.0
            };
            let mut next = Vec::with_capacity(gi.len());
            for (j, (&x, &raw)) in wi.data().iter().zip(gi).enumerate() {
                let x = f64::from(x);
                let d = raw / tokens * clip;
                next.push(if cfg.opt_type == OptType::Sgd {
                    x - lr * d
                } else if cfg.opt_type == OptType::Lion {
                    let m = &mut self.m[i][j];
                    let c = cfg.adam_b1 * *m + (1.0 - cfg.adam_b1) * d;
                    let sign = if c == 0.0 { 0.0 } else { c.signum() };
                    *m = cfg.adam_b2 * *m + (1.0 - cfg.adam_b2) * d;
                    x - lr * (sign + decay * x)
                } else {
                    let m = &mut self.m[i][j];
                    let v = &mut self.v[i][j];
                    *m = cfg.adam_b1 * *m + (1.0 - cfg.adam_b1) * d;
                    *v = cfg.adam_b2 * *v + (1.0 - cfg.adam_b2) * d * d;
                    let m_hat = *m / (1.0 - cfg.adam_b1.powi(self.t));
                    let v_hat = *v / (1.0 - cfg.adam_b2.powi(self.t));
                    x - lr * (m_hat / (v_hat.sqrt() + cfg.adam_eps) + decay * x)
                });
            }
            out.push(next);
        }
        (out, norm)
    }
}

/// Runs `steps` engine steps on one device and the reference beside it (re-synchronised to the
/// engine's f32 weights before each step, its f64 moments carried over); returns, per step, the
/// largest weight difference relative to the step's largest weight change, and the relative
/// difference of the gradient norms.
fn compare(extra: &[&str]) -> Vec<(f64, f64)> {
    let mut items = vec![
        "local_devices=1",
        "steps=4",
        "gradient_accumulation_steps=2",
    ];
    items.extend_from_slice(extra);
    let cfg = common::small_config(&items);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut engine = Engine::new(&mut cx, &plan, None)?;
            let sizes: Vec<usize> = engine
                .param_infos()
                .iter()
                .map(|p| p.shape.iter().product())
                .collect();
            let mut reference = Reference {
                m: sizes.iter().map(|&n| vec![0.0; n]).collect(),
                v: sizes.iter().map(|&n| vec![0.0; n]).collect(),
                t: 0,
            };
            let ga = cfg.gradient_accumulation_steps;
            let mut out = Vec::new();
            for step in 0..cfg.steps {
                let before = engine.params_to_host(&mut cx)?;
                let mut rows = Vec::new();
                for micro in 0..ga {
                    let mb = micro_batch(
                        source.as_ref(),
                        step as u64,
                        micro,
                        ga,
                        cfg.micro_batch_rows(),
                        cfg.max_target_length,
                    );
                    let batch = engine.batch(&cx, &mb)?;
                    engine.fwd_bwd(&mut cx, &batch)?;
                    rows.extend(mb);
                }
                let metrics = engine.update(&mut cx)?;
                let after = engine.params_to_host(&mut cx)?;
                let (g, tokens) = reference_gradient(&mut cx, &engine, &before, &rows)?;
                let (want, norm) = reference.step(&cfg, step, &before, &g, tokens);
                let (mut diff, mut change) = (0.0f64, 0.0f64);
                for ((w0, w1), r) in before.iter().zip(&after).zip(&want) {
                    for ((&a, &b), &c) in w0.data().iter().zip(w1.data()).zip(r) {
                        diff = diff.max((f64::from(b) - c).abs());
                        change = change.max((c - f64::from(a)).abs());
                    }
                }
                out.push((diff / change, (metrics.grad_norm - norm).abs() / norm));
            }
            Ok(out)
        },
    )
    .unwrap();
    results.into_iter().next().unwrap()
}

fn assert_matches(extra: &[&str]) {
    for (step, (weights, norm)) in compare(extra).into_iter().enumerate() {
        assert!(
            weights < 1e-2,
            "{extra:?} step {step}: weights differ from the f64 reference by {weights:.2e} of the step's change"
        );
        assert!(
            norm < 1e-5,
            "{extra:?} step {step}: grad norm differs from the f64 reference by {norm:.2e}"
        );
    }
}

#[test]
fn adamw_with_clipping_and_weight_decay_matches_its_definition() {
    assert_matches(&[
        "opt_type=adamw",
        "gradient_clipping_threshold=0.05",
        "adam_weight_decay=0.1",
        "learning_rate=0.01",
    ]);
}

#[test]
fn adamw_without_weight_decay_and_with_a_large_epsilon_matches_its_definition() {
    // ε of the order of the scaled gradient: it only matches if ε is compared with the gradient
    // after the division by tokens.
    assert_matches(&[
        "opt_type=adamw",
        "gradient_clipping_threshold=0.05",
        "adam_weight_decay=0",
        "adam_eps=1e-3",
        "learning_rate=0.01",
    ]);
}

#[test]
fn sgd_with_clipping_matches_its_definition() {
    assert_matches(&[
        "opt_type=sgd",
        "gradient_clipping_threshold=0.05",
        "learning_rate=0.5",
    ]);
}

/// Lion moves every weight by the learning rate (plus decay), so a weight whose `c` is within
/// rounding of 0 could move the other way in the reference: the portable kernel fixes the
/// engine's bits on every processor, and none of this run's weights is that close.
#[test]
fn lion_with_clipping_and_weight_decay_matches_its_definition() {
    assert_matches(&[
        "opt_type=lion",
        "deterministic=true",
        "gradient_clipping_threshold=0.05",
        "adam_weight_decay=0.5",
        "adam_b2=0.99",
        "learning_rate=0.001",
    ]);
}

#[test]
fn clipping_changes_adamw_training() {
    // The mirror of the bug this file guards: with the scale ignored, clipping did nothing.
    let clipped = common::run(&["opt_type=adamw", "gradient_clipping_threshold=0.01"]);
    let free = common::run(&["opt_type=adamw", "gradient_clipping_threshold=0"]);
    assert!(
        common::max_rel_diff(&clipped, &free) > 1e-3,
        "clipping had no effect on AdamW"
    );
}
