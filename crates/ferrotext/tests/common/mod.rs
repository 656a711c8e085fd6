//! What the binary's integration tests share.

use std::process::{Command, Output};

/// Runs the `ferrotext` binary built for these tests with `args` and collects its output.
pub fn ferrotext(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .args(args)
        .output()
        .expect("the ferrotext binary runs")
}
