//! `value_and_grad_into`: a weight whose whole gradient is one product that needs no
//! collective (a `{R:x}` weight used once, its gradient kept `{U:x}`) is added into the sink's
//! buffer by the product's kernel; every other gradient is handed over. Either way the sink ends
//! with its buffers plus `value_and_grad`'s gradients, the same collectives run, and each
//! parameter is finished once, in the streamed order.

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, Trace};
use ferrotext_sharding::{ArrayType, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, GradientSink, SpmdError};
use ferrotext_tensor::Tensor;

/// `Σ (x·w0·w1 + x·w2·w2ᵀ·w0)²`, a per-device partial sum over the batch axis `x`: `w1` is
/// used once (by a product), `w0` and `w2` twice (`w2` once through a transpose).
fn model(cx: &mut Ctx<'_>, ws: &[Array], x: &Array) -> Result<Array, SpmdError> {
    let h = cx.matmul(x, &ws[0], None)?;
    let y = cx.matmul(&h, &ws[1], None)?;
    let g = cx.matmul(x, &ws[2], None)?;
    let w2t = cx.transpose(&ws[2], &[1, 0])?;
    let g = cx.matmul(&g, &w2t, None)?;
    let g = cx.matmul(&g, &ws[0], None)?;
    let z = cx.add(&y, &g)?;
    let z2 = cx.mul(&z, &z)?;
    cx.reduce_sum(&z2, &[0, 1], Some(&p(&[], &["x"], &[])))
}

/// A model whose only weight `w` is used once, by one product.
fn single(cx: &mut Ctx<'_>, ws: &[Array], x: &Array) -> Result<Array, SpmdError> {
    let y = cx.matmul(x, &ws[0], None)?;
    let y2 = cx.mul(&y, &y)?;
    cx.reduce_sum(&y2, &[0, 1], Some(&p(&[], &["x"], &[])))
}

/// Buffers that start at `start`, offered where `offer` says; handed gradients are added in
/// here too, so both paths end in the same sums.
struct Recorder {
    bufs: Vec<Vec<f32>>,
    types: Vec<ArrayType>,
    offer: bool,
    /// (parameter, went into the buffer), in finishing order.
    events: Vec<(usize, bool)>,
}

impl GradientSink for Recorder {
    fn buffer(&mut self, k: usize, ty: &ArrayType) -> Option<&mut [f32]> {
        (self.offer && &self.types[k] == ty).then(|| self.bufs[k].as_mut_slice())
    }

    fn finished(
        &mut self,
        _: &mut Ctx<'_>,
        k: usize,
        grad: Option<&Array>,
    ) -> Result<(), SpmdError> {
        if let Some(g) = grad {
            for (b, v) in self.bufs[k].iter_mut().zip(local(g)) {
                *b += v;
            }
        }
        self.events.push((k, grad.is_none()));
        Ok(())
    }
}

/// Per device: (sink buffers, sink events, `value_and_grad`'s gradients plus the start), and
/// the traces of the sink run and of a streamed run.
type Run = ((Vec<Vec<f32>>, Vec<(usize, bool)>, Vec<Vec<f32>>), Trace);

fn run(
    weights_reduced: bool,
    offer: bool,
    f: fn(&mut Ctx<'_>, &[Array], &Array) -> Result<Array, SpmdError>,
    count: usize,
) -> (Vec<Run>, Vec<Trace>) {
    let m = mesh(&[("x", 2)]);
    let spec = || {
        if weights_reduced {
            p(&["", ""], &[], &["x"])
        } else {
            PartitionSpec::replicated()
        }
    };
    let setup = move |cx: &mut Ctx<'_>| -> (Vec<Array>, Array) {
        let ws = (0..count)
            .map(|k| {
                let value =
                    Tensor::from_fn(&[6, 6], |i| ((i * 5 + k * 11) % 13) as f32 * 0.05 - 0.3);
                place(cx, &value, spec())
            })
            .collect();
        let xs = Tensor::from_fn(&[8, 6], |i| ((i * 7) % 17) as f32 * 0.1 - 0.8);
        (ws, place(cx, &xs, p(&["x", ""], &[], &[])))
    };
    let sunk = on_devices(&m, |cx| {
        let (ws, x) = setup(cx);
        let types: Vec<ArrayType> = ws.iter().map(|w| w.ty().to_cotangent()).collect();
        let start: Vec<Vec<f32>> = types
            .iter()
            .enumerate()
            .map(|(k, t)| {
                let n: usize = t.shard_shape().iter().product();
                (0..n).map(|i| (i + k) as f32 * 0.01).collect()
            })
            .collect();
        let (_, grads) = cx.value_and_grad(&ws, |cx, ps| f(cx, ps, &x))?;
        // Only the sink run's collectives are compared: start the trace here.
        drop(cx.comm().take_trace());
        let mut sink = Recorder {
            bufs: start.clone(),
            types,
            offer,
            events: Vec::new(),
        };
        cx.value_and_grad_into(&ws, |cx, ps| f(cx, ps, &x), &mut sink)?;
        let want = start
            .iter()
            .zip(&grads)
            .map(|(s, g)| s.iter().zip(local(g)).map(|(a, b)| a + b).collect())
            .collect();
        Ok((sink.bufs, sink.events, want))
    });
    let streamed = on_devices(&m, |cx| {
        let (ws, x) = setup(cx);
        cx.value_and_grad_streaming(&ws, |cx, ps| f(cx, ps, &x), &mut |_, _, _| Ok(()))?;
        Ok(())
    })
    .into_iter()
    .map(|(_, t)| t)
    .collect();
    (sunk, streamed)
}

fn kinds(t: &Trace) -> Vec<(CollectiveKind, usize)> {
    t.events().iter().map(|e| (e.kind, e.elements)).collect()
}

fn check_sums(out: &[Run]) {
    for ((bufs, _, want), _) in out {
        for (k, (b, w)) in bufs.iter().zip(want).enumerate() {
            assert_close(b, w, 1e-5, &format!("parameter {k}"));
        }
    }
}

#[test]
fn a_weight_used_once_by_a_product_goes_into_the_buffer() {
    let (out, streamed) = run(true, true, single, 1);
    check_sums(&out);
    for (((_, events, _), trace), plain) in out.iter().zip(&streamed) {
        assert_eq!(events, &[(0, true)]);
        // Deferred: no collective in the backward either way.
        assert_eq!(kinds(trace), kinds(plain));
        assert!(kinds(trace).is_empty());
    }
}

#[test]
fn only_single_product_gradients_go_into_buffers_and_the_order_is_the_streamed_one() {
    let (out, streamed) = run(true, true, model, 3);
    check_sums(&out);
    for (((_, events, _), trace), plain) in out.iter().zip(&streamed) {
        // w1 (used once, by a product) goes in; w0 and w2 (used twice) are handed. Each is
        // finished at its first use, walked last: w2's, then w1's, then w0's.
        assert_eq!(events, &[(2, false), (1, true), (0, false)]);
        assert_eq!(kinds(trace), kinds(plain));
    }
}

/// The mirrors: a plain weight's transposed product all-reduces, so its gradient is handed
/// over even with a buffer on offer; and a sink that offers none is handed everything.
#[test]
fn a_gradient_that_needs_a_collective_or_has_no_buffer_is_handed_over() {
    let (out, streamed) = run(false, true, single, 1);
    check_sums(&out);
    for (((_, events, _), trace), plain) in out.iter().zip(&streamed) {
        assert_eq!(events, &[(0, false)]);
        assert_eq!(kinds(trace), kinds(plain));
        assert!(kinds(trace)
            .iter()
            .any(|(k, _)| *k == CollectiveKind::AllReduce));
    }
    let (out, _) = run(true, false, model, 3);
    check_sums(&out);
    for ((_, events, _), _) in &out {
        assert_eq!(events, &[(2, false), (1, false), (0, false)]);
    }
}
