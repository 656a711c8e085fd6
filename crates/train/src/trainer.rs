//! The trainer: an [`Engine`] and the data it reads, with the two moves of a step —
//! [`Trainer::micro_batch`] and [`Trainer::update`] — that the training loop ([`crate::train`])
//! calls in order. [`Trainer::step`] is the same step without checkpoints or logs (planning,
//! benchmarks, tests). Both drive one engine, so what the engine guarantees (one reduction per
//! step when the gate is open) holds for every loop by construction.

use std::sync::Arc;

use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;

use crate::data::{micro_batch, micro_batch_of_units, TokenSource};
use crate::engine::{Batch, Engine, FwdBwd, StepMetrics};
use crate::error::TrainError;
use crate::gate::Deferral;
use crate::plan::RunPlan;

/// The per-device trainer: an [`Engine`] and the data it reads.
pub struct Trainer {
    engine: Engine,
    source: Arc<dyn TokenSource>,
}

/// Plans one step of `plan` on its declared mesh in abstract mode (shapes only, device 0,
/// nothing communicated), e.g. `qwen3-0.6b` on 256 devices: returns the gate's decision and the
/// collective trace, or the first type error.
///
/// # Errors
/// A type error.
pub fn plan_step(
    plan: &RunPlan,
    source: Arc<dyn TokenSource>,
) -> Result<(Deferral, ferrotext_comm::Trace), TrainError> {
    let mut comm = ferrotext_comm::Communicator::new(
        0,
        plan.compute_mesh().clone(),
        Box::new(ferrotext_comm::NoTransport),
    );
    let mut cx = Ctx::new_abstract(&mut comm);
    let mut trainer = Trainer::new(&mut cx, plan, source, None)?;
    trainer.step(&mut cx)?;
    Ok((plan.deferral().clone(), cx.comm().take_trace()))
}

impl Trainer {
    /// An engine for `plan` (parameters from `initial`, or initialised from the seed) reading
    /// `source`.
    ///
    /// # Errors
    /// As [`Engine::new`].
    pub fn new(
        cx: &mut Ctx<'_>,
        plan: &RunPlan,
        source: Arc<dyn TokenSource>,
        initial: Option<&[Tensor]>,
    ) -> Result<Trainer, TrainError> {
        Ok(Trainer {
            engine: Engine::new(cx, plan, initial)?,
            source,
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, mutable (restoring a checkpoint; test hooks).
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// One optimizer step: every micro-batch of the step still to run (a step restored from a
    /// mid-step checkpoint continues at its next one), then the update at the schedule's
    /// learning rate.
    ///
    /// # Errors
    /// As [`Engine::fwd_bwd`] and [`Engine::update`].
    ///
    /// # Collectives
    /// As the engine's: with the gate open, no gradient reduction until `update`.
    pub fn step(&mut self, cx: &mut Ctx<'_>) -> Result<StepMetrics, TrainError> {
        self.step_with(cx, &mut |_, _, _| Ok(()))
    }

    /// [`Trainer::step`], calling `after_micro_batch(cx, engine, done)` after each micro-batch
    /// (`done` of the step's micro-batches have run): the training loop's step, whose hook takes
    /// the checkpoints inside a step.
    ///
    /// # Errors
    /// As [`Trainer::step`], or the hook's error (the step stops there).
    ///
    /// # Collectives
    /// As [`Trainer::step`], plus the hook's.
    pub fn step_with(
        &mut self,
        cx: &mut Ctx<'_>,
        after_micro_batch: &mut dyn FnMut(&mut Ctx<'_>, &Engine, usize) -> Result<(), TrainError>,
    ) -> Result<StepMetrics, TrainError> {
        let ga = self.engine.plan().config().gradient_accumulation_steps;
        for micro in self.engine.pending_micro_steps()..ga {
            self.micro_batch(cx, micro)?;
            after_micro_batch(cx, &self.engine, micro + 1)?;
        }
        self.update(cx)
    }

    /// Micro-batch `micro` of the current step: its rows from the source, forward, backward,
    /// and its gradients into the accumulator, in trace phase `micro_batch {micro}`. The step's
    /// last micro-batch closes the step ([`Engine::fwd_bwd_final`]: with overlap, the reduction
    /// starts during its backward).
    ///
    /// # Errors
    /// As [`Engine::fwd_bwd`].
    pub fn micro_batch(&mut self, cx: &mut Ctx<'_>, micro: usize) -> Result<FwdBwd, TrainError> {
        let config = self.engine.plan().config();
        let (ga, rows, len) = (
            config.gradient_accumulation_steps,
            config.micro_batch_rows(),
            config.max_target_length,
        );
        let step = self.engine.steps_taken() as u64;
        cx.comm().push_phase(format!("micro_batch {micro}"));
        let seqs = if config.layout_invariant {
            // Each device's micro-batch is one unit of the step's tree, the same sequences on
            // any layout. (A data-only mesh, as the plan checked: a whole batch per device.)
            let per_device = config.per_device_batch_size as usize;
            micro_batch_of_units(self.source.as_ref(), step, micro, ga, rows, per_device, len)
        } else {
            micro_batch(self.source.as_ref(), step, micro, ga, rows, len)
        };
        let batch = self.batch(cx, self.source.as_ref(), &seqs)?;
        let out = if micro + 1 < ga {
            self.engine.fwd_bwd(cx, &batch)
        } else {
            self.engine.fwd_bwd_final(cx, &batch)
        }?;
        cx.comm().pop_phase();
        Ok(out)
    }

    /// A micro-batch of `rows` read from `source`: packed (its documents found by the source's
    /// EOS) under `packing=true`.
    fn batch(
        &self,
        cx: &Ctx<'_>,
        source: &dyn TokenSource,
        rows: &[Vec<u32>],
    ) -> Result<Batch, TrainError> {
        match (self.engine.plan().config().packing, source.eos()) {
            (true, Some(eos)) => self.engine.packed_batch(cx, rows, eos),
            (true, None) => Err(TrainError::usage(
                "packing",
                "packing=true needs data whose documents are delimited (dataset_type=shards); \
                 this source has no document boundaries",
            )),
            (false, _) => self.engine.batch(cx, rows),
        }
    }

    /// The mean token loss of `source`'s first `eval_steps` batches (the same batches at every
    /// call, so evaluations compare), forward only, in trace phase `eval`: no gradient and no
    /// gradient collective, parameters and optimizer state untouched.
    ///
    /// # Errors
    /// As [`Engine::eval_step`].
    pub fn evaluate(
        &mut self,
        cx: &mut Ctx<'_>,
        source: &dyn TokenSource,
    ) -> Result<f64, TrainError> {
        let config = self.engine.plan().config();
        let (batches, rows, len) = (
            config.eval_steps,
            config.micro_batch_rows(),
            config.max_target_length,
        );
        cx.comm().push_phase("eval");
        let (mut loss_sum, mut tokens) = (0.0, 0u64);
        for b in 0..batches {
            let seqs = micro_batch(source, 0, b, batches, rows, len);
            let batch = self.batch(cx, source, &seqs)?;
            let out = self.engine.eval_step(cx, &batch)?;
            loss_sum += out.loss_sum;
            tokens += out.tokens;
        }
        cx.comm().pop_phase();
        Ok(loss_sum / tokens.max(1) as f64)
    }

    /// The step's update at the schedule's learning rate, in trace phase `update`: the one
    /// reduction, ÷ tokens, clipping, the optimizer. The metrics carry the data epoch of the
    /// step's last sequence.
    ///
    /// # Errors
    /// As [`Engine::update`].
    ///
    /// # Collectives
    /// As [`Engine::update`].
    pub fn update(&mut self, cx: &mut Ctx<'_>) -> Result<StepMetrics, TrainError> {
        let step = self.engine.steps_taken() as u64;
        cx.comm().push_phase("update");
        let mut metrics = self.engine.update(cx)?;
        cx.comm().pop_phase();
        let config = self.engine.plan().config();
        let per_step = (config.micro_batch_rows() * config.gradient_accumulation_steps) as u64;
        let last_sequence = (step + 1) * per_step - 1;
        metrics.epoch = self
            .source
            .epoch(last_sequence, config.max_target_length + 1);
        Ok(metrics)
    }
}
