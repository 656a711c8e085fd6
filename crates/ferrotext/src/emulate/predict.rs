//! What the collective trace predicts each host sends to the others per step: one step planned in
//! abstract mode on the job's mesh, each collective's group split over processes (`L` devices
//! each, process `p` holding devices `p·L..`), and the MPI backend's algorithms' payload.

use std::sync::Arc;

use anyhow::Result;
use ferrotext_comm::{CollectiveKind, Trace, TraceEvent};
use ferrotext_sharding::Mesh;
use ferrotext_train::TrainConfig;

/// Payload bytes one host sends to other hosts for `event` (of device 0), on `mesh` with
/// `local` devices per process; averaged over hosts where they differ (broadcast).
///
/// Per host, for a group of `n` devices spread over `P` processes with `m` each and a buffer of
/// `N` bytes: all-reduce `2(P−1)/P·N` (flat with `m = 1`; hierarchical with `m > 1`: `m` cross
/// all-reduces of `N/m`), reduce-scatter and all-gather `(P−1)/P·N`, all-to-all `m(n−m)/n·N`,
/// broadcast `(n−m)·N/P`, barrier 0.
pub fn host_bytes(event: &TraceEvent, mesh: &Mesh, local: usize) -> f64 {
    let Ok(group) = mesh.group_of(0, &event.axes) else {
        return 0.0;
    };
    let local = local.max(1);
    let n = group.len();
    let m = group.iter().filter(|&&d| d / local == 0).count().max(1);
    let p = (n / m).max(1) as f64;
    let (n, m, bytes) = (n as f64, m as f64, event.bytes as f64);
    if p <= 1.0 {
        return 0.0;
    }
    match event.kind {
        // A ring over the processes (the hierarchical form's cross-process part).
        CollectiveKind::AllReduce | CollectiveKind::ReduceScatter | CollectiveKind::AllGather => {
            event.kind.ring_bytes(p, bytes)
        }
        // Not a ring: each host's devices send every other host's share directly.
        CollectiveKind::AllToAll => m * (n - m) / n * bytes,
        CollectiveKind::Broadcast => (n - m) * bytes / p,
        _ => 0.0,
    }
}

/// Payload bytes per host per step the trace of one step predicts.
pub fn per_host_per_step(trace: &Trace, mesh: &Mesh, local: usize) -> f64 {
    trace
        .events()
        .iter()
        .map(|e| host_bytes(e, mesh, local))
        .sum()
}

/// Plans one step of `config` (abstract mode) and returns its per-host prediction, the trace's
/// all-reduce count, and whether the deferral gate opened.
///
/// # Errors
/// The config or the plan fails (a type error).
pub fn plan(config: &TrainConfig) -> Result<Prediction> {
    let plan = config.plan()?;
    let mesh = plan.mesh().clone();
    let source: Arc<dyn ferrotext_train::data::TokenSource> = Arc::from(
        ferrotext_train::data::source_for(config, plan.decoder().config().vocab_size)?,
    );
    let (gate, trace) = ferrotext_train::plan_step(&plan, source)?;
    let collectives = trace.events().len();
    Ok(Prediction {
        bytes_per_host_per_step: per_host_per_step(&trace, &mesh, config.local_devices),
        collectives_per_step: collectives,
        deferred: gate.is_open(),
    })
}

/// The trace's prediction for one step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Prediction {
    /// Payload bytes one host sends to the others per step.
    pub bytes_per_host_per_step: f64,
    /// Collectives device 0 issues per step.
    pub collectives_per_step: usize,
    /// Whether the gradient reduction is deferred to once per step.
    pub deferred: bool,
}
