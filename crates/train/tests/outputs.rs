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
