//! `ferrotext bench ...`: benchmarks that write JSON and print a table.
//!
//! Times are medians over repetitions within one process; compare the ratios, not the absolute
//! numbers (the machine is shared and noisy).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Subcommand, ValueEnum};
use ferrotext_comm::{human_bytes, run_spmd_in, CommError, SpmdOptions};
use ferrotext_sharding::Mesh;
use serde::Serialize;

use crate::launch::Launch;
use crate::UsageError;

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
    Cluster(crate::bench_cluster::ClusterArgs),
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

/// Collective transports the benchmark can run.
#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Device threads in this process, shared memory.
    Local,
    /// Processes of an MPI job (`mpirun -n P ferrotext bench collectives --backend mpi`).
    Mpi,
}

#[derive(Serialize)]
struct Row {
    backend: Backend,
    devices: usize,
    /// Processes the devices span (1 for the local backend).
    processes: usize,
    bytes: usize,
    reps: usize,
    all_reduce_median_s: f64,
    /// Buffer bytes / time.
    algbw_gb_s: f64,
    /// algbw × 2(n−1)/n, the per-device traffic of a bandwidth-optimal all-reduce (NCCL's bus
    /// bandwidth).
    busbw_gb_s: f64,
    memcpy_median_s: f64,
    memcpy_gb_s: f64,
    /// algbw / memcpy bandwidth.
    ratio_to_memcpy: f64,
}

#[derive(Serialize)]
struct Report {
    benchmark: &'static str,
    cores: usize,
    rows: Vec<Row>,
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
            collectives(launch, &plan, min_bytes, max_bytes, &out)
        }
        BenchCommand::Ga {
            model,
            ga,
            pairs,
            set,
            out,
        } => crate::bench_ga::run(&model, &ga, pairs, &set, &out),
        BenchCommand::Moe {
            model,
            pairs,
            set,
            out,
            svg,
        } => crate::bench_moe::run(&model, pairs, &set, &out, &svg),
        BenchCommand::Cluster(args) => {
            let predict = crate::bench_cluster::cost_model(args.set(), args.steps());
            crate::bench_cluster::run(&args, Some(&predict))
        }
        BenchCommand::Kernels {
            d_model,
            tokens,
            threads,
            out,
        } => crate::bench_kernels::run(&d_model, tokens, &threads, &out),
    }
}

/// Switches the MPI cluster between flat and hierarchical collectives.
fn set_flat(launch: &mut Launch, flat: bool) {
    #[cfg(feature = "mpi")]
    if let Some(mpi) = launch.mpi_mut() {
        mpi.set_hierarchical(!flat);
    }
    let _ = (launch, flat);
}

fn sizes(min_bytes: usize, max_bytes: usize) -> Vec<usize> {
    let mut sizes = Vec::new();
    let mut s = min_bytes.max(4);
    while s <= max_bytes {
        sizes.push(s);
        s *= 4;
    }
    sizes
}

/// Enough repetitions for ~0.25 s of copying per size, within [5, 200].
fn reps_for(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(5, 200)
}

/// The median of timings (0 for none).
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn memcpy_seconds(bytes: usize, reps: usize) -> f64 {
    let src = vec![1.0f32; bytes / 4];
    let mut dst = vec![0.0f32; bytes / 4];
    dst.copy_from_slice(&src);
    let times = (0..reps)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(times)
}

/// What `bench collectives` runs.
enum Plan {
    /// One in-process mesh per device count.
    Local { devices: Vec<usize> },
    /// The processes of this MPI job × `local_devices` threads each.
    Mpi { local_devices: usize, flat: bool },
}

fn collectives(
    launch: &mut Launch,
    plan: &Plan,
    min_bytes: usize,
    max_bytes: usize,
    out: &PathBuf,
) -> Result<()> {
    let (meshes, backend): (Vec<usize>, Backend) = match plan {
        Plan::Local { devices } => (devices.clone(), Backend::Local),
        Plan::Mpi {
            local_devices,
            flat,
        } => {
            if launch.cluster().is_none() {
                return Err(UsageError(
                    "--backend mpi runs under `mpirun -n P` with an MPI build (--features mpi)"
                        .into(),
                )
                .into());
            }
            set_flat(launch, *flat);
            (vec![launch.processes() * local_devices], Backend::Mpi)
        }
    };
    if meshes.iter().any(|&n| n < 2) || min_bytes > max_bytes {
        return Err(UsageError(
            "the benchmark needs ≥ 2 devices per mesh and --min-bytes ≤ --max-bytes".into(),
        )
        .into());
    }
    let sizes = sizes(min_bytes, max_bytes);
    let mut rows = Vec::new();
    for &n in &meshes {
        let mesh = std::sync::Arc::new(Mesh::explicit([("data", n)])?);
        let per_size = run_spmd_in(launch.cluster(), &mesh, &SpmdOptions::default(), |dev| {
            let mut medians = Vec::new();
            for &bytes in &sizes {
                let reps = reps_for(bytes);
                let mut buf = vec![1.0f32; bytes / 4];
                for _ in 0..2 {
                    dev.comm().all_reduce(&["data"], &mut buf)?;
                }
                let mut times = Vec::with_capacity(reps);
                for _ in 0..reps {
                    let t = Instant::now();
                    dev.comm().all_reduce(&["data"], &mut buf)?;
                    times.push(t.elapsed().as_secs_f64());
                }
                medians.push((reps, median(times)));
            }
            Ok::<_, CommError>(medians)
        })
        .context("all-reduce benchmark failed")?;
        for (&bytes, &(reps, seconds)) in sizes.iter().zip(&per_size[0]) {
            let memcpy = memcpy_seconds(bytes, reps);
            let algbw = bytes as f64 / seconds / 1e9;
            let memcpy_bw = bytes as f64 / memcpy / 1e9;
            rows.push(Row {
                backend,
                devices: n,
                processes: launch.processes(),
                bytes,
                reps,
                all_reduce_median_s: seconds,
                algbw_gb_s: algbw,
                busbw_gb_s: algbw * 2.0 * (n - 1) as f64 / n as f64,
                memcpy_median_s: memcpy,
                memcpy_gb_s: memcpy_bw,
                ratio_to_memcpy: algbw / memcpy_bw,
            });
        }
    }
    if !launch.is_leader() {
        return Ok(());
    }
    println!(
        "{:>9}  {:>7}  {:>9}  {:>12}  {:>11}  {:>11}  {:>11}  {:>8}",
        "processes",
        "devices",
        "bytes",
        "all_reduce",
        "algbw GB/s",
        "busbw GB/s",
        "memcpy GB/s",
        "ratio"
    );
    for r in &rows {
        println!(
            "{:>9}  {:>7}  {:>9}  {:>9.1} us  {:>11.2}  {:>11.2}  {:>11.2}  {:>8.2}",
            r.processes,
            r.devices,
            human_bytes(r.bytes),
            r.all_reduce_median_s * 1e6,
            r.algbw_gb_s,
            r.busbw_gb_s,
            r.memcpy_gb_s,
            r.ratio_to_memcpy
        );
    }
    let report = Report {
        benchmark: "all_reduce",
        cores: std::thread::available_parallelism().map_or(1, |c| c.get()),
        rows,
    };
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}
