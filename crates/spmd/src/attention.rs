//! Fused causal self-attention as one op on the tape, its transpose beside it (kernels:
//! `ferrotext_tensor::causal_attention` and its backward).
//!
//! Type rule: `q: [B, T, H, dk]`, `k: [B, T, KV, dk]`, `v: [B, T, KV, dv]` (grouped-query: `H` a
//! multiple of `KV`, query head `h` reads kv head `h / (H/KV)`), out `[B, T, H, dv]` laid out like
//! `q`. The batch and head dims may be split (alike in all three; a split of the heads keeps
//! every group on one device, since both head counts split into the same number of contiguous
//! blocks); the sequence and width dims must be whole; no operand may be unreduced, and the
//! three carry the same `reduced` tags. No collective: what the unfused composition
//! (`dot_general`, `causal_softmax`, `dot_general`, with k and v broadcast to `H` heads) would
//! compute, bit for bit (the kernel's tests), with no broadcast copies and no scores buffer
//! beside the probabilities. On bf16 q, k, v (and cotangent) the op and its transpose run the
//! bf16 kernels on the shards as stored (`f32` inside, outputs rounded once, probabilities kept
//! in `f32`): bitwise the widened route's result.
//!
//! The decoders use it in training (no key/value cache) wherever its type rule holds
//! ([`Ctx::causal_attention_fits`]), and the composition otherwise. Measured on qwen3-peer, GA 4,
//! 2-core AVX-512 machine, with the device kernel pools and MKL: steps 2–5% faster at data=4
//! (286–296 → 273–280 ms) and at data=1 (276–277 → 262–271 ms), the same losses to the bit.
//! (Before the device pools it was 2–5% slower: one (batch, head) gemm pair per task against
//! the composition's batched products.)

use ferrotext_sharding::ArrayType;

use crate::array::bf16_operands;
use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::rules;
use crate::tape::Backward;

const OP: &str = "causal_attention";

fn type_error(kind: K, xs: &[&ArrayType], message: impl Into<String>) -> SpmdError {
    ShardingTypeError::new(kind, OP, xs, message).into()
}

/// The output type of [`Ctx::causal_attention`], or why the operands do not fit.
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
        for d in [1, 3] {
            if t.sharding().dim_parts(d)? > 1 {
                return Err(type_error(
                    K::ShardingMismatch,
                    &all,
                    format!("dimension {d} is sharded; the sequence and widths must be whole"),
                ));
            }
        }
    }
    let spec = |t: &ArrayType, d: usize| t.sharding().spec().dim(d).clone();
    for t in [k, v] {
        if spec(t, 0) != spec(q, 0) || spec(t, 2) != spec(q, 2) {
            return Err(type_error(
                K::ShardingMismatch,
                &all,
                "q, k and v must split the batch and the heads alike",
            ));
        }
        if t.sharding().spec().reduced() != q.sharding().spec().reduced() {
            return Err(type_error(
                K::ShardingMismatch,
                &all,
                "q, k and v must carry the same reduced tags",
            ));
        }
    }
    let mut shape = q.shape().to_vec();
    shape[3] = v.shape()[3];
    rules::make_type(OP, q, shape, Ok(q.sharding().spec().clone())).map_err(Into::into)
}

impl Ctx<'_> {
    /// Whether [`Ctx::causal_attention`] takes these operands (its type rule; see the module
    /// docs). Callers with a composition to fall back on ask first.
    pub fn causal_attention_fits(&self, q: &Array, k: &Array, v: &Array) -> bool {
        attention_type(q.ty(), k.ty(), v.ty()).is_ok()
    }

    /// Causal grouped-query self-attention `softmax(scale·q·kᵀ, causal)·v`, fused, on
    /// `q: [B, T, H, dk]`, `k: [B, T, KV, dk]`, `v: [B, T, KV, dv]`; out `[B, T, H, dv]`. See the
    /// module docs for the type rule.
    ///
    /// # Errors
    /// Shapes that do not fit; a split sequence or width dim; batch or heads split differently;
    /// an unreduced operand; operands inside a manual region.
    pub fn causal_attention(
        &mut self,
        q: &Array,
        k: &Array,
        v: &Array,
        scale: f32,
    ) -> Result<Array, SpmdError> {
        let out_ty = attention_type(q.ty(), k.ty(), v.ty())?;
        let threads = self.threads();
        let (out, probs) = if let Some(b) = bf16_operands(&out_ty, &[q, k, v]) {
            let (out, probs) =
                ferrotext_tensor::causal_attention_bf16(b[0], b[1], b[2], scale, threads)?;
            (Array::from_bf16(out_ty, Some(out))?, Some(probs))
        } else {
            let (local, probs) = match (
                q.local_opt().as_deref(),
                k.local_opt().as_deref(),
                v.local_opt().as_deref(),
            ) {
                (Some(a), Some(b), Some(c)) => {
                    let fused = ferrotext_tensor::causal_attention(a, b, c, scale, threads)?;
                    (Some(fused.out), Some(fused.probs))
                }
                _ => (None, None),
            };
            (Array::new(out_ty, local), probs)
        };
        self.record(
            Backward::CausalAttention {
                q: q.clone(),
                k: k.clone(),
                v: v.clone(),
                probs,
                scale,
            },
            &[q, k, v],
            out,
        )
    }

    /// The transpose of [`Ctx::causal_attention`]: the cotangents of `q`, `k` and `v` from the
    /// forward's probabilities (`None` in abstract mode).
    pub(crate) fn causal_attention_transpose(
        &mut self,
        q: &Array,
        k: &Array,
        v: &Array,
        probs: Option<&ferrotext_tensor::Tensor>,
        scale: f32,
        ct: &Array,
    ) -> Result<[Array; 3], SpmdError> {
        let threads = self.threads();
        if let (Some(b), Some(p)) = (bf16_operands(&q.ty().to_cotangent(), &[q, k, v, ct]), probs) {
            // k and v hold bf16, so their types (and their cotangents') are bf16 too.
            let (dq, dk, dv) = ferrotext_tensor::causal_attention_backward_bf16(
                b[0], b[1], b[2], p, b[3], scale, threads,
            )?;
            return Ok([
                Array::from_bf16(q.ty().to_cotangent(), Some(dq))?,
                Array::from_bf16(k.ty().to_cotangent(), Some(dk))?,
                Array::from_bf16(v.ty().to_cotangent(), Some(dv))?,
            ]);
        }
        let (dq, dk, dv) = match (
            q.local_opt().as_deref(),
            k.local_opt().as_deref(),
            v.local_opt().as_deref(),
            probs,
            ct.local_opt().as_deref(),
        ) {
            (Some(a), Some(b), Some(c), Some(p), Some(d)) => {
                let (dq, dk, dv) =
                    ferrotext_tensor::causal_attention_backward(a, b, c, p, d, scale, threads)?;
                (Some(dq), Some(dk), Some(dv))
            }
            _ => (None, None, None),
        };
        Ok([
            Array::new(q.ty().to_cotangent(), dq),
            Array::new(k.ty().to_cotangent(), dk),
            Array::new(v.ty().to_cotangent(), dv),
        ])
    }
}
