//! The key/value cache of incremental decoding.
//!
//! A decoder step over `n` new tokens computes their queries, keys and values only; the keys and
//! values of the positions before them come from the cache, so a token costs one pass over the
//! weights and one over the cached positions instead of a forward over the whole context.
//!
//! Invariants:
//! * every layer's slot holds the same number of positions, [`KvCache::len`]: the positions of
//!   the tokens fed so far, in order, starting at 0;
//! * a slot holds keys *after* their norm and RoPE and before any per-head broadcast (GQA keeps
//!   `kv_heads` heads, not `heads`), so nothing is recomputed and nothing is stored twice;
//! * feeding tokens through the cache gives the logits a full forward over the whole sequence
//!   gives at those positions (same ops on the same values; the mask is bottom-right aligned).

use ferrotext_spmd::{Array, Ctx, SpmdError};

/// Keys and values of one attention layer: `[B, positions, heads, width]` each (empty at first).
#[derive(Clone, Debug, Default)]
pub struct KvSlot {
    kv: Option<(Array, Array)>,
}

impl KvSlot {
    /// Positions cached in this slot.
    pub fn len(&self) -> usize {
        self.kv.as_ref().map_or(0, |(k, _)| k.shape()[1])
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The keys and values of every position so far: the cached ones followed by `k` and `v`
    /// (the new positions, `[B, n, heads, width]`), which the slot then remembers.
    ///
    /// # Errors
    /// New keys or values whose batch, heads or width differ from the cached ones.
    pub fn extend(
        &mut self,
        cx: &mut Ctx<'_>,
        k: &Array,
        v: &Array,
    ) -> Result<(Array, Array), SpmdError> {
        let all = match &self.kv {
            None => (k.clone(), v.clone()),
            Some((pk, pv)) => (cx.concat(&[pk, k], 1)?, cx.concat(&[pv, v], 1)?),
        };
        self.kv = Some(all.clone());
        Ok(all)
    }
}

/// Every layer's [`KvSlot`], and how many positions they hold.
#[derive(Clone, Debug)]
pub struct KvCache {
    slots: Vec<KvSlot>,
}

impl KvCache {
    /// An empty cache for a decoder of `layers` layers.
    pub fn new(layers: usize) -> KvCache {
        KvCache {
            slots: vec![KvSlot::default(); layers],
        }
    }

    /// Positions cached (the tokens fed so far).
    pub fn len(&self) -> usize {
        self.slots.first().map_or(0, KvSlot::len)
    }

    /// Whether no token has been fed yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Layers the cache has slots for.
    pub fn layers(&self) -> usize {
        self.slots.len()
    }

    /// Forgets every position (a new sequence).
    pub fn clear(&mut self) {
        self.slots.iter_mut().for_each(|s| s.kv = None);
    }

    /// Layer `i`'s slot.
    pub(crate) fn slot(&mut self, i: usize) -> Option<&mut KvSlot> {
        self.slots.get_mut(i)
    }
}
