//! The transcendental functions whose bits must not depend on the machine: RoPE's rotation
//! tables and frequencies, and soft-capping's `tanh`.
//!
//! `f32::sin_cos`, `tanh`, `powf` and `ln` call the C library, whose last bit is its own: glibc
//! picks an FMA or a plain variant of `sincosf`, `pow` and `log` by processor at load time, and
//! another C library (or version) may round otherwise. Here they come from the `libm` crate, a
//! pure-Rust port of musl's: basic IEEE `f64` operations in a fixed order, no dispatch on the
//! processor, and no fused multiply-add the compiler could introduce (Rust never contracts `a *
//! b + c`), so its results are a function of its inputs alone — the same on every x86-64
//! processor, whatever C library the process has.
//!
//! Accuracy: each `f32` result is the `f64` function (within 1 ulp of `f64`) rounded once to
//! `f32`, which is the correctly rounded `f32` result unless the exact value lies within an
//! `f64` ulp of a rounding boundary. Tested against pinned bits (`tests`), so a change in the
//! crate's arithmetic shows.

/// `(sin x, cos x)` of an `f32` angle, each rounded once from `f64`.
#[inline]
pub(crate) fn sin_cos(x: f32) -> (f32, f32) {
    let (s, c) = libm::sincos(f64::from(x));
    (s as f32, c as f32)
}

/// `tanh x` of an `f32`, rounded once from `f64`.
#[inline]
pub(crate) fn tanh(x: f32) -> f32 {
    libm::tanh(f64::from(x)) as f32
}

/// `x^y` in `f64`.
#[inline]
pub(crate) fn pow(x: f64, y: f64) -> f64 {
    libm::pow(x, y)
}

/// `ln x` in `f64`.
#[inline]
pub(crate) fn ln(x: f64) -> f64 {
    libm::log(x)
}

/// The soft-capped logit `cap · tanh(x / cap)` (Gemma 2's attention and final logits), on
/// `tanh` (`fixed_math`): the same bits on every processor. Public for the `spmd` layer's elementwise op.
#[inline]
pub fn softcap(x: f32, cap: f32) -> f32 {
    cap * tanh(x / cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned bits: a change in how these are computed (another crate version's arithmetic, a
    /// C library call slipping back in) shows here, on any processor. The values are within an
    /// `f32` ulp of the `f64` functions.
    #[test]
    fn the_results_are_pinned_bits() {
        let angles = [
            0.0f32,
            1.0,
            -1.0,
            0.5,
            3.0,
            100.0,
            4095.0 * 0.0316,
            123_456.7,
            -7.25e-4,
        ];
        let got: Vec<(u32, u32)> = angles
            .iter()
            .map(|&a| {
                let (s, c) = sin_cos(a);
                (s.to_bits(), c.to_bits())
            })
            .collect();
        for (&a, &(s, c)) in angles.iter().zip(&got) {
            let (ws, wc) = (f64::from(a).sin(), f64::from(a).cos());
            let ulp = |x: f64| f64::from(f32::EPSILON) * x.abs().max(f64::from(f32::MIN_POSITIVE));
            assert!(
                (f64::from(f32::from_bits(s)) - ws).abs() <= ulp(ws),
                "sin {a}"
            );
            assert!(
                (f64::from(f32::from_bits(c)) - wc).abs() <= ulp(wc),
                "cos {a}"
            );
        }
        assert_eq!(got, PINNED_SIN_COS.to_vec());
        let caps: Vec<u32> = [-60.0f32, -3.5, 0.0, 1e-3, 2.75, 49.9, 300.0]
            .iter()
            .map(|&x| softcap(x, 50.0).to_bits())
            .collect();
        assert_eq!(caps, PINNED_SOFTCAP.to_vec());
        assert_eq!(pow(10_000.0, -0.25).to_bits(), PINNED_POW);
        assert_eq!(ln(40.0).to_bits(), PINNED_LN);
    }

    const PINNED_SIN_COS: [(u32, u32); 9] = [
        (0x0000_0000, 0x3f80_0000),
        (0x3f57_6aa4, 0x3f0a_5140),
        (0xbf57_6aa4, 0x3f0a_5140),
        (0x3ef5_7744, 0x3f60_a940),
        (0x3e10_81c3, 0xbf7d_7026),
        (0xbf01_a12e, 0x3f5c_c0ee),
        (0xbf0f_d963, 0xbf53_c33c),
        (0xbf7f_d9b9, 0xbd0b_f8c5),
        (0xba3e_0dec, 0x3f7f_fffc),
    ];
    const PINNED_SOFTCAP: [u32; 7] = [
        0xc226_bb1e,
        0xc05f_a285,
        0x0000_0000,
        0x3a83_126f,
        0x402f_d2a0,
        0x4218_268d,
        0x4247_ff5f,
    ];
    const PINNED_POW: u64 = 0x3fb9_9999_9999_999a;
    const PINNED_LN: u64 = 0x400d_82d3_3b32_720d;
}
