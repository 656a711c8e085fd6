//! Measuring this machine for the model: a forward + backward micro-batch of the planned model
//! on one device (the calibrated default), or a square matmul (a kernel's peak), and the thread
//! budget each device gets when several share the cores.

use std::sync::Arc;

use ferrotext_train::{TrainConfig, TrainError};

use crate::CostError;
use serde::Serialize;

/// Times a square matmul of `n` on `threads` threads in the run's product dtype (`bf16`: the
/// bf16 × bf16 → f32 product `dtype=bfloat16` runs; else f32, through `dot_general`), best of
/// 5, in GFLOP/s. A measurement of this machine, not a constant.
///
/// # Errors
/// [`CostError::Kernel`]: a bf16 product the kernel does not have (none for valid sizes in
/// f32).
pub fn measure_matmul_gflops(n: usize, threads: usize, bf16: bool) -> Result<f64, CostError> {
    let n = n.max(16);
    let a = ferrotext_tensor::Tensor::full(&[n, n], 0.5);
    let a16 = ferrotext_tensor::Bf16Tensor::from_f32(&a);
    let dims = ferrotext_tensor::DotDims::matmul(2);
    let threads = threads.max(1);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let out = if bf16 {
            ferrotext_tensor::dot_general_bf16(&a16, &a16, &dims, threads)
        } else {
            ferrotext_tensor::dot_general(&a, &a, &dims, threads)
        }
        .map_err(|error| CostError::Kernel { n, error })?;
        best = best.min(t.elapsed().as_secs_f64());
        drop(out);
    }
    Ok(2.0 * (n as f64).powi(3) / best.max(1e-9) / 1e9)
}

/// True when `config` computes its products in bf16 (`dtype=bfloat16`).
pub fn products_in_bf16(config: &TrainConfig) -> bool {
    config.dtype == ferrotext_sharding::DType::BF16
}

/// How `devices` devices would share this machine's cores (docs/design.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ThreadBudget {
    /// Kernel threads of one device: `cores / devices`, at least 1.
    pub threads: usize,
    /// Devices that run at once when the cores are full: all of them, or `cores / threads`
    /// when they outnumber the cores. A measurement runs this many side by side, so it sees
    /// what the cores do when they are all busy (shared execution units, memory bandwidth).
    pub concurrent: usize,
    /// The share of its threads each device gets: `concurrent / devices`, at most 1: the factor
    /// a throughput measured with `concurrent` devices is scaled by.
    pub share: f64,
}

/// The [`ThreadBudget`] of one of `devices` devices sharing `cores` cores.
pub fn device_thread_budget(cores: usize, devices: usize) -> ThreadBudget {
    let (cores, devices) = (cores.max(1), devices.max(1));
    let threads = (cores / devices).max(1);
    let concurrent = devices.min((cores / threads).max(1));
    ThreadBudget {
        threads,
        concurrent,
        share: (concurrent as f64 / devices as f64).min(1.0),
    }
}

/// The effective throughput, in GFLOP/s, of a micro-batch of `tokens` tokens at
/// `flops_per_token` training FLOPs each that took `seconds`.
///
/// # Errors
/// [`CostError::NoThroughput`] when the result is not positive and finite (no tokens, no time).
pub fn effective_gflops(flops_per_token: f64, tokens: f64, seconds: f64) -> Result<f64, CostError> {
    let gflops = flops_per_token * tokens / seconds / 1e9;
    if gflops.is_finite() && gflops > 0.0 {
        Ok(gflops)
    } else {
        Err(CostError::NoThroughput {
            tokens,
            flops_per_token,
            seconds,
        })
    }
}

/// A measured forward + backward micro-batch of a config's model on one device of this machine,
/// with as many devices running side by side as would share its cores: the calibration
/// `plan --cluster` prices compute with by default.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MicroBatchMeasurement {
    /// Threads each device ran its kernels on.
    pub threads: usize,
    /// Devices measured side by side, each on its own micro-batches.
    pub concurrent: usize,
    /// Tokens of one device's micro-batch (the config's per-device batch × sequence length).
    pub tokens: usize,
    /// Training FLOPs per token of the model.
    pub flops_per_token: f64,
    /// Micro-batches each device ran before timing (first-touch allocations, caches).
    pub warmup: usize,
    /// Micro-batches each device timed.
    pub timed: usize,
    /// The median time of one timed micro-batch over all devices, seconds.
    pub seconds: f64,
    /// `flops_per_token × tokens ÷ seconds`, GFLOP/s ([`effective_gflops`]).
    pub gflops: f64,
}

/// `config` on one device of one process: every mesh axis 1, no ZeRO-1, synthetic tokens, and
/// the per-device batch rounded to whole sequences (at least one). The model and sequence length
/// are the config's, so a micro-batch costs what one device's share costs on the cluster when
/// the batch is split over `data`.
///
/// # Errors
/// [`TrainError::Usage`] when the result does not validate.
pub fn one_device_config(config: &TrainConfig) -> Result<TrainConfig, TrainError> {
    let mut one = config.clone();
    one.local_devices = 1;
    one.num_processes = 1;
    one.ici_data_parallelism = 1;
    one.ici_fsdp_parallelism = 1;
    one.ici_tensor_parallelism = 1;
    one.ici_expert_parallelism = 1;
    one.shard_optimizer_over_data = false;
    one.dataset_type = ferrotext_train::DatasetType::Synthetic;
    one.per_device_batch_size = config.per_device_batch_size.round().max(1.0);
    one.validate()?;
    Ok(one)
}

/// Runs `warmup + timed` forward + backward micro-batches of `config`'s model on each of
/// `concurrent` independent one-device engines ([`one_device_config`]) side by side, each on
/// `threads` kernel threads, starting each micro-batch together (as a mesh's devices do), and
/// times the `timed` ones (median over all). Nothing is reduced or stepped: a micro-batch is
/// the engine's `fwd_bwd` (forward, loss, backward, accumulation), the `c` of the step model
/// (docs/design.md §9).
///
/// # Errors
/// As [`one_device_config`]; an engine error; [`CostError::NothingTimed`] for `timed == 0`;
/// [`CostError::MeasurePanicked`] for a device that panicked.
pub fn measure_micro_batch(
    config: &TrainConfig,
    threads: usize,
    concurrent: usize,
    warmup: usize,
    timed: usize,
) -> Result<MicroBatchMeasurement, CostError> {
    if timed == 0 {
        return Err(CostError::NothingTimed);
    }
    let one = one_device_config(config)?;
    let plan = one.plan()?;
    let flops_per_token = plan.decoder().flops_per_token(one.max_target_length);
    let source: Arc<dyn ferrotext_train::data::TokenSource> = Arc::from(
        ferrotext_train::data::source_for(&one, plan.decoder().config().vocab_size)?,
    );
    let (threads, concurrent) = (threads.max(1), concurrent.max(1));
    let rows = one.micro_batch_rows();
    let together = std::sync::Barrier::new(concurrent);
    let device = |index: usize| -> Result<Vec<f64>, TrainError> {
        let mut comm = ferrotext_comm::Communicator::new(
            0,
            plan.compute_mesh().clone(),
            Box::new(ferrotext_comm::NoTransport),
        );
        let mut cx = ferrotext_spmd::Ctx::new(&mut comm, threads);
        let mut engine = ferrotext_train::Engine::new(&mut cx, &plan, None);
        let mut times = Vec::with_capacity(timed);
        for micro in 0..warmup + timed {
            let ids = ferrotext_train::data::micro_batch(
                source.as_ref(),
                index as u64,
                micro,
                warmup + timed,
                rows,
                one.max_target_length,
            );
            // Every device reaches every barrier, even after a failure, so none waits forever.
            together.wait();
            let Ok(e) = engine.as_mut() else {
                continue;
            };
            let started = std::time::Instant::now();
            match e.batch(&cx, &ids).and_then(|b| e.fwd_bwd(&mut cx, &b)) {
                Ok(_) if micro >= warmup => times.push(started.elapsed().as_secs_f64()),
                Ok(_) => {}
                Err(err) => engine = Err(err),
            }
        }
        engine.map(|_| times)
    };
    let runs: Vec<Result<Vec<f64>, CostError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..concurrent)
            .map(|i| {
                let device = &device;
                // Each on its own kernel pool, as a training run's devices are.
                let name = format!("ferrotext-measure-{i}");
                scope.spawn(move || {
                    ferrotext_tensor::with_kernel_pool(threads, &name, 16 << 20, || device(i))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(device, h)| match h.join() {
                Ok(run) => run.map_err(CostError::from),
                Err(_) => Err(CostError::MeasurePanicked { device }),
            })
            .collect()
    });
    let mut times = Vec::with_capacity(concurrent * timed);
    for run in runs {
        times.extend(run?);
    }
    let seconds = median(&mut times);
    let tokens = rows * one.max_target_length;
    Ok(MicroBatchMeasurement {
        threads,
        concurrent,
        tokens,
        flops_per_token,
        warmup,
        timed,
        seconds,
        gflops: effective_gflops(flops_per_token, tokens as f64, seconds)?,
    })
}

/// Why `concurrent` one-device micro-batches of `config` ([`one_device_config`]) should not be
/// run here: their estimated memory ([`ferrotext_train::RunPlan::memory_per_device`], times `concurrent`)
/// is more than half of this machine's. `None` when it fits, or when the machine's memory is
/// unknown.
///
/// # Errors
/// As [`one_device_config`].
pub fn too_big_to_measure(
    config: &TrainConfig,
    concurrent: usize,
) -> Result<Option<String>, CostError> {
    let one = one_device_config(config)?;
    let need = one.plan()?.memory_per_device()?.total_bytes * concurrent.max(1) as f64;
    Ok(ferrotext_train::machine_memory_bytes()
        .filter(|&have| need > have / 2.0)
        .map(|have| {
            format!(
                "{} device(s) side by side would need {} of this machine's {}",
                concurrent.max(1),
                ferrotext_train::gib(need),
                ferrotext_train::gib(have)
            )
        }))
}

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
pub(crate) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}
