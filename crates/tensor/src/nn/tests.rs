//! The model kernels' tests: finite differences, and bitwise agreement with serial references
//! on any thread count.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use super::*;
use crate::fastmath::{exp, sigmoid};
use crate::rope::{rope_with, Rope};

fn t(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::new(shape.to_vec(), data.to_vec()).unwrap()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{x} vs {y}\n{a:?}\n{b:?}"
        );
    }
}

/// Central differences of a scalar function of a tensor, in f64 around f32 data.
fn numeric_grad(x: &Tensor, f: impl Fn(&Tensor) -> f64) -> Vec<f32> {
    let h = 1e-3f32;
    (0..x.len())
        .map(|i| {
            let mut p = x.clone();
            let mut m = x.clone();
            p.data_mut()[i] += h;
            m.data_mut()[i] -= h;
            ((f(&p) - f(&m)) / (2.0 * h as f64)) as f32
        })
        .collect()
}

fn weighted_sum(y: &Tensor, w: &Tensor) -> f64 {
    y.data()
        .iter()
        .zip(w.data())
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum()
}

#[test]
fn softmax_is_stable_and_its_backward_matches_finite_differences() {
    let x = t(&[2, 3], &[1000., 1001., 1002., -1., 0., 1.]);
    let y = softmax_last(&x).unwrap();
    let e = [(-2f32).exp(), (-1f32).exp(), 1.0];
    let s: f32 = e.iter().sum();
    close(&y.data()[..3], &[e[0] / s, e[1] / s, e[2] / s], 1e-6);
    close(&y.data()[3..], &[e[0] / s, e[1] / s, e[2] / s], 1e-6);
    let x = t(&[2, 3], &[0.1, -0.4, 0.3, 0.9, 0.2, -0.5]);
    let w = t(&[2, 3], &[1., 2., -1., 0.5, -2., 3.]);
    let dx = softmax_last_backward(&softmax_last(&x).unwrap(), &w).unwrap();
    close(
        dx.data(),
        &numeric_grad(&x, |x| weighted_sum(&softmax_last(x).unwrap(), &w)),
        1e-2,
    );
}

#[test]
fn causal_softmax_matches_masked_softmax() {
    let x = Tensor::from_fn(&[2, 3, 3], |i| ((i * 7) % 5) as f32 * 0.3);
    let y = causal_softmax(&x, 1.0).unwrap();
    let masked = x
        .map(|v| v)
        .zip_with(
            &Tensor::from_fn(&[3, 3], |i| if i % 3 > i / 3 { -1e30 } else { 0.0 }),
            |a, b| a + b,
        )
        .unwrap();
    close(y.data(), softmax_last(&masked).unwrap().data(), 1e-6);
    assert!(causal_softmax(&Tensor::zeros(&[3, 2]), 1.0).is_err());
    // the scale is folded in, and its backward matches finite differences
    let w = Tensor::from_fn(&[2, 3, 3], |i| (i % 4) as f32 - 1.5);
    let ys = causal_softmax(&x, 0.5).unwrap();
    close(
        ys.data(),
        causal_softmax(&x.scale(0.5), 1.0).unwrap().data(),
        1e-6,
    );
    let dx = softmax_backward_scaled(&ys, &w, 0.5).unwrap();
    close(
        dx.data(),
        &numeric_grad(&x, |x| weighted_sum(&causal_softmax(x, 0.5).unwrap(), &w)),
        1e-2,
    );
}

#[test]
fn rms_norm_forward_and_backward() {
    let x = t(&[2, 4], &[1., 2., 3., 4., -1., 0.5, 0., 2.]);
    let s = t(&[4], &[1., 0.5, 2., -1.]);
    let (y, inv) = rms_norm(&x, &s, 1e-6).unwrap();
    let r0 = 1.0 / (30.0f32 / 4.0 + 1e-6).sqrt();
    close(
        &y.data()[..4],
        &[r0, 0.5 * 2. * r0, 2. * 3. * r0, -4. * r0],
        1e-6,
    );
    let w = t(&[2, 4], &[0.3, -1., 2., 0.5, 1., 1., -0.5, 0.25]);
    let (dx, ds) = rms_norm_backward(&x, &s, &inv, &w).unwrap();
    close(
        dx.data(),
        &numeric_grad(&x, |x| weighted_sum(&rms_norm(x, &s, 1e-6).unwrap().0, &w)),
        1e-2,
    );
    close(
        ds.data(),
        &numeric_grad(&s, |s| weighted_sum(&rms_norm(&x, s, 1e-6).unwrap().0, &w)),
        1e-2,
    );
}

#[test]
fn rope_rotates_pairs_and_inverts() {
    // one sequence of 2 positions, 1 head, head_dim 4
    let x = t(&[2, 1, 4], &[1., 2., 3., 4., 1., 2., 3., 4.]);
    let y = rope(&x, &[0, 1], 10000.0, false).unwrap();
    close(&y.data()[..4], &[1., 2., 3., 4.], 1e-6); // position 0: identity
    let (f0, f1) = (1.0f32, 10000f32.powf(-0.5));
    let (s0, c0) = f0.sin_cos();
    let (s1, c1) = f1.sin_cos();
    close(
        &y.data()[4..],
        &[
            1. * c0 - 3. * s0,
            2. * c1 - 4. * s1,
            3. * c0 + 1. * s0,
            4. * c1 + 2. * s1,
        ],
        1e-6,
    );
    let back = rope(&y, &[0, 1], 10000.0, true).unwrap();
    close(back.data(), x.data(), 1e-6);
    assert!(rope(&t(&[2, 3], &[0.; 6]), &[0, 1], 1e4, false).is_err());
}

#[test]
fn swiglu_and_its_backward() {
    let g = t(&[4], &[-2., -0.3, 0.5, 3.]);
    let u = t(&[4], &[1., -1., 2., 0.5]);
    let w = t(&[4], &[0.5, 1., -1., 2.]);
    close(
        swiglu(&g, &u).unwrap().data(),
        silu(&g).mul(&u).unwrap().data(),
        1e-6,
    );
    let (dg, du) = swiglu_backward(&g, &u, &w).unwrap();
    close(
        dg.data(),
        &numeric_grad(&g, |g| weighted_sum(&swiglu(g, &u).unwrap(), &w)),
        1e-2,
    );
    close(
        du.data(),
        &numeric_grad(&u, |u| weighted_sum(&swiglu(&g, u).unwrap(), &w)),
        1e-2,
    );
}

/// GeGLU against the tanh GELU as torch writes it (`½x(1 + tanh(√(2/π)(x + 0.044715x³)))`),
/// and its derivative by hand, both in `f64` (the kernel computes `x·σ(2y)`, the same function);
/// and the backward against finite differences.
#[test]
fn geglu_is_the_tanh_gelu_times_up_and_its_backward_matches() {
    let n = 801;
    let g = Tensor::from_fn(&[n], |i| i as f32 * 0.02 - 8.0);
    let u = Tensor::from_fn(&[n], |i| 1.5 - (i % 7) as f32 * 0.4);
    let dy = Tensor::from_fn(&[n], |i| 0.5 + (i % 5) as f32 * 0.3);
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let y = glu(&g, &u, GluActivation::GeluTanh).unwrap();
    let (dg, du) = glu_backward(&g, &u, &dy, GluActivation::GeluTanh).unwrap();
    for i in 0..n {
        let (x, uv, d) = (
            f64::from(g.data()[i]),
            f64::from(u.data()[i]),
            f64::from(dy.data()[i]),
        );
        let inner = k * (x + 0.044_715 * x * x * x);
        let t = inner.tanh();
        let gelu = 0.5 * x * (1.0 + t);
        let dgelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044_715 * x * x);
        let near = |got: f32, want: f64, what: &str| {
            let tol = 2e-6 * want.abs().max(1.0);
            assert!(
                (f64::from(got) - want).abs() <= tol,
                "{what}({x}): {got} vs {want}"
            );
        };
        near(y.data()[i], gelu * uv, "geglu");
        near(dg.data()[i], d * uv * dgelu, "dg");
        near(du.data()[i], d * gelu, "du");
    }
    let (g, u, w) = (
        t(&[4], &[-2., -0.3, 0.5, 3.]),
        t(&[4], &[1., -1., 2., 0.5]),
        t(&[4], &[0.5, 1., -1., 2.]),
    );
    let geglu = |g: &Tensor, u: &Tensor| glu(g, u, GluActivation::GeluTanh).unwrap();
    let (dg, du) = glu_backward(&g, &u, &w, GluActivation::GeluTanh).unwrap();
    close(
        dg.data(),
        &numeric_grad(&g, |g| weighted_sum(&geglu(g, &u), &w)),
        1e-2,
    );
    close(
        du.data(),
        &numeric_grad(&u, |u| weighted_sum(&geglu(&g, u), &w)),
        1e-2,
    );
    // SwiGLU through the same entry point is `swiglu`, to the bit.
    assert_eq!(
        glu(&g, &u, GluActivation::Silu).unwrap(),
        swiglu(&g, &u).unwrap()
    );
}

#[test]
fn silu_backward_matches_finite_differences() {
    let x = t(&[5], &[-3., -0.5, 0., 0.7, 4.]);
    let w = t(&[5], &[1., 2., 3., -1., 0.5]);
    let dx = silu_backward(&x, &w).unwrap();
    close(
        dx.data(),
        &numeric_grad(&x, |x| weighted_sum(&silu(x), &w)),
        1e-2,
    );
}

#[test]
fn cross_entropy_sums_masked_losses_and_its_backward_matches() {
    let logits = t(
        &[3, 4],
        &[0.1, 2., -1., 0.5, 1., 1., 1., 1., 3., 0., 0., -2.],
    );
    let targets = [1, 2, 3];
    let mask = [1., 0., 1.];
    let ce = cross_entropy(&logits, &targets, &mask, 0.0).unwrap();
    let lse = |r: &[f32]| r.iter().map(|v| v.exp()).sum::<f32>().ln();
    let want = (lse(&logits.data()[..4]) - 2.) + (lse(&logits.data()[8..]) + 2.);
    assert!(
        (ce.loss_sum - want).abs() < 1e-5,
        "{} vs {want}",
        ce.loss_sum
    );
    assert_eq!(ce.count, 2.0);
    for z in [0.0, 0.1] {
        let ce = cross_entropy(&logits, &targets, &mask, z).unwrap();
        let d = cross_entropy_backward(&ce, &targets, &mask, z, 1.0).unwrap();
        let num = numeric_grad(&logits, |l| {
            cross_entropy(l, &targets, &mask, z).unwrap().loss_sum as f64
        });
        close(d.data(), &num, 1e-2);
        assert!(
            d.data()[4..8].iter().all(|&v| v == 0.0),
            "masked row has no gradient"
        );
    }
    let with_z = cross_entropy(&logits, &targets, &mask, 0.5)
        .unwrap()
        .loss_sum;
    let z_term = 0.5 * (lse(&logits.data()[..4]).powi(2) + lse(&logits.data()[8..]).powi(2));
    assert!((with_z - want - z_term).abs() < 1e-4);
    assert!(cross_entropy(&logits, &[1, 2, 4], &mask, 0.0).is_err());
}

#[test]
fn gather_and_scatter_add_are_adjoint() {
    let x = Tensor::from_fn(&[2, 3, 2], |i| i as f32);
    let g = gather(&x, 1, &[2, 0, 2]).unwrap();
    assert_eq!(g.shape(), &[2, 3, 2]);
    assert_eq!(&g.data()[..6], &[4., 5., 0., 1., 4., 5.]);
    let s = scatter_add(&[2, 3, 2], 1, &[2, 0, 2], &Tensor::full(&[2, 3, 2], 1.0)).unwrap();
    assert_eq!(&s.data()[..6], &[1., 1., 0., 0., 2., 2.]);
    // <gather(x), y> == <x, scatter_add(y)>
    let y = Tensor::from_fn(&[2, 3, 2], |i| (i as f32).sin());
    let lhs = weighted_sum(&g, &y);
    let rhs = weighted_sum(&x, &scatter_add(&[2, 3, 2], 1, &[2, 0, 2], &y).unwrap());
    assert!((lhs - rhs).abs() < 1e-5);
    assert!(gather(&x, 1, &[3]).is_err());
}

/// `scatter_add_into` adds rows into what `dest` holds (hand values), with the bits of
/// `dest + scatter_add(src)` where repeated rows round differently summed one by one into
/// `dest`; a bad index or size is an error that adds nothing.
#[test]
fn scatter_add_into_adds_rows_into_the_destination() {
    let mut dest = vec![10.0, 20.0, 30.0, 40.0, 50.0, 60.0];
    let src = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    scatter_add_into(&mut dest, 2, &[2, 0, 2], &src).unwrap();
    assert_eq!(dest, [13.0, 24.0, 30.0, 40.0, 56.0, 68.0]);
    // 1 + 2⁻²⁴ + 2⁻²⁴: one by one the halves of an ulp round away; summed first they count.
    let tiny = f32::EPSILON / 2.0;
    let mut one = vec![1.0f32];
    scatter_add_into(&mut one, 1, &[0, 0], &[tiny, tiny]).unwrap();
    let table = scatter_add(
        &[1, 1],
        0,
        &[0, 0],
        &Tensor::new(vec![2, 1], vec![tiny, tiny]).unwrap(),
    )
    .unwrap();
    assert_eq!(one[0], 1.0 + table.data()[0]);
    assert_ne!(one[0], 1.0 + tiny + tiny);
    let before = dest.clone();
    assert!(scatter_add_into(&mut dest, 2, &[3, 0, 1], &src).is_err());
    assert!(scatter_add_into(&mut dest, 2, &[0, 1], &src).is_err());
    assert!(scatter_add_into(&mut dest, 4, &[0], &src[..4]).is_err());
    assert_eq!(dest, before);
    assert!(scatter_add_into(&mut [], 0, &[], &[]).is_ok());
}

/// A table in parts of whole rows (a reduce-scatter bucket's segments) takes each row's sum
/// in the part holding it, with the bits of the whole table; parts that would cut a row
/// (the mirror) or are unequal are left untouched (`false`); a bad index is an error.
#[test]
fn scatter_add_into_parts_adds_each_row_into_the_part_holding_it() {
    let (width, rows) = (3, 6);
    let start: Vec<f32> = (0..rows * width).map(|i| i as f32 * 0.31 - 2.0).collect();
    let indices = [5, 0, 2, 5, 3, 0, 5];
    let src: Vec<f32> = (0..indices.len() * width)
        .map(|i| (i as f32 * 0.77).sin())
        .collect();
    let mut whole = start.clone();
    scatter_add_into(&mut whole, width, &indices, &src).unwrap();
    for p in [1, 2, 3, 6] {
        let mut table = start.clone();
        let mut parts: Vec<&mut [f32]> = table.chunks_mut(rows * width / p).collect();
        assert!(scatter_add_into_parts(&mut parts, width, &indices, &src).unwrap());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&table), bits(&whole), "{p} parts");
    }
    // Unequal parts (4 rows and 2), and rows of 2 in two parts of 9 elements (4.5 rows).
    let mut table = start.clone();
    let (a, b) = table.split_at_mut(width * 4);
    let mut unequal: Vec<&mut [f32]> = vec![a, b];
    assert!(!scatter_add_into_parts(&mut unequal, width, &indices, &src).unwrap());
    let mut halves: Vec<&mut [f32]> = table.chunks_mut(9).collect();
    assert!(!scatter_add_into_parts(&mut halves, 2, &[0], &[1.0, 2.0]).unwrap());
    assert_eq!(table, start, "untouched");
    let mut parts: Vec<&mut [f32]> = table.chunks_mut(9).collect();
    assert!(scatter_add_into_parts(&mut parts, width, &[6], &src[..3]).is_err());
}

fn rand(shape: &[usize], seed: u32) -> Tensor {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    Tensor::from_fn(shape, |_| {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s % 4000) as f32 / 1000.0 - 2.0
    })
}

/// Plain serial versions of the row kernels, written out here as the baseline.
mod reference {
    use super::Tensor;
    use crate::fastmath::exp;

    /// The order the kernels sum a row in, written out: term `i` into partial `i mod 16`,
    /// the partials folded `j + 8`, `+ 4`, `+ 2`, `+ 1`.
    pub fn lanes(terms: impl Iterator<Item = f32>) -> f32 {
        let mut p = [0.0f32; 16];
        for (i, t) in terms.enumerate() {
            p[i % 16] += t;
        }
        for w in [8, 4, 2, 1] {
            for j in 0..w {
                p[j] += p[j + w];
            }
        }
        p[0]
    }

    /// As [`lanes`], in `f64` with 8 partials.
    pub fn lanes_f64(terms: impl Iterator<Item = f32>) -> f64 {
        let mut p = [0.0f64; 8];
        for (i, t) in terms.enumerate() {
            p[i % 8] += f64::from(t);
        }
        for w in [4, 2, 1] {
            for j in 0..w {
                p[j] += p[j + w];
            }
        }
        p[0]
    }

    pub fn softmax(x: &Tensor, n: usize, causal: Option<f32>) -> Vec<f32> {
        let mut y = x.data().to_vec();
        for (k, row) in y.chunks_mut(n).enumerate() {
            let (keep, scale) = causal.map_or((n, 1.0), |s| (k % n + 1, s));
            let (live, masked) = row.split_at_mut(keep);
            let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for v in live.iter_mut() {
                *v = if causal.is_some() {
                    exp((*v - max) * scale)
                } else {
                    exp(*v - max)
                };
            }
            let inv = 1.0 / lanes(live.iter().copied());
            live.iter_mut().for_each(|v| *v *= inv);
            masked.fill(0.0);
        }
        y
    }

    pub fn rms_norm(x: &[f32], s: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
        let n = s.len();
        let (mut y, mut inv) = (Vec::new(), Vec::new());
        for row in x.chunks(n) {
            let ms = lanes(row.iter().map(|v| v * v)) / n as f32;
            let r = 1.0 / (ms + eps).sqrt();
            y.extend(row.iter().zip(s).map(|(v, s)| v * (r * s)));
            inv.push(r);
        }
        (y, inv)
    }

    /// dscale's order written out: each group of `4096 / n` rows (at least one) summed in
    /// row order from zero, then the groups' sums added in group order.
    pub fn rms_norm_backward(x: &[f32], s: &[f32], inv: &[f32], dy: &[f32]) -> Vec<f32> {
        let n = s.len();
        let group = (4096 / n).max(1);
        let mut dx = vec![0.0; x.len()];
        let mut ds = vec![0.0f32; n];
        let mut part = vec![0.0f32; n];
        for (row, &r) in inv.iter().enumerate() {
            let (xr, dyr) = (&x[row * n..][..n], &dy[row * n..][..n]);
            for i in 0..n {
                part[i] += dyr[i] * (xr[i] * r);
            }
            if row % group == group - 1 || row == inv.len() - 1 {
                for i in 0..n {
                    ds[i] += part[i];
                }
                part.fill(0.0);
            }
            let mean_gn = lanes((0..n).map(|i| dyr[i] * s[i] * (xr[i] * r))) / n as f32;
            for i in 0..n {
                dx[row * n + i] = r * (dyr[i] * s[i] - xr[i] * r * mean_gn);
            }
        }
        dx.extend(ds);
        dx
    }
}

/// Every threaded kernel gives the serial reference's bits on odd shapes (1, primes,
/// sizes that are not multiples of the chunk) and on 1, 2 or 3 threads.
#[test]
fn threaded_row_kernels_match_serial_references_bitwise() {
    let shapes: &[(usize, usize)] = &[(1, 1), (3, 7), (37, 131), (257, 131), (1031, 64)];
    for &(rows, n) in shapes {
        let x = rand(&[rows, n], 1);
        let w = rand(&[rows, n], 2);
        let s = rand(&[n], 3);
        let targets: Vec<u32> = (0..rows as u32).map(|i| (i * 31) % n as u32).collect();
        let mask: Vec<f32> = (0..rows).map(|i| [1.0, 0.0, 0.5][i % 3]).collect();
        for threads in [1, 2, 3] {
            crate::set_kernel_threads(threads);
            let at = format!("{rows}×{n} on {threads} threads");
            let sm = softmax_last(&x).unwrap();
            assert_eq!(sm.data(), reference::softmax(&x, n, None), "softmax {at}");
            let back = softmax_backward_scaled(&sm, &w, 0.7).unwrap();
            let want: Vec<f32> = w
                .data()
                .chunks(n)
                .zip(sm.data().chunks(n))
                .flat_map(|(d, y)| {
                    let dot = reference::lanes(d.iter().zip(y).map(|(d, y)| d * y));
                    d.iter().zip(y).map(move |(d, y)| 0.7 * y * (d - dot))
                })
                .collect();
            assert_eq!(back.data(), want, "softmax backward {at}");
            let sq = rand(&[rows, n, n], 4);
            assert_eq!(
                causal_softmax(&sq, 0.3).unwrap().data(),
                reference::softmax(&sq, n, Some(0.3)),
                "causal softmax {at}"
            );
            let (y, inv) = rms_norm(&x, &s, 1e-6).unwrap();
            let (wy, winv) = reference::rms_norm(x.data(), s.data(), 1e-6);
            assert_eq!((y.data(), &inv), (wy.as_slice(), &winv), "rms_norm {at}");
            let (dx, ds) = rms_norm_backward(&x, &s, &inv, &w).unwrap();
            let want = reference::rms_norm_backward(x.data(), s.data(), &inv, w.data());
            assert_eq!(dx.data(), &want[..x.len()], "rms_norm dx {at}");
            assert_eq!(ds.data(), &want[x.len()..], "rms_norm dscale {at}");
            let silu_want: Vec<f32> = x.data().iter().map(|&v| v * sigmoid(v)).collect();
            assert_eq!(silu(&x).data(), silu_want, "silu {at}");
            let sw = swiglu(&x, &w).unwrap();
            let sw_want: Vec<f32> = silu_want.iter().zip(w.data()).map(|(a, b)| a * b).collect();
            let sw_want2: Vec<f32> = x
                .data()
                .iter()
                .zip(w.data())
                .map(|(&a, &b)| a * sigmoid(a) * b)
                .collect();
            assert_eq!(sw.data(), sw_want2, "swiglu {at}");
            close(sw.data(), &sw_want, 1e-6);
            let (dg, du) = swiglu_backward(&x, &w, &sm).unwrap();
            let silu_dx = silu_backward(&x, &w).unwrap();
            for i in 0..x.len() {
                let (a, b, d) = (x.data()[i], w.data()[i], sm.data()[i]);
                let sg = sigmoid(a);
                assert_eq!(dg.data()[i], d * b * sg * (1.0 + a * (1.0 - sg)), "dg {at}");
                assert_eq!(du.data()[i], d * a * sg, "du {at}");
                let want = w.data()[i] * sg * (1.0 + a * (1.0 - sg));
                assert_eq!(silu_dx.data()[i], want, "silu' {at}");
            }
            for z in [0.0, 1e-4] {
                let ce = cross_entropy(&x, &targets, &mask, z).unwrap();
                let mut loss = 0.0f64;
                for (i, row) in x.data().chunks(n).enumerate() {
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = row.iter().map(|&v| exp(v - max)).collect();
                    let sum = reference::lanes_f64(e.iter().copied());
                    let probs: Vec<f32> = e.iter().map(|&v| v * (1.0 / sum) as f32).collect();
                    assert_eq!(&ce.probs().data()[i * n..][..n], probs, "ce probs {at}");
                    let lz = max as f64 + sum.ln();
                    assert_eq!(ce.log_z[i], lz as f32, "log Z {at}");
                    if mask[i] != 0.0 {
                        let t = targets[i] as usize;
                        loss += mask[i] as f64 * (lz - row[t] as f64 + z as f64 * lz * lz);
                    }
                }
                assert_eq!(ce.loss_sum, loss as f32, "ce loss {at}");
                let d = cross_entropy_backward(&ce, &targets, &mask, z, 0.5).unwrap();
                for (i, row) in d.data().chunks(n).enumerate() {
                    let k = 0.5 * mask[i];
                    let kp = k * (1.0 + 2.0 * z * ce.log_z[i]);
                    for (j, &g) in row.iter().enumerate() {
                        let mut want = ce.probs().data()[i * n + j] * kp;
                        if j == targets[i] as usize {
                            want -= k;
                        }
                        assert_eq!(g, want, "ce backward {at}");
                    }
                }
            }
        }
    }
    crate::set_kernel_threads(1);
}

/// RoPE on 1, 2 or 3 threads gives the bits of a plain loop over (batch, position, head).
#[test]
fn threaded_rope_matches_a_serial_loop_bitwise() {
    for &(b, seq, heads, dim) in &[(1, 1, 1, 2), (3, 7, 5, 6), (2, 131, 7, 64)] {
        let x = rand(&[b, seq, heads, dim], 9);
        let positions: Vec<usize> = (0..seq).map(|p| p * 3 + 1).collect();
        for interleaved in [false, true] {
            let rope = Rope {
                theta: 1e4,
                interleaved,
                yarn: None,
                llama3: None,
                scaling: None,
            };
            let freqs = rope.frequencies(dim);
            let half = dim / 2;
            let mut want = x.data().to_vec();
            for bi in 0..b {
                for (s, &p) in positions.iter().enumerate() {
                    for h in 0..heads {
                        let at = ((bi * seq + s) * heads + h) * dim;
                        for (i, &f) in freqs.iter().enumerate() {
                            let (sin, cos) = crate::fixed_math::sin_cos(p as f32 * f);
                            let (j0, j1) = if interleaved {
                                (at + 2 * i, at + 2 * i + 1)
                            } else {
                                (at + i, at + half + i)
                            };
                            let (x0, x1) = (x.data()[j0], x.data()[j1]);
                            want[j0] = x0 * cos - x1 * sin;
                            want[j1] = x1 * cos + x0 * sin;
                        }
                    }
                }
            }
            for threads in [1, 2, 3] {
                crate::set_kernel_threads(threads);
                let y = rope_with(&x, &positions, &rope, false).unwrap();
                assert_eq!(y.data(), want, "{b}×{seq}×{heads}×{dim} on {threads}");
            }
        }
    }
    crate::set_kernel_threads(1);
}

#[test]
fn top_k_is_descending_with_ties_to_the_lower_index() {
    let x = t(&[2, 4], &[0.5, 2., 2., -1., 3., 1., 0., 3.]);
    let (v, i) = top_k(&x, 2).unwrap();
    assert_eq!(v.data(), &[2., 2., 3., 3.]);
    assert_eq!(i, vec![1, 2, 0, 3]);
    assert!(top_k(&x, 5).is_err());
}

/// Both selection paths against a full stable sort, on rows with many ties, NaNs, signed
/// zeros and infinities, for every k.
#[test]
fn top_k_matches_a_full_sort() {
    let specials = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
    ];
    for n in [1usize, 2, 7, 16, 31, 67] {
        let x = Tensor::from_fn(&[3, n], |i| {
            if i % 11 == 5 {
                specials[i % specials.len()]
            } else {
                ((i * 7919) % 9) as f32 - 4.0
            }
        });
        for k in 1..=n {
            let (v, idx) = top_k(&x, k).unwrap();
            for (r, row) in x.data().chunks(n).enumerate() {
                let mut order: Vec<u32> = (0..n as u32).collect();
                order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
                assert_eq!(&idx[r * k..(r + 1) * k], &order[..k], "n {n} k {k}");
                for (j, &i) in order[..k].iter().enumerate() {
                    assert_eq!(v.data()[r * k + j].to_bits(), row[i as usize].to_bits());
                }
            }
        }
    }
}

#[test]
fn causal_softmax_over_a_cache_is_the_last_rows_of_the_square_mask() {
    // 7 keys; the last 3 are the new queries: their rows must equal the square mask's
    // last rows, and a single query sees every key.
    let (tk, tq) = (7, 3);
    let square = rand(&[2, tk, tk], 9);
    let full = causal_softmax(&square, 0.4).unwrap();
    let tail = square.slice(&[0..2, tk - tq..tk, 0..tk]).unwrap();
    let step = causal_softmax(&tail, 0.4).unwrap();
    let want = full.slice(&[0..2, tk - tq..tk, 0..tk]).unwrap();
    assert_eq!(step.data(), want.data());
    let one = causal_softmax(&square.slice(&[0..1, tk - 1..tk, 0..tk]).unwrap(), 0.4).unwrap();
    assert!(one.data().iter().all(|&p| p > 0.0), "{:?}", one.data());
    let err = causal_softmax(&rand(&[4, 3], 1), 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("Tk ≥ Tq"), "{err}");
}

/// Cross-entropy on long rows (the other tests' rows are at most 131 long) whose exponentials
/// span the whole `f32` range, a length with a tail of the 8 `f64` lanes and one without: log Z
/// and the probabilities equal the serial reference's, bit for bit.
#[test]
fn cross_entropy_of_long_wide_rows_is_the_serial_reference() {
    for n in [1000usize, 1003] {
        let logits = Tensor::from_fn(&[2, n], |i| {
            let j = i % n;
            -((j * 7919 % n) as f32) * 0.087 + (j % 3) as f32 * 1e-3
        });
        let (targets, mask) = (vec![3u32, 7], vec![1.0f32, 1.0]);
        let ce = cross_entropy(&logits, &targets, &mask, 0.0).unwrap();
        for (i, row) in logits.data().chunks(n).enumerate() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = row.iter().map(|&v| exp(v - max)).collect();
            let sum = reference::lanes_f64(e.iter().copied());
            assert_eq!(ce.log_z[i], (max as f64 + sum.ln()) as f32, "log Z, n {n}");
            let probs: Vec<f32> = e.iter().map(|&v| v * (1.0 / sum) as f32).collect();
            assert_eq!(&ce.probs().data()[i * n..][..n], probs, "probs, n {n}");
        }
    }
}
