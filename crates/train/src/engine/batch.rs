//! A micro-batch as the engine feeds it to the model ([`Batch`]): each device's block of the
//! inputs and shifted targets, the target-token count, and where the tokens sit when that is not
//! their index in their row — packed documents (`packing=true`: a document starts after each
//! EOS, the target after an EOS is not scored) and a load-balanced context split (every row's
//! `2n` chunks reordered so device `i` holds chunks `i` and `2n − 1 − i`).

use ferrotext_models::{Balanced, Positions};
use ferrotext_spmd::{Ctx, Ids};

use super::Engine;
use crate::error::TrainError;
use crate::plan::engine_rules;

/// One micro-batch: this device's blocks of the inputs and targets (`[rows, len]`, split over the
/// batch axes) and the micro-batch's target-token count.
#[derive(Clone, Debug)]
pub struct Batch {
    pub(super) inputs: Ids,
    pub(super) targets: Ids,
    pub(super) tokens: u64,
    /// Where the tokens sit, when that is not their index in their row: packed documents
    /// (`packing=true`) and a load-balanced context split.
    documents: Option<Positions>,
}

impl Batch {
    /// The inputs and, packed, their documents: what the model reads.
    pub(crate) fn tokens(&self) -> (&Ids, Option<&Positions>) {
        (&self.inputs, self.documents.as_ref())
    }
}

impl Engine {
    /// A micro-batch from its global rows (each `len + 1` tokens: inputs then shifted targets;
    /// [`IGNORE_INDEX`](ferrotext_spmd::IGNORE_INDEX) targets are ignored). Every device passes
    /// the same rows and keeps its block.
    ///
    /// # Errors
    /// Rows of unequal length, a token past the model's vocabulary (one read as an input, or a
    /// last target that is not ignored), or a count the batch axes do not divide. Every device checks the same
    /// global rows, so all refuse a bad batch together, before any of them computes (a token
    /// caught by one device's lookup alone left the others waiting in a collective).
    pub fn batch(&self, cx: &Ctx<'_>, rows: &[Vec<u32>]) -> Result<Batch, TrainError> {
        self.batch_of(cx, rows, None)
    }

    /// [`Engine::batch`] of packed rows (`packing=true`): each row holds documents that end in
    /// `eos`; a token's document starts after the last `eos` before it, its position counts
    /// from there, attention stays inside it, and the target after a document's `eos` (the
    /// next document's first token) is not scored (MaxText's packing).
    ///
    /// # Errors
    /// As [`Engine::batch`].
    pub fn packed_batch(
        &self,
        cx: &Ctx<'_>,
        rows: &[Vec<u32>],
        eos: u32,
    ) -> Result<Batch, TrainError> {
        self.batch_of(cx, rows, Some(eos))
    }

    fn batch_of(
        &self,
        cx: &Ctx<'_>,
        rows: &[Vec<u32>],
        eos: Option<u32>,
    ) -> Result<Batch, TrainError> {
        let len = rows.first().map_or(0, |r| r.len().saturating_sub(1));
        if len == 0 || rows.iter().any(|r| r.len() != len + 1) {
            return Err(TrainError::Misuse {
                call: "Engine::batch",
                reason: "a batch needs rows of equal length ≥ 2".into(),
            });
        }
        let vocab = self.plan.decoder().config().vocab_size;
        for (r, row) in rows.iter().enumerate() {
            // Index `len` is only a target, which may be ignored; every other token is read
            // as an input.
            let past = |(i, &t): &(usize, &u32)| {
                t as usize >= vocab && !(*i == len && t == ferrotext_spmd::IGNORE_INDEX)
            };
            if let Some((i, t)) = row.iter().enumerate().find(past) {
                let role = if i == len { "a target" } else { "an input" };
                return Err(TrainError::Misuse {
                    call: "Engine::batch",
                    reason: format!(
                        "row {r}, index {i}: token {t} ({role}) is past the model's vocabulary \
                         of {vocab}"
                    ),
                });
            }
        }
        let mut inputs: Vec<u32> = rows.iter().flat_map(|s| s[..len].iter().copied()).collect();
        let mut targets: Vec<u32> = rows.iter().flat_map(|s| s[1..].iter().copied()).collect();
        let packed = eos.map(|eos| pack(&inputs, &mut targets, len, eos));
        let tokens = targets
            .iter()
            .filter(|&&t| t != ferrotext_spmd::IGNORE_INDEX)
            .count() as u64;
        let shape = [rows.len(), len];
        let spec = if rows.len() == self.plan.config().micro_batch_rows() {
            self.plan.batch_spec().clone()
        } else {
            engine_rules().resolve(
                &[Some("activation_batch"), Some("activation_length")],
                &shape,
                cx.mesh(),
            )?
        };
        // A load-balanced context split: every row reordered so that device `i` holds chunks
        // `i` and `2n − 1 − i` of it; the model reads each token's original index.
        let context = cx.mesh().axis("context").map_or(1, |a| a.size());
        let chunks = (context > 1 && self.plan.config().context_parallel_load_balance)
            .then_some(2 * context);
        let index: Vec<u32> = (0..inputs.len()).map(|n| (n % len) as u32).collect();
        let in_document = packed.unwrap_or_else(|| index.clone());
        let place = |v: &[u32]| cx.ids_from_global(&shape, spec.clone(), v);
        let documents = match chunks {
            Some(chunks) => {
                for v in [&mut inputs, &mut targets] {
                    *v = balanced_order(v, len, chunks);
                }
                Some(Positions {
                    in_document: place(&balanced_order(&in_document, len, chunks))?,
                    balanced: Some(Balanced {
                        index: place(&balanced_order(&index, len, chunks))?,
                        chunks,
                    }),
                })
            }
            None if eos.is_some() => Some(Positions {
                in_document: place(&in_document)?,
                balanced: None,
            }),
            None => None,
        };
        Ok(Batch {
            inputs: cx.ids_from_global(&shape, spec.clone(), &inputs)?,
            targets: cx.ids_from_global(&shape, spec, &targets)?,
            tokens,
            documents,
        })
    }
}

/// `v` (rows of `len`, flat) with each row's `chunks` equal chunks reordered as a
/// load-balanced context split holds them: original chunk `j` at slot
/// [`Balanced::slot_of`]`(j, chunks)`.
fn balanced_order(v: &[u32], len: usize, chunks: usize) -> Vec<u32> {
    let size = len / chunks.max(1);
    let mut out = vec![0; v.len()];
    for (src, dst) in v.chunks(len).zip(out.chunks_mut(len)) {
        for j in 0..chunks {
            let at = Balanced::slot_of(j, chunks) * size;
            dst[at..at + size].copy_from_slice(&src[j * size..(j + 1) * size]);
        }
    }
    out
}

/// The documents of packed rows (`len` inputs each, flat): each input's position in its
/// document (a document starts after each `eos`); the target after an input that is `eos`
/// (it would cross into the next document) is no longer scored.
fn pack(inputs: &[u32], targets: &mut [u32], len: usize, eos: u32) -> Vec<u32> {
    let mut positions = vec![0; inputs.len()];
    for (row, ids) in inputs.chunks(len.max(1)).enumerate() {
        let mut start = 0usize;
        for (i, &id) in ids.iter().enumerate() {
            let at = row * len + i;
            positions[at] = (i - start) as u32;
            if id == eos {
                targets[at] = ferrotext_spmd::IGNORE_INDEX;
                start = i + 1;
            }
        }
    }
    positions
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of 8 in 4 chunks: chunk 0 at slot 0, chunk 3 at 1, chunk 1 at 2, chunk 2 at 3.
    #[test]
    fn a_balanced_row_holds_its_chunks_from_both_ends() {
        let v: Vec<u32> = (0..16).collect();
        let b = balanced_order(&v, 8, 4);
        assert_eq!(b, [0, 1, 6, 7, 2, 3, 4, 5, 8, 9, 14, 15, 10, 11, 12, 13]);
    }

    /// Hand-worked: rows `a b E c d | E f g h` (E the EOS): positions restart after each EOS,
    /// and the target after an EOS is not scored.
    #[test]
    fn packing_finds_documents_by_their_eos_and_masks_the_crossing_targets() {
        const E: u32 = 9;
        let inputs = [1, 2, E, 3, 4, E, 5, 6, 7, 8];
        let mut targets = [2, E, 3, 4, 5, 5, 6, 7, 8, 0];
        let positions = pack(&inputs, &mut targets, 5, E);
        assert_eq!(positions, [0, 1, 2, 0, 1, 0, 0, 1, 2, 3]);
        let x = ferrotext_spmd::IGNORE_INDEX;
        assert_eq!(targets, [2, E, x, 4, 5, x, 6, 7, 8, 0]);
    }
}
