//! [`Documents`]: where packed documents lie in a batch (MaxText's `packing`): each token's
//! segment id and its position in its own document. Attention stays inside a document and RoPE
//! restarts at each; the loss's targets are the caller's (it masks the ones that would cross a
//! boundary).

use ferrotext_spmd::Ids;

/// Each token's document and position in it, `u32[B, T]` each, split over the batch as the
/// tokens are (MaxText's `inputs_segmentation` and `inputs_position`). A change of segment id
/// along a row starts a document (documents are contiguous runs).
#[derive(Clone, Debug)]
pub struct Documents {
    /// The document each token belongs to.
    pub segment_ids: Ids,
    /// Each token's position in its document (0 at a document's first token).
    pub positions: Ids,
}
