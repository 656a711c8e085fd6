//! `ferrotext plan --cluster`: the predicted step, its JSON, and bad input (exit code 2).

mod common;
use common::ferrotext;

#[test]
fn plan_cluster_prints_the_predicted_step() {
    let out = ferrotext(&[
        "plan",
        "ici_data_parallelism=4",
        "local_devices=2",
        "--cluster",
        "hosts=2,devices_per_host=2,link=1gbit,10us,intra=200gbit,1us",
        "--device-gflops",
        "50",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "on 2 hosts × 2 devices",
        "50.0 GFLOP/s (given by --device-gflops)",
        "per host, shared by its 2 devices",
        "ratio deferred / per-micro-batch",
        "peak memory per device",
        "update",
        "micro_batch 3",
    ] {
        assert!(stdout.contains(needle), "{needle}:\n{stdout}");
    }
}

#[test]
fn plan_cluster_json_is_the_prediction() {
    let out = ferrotext(&[
        "plan",
        "ici_data_parallelism=4",
        "gradient_accumulation_steps=4",
        "--cluster",
        "hosts=4,devices_per_host=1,link=1gbit,50us",
        "--device-gflops",
        "50",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let deferred = p["deferred_step_ms"].as_f64().expect("deferred_step_ms");
    let per_micro_batch = p["per_micro_batch_step_ms"]
        .as_f64()
        .expect("per-micro-batch");
    assert!(deferred > 0.0 && deferred < per_micro_batch, "{p}");
    assert_eq!(p["gradient_accumulation_steps"], 4);
    assert!(p["collectives"].as_array().is_some_and(|c| !c.is_empty()));
    assert!(p["memory"]["total_bytes"].as_f64().is_some_and(|b| b > 0.0));
}

#[test]
fn bad_cluster_input_is_one_error_line_and_exit_code_2() {
    for (args, says) in [
        (
            vec!["--cluster", "hosts=2,devices_per_host=2,nics=2"],
            "nics",
        ),
        (
            vec!["--cluster", "hosts=2,devices_per_host=2,link=fast"],
            "link",
        ),
        (
            vec!["--cluster", "hosts=2,devices_per_host=2,link=0gbit"],
            "link",
        ),
        (vec!["--cluster", "hosts=2,devices_per_host=2"], "link"),
        (vec!["--cluster", "hosts=0,devices_per_host=2"], "hosts"),
        (
            vec!["--cluster", "hosts=3,devices_per_host=2,link=1gbit"],
            "num_processes = 3",
        ),
        (
            vec![
                "--cluster",
                "hosts=1,devices_per_host=4",
                "--device-gflops",
                "-1",
            ],
            "--device-gflops",
        ),
        (
            vec!["local_devices=2", "--cluster", "hosts=1,devices_per_host=4"],
            "local_devices",
        ),
        (vec!["--json"], "--cluster"),
    ] {
        let mut all = vec!["plan", "ici_data_parallelism=4"];
        all.extend(&args);
        let out = ferrotext(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.contains(says),
            "{args:?} should name {says}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn plan_cluster_says_where_the_device_throughput_comes_from() {
    // Default (no --device-gflops) and `measured`: a timed micro-batch of the model; `gemm`: a
    // matmul; a number: given. Text and JSON both say which.
    let cluster = ["--cluster", "hosts=2,devices_per_host=2,link=1gbit,10us"];
    for (gflops, text, json) in [
        (None, "measured here from a micro-batch", "micro_batch"),
        (
            Some("measured"),
            "measured here from a micro-batch",
            "micro_batch",
        ),
        (Some("gemm"), "measured here with gemm", "gemm"),
        (Some("50"), "given by --device-gflops", "given"),
    ] {
        let mut args = vec!["plan", "ici_data_parallelism=4", "max_target_length=32"];
        args.extend(cluster);
        if let Some(g) = gflops {
            args.extend(["--device-gflops", g]);
        }
        let out = ferrotext(&args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{gflops:?}: {stdout}");
        assert!(
            stdout.contains(text),
            "{gflops:?} should say {text}:\n{stdout}"
        );
        args.push("--json");
        let out = ferrotext(&args);
        let p: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(p["device_gflops_source"], json, "{gflops:?}");
        assert!(p["device_gflops"].as_f64().is_some_and(|g| g > 0.0), "{p}");
    }
}
