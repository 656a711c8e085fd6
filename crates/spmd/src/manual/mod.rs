//! `shard_map`: a manual region over every mesh axis, with JAX's varying / invarying / unreduced
//! / reduced typing inside (docs/sharding-rules.md §6), its casts and collectives, and their
//! transposes.
//!
//! Inside the region each value is this device's block, typed by [`ManualTags`]: per axis it is
//! *varying* (devices differ), *invarying* (identical), *unreduced* (partial sums) or *reduced*
//! (identical, gradient unreduced). The boundary maps an outside type to an inside one: axes in
//! the in_spec partitions become varying, the in_spec tags stay tags (R6.5); on the way out the
//! body's tags must equal the out_spec's and its varying axes must be those the out_spec shards
//! on (R6.6). The boundary moves no data and adds no collective (R6.14).
//!
//! Ops inside need equal varying sets (R6.9); a missing varying axis is cast in automatically
//! (R6.10): `reduced_vary_cast` when the operand is reduced on exactly those axes (transpose:
//! `vary_unreduced_cast`, free), else `pvary` (transpose: **psum**). That is the whole story of
//! MoE expert weights: tagged `{R:data}` they reach the `data`-varying tokens through a free
//! cast and their gradients leave the region `{U:data}`; untagged, a `pvary` puts an all-reduce
//! over `data` into every backward pass.
//!
//! The files: [`typing`] holds the type rules inside a region (the axis states, the rules of the
//! local ops, the casts' and collectives' result types); `region` holds `shard_map` itself and
//! the boundary's transposes; `op` the primitives as the tape records them; `collectives` holds the casts and collectives (`pcast`, `psum`,
//! `psum_scatter`, `all_gather`, `all_to_all`), the automatic casts of R6.10, and each
//! primitive's transpose (docs/sharding-rules.md §6.4's table).

mod collectives;
pub(crate) mod op;
mod region;
pub(crate) mod typing;

pub use op::GatherTo;
pub(crate) use region::{enter_region_transpose, exit_region_transpose};
pub use typing::AxisState;
