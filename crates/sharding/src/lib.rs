/*!
The `sharding` layer of ferrotext: how values are laid out on a mesh of devices, as *types*.

It owns [`Mesh`], [`AxisType`], [`PartitionSpec`] (per-dimension partitions plus the
`unreduced` and `reduced` tag sets), [`NamedSharding`] (a spec checked against a mesh),
[`ArrayType`] (dtype + shape + sharding, printed `f32[8@data,4]{U:fsdp}`), and the MaxText-style
[`LogicalAxisRules`]. It must not know about tensors, threads or collectives: it describes
layouts, the `comm` and `spmd` layers act on them.

# The key decision: tags cannot be lost silently

In JAX a `PartitionSpec` is a tuple with two extra sets, and rebuilding a spec from `*spec`
drops them, which is how an expert weight's `reduced` tag vanished in MaxText's MoE path. Here
partitions and tags are separate private fields; every constructor checks the invariants
(R1.7, R1.8, and R1.11–R1.16 for a [`NamedSharding`]), and every helper that rebuilds
partitions — [`PartitionSpec::without_size_one_axes`], [`PartitionSpec::truncated_to_rank`],
[`PartitionSpec::adjusted_for_shape`], [`LogicalAxisRules::resolve_for`], [`carry_reduced`] —
goes through [`PartitionSpec::with_partitions`], which keeps the tags or returns why it cannot.
The only method that drops tags says so in its name ([`PartitionSpec::without_tags`]).

The rules cited (R1.x) are those of `docs/sharding-rules.md`.

# Example
```
use std::sync::Arc;
use ferrotext_sharding::{ArrayType, DType, LogicalAxisRules, Mesh, NamedSharding, PartitionSpec};

let mesh = Arc::new(Mesh::explicit([("data", 4), ("tensor", 2)]).unwrap());
let rules = LogicalAxisRules::maxtext();
// A weight [embed, mlp], tagged reduced over `data` for deferral.
let current = PartitionSpec::replicated().with_reduced(["data"]).unwrap();
let spec = rules.resolve_for(&[Some("embed"), Some("mlp")], &[256, 768], &mesh, &current).unwrap();
let ty = ArrayType::new(DType::F32, vec![256, 768], NamedSharding::new(mesh, spec).unwrap()).unwrap();
assert_eq!(ty.to_string(), "f32[256,768@tensor]{R:data}");
assert_eq!(ty.to_cotangent().to_string(), "f32[256,768@tensor]{U:data}");
```
*/
#![deny(missing_docs)]

mod array_type;
mod dim;
mod dtype;
mod error;
mod logical;
mod mesh;
mod named;
mod spec;

pub use array_type::{ArrayType, ManualTags};
pub use dim::{AxisSet, DimSpec, PartitionsRepr};
pub use dtype::DType;
pub use error::{ShardingError, TagKind};
pub use logical::{carry_reduced, LogicalAxisRules};
pub use mesh::{AxisType, Mesh, MeshAxis};
pub use named::NamedSharding;
pub use spec::PartitionSpec;
