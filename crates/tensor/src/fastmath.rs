//! `exp` for the row kernels (softmax, cross-entropy, SiLU/SwiGLU) without a libm call, so the
//! loops that use it vectorise.
//!
//! [`exp`] is Cephes' `expf`: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (`ln 2` split in two so `r`
//! is exact), a degree-5 polynomial for `e^r − 1 − r`, and `2^n` put into the exponent bits. It
//! has no branch — the out-of-range cases are selects — so a loop over a slice compiles to vector
//! code. Error: within 2 ulp of the correctly rounded result over the whole range (tested against
//! `f64::exp` at every 997th f32 bit pattern in [−87.3, 88.7]); NaN in, NaN out; `+∞` above 88.72, `0` below
//! −87.33 (the libm result is a subnormal there; nothing in a softmax or a sigmoid can tell).

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
    let n = (clamped * LOG2E + ROUNDER) - ROUNDER;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    // 2^n as 2^h · 2^(n−h), h = ⌊n/2⌋: both halves stay normal for n in [−126, 128].
    let n = n as i32;
    let h = n >> 1;
    let two_to = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let y = e_r * two_to(h) * two_to(n - h);
    let y = if x > HI { f32::INFINITY } else { y };
    let y = if x < LO { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// Runs `f` compiled for AVX-512 when the CPU has it, so the loops inside use 16 lanes instead of
/// baseline x86-64's 4; otherwise runs it as it is. The bits are the same either way: the same
/// IEEE operations in the same order (Rust never fuses a multiply and an add on its own).
#[inline(always)]
pub(crate) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { with_avx512(f) };
        }
    }
    f()
}

/// `f`, inlined into a function compiled for AVX-512F.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `1 / (1 + e^{−x})`, on [`exp`].
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
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
