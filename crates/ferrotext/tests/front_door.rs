//! The front door through the binary: `ferrotext plot` (several runs on one chart, bad run
//! directories) and `ferrotext keys`.

use std::path::PathBuf;

mod common;
use common::ferrotext;

fn run_dir(root: &std::path::Path, name: &str, metrics: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("run dir");
    std::fs::write(dir.join("metrics.jsonl"), metrics).expect("metrics");
    dir
}

#[test]
fn two_runs_go_on_one_chart_with_their_names() {
    let root = std::env::temp_dir().join(format!("ferrotext-plot-cli-{}", std::process::id()));
    let a = run_dir(
        &root,
        "alpha",
        "{\"step\":0,\"loss\":3.0}\n{\"step\":1,\"loss\":2.0}\n",
    );
    let b = run_dir(
        &root,
        "beta",
        "{\"step\":0,\"loss\":3.5}\n{\"step\":1,\"loss\":2.5}\n",
    );
    let out_path = root.join("both.svg");
    let out = ferrotext(&[
        "plot",
        a.to_str().expect("utf-8"),
        b.to_str().expect("utf-8"),
        "--out",
        out_path.to_str().expect("utf-8"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let svg = std::fs::read_to_string(&out_path).expect("the chart");
    assert!(
        svg.contains("alpha loss") && svg.contains("beta loss"),
        "{svg}"
    );
    // one run, no --out: a 900×560 PNG in the run directory
    let out = ferrotext(&["plot", a.to_str().expect("utf-8")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(a.join("loss.png")).expect("loss.png");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    let (w, h) = (&png[16..20], &png[20..24]); // IHDR width and height, big-endian
    assert_eq!(
        (
            u32::from_be_bytes(w.try_into().unwrap()),
            u32::from_be_bytes(h.try_into().unwrap())
        ),
        (900, 560)
    );
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_directory_without_metrics_is_one_error_line_with_exit_code_2() {
    let root = std::env::temp_dir().join(format!("ferrotext-plot-bad-{}", std::process::id()));
    std::fs::create_dir_all(&root).expect("dir");
    let out_path = root.join("x.svg");
    let out = ferrotext(&[
        "plot",
        root.to_str().expect("utf-8"),
        "--out",
        out_path.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: reading "), "{stderr}");
    assert!(stderr.contains("metrics.jsonl"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(!out_path.exists(), "nothing written");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn keys_lists_every_group_with_defaults() {
    let out = ferrotext(&["keys"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    for section in [
        "model:",
        "mesh:",
        "data:",
        "optimizer:",
        "checkpoints:",
        "output:",
    ] {
        assert!(
            stdout.lines().any(|l| l == section),
            "{section} in {stdout}"
        );
    }
    let steps = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("steps "))
        .expect("a steps line");
    assert!(steps.contains("default 300"), "{steps}");
}

#[test]
fn profile_accounts_for_the_profiled_steps_and_writes_a_chrome_trace() {
    let root = std::env::temp_dir().join(format!("ferrotext-profile-{}", std::process::id()));
    let out = ferrotext(&[
        "train",
        &format!("base_output_directory={}", root.display()),
        "run_name=profiled",
        "steps=3",
        "base_emb_dim=32",
        "base_mlp_dim=64",
        "head_dim=8",
        "max_target_length=16",
        "profile=true",
        "profile_steps=1:3",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Two steps on four devices; the backward's matmuls, the step's one all-reduce phase and
    // the optimizer all appear.
    assert!(
        stdout.contains("profile: 2 step(s) × 4 device(s)"),
        "{stdout}"
    );
    for row in ["dot_general", "all_reduce", "optimizer"] {
        assert!(
            stdout.lines().any(|l| l.trim_start().starts_with(row)),
            "{row}: {stdout}"
        );
    }
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("dot_general") && l.contains("backward")),
        "{stdout}"
    );
    let run = root.join("profiled");
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("profile-trace.json")).expect("the trace"))
            .expect("JSON");
    let events = trace["traceEvents"].as_array().expect("events");
    let tracks: std::collections::BTreeSet<_> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["tid"].as_u64())
        .collect();
    assert_eq!(tracks.len(), 4, "one track per device");
    let steps: Vec<_> = events.iter().filter(|e| e["name"] == "step").collect();
    assert_eq!(steps.len(), 2 * 4, "two profiled steps per device");
    assert!(std::fs::read_to_string(run.join("profile.txt"))
        .expect("table")
        .contains("phases:"));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn bad_profile_steps_are_a_usage_error() {
    for steps in ["3", "2:1", "x:4", "9:12"] {
        let out = ferrotext(&[
            "train",
            "steps=5",
            "profile=true",
            &format!("profile_steps={steps}"),
        ]);
        assert_eq!(out.status.code(), Some(2), "{steps}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        // "3" is not even a string to TOML; the others parse and fail the range check.
        assert!(
            stderr.contains("profile_steps") && stderr.contains("a:b"),
            "{stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
}
