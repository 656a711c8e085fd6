//! Rounding against hand-computed cases and the `half` crate, the tensor type, and every row
//! kernel against `round_bf16` of its `f32` kernel on the widened inputs (bitwise).

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use half::bf16;

use super::*;
use crate::{
    causal_softmax, flash_attention, flash_attention_backward, glu, glu_backward, rms_norm,
    rms_norm_backward, rope_with, silu, softmax_backward_scaled, softmax_last, swiglu,
    swiglu_backward, GluActivation, KeyRanges, Rope, Scores, Tensor,
};

fn bits(x: f32) -> u16 {
    round_bf16(x).to_bits()
}

/// Cases worked by hand from the bits: bf16 keeps the top 16 bits of an f32.
#[test]
fn rounding_is_to_nearest_even_by_hand() {
    // Exact values are kept.
    assert_eq!(bits(1.0), 0x3f80);
    assert_eq!(bits(-2.0), 0xc000);
    // 1 + 2^-8 is halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81): to the even one.
    assert_eq!(bits(1.0 + 2f32.powi(-8)), 0x3f80);
    // 1 + 3·2^-8 is halfway between 0x3f81 (odd) and 0x3f82 (even): up.
    assert_eq!(bits(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
    // Just above and below a half: nearest.
    assert_eq!(bits(f32::from_bits(0x3f80_8001)), 0x3f81);
    assert_eq!(bits(f32::from_bits(0x3f80_7fff)), 0x3f80);
    // Negative ties go to even too.
    assert_eq!(bits(f32::from_bits(0xbf80_8000)), 0xbf80);
    assert_eq!(bits(f32::from_bits(0xbf81_8000)), 0xbf82);
    // Zeros keep their sign.
    assert_eq!(bits(0.0), 0x0000);
    assert_eq!(bits(-0.0), 0x8000);
}

#[test]
fn rounding_overflows_to_infinity_and_keeps_infinities_and_nans() {
    // bf16's largest finite is 0x7f7f = (2 − 2^-7)·2^127; f32::MAX rounds past it to ∞.
    assert_eq!(bits(f32::MAX), 0x7f80);
    assert_eq!(bits(f32::MIN), 0xff80);
    // Halfway between 0x7f7f (odd) and ∞ (0x7f80, "even"): to ∞, as IEEE does.
    assert_eq!(bits(f32::from_bits(0x7f7f_8000)), 0x7f80);
    // Below the halfway point: the largest finite.
    assert_eq!(bits(f32::from_bits(0x7f7f_7fff)), 0x7f7f);
    assert_eq!(bits(f32::INFINITY), 0x7f80);
    assert_eq!(bits(f32::NEG_INFINITY), 0xff80);
    // A NaN whose payload is only in the dropped half would round to ∞ by the integer trick:
    // it stays a (quiet) NaN, sign kept.
    let low_nan = f32::from_bits(0x7f80_0001);
    assert!(low_nan.is_nan());
    assert_eq!(bits(low_nan), 0x7fc0);
    assert_eq!(bits(f32::from_bits(0xff80_0001)), 0xffc0);
    // A NaN with payload in the top half keeps it; the quiet NaN is unchanged; an all-ones
    // payload does not carry into the sign.
    assert_eq!(bits(f32::from_bits(0x7fa0_0000)), 0x7fe0);
    assert_eq!(bits(f32::NAN), 0x7fc0);
    assert_eq!(bits(f32::from_bits(0x7fff_ffff)), 0x7fff);
    assert!(widen_bf16(round_bf16(f32::NAN)).is_nan());
}

#[test]
fn subnormals_round_on_the_same_grid() {
    // The smallest f32 subnormal (2^-149) is far below half of bf16's (2^-133): to +0.
    assert_eq!(bits(f32::from_bits(1)), 0x0000);
    assert_eq!(bits(-f32::from_bits(1)), 0x8000);
    // bf16's smallest subnormal is 0x0001 = f32 bits 0x0001_0000; half of it (0x8000) ties to
    // even (0), just above rounds up.
    assert_eq!(bits(f32::from_bits(0x0000_8000)), 0x0000);
    assert_eq!(bits(f32::from_bits(0x0000_8001)), 0x0001);
    assert_eq!(bits(f32::from_bits(0x0001_8000)), 0x0002);
    // The largest subnormal rounds up into the smallest normal (0x0080).
    assert_eq!(bits(f32::from_bits(0x007f_ffff)), 0x0080);
}

/// The `half` crate's conversion (an independent implementation) agrees on a sweep of bit
/// patterns across every exponent, ties included; widening is exact (`f32::from(bf16)`).
#[test]
fn rounding_matches_the_half_crate_on_a_sweep() {
    let mut x: u32 = 0x1234_5678;
    for i in 0u32..400_000 {
        // Every 4th value a tie (low half 0x8000), the rest pseudo-random bits.
        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let b = if i % 4 == 0 {
            (x & 0xffff_0000) | 0x8000
        } else {
            x
        };
        let v = f32::from_bits(b);
        let ours = round_bf16(v);
        let theirs = bf16::from_f32(v);
        if v.is_nan() {
            assert!(ours.is_nan() && ours.to_bits() & 0x8000 == theirs.to_bits() & 0x8000);
        } else {
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{b:#010x}");
        }
        assert_eq!(widen_bf16(theirs).to_bits(), f32::from(theirs).to_bits());
    }
}

#[test]
fn a_tensor_rounds_widens_reshapes_and_transposes() {
    let x = Tensor::from_fn(&[2, 3, 4], |i| i as f32 * 1.001 - 7.0);
    let b = Bf16Tensor::from_f32(&x);
    let back = b.to_f32();
    for (w, v) in back.data().iter().zip(x.data()) {
        assert_eq!(*w, widen_bf16(bf16::from_f32(*v)));
        // bf16 keeps 8 significant bits: half an ulp is at most 2^-8 of the value.
        assert!((w - v).abs() <= v.abs() * 2f32.powi(-8));
    }
    let t = b.transpose(&[2, 0, 1]).unwrap();
    let want = back.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(t.to_f32(), want);
    assert_eq!(t.shape(), &[4, 2, 3]);
    assert!(b.transpose(&[0, 0, 1]).is_err());
    assert!(b.clone().reshape(&[6, 4]).is_ok());
    let e = b.reshape(&[5, 5]).unwrap_err();
    assert!(e.to_string().contains("24 elements"), "{e}");
}

/// Values with a spread of magnitudes, rounded to bf16.
fn input(shape: &[usize], seed: u32) -> Bf16Tensor {
    let x = Tensor::from_fn(shape, |i| {
        let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8;
        (h as f32 / 16_777_216.0 - 0.5) * 6.0
    });
    Bf16Tensor::from_f32(&x)
}

/// `round_bf16` of an f32 result, for comparison.
fn rounded(t: &Tensor) -> Bf16Tensor {
    Bf16Tensor::from_f32(t)
}

// Shapes: rows shorter and longer than a chunk, a last chunk that is partial, and a size
// that splits over several tasks.
const SHAPES: [&[usize]; 4] = [&[3, 5], &[7, 1000], &[33, 128], &[64, 2048]];

#[test]
fn row_kernels_are_their_f32_kernels_rounded() {
    for &shape in &SHAPES {
        let x = input(shape, 1);
        let n = shape[1];
        let scale = Tensor::from_fn(&[n], |i| 0.5 + (i % 7) as f32 * 0.1);
        let (y, inv) = rms_norm_bf16(&x, &scale, 1e-6).unwrap();
        let (want, want_inv) = rms_norm(&x.to_f32(), &scale, 1e-6).unwrap();
        assert_eq!(y, rounded(&want), "rms_norm {shape:?}");
        assert_eq!(inv, want_inv, "rms_norm inverse rms {shape:?}");

        let s = softmax_last_bf16(&x).unwrap();
        assert_eq!(s, rounded(&softmax_last(&x.to_f32()).unwrap()), "{shape:?}");

        let u = input(shape, 2);
        let g = swiglu_bf16(&x, &u).unwrap();
        assert_eq!(g, rounded(&swiglu(&x.to_f32(), &u.to_f32()).unwrap()));
        let gelu = GluActivation::GeluTanh;
        let g = glu_bf16(&x, &u, gelu).unwrap();
        assert_eq!(g, rounded(&glu(&x.to_f32(), &u.to_f32(), gelu).unwrap()));
        assert_eq!(silu_bf16(&x).unwrap(), rounded(&silu(&x.to_f32())));
        let sum = add_bf16(&x, &u).unwrap();
        assert_eq!(sum, rounded(&x.to_f32().add(&u.to_f32()).unwrap()));
    }
}

#[test]
fn backward_row_kernels_are_their_f32_kernels_rounded() {
    for &shape in &SHAPES {
        let (x, dy) = (input(shape, 11), input(shape, 12));
        let n = shape[1];
        let scale = Tensor::from_fn(&[n], |i| 0.5 + (i % 5) as f32 * 0.1);
        let (_, inv) = rms_norm_bf16(&x, &scale, 1e-6).unwrap();
        let (dx, dscale) = rms_norm_backward_bf16(&x, &scale, &inv, &dy).unwrap();
        let (want_dx, want_dscale) =
            rms_norm_backward(&x.to_f32(), &scale, &inv, &dy.to_f32()).unwrap();
        assert_eq!(dx, rounded(&want_dx), "rms_norm_backward dx {shape:?}");
        // dscale stays f32, with the f32 kernel's bits (its groups, in its order).
        assert_eq!(dscale, want_dscale, "rms_norm_backward dscale {shape:?}");

        let u = input(shape, 13);
        let (dg, du) = swiglu_backward_bf16(&x, &u, &dy).unwrap();
        let (wg, wu) = swiglu_backward(&x.to_f32(), &u.to_f32(), &dy.to_f32()).unwrap();
        assert_eq!(
            (dg, du),
            (rounded(&wg), rounded(&wu)),
            "swiglu_backward {shape:?}"
        );
        let gelu = GluActivation::GeluTanh;
        let (dg, du) = glu_backward_bf16(&x, &u, &dy, gelu).unwrap();
        let (wg, wu) = glu_backward(&x.to_f32(), &u.to_f32(), &dy.to_f32(), gelu).unwrap();
        assert_eq!(
            (dg, du),
            (rounded(&wg), rounded(&wu)),
            "geglu_backward {shape:?}"
        );

        let y = softmax_last_bf16(&x).unwrap();
        let got = softmax_backward_bf16(&y, &dy, 0.7).unwrap();
        let want = softmax_backward_scaled(&y.to_f32(), &dy.to_f32(), 0.7).unwrap();
        assert_eq!(got, rounded(&want), "softmax_backward {shape:?}");
    }
    let x = input(&[3, 4], 1);
    let e = rms_norm_backward_bf16(&x, &Tensor::zeros(&[4]), &[1.0; 2], &x).unwrap_err();
    assert!(e.to_string().contains("row statistics"), "{e}");
    assert!(swiglu_backward_bf16(&x, &x, &input(&[4, 3], 1)).is_err());
}

/// The rounding is real: a bf16 kernel's output differs from the unrounded f32 result (the
/// mirror of the bitwise test above, which would also pass if both sides skipped rounding).
#[test]
fn bf16_outputs_are_rounded_not_just_stored() {
    let x = input(&[7, 1000], 3);
    let want = softmax_last(&x.to_f32()).unwrap();
    let got = softmax_last_bf16(&x).unwrap().to_f32();
    assert!(got.data().iter().zip(want.data()).any(|(a, b)| a != b));
    for (a, b) in got.data().iter().zip(want.data()) {
        assert!((a - b).abs() <= b.abs() * 2f32.powi(-8));
    }
}

#[test]
fn causal_softmax_and_attention_are_their_f32_kernels_rounded() {
    for (bh, tq, tk) in [(3, 5, 5), (2, 70, 70), (4, 3, 9)] {
        let x = input(&[bh, tq, tk], 4);
        let got = causal_softmax_bf16(&x, 0.3).unwrap();
        assert_eq!(got, rounded(&causal_softmax(&x.to_f32(), 0.3).unwrap()));
    }
}

/// The tiled bf16 attention, forward and backward, against the `f32` kernel on the same values
/// (within bf16's resolution: it rounds the probabilities and dS for their products), its bits
/// independent of the thread count; shapes that do not fit are errors.
#[test]
fn attention_and_its_backward_on_bf16_products_are_close_to_f32() {
    let key = crate::flash::KEY_BLOCK;
    for &(b, t, h, kv, dk, dv) in &[
        (1, 1, 1, 1, 1, 1),
        (2, 5, 3, 3, 4, 3),
        (3, 13, 6, 2, 7, 5),
        (2, 70, 4, 2, 16, 16),
        (1, key + 30, 2, 2, 24, 8),
    ] {
        let (q, k, v) = (
            input(&[b, t, h, dk], 5),
            input(&[b, t, kv, dk], 6),
            input(&[b, t, kv, dv], 7),
        );
        let dout = input(&[b, t, h, dv], 8);
        let scores = Scores {
            scale: 1.0 / (dk as f32).sqrt(),
            softcap: None,
        };
        let ranges = KeyRanges::causal(b, t, None);
        let at = format!("{b}×{t}×{h}/{kv}×{dk}/{dv}");
        let wide = |x: &Bf16Tensor| x.to_f32();
        let want = flash_attention(&wide(&q), &wide(&k), &wide(&v), &ranges, scores, 1).unwrap();
        let (out, lse) = flash_attention_bf16(&q, &k, &v, &ranges, scores, 1).unwrap();
        // The f32 kernel on the same values: the bf16 kernel rounds the probabilities and dS
        // for their products, so the two agree to bf16's resolution, not bitwise.
        assert_close_rel(&out.to_f32(), &want.out, 2e-2, &format!("out {at}"));
        assert_close_rel(&lse, &want.lse, 1e-5, &format!("lse {at}"));
        let (wq, wk, wv) = flash_attention_backward(
            &wide(&q),
            &wide(&k),
            &wide(&v),
            &wide(&out),
            &lse,
            &wide(&dout),
            &ranges,
            scores,
            1,
        )
        .unwrap();
        let backward = |threads| {
            flash_attention_backward_bf16(&q, &k, &v, &out, &lse, &dout, &ranges, scores, threads)
                .unwrap()
        };
        let grads = backward(1);
        assert_close_rel(&grads.0.to_f32(), &wq, 3e-2, &format!("dq {at}"));
        assert_close_rel(&grads.1.to_f32(), &wk, 3e-2, &format!("dk {at}"));
        assert_close_rel(&grads.2.to_f32(), &wv, 3e-2, &format!("dv {at}"));
        for threads in [2, 3] {
            let again = flash_attention_bf16(&q, &k, &v, &ranges, scores, threads).unwrap();
            assert_eq!(
                again,
                (out.clone(), lse.clone()),
                "forward {at} on {threads}"
            );
            assert_eq!(backward(threads), grads, "backward {at} on {threads}");
        }
    }
    let q = input(&[1, 4, 3, 8], 1);
    let kv = input(&[1, 4, 2, 8], 2);
    let scores = Scores {
        scale: 1.0,
        softcap: None,
    };
    let ranges = KeyRanges::causal(1, 4, None);
    let e = flash_attention_bf16(&q, &kv, &kv, &ranges, scores, 1).unwrap_err();
    assert!(e.to_string().contains("H a multiple of KV"), "{e}");
    let kv = input(&[1, 4, 1, 8], 2);
    let (out, lse) = flash_attention_bf16(&q, &kv, &kv, &ranges, scores, 1).unwrap();
    let bad = input(&[1, 4, 3, 7], 3);
    let e = flash_attention_backward_bf16(&q, &kv, &kv, &out, &lse, &bad, &ranges, scores, 1)
        .unwrap_err();
    assert!(
        e.to_string().contains("out and dout must be [1, 4, 3, 8]"),
        "{e}"
    );
}

/// `got` within `rel` of `want`'s largest magnitude, element by element.
fn assert_close_rel(got: &Tensor, want: &Tensor, rel: f32, what: &str) {
    let scale = want.data().iter().fold(1e-30f32, |m, x| m.max(x.abs()));
    let worst = got
        .data()
        .iter()
        .zip(want.data())
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= rel * scale,
        "{what}: {worst:e} apart, largest {scale:e}"
    );
}

#[test]
fn rope_is_its_f32_kernel_rounded() {
    let rope = Rope::standard(10_000.0);
    for shape in [[2usize, 5, 3, 8], [3, 64, 4, 32]] {
        let x = input(&shape, 8);
        let positions: Vec<usize> = (0..shape[1]).map(|p| 3 * p + 1).collect();
        for inverse in [false, true] {
            let got = rope_bf16(&x, &positions, &rope, inverse).unwrap();
            let want = rope_with(&x.to_f32(), &positions, &rope, inverse).unwrap();
            assert_eq!(got, rounded(&want), "{shape:?} inverse {inverse}");
        }
        // Interleaved pairs, and a head's first elements passed through (DeepSeek's).
        let interleaved = Rope {
            interleaved: true,
            ..rope
        };
        for (r, pass) in [(rope, 2), (interleaved, 0), (interleaved, 4)] {
            let got = rope_tail_bf16(&x, &positions, &r, false, pass).unwrap();
            let want = crate::rope_tail(&x.to_f32(), &positions, &r, false, pass).unwrap();
            assert_eq!(got, rounded(&want), "{shape:?} pass {pass}");
        }
    }
    let e = rope_bf16(&input(&[2, 5, 3, 8], 1), &[0, 1], &rope, false).unwrap_err();
    assert!(e.to_string().contains("2 positions"), "{e}");
}

#[test]
fn row_kernels_refuse_shapes_that_do_not_fit() {
    let x = input(&[3, 4], 1);
    let e = rms_norm_bf16(&x, &Tensor::zeros(&[5]), 1e-6).unwrap_err();
    assert!(e.to_string().contains("scale [5] for rows of 4"), "{e}");
    let e = swiglu_bf16(&x, &input(&[4, 3], 1)).unwrap_err();
    assert!(e.to_string().contains("[3, 4] vs [4, 3]"), "{e}");
    assert!(add_bf16(&x, &input(&[12], 1)).is_err());
    let e = causal_softmax_bf16(&input(&[4, 3], 1), 1.0).unwrap_err();
    assert!(e.to_string().contains("Tk ≥ Tq"), "{e}");
    assert!(softmax_last_bf16(&input(&[3, 0], 1)).is_err());
}

/// Maps and equal-shape binary ops are the `f32` ones on the widened inputs, rounded, bit for
/// bit (a size that splits over several blocks, and a short one), and really round (the
/// mirror: `scale` by a value that is not a power of two changes bits below bf16's).
#[test]
fn elementwise_ops_are_their_f32_ops_rounded() {
    for shape in [[3usize, 5], [9, 4000]] {
        let (a, b) = (input(&shape, 21), input(&shape, 22));
        let (wa, wb) = (a.to_f32(), b.to_f32());
        assert_eq!(scale_bf16(&a, 0.3), rounded(&wa.map(|x| 0.3 * x)));
        assert_eq!(map_bf16(&a, f32::exp), rounded(&wa.map(f32::exp)));
        assert_eq!(mul_bf16(&a, &b).unwrap(), rounded(&wa.mul(&wb).unwrap()));
        let sub = zip_bf16(&a, &b, |p, q| p - q).unwrap();
        assert_eq!(sub, rounded(&wa.sub(&wb).unwrap()));
        let unrounded = wa.map(|x| 0.3 * x);
        let got = scale_bf16(&a, 0.3).to_f32();
        assert!(got.data().iter().zip(unrounded.data()).any(|(x, y)| x != y));
    }
    let e = mul_bf16(&input(&[3, 4], 1), &input(&[4, 3], 1)).unwrap_err();
    assert!(e.to_string().contains("[3, 4] vs [4, 3]"), "{e}");
}

/// Transposes move the same elements as the `f32` transpose (every permutation of a rank-3
/// tensor of odd sizes, and a rank-4 one of the attention layouts across several blocks);
/// `reshaped` shares the storage and refuses a wrong element count.
#[test]
fn transposes_and_reshapes_move_elements_as_f32_does() {
    let x = input(&[3, 5, 7], 31);
    for perm in [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ] {
        let want = x.to_f32().transpose(&perm).unwrap();
        assert_eq!(x.transpose(&perm).unwrap().to_f32(), want, "{perm:?}");
    }
    let y = input(&[2, 70, 4, 33], 32);
    let want = y.to_f32().transpose(&[0, 2, 1, 3]).unwrap();
    assert_eq!(y.transpose(&[0, 2, 1, 3]).unwrap().to_f32(), want);
    let r = y.reshaped(&[140, 132]).unwrap();
    assert_eq!(r.shape(), &[140, 132]);
    assert!(std::ptr::eq(r.data().as_ptr(), y.data().as_ptr()));
    let e = y.reshaped(&[5, 5]).unwrap_err();
    assert!(e.to_string().contains("18480 elements"), "{e}");
    assert_eq!(r.into_data(), y.data().to_vec());
}
