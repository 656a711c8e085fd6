//! The forward pass of one layer on bound weights (`DecoderLayer<&Array>`): attention (GQA or
//! MLA), the dense MLP or MoE block, the residuals; and the embedding table's layout helpers.
//!
//! Invariants: parameters arrive typed by the caller and are never re-tagged here except by
//! [`reduced_over`] (a free cast whose transpose is the one all-reduce of a tied table's
//! gradient); a MoE layer adds its load-balance loss to `aux` in layer order, and pushes this
//! device's expert loads to `loads` in layer order; a router selection bias is read as data
//! (replicated), never through an op, so no gradient reaches it.

use ferrotext_spmd::{Array, Ctx, SpmdError};

use ferrotext_spmd::AttentionSpec;

use super::config::{Config, MlpActivation, NormPlacement};
use super::weights::{Attention, DecoderLayer, DenseMlp, Gqa, Mlp, SparseMoe};
use crate::deepseek::{mla_attention, Mla, MlaDims, MlaQueries, MlaWeights};
use crate::kv_cache::KvSlot;
use crate::moe::{self, MoeOptions, MoeWeights};
use crate::nn::{self, AttentionDims, AttentionWeights};
use crate::positions::Positions;

impl DecoderLayer<&Array> {
    /// Layer `i`: `x + attn(norm(x))`, then `+ mlp(norm(·))`, each norm where
    /// [`NormPlacement`](super::NormPlacement) puts it (a missing one is the identity); a MoE
    /// layer's load-balance loss is added to `aux`, its expert loads pushed to `loads`.
    /// `docs`: the tokens are packed documents.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        cx: &mut Ctx<'_>,
        x: &Array,
        (c, i): (&Config, usize),
        aux: &mut Option<Array>,
        loads: &mut Vec<Vec<f32>>,
        cache: Option<&mut KvSlot>,
        docs: Option<&Positions>,
    ) -> Result<Array, SpmdError> {
        let (eps, one) = (c.normalization_layer_epsilon, c.norm_plus_one);
        let normed = |cx: &mut Ctx<'_>, y: &Array, w: Option<&Array>| match w {
            Some(w) => nn::norm(cx, y, w, eps, one),
            None => Ok(y.clone()),
        };
        let pre = c.norm_placement == NormPlacement::Pre;
        // 1. h = input_layernorm(x): [B@batch, T, d]
        let h = normed(cx, x, self.input_layernorm)?;
        // 2. x = x + post_norm(self_attn(h)): heads split over `tensor` inside, [B@batch, T, d]
        let a = match &self.self_attn {
            Attention::Gqa(g) => g.forward(cx, &h, (c, i), cache, docs)?,
            Attention::Mla(m) => m.forward(cx, &h, c, cache, docs)?,
        };
        let a = normed(cx, &a, (!pre).then_some(self.post_attention_layernorm))?;
        let x = cx.add(x, &a)?;
        // 3. h = the norm before the MLP (Llama's is named post_attention_layernorm)
        let before_mlp = if pre {
            Some(self.post_attention_layernorm)
        } else {
            self.pre_feedforward_layernorm
        };
        let h = normed(cx, &x, before_mlp)?;
        // 4. x = x + post_norm(mlp(h)): a gated MLP, or the MoE block (experts split over
        //    `expert` inside)
        let m = match &self.mlp {
            Mlp::Dense(m) => m.forward(cx, &h, c)?,
            Mlp::Moe(m) => m.forward(cx, &h, c, aux, loads)?,
        };
        let m = normed(cx, &m, self.post_feedforward_layernorm)?;
        cx.add(&x, &m)
    }
}

impl DenseMlp<&Array> {
    /// The gated MLP of `h` (SwiGLU or GeGLU as `c` says, biases when declared).
    fn forward(&self, cx: &mut Ctx<'_>, h: &Array, c: &Config) -> Result<Array, SpmdError> {
        let w = nn::GluWeights {
            gate: (self.gate_proj, self.gate_bias),
            up: (self.up_proj, self.up_bias),
            down: (self.down_proj, self.down_bias),
        };
        nn::glu(cx, h, &w, c.mlp_activation == MlpActivation::GeluTanh)
    }
}

impl Gqa<&Array> {
    /// Layer `i`'s GQA self-attention of `h` (its window and RoPE are the layer's).
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        h: &Array,
        (c, i): (&Config, usize),
        cache: Option<&mut KvSlot>,
        docs: Option<&Positions>,
    ) -> Result<Array, SpmdError> {
        let w = AttentionWeights {
            q_proj: self.q_proj,
            q_bias: self.q_bias,
            k_proj: self.k_proj,
            k_bias: self.k_bias,
            v_proj: self.v_proj,
            v_bias: self.v_bias,
            o_proj: self.o_proj,
            o_bias: self.o_bias,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
        };
        let dims = AttentionDims {
            heads: c.base_num_query_heads,
            kv_heads: c.base_num_kv_heads,
            head_dim: c.head_dim,
            rope: c.layer_rope(i),
            eps: c.normalization_layer_epsilon,
            spec: AttentionSpec {
                scale: c.attention_scale(c.head_dim),
                softcap: c.attn_logit_softcapping,
                window: c.window_of(i),
            },
            norm_plus_one: c.norm_plus_one,
            qk_norm_all_heads: c.qk_norm_all_heads,
        };
        nn::attention(cx, h, &w, dims, cache, docs)
    }
}

impl Mla<&Array> {
    /// MLA self-attention of `h: [B@batch, T, d]` under `c`'s dims (see [`mla_attention`]).
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        h: &Array,
        c: &Config,
        cache: Option<&mut KvSlot>,
        docs: Option<&Positions>,
    ) -> Result<Array, SpmdError> {
        let m = c.mla.ok_or(SpmdError::MissingSettings {
            op: "mla",
            block: "MLA",
        })?;
        let queries = match (
            self.q_proj,
            self.q_a_proj,
            self.q_a_layernorm,
            self.q_b_proj,
        ) {
            (Some(wq), ..) => MlaQueries::Direct(wq),
            (None, Some(wq_a), Some(q_norm), Some(wq_b)) => {
                MlaQueries::Latent { wq_a, q_norm, wq_b }
            }
            _ => {
                return Err(SpmdError::MissingSettings {
                    op: "mla",
                    block: "query projections",
                })
            }
        };
        let w = MlaWeights {
            queries,
            wkv_a: self.kv_a_proj_with_mqa,
            kv_norm: self.kv_a_layernorm,
            wkv_b: self.kv_b_proj,
            out: self.o_proj,
        };
        let dims = MlaDims {
            heads: c.base_num_query_heads,
            q_lora_rank: m.q_lora_rank,
            kv_lora_rank: m.kv_lora_rank,
            qk_nope_head_dim: m.qk_nope_head_dim,
            qk_rope_head_dim: m.qk_rope_head_dim,
            v_head_dim: m.v_head_dim,
            eps: m.latent_norm_eps,
            rope: c.rope(),
        };
        mla_attention(cx, h, &w, dims, cache, docs)
    }
}

impl SparseMoe<&Array> {
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        h: &Array,
        c: &Config,
        aux: &mut Option<Array>,
        loads: &mut Vec<Vec<f32>>,
    ) -> Result<Array, SpmdError> {
        let settings = c.moe.as_ref().ok_or(SpmdError::MissingSettings {
            op: "moe",
            block: "MoE",
        })?;
        let weights = MoeWeights {
            router: self.gate.clone(),
            router_bias: self
                .e_score_correction_bias
                .map(selection_bias)
                .transpose()?
                .flatten(),
            wi_0: self.experts.gate_proj.clone(),
            wi_1: self.experts.up_proj.clone(),
            wo: self.experts.down_proj.clone(),
            shared: self
                .shared_expert
                .as_ref()
                .map(|s| [s.gate_proj.clone(), s.up_proj.clone(), s.down_proj.clone()]),
            shared_gate: self.shared_expert_gate.cloned(),
        };
        let options = MoeOptions {
            withhold_tags: settings.withhold_tags,
        };
        let out = moe::moe_sparse(cx, &settings.block(), h, &weights, options)?;
        if let Some(load) = out.expert_load {
            loads.push(load);
        }
        if let Some(loss) = out.load_balance_loss {
            *aux = Some(match aux.take() {
                Some(sum) => cx.add(&sum, &loss)?,
                None => loss,
            });
        }
        Ok(out.y)
    }
}

/// The values of a router selection bias `b` (`[experts]`, replicated: every device holds all
/// of it), read as data; `None` in abstract mode, where routing is not computed.
fn selection_bias(b: &Array) -> Result<Option<Vec<f32>>, SpmdError> {
    let spec = b.ty().sharding().spec();
    if !spec.partitions().iter().all(|p| p.is_replicated()) {
        return Err(SpmdError::WeightShape {
            op: "moe",
            name: "e_score_correction_bias",
            expected: "replicated (every device routes with all of it)".into(),
            got: b.ty().to_string(),
        });
    }
    Ok(b.local().ok().map(|t| t.data().to_vec()))
}

/// `table` cast to reduced over those of `axes` it is replicated on and not yet reduced on
/// (free: reduced is physically replicated), or `table` itself when there are none.
///
/// The tied embedding is used twice, by the lookup and by the LM head, each contracting the
/// batch. A plain table would get one all-reduce of its gradient per use; reduced, each use
/// leaves its cotangent unreduced over the batch, the two are summed locally, and the cast's
/// transpose all-reduces the sum once (plain → reduced cast ↔ all-reduce, `docs/design.md` §5).
/// A table the deferral gate already tagged is left as it is, so its gradient stays unreduced
/// until the update. Only `Explicit` axes can carry the tag (R1.13), so the others are skipped.
///
/// # Collectives
/// None forward; backward, one all-reduce over the axes added (none when nothing was added).
pub(super) fn reduced_over(
    cx: &mut Ctx<'_>,
    table: &Array,
    axes: &[String],
) -> Result<Array, SpmdError> {
    let (sharding, spec) = (table.ty().sharding(), table.ty().sharding().spec());
    let partitioned: Vec<&str> = spec.partition_axes().collect();
    let add: Vec<&String> = axes
        .iter()
        .filter(|a| {
            sharding.mesh().axis(a).is_some_and(|m| {
                m.axis_type() == ferrotext_sharding::AxisType::Explicit && m.size() > 1
            })
        })
        .filter(|a| !spec.reduced().contains(*a) && !partitioned.contains(&a.as_str()))
        .collect();
    if add.is_empty() {
        return Ok(table.clone());
    }
    let target = spec.with_reduced(add.into_iter().cloned())?;
    cx.reshard(table, &target)
}
