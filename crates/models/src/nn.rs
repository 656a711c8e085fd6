//! Layers shared by the model families: linear maps (with an optional bias), RMSNorm (`w` or
//! `1 + w`), GQA attention (QK-norm per head or over all heads, biases, scale, soft-cap and
//! sliding window as the family has them) with RoPE, the gated MLP (SwiGLU or GeGLU). Each is a
//! function of `spmd` arrays; shardings come from the operands
//! ([`linear`] keeps the activation's layout and settles what the weight's split requires).

use ferrotext_sharding::{DType, DimSpec, PartitionSpec};
use ferrotext_spmd::{Array, AttentionSpec, Ctx, QueryPlaces, SpmdError, UnaryOp};
use ferrotext_tensor::{DotDims, GluActivation, Rope, Tensor};

use crate::kv_cache::KvSlot;
use crate::positions::{Balanced, Positions};
use crate::remat;

/// How activations are laid out: the mesh axes the batch dim and the sequence dim are split
/// over (the sequence's under context parallelism).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActivationLayout {
    /// Mesh axes of the batch dim, major first (empty: replicated).
    pub batch: Vec<String>,
    /// Mesh axes of the sequence dim (empty: whole on every device).
    pub length: Vec<String>,
}

impl ActivationLayout {
    /// The layout of activations computed from token ids `[B, T]` laid out as `ids`.
    pub fn of(ids: &ferrotext_spmd::Ids) -> ActivationLayout {
        let spec = ids.ty().sharding().spec();
        ActivationLayout {
            batch: spec.dim(0).axis_names().to_vec(),
            length: spec.dim(1).axis_names().to_vec(),
        }
    }

    /// `[batch, length, None, ...]` for an activation of `rank ≥ 2` dims.
    pub fn spec(&self, rank: usize) -> PartitionSpec {
        let mut dims = vec![
            DimSpec::axes(self.batch.clone()),
            DimSpec::axes(self.length.clone()),
        ];
        dims.resize(rank, DimSpec::Replicated);
        PartitionSpec::new(dims)
    }

    /// Every axis the tokens are split over (batch and sequence): what a weight's gradient is
    /// a partial sum over.
    pub fn token_axes(&self) -> Vec<String> {
        self.batch.iter().chain(&self.length).cloned().collect()
    }
}

/// `x` (`[B, T, ..]`) with its sequence whole on every device, reduced over the axes it was
/// split on (context parallelism: every device's queries read every key; the gather's
/// transpose reduce-scatters the keys' cotangent, each device's partial sum). `x` itself when
/// its sequence is whole.
///
/// # Collectives
/// An all-gather over the sequence's axes forward; a reduce-scatter backward.
pub fn gather_sequence(cx: &mut Ctx<'_>, x: &Array) -> Result<Array, SpmdError> {
    let spec = x.ty().sharding().spec();
    let axes = spec.dim(1).axis_names().to_vec();
    if axes.is_empty() {
        return Ok(x.clone());
    }
    let whole = spec
        .with_partitions((0..x.ty().rank()).map(|d| match d {
            1 => DimSpec::Replicated,
            d => spec.dim(d).clone(),
        }))?
        .with_reduced(axes)?;
    cx.reshard(x, &whole)
}

/// `x · w` over the last dim of `x` and the first of `w`. The output keeps `x`'s layout on its
/// leading dims and `w`'s on the last, minus any axis `x` already uses: under FSDP (`w` split on
/// an axis the batch is split on too) that gathers `w`; under tensor parallelism with `w` split
/// on its *input* dim (both sides split on the contraction) it reduces the partial sums here.
///
/// The weight (f32 master) is cast to `x`'s dtype at use, so a bf16 activation meets a bf16
/// weight, and the weight's cotangent comes back f32 (docs/design.md §10).
///
/// # Errors
/// The dot_general type errors.
pub fn linear(cx: &mut Ctx<'_>, x: &Array, w: &Array) -> Result<Array, SpmdError> {
    let out = linear_out_spec(x, w);
    let w = cx.cast(w, x.ty().dtype())?;
    cx.matmul(x, &w, Some(&out))
}

/// [`linear`] with its result in `dtype` (f32 logits and router scores from bf16 activations,
/// unrounded).
///
/// # Errors
/// The dot_general type errors.
pub fn linear_to(cx: &mut Ctx<'_>, x: &Array, w: &Array, dtype: DType) -> Result<Array, SpmdError> {
    let out = linear_out_spec(x, w);
    let w = cx.cast(w, x.ty().dtype())?;
    let dims = DotDims::matmul(x.ty().rank());
    cx.dot_general_preferred(x, &w, &dims, Some(&out), dtype)
}

/// An LM head's f32 logits `[B, T, vocab]` of the normed hidden states `x` `[B, T, d]`: `x·head`
/// for a head of its own (`[d, vocab]`), or `x·tableᵀ` when `tied` (`head` is then the
/// embedding table `[vocab, d]`, cast to `x`'s dtype first). Never rounded. The main model's
/// head and the multi-token-prediction module's (which shares it) both run this.
///
/// # Errors
/// The dot_general type errors.
pub fn head_logits(
    cx: &mut Ctx<'_>,
    x: &Array,
    head: &Array,
    tied: bool,
) -> Result<Array, SpmdError> {
    if !tied {
        return linear_to(cx, x, head, DType::F32);
    }
    let dims = DotDims {
        lhs_contracting: vec![2],
        rhs_contracting: vec![1],
        ..Default::default()
    };
    let table = cx.cast(head, x.ty().dtype())?;
    cx.dot_general_preferred(x, &table, &dims, None, DType::F32)
}

/// [`linear`]'s output layout: `x`'s leading dims, `w`'s last minus the axes `x` uses.
fn linear_out_spec(x: &Array, w: &Array) -> PartitionSpec {
    let xs = x.ty().sharding().spec();
    let rank = x.ty().rank();
    let used: Vec<&String> = (0..rank - 1).flat_map(|d| xs.dim(d).axis_names()).collect();
    let out_last: Vec<String> = w
        .ty()
        .sharding()
        .spec()
        .dim(1)
        .axis_names()
        .iter()
        .filter(|a| !used.contains(a))
        .cloned()
        .collect();
    let mut dims: Vec<DimSpec> = (0..rank - 1).map(|d| xs.dim(d).clone()).collect();
    dims.push(DimSpec::axes(out_last));
    PartitionSpec::new(dims)
}

/// [`linear`], its product named `name` for the rematerialization policies
/// ([`Ctx::checkpoint_name`]: a policy that keeps `name` saves it instead of recomputing it).
///
/// # Errors
/// The dot_general type errors.
pub fn linear_named(
    cx: &mut Ctx<'_>,
    x: &Array,
    w: &Array,
    name: &'static str,
) -> Result<Array, SpmdError> {
    let y = linear(cx, x, w)?;
    Ok(cx.checkpoint_name(&y, name))
}

/// [`linear_named`], plus `bias` (`[out]`) on every row when given. The bias is laid out like the
/// product's last dim (its tags kept) and added with broadcasting, so its gradient is the sum
/// over the leading dims of the product's cotangent: left unreduced over the batch axes when
/// the bias enters tagged reduced (deferral), all-reduced over them otherwise.
///
/// # Errors
/// The dot_general, broadcast and add type errors.
pub fn linear_bias(
    cx: &mut Ctx<'_>,
    x: &Array,
    w: &Array,
    bias: Option<&Array>,
    name: &'static str,
) -> Result<Array, SpmdError> {
    let y = linear_named(cx, x, w, name)?;
    let Some(b) = bias else {
        return Ok(y);
    };
    let rank = y.ty().rank();
    let want = y.ty().sharding().spec().dim(rank - 1).clone();
    let b = cx.cast(b, y.ty().dtype())?;
    let bspec = b.ty().sharding().spec();
    let b = if bspec.dim(0) == &want {
        b.clone()
    } else {
        let aligned = bspec.with_partitions([want])?;
        cx.reshard(&b, &aligned)?
    };
    // `[n]` broadcasts against `[.., n]` (NumPy rules): a bias tagged reduced over the batch
    // axes is sliced locally, so its cotangent (the sum over the leading dims) comes back
    // unreduced over them; an untagged one is all-reduced in the transpose.
    cx.add(&y, &b)
}

/// RMSNorm of `x` over its last dim with `scale`. A scale stored split (MaxText's `norm → tensor`
/// rule) is first laid out like the activation's last dim, keeping its tags (MaxText's
/// `_align_scale_with_normalized_axis`): an all-gather per use under tensor parallelism.
///
/// # Errors
/// The rms_norm type errors.
pub fn rms_norm(cx: &mut Ctx<'_>, x: &Array, scale: &Array, eps: f32) -> Result<Array, SpmdError> {
    let want = x.ty().sharding().spec().dim(x.ty().rank() - 1).clone();
    let sspec = scale.ty().sharding().spec();
    if sspec.dim(0) == &want {
        return cx.rms_norm(x, scale, eps);
    }
    let aligned = sspec.with_partitions([want])?;
    let scale = cx.reshard(scale, &aligned)?;
    cx.rms_norm(x, &scale, eps)
}

/// [`rms_norm`] with the scale applied as `1 + scale` when `plus_one` (Gemma's norms, whose
/// weights are stored so): the shift is an op on the `[n]` scale, so the scale's gradient is the
/// same as [`rms_norm`]'s.
///
/// # Errors
/// The rms_norm type errors.
pub fn norm(
    cx: &mut Ctx<'_>,
    x: &Array,
    scale: &Array,
    eps: f32,
    plus_one: bool,
) -> Result<Array, SpmdError> {
    if !plus_one {
        return rms_norm(cx, x, scale, eps);
    }
    let shifted = cx.unary(UnaryOp::Shift(1.0), scale)?;
    rms_norm(cx, x, &shifted, eps)
}

/// Attention hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// The RoPE variant (θ and frequency scaling; rotate-half).
    pub rope: Rope,
    /// RMSNorm epsilon of the QK-norm.
    pub eps: f32,
    /// The scale on `q·k`, the logits' soft-cap and the sliding window.
    pub spec: AttentionSpec,
    /// The QK-norm's scales apply as `1 + w` (Gemma 3).
    pub norm_plus_one: bool,
    /// The QK-norm is over all heads at once, before they are split (OLMo 2).
    pub qk_norm_all_heads: bool,
}

/// The weights of one GQA attention block (`[in, out]` matrices; biases and QK-norm scales as
/// the family has them).
pub struct AttentionWeights<'a> {
    /// `[d, heads·head_dim]`.
    pub q_proj: &'a Array,
    /// `[heads·head_dim]` (Qwen2).
    pub q_bias: Option<&'a Array>,
    /// `[d, kv_heads·head_dim]`.
    pub k_proj: &'a Array,
    /// `[kv_heads·head_dim]` (Qwen2).
    pub k_bias: Option<&'a Array>,
    /// `[d, kv_heads·head_dim]`.
    pub v_proj: &'a Array,
    /// `[kv_heads·head_dim]` (Qwen2).
    pub v_bias: Option<&'a Array>,
    /// `[heads·head_dim, d]`.
    pub o_proj: &'a Array,
    /// `[d]` (`attention_bias`).
    pub o_bias: Option<&'a Array>,
    /// `[head_dim]` RMSNorm scale of the queries (QK-norm, Qwen3).
    pub q_norm: Option<&'a Array>,
    /// `[head_dim]` RMSNorm scale of the keys.
    pub k_norm: Option<&'a Array>,
}

/// Causal GQA self-attention on `x: [B, T, d]`: projections (with their biases when given),
/// QK-norm (per-head RMSNorm before RoPE) when given, rotate-half RoPE.
/// With a `cache`, `x` holds the `T` positions after the cached ones: they attend to the cached
/// keys and values too, and join the cache.
///
/// # Errors
/// Any type error of the ops (e.g. heads not divisible by the tensor axis).
pub fn attention(
    cx: &mut Ctx<'_>,
    x: &Array,
    w: &AttentionWeights<'_>,
    dims: AttentionDims,
    cache: Option<&mut KvSlot>,
    docs: Option<&Positions>,
) -> Result<Array, SpmdError> {
    let (b, t) = (x.shape()[0], x.shape()[1]);
    let (h, kv, hd) = (dims.heads, dims.kv_heads, dims.head_dim);
    // 1. projections, q [B, T, H·hd], k/v [B, T, KV·hd] (heads split over `tensor` if any);
    //    a QK-norm over all heads (OLMo 2) runs here, on whole rows
    let q = linear_bias(cx, x, w.q_proj, w.q_bias, remat::QUERY_PROJ)?;
    let k = linear_bias(cx, x, w.k_proj, w.k_bias, remat::KEY_PROJ)?;
    let v = linear_bias(cx, x, w.v_proj, w.v_bias, remat::VALUE_PROJ)?;
    let all_heads = |cx: &mut Ctx<'_>, y: Array, scale: Option<&Array>| match scale {
        Some(s) if dims.qk_norm_all_heads => whole_rows_norm(cx, &y, s, dims.eps),
        _ => Ok(y),
    };
    let q = all_heads(cx, q, w.q_norm)?;
    let k = all_heads(cx, k, w.k_norm)?;
    let q = cx.reshape(&q, &[b, t, h, hd], None)?;
    let k = cx.reshape(&k, &[b, t, kv, hd], None)?;
    let v = cx.reshape(&v, &[b, t, kv, hd], None)?;
    // 2. a per-head QK-norm (when the family has it), then RoPE (rotate-half)
    let per_head = |cx: &mut Ctx<'_>, y: Array, scale: Option<&Array>| match scale {
        Some(s) if !dims.qk_norm_all_heads => norm(cx, &y, s, dims.eps, dims.norm_plus_one),
        _ => Ok(y),
    };
    let q = per_head(cx, q, w.q_norm)?;
    let k = per_head(cx, k, w.k_norm)?;
    let start = cache.as_ref().map_or(0, |c| c.len());
    let rope = Rope {
        interleaved: false,
        ..dims.rope
    };
    let (q, k) = match docs {
        Some(d) => (
            cx.rope_tail_at(&q, &rope, &d.in_document, 0)?,
            cx.rope_tail_at(&k, &rope, &d.in_document, 0)?,
        ),
        None => (
            cx.rope_from(&q, &rope, start)?,
            cx.rope_from(&k, &rope, start)?,
        ),
    };
    // 3. the cached positions' keys and values before these (when decoding): [B, S, KV, hd]
    let (k, v) = match cache {
        Some(slot) => slot.extend(cx, &k, &v)?,
        None => (k, v),
    };
    let s = k.shape()[1];
    // 4–5. Training (no cached positions): the tiled op reads each kv head for its group of
    // query heads in place and keeps no T×T scores; the composition below computes the same
    // within rounding (it is what a key/value cache decodes with). Under context parallelism
    // the queries stay split and the keys and values are gathered.
    let (gk, gv) = keys_for_queries(cx, &k, &v, docs)?;
    if s == t && cx.attention_fits(&q, &gk, &gv) {
        let out = cx.attention(&q, &gk, &gv, &dims.spec, query_places(docs))?;
        let out = cx.reshape(&out, &[b, t, h * hd], None)?;
        return linear_bias(cx, &out, w.o_proj, w.o_bias, remat::OUT_PROJ);
    }
    if docs.is_some() {
        return Err(packed_needs_tiled(&q));
    }
    // 4. GQA: each kv head serves heads/kv query heads
    let (k, v) = if kv == h {
        (k, v)
    } else {
        let g = h / kv;
        let k5 = cx.broadcast_in_dim(&k, &[b, s, kv, g, hd], &[0, 1, 2, 4], None)?;
        let v5 = cx.broadcast_in_dim(&v, &[b, s, kv, g, hd], &[0, 1, 2, 4], None)?;
        (
            cx.reshape(&k5, &[b, s, h, hd], None)?,
            cx.reshape(&v5, &[b, s, h, hd], None)?,
        )
    };
    // 5. causal attention (windowed and soft-capped as the spec says), then o_proj
    let out = spec_attention(cx, &q, &k, &v, &dims.spec)?;
    linear_bias(cx, &out, w.o_proj, w.o_bias, remat::OUT_PROJ)
}

/// The keys (or values) every query of this device reads: gathered over the sequence's axes
/// ([`gather_sequence`]) and, after a load-balanced split ([`Balanced`]), put back in the rows'
/// order (slices and a concatenation: their transposes reorder the cotangents back).
///
/// # Errors
/// Any type error of the ops.
pub fn keys_for_queries(
    cx: &mut Ctx<'_>,
    k: &Array,
    v: &Array,
    places: Option<&Positions>,
) -> Result<(Array, Array), SpmdError> {
    let (k, v) = (gather_sequence(cx, k)?, gather_sequence(cx, v)?);
    let Some(b) = places.and_then(|p| p.balanced.as_ref()) else {
        return Ok((k, v));
    };
    let in_order = |cx: &mut Ctx<'_>, x: &Array| -> Result<Array, SpmdError> {
        let size = x.shape()[1] / b.chunks.max(1);
        let parts = (0..b.chunks)
            .map(|j| {
                let at = Balanced::slot_of(j, b.chunks) * size;
                cx.slice(x, 1, at, at + size)
            })
            .collect::<Result<Vec<_>, _>>()?;
        cx.concat(&parts.iter().collect::<Vec<_>>(), 1)
    };
    Ok((in_order(cx, &k)?, in_order(cx, &v)?))
}

/// Where this device's queries sit among the keys and in their documents (see
/// [`ferrotext_spmd::QueryPlaces`]); nothing given when the tokens are simply in order.
pub fn query_places(places: Option<&Positions>) -> QueryPlaces<'_> {
    QueryPlaces {
        index: places.and_then(|p| p.balanced.as_ref()).map(|b| &b.index),
        in_document: places.map(|p| &p.in_document),
    }
}

/// Packed documents need the tiled attention op (the composition has no document mask).
pub(crate) fn packed_needs_tiled(q: &Array) -> SpmdError {
    SpmdError::WeightShape {
        op: "attention",
        name: "packed documents",
        expected: "q, k and v the tiled attention takes (batch and heads split alike, the \
                   sequence whole, no key/value cache)"
            .into(),
        got: q.ty().to_string(),
    }
}

/// RMSNorm of `y` (`[B, T, n]`) over whole rows with `scale` (`[n]`): the rows gathered first
/// when their last dim is split (under tensor parallelism the statistic needs every head), laid
/// out again as they came.
fn whole_rows_norm(
    cx: &mut Ctx<'_>,
    y: &Array,
    scale: &Array,
    eps: f32,
) -> Result<Array, SpmdError> {
    let spec = y.ty().sharding().spec().clone();
    let last = y.ty().rank() - 1;
    if spec.dim(last).axis_names().is_empty() {
        return rms_norm(cx, y, scale, eps);
    }
    let mut dims: Vec<DimSpec> = (0..last).map(|d| spec.dim(d).clone()).collect();
    dims.push(DimSpec::Replicated);
    let whole = cx.reshard(y, &spec.with_partitions(dims)?)?;
    let normed = rms_norm(cx, &whole, scale, eps)?;
    cx.reshard(&normed, &spec)
}

/// The scores' product: `q [B, T, H, qk]` · `k [B, S, H, qk]` → `[B, H, T, S]`.
fn qk_dims() -> DotDims {
    DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![3],
        lhs_batch: vec![0, 2],
        rhs_batch: vec![0, 2],
    }
}

/// The heads' outputs: `probs [B, H, T, S]` · `v [B, S, H, vd]` → `[B, T, H·vd]` (heads
/// concatenated, ready for the output projection).
fn heads_times_v(cx: &mut Ctx<'_>, probs: &Array, v: &Array) -> Result<Array, SpmdError> {
    let (b, t, h, vd) = (
        probs.shape()[0],
        probs.shape()[2],
        v.shape()[2],
        v.shape()[3],
    );
    // out [B, H, T, vd] = probs·v → [B, T, H·vd]
    let pv = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![1],
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
    };
    let out = cx.dot_general(probs, v, &pv, None)?;
    let out = cx.transpose(&out, &[0, 2, 1, 3])?;
    cx.reshape(&out, &[b, t, h * vd], None)
}

/// [`causal_attention`] as `spec` says: its scale, and when set its soft-cap and sliding
/// window, composed from products, a mask and a softmax (the key/value cache's path; the tiled
/// op computes the same in training).
///
/// # Errors
/// Any type error of the ops.
pub fn spec_attention(
    cx: &mut Ctx<'_>,
    q: &Array,
    k: &Array,
    v: &Array,
    spec: &AttentionSpec,
) -> Result<Array, SpmdError> {
    if spec.softcap.is_none() && spec.window.is_none() {
        return causal_attention(cx, q, k, v, spec.scale);
    }
    let t = q.shape()[1];
    let s = k.shape()[1];
    // scores [B, H, T, S] in f32, scaled, soft-capped
    let scores = cx.dot_general_preferred(q, k, &qk_dims(), None, DType::F32)?;
    let mut logits = cx.scale(&scores, spec.scale)?;
    if let Some(cap) = spec.softcap {
        logits = cx.unary(UnaryOp::Softcap(cap), &logits)?;
    }
    // the mask: query `i` (position S − T + i) sees keys `j ≤ S − T + i` within the window
    let ty = cx.array_type(
        logits.ty().shape(),
        logits.ty().sharding().spec().without_tags(),
    )?;
    let shard = ty.shard_shape();
    let window = spec.window.unwrap_or(usize::MAX);
    let mask = Tensor::from_fn(&shard, |at| {
        let (i, j) = ((at / s) % t, at % s);
        let pos = s - t + i;
        if j <= pos && pos - j < window {
            0.0
        } else {
            f32::NEG_INFINITY
        }
    });
    let mask = cx.from_local(ty, mask)?;
    let logits = cx.add(&logits, &mask)?;
    let probs = cx.softmax(&logits)?;
    let probs = cx.cast(&probs, v.ty().dtype())?;
    heads_times_v(cx, &probs, v)
}

/// The heads' causal attention: `q` `[B, T, H, qk]`, `k` `[B, S, H, qk]` and `v`
/// `[B, S, H, vd]` give `softmax(scale · q·kᵀ, causal) · v` as `[B, T, H·vd]` (heads
/// concatenated, ready for the output projection). The queries are the last `T` of the `S ≥ T`
/// key positions (`S = T` in training; more under a key/value cache).
///
/// # Errors
/// Any type error of the ops.
pub fn causal_attention(
    cx: &mut Ctx<'_>,
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
) -> Result<Array, SpmdError> {
    // scores [B, H, T, S]
    let scores = cx.dot_general(q, k, &qk_dims(), None)?;
    let probs = cx.causal_softmax(&scores, scale)?;
    heads_times_v(cx, &probs, v)
}

/// The SwiGLU MLP: `(silu(x·w_gate) ⊙ (x·w_up))·w_down`.
///
/// # Errors
/// Any type error of the ops.
pub fn swiglu(
    cx: &mut Ctx<'_>,
    x: &Array,
    gate: &Array,
    up: &Array,
    down: &Array,
) -> Result<Array, SpmdError> {
    let g = linear_named(cx, x, gate, remat::MLPWI_0)?;
    let u = linear_named(cx, x, up, remat::MLPWI_1)?;
    let a = cx.swiglu(&g, &u)?;
    linear_named(cx, &a, down, remat::MLPWO)
}

/// The weights of a gated MLP (`[in, out]` matrices, biases when the family has them).
pub struct GluWeights<'a> {
    /// `[d, f]` and its `[f]` bias.
    pub gate: (&'a Array, Option<&'a Array>),
    /// `[d, f]` and its `[f]` bias.
    pub up: (&'a Array, Option<&'a Array>),
    /// `[f, d]` and its `[d]` bias.
    pub down: (&'a Array, Option<&'a Array>),
}

/// The gated MLP `(act(x·gate + b) ⊙ (x·up + b))·down + b`: SwiGLU (`gelu` false) or GeGLU
/// with the tanh GELU (`gelu` true), the activation and the product one fused op.
///
/// # Errors
/// Any type error of the ops.
pub fn glu(
    cx: &mut Ctx<'_>,
    x: &Array,
    w: &GluWeights<'_>,
    gelu: bool,
) -> Result<Array, SpmdError> {
    let g = linear_bias(cx, x, w.gate.0, w.gate.1, remat::MLPWI_0)?;
    let u = linear_bias(cx, x, w.up.0, w.up.1, remat::MLPWI_1)?;
    let act = if gelu {
        GluActivation::GeluTanh
    } else {
        GluActivation::Silu
    };
    let a = cx.glu(&g, &u, act)?;
    linear_bias(cx, &a, w.down.0, w.down.1, remat::MLPWO)
}

/// `w` with every partition removed but its tags kept (an all-gather when it was split).
pub(crate) fn unsplit(cx: &mut Ctx<'_>, w: &Array) -> Result<Array, SpmdError> {
    let spec = w.ty().sharding().spec();
    if spec.partitions().iter().all(|p| p.is_replicated()) {
        return Ok(w.clone());
    }
    let target = PartitionSpec::replicated().with_reduced_set(spec.reduced().clone())?;
    cx.reshard(w, &target)
}
