//! Sums of `f32` values that travel in a narrower element type: `grad_dtype=bfloat16`'s deferred
//! reduction, which moves half the bytes of the `f32` one.
//!
//! A reduction "as `bf16`" of `f32` buffers does, on every member:
//! 1. round its own buffer to `bf16` once (nearest even) — the one rounding of its contribution;
//! 2. run the `bf16` collective of the backend, which widens every member's `bf16` value, adds
//!    them in the fixed tree order of [`crate::tree_sum`] in `f32`, and rounds the sum to `bf16`
//!    once (the in-process backend and the flat MPI pipeline alike, so they are bitwise equal);
//! 3. widen the result back into `f32` (exact).
//!
//! So an element carries exactly two roundings more than the `f32` reduction: its member's value
//! and the reduced sum. A group of one still rounds its value (the sum of one member is itself),
//! so the result does not depend on the group's size in kind, only in value. Under MPI with
//! several devices in a process (the hierarchical layout of `mpi::backend`), the process's partial
//! sum is rounded to `bf16` before it crosses to other processes: one rounding more, and bits that
//! differ from the in-process run's; with one device per process the bits are the same.
//!
//! The element type on the wire is a [`DType`]: `f32` (the plain collective, bit for bit and byte
//! for byte) or `bf16`; any other is refused ([`CommError::WireDType`]) before anything moves.
//! The trace records a `bf16` reduction with its `bf16` element type (2 bytes an element).

use half::bf16;

use ferrotext_sharding::DType;

use crate::communicator::Communicator;
use crate::element::{check_wire, narrowed, round_trip, widen_into};
use crate::error::CommError;
use crate::stream::{Pending, Work};
use crate::trace::CollectiveKind;

impl Communicator {
    /// [`Communicator::all_reduce`] of `f32` values moved as `wire` (module docs): with
    /// `DType::BF16`, `buf` is rounded to `bf16`, summed in `f32` in the tree order, and the sum
    /// rounded once and widened back into `buf`.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`]; [`CommError::WireDType`] for a `wire` other than `f32` or
    /// `bf16`.
    ///
    /// # Collectives
    /// One all-reduce of `wire` elements.
    pub fn all_reduce_as<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        buf: &mut [f32],
        wire: DType,
    ) -> Result<(), CommError> {
        check_wire(CollectiveKind::AllReduce, axes, wire)?;
        if wire == DType::F32 {
            return self.all_reduce(axes, buf);
        }
        let mut narrow = narrowed(buf);
        self.all_reduce(axes, &mut narrow)?;
        widen_into(&narrow, buf);
        Ok(())
    }

    /// [`Communicator::reduce_scatter`] of `f32` values moved as `wire` (module docs).
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter`]; [`CommError::WireDType`] as above.
    ///
    /// # Collectives
    /// One reduce-scatter of `wire` elements.
    pub fn reduce_scatter_as<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: &[f32],
        output: &mut [f32],
        wire: DType,
    ) -> Result<(), CommError> {
        check_wire(CollectiveKind::ReduceScatter, axes, wire)?;
        if wire == DType::F32 {
            return self.reduce_scatter(axes, input, output);
        }
        let narrow = narrowed(input);
        let mut out = vec![bf16::ZERO; output.len()];
        self.reduce_scatter(axes, &narrow, &mut out)?;
        widen_into(&out, output);
        Ok(())
    }

    /// [`Communicator::start_all_reduce`] with `wire` the element type the reduction moves
    /// (module docs): the job's buffer is rounded to it on the stream thread, and
    /// [`Pending::wait`] gives the sum widened to `f32`.
    ///
    /// # Errors
    /// Bad axes. Collective failures come from [`Pending::wait`].
    ///
    /// # Collectives
    /// One all-reduce of `wire` elements on the background channel.
    pub fn start_all_reduce_as<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        buf: Vec<f32>,
        wire: DType,
    ) -> Result<Pending, CommError> {
        let op = self.begin_background(CollectiveKind::AllReduce, axes, buf.len(), wire)?;
        if op.group.len() == 1 {
            return Ok(Pending::done(Ok(round_trip(wire, buf))));
        }
        Ok(self.submit(op, Work::AllReduce(buf, wire)))
    }
}
