//! A layer as a rematerialized region (`remat_policy` other than `none`): the tape keeps the
//! layer's input and what the policy saves; the backward recomputes the rest from them
//! ([`ferrotext_spmd::Ctx::remat`]). The layer's outputs are its hidden states and, for a MoE
//! layer with a load-balance loss, that loss; its expert loads (data, not differentiated) are
//! those of the forward run.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use ferrotext_spmd::{Array, Ctx, RematFn, SavePolicy, SpmdError};

use super::{Decoder, DecoderLayer, ExpertLoads};
use crate::positions::Positions;

impl Decoder {
    /// Layer `i` (bound to `layer`) on `x` as a region saving what `policy` says: its output;
    /// its load-balance loss added to `aux` and its expert loads pushed to `loads`, as
    /// [`DecoderLayer::forward`] does.
    pub(super) fn layer_region(
        &self,
        cx: &mut Ctx<'_>,
        (i, layer): (usize, &DecoderLayer<&Array>),
        x: &Array,
        policy: &SavePolicy,
        (aux, loads): (&mut Option<Array>, &mut ExpertLoads),
        docs: Option<&Positions>,
    ) -> Result<Array, SpmdError> {
        let mut inputs = vec![x.clone()];
        let Ok(_) = layer.try_map(&mut |w: &&Array| {
            inputs.push((*w).clone());
            Ok::<(), Infallible>(())
        });
        let template = self.weights.layers[i].clone();
        let cfg = self.cfg.clone();
        let docs = docs.cloned();
        let forward_loads: Arc<Mutex<Option<ExpertLoads>>> = Arc::default();
        let first_loads = forward_loads.clone();
        let f: RematFn = Arc::new(move |cx, a| {
            let given = a.len();
            let mut weights = a.iter().skip(1);
            let layer = template.try_map(&mut |_| {
                weights.next().ok_or(SpmdError::TooFew {
                    op: "layer_region",
                    what: "layer weights",
                    got: given,
                })
            })?;
            let (mut layer_aux, mut layer_loads) = (None, Vec::new());
            let y = layer.forward(
                cx,
                &a[0],
                (&cfg, i),
                &mut layer_aux,
                &mut layer_loads,
                None,
                docs.as_ref(),
            )?;
            // The forward run's loads; the replay routes the same tokens the same way.
            if let Ok(mut slot) = first_loads.lock() {
                slot.get_or_insert(layer_loads);
            }
            Ok(std::iter::once(y).chain(layer_aux).collect())
        });
        let mut outs = cx.remat(&inputs, policy, f)?.into_iter();
        let y = outs.next().ok_or(SpmdError::Internal {
            op: "layer_region",
            invariant: "a layer has an output",
        })?;
        if let Some(layer_aux) = outs.next() {
            *aux = Some(match aux.take() {
                Some(sum) => cx.add(&sum, &layer_aux)?,
                None => layer_aux,
            });
        }
        if let Some(l) = forward_loads.lock().ok().and_then(|mut s| s.take()) {
            loads.extend(l);
        }
        Ok(y)
    }
}
