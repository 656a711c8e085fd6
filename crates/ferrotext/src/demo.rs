//! `ferrotext collectives`: a real run of the `comm` layer.
//!
//! Runs a training-shaped schedule (a loss all-reduce per micro-batch, the gradient reduction in
//! `update` both as one all-reduce and as ZeRO-1's reduce-scatter + all-gather, an all-to-all, a
//! broadcast, a barrier) on a mesh — in-process, or spanning the processes of an MPI job — checks
//! every result against a serial reference computed on the host, and prints device 0's trace.
//! Under MPI each process checks its own devices and reports the bytes it sent through MPI.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotext_comm::{run_spmd_in, CommError, SpmdOptions, Trace};

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
    /// Make this device stall before `update` for ten timeouts (tests the timeout path).
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

/// Deterministic per-device contents, different for each `salt`.
fn contents(device: usize, len: usize, salt: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((device * 31 + i * 7 + salt * 13) % 101) as f32 * 0.25 - 12.0)
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

/// Runs the demo.
pub fn run(args: &CollectivesArgs, launch: &mut Launch) -> Result<()> {
    let mesh = parse_mesh(&args.mesh)?;
    let axes_owned: Vec<String> = if args.axes.is_empty() {
        vec![mesh.axes()[0].name().to_string()]
    } else {
        args.axes.clone()
    };
    let axes: Vec<&str> = axes_owned.iter().map(String::as_str).collect();
    let n = mesh
        .axes_size(&axes)
        .map_err(|e| crate::UsageError(e.to_string()))?;
    let len = args.elements.div_ceil(n) * n;
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
    let options = SpmdOptions::default()
        .with_timeout(std::time::Duration::from_secs_f64(args.timeout_seconds));

    let start = Instant::now();
    let results = run_spmd_in(launch.cluster(), &mesh, &options, |dev| {
        let me = dev.index();
        let comm = dev.comm();
        let mut losses = Vec::new();
        for micro in 0..args.micro_batches {
            comm.push_phase(format!("micro_batch {micro}"));
            let mut loss = [me as f32 + micro as f32];
            comm.all_reduce(&axes, &mut loss)?;
            losses.push(loss[0]);
            comm.pop_phase();
        }
        if args.stall_device == Some(me) {
            std::thread::sleep(std::time::Duration::from_secs_f64(
                10.0 * args.timeout_seconds,
            ));
        }
        comm.push_phase("update");
        let grad = contents(me, len, 1);
        let mut all_reduced = grad.clone();
        if args.diverge_device == Some(me) {
            let mut wrong = vec![0.0; len * n];
            comm.all_gather(&axes, &grad, &mut wrong)?;
        } else {
            comm.all_reduce(&axes, &mut all_reduced)?;
        }
        if args.all_reduce_only {
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
        let tokens = contents(me, 8 * n, 2);
        let mut exchanged = vec![0.0; 8 * n];
        comm.all_to_all(&axes, &tokens, &mut exchanged)?;
        comm.pop_phase();
        comm.push_phase("checkpoint");
        let mut broadcast = contents(me, 16, 3);
        comm.broadcast(&axes, 0, &mut broadcast)?;
        comm.barrier(&axes)?;
        comm.pop_phase();
        Ok::<_, CommError>(DeviceResults {
            losses,
            all_reduced,
            gathered: Some(gathered),
            exchanged,
            broadcast,
            trace: comm.take_trace(),
        })
    })
    .context("the collective run failed")?;
    let elapsed = start.elapsed();

    let first = launch.process() * results.len();
    check(&mesh, &axes, len, args.micro_batches, first, &results)?;
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

/// Compares every device's results (devices `first..`) with a serial computation over its
/// group, in rank order.
fn check(
    mesh: &ferrotext_sharding::Mesh,
    axes: &[&str],
    len: usize,
    micro_batches: usize,
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
        let mut sum = contents(group[0], len, 1);
        for &g in &group[1..] {
            for (s, x) in sum.iter_mut().zip(contents(g, len, 1)) {
                *s += x;
            }
        }
        if r.all_reduced != sum || r.gathered.as_ref().is_some_and(|g| g != &sum) {
            bail!("device {d}: the gradient reduction differs from the serial sum");
        }
        if r.gathered.is_none() {
            continue;
        }
        let m = 8;
        for (k, &g) in group.iter().enumerate() {
            let theirs = contents(g, m * n, 2);
            if r.exchanged[k * m..(k + 1) * m] != theirs[rank * m..(rank + 1) * m] {
                bail!("device {d}: all-to-all chunk {k} is wrong");
            }
        }
        if r.broadcast != contents(group[0], 16, 3) {
            bail!("device {d}: broadcast differs from the root's buffer");
        }
    }
    Ok(())
}
