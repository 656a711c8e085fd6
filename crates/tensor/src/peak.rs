//! The CPU's stated peak FLOP/s: a number read from the hardware description, not measured, so
//! it does not move with how busy the machine is.
//!
//! `peak = cores × FMA units × f32 lanes × 2 (an FMA is two FLOPs) × clock`, where
//! - cores: the CPUs this process may run on (`available_parallelism`, which follows affinity
//!   and cgroup limits), divided by the hyper-threads per core when `/proc/cpuinfo` shows SMT
//!   (`siblings` / `cpu cores`): hyper-threads share a core's FMA units;
//! - lanes: the widest vector unit `is_x86_feature_detected!` finds (AVX-512F: 16, AVX2 with
//!   FMA: 8, otherwise 4);
//! - FMA units: 2 per core. That is what Intel's server cores with AVX-512 (Skylake-SP
//!   Gold/Platinum onwards, Cooper Lake, Ice Lake-SP, Sapphire Rapids) and AVX2 cores have; a part
//!   with one 512-bit port makes this an upper bound twice its true peak;
//! - clock: the nominal clock, from the first source that has it: the brand string's
//!   "@ x.xxGHz", CPUID leaf 0x16's base frequency, `/sys/.../cpufreq/base_frequency`, then
//!   `/proc/cpuinfo`'s "cpu MHz" (under a hypervisor, the clock it states). Turbo and AVX-512
//!   frequency licences are ignored.
//!
//! The achieved gemm rate is a different number, measured by the `bench kernels` command.

use std::fmt;

/// The CPU's stated peak and the figures it is made of (see the module docs for their sources).
#[derive(Clone, Debug, PartialEq)]
pub struct CpuPeak {
    /// Physical cores this process may use.
    pub cores: usize,
    /// FMA units per core (assumed 2).
    pub fma_units: usize,
    /// f32 lanes of the widest vector unit found.
    pub lanes: usize,
    /// The vector extension the lanes come from (`avx512f`, `avx2+fma`, `portable`).
    pub simd: &'static str,
    /// Nominal clock in Hz.
    pub clock_hz: f64,
    /// Where the clock was read.
    pub clock_source: &'static str,
    /// The CPU has AVX512_BF16: `vdpbf16ps` does two bf16 multiply-adds per f32 lane.
    pub bf16_pairs: bool,
    /// This process's bf16 products run on AMX tiles (MKL's product on a CPU with AMX-BF16),
    /// whose multiply unit does 512 bf16 multiply-adds a cycle per core.
    pub bf16_tiles: bool,
}

/// bf16 FLOPs an AMX multiply unit does a cycle: a `tdpbf16ps` is 16 × 16 × 32 multiply-adds
/// every 16 cycles.
const AMX_BF16_FLOPS_PER_CYCLE: f64 = 1024.0;

impl CpuPeak {
    /// Peak f32 FLOP/s: cores × FMA units × lanes × 2 × clock.
    pub fn flops(&self) -> f64 {
        (self.cores * self.fma_units * self.lanes * 2) as f64 * self.clock_hz
    }

    /// Peak bf16 × bf16 → f32 FLOP/s: the AMX unit's (cores × 1024 × clock) where the products
    /// run on tiles, else twice [`CpuPeak::flops`] where `vdpbf16ps` exists (two multiply-adds
    /// per lane per instruction, on the same FMA units), else the f32 peak (the products run on
    /// widened operands).
    pub fn bf16_flops(&self) -> f64 {
        if self.bf16_tiles {
            self.cores as f64 * AMX_BF16_FLOPS_PER_CYCLE * self.clock_hz
        } else if self.bf16_pairs {
            2.0 * self.flops()
        } else {
            self.flops()
        }
    }

    /// The peak for products in `bf16` (true) or `f32`, as a sentence for a run's summary.
    pub fn describe_for(&self, bf16: bool) -> String {
        match (bf16, self.bf16_pairs) {
            (false, _) => self.to_string(),
            (true, _) if self.bf16_tiles => format!(
                "{:.1} GFLOP/s bf16 = {} cores × 1024 FLOP a cycle (AMX tiles, MKL's bf16 \
                 product) × {:.3} GHz ({}); the f32 peak is {self}",
                self.bf16_flops() / 1e9,
                self.cores,
                self.clock_hz / 1e9,
                self.clock_source
            ),
            (true, true) => format!(
                "{:.1} GFLOP/s bf16 = 2 × the f32 peak {self} (AVX512_BF16: two multiply-adds per lane)",
                self.bf16_flops() / 1e9
            ),
            (true, false) => format!("{self} (no AVX512_BF16: bf16 products run at the f32 rate)"),
        }
    }
}

impl fmt::Display for CpuPeak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.1} GFLOP/s = {} cores × {} FMA units × {} f32 lanes ({}) × 2 × {:.3} GHz ({})",
            self.flops() / 1e9,
            self.cores,
            self.fma_units,
            self.lanes,
            self.simd,
            self.clock_hz / 1e9,
            self.clock_source
        )
    }
}

/// The stated peak of the CPUs this process may use. Reads `/proc/cpuinfo` and CPUID once per
/// call; never fails (a clock it cannot find is taken as 2 GHz and says so in `clock_source`).
pub fn cpu_peak() -> CpuPeak {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| -> Option<&str> {
        cpuinfo.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim())
        })
    };
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let smt = match (
        field("siblings").and_then(|v| v.parse::<usize>().ok()),
        field("cpu cores").and_then(|v| v.parse::<usize>().ok()),
    ) {
        (Some(s), Some(c)) if c > 0 && s >= c => s / c,
        _ => 1,
    };
    let (lanes, simd) = simd_lanes();
    let (clock_hz, clock_source) = field("model name")
        .and_then(brand_clock)
        .map(|hz| (hz, "brand string"))
        .or_else(|| cpuid_base_clock().map(|hz| (hz, "CPUID leaf 0x16")))
        .or_else(|| {
            std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/base_frequency")
                .ok()
                .and_then(|s| s.trim().parse::<f64>().ok())
                .map(|khz| (khz * 1e3, "cpufreq base_frequency"))
        })
        .or_else(|| {
            field("cpu MHz")
                .and_then(|v| v.parse::<f64>().ok())
                .map(|mhz| (mhz * 1e6, "/proc/cpuinfo cpu MHz"))
        })
        .unwrap_or((2e9, "unknown, 2 GHz assumed"));
    CpuPeak {
        bf16_pairs: has_bf16_pairs(),
        bf16_tiles: crate::bf16::products_on_tiles(),
        cores: logical.div_ceil(smt).max(1),
        fma_units: 2,
        lanes,
        simd,
        clock_hz,
        clock_source,
    }
}

/// "Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz" → 2.1e9.
fn brand_clock(name: &str) -> Option<f64> {
    let at = name.rsplit_once('@')?.1.trim();
    let ghz = at.strip_suffix("GHz")?.trim().parse::<f64>().ok()?;
    (ghz > 0.0).then_some(ghz * 1e9)
}

#[cfg(target_arch = "x86_64")]
fn simd_lanes() -> (usize, &'static str) {
    if is_x86_feature_detected!("avx512f") {
        (16, "avx512f")
    } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        (8, "avx2+fma")
    } else {
        (4, "sse")
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn simd_lanes() -> (usize, &'static str) {
    (4, "portable")
}

#[cfg(target_arch = "x86_64")]
fn has_bf16_pairs() -> bool {
    is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_bf16_pairs() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn cpuid_base_clock() -> Option<f64> {
    use std::arch::x86_64::__cpuid;
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86_64 CPU; leaf 0 reports the highest leaf, and leaf 0x16
    // is read only when it is at most that.
    let max = unsafe { __cpuid(0) }.eax;
    if max < 0x16 {
        return None;
    }
    #[allow(unused_unsafe)]
    // SAFETY: as above, leaf 0x16 is supported.
    let mhz = unsafe { __cpuid(0x16) }.eax & 0xffff;
    (mhz > 0).then_some(f64::from(mhz) * 1e6)
}

#[cfg(not(target_arch = "x86_64"))]
fn cpuid_base_clock() -> Option<f64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_the_product_of_its_parts_and_stable() {
        let p = cpu_peak();
        assert!(p.cores >= 1 && p.lanes >= 4 && p.clock_hz > 1e8, "{p}");
        let want = (p.cores * 2 * p.lanes * 2) as f64 * p.clock_hz;
        assert_eq!(p.flops(), want);
        // (Whether bf16 products run on tiles follows the process's bf16 kernel, which another
        // test may fix meanwhile.)
        let again = CpuPeak {
            bf16_tiles: p.bf16_tiles,
            ..cpu_peak()
        };
        assert_eq!(again, p, "reading it twice gives the same peak");
        assert!(p.to_string().contains("GFLOP/s"));
    }

    #[test]
    fn the_bf16_peak_doubles_only_with_avx512_bf16() {
        let with = CpuPeak {
            cores: 2,
            fma_units: 2,
            lanes: 16,
            simd: "avx512f",
            clock_hz: 2.5e9,
            clock_source: "test",
            bf16_pairs: true,
            bf16_tiles: false,
        };
        // 2 cores × 2 units × 16 lanes × 2 FLOP × 2.5 GHz = 320 GFLOP/s f32, 640 bf16.
        assert_eq!(with.flops(), 320e9);
        assert_eq!(with.bf16_flops(), 640e9);
        let without = CpuPeak {
            bf16_pairs: false,
            ..with
        };
        assert_eq!(without.bf16_flops(), 320e9);
        assert!(with.describe_for(true).starts_with("640.0 GFLOP/s bf16"));
        assert!(without.describe_for(true).contains("no AVX512_BF16"));
        assert_eq!(with.describe_for(false), with.to_string());
        // On AMX tiles: 2 cores × 1024 FLOP a cycle × 2.5 GHz.
        let tiles = CpuPeak {
            bf16_tiles: true,
            ..with.clone()
        };
        assert_eq!(tiles.bf16_flops(), 5120e9);
        assert_eq!(tiles.flops(), with.flops());
        assert!(tiles.describe_for(true).starts_with("5120.0 GFLOP/s bf16"));
        assert!(tiles.describe_for(true).contains("AMX"));
    }

    #[test]
    fn brand_strings_give_their_nominal_clock() {
        assert_eq!(
            brand_clock("Intel(R) Xeon(R) Gold 6230 CPU @ 2.10GHz"),
            Some(2.1e9)
        );
        assert_eq!(brand_clock("Intel(R) Xeon(R) Processor"), None);
        assert_eq!(brand_clock("AMD EPYC 9654 96-Core Processor"), None);
    }
}
