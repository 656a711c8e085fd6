//! Mirrors of JAX's own tests (docs/sharding-rules.md §8.2) with their exact per-device values, and
//! the seed error with its three working alternatives (docs/sharding-rules.md §3.3).

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, SpmdError, TypeErrorKind};
use ferrotext_tensor::{DotDims, Tensor};

#[test]
fn test_unreduced_einsum_basic() {
    let m = mesh(&[("x", 2)]);
    let results = on_devices(&m, |cx| {
        let a = iota(&[2, 2]);
        let lhs = place(cx, &a, p(&["", "x"], &[], &[]));
        let rhs = place(cx, &a, p(&["x", ""], &[], &[]));
        let out = cx.matmul(&lhs, &rhs, Some(&p(&["", ""], &["x"], &[])))?;
        assert_eq!(out.ty().to_string(), "f32[2,2]{U:x}");
        let partial = local(&out);
        let reduced = cx.reshard(&out, &PartitionSpec::replicated())?;
        Ok((partial, local(&reduced)))
    });
    assert_eq!(results[0].0 .0, vec![0., 0., 0., 2.]);
    assert_eq!(results[1].0 .0, vec![2., 3., 6., 9.]);
    for ((_, full), trace) in &results {
        assert_eq!(full, &vec![2., 3., 6., 11.]);
        // The dot communicated nothing; the reshard is the one all-reduce.
        assert_eq!(trace.events().len(), 1);
        assert_eq!(trace.events()[0].kind, CollectiveKind::AllReduce);
    }
}

#[test]
fn test_scalar_to_unreduced() {
    let m = mesh(&[("x", 2)]);
    let results = on_devices(&m, |cx| {
        let one = place(cx, &Tensor::scalar(1.0), PartitionSpec::replicated());
        let u = cx.reshard(&one, &p(&[], &["x"], &[]))?;
        // Host access to an unreduced value is refused, with the fix named.
        let err = u.scalar().unwrap_err().to_string();
        assert!(err.contains("call `reshard`"), "{err}");
        Ok(local(&u))
    });
    assert_eq!(results[0].0, vec![1.0]);
    assert_eq!(results[1].0, vec![0.0]);
    assert!(results.iter().all(|(_, t)| t.events().is_empty()));
}

/// Gradient accumulation over 5 micro-batches of `sum((x·w)²)`; returns the accumulated gradient
/// reduced to plain, and the device's trace.
fn minibatch_accumulation(weights_reduced: bool) -> Vec<(Vec<f32>, ferrotext_comm::Trace)> {
    let m = mesh(&[("x", 2)]);
    on_devices(&m, move |cx| {
        let w_spec = if weights_reduced {
            p(&["", ""], &[], &["x"])
        } else {
            p(&["", ""], &[], &[])
        };
        let w = place(
            cx,
            &Tensor::from_fn(&[4, 2], |i| 0.1 * i as f32 - 0.3),
            w_spec,
        );
        let acc_ty = w.ty().to_cotangent();
        let mut acc = cx.zeros(acc_ty);
        for micro in 0..5 {
            cx.comm().push_phase(format!("micro_batch {micro}"));
            let xs = Tensor::from_fn(&[8, 4], |i| ((i + micro * 7) % 11) as f32 * 0.1);
            let x = place(cx, &xs, p(&["x", ""], &[], &[]));
            let (_, g) = cx.value_and_grad(std::slice::from_ref(&w), |cx, ws| {
                let y = cx.matmul(&x, &ws[0], None)?;
                let y2 = cx.mul(&y, &y)?;
                // The loss stays a per-device partial sum: no forward all-reduce.
                cx.reduce_sum(&y2, &[0, 1], Some(&p(&[], &["x"], &[])))
            })?;
            acc = cx.add(&acc, &g[0])?;
            cx.comm().pop_phase();
        }
        cx.comm().push_phase("update");
        let total = cx.reshard(&acc, &PartitionSpec::replicated())?;
        cx.comm().pop_phase();
        Ok(local(&total))
    })
}

fn host_gradient() -> Vec<f32> {
    let w: Vec<f32> = (0..8).map(|i| 0.1 * i as f32 - 0.3).collect();
    let mut g = vec![0f32; 8];
    for micro in 0..5 {
        let x: Vec<f32> = (0..32)
            .map(|i| ((i + micro * 7) % 11) as f32 * 0.1)
            .collect();
        for b in 0..8 {
            for j in 0..2 {
                let y: f32 = (0..4).map(|k| x[b * 4 + k] * w[k * 2 + j]).sum();
                for k in 0..4 {
                    g[k * 2 + j] += 2.0 * y * x[b * 4 + k];
                }
            }
        }
    }
    g
}

#[test]
fn test_minibatch_scan_unreduced_has_exactly_one_all_reduce() {
    let results = minibatch_accumulation(true);
    for (grad, trace) in &results {
        assert_close(grad, &host_gradient(), 1e-5, "deferred gradient");
        assert_eq!(
            trace.count(CollectiveKind::AllReduce, &PhasePattern::any()),
            1
        );
        assert_eq!(
            trace.count(CollectiveKind::AllReduce, &PhasePattern::new("update")),
            1
        );
    }
}

#[test]
fn mirror_plain_weights_all_reduce_in_every_micro_batch() {
    let results = minibatch_accumulation(false);
    for (grad, trace) in &results {
        assert_close(grad, &host_gradient(), 1e-5, "plain gradient");
        for micro in 0..5 {
            let phase = PhasePattern::new(format!("micro_batch {micro}"));
            assert_eq!(
                trace.all_reduces_larger_than(1, &phase).len(),
                1,
                "micro-batch {micro}"
            );
        }
        assert_eq!(
            trace.count(CollectiveKind::AllReduce, &PhasePattern::new("update")),
            0
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The seed error (docs/sharding-rules.md §3.3) and its working alternatives.

fn seed_inputs(cx: &Ctx<'_>, w_spec: PartitionSpec) -> (Array, Array) {
    let x = place(
        cx,
        &Tensor::from_fn(&[8, 4], |i| (i % 7) as f32 * 0.25),
        p(&["data+fsdp", ""], &[], &[]),
    );
    let w = place(
        cx,
        &Tensor::from_fn(&[4, 4], |i| 0.05 * i as f32 - 0.2),
        w_spec,
    );
    (x, w)
}

fn seed_loss(cx: &mut Ctx<'_>, x: &Array, w: &Array) -> Result<Array, SpmdError> {
    let y = cx.matmul(x, w, None)?;
    let y2 = cx.mul(&y, &y)?;
    cx.reduce_sum(&y2, &[0, 1], None)
}

fn seed_host_gradient() -> Vec<f32> {
    let x: Vec<f32> = (0..32).map(|i| (i % 7) as f32 * 0.25).collect();
    let w: Vec<f32> = (0..16).map(|i| 0.05 * i as f32 - 0.2).collect();
    let mut g = vec![0f32; 16];
    for b in 0..8 {
        for j in 0..4 {
            let y: f32 = (0..4).map(|k| x[b * 4 + k] * w[k * 4 + j]).sum();
            for k in 0..4 {
                g[k * 4 + j] += 2.0 * y * x[b * 4 + k];
            }
        }
    }
    g
}

#[test]
fn seed_error_reduced_on_data_with_batch_over_data_and_fsdp() {
    let m = mesh(&[("data", 2), ("fsdp", 2)]);
    let results = on_devices(&m, |cx| {
        let (x, w) = seed_inputs(cx, p(&["", ""], &[], &["data"]));
        let err = cx
            .value_and_grad(&[w], |cx, ws| seed_loss(cx, &x, &ws[0]))
            .unwrap_err();
        let t = err.type_error().expect("a type error").clone();
        Ok((t.kind, t.to_string()))
    });
    for ((kind, message), _) in results {
        assert_eq!(kind, TypeErrorKind::UnreducedNotContracting);
        assert!(
            message.contains(
                "Got unreduced axes=frozenset({'data'}) and contracting spec=(('data', 'fsdp'),)"
            ),
            "{message}"
        );
    }
}

#[test]
fn seed_alternative_reduced_over_every_batch_axis() {
    let m = mesh(&[("data", 2), ("fsdp", 2)]);
    let results = on_devices(&m, |cx| {
        let (x, w) = seed_inputs(cx, p(&["", ""], &[], &["data", "fsdp"]));
        let (_, g) = cx.value_and_grad(&[w], |cx, ws| seed_loss(cx, &x, &ws[0]))?;
        assert_eq!(g[0].ty().to_string(), "f32[4,4]{U:(data,fsdp)}");
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    for (grad, _) in results {
        assert_close(&grad, &seed_host_gradient(), 1e-5, "grad");
    }
}

#[test]
fn seed_alternative_fsdp_weights_gathered_to_reduced_inside() {
    let m = mesh(&[("data", 2), ("fsdp", 2)]);
    let results = on_devices(&m, |cx| {
        let (x, w) = seed_inputs(cx, p(&["fsdp", ""], &[], &["data"]));
        cx.comm().push_phase("step");
        let (_, g) = cx.value_and_grad(&[w], |cx, ws| {
            let gathered = cx.reshard(&ws[0], &p(&["", ""], &[], &["data", "fsdp"]))?;
            seed_loss(cx, &x, &gathered)
        })?;
        cx.comm().pop_phase();
        assert_eq!(g[0].ty().to_string(), "f32[4@fsdp,4]{U:data}");
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    for (grad, trace) in results {
        assert_close(&grad, &seed_host_gradient(), 1e-5, "grad");
        // Forward: all-gather over fsdp; backward: the transposed reshard reduces over fsdp only.
        let step = PhasePattern::new("step");
        let gathers: Vec<_> = trace.filter(CollectiveKind::AllGather, &step).collect();
        assert_eq!(gathers.len(), 1);
        assert_eq!(gathers[0].axes, vec!["fsdp".to_string()]);
        let scatters: Vec<_> = trace.filter(CollectiveKind::ReduceScatter, &step).collect();
        assert_eq!(scatters.len(), 1);
        assert_eq!(scatters[0].axes, vec!["fsdp".to_string()]);
        assert!(trace
            .filter(CollectiveKind::AllReduce, &step)
            .all(|e| e.axes != ["data"]));
    }
}

#[test]
fn seed_alternative_dot_to_unreduced_then_reshard_to_fsdp() {
    let m = mesh(&[("data", 2), ("fsdp", 2)]);
    let results = on_devices(&m, |cx| {
        let (x, w) = seed_inputs(cx, p(&["", ""], &[], &[]));
        // dW = 2·xᵀ·(x·w), written out: contraction over the batch to U{data,fsdp}.
        let y = cx.matmul(&x, &w, None)?;
        let y2 = cx.scale(&y, 2.0)?;
        let dims = DotDims {
            lhs_contracting: vec![0],
            rhs_contracting: vec![0],
            ..Default::default()
        };
        let dw = cx.dot_general(&x, &y2, &dims, Some(&p(&["", ""], &["data", "fsdp"], &[])))?;
        let dw = cx.reshard(&dw, &p(&["fsdp", ""], &["data"], &[]))?;
        assert_eq!(dw.ty().to_string(), "f32[4@fsdp,4]{U:data}");
        let full = cx.reshard(&dw, &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    for (grad, _) in results {
        assert_close(&grad, &seed_host_gradient(), 1e-5, "grad");
    }
}
