//! [`Ids`]: an integer index array (token ids, targets) — its type and this device's block.
//! Made by [`Ctx::ids_from_local`](crate::Ctx::ids_from_local); read by `take`, the
//! cross-entropy ops and the grouped ops.

use ferrotext_sharding::ArrayType;

/// An integer index array (token ids): its type (dtype `u32`) and this device's block.
#[derive(Clone, Debug)]
pub struct Ids {
    ty: ArrayType,
    local: Option<Vec<u32>>,
}

impl Ids {
    /// Ids of type `ty` holding this device's block (`None` in abstract mode). The caller has
    /// checked that `local` fits `ty`'s shard.
    pub(crate) fn new(ty: ArrayType, local: Option<Vec<u32>>) -> Ids {
        Ids { ty, local }
    }

    /// The type.
    pub fn ty(&self) -> &ArrayType {
        &self.ty
    }

    /// This device's ids (`None` in abstract mode).
    pub fn local(&self) -> Option<&[u32]> {
        self.local.as_deref()
    }
}
