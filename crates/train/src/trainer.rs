//! The trainer: whole optimizer steps over a token source — a thin loop over the [`Engine`]:
//! for each of the `gradient_accumulation_steps` micro-batches, `fwd_bwd`; then `update`. Both
//! drivers share one core, so what the engine guarantees (one reduction per step when the gate
//! is open) holds for the trainer by construction.

use std::sync::Arc;

use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;

use crate::config::TrainConfig;
use crate::data::{micro_batch, TokenSource};
use crate::engine::{compute_mesh, Engine, StepMetrics};
use crate::error::TrainError;
use crate::gate::Deferral;

/// The per-device trainer: an [`Engine`] and the data it reads.
pub struct Trainer {
    engine: Engine,
    config: TrainConfig,
    source: Arc<dyn TokenSource>,
}

/// Plans one step of `config` on its declared mesh in abstract mode (shapes only, device 0,
/// nothing communicated), e.g. `qwen3-0.6b` on 256 devices: returns the gate's decision and the
/// collective trace, or the first type error.
///
/// # Errors
/// A type error or an invalid config.
pub fn plan_step(
    config: &TrainConfig,
    source: Arc<dyn TokenSource>,
) -> Result<(Deferral, ferrotext_comm::Trace), TrainError> {
    let mesh = compute_mesh(config)?;
    let mut comm =
        ferrotext_comm::Communicator::new(0, mesh, Box::new(ferrotext_comm::NoTransport));
    let mut cx = Ctx::new_abstract(&mut comm);
    let mut trainer = Trainer::new(&mut cx, config, source, None)?;
    trainer.step(&mut cx)?;
    let gate = trainer.engine().gate().clone();
    Ok((gate, cx.comm().take_trace()))
}

impl Trainer {
    /// An engine for `config` (parameters from `initial`, or initialised from the seed) reading
    /// `source`.
    ///
    /// # Errors
    /// As [`Engine::new`].
    pub fn new(
        cx: &mut Ctx<'_>,
        config: &TrainConfig,
        source: Arc<dyn TokenSource>,
        initial: Option<&[Tensor]>,
    ) -> Result<Trainer, TrainError> {
        Ok(Trainer {
            engine: Engine::new(cx, config, initial)?,
            config: config.clone(),
            source,
        })
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, mutable (diagnostics such as [`Engine::override_inside_spec`]).
    pub fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// One optimizer step: every micro-batch of the step through `fwd_bwd`, then `update`. A
    /// step restored from a mid-step checkpoint continues at its next micro-batch.
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
    /// but the last (`done` micro-batches of this step are accumulated): the place for a
    /// mid-step checkpoint.
    ///
    /// # Errors
    /// As [`Trainer::step`], or the callback's error.
    pub fn step_with(
        &mut self,
        cx: &mut Ctx<'_>,
        after_micro_batch: &mut dyn FnMut(&mut Ctx<'_>, &Engine, usize) -> Result<(), TrainError>,
    ) -> Result<StepMetrics, TrainError> {
        let (ga, rows, len) = (
            self.config.gradient_accumulation_steps,
            self.config.micro_batch_rows(),
            self.config.max_target_length,
        );
        let step = self.engine.steps_taken() as u64;
        for micro in self.engine.pending_micro_steps()..ga {
            cx.comm().push_phase(format!("micro_batch {micro}"));
            let seqs = micro_batch(self.source.as_ref(), step, micro, ga, rows, len);
            let batch = self.engine.batch(cx, &seqs)?;
            if micro + 1 < ga {
                self.engine.fwd_bwd(cx, &batch)?;
            } else {
                // The step's last micro-batch: with overlap, the reduction starts in its backward.
                self.engine.fwd_bwd_final(cx, &batch)?;
            }
            cx.comm().pop_phase();
            if micro + 1 < ga {
                after_micro_batch(cx, &self.engine, micro + 1)?;
            }
        }
        cx.comm().push_phase("update");
        let mut metrics = self.engine.update(cx)?;
        cx.comm().pop_phase();
        let last_sequence = (step + 1) * (rows * ga) as u64 - 1;
        metrics.epoch = self.source.epoch(last_sequence, len + 1);
        Ok(metrics)
    }
}
