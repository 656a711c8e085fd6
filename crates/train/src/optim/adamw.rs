//! AdamW (Loshchilov & Hutter; optax's `adamw`, as MaxText's `opt_type=adamw` builds it): bias
//! corrected first and second moments, and weight decay decoupled from the gradient, on matrices
//! only, scaled by the learning rate. The fused kernel is `ferrotext_tensor::adamw_update`.

use ferrotext_tensor::{adamw_update, AdamW, Tensor};

use super::{Hyper, Step};

/// The first moment `m` and the second `v`.
pub(super) const SLOTS: &[&str] = &["m", "v"];

/// One step on every shard (see [`super::Optimizer::step`]).
pub(super) fn step(
    hyper: &Hyper,
    step: Step,
    params: &mut [&mut Tensor],
    grads: &[&Tensor],
    state: &mut [Vec<Tensor>],
    decay: &[bool],
) {
    let [m, v] = state else {
        // `Optimizer::new` made one entry per slot: two.
        return;
    };
    let (b1, b2, t) = (hyper.b1, hyper.b2, step.t as i32);
    let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    let constants = |weight_decay_step: f32| AdamW {
        b1: b1 as f32,
        b2: b2 as f32,
        step: (step.lr / c1) as f32,
        c2_sqrt: c2.sqrt() as f32,
        eps: hyper.eps as f32,
        decay: weight_decay_step,
        grad_scale: step.grad_scale,
    };
    for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
        let wd = if decay[i] {
            (step.lr * hyper.weight_decay) as f32
        } else {
            0.0
        };
        // The moments see the gradient the step is defined on: divided by the step's tokens and
        // clipped (Adam is not invariant to that scale once ε and the clip factor's step-to-step
        // changes count).
        adamw_update(
            p.data_mut(),
            g.data(),
            m[i].data_mut(),
            v[i].data_mut(),
            constants(wd),
        );
    }
}
