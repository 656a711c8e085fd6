//! The two gates of a run, decided once by [`crate::RunPlan`]: deferral (docs/design.md §6,
//! MaxText's `_deferred_all_reduce_shardings` and `data_is_only_batch_axis`) — whether parameters
//! may enter each micro-batch `{R:data}` so their gradients stay `{U:data}` until the step's one
//! reduction — and ZeRO-1 (`shard_optimizer_over_data`).
//!
//! Both gates answer in the same words: `Open` with what the run needs to act on it (the axes to
//! tag, the tensors whose state stays replicated), or `Closed` with a [`ClosedReason`]. Nothing
//! downstream asks a gate twice: the answer is a value the plan keeps.

use ferrotext_sharding::{AxisType, LogicalAxisRules, Mesh, PartitionSpec, ShardingError};

/// Why a gate stayed closed. Each reason prints the sentence the run reports after "off: ".
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClosedReason {
    /// Deferral: `shard_mode=auto`, so no axis may carry a tag.
    ShardModeAuto,
    /// Deferral: a mesh axis is not `Explicit`.
    AxisNotExplicit {
        /// The axis.
        axis: String,
        /// Its type, as printed (`Auto`).
        axis_type: String,
    },
    /// Deferral: neither `data` nor `expert` is larger than 1.
    NoDataParallelism,
    /// Deferral: an axis other than `data`/`expert` is larger than 1.
    OtherAxis {
        /// The axis.
        axis: String,
        /// Its size.
        size: usize,
    },
    /// Deferral: the batch resolves to other axes than `data` and `expert`.
    BatchNotDataAlone {
        /// The axes the batch resolves to.
        axes: Vec<String>,
    },
    /// Deferral: the batch's mesh axes cannot be resolved.
    BatchUnresolved(String),
    /// ZeRO-1: `shard_optimizer_over_data=false`.
    Zero1NotRequested,
    /// ZeRO-1: `shard_mode=auto` or an axis that is not `Explicit`.
    Zero1NotExplicit,
    /// ZeRO-1: the `data` axis has size 1.
    Zero1NoDataAxis,
}

impl std::fmt::Display for ClosedReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClosedReason::ShardModeAuto => {
                f.write_str("shard_mode is auto: tags need explicit sharding")
            }
            ClosedReason::AxisNotExplicit { axis, axis_type } => write!(
                f,
                "mesh axis `{axis}` is {axis_type}, and tags are legal only on Explicit axes"
            ),
            ClosedReason::NoDataParallelism => f.write_str(
                "the data axis has size 1: there is no data-parallel reduction to defer",
            ),
            ClosedReason::OtherAxis { axis, size } => write!(
                f,
                "mesh axis `{axis}` has size {size}: deferral needs data (and expert) to be the \
                 only axes of size > 1 (its contractions would make a batch-only tag illegal)"
            ),
            ClosedReason::BatchNotDataAlone { axes } => write!(
                f,
                "the batch resolves to {axes:?}, not to `data` (and `expert`) alone"
            ),
            ClosedReason::BatchUnresolved(e) => {
                write!(f, "the batch axes cannot be resolved: {e}")
            }
            ClosedReason::Zero1NotRequested => f.write_str("shard_optimizer_over_data is false"),
            ClosedReason::Zero1NotExplicit => {
                f.write_str("ZeRO-1 needs explicit sharding on every mesh axis")
            }
            ClosedReason::Zero1NoDataAxis => {
                f.write_str("the data axis has size 1: nothing to shard the optimizer state over")
            }
        }
    }
}

/// The deferral gate's answer. A closed gate says why; training then proceeds untagged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Deferral {
    /// Parameters enter micro-batches tagged reduced over `axes` (`data`, plus `expert` under
    /// expert parallelism; minus, per parameter, the axes it is split over); gradients and the
    /// accumulator are unreduced there; `update` performs the one reduction.
    Open {
        /// The batch axes of size > 1 the tags cover, in mesh order.
        axes: Vec<String>,
    },
    /// Everything untagged: gradients are reduced inside every micro-batch.
    Closed(ClosedReason),
}

impl Deferral {
    /// True when open.
    pub fn is_open(&self) -> bool {
        matches!(self, Deferral::Open { .. })
    }

    /// "on", or "off: " followed by the reason.
    pub fn describe(&self) -> String {
        match self {
            Deferral::Open { .. } => {
                "on: gradients stay unreduced over the batch axes until the update".into()
            }
            Deferral::Closed(why) => format!("off: {why}"),
        }
    }

    /// The layout a parameter stored as `spec` enters micro-batches with: `spec` tagged reduced
    /// over the open gate's axes — except the axes the parameter is already sharded on (the tag
    /// would overlap a partition, R1.8; MaxText's `_tag_sharding`): an expert kernel split over
    /// `expert` is tagged `{R:data}` only. A closed gate, or no axis left, returns `spec`.
    ///
    /// # Errors
    /// Never for a valid spec; typed for safety.
    pub fn inside_spec(&self, spec: &PartitionSpec) -> Result<PartitionSpec, ShardingError> {
        let Deferral::Open { axes } = self else {
            return Ok(spec.clone());
        };
        let axes: Vec<&String> = axes.iter().filter(|a| !spec.is_sharded_on(a)).collect();
        if axes.is_empty() {
            Ok(spec.clone())
        } else {
            spec.with_reduced(axes.into_iter().cloned())
        }
    }
}

/// Where the gradient reduction overlaps the backward pass (`overlap_grad_reduce`), decided
/// with the deferral gate. Overlap needs the gradients to leave the backward unreduced, so the
/// parameters enter micro-batches tagged `{R:…}` in both overlapped forms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// Deferral open: the step's one reduction starts bucket by bucket during the last
    /// micro-batch's backward.
    LastMicroBatch,
    /// Deferral closed (`shard_mode=auto`, or an `Auto` axis), but the compute mesh could carry
    /// the tags: parameters enter micro-batches tagged reduced over `axes`, and every
    /// micro-batch's reduction starts bucket by bucket during its own backward and is added to
    /// a reduced accumulator — PyTorch DDP's schedule, with the per-micro-batch traffic of the
    /// untagged run.
    EveryMicroBatch {
        /// The batch axes the tags cover, in mesh order.
        axes: Vec<String>,
    },
    /// No overlap, and why: the sentence the run reports after "off: ".
    Off(String),
}

impl Overlap {
    /// Decides overlap from the flag, the deferral gate, and what that gate would answer on the
    /// `compute` mesh (every axis Explicit) under explicit sharding.
    pub fn decide(
        requested: bool,
        deferral: &Deferral,
        compute: &Mesh,
        rules: &LogicalAxisRules,
    ) -> Overlap {
        if !requested {
            return Overlap::Off("overlap_grad_reduce is false".into());
        }
        if deferral.is_open() {
            return Overlap::LastMicroBatch;
        }
        match deferral_gate(true, compute, rules) {
            Deferral::Open { axes } => Overlap::EveryMicroBatch { axes },
            Deferral::Closed(why) => Overlap::Off(why.to_string()),
        }
    }

    /// The layout a parameter stored as `spec` enters micro-batches with when the deferral gate
    /// gave `inside`: under [`Overlap::EveryMicroBatch`] it is tagged as an open gate over the
    /// same axes would tag it; otherwise `inside` unchanged.
    ///
    /// # Errors
    /// Never for a valid spec; typed for safety.
    pub fn inside_spec(
        &self,
        spec: &PartitionSpec,
        inside: PartitionSpec,
    ) -> Result<PartitionSpec, ShardingError> {
        match self {
            Overlap::EveryMicroBatch { axes } => {
                Deferral::Open { axes: axes.clone() }.inside_spec(spec)
            }
            _ => Ok(inside),
        }
    }

    /// True when each micro-batch reduces its own gradients ([`Overlap::EveryMicroBatch`]).
    pub fn every_micro_batch(&self) -> bool {
        matches!(self, Overlap::EveryMicroBatch { .. })
    }

    /// "on: …" with where the reduction overlaps, or "off: " followed by the reason.
    pub fn describe(&self) -> String {
        match self {
            Overlap::LastMicroBatch => {
                "on: the step's reduction starts bucket by bucket in the last micro-batch's backward"
                    .into()
            }
            Overlap::EveryMicroBatch { .. } => "on: each micro-batch's reduction starts bucket by \
                 bucket in its own backward (deferral is off)"
                .into(),
            Overlap::Off(why) => format!("off: {why}"),
        }
    }
}

/// The ZeRO-1 gate's answer. It only reshards, so unlike deferral it opens on meshes with other
/// axes (data2×tensor2: deferral closed, ZeRO-1 open).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Zero1 {
    /// Optimizer state sharded over `data`; `update` reduce-scatters the gradients, steps on the
    /// local slices and all-gathers the parameters. `replicated` names the parameters whose
    /// state stays replicated (no dimension the `data` axis divides).
    Open {
        /// Parameters whose optimizer state stays replicated.
        replicated: Vec<String>,
    },
    /// Not active, and why.
    Closed(ClosedReason),
}

impl Zero1 {
    /// True when open.
    pub fn is_open(&self) -> bool {
        matches!(self, Zero1::Open { .. })
    }

    /// "on" (with the replicated ones, said once) or "off: " followed by the reason.
    pub fn describe(&self) -> String {
        match self {
            Zero1::Open { replicated } if replicated.is_empty() => {
                "on: every optimizer-state tensor is sharded over `data`".into()
            }
            Zero1::Open { replicated } => format!(
                "on: optimizer state sharded over `data`, except {} tensor(s) no dimension of \
                 which `data` divides ({})",
                replicated.len(),
                replicated.join(", ")
            ),
            Zero1::Closed(why) => format!("off: {why}"),
        }
    }
}

/// Decides ZeRO-1 (MaxText's `_zero1_active`): the flag, explicit mode, every axis Explicit, and
/// a `data` axis larger than 1. An open answer lists no replicated tensor yet: the plan adds
/// them as it lays out each parameter ([`zero1_spec`]).
pub fn zero1_gate(flag: bool, explicit_mode: bool, mesh: &Mesh) -> Zero1 {
    if !flag {
        return Zero1::Closed(ClosedReason::Zero1NotRequested);
    }
    if !explicit_mode || !mesh.is_all_explicit() {
        return Zero1::Closed(ClosedReason::Zero1NotExplicit);
    }
    match mesh.axis("data") {
        Some(a) if a.size() > 1 => Zero1::Open {
            replicated: Vec::new(),
        },
        _ => Zero1::Closed(ClosedReason::Zero1NoDataAxis),
    }
}

/// The ZeRO-1 layout of a parameter's optimizer state (and of its reduced gradient): `data`
/// added, minor, to the first dimension whose shard it divides. `None` when the parameter is
/// already sharded on `data` or no dimension is divisible (it stays replicated).
///
/// # Errors
/// An axis the mesh does not have.
pub fn zero1_spec(
    spec: &PartitionSpec,
    shape: &[usize],
    mesh: &Mesh,
) -> Result<Option<PartitionSpec>, ShardingError> {
    let data = mesh.axis_size("data")?;
    if spec.is_sharded_on("data") || data <= 1 {
        return Ok(None);
    }
    for (d, &extent) in shape.iter().enumerate() {
        let parts = mesh.axes_size(spec.dim(d).axis_names())?;
        if (extent / parts) % data == 0 {
            let mut dims: Vec<_> = (0..shape.len()).map(|i| spec.dim(i).clone()).collect();
            let mut axes = dims[d].axis_names().to_vec();
            axes.push("data".into());
            dims[d] = ferrotext_sharding::DimSpec::axes(axes);
            return spec.with_partitions(dims).map(Some);
        }
    }
    Ok(None)
}

/// Decides deferral for `mesh` under `rules` in explicit (`explicit_mode`) or auto mode, whole:
/// open with the axes to tag, or closed with the reason.
///
/// Open only when all hold: explicit mode; every mesh axis `Explicit`; a `data`, `expert` or
/// `context` axis larger than 1; every other axis of size 1 (the blunt rule: `fsdp` breaks the
/// tag through the batch contraction, `tensor` through the feature contraction, and listing bad
/// axes missed `tensor` once); and the batch resolves to `data` and/or `expert` alone (or to no
/// axis, with `context` splitting the sequence). (`expert` splits the batch and the experts
/// only, `context` the sequence only: the engine keeps dense weights whole over both.)
pub fn deferral_gate(explicit_mode: bool, mesh: &Mesh, rules: &LogicalAxisRules) -> Deferral {
    let closed = Deferral::Closed;
    if !explicit_mode {
        return closed(ClosedReason::ShardModeAuto);
    }
    if let Some(axis) = mesh
        .axes()
        .iter()
        .find(|a| a.axis_type() != AxisType::Explicit)
    {
        return closed(ClosedReason::AxisNotExplicit {
            axis: axis.name().to_string(),
            axis_type: axis.axis_type().to_string(),
        });
    }
    // `context` splits each sequence (context parallelism): weights stay whole over it, and
    // their gradients are partial sums over it like over the batch.
    let batch_like = |name: &str| matches!(name, "data" | "expert" | "context");
    if !mesh
        .axes()
        .iter()
        .any(|a| batch_like(a.name()) && a.size() > 1)
    {
        return closed(ClosedReason::NoDataParallelism);
    }
    if let Some(axis) = mesh
        .axes()
        .iter()
        .find(|a| !batch_like(a.name()) && a.size() > 1)
    {
        return closed(ClosedReason::OtherAxis {
            axis: axis.name().to_string(),
            size: axis.size(),
        });
    }
    let context: Vec<String> = mesh
        .axis("context")
        .filter(|a| a.size() > 1)
        .map(|a| a.name().to_string())
        .into_iter()
        .collect();
    match rules.batch_mesh_axes(mesh) {
        Ok(axes) if axes.iter().all(|a| batch_like(a)) => Deferral::Open {
            axes: axes.into_iter().chain(context).collect(),
        },
        Err(_) if !context.is_empty() => Deferral::Open { axes: context },
        Ok(axes) => closed(ClosedReason::BatchNotDataAlone {
            axes: axes.into_iter().collect(),
        }),
        Err(e) => closed(ClosedReason::BatchUnresolved(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(axes: &[(&str, usize, AxisType)]) -> Mesh {
        Mesh::new(axes.iter().map(|&(n, s, t)| (n, s, t))).unwrap()
    }
    const E: AxisType = AxisType::Explicit;

    fn open(axes: &[&str]) -> Deferral {
        Deferral::Open {
            axes: axes.iter().map(|a| a.to_string()).collect(),
        }
    }

    #[test]
    fn gate_table() {
        let rules = LogicalAxisRules::maxtext();
        let gate = |m: &Mesh, explicit: bool| deferral_gate(explicit, m, &rules);
        let pure_dp = mesh(&[("data", 4, E), ("fsdp", 1, E), ("tensor", 1, E)]);
        assert_eq!(gate(&pure_dp, true), open(&["data"]));
        let off = |d: Deferral, needle: &str| match d {
            Deferral::Closed(why) => assert!(why.to_string().contains(needle), "{why}"),
            Deferral::Open { .. } => panic!("gate open; expected closed with `{needle}`"),
        };
        off(gate(&pure_dp, false), "shard_mode is auto");
        off(
            gate(
                &mesh(&[
                    ("data", 4, E),
                    ("fsdp", 1, E),
                    ("tensor", 1, AxisType::Auto),
                ]),
                true,
            ),
            "`tensor` is Auto",
        );
        off(
            gate(
                &mesh(&[("data", 1, E), ("fsdp", 1, E), ("tensor", 1, E)]),
                true,
            ),
            "data axis has size 1",
        );
        off(
            gate(
                &mesh(&[("data", 2, E), ("fsdp", 2, E), ("tensor", 1, E)]),
                true,
            ),
            "`fsdp` has size 2",
        );
        off(
            gate(
                &mesh(&[("data", 2, E), ("fsdp", 1, E), ("tensor", 2, E)]),
                true,
            ),
            "`tensor` has size 2",
        );
        // Expert parallelism: `expert` splits the batch like `data`; tags cover both.
        let ep = mesh(&[
            ("data", 2, E),
            ("fsdp", 1, E),
            ("tensor", 1, E),
            ("expert", 2, E),
        ]);
        let ep_gate = gate(&ep, true);
        assert_eq!(ep_gate, open(&["data", "expert"]));
        let split = PartitionSpec::new([Some("expert"), None, None]);
        assert_eq!(
            ep_gate.inside_spec(&split).unwrap(),
            split.with_reduced(["data"]).unwrap(),
            "an expert kernel split over `expert` is tagged over `data` only"
        );
        off(
            gate(
                &mesh(&[
                    ("data", 1, E),
                    ("fsdp", 1, E),
                    ("tensor", 2, E),
                    ("expert", 2, E),
                ]),
                true,
            ),
            "`tensor` has size 2",
        );
        assert!(gate(&pure_dp, true).describe().starts_with("on"));
    }

    /// The reasons print the sentences the run has always reported (the summary and the
    /// checkpoint manifest carry them).
    #[test]
    fn closed_reasons_print_whole_sentences() {
        assert_eq!(
            Deferral::Closed(ClosedReason::OtherAxis {
                axis: "fsdp".into(),
                size: 2
            })
            .describe(),
            "off: mesh axis `fsdp` has size 2: deferral needs data (and expert) to be the only \
             axes of size > 1 (its contractions would make a batch-only tag illegal)"
        );
        assert_eq!(
            Zero1::Open {
                replicated: vec!["a".into(), "b".into()]
            }
            .describe(),
            "on: optimizer state sharded over `data`, except 2 tensor(s) no dimension of which \
             `data` divides (a, b)"
        );
        assert_eq!(
            Zero1::Closed(ClosedReason::Zero1NotExplicit).describe(),
            "off: ZeRO-1 needs explicit sharding on every mesh axis"
        );
    }

    #[test]
    fn zero1_layouts() {
        let mesh = mesh(&[("data", 4, E), ("tensor", 2, E)]);
        let spec = PartitionSpec::new([None, Some("tensor")]);
        assert_eq!(
            zero1_spec(&spec, &[8, 6], &mesh)
                .unwrap()
                .unwrap()
                .to_string(),
            "P('data', 'tensor')"
        );
        assert_eq!(
            zero1_spec(&spec, &[6, 16], &mesh)
                .unwrap()
                .unwrap()
                .to_string(),
            "P(None, ('tensor', 'data'))"
        );
        assert_eq!(
            zero1_spec(&spec, &[6, 6], &mesh).unwrap(),
            None,
            "indivisible: replicated"
        );
        assert_eq!(
            zero1_spec(&PartitionSpec::new([Some("data")]), &[8], &mesh).unwrap(),
            None
        );
        assert!(zero1_gate(true, true, &mesh).is_open());
        assert!(!zero1_gate(false, true, &mesh).is_open());
        assert!(!zero1_gate(true, false, &mesh).is_open());
        let one = super::tests::mesh(&[("data", 1, E)]);
        assert!(
            matches!(zero1_gate(true, true, &one), Zero1::Closed(why) if why.to_string().contains("size 1"))
        );
    }

    #[test]
    fn params_already_sharded_on_data_stay_untagged() {
        let open = open(&["data"]);
        let on_data = PartitionSpec::new([Some("data"), None]);
        assert_eq!(open.inside_spec(&on_data).unwrap(), on_data);
        let replicated = PartitionSpec::new([None::<&str>, Some("tensor")]);
        assert_eq!(
            open.inside_spec(&replicated).unwrap().to_string(),
            "P(None, 'tensor', reduced={'data'})"
        );
        let closed = Deferral::Closed(ClosedReason::ShardModeAuto);
        assert_eq!(closed.inside_spec(&replicated).unwrap(), replicated);
    }
}
