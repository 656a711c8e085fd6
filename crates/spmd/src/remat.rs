//! Rematerialization (JAX's `jax.checkpoint`, MaxText's `remat_policy`): a region of the
//! program whose inside the tape does not keep. [`Ctx::remat`] runs the region once forward and
//! records one node holding only its inputs and what its [`SavePolicy`] saves; the backward
//! runs the region again on the same inputs (replay), walks the replay's own tape, and passes
//! the inputs' cotangents on.
//!
//! Invariants:
//! * Same bits as without the region: the replay repeats the forward's ops on the same inputs,
//!   each deterministic, and a value the policy saved is the forward's own result, used in
//!   place of recomputing it. A parameter whose whole gradient comes from the region still goes
//!   into the gradient sink's buffer, through the replay's walk, in the same order.
//! * Every device replays the same program, so collectives inside the region are issued again,
//!   in the backward, in the same order everywhere; the collective trace labels them
//!   `…/recompute` (and the profiler counts the replay as backward time).
//! * Saved values are keyed by their op's position on the region's tape, which the replay
//!   reaches in the same order; only an op that is recorded (some input differentiated) takes
//!   a position, and only such an op looks one up.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use crate::array::Array;
use crate::autodiff::GradientSink;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::tape::{Backward, RematState, SavePolicy, Tape};

/// A region's function: its inputs (as leaves of the region's tape) to its outputs. Called once
/// forward and once again in the backward, with the same inputs.
pub type RematFn =
    Arc<dyn Fn(&mut Ctx<'_>, &[Array]) -> Result<Vec<Array>, SpmdError> + Send + Sync>;

/// What the tape keeps of a region (`Backward::Remat`'s payload, held there opaquely so that
/// the tape need not know the function's type): its inputs, its function, what its forward
/// saved, and how many outputs it has.
pub(crate) struct Region {
    inputs: Vec<Array>,
    f: RematFn,
    saved: HashMap<usize, Array>,
}

impl Ctx<'_> {
    /// Runs `f` on `inputs` as a rematerialized region (see the module docs): the outputs, each
    /// recorded as produced by the region, which the tape keeps as `inputs` and what `policy`
    /// saves. Without a tape, or when no input is differentiated, `f` just runs.
    ///
    /// # Errors
    /// `f`'s; an empty output list.
    ///
    /// # Collectives
    /// `f`'s, forward; in the backward, `f`'s again (less those of saved values), then their
    /// transposes.
    pub fn remat(
        &mut self,
        inputs: &[Array],
        policy: &SavePolicy,
        f: RematFn,
    ) -> Result<Vec<Array>, SpmdError> {
        let recording = self.tape.is_some() && inputs.iter().any(|a| a.var.is_some());
        if !recording {
            return f(self, inputs);
        }
        let state = RematState::Forward {
            policy: policy.clone(),
            saved: HashMap::new(),
        };
        let (outs, state) = self.run_region(inputs, state, &f)?;
        let saved = match state {
            RematState::Forward { saved, .. } | RematState::Replay { saved } => saved,
        };
        let mut outs = outs.into_iter();
        let first = outs.next().ok_or(SpmdError::Internal {
            op: "remat",
            invariant: "a region has an output",
        })?;
        let rest: Vec<Array> = outs.collect();
        let refs: Vec<&Array> = inputs.iter().collect();
        let node = Backward::Remat {
            region: Arc::new(Region {
                inputs: inputs.to_vec(),
                f,
                saved,
            }),
            outputs: 1 + rest.len(),
        };
        let first = self.record(node, &refs, first)?;
        let mut all = vec![first.clone()];
        for (j, out) in rest.into_iter().enumerate() {
            all.push(self.record(Backward::RematOutput { index: j + 1 }, &[&first], out)?);
        }
        Ok(all)
    }

    /// `x`, named `name` for the save policies of the region it is computed in: a policy that
    /// names it keeps it, and the replay uses it instead of recomputing the op that made it.
    /// Outside a region, or for a value not recorded, nothing happens.
    pub fn checkpoint_name(&mut self, x: &Array, name: &'static str) -> Array {
        if let (Some(RematState::Forward { policy, saved }), Some(v)) = (&mut self.remat, x.var) {
            if policy.names.contains(&name) {
                saved.insert(v, x.clone());
            }
        }
        x.clone()
    }

    /// In a replay, the saved output of the op about to be recorded (`inputs` are its
    /// operands): `None` when nothing was saved for it, outside a replay, or when the op will
    /// not be recorded.
    pub(crate) fn replayed(&self, inputs: &[&Array]) -> Option<Array> {
        let Some(RematState::Replay { saved }) = &self.remat else {
            return None;
        };
        if !inputs.iter().any(|a| a.var.is_some()) {
            return None;
        }
        let at = self.tape.as_ref()?.nodes.len();
        saved.get(&at).map(|a| a.with_type(a.ty().clone()))
    }

    /// Runs `f` on `inputs` as leaves of a tape of its own, under `state`; restores the outer
    /// tape and state. Returns the outputs (their tape variables cleared) and the state as `f`
    /// left it; the region's tape is dropped.
    fn run_region(
        &mut self,
        inputs: &[Array],
        state: RematState,
        f: &RematFn,
    ) -> Result<(Vec<Array>, RematState), SpmdError> {
        let (outs, tape, state) = self.replay_region(inputs, state, f)?;
        drop(tape);
        Ok((outs, state))
    }

    /// [`Ctx::run_region`], keeping the region's tape and leaves: `(outputs with their region
    /// variables, (tape, leaves), state)`.
    #[allow(clippy::type_complexity)]
    fn replay_region(
        &mut self,
        inputs: &[Array],
        state: RematState,
        f: &RematFn,
    ) -> Result<(Vec<Array>, (Tape, Vec<Array>), RematState), SpmdError> {
        let outer_tape = self.tape.replace(Tape::default());
        let outer_state = self.remat.replace(state);
        let leaves: Vec<Array> = inputs.iter().map(|x| self.leaf(x)).collect();
        let result = f(self, &leaves);
        let tape = self.tape.take().unwrap_or_default();
        self.tape = outer_tape;
        let state = std::mem::replace(&mut self.remat, outer_state);
        let outs = result?;
        let state = state.ok_or(SpmdError::Internal {
            op: "remat",
            invariant: "a region's state outlives it",
        })?;
        Ok((outs, (tape, leaves), state))
    }

    /// The transpose of a region: its function replayed on its inputs (with the forward's saved
    /// values)
    /// under a `recompute` phase label, and the replay's tape walked from `cts` (one per
    /// output, `None` where an output got none). `sink_of[i]` is the gradient sink's parameter
    /// index for input `i` when its whole gradient comes from this region: the replay's walk
    /// may add it into the sink's buffer. Returns each input's cotangent, `None` for those that
    /// went into the buffer.
    pub(crate) fn remat_transpose(
        &mut self,
        region: &Arc<dyn Any + Send + Sync>,
        cts: Vec<Option<Array>>,
        sink: &mut dyn GradientSink,
        sink_of: &[Option<usize>],
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        let region = region.downcast_ref::<Region>().ok_or(SpmdError::Internal {
            op: "remat",
            invariant: "a region node holds a region",
        })?;
        self.comm().push_phase("recompute");
        let state = RematState::Replay {
            saved: region.saved.clone(),
        };
        let replay = self.replay_region(&region.inputs, state, &region.f);
        self.comm().pop_phase();
        let (outs, (tape, leaves), _) = replay?;
        let mut seeds = Vec::new();
        for (out, ct) in outs.iter().zip(cts) {
            if let (Some(v), Some(ct)) = (out.var, ct) {
                seeds.push((v, ct));
            }
        }
        let mut inner = RegionSink {
            outer: sink,
            sink_of,
        };
        self.backward_from(tape, seeds, &leaves, &mut inner)
    }
}

/// The sink of a replay's walk: offers the outer sink's buffer for the inputs whose whole
/// gradient comes from the region; everything else comes back as the walk's result.
struct RegionSink<'s> {
    outer: &'s mut dyn GradientSink,
    sink_of: &'s [Option<usize>],
}

impl GradientSink for RegionSink<'_> {
    fn buffer(&mut self, k: usize, ty: &ferrotext_sharding::ArrayType) -> Option<Vec<&mut [f32]>> {
        let outer = (*self.sink_of.get(k)?)?;
        self.outer.buffer(outer, ty)
    }

    fn finished(&mut self, _: &mut Ctx<'_>, _: usize, _: Option<&Array>) -> Result<(), SpmdError> {
        // The outer walk hands each input's cotangent on (or reports it sunk) itself.
        Ok(())
    }
}
