//! Qwen3-style decoder (MaxText's `decoder_block: qwen3`, HF `Qwen3ForCausalLM`), dense or with
//! mixture-of-experts feed-forward layers (HF `Qwen3MoeForCausalLM`: routed experts, optionally
//! shared ones, the first `first_num_dense_layers` layers dense).
//!
//! Token embedding → N × [RMSNorm → GQA attention with QK-norm and RoPE (rotate-half) → residual
//! → RMSNorm → SwiGLU MLP or MoE block → residual] → final RMSNorm → LM head (tied to the
//! embedding or not) → cross-entropy (plus optional z-loss), returned as the *sum* over target
//! tokens (the trainer divides once per step).
//!
//! Parameter names follow HF Qwen3 (`model.embed_tokens.weight`,
//! `model.layers.{i}.self_attn.q_proj.weight`, ...), but matrices are stored `[in, out]` (the
//! transpose of HF's `[out, in]`), so `x·W` needs no transpose; loading and saving in HF
//! orientation is one function in the trainer. Left out: biases (Qwen3 has none), sliding
//! windows, dropout.

use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, Ids, SpmdError};
use ferrotext_tensor::DotDims;

use crate::mla::{mla_attention, MlaDims, MlaWeights};
use crate::moe::{self, MoeConfig, MoeOptions, MoeWeights, RouterScore};
use ferrotext_tensor::{Rope, Yarn};

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
}
use crate::nn::{self, ActivationLayout, AttentionDims, AttentionWeights};
use crate::params::{Init, ParamInfo};

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
    /// A preset by name: `qwen3-tiny` (CPU-sized, byte vocabulary), `qwen3-peer` (the JAX peer
    /// harness's model), `qwen3-0.6b` (the real dims; abstract mode on CPU), `qwen3-moe-tiny`
    /// (qwen3-tiny with 8 routed experts, top-2, one shared expert, the first layer dense),
    /// `qwen3-moe-bench` (many small experts: a large gradient for its FLOPs), `deepseek3-tiny`
    /// (MaxText's: MLA, YaRN, 16 experts top-8) or `deepseek3-1.3b` (its ~1.3B variant; abstract
    /// mode on CPU, or train it with reduced dims).
    pub fn preset(name: &str) -> Option<Config> {
        let base = Config {
            vocab_size: 256,
            base_emb_dim: 128,
            base_num_decoder_layers: 2,
            base_num_query_heads: 4,
            base_num_kv_heads: 2,
            head_dim: 32,
            base_mlp_dim: 384,
            logits_via_embedding: true,
            rope_max_timescale: 1_000_000.0,
            normalization_layer_epsilon: 1e-6,
            z_loss_multiplier: 0.0,
            moe: None,
            mla: None,
            rope_yarn: None,
        };
        // MaxText's deepseek3-tiny (reference §4): MLA with YaRN, 16 experts top-8 with a
        // sigmoid router, 1 shared expert, the first 3 of 61 layers dense, untied head.
        let deepseek3_tiny = Config {
            vocab_size: 129_280,
            base_emb_dim: 64,
            base_num_decoder_layers: 61,
            base_num_query_heads: 4,
            base_num_kv_heads: 4,
            head_dim: 128,
            base_mlp_dim: 64,
            logits_via_embedding: false,
            rope_max_timescale: 10_000.0,
            normalization_layer_epsilon: 1e-6,
            z_loss_multiplier: 0.0,
            moe: Some(MoeSettings {
                num_experts: 16,
                num_experts_per_tok: 8,
                moe_mlp_dim: 64,
                shared_experts: 1,
                first_num_dense_layers: 3,
                score: RouterScore::Sigmoid,
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
                load_balance_loss_weight: 0.0,
                withhold_tags: false,
            }),
            mla: Some(MlaSettings {
                q_lora_rank: 32,
                kv_lora_rank: 16,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            }),
            rope_yarn: Some(Yarn {
                factor: 40.0,
                original_max_position: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
            }),
        };
        let moe = MoeSettings {
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_mlp_dim: 96,
            shared_experts: 1,
            first_num_dense_layers: 1,
            score: RouterScore::Softmax,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
            load_balance_loss_weight: 0.0,
            withhold_tags: false,
        };
        Some(match name {
            "qwen3-tiny" => base,
            "qwen3-peer" => Config {
                vocab_size: 2048,
                base_emb_dim: 256,
                base_num_decoder_layers: 4,
                base_num_query_heads: 8,
                base_num_kv_heads: 4,
                head_dim: 32,
                base_mlp_dim: 768,
                ..base
            },
            "qwen3-moe-tiny" => Config {
                moe: Some(moe),
                ..base
            },
            "qwen3-moe-bench" => Config {
                base_num_decoder_layers: 2,
                moe: Some(MoeSettings {
                    num_experts: 16,
                    moe_mlp_dim: 64,
                    first_num_dense_layers: 0,
                    ..moe
                }),
                ..base
            },
            "deepseek3-tiny" => deepseek3_tiny,
            // The ~1.3B variant of MaxText's GA integration test (reference §4).
            "deepseek3-1.3b" => Config {
                base_emb_dim: 1024,
                base_mlp_dim: 2048,
                base_num_decoder_layers: 24,
                moe: deepseek3_tiny.moe.clone().map(|m| MoeSettings {
                    moe_mlp_dim: 1024,
                    first_num_dense_layers: 1,
                    num_experts_per_tok: 2,
                    ..m
                }),
                ..deepseek3_tiny.clone()
            },
            "qwen3-0.6b" => Config {
                vocab_size: 151_936,
                base_emb_dim: 1024,
                base_num_decoder_layers: 28,
                base_num_query_heads: 16,
                base_num_kv_heads: 8,
                head_dim: 128,
                base_mlp_dim: 3072,
                ..base
            },
            _ => return None,
        })
    }

    /// The preset names.
    pub const PRESETS: &'static [&'static str] = &[
        "qwen3-tiny",
        "qwen3-peer",
        "qwen3-0.6b",
        "qwen3-moe-tiny",
        "qwen3-moe-bench",
        "deepseek3-tiny",
        "deepseek3-1.3b",
    ];

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

/// A Qwen3 decoder: its config, checked once.
#[derive(Clone, Debug)]
pub struct Qwen3 {
    cfg: Config,
}

/// Why a config cannot build a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid qwen3 config: {0}")]
pub struct ConfigError(pub String);

impl Qwen3 {
    /// Checks the config once, so the forward pass never branches on it.
    ///
    /// # Errors
    /// Zero sizes, `kv_heads` not dividing `heads`, an odd `head_dim` (RoPE pairs dims).
    pub fn new(cfg: Config) -> Result<Qwen3, ConfigError> {
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
        if cfg.base_num_query_heads % cfg.base_num_kv_heads != 0 {
            return Err(ConfigError(format!(
                "base_num_query_heads ({}) must be a multiple of base_num_kv_heads ({})",
                cfg.base_num_query_heads, cfg.base_num_kv_heads
            )));
        }
        if cfg.head_dim % 2 != 0 {
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
                    "MoE needs experts, a positive moe_mlp_dim and 1 ≤ num_experts_per_tok ≤                      num_experts; got {} experts, top-{}, width {}",
                    m.num_experts, m.num_experts_per_tok, m.moe_mlp_dim
                )));
            }
        }
        Ok(Qwen3 { cfg })
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Every parameter, in the order [`Qwen3::loss_sum`] takes them.
    pub fn params(&self) -> Vec<ParamInfo> {
        let c = &self.cfg;
        let (d, hq, hkv, f) = (
            c.base_emb_dim,
            c.base_num_query_heads * c.head_dim,
            c.base_num_kv_heads * c.head_dim,
            c.base_mlp_dim,
        );
        let p = |name: String,
                 shape: Vec<usize>,
                 logical: Vec<Option<&'static str>>,
                 init: Init| ParamInfo {
            name,
            shape,
            logical,
            init,
        };
        let mut out = vec![p(
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, d],
            vec![Some("vocab"), Some("embed")],
            Init::Normal { std: 0.02 },
        )];
        for i in 0..c.base_num_decoder_layers {
            let l = |s: &str| format!("model.layers.{i}.{s}");
            out.push(p(
                l("input_layernorm.weight"),
                vec![d],
                vec![Some("norm")],
                Init::Ones,
            ));
            if let Some(m) = &c.mla {
                let h = c.base_num_query_heads;
                let (qk, v) = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim);
                for (name, shape, logical, init) in [
                    (
                        "q_a_proj.weight",
                        vec![d, m.q_lora_rank],
                        [Some("embed"), Some("q_lora")],
                        Init::FanIn,
                    ),
                    (
                        "q_a_layernorm.weight",
                        vec![m.q_lora_rank],
                        [Some("q_lora"), None],
                        Init::Ones,
                    ),
                    (
                        "q_b_proj.weight",
                        vec![m.q_lora_rank, h * qk],
                        [Some("q_lora"), Some("q_heads")],
                        Init::FanIn,
                    ),
                    (
                        "kv_a_proj_with_mqa.weight",
                        vec![d, m.kv_lora_rank + m.qk_rope_head_dim],
                        [Some("embed"), Some("kv_lora")],
                        Init::FanIn,
                    ),
                    (
                        "kv_a_layernorm.weight",
                        vec![m.kv_lora_rank],
                        [Some("kv_lora"), None],
                        Init::Ones,
                    ),
                    (
                        "kv_b_proj.weight",
                        vec![m.kv_lora_rank, h * (m.qk_nope_head_dim + v)],
                        [Some("kv_lora"), Some("q_heads")],
                        Init::FanIn,
                    ),
                    (
                        "o_proj.weight",
                        vec![h * v, d],
                        [Some("q_heads"), Some("embed")],
                        Init::FanIn,
                    ),
                ] {
                    let logical = logical[..shape.len()].to_vec();
                    out.push(p(l(&format!("self_attn.{name}")), shape, logical, init));
                }
            } else {
                out.push(p(
                    l("self_attn.q_proj.weight"),
                    vec![d, hq],
                    vec![Some("embed"), Some("q_heads")],
                    Init::FanIn,
                ));
                out.push(p(
                    l("self_attn.k_proj.weight"),
                    vec![d, hkv],
                    vec![Some("embed"), Some("kv_heads")],
                    Init::FanIn,
                ));
                out.push(p(
                    l("self_attn.v_proj.weight"),
                    vec![d, hkv],
                    vec![Some("embed"), Some("kv_heads")],
                    Init::FanIn,
                ));
                out.push(p(
                    l("self_attn.o_proj.weight"),
                    vec![hq, d],
                    vec![Some("q_heads"), Some("embed")],
                    Init::FanIn,
                ));
                out.push(p(
                    l("self_attn.q_norm.weight"),
                    vec![c.head_dim],
                    vec![None],
                    Init::Ones,
                ));
                out.push(p(
                    l("self_attn.k_norm.weight"),
                    vec![c.head_dim],
                    vec![None],
                    Init::Ones,
                ));
            }
            out.push(p(
                l("post_attention_layernorm.weight"),
                vec![d],
                vec![Some("norm")],
                Init::Ones,
            ));
            match c.moe.as_ref().filter(|_| c.is_moe_layer(i)) {
                None => {
                    out.push(p(
                        l("mlp.gate_proj.weight"),
                        vec![d, f],
                        vec![Some("embed"), Some("mlp")],
                        Init::FanIn,
                    ));
                    out.push(p(
                        l("mlp.up_proj.weight"),
                        vec![d, f],
                        vec![Some("embed"), Some("mlp")],
                        Init::FanIn,
                    ));
                    out.push(p(
                        l("mlp.down_proj.weight"),
                        vec![f, d],
                        vec![Some("mlp"), Some("embed")],
                        Init::FanIn,
                    ));
                }
                Some(m) => {
                    let (e, fe) = (m.num_experts, m.moe_mlp_dim);
                    out.push(p(
                        l("mlp.gate.weight"),
                        vec![d, e],
                        vec![Some("embed"), None],
                        Init::FanIn,
                    ));
                    for (name, shape, logical) in [
                        (
                            "gate_proj",
                            vec![e, d, fe],
                            [Some("exp"), Some("embed"), Some("mlp")],
                        ),
                        (
                            "up_proj",
                            vec![e, d, fe],
                            [Some("exp"), Some("embed"), Some("mlp")],
                        ),
                        (
                            "down_proj",
                            vec![e, fe, d],
                            [Some("exp"), Some("mlp"), Some("embed")],
                        ),
                    ] {
                        out.push(p(
                            l(&format!("mlp.experts.{name}")),
                            shape,
                            logical.to_vec(),
                            Init::FanIn,
                        ));
                    }
                    if m.shared_experts > 0 {
                        let s = m.shared_experts * fe;
                        for (name, shape, logical) in [
                            ("gate_proj", vec![d, s], [Some("embed"), Some("mlp")]),
                            ("up_proj", vec![d, s], [Some("embed"), Some("mlp")]),
                            ("down_proj", vec![s, d], [Some("mlp"), Some("embed")]),
                        ] {
                            out.push(p(
                                l(&format!("mlp.shared_expert.{name}.weight")),
                                shape,
                                logical.to_vec(),
                                Init::FanIn,
                            ));
                        }
                    }
                }
            }
        }
        out.push(p(
            "model.norm.weight".into(),
            vec![d],
            vec![Some("norm")],
            Init::Ones,
        ));
        if !c.logits_via_embedding {
            out.push(p(
                "lm_head.weight".into(),
                vec![d, c.vocab_size],
                vec![Some("embed"), Some("vocab")],
                Init::FanIn,
            ));
        }
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

    /// The cross-entropy *sum* over the target tokens of a batch (`u32::MAX` targets are
    /// ignored), as a plain scalar. `params` are in [`Qwen3::params`] order, laid out and tagged
    /// by the caller; `inputs` and `targets` are `[B, T]`.
    ///
    /// # Errors
    /// A type error of the ops (a layout the model cannot run).
    pub fn loss_sum(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<Array, SpmdError> {
        let (logits, aux) = self.forward(cx, params, inputs)?;
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

    /// Logits `[B, T, vocab]`, split over the batch like the inputs, vocab replicated.
    ///
    /// # Errors
    /// As [`Qwen3::loss_sum`].
    pub fn logits(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
    ) -> Result<Array, SpmdError> {
        Ok(self.forward(cx, params, inputs)?.0)
    }

    /// Logits and the summed auxiliary losses of the MoE layers (their load-balance losses,
    /// when on).
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
    ) -> Result<(Array, Option<Array>), SpmdError> {
        let c = &self.cfg;
        let mut aux: Option<Array> = None;
        let batch_axes: Vec<String> = inputs.ty().sharding().spec().dim(0).axis_names().to_vec();
        let layout = ActivationLayout { batch: batch_axes };
        let mut it = params.iter();
        let mut next = || {
            it.next().ok_or_else(|| SpmdError::BadArgument {
                op: "qwen3".into(),
                reason: "too few parameters".into(),
            })
        };
        // 1. embedding lookup: x [B, T, d] split like the tokens (the table is gathered first if
        //    it is split, keeping its tags)
        let embed = next()?;
        let table = unsplit(cx, embed)?;
        let mut x = cx.take(&table, inputs)?;
        let dims = AttentionDims {
            heads: c.base_num_query_heads,
            kv_heads: c.base_num_kv_heads,
            head_dim: c.head_dim,
            rope_theta: c.rope_max_timescale,
            eps: c.normalization_layer_epsilon,
        };
        for i in 0..c.base_num_decoder_layers {
            let attn_norm = next()?;
            // 2. x = x + attention(norm(x))
            let h = nn::rms_norm(cx, &x, attn_norm, c.normalization_layer_epsilon)?;
            let a = match &c.mla {
                None => {
                    let w = AttentionWeights {
                        q_proj: next()?,
                        k_proj: next()?,
                        v_proj: next()?,
                        o_proj: next()?,
                        q_norm: next()?,
                        k_norm: next()?,
                    };
                    nn::attention(cx, &h, &w, dims)?
                }
                Some(m) => {
                    let w = MlaWeights {
                        wq_a: next()?,
                        q_norm: next()?,
                        wq_b: next()?,
                        wkv_a: next()?,
                        kv_norm: next()?,
                        wkv_b: next()?,
                        out: next()?,
                    };
                    let mla = MlaDims {
                        heads: c.base_num_query_heads,
                        q_lora_rank: m.q_lora_rank,
                        kv_lora_rank: m.kv_lora_rank,
                        qk_nope_head_dim: m.qk_nope_head_dim,
                        qk_rope_head_dim: m.qk_rope_head_dim,
                        v_head_dim: m.v_head_dim,
                        eps: c.normalization_layer_epsilon,
                        rope: c.rope(),
                    };
                    mla_attention(cx, &h, &w, mla)?
                }
            };
            x = cx.add(&x, &a)?;
            let mlp_norm = next()?;
            // 3. x = x + swiglu(norm(x))
            let h = nn::rms_norm(cx, &x, mlp_norm, c.normalization_layer_epsilon)?;
            let m = match c.moe.as_ref().filter(|_| c.is_moe_layer(i)) {
                None => {
                    let (gate, up, down) = (next()?, next()?, next()?);
                    nn::swiglu(cx, &h, gate, up, down)?
                }
                Some(settings) => {
                    let (router, wi_0, wi_1, wo) = (next()?, next()?, next()?, next()?);
                    let shared = if settings.shared_experts > 0 {
                        Some([next()?.clone(), next()?.clone(), next()?.clone()])
                    } else {
                        None
                    };
                    let weights = MoeWeights {
                        router: router.clone(),
                        router_bias: None,
                        wi_0: wi_0.clone(),
                        wi_1: wi_1.clone(),
                        wo: wo.clone(),
                        shared,
                    };
                    let options = MoeOptions {
                        withhold_tags: settings.withhold_tags,
                    };
                    let out = moe::moe_sparse(cx, &settings.block(), &h, &weights, options)?;
                    if let Some(loss) = out.load_balance_loss {
                        aux = Some(match aux {
                            Some(sum) => cx.add(&sum, &loss)?,
                            None => loss,
                        });
                    }
                    out.y
                }
            };
            x = cx.add(&x, &m)?;
        }
        // 4. final norm and LM head: [B, T, d]·[d, V] (tied: the embedding, transposed)
        let final_norm = next()?;
        let x = nn::rms_norm(cx, &x, final_norm, c.normalization_layer_epsilon)?;
        let logits = if c.logits_via_embedding {
            let dims = DotDims {
                lhs_contracting: vec![2],
                rhs_contracting: vec![1],
                ..Default::default()
            };
            cx.dot_general(&x, &table, &dims, None)?
        } else {
            let head = next()?;
            nn::linear(cx, &x, head)?
        };
        // 5. cross-entropy needs whole vocab rows: gather the vocab dim if it is split
        let want = layout.spec(3);
        let logits = if logits.ty().sharding().spec().partitions() == want.partitions() {
            logits
        } else {
            cx.reshard(&logits, &want)?
        };
        Ok((logits, aux))
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
