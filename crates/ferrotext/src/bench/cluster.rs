//! `ferrotext bench cluster`: step time and link bytes of deferred vs per-micro-batch gradient
//! reduction on emulated clusters (see `emulate`), over hosts × links × GA (× overlap), each cell
//! as ABBA-paired jobs; JSON to `target/bench/cluster.json` and a plot (SVG, `plotters`).
//!
//! Each job is a separate `mpirun` of `ferrotext train` on the same emulated network (one network
//! per hosts × link); per-micro-batch is `shard_mode=auto`, which closes the deferral gate so the
//! gradients are all-reduced in every micro-batch (with `overlap_grad_reduce=true`, bucket by
//! bucket during each micro-batch's backward, as PyTorch DDP does). Step times are the medians of
//! each job's steps after the first; the speedup of a pair is per-micro-batch ms / deferred ms,
//! and a cell's is the median over its pairs.
//!
//! Each network is also calibrated on itself, since its hosts share this machine's cores: `a`,
//! one all-reduce of the model's gradient bytes, is measured by a `bench collectives` job on the
//! network, and `c`, the compute of a micro-batch, is the slope of the deferred steps without
//! overlap against GA (least squares; needs two GA values), whose intercept is `o + a` (`o`: the
//! optimizer and everything else paid once a step). Each cell without overlap then carries the
//! speedup `(N·(c + a) + o) / (N·c + a + o)` predicts (`(c + a) / (c + a/N)` for `o` = 0), and
//! every cell the cost model's step fed with that `c` next to its step from the throughput
//! measured outside the emulation. The fitted prediction also takes the network's latency as
//! measured: a [`LATENCY_PROBE_BYTES`] all-reduce's time over its `2(n−1)` ring steps, which
//! the per-micro-batch mode pays for each of its per-parameter all-reduces (software and
//! scheduling on the shared cores cost far more than a wire's delay here).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotext_comm::human_bytes;
use serde::Serialize;

use super::{abba_pair, cores, median, write_json, Side};
use crate::emulate::{self, net::Network, JobRun, Plan};
use crate::plot::{line_chart, Series};

/// Arguments of `ferrotext bench cluster`.
#[derive(Args)]
pub struct ClusterArgs {
    /// Model preset.
    #[arg(long, default_value = "qwen3-peer")]
    model: String,
    /// Steps per job (the first is left out of the step time; link bytes are per-step
    /// differences, so at least 2).
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// ABBA pairs per cell.
    #[arg(long, default_value_t = 2)]
    pairs: usize,
    /// Emulated host counts.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    hosts: Vec<usize>,
    /// Devices per host.
    #[arg(long, default_value_t = 1)]
    devices_per_host: usize,
    /// Links (RATE[,DELAY]; a list separated by `;` or given several times).
    #[arg(long, value_delimiter = ';', default_value = "1gbit;10gbit")]
    links: Vec<String>,
    /// GA values.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    ga: Vec<usize>,
    /// `overlap_grad_reduce` values to pass to the job (none: the key is not passed).
    #[arg(long, value_delimiter = ',')]
    overlap: Vec<bool>,
    /// Extra `key=value` train overrides.
    #[arg(long = "set")]
    set: Vec<String>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "target/bench/cluster.json")]
    out: PathBuf,
    /// Where to write the plot.
    #[arg(long, default_value = "target/bench/cluster.svg")]
    svg: PathBuf,
}

impl ClusterArgs {
    /// The extra `key=value` overrides every job gets.
    pub fn set(&self) -> &[String] {
        &self.set
    }

    /// Steps per job.
    pub fn steps(&self) -> usize {
        self.steps
    }
}

/// The two ways to reduce the gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// All-reduced in every micro-batch (`shard_mode=auto`).
    PerMicroBatch,
    /// Partial sums kept, reduced once per step.
    Deferred,
}

/// One cell of the grid, as a prediction function sees it.
#[derive(Clone, Debug, Serialize)]
pub struct CellSpec {
    /// Model preset.
    pub model: String,
    /// Emulated hosts.
    pub hosts: usize,
    /// Devices per host.
    pub devices_per_host: usize,
    /// Link spec as given.
    pub link: String,
    /// Link rate, bits per second.
    pub link_bps: u64,
    /// Link one-way delay, seconds.
    pub link_delay_s: f64,
    /// Gradient accumulation steps.
    pub ga: usize,
    /// `overlap_grad_reduce`, when passed.
    pub overlap: Option<bool>,
}

/// A step-time prediction (ms) for a cell and mode, given the compute of one micro-batch fit on
/// the emulated setup (ms; `None`: the predictor measures the throughput itself); `None` when it
/// has none. The cost model plugs in here.
pub type Predictor<'a> = &'a dyn Fn(&CellSpec, Mode, Option<f64>) -> Option<f64>;

/// Predicted step times of a cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PredictedMs {
    /// Per-micro-batch mode.
    pub per_micro_batch: Option<f64>,
    /// Deferred mode.
    pub deferred: Option<f64>,
}

/// One mode's measurements in a cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ModeResult {
    /// Median over its jobs of each job's median step time.
    pub median_step_ms: f64,
    /// Every job's median step time, in run order.
    pub job_step_ms: Vec<f64>,
    /// Median over jobs of the bytes one host sent on its link per step.
    pub wire_bytes_per_step: f64,
    /// Median over jobs of the MPI payload one host sent per step.
    pub mpi_bytes_per_step: f64,
    /// The first job's losses (to check both modes compute the same).
    pub losses: Vec<f64>,
}

/// One cell's result.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// What ran.
    #[serde(flatten)]
    pub spec: CellSpec,
    /// Per-micro-batch reduction.
    pub per_micro_batch: ModeResult,
    /// Deferred reduction.
    pub deferred: ModeResult,
    /// Median over pairs of per-micro-batch ms / deferred ms.
    pub paired_speedup: f64,
    /// Deferred wire bytes / per-micro-batch wire bytes.
    pub wire_ratio: f64,
    /// From the prediction function, when one was given.
    pub predicted_step_ms: PredictedMs,
    /// From the prediction function fed the network's fitted `c` (see the module docs).
    pub predicted_with_fitted_compute_ms: PredictedMs,
    /// `(N·(c + a) + o) / (N·c + a + o)` from the network's fit (`(c + a) / (c + a/N)` when
    /// `o` is 0), for cells without overlap.
    pub formula_speedup: Option<f64>,
}

/// One network's calibration on itself (see the module docs).
#[derive(Clone, Debug, Serialize)]
pub struct NetworkFit {
    /// Emulated hosts.
    pub hosts: usize,
    /// Link spec as given.
    pub link: String,
    /// The model's gradient bytes (f32).
    pub gradient_bytes: usize,
    /// `a`: one all-reduce of `gradient_bytes` on the network (median of a `bench collectives`
    /// job), ms.
    pub all_reduce_ms: f64,
    /// One all-reduce of [`LATENCY_PROBE_BYTES`] on the network, ms: what a collective costs
    /// besides its bytes here (software and scheduling on shared cores, plus any link delay).
    pub small_all_reduce_ms: f64,
    /// The link latency `α` that makes the cost model's all-reduce of [`LATENCY_PROBE_BYTES`]
    /// take `small_all_reduce_ms` (`2(n−1)` latencies a ring), µs; the fitted predictions use
    /// it in place of the link's delay when it is larger.
    pub fitted_latency_us: f64,
    /// `c`: slope of the deferred steps without overlap against GA, ms per micro-batch.
    pub compute_ms: Option<f64>,
    /// The same fit's intercept: the per-step cost (`o + a`), ms.
    pub intercept_ms: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    steps: usize,
    pairs: usize,
    cores: usize,
    networks: Vec<NetworkFit>,
    cells: Vec<Cell>,
}

fn job_args(spec: &CellSpec, mode: Mode, steps: usize, set: &[String], dir: &Path) -> Vec<String> {
    let mut args = vec![
        "train".to_string(),
        format!("model_name={}", spec.model),
        format!("gradient_accumulation_steps={}", spec.ga),
        format!("steps={steps}"),
        format!("base_output_directory={}", dir.display()),
        format!(
            "run_name=h{}_ga{}_{}",
            spec.hosts,
            spec.ga,
            match mode {
                Mode::PerMicroBatch => "pmb",
                Mode::Deferred => "def",
            }
        ),
    ];
    if mode == Mode::PerMicroBatch {
        args.push("shard_mode=auto".into());
    }
    if let Some(o) = spec.overlap {
        args.push(format!("overlap_grad_reduce={o}"));
    }
    args.extend(set.iter().cloned());
    args
}

fn summarize(runs: &[JobRun]) -> ModeResult {
    let ms: Vec<f64> = runs.iter().map(JobRun::median_step_ms).collect();
    ModeResult {
        median_step_ms: median(ms.clone()),
        job_step_ms: ms,
        wire_bytes_per_step: median(runs.iter().map(JobRun::wire_bytes_per_step).collect()),
        mpi_bytes_per_step: median(runs.iter().map(JobRun::mpi_bytes_per_step).collect()),
        losses: runs.first().map(|r| r.losses.clone()).unwrap_or_default(),
    }
}

/// Runs the grid (see the module docs); `predict` fills `predicted_step_ms` when given.
///
/// # Errors
/// Bad input (checked for every cell before anything runs), a missing tool or privilege, a
/// failed set-up or job, an interruption; every network is removed.
pub fn run(args: &ClusterArgs, predict: Option<Predictor<'_>>) -> Result<()> {
    let stop = emulate::install_signal_flag()?;
    if args.steps < 2 {
        return Err(crate::UsageError("--steps must be at least 2".into()).into());
    }
    if args.pairs == 0 || args.hosts.is_empty() || args.links.is_empty() || args.ga.is_empty() {
        return Err(crate::UsageError(
            "--pairs, --hosts, --links and --ga must be non-empty".into(),
        )
        .into());
    }
    let overlaps: Vec<Option<bool>> = if args.overlap.is_empty() {
        vec![None]
    } else {
        args.overlap.iter().map(|&o| Some(o)).collect()
    };
    // Every cell's input is checked before any network exists.
    let scratch =
        std::env::temp_dir().join(format!("ferrotext-bench-cluster-{}", std::process::id()));
    let mut grid = Vec::new();
    for &hosts in &args.hosts {
        for link in &args.links {
            let spec_link = emulate::net::LinkSpec::parse(link)?;
            for &ga in &args.ga {
                for &overlap in &overlaps {
                    let spec = CellSpec {
                        model: args.model.clone(),
                        hosts,
                        devices_per_host: args.devices_per_host,
                        link: link.clone(),
                        link_bps: spec_link.rate_bps,
                        link_delay_s: spec_link.delay.map_or(0.0, |d| d.as_secs_f64()),
                        ga,
                        overlap,
                    };
                    for mode in [Mode::PerMicroBatch, Mode::Deferred] {
                        let job = job_args(&spec, mode, args.steps, &args.set, &scratch);
                        Plan::new(hosts, args.devices_per_host, link, &job)?;
                    }
                    grid.push(spec);
                }
            }
        }
    }
    emulate::preflight()?;
    emulate::net::remove_leftovers();

    let mut cells = Vec::new();
    let mut networks = Vec::new();
    let gradient_bytes = gradient_bytes(&args.model, &args.set)?;
    for &hosts in &args.hosts {
        for link in &args.links {
            let spec_link = emulate::net::LinkSpec::parse(link)?;
            let network = Network::create(hosts, &spec_link)?;
            println!("{hosts} hosts, link {link}, subnet {}", network.cidr());
            let all_reduce_ms = measure_all_reduce_ms(
                &network,
                args.devices_per_host,
                gradient_bytes,
                &scratch,
                &stop,
            )?;
            let small_all_reduce_ms = measure_all_reduce_ms(
                &network,
                args.devices_per_host,
                LATENCY_PROBE_BYTES,
                &scratch,
                &stop,
            )?;
            let latency_s = fitted_latency_s(
                small_all_reduce_ms,
                hosts * args.devices_per_host,
                spec_link.rate_bps,
            );
            println!(
                "  a = {all_reduce_ms:.1} ms: one all-reduce of the {} of gradients; one of {} \
                 takes {small_all_reduce_ms:.2} ms, a latency of {:.0} µs a ring step",
                human_bytes(gradient_bytes),
                human_bytes(LATENCY_PROBE_BYTES),
                latency_s * 1e6
            );
            let first = cells.len();
            for spec in grid.iter().filter(|s| s.hosts == hosts && &s.link == link) {
                let cell = run_cell(&network, spec, args, &scratch, &stop, predict)?;
                println!(
                    "  GA {:>2}{}: per-micro-batch {:>8.1} ms {:>10}/step, deferred {:>8.1} ms \
                     {:>10}/step, speedup {:.3}",
                    spec.ga,
                    spec.overlap
                        .map_or(String::new(), |o| format!(" overlap={o}")),
                    cell.per_micro_batch.median_step_ms,
                    human_bytes(cell.per_micro_batch.wire_bytes_per_step as usize),
                    cell.deferred.median_step_ms,
                    human_bytes(cell.deferred.wire_bytes_per_step as usize),
                    cell.paired_speedup
                );
                cells.push(cell);
            }
            drop(network);
            let fit = calibrate(
                NetworkFit {
                    hosts,
                    link: link.clone(),
                    gradient_bytes,
                    all_reduce_ms,
                    small_all_reduce_ms,
                    fitted_latency_us: latency_s * 1e6,
                    compute_ms: None,
                    intercept_ms: None,
                },
                &mut cells[first..],
                predict,
            );
            if let (Some(c), Some(i)) = (fit.compute_ms, fit.intercept_ms) {
                println!("  fit: c = {c:.1} ms per micro-batch, o + a = {i:.1} ms per step");
                for cell in &cells[first..] {
                    print_fitted(cell);
                }
            }
            networks.push(fit);
            // Written after every network, so an interrupted grid keeps what it measured.
            write_json(
                &args.out,
                &Report {
                    benchmark: "cluster",
                    steps: args.steps,
                    pairs: args.pairs,
                    cores: cores(),
                    networks: networks.clone(),
                    cells: cells.clone(),
                },
            )?;
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let report = Report {
        benchmark: "cluster",
        steps: args.steps,
        pairs: args.pairs,
        cores: cores(),
        networks,
        cells,
    };
    write_json(&args.out, &report)?;
    if let Some(dir) = args.svg.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    plot(&report.cells, &args.svg)?;
    println!("wrote {} and {}", args.out.display(), args.svg.display());
    Ok(())
}

fn run_cell(
    network: &Network,
    spec: &CellSpec,
    args: &ClusterArgs,
    scratch: &Path,
    stop: &std::sync::atomic::AtomicBool,
    predict: Option<Predictor<'_>>,
) -> Result<Cell> {
    let mut per_mb = Vec::new();
    let mut deferred = Vec::new();
    let mut speedups = Vec::new();
    for pair in 0..args.pairs {
        // A: per-micro-batch, B: deferred.
        let (pmb, def) = abba_pair(pair, |side| {
            let mode = match side {
                Side::A => Mode::PerMicroBatch,
                Side::B => Mode::Deferred,
            };
            let job = job_args(spec, mode, args.steps, &args.set, scratch);
            let mut job = Plan::new(spec.hosts, spec.devices_per_host, &spec.link, &job)?.job;
            job.push("resume=fresh".into());
            let run = run_job(network, spec.devices_per_host, &job, stop)?;
            if run.exit_code != Some(0) {
                bail!(
                    "a job of cell hosts={} link={} GA {} ({mode:?}) failed (exit {:?})",
                    spec.hosts,
                    spec.link,
                    spec.ga,
                    run.exit_code
                );
            }
            Ok(run)
        })?;
        speedups.push(pmb.median_step_ms() / def.median_step_ms().max(1e-9));
        per_mb.push(pmb);
        deferred.push(def);
    }
    let (per_micro_batch, deferred) = (summarize(&per_mb), summarize(&deferred));
    let wire_ratio = deferred.wire_bytes_per_step / per_micro_batch.wire_bytes_per_step.max(1.0);
    Ok(Cell {
        spec: spec.clone(),
        paired_speedup: median(speedups),
        wire_ratio,
        per_micro_batch,
        deferred,
        predicted_step_ms: PredictedMs {
            per_micro_batch: predict.and_then(|p| p(spec, Mode::PerMicroBatch, None)),
            deferred: predict.and_then(|p| p(spec, Mode::Deferred, None)),
        },
        predicted_with_fitted_compute_ms: PredictedMs::default(),
        formula_speedup: None,
    })
}

/// How long one job of the grid may take before it is taken for a lost launch: the slowest
/// (4 hosts at 1 Gbit/s, GA 8, 5 steps) takes under a minute.
const JOB_LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// How many times a job is launched when Open MPI keeps losing a daemon and the job hangs.
const JOB_ATTEMPTS: usize = 3;

/// [`emulate::run_job`] quietly, started again when a host's process never started (a launch
/// whose daemon Open MPI lost) or it runs past [`JOB_LIMIT`], at most [`JOB_ATTEMPTS`] times.
fn run_job(
    network: &Network,
    devices_per_host: usize,
    job: &[String],
    stop: &std::sync::atomic::AtomicBool,
) -> Result<JobRun> {
    for attempt in 1..=JOB_ATTEMPTS {
        let run = emulate::run_job(network, devices_per_host, job, stop, true, Some(JOB_LIMIT))?;
        let why = if !run.never_started.is_empty() {
            format!(
                "never started on host(s) {:?} within {} s",
                run.never_started,
                emulate::LAUNCH_DEADLINE.as_secs()
            )
        } else if run.timed_out {
            format!("ran past {} s", JOB_LIMIT.as_secs())
        } else {
            return Ok(run);
        };
        eprintln!(
            "warning: a job {why} and was stopped (attempt {attempt} of {JOB_ATTEMPTS}): {}",
            job.join(" ")
        );
    }
    bail!(
        "a job was stopped {JOB_ATTEMPTS} times (lost launches or past {} s): {}",
        JOB_LIMIT.as_secs(),
        job.join(" ")
    )
}

/// The gradient bytes (f32) of `model` under the `set` overrides.
fn gradient_bytes(model: &str, set: &[String]) -> Result<usize> {
    let mut items = vec![format!("model_name={model}")];
    items.extend(set.iter().cloned());
    let plan = ferrotext_train::TrainConfig::load(None, &items)?.plan()?;
    Ok(plan
        .params()
        .iter()
        .map(|p| p.shape.iter().product::<usize>() * 4)
        .sum())
}

/// The all-reduce whose time calibrates the network's per-collective latency: small enough
/// that its bytes cost nothing on any link of the grid (4 KiB is 33 µs at 1 Gbit/s).
pub const LATENCY_PROBE_BYTES: usize = 4096;

/// `α` (seconds) from a small all-reduce's time on `ranks` ranks: a ring all-reduce pays
/// `2(ranks − 1)` latencies, and its bytes at the link rate are taken off first.
fn fitted_latency_s(small_all_reduce_ms: f64, ranks: usize, link_bps: u64) -> f64 {
    let steps = 2.0 * (ranks.max(2) - 1) as f64;
    let wire = 2.0 * (ranks.max(2) - 1) as f64 / ranks.max(2) as f64
        * (LATENCY_PROBE_BYTES * 8) as f64
        / link_bps.max(1) as f64;
    ((small_all_reduce_ms * 1e-3 - wire) / steps).max(0.0)
}

/// `a`: the median all-reduce time (ms) of `bytes` on `network`, from a `bench collectives` job.
fn measure_all_reduce_ms(
    network: &Network,
    devices_per_host: usize,
    bytes: usize,
    scratch: &Path,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<f64> {
    std::fs::create_dir_all(scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let out = scratch.join(format!("all-reduce-{}-{bytes}.json", network.hosts()));
    let bytes = (bytes / 4).max(1) * 4;
    let job: Vec<String> = [
        "bench",
        "collectives",
        "--backend",
        "mpi",
        "--local-devices",
        &devices_per_host.to_string(),
        "--min-bytes",
        &bytes.to_string(),
        "--max-bytes",
        &bytes.to_string(),
        "--out",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let run = run_job(network, devices_per_host, &job, stop)?;
    if run.exit_code != Some(0) {
        bail!("the all-reduce job failed (exit {:?})", run.exit_code);
    }
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    let report: serde_json::Value = serde_json::from_str(&text)?;
    report["rows"][0]["all_reduce_median_s"]
        .as_f64()
        .map(|s| s * 1e3)
        .with_context(|| format!("no all-reduce time in {}", out.display()))
}

/// Least squares `y = intercept + slope · x`; `None` with fewer than two distinct `x`.
fn line_fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|&(x, _)| (x - mx) * (x - mx)).sum();
    if points.len() < 2 || sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|&(x, y)| (x - mx) * (y - my)).sum();
    let slope = sxy / sxx;
    Some((my - slope * mx, slope))
}

/// Fits `c` on one network's cells (see the module docs) and fills each cell's formula speedup
/// and its prediction with that `c` and the network's fitted latency; returns `network` with
/// the fit.
fn calibrate(
    network: NetworkFit,
    cells: &mut [Cell],
    predict: Option<Predictor<'_>>,
) -> NetworkFit {
    let a = network.all_reduce_ms;
    let points: Vec<(f64, f64)> = cells
        .iter()
        .filter(|c| c.spec.overlap != Some(true))
        .map(|c| (c.spec.ga as f64, c.deferred.median_step_ms))
        .collect();
    let fit = line_fit(&points);
    if let Some((intercept, c)) = fit.filter(|&(_, c)| c > 0.0) {
        // `o`: what a step costs besides its micro-batches and the one reduction.
        let o = (intercept - a).max(0.0);
        for cell in cells.iter_mut() {
            let n = cell.spec.ga as f64;
            if cell.spec.overlap != Some(true) {
                cell.formula_speedup = Some((n * (c + a) + o) / (n * c + a + o));
            }
            // The network's measured per-collective latency, where it exceeds the link's delay.
            let mut spec = cell.spec.clone();
            spec.link_delay_s = spec.link_delay_s.max(network.fitted_latency_us * 1e-6);
            cell.predicted_with_fitted_compute_ms = PredictedMs {
                per_micro_batch: predict.and_then(|p| p(&spec, Mode::PerMicroBatch, Some(c))),
                deferred: predict.and_then(|p| p(&spec, Mode::Deferred, Some(c))),
            };
        }
    }
    NetworkFit {
        compute_ms: fit.map(|f| f.1),
        intercept_ms: fit.map(|f| f.0),
        ..network
    }
}

/// One line per cell: measured against the formula and the fitted cost model.
fn print_fitted(cell: &Cell) {
    let ratio = |measured: f64, predicted: Option<f64>| {
        predicted.map_or("-".to_string(), |p| format!("{:.2}", measured / p))
    };
    let p = &cell.predicted_with_fitted_compute_ms;
    println!(
        "  GA {:>2}{}: speedup {:.3} vs formula {}; measured / plan (fitted c): per-micro-batch \
         {}, deferred {}",
        cell.spec.ga,
        cell.spec
            .overlap
            .map_or(String::new(), |o| format!(" overlap={o}")),
        cell.paired_speedup,
        cell.formula_speedup
            .map_or("-".to_string(), |f| format!("{f:.3}")),
        ratio(cell.per_micro_batch.median_step_ms, p.per_micro_batch),
        ratio(cell.deferred.median_step_ms, p.deferred),
    );
}

/// Paired speedup against GA, one line per hosts × link (× overlap), and the break-even line.
fn plot(cells: &[Cell], path: &Path) -> Result<()> {
    let mut series: Vec<Series> = Vec::new();
    for c in cells {
        let name = format!(
            "{} hosts, {}{}",
            c.spec.hosts,
            c.spec.link,
            c.spec
                .overlap
                .map_or(String::new(), |o| format!(", overlap={o}"))
        );
        let point = (c.spec.ga as f64, c.paired_speedup);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                name,
                points: vec![point],
                dashed: false,
            }),
        }
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let max_ga = cells.iter().map(|c| c.spec.ga).max().unwrap_or(1) as f64;
    series.push(Series {
        name: "break-even".into(),
        points: vec![(0.0, 1.0), (max_ga + 1.0, 1.0)],
        dashed: true,
    });
    line_chart(
        path,
        "deferred vs per-micro-batch gradient reduction on emulated hosts",
        "gradient accumulation steps",
        "speedup (per-micro-batch ms / deferred ms)",
        &series,
    )
}

/// The cost model (`ferrotext_train::cost::predict`) as the grid's prediction function: the
/// cell's config on `hosts × devices_per_host` with its link, device throughput measured here
/// once per model and device count from forward + backward micro-batches of the cell's model,
/// with the thread budget one of the cell's devices gets when every emulated device shares this
/// machine's cores (the emulated hosts do) and as many devices side by side as fill them
/// (`cost::measure_micro_batch`; a gemm matmul when that would not fit in memory) — or, given the
/// compute of a micro-batch fit on the emulated setup, the throughput that takes that long.
/// `None` for a cell the model cannot price.
pub fn cost_model(
    set: &[String],
    steps: usize,
) -> impl Fn(&CellSpec, Mode, Option<f64>) -> Option<f64> + '_ {
    use ferrotext_train::cost;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let gflops = move |config: &ferrotext_train::TrainConfig, devices: usize| -> Option<f64> {
        let b = cost::device_thread_budget(cores, devices);
        match cost::too_big_to_measure(config, b.concurrent).ok()? {
            // `concurrent` devices side by side; more devices than that: each gets a share.
            None => Some(
                cost::measure_micro_batch(config, b.threads, b.concurrent, 1, 3)
                    .ok()?
                    .gflops
                    * b.share,
            ),
            // A matmul on one thread alone: more devices than cores each get a share of one.
            Some(_) => Some(
                cost::measure_matmul_gflops(512, b.threads).ok()?
                    * (cores as f64 / (devices * b.threads) as f64).min(1.0),
            ),
        }
    };
    let cache = std::sync::Mutex::new(std::collections::BTreeMap::<(usize, String), f64>::new());
    move |spec: &CellSpec, mode: Mode, fitted_compute_ms: Option<f64>| {
        let devices = spec.hosts * spec.devices_per_host;
        let mut items = vec![
            format!("model_name={}", spec.model),
            format!("gradient_accumulation_steps={}", spec.ga),
            format!("steps={steps}"),
        ];
        if let Some(o) = spec.overlap {
            items.push(format!("overlap_grad_reduce={o}"));
        }
        items.extend(set.iter().cloned());
        let config = ferrotext_train::TrainConfig::load(None, &items).ok()?;
        let cluster: ferrotext_train::cost::ClusterSpec = format!(
            "hosts={},devices_per_host={},link={}bit,{}us",
            spec.hosts,
            spec.devices_per_host,
            spec.link_bps,
            spec.link_delay_s * 1e6
        )
        .parse()
        .ok()?;
        let rate = if let Some(c) = fitted_compute_ms {
            // The device throughput that makes a micro-batch take `c` ms: the model's compute
            // time is FLOPs ÷ throughput, so price it once at 1 GFLOP/s and scale.
            let at_one = ferrotext_train::cost::predict(&config, &cluster, 1.0).ok()?;
            at_one.compute_ms_per_micro_batch / c
        } else {
            let mut cache = cache.lock().ok()?;
            let key = (devices, spec.model.clone());
            match cache.get(&key) {
                Some(&r) => r,
                None => {
                    let r = gflops(&config, devices)?;
                    cache.insert(key, r);
                    r
                }
            }
        };
        let p = ferrotext_train::cost::predict(&config, &cluster, rate).ok()?;
        Some(match mode {
            Mode::PerMicroBatch => p.per_micro_batch_step_ms,
            Mode::Deferred => p.deferred_step_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(ga: usize, overlap: Option<bool>, deferred_ms: f64) -> Cell {
        Cell {
            spec: CellSpec {
                model: "m".into(),
                hosts: 2,
                devices_per_host: 1,
                link: "1gbit".into(),
                link_bps: 1_000_000_000,
                link_delay_s: 0.0,
                ga,
                overlap,
            },
            per_micro_batch: ModeResult::default(),
            deferred: ModeResult {
                median_step_ms: deferred_ms,
                ..ModeResult::default()
            },
            paired_speedup: 1.0,
            wire_ratio: 1.0,
            predicted_step_ms: PredictedMs::default(),
            predicted_with_fitted_compute_ms: PredictedMs::default(),
            formula_speedup: None,
        }
    }

    /// A network measured with `a` = 120 ms and a fitted latency of `latency_us`.
    fn network(latency_us: f64) -> NetworkFit {
        NetworkFit {
            hosts: 2,
            link: "1gbit".into(),
            gradient_bytes: 8,
            all_reduce_ms: 120.0,
            small_all_reduce_ms: 0.0,
            fitted_latency_us: latency_us,
            compute_ms: None,
            intercept_ms: None,
        }
    }

    /// Hand-computed: 2 ranks, 4 KiB at 1 Gbit/s is 32.8 µs on the wire; 1.0328 ms in all
    /// leaves 1000 µs over 2 ring steps. More ranks pay more steps; the latency is never
    /// negative.
    #[test]
    fn the_latency_is_a_small_all_reduce_less_its_bytes_over_its_ring_steps() {
        let wire_2 = (4096.0 * 8.0) / 1e9; // 2(n−1)/n = 1 for n = 2
        let l = fitted_latency_s(1.0 + wire_2 * 1e3, 2, 1_000_000_000);
        assert!((l - 500e-6).abs() < 1e-12, "{l}");
        let wire_4 = 1.5 * (4096.0 * 8.0) / 1e9;
        let l = fitted_latency_s(1.2 + wire_4 * 1e3, 4, 1_000_000_000);
        assert!((l - 200e-6).abs() < 1e-12, "{l}");
        assert_eq!(fitted_latency_s(0.0, 2, 1_000_000_000), 0.0);
    }

    #[test]
    fn the_line_fit_recovers_a_line_and_needs_two_distinct_points() {
        let (i, s) = line_fit(&[(1.0, 130.0), (2.0, 230.0), (4.0, 430.0)]).unwrap();
        assert!(
            (i - 30.0).abs() < 1e-9 && (s - 100.0).abs() < 1e-9,
            "{i} {s}"
        );
        assert!(line_fit(&[(4.0, 1.0)]).is_none());
        assert!(line_fit(&[(4.0, 1.0), (4.0, 2.0)]).is_none());
    }

    /// `c` comes from the deferred cells without overlap only; the formula is filled for those
    /// cells and matches the hand-computed speedup; the predictor receives the fitted `c`.
    #[test]
    fn calibration_fits_c_on_deferred_cells_without_overlap() {
        // c = 100 ms, o + a = 150 ms (a = 120, o = 30); the overlapped cells lie off the line.
        let mut cells = vec![
            cell(1, Some(false), 250.0),
            cell(1, Some(true), 10.0),
            cell(4, Some(false), 550.0),
            cell(4, Some(true), 10.0),
        ];
        let seen = std::sync::Mutex::new(Vec::new());
        let predict = |spec: &CellSpec, _: Mode, c: Option<f64>| {
            seen.lock().unwrap().push((c, spec.link_delay_s));
            Some(1.0)
        };
        let fit = calibrate(network(250.0), &mut cells, Some(&predict));
        assert!((fit.compute_ms.unwrap() - 100.0).abs() < 1e-9);
        assert!((fit.intercept_ms.unwrap() - 150.0).abs() < 1e-9);
        // GA 4: (4·220 + 30) / (400 + 150) = 910 / 550.
        let f = cells[2].formula_speedup.unwrap();
        assert!((f - 910.0 / 550.0).abs() < 1e-12, "{f}");
        assert!((cells[0].formula_speedup.unwrap() - 1.0).abs() < 1e-12);
        assert!(cells[1].formula_speedup.is_none() && cells[3].formula_speedup.is_none());
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 8);
        // Every prediction gets the fitted `c`, and the fitted latency in place of the delay.
        assert!(seen.iter().all(|(c, delay)| {
            c.is_some_and(|c| (c - 100.0).abs() < 1e-9) && (delay - 250e-6).abs() < 1e-15
        }));
    }

    #[test]
    fn a_single_ga_fits_nothing() {
        let mut cells = vec![cell(4, Some(false), 550.0)];
        let fit = calibrate(network(0.0), &mut cells, None);
        assert!(fit.compute_ms.is_none() && cells[0].formula_speedup.is_none());
    }
}
