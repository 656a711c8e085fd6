//! The front door through the binary: `ferrotext plot` (several runs on one chart, bad run
//! directories) and `ferrotext keys`.

use std::path::PathBuf;
use std::process::Command;

fn ferrotext(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .args(args)
        .output()
        .expect("the ferrotext binary runs")
}

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
