/*!
The `comm` layer of ferrotext: collectives over groups of mesh axes, the backends that carry
them, the SPMD runner, and the collective trace.

It owns [`Communicator`] (one per device: `all_reduce`, `reduce_scatter`, `all_gather`,
`all_to_all`, `broadcast`, `barrier`, each over a list of mesh axes), the [`Backend`] trait and
its in-process implementation [`LocalBackend`], [`run_spmd`], and the [`Trace`] every collective
is recorded in. It must not know about autodiff or models: it moves `f32`/`bf16` buffers.

# Key decisions

* **The trace is recorded by the front end, not the backend**, so every backend (threads today,
  MPI and NCCL later, an abstract shape-only run) produces the same trace for the same program.
  Tests read it to prove where reductions happen; the trainer prints its per-phase summary.
* **Deterministic sums.** Every reduction adds the members' contributions in one fixed
  pairwise tree over the ranks (`tree_sum`), in `f32`, whatever device computes it, so results
  are bitwise identical on every member and from run to run, and a sum over consecutive blocks
  of a power-of-two size first gives the same bits as one over everything. A sum of `f32`
  values may travel as `bf16` (`narrow`, a wire [`DType`](ferrotext_sharding::DType)): each member's value rounded once, the sum
  added in `f32` and rounded once — half the bytes, two roundings more.
* **Collectives never hang.** A member that leaves (returns, fails, panics), a member that issues
  a different collective at the same point, or a timeout breaks the group, and every waiting
  member gets a [`CommError`]. [`run_spmd`] reports the first device that failed.

# Example
```
use std::sync::Arc;
use ferrotext_comm::{run_spmd, CollectiveKind, CommError, PhasePattern, SpmdOptions};
use ferrotext_sharding::Mesh;

let mesh = Arc::new(Mesh::explicit([("data", 2), ("tensor", 2)]).unwrap());
let traces = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
    let comm = dev.comm();
    comm.push_phase("update");
    let mut grad = vec![1.0f32; 8];
    comm.all_reduce(&["data"], &mut grad)?; // over the 2 devices sharing a `tensor` index
    comm.pop_phase();
    assert_eq!(grad, vec![2.0; 8]);
    Ok::<_, CommError>(comm.take_trace())
})
.unwrap();
assert_eq!(traces[0].count(CollectiveKind::AllReduce, &PhasePattern::new("update")), 1);
```
*/
#![deny(missing_docs)]

mod backend;
mod cluster;
mod communicator;
mod element;
mod error;
mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod narrow;
mod runner;
pub mod stream;
mod trace;
pub mod tree_sum;

pub use backend::{Backend, NoTransport, OpInfo, TypedBackend};
pub use cluster::{started_by_mpi_launcher, Cluster, MPI_LAUNCHER_VARIABLES};
pub use communicator::Communicator;
pub use element::{Buf, BufMut, Element};
pub use error::CommError;
pub use local::LocalBackend;
pub use runner::{
    collective_timeout, default_threads_per_device, run_spmd, run_spmd_detachable, run_spmd_in,
    Device, RunError, RunFailure, SpmdOptions, MAX_COLLECTIVE_TIMEOUT,
};
pub use stream::{Pending, Stream};
pub use trace::{human_bytes, CollectiveKind, PhaseKindTotal, PhasePattern, Trace, TraceEvent};
