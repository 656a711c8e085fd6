//! The one error type of the `sharding` layer.
//!
//! Messages keep JAX's texts where docs/sharding-rules.md §1 quotes them (so users of JAX recognise
//! them) and carry the offending values as fields.

use std::fmt;

use crate::dim::{AxisSet, DimSpec, FrozenSetRepr, PartitionsRepr, SetRepr};

/// Which of a spec's two tag sets an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TagKind {
    /// The `unreduced` set (`U:`).
    Unreduced,
    /// The `reduced` set (`R:`).
    Reduced,
}

impl TagKind {
    fn capitalized(self) -> &'static str {
        match self {
            TagKind::Unreduced => "Unreduced",
            TagKind::Reduced => "Reduced",
        }
    }
}

impl fmt::Display for TagKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TagKind::Unreduced => "unreduced",
            TagKind::Reduced => "reduced",
        })
    }
}

/// Why a mesh, spec, sharding, array type or logical-rule resolution is invalid.
///
/// Every variant corresponds to a rule of `docs/sharding-rules.md` §1 (named in its doc) or
/// to a mesh/rule-table precondition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardingError {
    /// A mesh that cannot exist (no axes, empty or repeated name, size 0, bad coordinates).
    #[error("invalid mesh: {reason}")]
    InvalidMesh {
        /// What is wrong.
        reason: String,
    },
    /// A mesh axis name that the mesh does not have (outside spec validation, e.g. a device group).
    #[error("mesh axis `{axis}` is not in the mesh (axes: {})", mesh_axes.join(", "))]
    UnknownAxis {
        /// The name asked for.
        axis: String,
        /// The mesh's axis names, in mesh order.
        mesh_axes: Vec<String>,
    },
    /// A device index past the end of the mesh.
    #[error("device {device} is out of range for a mesh of {device_count} devices")]
    DeviceOutOfRange {
        /// The index asked for.
        device: usize,
        /// Devices in the mesh.
        device_count: usize,
    },
    /// R1.7: the two tag sets overlap.
    #[error(
        "`unreduced` and `reduced` argument to PartitionSpec cannot overlap. \
         Got unreduced: {} and reduced: {}",
        FrozenSetRepr(unreduced),
        FrozenSetRepr(reduced)
    )]
    TagsOverlap {
        /// The unreduced set given.
        unreduced: AxisSet,
        /// The reduced set given.
        reduced: AxisSet,
    },
    /// R1.8: a partition uses an axis that is also tagged.
    #[error(
        "partitions cannot overlap with {kind} axes passed to PartitionSpec. \
         Got partitions: {partitions} and {kind} axes: {}",
        FrozenSetRepr(axes)
    )]
    PartitionOverlapsTag {
        /// Which tag set overlaps.
        kind: TagKind,
        /// The partitions given.
        partitions: PartitionsRepr,
        /// The tag set given.
        axes: AxisSet,
    },
    /// R1.11 / R1.12: a tag names an axis the mesh does not have.
    #[error(
        "{} axes {} is not found in mesh.axis_names={}. Got pspec={spec}",
        kind.capitalized(),
        missing.join(", "),
        TupleRepr(mesh_axes)
    )]
    TagAxisNotInMesh {
        /// Which tag set.
        kind: TagKind,
        /// The tagged axes that are not mesh axes.
        missing: Vec<String>,
        /// The mesh's axis names.
        mesh_axes: Vec<String>,
        /// The spec, printed.
        spec: String,
    },
    /// R1.13 / R1.14: a tag names an axis that is not `Explicit`.
    #[error(
        "{} axes can only refer to mesh axes that is of type `Explicit`. Got {kind} axes: {} and mesh: {mesh}",
        kind.capitalized(),
        FrozenSetRepr(axes)
    )]
    TagAxisNotExplicit {
        /// Which tag set.
        kind: TagKind,
        /// The tag set given.
        axes: AxisSet,
        /// The mesh, printed.
        mesh: String,
    },
    /// R1.15: a partition names an axis the mesh does not have.
    #[error(
        "Resource axis: {axis} of {} is not found in mesh: {}.",
        PRepr(partitions),
        TupleRepr(mesh_axes)
    )]
    PartitionAxisNotInMesh {
        /// The unknown axis.
        axis: String,
        /// The spec's partitions.
        partitions: Vec<DimSpec>,
        /// The mesh's axis names.
        mesh_axes: Vec<String>,
    },
    /// R1.16: an axis appears in two partitions (or twice in one).
    #[error(
        "A single NamedSharding spec specification can map every mesh axis to at most one \
         positional dimension, but {} has duplicate entries for `{axis}`",
        PRepr(partitions)
    )]
    DuplicateAxis {
        /// The repeated axis.
        axis: String,
        /// The spec's partitions.
        partitions: Vec<DimSpec>,
    },
    /// R1.17: an API that takes a target sharding got partitions or tags on Auto/Manual axes.
    #[error(
        "PartitionSpec passed to {api} cannot contain axis names that are of type Auto or Manual. \
         Got spec: {spec} and non-explicit axes: {}",
        axes.join(", ")
    )]
    NonExplicitAxisForApi {
        /// The API, e.g. `reshard`.
        api: String,
        /// The spec, printed.
        spec: String,
        /// The offending axes.
        axes: Vec<String>,
    },
    /// docs/sharding-rules.md §1.4: a sharded dimension is not divisible by the product of its axis sizes.
    #[error(
        "Sharding spec {} implies that array axis {dim} is partitioned {parts} times, but does not \
         evenly divide the dimension size {extent}. Got shape: {} and sharding {sharding}",
        PartitionsRepr(vec![partition.clone()]),
        ShapeRepr(shape)
    )]
    Indivisible {
        /// The dimension.
        dim: usize,
        /// Its partition.
        partition: DimSpec,
        /// Product of its axis sizes.
        parts: usize,
        /// Its extent.
        extent: usize,
        /// The whole shape.
        shape: Vec<usize>,
        /// The sharding, printed.
        sharding: String,
    },
    /// docs/sharding-rules.md §1.4: the spec has more partitions than the array has dimensions.
    #[error(
        "Sharding {sharding} is only valid for values of rank at least {spec_rank}, but was applied \
         to a value of rank {rank}"
    )]
    RankTooSmall {
        /// The array's rank.
        rank: usize,
        /// The spec's length.
        spec_rank: usize,
        /// The sharding, printed.
        sharding: String,
    },
    /// A logical-axis rule maps to a mesh axis the value is tagged on.
    #[error(
        "logical axis `{logical}` resolves to mesh axis `{axis}`, which the value is {kind} on; \
         a spec cannot both shard and tag an axis (R1.8). Got tags: unreduced={} reduced={}",
        SetRepr(unreduced),
        SetRepr(reduced)
    )]
    RuleConflictsWithTag {
        /// The logical axis name.
        logical: String,
        /// The mesh axis its rule chose.
        axis: String,
        /// Which tag it collides with.
        kind: TagKind,
        /// The value's unreduced set.
        unreduced: AxisSet,
        /// The value's reduced set.
        reduced: AxisSet,
    },
    /// No logical-axis rule resolves `logical` to a usable mesh axis.
    #[error("no logical axis rule resolves `{logical}` to a mesh axis of size > 1 on {mesh}")]
    NoUsableRule {
        /// The logical axis name.
        logical: String,
        /// The mesh, printed.
        mesh: String,
    },
    /// A logical rule table that cannot be used (empty name, rule naming an axis twice).
    #[error("invalid logical axis rules: {reason}")]
    InvalidRules {
        /// What is wrong.
        reason: String,
    },
}

/// `P('x', None)` from bare partitions.
struct PRepr<'a>(&'a [DimSpec]);

impl fmt::Display for PRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("P(")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str(")")
    }
}

/// `('x', 'y')` from names.
struct TupleRepr<'a>(&'a [String]);

impl fmt::Display for TupleRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<DimSpec> = self.0.iter().map(DimSpec::axis).collect();
        write!(f, "{}", PartitionsRepr(dims))
    }
}

/// `(3, 4)` from a shape.
pub(crate) struct ShapeRepr<'a>(pub &'a [usize]);

impl fmt::Display for ShapeRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("(")?;
        for (i, n) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{n}")?;
        }
        if self.0.len() == 1 {
            f.write_str(",")?;
        }
        f.write_str(")")
    }
}
