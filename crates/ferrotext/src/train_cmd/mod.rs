//! `ferrotext train [config.toml] key=value ...`: plan the run first (one clear line and exit
//! code 2 on bad input, nothing written), train with a progress bar, then print a summary and
//! write per-step metrics as JSON lines. `ferrotext plan` lives here too ([`plan()`]): it reads the
//! same arguments.
//!
//! Errors come back as [`TrainError`](ferrotext_train::TrainError)s; `main` picks the exit code
//! from their class (2 for the user's input, 1 for everything else).
//!
//! `FERROTEXT_FAULT` injects a failure into the run to check how it is reported, in the tests'
//! builds only (`fault.rs`).
//!
//! Files: this one runs `train` step by step ([`run`]); `help.rs` writes `train --help`'s list of
//! keys; `plan.rs` is `ferrotext plan`, `prediction.rs` prints its `--cluster` prediction;
//! `summary.rs` prints the end of a run and delivers its outputs.

mod fault;
mod help;
mod plan;
mod prediction;
mod summary;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use ferrotext_train::{
    io, train_plan, RunOptions, RunPlan, StepCallback, StepMetrics, TrainConfig, TrainReport,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::common::{config_args, UsageError};
use crate::emulate::probe::WireProbe;
use crate::launch::Launch;
use fault::InjectedFault;

pub use help::keys_help;
pub use plan::{plan, PlanArgs};

/// Arguments of `ferrotext train`.
#[derive(Args)]
pub struct TrainArgs {
    /// An optional TOML config file, then `key=value` overrides.
    args: Vec<String>,
}

/// The run the arguments describe, planned (every key checked once).
fn load(args: &[String]) -> Result<RunPlan> {
    Ok(config_args::parse_config(args)?.plan()?)
}

/// What the run header calls the model: the HF directory it comes from (whose `config.json`
/// shapes it), else the preset.
fn model_label(config: &TrainConfig) -> String {
    let dir = Path::new(&config.load_parameters_path);
    if !config.load_parameters_path.is_empty() && dir.is_dir() {
        format!("the Hugging Face model in {}", dir.display())
    } else {
        config.model_name.clone()
    }
}

/// The header's line on a HF directory whose `config.json` ties the head to the embedding while
/// its weights store a head of their own (loaded untied, as transformers 5 loads it and warns).
fn untied_head_note(config: &TrainConfig) -> Option<&'static str> {
    let dir = Path::new(&config.load_parameters_path);
    (!config.load_parameters_path.is_empty() && ferrotext_hf::head_untied_by_its_weights(dir))
        .then_some(
            "head: config.json ties it to the embedding, but the weights store an \
             `lm_head.weight` of their own: loaded untied, as transformers 5 loads it",
        )
}

/// The config of one process of the job: the user's, with `num_processes` from the launcher.
fn load_for(args: &TrainArgs, launch: &Launch) -> Result<RunPlan> {
    let processes = launch.processes();
    let given = config_args::last_value(&args.args, "num_processes");
    if processes == 1 {
        // One process alone would run every process's devices itself (and report each step
        // once for each): a job of several processes is started by a launcher.
        if let Some(given) = given.filter(|g| g.trim() != "1") {
            return Err(UsageError(format!(
                "num_processes={given} but this is one process, not started by a launcher: \
                 run it under `mpirun -n {given}` (or `ferrotext emulate`), or leave \
                 num_processes out"
            ))
            .into());
        }
        return load(&args.args);
    }
    if let Some(given) = given.filter(|g| g.trim() != processes.to_string()) {
        return Err(UsageError(format!(
            "num_processes={given} but the launcher started {processes} processes"
        ))
        .into());
    }
    let mut with_processes = args.args.clone();
    with_processes.push(format!("num_processes={processes}"));
    load(&with_processes)
}

/// Tokens one optimizer step trains on, over all devices.
fn tokens_per_step(config: &TrainConfig) -> usize {
    config.micro_batch_rows() * config.gradient_accumulation_steps * config.max_target_length
}

/// Runs the command (under MPI: this process's share; process 0 prints and writes).
pub fn run(args: &TrainArgs, launch: &Launch) -> Result<()> {
    let plan = load_for(args, launch)?;
    let config = plan.config();
    let fault = InjectedFault::from_env()?;
    // Before the header names the kernel, and before any product runs.
    ferrotext_train::select_matmul_kernel(config)?;
    // Every output is checked before anything runs: a bad path is bad input, found now.
    io::check_output_paths(config)?;
    // Under `ferrotext emulate`: each process logs its link's counters at every step boundary.
    let wire = Arc::new(WireProbe::from_env(launch));
    if !launch.is_leader() {
        // Every process computes the same run; only process 0 reports it.
        return follow(&plan, launch, &wire, fault);
    }
    print_header(&plan, launch);
    let metrics_path = plan.metrics_path().to_path_buf();
    let (report, wall) = train_with_progress(&plan, launch, wire, fault, &metrics_path)?;
    if report.metrics.is_empty() {
        summary::print_nothing_to_do(&plan);
        // A job killed after its last checkpoint but before its outputs is restarted exactly
        // like this: it still owes them, from the final checkpoint it restored.
        return summary::deliver_outputs(config, &report, &metrics_path, launch);
    }
    let step_seconds = summary::print_summary(&plan, &report, wall);
    if config.profile {
        summary::report_profile(config, &metrics_path, launch.process(), step_seconds)?;
    }
    summary::deliver_outputs(config, &report, &metrics_path, launch)
}

/// Records each step's link counters into `wire`'s probe, when there is one.
fn wire_recorder(wire: Arc<Option<WireProbe>>) -> impl Fn(&StepMetrics) + Send + Sync + 'static {
    move |m: &StepMetrics| wire.iter().for_each(|w| w.record(m))
}

/// The run of a process other than 0: the same computation, silent (its wire probe still
/// records each step).
fn follow(
    plan: &RunPlan,
    launch: &Launch,
    wire: &Arc<Option<WireProbe>>,
    fault: InjectedFault,
) -> Result<()> {
    let on_step: Option<StepCallback> = match wire.as_ref() {
        Some(_) => Some(Arc::new(wire_recorder(wire.clone()))),
        None => None,
    };
    let options = fault.apply(RunOptions {
        on_step,
        cluster: launch.cluster(),
        return_params: !plan.config().save_parameters_path.is_empty(),
        ..Default::default()
    });
    train_plan(plan, &options)?;
    Ok(())
}

/// The lines before the first step: the cluster (under MPI), the model on its mesh, where the
/// outputs go, the matmul kernel, the precision keys and, in bf16, the bf16 kernel.
fn print_header(plan: &RunPlan, launch: &Launch) {
    let config = plan.config();
    let model = plan.decoder().config();
    if let Some(cluster) = launch.cluster() {
        println!(
            "{}: {} devices per process",
            cluster.describe(),
            config.local_devices
        );
    }
    println!(
        "{} ({} layers, d {}, vocab {}) on {}; GA {}, {} tokens per step, {} steps",
        model_label(config),
        model.base_num_decoder_layers,
        model.base_emb_dim,
        model.vocab_size,
        plan.mesh(),
        config.gradient_accumulation_steps,
        tokens_per_step(config),
        config.steps
    );
    if let Some(note) = untied_head_note(config) {
        println!("{note}");
    }
    println!("outputs: {}", plan.output_dir().display());
    println!("matmul: {}", ferrotext_tensor::matmul_kernel());
    // The set the portable kernel and the row kernels ran on: what a claim of equal bits
    // across processors is checked against (tests/deterministic.rs).
    println!("instruction set: {}", ferrotext_tensor::instruction_set());
    println!("precision: {}", plan.precision());
    if let Some(kernel) = bf16_kernel(plan) {
        println!("bf16 matmul: {kernel}");
    }
    if let Some(change) = ferrotext_train::checkpoint::dtype_change(config, &plan.checkpoint_root())
    {
        println!("{change}");
    }
}

/// What computes a bf16 run's products (`select_matmul_kernel` fixed it; `None` for float32).
pub(crate) fn bf16_kernel(plan: &RunPlan) -> Option<String> {
    (plan.precision().dtype == ferrotext_sharding::DType::BF16)
        .then(ferrotext_tensor::bf16_matmul_kernel)
        .and_then(Result::ok)
}

/// Trains process 0's share under a progress bar (step lines printed above it, see
/// [`step_line`]); returns the report and the run's wall time in seconds.
fn train_with_progress(
    plan: &RunPlan,
    launch: &Launch,
    wire: Arc<Option<WireProbe>>,
    fault: InjectedFault,
    metrics_path: &Path,
) -> Result<(TrainReport, f64)> {
    let config = plan.config();
    let bar = ProgressBar::new(config.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} step  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()), // ok: the template is a constant
    );
    let on_step = show_progress(bar.clone(), config.steps, wire_recorder(wire));
    let options = fault.apply(RunOptions {
        on_step: Some(Arc::new(on_step)),
        return_params: !config.save_parameters_path.is_empty(),
        cluster: launch.cluster(),
        metrics_path: Some(metrics_path.to_path_buf()),
        ..Default::default()
    });
    let started = Instant::now();
    let report = train_plan(plan, &options)?;
    bar.finish_and_clear();
    Ok((report, started.elapsed().as_secs_f64()))
}

/// The step callback of process 0: records the step (`record`), moves `bar` and prints the
/// step's line above it when [`step_line`] has one.
fn show_progress(
    bar: ProgressBar,
    steps: usize,
    record: impl Fn(&StepMetrics) + Send + Sync + 'static,
) -> impl Fn(&StepMetrics) + Send + Sync + 'static {
    move |m: &StepMetrics| {
        record(m);
        bar.set_position(m.step as u64 + 1);
        bar.set_message(format!(
            "loss {:.4}  {:.0} tok/s",
            m.loss,
            m.tokens as f64 / m.seconds
        ));
        if let Some(line) = step_line(m, steps) {
            bar.suspend(|| println!("{line}"));
        }
    }
}

/// The line printed for step `m` of a run of `steps`: every tenth of the run, the last step,
/// every skipped step and every evaluated one; `None` for the others.
fn step_line(m: &StepMetrics, steps: usize) -> Option<String> {
    let shown = m.step.is_multiple_of((steps / 10).max(1))
        || m.step + 1 == steps
        || m.skipped
        || m.eval_loss.is_some();
    if !shown {
        return None;
    }
    let skipped = if m.skipped {
        "  skipped: not finite"
    } else {
        ""
    };
    let mtp = m
        .mtp_loss
        .map_or(String::new(), |l| format!("  mtp_loss {l:.4}"));
    let epoch = m.epoch.map_or(String::new(), |e| format!("  epoch {e}"));
    let eval = m.eval_loss.map_or(String::new(), |l| {
        format!(
            "  eval_loss {l:.4} (ppl {:.2})",
            ferrotext_tensor::fixed_math::exp_f64(l)
        )
    });
    Some(format!(
        "step {:>4}  loss {:.4}{mtp}  grad_norm {:.3}  lr {:.2e}  {:.0} ms{epoch}{eval}{skipped}",
        m.step,
        m.loss,
        m.grad_norm,
        m.learning_rate,
        m.seconds * 1e3
    ))
}
