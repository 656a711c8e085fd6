//! The weight map: [`Weights`] → [`DecoderLayer`] → [`Attention`] / [`Mlp`], one field per
//! checkpoint tensor named as HF names it, generic over `W` (`ParamInfo` for the declarations,
//! `&Array` in the forward pass), and the declarations of a [`Config`]'s weights.
//!
//! Invariants: each struct's `try_map` visits its fields in declaration order, which *is* the
//! flat parameter order ([`Decoder::params`](super::Decoder::params)), so adding or reordering a
//! field changes checkpoints; matrices are declared `[in, out]` with `HfLayout::Tensor {
//! transposed: true }`, norms and biases `[n]` untransposed.

use super::config::{Config, NormPlacement};
use crate::deepseek::Mla;
use crate::params::{bias, matrix, norm_scale, HfLayout, Init, ParamInfo};

/// The whole model's weights (HF `Qwen3ForCausalLM`: `model.{embed_tokens, layers, norm}`, then
/// `lm_head`).
#[derive(Clone, Debug, PartialEq)]
pub struct Weights<W> {
    /// `model.embed_tokens.weight` `[vocab, d]`.
    pub embed_tokens: W,
    /// `model.layers.{i}`.
    pub layers: Vec<DecoderLayer<W>>,
    /// `model.norm.weight` `[d]`.
    pub norm: W,
    /// `lm_head.weight` `[d, vocab]`; `None` when tied to the embedding (`logits_via_embedding`).
    pub lm_head: Option<W>,
    /// The multi-token-prediction module, `model.layers.{L}.*` (`L` = the layer count), present
    /// exactly when `mtp_num_layers` is 1; last in the flat order, so a model without it has the
    /// same order as before.
    pub mtp: Option<Mtp<W>>,
}

/// One decoder layer (`model.layers.{i}`).
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderLayer<W> {
    /// `input_layernorm.weight` `[d]`, before attention (absent under
    /// [`NormPlacement::Post`](super::NormPlacement::Post)).
    pub input_layernorm: Option<W>,
    /// `self_attn.*`.
    pub self_attn: Attention<W>,
    /// `post_attention_layernorm.weight` `[d]`: before the MLP under
    /// [`NormPlacement::Pre`](super::NormPlacement::Pre) (HF's name for Llama's second norm),
    /// on attention's output otherwise.
    pub post_attention_layernorm: W,
    /// `pre_feedforward_layernorm.weight` `[d]`, before the MLP (Gemma's `PrePost`).
    pub pre_feedforward_layernorm: Option<W>,
    /// `mlp.*`.
    pub mlp: Mlp<W>,
    /// `post_feedforward_layernorm.weight` `[d]`, on the MLP's output (`PrePost`, `Post`).
    pub post_feedforward_layernorm: Option<W>,
}

/// A layer's attention.
#[derive(Clone, Debug, PartialEq)]
pub enum Attention<W> {
    /// Grouped-query attention with QK-norm (Qwen3).
    Gqa(Gqa<W>),
    /// Multi-head latent attention (DeepSeek).
    Mla(Mla<W>),
}

/// GQA weights (`self_attn.*`). The biases are present exactly when `qkv_bias` is set (Qwen2),
/// the norms exactly when `qk_norm` is (Qwen3).
#[derive(Clone, Debug, PartialEq)]
pub struct Gqa<W> {
    /// `q_proj.weight` `[d, heads·head_dim]`.
    pub q_proj: W,
    /// `q_proj.bias` `[heads·head_dim]`.
    pub q_bias: Option<W>,
    /// `k_proj.weight` `[d, kv_heads·head_dim]`.
    pub k_proj: W,
    /// `k_proj.bias` `[kv_heads·head_dim]`.
    pub k_bias: Option<W>,
    /// `v_proj.weight` `[d, kv_heads·head_dim]`.
    pub v_proj: W,
    /// `v_proj.bias` `[kv_heads·head_dim]`.
    pub v_bias: Option<W>,
    /// `o_proj.weight` `[heads·head_dim, d]`.
    pub o_proj: W,
    /// `o_proj.bias` `[d]` (`attention_out_bias`).
    pub o_bias: Option<W>,
    /// `q_norm.weight` `[head_dim]` (`[heads·head_dim]` under `qk_norm_all_heads`).
    pub q_norm: Option<W>,
    /// `k_norm.weight` `[head_dim]` (`[kv_heads·head_dim]` under `qk_norm_all_heads`).
    pub k_norm: Option<W>,
}

/// A layer's feed-forward.
#[derive(Clone, Debug, PartialEq)]
pub enum Mlp<W> {
    /// A SwiGLU MLP.
    Dense(DenseMlp<W>),
    /// A mixture-of-experts block.
    Moe(SparseMoe<W>),
}

/// Gated-MLP weights: `(act(x·gate_proj) ⊙ x·up_proj)·down_proj` (SwiGLU or GeGLU), biases
/// present exactly when `mlp_bias` is set (and never on shared experts).
#[derive(Clone, Debug, PartialEq)]
pub struct DenseMlp<W> {
    /// `gate_proj.weight` `[d, f]`.
    pub gate_proj: W,
    /// `gate_proj.bias` `[f]`.
    pub gate_bias: Option<W>,
    /// `up_proj.weight` `[d, f]`.
    pub up_proj: W,
    /// `up_proj.bias` `[f]`.
    pub up_bias: Option<W>,
    /// `down_proj.weight` `[f, d]`.
    pub down_proj: W,
    /// `down_proj.bias` `[d]`.
    pub down_bias: Option<W>,
}

/// Mixture-of-experts weights (`mlp.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct SparseMoe<W> {
    /// The router, `gate.weight` `[d, experts]`.
    pub gate: W,
    /// The router's selection bias, `gate.e_score_correction_bias` `[experts]` (DeepSeek-V3,
    /// `routed_bias`): state, not a trained weight. Routing reads it as data, so its gradient
    /// is identically zero, and the trainer moves it by the aux-loss-free balancing rule.
    pub e_score_correction_bias: Option<W>,
    /// The routed experts, stacked (HF: `experts.{e}.{gate,up,down}_proj.weight`).
    pub experts: Experts<W>,
    /// The shared experts as one SwiGLU of width `shared_experts × moe_mlp_dim` (HF:
    /// `shared_expert.*` for Qwen, `shared_experts.*` for DeepSeek).
    pub shared_expert: Option<DenseMlp<W>>,
    /// `shared_expert_gate.weight` `[d, 1]`: the shared experts' output times its sigmoid
    /// (Qwen2-MoE, `shared_expert_gate`).
    pub shared_expert_gate: Option<W>,
}

/// Routed experts' weights, stacked along a leading expert dim.
#[derive(Clone, Debug, PartialEq)]
pub struct Experts<W> {
    /// `[experts, d, moe_mlp_dim]`.
    pub gate_proj: W,
    /// `[experts, d, moe_mlp_dim]`.
    pub up_proj: W,
    /// `[experts, moe_mlp_dim, d]`.
    pub down_proj: W,
}

// One `try_map` per struct: visits the weights in field order (the flat parameter order) and
// rebuilds the structure with `f`'s results.

impl<W> Weights<W> {
    /// This structure with every weight replaced by `f(weight)`, visited in the flat parameter
    /// order ([`Decoder::params`](super::Decoder::params)).
    ///
    /// # Errors
    /// The first error of `f`.
    pub fn try_map<U, E>(&self, f: &mut impl FnMut(&W) -> Result<U, E>) -> Result<Weights<U>, E> {
        Ok(Weights {
            embed_tokens: f(&self.embed_tokens)?,
            layers: self
                .layers
                .iter()
                .map(|l| l.try_map(f))
                .collect::<Result<_, _>>()?,
            norm: f(&self.norm)?,
            lm_head: self.lm_head.as_ref().map(&mut *f).transpose()?,
            mtp: self.mtp.as_ref().map(|m| m.try_map(f)).transpose()?,
        })
    }
}

impl<W> DecoderLayer<W> {
    pub(crate) fn try_map<U, E>(
        &self,
        f: &mut impl FnMut(&W) -> Result<U, E>,
    ) -> Result<DecoderLayer<U>, E> {
        Ok(DecoderLayer {
            input_layernorm: self.input_layernorm.as_ref().map(&mut *f).transpose()?,
            self_attn: match &self.self_attn {
                Attention::Gqa(a) => Attention::Gqa(Gqa {
                    q_proj: f(&a.q_proj)?,
                    q_bias: a.q_bias.as_ref().map(&mut *f).transpose()?,
                    k_proj: f(&a.k_proj)?,
                    k_bias: a.k_bias.as_ref().map(&mut *f).transpose()?,
                    v_proj: f(&a.v_proj)?,
                    v_bias: a.v_bias.as_ref().map(&mut *f).transpose()?,
                    o_proj: f(&a.o_proj)?,
                    o_bias: a.o_bias.as_ref().map(&mut *f).transpose()?,
                    q_norm: a.q_norm.as_ref().map(&mut *f).transpose()?,
                    k_norm: a.k_norm.as_ref().map(&mut *f).transpose()?,
                }),
                Attention::Mla(a) => Attention::Mla(a.try_map(f)?),
            },
            post_attention_layernorm: f(&self.post_attention_layernorm)?,
            pre_feedforward_layernorm: self
                .pre_feedforward_layernorm
                .as_ref()
                .map(&mut *f)
                .transpose()?,
            mlp: match &self.mlp {
                Mlp::Dense(m) => Mlp::Dense(m.try_map(f)?),
                Mlp::Moe(m) => Mlp::Moe(SparseMoe {
                    gate: f(&m.gate)?,
                    e_score_correction_bias: m
                        .e_score_correction_bias
                        .as_ref()
                        .map(&mut *f)
                        .transpose()?,
                    experts: Experts {
                        gate_proj: f(&m.experts.gate_proj)?,
                        up_proj: f(&m.experts.up_proj)?,
                        down_proj: f(&m.experts.down_proj)?,
                    },
                    shared_expert: m.shared_expert.as_ref().map(|s| s.try_map(f)).transpose()?,
                    shared_expert_gate: m.shared_expert_gate.as_ref().map(&mut *f).transpose()?,
                }),
            },
            post_feedforward_layernorm: self
                .post_feedforward_layernorm
                .as_ref()
                .map(&mut *f)
                .transpose()?,
        })
    }
}

impl<W> DenseMlp<W> {
    fn try_map<U, E>(&self, f: &mut impl FnMut(&W) -> Result<U, E>) -> Result<DenseMlp<U>, E> {
        Ok(DenseMlp {
            gate_proj: f(&self.gate_proj)?,
            gate_bias: self.gate_bias.as_ref().map(&mut *f).transpose()?,
            up_proj: f(&self.up_proj)?,
            up_bias: self.up_bias.as_ref().map(&mut *f).transpose()?,
            down_proj: f(&self.down_proj)?,
            down_bias: self.down_bias.as_ref().map(&mut *f).transpose()?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The declarations.

impl Gqa<ParamInfo> {
    /// Layer `i`'s GQA declarations under `prefix` (`model.layers.{i}.self_attn`).
    fn declare(c: &Config, prefix: &str) -> Gqa<ParamInfo> {
        let l = |s: &str| format!("{prefix}.{s}");
        let (d, hq, hkv) = (
            c.base_emb_dim,
            c.base_num_query_heads * c.head_dim,
            c.base_num_kv_heads * c.head_dim,
        );
        let b = |s: &str, n, logical| c.qkv_bias.then(|| bias(l(s), n, Some(logical)));
        // A norm over all heads at once is replicated: its statistic needs every head.
        let (qn, kn) = match c.qk_norm_all_heads {
            true => (hq, hkv),
            false => (c.head_dim, c.head_dim),
        };
        let norm = |s: &str, n| c.qk_norm.then(|| layer_norm(c, l(s), n, None));
        Gqa {
            q_proj: matrix(
                l("q_proj.weight"),
                [d, hq],
                [Some("embed"), Some("q_heads")],
            ),
            q_bias: b("q_proj.bias", hq, "q_heads"),
            k_proj: matrix(
                l("k_proj.weight"),
                [d, hkv],
                [Some("embed"), Some("kv_heads")],
            ),
            k_bias: b("k_proj.bias", hkv, "kv_heads"),
            v_proj: matrix(
                l("v_proj.weight"),
                [d, hkv],
                [Some("embed"), Some("kv_heads")],
            ),
            v_bias: b("v_proj.bias", hkv, "kv_heads"),
            o_proj: matrix(
                l("o_proj.weight"),
                [hq, d],
                [Some("q_heads"), Some("embed")],
            ),
            o_bias: c
                .attention_out_bias
                .then(|| bias(l("o_proj.bias"), d, Some("embed"))),
            q_norm: norm("q_norm.weight", qn),
            k_norm: norm("k_norm.weight", kn),
        }
    }
}

/// An RMSNorm scale of `c`'s layers: ones, or zeros when the norm scales by `1 + w` (Gemma's
/// weights are stored so, and start at zero).
pub(crate) fn layer_norm(
    c: &Config,
    name: String,
    n: usize,
    logical: Option<&'static str>,
) -> ParamInfo {
    let p = norm_scale(name, n, logical);
    match c.norm_plus_one {
        true => ParamInfo {
            init: Init::Zeros,
            ..p
        },
        false => p,
    }
}

impl DenseMlp<ParamInfo> {
    /// `{prefix}.{gate,up,down}_proj.weight` of width `f` (HF names under `hf_prefix`), and
    /// their biases when `biased`.
    fn declare(
        prefix: &str,
        hf_prefix: &str,
        d: usize,
        f: usize,
        biased: bool,
    ) -> DenseMlp<ParamInfo> {
        let m = |proj: &str, shape, logical| {
            let mut p = matrix(format!("{prefix}.{proj}.weight"), shape, logical);
            p.hf = HfLayout::Tensor {
                name: format!("{hf_prefix}.{proj}.weight"),
                transposed: true,
            };
            p
        };
        let b = |proj: &str, n, logical| {
            biased.then(|| {
                let mut p = bias(format!("{prefix}.{proj}.bias"), n, Some(logical));
                p.hf = HfLayout::Tensor {
                    name: format!("{hf_prefix}.{proj}.bias"),
                    transposed: false,
                };
                p
            })
        };
        DenseMlp {
            gate_proj: m("gate_proj", [d, f], [Some("embed"), Some("mlp")]),
            gate_bias: b("gate_proj", f, "mlp"),
            up_proj: m("up_proj", [d, f], [Some("embed"), Some("mlp")]),
            up_bias: b("up_proj", f, "mlp"),
            down_proj: m("down_proj", [f, d], [Some("mlp"), Some("embed")]),
            down_bias: b("down_proj", d, "embed"),
        }
    }
}

impl DecoderLayer<ParamInfo> {
    /// Layer `i`'s declarations.
    pub(crate) fn declare(c: &Config, i: usize) -> DecoderLayer<ParamInfo> {
        let l = |s: &str| format!("model.layers.{i}.{s}");
        let d = c.base_emb_dim;
        let self_attn = match &c.mla {
            Some(m) => Attention::Mla(Mla::declare(&l("self_attn"), d, c.base_num_query_heads, m)),
            None => Attention::Gqa(Gqa::declare(c, &l("self_attn"))),
        };
        let mlp = match c.moe.as_ref().filter(|_| c.is_moe_layer(i)) {
            None => Mlp::Dense(DenseMlp::declare(
                &l("mlp"),
                &l("mlp"),
                d,
                c.base_mlp_dim,
                c.mlp_bias,
            )),
            Some(m) => {
                let (e, fe) = (m.num_experts, m.moe_mlp_dim);
                let experts =
                    |proj: &str, shape: [usize; 3], logical: [Option<&'static str>; 3]| ParamInfo {
                        name: l(&format!("mlp.experts.{proj}")),
                        shape: shape.to_vec(),
                        logical: logical.to_vec(),
                        init: Init::FanIn,
                        hf: HfLayout::Experts {
                            prefix: l("mlp.experts"),
                            suffix: format!("{proj}.weight"),
                        },
                    };
                // HF Qwen2-MoE says `shared_expert`, DeepSeek `shared_experts`.
                let shared_hf = if c.mla.is_some() {
                    "mlp.shared_experts"
                } else {
                    "mlp.shared_expert"
                };
                Mlp::Moe(SparseMoe {
                    gate: matrix(l("mlp.gate.weight"), [d, e], [Some("embed"), None]),
                    e_score_correction_bias: m.routed_bias.then(|| {
                        let name = l("mlp.gate.e_score_correction_bias");
                        ParamInfo {
                            hf: HfLayout::Tensor {
                                name: name.clone(),
                                transposed: false,
                            },
                            name,
                            shape: vec![e],
                            logical: vec![None],
                            init: Init::Zeros,
                        }
                    }),
                    experts: Experts {
                        gate_proj: experts(
                            "gate_proj",
                            [e, d, fe],
                            [Some("exp"), Some("embed"), Some("mlp")],
                        ),
                        up_proj: experts(
                            "up_proj",
                            [e, d, fe],
                            [Some("exp"), Some("embed"), Some("mlp")],
                        ),
                        down_proj: experts(
                            "down_proj",
                            [e, fe, d],
                            [Some("exp"), Some("mlp"), Some("embed")],
                        ),
                    },
                    shared_expert: (m.shared_experts > 0).then(|| {
                        DenseMlp::declare(
                            &l("mlp.shared_expert"),
                            &l(shared_hf),
                            d,
                            c.shared_mlp_dim(),
                            false,
                        )
                    }),
                    shared_expert_gate: (m.shared_experts > 0 && m.shared_expert_gate).then(|| {
                        matrix(
                            l("mlp.shared_expert_gate.weight"),
                            [d, 1],
                            [Some("embed"), None],
                        )
                    }),
                })
            }
        };
        let norm = |s: &str| layer_norm(c, l(&format!("{s}.weight")), d, Some("norm"));
        let (pre, pre_post) = match c.norm_placement {
            NormPlacement::Pre => (true, false),
            NormPlacement::PrePost => (true, true),
            NormPlacement::Post => (false, true),
        };
        DecoderLayer {
            input_layernorm: pre.then(|| norm("input_layernorm")),
            self_attn,
            post_attention_layernorm: norm("post_attention_layernorm"),
            pre_feedforward_layernorm: (pre && pre_post).then(|| norm("pre_feedforward_layernorm")),
            mlp,
            post_feedforward_layernorm: pre_post.then(|| norm("post_feedforward_layernorm")),
        }
    }
}

impl Weights<ParamInfo> {
    /// The declarations of `c`'s every weight.
    pub(super) fn declare(c: &Config) -> Weights<ParamInfo> {
        let embed_tokens = ParamInfo {
            name: "model.embed_tokens.weight".into(),
            shape: vec![c.vocab_size, c.base_emb_dim],
            logical: vec![Some("vocab"), Some("embed")],
            init: Init::Normal { std: 0.02 },
            hf: HfLayout::Tensor {
                name: "model.embed_tokens.weight".into(),
                transposed: false,
            },
        };
        Weights {
            embed_tokens,
            layers: (0..c.base_num_decoder_layers)
                .map(|i| DecoderLayer::declare(c, i))
                .collect(),
            norm: layer_norm(c, "model.norm.weight".into(), c.base_emb_dim, Some("norm")),
            lm_head: (!c.logits_via_embedding).then(|| {
                matrix(
                    "lm_head.weight".into(),
                    [c.base_emb_dim, c.vocab_size],
                    [Some("embed"), Some("vocab")],
                )
            }),
            mtp: (c.mtp_num_layers > 0).then(|| Mtp::declare(c)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// DeepSeek-V3's multi-token-prediction module (its math is in `crate::mtp`).

/// The weights of a depth-1 MTP module that are its own (`model.layers.{L}.*`, HF names),
/// matrices `[in, out]`. The embedding and the output head are the main model's: the DeepSeek-V3
/// report shares them, as MaxText and transformers' `MtpModel` do, and the published layer's
/// `embed_tokens` and `shared_head.head` are copies of them ([`crate::mtp::stored_copies`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Mtp<W> {
    /// `enorm.weight` `[d]`: the RMSNorm of the next token's embedding.
    pub enorm: W,
    /// `hnorm.weight` `[d]`: the RMSNorm of the main model's hidden state.
    pub hnorm: W,
    /// `eh_proj.weight` `[2d, d]`.
    pub eh_proj: W,
    /// The decoder layer (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`).
    pub layer: DecoderLayer<W>,
    /// `shared_head.norm.weight` `[d]`: the module's own final norm, before the shared head.
    pub shared_head_norm: W,
}

impl<W> Mtp<W> {
    /// This structure with every weight replaced by `f(weight)`, in field order (the flat order
    /// of [`Mtp::declare`]'s parameters).
    ///
    /// # Errors
    /// The first error of `f`.
    pub fn try_map<U, E>(&self, f: &mut impl FnMut(&W) -> Result<U, E>) -> Result<Mtp<U>, E> {
        Ok(Mtp {
            enorm: f(&self.enorm)?,
            hnorm: f(&self.hnorm)?,
            eh_proj: f(&self.eh_proj)?,
            layer: self.layer.try_map(f)?,
            shared_head_norm: f(&self.shared_head_norm)?,
        })
    }
}

impl Mtp<ParamInfo> {
    /// The declarations of `c`'s MTP layer, `model.layers.{num layers}.*`.
    pub fn declare(c: &Config) -> Mtp<ParamInfo> {
        let i = c.base_num_decoder_layers;
        let l = |s: &str| format!("model.layers.{i}.{s}");
        let d = c.base_emb_dim;
        Mtp {
            enorm: norm_scale(l("enorm.weight"), d, Some("norm")),
            hnorm: norm_scale(l("hnorm.weight"), d, Some("norm")),
            eh_proj: matrix(l("eh_proj.weight"), [2 * d, d], [None, Some("embed")]),
            layer: DecoderLayer::declare(c, i),
            shared_head_norm: norm_scale(l("shared_head.norm.weight"), d, Some("norm")),
        }
    }

    /// Every parameter, in [`Mtp::try_map`] order.
    pub fn params(&self) -> Vec<ParamInfo> {
        let mut out = Vec::new();
        let Ok(_) = self.try_map(&mut |p| {
            out.push(p.clone());
            Ok::<(), std::convert::Infallible>(())
        });
        out
    }
}
