//! Rematerialized regions (`Ctx::remat`): the same loss and gradients, bit for bit, as the
//! program without the region, under every save policy, through `value_and_grad` and through
//! a gradient sink's buffers; the region's collectives issued again in the backward under the
//! `recompute` label (and, the mirror, none so labelled without the region); a product the
//! policy saves is not recomputed (its collective is not issued again); a region with two
//! outputs passes both cotangents back.

mod common;

use std::sync::Arc;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern, Trace};
use ferrotext_sharding::ArrayType;
use ferrotext_spmd::{Array, Ctx, GradientSink, RematFn, SavePolicy, SpmdError, UnaryOp};
use ferrotext_tensor::{DotDims, Tensor};

/// The region: `h = x·w1` contracting the `tensor`-split width (the product's all-reduce over
/// `tensor`, asked for by its output sharding), `y = silu(h)·w2`; outputs `y` and `Σ h` (a
/// second, scalar output).
fn block(cx: &mut Ctx<'_>, a: &[Array]) -> Result<Vec<Array>, SpmdError> {
    let (x, w1, w2) = (&a[0], &a[1], &a[2]);
    let plain_rows = p(&["data", ""], &[], &[]);
    let h = cx.dot_general(x, w1, &DotDims::matmul(2), Some(&plain_rows))?;
    let h = cx.checkpoint_name(&h, "mlpwi");
    let s = cx.unary(UnaryOp::Silu, &h)?;
    let y = cx.matmul(&s, w2, None)?;
    let hs = cx.reduce_sum(&h, &[0, 1], Some(&p(&[], &[], &[])))?;
    Ok(vec![y, hs])
}

/// The loss `Σ y² + 0.5·Σ h` over `block`, run as a region under `policy` (or inline).
fn loss(
    cx: &mut Ctx<'_>,
    x: &Array,
    ws: &[Array],
    policy: Option<&SavePolicy>,
) -> Result<Array, SpmdError> {
    let inputs = [x.clone(), ws[0].clone(), ws[1].clone()];
    let outs = match policy {
        None => block(cx, &inputs)?,
        Some(policy) => {
            let f: RematFn = Arc::new(block);
            cx.remat(&inputs, policy, f)?
        }
    };
    let y2 = cx.mul(&outs[0], &outs[0])?;
    let sum = cx.reduce_sum(&y2, &[0, 1], Some(&p(&[], &[], &[])))?;
    let half = cx.scale(&outs[1], 0.5)?;
    cx.add(&sum, &half)
}

fn inputs(cx: &mut Ctx<'_>) -> (Array, Vec<Array>) {
    let x = Tensor::from_fn(&[8, 6], |i| ((i * 7 + 3) % 11) as f32 * 0.1 - 0.5);
    let w1 = Tensor::from_fn(&[6, 10], |i| ((i * 5 + 1) % 13) as f32 * 0.05 - 0.3);
    let w2 = Tensor::from_fn(&[10, 4], |i| ((i * 3 + 2) % 7) as f32 * 0.1 - 0.3);
    let x = place(cx, &x, p(&["data", "tensor"], &[], &[]));
    // Weights reduced over `data`: their gradients stay per-device partial sums.
    let w1 = place(cx, &w1, p(&["tensor", ""], &[], &["data"]));
    let w2 = place(cx, &w2, p(&["", ""], &[], &["data"]));
    (x, vec![w1, w2])
}

/// One device's loss bits, its gradients' local blocks' bits (partial sums over `data`), and
/// its trace.
/// A device's loss bits and gradients' bits.
type Bits = (u32, Vec<Vec<u32>>);

fn run(policy: Option<SavePolicy>) -> Vec<(Bits, Trace)> {
    let m = mesh(&[("data", 2), ("tensor", 2)]);
    on_devices(&m, |cx| {
        let (x, ws) = inputs(cx);
        let (l, grads) = cx.value_and_grad(&ws, |cx, w| loss(cx, &x, w, policy.as_ref()))?;
        let bits = |a: &Array| local(a).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let l = local(&l)[0].to_bits();
        Ok((l, grads.iter().map(bits).collect()))
    })
}

/// All-reduces issued again in a replay over `axis`.
fn recomputed_over(trace: &Trace, axis: &str) -> usize {
    let replay = PhasePattern::new("*recompute*");
    trace
        .events()
        .iter()
        .filter(|e| e.kind == CollectiveKind::AllReduce && replay.matches(&e.phase))
        .filter(|e| e.axes == [axis])
        .count()
}

fn recomputed(trace: &Trace) -> usize {
    trace.count(CollectiveKind::AllReduce, &PhasePattern::new("*recompute*"))
}

#[test]
fn every_policy_gives_the_bits_of_the_program_without_the_region() {
    let inline = run(None);
    let minimal = SavePolicy {
        dots_without_batch: true,
        names: vec![],
    };
    let named = SavePolicy {
        dots_without_batch: false,
        names: vec!["mlpwi"],
    };
    for policy in [SavePolicy::nothing(), minimal, named] {
        let remat = run(Some(policy.clone()));
        for (device, (a, b)) in inline.iter().zip(&remat).enumerate() {
            assert_eq!(
                a.0, b.0,
                "{policy:?}: device {device}: loss or gradients differ"
            );
        }
    }
}

#[test]
fn the_region_is_recomputed_in_the_backward_unless_its_product_is_saved() {
    let inline = run(None);
    let full = run(Some(SavePolicy::nothing()));
    let saved = run(Some(SavePolicy {
        dots_without_batch: false,
        names: vec!["mlpwi"],
    }));
    for device in 0..4 {
        // The mirror: no collective is labelled as recomputed without a region.
        assert_eq!(recomputed(&inline[device].1), 0, "device {device}");
        // The region's two forward all-reduces again, in the backward: the first product's over
        // `tensor` and the sum of `h` over `data`.
        assert_eq!(recomputed(&full[device].1), 2, "device {device}");
        assert_eq!(recomputed_over(&full[device].1, "tensor"), 1);
        // Saved by name: that product is not recomputed, so neither is its collective; the
        // sum still is.
        assert_eq!(recomputed_over(&saved[device].1, "tensor"), 0, "device {device}");
        assert_eq!(recomputed_over(&saved[device].1, "data"), 1, "device {device}");
        let all = |t: &Trace| t.count(CollectiveKind::AllReduce, &PhasePattern::any());
        assert_eq!(all(&full[device].1), all(&inline[device].1) + 2);
    }
}

/// Buffers for every parameter; records which gradients went in by the kernel.
struct Buffers {
    bufs: Vec<Vec<f32>>,
    types: Vec<ArrayType>,
    sunk: Vec<bool>,
}

impl GradientSink for Buffers {
    fn buffer(&mut self, k: usize, ty: &ArrayType) -> Option<Vec<&mut [f32]>> {
        (ty == &self.types[k]).then(|| vec![self.bufs[k].as_mut_slice()])
    }

    fn finished(&mut self, _: &mut Ctx<'_>, k: usize, g: Option<&Array>) -> Result<(), SpmdError> {
        match g {
            None => self.sunk[k] = true,
            Some(g) => {
                for (b, v) in self.bufs[k].iter_mut().zip(local(g)) {
                    *b += v;
                }
            }
        }
        Ok(())
    }
}

#[test]
fn a_parameter_used_only_inside_the_region_goes_into_the_sink_buffer_with_the_same_bits() {
    let m = mesh(&[("data", 2), ("tensor", 2)]);
    let sink_run = |policy: Option<SavePolicy>| {
        on_devices(&m, |cx| {
            let (x, ws) = inputs(cx);
            let types: Vec<ArrayType> = ws.iter().map(|w| w.ty().to_cotangent()).collect();
            let mut sink = Buffers {
                bufs: ws
                    .iter()
                    .map(|w| vec![0.0; w.local().unwrap().len()])
                    .collect(),
                types,
                sunk: vec![false; ws.len()],
            };
            cx.value_and_grad_into(&ws, |cx, w| loss(cx, &x, w, policy.as_ref()), &mut sink)?;
            let bits: Vec<Vec<u32>> = sink
                .bufs
                .iter()
                .map(|b| b.iter().map(|v| v.to_bits()).collect())
                .collect();
            Ok((bits, sink.sunk))
        })
    };
    let inline = sink_run(None);
    let remat = sink_run(Some(SavePolicy::nothing()));
    for ((a, _), (b, _)) in inline.iter().zip(&remat) {
        assert_eq!(a.0, b.0, "buffers differ");
        // `w2`'s whole gradient is one product without a collective: into the buffer, inside
        // the region's replay as outside it.
        assert!(
            a.1[1] && b.1[1],
            "w2 not added in place: {:?} {:?}",
            a.1,
            b.1
        );
    }
}

#[test]
fn outside_a_tape_a_region_just_runs() {
    let m = mesh(&[("data", 2), ("tensor", 2)]);
    let out = on_devices(&m, |cx| {
        let (x, ws) = inputs(cx);
        let a = loss(cx, &x, &ws, None)?;
        let b = loss(cx, &x, &ws, Some(&SavePolicy::nothing()))?;
        Ok((local(&a), local(&b)))
    });
    for ((a, b), trace) in out {
        assert_eq!(a, b);
        assert_eq!(recomputed(&trace), 0);
    }
}
