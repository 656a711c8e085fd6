//! `ferrotext train [config.toml] key=value ...`: plan the run first (one clear line and exit
//! code 2 on bad input, nothing written), train with a progress bar, then print a summary and
//! write per-step metrics as JSON lines.
//!
//! Errors come back as [`TrainError`]s; `main` picks the exit code from their class (2 for the
//! user's input, 1 for everything else).
//!
//! `FERROTEXT_FAULT` (tests only) injects a failure into the run to check how it is reported:
//! `device_panic:N` (device `N` panics) or `engine_misuse` (an `update` with nothing
//! accumulated).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use ferrotext_comm::{human_bytes, CollectiveKind, PhasePattern};
use ferrotext_train::{
    io, train_plan, Fault, RunOptions, RunPlan, StepMetrics, TrainConfig, TrainReport,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::bench::median;
use crate::launch::Launch;
use crate::UsageError;

/// Arguments of `ferrotext train`.
#[derive(Args)]
pub struct TrainArgs {
    /// An optional TOML config file, then `key=value` overrides.
    args: Vec<String>,
}

/// The failure `FERROTEXT_FAULT` asks to inject (see the module docs).
fn injected_fault() -> Result<Option<Fault>> {
    let Ok(text) = std::env::var("FERROTEXT_FAULT") else {
        return Ok(None);
    };
    match text.split_once(':') {
        None if text == "engine_misuse" => Ok(Some(Fault::EngineMisuse)),
        Some(("device_panic", n)) => match n.parse() {
            Ok(device) => Ok(Some(Fault::DevicePanic { device })),
            Err(_) => {
                Err(UsageError(format!("FERROTEXT_FAULT `{text}`: `{n}` is not a device")).into())
            }
        },
        _ => Err(UsageError(format!(
            "FERROTEXT_FAULT `{text}` is not `device_panic:N` or `engine_misuse`"
        ))
        .into()),
    }
}

/// The run the arguments describe, planned (every key checked once).
fn load(args: &TrainArgs) -> Result<RunPlan> {
    Ok(parse_config(&args.args)?.plan()?)
}

/// The config of `[config.toml] key=value ...`: a first argument without `=` is the file.
pub fn parse_config(args: &[String]) -> Result<TrainConfig> {
    let (file, overrides): (Option<PathBuf>, &[String]) = match args.first() {
        Some(first) if !first.contains('=') => (Some(PathBuf::from(first)), &args[1..]),
        _ => (None, args),
    };
    Ok(TrainConfig::parse(file.as_deref(), overrides)?)
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

/// Arguments of `ferrotext plan`.
#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    train: TrainArgs,
    /// Predict the step on a cluster:
    /// `hosts=H,devices_per_host=L,link=25gbit,10us[,intra=200gbit,1us][,mem=20GB/s][,link_per=host|device]`
    /// (`link` is a host's link, shared by its devices, unless `link_per=device`).
    #[arg(long)]
    cluster: Option<String>,
    /// A device's throughput for `--cluster`: GFLOP/s, `measured` (the default: a forward +
    /// backward micro-batch of this model timed here on the threads one of the cluster's devices
    /// would get on this machine, with as many devices side by side as fill its cores) or `gemm`
    /// (a 512³ matmul on those threads alone: a kernel's peak, optimistic for a micro-batch).
    #[arg(long = "device-gflops", allow_hyphen_values = true)]
    device_gflops: Option<String>,
    /// With `--cluster`: print the prediction as JSON.
    #[arg(long)]
    json: bool,
}

/// `ferrotext plan`: one step in abstract mode; with `--cluster`, the predicted step.
pub fn plan(args: &PlanArgs) -> Result<()> {
    if let Some(text) = &args.cluster {
        return plan_cluster(args, text);
    }
    if args.json || args.device_gflops.is_some() {
        return Err(UsageError("--json and --device-gflops need --cluster".into()).into());
    }
    let plan = load(&args.train)?;
    let config = plan.config();
    let source: std::sync::Arc<dyn ferrotext_train::data::TokenSource> = std::sync::Arc::from(
        ferrotext_train::data::source_for(config, plan.decoder().config().vocab_size)?,
    );
    let started = Instant::now();
    let (gate, trace) = ferrotext_train::plan_step(&plan, source)?;
    println!(
        "planned one step of {} ({} parameters) on {} in {:.2} s: every sharding rule checked",
        model_label(config),
        plan.decoder().param_count(),
        plan.mesh(),
        started.elapsed().as_secs_f64()
    );
    println!("deferral: {}", gate.describe());
    println!("overlap: {}", plan.overlap().describe());
    let mb = PhasePattern::new("micro_batch*");
    println!(
        "all-reduces larger than 8 elements in micro-batches: {}; in update: {}",
        trace.all_reduces_larger_than(8, &mb).len(),
        trace.count(CollectiveKind::AllReduce, &PhasePattern::new("update"))
    );
    println!("\ncollectives of one device:\n{}", trace.summary_table());
    Ok(())
}

/// Where a prediction's device throughput came from, in words.
enum Throughput {
    Given,
    Measured {
        threads: usize,
        cores: usize,
        devices: usize,
        per_thread_run: f64,
        /// Why the default micro-batch measurement was not taken (`None`: `gemm` was asked for).
        instead_of_micro_batch: Option<String>,
    },
    MicroBatch {
        cores: usize,
        devices: usize,
        share: f64,
        run: ferrotext_train::cost::MicroBatchMeasurement,
    },
}

/// `ferrotext plan --cluster ...`: the cost model's predicted step (`ferrotext_train::cost`).
fn plan_cluster(args: &PlanArgs, text: &str) -> Result<()> {
    use ferrotext_train::cost;
    let cluster: cost::ClusterSpec = text
        .parse()
        .map_err(|e: cost::ClusterSpecError| UsageError(e.to_string()))?;
    // The cluster lays the devices out; an explicit, different layout is a contradiction.
    for (key, want) in [
        ("local_devices", cluster.devices_per_host),
        ("num_processes", cluster.hosts),
    ] {
        let given = args
            .train
            .args
            .iter()
            .filter_map(|a| a.strip_prefix(key)?.strip_prefix('='))
            .next_back();
        if let Some(given) = given.filter(|g| g.trim() != want.to_string()) {
            return Err(UsageError(format!(
                "{key}={given} contradicts --cluster ({key} would be {want}); leave it out"
            ))
            .into());
        }
    }
    // The config is validated on the cluster's layout, not on the in-process default.
    let mut on_cluster = TrainArgs {
        args: args.train.args.clone(),
    };
    on_cluster.args.extend([
        format!("local_devices={}", cluster.devices_per_host),
        format!("num_processes={}", cluster.hosts),
    ]);
    let config = load(&on_cluster)?.config().clone();
    let devices = cluster.devices();
    // One device's thread budget if the cluster's devices shared this machine (docs/design.md §3);
    // when they outnumber the cores, each gets cores/devices of its thread.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let budget = cost::device_thread_budget(cores, devices);
    let (threads, share) = (budget.threads, budget.share);
    let gemm = |instead_of_micro_batch: Option<String>| -> Result<(f64, Throughput)> {
        let run = cost::measure_matmul_gflops(512, threads)?;
        let measured = Throughput::Measured {
            threads,
            cores,
            devices,
            per_thread_run: run,
            instead_of_micro_batch,
        };
        // A matmul on one thread alone: scaled by the devices sharing a thread, as before.
        let gemm_share = (cores as f64 / (devices * threads) as f64).min(1.0);
        Ok((run * gemm_share, measured))
    };
    let (gflops, source) = match args.device_gflops.as_deref().map(str::trim) {
        None | Some("measured") => match cost::too_big_to_measure(&config, budget.concurrent)? {
            Some(why) => gemm(Some(why))?,
            None => {
                let run = cost::measure_micro_batch(&config, threads, budget.concurrent, 1, 3)?;
                let gflops = run.gflops * share;
                let measured = Throughput::MicroBatch {
                    cores,
                    devices,
                    share,
                    run,
                };
                (gflops, measured)
            }
        },
        Some("gemm") => gemm(None)?,
        Some(g) => match g.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => (v, Throughput::Given),
            _ => {
                return Err(UsageError(format!(
                "--device-gflops `{g}` must be a positive number (GFLOP/s), `measured` or `gemm`"
            ))
                .into())
            }
        },
    };
    let mut p = cost::predict(&config, &cluster, gflops)?;
    p.device_gflops_source = match &source {
        Throughput::Given => "given",
        Throughput::Measured { .. } => "gemm",
        Throughput::MicroBatch { .. } => "micro_batch",
    }
    .into();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
        return Ok(());
    }
    print_prediction(&p, &source);
    Ok(())
}

fn print_prediction(p: &ferrotext_train::cost::Prediction, source: &Throughput) {
    use ferrotext_train::cost::LinkShare;
    let c = &p.cluster;
    println!(
        "predicted step of {} ({} parameters) on {} hosts × {} devices: {}",
        p.model, p.parameters, c.hosts, c.devices_per_host, p.mesh
    );
    if let Some(link) = &c.link {
        let shared = match c.link_per {
            LinkShare::Host => format!("per host, shared by its {} devices", c.devices_per_host),
            LinkShare::Device => "per device".into(),
        };
        println!("  link between hosts   {link} ({shared})");
    }
    println!("  link inside a host   {}", c.intra);
    println!(
        "  memory bandwidth     {:.1} GB/s per device (prices the optimizer)",
        c.memory_bytes_per_second / 1e9
    );
    match source {
        Throughput::Given => println!(
            "  device throughput    {:.1} GFLOP/s (given by --device-gflops)",
            p.device_gflops
        ),
        Throughput::Measured {
            threads,
            cores,
            devices,
            per_thread_run,
            instead_of_micro_batch,
        } => println!(
            "  device throughput    {:.1} GFLOP/s measured here with gemm (512³ f32 matmul on {threads} thread(s), the budget of one of {devices} devices sharing this machine's {cores} cores: {per_thread_run:.1} GFLOP/s{}); a kernel's peak, optimistic for a whole micro-batch{}; emulated hosts share these {cores} cores",
            p.device_gflops,
            if (devices * threads) > *cores {
                format!(", × {cores}/{} as the devices outnumber the cores", devices * threads)
            } else {
                String::new()
            },
            match instead_of_micro_batch {
                Some(why) => format!(" (not a measured micro-batch: {why})"),
                None => String::new(),
            }
        ),
        Throughput::MicroBatch {
            cores,
            devices,
            share,
            run,
        } => println!(
            "  device throughput    {:.1} GFLOP/s measured here from a micro-batch (forward + backward of this model, {} tokens per device on {} thread(s), the budget of one of {devices} devices sharing this machine's {cores} cores, {} device(s) side by side: median of {} after {} warm-up, {:.1} ms = {:.1} GFLOP/s{}); emulated hosts share these {cores} cores",
            p.device_gflops,
            run.tokens,
            run.threads,
            run.concurrent,
            run.timed,
            run.warmup,
            run.seconds * 1e3,
            run.gflops,
            if *share < 1.0 {
                format!(", × {share:.3} as only {} of the {devices} devices run at once", run.concurrent)
            } else {
                String::new()
            }
        ),
    }
    println!(
        "  compute              {:.3} MFLOP/token × {} tokens per device per micro-batch = {:.3} ms per micro-batch",
        p.flops_per_token / 1e6,
        p.tokens_per_device_per_micro_batch,
        p.compute_ms_per_micro_batch
    );
    println!(
        "  overlap_grad_reduce  {}{}",
        p.overlap_grad_reduce,
        if p.overlap_grad_reduce {
            " (gradient reductions hide behind 2/3 of a micro-batch's compute)"
        } else {
            ""
        }
    );
    for (title, rows) in [
        (
            format!("deferred ({})", p.deferred.deferral),
            &p.collectives,
        ),
        (
            format!("per micro-batch ({})", p.per_micro_batch.deferral),
            &p.per_micro_batch_collectives,
        ),
    ] {
        println!("\ncollectives of one device, {title}:");
        println!(
            "{:<14} {:<14} {:<12} {:>5} {:>9} {:>6} {:>10} {:>10} {:>10}",
            "phase",
            "collective",
            "axes",
            "group",
            "hosts×dev",
            "count",
            "bytes",
            "intra ms",
            "link ms"
        );
        for r in rows.iter() {
            println!(
                "{:<14} {:<14} {:<12} {:>5} {:>9} {:>6} {:>10} {:>10.3} {:>10.3}{}",
                r.phase,
                r.kind,
                r.axes.join(","),
                r.span.members,
                format!("{}×{}", r.span.hosts, r.span.per_host),
                r.count,
                human_bytes(r.bytes),
                r.intra_ms,
                r.link_ms,
                if r.in_step {
                    ""
                } else {
                    "  (outside the step)"
                }
            );
        }
    }
    let (d, m) = (&p.deferred, &p.per_micro_batch);
    println!(
        "\nstep (GA {}, ms)               {:>12} {:>16}",
        p.gradient_accumulation_steps, "deferred", "per-micro-batch"
    );
    for (what, a, b) in [
        ("compute", d.compute_ms, m.compute_ms),
        (
            "micro-batch collectives",
            d.micro_batch_collectives_ms,
            m.micro_batch_collectives_ms,
        ),
        (
            "gradient reduction",
            d.gradient_reduction_ms,
            m.gradient_reduction_ms,
        ),
        (
            "  of it exposed",
            d.exposed_reduction_ms,
            m.exposed_reduction_ms,
        ),
        (
            "update's other collectives",
            d.update_other_collectives_ms,
            m.update_other_collectives_ms,
        ),
        ("optimizer", d.optimizer_ms, m.optimizer_ms),
        ("step", d.step_ms, m.step_ms),
    ] {
        println!("  {what:<28} {a:>12.3} {b:>16.3}");
    }
    println!(
        "  ratio deferred / per-micro-batch = {:.3} (speedup {:.3}x)",
        p.ratio, p.speedup
    );
    let mem = &p.memory;
    let mib = |b: f64| b / f64::from(1u32 << 20);
    println!(
        "\npeak memory per device: {:.1} MiB = parameters {:.1} + accumulator {:.1} + gradients {:.1} + optimizer state {:.1} + activations of one micro-batch {:.1}",
        mib(mem.total_bytes),
        mib(mem.parameter_bytes),
        mib(mem.accumulator_bytes),
        mib(mem.gradient_bytes),
        mib(mem.optimizer_bytes),
        mib(mem.activation_bytes)
    );
}

/// This process's peak resident memory so far (Linux `VmHWM`), in MB.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// The config of one process of the job: the user's, with `num_processes` from the launcher.
fn load_for(args: &TrainArgs, launch: &Launch) -> Result<RunPlan> {
    let processes = launch.processes();
    if processes == 1 {
        return load(args);
    }
    let given = args
        .args
        .iter()
        .filter_map(|a| a.strip_prefix("num_processes="))
        .next_back();
    if let Some(given) = given.filter(|g| g.trim() != processes.to_string()) {
        return Err(UsageError(format!(
            "num_processes={given} but the launcher started {processes} processes"
        ))
        .into());
    }
    let mut with_processes = TrainArgs {
        args: args.args.clone(),
    };
    with_processes
        .args
        .push(format!("num_processes={processes}"));
    load(&with_processes)
}

/// Runs the command (under MPI: this process's share; process 0 prints and writes).
pub fn run(args: &TrainArgs, launch: &Launch) -> Result<()> {
    let plan = load_for(args, launch)?;
    let config = plan.config();
    let leader = launch.is_leader();
    let model = plan.decoder().config();
    let fault = injected_fault()?;
    // Before the header names the kernel, and before any product runs.
    ferrotext_train::select_matmul_kernel(config)?;
    let tokens_per_step =
        config.micro_batch_rows() * config.gradient_accumulation_steps * config.max_target_length;
    // Every output is checked before anything runs: a bad path is bad input, found now.
    io::check_output_paths(config)?;
    // Under `ferrotext emulate`: each process logs its link's counters at every step boundary.
    let wire = std::sync::Arc::new(crate::emulate::probe::WireProbe::from_env(launch));
    let probe = wire.clone();
    let probe_step = move |m: &StepMetrics| probe.iter().for_each(|w| w.record(m));
    if !leader {
        // Every process computes the same run; only process 0 reports it.
        let on_step: Option<ferrotext_train::StepCallback> = match wire.as_ref() {
            Some(_) => Some(std::sync::Arc::new(probe_step)),
            None => None,
        };
        let options = RunOptions {
            on_step,
            cluster: launch.cluster(),
            return_params: !config.save_parameters_path.is_empty(),
            fault,
            ..Default::default()
        };
        train_plan(&plan, &options)?;
        return Ok(());
    }
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
        tokens_per_step,
        config.steps
    );
    println!("outputs: {}", plan.output_dir().display());
    println!("matmul: {}", ferrotext_tensor::matmul_kernel());
    let bar = ProgressBar::new(config.steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} step  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()), // ok: the template is a constant
    );
    // Step lines are printed as the steps end (every tenth of the run, the last, and every
    // skipped step), above the progress bar.
    let steps = config.steps;
    let progress = bar.clone();
    let on_step = move |m: &StepMetrics| {
        probe_step(m);
        let bar = &progress;
        bar.set_position(m.step as u64 + 1);
        bar.set_message(format!(
            "loss {:.4}  {:.0} tok/s",
            m.loss,
            m.tokens as f64 / m.seconds
        ));
        if m.step.is_multiple_of((steps / 10).max(1))
            || m.step + 1 == steps
            || m.skipped
            || m.eval_loss.is_some()
        {
            let skipped = if m.skipped {
                "  skipped: not finite"
            } else {
                ""
            };
            let epoch = m.epoch.map_or(String::new(), |e| format!("  epoch {e}"));
            let eval = m.eval_loss.map_or(String::new(), |l| {
                format!("  eval_loss {l:.4} (ppl {:.2})", l.exp())
            });
            bar.suspend(|| {
                println!(
                    "step {:>4}  loss {:.4}  grad_norm {:.3}  lr {:.2e}  {:.0} ms{epoch}{eval}{skipped}",
                    m.step,
                    m.loss,
                    m.grad_norm,
                    m.learning_rate,
                    m.seconds * 1e3
                )
            });
        }
    };
    let metrics_path = plan.metrics_path().to_path_buf();
    let options = RunOptions {
        on_step: Some(std::sync::Arc::new(on_step)),
        return_params: !config.save_parameters_path.is_empty(),
        cluster: launch.cluster(),
        metrics_path: Some(metrics_path.clone()),
        fault,
        ..Default::default()
    };
    let started = Instant::now();
    let report = train_plan(&plan, &options)?;
    bar.finish_and_clear();
    let wall = started.elapsed().as_secs_f64();

    let m = &report.metrics;
    if m.is_empty() {
        println!(
            "nothing to do: run `{}` already finished its {} steps (checkpoints in {}); raise `steps` to train further, or set `resume=fresh` to start over",
            config.run_name,
            config.steps,
            plan.checkpoint_root().display()
        );
        // A job killed after its last checkpoint but before its outputs is restarted exactly
        // like this: it still owes them, from the final checkpoint it restored.
        return deliver_outputs(config, &report, &metrics_path, launch);
    }
    if report.first_step > 0 {
        println!(
            "resumed at step {} from {}",
            report.first_step,
            plan.checkpoint_root().display()
        );
    }
    let first = m.first().map_or(0.0, |x| x.loss);
    let last = m.last().map_or(0.0, |x| x.loss);
    let skipped = m.iter().filter(|x| x.skipped).count();
    // The first step pays for warm-up; leave it out when there are others.
    let warm_up = usize::from(m.len() > 1);
    let step_time = median(m.iter().skip(warm_up).map(|x| x.seconds).collect());
    let tok_s = tokens_per_step as f64 / step_time.max(1e-12);
    // The stated peak (from the CPU's description), so the figure does not move with how busy
    // the machine was at start-up; `bench kernels` measures the achieved gemm rate.
    let peak = ferrotext_tensor::cpu_peak();
    let mfu = report.flops_per_token * tok_s / peak.flops();
    println!("\nsummary");
    println!("  loss             {first:.4} -> {last:.4}");
    if let Some((step, eval)) = m
        .iter()
        .rev()
        .find_map(|x| x.eval_loss.map(|l| (x.step, l)))
    {
        println!(
            "  eval loss        {eval:.4} (perplexity {:.2}) after step {step}",
            eval.exp()
        );
    }
    if skipped > 0 {
        println!(
            "  skipped steps    {skipped} (loss or gradient not finite; nan_policy=skip_step)"
        );
    }
    println!("  parameters       {}", report.param_count);
    println!(
        "  median step      {:.1} ms  ({tok_s:.0} tokens/s; whole run {wall:.1} s)",
        step_time * 1e3
    );
    println!(
        "  model FLOPs util {:.1}% of the stated peak {peak}",
        mfu * 100.0
    );
    if let Some(mb) = peak_rss_mb() {
        println!("  peak RSS         {mb:.1} MB");
    }
    println!("  deferral         {}", report.gate.describe());
    println!("  overlap          {}", plan.overlap().describe());
    println!("  ZeRO-1           {}", report.zero1.describe());
    let grad_bytes: usize = report
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>() * 4)
        .sum();
    let saved = if report.gate.is_open() {
        (config.gradient_accumulation_steps - 1) * grad_bytes * config.steps
    } else {
        0
    };
    let mb = PhasePattern::new("micro_batch*");
    println!(
        "  all-reduce bytes micro-batches {}, update {}; deferral saved {}",
        human_bytes(report.trace.bytes(CollectiveKind::AllReduce, &mb)),
        human_bytes(
            report
                .trace
                .bytes(CollectiveKind::AllReduce, &PhasePattern::new("update"))
        ),
        human_bytes(saved)
    );
    println!(
        "\ncollectives of device 0 (all steps):\n{}",
        report.trace.summary_table()
    );

    if config.profile {
        report_profile(&metrics_path, launch.process(), step_time)?;
    }
    deliver_outputs(config, &report, &metrics_path, launch)
}

/// The run's declared outputs, from the parameters it ended with (trained now, or restored from
/// the final checkpoint of a run that had finished): the metrics path, the parameters file when
/// `save_parameters_path` asks for one, and the loss curve.
fn deliver_outputs(
    config: &TrainConfig,
    report: &TrainReport,
    metrics_path: &Path,
    launch: &Launch,
) -> Result<()> {
    println!("metrics: {}", metrics_path.display());
    if let Some(values) = &report.values {
        let path = PathBuf::from(&config.save_parameters_path);
        io::save_final_parameters(config, &report.params, values)?;
        println!("parameters: {}", path.display());
    }
    // Process 0 wrote the metrics; the chart is a convenience, so failing to draw it only warns; it comes
    // last, so a failure before it is the run's one error line.
    if let (0, Some(run_dir)) = (launch.process(), metrics_path.parent()) {
        match crate::plot::plot_run(run_dir) {
            Ok(chart) => println!("loss curve: {}", chart.display()),
            Err(err) => eprintln!("warning: no loss curve: {err:#}"),
        }
    }
    Ok(())
}

/// Prints the profile of this process's devices, beside the loop's median step time, and writes
/// the table (`profile.txt`) and a Chrome trace (`profile-trace.json`, or
/// `profile-trace.p{N}.json` for process N > 0) into the run directory.
fn report_profile(metrics_path: &Path, process: usize, step_seconds: f64) -> Result<()> {
    let events = ferrotext_profile::take_collected();
    let table = ferrotext_profile::Report::from_events(&events);
    let text = format!(
        "{table}  the loop measured a median step of {:.1} ms (the table's steps are the profiled ones)\n",
        step_seconds * 1e3
    );
    println!("\n{text}");
    let dir = metrics_path.parent().unwrap_or(Path::new("."));
    let trace_name = if process == 0 {
        "profile-trace.json".to_string()
    } else {
        format!("profile-trace.p{process}.json")
    };
    let trace = ferrotext_profile::chrome_trace(&events, process);
    std::fs::write(dir.join(&trace_name), serde_json::to_vec(&trace)?)
        .with_context(|| format!("writing {}", dir.join(&trace_name).display()))?;
    if process == 0 {
        std::fs::write(dir.join("profile.txt"), &text)
            .with_context(|| format!("writing {}", dir.join("profile.txt").display()))?;
    }
    println!(
        "profile trace: {} (open in Perfetto or chrome://tracing)",
        dir.join(&trace_name).display()
    );
    Ok(())
}
