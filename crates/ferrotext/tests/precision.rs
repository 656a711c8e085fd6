//! The precision keys through the binary (issue 30, "Bad input"): an unknown dtype name,
//! `weight_dtype` narrower than `dtype`, `grad_dtype=bfloat16` with `layout_invariant=true`, and
//! bf16 on a kernel without a bf16 product are one `error:` line, exit 2, and nothing written;
//! the mirrors run, and the
//! header names the dtypes and the bf16 kernel.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ferrotext-prec-cli-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("scratch");
    dir
}

/// `ferrotext train` of a tiny model for one step, outputs under `dir`, plus `extra`; with
/// `FERROTEXT_MATMUL=gemm` when `gemm`.
fn train(dir: &Path, extra: &[&str], gemm: bool) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotext"));
    cmd.arg("train")
        .arg(format!("base_output_directory={}", dir.display()))
        .args([
            "steps=1",
            "base_emb_dim=32",
            "base_mlp_dim=64",
            "max_target_length=16",
            "per_device_batch_size=1",
            "gradient_accumulation_steps=1",
        ])
        .args(extra);
    if gemm {
        cmd.env("FERROTEXT_MATMUL", "gemm");
    }
    cmd.output().expect("the ferrotext binary runs")
}

fn is_empty(dir: &Path) -> bool {
    std::fs::read_dir(dir).expect("dir").next().is_none()
}

#[test]
fn refused_precisions_are_one_error_line_exit_2_and_nothing_written() {
    for (extra, gemm, message) in [
        (
            &["dtype=half"][..],
            false,
            "error: dtype = \"half\": unknown dtype `half`",
        ),
        (
            &["dtype=float16"],
            false,
            "error: dtype must be bfloat16 or float32, got `float16`",
        ),
        (
            &["weight_dtype=bfloat16"],
            false,
            "error: weight_dtype=bfloat16 is narrower than dtype=float32",
        ),
        (
            &["grad_dtype=bfloat16", "layout_invariant=true"],
            false,
            "error: grad_dtype=bfloat16 with layout_invariant=true cannot hold its promise",
        ),
        (
            &["dtype=bfloat16"],
            true,
            "error: dtype=bfloat16 needs a bf16 × bf16 → f32 matrix product and the gemm crate \
             (FERROTEXT_MATMUL) has none",
        ),
    ] {
        let dir = scratch("refused");
        let out = train(&dir, extra, gemm);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.starts_with(message), "{extra:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(is_empty(&dir), "{extra:?}: something was written");
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn a_bf16_run_names_its_dtypes_and_kernel_and_the_fallback_runs_on_gemm() {
    let dir = scratch("accepted");
    let out = train(&dir, &["dtype=bfloat16", "matmul_bf16_fallback=true"], true);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "precision: dtype bfloat16 (activations, matmul inputs), weight_dtype float32 \
             (master weights, optimizer state), grad_dtype float32 (accumulator, reduction)"
        ),
        "{stdout}"
    );
    let kernel = stdout
        .lines()
        .find(|l| l.starts_with("bf16 matmul: "))
        .expect("a bf16 kernel line");
    assert!(kernel.contains("gemm crate"), "{kernel}");
    // The mirror: a float32 run names no bf16 kernel.
    let out = train(&dir, &["run_name=f32"], false);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("precision: dtype float32"), "{stdout}");
    assert!(!stdout.contains("bf16 matmul:"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `ferrotext generate --dtype`: a checkpoint trained in float32 generates in bf16 (the stderr
/// line names the dtype and the kernel), spelled either way; an unknown name is one error line,
/// exit 2.
#[test]
fn generate_takes_a_dtype_and_refuses_an_unknown_name() {
    let dir = scratch("generate");
    let out = train(&dir, &["enable_checkpointing=true"], false);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = dir.join("default");
    let generate = |dtype: &str| {
        Command::new(env!("CARGO_BIN_EXE_ferrotext"))
            .args([
                "generate",
                "--prompt",
                "ab",
                "--max-new-tokens",
                "3",
                "--dtype",
                dtype,
            ])
            .arg("--checkpoint")
            .arg(&run)
            .output()
            .expect("the ferrotext binary runs")
    };
    let bf16 = generate("bfloat16");
    let stderr = String::from_utf8_lossy(&bf16.stderr);
    assert!(bf16.status.success(), "{stderr}");
    assert!(stderr.contains("; dtype bfloat16 on "), "{stderr}");
    let f32 = generate("float32");
    let stderr = String::from_utf8_lossy(&f32.stderr);
    assert!(stderr.trim_end().ends_with("; dtype float32"), "{stderr}");
    // The short name is the same dtype: the same tokens.
    let short = generate("bf16");
    assert!(short.status.success());
    assert_eq!(short.stdout, bf16.stdout);
    let bad = generate("half");
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        "error: --dtype must be bfloat16 or float32 (or bf16, f32), got `half`"
    );
    assert!(bad.stdout.is_empty(), "nothing generated");
    std::fs::remove_dir_all(&dir).ok();
}
