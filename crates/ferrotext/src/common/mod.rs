//! What every command of the binary shares: the usage error (exit code 2), `--dtype`, the median
//! of timings, the split of `[config.toml] key=value ...` into a `train` config, and the line chart.
//!
//! # Invariant
//! This module is the bottom of the binary: it imports nothing from the rest of the crate (no
//! command module, not `main.rs`), only from other crates. Every command module imports its
//! shared helpers from here, never from `main.rs` or from a sibling command, so the binary's
//! modules form no import circle.

pub mod chart;
pub mod config_args;
mod dtype;
pub mod stats;
mod usage;

pub use dtype::dtype_flag;
pub use usage::{usage, UsageError};
