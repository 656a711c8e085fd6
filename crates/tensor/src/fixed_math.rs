//! The transcendental functions whose bits must not depend on the machine: every `exp`, `ln`,
//! `tanh`, `sin`, `cos` and `pow` whose result reaches a parameter, a loss or a sampled token
//! (RoPE's tables and frequencies, soft-capping, the elementwise ops, the log-sum-exps of the
//! loss and of attention, the initial weights, the learning-rate schedule, sampling).
//!
//! `f32::exp`, `sin_cos`, `tanh`, `powf`, `ln` and their `f64` twins call the C library, whose
//! last bit is its own: glibc picks an FMA or a plain variant of `exp`, `log`, `pow`, `sin`,
//! `cos` and `sincosf` by processor at load time, and another C library (or version) may round
//! otherwise. Here they come from the `libm` crate, a pure-Rust port of musl's: basic IEEE `f64`
//! operations in a fixed order, no dispatch on the processor, and no fused multiply-add the
//! compiler could introduce (Rust never contracts `a * b + c`), so its results are a function of
//! its inputs alone — the same on every x86-64 processor, whatever C library the process has.
//! The workspace's `clippy.toml` refuses the standard library's methods, so a call to the C
//! library cannot slip back in unnoticed.
//!
//! Accuracy: each `f32` result is the `f64` function (within 1 ulp of `f64`) rounded once to
//! `f32`, which is the correctly rounded `f32` result unless the exact value lies within an
//! `f64` ulp of a rounding boundary. Tested against pinned bits (`tests`), so a change in the
//! crate's arithmetic shows. Hot loops use `fastmath`'s vectorized `exp` instead (its own fixed
//! bits); these are for scalar work and elementwise ops off the decoder's fused kernels.

/// `(sin x, cos x)` of an `f32` angle, each rounded once from `f64`.
#[inline]
pub fn sin_cos(x: f32) -> (f32, f32) {
    let (s, c) = libm::sincos(f64::from(x));
    (s as f32, c as f32)
}

/// `sin x` of an `f32`, rounded once from `f64`.
#[inline]
pub fn sin(x: f32) -> f32 {
    libm::sin(f64::from(x)) as f32
}

/// `cos x` of an `f32`, rounded once from `f64`.
#[inline]
pub fn cos(x: f32) -> f32 {
    libm::cos(f64::from(x)) as f32
}

/// `tanh x` of an `f32`, rounded once from `f64`.
#[inline]
pub fn tanh(x: f32) -> f32 {
    libm::tanh(f64::from(x)) as f32
}

/// `eˣ` of an `f32`, rounded once from `f64` (`+∞` above `f32`'s range, 0 far below).
#[inline]
pub fn exp(x: f32) -> f32 {
    libm::exp(f64::from(x)) as f32
}

/// `ln x` of an `f32`, rounded once from `f64` (`−∞` at 0, NaN below).
#[inline]
pub fn ln(x: f32) -> f32 {
    libm::log(f64::from(x)) as f32
}

/// `x^y` in `f64`.
#[inline]
pub fn pow_f64(x: f64, y: f64) -> f64 {
    libm::pow(x, y)
}

/// `ln x` in `f64`.
#[inline]
pub fn ln_f64(x: f64) -> f64 {
    libm::log(x)
}

/// `eˣ` in `f64`.
#[inline]
pub fn exp_f64(x: f64) -> f64 {
    libm::exp(x)
}

/// `cos x` in `f64`.
#[inline]
pub fn cos_f64(x: f64) -> f64 {
    libm::cos(x)
}

/// The soft-capped logit `cap · tanh(x / cap)` (Gemma 2's attention and final logits), on
/// [`tanh`]: the same bits on every processor.
#[inline]
pub fn softcap(x: f32, cap: f32) -> f32 {
    cap * tanh(x / cap)
}

#[cfg(test)]
// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#[allow(clippy::disallowed_methods)]
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
        assert_eq!(pow_f64(10_000.0, -0.25).to_bits(), PINNED_POW);
        assert_eq!(ln_f64(40.0).to_bits(), PINNED_LN);
    }

    /// The elementwise functions pinned the same way, each also within an `f32` ulp of the
    /// `f64` function (the standard library's, as a reference only), and the single-angle
    /// `sin` and `cos` are [`sin_cos`]'s.
    #[test]
    fn the_elementwise_functions_are_pinned_bits() {
        let xs = [
            -80.0f32, -3.25, -0.5, -1e-4, 0.0, 1e-4, 0.75, 2.0, 10.5, 88.0,
        ];
        let ulp = |x: f64| f64::from(f32::EPSILON) * x.abs().max(f64::from(f32::MIN_POSITIVE));
        let close = |got: f32, want: f64| (f64::from(got) - want).abs() <= ulp(want);
        let mut got = Vec::new();
        for &x in &xs {
            let w = f64::from(x);
            assert!(close(exp(x), w.exp()), "exp {x}");
            assert!(close(tanh(x), w.tanh()), "tanh {x}");
            assert!(
                close(sin(x), w.sin()) && close(cos(x), w.cos()),
                "sin, cos {x}"
            );
            assert_eq!((sin(x), cos(x)), sin_cos(x), "{x}");
            let l = ln(x.abs().max(1e-30));
            assert!(close(l, w.abs().max(1e-30).ln()), "ln {x}");
            got.push([exp(x), tanh(x), sin(x), l].map(f32::to_bits));
        }
        assert_eq!(got, PINNED_ELEMENTWISE.to_vec());
        let f64s = [
            exp_f64(-2.5),
            cos_f64(0.3),
            ln_f64(1e-300),
            pow_f64(2.0, 0.5),
        ];
        assert_eq!(f64s.map(f64::to_bits), PINNED_F64);
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert!(ln(-1.0).is_nan() && exp(f32::NAN).is_nan());
        assert_eq!((exp(f32::INFINITY), exp(-200.0)), (f32::INFINITY, 0.0));
    }

    /// `[exp, tanh, sin, ln |x|]` of each test point.
    const PINNED_ELEMENTWISE: [[u32; 4]; 10] = [
        [0x05bf_ecba, 0xbf80_0000, 0x3f7e_6f7d, 0x408c_3990],
        [0x3d1e_d1b4, 0xbf7f_3b3d, 0x3ddd_9569, 0x3f96_de2b],
        [0x3f1b_4598, 0xbeec_9a9f, 0xbef5_7744, 0xbf31_7218],
        [0x3f7f_f972, 0xb8d1_b717, 0xb8d1_b717, 0xc113_5d8e],
        [0x3f80_0000, 0x0000_0000, 0x0000_0000, 0xc28a_27b5],
        [0x3f80_0347, 0x38d1_b717, 0x38d1_b717, 0xc113_5d8e],
        [0x4007_7cee, 0x3f22_991f, 0x3f2e_7fe1, 0xbe93_4b11],
        [0x40ec_7326, 0x3f76_ca83, 0x3f68_c7b7, 0x3f31_7218],
        [0x470d_db81, 0x3f80_0000, 0xbf61_33be, 0x4016_7cef],
        [0x7ef8_82b7, 0x3f80_0000, 0x3d10_fdd0, 0x408f_4658],
    ];
    /// `[exp(−2.5), cos(0.3), ln(1e−300), √2 as pow]` in `f64`.
    const PINNED_F64: [u64; 4] = [
        0x3fb5_0385_c094_f425,
        0x3fee_921d_d42f_09ba,
        0xc085_9634_47f8_7fb5,
        0x3ff6_a09e_667f_3bcd,
    ];

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
