//! A whole run: [`train`] plans the config once, starts one device program per device (threads
//! of this process, or this process's share under a [`Cluster`]), and each device runs the
//! training loop in [`device_loop`] — the one place where a step's parts are put in order.

use ferrotext_profile::{Phase, STEP_KIND};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_comm::{run_spmd_detachable, Cluster, SpmdOptions, Trace};
use ferrotext_models::ParamInfo;
#[cfg(feature = "fault-injection")]
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{on_device, Ctx};
use ferrotext_tensor::Tensor;

use crate::checkpoint;
use crate::config::TrainConfig;
use crate::data::{self, TokenSource};
use crate::engine::StepMetrics;
use crate::error::TrainError;
use crate::gate::{Deferral, Zero1};
use crate::io;
use crate::plan::RunPlan;
use crate::trainer::Trainer;

/// A callback for each finished step (progress bars, probes); owned, since the device threads
/// that call it may outlive a failed run's caller.
pub type StepCallback = Arc<dyn Fn(&StepMetrics) + Send + Sync>;

/// A failure injected on purpose, to check how each class of error reaches the user (the
/// binary's tests set it through `FERROTEXT_FAULT`). Only in builds with the `fault-injection`
/// feature (the tests'), never in a release binary.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Device `device` panics before its first step, as a bug in a kernel would.
    DevicePanic {
        /// The device that panics.
        device: usize,
    },
    /// After the first step, the loop calls `update` again with nothing accumulated: a caller
    /// breaking the engine API's contract.
    EngineMisuse,
}

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
    /// Test hook (`fault-injection` feature): use this spec for this parameter inside
    /// micro-batches (see [`crate::Engine::override_inside_spec`]).
    #[cfg(feature = "fault-injection")]
    pub inside_spec_override: Option<(String, PartitionSpec)>,
    /// The processes the mesh spans (`None`: every device is a thread of this process). Its
    /// process count must equal `num_processes`.
    pub cluster: Option<&'a dyn Cluster>,
    /// Append each step's metrics to this JSON-lines file as the step ends (device 0 writes;
    /// see [`io::MetricsLog`] for what a resumed run keeps).
    pub metrics_path: Option<PathBuf>,
    /// Test hook (`fault-injection` feature): a failure to inject (see [`Fault`]).
    #[cfg(feature = "fault-injection")]
    pub fault: Option<Fault>,
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

/// Runs `config.steps` steps: plans `config` ([`TrainConfig::plan`]) and runs [`train_plan`].
///
/// # Errors
/// As [`TrainConfig::plan`] and [`train_plan`].
pub fn train(config: &TrainConfig, options: &RunOptions<'_>) -> Result<TrainReport, TrainError> {
    match config.plan() {
        Ok(plan) => train_plan(&plan, options),
        Err(e) => {
            if let Some(cluster) = options.cluster {
                // Every process takes part in the agreement, even one whose config is invalid,
                // so none waits for another that already gave up.
                let _ = cluster.agree(
                    "the config",
                    format!("invalid: {e}").as_bytes(),
                    agreement_timeout(config),
                );
            }
            Err(e)
        }
    }
}

/// Puts this process's matrix products on the kernel `config` asks for: the portable,
/// fixed-order kernel under `deterministic=true` (the same bits on any processor); otherwise
/// the default choice (the fastest library found) stands; then, for `dtype=bfloat16`, the bf16
/// kernel ([`TrainConfig::select_bf16_kernel`]). Call it before any product runs.
///
/// # Errors
/// `deterministic=true` in a process whose products already run on another kernel (because
/// `FERROTEXT_MATMUL` named a library): a usage error naming the key and that kernel; a bf16 run
/// on a kernel without a bf16 product and no `matmul_bf16_fallback` ([`TrainError::Precision`]).
pub fn select_matmul_kernel(config: &TrainConfig) -> Result<(), TrainError> {
    ferrotext_tensor::check_kernel_env().map_err(|e| TrainError::usage("FERROTEXT_MATMUL", e))?;
    if !config.deterministic {
        return config.select_bf16_kernel().map(drop);
    }
    ferrotext_tensor::use_portable_matmul().map_err(|other| {
        TrainError::usage(
            "deterministic",
            format!(
                "deterministic=true needs the portable matmul kernel, but this process computes on {other} (FERROTEXT_MATMUL chose it): unset \
                 FERROTEXT_MATMUL or set it to `portable`"
            ),
        )
    })?;
    config.select_bf16_kernel().map(drop)
}

/// Runs the plan's steps: on the in-process mesh, or this process's share of it under a
/// [`Cluster`] (every process calls it with the same config; device 0, in process 0, reports
/// progress and writes checkpoints).
///
/// # Errors
/// A run that does not fit in this machine's memory; the first device's failure: a bad
/// parameter file, a type error, a collective failure, an accumulator-type violation; under a
/// cluster, also processes started with different configs.
pub fn train_plan(plan: &RunPlan, options: &RunOptions<'_>) -> Result<TrainReport, TrainError> {
    let config = plan.config();
    if config.profile {
        ferrotext_profile::enable();
    }
    if let Some(cluster) = options.cluster {
        let described = format!("{config:?}");
        cluster.agree(
            "the config",
            described.as_bytes(),
            agreement_timeout(config),
        )?;
        if cluster.processes() != config.num_processes {
            return Err(TrainError::usage(
                "num_processes",
                format!(
                    "num_processes = {} but the job has {} processes",
                    config.num_processes,
                    cluster.processes()
                ),
            ));
        }
    }
    select_matmul_kernel(config)?;
    plan.check_fits_in_memory()?;
    let source: Arc<dyn TokenSource> = Arc::from(data::source_for(
        config,
        plan.decoder().config().vocab_size,
    )?);
    let eval_source: Option<Arc<dyn TokenSource>> =
        data::eval_source_for(config, plan.decoder().config().vocab_size)?.map(Arc::from);
    let initial = if config.load_parameters_path.is_empty() {
        None
    } else {
        Some(io::load_parameters(
            Path::new(&config.load_parameters_path),
            plan.params(),
        )?)
    };
    // Resume (strict; `resume=fresh` moves old checkpoints aside): process 0 changes files.
    let root = plan.checkpoint_root();
    let resume_from = match options.cluster {
        None => checkpoint::prepare_resume(config, &root, true)?,
        Some(cluster) => agreed_resume(config, &root, cluster)?,
    };
    let spmd = SpmdOptions::default().with_timeout_secs(config.collective_timeout_seconds)?;
    // The device program owns what it reads, so a run whose group has failed can return even
    // while a device thread is still busy (it is detached and named in the error).
    let device_run = Arc::new(DeviceRun {
        plan: plan.clone(),
        source,
        eval_source,
        initial,
        resume_from,
        root,
        on_step: options.on_step.clone(),
        return_params: options.return_params,
        stop_after_steps: options.stop_after_steps,
        #[cfg(feature = "fault-injection")]
        inside_spec_override: options.inside_spec_override.clone(),
        metrics_path: options.metrics_path.clone(),
        #[cfg(feature = "fault-injection")]
        fault: options.fault,
    });
    let results = run_spmd_detachable(
        options.cluster,
        plan.compute_mesh(),
        &spmd,
        move |dev| -> Result<Option<TrainReport>, TrainError> {
            let device = dev.index();
            on_device(dev, |cx| device_run.run(cx, device).map(Some))
        },
    )
    .map_err(TrainError::from)?;
    results
        .into_iter()
        .next()
        .flatten()
        .ok_or_else(|| TrainError::Internal("this process ran no device".into()))
}

/// Everything one device program reads, owned.
struct DeviceRun {
    plan: RunPlan,
    source: Arc<dyn TokenSource>,
    eval_source: Option<Arc<dyn TokenSource>>,
    initial: Option<Vec<Tensor>>,
    resume_from: Option<PathBuf>,
    root: PathBuf,
    on_step: Option<StepCallback>,
    return_params: bool,
    stop_after_steps: Option<usize>,
    #[cfg(feature = "fault-injection")]
    inside_spec_override: Option<(String, PartitionSpec)>,
    metrics_path: Option<PathBuf>,
    #[cfg(feature = "fault-injection")]
    fault: Option<Fault>,
}

impl DeviceRun {
    /// One device's run: set up its trainer (resuming if asked), run the loop, report.
    fn run(&self, cx: &mut Ctx<'_>, device: usize) -> Result<TrainReport, TrainError> {
        #[cfg(feature = "fault-injection")]
        if self.fault == Some(Fault::DevicePanic { device }) {
            // ok: the tests-only fault a caller asks for (RunOptions::fault), never user input.
            panic!("injected fault: device {device} panics before its first step");
        }
        let plan = &self.plan;
        let mut trainer = Trainer::new(cx, plan, self.source.clone(), self.initial.as_deref())?;
        #[cfg(feature = "fault-injection")]
        if let Some((name, spec)) = &self.inside_spec_override {
            trainer
                .engine_mut()
                .override_inside_spec(name, spec.clone())?;
        }
        // Automatic resume: the same run name continues from its latest checkpoint; the data
        // position is the step index, so no batch is skipped or repeated.
        if let Some(dir) = &self.resume_from {
            trainer.engine_mut().restore_checkpoint(cx, dir)?;
        }
        let first_step = trainer.engine().steps_taken();
        let mut log = match &self.metrics_path {
            Some(path) if device == 0 => Some(io::MetricsLog::open(path, first_step)?),
            _ => None,
        };
        let mut events = match &self.metrics_path {
            Some(_) if device == 0 && plan.config().tensorboard => Some(
                crate::tensorboard::EventWriter::create(&plan.output_dir().join("tensorboard"))?,
            ),
            _ => None,
        };
        let reports_progress = device.is_multiple_of(plan.config().local_devices);
        let metrics = self.device_loop(cx, &mut trainer, &mut |m| {
            if let Some(log) = &mut log {
                log.append(m)?;
            }
            if let Some(events) = &mut events {
                events.step(m)?;
            }
            if reports_progress {
                if let Some(f) = &self.on_step {
                    f(m);
                }
            }
            Ok(())
        })?;
        let engine = trainer.engine();
        let values = if self.return_params {
            Some(engine.params_to_host(cx)?)
        } else {
            None
        };
        Ok(TrainReport {
            gate: plan.deferral().clone(),
            zero1: plan.zero1().clone(),
            metrics,
            first_step,
            trace: cx.comm().take_trace(),
            params: plan.params().to_vec(),
            values,
            param_count: plan.decoder().param_count(),
            flops_per_token: plan
                .decoder()
                .flops_per_token(plan.config().max_target_length),
        })
    }

    /// The training loop, nanoGPT-shaped: per step the learning rate, the micro-batches, the
    /// update, the log, then checkpoints. `log` records a finished step (metrics file,
    /// progress); it runs before the step's checkpoint, so a checkpoint never names a step the
    /// metrics file lacks.
    fn device_loop(
        &self,
        cx: &mut Ctx<'_>,
        trainer: &mut Trainer,
        log: &mut dyn FnMut(&StepMetrics) -> Result<(), TrainError>,
    ) -> Result<Vec<StepMetrics>, TrainError> {
        let config = self.plan.config();
        let ga = config.gradient_accumulation_steps;
        let start = trainer.engine().steps_taken();
        let end = self
            .stop_after_steps
            .map_or(config.steps, |n| (start + n).min(config.steps));
        let checkpoints = config.enable_checkpointing;
        let mut metrics = Vec::with_capacity(end.saturating_sub(start));
        let profiled = config.profile.then(|| config.profile_step_range());
        if profiled.is_some() {
            ferrotext_profile::begin_thread(cx.device());
        }
        while trainer.engine().steps_taken() < end {
            let step = trainer.engine().steps_taken();
            // 0. profiler: record this step if it is in `profile_steps` (a no-op when off).
            ferrotext_profile::set_step(
                profiled
                    .as_ref()
                    .filter(|r| r.contains(&step))
                    .map(|_| step),
            );
            let step_span = ferrotext_profile::span_in(STEP_KIND, Phase::Other);
            // 1. micro-batches: forward, backward, accumulate. Deferral happens here: with the
            //    gate open the gradients stay unreduced ({U:data}) in the accumulator, so no
            //    micro-batch communicates them; the step's one reduction is in `update`.
            //    Checkpoints inside the step are taken between micro-batches.
            // 2. update: the learning rate (linear warmup, then cosine decay to the floor), the
            //    one reduction, ÷ tokens, clip, optimizer step.
            let period = config.checkpoint_micro_batch_period;
            let root = &self.root;
            let mut m = trainer.step_with(cx, &mut |cx, engine, done| {
                if checkpoints && done < ga && period > 0 && done % period == 0 {
                    // A mid-step checkpoint stores the reduced accumulator (phase `checkpoint`).
                    engine.save_checkpoint(cx, root)?;
                }
                Ok(())
            })?;
            drop(step_span);
            #[cfg(feature = "fault-injection")]
            if self.fault == Some(Fault::EngineMisuse) {
                trainer.engine_mut().update(cx)?;
            }
            // 3. eval, every `eval_interval` steps and at the last: the held-out loss on the
            //    step's weights (forward only, trace phase `eval`, no gradient collective).
            let done = trainer.engine().steps_taken();
            let interval = config.eval_interval;
            if let Some(source) = self.eval_source.as_deref() {
                if interval > 0 && (done.is_multiple_of(interval) || done == config.steps) {
                    let loss = trainer.evaluate(cx, source)?;
                    m.eval_loss = Some(loss);
                    m.eval_perplexity = Some(ferrotext_tensor::fixed_math::exp_f64(loss));
                }
            }
            // 4. log: the metrics file and the progress callback.
            log(&m)?;
            // 5. checkpoint, every `checkpoint_period` steps and at the last.
            if checkpoints
                && (done.is_multiple_of(config.checkpoint_period) || done == config.steps)
            {
                trainer.engine().save_checkpoint(cx, &self.root)?;
            }
            metrics.push(m);
        }
        ferrotext_profile::finish_thread();
        Ok(metrics)
    }
}

/// How long processes wait for each other to agree (the collective timeout).
fn agreement_timeout(config: &TrainConfig) -> std::time::Duration {
    ferrotext_comm::collective_timeout(config.collective_timeout_seconds)
        .unwrap_or(SpmdOptions::default().collective_timeout)
}

/// The checkpoint every process of a job resumes from: process 0 tidies the checkpoint
/// directory first (stale temporaries, an interrupted replacement, `resume=fresh`), the others
/// read `latest` only after it has (a barrier), and all must resolve the same checkpoint — a
/// file system that is not shared, or a `latest` that changed in between, stops the job here
/// instead of resuming processes from different states. Every process takes part in both
/// agreements even when its own resolution failed, so none waits for another that gave up.
fn agreed_resume(
    config: &TrainConfig,
    root: &Path,
    cluster: &dyn Cluster,
) -> Result<Option<PathBuf>, TrainError> {
    let timeout = agreement_timeout(config);
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
