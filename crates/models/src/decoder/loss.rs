//! The loss sums of a [`Decoder`]: the main model's cross-entropy (plus z-loss and the MoE
//! auxiliary losses) as a plain scalar or as each device's partial sum, and the training
//! objective, which adds the multi-token-prediction module's term ([`crate::mtp`]).
//!
//! Invariant: one entry point, [`Decoder::loss`], runs one forward pass; only
//! [`LossOptions::with_mtp`] runs the MTP module, so evaluation and the plain loss are the main
//! model's. [`Decoder::loss_sum`] is its plain total, for tests and callers that want no more.

use ferrotext_spmd::{Array, Ctx, HeadLoss, Ids, SpmdError};

use super::{Decoder, LossSum};
use crate::positions::Positions;

/// Which sum [`Decoder::loss`] returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LossOptions {
    /// Each device's own partial sum (`{U:batch axes}`) instead of the plain total.
    pub partial: bool,
    /// The training objective: the multi-token-prediction module's term too, when the model
    /// has it (else the main model's loss, as evaluation scores it).
    pub with_mtp: bool,
}

impl Decoder {
    /// The cross-entropy *sum* over the target tokens of a batch ([`IGNORE_INDEX`] targets are
    /// ignored), as a plain scalar: the main model's loss of [`Decoder::loss`] with the default
    /// [`LossOptions`]. `params` are in [`Decoder::params`] order, laid out and tagged by the
    /// caller; `inputs` and `targets` are `[B, T]`.
    ///
    /// # Errors
    /// As [`Decoder::loss`].
    ///
    /// [`IGNORE_INDEX`]: ferrotext_spmd::IGNORE_INDEX
    pub fn loss_sum(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<Array, SpmdError> {
        Ok(self
            .loss(cx, params, (inputs, None), targets, LossOptions::default())?
            .total)
    }

    /// The loss sums of a batch of `inputs` (packed `docs` when given: attention stays inside
    /// each document and RoPE restarts at each) against `targets`, as `options` say: the
    /// cross-entropy sum (z-loss included) and the MoE auxiliary losses (`total`), this
    /// device's expert loads (`loads`: per MoE layer in layer order, the tokens of this device's
    /// block of the batch routed to each expert, the selection bias applied; empty in abstract
    /// mode — what the aux-loss-free balancing sums over micro-batches and devices), and with
    /// [`LossOptions::with_mtp`] the multi-token-prediction module's term in `total`, scaled as
    /// [`crate::mtp`] says, and its own cross-entropy sum apart (`mtp`).
    ///
    /// With [`LossOptions::partial`] every sum is each device's own over its tokens, a scalar
    /// unreduced over the batch axes (`f32[]{U:data}`, [`Ctx::cross_entropy_partial_sum`]): for
    /// a trainer that adds the partial sums of its micro-batches and devices in an order of its
    /// own before one reduction.
    ///
    /// # Errors
    /// A type error of the ops (a layout the model cannot run), or too few parameters; with
    /// `with_mtp` and the module on, a sequence dim split over devices; with `partial`, a model
    /// with an auxiliary loss (`load_balance_loss_weight` > 0), whose value is a function of the
    /// whole micro-batch's routing, not a sum over devices; packed documents on a layout the
    /// tiled attention does not take.
    pub fn loss(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        (inputs, docs): (&Ids, Option<&Positions>),
        targets: &Ids,
        options: LossOptions,
    ) -> Result<LossSum, SpmdError> {
        let LossOptions { partial, with_mtp } = options;
        let z = self.cfg.z_loss_multiplier;
        let h = self.hidden_and_head(cx, params, inputs, None, docs)?;
        let ce = if self.vocab_tiles > 1 {
            let spec = HeadLoss {
                transposed: h.tied,
                z_loss: z,
                tiles: self.vocab_tiles,
                partial,
                softcap: self.cfg.final_logit_softcapping,
            };
            let head = super::unsplit(cx, &h.head)?;
            cx.head_cross_entropy(&h.x, &head, targets, &spec)?
        } else {
            let logits = self.head(cx, &h, inputs)?;
            if partial {
                cx.cross_entropy_partial_sum(&logits, targets, z)?
            } else {
                cx.cross_entropy_sum(&logits, targets, z)?
            }
        };
        let (aux, loads) = (h.aux.clone(), h.loads.clone());
        let total = match (aux, partial) {
            (Some(_), true) => {
                return Err(SpmdError::NoPartialSum {
                    op: "Decoder::loss (partial)",
                })
            }
            (_, true) => ce,
            // The trainer divides the sum by the step's tokens: an auxiliary loss joins as
            // `aux · tokens` so that it ends up added to the mean.
            (Some(aux), false) => {
                let tokens: usize = inputs.ty().shape().iter().product();
                let aux = cx.scale(&aux, tokens as f32)?;
                cx.add(&ce, &aux)?
            }
            (None, false) => ce,
        };
        let w = self.bind(params)?;
        // The module reads the main model's embedding table and head (shared, not copies).
        let module = w.mtp.as_ref().filter(|_| with_mtp).map(|m| {
            let shared = crate::mtp::Shared {
                table: &h.table,
                head: &h.head,
                tied: h.tied,
            };
            (m, shared)
        });
        crate::mtp::join(
            cx,
            &self.cfg,
            module,
            (total, loads),
            &h.x,
            targets,
            partial,
        )
    }
}
