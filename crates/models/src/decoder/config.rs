//! The decoder's [`Config`] (named like MaxText's model keys), its MoE settings, and their one
//! base ([`Default`]) that every preset and reader starts from.

use ferrotext_tensor::{Llama3, Rope, Yarn};

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
        }
    }
}

impl Config {
    /// The RoPE variant: interleaved pairs for MLA models that ask for them
    /// ([`MlaSettings::rope_interleave`]), else rotate-half; YaRN or Llama 3 frequencies when set.
    pub fn rope(&self) -> Rope {
        Rope {
            theta: self.rope_max_timescale,
            interleaved: self.mla.as_ref().is_some_and(|m| m.rope_interleave),
            yarn: self.rope_yarn,
            llama3: self.rope_llama3,
        }
    }

    /// True when layer `i` has the MoE feed-forward.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| i >= m.first_num_dense_layers)
    }
}

/// Per MoE layer (layer order), one device's tokens routed to each expert: `loads[l][e]`.
pub type ExpertLoads = Vec<Vec<f32>>;

/// Why a config cannot build a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid model config: {0}")]
pub struct ConfigError(pub String);
