//! `ferrotext plan --cluster`'s report of a predicted step, section by section: the cluster and
//! where the device throughput came from, the compute, each mode's collectives, the step's
//! parts side by side, and the peak memory.

use ferrotext_comm::human_bytes;
use ferrotext_cost::{CollectiveCost, LinkShare, MicroBatchMeasurement, Prediction};

/// Where a prediction's device throughput came from, in words.
pub(super) enum Throughput {
    /// `--device-gflops` gave it.
    Given,
    /// A gemm matmul measured here.
    Measured {
        threads: usize,
        cores: usize,
        devices: usize,
        per_thread_run: f64,
        /// The product's dtype (`f32`, or `bf16` for `dtype=bfloat16`).
        dtype: &'static str,
        /// Why the default micro-batch measurement was not taken (`None`: `gemm` was asked for).
        instead_of_micro_batch: Option<String>,
    },
    /// A forward + backward micro-batch of the model measured here.
    MicroBatch {
        cores: usize,
        devices: usize,
        share: f64,
        /// The products run in bf16 (`dtype=bfloat16`).
        bf16: bool,
        run: MicroBatchMeasurement,
    },
}

impl Throughput {
    /// The prediction's `device_gflops_source`.
    pub(super) fn label(&self) -> &'static str {
        match self {
            Throughput::Given => "given",
            Throughput::Measured { .. } => "gemm",
            Throughput::MicroBatch { .. } => "micro_batch",
        }
    }
}

/// Prints the predicted step `p` whose device throughput came from `source`.
pub(super) fn print_prediction(p: &Prediction, source: &Throughput) {
    print_cluster(p);
    println!("{}", throughput_line(p.device_gflops, source));
    println!("{}", peak_line(p.device_gflops, source));
    print_compute(p);
    for (title, rows) in [
        (
            format!("deferred ({})", p.deferred.deferral),
            &p.collectives,
        ),
        (
            format!("per micro-batch ({})", p.per_micro_batch.deferral),
            &p.per_micro_batch_collectives,
        ),
    ] {
        print_collectives(&title, rows);
    }
    print_step(p);
    print_memory(p);
}

/// The model on the cluster, its links and its memory bandwidth.
fn print_cluster(p: &Prediction) {
    let c = &p.cluster;
    println!(
        "predicted step of {} ({} parameters) on {} hosts × {} devices: {}",
        p.model, p.parameters, c.hosts, c.devices_per_host, p.mesh
    );
    if let Some(link) = &c.link {
        let shared = match c.link_per {
            LinkShare::Host => format!("per host, shared by its {} devices", c.devices_per_host),
            LinkShare::Device => "per device".into(),
        };
        println!("  link between hosts   {link} ({shared})");
    }
    println!("  link inside a host   {}", c.intra);
    println!(
        "  memory bandwidth     {:.1} GB/s per device (prices the optimizer)",
        c.memory_bytes_per_second / 1e9
    );
}

/// The `device throughput` line: `gflops` and how it was obtained.
fn throughput_line(gflops: f64, source: &Throughput) -> String {
    match source {
        Throughput::Given => {
            format!("  device throughput    {gflops:.1} GFLOP/s (given by --device-gflops)")
        }
        Throughput::Measured {
            threads,
            cores,
            devices,
            per_thread_run,
            dtype,
            instead_of_micro_batch,
        } => format!(
            "  device throughput    {gflops:.1} GFLOP/s measured here with gemm (512³ {dtype} matmul on {threads} thread(s), the budget of one of {devices} devices sharing this machine's {cores} cores: {per_thread_run:.1} GFLOP/s{}); a kernel's peak, optimistic for a whole micro-batch{}; emulated hosts share these {cores} cores",
            if (devices * threads) > *cores {
                format!(
                    ", × {cores}/{} as the devices outnumber the cores",
                    devices * threads
                )
            } else {
                String::new()
            },
            match instead_of_micro_batch {
                Some(why) => format!(" (not a measured micro-batch: {why})"),
                None => String::new(),
            }
        ),
        Throughput::MicroBatch {
            cores,
            devices,
            share,
            run,
            ..
        } => format!(
            "  device throughput    {gflops:.1} GFLOP/s measured here from a micro-batch (forward + backward of this model, {} tokens per device on {} thread(s), the budget of one of {devices} devices sharing this machine's {cores} cores, {} device(s) side by side: median of {} after {} warm-up, {:.1} ms = {:.1} GFLOP/s{}); emulated hosts share these {cores} cores",
            run.tokens,
            run.threads,
            run.concurrent,
            run.timed,
            run.warmup,
            run.seconds * 1e3,
            run.gflops,
            if *share < 1.0 {
                format!(
                    ", × {share:.3} as only {} of the {devices} devices run at once",
                    run.concurrent
                )
            } else {
                String::new()
            }
        ),
    }
}

/// The measured throughput against this machine's peak (the probe MFU divides by); nothing for
/// a given throughput.
fn peak_line(gflops: f64, source: &Throughput) -> String {
    let (bf16, threads, cores, devices) = match source {
        Throughput::Given => return String::new(),
        Throughput::Measured {
            dtype,
            threads,
            cores,
            devices,
            ..
        } => (*dtype == "bf16", *threads, *cores, *devices),
        Throughput::MicroBatch {
            run,
            cores,
            devices,
            bf16,
            ..
        } => (*bf16, run.threads, *cores, *devices),
    };
    let peak = ferrotext_tensor::cpu_peak();
    // A device's share of the machine's (logical) CPUs: its threads, or cores ÷ devices when
    // the devices outnumber them (the throughput above is scaled the same way).
    let (cores, devices) = (cores.max(1), devices.max(1));
    let share = (threads * devices).min(cores) as f64 / (cores * devices) as f64;
    let device_peak = peak.flops_for(bf16) * share / 1e9;
    format!(
        "  device peak          {device_peak:.1} GFLOP/s ({:.3} of the peak of this machine's {cores} CPUs, {}): the throughput above is {:.1}% of it",
        share,
        peak.describe_for(bf16),
        100.0 * gflops / device_peak.max(1e-9)
    )
}

/// A micro-batch's compute, and whether the reductions overlap it.
fn print_compute(p: &Prediction) {
    println!(
        "  compute              {:.3} MFLOP/token × {} tokens per device per micro-batch = {:.3} ms per micro-batch",
        p.flops_per_token / 1e6,
        p.tokens_per_device_per_micro_batch,
        p.compute_ms_per_micro_batch
    );
    if p.recompute_flops_per_token > 0.0 {
        println!(
            "  recomputed           {:.3} MFLOP/token of it (remat_policy, num_vocab_tiling)",
            p.recompute_flops_per_token / 1e6
        );
    }
    println!(
        "  overlap_grad_reduce  {}{}",
        p.overlap_grad_reduce,
        if p.overlap_grad_reduce {
            " (gradient reductions hide behind 2/3 of a micro-batch's compute)"
        } else {
            ""
        }
    );
}

/// One device's collectives in one mode (`title`), one priced row each.
fn print_collectives(title: &str, rows: &[CollectiveCost]) {
    println!("\ncollectives of one device, {title}:");
    println!(
        "{:<14} {:<14} {:<12} {:>5} {:>9} {:>6} {:>10} {:>10} {:>10}",
        "phase",
        "collective",
        "axes",
        "group",
        "hosts×dev",
        "count",
        "bytes",
        "intra ms",
        "link ms"
    );
    for r in rows {
        println!(
            "{:<14} {:<14} {:<12} {:>5} {:>9} {:>6} {:>10} {:>10.3} {:>10.3}{}",
            r.phase,
            r.kind,
            r.axes.join(","),
            r.span.members,
            format!("{}×{}", r.span.hosts, r.span.per_host),
            r.count,
            human_bytes(r.bytes),
            r.intra_ms,
            r.link_ms,
            if r.in_step {
                ""
            } else {
                "  (outside the step)"
            }
        );
    }
}

/// The step's parts, deferred beside per-micro-batch, and their ratio.
fn print_step(p: &Prediction) {
    let (d, m) = (&p.deferred, &p.per_micro_batch);
    println!(
        "\nstep (GA {}, ms)               {:>12} {:>16}",
        p.gradient_accumulation_steps, "deferred", "per-micro-batch"
    );
    for (what, a, b) in [
        ("compute", d.compute_ms, m.compute_ms),
        (
            "micro-batch collectives",
            d.micro_batch_collectives_ms,
            m.micro_batch_collectives_ms,
        ),
        (
            "gradient reduction",
            d.gradient_reduction_ms,
            m.gradient_reduction_ms,
        ),
        (
            "  of it exposed",
            d.exposed_reduction_ms,
            m.exposed_reduction_ms,
        ),
        (
            "update's other collectives",
            d.update_other_collectives_ms,
            m.update_other_collectives_ms,
        ),
        ("optimizer", d.optimizer_ms, m.optimizer_ms),
        ("step", d.step_ms, m.step_ms),
    ] {
        println!("  {what:<28} {a:>12.3} {b:>16.3}");
    }
    println!(
        "  ratio deferred / per-micro-batch = {:.3} (speedup {:.3}x)",
        p.ratio, p.speedup
    );
}

/// A device's peak memory and its parts.
fn print_memory(p: &Prediction) {
    let mem = &p.memory;
    let mib = |b: f64| b / f64::from(1u32 << 20);
    println!(
        "\npeak memory per device: {:.1} MiB = parameters {:.1} + accumulator {:.1} + gradients {:.1} + optimizer state {:.1} + activations of one micro-batch {:.1}",
        mib(mem.total_bytes),
        mib(mem.parameter_bytes),
        mib(mem.accumulator_bytes),
        mib(mem.gradient_bytes),
        mib(mem.optimizer_bytes),
        mib(mem.activation_bytes)
    );
}
