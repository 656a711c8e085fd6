//! Multi-token prediction through the binary (issue 29 item 3, "Bad input"): a depth of 2, a
//! negative factor, and a DeepSeek-V3 directory with the layer loaded without
//! `mtp_num_layers=1` are one `error:` line naming the key, exit 2, nothing written; the mirror
//! trains and its step lines carry `mtp_loss`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-mtp-cli-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("scratch");
    dir
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hf/tests/fixtures/transformers/deepseek_v3-mtp-tf5-f32-single")
}

/// `ferrotext train` for two steps on the MTP fixture, outputs under `dir`, plus `extra`.
fn train(dir: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .arg("train")
        .arg(format!("base_output_directory={}", dir.display()))
        .arg(format!("load_parameters_path={}", fixture().display()))
        .args([
            "steps=2",
            "dataset_type=synthetic",
            "max_target_length=16",
            "per_device_batch_size=2",
            "local_devices=1",
            "gradient_accumulation_steps=1",
        ])
        .args(extra)
        .output()
        .expect("the ferrotext binary runs")
}

#[test]
fn bad_mtp_input_is_one_error_line_exit_2_and_nothing_written() {
    for (extra, needle) in [
        (&["mtp_num_layers=2"][..], "mtp_num_layers = 2"),
        (
            &["mtp_num_layers=1", "mtp_loss_scaling_factor=-1"],
            "mtp_loss_scaling_factor must be a finite number ≥ 0, got -1",
        ),
        (&[], "set mtp_num_layers=1"),
    ] {
        let dir = scratch("bad");
        let out = train(&dir, extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{extra:?}: {stderr}");
        assert!(errors[0].contains(needle), "{extra:?}: {stderr}");
        assert!(
            std::fs::read_dir(&dir).expect("dir").next().is_none(),
            "{extra:?}: something was written"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
    // The mirror: with the key, the layer trains and each step line reports it.
    let dir = scratch("good");
    let out = train(&dir, &["mtp_num_layers=1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<&str> = stdout.lines().filter(|l| l.starts_with("step")).collect();
    assert_eq!(steps.len(), 2, "{stdout}");
    assert!(steps.iter().all(|l| l.contains("  mtp_loss ")), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}
