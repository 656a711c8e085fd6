//! DeepSeek-V3's pieces of the decoder: multi-head latent attention (DeepSeek-V2/V3, MaxText
//! `attention_type: mla`) with its weights ([`Mla`]) and settings ([`MlaSettings`]). Its YaRN
//! RoPE is [`ferrotext_tensor::Yarn`] (chosen by `Config::rope`) and its sigmoid router is
//! [`crate::moe::RouterScore::Sigmoid`]; its rotation pairs are interleaved or rotate-half as
//! [`MlaSettings::rope_interleave`] says.
//!
//! MLA: queries and keys/values go through low-rank latents with their own RMSNorms; each head's
//! query/key is a position-free part (`qk_nope_head_dim`) and a RoPE part (`qk_rope_head_dim`)
//! whose key half is one vector shared by every head; values have their own width
//! (`v_head_dim`).

use ferrotext_spmd::{Array, AttentionSpec, Ctx, SpmdError};
use ferrotext_tensor::Rope;

use crate::kv_cache::KvSlot;
use crate::nn::{causal_attention, keys_for_queries, linear, linear_named, query_places, rms_norm};
use crate::params::{matrix, norm_scale, ParamInfo};
use crate::positions::Positions;
use crate::remat;

/// Multi-head latent attention in place of GQA (DeepSeek; MaxText's MLA keys).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaSettings {
    /// Query latent width (`q_lora_rank`).
    pub q_lora_rank: usize,
    /// Key/value latent width (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Position-free query/key width per head (`qk_nope_head_dim`).
    pub qk_nope_head_dim: usize,
    /// RoPE query/key width per head (`qk_rope_head_dim`).
    pub qk_rope_head_dim: usize,
    /// Value width per head (`v_head_dim`).
    pub v_head_dim: usize,
    /// The RoPE dims rotate as interleaved pairs `(2i, 2i+1)` (HF `rope_interleave: true`, the
    /// published DeepSeek-V3) or as rotate-half pairs `(i, i + rope/2)` (`false`). transformers
    /// de-interleaves, then rotates half: the same scores as rotating the pairs in place, since
    /// queries and keys are permuted alike.
    pub rope_interleave: bool,
    /// RMSNorm epsilon of the latent norms (`q_a_layernorm`, `kv_a_layernorm`). transformers'
    /// DeepSeek-V2 and V3, like DeepSeek's own code, build them with RMSNorm's default 1e-6,
    /// whatever `rms_norm_eps` the decoder's other norms take.
    pub latent_norm_eps: f32,
}

/// MLA weights (`self_attn.*`, HF DeepSeek-V3 names), matrices `[in, out]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Mla<W> {
    /// `q_proj.weight` `[d, heads·(nope+rope)]`: the queries in one projection, when there is
    /// no query latent (`q_lora_rank` 0; DeepSeek-V2-Lite, Moonlight).
    pub q_proj: Option<W>,
    /// `q_a_proj.weight` `[d, q_lora]` (with a query latent; likewise the next two).
    pub q_a_proj: Option<W>,
    /// `q_a_layernorm.weight` `[q_lora]`.
    pub q_a_layernorm: Option<W>,
    /// `q_b_proj.weight` `[q_lora, heads·(nope+rope)]`.
    pub q_b_proj: Option<W>,
    /// `kv_a_proj_with_mqa.weight` `[d, kv_lora + rope]`.
    pub kv_a_proj_with_mqa: W,
    /// `kv_a_layernorm.weight` `[kv_lora]`.
    pub kv_a_layernorm: W,
    /// `kv_b_proj.weight` `[kv_lora, heads·(nope+v)]`.
    pub kv_b_proj: W,
    /// `o_proj.weight` `[heads·v, d]`.
    pub o_proj: W,
}

impl<W> Mla<W> {
    /// This structure with every weight replaced by `f(weight)`, in field order.
    pub(crate) fn try_map<U, E>(
        &self,
        f: &mut impl FnMut(&W) -> Result<U, E>,
    ) -> Result<Mla<U>, E> {
        Ok(Mla {
            q_proj: self.q_proj.as_ref().map(&mut *f).transpose()?,
            q_a_proj: self.q_a_proj.as_ref().map(&mut *f).transpose()?,
            q_a_layernorm: self.q_a_layernorm.as_ref().map(&mut *f).transpose()?,
            q_b_proj: self.q_b_proj.as_ref().map(&mut *f).transpose()?,
            kv_a_proj_with_mqa: f(&self.kv_a_proj_with_mqa)?,
            kv_a_layernorm: f(&self.kv_a_layernorm)?,
            kv_b_proj: f(&self.kv_b_proj)?,
            o_proj: f(&self.o_proj)?,
        })
    }
}

impl Mla<ParamInfo> {
    /// The declarations under `prefix` (`model.layers.{i}.self_attn`) for width `d` and `heads`.
    pub(crate) fn declare(prefix: &str, d: usize, heads: usize, m: &MlaSettings) -> Mla<ParamInfo> {
        let n = |s: &str| format!("{prefix}.{s}.weight");
        let (qk, v) = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim);
        let (direct, latent) = (m.q_lora_rank == 0, m.q_lora_rank > 0);
        Mla {
            q_proj: direct.then(|| {
                matrix(
                    n("q_proj"),
                    [d, heads * qk],
                    [Some("embed"), Some("q_heads")],
                )
            }),
            q_a_proj: latent.then(|| {
                matrix(
                    n("q_a_proj"),
                    [d, m.q_lora_rank],
                    [Some("embed"), Some("q_lora")],
                )
            }),
            q_a_layernorm: latent
                .then(|| norm_scale(n("q_a_layernorm"), m.q_lora_rank, Some("q_lora"))),
            q_b_proj: latent.then(|| {
                matrix(
                    n("q_b_proj"),
                    [m.q_lora_rank, heads * qk],
                    [Some("q_lora"), Some("q_heads")],
                )
            }),
            kv_a_proj_with_mqa: matrix(
                n("kv_a_proj_with_mqa"),
                [d, m.kv_lora_rank + m.qk_rope_head_dim],
                [Some("embed"), Some("kv_lora")],
            ),
            kv_a_layernorm: norm_scale(n("kv_a_layernorm"), m.kv_lora_rank, Some("kv_lora")),
            kv_b_proj: matrix(
                n("kv_b_proj"),
                [m.kv_lora_rank, heads * (m.qk_nope_head_dim + v)],
                [Some("kv_lora"), Some("q_heads")],
            ),
            o_proj: matrix(
                n("o_proj"),
                [heads * v, d],
                [Some("q_heads"), Some("embed")],
            ),
        }
    }
}

/// MLA hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaDims {
    /// Heads.
    pub heads: usize,
    /// Query latent width (`q_lora_rank`).
    pub q_lora_rank: usize,
    /// Key/value latent width (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Position-free query/key width per head.
    pub qk_nope_head_dim: usize,
    /// RoPE query/key width per head.
    pub qk_rope_head_dim: usize,
    /// Value width per head.
    pub v_head_dim: usize,
    /// RMSNorm epsilon of the latent norms.
    pub eps: f32,
    /// The RoPE variant (DeepSeek: YaRN, interleaved).
    pub rope: Rope,
}

/// How an MLA block makes its queries (`[in, out]` matrices; HF names in brackets).
pub enum MlaQueries<'a> {
    /// Through a latent with its own RMSNorm (DeepSeek-V2/V3).
    Latent {
        /// `[d, q_lora]` (`q_a_proj`).
        wq_a: &'a Array,
        /// `[q_lora]` (`q_a_layernorm`).
        q_norm: &'a Array,
        /// `[q_lora, heads·(nope+rope)]` (`q_b_proj`).
        wq_b: &'a Array,
    },
    /// In one projection `[d, heads·(nope+rope)]` (`q_proj`; `q_lora_rank: null`).
    Direct(&'a Array),
}

/// The weights of one MLA block (`[in, out]` matrices; HF DeepSeek names in brackets).
pub struct MlaWeights<'a> {
    /// The queries' projections.
    pub queries: MlaQueries<'a>,
    /// `[d, kv_lora + rope]` (`kv_a_proj_with_mqa`).
    pub wkv_a: &'a Array,
    /// `[kv_lora]` (`kv_a_layernorm`).
    pub kv_norm: &'a Array,
    /// `[kv_lora, heads·(nope+v)]` (`kv_b_proj`).
    pub wkv_b: &'a Array,
    /// `[heads·v, d]` (`o_proj`).
    pub out: &'a Array,
}

/// Causal MLA self-attention on `x: [B, T, d]`. The softmax scale is
/// `(nope+rope)^−½ · rope.attention_scale_factor()` (YaRN's `mscale²`). With a `cache`, `x`
/// holds the positions after the cached ones (see [`crate::nn::attention`]); the cache keeps the
/// per-head keys and values, not the latent (simple, and exact; more memory than DeepSeek's
/// absorbed form).
///
/// # Errors
/// Any type error of the ops.
pub fn mla_attention(
    cx: &mut Ctx<'_>,
    x: &Array,
    w: &MlaWeights<'_>,
    dims: MlaDims,
    cache: Option<&mut KvSlot>,
    docs: Option<&Positions>,
) -> Result<Array, SpmdError> {
    let (b, t) = (x.ty().shape()[0], x.ty().shape()[1]);
    let h = dims.heads;
    let (nope, rope, vd) = (
        dims.qk_nope_head_dim,
        dims.qk_rope_head_dim,
        dims.v_head_dim,
    );
    // 1. queries, through their latent or not: [B, T, H, nope | rope]
    let q = match w.queries {
        MlaQueries::Latent { wq_a, q_norm, wq_b } => {
            let cq = linear(cx, x, wq_a)?;
            let cq = rms_norm(cx, &cq, q_norm, dims.eps)?;
            linear_named(cx, &cq, wq_b, remat::QUERY_PROJ)?
        }
        MlaQueries::Direct(wq) => linear_named(cx, x, wq, remat::QUERY_PROJ)?,
    };
    let q = cx.reshape(&q, &[b, t, h, nope + rope], None)?;
    let start = cache.as_ref().map_or(0, |c| c.len());
    // RoPE on each head's tail only: the bits of slicing `rope` off, rotating it and
    // concatenating it back, in one pass.
    let q = match docs {
        Some(d) => cx.rope_tail_at(&q, &dims.rope, &d.in_document, nope)?,
        None => cx.rope_tail_from(&q, &dims.rope, start, nope)?,
    };
    // 2. keys/values through theirs; the RoPE key is one vector for every head
    let ckv = linear(cx, x, w.wkv_a)?;
    let c = cx.slice(&ckv, 2, 0, dims.kv_lora_rank)?;
    let k_rope = cx.slice(&ckv, 2, dims.kv_lora_rank, dims.kv_lora_rank + rope)?;
    let k_rope = cx.reshape(&k_rope, &[b, t, 1, rope], None)?;
    let k_rope = match docs {
        Some(d) => cx.rope_tail_at(&k_rope, &dims.rope, &d.in_document, 0)?,
        None => cx.rope_from(&k_rope, &dims.rope, start)?,
    };
    let k_rope = cx.reshape(&k_rope, &[b, t, rope], None)?;
    let k_rope = cx.broadcast_in_dim(&k_rope, &[b, t, h, rope], &[0, 1, 3], None)?;
    let c = rms_norm(cx, &c, w.kv_norm, dims.eps)?;
    let kv = linear_named(cx, &c, w.wkv_b, remat::KEY_PROJ)?;
    let kv = cx.checkpoint_name(&kv, remat::VALUE_PROJ);
    let kv = cx.reshape(&kv, &[b, t, h, nope + vd], None)?;
    let k_nope = cx.slice(&kv, 3, 0, nope)?;
    let v = cx.slice(&kv, 3, nope, nope + vd)?;
    let k = cx.concat(&[&k_nope, &k_rope], 3)?;
    let (k, v) = match cache {
        Some(slot) => slot.extend(cx, &k, &v)?,
        None => (k, v),
    };
    // 3. causal attention with DeepSeek's scale, then the output projection
    let scale = dims.rope.attention_scale_factor() / ((nope + rope) as f32).sqrt();
    // Training (no cached positions): the tiled op (the composition's values within rounding).
    let (gk, gv) = keys_for_queries(cx, &k, &v, docs)?;
    let out = if k.shape()[1] == t && cx.attention_fits(&q, &gk, &gv) {
        let spec = AttentionSpec::causal(scale);
        let out = cx.attention(&q, &gk, &gv, &spec, query_places(docs))?;
        cx.reshape(&out, &[b, t, h * vd], None)?
    } else if docs.is_some() {
        return Err(crate::nn::packed_needs_tiled(&q));
    } else {
        causal_attention(cx, &q, &k, &v, scale)?
    };
    linear_named(cx, &out, w.out, remat::OUT_PROJ)
}
