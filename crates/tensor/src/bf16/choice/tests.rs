//! Which kernel computes bf16 products, for each f32 kernel, processor and library.

use super::*;
use crate::blas::open_mkl;
use crate::portable::Isa;

/// A CPU without AMX, with or without AVX512_BF16.
fn no_tiles(avx512_bf16: bool) -> Cpu {
    Cpu {
        avx512_bf16,
        amx_bf16: false,
    }
}

/// Which kernel computes bf16 products for each f32 kernel, named or picked automatically,
/// with and without the fallback.
#[test]
fn the_bf16_kernel_follows_the_f32_kernel_and_refuses_only_a_named_one() {
    let isa = Isa::detect();
    for own in [false, true] {
        assert_eq!(
            choose(&Kernel::Portable(isa), true, false, no_tiles(own)),
            Choice::Portable(isa, None)
        );
        assert_eq!(
            choose(&Kernel::Portable(isa), false, true, no_tiles(own)),
            Choice::Portable(isa, None)
        );
    }
    let gemm = "the gemm crate".to_string();
    assert_eq!(
        choose(&Kernel::Gemm, true, false, no_tiles(true)),
        Choice::Refused(gemm.clone())
    );
    assert_eq!(
        choose(&Kernel::Gemm, true, true, no_tiles(false)),
        Choice::Portable(isa, Some(gemm.clone()))
    );
    assert_eq!(
        choose(&Kernel::Gemm, true, true, no_tiles(true)),
        Choice::Own(gemm.clone())
    );
    assert_eq!(
        choose(&Kernel::Gemm, false, false, no_tiles(false)),
        Choice::Portable(isa, Some(gemm.clone()))
    );
    assert_eq!(
        choose(&Kernel::Gemm, false, false, no_tiles(true)),
        Choice::Own(gemm.clone())
    );
    // AMX helps only MKL's product: without it, ferrotext's kernel still runs.
    let tiles = Cpu {
        avx512_bf16: true,
        amx_bf16: true,
    };
    assert_eq!(
        choose(&Kernel::Gemm, false, false, tiles),
        Choice::Own(gemm)
    );
    let e = Choice::Refused("OpenBLAS 0.3.21".into())
        .describe()
        .unwrap_err();
    assert_eq!(
        e,
        TensorError::NoBf16Product {
            kernel: "OpenBLAS 0.3.21".into()
        }
    );
    assert!(
        e.to_string().starts_with("OpenBLAS 0.3.21 has no bf16"),
        "{e}"
    );
}

/// MKL's place in the choice: named, its own bf16 product; automatic, ferrotext's kernel first
/// unless the CPU has AMX tiles; without its bf16 product, refused when named and replaced by
/// the portable kernel otherwise. Needs MKL (`.ci/install-mkl`); reports itself skipped without.
#[test]
fn mkl_runs_bf16_products_where_its_product_is_the_best_choice() {
    let isa = Isa::detect();
    let Some(mkl) = open_mkl() else {
        crate::report_skipped(
            "tensor bf16::matmul::tests::mkl_runs_bf16_products_where_its_product_is_the_best_choice",
            "MKL is not installed (.ci/install-mkl)",
        );
        return;
    };
    // MKL has had `cblas_gemm_bf16bf16f32` since 2020.
    let what = mkl.description.clone();
    let with = Kernel::Blas(mkl);
    // Named: its own product, AVX512_BF16 or not; automatic: ferrotext's kernel first.
    for own in [false, true] {
        assert_eq!(
            choose(&with, true, false, no_tiles(own)),
            Choice::Library(what.clone(), "cblas_gemm_bf16bf16f32")
        );
    }
    assert_eq!(
        choose(&with, false, false, no_tiles(false)),
        Choice::Library(what.clone(), "cblas_gemm_bf16bf16f32")
    );
    assert_eq!(
        choose(&with, false, false, no_tiles(true)),
        Choice::Own(what.clone())
    );
    // With AMX tiles, MKL's product (which runs on them) comes before ferrotext's kernel.
    let tiles = Cpu {
        avx512_bf16: true,
        amx_bf16: true,
    };
    assert_eq!(
        choose(&with, false, false, tiles),
        Choice::Library(what.clone(), "cblas_gemm_bf16bf16f32")
    );
    let Kernel::Blas(mut mkl) = with else {
        unreachable!() // ok: built just above
    };
    mkl.bf16 = None;
    let without = Kernel::Blas(mkl);
    assert_eq!(
        choose(&without, true, false, no_tiles(true)),
        Choice::Refused(what.clone())
    );
    assert_eq!(
        choose(&without, true, true, no_tiles(false)),
        Choice::Portable(isa, Some(what.clone()))
    );
    assert_eq!(
        choose(&without, false, false, no_tiles(false)),
        Choice::Portable(isa, Some(what))
    );
}
