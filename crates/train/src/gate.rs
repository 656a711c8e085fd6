//! The deferral gate (DESIGN §6, MaxText's `_deferred_all_reduce_shardings` and
//! `data_is_only_batch_axis`): whether parameters may enter each micro-batch `{R:data}` so their
//! gradients stay `{U:data}` until the step's one reduction.

use ferrotext_sharding::{AxisType, LogicalAxisRules, Mesh, PartitionSpec, ShardingError};

/// The gate's decision. A closed gate says why; training then proceeds untagged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Deferral {
    /// Parameters enter micro-batches tagged reduced over the batch axes (`{R:data}`, plus
    /// `expert` under expert parallelism, minus the axes a parameter is split over); gradients
    /// and the accumulator are unreduced there; `update` performs the one reduction.
    Open,
    /// Everything untagged: gradients are reduced inside every micro-batch.
    Closed(String),
}

impl Deferral {
    /// True when open.
    pub fn is_open(&self) -> bool {
        matches!(self, Deferral::Open)
    }

    /// "on", or "off: " followed by the reason.
    pub fn describe(&self) -> String {
        match self {
            Deferral::Open => {
                "on: gradients stay unreduced over the batch axes until the update".into()
            }
            Deferral::Closed(why) => format!("off: {why}"),
        }
    }
}

/// Whether ZeRO-1 (`shard_optimizer_over_data`) is on. It only reshards, so unlike deferral it
/// works on meshes with other axes (data2×tensor2: deferral off, ZeRO-1 on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Zero1 {
    /// Optimizer state sharded over `data`; `update` reduce-scatters the gradients, steps on the
    /// local slices and all-gathers the parameters. `replicated` names the parameters whose
    /// state stays replicated (no dimension the `data` axis divides).
    Active {
        /// Parameters whose optimizer state stays replicated.
        replicated: Vec<String>,
    },
    /// Not active, and why.
    Off(String),
}

impl Zero1 {
    /// True when active.
    pub fn is_active(&self) -> bool {
        matches!(self, Zero1::Active { .. })
    }

    /// "on" (with the replicated ones, said once) or "off: " followed by the reason.
    pub fn describe(&self) -> String {
        match self {
            Zero1::Active { replicated } if replicated.is_empty() => "on: every optimizer-state tensor is sharded over `data`".into(),
            Zero1::Active { replicated } => format!(
                "on: optimizer state sharded over `data`, except {} tensor(s) no dimension of which `data` divides ({})",
                replicated.len(),
                replicated.join(", ")
            ),
            Zero1::Off(why) => format!("off: {why}"),
        }
    }
}

/// Decides ZeRO-1 (MaxText's `_zero1_active`): the flag, explicit mode, every axis Explicit, and
/// a `data` axis larger than 1.
pub fn zero1_gate(flag: bool, explicit_mode: bool, mesh: &Mesh) -> Zero1 {
    if !flag {
        return Zero1::Off("shard_optimizer_over_data is false".into());
    }
    if !explicit_mode || !mesh.is_all_explicit() {
        return Zero1::Off("ZeRO-1 needs explicit sharding on every mesh axis".into());
    }
    match mesh.axis("data") {
        Some(a) if a.size() > 1 => Zero1::Active {
            replicated: Vec::new(),
        },
        _ => {
            Zero1::Off("the data axis has size 1: nothing to shard the optimizer state over".into())
        }
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

/// The layout a parameter enters micro-batches with: its storage spec, tagged reduced over the
/// batch axes `batch_axes` when the gate is open — except the axes the parameter is already
/// sharded on (the tag would overlap a partition, R1.8; MaxText's `_tag_sharding`): an expert
/// kernel split over `expert` is tagged `{R:data}` only.
///
/// # Errors
/// Never for a valid spec; typed for safety.
pub fn deferred_spec(
    spec: &PartitionSpec,
    gate: &Deferral,
    batch_axes: &[String],
) -> Result<PartitionSpec, ShardingError> {
    let axes: Vec<&String> = batch_axes
        .iter()
        .filter(|a| !spec.is_sharded_on(a))
        .collect();
    if gate.is_open() && !axes.is_empty() {
        spec.with_reduced(axes.into_iter().cloned())
    } else {
        Ok(spec.clone())
    }
}

/// The axes a deferred parameter is tagged over: the batch axes of size > 1 (`data`, and
/// `expert` when it splits the batch).
///
/// # Errors
/// When the batch resolves to no axis.
pub fn deferral_axes(mesh: &Mesh, rules: &LogicalAxisRules) -> Result<Vec<String>, ShardingError> {
    Ok(rules.batch_mesh_axes(mesh)?.into_iter().collect())
}

/// Decides deferral for `mesh` under `rules` in explicit (`explicit_mode`) or auto mode.
///
/// Open only when all hold: explicit mode; every mesh axis `Explicit`; a `data` or `expert`
/// axis larger than 1; every other axis of size 1 (the blunt rule: `fsdp` breaks the tag through
/// the batch contraction, `tensor` through the feature contraction, and listing bad axes missed
/// `tensor` once); and the batch resolves to `data` and/or `expert` alone. (`expert` splits the
/// batch and the experts only: the engine keeps dense weights whole over it.)
pub fn deferral_gate(explicit_mode: bool, mesh: &Mesh, rules: &LogicalAxisRules) -> Deferral {
    let closed = |why: String| Deferral::Closed(why);
    if !explicit_mode {
        return closed("shard_mode is auto: tags need explicit sharding".into());
    }
    if let Some(axis) = mesh
        .axes()
        .iter()
        .find(|a| a.axis_type() != AxisType::Explicit)
    {
        return closed(format!(
            "mesh axis `{}` is {}, and tags are legal only on Explicit axes",
            axis.name(),
            axis.axis_type()
        ));
    }
    let batch_like = |name: &str| name == "data" || name == "expert";
    if !mesh
        .axes()
        .iter()
        .any(|a| batch_like(a.name()) && a.size() > 1)
    {
        return closed(
            "the data axis has size 1: there is no data-parallel reduction to defer".into(),
        );
    }
    if let Some(axis) = mesh
        .axes()
        .iter()
        .find(|a| !batch_like(a.name()) && a.size() > 1)
    {
        return closed(format!(
            "mesh axis `{}` has size {}: deferral needs data (and expert) to be the only axes of size > 1 (its contractions would make a batch-only tag illegal)",
            axis.name(),
            axis.size()
        ));
    }
    match rules.batch_mesh_axes(mesh) {
        Ok(axes) if axes.iter().all(|a| batch_like(a)) => Deferral::Open,
        Ok(axes) => closed(format!(
            "the batch resolves to {axes:?}, not to `data` (and `expert`) alone"
        )),
        Err(e) => closed(format!("the batch axes cannot be resolved: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(axes: &[(&str, usize, AxisType)]) -> Mesh {
        Mesh::new(axes.iter().map(|&(n, s, t)| (n, s, t))).unwrap()
    }
    const E: AxisType = AxisType::Explicit;

    #[test]
    fn gate_table() {
        let rules = LogicalAxisRules::maxtext();
        let gate = |m: &Mesh, explicit: bool| deferral_gate(explicit, m, &rules);
        let pure_dp = mesh(&[("data", 4, E), ("fsdp", 1, E), ("tensor", 1, E)]);
        assert_eq!(gate(&pure_dp, true), Deferral::Open);
        let off = |d: Deferral, needle: &str| match d {
            Deferral::Closed(why) => assert!(why.contains(needle), "{why}"),
            Deferral::Open => panic!("gate open; expected closed with `{needle}`"),
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
        assert_eq!(gate(&ep, true), Deferral::Open);
        assert_eq!(deferral_axes(&ep, &rules).unwrap(), ["data", "expert"]);
        let split = PartitionSpec::new([Some("expert"), None, None]);
        let axes = deferral_axes(&ep, &rules).unwrap();
        assert_eq!(
            deferred_spec(&split, &Deferral::Open, &axes).unwrap(),
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
        assert!(zero1_gate(true, true, &mesh).is_active());
        assert!(!zero1_gate(false, true, &mesh).is_active());
        assert!(!zero1_gate(true, false, &mesh).is_active());
        let one = super::tests::mesh(&[("data", 1, E)]);
        assert!(matches!(zero1_gate(true, true, &one), Zero1::Off(why) if why.contains("size 1")));
    }

    #[test]
    fn params_already_sharded_on_data_stay_untagged() {
        let open = Deferral::Open;
        let on_data = PartitionSpec::new([Some("data"), None]);
        let data = ["data".to_string()];
        assert_eq!(deferred_spec(&on_data, &open, &data).unwrap(), on_data);
        let replicated = PartitionSpec::new([None::<&str>, Some("tensor")]);
        assert_eq!(
            deferred_spec(&replicated, &open, &data)
                .unwrap()
                .to_string(),
            "P(None, 'tensor', reduced={'data'})"
        );
        let closed = Deferral::Closed("x".into());
        assert_eq!(
            deferred_spec(&replicated, &closed, &data).unwrap(),
            replicated
        );
    }
}
