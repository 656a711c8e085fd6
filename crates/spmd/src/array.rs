//! `Array`: a global array as one device sees it — its type and this device's shard.
//!
//! Invariant: in real mode the shard's shape is the type's shard shape; in abstract mode there is
//! no shard. An unreduced array's shard is a partial sum, never the value (docs/design.md §4.4).

use std::sync::Arc;

use ferrotext_sharding::ArrayType;
use ferrotext_tensor::Tensor;

use crate::error::SpmdError;

/// A global array: type plus this device's shard (shared, cheap to clone). See the module docs.
#[derive(Clone, Debug)]
pub struct Array {
    ty: ArrayType,
    local: Option<Arc<Tensor>>,
    /// Tape variable, when recorded for autodiff.
    pub(crate) var: Option<usize>,
}

impl Array {
    pub(crate) fn new(ty: ArrayType, local: Option<Tensor>) -> Array {
        Array {
            ty,
            local: local.map(Arc::new),
            var: None,
        }
    }

    /// The same data under another type (no copy). The caller guarantees the two types have the
    /// same physical layout on every device.
    pub(crate) fn with_type(&self, ty: ArrayType) -> Array {
        Array {
            ty,
            local: self.local.clone(),
            var: None,
        }
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
    pub fn local(&self) -> Result<&Tensor, SpmdError> {
        self.local.as_deref().ok_or_else(|| SpmdError::NoData {
            ty: self.ty.to_string(),
        })
    }

    /// This device's shard, mutable: copied first only if another array shares it. For
    /// in-place updates of values nothing else reads (optimizer steps).
    ///
    /// # Errors
    /// [`SpmdError::NoData`] in abstract mode.
    pub fn local_mut(&mut self) -> Result<&mut Tensor, SpmdError> {
        let ty = &self.ty;
        self.local
            .as_mut()
            .map(Arc::make_mut)
            .ok_or_else(|| SpmdError::NoData { ty: ty.to_string() })
    }

    /// This device's shard, mutable, when no other array shares it (`None` when shared or
    /// abstract): for writing into a value in place only where that costs no copy.
    pub(crate) fn local_if_unique(&mut self) -> Option<&mut Tensor> {
        self.local.as_mut().and_then(Arc::get_mut)
    }

    pub(crate) fn local_opt(&self) -> Option<&Tensor> {
        self.local.as_deref()
    }

    /// The shard as a tensor of its own (sharing its storage until either is written).
    pub(crate) fn local_owned(&self) -> Result<Tensor, SpmdError> {
        self.local().cloned()
    }

    /// This device's block, sharing its storage (a tensor clone copies nothing until written).
    pub(crate) fn local_cloned(&self) -> Option<Tensor> {
        self.local.as_deref().cloned()
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
