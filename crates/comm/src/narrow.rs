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
//! Invariants: `Wire::F32` is the plain `f32` collective, bit for bit and byte for byte; the trace
//! records a `Wire::Bf16` reduction with its `bf16` element type (2 bytes an element).

use half::bf16;

use ferrotext_sharding::DType;

use crate::communicator::Communicator;
use crate::error::CommError;
use crate::stream::{Pending, Work};
use crate::trace::CollectiveKind;

/// The element type a reduction of `f32` values moves (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Wire {
    /// `f32`: nothing is rounded.
    #[default]
    F32,
    /// `bf16`: each member's value rounded once, the sum in `f32`, rounded once.
    Bf16,
}

impl Wire {
    /// Its element type, as the trace records it.
    pub fn dtype(self) -> DType {
        match self {
            Wire::F32 => DType::F32,
            Wire::Bf16 => DType::BF16,
        }
    }

    /// Bytes of one element on the wire.
    pub fn bytes(self) -> usize {
        self.dtype().size_bytes()
    }

    /// `x` rounded to this type and widened back (the identity for `F32`).
    pub fn round_trip(self, mut x: Vec<f32>) -> Vec<f32> {
        if self == Wire::Bf16 {
            for v in &mut x {
                *v = bf16::from_f32(*v).to_f32();
            }
        }
        x
    }
}

/// `x` rounded to `bf16` (nearest even).
pub(crate) fn narrowed(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// `out` = `x` widened (exact).
pub(crate) fn widen_into(x: &[bf16], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.to_f32();
    }
}

impl Communicator {
    /// [`Communicator::all_reduce`] of `f32` values moved as `wire` (module docs): with
    /// `Wire::Bf16`, `buf` is rounded to `bf16`, summed in `f32` in the tree order, and the sum
    /// rounded once and widened back into `buf`.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    ///
    /// # Collectives
    /// One all-reduce of `wire` elements.
    pub fn all_reduce_as<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        buf: &mut [f32],
        wire: Wire,
    ) -> Result<(), CommError> {
        match wire {
            Wire::F32 => self.all_reduce(axes, buf),
            Wire::Bf16 => {
                let mut narrow = narrowed(buf);
                self.all_reduce(axes, &mut narrow)?;
                widen_into(&narrow, buf);
                Ok(())
            }
        }
    }

    /// [`Communicator::reduce_scatter`] of `f32` values moved as `wire` (module docs).
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter`].
    ///
    /// # Collectives
    /// One reduce-scatter of `wire` elements.
    pub fn reduce_scatter_as<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: &[f32],
        output: &mut [f32],
        wire: Wire,
    ) -> Result<(), CommError> {
        match wire {
            Wire::F32 => self.reduce_scatter(axes, input, output),
            Wire::Bf16 => {
                let narrow = narrowed(input);
                let mut out = vec![bf16::ZERO; output.len()];
                self.reduce_scatter(axes, &narrow, &mut out)?;
                widen_into(&out, output);
                Ok(())
            }
        }
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
        wire: Wire,
    ) -> Result<Pending, CommError> {
        let op = self.begin_background(CollectiveKind::AllReduce, axes, buf.len(), wire)?;
        if op.group.len() == 1 {
            return Ok(Pending::done(Ok(wire.round_trip(buf))));
        }
        Ok(self.submit(op, Work::AllReduce(buf, wire)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounding to nearest even, against the bits written out: 1 + 2⁻⁸ is a tie between 1 and
    /// 1 + 2⁻⁷ and goes to 1 (even); 1 + 3·2⁻⁹ rounds up.
    #[test]
    fn the_round_trip_rounds_to_nearest_even_and_f32_is_the_identity() {
        let x = vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-9), -3.5];
        assert_eq!(
            Wire::Bf16.round_trip(x.clone()),
            vec![1.0, 1.0 + 2f32.powi(-7), -3.5]
        );
        assert_eq!(Wire::F32.round_trip(x.clone()), x);
        assert_eq!((Wire::F32.bytes(), Wire::Bf16.bytes()), (4, 2));
    }
}
