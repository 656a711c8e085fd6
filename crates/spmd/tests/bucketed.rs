//! Bucketed resharding: the same values, bit for bit, as one `reshard` per value, with one
//! collective per bucket instead of one per value.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern, Trace};
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;

/// A value of type `spec` whose local block differs on every device (irrational-looking values,
/// so a sum in another order would show in the bits).
fn per_device(cx: &Ctx<'_>, shape: &[usize], spec: PartitionSpec, salt: usize) -> Array {
    let ty = cx.array_type(shape, spec).unwrap();
    let device = cx.device();
    let local = Tensor::from_fn(&ty.shard_shape(), |i| {
        ((i * 7 + device * 13 + salt * 31) as f32 * 0.37).sin() / 3.0
    });
    cx.from_local(ty, local).unwrap()
}

fn count(trace: &Trace, kind: CollectiveKind) -> usize {
    trace.count(kind, &PhasePattern::new("*"))
}

/// Moves `values` to `targets` both ways on every device; returns (per-value locals, bucketed
/// locals, per-value trace, bucketed trace) of each device.
type Both = (Vec<Vec<f32>>, Vec<Vec<f32>>, Trace, Trace);

fn both_ways(
    mesh_axes: &[(&str, usize)],
    make: impl Fn(&Ctx<'_>) -> Vec<(Array, PartitionSpec)> + Sync,
    bucket_bytes: usize,
) -> Vec<Both> {
    let m = mesh(mesh_axes);
    on_devices(&m, |cx| {
        let pairs = make(cx);
        let (xs, targets): (Vec<Array>, Vec<PartitionSpec>) = pairs.into_iter().unzip();
        cx.comm().take_trace();
        let one_by_one = xs
            .iter()
            .zip(&targets)
            .map(|(x, t)| cx.reshard(x, t).map(|a| local(&a)))
            .collect::<Result<Vec<_>, SpmdError>>()?;
        let single = cx.comm().take_trace();
        let bucketed: Vec<Vec<f32>> = cx
            .reshard_bucketed(&xs, &targets, bucket_bytes)?
            .iter()
            .map(local)
            .collect();
        let fused = cx.comm().take_trace();
        Ok((one_by_one, bucketed, single, fused))
    })
    .into_iter()
    .map(|(v, _)| v)
    .collect()
}

/// Five gradient-like values of 4·(24, 40, 8, 64, 100) bytes, `{U:data}` → `to`.
fn gradients(cx: &Ctx<'_>, to: &PartitionSpec) -> Vec<(Array, PartitionSpec)> {
    [vec![4, 6], vec![8, 5], vec![8], vec![4, 16], vec![20, 5]]
        .iter()
        .enumerate()
        .map(|(i, shape)| {
            let parts: Vec<&str> = vec![""; shape.len()];
            let u = per_device(cx, shape, p(&parts, &["data"], &[]), i);
            let mut target = to.clone();
            if target.len() > shape.len() {
                target = PartitionSpec::replicated();
            }
            (u, target)
        })
        .collect()
}

#[test]
fn all_reduce_buckets_are_bitwise_equal_to_one_reduction_per_value() {
    // 236 elements in all: one bucket; 240-byte buckets: [24+40+8+64 | 100 | ...] → 3 buckets;
    // a budget below every value: one bucket per value.
    for (budget, buckets) in [(1 << 20, 1), (300, 3), (1, 5)] {
        for (single, fused, t1, t2) in both_ways(
            &[("data", 4)],
            |cx| gradients(cx, &PartitionSpec::replicated()),
            budget,
        ) {
            assert_eq!(single, fused, "budget {budget}");
            assert_eq!(count(&t1, CollectiveKind::AllReduce), 5);
            assert_eq!(
                count(&t2, CollectiveKind::AllReduce),
                buckets,
                "budget {budget}"
            );
        }
    }
}

#[test]
fn reduce_scatter_and_all_gather_buckets_match_the_zero1_path() {
    // {U:data} → sharded over data on dim 0 (ZeRO-1's reduce-scatter), then back to plain (its
    // all-gather), in buckets; the 1-D value of 8 shards too.
    let m = &[("data", 4)];
    let make = |cx: &Ctx<'_>| -> Vec<(Array, PartitionSpec)> {
        gradients(cx, &p(&["data", ""], &[], &[]))
            .into_iter()
            .map(|(x, t)| {
                let t = if x.ty().rank() == 1 {
                    p(&["data"], &[], &[])
                } else {
                    t
                };
                (x, t)
            })
            .collect()
    };
    for (single, fused, t1, t2) in both_ways(m, make, 1 << 20) {
        assert_eq!(single, fused);
        assert_eq!(count(&t1, CollectiveKind::ReduceScatter), 5);
        assert_eq!(count(&t2, CollectiveKind::ReduceScatter), 1);
        assert_eq!(count(&t2, CollectiveKind::AllReduce), 0);
    }
    let gather = |cx: &Ctx<'_>| -> Vec<(Array, PartitionSpec)> {
        [vec![4, 6], vec![8, 5], vec![8], vec![4, 3]]
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let mut parts = vec![""; shape.len()];
                parts[0] = "data";
                let x = per_device(cx, shape, p(&parts, &[], &[]), i);
                (x, PartitionSpec::replicated())
            })
            .collect()
    };
    for (single, fused, t1, t2) in both_ways(m, gather, 1 << 20) {
        assert_eq!(single, fused);
        assert_eq!(count(&t1, CollectiveKind::AllGather), 4);
        assert_eq!(count(&t2, CollectiveKind::AllGather), 1);
    }
}

#[test]
fn values_scattering_different_dimensions_share_a_bucket_each_cut_along_its_own() {
    // ZeRO-1 shards whichever dimension the group divides: dim 0 of some values, dim 1 of
    // others. One bucket holds them all; each must be cut (and gathered back) along its own
    // dimension, as one reshard per value does.
    let shapes = [vec![4, 6], vec![3, 8], vec![8], vec![6, 4]];
    let dim_of = |shape: &[usize]| usize::from(!shape[0].is_multiple_of(4));
    let scatter = |cx: &Ctx<'_>| -> Vec<(Array, PartitionSpec)> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let u = per_device(cx, shape, p(&vec![""; shape.len()], &["data"], &[]), i);
                let mut parts = vec![""; shape.len()];
                parts[dim_of(shape)] = "data";
                (u, p(&parts, &[], &[]))
            })
            .collect()
    };
    for (single, fused, t1, t2) in both_ways(&[("data", 4)], scatter, 1 << 20) {
        assert_eq!(single, fused);
        assert_eq!(count(&t1, CollectiveKind::ReduceScatter), 4);
        assert_eq!(count(&t2, CollectiveKind::ReduceScatter), 1);
    }
    let gather = |cx: &Ctx<'_>| -> Vec<(Array, PartitionSpec)> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let mut parts = vec![""; shape.len()];
                parts[dim_of(shape)] = "data";
                (
                    per_device(cx, shape, p(&parts, &[], &[]), i),
                    PartitionSpec::replicated(),
                )
            })
            .collect()
    };
    for (single, fused, t1, t2) in both_ways(&[("data", 4)], gather, 1 << 20) {
        assert_eq!(single, fused);
        assert_eq!(count(&t1, CollectiveKind::AllGather), 4);
        assert_eq!(count(&t2, CollectiveKind::AllGather), 1);
    }
}

#[test]
fn values_split_over_another_axis_reduce_over_data_only_and_others_fall_back() {
    // data=2 × tensor=2: a `{U:data}` value sharded over tensor keeps its tensor split (an
    // all-reduce over data, bucketed with the others); a transition no single collective makes
    // (unreduced over data → sharded over tensor on a replicated dim) runs alone.
    let make = |cx: &Ctx<'_>| -> Vec<(Array, PartitionSpec)> {
        vec![
            (
                per_device(cx, &[4, 6], p(&["", "tensor"], &["data"], &[]), 0),
                p(&["", "tensor"], &[], &[]),
            ),
            (
                per_device(cx, &[6], p(&[""], &["data"], &[]), 1),
                PartitionSpec::replicated(),
            ),
            (
                per_device(cx, &[4, 6], p(&["", ""], &["data"], &[]), 2),
                p(&["tensor", ""], &[], &[]),
            ),
        ]
    };
    for (single, fused, _, t2) in both_ways(&[("data", 2), ("tensor", 2)], make, 1 << 20) {
        assert_eq!(single, fused);
        // one bucket for the first two, and the third's own collectives
        let events: Vec<_> = t2
            .events()
            .iter()
            .map(|e| (e.kind, e.axes.clone()))
            .collect();
        assert_eq!(
            events.first().map(|e| e.0),
            Some(CollectiveKind::AllReduce),
            "{events:?}"
        );
    }
}

#[test]
fn a_bad_target_is_the_reshard_type_error_before_anything_moves() {
    let m = mesh(&[("data", 4)]);
    let out = on_devices(&m, |cx| {
        let good = per_device(cx, &[4], p(&[""], &["data"], &[]), 0);
        let bad_target = p(&["nope"], &[], &[]);
        cx.comm().take_trace();
        let err = cx
            .reshard_bucketed(
                &[good.clone(), good],
                &[PartitionSpec::replicated(), bad_target],
                1 << 20,
            )
            .err()
            .map(|e| e.to_string());
        Ok((err, cx.comm().take_trace().events().len()))
    });
    for ((err, events), _) in out {
        assert!(err.is_some());
        assert_eq!(events, 0, "nothing communicated");
    }
}
