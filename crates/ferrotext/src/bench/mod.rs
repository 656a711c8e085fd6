//! `ferrotext bench ...`: benchmarks that write JSON and print a table, one submodule each, and
//! what they share: the ABBA pairing of two configurations and writing the results (the median
//! is [`crate::common::stats::median`]).
//!
//! Times are medians over repetitions within one process; compare the ratios, not the absolute
//! numbers (the machine is shared and noisy). Two configurations are compared in ABBA-ordered
//! pairs ([`abba_pair`]), so a drift of the machine during the run falls on both alike.

mod cluster;
mod collectives;
mod ga;
mod generate;
mod kernels;
mod layout;
mod moe;
mod peers;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Subcommand;
use ferrotext_train::StepMetrics;

use crate::common::stats::median;
use crate::launch::Launch;

use cluster::ClusterArgs;
use collectives::{Backend, Plan};
use peers::PeersArgs;

/// The benchmarks.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// All-reduce bandwidth from 4 KiB to 64 MiB next to memcpy of the same buffer. With
    /// `--backend mpi`, run under `mpirun -n P`: one `data` mesh of P × `--local-devices`.
    Collectives {
        /// Device counts to run (a one-axis `data` mesh each; local backend).
        #[arg(long, value_delimiter = ',', default_value = "2,4")]
        devices: Vec<usize>,
        /// Smallest buffer in bytes (sizes grow ×4).
        #[arg(long, default_value_t = 4 << 10)]
        min_bytes: usize,
        /// Largest buffer in bytes.
        #[arg(long, default_value_t = 64 << 20)]
        max_bytes: usize,
        /// Which transport.
        #[arg(long, value_enum, default_value_t = Backend::Local)]
        backend: Backend,
        /// Device threads per process (`--backend mpi`).
        #[arg(long, default_value_t = 1)]
        local_devices: usize,
        /// Run collectives across processes flat, not hierarchically (`--backend mpi`).
        #[arg(long)]
        flat: bool,
        /// Where to write the JSON results.
        #[arg(long, default_value = "target/bench/collectives.json")]
        out: PathBuf,
    },
    /// Step time with the gradient reduction deferred vs per micro-batch, GA ∈ {1,2,4,8}, data=4,
    /// in one process, ABBA-paired; JSON plus the fit of o, c, a.
    Ga {
        /// Model preset.
        #[arg(long, default_value = "qwen3-peer")]
        model: String,
        /// GA values.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        ga: Vec<usize>,
        /// Timed (deferred, untagged) step pairs per GA.
        #[arg(long, default_value_t = 4)]
        pairs: usize,
        /// Extra `key=value` train overrides.
        #[arg(long = "set")]
        set: Vec<String>,
        /// Where to write the JSON results.
        #[arg(long, default_value = "target/bench/ga.json")]
        out: PathBuf,
    },
    /// What `layout_invariant=true` costs: the same deterministic run with and without the
    /// key, ABBA-paired in one process, at each (data, GA) point; and the gradient memory the
    /// tree adds per device.
    Layout {
        /// Model preset.
        #[arg(long, default_value = "qwen3-peer")]
        model: String,
        /// `data×GA` points (each a device's micro-batch of `per_device_batch_size` rows).
        #[arg(long, value_delimiter = ',', default_value = "4x4,1x4")]
        points: Vec<layout::Point>,
        /// Timed (without, with) step pairs per point.
        #[arg(long, default_value_t = 8)]
        pairs: usize,
        /// Extra `key=value` train overrides (both runs).
        #[arg(long = "set")]
        set: Vec<String>,
        /// Where to write the JSON results.
        #[arg(long, default_value = "target/bench/layout.json")]
        out: PathBuf,
    },
    /// The MoE sweeps (GA, tokens per micro-batch, experts, depth): deferred vs per-micro-batch
    /// reduction, ABBA-paired in one process, with predicted speedups and peak memory; JSON and
    /// an SVG plot.
    Moe {
        /// MoE model preset.
        #[arg(long, default_value = "qwen3-moe-bench")]
        model: String,
        /// Timed (tagged, untagged) step pairs per point.
        #[arg(long, default_value_t = 3)]
        pairs: usize,
        /// Extra `key=value` train overrides.
        #[arg(long = "set")]
        set: Vec<String>,
        /// Where to write the JSON results.
        #[arg(long, default_value = "target/bench/moe.json")]
        out: PathBuf,
        /// Where to write the plot.
        #[arg(long, default_value = "target/bench/moe.svg")]
        svg: PathBuf,
    },
    /// Deferred vs per-micro-batch gradient reduction on emulated clusters (hosts × links × GA,
    /// ABBA-paired `mpirun` jobs through `ferrotext emulate`'s network): step time, bytes on the
    /// links; JSON and an SVG plot. Needs what `emulate` needs (root, `ip`, `tc`, `mpirun`).
    Cluster(ClusterArgs),
    /// Time per generated token with the key/value cache against recomputing the whole context,
    /// at `--context` positions, ABBA-paired; JSON.
    Generate {
        /// Model preset (initial weights).
        #[arg(long, default_value = "qwen3-peer")]
        model: String,
        /// Positions at the last token (prompt + new tokens).
        #[arg(long, default_value_t = 256)]
        context: usize,
        /// Tokens generated per run (the per-token time is their median after the first).
        #[arg(long, default_value_t = 8)]
        new_tokens: usize,
        /// ABBA pairs.
        #[arg(long, default_value_t = 4)]
        pairs: usize,
        /// Where to write the JSON results.
        #[arg(long, default_value = "target/bench/generate.json")]
        out: PathBuf,
    },
    /// ferrotext's step time beside the JAX and PyTorch peers' (the team checkout's peers
    /// directory, set by `--peers`) on the same
    /// model, tokens, optimizer and clipping, at several (data, GA) points; each run a fresh
    /// process, engines alternated ABBA round by round; JSON and a markdown table.
    Peers(PeersArgs),
    /// GFLOP/s of the matmul shapes of a transformer layer (forward and both backward products)
    /// through `dot_general`, next to the `gemm` crate called directly on the same layout.
    Kernels {
        /// Model widths to run.
        #[arg(long, value_delimiter = ',', default_value = "256,1024")]
        d_model: Vec<usize>,
        /// Tokens per matmul (rows of the activations).
        #[arg(long, default_value_t = 1024)]
        tokens: usize,
        /// Thread counts to run.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        threads: Vec<usize>,
        /// Where to write the JSON results.
        #[arg(long, default_value = "target/bench/kernels.json")]
        out: PathBuf,
    },
}

/// Runs one benchmark.
pub fn run(which: BenchCommand, launch: &mut Launch) -> Result<()> {
    match which {
        BenchCommand::Collectives {
            devices,
            min_bytes,
            max_bytes,
            backend,
            local_devices,
            flat,
            out,
        } => {
            let plan = match backend {
                Backend::Local => Plan::Local { devices },
                Backend::Mpi => Plan::Mpi {
                    local_devices,
                    flat,
                },
            };
            collectives::run(launch, &plan, min_bytes, max_bytes, &out)
        }
        BenchCommand::Ga {
            model,
            ga,
            pairs,
            set,
            out,
        } => ga::run(&model, &ga, pairs, &set, &out),
        BenchCommand::Layout {
            model,
            points,
            pairs,
            set,
            out,
        } => layout::run(&model, &points, pairs, &set, &out),
        BenchCommand::Moe {
            model,
            pairs,
            set,
            out,
            svg,
        } => moe::run(&model, pairs, &set, &out, &svg),
        BenchCommand::Cluster(args) => {
            let predict = cluster::cost_model(args.set(), args.steps());
            cluster::run(&args, Some(&predict))
        }
        BenchCommand::Generate {
            model,
            context,
            new_tokens,
            pairs,
            out,
        } => generate::run(&model, context, new_tokens, pairs, &out),
        BenchCommand::Peers(args) => peers::run(&args),
        BenchCommand::Kernels {
            d_model,
            tokens,
            threads,
            out,
        } => kernels::run(&d_model, tokens, &threads, &out),
    }
}

/// The cores of this machine (recorded in the reports).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |c| c.get())
}

/// One of the two configurations a paired benchmark compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The first: run first in even pairs.
    A,
    /// The second: run first in odd pairs.
    B,
}

/// Pair `i` of an ABBA-ordered comparison: `run(A)` then `run(B)` when `i` is even, `run(B)` then
/// `run(A)` when it is odd, so a machine that drifts (warms up, gets busier) slows both sides
/// alike over every two pairs. Returns `(A's result, B's result)`.
///
/// # Errors
/// The first error of `run`; the pair stops there.
pub(crate) fn abba_pair<T, E>(
    i: usize,
    mut run: impl FnMut(Side) -> Result<T, E>,
) -> Result<(T, T), E> {
    if i.is_multiple_of(2) {
        let a = run(Side::A)?;
        Ok((a, run(Side::B)?))
    } else {
        let b = run(Side::B)?;
        Ok((run(Side::A)?, b))
    }
}

/// One ABBA pair of training steps: each side's step time and loss.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepPair {
    /// A's step time, seconds.
    pub a_seconds: f64,
    /// B's step time, seconds.
    pub b_seconds: f64,
    /// A's loss.
    pub a_loss: f64,
    /// B's loss.
    pub b_loss: f64,
}

impl StepPair {
    /// The pair of A's step `a` and B's step `b`.
    pub fn of(a: &StepMetrics, b: &StepMetrics) -> StepPair {
        StepPair {
            a_seconds: a.seconds,
            b_seconds: b.seconds,
            a_loss: a.loss,
            b_loss: b.loss,
        }
    }
}

/// The statistics of a run of [`StepPair`]s.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Paired {
    /// Median of A's step times, seconds.
    pub a_seconds: f64,
    /// Median of B's step times, seconds.
    pub b_seconds: f64,
    /// Median over pairs of B's time / A's time (the speedup of A over B, paired).
    pub b_over_a: f64,
    /// Largest `|A's loss − B's loss|` over the pairs (both sides compute the same steps).
    pub max_abs_loss_diff: f64,
}

impl Paired {
    /// The statistics of `pairs` (all zero for none).
    pub fn of(pairs: &[StepPair]) -> Paired {
        Paired {
            a_seconds: median(pairs.iter().map(|p| p.a_seconds).collect()),
            b_seconds: median(pairs.iter().map(|p| p.b_seconds).collect()),
            b_over_a: median(pairs.iter().map(|p| p.b_seconds / p.a_seconds).collect()),
            max_abs_loss_diff: pairs
                .iter()
                .map(|p| (p.a_loss - p.b_loss).abs())
                .fold(0.0, f64::max),
        }
    }
}

/// Writes `contents` to `path`, creating its folder first.
///
/// # Errors
/// The folder or the file cannot be written (the message names the path).
fn write_file(path: &Path, contents: impl AsRef<[u8]>) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// Writes `report` to `path` as pretty-printed JSON (see [`write_file`]), with a `machine`
/// object beside its own keys when it is a JSON object that has none ([`machine`]).
///
/// # Errors
/// As [`write_file`].
fn write_json(path: &Path, report: &impl serde::Serialize) -> Result<()> {
    let mut value = serde_json::to_value(report)?;
    if let Some(keys) = value.as_object_mut() {
        keys.entry("machine").or_insert_with(machine);
    }
    write_file(path, serde_json::to_string_pretty(&value)?)
}

/// What a report's figures depend on besides the benchmark: the cores, the processor as Linux
/// names it (`/proc/cpuinfo`'s `model name`; null where it says none), and the kernel this
/// binary's `f32` products run on, which follows the processor (`crates/tensor/src/blas.rs`)
/// and `FERROTEXT_MATMUL`.
fn machine() -> serde_json::Value {
    serde_json::json!({
        "cores": cores(),
        "processor": ferrotext_tensor::processor_name(),
        "matmul": ferrotext_tensor::matmul_kernel(),
    })
}

/// Two planned training runs on one mesh, stepped side by side in one process: a warm-up step
/// each, then `pairs` ABBA-ordered pairs of steps (A = `a`, B = `b`), both reading `a`'s data.
/// Returns device 0's statistics.
///
/// # Errors
/// A data source the config cannot open; a training failure on any device.
pub(crate) fn paired_training_steps(
    a: &ferrotext_train::RunPlan,
    b: &ferrotext_train::RunPlan,
    pairs: usize,
) -> Result<Paired, ferrotext_train::TrainError> {
    use ferrotext_train::{data, TrainError, Trainer};
    let vocab = a.decoder().config().vocab_size;
    let source: std::sync::Arc<dyn data::TokenSource> =
        std::sync::Arc::from(data::source_for(a.config(), vocab)?);
    let opts =
        ferrotext_comm::SpmdOptions::default().with_timeout(std::time::Duration::from_secs(600));
    let mesh = a.compute_mesh();
    let per_device = ferrotext_comm::run_spmd(mesh, &opts, |dev| {
        ferrotext_spmd::on_device(dev, |cx| -> Result<Vec<StepPair>, TrainError> {
            let mut run_a = Trainer::new(cx, a, source.clone(), None)?;
            let mut run_b = Trainer::new(cx, b, source.clone(), None)?;
            run_a.step(cx)?; // warm-up
            run_b.step(cx)?;
            (0..pairs)
                .map(|i| {
                    let (ma, mb) = abba_pair(i, |side| match side {
                        Side::A => run_a.step(cx),
                        Side::B => run_b.step(cx),
                    })?;
                    Ok(StepPair::of(&ma, &mb))
                })
                .collect()
        })
    })
    .map_err(TrainError::from)?;
    Ok(Paired::of(
        per_device.first().map_or(&[][..], Vec::as_slice),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report gets the machine beside its own keys; one that records its own keeps it; one
    /// that is not an object is written as it is.
    #[test]
    fn reports_record_the_machine_unless_they_say_it() {
        let dir = std::env::temp_dir().join(format!("ferrotext-machine-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let read = |name: &str, report: serde_json::Value| {
            let path = dir.join(name);
            write_json(&path, &report).unwrap();
            serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(path).unwrap())
                .unwrap()
        };
        let plain = read("plain.json", serde_json::json!({ "rows": [1, 2] }));
        assert_eq!(plain["rows"], serde_json::json!([1, 2]));
        assert_eq!(plain["machine"], machine());
        assert_eq!(plain["machine"]["cores"], cores());
        let own = serde_json::json!({ "machine": "the report's own" });
        assert_eq!(read("own.json", own.clone()), own);
        let list = serde_json::json!([1, 2]);
        assert_eq!(read("list.json", list.clone()), list);
        std::fs::remove_dir_all(dir).ok();
    }
}
