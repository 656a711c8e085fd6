//! Reverse-mode autodiff on a per-device tape, with the cotangent-type rule.
//!
//! The rule that makes deferral work (R4.2–R4.3): the cotangent of a value has the value's type
//! with `reduced` and `unreduced` swapped, and each transpose emits its op with that type as the
//! output sharding. So a weight typed `{R:data}` used against activations sharded on `data` gets
//! a gradient typed `{U:data}` from a transposed dot that communicates nothing, while a plain
//! weight gets its all-reduce inside that dot, once per use (§4.2).
//!
//! Every device records the same tape (same program, same types), so the backward pass issues the
//! same collectives in the same order everywhere. Contributions to a cotangent are type-checked
//! against the expected cotangent type and added without communication (R4.4); inputs that
//! receive no contribution get typed zeros (R4.12).

use ferrotext_sharding::{ArrayType, PartitionSpec};
use ferrotext_tensor::{DotDims, Tensor};

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind};
use crate::ops::UnaryOp;
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
    },
    Softmax {
        out: Array,
        scale: f32,
    },
    Swiglu {
        g: Array,
        u: Array,
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
            return Err(ct_error("vjp", &expected, seed.ty()).into());
        }
        let grads = self.backward(tape, &out, seed, &leaves, &mut |_, _, _| Ok(()))?;
        out.var = None;
        Ok((out, grads))
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
        let outer = self.tape.take();
        self.tape = Some(Tape::default());
        let leaves: Vec<Array> = params.iter().map(|x| self.leaf(x)).collect();
        let result = f(self, &leaves);
        let tape = self.tape.take().unwrap_or_default();
        self.tape = outer;
        let mut out = result?;
        let seed = self.scalar_seed(&out)?;
        let grads = self.backward(tape, &out, seed, &leaves, on_final)?;
        out.var = None;
        Ok((out, grads))
    }

    /// 1 of a scalar output's cotangent type (R4.5).
    fn scalar_seed(&mut self, out: &Array) -> Result<Array, SpmdError> {
        if out.ty().rank() != 0 {
            return Err(SpmdError::BadArgument {
                op: "value_and_grad".into(),
                reason: format!("the function must return a scalar, got `{}`", out.ty()),
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

    /// The reverse walk. `on_final(cx, k, ct)` gets leaf `k`'s cotangent once no later (in walk
    /// order) node can add to it.
    fn backward(
        &mut self,
        tape: Tape,
        out: &Array,
        seed: Array,
        leaves: &[Array],
        on_final: &mut dyn FnMut(&mut Ctx<'_>, usize, &Array) -> Result<(), SpmdError>,
    ) -> Result<Vec<Array>, SpmdError> {
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
        for (i, node) in tape.nodes.iter().enumerate() {
            for v in node.inputs.iter().flatten() {
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
        let mut leaf_cts: Vec<Option<Array>> = (0..n).map(|_| None).collect();
        for i in (0..n).rev() {
            let walked = cts[i].take();
            if let Some(ct) = walked {
                self.backward_node(&tape, i, ct, &mut cts, &mut leaf_cts)?;
            }
            for &v in &finished_at[i] {
                // Leaves' cotangents sit in `cts` until the walk reaches them; move them now.
                if let Some(ct) = cts[v].take() {
                    leaf_cts[v] = Some(ct);
                }
                if let (Some(ct), Some(&k)) = (&leaf_cts[v], leaf_of.get(&v)) {
                    on_final(self, k, ct)?;
                    handed[k] = true;
                }
            }
        }
        let grads: Vec<Array> = leaves
            .iter()
            .map(|leaf| {
                let v = leaf.var.unwrap_or(usize::MAX);
                match leaf_cts.get_mut(v).and_then(Option::take) {
                    Some(ct) => ct,
                    // R4.12: zero cotangents are typed too.
                    None => self.zeros(leaf.ty().to_cotangent()),
                }
            })
            .collect();
        for (k, grad) in grads.iter().enumerate() {
            if !handed[k] {
                on_final(self, k, grad)?;
            }
        }
        Ok(grads)
    }

    /// Walks node `i` with its cotangent `ct`: a leaf keeps it, any other node passes its
    /// inputs' cotangents on.
    fn backward_node(
        &mut self,
        tape: &Tape,
        i: usize,
        ct: Array,
        cts: &mut [Option<Array>],
        leaf_cts: &mut [Option<Array>],
    ) -> Result<(), SpmdError> {
        {
            let node = &tape.nodes[i];
            if let Backward::Leaf = node.backward {
                leaf_cts[i] = Some(ct);
                return Ok(());
            }
            let needed: Vec<bool> = node.inputs.iter().map(Option::is_some).collect();
            let input_cts = self.transpose_node(&node.backward, &ct, &needed)?;
            for (input, ict) in node.inputs.iter().zip(input_cts) {
                let (Some(v), Some(ict)) = (input, ict) else {
                    continue;
                };
                let expected = tape.nodes[*v].ty.to_cotangent();
                if ict.ty() != &expected {
                    return Err(ct_error("backward", &expected, ict.ty()).into());
                }
                cts[*v] = Some(match cts[*v].take() {
                    None => ict,
                    // R4.4: contributions of equal type add without communication.
                    Some(acc) => self.binary_untracked(BinaryOp::Add, &acc, &ict)?,
                });
            }
        }
        Ok(())
    }

    /// Cotangents of a node's inputs from the cotangent of its output.
    fn transpose_node(
        &mut self,
        backward: &Backward,
        ct: &Array,
        needed: &[bool],
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        Ok(match backward {
            Backward::Leaf => Vec::new(),
            Backward::Unary { op, x, out } => {
                let d = if matches!(op, UnaryOp::Neg | UnaryOp::Scale(_)) {
                    self.unary_untracked(*op, ct)?
                } else {
                    // ct · f'(x): the derivative has x's type (reduced passes), so a `{U}` ct
                    // times an `{R}` derivative stays `{U}` (R4.13).
                    let local = match (x.local_opt(), out.local_opt()) {
                        (Some(xv), Some(yv)) => Some(op.derivative(xv, yv)?),
                        _ => None,
                    };
                    let deriv = Array::new(x.ty().clone(), local);
                    self.binary_untracked(BinaryOp::Mul, ct, &deriv)?
                };
                vec![Some(d)]
            }
            // Only the cotangents of differentiated inputs are computed: a constant operand (a
            // mask, a batch) must not cost a reduction.
            Backward::Binary { op, a, b, out } => {
                let need = |i: usize| needed.get(i).copied().unwrap_or(false);
                let da = if !need(0) {
                    None
                } else {
                    let d = match op {
                        BinaryOp::Add | BinaryOp::Sub => ct.clone(),
                        BinaryOp::Mul => self.binary_untracked(BinaryOp::Mul, ct, b)?,
                        BinaryOp::Div => self.binary_untracked(BinaryOp::Div, ct, b)?,
                        BinaryOp::Max => return Err(not_differentiable("max")),
                    };
                    Some(self.unbroadcast(&d, a.ty())?)
                };
                let db = if !need(1) {
                    None
                } else {
                    let d = match op {
                        BinaryOp::Add => ct.clone(),
                        BinaryOp::Sub => self.unary_untracked(UnaryOp::Neg, ct)?,
                        BinaryOp::Mul => self.binary_untracked(BinaryOp::Mul, ct, a)?,
                        BinaryOp::Div => {
                            let q = self.binary_untracked(BinaryOp::Div, out, b)?;
                            let p = self.binary_untracked(BinaryOp::Mul, ct, &q)?;
                            self.unary_untracked(UnaryOp::Neg, &p)?
                        }
                        BinaryOp::Max => return Err(not_differentiable("max")),
                    };
                    Some(self.unbroadcast(&d, b.ty())?)
                };
                vec![da, db]
            }
            Backward::Dot { lhs, rhs, dims } => {
                let need = |i: usize| needed.get(i).copied().unwrap_or(false);
                let nb = dims.lhs_batch.len();
                let lf =
                    DotDims::free(lhs.ty().rank(), &dims.lhs_batch, &dims.lhs_contracting).len();
                let rf =
                    DotDims::free(rhs.ty().rank(), &dims.rhs_batch, &dims.rhs_contracting).len();
                let batch: Vec<usize> = (0..nb).collect();
                let lkept: Vec<usize> = (nb..nb + lf).collect();
                let rkept: Vec<usize> = (nb + lf..nb + lf + rf).collect();
                let dl = if need(0) {
                    Some(self.dot_transpose(
                        ct,
                        rhs,
                        lhs.ty(),
                        (&dims.lhs_batch, &dims.lhs_contracting),
                        (&dims.rhs_batch, &dims.rhs_contracting),
                        (&batch, &rkept),
                    )?)
                } else {
                    None
                };
                let dr = if need(1) {
                    Some(self.dot_transpose(
                        ct,
                        lhs,
                        rhs.ty(),
                        (&dims.rhs_batch, &dims.rhs_contracting),
                        (&dims.lhs_batch, &dims.lhs_contracting),
                        (&batch, &lkept),
                    )?)
                } else {
                    None
                };
                vec![dl, dr]
            }
            Backward::ReduceSum { x, .. } if x.is_manual() => {
                let kept_shape: Vec<usize> = ct.shape().to_vec();
                let dims = (0..x.rank()).filter(|d| !matches!(backward, Backward::ReduceSum { axes, .. } if axes.contains(d))).collect::<Vec<_>>();
                let local = match ct.local_opt() {
                    Some(t) => Some(t.broadcast_in_dim(x.shape(), &dims)?),
                    None => None,
                };
                let _ = kept_shape;
                vec![Some(Array::new(x.to_cotangent(), local))]
            }
            Backward::ReduceSum { x, axes } => {
                let kept: Vec<usize> = (0..x.rank()).filter(|d| !axes.contains(d)).collect();
                let target = x.to_cotangent();
                vec![Some(self.broadcast_in_dim_untracked(
                    ct,
                    x.shape(),
                    &kept,
                    Some(target.sharding().spec()),
                )?)]
            }
            Backward::Broadcast { x, dims } if x.is_manual() => {
                let summed: Vec<usize> =
                    (0..ct.ty().rank()).filter(|d| !dims.contains(d)).collect();
                let local = match ct.local_opt() {
                    Some(t) => Some(t.sum_axes(&summed)?.reshape(x.shape())?),
                    None => None,
                };
                vec![Some(Array::new(x.to_cotangent(), local))]
            }
            Backward::Broadcast { x, dims } => {
                vec![Some(self.unbroadcast_in_dim(ct, x, dims)?)]
            }
            Backward::Reshape { x } if x.is_manual() => {
                let local = match ct.local_opt() {
                    Some(t) => Some(t.clone().reshape(x.shape())?),
                    None => None,
                };
                vec![Some(Array::new(x.to_cotangent(), local))]
            }
            Backward::Reshape { x } => {
                let target = x.to_cotangent();
                vec![Some(self.reshape_untracked(
                    ct,
                    x.shape(),
                    Some(target.sharding().spec()),
                )?)]
            }
            Backward::Transpose { perm } => {
                let mut inverse = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inverse[p] = i;
                }
                vec![Some(self.transpose_untracked(ct, &inverse)?)]
            }
            Backward::Reshard { src } => {
                let target = src.to_cotangent();
                vec![Some(self.reshard_untracked(ct, target.sharding().spec())?)]
            }
            // The region boundary moves no data; the cotangent crosses it with swapped tags
            // (R6.13) and no collective (R6.14).
            Backward::EnterRegion { outside } => {
                vec![Some(ct.with_type(outside.to_cotangent()))]
            }
            Backward::ExitRegion { inside } => {
                vec![Some(ct.with_type(inside.to_cotangent()))]
            }
            Backward::Manual { op } => vec![Some(self.manual_transpose(op, ct)?)],
            // slice ↔ zero padding (zeros keep an unreduced cotangent's sum exact, R9.1)
            Backward::Slice { x, dim, start } => {
                let local = match ct.local_opt() {
                    Some(c) => {
                        let full = x.to_cotangent().shard_shape();
                        let mut before = full.clone();
                        before[*dim] = *start;
                        let mut after = full.clone();
                        after[*dim] = full[*dim] - start - c.shape()[*dim];
                        let (z0, z1) = (Tensor::zeros(&before), Tensor::zeros(&after));
                        Some(Tensor::concat(&[&z0, c, &z1], *dim)?)
                    }
                    None => None,
                };
                vec![Some(Array::new(x.to_cotangent(), local))]
            }
            Backward::Concat { types, dim, sizes } => {
                let mut out = Vec::with_capacity(types.len());
                let mut offset = 0;
                for (t, &n) in types.iter().zip(sizes) {
                    let local = ct
                        .local_opt()
                        .map(|c| c.slice_dim(*dim, offset..offset + n))
                        .transpose()?;
                    out.push(Some(Array::new(t.to_cotangent(), local)));
                    offset += n;
                }
                out
            }
            Backward::Take { table, ids } => vec![Some(self.take_transpose(ct, table, ids)?)],
            Backward::RmsNorm { x, scale, inv_rms } => {
                let need_scale = needed.get(1).copied().unwrap_or(false);
                let (dx, ds) = self.rms_norm_transpose(ct, x, scale, inv_rms, need_scale)?;
                vec![Some(dx), ds]
            }
            // rotations are orthogonal: the transpose turns the other way
            Backward::Rope { rope, positions } => {
                let local = ct
                    .local_opt()
                    .map(|c| ferrotext_tensor::rope_with(c, positions, rope, true))
                    .transpose()?;
                vec![Some(Array::new(ct.ty().clone(), local))]
            }
            Backward::Softmax { out, scale } => {
                let local = match (out.local_opt(), ct.local_opt()) {
                    (Some(y), Some(c)) => {
                        Some(ferrotext_tensor::softmax_backward_scaled(y, c, *scale)?)
                    }
                    _ => None,
                };
                vec![Some(Array::new(ct.ty().clone(), local))]
            }
            Backward::GroupedMatmul { x, w, group_sizes } => {
                self.grouped_matmul_transpose(x, w, group_sizes, ct)?
            }
            Backward::TakeRows { x, rows } => vec![Some(self.take_rows_transpose(x, rows, ct)?)],
            Backward::Swiglu { g, u } => {
                let (dg, du) = match (g.local_opt(), u.local_opt(), ct.local_opt()) {
                    (Some(a), Some(b), Some(c)) => {
                        let (dg, du) = ferrotext_tensor::swiglu_backward(a, b, c)?;
                        (Some(dg), Some(du))
                    }
                    _ => (None, None),
                };
                vec![
                    Some(Array::new(g.ty().to_cotangent(), dg)),
                    Some(Array::new(u.ty().to_cotangent(), du)),
                ]
            }
            Backward::CrossEntropy {
                logits,
                targets,
                ce,
                z_loss,
            } => {
                let local = match (ce, ct.local_opt(), targets.local()) {
                    (Some(ce), Some(c), Some(ids)) => {
                        let mask: Vec<f32> = ids
                            .iter()
                            .map(|&i| if i == u32::MAX { 0.0 } else { 1.0 })
                            .collect();
                        let safe: Vec<u32> = ids
                            .iter()
                            .map(|&i| if i == u32::MAX { 0 } else { i })
                            .collect();
                        let d = ferrotext_tensor::cross_entropy_backward(
                            ce,
                            &safe,
                            &mask,
                            *z_loss,
                            c.data()[0],
                        )?;
                        Some(d.reshape(&logits.to_cotangent().shard_shape())?)
                    }
                    _ => None,
                };
                vec![Some(Array::new(logits.to_cotangent(), local))]
            }
            Backward::Select { mask } => {
                let (da, db) = match (mask.local_opt(), ct.local_opt()) {
                    (Some(m), Some(c)) => {
                        let zero = Tensor::zeros(c.shape());
                        (
                            Some(crate::structural::select_local(m, c, &zero)?),
                            Some(crate::structural::select_local(m, &zero, c)?),
                        )
                    }
                    _ => (None, None),
                };
                vec![
                    Some(Array::new(ct.ty().clone(), da)),
                    Some(Array::new(ct.ty().clone(), db)),
                ]
            }
        })
    }

    /// JAX's `_dot_general_transpose_lhs`, written for either side: the cotangent of `this`
    /// operand from `ct` (`[batch, lhs free, rhs free]`) and the `other` operand, emitted with
    /// `this`'s cotangent type as `out_sharding` (R4.3).
    fn dot_transpose(
        &mut self,
        ct: &Array,
        other: &Array,
        this: &ArrayType,
        (this_batch, this_contract): (&Vec<usize>, &Vec<usize>),
        (other_batch, other_contract): (&Vec<usize>, &Vec<usize>),
        (ct_batch, ct_other_kept): (&Vec<usize>, &Vec<usize>),
    ) -> Result<Array, SpmdError> {
        let other_kept = DotDims::free(other.ty().rank(), other_batch, other_contract);
        let this_kept = DotDims::free(this.rank(), this_batch, this_contract);
        let dims = DotDims {
            lhs_contracting: ct_other_kept.clone(),
            rhs_contracting: other_kept,
            lhs_batch: ct_batch.clone(),
            rhs_batch: other_batch.clone(),
        };
        // Result dims are [batch, this kept, other's contracting dims in ascending order]; map
        // them to `this`'s dims.
        let mut pairs: Vec<(usize, usize)> = this_contract
            .iter()
            .copied()
            .zip(other_contract.iter().copied())
            .collect();
        pairs.sort_by_key(|&(_, o)| o);
        let order: Vec<usize> = this_batch
            .iter()
            .copied()
            .chain(this_kept)
            .chain(pairs.into_iter().map(|(t, _)| t))
            .collect();
        let target = this.to_cotangent();
        if target.is_manual() {
            let r = self.manual_dot(ct, other, &dims)?;
            let mut perm = vec![0; order.len()];
            for (k, &d) in order.iter().enumerate() {
                perm[d] = k;
            }
            return self.transpose_untracked(&r, &perm);
        }
        let tspec = target.sharding().spec();
        let out_spec = PartitionSpec::tagged(
            order.iter().map(|&d| tspec.dim(d).clone()),
            tspec.unreduced().clone(),
            tspec.reduced().clone(),
        )?;
        let r = self.dot_general_untracked(ct, other, &dims, Some(&out_spec))?;
        let mut perm = vec![0; order.len()];
        for (k, &d) in order.iter().enumerate() {
            perm[d] = k;
        }
        self.transpose_untracked(&r, &perm)
    }

    /// The cotangent of an operand that a binary op broadcast: summed over the broadcast dims and
    /// typed as the operand's cotangent.
    fn unbroadcast(&mut self, ct: &Array, operand: &ArrayType) -> Result<Array, SpmdError> {
        let target = operand.to_cotangent();
        if ct.ty() == &target {
            return Ok(ct.clone());
        }
        if target.is_manual() {
            let lead = ct.ty().rank() - operand.rank();
            let summed: Vec<usize> = (0..ct.ty().rank())
                .filter(|&d| d < lead || (operand.shape()[d - lead] == 1 && ct.shape()[d] != 1))
                .collect();
            let local = match ct.local_opt() {
                Some(t) => Some(t.sum_axes(&summed)?.reshape(operand.shape())?),
                None => None,
            };
            return Ok(Array::new(target, local));
        }
        if ct.shape() == operand.shape() {
            return self.reshard_untracked(ct, target.sharding().spec());
        }
        let lead = ct.ty().rank() - operand.rank();
        let dims: Vec<usize> = (lead..ct.ty().rank()).collect();
        self.unbroadcast_in_dim(ct, operand, &dims)
    }

    /// Transpose of `broadcast_in_dim(x → ct's shape, dims)`: `reduce_sum` over the new dims
    /// (and the stretched size-1 dims) with the cotangent type as `out_sharding`.
    fn unbroadcast_in_dim(
        &mut self,
        ct: &Array,
        x: &ArrayType,
        dims: &[usize],
    ) -> Result<Array, SpmdError> {
        let target = x.to_cotangent();
        let tspec = target.sharding().spec();
        let stretched: Vec<usize> = (0..x.rank())
            .filter(|&i| x.shape()[i] == 1 && ct.shape()[dims[i]] != 1)
            .collect();
        let summed: Vec<usize> = (0..ct.ty().rank())
            .filter(|d| !dims.contains(d) || stretched.iter().any(|&i| dims[i] == *d))
            .collect();
        if stretched.is_empty() {
            return self.reduce_sum_untracked(ct, &summed, Some(tspec));
        }
        let kept_spec = PartitionSpec::tagged(
            (0..x.rank())
                .filter(|i| !stretched.contains(i))
                .map(|i| tspec.dim(i).clone()),
            tspec.unreduced().clone(),
            tspec.reduced().clone(),
        )?;
        let s = self.reduce_sum_untracked(ct, &summed, Some(&kept_spec))?;
        self.reshape_untracked(&s, x.shape(), Some(tspec))
    }
}

fn not_differentiable(op: &str) -> SpmdError {
    SpmdError::BadArgument {
        op: op.into(),
        reason: format!("`{op}` has no transpose; it cannot be differentiated"),
    }
}

/// R4.3's check, typed by what differs.
fn ct_error(op: &str, expected: &ArrayType, got: &ArrayType) -> ShardingTypeError {
    let (es, gs) = (expected.sharding().spec(), got.sharding().spec());
    let kind = if es.unreduced() != gs.unreduced() {
        TypeErrorKind::UnreducedMismatch
    } else if es.reduced() != gs.reduced() {
        TypeErrorKind::ReducedConflict
    } else if expected.shape() != got.shape() {
        TypeErrorKind::ShapeError
    } else {
        TypeErrorKind::ShardingMismatch
    };
    ShardingTypeError::new(
        kind,
        op,
        &[got],
        format!("Expected cotangent type {expected} but got {got}"),
    )
}
