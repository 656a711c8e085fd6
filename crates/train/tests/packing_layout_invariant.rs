//! Packed runs under `layout_invariant=true`: the documents come from the tokens alone, so a
//! packed run keeps its bits across layouts and resumes bit for bit. A test binary of its own:
//! `deterministic=true` needs the portable kernel, which a process fixes at its first run.

use ferrotext_train::{train, RunOptions};
mod common;

use common::packed::{config, losses, shards};
use common::scratch::scratch;

#[test]
fn packed_runs_keep_layout_invariance_and_resume_bit_for_bit() {
    let dir = scratch("layouts");
    let data = shards(&dir);
    let out = format!("base_output_directory={}", dir.display());
    let layout = |devices: usize, ga: usize, run: &str, extra: &[&str]| {
        let keys = [
            format!("local_devices={devices}"),
            format!("ici_data_parallelism={devices}"),
            format!("gradient_accumulation_steps={ga}"),
            format!("run_name={run}"),
        ];
        let mut all: Vec<&str> = keys.iter().map(String::as_str).collect();
        all.extend_from_slice(&[
            &out,
            "packing=true",
            "layout_invariant=true",
            "deterministic=true",
        ]);
        all.extend_from_slice(extra);
        config(&data, &all)
    };
    if std::env::var("FERROTEXT_MATMUL").is_ok_and(|k| !k.is_empty() && k != "portable") {
        // A library kernel forced (`.ci/kernel-paths`): deterministic=true is refused there.
        assert!(train(&layout(2, 1, "a", &[]), &RunOptions::default()).is_err());
        return;
    }
    let two = train(&layout(2, 1, "two", &[]), &RunOptions::default()).unwrap();
    let one = train(&layout(1, 2, "one", &[]), &RunOptions::default()).unwrap();
    assert_eq!(losses(&two), losses(&one));
    // Stopped after step 1 and resumed from its checkpoint: the documents come from the
    // tokens the resumed run reads again.
    let ckpt = ["enable_checkpointing=true", "checkpoint_period=1"];
    let stop = RunOptions {
        stop_after_steps: Some(1),
        ..Default::default()
    };
    let first = train(&layout(1, 2, "split", &ckpt), &stop).unwrap();
    let rest = train(&layout(1, 2, "split", &ckpt), &RunOptions::default()).unwrap();
    let mut resumed = losses(&first);
    resumed.extend(losses(&rest));
    assert_eq!(resumed, losses(&one));
}
