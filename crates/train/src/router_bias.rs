//! DeepSeek-V3's auxiliary-loss-free load balancing (DeepSeek-V3 report, sect. 2.1.2; MaxText
//! `routed_bias_update_rate`): after each optimizer step, every MoE layer's router selection bias
//! moves by `rate · sign(mean load − load_e)` per expert — up for an expert that got fewer tokens
//! than the mean, down for one that got more, unchanged at the mean.
//!
//! The loads are the step's: every micro-batch's routing counted on each device
//! ([`Decoder::loss`]'s `loads`), summed locally across micro-batches, then summed over the
//! devices **once per step** — one all-reduce of `layers × experts` f32 values (4 bytes each:
//! 58 × 16 × 4 = 3.7 KB for `deepseek3-tiny`), in `update`, beside the gradients' reduction.
//! Devices that share a block of the batch (tensor or any non-batch axis) route the same tokens,
//! so only the batch axes sum.
//!
//! Invariants: the bias is a replicated parameter (`mlp.gate.e_score_correction_bias`) that no
//! op differentiates: its gradient is zero, the optimizer leaves it (no weight decay on 1-D
//! values), and this update is the only thing that moves it — identically on every device,
//! since every device holds the same reduced loads. A skipped step (`nan_policy=skip_step`)
//! moves nothing.
//!
//! [`Decoder::loss`]: ferrotext_models::decoder::Decoder::loss

use ferrotext_models::decoder::{Decoder, ExpertLoads, Mlp};
use ferrotext_sharding::{DimSpec, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, Mode};
use ferrotext_tensor::Tensor;

use crate::error::TrainError;

/// `bias_e += rate · sign(mean(load) − load_e)` for every expert `e` (`sign(0) = 0`).
pub fn bias_update(bias: &mut [f32], load: &[f32], rate: f32) {
    let mean = load.iter().map(|&l| f64::from(l)).sum::<f64>() / load.len().max(1) as f64;
    for (b, &l) in bias.iter_mut().zip(load) {
        let gap = mean - f64::from(l);
        if gap > 0.0 {
            *b += rate;
        } else if gap < 0.0 {
            *b -= rate;
        }
    }
}

/// The balancing of one run: which parameters are selection biases, and the rate.
#[derive(Clone, Debug)]
pub(crate) struct RouterBalance {
    /// Flat parameter index of each MoE layer's selection bias, in layer order (the order of
    /// [`ExpertLoads`]).
    biases: Vec<usize>,
    experts: usize,
    rate: f32,
}

impl RouterBalance {
    /// The balancing of `decoder` at `rate`, or `None` when there is none to do (rate 0, or a
    /// model without selection biases — the config check refuses a positive rate there).
    pub(crate) fn new(decoder: &Decoder, rate: f64) -> Option<RouterBalance> {
        let experts = decoder.config().moe.as_ref()?.num_experts;
        let params = decoder.params();
        let biases: Vec<usize> = decoder
            .weights()
            .layers
            .iter()
            .filter_map(|l| match &l.mlp {
                Mlp::Moe(m) => m.e_score_correction_bias.as_ref(),
                Mlp::Dense(_) => None,
            })
            .filter_map(|info| params.iter().position(|p| p.name == info.name))
            .collect();
        (rate > 0.0 && !biases.is_empty()).then_some(RouterBalance {
            biases,
            experts,
            rate: rate as f32,
        })
    }

    /// `loads` (one micro-batch's, this device's) added into the step's running sum `acc`.
    pub(crate) fn add(acc: &mut ExpertLoads, loads: ExpertLoads) {
        if acc.is_empty() {
            *acc = loads;
            return;
        }
        for (a, l) in acc.iter_mut().zip(loads) {
            for (x, y) in a.iter_mut().zip(l) {
                *x += y;
            }
        }
    }

    /// The step's loads summed over the devices' blocks of the batch (split over the axes of
    /// `batch_spec`'s first dim), flat `[layers · experts]`; `None` in abstract mode.
    ///
    /// # Collectives
    /// One all-reduce of `layers × experts` f32 over the batch axes (recorded in abstract mode
    /// too).
    pub(crate) fn reduce(
        &self,
        cx: &mut Ctx<'_>,
        batch_spec: &PartitionSpec,
        local: &ExpertLoads,
    ) -> Result<Option<Vec<f32>>, TrainError> {
        let n = self.biases.len() * self.experts;
        let batch = batch_spec.dim(0).clone();
        let blocks: usize = batch
            .axis_names()
            .iter()
            .map(|a| cx.mesh().axis(a).map_or(1, |m| m.size()))
            .product();
        // [blocks@batch, n]: each device's row is its loads; the sum over rows is the reduction.
        let spec = PartitionSpec::new(vec![batch, DimSpec::Replicated]);
        let ty = cx.array_type(&[blocks, n], spec)?;
        let rows = if cx.mode() == Mode::Abstract {
            cx.abstract_array(ty)
        } else {
            let flat: Vec<f32> = local.iter().flatten().copied().collect();
            if flat.len() != n {
                return Err(TrainError::Internal(format!(
                    "expert loads of {} values for {} MoE layers × {} experts",
                    flat.len(),
                    self.biases.len(),
                    self.experts
                )));
            }
            cx.from_local(ty, Tensor::new(vec![1, n], flat)?)?
        };
        let total = cx.reduce_sum(&rows, &[0], Some(&PartitionSpec::replicated()))?;
        Ok(match total.local() {
            Ok(t) => Some(t.data().to_vec()),
            Err(_) => None,
        })
    }

    /// A device's share of the step's summed `totals` (`[layers · experts]`, a checkpoint's):
    /// the totals on the `first` device along the batch axes, zeros elsewhere, so that
    /// [`RouterBalance::reduce`] gives the totals back.
    ///
    /// # Errors
    /// Totals of another length than `layers × experts`.
    pub(crate) fn split_loads(
        &self,
        totals: &[f32],
        first: bool,
    ) -> Result<ExpertLoads, TrainError> {
        if totals.len() != self.biases.len() * self.experts {
            return Err(TrainError::Checkpoint {
                path: "manifest.json".into(),
                problem: crate::checkpoint::problem::CheckpointProblem::ExpertLoadsCount {
                    values: totals.len(),
                    layers: self.biases.len(),
                    experts: self.experts,
                },
            });
        }
        Ok(totals
            .chunks(self.experts)
            .map(|l| {
                if first {
                    l.to_vec()
                } else {
                    vec![0.0; l.len()]
                }
            })
            .collect())
    }

    /// Every selection bias moved by [`bias_update`] from the reduced `loads`
    /// (`[layers · experts]`), in place on `params` (replicated: each device moves its copy
    /// alike).
    pub(crate) fn apply(&self, params: &mut [Array], loads: &[f32]) -> Result<(), TrainError> {
        for (layer, &i) in self.biases.iter().enumerate() {
            let load = &loads[layer * self.experts..(layer + 1) * self.experts];
            let p = params
                .get_mut(i)
                .ok_or_else(|| TrainError::Internal(format!("no parameter {i}")))?;
            bias_update(p.local_mut()?.data_mut(), load, self.rate);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loads [5, 1, 3, 3] (mean 3): the overloaded expert goes down by the rate, the
    /// underloaded one up, the two at the mean stay.
    #[test]
    fn the_update_moves_by_the_rate_against_the_load() {
        let mut bias = vec![0.5, -0.25, 0.0, 1.0];
        bias_update(&mut bias, &[5.0, 1.0, 3.0, 3.0], 0.125);
        assert_eq!(bias, vec![0.375, -0.125, 0.0, 1.0]);
    }

    #[test]
    fn loads_add_layer_by_layer() {
        let mut acc = Vec::new();
        RouterBalance::add(&mut acc, vec![vec![1.0, 2.0], vec![0.0, 3.0]]);
        RouterBalance::add(&mut acc, vec![vec![1.0, 0.0], vec![2.0, 1.0]]);
        assert_eq!(acc, vec![vec![2.0, 2.0], vec![2.0, 4.0]]);
    }
}
