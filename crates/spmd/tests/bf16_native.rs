//! The native bf16 paths of the spmd ops (docs/design.md §10): on bf16 arrays, RMSNorm, SwiGLU,
//! the tiled attention, RoPE, the elementwise ops, reshape and transpose run their bf16 kernels
//! instead of widening each operand and rounding the result. Each must give, bit for bit, what
//! the widened route gives: the same op on the `f32` arrays of the widened values, rounded once
//! (`cast` to bf16) — but the attention, within bf16's resolution (its products round the
//! probabilities, as FlashAttention's do). Forward and backward (`vjp` with a bf16 cotangent), on a mesh that splits
//! the batch. And the bf16 kernels are what runs: the profiler sees their spans, and no
//! widening of a bf16 shard, on bf16 arrays; and (the mirror) the widening and none of those
//! kernels on the widened route.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use ferrotext_sharding::{DType, PartitionSpec};
use ferrotext_spmd::{Array, AttentionSpec, Ctx, QueryPlaces, SpmdError, UnaryOp};
use ferrotext_tensor::{round_bf16, widen_bf16, Bf16Tensor, GluActivation, Tensor};

/// Values with a spread of magnitudes (the seed shifts them).
fn values(shape: &[usize], seed: usize) -> Tensor {
    Tensor::from_fn(shape, |i| {
        let h = (i * 2_654_435_761 + seed * 97) % 1_000_003;
        (h as f32 / 1_000_003.0 - 0.5) * 3.0
    })
}

/// An op on the arrays it is given (bf16 ones, or their widened `f32` copies).
type Op<'a> = dyn Fn(&mut Ctx<'_>, &[Array]) -> Result<Array, SpmdError> + Sync + 'a;

/// The bits of `a` widened to f32, gathered to every device.
fn bits(cx: &mut Ctx<'_>, a: &Array) -> Result<Vec<u32>, SpmdError> {
    let wide = cx.cast(a, DType::F32)?;
    Ok(cx
        .to_host(&wide)?
        .data()
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

/// `a` rounded to bf16 when it is `f32` (the widened route's one rounding), else itself.
fn rounded(cx: &mut Ctx<'_>, a: &Array, bf16: bool) -> Result<Array, SpmdError> {
    if bf16 {
        cx.cast(a, DType::BF16)
    } else {
        Ok(a.clone())
    }
}

/// One route's results: the bits of the output and of each cotangent, the bf16 spans, the
/// output's type.
type Route = (Vec<Vec<u32>>, Vec<&'static str>, String);

/// One device's results of `op` by both routes: the output's and every input's cotangent's
/// bits (`native`, `widened`), the bf16 kernel spans the profiler saw on each route, and the
/// output's type on the native route. `inputs` are placed with `specs`; those marked `true` in
/// `to_bf16` are cast to bf16 (the rest, a norm's scale, stay f32).
struct Routes {
    native: Vec<Vec<u32>>,
    widened: Vec<Vec<u32>>,
    native_spans: Vec<&'static str>,
    widened_spans: Vec<&'static str>,
    out_type: String,
}

fn routes(
    cx: &mut Ctx<'_>,
    inputs: &[(Tensor, PartitionSpec, bool)],
    ct: &Tensor,
    op: &Op<'_>,
) -> Result<Routes, SpmdError> {
    let mut run = |bf16: bool| -> Result<Route, SpmdError> {
        let mut xs = Vec::new();
        for (value, spec, to_bf16) in inputs {
            let x = place(cx, value, spec.clone());
            let b = if *to_bf16 {
                cx.cast(&x, DType::BF16)?
            } else {
                x
            };
            // The widened route's inputs: the bf16 values, exactly, in f32.
            xs.push(if bf16 { b } else { cx.cast(&b, DType::F32)? });
        }
        ferrotext_profile::begin_thread(0);
        ferrotext_profile::set_step(Some(0));
        let (out, grads) = cx.vjp(
            &xs,
            |cx, p| op(cx, p),
            |cx, out| {
                let c = cx.from_global(ct, out.ty().sharding().clone())?;
                // The cotangent holds bf16 values on both routes.
                let c = cx.cast(&c, DType::BF16)?;
                if bf16 {
                    Ok(c)
                } else {
                    cx.cast(&c, DType::F32)
                }
            },
        )?;
        let spans = ferrotext_profile::end_thread()
            .iter()
            .map(|e| e.kind)
            .filter(|k| k.ends_with("_bf16"))
            .collect();
        let out_type = out.ty().to_string();
        let mut all = Vec::new();
        let out = rounded(cx, &out, !bf16)?;
        all.push(bits(cx, &out)?);
        for (g, (_, _, to_bf16)) in grads.iter().zip(inputs) {
            let g = rounded(cx, g, !bf16 && *to_bf16)?;
            all.push(bits(cx, &g)?);
        }
        Ok((all, spans, out_type))
    };
    let (native, native_spans, out_type) = run(true)?;
    let (widened, widened_spans, _) = run(false)?;
    Ok(Routes {
        native,
        widened,
        native_spans,
        widened_spans,
        out_type,
    })
}

/// Runs `op` both ways on a 2-device mesh splitting dim 0 and checks the bits, the spans
/// (`kernels` on the native route, none on the widened one) and the output's dtype.
fn check(
    what: &str,
    inputs: &[(Tensor, PartitionSpec, bool)],
    ct_shape: &[usize],
    kernels: &[&str],
    op: &Op<'_>,
) {
    ferrotext_profile::enable();
    let ct = values(ct_shape, 99);
    let m = mesh(&[("data", 2)]);
    for (r, _) in on_devices(&m, |cx| routes(cx, inputs, &ct, op)) {
        assert!(r.out_type.starts_with("bf16["), "{what}: {}", r.out_type);
        assert_eq!(r.native.len(), r.widened.len());
        for (i, (n, w)) in r.native.iter().zip(&r.widened).enumerate() {
            if i > 0 && what.ends_with("softmax") {
                // The transpose reads the output as stored: rounded to bf16 on the native route,
                // the f32 result on the widened one (whose program is f32). The bits of the
                // native route are checked by `softmax_transpose_reads_the_stored_output`.
                assert_close_bits(n, w, 0.01, &format!("{what}: result {i}"));
                continue;
            }
            if what == "attention" {
                // The tiled attention on bf16 multiplies bf16 values: its probabilities and dS
                // are rounded for their products (as FlashAttention's), and its backward's row
                // sums read the stored output; the widened route does neither. The tensor
                // crate's tests hold both to the f32 kernel's values.
                assert_close_bits(n, w, 0.03, &format!("{what}: result {i}"));
                continue;
            }
            let first = n.iter().zip(w).position(|(a, b)| a != b);
            assert_eq!(first, None, "{what}: result {i} (0 = output) differs");
        }
        for k in kernels {
            assert!(
                r.native_spans.contains(k),
                "{what}: {k} not in {:?}",
                r.native_spans
            );
            assert!(
                !r.widened_spans.contains(k),
                "{what}: {:?}",
                r.widened_spans
            );
        }
        // No bf16 shard was widened on the native route; the widened route's are.
        assert!(
            !r.native_spans.contains(&"widen_bf16"),
            "{what}: {:?}",
            r.native_spans
        );
        assert!(
            r.widened_spans.contains(&"widen_bf16"),
            "{what}: {:?}",
            r.widened_spans
        );
    }
}

/// Two arrays of f32 bits agree within `rel` of the largest magnitude.
fn assert_close_bits(a: &[u32], b: &[u32], rel: f32, what: &str) {
    let (a, b): (Vec<f32>, Vec<f32>) = (
        a.iter().map(|&x| f32::from_bits(x)).collect(),
        b.iter().map(|&x| f32::from_bits(x)).collect(),
    );
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= rel * scale,
        "{what}: {worst:e} apart, largest {scale:e}"
    );
}

fn split(rank: usize) -> PartitionSpec {
    let mut parts = vec![""; rank];
    parts[0] = "data";
    p(&parts, &[], &[])
}

#[test]
fn rms_norm_swiglu_and_geglu_run_bf16_with_the_widened_bits() {
    let (b, t, d) = (4, 6, 40);
    let x = (values(&[b, t, d], 1), split(3), true);
    let scale = (values(&[d], 2), p(&[""], &[], &[]), false);
    check(
        "rms_norm",
        &[x.clone(), scale],
        &[b, t, d],
        &["rms_norm_bf16", "rms_norm_backward_bf16"],
        &|cx, a| cx.rms_norm(&a[0], &a[1], 1e-5),
    );
    let u = (values(&[b, t, d], 3), split(3), true);
    check(
        "swiglu",
        &[x, u],
        &[b, t, d],
        &["swiglu_bf16", "swiglu_backward_bf16"],
        &|cx, a| cx.swiglu(&a[0], &a[1]),
    );
    let g = (values(&[b, t, d], 4), split(3), true);
    let u = (values(&[b, t, d], 5), split(3), true);
    check(
        "geglu",
        &[g, u],
        &[b, t, d],
        &["geglu_bf16", "geglu_backward_bf16"],
        &|cx, a| cx.glu(&a[0], &a[1], GluActivation::GeluTanh),
    );
}

#[test]
fn softmax_runs_bf16_with_the_widened_bits() {
    let (b, t, d) = (4, 6, 40);
    let x = (values(&[b, t, d], 21), split(3), true);
    check(
        "softmax",
        &[x],
        &[b, t, d],
        &["softmax_last_bf16", "softmax_backward_bf16"],
        &|cx, a| cx.softmax(&a[0]),
    );
    // Scores [b, Tq, Tk] with Tk > Tq, as a decoding step over a key/value cache makes them.
    let scores = (values(&[b, 5, 9], 22), split(3), true);
    check(
        "causal_softmax",
        &[scores],
        &[b, 5, 9],
        &["causal_softmax_bf16", "softmax_backward_bf16"],
        &|cx, a| cx.causal_softmax(&a[0], 0.3),
    );
}

/// The bf16 softmax's transpose is the `f32` kernel on the output as stored (bf16, widened) and
/// the cotangent, rounded on store: the bits an op without a bf16 kernel gives (docs/design.md
/// §10), computed here from the tensor crate's `f32` kernels.
#[test]
fn softmax_transpose_reads_the_stored_output() {
    let x = values(&[4, 6, 40], 23);
    let ct = values(&[4, 6, 40], 24);
    let m = mesh(&[("data", 1)]);
    for (got, _) in on_devices(&m, |cx| {
        let a = place(cx, &x, PartitionSpec::replicated());
        let a = cx.cast(&a, DType::BF16)?;
        let (out, grads) = cx.vjp(
            std::slice::from_ref(&a),
            |cx, p| cx.softmax(&p[0]),
            |cx, out| {
                let c = cx.from_global(&ct, out.ty().sharding().clone())?;
                cx.cast(&c, DType::BF16)
            },
        )?;
        let widen = |cx: &mut Ctx<'_>, v: &Array| -> Result<Tensor, SpmdError> {
            let f = cx.cast(v, DType::F32)?;
            Ok(f.local()?.into_owned())
        };
        Ok((widen(cx, &a)?, widen(cx, &out)?, widen(cx, &grads[0])?))
    }) {
        let (x_low, y, dx) = got;
        let round = |t: &Tensor| Bf16Tensor::from_f32(t).to_f32();
        assert_eq!(y, round(&ferrotext_tensor::softmax_last(&x_low).unwrap()));
        let ct_low = round(&ct);
        let want = round(&ferrotext_tensor::softmax_backward_scaled(&y, &ct_low, 1.0).unwrap());
        assert_eq!(dx, want);
    }
}

#[test]
fn attention_runs_bf16_kernels_close_to_the_widened_route() {
    let (b, t, h, kv, dk) = (4, 70, 4, 2, 16);
    let q = (values(&[b, t, h, dk], 4), split(4), true);
    let k = (values(&[b, t, kv, dk], 5), split(4), true);
    let v = (values(&[b, t, kv, dk], 6), split(4), true);
    check(
        "attention",
        &[q, k, v],
        &[b, t, h, dk],
        &["flash_attention_bf16", "flash_attention_backward_bf16"],
        &|cx, a| {
            cx.attention(
                &a[0],
                &a[1],
                &a[2],
                &AttentionSpec::causal(0.25),
                QueryPlaces::default(),
            )
        },
    );
}

#[test]
fn rope_runs_bf16_with_the_widened_bits() {
    let (b, t, h, d) = (4, 7, 3, 8);
    let x = (values(&[b, t, h, d], 9), split(4), true);
    let rope = ferrotext_tensor::Rope::standard(10_000.0);
    check("rope", &[x], &[b, t, h, d], &["rope_bf16"], &|cx, a| {
        cx.rope_from(&a[0], &rope, 3)
    });
}

#[test]
fn elementwise_ops_run_bf16_with_the_widened_bits() {
    let shape = [4, 5000];
    let a = (values(&shape, 7), split(2), true);
    let b = (values(&shape, 8), split(2), true);
    check(
        "add",
        &[a.clone(), b.clone()],
        &shape,
        &["elementwise_bf16"],
        &|cx, x| cx.add(&x[0], &x[1]),
    );
    check(
        "mul",
        &[a.clone(), b],
        &shape,
        &["elementwise_bf16"],
        &|cx, x| cx.mul(&x[0], &x[1]),
    );
    // One op per check: the native route rounds between ops, the widened one would not.
    check(
        "scale",
        std::slice::from_ref(&a),
        &shape,
        &["elementwise_bf16"],
        &|cx, x| cx.unary(UnaryOp::Scale(0.3), &x[0]),
    );
    // The transpose of `square` reads only x, and its derivative 2x is exact in bf16: the f32
    // program's gradient, rounded once, is the bf16 one.
    check("square", &[a], &shape, &["elementwise_bf16"], &|cx, x| {
        cx.unary(UnaryOp::Square, &x[0])
    });
}

/// A map's transpose stores the derivative in x's dtype, so in bf16 it is rounded before the
/// cotangent multiplies it: SiLU's gradient is `round(ct · round(silu'(x)))`, computed here on
/// the host from the rounded values, bit for bit, with no bf16 shard widened.
#[test]
fn a_map_transpose_rounds_the_derivative_as_it_stores_it() {
    ferrotext_profile::enable();
    let (xv, cv) = (values(&[4, 300], 12), values(&[4, 300], 13));
    let r = |v: f32| widen_bf16(round_bf16(v));
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let x = place(cx, &xv, split(2));
        let xb = cx.cast(&x, DType::BF16)?;
        ferrotext_profile::begin_thread(0);
        ferrotext_profile::set_step(Some(0));
        let (y, g) = cx.vjp(
            &[xb],
            |cx, p| cx.unary(UnaryOp::Silu, &p[0]),
            |cx, out| {
                let c = cx.from_global(&cv, out.ty().sharding().clone())?;
                cx.cast(&c, DType::BF16)
            },
        )?;
        let spans: Vec<&str> = ferrotext_profile::end_thread()
            .iter()
            .map(|e| e.kind)
            .collect();
        Ok((bits(cx, &y)?, bits(cx, &g[0])?, spans))
    });
    for ((y, g, spans), _) in out {
        for (i, (&x, &c)) in xv.data().iter().zip(cv.data()).enumerate() {
            let (x, c) = (r(x), r(c));
            let s = 1.0 / (1.0 + (-x).exp());
            assert_eq!(y[i], r(x / (1.0 + (-x).exp())).to_bits(), "silu [{i}]");
            let d = r(s * (1.0 + x * (1.0 - s)));
            assert_eq!(g[i], r(c * d).to_bits(), "gradient [{i}]");
        }
        assert!(!spans.contains(&"widen_bf16"), "{spans:?}");
    }
}

/// A broadcast operand is not the output's shard shape: the op takes the widened route (no
/// bf16 span) and still gives the widened bits.
#[test]
fn a_broadcast_takes_the_widened_route_with_the_same_bits() {
    ferrotext_profile::enable();
    let (a, row) = (values(&[4, 30], 9), values(&[30], 10));
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let x = place(cx, &a, split(2));
        let r = place(cx, &row, p(&[""], &[], &[]));
        let (xb, rb) = (cx.cast(&x, DType::BF16)?, cx.cast(&r, DType::BF16)?);
        ferrotext_profile::begin_thread(0);
        ferrotext_profile::set_step(Some(0));
        let y = cx.add(&xb, &rb)?;
        let spans: Vec<&str> = ferrotext_profile::end_thread()
            .iter()
            .map(|e| e.kind)
            .filter(|k| k.ends_with("_bf16"))
            .collect();
        let (xw, rw) = (cx.cast(&xb, DType::F32)?, cx.cast(&rb, DType::F32)?);
        let want = cx.add(&xw, &rw)?;
        let want = cx.cast(&want, DType::BF16)?;
        Ok((bits(cx, &y)?, bits(cx, &want)?, spans))
    });
    for ((got, want, spans), _) in out {
        assert_eq!(got, want);
        assert!(!spans.contains(&"elementwise_bf16"), "{spans:?}");
        assert!(spans.contains(&"widen_bf16"), "{spans:?}");
    }
}

#[test]
fn reshape_and_transpose_run_bf16_with_the_widened_bits() {
    let (b, t, h, d) = (4, 6, 3, 8);
    let x = (values(&[b, t, h * d], 11), split(3), true);
    check(
        "reshape then transpose",
        &[x],
        &[b, h, t, d],
        &["transpose_bf16"],
        &|cx, a| {
            let y = cx.reshape(&a[0], &[b, t, h, d], None)?;
            cx.transpose(&y, &[0, 2, 1, 3])
        },
    );
}
