//! The decoder: Qwen3 (MaxText's `decoder_block: qwen3`, HF `Qwen3ForCausalLM`), Qwen3-MoE (HF
//! `Qwen3MoeForCausalLM`: routed experts, optionally shared ones, the first
//! `first_num_dense_layers` layers dense) and DeepSeek-V3 (MLA attention with YaRN and a sigmoid
//! router; its pieces are in [`crate::deepseek`]). Presets are in `presets.rs`.
//!
//! Token embedding → N × [RMSNorm → attention (GQA with QK-norm and rotate-half RoPE, or MLA) →
//! residual → RMSNorm → SwiGLU MLP or MoE block → residual] → final RMSNorm → LM head (tied to
//! the embedding or not) → cross-entropy (plus optional z-loss), returned as the *sum* over
//! target tokens (the trainer divides once per step).
//!
//! # The structs are the weight map
//! [`Weights`] → [`DecoderLayer`] → [`Attention`] / [`Mlp`] hold one field per checkpoint
//! tensor, named as HF names it (`input_layernorm`, `self_attn.q_proj`, `mlp.gate`, ...). A
//! decoder is built once as `Weights<ParamInfo>` (the declarations: name, shape, logical axes,
//! initialisation, HF layout); the forward pass binds the caller's arrays to the same structure
//! (`Weights<&Array>`) and reads each weight by its field name. The flat parameter order
//! ([`Decoder::params`]) is the fields' declaration order, walked by one `try_map` per struct.
//!
//! Matrices are stored `[in, out]` (the transpose of HF's `[out, in]`), so `x·W` needs no
//! transpose, and routed experts are stacked `[E, in, out]`; each [`ParamInfo::hf`] says how the
//! weight maps to HF tensors. Left out: biases (Qwen3 has none), sliding windows, dropout.

use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, Ids, SpmdError};
use ferrotext_tensor::{DotDims, Rope, Yarn};

use crate::deepseek::Mla;
pub use crate::deepseek::MlaSettings;
use crate::kv_cache::{KvCache, KvSlot};
use crate::moe::RouterScore;
use crate::moe::{self, MoeConfig, MoeOptions, MoeWeights};
use crate::nn::{self, ActivationLayout, AttentionDims, AttentionWeights};
use crate::params::{HfLayout, Init, ParamInfo};

/// The mixture-of-experts feed-forward of a [`Config`] (MaxText's MoE keys).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeSettings {
    /// Routed experts (`num_experts`).
    pub num_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub num_experts_per_tok: usize,
    /// Hidden width of each expert (`moe_mlp_dim`).
    pub moe_mlp_dim: usize,
    /// Shared experts, run on every token as one SwiGLU of `shared_experts × moe_mlp_dim`.
    pub shared_experts: usize,
    /// Leading dense layers (`first_num_dense_layers`).
    pub first_num_dense_layers: usize,
    /// Router score.
    pub score: RouterScore,
    /// Renormalise the chosen scores (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Factor on the routed output (`routed_scaling_factor`).
    pub routed_scaling_factor: f32,
    /// Weight of the load-balance loss (`load_balance_loss_weight`; 0 disables).
    pub load_balance_loss_weight: f32,
    /// Diagnostic mirror: drop the expert weights' tags before the MoE region (see
    /// [`MoeOptions::withhold_tags`]).
    pub withhold_tags: bool,
}

impl MoeSettings {
    fn block(&self) -> MoeConfig {
        MoeConfig {
            num_experts: self.num_experts,
            num_experts_per_tok: self.num_experts_per_tok,
            score: self.score,
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling_factor: self.routed_scaling_factor,
            load_balance_loss_weight: self.load_balance_loss_weight,
        }
    }
}

/// Model dimensions, named like MaxText's model keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width (`base_emb_dim`).
    pub base_emb_dim: usize,
    /// Decoder layers (`base_num_decoder_layers`).
    pub base_num_decoder_layers: usize,
    /// Query heads (`base_num_query_heads`).
    pub base_num_query_heads: usize,
    /// Key/value heads (`base_num_kv_heads`).
    pub base_num_kv_heads: usize,
    /// Per-head width (`head_dim`).
    pub head_dim: usize,
    /// SwiGLU hidden width (`base_mlp_dim`).
    pub base_mlp_dim: usize,
    /// Tied LM head (`logits_via_embedding`).
    pub logits_via_embedding: bool,
    /// RoPE θ (`rope_max_timescale`).
    pub rope_max_timescale: f32,
    /// RMSNorm epsilon (`normalization_layer_epsilon`).
    pub normalization_layer_epsilon: f32,
    /// Weight of the z-loss `(log Z)²` per token (`z_loss_multiplier`; 0 disables).
    pub z_loss_multiplier: f32,
    /// Mixture-of-experts feed-forward layers (`None`: every layer dense).
    pub moe: Option<MoeSettings>,
    /// Multi-head latent attention (`None`: GQA with QK-norm).
    pub mla: Option<MlaSettings>,
    /// YaRN RoPE extension (MLA models; `None`: plain RoPE).
    pub rope_yarn: Option<Yarn>,
}

impl Config {
    /// The RoPE variant: interleaved YaRN for MLA models that set it, else plain rotate-half.
    pub fn rope(&self) -> Rope {
        Rope {
            theta: self.rope_max_timescale,
            interleaved: self.mla.is_some(),
            yarn: self.rope_yarn,
        }
    }

    /// True when layer `i` has the MoE feed-forward.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| i >= m.first_num_dense_layers)
    }
}

/// Why a config cannot build a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid qwen3 config: {0}")]
pub struct ConfigError(pub String);

// ---------------------------------------------------------------------------------------------
// The weight map. `W` is `ParamInfo` for the declarations and `&Array` in the forward pass.

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
}

/// One decoder layer (`model.layers.{i}`).
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderLayer<W> {
    /// `input_layernorm.weight` `[d]`.
    pub input_layernorm: W,
    /// `self_attn.*`.
    pub self_attn: Attention<W>,
    /// `post_attention_layernorm.weight` `[d]`.
    pub post_attention_layernorm: W,
    /// `mlp.*`.
    pub mlp: Mlp<W>,
}

/// A layer's attention.
#[derive(Clone, Debug, PartialEq)]
pub enum Attention<W> {
    /// Grouped-query attention with QK-norm (Qwen3).
    Gqa(Gqa<W>),
    /// Multi-head latent attention (DeepSeek).
    Mla(Mla<W>),
}

/// GQA weights (`self_attn.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct Gqa<W> {
    /// `q_proj.weight` `[d, heads·head_dim]`.
    pub q_proj: W,
    /// `k_proj.weight` `[d, kv_heads·head_dim]`.
    pub k_proj: W,
    /// `v_proj.weight` `[d, kv_heads·head_dim]`.
    pub v_proj: W,
    /// `o_proj.weight` `[heads·head_dim, d]`.
    pub o_proj: W,
    /// `q_norm.weight` `[head_dim]`.
    pub q_norm: W,
    /// `k_norm.weight` `[head_dim]`.
    pub k_norm: W,
}

/// A layer's feed-forward.
#[derive(Clone, Debug, PartialEq)]
pub enum Mlp<W> {
    /// A SwiGLU MLP.
    Dense(DenseMlp<W>),
    /// A mixture-of-experts block.
    Moe(SparseMoe<W>),
}

/// SwiGLU weights: `(silu(x·gate_proj) ⊙ x·up_proj)·down_proj`.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseMlp<W> {
    /// `gate_proj.weight` `[d, f]`.
    pub gate_proj: W,
    /// `up_proj.weight` `[d, f]`.
    pub up_proj: W,
    /// `down_proj.weight` `[f, d]`.
    pub down_proj: W,
}

/// Mixture-of-experts weights (`mlp.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct SparseMoe<W> {
    /// The router, `gate.weight` `[d, experts]`.
    pub gate: W,
    /// The routed experts, stacked (HF: `experts.{e}.{gate,up,down}_proj.weight`).
    pub experts: Experts<W>,
    /// The shared experts as one SwiGLU of width `shared_experts × moe_mlp_dim` (HF:
    /// `shared_expert.*` for Qwen, `shared_experts.*` for DeepSeek).
    pub shared_expert: Option<DenseMlp<W>>,
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
    /// order ([`Decoder::params`]).
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
        })
    }
}

impl<W> DecoderLayer<W> {
    fn try_map<U, E>(&self, f: &mut impl FnMut(&W) -> Result<U, E>) -> Result<DecoderLayer<U>, E> {
        Ok(DecoderLayer {
            input_layernorm: f(&self.input_layernorm)?,
            self_attn: match &self.self_attn {
                Attention::Gqa(a) => Attention::Gqa(Gqa {
                    q_proj: f(&a.q_proj)?,
                    k_proj: f(&a.k_proj)?,
                    v_proj: f(&a.v_proj)?,
                    o_proj: f(&a.o_proj)?,
                    q_norm: f(&a.q_norm)?,
                    k_norm: f(&a.k_norm)?,
                }),
                Attention::Mla(a) => Attention::Mla(a.try_map(f)?),
            },
            post_attention_layernorm: f(&self.post_attention_layernorm)?,
            mlp: match &self.mlp {
                Mlp::Dense(m) => Mlp::Dense(m.try_map(f)?),
                Mlp::Moe(m) => Mlp::Moe(SparseMoe {
                    gate: f(&m.gate)?,
                    experts: Experts {
                        gate_proj: f(&m.experts.gate_proj)?,
                        up_proj: f(&m.experts.up_proj)?,
                        down_proj: f(&m.experts.down_proj)?,
                    },
                    shared_expert: m.shared_expert.as_ref().map(|s| s.try_map(f)).transpose()?,
                }),
            },
        })
    }
}

impl<W> DenseMlp<W> {
    fn try_map<U, E>(&self, f: &mut impl FnMut(&W) -> Result<U, E>) -> Result<DenseMlp<U>, E> {
        Ok(DenseMlp {
            gate_proj: f(&self.gate_proj)?,
            up_proj: f(&self.up_proj)?,
            down_proj: f(&self.down_proj)?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The declarations.

/// A `[in, out]` matrix initialised `N(0, 1/in)`; HF stores it `[out, in]` under `name`.
pub(crate) fn matrix(
    name: String,
    shape: [usize; 2],
    logical: [Option<&'static str>; 2],
) -> ParamInfo {
    ParamInfo {
        hf: HfLayout::Tensor {
            name: name.clone(),
            transposed: true,
        },
        name,
        shape: shape.to_vec(),
        logical: logical.to_vec(),
        init: Init::FanIn,
    }
}

/// An RMSNorm scale `[n]` of ones, as HF stores it.
pub(crate) fn norm_scale(name: String, n: usize, logical: Option<&'static str>) -> ParamInfo {
    ParamInfo {
        hf: HfLayout::Tensor {
            name: name.clone(),
            transposed: false,
        },
        name,
        shape: vec![n],
        logical: vec![logical],
        init: Init::Ones,
    }
}

impl DenseMlp<ParamInfo> {
    /// `{prefix}.{gate,up,down}_proj.weight` of width `f` (HF names under `hf_prefix`).
    fn declare(prefix: &str, hf_prefix: &str, d: usize, f: usize) -> DenseMlp<ParamInfo> {
        let m = |proj: &str, shape, logical| {
            let mut p = matrix(format!("{prefix}.{proj}.weight"), shape, logical);
            p.hf = HfLayout::Tensor {
                name: format!("{hf_prefix}.{proj}.weight"),
                transposed: true,
            };
            p
        };
        DenseMlp {
            gate_proj: m("gate_proj", [d, f], [Some("embed"), Some("mlp")]),
            up_proj: m("up_proj", [d, f], [Some("embed"), Some("mlp")]),
            down_proj: m("down_proj", [f, d], [Some("mlp"), Some("embed")]),
        }
    }
}

impl DecoderLayer<ParamInfo> {
    /// Layer `i`'s declarations.
    fn declare(c: &Config, i: usize) -> DecoderLayer<ParamInfo> {
        let l = |s: &str| format!("model.layers.{i}.{s}");
        let (d, hq, hkv) = (
            c.base_emb_dim,
            c.base_num_query_heads * c.head_dim,
            c.base_num_kv_heads * c.head_dim,
        );
        let self_attn = match &c.mla {
            Some(m) => Attention::Mla(Mla::declare(&l("self_attn"), d, c.base_num_query_heads, m)),
            None => Attention::Gqa(Gqa {
                q_proj: matrix(
                    l("self_attn.q_proj.weight"),
                    [d, hq],
                    [Some("embed"), Some("q_heads")],
                ),
                k_proj: matrix(
                    l("self_attn.k_proj.weight"),
                    [d, hkv],
                    [Some("embed"), Some("kv_heads")],
                ),
                v_proj: matrix(
                    l("self_attn.v_proj.weight"),
                    [d, hkv],
                    [Some("embed"), Some("kv_heads")],
                ),
                o_proj: matrix(
                    l("self_attn.o_proj.weight"),
                    [hq, d],
                    [Some("q_heads"), Some("embed")],
                ),
                q_norm: norm_scale(l("self_attn.q_norm.weight"), c.head_dim, None),
                k_norm: norm_scale(l("self_attn.k_norm.weight"), c.head_dim, None),
            }),
        };
        let mlp = match c.moe.as_ref().filter(|_| c.is_moe_layer(i)) {
            None => Mlp::Dense(DenseMlp::declare(&l("mlp"), &l("mlp"), d, c.base_mlp_dim)),
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
                            m.shared_experts * fe,
                        )
                    }),
                })
            }
        };
        DecoderLayer {
            input_layernorm: norm_scale(l("input_layernorm.weight"), d, Some("norm")),
            self_attn,
            post_attention_layernorm: norm_scale(
                l("post_attention_layernorm.weight"),
                d,
                Some("norm"),
            ),
            mlp,
        }
    }
}

impl Weights<ParamInfo> {
    /// The declarations of `c`'s every weight.
    fn declare(c: &Config) -> Weights<ParamInfo> {
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
            norm: norm_scale("model.norm.weight".into(), c.base_emb_dim, Some("norm")),
            lm_head: (!c.logits_via_embedding).then(|| {
                matrix(
                    "lm_head.weight".into(),
                    [c.base_emb_dim, c.vocab_size],
                    [Some("embed"), Some("vocab")],
                )
            }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model.

/// A decoder: its config, checked once, and its weight declarations.
#[derive(Clone, Debug)]
pub struct Decoder {
    cfg: Config,
    weights: Weights<ParamInfo>,
}

impl Decoder {
    /// Checks the config once, so the forward pass never branches on it.
    ///
    /// # Errors
    /// Zero sizes, `kv_heads` not dividing `heads`, an odd `head_dim` (RoPE pairs dims), MLA or
    /// MoE settings out of range.
    pub fn new(cfg: Config) -> Result<Decoder, ConfigError> {
        let sizes = [
            cfg.vocab_size,
            cfg.base_emb_dim,
            cfg.base_num_decoder_layers,
            cfg.base_num_query_heads,
            cfg.base_num_kv_heads,
            cfg.head_dim,
            cfg.base_mlp_dim,
        ];
        if sizes.contains(&0) {
            return Err(ConfigError("every model dimension must be positive".into()));
        }
        if !cfg
            .base_num_query_heads
            .is_multiple_of(cfg.base_num_kv_heads)
        {
            return Err(ConfigError(format!(
                "base_num_query_heads ({}) must be a multiple of base_num_kv_heads ({})",
                cfg.base_num_query_heads, cfg.base_num_kv_heads
            )));
        }
        if !cfg.head_dim.is_multiple_of(2) {
            return Err(ConfigError(format!(
                "head_dim ({}) must be even for RoPE",
                cfg.head_dim
            )));
        }
        if let Some(m) = &cfg.mla {
            let dims = [
                m.q_lora_rank,
                m.kv_lora_rank,
                m.qk_nope_head_dim,
                m.qk_rope_head_dim,
                m.v_head_dim,
            ];
            if dims.contains(&0) || m.qk_rope_head_dim % 2 != 0 {
                return Err(ConfigError(format!(
                    "MLA needs positive ranks and head widths and an even qk_rope_head_dim, got {m:?}"
                )));
            }
        }
        if let Some(m) = &cfg.moe {
            if m.num_experts == 0
                || m.moe_mlp_dim == 0
                || m.num_experts_per_tok == 0
                || m.num_experts_per_tok > m.num_experts
            {
                return Err(ConfigError(format!(
                    "MoE needs experts, a positive moe_mlp_dim and 1 ≤ num_experts_per_tok ≤ \
                     num_experts; got {} experts, top-{}, width {}",
                    m.num_experts, m.num_experts_per_tok, m.moe_mlp_dim
                )));
            }
        }
        let weights = Weights::declare(&cfg);
        Ok(Decoder { cfg, weights })
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The weight declarations, as a structure.
    pub fn weights(&self) -> &Weights<ParamInfo> {
        &self.weights
    }

    /// Every parameter, in the order [`Decoder::loss_sum`] takes them.
    pub fn params(&self) -> Vec<ParamInfo> {
        let mut out = Vec::new();
        let Ok(_) = self.weights.try_map(&mut |p| {
            out.push(p.clone());
            Ok::<(), std::convert::Infallible>(())
        });
        out
    }

    /// Total parameter count.
    pub fn param_count(&self) -> usize {
        self.params()
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum()
    }

    /// Training FLOPs per token at sequence length `seq`: 6 per matmul weight (forward and both
    /// backward products; the LM head counts the vocabulary projection, the embedding lookup
    /// counts nothing; of the routed experts only the k a token uses) plus the attention score and
    /// value products (12·layers·seq·heads·head_dim).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let c = &self.cfg;
        let embedding = c.vocab_size * c.base_emb_dim;
        let attention_norms = match &c.mla {
            Some(m) => m.q_lora_rank + m.kv_lora_rank,
            None => 2 * c.head_dim,
        };
        let norms =
            c.base_num_decoder_layers * (2 * c.base_emb_dim + attention_norms) + c.base_emb_dim;
        let lm_head = embedding;
        let untied_extra = if c.logits_via_embedding { 0 } else { embedding };
        // A token runs k of the E routed experts: only their weights count.
        let idle_experts: usize = match &c.moe {
            Some(m) => {
                let layers = (0..c.base_num_decoder_layers)
                    .filter(|&i| c.is_moe_layer(i))
                    .count();
                let per_expert = 3 * c.base_emb_dim * m.moe_mlp_dim;
                layers * (m.num_experts - m.num_experts_per_tok) * per_expert
            }
            None => 0,
        };
        let matmul_weights =
            self.param_count() - embedding - norms - untied_extra - idle_experts + lm_head;
        // Scores (q·k over the query/key width) and values, forward and backward: 6 each.
        let (qk_width, v_width) = match &c.mla {
            Some(m) => (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim),
            None => (c.head_dim, c.head_dim),
        };
        let attention = 6.0
            * (c.base_num_decoder_layers * seq * c.base_num_query_heads * (qk_width + v_width))
                as f64;
        6.0 * matmul_weights as f64 + attention
    }

    /// The cross-entropy *sum* over the target tokens of a batch ([`IGNORE_INDEX`](ferrotext_spmd::IGNORE_INDEX) targets are
    /// ignored), as a plain scalar. `params` are in [`Decoder::params`] order, laid out and
    /// tagged by the caller; `inputs` and `targets` are `[B, T]`.
    ///
    /// # Errors
    /// A type error of the ops (a layout the model cannot run), or too few parameters.
    pub fn loss_sum(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<Array, SpmdError> {
        let (logits, aux) = self.forward(cx, params, inputs, None)?;
        let ce = cx.cross_entropy_sum(&logits, targets, self.cfg.z_loss_multiplier)?;
        match aux {
            // The trainer divides the sum by the step's tokens: an auxiliary loss joins as
            // `aux · tokens` so that it ends up added to the mean.
            Some(aux) => {
                let tokens: usize = inputs.ty().shape().iter().product();
                let aux = cx.scale(&aux, tokens as f32)?;
                cx.add(&ce, &aux)
            }
            None => Ok(ce),
        }
    }

    /// [`Decoder::loss_sum`] left as each device's partial sum over its own tokens, a scalar
    /// unreduced over the batch axes (`f32[]{U:data}`, [`Ctx::cross_entropy_partial_sum`]): for
    /// a trainer that adds the partial sums of its micro-batches and devices in an order of its
    /// own before one reduction.
    ///
    /// # Errors
    /// As [`Decoder::loss_sum`]; a model with an auxiliary loss (`load_balance_loss_weight` >
    /// 0), whose value is a function of the whole micro-batch's routing, not a sum over devices.
    pub fn loss_partial_sum(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<Array, SpmdError> {
        let (logits, aux) = self.forward(cx, params, inputs, None)?;
        if aux.is_some() {
            return Err(SpmdError::BadArgument {
                op: "loss_partial_sum".into(),
                reason: "an auxiliary loss depends on the whole micro-batch and has no \
                         per-device partial sum"
                    .into(),
            });
        }
        cx.cross_entropy_partial_sum(&logits, targets, self.cfg.z_loss_multiplier)
    }

    /// Logits `[B, T, vocab]`, split over the batch like the inputs, vocab replicated.
    ///
    /// # Errors
    /// As [`Decoder::loss_sum`].
    pub fn logits(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
    ) -> Result<Array, SpmdError> {
        Ok(self.forward(cx, params, inputs, None)?.0)
    }

    /// Incremental decoding: the logits `[B, T, vocab]` of `inputs` (`[B, T]`, the tokens that
    /// follow the ones already in `cache`, at positions `cache.len()..`), computed from their
    /// own queries, keys and values and the cached ones; `inputs` then join the cache. Equal to
    /// the last `T` positions of [`Decoder::logits`] over the whole sequence.
    ///
    /// # Errors
    /// A cache made for another depth; as [`Decoder::logits`].
    pub fn decode(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        cache: &mut KvCache,
    ) -> Result<Array, SpmdError> {
        if cache.layers() != self.weights.layers.len() {
            return Err(SpmdError::BadArgument {
                op: "decode".into(),
                reason: format!(
                    "the cache has {} layers, the decoder {}",
                    cache.layers(),
                    self.weights.layers.len()
                ),
            });
        }
        Ok(self.forward(cx, params, inputs, Some(cache))?.0)
    }

    /// An empty key/value cache for [`Decoder::decode`].
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.weights.layers.len())
    }

    /// `params` (flat, in [`Decoder::params`] order) bound to the weight map.
    fn bind<'p>(&self, params: &'p [Array]) -> Result<Weights<&'p Array>, SpmdError> {
        let mut it = params.iter();
        self.weights.try_map(&mut |_| {
            it.next().ok_or_else(|| SpmdError::BadArgument {
                op: "qwen3".into(),
                reason: "too few parameters".into(),
            })
        })
    }

    /// Logits and the summed auxiliary losses of the MoE layers (their load-balance losses,
    /// when on). Activations are `[B@batch, T, d]`: the batch split like the tokens.
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        mut cache: Option<&mut KvCache>,
    ) -> Result<(Array, Option<Array>), SpmdError> {
        let (c, w) = (&self.cfg, self.bind(params)?);
        let batch_axes: Vec<String> = inputs.ty().sharding().spec().dim(0).axis_names().to_vec();
        let layout = ActivationLayout { batch: batch_axes };
        // 1. embedding lookup: x [B@batch, T, d] (the table is gathered first if it is split,
        //    keeping its tags)
        let table = unsplit(cx, w.embed_tokens)?;
        let table = match w.lm_head {
            None => reduced_over(cx, &table, &layout.batch)?,
            Some(_) => table,
        };
        let mut x = cx.take(&table, inputs)?;
        // 2. the layers: x [B@batch, T, d] each
        let mut aux: Option<Array> = None;
        for (i, layer) in w.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().and_then(|k| k.slot(i));
            x = layer.forward(cx, &x, c, &mut aux, slot)?;
        }
        // 3. final norm and LM head: [B, T, d]·[d, V] (tied: the embedding, transposed)
        let x = nn::rms_norm(cx, &x, w.norm, c.normalization_layer_epsilon)?;
        let logits = match w.lm_head {
            None => {
                let dims = DotDims {
                    lhs_contracting: vec![2],
                    rhs_contracting: vec![1],
                    ..Default::default()
                };
                cx.dot_general(&x, &table, &dims, None)?
            }
            Some(head) => nn::linear(cx, &x, head)?,
        };
        // 4. cross-entropy needs whole vocab rows: gather the vocab dim if it is split
        let want = layout.spec(3);
        let logits = if logits.ty().sharding().spec().partitions() == want.partitions() {
            logits
        } else {
            cx.reshard(&logits, &want)?
        };
        Ok((logits, aux))
    }
}

impl DecoderLayer<&Array> {
    /// `x + attn(norm(x))`, then `+ mlp(norm(·))`; a MoE layer's load-balance loss is added to
    /// `aux`.
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        x: &Array,
        c: &Config,
        aux: &mut Option<Array>,
        cache: Option<&mut KvSlot>,
    ) -> Result<Array, SpmdError> {
        let eps = c.normalization_layer_epsilon;
        // 1. h = input_layernorm(x): [B@batch, T, d]
        let h = nn::rms_norm(cx, x, self.input_layernorm, eps)?;
        // 2. x = x + self_attn(h): heads split over `tensor` inside, [B@batch, T, d] out
        let a = match &self.self_attn {
            Attention::Gqa(g) => g.forward(cx, &h, c, cache)?,
            Attention::Mla(m) => m.forward(cx, &h, c, cache)?,
        };
        let x = cx.add(x, &a)?;
        // 3. h = post_attention_layernorm(x)
        let h = nn::rms_norm(cx, &x, self.post_attention_layernorm, eps)?;
        // 4. x = x + mlp(h): SwiGLU, or the MoE block (experts split over `expert` inside)
        let m = match &self.mlp {
            Mlp::Dense(m) => nn::swiglu(cx, &h, m.gate_proj, m.up_proj, m.down_proj)?,
            Mlp::Moe(m) => m.forward(cx, &h, c, aux)?,
        };
        cx.add(&x, &m)
    }
}

impl Gqa<&Array> {
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        h: &Array,
        c: &Config,
        cache: Option<&mut KvSlot>,
    ) -> Result<Array, SpmdError> {
        let w = AttentionWeights {
            q_proj: self.q_proj,
            k_proj: self.k_proj,
            v_proj: self.v_proj,
            o_proj: self.o_proj,
            q_norm: self.q_norm,
            k_norm: self.k_norm,
        };
        let dims = AttentionDims {
            heads: c.base_num_query_heads,
            kv_heads: c.base_num_kv_heads,
            head_dim: c.head_dim,
            rope_theta: c.rope_max_timescale,
            eps: c.normalization_layer_epsilon,
        };
        nn::attention(cx, h, &w, dims, cache)
    }
}

impl SparseMoe<&Array> {
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        h: &Array,
        c: &Config,
        aux: &mut Option<Array>,
    ) -> Result<Array, SpmdError> {
        let settings = c.moe.as_ref().ok_or_else(|| SpmdError::BadArgument {
            op: "qwen3".into(),
            reason: "MoE weights on a config without MoE settings".into(),
        })?;
        let weights = MoeWeights {
            router: self.gate.clone(),
            router_bias: None,
            wi_0: self.experts.gate_proj.clone(),
            wi_1: self.experts.up_proj.clone(),
            wo: self.experts.down_proj.clone(),
            shared: self
                .shared_expert
                .as_ref()
                .map(|s| [s.gate_proj.clone(), s.up_proj.clone(), s.down_proj.clone()]),
        };
        let options = MoeOptions {
            withhold_tags: settings.withhold_tags,
        };
        let out = moe::moe_sparse(cx, &settings.block(), h, &weights, options)?;
        if let Some(loss) = out.load_balance_loss {
            *aux = Some(match aux.take() {
                Some(sum) => cx.add(&sum, &loss)?,
                None => loss,
            });
        }
        Ok(out.y)
    }
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
fn reduced_over(cx: &mut Ctx<'_>, table: &Array, axes: &[String]) -> Result<Array, SpmdError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::RouterScore;

    fn tiny_moe_mla() -> Config {
        let mut c = Config::preset("qwen3-tiny").unwrap();
        c.base_num_decoder_layers = 2;
        c.logits_via_embedding = false;
        c.mla = Some(MlaSettings {
            q_lora_rank: 6,
            kv_lora_rank: 4,
            qk_nope_head_dim: 4,
            qk_rope_head_dim: 2,
            v_head_dim: 3,
        });
        c.moe = Some(MoeSettings {
            num_experts: 3,
            num_experts_per_tok: 2,
            moe_mlp_dim: 5,
            shared_experts: 1,
            first_num_dense_layers: 1,
            score: RouterScore::Sigmoid,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
            load_balance_loss_weight: 0.0,
            withhold_tags: false,
        });
        c
    }

    /// Regression (issue 13): the message had a run of stray spaces from a broken line.
    #[test]
    fn moe_range_error_reads_as_one_sentence() {
        let mut c = tiny_moe_mla();
        if let Some(m) = c.moe.as_mut() {
            m.num_experts_per_tok = 5;
        }
        let err = Decoder::new(c).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid qwen3 config: MoE needs experts, a positive moe_mlp_dim and 1 ≤ \
             num_experts_per_tok ≤ num_experts; got 3 experts, top-5, width 5"
        );
    }

    /// The flat order is the one the trainer has always used (written out by hand here).
    #[test]
    fn params_come_in_the_historical_order() {
        let names: Vec<String> = Decoder::new(tiny_moe_mla())
            .unwrap()
            .params()
            .into_iter()
            .map(|p| p.name)
            .collect();
        let mut want = vec!["model.embed_tokens.weight".to_string()];
        for i in 0..2 {
            let l = |s: &str| format!("model.layers.{i}.{s}");
            want.push(l("input_layernorm.weight"));
            for s in [
                "q_a_proj",
                "q_a_layernorm",
                "q_b_proj",
                "kv_a_proj_with_mqa",
                "kv_a_layernorm",
                "kv_b_proj",
                "o_proj",
            ] {
                want.push(l(&format!("self_attn.{s}.weight")));
            }
            want.push(l("post_attention_layernorm.weight"));
            if i == 0 {
                for s in ["gate_proj", "up_proj", "down_proj"] {
                    want.push(l(&format!("mlp.{s}.weight")));
                }
            } else {
                want.push(l("mlp.gate.weight"));
                for s in ["gate_proj", "up_proj", "down_proj"] {
                    want.push(l(&format!("mlp.experts.{s}")));
                }
                for s in ["gate_proj", "up_proj", "down_proj"] {
                    want.push(l(&format!("mlp.shared_expert.{s}.weight")));
                }
            }
        }
        want.push("model.norm.weight".into());
        want.push("lm_head.weight".into());
        assert_eq!(names, want);
    }

    /// Every matrix is HF `[out, in]`, including the two the old suffix rule missed, and the
    /// stacked experts unstack to one `[out, in]` tensor per expert.
    #[test]
    fn hf_layouts_declare_orientation_and_unstacked_experts() {
        let d = Decoder::new(tiny_moe_mla()).unwrap();
        let params = d.params();
        let find = |n: &str| params.iter().find(|p| p.name == n).unwrap().hf_tensors();
        assert_eq!(
            find("model.layers.1.self_attn.kv_a_proj_with_mqa.weight"),
            vec![(
                "model.layers.1.self_attn.kv_a_proj_with_mqa.weight".to_string(),
                vec![6, 128]
            )]
        );
        assert_eq!(
            find("model.layers.1.mlp.gate.weight"),
            vec![("model.layers.1.mlp.gate.weight".to_string(), vec![3, 128])]
        );
        assert_eq!(
            find("model.layers.1.mlp.experts.down_proj"),
            (0..3)
                .map(|e| (
                    format!("model.layers.1.mlp.experts.{e}.down_proj.weight"),
                    vec![128, 5]
                ))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            find("model.layers.1.mlp.shared_expert.up_proj.weight")[0].0,
            "model.layers.1.mlp.shared_experts.up_proj.weight"
        );
        assert_eq!(
            find("model.norm.weight"),
            vec![("model.norm.weight".to_string(), vec![128])]
        );
    }

    /// `to_hf` against indices written out by hand, and `from_hf` inverts it.
    #[test]
    fn experts_unstack_transposed_and_come_back() {
        let info = ParamInfo {
            name: "x".into(),
            shape: vec![2, 3, 4],
            logical: vec![None; 3],
            init: Init::Ones,
            hf: HfLayout::Experts {
                prefix: "p".into(),
                suffix: "w".into(),
            },
        };
        let v = ferrotext_tensor::Tensor::from_fn(&[2, 3, 4], |i| i as f32);
        let parts = info.to_hf(&v).unwrap();
        assert_eq!(parts[1].0, "p.1.w");
        assert_eq!(parts[1].1.shape(), &[4, 3]);
        // HF[e=1][o=2][i=1] = ours[e=1][i=1][o=2] = 12 + 4 + 2.
        assert_eq!(parts[1].1.data()[2 * 3 + 1], 18.0);
        let tensors: Vec<_> = parts.into_iter().map(|(_, t)| t).collect();
        assert_eq!(info.from_hf(tensors).unwrap(), v);
    }
}
