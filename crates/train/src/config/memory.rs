//! Memory figures: what the run plan's estimates count, and how they are printed.
//!
//! Invariant: plain numbers (bytes as `f64`); the estimates themselves are computed by the run
//! plan.

use serde::Serialize;

/// What [`crate::RunPlan::memory_estimate`] counts, in bytes per process.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryEstimate {
    /// Parameters, accumulator, reduced gradients and optimizer state of the process's
    /// devices, plus the host copy of the parameters.
    pub parameter_and_optimizer_bytes: f64,
    /// One micro-batch's activations on each of the process's devices.
    pub activation_bytes: f64,
}

/// What [`crate::RunPlan::memory_per_device`] counts for one device, in bytes (`f32` values; the
/// layers' activations in `dtype`), with
/// the element counts the optimizer's cost is computed from. `total_bytes` is the sum of the five
/// byte fields.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DeviceMemory {
    /// Parameters of the whole model.
    pub parameter_elements: f64,
    /// Parameter elements this device holds (÷ `fsdp × tensor`).
    pub local_parameter_elements: f64,
    /// Elements the optimizer steps on this device (÷ `data` more under ZeRO-1).
    pub optimizer_stepped_elements: f64,
    /// The device's parameters.
    pub parameter_bytes: f64,
    /// The gradient accumulator (the micro-batches' partial sums).
    pub accumulator_bytes: f64,
    /// Gradient sets beyond the accumulator (the update reduces the accumulator in place):
    /// `layout_invariant`'s tree nodes, else none.
    pub gradient_bytes: f64,
    /// The optimizer state (AdamW's two moments; none for SGD; ÷ `data` under ZeRO-1).
    pub optimizer_bytes: f64,
    /// One micro-batch's activations kept for the backward pass: the layers' in `dtype` (2 bytes
    /// in bf16), the logits' in `f32`; in bf16 also the weights' bf16 copies.
    pub activation_bytes: f64,
    /// The sum of the five above.
    pub total_bytes: f64,
}

impl MemoryEstimate {
    /// The sum.
    pub fn total(&self) -> f64 {
        self.parameter_and_optimizer_bytes + self.activation_bytes
    }
}

/// `bytes` in GiB with one decimal (`12.0 GiB`), as memory figures are printed.
pub fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / f64::from(1u32 << 30))
}

/// `MemTotal` from `/proc/meminfo`, in bytes (`None` where it cannot be read).
pub fn machine_memory_bytes() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: f64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024.0)
}
