//! The end of a `train` run on process 0: the summary (losses, speed, reductions, the collective
//! table), the profile when one was recorded, and the run's declared outputs.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ferrotext_comm::{human_bytes, CollectiveKind, PhasePattern};
use ferrotext_train::{io, CpuTime, RunPlan, StepMetrics, TrainConfig, TrainReport};

use super::tokens_per_step;
use crate::common::stats::median;
use crate::launch::Launch;

/// The line of a run that had no step left to train.
pub(super) fn print_nothing_to_do(plan: &RunPlan) {
    let config = plan.config();
    println!(
        "nothing to do: run `{}` already finished its {} steps (checkpoints in {}); raise `steps` to train further, or set `resume=fresh` to start over",
        config.run_name,
        config.steps,
        plan.checkpoint_root().display()
    );
}

/// Prints the summary of a run that trained at least one step (`report.metrics` not empty) and
/// took `wall` seconds; returns the median step time in seconds.
pub(super) fn print_summary(plan: &RunPlan, report: &TrainReport, wall: f64) -> f64 {
    if report.first_step > 0 {
        println!(
            "resumed at step {} from {}",
            report.first_step,
            plan.checkpoint_root().display()
        );
    }
    let step_seconds = median_step_seconds(&report.metrics);
    println!("\nsummary");
    print_losses(&report.metrics);
    println!("  parameters       {}", report.param_count);
    print_speed(plan.config(), report, step_seconds, wall);
    print_reductions(plan, report);
    println!(
        "\ncollectives of device 0 (all steps):\n{}",
        report.trace.summary_table()
    );
    step_seconds
}

/// The median step time in seconds; the first step pays for warm-up, so it is left out when
/// there are others.
fn median_step_seconds(m: &[StepMetrics]) -> f64 {
    let warm_up = usize::from(m.len() > 1);
    median(m.iter().skip(warm_up).map(|x| x.seconds).collect())
}

/// The process's mean CPU time a step (user and system), leaving out the warm-up step as the
/// median step time does; `None` when the steps carry none.
fn mean_step_cpu(m: &[StepMetrics]) -> Option<CpuTime> {
    let warm_up = usize::from(m.len() > 1);
    let steps: Vec<CpuTime> = m.iter().skip(warm_up).filter_map(|x| x.cpu).collect();
    let n = steps.len() as f64;
    (!steps.is_empty()).then(|| CpuTime {
        user: steps.iter().map(|c| c.user).sum::<f64>() / n,
        system: steps.iter().map(|c| c.system).sum::<f64>() / n,
    })
}

/// The first and last loss, the last evaluation, and the skipped steps.
fn print_losses(m: &[StepMetrics]) {
    let first = m.first().map_or(0.0, |x| x.loss);
    let last = m.last().map_or(0.0, |x| x.loss);
    let skipped = m.iter().filter(|x| x.skipped).count();
    println!("  loss             {first:.4} -> {last:.4}");
    if let Some((step, eval)) = m
        .iter()
        .rev()
        .find_map(|x| x.eval_loss.map(|l| (x.step, l)))
    {
        println!(
            "  eval loss        {eval:.4} (perplexity {:.2}) after step {step}",
            ferrotext_tensor::fixed_math::exp_f64(eval)
        );
    }
    if skipped > 0 {
        println!(
            "  skipped steps    {skipped} (loss or gradient not finite; nan_policy=skip_step)"
        );
    }
}

/// The median step, tokens per second, the model FLOPs utilisation and the peak memory.
fn print_speed(config: &TrainConfig, report: &TrainReport, step_seconds: f64, wall: f64) {
    let tok_s = tokens_per_step(config) as f64 / step_seconds.max(1e-12);
    // The probed peak (this processor's FMA throughput, measured once per process in short
    // windows whose best counts, so it does not move with how busy the machine is), against
    // the products' dtype: a bf16 run's products may run at twice the f32 rate (AVX512_BF16).
    let peak = ferrotext_tensor::cpu_peak();
    let bf16 = ferrotext_cost::products_in_bf16(config);
    let achieved = report.flops_per_token * tok_s;
    println!(
        "  median step      {:.1} ms  ({tok_s:.0} tokens/s; whole run {wall:.1} s)",
        step_seconds * 1e3
    );
    println!(
        "  model FLOPs util {:.1}% = {:.1} GFLOP/s achieved (model FLOPs × tokens/s) ÷ the peak {}",
        achieved / peak.flops_for(bf16) * 100.0,
        achieved / 1e9,
        peak.describe_for(bf16)
    );
    // The same rate against what this process's product kernel reaches here: the step's gap
    // alone, without the kernel's own gap to the instructions.
    if let Some(products) = ferrotext_tensor::product_peak(bf16, peak.cores) {
        println!(
            "  of products      {:.1}% of {}",
            achieved / products.flops * 100.0,
            products.describe(bf16)
        );
    }
    if let Some(cpu) = mean_step_cpu(&report.metrics) {
        println!(
            "  CPU a step       {:.2} s user, {:.2} s system ({:.1}% in the kernel)",
            cpu.user,
            cpu.system,
            cpu.system_fraction() * 100.0
        );
    }
    if let Some(mb) = peak_rss_mb() {
        println!("  peak RSS         {mb:.1} MB");
    }
}

/// How the gradients were reduced: the deferral gate, overlap, ZeRO-1, and the all-reduced
/// bytes against what deferring saved.
fn print_reductions(plan: &RunPlan, report: &TrainReport) {
    let config = plan.config();
    println!("  deferral         {}", report.gate.describe());
    println!("  overlap          {}", plan.overlap().describe());
    println!("  ZeRO-1           {}", report.zero1.describe());
    let grad_elements: usize = report
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    // Deferred: one reduction a step in `grad_dtype` where each micro-batch would all-reduce
    // its f32 gradients.
    let deferred_bytes = plan.precision().grad_dtype.size_bytes();
    let steps = report.metrics.len();
    let saved = if report.gate.is_open() {
        (config.gradient_accumulation_steps * 4).saturating_sub(deferred_bytes)
            * grad_elements
            * steps
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
}

/// One device's roofline: the machine's probed peaks and memory bandwidth times the device's
/// share of the cores (its `cores / local_devices` kernel threads, or a `1 / local_devices`
/// share of them when the devices outnumber the cores).
fn device_roofline(config: &TrainConfig) -> ferrotext_profile::Roofline {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let devices = config.local_devices.max(1);
    let threads = (cores / devices).max(1);
    let share = (threads * devices).min(cores) as f64 / (cores * devices) as f64;
    let peak = ferrotext_tensor::cpu_peak();
    ferrotext_profile::Roofline {
        flops: peak.flops() * share,
        bf16_flops: peak.bf16_flops() * share,
        bytes_per_second: ferrotext_tensor::memory_bandwidth(cores) * share,
    }
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

/// The run's declared outputs, from the parameters it ended with (trained now, or restored from
/// the final checkpoint of a run that had finished): the metrics path, the parameters file when
/// `save_parameters_path` asks for one, and the loss curve.
pub(super) fn deliver_outputs(
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
/// `profile-trace.p{N}.json` for process N > 0) into the run directory. Each op is set against
/// one device's roofline ([`device_roofline`]).
pub(super) fn report_profile(
    config: &TrainConfig,
    metrics_path: &Path,
    process: usize,
    step_seconds: f64,
) -> Result<()> {
    let events = ferrotext_profile::take_collected();
    let table =
        ferrotext_profile::Report::from_events(&events).with_roofline(device_roofline(config));
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
