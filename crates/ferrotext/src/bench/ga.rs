//! `ferrotext bench ga`: step time with the data-parallel reduction deferred vs reduced in every
//! micro-batch, for several GA values, in one process with the two modes' steps interleaved in
//! ABBA order (the machine is shared and drifts); then the fit of docs/design.md §9's model
//! `untagged = o + N·c + N·a`, `deferred = o + N·c + a`.

use std::path::Path;

use anyhow::Result;
use ferrotext_train::{DatasetType, ShardMode, TrainConfig};
use serde::Serialize;

use super::{paired_training_steps, write_json, Paired};

#[derive(Serialize)]
struct Row {
    ga: usize,
    deferred_ms: f64,
    untagged_ms: f64,
    paired_speedup: f64,
    deferred_tokens_per_s: f64,
    untagged_tokens_per_s: f64,
    max_abs_loss_diff: f64,
    predicted_speedup: f64,
}

/// Least squares for `(o, c, a)` from `(N, deferred s, untagged s)` rows.
fn fit(points: &[(usize, f64, f64)]) -> (f64, f64, f64) {
    let mut ata = [[0.0f64; 3]; 3];
    let mut atb = [0.0f64; 3];
    for &(n, d, u) in points {
        let n = n as f64;
        for (row, t) in [([1.0, n, 1.0], d), ([1.0, n, n], u)] {
            for i in 0..3 {
                atb[i] += row[i] * t;
                for j in 0..3 {
                    ata[i][j] += row[i] * row[j];
                }
            }
        }
    }
    // Gaussian elimination on the 3×3 normal equations.
    let mut m = [[0.0f64; 4]; 3];
    for i in 0..3 {
        m[i][..3].copy_from_slice(&ata[i]);
        m[i][3] = atb[i];
    }
    for col in 0..3 {
        let pivot = (col..3)
            .max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))
            .unwrap_or(col);
        m.swap(col, pivot);
        let pivot_row = m[col];
        for (r, row) in m.iter_mut().enumerate() {
            if r != col && pivot_row[col] != 0.0 {
                let f = row[col] / pivot_row[col];
                for (v, p) in row.iter_mut().zip(pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    let x = |i: usize| {
        if m[i][i] == 0.0 {
            0.0
        } else {
            m[i][3] / m[i][i]
        }
    };
    (x(0), x(1), x(2))
}

/// Runs the benchmark and writes JSON to `out`.
pub fn run(model: &str, gas: &[usize], pairs: usize, extra: &[String], out: &Path) -> Result<()> {
    let base = TrainConfig {
        model_name: model.into(),
        ici_data_parallelism: 4,
        per_device_batch_size: 2.0,
        max_target_length: 64,
        dataset_type: DatasetType::Synthetic,
        learning_rate: 0.001,
        ..TrainConfig::default()
    }
    .with_overrides(extra)?;
    let mut points = Vec::new();
    let mut raw = Vec::new();
    for &ga in gas {
        let deferred = TrainConfig {
            gradient_accumulation_steps: ga,
            steps: 2 * pairs + 2,
            ..base.clone()
        };
        deferred.validate()?;
        let mut untagged = deferred.clone();
        untagged.shard_mode = ShardMode::Auto;
        let (deferred_plan, untagged_plan) = (deferred.plan()?, untagged.plan()?);
        // A: deferred, B: untagged.
        let Paired {
            a_seconds: d,
            b_seconds: u,
            b_over_a: paired,
            max_abs_loss_diff: loss_diff,
        } = paired_training_steps(&deferred_plan, &untagged_plan, pairs)?;
        let tokens = (deferred.micro_batch_rows() * ga * deferred.max_target_length) as f64;
        points.push((ga, d, u));
        raw.push((ga, d, u, paired, tokens / d, tokens / u, loss_diff));
    }
    let (o, c, a) = fit(&points);
    let rows: Vec<Row> = raw
        .iter()
        .map(|&(ga, d, u, paired, dt, ut, diff)| Row {
            ga,
            deferred_ms: d * 1e3,
            untagged_ms: u * 1e3,
            paired_speedup: paired,
            deferred_tokens_per_s: dt,
            untagged_tokens_per_s: ut,
            max_abs_loss_diff: diff,
            predicted_speedup: (o + ga as f64 * (c + a)) / (o + ga as f64 * c + a),
        })
        .collect();
    println!(
        "{:>3}  {:>11}  {:>11}  {:>8}  {:>9}  {:>10}  {:>10}  {:>10}",
        "GA",
        "deferred ms",
        "untagged ms",
        "speedup",
        "predicted",
        "defer tok/s",
        "untag tok/s",
        "loss diff"
    );
    for r in &rows {
        println!(
            "{:>3}  {:>11.1}  {:>11.1}  {:>7.3}x  {:>8.3}x  {:>10.0}  {:>10.0}  {:>10.1e}",
            r.ga,
            r.deferred_ms,
            r.untagged_ms,
            r.paired_speedup,
            r.predicted_speedup,
            r.deferred_tokens_per_s,
            r.untagged_tokens_per_s,
            r.max_abs_loss_diff
        );
    }
    println!(
        "fit: o = {:.1} ms, c = {:.1} ms per micro-batch, a = {:.1} ms per gradient reduction",
        o * 1e3,
        c * 1e3,
        a * 1e3
    );
    let json = serde_json::json!({ "benchmark": "ga", "model": model, "fit_seconds": { "o": o, "c": c, "a": a }, "rows": rows });
    write_json(out, &json)?;
    println!("wrote {}", out.display());
    Ok(())
}
