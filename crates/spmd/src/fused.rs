//! Fused row-wise ops the models need, each one op on the tape with its hand-written transpose
//! beside it (kernels from `ferrotext_tensor`): RMSNorm, RoPE, softmax over the last dim (and
//! causal softmax), SwiGLU, and cross-entropy (with [`IGNORE_INDEX`], the target id of a token
//! that does not count).
//!
//! Their type rules: the row dimension(s) they reduce over must not be split over devices
//! (reshard first); activations may not be unreduced; a scale reduced on an axis the rows are
//! sharded on is used locally and its cotangent comes back unreduced there (docs/design.md §4.2) —
//! the same answer `mul` gives, whose rule RMSNorm reuses.
//!
//! bf16 (docs/design.md §10): where the result is stored in bf16 and every activation operand
//! holds bf16 ([`bf16_operands`]), RMSNorm, SwiGLU, softmax (causal too) and their transposes
//! run the bf16 kernels on the shards as stored: bitwise the `f32` kernel on the widened shards
//! rounded on store (the tensor crate's invariant), without the widening copies and the
//! rounding pass.

use ferrotext_sharding::{ArrayType, AxisSet, DimSpec, PartitionSpec};

use ferrotext_tensor::GluActivation;

use crate::array::{bf16_operands, Array};
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::ids::Ids;
use crate::rules::{self, BinaryOp};
use crate::tape::Backward;

/// The target id of a token that [`Ctx::cross_entropy_sum`] ignores: it adds nothing to the
/// loss and gets a zero gradient (padding, a prompt token).
pub const IGNORE_INDEX: u32 = u32::MAX;

fn type_error(kind: K, op: &str, xs: &[&ArrayType], message: impl Into<String>) -> SpmdError {
    ShardingTypeError::new(kind, op, xs, message).into()
}

fn check_rowwise(op: &str, x: &ArrayType, dims_from_end: usize) -> Result<(), SpmdError> {
    if x.rank() < dims_from_end {
        return Err(type_error(
            K::ShapeError,
            op,
            &[x],
            format!("needs rank ≥ {dims_from_end}"),
        ));
    }
    for d in x.rank() - dims_from_end..x.rank() {
        if x.sharding().dim_parts(d)? > 1 {
            return Err(type_error(
                K::ShardingMismatch,
                op,
                &[x],
                format!("dimension {d} is sharded; `{op}` works on whole rows, reshard it first"),
            ));
        }
    }
    if !x.sharding().spec().unreduced().is_empty() {
        return Err(type_error(
            K::UnreducedOperand,
            op,
            &[x],
            format!("`{op}` cannot take an unreduced operand"),
        ));
    }
    Ok(())
}

/// Axes that split the rows of `x` (every dim but the last `skip`), i.e. the axes a row-wise
/// sum over all rows is partial over.
fn row_axes(x: &ArrayType) -> AxisSet {
    x.sharding()
        .spec()
        .partition_axes()
        .map(str::to_string)
        .collect()
}

impl Ctx<'_> {
    /// RMSNorm over the last dim: `x · rsqrt(mean(x²) + eps) · scale` (f32 statistics).
    ///
    /// # Errors
    /// A sharded last dim, an unreduced operand, or what `mul(x, scale)` would reject.
    ///
    /// # Collectives
    /// None forward. Backward: the scale's gradient is a sum over rows, partial over the axes
    /// the rows are split on — kept unreduced for a scale reduced on them, else all-reduced.
    pub fn rms_norm(&mut self, x: &Array, scale: &Array, eps: f32) -> Result<Array, SpmdError> {
        const OP: &str = "rms_norm";
        check_rowwise(OP, x.ty(), 1)?;
        if scale.ty().rank() != 1 || scale.shape()[0] != *x.shape().last().unwrap_or(&0) {
            return Err(type_error(
                K::ShapeError,
                OP,
                &[x.ty(), scale.ty()],
                "scale must match the last dim",
            ));
        }
        check_rowwise(OP, scale.ty(), 1)?;
        // The scale may stay f32 beside a bf16 `x` (norm scales are never rounded, docs/design.md
        // §10): the output takes `x`'s dtype.
        let scale_as_x = scale.ty().with_dtype(x.ty().dtype());
        let out_ty = rules::binary_type(BinaryOp::Mul, x.ty(), &scale_as_x)
            .map_err(|e| rules::attribute(OP, e))?
            .out;
        let native = bf16_operands(&out_ty, &[x]);
        let (out, inv) = match (native, scale.local_opt()) {
            (Some(xb), Some(s)) => {
                let (y, inv) = ferrotext_tensor::rms_norm_bf16(xb[0], &s, eps)?;
                (Array::from_bf16(out_ty, Some(y))?, inv)
            }
            (None, s) => match (x.local_opt().as_deref(), s.as_deref()) {
                (Some(xv), Some(s)) => {
                    let (y, inv) = ferrotext_tensor::rms_norm(xv, s, eps)?;
                    (Array::new(out_ty, Some(y)), inv)
                }
                _ => (Array::new(out_ty, None), Vec::new()),
            },
            (Some(_), None) => (Array::new(out_ty, None), Vec::new()),
        };
        self.record(
            Backward::RmsNorm {
                x: x.clone(),
                scale: scale.clone(),
                inv_rms: inv,
            },
            &[x, scale],
            out,
        )
    }

    pub(crate) fn rms_norm_transpose(
        &mut self,
        ct: &Array,
        x: &Array,
        scale: &Array,
        inv_rms: &[f32],
        need_scale: bool,
    ) -> Result<(Array, Option<Array>), SpmdError> {
        let dx_ty = x.ty().to_cotangent();
        let (dx, dscale) = match (bf16_operands(&dx_ty, &[x, ct]), scale.local_opt()) {
            (Some(b), Some(s)) => {
                let (dx, ds) = ferrotext_tensor::rms_norm_backward_bf16(b[0], &s, inv_rms, b[1])?;
                (Array::from_bf16(dx_ty, Some(dx))?, Some(ds))
            }
            (_, s) => match (
                x.local_opt().as_deref(),
                s.as_deref(),
                ct.local_opt().as_deref(),
            ) {
                (Some(xv), Some(s), Some(c)) => {
                    let (dx, ds) = ferrotext_tensor::rms_norm_backward(xv, s, inv_rms, c)?;
                    (Array::new(dx_ty, Some(dx)), Some(ds))
                }
                _ => (Array::new(dx_ty, None), None),
            },
        };
        if !need_scale {
            return Ok((dx, None));
        }
        // The scale's gradient: each device summed its own rows.
        let target = scale.ty().to_cotangent();
        let natural_spec =
            PartitionSpec::tagged([DimSpec::Replicated], row_axes(x.ty()), AxisSet::new())?;
        let natural = rules::make_type(
            "rms_norm",
            scale.ty(),
            scale.shape().to_vec(),
            Ok(natural_spec),
        )?;
        let dscale = self.convert(dscale, &natural, &target)?;
        Ok((dx, Some(Array::new(target, dscale))))
    }

    /// Softmax over the last dim (stable).
    ///
    /// # Errors
    /// A sharded last dim or an unreduced operand.
    pub fn softmax(&mut self, x: &Array) -> Result<Array, SpmdError> {
        check_rowwise("softmax", x.ty(), 1)?;
        let out = if let Some(b) = bf16_operands(x.ty(), &[x]) {
            Array::from_bf16(
                x.ty().clone(),
                Some(ferrotext_tensor::softmax_last_bf16(b[0])?),
            )?
        } else {
            let local = x
                .local_opt()
                .as_deref()
                .map(ferrotext_tensor::softmax_last)
                .transpose()?;
            Array::new(x.ty().clone(), local)
        };
        let saved = out.clone();
        self.record(
            Backward::Softmax {
                out: saved,
                scale: 1.0,
            },
            &[x],
            out,
        )
    }

    /// Causal softmax of `scale·x` over the last two dims `[.., Tq, Tk]` (query × key, the
    /// queries being the last `Tq` of `Tk ≥ Tq` positions): keys after the query get
    /// probability 0 (attention's mask and `1/√d` scale, fused). `Tq = Tk` in training; a
    /// decoder step over a key/value cache has `Tq < Tk`.
    ///
    /// # Errors
    /// A sharded query or key dim; an unreduced operand; fewer keys than queries.
    pub fn causal_softmax(&mut self, x: &Array, scale: f32) -> Result<Array, SpmdError> {
        check_rowwise("causal_softmax", x.ty(), 2)?;
        let out = if let Some(b) = bf16_operands(x.ty(), &[x]) {
            let y = ferrotext_tensor::causal_softmax_bf16(b[0], scale)?;
            Array::from_bf16(x.ty().clone(), Some(y))?
        } else {
            let local = x
                .local_opt()
                .as_deref()
                .map(|t| ferrotext_tensor::causal_softmax(t, scale))
                .transpose()?;
            Array::new(x.ty().clone(), local)
        };
        let saved = out.clone();
        self.record(Backward::Softmax { out: saved, scale }, &[x], out)
    }

    /// The SwiGLU activation `silu(g) ⊙ u` as one op (one pass forward, one backward):
    /// [`Ctx::glu`] with [`GluActivation::Silu`].
    ///
    /// # Errors
    /// As [`Ctx::glu`].
    pub fn swiglu(&mut self, g: &Array, u: &Array) -> Result<Array, SpmdError> {
        self.glu(g, u, GluActivation::Silu)
    }

    /// A gated unit's activation `act(g) ⊙ u` as one op (one pass forward, one backward):
    /// SwiGLU, or GeGLU with the tanh GELU. `act(g)` is never stored.
    ///
    /// # Errors
    /// What `mul(g, u)` would reject; an unreduced operand.
    pub fn glu(&mut self, g: &Array, u: &Array, act: GluActivation) -> Result<Array, SpmdError> {
        let op = act.name();
        if g.shape() != u.shape() {
            return Err(type_error(
                K::ShapeError,
                op,
                &[g.ty(), u.ty()],
                "gate and up must have one shape",
            ));
        }
        rules::unary_type(op, false, g.ty())?;
        let out_ty = if g.ty().is_manual() {
            crate::manual::typing::manual_binary_type(BinaryOp::Mul, g.ty(), u.ty()).map_err(
                |e| match e {
                    SpmdError::Type(t) => rules::attribute(op, t).into(),
                    other => other,
                },
            )?
        } else {
            rules::binary_type(BinaryOp::Mul, g.ty(), u.ty())
                .map_err(|e| rules::attribute(op, e))?
                .out
        };
        if out_ty.sharding().spec().partitions() != g.ty().sharding().spec().partitions()
            || g.ty().sharding().spec().partitions() != u.ty().sharding().spec().partitions()
        {
            return Err(type_error(
                K::ShardingMismatch,
                op,
                &[g.ty(), u.ty()],
                "gate and up must be laid out alike",
            ));
        }
        let out = if let Some(b) = bf16_operands(&out_ty, &[g, u]) {
            Array::from_bf16(out_ty, Some(ferrotext_tensor::glu_bf16(b[0], b[1], act)?))?
        } else {
            let local = match (g.local_opt().as_deref(), u.local_opt().as_deref()) {
                (Some(a), Some(b)) => Some(ferrotext_tensor::glu(a, b, act)?),
                _ => None,
            };
            Array::new(out_ty, local)
        };
        self.record(
            Backward::Glu {
                g: g.clone(),
                u: u.clone(),
                act,
            },
            &[g, u],
            out,
        )
    }

    /// The *sum* of token cross-entropies of `logits: [.., vocab]` against `targets` (same
    /// leading shape and sharding; [`IGNORE_INDEX`] marks a token to ignore), plus `z_loss·(log Z)²` per
    /// token (0 disables), as a plain scalar.
    ///
    /// # Errors
    /// A sharded vocab dim, tagged logits, or targets laid out differently from the logits'
    /// leading dims.
    ///
    /// # Collectives
    /// One all-reduce of one element over the axes the tokens are split on (forward only).
    pub fn cross_entropy_sum(
        &mut self,
        logits: &Array,
        targets: &Ids,
        z_loss: f32,
    ) -> Result<Array, SpmdError> {
        self.cross_entropy(logits, targets, z_loss, true)
    }

    /// [`Ctx::cross_entropy_sum`] left as each device's partial sum: a scalar unreduced over
    /// the axes the tokens are split on (`f32[]{U:data}`), for a caller that adds partial sums
    /// in an order of its own before reducing them once. Its cotangent is reduced (R4.5).
    ///
    /// # Errors
    /// As [`Ctx::cross_entropy_sum`].
    ///
    /// # Collectives
    /// None.
    pub fn cross_entropy_partial_sum(
        &mut self,
        logits: &Array,
        targets: &Ids,
        z_loss: f32,
    ) -> Result<Array, SpmdError> {
        self.cross_entropy(logits, targets, z_loss, false)
    }

    fn cross_entropy(
        &mut self,
        logits: &Array,
        targets: &Ids,
        z_loss: f32,
        reduce: bool,
    ) -> Result<Array, SpmdError> {
        const OP: &str = "cross_entropy";
        let t = logits.ty();
        check_rowwise(OP, t, 1)?;
        let lead = &t.shape()[..t.rank() - 1];
        let lead_parts: Vec<DimSpec> = (0..t.rank() - 1)
            .map(|d| t.sharding().spec().dim(d).clone())
            .collect();
        let tparts: Vec<DimSpec> = (0..targets.ty().rank())
            .map(|d| targets.ty().sharding().spec().dim(d).clone())
            .collect();
        if targets.ty().shape() != lead || tparts != lead_parts {
            return Err(type_error(
                K::ShardingMismatch,
                OP,
                &[t, targets.ty()],
                "targets must have the logits' leading shape and sharding",
            ));
        }
        let scalar_ty = self.array_type(&[], PartitionSpec::replicated())?;
        let natural = self.array_type(
            &[],
            PartitionSpec::replicated().with_unreduced_set(row_axes(t))?,
        )?;
        let (local, probs) = match (logits.local_opt().as_deref(), targets.local()) {
            (Some(l), Some(ids)) => {
                let v = *t.shape().last().unwrap_or(&1);
                let rows = l.len() / v;
                let flat = l.clone().reshape(&[rows, v])?;
                let (safe, mask) = split_ignored(ids);
                let ce = ferrotext_tensor::cross_entropy(&flat, &safe, &mask, z_loss)?;
                (
                    Some(ferrotext_tensor::Tensor::scalar(ce.loss_sum)),
                    Some(ce),
                )
            }
            _ => (None, None),
        };
        let out = if reduce {
            let local = self.convert(local, &natural, &scalar_ty)?;
            Array::new(scalar_ty, local)
        } else {
            Array::new(natural, local)
        };
        self.record(
            Backward::CrossEntropy {
                logits: t.clone(),
                targets: targets.clone(),
                ce: probs,
                z_loss,
            },
            &[logits],
            out,
        )
    }

    /// The transpose of [`Ctx::softmax`] / [`Ctx::causal_softmax`] (of `scale·x`) from its
    /// output `out`.
    pub(crate) fn softmax_transpose(
        &mut self,
        out: &Array,
        scale: f32,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        if let Some(b) = bf16_operands(ct.ty(), &[out, ct]) {
            let dx = ferrotext_tensor::softmax_backward_bf16(b[0], b[1], scale)?;
            return Array::from_bf16(ct.ty().clone(), Some(dx));
        }
        let local = match (out.local_opt().as_deref(), ct.local_opt().as_deref()) {
            (Some(y), Some(c)) => Some(ferrotext_tensor::softmax_backward_scaled(y, c, scale)?),
            _ => None,
        };
        Ok(Array::new(ct.ty().clone(), local))
    }

    /// The transpose of [`Ctx::glu`] at `(g, u)`: the cotangents of the gate and the up
    /// projection.
    pub(crate) fn glu_transpose(
        &mut self,
        g: &Array,
        u: &Array,
        act: GluActivation,
        ct: &Array,
    ) -> Result<[Array; 2], SpmdError> {
        if let Some(b) = bf16_operands(&g.ty().to_cotangent(), &[g, u, ct]) {
            // `u` holds bf16, so its type (and its cotangent's) is bf16 too.
            let (dg, du) = ferrotext_tensor::glu_backward_bf16(b[0], b[1], b[2], act)?;
            return Ok([
                Array::from_bf16(g.ty().to_cotangent(), Some(dg))?,
                Array::from_bf16(u.ty().to_cotangent(), Some(du))?,
            ]);
        }
        let (dg, du) = match (
            g.local_opt().as_deref(),
            u.local_opt().as_deref(),
            ct.local_opt().as_deref(),
        ) {
            (Some(a), Some(b), Some(c)) => {
                let (dg, du) = ferrotext_tensor::glu_backward(a, b, c, act)?;
                (Some(dg), Some(du))
            }
            _ => (None, None),
        };
        Ok([
            Array::new(g.ty().to_cotangent(), dg),
            Array::new(u.ty().to_cotangent(), du),
        ])
    }

    /// The transpose of [`Ctx::cross_entropy_sum`] of `logits` against `targets`, from the
    /// forward's saved probabilities `ce` (`None` in abstract mode): the logits' cotangent, no
    /// communication (the scalar `ct` is plain, so every device scales its own rows).
    pub(crate) fn cross_entropy_transpose(
        &mut self,
        logits: &ArrayType,
        targets: &Ids,
        ce: Option<&ferrotext_tensor::CrossEntropy>,
        z_loss: f32,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        let local = match (ce, ct.local_opt().as_deref(), targets.local()) {
            (Some(ce), Some(c), Some(ids)) => {
                let (safe, mask) = split_ignored(ids);
                let d = ferrotext_tensor::cross_entropy_backward(
                    ce,
                    &safe,
                    &mask,
                    z_loss,
                    c.data()[0],
                )?;
                Some(d.reshape(&logits.to_cotangent().shard_shape())?)
            }
            _ => None,
        };
        Ok(Array::new(logits.to_cotangent(), local))
    }
}

/// `ids` with [`IGNORE_INDEX`] replaced by 0 (a valid row to read), and the mask that is 0 at
/// those tokens and 1 elsewhere.
pub(crate) fn split_ignored(ids: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let safe = ids
        .iter()
        .map(|&i| if i == IGNORE_INDEX { 0 } else { i })
        .collect();
    let mask = ids
        .iter()
        .map(|&i| if i == IGNORE_INDEX { 0.0 } else { 1.0 })
        .collect();
    (safe, mask)
}
