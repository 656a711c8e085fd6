//! `ferrotext bench kernels`: GFLOP/s of a transformer layer's matmuls through
//! `ferrotext_tensor::dot_general` (on this process's kernel: OpenBLAS when the machine has it,
//! see `ferrotext_tensor::matmul_kernel`), next to the `gemm` crate called directly on the same
//! strided layout (its own figure), so the ratio shows what the kernel and wrapper gain or cost.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use ferrotext_tensor::{dot_general, DotDims, Tensor};
use gemm::Parallelism;
use serde::Serialize;

use super::write_json;
use crate::common::stats::median;

#[derive(Serialize)]
struct Row {
    d_model: usize,
    matmul: String,
    product: &'static str,
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
    ours_gflops: f64,
    gemm_gflops: f64,
    ratio: f64,
}

/// One product: `[m,k]·[k,n]` where each operand may be stored transposed.
struct Product {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    lhs_transposed: bool,
    rhs_transposed: bool,
}

fn time_it(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn measure(p: &Product, threads: usize) -> Result<(f64, f64)> {
    let lhs_shape = if p.lhs_transposed {
        [p.k, p.m]
    } else {
        [p.m, p.k]
    };
    let rhs_shape = if p.rhs_transposed {
        [p.n, p.k]
    } else {
        [p.k, p.n]
    };
    let lhs = Tensor::from_fn(&lhs_shape, |i| (i % 13) as f32 * 0.01);
    let rhs = Tensor::from_fn(&rhs_shape, |i| (i % 7) as f32 * 0.01);
    let dims = DotDims {
        lhs_contracting: vec![usize::from(!p.lhs_transposed)],
        rhs_contracting: vec![usize::from(p.rhs_transposed)],
        ..Default::default()
    };
    let flops = 2.0 * (p.m * p.n * p.k) as f64;
    let reps = ((2e9 / flops) as usize).clamp(3, 50);
    let ours = time_it(reps, || {
        std::hint::black_box(dot_general(&lhs, &rhs, &dims, threads).ok());
    });
    // The same product straight through gemm: strides of the stored layouts.
    let (lhs_rs, lhs_cs) = if p.lhs_transposed {
        (1, p.m as isize)
    } else {
        (p.k as isize, 1)
    };
    let (rhs_rs, rhs_cs) = if p.rhs_transposed {
        (1, p.k as isize)
    } else {
        (p.n as isize, 1)
    };
    let mut dst = vec![0.0f32; p.m * p.n];
    let parallelism = if threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    let direct = time_it(reps, || {
        // SAFETY: the strides describe `lhs` ([m,k] or its transpose), `rhs` ([k,n] or its
        // transpose) and `dst` ([m,n] row-major) exactly; all three live for the call.
        unsafe {
            gemm::gemm(
                p.m,
                p.n,
                p.k,
                dst.as_mut_ptr(),
                1,
                p.n as isize,
                false,
                lhs.data().as_ptr(),
                lhs_cs,
                lhs_rs,
                rhs.data().as_ptr(),
                rhs_cs,
                rhs_rs,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
        std::hint::black_box(&mut dst);
    });
    Ok((flops / ours / 1e9, flops / direct / 1e9))
}

/// Runs the kernel benchmark and writes JSON to `out`.
pub fn run(d_models: &[usize], tokens: usize, threads: &[usize], out: &Path) -> Result<()> {
    let mut rows = Vec::new();
    println!("ours: {}", ferrotext_tensor::matmul_kernel());
    println!(
        "{:>6}  {:<10} {:<14} {:>5} {:>5} {:>5} {:>3}  {:>9} {:>9} {:>6}",
        "d", "matmul", "product", "m", "n", "k", "thr", "ours GF/s", "gemm GF/s", "ratio"
    );
    for &d in d_models {
        // (name, in, out) of a layer's weights: fused qkv, attention output, MLP up, MLP down.
        for (name, din, dout) in [
            ("qkv", d, 3 * d),
            ("attn_out", d, d),
            ("mlp_up", d, 4 * d),
            ("mlp_down", 4 * d, d),
        ] {
            let products = [
                // forward y = x·W
                Product {
                    name: "forward x·W",
                    m: tokens,
                    n: dout,
                    k: din,
                    lhs_transposed: false,
                    rhs_transposed: false,
                },
                // dx = dy·Wᵀ (W read transposed)
                Product {
                    name: "dx = dy·Wᵀ",
                    m: tokens,
                    n: din,
                    k: dout,
                    lhs_transposed: false,
                    rhs_transposed: true,
                },
                // dW = xᵀ·dy (x read transposed)
                Product {
                    name: "dW = xᵀ·dy",
                    m: din,
                    n: dout,
                    k: tokens,
                    lhs_transposed: true,
                    rhs_transposed: false,
                },
            ];
            for p in &products {
                for &t in threads {
                    let (ours, direct) = measure(p, t)?;
                    println!(
                        "{d:>6}  {name:<10} {:<14} {:>5} {:>5} {:>5} {t:>3}  {ours:>9.1} {direct:>9.1} {:>6.2}",
                        p.name, p.m, p.n, p.k, ours / direct
                    );
                    rows.push(Row {
                        d_model: d,
                        matmul: name.to_string(),
                        product: p.name,
                        m: p.m,
                        n: p.n,
                        k: p.k,
                        threads: t,
                        ours_gflops: ours,
                        gemm_gflops: direct,
                        ratio: ours / direct,
                    });
                }
            }
        }
    }
    write_json(
        out,
        &serde_json::json!({ "benchmark": "kernels", "rows": rows }),
    )?;
    println!("wrote {}", out.display());
    Ok(())
}
