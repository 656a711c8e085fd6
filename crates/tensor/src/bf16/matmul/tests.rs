//! bf16 products on every kernel this machine has against the f32 product of the widened
//! operands, and the choice of kernel.
//!
//! The bound: every widened term `a·b` of two bf16 values is exact in f32 (8 + 8 significant
//! bits ≤ 24), so a bf16 product and the f32 product of the widened operands add the same
//! exact terms and differ only by the order of addition. Each f32 sum of `k` terms lies within
//! `γ_k·Σ|a·b|` of the exact sum (`γ_k ≈ k·2^-24`), so each lies within that of the f64
//! reference here; the tests allow `2·k·2^-24·Σ|a·b|` (plus the destination under
//! accumulation). On the portable kernel the two are the same chain: equal bits. The
//! AVX512_BF16 kernel adds pairs of terms per instruction and flushes subnormals; on these
//! operands (no subnormal inputs or sums) it is held to the same bound, and to equal bits on
//! any thread count.

use half::bf16;

use super::super::choice::{bf16_matmul_kernel, cpu};
use super::*;
use crate::blas::tests::strided_product;
use crate::blas::{gemm_on, open_mkl, open_openblas};
use crate::operand::{Operand, Product};
use crate::{dot_general, dot_general_accumulate, matmul_order_is_fixed};

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 9;
            crate::round_bf16(h as f32 / 8_388_608.0 * 4.0 - 2.0).to_f32()
        })
        .collect()
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| crate::round_bf16(x)).collect()
}

/// Every kernel: `gemm`, the portable kernel, and each BLAS found (with its bf16 product, and
/// without it: then the portable kernel stands in).
fn kernels() -> Vec<Kernel> {
    let mut all = vec![Kernel::Gemm, Kernel::Portable(Isa::detect())];
    for blas in [open_mkl(), open_openblas()].into_iter().flatten() {
        all.push(Kernel::Blas(blas));
    }
    if let Some(mut blas) = open_mkl() {
        blas.bf16 = None;
        all.push(Kernel::Blas(blas));
    }
    all
}

/// `dst (+)= a·b` on `kernel` for operands of `T` with the given strides.
fn run<T: crate::blas::Element>(
    kernel: &Kernel,
    mnk: (usize, usize, usize),
    a: (&[T], (usize, usize)),
    b: (&[T], (usize, usize)),
    threads: usize,
    start: Option<&[f32]>,
) -> Vec<f32> {
    strided_product(mnk, a, b, (threads, start), |p, parallelism| {
        // SAFETY: the caller's strides address only elements inside `a` and `b`; the
        // destination is m×n.
        unsafe { gemm_on(kernel, p, parallelism) }
    })
}

/// [`run`] on the AVX512_BF16 kernel; the caller checked the CPU has AVX512_BF16.
#[cfg(target_arch = "x86_64")]
fn own_product(
    mnk: (usize, usize, usize),
    a: (&[bf16], (usize, usize)),
    b: (&[bf16], (usize, usize)),
    threads: usize,
    start: Option<&[f32]>,
) -> Vec<f32> {
    strided_product(mnk, a, b, (threads, start), |p, parallelism| {
        // SAFETY: the caller's strides address only elements inside `a` and `b`; the
        // destination is m×n; the CPU has AVX512_BF16.
        unsafe { own(p, parallelism) }
    })
}

#[test]
fn every_kernel_gives_the_widened_f32_product_within_the_summation_bound() {
    let portable = Kernel::Portable(Isa::detect());
    let own = own_kernel_runs_here(
        "every_kernel_gives_the_widened_f32_product_within_the_summation_bound (the \
         AVX512_BF16 kernel's part)",
    );
    // One row (decode), odd contractions, partial tiles and panels, a split over threads, and
    // k past one block of the AVX512_BF16 kernel (512) and n past one of its column blocks.
    for (m, n, k) in [
        (5, 7, 3),
        (1, 33, 7),
        (1, 530, 1030),
        (300, 70, 131),
        (601, 170, 130),
        (130, 530, 1030),
    ] {
        let a = values(m * (k + 3), 1);
        let b = values(k * (n + 5), 2);
        let (a16, b16) = (to_bf16(&a), to_bf16(&b));
        // Row-major, a transposed, b transposed, padded rows.
        let layouts = [
            ((k, 1), (n, 1)),
            ((1, m), (n, 1)),
            ((k + 3, 1), (1, k)),
            ((k + 3, 1), (n + 5, 1)),
        ];
        for &(sa, sb) in &layouts {
            let at = |i: usize, l: usize| f64::from(a[i * sa.0 + l * sa.1]);
            let bt = |l: usize, j: usize| f64::from(b[l * sb.0 + j * sb.1]);
            // Each element's exact sum and the sum of its terms' magnitudes.
            let reference: Vec<(f64, f64)> = (0..m * n)
                .map(|e| {
                    let (i, j) = (e / n, e % n);
                    (0..k).fold((0.0, 0.0), |(x, s), l| {
                        let t = at(i, l) * bt(l, j);
                        (x + t, s + t.abs())
                    })
                })
                .collect();
            let start = values(m * n, 3);
            for c in [None, Some(start.as_slice())] {
                let same_on_portable = run(&portable, (m, n, k), (&a, sa), (&b, sb), 1, c);
                for kernel in &kernels() {
                    for threads in [1, 3] {
                        let got = run(kernel, (m, n, k), (&a16, sa), (&b16, sb), threads, c);
                        for i in 0..m {
                            for j in 0..n {
                                let (exact, size) = reference[i * n + j];
                                let c0 = c.map_or(0.0, |c| f64::from(c[i * n + j]));
                                let bound =
                                    2.0 * k as f64 * 2f64.powi(-24) * (size + c0.abs()) + 1e-30;
                                let x = f64::from(got[i * n + j]);
                                assert!(
                                    (x - exact - c0).abs() <= bound,
                                    "{}: ({i},{j}) {x} vs {} ± {bound}",
                                    kernel.describe(),
                                    exact + c0
                                );
                            }
                        }
                        if matches!(kernel, Kernel::Portable(_)) {
                            assert_eq!(got, same_on_portable, "portable bits {m}×{n}×{k}");
                        }
                    }
                }
                #[cfg(target_arch = "x86_64")]
                if own {
                    let one = own_product((m, n, k), (&a16, sa), (&b16, sb), 1, c);
                    for threads in [1, 3] {
                        let got = own_product((m, n, k), (&a16, sa), (&b16, sb), threads, c);
                        assert_eq!(got, one, "AVX512_BF16 bits on {threads} threads");
                        for i in 0..m {
                            for j in 0..n {
                                let (exact, size) = reference[i * n + j];
                                let c0 = c.map_or(0.0, |c| f64::from(c[i * n + j]));
                                let bound =
                                    2.0 * k as f64 * 2f64.powi(-24) * (size + c0.abs()) + 1e-30;
                                let x = f64::from(got[i * n + j]);
                                assert!(
                                    (x - exact - c0).abs() <= bound,
                                    "AVX512_BF16: ({i},{j}) {x} vs {} ± {bound}",
                                    exact + c0
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Whether this CPU runs ferrotext's AVX512_BF16 kernel; when not, the check `name` reports
/// itself skipped (the instructions have no other route to check them on).
fn own_kernel_runs_here(name: &str) -> bool {
    let here = cpu().avx512_bf16;
    if !here {
        crate::report_skipped(
            &format!("tensor bf16::matmul::tests::{name}"),
            "this processor has no AVX512_BF16",
        );
    }
    here
}

/// A bf16 `[B, T, H, d]` attention-like product batched over B and H, `x·Wᵀ`, `xᵀ·dy` and a
/// layout that needs a copy, through the public products on this process's kernel, against
/// `dot_general` on the widened operands; or, where the process's kernel refuses bf16, the
/// error naming it.
#[test]
fn dot_general_bf16_matches_dot_general_on_widened_operands() {
    let cases: Vec<(Vec<usize>, Vec<usize>, DotDims)> = vec![
        (vec![70, 40], vec![40, 30], DotDims::matmul(2)),
        (
            vec![70, 40],
            vec![30, 40],
            DotDims {
                lhs_contracting: vec![1],
                rhs_contracting: vec![1],
                ..DotDims::default()
            },
        ),
        (
            vec![70, 40],
            vec![70, 30],
            DotDims {
                lhs_contracting: vec![0],
                rhs_contracting: vec![0],
                ..DotDims::default()
            },
        ),
        (
            vec![2, 9, 3, 8],
            vec![2, 9, 3, 8],
            DotDims {
                lhs_batch: vec![0, 2],
                rhs_batch: vec![0, 2],
                lhs_contracting: vec![3],
                rhs_contracting: vec![3],
            },
        ),
        // Contracting dims listed out of memory order: a copy.
        (
            vec![4, 5, 6],
            vec![6, 5, 3],
            DotDims {
                lhs_contracting: vec![2, 1],
                rhs_contracting: vec![0, 1],
                ..DotDims::default()
            },
        ),
    ];
    let refused = bf16_matmul_kernel().err();
    for (ls, rs, dims) in cases {
        let lv = values(ls.iter().product(), 4);
        let rv = values(rs.iter().product(), 5);
        let (l32, r32) = (
            Tensor::new(ls.clone(), lv.clone()).unwrap(),
            Tensor::new(rs.clone(), rv.clone()).unwrap(),
        );
        let (l16, r16) = (
            Bf16Tensor::new(ls, to_bf16(&lv)).unwrap(),
            Bf16Tensor::new(rs, to_bf16(&rv)).unwrap(),
        );
        let got = dot_general_bf16(&l16, &r16, &dims, 2);
        let mut acc = vec![
            1.0f32;
            dims.output_shape(l32.shape(), r32.shape())
                .unwrap()
                .iter()
                .product()
        ];
        let added = dot_general_bf16_accumulate(&l16, &r16, &dims, 2, &mut acc);
        if let Some(e) = &refused {
            assert_eq!(got.unwrap_err(), *e);
            assert_eq!(added.unwrap_err(), *e);
            continue;
        }
        let (got, want) = (got.unwrap(), dot_general(&l32, &r32, &dims, 2).unwrap());
        added.unwrap();
        let mut want_acc = vec![1.0f32; acc.len()];
        dot_general_accumulate(&l32, &r32, &dims, 2, &mut want_acc).unwrap();
        assert_eq!(got.shape(), want.shape());
        let k: usize = dims
            .lhs_contracting
            .iter()
            .map(|&d| l32.shape()[d])
            .product();
        // |terms| ≤ 4, so Σ|a·b| ≤ 4k.
        let bound = 2.0 * k as f32 * 2f32.powi(-24) * (4.0 * k as f32 + 1.0);
        if matmul_order_is_fixed() {
            assert_eq!(got, want);
            assert_eq!(acc, want_acc);
        }
        for (x, y) in got.data().iter().zip(want.data()) {
            assert!((x - y).abs() <= bound, "{x} vs {y}");
        }
        for (x, y) in acc.iter().zip(&want_acc) {
            assert!((x - y).abs() <= bound, "{x} vs {y}");
        }
    }
}

#[test]
fn dot_general_bf16_refuses_shapes_that_do_not_fit() {
    if bf16_matmul_kernel().is_err() {
        return; // the kernel's refusal comes first; checked above
    }
    let a = Bf16Tensor::new(vec![2, 3], vec![bf16::ONE; 6]).unwrap();
    let e = dot_general_bf16(&a, &a, &DotDims::matmul(2), 1).unwrap_err();
    assert!(e.to_string().contains("size 3"), "{e}");
    let mut out = vec![0.0; 5];
    let at = a.transpose(&[1, 0]).unwrap();
    let e = dot_general_bf16_accumulate(&a, &at, &DotDims::matmul(2), 1, &mut out).unwrap_err();
    assert!(e.to_string().contains("5 elements"), "{e}");
}

/// The rounding product on the AVX512_BF16 kernel itself (whatever the process chose): on a
/// contraction of three blocks, rows of several chunks and columns past one packed block and
/// not a whole panel, each element is `round_bf16` of what the `f32`-storing kernel computes,
/// bit for bit, on one and two threads, with either operand strided (transposed).
#[cfg(target_arch = "x86_64")]
#[test]
fn the_own_kernel_rounds_what_it_would_store() {
    if !own_kernel_runs_here("the_own_kernel_rounds_what_it_would_store") {
        return;
    }
    for &(m, n, k, lt, rt) in &[
        (1, 1, 1, false, false),
        (9, 33, 3, false, true),
        (500, 1100, 1030, false, false),
        (130, 70, 515, true, false),
        (77, 600, 40, false, true),
    ] {
        let (a, b) = (to_bf16(&values(m * k, 41)), to_bf16(&values(k * n, 42)));
        let (astr, bstr) = (
            if lt { (1, m) } else { (k, 1) },
            if rt { (1, k) } else { (n, 1) },
        );
        let want = own_product((m, n, k), (&a, astr), (&b, bstr), 1, None);
        let want: Vec<bf16> = want.iter().map(|&x| crate::round_bf16(x)).collect();
        for threads in [1, 2] {
            let mut got = vec![bf16::from_bits(0x7fc1); m * n];
            let op = |p: &[bf16], (rs, cs): (usize, usize)| Operand {
                ptr: p.as_ptr(),
                rs: rs as isize,
                cs: cs as isize,
            };
            let p = Product {
                m,
                n,
                k,
                a: op(&a, astr),
                b: op(&b, bstr),
                dst: got.as_mut_ptr(),
                ldc: n,
                store: Store::Overwrite,
            };
            // SAFETY: the strides address only elements inside `a` and `b`; `got` is m×n; the
            // CPU has AVX512_BF16 (checked above).
            unsafe { own_rounded(p, threads, None) };
            let diff = got
                .iter()
                .zip(&want)
                .position(|(x, y)| x.to_bits() != y.to_bits());
            assert_eq!(diff, None, "{m}×{n}×{k} lt {lt} rt {rt} on {threads}");
        }
    }
}

/// `dot_general_bf16_rounded` is `dot_general_bf16` rounded, bit for bit, on whichever kernel
/// the process chose (a batched attention-like layout, small and with bands of rows that cross
/// batch entries, a plain `x·W` and `dy·Wᵀ`, a contraction beyond the register-tile rounding's
/// 1024, odd sizes, 1 to 3 threads); and it does round (the mirror: the `f32` product differs
/// from it).
#[test]
fn dot_general_bf16_rounded_is_the_product_rounded() {
    let batched = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![3],
        lhs_batch: vec![0, 2],
        rhs_batch: vec![0, 2],
    };
    let transposed_rhs = DotDims {
        lhs_contracting: vec![1],
        rhs_contracting: vec![1],
        ..DotDims::default()
    };
    // Batches, and single products wider than they are tall (`[130, 64] × [64, 1000]`, a
    // transposed rhs, a long contraction), cut in bands of rows; a rhs above the cached size
    // (`[1100, 600]`: bands of at least 256 rows where the rows allow).
    let cases: [(Vec<usize>, Vec<usize>, DotDims); 9] = [
        (vec![600, 1100], vec![1100, 600], DotDims::matmul(2)),
        (vec![4, 70, 2, 16], vec![4, 50, 2, 16], batched.clone()),
        (vec![130, 64], vec![64, 1000], DotDims::matmul(2)),
        (vec![140, 600], vec![700, 600], transposed_rhs.clone()),
        (vec![128, 1500], vec![1500, 300], DotDims::matmul(2)),
        (vec![300, 1100], vec![1100, 40], DotDims::matmul(2)),
        (vec![300, 70], vec![70, 130], DotDims::matmul(2)),
        (vec![257, 600], vec![90, 600], transposed_rhs),
        (vec![2, 5, 3, 8], vec![2, 5, 3, 8], batched),
    ];
    for (ls, rs, dims) in cases {
        let l = Bf16Tensor::new(ls.clone(), to_bf16(&values(ls.iter().product(), 51))).unwrap();
        let r = Bf16Tensor::new(rs.clone(), to_bf16(&values(rs.iter().product(), 52))).unwrap();
        let Ok(whole) = dot_general_bf16(&l, &r, &dims, 1) else {
            // A refused kernel: the rounding product refuses alike.
            assert!(dot_general_bf16_rounded(&l, &r, &dims, 1).is_err());
            continue;
        };
        for threads in [1, 2, 3] {
            let got = dot_general_bf16_rounded(&l, &r, &dims, threads).unwrap();
            let want = Bf16Tensor::from_f32(&dot_general_bf16(&l, &r, &dims, threads).unwrap());
            assert_eq!(got, want, "{ls:?} x {rs:?} on {threads}");
        }
        let got = dot_general_bf16_rounded(&l, &r, &dims, 1).unwrap().to_f32();
        assert_eq!(got.shape(), whole.shape());
        assert!(got.data().iter().zip(whole.data()).any(|(a, b)| a != b));
    }
}

#[test]
fn bands_are_narrow_on_a_cached_rhs_and_wide_on_a_large_one() {
    // qwen3-peer's mlp_up `x·W` (a 384 KiB rhs): 8 bands of 64 rows on 2 threads.
    assert_eq!(band_rows(512, 768, 256, 2), 64);
    // qwen3-0.6b's lm_head and its weight gradient (`b` of 311 MB and 1 MiB): 256 rows.
    assert_eq!(band_rows(512, 151_936, 1024, 2), 256);
    assert_eq!(band_rows(151_936, 1024, 512, 2), 256);
    // Never below 64 rows (nor above the rows), and as many bands on each thread.
    assert_eq!(band_rows(128, 768, 256, 2), 64);
    assert_eq!(band_rows(40, 8, 8, 1), 40);
    assert_eq!(band_rows(600, 600, 1100, 2) * 4, 600);
}

/// The fused weight-gradient path: each element of the accumulator gets exactly the rounded
/// product's value, widened — the bits of `dot_general_bf16_rounded` followed by
/// `widen_add_slice` — whole or in parts of whole rows, on any thread count; parts that cut a
/// row, and an empty contraction, are declined with the accumulator untouched.
#[test]
fn a_rounded_product_accumulated_is_the_rounded_product_widened_and_added() {
    // Rows enough for a run per thread (and, on the AVX512_BF16 kernel, the tiles rounded and
    // added from registers): partial row tiles and column panels, an odd contraction, one
    // over the kernel's blocks of the contraction and columns, and a transposed lhs as a
    // weight gradient's `xᵀ·dy`; and rows too few for runs.
    let cases: [(Vec<usize>, Vec<usize>, DotDims); 5] = [
        (vec![300, 70], vec![70, 130], DotDims::matmul(2)),
        (vec![203, 33], vec![33, 45], DotDims::matmul(2)),
        (vec![600, 1100], vec![1100, 600], DotDims::matmul(2)),
        (vec![12, 5], vec![5, 9], DotDims::matmul(2)),
        (
            vec![96, 256],
            vec![96, 40],
            DotDims {
                lhs_contracting: vec![0],
                rhs_contracting: vec![0],
                ..DotDims::default()
            },
        ),
    ];
    for (ls, rs, dims) in cases {
        let l = Bf16Tensor::new(ls.clone(), to_bf16(&values(ls.iter().product(), 61))).unwrap();
        let r = Bf16Tensor::new(rs.clone(), to_bf16(&values(rs.iter().product(), 62))).unwrap();
        let Ok(rounded) = dot_general_bf16_rounded(&l, &r, &dims, 1) else {
            let mut acc = vec![0.0f32; 1];
            assert!(
                dot_general_bf16_rounded_accumulate_parts(&l, &r, &dims, 1, &mut [&mut acc])
                    .is_err()
            );
            continue;
        };
        let start: Vec<f32> = values(rounded.len(), 63);
        let mut want = start.clone();
        crate::widen_add_slice(rounded.data(), &mut want);
        let n = *rounded.shape().last().unwrap();
        let rows = rounded.len() / n;
        for (parts, threads) in [(1, 1), (1, 2), (3, 2), (rows, 3)] {
            if rows % parts != 0 {
                continue;
            }
            let mut acc = start.clone();
            let mut split: Vec<&mut [f32]> = acc.chunks_mut(rounded.len() / parts).collect();
            assert!(
                dot_general_bf16_rounded_accumulate_parts(&l, &r, &dims, threads, &mut split)
                    .unwrap(),
                "{ls:?} x {rs:?}"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&acc),
                bits(&want),
                "{ls:?} x {rs:?}, {parts} parts on {threads}"
            );
        }
        // A part that cuts a row is declined, untouched.
        let mut acc = start.clone();
        let (a, b) = acc.split_at_mut(n + 1);
        let mut split = [a, b];
        assert!(!dot_general_bf16_rounded_accumulate_parts(&l, &r, &dims, 2, &mut split).unwrap());
        assert_eq!(acc, start);
    }
    // An empty contraction: declined (the unfused path adds its zeros).
    let (l, r) = (
        Bf16Tensor::new(vec![4, 0], vec![]).unwrap(),
        Bf16Tensor::new(vec![0, 3], vec![]).unwrap(),
    );
    let mut acc = vec![-0.0f32; 12];
    match dot_general_bf16_rounded_accumulate_parts(&l, &r, &DotDims::matmul(2), 1, &mut [&mut acc])
    {
        Ok(done) => assert!(!done, "an empty contraction is declined"),
        Err(e) => assert!(matches!(e, TensorError::NoBf16Product { .. }), "{e}"),
    }
}

/// A right operand that keeps its packings (`Bf16Tensor::keeping_packings`) gives every
/// product the bits of the same tensor without them — forward and transposed layouts, rounded
/// (in registers and in bands) or not, on one and two threads, the packing made by the first
/// product and used by the later ones — and keeps one packing per matrix and layout where the
/// AVX512_BF16 kernel runs, none for a batched `b` or a product of a decoded token's rows. The
/// mirror: the same tensor without `keeping_packings` keeps none.
#[test]
fn a_kept_packing_gives_the_products_bits_and_is_made_once_per_layout() {
    let transposed = DotDims {
        lhs_contracting: vec![1],
        rhs_contracting: vec![1],
        ..DotDims::default()
    };
    let batched = DotDims {
        lhs_contracting: vec![2],
        rhs_contracting: vec![1],
        lhs_batch: vec![0],
        rhs_batch: vec![0],
    };
    let bits = |t: &Tensor| t.data().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let packs = cpu().avx512_bf16 && bf16_matmul_kernel().is_ok() && {
        // The process's choice is made by now (the products above fixed it).
        crate::bf16_products_keep_packings()
    };
    if !packs {
        // The bits are still compared below; only the packings' count has nothing to count.
        crate::report_skipped(
            "tensor bf16::matmul::tests::a_kept_packing_…: the packings kept",
            "this process's bf16 kernel packs no operand (not ferrotext's AVX512_BF16 kernel)",
        );
    }
    // (lhs, rhs, dims, packings kept after it): `x·W`, `dy·Wᵀ` on the same `W` (a second
    // layout), a long contraction (rounded in bands), a reshaped `W` (another matrix of the
    // same storage), a decoded token (no packing), a batched rhs (none).
    let w = Bf16Tensor::new(vec![96, 200], to_bf16(&values(96 * 200, 61))).unwrap();
    let long = Bf16Tensor::new(vec![1100, 600], to_bf16(&values(1100 * 600, 62))).unwrap();
    let stack = Bf16Tensor::new(vec![2, 40, 30], to_bf16(&values(2 * 40 * 30, 63))).unwrap();
    let cases: Vec<(Vec<usize>, Bf16Tensor, DotDims, usize)> = vec![
        (vec![130, 96], w.clone(), DotDims::matmul(2), 1),
        (vec![300, 200], w.clone(), transposed.clone(), 2),
        (vec![300, 1100], long.clone(), DotDims::matmul(2), 1),
        (
            vec![140, 200],
            w.reshaped(&[200, 96]).unwrap(),
            DotDims::matmul(2),
            3,
        ),
        (vec![2, 96], w.clone(), DotDims::matmul(2), 3),
        (vec![2, 7, 40], stack.clone(), batched, 0),
    ];
    // One keeping tensor per storage, shared by its cases (as a step's weight copy is).
    let keeping = [
        w.keeping_packings(),
        long.keeping_packings(),
        stack.keeping_packings(),
    ];
    let keeper = |r: &Bf16Tensor| {
        let k = keeping
            .iter()
            .find(|k| k.data().as_ptr() == r.data().as_ptr())
            .unwrap();
        k.reshaped(r.shape()).unwrap()
    };
    for (ls, plain, dims, want_kept) in cases {
        let l = Bf16Tensor::new(ls.clone(), to_bf16(&values(ls.iter().product(), 64))).unwrap();
        let kept = keeper(&plain);
        let Ok(want) = dot_general_bf16(&l, &plain, &dims, 1) else {
            assert!(dot_general_bf16(&l, &kept, &dims, 1).is_err());
            return;
        };
        let want_rounded = dot_general_bf16_rounded(&l, &plain, &dims, 1).unwrap();
        for threads in [1, 2, 1] {
            let what = format!("{ls:?} x {:?} on {threads}", plain.shape());
            let got = dot_general_bf16(&l, &kept, &dims, threads).unwrap();
            assert_eq!(bits(&got), bits(&want), "{what}");
            let got = dot_general_bf16_rounded(&l, &kept, &dims, threads).unwrap();
            assert_eq!(got, want_rounded, "{what} rounded");
        }
        let expected = if packs { want_kept } else { 0 };
        assert_eq!(
            kept.kept_packings(),
            expected,
            "{ls:?} x {:?}",
            plain.shape()
        );
        assert_eq!(plain.kept_packings(), 0);
    }
}
