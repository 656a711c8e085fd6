//! `cast` (JAX's `convert_element_type`) between `f32` and `bf16`, and its transpose.
//!
//! The one op where a program changes precision on purpose (binary ops and `dot_general` refuse
//! mixed dtypes: [`crate::rules`]). Invariants: the type changes only its dtype (shape, sharding
//! and tags are kept, so no collective ever follows); `f32 → bf16` rounds each value to nearest
//! even and `bf16 → f32` widens exactly; the transpose casts the cotangent back to the
//! operand's dtype, so a weight converted to bf16 at use gets an `f32` cotangent (its bf16
//! cotangent widened), as JAX's and PyTorch autocast's do.
//!
//! A program may ask the context to remember the casts of arrays it converts many times while
//! nobody writes them — a step's weights, cast at use in every micro-batch
//! ([`Ctx::remember_casts`]): the first cast of such an array computes, later ones share its
//! result's storage. The result is the same bits either way (a cast is a pure function of its
//! operand's storage), and each use is still recorded on the tape, so gradients are unchanged.
//! The memo holds its sources, so a remembered array is never written in place (a write copies
//! first); [`Ctx::forget_casts`] lets them go before the weights are updated.

use ferrotext_sharding::DType;

use crate::array::Array;
use crate::cast_memo::CastMemo;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::rules;
use crate::tape::Backward;

impl Ctx<'_> {
    /// `x` in `dtype` (JAX's `convert_element_type`): `f32 → bf16` rounds to nearest even,
    /// `bf16 → f32` is exact, the same dtype returns `x` itself.
    ///
    /// # Errors
    /// A conversion other than between `f32` and `bf16` (a `dtype_mismatch` type error).
    ///
    /// # Collectives
    /// None.
    pub fn cast(&mut self, x: &Array, dtype: DType) -> Result<Array, SpmdError> {
        if x.ty().dtype() == dtype {
            return Ok(x.clone());
        }
        let out = self.cast_remembered(x, dtype)?;
        self.record(
            Backward::Cast {
                from: x.ty().dtype(),
            },
            &[x],
            out,
        )
    }

    /// [`Ctx::cast`] without recording: the remembered cast when `x` is a registered source
    /// ([`Ctx::remember_casts`]), else computed (and remembered when it should be).
    pub(crate) fn cast_remembered(&mut self, x: &Array, dtype: DType) -> Result<Array, SpmdError> {
        Ok(match self.casts.get(x, dtype) {
            Some(hit) => hit.with_type(rules::cast_type(x.ty(), dtype)?),
            None => {
                let out = self.cast_untracked(x, dtype)?;
                self.casts.keep(x, dtype, out)
            }
        })
    }

    pub(crate) fn cast_untracked(&mut self, x: &Array, dtype: DType) -> Result<Array, SpmdError> {
        if x.ty().dtype() == dtype {
            return Ok(x.with_type(x.ty().clone()));
        }
        let ty = rules::cast_type(x.ty(), dtype)?;
        // `Array::new` rounds into a bf16 type's storage; a bf16 shard reads back widened.
        Ok(Array::new(ty, x.local_cloned()))
    }

    /// Remembers the casts of `arrays` until [`Ctx::forget_casts`] (module docs): a later
    /// [`Ctx::cast`] of an array sharing one's storage reuses the first cast's result. For
    /// values converted many times and written by no one meanwhile, such as a step's weights;
    /// writing one in place before `forget_casts` copies it first. Nothing in abstract mode.
    pub fn remember_casts(&mut self, arrays: &[Array]) {
        for a in arrays {
            self.casts.register(a);
        }
    }

    /// [`Ctx::remember_casts`], and each bf16 cast remembered keeps the packings its products
    /// make of it as their right operand (`Bf16Tensor::keeping_packings`): a step whose
    /// micro-batches multiply by the same weights packs each weight's bf16 copy once per
    /// layout (`x·W`, `dy·Wᵀ`) instead of once per micro-batch, holding about twice the copy's
    /// size until [`Ctx::forget_casts`]. The same bits either way.
    pub fn remember_casts_and_packings(&mut self, arrays: &[Array]) {
        self.remember_casts(arrays);
        self.casts.keep_packings();
    }

    /// Drops every remembered cast and its source ([`Ctx::remember_casts`]).
    pub fn forget_casts(&mut self) {
        self.casts = CastMemo::default();
    }

    /// The transpose of [`Ctx::cast`] added into a gradient buffer (`dest`: the operand's local
    /// block in consecutive parts, as `GradientSink::buffer` gives it): each bf16 cotangent
    /// element widened and added where it lands, with no f32 copy of the cotangent first — the
    /// bits of adding [`Ctx::cast_transpose`]'s result. Returns whether it did (`false`, `dest`
    /// untouched: an operand that was not f32, or no data).
    pub(crate) fn cast_transpose_into(
        &mut self,
        from: DType,
        ct: &Array,
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        let Some(src) = ct.local_bf16().filter(|_| from == DType::F32) else {
            return Ok(false);
        };
        if dest.iter().map(|d| d.len()).sum::<usize>() != src.len() {
            return Err(SpmdError::Internal {
                op: "cast_transpose_into",
                invariant: "a buffer holds the operand's whole local block",
            });
        }
        let _span =
            ferrotext_profile::span("widen_add_bf16").map(|s| s.bytes((10 * src.len()) as f64));
        let mut at = 0;
        for part in dest.iter_mut() {
            ferrotext_tensor::widen_add_slice(&src.data()[at..at + part.len()], part);
            at += part.len();
        }
        Ok(true)
    }

    /// The transpose of [`Ctx::cast`]: the cotangent cast back to the operand's dtype `from`.
    pub(crate) fn cast_transpose(&mut self, from: DType, ct: &Array) -> Result<Array, SpmdError> {
        self.cast_untracked(ct, from)
    }
}
