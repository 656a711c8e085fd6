//! Multi-process runs under `mpirun` (feature `mpi`): collectives against a serial reference,
//! the hierarchical algorithm's traffic, failures that end the job, and training that equals the
//! in-process run — losses, schedule and checkpoints.
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod scratch;
use scratch::scratch;

/// One MPI job at a time: they share the machine's cores.
static JOBS: Mutex<()> = Mutex::new(());

const EXE: &str = env!("CARGO_BIN_EXE_ferrotext");

fn mpirun_command(processes: usize, args: &[&str]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-n"])
        .arg(processes.to_string())
        .arg(EXE)
        .args(args);
    cmd
}

fn mpirun(processes: usize, args: &[&str]) -> Output {
    mpirun_command(processes, args)
        .output()
        .expect("mpirun runs (install openmpi-bin)")
}

fn local(args: &[&str]) -> Output {
    Command::new(EXE)
        .args(args)
        .output()
        .expect("ferrotext runs")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn succeeded(out: &Output) -> String {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

/// `train`'s arguments: `base`, then `extra`, then `run_name=run`.
fn train_args(base: &[&str], extra: &[&str], run: &str) -> Vec<String> {
    let mut v: Vec<String> = std::iter::once(&"train")
        .chain(base)
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    v.push(format!("run_name={run}"));
    v
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn collectives_across_processes_equal_the_serial_reference() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let cases: &[(usize, &str, &str, bool)] = &[
        (2, "data=4", "data", false),
        (2, "data=4", "data", true),
        (4, "data=4", "data", false),
        (2, "data=2,tensor=2", "data,tensor", false),
        (2, "data=2,tensor=2", "tensor,data", false),
        (2, "data=2,tensor=2", "data", false),
        (2, "data=2,tensor=2", "tensor", false),
        (4, "data=2,tensor=4", "data,tensor", false),
    ];
    for &(processes, mesh, axes, flat) in cases {
        let mut args = vec![
            "collectives",
            "--mesh",
            mesh,
            "--axes",
            axes,
            "--elements",
            "1001",
        ];
        if flat {
            args.push("--flat");
        }
        let stdout = succeeded(&mpirun(processes, &args));
        let ok = stdout
            .lines()
            .filter(|l| l.contains("equal the serial reference"))
            .count();
        assert_eq!(
            ok, processes,
            "{processes} processes, {mesh} over {axes}:\n{stdout}"
        );
    }
}

/// The pipelined collectives (all-reduce, reduce-scatter, all-gather) against the serial
/// tree-order sum, bitwise, with contents whose f32 sums depend on the order of addition, on
/// lengths whose chunks are uneven and cut into several parts (the last one short), for several
/// process counts; flat over 2 processes × 2 devices mixes peers in and out of the process.
#[test]
fn pipelined_collectives_equal_tree_order_sums_bitwise_on_uneven_sizes() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let cases: &[(usize, &str, bool, &str)] = &[
        (2, "data=2", false, "1000003"),
        (3, "data=3", false, "777777"),
        (4, "data=4", false, "1000001"),
        (2, "data=4", true, "600011"),
        (2, "data=2", false, "5"),
    ];
    for &(processes, mesh, flat, elements) in cases {
        let mut args = vec![
            "collectives",
            "--mesh",
            mesh,
            "--elements",
            elements,
            "--rounding",
        ];
        if flat {
            args.push("--flat");
        }
        let stdout = succeeded(&mpirun(processes, &args));
        let ok = stdout
            .lines()
            .filter(|l| l.contains("equal the serial reference"))
            .count();
        assert_eq!(
            ok, processes,
            "{processes} processes, {mesh}, {elements}:\n{stdout}"
        );
    }
}

/// A device whose all-reduce is twice as long: its first parts have the same size as its
/// peers' (parts of a fixed size), only the header's element count differs.
#[test]
fn a_length_disagreement_is_a_mismatch_from_the_first_part() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let out = mpirun(
        2,
        &[
            "collectives",
            "--mesh",
            "data=2",
            "--elements",
            "262144",
            "--diverge-length",
            "1",
            "--timeout-seconds",
            "30",
        ],
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("collective mismatch at collective #4") && stderr.contains("elements"),
        "{stderr}"
    );
}

/// Bytes process `p` sent to other processes and within itself, from the demo's report.
fn traffic(stdout: &str) -> Vec<(u64, u64)> {
    let mut rows: Vec<(usize, u64, u64)> = stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("process ")?;
            let (p, rest) = rest.split_once(": mpi bytes to other processes ")?;
            let (other, within) = rest.split_once(", within this process ")?;
            Some((p.parse().ok()?, other.parse().ok()?, within.parse().ok()?))
        })
        .collect();
    rows.sort();
    rows.into_iter().map(|(_, o, w)| (o, w)).collect()
}

#[test]
fn hierarchical_all_reduce_sends_one_lth_of_the_flat_bytes_between_processes() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    for (mesh, per_process) in [("data=4", 2u64), ("data=8", 4)] {
        let run = |flat: bool| {
            let mut args = vec![
                "collectives",
                "--mesh",
                mesh,
                "--elements",
                "65536",
                "--micro-batches",
                "0",
                "--all-reduce-only",
            ];
            if flat {
                args.push("--flat");
            }
            traffic(&succeeded(&mpirun(2, &args)))
        };
        let (hierarchical, flat) = (run(false), run(true));
        assert_eq!(hierarchical.len(), 2, "{hierarchical:?}");
        for (h, f) in hierarchical.iter().zip(&flat) {
            assert!(
                h.0 > 0,
                "the hierarchical all-reduce crossed processes: {h:?}"
            );
            assert_eq!(
                h.0 * per_process,
                f.0,
                "{mesh}: hierarchical {h:?}, flat {f:?}"
            );
            // Mirror: the flat algorithm also sends to its own process's devices through MPI;
            // the hierarchical one keeps those in shared memory.
            assert_eq!(h.1, 0);
            assert!(f.1 > 0);
        }
    }
}

#[test]
fn a_diverging_device_ends_the_job_with_a_mismatch_error() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let out = mpirun(
        2,
        &[
            "collectives",
            "--mesh",
            "data=2",
            "--diverge-device",
            "1",
            "--timeout-seconds",
            "20",
        ],
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("collective mismatch at collective #4"),
        "{stderr}"
    );
}

/// A diverged device's all-gather sends its whole 4 MiB input where its peers expect a chunk of
/// their all-reduce: a message larger than the receive. Before receives were sized from the
/// matched probe, Open MPI's shared-memory single-copy path wrote it past the receive buffer
/// (`malloc(): corrupted top size`, SIGABRT; SIGSEGV with `--flat`).
#[test]
fn a_larger_message_from_a_diverged_device_is_a_mismatch_not_memory_corruption() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    for (mesh, flat) in [("data=4", false), ("data=4", true), ("data=8", true)] {
        let mut args = vec![
            "collectives",
            "--mesh",
            mesh,
            "--diverge-device",
            "1",
            "--timeout-seconds",
            "30",
        ];
        if flat {
            args.push("--flat");
        }
        let out = mpirun(2, &args);
        let (stdout, stderr) = text(&out);
        let all = format!("{stdout}\n{stderr}");
        assert!(!out.status.success(), "{mesh} flat={flat}: {all}");
        assert!(
            stderr.contains("collective mismatch at collective #4"),
            "{mesh} flat={flat}: {all}"
        );
        for crash in [
            "malloc()",
            "corrupted",
            "signal 11",
            "signal 6",
            "Segmentation",
        ] {
            assert!(!all.contains(crash), "{mesh} flat={flat}: {crash}: {all}");
        }
    }
}

#[test]
fn a_stalled_process_ends_the_job_with_a_timeout_error_within_the_timeout() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let started = Instant::now();
    let out = mpirun(
        2,
        &[
            "collectives",
            "--mesh",
            "data=2",
            "--stall-device",
            "1",
            "--timeout-seconds",
            "2",
        ],
    );
    let elapsed = started.elapsed();
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("timed out after") && stderr.contains("devices [1] never arrived"),
        "{stderr}"
    );
    // Ended by the 2 s timeout, not by the end of the 20 s stall (after which the run would
    // have succeeded): the error above already says so; this bounds the wait.
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
}

#[test]
fn killing_one_process_ends_the_job_with_a_clear_error() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("mpi-kill");
    let out_dir = format!("base_output_directory={}", dir.display());
    let child = mpirun_command(2, &["train", "local_devices=2", "steps=100000", &out_dir])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    // Wait until both processes run, then kill process 1 (its PID is the later child).
    let deadline = Instant::now() + Duration::from_secs(60);
    let victim = loop {
        let pids = Command::new("pgrep")
            .args(["-P", &child.id().to_string()])
            .output()
            .expect("pgrep runs");
        let pids: Vec<String> = String::from_utf8_lossy(&pids.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect();
        if pids.len() == 2 {
            std::thread::sleep(Duration::from_secs(2)); // well into training
            break pids[1].clone();
        }
        assert!(Instant::now() < deadline, "the MPI processes did not start");
        std::thread::sleep(Duration::from_millis(100));
    };
    Command::new("kill")
        .args(["-9", &victim])
        .status()
        .expect("kill runs");
    let killed = Instant::now();
    let out = child.wait_with_output().expect("mpirun ends");
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("exited on signal 9"), "{stderr}");
    assert!(
        killed.elapsed() < Duration::from_secs(30),
        "took {:?}",
        killed.elapsed()
    );
}

/// `(loss, grad_norm)` per step from a run's metrics file.
fn metrics(dir: &Path, run: &str) -> Vec<(f64, f64)> {
    let text = std::fs::read_to_string(dir.join(run).join("metrics.jsonl")).expect("metrics");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            (
                v["loss"].as_f64().unwrap_or(f64::NAN),
                v["grad_norm"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect()
}

/// The per-phase collective table a run prints.
fn schedule(stdout: &str) -> String {
    stdout
        .split("collectives of device 0 (all steps):")
        .nth(1)
        .and_then(|rest| rest.split("metrics:").next())
        .unwrap_or("")
        .to_string()
}

fn assert_close(a: &[(f64, f64)], b: &[(f64, f64)], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x.0 - y.0).abs() <= 1e-6 && (x.1 - y.1).abs() <= 1e-6,
            "{what}: {a:?} vs {b:?}"
        );
    }
}

/// `layout_invariant=true` over MPI: 2 processes × 2 devices (hierarchical) and 4 processes ×
/// 1 device (flat), GA 1, log the same losses and grad norms to the bit as one device with GA 4
/// in one process — the same global batch, laid out three ways.
#[test]
fn layout_invariant_mpi_runs_equal_one_device_bitwise() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("mpi-layout");
    let out_dir = format!("base_output_directory={}", dir.display());
    let with = |extra: &[&str], run: &str| -> Vec<String> {
        let mut v: Vec<String> = [
            "train",
            "steps=3",
            "opt_type=adamw",
            "deterministic=true",
            "layout_invariant=true",
            &out_dir,
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        v.push(format!("run_name={run}"));
        v
    };
    let one = [
        "ici_data_parallelism=1",
        "local_devices=1",
        "gradient_accumulation_steps=4",
    ];
    succeeded(&local(&refs(&with(&one, "one"))));
    succeeded(&mpirun(
        2,
        &refs(&with(
            &["local_devices=2", "gradient_accumulation_steps=1"],
            "two_by_two",
        )),
    ));
    succeeded(&mpirun(
        4,
        &refs(&with(
            &["local_devices=1", "gradient_accumulation_steps=1"],
            "four",
        )),
    ));
    let want = metrics(&dir, "one");
    assert_eq!(want.len(), 3);
    assert_eq!(metrics(&dir, "two_by_two"), want, "2 processes × 2 devices");
    assert_eq!(metrics(&dir, "four"), want, "4 processes × 1 device");
}

#[test]
fn mpi_training_equals_the_local_run_and_repeats_bitwise() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("mpi-train");
    let out_dir = format!("base_output_directory={}", dir.display());
    let common = [
        "train",
        "steps=3",
        "gradient_accumulation_steps=4",
        &out_dir,
    ];
    let with = |extra: &[&'static str], run: &'static str| -> Vec<String> {
        let mut v: Vec<String> = common.iter().map(|s| s.to_string()).collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v.push(format!("run_name={run}"));
        v
    };
    let first = succeeded(&mpirun(4, &refs(&with(&["local_devices=1"], "mpi_a"))));
    let _ = succeeded(&mpirun(4, &refs(&with(&["local_devices=1"], "mpi_b"))));
    let hybrid = succeeded(&mpirun(2, &refs(&with(&["local_devices=2"], "hybrid"))));
    let alone = succeeded(&local(&refs(&with(&["local_devices=4"], "local"))));
    assert!(first.contains("MPI (Open MPI"), "{first}");

    let (a, b) = (metrics(&dir, "mpi_a"), metrics(&dir, "mpi_b"));
    assert_eq!(a.len(), 3);
    assert_eq!(a, b, "two MPI runs are bitwise equal");
    assert!(a[2].0 < a[0].0, "the loss falls: {a:?}");
    assert_close(
        &a,
        &metrics(&dir, "local"),
        "mpirun -n 4 vs 4 local devices",
    );
    assert_close(
        &metrics(&dir, "hybrid"),
        &metrics(&dir, "local"),
        "2 processes × 2 devices vs 4 local",
    );

    // The same schedule: only the loss all-reduce in micro-batches, the gradients in update.
    let (mpi_schedule, local_schedule) = (schedule(&first), schedule(&alone));
    assert!(
        mpi_schedule.contains("micro_batch 3  all_reduce  3      12 B"),
        "{mpi_schedule}"
    );
    assert_eq!(mpi_schedule, local_schedule);
    assert_eq!(schedule(&hybrid), local_schedule);
}

/// With the gate closed (`shard_mode=auto`) and `overlap_grad_reduce=true`, each micro-batch's
/// reduction runs bucket by bucket on the background stream's MPI communicator during its
/// backward (DDP): the losses are the untagged in-process run's, over flat and hierarchical
/// processes, and every micro-batch all-reduces the gradients in buckets, not one per gradient.
#[test]
fn per_micro_batch_overlap_across_processes_equals_the_untagged_local_run() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("mpi-ddp");
    let out_dir = format!("base_output_directory={}", dir.display());
    let args = |extra: &[&str], run: &str| {
        train_args(
            &[
                "steps=3",
                "gradient_accumulation_steps=2",
                "shard_mode=auto",
                "grad_bucket_mb=0.1",
                &out_dir,
            ],
            extra,
            run,
        )
    };
    let ddp = succeeded(&mpirun(
        4,
        &refs(&args(
            &["local_devices=1", "overlap_grad_reduce=true"],
            "ddp",
        )),
    ));
    let _ = succeeded(&mpirun(
        2,
        &refs(&args(
            &["local_devices=2", "overlap_grad_reduce=true"],
            "ddp_hybrid",
        )),
    ));
    let untagged = succeeded(&local(&refs(&args(&["local_devices=4"], "untagged"))));
    assert!(
        ddp.contains("overlap          on: each micro-batch"),
        "{ddp}"
    );
    let reference = metrics(&dir, "untagged");
    assert_close(&metrics(&dir, "ddp"), &reference, "DDP over 4 processes");
    assert_close(&metrics(&dir, "ddp_hybrid"), &reference, "DDP over 2 × 2");
    // A row per micro-batch: (count, bytes); the same bytes, in fewer collectives.
    let row = |table: &str, phase: &str| -> (usize, String) {
        let line = table
            .lines()
            .find(|l| l.starts_with(phase) && l.contains("all_reduce"))
            .unwrap_or_else(|| panic!("no {phase} row in {table}"));
        let cols: Vec<&str> = line.split_whitespace().collect();
        (cols[3].parse().expect("count"), cols[4..].join(" "))
    };
    for phase in ["micro_batch 0", "micro_batch 1"] {
        let (buckets, bytes) = row(&schedule(&ddp), phase);
        let (per_gradient, local_bytes) = row(&schedule(&untagged), phase);
        assert_eq!(bytes, local_bytes, "{phase}");
        assert!(
            buckets < per_gradient,
            "{phase}: {buckets} vs {per_gradient}"
        );
    }
}

/// Copies checkpoint `name` of run `from` into a fresh run `to`, as its latest.
fn adopt_checkpoint(dir: &Path, from: &str, name: &str, to: &str) {
    let src = dir.join(from).join("checkpoints").join(name);
    let dst_root = dir.join(to).join("checkpoints");
    std::fs::create_dir_all(dst_root.join(name)).expect("mkdir");
    for entry in std::fs::read_dir(&src).expect("checkpoint dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dst_root.join(name).join(entry.file_name())).expect("copy");
    }
    std::fs::write(dst_root.join("latest"), name).expect("latest");
}

#[test]
fn mid_step_checkpoints_move_between_mpi_and_local_runs() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("mpi-ckpt");
    let out_dir = format!("base_output_directory={}", dir.display());
    let args = |run: &str, devices: &str| -> Vec<String> {
        [
            "train",
            "steps=2",
            "gradient_accumulation_steps=4",
            "enable_checkpointing=true",
            "checkpoint_micro_batch_period=2",
            devices,
            &out_dir,
            &format!("run_name={run}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    succeeded(&mpirun(4, &refs(&args("mpi", "local_devices=1"))));
    succeeded(&local(&refs(&args("local", "local_devices=4"))));
    let whole = metrics(&dir, "local");
    assert_close(&metrics(&dir, "mpi"), &whole, "uninterrupted runs");

    // Written under MPI in the middle of step 1, finished by 4 local devices, and vice versa.
    let mid = "step_00000001_micro_002";
    adopt_checkpoint(&dir, "mpi", mid, "to_local");
    succeeded(&local(&refs(&args("to_local", "local_devices=4"))));
    adopt_checkpoint(&dir, "local", mid, "to_mpi");
    succeeded(&mpirun(4, &refs(&args("to_mpi", "local_devices=1"))));
    for run in ["to_local", "to_mpi"] {
        let resumed = metrics(&dir, run);
        assert_eq!(resumed.len(), 1, "{run} ran only the rest of step 1");
        assert_close(&resumed, &whole[1..], run);
    }
}

#[test]
fn processes_started_with_different_configs_stop_at_start_up() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe"])
        .args(["-n", "1", EXE, "train", "local_devices=1", "steps=3"])
        .arg(":")
        .args(["-n", "1", EXE, "train", "local_devices=1", "steps=4"])
        .output()
        .expect("mpirun runs");
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("disagree on the config: processes [1] differ from process 0"),
        "{stderr}"
    );
}

/// Process 1 never reaches the start-up config agreement (it runs another command, whose own
/// collective waits a minute for device 0): process 0's agreement gives up after the run's
/// collective timeout naming process 1, instead of waiting inside `MPI_Allgather` for good.
#[test]
fn a_process_that_never_reaches_the_config_agreement_is_named_after_the_timeout() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let started = Instant::now();
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe"])
        .args(["-n", "1", EXE, "train", "local_devices=1", "steps=3"])
        .arg("collective_timeout_seconds=2")
        .arg(":")
        .args(["-n", "1", EXE, "collectives", "--mesh", "data=2"])
        .args(["--timeout-seconds", "60"])
        .output()
        .expect("mpirun runs");
    let elapsed = started.elapsed();
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("agreement on the config")
            && stderr.contains("processes [1] never arrived"),
        "{stderr}"
    );
    // Ended by the 2 s agreement timeout, not by process 1's own 60 s one.
    assert!(elapsed < Duration::from_secs(50), "took {elapsed:?}");
}

/// In one process, a device stalled for ten timeouts no longer keeps the run (and the process)
/// alive after its peer timed out: the run returns naming it as left running.
#[test]
fn an_in_process_stalled_device_does_not_keep_the_process_alive() {
    let started = Instant::now();
    let out = local(&[
        "collectives",
        "--mesh",
        "data=2",
        "--stall-device",
        "1",
        "--timeout-seconds",
        "2",
    ]);
    let elapsed = started.elapsed();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("devices [1] never arrived"), "{stderr}");
    assert!(
        stderr.contains("devices [1] were still running"),
        "{stderr}"
    );
    // The stall lasts 20 s; the run returns after about 2 × 2 s.
    assert!(elapsed < Duration::from_secs(16), "took {elapsed:?}");
}

/// Sizes and timeouts that cannot work are one `error:` line and exit code 2, before anything
/// is allocated; they used to abort in the allocator or panic in `Duration::from_secs_f64`.
#[test]
fn impossible_sizes_and_timeouts_are_usage_errors() {
    for args in [
        &["--elements", "1000000000000"][..],
        &["--elements", "18446744073709551615"],
        &["--timeout-seconds", "NaN"],
        &["--timeout-seconds", "inf"],
        &["--timeout-seconds", "1e30"],
    ] {
        let mut all = vec!["collectives"];
        all.extend_from_slice(args);
        let out = local(&all);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stdout}{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        if args[0] == "--elements" {
            assert!(stderr.contains("of memory"), "{stderr}");
        } else {
            assert!(stderr.contains("collective timeout"), "{stderr}");
        }
    }
}

/// `grad_dtype=bfloat16` over MPI, 2 processes × 1 device (the flat pipeline: each member's
/// block rounded to bf16, summed in f32 in the tree order by its owner, rounded once): losses and
/// gradient norms equal the in-process run on 2 devices to the bit, and differ from the float32
/// reduction's (the mirror: the setting reached the wire).
#[test]
fn bf16_gradients_over_mpi_equal_the_in_process_run_bitwise() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("mpi-bf16-grads");
    let out_dir = format!("base_output_directory={}", dir.display());
    let args = |extra: &[&str], run: &str| {
        train_args(
            &[
                "steps=3",
                "gradient_accumulation_steps=2",
                "deterministic=true",
                &out_dir,
            ],
            extra,
            run,
        )
    };
    let mpi = succeeded(&mpirun(
        2,
        &refs(&args(&["local_devices=1", "grad_dtype=bfloat16"], "mpi")),
    ));
    let _ = succeeded(&local(&refs(&args(
        &["local_devices=2", "grad_dtype=bfloat16"],
        "local",
    ))));
    let _ = succeeded(&local(&refs(&args(&["local_devices=2"], "local_f32"))));
    assert!(mpi.contains("MPI (Open MPI"), "{mpi}");
    assert!(
        mpi.contains("grad_dtype bfloat16 (f32 accumulator"),
        "{mpi}"
    );
    let (m, l, f) = (
        metrics(&dir, "mpi"),
        metrics(&dir, "local"),
        metrics(&dir, "local_f32"),
    );
    assert_eq!(m.len(), 3);
    assert_eq!(m, l, "mpirun -n 2 vs 2 local devices, grad_dtype=bfloat16");
    assert_ne!(l, f, "bf16 and f32 reductions");
    assert_eq!(l[0].0, f[0].0, "step 0's loss comes before any update");
    assert_ne!(
        l[0].1, f[0].1,
        "step 0's gradient norm is of the rounded reduction"
    );
    // 2 processes × 2 devices (hierarchical): each process's partial sum is rounded to bf16
    // once more before it crosses (comm/src/narrow.rs), so only close to 4 local devices.
    let _ = succeeded(&mpirun(
        2,
        &refs(&args(&["local_devices=2", "grad_dtype=bfloat16"], "hybrid")),
    ));
    let _ = succeeded(&local(&refs(&args(
        &["local_devices=4", "grad_dtype=bfloat16"],
        "local4",
    ))));
    let (h, l4) = (metrics(&dir, "hybrid"), metrics(&dir, "local4"));
    assert_eq!(h.len(), 3);
    for (x, y) in h.iter().zip(&l4) {
        assert!(
            (x.0 - y.0).abs() <= 1e-3 * y.0 && (x.1 - y.1).abs() <= 1e-2 * y.1,
            "hierarchical {h:?} vs local {l4:?}"
        );
    }
}

/// Context parallelism across processes: one sequence split over 2 processes × 2 devices
/// (`ici_context_parallelism=4`, load-balanced) logs the one-device run's losses and gradient
/// norms (within 1e-6), and its keys' gathers and their cotangents' reduce-scatters cross the
/// processes inside the micro-batches.
#[test]
fn a_sequence_split_over_processes_trains_the_one_device_losses() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("mpi-context");
    let out_dir = format!("base_output_directory={}", dir.display());
    let args = |extra: &[&str], run: &str| {
        train_args(
            &[
                "steps=3",
                "max_target_length=64",
                "ici_data_parallelism=1",
                &out_dir,
            ],
            extra,
            run,
        )
    };
    let split = [
        "local_devices=2",
        "ici_context_parallelism=4",
        "per_device_batch_size=0.5",
    ];
    let mpi = succeeded(&mpirun(2, &refs(&args(&split, "mpi"))));
    let one = ["local_devices=1", "per_device_batch_size=2"];
    let _ = succeeded(&local(&refs(&args(&one, "one"))));
    assert!(mpi.contains("'context': 4"), "{mpi}");
    assert_close(
        &metrics(&dir, "mpi"),
        &metrics(&dir, "one"),
        "context=4 over MPI",
    );
    let table = schedule(&mpi);
    assert!(
        table.contains("all_gather") && table.contains("reduce_scatter"),
        "{table}"
    );
}
