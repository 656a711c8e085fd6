//! What an `f32` product of ferrotext's own could reach where a weight is packed once a step:
//! an AVX-512 register tile (8 rows × 32 columns, `vfmadd231ps`, the bf16 kernel's shape) over a
//! `b` packed beforehand into 32-column panels, `a` read where it is stored, against this
//! process's `f32` product (`dot_general` on one thread: the BLAS the binary opens, or
//! `FERROTEXT_MATMUL`'s), which packs its operands on every call. Both on the forward `x·W` of a
//! layer's weights, alternated pair by pair; the tile's result is checked against the kernel's
//! (within 1e-4 of the largest element). Issue 46's data=4 question: a device's 128-row products
//! pay the weight's packing each call.
//!
//! The tile is a measurement, not a kernel: no edge tiles (the shapes are multiples of 8 and
//! 32), a contraction cut into blocks of 256 added through a scratch tile. Writes
//! `target/bench/f32_tile.json`.
//!
//! Run it with the allocator as the `ferrotext` binary sets it (the kernel's product allocates
//! its result each call; on glibc's defaults a large one faults its pages in again every time):
//!
//! ```text
//! GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615:glibc.malloc.hugetlb=1 \
//!   cargo run --release -p ferrotext-tensor --example f32_tile -- [tokens=128,512] [pairs=5]
//! ```

use std::time::Instant;

use ferrotext_tensor::{dot_general, matmul_kernel, DotDims, Tensor};

/// Rows of `a` a tile covers.
const MR: usize = 8;
/// Columns of `b` a panel (and a tile) covers: two registers of 16 `f32`.
const NR: usize = 32;
/// The contraction's block (a tile's 8 rows of `a` over it: 8 KiB, in L1).
const KC: usize = 256;

/// `b` (k×n, row-major) as `n / NR` panels of `k × NR`, each row of a panel contiguous.
fn pack(b: &[f32], k: usize, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(k * n);
    for p in 0..n / NR {
        for l in 0..k {
            out.extend_from_slice(&b[l * n + p * NR..l * n + (p + 1) * NR]);
        }
    }
    out
}

/// One tile: `c[r, 0..32] (+)= Σ_l a[r, l] · panel[l, 0..32]` over `kc` terms.
///
/// # Safety
/// AVX-512F; `a` holds 8 rows `lda` apart of `kc` elements, `panel` `kc × 32`, `c` 8 rows `ldc`
/// apart of 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile(
    kc: usize,
    a: *const f32,
    lda: usize,
    panel: *const f32,
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for l in 0..kc {
        // SAFETY: the caller's contract.
        let (b0, b1) = unsafe {
            (
                _mm512_loadu_ps(panel.add(l * NR)),
                _mm512_loadu_ps(panel.add(l * NR + 16)),
            )
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row r, element l of the tile's rows.
            let x = _mm512_set1_ps(unsafe { *a.add(r * lda + l) });
            acc[0] = _mm512_fmadd_ps(x, b0, acc[0]);
            acc[1] = _mm512_fmadd_ps(x, b1, acc[1]);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row r of the caller's tile of `c`.
        unsafe {
            let row = c.add(r * ldc);
            let (lo, hi) = if add {
                (
                    _mm512_add_ps(_mm512_loadu_ps(row), acc[0]),
                    _mm512_add_ps(_mm512_loadu_ps(row.add(16)), acc[1]),
                )
            } else {
                (acc[0], acc[1])
            };
            _mm512_storeu_ps(row, lo);
            _mm512_storeu_ps(row.add(16), hi);
        }
    }
}

/// `c = a · b` (m×k by k×n, row-major) with `b` [`pack`]ed.
#[cfg(target_arch = "x86_64")]
fn product(m: usize, n: usize, k: usize, a: &[f32], packed: &[f32], c: &mut [f32]) {
    assert!(m.is_multiple_of(MR) && n.is_multiple_of(NR) && a.len() == m * k && c.len() == m * n);
    for l0 in (0..k).step_by(KC) {
        let kc = KC.min(k - l0);
        for i in (0..m).step_by(MR) {
            for p in 0..n / NR {
                // SAFETY: the CPU has AVX-512F (checked in `main`); rows i..i+8 and columns
                // l0..l0+kc of `a`, the panel's rows l0.., and the tile of `c` are inside.
                unsafe {
                    tile(
                        kc,
                        a.as_ptr().add(i * k + l0),
                        k,
                        packed.as_ptr().add(p * k * NR + l0 * NR),
                        c.as_mut_ptr().add(i * n + p * NR),
                        n,
                        l0 > 0,
                    )
                };
            }
        }
    }
}

/// A layer's weights `(name, fan-in, fan-out)`: qwen3-peer's and qwen3-0.6b's.
const WEIGHTS: [(&str, usize, usize); 8] = [
    ("peer qkv", 256, 512),
    ("peer attn_out", 256, 256),
    ("peer mlp_up", 256, 768),
    ("peer mlp_down", 768, 256),
    ("0.6b qkv", 1024, 4096),
    ("0.6b attn_out", 2048, 1024),
    ("0.6b mlp_up", 1024, 3072),
    ("0.6b mlp_down", 3072, 1024),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(target_arch = "x86_64")]
fn main() {
    if !std::arch::is_x86_feature_detected!("avx512f") {
        println!("this processor has no AVX-512F: nothing to measure");
        return;
    }
    let mut tokens = vec![128usize, 512];
    let mut pairs = 5usize;
    // A bad argument is one line and exit status 2.
    let usage = |what: &str| -> ! {
        eprintln!("error: {what}; the arguments are tokens=128,512 (multiples of 8) pairs=5 (≥ 1)");
        std::process::exit(2)
    };
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("tokens", v)) => {
                tokens = v
                    .split(',')
                    .map(|t| match t.parse::<usize>() {
                        Ok(m) if m > 0 && m.is_multiple_of(MR) => m,
                        _ => usage(&format!("tokens={t}")),
                    })
                    .collect()
            }
            Some(("pairs", v)) => match v.parse() {
                Ok(n) if n >= 1 => pairs = n,
                _ => usage(&format!("pairs={v}")),
            },
            _ => usage(&format!("unknown argument `{arg}`")),
        }
    }
    let kernel = matmul_kernel();
    println!("f32 x·W on one thread: {kernel} against the tile over a kept packing, GFLOP/s (median of {pairs} pairs)");
    let mut rows = Vec::new();
    for &m in &tokens {
        for (name, k, n) in WEIGHTS {
            let a = Tensor::from_fn(&[m, k], |i| ((i * 7 % 13) as f32 - 6.0) * 0.01);
            let b = Tensor::from_fn(&[k, n], |i| ((i * 5 % 11) as f32 - 5.0) * 0.01);
            let packed = pack(b.data(), k, n);
            let flops = 2.0 * (m * n * k) as f64;
            let reps = ((4e8 / flops) as usize).max(2);
            let mut c = vec![0f32; m * n];
            let (mut theirs, mut ours) = (Vec::new(), Vec::new());
            let mut want = None;
            for _ in 0..pairs {
                let t = Instant::now();
                for _ in 0..reps {
                    // ok: two matrices of matching shapes, made here.
                    want = Some(dot_general(&a, &b, &DotDims::matmul(2), 1).expect("product"));
                }
                theirs.push(flops * reps as f64 / t.elapsed().as_secs_f64() / 1e9);
                let t = Instant::now();
                for _ in 0..reps {
                    product(m, n, k, a.data(), &packed, &mut c);
                }
                ours.push(flops * reps as f64 / t.elapsed().as_secs_f64() / 1e9);
            }
            let want = want.expect("at least one pair"); // ok: pairs ≥ 1, checked above
            let scale = want.data().iter().fold(0f32, |s, x| s.max(x.abs()));
            let gap = want
                .data()
                .iter()
                .zip(&c)
                .fold(0f32, |s, (x, y)| s.max((x - y).abs()));
            assert!(gap <= 1e-4 * scale, "{name}: the tile is {gap} off");
            let (t, o) = (median(theirs), median(ours));
            println!(
                "{m:>5} {name:<14} {k:>5}×{n:<5} {t:7.1} {o:7.1}  {:.2}×",
                o / t
            );
            rows.push(format!(
                "{{\"tokens\":{m},\"weight\":\"{name}\",\"k\":{k},\"n\":{n},\"kernel_gflops\":{t:.2},\"tile_gflops\":{o:.2},\"ratio\":{:.3}}}",
                o / t
            ));
        }
    }
    let out = std::path::Path::new("target/bench");
    std::fs::create_dir_all(out).expect("target/bench");
    let json = format!(
        "{{\"kernel\":\"{kernel}\",\"pairs\":{pairs},\"rows\":[{}]}}\n",
        rows.join(",")
    );
    std::fs::write(out.join("f32_tile.json"), json).expect("write");
    println!("wrote target/bench/f32_tile.json");
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("x86-64 only");
}
