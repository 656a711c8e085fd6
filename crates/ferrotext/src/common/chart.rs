//! Line charts (PNG or SVG, drawn with `plotters`): `plot` and `train` draw loss curves with
//! them, `bench` its speedups.
//!
//! Text is set in DejaVu Sans, embedded in the binary (the `dejavu` crate) and registered with
//! plotters once: a PNG renders the same on a machine without fonts.

use std::path::Path;

use anyhow::{bail, Result};

/// One named line of a chart.
pub struct Series {
    /// The legend text.
    pub name: String,
    /// `(x, y)` points in x order.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (a second quantity of the same run).
    pub dashed: bool,
}

/// Registers the embedded DejaVu Sans as plotters' `sans-serif` (once per process).
fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(
            "sans-serif",
            plotters::style::FontStyle::Normal,
            dejavu::sans::regular(),
        )
        .is_ok()
    });
    if !ok {
        bail!("the embedded DejaVu Sans font did not load");
    }
    Ok(())
}

/// Draws `series` as lines on one chart with a legend into `path`: SVG when it ends in `.svg`,
/// else PNG (900×560). The axes span the points (y from the smallest value, with a margin).
pub fn line_chart(
    path: &Path,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<()> {
    use plotters::prelude::*;
    register_font()?;
    if series.iter().all(|s| s.points.is_empty()) {
        bail!("nothing to plot into {}", path.display());
    }
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("plotting {}: {e}", path.display());
    let size = (900, 560);
    let svg = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    if svg {
        let root = SVGBackend::new(path, size).into_drawing_area();
        draw(root, title, x_desc, y_desc, series).map_err(|e| err(&e))
    } else {
        let root = BitMapBackend::new(path, size).into_drawing_area();
        draw(root, title, x_desc, y_desc, series).map_err(|e| err(&e))
    }
}

/// The chart of [`line_chart`] on any plotters backend.
fn draw<DB: plotters::prelude::DrawingBackend>(
    root: plotters::drawing::DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[Series],
) -> std::result::Result<(), plotters::drawing::DrawingAreaErrorKind<DB::ErrorType>> {
    use plotters::prelude::*;
    let points = || series.iter().flat_map(|s| s.points.iter());
    let (x_min, x_max) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.0), hi.max(p.0))
    });
    let (y_min, y_max) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let x_range = x_min..x_max.max(x_min + 1.0);
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let y_range = (y_min - pad).max(0.0f64.min(y_min))..y_max + pad;

    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range, y_range)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let style = color.stroke_width(2);
        let drawn = if s.dashed {
            chart.draw_series(DashedLineSeries::new(s.points.iter().copied(), 6, 4, style))
        } else {
            chart.draw_series(LineSeries::new(s.points.iter().copied(), style))
        };
        drawn?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()
}
