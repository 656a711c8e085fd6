//! The decoder: Qwen3 (MaxText's `decoder_block: qwen3`, HF `Qwen3ForCausalLM`), Qwen3-MoE (HF
//! `Qwen3MoeForCausalLM`: routed experts, optionally shared ones, the first
//! `first_num_dense_layers` layers dense), DeepSeek-V3 (MLA attention with YaRN and a sigmoid
//! router; its pieces are in [`crate::deepseek`]), Llama 3 (`LlamaForCausalLM`: GQA without
//! QK-norm, Llama 3 RoPE scaling) and Qwen2 (`Qwen2ForCausalLM`: GQA without QK-norm, biases on
//! the q, k, v projections). Presets are in `presets.rs`.
//!
//! Token embedding → N × [RMSNorm → attention (GQA with optional QK-norm and q/k/v biases and
//! rotate-half RoPE, or MLA) →
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
//! weight maps to HF tensors. A bias (on q, k, v, o or the MLP, as the family has them) is a
//! parameter of its own (`[out]`, logical axis of the projection's output), added after the
//! matmul. Left out: dropout.
//!
//! Files: here the [`Decoder`] (checked once in [`Decoder::new`], then the loss, logits and
//! decode entry points); `config` the [`Config`] and its base; `loss` the loss sums (the main
//! model's, and the training objective with the MTP module's term); `weights` the weight map
//! (the MTP module's included) and its declarations; `forward` one layer's forward pass on bound
//! weights; `flops` the training FLOPs a token costs. The layering is one way: `config` ←
//! `weights` ← `forward`/`mtp` ← here.

use ferrotext_sharding::DType;
use ferrotext_spmd::{Array, Ctx, Ids, SpmdError, UnaryOp};

pub use crate::deepseek::MlaSettings;
use crate::kv_cache::KvCache;
pub use crate::mtp::LossSum;
use crate::nn::{self, unsplit, ActivationLayout};
use crate::params::ParamInfo;
use crate::positions::Positions;
use crate::remat::RematPolicy;
pub use crate::router::GroupLimit;

pub(crate) mod config;
mod flops;
mod forward;
mod loss;
mod region;
pub(crate) mod weights;

pub use loss::LossOptions;

pub use config::{
    Config, ConfigError, ExpertLoads, MlpActivation, MoeSettings, NormPlacement, SlidingWindow,
};
use forward::reduced_over;
pub use weights::{Attention, DecoderLayer, DenseMlp, Experts, Gqa, Mlp, SparseMoe, Weights};

/// The trunk's results: the normed last hidden states `x` `[B@batch, T, d]`, the head's weight
/// (`[d, V]`, or the embedding table `[V, d]` when `tied`), the summed auxiliary losses and the
/// expert loads.
struct Hidden {
    x: Array,
    /// The embedding table as the lookup read it (gathered whole; reduced when tied).
    table: Array,
    head: Array,
    tied: bool,
    aux: Option<Array>,
    loads: ExpertLoads,
}

/// A decoder: its config, checked once, and its weight declarations.
#[derive(Clone, Debug)]
pub struct Decoder {
    cfg: Config,
    weights: Weights<ParamInfo>,
    /// The dtype of the activations and matmul inputs (MaxText's `dtype`); weights stay f32.
    compute_dtype: DType,
    /// What the backward keeps of each layer (MaxText's `remat_policy`).
    remat: RematPolicy,
    /// Tiles of tokens the head's loss is computed over (MaxText's `num_vocab_tiling`; 1: the
    /// whole logits at once).
    vocab_tiles: usize,
}

impl Decoder {
    /// Checks the config once, so the forward pass never branches on it.
    ///
    /// # Errors
    /// Zero sizes, `kv_heads` not dividing `heads`, an odd `head_dim` (RoPE pairs dims), MLA or
    /// MoE settings out of range, both YaRN and Llama 3 RoPE scaling, q/k/v biases or QK-norm
    /// asked of MLA, an MTP depth above 1 or a negative or non-finite MTP loss factor.
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
        // MLA gives keys and values one head per query head and never reads the count.
        if cfg.mla.is_none()
            && !cfg
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
        if cfg.rope_yarn.is_some() && cfg.rope_llama3.is_some() {
            return Err(ConfigError(
                "a RoPE table has one frequency scaling: rope_yarn or rope_llama3, not both".into(),
            ));
        }
        if cfg.mla.is_some() && (cfg.qkv_bias || cfg.qk_norm) {
            return Err(ConfigError(
                "qkv_bias and qk_norm are GQA settings; MLA attention has neither".into(),
            ));
        }
        if let Some(m) = &cfg.mla {
            // A zero `q_lora_rank` is MaxText's "no query latent" (HF `q_lora_rank: null`).
            let dims = [
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
            m.groups
                .check(m.num_experts, m.num_experts_per_tok)
                .map_err(ConfigError)?;
            if m.interleave_moe_layer_step == 0 {
                return Err(ConfigError(
                    "interleave_moe_layer_step must be at least 1".into(),
                ));
            }
            if m.shared_expert_gate && m.shared_experts == 0 {
                return Err(ConfigError(
                    "a shared expert gate needs shared_experts > 0".into(),
                ));
            }
        }
        crate::mtp::check(&cfg).map_err(ConfigError)?;
        cfg.check_blocks().map_err(ConfigError)?;
        let weights = Weights::declare(&cfg);
        Ok(Decoder {
            cfg,
            weights,
            compute_dtype: DType::F32,
            remat: RematPolicy::None,
            vocab_tiles: 1,
        })
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// This decoder computing in `dtype` (MaxText's `dtype`): the activations between ops and
    /// the matmul inputs are `dtype`; the weights stay f32 and are converted at use; norms'
    /// statistics, the logits, the loss and the router's scores stay f32 (docs/design.md §10).
    ///
    /// # Errors
    /// A dtype other than `f32` or `bf16`.
    pub fn with_compute_dtype(mut self, dtype: DType) -> Result<Decoder, ConfigError> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(ConfigError(format!(
                "the compute dtype must be f32 or bf16, not {dtype}"
            )));
        }
        self.compute_dtype = dtype;
        Ok(self)
    }

    /// The dtype of the activations and matmul inputs (f32 unless [`Decoder::with_compute_dtype`]
    /// said otherwise).
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    /// This decoder keeping of each layer, for the backward, what `policy` says (MaxText's
    /// `remat_policy`; [`crate::remat`]): the rest is recomputed from the layer's input, with
    /// the same bits. Decoding with a key/value cache never recomputes.
    pub fn with_remat(mut self, policy: RematPolicy) -> Decoder {
        self.remat = policy;
        self
    }

    /// What the backward keeps of each layer.
    pub fn remat(&self) -> RematPolicy {
        self.remat
    }

    /// This decoder computing its training loss over `tiles` tiles of each device's tokens
    /// (MaxText's `num_vocab_tiling`; [`ferrotext_spmd::HeadLoss`]): the `[tokens, vocab]` logits
    /// never exist whole, and the backward recomputes each tile's. 1 (or 0): untiled.
    pub fn with_vocab_tiling(mut self, tiles: usize) -> Decoder {
        self.vocab_tiles = tiles.max(1);
        self
    }

    /// Tiles of tokens the training loss is computed over (1: untiled).
    pub fn vocab_tiles(&self) -> usize {
        self.vocab_tiles
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

    /// The last hidden states `[B, T, d]` after the final norm (transformers'
    /// `last_hidden_state`; what DeepSeek-V3's multi-token prediction reads,
    /// [`crate::mtp`]).
    ///
    /// # Errors
    /// As [`Decoder::logits`].
    pub fn hidden(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
    ) -> Result<Array, SpmdError> {
        let w = self.bind(params)?;
        Ok(self.trunk(cx, &w, inputs, None, None)?.0)
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
        Ok(self.forward(cx, params, inputs, None, None)?.0)
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
            return Err(SpmdError::CacheLayers {
                op: "decode",
                cache: cache.layers(),
                model: self.weights.layers.len(),
            });
        }
        Ok(self.forward(cx, params, inputs, Some(cache), None)?.0)
    }

    /// An empty key/value cache for [`Decoder::decode`].
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.weights.layers.len())
    }

    /// `params` (flat, in [`Decoder::params`] order) bound to the weight map.
    fn bind<'p>(&self, params: &'p [Array]) -> Result<Weights<&'p Array>, SpmdError> {
        let mut it = params.iter();
        self.weights.try_map(&mut |_| {
            it.next().ok_or(SpmdError::TooFew {
                op: "decoder",
                what: "parameters",
                got: params.len(),
            })
        })
    }

    /// Logits, the summed auxiliary losses of the MoE layers (their load-balance losses, when
    /// on), this device's expert loads and the normed last hidden states (what the MTP module
    /// reads). Activations are `[B@batch, T, d]`: the batch split like the tokens.
    #[allow(clippy::type_complexity)]
    fn forward(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        cache: Option<&mut KvCache>,
        docs: Option<&Positions>,
    ) -> Result<(Array, Option<Array>, ExpertLoads, Array), SpmdError> {
        let hidden = self.hidden_and_head(cx, params, inputs, cache, docs)?;
        let logits = self.head(cx, &hidden, inputs)?;
        Ok((logits, hidden.aux, hidden.loads, hidden.x))
    }

    /// Step 3 of [`Decoder::forward`]: the LM head's f32 logits `[B, T, vocab]` of `h`'s hidden
    /// states (`[B, T, d]·[d, V]`; tied: the embedding, transposed), soft-capped when the model
    /// caps them, with whole vocab rows (the vocab dim gathered if it is split) laid out like
    /// `inputs`, as the cross-entropy reads them.
    fn head(&self, cx: &mut Ctx<'_>, h: &Hidden, inputs: &Ids) -> Result<Array, SpmdError> {
        let logits = nn::head_logits(cx, &h.x, &h.head, h.tied)?;
        let logits = match self.cfg.final_logit_softcapping {
            Some(cap) => cx.unary(UnaryOp::Softcap(cap), &logits)?,
            None => logits,
        };
        let want = ActivationLayout::of(inputs).spec(3);
        if logits.ty().sharding().spec().partitions() == want.partitions() {
            Ok(logits)
        } else {
            cx.reshard(&logits, &want)
        }
    }

    /// Steps 1 and 2 of [`Decoder::forward`] and the head's weight: what the head reads.
    fn hidden_and_head(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        cache: Option<&mut KvCache>,
        docs: Option<&Positions>,
    ) -> Result<Hidden, SpmdError> {
        let w = self.bind(params)?;
        let (x, table, aux, loads) = self.trunk(cx, &w, inputs, cache, docs)?;
        let (head, tied) = match w.lm_head {
            None => (table.clone(), true),
            Some(head) => (head.clone(), false),
        };
        Ok(Hidden {
            x,
            table,
            head,
            tied,
            aux,
            loads,
        })
    }

    /// Steps 1 and 2 of [`Decoder::forward`] and the final norm: the normed hidden states
    /// `[B@batch, T, d]`, the embedding table as the head uses it, the auxiliary losses and the
    /// expert loads.
    #[allow(clippy::type_complexity)]
    fn trunk(
        &self,
        cx: &mut Ctx<'_>,
        w: &Weights<&Array>,
        inputs: &Ids,
        mut cache: Option<&mut KvCache>,
        docs: Option<&Positions>,
    ) -> Result<(Array, Array, Option<Array>, ExpertLoads), SpmdError> {
        let c = &self.cfg;
        let layout = ActivationLayout::of(inputs);
        // 1. embedding lookup: x [B@batch, T, d] (the table is gathered first if it is split,
        //    keeping its tags)
        let table = unsplit(cx, w.embed_tokens)?;
        let table = match w.lm_head {
            None => reduced_over(cx, &table, &layout.token_axes())?,
            Some(_) => table,
        };
        let x = match c.pad_token_id {
            Some(pad) => cx.take_frozen(&table, inputs, pad)?,
            None => cx.take(&table, inputs)?,
        };
        let mut x = cx.cast(&x, self.compute_dtype)?;
        if c.scale_embedding {
            // Gemma's `normalizer`: √d, in the activations' dtype.
            x = cx.scale(&x, (c.base_emb_dim as f32).sqrt())?;
        }
        // 2. the layers: x [B@batch, T, d] each
        let mut aux: Option<Array> = None;
        let mut loads = Vec::new();
        let save = self.remat.save_policy();
        for (i, layer) in w.layers.iter().enumerate() {
            let slot = cache.as_deref_mut().and_then(|k| k.slot(i));
            x = match (&save, slot) {
                (Some(policy), None) => {
                    self.layer_region(cx, (i, layer), &x, policy, (&mut aux, &mut loads), docs)?
                }
                (_, slot) => layer.forward(cx, &x, (c, i), &mut aux, &mut loads, slot, docs)?,
            };
        }
        // the final norm
        let x = nn::norm(
            cx,
            &x,
            w.norm,
            c.normalization_layer_epsilon,
            c.norm_plus_one,
        )?;
        Ok((x, table, aux, loads))
    }
}

#[cfg(test)]
mod tests;
