//! Typed errors carry the values they name: a caller can match on the op, the counts, the printed
//! types and the bucket, and the sentence printed is built from those fields. Each refusal is
//! paired with the same call on good arguments, which succeeds.

mod common;

use common::*;
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::SpmdError;
use ferrotext_tensor::Tensor;

#[test]
fn argument_counts_shapes_and_scalars_are_refused_with_their_values() {
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let ty = cx.array_type(&[4, 6], p(&["data", ""], &[], &[]))?;
        // A shard of [4@data, 6] on 2 devices is [2, 6]; [3, 6] is not.
        let wrong_shape = cx
            .from_local(ty.clone(), Tensor::zeros(&[3, 6]))
            .err()
            .map(|e| (e.to_string(), matches!(e, SpmdError::ShardShape { ref expected, ref got, .. } if expected == &[2, 6] && got == &[3, 6])));
        let x = cx.from_local(ty.clone(), Tensor::zeros(&[2, 6]))?;
        // Two inputs for one in_spec.
        let count = cx
            .shard_map(
                &[x.clone(), x.clone()],
                &[p(&["data", ""], &[], &[])],
                &[],
                |_, _| Ok(vec![]),
            )
            .err();
        let ran = cx
            .shard_map(
                std::slice::from_ref(&x),
                &[p(&["data", ""], &[], &[])],
                &[],
                |_, _| Ok(vec![]),
            )
            .is_ok();
        let not_scalar = x.scalar().err();
        let one = cx.array_type(&[], PartitionSpec::replicated())?;
        let scalar = cx.full(one, 2.5)?.scalar()?;
        let none = cx.concat(&[], 0).err();
        Ok((wrong_shape, count, ran, not_scalar, scalar, none))
    });
    for ((wrong_shape, count, ran, not_scalar, scalar, none), _) in out {
        let (text, typed) = wrong_shape.expect("a [3, 6] block of f32[4@data,6] is refused");
        assert!(typed, "{text}");
        assert_eq!(
            text,
            "`from_local`: a shard of `f32[4@data,6]` has shape [2, 6], got [3, 6]"
        );
        match count.expect("two inputs for one in_spec are refused") {
            e @ SpmdError::CountMismatch {
                op: "shard_map",
                got: 2,
                expected: 1,
                ..
            } => assert_eq!(e.to_string(), "`shard_map`: 2 inputs for 1 in_specs"),
            other => panic!("not a count mismatch: {other}"),
        }
        assert!(ran, "one input for one in_spec runs");
        match not_scalar.expect("a [4, 6] array is not a scalar") {
            SpmdError::NotScalar { op: "scalar", ty } => assert_eq!(ty, "f32[4@data,6]"),
            other => panic!("not NotScalar: {other}"),
        }
        assert_eq!(scalar, 2.5);
        assert_eq!(
            none.expect("concat of nothing is refused").to_string(),
            "`concat`: no operands"
        );
    }
}

#[test]
fn a_bucket_plan_refuses_counts_and_orders_by_value() {
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let ty = cx.array_type(&[4, 6], p(&["", ""], &["data"], &[]))?;
        let types = [ty.clone(), ty];
        let targets = [PartitionSpec::replicated(), PartitionSpec::replicated()];
        let short = cx
            .plan_buckets(&types, &targets[..1], 1 << 20, &[0, 1])
            .err();
        let twice = cx.plan_buckets(&types, &targets, 1 << 20, &[1, 1]).err();
        let plan = cx.plan_buckets(&types, &targets, 1 << 20, &[1, 0]);
        Ok((short, twice, plan.is_ok()))
    });
    for ((short, twice, planned), _) in out {
        match short.expect("two values for one target are refused") {
            e @ SpmdError::CountMismatch {
                got: 2,
                expected: 1,
                ..
            } => assert_eq!(e.to_string(), "`plan_buckets`: 2 values for 1 targets"),
            other => panic!("not a count mismatch: {other}"),
        }
        match twice.expect("an order naming a value twice is refused") {
            SpmdError::BadOrder { order, values, .. } => {
                assert_eq!(order, vec![1, 1]);
                assert_eq!(values, 2);
            }
            other => panic!("not BadOrder: {other}"),
        }
        assert!(planned, "an order listing each value once plans");
    }
}

#[test]
fn accumulating_into_a_value_the_buffers_lack_names_the_index_and_the_count() {
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let u = p(&["", ""], &["data"], &[]);
        let ty = cx.array_type(&[4, 6], u)?;
        let plan = cx.plan_buckets(
            std::slice::from_ref(&ty),
            &[PartitionSpec::replicated()],
            1 << 20,
            &[0],
        )?;
        let mut buffers = cx.bucket_buffers(&plan)?;
        let x = cx.from_local(ty, Tensor::full(&[4, 6], 1.0))?;
        let past = cx.accumulate_into(&mut buffers, 5, &x).err();
        let into = cx.accumulate_into(&mut buffers, 0, &x).is_ok();
        Ok((past, into))
    });
    for ((past, into), _) in out {
        match past.expect("value 5 of one is refused") {
            e @ SpmdError::NoSuchValue {
                index: 5,
                values: 1,
                ..
            } => assert_eq!(
                e.to_string(),
                "`accumulate_into`: no value 5 (the buffers hold 1)"
            ),
            other => panic!("not NoSuchValue: {other}"),
        }
        assert!(into, "value 0 of one is accumulated");
    }
}
