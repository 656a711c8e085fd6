// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use super::*;

fn deepseek() -> Rope {
    Rope {
        theta: 10_000.0,
        interleaved: true,
        yarn: Some(Yarn {
            factor: 40.0,
            original_max_position: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            attention_factor: 1.0,
        }),
        llama3: None,
        scaling: None,
    }
}

/// Positions given per (row, index) rotate each row by its own: a row of a packed sequence
/// whose second document starts at index 3 equals, there, the rotation at positions from 0.
#[test]
fn per_row_positions_restart_where_a_row_says() {
    let x = Tensor::from_fn(&[2, 5, 2, 4], |i| (i as f32 * 0.37).sin());
    let rope = Rope::standard(10_000.0);
    let shared = rope_tail(&x, &[0, 1, 2, 3, 4], &rope, false, 0).unwrap();
    let packed = [0, 1, 2, 3, 4, 0, 1, 2, 0, 1];
    let per_row = rope_tail(&x, &packed, &rope, false, 0).unwrap();
    let (row, chunk) = (5 * 8, 8);
    // Row 0 is the shared rotation; row 1's index 3 (position 0) is x itself, unrotated,
    // and its index 4 (position 1) is the shared rotation's index 1 of the same values.
    assert_eq!(&per_row.data()[..row], &shared.data()[..row]);
    let at = |t: &Tensor, s: usize| t.data()[row + s * chunk..row + (s + 1) * chunk].to_vec();
    assert_eq!(at(&per_row, 3), at(&x, 3));
    let moved = Tensor::new(vec![1, 2, 2, 4], [at(&x, 3), at(&x, 4)].concat()).unwrap();
    let want = rope_tail(&moved, &[0, 1], &rope, false, 0).unwrap();
    assert_eq!(at(&per_row, 4), want.data()[chunk..].to_vec());
    assert_ne!(at(&per_row, 4), at(&shared, 4));
    assert!(rope_tail(&x, &packed[..7], &rope, false, 0).is_err());
}

/// transformers' `linear` (every frequency over the factor) and `dynamic` (θ grown past
/// `max_position` by `(factor·L/max − (factor − 1))^(dim/(dim−2))`), by hand at dim 8.
#[test]
fn linear_and_dynamic_scalings_move_the_frequencies_as_transformers_does() {
    let plain = Rope::standard(1e4).frequencies(8);
    let linear = Rope {
        scaling: Some(PositionScaling::Linear { factor: 2.0 }),
        ..Rope::standard(1e4)
    };
    for (a, b) in linear.frequencies(8).iter().zip(&plain) {
        assert_eq!(*a, b / 2.0);
    }
    let dynamic = Rope {
        scaling: Some(PositionScaling::Dynamic {
            factor: 2.0,
            max_position: 16,
        }),
        ..Rope::standard(1e4)
    };
    assert_eq!(dynamic.frequencies_at(8, 16), plain, "up to max: plain");
    let theta = 1e4f64 * (2.0f64 * 24.0 / 16.0 - 1.0).powf(8.0 / 6.0);
    let want: Vec<f32> = (0..4)
        .map(|i| theta.powf(-(2.0 * i as f64) / 8.0) as f32)
        .collect();
    assert_eq!(dynamic.frequencies_at(8, 24), want);
}

/// Hand-computed for Llama 3.2's scaling (factor 32, low 1, high 4, original 8192) at
/// dim 64, θ 5e5: pair i has wavelength 2π·θ^(i/32). Below 8192/4 = 2048 positions the pair
/// keeps its frequency (i ≤ 14: 2π·5e5^(14/32) ≈ 1956), above 8192 it is divided by 32
/// (i ≥ 18: ≈ 10089), and pair 16 (≈ 4443) blends with smooth = (8192/4443 − 1) / 3.
#[test]
fn llama3_scaling_keeps_fast_pairs_divides_slow_ones_and_blends_between() {
    let plain = Rope::standard(500_000.0).frequencies(64);
    let rope = Rope {
        llama3: Some(Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 8192,
        }),
        ..Rope::standard(500_000.0)
    };
    let scaled = rope.frequencies(64);
    for i in 0..=14 {
        assert_eq!(scaled[i], plain[i], "pair {i} keeps its frequency");
    }
    for i in 18..32 {
        assert!(
            (scaled[i] - plain[i] / 32.0).abs() <= 1e-6 * plain[i],
            "pair {i}"
        );
    }
    let f = 500_000f64.powf(-16.0 / 32.0);
    let wavelen = 2.0 * std::f64::consts::PI / f;
    assert!((wavelen - 4442.88).abs() < 0.01, "{wavelen}");
    let smooth = (8192.0 / wavelen - 1.0) / 3.0;
    let want = ((1.0 - smooth) * f / 32.0 + smooth * f) as f32;
    assert!((scaled[16] - want).abs() <= 1e-6 * want);
    assert!(scaled[16] < plain[16] && scaled[16] > plain[16] / 32.0);
    assert_eq!(rope.attention_scale_factor(), 1.0);
}

/// Hand-computed: for dim 64, θ 1e4, 4096 positions, the ramp runs from pair
/// floor(64·ln(4096/(32·2π))/(2·ln 1e4)) = 10 to ceil(64·ln(4096/(2π))/(2·ln 1e4)) = 23.
#[test]
fn yarn_keeps_fast_pairs_and_interpolates_slow_ones() {
    let plain = Rope::standard(10_000.0).frequencies(64);
    let yarn = deepseek().frequencies(64);
    for i in 0..=10 {
        assert_eq!(yarn[i], plain[i], "pair {i} keeps its frequency");
    }
    for i in 23..32 {
        assert!(
            (yarn[i] - plain[i] / 40.0).abs() <= 1e-6 * plain[i],
            "pair {i} / 40"
        );
    }
    let mid = 16; // ramp (16-10)/13
    let ramp = 6.0 / 13.0;
    let want = plain[mid] / 40.0 * ramp + plain[mid] * (1.0 - ramp);
    assert!((yarn[mid] - want).abs() <= 1e-6 * want);
    let m = 0.1 * 40f32.ln() + 1.0;
    assert!((deepseek().attention_scale_factor() - m * m).abs() < 1e-6);
}

/// More keys than the cache keeps, twice over, each against the same rotation computed on
/// a fresh thread (an empty cache): a cached table has the bits of a fresh one, and a
/// different position list, direction, variant or width never gets another's table.
#[test]
fn cached_tables_give_the_bits_of_fresh_ones_and_only_for_their_own_key() {
    let x = Tensor::from_fn(&[3, 2, 8], |i| (i as f32 * 0.37).sin());
    let wide = Tensor::from_fn(&[3, 1, 16], |i| (i as f32 * 0.21).cos());
    let keys: Vec<(Tensor, Vec<usize>, Rope, bool)> = vec![
        (x.clone(), vec![0, 5, 9], deepseek(), false),
        (x.clone(), vec![0, 5, 9], deepseek(), true),
        (x.clone(), vec![0, 5, 8], deepseek(), false),
        (x.clone(), vec![0, 5, 9], Rope::standard(10_000.0), false),
        (x.clone(), vec![0, 5, 9], Rope::standard(500.0), false),
        (wide.clone(), vec![0, 5, 9], Rope::standard(10_000.0), false),
    ];
    assert!(keys.len() > CACHED_TABLES);
    for _round in 0..2 {
        for (x, positions, rope, inverse) in &keys {
            let here = rope_with(x, positions, rope, *inverse).unwrap();
            let (x, positions, rope, inverse) = (x.clone(), positions.clone(), *rope, *inverse);
            let fresh = std::thread::spawn(move || rope_with(&x, &positions, &rope, inverse))
                .join()
                .unwrap()
                .unwrap();
            assert_eq!(here, fresh);
        }
    }
}

/// Interleaved pairs rotate (2i, 2i+1); the inverse undoes it; norms are kept.
#[test]
fn interleaved_rotation_is_orthogonal_and_inverts() {
    let x = Tensor::from_fn(&[3, 2, 8], |i| (i as f32 * 0.37).sin());
    let rope = deepseek();
    let y = rope_with(&x, &[0, 5, 9], &rope, false).unwrap();
    assert_eq!(&y.data()[..16], &x.data()[..16], "position 0 does not turn");
    let back = rope_with(&y, &[0, 5, 9], &rope, true).unwrap();
    for (a, b) in back.data().iter().zip(x.data()) {
        assert!((a - b).abs() < 1e-5);
    }
    let freqs = rope.frequencies(8);
    let (sin, cos) = (5.0 * freqs[1]).sin_cos();
    let (x0, x1) = (x.data()[16 + 2], x.data()[16 + 3]);
    assert!((y.data()[16 + 2] - (x0 * cos - x1 * sin)).abs() < 1e-6);
    assert!((y.data()[16 + 3] - (x1 * cos + x0 * sin)).abs() < 1e-6);
}

/// YaRN's attention_factor scales the rotation: every position's pair norms grow by it,
/// and `inverse` is the transpose (⟨R x, y⟩ = ⟨x, inverse(y)⟩), the backward of a scaled
/// rotation, not its inverse.
#[test]
fn a_scaled_rotation_scales_norms_and_its_inverse_flag_is_the_transpose() {
    let mut rope = deepseek();
    if let Some(y) = rope.yarn.as_mut() {
        y.attention_factor = 1.25;
    }
    let x = Tensor::from_fn(&[3, 2, 8], |i| (i as f32 * 0.37).sin());
    let y = Tensor::from_fn(&[3, 2, 8], |i| (i as f32 * 0.71).cos());
    let positions = [0, 5, 9];
    let rx = rope_with(&x, &positions, &rope, false).unwrap();
    let ty = rope_with(&y, &positions, &rope, true).unwrap();
    let dot = |a: &Tensor, b: &Tensor| -> f64 {
        a.data()
            .iter()
            .zip(b.data())
            .map(|(p, q)| f64::from(p * q))
            .sum()
    };
    assert!((dot(&rx, &y) - dot(&x, &ty)).abs() < 1e-4);
    let norm = |a: &Tensor| dot(a, a).sqrt();
    assert!((norm(&rx) - 1.25 * norm(&x)).abs() < 1e-4 * norm(&x));
    let plain = rope_with(&x, &positions, &deepseek(), false).unwrap();
    for (a, b) in rx.data().iter().zip(plain.data()) {
        assert!((a - 1.25 * b).abs() < 1e-6);
    }
}

#[test]
fn a_rotated_tail_has_the_bits_of_the_tail_rotated_alone_and_the_head_passes_through() {
    let (b, t, h, pass, tail) = (2, 5, 3, 6, 4);
    let dim = pass + tail;
    let x = Tensor::from_fn(&[b, t, h, dim], |i| (i as f32 * 0.37).sin());
    let positions: Vec<usize> = (3..3 + t).collect();
    for rope in [deepseek(), Rope::standard(10_000.0)] {
        for inverse in [false, true] {
            let y = rope_tail(&x, &positions, &rope, inverse, pass).unwrap();
            // The reference: the tail copied out, rotated by `rope_with`, put back.
            let tail_of = |v: &Tensor| {
                Tensor::from_fn(&[b, t, h, tail], |i| {
                    v.data()[i / tail * dim + pass + i % tail]
                })
            };
            let want = rope_with(&tail_of(&x), &positions, &rope, inverse).unwrap();
            assert_eq!(tail_of(&y), want, "{rope:?} inverse {inverse}");
            for (row, (yr, xr)) in y.data().chunks(dim).zip(x.data().chunks(dim)).enumerate() {
                assert_eq!(yr[..pass], xr[..pass], "head {row} passes through");
            }
        }
    }
    let whole = rope_tail(&x, &positions, &deepseek(), false, 0).unwrap();
    assert_eq!(
        whole,
        rope_with(&x, &positions, &deepseek(), false).unwrap()
    );
    assert!(
        rope_tail(&x, &positions, &deepseek(), false, 5).is_err(),
        "odd tail"
    );
    assert!(
        rope_tail(&x, &positions, &deepseek(), false, dim + 2).is_err(),
        "past the head"
    );
}

/// Every rotated element is its pair's formula, to the bit: `x0·cos − x1·sin` and
/// `x1·cos + x0·sin` with `(sin, cos)` of `sign·p·f` (scaled by YaRN's factor), computed here
/// one element at a time, over head widths around the kernel's vector blocks (a short tail, a
/// whole block, blocks and a rest), both pairings, both directions, passed-through heads,
/// shared and per-row positions, on 1 and 2 threads.
#[test]
fn every_element_is_its_pairs_formula_to_the_bit() {
    let mut scaled = deepseek();
    if let Some(y) = scaled.yarn.as_mut() {
        y.attention_factor = 1.25;
    }
    let ropes = [
        Rope::standard(10_000.0),
        Rope {
            interleaved: true,
            ..Rope::standard(500.0)
        },
        scaled,
    ];
    // (head width, passed through, tokens, heads): the last is large enough to be split
    // over two threads.
    for (dim, pass, t, h) in [
        (2, 0, 5, 3),
        (8, 0, 5, 3),
        (32, 0, 5, 3),
        (34, 2, 5, 3),
        (40, 0, 5, 3),
        (64, 0, 5, 3),
        (96, 32, 5, 3),
        (128, 0, 5, 3),
        (100, 0, 5, 3),
        (32, 0, 128, 8),
    ] {
        let b = 2;
        let x = Tensor::from_fn(&[b, t, h, dim], |i| {
            ((i * 37 % 101) as f32 * 0.19).sin() * 3.0
        });
        let shared: Vec<usize> = (4..4 + t).collect();
        let per_row: Vec<usize> = (0..b * t).map(|i| (i * 3) % 11).collect();
        for rope in &ropes {
            for inverse in [false, true] {
                for positions in [&shared, &per_row] {
                    for threads in [1, 2] {
                        let y = crate::with_kernel_pool(threads, "rope-test", 1 << 20, || {
                            rope_tail(&x, positions, rope, inverse, pass)
                        })
                        .unwrap();
                        let tail = dim - pass;
                        let freqs =
                            rope.frequencies_at(tail, positions.iter().max().map_or(0, |p| p + 1));
                        let sign = if inverse { -1.0 } else { 1.0 };
                        let factor = rope.yarn.map_or(1.0, |y| y.attention_factor);
                        for (head, (ys, xs)) in
                            y.data().chunks(dim).zip(x.data().chunks(dim)).enumerate()
                        {
                            let s = head / h;
                            let p = positions[if positions.len() == t { s % t } else { s }];
                            assert_eq!(ys[..pass], xs[..pass]);
                            let (xs, ys) = (&xs[pass..], &ys[pass..]);
                            for (i, &f) in freqs.iter().enumerate() {
                                let (sin, cos) = crate::fixed_math::sin_cos(sign * p as f32 * f);
                                let (sin, cos) = if factor == 1.0 {
                                    (sin, cos)
                                } else {
                                    (sin * factor, cos * factor)
                                };
                                let (a, b) = if rope.interleaved {
                                    (2 * i, 2 * i + 1)
                                } else {
                                    (i, i + tail / 2)
                                };
                                let (x0, x1) = (xs[a], xs[b]);
                                let want = [x0 * cos - x1 * sin, x1 * cos + x0 * sin];
                                assert_eq!(
                                    [ys[a].to_bits(), ys[b].to_bits()],
                                    want.map(f32::to_bits),
                                    "dim {dim} pass {pass} {rope:?} inverse {inverse} head \
                                     {head} pair {i} on {threads} threads"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
