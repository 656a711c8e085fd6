//! Tests that cannot run a check on this machine say so, in one place: [`report_skipped`].
//!
//! A test whose check needs something this machine lacks (an instruction the processor does not
//! have, a library that is not installed) either runs the same check another way or calls
//! [`report_skipped`] and returns; it never passes in silence. `.ci/run` collects the reports
//! and prints them as a list at its end, which is empty on a machine with AVX512_BF16, MKL and
//! OpenBLAS.

use std::io::Write;

/// The file [`report_skipped`] appends to, when the variable names one (`.ci/run` sets it).
pub const SKIPPED_ENV: &str = "FERROTEXT_SKIPPED";

/// Reports that the check `check` (a test, named so a reader can find it) did not run here,
/// and `why`: one line `skipped: {check}: {why}` on the process's standard error, outside the
/// test harness's capture (so `cargo test` shows it even for a passing test), and appended to
/// the file `FERROTEXT_SKIPPED` names when it is set.
pub fn report_skipped(check: &str, why: &str) {
    let line = format!("skipped: {check}: {why}\n");
    // Written to the stream itself: the harness captures only `print!`/`eprint!`.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os(SKIPPED_ENV).filter(|p| !p.is_empty()) {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path);
        if let Ok(mut file) = file {
            // One write of one line: appends from parallel tests do not interleave.
            let _ = file.write_all(line.as_bytes());
        }
    }
}
