//! Flat bucket buffers: accumulating into a bucket's buffer and moving it in place is bitwise the
//! same as accumulating one array per value and moving them with `reshard_planned`, with the same
//! collectives.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, Communicator, NoTransport, Trace};
use ferrotext_sharding::{ArrayType, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;

/// A value of type `spec` whose local block differs on every device and with `salt`.
fn per_device(cx: &Ctx<'_>, shape: &[usize], spec: &PartitionSpec, salt: usize) -> Array {
    let ty = cx.array_type(shape, spec.clone()).unwrap();
    let device = cx.device();
    let local = Tensor::from_fn(&ty.shard_shape(), |i| {
        ((i * 7 + device * 13 + salt * 31) as f32 * 0.37).sin() / 3.0
    });
    cx.from_local(ty, local).unwrap()
}

/// (kind, elements) of every collective, in order.
fn events(trace: &Trace) -> Vec<(CollectiveKind, usize)> {
    trace
        .events()
        .iter()
        .map(|e| (e.kind, e.elements))
        .collect()
}

/// Values of `shapes` typed `sources`, moved to `targets`: two "micro-batches" accumulated into
/// arrays and moved by `reshard_planned`, and the same accumulated into buffers and moved by
/// `reshard_buffers` (bucket 0 started early when `start_first`). Returns per device (arrays'
/// locals, buffers' locals, arrays' trace, buffers' trace).
type Both = (Vec<Vec<f32>>, Vec<Vec<f32>>, Trace, Trace);

fn both_ways(
    mesh_axes: &[(&str, usize)],
    values: &[(Vec<usize>, PartitionSpec, PartitionSpec)],
    bucket_bytes: usize,
    start_first: bool,
) -> Vec<Both> {
    let m = mesh(mesh_axes);
    on_devices(&m, |cx| {
        let sources: Vec<ArrayType> = values
            .iter()
            .map(|(shape, spec, _)| cx.array_type(shape, spec.clone()))
            .collect::<Result<_, _>>()?;
        let targets: Vec<PartitionSpec> = values.iter().map(|v| v.2.clone()).collect();
        let order: Vec<usize> = (0..values.len()).rev().collect();
        let plan = cx.plan_buckets(&sources, &targets, bucket_bytes, &order)?;
        let micro = |cx: &Ctx<'_>, salt: usize| -> Vec<Array> {
            values
                .iter()
                .enumerate()
                .map(|(i, (shape, spec, _))| per_device(cx, shape, spec, salt * 10 + i))
                .collect()
        };
        let (first, second) = (micro(cx, 1), micro(cx, 2));

        let mut accs: Vec<Array> = sources.iter().map(|t| cx.zeros(t.clone())).collect();
        let mut buffers = cx.bucket_buffers(&plan)?;
        for batch in [&first, &second] {
            for (i, x) in batch.iter().enumerate() {
                cx.accumulate(&mut accs[i], x)?;
                cx.accumulate_into(&mut buffers, i, x)?;
            }
        }
        let copies: Vec<Vec<f32>> = buffers.to_arrays()?.iter().map(local).collect();
        let accumulated: Vec<Vec<f32>> = accs.iter().map(local).collect();
        assert_eq!(
            copies, accumulated,
            "to_arrays gives the accumulated values"
        );

        cx.comm().take_trace();
        let by_arrays: Vec<Vec<f32>> = cx
            .reshard_planned(&plan, &accs)?
            .iter()
            .map(local)
            .collect();
        let t_arrays = cx.comm().take_trace();
        let mut started = Vec::new();
        if start_first && plan.bucket_count() > 0 {
            started.push(cx.start_buffered_bucket(&plan, 0, &mut buffers)?);
        }
        let by_buffers: Vec<Vec<f32>> = cx
            .reshard_buffers(&plan, buffers, started)?
            .iter()
            .map(local)
            .collect();
        let t_buffers = cx.comm().take_trace();
        Ok((by_arrays, by_buffers, t_arrays, t_buffers))
    })
    .into_iter()
    .map(|(v, _)| v)
    .collect()
}

/// Shapes of 4·(24, 40, 8, 64, 100) bytes, `{U:data}`, each to `target(shape)`.
fn gradients(
    target: impl Fn(&[usize]) -> PartitionSpec,
) -> Vec<(Vec<usize>, PartitionSpec, PartitionSpec)> {
    [vec![4, 6], vec![8, 5], vec![8], vec![4, 16], vec![20, 4]]
        .into_iter()
        .map(|shape| {
            let u = p(&vec![""; shape.len()], &["data"], &[]);
            let t = target(&shape);
            (shape, u, t)
        })
        .collect()
}

fn check(both: Vec<Both>, kind: CollectiveKind, collectives: usize) {
    for (by_arrays, by_buffers, t_arrays, t_buffers) in both {
        assert_eq!(by_arrays, by_buffers, "bitwise the per-array path");
        let (ea, mut eb) = (events(&t_arrays), events(&t_buffers));
        // A bucket started early is on the background channel; the others keep their order.
        eb.sort_by_key(|e| e.1);
        let mut ea_sorted = ea.clone();
        ea_sorted.sort_by_key(|e| e.1);
        assert_eq!(ea_sorted, eb, "the same collectives");
        assert_eq!(ea.iter().filter(|e| e.0 == kind).count(), collectives);
    }
}

#[test]
fn all_reduce_buckets_moved_in_place_equal_the_arrays_moved_in_buckets() {
    let values = gradients(|_| PartitionSpec::replicated());
    // 240-byte buckets, filled from the last value back (bytes 320 | 256 | 32+160 | 96): 4
    // all-reduces.
    for start_first in [false, true] {
        check(
            both_ways(&[("data", 4)], &values, 240, start_first),
            CollectiveKind::AllReduce,
            4,
        );
        check(
            both_ways(&[("data", 4)], &values, 1 << 20, start_first),
            CollectiveKind::AllReduce,
            1,
        );
    }
}

#[test]
fn reduce_scatter_buffers_hold_each_members_chunks_together_on_any_dimension() {
    // ZeRO-1's reduce-scatter, scattering dim 0 of some values and dim 1 of others (chunks of
    // dim 1 are strided in the value and contiguous in the buffer).
    let values = gradients(|shape| match shape.len() {
        1 => p(&["data"], &[], &[]),
        _ if shape[1] % 4 == 0 => p(&["", "data"], &[], &[]),
        _ => p(&["data", ""], &[], &[]),
    });
    for start_first in [false, true] {
        check(
            both_ways(&[("data", 4)], &values, 1 << 20, start_first),
            CollectiveKind::ReduceScatter,
            1,
        );
    }
}

#[test]
fn values_outside_buckets_are_kept_as_arrays_and_moved_alone() {
    // data=2 × tensor=2: a tensor-split value joins the data all-reduce bucket; a move no single
    // collective makes and a tag-only change stay loose.
    let values = vec![
        (
            vec![4, 6],
            p(&["", "tensor"], &["data"], &[]),
            p(&["", "tensor"], &[], &[]),
        ),
        (
            vec![6],
            p(&[""], &["data"], &[]),
            PartitionSpec::replicated(),
        ),
        (
            vec![4, 6],
            p(&["", ""], &["data"], &[]),
            p(&["tensor", ""], &[], &[]),
        ),
        (vec![4, 6], p(&["", ""], &[], &[]), p(&["", ""], &[], &[])),
    ];
    for start_first in [false, true] {
        for (by_arrays, by_buffers, _, t_buffers) in
            both_ways(&[("data", 2), ("tensor", 2)], &values, 1 << 20, start_first)
        {
            assert_eq!(by_arrays, by_buffers);
            assert!(events(&t_buffers).contains(&(CollectiveKind::AllReduce, 4 * 6 / 2 + 6)));
        }
    }
}

#[test]
fn a_started_bucket_is_not_readable_nor_writable_and_a_wrong_type_is_refused() {
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let u = p(&["", ""], &["data"], &[]);
        let ty = cx.array_type(&[4, 6], u.clone())?;
        let plan = cx.plan_buckets(
            std::slice::from_ref(&ty),
            &[PartitionSpec::replicated()],
            1 << 20,
            &[0],
        )?;
        let mut buffers = cx.bucket_buffers(&plan)?;
        let plain = per_device(cx, &[4, 6], &p(&["", ""], &[], &[]), 0);
        let wrong = cx
            .accumulate_into(&mut buffers, 0, &plain)
            .err()
            .map(|e| e.to_string());
        let x = per_device(cx, &[4, 6], &u, 0);
        cx.accumulate_into(&mut buffers, 0, &x)?;
        let started = cx.start_buffered_bucket(&plan, 0, &mut buffers)?;
        let read = buffers.to_arrays().err().map(|e| e.to_string());
        let write = cx
            .accumulate_into(&mut buffers, 0, &x)
            .err()
            .map(|e| e.to_string());
        let twice = cx
            .start_buffered_bucket(&plan, 0, &mut buffers)
            .err()
            .map(|e| e.to_string());
        let moved = cx.reshard_buffers(&plan, buffers, vec![started])?;
        let want = cx.reshard(&x, &PartitionSpec::replicated())?;
        Ok((wrong, read, write, twice, local(&moved[0]) == local(&want)))
    });
    for ((wrong, read, write, twice, same), _) in out {
        let wrong = wrong.expect("a plain value into a {U:data} accumulator is refused");
        assert!(
            wrong.contains("f32[4,6]{U:data}") && wrong.contains("f32[4,6]`"),
            "{wrong}"
        );
        assert!(read.expect("in flight").contains("being reduced"));
        assert!(write.expect("in flight").contains("being reduced"));
        assert!(twice.expect("started twice").contains("twice"));
        assert!(same);
    }
}

#[test]
fn abstract_buffers_record_each_collective_once_whether_started_early_or_not() {
    let m = mesh(&[("data", 8)]);
    let values = gradients(|_| PartitionSpec::replicated());
    let record = |start_first: bool| -> Result<Vec<(CollectiveKind, usize)>, SpmdError> {
        let mut comm = Communicator::new(0, m.clone(), Box::new(NoTransport));
        let mut cx = Ctx::new_abstract(&mut comm);
        let sources: Vec<ArrayType> = values
            .iter()
            .map(|(shape, spec, _)| cx.array_type(shape, spec.clone()))
            .collect::<Result<_, _>>()?;
        let targets: Vec<PartitionSpec> = values.iter().map(|v| v.2.clone()).collect();
        let plan = cx.plan_buckets(&sources, &targets, 240, &[4, 3, 2, 1, 0])?;
        let mut buffers = cx.bucket_buffers(&plan)?;
        for (i, ty) in sources.iter().enumerate() {
            let x = cx.abstract_array(ty.clone());
            cx.accumulate_into(&mut buffers, i, &x)?;
        }
        let mut started = Vec::new();
        if start_first {
            started.push(cx.start_buffered_bucket(&plan, 0, &mut buffers)?);
        }
        cx.reshard_buffers(&plan, buffers, started)?;
        Ok(events(&cx.comm().take_trace()))
    };
    let (plain, early) = (record(false).unwrap(), record(true).unwrap());
    assert_eq!(plain.len(), 4, "{plain:?}");
    assert_eq!(plain, early);
}

/// A reduce-scatter bucket keeps a value cut along dim 0 as one run per segment: `value_mut`
/// offers those runs as the value's consecutive parts (chunk `k` in part `k`), so adding the
/// value's block part by part is `accumulate_into`, to the bit. A value cut along dim 1 has
/// several runs per segment and is not offered (the mirror); nor is one of another type.
#[test]
fn value_mut_offers_a_reduce_scatter_values_chunks_as_its_parts() {
    let m = mesh(&[("data", 4)]);
    let out = on_devices(&m, |cx| {
        let u = p(&["", ""], &["data"], &[]);
        let ty = cx.array_type(&[8, 4], u.clone())?;
        let plan = cx.plan_buckets(
            &[ty.clone(), ty.clone()],
            &[p(&["data", ""], &[], &[]), p(&["", "data"], &[], &[])],
            1 << 20,
            &[1, 0],
        )?;
        let x = per_device(cx, &[8, 4], &u, 3);
        let (mut by_parts, mut by_add) = (cx.bucket_buffers(&plan)?, cx.bucket_buffers(&plan)?);
        let block = local(&x);
        let parts = by_parts.value_mut(0, &ty).map(|mut parts| {
            let sizes: Vec<usize> = parts.iter().map(|p| p.len()).collect();
            for (part, chunk) in parts.iter_mut().zip(block.chunks(block.len() / 4)) {
                for (a, b) in part.iter_mut().zip(chunk) {
                    *a += b;
                }
            }
            sizes
        });
        cx.accumulate_into(&mut by_add, 0, &x)?;
        let dim1 = by_parts.value_mut(1, &ty).is_some();
        let plain = cx.array_type(&[8, 4], p(&["", ""], &[], &[]))?;
        let other_type = by_parts.value_mut(0, &plain).is_some();
        let same = local(&by_parts.to_arrays()?[0]) == local(&by_add.to_arrays()?[0]);
        Ok((parts, dim1, other_type, same))
    });
    for ((parts, dim1, other_type, same), _) in out {
        assert_eq!(parts, Some(vec![8; 4]), "4 parts of 2 rows");
        assert!(same, "bitwise accumulate_into");
        assert!(!dim1, "chunks of dim 1 are strided in the value");
        assert!(!other_type);
    }
}
