//! [`Packings`]: the packed forms of a bf16 tensor that its products keep while it lives
//! ([`Bf16Tensor::keeping_packings`](super::Bf16Tensor::keeping_packings)): a weight's bf16
//! copy, multiplied by every micro-batch of a step, packed for the AVX512_BF16 kernel once per
//! layout (`x·W`'s row-major `W`, `dy·Wᵀ`'s column-major one) instead of once per product.
//!
//! Invariants:
//! * A packing is keyed by the matrix it packs inside the tensor's storage (its element
//!   offset, strides, `k` and `n`), and the storage never changes while a tensor holds it (a
//!   [`Bf16Tensor`](super::Bf16Tensor)'s elements are immutable), so a kept packing is the
//!   packing a product would make: the same words, hence the same bits.
//! * Nothing is packed while the lock is held: two threads that miss at once both pack, and
//!   the first to return keeps its packing (no thread waits on another's packing, so a rayon
//!   worker that steals a product meanwhile cannot deadlock).
//! * The packings are dropped with the last clone of the tensor that keeps them.

#[cfg(target_arch = "x86_64")]
use std::sync::{Arc, Mutex};

#[cfg(target_arch = "x86_64")]
use super::dpbf16::PackedB;

/// Which matrix of a tensor's storage a packing holds: `k` rows of `n` elements from element
/// `offset`, `rs` and `cs` apart.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatrixAt {
    /// The first element's index in the storage.
    pub(crate) offset: isize,
    /// The stride between rows (the contraction).
    pub(crate) rs: isize,
    /// The stride between columns.
    pub(crate) cs: isize,
    /// Rows (the contraction's length).
    pub(crate) k: usize,
    /// Columns.
    pub(crate) n: usize,
}

/// The packings a tensor's products made of it and keep (module docs).
#[derive(Default)]
pub(crate) struct Packings {
    /// Each packed matrix and its packing (none on processors without the kernel).
    #[cfg(target_arch = "x86_64")]
    kept: Mutex<Vec<(MatrixAt, Arc<PackedB>)>>,
}

impl std::fmt::Debug for Packings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packings")
            .field("kept", &self.len())
            .finish()
    }
}

impl Packings {
    /// How many packings are kept.
    pub(crate) fn len(&self) -> usize {
        #[cfg(target_arch = "x86_64")]
        return self.kept.lock().map_or(0, |kept| kept.len());
        #[cfg(not(target_arch = "x86_64"))]
        0
    }

    /// The kept packing of `at`, or `pack()`'s, kept from now on (module docs: `pack` runs
    /// without the lock). A poisoned lock (a panic while it was held: only a `Vec` push) keeps
    /// nothing and packs afresh.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn get_or_pack(&self, at: MatrixAt, pack: impl FnOnce() -> PackedB) -> Arc<PackedB> {
        let find = |kept: &[(MatrixAt, Arc<PackedB>)]| {
            kept.iter()
                .find(|(key, _)| *key == at)
                .map(|(_, p)| Arc::clone(p))
        };
        if let Some(hit) = self.kept.lock().ok().and_then(|kept| find(&kept)) {
            return hit;
        }
        let packed = Arc::new(pack());
        match self.kept.lock() {
            Ok(mut kept) => match find(&kept) {
                Some(first) => first,
                None => {
                    kept.push((at, Arc::clone(&packed)));
                    packed
                }
            },
            Err(_) => packed,
        }
    }
}
