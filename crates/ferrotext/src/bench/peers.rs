//! `ferrotext bench peers`: ferrotext's step time beside the JAX and PyTorch peers' (the `jax/`
//! and `torch/` folders of the team checkout's peers directory, which `--peers` names) on the
//! same model, tokens per micro-batch, optimizer and clipping, at several (data, GA) points.
//!
//! Every run is a fresh process of its engine: `ferrotext train` (this binary), the JAX peer's
//! `train.py --defer`, the PyTorch peer's `train.py --mode no_sync` (DDP, one all-reduce per
//! step). A round runs each engine once per point, in the order ferrotext, JAX, PyTorch on odd
//! rounds and the reverse on even ones (ABBA), so a machine that drifts slows every engine alike
//! over two rounds; ratios pair the runs of one round. Each run's figure is its median step
//! after `warmup` untimed steps (ferrotext's from its `metrics.jsonl`, the peers' from the median
//! they print), i.e. compilation and start-up are left out of every engine alike.
//!
//! The model is `qwen3-peer` (the peers' defaults): 8 rows of 64 tokens per micro-batch,
//! `8 / data` rows on each device, SGD, gradient clipping by global norm at `clip` on all three
//! (ferrotext's default 1.0; 0 turns it off everywhere).

use std::fmt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use ferrotext_sharding::DType;
use ferrotext_train::{DatasetType, OptType, TrainConfig};
use serde::Serialize;

use super::write_json;
use crate::common::stats::median;
use crate::common::{dtype_flag, UsageError};

/// Global rows per micro-batch: the peers' `--micro-batch` default.
const MICRO_BATCH_ROWS: usize = 8;

/// `ferrotext bench peers`'s options.
#[derive(Args, Clone, Debug)]
pub struct PeersArgs {
    /// The team checkout's peers directory (holding `jax/train.py` and `torch/train.py`); the
    /// default assumes that checkout sits beside this repository.
    #[arg(long, default_value = "../shared/peers")]
    peers: PathBuf,
    /// The JAX peer's Python (default: `PEERS/jax/.venv/bin/python`, its README's set-up).
    #[arg(long)]
    jax_python: Option<PathBuf>,
    /// The PyTorch peer's Python (default: `PEERS/torch/.venv/bin/python`).
    #[arg(long)]
    torch_python: Option<PathBuf>,
    /// Points as `DATAxGA`: data-parallel devices (dividing 8) and micro-batches per step.
    #[arg(long, value_delimiter = ',', default_value = "4x1,4x2,4x4,4x8,1x4")]
    points: Vec<Point>,
    /// Engines to run (at least one).
    #[arg(long, value_delimiter = ',', default_value = "ferrotext,jax,torch")]
    engines: Vec<Engine>,
    /// Rounds (each runs every engine once per point).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Untimed steps per run.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps per run (the figure is their median).
    #[arg(long, default_value_t = 8)]
    steps: usize,
    /// Gradient clipping by global norm on every engine (0: off).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// The compute dtype on every engine: `float32`, or `bfloat16` (ferrotext's
    /// `dtype=bfloat16`, the PyTorch peer's `--dtype bf16`, autocast; the JAX peer has no bf16
    /// mode and is refused); `f32`, `bf16` also.
    #[arg(long, default_value = "float32", value_parser = peer_dtype)]
    dtype: DType,
    /// Extra `key=value` overrides for the ferrotext runs.
    #[arg(long = "set")]
    set: Vec<String>,
    /// Extra arguments for both peers' `train.py` (e.g. `--peer-arg=--seq=128` beside
    /// `--set max_target_length=128`).
    #[arg(long = "peer-arg", allow_hyphen_values = true)]
    peer_args: Vec<String>,
    /// Seconds a run may take before it is killed and the benchmark fails.
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// Where ferrotext's runs write their outputs.
    #[arg(long, default_value = "target/bench/peers-runs")]
    runs: PathBuf,
    /// Where to write the JSON results.
    #[arg(long, default_value = "target/bench/peers.json")]
    out: PathBuf,
}

/// `--dtype`: the words of every command ([`dtype_flag`]), float32 or bfloat16.
fn peer_dtype(value: &str) -> Result<DType, UsageError> {
    dtype_flag(value, &[DType::F32, DType::BF16])
}

/// A training engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// `ferrotext train`.
    Ferrotext,
    /// The JAX peer.
    Jax,
    /// The PyTorch peer.
    Torch,
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Engine::Ferrotext => "ferrotext",
            Engine::Jax => "JAX",
            Engine::Torch => "PyTorch",
        })
    }
}

/// A point of the comparison: data-parallel devices and micro-batches per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Point {
    data: usize,
    ga: usize,
}

impl FromStr for Point {
    type Err = String;

    /// `DATAxGA`, e.g. `4x8`; `data` must divide the 8 rows of a micro-batch, GA be at least 1.
    fn from_str(s: &str) -> Result<Point, String> {
        let bad = || format!("`{s}`: expected DATAxGA with DATA dividing 8 and GA ≥ 1, e.g. 4x8");
        let (data, ga) = s.split_once(['x', 'X']).ok_or_else(bad)?;
        let (data, ga): (usize, usize) = (
            data.trim().parse().map_err(|_| bad())?,
            ga.trim().parse().map_err(|_| bad())?,
        );
        if data == 0 || !MICRO_BATCH_ROWS.is_multiple_of(data) || ga == 0 {
            return Err(bad());
        }
        Ok(Point { data, ga })
    }
}

/// One run's figure.
#[derive(Clone, Debug, Serialize)]
struct Run {
    point: Point,
    round: usize,
    engine: Engine,
    median_ms: f64,
}

/// A point's figures, one per round and engine, and the paired ratios.
#[derive(Serialize)]
struct Row {
    point: Point,
    ferrotext_ms: Vec<f64>,
    jax_ms: Vec<f64>,
    torch_ms: Vec<f64>,
    /// ferrotext / JAX, per round.
    ferrotext_over_jax: Vec<f64>,
    /// ferrotext / PyTorch, per round.
    ferrotext_over_torch: Vec<f64>,
}

/// The engines of round `round` (0-based) in the order they run: as given on even rounds,
/// reversed on odd ones.
fn round_order(engines: &[Engine], round: usize) -> Vec<Engine> {
    let mut order = engines.to_vec();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

impl PeersArgs {
    fn python(&self, engine: Engine) -> PathBuf {
        let (given, dir) = match engine {
            Engine::Jax => (&self.jax_python, "jax"),
            _ => (&self.torch_python, "torch"),
        };
        given
            .clone()
            .unwrap_or_else(|| self.peers.join(dir).join(".venv/bin/python"))
    }

    /// Refuses what cannot run before anything runs: no engines or rounds, a peer's script or
    /// Python missing.
    fn check(&self) -> Result<()> {
        if self.engines.is_empty() || self.rounds == 0 || self.steps == 0 || self.points.is_empty()
        {
            bail!("bench peers needs at least one engine, point, round and timed step");
        }
        if !(self.clip.is_finite() && self.clip >= 0.0) {
            bail!("--clip {}: a norm ≥ 0 (0 turns clipping off)", self.clip);
        }
        if self.dtype == DType::BF16 && self.engines.contains(&Engine::Jax) {
            bail!("--dtype bf16: the JAX peer has no bf16 mode; run --engines ferrotext,torch");
        }
        for &engine in &self.engines {
            let (dir, readme) = match engine {
                Engine::Ferrotext => continue,
                Engine::Jax => (
                    "jax",
                    "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt",
                ),
                Engine::Torch => (
                    "torch",
                    "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt",
                ),
            };
            let script = self.peers.join(dir).join("train.py");
            if !script.is_file() {
                bail!(
                    "the {engine} peer's {} is not there (--peers)",
                    script.display()
                );
            }
            let python = self.python(engine);
            if !python.exists() {
                bail!(
                    "the {engine} peer's Python {} is not there: set it up in {} (`{readme}`) or \
                     pass --{}-python",
                    python.display(),
                    self.peers.join(dir).display(),
                    dir
                );
            }
        }
        Ok(())
    }

    /// The command of one run, and where ferrotext's writes its metrics.
    fn command(&self, engine: Engine, point: Point, round: usize) -> Result<(Command, PathBuf)> {
        let Point { data, ga } = point;
        let run_name = format!("data{data}-ga{ga}-round{round}");
        let run_dir = self.runs.join(&run_name);
        let mut cmd = match engine {
            Engine::Ferrotext => {
                let exe = std::env::current_exe().context("locating the ferrotext binary")?;
                let config = TrainConfig {
                    model_name: "qwen3-peer".into(),
                    max_target_length: 64,
                    dataset_type: DatasetType::Synthetic,
                    opt_type: OptType::Sgd,
                    ici_data_parallelism: data as i64,
                    local_devices: data,
                    per_device_batch_size: (MICRO_BATCH_ROWS / data) as f64,
                    gradient_accumulation_steps: ga,
                    steps: self.warmup + self.steps,
                    gradient_clipping_threshold: self.clip,
                    dtype: self.dtype,
                    base_output_directory: self.runs.display().to_string(),
                    run_name: run_name.clone(),
                    ..TrainConfig::default()
                };
                let mut cmd = Command::new(exe);
                // The user's `--set` items as given, after: the child checks them.
                cmd.arg("train").args(config.to_overrides()).args(&self.set);
                cmd
            }
            Engine::Jax | Engine::Torch => {
                let dir = self.peers.join(if engine == Engine::Jax {
                    "jax"
                } else {
                    "torch"
                });
                let mut cmd = Command::new(self.python(engine));
                cmd.current_dir(&dir).arg("train.py");
                let (data, ga) = (data.to_string(), ga.to_string());
                if engine == Engine::Jax {
                    cmd.args(["--dp", &data, "--defer"]);
                } else {
                    cmd.args(["--nproc", &data, "--mode", "no_sync"]);
                    if self.dtype == DType::BF16 {
                        // f32 is the peer's default: said only when it is not; the peer takes
                        // the short name.
                        cmd.args(["--dtype", self.dtype.short_name()]);
                    }
                }
                cmd.args(["--ga", &ga, "--opt", "sgd"])
                    .args(["--warmup", &self.warmup.to_string()])
                    .args(["--steps", &self.steps.to_string()])
                    .args(["--clip", &self.clip.to_string()])
                    .args(&self.peer_args);
                cmd
            }
        };
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        Ok((cmd, run_dir))
    }

    /// Runs one engine at one point and returns its median step in ms.
    fn run_one(&self, engine: Engine, point: Point, round: usize) -> Result<f64> {
        let (mut cmd, run_dir) = self.command(engine, point, round)?;
        let output = run_with_timeout(&mut cmd, Duration::from_secs(self.timeout))
            .with_context(|| format!("running {engine} at data={} GA {}", point.data, point.ga))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let failed = || {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            anyhow!(
                "{engine} at data={} GA {} failed ({}); its last lines:\n{}\n{}",
                point.data,
                point.ga,
                output.status,
                stdout.lines().last().unwrap_or(""),
                tail.join("\n")
            )
        };
        if !output.status.success() {
            return Err(failed());
        }
        let ms = match engine {
            Engine::Ferrotext => {
                let metrics = run_dir.join("metrics.jsonl");
                let text = std::fs::read_to_string(&metrics)
                    .with_context(|| format!("reading {}", metrics.display()))?;
                ferrotext_median_ms(&text, self.warmup)
            }
            Engine::Jax => jax_median_ms(&stdout),
            Engine::Torch => torch_median_ms(&stdout),
        };
        ms.with_context(failed)
    }
}

/// Runs `cmd` to its end, or kills it after `timeout`.
///
/// # Errors
/// It cannot start, or it ran past `timeout` (killed).
fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Result<std::process::Output> {
    let mut child = cmd.spawn().context("starting the process")?;
    // Drain both pipes on threads, so a chatty child never blocks on a full pipe.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut pipe) = pipe {
                // A read error ends the capture; what came before is kept.
                let _ = pipe.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for the process")? {
            break status;
        }
        if start.elapsed() > timeout {
            // Already gone is fine: the point is that it no longer runs.
            let _ = child.kill();
            let _ = child.wait();
            bail!("killed after {} s (--timeout)", timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(std::process::Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// The median `seconds` of the steps from `warmup` on in a `metrics.jsonl`, in ms.
fn ferrotext_median_ms(metrics: &str, warmup: usize) -> Result<f64> {
    let mut seconds = Vec::new();
    for (i, line) in metrics.lines().enumerate() {
        let value: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("metrics.jsonl line {}: not JSON", i + 1))?;
        let (Some(step), Some(s)) = (value["step"].as_u64(), value["seconds"].as_f64()) else {
            continue;
        };
        if step >= warmup as u64 {
            seconds.push(s);
        }
    }
    if seconds.is_empty() {
        bail!("no timed step in metrics.jsonl");
    }
    Ok(median(seconds) * 1e3)
}

/// The JAX peer's `…: median step X ms over K steps | …` line.
fn jax_median_ms(stdout: &str) -> Result<f64> {
    stdout
        .lines()
        .find_map(|line| {
            let rest = line.split_once("median step ")?.1;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .context("no `median step X ms` line in the JAX peer's output")
}

/// The PyTorch peer's JSON line of the `no_sync` mode: its `median_ms`.
fn torch_median_ms(stdout: &str) -> Result<f64> {
    stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line.trim()).ok())
        .find(|v| v["mode"] == "no_sync")
        .and_then(|v| v["median_ms"].as_f64())
        .context("no JSON line with `median_ms` for mode `no_sync` in the PyTorch peer's output")
}

/// The rows of the report from every run.
fn rows(args: &PeersArgs, runs: &[Run]) -> Vec<Row> {
    args.points
        .iter()
        .map(|&point| {
            let of = |engine: Engine| -> Vec<f64> {
                (0..args.rounds)
                    .filter_map(|round| {
                        runs.iter()
                            .find(|r| r.point == point && r.round == round && r.engine == engine)
                            .map(|r| r.median_ms)
                    })
                    .collect()
            };
            let (ft, jax, torch) = (of(Engine::Ferrotext), of(Engine::Jax), of(Engine::Torch));
            let ratio =
                |other: &[f64]| -> Vec<f64> { ft.iter().zip(other).map(|(a, b)| a / b).collect() };
            Row {
                point,
                ferrotext_over_jax: ratio(&jax),
                ferrotext_over_torch: ratio(&torch),
                ferrotext_ms: ft,
                jax_ms: jax,
                torch_ms: torch,
            }
        })
        .collect()
}

/// `a, b` with one decimal (or `-` for none).
fn list(xs: &[f64], digits: usize) -> String {
    if xs.is_empty() {
        return "-".into();
    }
    xs.iter()
        .map(|x| format!("{x:.digits$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs the benchmark, prints a markdown table and writes JSON to `args.out`.
///
/// # Errors
/// A missing peer or Python (before anything runs), a run that fails, times out or prints no
/// figure (naming the engine and point, with its last lines).
pub fn run(args: &PeersArgs) -> Result<()> {
    args.check()?;
    let mut runs = Vec::new();
    for &point in &args.points {
        for round in 0..args.rounds {
            for engine in round_order(&args.engines, round) {
                let median_ms = args.run_one(engine, point, round)?;
                println!(
                    "data={} GA {} round {}: {engine} {median_ms:.1} ms",
                    point.data,
                    point.ga,
                    round + 1
                );
                runs.push(Run {
                    point,
                    round,
                    engine,
                    median_ms,
                });
            }
        }
    }
    let rows = rows(args, &runs);
    println!();
    println!("| data | GA | ferrotext ms | JAX ms | PyTorch ms | ferrotext / JAX | ferrotext / PyTorch |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.point.data,
            r.point.ga,
            list(&r.ferrotext_ms, 1),
            list(&r.jax_ms, 1),
            list(&r.torch_ms, 1),
            list(&r.ferrotext_over_jax, 2),
            list(&r.ferrotext_over_torch, 2)
        );
    }
    let json = serde_json::json!({
        "benchmark": "peers",
        "model": "qwen3-peer",
        "cores": super::cores(),
        "micro_batch_rows": MICRO_BATCH_ROWS,
        "clip": args.clip,
        "dtype": args.dtype.short_name(),
        "warmup": args.warmup,
        "steps": args.steps,
        "set": args.set,
        "peer_args": args.peer_args,
        "runs": runs,
        "rows": rows,
    });
    write_json(&args.out, &json)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests;
