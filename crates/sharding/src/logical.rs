//! Logical axis rules, MaxText style: a model names its dimensions (`embed`, `mlp`,
//! `activation_batch`, ...) and a rule table maps each name to an ordered list of mesh axes.
//!
//! Resolution of one dimension walks its rule's axes in order and keeps an axis only when it
//! (1) exists in the mesh, (2) has size > 1, (3) is not used by an earlier dimension or by the
//! value's tags, and (4) keeps the product of kept axis sizes a divisor of the dimension. So one
//! rule table serves data-only, data×fsdp and data×tensor meshes alike.
//!
//! Tags travel: [`LogicalAxisRules::resolve_for`] rebuilds a value's spec and keeps *its* tags, or
//! fails with [`ShardingError::RuleConflictsWithTag`]; [`carry_reduced`] copies a value's reduced
//! axes onto a spec that was rebuilt elsewhere (MaxText's `carry_reduced_axes`).

use crate::dim::{AxisSet, DimSpec};
use crate::error::{ShardingError, TagKind};
use crate::mesh::Mesh;
use crate::spec::PartitionSpec;

/// An ordered table from logical axis names to ordered mesh axes.
///
/// Invariant: names are non-empty and unique; a rule lists each mesh axis at most once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogicalAxisRules {
    rules: Vec<(String, Vec<String>)>,
}

impl LogicalAxisRules {
    /// Builds a table from `(logical name, mesh axes)` pairs.
    ///
    /// # Errors
    /// [`ShardingError::InvalidRules`] for an empty or repeated name, or a rule naming an axis twice.
    pub fn new<N, A, S>(rules: impl IntoIterator<Item = (N, A)>) -> Result<Self, ShardingError>
    where
        N: Into<String>,
        A: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut table: Vec<(String, Vec<String>)> = Vec::new();
        for (name, axes) in rules {
            let name = name.into();
            let axes: Vec<String> = axes.into_iter().map(Into::into).collect();
            let invalid = |reason: String| Err(ShardingError::InvalidRules { reason });
            if name.is_empty() {
                return invalid("a rule has an empty logical name".into());
            }
            if table.iter().any(|(n, _)| *n == name) {
                return invalid(format!("logical axis `{name}` has two rules"));
            }
            if let Some(dup) = axes
                .iter()
                .enumerate()
                .find(|(i, a)| axes[..*i].contains(a))
            {
                return invalid(format!("rule `{name}` lists mesh axis `{}` twice", dup.1));
            }
            table.push((name, axes));
        }
        Ok(LogicalAxisRules { rules: table })
    }

    /// MaxText's default rules (`configs/base.yml`), restricted to the mesh axes ferrotext knows
    /// (`data`, `fsdp`, `tensor`, `expert`, `stage`, ...). Axes a mesh lacks are skipped at
    /// resolution, so the table works on any mesh.
    pub fn maxtext() -> LogicalAxisRules {
        const RULES: &[(&str, &[&str])] = &[
            (
                "activation_batch",
                &["data", "fsdp", "fsdp_transpose", "expert"],
            ),
            (
                "activation_batch_no_exp",
                &["data", "fsdp", "fsdp_transpose"],
            ),
            (
                "activation_embed_and_logits_batch",
                &["data", "stage", "fsdp", "fsdp_transpose", "expert"],
            ),
            ("activation_length", &["sequence", "context"]),
            (
                "activation_norm_length",
                &["tensor_sequence", "context", "sequence"],
            ),
            ("activation_embed", &["tensor"]),
            ("activation_mlp", &["tensor"]),
            ("activation_heads", &["tensor", "sequence"]),
            ("activation_kv_heads", &["tensor", "sequence"]),
            ("activation_kv", &["tensor"]),
            ("activation_vocab", &["tensor"]),
            ("activation_exp", &["expert"]),
            (
                "embed",
                &["fsdp", "fsdp_transpose", "sequence", "context", "expert"],
            ),
            (
                "embed_no_exp",
                &["fsdp", "fsdp_transpose", "sequence", "context"],
            ),
            (
                "embed_moe",
                &["fsdp", "fsdp_transpose", "sequence", "context"],
            ),
            (
                "mlp",
                &[
                    "fsdp_transpose",
                    "tensor",
                    "tensor_sequence",
                    "autoregressive",
                ],
            ),
            (
                "mlp_moe",
                &[
                    "fsdp_transpose",
                    "tensor",
                    "tensor_sequence",
                    "autoregressive",
                ],
            ),
            ("heads", &["tensor", "tensor_sequence", "autoregressive"]),
            ("q_heads", &["tensor", "tensor_sequence", "autoregressive"]),
            ("kv_heads", &["tensor", "tensor_sequence", "autoregressive"]),
            ("kv", &[]),
            ("kv_head_dim", &[]),
            ("vocab", &["tensor", "tensor_sequence", "autoregressive"]),
            ("norm", &["tensor"]),
            ("exp", &["expert"]),
            ("layers", &["stage"]),
        ];
        LogicalAxisRules {
            rules: RULES
                .iter()
                .map(|(n, axes)| (n.to_string(), axes.iter().map(|a| a.to_string()).collect()))
                .collect(),
        }
    }

    /// This table with `axis` removed from the rule for `logical` (unchanged when the rule does
    /// not list it): e.g. `embed` without `expert`, so dense weights stay whole while the expert
    /// axis splits only the batch and the experts.
    pub fn without_axis(mut self, logical: &str, axis: &str) -> LogicalAxisRules {
        if let Some((_, axes)) = self.rules.iter_mut().find(|(n, _)| n == logical) {
            axes.retain(|a| a != axis);
        }
        self
    }

    /// The mesh axes the rule for `logical` lists, in order (`None` when there is no rule).
    pub fn rule(&self, logical: &str) -> Option<&[String]> {
        self.rules
            .iter()
            .find(|(n, _)| n == logical)
            .map(|(_, a)| a.as_slice())
    }

    /// A fresh, untagged spec for an array of `shape` whose dimensions have the logical names
    /// `logical` (`None` = never sharded; a name with no rule is replicated).
    ///
    /// # Errors
    /// [`ShardingError::InvalidRules`] when `logical` and `shape` differ in length.
    pub fn resolve(
        &self,
        logical: &[Option<&str>],
        shape: &[usize],
        mesh: &Mesh,
    ) -> Result<PartitionSpec, ShardingError> {
        self.resolve_for(logical, shape, mesh, &PartitionSpec::replicated())
    }

    /// The spec for a value currently typed `current`, rebuilt from the rules: its partitions come
    /// from the rules, its tags from `current` (both sets, unchanged).
    ///
    /// # Errors
    /// [`ShardingError::RuleConflictsWithTag`] when a rule would shard on an axis `current` is
    /// tagged on — the rebuild cannot keep the tag, and dropping it silently would take the value
    /// off the deferred path; [`ShardingError::InvalidRules`] for a length mismatch.
    pub fn resolve_for(
        &self,
        logical: &[Option<&str>],
        shape: &[usize],
        mesh: &Mesh,
        current: &PartitionSpec,
    ) -> Result<PartitionSpec, ShardingError> {
        if logical.len() != shape.len() {
            return Err(ShardingError::InvalidRules {
                reason: format!(
                    "{} logical axis names for an array of rank {}",
                    logical.len(),
                    shape.len()
                ),
            });
        }
        let mut used: Vec<&str> = Vec::new();
        let mut partitions = Vec::with_capacity(shape.len());
        for (name, &extent) in logical.iter().zip(shape) {
            let rule_axes = name.and_then(|n| self.rule(n)).unwrap_or(&[]);
            let mut kept: Vec<String> = Vec::new();
            let mut product = 1;
            for axis in rule_axes {
                let Some(mesh_axis) = mesh.axis(axis) else {
                    continue;
                };
                if mesh_axis.size() == 1 || used.contains(&axis.as_str()) {
                    continue;
                }
                if extent % (product * mesh_axis.size()) != 0 {
                    continue;
                }
                for (kind, set) in [
                    (TagKind::Unreduced, current.unreduced()),
                    (TagKind::Reduced, current.reduced()),
                ] {
                    if set.contains(axis) {
                        return Err(ShardingError::RuleConflictsWithTag {
                            logical: name.unwrap_or_default().to_string(),
                            axis: axis.clone(),
                            kind,
                            unreduced: current.unreduced().clone(),
                            reduced: current.reduced().clone(),
                        });
                    }
                }
                product *= mesh_axis.size();
                used.push(axis);
                kept.push(axis.clone());
            }
            partitions.push(DimSpec::axes(kept));
        }
        current.with_partitions(partitions)
    }

    /// The mesh axes of size > 1 that the `activation_batch` rule resolves to on `mesh` (MaxText's
    /// `batch_mesh_axes`, used by the deferral gate).
    ///
    /// # Errors
    /// [`ShardingError::NoUsableRule`] when no rule or no axis of size > 1 remains.
    pub fn batch_mesh_axes(&self, mesh: &Mesh) -> Result<AxisSet, ShardingError> {
        let axes: AxisSet = self
            .rule("activation_batch")
            .unwrap_or(&[])
            .iter()
            .filter(|a| mesh.axis(a).is_some_and(|x| x.size() > 1))
            .cloned()
            .collect();
        if axes.is_empty() {
            return Err(ShardingError::NoUsableRule {
                logical: "activation_batch".into(),
                mesh: mesh.to_string(),
            });
        }
        Ok(axes)
    }
}

/// Copies `from`'s reduced axes onto `spec` (a spec rebuilt from logical rules, which is always
/// untagged), so resharding a `{R:data}` value onto it keeps the value on the deferred path.
///
/// # Errors
/// Declines with [`ShardingError::PartitionOverlapsTag`] when `spec` shards on one of those axes
/// (the value cannot be both sharded and reduced there) and [`ShardingError::TagsOverlap`] when
/// `spec` is unreduced on one of them. The caller decides: keep the old layout, or reshard
/// explicitly and accept the reduction.
pub fn carry_reduced(
    spec: &PartitionSpec,
    from: &PartitionSpec,
) -> Result<PartitionSpec, ShardingError> {
    spec.with_reduced(from.reduced().iter().cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(axes: &[&str]) -> AxisSet {
        axes.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn resolution_skips_missing_size_one_used_and_indivisible_axes() {
        let rules = LogicalAxisRules::maxtext();
        let mesh = Mesh::explicit([("data", 4), ("fsdp", 1), ("tensor", 2)]).unwrap();
        // activation_batch → data (fsdp has size 1, fsdp_transpose/expert absent)
        let spec = rules
            .resolve(
                &[Some("activation_batch"), None, Some("activation_embed")],
                &[8, 16, 32],
                &mesh,
            )
            .unwrap();
        assert_eq!(
            spec,
            PartitionSpec::new([Some("data"), None, Some("tensor")])
        );
        // `tensor` already used by dim 0: dim 1 stays replicated.
        let spec = rules
            .resolve(&[Some("vocab"), Some("mlp")], &[8, 8], &mesh)
            .unwrap();
        assert_eq!(spec, PartitionSpec::new([Some("tensor"), None]));
        // 6 is not divisible by data=4: skipped.
        let spec = rules
            .resolve(&[Some("activation_batch")], &[6], &mesh)
            .unwrap();
        assert_eq!(spec, PartitionSpec::new([None::<&str>]));
        // several axes, major first
        let mesh = Mesh::explicit([("data", 2), ("fsdp", 2)]).unwrap();
        let spec = rules
            .resolve(&[Some("activation_batch"), Some("embed")], &[8, 8], &mesh)
            .unwrap();
        assert_eq!(
            spec,
            PartitionSpec::new([DimSpec::axes(["data", "fsdp"]), DimSpec::Replicated])
        );
        assert!(rules.resolve(&[Some("embed")], &[8, 8], &mesh).is_err());
    }

    #[test]
    fn resolve_for_keeps_both_tags() {
        let rules = LogicalAxisRules::maxtext();
        let mesh = Mesh::explicit([("data", 4), ("fsdp", 2), ("tensor", 2)]).unwrap();
        let current = PartitionSpec::new([None::<&str>, None])
            .with_reduced(["data"])
            .unwrap();
        let spec = rules
            .resolve_for(&[Some("embed"), Some("mlp")], &[8, 8], &mesh, &current)
            .unwrap();
        assert_eq!(
            spec.partitions(),
            &[DimSpec::axis("fsdp"), DimSpec::axis("tensor")]
        );
        assert_eq!(spec.reduced(), &set(&["data"]));
        let current = PartitionSpec::replicated()
            .with_unreduced(["data"])
            .unwrap();
        let spec = rules
            .resolve_for(&[Some("embed")], &[8], &mesh, &current)
            .unwrap();
        assert_eq!(spec.unreduced(), &set(&["data"]));
    }

    #[test]
    fn resolve_for_refuses_to_shard_a_tagged_axis() {
        let rules = LogicalAxisRules::maxtext();
        let mesh = Mesh::explicit([("data", 4)]).unwrap();
        let current = PartitionSpec::replicated().with_reduced(["data"]).unwrap();
        let err = rules
            .resolve_for(&[Some("activation_batch")], &[8], &mesh, &current)
            .unwrap_err();
        assert!(matches!(
            err,
            ShardingError::RuleConflictsWithTag {
                kind: TagKind::Reduced,
                ..
            }
        ));
        assert!(err
            .to_string()
            .contains("`activation_batch` resolves to mesh axis `data`"));
    }

    #[test]
    fn carry_reduced_accepts_and_declines() {
        let from = PartitionSpec::new([None::<&str>, None])
            .with_reduced(["data"])
            .unwrap();
        let rebuilt = PartitionSpec::new([Some("expert"), None, Some("tensor")]);
        let carried = carry_reduced(&rebuilt, &from).unwrap();
        assert_eq!(carried.reduced(), &set(&["data"]));
        assert_eq!(carried.partitions(), rebuilt.partitions());

        let sharded_on_data = PartitionSpec::new([Some("data"), None]);
        let err = carry_reduced(&sharded_on_data, &from).unwrap_err();
        assert!(matches!(
            err,
            ShardingError::PartitionOverlapsTag {
                kind: TagKind::Reduced,
                ..
            }
        ));
        let unreduced_on_data = PartitionSpec::replicated()
            .with_unreduced(["data"])
            .unwrap();
        assert!(matches!(
            carry_reduced(&unreduced_on_data, &from),
            Err(ShardingError::TagsOverlap { .. })
        ));
        // Nothing to carry: the spec comes back unchanged.
        assert_eq!(
            carry_reduced(&rebuilt, &PartitionSpec::replicated()).unwrap(),
            rebuilt
        );
    }

    #[test]
    fn batch_axes() {
        let rules = LogicalAxisRules::maxtext();
        let mesh = Mesh::explicit([("data", 4), ("fsdp", 1), ("tensor", 2)]).unwrap();
        assert_eq!(rules.batch_mesh_axes(&mesh).unwrap(), set(&["data"]));
        let mesh = Mesh::explicit([("data", 2), ("fsdp", 2)]).unwrap();
        assert_eq!(
            rules.batch_mesh_axes(&mesh).unwrap(),
            set(&["data", "fsdp"])
        );
        let mesh = Mesh::explicit([("tensor", 4)]).unwrap();
        assert!(rules.batch_mesh_axes(&mesh).is_err());
    }

    #[test]
    fn bad_tables_are_rejected() {
        assert!(LogicalAxisRules::new([("a", vec!["x"]), ("a", vec!["y"])]).is_err());
        assert!(LogicalAxisRules::new([("a", vec!["x", "x"])]).is_err());
        assert!(LogicalAxisRules::new([("", vec!["x"])]).is_err());
        let rules = LogicalAxisRules::new([("batch", vec!["x"])]).unwrap();
        assert_eq!(rules.rule("batch").unwrap(), &["x".to_string()]);
    }
}
