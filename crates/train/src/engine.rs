//! The engine: the training core as two calls, for callers that drive gradient accumulation
//! themselves (post-training and RL loops) and for the training loop ([`crate::train`]).
//!
//! * [`Engine::fwd_bwd`] runs forward and backward on one micro-batch and adds its gradients to
//!   the pending accumulator — typed `{U:data}` when the deferral gate is open, so nothing is
//!   communicated;
//! * [`Engine::update`] performs the step's one reduction, divides once by the tokens of every
//!   micro-batch since the last update, clips, and steps the optimizer.
//!
//! With the gate closed and [`Overlap::EveryMicroBatch`] (`shard_mode=auto` with
//! `overlap_grad_reduce=true`), the parameters still enter micro-batches tagged, each
//! micro-batch's gradients are reduced bucket by bucket while its backward runs (PyTorch DDP's
//! schedule), and the accumulator holds reduced gradients, so `update` reduces nothing.
//!
//! The accumulator is a [`PartialGradients`]: an opaque value whose only way out is
//! [`PartialGradients::reduce`], so partial sums can never reach the optimizer (or a reader)
//! unreduced. Every layout comes from the [`RunPlan`]; the engine decides nothing about it.
//! Checkpoints see the engine through [`EngineState`] (a read-only snapshot) and change it only
//! through [`Engine::install`], which swaps a whole restored state in.

use std::sync::Arc;
use std::time::Instant;

use ferrotext_models::init_normal;
use ferrotext_models::ParamInfo;
use ferrotext_sharding::{ArrayType, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, BucketPlan, Ctx, GradientSink, Ids, Mode};
use ferrotext_tensor::Tensor;
use serde::Serialize;

use crate::config::NanPolicy;
use crate::error::TrainError;
use crate::gate::{Deferral, Overlap, Zero1};
use crate::gradients::{FinishedTree, Gradients, PartialGradients, UnitNode, UnitTree};
use crate::optim::{clip_scale, learning_rate, Optimizer};
use crate::plan::{engine_rules, RunPlan};

/// What one step reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepMetrics {
    /// The step index (0-based).
    pub step: usize,
    /// Mean token loss of the step (Σ loss / Σ tokens).
    pub loss: f64,
    /// Target tokens in the step.
    pub tokens: u64,
    /// Global gradient norm after the division by tokens, before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub learning_rate: f64,
    /// Wall time of the step on this device (its micro-batches and the update).
    pub seconds: f64,
    /// The step's update was dropped because its loss or gradient was not finite
    /// (`nan_policy=skip_step`); parameters and optimizer state are as before the step.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// The data epoch the step's last sequence came from (`dataset_order=sequential` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Mean token loss on the held-out data after this step's update, on steps that evaluate
    /// (`eval_interval`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// `exp(eval_loss)`, on steps that evaluate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
}

/// One micro-batch: this device's blocks of the inputs and targets (`[rows, len]`, split over the
/// batch axes) and the micro-batch's target-token count.
#[derive(Clone, Debug)]
pub struct Batch {
    inputs: Ids,
    targets: Ids,
    tokens: u64,
}

/// What [`Engine::fwd_bwd`] reports for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FwdBwd {
    /// Σ token losses of the micro-batch (not divided).
    pub loss_sum: f64,
    /// Target tokens of the micro-batch.
    pub tokens: u64,
}

/// The accumulation in progress between updates.
struct Pending {
    /// Parameters as they enter micro-batches (`{R:data}` when deferred), cast once.
    used: Vec<Array>,
    sum: StepSum,
    loss_sum: f64,
    tokens: u64,
    micro_steps: usize,
    started: Instant,
    /// The step's last micro-batch has run (`fwd_bwd_final`): only `update` may follow.
    closed: bool,
}

/// How a step's micro-batches are summed.
enum StepSum {
    /// Into one accumulator, micro-batch after micro-batch (the default: each weight's gradient
    /// is added straight in by its product's kernel).
    Accumulator(PartialGradients),
    /// As a tree over units of one device's micro-batch (`layout_invariant=true`).
    Tree(UnitTree),
}

/// The per-device training engine. See the module docs.
pub struct Engine {
    plan: RunPlan,
    /// Layout inside micro-batches, per parameter: the plan's, unless a test hook overrode it
    /// (`Engine::override_inside_spec`, `fault-injection` feature).
    inside: Vec<PartitionSpec>,
    /// The accumulator's type per gradient: the type it leaves the backward pass with (the
    /// gate's promise), or under [`Overlap::EveryMicroBatch`] the reduced gradient's (the
    /// target layout).
    acc_types: Vec<ArrayType>,
    /// The optimizer state's types (the plan's targets on the parameters' shapes).
    moment_types: Vec<ArrayType>,
    params: Vec<Array>,
    opt: Optimizer,
    decay: Vec<bool>,
    step: usize,
    pending: Option<Pending>,
    /// The reduction of the backward's gradients in buckets (see [`PartialGradients::reduce`]):
    /// the step's, or each micro-batch's under [`Overlap::EveryMicroBatch`]. Its sources are
    /// the promised types.
    reduce_plan: Arc<BucketPlan>,
    /// The accumulator's reduction in `update`: `reduce_plan`, or a plan that moves nothing
    /// when every micro-batch reduced its own gradients.
    acc_plan: Arc<BucketPlan>,
    /// ZeRO-1: the parameters' all-gather after the step, in buckets.
    gather_plan: Option<BucketPlan>,
    /// `layout_invariant`: gradient sets of `acc_plan` left by the last step's tree, reused as
    /// the next step's units.
    unit_spares: Vec<PartialGradients>,
}

/// A read-only view of an engine's state between two calls: what a checkpoint saves.
pub(crate) struct EngineState<'a> {
    /// The plan (config, parameter declarations, layouts, gates).
    pub plan: &'a RunPlan,
    /// The parameters, in their storage layouts.
    pub params: &'a [Array],
    /// AdamW's moment shards and step count (`None` for SGD).
    pub moments: Option<(&'a [Tensor], &'a [Tensor], u64)>,
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
    /// AdamW's moment shards and step count.
    pub moments: Option<(Vec<Tensor>, Vec<Tensor>, u64)>,
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
}

/// The fewest buckets an overlapped reduction is split into: with one bucket (a model whose
/// gradients fit in `grad_bucket_mb`) nothing can start before the backward ends.
const OVERLAP_MIN_BUCKETS: usize = 8;

/// An overlapped reduction's bucket size: `configured`, but at most 1/[`OVERLAP_MIN_BUCKETS`]
/// of the `gradient_bytes` (and at least 1 MiB, so a bucket still amortises a collective's
/// latency), so the last micro-batch's backward has buckets to overlap. Measured on 2 emulated
/// hosts at 1 Gbit/s (qwen3-peer, 14 MiB of gradients, GA 4): one 25 MiB bucket 529 ms a step,
/// 2 MiB buckets 469 ms.
fn overlap_bucket_bytes(configured: usize, gradient_bytes: usize) -> usize {
    configured.min((gradient_bytes / OVERLAP_MIN_BUCKETS).max(1 << 20))
}

impl Engine {
    /// Places the parameters (from `initial` global values, or initialised from the seed) in
    /// the layouts `plan` decided.
    ///
    /// # Errors
    /// [`TrainError::Misuse`] for `initial` values that do not fit the model; a layout the
    /// device's mesh cannot hold.
    pub fn new(
        cx: &mut Ctx<'_>,
        plan: &RunPlan,
        initial: Option<&[Tensor]>,
    ) -> Result<Engine, TrainError> {
        let config = plan.config();
        let mesh = cx.mesh().clone();
        let mut moment_types = Vec::new();
        let mut inside = Vec::new();
        let mut promised = Vec::new();
        let mut params = Vec::new();
        let mut decay = Vec::new();
        let mut plain = Vec::new();
        for (i, (info, layout)) in plan.params().iter().zip(plan.layouts()).enumerate() {
            moment_types.push(cx.array_type(&info.shape, layout.target.clone())?);
            promised.push(
                cx.array_type(&info.shape, layout.inside.clone())?
                    .to_cotangent(),
            );
            let named = NamedSharding::new(mesh.clone(), layout.plain.clone())?;
            params.push(if cx.mode() == Mode::Abstract {
                // Planning: types and collectives only; no 2-GB initialisation for a 0.6B model.
                let ty = ArrayType::new(ferrotext_sharding::DType::F32, info.shape.clone(), named)?;
                cx.abstract_array(ty)
            } else {
                cx.from_global(
                    &initial_value(info, i, initial, config.init_weights_seed)?,
                    named,
                )?
            });
            plain.push(layout.plain.clone());
            inside.push(layout.inside.clone());
            decay.push(info.shape.len() >= 2);
        }
        let shapes: Vec<Vec<usize>> = moment_types.iter().map(ArrayType::shard_shape).collect();
        // Buckets filled from the last parameter back: the backward pass finishes the last
        // layers' gradients first.
        let bucket_bytes = config.grad_bucket_bytes();
        let backwards: Vec<usize> = (0..plan.params().len()).rev().collect();
        let targets: Vec<PartitionSpec> = plan.layouts().iter().map(|l| l.target.clone()).collect();
        let gradient_bytes: usize = promised
            .iter()
            .map(|t| t.shard_shape().iter().product::<usize>() * 4)
            .sum();
        let overlap = plan.overlap();
        let reduce_bucket_bytes = if matches!(overlap, Overlap::Off(_)) {
            bucket_bytes
        } else {
            overlap_bucket_bytes(bucket_bytes, gradient_bytes)
        };
        // `layout_invariant` under ZeRO-1: the gradients are all-reduced whole (twice a
        // reduce-scatter's bytes) so that the norm is the whole gradient's, summed alike on
        // every layout; the optimizer then takes each device's slice of them (free).
        let reduce_targets = if config.layout_invariant {
            &plain
        } else {
            &targets
        };
        let reduce_plan = Arc::new(cx.plan_buckets(
            &promised,
            reduce_targets,
            reduce_bucket_bytes,
            &backwards,
        )?);
        let (acc_types, acc_plan) = if overlap.every_micro_batch() {
            let reduced = moment_types.clone();
            let nothing = cx.plan_buckets(&reduced, &targets, bucket_bytes, &backwards)?;
            (reduced, Arc::new(nothing))
        } else {
            (promised.clone(), reduce_plan.clone())
        };
        let gather_plan = if plan.zero1().is_open() {
            Some(cx.plan_buckets(&moment_types, &plain, bucket_bytes, &backwards)?)
        } else {
            None
        };
        Ok(Engine {
            plan: plan.clone(),
            opt: if cx.mode() == Mode::Abstract {
                Optimizer::Sgd
            } else {
                Optimizer::new(config, &shapes)
            },
            inside,
            acc_types,
            moment_types,
            params,
            decay,
            step: 0,
            pending: None,
            reduce_plan,
            acc_plan,
            gather_plan,
            unit_spares: Vec::new(),
        })
    }

    /// The plan the engine runs.
    pub fn plan(&self) -> &RunPlan {
        &self.plan
    }

    /// The gate's decision.
    pub fn gate(&self) -> &Deferral {
        self.plan.deferral()
    }

    /// The parameters' declarations, in order.
    pub fn param_infos(&self) -> &[ParamInfo] {
        self.plan.params()
    }

    /// Uses `spec` for parameter `name` inside micro-batches instead of the gate's layout. A
    /// test hook (`fault-injection` feature): it simulates a helper that rebuilt the spec (e.g.
    /// from logical rules) and dropped the reduced tag, which the accumulator check must catch.
    #[cfg(feature = "fault-injection")]
    ///
    /// # Errors
    /// [`TrainError::Misuse`] for an unknown parameter name.
    pub fn override_inside_spec(
        &mut self,
        name: &str,
        spec: PartitionSpec,
    ) -> Result<(), TrainError> {
        let i = self
            .param_infos()
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| TrainError::Misuse {
                call: "Engine::override_inside_spec",
                reason: format!("no parameter `{name}`"),
            })?;
        self.inside[i] = spec;
        Ok(())
    }

    /// ZeRO-1's decision.
    pub fn zero1(&self) -> &Zero1 {
        self.plan.zero1()
    }

    /// This device's optimizer-state shards (AdamW `m` and `v`; `None` for SGD).
    pub fn optimizer_state(&self) -> Option<(&[Tensor], &[Tensor])> {
        self.opt.moments().map(|(m, v, _)| (m, v))
    }

    /// The layout of a micro-batch's `[rows, len]` token arrays.
    pub fn batch_spec(&self) -> &PartitionSpec {
        self.plan.batch_spec()
    }

    /// Optimizer steps taken.
    pub fn steps_taken(&self) -> usize {
        self.step
    }

    /// Micro-batches accumulated since the last update.
    pub fn pending_micro_steps(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.micro_steps)
    }

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
            }),
            None => None,
        };
        Ok(EngineState {
            plan: &self.plan,
            params: &self.params,
            moments: self.opt.moments(),
            moment_types: &self.moment_types,
            promised: &self.acc_types,
            pending,
            step: self.step,
        })
    }

    /// Swaps a whole restored state in (a checkpoint's): the parameters, the optimizer's
    /// moments, the step, and the accumulation to continue — whose parameters re-enter the
    /// micro-batches in their inside layouts (a free cast). Nothing changes on an error.
    ///
    /// # Errors
    /// Moments that do not fit the optimizer; a layout error.
    pub(crate) fn install(&mut self, cx: &mut Ctx<'_>, state: Restored) -> Result<(), TrainError> {
        let pending = match state.pending {
            Some(p) => Some(Pending {
                used: self.enter_micro_batches(cx, &state.params)?,
                sum: self.restored_sum(cx, p.grads, p.tree)?,
                loss_sum: p.loss_sum,
                tokens: p.tokens,
                micro_steps: p.micro_steps,
                started: Instant::now(),
                closed: false,
            }),
            None => None,
        };
        if let Some((m, v, t)) = state.moments {
            self.opt.set_moments(m, v, t)?;
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

    /// The parameters as they enter micro-batches: each cast to its inside layout. Under
    /// deferral the cast (plain → `{R:data}`) is free and sits outside the differentiated
    /// function (R4.8) — inside it, its transpose would put the all-reduce back into every
    /// micro-batch.
    fn enter_micro_batches(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
    ) -> Result<Vec<Array>, TrainError> {
        let mut used = Vec::with_capacity(params.len());
        for (p, spec) in params.iter().zip(&self.inside) {
            used.push(if p.ty().sharding().spec() == spec {
                p.clone()
            } else {
                cx.reshard(p, spec)?
            });
        }
        Ok(used)
    }

    /// A micro-batch from its global rows (each `len + 1` tokens: inputs then shifted targets;
    /// [`IGNORE_INDEX`](ferrotext_spmd::IGNORE_INDEX) targets are ignored). Every device passes the same rows and keeps its block.
    ///
    /// # Errors
    /// Rows of unequal length, or a count the batch axes do not divide.
    pub fn batch(&self, cx: &Ctx<'_>, rows: &[Vec<u32>]) -> Result<Batch, TrainError> {
        let len = rows.first().map_or(0, |r| r.len().saturating_sub(1));
        if len == 0 || rows.iter().any(|r| r.len() != len + 1) {
            return Err(TrainError::Data(
                "a batch needs rows of equal length ≥ 2".into(),
            ));
        }
        let inputs: Vec<u32> = rows.iter().flat_map(|s| s[..len].iter().copied()).collect();
        let targets: Vec<u32> = rows.iter().flat_map(|s| s[1..].iter().copied()).collect();
        let tokens = targets
            .iter()
            .filter(|&&t| t != ferrotext_spmd::IGNORE_INDEX)
            .count() as u64;
        let shape = [rows.len(), len];
        let spec = if rows.len() == self.plan.config().micro_batch_rows() {
            self.plan.batch_spec().clone()
        } else {
            engine_rules().resolve(&[Some("activation_batch"), None], &shape, cx.mesh())?
        };
        Ok(Batch {
            inputs: cx.ids_from_global(&shape, spec.clone(), &inputs)?,
            targets: cx.ids_from_global(&shape, spec, &targets)?,
            tokens,
        })
    }

    /// Forward and backward on one micro-batch; its gradients join the pending accumulator.
    ///
    /// # Errors
    /// [`TrainError::AccumulatorType`] when a gradient arrives typed differently from the gate's
    /// promise (nothing is reduced early); a call after [`Engine::fwd_bwd_final`] (the step is
    /// closed: call `update`); any op or collective failure.
    ///
    /// # Collectives
    /// Gate open: only the one-element loss all-reduce. Gate closed: each gradient's
    /// all-reduce, inside the backward pass — under [`Overlap::EveryMicroBatch`] one per bucket,
    /// started on the background channel as the bucket's gradients are finished.
    pub fn fwd_bwd(&mut self, cx: &mut Ctx<'_>, batch: &Batch) -> Result<FwdBwd, TrainError> {
        let overlap = self.plan.overlap().every_micro_batch();
        self.micro_batch(cx, batch, overlap)
    }

    /// [`Engine::fwd_bwd`] for the step's last micro-batch. With `overlap_grad_reduce`, each
    /// bucket of the step's reduction starts on the device's background stream as soon as the
    /// backward pass has finished every gradient in it, so the reduction runs while the rest of
    /// the backward computes, and [`Engine::update`] waits for it; without, this is `fwd_bwd`.
    /// Either way the step is closed: the next call must be `update`. The weights are bitwise
    /// those of the non-overlapped step (the same buckets, the same sums).
    ///
    /// # Errors
    /// As [`Engine::fwd_bwd`].
    ///
    /// # Collectives
    /// As [`Engine::fwd_bwd`], plus (overlap, gate open) the step's bucketed reduction on the
    /// background channel.
    pub fn fwd_bwd_final(&mut self, cx: &mut Ctx<'_>, batch: &Batch) -> Result<FwdBwd, TrainError> {
        let overlap = !matches!(self.plan.overlap(), Overlap::Off(_));
        let out = self.micro_batch(cx, batch, overlap)?;
        if let Some(pending) = &mut self.pending {
            pending.closed = true;
        }
        Ok(out)
    }

    /// One micro-batch; `overlap`: start each finished bucket's reduction during the backward
    /// (of the step's reduction, or under [`Overlap::EveryMicroBatch`] of this micro-batch's,
    /// which is then finished and added to the reduced accumulator).
    fn micro_batch(
        &mut self,
        cx: &mut Ctx<'_>,
        batch: &Batch,
        overlap: bool,
    ) -> Result<FwdBwd, TrainError> {
        if self.pending.is_none() {
            // Deferral: the parameters enter every micro-batch `{R:data}` (a free cast).
            let used = self.enter_micro_batches(cx, &self.params)?;
            let sum = if self.plan.config().layout_invariant {
                StepSum::Tree(UnitTree::new(std::mem::take(&mut self.unit_spares)))
            } else {
                StepSum::Accumulator(PartialGradients::zeros(cx, self.acc_plan.clone())?)
            };
            self.pending = Some(Pending {
                used,
                sum,
                loss_sum: 0.0,
                tokens: 0,
                micro_steps: 0,
                started: Instant::now(),
                closed: false,
            });
        }
        let pending = self
            .pending
            .as_mut()
            .ok_or_else(|| TrainError::Internal("no pending accumulation".into()))?;
        if pending.closed {
            return Err(TrainError::Misuse {
                call: "Engine::fwd_bwd",
                reason: "fwd_bwd after fwd_bwd_final: the step is closed, call update".into(),
            });
        }
        let model = self.plan.decoder();
        let infos = self.plan.params();
        let loss_sum = match &mut pending.sum {
            StepSum::Accumulator(acc) => {
                let loss = Self::accumulate_micro_batch(
                    cx,
                    &self.plan,
                    &self.reduce_plan,
                    &pending.used,
                    acc,
                    batch,
                    overlap,
                )?;
                if loss.is_abstract() {
                    0.0
                } else {
                    f64::from(loss.scalar()?)
                }
            }
            StepSum::Tree(tree) => {
                // A unit: this micro-batch's gradients from zero, its loss this device's
                // partial sum; the tree adds it in its place.
                let unit = tree.open_unit(cx, &self.acc_plan)?;
                let mut sink = AccumulatorSink::new(unit, false, infos);
                let loss = cx
                    .value_and_grad_into(
                        &pending.used,
                        |cx, ps| model.loss_partial_sum(cx, ps, &batch.inputs, &batch.targets),
                        &mut sink,
                    )
                    .map_err(|e| sink.wrong_type.take().unwrap_or(TrainError::from(e)))?;
                // The micro-batch's loss for the caller (one one-element all-reduce, as the
                // default path's loss); the step's loss comes from the tree.
                let reported = cx.reshard(&loss, &PartitionSpec::replicated())?;
                tree.close_unit(cx, loss)?;
                if reported.is_abstract() {
                    0.0
                } else {
                    f64::from(reported.scalar()?)
                }
            }
        };
        pending.loss_sum += loss_sum;
        pending.tokens += batch.tokens;
        pending.micro_steps += 1;
        Ok(FwdBwd {
            loss_sum,
            tokens: batch.tokens,
        })
    }

    /// One micro-batch's forward and backward into the step's accumulator `acc` (the default
    /// path): each gradient joins it as soon as the backward has finished it — a weight's added
    /// in by its product's kernel where it can be; with `overlap`, a bucket whose gradients are
    /// all in starts reducing at once. Under DDP (`Overlap::EveryMicroBatch`) the micro-batch's
    /// own gradients are reduced first and then added. Returns the loss.
    fn accumulate_micro_batch(
        cx: &mut Ctx<'_>,
        plan: &RunPlan,
        reduce_plan: &Arc<BucketPlan>,
        used: &[Array],
        acc: &mut PartialGradients,
        batch: &Batch,
        overlap: bool,
    ) -> Result<Array, TrainError> {
        let model = plan.decoder();
        // DDP: this micro-batch's own partial gradients, reduced before they join the step's.
        let mut own = if plan.overlap().every_micro_batch() {
            Some(PartialGradients::zeros(cx, reduce_plan.clone())?)
        } else {
            None
        };
        let target = match &mut own {
            Some(own) => own,
            None => &mut *acc,
        };
        let mut sink = AccumulatorSink::new(target, overlap, plan.params());
        let loss = cx
            .value_and_grad_into(
                used,
                |cx, ps| model.loss_sum(cx, ps, &batch.inputs, &batch.targets),
                &mut sink,
            )
            .map_err(|e| sink.wrong_type.take().unwrap_or(TrainError::from(e)))?;
        if let Some(own) = own {
            let reduced = own.reduce(cx)?;
            for (i, g) in reduced.arrays().iter().enumerate() {
                cx.accumulate_into(&mut acc.grads, i, g)?;
            }
        }
        Ok(loss)
    }

    /// The optimizer step over every micro-batch since the last update: the one reduction, one
    /// division by their total token count, global-norm clipping, the optimizer; then the
    /// accumulator is reset.
    ///
    /// The learning rate is the schedule's for this step ([`learning_rate`]).
    ///
    /// # Errors
    /// [`TrainError::Misuse`] when no micro-batch ran since the last update; a collective
    /// failure.
    ///
    /// # Collectives
    /// Gate open: one all-reduce per parameter (the deferred reduction), plus one-element norm
    /// reductions for parameters split over devices. Gate closed: only those.
    pub fn update(&mut self, cx: &mut Ctx<'_>) -> Result<StepMetrics, TrainError> {
        // The one place the schedule is read: every loop steps through here.
        let lr = learning_rate(self.plan.config(), self.step);
        let pending = self.pending.take().ok_or_else(|| TrainError::Misuse {
            call: "Engine::update",
            reason: "update called with no fwd_bwd since the last update".into(),
        })?;
        let Pending {
            used,
            sum,
            loss_sum,
            tokens,
            started,
            ..
        } = pending;
        drop(used);
        let (acc, loss_sum) = match sum {
            StepSum::Accumulator(acc) => (acc, loss_sum),
            StepSum::Tree(tree) => {
                let FinishedTree { grads, loss, spare } = tree.finish(cx)?.ok_or_else(|| {
                    TrainError::Internal("a pending step without micro-batches".into())
                })?;
                self.unit_spares = spare;
                let acc = grads;
                // The step's loss: the devices' subtrees completed by one all-reduce (the
                // collectives' tree), as the gradients' below.
                let loss = cx.reshard(&loss, &PartitionSpec::replicated())?;
                let loss_sum = if loss.is_abstract() {
                    0.0
                } else {
                    f64::from(loss.scalar()?)
                };
                (acc, loss_sum)
            }
        };
        let grads = acc.reduce(cx)?;
        let inv_tokens = 1.0 / tokens.max(1) as f64;
        let grad_norm = grads.squared_norm(cx)?.sqrt() * inv_tokens;
        let loss = loss_sum * inv_tokens;
        // Every device holds the same reduced loss and norm, so every device takes the same
        // branch here and the collectives below stay matched.
        let skipped = cx.mode() == Mode::Real && !(loss.is_finite() && grad_norm.is_finite());
        let config = self.plan.config();
        if skipped && config.nan_policy == NanPolicy::Stop {
            return Err(TrainError::NonFinite {
                step: self.step,
                loss,
                grad_norm,
            });
        }
        let grads = if config.layout_invariant && self.plan.zero1().is_open() {
            let targets: Vec<PartitionSpec> = self
                .plan
                .layouts()
                .iter()
                .map(|l| l.target.clone())
                .collect();
            grads.sliced(cx, &targets)?
        } else {
            grads
        };
        let scale = (inv_tokens * clip_scale(grad_norm, config.gradient_clipping_threshold)) as f32;
        // nan_policy=skip_step: a skipped update leaves parameters and moments as they were.
        if !skipped {
            self.apply_update(cx, lr, scale, &grads)?;
        }
        let metrics = StepMetrics {
            step: self.step,
            loss,
            tokens,
            grad_norm,
            learning_rate: lr,
            seconds: started.elapsed().as_secs_f64(),
            skipped,
            epoch: None,
            eval_loss: None,
            eval_perplexity: None,
        };
        self.step += 1;
        Ok(metrics)
    }

    /// The optimizer on the reduced gradients: in place, or under ZeRO-1 on this device's
    /// `data` slice of each parameter (a free local slice) followed by the parameters'
    /// all-gather, one per bucket.
    fn apply_update(
        &mut self,
        cx: &mut Ctx<'_>,
        lr: f64,
        scale: f32,
        grads: &Gradients,
    ) -> Result<(), TrainError> {
        if self.plan.zero1().is_open() {
            let mut slices = Vec::with_capacity(self.params.len());
            for (p, layout) in self.params.iter().zip(self.plan.layouts()) {
                let t = &layout.target;
                slices.push(if p.ty().sharding().spec() == t {
                    p.clone()
                } else {
                    cx.reshard(p, t)?
                });
            }
            if cx.mode() == Mode::Real {
                self.opt.apply(lr, scale, &mut slices, grads, &self.decay)?;
            }
            self.params = match &self.gather_plan {
                Some(plan) => cx.reshard_planned(plan, &slices)?,
                None => {
                    let plain: Vec<PartitionSpec> = self
                        .plan
                        .layouts()
                        .iter()
                        .map(|l| l.plain.clone())
                        .collect();
                    cx.reshard_bucketed(&slices, &plain, self.plan.config().grad_bucket_bytes())?
                }
            };
        } else if cx.mode() == Mode::Real {
            // Nothing else holds the parameters' shards now, so the update runs in place.
            self.opt
                .apply(lr, scale, &mut self.params, grads, &self.decay)?;
        }
        Ok(())
    }

    /// The loss sum and token count of a batch, without gradients or state changes.
    ///
    /// # Errors
    /// An op or collective failure.
    pub fn eval_step(&mut self, cx: &mut Ctx<'_>, batch: &Batch) -> Result<FwdBwd, TrainError> {
        let loss = self
            .plan
            .decoder()
            .loss_sum(cx, &self.params, &batch.inputs, &batch.targets)?;
        let loss_sum = if loss.is_abstract() {
            0.0
        } else {
            f64::from(loss.scalar()?)
        };
        Ok(FwdBwd {
            loss_sum,
            tokens: batch.tokens,
        })
    }

    /// The global parameter values (gathered; every device gets them).
    ///
    /// # Errors
    /// A collective failure.
    pub fn params_to_host(&self, cx: &mut Ctx<'_>) -> Result<Vec<Tensor>, TrainError> {
        self.params
            .iter()
            .map(|p| cx.to_host(p).map_err(TrainError::from))
            .collect()
    }
}

/// The error for a gradient that arrived typed differently from its accumulator.
/// The backward's gradients into a micro-batch's accumulator (see [`Engine::fwd_bwd`]):
/// offered in place to the kernels, checked against the accumulator's types, and (with
/// `overlap`) each bucket started as soon as all its gradients are in.
struct AccumulatorSink<'a> {
    acc: &'a mut PartialGradients,
    buckets: Vec<Vec<usize>>,
    /// Per gradient: in the accumulator.
    finished: Vec<bool>,
    /// Per bucket: its reduction started.
    in_flight: Vec<bool>,
    overlap: bool,
    infos: &'a [ParamInfo],
    /// The typed error behind a refused gradient (the walk only carries an `SpmdError`).
    wrong_type: Option<TrainError>,
}

impl<'a> AccumulatorSink<'a> {
    /// A sink into `acc`, starting each full bucket's reduction at once when `overlap`.
    fn new(acc: &'a mut PartialGradients, overlap: bool, infos: &'a [ParamInfo]) -> Self {
        AccumulatorSink {
            buckets: acc.plan.buckets().map(<[usize]>::to_vec).collect(),
            finished: vec![false; acc.grads.len()],
            in_flight: vec![false; acc.plan.buckets().count()],
            acc,
            overlap,
            infos,
            wrong_type: None,
        }
    }
}

impl GradientSink for AccumulatorSink<'_> {
    fn buffer(&mut self, k: usize, ty: &ArrayType) -> Option<Vec<&mut [f32]>> {
        self.acc.grads.value_mut(k, ty)
    }

    fn finished(
        &mut self,
        cx: &mut Ctx<'_>,
        k: usize,
        grad: Option<&Array>,
    ) -> Result<(), ferrotext_spmd::SpmdError> {
        if let Some(grad) = grad {
            let slot = self.acc.grads.ty(k);
            if grad.ty() != slot {
                self.wrong_type = Some(accumulator_type_error(&self.infos[k].name, slot, grad));
                return Err(ferrotext_spmd::SpmdError::BadArgument {
                    op: "fwd_bwd".into(),
                    reason: "a gradient's type differs from its accumulator's".into(),
                });
            }
            cx.accumulate_into(&mut self.acc.grads, k, grad)?;
        }
        self.finished[k] = true;
        if self.overlap {
            for (b, members) in self.buckets.iter().enumerate() {
                if !self.in_flight[b] && members.iter().all(|&m| self.finished[m]) {
                    let started =
                        cx.start_buffered_bucket(&self.acc.plan, b, &mut self.acc.grads)?;
                    self.acc.started.push(started);
                    self.in_flight[b] = true;
                }
            }
        }
        Ok(())
    }
}

fn accumulator_type_error(param: &str, acc: &ArrayType, grad: &Array) -> TrainError {
    TrainError::AccumulatorType {
        param: param.to_string(),
        expected: acc.to_string(),
        got: grad.ty().to_string(),
        expected_unreduced: acc.sharding().spec().unreduced().iter().cloned().collect(),
    }
}

/// Parameter `i`'s starting value: `initial[i]` checked against its declaration, or drawn from
/// the seed.
fn initial_value(
    info: &ParamInfo,
    i: usize,
    initial: Option<&[Tensor]>,
    seed: u64,
) -> Result<Tensor, TrainError> {
    let Some(values) = initial else {
        return Ok(init_normal(info, seed, i));
    };
    let misuse = |reason: String| TrainError::Misuse {
        call: "Engine::new",
        reason,
    };
    let v = values
        .get(i)
        .ok_or_else(|| misuse(format!("no initial value for `{}`", info.name)))?;
    if v.shape() != info.shape.as_slice() {
        return Err(misuse(format!(
            "`{}` has shape {:?}, the model needs {:?}",
            info.name,
            v.shape(),
            info.shape
        )));
    }
    Ok(v.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapped_buckets_split_a_small_model_and_leave_a_large_one_alone() {
        const MIB: usize = 1 << 20;
        // qwen3-peer's 14 MiB of gradients under 25 MiB buckets: 8 buckets of 1.75 MiB
        assert_eq!(overlap_bucket_bytes(25 * MIB, 14 * MIB), 14 * MIB / 8);
        // a tiny model: never below 1 MiB
        assert_eq!(overlap_bucket_bytes(25 * MIB, MIB), MIB);
        // a configured size below the floor is kept (tests use tiny buckets)
        assert_eq!(overlap_bucket_bytes(10_000, 14 * MIB), 10_000);
        // qwen3-0.6b's 2.2 GiB: the configured 25 MiB
        assert_eq!(overlap_bucket_bytes(25 * MIB, 2253 * MIB), 25 * MIB);
    }
}
