//! `ferrotext bench moe`: the seed's one-factor sweeps at CPU scale for an MoE model — GA, tokens
//! per micro-batch, experts, depth — each row timing the step with the data-parallel reduction
//! deferred (tagged) against reduced in every micro-batch (untagged), ABBA-paired in one process.
//!
//! Each row also predicts the untagged step from measurements that do not include it: `a` is
//! timed directly (the all-reduce of every parameter's gradient, as one micro-batch of the
//! untagged step issues them), `c` and `o` come from the deferred step at GA N and GA 1
//! (`d_N = o + N·c + a`, `d_1 = o + c + a`). Predicted speedup `(o + N(c+a)) / d_N`; the seed's
//! model `(c+a)/(c+a/N)` (which leaves `o` out) is reported next to it.
//!
//! Peak memory (tagged vs untagged) is measured in two child processes of `ferrotext train`
//! (peak RSS is per process). Writes JSON and an SVG plot.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_spmd::on_device;
use ferrotext_train::{data, DatasetType, ShardMode, TrainConfig, TrainError, Trainer};
use serde::Serialize;

use super::{abba_pair, write_file, write_json, Paired, Side, StepPair};
use crate::common::stats::median;

/// One factor of the sweep and its values: the base config with one key changed per point.
struct Sweep {
    name: &'static str,
    /// Label and config per point.
    points: Vec<(String, TrainConfig)>,
}

impl Sweep {
    /// The sweep `name` over `values`: each point labelled `label(v)`, the base config with
    /// `set(config, v)` applied.
    fn over(
        name: &'static str,
        base: &TrainConfig,
        values: [usize; 3],
        label: impl Fn(usize) -> String,
        set: impl Fn(&mut TrainConfig, usize),
    ) -> Sweep {
        let point = |v| {
            let mut config = base.clone();
            set(&mut config, v);
            (label(v), config)
        };
        Sweep {
            name,
            points: values.iter().map(|&v| point(v)).collect(),
        }
    }
}

fn sweeps(base: &TrainConfig, base_len: usize, base_layers: usize) -> Vec<Sweep> {
    let times = |m: usize| format!("x{m}");
    vec![
        Sweep::over(
            "ga",
            base,
            [2, 4, 8],
            |g| g.to_string(),
            |c, g| c.gradient_accumulation_steps = g,
        ),
        Sweep::over("tokens", base, [1, 2, 4], times, |c, m| {
            c.max_target_length = base_len * m
        }),
        Sweep::over(
            "experts",
            base,
            [8, 16, 32],
            |e| e.to_string(),
            |c, e| c.num_experts = Some(e),
        ),
        Sweep::over("depth", base, [1, 2, 3], times, |c, m| {
            c.base_num_decoder_layers = Some(base_layers * m)
        }),
    ]
}

#[derive(Serialize)]
struct Row {
    sweep: &'static str,
    point: String,
    ga: usize,
    parameters: usize,
    tagged_ms: f64,
    untagged_ms: f64,
    measured_speedup: f64,
    /// Deferred step at GA 1.
    ga1_ms: f64,
    o_ms: f64,
    c_ms: f64,
    a_ms: f64,
    /// `(o + N(c+a)) / d_N`.
    predicted_speedup: f64,
    /// The seed's `(c+a)/(c+a/N)`.
    model_speedup: f64,
    /// `|measured / model − 1|`.
    model_error: f64,
    max_abs_loss_diff: f64,
}

/// Timings of one configuration: deferred and untagged at its GA (paired), deferred at GA 1, and
/// the direct all-reduce time of its gradients.
struct Timed {
    tagged: f64,
    untagged: f64,
    paired: f64,
    ga1: f64,
    a: f64,
    loss_diff: f64,
    parameters: usize,
}

fn time_config(config: &TrainConfig, pairs: usize) -> Result<Timed> {
    let tagged = TrainConfig {
        steps: 2 * pairs + 2,
        ..config.clone()
    };
    tagged.validate()?;
    let mut untagged = tagged.clone();
    untagged.shard_mode = ShardMode::Auto;
    let mut ga1 = tagged.clone();
    ga1.gradient_accumulation_steps = 1;
    let (tagged, untagged, ga1) = (tagged.plan()?, untagged.plan()?, ga1.plan()?);
    let mesh = tagged.compute_mesh().clone();
    let vocab = tagged.decoder().config().vocab_size;
    let source: Arc<dyn data::TokenSource> = Arc::from(data::source_for(tagged.config(), vocab)?);
    let opts = SpmdOptions::default().with_timeout(Duration::from_secs(600));
    type Samples = (Vec<StepPair>, Vec<f64>, Vec<f64>, usize);
    let per_device = run_spmd(&mesh, &opts, |dev| -> Result<Samples, TrainError> {
        on_device(dev, |cx| {
            let mut a = Trainer::new(cx, &tagged, source.clone(), None)?;
            let mut b = Trainer::new(cx, &untagged, source.clone(), None)?;
            let mut c = Trainer::new(cx, &ga1, source.clone(), None)?;
            a.step(cx)?; // warm-up
            b.step(cx)?;
            c.step(cx)?;
            let mut pairs_out = Vec::new();
            let mut ga1_times = Vec::new();
            for i in 0..pairs {
                // A: tagged, B: untagged; the GA-1 step after each pair.
                let (ma, mb) = abba_pair(i, |side| match side {
                    Side::A => a.step(cx),
                    Side::B => b.step(cx),
                })?;
                pairs_out.push(StepPair::of(&ma, &mb));
                ga1_times.push(c.step(cx)?.seconds);
            }
            // `a`: every parameter's gradient all-reduced over the batch axes, one call each.
            let sizes: Vec<usize> = a
                .engine()
                .param_infos()
                .iter()
                .map(|p| p.shape.iter().product())
                .collect();
            let mut buffers: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1.0; n]).collect();
            let mut reduce_times = Vec::new();
            for _ in 0..pairs.max(3) {
                let t = Instant::now();
                for buf in &mut buffers {
                    cx.comm().all_reduce(&["data"], buf)?;
                }
                reduce_times.push(t.elapsed().as_secs_f64());
            }
            Ok((pairs_out, ga1_times, reduce_times, sizes.iter().sum()))
        })
    })
    .map_err(TrainError::from)?;
    let (samples, ga1_times, reduce_times, parameters) = &per_device[0];
    let paired = Paired::of(samples);
    Ok(Timed {
        tagged: paired.a_seconds,
        untagged: paired.b_seconds,
        paired: paired.b_over_a,
        ga1: median(ga1_times.clone()),
        a: median(reduce_times.clone()),
        loss_diff: paired.max_abs_loss_diff,
        parameters: *parameters,
    })
}

/// Peak RSS in MB of a child `ferrotext train` run of `config`.
fn peak_rss_mb(config: &TrainConfig) -> Result<f64> {
    let exe = std::env::current_exe().context("locating the ferrotext binary")?;
    let out = std::process::Command::new(exe)
        .arg("train")
        .args(config.to_overrides())
        .output()
        .context("running a child `ferrotext train`")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("peak RSS")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .with_context(|| format!("no `peak RSS` line in the child's output:\n{stdout}"))
}

/// Runs the benchmark; writes JSON to `out` and the plot to `svg`.
pub fn run(model: &str, pairs: usize, extra: &[String], out: &Path, svg: &Path) -> Result<()> {
    let (base_len, base_layers) = (32, 2);
    let base = TrainConfig {
        model_name: model.into(),
        ici_data_parallelism: 4,
        per_device_batch_size: 1.0,
        max_target_length: base_len,
        base_num_decoder_layers: Some(base_layers),
        gradient_accumulation_steps: 4,
        dataset_type: DatasetType::Synthetic,
        learning_rate: 0.001,
        ..TrainConfig::default()
    }
    .with_overrides(extra)?;
    let mut rows = Vec::new();
    println!(
        "{:>8} {:>6} {:>3} {:>9} {:>10} {:>11} {:>8} {:>9} {:>7} {:>7} {:>7} {:>7}",
        "sweep",
        "point",
        "GA",
        "params",
        "tagged ms",
        "untagged ms",
        "measured",
        "predicted",
        "model",
        "o ms",
        "c ms",
        "a ms"
    );
    for sweep in sweeps(&base, base_len, base_layers) {
        for (label, config) in &sweep.points {
            config.validate()?;
            let n = config.gradient_accumulation_steps;
            let t = time_config(config, pairs)?;
            let c = ((t.tagged - t.ga1) / (n as f64 - 1.0)).max(0.0);
            let o = t.ga1 - c - t.a;
            let predicted = (o + n as f64 * (c + t.a)) / t.tagged;
            let model_speedup = (c + t.a) / (c + t.a / n as f64);
            let row = Row {
                sweep: sweep.name,
                point: label.clone(),
                ga: n,
                parameters: t.parameters,
                tagged_ms: t.tagged * 1e3,
                untagged_ms: t.untagged * 1e3,
                measured_speedup: t.paired,
                ga1_ms: t.ga1 * 1e3,
                o_ms: o * 1e3,
                c_ms: c * 1e3,
                a_ms: t.a * 1e3,
                predicted_speedup: predicted,
                model_speedup,
                model_error: (t.paired / model_speedup - 1.0).abs(),
                max_abs_loss_diff: t.loss_diff,
            };
            println!(
                "{:>8} {:>6} {:>3} {:>9} {:>10.1} {:>11.1} {:>7.3}x {:>8.3}x {:>6.3}x {:>7.1} {:>7.1} {:>7.2}",
                row.sweep,
                row.point,
                row.ga,
                row.parameters,
                row.tagged_ms,
                row.untagged_ms,
                row.measured_speedup,
                row.predicted_speedup,
                row.model_speedup,
                row.o_ms,
                row.c_ms,
                row.a_ms
            );
            rows.push(row);
        }
    }
    let mut memory = TrainConfig {
        steps: 6,
        ..base.clone()
    };
    let tagged_mb = peak_rss_mb(&memory)?;
    memory.shard_mode = ShardMode::Auto;
    let untagged_mb = peak_rss_mb(&memory)?;
    println!(
        "peak RSS (base point, 6 steps, separate processes): tagged {tagged_mb:.1} MB, untagged \
         {untagged_mb:.1} MB, ratio {:.3}",
        tagged_mb / untagged_mb
    );
    let json = serde_json::json!({
        "benchmark": "moe",
        "model": model,
        "base": base,
        "rows": rows,
        "peak_rss_mb": { "tagged": tagged_mb, "untagged": untagged_mb },
    });
    write_json(out, &json)?;
    write_file(svg, plot(&rows))?;
    println!("wrote {} and {}", out.display(), svg.display());
    Ok(())
}

/// Four panels (one per sweep): measured speedup (solid) and the two predictions (dashed:
/// with `o`; dotted: the seed's model) against the sweep's points.
fn plot(rows: &[Row]) -> String {
    let (w, h, pad) = (260.0, 220.0, 40.0);
    let names = ["ga", "tokens", "experts", "depth"];
    let lo = rows
        .iter()
        .flat_map(|r| [r.measured_speedup, r.predicted_speedup, r.model_speedup])
        .fold(1.0f64, f64::min)
        .min(0.9);
    let hi = rows
        .iter()
        .flat_map(|r| [r.measured_speedup, r.predicted_speedup, r.model_speedup])
        .fold(1.0f64, f64::max)
        * 1.05;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
        4.0 * w,
        h + 30.0
    );
    svg.push_str(&format!(
        "<text x=\"10\" y=\"{}\">speedup of deferred (tagged) over per-micro-batch reduction — solid: measured, dashed: predicted (o, c, a), dotted: (c+a)/(c+a/N)</text>\n",
        h + 22.0
    ));
    for (panel, name) in names.iter().enumerate() {
        let points: Vec<&Row> = rows.iter().filter(|r| r.sweep == *name).collect();
        let x0 = panel as f64 * w;
        let px =
            |i: usize| x0 + pad + (w - 2.0 * pad) * i as f64 / (points.len().max(2) - 1) as f64;
        let py = |v: f64| h - pad - (h - 2.0 * pad) * (v - lo) / (hi - lo);
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"16\" font-weight=\"bold\">{name}</text>\n\
             <line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#999\"/>\n\
             <line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#999\"/>\n\
             <text x=\"{}\" y=\"{}\">{hi:.2}</text><text x=\"{}\" y=\"{}\">{lo:.2}</text>\n\
             <line x1=\"{}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\n",
            x0 + pad,
            x0 + pad,
            h - pad,
            x0 + w - pad,
            h - pad,
            x0 + pad,
            pad,
            x0 + pad,
            h - pad,
            x0 + 4.0,
            pad,
            x0 + 4.0,
            h - pad,
            x0 + pad,
            py(1.0),
            x0 + w - pad,
            py(1.0),
        ));
        for (i, r) in points.iter().enumerate() {
            svg.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                px(i),
                h - pad + 14.0,
                r.point
            ));
        }
        for (pick, style) in [
            (0usize, "stroke=\"#1f77b4\" stroke-width=\"2\""),
            (1, "stroke=\"#d62728\" stroke-dasharray=\"6,3\""),
            (2, "stroke=\"#2ca02c\" stroke-dasharray=\"2,3\""),
        ] {
            let path: Vec<String> = points
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let v = [r.measured_speedup, r.predicted_speedup, r.model_speedup][pick];
                    format!("{:.1},{:.1}", px(i), py(v))
                })
                .collect();
            svg.push_str(&format!(
                "<polyline points=\"{}\" fill=\"none\" {style}/>\n",
                path.join(" ")
            ));
        }
    }
    svg.push_str("</svg>\n");
    svg
}
