//! `value_and_grad_streaming`: each parameter's gradient is handed over as soon as the backward
//! walk has passed its last use — the parameters of the last ops first — with the values
//! `value_and_grad` returns, each exactly once.

mod common;

use common::*;
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;

/// `Σ w2·(w1·(w0·x))` over a length-4 vector; `w3` unused.
fn chain(cx: &mut Ctx<'_>, ps: &[Array], x: &Array) -> Result<Array, SpmdError> {
    let h0 = cx.mul(&ps[0], x)?;
    let h1 = cx.mul(&ps[1], &h0)?;
    let h2 = cx.mul(&ps[2], &h1)?;
    cx.reduce_sum(&h2, &[0], None)
}

#[test]
fn gradients_arrive_last_op_first_with_the_same_values() {
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let value = |k: usize| Tensor::from_fn(&[4], |i| 0.5 + (i + 3 * k) as f32 * 0.25);
        let params: Vec<Array> = (0..4)
            .map(|k| place(cx, &value(k), PartitionSpec::replicated()))
            .collect();
        let x = place(cx, &value(9), PartitionSpec::replicated());
        let (_, plain) = cx.value_and_grad(&params, |cx, ps| chain(cx, ps, &x))?;
        let mut seen: Vec<(usize, Vec<f32>)> = Vec::new();
        let (_, streamed) =
            cx.value_and_grad_streaming(&params, |cx, ps| chain(cx, ps, &x), &mut |_, k, g| {
                seen.push((k, local(g)));
                Ok(())
            })?;
        Ok((
            plain.iter().map(local).collect::<Vec<_>>(),
            streamed.iter().map(local).collect::<Vec<_>>(),
            seen,
        ))
    });
    for ((plain, streamed, seen), _) in out {
        assert_eq!(plain, streamed);
        let order: Vec<usize> = seen.iter().map(|(k, _)| *k).collect();
        // w2 is used by the last op, w0 by the first; the unused w3 comes last, as zeros.
        assert_eq!(order, [2, 1, 0, 3]);
        for (k, g) in &seen {
            assert_eq!(g, &plain[*k], "parameter {k}");
        }
        assert!(seen[3].1.iter().all(|&v| v == 0.0));
    }
}

#[test]
fn a_hook_error_stops_the_walk() {
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let params: Vec<Array> = (0..4)
            .map(|_| place(cx, &Tensor::full(&[4], 1.0), PartitionSpec::replicated()))
            .collect();
        let x = place(cx, &Tensor::full(&[4], 2.0), PartitionSpec::replicated());
        let mut calls = 0;
        let err = cx
            .value_and_grad_streaming(&params, |cx, ps| chain(cx, ps, &x), &mut |_, _, _| {
                calls += 1;
                Err(SpmdError::Stopped {
                    op: "hook",
                    reason: "stop".into(),
                })
            })
            .err()
            .map(|e| e.to_string());
        Ok((err, calls))
    });
    for ((err, calls), _) in out {
        assert_eq!(err.as_deref(), Some("`hook`: stop"));
        assert_eq!(calls, 1);
    }
}

/// `accumulate` (the engine's gradient accumulator): bitwise `add`, in place; a shard another
/// array shares is copied first, so the other keeps its value; mismatched types and arrays on a
/// tape are refused by name.
#[test]
fn accumulate_adds_in_place_like_add() {
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let a = place(
            cx,
            &Tensor::from_fn(&[4, 8], |i| 0.1 * i as f32),
            PartitionSpec::new([Some("data"), None]),
        );
        let b = place(
            cx,
            &Tensor::from_fn(&[4, 8], |i| 1.0 / (1 + i) as f32),
            PartitionSpec::new([Some("data"), None]),
        );
        let want = cx.add(&a, &b)?;
        let shared = a.clone();
        let mut acc = a;
        cx.accumulate(&mut acc, &b)?;
        let other = place(cx, &Tensor::full(&[4, 8], 1.0), PartitionSpec::replicated());
        let mismatch = cx
            .accumulate(&mut acc.clone(), &other)
            .unwrap_err()
            .to_string();
        let (_, taped) = cx.value_and_grad(std::slice::from_ref(&b), |cx, ps| {
            let mut inside = ps[0].clone();
            let refused = cx.accumulate(&mut inside, &ps[0]).is_err();
            assert!(refused, "an array on the tape is refused");
            cx.reduce_sum(&ps[0], &[0, 1], None)
        })?;
        drop(taped);
        Ok((local(&acc), local(&want), local(&shared), mismatch))
    });
    for ((acc, want, shared, mismatch), _) in out {
        assert_eq!(acc, want);
        assert_ne!(shared, acc, "the shared shard kept its value");
        assert!(
            mismatch.contains("accumulate") && mismatch.contains("f32["),
            "{mismatch}"
        );
    }
}
