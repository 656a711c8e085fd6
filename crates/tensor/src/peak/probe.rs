//! The FMA throughput probe: what one core's vector units do a second, measured, for the peak
//! the MFU divides by ([`super::CpuPeak`]).
//!
//! A table cannot know that an AMD EPYC (Zen 4) runs a 512-bit FMA as two 256-bit halves (one
//! `vfmadd231ps zmm` a cycle) while a Xeon Gold has two full 512-bit units (two a cycle): both
//! report AVX-512F. So each instruction a product may run on is timed in a loop of independent
//! accumulator chains, at least the FMA latency × units of any x86 core (10 at most: Haswell's
//! 5 cycles × 2 units), so the loop is bound by throughput, never latency, and few enough that
//! the chains and the loop's two constants stay in registers: [`ZMM_CHAINS`] of AVX-512's 32,
//! [`YMM_CHAINS`] of AVX2's 16 (with 16 the compiler spilled two chains to the stack and
//! shuffled the rest through moves, and an AMD EPYC (Zen 1) probed 26 GFLOP/s a core where its
//! products ran at 38). The loops run on every core at once (all-core clocks, not one
//! core's boost), best of [`WINDOWS`] short windows per core: a window another process
//! preempted is slower, never faster, so the best one is what the core does when it is ours.
//! The clock is measured the same way, by a chain of dependent register adds (one cycle each on
//! every x86 core), and only *explains* the rate: `units = rate ÷ (clock × FLOPs an
//! instruction does)`, snapped to the nearest half ([`snap_units`]).
//!
//! Where the time goes: [`WINDOWS`] × ~100 µs per instruction and per core, about 20 ms per
//! probe on an idle machine; [`probed`] runs it once per process.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Windows timed per instruction and per core; the best one counts.
pub(crate) const WINDOWS: usize = 40;

/// How long one window should last once calibrated.
const WINDOW: Duration = Duration::from_micros(100);

/// Dependent adds an iteration of [`clock_loop`].
const CLOCK_ADDS: usize = 64;

/// Independent accumulator chains in the AVX-512 probe loops (of 32 registers).
const ZMM_CHAINS: usize = 16;

/// Independent accumulator chains in the AVX2 probe loop (of 16 registers: 2 hold constants).
const YMM_CHAINS: usize = 12;

/// One instruction's measured throughput on this machine's cores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FmaProbe {
    /// The instruction and the extension it needs (`vfmadd231ps zmm (avx512f)`).
    pub instruction: &'static str,
    /// FLOPs one instruction does: 2 per lane for an FMA, 4 per lane for `vdpbf16ps` (two
    /// multiply-adds per `f32` lane).
    pub flops_per_instruction: usize,
    /// The best FLOP/s of one core, the mean over the cores probed at once.
    pub flops_per_core: f64,
    /// The clock measured on the same cores (a dependent add chain), Hz.
    pub clock_hz: f64,
}

impl FmaProbe {
    /// Instructions a cycle per core: the measured rate over the measured clock.
    pub fn per_cycle(&self) -> f64 {
        self.flops_per_core / (self.clock_hz * self.flops_per_instruction as f64)
    }

    /// Full-width units this rate amounts to ([`snap_units`] of [`FmaProbe::per_cycle`]).
    pub fn units(&self) -> f64 {
        snap_units(self.per_cycle())
    }
}

/// Instructions a cycle, snapped to the nearest half (at least a half): a Zen 4's
/// `vfmadd231ps zmm` runs at 1 a cycle (two 256-bit halves), a Xeon Gold's at 2, and a core
/// that splits an instruction over two cycles at 0.5. Timer and clock noise of a few percent
/// does not move the snapped figure.
pub fn snap_units(per_cycle: f64) -> f64 {
    ((per_cycle * 2.0).round() / 2.0).max(0.5)
}

/// The probes of this machine, measured on the first call on `cores` threads and kept for the
/// process: the best `f32` FMA (AVX-512F, else AVX2) and `vdpbf16ps` where the CPU has it.
/// Empty on processors without a probe (not x86_64, or no FMA).
pub(crate) fn probed(cores: usize) -> &'static Probes {
    static PROBES: OnceLock<Probes> = OnceLock::new();
    PROBES.get_or_init(|| measure(cores))
}

/// The probes of one machine.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Probes {
    /// The fastest `f32` FMA found.
    pub f32: Option<FmaProbe>,
    /// `vdpbf16ps zmm`, where the CPU has AVX512_BF16.
    pub bf16: Option<FmaProbe>,
}

/// A loop over probe instructions: runs `iters` iterations, returns something depending on
/// every result (so nothing is optimised away).
type Kernel = fn(usize) -> f32;

/// One instruction to probe: its name, FLOPs per instruction, the instructions an iteration of
/// its loop runs (its chains), and its loop.
type Candidate = (&'static str, usize, usize, Kernel);

pub(super) fn measure(cores: usize) -> Probes {
    let cores = cores.max(1);
    let (f32_candidates, bf16_candidate) = candidates();
    let all: Vec<Candidate> = f32_candidates
        .iter()
        .copied()
        .chain(bf16_candidate)
        .collect();
    if all.is_empty() {
        return Probes::default();
    }
    // Every core runs every probe at once; a core's figures are its best windows.
    let per_core: Vec<(f64, Vec<f64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores)
            .map(|_| {
                s.spawn(|| {
                    let clock = best_rate(clock_loop, CLOCK_ADDS as f64);
                    let rates = all
                        .iter()
                        .map(|&(_, flops, chains, kernel)| {
                            best_rate(kernel, (flops * chains) as f64)
                        })
                        .collect::<Vec<_>>();
                    (clock, rates)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let n = per_core.len().max(1) as f64;
    let clock_hz = per_core.iter().map(|c| c.0).sum::<f64>() / n;
    let probe = |i: usize| {
        let (instruction, flops_per_instruction, _, _) = all[i];
        FmaProbe {
            instruction,
            flops_per_instruction,
            flops_per_core: per_core.iter().map(|c| c.1[i]).sum::<f64>() / n,
            clock_hz,
        }
    };
    let f32 = (0..f32_candidates.len())
        .map(probe)
        .max_by(|a, b| a.flops_per_core.total_cmp(&b.flops_per_core));
    let bf16 = bf16_candidate.map(|_| probe(all.len() - 1));
    Probes { f32, bf16 }
}

/// The best rate of `kernel` over [`WINDOWS`] windows of about [`WINDOW`], counting `per_iter`
/// units (FLOPs, cycles) an iteration.
fn best_rate(kernel: Kernel, per_iter: f64) -> f64 {
    let mut iters = 256;
    // Calibrate: double until a window lasts long enough to time well.
    while time(kernel, iters) < WINDOW && iters < 1 << 30 {
        iters *= 2;
    }
    (0..WINDOWS)
        .map(|_| iters as f64 * per_iter / time(kernel, iters).as_secs_f64().max(1e-9))
        .fold(0.0, f64::max)
}

fn time(kernel: Kernel, iters: usize) -> Duration {
    let start = Instant::now();
    std::hint::black_box(kernel(std::hint::black_box(iters)));
    start.elapsed()
}

#[cfg(target_arch = "x86_64")]
fn candidates() -> (Vec<Candidate>, Option<Candidate>) {
    let mut f32: Vec<Candidate> = Vec::new();
    if is_x86_feature_detected!("avx512f") {
        f32.push((
            "vfmadd231ps zmm (avx512f)",
            32,
            ZMM_CHAINS,
            x86::fma_zmm_safe,
        ));
    }
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        f32.push((
            "vfmadd231ps ymm (avx2+fma)",
            16,
            YMM_CHAINS,
            x86::fma_ymm_safe,
        ));
    }
    let bf16 = (is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f"))
        .then_some((
            "vdpbf16ps zmm (avx512_bf16)",
            64,
            ZMM_CHAINS,
            x86::dpbf16_zmm_safe as Kernel,
        ));
    (f32, bf16)
}

#[cfg(not(target_arch = "x86_64"))]
fn candidates() -> (Vec<Candidate>, Option<Candidate>) {
    (Vec::new(), None)
}

/// One cycle an add: [`CLOCK_ADDS`] dependent register adds an iteration (the `.rept` count).
#[cfg(target_arch = "x86_64")]
fn clock_loop(iters: usize) -> f32 {
    let mut x: u64 = 0;
    let one: u64 = 1;
    for _ in 0..iters {
        // SAFETY: register arithmetic only: no memory, no stack, no flags read afterwards.
        unsafe {
            std::arch::asm!(
                ".rept 64",
                "add {x}, {one}",
                ".endr",
                x = inout(reg) x,
                one = in(reg) one,
                options(nomem, nostack)
            );
        }
    }
    x as f32
}

#[cfg(not(target_arch = "x86_64"))]
fn clock_loop(iters: usize) -> f32 {
    iters as f32
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{YMM_CHAINS, ZMM_CHAINS};

    /// [`fma_zmm`] where the CPU has AVX-512F (checked by the caller, [`super::candidates`]).
    pub(super) fn fma_zmm_safe(iters: usize) -> f32 {
        assert!(is_x86_feature_detected!("avx512f"));
        // SAFETY: the CPU has AVX-512F (asserted).
        unsafe { fma_zmm(iters) }
    }

    /// [`fma_ymm`] where the CPU has AVX2 and FMA.
    pub(super) fn fma_ymm_safe(iters: usize) -> f32 {
        assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
        // SAFETY: the CPU has AVX2 and FMA (asserted).
        unsafe { fma_ymm(iters) }
    }

    /// [`dpbf16_zmm`] where the CPU has AVX512_BF16.
    pub(super) fn dpbf16_zmm_safe(iters: usize) -> f32 {
        assert!(is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f"));
        // SAFETY: the CPU has AVX512_BF16 and AVX-512F (asserted).
        unsafe { dpbf16_zmm(iters) }
    }

    /// `acc = acc · ½ + 1` on [`ZMM_CHAINS`] registers: the values stay near 2 (no overflow, no
    /// subnormals, which some cores run slowly).
    #[target_feature(enable = "avx512f")]
    unsafe fn fma_zmm(iters: usize) -> f32 {
        let (half, one) = (_mm512_set1_ps(0.5), _mm512_set1_ps(1.0));
        let mut acc = [one; ZMM_CHAINS];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_fmadd_ps(*r, half, one);
            }
        }
        acc.iter().map(|&r| _mm512_reduce_add_ps(r)).sum()
    }

    /// As [`fma_zmm`] on [`YMM_CHAINS`] 256-bit registers.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fma_ymm(iters: usize) -> f32 {
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let mut acc = [one; YMM_CHAINS];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm256_fmadd_ps(*r, half, one);
            }
        }
        let mut lanes = [0f32; 8];
        let mut total = 0.0;
        for r in acc {
            // SAFETY: `lanes` holds 8 f32, one 256-bit store.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), r) };
            total += lanes.iter().sum::<f32>();
        }
        total
    }

    /// `acc += a₀b₀ + a₁b₁` per lane on [`ZMM_CHAINS`] registers, with `a = b = 2⁻⁸` in bf16
    /// (`0x3b80`): each instruction adds 2⁻¹⁵ a lane, so a long window stays far from overflow.
    #[target_feature(enable = "avx512bf16,avx512f")]
    unsafe fn dpbf16_zmm(iters: usize) -> f32 {
        // SAFETY: `__m512bh` is the same 512 bits as `__m512i`, any pattern valid.
        let pair =
            unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(0x3b80_3b80)) };
        let mut acc = [_mm512_setzero_ps(); ZMM_CHAINS];
        for _ in 0..iters {
            for r in acc.iter_mut() {
                *r = _mm512_dpbf16_ps(*r, pair, pair);
            }
        }
        acc.iter().map(|&r| _mm512_reduce_add_ps(r)).sum()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// The loops compute what a plain loop does (so the timed code is the arithmetic it
        /// claims): `x ← x/2 + 1` from 1, and `x += 2·2⁻¹⁶` from 0, per lane.
        #[test]
        fn probe_loops_compute_what_a_plain_loop_does() {
            let plain_fma = |iters: usize, lanes: usize, chains: usize| {
                let mut x = 1f32;
                for _ in 0..iters {
                    x = x.mul_add(0.5, 1.0);
                }
                x * (lanes * chains) as f32
            };
            if is_x86_feature_detected!("avx512f") {
                assert_eq!(fma_zmm_safe(7), plain_fma(7, 16, ZMM_CHAINS));
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                assert_eq!(fma_ymm_safe(7), plain_fma(7, 8, YMM_CHAINS));
            }
            if is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f") {
                // 2⁻⁸ · 2⁻⁸ · 2 products · 5 iterations, 16 lanes × ZMM_CHAINS registers.
                let want = 5.0 * 2.0 * 2f32.powi(-16) * (16 * ZMM_CHAINS) as f32;
                assert_eq!(dpbf16_zmm_safe(5), want);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_snap_to_the_nearest_half() {
        assert_eq!(snap_units(0.97), 1.0);
        assert_eq!(snap_units(1.9), 2.0);
        assert_eq!(snap_units(0.52), 0.5);
        assert_eq!(snap_units(1.3), 1.5);
        assert_eq!(snap_units(0.1), 0.5);
    }

    #[test]
    fn the_clock_loop_is_one_add_an_instruction() {
        // 64 adds an iteration, 10 iterations.
        #[cfg(target_arch = "x86_64")]
        assert_eq!(clock_loop(10), (10 * CLOCK_ADDS) as f32);
    }

    /// On this machine: the probe finds a rate, its clock is plausible, and the snapped unit
    /// count is within what any x86 core has (a half to two full-width instructions a cycle).
    #[test]
    fn the_probe_measures_this_machine() {
        let p = measure(1);
        let Some(f32) = p.f32 else {
            return;
        };
        assert!(f32.clock_hz > 5e8 && f32.clock_hz < 7e9, "{f32:?}");
        assert!((0.5..=2.0).contains(&f32.units()), "{f32:?}");
        if let Some(bf16) = p.bf16 {
            assert!((0.5..=2.0).contains(&bf16.units()), "{bf16:?}");
            assert_eq!(bf16.clock_hz, f32.clock_hz);
        }
    }
}
