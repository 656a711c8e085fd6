//! The DeepSeek-style mixture-of-experts block: a router, top-k routed experts with SwiGLU, and
//! optional shared experts — as a dropless sparse path inside a `shard_map` region, and a dense
//! reference (every expert on every token, masked) for tests.
//!
//! # The sparse path (per device, inside the region)
//! 1. router logits `x·W_r`, scores by softmax or sigmoid; the top-k experts per token are chosen
//!    by [`crate::router::select_experts`] on `scores + bias` (DeepSeek's selection-only bias,
//!    never in the weights) within the best expert groups, and the chosen scores are the gate
//!    weights, renormalised over the k if asked and times `routed_scaling_factor`; this
//!    device's expert loads are counted on the way ([`MoeOutput::expert_load`]);
//! 2. the token copies are sorted by expert (`take_rows`), each expert's consecutive rows go
//!    through its SwiGLU (`grouped_matmul`, no capacity, nothing dropped), and the results are
//!    unsorted and combined with the gate weights;
//! 3. the shared experts (a plain SwiGLU on every token) are added.
//!
//! # Expert parallelism
//! When the expert kernels are split along their expert dim (mesh axes `A`, `ep` devices, `E/ep`
//! experts each), every device sends each token copy to the device holding its expert and gets
//! the result back — two `all_to_all`s over `A`, plus one of the per-expert counts. The exchange
//! buffers have a fixed size (`ep × n·k` rows: no token is ever dropped, whatever the routing),
//! padded with zero rows that the grouped product skips. The batch must be split over `A` too.
//!
//! # The key decision: weights enter the region with the spec they carry
//! R6.3 wants every in_spec equal to its argument's spec, tags included. The block therefore
//! takes each weight's in_spec from the weight itself (the `carry_reduced` of its layout and its
//! tags), never rebuilds it from logical rules: an expert weight placed `{R:data}` is
//! `reduced_vary_cast` inside, and its gradient leaves the region `{U:data}` with no psum — the
//! per-micro-batch expert reduction of the seed never happens. [`MoeOptions::withhold_tags`] is
//! the diagnostic mirror (tags dropped before the region, as a rebuilt spec would).

use ferrotext_sharding::{carry_reduced, ArrayType, DType, DimSpec, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError, UnaryOp};
use ferrotext_tensor::{DotDims, Tensor};

use crate::router::{self, GroupLimit};

mod dense;
mod experts;

pub use dense::moe_dense;
use experts::{experts_local, experts_parallel};

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterScore {
    /// `softmax` over the experts (Mixtral, DeepSeek-V2).
    Softmax,
    /// Per-expert `sigmoid` (DeepSeek-V3).
    Sigmoid,
}

/// The block's routing hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts.
    pub num_experts: usize,
    /// Experts per token (top-k).
    pub num_experts_per_tok: usize,
    /// Score function.
    pub score: RouterScore,
    /// Renormalise the k chosen scores to sum to 1.
    pub norm_topk_prob: bool,
    /// Factor on the routed experts' output.
    pub routed_scaling_factor: f32,
    /// Weight of the Switch-style load-balance loss (0: not computed).
    pub load_balance_loss_weight: f32,
    /// Group-limited selection (DeepSeek-V3's `n_group`/`topk_group`; one group: plain top-k).
    pub groups: GroupLimit,
}

/// What the block returns.
#[derive(Clone, Debug)]
pub struct MoeOutput {
    /// The block's output, laid out like its input.
    pub y: Array,
    /// The load-balance loss (a replicated scalar), when its weight is positive:
    /// `weight · E² · mean over (sequences, experts) of density · mean score`, where `density` is
    /// the fraction of a sequence's tokens that chose the expert (MaxText's sequence-wise
    /// Switch loss). The gradient flows through the scores only.
    pub load_balance_loss: Option<Array>,
    /// Tokens of *this device* routed to each expert (`[experts]`, data, not differentiated):
    /// what the aux-loss-free balancing sums over micro-batches and devices. `None` in abstract
    /// mode, where no routing is computed.
    pub expert_load: Option<Vec<f32>>,
}

/// The block's weights, as placed by the caller (their tags are theirs to choose).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// Router `[d, experts]`.
    pub router: Array,
    /// Selection-only bias `[experts]` (DeepSeek-V3's load balancing; not differentiated).
    pub router_bias: Option<Vec<f32>>,
    /// Expert gate projections `[experts, d, f]`.
    pub wi_0: Array,
    /// Expert up projections `[experts, d, f]`.
    pub wi_1: Array,
    /// Expert down projections `[experts, f, d]`.
    pub wo: Array,
    /// Shared experts as one SwiGLU: gate `[d, s]`, up `[d, s]`, down `[s, d]`.
    pub shared: Option<[Array; 3]>,
    /// The shared experts' gate `[d, 1]`: their output times `sigmoid(x·gate)` (Qwen2-MoE).
    pub shared_gate: Option<Array>,
}

/// Diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoeOptions {
    /// Drop the weights' `reduced` tags before the region (what a spec rebuilt from logical
    /// rules does): the mirror that makes the in-region gradient psums appear.
    pub withhold_tags: bool,
}

/// This device's routing of `n` tokens: expert per copy (token-major) and gate positions.
struct Routing {
    /// `experts[t·k + j]`: the j-th expert of token t.
    experts: Vec<u32>,
}

impl MoeConfig {
    fn check(&self, weights: &MoeWeights) -> Result<(), SpmdError> {
        let e = self.num_experts;
        let k = self.num_experts_per_tok;
        if k == 0 || k > e {
            return Err(SpmdError::SettingOutOfRange {
                op: "moe",
                key: "num_experts_per_tok",
                value: k,
                limit: e,
                of: "experts",
            });
        }
        if self.groups.check(e, k).is_err() {
            return Err(SpmdError::SettingOutOfRange {
                op: "moe",
                key: "n_routing_groups",
                value: self.groups.n_routing_groups,
                limit: e,
                of: "experts, with topk_routing_group groups holding num_experts_per_tok",
            });
        }
        for (name, w) in [
            ("wi_0", &weights.wi_0),
            ("wi_1", &weights.wi_1),
            ("wo", &weights.wo),
        ] {
            if w.ty().rank() != 3 || w.ty().shape()[0] != e {
                return Err(SpmdError::WeightShape {
                    op: "moe",
                    name,
                    expected: format!("[{e}, _, _]"),
                    got: w.ty().to_string(),
                });
            }
        }
        if weights.router.ty().shape().last() != Some(&e) {
            return Err(SpmdError::WeightShape {
                op: "moe",
                name: "router",
                expected: format!("[d, {e}]"),
                got: weights.router.ty().to_string(),
            });
        }
        if let Some(b) = weights.router_bias.as_ref().filter(|b| b.len() != e) {
            return Err(SpmdError::WeightShape {
                op: "moe",
                name: "router_bias",
                expected: format!("[{e}]"),
                got: format!("[{}]", b.len()),
            });
        }
        Ok(())
    }

    /// Top-k experts per row of `scores` (`[n, experts]`, this device's), chosen on
    /// `scores + bias` within the best groups ([`router::select_experts`]).
    fn route(&self, scores: &Tensor, bias: Option<&[f32]>) -> Result<Routing, SpmdError> {
        let experts = router::select_experts(scores, self.num_experts_per_tok, bias, self.groups)?;
        Ok(Routing { experts })
    }

    fn scores(&self, cx: &mut Ctx<'_>, logits: &Array) -> Result<Array, SpmdError> {
        match self.score {
            RouterScore::Softmax => cx.softmax(logits),
            RouterScore::Sigmoid => cx.unary(UnaryOp::Sigmoid, logits),
        }
    }

    /// Gate weights `[n, k]` from the chosen scores `[n, k]`.
    fn gates(&self, cx: &mut Ctx<'_>, chosen: &Array) -> Result<Array, SpmdError> {
        let gates = if self.norm_topk_prob {
            let shape = chosen.ty().shape().to_vec();
            let sum = cx.reduce_sum(chosen, &[1], None)?;
            let sum = cx.broadcast_in_dim(&sum, &shape, &[0], None)?;
            cx.div(chosen, &sum)?
        } else {
            chosen.clone()
        };
        if self.routed_scaling_factor == 1.0 {
            Ok(gates)
        } else {
            cx.scale(&gates, self.routed_scaling_factor)
        }
    }
}

/// Every weight of the block, in a fixed order (in_specs follow it).
fn weight_list(w: &MoeWeights) -> Vec<Array> {
    let mut list = vec![
        w.router.clone(),
        w.wi_0.clone(),
        w.wi_1.clone(),
        w.wo.clone(),
    ];
    if let Some(shared) = &w.shared {
        list.extend(shared.iter().cloned());
    }
    list.extend(w.shared_gate.iter().cloned());
    list
}

/// The MoE block on `x` (`[batch, seq, d]`), dropless and sparse, inside a `shard_map` over the
/// whole mesh: every device routes its own tokens; its experts are all of them, or — when the
/// expert kernels split their expert dim (expert parallelism, see the module docs) — its share,
/// with the token copies sent to the experts' devices and back.
///
/// # Errors
/// Weights that do not fit the config; any op's type error.
///
/// # Collectives
/// Forward: a 1-element psum of the load-balance loss (when on) and, under expert parallelism,
/// three `all_to_all`s (counts, rows out, results back). Backward: the transposed `all_to_all`s;
/// no reduction for weights tagged reduced over the axes the batch is split on (their
/// gradients leave unreduced); a psum per untagged weight.
pub fn moe_sparse(
    cx: &mut Ctx<'_>,
    config: &MoeConfig,
    x: &Array,
    weights: &MoeWeights,
    options: MoeOptions,
) -> Result<MoeOutput, SpmdError> {
    config.check(weights)?;
    // Expert parallelism: the axes the expert kernels' expert dim is split over.
    let ep_axes: Vec<String> = weights
        .wi_0
        .ty()
        .sharding()
        .spec()
        .dim(0)
        .axis_names()
        .to_vec();
    for w in [&weights.wi_1, &weights.wo] {
        if w.ty().sharding().spec().dim(0).axis_names() != ep_axes.as_slice() {
            return Err(SpmdError::SplitMismatch {
                op: "moe",
                rule: "the expert kernels must split their expert dim alike",
                first: weights.wi_0.ty().to_string(),
                other: w.ty().to_string(),
            });
        }
    }
    let batch_axes = x.ty().sharding().spec().dim(0).axis_names().to_vec();
    if let Some(missing) = ep_axes.iter().find(|a| !batch_axes.contains(a)) {
        return Err(SpmdError::ExpertAxisNotOnBatch {
            op: "moe",
            axis: missing.clone(),
            x: x.ty().to_string(),
        });
    }
    let mut inputs = vec![x.clone()];
    let mut in_specs = vec![x.ty().sharding().spec().clone()];
    for (i, w) in weight_list(weights).into_iter().enumerate() {
        // Weights split over devices other than by expert (FSDP, tensor) are gathered first,
        // keeping their tags (the backward reduce-scatters); expert kernels keep their expert
        // split.
        let keep_dim0 = (1..=3).contains(&i) && !ep_axes.is_empty();
        let w = gather_except(cx, &w, keep_dim0)?;
        let spec = w.ty().sharding().spec();
        let layout = spec.without_tags();
        if options.withhold_tags {
            let plain = cx.reshard(&w, &layout)?;
            in_specs.push(layout);
            inputs.push(plain);
        } else {
            in_specs.push(carry_reduced(&layout, spec)?);
            inputs.push(w);
        }
    }
    let out_spec = x.ty().sharding().spec().clone();
    let has_shared = match (&weights.shared, &weights.shared_gate) {
        (None, _) => Shared::None,
        (Some(_), None) => Shared::Plain,
        (Some(_), Some(_)) => Shared::Gated,
    };
    let bias = weights.router_bias.clone();
    let ep: Vec<&str> = ep_axes.iter().map(String::as_str).collect();
    let with_loss = config.load_balance_loss_weight > 0.0;
    let mut out_specs = vec![out_spec];
    if with_loss {
        out_specs.push(PartitionSpec::replicated());
    }
    let sequences = x.ty().shape()[0];
    let mut expert_load = None;
    let out = cx.shard_map(&inputs, &in_specs, &out_specs, |cx, xs| {
        let (y, loss, load) = sparse_body(
            cx,
            config,
            &xs[0],
            &xs[1..],
            has_shared,
            bias.as_deref(),
            &ep,
            sequences,
        )?;
        expert_load = load;
        Ok(std::iter::once(y).chain(loss).collect())
    })?;
    let mut out = out.into_iter();
    let y = out.next().ok_or(SpmdError::Internal {
        op: "moe",
        invariant: "the region returned nothing",
    })?;
    Ok(MoeOutput {
        y,
        load_balance_loss: out.next(),
        expert_load,
    })
}

/// `w` with every partition removed (but its expert dim's, when `keep_dim0`), tags kept.
fn gather_except(cx: &mut Ctx<'_>, w: &Array, keep_dim0: bool) -> Result<Array, SpmdError> {
    let spec = w.ty().sharding().spec();
    let mut dims = vec![DimSpec::Replicated; w.ty().rank()];
    if keep_dim0 {
        dims[0] = spec.dim(0).clone();
    }
    let target = PartitionSpec::new(dims).with_reduced_set(spec.reduced().clone())?;
    if target == *spec {
        Ok(w.clone())
    } else {
        cx.reshard(w, &target)
    }
}

/// The shared experts of a block: none, a plain SwiGLU, or one gated by `sigmoid(x·g)`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shared {
    None,
    Plain,
    Gated,
}

/// What [`sparse_body`] returns on one device: the output, the load-balance loss (when on),
/// the expert loads (none in abstract mode).
type BodyOut = (Array, Option<Array>, Option<Vec<f32>>);

/// One device's tokens through the block (see the module docs), its load-balance loss (summed
/// over the devices) when on, and its expert loads (none in abstract mode). `sequences` is the
/// global batch.
#[allow(clippy::too_many_arguments)]
fn sparse_body(
    cx: &mut Ctx<'_>,
    config: &MoeConfig,
    x: &Array,
    w: &[Array],
    has_shared: Shared,
    bias: Option<&[f32]>,
    ep_axes: &[&str],
    sequences: usize,
) -> Result<BodyOut, SpmdError> {
    let shape = x.ty().shape().to_vec();
    let d = shape[shape.len() - 1];
    let n: usize = shape[..shape.len() - 1].iter().product();
    let (e, k) = (config.num_experts, config.num_experts_per_tok);
    let xf = cx.reshape(x, &[n, d], None)?;
    // The router's scores in f32 from the compute-dtype activations (docs/design.md §10).
    let router = cx.cast(&w[0], xf.ty().dtype())?;
    let logits = cx.dot_general_preferred(&xf, &router, &DotDims::matmul(2), None, DType::F32)?;
    let scores = config.scores(cx, &logits)?;

    // Routing is data: chosen on this device's scores (abstract mode: any valid routing).
    let (experts, load): (Vec<u32>, _) = match scores.local().ok() {
        Some(s) => {
            let experts = config.route(&s, bias)?.experts;
            let load = router::expert_load(&experts, e);
            (experts, Some(load))
        }
        None => ((0..n * k).map(|i| (i % k) as u32).collect(), None),
    };
    let picks: Vec<u32> = experts
        .iter()
        .enumerate()
        .map(|(i, &ex)| ((i / k) * e) as u32 + ex)
        .collect();
    let loss = if config.load_balance_loss_weight > 0.0 {
        Some(load_balance_loss(
            cx,
            config,
            &scores,
            &experts,
            (&shape, sequences),
        )?)
    } else {
        None
    };
    let flat = cx.reshape(&scores, &[n * e, 1], None)?;
    let chosen = cx.take_rows(&flat, &picks)?;
    let chosen = cx.reshape(&chosen, &[n, k], None)?;
    let gates = config.gates(cx, &chosen)?;

    let copies = if ep_axes.is_empty() {
        experts_local(cx, &xf, w, &experts, e, k)?
    } else {
        experts_parallel(cx, &xf, w, &experts, e, k, ep_axes)?
    };
    let copies = cx.reshape(&copies, &[n, k, d], None)?;
    let gates = cx.broadcast_in_dim(&gates, &[n, k, d], &[0, 1], None)?;
    // The gate weights are f32 (the router's); they meet the expert outputs in their dtype.
    let gates = cx.cast(&gates, copies.ty().dtype())?;
    let weighted = cx.mul(&copies, &gates)?;
    let mut y = cx.reduce_sum(&weighted, &[1], None)?;
    if has_shared != Shared::None {
        let s = shared_experts(cx, &xf, w, has_shared)?;
        y = cx.add(&y, &s)?;
    }
    Ok((cx.reshape(&y, &shape, None)?, loss, load))
}

/// The load-balance loss of one device's tokens, summed over the devices its routing varies
/// over: `weight · E / sequences · Σ density · mean score` (`shape`: the block's input shape,
/// `sequences`: the global batch); `experts` the chosen expert of each token copy.
fn load_balance_loss(
    cx: &mut Ctx<'_>,
    config: &MoeConfig,
    scores: &Array,
    experts: &[u32],
    (shape, sequences): (&[usize], usize),
) -> Result<Array, SpmdError> {
    let e = config.num_experts;
    let k = config.num_experts_per_tok;
    let n: usize = shape[..shape.len() - 1].iter().product();
    let seq = shape[shape.len() - 2];
    let rows = n / seq.max(1);
    // density[b, e]: the fraction of sequence b's tokens that chose expert e (data).
    let mut density = vec![0f32; rows * e];
    for (copy, &ex) in experts.iter().enumerate() {
        density[(copy / k / seq) * e + ex as usize] += 1.0 / seq as f32;
    }
    let ty = ArrayType::manual(
        scores.ty().dtype(),
        vec![rows, e],
        scores.ty().sharding().mesh().clone(),
        scores.ty().manual_tags().clone(),
    )?;
    let density = cx.from_local(ty, Tensor::new(vec![rows, e], density)?)?;
    let per_seq = cx.reshape(scores, &[rows, seq, e], None)?;
    let mean_prob = cx.reduce_sum(&per_seq, &[1], None)?;
    let both = cx.mul(&mean_prob, &density)?;
    let local = cx.reduce_sum(&both, &[0, 1], None)?;
    // weight · E² · mean over (sequences, experts) = weight · E / sequences · Σ, with the
    // 1/seq of the mean score folded in.
    let factor = config.load_balance_loss_weight * e as f32 / (sequences * seq) as f32;
    let local = cx.scale(&local, factor)?;
    let varying: Vec<String> = local.ty().manual_tags().varying().iter().cloned().collect();
    let axes: Vec<&str> = varying.iter().map(String::as_str).collect();
    if axes.is_empty() {
        Ok(local)
    } else {
        cx.psum(&local, &axes)
    }
}

/// The shared experts' output `[n, d]` on the rows `xf` (weights 4..6 of `w`; 7, its sigmoid
/// gate, when `Gated`).
fn shared_experts(
    cx: &mut Ctx<'_>,
    xf: &Array,
    w: &[Array],
    has_shared: Shared,
) -> Result<Array, SpmdError> {
    let (n, d) = (xf.ty().shape()[0], xf.ty().shape()[1]);
    let dtype = xf.ty().dtype();
    let (wg, wu, wo) = (
        cx.cast(&w[4], dtype)?,
        cx.cast(&w[5], dtype)?,
        cx.cast(&w[6], dtype)?,
    );
    let g = cx.matmul(xf, &wg, None)?;
    let u = cx.matmul(xf, &wu, None)?;
    let a = cx.swiglu(&g, &u)?;
    let mut s = cx.matmul(&a, &wo, None)?;
    if has_shared == Shared::Gated {
        // sigmoid(x·gate) [n, 1] on every row of the shared output [n, d]
        let gate = cx.cast(&w[7], dtype)?;
        let z = cx.dot_general_preferred(xf, &gate, &DotDims::matmul(2), None, DType::F32)?;
        let z = cx.unary(UnaryOp::Sigmoid, &z)?;
        let z = cx.reshape(&z, &[n], None)?;
        let z = cx.broadcast_in_dim(&z, &[n, d], &[0], None)?;
        let z = cx.cast(&z, s.ty().dtype())?;
        s = cx.mul(&s, &z)?;
    }
    Ok(s)
}
