//! Reverse-mode autodiff on a per-device tape, with the cotangent-type rule.
//!
//! Owns `vjp` / `value_and_grad` and the reverse walk over the tape (`crate::tape`: what each
//! recorded op keeps for its transpose). The transposes themselves live beside their forward
//! ops (as JAX registers a primitive's transpose rule beside it): `elementwise`, `dot`,
//! `shape_ops`, `reshard`, `structural`, `fused`, `grouped`, and `manual` for the region and its
//! collectives. The walk only dispatches to them and adds up contributions.
//!
//! The rule that makes deferral work (R4.2–R4.3): the cotangent of a value has the value's type
//! with `reduced` and `unreduced` swapped, and each transpose emits its op with that type as the
//! output sharding. So a weight typed `{R:data}` used against activations sharded on `data` gets
//! a gradient typed `{U:data}` from a transposed dot that communicates nothing, while a plain
//! weight gets its all-reduce inside that dot, once per use (docs/sharding-rules.md §4.2).
//!
//! Every device records the same tape (same program, same types), so the backward pass issues the
//! same collectives in the same order everywhere. Contributions to a cotangent are type-checked
//! against the expected cotangent type and added without communication (R4.4); inputs that
//! receive no contribution get typed zeros (R4.12).

//!
//! Files: here the entry points and recording; `walk` the reverse walk; `into` which leaves a
//! node's transpose may add into a gradient buffer in place, and `tied` the one pair of
//! contributions that may (a tied table's); `transpose` the dispatch of a node to its op's
//! transpose; `sink` where gradients go ([`GradientSink`]).

use ferrotext_sharding::PartitionSpec;

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError};
use crate::tape::{Backward, Node, RematState, Tape};

mod into;
mod sink;
mod tied;
mod transpose;
mod uses;
mod walk;

pub use sink::GradientSink;
use sink::{all_handed, Handed};

impl Ctx<'_> {
    /// Records `out` as produced by `backward` from `inputs`, when a tape is active and some
    /// input is being differentiated.
    pub(crate) fn record(
        &mut self,
        backward: Backward,
        inputs: &[&Array],
        mut out: Array,
    ) -> Result<Array, SpmdError> {
        if let Some(tape) = &mut self.tape {
            if inputs.iter().any(|a| a.var.is_some()) {
                let at = tape.nodes.len();
                if let Some(RematState::Forward { policy, saved }) = &mut self.remat {
                    if policy.saves_op(&backward) {
                        saved.insert(at, out.with_type(out.ty().clone()));
                    }
                }
                out.var = Some(tape.push(Node {
                    inputs: inputs.iter().map(|a| a.var).collect(),
                    backward,
                    ty: out.ty().clone(),
                }));
            }
        }
        Ok(out)
    }

    pub(crate) fn leaf(&mut self, x: &Array) -> Array {
        let tape = self.tape.get_or_insert_with(Tape::default);
        let mut leaf = x.clone();
        leaf.var = Some(tape.push(Node {
            inputs: Vec::new(),
            backward: Backward::Leaf,
            ty: x.ty().clone(),
        }));
        leaf
    }

    /// Runs `f` on `inputs` and pulls `cotangent` (typed as the output's cotangent, R4.9) back
    /// to each input: returns the output and one cotangent per input, typed as that input's
    /// cotangent (R4.2).
    ///
    /// # Errors
    /// A type error in `f` or in a transpose (e.g. `unreduced_not_contracting` when a `{R:data}`
    /// weight meets a batch sharded over `(data, fsdp)`); a cotangent of the wrong type.
    pub fn vjp<F>(
        &mut self,
        inputs: &[Array],
        f: F,
        cotangent: impl FnOnce(&mut Ctx<'_>, &Array) -> Result<Array, SpmdError>,
    ) -> Result<(Array, Vec<Array>), SpmdError>
    where
        F: FnOnce(&mut Ctx<'_>, &[Array]) -> Result<Array, SpmdError>,
    {
        let outer = self.tape.take();
        self.tape = Some(Tape::default());
        let leaves: Vec<Array> = inputs.iter().map(|x| self.leaf(x)).collect();
        let result = f(self, &leaves);
        let tape = self.tape.take().unwrap_or_default();
        self.tape = outer;
        let mut out = result?;
        let seed = cotangent(self, &out)?;
        let expected = out.ty().to_cotangent();
        if seed.ty() != &expected {
            return Err(ShardingTypeError::cotangent("vjp", &expected, seed.ty()).into());
        }
        let grads = self.backward(
            tape,
            &out,
            seed,
            &leaves,
            &mut Handed(&mut |_, _, _| Ok(())),
        )?;
        out.var = None;
        Ok((out, all_handed(grads)?))
    }

    /// [`Ctx::value_and_grad`], calling `on_final(cx, i, grad)` with the gradient of `params[i]`
    /// as soon as the backward pass has finished it — when the walk has passed every op that
    /// used the parameter — rather than only at the end: the hook for starting a gradient's
    /// reduction while the rest of the backward still runs (overlap). Every parameter is handed
    /// over exactly once, zero gradients (parameters `f` never used) last; the returned
    /// gradients are the same values.
    ///
    /// # Errors
    /// As [`Ctx::value_and_grad`], or the hook's error (the walk stops there).
    pub fn value_and_grad_streaming<F>(
        &mut self,
        params: &[Array],
        f: F,
        on_final: &mut dyn FnMut(&mut Ctx<'_>, usize, &Array) -> Result<(), SpmdError>,
    ) -> Result<(Array, Vec<Array>), SpmdError>
    where
        F: FnOnce(&mut Ctx<'_>, &[Array]) -> Result<Array, SpmdError>,
    {
        let (out, grads) = self.scalar_walk(params, f, &mut Handed(on_final))?;
        Ok((out, all_handed(grads)?))
    }

    /// `f`'s value, its gradient with respect to `params` going to `sink` as in
    /// [`Ctx::value_and_grad_streaming`] — each parameter's once, as soon as the backward has
    /// finished it — except that a parameter whose whole gradient comes from one op, a
    /// `dot_general` (its transposed product, when that needs no collective and no copy) or a
    /// `take` (its rows, likewise), and for which `sink` offers a buffer
    /// ([`GradientSink::buffer`]), is added into that buffer by the kernel itself, and `sink`
    /// is only told it is done: a gradient accumulator takes a weight's gradient without it
    /// being stored and read back. A parameter with several contributions is handed their sum,
    /// as before, so the buffer's sum is the handed path's: a take's rows are summed per table
    /// row before they are added, and a product adds its tiles as the kernel finishes them
    /// (the same bits as adding the product after it unless the kernel splits the contraction).
    ///
    /// # Errors
    /// As [`Ctx::value_and_grad`], or the sink's error (the walk stops there).
    pub fn value_and_grad_into<F>(
        &mut self,
        params: &[Array],
        f: F,
        sink: &mut dyn GradientSink,
    ) -> Result<Array, SpmdError>
    where
        F: FnOnce(&mut Ctx<'_>, &[Array]) -> Result<Array, SpmdError>,
    {
        Ok(self.scalar_walk(params, f, sink)?.0)
    }

    /// Records scalar `f` on `params` as leaves and walks back from the seed 1 into `sink`:
    /// the value and each leaf's cotangent (`None` for those added into the sink's buffers).
    fn scalar_walk<F>(
        &mut self,
        params: &[Array],
        f: F,
        sink: &mut dyn GradientSink,
    ) -> Result<(Array, Vec<Option<Array>>), SpmdError>
    where
        F: FnOnce(&mut Ctx<'_>, &[Array]) -> Result<Array, SpmdError>,
    {
        let outer = self.tape.take();
        self.tape = Some(Tape::default());
        let leaves: Vec<Array> = params.iter().map(|x| self.leaf(x)).collect();
        let result = f(self, &leaves);
        let tape = self.tape.take().unwrap_or_default();
        self.tape = outer;
        let mut out = result?;
        let seed = self.scalar_seed(&out)?;
        let grads = self.backward(tape, &out, seed, &leaves, sink)?;
        out.var = None;
        Ok((out, grads))
    }

    /// 1 of a scalar output's cotangent type (R4.5).
    fn scalar_seed(&mut self, out: &Array) -> Result<Array, SpmdError> {
        if out.ty().rank() != 0 {
            return Err(SpmdError::NotScalar {
                op: "value_and_grad",
                ty: out.ty().to_string(),
            });
        }
        let ct_ty = out.ty().to_cotangent();
        let spec = ct_ty.sharding().spec();
        if spec.unreduced().is_empty() {
            self.full(ct_ty, 1.0)
        } else {
            let plain = self.array_type(
                &[],
                PartitionSpec::replicated().with_reduced_set(spec.reduced().clone())?,
            )?;
            let one = self.full(plain, 1.0)?;
            self.reshard_untracked(&one, spec)
        }
    }

    /// `f`'s value and its gradient with respect to `params`, for a scalar `f`. The seed is 1 of
    /// the output's cotangent type (R4.5): plain 1 for a plain loss; for a reduced loss, 1 on the
    /// index-0 device of the group and 0 elsewhere.
    ///
    /// # Errors
    /// As [`Ctx::vjp`]; a non-scalar output.
    pub fn value_and_grad<F>(
        &mut self,
        params: &[Array],
        f: F,
    ) -> Result<(Array, Vec<Array>), SpmdError>
    where
        F: FnOnce(&mut Ctx<'_>, &[Array]) -> Result<Array, SpmdError>,
    {
        self.vjp(params, f, |cx, out| cx.scalar_seed(out))
    }
}
