//! The CPU's peak FLOP/s, the figure MFU divides by: what this processor's vector units do,
//! per dtype, probed once per process ([`probe`]), with its description's figures beside it.
//!
//! `peak = cores × the probed FLOP/s of one core`, where
//! - cores: the CPUs this process may run on (`available_parallelism`, which follows affinity
//!   and cgroup limits), divided by the hyper-threads per core when `/proc/cpuinfo` shows SMT
//!   (`siblings` / `cpu cores`): hyper-threads share a core's FMA units;
//! - the probed rate: the fastest `f32` FMA instruction the CPU has (`vfmadd231ps` on 512- or
//!   256-bit registers), and `vdpbf16ps` for bf16 products, timed on every core at once
//!   ([`FmaProbe`]). A table would be wrong on one of the two common AVX-512 designs: an AMD
//!   EPYC (Zen 4) executes a 512-bit FMA in two 256-bit halves, one a cycle; a Xeon Gold or
//!   Platinum has two full-width units, two a cycle. The probe tells them apart, and also
//!   measures the clock the cores really run at (turbo, AVX-512 licences, a hypervisor's), so
//!   the description reads `1 a cycle at 3.40 GHz` or `2 a cycle at 2.10 GHz`.
//! - Where nothing can be probed (not x86_64), or for AMX tiles (which this probe does not
//!   drive), the stated figures count: `cores × FMA units (2) × f32 lanes × 2 × clock`, AMX's
//!   1024 bf16 FLOPs a cycle × clock, with the nominal clock from the first source that has it:
//!   the brand string's "@ x.xxGHz", CPUID leaf 0x16's base frequency,
//!   `/sys/.../cpufreq/base_frequency`, then `/proc/cpuinfo`'s "cpu MHz".
//!
//! The probe measures instructions, not products: the fastest product of `bench kernels`
//! reaches 75–95% of it, and a step's MFU is the rest of the story. [`product_peak`] measures
//! the products themselves (this process's kernel, every core at once), the other figure a
//! run's summary sets its rate against.

mod memory;
mod probe;
mod product;

use std::fmt;

pub use memory::memory_bandwidth;
pub use probe::{snap_units, FmaProbe, Probes};
pub use product::{product_peak, ProductProbe};

/// The CPU's peak and the figures it is made of (see the module docs for their sources).
#[derive(Clone, Debug, PartialEq)]
pub struct CpuPeak {
    /// Physical cores this process may use.
    pub cores: usize,
    /// f32 lanes of the widest vector unit found.
    pub lanes: usize,
    /// The vector extension the lanes come from (`avx512f`, `avx2+fma`, `portable`).
    pub simd: &'static str,
    /// Nominal clock in Hz (the stated figure; the probes carry the measured one).
    pub clock_hz: f64,
    /// Where the nominal clock was read.
    pub clock_source: &'static str,
    /// The CPU has AVX512_BF16: `vdpbf16ps` does two bf16 multiply-adds per f32 lane.
    pub bf16_pairs: bool,
    /// This process's bf16 products run on AMX tiles (MKL's product on a CPU with AMX-BF16),
    /// whose multiply unit does 512 bf16 multiply-adds a cycle per core.
    pub bf16_tiles: bool,
    /// The measured throughput of the `f32` and bf16 instructions ([`FmaProbe`]).
    pub probes: Probes,
}

/// bf16 FLOPs an AMX multiply unit does a cycle: a `tdpbf16ps` is 16 × 16 × 32 multiply-adds
/// every 16 cycles.
const AMX_BF16_FLOPS_PER_CYCLE: f64 = 1024.0;

/// FMA units per core the stated (unprobed) peak assumes: what Intel's server cores with
/// AVX-512 and AVX2 cores have; an upper bound twice the truth on a core with one.
const STATED_FMA_UNITS: usize = 2;

impl CpuPeak {
    /// Peak f32 FLOP/s: cores × the probed rate of one core, else the stated cores × 2 FMA
    /// units × lanes × 2 × nominal clock.
    pub fn flops(&self) -> f64 {
        match self.probes.f32 {
            Some(p) => self.cores as f64 * p.flops_per_core,
            None => self.stated_flops(),
        }
    }

    /// The stated f32 peak (cores × 2 FMA units × lanes × 2 × nominal clock), what the peak was
    /// before it was probed: an upper bound on a core whose FMA units are narrower.
    pub fn stated_flops(&self) -> f64 {
        (self.cores * STATED_FMA_UNITS * self.lanes * 2) as f64 * self.clock_hz
    }

    /// Peak bf16 × bf16 → f32 FLOP/s: the AMX unit's (cores × 1024 × clock, stated) where the
    /// products run on tiles; else cores × the probed `vdpbf16ps` rate; else (unprobed) twice
    /// [`CpuPeak::flops`] where `vdpbf16ps` exists, else the f32 peak (the products run on
    /// widened operands).
    pub fn bf16_flops(&self) -> f64 {
        if self.bf16_tiles {
            self.cores as f64 * AMX_BF16_FLOPS_PER_CYCLE * self.clock_hz
        } else if let (Some(p), true) = (self.probes.bf16, self.bf16_pairs) {
            self.cores as f64 * p.flops_per_core
        } else if self.bf16_pairs {
            2.0 * self.flops()
        } else {
            self.flops()
        }
    }

    /// The peak of products in `bf16` (true) or `f32`, FLOP/s.
    pub fn flops_for(&self, bf16: bool) -> f64 {
        if bf16 {
            self.bf16_flops()
        } else {
            self.flops()
        }
    }

    /// The peak for products in `bf16` (true) or `f32`, as a sentence for a run's summary.
    pub fn describe_for(&self, bf16: bool) -> String {
        if !bf16 {
            return self.to_string();
        }
        if self.bf16_tiles {
            return format!(
                "{:.1} GFLOP/s bf16 = {} cores × 1024 FLOP a cycle (AMX tiles, MKL's bf16 \
                 product; stated, not probed) × {:.3} GHz ({}); the f32 peak is {self}",
                self.bf16_flops() / 1e9,
                self.cores,
                self.clock_hz / 1e9,
                self.clock_source
            );
        }
        match (self.probes.bf16, self.bf16_pairs) {
            (Some(p), true) => format!(
                "{:.1} GFLOP/s bf16 = {} cores × {}",
                self.bf16_flops() / 1e9,
                self.cores,
                describe_probe(&p)
            ),
            (None, true) => format!(
                "{:.1} GFLOP/s bf16 = 2 × the f32 peak {self} (AVX512_BF16: two multiply-adds per lane)",
                self.bf16_flops() / 1e9
            ),
            (_, false) => format!("{self} (no AVX512_BF16: bf16 products run at the f32 rate)"),
        }
    }
}

/// `107.5 GFLOP/s probed (vfmadd231ps zmm (avx512f): 1 a cycle × 32 FLOP at 3.36 GHz measured)`.
fn describe_probe(p: &FmaProbe) -> String {
    format!(
        "{:.1} GFLOP/s probed ({}: {} a cycle × {} FLOP at {:.2} GHz measured)",
        p.flops_per_core / 1e9,
        p.instruction,
        p.units(),
        p.flops_per_instruction,
        p.clock_hz / 1e9
    )
}

impl fmt::Display for CpuPeak {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.probes.f32 {
            Some(p) => write!(
                f,
                "{:.1} GFLOP/s = {} cores × {} (the stated {} FMA units × {} lanes at {:.3} GHz would say {:.1})",
                self.flops() / 1e9,
                self.cores,
                describe_probe(&p),
                STATED_FMA_UNITS,
                self.lanes,
                self.clock_hz / 1e9,
                self.stated_flops() / 1e9
            ),
            None => write!(
                f,
                "{:.1} GFLOP/s = {} cores × {} FMA units × {} f32 lanes ({}) × 2 × {:.3} GHz ({}; stated, not probed)",
                self.flops() / 1e9,
                self.cores,
                STATED_FMA_UNITS,
                self.lanes,
                self.simd,
                self.clock_hz / 1e9,
                self.clock_source
            ),
        }
    }
}

/// The peak of the CPUs this process may use: their description read from `/proc/cpuinfo` and
/// CPUID, and their FMA throughput probed on the first call ([`FmaProbe`], about 20 ms on an idle
/// machine; later calls reuse it). Never fails (a clock it cannot find is taken as 2 GHz and
/// says so in `clock_source`; a CPU without a probe gets the stated figures).
pub fn cpu_peak() -> CpuPeak {
    let stated = stated_peak();
    CpuPeak {
        probes: *probe::probed(stated.cores),
        ..stated
    }
}

/// The value of `/proc/cpuinfo`'s first line named `key` (the first processor's), trimmed.
fn cpuinfo_field<'a>(cpuinfo: &'a str, key: &str) -> Option<&'a str> {
    cpuinfo.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim())
    })
}

/// This processor as Linux names it (`/proc/cpuinfo`'s `model name`), or `None` where it says
/// none.
pub fn processor_name() -> Option<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    cpuinfo_field(&cpuinfo, "model name").map(str::to_string)
}

/// The peak from the CPU's description alone, nothing probed.
fn stated_peak() -> CpuPeak {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| cpuinfo_field(&cpuinfo, key);
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
        probes: Probes::default(),
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
    fn the_peak_is_the_probe_times_the_cores_and_stable() {
        let p = cpu_peak();
        assert!(p.cores >= 1 && p.lanes >= 4 && p.clock_hz > 1e8, "{p}");
        match p.probes.f32 {
            Some(f) => assert_eq!(p.flops(), p.cores as f64 * f.flops_per_core),
            None => assert_eq!(p.flops(), p.stated_flops()),
        }
        assert_eq!(
            p.stated_flops(),
            (p.cores * 2 * p.lanes * 2) as f64 * p.clock_hz
        );
        // (Whether bf16 products run on tiles follows the process's bf16 kernel, which another
        // test may fix meanwhile.)
        let again = CpuPeak {
            bf16_tiles: p.bf16_tiles,
            ..cpu_peak()
        };
        assert_eq!(
            again, p,
            "the probe runs once a process: reading it twice gives the same"
        );
        assert!(p.to_string().contains("GFLOP/s"));
    }

    /// The probe reads what the FMA units do, so no product runs faster than it: measured in
    /// alternation with this process's `f32` product on one core, the best product is below
    /// the best probe (with 10% for noise; a sound probe sits 5–25% above the product). A probe
    /// loop whose chains spill to the stack reads low: with 16 AVX2 chains an AMD EPYC (Zen 1)
    /// probed 26 GFLOP/s a core against a product's 38, and this fails.
    #[test]
    fn no_product_outruns_the_probe() {
        let (mut probed, mut product) = (0.0f64, 0.0f64);
        for _ in 0..3 {
            if let Some(f) = probe::measure(1).f32 {
                probed = probed.max(f.flops_per_core);
            }
            let p = product::measure(false, 1).expect("the f32 product runs everywhere");
            product = product.max(p.flops);
        }
        if probed == 0.0 {
            crate::report_skipped(
                "tensor peak::tests::no_product_outruns_the_probe",
                "this processor has no FMA probe",
            );
            return;
        }
        assert!(
            product <= 1.1 * probed,
            "the product ({}) ran at {:.1} GFLOP/s, the probe read {:.1}",
            crate::matmul_kernel(),
            product / 1e9,
            probed / 1e9
        );
    }

    /// A probe of `units` instructions a cycle of `flops` FLOPs each at `ghz`, 2% slow (what a
    /// timed loop finds).
    fn probe(instruction: &'static str, flops: usize, units: f64, ghz: f64) -> FmaProbe {
        FmaProbe {
            instruction,
            flops_per_instruction: flops,
            flops_per_core: 0.98 * units * flops as f64 * ghz * 1e9,
            clock_hz: ghz * 1e9,
        }
    }

    /// Two AVX-512 designs with one description: both report AVX-512F and AVX512_BF16, 16
    /// lanes; the probe tells them apart.
    ///
    /// | CPU | `vfmadd231ps zmm` a cycle | `vdpbf16ps zmm` a cycle | measured clock |
    /// |---|---|---|---|
    /// | AMD EPYC (Zen 4): 512-bit ops in two 256-bit halves | 1 | 1 | 3.40 GHz |
    /// | Intel Xeon Platinum 8380H (Cooper Lake): two 512-bit FMA units | 2 | 2 | 2.90 GHz |
    #[test]
    fn the_probe_tells_a_split_512_bit_fma_from_two_full_units() {
        let described = |probes| CpuPeak {
            cores: 2,
            lanes: 16,
            simd: "avx512f",
            clock_hz: 2.6e9,
            clock_source: "test",
            bf16_pairs: true,
            bf16_tiles: false,
            probes,
        };
        let epyc = described(Probes {
            f32: Some(probe("vfmadd231ps zmm (avx512f)", 32, 1.0, 3.4)),
            bf16: Some(probe("vdpbf16ps zmm (avx512_bf16)", 64, 1.0, 3.4)),
        });
        let xeon = described(Probes {
            f32: Some(probe("vfmadd231ps zmm (avx512f)", 32, 2.0, 2.9)),
            bf16: Some(probe("vdpbf16ps zmm (avx512_bf16)", 64, 2.0, 2.9)),
        });
        // The same stated peak: 2 cores × 2 units × 16 lanes × 2 × 2.6 GHz.
        assert_eq!(epyc.stated_flops(), 332.8e9);
        assert_eq!(xeon.stated_flops(), epyc.stated_flops());
        // Probed: 2 cores × 0.98 × 1 × 32 × 3.4 GHz, and × 2 × 32 × 2.9 GHz.
        let near = |a: f64, b: f64| (a - b).abs() < 1e-3 * b;
        assert!(near(epyc.flops(), 2.0 * 0.98 * 32.0 * 3.4e9));
        assert!(near(xeon.flops(), 2.0 * 0.98 * 64.0 * 2.9e9));
        assert!(near(epyc.bf16_flops(), 2.0 * epyc.flops()));
        assert!(near(xeon.bf16_flops(), 2.0 * xeon.flops()));
        assert_eq!(epyc.probes.f32.map(|p| p.units()), Some(1.0));
        assert_eq!(xeon.probes.f32.map(|p| p.units()), Some(2.0));
        assert!(epyc
            .to_string()
            .contains("1 a cycle × 32 FLOP at 3.40 GHz measured"));
        assert!(xeon
            .to_string()
            .contains("2 a cycle × 32 FLOP at 2.90 GHz measured"));
        assert!(epyc
            .to_string()
            .starts_with("213.2 GFLOP/s = 2 cores × 106.6 GFLOP/s probed"));
        let text = epyc.describe_for(true);
        assert!(
            text.starts_with("426.5 GFLOP/s bf16 = 2 cores × 213.2 GFLOP/s probed (vdpbf16ps"),
            "{text}"
        );
        assert_eq!(epyc.flops_for(true), epyc.bf16_flops());
        assert_eq!(epyc.flops_for(false), epyc.flops());
    }

    #[test]
    fn unprobed_the_stated_figures_count_and_bf16_doubles_only_with_avx512_bf16() {
        let with = CpuPeak {
            cores: 2,
            lanes: 16,
            simd: "avx512f",
            clock_hz: 2.5e9,
            clock_source: "test",
            bf16_pairs: true,
            bf16_tiles: false,
            probes: Probes::default(),
        };
        // 2 cores × 2 units × 16 lanes × 2 FLOP × 2.5 GHz = 320 GFLOP/s f32, 640 bf16.
        assert_eq!(with.flops(), 320e9);
        assert_eq!(with.bf16_flops(), 640e9);
        let without = CpuPeak {
            bf16_pairs: false,
            ..with.clone()
        };
        assert_eq!(without.bf16_flops(), 320e9);
        assert!(with.describe_for(true).starts_with("640.0 GFLOP/s bf16"));
        assert!(with.to_string().contains("stated, not probed"));
        assert!(without.describe_for(true).contains("no AVX512_BF16"));
        assert_eq!(with.describe_for(false), with.to_string());
        // On AMX tiles: 2 cores × 1024 FLOP a cycle × 2.5 GHz, stated even when probed.
        let tiles = CpuPeak {
            bf16_tiles: true,
            probes: Probes {
                f32: Some(probe("vfmadd231ps zmm (avx512f)", 32, 2.0, 2.5)),
                bf16: Some(probe("vdpbf16ps zmm (avx512_bf16)", 64, 2.0, 2.5)),
            },
            ..with.clone()
        };
        assert_eq!(tiles.bf16_flops(), 5120e9);
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
