//! The cost model behind `ferrotext plan --cluster`: a predicted optimizer step on a cluster
//! nobody here has (docs/design.md §3 "Cost model", §9).
//!
//! One step of the config is planned twice in abstract mode — as given (the deferral gate
//! decides) and with `shard_mode=auto` (the gate closed: gradients all-reduced in every
//! micro-batch) — and each recorded collective is priced; compute comes from the model's FLOPs
//! and a device throughput the caller gives: a number, or one measured here, either from a
//! forward + backward micro-batch of the planned model on one device ([`measure_micro_batch`],
//! the calibrated default of `plan --cluster`) or from a square matmul
//! ([`measure_matmul_gflops`], a kernel's peak, which the model's other work makes 1.3–3×
//! optimistic).
//!
//! # The model
//! * **Compute** per micro-batch: `flops_per_token × micro-batch tokens ÷ devices` (each device's
//!   share of the training FLOPs) ÷ the device's throughput.
//! * **A collective** is priced per level of the hierarchy with the α–β ring costs of
//!   [`level_seconds`]: `n` members, `B` bytes (the trace's full buffer), link latency `α` and
//!   bandwidth `β`: all-reduce `2(n−1)/n·B/β + 2(n−1)α`; reduce-scatter and all-gather
//!   `(n−1)/n·B/β + (n−1)α`; all-to-all `(n−1)/n·B/β + (n−1)α`; broadcast `B/β + α`; barrier
//!   `2(n−1)α`. A group inside one host is priced over `intra` only. A group whose devices span
//!   `h` hosts with `m > 1` of them in each runs hierarchically, as the MPI backend does:
//!   reduce-scatter inside the host over `intra` (`m` members, `B`), the cross-host collective
//!   over `link` (`h` members, `B/m`), all-gather inside the host. With one member per host (or an
//!   uneven spread, or an all-to-all or broadcast, which the backend never splits) it runs flat
//!   over `link`.
//! * **The host link is shared**: with [`LinkShare::Host`] (the default, and what the emulated
//!   cluster shapes with `tc`), every device of a host issues the same collective at the same
//!   time, so the host's `L` devices share one link and each cross-host stage sees `β/L`. With
//!   [`LinkShare::Device`] each device has a link of its own.
//! * **Overlap** (`overlap_grad_reduce=true` in the config, when the config knows that key): a
//!   micro-batch's gradient reductions (all-reduces and reduce-scatters of more than 8 elements
//!   over a batch axis: `data`, `fsdp` or `expert`) hide behind its backward, taken as
//!   [`BACKWARD_SHARE`] of its compute; the step's update reduction hides behind the last
//!   micro-batch's backward. The reductions run one after another in the trace's order, each
//!   starting once the backward has finished its share of their bytes (gradients are finished
//!   at a steady rate, bucket by bucket, the last bucket — the embedding's — at the backward's
//!   end) and its predecessor is done; exposed is what runs past the backward
//!   ([`exposed_after_backward`]: `max(0, a − b)` for many small buckets, all of `a` for one).
//!   Without overlap everything is exposed.
//! * **The optimizer** streams the device's parameters, gradients and optimizer state once
//!   through memory: [`OptType::step_bytes_per_element`](ferrotext_train::OptType::step_bytes_per_element)
//!   bytes per element of the slice it steps
//!   (plus the scale-and-clip pass over the whole local gradient) over
//!   [`ClusterSpec::memory_bytes_per_second`].
//! * **A step** is `Σ_micro-batches (compute + their other collectives + exposed reduction) +
//!   the update's other collectives + the optimizer`. Collectives outside the step (set-up) are
//!   listed but not counted.
//! * **Memory** per device: [`ferrotext_train::RunPlan::memory_per_device`].

//!
//! # Files
//! | file | what it owns |
//! |---|---|
//! | `cluster.rs` | [`ClusterSpec`]: the `--cluster` text parsed (hosts, links, memory bandwidth) |
//! | `error.rs` | [`CostError`]: what the cost model fails with, in the training layer's classes |
//! | `price.rs` | pricing a planned step's trace on a cluster: [`predict`], [`collective_cost`] |
//! | `measure.rs` | measuring this machine: a micro-batch's throughput, a matmul's peak |

mod cluster;
mod error;
mod measure;
mod price;
#[cfg(test)]
mod tests;

pub use cluster::*;
pub use error::CostError;
pub use measure::*;
pub use price::*;
