//! The matrix-product kernel behind [`crate::dot_general`] and the grouped products: Intel MKL
//! or OpenBLAS when this machine has one, else the `gemm` crate; or ferrotext's own portable
//! kernel (`crate::portable`) when asked for (`deterministic=true`, `FERROTEXT_MATMUL=portable`).
//!
//! The BLAS is opened at run time (`dlopen`), not linked: the build needs nothing outside the
//! Rust registry, and a machine without one runs the same binary on `gemm`. The two libraries
//! are MKL's single runtime library (`libmkl_rt.so.3`, PyPI's `mkl` wheel; `.ci/install-mkl`
//! puts it where the loader finds it) and OpenBLAS (`libopenblas.so.0`, Debian's
//! `libopenblas0-pthread`). MKL is tried first on an Intel processor, OpenBLAS first on one
//! with AVX-512 made by another ([`library_order`]): MKL keeps its AVX-512 kernels for Intel's.
//! On a 2-core Xeon, one thread, hot operands, qwen3-peer's products at 128 rows (a device's
//! micro-batch at data=4): MKL 2026.2 172–203 GFLOP/s, OpenBLAS 0.3.21's SkylakeX kernel
//! 139–169, `gemm` 0.19 102–111 (`ferrotext bench kernels`, and the same shapes through each
//! library's `cblas_sgemm`); whole qwen3-peer steps (GA 4), MKL vs OpenBLAS: data=4 307–319 →
//! 267–284 ms, data=1 293–317 → 274–286 ms, alternated runs. On a 2-core AMD EPYC (Zen 4) the
//! other way round: OpenBLAS's Cooperlake kernel made qwen3-0.6b's `f32` step 0.81× MKL's
//! (docs/performance.md).
//!
//! Invariants:
//! * The BLAS computes on its caller's thread only: MKL's sequential threading layer (chosen
//!   before any other MKL call), OpenBLAS with `openblas_set_num_threads(1)`. So a device
//!   never uses more cores than its budget, and many device threads may call at once. An
//!   OpenBLAS build that says `SINGLE_THREADED` (Debian's `libopenblas0-serial`) is not used: it
//!   is not made for concurrent callers.
//! * The choice is made once per process and never changes, so one process's results have the
//!   same bits run after run. `FERROTEXT_MATMUL=mkl|openblas|gemm|portable` forces one.
//! * Only the portable kernel fixes each element's order of addition by its own code
//!   ([`matmul_order_is_fixed`]): its bits are the same on any processor, in any row block, on
//!   any thread count. A BLAS chooses its kernel (and so its order) by processor and shape: on
//!   one machine its results repeat, but a block of rows, a zero-padded contraction or another
//!   processor may give other bits (MKL on an AMD EPYC and on a Xeon do; OpenBLAS's Haswell and
//!   SkylakeX kernels do). Claims of equal bits across routes are made for the portable kernel
//!   and checked within a tolerance on the others.
//! * Operands a BLAS cannot take (a stride other than 1 on both axes, or a negative one) go to
//!   `gemm`, which takes any strides.

use std::ffi::{c_char, c_float, c_int, CStr};
use std::sync::OnceLock;

use crate::operand::{Product, Store, Widen};
use crate::portable::{self, Isa};

/// A CBLAS product with f32 output and `T` inputs: `cblas_sgemm` (`T = f32`), MKL's
/// `cblas_gemm_bf16bf16f32` and OpenBLAS's `cblas_sbgemm` (`T = bf16`, a `u16` in C) share
/// this signature (order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc).
pub(crate) type Cblas<T> = unsafe extern "C" fn(
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    c_float,
    *const T,
    c_int,
    *const T,
    c_int,
    c_float,
    *mut c_float,
    c_int,
);

/// `cblas_sgemm`'s signature.
type Sgemm = Cblas<c_float>;

/// An element type a product reads: `f32`, or `bf16` widened exactly to `f32` as it is read.
/// The output and the accumulation are `f32` either way.
pub(crate) trait Element: Widen {
    /// This element type's product in `blas`, if the library has one.
    fn cblas(blas: &Blas) -> Option<Cblas<Self>>;
    /// [`gemm_on`] on the kernel this process uses for this element type: the matrix-product
    /// kernel for `f32`, the bf16 choice (`crate::bf16`) for `bf16`.
    ///
    /// # Safety
    /// As [`sgemm`].
    unsafe fn product(p: Product<Self>, parallelism: gemm::Parallelism);
    /// The product when no BLAS takes it (no library, no product for this type, or a layout
    /// CBLAS refuses): the `gemm` crate for `f32`, the portable kernel for `bf16`.
    ///
    /// # Safety
    /// As [`sgemm`].
    unsafe fn without_blas(p: Product<Self>, parallelism: gemm::Parallelism);
}

impl Element for f32 {
    fn cblas(blas: &Blas) -> Option<Cblas<f32>> {
        Some(blas.sgemm)
    }
    unsafe fn product(p: Product, parallelism: gemm::Parallelism) {
        // SAFETY: the caller's contract.
        unsafe { sgemm(p, parallelism) }
    }
    unsafe fn without_blas(p: Product, parallelism: gemm::Parallelism) {
        // SAFETY: the caller's contract.
        unsafe { sgemm_gemm(p, parallelism) }
    }
}

const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;

/// The fewest rows of a block when a product is split over threads (every kernel's split).
pub(crate) const MIN_BLOCK_ROWS: usize = 64;

/// Multiply-adds (rows × n × k) every block of a split product has at least: far above the
/// size below which a BLAS switches to its small-matrix kernels (whose sums are ordered
/// differently), so a block is computed exactly as its rows of the whole product are.
const REGULAR_KERNEL_MIN: usize = 1 << 22;

/// OpenBLAS's names, in the order tried.
const OPENBLAS: [&str; 2] = ["libopenblas.so.0", "libopenblas.so"];

/// Intel MKL's single dynamic library (`libmkl_rt`), newest interface first.
const MKL: [&str; 3] = ["libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"];

/// `MKL_THREADING_SEQUENTIAL` for `MKL_Set_Threading_Layer`.
const MKL_THREADING_SEQUENTIAL: c_int = 1;

/// What computes this process's matrix products.
pub(crate) enum Kernel {
    /// An opened BLAS (MKL or OpenBLAS).
    Blas(Blas),
    /// ferrotext's own fixed-order kernel, on the instruction set it runs on.
    Portable(Isa),
    /// The `gemm` crate.
    Gemm,
}

/// An opened BLAS: its `cblas_sgemm`, set to compute on its caller's thread only, and its
/// bf16 × bf16 → f32 product with the symbol's name when the library has one.
pub(crate) struct Blas {
    sgemm: Sgemm,
    pub(crate) bf16: Option<(Cblas<half::bf16>, &'static str)>,
    /// What it is, for run headers: `OpenBLAS 0.3.21 (SkylakeX, one thread per call)`.
    pub(crate) description: String,
    /// Intel MKL, whose bf16 product runs on AMX tiles where the CPU has them.
    pub(crate) is_mkl: bool,
    /// Keeps the library mapped while `sgemm` may be called.
    _library: libloading::Library,
}

static KERNEL: OnceLock<Kernel> = OnceLock::new();

/// The kernel `FERROTEXT_MATMUL` asks for (`mkl`, `openblas`, `gemm` or `portable`), else
/// [`open_default`].
pub(crate) fn open() -> Kernel {
    let blas = match std::env::var("FERROTEXT_MATMUL").as_deref() {
        Ok("gemm") => None,
        Ok("portable") => return Kernel::Portable(Isa::detect()),
        Ok("openblas") => open_openblas(),
        Ok("mkl") => open_mkl(),
        _ => return open_default(),
    };
    blas.map_or(Kernel::Gemm, Kernel::Blas)
}

/// The kernel nobody named: the first found of MKL and OpenBLAS in [`library_order`]'s order
/// for this processor, else `gemm`.
pub(crate) fn open_default() -> Kernel {
    let blas = match library_order(processor()) {
        LibraryOrder::MklFirst => open_mkl().or_else(open_openblas),
        LibraryOrder::OpenblasFirst => open_openblas().or_else(open_mkl),
    };
    blas.map_or(Kernel::Gemm, Kernel::Blas)
}

/// Which BLAS is tried first when both are installed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LibraryOrder {
    /// Intel MKL, then OpenBLAS.
    MklFirst,
    /// OpenBLAS, then Intel MKL.
    OpenblasFirst,
}

/// What the library order depends on: who made the processor and whether it has AVX-512F.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Processor {
    /// The CPUID vendor string is `GenuineIntel`.
    pub(crate) intel: bool,
    /// The processor has AVX-512F.
    pub(crate) avx512f: bool,
}

/// OpenBLAS first on a processor with AVX-512 that is not Intel's, MKL first everywhere else.
///
/// MKL picks its AVX-512 kernels on Intel processors only: on an AMD EPYC (Zen 4) it runs
/// `mkl_blas_def_sgemm_kernel_0_zen` from its default library (`libmkl_def.so.3`, by `perf`)
/// and its verbose line names no instruction set, while OpenBLAS runs its Cooperlake (AVX-512)
/// kernel there and ran qwen3-0.6b's `f32` step in 0.81× MKL's time and qwen3-peer's in
/// 0.71–0.97× (docs/performance.md). On a Xeon MKL was the faster one, and
/// on a processor with AVX2 alone neither was measured against the other (nor MKL's bf16
/// product, which a processor without AVX512_BF16 uses, against the portable kernel), so those
/// keep MKL first.
pub(crate) fn library_order(p: Processor) -> LibraryOrder {
    if p.avx512f && !p.intel {
        LibraryOrder::OpenblasFirst
    } else {
        LibraryOrder::MklFirst
    }
}

/// This processor, asked of CPUID (vendor string, leaf 0) and of std's feature detection.
pub(crate) fn processor() -> Processor {
    #[cfg(target_arch = "x86_64")]
    {
        let leaf0 = std::arch::x86_64::__cpuid(0);
        let vendor = [leaf0.ebx, leaf0.edx, leaf0.ecx];
        Processor {
            intel: vendor.map(u32::to_le_bytes).concat() == b"GenuineIntel",
            avx512f: std::arch::is_x86_feature_detected!("avx512f"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Processor {
            intel: false,
            avx512f: false,
        }
    }
}

/// Reads a static NUL-terminated string a library function returns.
///
/// # Safety
/// `f` must return null or a pointer to a NUL-terminated string that stays valid.
unsafe fn text(f: unsafe extern "C" fn() -> *const c_char) -> Option<String> {
    // SAFETY: the caller's contract.
    let p = unsafe { f() };
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null, NUL-terminated and valid, by the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    Some(s.to_string_lossy().trim().to_string())
}

pub(crate) fn open_openblas() -> Option<Blas> {
    OPENBLAS.iter().find_map(|name| {
        // SAFETY: loading OpenBLAS runs its initialisers, which only set up its own state.
        let library = unsafe { libloading::Library::new(name) }.ok()?;
        // SAFETY: the symbols are OpenBLAS's, with the C signatures written here; the strings
        // they return are static and NUL-terminated.
        unsafe {
            let sgemm = *library.get::<Sgemm>(b"cblas_sgemm\0").ok()?;
            let threads = *library
                .get::<unsafe extern "C" fn(c_int)>(b"openblas_set_num_threads\0")
                .ok()?;
            type Text = unsafe extern "C" fn() -> *const c_char;
            let config = text(*library.get::<Text>(b"openblas_get_config\0").ok()?)?;
            let core = match library.get::<Text>(b"openblas_get_corename\0") {
                Ok(f) => text(*f).unwrap_or_default(),
                Err(_) => String::new(),
            };
            if config.contains("SINGLE_THREADED") {
                return None;
            }
            threads(1);
            // Built with `BUILD_BFLOAT16=1` only (Debian's 0.3.21 is not).
            let bf16 = library
                .get::<Cblas<half::bf16>>(b"cblas_sbgemm\0")
                .ok()
                .map(|f| (*f, "cblas_sbgemm"));
            let version = config
                .split_whitespace()
                .take(2)
                .collect::<Vec<_>>()
                .join(" ");
            Some(Blas {
                sgemm,
                bf16,
                description: format!("{version} ({core}, one thread per call)"),
                is_mkl: false,
                _library: library,
            })
        }
    })
}

pub(crate) fn open_mkl() -> Option<Blas> {
    MKL.iter().find_map(|name| {
        // SAFETY: loading MKL runs its initialisers, which only set up its own state.
        let library = unsafe { libloading::Library::new(name) }.ok()?;
        // SAFETY: the symbols are MKL's, with the C signatures written here. The threading
        // layer is chosen before any other MKL call, as MKL requires.
        unsafe {
            let layer = *library
                .get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_Set_Threading_Layer\0")
                .ok()?;
            if layer(MKL_THREADING_SEQUENTIAL) != MKL_THREADING_SEQUENTIAL {
                return None;
            }
            let sgemm = *library.get::<Sgemm>(b"cblas_sgemm\0").ok()?;
            let bf16 = library
                .get::<Cblas<half::bf16>>(b"cblas_gemm_bf16bf16f32\0")
                .ok()
                .map(|f| (*f, "cblas_gemm_bf16bf16f32"));
            let mut buf = [0 as c_char; 198];
            let version = match library
                .get::<unsafe extern "C" fn(*mut c_char, c_int)>(b"MKL_Get_Version_String\0")
            {
                Ok(f) => {
                    f(buf.as_mut_ptr(), buf.len() as c_int - 1);
                    mkl_version(&CStr::from_ptr(buf.as_ptr()).to_string_lossy())
                }
                Err(_) => "Intel MKL".to_string(),
            };
            Some(Blas {
                sgemm,
                bf16,
                description: format!("{version} (sequential, one thread per call)"),
                is_mkl: true,
                _library: library,
            })
        }
    })
}

/// "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build …" → "Intel MKL 2026.2".
fn mkl_version(full: &str) -> String {
    match full.split_once("Version ") {
        Some((_, rest)) => {
            let v = rest.split(|c: char| c == '-' || c.is_whitespace()).next();
            format!("Intel MKL {}", v.unwrap_or_default())
        }
        None => "Intel MKL".to_string(),
    }
}

pub(crate) fn kernel() -> &'static Kernel {
    KERNEL.get_or_init(open)
}

impl Kernel {
    /// For run headers (see [`matmul_kernel`]).
    pub(crate) fn describe(&self) -> String {
        match self {
            Kernel::Blas(blas) => blas.description.clone(),
            Kernel::Portable(isa) => format!("the portable kernel ({}, fixed order)", isa.name()),
            Kernel::Gemm => "the gemm crate".into(),
        }
    }
}

/// What computes matrix products in this process, for run headers and benchmarks: `OpenBLAS
/// 0.3.21 (SkylakeX, one thread per call)`, `Intel MKL 2026.2 (sequential, one thread per
/// call)`, `the portable kernel (AVX-512, fixed order)` or `the gemm crate`; beside a library,
/// `; products by a row-major matrix on the portable kernel (AVX-512), a step's weights packed
/// once` where those products take that route ([`f32_products_keep_packings`]).
pub fn matmul_kernel() -> String {
    match (kernel(), kept_packing_isa()) {
        (Kernel::Portable(_), _) | (_, None) => kernel().describe(),
        (library, Some(isa)) => format!(
            "{}; products by a row-major matrix on the portable kernel ({}), a step's weights \
             packed once",
            library.describe(),
            isa.name()
        ),
    }
}

/// True when this process's products add each element's terms in an order fixed by
/// ferrotext's own code (the portable kernel): then a product's bits do not depend on the
/// processor, the row block or the thread count, and a contraction padded with zero terms has
/// the unpadded bits. False on a BLAS or `gemm`, whose order follows the processor and shape.
pub fn matmul_order_is_fixed() -> bool {
    matches!(kernel(), Kernel::Portable(_))
}

/// The kernel environment variables, checked: `FERROTEXT_MATMUL` names a kernel this build
/// knows (`mkl`, `openblas`, `gemm` or `portable`), `FERROTEXT_F32_KEPT` is `0` or `1`, and
/// `FERROTEXT_PORTABLE_ISA` an instruction set (`avx512`, `avx2` or `scalar`) this processor
/// has, each when set and not empty. A
/// misspelt value would otherwise run the default kernel, and a set the processor lacks
/// another set, without a word.
///
/// # Errors
/// The variable, its value and the values it takes, as one line.
pub fn check_kernel_env() -> Result<(), String> {
    let known = ["mkl", "openblas", "gemm", "portable"];
    match std::env::var("FERROTEXT_MATMUL") {
        Ok(v) if !v.is_empty() && !known.contains(&v.as_str()) => {
            return Err(format!(
                "FERROTEXT_MATMUL={v} names nothing this build knows; it takes {}",
                known.join(", ")
            ));
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(format!(
                "FERROTEXT_MATMUL is not UTF-8; it takes {}",
                known.join(", ")
            ));
        }
        _ => {}
    }
    match std::env::var(KEPT_ENV) {
        Ok(v) if !matches!(v.as_str(), "" | "0" | "1") => {
            return Err(format!(
                "{KEPT_ENV}={v} names nothing this build knows; it takes 0, 1"
            ));
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(format!("{KEPT_ENV} is not UTF-8; it takes 0, 1"));
        }
        _ => {}
    }
    crate::isa::forced().map(|_| ())
}

/// The environment variable that turns the kept-packing route off (`0`) or on (`1`).
const KEPT_ENV: &str = "FERROTEXT_F32_KEPT";

/// The instruction set of the portable kernel's route for `f32` products by a row-major matrix
/// (`crate::matmul::kept`: a layer's `x·W` and `dy·Wᵀ`), which reads the right operand's
/// panels from its kept packings where it keeps them ([`crate::Tensor::keeping_packings`]: a
/// step's weights, packed once); `None` where those products run on the process's kernel.
///
/// `FERROTEXT_F32_KEPT=0|1` decides; unset, the route runs on the portable kernel (the same
/// bits, without packing a weight again) and beside a BLAS the process chose itself where
/// [`kept_by_default`] says so. A BLAS the user named (`FERROTEXT_MATMUL`) computes every
/// product. The route is chosen by the product's layout alone, never by whether an operand
/// keeps packings, so keeping them (a step of several micro-batches without
/// rematerialization) changes no bit.
pub(crate) fn kept_packing_isa() -> Option<Isa> {
    static CHOSEN: OnceLock<Option<Isa>> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let isa = match kernel() {
            Kernel::Portable(isa) => *isa,
            _ => Isa::detect(),
        };
        match std::env::var(KEPT_ENV).as_deref() {
            Ok("0") => None,
            Ok("1") => Some(isa),
            _ => match kernel() {
                Kernel::Portable(isa) => Some(*isa),
                _ if std::env::var("FERROTEXT_MATMUL").is_ok_and(|v| !v.is_empty()) => None,
                _ => kept_by_default(processor(), isa).then_some(isa),
            },
        }
    })
}

/// Whether a process whose products run on a BLAS it chose (or `gemm`) takes the portable
/// kernel's route for its products by a row-major matrix: on a processor with AVX-512 not made by Intel, with the
/// portable kernel on AVX-512. Measured on a 2-core AMD EPYC (Zen 4) against OpenBLAS 0.3.21's
/// Cooperlake kernel, one thread, the weight packed once (`examples/f32_kept.rs`): qwen3-peer's
/// `x·W` and `dy·Wᵀ` at 128 rows 1.09–1.21×, at 512 rows 1.01–1.12×; qwen3-0.6b's 1.19–1.44×
/// and 1.05–1.19× (docs/performance.md). On a Xeon, MKL's kernel runs two full-width FMA units
/// and was not measured against it, so a Xeon keeps MKL.
pub(crate) fn kept_by_default(p: Processor, isa: Isa) -> bool {
    isa == Isa::Avx512 && p.avx512f && !p.intel
}

/// True when this process's `f32` products keep the packings of a right operand that asks
/// ([`crate::Tensor::keeping_packings`]): a step holding its weights that way holds about
/// twice their size more.
pub fn f32_products_keep_packings() -> bool {
    kept_packing_isa().is_some()
}

/// Makes the portable kernel this process's matrix-product kernel, before any product runs
/// (what `deterministic=true` asks for). Calling it again is harmless.
///
/// # Errors
/// The process already computes its products on another kernel (a product ran first, or
/// `FERROTEXT_MATMUL` named another library): its description.
pub fn use_portable_matmul() -> Result<(), String> {
    let chosen = KERNEL.get_or_init(|| match std::env::var("FERROTEXT_MATMUL") {
        // The user named a kernel: it is theirs, and the caller is told it is not this one.
        Ok(named) if !named.is_empty() && named != "portable" => open(),
        _ => Kernel::Portable(Isa::detect()),
    });
    match chosen {
        Kernel::Portable(_) => Ok(()),
        other => Err(other.describe()),
    }
}

/// An operand's layout for CBLAS (row-major): the transpose flag and leading dimension, when
/// its `rows × cols` elements at strides `(rs, cs)` are a row-major or column-major matrix.
fn cblas_layout(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<(c_int, c_int)> {
    let fits = |v: usize| c_int::try_from(v).ok();
    if cs == 1 && (rows == 1 || rs >= cols.max(1) as isize) {
        let ld = if rows == 1 { cols.max(1) } else { rs as usize };
        return Some((CBLAS_NO_TRANS, fits(ld)?));
    }
    if rs == 1 && (cols == 1 || cs >= rows.max(1) as isize) {
        let ld = if cols == 1 { rows.max(1) } else { cs as usize };
        return Some((CBLAS_TRANS, fits(ld)?));
    }
    None
}

/// The product `p` (`dst = a · b`, or `+=`, per its `store`) on this process's kernel. With
/// `parallelism = Rayon(t)`, `gemm` splits the product itself; a BLAS gets up to `t` row blocks
/// of a product large enough (see [`REGULAR_KERNEL_MIN`]), one call each on the rayon pool.
/// Either way the bits do not depend on `parallelism` or `ldc`.
///
/// # Safety
/// Every element `(i, j)` of `a` (i < m, j < k) and `b` (i < k, j < n) is readable at its
/// offset, and `dst`'s `m` rows of `n` elements `ldc` apart are writable (initialised under
/// [`Store::Accumulate`]), alias neither, and are touched by no one else meanwhile.
pub(crate) unsafe fn sgemm(p: Product, parallelism: gemm::Parallelism) {
    // SAFETY: the caller's contract.
    unsafe { gemm_on(kernel(), p, parallelism) }
}

/// [`sgemm`] on `kernel` for operands of `T` (f32, or bf16 widened): a BLAS's product for `T`
/// when it has one and takes the layouts, else [`Element::without_blas`].
///
/// # Safety
/// As [`sgemm`].
pub(crate) unsafe fn gemm_on<T: Element>(
    kernel: &Kernel,
    p: Product<T>,
    parallelism: gemm::Parallelism,
) {
    if let Some(rows) = row_blocks(kernel, p.m, p.n, p.k, parallelism) {
        let block = |block| {
            // SAFETY: a block of rows of the caller's product.
            unsafe { gemm_on(kernel, block, gemm::Parallelism::None) }
        };
        // SAFETY: the caller's contract; each block writes its own rows of `dst`.
        unsafe { p.for_each_row_block(rows, block) };
        return;
    }
    if let Kernel::Portable(isa) = kernel {
        // SAFETY: the caller's contract, which is the portable kernel's.
        unsafe { portable::gemm(*isa, p) };
        return;
    }
    if let Kernel::Blas(blas) = kernel {
        if let Some(product) = T::cblas(blas) {
            // SAFETY: the caller's contract.
            if unsafe { gemm_blas(product, p) } {
                return;
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { T::without_blas(p, parallelism) }
}

/// How many rows each block of a product split across threads takes, or `None` to make one
/// call. With threads to spare, a BLAS or the portable kernel gets one call per thread on its
/// own rows. The portable kernel's rows of a block are its rows of the whole by construction. A
/// BLAS's blocks are kept far above its small-matrix kernels, so they take the kernel the whole
/// product takes; that its rows then have the whole product's bits is what the libraries here do
/// (the kernel test checks it within a tolerance on every library, bitwise on the portable
/// kernel), not a promise they make.
fn row_blocks(
    kernel: &Kernel,
    m: usize,
    n: usize,
    k: usize,
    parallelism: gemm::Parallelism,
) -> Option<usize> {
    match (parallelism, kernel) {
        (gemm::Parallelism::Rayon(t), Kernel::Blas(_) | Kernel::Portable(_)) => {
            let t = t.min(m / MIN_BLOCK_ROWS);
            // `t > 1` means m ≥ 128 rows, so `rows` ≥ 64; the last block is the smallest.
            let rows = m.div_ceil(t.max(1));
            let smallest = |rows: usize| m - (m.div_ceil(rows) - 1) * rows;
            let big_enough = matches!(kernel, Kernel::Portable(_))
                || smallest(rows) * n * k >= REGULAR_KERNEL_MIN;
            (t > 1 && big_enough).then_some(rows)
        }
        _ => None,
    }
}

/// [`gemm_on`] on an opened BLAS's `product`: false, having done nothing, when the operands'
/// layouts or sizes do not fit CBLAS (the caller then uses [`Element::without_blas`]).
///
/// # Safety
/// As [`gemm_on`]; `product` is a library's CBLAS product for `T`.
unsafe fn gemm_blas<T: Element>(product: Cblas<T>, p: Product<T>) -> bool {
    let Product {
        m,
        n,
        k,
        a,
        b,
        dst,
        ldc,
        store,
    } = p;
    let dims = (
        c_int::try_from(m),
        c_int::try_from(n),
        c_int::try_from(k),
        c_int::try_from(ldc.max(1)),
    );
    if let (Some((ta, lda)), Some((tb, ldb)), (Ok(mi), Ok(ni), Ok(ki), Ok(ldc))) = (
        cblas_layout(m, k, a.rs, a.cs),
        cblas_layout(k, n, b.rs, b.cs),
        dims,
    ) {
        // SAFETY: the caller's contract; the layouts describe exactly the elements it
        // guarantees readable, and `ldc` is `dst`'s row stride.
        unsafe {
            product(
                CBLAS_ROW_MAJOR,
                ta,
                tb,
                mi,
                ni,
                ki,
                1.0,
                a.ptr,
                lda,
                b.ptr,
                ldb,
                if store == Store::Accumulate { 1.0 } else { 0.0 },
                dst,
                ldc,
            );
        }
        return true;
    }
    false
}

/// [`gemm_on`] on the `gemm` crate.
///
/// # Safety
/// As [`gemm_on`].
unsafe fn sgemm_gemm(p: Product, parallelism: gemm::Parallelism) {
    let Product {
        m,
        n,
        k,
        a,
        b,
        dst,
        ldc,
        store,
    } = p;
    // SAFETY: the caller's contract; `dst` is read only under `Store::Accumulate`, when the
    // caller has initialised it (`gemm` then computes `1·dst + 1·a·b`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ldc as isize,
            store == Store::Accumulate,
            a.ptr,
            a.cs,
            a.rs,
            b.ptr,
            b.cs,
            b.rs,
            if store == Store::Accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
pub(crate) mod tests;
