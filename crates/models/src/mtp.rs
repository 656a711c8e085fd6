//! DeepSeek-V3's multi-token prediction module, depth 1 (DeepSeek-V3 report, section 2.2; MaxText
//! `mtp_num_layers`), as the published checkpoint stores it: layer `model.layers.{L}`, `L` =
//! `num_hidden_layers`, with `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, a full decoder layer,
//! and `shared_head.{norm, head}`.
//!
//! For a row `t_0..t_{T}` (inputs `t_0..t_{T-1}`, targets `t_1..t_T`) and the main model's last
//! hidden states `h_i` after its final norm ([`crate::decoder::Decoder::hidden`]):
//!
//! ```text
//! x_i = eh_proj · [ enorm(Emb(t_{i+1})) ; hnorm(h_i) ]     (the embedding first)
//! y   = DecoderLayer_L(x)                                   (causal, RoPE position of x_i is i)
//! z_i = shared_head.head · shared_head.norm(y_i)            predicts t_{i+2}
//! ```
//!
//! The concatenation puts the embedding first, the order that reads the published weights (the
//! paper writes the other). Invariant: [`mtp_loss_sum`] reads only its own weights and the
//! hidden states; the labels are the targets shifted by one, the last position ignored.
//!
//! Left out (issue 29 item 3, not done): the `mtp_num_layers` config key, training with the loss
//! scaled by `mtp_loss_scaling_factor`, and loading and export through the decoder's weight map;
//! a directory with the layer is refused at load today.

use ferrotext_spmd::{Array, Ctx, Ids, SpmdError};

use crate::decoder::{matrix, norm_scale, Config, DecoderLayer};
use crate::nn::{linear, rms_norm};
use crate::params::{HfLayout, Init, ParamInfo};

/// The weights of a depth-1 MTP module (`model.layers.{L}.*`, HF names), matrices `[in, out]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Mtp<W> {
    /// `embed_tokens.weight` `[vocab, d]` (the published layer's copy of the embedding).
    pub embed_tokens: W,
    /// `enorm.weight` `[d]`: the RMSNorm of the next token's embedding.
    pub enorm: W,
    /// `hnorm.weight` `[d]`: the RMSNorm of the main model's hidden state.
    pub hnorm: W,
    /// `eh_proj.weight` `[2d, d]`.
    pub eh_proj: W,
    /// The decoder layer (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`).
    pub layer: DecoderLayer<W>,
    /// `shared_head.norm.weight` `[d]`.
    pub shared_head_norm: W,
    /// `shared_head.head.weight` `[d, vocab]`.
    pub shared_head_head: W,
}

impl<W> Mtp<W> {
    /// This structure with every weight replaced by `f(weight)`, in field order (the flat order
    /// of [`Mtp::declare`]'s parameters).
    ///
    /// # Errors
    /// The first error of `f`.
    pub fn try_map<U, E>(&self, f: &mut impl FnMut(&W) -> Result<U, E>) -> Result<Mtp<U>, E> {
        Ok(Mtp {
            embed_tokens: f(&self.embed_tokens)?,
            enorm: f(&self.enorm)?,
            hnorm: f(&self.hnorm)?,
            eh_proj: f(&self.eh_proj)?,
            layer: self.layer.try_map(f)?,
            shared_head_norm: f(&self.shared_head_norm)?,
            shared_head_head: f(&self.shared_head_head)?,
        })
    }
}

impl Mtp<ParamInfo> {
    /// The declarations of `c`'s MTP layer, `model.layers.{num layers}.*`.
    pub fn declare(c: &Config) -> Mtp<ParamInfo> {
        let i = c.base_num_decoder_layers;
        let l = |s: &str| format!("model.layers.{i}.{s}");
        let d = c.base_emb_dim;
        let embed = l("embed_tokens.weight");
        Mtp {
            embed_tokens: ParamInfo {
                hf: HfLayout::Tensor {
                    name: embed.clone(),
                    transposed: false,
                },
                name: embed,
                shape: vec![c.vocab_size, d],
                logical: vec![Some("vocab"), Some("embed")],
                init: Init::Normal { std: 0.02 },
            },
            enorm: norm_scale(l("enorm.weight"), d, Some("norm")),
            hnorm: norm_scale(l("hnorm.weight"), d, Some("norm")),
            eh_proj: matrix(l("eh_proj.weight"), [2 * d, d], [None, Some("embed")]),
            layer: DecoderLayer::declare(c, i),
            shared_head_norm: norm_scale(l("shared_head.norm.weight"), d, Some("norm")),
            shared_head_head: matrix(
                l("shared_head.head.weight"),
                [d, c.vocab_size],
                [Some("embed"), Some("vocab")],
            ),
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

/// The MTP cross-entropy *sum* of a batch: `hidden` `[B, T, d]` are the main model's normed last
/// hidden states at the inputs' positions, `next` `[B, T]` the tokens after each input (the
/// targets), `labels` `[B, T]` the tokens two after (the targets shifted by one, the last
/// position [`IGNORE_INDEX`](ferrotext_spmd::IGNORE_INDEX)). `params` in [`Mtp::params`] order.
///
/// # Errors
/// Too few parameters; a type error of the ops.
pub fn mtp_loss_sum(
    cx: &mut Ctx<'_>,
    c: &Config,
    params: &[Array],
    hidden: &Array,
    next: &Ids,
    labels: &Ids,
) -> Result<Array, SpmdError> {
    let mut it = params.iter();
    let w = Mtp::declare(c).try_map(&mut |_| {
        it.next().ok_or(SpmdError::TooFew {
            op: "mtp",
            what: "parameters",
            got: params.len(),
        })
    })?;
    let eps = c.normalization_layer_epsilon;
    // 1. x = eh_proj · [enorm(Emb(next)); hnorm(h)]: [B, T, 2d] → [B, T, d]
    let e = cx.take(w.embed_tokens, next)?;
    let e = rms_norm(cx, &e, w.enorm, eps)?;
    let h = rms_norm(cx, hidden, w.hnorm, eps)?;
    let both = cx.concat(&[&e, &h], 2)?;
    let x = linear(cx, &both, w.eh_proj)?;
    // 2. the decoder layer (its MoE loads and auxiliary loss are not the main model's: dropped)
    let (mut aux, mut loads) = (None, Vec::new());
    let y = w.layer.forward(cx, &x, c, &mut aux, &mut loads, None)?;
    // 3. the shared head and the cross-entropy against the tokens two ahead
    let y = rms_norm(cx, &y, w.shared_head_norm, eps)?;
    let z = linear(cx, &y, w.shared_head_head)?;
    cx.cross_entropy_sum(&z, labels, 0.0)
}
