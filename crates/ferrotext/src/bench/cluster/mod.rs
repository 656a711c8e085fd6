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
//!
//! Files: this one runs the grid; `calibrate.rs` fits each network; `cost_model.rs` is the
//! prediction function the cost model provides; `plot.rs` draws the speedups.

mod calibrate;
mod cost_model;
mod plot;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotext_comm::human_bytes;
use ferrotext_train::{ShardMode, TrainConfig};
use serde::Serialize;

use super::{abba_pair, cores, write_json, Side};
use crate::common::stats::median;
use crate::common::UsageError;
use crate::emulate::{self, net::Network, JobRun, Plan};
use calibrate::{
    calibrate, fitted_latency_s, measure_all_reduce_ms, print_fitted, LATENCY_PROBE_BYTES,
};
pub use cost_model::cost_model;
use plot::plot;

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
    /// Links (`RATE[,DELAY]`; a list separated by `;` or given several times).
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

impl CellSpec {
    /// The run a cell trains, before the user's `--set` items: its model and GA, `steps` steps,
    /// and its `overlap_grad_reduce` when given.
    pub fn config(&self, steps: usize) -> TrainConfig {
        let defaults = TrainConfig::default();
        TrainConfig {
            model_name: self.model.clone(),
            gradient_accumulation_steps: self.ga,
            steps,
            overlap_grad_reduce: self.overlap.unwrap_or(defaults.overlap_grad_reduce),
            ..defaults
        }
    }
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

/// A cell's `ferrotext train` command line in `mode`: its config as `key=value` items, then the
/// user's `--set` items as given (the job, which knows its processes, checks them).
fn job_args(spec: &CellSpec, mode: Mode, steps: usize, set: &[String], dir: &Path) -> Vec<String> {
    let tag = match mode {
        Mode::PerMicroBatch => "pmb",
        Mode::Deferred => "def",
    };
    let config = TrainConfig {
        base_output_directory: dir.display().to_string(),
        run_name: format!("h{}_ga{}_{tag}", spec.hosts, spec.ga),
        shard_mode: match mode {
            Mode::PerMicroBatch => ShardMode::Auto,
            Mode::Deferred => ShardMode::Explicit,
        },
        ..spec.config(steps)
    };
    let mut args = vec!["train".to_string()];
    args.extend(config.to_overrides());
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
        return Err(UsageError("--steps must be at least 2".into()).into());
    }
    if args.pairs == 0 || args.hosts.is_empty() || args.links.is_empty() || args.ga.is_empty() {
        return Err(
            UsageError("--pairs, --hosts, --links and --ga must be non-empty".into()).into(),
        );
    }
    let scratch =
        std::env::temp_dir().join(format!("ferrotext-bench-cluster-{}", std::process::id()));
    // Every cell's input is checked before any network exists.
    let grid = grid(args, &scratch)?;
    emulate::preflight()?;
    emulate::net::remove_leftovers();

    let mut report = Report {
        benchmark: "cluster",
        steps: args.steps,
        pairs: args.pairs,
        cores: cores(),
        networks: Vec::new(),
        cells: Vec::new(),
    };
    let grid_run = GridRun {
        args,
        grid: &grid,
        gradient_bytes: gradient_bytes(&args.model, &args.set)?,
        scratch: &scratch,
        stop: &stop,
        predict,
    };
    for &hosts in &args.hosts {
        for link in &args.links {
            let fit = grid_run.network(hosts, link, &mut report.cells)?;
            report.networks.push(fit);
            // Written after every network, so an interrupted grid keeps what it measured.
            write_json(&args.out, &report)?;
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    write_json(&args.out, &report)?;
    if let Some(dir) = args.svg.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    plot(&report.cells, &args.svg)?;
    println!("wrote {} and {}", args.out.display(), args.svg.display());
    Ok(())
}

/// Every cell of hosts × links × GA × overlap, each of its jobs checked (as `emulate` would
/// plan it) before any network exists.
///
/// # Errors
/// A link that does not parse, or a job `emulate` refuses.
fn grid(args: &ClusterArgs, scratch: &Path) -> Result<Vec<CellSpec>> {
    let overlaps: Vec<Option<bool>> = if args.overlap.is_empty() {
        vec![None]
    } else {
        args.overlap.iter().map(|&o| Some(o)).collect()
    };
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
                        let job = job_args(&spec, mode, args.steps, &args.set, scratch);
                        Plan::new(hosts, args.devices_per_host, link, &job)?;
                    }
                    grid.push(spec);
                }
            }
        }
    }
    Ok(grid)
}

/// What every network of a grid's run shares.
struct GridRun<'a> {
    args: &'a ClusterArgs,
    grid: &'a [CellSpec],
    /// The model's gradient bytes (f32).
    gradient_bytes: usize,
    scratch: &'a Path,
    stop: &'a AtomicBool,
    predict: Option<Predictor<'a>>,
}

impl GridRun<'_> {
    /// One network (`hosts` hosts on `link`): created, calibrated (`a` and the latency), its
    /// cells run and appended to `cells`, torn down; returns its fit (see [`calibrate()`]).
    fn network(&self, hosts: usize, link: &str, cells: &mut Vec<Cell>) -> Result<NetworkFit> {
        let args = self.args;
        let spec_link = emulate::net::LinkSpec::parse(link)?;
        let network = Network::create(hosts, &spec_link)?;
        println!("{hosts} hosts, link {link}, subnet {}", network.cidr());
        let measure = |bytes| {
            measure_all_reduce_ms(
                &network,
                args.devices_per_host,
                bytes,
                self.scratch,
                self.stop,
            )
        };
        let all_reduce_ms = measure(self.gradient_bytes)?;
        let small_all_reduce_ms = measure(LATENCY_PROBE_BYTES)?;
        let latency_s = fitted_latency_s(
            small_all_reduce_ms,
            hosts * args.devices_per_host,
            spec_link.rate_bps,
        );
        println!(
            "  a = {all_reduce_ms:.1} ms: one all-reduce of the {} of gradients; one of {} \
             takes {small_all_reduce_ms:.2} ms, a latency of {:.0} µs a ring step",
            human_bytes(self.gradient_bytes),
            human_bytes(LATENCY_PROBE_BYTES),
            latency_s * 1e6
        );
        let first = cells.len();
        for spec in self
            .grid
            .iter()
            .filter(|s| s.hosts == hosts && s.link == link)
        {
            let cell = run_cell(&network, spec, args, self.scratch, self.stop, self.predict)?;
            print_cell(&cell);
            cells.push(cell);
        }
        drop(network);
        let fit = calibrate(
            NetworkFit {
                hosts,
                link: link.to_string(),
                gradient_bytes: self.gradient_bytes,
                all_reduce_ms,
                small_all_reduce_ms,
                fitted_latency_us: latency_s * 1e6,
                compute_ms: None,
                intercept_ms: None,
            },
            &mut cells[first..],
            self.predict,
        );
        if let (Some(c), Some(i)) = (fit.compute_ms, fit.intercept_ms) {
            println!("  fit: c = {c:.1} ms per micro-batch, o + a = {i:.1} ms per step");
            for cell in &cells[first..] {
                print_fitted(cell);
            }
        }
        Ok(fit)
    }
}

/// A cell's line: each mode's step time and link bytes per step, and the paired speedup.
fn print_cell(cell: &Cell) {
    let spec = &cell.spec;
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
}

fn run_cell(
    network: &Network,
    spec: &CellSpec,
    args: &ClusterArgs,
    scratch: &Path,
    stop: &AtomicBool,
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

/// How many times a job is launched when Open MPI keeps losing a daemon or the job hangs: as
/// many as `emulate` launches a lost one.
const JOB_ATTEMPTS: usize = emulate::LAUNCH_ATTEMPTS;

/// [`emulate::run_job`] quietly, started again when a host's process never started (a launch
/// whose daemon Open MPI lost) or it runs past [`JOB_LIMIT`], at most [`JOB_ATTEMPTS`] times.
fn run_job(
    network: &Network,
    devices_per_host: usize,
    job: &[String],
    stop: &AtomicBool,
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
    let config = TrainConfig {
        model_name: model.into(),
        ..TrainConfig::default()
    };
    let plan = config.with_overrides(set)?.plan()?;
    Ok(plan
        .params()
        .iter()
        .map(|p| p.shape.iter().product::<usize>() * 4)
        .sum())
}
