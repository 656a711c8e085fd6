//! bf16 arrays (docs/design.md §10): `cast` rounds to nearest even and widens exactly, a bf16
//! product is the product of the bf16 operands rounded once, mixed dtypes are refused by name,
//! and the gradient path keeps the mission's guarantee: a `{R:data}` f32 weight used in bf16
//! gets an f32 `{U:data}` gradient with no collective, an untagged one an all-reduce (mirror).
//! The baselines are host arithmetic in f64 on the rounded values, written here.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_sharding::{DType, PartitionSpec};
use ferrotext_spmd::{SpmdError, TypeErrorKind};
use ferrotext_tensor::{round_bf16, widen_bf16, DotDims, Tensor};

/// `x` rounded to bf16 and back, on the host: the reference rounding.
fn host_round(x: f64) -> f64 {
    f64::from(widen_bf16(round_bf16(x as f32)))
}

/// The spacing of bf16 values at `x` (one unit in the last place).
fn bf16_ulp(x: f64) -> f64 {
    let e = x.abs().max(f64::MIN_POSITIVE).log2().floor();
    2f64.powf(e - 7.0)
}

#[test]
fn cast_rounds_to_nearest_even_and_widens_exactly() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: the tie goes to the even mantissa (1). 1 + 3·2⁻⁸
    // is halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶ and goes up to the even one (1 + 2⁻⁶); just above
    // a half rounds up; -0 and a large value keep their sign and magnitude class.
    let input = [
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
        1.0 + 2f32.powi(-8) + 2f32.powi(-20),
        -0.0,
        3.0e38,
        -2.5,
        1.0e-3,
        65504.0,
    ];
    let want = [
        1.0,
        1.0 + 2f32.powi(-6),
        1.0 + 2f32.powi(-7),
        -0.0,
        3.0e38_f32,
        -2.5,
        0.000_999_450_7,
        65536.0,
    ];
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let x = place(
            cx,
            &Tensor::new(vec![8], input.to_vec())?,
            p(&["data"], &[], &[]),
        );
        let b = cx.cast(&x, DType::BF16)?;
        let back = cx.cast(&b, DType::F32)?;
        let full = cx.reshard(&back, &PartitionSpec::replicated())?;
        Ok((b.ty().to_string(), local(&full), b.local_bf16().is_some()))
    });
    for ((ty, values, stored_bf16), _) in out {
        assert_eq!(ty, "bf16[8@data]");
        assert!(stored_bf16, "a bf16 array stores bf16");
        for (i, (&got, &w)) in values.iter().zip(&want).enumerate() {
            let w = if i == 4 {
                // 3e38 rounds to the nearest bf16 (computed independently of `round_bf16`: the
                // top 16 bits of the f32 with the dropped half compared to a half).
                let bits = 3.0e38_f32.to_bits();
                let up =
                    (bits & 0xffff) > 0x8000 || ((bits & 0xffff) == 0x8000 && bits & 0x10000 != 0);
                f32::from_bits(((bits >> 16) + u32::from(up)) << 16)
            } else if i == 6 {
                f32::from_bits(round_half_even_bits(1.0e-3))
            } else {
                w
            };
            assert_eq!(got.to_bits(), w.to_bits(), "element {i}: {got} vs {w}");
        }
    }
}

/// The bf16 rounding of `x` by integer arithmetic on its bits (independent of the library).
fn round_half_even_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    let low = bits & 0xffff;
    let up = low > 0x8000 || (low == 0x8000 && bits & 0x10000 != 0);
    ((bits >> 16) + u32::from(up)) << 16
}

fn x_value(b: usize, d: usize) -> Tensor {
    Tensor::from_fn(&[b, d], |i| ((i * 37 % 23) as f32 - 11.0) * 0.0731)
}

fn w_value(d: usize, f: usize) -> Tensor {
    Tensor::from_fn(&[d, f], |i| ((i * 13 % 29) as f32 - 14.0) * 0.0237)
}

#[test]
fn a_bf16_product_is_the_product_of_the_rounded_operands_rounded_once() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let (b, d, f) = (8, 48, 12);
    let (xv, wv) = (x_value(b, d), w_value(d, f));
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let x = place(cx, &xv, p(&["data", ""], &[], &[]));
        let w = place(cx, &wv, p(&["", ""], &[], &[]));
        let (xb, wb) = (cx.cast(&x, DType::BF16)?, cx.cast(&w, DType::BF16)?);
        let y = cx.matmul(&xb, &wb, None)?;
        let y32 = cx.dot_general_preferred(&xb, &wb, &DotDims::matmul(2), None, DType::F32)?;
        let y_wide = cx.cast(&y, DType::F32)?;
        let y_full = cx.reshard(&y_wide, &PartitionSpec::replicated())?;
        let y32_full = cx.reshard(&y32, &PartitionSpec::replicated())?;
        Ok((
            y.ty().to_string(),
            y32.ty().to_string(),
            local(&y_full),
            local(&y32_full),
        ))
    });
    let (xd, wd) = (xv.data(), wv.data());
    for ((ty, ty32, y, y32), _) in out {
        assert_eq!(ty, "bf16[8@data,12]");
        assert_eq!(ty32, "f32[8@data,12]");
        let mut rounded_once_differs = 0;
        for i in 0..b {
            for j in 0..f {
                let exact: f64 = (0..d)
                    .map(|k| {
                        host_round(f64::from(xd[i * d + k])) * host_round(f64::from(wd[k * f + j]))
                    })
                    .sum();
                let got32 = f64::from(y32[i * f + j]);
                // The f32 result: the exact sum of exact products, up to f32 rounding in the sums.
                assert!(
                    (got32 - exact).abs() <= 1e-5 * (1.0 + exact.abs()),
                    "{got32} vs {exact}"
                );
                // The bf16 result: that value rounded once (within one bf16 ulp where the f32
                // sums sit on a rounding boundary).
                let got = f64::from(y[i * f + j]);
                assert!(
                    (got - host_round(exact)).abs() <= bf16_ulp(exact),
                    "({i},{j}): {got} vs {}",
                    host_round(exact)
                );
                assert_eq!(got, host_round(got), "a bf16 result is a bf16 value");
                if got != got32 {
                    rounded_once_differs += 1;
                }
            }
        }
        assert!(rounded_once_differs > 0, "the bf16 product is rounded");
    }
}

#[test]
fn mixed_dtypes_are_refused_by_name_and_a_cast_makes_them_meet() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let x = place(cx, &x_value(4, 6), p(&["data", ""], &[], &[]));
        let w = place(cx, &w_value(6, 3), p(&["", ""], &[], &[]));
        let xb = cx.cast(&x, DType::BF16)?;
        let add = cx.add(&xb, &x).err();
        let dot = cx.matmul(&xb, &w, None).err();
        let wb = cx.cast(&w, DType::BF16)?;
        let ok = cx.matmul(&xb, &wb, None)?.ty().to_string();
        let sum = cx.add(&xb, &xb)?.ty().to_string();
        Ok((add, dot, ok, sum))
    });
    for ((add, dot, ok, sum), _) in out {
        for (e, op) in [(add, "add"), (dot, "dot_general")] {
            match e.expect("mixed dtypes are refused") {
                SpmdError::Type(t) => {
                    assert_eq!(t.kind, TypeErrorKind::DTypeMismatch);
                    let text = t.to_string();
                    assert!(text.contains(op), "{text}");
                    assert!(text.contains("bf16[4@data,6]"), "{text}");
                    assert!(text.contains("f32["), "{text}");
                }
                other => panic!("not a type error: {other}"),
            }
        }
        assert_eq!(ok, "bf16[4@data,3]");
        assert_eq!(sum, "bf16[4@data,6]");
    }
}

/// What a device reports from [`bf16_step`]: the reduced gradient, its type, the gradient
/// all-reduces inside the step and those when it is reduced after.
type StepReport = (Vec<f32>, String, usize, usize);

/// One step of `Σ (cast(x)·cast(w))²` (the square in f32) on data=2, the weight tagged or not.
fn bf16_step(tagged: bool) -> Vec<(StepReport, ferrotext_comm::Trace)> {
    let (b, d, f) = (8, 16, 4);
    let (xv, wv) = (x_value(b, d), w_value(d, f));
    let m = mesh(&[("data", 2)]);
    on_devices(&m, move |cx| {
        let x = place(cx, &xv, p(&["data", ""], &[], &[]));
        let r: &[&str] = if tagged { &["data"] } else { &[] };
        let w = place(cx, &wv, p(&["", ""], &[], r));
        cx.comm().take_trace();
        let (_, grads) = cx.value_and_grad(std::slice::from_ref(&w), |cx, ps| {
            let xb = cx.cast(&x, DType::BF16)?;
            let wb = cx.cast(&ps[0], DType::BF16)?;
            let y = cx.dot_general_preferred(&xb, &wb, &DotDims::matmul(2), None, DType::F32)?;
            let y2 = cx.mul(&y, &y)?;
            cx.reduce_sum(&y2, &[0, 1], None)
        })?;
        let trace = cx.comm().take_trace();
        // The scalar loss's own all-reduce (one element) is not a gradient's.
        let reduces = trace.all_reduces_larger_than(1, &PhasePattern::any()).len();
        let ty = grads[0].ty().to_string();
        let full = cx.reshard(&grads[0], &PartitionSpec::replicated())?;
        let later = cx
            .comm()
            .take_trace()
            .count(CollectiveKind::AllReduce, &PhasePattern::any());
        Ok((local(&full), ty, reduces, later))
    })
}

#[test]
fn a_tagged_weight_used_in_bf16_gets_an_f32_unreduced_gradient_with_no_collective() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let (b, d, f) = (8, 16, 4);
    let (xv, wv) = (x_value(b, d), w_value(d, f));
    // The reference: d/dw Σ y² = 2 xᵀ y, with x, w and the cotangent 2y rounded to bf16 as
    // the program does (y in f32, its cotangent cast to bf16 before the transposed product).
    let (xd, wd) = (xv.data(), wv.data());
    let xr: Vec<f64> = xd.iter().map(|&v| host_round(f64::from(v))).collect();
    let wr: Vec<f64> = wd.iter().map(|&v| host_round(f64::from(v))).collect();
    let y: Vec<f64> = (0..b * f)
        .map(|at| {
            (0..d)
                .map(|k| xr[(at / f) * d + k] * wr[k * f + at % f])
                .sum()
        })
        .collect();
    let dy: Vec<f64> = y.iter().map(|&v| host_round(2.0 * v)).collect();
    // Each device's partial `xᵀ·dy` over its rows is rounded to bf16 (the bf16 cotangent of the
    // cast weight), widened, and the two partials added in f32.
    let partial = |rows: std::ops::Range<usize>, k: usize, j: usize| -> f64 {
        host_round(rows.map(|i| xr[i * d + k] * dy[i * f + j]).sum())
    };
    let want: Vec<f64> = (0..d * f)
        .map(|at| partial(0..b / 2, at / f, at % f) + partial(b / 2..b, at / f, at % f))
        .collect();
    let tagged = bf16_step(true);
    let plain = bf16_step(false);
    for (((g, ty, reduces, later), _), ((g_plain, ty_plain, reduces_plain, _), _)) in
        tagged.iter().zip(&plain)
    {
        assert_eq!(ty, "f32[16,4]{U:data}", "the gradient is f32 and unreduced");
        assert_eq!(*reduces, 0, "no gradient all-reduce inside the step");
        assert_eq!(*later, 1, "one all-reduce when it is reduced");
        assert_eq!(ty_plain, "f32[16,4]");
        assert!(
            *reduces_plain >= 1,
            "the mirror: an untagged weight is all-reduced in the step"
        );
        for (i, (&got, &w)) in g.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - w).abs() <= 2.0 * bf16_ulp(w) + 1e-6,
                "element {i}: {got} vs {w}"
            );
        }
        for (a, c) in g.iter().zip(g_plain) {
            assert!((a - c).abs() <= 1e-2 * (1.0 + c.abs()), "{a} vs {c}");
        }
    }
}
