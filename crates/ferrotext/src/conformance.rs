//! `ferrotext conformance FILE...`: runs type-rule cases (format: `docs/conformance-format.md`) in
//! abstract mode; one line per failing case, then `N passed, N failed`; exit 0 only when all pass.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotext_spmd::conformance::run_jsonl;

use crate::common::UsageError;

/// Flags of `ferrotext conformance`.
#[derive(Args)]
pub struct ConformanceArgs {
    /// JSON-lines files of cases.
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

/// Runs every case of every file.
pub fn run(args: &ConformanceArgs) -> Result<()> {
    let (mut passed, mut failed) = (0, 0);
    for file in &args.files {
        let text = ferrotext_files::read_regular_to_string(file)
            .map_err(|e| UsageError(format!("cannot read {}: {e}", file.display())))?;
        let summary = run_jsonl(&text).with_context(|| format!("in {}", file.display()))?;
        for (id, why) in &summary.failures {
            println!("FAIL {id}: {why}");
        }
        passed += summary.passed;
        failed += summary.failures.len();
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} conformance case(s) failed");
    }
    Ok(())
}
