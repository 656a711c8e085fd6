//! Memory figures: what the run plan's estimates count, the terms a model's blocks add to them,
//! and how they are printed.
//!
//! Invariant: plain numbers (bytes as `f64`); the estimates themselves are computed by the run
//! plan, from these terms.

use ferrotext_models::decoder::{self, NormPlacement};
use serde::Serialize;

/// The d-wide values per token one layer's backward keeps beyond the usual ~16: 4 for Gemma's
/// two extra sandwich norms (each its input and output), none otherwise.
pub(crate) fn sandwich_norm_widths(m: &decoder::Config) -> f64 {
    if m.norm_placement == NormPlacement::PrePost {
        4.0
    } else {
        0.0
    }
}

/// The logits' bytes (f32) for `tokens` tokens of a device: the logits, their softmax and
/// gradient whole, plus the soft-capped logits beside the raw ones under a final soft-cap
/// (Gemma 2); or under `tiles` > 1 one tile's logits and probabilities at a time (plus its
/// capped logits, kept for the cap's derivative), beside the head's weight gradient.
pub(crate) fn logits_bytes(m: &decoder::Config, tiles: usize, tokens: f64) -> f64 {
    let (vocab, d) = (m.vocab_size as f64, m.base_emb_dim as f64);
    let capped = if m.final_logit_softcapping.is_some() {
        1.0
    } else {
        0.0
    };
    if tiles <= 1 {
        return (3.0 + capped) * tokens * vocab * 4.0;
    }
    let tile = (tokens / tiles as f64).ceil();
    (2.0 + capped) * tile * vocab * 4.0 + vocab * d * 4.0
}

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
