//! `ferrotext emulate`: jobs under `mpirun` on emulated hosts (network namespaces on a bridge).
//! The bytes on the links per step (deferred = ¼ of per-micro-batch at GA 4, each near the
//! trace's prediction; `grad_dtype=bfloat16` halves the deferred bytes), losses equal to the
//! in-process run, bad input, and that nothing is left
//! behind — after a success, a failing job, SIGTERM, and SIGKILL followed by the next start.
//!
//! Needs root (CI runs as root), `ip`/`tc` (iproute2) and Open MPI.
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod scratch;
use scratch::scratch;

/// One emulated cluster at a time: they share the machine's cores.
static JOBS: Mutex<()> = Mutex::new(());

const EXE: &str = env!("CARGO_BIN_EXE_ferrotext");

fn emulate(args: &[&str]) -> Command {
    let mut cmd = Command::new(EXE);
    cmd.arg("emulate").args(args);
    cmd
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every namespace, link and qdisc the emulate process `pid` would have created.
fn objects_of(pid: u32) -> Vec<String> {
    let ns = format!("ftxemu-{pid}-h");
    let links = [
        format!("fxb{pid}"),
        format!("fxv{pid}h"),
        format!("fxn{pid}h"),
    ];
    let mut found: Vec<String> = ip(&["netns", "list"])
        .lines()
        .filter(|l| l.starts_with(&ns))
        .map(str::to_string)
        .collect();
    for line in ip(&["-o", "link", "show"]).lines() {
        let name = line.split(':').nth(1).unwrap_or("").trim();
        let name = name.split('@').next().unwrap_or("");
        if links
            .iter()
            .any(|l| name == l || (l.ends_with('h') && name.starts_with(l.as_str())))
        {
            found.push(name.to_string());
        }
    }
    let qdiscs = Command::new("tc")
        .args(["qdisc", "show"])
        .output()
        .expect("tc runs");
    for line in String::from_utf8_lossy(&qdiscs.stdout).lines() {
        if links.iter().any(|l| line.contains(&format!("dev {l}"))) {
            found.push(line.to_string());
        }
    }
    let run_dir = std::env::temp_dir().join(format!("ferrotext-emulate-{pid}"));
    if run_dir.exists() {
        found.push(run_dir.display().to_string());
    }
    found
}

fn assert_nothing_left(pid: u32, what: &str) {
    let left = objects_of(pid);
    assert!(left.is_empty(), "{what}: left behind {left:?}");
}

/// Runs `cmd` to completion; returns its output and its PID.
fn run(mut cmd: Command) -> (Output, u32) {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ferrotext starts");
    let pid = child.id();
    (child.wait_with_output().expect("ferrotext ends"), pid)
}

/// The job used by the byte test: qwen3-tiny at a reduced size, GA 4, a few steps.
fn tiny(dir: &Path, run_name: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "train",
        "model_name=qwen3-tiny",
        "base_emb_dim=64",
        "base_mlp_dim=384",
        "base_num_decoder_layers=4",
        "head_dim=16",
        "max_target_length=32",
        "gradient_accumulation_steps=4",
        "steps=4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(format!("base_output_directory={}", dir.display()));
    v.push(format!("run_name={run_name}"));
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// `loss` per step from a run's metrics file.
fn losses(dir: &Path, run: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(dir.join(run).join("metrics.jsonl")).expect("metrics");
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            v["loss"].as_f64().unwrap_or(f64::NAN)
        })
        .collect()
}

/// Runs the tiny job on 2 emulated hosts × 1 device; returns the JSON report.
fn emulated(dir: &Path, run_name: &str, extra: &[&str]) -> serde_json::Value {
    let json = dir.join(format!("{run_name}.json"));
    let mut args: Vec<String> = [
        "--hosts",
        "2",
        "--devices-per-host",
        "1",
        "--link",
        "10gbit",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(json.display().to_string());
    args.push("--".into());
    args.extend(tiny(dir, run_name, extra));
    let (out, pid) = run(emulate(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("wire tx/step"), "{stdout}");
    assert_nothing_left(pid, "after a successful run");
    serde_json::from_str(&std::fs::read_to_string(&json).expect("report")).expect("json")
}

fn within(a: f64, b: f64, tolerance: f64) -> bool {
    (a - b).abs() <= tolerance * b.abs()
}

#[test]
fn deferred_sends_a_quarter_of_per_micro_batch_bytes_on_the_links() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("emu-bytes");
    let deferred = emulated(&dir, "deferred", &[]);
    let per_mb = emulated(&dir, "per_mb", &["shard_mode=auto"]);
    let local = Command::new(EXE)
        .args(tiny(&dir, "local_deferred", &["local_devices=2"]))
        .output()
        .expect("ferrotext runs");
    assert!(local.status.success(), "{:?}", text(&local));
    let local_auto = Command::new(EXE)
        .args(tiny(
            &dir,
            "local_auto",
            &["local_devices=2", "shard_mode=auto"],
        ))
        .output()
        .expect("ferrotext runs");
    assert!(local_auto.status.success(), "{:?}", text(&local_auto));

    let report = |r: &serde_json::Value| -> (f64, f64, Vec<(f64, f64)>) {
        let predicted = r["prediction"]["bytes_per_host_per_step"]
            .as_f64()
            .expect("a prediction");
        let deferred = r["prediction"]["deferred"].as_bool().unwrap_or(false);
        let hosts: Vec<(f64, f64)> = r["run"]["hosts"]
            .as_array()
            .expect("hosts")
            .iter()
            .map(|h| {
                assert_eq!(h["steps_measured"].as_u64(), Some(3), "{h}");
                (
                    h["wire_tx_bytes_per_step"].as_f64().unwrap_or(0.0),
                    h["mpi_bytes_per_step"].as_f64().unwrap_or(0.0),
                )
            })
            .collect();
        (predicted, f64::from(u8::from(deferred)), hosts)
    };
    let (d_pred, d_open, d_hosts) = report(&deferred);
    let (p_pred, p_open, p_hosts) = report(&per_mb);
    assert_eq!((d_open, p_open), (1.0, 0.0), "the gate: open, then closed");
    assert_eq!(d_hosts.len(), 2);
    for (d, p) in d_hosts.iter().zip(&p_hosts) {
        // Each within 10% of the trace's prediction, on the wire and in MPI's own count.
        assert!(within(d.0, d_pred, 0.10), "deferred wire {d:?} vs {d_pred}");
        assert!(within(p.0, p_pred, 0.10), "per-mb wire {p:?} vs {p_pred}");
        assert!(within(d.1, d_pred, 0.02), "deferred MPI {d:?} vs {d_pred}");
        assert!(within(p.1, p_pred, 0.02), "per-mb MPI {p:?} vs {p_pred}");
        // Deferral: a quarter of the bytes at GA 4.
        assert!(
            within(d.0 / p.0, 0.25, 0.10),
            "deferred / per-micro-batch = {} ({d:?} vs {p:?})",
            d.0 / p.0
        );
    }
    // The same losses as the in-process run of the same config on 2 local devices.
    for (run, local) in [("deferred", "local_deferred"), ("per_mb", "local_auto")] {
        let (a, b) = (losses(&dir, run), losses(&dir, local));
        assert_eq!(a.len(), 4, "{run}");
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6, "{run}: {a:?} vs {local}: {b:?}");
        }
    }
}

/// Per host, `(wire tx bytes, MPI bytes)` per step, and the trace's prediction per host.
fn per_step(r: &serde_json::Value) -> (f64, Vec<(f64, f64)>) {
    let predicted = r["prediction"]["bytes_per_host_per_step"]
        .as_f64()
        .expect("a prediction");
    let hosts = r["run"]["hosts"]
        .as_array()
        .expect("hosts")
        .iter()
        .map(|h| {
            (
                h["wire_tx_bytes_per_step"].as_f64().unwrap_or(0.0),
                h["mpi_bytes_per_step"].as_f64().unwrap_or(0.0),
            )
        })
        .collect();
    (predicted, hosts)
}

/// `grad_dtype=bfloat16` halves the deferred reduction's bytes between hosts: the bf16 run's
/// bytes on each link are half the float32 run's, within 5% (what does not halve: the loss
/// scalars of 4 micro-batches, the norm's few f32 elements, the pipeline's 40-byte part headers
/// and TCP's acknowledgements of them, about 1% of the f32 step here), and near the trace's own
/// prediction, which counts the reduction at 2 bytes an element. The mirror: with the gate
/// closed the gradients are reduced in every micro-batch, in f32 whatever `grad_dtype` says, so
/// the per-micro-batch traffic is unchanged.
#[test]
fn bf16_gradients_halve_the_deferred_bytes_on_the_links() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("emu-bf16-grads");
    let (f_pred, f) = per_step(&emulated(&dir, "f32", &[]));
    let (b_pred, b) = per_step(&emulated(&dir, "bf16", &["grad_dtype=bfloat16"]));
    let (pf_pred, pf) = per_step(&emulated(&dir, "per_mb_f32", &["shard_mode=auto"]));
    let (pb_pred, pb) = per_step(&emulated(
        &dir,
        "per_mb_bf16",
        &["shard_mode=auto", "grad_dtype=bfloat16"],
    ));
    assert!(within(b_pred / f_pred, 0.5, 0.02), "{b_pred} vs {f_pred}");
    assert_eq!(pb_pred, pf_pred, "per-micro-batch prediction");
    assert_eq!((f.len(), b.len(), pf.len(), pb.len()), (2, 2, 2, 2));
    for (((f, b), pf), pb) in f.iter().zip(&b).zip(&pf).zip(&pb) {
        assert!(
            within(b.0 / f.0, 0.5, 0.05),
            "wire: bf16 {b:?} vs f32 {f:?}"
        );
        assert!(within(b.1 / f.1, 0.5, 0.02), "MPI: bf16 {b:?} vs f32 {f:?}");
        assert!(within(b.0, b_pred, 0.10), "bf16 wire {b:?} vs {b_pred}");
        assert!(
            within(pb.0, pf.0, 0.03),
            "per-micro-batch wire {pb:?} vs {pf:?}"
        );
        assert!(
            within(pb.1, pf.1, 0.001),
            "per-micro-batch MPI {pb:?} vs {pf:?}"
        );
    }
}

fn one_error_line(out: &Output) -> String {
    let (_, stderr) = text(out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0].to_string()
}

#[test]
fn bad_input_is_one_error_line_and_leaves_nothing() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let cases: &[(&[&str], &str)] = &[
        (
            &["--hosts", "0", "--", "train"],
            "--hosts must be at least 1",
        ),
        (
            &["--hosts", "2", "--link", "1gigabit", "--", "train"],
            "--link",
        ),
        (
            &["--hosts", "2", "--link", "1gbit,5parsecs", "--", "train"],
            "delay",
        ),
        (
            &[
                "--hosts",
                "2",
                "--devices-per-host",
                "1",
                "--",
                "train",
                "ici_data_parallelism=3",
            ],
            "must form the job's mesh",
        ),
        (
            &["--hosts", "2", "--", "train", "local_devices=4"],
            "local_devices=4",
        ),
        // The job is read as ferrotext reads a command line before any network is made.
        (
            &["--hosts", "2", "--", "nonsense"],
            "the job after `--`: unrecognized subcommand 'nonsense'",
        ),
        (
            &[
                "--hosts", "2", "--", "emulate", "--hosts", "2", "--", "train",
            ],
            "cannot be `emulate` itself",
        ),
        (
            &[
                "--hosts",
                "2",
                "--json",
                "/proc/ferrotext-emulate/x.json",
                "--",
                "train",
            ],
            "--json: /proc/ferrotext-emulate/x.json cannot be written",
        ),
    ];
    for (args, expect) in cases {
        let (out, pid) = run(emulate(args));
        let line = one_error_line(&out);
        assert!(line.contains(expect), "{args:?}: {line}");
        assert_nothing_left(pid, &format!("{args:?}"));
    }
    // A missing tool is named.
    let mut cmd = emulate(&["--hosts", "2", "--", "train"]);
    cmd.env("PATH", "/nonexistent-ferrotext-path");
    let (out, pid) = run(cmd);
    let line = one_error_line(&out);
    assert!(
        line.contains("needs `ip`") && line.contains("iproute2"),
        "{line}"
    );
    assert_nothing_left(pid, "missing tool");
}

/// PIDs of the children of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let out = Command::new("pgrep")
        .args(["-P", &pid.to_string()])
        .output()
        .expect("pgrep runs");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn running(pid: u32) -> bool {
    // A zombie (exited, not yet reaped by its new parent) counts as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// `emulate` of a training job on 2 hosts at 1 Gbit/s that runs until it is stopped, its
/// outputs under `dir` (not started).
fn long_job(dir: &Path) -> Command {
    let out = format!("base_output_directory={}", dir.display());
    emulate(&[
        "--hosts",
        "2",
        "--link",
        "1gbit",
        "--",
        "train",
        "model_name=qwen3-tiny",
        "steps=100000",
        "resume=fresh",
        &out,
    ])
}

/// Starts a long job and waits until its processes run inside the namespaces; returns the
/// emulate child and the PIDs inside its namespaces.
// The child is returned to the caller, which waits for it (clippy cannot follow it there).
#[allow(clippy::zombie_processes)]
fn start_long_job(dir: &Path) -> (Child, Vec<u32>) {
    let mut child = long_job(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("emulate starts");
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let inside: Vec<u32> = (0..2)
            .flat_map(|h| {
                ip(&["netns", "pids", &format!("ftxemu-{pid}-h{h}")])
                    .split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
        // orted and the ferrotext process in each namespace.
        if inside.len() >= 4 {
            std::thread::sleep(Duration::from_secs(1));
            return (child, inside);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the job did not start");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn wait_gone(pids: &[u32], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while pids.iter().any(|&p| running(p)) {
        assert!(
            Instant::now() < deadline,
            "{what}: processes still running: {:?}",
            pids.iter().filter(|&&p| running(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn nothing_is_left_after_failure_signals_and_a_killed_run() {
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("emu-cleanup");

    // A job that fails after launch (a device diverges: collective mismatch).
    let (out, pid) = run(emulate(&[
        "--hosts",
        "2",
        "--",
        "collectives",
        "--mesh",
        "data=2",
        "--diverge-device",
        "1",
        "--timeout-seconds",
        "20",
    ]));
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the job failed"), "{stderr}");
    assert_nothing_left(pid, "after a failing job");

    // SIGTERM in the middle of training: the handler stops the job and removes the network.
    let (child, inside) = start_long_job(&dir);
    let pid = child.id();
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success());
    let out = child.wait_with_output().expect("emulate ends");
    assert!(!out.status.success());
    wait_gone(&inside, "after SIGTERM");
    assert_nothing_left(pid, "after SIGTERM");

    // SIGKILL: nothing can run then; the next start removes what is left.
    let (mut child, inside) = start_long_job(&dir);
    let pid = child.id();
    let mpirun = children(pid);
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    assert!(
        !objects_of(pid).is_empty(),
        "a killed run leaves its network"
    );
    let (out, next) = run(emulate(&[
        "--hosts",
        "2",
        "--",
        "collectives",
        "--mesh",
        "data=2",
    ]));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("removed what killed emulate runs left")
            && stderr.contains(&format!("ftxemu-{pid}-h0")),
        "{stderr}"
    );
    assert_nothing_left(pid, "the killed run, after the next start");
    assert_nothing_left(next, "the next run");
    wait_gone(&inside, "the killed run's processes");
    wait_gone(&mpirun, "the killed run's mpirun");
}

/// Ctrl-C pressed again and again at a terminal (SIGINT to the launcher's whole process group,
/// every 10 ms, through set-up, training and teardown) still ends with nothing left: the
/// set-up and teardown helpers run in groups of their own, so the signal never kills one
/// halfway (before, a namespace or the bridge was left in 3 of 5 tries), and ignore it, so one
/// caught by it before it leaves the launcher's group lives on (before, a namespace, a link or
/// the bridge was left in 3 of 30 tries; the deterministic check is
/// `a_helper_outlives_the_signals_that_stop_a_run`). Six starting points, to meet set-up,
/// the job and teardown more than once.
#[test]
fn repeated_interrupts_to_the_process_group_leave_nothing() {
    use std::os::unix::process::CommandExt;
    let _job = JOBS.lock().unwrap_or_else(|p| p.into_inner());
    let dir = scratch("emu-interrupts");
    for delay_ms in [100u64, 200, 400, 700, 1000, 1500] {
        let mut child = long_job(&dir)
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("emulate starts");
        let pid = child.id();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().expect("wait").is_none() {
            assert!(Instant::now() < deadline, "emulate did not end");
            let _ = Command::new("kill")
                .args(["-INT", "--", &format!("-{pid}")])
                .stderr(Stdio::null())
                .status();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_nothing_left(pid, &format!("after interrupts from {delay_ms} ms"));
    }
}
