//! Memory-efficient attention as one op on the tape, its transpose beside it (kernels:
//! `ferrotext_tensor::flash_attention` and its backward: tiled, online softmax, only the output
//! and each row's log-sum-exp kept, the scores recomputed tile by tile in the backward — memory
//! linear in the sequence).
//!
//! Type rule: `q: [B, T, H, dk]`, `k: [B, T, KV, dk]`, `v: [B, T, KV, dv]` (grouped-query: `H` a
//! multiple of `KV`, query head `h` reads kv head `h / (H/KV)`), out `[B, T, H, dv]` laid out like
//! `q`. The batch and head dims may be split (alike in all three; a split of the heads keeps
//! every group on one device, since both head counts split into the same number of contiguous
//! blocks); the width dims must be whole; no operand may be unreduced. `q`'s sequence may be
//! split over axes S (context parallelism) when `k` and `v` hold the whole sequence reduced over
//! S (the caller gathers them): each device attends its queries to every key, and the keys'
//! and values' cotangents come back unreduced over S (their gather's transpose reduce-scatters
//! them); otherwise the three carry the same `reduced` tags. Query places ([`QueryPlaces`]),
//! when given, are `u32[B, T]` split as `q`'s batch and sequence. No collective.
//!
//! What a query sees ([`AttentionSpec`]): the keys up to its own index (causal), within its
//! document when its position in it is given (its document starts that many keys before it:
//! packed documents are contiguous runs), at most `window` of them when a sliding window is set;
//! the logits are `scale·q·k`, soft-capped when asked. A query's index is its place in this
//! device's slice of the sequence unless given (a load-balanced split reorders the rows).
//!
//! On bf16 `q`, `k`, `v` the kernel runs in `f32` on the widened shards and rounds its output
//! and cotangents once; the backward's row sums `rowsum(dout ⊙ out)` read the output as stored
//! (rounded), as FlashAttention's do. Memory kept for the backward: the operands (which the
//! projections' transposes keep anyway), the output and `B·H·T` log-sum-exps — no `T×T` array.

use std::sync::Arc;

use ferrotext_sharding::{ArrayType, AxisSet};
use ferrotext_tensor::{KeyRanges, Scores, Tensor};

use crate::array::{bf16_operands, Array};
use crate::ctx::{Ctx, Mode};
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::ids::Ids;
use crate::rules;
use crate::tape::{AttentionSaved, Backward};

const OP: &str = "attention";

/// How [`Ctx::attention`]'s queries see the keys and how scores become logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// The factor on `q·k` (`1/√dk` usually).
    pub scale: f32,
    /// Attention-logit soft-capping: logits `cap·tanh(x/cap)` (Gemma 2); `None`: off.
    pub softcap: Option<f32>,
    /// Sliding window: a query sees at most this many keys, its own position included;
    /// `None`: every earlier key.
    pub window: Option<usize>,
}

impl AttentionSpec {
    /// Plain causal attention with `scale`.
    pub fn causal(scale: f32) -> AttentionSpec {
        AttentionSpec {
            scale,
            softcap: None,
            window: None,
        }
    }

    fn scores(&self) -> Scores {
        Scores {
            scale: self.scale,
            softcap: self.softcap,
        }
    }
}

fn type_error(kind: K, xs: &[&ArrayType], message: impl Into<String>) -> SpmdError {
    ShardingTypeError::new(kind, OP, xs, message).into()
}

/// The output type of [`Ctx::attention`], or why the operands do not fit.
fn attention_type(q: &ArrayType, k: &ArrayType, v: &ArrayType) -> Result<ArrayType, SpmdError> {
    let all = [q, k, v];
    let shapes_fit = match (q.shape(), k.shape(), v.shape()) {
        (&[b, t, h, dk], &[kb, kt, kv, kdk], &[vb, vt, vkv, _]) => {
            (b, t, dk) == (kb, kt, kdk) && (b, t, kv) == (vb, vt, vkv) && kv > 0 && h % kv == 0
        }
        _ => false,
    };
    if !shapes_fit {
        return Err(type_error(
            K::ShapeError,
            &all,
            "needs q [B,T,H,dk], k [B,T,KV,dk], v [B,T,KV,dv] with H a multiple of KV",
        ));
    }
    if all.iter().any(|t| t.is_manual()) {
        return Err(type_error(
            K::ShardingMismatch,
            &all,
            "is not defined inside a manual region; use the unfused ops there",
        ));
    }
    for t in all {
        if !t.sharding().spec().unreduced().is_empty() {
            return Err(type_error(
                K::UnreducedOperand,
                &all,
                "cannot take an unreduced operand",
            ));
        }
        if t.sharding().dim_parts(3)? > 1 {
            return Err(type_error(
                K::ShardingMismatch,
                &all,
                "dimension 3 is sharded; the widths must be whole",
            ));
        }
    }
    // Context parallelism: q's sequence may be split over axes S when k and v hold the whole
    // sequence, reduced over S (gathered by the caller): each device attends its queries to
    // every key, and the keys' and values' cotangents come back unreduced over S.
    let split: AxisSet = q
        .sharding()
        .spec()
        .dim(1)
        .axis_names()
        .iter()
        .cloned()
        .collect();
    let spec = |t: &ArrayType, d: usize| t.sharding().spec().dim(d).clone();
    let mut want_reduced = q.sharding().spec().reduced().clone();
    want_reduced.extend(split.iter().cloned());
    for t in [k, v] {
        if spec(t, 0) != spec(q, 0) || spec(t, 2) != spec(q, 2) {
            return Err(type_error(
                K::ShardingMismatch,
                &all,
                "q, k and v must split the batch and the heads alike",
            ));
        }
        if t.sharding().dim_parts(1)? > 1 {
            return Err(type_error(
                K::ShardingMismatch,
                &all,
                "dimension 1 of k or v is sharded; the keys' sequence must be whole (gather it)",
            ));
        }
        if t.sharding().spec().reduced() != &want_reduced {
            return Err(type_error(
                K::ShardingMismatch,
                &all,
                "k and v must carry q's reduced tags, plus the axes q's sequence is split over",
            ));
        }
    }
    let mut shape = q.shape().to_vec();
    shape[3] = v.shape()[3];
    rules::make_type(OP, q, shape, Ok(q.sharding().spec().clone())).map_err(Into::into)
}

/// Where each of [`Ctx::attention`]'s query rows sits in the sequence its keys hold: its
/// index there (`None`: the rows are in order, this device's slice starting where its split
/// puts it) and its position in its document (`None`: one document from index 0). Each is
/// `u32[B, T]`, split as `q`'s batch and sequence.
#[derive(Clone, Copy, Debug, Default)]
pub struct QueryPlaces<'a> {
    /// Each query's index among the keys (a load-balanced split reorders the rows).
    pub index: Option<&'a Ids>,
    /// Each query's position in its packed document (its document starts that many keys
    /// before it).
    pub in_document: Option<&'a Ids>,
}

/// Query places fit `q`: `[B, T]`, split as `q`'s batch and sequence.
fn check_places(q: &ArrayType, places: &QueryPlaces<'_>) -> Result<(), SpmdError> {
    let spec = |t: &ArrayType, d: usize| t.sharding().spec().dim(d).clone();
    for ids in [places.index, places.in_document].into_iter().flatten() {
        let p = ids.ty();
        if p.shape() != &q.shape()[..2] || spec(p, 0) != spec(q, 0) || spec(p, 1) != spec(q, 1) {
            return Err(type_error(
                K::ShardingMismatch,
                &[q, p],
                "needs query indices and document positions [B, T] split over the batch and \
                 sequence as q is",
            ));
        }
    }
    Ok(())
}

/// Which keys each of this device's query rows sees: `rows` batch rows of `queries` queries
/// over `keys` keys, the queries at `offset..offset + queries` unless `index` gives each one's
/// index; within documents when `in_document` gives each one's position in its document.
fn key_ranges(
    (rows, queries, keys, offset): (usize, usize, usize, usize),
    (index, in_document): (Option<&[u32]>, Option<&[u32]>),
    window: Option<usize>,
) -> Result<KeyRanges, SpmdError> {
    if index.is_none() && in_document.is_none() {
        return Ok(KeyRanges::causal(rows, keys, window).query_rows(offset..offset + queries)?);
    }
    let at = |n: usize| index.map_or(offset + n % queries.max(1), |ix| ix[n] as usize);
    let places: Vec<(u32, u32)> = (0..rows * queries)
        .map(|n| {
            let i = at(n);
            let back = in_document.map_or(i, |p| p[n] as usize);
            (i as u32, i.saturating_sub(back) as u32)
        })
        .collect();
    Ok(KeyRanges::places(rows, keys, &places, window)?)
}

impl Ctx<'_> {
    /// Whether [`Ctx::attention`] takes these operands (its type rule; see the module docs).
    /// Callers with a composition to fall back on ask first.
    pub fn attention_fits(&self, q: &Array, k: &Array, v: &Array) -> bool {
        attention_type(q.ty(), k.ty(), v.ty()).is_ok()
    }

    /// Causal grouped-query self-attention `softmax(logits over the visible keys)·v`, tiled, on
    /// `q: [B, T, H, dk]`, `k: [B, T, KV, dk]`, `v: [B, T, KV, dv]`; out `[B, T, H, dv]`.
    /// `places` says where each query sits among the keys and in its packed document (each
    /// query sees only its document). See the module docs for the type rule and what is kept.
    ///
    /// # Errors
    /// Shapes that do not fit; a split sequence or width dim; batch or heads split differently;
    /// an unreduced operand; operands inside a manual region; segment ids that do not fit.
    ///
    /// # Collectives
    /// None, forward or backward.
    pub fn attention(
        &mut self,
        q: &Array,
        k: &Array,
        v: &Array,
        spec: &AttentionSpec,
        places: QueryPlaces<'_>,
    ) -> Result<Array, SpmdError> {
        let out_ty = attention_type(q.ty(), k.ty(), v.ty())?;
        check_places(q.ty(), &places)?;
        let threads = self.threads();
        let scores = spec.scores();
        let ranges = if self.mode() == Mode::Abstract {
            None
        } else {
            let local = q.ty().shard_shape();
            let offset = q.ty().sharding().shard_ranges(q.shape(), self.device())?[1].start;
            let sizes = (local[0], local[1], k.shape()[1], offset);
            let local = (
                places.index.and_then(Ids::local),
                places.in_document.and_then(Ids::local),
            );
            Some(key_ranges(sizes, local, spec.window)?)
        };
        let (out, lse) = match (&ranges, bf16_operands(&out_ty, &[q, k, v])) {
            (Some(r), Some(b)) => {
                let (out, lse) =
                    ferrotext_tensor::flash_attention_bf16(b[0], b[1], b[2], r, scores, threads)?;
                (Array::from_bf16(out_ty, Some(out))?, Some(lse))
            }
            (Some(r), None) => {
                let (ql, kl, vl) = (q.local()?, k.local()?, v.local()?);
                let f = ferrotext_tensor::flash_attention(&ql, &kl, &vl, r, scores, threads)?;
                (Array::new(out_ty, Some(f.out)), Some(f.lse))
            }
            (None, _) => (Array::new(out_ty, None), None),
        };
        self.record(
            Backward::Attention(Box::new(AttentionSaved {
                q: q.clone(),
                k: k.clone(),
                v: v.clone(),
                out: out.clone(),
                lse,
                ranges: ranges.map(Arc::new),
                scores,
            })),
            &[q, k, v],
            out,
        )
    }

    /// The transpose of [`Ctx::attention`]: the cotangents of `q`, `k` and `v` from the
    /// forward's output and log-sum-exps (`None` in abstract mode), the scores recomputed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_transpose(
        &mut self,
        [q, k, v, out]: [&Array; 4],
        lse: Option<&Tensor>,
        ranges: Option<&KeyRanges>,
        scores: Scores,
        ct: &Array,
    ) -> Result<[Array; 3], SpmdError> {
        let threads = self.threads();
        let (Some(lse), Some(r)) = (lse, ranges) else {
            return Ok([
                Array::new(q.ty().to_cotangent(), None),
                Array::new(k.ty().to_cotangent(), None),
                Array::new(v.ty().to_cotangent(), None),
            ]);
        };
        if let Some(b) = bf16_operands(&q.ty().to_cotangent(), &[q, k, v, out, ct]) {
            // k and v hold bf16, so their types (and their cotangents') are bf16 too.
            let (dq, dk, dv) = ferrotext_tensor::flash_attention_backward_bf16(
                b[0], b[1], b[2], b[3], lse, b[4], r, scores, threads,
            )?;
            return Ok([
                Array::from_bf16(q.ty().to_cotangent(), Some(dq))?,
                Array::from_bf16(k.ty().to_cotangent(), Some(dk))?,
                Array::from_bf16(v.ty().to_cotangent(), Some(dv))?,
            ]);
        }
        let (ql, kl, vl) = (q.local()?, k.local()?, v.local()?);
        let (ol, cl) = (out.local()?, ct.local()?);
        let (dq, dk, dv) = ferrotext_tensor::flash_attention_backward(
            &ql, &kl, &vl, &ol, lse, &cl, r, scores, threads,
        )?;
        Ok([
            Array::new(q.ty().to_cotangent(), Some(dq)),
            Array::new(k.ty().to_cotangent(), Some(dk)),
            Array::new(v.ty().to_cotangent(), Some(dv)),
        ])
    }
}
