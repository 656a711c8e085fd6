//! The type of a global array: dtype, shape and a [`NamedSharding`] that fits the shape, printed in
//! JAX's short form `f32[8@data,4]{U:fsdp, R:x}` (docs/sharding-rules.md §1.6).
//!
//! Invariants of an [`ArrayType`] (checked by [`ArrayType::new`]): the spec is padded with
//! replicated dimensions to exactly the array's rank (never longer), and every sharded dimension is
//! divisible by the product of its axis sizes (docs/sharding-rules.md §1.4). Tags are kept as
//! given.
//!
//! Inside a manual (`shard_map`) region a value's type also carries its [`ManualTags`] (JAX's
//! `mat`): the manual axes it is varying, unreduced or reduced over (docs/sharding-rules.md §6.1).
//! Those types are built by [`ArrayType::manual`]; outside a region the manual tags are empty.

use std::fmt;

use crate::dim::AxisSet;
use crate::dtype::DType;
use crate::error::ShardingError;
use crate::mesh::{AxisType, Mesh};
use crate::named::NamedSharding;

/// The per-axis state of a value inside a manual region (JAX's `ManualAxisType`,
/// docs/sharding-rules.md §1.4, §6.1): varying (devices hold different values), unreduced (partial
/// sums), reduced (identical, with an unreduced gradient); an axis in none of them is invarying.
///
/// Invariants (checked by [`ManualTags::new`]): the three sets are pairwise disjoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ManualTags {
    varying: AxisSet,
    unreduced: AxisSet,
    reduced: AxisSet,
}

impl ManualTags {
    /// Checks that the sets are pairwise disjoint.
    ///
    /// # Errors
    /// [`ShardingError::TagsOverlap`] when unreduced and reduced overlap, and
    /// [`ShardingError::InvalidMesh`] naming the rule when varying overlaps either
    /// ("varying and unreduced cannot have common mesh axes").
    pub fn new(
        varying: AxisSet,
        unreduced: AxisSet,
        reduced: AxisSet,
    ) -> Result<ManualTags, ShardingError> {
        if !unreduced.is_disjoint(&reduced) {
            return Err(ShardingError::TagsOverlap { unreduced, reduced });
        }
        for (name, set) in [("unreduced", &unreduced), ("reduced", &reduced)] {
            if !varying.is_disjoint(set) {
                return Err(ShardingError::InvalidMesh {
                    reason: format!(
                        "varying and {name} cannot have common mesh axes. Got varying={varying:?} and {name}={set:?}"
                    ),
                });
            }
        }
        Ok(ManualTags {
            varying,
            unreduced,
            reduced,
        })
    }

    /// Axes the devices hold different values over.
    pub fn varying(&self) -> &AxisSet {
        &self.varying
    }

    /// Axes the value holds partial sums over.
    pub fn unreduced(&self) -> &AxisSet {
        &self.unreduced
    }

    /// Axes the value is identical over, with an unreduced gradient.
    pub fn reduced(&self) -> &AxisSet {
        &self.reduced
    }

    /// True when all three sets are empty.
    pub fn is_empty(&self) -> bool {
        self.varying.is_empty() && self.unreduced.is_empty() && self.reduced.is_empty()
    }

    /// The cotangent's tags: varying kept, unreduced and reduced swapped (R4.2).
    pub fn to_cotangent(&self) -> ManualTags {
        ManualTags {
            varying: self.varying.clone(),
            unreduced: self.reduced.clone(),
            reduced: self.unreduced.clone(),
        }
    }
}

/// dtype + shape + a sharding that fits the shape. See the module docs for the invariants.
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use ferrotext_sharding::{ArrayType, DType, Mesh, NamedSharding, PartitionSpec};
/// let mesh = Arc::new(Mesh::explicit([("data", 2), ("fsdp", 2)]).unwrap());
/// let spec = PartitionSpec::new(["fsdp"]).with_unreduced(["data"]).unwrap();
/// let ty = ArrayType::new(DType::F32, vec![4, 4], NamedSharding::new(mesh, spec).unwrap()).unwrap();
/// assert_eq!(ty.to_string(), "f32[4@fsdp,4]{U:data}");
/// assert_eq!(ty.shard_shape(), vec![2, 4]);
/// ```
///
/// Its parts are shared (`Arc`): a type is cloned, moved and dropped a few times for every op
/// a device records and transposes (the tape, the type rules, the arrays), and each of those
/// was a deep copy of a shape, a spec and its axis sets; now it is a reference count.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ArrayType(std::sync::Arc<Parts>);

/// What an [`ArrayType`] is made of.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Parts {
    dtype: DType,
    shape: Vec<usize>,
    sharding: NamedSharding,
    manual: ManualTags,
}

impl fmt::Debug for ArrayType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArrayType")
            .field("dtype", &self.0.dtype)
            .field("shape", &self.0.shape)
            .field("sharding", &self.0.sharding)
            .field("manual", &self.0.manual)
            .finish()
    }
}

impl ArrayType {
    fn of(parts: Parts) -> ArrayType {
        ArrayType(std::sync::Arc::new(parts))
    }

    /// Checks `sharding` against `shape` and pads its spec to the rank.
    ///
    /// # Errors
    /// [`ShardingError::RankTooSmall`] or [`ShardingError::Indivisible`].
    pub fn new(
        dtype: DType,
        shape: Vec<usize>,
        sharding: NamedSharding,
    ) -> Result<ArrayType, ShardingError> {
        sharding.check_shape(&shape)?;
        let padded = sharding.spec().truncated_to_rank(shape.len());
        let sharding = sharding.with_spec(padded)?;
        Ok(ArrayType::of(Parts {
            dtype,
            shape,
            sharding,
            manual: ManualTags::default(),
        }))
    }

    /// The type of a per-device value inside a manual region over every axis of `mesh`: `shape`
    /// is the local shape, the spec is replicated, `tags` give the manual state
    /// (docs/sharding-rules.md §6.1).
    ///
    /// # Errors
    /// [`ShardingError::InvalidMesh`] when a mesh axis is not `Manual` or a tag names an axis the
    /// mesh does not have ("Axes mentioned in `manual_axis_type` ... should be of type `Manual`").
    pub fn manual(
        dtype: DType,
        shape: Vec<usize>,
        mesh: std::sync::Arc<Mesh>,
        tags: ManualTags,
    ) -> Result<ArrayType, ShardingError> {
        let not_manual = mesh
            .axes()
            .iter()
            .find(|a| a.axis_type() != AxisType::Manual);
        let unknown = tags
            .varying
            .iter()
            .chain(&tags.unreduced)
            .chain(&tags.reduced)
            .find(|a| mesh.axis(a).is_none());
        if let Some(axis) = not_manual
            .map(|a| a.name().to_string())
            .or(unknown.cloned())
        {
            return Err(ShardingError::InvalidMesh {
                reason: format!(
                    "Axes mentioned in `manual_axis_type` should be of type `Manual`; `{axis}` is not \
                     a manual axis of {mesh}"
                ),
            });
        }
        let sharding = NamedSharding::replicated(mesh)
            .with_spec(crate::spec::PartitionSpec::replicated().truncated_to_rank(shape.len()))?;
        Ok(ArrayType::of(Parts {
            dtype,
            shape,
            sharding,
            manual: tags,
        }))
    }

    /// The manual-region tags (empty outside a region).
    pub fn manual_tags(&self) -> &ManualTags {
        &self.0.manual
    }

    /// True for the type of a value inside a manual region.
    pub fn is_manual(&self) -> bool {
        self.mesh()
            .axes()
            .iter()
            .all(|a| a.axis_type() == AxisType::Manual)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }

    /// The sharding (its spec has exactly `rank` partitions).
    pub fn sharding(&self) -> &NamedSharding {
        &self.0.sharding
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        self.0.sharding.mesh()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.shape.len()
    }

    /// Number of elements of the global array.
    pub fn element_count(&self) -> usize {
        self.0.shape.iter().product()
    }

    /// The shape of one device's shard (tags do not shrink it, R1.20).
    pub fn shard_shape(&self) -> Vec<usize> {
        self.0
            .shape
            .iter()
            .zip(self.0.sharding.spec().partitions())
            .map(|(&n, dim)| {
                let parts: usize = dim
                    .axis_names()
                    .iter()
                    .filter_map(|a| self.mesh().axis(a).map(|x| x.size()))
                    .product();
                n / parts
            })
            .collect()
    }

    /// The cotangent's type: same dtype and shape, tags swapped (R4.2). Without tags to swap,
    /// this type itself (shared, not rebuilt).
    pub fn to_cotangent(&self) -> ArrayType {
        let (spec, manual) = (self.0.sharding.spec(), &self.0.manual);
        if spec.unreduced() == spec.reduced() && manual.unreduced() == manual.reduced() {
            return self.clone();
        }
        ArrayType::of(Parts {
            dtype: self.0.dtype,
            shape: self.0.shape.clone(),
            sharding: self.0.sharding.to_cotangent(),
            manual: self.0.manual.to_cotangent(),
        })
    }

    /// The same array in another dtype: shape, sharding and manual tags unchanged (JAX's
    /// `convert_element_type` changes nothing else).
    pub fn with_dtype(&self, dtype: DType) -> ArrayType {
        ArrayType::of(Parts {
            dtype,
            shape: self.0.shape.clone(),
            sharding: self.0.sharding.clone(),
            manual: self.0.manual.clone(),
        })
    }

    /// Axis names of `set` in mesh order, as printing wants them (R1.4).
    fn in_mesh_order<'a>(&'a self, set: &'a AxisSet) -> Vec<&'a str> {
        self.mesh()
            .axis_names()
            .filter(|a| set.contains(*a))
            .collect()
    }
}

/// `f32[8@data,4]{U:fsdp, R:x}`: each dim as `n`, `n@x` or `n@(x,y)` (only `Explicit` axes are part
/// of the type, so `Auto` ones are not printed), then `V:` (varying, manual regions only), `U:` and
/// `R:` in mesh order, each one name or a parenthesised list; no braces when untagged.
impl fmt::Display for ArrayType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.0.dtype)?;
        for (i, (n, dim)) in self
            .0
            .shape
            .iter()
            .zip(self.0.sharding.spec().partitions())
            .enumerate()
        {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{n}")?;
            let explicit: Vec<&str> = dim
                .axis_names()
                .iter()
                .map(String::as_str)
                .filter(|a| {
                    self.mesh()
                        .axis(a)
                        .is_some_and(|x| x.axis_type() == AxisType::Explicit)
                })
                .collect();
            write_axes(f, "@", &explicit)?;
        }
        f.write_str("]")?;
        let spec = self.0.sharding.spec();
        let union = |a: &AxisSet, b: &AxisSet| -> AxisSet { a.union(b).cloned().collect() };
        let (u, r) = (
            union(spec.unreduced(), &self.0.manual.unreduced),
            union(spec.reduced(), &self.0.manual.reduced),
        );
        let tags: Vec<(&str, Vec<&str>)> = [("V:", &self.0.manual.varying), ("U:", &u), ("R:", &r)]
            .into_iter()
            .map(|(label, set)| (label, self.in_mesh_order(set)))
            .filter(|(_, axes)| !axes.is_empty())
            .collect();
        if !tags.is_empty() {
            f.write_str("{")?;
            for (i, (label, axes)) in tags.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write_axes(f, label, axes)?;
            }
            f.write_str("}")?;
        }
        Ok(())
    }
}

/// `prefix` + `x` or `(x,y)`; nothing for no axes.
fn write_axes(f: &mut fmt::Formatter<'_>, prefix: &str, axes: &[&str]) -> fmt::Result {
    match axes {
        [] => Ok(()),
        [one] => write!(f, "{prefix}{one}"),
        many => write!(f, "{prefix}({})", many.join(",")),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::dim::DimSpec;
    use crate::spec::PartitionSpec;

    fn ty(mesh: &[(&str, usize, AxisType)], shape: &[usize], spec: PartitionSpec) -> String {
        let mesh = Arc::new(Mesh::new(mesh.iter().map(|&(n, s, t)| (n, s, t))).unwrap());
        ArrayType::new(
            DType::F32,
            shape.to_vec(),
            NamedSharding::new(mesh, spec).unwrap(),
        )
        .unwrap()
        .to_string()
    }

    const E: AxisType = AxisType::Explicit;

    #[test]
    fn manual_types_print_varying_first() {
        let mesh = Arc::new(
            Mesh::new([
                ("a", 1, AxisType::Manual),
                ("b", 1, AxisType::Manual),
                ("c", 1, AxisType::Manual),
            ])
            .unwrap(),
        );
        let set = |a: &str| -> AxisSet { [a.to_string()].into_iter().collect() };
        let tags = ManualTags::new(set("c"), set("a"), set("b")).unwrap();
        let t = ArrayType::manual(DType::F32, vec![1, 1, 1, 1], mesh.clone(), tags).unwrap();
        assert_eq!(t.to_string(), "f32[1,1,1,1]{V:c, U:a, R:b}");
        assert_eq!(t.to_cotangent().to_string(), "f32[1,1,1,1]{V:c, U:b, R:a}");
        assert!(ManualTags::new(set("a"), set("a"), AxisSet::new()).is_err());
        let explicit = Arc::new(Mesh::explicit([("a", 2)]).unwrap());
        assert!(ArrayType::manual(DType::F32, vec![2], explicit, ManualTags::default()).is_err());
    }

    /// The examples of docs/sharding-rules.md §1.6.
    #[test]
    fn golden_strings_of_section_1_6() {
        let abc = [("a", 1, E), ("b", 1, E), ("c", 1, E)];
        let spec = PartitionSpec::tagged([None::<&str>, None, None, None], ["a"], ["b"]).unwrap();
        assert_eq!(ty(&abc, &[1, 1, 1, 1], spec), "f32[1,1,1,1]{U:a, R:b}");
        let df = [("data", 2, E), ("fsdp", 2, E)];
        let spec = PartitionSpec::new(["fsdp"])
            .with_unreduced(["data"])
            .unwrap();
        assert_eq!(ty(&df, &[4, 4], spec), "f32[4@fsdp,4]{U:data}");
        let spec = PartitionSpec::replicated()
            .with_unreduced(["fsdp", "data"])
            .unwrap();
        assert_eq!(ty(&df, &[4, 4], spec), "f32[4,4]{U:(data,fsdp)}");
    }

    #[test]
    fn partitions_print_major_first_and_tags_in_mesh_order() {
        let xyz = [("x", 1, E), ("y", 2, E), ("z", 4, E)];
        assert_eq!(
            ty(&xyz, &[8], PartitionSpec::new([DimSpec::axes(["z", "x"])])),
            "f32[8@(z,x)]"
        );
        let spec = PartitionSpec::tagged(["x"], ["y"], ["z"]).unwrap();
        assert_eq!(ty(&xyz, &[8, 16], spec), "f32[8@x,16]{U:y, R:z}");
        let dft = [("data", 2, E), ("fsdp", 1, E), ("tensor", 2, E)];
        let spec = PartitionSpec::tagged(["fsdp"], ["tensor"], ["data"]).unwrap();
        assert_eq!(ty(&dft, &[16], spec), "f32[16@fsdp]{U:tensor, R:data}");
    }

    #[test]
    fn auto_axes_are_not_part_of_the_printed_type() {
        let mixed = [("x", 2, E), ("y", 2, AxisType::Auto)];
        let spec = PartitionSpec::new([Some("y"), None])
            .with_unreduced(["x"])
            .unwrap();
        assert_eq!(ty(&mixed, &[8, 4], spec), "f32[8,4]{U:x}");
        let mixed = [("x", 2, E), ("y", 1, AxisType::Auto), ("z", 2, E)];
        assert_eq!(
            ty(&mixed, &[8, 4], PartitionSpec::new(["x", "y"])),
            "f32[8@x,4]"
        );
    }

    #[test]
    fn spec_is_padded_to_rank() {
        let mesh = Arc::new(Mesh::explicit([("x", 2)]).unwrap());
        let t = ArrayType::new(
            DType::BF16,
            vec![4, 6, 2],
            NamedSharding::new(mesh, PartitionSpec::new(["x"])).unwrap(),
        )
        .unwrap();
        assert_eq!(t.sharding().spec().len(), 3);
        assert_eq!(t.to_string(), "bf16[4@x,6,2]");
        assert_eq!(t.shard_shape(), vec![2, 6, 2]);
    }
}
