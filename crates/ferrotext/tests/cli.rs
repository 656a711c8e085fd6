//! The binary end to end.

use std::process::Command;

mod common;
use common::ferrotext;

#[test]
fn collectives_demo_checks_its_results_and_prints_the_trace() {
    let out = ferrotext(&[
        "collectives",
        "--mesh",
        "data=2,tensor=2",
        "--elements",
        "4096",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("equal the serial reference (bitwise)"),
        "{stdout}"
    );
    assert!(stdout.contains("update/zero1   reduce_scatter"), "{stdout}");
    assert!(stdout.contains("micro_batch 3  all_reduce"), "{stdout}");
}

#[test]
fn a_bad_mesh_is_a_usage_error_with_exit_code_2() {
    for mesh in ["data=x", "data", "data=2,data=2", "data=0"] {
        let out = ferrotext(&["collectives", "--mesh", mesh]);
        assert_eq!(out.status.code(), Some(2), "--mesh {mesh}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "one clear line: {stderr}");
    }
}

#[test]
fn collectives_bench_writes_json() {
    let dir = std::env::temp_dir().join(format!("ferrotext-bench-{}", std::process::id()));
    let out_path = dir.join("collectives.json");
    let out = ferrotext(&[
        "bench",
        "collectives",
        "--devices",
        "2",
        "--min-bytes",
        "4096",
        "--max-bytes",
        "16384",
        "--out",
        out_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["bytes"], 16384);
    assert!(rows[0]["algbw_gb_s"].as_f64().unwrap() > 0.0);
    // The machine the figures came from: this process's kernel is the child's (same binary
    // choice, same environment), the cores and processor as this process sees them.
    let machine = &json["machine"];
    assert_eq!(
        machine["matmul"],
        ferrotext_tensor::matmul_kernel().as_str()
    );
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    assert_eq!(machine["cores"], cores);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|rest| rest.split_once(':'))
        .map(|(_, name)| name.trim());
    assert_eq!(machine["processor"].as_str(), model);
    std::fs::remove_dir_all(dir).ok();
}

/// Stand-in peers for `bench peers`: `train.py` scripts (run by `/bin/sh`) that log their
/// arguments (after the script's name) to `PEERS/calls.txt` and print `jax_line` /
/// `torch_line` as their figure.
fn fake_peers(dir: &std::path::Path, jax_line: &str, torch_line: &str) -> std::path::PathBuf {
    let peers = dir.join("peers");
    for (name, line) in [("jax", jax_line), ("torch", torch_line)] {
        std::fs::create_dir_all(peers.join(name)).unwrap();
        let script = format!("echo \"{name} $*\" >> ../calls.txt\necho '{line}'\n");
        std::fs::write(peers.join(name).join("train.py"), script).unwrap();
    }
    peers
}

/// `bench peers` runs each engine once per round, in ABBA order, gives each the point's devices,
/// GA and clipping, and pairs each round's figures: the peers here are stand-in scripts with
/// fixed figures, ferrotext a real (tiny) run.
#[test]
fn peers_bench_alternates_the_engines_and_pairs_each_rounds_figures() {
    let dir = std::env::temp_dir().join(format!("ferrotext-peers-{}", std::process::id()));
    let peers = fake_peers(
        &dir,
        "defer: median step 50.0 ms over 1 steps | 1 tokens/s",
        r#"{"peer": "torch", "mode": "no_sync", "median_ms": 80.0}"#,
    );
    let (runs, out_path) = (dir.join("runs"), dir.join("peers.json"));
    let out = ferrotext(&[
        "bench",
        "peers",
        "--peers",
        peers.to_str().unwrap(),
        "--jax-python",
        "/bin/sh",
        "--torch-python",
        "/bin/sh",
        "--points",
        "2x1",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--set",
        "base_num_decoder_layers=1",
        "--set",
        "base_emb_dim=32",
        "--set",
        "head_dim=8",
        "--set",
        "base_mlp_dim=32",
        "--set",
        "vocab_size=64",
        "--set",
        "max_target_length=16",
        "--runs",
        runs.to_str().unwrap(),
        "--out",
        out_path.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let calls = std::fs::read_to_string(peers.join("calls.txt")).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 4, "{calls:?}");
    // Round 1: ferrotext, JAX, PyTorch; round 2: PyTorch, JAX, ferrotext.
    assert!(
        calls[0].starts_with("jax --dp 2 --defer --ga 1 --opt sgd"),
        "{calls:?}"
    );
    assert!(
        calls[1].starts_with("torch --nproc 2 --mode no_sync --ga 1"),
        "{calls:?}"
    );
    assert!(
        calls[2].starts_with("torch ") && calls[3].starts_with("jax "),
        "{calls:?}"
    );
    assert!(
        calls
            .iter()
            .all(|c| c.ends_with("--warmup 1 --steps 1 --clip 1")),
        "{calls:?}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    let order: Vec<&str> = json["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["engine"].as_str().unwrap())
        .collect();
    assert_eq!(
        order,
        ["ferrotext", "jax", "torch", "torch", "jax", "ferrotext"]
    );
    let row = &json["rows"][0];
    assert_eq!(row["jax_ms"], serde_json::json!([50.0, 50.0]));
    assert_eq!(row["torch_ms"], serde_json::json!([80.0, 80.0]));
    for round in 0..2 {
        let ft = row["ferrotext_ms"][round].as_f64().unwrap();
        assert!(ft > 0.0);
        let ratio = |key: &str| row[key][round].as_f64().unwrap();
        assert!((ratio("ferrotext_over_jax") - ft / 50.0).abs() < 1e-12 * ft);
        assert!((ratio("ferrotext_over_torch") - ft / 80.0).abs() < 1e-12 * ft);
    }
    // ferrotext's own run wrote its metrics where the benchmark read them.
    assert!(runs.join("data2-ga1-round1/metrics.jsonl").is_file());
    std::fs::remove_dir_all(dir).ok();
}

/// A peer that prints no figure, or a Python that is not there, fails `bench peers` with one
/// error naming the engine; nothing runs for a missing Python.
#[test]
fn peers_bench_names_the_peer_it_cannot_read_or_start() {
    let dir = std::env::temp_dir().join(format!("ferrotext-peers-bad-{}", std::process::id()));
    let peers = fake_peers(&dir, "no figure here", "Traceback: boom");
    let peers = peers.to_str().unwrap();
    let out_path = dir.join("peers.json");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench", "peers", "--peers", peers, "--points", "4x1", "--rounds", "1",
        ];
        args.extend_from_slice(&["--out", out_path.to_str().unwrap()]);
        args.extend_from_slice(extra);
        ferrotext(&args)
    };
    let out = bench(&["--engines", "torch", "--torch-python", "/bin/sh"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("PyTorch at data=4 GA 1"), "{stderr}");
    assert!(
        stderr.contains("Traceback: boom"),
        "the peer's own words: {stderr}"
    );
    let out = bench(&["--engines", "jax", "--jax-python", "/bin/sh"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("JAX at data=4 GA 1"),
        "{stderr}"
    );
    let calls = || std::fs::read_to_string(dir.join("peers/calls.txt")).unwrap();
    assert_eq!(calls().lines().count(), 2, "one call of each peer so far");
    let missing = dir.join("no-python");
    let out = bench(&[
        "--engines",
        "torch,jax",
        "--torch-python",
        "/bin/sh",
        "--jax-python",
        missing.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no-python"),
        "{stderr}"
    );
    assert_eq!(calls().lines().count(), 2, "nothing ran: {}", calls());
    assert!(!out_path.exists(), "no report from a failed benchmark");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn conformance_command_passes_the_public_cases_and_reports_failures() {
    let public = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../spmd/tests/data/conformance-public.jsonl"
    );
    let out = ferrotext(&["conformance", public]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.trim_end().ends_with("723 passed, 0 failed"),
        "{stdout}"
    );

    // A case whose expectation is wrong is reported and fails the run.
    let dir = std::env::temp_dir().join(format!("ferrotext-conf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        r#"{"id":"wrong-1","rule":"R3.8","mesh":[["x",2,"explicit"]],"op":"neg","args":[{"shape":[4],"dtype":"f32","spec":{"p":[null],"u":["x"],"r":[]}}],"params":{},"expect":{"type":"f32[4]"}}"#,
    )
    .unwrap();
    let out = ferrotext(&["conformance", bad.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout.contains("FAIL wrong-1: forward: want f32[4], got f32[4]{U:x}"),
        "{stdout}"
    );
    assert!(stdout.contains("0 passed, 1 failed"), "{stdout}");
    std::fs::remove_dir_all(dir).ok();
}

/// Every bad-input path of `ferrotext train`: exit code 2, one `error:` line, nothing written.
#[test]
fn train_rejects_bad_input_with_exit_code_2_and_writes_nothing() {
    let dir = std::env::temp_dir().join(format!("ferrotext-bad-{}", std::process::id()));
    let out = format!("base_output_directory={}", dir.display());
    let cases: &[(&[&str], &str)] = &[
        (&["no_such_key=1"], "unknown key `no_such_key`"),
        (&["step=10"], "unknown key `step`; did you mean `steps`?"),
        (&["steps=many"], "invalid type"),
        (&["steps=many"], "(`steps` takes integer)"),
        (
            &["learning_rate=-1"],
            "learning_rate must be a finite number in (0, ∞)",
        ),
        (&["shard_mode=manual"], "unknown variant `manual`"),
        (
            &["ici_data_parallelism=3"],
            "does not match local_devices = 4",
        ),
        (
            &["ici_data_parallelism=-1", "ici_fsdp_parallelism=-1"],
            "at most one",
        ),
        (
            &["per_device_batch_size=0.5"],
            "not divisible by data×fsdp×expert = 4",
        ),
        (&["model_name=gpt5"], "is not a preset"),
        (&["dataset_type=text"], "needs dataset_path"),
        (
            &["dataset_path=/tmp/some.txt"],
            "dataset_type is corpus, which reads none",
        ),
        (
            &["dataset_type=text", "dataset_path=/no/such/file.txt"],
            "cannot open /no/such/file.txt",
        ),
        (
            &["load_parameters_path=/no/such/params.safetensors"],
            "cannot read",
        ),
        (&["notakeyvalue"], "is not `key=value`"),
        // NaN passes every `< 0` check: each float key is checked for being inside its range.
        (&["adam_eps=nan"], "adam_eps must be a finite number"),
        (
            &["adam_weight_decay=inf"],
            "adam_weight_decay must be a finite number",
        ),
        (
            &["z_loss_multiplier=nan"],
            "z_loss_multiplier must be a finite number",
        ),
        (
            &["gradient_clipping_threshold=nan"],
            "gradient_clipping_threshold must be a finite number",
        ),
        (
            &["num_experts=4", "routed_scaling_factor=nan"],
            "routed_scaling_factor must be a finite number",
        ),
        (
            &["learning_rate=nan"],
            "learning_rate must be a finite number",
        ),
        (
            &["collective_timeout_seconds=nan"],
            "collective_timeout_seconds must be",
        ),
        (
            &["collective_timeout_seconds=inf"],
            "collective_timeout_seconds must be",
        ),
        (
            &["collective_timeout_seconds=1e30"],
            "collective_timeout_seconds must be",
        ),
        // Sizes that cannot fit are refused before anything is allocated or multiplied.
        (
            &["local_devices=5000"],
            "local_devices = 5000 is larger than",
        ),
        (
            &["per_device_batch_size=1e15"],
            "per_device_batch_size must be",
        ),
        (
            &["vocab_size=1000000000000"],
            "vocab_size = 1000000000000 is larger than",
        ),
        (
            &["base_num_decoder_layers=100000000"],
            "base_num_decoder_layers = 100000000 is larger than",
        ),
        (
            &[
                "ici_data_parallelism=4611686018427387905",
                "ici_fsdp_parallelism=4",
            ],
            "larger than the largest supported mesh",
        ),
        (
            &["ici_data_parallelism=65536", "ici_fsdp_parallelism=65536"],
            "is larger than the 4 devices",
        ),
        (
            &["max_target_length=200000", "per_device_batch_size=64"],
            "this run needs about",
        ),
        (&["steps=abc"], "steps = \"abc\": invalid type"),
        // Inputs that are not regular files would block or read without bound.
        (&["load_parameters_path=/dev/zero"], "is not a regular file"),
        (&["tokenizer_path=/dev/zero"], "is not a regular file"),
        (
            &["dataset_type=text", "dataset_path=/dev/zero"],
            "is not a regular file",
        ),
        // Outputs that cannot be written are found before training.
        (&["metrics_file=/proc/ferrotext.jsonl"], "refuses new files"),
        (&["save_parameters_path=/proc"], "save_parameters_path"),
        (&["run_name=../outside"], "run_name must name one directory"),
        // A multi-process job started as one process would run every process's devices.
        (&["num_processes=2"], "not started by a launcher"),
        // The long-sequence keys.
        (
            &["remat_policy=most"],
            "remat_policy = \"most\": unknown variant `most`",
        ),
        (
            &["num_vocab_tiling=0"],
            "num_vocab_tiling must be at least 1",
        ),
        (
            &["packing=true"],
            "packing=true needs data whose documents are delimited",
        ),
        (
            &[
                "ici_data_parallelism=1",
                "ici_context_parallelism=4",
                "max_target_length=100",
            ],
            "ici_context_parallelism = 4 needs max_target_length = 100 to split into 8",
        ),
        (
            &[
                "model_name=qwen3-0.6b",
                "local_devices=1",
                "ici_data_parallelism=1",
                "per_device_batch_size=1",
                "max_target_length=4096",
                "dtype=bfloat16",
            ],
            "remat_policy=full num_vocab_tiling=4 would need",
        ),
    ];
    for (args, needle) in cases {
        let mut all = vec!["train", &out];
        all.extend_from_slice(args);
        let res = ferrotext(&all);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(!dir.exists(), "{args:?} wrote {}", dir.display());
    }
}

#[test]
fn train_runs_and_writes_metrics_and_parameters() {
    let dir = std::env::temp_dir().join(format!("ferrotext-train-{}", std::process::id()));
    let params = dir.join("final.safetensors");
    let res = ferrotext(&[
        "train",
        &format!("base_output_directory={}", dir.display()),
        "run_name=smoke",
        "steps=2",
        "base_emb_dim=32",
        "base_mlp_dim=64",
        "head_dim=8",
        "max_target_length=16",
        &format!("save_parameters_path={}", params.display()),
    ]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(stdout.contains("deferral         on"), "{stdout}");
    // `bench moe` reads this line from child runs.
    let rss: f64 = stdout
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("peak RSS")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no peak RSS line: {stdout}"));
    assert!(rss > 1.0, "{rss}");
    let metrics = std::fs::read_to_string(dir.join("smoke/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2);
    let first: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    assert!(first["loss"].as_f64().unwrap() > 5.0);
    // Each step reports the process's CPU time: the step did work in user space, and the
    // summary states the kernel's share.
    assert!(first["cpu"]["user"].as_f64().unwrap() > 0.0, "{first}");
    assert!(first["cpu"]["system"].as_f64().unwrap() >= 0.0, "{first}");
    assert!(stdout.contains("% in the kernel)"), "{stdout}");
    assert!(params.exists());
    // The saved parameters load back as the starting point of another run.
    let res = ferrotext(&[
        "train",
        &format!("base_output_directory={}", dir.display()),
        "run_name=again",
        "steps=1",
        "base_emb_dim=32",
        "base_mlp_dim=64",
        "head_dim=8",
        "max_target_length=16",
        &format!("load_parameters_path={}", params.display()),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let again = std::fs::read_to_string(dir.join("again/metrics.jsonl")).unwrap();
    let loaded: serde_json::Value = serde_json::from_str(again.lines().next().unwrap()).unwrap();
    assert!(
        loaded["loss"].as_f64().unwrap() < first["loss"].as_f64().unwrap(),
        "training continued from the saved weights"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// qwen3-0.6b (the real dims) type-checks and plans on a 256-device mesh in abstract mode.
#[test]
fn plan_qwen3_0_6b_on_256_devices() {
    let res = ferrotext(&[
        "plan",
        "model_name=qwen3-0.6b",
        "local_devices=256",
        "per_device_batch_size=1",
        "max_target_length=256",
    ]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(stdout.contains("(596049920 parameters)"), "{stdout}");
    let update: usize = stdout
        .split("all-reduces larger than 8 elements in micro-batches: 0; in update: ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    // 310 gradients in 25 MiB buckets: at most ⌈gradient bytes / bucket⌉ + 1 collectives.
    let bound = (596_049_920usize * 4).div_ceil(25 << 20) + 1;
    assert!(
        update > 1 && update <= bound,
        "{update} > {bound}: {stdout}"
    );
    // One bucket per gradient: one all-reduce per parameter.
    let res = ferrotext(&[
        "plan",
        "model_name=qwen3-0.6b",
        "local_devices=256",
        "per_device_batch_size=1",
        "max_target_length=256",
        "grad_bucket_mb=1e-9",
    ]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        stdout.contains("all-reduces larger than 8 elements in micro-batches: 0; in update: 310"),
        "{stdout}"
    );
}

/// `kill -9` of a real training process while it checkpoints every step, then the same command
/// again: it resumes from the last complete checkpoint and finishes.
#[test]
fn kill_9_mid_run_then_a_clean_resume() {
    let dir = std::env::temp_dir().join(format!("ferrotext-kill-{}", std::process::id()));
    let args = [
        "train".to_string(),
        format!("base_output_directory={}", dir.display()),
        "run_name=killed".into(),
        "steps=30".into(),
        "enable_checkpointing=true".into(),
        "checkpoint_period=1".into(),
        "base_emb_dim=64".into(),
        "base_mlp_dim=128".into(),
        "head_dim=16".into(),
        "max_target_length=32".into(),
    ];
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let latest = dir.join("killed/checkpoints/latest");
    let start = std::time::Instant::now();
    while !latest.exists() && start.elapsed() < std::time::Duration::from_secs(120) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(latest.exists(), "no checkpoint within two minutes");
    // Somewhere in the next steps — possibly in the middle of writing a checkpoint.
    std::thread::sleep(std::time::Duration::from_millis(70));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let res = ferrotext(&args);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let stdout = String::from_utf8_lossy(&res.stdout);
    let resumed_at: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("resumed at step "))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no resume line: {stdout}"));
    assert!(
        resumed_at >= 1,
        "resumed from a checkpoint, not from scratch"
    );
    // The killed run's steps before the checkpoint stay; the ones it logged after the checkpoint
    // were repeated by the resume and appear once: every step exactly once, in order.
    let metrics = std::fs::read_to_string(dir.join("killed/metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, (0..30).collect::<Vec<u64>>());
    // Run again: nothing left to do, said so, nothing printed as a summary.
    let again = ferrotext(&args);
    let stdout = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success());
    assert!(stdout.contains("nothing to do"), "{stdout}");
    assert!(!stdout.contains("median step"), "{stdout}");
    std::fs::remove_dir_all(dir).ok();
}

/// A run that diverges stops with an error naming the step (exit 1), keeping the metrics of the
/// steps it finished.
#[test]
fn a_diverging_run_stops_naming_the_step() {
    let dir = std::env::temp_dir().join(format!("ferrotext-diverge-{}", std::process::id()));
    let res = ferrotext(&[
        "train",
        &format!("base_output_directory={}", dir.display()),
        "steps=4",
        "opt_type=sgd",
        "learning_rate=1e30",
        "max_target_length=16",
    ]);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(1), "{stderr}");
    assert!(stderr.starts_with("error: step 1: the loss"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let metrics = std::fs::read_to_string(dir.join("default/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1, "step 0 was logged as it ended");
    std::fs::remove_dir_all(dir).ok();
}

/// The four classes of failure reach the user with their own exit code (issue 13): the user's
/// input exits 2 with the whole message on one line; engine misuse, an I/O failure and a device
/// panic exit 1, each named — a bug in ferrotext is never reported as the user's mistake.
#[test]
fn a_usage_error_exits_2_with_the_whole_message() {
    let dir = std::env::temp_dir().join(format!("ferrotext-usage-{}", std::process::id()));
    let res = ferrotext(&[
        "train",
        &format!("base_output_directory={}", dir.display()),
        "moe_mlp_dim=64",
    ]);
    assert_eq!(res.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&res.stderr),
        "error: MoE keys need an MoE model: set num_experts or pick an MoE preset (model_name \
         `qwen3-tiny` is dense)\n"
    );
    assert!(!dir.exists(), "bad input wrote {}", dir.display());
}

/// A run with a fault injected through `FERROTEXT_FAULT` (see `train_cmd/fault.rs`; the hook
/// exists in builds with the `fault-injection` feature, which the README's test command turns
/// on; `fault_classes.rs` checks that a build without it has none).
#[cfg(feature = "fault-injection")]
fn faulty_train(fault: &str, dir: &std::path::Path) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .args([
            "train",
            &format!("base_output_directory={}", dir.display()),
            "steps=2",
            "max_target_length=16",
            "collective_timeout_seconds=30",
        ])
        .env("FERROTEXT_FAULT", fault)
        .output()
        .expect("the ferrotext binary runs");
    std::fs::remove_dir_all(dir).ok();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[cfg(feature = "fault-injection")]
#[test]
fn engine_misuse_exits_1_naming_the_call() {
    let dir = std::env::temp_dir().join(format!("ferrotext-misuse-{}", std::process::id()));
    let (code, stderr) = faulty_train("engine_misuse", &dir);
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(
        stderr,
        "error: Engine::update: update called with no fwd_bwd since the last update\n"
    );
}

#[cfg(feature = "fault-injection")]
#[test]
fn a_device_panic_exits_1_naming_the_device_and_the_message() {
    let dir = std::env::temp_dir().join(format!("ferrotext-panic-{}", std::process::id()));
    let (code, stderr) = faulty_train("device_panic:1", &dir);
    assert_eq!(code, Some(1), "{stderr}");
    // The panic hook prints its own lines first; ferrotext's report is the last line.
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: device 1 failed (a bug in ferrotext")
            && last.contains("injected fault: device 1 panics before its first step"),
        "{stderr}"
    );
}

/// A write the file system refuses mid-run (the file-size limit, `ulimit -f`, with SIGXFSZ
/// ignored so the write fails instead of killing the process) is an I/O failure: exit 1, the
/// file named — not bad input, since every output path was checked before the run.
#[test]
fn an_io_failure_mid_run_exits_1_naming_the_file() {
    let dir = std::env::temp_dir().join(format!("ferrotext-io-{}", std::process::id()));
    let params = dir.join("final.safetensors");
    let out = Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 4; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_ferrotext"))
        .args([
            "train",
            &format!("base_output_directory={}", dir.display()),
            "steps=2",
            "max_target_length=16",
            &format!("save_parameters_path={}", params.display()),
        ])
        .output()
        .expect("sh runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: ")
            && stderr.contains(&params.display().to_string())
            && stderr.contains("large"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    std::fs::remove_dir_all(dir).ok();
}

/// The summary's "deferral saved" counts what each micro-batch would have all-reduced (f32)
/// less the step's one deferred reduction in `grad_dtype`: at GA 2, 4 bytes an element saved
/// in f32 and 6 in bf16 (its reduction moves 2 bytes, not 4).
#[test]
fn deferral_saved_counts_the_deferred_reduction_in_grad_dtype() {
    let dir = std::env::temp_dir().join(format!("ferrotext-saved-{}", std::process::id()));
    let saved = |grad_dtype: &str| -> (usize, f64) {
        let res = ferrotext(&[
            "train",
            &format!("base_output_directory={}", dir.display()),
            &format!("run_name={grad_dtype}"),
            "steps=1",
            "gradient_accumulation_steps=2",
            "base_emb_dim=32",
            "base_mlp_dim=64",
            "head_dim=8",
            "max_target_length=16",
            "dtype=bfloat16",
            "matmul_bf16_fallback=true",
            &format!("grad_dtype={grad_dtype}"),
        ]);
        let stdout = String::from_utf8_lossy(&res.stdout).into_owned();
        assert!(res.status.success(), "{stdout}");
        let field = |prefix: &str| -> String {
            stdout
                .lines()
                .find_map(|l| l.trim().strip_prefix(prefix).map(str::to_owned))
                .unwrap_or_else(|| panic!("no {prefix} line: {stdout}"))
        };
        let params: usize = field("parameters").trim().parse().unwrap();
        let line = field("all-reduce bytes");
        let text = line.rsplit("deferral saved ").next().unwrap();
        let (value, unit) = text.trim().split_once(' ').unwrap();
        let scale = match unit {
            "B" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            other => panic!("unit {other}"),
        };
        (params, value.parse::<f64>().unwrap() * scale)
    };
    let (params, f32_saved) = saved("float32");
    let (_, bf16_saved) = saved("bfloat16");
    // human_bytes keeps one decimal: 0.1 of the unit at most.
    let close = |got: f64, want: f64| (got - want).abs() <= 0.06 * want;
    assert!(
        close(f32_saved, 4.0 * params as f64),
        "{f32_saved} vs 4 × {params}"
    );
    assert!(
        close(bf16_saved, 6.0 * params as f64),
        "{bf16_saved} vs 6 × {params}"
    );
    std::fs::remove_dir_all(dir).ok();
}

/// A command line the parser refuses is one `error:` line and exit code 2, its tips and the
/// missing arguments folded in; the mirror: `--help` still prints the whole help, exit 0.
#[test]
fn argument_errors_are_one_line_with_exit_code_2() {
    for (args, needle) in [
        (&["nosuchcmd"][..], "unrecognized subcommand 'nosuchcmd'"),
        (&["export"], "not provided: <CHECKPOINT> <OUT>"),
        (
            &["generate", "--prompt", "a", "--max-new-tokens", "abc"],
            "invalid value 'abc' for '--max-new-tokens",
        ),
        (&["plot", "r", "--no-such-flag"], "--no-such-flag"),
    ] {
        let res = ferrotext(args);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let help = ferrotext(&["export", "--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).lines().count() > 5);
}

/// `plan` prints the memory estimate and whether a step keeps its weights' packings: never
/// with one micro-batch; in f32 with two exactly where this process's f32 products keep them
/// (the binary runs on the same processor and environment as this test). The estimate with
/// them is the larger one.
#[test]
fn plan_prints_the_memory_estimate_and_whether_packings_are_kept() {
    let line = |ga: &str| {
        let out = ferrotext(&["plan", "dtype=float32", ga]);
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{stdout}");
        let line = stdout
            .lines()
            .find(|l| l.starts_with("memory per process, estimated: "))
            .unwrap_or_else(|| panic!("no memory line in {stdout}"))
            .to_string();
        let gib: f64 = line["memory per process, estimated: ".len()..]
            .split(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no figure in {line}"));
        (line, gib)
    };
    let (one, one_gib) = line("gradient_accumulation_steps=1");
    assert!(one.ends_with("kept for the step: no"), "{one}");
    let (two, two_gib) = line("gradient_accumulation_steps=2");
    let keeps = ferrotext_tensor::f32_products_keep_packings();
    let want = if keeps { "yes" } else { "no" };
    assert!(
        two.ends_with(&format!("kept for the step: {want}")),
        "{two}"
    );
    assert!(two_gib >= one_gib, "{two} against {one}");
}
