//! The cost model behind `ferrotext plan --cluster`: a predicted optimizer step on a cluster
//! nobody here has (docs/design.md §3 "Cost model", §9).
//!
//! One step of the config is planned twice in abstract mode — as given (the deferral gate
//! decides) and with `shard_mode=auto` (the gate closed: gradients all-reduced in every
//! micro-batch) — and each recorded collective is priced; compute comes from the model's FLOPs
//! and a device throughput the caller gives: a number, or one measured here, either from a
//! forward + backward micro-batch of the planned model on one device ([`measure_micro_batch`],
//! the calibrated default of `plan --cluster`) or from a square matmul
//! ([`measure_matmul_gflops`], a kernel's peak, which the model's other work makes 1.3–3×
//! optimistic).
//!
//! # The model
//! * **Compute** per micro-batch: `flops_per_token × micro-batch tokens ÷ devices` (each device's
//!   share of the training FLOPs) ÷ the device's throughput.
//! * **A collective** is priced per level of the hierarchy with the α–β ring costs of
//!   [`level_seconds`]: `n` members, `B` bytes (the trace's full buffer), link latency `α` and
//!   bandwidth `β`: all-reduce `2(n−1)/n·B/β + 2(n−1)α`; reduce-scatter and all-gather
//!   `(n−1)/n·B/β + (n−1)α`; all-to-all `(n−1)/n·B/β + (n−1)α`; broadcast `B/β + α`; barrier
//!   `2(n−1)α`. A group inside one host is priced over `intra` only. A group whose devices span
//!   `h` hosts with `m > 1` of them in each runs hierarchically, as the MPI backend does:
//!   reduce-scatter inside the host over `intra` (`m` members, `B`), the cross-host collective
//!   over `link` (`h` members, `B/m`), all-gather inside the host. With one member per host (or an
//!   uneven spread, or an all-to-all or broadcast, which the backend never splits) it runs flat
//!   over `link`.
//! * **The host link is shared**: with [`LinkShare::Host`] (the default, and what the emulated
//!   cluster shapes with `tc`), every device of a host issues the same collective at the same
//!   time, so the host's `L` devices share one link and each cross-host stage sees `β/L`. With
//!   [`LinkShare::Device`] each device has a link of its own.
//! * **Overlap** (`overlap_grad_reduce=true` in the config, when the config knows that key): a
//!   micro-batch's gradient reductions (all-reduces and reduce-scatters of more than 8 elements
//!   over a batch axis: `data`, `fsdp` or `expert`) hide behind its backward, taken as
//!   [`BACKWARD_SHARE`] of its compute; the step's update reduction hides behind the last
//!   micro-batch's backward. The reductions run one after another in the trace's order, each
//!   starting once the backward has finished its share of their bytes (gradients are finished
//!   at a steady rate, bucket by bucket, the last bucket — the embedding's — at the backward's
//!   end) and its predecessor is done; exposed is what runs past the backward
//!   ([`exposed_after_backward`]: `max(0, a − b)` for many small buckets, all of `a` for one).
//!   Without overlap everything is exposed.
//! * **The optimizer** streams the device's parameters, gradients and optimizer state once
//!   through memory: [`optimizer_bytes_per_element`] bytes per element of the slice it steps
//!   (plus the scale-and-clip pass over the whole local gradient) over
//!   [`ClusterSpec::memory_bytes_per_second`].
//! * **A step** is `Σ_micro-batches (compute + their other collectives + exposed reduction) +
//!   the update's other collectives + the optimizer`. Collectives outside the step (set-up) are
//!   listed but not counted.
//! * **Memory** per device: [`crate::RunPlan::memory_per_device`].

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use ferrotext_comm::{CollectiveKind, PhasePattern, Trace, TraceEvent};
use ferrotext_sharding::Mesh;
use serde::Serialize;

use crate::config::{DeviceMemory, OptType, ShardMode, TrainConfig};
use crate::error::TrainError;
use crate::trainer::plan_step;

/// The share of a micro-batch's compute that is its backward pass (2 of the 3 matmuls per
/// weight), the window an overlapped gradient reduction can hide in.
pub const BACKWARD_SHARE: f64 = 2.0 / 3.0;

/// `intra` when `--cluster` does not give it: 200 Gbit/s, 1 µs (an NVLink-class link between
/// devices of one host).
pub const DEFAULT_INTRA: Link = Link {
    bytes_per_second: 200e9 / 8.0,
    latency_seconds: 1e-6,
};

/// Memory bandwidth of a device when `--cluster` does not give `mem`: 20 GB/s (a CPU device's
/// share of a host's memory bandwidth, about this machine's single-thread memcpy).
pub const DEFAULT_MEMORY_BYTES_PER_SECOND: f64 = 20e9;

/// One level's link: bandwidth and latency (α–β). Both are finite; the bandwidth is positive and
/// the latency is not negative.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Link {
    /// β, bytes per second.
    pub bytes_per_second: f64,
    /// α, seconds per message.
    pub latency_seconds: f64,
}

/// Who shares a host's `link`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkShare {
    /// One link per host, shared by its devices (the emulated cluster; `link_per=host`).
    Host,
    /// One link per device (a NIC per GPU; `link_per=device`).
    Device,
}

/// The cluster of a prediction, parsed from `hosts=H,devices_per_host=L,link=25gbit,10us[,
/// intra=200gbit,1us][,mem=20GB/s][,link_per=host|device]`. A parsed spec always has `hosts ≥ 1`,
/// `devices_per_host ≥ 1`, positive finite rates and a `link` when `hosts > 1`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterSpec {
    /// Hosts (processes of the job).
    pub hosts: usize,
    /// Devices of each host.
    pub devices_per_host: usize,
    /// The link between hosts (`None` only for one host).
    pub link: Option<Link>,
    /// The link between devices of one host.
    pub intra: Link,
    /// Whether `link` is per host or per device.
    pub link_per: LinkShare,
    /// A device's memory bandwidth, bytes per second (prices the optimizer).
    pub memory_bytes_per_second: f64,
}

/// Why a `--cluster` string does not parse; each names the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterSpecError {
    /// A key the cluster spec does not have.
    #[error("--cluster: unknown key `{key}` (known: hosts, devices_per_host, link, intra, mem, link_per)")]
    UnknownKey {
        /// The key as given.
        key: String,
    },
    /// A required key is missing.
    #[error("--cluster: missing `{key}`{why}")]
    MissingKey {
        /// The key.
        key: String,
        /// Why it is needed (may be empty).
        why: String,
    },
    /// A key given twice.
    #[error("--cluster: `{key}` given twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// A value that does not parse or is out of range.
    #[error("--cluster: {key}=`{value}`: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// A part that is not `key=value` and does not continue a link value.
    #[error("--cluster: `{part}` is not key=value")]
    Syntax {
        /// The part as given.
        part: String,
    },
}

const KEYS: [&str; 6] = [
    "hosts",
    "devices_per_host",
    "link",
    "intra",
    "mem",
    "link_per",
];

impl FromStr for ClusterSpec {
    type Err = ClusterSpecError;

    /// Parses `key=value` parts separated by commas; a `link` or `intra` value is a rate with an
    /// optional latency after a comma (`25gbit,10us`). Rates: `bit`, `kbit`, `mbit`, `gbit`,
    /// `tbit` (decimal, any case) or `B/s`, `kB/s`, `MB/s`, `GB/s`, `TB/s`, `KiB/s`, `MiB/s`,
    /// `GiB/s`; latencies: `ns`, `us`, `µs`, `ms`, `s` (a bare `0` too; absent: 0).
    fn from_str(text: &str) -> Result<ClusterSpec, ClusterSpecError> {
        let mut given: Vec<(String, String)> = Vec::new();
        for part in text.split(',').map(str::trim) {
            match part.split_once('=') {
                Some((key, value)) => {
                    let key = key.trim();
                    if !KEYS.contains(&key) {
                        return Err(ClusterSpecError::UnknownKey { key: key.into() });
                    }
                    if given.iter().any(|(k, _)| k == key) {
                        return Err(ClusterSpecError::DuplicateKey { key: key.into() });
                    }
                    given.push((key.into(), value.trim().into()));
                }
                None => match given.last_mut() {
                    // `link=25gbit,10us`: the latency continues the previous link value.
                    Some((key, value))
                        if (key == "link" || key == "intra")
                            && !value.contains(',')
                            && !part.is_empty() =>
                    {
                        value.push(',');
                        value.push_str(part);
                    }
                    _ => return Err(ClusterSpecError::Syntax { part: part.into() }),
                },
            }
        }
        let get = |key: &str| {
            given
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let count = |key: &str| -> Result<usize, ClusterSpecError> {
            let value = get(key).ok_or_else(|| ClusterSpecError::MissingKey {
                key: key.into(),
                why: String::new(),
            })?;
            match value.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(bad(key, value, "must be a whole number ≥ 1")),
            }
        };
        let hosts = count("hosts")?;
        let devices_per_host = count("devices_per_host")?;
        let link = get("link").map(|v| parse_link("link", v)).transpose()?;
        if hosts > 1 && link.is_none() {
            return Err(ClusterSpecError::MissingKey {
                key: "link".into(),
                why: format!(" (hosts = {hosts}: the link between hosts, e.g. link=25gbit,10us)"),
            });
        }
        let intra = match get("intra") {
            Some(v) => parse_link("intra", v)?,
            None => DEFAULT_INTRA,
        };
        let memory_bytes_per_second = match get("mem") {
            Some(v) => parse_rate("mem", v)?,
            None => DEFAULT_MEMORY_BYTES_PER_SECOND,
        };
        let link_per = match get("link_per") {
            None | Some("host") => LinkShare::Host,
            Some("device") => LinkShare::Device,
            Some(other) => return Err(bad("link_per", other, "must be `host` or `device`")),
        };
        Ok(ClusterSpec {
            hosts,
            devices_per_host,
            link,
            intra,
            link_per,
            memory_bytes_per_second,
        })
    }
}

fn bad(key: &str, value: &str, reason: &str) -> ClusterSpecError {
    ClusterSpecError::BadValue {
        key: key.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

/// `25gbit,10us` → a [`Link`].
fn parse_link(key: &str, value: &str) -> Result<Link, ClusterSpecError> {
    let (rate, latency) = match value.split_once(',') {
        Some((r, l)) => (r.trim(), Some(l.trim())),
        None => (value.trim(), None),
    };
    let bytes_per_second = parse_rate(key, rate)?;
    let latency_seconds = match latency {
        Some(l) => parse_latency(key, l)?,
        None => 0.0,
    };
    Ok(Link {
        bytes_per_second,
        latency_seconds,
    })
}

/// Splits `25gbit` into (25, "gbit").
fn number_and_unit(text: &str) -> (&str, &str) {
    let end = text
        .find(|c: char| {
            !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+')
        })
        .unwrap_or(text.len());
    // An exponent sign only counts after an `e`; `1e9bit` parses, `gbit` alone does not.
    (&text[..end], &text[end..])
}

/// A rate in bytes per second; finite and positive.
fn parse_rate(key: &str, text: &str) -> Result<f64, ClusterSpecError> {
    let (number, unit) = number_and_unit(text);
    let value: f64 = number.parse().map_err(|_| {
        bad(
            key,
            text,
            "the rate must be a number with a unit, e.g. 25gbit or 12.5GB/s",
        )
    })?;
    let bits = match unit.to_ascii_lowercase().as_str() {
        "bit" => Some(1.0),
        "kbit" => Some(1e3),
        "mbit" => Some(1e6),
        "gbit" => Some(1e9),
        "tbit" => Some(1e12),
        _ => None,
    };
    let scale = match (bits, unit) {
        (Some(b), _) => b / 8.0,
        (None, "B/s") => 1.0,
        (None, "kB/s" | "KB/s") => 1e3,
        (None, "MB/s") => 1e6,
        (None, "GB/s") => 1e9,
        (None, "TB/s") => 1e12,
        (None, "KiB/s") => 1024.0,
        (None, "MiB/s") => 1024.0 * 1024.0,
        (None, "GiB/s") => 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(bad(
                key,
                text,
                "unknown rate unit (bit, kbit, mbit, gbit, tbit; B/s, kB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s)",
            ))
        }
    };
    let rate = value * scale;
    if !(rate.is_finite() && rate > 0.0) {
        return Err(bad(key, text, "the rate must be positive and finite"));
    }
    Ok(rate)
}

/// A latency in seconds; finite and not negative.
fn parse_latency(key: &str, text: &str) -> Result<f64, ClusterSpecError> {
    let (number, unit) = number_and_unit(text);
    let value: f64 = number.parse().map_err(|_| {
        bad(
            key,
            text,
            "the latency must be a number with a unit, e.g. 10us",
        )
    })?;
    let per_second = match unit {
        "ns" => 1e9,
        "us" | "µs" => 1e6,
        "ms" => 1e3,
        "s" => 1.0,
        "" if value == 0.0 => 1.0,
        _ => return Err(bad(key, text, "unknown latency unit (ns, us, ms, s)")),
    };
    let latency = value / per_second;
    if !(latency.is_finite() && latency >= 0.0) {
        return Err(bad(
            key,
            text,
            "the latency must be finite and not negative",
        ));
    }
    Ok(latency)
}

impl ClusterSpec {
    /// Devices of the cluster: `hosts × devices_per_host`.
    pub fn devices(&self) -> usize {
        self.hosts.saturating_mul(self.devices_per_host)
    }

    /// The bandwidth one device's cross-host stage sees: the link's, divided by the host's
    /// devices when they share it ([`LinkShare::Host`]).
    fn cross_link(&self) -> Link {
        let link = self.link.unwrap_or(self.intra);
        let share = match self.link_per {
            LinkShare::Host => self.devices_per_host as f64,
            LinkShare::Device => 1.0,
        };
        Link {
            bytes_per_second: link.bytes_per_second / share,
            latency_seconds: link.latency_seconds,
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.3} Gbit/s, {:.1} µs",
            self.bytes_per_second * 8.0 / 1e9,
            self.latency_seconds * 1e6
        )
    }
}

/// The α–β ring cost, in seconds, of one `kind` collective of `bytes` (the trace's full buffer)
/// among `members` devices on one level with link `link`. One member costs nothing.
pub fn level_seconds(kind: CollectiveKind, members: usize, bytes: f64, link: &Link) -> f64 {
    if members <= 1 {
        return 0.0;
    }
    let n = members as f64;
    let (alpha, beta) = (link.latency_seconds, link.bytes_per_second);
    match kind {
        CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n * bytes / beta + 2.0 * (n - 1.0) * alpha,
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather | CollectiveKind::AllToAll => {
            (n - 1.0) / n * bytes / beta + (n - 1.0) * alpha
        }
        CollectiveKind::Broadcast => bytes / beta + alpha,
        CollectiveKind::Barrier => 2.0 * (n - 1.0) * alpha,
    }
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

/// Bytes the optimizer streams through memory per element it steps: AdamW reads the parameter,
/// gradient and both moments and writes the parameter and moments (7 × 4 bytes); SGD reads the
/// parameter and gradient and writes the parameter (3 × 4).
pub fn optimizer_bytes_per_element(opt: OptType) -> f64 {
    match opt {
        OptType::Adamw => 28.0,
        OptType::Sgd => 12.0,
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
    /// `micro_batch` ([`measure_micro_batch`]) or `gemm` ([`measure_matmul_gflops`]); the
    /// caller that measured says which.
    pub device_gflops_source: String,
    /// Training FLOPs per token.
    pub flops_per_token: f64,
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
fn overlap_grad_reduce(config: &TrainConfig) -> bool {
    serde_json::to_value(config)
        .ok()
        .and_then(|v| v.get("overlap_grad_reduce").and_then(|b| b.as_bool()))
        .unwrap_or(false)
}

/// The config laid out on the cluster: `num_processes = hosts`, `local_devices =
/// devices_per_host`.
///
/// # Errors
/// [`TrainError::Config`] when the mesh's axes do not form `hosts × devices_per_host` devices,
/// or any other invalid value.
pub fn config_on(config: &TrainConfig, cluster: &ClusterSpec) -> Result<TrainConfig, TrainError> {
    let mut on = config.clone();
    on.num_processes = cluster.hosts;
    on.local_devices = cluster.devices_per_host;
    on.validate().map_err(|e| {
        TrainError::Config(format!(
            "on --cluster hosts={},devices_per_host={} ({} devices): {e}",
            cluster.hosts,
            cluster.devices_per_host,
            cluster.devices()
        ))
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
) -> Result<Vec<CollectiveCost>, TrainError> {
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
fn priced_reductions(
    trace: &Trace,
    mesh: &Mesh,
    cluster: &ClusterSpec,
) -> Result<Vec<(String, f64, f64)>, TrainError> {
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
fn step_breakdown(
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
/// [`TrainError::Config`] for a non-positive or non-finite `device_gflops`, a mesh that does not
/// form `hosts × devices_per_host` devices, or an invalid config; a type error from planning.
pub fn predict(
    config: &TrainConfig,
    cluster: &ClusterSpec,
    device_gflops: f64,
) -> Result<Prediction, TrainError> {
    if !(device_gflops.is_finite() && device_gflops > 0.0) {
        return Err(TrainError::Config(format!(
            "the device throughput must be positive and finite, got {device_gflops} GFLOP/s"
        )));
    }
    let config = config_on(config, cluster)?;
    let mut closed = config.clone();
    closed.shard_mode = ShardMode::Auto;
    let (plan, closed_plan) = (config.plan()?, closed.plan()?);
    let model = plan.decoder();
    let source: Arc<dyn crate::data::TokenSource> =
        Arc::from(crate::data::source_for(&config, model.config().vocab_size)?);
    let mesh = plan.mesh().clone();
    let (gate, trace) = plan_step(&plan, source.clone())?;
    let (closed_gate, closed_trace) = plan_step(&closed_plan, source)?;

    let ga = config.gradient_accumulation_steps;
    let flops_per_token = model.flops_per_token(config.max_target_length);
    let tokens =
        (config.micro_batch_rows() * config.max_target_length) as f64 / config.devices() as f64;
    let compute_ms = flops_per_token * tokens / (device_gflops * 1e9) * 1e3;

    let memory = plan.memory_per_device()?;
    let optimizer_ms = (memory.optimizer_stepped_elements
        * optimizer_bytes_per_element(config.opt_type)
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

/// Times a square f32 matmul of `n` on `threads` threads (the `gemm` crate through
/// `dot_general`), best of 5, in GFLOP/s. A measurement of this machine, not a constant.
///
/// # Errors
/// A kernel error (none for valid sizes).
pub fn measure_matmul_gflops(n: usize, threads: usize) -> Result<f64, TrainError> {
    let n = n.max(16);
    let a = ferrotext_tensor::Tensor::full(&[n, n], 0.5);
    let dims = ferrotext_tensor::DotDims::matmul(2);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let out = ferrotext_tensor::dot_general(&a, &a, &dims, threads.max(1))
            .map_err(|e| TrainError::Config(e.to_string()))?;
        best = best.min(t.elapsed().as_secs_f64());
        drop(out);
    }
    Ok(2.0 * (n as f64).powi(3) / best.max(1e-9) / 1e9)
}

/// How `devices` devices would share this machine's cores (docs/design.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ThreadBudget {
    /// Kernel threads of one device: `cores / devices`, at least 1.
    pub threads: usize,
    /// Devices that run at once when the cores are full: all of them, or `cores / threads`
    /// when they outnumber the cores. A measurement runs this many side by side, so it sees
    /// what the cores do when they are all busy (shared execution units, memory bandwidth).
    pub concurrent: usize,
    /// The share of its threads each device gets: `concurrent / devices`, at most 1: the factor
    /// a throughput measured with `concurrent` devices is scaled by.
    pub share: f64,
}

/// The [`ThreadBudget`] of one of `devices` devices sharing `cores` cores.
pub fn device_thread_budget(cores: usize, devices: usize) -> ThreadBudget {
    let (cores, devices) = (cores.max(1), devices.max(1));
    let threads = (cores / devices).max(1);
    let concurrent = devices.min((cores / threads).max(1));
    ThreadBudget {
        threads,
        concurrent,
        share: (concurrent as f64 / devices as f64).min(1.0),
    }
}

/// The effective throughput, in GFLOP/s, of a micro-batch of `tokens` tokens at
/// `flops_per_token` training FLOPs each that took `seconds`.
///
/// # Errors
/// [`TrainError::Config`] when the result is not positive and finite (no tokens, no time).
pub fn effective_gflops(
    flops_per_token: f64,
    tokens: f64,
    seconds: f64,
) -> Result<f64, TrainError> {
    let gflops = flops_per_token * tokens / seconds / 1e9;
    if gflops.is_finite() && gflops > 0.0 {
        Ok(gflops)
    } else {
        Err(TrainError::Config(format!(
            "no effective throughput from {tokens} tokens × {flops_per_token} FLOP in {seconds} s"
        )))
    }
}

/// A measured forward + backward micro-batch of a config's model on one device of this machine,
/// with as many devices running side by side as would share its cores: the calibration
/// `plan --cluster` prices compute with by default.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MicroBatchMeasurement {
    /// Threads each device ran its kernels on.
    pub threads: usize,
    /// Devices measured side by side, each on its own micro-batches.
    pub concurrent: usize,
    /// Tokens of one device's micro-batch (the config's per-device batch × sequence length).
    pub tokens: usize,
    /// Training FLOPs per token of the model.
    pub flops_per_token: f64,
    /// Micro-batches each device ran before timing (first-touch allocations, caches).
    pub warmup: usize,
    /// Micro-batches each device timed.
    pub timed: usize,
    /// The median time of one timed micro-batch over all devices, seconds.
    pub seconds: f64,
    /// `flops_per_token × tokens ÷ seconds`, GFLOP/s ([`effective_gflops`]).
    pub gflops: f64,
}

/// `config` on one device of one process: every mesh axis 1, no ZeRO-1, synthetic tokens, and
/// the per-device batch rounded to whole sequences (at least one). The model and sequence length
/// are the config's, so a micro-batch costs what one device's share costs on the cluster when
/// the batch is split over `data`.
///
/// # Errors
/// [`TrainError::Config`] / [`TrainError::Usage`] when the result does not validate.
pub fn one_device_config(config: &TrainConfig) -> Result<TrainConfig, TrainError> {
    let mut one = config.clone();
    one.local_devices = 1;
    one.num_processes = 1;
    one.ici_data_parallelism = 1;
    one.ici_fsdp_parallelism = 1;
    one.ici_tensor_parallelism = 1;
    one.ici_expert_parallelism = 1;
    one.shard_optimizer_over_data = false;
    one.dataset_type = crate::config::DatasetType::Synthetic;
    one.per_device_batch_size = config.per_device_batch_size.round().max(1.0);
    one.validate()?;
    Ok(one)
}

/// Runs `warmup + timed` forward + backward micro-batches of `config`'s model on each of
/// `concurrent` independent one-device engines ([`one_device_config`]) side by side, each on
/// `threads` kernel threads, starting each micro-batch together (as a mesh's devices do), and
/// times the `timed` ones (median over all). Nothing is reduced or stepped: a micro-batch is
/// the engine's `fwd_bwd` (forward, loss, backward, accumulation), the `c` of the step model
/// (docs/design.md §9).
///
/// # Errors
/// As [`one_device_config`]; an engine error; `timed == 0`.
pub fn measure_micro_batch(
    config: &TrainConfig,
    threads: usize,
    concurrent: usize,
    warmup: usize,
    timed: usize,
) -> Result<MicroBatchMeasurement, TrainError> {
    if timed == 0 {
        return Err(TrainError::Config(
            "measuring a micro-batch needs at least one timed run".into(),
        ));
    }
    let one = one_device_config(config)?;
    let plan = one.plan()?;
    let flops_per_token = plan.decoder().flops_per_token(one.max_target_length);
    let source: Arc<dyn crate::data::TokenSource> = Arc::from(crate::data::source_for(
        &one,
        plan.decoder().config().vocab_size,
    )?);
    let (threads, concurrent) = (threads.max(1), concurrent.max(1));
    let rows = one.micro_batch_rows();
    let together = std::sync::Barrier::new(concurrent);
    let device = |index: usize| -> Result<Vec<f64>, TrainError> {
        let mut comm = ferrotext_comm::Communicator::new(
            0,
            plan.compute_mesh().clone(),
            Box::new(ferrotext_comm::NoTransport),
        );
        let mut cx = ferrotext_spmd::Ctx::new(&mut comm, threads);
        let mut engine = crate::engine::Engine::new(&mut cx, &plan, None);
        let mut times = Vec::with_capacity(timed);
        for micro in 0..warmup + timed {
            let ids = crate::data::micro_batch(
                source.as_ref(),
                index as u64,
                micro,
                warmup + timed,
                rows,
                one.max_target_length,
            );
            // Every device reaches every barrier, even after a failure, so none waits forever.
            together.wait();
            let Ok(e) = engine.as_mut() else {
                continue;
            };
            let started = std::time::Instant::now();
            match e.batch(&cx, &ids).and_then(|b| e.fwd_bwd(&mut cx, &b)) {
                Ok(_) if micro >= warmup => times.push(started.elapsed().as_secs_f64()),
                Ok(_) => {}
                Err(err) => engine = Err(err),
            }
        }
        engine.map(|_| times)
    };
    let runs: Vec<Result<Vec<f64>, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..concurrent)
            .map(|i| {
                let device = &device;
                // Each on its own kernel pool, as a training run's devices are.
                let name = format!("ferrotext-measure-{i}");
                scope.spawn(move || {
                    ferrotext_tensor::with_kernel_pool(threads, &name, 16 << 20, || device(i))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(TrainError::Config(
                        "a device measuring a micro-batch panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut times = Vec::with_capacity(concurrent * timed);
    for run in runs {
        times.extend(run?);
    }
    let seconds = median(&mut times);
    let tokens = rows * one.max_target_length;
    Ok(MicroBatchMeasurement {
        threads,
        concurrent,
        tokens,
        flops_per_token,
        warmup,
        timed,
        seconds,
        gflops: effective_gflops(flops_per_token, tokens as f64, seconds)?,
    })
}

/// Why `concurrent` one-device micro-batches of `config` ([`one_device_config`]) should not be
/// run here: their estimated memory ([`crate::RunPlan::memory_per_device`], times `concurrent`)
/// is more than half of this machine's. `None` when it fits, or when the machine's memory is
/// unknown.
///
/// # Errors
/// As [`one_device_config`].
pub fn too_big_to_measure(
    config: &TrainConfig,
    concurrent: usize,
) -> Result<Option<String>, TrainError> {
    let one = one_device_config(config)?;
    let need = one.plan()?.memory_per_device()?.total_bytes * concurrent.max(1) as f64;
    Ok(crate::config::machine_memory_bytes()
        .filter(|&have| need > have / 2.0)
        .map(|have| {
            format!(
                "{} device(s) side by side would need {} of this machine's {}",
                concurrent.max(1),
                crate::config::gib(need),
                crate::config::gib(have)
            )
        }))
}

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB16: f64 = 16.0 * 1024.0 * 1024.0;

    fn gbit(g: f64, latency: f64) -> Link {
        Link {
            bytes_per_second: g * 1e9 / 8.0,
            latency_seconds: latency,
        }
    }

    fn cluster(text: &str) -> ClusterSpec {
        text.parse().expect("a valid cluster spec")
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn parses_the_documented_form() {
        let c = cluster("hosts=2,devices_per_host=4,link=25gbit,10us,intra=200gbit,1us");
        assert_eq!((c.hosts, c.devices_per_host), (2, 4));
        assert_eq!(c.link, Some(gbit(25.0, 10e-6)));
        assert_eq!(c.intra, gbit(200.0, 1e-6));
        assert_eq!(c.link_per, LinkShare::Host);
        let c = cluster("hosts=1,devices_per_host=4,intra=8GB/s");
        assert_eq!(c.link, None);
        assert_eq!(c.intra.bytes_per_second, 8e9);
        assert_eq!(c.intra.latency_seconds, 0.0);
        let c = cluster("devices_per_host=2,hosts=2,link=1Gbit,0,link_per=device,mem=1GiB/s");
        assert_eq!(c.link, Some(gbit(1.0, 0.0)));
        assert_eq!(c.link_per, LinkShare::Device);
        assert_eq!(c.memory_bytes_per_second, 1024.0 * 1024.0 * 1024.0);
    }

    #[test]
    fn parse_errors_name_the_key() {
        let err = |text: &str| text.parse::<ClusterSpec>().expect_err(text);
        assert!(matches!(
            err("hosts=2,devices_per_host=2,link=1gbit,nics=2"),
            ClusterSpecError::UnknownKey { key } if key == "nics"
        ));
        assert!(matches!(
            err("hosts=2,devices_per_host=2"),
            ClusterSpecError::MissingKey { key, .. } if key == "link"
        ));
        assert!(
            matches!(err("devices_per_host=2"), ClusterSpecError::MissingKey { key, .. } if key == "hosts")
        );
        for (text, key) in [
            ("hosts=0,devices_per_host=2", "hosts"),
            ("hosts=two,devices_per_host=2", "hosts"),
            ("hosts=1,devices_per_host=-1", "devices_per_host"),
            ("hosts=2,devices_per_host=2,link=0gbit", "link"),
            ("hosts=2,devices_per_host=2,link=-5gbit", "link"),
            ("hosts=2,devices_per_host=2,link=fast", "link"),
            ("hosts=2,devices_per_host=2,link=25gbps", "link"),
            ("hosts=2,devices_per_host=2,link=25gbit,10", "link"),
            ("hosts=2,devices_per_host=2,link=25gbit,-1us", "link"),
            ("hosts=2,devices_per_host=2,link=nangbit", "link"),
            ("hosts=1,devices_per_host=2,intra=infgbit", "intra"),
            ("hosts=1,devices_per_host=2,mem=0GB/s", "mem"),
            ("hosts=1,devices_per_host=2,link_per=rack", "link_per"),
        ] {
            match err(text) {
                ClusterSpecError::BadValue { key: k, .. } => assert_eq!(k, key, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
            assert!(err(text).to_string().contains(key), "{text}");
        }
        assert!(matches!(
            err("hosts=1,hosts=1,devices_per_host=1"),
            ClusterSpecError::DuplicateKey { key } if key == "hosts"
        ));
        assert!(matches!(
            err("hosts=1,devices_per_host=1,oops"),
            ClusterSpecError::Syntax { .. }
        ));
        assert!(matches!(
            err("hosts=2,devices_per_host=2,link=1gbit,1us,2us"),
            ClusterSpecError::Syntax { .. }
        ));
    }

    #[test]
    fn ring_formulas_by_hand() {
        let link = gbit(8.0, 1e-6); // 1 GB/s
        let b = 1e9;
        // 4 members: all-reduce 2·3/4 s + 6 µs; reduce-scatter / all-gather 3/4 s + 3 µs.
        assert!(close(
            level_seconds(CollectiveKind::AllReduce, 4, b, &link),
            1.5 + 6e-6
        ));
        assert!(close(
            level_seconds(CollectiveKind::ReduceScatter, 4, b, &link),
            0.75 + 3e-6
        ));
        assert!(close(
            level_seconds(CollectiveKind::AllGather, 4, b, &link),
            0.75 + 3e-6
        ));
        assert!(close(
            level_seconds(CollectiveKind::AllToAll, 4, b, &link),
            0.75 + 3e-6
        ));
        assert!(close(
            level_seconds(CollectiveKind::Broadcast, 4, b, &link),
            1.0 + 1e-6
        ));
        assert_eq!(level_seconds(CollectiveKind::AllReduce, 1, b, &link), 0.0);
    }

    /// 2 hosts × 2 devices, a 16 MiB all-reduce over all four at 1 Gbit/s between hosts.
    #[test]
    fn hierarchical_all_reduce_by_hand() {
        let span = GroupSpan::of(&[0, 1, 2, 3], 2);
        assert_eq!(
            span,
            GroupSpan {
                members: 4,
                hosts: 2,
                per_host: 2,
                even: true
            }
        );
        // Inside: reduce-scatter of 16 MiB over 2 (1/2 of it at 25 GB/s, 1 µs), then all-gather.
        let inside = 2.0 * (0.5 * MIB16 / 25e9 + 1e-6);
        // Across: an all-reduce of half the bytes (8 MiB) between 2 hosts: 2·(1/2)·8 MiB / β +
        // 2 α, β = 1 Gbit/s per device …
        let per_device = cluster("hosts=2,devices_per_host=2,link=1gbit,10us,link_per=device");
        let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &per_device);
        assert!(close(cost.intra_seconds, inside), "{cost:?}");
        assert!(
            close(cost.link_seconds, (MIB16 / 2.0) / 125e6 + 20e-6),
            "{cost:?}"
        );
        // … or 1 Gbit/s per host, shared by its 2 devices' concurrent stages: twice as long.
        let per_host = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
        let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &per_host);
        assert!(close(cost.intra_seconds, inside));
        assert!(close(cost.link_seconds, MIB16 / 125e6 + 20e-6), "{cost:?}");
        // Reduce-scatter: inside RS of 16 MiB, across RS of 8 MiB; all-gather mirrors it.
        let rs = collective_cost(CollectiveKind::ReduceScatter, MIB16, &span, &per_device);
        assert!(close(rs.intra_seconds, 0.5 * MIB16 / 25e9 + 1e-6));
        assert!(close(rs.link_seconds, 0.5 * (MIB16 / 2.0) / 125e6 + 10e-6));
        let ag = collective_cost(CollectiveKind::AllGather, MIB16, &span, &per_device);
        assert_eq!(ag, rs);
    }

    #[test]
    fn single_host_groups_use_only_intra() {
        let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
        // The pair {0, 1} lives on host 0.
        let span = GroupSpan::of(&[0, 1], 2);
        assert_eq!(span.hosts, 1);
        let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &c);
        assert_eq!(cost.link_seconds, 0.0);
        assert!(close(cost.intra_seconds, MIB16 / 25e9 + 2e-6));
        // One device per host: flat over the link, shared by the host's 2 devices.
        let span = GroupSpan::of(&[0, 2], 2);
        assert_eq!((span.hosts, span.per_host), (2, 1));
        let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &c);
        assert_eq!(cost.intra_seconds, 0.0);
        assert!(close(cost.link_seconds, MIB16 / (125e6 / 2.0) + 20e-6));
    }

    fn config(items: &[&str]) -> TrainConfig {
        let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        TrainConfig::load(None, &items).expect("a valid config")
    }

    #[test]
    fn prediction_bytes_equal_the_trace() {
        let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=4"]);
        let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
        let p = predict(&cfg, &c, 50.0).expect("predicts");
        let on = config_on(&cfg, &c).expect("fits");
        let vocab = on.model().expect("model").vocab_size;
        let source: Arc<dyn crate::data::TokenSource> =
            Arc::from(crate::data::source_for(&on, vocab).expect("corpus"));
        let (_, trace) = plan_step(&on.plan().unwrap(), source.clone()).expect("plans");
        let total: usize = trace.events().iter().map(|e| e.bytes).sum();
        assert_eq!(p.collectives.iter().map(|r| r.bytes).sum::<usize>(), total);
        let update = PhasePattern::new("update*");
        for kind in [CollectiveKind::AllReduce, CollectiveKind::ReduceScatter] {
            let rows: usize = p
                .collectives
                .iter()
                .filter(|r| update.matches(&r.phase) && r.kind == kind.name())
                .map(|r| r.bytes)
                .sum();
            assert_eq!(rows, trace.bytes(kind, &update));
        }
        let mut closed = on.clone();
        closed.shard_mode = ShardMode::Auto;
        let (_, closed_trace) = plan_step(&closed.plan().unwrap(), source).expect("plans");
        let total: usize = closed_trace.events().iter().map(|e| e.bytes).sum();
        assert_eq!(
            p.per_micro_batch_collectives
                .iter()
                .map(|r| r.bytes)
                .sum::<usize>(),
            total
        );
    }

    #[test]
    fn the_closed_gate_reduces_in_every_micro_batch() {
        let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=3"]);
        let c = cluster("hosts=4,devices_per_host=1,link=1gbit,10us");
        let p = predict(&cfg, &c, 50.0).expect("predicts");
        assert!(
            p.deferred.deferral.starts_with("on"),
            "{}",
            p.deferred.deferral
        );
        assert!(p.per_micro_batch.deferral.starts_with("off"));
        assert_eq!(p.deferred.micro_batch_gradient_all_reduces, vec![0, 0, 0]);
        let closed = &p.per_micro_batch.micro_batch_gradient_all_reduces;
        assert_eq!(closed.len(), 3);
        assert!(
            closed.iter().all(|&n| n > 0 && n == closed[0]),
            "{closed:?}"
        );
        // Every micro-batch reduces about what the update reduces once when deferred.
        let reduced = |rows: &[CollectiveCost], phase: &str| -> usize {
            rows.iter()
                .filter(|r| r.phase == phase && r.gradient_reduction)
                .map(|r| r.bytes)
                .sum()
        };
        let once = reduced(&p.collectives, "update");
        let each = reduced(&p.per_micro_batch_collectives, "micro_batch 2");
        assert!(each >= once && once > 0, "{each} vs {once}");
    }

    #[test]
    fn deferral_pays_on_a_slow_link_and_not_at_ga_1() {
        let slow = cluster("hosts=2,devices_per_host=2,link=1gbit,50us");
        let ga4 = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=4"]);
        let p = predict(&ga4, &slow, 50.0).expect("predicts");
        assert!(p.deferred_step_ms < p.per_micro_batch_step_ms, "{p:?}");
        assert!(p.ratio < 0.6, "ratio {}", p.ratio);
        assert!(close(p.ratio * p.speedup, 1.0));
        let ga1 = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=1"]);
        let p = predict(&ga1, &slow, 50.0).expect("predicts");
        // The same reductions, once, in the update or in the only micro-batch.
        assert!((p.ratio - 1.0).abs() < 0.2, "ratio {}", p.ratio);
        assert!(p.ratio <= 1.0 + 1e-9, "ratio {}", p.ratio);
    }

    #[test]
    fn compute_and_memory_follow_the_config() {
        let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=2"]);
        let c = cluster("hosts=1,devices_per_host=4,intra=8GB/s");
        let p = predict(&cfg, &c, 10.0).expect("predicts");
        // per_device_batch_size 2 × 128 tokens per device and micro-batch.
        assert_eq!(p.tokens_per_device_per_micro_batch, 256.0);
        let expected = p.flops_per_token * 256.0 / 10e9 * 1e3;
        assert!(close(p.compute_ms_per_micro_batch, expected));
        assert!(close(p.deferred.compute_ms, 2.0 * expected));
        let params = p.parameters as f64 * 4.0;
        assert_eq!(p.memory.parameter_bytes, params);
        assert_eq!(p.memory.accumulator_bytes, params);
        assert_eq!(p.memory.optimizer_bytes, 2.0 * params);
        // ZeRO-1 splits the optimizer state (and the reduced gradients) over data = 4.
        let z = config(&["ici_data_parallelism=4", "shard_optimizer_over_data=true"]);
        let pz = predict(&z, &c, 10.0).expect("predicts");
        assert_eq!(pz.memory.optimizer_bytes, 2.0 * params / 4.0);
        assert!(pz.optimizer_ms < p.optimizer_ms);
        assert!(p.memory.total_bytes > p.memory.activation_bytes);
    }

    #[test]
    fn exposed_reduction_by_hand() {
        // Bytes 1, 1, 2 over a backward of 40 ms: ready at 10, 20, 40; finished at 20, 30, 60.
        let three = [(1.0, 10.0), (1.0, 10.0), (2.0, 20.0)];
        assert_eq!(exposed_after_backward(&three, 40.0), 20.0);
        assert_eq!(exposed_after_backward(&three, 0.0), 40.0);
        // One bucket is ready only when the backward ends: all of it is exposed.
        assert_eq!(exposed_after_backward(&[(4.0, 40.0)], 100.0), 40.0);
        // Link-bound: 4 × 30 ms behind 40 ms, the first starting at 10: 130 − 40.
        assert_eq!(exposed_after_backward(&[(1.0, 30.0); 4], 40.0), 90.0);
        // Many small buckets behind a long backward: only the last one's 1 ms.
        assert_eq!(exposed_after_backward(&[(1.0, 1.0); 100], 200.0), 1.0);
        assert_eq!(exposed_after_backward(&[], 10.0), 0.0);
    }

    #[test]
    fn overlap_hides_the_reduction_behind_the_backward() {
        // Overlapped: the reduction runs in the last micro-batch, in buckets.
        let cfg = config(&[
            "ici_data_parallelism=4",
            "gradient_accumulation_steps=4",
            "overlap_grad_reduce=true",
        ]);
        let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
        let on = config_on(&cfg, &c).expect("fits");
        let mesh = on.mesh().expect("mesh");
        let vocab = on.model().expect("model").vocab_size;
        let source: Arc<dyn crate::data::TokenSource> =
            Arc::from(crate::data::source_for(&on, vocab).expect("corpus"));
        let (_, trace) = plan_step(&on.plan().unwrap(), source).expect("plans");
        let rows = price_trace(&trace, &mesh, &c).expect("prices");
        let reductions = priced_reductions(&trace, &mesh, &c).expect("prices");
        let last: Vec<&(String, f64, f64)> = reductions
            .iter()
            .filter(|r| r.0 == "micro_batch 3")
            .collect();
        assert!(last.len() > 1, "buckets: {last:?}");
        assert_eq!(
            last.len(),
            reductions.len(),
            "nothing outside the last micro-batch"
        );
        let a: f64 = last.iter().map(|r| r.2).sum();
        let breakdown = |compute: f64, overlap: bool| {
            step_breakdown(
                &rows,
                &reductions,
                &trace,
                4,
                compute,
                overlap,
                0.0,
                String::new(),
            )
        };
        assert!(close(breakdown(3.0 * a, false).exposed_reduction_ms, a));
        // A long backward hides all but the last bucket, which is ready only at its end.
        let long = breakdown(30.0 * a, true).exposed_reduction_ms;
        assert!(close(long, last[last.len() - 1].2), "{long}");
        // A short one hides less, and never more than its own length.
        let short = breakdown(0.75 * a, true).exposed_reduction_ms;
        assert!(
            short > long && short >= a - 0.5 * a - 1e-9 && short < a,
            "{short}"
        );
        assert!(overlap_grad_reduce(&on));
    }

    #[test]
    fn a_mesh_that_does_not_fit_the_cluster_is_a_config_error() {
        let cfg = config(&["ici_data_parallelism=4"]);
        let c = cluster("hosts=3,devices_per_host=2,link=1gbit,10us");
        let err = predict(&cfg, &c, 10.0).expect_err("4 ≠ 6");
        assert!(matches!(err, TrainError::Config(_)), "{err}");
        assert!(err.to_string().contains("hosts=3"), "{err}");
        let ok = cluster("hosts=1,devices_per_host=4");
        assert!(matches!(
            predict(&cfg, &ok, 0.0),
            Err(TrainError::Config(_))
        ));
        assert!(matches!(
            predict(&cfg, &ok, f64::NAN),
            Err(TrainError::Config(_))
        ));
    }

    #[test]
    fn thread_budget_by_hand() {
        // 16 cores, 4 devices: 4 threads each, all 4 at once. 2 cores, 4 devices: 1 thread
        // each, 2 at once, so half of a thread each. 3 cores, 2 devices: 1 thread each, both at
        // once (the spare core is not shared out).
        let budget = |cores, devices| {
            let b = device_thread_budget(cores, devices);
            (b.threads, b.concurrent, b.share)
        };
        assert_eq!(budget(16, 4), (4, 4, 1.0));
        assert_eq!(budget(2, 4), (1, 2, 0.5));
        assert_eq!(budget(3, 2), (1, 2, 1.0));
        assert_eq!(budget(8, 3), (2, 3, 1.0));
        assert_eq!(budget(2, 64), (1, 2, 1.0 / 32.0));
        assert_eq!(budget(0, 0), (1, 1, 1.0));
    }

    #[test]
    fn effective_throughput_by_hand() {
        // 6 MFLOP/token × 512 tokens in 0.1 s = 30.72 GFLOP/s.
        let g = effective_gflops(6e6, 512.0, 0.1).expect("positive");
        assert!(close(g, 30.72), "{g}");
        for (tokens, seconds) in [(0.0, 0.1), (512.0, 0.0), (512.0, -1.0), (512.0, f64::NAN)] {
            assert!(
                matches!(
                    effective_gflops(6e6, tokens, seconds),
                    Err(TrainError::Config(_))
                ),
                "{tokens} tokens in {seconds} s"
            );
        }
        let mut odd = [3.0, 1.0, 2.0];
        assert_eq!(median(&mut odd), 2.0);
        let mut even = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(median(&mut even), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn a_measured_throughput_prices_the_micro_batch_it_came_from() {
        // A micro-batch of the cluster's per-device tokens measured at 0.25 s: the predicted
        // compute per micro-batch is those 0.25 s, whatever the FLOPs.
        let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=2"]);
        let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
        let one = one_device_config(&cfg).expect("one device");
        let plan = one.plan().expect("plans");
        let fpt = plan.decoder().flops_per_token(one.max_target_length);
        let tokens = one.micro_batch_rows() * one.max_target_length;
        let g = effective_gflops(fpt, tokens as f64, 0.25).expect("positive");
        let p = predict(&cfg, &c, g).expect("predicts");
        assert_eq!(p.tokens_per_device_per_micro_batch, tokens as f64);
        assert!(close(p.compute_ms_per_micro_batch, 250.0), "{p:?}");
        assert!(close(p.deferred.compute_ms, 500.0));
        assert_eq!(p.device_gflops_source, "given");
    }

    #[test]
    fn one_device_config_keeps_the_model_and_the_per_device_batch() {
        let cfg = config(&[
            "ici_data_parallelism=4",
            "per_device_batch_size=3",
            "shard_optimizer_over_data=true",
            "max_target_length=64",
        ]);
        let fsdp = config(&["ici_data_parallelism=2", "ici_fsdp_parallelism=2"]);
        assert_eq!(one_device_config(&fsdp).expect("one").devices(), 1);
        let one = one_device_config(&cfg).expect("one device");
        assert_eq!(one.devices(), 1);
        assert_eq!(one.micro_batch_rows(), 3);
        assert_eq!(one.max_target_length, 64);
        assert_eq!(one.model_name, cfg.model_name);
        assert!(!one.shard_optimizer_over_data);
        // A fractional per-device batch becomes whole sequences, at least one.
        let half = config(&[
            "per_device_batch_size=0.5",
            "ici_data_parallelism=2",
            "ici_tensor_parallelism=2",
        ]);
        assert_eq!(one_device_config(&half).expect("one").micro_batch_rows(), 1);
        // The tiny model fits in any machine this runs on.
        assert_eq!(too_big_to_measure(&cfg, 4).expect("plans"), None);
    }
}
