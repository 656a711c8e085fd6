//! The device mesh: ordered named axes, their sizes and types, and the device groups along them.
//!
//! Invariants of a [`Mesh`] (checked by [`Mesh::new`], so no other value exists):
//! 1. at least one axis; every name non-empty and unique (R1.1);
//! 2. every size ≥ 1;
//! 3. devices are numbered row-major over the axes in mesh order: the last axis varies fastest.

use std::fmt;

use crate::error::ShardingError;

/// How the type system treats a mesh axis (spec R1.1–R1.3).
///
/// Only `Explicit` axes may carry `reduced`/`unreduced` tags (R1.13, R1.14); `Manual` axes appear
/// inside `shard_map` regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AxisType {
    /// Shardings on this axis are part of the type and checked by every op.
    Explicit,
    /// The partitioner chooses; the type system does not see this axis.
    Auto,
    /// Inside a manual (`shard_map`) region: each device sees only its own shard.
    Manual,
}

impl fmt::Display for AxisType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AxisType::Explicit => "Explicit",
            AxisType::Auto => "Auto",
            AxisType::Manual => "Manual",
        })
    }
}

/// One named axis of a mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MeshAxis {
    name: String,
    size: usize,
    axis_type: AxisType,
}

impl MeshAxis {
    /// The axis name, e.g. `data`.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Number of devices along this axis (≥ 1).
    pub fn size(&self) -> usize {
        self.size
    }
    /// How the type system treats this axis.
    pub fn axis_type(&self) -> AxisType {
        self.axis_type
    }
}

/// An ordered list of named axes with sizes and types; the devices are its row-major grid.
///
/// See the module docs for the invariants. Equality and hashing are structural (names, sizes,
/// types, in order), like JAX's abstract mesh.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    axes: Vec<MeshAxis>,
}

impl Mesh {
    /// Builds a mesh from `(name, size, type)` triples in mesh order.
    ///
    /// # Errors
    /// [`ShardingError::InvalidMesh`] when there are no axes, a name is empty or repeated, or a
    /// size is zero.
    pub fn new<S: Into<String>>(
        axes: impl IntoIterator<Item = (S, usize, AxisType)>,
    ) -> Result<Mesh, ShardingError> {
        let axes: Vec<MeshAxis> = axes
            .into_iter()
            .map(|(name, size, axis_type)| MeshAxis {
                name: name.into(),
                size,
                axis_type,
            })
            .collect();
        let invalid = |reason: String| Err(ShardingError::InvalidMesh { reason });
        if axes.is_empty() {
            return invalid("a mesh needs at least one axis".into());
        }
        for (i, axis) in axes.iter().enumerate() {
            if axis.name.is_empty() {
                return invalid(format!("axis {i} has an empty name"));
            }
            if axis.size == 0 {
                return invalid(format!("axis `{}` has size 0", axis.name));
            }
            if axes[..i].iter().any(|a| a.name == axis.name) {
                return invalid(format!("axis `{}` appears twice", axis.name));
            }
        }
        Ok(Mesh { axes })
    }

    /// A mesh whose axes are all [`AxisType::Explicit`] (what `jax.make_mesh` builds, R1.2).
    ///
    /// # Errors
    /// As [`Mesh::new`].
    pub fn explicit<S: Into<String>>(
        axes: impl IntoIterator<Item = (S, usize)>,
    ) -> Result<Mesh, ShardingError> {
        Mesh::new(
            axes.into_iter()
                .map(|(name, size)| (name, size, AxisType::Explicit)),
        )
    }

    /// The same mesh with every axis set to `axis_type`.
    pub fn with_all_axis_types(&self, axis_type: AxisType) -> Mesh {
        let mut mesh = self.clone();
        for axis in &mut mesh.axes {
            axis.axis_type = axis_type;
        }
        mesh
    }

    /// The axes in mesh order.
    pub fn axes(&self) -> &[MeshAxis] {
        &self.axes
    }

    /// Axis names in mesh order.
    pub fn axis_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.axes.iter().map(|a| a.name.as_str())
    }

    /// Position of `name` in mesh order, if the axis exists.
    pub fn axis_index(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|a| a.name == name)
    }

    /// The axis called `name`, if it exists.
    pub fn axis(&self, name: &str) -> Option<&MeshAxis> {
        self.axes.iter().find(|a| a.name == name)
    }

    /// Size of the axis `name`.
    ///
    /// # Errors
    /// [`ShardingError::UnknownAxis`] when the mesh has no such axis.
    pub fn axis_size(&self, name: &str) -> Result<usize, ShardingError> {
        self.axis(name)
            .map(MeshAxis::size)
            .ok_or_else(|| self.unknown_axis(name))
    }

    /// Product of the sizes of `names` (1 for none).
    ///
    /// # Errors
    /// [`ShardingError::UnknownAxis`] for a name that is not a mesh axis.
    pub fn axes_size<S: AsRef<str>>(&self, names: &[S]) -> Result<usize, ShardingError> {
        names
            .iter()
            .try_fold(1, |acc, n| Ok(acc * self.axis_size(n.as_ref())?))
    }

    /// Total number of devices (the product of all axis sizes).
    pub fn device_count(&self) -> usize {
        self.axes.iter().map(|a| a.size).product()
    }

    /// True when every axis is `Explicit`.
    pub fn is_all_explicit(&self) -> bool {
        self.axes.iter().all(|a| a.axis_type == AxisType::Explicit)
    }

    /// The coordinates of `device` along each axis, in mesh order (row-major numbering).
    ///
    /// # Errors
    /// [`ShardingError::DeviceOutOfRange`] when `device >= device_count()`.
    pub fn coords(&self, device: usize) -> Result<Vec<usize>, ShardingError> {
        self.check_device(device)?;
        let mut coords = vec![0; self.axes.len()];
        let mut rest = device;
        for (c, axis) in coords.iter_mut().zip(&self.axes).rev() {
            *c = rest % axis.size;
            rest /= axis.size;
        }
        Ok(coords)
    }

    /// The device at `coords` (one per axis, in mesh order).
    ///
    /// # Errors
    /// [`ShardingError::InvalidMesh`] when the number of coordinates or any coordinate is out of
    /// range.
    pub fn device_at(&self, coords: &[usize]) -> Result<usize, ShardingError> {
        if coords.len() != self.axes.len()
            || coords.iter().zip(&self.axes).any(|(c, a)| *c >= a.size)
        {
            return Err(ShardingError::InvalidMesh {
                reason: format!("coordinates {coords:?} do not address a device of {self}"),
            });
        }
        Ok(coords
            .iter()
            .zip(&self.axes)
            .fold(0, |acc, (c, a)| acc * a.size + c))
    }

    /// The devices that share `device`'s coordinates on every axis *not* in `group_axes`, ordered
    /// by their coordinates along `group_axes` with the first listed axis major.
    ///
    /// This is the group a collective "over `group_axes`" runs in; the position of a device in the
    /// returned list is its rank in the group (its index along a dimension sharded over
    /// `group_axes` in that order). With no axes the group is the device alone.
    ///
    /// # Errors
    /// [`ShardingError::UnknownAxis`] or [`ShardingError::InvalidMesh`] (an axis listed twice), and
    /// [`ShardingError::DeviceOutOfRange`].
    pub fn group_of<S: AsRef<str>>(
        &self,
        device: usize,
        group_axes: &[S],
    ) -> Result<Vec<usize>, ShardingError> {
        let base = self.coords(device)?;
        let positions = self.axis_positions(group_axes)?;
        let size: usize = positions.iter().map(|&p| self.axes[p].size).product();
        let mut members = Vec::with_capacity(size);
        let mut coords = base;
        for rank in 0..size {
            let mut rest = rank;
            for &p in positions.iter().rev() {
                coords[p] = rest % self.axes[p].size;
                rest /= self.axes[p].size;
            }
            members.push(self.device_at(&coords)?);
        }
        Ok(members)
    }

    /// Every group along `group_axes` (see [`Mesh::group_of`]), ordered by their first device.
    ///
    /// # Errors
    /// As [`Mesh::group_of`].
    pub fn groups<S: AsRef<str>>(
        &self,
        group_axes: &[S],
    ) -> Result<Vec<Vec<usize>>, ShardingError> {
        let mut seen = vec![false; self.device_count()];
        let mut groups = Vec::new();
        for device in 0..self.device_count() {
            if seen[device] {
                continue;
            }
            let group = self.group_of(device, group_axes)?;
            for &d in &group {
                seen[d] = true;
            }
            groups.push(group);
        }
        Ok(groups)
    }

    /// Mesh positions of `names`, in the order given; rejects unknown and repeated axes.
    fn axis_positions<S: AsRef<str>>(&self, names: &[S]) -> Result<Vec<usize>, ShardingError> {
        let mut positions = Vec::with_capacity(names.len());
        for name in names {
            let name = name.as_ref();
            let p = self
                .axis_index(name)
                .ok_or_else(|| self.unknown_axis(name))?;
            if positions.contains(&p) {
                return Err(ShardingError::InvalidMesh {
                    reason: format!("axis `{name}` is listed twice in a device group"),
                });
            }
            positions.push(p);
        }
        Ok(positions)
    }

    fn check_device(&self, device: usize) -> Result<(), ShardingError> {
        if device >= self.device_count() {
            return Err(ShardingError::DeviceOutOfRange {
                device,
                device_count: self.device_count(),
            });
        }
        Ok(())
    }

    pub(crate) fn unknown_axis(&self, name: &str) -> ShardingError {
        ShardingError::UnknownAxis {
            axis: name.to_string(),
            mesh_axes: self.axis_names().map(str::to_string).collect(),
        }
    }
}

/// JAX's form: `Mesh('x': 2, 'y': 2, axis_types=(Explicit, Auto))`.
impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Mesh(")?;
        for axis in &self.axes {
            write!(f, "'{}': {}, ", axis.name, axis.size)?;
        }
        f.write_str("axis_types=(")?;
        for (i, axis) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", axis.axis_type)?;
        }
        if self.axes.len() == 1 {
            f.write_str(",")?;
        }
        f.write_str("))")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh_2_1_2() -> Mesh {
        Mesh::explicit([("a", 2), ("b", 1), ("c", 2)]).unwrap()
    }

    #[test]
    fn devices_are_row_major() {
        let mesh = Mesh::explicit([("x", 2), ("y", 3)]).unwrap();
        assert_eq!(mesh.device_count(), 6);
        assert_eq!(mesh.coords(0).unwrap(), vec![0, 0]);
        assert_eq!(mesh.coords(1).unwrap(), vec![0, 1]);
        assert_eq!(mesh.coords(3).unwrap(), vec![1, 0]);
        assert_eq!(mesh.coords(5).unwrap(), vec![1, 2]);
        for d in 0..6 {
            assert_eq!(mesh.device_at(&mesh.coords(d).unwrap()).unwrap(), d);
        }
        assert!(mesh.coords(6).is_err());
    }

    #[test]
    fn groups_follow_the_listed_axis_order() {
        let mesh = mesh_2_1_2();
        assert_eq!(mesh.groups(&["a"]).unwrap(), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(mesh.groups(&["c"]).unwrap(), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(mesh.groups(&["a", "c"]).unwrap(), vec![vec![0, 1, 2, 3]]);
        // `c` major: rank order walks `c` slowest.
        assert_eq!(mesh.groups(&["c", "a"]).unwrap(), vec![vec![0, 2, 1, 3]]);
        let none: [&str; 0] = [];
        assert_eq!(
            mesh.groups(&none).unwrap(),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        assert_eq!(mesh.group_of(3, &["b"]).unwrap(), vec![3]);
    }

    #[test]
    fn bad_meshes_and_axes_are_rejected() {
        assert!(Mesh::explicit::<&str>([]).is_err());
        assert!(Mesh::explicit([("x", 2), ("x", 2)]).is_err());
        assert!(Mesh::explicit([("x", 0)]).is_err());
        assert!(Mesh::explicit([("", 1)]).is_err());
        let mesh = mesh_2_1_2();
        assert!(matches!(
            mesh.group_of(0, &["z"]),
            Err(ShardingError::UnknownAxis { .. })
        ));
        assert!(mesh.group_of(0, &["a", "a"]).is_err());
    }

    #[test]
    fn prints_like_jax() {
        let mesh = Mesh::new([("x", 2, AxisType::Explicit), ("y", 2, AxisType::Auto)]).unwrap();
        assert_eq!(
            mesh.to_string(),
            "Mesh('x': 2, 'y': 2, axis_types=(Explicit, Auto))"
        );
        let one = Mesh::new([("x", 2, AxisType::Auto)]).unwrap();
        assert_eq!(one.to_string(), "Mesh('x': 2, axis_types=(Auto,))");
    }
}
