//! `value_and_grad_into`: a parameter whose whole gradient is one product that needs no
//! collective (a `{R:x}` weight's transposed dot, its gradient kept `{U:x}`) or one `take` is
//! added into the sink's buffer by the kernel; every other gradient (several contributions, a
//! collective) is handed over. Either way the sink ends with its buffers plus
//! `value_and_grad`'s gradients, the same collectives run, and each parameter is finished once,
//! in the streamed order.

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, Trace};
use ferrotext_sharding::{ArrayType, PartitionSpec};
use ferrotext_spmd::{Array, AxisState, Ctx, GradientSink, Ids, SpmdError};
use ferrotext_tensor::{DotDims, Tensor};

/// `Σ (x·w0·w1 + x·w2·w2ᵀ·w0)²`, a per-device partial sum over the batch axis `x`: `w1` is
/// used by one product, `w0` by two, `w2` by a product and a transpose.
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

/// A loss of the parameters.
type LossFn<'a> = dyn Fn(&mut Ctx<'_>, &[Array]) -> Result<Array, SpmdError> + 'a;

/// A model whose only weight `w` is used once, by one product.
fn single(cx: &mut Ctx<'_>, ws: &[Array], x: &Array) -> Result<Array, SpmdError> {
    let y = cx.matmul(x, &ws[0], None)?;
    let y2 = cx.mul(&y, &y)?;
    cx.reduce_sum(&y2, &[0, 1], Some(&p(&[], &["x"], &[])))
}

/// `Σ (take(t, ids) · tᵀ)²`: a tied table, used by a `take` and by a product (contracting its
/// second dim, as a tied output head does).
fn tied(cx: &mut Ctx<'_>, ts: &[Array], ids: &Ids) -> Result<Array, SpmdError> {
    let rows = cx.take(&ts[0], ids)?;
    let head = DotDims {
        lhs_contracting: vec![2],
        rhs_contracting: vec![1],
        ..DotDims::default()
    };
    let logits = cx.dot_general(&rows, &ts[0], &head, None)?;
    let l2 = cx.mul(&logits, &logits)?;
    cx.reduce_sum(&l2, &[0, 1, 2], Some(&p(&[], &["x"], &[])))
}

/// Buffers that start at `start`, offered where `offer` says; handed gradients are added in
/// here too, so both paths end in the same sums.
struct Recorder {
    bufs: Vec<Vec<f32>>,
    types: Vec<ArrayType>,
    /// The parts each buffer is offered in (consecutive, equal); 0: none offered.
    offer: usize,
    /// (parameter, what was handed over), in finishing order.
    events: Vec<(usize, Option<Vec<f32>>)>,
}

impl GradientSink for Recorder {
    fn buffer(&mut self, k: usize, ty: &ArrayType) -> Option<Vec<&mut [f32]>> {
        let part = self.bufs[k].len() / self.offer.max(1);
        (self.offer > 0 && &self.types[k] == ty).then(|| self.bufs[k].chunks_mut(part).collect())
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
        self.events.push((k, grad.map(local)));
        Ok(())
    }
}

/// Per device: (sink buffers, sink events, `value_and_grad`'s gradients, those plus the
/// start), and the trace of the sink run.
type Run = (
    (
        Vec<Vec<f32>>,
        Vec<(usize, Option<Vec<f32>>)>,
        Vec<Vec<f32>>,
        Vec<Vec<f32>>,
    ),
    Trace,
);

fn run(
    weights_reduced: bool,
    offer: usize,
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
        let grads: Vec<Vec<f32>> = grads.iter().map(local).collect();
        let want = start
            .iter()
            .zip(&grads)
            .map(|(s, g)| s.iter().zip(g).map(|(a, b)| a + b).collect())
            .collect();
        Ok((sink.bufs, sink.events, grads, want))
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
    for ((bufs, _, _, want), _) in out {
        for (k, (b, w)) in bufs.iter().zip(want).enumerate() {
            assert_close(b, w, 1e-5, &format!("parameter {k}"));
        }
    }
}

/// (parameter, handed nothing, handed all of its gradient) per event.
fn shares(events: &[(usize, Option<Vec<f32>>)], grads: &[Vec<f32>]) -> Vec<(usize, bool, bool)> {
    events
        .iter()
        .map(|(k, handed)| match handed {
            None => (*k, true, false),
            Some(h) => {
                let all = h
                    .iter()
                    .zip(&grads[*k])
                    .all(|(a, b)| (a - b).abs() <= 1e-6 * (1.0 + b.abs()));
                (*k, false, all)
            }
        })
        .collect()
}

#[test]
fn a_weight_used_once_by_a_product_goes_into_the_buffer() {
    let (out, streamed) = run(true, 1, single, 1);
    check_sums(&out);
    for (((_, events, grads, _), trace), plain) in out.iter().zip(&streamed) {
        assert_eq!(shares(events, grads), [(0, true, false)]);
        // Deferred: no collective in the backward either way.
        assert_eq!(kinds(trace), kinds(plain));
        assert!(kinds(trace).is_empty());
    }
}

/// A buffer offered in parts (a reduce-scatter bucket keeps a value in segments) takes the
/// product part by part when each part holds whole rows of the 6×6 gradient (2 parts of 3 rows,
/// 3 of 2); the mirror: in 4 parts of 9 elements a part would cut a row, and the gradient is
/// handed over instead. Either way the sums are `value_and_grad`'s.
#[test]
fn a_buffer_in_parts_of_whole_rows_takes_the_product_and_one_that_cuts_a_row_is_handed() {
    for (parts, into) in [(2, true), (3, true), (4, false)] {
        let (out, streamed) = run(true, parts, single, 1);
        check_sums(&out);
        for (((_, events, grads, _), trace), plain) in out.iter().zip(&streamed) {
            assert_eq!(shares(events, grads), [(0, into, !into)], "{parts} parts");
            assert_eq!(kinds(trace), kinds(plain));
        }
    }
}

#[test]
fn only_sole_contributions_go_into_buffers_and_the_order_is_the_streamed_one() {
    let (out, streamed) = run(true, 1, model, 3);
    check_sums(&out);
    for (((_, events, grads, _), trace), plain) in out.iter().zip(&streamed) {
        // Each is finished at its first use, walked last: w2's, then w1's, then w0's. w1 (one
        // product) goes into its buffer; w0 (two products) and w2 (a product and a transpose)
        // are handed the sums of their contributions.
        assert_eq!(
            shares(events, grads),
            [(2, false, true), (1, true, false), (0, false, true)]
        );
        assert_eq!(kinds(trace), kinds(plain));
    }
}

/// The sink's buffer, the handed path's sum, and per finished parameter whether it went into
/// the buffer.
type AgainstHanded = (Vec<f32>, Vec<f32>, Vec<(usize, bool)>);

/// The sink's buffer after `value_and_grad_into` of `f` on the one table `ws[0]`, starting at
/// `start` and offered in `offer` parts; what the handed path gives (`start` plus
/// `value_and_grad`'s gradient); and whether the table went into the buffer.
fn against_the_handed_path(
    cx: &mut Ctx<'_>,
    ws: &[Array],
    f: &LossFn<'_>,
    start: &[f32],
    offer: usize,
) -> Result<AgainstHanded, SpmdError> {
    let (_, g) = cx.value_and_grad(ws, f)?;
    let mut sink = Recorder {
        bufs: vec![start.to_vec()],
        types: vec![ws[0].ty().to_cotangent()],
        offer,
        events: Vec::new(),
    };
    cx.value_and_grad_into(ws, f, &mut sink)?;
    let want: Vec<f32> = start.iter().zip(local(&g[0])).map(|(a, b)| a + b).collect();
    let sunk = sink.events.iter().map(|(k, h)| (*k, h.is_none())).collect();
    Ok((sink.bufs.remove(0), want, sunk))
}

/// A table only a `take` reads (ids repeat) goes into the buffer with the bits of the handed
/// path, whole or in parts of whole rows (5 parts of one row); in parts that cut a row (3 of
/// 5 elements) it is handed; a tied one (a `take` and a product) is handed the sum.
#[test]
fn a_take_goes_into_the_buffer_with_the_handed_bits_a_tied_table_is_handed() {
    let m = mesh(&[("x", 2)]);
    let out = on_devices(&m, |cx| {
        let table = place(
            cx,
            &Tensor::from_fn(&[5, 3], |i| 0.1 * i as f32 - 0.4),
            p(&["", ""], &[], &["x"]),
        );
        let ids =
            cx.ids_from_global(&[2, 4], p(&["x", ""], &[], &[]), &[4, 0, 4, 2, 1, 1, 3, 0])?;
        let ws = [table];
        let lookup = |cx: &mut Ctx<'_>, ts: &[Array]| -> Result<Array, SpmdError> {
            let rows = cx.take(&ts[0], &ids)?;
            let r3 = cx.mul(&rows, &rows)?;
            let r3 = cx.mul(&r3, &rows)?;
            cx.reduce_sum(&r3, &[0, 1, 2], Some(&p(&[], &["x"], &[])))
        };
        let tied_head = |cx: &mut Ctx<'_>, ts: &[Array]| tied(cx, ts, &ids);
        // A lookup that passes nothing back to row 4 (`take_frozen`).
        let frozen = |cx: &mut Ctx<'_>, ts: &[Array]| -> Result<Array, SpmdError> {
            let rows = cx.take_frozen(&ts[0], &ids, 4)?;
            let r3 = cx.mul(&rows, &rows)?;
            let r3 = cx.mul(&r3, &rows)?;
            cx.reduce_sum(&r3, &[0, 1, 2], Some(&p(&[], &["x"], &[])))
        };
        let start: Vec<f32> = (0..15).map(|i| i as f32 * 0.37 + 0.01).collect();
        let mut results = Vec::new();
        let models: [(&LossFn<'_>, usize); 5] = [
            (&lookup, 1),
            (&tied_head, 1),
            (&lookup, 5),
            (&lookup, 3),
            (&frozen, 1),
        ];
        for (f, offer) in models {
            results.push(against_the_handed_path(cx, &ws, f, &start, offer)?);
        }
        Ok(results)
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (results, _) in out {
        let (bufs, want, sunk) = &results[0];
        assert_eq!(sunk, &[(0, true)]);
        assert_eq!(bits(bufs), bits(want), "the handed path's bits");
        let (bufs, want, sunk) = &results[1];
        assert_eq!(sunk, &[(0, false)]);
        assert_close(bufs, want, 1e-5, "tied table");
        let (bufs, want, sunk) = &results[2];
        assert_eq!(sunk, &[(0, true)], "5 parts of one row");
        assert_eq!(bits(bufs), bits(want), "in parts, the handed path's bits");
        let (bufs, want, sunk) = &results[3];
        assert_eq!(sunk, &[(0, false)], "3 parts cut rows");
        assert_eq!(bits(bufs), bits(want));
        let (bufs, want, sunk) = &results[4];
        assert_eq!(sunk, &[(0, true)], "a frozen lookup goes into the buffer");
        assert_eq!(
            bits(bufs),
            bits(want),
            "a frozen lookup: the handed path's bits"
        );
        let start: Vec<f32> = (12..15).map(|i| i as f32 * 0.37 + 0.01).collect();
        assert_eq!(bits(&bufs[12..15]), bits(&start), "row 4 untouched");
    }
}

/// `Σ (cast(take(t, ids)) · cast(t)ᵀ)²` with `f32` logits: a tied table as the decoder uses it
/// in bf16 — the lookup reads the `f32` table and casts its rows, the head reads the table's
/// bf16 cast (`dot_general_preferred`, as the LM head).
fn tied_bf16(
    cx: &mut Ctx<'_>,
    ts: &[Array],
    ids: &Ids,
    frozen: Option<u32>,
) -> Result<Array, SpmdError> {
    use ferrotext_sharding::DType;
    let rows = match frozen {
        Some(row) => cx.take_frozen(&ts[0], ids, row)?,
        None => cx.take(&ts[0], ids)?,
    };
    let rows = cx.cast(&rows, DType::BF16)?;
    let table = cx.cast(&ts[0], DType::BF16)?;
    let head = DotDims {
        lhs_contracting: vec![2],
        rhs_contracting: vec![1],
        ..DotDims::default()
    };
    let logits = cx.dot_general_preferred(&rows, &table, &head, None, DType::F32)?;
    let l2 = cx.mul(&logits, &logits)?;
    cx.reduce_sum(&l2, &[0, 1, 2], Some(&p(&[], &["x"], &[])))
}

/// A tied table in bf16 (a lookup of the `f32` table, a head on its bf16 cast) goes into a
/// buffer offered whole with the handed path's bits: the head's rounded product into every
/// row, the lookup's rows (ids repeat, and rows stay untouched) summed with it first on the
/// rows they touch — the buffer's start `+ (w + rows)` there, its signed zeros included. The
/// mirrors: offered in parts, or with a second micro-batch's start, it is handed or sunk with
/// the same sums; the `f32` tied table above is handed. The same with the lookup frozen at a
/// row it reads twice (`take_frozen`: that row gets the head's part alone), in place and handed
/// alike.
#[test]
fn a_tied_bf16_table_goes_into_the_buffer_with_the_handed_bits() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let m = mesh(&[("x", 2)]);
    let out = on_devices(&m, |cx| {
        let table = place(
            cx,
            &Tensor::from_fn(&[6, 4], |i| ((i * 7) % 11) as f32 * 0.13 - 0.6),
            p(&["", ""], &[], &["x"]),
        );
        let ids =
            cx.ids_from_global(&[2, 4], p(&["x", ""], &[], &[]), &[4, 0, 4, 2, 1, 1, 3, 0])?;
        let ws = [table];
        // Touched rows start at +0.0, -0.0 and values whose last place is above the gradient's
        // (so that `(start + w) + rows` and `start + (w + rows)` round apart); row 5 is never
        // looked up.
        let starts: [Vec<f32>; 2] = [
            (0..24)
                .map(|i| match i % 5 {
                    0 => 0.0,
                    1 => -0.0,
                    _ => (i as f32 * 91.731 - 700.37) * if i % 2 == 0 { 1e4 } else { -1e4 },
                })
                .collect(),
            vec![0.0; 24],
        ];
        let mut results = Vec::new();
        // Plain, and with row 4 (looked up twice) frozen (`take_frozen`: the head's part only).
        for frozen in [None, Some(4)] {
            let f = |cx: &mut Ctx<'_>, ts: &[Array]| tied_bf16(cx, ts, &ids, frozen);
            for (start, offer) in [(&starts[0], 1), (&starts[1], 1), (&starts[0], 4)] {
                results.push(against_the_handed_path(cx, &ws, &f, start, offer)?);
            }
        }
        Ok(results)
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (results, _) in out {
        for (case, (bufs, want, sunk)) in results.iter().enumerate() {
            let whole = case % 3 < 2;
            assert_eq!(
                sunk,
                &[(0, whole)],
                "case {case}: into the buffer when offered whole"
            );
            assert_eq!(
                bits(bufs),
                bits(want),
                "case {case}: the handed path's bits"
            );
        }
        let (bufs, want, _) = &results[0];
        assert!(
            bufs.iter()
                .zip(want)
                .any(|(b, w)| *b != 0.0 && b.to_bits() == w.to_bits()),
            "a gradient to add"
        );
    }
}

/// `Σ y²` for `y = body(x, w)` computed inside a `shard_map` region that takes `x` and `w` with
/// the specs they carry (so a `{R:x}` weight is cast varying before use), out `{U:x}`.
fn squares_in_region(
    cx: &mut Ctx<'_>,
    x: &Array,
    w: &Array,
    body: impl FnOnce(&mut Ctx<'_>, &Array, &Array) -> Result<Array, SpmdError>,
) -> Result<Array, SpmdError> {
    let specs = [
        x.ty().sharding().spec().clone(),
        w.ty().sharding().spec().clone(),
    ];
    let out = cx.shard_map(
        &[x.clone(), w.clone()],
        &specs,
        &[p(&[], &["x"], &[])],
        |cx, xs| {
            let y = body(cx, &xs[0], &xs[1])?;
            let y2 = cx.mul(&y, &y)?;
            let s = cx.reduce_sum(&y2, &[0, 1], None)?;
            Ok(vec![cx.pcast(&s, &["x"], AxisState::Unreduced)?])
        },
    )?;
    Ok(out[0].clone())
}

/// Expert weights enter a region and are cast `reduced → varying` before a grouped product: ops
/// that only retype, so the weight's whole gradient is still the product's and goes into the
/// buffer — whole, or in 2 parts of one expert each — with the sums of `value_and_grad`. The
/// mirror: a weight the region uses twice (two products) is handed the sum.
#[test]
fn an_expert_weight_behind_a_region_and_a_cast_goes_into_the_buffer() {
    let m = mesh(&[("x", 2)]);
    let out = on_devices(&m, |cx| {
        let w = Tensor::from_fn(&[2, 4, 3], |i| ((i * 5) % 11) as f32 * 0.1 - 0.5);
        let w = place(cx, &w, p(&["", "", ""], &[], &["x"]));
        let xs = Tensor::from_fn(&[8, 4], |i| ((i * 7) % 13) as f32 * 0.1 - 0.6);
        let x = place(cx, &xs, p(&["x", ""], &[], &[]));
        let ws = [w];
        let experts = |twice: bool| {
            let x = x.clone();
            move |cx: &mut Ctx<'_>, ws: &[Array]| -> Result<Array, SpmdError> {
                squares_in_region(cx, &x, &ws[0], |cx, x, w| {
                    let y = cx.grouped_matmul(x, w, &[1, 3])?;
                    if !twice {
                        return Ok(y);
                    }
                    let again = cx.grouped_matmul(x, w, &[3, 1])?;
                    cx.add(&y, &again)
                })
            }
        };
        let start: Vec<f32> = (0..24).map(|i| i as f32 * 0.05 - 0.4).collect();
        let mut results = Vec::new();
        for (twice, offer) in [(false, 1), (false, 2), (true, 1)] {
            let f = experts(twice);
            let (_, g) = cx.value_and_grad(&ws, &f)?;
            let mut sink = Recorder {
                bufs: vec![start.clone()],
                types: vec![ws[0].ty().to_cotangent()],
                offer,
                events: Vec::new(),
            };
            cx.value_and_grad_into(&ws, &f, &mut sink)?;
            let want: Vec<f32> = start.iter().zip(local(&g[0])).map(|(a, b)| a + b).collect();
            let sunk: Vec<(usize, bool)> =
                sink.events.iter().map(|(k, h)| (*k, h.is_none())).collect();
            results.push((sink.bufs.remove(0), want, sunk));
        }
        Ok(results)
    });
    for (results, _) in out {
        for ((bufs, want, sunk), into) in results.iter().zip([true, true, false]) {
            assert_eq!(sunk, &[(0, into)]);
            assert_close(bufs, want, 1e-5, "expert weight");
        }
    }
}

/// Inside a region a weight's transposed product is the local product: a `{R:x}` weight cast
/// varying and used by one matmul there goes into the buffer, with `value_and_grad`'s sums.
#[test]
fn a_dense_weight_inside_a_region_goes_into_the_buffer() {
    let m = mesh(&[("x", 2)]);
    let out = on_devices(&m, |cx| {
        let w = Tensor::from_fn(&[4, 3], |i| ((i * 5) % 11) as f32 * 0.1 - 0.5);
        let w = place(cx, &w, p(&["", ""], &[], &["x"]));
        let xs = Tensor::from_fn(&[8, 4], |i| ((i * 7) % 13) as f32 * 0.1 - 0.6);
        let x = place(cx, &xs, p(&["x", ""], &[], &[]));
        let ws = [w];
        let f = |cx: &mut Ctx<'_>, ws: &[Array]| -> Result<Array, SpmdError> {
            squares_in_region(cx, &x, &ws[0], |cx, x, w| cx.matmul(x, w, None))
        };
        let (_, g) = cx.value_and_grad(&ws, f)?;
        let start: Vec<f32> = (0..12).map(|i| i as f32 * 0.05 - 0.3).collect();
        let mut sink = Recorder {
            bufs: vec![start.clone()],
            types: vec![ws[0].ty().to_cotangent()],
            offer: 1,
            events: Vec::new(),
        };
        cx.value_and_grad_into(&ws, f, &mut sink)?;
        let want: Vec<f32> = start.iter().zip(local(&g[0])).map(|(a, b)| a + b).collect();
        Ok((sink.bufs.remove(0), want, sink.events[0].1.is_none()))
    });
    for ((bufs, want, into), _) in out {
        assert!(into, "into the buffer");
        assert_close(&bufs, &want, 1e-5, "dense weight in a region");
    }
}

/// The mirrors: a plain weight's transposed product all-reduces, so its gradient is handed
/// over even with a buffer on offer; and a sink that offers none is handed everything.
#[test]
fn a_gradient_that_needs_a_collective_or_has_no_buffer_is_handed_over() {
    let (out, streamed) = run(false, 1, single, 1);
    check_sums(&out);
    for (((_, events, grads, _), trace), plain) in out.iter().zip(&streamed) {
        assert_eq!(shares(events, grads), [(0, false, true)]);
        assert_eq!(kinds(trace), kinds(plain));
        assert!(kinds(trace)
            .iter()
            .any(|(k, _)| *k == CollectiveKind::AllReduce));
    }
    let (out, _) = run(true, 0, model, 3);
    check_sums(&out);
    for ((_, events, grads, _), _) in &out {
        assert_eq!(
            shares(events, grads),
            [(2, false, true), (1, false, true), (0, false, true)]
        );
    }
}

/// `Σ (cast(x)·cast(w))²` in bf16 (the square in f32): the weight is used once, by a `cast`.
fn single_bf16(cx: &mut Ctx<'_>, ws: &[Array], x: &Array) -> Result<Array, SpmdError> {
    let xb = cx.cast(x, ferrotext_sharding::DType::BF16)?;
    let wb = cx.cast(&ws[0], ferrotext_sharding::DType::BF16)?;
    let y = cx.dot_general_preferred(
        &xb,
        &wb,
        &DotDims::matmul(2),
        None,
        ferrotext_sharding::DType::F32,
    )?;
    let y2 = cx.mul(&y, &y)?;
    cx.reduce_sum(&y2, &[0, 1], Some(&p(&[], &["x"], &[])))
}

/// Runs `f` (one weight) with its buffer offered in `parts`: the weight is not handed over, and
/// the buffer ends with exactly the bits of its start plus `value_and_grad`'s gradient (the
/// handed path), with the same collectives as the streamed run.
fn into_the_buffer_with_the_handed_bits(
    f: fn(&mut Ctx<'_>, &[Array], &Array) -> Result<Array, SpmdError>,
    parts: usize,
) {
    let (out, streamed) = run(true, parts, f, 1);
    for (((bufs, events, grads, want), trace), plain) in out.iter().zip(&streamed) {
        assert_eq!(shares(events, grads), [(0, true, false)], "{parts} parts");
        let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&bufs[0]),
            bits(&want[0]),
            "{parts} parts: the handed bits"
        );
        assert!(grads[0].iter().any(|g| *g != 0.0), "a gradient to add");
        assert_eq!(kinds(trace), kinds(plain));
    }
}

/// A weight cast to bf16 at use by an elementwise op: the cast's transpose widens its bf16
/// cotangent straight into the buffer (whole, or in parts of any length: it is elementwise),
/// with the bits of the handed path — `value_and_grad`'s f32 gradient added to the buffer's
/// start, compared exactly.
#[test]
fn a_weight_cast_to_bf16_is_widened_into_the_buffer_with_the_handed_bits() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    for parts in [1, 4] {
        into_the_buffer_with_the_handed_bits(squared_bf16_weight, parts);
    }
    // The mirror: offered no buffer, the gradient is handed over (and the sums still agree).
    let (out, _) = run(true, 0, squared_bf16_weight, 1);
    for ((_, events, grads, _), _) in &out {
        assert_eq!(shares(events, grads), [(0, false, true)]);
    }
}

/// `Σ cast(cast(x)·cast(w))²`: a bf16 product (its result rounded to bf16, as a layer's
/// activation is), the square in f32. The weight's cotangent is the transposed product rounded
/// to bf16, then widened by the cast's transpose.
fn single_bf16_product(cx: &mut Ctx<'_>, ws: &[Array], x: &Array) -> Result<Array, SpmdError> {
    let xb = cx.cast(x, ferrotext_sharding::DType::BF16)?;
    let wb = cx.cast(&ws[0], ferrotext_sharding::DType::BF16)?;
    let y = cx.dot_general(&xb, &wb, &DotDims::matmul(2), None)?;
    let y = cx.cast(&y, ferrotext_sharding::DType::F32)?;
    let y2 = cx.mul(&y, &y)?;
    cx.reduce_sum(&y2, &[0, 1], Some(&p(&[], &["x"], &[])))
}

/// Per device, how many `widen_add_bf16` spans (a bf16 cotangent widened into a buffer) the
/// backward of `f` ran with its one weight's buffer offered whole.
fn widening_adds(f: fn(&mut Ctx<'_>, &[Array], &Array) -> Result<Array, SpmdError>) -> Vec<usize> {
    ferrotext_profile::enable();
    on_devices(&mesh(&[("x", 2)]), |cx| {
        let w = Tensor::from_fn(&[6, 6], |i| (i % 13) as f32 * 0.05 - 0.3);
        let w = place(cx, &w, p(&["", ""], &[], &["x"]));
        let x = Tensor::from_fn(&[8, 6], |i| ((i * 7) % 17) as f32 * 0.1 - 0.8);
        let x = place(cx, &x, p(&["x", ""], &[], &[]));
        let mut sink = Recorder {
            bufs: vec![vec![0.0; 36]],
            types: vec![w.ty().to_cotangent()],
            offer: 1,
            events: Vec::new(),
        };
        ferrotext_profile::begin_thread(0);
        ferrotext_profile::set_step(Some(0));
        cx.value_and_grad_into(&[w], |cx, ps| f(cx, ps, &x), &mut sink)?;
        let events = ferrotext_profile::end_thread();
        assert_eq!(sink.events.len(), 1, "the weight is finished once");
        Ok(events.iter().filter(|e| e.kind == "widen_add_bf16").count())
    })
    .into_iter()
    .map(|(n, _)| n)
    .collect()
}

/// A weight cast to bf16 for a bf16 product: the transposed product rounds its result and adds
/// it widened into the buffer itself (no bf16 cotangent stored, no separate widening add), with
/// the bits of the handed path — `value_and_grad`'s gradient (the rounded product, then the
/// cast's widening) added to the buffer's start, compared exactly — whole or in parts (4
/// parts cut a row: the cast widens the product's bf16 result into them instead).
#[test]
fn a_weight_cast_for_a_bf16_product_takes_the_rounded_product_into_the_buffer() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    for parts in [1, 2, 4, 6] {
        into_the_buffer_with_the_handed_bits(single_bf16_product, parts);
    }
    // The probe: no widening add on this path; the mirror, a weight whose bf16 cast is used
    // by an elementwise op (its bf16 cotangent is widened by the cast's transpose), has one.
    assert_eq!(widening_adds(single_bf16_product), [0, 0]);
    assert_eq!(widening_adds(squared_bf16_weight), [1, 1]);
}

/// `Σ cast(cast(x)·cast(w)²)²`: the weight's bf16 cast is used by an elementwise op (the
/// square), not by the product, so its bf16 cotangent reaches the cast and is widened there.
fn squared_bf16_weight(cx: &mut Ctx<'_>, ws: &[Array], x: &Array) -> Result<Array, SpmdError> {
    let xb = cx.cast(x, ferrotext_sharding::DType::BF16)?;
    let wb = cx.cast(&ws[0], ferrotext_sharding::DType::BF16)?;
    let w2 = cx.mul(&wb, &wb)?;
    let y = cx.dot_general(&xb, &w2, &DotDims::matmul(2), None)?;
    let y = cx.cast(&y, ferrotext_sharding::DType::F32)?;
    let y2 = cx.mul(&y, &y)?;
    cx.reduce_sum(&y2, &[0, 1], Some(&p(&[], &["x"], &[])))
}

/// A weight cast to bf16 for a product whose result stays f32 (the LM head's logits,
/// `dot_general_preferred`): its cotangent is cast to bf16 once, before both transposes, so the
/// weight's transposed product is rounded and added into its buffer like a layer's — no
/// widening add — with the handed path's bits, whole or in parts (and the handed path, offered
/// no buffer, still agrees: the other test above).
#[test]
fn a_weight_behind_a_product_with_an_f32_result_takes_the_rounded_product_into_the_buffer() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    for parts in [1, 2, 4, 6] {
        into_the_buffer_with_the_handed_bits(single_bf16, parts);
    }
    assert_eq!(widening_adds(single_bf16), [0, 0]);
}
