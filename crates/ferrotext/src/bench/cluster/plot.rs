//! The chart of `bench cluster`: the paired speedup against GA per network.

use std::path::Path;

use anyhow::Result;

use super::Cell;
use crate::common::chart::{line_chart, Series};

/// Paired speedup against GA, one line per hosts × link (× overlap), and the break-even line.
pub(super) fn plot(cells: &[Cell], path: &Path) -> Result<()> {
    let mut series: Vec<Series> = Vec::new();
    for c in cells {
        let name = format!(
            "{} hosts, {}{}",
            c.spec.hosts,
            c.spec.link,
            c.spec
                .overlap
                .map_or(String::new(), |o| format!(", overlap={o}"))
        );
        let point = (c.spec.ga as f64, c.paired_speedup);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                name,
                points: vec![point],
                dashed: false,
            }),
        }
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let max_ga = cells.iter().map(|c| c.spec.ga).max().unwrap_or(1) as f64;
    series.push(Series {
        name: "break-even".into(),
        points: vec![(0.0, 1.0), (max_ga + 1.0, 1.0)],
        dashed: true,
    });
    line_chart(
        path,
        "deferred vs per-micro-batch gradient reduction on emulated hosts",
        "gradient accumulation steps",
        "speedup (per-micro-batch ms / deferred ms)",
        &series,
    )
}
