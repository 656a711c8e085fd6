//! `ferrotext bench collectives`: all-reduce bandwidth from 4 KiB to 64 MiB next to memcpy of the
//! same buffer, on in-process meshes or across the processes of an MPI job.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::ValueEnum;
use ferrotext_comm::{human_bytes, run_spmd_in, CommError, SpmdOptions};
use ferrotext_sharding::Mesh;
use serde::Serialize;

use super::{cores, write_json};
use crate::common::stats::median;
use crate::common::UsageError;
use crate::launch::Launch;

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
pub(super) enum Plan {
    /// One in-process mesh per device count.
    Local { devices: Vec<usize> },
    /// The processes of this MPI job × `local_devices` threads each.
    Mpi { local_devices: usize, flat: bool },
}

/// Runs `bench collectives` (see [`super::BenchCommand::Collectives`]) and writes JSON to `out`.
pub(super) fn run(
    launch: &mut Launch,
    plan: &Plan,
    min_bytes: usize,
    max_bytes: usize,
    out: &Path,
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
    print_rows(&rows);
    let report = Report {
        benchmark: "all_reduce",
        cores: cores(),
        rows,
    };
    write_json(out, &report)?;
    println!("wrote {}", out.display());
    Ok(())
}

/// The benchmark's table on stdout.
fn print_rows(rows: &[Row]) {
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
    for r in rows {
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
}
