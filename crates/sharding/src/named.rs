//! `NamedSharding`: a [`PartitionSpec`] checked against a [`Mesh`].
//!
//! Invariants of a [`NamedSharding`] (checked by [`NamedSharding::new`], on top of the spec's own,
//! see [`crate::spec`]):
//! 1. every unreduced axis and every reduced axis is a mesh axis (R1.11, R1.12);
//! 2. every tagged axis is `Explicit` (R1.13, R1.14);
//! 3. every partition axis is a mesh axis (R1.15);
//! 4. no mesh axis appears in two partitions or twice in one (R1.16).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use crate::dim::{AxisSet, DimSpec};
use crate::error::{ShardingError, TagKind};
use crate::mesh::{AxisType, Mesh};
use crate::spec::PartitionSpec;

/// A mesh plus a spec that is valid on it. See the module docs for the invariants.
///
/// Equality is structural (mesh and spec, R1.18): `{R:x}` and plain are unequal but
/// [equivalent](NamedSharding::is_equivalent_to).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NamedSharding {
    mesh: Arc<Mesh>,
    spec: PartitionSpec,
}

impl NamedSharding {
    /// Checks `spec` against `mesh`.
    ///
    /// # Errors
    /// The first violated rule among R1.11–R1.16, in that order.
    pub fn new(mesh: Arc<Mesh>, spec: PartitionSpec) -> Result<NamedSharding, ShardingError> {
        let mesh_axes = || mesh.axis_names().map(str::to_string).collect::<Vec<_>>();
        for (kind, set) in [
            (TagKind::Unreduced, spec.unreduced()),
            (TagKind::Reduced, spec.reduced()),
        ] {
            let missing: Vec<String> = set
                .iter()
                .filter(|a| mesh.axis(a).is_none())
                .cloned()
                .collect();
            if !missing.is_empty() {
                return Err(ShardingError::TagAxisNotInMesh {
                    kind,
                    missing,
                    mesh_axes: mesh_axes(),
                    spec: spec.to_string(),
                });
            }
        }
        for (kind, set) in [
            (TagKind::Unreduced, spec.unreduced()),
            (TagKind::Reduced, spec.reduced()),
        ] {
            let all_explicit = set.iter().all(|a| {
                mesh.axis(a)
                    .is_some_and(|x| x.axis_type() == AxisType::Explicit)
            });
            if !all_explicit {
                return Err(ShardingError::TagAxisNotExplicit {
                    kind,
                    axes: set.clone(),
                    mesh: mesh.to_string(),
                });
            }
        }
        let mut used: Vec<&str> = Vec::new();
        for axis in spec.partition_axes() {
            if mesh.axis(axis).is_none() {
                return Err(ShardingError::PartitionAxisNotInMesh {
                    axis: axis.to_string(),
                    partitions: spec.partitions().to_vec(),
                    mesh_axes: mesh_axes(),
                });
            }
        }
        for axis in spec.partition_axes() {
            if used.contains(&axis) {
                return Err(ShardingError::DuplicateAxis {
                    axis: axis.to_string(),
                    partitions: spec.partitions().to_vec(),
                });
            }
            used.push(axis);
        }
        Ok(NamedSharding { mesh, spec })
    }

    /// Replicated on every axis, untagged (`P()`).
    pub fn replicated(mesh: Arc<Mesh>) -> NamedSharding {
        NamedSharding {
            mesh,
            spec: PartitionSpec::replicated(),
        }
    }

    /// The mesh.
    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.mesh
    }

    /// The spec.
    pub fn spec(&self) -> &PartitionSpec {
        &self.spec
    }

    /// The same mesh with another spec.
    ///
    /// # Errors
    /// As [`NamedSharding::new`].
    pub fn with_spec(&self, spec: PartitionSpec) -> Result<NamedSharding, ShardingError> {
        NamedSharding::new(self.mesh.clone(), spec)
    }

    /// The cotangent's sharding: tags swapped (R4.2). Always valid: the swapped sets name the same
    /// explicit axes.
    pub fn to_cotangent(&self) -> NamedSharding {
        NamedSharding {
            mesh: self.mesh.clone(),
            spec: self.spec.to_cotangent(),
        }
    }

    /// The shape of one device's shard of an array of `shape` (R1.20: tags do not shrink it).
    ///
    /// # Errors
    /// [`ShardingError::RankTooSmall`] when the spec is longer than `shape`, and
    /// [`ShardingError::Indivisible`] when a sharded dimension is not divisible by its axes.
    pub fn shard_shape(&self, shape: &[usize]) -> Result<Vec<usize>, ShardingError> {
        self.check_shape(shape)?;
        shape
            .iter()
            .enumerate()
            .map(|(d, &n)| Ok(n / self.dim_parts(d)?))
            .collect()
    }

    /// The index range of each dimension that `device` holds for an array of `shape`; a dimension
    /// split over `(a, b)` is indexed with `a` major.
    ///
    /// # Errors
    /// As [`NamedSharding::shard_shape`], plus [`ShardingError::DeviceOutOfRange`].
    pub fn shard_ranges(
        &self,
        shape: &[usize],
        device: usize,
    ) -> Result<Vec<Range<usize>>, ShardingError> {
        let shard = self.shard_shape(shape)?;
        let coords = self.mesh.coords(device)?;
        let mut ranges = Vec::with_capacity(shape.len());
        for (d, &len) in shard.iter().enumerate() {
            let mut index = 0;
            for axis in self.spec.dim(d).axis_names() {
                let p = self
                    .mesh
                    .axis_index(axis)
                    .ok_or_else(|| self.mesh.unknown_axis(axis))?;
                index = index * self.mesh.axes()[p].size() + coords[p];
            }
            ranges.push(index * len..(index + 1) * len);
        }
        Ok(ranges)
    }

    /// Checks that this sharding fits an array of `shape` (docs/sharding-rules.md §1.4): the spec
    /// is no longer than the rank and each sharded dimension is divisible by the product of its
    /// axis sizes.
    ///
    /// # Errors
    /// [`ShardingError::RankTooSmall`] or [`ShardingError::Indivisible`].
    pub fn check_shape(&self, shape: &[usize]) -> Result<(), ShardingError> {
        if self.spec.len() > shape.len() {
            return Err(ShardingError::RankTooSmall {
                rank: shape.len(),
                spec_rank: self.spec.len(),
                sharding: self.to_string(),
            });
        }
        for (d, &extent) in shape.iter().enumerate() {
            let parts = self.dim_parts(d)?;
            if extent % parts != 0 {
                return Err(ShardingError::Indivisible {
                    dim: d,
                    partition: self.spec.dim(d).clone(),
                    parts,
                    extent,
                    shape: shape.to_vec(),
                    sharding: self.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Number of pieces dimension `dim` is split into.
    ///
    /// # Errors
    /// Never for a valid sharding (the axes exist); typed for safety.
    pub fn dim_parts(&self, dim: usize) -> Result<usize, ShardingError> {
        self.mesh.axes_size(self.spec.dim(dim).axis_names())
    }

    /// R1.19: false whenever the value is unreduced over devices, or split over more than one
    /// device; a reduced-only spec is fully replicated.
    pub fn is_fully_replicated(&self) -> bool {
        if self.mesh.device_count() == 1 {
            return true;
        }
        let spans_devices = |a: &str| self.mesh.axis(a).is_some_and(|x| x.size() > 1);
        !self.spec.partition_axes().any(spans_devices)
            && !self.spec.unreduced().iter().any(|a| spans_devices(a))
    }

    /// R1.18: same physical layout on an array of rank `rank`. Reduced is physically replicated,
    /// so `{R:x}` is equivalent to plain; unreduced is not. Size-1 axes and trailing replicated
    /// dimensions do not matter.
    pub fn is_equivalent_to(&self, other: &NamedSharding, rank: usize) -> bool {
        let physical = |s: &NamedSharding| -> Option<(Vec<DimSpec>, AxisSet)> {
            let spec = s.spec.truncated_to_rank(rank.max(s.spec.len()));
            let spec = spec.without_size_one_axes(&s.mesh).ok()?;
            let unreduced = spec
                .unreduced()
                .iter()
                .filter(|a| s.mesh.axis(a).is_some_and(|x| x.size() > 1))
                .cloned()
                .collect();
            Some((spec.partitions().to_vec(), unreduced))
        };
        self.mesh.device_count() == other.mesh.device_count()
            && self
                .mesh
                .axes()
                .iter()
                .map(|a| (a.name(), a.size()))
                .eq(other.mesh.axes().iter().map(|a| (a.name(), a.size())))
            && physical(self).is_some()
            && physical(self) == physical(other)
    }

    /// R1.17: APIs that take a target sharding (`reshard`, `out_sharding`) refuse partitions or
    /// tags on `Auto`/`Manual` axes.
    ///
    /// # Errors
    /// [`ShardingError::NonExplicitAxisForApi`] naming `api` and the offending axes.
    pub fn check_explicit_for(&self, api: &str) -> Result<(), ShardingError> {
        let mut bad: Vec<String> = self
            .spec
            .partition_axes()
            .chain(self.spec.unreduced().iter().map(String::as_str))
            .chain(self.spec.reduced().iter().map(String::as_str))
            .filter(|a| {
                self.mesh
                    .axis(a)
                    .is_some_and(|x| x.axis_type() != AxisType::Explicit)
            })
            .map(str::to_string)
            .collect();
        bad.dedup();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(ShardingError::NonExplicitAxisForApi {
                api: api.to_string(),
                spec: self.spec.to_string(),
                axes: bad,
            })
        }
    }
}

/// `NamedSharding(mesh=Mesh('x': 2, axis_types=(Explicit,)), spec=P('x', None))`.
impl fmt::Display for NamedSharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NamedSharding(mesh={}, spec={})", self.mesh, self.spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(axes: &[(&str, usize, AxisType)]) -> Arc<Mesh> {
        Arc::new(Mesh::new(axes.iter().map(|&(n, s, t)| (n, s, t))).unwrap())
    }

    fn xy() -> Arc<Mesh> {
        mesh(&[("x", 2, AxisType::Explicit), ("y", 2, AxisType::Explicit)])
    }

    #[test]
    fn r1_11_unreduced_axis_must_exist() {
        let spec =
            PartitionSpec::tagged([None::<&str>, None], ["w"], Vec::<String>::new()).unwrap();
        let err = NamedSharding::new(xy(), spec).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Unreduced axes w is not found in mesh.axis_names=('x', 'y'). \
             Got pspec=P(None, None, unreduced={'w'})"
        );
    }

    #[test]
    fn r1_12_reduced_axis_must_exist() {
        let spec =
            PartitionSpec::tagged([None::<&str>, None], Vec::<String>::new(), ["y", "w"]).unwrap();
        let err = NamedSharding::new(xy(), spec).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Reduced axes w is not found in mesh.axis_names=('x', 'y'). \
             Got pspec=P(None, None, reduced={'w', 'y'})"
        );
    }

    #[test]
    fn r1_13_unreduced_axis_must_be_explicit() {
        let m = mesh(&[("x", 2, AxisType::Explicit), ("y", 2, AxisType::Auto)]);
        let spec = PartitionSpec::replicated().with_unreduced(["y"]).unwrap();
        let err = NamedSharding::new(m, spec).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Unreduced axes can only refer to mesh axes that is of type `Explicit`. \
             Got unreduced axes: frozenset({'y'}) and mesh: Mesh('x': 2, 'y': 2, axis_types=(Explicit, Auto))"
        );
        let manual = mesh(&[("x", 2, AxisType::Manual)]);
        let spec = PartitionSpec::replicated().with_unreduced(["x"]).unwrap();
        assert!(matches!(
            NamedSharding::new(manual, spec),
            Err(ShardingError::TagAxisNotExplicit {
                kind: TagKind::Unreduced,
                ..
            })
        ));
    }

    #[test]
    fn r1_14_reduced_axis_must_be_explicit() {
        let m = mesh(&[("x", 2, AxisType::Auto)]);
        let spec = PartitionSpec::replicated().with_reduced(["x"]).unwrap();
        let err = NamedSharding::new(m, spec).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Reduced axes can only refer to mesh axes that is of type `Explicit`. \
             Got reduced axes: frozenset({'x'}) and mesh: Mesh('x': 2, axis_types=(Auto,))"
        );
    }

    #[test]
    fn r1_15_partition_axis_must_exist() {
        let err = NamedSharding::new(xy(), PartitionSpec::new([Some("w"), None])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Resource axis: w of P('w', None) is not found in mesh: ('x', 'y')."
        );
    }

    #[test]
    fn r1_16_no_axis_in_two_partitions() {
        let err = NamedSharding::new(xy(), PartitionSpec::new(["x", "x"])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "A single NamedSharding spec specification can map every mesh axis to at most one \
             positional dimension, but P('x', 'x') has duplicate entries for `x`"
        );
        let err = NamedSharding::new(
            xy(),
            PartitionSpec::new([DimSpec::axes(["y", "x"]), DimSpec::axis("x")]),
        )
        .unwrap_err();
        assert!(err
            .to_string()
            .ends_with("but P(('y', 'x'), 'x') has duplicate entries for `x`"));
    }

    #[test]
    fn r1_17_api_targets_must_be_explicit() {
        let m = mesh(&[("x", 2, AxisType::Explicit), ("y", 2, AxisType::Auto)]);
        let ns = NamedSharding::new(m, PartitionSpec::new(["y"])).unwrap();
        let err = ns.check_explicit_for("reshard").unwrap_err();
        assert!(err
            .to_string()
            .starts_with("PartitionSpec passed to reshard cannot contain axis names that are of type Auto or Manual."));
        assert!(ns
            .with_spec(PartitionSpec::new(["x"]))
            .unwrap()
            .check_explicit_for("reshard")
            .is_ok());
    }

    #[test]
    fn r1_18_equality_and_equivalence() {
        let plain = NamedSharding::new(xy(), PartitionSpec::new([None::<&str>])).unwrap();
        let reduced = plain
            .with_spec(
                PartitionSpec::new([None::<&str>])
                    .with_reduced(["x"])
                    .unwrap(),
            )
            .unwrap();
        let unreduced = plain
            .with_spec(
                PartitionSpec::new([None::<&str>])
                    .with_unreduced(["x"])
                    .unwrap(),
            )
            .unwrap();
        assert_ne!(plain, reduced);
        assert_ne!(plain, unreduced);
        assert!(reduced.is_equivalent_to(&plain, 2));
        assert!(!unreduced.is_equivalent_to(&plain, 2));
        let sharded = plain.with_spec(PartitionSpec::new(["x"])).unwrap();
        assert!(!sharded.is_equivalent_to(&plain, 2));
    }

    #[test]
    fn r1_19_fully_replicated() {
        let plain = NamedSharding::replicated(xy());
        assert!(plain.is_fully_replicated());
        assert!(plain
            .with_spec(PartitionSpec::replicated().with_reduced(["x"]).unwrap())
            .unwrap()
            .is_fully_replicated());
        assert!(!plain
            .with_spec(PartitionSpec::replicated().with_unreduced(["x"]).unwrap())
            .unwrap()
            .is_fully_replicated());
        assert!(!plain
            .with_spec(PartitionSpec::new(["y"]))
            .unwrap()
            .is_fully_replicated());
    }

    #[test]
    fn r1_20_shard_shape_ignores_tags() {
        let ns = NamedSharding::new(
            xy(),
            PartitionSpec::new(["x"]).with_unreduced(["y"]).unwrap(),
        )
        .unwrap();
        assert_eq!(ns.shard_shape(&[8, 4]).unwrap(), vec![4, 4]);
        let both =
            NamedSharding::new(xy(), PartitionSpec::new([DimSpec::axes(["x", "y"])])).unwrap();
        assert_eq!(both.shard_shape(&[8, 4]).unwrap(), vec![2, 4]);
    }

    #[test]
    fn shape_errors_name_the_dimension() {
        let ns = NamedSharding::new(xy(), PartitionSpec::new([Some("y"), None])).unwrap();
        let err = ns.shard_shape(&[3, 4]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Sharding spec ('y',) implies that array axis 0 is partitioned 2 times, but does not evenly \
             divide the dimension size 3. Got shape: (3, 4) and sharding NamedSharding(mesh=Mesh('x': 2, \
             'y': 2, axis_types=(Explicit, Explicit)), spec=P('y', None))"
        );
        let err = ns
            .with_spec(PartitionSpec::new([None, Some("y")]))
            .unwrap()
            .shard_shape(&[8])
            .unwrap_err();
        assert!(err.to_string().ends_with(
            "is only valid for values of rank at least 2, but was applied to a value of rank 1"
        ));
    }

    #[test]
    fn shard_ranges_are_major_first() {
        let ns = NamedSharding::new(xy(), PartitionSpec::new([DimSpec::axes(["y", "x"])])).unwrap();
        // device 1 = (x 0, y 1): index = y*2 + x = 2
        assert_eq!(ns.shard_ranges(&[8, 3], 1).unwrap(), vec![4..6, 0..3]);
        // device 2 = (x 1, y 0): index 1
        assert_eq!(ns.shard_ranges(&[8, 3], 2).unwrap(), vec![2..4, 0..3]);
    }
}
