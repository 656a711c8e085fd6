//! `Array`: a global array as one device sees it — its type and this device's shard.
//!
//! Invariant: in real mode the shard's shape is the type's shard shape; in abstract mode there is
//! no shard. An unreduced array's shard is a partial sum, never the value (docs/design.md §4.4).
//!
//! The shard's storage follows the type's dtype: a `bf16` array stores a [`Bf16Tensor`], every
//! other dtype an `f32` [`Tensor`]. [`Array::new`] is where an `f32` result becomes a `bf16`
//! array's value, by `round_bf16` (nearest even) — the one rounding of mixed precision
//! (docs/design.md §10). A `bf16` shard read as `f32` ([`Array::local`]) is widened exactly, so
//! an op that has no bf16 kernel computes, bit for bit, what its bf16 kernel would: the `f32`
//! op on the widened inputs, rounded once on store.

use std::borrow::Cow;
use std::sync::Arc;

use ferrotext_sharding::{ArrayType, DType};
use ferrotext_tensor::{Bf16Tensor, Tensor};

use crate::error::SpmdError;

/// A global array: type plus this device's shard (shared, cheap to clone). See the module docs.
#[derive(Clone, Debug)]
pub struct Array {
    ty: ArrayType,
    local: Option<Arc<Local>>,
    /// Tape variable, when recorded for autodiff.
    pub(crate) var: Option<usize>,
}

/// One device's shard, stored in its type's dtype.
#[derive(Clone, Debug)]
enum Local {
    /// `f32` storage (every dtype but `bf16`).
    F32(Tensor),
    /// `bf16` storage.
    Bf16(Bf16Tensor),
}

impl Array {
    /// An array of type `ty` holding `local`, rounded to bf16 when `ty` is `bf16`.
    pub(crate) fn new(ty: ArrayType, local: Option<Tensor>) -> Array {
        let local = local.map(|t| match ty.dtype() {
            DType::BF16 => Local::Bf16(Bf16Tensor::from_f32(&t)),
            _ => Local::F32(t),
        });
        Array {
            ty,
            local: local.map(Arc::new),
            var: None,
        }
    }

    /// A `bf16` array holding `local` as it is (a bf16 kernel's output; no rounding).
    ///
    /// # Errors
    /// [`SpmdError::Internal`] when `ty` is not `bf16`.
    pub(crate) fn from_bf16(ty: ArrayType, local: Option<Bf16Tensor>) -> Result<Array, SpmdError> {
        if ty.dtype() != DType::BF16 {
            return Err(SpmdError::Internal {
                op: "from_bf16",
                invariant: "a bf16 shard is stored only under a bf16 type",
            });
        }
        Ok(Array {
            ty,
            local: local.map(|t| Arc::new(Local::Bf16(t))),
            var: None,
        })
    }

    /// The same data under another type (no copy). The caller guarantees the two types have the
    /// same physical layout on every device.
    pub(crate) fn with_type(&self, ty: ArrayType) -> Array {
        debug_assert_eq!(
            ty.dtype() == DType::BF16,
            self.ty.dtype() == DType::BF16,
            "a retyping keeps the storage's dtype"
        );
        Array {
            ty,
            local: self.local.clone(),
            var: None,
        }
    }

    /// This array (no copy) with its shard keeping the packings that products make of it as
    /// their right operand ([`Tensor::keeping_packings`], [`Bf16Tensor::keeping_packings`]):
    /// for a step's weights, which every micro-batch multiplies by. The same values and type;
    /// the same array in abstract mode. Its products have the same bits either way.
    pub fn keeping_packings(&self) -> Array {
        let local = match self.local.as_deref() {
            Some(Local::Bf16(t)) => Local::Bf16(t.keeping_packings()),
            Some(Local::F32(t)) => Local::F32(t.keeping_packings()),
            None => return self.with_type(self.ty.clone()),
        };
        Array {
            ty: self.ty.clone(),
            local: Some(Arc::new(local)),
            var: None,
        }
    }

    /// The address of this device's shard storage, shared by every array that shares the storage
    /// (`None` in abstract mode): an identity for memos that hold the array, so the address is
    /// not reused while they do.
    pub(crate) fn storage_id(&self) -> Option<usize> {
        self.local.as_ref().map(|l| Arc::as_ptr(l) as usize)
    }

    /// True when both arrays read the same shard storage (a clone, a retyping, a remembered
    /// cast): no copy lies between them. False in abstract mode.
    pub fn shares_storage(&self, other: &Array) -> bool {
        matches!((self.storage_id(), other.storage_id()), (Some(a), Some(b)) if a == b)
    }

    /// The type.
    pub fn ty(&self) -> &ArrayType {
        &self.ty
    }

    /// The global shape.
    pub fn shape(&self) -> &[usize] {
        self.ty.shape()
    }

    /// True when this array carries no data (abstract mode).
    pub fn is_abstract(&self) -> bool {
        self.local.is_none()
    }

    /// This device's shard: for an unreduced array, a partial sum (JAX's
    /// `addressable_shards[i].data`, the one sanctioned view of per-device partials).
    ///
    /// # Errors
    /// [`SpmdError::NoData`] in abstract mode.
    ///
    /// A `bf16` shard comes widened to `f32` (exact; a copy), an `f32` one borrowed.
    pub fn local(&self) -> Result<Cow<'_, Tensor>, SpmdError> {
        self.local_opt().ok_or_else(|| SpmdError::NoData {
            ty: self.ty.to_string(),
        })
    }

    /// This device's `bf16` shard as stored (`None` for another dtype or in abstract mode): for
    /// the kernels that read bf16 directly.
    pub fn local_bf16(&self) -> Option<&Bf16Tensor> {
        match self.local.as_deref() {
            Some(Local::Bf16(t)) => Some(t),
            _ => None,
        }
    }

    /// This device's shard, mutable: copied first only if another array shares it. For
    /// in-place updates of values nothing else reads (optimizer steps, accumulators).
    ///
    /// # Errors
    /// [`SpmdError::NoData`] in abstract mode; [`SpmdError::Internal`] for a `bf16` array (its
    /// values are only written by an op, which rounds them once).
    pub fn local_mut(&mut self) -> Result<&mut Tensor, SpmdError> {
        let ty = &self.ty;
        match self.local.as_mut().map(Arc::make_mut) {
            Some(Local::F32(t)) => Ok(t),
            Some(Local::Bf16(_)) => Err(SpmdError::Internal {
                op: "local_mut",
                invariant: "a bf16 array is written only by an op, never in place",
            }),
            None => Err(SpmdError::NoData { ty: ty.to_string() }),
        }
    }

    /// This device's `f32` shard, mutable, when no other array shares it (`None` when shared,
    /// `bf16` or abstract): for writing into a value in place only where that costs no copy.
    pub(crate) fn local_if_unique(&mut self) -> Option<&mut Tensor> {
        match self.local.as_mut().and_then(Arc::get_mut) {
            Some(Local::F32(t)) => Some(t),
            _ => None,
        }
    }

    /// The shard as `f32` (a `bf16` one widened), `None` in abstract mode.
    pub(crate) fn local_opt(&self) -> Option<Cow<'_, Tensor>> {
        self.local.as_deref().map(|l| match l {
            Local::F32(t) => Cow::Borrowed(t),
            Local::Bf16(t) => Cow::Owned(t.to_f32()),
        })
    }

    /// The shard as a tensor of its own (sharing its storage until either is written).
    pub(crate) fn local_owned(&self) -> Result<Tensor, SpmdError> {
        self.local().map(Cow::into_owned)
    }

    /// This device's block, sharing its storage (a tensor clone copies nothing until written).
    pub(crate) fn local_cloned(&self) -> Option<Tensor> {
        self.local_opt().map(Cow::into_owned)
    }

    /// The value as a host scalar (rank 0 or one element).
    ///
    /// # Errors
    /// [`SpmdError::HostAccessUnreduced`] for an unreduced array, [`SpmdError::NoData`] in
    /// abstract mode, [`SpmdError::NotScalar`] for more than one element.
    pub fn scalar(&self) -> Result<f32, SpmdError> {
        if !self.ty.sharding().spec().unreduced().is_empty() {
            return Err(SpmdError::HostAccessUnreduced {
                ty: self.ty.to_string(),
            });
        }
        let t = self.local()?;
        if self.ty.element_count() != 1 {
            return Err(SpmdError::NotScalar {
                op: "scalar",
                ty: self.ty.to_string(),
            });
        }
        Ok(t.data()[0])
    }
}

/// The operands' bf16 shards when the result `out` is stored in bf16 and every operand is too:
/// then an op runs its bf16 kernel on them (no widening copy, no rounding pass), which gives
/// the bits the `f32` kernel on the widened shards would once rounded on store (the tensor
/// crate's invariant). `None` otherwise (and in abstract mode): the op widens.
pub(crate) fn bf16_operands<'a>(out: &ArrayType, xs: &[&'a Array]) -> Option<Vec<&'a Bf16Tensor>> {
    if out.dtype() != DType::BF16 {
        return None;
    }
    xs.iter().map(|x| x.local_bf16()).collect()
}
