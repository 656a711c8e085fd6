//! Which kernel computes this process's bf16 × bf16 → f32 products, chosen once (the rules are
//! in `matmul.rs`'s module docs): from the `f32` kernel, what the user named, whether a fallback
//! was allowed, and what the CPU has (AVX512_BF16, AMX tiles the OS lets programs use).

use std::sync::OnceLock;

use crate::blas::{kernel, Kernel};
use crate::error::TensorError;
use crate::portable::Isa;

/// Which kernel computes this process's bf16 products.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// The library's own bf16 product: its description and the symbol.
    Library(String, &'static str),
    /// ferrotext's AVX512_BF16 kernel, in place of the library's product (its description) or
    /// of a library without one.
    Own(String),
    /// The portable kernel, widening bf16 to f32: because it is the process's kernel (`None`),
    /// or in place of a kernel without a bf16 product (its description).
    Portable(Isa, Option<String>),
    /// A kernel without a bf16 product that the user named: its description.
    Refused(String),
}

impl Choice {
    pub(super) fn describe(&self) -> Result<String, TensorError> {
        match self {
            Choice::Library(what, symbol) => Ok(format!("{what}: {symbol}")),
            Choice::Own(instead) => Ok(format!(
                "ferrotext's AVX512_BF16 kernel (vdpbf16ps, one thread per call), for {instead}"
            )),
            Choice::Portable(isa, None) => Ok(format!(
                "the portable kernel ({}, fixed order), bf16 widened to f32",
                isa.name()
            )),
            Choice::Portable(isa, Some(instead)) => Ok(format!(
                "the portable kernel ({}, fixed order), bf16 widened to f32, as {instead} has no \
                 bf16 product",
                isa.name()
            )),
            Choice::Refused(kernel) => Err(TensorError::NoBf16Product {
                kernel: kernel.clone(),
            }),
        }
    }
}

/// What this CPU offers bf16 products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cpu {
    /// AVX512_BF16, which ferrotext's own kernel needs.
    pub(crate) avx512_bf16: bool,
    /// AMX tiles with bf16 (and the OS saving their state), which MKL's bf16 product uses.
    pub(crate) amx_bf16: bool,
}

/// The bf16 kernel for the process's `f32` kernel: `named` says the user chose that kernel
/// (`FERROTEXT_MATMUL`), `fallback` that they allow another in its place.
pub(crate) fn choose(kernel: &Kernel, named: bool, fallback: bool, cpu: Cpu) -> Choice {
    let own = cpu.avx512_bf16;
    let (library, on_tiles) = match kernel {
        Kernel::Portable(isa) => return Choice::Portable(*isa, None),
        Kernel::Blas(blas) => (
            blas.bf16
                .map(|(_, symbol)| (blas.description.clone(), symbol)),
            cpu.amx_bf16 && blas.is_mkl,
        ),
        Kernel::Gemm => (None, false),
    };
    match library {
        Some((what, symbol)) if named || !own || on_tiles => Choice::Library(what, symbol),
        None if named && !fallback => Choice::Refused(kernel.describe()),
        _ if own => Choice::Own(kernel.describe()),
        _ => Choice::Portable(Isa::detect(), Some(kernel.describe())),
    }
}

/// What this CPU offers bf16 products, found once per process: CPUID traps to the hypervisor
/// in a virtual machine (tens of µs), and a product asks on every call (`bands_keep_bits`).
pub(super) fn cpu() -> Cpu {
    static CPU: OnceLock<Cpu> = OnceLock::new();
    *CPU.get_or_init(detect_cpu)
}

/// [`cpu`], asked of the processor (and of `MKL_ENABLE_INSTRUCTIONS`, which MKL reads once too).
fn detect_cpu() -> Cpu {
    #[cfg(target_arch = "x86_64")]
    {
        Cpu {
            avx512_bf16: super::dpbf16::available(),
            amx_bf16: amx_bf16() && mkl_may_use_tiles(),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Cpu {
            avx512_bf16: false,
            amx_bf16: false,
        }
    }
}

/// True when the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and the OS
/// saves the tile state (XCR0 bits 17 and 18, set by Linux 5.16 on). std's feature detection
/// for AMX is not stable yet, hence CPUID here.
#[cfg(target_arch = "x86_64")]
fn amx_bf16() -> bool {
    use std::arch::x86_64::__cpuid_count;
    let (max_leaf, leaf1) = (__cpuid_count(0, 0).eax, __cpuid_count(1, 0));
    let osxsave = leaf1.ecx & (1 << 27) != 0;
    if max_leaf < 7 || !osxsave {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    let tiles = edx & (1 << 24) != 0 && edx & (1 << 22) != 0;
    // SAFETY: OSXSAVE is set, so XGETBV may be executed.
    tiles && unsafe { xcr0() } & (0b11 << 17) == 0b11 << 17
}

/// False when `MKL_ENABLE_INSTRUCTIONS` caps MKL below AMX (`AVX2`, `AVX512`, …): MKL then runs
/// bf16 products without tiles. AMX comes with `AVX512_E4` and later.
#[cfg(target_arch = "x86_64")]
fn mkl_may_use_tiles() -> bool {
    match std::env::var("MKL_ENABLE_INSTRUCTIONS") {
        Ok(v) if !v.is_empty() => ["AVX512_E4", "AVX512_E5", "AVX10"]
            .iter()
            .any(|with_tiles| v.eq_ignore_ascii_case(with_tiles)),
        _ => true,
    }
}

/// The XCR0 register (which state components the OS saves).
///
/// # Safety
/// CPUID.1:ECX.OSXSAVE is set.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: the caller's contract (XGETBV is enabled).
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

static CHOICE: OnceLock<Choice> = OnceLock::new();

/// True when `FERROTEXT_MATMUL` names a kernel.
fn named() -> bool {
    std::env::var("FERROTEXT_MATMUL").is_ok_and(|v| !v.is_empty())
}

pub(super) fn choice(fallback: bool) -> &'static Choice {
    CHOICE.get_or_init(|| choose(kernel(), named(), fallback, cpu()))
}

/// What computes this process's bf16 products, for run headers and benchmarks: `ferrotext's
/// AVX512_BF16 kernel (…)`, `Intel MKL 2026.2 (sequential, one thread per call):
/// cblas_gemm_bf16bf16f32`, or the portable kernel (saying which kernel it stands in for).
///
/// # Errors
/// [`TensorError::NoBf16Product`]: `FERROTEXT_MATMUL` named a kernel without a bf16 product
/// and [`allow_bf16_fallback`] was not called first.
pub fn bf16_matmul_kernel() -> Result<String, TensorError> {
    choice(false).describe()
}

/// True when this process's bf16 products pack their right operand in a form a tensor can keep
/// (`Bf16Tensor::keeping_packings`): ferrotext's AVX512_BF16 kernel was chosen. The choice is
/// read, not made: `false` before the first bf16 product (or [`bf16_matmul_kernel`]) fixes it.
pub fn bf16_products_keep_packings() -> bool {
    matches!(CHOICE.get(), Some(Choice::Own(_)))
}

/// True when this process's bf16 products run on AMX tiles: MKL's product was chosen (the
/// choice is read, not made) and the CPU has AMX-BF16. For the peak
/// ([`crate::cpu_peak`]).
pub(crate) fn products_on_tiles() -> bool {
    matches!(CHOICE.get(), Some(Choice::Library(..)))
        && cpu().amx_bf16
        && matches!(kernel(), Kernel::Blas(blas) if blas.is_mkl)
}

/// Lets bf16 products run on another kernel (AVX512_BF16 or portable) when `FERROTEXT_MATMUL`
/// named a kernel that has no bf16 product (what a user asks for explicitly). Call it before
/// any bf16 product; calling it again is harmless. Returns what will compute bf16 products.
///
/// # Errors
/// [`TensorError::NoBf16Product`]: a bf16 product (or [`bf16_matmul_kernel`]) already fixed
/// the choice as refused.
pub fn allow_bf16_fallback() -> Result<String, TensorError> {
    choice(true).describe()
}

#[cfg(test)]
mod tests;
