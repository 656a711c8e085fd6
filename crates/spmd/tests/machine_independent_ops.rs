//! The elementwise ops whose functions call into a math library (`exp`, `log`, `sin`, `cos`,
//! `tanh`, sigmoid, SiLU, GELU's tanh form) compute them with `ferrotext_tensor::fixed_math`,
//! bit for bit, in `f32` and in bf16: results that depend on the inputs alone, not on which
//! variant of the C library's functions the processor got. The inputs include points where
//! glibc's `f32` functions round otherwise (found by a scan on an x86-64 machine), and the test
//! checks that some still do there, so a C library call slipping back into an op would fail it.

// The C library is called here on purpose, as the mirror: `clippy.toml`.
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use ferrotext_sharding::{DType, PartitionSpec};
use ferrotext_spmd::UnaryOp;
use ferrotext_tensor::{fixed_math, round_bf16, widen_bf16, Tensor};

/// The inputs: a sweep over [−12, 12) and the points where, on the machine that found them,
/// glibc's `expf`, `logf`, `tanhf`, `sinf` and `cosf` differed from `fixed_math` in the last bit.
fn inputs() -> Vec<f32> {
    let found = [
        -11.985_505,
        11.793_637,
        -5.341_458,
        -4.905_688,
        -11.999_356,
        -11.971_641,
    ];
    let sweep = (0..250).map(|i| i as f32 * 0.096 - 12.0);
    found.into_iter().chain(sweep).collect()
}

/// A function of one element.
type Function = fn(f32) -> f32;

/// Each op beside the function it must compute (of the element, bit for bit).
fn ops() -> Vec<(&'static str, UnaryOp, Function)> {
    fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + fixed_math::exp(-x))
    }
    fn gelu_tanh(x: f32) -> f32 {
        0.5 * x * (1.0 + fixed_math::tanh(0.797_884_6 * (x + 0.044_715 * x * x * x)))
    }
    vec![
        ("exp", UnaryOp::Exp, fixed_math::exp),
        ("log", UnaryOp::Log, |x| fixed_math::ln(x.abs())),
        ("sin", UnaryOp::Sin, fixed_math::sin),
        ("cos", UnaryOp::Cos, fixed_math::cos),
        ("tanh", UnaryOp::Tanh, fixed_math::tanh),
        ("sigmoid", UnaryOp::Sigmoid, sigmoid),
        ("silu", UnaryOp::Silu, |x| x / (1.0 + fixed_math::exp(-x))),
        ("gelu_tanh", UnaryOp::GeluTanh, gelu_tanh),
    ]
}

#[test]
fn the_library_ops_compute_with_fixed_math_bit_for_bit() {
    let xs = inputs();
    let x = Tensor::new(vec![xs.len()], xs.clone()).unwrap();
    let abs_x = Tensor::new(vec![xs.len()], xs.iter().map(|v| v.abs()).collect()).unwrap();
    let m = mesh(&[("data", 1)]);
    let results = on_devices(&m, |cx| {
        let mut got = Vec::new();
        for (name, op, _) in ops() {
            let input = if name == "log" { &abs_x } else { &x };
            let a = place(cx, input, PartitionSpec::replicated());
            let f32_result = local(&cx.unary(op, &a)?);
            let low = cx.cast(&a, DType::BF16)?;
            let low_result = cx.unary(op, &low)?;
            let bf16_result = local(&cx.cast(&low_result, DType::F32)?);
            got.push((f32_result, bf16_result));
        }
        Ok(got)
    });
    let (got, _) = &results[0];
    for ((name, _, f), (f32_result, bf16_result)) in ops().into_iter().zip(got) {
        for (i, &v) in xs.iter().enumerate() {
            assert_eq!(
                f32_result[i].to_bits(),
                f(v).to_bits(),
                "{name}({v}) in f32"
            );
            // bf16: the input rounded, widened, the function, the result rounded.
            let low = widen_bf16(round_bf16(v));
            let want = widen_bf16(round_bf16(f(low)));
            assert_eq!(
                bf16_result[i].to_bits(),
                want.to_bits(),
                "{name}({low}) in bf16"
            );
        }
    }
}

/// The mirror: the inputs tell the C library's functions from `fixed_math`'s here, so the test
/// above would catch an op computing with them. Where this C library agrees with `fixed_math`
/// on every input (another library, a correctly rounded one), that is reported, not failed.
#[test]
fn the_inputs_tell_the_c_library_from_fixed_math() {
    let xs = inputs();
    let libc: [(&str, Function, Function); 5] = [
        ("exp", f32::exp, fixed_math::exp),
        ("ln", |x| x.abs().ln(), |x| fixed_math::ln(x.abs())),
        ("tanh", f32::tanh, fixed_math::tanh),
        ("sin", f32::sin, fixed_math::sin),
        ("cos", f32::cos, fixed_math::cos),
    ];
    for (name, c, fixed) in libc {
        if !xs.iter().any(|&x| c(x).to_bits() != fixed(x).to_bits()) {
            ferrotext_tensor::report_skipped(
                "spmd machine_independent_ops::the_inputs_tell_the_c_library_from_fixed_math",
                &format!("this C library's `{name}` agrees with fixed_math on every input"),
            );
        }
    }
}
