//! `cast` (JAX's `convert_element_type`) between `f32` and `bf16`, and its transpose.
//!
//! The one op where a program changes precision on purpose (binary ops and `dot_general` refuse
//! mixed dtypes: [`crate::rules`]). Invariants: the type changes only its dtype (shape, sharding
//! and tags are kept, so no collective ever follows); `f32 → bf16` rounds each value to nearest
//! even and `bf16 → f32` widens exactly; the transpose casts the cotangent back to the
//! operand's dtype, so a weight converted to bf16 at use gets an `f32` cotangent (its bf16
//! cotangent widened), as JAX's and PyTorch autocast's do.

use ferrotext_sharding::DType;

use crate::array::Array;
use crate::autodiff::Backward;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::rules;

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
        let out = self.cast_untracked(x, dtype)?;
        self.record(
            Backward::Cast {
                from: x.ty().dtype(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn cast_untracked(&mut self, x: &Array, dtype: DType) -> Result<Array, SpmdError> {
        if x.ty().dtype() == dtype {
            return Ok(x.with_type(x.ty().clone()));
        }
        let ty = rules::cast_type(x.ty(), dtype)?;
        // `Array::new` rounds into a bf16 type's storage; a bf16 shard reads back widened.
        Ok(Array::new(ty, x.local_cloned()))
    }

    /// The transpose of [`Ctx::cast`]: the cotangent cast back to the operand's dtype `from`.
    pub(crate) fn cast_transpose(&mut self, from: DType, ct: &Array) -> Result<Array, SpmdError> {
        self.cast_untracked(ct, from)
    }
}
