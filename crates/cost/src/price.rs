//! Pricing a planned step: each collective of the abstract trace at the α–β ring cost of its
//! levels (see the crate docs for the model), compute from the model's FLOPs and a throughput,
//! the exposed part of overlapped reductions, the optimizer's memory stream; summed into a
//! [`Prediction`] for the config as given and with the gate closed.

use std::sync::Arc;

use ferrotext_comm::{CollectiveKind, PhasePattern, Trace, TraceEvent};
use ferrotext_sharding::Mesh;
use ferrotext_train::{plan_step, DeviceMemory, ShardMode, TrainConfig};

use crate::CostError;
use serde::Serialize;

use crate::cluster::{ClusterSpec, Link};

/// The share of a micro-batch's compute that is its backward pass (2 of the 3 matmuls per
/// weight), the window an overlapped gradient reduction can hide in.
pub const BACKWARD_SHARE: f64 = 2.0 / 3.0;

/// The α–β ring cost, in seconds, of one `kind` collective of `bytes` (the trace's full buffer)
/// among `members` devices on one level with link `link`. One member costs nothing.
pub fn level_seconds(kind: CollectiveKind, members: usize, bytes: f64, link: &Link) -> f64 {
    if members <= 1 {
        return 0.0;
    }
    let n = members as f64;
    let (alpha, beta) = (link.latency_seconds, link.bytes_per_second);
    if kind == CollectiveKind::Barrier {
        // No bytes: latency alone.
        return kind.ring_steps(n) * alpha;
    }
    kind.ring_bytes(n, bytes) / beta + kind.ring_steps(n) * alpha
}

/// How a collective's group lies over the hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GroupSpan {
    /// Devices in the group.
    pub members: usize,
    /// Hosts the group touches.
    pub hosts: usize,
    /// The most group members on one host.
    pub per_host: usize,
    /// Every touched host holds the same number of members.
    pub even: bool,
}

impl GroupSpan {
    /// The span of `group` (device ids) when host `p` holds devices `p·L … p·L+L−1`.
    pub fn of(group: &[usize], devices_per_host: usize) -> GroupSpan {
        let l = devices_per_host.max(1);
        let mut per: Vec<(usize, usize)> = Vec::new();
        for &d in group {
            match per.iter_mut().find(|(h, _)| *h == d / l) {
                Some((_, c)) => *c += 1,
                None => per.push((d / l, 1)),
            }
        }
        let most = per.iter().map(|&(_, c)| c).max().unwrap_or(0);
        GroupSpan {
            members: group.len(),
            hosts: per.len(),
            per_host: most,
            even: per.iter().all(|&(_, c)| c == most),
        }
    }
}

/// The cost of one collective: seconds inside hosts and on the host links.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LevelCost {
    /// Seconds of the stages inside a host (over `intra`).
    pub intra_seconds: f64,
    /// Seconds of the stages between hosts (over `link`, shared as the spec says).
    pub link_seconds: f64,
}

impl LevelCost {
    /// Both levels, one after the other.
    pub fn seconds(&self) -> f64 {
        self.intra_seconds + self.link_seconds
    }
}

/// The cost of one `kind` collective of `bytes` over a group spanning `span` on `cluster`, the
/// way the MPI backend runs it (module docs): inside one host over `intra`; hierarchically for
/// all-reduce, reduce-scatter, all-gather and barrier with `m > 1` members on every host; flat
/// over the (shared) link otherwise.
pub fn collective_cost(
    kind: CollectiveKind,
    bytes: f64,
    span: &GroupSpan,
    cluster: &ClusterSpec,
) -> LevelCost {
    let intra = &cluster.intra;
    if span.hosts <= 1 {
        return LevelCost {
            intra_seconds: level_seconds(kind, span.members, bytes, intra),
            link_seconds: 0.0,
        };
    }
    let cross = cluster.cross_link();
    let (h, m) = (span.hosts, span.per_host);
    let hierarchical = m > 1
        && span.even
        && matches!(
            kind,
            CollectiveKind::AllReduce
                | CollectiveKind::ReduceScatter
                | CollectiveKind::AllGather
                | CollectiveKind::Barrier
        );
    if !hierarchical {
        return LevelCost {
            intra_seconds: 0.0,
            link_seconds: level_seconds(kind, span.members, bytes, &cross),
        };
    }
    let inside = |k| level_seconds(k, m, bytes, intra);
    let across = level_seconds(kind, h, bytes / m as f64, &cross);
    let intra_seconds = match kind {
        CollectiveKind::AllReduce | CollectiveKind::Barrier => {
            inside(CollectiveKind::ReduceScatter) + inside(CollectiveKind::AllGather)
        }
        _ => inside(kind),
    };
    LevelCost {
        intra_seconds,
        link_seconds: across,
    }
}

/// Bytes per local gradient element of the pass before the optimizer: dividing by the step's
/// tokens and clipping (read, write, and the norm's read: 3 × 4).
pub const SCALE_AND_CLIP_BYTES_PER_ELEMENT: f64 = 12.0;

/// The collectives of one phase of one kind over one group of axes, priced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CollectiveCost {
    /// The phase label (`micro_batch 0`, `update`, `update/zero1`, `-` outside any phase).
    pub phase: String,
    /// The collective (`all_reduce`, ...).
    pub kind: String,
    /// The mesh axes of its group.
    pub axes: Vec<String>,
    /// How the group lies over the hosts.
    pub span: GroupSpan,
    /// Collectives in this row.
    pub count: usize,
    /// Their bytes as the trace records them (full buffers).
    pub bytes: usize,
    /// Whether they are gradient reductions (all-reduce or reduce-scatter of more than 8
    /// elements over a batch axis), the part overlap can hide. Scalars get rows of their own.
    pub gradient_reduction: bool,
    /// Whether they belong to the step (a micro-batch or the update) and so are counted in it.
    pub in_step: bool,
    /// Milliseconds inside hosts.
    pub intra_ms: f64,
    /// Milliseconds on host links.
    pub link_ms: f64,
    /// Both.
    pub ms: f64,
}

/// One mode's step, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepBreakdown {
    /// The gate's decision in this mode.
    pub deferral: String,
    /// Compute of every micro-batch.
    pub compute_ms: f64,
    /// Collectives of the micro-batches that are not gradient reductions (always exposed).
    pub micro_batch_collectives_ms: f64,
    /// Every gradient reduction of the step (micro-batches and update), before overlap.
    pub gradient_reduction_ms: f64,
    /// The part of it that is not hidden behind a backward.
    pub exposed_reduction_ms: f64,
    /// The update's other collectives (ZeRO-1's parameter all-gather, ...).
    pub update_other_collectives_ms: f64,
    /// The optimizer.
    pub optimizer_ms: f64,
    /// The step: compute + micro-batch collectives + exposed reduction + update collectives +
    /// optimizer.
    pub step_ms: f64,
    /// Gradient all-reduces (over 8 elements) in each micro-batch, in order.
    pub micro_batch_gradient_all_reduces: Vec<usize>,
}

/// What [`predict`] predicts for one step of a config on a cluster.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    /// The model preset.
    pub model: String,
    /// Its parameter count.
    pub parameters: usize,
    /// The mesh (with `local_devices` and `num_processes` from the cluster).
    pub mesh: String,
    /// The cluster.
    pub cluster: ClusterSpec,
    /// Micro-batches per step.
    pub gradient_accumulation_steps: usize,
    /// `overlap_grad_reduce` as the config has it (false when the config has no such key).
    pub overlap_grad_reduce: bool,
    /// The device throughput the compute was priced at, GFLOP/s.
    pub device_gflops: f64,
    /// Where `device_gflops` came from: `given` ([`predict`]'s argument, its value here),
    /// `micro_batch` ([`measure_micro_batch`](crate::measure_micro_batch)) or `gemm`
    /// ([`measure_matmul_gflops`](crate::measure_matmul_gflops)); the
    /// caller that measured says which.
    pub device_gflops_source: String,
    /// Training FLOPs per token, what the backward recomputes included (`remat_policy`,
    /// `num_vocab_tiling`).
    pub flops_per_token: f64,
    /// Of [`Prediction::flops_per_token`], what the backward recomputes.
    pub recompute_flops_per_token: f64,
    /// Tokens of one micro-batch per device (the micro-batch's tokens ÷ devices).
    pub tokens_per_device_per_micro_batch: f64,
    /// Compute of one micro-batch on one device.
    pub compute_ms_per_micro_batch: f64,
    /// The config's collectives (as given: the gate decides), per phase, kind and axes.
    pub collectives: Vec<CollectiveCost>,
    /// The same with the gate closed (`shard_mode=auto`).
    pub per_micro_batch_collectives: Vec<CollectiveCost>,
    /// The config's step.
    pub deferred: StepBreakdown,
    /// The step with the gate closed.
    pub per_micro_batch: StepBreakdown,
    /// `deferred.step_ms`.
    pub deferred_step_ms: f64,
    /// `per_micro_batch.step_ms`.
    pub per_micro_batch_step_ms: f64,
    /// `deferred_step_ms / per_micro_batch_step_ms` (below 1 when deferral pays).
    pub ratio: f64,
    /// `per_micro_batch_step_ms / deferred_step_ms`, the speedup `bench ga` reports.
    pub speedup: f64,
    /// `deferred.exposed_reduction_ms`.
    pub exposed_reduction_ms: f64,
    /// The optimizer's time (equal in both modes).
    pub optimizer_ms: f64,
    /// Peak memory per device.
    pub memory: DeviceMemory,
}

/// Phase label of the optimizer update.
const UPDATE: &str = "update*";
/// Phase labels of the micro-batches.
const MICRO_BATCH: &str = "micro_batch*";
/// Axes over which a reduction is a gradient reduction (the batch axes).
const BATCH_AXES: [&str; 3] = ["data", "fsdp", "expert"];

/// Reductions of at most this many elements are scalars (the loss, the token count, the
/// gradient norm), not gradients: the trace's own probe size.
const SCALAR_ELEMENTS: usize = 8;

fn is_gradient_reduction(e: &TraceEvent) -> bool {
    matches!(
        e.kind,
        CollectiveKind::AllReduce | CollectiveKind::ReduceScatter
    ) && e.elements > SCALAR_ELEMENTS
        && e.axes.iter().any(|a| BATCH_AXES.contains(&a.as_str()))
}

/// `overlap_grad_reduce` when the config has that key (read through serde, so this compiles
/// with and without it), else false.
pub(crate) fn overlap_grad_reduce(config: &TrainConfig) -> bool {
    serde_json::to_value(config)
        .ok()
        .and_then(|v| v.get("overlap_grad_reduce").and_then(|b| b.as_bool()))
        .unwrap_or(false)
}

/// The config laid out on the cluster: `num_processes = hosts`, `local_devices =
/// devices_per_host`.
///
/// # Errors
/// [`CostError::NotOnCluster`] when the mesh's axes do not form `hosts × devices_per_host`
/// devices, or any other value is invalid there.
pub fn config_on(config: &TrainConfig, cluster: &ClusterSpec) -> Result<TrainConfig, CostError> {
    let mut on = config.clone();
    on.num_processes = cluster.hosts;
    on.local_devices = cluster.devices_per_host;
    on.validate().map_err(|e| CostError::NotOnCluster {
        hosts: cluster.hosts,
        devices_per_host: cluster.devices_per_host,
        devices: cluster.devices(),
        error: Box::new(e),
    })?;
    Ok(on)
}

/// Prices every event of `trace` on `cluster` (group of device 0, whose trace it is), one row per
/// (phase, kind, axes) in order of first appearance.
///
/// # Errors
/// An axis the mesh does not have.
pub fn price_trace(
    trace: &Trace,
    mesh: &Mesh,
    cluster: &ClusterSpec,
) -> Result<Vec<CollectiveCost>, CostError> {
    let step = [PhasePattern::new(MICRO_BATCH), PhasePattern::new(UPDATE)];
    let mut rows: Vec<CollectiveCost> = Vec::new();
    for e in trace.events() {
        let group = mesh.group_of(0, &e.axes)?;
        let span = GroupSpan::of(&group, cluster.devices_per_host);
        let cost = collective_cost(e.kind, e.bytes as f64, &span, cluster);
        let phase = if e.phase.is_empty() {
            "-".to_string()
        } else {
            e.phase.clone()
        };
        let gradient = is_gradient_reduction(e);
        let row = match rows.iter_mut().find(|r| {
            r.phase == phase
                && r.kind == e.kind.name()
                && r.axes == e.axes
                && r.gradient_reduction == gradient
        }) {
            Some(r) => r,
            None => {
                rows.push(CollectiveCost {
                    in_step: step.iter().any(|p| p.matches(&e.phase)),
                    phase,
                    kind: e.kind.name().into(),
                    axes: e.axes.clone(),
                    span,
                    count: 0,
                    bytes: 0,
                    gradient_reduction: gradient,
                    intra_ms: 0.0,
                    link_ms: 0.0,
                    ms: 0.0,
                });
                let last = rows.len() - 1;
                &mut rows[last]
            }
        };
        row.count += 1;
        row.bytes += e.bytes;
        row.intra_ms += cost.intra_seconds * 1e3;
        row.link_ms += cost.link_seconds * 1e3;
        row.ms += cost.seconds() * 1e3;
    }
    Ok(rows)
}

/// The part of gradient reductions `(bytes, ms)`, in issue order, that runs past a backward of
/// `window` ms they overlap: each starts once the backward has finished its share of their bytes
/// (at a steady rate, so the last one at the window's end) and after the one before it. With no
/// window, all of them.
pub fn exposed_after_backward(reductions: &[(f64, f64)], window: f64) -> f64 {
    let total: f64 = reductions.iter().map(|r| r.0).sum();
    let (mut finished, mut bytes) = (0.0f64, 0.0);
    for &(b, ms) in reductions {
        bytes += b;
        let ready = if total > 0.0 {
            window * bytes / total
        } else {
            window
        };
        finished = finished.max(ready) + ms;
    }
    (finished - window).max(0.0)
}

/// Every gradient reduction of `trace` priced on `cluster`: `(phase, bytes, ms)` in issue order.
///
/// # Errors
/// An axis the mesh does not have.
pub(crate) fn priced_reductions(
    trace: &Trace,
    mesh: &Mesh,
    cluster: &ClusterSpec,
) -> Result<Vec<(String, f64, f64)>, CostError> {
    let mut out = Vec::new();
    for e in trace.events().iter().filter(|e| is_gradient_reduction(e)) {
        let group = mesh.group_of(0, &e.axes)?;
        let span = GroupSpan::of(&group, cluster.devices_per_host);
        let cost = collective_cost(e.kind, e.bytes as f64, &span, cluster);
        out.push((e.phase.clone(), e.bytes as f64, cost.seconds() * 1e3));
    }
    Ok(out)
}

/// One mode's step from its priced collectives (module docs: overlap, optimizer);
/// `reductions` are [`priced_reductions`] of `trace`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step_breakdown(
    rows: &[CollectiveCost],
    reductions: &[(String, f64, f64)],
    trace: &Trace,
    ga: usize,
    compute_ms: f64,
    overlap: bool,
    optimizer_ms: f64,
    deferral: String,
) -> StepBreakdown {
    let update = PhasePattern::new(UPDATE);
    let window = if overlap {
        BACKWARD_SHARE * compute_ms
    } else {
        0.0
    };
    // Folded from +0.0: an empty f64 `sum()` is −0.0.
    let update_reduction = rows
        .iter()
        .filter(|r| update.matches(&r.phase) && r.gradient_reduction)
        .fold(0.0, |t, r| t + r.ms);
    let update_other = rows
        .iter()
        .filter(|r| update.matches(&r.phase) && !r.gradient_reduction)
        .fold(0.0, |t, r| t + r.ms);
    let in_update: Vec<(f64, f64)> = reductions
        .iter()
        .filter(|r| update.matches(&r.0))
        .map(|r| (r.1, r.2))
        .collect();
    let (mut other, mut reduction, mut exposed) = (0.0, update_reduction, 0.0);
    let mut counts = Vec::with_capacity(ga);
    for i in 0..ga {
        let label = format!("micro_batch {i}");
        let in_phase = |phase: &str| {
            phase == label
                || phase
                    .strip_prefix(label.as_str())
                    .is_some_and(|r| r.starts_with('/'))
        };
        let here = rows.iter().filter(|r| in_phase(&r.phase));
        let (g, o) = here.fold((0.0, 0.0), |(g, o), r| {
            if r.gradient_reduction {
                (g + r.ms, o)
            } else {
                (g, o + r.ms)
            }
        });
        other += o;
        reduction += g;
        // The last backward also hides the update's reduction.
        let mut overlapped: Vec<(f64, f64)> = reductions
            .iter()
            .filter(|r| in_phase(&r.0))
            .map(|r| (r.1, r.2))
            .collect();
        if i + 1 == ga {
            overlapped.extend(in_update.iter().copied());
        }
        exposed += exposed_after_backward(&overlapped, window);
        counts.push(
            trace
                .all_reduces_larger_than(SCALAR_ELEMENTS, &PhasePattern::any())
                .iter()
                .filter(|e| in_phase(&e.phase) && is_gradient_reduction(e))
                .count(),
        );
    }
    let compute = compute_ms * ga as f64;
    StepBreakdown {
        deferral,
        compute_ms: compute,
        micro_batch_collectives_ms: other,
        gradient_reduction_ms: reduction,
        exposed_reduction_ms: exposed,
        update_other_collectives_ms: update_other,
        optimizer_ms,
        step_ms: compute + other + exposed + update_other + optimizer_ms,
        micro_batch_gradient_all_reduces: counts,
    }
}

/// Predicts one optimizer step of `config` on `cluster` with devices of `device_gflops` GFLOP/s:
/// plans the step twice in abstract mode (as configured, and with the gate closed by
/// `shard_mode=auto`), prices every collective, and adds compute, overlap and the optimizer (module
/// docs). The prediction's collective bytes are the traces' bytes, row for row.
///
/// # Errors
/// [`CostError::BadThroughput`] for a non-positive or non-finite `device_gflops`,
/// [`CostError::NotOnCluster`] for a mesh that does not form `hosts × devices_per_host` devices
/// or an invalid config; a type error from planning.
pub fn predict(
    config: &TrainConfig,
    cluster: &ClusterSpec,
    device_gflops: f64,
) -> Result<Prediction, CostError> {
    if !(device_gflops.is_finite() && device_gflops > 0.0) {
        return Err(CostError::BadThroughput {
            gflops: device_gflops,
        });
    }
    let config = config_on(config, cluster)?;
    let mut closed = config.clone();
    closed.shard_mode = ShardMode::Auto;
    let (plan, closed_plan) = (config.plan()?, closed.plan()?);
    let model = plan.decoder();
    let source: Arc<dyn ferrotext_train::data::TokenSource> = Arc::from(
        ferrotext_train::data::source_for(&config, model.config().vocab_size)?,
    );
    let mesh = plan.mesh().clone();
    let (gate, trace) = plan_step(&plan, source.clone())?;
    let (closed_gate, closed_trace) = plan_step(&closed_plan, source)?;

    let ga = config.gradient_accumulation_steps;
    // The model's FLOPs, and what rematerialization and vocabulary tiling compute again.
    let recompute_flops_per_token = model.recompute_flops_per_token(config.max_target_length);
    let flops_per_token =
        model.flops_per_token(config.max_target_length) + recompute_flops_per_token;
    let tokens =
        (config.micro_batch_rows() * config.max_target_length) as f64 / config.devices() as f64;
    let compute_ms = flops_per_token * tokens / (device_gflops * 1e9) * 1e3;

    let memory = plan.memory_per_device()?;
    let optimizer_ms = (memory.optimizer_stepped_elements
        * config.opt_type.step_bytes_per_element() as f64
        + memory.local_parameter_elements * SCALE_AND_CLIP_BYTES_PER_ELEMENT)
        / cluster.memory_bytes_per_second
        * 1e3;
    let overlap = overlap_grad_reduce(&config);

    let rows = price_trace(&trace, &mesh, cluster)?;
    let closed_rows = price_trace(&closed_trace, &mesh, cluster)?;
    let deferred = step_breakdown(
        &rows,
        &priced_reductions(&trace, &mesh, cluster)?,
        &trace,
        ga,
        compute_ms,
        overlap,
        optimizer_ms,
        gate.describe(),
    );
    let per_micro_batch = step_breakdown(
        &closed_rows,
        &priced_reductions(&closed_trace, &mesh, cluster)?,
        &closed_trace,
        ga,
        compute_ms,
        overlap,
        optimizer_ms,
        closed_gate.describe(),
    );
    let (d, p) = (deferred.step_ms, per_micro_batch.step_ms);
    Ok(Prediction {
        model: config.model_name.clone(),
        parameters: model.param_count(),
        mesh: mesh.to_string(),
        cluster: cluster.clone(),
        gradient_accumulation_steps: ga,
        overlap_grad_reduce: overlap,
        device_gflops,
        device_gflops_source: "given".into(),
        flops_per_token,
        recompute_flops_per_token,
        tokens_per_device_per_micro_batch: tokens,
        compute_ms_per_micro_batch: compute_ms,
        collectives: rows,
        per_micro_batch_collectives: closed_rows,
        exposed_reduction_ms: deferred.exposed_reduction_ms,
        deferred,
        per_micro_batch,
        deferred_step_ms: d,
        per_micro_batch_step_ms: p,
        ratio: d / p,
        speedup: p / d,
        optimizer_ms,
        memory,
    })
}
