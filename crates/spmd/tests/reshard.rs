//! The reshard transition table of docs/sharding-rules.md §5.2 (mesh x=2, value arange(4)), forward
//! and backward: the collectives each transition issues and the exact per-device results.

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern, Trace};
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, SpmdError};

use CollectiveKind::{AllGather, AllReduce, ReduceScatter};

fn kinds(trace: &Trace, phase: &str) -> Vec<CollectiveKind> {
    let pattern = PhasePattern::new(phase);
    trace
        .events()
        .iter()
        .filter(|e| pattern.matches(&e.phase))
        .map(|e| e.kind)
        .collect()
}

/// A value of type `spec` holding arange(4): plain/sharded/reduced directly, unreduced through a
/// reshard from plain (value on device 0 of the group, zeros elsewhere).
fn source(cx: &mut Ctx<'_>, spec: &PartitionSpec, n: usize) -> Result<Array, SpmdError> {
    let value = iota(&[n]);
    if spec.unreduced().is_empty() {
        return Ok(place(cx, &value, spec.clone()));
    }
    let plain = place(cx, &value, PartitionSpec::replicated());
    cx.reshard(&plain, spec)
}

/// Ones of type `ty` (through a reshard when `ty` is unreduced).
fn ones_like(cx: &mut Ctx<'_>, out: &Array) -> Result<Array, SpmdError> {
    let ty = out.ty().to_cotangent();
    let spec = ty.sharding().spec().clone();
    if spec.unreduced().is_empty() {
        return cx.full(ty, 1.0);
    }
    let plain = cx.array_type(ty.shape(), spec.without_tags())?;
    let plain = cx.full(plain, 1.0)?;
    cx.reshard(&plain, &spec)
}

struct Row {
    src: PartitionSpec,
    dst: PartitionSpec,
    forward: Vec<CollectiveKind>,
    /// Per-device local result on devices 0 and 1.
    result: [Vec<f32>; 2],
    backward: Vec<CollectiveKind>,
}

#[test]
fn transition_table_on_one_axis() {
    let m = mesh(&[("x", 2)]);
    let plain = p(&[""], &[], &[]);
    let sharded = p(&["x"], &[], &[]);
    let u = p(&[""], &["x"], &[]);
    let r = p(&[""], &[], &["x"]);
    let full = vec![0., 1., 2., 3.];
    let rows = vec![
        Row {
            src: u.clone(),
            dst: plain.clone(),
            forward: vec![AllReduce],
            result: [full.clone(), full.clone()],
            backward: vec![],
        },
        Row {
            src: u.clone(),
            dst: sharded.clone(),
            forward: vec![ReduceScatter],
            result: [vec![0., 1.], vec![2., 3.]],
            backward: vec![AllGather],
        },
        Row {
            src: u.clone(),
            dst: r.clone(),
            forward: vec![AllReduce],
            result: [full.clone(), full.clone()],
            backward: vec![AllReduce],
        },
        Row {
            src: plain.clone(),
            dst: u.clone(),
            forward: vec![],
            result: [full.clone(), vec![0.; 4]],
            backward: vec![],
        },
        Row {
            src: sharded.clone(),
            dst: u.clone(),
            forward: vec![],
            result: [vec![0., 1., 0., 0.], vec![0., 0., 2., 3.]],
            backward: vec![],
        },
        Row {
            src: r.clone(),
            dst: u.clone(),
            forward: vec![],
            result: [full.clone(), vec![0.; 4]],
            backward: vec![],
        },
        Row {
            src: plain.clone(),
            dst: r.clone(),
            forward: vec![],
            result: [full.clone(), full.clone()],
            backward: vec![AllReduce],
        },
        Row {
            src: r.clone(),
            dst: plain.clone(),
            forward: vec![],
            result: [full.clone(), full.clone()],
            backward: vec![],
        },
        Row {
            src: sharded.clone(),
            dst: r.clone(),
            forward: vec![AllGather],
            result: [full.clone(), full.clone()],
            backward: vec![ReduceScatter],
        },
        Row {
            src: r.clone(),
            dst: sharded.clone(),
            forward: vec![],
            result: [vec![0., 1.], vec![2., 3.]],
            backward: vec![],
        },
    ];
    for row in rows {
        let results = on_devices(&m, |cx| {
            let x = source(cx, &row.src, 4)?;
            cx.comm().push_phase("forward");
            let y = cx.reshard(&x, &row.dst)?;
            cx.comm().pop_phase();
            cx.comm().push_phase("vjp");
            let (_, grads) = cx.vjp(&[x], |cx, xs| cx.reshard(&xs[0], &row.dst), ones_like)?;
            cx.comm().pop_phase();
            // The cotangent is typed as the source's cotangent (R4.2).
            assert_eq!(grads[0].ty(), &y_source_ct(&x_ty(cx, &row.src)?));
            Ok(local(&y))
        });
        for (d, (value, trace)) in results.iter().enumerate() {
            let what = format!("{} -> {} on device {d}", row.src, row.dst);
            assert_eq!(value, &row.result[d], "{what}");
            assert_eq!(
                kinds(trace, "forward"),
                row.forward,
                "{what}: forward collectives"
            );
            // vjp = the forward again, then the transpose.
            let mut back = kinds(trace, "vjp");
            back.drain(..row.forward.len());
            assert_eq!(back, row.backward, "{what}: backward collectives");
        }
    }
}

fn x_ty(cx: &Ctx<'_>, spec: &PartitionSpec) -> Result<ferrotext_sharding::ArrayType, SpmdError> {
    cx.array_type(&[4], spec.clone())
}

fn y_source_ct(ty: &ferrotext_sharding::ArrayType) -> ferrotext_sharding::ArrayType {
    ty.to_cotangent()
}

#[test]
fn partial_reduction_over_one_of_two_unreduced_axes() {
    let m = mesh(&[("x", 2), ("y", 2)]);
    let results = on_devices(&m, |cx| {
        let both = source(cx, &p(&[""], &["x", "y"], &[]), 4)?;
        let before = local(&both);
        cx.comm().take_trace();
        let ux = cx.reshard(&both, &p(&[""], &["x"], &[]))?;
        Ok((before, local(&ux)))
    });
    for (d, ((before, after), trace)) in results.iter().enumerate() {
        // plain -> U{x,y}: only device (0,0) keeps the value.
        let want_before = if d == 0 {
            vec![0., 1., 2., 3.]
        } else {
            vec![0.; 4]
        };
        assert_eq!(before, &want_before);
        // U{x,y} -> U{x}: an all-reduce over y only; devices with x=0 hold the value.
        let x = d / 2;
        let want = if x == 0 {
            vec![0., 1., 2., 3.]
        } else {
            vec![0.; 4]
        };
        assert_eq!(after, &want, "device {d}");
        let e = &trace.events()[0];
        assert_eq!((e.kind, e.axes.clone()), (AllReduce, vec!["y".to_string()]));
        assert_eq!(trace.events().len(), 1);
    }
}

#[test]
fn unreduced_over_data_and_fsdp_to_fsdp_sharded_still_data_partial() {
    let m = mesh(&[("data", 2), ("fsdp", 2)]);
    let results = on_devices(&m, |cx| {
        let u = source(cx, &p(&[""], &["data", "fsdp"], &[]), 4)?;
        cx.comm().take_trace();
        let y = cx.reshard(&u, &p(&["fsdp"], &["data"], &[]))?;
        assert_eq!(y.ty().to_string(), "f32[4@fsdp]{U:data}");
        Ok(local(&y))
    });
    for (d, (value, trace)) in results.iter().enumerate() {
        let (data, fsdp) = (d / 2, d % 2);
        let want = if data == 0 {
            vec![2. * fsdp as f32, 2. * fsdp as f32 + 1.]
        } else {
            vec![0., 0.]
        };
        assert_eq!(value, &want, "device {d}");
        let e = &trace.events()[0];
        assert_eq!(
            (e.kind, e.axes.clone()),
            (ReduceScatter, vec!["fsdp".to_string()])
        );
        assert_eq!(trace.events().len(), 1);
    }
}

#[test]
fn mixed_round_trips_reproduce_the_input_exactly() {
    // JAX's test_sharded_unreduced_roundtrip / test_replicated_sharded_unreduced_roundtrip.
    let m = mesh(&[("x", 2), ("y", 2)]);
    let value = iota(&[4, 4]);
    let layouts = [
        p(&["x", "y"], &[], &[]),
        p(&["x", ""], &["y"], &[]),
        p(&["", ""], &["x", "y"], &[]),
        p(&["", "y"], &["x"], &[]),
        p(&["", ""], &[], &["x"]),
        p(&["y", "x"], &[], &[]),
        p(&["x+y", ""], &[], &[]),
    ];
    let results = on_devices(&m, |cx| {
        let mut out = Vec::new();
        for a in &layouts {
            for b in &layouts {
                let start = place(cx, &value, p(&["", ""], &[], &[]));
                let x = cx.reshard(&start, a)?;
                let y = cx.reshard(&x, b)?;
                let z = cx.reshard(&y, &p(&["", ""], &[], &[]))?;
                out.push(local(&z));
            }
        }
        Ok(out)
    });
    for (values, _) in results {
        for v in values {
            assert_eq!(v, value.data());
        }
    }
}
