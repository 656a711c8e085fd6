//! Gradients of a 2-layer MLP with RMSNorm on meshes data=4, data×tensor=2×2 and data×fsdp=2×2
//! against finite differences of an independent f64 implementation and against the
//! single-device run; the collective trace of `{R:data}` parameters versus plain ones; abstract
//! mode reproducing the real trace.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::Arc;

use common::*;
use ferrotext_comm::{CollectiveKind, Communicator, NoTransport, PhasePattern, Trace};
use ferrotext_sharding::{Mesh, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError, UnaryOp};
use ferrotext_tensor::Tensor;

const B: usize = 8;
const D: usize = 16;
const F: usize = 24;
const EPS: f32 = 1e-5;

fn x_value() -> Tensor {
    Tensor::from_fn(&[B, D], |i| ((i * 37 % 23) as f32 - 11.0) * 0.1)
}
fn t_value() -> Tensor {
    Tensor::from_fn(&[B, D], |i| ((i * 11 % 17) as f32 - 8.0) * 0.05)
}
fn params() -> [Tensor; 3] {
    [
        Tensor::from_fn(&[D], |i| 1.0 + 0.02 * i as f32),
        Tensor::from_fn(&[D, F], |i| ((i * 7 % 31) as f32 - 15.0) * 0.02),
        Tensor::from_fn(&[F, D], |i| ((i * 13 % 29) as f32 - 14.0) * 0.02),
    ]
}

/// How the MLP is laid out on a mesh.
#[derive(Clone)]
struct Layout {
    batch: &'static str,
    g: PartitionSpec,
    w1: PartitionSpec,
    w2: PartitionSpec,
}

impl Layout {
    fn data_only(tag: bool) -> Layout {
        let r: &[&str] = if tag { &["data"] } else { &[] };
        Layout {
            batch: "data",
            g: p(&[""], &[], r),
            w1: p(&["", ""], &[], r),
            w2: p(&["", ""], &[], r),
        }
    }
    fn data_tensor() -> Layout {
        Layout {
            batch: "data",
            g: p(&[""], &[], &[]),
            w1: p(&["", "tensor"], &[], &[]),
            w2: p(&["tensor", ""], &[], &[]),
        }
    }
    fn data_fsdp() -> Layout {
        Layout {
            batch: "data+fsdp",
            g: p(&[""], &[], &[]),
            w1: p(&["fsdp", ""], &[], &[]),
            w2: p(&["fsdp", ""], &[], &[]),
        }
    }
    fn single() -> Layout {
        Layout {
            batch: "",
            g: p(&[""], &[], &[]),
            w1: p(&["", ""], &[], &[]),
            w2: p(&["", ""], &[], &[]),
        }
    }
}

fn rms_norm(cx: &mut Ctx<'_>, x: &Array, g: &Array) -> Result<Array, SpmdError> {
    let sq = cx.mul(x, x)?;
    let ms = cx.reduce_sum(&sq, &[1], None)?;
    let ms = cx.scale(&ms, 1.0 / D as f32)?;
    let eps_ty = cx.array_type(&[], PartitionSpec::replicated())?;
    let eps = cx.full(eps_ty, EPS)?;
    let ms = cx.add(&ms, &eps)?;
    let inv = cx.unary(UnaryOp::Rsqrt, &ms)?;
    let inv = cx.broadcast_in_dim(&inv, &[B, D], &[0], None)?;
    let n = cx.mul(x, &inv)?;
    cx.mul(&n, g)
}

fn mlp_loss(
    cx: &mut Ctx<'_>,
    layout: &Layout,
    x: &Array,
    t: &Array,
    ps: &[Array],
) -> Result<Array, SpmdError> {
    let h = rms_norm(cx, x, &ps[0])?;
    let z = cx.matmul(&h, &ps[1], None)?;
    let a = cx.unary(UnaryOp::Silu, &z)?;
    let out = p(&[layout.batch, ""], &[], &[]);
    let y = cx.matmul(&a, &ps[2], Some(&out))?;
    let d = cx.sub(&y, t)?;
    let d2 = cx.mul(&d, &d)?;
    cx.reduce_sum(&d2, &[0, 1], None)
}

/// What one device reports from a step: the loss, the gradients reduced to plain, their types,
/// and the trace of the step alone.
type StepResult = (f32, Vec<Vec<f32>>, Vec<String>, Trace);

/// One value_and_grad step on one device.
fn step(cx: &mut Ctx<'_>, layout: &Layout) -> Result<StepResult, SpmdError> {
    let x = place(cx, &x_value(), p(&[layout.batch, ""], &[], &[]));
    let t = place(cx, &t_value(), p(&[layout.batch, ""], &[], &[]));
    let [g, w1, w2] = params();
    let ps = vec![
        place(cx, &g, layout.g.clone()),
        place(cx, &w1, layout.w1.clone()),
        place(cx, &w2, layout.w2.clone()),
    ];
    cx.comm().take_trace();
    cx.comm().push_phase("step");
    let (loss, grads) = cx.value_and_grad(&ps, |cx, ps| mlp_loss(cx, layout, &x, &t, ps))?;
    cx.comm().pop_phase();
    let trace = cx.comm().take_trace();
    let types = grads.iter().map(|g| g.ty().to_string()).collect();
    let mut values = Vec::new();
    for g in &grads {
        let full = cx.reshard(g, &PartitionSpec::replicated())?;
        values.push(if full.is_abstract() {
            Vec::new()
        } else {
            local(&full)
        });
    }
    Ok((loss.scalar().unwrap_or(f32::NAN), values, types, trace))
}

/// The same loss in f64, written independently of the spmd layer.
fn host_loss(g: &[f64], w1: &[f64], w2: &[f64]) -> f64 {
    let x: Vec<f64> = x_value().data().iter().map(|&v| v as f64).collect();
    let t: Vec<f64> = t_value().data().iter().map(|&v| v as f64).collect();
    let mut loss = 0.0;
    for b in 0..B {
        let row = &x[b * D..(b + 1) * D];
        let ms = row.iter().map(|v| v * v).sum::<f64>() / D as f64;
        let inv = 1.0 / (ms + EPS as f64).sqrt();
        let h: Vec<f64> = (0..D).map(|i| row[i] * inv * g[i]).collect();
        let a: Vec<f64> = (0..F)
            .map(|j| {
                let z: f64 = (0..D).map(|i| h[i] * w1[i * F + j]).sum();
                z / (1.0 + (-z).exp())
            })
            .collect();
        for k in 0..D {
            let y: f64 = (0..F).map(|j| a[j] * w2[j * D + k]).sum();
            loss += (y - t[b * D + k]).powi(2);
        }
    }
    loss
}

/// Central finite differences of [`host_loss`] for every parameter element.
fn finite_difference_grads() -> Vec<Vec<f64>> {
    let base: Vec<Vec<f64>> = params()
        .iter()
        .map(|p| p.data().iter().map(|&v| v as f64).collect())
        .collect();
    let h = 1e-6;
    (0..3)
        .map(|which| {
            (0..base[which].len())
                .map(|i| {
                    let mut plus = base.clone();
                    let mut minus = base.clone();
                    plus[which][i] += h;
                    minus[which][i] -= h;
                    (host_loss(&plus[0], &plus[1], &plus[2])
                        - host_loss(&minus[0], &minus[1], &minus[2]))
                        / (2.0 * h)
                })
                .collect()
        })
        .collect()
}

fn run(mesh_axes: &[(&str, usize)], layout: Layout) -> Vec<(StepResult, Trace)> {
    let m = mesh(mesh_axes);
    on_devices(&m, move |cx| step(cx, &layout))
}

fn check_against_references(results: &[(StepResult, Trace)]) {
    let fd = finite_difference_grads();
    let single = run(&[("data", 1)], Layout::single());
    let single_grads = &single[0].0 .1;
    for ((loss, grads, _, _), _) in results {
        assert!(
            (loss - single[0].0 .0).abs() <= 1e-5 * single[0].0 .0.abs(),
            "loss {loss}"
        );
        for (k, g) in grads.iter().enumerate() {
            let fd32: Vec<f32> = fd[k].iter().map(|&v| v as f32).collect();
            assert_close(g, &fd32, 2e-3, &format!("param {k} vs finite differences"));
            assert_close(
                g,
                &single_grads[k],
                1e-5,
                &format!("param {k} vs single device"),
            );
        }
    }
}

#[test]
fn gradients_on_data4_match_finite_differences_and_single_device() {
    check_against_references(&run(&[("data", 4)], Layout::data_only(false)));
    check_against_references(&run(&[("data", 4)], Layout::data_only(true)));
}

#[test]
fn gradients_on_data_tensor_match() {
    check_against_references(&run(&[("data", 2), ("tensor", 2)], Layout::data_tensor()));
}

#[test]
fn gradients_on_data_fsdp_match() {
    let results = run(&[("data", 2), ("fsdp", 2)], Layout::data_fsdp());
    for ((_, _, types, _), _) in &results {
        // FSDP weights get FSDP-sharded gradients (reduce-scattered over fsdp).
        assert_eq!(types[1], "f32[16@fsdp,24]");
    }
    check_against_references(&results);
}

#[test]
fn reduced_params_get_unreduced_grads_with_no_backward_all_reduce() {
    let results = run(&[("data", 4)], Layout::data_only(true));
    for ((_, _, types, trace), _) in &results {
        assert_eq!(
            types,
            &[
                "f32[16]{U:data}",
                "f32[16,24]{U:data}",
                "f32[24,16]{U:data}"
            ]
        );
        // Only the scalar loss is all-reduced (in the forward); no gradient is.
        let big = trace.all_reduces_larger_than(8, &PhasePattern::any());
        assert!(big.is_empty(), "{big:?}");
        assert_eq!(
            trace.count(CollectiveKind::AllReduce, &PhasePattern::any()),
            1
        );
    }
}

#[test]
fn mirror_plain_params_all_reduce_once_per_weight_use() {
    let results = run(&[("data", 4)], Layout::data_only(false));
    for ((_, _, types, trace), _) in &results {
        assert_eq!(types, &["f32[16]", "f32[16,24]", "f32[24,16]"]);
        let big = trace.all_reduces_larger_than(8, &PhasePattern::any());
        let mut sizes: Vec<usize> = big.iter().map(|e| e.elements).collect();
        sizes.sort();
        assert_eq!(
            sizes,
            vec![D, D * F, F * D],
            "one all-reduce per weight use"
        );
    }
}

/// The abstract run of the step records the same collectives (kinds, axes, sizes, phases) as
/// the real one.
#[test]
fn abstract_mode_records_the_real_trace() {
    for (axes, layout) in [
        (vec![("data", 4)], Layout::data_only(true)),
        (vec![("data", 4)], Layout::data_only(false)),
        (vec![("data", 2), ("tensor", 2)], Layout::data_tensor()),
        (vec![("data", 2), ("fsdp", 2)], Layout::data_fsdp()),
    ] {
        let real = run(&axes, layout.clone());
        let m = mesh(&axes);
        let abstract_trace = abstract_step(&m, &layout);
        assert!(!abstract_trace.events().is_empty());
        assert_eq!(abstract_trace.events(), real[0].0 .3.events(), "{axes:?}");
    }
}

fn abstract_step(m: &Arc<Mesh>, layout: &Layout) -> Trace {
    let mut comm = Communicator::new(0, m.clone(), Box::new(NoTransport));
    let mut cx = Ctx::new_abstract(&mut comm);
    let (_, _, _, trace) = step(&mut cx, layout).expect("the abstract step type-checks");
    trace
}

/// A data=256 mesh is planned in one process (time reported, not asserted: see the bench).
#[test]
fn abstract_mode_plans_a_256_device_mesh() {
    let m = mesh(&[("data", 256)]);
    let mut comm = Communicator::new(0, m.clone(), Box::new(NoTransport));
    let mut cx = Ctx::new_abstract(&mut comm);
    let layout = Layout::data_only(true);
    let xt = cx
        .array_type(&[256 * B, D], p(&["data", ""], &[], &[]))
        .unwrap();
    let x = cx.abstract_array(xt.clone());
    let t = cx.abstract_array(xt);
    let ps: Vec<Array> = params()
        .iter()
        .zip([&layout.g, &layout.w1, &layout.w2])
        .map(|(v, s)| cx.abstract_array(cx.array_type(v.shape(), s.clone()).unwrap()))
        .collect();
    let start = std::time::Instant::now();
    let (_, grads) = cx
        .value_and_grad(&ps, |cx, ps| {
            // The same MLP on 256×B rows.
            let sq = cx.mul(&x, &x)?;
            let ms = cx.reduce_sum(&sq, &[1], None)?;
            let inv = cx.unary(UnaryOp::Rsqrt, &ms)?;
            let inv = cx.broadcast_in_dim(&inv, &[256 * B, D], &[0], None)?;
            let n = cx.mul(&x, &inv)?;
            let h = cx.mul(&n, &ps[0])?;
            let z = cx.matmul(&h, &ps[1], None)?;
            let a = cx.unary(UnaryOp::Silu, &z)?;
            let y = cx.matmul(&a, &ps[2], None)?;
            let d = cx.sub(&y, &t)?;
            let d2 = cx.mul(&d, &d)?;
            cx.reduce_sum(&d2, &[0, 1], None)
        })
        .unwrap();
    eprintln!("planned a data=256 MLP step in {:?}", start.elapsed());
    assert_eq!(grads[1].ty().to_string(), "f32[16,24]{U:data}");
    let events = cx.comm().trace().events().to_vec();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].group_size, 256);
}
