//! `exp` for the row kernels (softmax, cross-entropy, SiLU/SwiGLU) without a libm call, so the
//! loops that use it vectorise.
//!
//! [`exp`] is Cephes' `expf`: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (`ln 2` split in two so `r`
//! is exact), a degree-5 polynomial for `e^r − 1 − r`, and `2^n` put into the exponent bits. It
//! has no branch — the out-of-range cases are selects — so a loop over a slice compiles to vector
//! code. Its multiply-adds are fused (`f32::mul_add`: one rounding each, so the same bits as a
//! vector FMA instruction, and as libm's `fmaf` where the code is compiled for baseline x86-64),
//! a third fewer vector operations than a multiply and an add apart: SwiGLU, bound by its
//! exponential, ran 0.70–0.86× its time with them (`examples/rows`). [`vectorized`] compiles
//! for a set with FMA, and [`Isa::detect`] picks a set only where the CPU has FMA. Error: within 2 ulp of the correctly rounded result over the whole range (tested against
//! `f64::exp` at every 997th f32 bit pattern in [−87.3, 88.7]); NaN in, NaN out; `+∞` above 88.72, `0` below
//! −87.33 (the libm result is a subnormal there; nothing in a softmax or a sigmoid can tell).

use crate::isa::Isa;

/// `e^x` in f32 (see the module docs for its error).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const HI: f32 = 88.722_83;
    const LO: f32 = -87.336_55;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let clamped = x.clamp(LO, HI);
    // Round to nearest by adding and removing 1.5·2²³ (exact for |t| < 2²²), not `round()`,
    // which is a libm call on baseline x86-64 and would stop the loop from vectorising.
    const ROUNDER: f32 = 12_582_912.0;
    let shifted = clamped.mul_add(LOG2E, ROUNDER);
    let n = shifted - ROUNDER;
    // `n` as an integer, read off the shifted value's low mantissa bits (`bits(1.5·2²³ + n) =
    // bits(1.5·2²³) + n`): a bit cast and an integer subtract per lane. `n as i32` is
    // Rust's saturating conversion, which the compiler lowered here to one scalar convert and
    // insert per lane (an exponential cost several times its polynomial). Wrapping: a NaN
    // gives a meaningless `n`, whose result the NaN check below discards.
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUNDER.to_bits() as i32);
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, clamped));
    let e_r = exp_reduced(r);
    // 2^n as 2^h · 2^(n−h), h = ⌊n/2⌋: both halves stay normal for n in [−126, 128].
    let h = n_int >> 1;
    let two_to = |e: i32| f32::from_bits((e.wrapping_add(127) as u32) << 23);
    let y = e_r * two_to(h) * two_to(n_int.wrapping_sub(h));
    let y = if x > HI { f32::INFINITY } else { y };
    let y = if x < LO { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `e^r` for the reduced argument `|r| ≤ ln 2 / 2` of [`exp`]: Cephes' degree-5 polynomial for
/// `e^r − 1 − r`, its multiply-adds fused.
#[inline(always)]
fn exp_reduced(r: f32) -> f32 {
    let p = 1.987_569_1e-4_f32;
    let p = p.mul_add(r, 1.398_199_9e-3);
    let p = p.mul_add(r, 8.333_452e-3);
    let p = p.mul_add(r, 4.166_579_6e-2);
    let p = p.mul_add(r, 1.666_666_5e-1);
    let p = p.mul_add(r, 0.5);
    (p * r).mul_add(r, r) + 1.0
}

/// Runs `f` compiled for this process's instruction set ([`Isa::detect`]: the widest the CPU
/// has, or the one `FERROTEXT_PORTABLE_ISA` forces), so the loops inside use 16 lanes (AVX-512)
/// or 8 (AVX2) instead of baseline x86-64's 4. The bits are the same on every set: the same IEEE
/// operations in the same order (Rust never fuses a multiply and an add on its own; an explicit
/// `mul_add` is one exactly rounded operation on every set, and both vector sets enable FMA).
///
/// Write the closure `#[inline(always)] || …`: the vector code is what gets inlined into the
/// wrappers below, and a closure the compiler leaves out of line is compiled once, for baseline
/// x86-64 (seen in `perf annotate`: the causal-softmax, softmax-backward, RMSNorm-backward and
/// GQA-sum closures ran on `xmm` registers until they were marked).
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match Isa::detect() {
        // SAFETY: `detect` gives only a set this CPU has.
        Isa::Avx512 => return unsafe { with_avx512(f) },
        // SAFETY: as above.
        Isa::Avx2 => return unsafe { with_avx2(f) },
        Isa::Scalar => {}
    }
    f()
}

/// `f`, inlined into a function compiled for AVX-512F.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `f`, inlined into a function compiled for AVX2.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Partial sums of a lane reduction: one AVX-512 register of `f32`.
const LANES: usize = 16;

/// Partial sums folded in a fixed tree: lane `j` with `j + W/2`, then `+ W/4`, …, `+ 1`.
#[inline(always)]
pub(crate) fn fold_lanes<T: Copy + std::ops::AddAssign, const W: usize>(mut acc: [T; W]) -> T {
    let mut width = W / 2;
    while width > 0 {
        for j in 0..width {
            let right = acc[j + width];
            acc[j] += right;
        }
        width /= 2;
    }
    acc[0]
}

/// `Σᵢ f(aᵢ, bᵢ)` over two equally long slices, in 16 interleaved partial sums (element `i`
/// goes to sum `i mod 16`) folded in a fixed tree: a sequential `f32` sum is a chain of
/// dependent adds the compiler may not reorder, so it runs at one add per 4 cycles, while the
/// lanes are one vector add per element group. The order depends only on the length, so the
/// bits are the same on every thread count and with or without AVX-512.
#[inline(always)]
pub(crate) fn lane_sum2<A: Copy, B: Copy>(a: &[A], b: &[B], f: impl Fn(A, B) -> f32) -> f32 {
    lane_sum3(a, b, b, |x, y, _| f(x, y))
}

/// `Σᵢ f(aᵢ, bᵢ, cᵢ)` over three equally long slices, in lanes (see [`lane_sum2`]): 16 partial
/// sums of `f32`, element `i` into sum `i mod 16`, folded by [`fold_lanes`].
#[inline(always)]
pub(crate) fn lane_sum3<A: Copy, B: Copy, C: Copy>(
    a: &[A],
    b: &[B],
    c: &[C],
    f: impl Fn(A, B, C) -> f32,
) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let mut acc = [0.0f32; LANES];
    let (ac, bc, cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let (at, bt, ct) = (ac.remainder(), bc.remainder(), cc.remainder());
    for ((x, y), z) in ac.zip(bc).zip(cc) {
        for j in 0..LANES {
            acc[j] += f(x[j], y[j], z[j]);
        }
    }
    if !at.is_empty() {
        // The last partial chunk as a whole one, its missing lanes repeating the last element
        // and adding `+0.0` (a lane that starts at `+0.0` is never `−0.0`, so its bits stay):
        // no lane indexed at run time, so the lanes stay in a register (a QK-norm row is two
        // chunks: its sums' lanes had lived in memory for a tail it never has).
        let last = at.len() - 1;
        let (pa, pb, pc): ([A; LANES], [B; LANES], [C; LANES]) = (
            std::array::from_fn(|j| at[j.min(last)]),
            std::array::from_fn(|j| bt[j.min(last)]),
            std::array::from_fn(|j| ct[j.min(last)]),
        );
        for j in 0..LANES {
            let y = f(pa[j], pb[j], pc[j]);
            acc[j] += if j <= last { y } else { 0.0 };
        }
    }
    fold_lanes(acc)
}

/// `Σᵢ xᵢ` in lanes (see [`lane_sum2`]).
#[inline(always)]
pub(crate) fn lane_sum(xs: &[f32]) -> f32 {
    lane_sum2(xs, xs, |x, _| x)
}

/// `Σᵢ xᵢ` in `f64`, in 8 interleaved partial sums folded in a fixed tree (as [`lane_sum2`]):
/// the order `write_sum_f64` keeps (its tests' reference).
#[cfg(test)]
fn lane_sum_f64(xs: &[f32]) -> f64 {
    const W: usize = 8;
    let mut acc = [0.0f64; W];
    let chunks = xs.chunks_exact(W);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..W {
            acc[j] += f64::from(c[j]);
        }
    }
    for (j, &x) in tail.iter().enumerate() {
        acc[j] += f64::from(x);
    }
    fold_lanes(acc)
}

/// `out[i] = f(xs[i])` for each element, and the sum of the new values in `f64` from the same
/// pass, in 8 interleaved partial sums folded in a fixed tree (as [`lane_sum2`]): element `i`
/// into lane `i mod 8`, added in index order (its tests compare it with the sum taken apart). `out` holds `xs.len()` elements; each is written (it may start
/// uninitialised).
#[inline(always)]
pub(crate) fn write_sum_f64(
    xs: &[f32],
    out: &mut [std::mem::MaybeUninit<f32>],
    f: impl Fn(f32) -> f32,
) -> f64 {
    const W: usize = 8;
    assert_eq!(xs.len(), out.len()); // ok: the callers' rows
    let mut acc = [0.0f64; W];
    // Two lanes' worth of `f32` at a time (a vector of 16 computed as one), each half added
    // into the 8 `f64` lanes in index order.
    let chunks = xs.chunks_exact(2 * W);
    let tail = chunks.remainder();
    let mut outs = out.chunks_exact_mut(2 * W);
    for (c, o) in chunks.zip(&mut outs) {
        let mut y = [0.0f32; 2 * W];
        for j in 0..2 * W {
            y[j] = f(c[j]);
        }
        for j in 0..2 * W {
            o[j].write(y[j]);
        }
        for j in 0..W {
            acc[j] += f64::from(y[j]);
        }
        for j in 0..W {
            acc[j] += f64::from(y[W + j]);
        }
    }
    for ((j, &x), o) in tail.iter().enumerate().zip(outs.into_remainder()) {
        let y = f(x);
        o.write(y);
        acc[j % W] += f64::from(y);
    }
    fold_lanes(acc)
}

/// The largest of `xs` (NaN ignored, as `f32::max` does; `−∞` for none), in lanes. A maximum
/// does not depend on the order it is taken in, so this equals the sequential fold. Taken by
/// comparison (`if x > m { x } else { m }`, one vector instruction) rather than `f32::max`,
/// whose NaN rules cost three, and folded as a tree: with the lanes starting at `−∞` a NaN never
/// enters them, so the two agree. A last partial chunk is padded with `−∞`, so the lanes stay
/// in a register instead of being indexed one by one in memory (`perf annotate` of the tiled
/// attention's forward: `f32::max` and the sequential fold of 16 lanes a row were a quarter of
/// its softmax).
#[inline(always)]
pub(crate) fn lane_max(xs: &[f32]) -> f32 {
    #[inline(always)]
    fn larger(x: f32, m: f32) -> f32 {
        if x > m {
            x
        } else {
            m
        }
    }
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] = larger(c[j], acc[j]);
        }
    }
    if !tail.is_empty() {
        let mut pad = [f32::NEG_INFINITY; LANES];
        pad[..tail.len()].copy_from_slice(tail);
        for j in 0..LANES {
            acc[j] = larger(pad[j], acc[j]);
        }
    }
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            acc[j] = larger(acc[j + width], acc[j]);
        }
        width /= 2;
    }
    acc[0]
}

/// Each element `x` of `xs`, at index `i`, replaced by `f(i, x)`, and the sum of the new values
/// returned from the same pass: bit for bit [`lane_sum`] of them (element `i` into lane `i mod
/// 16`, added in index order, the same fold). A last partial chunk runs as a whole one on a
/// padded copy (its extra lanes computed and dropped: `f` may see indices up to the next
/// multiple of 16), so the lanes stay in a register instead of being indexed one by one in
/// memory; the padding adds `+0.0`, which leaves a lane's bits as they are (a lane that starts
/// at `+0.0` is never `−0.0`).
#[inline(always)]
pub(crate) fn map_sum(xs: &mut [f32], f: impl Fn(usize, f32) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    let mut base = 0;
    for c in &mut chunks {
        for j in 0..LANES {
            let y = f(base + j, c[j]);
            c[j] = y;
            acc[j] += y;
        }
        base += LANES;
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mut pad = [0.0f32; LANES];
        pad[..tail.len()].copy_from_slice(tail);
        for j in 0..LANES {
            let y = f(base + j, pad[j]);
            pad[j] = y;
            acc[j] += if j < tail.len() { y } else { 0.0 };
        }
        tail.copy_from_slice(&pad[..tail.len()]);
    }
    fold_lanes(acc)
}

/// `1 / (1 + e^{−x})`, on [`exp`].
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[cfg(test)]
// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// The integer part read off the shifted value's bits is `n as i32` wherever the result
    /// depends on it: the same bits as the exponential computed with the conversion, at every
    /// 97th f32 bit pattern (NaN, infinities and the clamped ranges included).
    #[test]
    fn exp_reads_its_integer_part_off_the_bits_exactly() {
        fn with_conversion(x: f32) -> f32 {
            let clamped = x.clamp(-87.336_55, 88.722_83);
            let n = clamped.mul_add(std::f32::consts::LOG2_E, 12_582_912.0) - 12_582_912.0;
            let r = (-n).mul_add(-2.121_944_4e-4, (-n).mul_add(0.693_359_4, clamped));
            // The polynomial is shared: what differs is how `n` becomes an integer.
            let e_r = exp_reduced(r);
            let n = n as i32;
            let h = n >> 1;
            let two_to = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
            let y = e_r * two_to(h) * two_to(n - h);
            let y = if x > 88.722_83 { f32::INFINITY } else { y };
            let y = if x < -87.336_55 { 0.0 } else { y };
            if x.is_nan() {
                x
            } else {
                y
            }
        }
        for bits in (0..=u32::MAX).step_by(97) {
            let x = f32::from_bits(bits);
            assert_eq!(exp(x).to_bits(), with_conversion(x).to_bits(), "{x}");
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_correctly_rounded_value() {
        let (mut worst, mut checked) = (0, 0);
        // Every 997th f32 bit pattern in the range, positive and negative alike.
        for bits in (0..=u32::MAX).step_by(997) {
            let x = f32::from_bits(bits);
            if !(-87.3..=88.7).contains(&x) {
                continue;
            }
            let want = f64::from(x).exp() as f32;
            worst = worst.max(ulps(exp(x), want));
            checked += 1;
        }
        assert!(checked > 1_000_000, "{checked}");
        assert!(worst <= 2, "worst {worst} ulp");
    }

    /// `write_sum_f64` writes `f` of every element and returns, bit for bit, `lane_sum_f64` of
    /// what it wrote, at every length up to 150 (tails of every size) and on values whose
    /// order of addition shows (a sum in another order differs: the mirror).
    #[test]
    fn write_sum_f64_is_the_lane_sum_of_what_it_writes() {
        for n in 0..150usize {
            let xs: Vec<f32> = (0..n)
                .map(|i| {
                    ((i * 7919 % 97) as f32 - 48.0) * 0.731 * if i % 5 == 0 { 1e7 } else { 1.0 }
                })
                .collect();
            let f = |x: f32| x * 1.5 - 0.25;
            let mut out = vec![std::mem::MaybeUninit::new(f32::NAN); n];
            let sum = write_sum_f64(&xs, &mut out, f);
            // SAFETY: every element was initialised (to NaN) before the call.
            let written: Vec<f32> = out.iter().map(|o| unsafe { o.assume_init() }).collect();
            let want: Vec<f32> = xs.iter().map(|&x| f(x)).collect();
            assert_eq!(written, want, "n {n}");
            assert_eq!(sum.to_bits(), lane_sum_f64(&want).to_bits(), "n {n}");
        }
        // The mirror: these values' sum depends on its order (a sequential f64 sum differs).
        let xs: Vec<f32> = (0..64)
            .map(|i| {
                if i % 8 == 0 {
                    1e30
                } else {
                    1.0 + i as f32 * 1e-7
                }
            })
            .collect();
        let xs: Vec<f32> = xs
            .iter()
            .enumerate()
            .map(|(i, &x)| if i % 16 == 8 { -x } else { x })
            .collect();
        let sequential: f64 = xs.iter().map(|&x| f64::from(x)).sum();
        let mut out = vec![std::mem::MaybeUninit::new(0.0); xs.len()];
        let lanes = write_sum_f64(&xs, &mut out, |x| x);
        assert_eq!(lanes.to_bits(), lane_sum_f64(&xs).to_bits());
        assert_ne!(lanes.to_bits(), sequential.to_bits());
    }

    /// Lane sums against an f64 loop on every length up to a few lanes (tails of every size),
    /// the same bits whichever of `lane_sum` / `lane_sum2` computes them, and the max equal to
    /// the sequential fold, NaN ignored.
    #[test]
    fn lane_reductions_match_plain_loops() {
        for n in 0..150usize {
            let xs: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
            let want: f64 = xs.iter().map(|&x| f64::from(x)).sum();
            assert!((f64::from(lane_sum(&xs)) - want).abs() < 1e-5, "n {n}");
            assert!((lane_sum_f64(&xs) - want).abs() < 1e-12, "n {n}");
            let dot = lane_sum2(&xs, &xs, |a, b| a * b);
            let want_dot: f64 = xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            assert!((f64::from(dot) - want_dot).abs() < 1e-4, "n {n}");
            assert_eq!(
                lane_sum(&xs).to_bits(),
                lane_sum2(&xs, &xs, |a, _| a).to_bits()
            );
            let seq = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(lane_max(&xs), seq, "n {n}");
            // The lanes' order, written out: element i into lane i mod 16, in index order,
            // then the tree fold; the padded last chunk must leave exactly these bits.
            let mut lanes = [0.0f32; LANES];
            for (i, &x) in xs.iter().enumerate() {
                lanes[i % LANES] += x * x;
            }
            let written_out = fold_lanes(lanes);
            assert_eq!(dot.to_bits(), written_out.to_bits(), "n {n}");
            // The fused passes: the mapped values, and their lane reduction's bits.
            let f = |x: f32| exp(0.7 * x - 0.1);
            let mapped: Vec<f32> = xs.iter().map(|&x| f(x)).collect();
            let mut b = xs.clone();
            let sum = map_sum(&mut b, |_, x| f(x));
            assert_eq!(sum.to_bits(), lane_sum(&mapped).to_bits(), "n {n}");
            assert_eq!(b, mapped, "n {n}");
        }
        assert_eq!(lane_max(&[1.0, f32::NAN, 3.0, -2.0]), 3.0);
        let mut with_nans = vec![f32::NAN; 37];
        with_nans[20] = -7.0;
        assert_eq!(
            lane_max(&with_nans),
            -7.0,
            "NaN ignored in every lane and the tail"
        );
        assert_eq!(lane_max(&[f32::NAN; 3]), f32::NEG_INFINITY);
        assert_eq!(lane_max(&[]), f32::NEG_INFINITY);
        // The index each element is handed: its own.
        let mut at = vec![0.0f32; 37];
        assert_eq!(
            map_sum(&mut at, |i, _| i as f32),
            (0..37).sum::<usize>() as f32
        );
        assert!(at.iter().enumerate().all(|(i, &x)| x == i as f32));
        // Exact where the order cannot matter: 1000 ones.
        assert_eq!(lane_sum(&[1.0; 1000]), 1000.0);
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert_eq!(sigmoid(-200.0), 0.0);
        assert_eq!(sigmoid(200.0), 1.0);
    }
}
