//! The product probe: the FLOP/s this process's own matrix-product kernel reaches on this
//! machine, per dtype — the rate a step's products could run at if nothing else took time, the
//! figure the "fraction of the fastest product" goal divides by.
//!
//! The instruction probe ([`super::FmaProbe`]) says what the vector units do; a product also
//! packs operands, loads tiles and stores results, and reaches 75–95% of that depending on the
//! kernel and the core (ferrotext's AVX512_BF16 kernel on a Zen 4: about 85%; MKL's f32
//! product on the same core: about 80%). So a run's MFU against the instruction peak mixes two
//! gaps: the kernel's (its products below the instructions) and the step's (time outside
//! products, products on shapes slower than the probe's). Against this probe it shows the
//! step's alone.
//!
//! Each core multiplies its own [`SIDE`]-cubed operands on its own thread (one thread per
//! product, so every core runs the kernel's single-thread path, as a device's kernel threads
//! do), all cores at once (all-core clocks; shared caches and memory as in a step), best of
//! [`WINDOWS`] windows per core: a window another process preempted is slower, never faster.
//! The operands fit a core's L2 cache (bf16: 512 KiB each; f32: 1 MiB), the shape of a layer's
//! products at 512 tokens and a model width of 512 to 1024.

use std::sync::{Barrier, OnceLock};
use std::time::Instant;

use crate::bf16::Bf16Tensor;
use crate::matmul::{dot_general, DotDims};
use crate::tensor::Tensor;

/// Rows, columns and contraction of the probe's product.
const SIDE: usize = 512;

/// Windows timed per core; the best one counts.
const WINDOWS: usize = 8;

/// The product probe of one dtype: the kernel's rate on this machine's cores.
#[derive(Clone, Debug, PartialEq)]
pub struct ProductProbe {
    /// FLOP/s of all cores together: the sum of each core's best window.
    pub flops: f64,
    /// Cores that ran it at once.
    pub cores: usize,
    /// The kernel that ran it (the process's choice for the dtype, as the run header names it).
    pub kernel: String,
}

impl ProductProbe {
    /// `400.1 GFLOP/s bf16 products measured (2 cores × one 512³ product each, ferrotext's ...)`.
    pub fn describe(&self, bf16: bool) -> String {
        format!(
            "{:.1} GFLOP/s {} products measured ({} cores × one {SIDE}³ product each, best of {WINDOWS}; {})",
            self.flops / 1e9,
            if bf16 { "bf16" } else { "f32" },
            self.cores,
            self.kernel
        )
    }
}

/// The rate of this process's product kernel for `bf16` (true) or `f32` products on `cores`
/// cores, measured on the first call per dtype (about 10–60 ms and a few MiB a core) and kept
/// for the process; `None` when a product fails (a refused bf16 kernel choice).
pub fn product_peak(bf16: bool, cores: usize) -> Option<ProductProbe> {
    static F32: OnceLock<Option<ProductProbe>> = OnceLock::new();
    static BF16: OnceLock<Option<ProductProbe>> = OnceLock::new();
    let cell = if bf16 { &BF16 } else { &F32 };
    cell.get_or_init(|| measure(bf16, cores.max(1))).clone()
}

pub(super) fn measure(bf16: bool, cores: usize) -> Option<ProductProbe> {
    let kernel = if bf16 {
        crate::bf16_matmul_kernel().ok()?
    } else {
        crate::matmul_kernel()
    };
    let barrier = Barrier::new(cores);
    let best: Vec<Option<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores)
            .map(|_| s.spawn(|| core_rate(bf16, &barrier)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().ok().flatten())
            .collect()
    });
    let flops = best.into_iter().sum::<Option<f64>>()?;
    Some(ProductProbe {
        flops,
        cores,
        kernel,
    })
}

/// One core's best rate over [`WINDOWS`] products, each started with the other cores'.
fn core_rate(bf16: bool, barrier: &Barrier) -> Option<f64> {
    let values = |salt: usize| {
        Tensor::from_fn(&[SIDE, SIDE], move |i| {
            ((i * 7 + salt) % 13) as f32 / 13.0 - 0.5
        })
    };
    // `b` keeps its packings, as a step's weights do: where this process's products take the
    // kept route, the probe is the rate a step's weight products run at.
    let (a, b) = (values(1), values(5).keeping_packings());
    let (a16, b16) = (Bf16Tensor::from_f32(&a), Bf16Tensor::from_f32(&b));
    let dims = DotDims::matmul(2);
    let product = || -> Option<()> {
        if bf16 {
            std::hint::black_box(crate::dot_general_bf16(&a16, &b16, &dims, 1).ok()?);
        } else {
            std::hint::black_box(dot_general(&a, &b, &dims, 1).ok()?);
        }
        Some(())
    };
    // A first product outside the windows: packing buffers, pages, the kernel's choice.
    let mut ok = product().is_some();
    let mut best = f64::MAX;
    for _ in 0..WINDOWS {
        // Every core waits at every window, even one whose products failed, so none waits
        // for ever.
        barrier.wait();
        if ok {
            let start = Instant::now();
            ok = product().is_some();
            best = best.min(start.elapsed().as_secs_f64());
        }
    }
    if !ok {
        return None;
    }
    Some(2.0 * (SIDE * SIDE * SIDE) as f64 / best.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_runs_below_the_instructions_and_is_measured_once() {
        let probe = product_peak(false, 1).expect("the f32 product runs everywhere");
        let instructions = crate::cpu_peak();
        // One core's product cannot beat what the whole machine's FMA units do at twice their
        // nominal clock (no turbo doubles it). The stated figure, not the probed one: the
        // probe, run while other tests keep the cores busy, can read low (72.8 GFLOP/s a core
        // against an idle 118 here). And any kernel does 0.05 GFLOP/s, the portable scalar
        // path in a test build included. A FLOP count off by an order of magnitude fails.
        let bound = 2.0 * instructions.stated_flops();
        assert!(
            (0.05e9..bound).contains(&probe.flops),
            "{} against the bound {bound}",
            probe.flops
        );
        assert_eq!(probe.kernel, crate::matmul_kernel());
        assert_eq!(product_peak(false, 1), Some(probe), "measured once");
    }
}
