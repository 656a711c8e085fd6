//! The dense reference of the mixture-of-experts block: every expert on every token, each
//! output masked by its gate weight, in global ops only — what the sparse path is tested
//! against.

use ferrotext_sharding::DType;
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, SpmdError, UnaryOp};
use ferrotext_tensor::Tensor;

use super::{MoeConfig, MoeOutput, MoeWeights};
use crate::router;

/// The reference: every expert on every token, each output masked by its gate weight (zero for
/// experts not chosen). Global ops only; the same routing rule as [`moe_sparse`](super::moe_sparse).
///
/// # Errors
/// As [`moe_sparse`](super::moe_sparse).
pub fn moe_dense(
    cx: &mut Ctx<'_>,
    config: &MoeConfig,
    x: &Array,
    weights: &MoeWeights,
) -> Result<MoeOutput, SpmdError> {
    config.check(weights)?;
    let shape = x.ty().shape().to_vec();
    let rank = shape.len();
    let (e, k) = (config.num_experts, config.num_experts_per_tok);
    let logits = crate::nn::linear_to(cx, x, &weights.router, DType::F32)?;
    let scores = config.scores(cx, &logits)?;
    // The chosen experts' scores, everything else zero (a constant mask from this device's rows).
    let (mask_local, expert_load) = match scores.local().ok() {
        Some(s) => {
            let rows = s.len() / e;
            let shape = s.shape().to_vec();
            let flat = s.into_owned().reshape(&[rows, e])?;
            let routing = config.route(&flat, weights.router_bias.as_deref())?;
            let mut m = vec![0f32; rows * e];
            for (i, &ex) in routing.experts.iter().enumerate() {
                m[(i / k) * e + ex as usize] = 1.0;
            }
            let load = router::expert_load(&routing.experts, e);
            (Tensor::new(shape, m)?, Some(load))
        }
        None => (Tensor::zeros(&scores.ty().shard_shape()), None),
    };
    let mask_ty = cx.array_type(
        scores.ty().shape(),
        scores.ty().sharding().spec().without_tags(),
    )?;
    let mask = cx.from_local(mask_ty, mask_local)?;
    let load_balance_loss = if config.load_balance_loss_weight > 0.0 && rank == 3 {
        let (b, t) = (shape[0], shape[1]);
        let density = cx.reduce_sum(&mask, &[1], None)?;
        let mean_prob = cx.reduce_sum(&scores, &[1], None)?;
        let both = cx.mul(&density, &mean_prob)?;
        let total = cx.reduce_sum(&both, &[0, 1], Some(&PartitionSpec::replicated()))?;
        // density and mean score are each a mean over t: divide by t².
        let factor = config.load_balance_loss_weight * (e * e) as f32 / (b * e * t * t) as f32;
        Some(cx.scale(&total, factor)?)
    } else {
        None
    };
    let chosen = cx.mul(&scores, &mask)?;
    let mut gates = if config.norm_topk_prob {
        let sum = cx.reduce_sum(&chosen, &[rank - 1], None)?;
        let dims: Vec<usize> = (0..rank - 1).collect();
        let sum = cx.broadcast_in_dim(&sum, chosen.ty().shape(), &dims, None)?;
        cx.div(&chosen, &sum)?
    } else {
        chosen
    };
    if config.routed_scaling_factor != 1.0 {
        gates = cx.scale(&gates, config.routed_scaling_factor)?;
    }
    let mut y = routed_experts(cx, x, weights, (&gates, e))?;
    if let Some([gate, up, down]) = &weights.shared {
        let mut s = crate::nn::swiglu(cx, x, gate, up, down)?;
        if let Some(g) = &weights.shared_gate {
            let z = crate::nn::linear_to(cx, x, g, DType::F32)?;
            let z = cx.unary(UnaryOp::Sigmoid, &z)?;
            let z = cx.reshape(&z, &shape[..rank - 1], None)?;
            let dims: Vec<usize> = (0..rank - 1).collect();
            let z = cx.broadcast_in_dim(&z, &shape, &dims, None)?;
            let z = cx.cast(&z, s.ty().dtype())?;
            s = cx.mul(&s, &z)?;
        }
        y = cx.add(&y, &s)?;
    }
    Ok(MoeOutput {
        y,
        load_balance_loss,
        expert_load,
    })
}

/// Each of the `e` experts' SwiGLU on every token of `x`, times its column of `gates` (zero
/// for experts not chosen), summed in expert order.
fn routed_experts(
    cx: &mut Ctx<'_>,
    x: &Array,
    weights: &MoeWeights,
    (gates, e): (&Array, usize),
) -> Result<Array, SpmdError> {
    let shape = x.ty().shape().to_vec();
    let rank = shape.len();
    let mut y: Option<Array> = None;
    let dims: Vec<usize> = (0..rank).collect();
    for expert in 0..e {
        let pick = |cx: &mut Ctx<'_>, w: &Array| -> Result<Array, SpmdError> {
            let s = cx.slice(w, 0, expert, expert + 1)?;
            let rest = w.ty().shape()[1..].to_vec();
            cx.reshape(&s, &rest, None)
        };
        let (w0, w1, w2) = (
            pick(cx, &weights.wi_0)?,
            pick(cx, &weights.wi_1)?,
            pick(cx, &weights.wo)?,
        );
        let h = crate::nn::swiglu(cx, x, &w0, &w1, &w2)?;
        let gate = cx.slice(gates, rank - 1, expert, expert + 1)?;
        let gate = cx.broadcast_in_dim(&gate, &shape, &dims, None)?;
        let gate = cx.cast(&gate, h.ty().dtype())?;
        let part = cx.mul(&h, &gate)?;
        y = Some(match y {
            Some(acc) => cx.add(&acc, &part)?,
            None => part,
        });
    }
    y.ok_or(SpmdError::Internal {
        op: "moe",
        invariant: "no experts",
    })
}
