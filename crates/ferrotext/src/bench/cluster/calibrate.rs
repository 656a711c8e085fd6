//! Each network's calibration on itself (see the parent module's docs): `a`, one all-reduce of
//! the gradients, and the per-collective latency measured by `bench collectives` jobs on the
//! network; `c` and `o + a` fitted on its deferred cells without overlap; then each cell's
//! formula speedup and its prediction with the fitted `c`.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use anyhow::{bail, Context, Result};

use super::{run_job, Cell, Mode, NetworkFit, PredictedMs, Predictor};
use crate::emulate::net::Network;

/// The all-reduce whose time calibrates the network's per-collective latency: small enough
/// that its bytes cost nothing on any link of the grid (4 KiB is 33 µs at 1 Gbit/s).
pub const LATENCY_PROBE_BYTES: usize = 4096;

/// `α` (seconds) from a small all-reduce's time on `ranks` ranks: a ring all-reduce pays
/// `2(ranks − 1)` latencies, and its bytes at the link rate are taken off first.
pub(super) fn fitted_latency_s(small_all_reduce_ms: f64, ranks: usize, link_bps: u64) -> f64 {
    let steps = 2.0 * (ranks.max(2) - 1) as f64;
    let wire = 2.0 * (ranks.max(2) - 1) as f64 / ranks.max(2) as f64
        * (LATENCY_PROBE_BYTES * 8) as f64
        / link_bps.max(1) as f64;
    ((small_all_reduce_ms * 1e-3 - wire) / steps).max(0.0)
}

/// `a`: the median all-reduce time (ms) of `bytes` on `network`, from a `bench collectives` job.
pub(super) fn measure_all_reduce_ms(
    network: &Network,
    devices_per_host: usize,
    bytes: usize,
    scratch: &Path,
    stop: &AtomicBool,
) -> Result<f64> {
    std::fs::create_dir_all(scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let out = scratch.join(format!("all-reduce-{}-{bytes}.json", network.hosts()));
    let bytes = (bytes / 4).max(1) * 4;
    let job: Vec<String> = [
        "bench",
        "collectives",
        "--backend",
        "mpi",
        "--local-devices",
        &devices_per_host.to_string(),
        "--min-bytes",
        &bytes.to_string(),
        "--max-bytes",
        &bytes.to_string(),
        "--out",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let run = run_job(network, devices_per_host, &job, stop)?;
    if run.exit_code != Some(0) {
        bail!("the all-reduce job failed (exit {:?})", run.exit_code);
    }
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    let report: serde_json::Value = serde_json::from_str(&text)?;
    report["rows"][0]["all_reduce_median_s"]
        .as_f64()
        .map(|s| s * 1e3)
        .with_context(|| format!("no all-reduce time in {}", out.display()))
}

/// Least squares `y = intercept + slope · x`; `None` with fewer than two distinct `x`.
fn line_fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|&(x, _)| (x - mx) * (x - mx)).sum();
    if points.len() < 2 || sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|&(x, y)| (x - mx) * (y - my)).sum();
    let slope = sxy / sxx;
    Some((my - slope * mx, slope))
}

/// Fits `c` on one network's cells (see the module docs) and fills each cell's formula speedup
/// and its prediction with that `c` and the network's fitted latency; returns `network` with
/// the fit.
pub(super) fn calibrate(
    network: NetworkFit,
    cells: &mut [Cell],
    predict: Option<Predictor<'_>>,
) -> NetworkFit {
    let a = network.all_reduce_ms;
    let points: Vec<(f64, f64)> = cells
        .iter()
        .filter(|c| c.spec.overlap != Some(true))
        .map(|c| (c.spec.ga as f64, c.deferred.median_step_ms))
        .collect();
    let fit = line_fit(&points);
    if let Some((intercept, c)) = fit.filter(|&(_, c)| c > 0.0) {
        // `o`: what a step costs besides its micro-batches and the one reduction.
        let o = (intercept - a).max(0.0);
        for cell in cells.iter_mut() {
            let n = cell.spec.ga as f64;
            if cell.spec.overlap != Some(true) {
                cell.formula_speedup = Some((n * (c + a) + o) / (n * c + a + o));
            }
            // The network's measured per-collective latency, where it exceeds the link's delay.
            let mut spec = cell.spec.clone();
            spec.link_delay_s = spec.link_delay_s.max(network.fitted_latency_us * 1e-6);
            cell.predicted_with_fitted_compute_ms = PredictedMs {
                per_micro_batch: predict.and_then(|p| p(&spec, Mode::PerMicroBatch, Some(c))),
                deferred: predict.and_then(|p| p(&spec, Mode::Deferred, Some(c))),
            };
        }
    }
    NetworkFit {
        compute_ms: fit.map(|f| f.1),
        intercept_ms: fit.map(|f| f.0),
        ..network
    }
}

/// One line per cell: measured against the formula and the fitted cost model.
pub(super) fn print_fitted(cell: &Cell) {
    let ratio = |measured: f64, predicted: Option<f64>| {
        predicted.map_or("-".to_string(), |p| format!("{:.2}", measured / p))
    };
    let p = &cell.predicted_with_fitted_compute_ms;
    println!(
        "  GA {:>2}{}: speedup {:.3} vs formula {}; measured / plan (fitted c): per-micro-batch \
         {}, deferred {}",
        cell.spec.ga,
        cell.spec
            .overlap
            .map_or(String::new(), |o| format!(" overlap={o}")),
        cell.paired_speedup,
        cell.formula_speedup
            .map_or("-".to_string(), |f| format!("{f:.3}")),
        ratio(cell.per_micro_batch.median_step_ms, p.per_micro_batch),
        ratio(cell.deferred.median_step_ms, p.deferred),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::cluster::{CellSpec, ModeResult};

    fn cell(ga: usize, overlap: Option<bool>, deferred_ms: f64) -> Cell {
        Cell {
            spec: CellSpec {
                model: "m".into(),
                hosts: 2,
                devices_per_host: 1,
                link: "1gbit".into(),
                link_bps: 1_000_000_000,
                link_delay_s: 0.0,
                ga,
                overlap,
            },
            per_micro_batch: ModeResult::default(),
            deferred: ModeResult {
                median_step_ms: deferred_ms,
                ..ModeResult::default()
            },
            paired_speedup: 1.0,
            wire_ratio: 1.0,
            predicted_step_ms: PredictedMs::default(),
            predicted_with_fitted_compute_ms: PredictedMs::default(),
            formula_speedup: None,
        }
    }

    /// A network measured with `a` = 120 ms and a fitted latency of `latency_us`.
    fn network(latency_us: f64) -> NetworkFit {
        NetworkFit {
            hosts: 2,
            link: "1gbit".into(),
            gradient_bytes: 8,
            all_reduce_ms: 120.0,
            small_all_reduce_ms: 0.0,
            fitted_latency_us: latency_us,
            compute_ms: None,
            intercept_ms: None,
        }
    }

    /// Hand-computed: 2 ranks, 4 KiB at 1 Gbit/s is 32.8 µs on the wire; 1.0328 ms in all
    /// leaves 1000 µs over 2 ring steps. More ranks pay more steps; the latency is never
    /// negative.
    #[test]
    fn the_latency_is_a_small_all_reduce_less_its_bytes_over_its_ring_steps() {
        let wire_2 = (4096.0 * 8.0) / 1e9; // 2(n−1)/n = 1 for n = 2
        let l = fitted_latency_s(1.0 + wire_2 * 1e3, 2, 1_000_000_000);
        assert!((l - 500e-6).abs() < 1e-12, "{l}");
        let wire_4 = 1.5 * (4096.0 * 8.0) / 1e9;
        let l = fitted_latency_s(1.2 + wire_4 * 1e3, 4, 1_000_000_000);
        assert!((l - 200e-6).abs() < 1e-12, "{l}");
        assert_eq!(fitted_latency_s(0.0, 2, 1_000_000_000), 0.0);
    }

    #[test]
    fn the_line_fit_recovers_a_line_and_needs_two_distinct_points() {
        let (i, s) = line_fit(&[(1.0, 130.0), (2.0, 230.0), (4.0, 430.0)]).unwrap();
        assert!(
            (i - 30.0).abs() < 1e-9 && (s - 100.0).abs() < 1e-9,
            "{i} {s}"
        );
        assert!(line_fit(&[(4.0, 1.0)]).is_none());
        assert!(line_fit(&[(4.0, 1.0), (4.0, 2.0)]).is_none());
    }

    /// `c` comes from the deferred cells without overlap only; the formula is filled for those
    /// cells and matches the hand-computed speedup; the predictor receives the fitted `c`.
    #[test]
    fn calibration_fits_c_on_deferred_cells_without_overlap() {
        // c = 100 ms, o + a = 150 ms (a = 120, o = 30); the overlapped cells lie off the line.
        let mut cells = vec![
            cell(1, Some(false), 250.0),
            cell(1, Some(true), 10.0),
            cell(4, Some(false), 550.0),
            cell(4, Some(true), 10.0),
        ];
        let seen = std::sync::Mutex::new(Vec::new());
        let predict = |spec: &CellSpec, _: Mode, c: Option<f64>| {
            seen.lock().unwrap().push((c, spec.link_delay_s));
            Some(1.0)
        };
        let fit = calibrate(network(250.0), &mut cells, Some(&predict));
        assert!((fit.compute_ms.unwrap() - 100.0).abs() < 1e-9);
        assert!((fit.intercept_ms.unwrap() - 150.0).abs() < 1e-9);
        // GA 4: (4·220 + 30) / (400 + 150) = 910 / 550.
        let f = cells[2].formula_speedup.unwrap();
        assert!((f - 910.0 / 550.0).abs() < 1e-12, "{f}");
        assert!((cells[0].formula_speedup.unwrap() - 1.0).abs() < 1e-12);
        assert!(cells[1].formula_speedup.is_none() && cells[3].formula_speedup.is_none());
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 8);
        // Every prediction gets the fitted `c`, and the fitted latency in place of the delay.
        assert!(seen.iter().all(|(c, delay)| {
            c.is_some_and(|c| (c - 100.0).abs() < 1e-9) && (delay - 250e-6).abs() < 1e-15
        }));
    }

    #[test]
    fn a_single_ga_fits_nothing() {
        let mut cells = vec![cell(4, Some(false), 550.0)];
        let fit = calibrate(network(0.0), &mut cells, None);
        assert!(fit.compute_ms.is_none() && cells[0].formula_speedup.is_none());
    }
}
