/*!
The `train` layer of ferrotext: the config (MaxText's keys), data, optimizers, the deferral
gate, and the trainer that runs gradient accumulation with the data-parallel reduction deferred
to the step. It must not know about the command line.

Main items: [`TrainConfig`], [`deferral_gate`] / [`Deferral`], [`Engine`] (`fwd_bwd` per
micro-batch, `update` per step, the opaque [`PartialGradients`]), [`Trainer`] (a thin loop over
the engine), [`train`] (a whole run on the in-process mesh), the token
sources in [`data`], [`Optimizer`].

# The key decision: the gate decides, the types do the rest

When the gate opens, parameters enter each micro-batch typed `{R:data}` (a free cast, outside the
differentiated function). Everything else follows from the `spmd` type rules: the gradients come
out `{U:data}`, add up without communication, and the `reshard` to the plain layout in `update`
is the step's one all-reduce. The trainer checks every gradient against the accumulator type the
gate promised, so a tag dropped anywhere is an error naming the parameter, never a silent early
reduction.
*/
#![deny(missing_docs)]

pub mod checkpoint;
mod config;
pub mod cost;
pub mod data;
mod engine;
mod error;
mod gate;
pub mod hf;
pub mod io;
pub mod keys;
mod optim;
pub mod sample;
mod trainer;

use std::sync::Arc;

use ferrotext_comm::{run_spmd_detachable, Cluster, SpmdOptions, Trace};
use ferrotext_models::ParamInfo;
use ferrotext_spmd::Ctx;
use ferrotext_tensor::Tensor;

pub use config::{
    DatasetOrder, DatasetType, DeviceMemory, MemoryEstimate, NanPolicy, OptType, ResumeMode,
    ShardMode, TrainConfig,
};
pub use engine::{compute_mesh, Batch, Engine, FwdBwd, Gradients, PartialGradients, StepMetrics};
pub use error::TrainError;
pub use gate::{
    deferral_axes, deferral_gate, deferred_spec, zero1_gate, zero1_spec, Deferral, Zero1,
};
pub use optim::{clip_scale, learning_rate, Optimizer};
pub use trainer::{plan_step, Trainer};

/// A callback for each finished step (progress bars, probes); owned, since the device threads
/// that call it may outlive a failed run's caller.
pub type StepCallback = Arc<dyn Fn(&StepMetrics) + Send + Sync>;

/// Extras of a run beyond the config.
#[derive(Default)]
pub struct RunOptions<'a> {
    /// Called after every step on the first device of each process (device 0 alone in one
    /// process): progress reporting, per-process probes.
    pub on_step: Option<StepCallback>,
    /// Gather the final parameters into the report.
    pub return_params: bool,
    /// Stop after this many steps of this run (as an interrupted run would; the schedule still
    /// spans `steps`).
    pub stop_after_steps: Option<usize>,
    /// Diagnostic: use this spec for this parameter inside micro-batches (see
    /// [`Engine::override_inside_spec`]).
    pub inside_spec_override: Option<(String, ferrotext_sharding::PartitionSpec)>,
    /// The processes the mesh spans (`None`: every device is a thread of this process). Its
    /// process count must equal `num_processes`.
    pub cluster: Option<&'a dyn Cluster>,
    /// Append each step's metrics to this JSON-lines file as the step ends (device 0 writes;
    /// see [`io::MetricsLog`] for what a resumed run keeps).
    pub metrics_path: Option<std::path::PathBuf>,
}

/// What a run produced (the view of this process's first device; device 0 in process 0).
#[derive(Debug)]
pub struct TrainReport {
    /// The gate's decision.
    pub gate: Deferral,
    /// ZeRO-1's decision.
    pub zero1: Zero1,
    /// Per-step metrics of the steps this run took.
    pub metrics: Vec<StepMetrics>,
    /// The step the run started at: 0, or where a checkpoint left off.
    pub first_step: usize,
    /// The collective trace of the whole run (of the device the report comes from).
    pub trace: Trace,
    /// The parameter declarations.
    pub params: Vec<ParamInfo>,
    /// Final parameter values, when asked for.
    pub values: Option<Vec<Tensor>>,
    /// Parameter count.
    pub param_count: usize,
    /// Training FLOPs per token.
    pub flops_per_token: f64,
}

/// Runs `config.steps` steps: on the in-process mesh, or this process's share of it under a
/// [`Cluster`] (every process calls `train` with the same config; device 0, in process 0, reports
/// progress and writes checkpoints).
///
/// # Errors
/// The first device's failure: a bad parameter file, a type error, a collective failure, an
/// accumulator-type violation; under a cluster, also processes started with different configs.
pub fn train(config: &TrainConfig, options: &RunOptions<'_>) -> Result<TrainReport, TrainError> {
    let valid = config.validate();
    if let Some(cluster) = options.cluster {
        // Every process takes part in the agreement, even one whose config is invalid, so none
        // waits for another that already gave up.
        let described = match &valid {
            Ok(()) => format!("{config:?}"),
            Err(e) => format!("invalid: {e}"),
        };
        let timeout = ferrotext_comm::collective_timeout(config.collective_timeout_seconds)
            .unwrap_or(SpmdOptions::default().collective_timeout);
        cluster.agree("the config", described.as_bytes(), timeout)?;
        if cluster.processes() != config.num_processes {
            return Err(TrainError::Config(format!(
                "num_processes = {} but the job has {} processes",
                config.num_processes,
                cluster.processes()
            )));
        }
    }
    valid?;
    config.check_fits_in_memory()?;
    let model_cfg = config.model()?;
    let model = ferrotext_models::qwen3::Qwen3::new(model_cfg.clone())
        .map_err(|e| TrainError::Config(e.to_string()))?;
    let source: Arc<dyn data::TokenSource> =
        Arc::from(data::source_for(config, model_cfg.vocab_size)?);
    let initial = if config.load_parameters_path.is_empty() {
        None
    } else {
        Some(io::load_parameters(
            std::path::Path::new(&config.load_parameters_path),
            &model.params(),
        )?)
    };
    // Resume (strict; `resume=fresh` moves old checkpoints aside): process 0 changes files.
    let root = config.checkpoint_root();
    let resume_from = match options.cluster {
        None => checkpoint::prepare_resume(config, &root, true)?,
        Some(cluster) => agreed_resume(config, &root, cluster)?,
    };
    let mesh = compute_mesh(config)?;
    let spmd = SpmdOptions::default().with_timeout_secs(config.collective_timeout_seconds)?;
    // The device program owns what it reads, so a run whose group has failed can return even
    // while a device thread is still busy (it is detached and named in the error).
    let config = Arc::new(config.clone());
    let run: Arc<RunOptions<'static>> = Arc::new(RunOptions {
        on_step: options.on_step.clone(),
        return_params: options.return_params,
        stop_after_steps: options.stop_after_steps,
        inside_spec_override: options.inside_spec_override.clone(),
        metrics_path: options.metrics_path.clone(),
        // Devices reach the cluster through their backends; the program needs no reference.
        cluster: None,
    });
    let results = run_spmd_detachable(
        options.cluster,
        &mesh,
        &spmd,
        move |dev| -> Result<Option<TrainReport>, TrainError> {
            let config: &TrainConfig = &config;
            let device = dev.index();
            let threads = dev.threads();
            let mut cx = Ctx::new(dev.comm(), threads);
            let mut trainer = Trainer::new(&mut cx, config, source.clone(), initial.as_deref())?;
            if let Some((name, spec)) = &run.inside_spec_override {
                trainer
                    .engine_mut()
                    .override_inside_spec(name, spec.clone())?;
            }
            // Automatic resume: the same run name continues from its latest checkpoint; the
            // data position is the step index, so no batch is skipped or repeated.
            if let Some(dir) = &resume_from {
                trainer.engine_mut().restore_checkpoint(&mut cx, dir)?;
            }
            let first_step = trainer.engine().steps_taken();
            let mut log = match &run.metrics_path {
                Some(path) if device == 0 => Some(io::MetricsLog::open(path, first_step)?),
                _ => None,
            };
            let mut metrics = Vec::with_capacity(config.steps);
            let limit = run.stop_after_steps.map_or(config.steps, |n| {
                (trainer.engine().steps_taken() + n).min(config.steps)
            });
            while trainer.engine().steps_taken() < limit {
                let period = config.checkpoint_micro_batch_period;
                let m = trainer.step_with(&mut cx, &mut |cx, engine, done| {
                    if config.enable_checkpointing && period > 0 && done % period == 0 {
                        engine.save_checkpoint(cx, &root)?;
                    }
                    Ok(())
                })?;
                if let Some(log) = &mut log {
                    log.append(&m)?;
                }
                if device % config.local_devices == 0 {
                    if let Some(f) = &run.on_step {
                        f(&m);
                    }
                }
                let done = trainer.engine().steps_taken();
                if config.enable_checkpointing
                    && (done % config.checkpoint_period == 0 || done == config.steps)
                {
                    trainer.engine().save_checkpoint(&mut cx, &root)?;
                }
                metrics.push(m);
            }
            let values = if run.return_params {
                Some(trainer.engine().params_to_host(&mut cx)?)
            } else {
                None
            };
            Ok(Some(TrainReport {
                gate: trainer.engine().gate().clone(),
                zero1: trainer.engine().zero1().clone(),
                metrics,
                first_step,
                trace: cx.comm().take_trace(),
                params: trainer.engine().param_infos().to_vec(),
                values,
                param_count: trainer.engine().model().param_count(),
                flops_per_token: trainer
                    .engine()
                    .model()
                    .flops_per_token(config.max_target_length),
            }))
        },
    )
    .map_err(TrainError::from)?;
    results
        .into_iter()
        .next()
        .flatten()
        .ok_or_else(|| TrainError::Config("this process ran no device".into()))
}

/// The checkpoint every process of a job resumes from: process 0 tidies the checkpoint
/// directory first (stale temporaries, an interrupted replacement, `resume=fresh`), the others
/// read `latest` only after it has (a barrier), and all must resolve the same checkpoint — a
/// file system that is not shared, or a `latest` that changed in between, stops the job here
/// instead of resuming processes from different states. Every process takes part in both
/// agreements even when its own resolution failed, so none waits for another that gave up.
fn agreed_resume(
    config: &TrainConfig,
    root: &std::path::Path,
    cluster: &dyn Cluster,
) -> Result<Option<std::path::PathBuf>, TrainError> {
    let timeout = ferrotext_comm::collective_timeout(config.collective_timeout_seconds)
        .unwrap_or(SpmdOptions::default().collective_timeout);
    let writer = cluster.process() == 0;
    let tidied = writer.then(|| checkpoint::prepare_resume(config, root, true));
    cluster.agree("the checkpoint directory's tidy-up", b"done", timeout)?;
    let resolved = match tidied {
        Some(result) => result,
        None => checkpoint::prepare_resume(config, root, false),
    };
    let described = match &resolved {
        Ok(dir) => format!("{dir:?}"),
        Err(e) => format!("error: {e}"),
    };
    cluster.agree(
        "the checkpoint to resume from",
        described.as_bytes(),
        timeout,
    )?;
    resolved
}
