//! `ferrotext collectives`: a real run of the `comm` layer until the trainer exists.
//!
//! Runs a training-shaped schedule (a loss all-reduce per micro-batch, the gradient reduction in
//! `update` both as one all-reduce and as ZeRO-1's reduce-scatter + all-gather, an all-to-all, a
//! broadcast) on an in-process mesh, checks every result against a serial reference computed on
//! the host, and prints device 0's trace.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotext_comm::{run_spmd, CommError, SpmdOptions, Trace};

use crate::mesh_arg::parse_mesh;

/// Flags of `ferrotext collectives`.
#[derive(Args)]
pub struct CollectivesArgs {
    /// Mesh axes in order, `name=size,...`; collectives run over the first axis.
    #[arg(long, default_value = "data=4")]
    mesh: String,
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
    gathered: Vec<f32>,
    exchanged: Vec<f32>,
    broadcast: Vec<f32>,
    trace: Trace,
}

/// Runs the demo.
pub fn run(args: &CollectivesArgs) -> Result<()> {
    let mesh = parse_mesh(&args.mesh)?;
    let axis = mesh.axes()[0].name().to_string();
    let axes = [axis.as_str()];
    let n = mesh.axes()[0].size();
    let len = args.elements.div_ceil(n) * n;
    println!(
        "mesh {mesh}: {} devices, collectives over `{axis}` (groups of {n})",
        mesh.device_count()
    );

    let start = Instant::now();
    let results = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
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
        comm.push_phase("update");
        let grad = contents(me, len, 1);
        let mut all_reduced = grad.clone();
        comm.all_reduce(&axes, &mut all_reduced)?;
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
        comm.pop_phase();
        Ok::<_, CommError>(DeviceResults {
            losses,
            all_reduced,
            gathered,
            exchanged,
            broadcast,
            trace: comm.take_trace(),
        })
    })
    .context("the collective run failed")?;
    let elapsed = start.elapsed();

    check(&mesh, &axes, len, args.micro_batches, &results)?;
    println!("\ncollective trace of device 0:\n{}", results[0].trace);
    println!("per phase:\n{}", results[0].trace.summary_table());
    println!(
        "all {} devices' results equal the serial reference (bitwise); run took {:.1} ms",
        results.len(),
        elapsed.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Compares every device's results with a serial computation over its group, in rank order.
fn check(
    mesh: &ferrotext_sharding::Mesh,
    axes: &[&str],
    len: usize,
    micro_batches: usize,
    results: &[DeviceResults],
) -> Result<()> {
    for (d, r) in results.iter().enumerate() {
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
        if r.all_reduced != sum || r.gathered != sum {
            bail!("device {d}: the gradient reduction differs from the serial sum");
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
