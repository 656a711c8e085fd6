//! `ferrotext plan [config.toml] key=value ...`: one training step in abstract mode (shapes
//! only); with `--cluster`, the cost model's predicted step on that cluster.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_cost::{self as cost, ClusterSpec};
use ferrotext_train::TrainConfig;

use super::prediction::{print_prediction, Throughput};
use super::{load, model_label, untied_head_note, TrainArgs};
use crate::common::{config_args, UsageError};

/// Arguments of `ferrotext plan`.
#[derive(Args)]
pub struct PlanArgs {
    #[command(flatten)]
    train: TrainArgs,
    /// Predict the step on a cluster:
    /// `hosts=H,devices_per_host=L,link=25gbit,10us[,intra=200gbit,1us][,mem=20GB/s][,link_per=host|device]`
    /// (`link` is a host's link, shared by its devices, unless `link_per=device`).
    #[arg(long)]
    cluster: Option<String>,
    /// A device's throughput for `--cluster`: GFLOP/s, `measured` (the default: a forward +
    /// backward micro-batch of this model timed here on the threads one of the cluster's devices
    /// would get on this machine, with as many devices side by side as fill its cores) or `gemm`
    /// (a 512³ matmul on those threads alone: a kernel's peak, optimistic for a micro-batch).
    #[arg(long = "device-gflops", allow_hyphen_values = true)]
    device_gflops: Option<String>,
    /// With `--cluster`: print the prediction as JSON.
    #[arg(long)]
    json: bool,
}

/// `ferrotext plan`: one step in abstract mode; with `--cluster`, the predicted step.
pub fn plan(args: &PlanArgs) -> Result<()> {
    if let Some(text) = &args.cluster {
        return plan_cluster(args, text);
    }
    if args.json || args.device_gflops.is_some() {
        return Err(UsageError("--json and --device-gflops need --cluster".into()).into());
    }
    let plan = load(&args.train.args)?;
    let config = plan.config();
    // A bf16 run on a kernel without a bf16 product is refused before the step is planned.
    let bf16 = config.select_bf16_kernel()?;
    let source: Arc<dyn ferrotext_train::data::TokenSource> = Arc::from(
        ferrotext_train::data::source_for(config, plan.decoder().config().vocab_size)?,
    );
    let started = Instant::now();
    let (gate, trace) = ferrotext_train::plan_step(&plan, source)?;
    println!(
        "planned one step of {} ({} parameters) on {} in {:.2} s: every sharding rule checked",
        model_label(config),
        plan.decoder().param_count(),
        plan.mesh(),
        started.elapsed().as_secs_f64()
    );
    if let Some(note) = untied_head_note(config) {
        println!("{note}");
    }
    println!("precision: {}", plan.precision());
    if let Some(kernel) = bf16 {
        println!("bf16 matmul: {kernel}");
    }
    print_peak(&plan);
    let estimate = plan.memory_estimate()?;
    println!(
        "memory per process, estimated: {} ({} of parameters and optimizer state, {} of \
         activations for one micro-batch); the weights' packings kept for the step: {}",
        ferrotext_train::gib(estimate.total()),
        ferrotext_train::gib(estimate.parameter_and_optimizer_bytes),
        ferrotext_train::gib(estimate.activation_bytes),
        if plan.keeps_weight_packings() {
            "yes"
        } else {
            "no"
        }
    );
    println!("deferral: {}", gate.describe());
    println!("overlap: {}", plan.overlap().describe());
    let mb = PhasePattern::new("micro_batch*");
    println!(
        "all-reduces larger than 8 elements in micro-batches: {}; in update: {}",
        trace.all_reduces_larger_than(8, &mb).len(),
        trace.count(CollectiveKind::AllReduce, &PhasePattern::new("update"))
    );
    println!("\ncollectives of one device:\n{}", trace.summary_table());
    Ok(())
}

/// The peak a run's MFU divides by, and the step's FLOPs against it: the least time a step
/// could take on this machine's cores.
fn print_peak(plan: &ferrotext_train::RunPlan) {
    let config = plan.config();
    let bf16 = cost::products_in_bf16(config);
    let peak = ferrotext_tensor::cpu_peak();
    let step_flops = plan.decoder().flops_per_token(config.max_target_length)
        * super::tokens_per_step(config) as f64;
    println!(
        "peak of this machine (MFU's denominator): {}\nmodel FLOPs a step: {:.2} GFLOP, {:.1} ms at that peak",
        peak.describe_for(bf16),
        step_flops / 1e9,
        step_flops / peak.flops_for(bf16) * 1e3
    );
    if let Some(products) = ferrotext_tensor::product_peak(bf16, peak.cores) {
        println!(
            "the products' rate here: {}, {:.1} ms a step at that rate",
            products.describe(bf16),
            step_flops / products.flops * 1e3
        );
    }
}

/// `ferrotext plan --cluster ...`: the cost model's predicted step (`ferrotext_cost`).
fn plan_cluster(args: &PlanArgs, text: &str) -> Result<()> {
    let cluster: ClusterSpec = text
        .parse()
        .map_err(|e: cost::ClusterSpecError| UsageError(e.to_string()))?;
    let config = config_on(&args.train.args, &cluster)?;
    let (gflops, source) =
        device_throughput(args.device_gflops.as_deref(), &config, cluster.devices())?;
    let mut p = cost::predict(&config, &cluster, gflops)?;
    p.device_gflops_source = source.label().into();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
        return Ok(());
    }
    print_prediction(&p, &source);
    Ok(())
}

/// The config of `args` validated on the cluster's layout (its hosts as processes, its devices
/// per host as local devices), not on the in-process default.
///
/// # Errors
/// A `local_devices` or `num_processes` in `args` that contradicts the cluster (the cluster lays
/// the devices out); any error of planning the config.
fn config_on(args: &[String], cluster: &ClusterSpec) -> Result<TrainConfig> {
    for (key, want) in [
        ("local_devices", cluster.devices_per_host),
        ("num_processes", cluster.hosts),
    ] {
        let given = config_args::last_value(args, key);
        if let Some(given) = given.filter(|g| g.trim() != want.to_string()) {
            return Err(UsageError(format!(
                "{key}={given} contradicts --cluster ({key} would be {want}); leave it out"
            ))
            .into());
        }
    }
    let mut on_cluster = args.to_vec();
    on_cluster.extend([
        format!("local_devices={}", cluster.devices_per_host),
        format!("num_processes={}", cluster.hosts),
    ]);
    Ok(load(&on_cluster)?.config().clone())
}

/// A device's throughput (GFLOP/s) for `--device-gflops` (`None`: `measured`) and where it came
/// from, for one of `devices` devices sharing this machine's cores (docs/design.md §3: when they
/// outnumber the cores, each gets cores/devices of its thread).
///
/// # Errors
/// A `--device-gflops` that is neither a positive number, `measured` nor `gemm`; a failed
/// measurement.
fn device_throughput(
    choice: Option<&str>,
    config: &TrainConfig,
    devices: usize,
) -> Result<(f64, Throughput)> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let budget = cost::device_thread_budget(cores, devices);
    let (threads, share) = (budget.threads, budget.share);
    let gemm = |instead_of_micro_batch: Option<String>| -> Result<(f64, Throughput)> {
        let bf16 = cost::products_in_bf16(config);
        let run = cost::measure_matmul_gflops(512, threads, bf16)?;
        let measured = Throughput::Measured {
            threads,
            cores,
            devices,
            per_thread_run: run,
            dtype: if bf16 { "bf16" } else { "f32" },
            instead_of_micro_batch,
        };
        // A matmul on one thread alone: scaled by the devices sharing a thread, as before.
        let gemm_share = (cores as f64 / (devices * threads) as f64).min(1.0);
        Ok((run * gemm_share, measured))
    };
    Ok(match choice.map(str::trim) {
        None | Some("measured") => match cost::too_big_to_measure(config, budget.concurrent)? {
            Some(why) => gemm(Some(why))?,
            None => {
                let run = cost::measure_micro_batch(config, threads, budget.concurrent, 1, 3)?;
                let gflops = run.gflops * share;
                let measured = Throughput::MicroBatch {
                    cores,
                    devices,
                    share,
                    bf16: cost::products_in_bf16(config),
                    run,
                };
                (gflops, measured)
            }
        },
        Some("gemm") => gemm(None)?,
        Some(g) => match g.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => (v, Throughput::Given),
            _ => {
                return Err(UsageError(format!(
                "--device-gflops `{g}` must be a positive number (GFLOP/s), `measured` or `gemm`"
            ))
                .into())
            }
        },
    })
}
