//! `dot_general` (and `matmul`) and its transpose.
//!
//! Owns: the forward — type from [`crate::rules::dot_general_type`], the operand layouts the
//! contraction computes in (`layout.rs`), the natural result (partial sums over the
//! contracting axes) resharded onto the output type — and the transpose, JAX's
//! `_dot_general_transpose_lhs/rhs`: each operand's cotangent is another `dot_general` emitted
//! with that operand's cotangent type as `out_sharding` (R4.3). That is where deferral happens:
//! a `{R:data}` weight's cotangent is typed `{U:data}`, so its transposed dot keeps the partial
//! sums and communicates nothing, while a plain weight's transposed dot all-reduces them.
//!
//! Inside `shard_map` the dot is local ([`crate::manual::typing::manual_dot_type`]).

use ferrotext_sharding::{ArrayType, DType, PartitionSpec};
use ferrotext_tensor::{
    dot_general, dot_general_accumulate_parts, dot_general_bf16, dot_general_bf16_rounded,
    dot_general_bf16_rounded_accumulate_parts, Bf16Tensor, DotDims, Tensor,
};

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::manual::typing::{manual_dot_type, manual_without_out_sharding};
use crate::reshard::same_layout;
use crate::rules;
use crate::tape::Backward;

mod layout;

use layout::{aligned_dot_types, natural_as_they_stand, natural_dot_type};

impl Ctx<'_> {
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
        self.dot_general_recorded(lhs, rhs, dims, out_sharding, None)
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

    /// [`Ctx::dot_general`] with its result in `preferred` (JAX's `preferred_element_type`):
    /// bf16 operands give an `f32` result unrounded (the logits of a bf16 model), or `f32`
    /// operands a bf16 one. The transpose casts the cotangent to each operand's dtype first.
    ///
    /// # Errors
    /// As [`Ctx::dot_general`].
    ///
    /// # Collectives
    /// As [`Ctx::dot_general`]; partial sums are reduced in `f32` and rounded once after.
    pub fn dot_general_preferred(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
        out_sharding: Option<&PartitionSpec>,
        preferred: DType,
    ) -> Result<Array, SpmdError> {
        self.dot_general_recorded(lhs, rhs, dims, out_sharding, Some(preferred))
    }

    /// [`Ctx::dot_general`] recorded on the tape, its result in `preferred` when given (inside
    /// a region: the local product, then a cast).
    fn dot_general_recorded(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
        out_sharding: Option<&PartitionSpec>,
        preferred: Option<DType>,
    ) -> Result<Array, SpmdError> {
        // The `out_sharding` is checked against the mesh before anything else (R1.13/R1.14).
        if let Some(spec) = out_sharding {
            rules::check_out_sharding("dot_general", lhs.ty().sharding().mesh(), spec)?;
        }
        let manual = lhs.ty().is_manual() || rhs.ty().is_manual();
        if manual {
            let cast = self.match_varying(&[lhs, rhs])?;
            if cast[0].ty() != lhs.ty() || cast[1].ty() != rhs.ty() {
                return self.dot_general_recorded(
                    &cast[0],
                    &cast[1],
                    dims,
                    out_sharding,
                    preferred,
                );
            }
            if let Some(dtype) = preferred {
                let out = self.dot_general_recorded(lhs, rhs, dims, out_sharding, None)?;
                return self.cast(&out, dtype);
            }
        }
        // In a rematerialized region's replay, a product its policy saved is not recomputed.
        let out = match self.replayed(&[lhs, rhs]) {
            Some(saved) => saved,
            None if manual => self.dot_general_untracked(lhs, rhs, dims, out_sharding)?,
            None => self.dot_general_typed(lhs, rhs, dims, out_sharding, preferred)?,
        };
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
        self.dot_general_typed(lhs, rhs, dims, out_sharding, None)
    }

    /// The product outside regions, its result in `preferred` when given (else the operands'
    /// dtype). bf16 operands run the bf16 product (`f32` sums); the natural result is moved to
    /// the output layout in `f32` and rounded once, where the array is made.
    fn dot_general_typed(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
        out_sharding: Option<&PartitionSpec>,
        preferred: Option<DType>,
    ) -> Result<Array, SpmdError> {
        let mut out_ty = rules::dot_general_type(lhs.ty(), rhs.ty(), dims, out_sharding)?;
        if let Some(dtype) = preferred {
            out_ty = rules::cast_type(&out_ty, dtype)?;
        }
        let (lhs_ty, rhs_ty, contracted) = aligned_dot_types(lhs.ty(), rhs.ty(), dims)?;
        let natural = natural_dot_type(&out_ty, (&lhs_ty, &rhs_ty), dims, contracted)?;
        let bf16 = lhs.ty().dtype() == DType::BF16;
        if bf16 && out_ty.dtype() == DType::BF16 && same_layout(&natural, &out_ty) {
            // The product is the output as it stands: rounded where the kernel stores it (the
            // same bits as the f32 product rounded after).
            let l = self.aligned_bf16(lhs, &lhs_ty)?;
            let r = self.aligned_bf16(rhs, &rhs_ty)?;
            let local = match (l, r) {
                (Some(l), Some(r)) => Some(dot_general_bf16_rounded(&l, &r, dims, self.threads())?),
                _ => None,
            };
            return Array::from_bf16(out_ty, local);
        }
        let natural_local = if bf16 {
            let l = self.aligned_bf16(lhs, &lhs_ty)?;
            let r = self.aligned_bf16(rhs, &rhs_ty)?;
            match (l, r) {
                (Some(l), Some(r)) => Some(dot_general_bf16(&l, &r, dims, self.threads())?),
                _ => None,
            }
        } else {
            let l = self.aligned(lhs, &lhs_ty)?;
            let r = self.aligned(rhs, &rhs_ty)?;
            match (l, r) {
                (Some(l), Some(r)) => Some(dot_general(&l, &r, dims, self.threads())?),
                _ => None,
            }
        };
        let local = self.convert(natural_local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `dest += ` this device's block of `dot_general(lhs, rhs)` typed by `out_sharding`, when
    /// that block is the contraction's natural result on the operands as they stand — no
    /// operand moves, no collective, nothing to convert after — and each of `dest`'s parts
    /// (the block's consecutive equal parts, see [`crate::GradientSink::buffer`]) holds whole
    /// rows of the product, so the product can be added into `dest` (a gradient accumulator)
    /// by the kernel itself. Returns whether it was; `false` leaves `dest` untouched and the
    /// caller takes the ordinary path.
    ///
    /// # Errors
    /// The dot_general type errors; `dest` not the size of the local block.
    ///
    /// # Collectives
    /// None.
    pub(crate) fn dot_general_accumulate_untracked(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
        out_sharding: &PartitionSpec,
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        if lhs.ty().is_manual() || rhs.ty().is_manual() || lhs.ty().dtype() != DType::F32 {
            // A bf16 product's cotangent is rounded to bf16 on the ordinary path; adding it
            // unrounded here would make the bits depend on the path taken.
            return Ok(false);
        }
        if !natural_as_they_stand(lhs.ty(), rhs.ty(), dims, out_sharding)? {
            return Ok(false);
        }
        match (lhs.local_opt().as_deref(), rhs.local_opt().as_deref()) {
            (Some(l), Some(r)) => Ok(dot_general_accumulate_parts(
                l,
                r,
                dims,
                self.threads(),
                dest,
            )?),
            _ => Ok(true),
        }
    }

    /// `x`'s shard laid out as `ty`: borrowed when the layout already matches, else moved.
    fn aligned<'a>(
        &mut self,
        x: &'a Array,
        ty: &ArrayType,
    ) -> Result<Option<std::borrow::Cow<'a, Tensor>>, SpmdError> {
        if same_layout(x.ty(), ty) {
            return Ok(x.local_opt());
        }
        Ok(self
            .convert(x.local_cloned(), x.ty(), ty)?
            .map(std::borrow::Cow::Owned))
    }

    /// A bf16 `x`'s shard laid out as `ty`, as stored (borrowed) when the layout already
    /// matches, else moved (in `f32`, exact) and stored again.
    fn aligned_bf16<'a>(
        &mut self,
        x: &'a Array,
        ty: &ArrayType,
    ) -> Result<Option<std::borrow::Cow<'a, Bf16Tensor>>, SpmdError> {
        if same_layout(x.ty(), ty) {
            if let Some(local) = x.local_bf16() {
                return Ok(Some(std::borrow::Cow::Borrowed(local)));
            }
        }
        Ok(self
            .aligned(x, ty)?
            .map(|t| std::borrow::Cow::Owned(Bf16Tensor::from_f32(&t))))
    }

    /// The dot inside a region: this device's blocks contracted locally, typed by
    /// [`manual_dot_type`] (no collective).
    pub(crate) fn manual_dot(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
    ) -> Result<Array, SpmdError> {
        rules::same_dtype("dot_general", lhs.ty(), rhs.ty())?;
        let ty = manual_dot_type(lhs.ty(), rhs.ty(), dims)?;
        if let (Some(a), Some(b)) = (lhs.local_bf16(), rhs.local_bf16()) {
            let local = dot_general_bf16(a, b, dims, self.threads())?;
            return Ok(Array::new(ty, Some(local)));
        }
        let local = match (lhs.local_opt().as_deref(), rhs.local_opt().as_deref()) {
            (Some(a), Some(b)) => Some(dot_general(a, b, dims, self.threads())?),
            _ => None,
        };
        Ok(Array::new(ty, local))
    }

    /// The transpose of [`Ctx::dot_general`]: the cotangents of `lhs` and `rhs` from `ct`
    /// (`[batch, lhs free, rhs free]`); `None` where `need` says the operand is not
    /// differentiated (a constant operand costs no reduction).
    pub(crate) fn dot_general_transpose(
        &mut self,
        (lhs, rhs): (&Array, &Array),
        dims: &DotDims,
        ct: &Array,
        need: [bool; 2],
    ) -> Result<[Option<Array>; 2], SpmdError> {
        // A product whose result dtype differs from its operands' (`dot_general_preferred`,
        // the lm_head's f32 logits): both sides take the cotangent in the operands' dtype, so
        // it is cast once here rather than once per side.
        let cast;
        let ct = match [lhs, rhs].map(|a| a.ty().dtype()) {
            [l, r] if need == [true, true] && l == r && ct.ty().dtype() != l => {
                cast = self.cast_untracked(ct, l)?;
                &cast
            }
            _ => ct,
        };
        let dl = if need[0] {
            Some(self.dot_transpose((lhs, rhs), dims, ct, 0)?)
        } else {
            None
        };
        let dr = if need[1] {
            Some(self.dot_transpose((lhs, rhs), dims, ct, 1)?)
        } else {
            None
        };
        Ok([dl, dr])
    }

    /// [`Ctx::dot_general_transpose`] for one operand (`side` 0: lhs, 1: rhs), its cotangent
    /// added into `dest` — a buffer laid out as its local block, in parts — by the product's
    /// kernel, when that product is the whole cotangent (no collective, no transpose after it;
    /// see [`Ctx::dot_general_accumulate_untracked`]; inside a region, the local product typed
    /// as the cotangent). Returns whether it was; on `false` nothing was touched and the caller
    /// takes the ordinary transpose.
    ///
    /// # Errors
    /// As [`Ctx::dot_general_transpose`].
    pub(crate) fn dot_general_transpose_into(
        &mut self,
        (lhs, rhs): (&Array, &Array),
        dims: &DotDims,
        ct: &Array,
        side: usize,
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        let t = TransposedDot::of((lhs, rhs), dims, ct, side);
        let target = t.this.to_cotangent();
        if !t.in_order() || t.lhs.ty().dtype() != t.rhs.ty().dtype() || target.dtype() != DType::F32
        {
            return Ok(false);
        }
        if target.is_manual() {
            // Inside a region the transpose is the local product (`manual_dot`), no collective.
            if manual_dot_type(t.lhs.ty(), t.rhs.ty(), &t.dims)? != target {
                return Ok(false);
            }
            return match (t.lhs.local_opt().as_deref(), t.rhs.local_opt().as_deref()) {
                (Some(l), Some(r)) => Ok(dot_general_accumulate_parts(
                    l,
                    r,
                    &t.dims,
                    self.threads(),
                    dest,
                )?),
                _ => Ok(true),
            };
        }
        let out_spec = t.out_spec(&target)?;
        self.dot_general_accumulate_untracked(t.lhs, t.rhs, &t.dims, &out_spec, dest)
    }

    /// [`Ctx::dot_general_transpose_into`] for an operand that is a bf16 cast of an `f32` value
    /// (a weight cast at use): its cotangent, rounded to bf16 as the ordinary transpose stores
    /// it, widened and added into `dest` — the `f32` value's buffer — with no bf16 cotangent
    /// stored in between: the bits of the ordinary transpose followed by the cast's
    /// ([`Ctx::cast_transpose_into`]). Taken when the ordinary transpose is a rounded product
    /// on the operands as they stand, in order, with no collective and nothing to convert after;
    /// returns whether it was (`false`: `dest` untouched, the caller takes the ordinary path).
    ///
    /// # Errors
    /// As [`Ctx::dot_general_transpose`].
    pub(crate) fn dot_general_transpose_rounded_into(
        &mut self,
        (lhs, rhs): (&Array, &Array),
        dims: &DotDims,
        ct: &Array,
        side: usize,
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        let t = TransposedDot::of((lhs, rhs), dims, ct, side);
        let target = t.this.to_cotangent();
        let bf16 = |ty: &ArrayType| ty.dtype() == DType::BF16;
        if !t.in_order()
            || target.is_manual()
            || !bf16(&target)
            || !bf16(t.lhs.ty())
            || !bf16(t.rhs.ty())
        {
            return Ok(false);
        }
        let out_spec = t.out_spec(&target)?;
        if !natural_as_they_stand(t.lhs.ty(), t.rhs.ty(), &t.dims, &out_spec)? {
            return Ok(false);
        }
        match (t.lhs.local_bf16(), t.rhs.local_bf16()) {
            (Some(l), Some(r)) => Ok(dot_general_bf16_rounded_accumulate_parts(
                l,
                r,
                &t.dims,
                self.threads(),
                dest,
            )?),
            // Abstract mode: nothing to add.
            _ => Ok(t.lhs.is_abstract() && t.rhs.is_abstract()),
        }
    }

    /// JAX's `_dot_general_transpose_lhs`, written for either side (see [`TransposedDot`]):
    /// the cotangent of operand `side`, emitted with its cotangent type as `out_sharding`
    /// (R4.3).
    fn dot_transpose(
        &mut self,
        (lhs, rhs): (&Array, &Array),
        dims: &DotDims,
        ct: &Array,
        side: usize,
    ) -> Result<Array, SpmdError> {
        // A product whose result dtype differs from its operands' (`dot_general_preferred`):
        // the cotangent is cast to the operand's dtype first, as JAX's transpose computes it.
        let this_dtype = [lhs, rhs][side].ty().dtype();
        let cast;
        let ct = if ct.ty().dtype() == this_dtype {
            ct
        } else {
            cast = self.cast_untracked(ct, this_dtype)?;
            &cast
        };
        let t = TransposedDot::of((lhs, rhs), dims, ct, side);
        let target = t.this.to_cotangent();
        let mut perm = vec![0; t.order.len()];
        for (k, &d) in t.order.iter().enumerate() {
            perm[d] = k;
        }
        if target.is_manual() {
            let r = self.manual_dot(t.lhs, t.rhs, &t.dims)?;
            return self.transpose_untracked(&r, &perm);
        }
        let r = self.dot_general_untracked(t.lhs, t.rhs, &t.dims, Some(&t.out_spec(&target)?))?;
        if t.in_order() {
            return Ok(r);
        }
        self.transpose_untracked(&r, &perm)
    }
}

/// The product that gives one operand's cotangent: `ct · other` (`[batch, this kept, this
/// contracting]`) or `other · ct` (`[batch, this contracting, this kept]`), either the
/// cotangent up to a transpose of its dims (`order`: the result's dims in `this`'s order).
/// The one that needs no transpose is taken when there is one (a weight's `xᵀ·dy` is
/// `other · ct`), so no copy follows the product.
struct TransposedDot<'a> {
    lhs: &'a Array,
    rhs: &'a Array,
    dims: DotDims,
    order: Vec<usize>,
    this: &'a ArrayType,
}

impl<'a> TransposedDot<'a> {
    fn of(
        (lhs, rhs): (&'a Array, &'a Array),
        dims: &DotDims,
        ct: &'a Array,
        side: usize,
    ) -> TransposedDot<'a> {
        let nb = dims.lhs_batch.len();
        let lf = DotDims::free(lhs.ty().rank(), &dims.lhs_batch, &dims.lhs_contracting).len();
        let rf = DotDims::free(rhs.ty().rank(), &dims.rhs_batch, &dims.rhs_contracting).len();
        let ct_batch: Vec<usize> = (0..nb).collect();
        // `this` is the operand differentiated; `ct_other_kept` are the ct dims of `other`'s
        // free dims.
        let (this, other, this_batch, this_contract, other_batch, other_contract, ct_other_kept) =
            if side == 0 {
                (
                    lhs.ty(),
                    rhs,
                    &dims.lhs_batch,
                    &dims.lhs_contracting,
                    &dims.rhs_batch,
                    &dims.rhs_contracting,
                    (nb + lf..nb + lf + rf).collect::<Vec<usize>>(),
                )
            } else {
                (
                    rhs.ty(),
                    lhs,
                    &dims.rhs_batch,
                    &dims.rhs_contracting,
                    &dims.lhs_batch,
                    &dims.lhs_contracting,
                    (nb..nb + lf).collect::<Vec<usize>>(),
                )
            };
        let other_kept = DotDims::free(other.ty().rank(), other_batch, other_contract);
        let this_kept = DotDims::free(this.rank(), this_batch, this_contract);
        // `this`'s contracting dims in the order of the `other` dims they pair with.
        let mut pairs: Vec<(usize, usize)> = this_contract
            .iter()
            .copied()
            .zip(other_contract.iter().copied())
            .collect();
        pairs.sort_by_key(|&(_, o)| o);
        let paired: Vec<usize> = pairs.into_iter().map(|(t, _)| t).collect();
        let ct_first: Vec<usize> = this_batch
            .iter()
            .chain(&this_kept)
            .chain(&paired)
            .copied()
            .collect();
        let other_first: Vec<usize> = this_batch
            .iter()
            .chain(&paired)
            .chain(&this_kept)
            .copied()
            .collect();
        let swap = !is_identity(&ct_first) && is_identity(&other_first);
        if swap {
            TransposedDot {
                lhs: other,
                rhs: ct,
                dims: DotDims {
                    lhs_contracting: other_kept,
                    rhs_contracting: ct_other_kept,
                    lhs_batch: other_batch.clone(),
                    rhs_batch: ct_batch,
                },
                order: other_first,
                this,
            }
        } else {
            TransposedDot {
                lhs: ct,
                rhs: other,
                dims: DotDims {
                    lhs_contracting: ct_other_kept,
                    rhs_contracting: other_kept,
                    lhs_batch: ct_batch,
                    rhs_batch: other_batch.clone(),
                },
                order: ct_first,
                this,
            }
        }
    }

    /// The product's result is the cotangent as it stands (no transpose after).
    fn in_order(&self) -> bool {
        is_identity(&self.order)
    }

    /// The product's out sharding: the cotangent type's, its dims in the product's order.
    fn out_spec(&self, target: &ArrayType) -> Result<PartitionSpec, SpmdError> {
        let tspec = target.sharding().spec();
        Ok(PartitionSpec::tagged(
            self.order.iter().map(|&d| tspec.dim(d).clone()),
            tspec.unreduced().clone(),
            tspec.reduced().clone(),
        )?)
    }
}

/// `order` is `0, 1, 2, …`.
fn is_identity(order: &[usize]) -> bool {
    order.iter().enumerate().all(|(k, &d)| k == d)
}
