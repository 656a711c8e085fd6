//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; optax's `lion`, with
//! MaxText's keys as its forks that offer `opt_type=lion` read them): the update is the sign of
//! an interpolation between the momentum and the gradient, so every element moves by the
//! learning rate; one state slot.
//!
//! ```text
//! c = β1·m + (1 − β1)·g          (β1 = adam_b1)
//! w ← w − lr·(sign(c) + λ·w)     (λ = adam_weight_decay, matrices only; sign(0) = 0)
//! m ← β2·m + (1 − β2)·g          (β2 = adam_b2)
//! ```
//!
//! `g` is the gradient the step is defined on (divided by the step's tokens and clipped), as
//! for AdamW. Lion's authors suggest a learning rate 3–10× smaller than AdamW's and a weight
//! decay as much larger. The loop runs on the device's thread (no kernel of `ferrotext_tensor`):
//! it is one pass over the state, like SGD's.

use ferrotext_tensor::Tensor;

use super::{Hyper, Step};

/// The momentum `m`.
pub(super) const SLOTS: &[&str] = &["m"];

/// `x`'s sign, 0 for ±0 (as `jnp.sign`; `f32::signum` gives ±1 there).
fn sign(x: f32) -> f32 {
    if x == 0.0 {
        0.0
    } else {
        x.signum()
    }
}

/// One step on every shard (see [`super::Optimizer::step`]).
pub(super) fn step(
    hyper: &Hyper,
    step: Step,
    params: &mut [&mut Tensor],
    grads: &[&Tensor],
    state: &mut [Vec<Tensor>],
    decay: &[bool],
) {
    let [m] = state else {
        // `Optimizer::new` made one entry per slot: one.
        return;
    };
    let (b1, b2) = (hyper.b1 as f32, hyper.b2 as f32);
    let lr = step.lr as f32;
    for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
        let wd = if decay[i] {
            hyper.weight_decay as f32
        } else {
            0.0
        };
        let moments = m[i].data_mut();
        for ((w, &raw), m) in p.data_mut().iter_mut().zip(g.data()).zip(moments) {
            let g = raw * step.grad_scale;
            let update = sign(b1 * *m + (1.0 - b1) * g);
            *w -= lr * (update + wd * *w);
            *m = b2 * *m + (1.0 - b2) * g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{OptType, Optimizer};
    use super::*;

    /// Two steps written out by hand from the definition in the module docs.
    #[test]
    fn two_steps_match_the_definition() {
        let hyper = Hyper {
            b1: 0.9,
            b2: 0.99,
            eps: 1e-8,
            weight_decay: 0.5,
        };
        let mut opt = Optimizer::new(OptType::Lion, hyper, &[vec![3]]);
        let mut p = Tensor::new(vec![3], vec![1.0, -2.0, 0.5]).unwrap();
        // Scaled by 2 as it is read: g = [0.5, -1, 0].
        let g = Tensor::new(vec![3], vec![0.25, -0.5, 0.0]).unwrap();
        opt.step(0.1, 2.0, &mut [&mut p], &[&g], &[true]);
        // m = 0: sign(0.1·g) = [1, −1, 0]; w −= 0.1·(sign + 0.5·w).
        let want1 = [
            1.0 - 0.1 * (1.0 + 0.5),
            -2.0 - 0.1 * (-1.0 - 1.0),
            0.5 - 0.1 * 0.25,
        ];
        for (a, b) in p.data().iter().zip(want1) {
            assert!((a - b).abs() < 1e-6, "{:?} vs {want1:?}", p.data());
        }
        // m = 0.01·g = [0.005, −0.01, 0]; a gradient against the momentum's sign.
        let g2 = Tensor::new(vec![3], vec![-0.001, 0.001, 0.0]).unwrap();
        opt.step(0.1, 2.0, &mut [&mut p], &[&g2], &[false]);
        // c = 0.9·m + 0.1·g2·2 = [0.0045 − 0.0002, −0.009 + 0.0002, 0]: the momentum wins.
        let want2 = [want1[0] - 0.1, want1[1] + 0.1, want1[2]];
        for (a, b) in p.data().iter().zip(want2) {
            assert!((a - b).abs() < 1e-6, "{:?} vs {want2:?}", p.data());
        }
        let (slots, steps) = opt.state().unwrap();
        assert_eq!(steps, 2);
        let m = slots[0][0].data();
        let want_m = 0.99 * 0.01 * 0.5 + 0.01 * (-0.002);
        assert!((m[0] - want_m).abs() < 1e-7, "{m:?}");
        assert_eq!(OptType::Lion.slots(), ["m"]);
        assert_eq!(OptType::Lion.step_bytes_per_element(), 20);
    }
}
