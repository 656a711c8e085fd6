//! The optimizer's entry points that check what they are given: [`Optimizer::apply`] takes only
//! reduced gradients ([`Gradients`]), and [`Optimizer::set_state`] only a state of the shapes
//! the optimizer keeps.

use std::borrow::Cow;

use ferrotext_spmd::Array;
use ferrotext_tensor::Tensor;

use super::Optimizer;
use crate::error::TrainError;
use crate::gradients::Gradients;

impl Optimizer {
    /// Replaces the state and the step count with a checkpoint's: `slots[s][p]`, slot-major
    /// in [`super::OptType::slots`] order, each of the shape the optimizer keeps for shard `p`.
    ///
    /// # Errors
    /// [`TrainError::Misuse`]: an optimizer that keeps no state, or slots of the wrong number
    /// or shapes.
    pub fn set_state(&mut self, slots: Vec<Vec<Tensor>>, steps: u64) -> Result<(), TrainError> {
        let misuse = |reason: String| TrainError::Misuse {
            call: "Optimizer::set_state",
            reason,
        };
        if !self.kind.keeps_state() {
            return Err(misuse(format!(
                "opt_type {:?} keeps no state to restore",
                self.kind
            )));
        }
        let fits = |a: &[Tensor], b: &[Tensor]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.shape() == y.shape())
        };
        if slots.len() != self.slots.len()
            || self.slots.iter().zip(&slots).any(|(a, b)| !fits(a, b))
        {
            return Err(misuse("optimizer state does not fit the parameters".into()));
        }
        self.slots = slots;
        self.steps = steps;
        Ok(())
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
        params: &mut [Array],
        grads: &Gradients,
        decay: &[bool],
    ) -> Result<(), TrainError> {
        // Bytes: each parameter, gradient and state slot read once, the parameter and the slots
        // written once (4 bytes an element each).
        let _span = ferrotext_profile::span_in("optimizer", ferrotext_profile::Phase::Optimizer)
            .map(|s| s.bytes((4 * grads.local_elements() * (3 + 2 * self.slots.len())) as f64));
        let grad_owned: Vec<Cow<'_, Tensor>> = grads
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
    use super::super::{Hyper, OptType};
    use super::*;

    #[test]
    fn a_state_that_does_not_fit_is_refused_and_one_that_does_is_taken() {
        let hyper = Hyper {
            b1: 0.9,
            b2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let zeros = |n: usize| Tensor::new(vec![n], vec![0.0; n]).unwrap();
        let mut adamw = Optimizer::new(OptType::Adamw, hyper, &[vec![2]]);
        assert!(adamw.set_state(vec![vec![zeros(2)]], 3).is_err());
        assert!(adamw
            .set_state(vec![vec![zeros(3)], vec![zeros(3)]], 3)
            .is_err());
        adamw
            .set_state(vec![vec![zeros(2)], vec![zeros(2)]], 3)
            .unwrap();
        assert_eq!(adamw.state().map(|(_, t)| t), Some(3));
        let mut sgd = Optimizer::new(OptType::Sgd, hyper, &[vec![2]]);
        let err = sgd.set_state(vec![], 1).unwrap_err();
        assert!(err.to_string().contains("keeps no state"), "{err}");
    }
}
