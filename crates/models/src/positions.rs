//! [`Positions`]: where each token of a batch sits when that is not simply its index in its row
//! — packed documents (MaxText's `packing`: positions restart at each document, attention stays
//! inside it) and a load-balanced context split (MaxText's `context_parallel_load_balance`: each
//! device holds two chunks of every row, one from each end, so causal attention costs every
//! device the same).

use ferrotext_spmd::Ids;

/// Each token's position in its document and, when a load-balanced split reordered the rows,
/// its index in its row's original order; `u32[B, T]` each, split as the tokens are.
#[derive(Clone, Debug)]
pub struct Positions {
    /// Each token's position in its document (RoPE's position: 0 at a document's first token;
    /// its index in the row when the row is one document).
    pub in_document: Ids,
    /// Set when a load-balanced context split reordered the rows.
    pub balanced: Option<Balanced>,
}

/// A load-balanced context split: with `chunks = 2n` equal chunks of every row over `n`
/// devices, device `i` holds chunks `i` and `2n − 1 − i`, in that order.
#[derive(Clone, Debug)]
pub struct Balanced {
    /// Each token's index in its row's original order.
    pub index: Ids,
    /// The chunks each row is cut into: twice the context axis's size.
    pub chunks: usize,
}

impl Balanced {
    /// Where original chunk `j` of `chunks` sits in a row gathered in the balanced order.
    pub fn slot_of(j: usize, chunks: usize) -> usize {
        let n = chunks / 2;
        if j < n {
            2 * j
        } else {
            2 * (chunks - 1 - j) + 1
        }
    }
}
