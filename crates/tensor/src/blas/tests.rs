//! Every kernel against an f64 product on every layout, and the CBLAS layout rules.

use super::*;

/// `a · b` in f64 from strided operands.
fn reference(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    (ars, acs): (usize, usize),
    b: &[f32],
    (brs, bcs): (usize, usize),
) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|l| f64::from(a[i * ars + l * acs]) * f64::from(b[l * brs + j * bcs]))
                .sum();
        }
    }
    out
}

/// `dst (+)= a·b` for `(m, n, k)` and operands of `T` with strides `(rows, columns)`, computed
/// by `kernel` (a kernel function given the product and the parallelism of `threads`): into a
/// destination of NaNs (a read of it would show), or added into `start`.
///
/// `kernel` is handed a product whose operands lie inside `a` and `b` (the caller's strides
/// must address only their elements) and whose destination is an m×n buffer of its own.
pub(crate) fn strided_product<T>(
    (m, n, k): (usize, usize, usize),
    (a, (ars, acs)): (&[T], (usize, usize)),
    (b, (brs, bcs)): (&[T], (usize, usize)),
    (threads, start): (usize, Option<&[f32]>),
    kernel: impl FnOnce(Product<T>, gemm::Parallelism),
) -> Vec<f32> {
    let (mut dst, store) = match start {
        Some(c) => (c.to_vec(), Store::Accumulate),
        None => (vec![f32::NAN; m * n], Store::Overwrite),
    };
    let op = |data: &[T], rs: usize, cs: usize| crate::operand::Operand {
        ptr: data.as_ptr(),
        rs: rs as isize,
        cs: cs as isize,
    };
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let p = Product {
        m,
        n,
        k,
        a: op(a, ars, acs),
        b: op(b, brs, bcs),
        dst: dst.as_mut_ptr(),
        ldc: n,
        store,
    };
    kernel(p, parallelism);
    dst
}

/// [`strided_product`] on `kernel`.
fn product(
    kernel: &Kernel,
    mnk: (usize, usize, usize),
    a: (&[f32], (usize, usize)),
    b: (&[f32], (usize, usize)),
    threads: usize,
    start: Option<&[f32]>,
) -> Vec<f32> {
    strided_product(mnk, a, b, (threads, start), |p, parallelism| {
        // SAFETY: the caller's strides address only elements inside `a` and `b`; the
        // destination is m×n.
        unsafe { gemm_on(kernel, p, parallelism) }
    })
}

/// Every kernel this machine has (`gemm`, MKL, OpenBLAS, the portable kernel) against an
/// f64 loop, on every layout `dot_general` hands them (row-major, transposed, padded rows,
/// a layout only `gemm` takes), in one call and in row blocks on 2 and 3 threads; and the
/// same for a product added into a destination (`Store::Accumulate`), against the f64 sum
/// of the destination and the product. The portable kernel gives the same bits in blocks
/// (its invariant); a BLAS or `gemm` is held to the tolerance only, since which kernel —
/// and so which order of addition — it runs on a block depends on the processor (OpenBLAS's
/// Haswell kernel computes a block's rows otherwise than the whole product's).
#[test]
fn every_kernel_matches_an_f64_product_on_every_layout() {
    // `gemm`, the portable kernel and each BLAS this machine has (opened here, whichever
    // the process uses).
    let libraries: Vec<Kernel> = [Kernel::Gemm, Kernel::Portable(Isa::detect())]
        .into_iter()
        .chain(
            [open_mkl(), open_openblas()]
                .into_iter()
                .flatten()
                .map(Kernel::Blas),
        )
        .collect();
    // Too small to split; split over 2 or 3 threads (uneven blocks), and a wide product.
    for (m, n, k) in [(300, 70, 130), (601, 170, 130), (130, 1100, 150)] {
        let data = |len: usize, seed: u32| -> Vec<f32> {
            (0..len)
                .map(|i| {
                    ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 9) as f32
                        / 8_388_608.0
                        - 0.5
                })
                .collect()
        };
        let a = data(2 * m * (k + 3), 1);
        let b = data(k * (n + 5), 2);
        // (a strides, b strides): row-major, a transposed, b transposed, padded rows, and a
        // with element stride 2 (only `gemm` takes it).
        let layouts = [
            ((k, 1), (n, 1)),
            ((1, m), (n, 1)),
            ((k + 3, 1), (1, k)),
            ((k + 3, 1), (n + 5, 1)),
            ((2 * k + 3, 2), (n, 1)),
        ];
        for kernel in &libraries {
            let fixed = matches!(kernel, Kernel::Portable(_));
            for &(sa, sb) in &layouts {
                let want = reference((m, n, k), &a, sa, &b, sb);
                let start = data(m * n, 3);
                let added: Vec<f64> = want
                    .iter()
                    .zip(&start)
                    .map(|(w, c)| w + f64::from(*c))
                    .collect();
                for (c, want) in [(None, &want), (Some(start.as_slice()), &added)] {
                    let one = product(kernel, (m, n, k), (&a, sa), (&b, sb), 1, c);
                    for threads in [1, 2, 3] {
                        let got = product(kernel, (m, n, k), (&a, sa), (&b, sb), threads, c);
                        for (x, y) in got.iter().zip(want) {
                            assert!(
                                (f64::from(*x) - y).abs() <= 1e-4 * (1.0 + y.abs()),
                                "{}: {x} vs {y} on {threads} (accumulate: {})",
                                kernel.describe(),
                                c.is_some()
                            );
                        }
                        if fixed {
                            assert_eq!(got, one, "threads {threads} (accumulate: {})", c.is_some());
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn mkl_versions_are_shortened() {
    assert_eq!(
        mkl_version("Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build 20260915 for Intel(R) 64 architecture applications"),
        "Intel MKL 2026.2"
    );
    assert_eq!(mkl_version("something else"), "Intel MKL");
}

#[test]
fn layouts_cblas_accepts_and_refuses() {
    // Row-major 3×4 with padding, column-major 3×4, and a single row or column.
    assert_eq!(cblas_layout(3, 4, 5, 1), Some((CBLAS_NO_TRANS, 5)));
    assert_eq!(cblas_layout(3, 4, 1, 3), Some((CBLAS_TRANS, 3)));
    assert_eq!(cblas_layout(1, 4, 0, 1), Some((CBLAS_NO_TRANS, 4)));
    assert_eq!(cblas_layout(3, 1, 1, 0), Some((CBLAS_TRANS, 3)));
    // Overlapping rows, strides on both axes, negative strides: `gemm`'s.
    assert_eq!(cblas_layout(3, 4, 2, 1), None);
    assert_eq!(cblas_layout(3, 4, 8, 2), None);
    assert_eq!(cblas_layout(3, 4, -4, 1), None);
}

#[test]
fn openblas_comes_first_on_a_processor_with_avx512_not_made_by_intel() {
    let order = |intel, avx512f| library_order(Processor { intel, avx512f });
    assert_eq!(order(false, true), LibraryOrder::OpenblasFirst);
    assert_eq!(order(true, true), LibraryOrder::MklFirst);
    assert_eq!(order(true, false), LibraryOrder::MklFirst);
    assert_eq!(order(false, false), LibraryOrder::MklFirst);
}

/// The kept-packing route beside a chosen BLAS: where the portable kernel runs AVX-512 on a
/// processor not made by Intel (measured against OpenBLAS's AVX-512 kernel there), nowhere
/// else — not on a Xeon (MKL, unmeasured against it), nor on a narrower set (forced, or the
/// processor's).
#[test]
fn the_kept_route_runs_beside_a_blas_on_avx512_not_made_by_intel() {
    let kept = |intel, avx512f, isa| kept_by_default(Processor { intel, avx512f }, isa);
    assert!(kept(false, true, Isa::Avx512));
    assert!(!kept(true, true, Isa::Avx512));
    assert!(!kept(false, true, Isa::Avx2));
    assert!(!kept(false, true, Isa::Scalar));
    assert!(!kept(false, false, Isa::Avx2));
}

/// The processor as Linux describes it (`/proc/cpuinfo`'s first `vendor_id` and `flags`), a
/// source independent of the CPUID reads in `processor()`.
#[cfg(target_arch = "x86_64")]
fn processor_from_cpuinfo() -> Option<Processor> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    Some(Processor {
        intel: field("vendor_id")? == "GenuineIntel",
        avx512f: field("flags")?.split_whitespace().any(|f| f == "avx512f"),
    })
}

/// With both libraries installed, the kernel nobody named is OpenBLAS on a processor with
/// AVX-512 not made by Intel and MKL on any other, as `/proc/cpuinfo` describes this one (on a
/// machine without both, the one found). The rule is spelled out here, not read from
/// `library_order`.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_default_kernel_follows_the_processor() {
    let cpu = processor_from_cpuinfo().expect("/proc/cpuinfo names the vendor and flags");
    assert_eq!(processor(), cpu);
    let found = |k: &Kernel| match k {
        Kernel::Blas(b) if b.is_mkl => "mkl",
        Kernel::Blas(_) => "openblas",
        _ => "none",
    };
    let (mkl, openblas) = (open_mkl().is_some(), open_openblas().is_some());
    let openblas_first = cpu.avx512f && !cpu.intel;
    let want = match (mkl, openblas) {
        (true, true) if openblas_first => "openblas",
        (true, _) => "mkl",
        (false, true) => "openblas",
        (false, false) => "none",
    };
    assert_eq!(
        found(&open_default()),
        want,
        "{cpu:?}, MKL {mkl}, OpenBLAS {openblas}"
    );
}
