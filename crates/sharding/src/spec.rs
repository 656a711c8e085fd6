//! `PartitionSpec`: how each array dimension is split over mesh axes, plus the `unreduced` and
//! `reduced` tag sets.
//!
//! Invariants of a [`PartitionSpec`] (checked by every constructor, so no other value exists):
//! 1. `unreduced ∩ reduced = ∅` (R1.7);
//! 2. no axis used in a partition is in `unreduced` or `reduced` (R1.8);
//! 3. partitions are canonical: a dimension split over no axes is [`DimSpec::Replicated`], never an
//!    empty list (R1.10).
//!
//! Rules of docs/sharding-rules.md §1.2 that Rust makes unrepresentable: tag sets are typed sets,
//! never a list or a string (R1.5), and cannot contain `None` (R1.6); only the `sum` kind of
//! unreduced exists, so there is no `unreduced_kind` to get wrong (R1.9). Tags are separate fields,
//! so no indexing or iteration of a spec can drop them (the `*pspec` guard of
//! docs/sharding-rules.md §1.2 has nothing to guard): every method that rebuilds partitions keeps
//! the tags, and one that cannot says so in its `Result`.
//!
//! Axis *existence* and *uniqueness* across partitions (R1.11–R1.16) need a mesh and are checked by
//! [`crate::NamedSharding`].

use std::fmt;

use crate::dim::{AxisSet, DimSpec, PartitionsRepr, SetRepr};
use crate::error::{ShardingError, TagKind};
use crate::mesh::Mesh;

/// Per-dimension partitions plus `unreduced` and `reduced` axis sets.
///
/// See the module docs for the invariants. Equality and hashing are structural over the three
/// fields (R1.18): `P('x') != P('x', None)`, and a tagged spec never equals its untagged
/// partitions. Trailing dimensions may be omitted; they are replicated.
///
/// # Examples
/// ```
/// use ferrotext_sharding::{DimSpec, PartitionSpec};
/// let spec = PartitionSpec::new([DimSpec::axis("fsdp"), DimSpec::Replicated])
///     .with_unreduced(["data"])
///     .unwrap();
/// assert_eq!(spec.to_string(), "P('fsdp', None, unreduced={'data'})");
/// // The cotangent type swaps the tags (R4.2).
/// assert_eq!(spec.to_cotangent().to_string(), "P('fsdp', None, reduced={'data'})");
/// // A tag may not overlap a partition (R1.8).
/// assert!(spec.with_reduced(["fsdp"]).is_err());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PartitionSpec {
    partitions: Vec<DimSpec>,
    unreduced: AxisSet,
    reduced: AxisSet,
}

impl PartitionSpec {
    /// An untagged spec with these partitions. Cannot fail: untagged partitions only need a mesh to
    /// be checked (R1.15, R1.16).
    pub fn new<D: Into<DimSpec>>(partitions: impl IntoIterator<Item = D>) -> PartitionSpec {
        PartitionSpec {
            partitions: partitions.into_iter().map(Into::into).collect(),
            unreduced: AxisSet::new(),
            reduced: AxisSet::new(),
        }
    }

    /// `P()`: replicated on every axis, no tags.
    pub fn replicated() -> PartitionSpec {
        PartitionSpec::default()
    }

    /// A spec with all three fields given.
    ///
    /// # Errors
    /// [`ShardingError::TagsOverlap`] (R1.7) or [`ShardingError::PartitionOverlapsTag`] (R1.8).
    pub fn tagged<D: Into<DimSpec>, U: Into<String>, R: Into<String>>(
        partitions: impl IntoIterator<Item = D>,
        unreduced: impl IntoIterator<Item = U>,
        reduced: impl IntoIterator<Item = R>,
    ) -> Result<PartitionSpec, ShardingError> {
        PartitionSpec {
            partitions: partitions.into_iter().map(Into::into).collect(),
            unreduced: unreduced.into_iter().map(Into::into).collect(),
            reduced: reduced.into_iter().map(Into::into).collect(),
        }
        .validated()
    }

    /// This spec with `axes` added to its unreduced set.
    ///
    /// # Errors
    /// As [`PartitionSpec::tagged`].
    pub fn with_unreduced<S: Into<String>>(
        &self,
        axes: impl IntoIterator<Item = S>,
    ) -> Result<PartitionSpec, ShardingError> {
        let mut spec = self.clone();
        spec.unreduced.extend(axes.into_iter().map(Into::into));
        spec.validated()
    }

    /// This spec with `axes` added to its reduced set.
    ///
    /// # Errors
    /// As [`PartitionSpec::tagged`].
    pub fn with_reduced<S: Into<String>>(
        &self,
        axes: impl IntoIterator<Item = S>,
    ) -> Result<PartitionSpec, ShardingError> {
        let mut spec = self.clone();
        spec.reduced.extend(axes.into_iter().map(Into::into));
        spec.validated()
    }

    /// This spec with its unreduced set replaced (JAX's `update(unreduced=...)`).
    ///
    /// # Errors
    /// As [`PartitionSpec::tagged`].
    pub fn with_unreduced_set(&self, unreduced: AxisSet) -> Result<PartitionSpec, ShardingError> {
        PartitionSpec {
            unreduced,
            ..self.clone()
        }
        .validated()
    }

    /// This spec with its reduced set replaced (JAX's `update(reduced=...)`).
    ///
    /// # Errors
    /// As [`PartitionSpec::tagged`].
    pub fn with_reduced_set(&self, reduced: AxisSet) -> Result<PartitionSpec, ShardingError> {
        PartitionSpec {
            reduced,
            ..self.clone()
        }
        .validated()
    }

    /// New partitions, the same tags: the one primitive every partition-rebuilding helper uses, so
    /// tags travel by construction.
    ///
    /// # Errors
    /// [`ShardingError::PartitionOverlapsTag`] when a new partition uses a tagged axis (R1.8).
    pub fn with_partitions<D: Into<DimSpec>>(
        &self,
        partitions: impl IntoIterator<Item = D>,
    ) -> Result<PartitionSpec, ShardingError> {
        PartitionSpec {
            partitions: partitions.into_iter().map(Into::into).collect(),
            ..self.clone()
        }
        .validated()
    }

    /// The same partitions with both tag sets emptied. The name says it: this is the only method
    /// that drops tags, for callers that build a plain layout on purpose (e.g. the target of the
    /// one reduction in `update`).
    pub fn without_tags(&self) -> PartitionSpec {
        PartitionSpec::new(self.partitions.clone())
    }

    /// The per-dimension partitions (the tag-safe accessor; JAX's `spec.partitions`).
    pub fn partitions(&self) -> &[DimSpec] {
        &self.partitions
    }

    /// Axes the value holds partial sums over.
    pub fn unreduced(&self) -> &AxisSet {
        &self.unreduced
    }

    /// Axes the value is replicated over and whose gradient may come back unreduced.
    pub fn reduced(&self) -> &AxisSet {
        &self.reduced
    }

    /// True when either tag set is non-empty.
    pub fn is_tagged(&self) -> bool {
        !self.unreduced.is_empty() || !self.reduced.is_empty()
    }

    /// Number of partitions given (tags not counted; `len(P(unreduced={'x'})) == 0`).
    pub fn len(&self) -> usize {
        self.partitions.len()
    }

    /// True when no partition is given (`P()`, possibly tagged).
    pub fn is_empty(&self) -> bool {
        self.partitions.is_empty()
    }

    /// The partition of dimension `dim`; dimensions past the end are replicated.
    pub fn dim(&self, dim: usize) -> &DimSpec {
        self.partitions.get(dim).unwrap_or(&DimSpec::Replicated)
    }

    /// Every axis used by a partition, flattened in dimension order (`S(v)` in the spec's
    /// notation; MaxText's `get_mesh_axes_used_by_tensor_spec`).
    pub fn partition_axes(&self) -> impl Iterator<Item = &str> + '_ {
        self.partitions
            .iter()
            .flat_map(|d| d.axis_names().iter().map(String::as_str))
    }

    /// True when `axis` is used by some partition.
    pub fn is_sharded_on(&self, axis: &str) -> bool {
        self.partition_axes().any(|a| a == axis)
    }

    /// The cotangent's spec: partitions unchanged, `reduced` and `unreduced` swapped (R4.2).
    ///
    /// | primal on axis A | cotangent on A |
    /// |---|---|
    /// | sharded | sharded |
    /// | replicated | replicated |
    /// | reduced `{R:A}` | unreduced `{U:A}` |
    /// | unreduced `{U:A}` | reduced `{R:A}` |
    ///
    /// Applying it twice gives the spec back.
    pub fn to_cotangent(&self) -> PartitionSpec {
        PartitionSpec {
            partitions: self.partitions.clone(),
            unreduced: self.reduced.clone(),
            reduced: self.unreduced.clone(),
        }
    }

    /// `spec + other`: partitions concatenated, tag sets united (JAX's `P.__add__`).
    ///
    /// # Errors
    /// When the union violates R1.7 or R1.8.
    pub fn concat(&self, other: &PartitionSpec) -> Result<PartitionSpec, ShardingError> {
        let mut spec = self.clone();
        spec.partitions.extend(other.partitions.iter().cloned());
        spec.unreduced.extend(other.unreduced.iter().cloned());
        spec.reduced.extend(other.reduced.iter().cloned());
        spec.validated()
    }

    /// Cut or pad (with replicated) the partitions to exactly `rank`, keeping the tags (MaxText's
    /// tag-safe `_truncate_pspec`). Never fails: removing partitions cannot create an overlap, and
    /// an axis that only the dropped dimensions used simply becomes replicated.
    pub fn truncated_to_rank(&self, rank: usize) -> PartitionSpec {
        let mut partitions = self.partitions.clone();
        partitions.resize(rank, DimSpec::Replicated);
        PartitionSpec {
            partitions,
            ..self.clone()
        }
    }

    /// Drop mesh axes of size 1 from every partition, keeping the tags (MaxText's
    /// `remove_size_one_mesh_axis`). Tags on size-1 axes are kept: they are harmless and dropping
    /// them would change what the cotangent rule sees.
    ///
    /// # Errors
    /// [`ShardingError::UnknownAxis`] for a partition axis the mesh does not have.
    pub fn without_size_one_axes(&self, mesh: &Mesh) -> Result<PartitionSpec, ShardingError> {
        let mut partitions = Vec::with_capacity(self.partitions.len());
        for dim in &self.partitions {
            let mut kept = Vec::new();
            for axis in dim.axis_names() {
                if mesh.axis_size(axis)? > 1 {
                    kept.push(axis.clone());
                }
            }
            partitions.push(DimSpec::axes(kept));
        }
        self.with_partitions(partitions)
    }

    /// Per dimension, keep the leading axes whose cumulative size divides the dimension and drop
    /// the rest, keeping the tags (MaxText's `adjust_pspec_for_indivisible_shapes`). Partitions
    /// beyond `shape`'s rank are dropped.
    ///
    /// # Errors
    /// [`ShardingError::UnknownAxis`] for a partition axis the mesh does not have.
    pub fn adjusted_for_shape(
        &self,
        shape: &[usize],
        mesh: &Mesh,
    ) -> Result<PartitionSpec, ShardingError> {
        let mut partitions = Vec::with_capacity(shape.len());
        for (d, &extent) in shape.iter().enumerate() {
            let mut kept = Vec::new();
            let mut product = 1;
            for axis in self.dim(d).axis_names() {
                product *= mesh.axis_size(axis)?;
                if extent % product != 0 {
                    break;
                }
                kept.push(axis.clone());
            }
            partitions.push(DimSpec::axes(kept));
        }
        self.with_partitions(partitions)
    }

    /// Checks R1.7 and R1.8, in JAX's order.
    fn validated(self) -> Result<PartitionSpec, ShardingError> {
        if !self.unreduced.is_disjoint(&self.reduced) {
            return Err(ShardingError::TagsOverlap {
                unreduced: self.unreduced,
                reduced: self.reduced,
            });
        }
        for (kind, set) in [
            (TagKind::Unreduced, &self.unreduced),
            (TagKind::Reduced, &self.reduced),
        ] {
            if self.partition_axes().any(|a| set.contains(a)) {
                return Err(ShardingError::PartitionOverlapsTag {
                    kind,
                    partitions: PartitionsRepr(self.partitions.clone()),
                    axes: set.clone(),
                });
            }
        }
        Ok(self)
    }
}

/// JAX 0.10.2's repr: `P('x', None, unreduced={'y'}, reduced={'z'})`; tags only when present.
impl fmt::Display for PartitionSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("P(")?;
        let mut first = true;
        let mut sep = |f: &mut fmt::Formatter<'_>| -> fmt::Result {
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            Ok(())
        };
        for dim in &self.partitions {
            sep(f)?;
            write!(f, "{dim}")?;
        }
        for (label, set) in [("unreduced", &self.unreduced), ("reduced", &self.reduced)] {
            if !set.is_empty() {
                sep(f)?;
                write!(f, "{label}={}", SetRepr(set))?;
            }
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn set(axes: &[&str]) -> AxisSet {
        axes.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn r1_7_unreduced_and_reduced_cannot_overlap() {
        let err = PartitionSpec::tagged([DimSpec::Replicated], ["y"], ["y", "z"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`unreduced` and `reduced` argument to PartitionSpec cannot overlap. \
             Got unreduced: frozenset({'y'}) and reduced: frozenset({'y', 'z'})"
        );
        assert!(matches!(err, ShardingError::TagsOverlap { .. }));
    }

    #[test]
    fn r1_8_partitions_cannot_overlap_tags() {
        let err = PartitionSpec::new([DimSpec::axes(["x", "y"])])
            .with_unreduced(["y"])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "partitions cannot overlap with unreduced axes passed to PartitionSpec. \
             Got partitions: (('x', 'y'),) and unreduced axes: frozenset({'y'})"
        );
        let err = PartitionSpec::tagged([Some("data"), None], Vec::<String>::new(), ["data"])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "partitions cannot overlap with reduced axes passed to PartitionSpec. \
             Got partitions: ('data', None) and reduced axes: frozenset({'data'})"
        );
        assert!(matches!(
            err,
            ShardingError::PartitionOverlapsTag {
                kind: TagKind::Reduced,
                ..
            }
        ));
    }

    #[test]
    fn r1_10_partitions_are_canonical() {
        assert_eq!(DimSpec::axes(Vec::<String>::new()), DimSpec::Replicated);
        assert_eq!(DimSpec::from(["x"]), DimSpec::axis("x"));
        assert_eq!(
            PartitionSpec::new([DimSpec::from(["x"]), DimSpec::axes(Vec::<String>::new())]),
            PartitionSpec::new([Some("x"), None])
        );
    }

    #[test]
    fn equality_is_structural() {
        let px = PartitionSpec::new(["x"]);
        assert_ne!(px, PartitionSpec::new([Some("x"), None]));
        assert_ne!(px, px.with_unreduced(["y"]).unwrap());
        assert_eq!(
            px.with_unreduced(["y"]).unwrap(),
            PartitionSpec::tagged(["x"], ["y"], Vec::<String>::new()).unwrap()
        );
        assert_eq!(
            PartitionSpec::replicated()
                .with_unreduced(["x"])
                .unwrap()
                .len(),
            0
        );
    }

    #[test]
    fn prints_like_jax_0_10() {
        let spec = PartitionSpec::tagged([Some("x"), None], ["y"], ["z"]).unwrap();
        assert_eq!(
            spec.to_string(),
            "P('x', None, unreduced={'y'}, reduced={'z'})"
        );
        assert_eq!(PartitionSpec::replicated().to_string(), "P()");
        assert_eq!(
            PartitionSpec::new([DimSpec::axes(["x", "y"])]).to_string(),
            "P(('x', 'y'))"
        );
        assert_eq!(
            PartitionsRepr(vec![DimSpec::axis("z")]).to_string(),
            "('z',)"
        );
    }

    #[test]
    fn concat_unites_tags_and_checks_them() {
        let a = PartitionSpec::new(["x"]).with_reduced(["z"]).unwrap();
        let b = PartitionSpec::new([None::<&str>])
            .with_unreduced(["y"])
            .unwrap();
        let ab = a.concat(&b).unwrap();
        assert_eq!(
            ab.to_string(),
            "P('x', None, unreduced={'y'}, reduced={'z'})"
        );
        assert!(a.concat(&PartitionSpec::new(["z"])).is_err());
    }

    #[test]
    fn rebuild_helpers_keep_tags() {
        let mesh = Mesh::explicit([("data", 4), ("fsdp", 1), ("tensor", 2)]).unwrap();
        let spec = PartitionSpec::new([DimSpec::axes(["fsdp", "tensor"]), DimSpec::axis("tensor")]);
        // (not valid on a mesh: tensor twice; the helpers do not care, NamedSharding does)
        let spec = spec.with_reduced(["data"]).unwrap();

        let no_ones = spec.without_size_one_axes(&mesh).unwrap();
        assert_eq!(no_ones.partitions()[0], DimSpec::axis("tensor"));
        assert_eq!(no_ones.reduced(), &set(&["data"]));

        let adjusted =
            PartitionSpec::new([DimSpec::axes(["tensor", "fsdp"]), DimSpec::axis("fsdp")])
                .with_unreduced(["data"])
                .unwrap()
                .adjusted_for_shape(&[3, 8], &mesh)
                .unwrap();
        assert_eq!(
            adjusted.partitions(),
            &[DimSpec::Replicated, DimSpec::axis("fsdp")]
        );
        assert_eq!(adjusted.unreduced(), &set(&["data"]));

        let truncated = spec.truncated_to_rank(1);
        assert_eq!(truncated.len(), 1);
        assert_eq!(truncated.reduced(), &set(&["data"]));
        assert_eq!(spec.truncated_to_rank(3).len(), 3);
        assert_eq!(spec.truncated_to_rank(3).reduced(), &set(&["data"]));
    }

    fn arb_spec() -> impl Strategy<Value = PartitionSpec> {
        let axes = ["a", "b", "c", "d", "e"];
        // Each axis goes to one of: dim 0, dim 1, unreduced, reduced, nowhere.
        proptest::collection::vec(0u8..5, axes.len()).prop_map(move |places| {
            let mut dims = vec![Vec::new(), Vec::new()];
            let (mut u, mut r) = (Vec::new(), Vec::new());
            for (axis, place) in axes.iter().zip(places) {
                match place {
                    0 | 1 => dims[place as usize].push(*axis),
                    2 => u.push(*axis),
                    3 => r.push(*axis),
                    _ => {}
                }
            }
            PartitionSpec::tagged(dims.into_iter().map(DimSpec::axes), u, r).unwrap()
        })
    }

    proptest! {
        #[test]
        fn cotangent_twice_is_identity(spec in arb_spec()) {
            prop_assert_eq!(spec.to_cotangent().to_cotangent(), spec.clone());
            let cotangent = spec.to_cotangent();
            prop_assert_eq!(cotangent.unreduced(), spec.reduced());
        }

        #[test]
        fn rebuilds_keep_tags(spec in arb_spec(), rank in 0usize..4, d0 in 1usize..9, d1 in 1usize..9) {
            let mesh = Mesh::explicit([("a", 2), ("b", 1), ("c", 4), ("d", 2), ("e", 1)]).unwrap();
            let rebuilt = [
                spec.truncated_to_rank(rank),
                spec.without_size_one_axes(&mesh).unwrap(),
                spec.adjusted_for_shape(&[d0, d1], &mesh).unwrap(),
            ];
            for r in rebuilt {
                prop_assert_eq!(r.unreduced(), spec.unreduced());
                prop_assert_eq!(r.reduced(), spec.reduced());
            }
        }
    }
}
