//! `ferrotext bench layout`: what `layout_invariant=true` costs. The same run with and without
//! the key (both `deterministic=true`, so only the tree differs), for each (data, GA) point,
//! in one process with the two runs' steps interleaved in ABBA order (the machine is shared and
//! drifts), each point's global batch the same; and the gradient memory the tree adds.

use std::path::Path;

use anyhow::Result;
use ferrotext_train::{DatasetType, TrainConfig};
use serde::Serialize;

use super::{paired_training_steps, write_json};

/// A point of the comparison: data-parallel devices and micro-batches per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Point {
    data: usize,
    ga: usize,
}

impl std::str::FromStr for Point {
    type Err = String;

    /// `DATAxGA`, e.g. `4x4`: both at least 1.
    fn from_str(s: &str) -> Result<Point, String> {
        let bad = || format!("`{s}`: expected DATAxGA with both at least 1, e.g. 4x4");
        let (data, ga) = s.split_once(['x', 'X']).ok_or_else(bad)?;
        let (data, ga): (usize, usize) = (
            data.trim().parse().map_err(|_| bad())?,
            ga.trim().parse().map_err(|_| bad())?,
        );
        if data == 0 || ga == 0 {
            return Err(bad());
        }
        Ok(Point { data, ga })
    }
}

#[derive(Serialize)]
struct Row {
    data: usize,
    ga: usize,
    tokens_per_device_micro_batch: usize,
    without_ms: f64,
    with_ms: f64,
    /// Median over pairs of with / without.
    paired_ratio: f64,
    /// The most gradient sets a device holds at once under the key (one without).
    gradient_sets: usize,
    /// The bytes those extra sets take on a device.
    extra_gradient_bytes: usize,
}

/// The most gradient sets a device holds at once with the key: while unit `m` runs, the binary
/// counter's complete subtrees over units `0..m`, plus a fresh set for the unit unless its
/// left sibling is a single unit (`m` odd), which it adds into.
fn gradient_sets(ga: usize) -> usize {
    (0..ga)
        .map(|m| m.count_ones() as usize + usize::from(m % 2 == 0))
        .max()
        .unwrap_or(1)
}

/// Runs the comparison at each `(data, ga)` point of `points` (`per_device_batch_size` rows a
/// device's micro-batch) and writes the JSON to `out`.
///
/// # Errors
/// A config the keys refuse; a training failure.
pub fn run(
    model: &str,
    points: &[Point],
    pairs: usize,
    extra: &[String],
    out: &Path,
) -> Result<()> {
    let mut rows = Vec::new();
    for &Point { data, ga } in points {
        let without = TrainConfig {
            model_name: model.into(),
            ici_data_parallelism: data as i64,
            local_devices: data,
            gradient_accumulation_steps: ga,
            per_device_batch_size: 2.0,
            max_target_length: 64,
            dataset_type: DatasetType::Synthetic,
            learning_rate: 0.001,
            deterministic: true,
            steps: 2 * pairs + 2,
            ..TrainConfig::default()
        }
        .with_overrides(extra)?;
        let with = TrainConfig {
            layout_invariant: true,
            ..without.clone()
        };
        with.validate()?;
        let (without_plan, with_plan) = (without.plan()?, with.plan()?);
        let paired = paired_training_steps(&without_plan, &with_plan, pairs)?;
        let sets = gradient_sets(ga);
        // Each device holds whole gradients (the tree's sets are `{U:data}` partial sums).
        let params: usize = with_plan
            .params()
            .iter()
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        rows.push(Row {
            data,
            ga,
            tokens_per_device_micro_batch: with.micro_batch_rows() / data * with.max_target_length,
            without_ms: paired.a_seconds * 1e3,
            with_ms: paired.b_seconds * 1e3,
            paired_ratio: paired.b_over_a,
            gradient_sets: sets,
            extra_gradient_bytes: (sets - 1) * params * std::mem::size_of::<f32>(),
        });
    }
    println!(
        "{:>4}  {:>3}  {:>10}  {:>10}  {:>8}  {:>4}  {:>9}",
        "data", "GA", "without ms", "with ms", "ratio", "sets", "extra MB"
    );
    for r in &rows {
        println!(
            "{:>4}  {:>3}  {:>10.1}  {:>10.1}  {:>7.3}x  {:>4}  {:>9.1}",
            r.data,
            r.ga,
            r.without_ms,
            r.with_ms,
            r.paired_ratio,
            r.gradient_sets,
            r.extra_gradient_bytes as f64 / 1e6
        );
    }
    let json = serde_json::json!({ "benchmark": "layout", "model": model, "rows": rows });
    write_json(out, &json)?;
    println!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{gradient_sets, Point};

    #[test]
    fn points_parse_and_refuse_zeros() {
        assert_eq!("4x2".parse(), Ok(Point { data: 4, ga: 2 }));
        assert!("0x2".parse::<Point>().is_err());
        assert!("4".parse::<Point>().is_err());
    }

    /// Counted by hand from the binary counter: GA 1 and 2 one set (the second unit adds into
    /// the first); GA 4 a pair and a fresh unit (the third); GA 8, during the seventh unit,
    /// subtrees of 4 and 2 units and a fresh one.
    #[test]
    fn gradient_sets_follow_the_binary_counter() {
        assert_eq!(gradient_sets(1), 1);
        assert_eq!(gradient_sets(2), 1);
        assert_eq!(gradient_sets(4), 2);
        assert_eq!(gradient_sets(8), 3);
    }
}
