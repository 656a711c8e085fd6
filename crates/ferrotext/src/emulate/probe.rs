//! The job's side of `emulate`: at every step boundary, each process appends its host's interface
//! counters and its MPI byte count to a JSON-lines file; `emulate` reads them after the job.
//!
//! Inside a host's namespace `/proc/self/net/dev` (and `/proc/self/net/snmp`) are that
//! namespace's counters, so each process sees exactly its host's link. The differences between
//! step boundaries are per-step bytes without the start-up traffic (daemon wire-up, the config
//! agreement).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::launch::Launch;

/// The interface to count (set by `emulate` through `mpirun -x`).
pub const ENV_IF: &str = "FERROTEXT_WIRE_IF";
/// The directory of the per-process files (set by `emulate` through `mpirun -x`).
pub const ENV_DIR: &str = "FERROTEXT_WIRE_DIR";

/// One process's counters at the end of one step.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Sample {
    /// The step that just ended.
    pub step: usize,
    /// Its loss.
    pub loss: f64,
    /// Its wall time in seconds.
    pub seconds: f64,
    /// Interface counters since the interface came up.
    pub tx_bytes: u64,
    /// Received bytes.
    pub rx_bytes: u64,
    /// Sent packets.
    pub tx_packets: u64,
    /// Received packets.
    pub rx_packets: u64,
    /// TCP segments retransmitted by this namespace.
    pub tcp_retrans_segs: u64,
    /// Payload bytes this process sent through MPI to other processes.
    pub mpi_bytes: u64,
}

/// The file process `p` writes in `dir`.
pub fn file_for(dir: &Path, process: usize) -> PathBuf {
    dir.join(format!("wire-{process}.jsonl"))
}

/// The file process `p` creates in `dir` once it runs (past MPI's start-up): how `run_job`
/// tells a launch that lost a daemon from a slow one.
pub fn started_file(dir: &Path, process: usize) -> PathBuf {
    dir.join(format!("started-{process}"))
}

/// Marks this process as started, when it runs under `emulate` (any job, not only `train`;
/// best effort: a marker never fails a run).
pub fn mark_started(launch: &Launch) {
    if let Some(dir) = std::env::var_os(ENV_DIR) {
        let _ = std::fs::write(started_file(Path::new(&dir), launch.process()), b"");
    }
}

/// The hosts of `hosts` whose process has not marked itself started in `dir`.
pub fn not_started(dir: &Path, hosts: usize) -> Vec<usize> {
    (0..hosts)
        .filter(|&h| !started_file(dir, h).exists())
        .collect()
}

/// `(rx_bytes, rx_packets, tx_bytes, tx_packets)` of `iface` from `/proc/self/net/dev`.
fn interface_counters(iface: &str) -> Option<(u64, u64, u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/net/dev").ok()?;
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{iface}:")))?;
    let fields: Vec<u64> = line
        .split_once(':')?
        .1
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets ...
    Some((
        *fields.first()?,
        *fields.get(1)?,
        *fields.get(8)?,
        *fields.get(9)?,
    ))
}

/// `RetransSegs` from `/proc/self/net/snmp` (0 when unreadable).
fn tcp_retransmissions() -> u64 {
    let Ok(text) = std::fs::read_to_string("/proc/self/net/snmp") else {
        return 0;
    };
    let mut tcp = text.lines().filter(|l| l.starts_with("Tcp:"));
    let (Some(names), Some(values)) = (tcp.next(), tcp.next()) else {
        return 0;
    };
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "RetransSegs")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

/// Appends one [`Sample`] per step (see the module docs).
pub struct WireProbe {
    #[cfg(feature = "mpi")]
    meter: Option<ferrotext_comm::mpi::TrafficMeter>,
    iface: String,
    file: Mutex<std::fs::File>,
}

impl WireProbe {
    /// A probe when this process runs under `emulate` (both variables set and the file opens),
    /// else `None`.
    pub fn from_env(launch: &Launch) -> Option<WireProbe> {
        let iface = std::env::var(ENV_IF).ok()?;
        let dir = PathBuf::from(std::env::var_os(ENV_DIR)?);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file_for(&dir, launch.process()))
            .ok()?;
        Some(WireProbe {
            #[cfg(feature = "mpi")]
            meter: launch.mpi().map(|m| m.traffic_meter()),
            iface,
            file: Mutex::new(file),
        })
    }

    /// Records the counters at the end of `metrics`' step (best effort: a probe never fails a
    /// run).
    pub fn record(&self, metrics: &ferrotext_train::StepMetrics) {
        let (rx_bytes, rx_packets, tx_bytes, tx_packets) =
            interface_counters(&self.iface).unwrap_or_default();
        #[cfg(feature = "mpi")]
        let mpi_bytes = self
            .meter
            .as_ref()
            .map_or(0, |m| m.read().to_other_processes);
        #[cfg(not(feature = "mpi"))]
        let mpi_bytes = 0;
        let sample = Sample {
            step: metrics.step,
            loss: metrics.loss,
            seconds: metrics.seconds,
            tx_bytes,
            rx_bytes,
            tx_packets,
            rx_packets,
            tcp_retrans_segs: tcp_retransmissions(),
            mpi_bytes,
        };
        if let (Ok(line), Ok(mut file)) = (serde_json::to_string(&sample), self.file.lock()) {
            let _ = writeln!(file, "{line}");
        }
    }
}

/// The samples of process `process` in `dir` (empty when it wrote none).
pub fn read_samples(dir: &Path, process: usize) -> Vec<Sample> {
    std::fs::read_to_string(file_for(dir, process))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_without_a_start_marker_are_the_ones_not_started() {
        let dir = std::env::temp_dir().join(format!("ferrotext-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        for h in 0..3 {
            let _ = std::fs::remove_file(started_file(&dir, h));
        }
        assert_eq!(not_started(&dir, 3), vec![0, 1, 2]);
        std::fs::write(started_file(&dir, 0), b"").expect("marker");
        std::fs::write(started_file(&dir, 2), b"").expect("marker");
        assert_eq!(not_started(&dir, 3), vec![1]);
        std::fs::write(started_file(&dir, 1), b"").expect("marker");
        assert!(not_started(&dir, 3).is_empty());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
