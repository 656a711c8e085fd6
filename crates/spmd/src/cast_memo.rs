//! [`CastMemo`]: the casts a context remembers for reuse (`Ctx::remember_casts`, in `convert`):
//! each registered source's casts, keyed by the source's storage address, and, when asked
//! (`Ctx::remember_casts_and_packings`), each bf16 cast keeping the packings its products make
//! of it.

use std::collections::HashMap;

use ferrotext_sharding::DType;

use crate::array::Array;

/// The casts a context remembers (`Ctx::remember_casts`). Keys are storage addresses of the
/// registered sources; holding each source keeps its address from being reused while the
/// entry lives.
#[derive(Debug, Default)]
pub(crate) struct CastMemo {
    /// Registered sources, by storage address.
    sources: HashMap<usize, Array>,
    /// Their casts computed so far, by storage address and target dtype.
    casts: HashMap<(usize, DType), Array>,
    /// Whether a remembered bf16 cast keeps its products' packings
    /// ([`Array::keeping_packings`]).
    packings: bool,
}

impl CastMemo {
    /// Registers `x` as a source whose casts are remembered (nothing in abstract mode).
    pub(crate) fn register(&mut self, x: &Array) {
        if let Some(id) = x.storage_id() {
            self.sources.insert(id, x.with_type(x.ty().clone()));
        }
    }

    /// The remembered cast of `x` to `dtype`, when `x` shares a registered source's storage.
    pub(crate) fn get(&self, x: &Array, dtype: DType) -> Option<&Array> {
        self.casts.get(&(x.storage_id()?, dtype))
    }

    /// From now on, a remembered bf16 cast keeps its products' packings.
    pub(crate) fn keep_packings(&mut self) {
        self.packings = true;
    }

    /// Remembers `out` as the cast of `x` to `dtype` when `x` is a registered source, and
    /// returns the cast to use: `out`, keeping its packings when the memo keeps them.
    pub(crate) fn keep(&mut self, x: &Array, dtype: DType, out: Array) -> Array {
        let Some(id) = x.storage_id().filter(|id| self.sources.contains_key(id)) else {
            return out;
        };
        let out = if self.packings {
            out.keeping_packings()
        } else {
            out
        };
        self.casts
            .insert((id, dtype), out.with_type(out.ty().clone()));
        out
    }
}
