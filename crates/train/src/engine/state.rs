//! What a checkpoint sees of an engine and gives back: [`EngineState`], a read-only snapshot
//! between two calls, and [`Restored`], a whole state checked before [`Engine::install`] swaps
//! it in (an error leaves the engine as it was). A step in progress travels as its accumulator,
//! or under `layout_invariant=true` as its unit tree's subtrees.

use std::time::Instant;

use ferrotext_spmd::{Array, Ctx};
use ferrotext_tensor::Tensor;

use super::{Engine, Pending, StepSum};
use crate::error::TrainError;
use crate::gradients::{PartialGradients, UnitNode, UnitTree};
use crate::plan::RunPlan;
use ferrotext_sharding::ArrayType;

/// A read-only view of an engine's state between two calls: what a checkpoint saves.
pub(crate) struct EngineState<'a> {
    /// The plan (config, parameter declarations, layouts, gates).
    pub plan: &'a RunPlan,
    /// The parameters, in their storage layouts.
    pub params: &'a [Array],
    /// The optimizer's state shards, `[slot][parameter]`, and its step count (`None` for an
    /// optimizer that keeps none).
    pub opt_state: Option<(&'a [Vec<Tensor>], u64)>,
    /// The optimizer state's types.
    pub moment_types: &'a [ArrayType],
    /// The accumulator type of each gradient.
    pub promised: &'a [ArrayType],
    /// The accumulation in progress, if a step is under way.
    pub pending: Option<PendingState>,
    /// Optimizer steps taken.
    pub step: usize,
}

/// The accumulation part of an [`EngineState`].
pub(crate) struct PendingState {
    /// The accumulated (possibly partial) gradients (copies).
    pub sum: PendingSum,
    /// Micro-batches accumulated.
    pub micro_steps: usize,
    /// Their target tokens.
    pub tokens: u64,
    /// Their Σ token losses.
    pub loss_sum: f64,
    /// This device's expert loads so far (aux-loss-free balancing; empty when off).
    pub loads: ferrotext_models::decoder::ExpertLoads,
}

/// A step's gradients so far, as a checkpoint reads them (copies).
pub(crate) enum PendingSum {
    /// The accumulator's values.
    Accumulator(Vec<Array>),
    /// `layout_invariant=true`: the unit tree's complete subtrees, oldest first.
    Tree(Vec<TreeNodeState>),
}

/// A complete subtree of a step's unit tree (`layout_invariant=true`), this device's.
pub(crate) struct TreeNodeState {
    /// It sums `2^level` units.
    pub level: u32,
    /// Its gradients, typed as the engine promises.
    pub grads: Vec<Array>,
    /// Its loss partial sum.
    pub loss: Array,
}

/// A whole state to install ([`Engine::install`]), built and checked before the engine changes.
pub(crate) struct Restored {
    /// Parameters in their storage layouts.
    pub params: Vec<Array>,
    /// The optimizer's state shards, `[slot][parameter]`, and its step count.
    pub opt_state: Option<(Vec<Vec<Tensor>>, u64)>,
    /// The accumulation to continue, if the state was saved mid-step.
    pub pending: Option<RestoredPending>,
    /// Optimizer steps taken.
    pub step: usize,
}

/// The accumulation part of a [`Restored`] state.
pub(crate) struct RestoredPending {
    /// Accumulated gradients, typed as the engine promises: this device's sum so far.
    pub grads: Vec<Array>,
    /// The unit tree's subtrees, when the checkpoint kept them (written under
    /// `layout_invariant=true`) and they fit this mesh and layout.
    pub tree: Option<Vec<TreeNodeState>>,
    /// Σ token losses.
    pub loss_sum: f64,
    /// Target tokens.
    pub tokens: u64,
    /// Micro-batches accumulated.
    pub micro_steps: usize,
    /// This device's share of the step's expert loads so far (the totals on the first device
    /// of the batch axes, zeros elsewhere, so the update's sum gives the totals back).
    pub loads: ferrotext_models::decoder::ExpertLoads,
}

impl Engine {
    /// The state a checkpoint saves, read-only.
    ///
    /// # Errors
    /// A step whose reduction has started (after [`Engine::fwd_bwd_final`] with overlap): its
    /// accumulator is no longer readable.
    pub(crate) fn state(&self) -> Result<EngineState<'_>, TrainError> {
        let pending = match &self.pending {
            Some(p) => Some(PendingState {
                sum: match &p.sum {
                    StepSum::Accumulator(acc) => PendingSum::Accumulator(acc.grads.to_arrays()?),
                    StepSum::Tree(tree) => PendingSum::Tree(
                        tree.nodes()?
                            .iter()
                            .map(|node| {
                                Ok(TreeNodeState {
                                    level: node.level,
                                    grads: node.grads.grads.to_arrays()?,
                                    loss: node.loss.clone(),
                                })
                            })
                            .collect::<Result<_, TrainError>>()?,
                    ),
                },
                micro_steps: p.micro_steps,
                tokens: p.tokens,
                loss_sum: p.loss_sum,
                loads: p.loads.clone(),
            }),
            None => None,
        };
        Ok(EngineState {
            plan: &self.plan,
            params: &self.params,
            opt_state: self.opt.state(),
            moment_types: &self.moment_types,
            promised: &self.acc_types,
            pending,
            step: self.step,
        })
    }

    /// Swaps a whole restored state in (a checkpoint's): the parameters, the optimizer's
    /// state, the step, and the accumulation to continue — whose parameters re-enter the
    /// micro-batches in their inside layouts (a free cast). Nothing changes on an error.
    ///
    /// # Errors
    /// A state that does not fit the optimizer; a layout error.
    pub(crate) fn install(&mut self, cx: &mut Ctx<'_>, state: Restored) -> Result<(), TrainError> {
        let pending = match state.pending {
            Some(p) => Some(Pending {
                used: self.enter_micro_batches(cx, &state.params)?,
                sum: self.restored_sum(cx, p.grads, p.tree)?,
                loss_sum: p.loss_sum,
                tokens: p.tokens,
                micro_steps: p.micro_steps,
                loads: p.loads,
                // The MTP metric's sums are not in checkpoints: a step resumed mid-way reports
                // the MTP loss of its micro-batches since the resume (the weights are exact).
                mtp: (0.0, 0),
                started: Instant::now(),
                cpu_started: crate::CpuTime::now(),
                closed: false,
            }),
            None => None,
        };
        if let Some((slots, steps)) = state.opt_state {
            self.opt.set_state(slots, steps)?;
        }
        self.params = state.params;
        self.pending = pending;
        self.step = state.step;
        Ok(())
    }

    /// A restored step's sum so far, as this run sums: the accumulator, or under
    /// `layout_invariant=true` the unit tree, which only a checkpoint that kept it restores.
    ///
    /// # Errors
    /// A tree that the checkpoint did not keep (written without `layout_invariant=true`, or on
    /// another mesh or layout); values not typed as the accumulator's.
    fn restored_sum(
        &self,
        cx: &mut Ctx<'_>,
        grads: Vec<Array>,
        tree: Option<Vec<TreeNodeState>>,
    ) -> Result<StepSum, TrainError> {
        if !self.plan.config().layout_invariant {
            return Ok(StepSum::Accumulator(PartialGradients::from_arrays(
                cx,
                &grads,
                self.acc_plan.clone(),
            )?));
        }
        let nodes = tree.ok_or_else(|| {
            TrainError::usage(
                "layout_invariant",
                "layout_invariant=true continues a step from a checkpoint taken inside it only \
                 when that checkpoint kept the step's unit tree: written under \
                 layout_invariant=true on this mesh and split into micro-batches; resume from \
                 a step boundary instead",
            )
        })?;
        let nodes = nodes
            .into_iter()
            .map(|node| {
                Ok(UnitNode {
                    level: node.level,
                    grads: PartialGradients::from_arrays(cx, &node.grads, self.acc_plan.clone())?,
                    loss: node.loss,
                })
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        Ok(StepSum::Tree(UnitTree::from_nodes(nodes)?))
    }
}
