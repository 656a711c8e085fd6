//! SGD: `p ← p − lr·g`. It keeps no state.

use ferrotext_tensor::{sgd_update, Tensor};

use super::{Hyper, Step};

/// No state.
pub(super) const SLOTS: &[&str] = &[];

/// One step on every shard (see [`super::Optimizer::step`]).
pub(super) fn step(
    _hyper: &Hyper,
    step: Step,
    params: &mut [&mut Tensor],
    grads: &[&Tensor],
    _state: &mut [Vec<Tensor>],
    _decay: &[bool],
) {
    let k = step.lr as f32 * step.grad_scale;
    for (p, g) in params.iter_mut().zip(grads) {
        sgd_update(p.data_mut(), g.data(), k);
    }
}
