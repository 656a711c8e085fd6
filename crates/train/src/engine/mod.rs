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

use ferrotext_models::decoder::LossOptions;
use ferrotext_models::init_normal;
use ferrotext_models::ParamInfo;
use ferrotext_sharding::{ArrayType, DType, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, BucketPlan, Ctx, Mode};
use ferrotext_tensor::Tensor;
use serde::Serialize;

use crate::error::TrainError;
use crate::gate::{Deferral, Overlap, Zero1};
use crate::gradients::{PartialGradients, UnitTree};
use crate::optim::{OptType, Optimizer};
use crate::plan::RunPlan;
use crate::router_bias::RouterBalance;

mod batch;
mod state;
mod step;

pub use batch::Batch;

pub(crate) use state::{
    EngineState, PendingState, PendingSum, Restored, RestoredPending, TreeNodeState,
};

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
    /// The process's CPU seconds during the step, user and system (every thread: all of this
    /// process's devices), where the platform reports them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<crate::CpuTime>,
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
    /// The multi-token-prediction loss, unscaled: Σ MTP cross-entropy / Σ positions with a token
    /// two ahead (`B·(T − 1)` per micro-batch), when `mtp_num_layers` = 1. `loss` includes it
    /// times `mtp_loss_scaling_factor`. A metric summed outside `layout_invariant`'s tree: equal
    /// across layouts to rounding, not bit for bit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mtp_loss: Option<f64>,
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
    /// This device's expert loads summed over the step's micro-batches (aux-loss-free
    /// balancing; empty when off).
    loads: ferrotext_models::decoder::ExpertLoads,
    /// Σ of the micro-batches' MTP cross-entropy sums and of their MTP positions (zero without
    /// the module).
    mtp: (f64, u64),
    started: Instant,
    /// The process's CPU time when the step started (`None` where it cannot be read).
    cpu_started: Option<crate::CpuTime>,
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
    /// The router selection biases' balancing after each step (`routed_bias_update_rate`).
    balance: Option<RouterBalance>,
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
        // `grad_dtype=bfloat16`: the step's deferred reduction moves bf16 (each device's f32
        // accumulator rounded once as it starts); a reduction in every micro-batch (DDP) stays
        // f32, so a gradient is never rounded per micro-batch.
        let wire = if overlap.every_micro_batch() {
            DType::F32
        } else {
            plan.precision().grad_dtype
        };
        let reduce_plan = Arc::new(
            cx.plan_buckets(&promised, reduce_targets, reduce_bucket_bytes, &backwards)?
                .with_reduction_wire(wire),
        );
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
            opt: optimizer(cx.mode(), config, &shapes),
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
            balance: RouterBalance::new(plan.decoder(), config.routed_bias_update_rate),
        })
    }

    /// The plan the engine runs.
    pub fn plan(&self) -> &RunPlan {
        &self.plan
    }

    /// This device's gradient sums of the step so far (copies, `None` between steps): with the
    /// deferral open, its own f32 partial sums (`{U:data}`), what the step's reduction will take
    /// — and what a mid-step checkpoint saves. A test hook (`fault-injection` feature), so that
    /// partial sums have no reader outside the crate in a release build (`gradients.rs`): tests
    /// compare the reduction against them.
    ///
    /// # Errors
    /// A step whose reduction has started, or one summed as a unit tree
    /// (`layout_invariant=true`): [`TrainError::Misuse`].
    #[cfg(feature = "fault-injection")]
    pub fn accumulated_gradients(&self) -> Result<Option<Vec<Array>>, TrainError> {
        let misuse = |reason: &str| TrainError::Misuse {
            call: "Engine::accumulated_gradients",
            reason: reason.into(),
        };
        match self.state()?.pending.map(|p| p.sum) {
            None => Ok(None),
            Some(state::PendingSum::Accumulator(grads)) => Ok(Some(grads)),
            Some(state::PendingSum::Tree(_)) => {
                Err(misuse("layout_invariant=true sums the step as a unit tree"))
            }
        }
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

    /// This device's optimizer-state shards, `state[s][p]`: slot `s` of
    /// [`OptType::slots`] (AdamW: `m`, `v`) for parameter `p`; `None` for an optimizer that
    /// keeps none (SGD).
    pub fn optimizer_state(&self) -> Option<&[Vec<Tensor>]> {
        self.opt.state().map(|(slots, _)| slots)
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

    /// The loss sum and token count of a batch, without gradients or state changes.
    ///
    /// # Errors
    /// An op or collective failure.
    pub fn eval_step(&mut self, cx: &mut Ctx<'_>, batch: &Batch) -> Result<FwdBwd, TrainError> {
        let main = LossOptions::default();
        let loss = self
            .plan
            .decoder()
            .loss(cx, &self.params, batch.tokens(), &batch.targets, main)?
            .total;
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

/// The engine's optimizer on shards of `shapes`: the config's, or in abstract mode (which steps
/// nothing) one without state, so nothing is allocated.
fn optimizer(mode: Mode, config: &crate::TrainConfig, shapes: &[Vec<usize>]) -> Optimizer {
    let kind = if mode == Mode::Abstract {
        OptType::Sgd
    } else {
        config.opt_type
    };
    Optimizer::new(kind, config.optimizer_hyper(), shapes)
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
