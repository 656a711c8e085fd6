//! The ops on global arrays. Each one: (1) computes its output type with [`crate::rules`] — a
//! type error stops it before any compute or communication; (2) computes this device's shard
//! (real mode) and issues the collectives the types require, through the same helpers in real
//! and abstract mode; (3) records itself on the tape when autodiff is active.
//!
//! Ops that must communicate do it by computing a *natural* local result and resharding it onto
//! the output type: a contraction over sharded dims yields partial sums (unreduced over those
//! axes), which the reshard reduces — all-reduce, or reduce-scatter when the output is sharded on
//! a contracting axis — unless the output type keeps them unreduced.

use ferrotext_sharding::{ArrayType, AxisSet, DimSpec, PartitionSpec};
use ferrotext_tensor::{dot_general, DotDims, Tensor};

use crate::array::Array;
use crate::autodiff::Backward;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::rules::{self, BinaryOp};

/// Elementwise unary ops.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// `-x` (linear: accepts unreduced, DESIGN §4.1).
    Neg,
    /// `k·x` for a constant `k` that is not differentiated (linear: accepts unreduced).
    Scale(f32),
    /// `eˣ`.
    Exp,
    /// `ln x`.
    Log,
    /// `sin x`.
    Sin,
    /// `cos x`.
    Cos,
    /// `tanh x`.
    Tanh,
    /// `x²`.
    Square,
    /// `1/√x`.
    Rsqrt,
    /// `x·σ(x)` (SiLU).
    Silu,
    /// `σ(x) = 1/(1+e⁻ˣ)` (DeepSeek's router score).
    Sigmoid,
}

impl UnaryOp {
    fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Scale(_) => "scale",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Square => "square",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Silu => "silu",
            UnaryOp::Sigmoid => "sigmoid",
        }
    }

    fn is_linear(self) -> bool {
        matches!(self, UnaryOp::Neg | UnaryOp::Scale(_))
    }

    /// `op` over every element, one monomorphic loop per op.
    fn map(self, t: &Tensor) -> Tensor {
        match self {
            UnaryOp::Neg => t.map(|x| -x),
            UnaryOp::Scale(k) => t.map(|x| k * x),
            UnaryOp::Exp => t.map(f32::exp),
            UnaryOp::Log => t.map(f32::ln),
            UnaryOp::Sin => t.map(f32::sin),
            UnaryOp::Cos => t.map(f32::cos),
            UnaryOp::Tanh => t.map(f32::tanh),
            UnaryOp::Square => t.map(|x| x * x),
            UnaryOp::Rsqrt => t.map(|x| 1.0 / x.sqrt()),
            UnaryOp::Silu => t.map(|x| x / (1.0 + (-x).exp())),
            UnaryOp::Sigmoid => t.map(|x| 1.0 / (1.0 + (-x).exp())),
        }
    }

    /// d(op)/dx elementwise at `x` (with `y = op(x)` at hand), one monomorphic loop per op.
    pub(crate) fn derivative(self, x: &Tensor, y: &Tensor) -> Result<Tensor, SpmdError> {
        Ok(match self {
            UnaryOp::Neg => x.map(|_| -1.0),
            UnaryOp::Scale(k) => x.map(|_| k),
            UnaryOp::Exp => y.clone(),
            UnaryOp::Log => x.map(|v| 1.0 / v),
            UnaryOp::Sin => x.map(f32::cos),
            UnaryOp::Cos => x.map(|v| -v.sin()),
            UnaryOp::Tanh => y.map(|t| 1.0 - t * t),
            UnaryOp::Square => x.map(|v| 2.0 * v),
            UnaryOp::Rsqrt => y.map(|r| -0.5 * r * r * r),
            UnaryOp::Silu => x.map(|v| {
                let s = 1.0 / (1.0 + (-v).exp());
                s * (1.0 + v * (1.0 - s))
            }),
            UnaryOp::Sigmoid => y.map(|s| s * (1.0 - s)),
        })
    }
}

impl Ctx<'_> {
    // -----------------------------------------------------------------------------------------
    // Elementwise

    /// `op(x)` elementwise. Reduced passes through; unreduced only for linear ops.
    ///
    /// # Errors
    /// `unreduced_operand` for a non-linear op on an unreduced value.
    pub fn unary(&mut self, op: UnaryOp, x: &Array) -> Result<Array, SpmdError> {
        let out = self.unary_untracked(op, x)?;
        self.record(
            Backward::Unary {
                op,
                x: x.clone(),
                out: out.clone(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn unary_untracked(&mut self, op: UnaryOp, x: &Array) -> Result<Array, SpmdError> {
        let ty = if x.ty().is_manual() {
            crate::manual::manual_unary_type(op.name(), op.is_linear(), x.ty())?
        } else {
            rules::unary_type(op.name(), op.is_linear(), x.ty())?
        };
        let local = x.local_opt().map(|t| op.map(t));
        Ok(Array::new(ty, local))
    }

    /// `-x`.
    ///
    /// # Errors
    /// As [`Ctx::unary`].
    pub fn neg(&mut self, x: &Array) -> Result<Array, SpmdError> {
        self.unary(UnaryOp::Neg, x)
    }

    /// `k·x` for a constant `k`.
    ///
    /// # Errors
    /// As [`Ctx::unary`].
    pub fn scale(&mut self, x: &Array, k: f32) -> Result<Array, SpmdError> {
        self.unary(UnaryOp::Scale(k), x)
    }

    /// `eˣ`.
    ///
    /// # Errors
    /// As [`Ctx::unary`].
    pub fn exp(&mut self, x: &Array) -> Result<Array, SpmdError> {
        self.unary(UnaryOp::Exp, x)
    }

    /// `a ∘ b` elementwise with NumPy broadcasting. An operand replicated (or reduced) on an axis
    /// the other is sharded on is sliced locally (DESIGN §4.2).
    ///
    /// # Errors
    /// The binary-op type errors of [`crate::rules::binary_type`].
    pub fn binary(&mut self, op: BinaryOp, a: &Array, b: &Array) -> Result<Array, SpmdError> {
        // R3.4: a rank-0 untagged operand next to a reduced one is cast to reduced first, as a
        // recorded reshard (free forward; its transpose reduces the scalar's cotangent).
        let promote = |x: &Array, other: &Array| {
            x.ty().rank() == 0
                && !x.ty().sharding().spec().is_tagged()
                && !other.ty().sharding().spec().reduced().is_empty()
        };
        if promote(a, b) || promote(b, a) {
            let (x, other) = if promote(a, b) { (a, b) } else { (b, a) };
            let spec = PartitionSpec::replicated()
                .with_reduced_set(other.ty().sharding().spec().reduced().clone())?;
            let cast = self.reshard(x, &spec)?;
            return if promote(a, b) {
                self.binary(op, &cast, b)
            } else {
                self.binary(op, a, &cast)
            };
        }
        if a.ty().is_manual() || b.ty().is_manual() {
            // R6.10: missing varying axes are cast in first (recorded: their transposes matter).
            let cast = self.match_varying(&[a, b])?;
            if cast[0].ty() != a.ty() || cast[1].ty() != b.ty() {
                return self.binary(op, &cast[0], &cast[1]);
            }
        }
        let out = self.binary_untracked(op, a, b)?;
        self.record(
            Backward::Binary {
                op,
                a: a.clone(),
                b: b.clone(),
                out: out.clone(),
            },
            &[a, b],
            out,
        )
    }

    pub(crate) fn binary_untracked(
        &mut self,
        op: BinaryOp,
        a: &Array,
        b: &Array,
    ) -> Result<Array, SpmdError> {
        let out_ty = if a.ty().is_manual() || b.ty().is_manual() {
            crate::manual::manual_binary_type(op, a.ty(), b.ty())?
        } else {
            rules::binary_type(op, a.ty(), b.ty())?.out
        };
        let local = match (a.local_opt(), b.local_opt()) {
            (Some(x), Some(y)) => {
                let x = self.slice_to(x, a.ty(), &out_ty)?;
                let y = self.slice_to(y, b.ty(), &out_ty)?;
                // One monomorphic loop per op (a function pointer here would cost a call per
                // element and stop vectorisation).
                Some(match op {
                    BinaryOp::Add => x.zip_with(&y, |p, q| p + q)?,
                    BinaryOp::Sub => x.zip_with(&y, |p, q| p - q)?,
                    BinaryOp::Mul => x.zip_with(&y, |p, q| p * q)?,
                    BinaryOp::Div => x.zip_with(&y, |p, q| p / q)?,
                    BinaryOp::Max => x.zip_with(&y, f32::max)?,
                })
            }
            _ => None,
        };
        Ok(Array::new(out_ty, local))
    }

    /// The operand's local block cut down to the output's partitions (right-aligned dims;
    /// broadcast size-1 dims stay size 1). Only slices: the type rule guarantees that every
    /// operand dim is either partitioned like the output or replicated.
    fn slice_to<'a>(
        &self,
        t: &'a Tensor,
        ty: &ArrayType,
        out: &ArrayType,
    ) -> Result<std::borrow::Cow<'a, Tensor>, SpmdError> {
        let lead = out.rank() - ty.rank();
        let needs_slice = !out.is_manual()
            && (0..ty.rank()).any(|i| {
                ty.shape()[i] == out.shape()[lead + i]
                    && ty.sharding().spec().dim(i) != out.sharding().spec().dim(lead + i)
            });
        if !needs_slice {
            return Ok(std::borrow::Cow::Borrowed(t));
        }
        let mut t = t.clone();
        for i in 0..ty.rank() {
            let want = out.sharding().spec().dim(lead + i);
            if ty.shape()[i] != out.shape()[lead + i] || ty.sharding().spec().dim(i) == want {
                continue;
            }
            let (index, n) = self.rank_over(want.axis_names())?;
            let block = t.shape()[i] / n;
            t = t.slice_dim(i, index * block..(index + 1) * block)?;
        }
        Ok(std::borrow::Cow::Owned(t))
    }

    /// `a + b`.
    ///
    /// # Errors
    /// As [`Ctx::binary`].
    pub fn add(&mut self, a: &Array, b: &Array) -> Result<Array, SpmdError> {
        self.binary(BinaryOp::Add, a, b)
    }

    /// `a - b`.
    ///
    /// # Errors
    /// As [`Ctx::binary`].
    pub fn sub(&mut self, a: &Array, b: &Array) -> Result<Array, SpmdError> {
        self.binary(BinaryOp::Sub, a, b)
    }

    /// `a * b`.
    ///
    /// # Errors
    /// As [`Ctx::binary`].
    pub fn mul(&mut self, a: &Array, b: &Array) -> Result<Array, SpmdError> {
        self.binary(BinaryOp::Mul, a, b)
    }

    /// `a / b`.
    ///
    /// # Errors
    /// As [`Ctx::binary`].
    pub fn div(&mut self, a: &Array, b: &Array) -> Result<Array, SpmdError> {
        self.binary(BinaryOp::Div, a, b)
    }

    // -----------------------------------------------------------------------------------------
    // dot_general

    /// `dot_general(lhs, rhs)` with output `[batch, lhs free, rhs free]` typed by `out_sharding`
    /// (or inferred, R3.10).
    ///
    /// # Errors
    /// The dot_general type errors (R3.8–R3.12).
    ///
    /// # Collectives
    /// None when no contracting dim is sharded or when `out_sharding` keeps the partial sums
    /// unreduced; otherwise an all-reduce over the contracting axes (a reduce-scatter when the
    /// output is sharded on one of them). Operands sharded in ways that cannot meet locally are
    /// gathered first.
    pub fn dot_general(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        // The `out_sharding` is checked against the mesh before anything else (R1.13/R1.14).
        if let Some(spec) = out_sharding {
            rules::check_out_sharding("dot_general", lhs.ty().sharding().mesh(), spec)?;
        }
        if lhs.ty().is_manual() || rhs.ty().is_manual() {
            let cast = self.match_varying(&[lhs, rhs])?;
            if cast[0].ty() != lhs.ty() || cast[1].ty() != rhs.ty() {
                return self.dot_general(&cast[0], &cast[1], dims, out_sharding);
            }
        }
        let out = self.dot_general_untracked(lhs, rhs, dims, out_sharding)?;
        self.record(
            Backward::Dot {
                lhs: lhs.clone(),
                rhs: rhs.clone(),
                dims: dims.clone(),
            },
            &[lhs, rhs],
            out,
        )
    }

    /// `x · w` contracting the last dim of `x` with the first of `w`.
    ///
    /// # Errors
    /// As [`Ctx::dot_general`].
    pub fn matmul(
        &mut self,
        x: &Array,
        w: &Array,
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        self.dot_general(x, w, &DotDims::matmul(x.ty().rank()), out_sharding)
    }

    pub(crate) fn dot_general_untracked(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        if lhs.ty().is_manual() || rhs.ty().is_manual() {
            manual_without_out_sharding("dot_general", lhs, out_sharding)?;
            return self.manual_dot(lhs, rhs, dims);
        }
        let out_ty = rules::dot_general_type(lhs.ty(), rhs.ty(), dims, out_sharding)?;
        let (lhs_ty, rhs_ty, contracted) = aligned_dot_types(lhs.ty(), rhs.ty(), dims)?;
        let l = self.aligned(lhs, &lhs_ty)?;
        let r = self.aligned(rhs, &rhs_ty)?;
        let natural_local = match (l, r) {
            (Some(l), Some(r)) => Some(dot_general(&l, &r, dims, self.threads())?),
            _ => None,
        };
        // The natural result: partial sums over the contracting axes.
        let lf = DotDims::free(lhs.ty().rank(), &dims.lhs_batch, &dims.lhs_contracting);
        let rf = DotDims::free(rhs.ty().rank(), &dims.rhs_batch, &dims.rhs_contracting);
        let partitions: Vec<DimSpec> = dims
            .lhs_batch
            .iter()
            .chain(&lf)
            .map(|&d| lhs_ty.sharding().spec().dim(d).clone())
            .chain(rf.iter().map(|&d| rhs_ty.sharding().spec().dim(d).clone()))
            .collect();
        let natural_spec = PartitionSpec::tagged(partitions, contracted, AxisSet::new())?;
        let natural = rules::make_type(
            "dot_general",
            &out_ty,
            out_ty.shape().to_vec(),
            Ok(natural_spec),
        )?;
        let local = self.convert(natural_local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `x`'s shard laid out as `ty`: borrowed when the layout already matches, else moved.
    fn aligned<'a>(
        &mut self,
        x: &'a Array,
        ty: &ArrayType,
    ) -> Result<Option<std::borrow::Cow<'a, Tensor>>, SpmdError> {
        if crate::reshard::same_layout(x.ty(), ty) {
            return Ok(x.local_opt().map(std::borrow::Cow::Borrowed));
        }
        Ok(self
            .convert(x.local_cloned(), x.ty(), ty)?
            .map(std::borrow::Cow::Owned))
    }

    // -----------------------------------------------------------------------------------------
    // reduce_sum, broadcast_in_dim, reshape, transpose

    /// Sum over `axes` (R3.16–R3.18).
    ///
    /// # Errors
    /// The reduce_sum type errors.
    ///
    /// # Collectives
    /// An all-reduce (or reduce-scatter) over the axes of summed sharded dims that the output
    /// does not keep unreduced; none otherwise.
    pub fn reduce_sum(
        &mut self,
        x: &Array,
        axes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        let out = self.reduce_sum_untracked(x, axes, out_sharding)?;
        self.record(
            Backward::ReduceSum {
                x: x.ty().clone(),
                axes: axes.to_vec(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn reduce_sum_untracked(
        &mut self,
        x: &Array,
        axes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        if x.ty().is_manual() {
            manual_without_out_sharding("reduce_sum", x, out_sharding)?;
            let shape = rules::reduce_sum_type(x.ty(), axes, None)?.shape().to_vec();
            let local = x.local_opt().map(|t| t.sum_axes(axes)).transpose()?;
            return self.manual_local(x, shape, local);
        }
        let out_ty = rules::reduce_sum_type(x.ty(), axes, out_sharding)?;
        let spec = x.ty().sharding().spec();
        let mut u = spec.unreduced().clone();
        let mut partitions = Vec::new();
        for d in 0..x.ty().rank() {
            if axes.contains(&d) {
                u.extend(spec.dim(d).axis_names().iter().cloned());
            } else {
                partitions.push(spec.dim(d).clone());
            }
        }
        let natural_spec = PartitionSpec::tagged(partitions, u, spec.reduced().clone())?;
        let natural = rules::make_type(
            "reduce_sum",
            &out_ty,
            out_ty.shape().to_vec(),
            Ok(natural_spec),
        )?;
        let local = match x.local_opt() {
            Some(t) => Some(t.sum_axes(axes)?),
            None => None,
        };
        let local = self.convert(local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `x` broadcast to `shape`, its dim `i` becoming dim `dims[i]` (R3.22).
    ///
    /// # Errors
    /// The broadcast_in_dim type errors.
    ///
    /// # Collectives
    /// None for new dims (sliced locally); gathers only when `out_sharding` un-shards an operand
    /// dim.
    pub fn broadcast_in_dim(
        &mut self,
        x: &Array,
        shape: &[usize],
        dims: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        let out = self.broadcast_in_dim_untracked(x, shape, dims, out_sharding)?;
        self.record(
            Backward::Broadcast {
                x: x.ty().clone(),
                dims: dims.to_vec(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn broadcast_in_dim_untracked(
        &mut self,
        x: &Array,
        shape: &[usize],
        dims: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        if x.ty().is_manual() {
            manual_without_out_sharding("broadcast_in_dim", x, out_sharding)?;
            rules::broadcast_in_dim_type(x.ty(), shape, dims, None)?;
            let local = x
                .local_opt()
                .map(|t| t.broadcast_in_dim(shape, dims))
                .transpose()?;
            return self.manual_local(x, shape.to_vec(), local);
        }
        let out_ty = rules::broadcast_in_dim_type(x.ty(), shape, dims, out_sharding)?;
        let natural = rules::broadcast_in_dim_type(x.ty(), shape, dims, None)?;
        let local = match x.local_opt() {
            Some(t) => {
                let local_shape = natural.shard_shape();
                Some(t.broadcast_in_dim(&local_shape, dims)?)
            }
            None => None,
        };
        let local = self.convert(local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `x` with a new shape of the same size (R3.23).
    ///
    /// # Errors
    /// The reshape type errors.
    ///
    /// # Collectives
    /// None when every shard stays local (the usual merge or split of a dim sharded on its major
    /// part); otherwise the gathers and slices of the equivalent reshard.
    pub fn reshape(
        &mut self,
        x: &Array,
        new_sizes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        let out = self.reshape_untracked(x, new_sizes, out_sharding)?;
        self.record(Backward::Reshape { x: x.ty().clone() }, &[x], out)
    }

    pub(crate) fn reshape_untracked(
        &mut self,
        x: &Array,
        new_sizes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        if x.ty().is_manual() {
            manual_without_out_sharding("reshape", x, out_sharding)?;
            rules::reshape_type(x.ty(), new_sizes, None)?;
            let local = x
                .local_opt()
                .map(|t| t.clone().reshape(new_sizes))
                .transpose()?;
            return self.manual_local(x, new_sizes.to_vec(), local);
        }
        let out_ty = rules::reshape_type(x.ty(), new_sizes, out_sharding)?;
        let spec = x.ty().sharding().spec();
        // Either reshape each shard in place, or gather the partitions first.
        let (src_ty, src_local) = if rules::local_reshape_partitions(x.ty(), new_sizes).is_some() {
            (x.ty().clone(), x.local_cloned())
        } else {
            let unsharded = PartitionSpec::tagged(
                Vec::<DimSpec>::new(),
                spec.unreduced().clone(),
                spec.reduced().clone(),
            )?;
            let ty = rules::reshard_type(x.ty(), &unsharded)?;
            let local = self.convert(x.local_cloned(), x.ty(), &ty)?;
            (ty, local)
        };
        let natural = rules::reshape_type(&src_ty, new_sizes, None)?;
        let local = match src_local {
            Some(t) => Some(t.reshape(&natural.shard_shape())?),
            None => None,
        };
        let local = self.convert(local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `x` with its dims permuted: output dim `d` is input dim `perm[d]`.
    ///
    /// # Errors
    /// `shape_error` when `perm` is not a permutation.
    pub fn transpose(&mut self, x: &Array, perm: &[usize]) -> Result<Array, SpmdError> {
        let out = self.transpose_untracked(x, perm)?;
        self.record(
            Backward::Transpose {
                perm: perm.to_vec(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn transpose_untracked(
        &mut self,
        x: &Array,
        perm: &[usize],
    ) -> Result<Array, SpmdError> {
        let ty = rules::transpose_type(x.ty(), perm)?;
        let local = match x.local_opt() {
            Some(t) => Some(t.transpose(perm)?),
            None => None,
        };
        if x.ty().is_manual() {
            return self.manual_local(x, ty.shape().to_vec(), local);
        }
        Ok(Array::new(ty, local))
    }
}

/// Inside a region every op is local: an output sharding has no meaning there. A tag on a Manual
/// axis is still first of all an invalid spec (R1.13, R1.14), as it is outside a region.
fn manual_without_out_sharding(
    op: &str,
    x: &Array,
    out_sharding: Option<&PartitionSpec>,
) -> Result<(), SpmdError> {
    match out_sharding {
        None => Ok(()),
        Some(spec) => {
            rules::check_out_sharding(op, x.ty().sharding().mesh(), spec)?;
            Err(SpmdError::BadArgument {
                op: op.into(),
                reason: format!("`out_sharding` {spec} is not allowed inside a shard_map body"),
            })
        }
    }
}

/// The operand layouts a dot_general computes in locally, and the axes its contraction runs over.
///
/// Each contracting pair meets on one partition: the common one, or the sharded side's when the
/// other is replicated (the replicated side is sliced, free), or the lhs's when both are sharded
/// differently (the rhs is resharded). A free dim gives up axes the other operand or a
/// contraction uses (gathered). The natural result is then unreduced over the contraction axes.
fn aligned_dot_types(
    lhs: &ArrayType,
    rhs: &ArrayType,
    dims: &DotDims,
) -> Result<(ArrayType, ArrayType, AxisSet), SpmdError> {
    let ls = lhs.sharding().spec();
    let rs = rhs.sharding().spec();
    let lf = DotDims::free(lhs.rank(), &dims.lhs_batch, &dims.lhs_contracting);
    let rf = DotDims::free(rhs.rank(), &dims.rhs_batch, &dims.rhs_contracting);
    let mut lparts: Vec<DimSpec> = (0..lhs.rank()).map(|d| ls.dim(d).clone()).collect();
    let mut rparts: Vec<DimSpec> = (0..rhs.rank()).map(|d| rs.dim(d).clone()).collect();
    let axes_of = |parts: &[DimSpec], skip: usize| -> AxisSet {
        parts
            .iter()
            .enumerate()
            .filter(|(d, _)| *d != skip)
            .flat_map(|(_, p)| p.axis_names().iter().cloned())
            .collect()
    };
    // Batch dims meet on the lhs's partition (the rhs's when the lhs is replicated there: the
    // lhs is sliced for free and each device computes its batch slice). When the output type
    // keeps the lhs's replicated batch dim (R3.9), the natural result is sharded where the
    // output is not, and the final reshard all-gathers it.
    for (&l, &r) in dims.lhs_batch.iter().zip(&dims.rhs_batch) {
        let target = if !lparts[l].is_replicated() {
            lparts[l].clone()
        } else {
            rparts[r].clone()
        };
        let clash = target
            .axis_names()
            .iter()
            .any(|a| axes_of(&lparts, l).contains(a) || axes_of(&rparts, r).contains(a));
        let target = if clash { DimSpec::Replicated } else { target };
        lparts[l] = target.clone();
        rparts[r] = target;
    }
    let mut contracted = AxisSet::new();
    for (&l, &r) in dims.lhs_contracting.iter().zip(&dims.rhs_contracting) {
        let target = if !lparts[l].is_replicated() {
            lparts[l].clone()
        } else {
            rparts[r].clone()
        };
        let clash = target
            .axis_names()
            .iter()
            .any(|a| axes_of(&lparts, l).contains(a) || axes_of(&rparts, r).contains(a));
        let target = if clash { DimSpec::Replicated } else { target };
        contracted.extend(target.axis_names().iter().cloned());
        lparts[l] = target.clone();
        rparts[r] = target;
    }
    // Free dims may not use contraction axes, and the rhs's free dims may not use the lhs's axes.
    for &d in &lf {
        let keep: Vec<String> = lparts[d]
            .axis_names()
            .iter()
            .take_while(|a| !contracted.contains(*a))
            .cloned()
            .collect();
        lparts[d] = DimSpec::axes(keep);
    }
    let lhs_axes = axes_of(&lparts, usize::MAX);
    for &d in &rf {
        let keep: Vec<String> = rparts[d]
            .axis_names()
            .iter()
            .take_while(|a| !contracted.contains(*a) && !lhs_axes.contains(*a))
            .cloned()
            .collect();
        rparts[d] = DimSpec::axes(keep);
    }
    let retag = |t: &ArrayType, parts: Vec<DimSpec>| -> Result<ArrayType, SpmdError> {
        let used: AxisSet = parts
            .iter()
            .flat_map(|p| p.axis_names().iter().cloned())
            .collect();
        let r: AxisSet = t
            .sharding()
            .spec()
            .reduced()
            .difference(&used)
            .cloned()
            .collect();
        let spec = PartitionSpec::tagged(parts, AxisSet::new(), r)?;
        Ok(rules::make_type(
            "dot_general",
            t,
            t.shape().to_vec(),
            Ok(spec),
        )?)
    };
    Ok((retag(lhs, lparts)?, retag(rhs, rparts)?, contracted))
}
