//! The loss sums of a [`Decoder`]: the main model's cross-entropy (plus z-loss and the MoE
//! auxiliary losses) as a plain scalar or as each device's partial sum, and the training
//! objective, which adds the multi-token-prediction module's term ([`crate::mtp`]).
//!
//! Invariant: every entry point runs one forward pass; the `_parts` ones alone run the MTP
//! module, so evaluation and the plain loss are the main model's.

use ferrotext_spmd::{Array, Ctx, HeadLoss, Ids, SpmdError};

use super::{Decoder, ExpertLoads, LossSum};
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
    /// [`Decoder::loss_sum`] and this device's expert loads: per MoE layer in layer order, the
    /// tokens of this device's block of the batch routed to each expert (`[experts]` counts, the
    /// selection bias applied; empty in abstract mode) — what the aux-loss-free balancing sums
    /// over micro-batches and devices. The main model's loss: an MTP module is not run (see
    /// [`Decoder::loss_sum_parts`]).
    ///
    /// # Errors
    /// As [`Decoder::loss_sum`].
    pub fn loss_sum_and_loads(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<(Array, ExpertLoads), SpmdError> {
        let parts = self.parts(cx, params, (inputs, None), targets, (false, false))?;
        Ok((parts.total, parts.loads))
    }

    /// The training objective's sum: [`Decoder::loss_sum_and_loads`] plus, when the model has
    /// the multi-token-prediction module, its term scaled as [`crate::mtp`] says, and the
    /// module's own cross-entropy sum apart (`mtp`).
    ///
    /// # Errors
    /// As [`Decoder::loss_sum`]; a sequence dim split over devices when the module is on.
    pub fn loss_sum_parts(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<LossSum, SpmdError> {
        self.parts(cx, params, (inputs, None), targets, (false, true))
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
        Ok(self
            .loss_partial_sum_and_loads(cx, params, inputs, targets)?
            .0)
    }

    /// [`Decoder::loss_partial_sum`] and this device's expert loads (as
    /// [`Decoder::loss_sum_and_loads`]).
    ///
    /// # Errors
    /// As [`Decoder::loss_partial_sum`].
    pub fn loss_partial_sum_and_loads(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<(Array, ExpertLoads), SpmdError> {
        let parts = self.parts(cx, params, (inputs, None), targets, (true, false))?;
        Ok((parts.total, parts.loads))
    }

    /// [`Decoder::loss_sum_parts`] as partial sums (as [`Decoder::loss_partial_sum`]).
    ///
    /// # Errors
    /// As [`Decoder::loss_partial_sum`].
    pub fn loss_partial_sum_parts(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        inputs: &Ids,
        targets: &Ids,
    ) -> Result<LossSum, SpmdError> {
        self.parts(cx, params, (inputs, None), targets, (true, true))
    }

    /// The loss sums of a batch of `inputs` (packed `docs` when given: attention stays inside
    /// each document and RoPE restarts at each) against `targets`, as `options` say: the
    /// entry point the other `loss_*` methods specialise.
    ///
    /// # Errors
    /// As [`Decoder::loss_sum`]; as [`Decoder::loss_partial_sum`] for `partial`; packed
    /// documents on a layout the tiled attention does not take.
    pub fn loss(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        (inputs, docs): (&Ids, Option<&Positions>),
        targets: &Ids,
        options: LossOptions,
    ) -> Result<LossSum, SpmdError> {
        self.parts(
            cx,
            params,
            (inputs, docs),
            targets,
            (options.partial, options.with_mtp),
        )
    }

    /// The loss sums: `partial` as each device's own ([`Ctx::cross_entropy_partial_sum`]);
    /// `with_mtp`: the MTP module's term too, when the model has it.
    fn parts(
        &self,
        cx: &mut Ctx<'_>,
        params: &[Array],
        (inputs, docs): (&Ids, Option<&Positions>),
        targets: &Ids,
        (partial, with_mtp): (bool, bool),
    ) -> Result<LossSum, SpmdError> {
        let z = self.cfg.z_loss_multiplier;
        let (ce, aux, loads, hidden) = if self.vocab_tiles > 1 {
            let h = self.hidden_and_head(cx, params, inputs, None, docs)?;
            let spec = HeadLoss {
                transposed: h.tied,
                z_loss: z,
                tiles: self.vocab_tiles,
                partial,
                softcap: self.cfg.final_logit_softcapping,
            };
            let head = super::unsplit(cx, &h.head)?;
            let ce = cx.head_cross_entropy(&h.x, &head, targets, &spec)?;
            (ce, h.aux, h.loads, h.x)
        } else {
            let (logits, aux, loads, hidden) = self.forward(cx, params, inputs, None, docs)?;
            let ce = if partial {
                cx.cross_entropy_partial_sum(&logits, targets, z)?
            } else {
                cx.cross_entropy_sum(&logits, targets, z)?
            };
            (ce, aux, loads, hidden)
        };
        let total = match (aux, partial) {
            (Some(_), true) => {
                return Err(SpmdError::NoPartialSum {
                    op: "loss_partial_sum",
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
        let (c, w) = (&self.cfg, self.bind(params)?.mtp.filter(|_| with_mtp));
        let m = w.as_ref();
        crate::mtp::join(cx, c, m, (total, loads), &hidden, targets, partial)
    }
}
