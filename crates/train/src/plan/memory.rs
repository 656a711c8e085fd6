//! The run's memory, estimated before anything is allocated: per device (parameters, the
//! gradient accumulator, the optimizer state, one micro-batch's activations as `remat_policy`,
//! `num_vocab_tiling` and `dtype` keep them) and per process; and the refusal of a run that
//! would not fit, naming the long-sequence settings that would.

use ferrotext_models::RematPolicy;
use ferrotext_sharding::DType;

use super::RunPlan;
use crate::config::{gib, machine_memory_bytes, memory, DeviceMemory, MemoryEstimate};
use crate::error::TrainError;

impl RunPlan {
    /// Refuses a run whose [`RunPlan::memory_estimate`] exceeds this machine's memory
    /// (`MemTotal` of `/proc/meminfo`; no check where that cannot be read), before anything is
    /// allocated.
    ///
    /// # Errors
    /// [`TrainError::Usage`] with the estimate and the machine's memory.
    pub fn check_fits_in_memory(&self) -> Result<(), TrainError> {
        let Some(total) = machine_memory_bytes() else {
            return Ok(());
        };
        let estimate = self.memory_estimate()?;
        if estimate.total() <= total {
            return Ok(());
        }
        let lean = self.leanest();
        let remedy = match lean {
            Some((keys, need)) if need <= total => {
                format!("{keys} would need about {}", gib(need))
            }
            Some((keys, need)) => format!(
                "even {keys} needs about {}; reduce per_device_batch_size, max_target_length or \
                 the model",
                gib(need)
            ),
            None => "reduce per_device_batch_size, max_target_length or the model".into(),
        };
        Err(TrainError::usage(
            "per_device_batch_size",
            format!(
                "this run needs about {} per process ({} of parameters and optimizer state, {} \
                 of activations for one micro-batch), more than this machine's {}; {remedy}",
                gib(estimate.total()),
                gib(estimate.parameter_and_optimizer_bytes),
                gib(estimate.activation_bytes),
                gib(total)
            ),
        ))
    }

    /// The memory-leanest settings of the long-sequence keys for this run — `remat_policy=full`
    /// and a `num_vocab_tiling` giving tiles of about 1,024 tokens — as `key=value` text with
    /// their estimate; `None` when this run already uses them (or they do not plan).
    fn leanest(&self) -> Option<(String, f64)> {
        let config = self.config();
        let tokens = config.micro_batch_rows() * config.max_target_length / config.devices().max(1);
        let tiles = tokens.div_ceil(1024).max(config.num_vocab_tiling);
        if config.remat_policy == RematPolicy::Full && tiles == config.num_vocab_tiling {
            return None;
        }
        let mut lean = config.clone();
        lean.remat_policy = RematPolicy::Full;
        lean.num_vocab_tiling = tiles;
        let need = lean.plan().ok()?.memory_estimate().ok()?.total();
        Some((format!("remat_policy=full num_vocab_tiling={tiles}"), need))
    }

    /// The peak memory of one device, estimated: its parameters, the gradient accumulator
    /// (reduced in place by the update; `layout_invariant`'s tree keeps more sets), the
    /// optimizer state (÷ `data` under ZeRO-1), all `f32`, and one micro-batch's activations:
    /// the layers' in `dtype` (2 bytes in bf16) as `remat_policy` keeps them, the logits' in
    /// `f32` (whole, or one tile's under `num_vocab_tiling`), and in bf16 the weights' bf16
    /// copies the backward reads (and their packings, where a step keeps them:
    /// [`RunPlan::keeps_weight_packings`]).
    /// Parameters count once per device over the axes that split them (`fsdp × tensor`).
    ///
    /// # Errors
    /// None for a plan's mesh; typed for safety.
    pub fn memory_per_device(&self) -> Result<DeviceMemory, TrainError> {
        self.memory_per_device_keeping(self.keeps_weight_packings())
    }

    /// Whether this run, keeping its weights' packings for the step, is estimated to fit in
    /// `bytes` per process ([`RunPlan::memory_estimate`] with the packings counted). A step
    /// that keeps them computes the same bits as one that packs them per product, so a run
    /// that would not fit with them keeps none rather than being refused.
    pub fn weight_packings_fit_in(&self, bytes: f64) -> bool {
        self.memory_estimate_keeping(true)
            .is_ok_and(|estimate| estimate.total() <= bytes)
    }

    /// [`RunPlan::memory_per_device`], counting the weights' packings when `keeps`.
    fn memory_per_device_keeping(&self, keeps: bool) -> Result<DeviceMemory, TrainError> {
        let config = self.config();
        let mesh = self.mesh();
        let m = self.decoder().config();
        let params: f64 = self
            .params()
            .iter()
            .map(|p| p.shape.iter().map(|&d| d as f64).product::<f64>())
            .sum();
        let split = mesh.axes_size(&["fsdp", "tensor"])? as f64;
        let data = mesh.axis_size("data")? as f64;
        let local = params / split;
        let zero1 = if config.shard_optimizer_over_data {
            data
        } else {
            1.0
        };
        let state_bytes = config.opt_type.state_bytes_per_element() as f64;
        let batch_parts = mesh.axes_size(&["data", "fsdp", "expert"])? as f64;
        let rows = (config.micro_batch_rows() as f64 / batch_parts).max(1.0);
        // Context parallelism splits each sequence over its devices.
        let len = config.max_target_length as f64 / mesh.axis_size("context").unwrap_or(1) as f64;
        let tokens = rows * len;
        let (d, f) = (m.base_emb_dim as f64, m.base_mlp_dim as f64);
        let heads = m.base_num_query_heads as f64;
        let layers = m.base_num_decoder_layers as f64;
        let dtype = self.precision().dtype;
        let kept = dtype.size_bytes() as f64;
        // What one layer's backward needs: ~16 d-wide and 4 f-wide values per token (and
        // Gemma's sandwich norms'), and the tiled attention's log-sum-exps (f32, one per head
        // and token; no T×T scores).
        let d_wide = 16.0 + memory::sandwich_norm_widths(m);
        let whole_layer = tokens * (d_wide * d + 4.0 * f) * kept + tokens * heads * 4.0;
        // Kept per layer across the step: all of it without rematerialization; else the
        // layer's input and what the policy saves, plus one layer's whole set while its
        // backward recomputes it.
        let (per_layer, recompute) = match self.decoder().remat() {
            RematPolicy::None => (whole_layer, 0.0),
            policy => {
                let q = (m.base_num_query_heads * m.head_dim) as f64;
                let kv = (m.base_num_kv_heads * m.head_dim) as f64;
                let saved = policy.kept_widths(q as usize, kv as usize, d as usize, f as usize);
                (tokens * (d + saved as f64) * kept, whole_layer)
            }
        };
        // In bf16 each weight's bf16 copy (cast at use) is kept for the backward too — for
        // the whole step without rematerialization; with it, a layer's for its region only.
        // A step that keeps its weights' packings holds two more of about the copy's size
        // each (`x·W`'s and `dy·Wᵀ`'s), where this process's kernel packs them; in `f32`, two
        // of about the weight's size.
        let copies = match (dtype, self.decoder().remat()) {
            (DType::F32, _) if keeps && ferrotext_tensor::f32_products_keep_packings() => {
                local * 4.0 * 2.0
            }
            (DType::F32, _) => 0.0,
            (_, RematPolicy::None) => {
                let packings = if keeps && ferrotext_tensor::bf16_products_keep_packings() {
                    2.0
                } else {
                    0.0
                };
                local * kept * (1.0 + packings)
            }
            _ => (2.0 * m.vocab_size as f64 * d + local / layers) * kept,
        };
        let logits = memory::logits_bytes(m, self.decoder().vocab_tiles(), tokens);
        let activation_bytes = layers * per_layer + recompute + logits + copies;
        // The micro-batches' partial sums live in flat bucket buffers that the update reduces
        // in place (all-reduce, or ZeRO-1's reduce-scatter): no second gradient set, except
        // the tree of `layout_invariant`, which keeps up to log2(GA) more.
        let (parameter_bytes, accumulator_bytes) = (local * 4.0, local * 4.0);
        let extra_sets = if config.layout_invariant {
            // ⌈log2 GA⌉
            f64::from(
                config
                    .gradient_accumulation_steps
                    .next_power_of_two()
                    .trailing_zeros(),
            )
        } else {
            0.0
        };
        let gradient_bytes = extra_sets * local * 4.0;
        let optimizer_bytes = local * state_bytes / zero1;
        Ok(DeviceMemory {
            parameter_elements: params,
            local_parameter_elements: local,
            optimizer_stepped_elements: local / zero1,
            parameter_bytes,
            accumulator_bytes,
            gradient_bytes,
            optimizer_bytes,
            activation_bytes,
            total_bytes: parameter_bytes
                + accumulator_bytes
                + gradient_bytes
                + optimizer_bytes
                + activation_bytes,
        })
    }

    /// The memory one process of this run needs, estimated: [`RunPlan::memory_per_device`]
    /// times the devices of the process, plus the host copies of the parameters. A lower bound
    /// in spirit: it counts what must exist, not allocator slack.
    ///
    /// # Errors
    /// As [`RunPlan::memory_per_device`].
    pub fn memory_estimate(&self) -> Result<MemoryEstimate, TrainError> {
        self.memory_estimate_keeping(self.keeps_weight_packings())
    }

    /// [`RunPlan::memory_estimate`], counting the weights' packings when `keeps`.
    fn memory_estimate_keeping(&self, keeps: bool) -> Result<MemoryEstimate, TrainError> {
        let device = self.memory_per_device_keeping(keeps)?;
        let local = self.config().local_devices as f64;
        Ok(MemoryEstimate {
            parameter_and_optimizer_bytes: (device.total_bytes - device.activation_bytes) * local
                + device.parameter_elements * 4.0,
            activation_bytes: device.activation_bytes * local,
        })
    }
}
