//! The cost model (`ferrotext_cost`) as the grid's prediction function.

use super::{CellSpec, Mode};

/// The cost model (`ferrotext_cost::predict`) as the grid's prediction function: the
/// cell's config on `hosts × devices_per_host` with its link, device throughput measured here
/// once per model and device count from forward + backward micro-batches of the cell's model,
/// with the thread budget one of the cell's devices gets when every emulated device shares this
/// machine's cores (the emulated hosts do) and as many devices side by side as fill them
/// (`cost::measure_micro_batch`; a gemm matmul when that would not fit in memory) — or, given the
/// compute of a micro-batch fit on the emulated setup, the throughput that takes that long.
/// `None` for a cell the model cannot price.
pub fn cost_model(
    set: &[String],
    steps: usize,
) -> impl Fn(&CellSpec, Mode, Option<f64>) -> Option<f64> + '_ {
    use ferrotext_cost as cost;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let gflops = move |config: &ferrotext_train::TrainConfig, devices: usize| -> Option<f64> {
        let b = cost::device_thread_budget(cores, devices);
        match cost::too_big_to_measure(config, b.concurrent).ok()? {
            // `concurrent` devices side by side; more devices than that: each gets a share.
            None => Some(
                cost::measure_micro_batch(config, b.threads, b.concurrent, 1, 3)
                    .ok()?
                    .gflops
                    * b.share,
            ),
            // A matmul on one thread alone: more devices than cores each get a share of one.
            Some(_) => Some(
                cost::measure_matmul_gflops(512, b.threads, cost::products_in_bf16(config)).ok()?
                    * (cores as f64 / (devices * b.threads) as f64).min(1.0),
            ),
        }
    };
    let cache = std::sync::Mutex::new(std::collections::BTreeMap::<(usize, String), f64>::new());
    move |spec: &CellSpec, mode: Mode, fitted_compute_ms: Option<f64>| {
        let devices = spec.hosts * spec.devices_per_host;
        let config = spec.config(steps).with_overrides(set).ok()?;
        let cluster: ferrotext_cost::ClusterSpec = format!(
            "hosts={},devices_per_host={},link={}bit,{}us",
            spec.hosts,
            spec.devices_per_host,
            spec.link_bps,
            spec.link_delay_s * 1e6
        )
        .parse()
        .ok()?;
        let rate = if let Some(c) = fitted_compute_ms {
            // The device throughput that makes a micro-batch take `c` ms: the model's compute
            // time is FLOPs ÷ throughput, so price it once at 1 GFLOP/s and scale.
            let at_one = ferrotext_cost::predict(&config, &cluster, 1.0).ok()?;
            at_one.compute_ms_per_micro_batch / c
        } else {
            let mut cache = cache.lock().ok()?;
            let key = (devices, spec.model.clone());
            match cache.get(&key) {
                Some(&r) => r,
                None => {
                    let r = gflops(&config, devices)?;
                    cache.insert(key, r);
                    r
                }
            }
        };
        let p = ferrotext_cost::predict(&config, &cluster, rate).ok()?;
        Some(match mode {
            Mode::PerMicroBatch => p.per_micro_batch_step_ms,
            Mode::Deferred => p.deferred_step_ms,
        })
    }
}
