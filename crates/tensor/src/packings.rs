//! [`Packings`]: the packed forms of a tensor that its products keep while it lives
//! ([`Tensor::keeping_packings`](crate::Tensor::keeping_packings),
//! [`Bf16Tensor::keeping_packings`](crate::Bf16Tensor::keeping_packings)): a step's weight,
//! multiplied by every micro-batch, packed for the kernel once per layout (`x·W`'s row-major
//! `W`, `dy·Wᵀ`'s column-major one) instead of once per product. `P` is the kernel's packing:
//! the portable kernel's `f32` panels, or the AVX512_BF16 kernel's pairs.
//!
//! Invariants:
//! * A packing is keyed by the matrix it packs inside the tensor's storage (its element
//!   offset, strides, `k` and `n`), and the storage never changes while a tensor keeps
//!   packings (a [`Bf16Tensor`](crate::Bf16Tensor)'s elements are immutable; a
//!   [`Tensor`](crate::Tensor) written in place lets its packings go first), so a kept packing
//!   is the packing a product would make: the same words, hence the same bits.
//! * Nothing is packed while the lock is held: two threads that miss at once both pack, and
//!   the first to return keeps its packing (no thread waits on another's packing, so a rayon
//!   worker that steals a product meanwhile cannot deadlock).
//! * The packings are dropped with the last clone of the tensor that keeps them.

use std::sync::{Arc, Mutex};

/// Which matrix of a tensor's storage a packing holds: `k` rows of `n` elements from element
/// `offset`, `rs` and `cs` apart.
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

/// The packings `P` a tensor's products made of it and keep (module docs).
pub(crate) struct Packings<P> {
    /// Each packed matrix and its packing.
    kept: Mutex<Vec<(MatrixAt, Arc<P>)>>,
}

impl<P> Default for Packings<P> {
    fn default() -> Self {
        Packings {
            kept: Mutex::new(Vec::new()),
        }
    }
}

impl<P> std::fmt::Debug for Packings<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packings")
            .field("kept", &self.len())
            .finish()
    }
}

impl<P> Packings<P> {
    /// How many packings are kept.
    pub(crate) fn len(&self) -> usize {
        self.kept.lock().map_or(0, |kept| kept.len())
    }

    /// The kept packing of `at`, or `pack()`'s, kept from now on (module docs: `pack` runs
    /// without the lock). A poisoned lock (a panic while it was held: only a `Vec` push) keeps
    /// nothing and packs afresh.
    pub(crate) fn get_or_pack(&self, at: MatrixAt, pack: impl FnOnce() -> P) -> Arc<P> {
        let find = |kept: &[(MatrixAt, Arc<P>)]| {
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
