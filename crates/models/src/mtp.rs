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
//! z_i = Head · shared_head.norm(y_i)                        predicts t_{i+2}
//! ```
//!
//! `Emb` and `Head` are the main model's embedding and output head, one parameter each, trained
//! by both losses: the report shares them ("the embedding layer and the output head are shared
//! with the main model"), as MaxText and transformers' `MtpModel` do. The published layer stores
//! copies of them under its own names (`embed_tokens`, `shared_head.head`, [`stored_copies`]):
//! loading reads a copy as the tie itself and refuses one with values of its own; export writes
//! the copies back. `shared_head.norm` is the module's own.
//!
//! The concatenation puts the embedding first, the order that reads the published weights (the
//! paper writes the other). Invariant: [`mtp_loss_sum`] reads only its own weights, the shared
//! embedding and head, and the hidden states; the labels are the targets shifted by one, the last
//! position ignored.
//!
//! # Wiring
//! `mtp_num_layers = 1` ([`Config::mtp_num_layers`]) puts the module's own weights in the
//! decoder's weight map ([`Weights::mtp`](crate::decoder::Weights::mtp), last in the flat order),
//! so loading, export, checkpoints and ZeRO-1 carry its parameters as any other. The decoder's
//! loss sums ([`Decoder::loss`](crate::decoder::Decoder::loss) with `with_mtp`) then add
//! `mtp_loss_scaling_factor × MTP sum × T / (T − 1)` for `[B, T]` inputs: after the trainer's
//! division by the step's tokens that is `factor × the MTP loss's per-token mean` (MaxText's
//! `calculate_mtp_loss`, whose mean is over the `B·(T − 1)` positions that have a token two
//! ahead), exact when no target is ignored. The labels come from the targets on each device
//! (the sequence dim is never split): `next = targets` (an ignored target becomes id 0, whose
//! label is then ignored), `labels[i] = targets[i + 1]`, the last position ignored.
//!
//! Left out: depths above 1 (refused by [`check`]; the published model and transformers have
//! one), the module's MoE load-balance loss and expert loads (not the main model's: dropped, so
//! the aux-loss-free balancing does not move its selection bias), its use in generation (ignored
//! there), and casts of its own to the compute dtype (under `dtype=bfloat16` its ops take the
//! dtypes their inputs arrive in).

use ferrotext_spmd::{Array, Ctx, Ids, SpmdError, IGNORE_INDEX};

use crate::decoder::config::{Config, ExpertLoads};
pub use crate::decoder::weights::Mtp;
use crate::nn::{linear, rms_norm, ActivationLayout};
use crate::params::ParamInfo;

/// The MTP settings of `c` checked (what [`Decoder::new`](crate::decoder::Decoder::new) runs).
///
/// # Errors
/// A depth above 1, or a negative or non-finite loss factor, named with the value.
pub fn check(c: &Config) -> Result<(), String> {
    if c.mtp_num_layers > 1 {
        return Err(format!(
            "mtp_num_layers = {}: only depth 1 is built (DeepSeek-V3's published module, and the \
             one transformers reads); use 0 or 1",
            c.mtp_num_layers
        ));
    }
    let f = c.mtp_loss_scaling_factor;
    if !(f.is_finite() && f >= 0.0) {
        return Err(format!(
            "mtp_loss_scaling_factor must be a finite number ≥ 0, got {f}"
        ));
    }
    Ok(())
}

/// A tensor the published MTP layer stores as a copy of one of the main model's (HF names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredCopy {
    /// The copy's name: `model.layers.{L}.embed_tokens.weight` or
    /// `model.layers.{L}.shared_head.head.weight`.
    pub copy: String,
    /// The main model's tensor it copies: `model.embed_tokens.weight`, or `lm_head.weight` (the
    /// embedding when the head is tied to it).
    pub of: String,
}

/// The copies DeepSeek-V3's published MTP layer stores of the main model's embedding and head,
/// for a model whose parameters are `params` ([`Decoder::params`](crate::decoder::Decoder::params));
/// none without the module. The module reads the main model's tensors themselves: a loader
/// checks each copy against what it copies and reads it no further, and an export writes it.
pub fn stored_copies(params: &[ParamInfo]) -> Vec<StoredCopy> {
    const EMBEDDING: &str = "model.embed_tokens.weight";
    const HEAD: &str = "lm_head.weight";
    let layer = params.iter().find_map(|p| {
        p.name
            .strip_prefix("model.layers.")?
            .strip_suffix(".eh_proj.weight")
    });
    let Some(layer) = layer else {
        return Vec::new();
    };
    let head = if params.iter().any(|p| p.name == HEAD) {
        HEAD
    } else {
        EMBEDDING
    };
    vec![
        StoredCopy {
            copy: format!("model.layers.{layer}.embed_tokens.weight"),
            of: EMBEDDING.into(),
        },
        StoredCopy {
            copy: format!("model.layers.{layer}.shared_head.head.weight"),
            of: head.into(),
        },
    ]
}

/// The parameter count of `c`'s MTP module (0 without it): its own weights, not the embedding
/// and head it shares with the main model.
pub fn param_count(c: &Config) -> usize {
    if c.mtp_num_layers == 0 {
        return 0;
    }
    let params = Mtp::declare(c).params();
    params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum()
}

/// Training FLOPs per token of `c`'s MTP module at sequence length `seq` (0 without it), as
/// [`Decoder::flops_per_token`](crate::decoder::Decoder::flops_per_token) counts the main
/// model's: 6 per matmul weight (`eh_proj`, the layer's projections, of the routed experts only
/// the k a token uses, and the shared head, which the module runs again; not the embedding
/// lookup, norms or biases) plus the layer's attention products.
pub fn flops_per_token(c: &Config, seq: usize) -> f64 {
    if c.mtp_num_layers == 0 {
        return 0.0;
    }
    let m = Mtp::declare(c);
    let active = |p: &ParamInfo| -> f64 {
        let n = p.shape.iter().product::<usize>() as f64;
        match (p.shape.len(), &c.moe) {
            (3, Some(moe)) => n * moe.num_experts_per_tok as f64 / moe.num_experts as f64,
            _ => n,
        }
    };
    // Its own matrices, and the shared head's `d × vocab` (run a second time).
    let weights: f64 = m
        .params()
        .iter()
        .filter(|p| p.shape.len() >= 2)
        .map(active)
        .sum::<f64>()
        + (c.base_emb_dim * c.vocab_size) as f64;
    let (qk, v) = match &c.mla {
        Some(a) => (a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim),
        None => (c.head_dim, c.head_dim),
    };
    6.0 * weights + 6.0 * (seq * c.base_num_query_heads * (qk + v)) as f64
}

/// The main model's weights the module shares, as the main model's forward read them.
#[derive(Clone, Copy)]
pub struct Shared<'a> {
    /// The embedding table `[vocab, d]` as the main lookup reads it (gathered whole; reduced
    /// when tied to the head).
    pub table: &'a Array,
    /// The output head: `lm_head` `[d, vocab]`, or the table itself when `tied`.
    pub head: &'a Array,
    /// The head is the embedding, transposed.
    pub tied: bool,
}

/// The MTP cross-entropy *sum* of a batch: `hidden` `[B, T, d]` are the main model's normed last
/// hidden states at the inputs' positions, `next` `[B, T]` the tokens after each input (the
/// targets), `labels` `[B, T]` the tokens two after (the targets shifted by one, the last
/// position [`IGNORE_INDEX`]). `params` are the module's own, in [`Mtp::params`] order; `shared`
/// the main model's embedding and head.
///
/// # Errors
/// Too few parameters; a type error of the ops.
pub fn mtp_loss_sum(
    cx: &mut Ctx<'_>,
    c: &Config,
    (params, shared): (&[Array], Shared<'_>),
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
    w.loss(cx, c, shared, hidden, (next, labels), false)
}

impl Mtp<&Array> {
    /// The cross-entropy sum of the module (see [`mtp_loss_sum`]); `partial`: left as each
    /// device's partial sum (`f32[]{U:batch}`, [`Ctx::cross_entropy_partial_sum`]).
    pub(crate) fn loss(
        &self,
        cx: &mut Ctx<'_>,
        c: &Config,
        shared: Shared<'_>,
        hidden: &Array,
        (next, labels): (&Ids, &Ids),
        partial: bool,
    ) -> Result<Array, SpmdError> {
        let eps = c.normalization_layer_epsilon;
        // 1. x = eh_proj · [enorm(Emb(next)); hnorm(h)]: [B@batch, T, 2d] → [B@batch, T, d]
        //    (the main model's table, as its lookup read it)
        let e = match c.pad_token_id {
            Some(pad) => cx.take_frozen(shared.table, next, pad)?,
            None => cx.take(shared.table, next)?,
        };
        // The embedding rows in the main model's compute dtype (bf16 under `dtype=bfloat16`).
        let e = cx.cast(&e, hidden.ty().dtype())?;
        let e = rms_norm(cx, &e, self.enorm, eps)?;
        let h = rms_norm(cx, hidden, self.hnorm, eps)?;
        let both = cx.concat(&[&e, &h], 2)?;
        let x = linear(cx, &both, self.eh_proj)?;
        // 2. the decoder layer (its MoE loads and auxiliary loss are not the main model's:
        //    dropped)
        let (mut aux, mut loads) = (None, Vec::new());
        let i = c.base_num_decoder_layers;
        let y = self
            .layer
            .forward(cx, &x, (c, i), &mut aux, &mut loads, None, None)?;
        // 3. its own norm, then the main model's head [B@batch, T, vocab] (f32 logits, never
        //    rounded), whole vocab rows, and the cross-entropy against the tokens two ahead
        let y = rms_norm(cx, &y, self.shared_head_norm, eps)?;
        let z = crate::nn::head_logits(cx, &y, shared.head, shared.tied)?;
        let layout = ActivationLayout::of(next);
        let want = layout.spec(3);
        let z = if z.ty().sharding().spec().partitions() == want.partitions() {
            z
        } else {
            cx.reshard(&z, &want)?
        };
        if partial {
            cx.cross_entropy_partial_sum(&z, labels, 0.0)
        } else {
            cx.cross_entropy_sum(&z, labels, 0.0)
        }
    }
}

/// A batch's loss sum in its parts ([`Decoder::loss`](crate::decoder::Decoder::loss)).
#[derive(Clone, Debug)]
pub struct LossSum {
    /// What the trainer differentiates: the cross-entropy sum (z-loss included), the auxiliary
    /// losses and the scaled MTP term.
    pub total: Array,
    /// The MTP module's cross-entropy sum over its positions, unscaled (`None` without it).
    pub mtp: Option<Array>,
    /// This device's expert loads: per MoE layer in layer order, the tokens of this device's
    /// block of the batch routed to each expert (`[experts]` counts; empty in abstract mode).
    pub loads: ExpertLoads,
}

/// `total` (a loss sum of the `[B, T]` `targets`, with its `loads`) plus, when the module `w` is
/// there (with the main model's weights it shares), `factor · mtp · T / (T − 1)`, with `mtp` the
/// module's cross-entropy sum (partial sums when `partial`).
///
/// # Errors
/// A split sequence dim; a type error of the ops.
pub(crate) fn join(
    cx: &mut Ctx<'_>,
    c: &Config,
    w: Option<(&Mtp<&Array>, Shared<'_>)>,
    (total, loads): (Array, ExpertLoads),
    hidden: &Array,
    targets: &Ids,
    partial: bool,
) -> Result<LossSum, SpmdError> {
    let Some((w, shared)) = w else {
        return Ok(LossSum {
            total,
            mtp: None,
            loads,
        });
    };
    let (next, labels) = shifted(cx, targets)?;
    let mtp = w.loss(cx, c, shared, hidden, (&next, &labels), partial)?;
    let t = targets.ty().shape().get(1).copied().unwrap_or(1);
    let scale = c.mtp_loss_scaling_factor * t as f32 / t.saturating_sub(1).max(1) as f32;
    let scaled = cx.scale(&mtp, scale)?;
    Ok(LossSum {
        total: cx.add(&total, &scaled)?,
        mtp: Some(mtp),
        loads,
    })
}

/// The MTP's `(next, labels)` of `targets` `[B, T]`, built on each device from its rows:
/// `next[i] = targets[i]` (an ignored target becomes id 0), `labels[i] = targets[i + 1]` (ignored
/// where `targets[i]` is), the last position [`IGNORE_INDEX`].
///
/// # Errors
/// A sequence dim split over devices (a row's next token would be on another device).
pub(crate) fn shifted(cx: &Ctx<'_>, targets: &Ids) -> Result<(Ids, Ids), SpmdError> {
    let ty = targets.ty();
    let spec = ty.sharding().spec().clone();
    let t = ty.shape().get(1).copied().unwrap_or(0);
    if ty.rank() != 2 || !ty.sharding().dim_parts(1).is_ok_and(|n| n == 1) {
        return Err(SpmdError::WeightShape {
            op: "mtp",
            name: "targets",
            expected: "[B, T] with the sequence dim whole on every device".into(),
            got: ty.to_string(),
        });
    }
    let local: Vec<u32> = match targets.local() {
        Some(l) => l.to_vec(),
        None => vec![0; ty.shard_shape().iter().product()],
    };
    let next: Vec<u32> = local
        .iter()
        .map(|&x| if x == IGNORE_INDEX { 0 } else { x })
        .collect();
    let mut labels = vec![IGNORE_INDEX; local.len()];
    for (row, out) in local.chunks(t.max(1)).zip(labels.chunks_mut(t.max(1))) {
        for i in 0..t.saturating_sub(1) {
            if row[i] != IGNORE_INDEX {
                out[i] = row[i + 1];
            }
        }
    }
    let shape = ty.shape().to_vec();
    Ok((
        cx.ids_from_local(&shape, spec.clone(), next)?,
        cx.ids_from_local(&shape, spec, labels)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::Mtp;
    use crate::decoder::{Config, Decoder};

    fn tiny(mtp: usize) -> Config {
        let mut c = Config::preset("qwen3-tiny").unwrap();
        c.mtp_num_layers = mtp;
        c
    }

    #[test]
    fn depth_two_and_a_bad_factor_are_refused_by_name() {
        let e = Decoder::new(tiny(2)).unwrap_err().to_string();
        assert!(e.contains("mtp_num_layers = 2"), "{e}");
        for bad in [-0.5, f32::NAN] {
            let mut c = tiny(1);
            c.mtp_loss_scaling_factor = bad;
            let e = Decoder::new(c).unwrap_err().to_string();
            assert!(e.contains("mtp_loss_scaling_factor"), "{e}");
        }
        assert!(Decoder::new(tiny(1)).is_ok(), "mirror: depth 1 builds");
    }

    /// The module comes last in the flat order, under `model.layers.2.*` for two layers, and
    /// leaves the main model's order as it was.
    #[test]
    fn the_module_is_last_and_the_main_order_unchanged() {
        let without: Vec<String> = Decoder::new(tiny(0))
            .unwrap()
            .params()
            .into_iter()
            .map(|p| p.name)
            .collect();
        let with: Vec<String> = Decoder::new(tiny(1))
            .unwrap()
            .params()
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(&with[..without.len()], &without[..]);
        let extra = &with[without.len()..];
        assert_eq!(
            extra.first().map(String::as_str),
            Some("model.layers.2.enorm.weight")
        );
        assert_eq!(
            extra.last().map(String::as_str),
            Some("model.layers.2.shared_head.norm.weight")
        );
        assert!(extra.iter().all(|n| n.starts_with("model.layers.2.")));
    }

    /// The published layer's copies: the embedding's, and the head's (`lm_head`, or the
    /// embedding when tied); none without the module. The module's parameters hold neither.
    #[test]
    fn the_stored_copies_name_the_shared_tensors() {
        use super::{stored_copies, StoredCopy};
        let copy = |copy: &str, of: &str| StoredCopy {
            copy: copy.into(),
            of: of.into(),
        };
        let mut untied = tiny(1);
        untied.logits_via_embedding = false;
        let mut tied = tiny(1);
        tied.logits_via_embedding = true;
        for (c, head) in [
            (untied, "lm_head.weight"),
            (tied, "model.embed_tokens.weight"),
        ] {
            let params = Decoder::new(c.clone()).unwrap().params();
            assert_eq!(
                stored_copies(&params),
                [
                    copy(
                        "model.layers.2.embed_tokens.weight",
                        "model.embed_tokens.weight"
                    ),
                    copy("model.layers.2.shared_head.head.weight", head),
                ]
            );
            let plain = Decoder::new(Config {
                mtp_num_layers: 0,
                ..c.clone()
            })
            .unwrap();
            assert!(stored_copies(&plain.params()).is_empty());
            let own = params.len() - plain.params().len();
            let module = Mtp::declare(&c).params();
            assert_eq!(own, module.len());
            assert!(module
                .iter()
                .all(|p| !p.name.ends_with("embed_tokens.weight")
                    && !p.name.ends_with("shared_head.head.weight")));
        }
    }

    /// qwen3-tiny (d 128, 4 heads of 32, 2 kv heads, MLP 384, vocab 256) at seq 16: the module
    /// adds 6 × (eh_proj 256·128 + q 128·128 + k, v 128·64 each + o 128·128 + MLP 3·128·384 +
    /// head 128·256) + 6·16·4·64, counted by hand.
    #[test]
    fn flops_count_the_module_by_hand() {
        let a = Decoder::new(tiny(0)).unwrap().flops_per_token(16);
        let b = Decoder::new(tiny(1)).unwrap().flops_per_token(16);
        let weights = 256 * 128 + 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384 + 128 * 256;
        let by_hand = 6.0 * weights as f64 + 6.0 * (16 * 4 * 64) as f64;
        assert_eq!(b - a, by_hand);
    }
}
