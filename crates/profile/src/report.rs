//! The summary table: where the recorded steps went, per op kind and per phase.
//!
//! Every figure is per step and per device: the sums over all recorded events divided by
//! (devices × steps), so a 4-device run and a 1-device run read alike. Time is *exclusive* time
//! (see the crate docs), so the rows and the phase totals add up to the steps' wall time; the
//! `step` spans' own exclusive time is what no instrumented op accounts for, reported as idle.
//!
//! With a [`Roofline`] (the machine's peak FLOP/s and memory bandwidth), each row also shows the
//! least time its FLOPs and bytes allow, `max(FLOPs ÷ peak, bytes ÷ bandwidth)`, and that as a
//! share of its time: the gap to the roofline, per op. The bytes are what the op must read and
//! write once (its operands and result), as each kernel's span states them; data that stays in
//! cache between ops can beat the memory side of the roof.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::{Event, Phase};

/// The span kind the training loop wraps each recorded step in.
pub const STEP_KIND: &str = "step";

/// One op kind in one phase.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The op kind.
    pub kind: &'static str,
    /// The phase it ran in.
    pub phase: Phase,
    /// Calls per step and device.
    pub calls: f64,
    /// Exclusive milliseconds per step and device.
    pub ms: f64,
    /// Floating-point operations per step and device.
    pub flops: f64,
    /// Bytes per step and device.
    pub bytes: f64,
}

impl Row {
    /// Achieved GFLOP/s over the exclusive time (0 when the op has no FLOP count).
    pub fn gflops(&self) -> f64 {
        rate(self.flops, self.ms) / 1e9
    }

    /// Achieved GB/s over the exclusive time (0 when the op has no byte count).
    pub fn gbytes(&self) -> f64 {
        rate(self.bytes, self.ms) / 1e9
    }
}

fn rate(amount: f64, ms: f64) -> f64 {
    if ms > 0.0 {
        amount / (ms / 1e3)
    } else {
        0.0
    }
}

/// What bounds an op's time on a machine: its peak FLOP rate per product dtype and its memory
/// bandwidth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    /// Peak `f32` FLOP/s of the threads one device runs on.
    pub flops: f64,
    /// Peak bf16 FLOP/s, for ops whose kind ends in `_bf16` (the bf16 kernels' spans).
    pub bf16_flops: f64,
    /// Memory bandwidth of those threads, bytes a second.
    pub bytes_per_second: f64,
}

impl Roofline {
    /// The least time `row`'s FLOPs and bytes take at this roofline, milliseconds.
    pub fn ms(&self, row: &Row) -> f64 {
        let peak = if row.kind.ends_with("_bf16") {
            self.bf16_flops
        } else {
            self.flops
        };
        let compute = if peak > 0.0 { row.flops / peak } else { 0.0 };
        let memory = if self.bytes_per_second > 0.0 {
            row.bytes / self.bytes_per_second
        } else {
            0.0
        };
        compute.max(memory) * 1e3
    }
}

/// Per-phase milliseconds per step and device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    /// Exclusive time per phase.
    pub by_phase: BTreeMap<Phase, f64>,
    /// Step time that no instrumented op accounts for.
    pub idle_ms: f64,
    /// The steps' wall time (the `step` spans' duration).
    pub step_ms: f64,
}

impl Totals {
    /// Everything the profiler accounts for: the phases plus idle (equals `step_ms` when every
    /// span ran inside a step span).
    pub fn accounted_ms(&self) -> f64 {
        self.by_phase.values().sum::<f64>() + self.idle_ms
    }
}

/// The summary of a profiled run.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Distinct devices that recorded.
    pub devices: usize,
    /// Distinct steps recorded.
    pub steps: usize,
    /// Op kinds by exclusive time, largest first.
    pub rows: Vec<Row>,
    /// Phase totals.
    pub totals: Totals,
    /// The machine's roofline, when the caller gave one ([`Report::with_roofline`]).
    pub roofline: Option<Roofline>,
}

impl Report {
    /// Summarises `events` (of any number of devices and steps).
    pub fn from_events(events: &[Event]) -> Report {
        let devices = events
            .iter()
            .map(|e| e.device)
            .collect::<BTreeSet<_>>()
            .len();
        let steps = events
            .iter()
            .filter_map(|e| e.step)
            .collect::<BTreeSet<_>>()
            .len()
            .max(1);
        let per = (devices.max(1) * steps) as f64;
        let mut rows: BTreeMap<(&'static str, Phase), Row> = BTreeMap::new();
        let mut totals = Totals::default();
        for e in events {
            let ms = e.self_ns as f64 / 1e6 / per;
            if e.kind == STEP_KIND {
                totals.idle_ms += ms;
                totals.step_ms += e.dur_ns as f64 / 1e6 / per;
                continue;
            }
            *totals.by_phase.entry(e.phase).or_default() += ms;
            let row = rows.entry((e.kind, e.phase)).or_insert(Row {
                kind: e.kind,
                phase: e.phase,
                calls: 0.0,
                ms: 0.0,
                flops: 0.0,
                bytes: 0.0,
            });
            row.calls += 1.0 / per;
            row.ms += ms;
            row.flops += e.flops / per;
            row.bytes += e.bytes / per;
        }
        let mut rows: Vec<Row> = rows.into_values().collect();
        rows.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        Report {
            devices,
            steps,
            rows,
            totals,
            roofline: None,
        }
    }

    /// This report with each row's time set against `roofline` (two more columns).
    pub fn with_roofline(self, roofline: Roofline) -> Report {
        Report {
            roofline: Some(roofline),
            ..self
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.totals;
        let share = |ms: f64| {
            if t.step_ms > 0.0 {
                100.0 * ms / t.step_ms
            } else {
                0.0
            }
        };
        writeln!(
            f,
            "profile: {} step(s) × {} device(s); per step and device: {:.1} ms wall, {:.1} ms accounted",
            self.steps,
            self.devices,
            t.step_ms,
            t.accounted_ms()
        )?;
        write!(f, "  phases:")?;
        for (phase, ms) in &t.by_phase {
            write!(f, " {} {:.1} ms ({:.1}%),", phase.name(), ms, share(*ms))?;
        }
        writeln!(f, " idle {:.1} ms ({:.1}%)", t.idle_ms, share(t.idle_ms))?;
        if let Some(roof) = &self.roofline {
            writeln!(
                f,
                "  roofline: {:.1} GFLOP/s f32, {:.1} GFLOP/s bf16, {:.1} GB/s memory; `roof ms` is max(FLOPs ÷ peak, bytes ÷ bandwidth), `of roof` that ÷ ms",
                roof.flops / 1e9,
                roof.bf16_flops / 1e9,
                roof.bytes_per_second / 1e9
            )?;
        }
        writeln!(
            f,
            "  {:<30} {:<10} {:>7} {:>9} {:>6} {:>9} {:>8} {:>9}{}",
            "op",
            "phase",
            "calls",
            "ms",
            "share",
            "GFLOP/s",
            "GB/s",
            "MB",
            if self.roofline.is_some() {
                format!(" {:>8} {:>7}", "roof ms", "of roof")
            } else {
                String::new()
            }
        )?;
        for row in &self.rows {
            write!(
                f,
                "  {:<30} {:<10} {:>7.1} {:>9.2} {:>5.1}% {:>9.1} {:>8.2} {:>9.2}",
                row.kind,
                row.phase.name(),
                row.calls,
                row.ms,
                share(row.ms),
                row.gflops(),
                row.gbytes(),
                row.bytes / 1e6
            )?;
            if let Some(roof) = &self.roofline {
                let floor = roof.ms(row);
                if row.ms > 0.0 && floor > 0.0 {
                    write!(f, " {:>8.2} {:>6.1}%", floor, 100.0 * floor / row.ms)?;
                } else {
                    write!(f, " {:>8} {:>7}", "-", "-")?;
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(device: usize, kind: &'static str, phase: Phase, dur: u64, own: u64) -> Event {
        Event {
            device,
            kind,
            phase,
            step: Some(0),
            shapes: String::new(),
            start_ns: 0,
            dur_ns: dur,
            self_ns: own,
            flops: 2e6,
            bytes: 0.0,
            depth: 1,
        }
    }

    #[test]
    fn rows_and_totals_are_per_device_and_add_up_to_the_step() {
        // Two devices, one 10 ms step each: 6 ms of matmul (1 ms of it an all-reduce inside),
        // 2 ms of optimizer, 3 ms unaccounted on device 0 and 2 ms on device 1... per device.
        let mut events = Vec::new();
        for (device, idle) in [(0, 3_000_000), (1, 2_000_000)] {
            events.push(event(
                device,
                "all_reduce",
                Phase::Collective,
                1_000_000,
                1_000_000,
            ));
            events.push(event(
                device,
                "matmul",
                Phase::Forward,
                6_000_000,
                5_000_000,
            ));
            events.push(event(
                device,
                "adamw",
                Phase::Optimizer,
                2_000_000,
                2_000_000,
            ));
            let step_ms = 1_000_000 + 5_000_000 + 2_000_000 + idle;
            events.push(event(device, STEP_KIND, Phase::Other, step_ms, idle));
        }
        let report = Report::from_events(&events);
        assert_eq!((report.devices, report.steps), (2, 1));
        assert_eq!(report.rows[0].kind, "matmul");
        assert!((report.rows[0].ms - 5.0).abs() < 1e-9);
        // 2 MFLOP in 5 ms of exclusive time.
        assert!((report.rows[0].gflops() - 0.4).abs() < 1e-9);
        assert!((report.totals.idle_ms - 2.5).abs() < 1e-9);
        assert!((report.totals.step_ms - 10.5).abs() < 1e-9);
        assert!((report.totals.accounted_ms() - report.totals.step_ms).abs() < 1e-9);
        let text = report.to_string();
        assert!(text.contains("collective 1.0 ms"), "{text}");
        assert!(text.contains("idle 2.5 ms"), "{text}");
    }

    #[test]
    fn the_roofline_bounds_each_row_by_its_flops_or_its_bytes() {
        let row = |kind, flops: f64, bytes: f64| Row {
            kind,
            phase: Phase::Forward,
            calls: 1.0,
            ms: 10.0,
            flops,
            bytes,
        };
        let roof = Roofline {
            flops: 100e9,
            bf16_flops: 200e9,
            bytes_per_second: 10e9,
        };
        // 1 GFLOP at 100 GFLOP/s: 10 ms; its 1 MB would take 0.1 ms.
        assert!((roof.ms(&row("dot_general", 1e9, 1e6)) - 10.0).abs() < 1e-9);
        // The same in bf16: twice the peak, half the time.
        assert!((roof.ms(&row("dot_general_bf16", 1e9, 1e6)) - 5.0).abs() < 1e-9);
        // No FLOPs, 50 MB at 10 GB/s: 5 ms, memory-bound.
        assert!((roof.ms(&row("rms_norm_bf16", 0.0, 50e6)) - 5.0).abs() < 1e-9);
        let mut events = vec![Event {
            device: 0,
            kind: "rms_norm_bf16",
            phase: Phase::Forward,
            step: Some(0),
            shapes: String::new(),
            start_ns: 0,
            dur_ns: 10_000_000,
            self_ns: 10_000_000,
            flops: 0.0,
            bytes: 50e6,
            depth: 1,
        }];
        events.push(Event {
            kind: STEP_KIND,
            depth: 0,
            bytes: 0.0,
            ..events[0].clone()
        });
        let plain = Report::from_events(&events);
        assert!(!plain.to_string().contains("of roof"));
        let text = plain.with_roofline(roof).to_string();
        assert!(text.contains("of roof"), "{text}");
        // 10 ms taken, 5 ms at the roof: 50%.
        assert!(text.contains("5.00   50.0%"), "{text}");
    }
}
