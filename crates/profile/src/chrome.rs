//! Chrome trace-event JSON (opens in Perfetto and `chrome://tracing`): one complete ("X") event
//! per span, one track per device thread, named by a metadata event.

use std::collections::BTreeSet;

use serde_json::{json, Value};

use crate::Event;

/// The trace of `events` as a JSON document; `process` labels the process (the MPI rank, 0
/// in-process), so traces of several processes can be concatenated.
pub fn chrome_trace(events: &[Event], process: usize) -> Value {
    let mut trace: Vec<Value> = events
        .iter()
        .map(|e| e.device)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|device| {
            json!({
                "name": "thread_name", "ph": "M", "pid": process, "tid": device,
                "args": { "name": format!("device {device}") },
            })
        })
        .collect();
    trace.extend(events.iter().map(|e| {
        json!({
            "name": e.kind,
            "cat": e.phase.name(),
            "ph": "X",
            "pid": process,
            "tid": e.device,
            "ts": e.start_ns as f64 / 1e3,
            "dur": e.dur_ns as f64 / 1e3,
            "args": {
                "step": e.step,
                "shapes": e.shapes,
                "flops": e.flops,
                "bytes": e.bytes,
                "self_us": e.self_ns as f64 / 1e3,
            },
        })
    }));
    json!({ "traceEvents": trace, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Phase;

    #[test]
    fn one_named_track_per_device_and_microsecond_times() {
        let e = |device| Event {
            device,
            kind: "matmul",
            phase: Phase::Backward,
            step: Some(2),
            shapes: "f32[2,3]".into(),
            start_ns: 1_500,
            dur_ns: 2_000,
            self_ns: 2_000,
            flops: 12.0,
            bytes: 0.0,
            depth: 0,
        };
        let trace = chrome_trace(&[e(1), e(0), e(1)], 5);
        let events = trace["traceEvents"].as_array().expect("an array");
        let names: Vec<_> = events
            .iter()
            .map(|v| v["ph"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(names, ["M", "M", "X", "X", "X"]);
        assert_eq!(events[0]["args"]["name"], "device 0");
        assert_eq!(events[2]["tid"], 1);
        assert_eq!(events[2]["pid"], 5);
        assert_eq!(events[2]["ts"], 1.5);
        assert_eq!(events[2]["dur"], 2.0);
        assert_eq!(events[2]["cat"], "backward");
    }
}
