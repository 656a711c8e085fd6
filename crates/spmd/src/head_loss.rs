//! The LM head and its cross-entropy, tiled over the tokens (MaxText's `num_vocab_tiling`): the
//! `[tokens, vocab]` logits and their cotangent never exist whole. The op takes the final hidden
//! states and the head's weight and returns the loss sum; its transpose recomputes each tile's
//! logits.
//!
//! Type rule: `h: [.., d]` (its leading dims split over batch axes as the targets' are, `d`
//! whole), `w: [d, V]` (an untied head) or `[V, d]` (a tied embedding, `transposed`), whole on
//! every device (gather a split one first), `f32` (the master weight: in bf16 the op casts it
//! at use, remembered casts reused), possibly `reduced`; targets `u32` with `h`'s leading shape
//! and split. Out: a plain scalar (the sum over every device's rows: an all-reduce over the
//! batch axes) or, `partial`, each device's own sum `{U:batch axes}` — as
//! [`Ctx::cross_entropy_sum`] and [`Ctx::cross_entropy_partial_sum`].
//!
//! Numbers: each tile's logits are `h_tile · w` as the untiled product computes them (bf16
//! operands, f32 result), its rows' losses the untiled kernel's, summed per tile and across
//! tiles in f64; the tile's logit cotangent is the untiled one (in bf16: rounded once, as the
//! untiled head's is), `dh` its product with the weight. The weight's gradient adds every tile's
//! product in `f32` into one buffer (no bf16 rounding of partial products). So the loss and
//! `dh` equal the untiled head's up to the order of the loss sum's additions, and the weight's
//! gradient up to how its contraction over tokens is split: within 1e-6 relative, not bitwise.
//!
//! Memory: one tile's logits and probabilities (`2 × rows × V` f32) at a time, the rows'
//! log-partition values are not kept (the transpose recomputes the tile), and the weight's
//! gradient buffer (`d × V` f32) in the backward.

use ferrotext_sharding::{ArrayType, AxisSet, DType, DimSpec, PartitionSpec};
use ferrotext_tensor::{Bf16Tensor, DotDims, Tensor};

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::fused::split_ignored;
use crate::ids::Ids;
use crate::rules;
use crate::rules::head_loss::{check_types, HeadLoss, OP};
use crate::tape::{Backward, HeadLossSaved};

/// The axes `h`'s rows are split over (what the loss is partial over).
fn row_axes(h: &ArrayType) -> AxisSet {
    h.sharding()
        .spec()
        .partition_axes()
        .map(str::to_string)
        .collect()
}

/// The product dims: logits `[rows, V]` from `h [rows, d]` and the weight.
fn logits_dims(transposed: bool) -> DotDims {
    DotDims {
        lhs_contracting: vec![1],
        rhs_contracting: vec![if transposed { 1 } else { 0 }],
        ..DotDims::default()
    }
}

/// One device's rows in its compute dtype: `[rows, d]`, f32 or bf16.
enum Rows {
    F32(Tensor),
    Bf16(Bf16Tensor),
}

impl Rows {
    fn of(h: &Array) -> Result<Option<Rows>, SpmdError> {
        let d = *h.shape().last().unwrap_or(&1);
        if let Some(b) = h.local_bf16() {
            let rows = b.len() / d.max(1);
            return Ok(Some(Rows::Bf16(Bf16Tensor::new(
                vec![rows, d],
                b.data().to_vec(),
            )?)));
        }
        Ok(h.local_opt()
            .map(|t| {
                let rows = t.len() / d.max(1);
                t.into_owned().reshape(&[rows, d])
            })
            .transpose()?
            .map(Rows::F32))
    }

    fn len(&self) -> usize {
        match self {
            Rows::F32(t) => t.shape()[0],
            Rows::Bf16(t) => t.shape()[0],
        }
    }

    /// Rows `range`, as a product operand (a copy: `range.len() × d`).
    fn tile(&self, range: std::ops::Range<usize>) -> Result<Rows, SpmdError> {
        Ok(match self {
            Rows::F32(t) => {
                let d = t.shape()[1];
                Rows::F32(Tensor::new(
                    vec![range.len(), d],
                    t.data()[range.start * d..range.end * d].to_vec(),
                )?)
            }
            Rows::Bf16(t) => {
                let d = t.shape()[1];
                Rows::Bf16(Bf16Tensor::new(
                    vec![range.len(), d],
                    t.data()[range.start * d..range.end * d].to_vec(),
                )?)
            }
        })
    }
}

/// The weight in the rows' dtype.
enum Weight<'a> {
    F32(std::borrow::Cow<'a, Tensor>),
    Bf16(Array),
}

impl Ctx<'_> {
    /// The LM head `h · w` (or `h · wᵀ`, `transposed`) and the cross-entropy of its logits
    /// against `targets` ([`IGNORE_INDEX`](crate::IGNORE_INDEX) ignored), plus the z-loss, as one sum, computed over
    /// `spec.tiles` tiles of each device's tokens (see the module docs).
    ///
    /// # Errors
    /// Operands that do not fit the type rule (module docs); a target outside the vocabulary.
    ///
    /// # Collectives
    /// Forward: an all-reduce of the scalar over the batch axes unless `partial`. Backward: the
    /// weight's gradient all-reduced over the batch axes unless the weight is reduced on them.
    pub fn head_cross_entropy(
        &mut self,
        h: &Array,
        w: &Array,
        targets: &Ids,
        spec: &HeadLoss,
    ) -> Result<Array, SpmdError> {
        check_types(h.ty(), w.ty(), targets.ty(), spec)?;
        let scalar_ty = self.array_type(&[], PartitionSpec::replicated())?;
        let natural = self.array_type(
            &[],
            PartitionSpec::replicated().with_unreduced_set(row_axes(h.ty()))?,
        )?;
        let local = match (Rows::of(h)?, targets.local()) {
            (Some(rows), Some(ids)) => {
                let weight = self.head_weight(w, h.ty().dtype())?;
                let mut sum = 0.0f64;
                for range in tiles(rows.len(), spec.tiles) {
                    let logits =
                        self.tile_logits(&rows, range.clone(), &weight, spec.transposed)?;
                    let logits = capped(logits, spec.softcap);
                    let (safe, mask) = split_ignored(&ids[range]);
                    let ce = ferrotext_tensor::cross_entropy(&logits, &safe, &mask, spec.z_loss)?;
                    sum += f64::from(ce.loss_sum);
                }
                Some(Tensor::scalar(sum as f32))
            }
            _ => None,
        };
        let out = if spec.partial {
            Array::new(natural, local)
        } else {
            let local = self.convert(local, &natural, &scalar_ty)?;
            Array::new(scalar_ty, local)
        };
        self.record(
            Backward::HeadLoss(Box::new(HeadLossSaved {
                h: h.clone(),
                w: w.clone(),
                targets: targets.clone(),
                spec: *spec,
            })),
            &[h, w],
            out,
        )
    }

    /// `w` as the products read it: itself in f32, its (remembered) bf16 cast for bf16 rows.
    fn head_weight<'w>(&mut self, w: &'w Array, dtype: DType) -> Result<Weight<'w>, SpmdError> {
        Ok(match dtype {
            DType::BF16 => Weight::Bf16(self.cast_remembered(w, DType::BF16)?),
            _ => Weight::F32(w.local()?),
        })
    }

    /// The logits of rows `range`: `[rows, V]` f32.
    fn tile_logits(
        &self,
        rows: &Rows,
        range: std::ops::Range<usize>,
        w: &Weight<'_>,
        transposed: bool,
    ) -> Result<Tensor, SpmdError> {
        let dims = logits_dims(transposed);
        let threads = self.threads();
        Ok(match (rows.tile(range)?, w) {
            (Rows::F32(t), Weight::F32(w)) => ferrotext_tensor::dot_general(&t, w, &dims, threads)?,
            (Rows::Bf16(t), Weight::Bf16(w)) => {
                let w = w.local_bf16().ok_or(SpmdError::Internal {
                    op: OP,
                    invariant: "a bf16 cast holds bf16",
                })?;
                ferrotext_tensor::dot_general_bf16(&t, w, &dims, threads)?
            }
            _ => {
                return Err(SpmdError::Internal {
                    op: OP,
                    invariant: "rows and weight share a dtype",
                })
            }
        })
    }

    /// The transpose of [`Ctx::head_cross_entropy`]: `dh` (in `h`'s dtype) and the weight's
    /// gradient (f32, laid out as the weight's cotangent), each tile's logits recomputed.
    pub(crate) fn head_cross_entropy_transpose(
        &mut self,
        saved: &HeadLossSaved,
        ct: &Array,
        need_w: bool,
    ) -> Result<[Option<Array>; 2], SpmdError> {
        let (h, w, spec) = (&saved.h, &saved.w, &saved.spec);
        let dh_ty = h.ty().to_cotangent();
        let target = w.ty().to_cotangent();
        let natural_spec = PartitionSpec::tagged(
            [DimSpec::Replicated, DimSpec::Replicated],
            row_axes(h.ty()),
            AxisSet::new(),
        )?;
        let natural = rules::make_type(OP, w.ty(), w.shape().to_vec(), Ok(natural_spec))?;
        let (dh, dw) = match (Rows::of(h)?, saved.targets.local(), ct.local_opt()) {
            (Some(rows), Some(ids), Some(c)) => {
                let (dh, dw) =
                    self.head_backward_local(&rows, ids, w, c.data()[0], spec, need_w)?;
                (Some(dh), dw)
            }
            _ => (None, None),
        };
        let dh = match dh {
            Some(Rows::Bf16(t)) => {
                Array::from_bf16(dh_ty.clone(), Some(t.reshape(&dh_ty.shard_shape())?))?
            }
            Some(Rows::F32(t)) => Array::new(dh_ty.clone(), Some(t.reshape(&dh_ty.shard_shape())?)),
            None => Array::new(dh_ty, None),
        };
        if !need_w {
            return Ok([Some(dh), None]);
        }
        let dw = self.convert(dw, &natural, &target)?;
        Ok([Some(dh), Some(Array::new(target, dw))])
    }

    /// One device's `dh` rows and (when `need_w`) its partial weight gradient, tile by tile.
    fn head_backward_local(
        &mut self,
        rows: &Rows,
        ids: &[u32],
        w: &Array,
        ct: f32,
        spec: &HeadLoss,
        need_w: bool,
    ) -> Result<(Rows, Option<Tensor>), SpmdError> {
        let threads = self.threads();
        let weight = self.head_weight(
            w,
            match rows {
                Rows::Bf16(_) => DType::BF16,
                Rows::F32(_) => DType::F32,
            },
        )?;
        let n = rows.len();
        let d = w.shape()[if spec.transposed { 1 } else { 0 }];
        let mut dh = vec![0.0f32; n * d];
        let mut dw = need_w.then(|| vec![0.0f32; w.ty().shard_shape().iter().product()]);
        // dh [rows, d] = dlogits [rows, V] · w (tied: [V, d]) or · wᵀ (untied: [d, V]).
        let dh_dims = DotDims {
            lhs_contracting: vec![1],
            rhs_contracting: vec![if spec.transposed { 0 } else { 1 }],
            ..DotDims::default()
        };
        // The weight's gradient: tied [V, d] = dlogitsᵀ · h; untied [d, V] = hᵀ · dlogits.
        let dw_dims = DotDims {
            lhs_contracting: vec![0],
            rhs_contracting: vec![0],
            ..DotDims::default()
        };
        for range in tiles(n, spec.tiles) {
            let logits = self.tile_logits(rows, range.clone(), &weight, spec.transposed)?;
            let logits = capped(logits, spec.softcap);
            let (safe, mask) = split_ignored(&ids[range.clone()]);
            let ce = ferrotext_tensor::cross_entropy(&logits, &safe, &mask, spec.z_loss)?;
            let dl = ferrotext_tensor::cross_entropy_backward(&ce, &safe, &mask, spec.z_loss, ct)?;
            drop(ce);
            let dl = capped_backward(dl, &logits, spec.softcap)?;
            drop(logits);
            let out = &mut dh[range.start * d..range.end * d];
            match (rows.tile(range)?, &weight) {
                (Rows::F32(ht), Weight::F32(wt)) => {
                    out.copy_from_slice(
                        ferrotext_tensor::dot_general(&dl, wt, &dh_dims, threads)?.data(),
                    );
                    if let Some(dw) = dw.as_mut() {
                        let (a, b) = if spec.transposed {
                            (&dl, &ht)
                        } else {
                            (&ht, &dl)
                        };
                        ferrotext_tensor::dot_general_accumulate(a, b, &dw_dims, threads, dw)?;
                    }
                }
                (Rows::Bf16(ht), Weight::Bf16(wb)) => {
                    let wb = wb.local_bf16().ok_or(SpmdError::Internal {
                        op: OP,
                        invariant: "a bf16 cast holds bf16",
                    })?;
                    // The logits' cotangent rounded once, as the untiled head's is.
                    let dl = Bf16Tensor::from_f32(&dl);
                    out.copy_from_slice(
                        ferrotext_tensor::dot_general_bf16(&dl, wb, &dh_dims, threads)?.data(),
                    );
                    if let Some(dw) = dw.as_mut() {
                        let (a, b) = if spec.transposed {
                            (&dl, &ht)
                        } else {
                            (&ht, &dl)
                        };
                        ferrotext_tensor::dot_general_bf16_accumulate(a, b, &dw_dims, threads, dw)?;
                    }
                }
                _ => {
                    return Err(SpmdError::Internal {
                        op: OP,
                        invariant: "rows and weight share a dtype",
                    })
                }
            }
        }
        let dh = Tensor::new(vec![n, d], dh)?;
        let dh = match rows {
            Rows::Bf16(_) => Rows::Bf16(Bf16Tensor::from_f32(&dh)),
            Rows::F32(_) => Rows::F32(dh),
        };
        let dw = dw
            .map(|v| Tensor::new(w.ty().shard_shape(), v))
            .transpose()?;
        Ok((dh, dw))
    }
}

/// `logits` soft-capped (`cap·tanh(z/cap)`): the untiled `softcap` op's function, so its bits.
fn capped(logits: Tensor, cap: Option<f32>) -> Tensor {
    match cap {
        Some(c) => logits.map(|x| ferrotext_tensor::softcap(x, c)),
        None => logits,
    }
}

/// The cotangent of the uncapped logits from the capped ones `y` and their cotangent `dl`:
/// `d(cap·tanh(z/cap))/dz = 1 − (y/cap)²`, the untiled `softcap` op's transpose.
fn capped_backward(dl: Tensor, y: &Tensor, cap: Option<f32>) -> Result<Tensor, SpmdError> {
    let Some(c) = cap else {
        return Ok(dl);
    };
    let data = dl
        .data()
        .iter()
        .zip(y.data())
        .map(|(g, v)| g * (1.0 - (v / c) * (v / c)))
        .collect();
    Ok(Tensor::new(dl.shape().to_vec(), data)?)
}

/// `n` rows cut into `tiles` consecutive ranges of `⌈n / tiles⌉` (the last shorter; none empty).
fn tiles(n: usize, tiles: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let size = n.div_ceil(tiles.max(1)).max(1);
    (0..n).step_by(size).map(move |s| s..(s + size).min(n))
}
