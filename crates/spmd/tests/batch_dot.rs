//! `dot_general` with a batch dim sharded on one operand only (R3.9, as JAX 0.10.2 does it): the
//! output takes the lhs's batch partition, and in real mode every device must hold the right
//! values of that output — also when the lhs is replicated there and the rhs is not, so the
//! local product alone would only cover this device's batch slice. Checked against a plain
//! single-device batched matmul written out here (an independent baseline), forward and
//! gradient.

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_sharding::{Mesh, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError, TypeErrorKind};
use ferrotext_tensor::{DotDims, Tensor};
use std::sync::Arc;

/// `out[b, m, n] = Σ_k lhs[b, m, k] · rhs[b, k, n]` over a flattened batch `b`.
fn batched_matmul(lhs: &Tensor, rhs: &Tensor, nb: usize) -> Tensor {
    let (ls, rs) = (lhs.shape(), rhs.shape());
    let batch: usize = ls[..nb].iter().product();
    let (m, k, n) = (ls[nb], ls[nb + 1], rs[nb + 1]);
    let mut out = vec![0.0f32; batch * m * n];
    for b in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f64;
                for c in 0..k {
                    acc += f64::from(lhs.data()[(b * m + i) * k + c])
                        * f64::from(rhs.data()[(b * k + c) * n + j]);
                }
                out[(b * m + i) * n + j] = acc as f32;
            }
        }
    }
    let mut shape = ls[..nb].to_vec();
    shape.extend([m, n]);
    Tensor::new(shape, out).unwrap()
}

/// The gradients of `Σ out²` with respect to `lhs` and `rhs`, by hand:
/// `dlhs[b,m,k] = Σ_n 2·out[b,m,n]·rhs[b,k,n]`, `drhs[b,k,n] = Σ_m lhs[b,m,k]·2·out[b,m,n]`.
fn baseline_grads(lhs: &Tensor, rhs: &Tensor, nb: usize) -> (Vec<f32>, Vec<f32>) {
    let out = batched_matmul(lhs, rhs, nb);
    let (ls, rs) = (lhs.shape(), rhs.shape());
    let batch: usize = ls[..nb].iter().product();
    let (m, k, n) = (ls[nb], ls[nb + 1], rs[nb + 1]);
    let (mut dl, mut dr) = (
        vec![0.0f32; lhs.data().len()],
        vec![0.0f32; rhs.data().len()],
    );
    for b in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let g = 2.0 * out.data()[(b * m + i) * n + j];
                for c in 0..k {
                    dl[(b * m + i) * k + c] += g * rhs.data()[(b * k + c) * n + j];
                    dr[(b * k + c) * n + j] += g * lhs.data()[(b * m + i) * k + c];
                }
            }
        }
    }
    (dl, dr)
}

/// Batch dims leading (`nb` of them), then `[m, k]` on the lhs and `[k, n]` on the rhs.
fn batch_dims(nb: usize) -> DotDims {
    DotDims {
        lhs_contracting: vec![nb + 1],
        rhs_contracting: vec![nb],
        lhs_batch: (0..nb).collect(),
        rhs_batch: (0..nb).collect(),
    }
}

/// The block of `global` that `device` holds under `spec` (the sharding crate's layout, not the
/// op under test).
fn block_of(mesh: &Arc<Mesh>, global: &Tensor, spec: &PartitionSpec, device: usize) -> Vec<f32> {
    let named = ferrotext_sharding::NamedSharding::new(mesh.clone(), spec.clone()).unwrap();
    let ranges = named.shard_ranges(global.shape(), device).unwrap();
    global.slice(&ranges).unwrap().data().to_vec()
}

struct Case {
    mesh: Arc<Mesh>,
    lhs_shape: Vec<usize>,
    lhs_spec: PartitionSpec,
    rhs_shape: Vec<usize>,
    rhs_spec: PartitionSpec,
    nb: usize,
    /// The printed output type (R3.9: the lhs's batch partition).
    want_ty: &'static str,
    /// The output spec that `want_ty` prints.
    want_spec: PartitionSpec,
}

struct DeviceResult {
    out_ty: String,
    out_local: Vec<f32>,
    forward_gathers: usize,
    grad_tys: Vec<String>,
    grads: Vec<Vec<f32>>,
}

fn run(case: &Case) {
    let lhs_g = Tensor::from_fn(&case.lhs_shape, |i| ((i * 7 + 3) % 11) as f32 * 0.25 - 1.0);
    let rhs_g = Tensor::from_fn(&case.rhs_shape, |i| ((i * 5 + 1) % 13) as f32 * 0.2 - 1.1);
    let want = batched_matmul(&lhs_g, &rhs_g, case.nb);
    let (want_dl, want_dr) = baseline_grads(&lhs_g, &rhs_g, case.nb);
    let dims = batch_dims(case.nb);
    let results = on_devices(&case.mesh, |cx: &mut Ctx<'_>| {
        let lhs = place(cx, &lhs_g, case.lhs_spec.clone());
        let rhs = place(cx, &rhs_g, case.rhs_spec.clone());
        cx.comm().push_phase("forward");
        let out = cx.dot_general(&lhs, &rhs, &dims, None)?;
        cx.comm().pop_phase();
        let forward_gathers = cx
            .comm()
            .trace()
            .count(CollectiveKind::AllGather, &PhasePattern::any());
        let (_, grads) = cx.value_and_grad(&[lhs.clone(), rhs.clone()], |cx, p| {
            let y = cx.dot_general(&p[0], &p[1], &dims, None)?;
            let y2 = cx.mul(&y, &y)?;
            let all: Vec<usize> = (0..y2.ty().rank()).collect();
            cx.reduce_sum(&y2, &all, None)
        })?;
        let grad_tys = grads.iter().map(|g: &Array| g.ty().to_string()).collect();
        let grads = grads
            .iter()
            .map(|g| Ok(cx.to_host(g)?.data().to_vec()))
            .collect::<Result<_, SpmdError>>()?;
        Ok(DeviceResult {
            out_ty: out.ty().to_string(),
            out_local: local(&out),
            forward_gathers,
            grad_tys,
            grads,
        })
    });
    for (device, (r, _)) in results.iter().enumerate() {
        assert_eq!(r.out_ty, case.want_ty, "device {device}: output type");
        let want_block = block_of(&case.mesh, &want, &case.want_spec, device);
        assert_close(
            &r.out_local,
            &want_block,
            1e-5,
            &format!("device {device}: output"),
        );
        let lhs_ty = format!("{}", place_ty(&case.mesh, &case.lhs_shape, &case.lhs_spec));
        let rhs_ty = format!("{}", place_ty(&case.mesh, &case.rhs_shape, &case.rhs_spec));
        assert_eq!(
            r.grad_tys,
            vec![lhs_ty, rhs_ty],
            "device {device}: cotangent types"
        );
        assert_close(
            &r.grads[0],
            &want_dl,
            1e-4,
            &format!("device {device}: d lhs"),
        );
        assert_close(
            &r.grads[1],
            &want_dr,
            1e-4,
            &format!("device {device}: d rhs"),
        );
        // The output is replicated on a batch axis the rhs is sharded on: the batch slices were
        // computed apart, so the forward op had to gather (and it says so in the trace).
        let rhs_only = (0..case.nb)
            .any(|d| case.lhs_spec.dim(d).is_replicated() && !case.rhs_spec.dim(d).is_replicated());
        if rhs_only {
            assert!(
                r.forward_gathers > 0,
                "device {device}: no all-gather recorded"
            );
        }
    }
}

fn place_ty(
    mesh: &Arc<Mesh>,
    shape: &[usize],
    spec: &PartitionSpec,
) -> ferrotext_sharding::ArrayType {
    let named = ferrotext_sharding::NamedSharding::new(mesh.clone(), spec.clone()).unwrap();
    ferrotext_sharding::ArrayType::new(ferrotext_sharding::DType::F32, shape.to_vec(), named)
        .unwrap()
}

#[test]
fn rhs_only_sharded_batch_gives_replicated_output_with_correct_values() {
    run(&Case {
        mesh: mesh(&[("data", 2)]),
        lhs_shape: vec![4, 3, 5],
        lhs_spec: p(&["", "", ""], &[], &[]),
        rhs_shape: vec![4, 5, 2],
        rhs_spec: p(&["data", "", ""], &[], &[]),
        nb: 1,
        want_ty: "f32[4,3,2]",
        want_spec: p(&["", "", ""], &[], &[]),
    });
}

#[test]
fn lhs_only_sharded_batch_keeps_the_lhs_partition() {
    run(&Case {
        mesh: mesh(&[("data", 2)]),
        lhs_shape: vec![4, 3, 5],
        lhs_spec: p(&["data", "", ""], &[], &[]),
        rhs_shape: vec![4, 5, 2],
        rhs_spec: p(&["", "", ""], &[], &[]),
        nb: 1,
        want_ty: "f32[4@data,3,2]",
        want_spec: p(&["data", "", ""], &[], &[]),
    });
}

/// JAX's example: `[4,8@fsdp,8]·[4@data,8,4]` → `f32[4,8@fsdp,4]`.
#[test]
fn rhs_batch_on_data_lhs_free_on_fsdp() {
    run(&Case {
        mesh: mesh(&[("data", 2), ("fsdp", 2)]),
        lhs_shape: vec![4, 8, 8],
        lhs_spec: p(&["", "fsdp", ""], &[], &[]),
        rhs_shape: vec![4, 8, 4],
        rhs_spec: p(&["data", "", ""], &[], &[]),
        nb: 1,
        want_ty: "f32[4,8@fsdp,4]",
        want_spec: p(&["", "fsdp", ""], &[], &[]),
    });
}

/// The rhs's batch axis is the one the lhs's free dim is sharded on.
#[test]
fn rhs_batch_axis_used_by_lhs_free_dim() {
    run(&Case {
        mesh: mesh(&[("data", 2)]),
        lhs_shape: vec![4, 4, 5],
        lhs_spec: p(&["", "data", ""], &[], &[]),
        rhs_shape: vec![4, 5, 2],
        rhs_spec: p(&["data", "", ""], &[], &[]),
        nb: 1,
        want_ty: "f32[4,4@data,2]",
        want_spec: p(&["", "data", ""], &[], &[]),
    });
}

/// Two batch dims, each sharded on a different side.
#[test]
fn several_batch_dims_sharded_on_different_sides() {
    run(&Case {
        mesh: mesh(&[("data", 2), ("fsdp", 2)]),
        lhs_shape: vec![2, 4, 3, 5],
        lhs_spec: p(&["", "fsdp", "", ""], &[], &[]),
        rhs_shape: vec![2, 4, 5, 2],
        rhs_spec: p(&["data", "", "", ""], &[], &[]),
        nb: 2,
        want_ty: "f32[2,4@fsdp,3,2]",
        want_spec: p(&["", "fsdp", "", ""], &[], &[]),
    });
}

/// Both sides sharded, on different axes: R3.9's error, raised before any compute.
#[test]
fn batch_sharded_differently_on_both_sides_is_an_error() {
    let m = mesh(&[("data", 2), ("tensor", 2)]);
    let results = on_devices(&m, |cx| {
        let lhs = place(cx, &iota(&[4, 3, 5]), p(&["data", "", ""], &[], &[]));
        let rhs = place(cx, &iota(&[4, 5, 2]), p(&["tensor", "", ""], &[], &[]));
        let err = cx
            .dot_general(&lhs, &rhs, &batch_dims(1), None)
            .unwrap_err();
        let t = err.type_error().expect("a type error").clone();
        Ok((t.kind, err.to_string()))
    });
    for ((kind, msg), trace) in &results {
        assert_eq!(*kind, TypeErrorKind::BatchMismatch);
        assert!(
            msg.contains(
                "dot_general requires lhs batch dimensions and rhs batch dimensions to have the \
                 consistent sharding, got ('data',) and ('tensor',)."
            ),
            "{msg}"
        );
        assert!(
            msg.contains("f32[4@data,3,5]") && msg.contains("f32[4@tensor,5,2]"),
            "{msg}"
        );
        assert!(trace.events().is_empty());
    }
}
