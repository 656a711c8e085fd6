//! `deterministic=true`: the same run logs the same losses and grad norms to the bit whatever
//! code path the processor gives the matrix products, and a kernel that cannot honour the key
//! is refused.

use std::path::Path;
use std::process::Command;

/// `ferrotext train` on a short job with `env` set, writing under `dir/run`; returns the
/// `(loss, grad_norm)` of every step as logged (full precision), and the run header's
/// `matmul:` and `instruction set:` lines.
fn run(dir: &Path, run: &str, keys: &[&str], env: &[(&str, &str)]) -> (Vec<(f64, f64)>, String) {
    let base = format!("base_output_directory={}", dir.display());
    let name = format!("run_name={run}");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotext"));
    cmd.args(["train", &base, &name, "steps=3", "max_target_length=32"])
        .args(keys)
        .env_remove("FERROTEXT_MATMUL")
        .env_remove("FERROTEXT_PORTABLE_ISA");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the ferrotext binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{run}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let header: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("matmul:") || l.starts_with("instruction set:"))
        .collect();
    let header = header.join("\n");
    let metrics = std::fs::read_to_string(dir.join(run).join("metrics.jsonl")).unwrap();
    let steps = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["loss"].as_f64().unwrap(),
                v["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect();
    (steps, header)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// With the key, the products run on the portable kernel, and forcing it and the row kernels
/// onto the code paths other processors take (AVX2, or no vector unit at all) changes no bit of
/// any loss or grad norm; MKL's and OpenBLAS's own processor switches do not reach it either.
/// Each run's header names the instruction set that ran, so a forced set cannot pass by
/// running another.
#[test]
fn deterministic_runs_have_the_same_bits_on_every_code_path() {
    let dir = temp_dir("deterministic");
    let native = native_set();
    // (run, environment, the set its header must name)
    let paths: [CodePath; 4] = [
        ("native", &[], native),
        (
            "avx2",
            &[("FERROTEXT_PORTABLE_ISA", "avx2")],
            "AVX2 (forced by FERROTEXT_PORTABLE_ISA)",
        ),
        (
            "scalar",
            &[("FERROTEXT_PORTABLE_ISA", "scalar")],
            "scalar (forced by FERROTEXT_PORTABLE_ISA)",
        ),
        (
            "library-switches",
            &[
                ("MKL_ENABLE_INSTRUCTIONS", "AVX2"),
                ("OPENBLAS_CORETYPE", "Haswell"),
            ],
            native,
        ),
    ];
    let (want, header) = run(&dir, "native", &["deterministic=true"], paths[0].1);
    assert!(header.contains("portable kernel"), "{header}");
    assert!(
        header.ends_with(&format!("instruction set: {native}")),
        "{header}"
    );
    assert_eq!(want.len(), 3);
    for (name, env, set) in &paths[1..] {
        if *name == "avx2" && native == "scalar" {
            // This processor has no AVX2: the forced set is refused (`an_unknown_kernel_name_is_refused`
            // checks the refusal); its bits are not checked here.
            ferrotext_tensor::report_skipped(
                "ferrotext deterministic: the AVX2 path",
                "this processor has no AVX2",
            );
            continue;
        }
        let (got, header) = run(&dir, name, &["deterministic=true"], env);
        assert!(header.contains("portable kernel"), "{name}: {header}");
        assert!(
            header.ends_with(&format!("instruction set: {set}")),
            "{name}: the header names the set that ran ({set}): {header}"
        );
        assert_eq!(
            got, want,
            "{name}: the same losses and grad norms to the bit"
        );
    }
    std::fs::remove_dir_all(dir).ok();
}

/// A run: its name, its environment, the set its header must name.
type CodePath = (
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static str,
);

/// The widest instruction set this processor has, as a run header names it.
fn native_set() -> &'static str {
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma")
    {
        "AVX-512"
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        "AVX2"
    } else {
        "scalar"
    }
}

/// The mirror: without the key the products run on the machine's BLAS, and its code path for
/// another processor (two of OpenBLAS's kernels, [`two_openblas_kernels`]) changes the logged
/// numbers — the comparison above can see a difference when there is one. Needs OpenBLAS
/// (`.ci/run` installs it).
#[test]
fn without_the_key_another_processors_code_path_changes_the_bits() {
    let dir = temp_dir("nondeterministic");
    let openblas = |core: &'static str| {
        [
            ("FERROTEXT_MATMUL", "openblas"),
            ("OPENBLAS_CORETYPE", core),
        ]
    };
    let (wide, narrow) = two_openblas_kernels();
    let (first, header) = run(&dir, wide, &[], &openblas(wide));
    assert!(
        header.contains("OpenBLAS") && header.contains(wide),
        "this test needs OpenBLAS (libopenblas0-pthread; .ci/run installs it) running its \
         {wide} kernel: {header}"
    );
    let (second, header) = run(&dir, narrow, &[], &openblas(narrow));
    assert!(header.contains(narrow), "{narrow}: {header}");
    assert_ne!(
        first, second,
        "OpenBLAS's {wide} and {narrow} kernels gave the same bits"
    );
    // And the two runs agree as numbers: the difference is rounding.
    for ((a, _), (b, _)) in first.iter().zip(&second) {
        assert!((a - b).abs() < 1e-3 * a.abs(), "{a} vs {b}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Two OpenBLAS kernels this processor can run whose sums differ: SkylakeX's (AVX-512) and
/// Haswell's (AVX2 with FMA) where it has AVX-512, else Haswell's and Sandybridge's (AVX, its
/// multiplies and adds apart). Forcing a kernel the processor lacks ends the run on an illegal
/// instruction (SkylakeX on an AMD EPYC with AVX2 alone did).
fn two_openblas_kernels() -> (&'static str, &'static str) {
    if std::arch::is_x86_feature_detected!("avx512f") {
        ("SkylakeX", "Haswell")
    } else {
        ("Haswell", "Sandybridge")
    }
}

/// `deterministic=true` in a process whose products another kernel already computes
/// (`FERROTEXT_MATMUL` names it) is bad input: one line naming the key, exit 2, no run
/// directory.
#[test]
fn deterministic_with_another_kernel_is_refused() {
    let dir = temp_dir("deterministic-refused");
    let base = format!("base_output_directory={}", dir.display());
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotext"))
        .args(["train", &base, "steps=1", "deterministic=true"])
        .env("FERROTEXT_MATMUL", "gemm")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.starts_with("error: deterministic=true"), "{stderr}");
    assert!(stderr.contains("gemm"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(!dir.exists(), "nothing written");
}

/// A kernel variable naming nothing this build knows (a misspelling) is bad input, not the
/// default kernel in silence: one line naming the variable, exit 2, no run directory. The
/// mirror: the known names pass it (the tests above run with `openblas`, `gemm`, `avx2` and
/// `scalar` and get past it to their own checks).
#[test]
fn an_unknown_kernel_name_is_refused() {
    for (name, value) in [
        ("FERROTEXT_MATMUL", "openblass"),
        ("FERROTEXT_PORTABLE_ISA", "sse2"),
        ("FERROTEXT_F32_KEPT", "yes"),
    ] {
        let dir = temp_dir(&format!("unknown-{value}"));
        let base = format!("base_output_directory={}", dir.display());
        let out = Command::new(env!("CARGO_BIN_EXE_ferrotext"))
            .args(["train", &base, "steps=1"])
            .env(name, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.starts_with(&format!("error: {name}={value} names nothing")),
            "{stderr}"
        );
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(!dir.exists(), "nothing written");
    }
}
