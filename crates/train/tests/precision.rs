//! The precision keys (issue 30 items 1 and 4): MaxText's names and meanings for `dtype`,
//! `weight_dtype` and `grad_dtype`; each refusal a typed usage error naming the key and value,
//! each with an accepted mirror; the plan's decoder computes in `dtype`; bf16 on a kernel without
//! a bf16 product is refused unless the fallback is asked for; a bf16 Hugging Face export is the
//! round-to-nearest-even of the f32 master weights. (bf16 runs and their resumes:
//! `precision_runs.rs`.)

use std::path::{Path, PathBuf};

use ferrotext_sharding::DType;
use ferrotext_train::{train, PrecisionProblem, RunOptions, TrainConfig, TrainError};

mod common;
use common::small_config;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-prec-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

fn load(items: &[&str]) -> Result<TrainConfig, TrainError> {
    TrainConfig::load(
        None,
        &items.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    )
}

/// A name that is no dtype is refused while the config is read, naming the key and the value; a
/// dtype that is one but not built for the key (`float16`, `int32`) is refused naming both and
/// the key's choices. Both are one-line usage errors.
#[test]
fn an_unknown_or_unbuilt_dtype_is_refused_naming_key_and_value() {
    for (key, value) in [
        ("dtype", "half"),
        ("weight_dtype", "fp32"),
        ("grad_dtype", "BF16"),
    ] {
        let item = format!("{key}={value}");
        let err = load(&[&item]).unwrap_err();
        assert!(err.is_usage(), "{item}: {err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("{key} = \"{value}\": unknown dtype `{value}`")),
            "{text}"
        );
        assert_eq!(text.lines().count(), 1, "{text}");
    }
    for (key, value) in [
        ("dtype", "float16"),
        ("grad_dtype", "f16"),
        ("dtype", "int32"),
    ] {
        let item = format!("{key}={value}");
        match load(&[&item]) {
            Err(e @ TrainError::NotAChoice { .. }) => {
                assert!(e.is_usage());
                let long = DType::parse(value).unwrap().name();
                assert_eq!(
                    e.to_string(),
                    format!("{key} must be bfloat16 or float32, got `{long}`")
                );
            }
            other => panic!("{item}: not NotAChoice: {other:?}"),
        }
    }
}

/// Either spelling of a dtype is the same value: MaxText's (`bfloat16`) and the short one
/// (`bf16`), for every precision key.
#[test]
fn both_spellings_of_a_dtype_are_one_value() {
    let long = load(&[
        "dtype=bfloat16",
        "weight_dtype=float32",
        "grad_dtype=bfloat16",
        "save_parameters_dtype=bfloat16",
    ])
    .unwrap();
    let short = load(&[
        "dtype=bf16",
        "weight_dtype=f32",
        "grad_dtype=bf16",
        "save_parameters_dtype=bf16",
    ])
    .unwrap();
    assert_eq!(long, short);
    assert_eq!(long.precision().unwrap().dtype, DType::BF16);
    assert_eq!(long.save_parameters_dtype, DType::BF16);
    assert_eq!(load(&[]).unwrap().precision().unwrap().dtype, DType::F32);
    // The mirror: another value is another config.
    assert_ne!(load(&["dtype=f32"]).unwrap(), short);
}

#[test]
fn weight_dtype_narrower_than_dtype_or_not_float32_is_refused_naming_both() {
    let err = load(&["weight_dtype=bfloat16"]).unwrap_err();
    assert!(err.is_usage());
    assert!(matches!(
        &err,
        TrainError::Precision {
            key: "weight_dtype",
            value,
            problem: PrecisionProblem::NarrowerThanDtype { dtype: "float32" },
        } if value == "bfloat16"
    ));
    assert_eq!(
        err.to_string(),
        "weight_dtype=bfloat16 is narrower than dtype=float32: the master weights must hold at \
         least the compute precision; set weight_dtype=float32"
    );
    // Not narrower, but bf16 master weights are not built.
    let err = load(&["dtype=bfloat16", "weight_dtype=bfloat16"]).unwrap_err();
    assert!(matches!(
        &err,
        TrainError::Precision {
            key: "weight_dtype",
            problem: PrecisionProblem::MasterWeightsAreFloat32,
            ..
        }
    ));
    assert!(err
        .to_string()
        .contains("master weights and the optimizer state are float32"));
    // The mirror: f32 master weights under bf16 compute.
    load(&["dtype=bfloat16", "weight_dtype=float32"]).unwrap();
}

#[test]
fn grad_dtype_bfloat16_is_refused_with_layout_invariant_and_taken_without() {
    let err = load(&["grad_dtype=bfloat16", "layout_invariant=true"]).unwrap_err();
    assert!(err.is_usage());
    assert!(matches!(
        &err,
        TrainError::Precision {
            key: "grad_dtype",
            problem: PrecisionProblem::NotLayoutInvariant,
            ..
        }
    ));
    assert_eq!(err.to_string().lines().count(), 1);
    assert!(
        err.to_string()
            .starts_with("grad_dtype=bfloat16 with layout_invariant=true"),
        "{err}"
    );
    // The mirrors: either key alone is taken.
    assert_eq!(
        load(&["grad_dtype=bfloat16"]).unwrap().grad_dtype,
        DType::BF16
    );
    assert!(load(&[
        "grad_dtype=float32",
        "layout_invariant=true",
        "deterministic=true"
    ])
    .is_ok());
}

#[test]
fn the_plans_decoder_computes_in_dtype() {
    let bf16 = load(&["dtype=bfloat16"]).unwrap().plan().unwrap();
    assert_eq!(bf16.decoder().compute_dtype(), DType::BF16);
    assert_eq!(bf16.precision().dtype, DType::BF16);
    let f32 = load(&[]).unwrap().plan().unwrap();
    assert_eq!(f32.decoder().compute_dtype(), DType::F32);
    // bf16 activations halve the layers' share of the estimate; parameters are unchanged.
    let (a, b) = (
        bf16.memory_per_device().unwrap(),
        f32.memory_per_device().unwrap(),
    );
    assert_eq!(a.parameter_bytes, b.parameter_bytes);
    assert!(a.activation_bytes < b.activation_bytes);
}

#[test]
fn the_keys_table_lists_the_precision_keys_with_their_defaults() {
    let table = ferrotext_train::keys::table();
    let line = |name: &str| {
        table
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing:\n{table}"))
            .to_string()
    };
    assert!(line("dtype").contains("default float32"));
    assert!(line("weight_dtype").contains("default float32"));
    assert!(line("grad_dtype").contains("default float32"));
    assert!(line("matmul_bf16_fallback").contains("default false"));
}

/// The bf16 kernel is chosen once per process, so each case runs in a child process of this
/// test binary with `FERROTEXT_MATMUL=gemm` (a kernel without a bf16 product).
const CHILD: &str = "FERROTEXT_PRECISION_CHILD";

/// In a child: the case `CHILD` names; in the parent: nothing.
#[test]
fn kernel_child() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    let mut items = vec!["dtype=bfloat16"];
    if case == "fallback" {
        items.push("matmul_bf16_fallback=true");
    }
    let config = load(&items).unwrap();
    match config.select_bf16_kernel() {
        Ok(kernel) => println!("KERNEL-OK {}", kernel.unwrap_or_default()),
        Err(e) => println!("KERNEL-ERR usage={} {e}", e.is_usage()),
    }
}

fn child(case: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "kernel_child", "--nocapture", "--test-threads=1"])
        .env(CHILD, case)
        .env("FERROTEXT_MATMUL", "gemm")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    // The harness prints `test kernel_child ... ` before the child's own line.
    stdout
        .lines()
        .find_map(|l| l.find("KERNEL-").map(|at| l[at..].to_string()))
        .unwrap_or_else(|| panic!("no result line: {stdout}"))
}

#[test]
fn bf16_on_a_kernel_without_a_bf16_product_is_refused_unless_the_fallback_is_asked_for() {
    let refused = child("refuse");
    assert_eq!(
        refused,
        "KERNEL-ERR usage=true dtype=bfloat16 needs a bf16 × bf16 → f32 matrix product and the \
         gemm crate (FERROTEXT_MATMUL) has none: set matmul_bf16_fallback=true to run bf16 \
         products on ferrotext's own kernel, or FERROTEXT_MATMUL=mkl or portable, or \
         dtype=float32"
    );
    let allowed = child("fallback");
    assert!(allowed.starts_with("KERNEL-OK "), "{allowed}");
    // It says which kernel runs in place of gemm.
    assert!(allowed.contains("gemm crate"), "{allowed}");
}

fn run_config(base: &Path, run: &str, extra: &[&str]) -> TrainConfig {
    let dir = format!("base_output_directory={}", base.display());
    let run = format!("run_name={run}");
    let mut all = vec![
        dir.as_str(),
        run.as_str(),
        "gradient_accumulation_steps=2",
        "steps=4",
        "learning_rate=0.01",
    ];
    all.extend_from_slice(extra);
    small_config(&all)
}

/// An independent round-to-nearest-even of f32 to bf16 bits (ties to the even mantissa; no NaN
/// in trained weights).
fn rne_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    ((bits + 0x7fff + lsb) >> 16) as u16
}

#[test]
fn the_rounding_reference_rounds_ties_to_even() {
    // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: to 1 (even); 1 + 3·2⁻⁸ is halfway between
    // 1 + 2⁻⁷ (odd) and 1 + 2⁻⁶: up; just above a half rounds up.
    assert_eq!(rne_bits(1.0 + 2f32.powi(-8)), 0x3f80);
    assert_eq!(rne_bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    assert_eq!(rne_bits(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), 0x3f81);
    assert_eq!(rne_bits(-2.0), 0xc000);
}

/// `ferrotext export --dtype bf16` of a trained checkpoint: every tensor is bf16 and each value
/// is the round-to-nearest-even of the checkpoint's f32 master weight; read back, the values are
/// those rounded weights; the f32 export is the weights exactly.
#[test]
fn a_bf16_export_is_the_round_to_nearest_even_of_the_f32_weights_and_reads_back() {
    let base = scratch("export");
    let cfg = run_config(&base, "run", &["enable_checkpointing=true", "steps=2"]);
    train(&cfg, &RunOptions::default()).unwrap();
    let root = base.join("run/checkpoints");
    let (_, master) = ferrotext_train::checkpoint::read_parameters(&root).unwrap();
    let plan = cfg.plan().unwrap();
    for dtype in [DType::BF16, DType::F32] {
        let out = base.join(format!("hf-{dtype:?}"));
        ferrotext_train::export::export_checkpoint(&root, None, &out, dtype, 1 << 30).unwrap();
        let back = ferrotext_train::io::load_parameters(&out, plan.params()).unwrap();
        let mut rounded_somewhere = false;
        for (m, b) in master.iter().zip(&back) {
            for (&x, &y) in m.data().iter().zip(b.data()) {
                let want = match dtype {
                    DType::BF16 => f32::from_bits(u32::from(rne_bits(x)) << 16),
                    _ => x,
                };
                assert_eq!(
                    y.to_bits(),
                    want.to_bits(),
                    "{dtype:?}: {x} read back as {y}"
                );
                rounded_somewhere |= y != x;
            }
        }
        assert_eq!(rounded_somewhere, dtype == DType::BF16, "{dtype:?}");
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let want = match dtype {
            DType::BF16 => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F32,
        };
        assert!(st.tensors().iter().all(|(_, v)| v.dtype() == want));
    }
    // A dtype an export does not write is refused before anything is written.
    let out = base.join("hf-f16");
    let err = ferrotext_train::export::export_checkpoint(&root, None, &out, DType::F16, 1 << 30)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("tensors are saved as float32 or bfloat16, not float16"),
        "{err}"
    );
    assert!(!out.exists());
    std::fs::remove_dir_all(&base).ok();
}

/// A bf16 step of several micro-batches keeps its weights' packings (the casts are remembered
/// and reused), and the memory estimate counts them — two more of the bf16 copies' size —
/// where this process's bf16 kernel packs; a single micro-batch and rematerialized layers (whose
/// copies are let go) keep none, and their estimates add nothing. An f32 step of several
/// micro-batches keeps its weights' own packings where this process's f32 products take them
/// (`f32_products_keep_packings`), and its estimate adds two of the weights' size; elsewhere
/// it keeps none and adds nothing.
#[test]
fn a_step_of_several_micro_batches_keeps_packings_and_the_estimate_counts_them() {
    // Fix the process's bf16 kernel first, as a bf16 run does before it plans memory.
    let _ = load(&["dtype=bfloat16"]).unwrap().select_bf16_kernel();
    let plan = |keys: &[&str]| load(keys).unwrap().plan().unwrap();
    let ga = |n: usize| format!("gradient_accumulation_steps={n}");
    let (ga1, ga2) = (ga(1), ga(2));
    let several = plan(&["dtype=bfloat16", &ga2]);
    let one = plan(&["dtype=bfloat16", &ga1]);
    let remat = plan(&["dtype=bfloat16", &ga2, "remat_policy=full"]);
    let remat_one = plan(&["dtype=bfloat16", &ga1, "remat_policy=full"]);
    let f32 = plan(&[&ga2]);
    let f32_one = plan(&[&ga1]);
    assert!(several.keeps_weight_packings());
    for other in [&one, &remat, &f32_one] {
        assert!(!other.keeps_weight_packings());
    }
    let f32_packs = ferrotext_tensor::f32_products_keep_packings();
    assert_eq!(f32.keeps_weight_packings(), f32_packs);
    let activations =
        |p: &ferrotext_train::RunPlan| p.memory_per_device().unwrap().activation_bytes;
    let copies = several
        .memory_per_device()
        .unwrap()
        .local_parameter_elements
        * 2.0;
    let extra = activations(&several) - activations(&one);
    let packs = ferrotext_tensor::bf16_products_keep_packings();
    if !packs {
        // The plans' keys and the unchanged estimates are still checked.
        ferrotext_tensor::report_skipped(
            "train precision::a_step_of_several_…: the bf16 packings' bytes in the estimate",
            "this process's bf16 kernel packs no operand (not ferrotext's AVX512_BF16 kernel)",
        );
    }
    let want = if packs { 2.0 * copies } else { 0.0 };
    assert!(
        (extra - want).abs() <= 1e-9 * want.max(1.0),
        "packings {extra} bytes, want {want} (the kernel packs: {packs})"
    );
    assert_eq!(activations(&remat), activations(&remat_one));
    // Keeping them is decided by whether they fit: a machine with room for the estimate
    // without them (the one-micro-batch plan's) but not with them gets none (the products'
    // bits do not depend on it).
    for (plan, without, counted) in [(&several, &one, packs), (&f32, &f32_one, f32_packs)] {
        let with = plan.memory_estimate().unwrap().total();
        let without = without.memory_estimate().unwrap().total();
        assert!(plan.weight_packings_fit_in(with));
        assert_eq!(
            plan.weight_packings_fit_in(without),
            !counted,
            "{with} vs {without}"
        );
    }
    let weights = f32.memory_per_device().unwrap().local_parameter_elements * 4.0;
    let want = if f32_packs { 2.0 * weights } else { 0.0 };
    let extra = activations(&f32) - activations(&f32_one);
    assert!(
        (extra - want).abs() <= 1e-9 * want.max(1.0),
        "f32 packings {extra} bytes, want {want} (the f32 products keep them: {f32_packs})"
    );
}
