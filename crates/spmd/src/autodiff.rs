//! Reverse-mode autodiff on a per-device tape, with the cotangent-type rule.
//!
//! Owns the tape ([`Backward`]: what each recorded op keeps for its transpose), `vjp` /
//! `value_and_grad`, and the reverse walk. The transposes themselves live beside their forward
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

use std::collections::HashMap;

use ferrotext_sharding::{ArrayType, DType, PartitionSpec};
use ferrotext_tensor::DotDims;

use crate::array::Array;
use crate::ctx::Ctx;
use crate::elementwise::UnaryOp;
use crate::error::{ShardingTypeError, SpmdError};
use crate::manual::{enter_region_transpose, exit_region_transpose};
use crate::rules::BinaryOp;

/// What a recorded op needs for its transpose.
#[derive(Debug)]
pub(crate) enum Backward {
    Leaf,
    Unary {
        op: UnaryOp,
        x: Array,
        out: Array,
    },
    Binary {
        op: BinaryOp,
        a: Array,
        b: Array,
        out: Array,
    },
    Dot {
        lhs: Array,
        rhs: Array,
        dims: DotDims,
    },
    ReduceSum {
        x: ArrayType,
        axes: Vec<usize>,
    },
    Broadcast {
        x: ArrayType,
        dims: Vec<usize>,
    },
    Reshape {
        x: ArrayType,
    },
    Cast {
        from: ferrotext_sharding::DType,
    },
    Transpose {
        perm: Vec<usize>,
    },
    Reshard {
        src: ArrayType,
    },
    EnterRegion {
        outside: ArrayType,
    },
    ExitRegion {
        inside: ArrayType,
    },
    Manual {
        op: crate::manual::ManualOp,
    },
    Slice {
        x: ArrayType,
        dim: usize,
        start: usize,
    },
    Concat {
        types: Vec<ArrayType>,
        dim: usize,
        sizes: Vec<usize>,
    },
    Take {
        table: ArrayType,
        ids: crate::structural::Ids,
    },
    Select {
        mask: Array,
    },
    RmsNorm {
        x: Array,
        scale: Array,
        inv_rms: Vec<f32>,
    },
    Rope {
        rope: ferrotext_tensor::Rope,
        positions: Vec<usize>,
        /// Leading elements of each head passed through unrotated.
        pass: usize,
    },
    Softmax {
        out: Array,
        scale: f32,
    },
    Swiglu {
        g: Array,
        u: Array,
    },
    CausalAttention {
        q: Array,
        k: Array,
        v: Array,
        probs: Option<ferrotext_tensor::Tensor>,
        scale: f32,
    },
    GroupedMatmul {
        x: Array,
        w: Array,
        group_sizes: Vec<usize>,
    },
    TakeRows {
        x: ArrayType,
        rows: Vec<u32>,
    },
    CrossEntropy {
        logits: ArrayType,
        targets: crate::structural::Ids,
        ce: Option<ferrotext_tensor::CrossEntropy>,
        z_loss: f32,
    },
}

#[derive(Debug)]
struct Node {
    inputs: Vec<Option<usize>>,
    backward: Backward,
    ty: ArrayType,
}

/// The recorded ops of one differentiated function.
#[derive(Debug, Default)]
pub(crate) struct Tape {
    nodes: Vec<Node>,
}

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
                tape.nodes.push(Node {
                    inputs: inputs.iter().map(|a| a.var).collect(),
                    backward,
                    ty: out.ty().clone(),
                });
                out.var = Some(tape.nodes.len() - 1);
            }
        }
        Ok(out)
    }

    fn leaf(&mut self, x: &Array) -> Array {
        let tape = self.tape.get_or_insert_with(Tape::default);
        tape.nodes.push(Node {
            inputs: Vec::new(),
            backward: Backward::Leaf,
            ty: x.ty().clone(),
        });
        let mut leaf = x.clone();
        leaf.var = Some(tape.nodes.len() - 1);
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

    /// The reverse walk. `sink` gets leaf `k`'s cotangent once no later (in walk order) node can
    /// add to it, or is told it was added into its buffer. Returns each leaf's cotangent, `None`
    /// for those added into the sink's buffers.
    fn backward(
        &mut self,
        tape: Tape,
        out: &Array,
        seed: Array,
        leaves: &[Array],
        sink: &mut dyn GradientSink,
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        // Ops recorded by the profiler during the walk count as backward.
        let _phase = ferrotext_profile::phase_scope(ferrotext_profile::Phase::Backward);
        let n = tape.nodes.len();
        let mut cts: Vec<Option<Array>> = (0..n).map(|_| None).collect();
        if let Some(v) = out.var {
            cts[v] = Some(seed);
        }
        // The node index below which nothing adds to each leaf's cotangent: the smallest index
        // of a node that uses it (walked last).
        let leaf_of: std::collections::HashMap<usize, usize> = leaves
            .iter()
            .enumerate()
            .filter_map(|(k, l)| l.var.map(|v| (v, k)))
            .collect();
        let mut finished_at: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut first_use: Vec<Option<usize>> = vec![None; n];
        // How many times each value is an input, over the whole tape.
        let mut uses = vec![0usize; n];
        for (i, node) in tape.nodes.iter().enumerate() {
            for v in node.inputs.iter().flatten() {
                uses[*v] += 1;
                if leaf_of.contains_key(v) && first_use[*v].is_none() {
                    first_use[*v] = Some(i);
                }
            }
        }
        for (v, use_at) in first_use.iter().enumerate() {
            if let Some(i) = use_at {
                finished_at[*i].push(v);
            }
        }
        let mut handed = vec![false; leaves.len()];
        let mut sunk = vec![false; n];
        let mut leaf_cts: Vec<Option<Array>> = (0..n).map(|_| None).collect();
        for i in (0..n).rev() {
            let walked = cts[i].take();
            if let Some(ct) = walked {
                // Leaves whose whole cotangent is this node's contribution (it uses them once,
                // and no other node does — directly, or through ops that only retype, each
                // value on the way used once): offered to the sink's buffer. A leaf with several
                // contributions is handed their sum, so that what the buffer ends with is the
                // sum the handed path adds, in its order.
                let into: Vec<Into> = tape.nodes[i]
                    .inputs
                    .iter()
                    .enumerate()
                    .filter_map(|(side, v)| {
                        let v = (*v)?;
                        if let Some(&k) = leaf_of.get(&v) {
                            let here = tape.nodes[i].inputs.iter().flatten().filter(|&&u| u == v);
                            let alone =
                                first_use[v] == Some(i) && cts[v].is_none() && here.count() == 1;
                            return alone.then_some(Into {
                                side,
                                k,
                                leaf: v,
                                through_cast: false,
                            });
                        }
                        if !adds_in_place(&tape.nodes[i].backward) {
                            return None;
                        }
                        // Through ops that only retype, or (a product's operand) through the
                        // bf16 cast of an `f32` weight, whose rounded cotangent the product's
                        // transpose then widens into the weight's buffer itself.
                        let (leaf, through_cast) = match leaf_through_retypes(&tape, &uses, v) {
                            Some(leaf) => (leaf, false),
                            None if matches!(tape.nodes[i].backward, Backward::Dot { .. }) => {
                                (leaf_through_cast(&tape, &uses, &leaf_of, v)?, true)
                            }
                            None => return None,
                        };
                        let k = *leaf_of.get(&leaf)?;
                        cts[leaf].is_none().then_some(Into {
                            side,
                            k,
                            leaf,
                            through_cast,
                        })
                    })
                    .collect();
                self.backward_node(
                    &tape,
                    i,
                    ct,
                    &mut cts,
                    &mut leaf_cts,
                    sink,
                    &into,
                    &mut sunk,
                )?;
            }
            for &v in &finished_at[i] {
                // Leaves' cotangents sit in `cts` until the walk reaches them; move them now.
                if let Some(ct) = cts[v].take() {
                    leaf_cts[v] = Some(ct);
                }
                let Some(&k) = leaf_of.get(&v) else {
                    continue;
                };
                if sunk[v] {
                    sink.finished(self, k, None)?;
                    handed[k] = true;
                } else if let Some(ct) = &leaf_cts[v] {
                    sink.finished(self, k, Some(ct))?;
                    handed[k] = true;
                }
            }
        }
        let grads: Vec<Option<Array>> = leaves
            .iter()
            .map(|leaf| {
                let v = leaf.var.unwrap_or(usize::MAX);
                if sunk.get(v).copied().unwrap_or(false) {
                    return None;
                }
                Some(match leaf_cts.get_mut(v).and_then(Option::take) {
                    Some(ct) => ct,
                    // R4.12: zero cotangents are typed too.
                    None => self.zeros(leaf.ty().to_cotangent()),
                })
            })
            .collect();
        for (k, grad) in grads.iter().enumerate() {
            if !handed[k] {
                sink.finished(self, k, grad.as_ref())?;
            }
        }
        Ok(grads)
    }

    /// Walks node `i` with its cotangent `ct`: a leaf keeps it, any other node passes its
    /// inputs' cotangents on. `into` lists the leaves whose whole cotangent this node gives
    /// through an input: a `dot_general`, a `take` or a grouped product first offers it to
    /// `sink`'s buffer (the leaf is marked in `sunk` when it went there).
    #[allow(clippy::too_many_arguments)]
    fn backward_node(
        &mut self,
        tape: &Tape,
        i: usize,
        ct: Array,
        cts: &mut [Option<Array>],
        leaf_cts: &mut [Option<Array>],
        sink: &mut dyn GradientSink,
        into: &[Into],
        sunk: &mut [bool],
    ) -> Result<(), SpmdError> {
        let node = &tape.nodes[i];
        if let Backward::Leaf = node.backward {
            leaf_cts[i] = Some(ct);
            return Ok(());
        }
        // A product whose result dtype is not its operands' (the LM head's f32 logits): both
        // transposes take the cotangent in the operands' dtype, so it is cast once, here —
        // where `dot_general_transpose` would cast it — and an operand that is a weight's bf16
        // cast can then take the rounded product into its buffer like any other weight.
        let ct = match &node.backward {
            Backward::Dot { lhs, rhs, .. }
                if lhs.ty().dtype() == rhs.ty().dtype() && ct.ty().dtype() != lhs.ty().dtype() =>
            {
                self.cast_untracked(&ct, lhs.ty().dtype())?
            }
            _ => ct,
        };
        let mut needed: Vec<bool> = node.inputs.iter().map(Option::is_some).collect();
        if adds_in_place(&node.backward) {
            // A leaf's whole cotangent, into the sink's buffer.
            for &Into {
                side,
                k,
                leaf,
                through_cast,
            } in into
            {
                let expected = tape.nodes[leaf].ty.to_cotangent();
                let Some(mut dest) = sink.buffer(k, &expected) else {
                    continue;
                };
                let added = match (&node.backward, through_cast) {
                    (Backward::Dot { lhs, rhs, dims }, true) => self
                        .dot_general_transpose_rounded_into(
                            (lhs, rhs),
                            dims,
                            &ct,
                            side,
                            &mut dest,
                        )?,
                    (_, true) => false,
                    (backward, false) => {
                        self.add_contribution_into(backward, &ct, side, &mut dest)?
                    }
                };
                if added {
                    sunk[leaf] = true;
                    needed[side] = false;
                }
            }
        }
        // A take's rows, or a slice, into the contribution its input already has (a tied
        // embedding's head; a value cut into parts, as MLA's projections are): R4.4's sum
        // without a zero table or a zero-padded copy (the same values; a `-0.0` the rows or the
        // slice miss stays `-0.0`, where adding zeros would make it `+0.0`). Only these two:
        // each element of the contribution gets one addend (a take's rows are summed per table
        // row first), so the sum is R4.4's to the bit.
        let into_existing = matches!(
            node.backward,
            Backward::Take { .. } | Backward::Slice { .. }
        );
        if let (true, Some(Some(v)), Some(true)) =
            (into_existing, node.inputs.first(), needed.first().copied())
        {
            let expected = tape.nodes[*v].ty.to_cotangent();
            if let Some(existing) = cts[*v].as_mut() {
                if existing.ty() == &expected
                    && existing.local_bf16().is_none()
                    && !existing.is_abstract()
                {
                    let dest = existing.local_mut()?.data_mut();
                    if self.add_contribution_into(&node.backward, &ct, 0, &mut [dest])? {
                        needed[0] = false;
                    }
                }
            }
        }
        if (into_existing || adds_in_place(&node.backward)) && !needed.iter().any(|&n| n) {
            return Ok(());
        }
        let input_cts = self.transpose_node(&node.backward, &ct, &needed)?;
        for ((input, ict), &need) in node.inputs.iter().zip(input_cts).zip(&needed) {
            let (Some(v), Some(ict), true) = (input, ict, need) else {
                continue;
            };
            let expected = tape.nodes[*v].ty.to_cotangent();
            if ict.ty() != &expected {
                return Err(ShardingTypeError::cotangent("backward", &expected, ict.ty()).into());
            }
            cts[*v] = Some(match cts[*v].take() {
                None => ict,
                // R4.4: contributions of equal type add without communication.
                Some(acc) => self.add_contributions(acc, ict)?,
            });
        }
        Ok(())
    }

    /// `acc + ict` for two contributions of the same type (R4.4): added into whichever of the
    /// two no other array shares, in place (no new buffer; IEEE addition is commutative, so
    /// the bits are those of `acc + ict`), else into a new one.
    fn add_contributions(&mut self, mut acc: Array, mut ict: Array) -> Result<Array, SpmdError> {
        // In place on `f32` shards only: asking a bf16 shard for its `f32` view widens a copy
        // of it (two per sum of bf16 contributions, `x`'s from a layer's gate and up products,
        // before this was checked), and bf16 sums go through the rounding op below anyway.
        let f32_shards = acc.local_bf16().is_none() && ict.local_bf16().is_none();
        if acc.ty() == ict.ty() && f32_shards {
            if let (Some(a), Some(b)) = (acc.local_if_unique(), ict.local_opt().as_deref()) {
                a.add_assign(b)?;
                return Ok(acc);
            }
            if let (Some(b), Some(a)) = (ict.local_if_unique(), acc.local_opt().as_deref()) {
                b.add_assign(a)?;
                return Ok(ict);
            }
        }
        self.binary_untracked(BinaryOp::Add, &acc, &ict)
    }

    /// Adds the node's contribution to input `side`'s cotangent into `dest` (that input's local
    /// block, row-major, in consecutive parts of equal length; see [`GradientSink::buffer`]),
    /// where the op can do so itself — a `dot_general`'s transposed product or a `take`'s rows
    /// (part by part when each holds whole rows), a slice into its window (one part) —
    /// and it needs no collective; returns whether it did (`false`: `dest` untouched). Only the
    /// first two go into a sink's buffer ([`adds_in_place`]).
    fn add_contribution_into(
        &mut self,
        backward: &Backward,
        ct: &Array,
        side: usize,
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        match (backward, dest) {
            (Backward::Dot { lhs, rhs, dims }, dest) => {
                self.dot_general_transpose_into((lhs, rhs), dims, ct, side, dest)
            }
            (Backward::Take { table, ids }, dest) => self.take_transpose_into(ct, table, ids, dest),
            (Backward::GroupedMatmul { x, w, group_sizes }, dest) if side == 1 => {
                self.grouped_matmul_transpose_into(x, w, group_sizes, ct, dest)
            }
            (Backward::Cast { from }, dest) => self.cast_transpose_into(*from, ct, dest),
            (Backward::Slice { x, dim, start }, [whole]) => {
                self.slice_transpose_into(x, *dim, *start, ct, whole)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Cotangents of a node's inputs from the cotangent of its output: each arm calls the
    /// transpose defined beside its forward op. `needed[i]` says whether input `i` is being
    /// differentiated (ops that can skip an input's cotangent do, so a constant operand costs no
    /// reduction).
    fn transpose_node(
        &mut self,
        backward: &Backward,
        ct: &Array,
        needed: &[bool],
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        let need = |i: usize| needed.get(i).copied().unwrap_or(false);
        let one = |x: Array| vec![Some(x)];
        Ok(match backward {
            Backward::Leaf => Vec::new(),
            Backward::Unary { op, x, out } => one(self.unary_transpose(*op, x, out, ct)?),
            Backward::Binary { op, a, b, out } => self
                .binary_transpose(*op, (a, b, out), ct, [need(0), need(1)])?
                .into(),
            Backward::Dot { lhs, rhs, dims } => self
                .dot_general_transpose((lhs, rhs), dims, ct, [need(0), need(1)])?
                .into(),
            Backward::ReduceSum { x, axes } => one(self.reduce_sum_transpose(x, axes, ct)?),
            Backward::Broadcast { x, dims } => one(self.broadcast_in_dim_transpose(ct, x, dims)?),
            Backward::Reshape { x } => one(self.reshape_transpose(x, ct)?),
            Backward::Cast { from } => one(self.cast_transpose(*from, ct)?),
            Backward::Transpose { perm } => one(self.transpose_transpose(perm, ct)?),
            Backward::Reshard { src } => one(self.reshard_transpose(src, ct)?),
            Backward::EnterRegion { outside } => one(enter_region_transpose(outside, ct)),
            Backward::ExitRegion { inside } => one(exit_region_transpose(inside, ct)),
            Backward::Manual { op } => one(self.manual_transpose(op, ct)?),
            Backward::Slice { x, dim, start } => one(self.slice_transpose(x, *dim, *start, ct)?),
            Backward::Concat { types, dim, sizes } => {
                self.concat_transpose(types, *dim, sizes, ct)?
            }
            Backward::Take { table, ids } => one(self.take_transpose(ct, table, ids)?),
            Backward::Select { mask } => {
                let [da, db] = self.select_transpose(mask, ct)?;
                vec![Some(da), Some(db)]
            }
            Backward::RmsNorm { x, scale, inv_rms } => {
                let (dx, ds) = self.rms_norm_transpose(ct, x, scale, inv_rms, need(1))?;
                vec![Some(dx), ds]
            }
            Backward::Rope {
                rope,
                positions,
                pass,
            } => one(self.rope_transpose(rope, positions, *pass, ct)?),
            Backward::Softmax { out, scale } => one(self.softmax_transpose(out, *scale, ct)?),
            Backward::Swiglu { g, u } => {
                let [dg, du] = self.swiglu_transpose(g, u, ct)?;
                vec![Some(dg), Some(du)]
            }
            Backward::CausalAttention {
                q,
                k,
                v,
                probs,
                scale,
            } => {
                let [dq, dk, dv] =
                    self.causal_attention_transpose(q, k, v, probs.as_ref(), *scale, ct)?;
                vec![Some(dq), Some(dk), Some(dv)]
            }
            Backward::GroupedMatmul { x, w, group_sizes } => {
                self.grouped_matmul_transpose(x, w, group_sizes, ct, [need(0), need(1)])?
            }
            Backward::TakeRows { x, rows } => one(self.take_rows_transpose(x, rows, ct)?),
            Backward::CrossEntropy {
                logits,
                targets,
                ce,
                z_loss,
            } => one(self.cross_entropy_transpose(logits, targets, ce.as_ref(), *z_loss, ct)?),
        })
    }
}

/// Where [`Ctx::value_and_grad_into`] delivers each parameter's gradient: a gradient
/// accumulator, which may offer buffers for the backward's kernels to add into in place.
pub trait GradientSink {
    /// A buffer holding parameter `k`'s running sum as a row-major local block of `ty` (the
    /// gradient's type), that the backward may add `k`'s whole gradient into, given as
    /// consecutive parts of equal length — part `j` of `p` holds elements `j·len/p ..
    /// (j+1)·len/p` of the block: one part for a contiguous buffer, one per segment where the
    /// buffer keeps the block in segments (a reduce-scatter bucket's); `None` to be handed the
    /// gradient instead. Must return `None` for a type other than the buffer's.
    fn buffer(&mut self, k: usize, ty: &ArrayType) -> Option<Vec<&mut [f32]>>;

    /// Parameter `k`'s gradient is final: `Some(grad)` when it is handed over, `None` when it
    /// was added into [`GradientSink::buffer`]`(k)`. Called once per parameter.
    ///
    /// # Errors
    /// The sink's own (the walk stops there).
    fn finished(
        &mut self,
        cx: &mut Ctx<'_>,
        k: usize,
        grad: Option<&Array>,
    ) -> Result<(), SpmdError>;
}

/// A sink without buffers that hands every gradient to a callback.
struct Handed<'f>(&'f mut dyn FnMut(&mut Ctx<'_>, usize, &Array) -> Result<(), SpmdError>);

impl GradientSink for Handed<'_> {
    fn buffer(&mut self, _: usize, _: &ArrayType) -> Option<Vec<&mut [f32]>> {
        None
    }

    fn finished(
        &mut self,
        cx: &mut Ctx<'_>,
        k: usize,
        grad: Option<&Array>,
    ) -> Result<(), SpmdError> {
        match grad {
            Some(g) => (self.0)(cx, k, g),
            None => Err(SpmdError::Internal {
                op: "value_and_grad",
                invariant: "a gradient went into a buffer the sink did not offer",
            }),
        }
    }
}

/// The gradients of a walk whose sink had no buffers: every one was handed over.
fn all_handed(grads: Vec<Option<Array>>) -> Result<Vec<Array>, SpmdError> {
    grads
        .into_iter()
        .map(|g| {
            g.ok_or(SpmdError::Internal {
                op: "value_and_grad",
                invariant: "a gradient missing from a walk without buffers",
            })
        })
        .collect()
}

/// Ops whose transpose can add a contribution into a buffer in place
/// ([`Ctx::add_contribution_into`]).
fn adds_in_place(backward: &Backward) -> bool {
    matches!(
        backward,
        Backward::Dot { .. }
            | Backward::Take { .. }
            | Backward::GroupedMatmul { .. }
            | Backward::Cast { .. }
    )
}

/// A leaf whose whole cotangent a node gives through its input `side` (sink parameter `k`,
/// tape value `leaf`); `through_cast`: the input is the leaf's bf16 cast ([`leaf_through_cast`]).
#[derive(Clone, Copy)]
struct Into {
    side: usize,
    k: usize,
    leaf: usize,
    through_cast: bool,
}

/// The `f32` leaf behind value `v` when `v` is its cast to bf16 (a weight cast at use), directly
/// or through ops that only retype, every value on the way used exactly once: the leaf's
/// cotangent is then `v`'s, widened.
fn leaf_through_cast(
    tape: &Tape,
    uses: &[usize],
    leaf_of: &HashMap<usize, usize>,
    v: usize,
) -> Option<usize> {
    let node = &tape.nodes[v];
    if uses[v] != 1 || !matches!(node.backward, Backward::Cast { from: DType::F32 }) {
        return None;
    }
    let [Some(u)] = node.inputs[..] else {
        return None;
    };
    if leaf_of.contains_key(&u) {
        return (uses[u] == 1).then_some(u);
    }
    leaf_through_retypes(tape, uses, u)
}

/// The leaf behind value `v` through a chain of ops that only retype ([`retypes_only`]), when
/// every value on the way, `v` and the leaf included, is used exactly once on the tape: the
/// leaf's cotangent is then `v`'s, retyped, with the same local block.
fn leaf_through_retypes(tape: &Tape, uses: &[usize], v: usize) -> Option<usize> {
    let mut at = v;
    loop {
        let node = &tape.nodes[at];
        if uses[at] != 1 {
            return None;
        }
        if matches!(node.backward, Backward::Leaf) {
            return (at != v).then_some(at);
        }
        if !retypes_only(&node.backward) {
            return None;
        }
        let [Some(input)] = node.inputs[..] else {
            return None;
        };
        at = input;
    }
}

/// Ops whose transpose only retypes the cotangent, its local block unchanged: entering and
/// leaving a region, and the pcasts between reduced, varying and unreduced. A leaf seen
/// through a chain of them (each value used once) still has its whole cotangent from the op
/// at the end of the chain, so that op may add it into the leaf's buffer.
fn retypes_only(backward: &Backward) -> bool {
    use crate::manual::AxisState::{Reduced, Unreduced, Varying};
    match backward {
        Backward::EnterRegion { .. } | Backward::ExitRegion { .. } => true,
        Backward::Manual {
            op: crate::manual::ManualOp::Pcast { from, to, .. },
        } => matches!((from, to), (Reduced, Varying) | (Varying, Unreduced)),
        _ => false,
    }
}
