//! The optimizers' kernels over flat parameter buffers: the SGD and AdamW updates and the sum of
//! squares behind the global gradient norm.
//!
//! Each is one pass over memory on the device's kernel budget (the optimizer is bound by memory:
//! a step reads the gradient and the parameter and writes the parameter, AdamW its two moments
//! too), compiled for AVX-512 where the CPU has it. The updates are elementwise, so their bits do
//! not depend on the thread count or the instruction set (the same IEEE operations in the same
//! order). The sum of squares runs in a fixed order that depends only on the length: blocks of
//! [`NORM_BLOCK`] elements, each summed in [`NORM_LANES`] interleaved `f64` lanes folded in a
//! fixed tree, the blocks' sums added in order.

use rayon::prelude::*;

use crate::fastmath::{fold_lanes, vectorized};
use crate::parallel::{for_each_chunk, kernel_threads, tasks_for, Work};

/// Elements of one chunk of an update (the unit handed to a thread).
const UPDATE_BLOCK: usize = 4096;

/// Elements summed into one partial of [`sum_of_squares`].
const NORM_BLOCK: usize = 1 << 14;

/// Interleaved `f64` partial sums within a block: four AVX-512 registers, so four chains of
/// dependent adds run at once (one chain is one add per 4 cycles).
const NORM_LANES: usize = 32;

/// SGD in place: `w[i] -= k · g[i]` (`k` = learning rate × gradient scale), over
/// `w.len()` elements (`g` at least as long).
///
/// # Panics
/// When `g` is shorter than `w` (a bug in the caller).
pub fn sgd_update(w: &mut [f32], g: &[f32], k: f32) {
    // A caller's bug otherwise: the optimizer pairs each parameter with its own gradient.
    let fits = g.len() >= w.len();
    assert!(fits, "sgd_update: a gradient shorter than its parameter"); // ok: caller's invariant
    for_each_chunk(w, UPDATE_BLOCK, kernel_threads(), Work::Light, |c, run| {
        let g = &g[c * UPDATE_BLOCK..];
        vectorized(
            #[inline(always)]
            || {
                for (w, &d) in run.iter_mut().zip(g) {
                    *w -= k * d;
                }
            },
        );
    });
}

/// One AdamW step's constants (see [`adamw_update`]).
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    /// The first moment's decay `β₁`.
    pub b1: f32,
    /// The second moment's decay `β₂`.
    pub b2: f32,
    /// Learning rate over the first moment's bias correction, `lr / (1 − β₁ᵗ)`.
    pub step: f32,
    /// `√(1 − β₂ᵗ)`, the second moment's bias correction.
    pub c2_sqrt: f32,
    /// `ε`, added to the corrected second moment's root.
    pub eps: f32,
    /// Decoupled weight decay, `lr · λ` (0 for a parameter without decay).
    pub decay: f32,
    /// The gradient's scale (1 / tokens, times the clipping factor).
    pub grad_scale: f32,
}

/// AdamW in place over `w` and its moments `m`, `v` (all of `w.len()` elements; `g` at least as
/// long): with `d = g·grad_scale`, `m ← β₁m + (1−β₁)d`, `v ← β₂v + (1−β₂)d²`,
/// `w ← w − (step·m / (√v / c2_sqrt + ε) + decay·w)`.
///
/// # Panics
/// When `g` is shorter than `w` or a moment is not as long (a bug in the caller).
pub fn adamw_update(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: AdamW) {
    let n = w.len();
    // A caller's bug otherwise: the optimizer pairs each parameter with its gradient and moments.
    let fits = g.len() >= n && m.len() == n && v.len() == n;
    assert!(fits, "adamw_update: a gradient or moment too short"); // ok: caller's invariant
    let update = |w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
        vectorized(
            #[inline(always)]
            || {
                for (((w, &raw), mm), vv) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut())
                {
                    let d = raw * c.grad_scale;
                    *mm = c.b1 * *mm + (1.0 - c.b1) * d;
                    *vv = c.b2 * *vv + (1.0 - c.b2) * d * d;
                    *w -= c.step * *mm / (vv.sqrt() / c.c2_sqrt + c.eps) + c.decay * *w;
                }
            },
        );
    };
    let tasks = tasks_for(3 * n, kernel_threads(), Work::Light);
    if tasks == 1 {
        update(w, g, m, v);
        return;
    }
    let per_task = n.div_ceil(UPDATE_BLOCK).div_ceil(tasks) * UPDATE_BLOCK;
    w.par_chunks_mut(per_task)
        .zip(g.par_chunks(per_task))
        .zip(m.par_chunks_mut(per_task))
        .zip(v.par_chunks_mut(per_task))
        .for_each(|(((w, g), m), v)| update(w, g, m, v));
}

/// `Σ xᵢ²` in `f64`, in a fixed order that depends only on `xs.len()` (see the module docs):
/// the same bits on every thread count. Each square is exact in `f64`.
pub fn sum_of_squares(xs: &[f32]) -> f64 {
    let blocks = xs.len().div_ceil(NORM_BLOCK);
    let mut partials = vec![0.0f64; blocks];
    let tasks = tasks_for(xs.len(), kernel_threads(), Work::Light);
    if tasks == 1 {
        for (p, block) in partials.iter_mut().zip(xs.chunks(NORM_BLOCK)) {
            *p = block_sum_of_squares(block);
        }
    } else {
        let per_task = blocks.div_ceil(tasks);
        partials
            .par_chunks_mut(per_task)
            .zip(xs.par_chunks(per_task * NORM_BLOCK))
            .for_each(|(ps, run)| {
                for (p, block) in ps.iter_mut().zip(run.chunks(NORM_BLOCK)) {
                    *p = block_sum_of_squares(block);
                }
            });
    }
    partials.iter().sum()
}

/// One block's `Σ xᵢ²` (see [`lane_sum_of_squares`]), compiled for this process's instruction
/// set (the same bits on each; see `crate::isa`): a function of its own, since through
/// `vectorized` the compiler left the loop out of line, at baseline x86-64's two `f64` lanes an
/// instruction.
fn block_sum_of_squares(xs: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    match crate::isa::Isa::detect() {
        // SAFETY: `detect` gives only a set this CPU has.
        crate::isa::Isa::Avx512 => return unsafe { block_sum_of_squares_avx512(xs) },
        // SAFETY: as above.
        crate::isa::Isa::Avx2 => return unsafe { block_sum_of_squares_avx2(xs) },
        crate::isa::Isa::Scalar => {}
    }
    lane_sum_of_squares(xs)
}

/// [`lane_sum_of_squares`] compiled for AVX-512F.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block_sum_of_squares_avx512(xs: &[f32]) -> f64 {
    lane_sum_of_squares(xs)
}

/// [`lane_sum_of_squares`] compiled for AVX2.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn block_sum_of_squares_avx2(xs: &[f32]) -> f64 {
    lane_sum_of_squares(xs)
}

/// `Σ xᵢ²`: element `i` into lane `i mod NORM_LANES`, the lanes folded in a tree. Always inlined,
/// so that it is compiled with its caller's instruction set.
#[inline(always)]
fn lane_sum_of_squares(xs: &[f32]) -> f64 {
    let mut acc = [0.0f64; NORM_LANES];
    let chunks = xs.chunks_exact(NORM_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += f64::from(x) * f64::from(x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(tail) {
        *a += f64::from(x) * f64::from(x);
    }
    fold_lanes(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::with_kernel_pool;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    #[test]
    fn sgd_update_subtracts_the_scaled_gradient_on_any_thread_count() {
        let n = 200_003;
        let (w0, g) = (values(n, 1), values(n, 2));
        let k = 0.37f32;
        let expected: Vec<f32> = w0.iter().zip(&g).map(|(&w, &d)| w - k * d).collect();
        for threads in [1, 2, 3] {
            let mut w = w0.clone();
            with_kernel_pool(threads, "t", 1 << 20, || sgd_update(&mut w, &g, k));
            assert_eq!(w, expected, "threads {threads}");
        }
    }

    #[test]
    fn adamw_update_matches_the_formula_per_element_on_any_thread_count() {
        let n = 150_001;
        let (w0, g, m0) = (values(n, 3), values(n, 4), values(n, 5));
        let v0: Vec<f32> = values(n, 6).iter().map(|x| x.abs()).collect();
        let c = AdamW {
            b1: 0.9,
            b2: 0.95,
            step: 1e-3 / 0.1,
            c2_sqrt: 0.05f32.sqrt(),
            eps: 1e-8,
            decay: 1e-4,
            grad_scale: 0.25,
        };
        // Written out element by element, in f64 where it is exact, as a reference.
        let mut expect = (w0.clone(), m0.clone(), v0.clone());
        for i in 0..n {
            let d = g[i] * c.grad_scale;
            let m = c.b1 * m0[i] + (1.0 - c.b1) * d;
            let v = c.b2 * v0[i] + (1.0 - c.b2) * d * d;
            expect.0[i] = w0[i] - (c.step * m / (v.sqrt() / c.c2_sqrt + c.eps) + c.decay * w0[i]);
            expect.1[i] = m;
            expect.2[i] = v;
        }
        for threads in [1, 2, 3] {
            let (mut w, mut m, mut v) = (w0.clone(), m0.clone(), v0.clone());
            with_kernel_pool(threads, "t", 1 << 20, || {
                adamw_update(&mut w, &g, &mut m, &mut v, c)
            });
            assert_eq!(
                (&w, &m, &v),
                (&expect.0, &expect.1, &expect.2),
                "threads {threads}"
            );
        }
    }

    #[test]
    fn sum_of_squares_is_exact_on_quarter_integers_and_one_order_on_any_thread_count() {
        // Quarter-integers: every square and partial sum is exact in f64, in any order.
        for len in [
            0,
            1,
            31,
            32,
            33,
            NORM_BLOCK - 1,
            NORM_BLOCK + 5,
            3 * NORM_BLOCK + 77,
        ] {
            let xs: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25)
                .collect();
            let serial: f64 = xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert_eq!(sum_of_squares(&xs), serial, "len {len}");
        }
        // Values whose sum rounds: within 1e-12 of the serial sum, and the same bits on 1, 2
        // and 3 threads.
        let xs = values(5 * NORM_BLOCK + 1234, 7);
        let serial: f64 = xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let one = sum_of_squares(&xs);
        assert!((one - serial).abs() <= 1e-12 * serial);
        for threads in [2, 3] {
            let many = with_kernel_pool(threads, "t", 1 << 20, || sum_of_squares(&xs));
            assert_eq!(many.to_bits(), one.to_bits(), "threads {threads}");
        }
    }
}
