//! `ferrotext bench cluster`: step time and link bytes of deferred vs per-micro-batch gradient
//! reduction on emulated clusters (see `emulate`), over hosts × links × GA (× overlap), each cell
//! as ABBA-paired jobs; JSON to `target/bench/cluster.json` and a plot (SVG, `plotters`).
//!
//! Each job is a separate `mpirun` of `ferrotext train` on the same emulated network (one network
//! per hosts × link); per-micro-batch is `shard_mode=auto`, which closes the deferral gate so the
//! gradients are all-reduced in every micro-batch. Step times are the medians of each job's steps
//! after the first; the speedup of a pair is per-micro-batch ms / deferred ms, and a cell's is the
//! median over its pairs.

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

/// A step-time prediction (ms) for a cell and mode; `None` when it has none. The cost model
/// plugs in here.
pub type Predictor<'a> = &'a dyn Fn(&CellSpec, Mode) -> Option<f64>;

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
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    steps: usize,
    pairs: usize,
    cores: usize,
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
    for &hosts in &args.hosts {
        for link in &args.links {
            let spec_link = emulate::net::LinkSpec::parse(link)?;
            let network = Network::create(hosts, &spec_link)?;
            println!("{hosts} hosts, link {link}, subnet {}", network.cidr());
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
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let report = Report {
        benchmark: "cluster",
        steps: args.steps,
        pairs: args.pairs,
        cores: cores(),
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
            let run = emulate::run_job(network, spec.devices_per_host, &job, stop, true)?;
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
            per_micro_batch: predict.and_then(|p| p(spec, Mode::PerMicroBatch)),
            deferred: predict.and_then(|p| p(spec, Mode::Deferred)),
        },
    })
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
/// (`cost::measure_micro_batch`; a gemm matmul when that would not fit in memory). `None` for a cell the model cannot price.
pub fn cost_model(set: &[String], steps: usize) -> impl Fn(&CellSpec, Mode) -> Option<f64> + '_ {
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
    move |spec: &CellSpec, mode: Mode| {
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
        let rate = {
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
        let cluster: ferrotext_train::cost::ClusterSpec = format!(
            "hosts={},devices_per_host={},link={}bit,{}us",
            spec.hosts,
            spec.devices_per_host,
            spec.link_bps,
            spec.link_delay_s * 1e6
        )
        .parse()
        .ok()?;
        let p = ferrotext_train::cost::predict(&config, &cluster, rate).ok()?;
        Some(match mode {
            Mode::PerMicroBatch => p.per_micro_batch_step_ms,
            Mode::Deferred => p.deferred_step_ms,
        })
    }
}
