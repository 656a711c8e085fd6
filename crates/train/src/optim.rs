//! Optimizers on f32 master weights (this device's shards), the learning-rate schedule, and
//! global-norm clipping.

use ferrotext_tensor::{adamw_update, sgd_update, AdamW, Tensor};

use crate::config::{OptType, TrainConfig};

/// Linear warmup to the peak over `warmup_steps_fraction · steps`, then cosine decay to
/// `learning_rate_final_fraction · peak` at the last step.
pub fn learning_rate(config: &TrainConfig, step: usize) -> f64 {
    let peak = config.learning_rate;
    let warmup = (config.warmup_steps_fraction * config.steps as f64).round() as usize;
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = (config.steps - warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    let floor = config.learning_rate_final_fraction * peak;
    floor + (peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The scale that brings `norm` down to `threshold` (1 when under it, or when clipping is off).
pub fn clip_scale(norm: f64, threshold: f64) -> f64 {
    if threshold > 0.0 && norm > threshold {
        threshold / norm
    } else {
        1.0
    }
}

/// Optimizer state for one device's shards.
#[derive(Clone, Debug)]
pub enum Optimizer {
    /// `p ← p − lr·g`.
    Sgd,
    /// AdamW with bias correction and decoupled weight decay on matrices.
    AdamW {
        /// β1.
        b1: f64,
        /// β2.
        b2: f64,
        /// ε.
        eps: f64,
        /// Weight decay.
        weight_decay: f64,
        /// First moments, one per parameter shard.
        m: Vec<Tensor>,
        /// Second moments.
        v: Vec<Tensor>,
        /// Steps taken.
        t: u64,
    },
}

impl Optimizer {
    /// State for shards of these shapes.
    pub fn new(config: &TrainConfig, shapes: &[Vec<usize>]) -> Optimizer {
        match config.opt_type {
            OptType::Sgd => Optimizer::Sgd,
            OptType::Adamw => Optimizer::AdamW {
                b1: config.adam_b1,
                b2: config.adam_b2,
                eps: config.adam_eps,
                weight_decay: config.adam_weight_decay,
                m: shapes
                    .iter()
                    .map(|s| Tensor::accumulator_zeros(s))
                    .collect(),
                v: shapes
                    .iter()
                    .map(|s| Tensor::accumulator_zeros(s))
                    .collect(),
                t: 0,
            },
        }
    }

    /// One step on every shard, in place: the gradients are multiplied by `grad_scale` (one over
    /// the token count, times the clipping factor) as they are read. `decay[i]` says whether
    /// parameter `i` takes weight decay.
    pub fn step(
        &mut self,
        lr: f64,
        grad_scale: f32,
        params: &mut [&mut Tensor],
        grads: &[&Tensor],
        decay: &[bool],
    ) {
        match self {
            Optimizer::Sgd => {
                let k = lr as f32 * grad_scale;
                for (p, g) in params.iter_mut().zip(grads) {
                    sgd_update(p.data_mut(), g.data(), k);
                }
            }
            Optimizer::AdamW {
                b1,
                b2,
                eps,
                weight_decay,
                m,
                v,
                t,
            } => {
                *t += 1;
                let (c1, c2) = (1.0 - b1.powi(*t as i32), 1.0 - b2.powi(*t as i32));
                let constants = |weight_decay_step: f32| AdamW {
                    b1: *b1 as f32,
                    b2: *b2 as f32,
                    step: (lr / c1) as f32,
                    c2_sqrt: c2.sqrt() as f32,
                    eps: *eps as f32,
                    decay: weight_decay_step,
                    grad_scale,
                };
                for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
                    let wd = if decay[i] {
                        (lr * *weight_decay) as f32
                    } else {
                        0.0
                    };
                    // The moments see the gradient the step is defined on: divided by the step's
                    // tokens and clipped (Adam is not invariant to that scale once ε and the
                    // clip factor's step-to-step changes count).
                    adamw_update(
                        p.data_mut(),
                        g.data(),
                        m[i].data_mut(),
                        v[i].data_mut(),
                        constants(wd),
                    );
                }
            }
        }
    }
}

impl Optimizer {
    /// The AdamW moments and step count (`None` for SGD, which keeps no state).
    pub fn moments(&self) -> Option<(&[Tensor], &[Tensor], u64)> {
        match self {
            Optimizer::AdamW { m, v, t, .. } => Some((m, v, *t)),
            Optimizer::Sgd => None,
        }
    }

    /// Replaces the AdamW moments and step count (shards of the parameters' shapes).
    ///
    /// # Errors
    /// [`crate::TrainError::Misuse`]: SGD (no state to set) or moments of the wrong shapes.
    pub fn set_moments(
        &mut self,
        new_m: Vec<Tensor>,
        new_v: Vec<Tensor>,
        new_t: u64,
    ) -> Result<(), crate::TrainError> {
        match self {
            Optimizer::AdamW { m, v, t, .. } => {
                let fits = |a: &[Tensor], b: &[Tensor]| {
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.shape() == y.shape())
                };
                if !fits(m, &new_m) || !fits(v, &new_v) {
                    return Err(crate::TrainError::Misuse {
                        call: "Optimizer::set_moments",
                        reason: "optimizer moments do not fit the parameters".into(),
                    });
                }
                *m = new_m;
                *v = new_v;
                *t = new_t;
                Ok(())
            }
            Optimizer::Sgd => Err(crate::TrainError::Misuse {
                call: "Optimizer::set_moments",
                reason: "SGD keeps no moments to restore".into(),
            }),
        }
    }

    /// [`Optimizer::step`] on the parameters' shards with reduced gradients — the only form the
    /// optimizer accepts (see [`crate::PartialGradients`]). Shards nobody else holds are updated
    /// in place.
    ///
    /// # Errors
    /// An abstract (data-less) parameter or gradient.
    pub fn apply(
        &mut self,
        lr: f64,
        grad_scale: f32,
        params: &mut [ferrotext_spmd::Array],
        grads: &crate::gradients::Gradients,
        decay: &[bool],
    ) -> Result<(), crate::TrainError> {
        let _span = ferrotext_profile::span_in("optimizer", ferrotext_profile::Phase::Optimizer);
        let grad_owned: Vec<std::borrow::Cow<'_, Tensor>> = grads
            .arrays()
            .iter()
            .map(|g| g.local())
            .collect::<Result<_, _>>()?;
        let grad_locals: Vec<&Tensor> = grad_owned.iter().map(|g| &**g).collect();
        let mut param_locals: Vec<&mut Tensor> = params
            .iter_mut()
            .map(|p| p.local_mut())
            .collect::<Result<_, _>>()?;
        let decay: Vec<bool> = (0..param_locals.len())
            .map(|i| decay.get(i).copied().unwrap_or(false))
            .collect();
        self.step(lr, grad_scale, &mut param_locals, &grad_locals, &decay);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let c = TrainConfig {
            steps: 100,
            learning_rate: 1.0,
            warmup_steps_fraction: 0.1,
            learning_rate_final_fraction: 0.1,
            ..TrainConfig::default()
        };
        assert!((learning_rate(&c, 0) - 0.1).abs() < 1e-12);
        assert!((learning_rate(&c, 9) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&c, 10) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&c, 100) - 0.1).abs() < 1e-12);
        assert!(learning_rate(&c, 55) < 1.0 && learning_rate(&c, 55) > 0.1);
    }

    #[test]
    fn adamw_first_step_matches_hand_computation() {
        let c = TrainConfig {
            adam_b1: 0.9,
            adam_b2: 0.95,
            adam_eps: 1e-8,
            adam_weight_decay: 0.0,
            ..TrainConfig::default()
        };
        let mut opt = Optimizer::new(&c, &[vec![2]]);
        let mut p = Tensor::new(vec![2], vec![1.0, -1.0]).unwrap();
        let g = Tensor::new(vec![2], vec![0.5, -2.0]).unwrap();
        opt.step(0.1, 3.0, &mut [&mut p], &[&g], &[false]);
        // bias-corrected m/√v = g/|g| on the first step: each weight moves by lr·sign(g)
        assert!((p.data()[0] - 0.9).abs() < 1e-6);
        assert!((p.data()[1] + 0.9).abs() < 1e-6);
        let mut q = Tensor::new(vec![1], vec![1.0]).unwrap();
        Optimizer::Sgd.step(
            0.1,
            2.0,
            &mut [&mut q],
            &[&Tensor::new(vec![1], vec![1.0]).unwrap()],
            &[false],
        );
        assert!((q.data()[0] - 0.8).abs() < 1e-7);
        assert_eq!(clip_scale(2.0, 1.0), 0.5);
        assert_eq!(clip_scale(0.5, 1.0), 1.0);
        assert_eq!(clip_scale(5.0, 0.0), 1.0);
    }
}
