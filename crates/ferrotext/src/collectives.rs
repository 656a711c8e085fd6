//! `ferrotext collectives`: a real run of the `comm` layer.
//!
//! Runs a training-shaped schedule (a loss all-reduce per micro-batch, the gradient reduction in
//! `update` both as one all-reduce and as ZeRO-1's reduce-scatter + all-gather, an all-to-all, a
//! broadcast, a barrier) on a mesh — in-process, or spanning the processes of an MPI job — checks
//! every result against a serial reference computed on the host, and prints device 0's trace.
//! Under MPI each process checks its own devices and reports the bytes it sent through MPI.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotext_comm::{human_bytes, run_spmd_detachable, CommError, Device, SpmdOptions, Trace};
use ferrotext_sharding::Mesh;

use crate::common::UsageError;
use crate::launch::Launch;
use crate::mesh_arg::parse_mesh;

/// Flags of `ferrotext collectives`.
#[derive(Args)]
pub struct CollectivesArgs {
    /// Mesh axes in order, `name=size,...` (under MPI: processes × devices per process).
    #[arg(long, default_value = "data=4")]
    mesh: String,
    /// The axes the collectives run over, comma-separated (default: the first mesh axis).
    #[arg(long, value_delimiter = ',')]
    axes: Vec<String>,
    /// Under MPI: run collectives across processes flat instead of hierarchically.
    #[arg(long)]
    flat: bool,
    /// Only the gradient all-reduce of `update` (for traffic measurements).
    #[arg(long)]
    all_reduce_only: bool,
    /// Make this device issue a different collective in `update` (tests the mismatch path): an
    /// all-gather of its whole gradient, so every message it sends is larger than the chunk of
    /// the all-reduce its peers expect.
    #[arg(long, hide = true)]
    diverge_device: Option<usize>,
    /// Make this device's gradient all-reduce twice as long as its peers' (tests that a length
    /// disagreement is a mismatch even where the first messages have the same size).
    #[arg(long, hide = true)]
    diverge_length: Option<usize>,
    /// Fill the buffers with values of very different magnitudes, whose f32 sums depend on the
    /// order of addition: the check then holds only where the sums follow the tree over the
    /// ranks (in one process, flat under MPI, or hierarchical with a power-of-two number of
    /// devices per process).
    #[arg(long, hide = true)]
    rounding: bool,
    /// Make this device stall before `update` for ten timeouts (tests the timeout path and, in
    /// one process, that the run returns without waiting for the stalled device).
    #[arg(long, hide = true)]
    stall_device: Option<usize>,
    /// Collective timeout in seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_seconds: f64,
    /// Elements of the gradient buffer reduced in `update`.
    #[arg(long, default_value_t = 1 << 20)]
    elements: usize,
    /// Micro-batches (one small loss all-reduce each).
    #[arg(long, default_value_t = 4)]
    micro_batches: usize,
}

/// Deterministic per-device contents, different for each `salt`: small multiples of 1/4 (sums
/// exact in any order), or with `rounding` mantissas spread over 2^-20 .. 2^20 (f32 sums that
/// depend on the order of addition).
fn contents(device: usize, len: usize, salt: usize, rounding: bool) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let small = ((device * 31 + i * 7 + salt * 13) % 101) as f32 * 0.25 - 12.0;
            if rounding {
                let h = (device as u64 * 0x9e37_79b9 + i as u64 * 0x85eb_ca6b + salt as u64)
                    .wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
                let exponent = ((h >> 40) % 41) as i32 - 20;
                (small + 0.1) * 2f32.powi(exponent)
            } else {
                small
            }
        })
        .collect()
}

/// What each device computed, to be checked on the host.
struct DeviceResults {
    losses: Vec<f32>,
    all_reduced: Vec<f32>,
    /// `None` when only the all-reduce ran.
    gathered: Option<Vec<f32>>,
    exchanged: Vec<f32>,
    broadcast: Vec<f32>,
    trace: Trace,
}

/// f32 buffers of the gradient's length each device holds at once (gradient, all-reduced copy,
/// gathered copy, MPI staging, the host check's reference sum), rounded up.
const BUFFERS_PER_DEVICE: usize = 6;

/// The memory (bytes) this process needs for `len`-element gradients on `devices` devices, the
/// diverging one (if here) holding an all-gather output `n` times larger; `None` on overflow.
fn memory_needed(len: usize, n: usize, devices: usize, diverging_here: bool) -> Option<usize> {
    let per_device = len.checked_mul(4)?.checked_mul(BUFFERS_PER_DEVICE)?;
    let extra = if diverging_here {
        len.checked_mul(4)?.checked_mul(n)?
    } else {
        0
    };
    per_device.checked_mul(devices)?.checked_add(extra)
}

/// This machine's physical memory in bytes (Linux), if known.
fn physical_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses `--elements` values whose buffers overflow or cannot fit in this machine's memory,
/// before anything is allocated. Returns the gradient length (a multiple of `n`).
fn checked_len(
    elements: usize,
    n: usize,
    devices: usize,
    diverging_here: bool,
) -> Result<usize, UsageError> {
    let len = elements.div_ceil(n).checked_mul(n);
    let needed = len.and_then(|len| memory_needed(len, n, devices, diverging_here));
    let (Some(len), Some(needed)) = (len, needed) else {
        return Err(UsageError(format!(
            "--elements {elements}: the buffers of {devices} device(s) would need more than \
             {} of memory (the size overflows)",
            human_bytes(usize::MAX)
        )));
    };
    if needed > isize::MAX as usize || physical_memory().is_some_and(|total| needed > total) {
        let total = physical_memory().map_or_else(String::new, |t| {
            format!(", more than this machine's {}", human_bytes(t))
        });
        return Err(UsageError(format!(
            "--elements {elements}: needs about {} of memory in this process ({BUFFERS_PER_DEVICE} \
             f32 buffers of {len} elements on each of {devices} device(s)){total}",
            human_bytes(needed)
        )));
    }
    Ok(len)
}

/// What every device thread needs (owned: the run may leave a stalled device behind).
struct Job {
    axes: Vec<String>,
    len: usize,
    n: usize,
    micro_batches: usize,
    all_reduce_only: bool,
    diverge_device: Option<usize>,
    diverge_length: Option<usize>,
    rounding: bool,
    stall_device: Option<usize>,
    stall: Duration,
}

/// Runs `ferrotext collectives`.
pub fn run(args: &CollectivesArgs, launch: &mut Launch) -> Result<()> {
    let options = SpmdOptions::default()
        .with_timeout_secs(args.timeout_seconds)
        .map_err(|e| UsageError(format!("--timeout-seconds: {e}")))?;
    let mesh = parse_mesh(&args.mesh)?;
    let axes_owned = group_axes(args, &mesh)?;
    let axes: Vec<&str> = axes_owned.iter().map(String::as_str).collect();
    let n = mesh
        .axes_size(&axes)
        .map_err(|e| UsageError(e.to_string()))?;
    let processes = launch.processes().max(1);
    let devices_here = mesh.device_count() / processes;
    let here = launch.process() * devices_here..(launch.process() + 1) * devices_here;
    let diverging_here = args
        .diverge_device
        .or(args.diverge_length)
        .is_some_and(|d| here.contains(&d));
    let len = checked_len(args.elements, n, devices_here, diverging_here)?;
    #[cfg(feature = "mpi")]
    if let Some(mpi) = launch.mpi_mut() {
        mpi.set_hierarchical(!args.flat);
    }
    let leader = launch.is_leader();
    if leader {
        println!(
            "mesh {mesh}: {} devices in {} process(es), collectives over {axes:?} (groups of {n})",
            mesh.device_count(),
            launch.processes()
        );
    }
    let job = Job {
        axes: axes_owned.clone(),
        len,
        n,
        micro_batches: args.micro_batches,
        all_reduce_only: args.all_reduce_only,
        diverge_device: args.diverge_device,
        diverge_length: args.diverge_length,
        rounding: args.rounding,
        stall_device: args.stall_device,
        stall: options.collective_timeout.saturating_mul(10),
    };

    let start = Instant::now();
    let results = run_spmd_detachable(launch.cluster(), &mesh, &options, move |dev| {
        job.device_program(dev)
    })
    .context("the collective run failed")?;
    let elapsed = start.elapsed();

    let first = launch.process() * results.len();
    check(
        &mesh,
        &axes,
        len,
        args.micro_batches,
        args.rounding,
        first,
        &results,
    )?;
    if leader {
        println!("\ncollective trace of device 0:\n{}", results[0].trace);
        println!("per phase:\n{}", results[0].trace.summary_table());
    }
    println!(
        "process {}: devices {first}..{} equal the serial reference (bitwise); run took {:.1} ms",
        launch.process(),
        first + results.len(),
        elapsed.as_secs_f64() * 1e3
    );
    #[cfg(feature = "mpi")]
    if let Some(mpi) = launch.mpi() {
        let t = mpi.traffic();
        println!(
            "process {}: mpi bytes to other processes {}, within this process {}",
            launch.process(),
            t.to_other_processes,
            t.within_process
        );
    }
    Ok(())
}

/// The axes the collectives run over: `--axes`, else the mesh's first axis.
fn group_axes(args: &CollectivesArgs, mesh: &Mesh) -> Result<Vec<String>, UsageError> {
    if !args.axes.is_empty() {
        return Ok(args.axes.clone());
    }
    let first = mesh
        .axes()
        .first()
        .ok_or_else(|| UsageError(format!("--mesh {}: no axes", args.mesh)))?;
    Ok(vec![first.name().to_string()])
}

impl Job {
    /// One device's schedule: a loss all-reduce per micro-batch, then (phase `update`) the
    /// gradient all-reduced, or the injected divergence; unless `all_reduce_only`, ZeRO-1's
    /// reduce-scatter + all-gather, an all-to-all (`moe_dispatch`), and a broadcast and a
    /// barrier (`checkpoint`).
    fn device_program(&self, dev: &mut Device) -> Result<DeviceResults, CommError> {
        let (len, n) = (self.len, self.n);
        let axes: Vec<&str> = self.axes.iter().map(String::as_str).collect();
        let me = dev.index();
        let comm = dev.comm();
        let mut losses = Vec::new();
        for micro in 0..self.micro_batches {
            comm.push_phase(format!("micro_batch {micro}"));
            let mut loss = [me as f32 + micro as f32];
            comm.all_reduce(&axes, &mut loss)?;
            losses.push(loss[0]);
            comm.pop_phase();
        }
        if self.stall_device == Some(me) {
            std::thread::sleep(self.stall);
        }
        comm.push_phase("update");
        let grad = contents(me, len, 1, self.rounding);
        let mut all_reduced = grad.clone();
        if self.diverge_device == Some(me) {
            let mut wrong = vec![0.0; len * n];
            comm.all_gather(&axes, &grad, &mut wrong)?;
        } else if self.diverge_length == Some(me) {
            let mut longer = contents(me, 2 * len, 1, self.rounding);
            comm.all_reduce(&axes, &mut longer)?;
        } else {
            comm.all_reduce(&axes, &mut all_reduced)?;
        }
        if self.all_reduce_only {
            comm.pop_phase();
            return Ok(DeviceResults {
                losses,
                all_reduced,
                gathered: None,
                exchanged: Vec::new(),
                broadcast: Vec::new(),
                trace: comm.take_trace(),
            });
        }
        comm.push_phase("zero1");
        let mut shard = vec![0.0; len / n];
        comm.reduce_scatter(&axes, &grad, &mut shard)?;
        let mut gathered = vec![0.0; len];
        comm.all_gather(&axes, &shard, &mut gathered)?;
        comm.pop_phase();
        comm.pop_phase();
        comm.push_phase("moe_dispatch");
        let tokens = contents(me, 8 * n, 2, self.rounding);
        let mut exchanged = vec![0.0; 8 * n];
        comm.all_to_all(&axes, &tokens, &mut exchanged)?;
        comm.pop_phase();
        comm.push_phase("checkpoint");
        let mut broadcast = contents(me, 16, 3, self.rounding);
        comm.broadcast(&axes, 0, &mut broadcast)?;
        comm.barrier(&axes)?;
        comm.pop_phase();
        Ok(DeviceResults {
            losses,
            all_reduced,
            gathered: Some(gathered),
            exchanged,
            broadcast,
            trace: comm.take_trace(),
        })
    }
}

/// Compares every device's results (devices `first..`) with a serial computation over its
/// group, in the collectives' tree order over the ranks.
fn check(
    mesh: &Mesh,
    axes: &[&str],
    len: usize,
    micro_batches: usize,
    rounding: bool,
    first: usize,
    results: &[DeviceResults],
) -> Result<()> {
    for (d, r) in (first..).zip(results) {
        let group = mesh.group_of(d, axes)?;
        let rank = group.iter().position(|&g| g == d).unwrap_or(0);
        let n = group.len();
        for (micro, &loss) in r.losses.iter().enumerate().take(micro_batches) {
            let want: f32 = group.iter().map(|&g| g as f32 + micro as f32).sum();
            if loss != want {
                bail!("device {d}: micro-batch {micro} loss {loss} != {want}");
            }
        }
        // Every reduction sums its members in one fixed tree over the ranks (`tree_sum`).
        let members: Vec<Vec<f32>> = group
            .iter()
            .map(|&g| contents(g, len, 1, rounding))
            .collect();
        let sum: Vec<f32> = (0..len)
            .map(|i| {
                let column: Vec<f32> = members.iter().map(|m| m[i]).collect();
                ferrotext_comm::tree_sum::tree_sum_f32(&column)
            })
            .collect();
        if r.all_reduced != sum || r.gathered.as_ref().is_some_and(|g| g != &sum) {
            bail!("device {d}: the gradient reduction differs from the serial sum");
        }
        if r.gathered.is_none() {
            continue;
        }
        let m = 8;
        for (k, &g) in group.iter().enumerate() {
            let theirs = contents(g, m * n, 2, rounding);
            if r.exchanged[k * m..(k + 1) * m] != theirs[rank * m..(rank + 1) * m] {
                bail!("device {d}: all-to-all chunk {k} is wrong");
            }
        }
        if r.broadcast != contents(group[0], 16, 3, rounding) {
            bail!("device {d}: broadcast differs from the root's buffer");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::contents;

    #[test]
    fn rounding_contents_have_order_dependent_sums() {
        let parts: Vec<Vec<f32>> = (0..4).map(|d| contents(d, 1000, 1, true)).collect();
        let forward: Vec<f32> = (0..1000)
            .map(|i| ((parts[0][i] + parts[1][i]) + parts[2][i]) + parts[3][i])
            .collect();
        let backward: Vec<f32> = (0..1000)
            .map(|i| ((parts[3][i] + parts[2][i]) + parts[1][i]) + parts[0][i])
            .collect();
        let differ = forward
            .iter()
            .zip(&backward)
            .filter(|(a, b)| a != b)
            .count();
        assert!(
            differ > 100,
            "only {differ} of 1000 sums depend on the order"
        );
    }
}
