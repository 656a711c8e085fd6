/*!
The `spmd` layer of ferrotext: global arrays under JAX's explicit-sharding rules, with
`reduced`/`unreduced` tags, `reshard`, reverse-mode autodiff and abstract (shape-only)
evaluation. It must not know about models, optimizers or files.

Main items: [`Array`] (a global array: type plus this device's shard), [`Ctx`] (one device's
context: communicator, mode, thread budget, tape), the ops on `Ctx` (elementwise,
`dot_general`, `reduce_sum`, `broadcast_in_dim`, `reshape`, `transpose`, `slice`, `concat`,
`take` (gather by [`Ids`]; `take_frozen`, whose backward leaves one row out), `select`,
`reshard`),
[`Ctx::shard_map`] with its casts and collectives (`pcast`, `psum`, `psum_scatter`,
`all_gather`, `all_to_all`),
[`Ctx::value_and_grad`] / [`Ctx::vjp`], the type rules in [`rules`], and the [`conformance`]
runner.

# Where things live

Each op family is one file holding the forwards (methods on [`Ctx`]) and, beside each, its
transpose; `tape` holds what the ops record and `autodiff` the reverse walk that dispatches to
them.

| file | owns |
|---|---|
| `ctx` | [`Ctx`]: construction, arrays from host data, the mode-aware collective helpers |
| `elementwise` | the unary ([`UnaryOp`]) and binary ops, and their transposes |
| `array` | [`Array`]: a type and this device's shard, stored in the type's dtype (bf16 rounded once where it is made) |
| `convert` | `cast` between f32 and bf16 (JAX's `convert_element_type`) and its transpose; `cast_memo` the casts a context remembers |
| `dot` | `dot_general`/`matmul` (bf16 operands on the bf16 product, `dot_general_preferred` for an f32 result) and their transposes (where deferral happens) |
| `shape_ops` | `reduce_sum`, `broadcast_in_dim`, `reshape`, `transpose` and their transposes |
| `reshard` | `reshard`, the data movement between layouts, and its transpose |
| `structural` | `slice`, `concat`, `take` (and `take_frozen`), `select` and their transposes |
| `ids` | [`Ids`]: index arrays (token ids, targets) |
| `rope` | rotary position embeddings (at positions from a start, or per token) and their transpose |
| `fused` | RMSNorm, softmax, SwiGLU, cross-entropy ([`IGNORE_INDEX`]) and their transposes |
| `head_loss` | the LM head's cross-entropy tiled over the tokens ([`HeadLoss`], its type rule in `rules/head_loss.rs`) and its transpose |
| `grouped` | `take_rows`, `grouped_matmul` (MoE, inside a region) and their transposes |
| `manual/typing` | the type rules inside a `shard_map` region ([`AxisState`]) |
| `manual/region` | `shard_map` and the boundary's transposes |
| `manual/collectives` | `pcast`, `psum`, `psum_scatter`, `all_gather`, `all_to_all` and their transposes |
| `bucketed` | fused reshards of many arrays ([`BucketPlan`]) |
| `flat` | values held in their buckets' flat buffers, accumulated and moved in place ([`BucketBuffers`]) |
| `tape` | the tape: what each recorded op keeps for its transpose; what a rematerialized region saves ([`SavePolicy`]) |
| `remat` | rematerialized regions ([`Ctx::remat`], [`Ctx::checkpoint_name`]) and their transpose: the replay |
| `autodiff` | `vjp`/`value_and_grad`, the reverse walk, gradients streamed to a [`GradientSink`] |
| [`rules`] | the type rules outside regions |

# The key decision: deferral falls out of the types

Every op computes its output type first (a type error stops it before any compute or
communication), then computes its shard and issues exactly the collectives its types require.
Autodiff gives each cotangent its primal's type with `reduced` and `unreduced` swapped, and each
transpose passes that type as the output sharding of the op it emits. So a weight typed
`{R:data}` gets a `{U:data}` gradient with no collective, and a plain weight gets its
all-reduce inside the transposed dot — nothing in the trainer has to special-case either.

# Example
```
use std::sync::Arc;
use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions};
use ferrotext_sharding::{Mesh, PartitionSpec};
use ferrotext_spmd::{Ctx, SpmdError};
use ferrotext_tensor::Tensor;

let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
let grads = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
    let mut cx = Ctx::new(dev.comm(), 1);
    let x_ty = cx.array_type(&[4, 3], PartitionSpec::new(["data"]))?;
    let x = cx.from_global(&Tensor::full(&[4, 3], 1.0), x_ty.sharding().clone())?;
    let w_ty = cx.array_type(&[3, 2], PartitionSpec::replicated().with_reduced(["data"])?)?;
    let w = cx.from_global(&Tensor::full(&[3, 2], 0.5), w_ty.sharding().clone())?;
    let (_, g) = cx.value_and_grad(&[w], |cx, p| {
        let y = cx.matmul(&x, &p[0], None)?;
        cx.reduce_sum(&y, &[0, 1], None)
    })?;
    let n_all_reduce = cx.comm().trace().count(CollectiveKind::AllReduce, &PhasePattern::any());
    Ok::<_, SpmdError>((g[0].ty().to_string(), n_all_reduce))
})
.unwrap();
// The gradient of a `{R:data}` weight is a per-device partial sum, and the backward pass
// communicated nothing (the one all-reduce is the forward loss sum over the batch).
assert_eq!(grads[0], ("f32[3,2]{U:data}".to_string(), 1));
```
*/
#![deny(missing_docs)]

mod array;
mod attention;
mod autodiff;
mod bucketed;
mod cast_memo;
pub mod conformance;
mod convert;
mod ctx;
mod dot;
mod elementwise;
mod error;
mod flat;
mod fused;
mod grouped;
mod head_loss;
mod ids;
mod manual;
mod remat;
mod reshard;
mod rope;
pub mod rules;
mod shape_ops;
mod structural;
mod tape;

pub use array::Array;
pub use attention::{AttentionSpec, QueryPlaces};
pub use autodiff::GradientSink;
pub use bucketed::{BucketPlan, StartedBucket};
pub use ctx::{on_device, Ctx, Mode};
pub use error::{ShardingTypeError, SpmdError, TypeErrorKind};
pub use flat::BucketBuffers;
pub use fused::IGNORE_INDEX;
pub use ids::Ids;
pub use manual::{AxisState, GatherTo};
pub use remat::RematFn;
pub use rules::head_loss::HeadLoss;
pub use rules::{BinaryOp, UnaryOp};
pub use tape::SavePolicy;
