//! The engine: the training core as two calls, for callers that drive gradient accumulation
//! themselves (post-training and RL loops) and for the [`crate::Trainer`]'s own loop.
//!
//! * [`Engine::fwd_bwd`] runs forward and backward on one micro-batch and adds its gradients to
//!   the pending accumulator — typed `{U:data}` when the deferral gate is open, so nothing is
//!   communicated;
//! * [`Engine::update`] performs the step's one reduction, divides once by the tokens of every
//!   micro-batch since the last update, clips, and steps the optimizer.
//!
//! The accumulator is a [`PartialGradients`]: an opaque value whose only way out is
//! [`PartialGradients::reduce`], so partial sums can never reach the optimizer (or a reader)
//! unreduced.

use std::sync::Arc;
use std::time::Instant;

use ferrotext_models::qwen3::Qwen3;
use ferrotext_models::{init_normal, ParamInfo};
use ferrotext_sharding::{
    ArrayType, AxisType, LogicalAxisRules, Mesh, NamedSharding, PartitionSpec,
};
use ferrotext_spmd::{Array, BucketPlan, Ctx, Ids, Mode, StartedBucket};
use ferrotext_tensor::Tensor;
use serde::Serialize;

use crate::config::{NanPolicy, ShardMode, TrainConfig};
use crate::error::TrainError;
use crate::gate::{
    deferral_axes, deferral_gate, deferred_spec, zero1_gate, zero1_spec, Deferral, Zero1,
};
use crate::optim::{clip_scale, learning_rate, Optimizer};

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

/// Gradients summed over micro-batches, possibly still per-device partial sums (`{U:data}`).
///
/// Opaque on purpose: it has no accessor, and the optimizer takes only [`Gradients`], so the one
/// way to use it is [`PartialGradients::reduce`] — the step's reduction.
///
/// The legitimate path compiles — reduce, then apply:
///
/// ```no_run
/// # fn ok(
/// #     cx: &mut ferrotext_spmd::Ctx<'_>,
/// #     opt: &mut ferrotext_train::Optimizer,
/// #     params: &mut [ferrotext_spmd::Array],
/// #     partial: ferrotext_train::PartialGradients,
/// # ) -> Result<(), ferrotext_train::TrainError> {
/// let reduced = partial.reduce(cx)?;
/// opt.apply(0.1, 1.0, params, &reduced, &[])?;
/// # Ok(())
/// # }
/// ```
///
/// ```compile_fail
/// # fn misuse(partial: ferrotext_train::PartialGradients) {
/// // Partial sums cannot be read...
/// let first = &partial.grads[0];
/// # }
/// ```
///
/// ```compile_fail
/// # fn misuse(opt: &mut ferrotext_train::Optimizer, params: &mut [ferrotext_spmd::Array],
/// #           partial: &ferrotext_train::PartialGradients) {
/// // ...nor handed to the optimizer without the reduction.
/// opt.apply(0.1, 1.0, params, partial, &[]).unwrap();
/// # }
/// ```
pub struct PartialGradients {
    pub(crate) grads: Vec<Array>,
    /// How the reduction runs: gradients in buckets, filled from the last parameter back (the
    /// order a backward pass finishes them).
    pub(crate) plan: Arc<BucketPlan>,
    /// Buckets whose reduction already started (overlap), in start order.
    pub(crate) started: Vec<StartedBucket>,
}

impl PartialGradients {
    /// The reduction: every gradient resharded to its target layout — the parameter's own (an
    /// all-reduce of each unreduced gradient) or, under ZeRO-1, its `data` shard (a
    /// reduce-scatter) — in buckets of the configured size (`grad_bucket_mb`); nothing moves for
    /// gradients already reduced but a local slice. Bitwise equal to one reshard per gradient.
    ///
    /// # Errors
    /// A collective failure.
    ///
    /// # Collectives
    /// One all-reduce (ZeRO-1: reduce-scatter) over `data` per bucket of `{U:data}` gradients,
    /// in parameter order; none when they are already reduced.
    pub fn reduce(self, cx: &mut Ctx<'_>) -> Result<Gradients, TrainError> {
        let PartialGradients {
            grads,
            plan,
            started,
        } = self;
        if started.is_empty() {
            return Ok(Gradients {
                grads: cx.reshard_planned(&plan, &grads)?,
            });
        }
        // Overlapped: finish what the backward started, then run any bucket it did not.
        let mut out: Vec<Option<Array>> = vec![None; grads.len()];
        cx.move_outside_buckets(&plan, &grads, &mut out)?;
        let mut done = vec![false; grads.len()];
        for bucket in started {
            for (i, a) in cx.finish_planned_bucket(bucket)? {
                done[i] = true;
                out[i] = Some(a);
            }
        }
        let remaining: Vec<usize> = plan
            .buckets()
            .enumerate()
            .filter(|(_, members)| members.iter().any(|&m| !done[m]))
            .map(|(b, _)| b)
            .collect();
        for b in remaining {
            for (i, a) in cx.move_planned_bucket(&plan, b, &grads)? {
                out[i] = Some(a);
            }
        }
        let grads = out
            .into_iter()
            .map(|a| a.ok_or_else(|| TrainError::Config("a gradient was not reduced".into())))
            .collect::<Result<_, _>>()?;
        Ok(Gradients { grads })
    }
}

/// Reduced gradients in the parameters' layout: what the optimizer takes.
pub struct Gradients {
    grads: Vec<Array>,
}

impl Gradients {
    /// The gradients, in parameter order.
    pub fn arrays(&self) -> &[Array] {
        &self.grads
    }
}

/// The accumulation in progress between updates.
pub(crate) struct Pending {
    /// Parameters as they enter micro-batches (`{R:data}` when deferred), cast once.
    pub(crate) used: Vec<Array>,
    pub(crate) acc: PartialGradients,
    pub(crate) loss_sum: f64,
    pub(crate) tokens: u64,
    pub(crate) micro_steps: usize,
    pub(crate) started: Instant,
    /// The step's last micro-batch has run (`fwd_bwd_final`): only `update` may follow.
    pub(crate) closed: bool,
}

/// The per-device training engine. See the module docs.
pub struct Engine {
    pub(crate) config: TrainConfig,
    pub(crate) model: Qwen3,
    pub(crate) infos: Vec<ParamInfo>,
    pub(crate) gate: Deferral,
    /// Storage layout of each parameter (from the logical rules, untagged).
    pub(crate) plain: Vec<PartitionSpec>,
    /// Layout inside micro-batches (tagged `{R:data}` when the gate is open).
    pub(crate) inside: Vec<PartitionSpec>,
    /// The accumulator type the gate promised for each gradient.
    pub(crate) promised: Vec<ArrayType>,
    /// ZeRO-1's decision.
    pub(crate) zero1: Zero1,
    /// Where each reduced gradient and each optimizer-state tensor lives: the parameter's layout,
    /// or its ZeRO-1 `data` shard.
    pub(crate) targets: Vec<PartitionSpec>,
    /// The optimizer state's types (`targets` on the parameters' shapes).
    pub(crate) moment_types: Vec<ArrayType>,
    pub(crate) params: Vec<Array>,
    pub(crate) opt: Optimizer,
    pub(crate) decay: Vec<bool>,
    pub(crate) step: usize,
    pub(crate) batch_spec: PartitionSpec,
    pub(crate) pending: Option<Pending>,
    /// The step's reduction in buckets (see [`PartialGradients::reduce`]).
    pub(crate) reduce_plan: Arc<BucketPlan>,
    /// ZeRO-1: the parameters' all-gather after the step, in buckets.
    pub(crate) gather_plan: Option<BucketPlan>,
}

/// Σ of the squares of every reduced gradient, in f64 and the same whatever the layout (so
/// ZeRO-1, FSDP and replicated runs clip by the same factor): each device sums its own shard of
/// each gradient in f64; shards of the gradients split over the same mesh axes are combined in
/// one exact exchange over those axes; replicated gradients need none.
///
/// The exchange is an all-reduce of a zero buffer with one `(hi, lo)` f32 slot per member, each
/// member writing its f64 partial into its own slot: every sum in it adds zeros to one value, so
/// every member receives every partial exactly (to 48 bits) and adds them in rank order.
///
/// # Collectives
/// One all-reduce of `2 × group` elements per distinct set of axes the gradients are split over
/// (none when nothing is split).
fn squared_norm(cx: &mut Ctx<'_>, grads: &Gradients) -> Result<f64, TrainError> {
    let mut by_axes: std::collections::BTreeMap<Vec<String>, f64> = Default::default();
    for g in grads.arrays() {
        let axes: Vec<String> = g
            .ty()
            .sharding()
            .spec()
            .partition_axes()
            .map(str::to_string)
            .collect();
        let local = if g.is_abstract() {
            0.0
        } else {
            g.local()?
                .data()
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum()
        };
        *by_axes.entry(axes).or_default() += local;
    }
    let mut total = 0.0;
    for (axes, partial) in by_axes {
        let group = cx.comm().group(&axes)?;
        if group.len() == 1 {
            total += partial;
            continue;
        }
        if cx.mode() == Mode::Abstract {
            cx.comm().record_abstract(
                ferrotext_comm::CollectiveKind::AllReduce,
                &axes,
                2 * group.len(),
                ferrotext_sharding::DType::F32,
            )?;
            continue;
        }
        let rank = group
            .iter()
            .position(|&d| d == cx.comm().device())
            .ok_or_else(|| TrainError::Config("device outside its own group".into()))?;
        let mut slots = vec![0.0f32; 2 * group.len()];
        let hi = partial as f32;
        slots[2 * rank] = hi;
        slots[2 * rank + 1] = (partial - f64::from(hi)) as f32;
        cx.comm().all_reduce(&axes, &mut slots)?;
        total += slots
            .chunks_exact(2)
            .map(|p| f64::from(p[0]) + f64::from(p[1]))
            .sum::<f64>();
    }
    Ok(total)
}

/// MaxText's logical rules, with `embed` kept off the `expert` axis: under expert parallelism
/// that axis splits the batch and the experts, and dense weights stay whole over it (MaxText
/// would shard them over it like FSDP, which closes deferral).
fn engine_rules() -> LogicalAxisRules {
    LogicalAxisRules::maxtext().without_axis("embed", "expert")
}

/// The mesh the engine computes on: the config's, with every axis Explicit (ferrotext has no
/// automatic partitioner; under `shard_mode=auto` the axes keep their layouts but the gate keeps
/// tags off).
pub fn compute_mesh(config: &TrainConfig) -> Result<Arc<Mesh>, TrainError> {
    Ok(Arc::new(
        config.mesh()?.with_all_axis_types(AxisType::Explicit),
    ))
}

impl Engine {
    /// Places the parameters (from `initial` global values, or initialised from the seed) and
    /// decides deferral.
    ///
    /// # Errors
    /// A parameter shape that does not match the model, or a layout the mesh cannot hold.
    pub fn new(
        cx: &mut Ctx<'_>,
        config: &TrainConfig,
        initial: Option<&[Tensor]>,
    ) -> Result<Engine, TrainError> {
        let model = Qwen3::new(config.model()?).map_err(|e| TrainError::Config(e.to_string()))?;
        let infos = model.params();
        let rules = engine_rules();
        let declared = config.mesh()?;
        let mesh = cx.mesh().clone();
        let explicit = config.shard_mode == ShardMode::Explicit;
        let gate = deferral_gate(explicit, &declared, &rules);
        let batch_axes = if gate.is_open() {
            deferral_axes(&declared, &rules)?
        } else {
            Vec::new()
        };
        let mut zero1 = zero1_gate(config.shard_optimizer_over_data, explicit, &declared);
        let mut targets = Vec::new();
        let mut moment_types = Vec::new();
        let mut plain = Vec::new();
        let mut inside = Vec::new();
        let mut promised = Vec::new();
        let mut params = Vec::new();
        let mut decay = Vec::new();
        for (i, info) in infos.iter().enumerate() {
            let spec = rules.resolve(&info.logical, &info.shape, &mesh)?;
            let tagged = deferred_spec(&spec, &gate, &batch_axes)?;
            let target = match &mut zero1 {
                Zero1::Active { replicated } => match zero1_spec(&spec, &info.shape, &mesh)? {
                    Some(z) => z,
                    None => {
                        replicated.push(info.name.clone());
                        spec.clone()
                    }
                },
                Zero1::Off(_) => spec.clone(),
            };
            moment_types.push(cx.array_type(&info.shape, target.clone())?);
            targets.push(target);
            let named = NamedSharding::new(mesh.clone(), spec.clone())?;
            if cx.mode() == Mode::Abstract {
                // Planning: types and collectives only; no 2-GB initialisation for a 0.6B model.
                let ty = ArrayType::new(ferrotext_sharding::DType::F32, info.shape.clone(), named)?;
                promised.push(cx.array_type(&info.shape, tagged.clone())?.to_cotangent());
                params.push(cx.abstract_array(ty));
                plain.push(spec);
                inside.push(tagged);
                decay.push(info.shape.len() >= 2);
                continue;
            }
            let value = match initial {
                Some(values) => {
                    let v = values.get(i).ok_or_else(|| {
                        TrainError::Config(format!("no initial value for `{}`", info.name))
                    })?;
                    if v.shape() != info.shape.as_slice() {
                        return Err(TrainError::Config(format!(
                            "`{}` has shape {:?}, the model needs {:?}",
                            info.name,
                            v.shape(),
                            info.shape
                        )));
                    }
                    v.clone()
                }
                None => init_normal(info, config.init_weights_seed, i),
            };
            let array = cx.from_global(&value, named)?;
            promised.push(cx.array_type(&info.shape, tagged.clone())?.to_cotangent());
            plain.push(spec);
            inside.push(tagged);
            params.push(array);
            decay.push(info.shape.len() >= 2);
        }
        let shapes: Vec<Vec<usize>> = moment_types.iter().map(ArrayType::shard_shape).collect();
        // Buckets filled from the last parameter back: the backward pass finishes the last
        // layers' gradients first.
        let bucket_bytes = config.grad_bucket_bytes();
        let backwards: Vec<usize> = (0..infos.len()).rev().collect();
        let reduce_plan =
            Arc::new(cx.plan_buckets(&promised, &targets, bucket_bytes, &backwards)?);
        let gather_plan = if zero1.is_active() {
            Some(cx.plan_buckets(&moment_types, &plain, bucket_bytes, &backwards)?)
        } else {
            None
        };
        let rows = config.micro_batch_rows();
        let batch_spec = rules.resolve(
            &[Some("activation_batch"), None],
            &[rows, config.max_target_length],
            &mesh,
        )?;
        Ok(Engine {
            config: config.clone(),
            model,
            opt: if cx.mode() == Mode::Abstract {
                Optimizer::Sgd
            } else {
                Optimizer::new(config, &shapes)
            },
            infos,
            gate,
            zero1,
            targets,
            moment_types,
            plain,
            inside,
            promised,
            params,
            decay,
            step: 0,
            batch_spec,
            pending: None,
            reduce_plan,
            gather_plan,
        })
    }

    /// The gate's decision.
    pub fn gate(&self) -> &Deferral {
        &self.gate
    }

    /// The parameters' declarations, in order.
    pub fn param_infos(&self) -> &[ParamInfo] {
        &self.infos
    }

    /// The model.
    pub fn model(&self) -> &Qwen3 {
        &self.model
    }

    /// Uses `spec` for parameter `name` inside micro-batches instead of the gate's layout. A
    /// diagnostic: it simulates a helper that rebuilt the spec (e.g. from logical rules) and
    /// dropped the reduced tag, which the accumulator check must catch.
    ///
    /// # Errors
    /// An unknown parameter name.
    pub fn override_inside_spec(
        &mut self,
        name: &str,
        spec: PartitionSpec,
    ) -> Result<(), TrainError> {
        let i = self
            .infos
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| TrainError::Config(format!("no parameter `{name}`")))?;
        self.inside[i] = spec;
        Ok(())
    }

    /// ZeRO-1's decision.
    pub fn zero1(&self) -> &Zero1 {
        &self.zero1
    }

    /// This device's optimizer-state shards (AdamW `m` and `v`; `None` for SGD).
    pub fn optimizer_state(&self) -> Option<(&[Tensor], &[Tensor])> {
        self.opt.moments().map(|(m, v, _)| (m, v))
    }

    /// The layout of a micro-batch's `[rows, len]` token arrays.
    pub fn batch_spec(&self) -> &PartitionSpec {
        &self.batch_spec
    }

    /// Optimizer steps taken.
    pub fn steps_taken(&self) -> usize {
        self.step
    }

    /// Micro-batches accumulated since the last update.
    pub fn pending_micro_steps(&self) -> usize {
        self.pending.as_ref().map_or(0, |p| p.micro_steps)
    }

    /// A micro-batch from its global rows (each `len + 1` tokens: inputs then shifted targets;
    /// `u32::MAX` targets are ignored). Every device passes the same rows and keeps its block.
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
        let tokens = targets.iter().filter(|&&t| t != u32::MAX).count() as u64;
        let shape = [rows.len(), len];
        let spec = if rows.len() == self.config.micro_batch_rows() {
            self.batch_spec.clone()
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
    /// all-reduce, inside the backward pass.
    pub fn fwd_bwd(&mut self, cx: &mut Ctx<'_>, batch: &Batch) -> Result<FwdBwd, TrainError> {
        self.micro_batch(cx, batch, false)
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
        let overlap = self.config.overlap_grad_reduce;
        let out = self.micro_batch(cx, batch, overlap)?;
        if let Some(pending) = &mut self.pending {
            pending.closed = true;
        }
        Ok(out)
    }

    /// One micro-batch; `overlap`: start each finished bucket's reduction during the backward.
    fn micro_batch(
        &mut self,
        cx: &mut Ctx<'_>,
        batch: &Batch,
        overlap: bool,
    ) -> Result<FwdBwd, TrainError> {
        if self.pending.is_none() {
            // Deferral: the parameters enter every micro-batch `{R:data}`. The cast is free and
            // sits outside the differentiated function (R4.8) — inside it, its transpose would
            // put the all-reduce back into every micro-batch.
            let mut used = Vec::with_capacity(self.params.len());
            for (p, spec) in self.params.iter().zip(&self.inside) {
                used.push(if p.ty().sharding().spec() == spec {
                    p.clone()
                } else {
                    cx.reshard(p, spec)?
                });
            }
            let grads = self.promised.iter().map(|t| cx.zeros(t.clone())).collect();
            self.pending = Some(Pending {
                used,
                acc: PartialGradients {
                    grads,
                    plan: self.reduce_plan.clone(),
                    started: Vec::new(),
                },
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
            .ok_or_else(|| TrainError::Config("no pending accumulation".into()))?;
        if pending.closed {
            return Err(TrainError::Config(
                "fwd_bwd after fwd_bwd_final: the step is closed, call update".into(),
            ));
        }
        let model = &self.model;
        let infos = &self.infos;
        let acc = &mut pending.acc;
        let buckets: Vec<Vec<usize>> = acc.plan.buckets().map(<[usize]>::to_vec).collect();
        let mut finished = vec![false; acc.grads.len()];
        let mut in_flight = vec![false; buckets.len()];
        let mut wrong_type: Option<TrainError> = None;
        // Each gradient joins its accumulator as soon as the backward has finished it; with
        // `overlap`, a bucket whose gradients are all in starts reducing at once.
        let (loss, _) = cx
            .value_and_grad_streaming(
                &pending.used,
                |cx, ps| model.loss_sum(cx, ps, &batch.inputs, &batch.targets),
                &mut |cx, i, grad| {
                    let slot = &mut acc.grads[i];
                    if grad.ty() != slot.ty() {
                        wrong_type = Some(accumulator_type_error(&infos[i].name, slot, grad));
                        return Err(ferrotext_spmd::SpmdError::BadArgument {
                            op: "fwd_bwd".into(),
                            reason: "a gradient's type differs from its accumulator's".into(),
                        });
                    }
                    *slot = cx.add(slot, grad)?;
                    finished[i] = true;
                    if overlap {
                        for (b, members) in buckets.iter().enumerate() {
                            if !in_flight[b] && members.iter().all(|&m| finished[m]) {
                                let started = cx.start_planned_bucket(&acc.plan, b, &acc.grads)?;
                                acc.started.push(started);
                                in_flight[b] = true;
                            }
                        }
                    }
                    Ok(())
                },
            )
            .map_err(|e| wrong_type.take().unwrap_or(TrainError::from(e)))?;
        let loss_sum = if loss.is_abstract() {
            0.0
        } else {
            f64::from(loss.scalar()?)
        };
        pending.loss_sum += loss_sum;
        pending.tokens += batch.tokens;
        pending.micro_steps += 1;
        Ok(FwdBwd {
            loss_sum,
            tokens: batch.tokens,
        })
    }

    /// The optimizer step over every micro-batch since the last update: the one reduction, one
    /// division by their total token count, global-norm clipping, the optimizer; then the
    /// accumulator is reset.
    ///
    /// # Errors
    /// No micro-batch since the last update; a collective failure.
    ///
    /// # Collectives
    /// Gate open: one all-reduce per parameter (the deferred reduction), plus one-element norm
    /// reductions for parameters split over devices. Gate closed: only those.
    pub fn update(&mut self, cx: &mut Ctx<'_>) -> Result<StepMetrics, TrainError> {
        let pending = self.pending.take().ok_or_else(|| {
            TrainError::Config("update called with no fwd_bwd since the last update".into())
        })?;
        let lr = learning_rate(&self.config, self.step);
        let Pending {
            used,
            acc,
            loss_sum,
            tokens,
            started,
            ..
        } = pending;
        drop(used);
        let grads = acc.reduce(cx)?;
        let inv_tokens = 1.0 / tokens.max(1) as f64;
        let grad_norm = squared_norm(cx, &grads)?.sqrt() * inv_tokens;
        let loss = loss_sum * inv_tokens;
        // Every device holds the same reduced loss and norm, so every device takes the same
        // branch here and the collectives below stay matched.
        let skipped = cx.mode() == Mode::Real && !(loss.is_finite() && grad_norm.is_finite());
        if skipped && self.config.nan_policy == NanPolicy::Stop {
            return Err(TrainError::NonFinite {
                step: self.step,
                loss,
                grad_norm,
            });
        }
        let scale =
            (inv_tokens * clip_scale(grad_norm, self.config.gradient_clipping_threshold)) as f32;
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
        if self.zero1.is_active() {
            let mut slices = Vec::with_capacity(self.params.len());
            for (p, t) in self.params.iter().zip(&self.targets) {
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
                    cx.reshard_bucketed(&slices, &self.plain, self.config.grad_bucket_bytes())?
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
            .model
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
fn accumulator_type_error(param: &str, acc: &Array, grad: &Array) -> TrainError {
    TrainError::AccumulatorType {
        param: param.to_string(),
        expected: acc.ty().to_string(),
        got: grad.ty().to_string(),
        expected_unreduced: acc
            .ty()
            .sharding()
            .spec()
            .unreduced()
            .iter()
            .cloned()
            .collect(),
    }
}
