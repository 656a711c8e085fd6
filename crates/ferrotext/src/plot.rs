//! `ferrotext plot RUN_DIR...`: the loss curves of one or more runs on one chart (PNG or SVG,
//! drawn with `plotters`), read from each run's `metrics.jsonl`; `train` draws its own run's chart
//! the same way at the end (`loss.png` and `loss.svg`). Lines that carry an `eval_loss` draw a
//! second, dashed series per run (drawn by [`crate::common::chart`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::common::chart::{line_chart, Series};
use crate::common::UsageError;

/// `ferrotext plot RUN_DIR... [--out FILE]`.
#[derive(Args, Debug)]
pub struct PlotArgs {
    /// Run directories (each holds the `metrics.jsonl` that `train` writes).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Where to write the chart: `.svg` for SVG, anything else PNG; default `loss.png` inside the
    /// run directory for one run, `loss.png` in the current directory for several.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The loss (and eval loss, when logged) of one run, by step.
#[derive(Debug, Default, PartialEq)]
pub struct Curves {
    /// `(step, loss)` of every step that logged a finite loss.
    pub loss: Vec<(f64, f64)>,
    /// `(step, eval_loss)` of every line that carried one.
    pub eval_loss: Vec<(f64, f64)>,
}

/// Runs `ferrotext plot`.
pub fn run(args: &PlotArgs) -> Result<()> {
    let out = match (&args.out, args.runs.as_slice()) {
        (Some(out), _) => out.clone(),
        (None, [one]) => one.join("loss.png"),
        (None, _) => PathBuf::from("loss.png"),
    };
    // An output that cannot be written is the user's input, found before anything is drawn.
    ferrotext_train::io::check_output_path("--out", &out, false)?;
    let mut series = Vec::new();
    for dir in &args.runs {
        let curves = read_curves(dir).map_err(|e| UsageError(format!("{e:#}")))?;
        series.extend(run_series(&run_label(dir), curves));
    }
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    line_chart(
        &out,
        "training loss",
        "step",
        "loss (mean per token)",
        &series,
    )?;
    println!("wrote {}", out.display());
    Ok(())
}

/// Draws `dir`'s loss curve into `dir/loss.png` and `dir/loss.svg` (the end of `train`);
/// returns the PNG's path.
pub fn plot_run(dir: &Path) -> Result<PathBuf> {
    let curves = read_curves(dir)?;
    let series = run_series(&run_label(dir), curves);
    for name in ["loss.svg", "loss.png"] {
        line_chart(
            &dir.join(name),
            "training loss",
            "step",
            "loss (mean per token)",
            &series,
        )?;
    }
    Ok(dir.join("loss.png"))
}

fn run_label(dir: &Path) -> String {
    dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

fn run_series(label: &str, curves: Curves) -> Vec<Series> {
    let mut series = vec![Series {
        name: format!("{label} loss"),
        points: curves.loss,
        dashed: false,
    }];
    if !curves.eval_loss.is_empty() {
        series.push(Series {
            name: format!("{label} eval loss"),
            points: curves.eval_loss,
            dashed: true,
        });
    }
    series
}

/// Reads `dir/metrics.jsonl`: every line a JSON object with a `step`; `loss` and `eval_loss`
/// are taken where present and finite. A line that is not such an object is an error naming the
/// file and line.
pub fn read_curves(dir: &Path) -> Result<Curves> {
    let path = dir.join("metrics.jsonl");
    let text = ferrotext_files::read_regular_to_string(&path)
        .with_context(|| format!("reading {} (is it a run directory?)", path.display()))?;
    let mut curves = Curves::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let value: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not a JSON object", at()))?;
        let Some(step) = value.get("step").and_then(serde_json::Value::as_f64) else {
            bail!("{}: no numeric `step`", at());
        };
        let finite = |key: &str| {
            value
                .get(key)
                .and_then(serde_json::Value::as_f64)
                .filter(|v| v.is_finite())
        };
        if let Some(loss) = finite("loss") {
            curves.loss.push((step, loss));
        }
        if let Some(eval) = finite("eval_loss") {
            curves.eval_loss.push((step, eval));
        }
    }
    if curves.loss.is_empty() && curves.eval_loss.is_empty() {
        bail!("{} holds no loss to plot", path.display());
    }
    Ok(curves)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_dir(name: &str, metrics: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("ferrotext-plot-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(dir.join("metrics.jsonl"), metrics).expect("write metrics");
        dir
    }

    #[test]
    fn curves_take_finite_losses_and_eval_losses_by_step() {
        let dir = run_dir(
            "curves",
            "{\"step\":0,\"loss\":5.5}\n{\"step\":1,\"loss\":null}\n\n\
             {\"step\":2,\"loss\":4.0,\"eval_loss\":4.5}\n",
        );
        let curves = read_curves(&dir).expect("curves");
        assert_eq!(curves.loss, [(0.0, 5.5), (2.0, 4.0)]);
        assert_eq!(curves.eval_loss, [(2.0, 4.5)]);
        let out = plot_run(&dir).expect("plot");
        let png = std::fs::read(&out).expect("png");
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n"),
            "not a PNG: {:?}",
            &png[..8]
        );
        let svg = std::fs::read_to_string(dir.join("loss.svg")).expect("svg");
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.contains("eval loss"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_bad_line_is_named_by_file_and_line() {
        let dir = run_dir("bad", "{\"step\":0,\"loss\":1.0}\nnot json\n");
        let err = format!("{:#}", read_curves(&dir).expect_err("bad line"));
        assert!(
            err.contains("metrics.jsonl line 2: not a JSON object"),
            "{err}"
        );
        std::fs::write(dir.join("metrics.jsonl"), "{\"loss\":1.0}\n").expect("write");
        let err = format!("{:#}", read_curves(&dir).expect_err("no step"));
        assert!(err.contains("line 1: no numeric `step`"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
