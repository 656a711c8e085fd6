//! Elementwise ops and their transposes: [`UnaryOp`] (`neg`, `scale`, `exp`, …) and the binary
//! ops (`add`, `sub`, `mul`, `div`, `max`) with NumPy broadcasting.
//!
//! Owns: the forward of each op — output type from [`crate::rules`] (or the region's rule inside
//! `shard_map`), this device's block, the tape record — and its transpose. An operand replicated
//! (or reduced) on an axis the other is sharded on is sliced locally (docs/design.md §4.2), so the
//! forward never communicates; the transpose of a broadcast operand sums its cotangent back
//! (`unbroadcast`), which may reduce over the axes the other operand was sharded on.
//!
//! Only the cotangents of differentiated inputs are computed: a constant operand (a mask, a
//! batch) must not cost a reduction. `max` has no transpose.
//!
//! bf16: maps, their transposes' derivatives, and binary ops whose operand shards are the
//! output's shard shape (no slicing, no broadcast) run on the bf16 shards as stored, each value
//! the `f32` function of the widened inputs rounded once: bitwise the widened route's result.

use ferrotext_sharding::{ArrayType, PartitionSpec};
use ferrotext_tensor::{fixed_math, softcap, Bf16Tensor, Tensor};

use crate::array::bf16_operands;
use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::rules::{self, BinaryOp, UnaryOp};
use crate::tape::Backward;

/// `√(2/π)`, GELU's tanh approximation's factor.
const GELU_K: f32 = 0.797_884_6;

/// GELU, tanh approximation: `½x(1 + tanh(√(2/π)(x + 0.044715x³)))`, as torch's
/// `gelu(approximate="tanh")` writes it.
fn gelu_tanh(x: f32) -> f32 {
    0.5 * x * (1.0 + fixed_math::tanh(GELU_K * (x + 0.044_715 * x * x * x)))
}

/// d/dx of [`gelu_tanh`]: `½(1 + t) + ½x(1 − t²)·√(2/π)(1 + 3·0.044715x²)`, `t` the tanh.
fn gelu_tanh_derivative(x: f32) -> f32 {
    let t = fixed_math::tanh(GELU_K * (x + 0.044_715 * x * x * x));
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * 0.044_715 * x * x)
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
            UnaryOp::Shift(_) => "shift",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Softcap(_) => "softcap",
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
            UnaryOp::Exp => t.map(fixed_math::exp),
            UnaryOp::Log => t.map(fixed_math::ln),
            UnaryOp::Sin => t.map(fixed_math::sin),
            UnaryOp::Cos => t.map(fixed_math::cos),
            UnaryOp::Tanh => t.map(fixed_math::tanh),
            UnaryOp::Square => t.map(|x| x * x),
            UnaryOp::Rsqrt => t.map(|x| 1.0 / x.sqrt()),
            UnaryOp::Silu => t.map(|x| x / (1.0 + fixed_math::exp(-x))),
            UnaryOp::Sigmoid => t.map(|x| 1.0 / (1.0 + fixed_math::exp(-x))),
            UnaryOp::Shift(c) => t.map(|x| x + c),
            UnaryOp::GeluTanh => t.map(gelu_tanh),
            UnaryOp::Softcap(c) => t.map(|x| softcap(x, c)),
        }
    }

    /// [`UnaryOp::map`] on a bf16 tensor: the same `f32` function on each widened element, rounded
    /// (bitwise the `f32` map on the widened tensor, rounded on store).
    fn map_bf16(self, t: &Bf16Tensor) -> Bf16Tensor {
        use ferrotext_tensor::map_bf16 as m;
        match self {
            UnaryOp::Neg => m(t, |x| -x),
            UnaryOp::Scale(k) => m(t, |x| k * x),
            UnaryOp::Exp => m(t, fixed_math::exp),
            UnaryOp::Log => m(t, fixed_math::ln),
            UnaryOp::Sin => m(t, fixed_math::sin),
            UnaryOp::Cos => m(t, fixed_math::cos),
            UnaryOp::Tanh => m(t, fixed_math::tanh),
            UnaryOp::Square => m(t, |x| x * x),
            UnaryOp::Rsqrt => m(t, |x| 1.0 / x.sqrt()),
            UnaryOp::Silu => m(t, |x| x / (1.0 + fixed_math::exp(-x))),
            UnaryOp::Sigmoid => m(t, |x| 1.0 / (1.0 + fixed_math::exp(-x))),
            UnaryOp::Shift(c) => m(t, |x| x + c),
            UnaryOp::GeluTanh => m(t, gelu_tanh),
            UnaryOp::Softcap(c) => m(t, |x| softcap(x, c)),
        }
    }

    /// d(op)/dx elementwise at `x` (with `y = op(x)` at hand), one monomorphic loop per op.
    pub(crate) fn derivative(self, x: &Tensor, y: &Tensor) -> Result<Tensor, SpmdError> {
        Ok(match self {
            UnaryOp::Neg => x.map(|_| -1.0),
            UnaryOp::Scale(k) => x.map(|_| k),
            UnaryOp::Exp => y.clone(),
            UnaryOp::Log => x.map(|v| 1.0 / v),
            UnaryOp::Sin => x.map(fixed_math::cos),
            UnaryOp::Cos => x.map(|v| -fixed_math::sin(v)),
            UnaryOp::Tanh => y.map(|t| 1.0 - t * t),
            UnaryOp::Square => x.map(|v| 2.0 * v),
            UnaryOp::Rsqrt => y.map(|r| -0.5 * r * r * r),
            UnaryOp::Silu => x.map(|v| {
                let s = 1.0 / (1.0 + fixed_math::exp(-v));
                s * (1.0 + v * (1.0 - s))
            }),
            UnaryOp::Sigmoid => y.map(|s| s * (1.0 - s)),
            UnaryOp::Shift(_) => x.map(|_| 1.0),
            UnaryOp::GeluTanh => x.map(gelu_tanh_derivative),
            UnaryOp::Softcap(c) => y.map(|v| 1.0 - (v / c) * (v / c)),
        })
    }
}

/// `a ∘ b` on bf16 shards of one shape: the `f32` function on the widened elements, rounded
/// (bitwise the `f32` op on the widened shards, rounded on store); one monomorphic loop per op.
fn binary_bf16(op: BinaryOp, a: &Bf16Tensor, b: &Bf16Tensor) -> Result<Bf16Tensor, SpmdError> {
    use ferrotext_tensor::zip_bf16 as z;
    Ok(match op {
        BinaryOp::Add => z(a, b, |p, q| p + q)?,
        BinaryOp::Sub => z(a, b, |p, q| p - q)?,
        BinaryOp::Mul => z(a, b, |p, q| p * q)?,
        BinaryOp::Div => z(a, b, |p, q| p / q)?,
        BinaryOp::Max => z(a, b, f32::max)?,
    })
}

impl UnaryOp {
    /// [`UnaryOp::derivative`] on bf16 `x` and `y`, each value rounded to bf16 as the `f32` one
    /// is when stored in `x`'s (bf16) type: the same `f32` functions on the widened elements.
    fn derivative_bf16(self, x: &Bf16Tensor, y: &Bf16Tensor) -> Bf16Tensor {
        use ferrotext_tensor::map_bf16 as m;
        match self {
            UnaryOp::Neg => m(x, |_| -1.0),
            UnaryOp::Scale(k) => m(x, |_| k),
            UnaryOp::Exp => y.clone(),
            UnaryOp::Log => m(x, |v| 1.0 / v),
            UnaryOp::Sin => m(x, fixed_math::cos),
            UnaryOp::Cos => m(x, |v| -fixed_math::sin(v)),
            UnaryOp::Tanh => m(y, |t| 1.0 - t * t),
            UnaryOp::Square => m(x, |v| 2.0 * v),
            UnaryOp::Rsqrt => m(y, |r| -0.5 * r * r * r),
            UnaryOp::Silu => m(x, |v| {
                let s = 1.0 / (1.0 + fixed_math::exp(-v));
                s * (1.0 + v * (1.0 - s))
            }),
            UnaryOp::Sigmoid => m(y, |s| s * (1.0 - s)),
            UnaryOp::Shift(_) => m(x, |_| 1.0),
            UnaryOp::GeluTanh => m(x, gelu_tanh_derivative),
            UnaryOp::Softcap(c) => m(y, |v| 1.0 - (v / c) * (v / c)),
        }
    }
}

impl Ctx<'_> {
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
            crate::manual::typing::manual_unary_type(op.name(), op.is_linear(), x.ty())?
        } else {
            rules::unary_type(op.name(), op.is_linear(), x.ty())?
        };
        if let Some(b) = bf16_operands(&ty, &[x]) {
            let y = op.map_bf16(b[0]);
            return Array::from_bf16(ty, Some(y));
        }
        let local = x.local_opt().as_deref().map(|t| op.map(t));
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
    /// the other is sharded on is sliced locally (docs/design.md §4.2).
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
            crate::manual::typing::manual_binary_type(op, a.ty(), b.ty())?
        } else {
            rules::binary_type(op, a.ty(), b.ty())?.out
        };
        if let Some(v) = bf16_operands(&out_ty, &[a, b]) {
            // Operands whose shards are the output's shard shape need no slicing or broadcast.
            let shard = out_ty.shard_shape();
            if v[0].shape() == shard.as_slice() && v[1].shape() == shard.as_slice() {
                return Array::from_bf16(out_ty, Some(binary_bf16(op, v[0], v[1])?));
            }
        }
        let local = match (a.local_opt().as_deref(), b.local_opt().as_deref()) {
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

    /// `acc += x` in place, for two arrays of one type outside autodiff (a gradient
    /// accumulator): bitwise [`Ctx::add`]'s result, without a new buffer (the shard is copied
    /// first only if another array shares it).
    ///
    /// # Errors
    /// [`SpmdError::AccumulateMismatch`] when the types differ or either array is on an autodiff tape.
    pub fn accumulate(&mut self, acc: &mut Array, x: &Array) -> Result<(), SpmdError> {
        if acc.ty() != x.ty() || acc.var.is_some() || x.var.is_some() {
            return Err(SpmdError::AccumulateMismatch {
                op: "accumulate",
                acc: acc.ty().to_string(),
                x: x.ty().to_string(),
            });
        }
        if acc.local_bf16().is_some() {
            // A bf16 sum is rounded once, as `add` stores it.
            let sum = self.binary_untracked(BinaryOp::Add, acc, x)?;
            *acc = sum;
            return Ok(());
        }
        if let Some(src) = x.local_opt().as_deref() {
            if !acc.is_abstract() {
                acc.local_mut()?.add_assign(src)?;
            }
        }
        Ok(())
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

    /// The transpose of [`Ctx::unary`] at `x` (with `out = op(x)` at hand): `ct · f'(x)`, or the
    /// op itself for a linear one. The derivative has x's type (reduced passes), so a `{U}` ct
    /// times an `{R}` derivative stays `{U}` (R4.13).
    pub(crate) fn unary_transpose(
        &mut self,
        op: UnaryOp,
        x: &Array,
        out: &Array,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        if matches!(op, UnaryOp::Neg | UnaryOp::Scale(_)) {
            return self.unary_untracked(op, ct);
        }
        let deriv = if let Some(b) = bf16_operands(x.ty(), &[x, out]) {
            Array::from_bf16(x.ty().clone(), Some(op.derivative_bf16(b[0], b[1])))?
        } else {
            let local = match (x.local_opt().as_deref(), out.local_opt().as_deref()) {
                (Some(xv), Some(yv)) => Some(op.derivative(xv, yv)?),
                _ => None,
            };
            Array::new(x.ty().clone(), local)
        };
        self.binary_untracked(BinaryOp::Mul, ct, &deriv)
    }

    /// The transpose of [`Ctx::binary`]: the cotangents of `a` and `b` (with `out = a ∘ b` at
    /// hand), each summed back over what the op broadcast; `None` where `need` says the input is
    /// not differentiated.
    ///
    /// # Errors
    /// `max` (not differentiable); a type error of the emitted ops.
    pub(crate) fn binary_transpose(
        &mut self,
        op: BinaryOp,
        (a, b, out): (&Array, &Array, &Array),
        ct: &Array,
        need: [bool; 2],
    ) -> Result<[Option<Array>; 2], SpmdError> {
        let da = if !need[0] {
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
        let db = if !need[1] {
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
        Ok([da, db])
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
            let local = match ct.local_opt().as_deref() {
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
        self.broadcast_in_dim_transpose(ct, operand, &dims)
    }
}

fn not_differentiable(op: &'static str) -> SpmdError {
    SpmdError::NotDifferentiable { op }
}
