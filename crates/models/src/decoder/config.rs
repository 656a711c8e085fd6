//! The decoder's [`Config`] (named like MaxText's model keys), its MoE settings, and their one
//! base ([`Default`]) that every preset and reader starts from.

use ferrotext_tensor::{Llama3, PositionScaling, Rope, Yarn};

use crate::deepseek::MlaSettings;
use crate::moe::{MoeConfig, RouterScore};
use crate::router::GroupLimit;

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
    /// Group-limited routing (`n_routing_groups`, `topk_routing_group`).
    pub groups: GroupLimit,
    /// A selection-only router bias per MoE layer (`routed_bias`; HF
    /// `mlp.gate.e_score_correction_bias`), declared as a zero-initialised `[experts]` weight.
    pub routed_bias: bool,
    /// Diagnostic mirror: drop the expert weights' tags before the MoE region (see
    /// [`MoeOptions::withhold_tags`](crate::moe::MoeOptions::withhold_tags)).
    pub withhold_tags: bool,
    /// The shared experts' width when it is not `shared_experts × moe_mlp_dim` (Qwen2-MoE's
    /// `shared_expert_intermediate_size`).
    pub shared_mlp_dim: Option<usize>,
    /// The shared experts' output times `sigmoid(x·w)` of a `[d, 1]` gate (Qwen2-MoE's
    /// `shared_expert_gate`).
    pub shared_expert_gate: bool,
    /// Past the leading dense layers, layer `i` is MoE when `(i + 1)` is a multiple of this
    /// (MaxText's `interleave_moe_layer_step`; HF `decoder_sparse_step`); 1: every layer.
    pub interleave_moe_layer_step: usize,
}

impl MoeSettings {
    /// The MoE block's routing settings.
    pub(crate) fn block(&self) -> MoeConfig {
        MoeConfig {
            num_experts: self.num_experts,
            num_experts_per_tok: self.num_experts_per_tok,
            score: self.score,
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling_factor: self.routed_scaling_factor,
            load_balance_loss_weight: self.load_balance_loss_weight,
            groups: self.groups,
        }
    }
}

/// Where a layer's RMSNorms sit around its two sub-layers (attention, MLP).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormPlacement {
    /// `x + f(norm(x))` (Llama, Qwen, DeepSeek, Mistral): `input_layernorm` before attention,
    /// `post_attention_layernorm` before the MLP.
    #[default]
    Pre,
    /// `x + norm₂(f(norm₁(x)))` (Gemma 2/3): `input_layernorm` / `post_attention_layernorm`
    /// around attention, `pre_feedforward_layernorm` / `post_feedforward_layernorm` around the
    /// MLP.
    PrePost,
    /// `x + norm(f(x))` (OLMo 2): `post_attention_layernorm` after attention,
    /// `post_feedforward_layernorm` after the MLP, nothing before either.
    Post,
}

/// The gate activation of the MLP: `act(x·gate) ⊙ x·up`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MlpActivation {
    /// SiLU: SwiGLU (Llama, Qwen, DeepSeek, Mistral, OLMo 2).
    #[default]
    Silu,
    /// GELU with the tanh approximation: GeGLU (Gemma; HF `gelu_pytorch_tanh`).
    GeluTanh,
}

/// Sliding-window attention: on the layers it covers, a query at position `i` sees the keys at
/// `i − size < j ≤ i`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlidingWindow {
    /// The window (`sliding_window`), its own position included.
    pub size: usize,
    /// Which layers slide (HF `layer_types`: `true` for `sliding_attention`), one per layer;
    /// empty: every layer (Mistral).
    pub layers: Vec<bool>,
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
    /// Llama 3's RoPE frequency scaling (HF `rope_type: llama3`; `None`: plain frequencies).
    pub rope_llama3: Option<Llama3>,
    /// Per-head RMSNorm of the queries and keys before RoPE (Qwen3's QK-norm; Llama and Qwen2
    /// have none). GQA only: MLA has its own latent norms.
    pub qk_norm: bool,
    /// Biases on the q, k and v projections (Qwen2's; GQA only).
    pub qkv_bias: bool,
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
    /// Multi-token-prediction depth (`mtp_num_layers`): 0 none, 1 DeepSeek-V3's module
    /// ([`crate::mtp`]) after the last layer, trained beside the main loss.
    pub mtp_num_layers: usize,
    /// Weight of the MTP loss (per-token mean) added to the main loss's mean
    /// (`mtp_loss_scaling_factor`, MaxText's default 0.1).
    pub mtp_loss_scaling_factor: f32,
    /// `linear` or `dynamic` RoPE position scaling (HF `rope_type`; `None`: neither).
    pub rope_scaling: Option<PositionScaling>,
    /// A bias on the attention's output projection (HF `attention_bias` with `qkv_bias`; GQA).
    pub attention_out_bias: bool,
    /// Biases on the dense MLP's three projections (HF `mlp_bias`).
    pub mlp_bias: bool,
    /// QK-norm over all heads at once, before the heads are split (OLMo 2: `q_norm` is
    /// `[heads·head_dim]`), instead of per head; needs `qk_norm`.
    pub qk_norm_all_heads: bool,
    /// Where the layers' norms sit ([`NormPlacement`]).
    pub norm_placement: NormPlacement,
    /// Every RMSNorm scales by `1 + w` instead of `w` (Gemma; its weights are stored so).
    pub norm_plus_one: bool,
    /// The embedding rows times `√base_emb_dim` (Gemma's `normalizer`).
    pub scale_embedding: bool,
    /// The MLP's gate activation.
    pub mlp_activation: MlpActivation,
    /// The attention's scale is `query_pre_attn_scalar^−½` instead of `head_dim^−½` (Gemma).
    pub query_pre_attn_scalar: Option<f32>,
    /// Attention-logit soft-capping: logits `cap·tanh(s/cap)` before the softmax (Gemma 2).
    pub attn_logit_softcapping: Option<f32>,
    /// Final-logit soft-capping: the LM head's logits `cap·tanh(z/cap)` (Gemma 2).
    pub final_logit_softcapping: Option<f32>,
    /// Sliding-window attention on some or all layers (Mistral, Gemma 2/3, Qwen's
    /// `use_sliding_window`).
    pub sliding_window: Option<SlidingWindow>,
    /// RoPE θ of the sliding layers when it is not the full layers' (Gemma 3's
    /// `rope_local_base_freq`; plain RoPE there, whatever scaling the full layers have).
    pub sliding_rope_theta: Option<f32>,
    /// The pad token's row of the embedding (HF `pad_token_id`), whose lookups pass no gradient
    /// back: transformers builds every family's embedding as `nn.Embedding(padding_idx =
    /// pad_token_id)`, so that row learns only from a head tied to the table. The forward is
    /// unchanged. `None` (every row learns from its lookups) for presets, MaxText's behaviour.
    pub pad_token_id: Option<u32>,
}

/// The one base every preset and reader starts from (`..Config::default()`): a plain pre-norm
/// dense decoder (Llama's blocks: GQA without QK-norm or biases, SwiGLU, untied head, θ 10000,
/// ε 1e-6, no RoPE scaling, no MoE, MLA or MTP module, MaxText's `mtp_loss_scaling_factor` 0.1)
/// at CPU size (vocabulary 256, width 128, 2 layers of 4 query and 2 key/value heads of 32, MLP
/// 384). A default written once here is the default everywhere.
impl Default for Config {
    fn default() -> Config {
        Config {
            vocab_size: 256,
            base_emb_dim: 128,
            base_num_decoder_layers: 2,
            base_num_query_heads: 4,
            base_num_kv_heads: 2,
            head_dim: 32,
            base_mlp_dim: 384,
            logits_via_embedding: false,
            rope_max_timescale: 10_000.0,
            rope_llama3: None,
            qk_norm: false,
            qkv_bias: false,
            normalization_layer_epsilon: 1e-6,
            z_loss_multiplier: 0.0,
            moe: None,
            mla: None,
            rope_yarn: None,
            mtp_num_layers: 0,
            mtp_loss_scaling_factor: 0.1,
            rope_scaling: None,
            attention_out_bias: false,
            mlp_bias: false,
            qk_norm_all_heads: false,
            norm_placement: NormPlacement::Pre,
            norm_plus_one: false,
            scale_embedding: false,
            mlp_activation: MlpActivation::Silu,
            query_pre_attn_scalar: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            sliding_window: None,
            sliding_rope_theta: None,
            pad_token_id: None,
        }
    }
}

/// The base of every MoE preset and reader: 8 routed experts, top-2 by softmax, renormalised,
/// width 384, no shared experts, every layer MoE, no groups, selection bias or load-balance loss.
impl Default for MoeSettings {
    fn default() -> MoeSettings {
        MoeSettings {
            num_experts: 8,
            num_experts_per_tok: 2,
            moe_mlp_dim: 384,
            shared_experts: 0,
            first_num_dense_layers: 0,
            score: RouterScore::Softmax,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
            load_balance_loss_weight: 0.0,
            groups: GroupLimit::default(),
            routed_bias: false,
            withhold_tags: false,
            shared_mlp_dim: None,
            shared_expert_gate: false,
            interleave_moe_layer_step: 1,
        }
    }
}

impl Config {
    /// The building blocks' settings of `c` checked: windows, soft-caps and scales in range, each
    /// block only where the decoder builds it.
    pub(crate) fn check_blocks(&self) -> Result<(), String> {
        let c = self;
        if let Some(w) = &c.sliding_window {
            if w.size == 0 {
                return Err("sliding_window must be at least 1".into());
            }
            if !w.layers.is_empty() && w.layers.len() != c.base_num_decoder_layers {
                return Err(format!(
                    "the sliding layers list {} entries for {} layers",
                    w.layers.len(),
                    c.base_num_decoder_layers
                ));
            }
        }
        if c.sliding_rope_theta.is_some() && c.sliding_window.is_none() {
            return Err("sliding_rope_theta needs a sliding window".into());
        }
        let positive = [
            ("attn_logit_softcapping", c.attn_logit_softcapping),
            ("final_logit_softcapping", c.final_logit_softcapping),
            ("query_pre_attn_scalar", c.query_pre_attn_scalar),
            ("sliding_rope_theta", c.sliding_rope_theta),
        ];
        for (key, v) in positive {
            if let Some(x) = v.filter(|x| !(x.is_finite() && *x > 0.0)) {
                return Err(format!("{key} must be a positive number, got {x}"));
            }
        }
        if c.rope_scaling.is_some() && (c.rope_yarn.is_some() || c.rope_llama3.is_some()) {
            return Err(
                "a RoPE table has one frequency scaling: rope_scaling, rope_yarn or rope_llama3"
                    .into(),
            );
        }
        if c.mla.is_some() && (c.attention_out_bias || c.qk_norm_all_heads) {
            return Err("attention_out_bias and qk_norm_all_heads are GQA settings".into());
        }
        if c.qk_norm_all_heads && !c.qk_norm {
            return Err("qk_norm_all_heads needs qk_norm".into());
        }
        Ok(())
    }

    /// The RoPE variant: interleaved pairs for MLA models that ask for them
    /// ([`MlaSettings::rope_interleave`]), else rotate-half; YaRN or Llama 3 frequencies when set.
    pub fn rope(&self) -> Rope {
        Rope {
            theta: self.rope_max_timescale,
            interleaved: self.mla.as_ref().is_some_and(|m| m.rope_interleave),
            yarn: self.rope_yarn,
            llama3: self.rope_llama3,
            scaling: self.rope_scaling,
        }
    }

    /// The RoPE of layer `i`: [`Config::rope`], or plain RoPE of `sliding_rope_theta` on a
    /// sliding layer when that is set (Gemma 3).
    pub fn layer_rope(&self, i: usize) -> Rope {
        match self.sliding_rope_theta {
            Some(theta) if self.window_of(i).is_some() => Rope::standard(theta),
            _ => self.rope(),
        }
    }

    /// The sliding window of layer `i`, `None` on a full-attention layer.
    pub fn window_of(&self, i: usize) -> Option<usize> {
        let w = self.sliding_window.as_ref()?;
        (w.layers.is_empty() || w.layers.get(i).copied().unwrap_or(false)).then_some(w.size)
    }

    /// The attention's scale on `q·k` for query/key heads of width `qk`: `qk^−½`, or
    /// `query_pre_attn_scalar^−½` when set.
    pub fn attention_scale(&self, qk: usize) -> f32 {
        match self.query_pre_attn_scalar {
            Some(s) => 1.0 / s.sqrt(),
            None => 1.0 / (qk as f32).sqrt(),
        }
    }

    /// True when layer `i` has the MoE feed-forward: past the leading dense layers, every
    /// `interleave_moe_layer_step`-th layer (counting from 1).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| {
            i >= m.first_num_dense_layers
                && (i + 1).is_multiple_of(m.interleave_moe_layer_step.max(1))
        })
    }

    /// The shared experts' width (0: none).
    pub fn shared_mlp_dim(&self) -> usize {
        self.moe.as_ref().map_or(0, |m| match m.shared_mlp_dim {
            Some(w) if m.shared_experts > 0 => w,
            _ => m.shared_experts * m.moe_mlp_dim,
        })
    }
}

/// Per MoE layer (layer order), one device's tokens routed to each expert: `loads[l][e]`.
pub type ExpertLoads = Vec<Vec<f32>>;

/// Why a config cannot build a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid model config: {0}")]
pub struct ConfigError(pub String);
