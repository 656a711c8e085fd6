//! A step's two moves: [`Engine::fwd_bwd`] per micro-batch (forward, backward, each gradient
//! into the step's sum as soon as the backward finishes it, through [`AccumulatorSink`]) and
//! [`Engine::update`] per step (the one reduction, ÷ tokens, clipping, the optimizer).
//! Invariant: a gradient whose type is not its accumulator's is refused by the sink, never
//! reduced early.

use std::sync::Arc;
use std::time::Instant;

use ferrotext_models::{ParamInfo, RematPolicy};
use ferrotext_sharding::{ArrayType, DType, PartitionSpec};
use ferrotext_spmd::{Array, BucketPlan, Ctx, GradientSink, Mode};

use super::{Batch, Engine, FwdBwd, Pending, StepMetrics, StepSum};
use crate::config::NanPolicy;
use crate::error::TrainError;
use crate::gate::Overlap;
use crate::gradients::{FinishedTree, Gradients, PartialGradients, UnitTree};
use crate::plan::RunPlan;
use crate::router_bias::RouterBalance;
use crate::schedule::{clip_scale, learning_rate};
use ferrotext_models::decoder::{ExpertLoads, LossOptions};

impl Engine {
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
            self.open_step(cx)?;
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
        let mut loads = Vec::new();
        // The MTP cross-entropy sum, kept apart for the metrics (its scaled term is in the loss).
        let mut mtp: Option<Array> = None;
        let loss_sum = match &mut pending.sum {
            StepSum::Accumulator(acc) => {
                let loss = Self::accumulate_micro_batch(
                    (&mut loads, &mut mtp),
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
                        |cx, ps| {
                            let options = LossOptions {
                                partial: true,
                                with_mtp: true,
                            };
                            let parts =
                                model.loss(cx, ps, batch.tokens(), &batch.targets, options)?;
                            (loads, mtp) = (parts.loads, parts.mtp);
                            Ok(parts.total)
                        },
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
        if self.balance.is_some() {
            RouterBalance::add(&mut pending.loads, loads);
        }
        if let Some(m) = mtp {
            Self::add_mtp(cx, pending, &m, batch)?;
        }
        pending.loss_sum += loss_sum;
        pending.tokens += batch.tokens;
        pending.micro_steps += 1;
        Ok(FwdBwd {
            loss_sum,
            tokens: batch.tokens,
        })
    }

    /// Opens a step: the parameters enter its micro-batches (typed for deferral), the casts
    /// they share are remembered, and an empty accumulator (or unit tree) waits for gradients.
    fn open_step(&mut self, cx: &mut Ctx<'_>) -> Result<(), TrainError> {
        // Deferral: the parameters enter every micro-batch `{R:data}` (a free cast).
        let mut used = self.enter_micro_batches(cx, &self.params)?;
        // The step's weights are written by no one until `update`: each cast the model
        // makes of one (bf16 compute) is computed once and shared by every micro-batch —
        // unless the layers are rematerialized, whose point is to keep only their inputs:
        // then a weight is cast where it is used, again in the replay, and let go. With more
        // than one micro-batch, each copy's packings for the products are kept too; in f32
        // the weights keep their own.
        cx.forget_casts();
        if self.plan.keeps_weight_packings() {
            if self.plan.precision().dtype == DType::F32 {
                used = used.iter().map(Array::keeping_packings).collect();
            }
            cx.remember_casts_and_packings(&used);
        } else if self.plan.decoder().remat() == RematPolicy::None {
            cx.remember_casts(&used);
        }
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
            loads: Vec::new(),
            mtp: (0.0, 0),
            started: Instant::now(),
            cpu_started: crate::CpuTime::now(),
            closed: false,
        });
        Ok(())
    }

    /// Adds a micro-batch's MTP cross-entropy sum `m` (this device's partial sum under
    /// `layout_invariant`) and its positions to the step's.
    fn add_mtp(
        cx: &mut Ctx<'_>,
        pending: &mut Pending,
        m: &Array,
        batch: &Batch,
    ) -> Result<(), TrainError> {
        // A partial sum (layout_invariant) is completed by a one-element all-reduce.
        let m = cx.reshard(m, &PartitionSpec::replicated())?;
        let shape = batch.inputs.ty().shape();
        let positions = shape.first().copied().unwrap_or(0)
            * shape.get(1).copied().unwrap_or(1).saturating_sub(1);
        if !m.is_abstract() {
            pending.mtp.0 += f64::from(m.scalar()?);
        }
        pending.mtp.1 += positions as u64;
        Ok(())
    }

    /// One micro-batch's forward and backward into the step's accumulator `acc` (the default
    /// path): each gradient joins it as soon as the backward has finished it — a weight's added
    /// in by its product's kernel where it can be; with `overlap`, a bucket whose gradients are
    /// all in starts reducing at once. Under DDP (`Overlap::EveryMicroBatch`) the micro-batch's
    /// own gradients are reduced first and then added. Returns the loss.
    #[allow(clippy::too_many_arguments)]
    fn accumulate_micro_batch(
        (loads, mtp): (&mut ExpertLoads, &mut Option<Array>),
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
                |cx, ps| {
                    let options = LossOptions {
                        partial: false,
                        with_mtp: true,
                    };
                    let parts = model.loss(cx, ps, batch.tokens(), &batch.targets, options)?;
                    (*loads, *mtp) = (parts.loads, parts.mtp);
                    Ok(parts.total)
                },
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
            cpu_started,
            loads,
            mtp,
            ..
        } = pending;
        drop(used);
        // Before the optimizer writes the weights: the memo holds them (a write would copy).
        cx.forget_casts();
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
        // Aux-loss-free balancing: the step's expert loads, one all-reduce of layers × experts
        // values, then every selection bias moved alike on every device (see router_bias.rs).
        if let Some(balance) = &self.balance {
            let total = balance.reduce(cx, self.plan.batch_spec(), &loads)?;
            if let (Some(total), false) = (total, skipped) {
                balance.apply(&mut self.params, &total)?;
            }
        }
        let metrics = StepMetrics {
            step: self.step,
            loss,
            tokens,
            grad_norm,
            learning_rate: lr,
            seconds: started.elapsed().as_secs_f64(),
            cpu: cpu_started
                .zip(crate::CpuTime::now())
                .map(|(start, end)| end.since(start)),
            skipped,
            epoch: None,
            eval_loss: None,
            eval_perplexity: None,
            mtp_loss: (self.plan.decoder().config().mtp_num_layers > 0)
                .then(|| mtp.0 / mtp.1.max(1) as f64),
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
                return Err(ferrotext_spmd::SpmdError::AccumulateMismatch {
                    op: "fwd_bwd",
                    acc: slot.to_string(),
                    x: grad.ty().to_string(),
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
