//! The trainer: one optimizer step = N micro-batches of forward and backward, accumulating
//! gradients, then `update` — the step's one reduction, one division by the token count,
//! clipping, the optimizer. It runs on every device of the mesh (SPMD); device 0's view is
//! what gets reported.

use std::sync::Arc;
use std::time::Instant;

use ferrotext_models::qwen3::Qwen3;
use ferrotext_models::{init_normal, ParamInfo};
use ferrotext_sharding::{
    ArrayType, AxisType, LogicalAxisRules, Mesh, NamedSharding, PartitionSpec,
};
use ferrotext_spmd::{Array, Ctx, Ids, Mode};
use ferrotext_tensor::Tensor;
use serde::Serialize;

use crate::config::{ShardMode, TrainConfig};
use crate::data::{micro_batch, TokenSource};
use crate::error::TrainError;
use crate::gate::{deferral_gate, deferred_spec, Deferral};
use crate::optim::{clip_scale, learning_rate, Optimizer};

/// What one step reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepMetrics {
    /// The step index (0-based).
    pub step: usize,
    /// Mean token loss of the step (Σ loss / Σ tokens).
    pub loss: f64,
    /// Target tokens in the step.
    pub tokens: u64,
    /// Global gradient norm after the division by tokens, before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub learning_rate: f64,
    /// Wall time of the step on this device.
    pub seconds: f64,
}

/// The per-device trainer. See the module docs.
pub struct Trainer {
    config: TrainConfig,
    model: Qwen3,
    infos: Vec<ParamInfo>,
    gate: Deferral,
    /// Storage layout of each parameter (from the logical rules, untagged).
    plain: Vec<PartitionSpec>,
    /// Layout inside micro-batches (tagged `{R:data}` when the gate is open).
    inside: Vec<PartitionSpec>,
    /// The accumulator type the gate promised for each gradient.
    promised: Vec<ArrayType>,
    params: Vec<Array>,
    opt: Optimizer,
    decay: Vec<bool>,
    step: usize,
    batch_spec: PartitionSpec,
    source: Arc<dyn TokenSource>,
}

/// Plans one step of `config` on its declared mesh in abstract mode (shapes only, device 0,
/// nothing communicated), e.g. `qwen3-0.6b` on 256 devices: returns the gate's decision and the
/// collective trace, or the first type error.
///
/// # Errors
/// A type error or an invalid config.
pub fn plan_step(
    config: &TrainConfig,
    source: Arc<dyn TokenSource>,
) -> Result<(Deferral, ferrotext_comm::Trace), TrainError> {
    let mesh = compute_mesh(config)?;
    let mut comm =
        ferrotext_comm::Communicator::new(0, mesh, Box::new(ferrotext_comm::NoTransport));
    let mut cx = Ctx::new_abstract(&mut comm);
    let mut trainer = Trainer::new(&mut cx, config, source, None)?;
    trainer.step(&mut cx)?;
    let gate = trainer.gate().clone();
    Ok((gate, cx.comm().take_trace()))
}

/// The mesh the trainer computes on: the config's, with every axis Explicit (ferrotext has no
/// automatic partitioner; under `shard_mode=auto` the axes keep their layouts but the gate keeps
/// tags off).
pub fn compute_mesh(config: &TrainConfig) -> Result<Arc<Mesh>, TrainError> {
    Ok(Arc::new(
        config.mesh()?.with_all_axis_types(AxisType::Explicit),
    ))
}

impl Trainer {
    /// Places the parameters (from `initial` global values, or initialised from the seed) and
    /// decides deferral.
    ///
    /// # Errors
    /// A parameter shape that does not match the model, or a layout the mesh cannot hold.
    pub fn new(
        cx: &mut Ctx<'_>,
        config: &TrainConfig,
        source: Arc<dyn TokenSource>,
        initial: Option<&[Tensor]>,
    ) -> Result<Trainer, TrainError> {
        let model = Qwen3::new(config.model()?).map_err(|e| TrainError::Config(e.to_string()))?;
        let infos = model.params();
        let rules = LogicalAxisRules::maxtext();
        let declared = config.mesh()?;
        let mesh = cx.mesh().clone();
        let gate = deferral_gate(config.shard_mode == ShardMode::Explicit, &declared, &rules);
        let mut plain = Vec::new();
        let mut inside = Vec::new();
        let mut promised = Vec::new();
        let mut params = Vec::new();
        let mut decay = Vec::new();
        for (i, info) in infos.iter().enumerate() {
            let spec = rules.resolve(&info.logical, &info.shape, &mesh)?;
            let tagged = deferred_spec(&spec, &gate)?;
            let named = NamedSharding::new(mesh.clone(), spec.clone())?;
            if cx.mode() == Mode::Abstract {
                // Planning: types and collectives only; no 2-GB initialisation for a 0.6B model.
                let ty = ArrayType::new(ferrotext_sharding::DType::F32, info.shape.clone(), named)?;
                promised.push(cx.array_type(&info.shape, tagged.clone())?.to_cotangent());
                params.push(cx.abstract_array(ty));
                plain.push(spec);
                inside.push(tagged);
                decay.push(info.shape.len() >= 2);
                continue;
            }
            let value = match initial {
                Some(values) => {
                    let v = values.get(i).ok_or_else(|| {
                        TrainError::Config(format!("no initial value for `{}`", info.name))
                    })?;
                    if v.shape() != info.shape.as_slice() {
                        return Err(TrainError::Config(format!(
                            "`{}` has shape {:?}, the model needs {:?}",
                            info.name,
                            v.shape(),
                            info.shape
                        )));
                    }
                    v.clone()
                }
                None => init_normal(info, config.init_weights_seed, i),
            };
            let array = cx.from_global(&value, named)?;
            promised.push(cx.array_type(&info.shape, tagged.clone())?.to_cotangent());
            plain.push(spec);
            inside.push(tagged);
            params.push(array);
            decay.push(info.shape.len() >= 2);
        }
        let shapes: Vec<Vec<usize>> = params.iter().map(|p| p.ty().shard_shape()).collect();
        let rows = config.micro_batch_rows();
        let batch_spec = rules.resolve(
            &[Some("activation_batch"), None],
            &[rows, config.max_target_length],
            &mesh,
        )?;
        Ok(Trainer {
            config: config.clone(),
            model,
            opt: if cx.mode() == Mode::Abstract {
                Optimizer::Sgd
            } else {
                Optimizer::new(config, &shapes)
            },
            infos,
            gate,
            plain,
            inside,
            promised,
            params,
            decay,
            step: 0,
            batch_spec,
            source,
        })
    }

    /// The gate's decision.
    pub fn gate(&self) -> &Deferral {
        &self.gate
    }

    /// The parameters' declarations, in order.
    pub fn param_infos(&self) -> &[ParamInfo] {
        &self.infos
    }

    /// The model.
    pub fn model(&self) -> &Qwen3 {
        &self.model
    }

    /// Uses `spec` for parameter `name` inside micro-batches instead of the gate's layout. A
    /// diagnostic: it simulates a helper that rebuilt the spec (e.g. from logical rules) and
    /// dropped the reduced tag, which the accumulator check must catch.
    ///
    /// # Errors
    /// An unknown parameter name.
    pub fn override_inside_spec(
        &mut self,
        name: &str,
        spec: PartitionSpec,
    ) -> Result<(), TrainError> {
        let i = self
            .infos
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| TrainError::Config(format!("no parameter `{name}`")))?;
        self.inside[i] = spec;
        Ok(())
    }

    /// The global batch rows of micro-batch `micro` of the current step as this device's
    /// `(inputs, targets)` blocks, and the micro-batch's target-token count.
    fn batch(&self, cx: &Ctx<'_>, micro: usize) -> Result<(Ids, Ids, u64), TrainError> {
        let (rows, len) = (
            self.config.micro_batch_rows(),
            self.config.max_target_length,
        );
        let seqs = micro_batch(
            self.source.as_ref(),
            self.step as u64,
            micro,
            self.config.gradient_accumulation_steps,
            rows,
            len,
        );
        let inputs: Vec<u32> = seqs.iter().flat_map(|s| s[..len].iter().copied()).collect();
        let targets: Vec<u32> = seqs.iter().flat_map(|s| s[1..].iter().copied()).collect();
        let count = targets.iter().filter(|&&t| t != u32::MAX).count() as u64;
        let shape = [rows, len];
        Ok((
            cx.ids_from_global(&shape, self.batch_spec.clone(), &inputs)?,
            cx.ids_from_global(&shape, self.batch_spec.clone(), &targets)?,
            count,
        ))
    }

    /// One optimizer step (see the module docs).
    ///
    /// # Errors
    /// [`TrainError::AccumulatorType`] when a gradient arrives typed differently from the gate's
    /// promise (the step stops before any early reduction); any op or collective failure.
    ///
    /// # Collectives
    /// Gate open: per micro-batch only the one-element loss all-reduce; in `update` one
    /// all-reduce per parameter (the deferred reduction). Gate closed: the gradient all-reduces
    /// happen inside each micro-batch's backward pass.
    pub fn step(&mut self, cx: &mut Ctx<'_>) -> Result<StepMetrics, TrainError> {
        let start = Instant::now();
        let lr = learning_rate(&self.config, self.step);
        // Deferral: the parameters enter every micro-batch `{R:data}`. The cast is free and sits
        // outside the differentiated function (R4.8) — inside it, its transpose would put the
        // all-reduce back into every micro-batch.
        let mut used = Vec::with_capacity(self.params.len());
        for (p, spec) in self.params.iter().zip(&self.inside) {
            used.push(if p.ty().sharding().spec() == spec {
                p.clone()
            } else {
                cx.reshard(p, spec)?
            });
        }
        let mut acc: Vec<Array> = self.promised.iter().map(|t| cx.zeros(t.clone())).collect();
        let (mut loss_sum, mut tokens) = (0.0f64, 0u64);
        for micro in 0..self.config.gradient_accumulation_steps {
            cx.comm().push_phase(format!("micro_batch {micro}"));
            let (inputs, targets, count) = self.batch(cx, micro)?;
            let model = &self.model;
            let (loss, grads) =
                cx.value_and_grad(&used, |cx, ps| model.loss_sum(cx, ps, &inputs, &targets))?;
            for (i, grad) in grads.iter().enumerate() {
                if grad.ty() != acc[i].ty() {
                    return Err(TrainError::AccumulatorType {
                        param: self.infos[i].name.clone(),
                        expected: acc[i].ty().to_string(),
                        got: grad.ty().to_string(),
                        expected_unreduced: acc[i]
                            .ty()
                            .sharding()
                            .spec()
                            .unreduced()
                            .iter()
                            .cloned()
                            .collect(),
                    });
                }
                acc[i] = cx.add(&acc[i], grad)?;
            }
            if !loss.is_abstract() {
                loss_sum += f64::from(loss.scalar()?);
            }
            tokens += count;
            cx.comm().pop_phase();
        }
        cx.comm().push_phase("update");
        // The step's one reduction: unreduced accumulators become plain (an all-reduce each);
        // plain ones are already reduced (no-op).
        let mut grads = Vec::with_capacity(acc.len());
        for (a, spec) in acc.iter().zip(&self.plain) {
            grads.push(cx.reshard(a, spec)?);
        }
        let inv_tokens = 1.0 / tokens.max(1) as f64;
        let mut sq = 0.0f64;
        for g in &grads {
            let g2 = cx.mul(g, g)?;
            let axes: Vec<usize> = (0..g.ty().rank()).collect();
            let s = cx.reduce_sum(&g2, &axes, None)?;
            if !s.is_abstract() {
                sq += f64::from(s.scalar()?);
            }
        }
        let grad_norm = sq.sqrt() * inv_tokens;
        let scale =
            (inv_tokens * clip_scale(grad_norm, self.config.gradient_clipping_threshold)) as f32;
        // Nothing else holds the parameters' shards now, so the update runs in place.
        drop(used);
        drop(acc);
        if cx.mode() == Mode::Abstract {
            cx.comm().pop_phase();
            self.step += 1;
            return Ok(StepMetrics {
                step: self.step - 1,
                loss: 0.0,
                tokens,
                grad_norm: 0.0,
                learning_rate: lr,
                seconds: start.elapsed().as_secs_f64(),
            });
        }
        let grad_locals: Vec<&Tensor> =
            grads.iter().map(|g| g.local()).collect::<Result<_, _>>()?;
        let mut param_locals: Vec<&mut Tensor> = self
            .params
            .iter_mut()
            .map(|p| p.local_mut())
            .collect::<Result<_, _>>()?;
        self.opt
            .step(lr, scale, &mut param_locals, &grad_locals, &self.decay);
        cx.comm().pop_phase();
        let metrics = StepMetrics {
            step: self.step,
            loss: loss_sum * inv_tokens,
            tokens,
            grad_norm,
            learning_rate: lr,
            seconds: start.elapsed().as_secs_f64(),
        };
        self.step += 1;
        Ok(metrics)
    }

    /// The global parameter values (gathered; every device gets them).
    ///
    /// # Errors
    /// A collective failure.
    pub fn params_to_host(&self, cx: &mut Ctx<'_>) -> Result<Vec<Tensor>, TrainError> {
        self.params
            .iter()
            .map(|p| cx.to_host(p).map_err(TrainError::from))
            .collect()
    }
}
