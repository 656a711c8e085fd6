//! `shard_map`: boundary rules (R6.3, R6.6), the varying/unreduced/reduced typing inside, the casts
//! and collectives with their transposes (docs/sharding-rules.md §6.4), and the transposition rule
//! that decides whether a replicated input's gradient is psummed (R6.13–R6.14).

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, AxisState, Ctx, GatherTo, SpmdError, TypeErrorKind, UnaryOp};
use ferrotext_tensor::Tensor;

fn x_value() -> Tensor {
    Tensor::from_fn(&[8, 4], |i| ((i * 5 % 9) as f32 - 4.0) * 0.25)
}
fn w_value() -> Tensor {
    Tensor::from_fn(&[4, 2], |i| 0.1 * i as f32 - 0.35)
}

/// d/dw of sum((x·w)²) on the host.
fn host_dw() -> Vec<f32> {
    let (x, w) = (x_value(), w_value());
    let mut g = vec![0f32; 8];
    for b in 0..8 {
        for j in 0..2 {
            let y: f32 = (0..4)
                .map(|k| x.data()[b * 4 + k] * w.data()[k * 2 + j])
                .sum();
            for k in 0..4 {
                g[k * 2 + j] += 2.0 * y * x.data()[b * 4 + k];
            }
        }
    }
    g
}

/// Per device: the full gradient of `w`, its type before resharding, and the type of `x·w` inside the region.
type RegionResult = (Vec<f32>, String, String);

/// `y = x·w` inside a shard_map (x split over the batch), loss `sum(y²)` outside.
fn matmul_in_region(reduced_w: bool) -> Vec<(RegionResult, ferrotext_comm::Trace)> {
    let m = mesh(&[("data", 2)]);
    on_devices(&m, move |cx| {
        let x_spec = p(&["data", ""], &[], &[]);
        let w_spec = if reduced_w {
            p(&["", ""], &[], &["data"])
        } else {
            p(&["", ""], &[], &[])
        };
        let x = place(cx, &x_value(), x_spec.clone());
        let w = place(cx, &w_value(), w_spec.clone());
        cx.comm().push_phase("step");
        let mut inner_type = String::new();
        let (_, g) = cx.value_and_grad(&[w], |cx, ws| {
            let out = cx.shard_map(
                &[x.clone(), ws[0].clone()],
                &[x_spec.clone(), w_spec.clone()],
                &[p(&["data", ""], &[], &[])],
                |cx, xs| {
                    let y = cx.matmul(&xs[0], &xs[1], None)?;
                    inner_type = y.ty().to_string();
                    Ok(vec![y])
                },
            )?;
            let y2 = cx.mul(&out[0], &out[0])?;
            cx.reduce_sum(&y2, &[0, 1], None)
        })?;
        cx.comm().pop_phase();
        let ty = g[0].ty().to_string();
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok((local(&full), ty, inner_type))
    })
}

#[test]
fn reduced_in_spec_gives_unreduced_grad_with_no_psum() {
    for ((dw, ty, inner), trace) in matmul_in_region(true) {
        assert_eq!(inner, "f32[4,2]{V:data}");
        assert_eq!(ty, "f32[4,2]{U:data}");
        assert_close(&dw, &host_dw(), 1e-5, "dw");
        // Only the scalar loss is all-reduced in the step.
        assert!(trace
            .all_reduces_larger_than(1, &PhasePattern::new("step"))
            .is_empty());
    }
}

#[test]
fn mirror_untagged_in_spec_gets_a_psum_in_the_backward() {
    for ((dw, ty, _), trace) in matmul_in_region(false) {
        assert_eq!(ty, "f32[4,2]");
        assert_close(&dw, &host_dw(), 1e-5, "dw");
        let big = trace.all_reduces_larger_than(1, &PhasePattern::new("step"));
        assert_eq!(big.len(), 1, "the transposed pvary of w is one psum");
        assert_eq!(big[0].elements, 8);
    }
}

#[test]
fn matmul_to_unreduced_through_pcast() {
    // JAX's test_matmul_unreduced: a contraction over `y` inside, cast to unreduced, out
    // P('x', U{y}); the per-device partials sum to the product.
    let m = mesh(&[("x", 2), ("y", 2)]);
    let a = Tensor::from_fn(&[4, 4], |i| i as f32);
    let b = Tensor::from_fn(&[4, 2], |i| 1.0 + i as f32);
    let results = on_devices(&m, |cx| {
        let (sa, sb) = (p(&["x", "y"], &[], &[]), p(&["y", ""], &[], &[]));
        let xa = place(cx, &a, sa.clone());
        let xb = place(cx, &b, sb.clone());
        let out = cx.shard_map(
            &[xa, xb],
            &[sa, sb],
            &[p(&["x", ""], &["y"], &[])],
            |cx, xs| {
                let y = cx.matmul(&xs[0], &xs[1], None)?;
                assert_eq!(y.ty().to_string(), "f32[2,2]{V:(x,y)}");
                let u = cx.pcast(&y, &["y"], AxisState::Unreduced)?;
                assert_eq!(u.ty().to_string(), "f32[2,2]{V:x, U:y}");
                Ok(vec![u])
            },
        )?;
        assert_eq!(out[0].ty().to_string(), "f32[4@x,2]{U:y}");
        let full = cx.reshard(&out[0], &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    let want: Vec<f32> = (0..4)
        .flat_map(|i| {
            (0..2).map(move |j| {
                (0..4)
                    .map(|k| (i * 4 + k) as f32 * (1.0 + (k * 2 + j) as f32))
                    .sum::<f32>()
            })
        })
        .collect();
    for (v, _) in results {
        assert_eq!(v, want);
    }
}

#[test]
fn psum_of_unreduced_and_preduced_transpose_into_each_other() {
    let m = mesh(&[("data", 2)]);
    let results = on_devices(&m, |cx| {
        let spec = p(&[""], &[], &["data"]);
        let w = place(cx, &Tensor::full(&[3], 2.0), spec.clone());
        let (_, g) = cx.value_and_grad(&[w], |cx, ws| {
            let out = cx.shard_map(
                &[ws[0].clone()],
                std::slice::from_ref(&spec),
                &[p(&[""], &[], &[])],
                |cx, xs| {
                    // R → V (free cast), V → U, then psum of U: an all-reduce to invarying.
                    let v = cx.pcast(&xs[0], &["data"], AxisState::Varying)?;
                    let u = cx.pcast(&v, &["data"], AxisState::Unreduced)?;
                    Ok(vec![cx.psum(&u, &["data"])?])
                },
            )?;
            cx.reduce_sum(&out[0], &[0], None)
        })?;
        assert_eq!(g[0].ty().to_string(), "f32[3]{U:data}");
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    // Forward: psum of the two identical copies = 2w, loss = Σ 2w; gradient 2 per element.
    for (v, trace) in results {
        assert_eq!(v, vec![2.0; 3]);
        assert_eq!(
            trace.count(CollectiveKind::AllReduce, &PhasePattern::any()),
            2,
            "forward psum + final reshard"
        );
    }
}

#[test]
fn all_gather_reduced_and_psum_scatter_unreduced_are_a_transpose_pair() {
    let m = mesh(&[("fsdp", 2)]);
    let results = on_devices(&m, |cx| {
        let spec = p(&["fsdp", ""], &[], &[]);
        let w = place(cx, &w_value(), spec.clone());
        cx.comm().push_phase("step");
        let (_, g) = cx.value_and_grad(&[w], |cx, ws| {
            let out = cx.shard_map(
                &[ws[0].clone()],
                std::slice::from_ref(&spec),
                &[p(&["", ""], &[], &["fsdp"])],
                |cx, xs| {
                    Ok(vec![cx.all_gather(
                        &xs[0],
                        &["fsdp"],
                        0,
                        GatherTo::Reduced,
                    )?])
                },
            )?;
            let sq = cx.mul(&out[0], &out[0])?;
            cx.reduce_sum(&sq, &[0, 1], None)
        })?;
        cx.comm().pop_phase();
        assert_eq!(g[0].ty().to_string(), "f32[4@fsdp,2]");
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    let want: Vec<f32> = w_value().data().iter().map(|v| 2.0 * v).collect();
    for (v, trace) in results {
        assert_close(&v, &want, 1e-6, "d(sum w²)/dw");
        let step = PhasePattern::new("step");
        assert_eq!(trace.count(CollectiveKind::AllGather, &step), 1);
        assert_eq!(trace.count(CollectiveKind::ReduceScatter, &step), 1);
    }
}

#[test]
fn all_to_all_forward_and_backward() {
    let m = mesh(&[("expert", 2)]);
    let value = Tensor::from_fn(&[4, 2], |i| i as f32);
    let results = on_devices(&m, |cx| {
        let spec = p(&["expert", ""], &[], &[]);
        let x = place(cx, &value, spec.clone());
        let mut exchanged = Vec::new();
        let (_, g) = cx.value_and_grad(&[x], |cx, xs| {
            let out = cx.shard_map(
                &[xs[0].clone()],
                std::slice::from_ref(&spec),
                std::slice::from_ref(&spec),
                |cx, xs| {
                    let y = cx.all_to_all(&xs[0], &["expert"], 0, 0)?;
                    exchanged = local(&y);
                    // weight each exchanged row by its position to make the gradient non-trivial
                    let wv = Tensor::from_fn(&[2, 2], |i| 1.0 + i as f32);
                    let wt = y.ty().clone();
                    let w = Array::clone(&cx.from_local(wt, wv)?);
                    Ok(vec![cx.mul(&y, &w)?])
                },
            )?;
            cx.reduce_sum(&out[0], &[0, 1], None)
        })?;
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok((exchanged, local(&full)))
    });
    // Device 0 holds rows 0,1; device 1 rows 2,3. Chunk j of each goes to device j.
    assert_eq!(results[0].0 .0, vec![0., 1., 4., 5.]);
    assert_eq!(results[1].0 .0, vec![2., 3., 6., 7.]);
    // The gradient of row r is the weight its element met after the exchange.
    assert_eq!(results[0].0 .1, vec![1., 2., 1., 2., 3., 4., 3., 4.]);
}

#[test]
fn boundary_and_inside_type_errors() {
    let m = mesh(&[("data", 2)]);
    let results = on_devices(&m, |cx| {
        let w = place(cx, &w_value(), p(&["", ""], &[], &["data"]));
        let kind = |r: Result<Vec<Array>, SpmdError>| {
            r.unwrap_err()
                .type_error()
                .map(|t| (t.kind, t.message.clone()))
        };
        // R6.3: the in_spec must equal the argument's spec, tags included.
        let r6_3 = kind(cx.shard_map(
            std::slice::from_ref(&w),
            &[p(&["", ""], &[], &[])],
            &[],
            |_, _| Ok(vec![]),
        ));
        // R6.6: a reduced output through an untagged out_spec.
        let spec = p(&["", ""], &[], &["data"]);
        let r6_6 = kind(cx.shard_map(
            std::slice::from_ref(&w),
            std::slice::from_ref(&spec),
            &[p(&["", ""], &[], &[])],
            |_, xs| Ok(vec![xs[0].clone()]),
        ));
        // R6.12: sin of an unreduced value inside.
        let r6_12 = kind(cx.shard_map(
            std::slice::from_ref(&w),
            std::slice::from_ref(&spec),
            &[],
            |cx, xs| {
                let v = cx.pcast(&xs[0], &["data"], AxisState::Varying)?;
                let u = cx.pcast(&v, &["data"], AxisState::Unreduced)?;
                cx.unary(UnaryOp::Sin, &u)?;
                Ok(vec![])
            },
        ));
        // Unsupported pcast: invarying → unreduced.
        let plain = place(cx, &w_value(), p(&["", ""], &[], &[]));
        let bad_cast = kind(
            cx.shard_map(&[plain], &[p(&["", ""], &[], &[])], &[], |cx, xs| {
                cx.pcast(&xs[0], &["data"], AxisState::Unreduced)?;
                Ok(vec![])
            }),
        );
        Ok(vec![r6_3, r6_6, r6_12, bad_cast])
    });
    let errs = &results[0].0;
    assert_eq!(errs[0].as_ref().unwrap().0, TypeErrorKind::ShardingMismatch);
    assert!(errs[0]
        .as_ref()
        .unwrap()
        .1
        .contains("does not match the specs of the input"));
    assert_eq!(
        errs[1].as_ref().unwrap().0,
        TypeErrorKind::UnreducedMismatch
    );
    assert_eq!(errs[2].as_ref().unwrap().0, TypeErrorKind::UnreducedOperand);
    assert!(errs[3]
        .as_ref()
        .unwrap()
        .1
        .contains("Unsupported pcast from=invarying, to='unreduced'"));
}

#[test]
fn abstract_shard_map_records_the_real_trace() {
    let m = mesh(&[("data", 2)]);
    let real = matmul_in_region(false);
    let mut comm =
        ferrotext_comm::Communicator::new(0, m.clone(), Box::new(ferrotext_comm::NoTransport));
    let mut cx = Ctx::new_abstract(&mut comm);
    let x_spec = p(&["data", ""], &[], &[]);
    let w_spec = p(&["", ""], &[], &[]);
    let x = cx.abstract_array(cx.array_type(&[8, 4], x_spec.clone()).unwrap());
    let w = cx.abstract_array(cx.array_type(&[4, 2], w_spec.clone()).unwrap());
    cx.comm().push_phase("step");
    let (_, g) = cx
        .value_and_grad(&[w], |cx, ws| {
            let out = cx.shard_map(
                &[x.clone(), ws[0].clone()],
                &[x_spec.clone(), w_spec.clone()],
                &[p(&["data", ""], &[], &[])],
                |cx, xs| Ok(vec![cx.matmul(&xs[0], &xs[1], None)?]),
            )?;
            let y2 = cx.mul(&out[0], &out[0])?;
            cx.reduce_sum(&y2, &[0, 1], None)
        })
        .unwrap();
    cx.comm().pop_phase();
    cx.reshard(&g[0], &PartitionSpec::replicated()).unwrap();
    assert_eq!(cx.comm().trace().events(), real[0].1.events());
}
