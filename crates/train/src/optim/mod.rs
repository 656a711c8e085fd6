//! Optimizers on f32 master weights (this device's shards): which optimizer a run uses
//! ([`OptType`], the `opt_type` key) with every fact that depends on it — the state it keeps per
//! parameter ([`OptType::slots`]), the bytes that state and its step take, the checkpoint file
//! the state goes to — and one device's state and step ([`Optimizer`]).
//!
//! # Files
//!
//! | file | what it owns |
//! |---|---|
//! | `mod.rs` | [`OptType`] and its facts, [`Hyper`], [`Optimizer`]: the state as slots, the step's dispatch |
//! | `sgd.rs`, `adamw.rs`, `lion.rs` | one optimizer each: its slots and its step on one device's shards |
//! | `checked.rs` | the entry points that check what they are given: [`Optimizer::apply`] (reduced gradients only) and [`Optimizer::set_state`] (a checkpoint's state, shapes checked) |
//!
//! Invariant: everything outside this folder that depends on the optimizer — the plan's memory
//! estimate, the cost model, checkpoints (what they write and check), ZeRO-1's sharding of the
//! state — reads it from [`OptType`]'s methods or from the slots, never from a match on the
//! variant. So an optimizer is added by a file beside `adamw.rs` (its `SLOTS` and `step`), its
//! variant with an arm in [`OptType::slots`] and [`Optimizer::step`], and its name in
//! [`OPT_TYPE_FORM`].

use ferrotext_tensor::Tensor;
use serde::{Deserialize, Serialize};

mod adamw;
mod checked;
mod lion;
mod sgd;

/// `opt_type`: the optimizer a run steps with (MaxText's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptType {
    /// AdamW with decoupled weight decay on matrices.
    Adamw,
    /// Plain SGD.
    Sgd,
    /// Lion: the sign of an interpolated momentum, one state slot.
    Lion,
}

/// The `opt_type` values, as `ferrotext keys` lists them.
pub const OPT_TYPE_FORM: &str = "adamw|sgd|lion";

/// The checkpoint file an optimizer's state goes to (none for one that keeps no state): each
/// slot's tensor of parameter `name` as `<slot>/<name>`.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

impl OptType {
    /// The state it keeps: one f32 tensor of the parameter's shape per slot, named here
    /// (`m`, `v` for AdamW; none for SGD). Checkpoints store slot `s` of parameter `p` as
    /// `s/p`.
    pub fn slots(self) -> &'static [&'static str] {
        match self {
            OptType::Adamw => adamw::SLOTS,
            OptType::Sgd => sgd::SLOTS,
            OptType::Lion => lion::SLOTS,
        }
    }

    /// Whether it keeps any state (and a step count) between steps.
    pub fn keeps_state(self) -> bool {
        !self.slots().is_empty()
    }

    /// Bytes of state per parameter element it steps (4 per f32 slot).
    pub fn state_bytes_per_element(self) -> usize {
        4 * self.slots().len()
    }

    /// Bytes its step streams through memory per element it steps: the parameter read and
    /// written and the gradient read (3 × 4), and each slot read and written (2 × 4 a slot) —
    /// AdamW 28, SGD 12.
    pub fn step_bytes_per_element(self) -> usize {
        12 + 8 * self.slots().len()
    }

    /// The checkpoint file its state goes to, `None` when it keeps none.
    pub fn checkpoint_file(self) -> Option<&'static str> {
        self.keeps_state().then_some(OPTIMIZER_FILE)
    }
}

/// The optimizer keys MaxText's Adam family reads (`adam_b1`, `adam_b2`, `adam_eps`,
/// `adam_weight_decay`); an optimizer takes those it has a use for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    /// β1 (`adam_b1`): the first moment's decay.
    pub b1: f64,
    /// β2 (`adam_b2`): the second moment's decay.
    pub b2: f64,
    /// ε (`adam_eps`).
    pub eps: f64,
    /// Decoupled weight decay on matrices (`adam_weight_decay`), scaled by the learning rate.
    pub weight_decay: f64,
}

/// What one step of an optimizer is told besides the tensors.
#[derive(Clone, Copy, Debug)]
struct Step {
    /// The learning rate of this step.
    lr: f64,
    /// What each gradient is multiplied by as it is read (one over the tokens, times the
    /// clipping factor).
    grad_scale: f32,
    /// Steps taken, this one included (1 on the first).
    t: u64,
}

/// One device's optimizer: its type, keys and state on this device's shards.
#[derive(Clone, Debug)]
pub struct Optimizer {
    kind: OptType,
    hyper: Hyper,
    /// `slots[s][p]`: slot `s` of [`OptType::slots`] for parameter shard `p`.
    slots: Vec<Vec<Tensor>>,
    /// Steps taken.
    steps: u64,
}

impl Optimizer {
    /// An optimizer of type `kind` for shards of these shapes, its state zero.
    pub fn new(kind: OptType, hyper: Hyper, shapes: &[Vec<usize>]) -> Optimizer {
        let slots = kind
            .slots()
            .iter()
            .map(|_| {
                shapes
                    .iter()
                    .map(|s| Tensor::accumulator_zeros(s))
                    .collect()
            })
            .collect();
        Optimizer {
            kind,
            hyper,
            slots,
            steps: 0,
        }
    }

    /// Its type.
    pub fn kind(&self) -> OptType {
        self.kind
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
        self.steps += 1;
        let step = Step {
            lr,
            grad_scale,
            t: self.steps,
        };
        let state = &mut self.slots;
        match self.kind {
            OptType::Adamw => adamw::step(&self.hyper, step, params, grads, state, decay),
            OptType::Sgd => sgd::step(&self.hyper, step, params, grads, state, decay),
            OptType::Lion => lion::step(&self.hyper, step, params, grads, state, decay),
        }
    }

    /// Its state and step count, slot-major as [`Optimizer`] keeps it (`state[s][p]`); `None`
    /// for an optimizer that keeps none.
    pub fn state(&self) -> Option<(&[Vec<Tensor>], u64)> {
        self.kind
            .keeps_state()
            .then_some((self.slots.as_slice(), self.steps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hyper() -> Hyper {
        Hyper {
            b1: 0.9,
            b2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }

    #[test]
    fn the_facts_follow_the_slots() {
        assert_eq!(OptType::Adamw.slots(), ["m", "v"]);
        assert!(OptType::Sgd.slots().is_empty());
        assert_eq!(
            (
                OptType::Adamw.step_bytes_per_element(),
                OptType::Sgd.step_bytes_per_element()
            ),
            (28, 12)
        );
        assert_eq!(OptType::Adamw.state_bytes_per_element(), 8);
        assert_eq!(OptType::Adamw.checkpoint_file(), Some(OPTIMIZER_FILE));
        assert_eq!(OptType::Sgd.checkpoint_file(), None);
        // Every variant is in the keys' form, in serde's spelling.
        for kind in [OptType::Adamw, OptType::Sgd, OptType::Lion] {
            let name = serde_json::to_value(kind).unwrap();
            let name = name.as_str().unwrap();
            assert!(OPT_TYPE_FORM.split('|').any(|n| n == name), "{name}");
        }
    }

    #[test]
    fn adamw_first_step_matches_hand_computation_and_sgd_steps_by_lr_times_g() {
        let mut opt = Optimizer::new(OptType::Adamw, hyper(), &[vec![2]]);
        let mut p = Tensor::new(vec![2], vec![1.0, -1.0]).unwrap();
        let g = Tensor::new(vec![2], vec![0.5, -2.0]).unwrap();
        opt.step(0.1, 3.0, &mut [&mut p], &[&g], &[false]);
        // bias-corrected m/√v = g/|g| on the first step: each weight moves by lr·sign(g)
        assert!((p.data()[0] - 0.9).abs() < 1e-6);
        assert!((p.data()[1] + 0.9).abs() < 1e-6);
        assert_eq!(opt.state().map(|(s, t)| (s.len(), t)), Some((2, 1)));
        let mut sgd = Optimizer::new(OptType::Sgd, hyper(), &[vec![1]]);
        let mut q = Tensor::new(vec![1], vec![1.0]).unwrap();
        sgd.step(
            0.1,
            2.0,
            &mut [&mut q],
            &[&Tensor::new(vec![1], vec![1.0]).unwrap()],
            &[false],
        );
        assert!((q.data()[0] - 0.8).abs() < 1e-7);
        assert!(sgd.state().is_none());
    }
}
