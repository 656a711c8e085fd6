//! Run outputs: the metrics log survives a killed run and a resume never duplicates a step; every
//! output path is checked before a run starts.

use ferrotext_train::io::{check_output_paths, MetricsLog};
use ferrotext_train::{StepMetrics, TrainConfig};

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-outputs-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn step(step: usize) -> StepMetrics {
    StepMetrics {
        step,
        loss: 1.0 / (step + 1) as f64,
        tokens: 16,
        grad_norm: 0.5,
        learning_rate: 1e-3,
        seconds: 0.1,
        cpu: None,
        skipped: false,
        epoch: None,
        eval_loss: None,
        eval_perplexity: None,
        mtp_loss: None,
    }
}

fn steps_in(path: &std::path::Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

#[test]
fn each_step_is_on_disk_when_it_ends_and_a_resume_drops_the_steps_it_repeats() {
    let dir = scratch("metrics");
    let path = dir.join("run/metrics.jsonl");
    {
        let mut log = MetricsLog::open(&path, 0).unwrap();
        for s in 0..5 {
            log.append(&step(s)).unwrap();
            // Readable by another process right away (no buffering until the end).
            assert_eq!(steps_in(&path).len(), s + 1);
        }
        // Dropped without any closing call: as a killed run would leave it.
    }
    // A resume from the checkpoint of step 3 repeats steps 3 and 4.
    let mut log = MetricsLog::open(&path, 3).unwrap();
    assert_eq!(steps_in(&path), [0, 1, 2]);
    for s in 3..6 {
        log.append(&step(s)).unwrap();
    }
    assert_eq!(steps_in(&path), [0, 1, 2, 3, 4, 5]);
    // A fresh run (step 0) starts the file over.
    MetricsLog::open(&path, 0).unwrap();
    assert_eq!(steps_in(&path), Vec::<u64>::new());
    std::fs::remove_dir_all(&dir).ok();
}

fn config(items: &[String]) -> TrainConfig {
    TrainConfig::load(None, items).unwrap()
}

#[test]
fn unwritable_outputs_are_found_before_the_run_and_nothing_is_left_behind() {
    let dir = scratch("paths");
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let out = |p: &std::path::Path| format!("base_output_directory={}", p.display());
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec![out(&file)], "is not a directory"),
        (
            vec![format!("metrics_file={}", dir.display())],
            "is a directory",
        ),
        (
            vec![out(&dir), format!("save_parameters_path={}", dir.display())],
            "save_parameters_path",
        ),
        (
            vec![
                out(&dir),
                "metrics_file=/proc/ferrotext/metrics.jsonl".into(),
            ],
            "refuses new files",
        ),
        (
            vec![out(&dir), format!("run_name={}", "r".repeat(5000))],
            "name component of 5000 bytes",
        ),
        (
            vec![
                out(&file.join("below-a-file")),
                "enable_checkpointing=true".into(),
            ],
            "is not a directory",
        ),
    ];
    for (items, needle) in cases {
        let err = check_output_paths(&config(&items)).unwrap_err().to_string();
        assert!(err.contains(needle), "{items:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // Nothing was created by the checks.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("a-file")]);
    // The mirror: writable outputs in a directory that does not exist yet pass, and create
    // nothing either.
    let fresh = dir.join("not/yet/there");
    check_output_paths(&config(&[out(&fresh), "enable_checkpointing=true".into()])).unwrap();
    assert!(!dir.join("not").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// A `metrics_file` that names an existing file which is not a metrics file (a path given by
/// mistake) is refused before the run, and again by the log itself, and its bytes are kept; a
/// metrics file whose last line a kill cut off (no newline after it) opens, the cut line
/// dropped — the mirror that the check refuses only what is not a metrics file.
#[test]
fn a_file_that_is_not_a_metrics_file_is_never_overwritten() {
    let dir = scratch("not-metrics");
    let out = format!("base_output_directory={}", dir.display());
    let notes = dir.join("notes.md");
    let bad_line = dir.join("bad-line.jsonl");
    let binary = dir.join("binary.jsonl");
    std::fs::write(&notes, "# my notes\n\nimportant text\n").unwrap();
    let first = serde_json::to_string(&step(0)).unwrap();
    std::fs::write(
        &bad_line,
        format!("{first}\n{{\"step\":1,\"loss\":NaN}}\n{first}\n"),
    )
    .unwrap();
    std::fs::write(&binary, [0xff, 0xfe, 0x00, 0x01]).unwrap();
    for (path, line) in [(&notes, 1), (&bad_line, 2), (&binary, 1)] {
        let before = std::fs::read(path).unwrap();
        let items = [out.clone(), format!("metrics_file={}", path.display())];
        let err = check_output_paths(&config(&items)).unwrap_err().to_string();
        assert!(err.contains("metrics_file"), "{err}");
        assert!(
            err.contains(&format!("line {line} is not a metrics line")),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        if path != &binary {
            let err = MetricsLog::open(path, 0).err().map(|e| e.to_string());
            assert!(err.is_some_and(|e| e.contains("not overwritten")));
        }
        assert_eq!(std::fs::read(path).unwrap(), before, "{}", path.display());
    }

    let cut = dir.join("cut.jsonl");
    let second = serde_json::to_string(&step(1)).unwrap();
    std::fs::write(&cut, format!("{first}\n{second}\n{{\"step\":2,\"lo")).unwrap();
    let items = [out.clone(), format!("metrics_file={}", cut.display())];
    check_output_paths(&config(&items)).unwrap();
    MetricsLog::open(&cut, 2).unwrap();
    assert_eq!(steps_in(&cut), [0, 1]);
    std::fs::remove_dir_all(&dir).ok();
}
