//! Classes of failure found by fault injection, each fixed as a class: a rerun of a finished
//! run still delivers its declared outputs; no file a run reads (a checkpoint's included) can
//! block it; a binary that cannot speak MPI refuses to run under an MPI launcher; a binary built
//! without the `fault-injection` feature carries no test hook.

use std::path::Path;
use std::process::Command;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// `ferrotext train` on a small job writing under `dir/run`, with checkpoints on; killed (and
/// the test failed) if it has not finished in two minutes, so a read that blocks cannot hang
/// the suite.
fn train(dir: &Path, run: &str, extra: &[&str]) -> std::process::Output {
    let base = format!("base_output_directory={}", dir.display());
    let run = format!("run_name={run}");
    let mut args = vec![
        "train",
        &base,
        &run,
        "steps=2",
        "max_target_length=16",
        "gradient_accumulation_steps=2",
        "enable_checkpointing=true",
    ];
    args.extend_from_slice(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the ferrotext binary runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().ok();
            panic!("ferrotext {args:?} was still running after two minutes");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// A job killed after its final checkpoint but before it wrote `save_parameters_path` is
/// restarted as it was: the rerun has nothing to train, says so, and still writes the file —
/// the final checkpoint's parameters, the same bytes an uninterrupted run writes.
#[test]
fn a_rerun_of_a_finished_run_still_writes_its_parameters() {
    let dir = temp_dir("rerun-outputs");
    std::fs::create_dir_all(&dir).unwrap();
    let promised = dir.join("final.safetensors");
    let save = format!("save_parameters_path={}", promised.display());
    // The "killed" job: every step and checkpoint done, the parameters file never written.
    let first = train(&dir, "killed", &[]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(!promised.exists());
    // The scheduler restarts it with its full command line.
    let rerun = train(&dir, "killed", &[&save]);
    let stdout = String::from_utf8_lossy(&rerun.stdout);
    assert!(
        rerun.status.success(),
        "{}",
        String::from_utf8_lossy(&rerun.stderr)
    );
    assert!(stdout.contains("nothing to do"), "{stdout}");
    assert!(
        promised.is_file(),
        "the promised file was written: {stdout}"
    );
    // Against an independent baseline: the same job never interrupted.
    let whole = dir.join("whole.safetensors");
    let whole_arg = format!("save_parameters_path={}", whole.display());
    let uninterrupted = train(&dir, "whole", &[&whole_arg]);
    assert!(uninterrupted.status.success());
    assert_eq!(
        std::fs::read(&promised).unwrap(),
        std::fs::read(&whole).unwrap(),
        "the rerun wrote the uninterrupted run's parameters"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Every file of a checkpoint that a restore reads, replaced by a FIFO (which would block a
/// reader forever), is refused with one line naming it (exit 2 or 1), at once. The mirror: the
/// untouched checkpoint restores.
#[test]
fn a_checkpoint_file_that_is_not_a_regular_file_is_refused_not_waited_on() {
    let dir = temp_dir("fifo-checkpoint");
    std::fs::create_dir_all(&dir).unwrap();
    let first = train(&dir, "run", &[]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let root = dir.join("run/checkpoints");
    let latest = std::fs::read_to_string(root.join("latest")).unwrap();
    let ckpt = root.join(latest.trim());
    // The mirror: resuming from the intact checkpoint (two more steps) works.
    let more = train(&dir, "run", &["steps=3", "checkpoint_keep=0"]);
    assert!(
        more.status.success(),
        "{}",
        String::from_utf8_lossy(&more.stderr)
    );
    let latest = std::fs::read_to_string(root.join("latest")).unwrap();
    let ckpt_now = root.join(latest.trim());
    assert_ne!(ckpt, ckpt_now);
    let names: Vec<String> = std::fs::read_dir(&ckpt_now)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().any(|n| n == "params.safetensors"), "{names:?}");
    for name in names.iter().chain(std::iter::once(&"latest".to_string())) {
        let path = if name == "latest" {
            root.join("latest")
        } else {
            ckpt_now.join(name)
        };
        let saved = dir.join("saved");
        std::fs::rename(&path, &saved).unwrap();
        let made = Command::new("mkfifo").arg(&path).status().unwrap();
        assert!(made.success());
        let out = train(&dir, "run", &["steps=4"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: a FIFO was accepted");
        assert!(stderr.starts_with("error: "), "{name}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{name}: {stderr}");
        assert!(stderr.contains(name.as_str()), "{name}: {stderr}");
        std::fs::remove_file(&path).unwrap();
        std::fs::rename(&saved, &path).unwrap();
    }
    std::fs::remove_dir_all(dir).ok();
}

/// A binary built without the `mpi` feature, started under an MPI launcher (its environment
/// says so), stops with one line saying how to build it, before it writes anything; the mirror
/// (the same command outside a launcher) trains.
#[cfg(not(feature = "mpi"))]
#[test]
fn a_binary_without_mpi_refuses_to_run_under_an_mpi_launcher() {
    let dir = temp_dir("no-mpi");
    let base = format!("base_output_directory={}", dir.display());
    for var in [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_RANK",
        "MPI_LOCALNRANKS",
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrotext"))
            .args(["train", &base, "steps=1", "max_target_length=16"])
            .env(var, "2")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}: {stderr}");
        assert!(stderr.contains("--features mpi"), "{var}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{var}: {stderr}");
        assert!(!dir.exists(), "{var}: nothing written");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .args(["train", &base, "steps=1", "max_target_length=16"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(dir).ok();
}

/// Whether the binary's bytes contain `needle` (a string the test hooks print or read).
fn binary_contains(needle: &[u8]) -> bool {
    let bytes = std::fs::read(env!("CARGO_BIN_EXE_ferrotext")).expect("the binary reads");
    bytes.windows(needle.len()).any(|w| w == needle)
}

/// A binary built without the `fault-injection` feature (a release build, or this suite run
/// as `.ci/run` runs it without features) has no test hook: it never reads `FERROTEXT_FAULT`
/// (the run asked to panic trains and exits 0), and neither the variable's name nor the
/// injected panic's message is in it.
#[cfg(not(feature = "fault-injection"))]
#[test]
fn a_build_without_fault_injection_has_no_test_hook() {
    assert!(!binary_contains(b"FERROTEXT_FAULT"));
    assert!(!binary_contains(b"injected fault: device"));
    let dir = temp_dir("no-hook");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotext"));
    child.env("FERROTEXT_FAULT", "device_panic:0");
    let out = child
        .args([
            "train",
            &format!("base_output_directory={}", dir.display()),
            "steps=1",
            "max_target_length=16",
        ])
        .output()
        .expect("the ferrotext binary runs");
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The mirror: built with the feature (the README's test command), the same probe finds the
/// hook (and `cli.rs` checks what it does).
#[cfg(feature = "fault-injection")]
#[test]
fn a_build_with_fault_injection_has_the_hook() {
    assert!(binary_contains(b"FERROTEXT_FAULT"));
    assert!(binary_contains(b"injected fault: device"));
}
