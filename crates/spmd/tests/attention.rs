//! The tiled `attention` op on a `data × tensor` mesh (batch over `data`, heads over
//! `tensor`, grouped-query heads): its output against an f64 loop written here, its gradients
//! against the unfused composition (`dot_general` · `causal_softmax` · `dot_general` with k and
//! v broadcast to every head) on one device, no collective in either direction; and its type
//! errors name the op and print the operands.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, AttentionSpec, Ctx, QueryPlaces, SpmdError};
use ferrotext_tensor::{DotDims, Tensor};

const B: usize = 4;
const T: usize = 6;
const H: usize = 4;
const KV: usize = 2;
const D: usize = 3;
const SCALE: f32 = 0.6;

fn inputs() -> (Tensor, Tensor, Tensor, Tensor) {
    let f = |n: usize, a: usize, b: usize| {
        Tensor::from_fn(&[B, T, n, D], move |i| {
            ((i * a + b) % 17) as f32 * 0.13 - 1.0
        })
    };
    let w = Tensor::from_fn(&[B, T, H, D], |i| ((i * 3 + 2) % 7) as f32 * 0.3 - 0.9);
    (f(H, 7, 3), f(KV, 5, 1), f(KV, 11, 4), w)
}

/// `out[b, i, h] = Σ_{j ≤ i} softmax_j(SCALE · q[b,i,h]·k[b,j,g]) · v[b,j,g]`, `g = h / (H/KV)`,
/// in f64.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor) -> Vec<f32> {
    let at = |t: &Tensor, n: usize, b: usize, s: usize, h: usize, d: usize| {
        f64::from(t.data()[((b * T + s) * n + h) * D + d])
    };
    let mut out = vec![0.0f32; B * T * H * D];
    for b in 0..B {
        for i in 0..T {
            for h in 0..H {
                let g = h / (H / KV);
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        (0..D)
                            .map(|d| at(q, H, b, i, h, d) * at(k, KV, b, j, g, d))
                            .sum::<f64>()
                            * f64::from(SCALE)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..D {
                    let o: f64 = (0..=i).map(|j| e[j] / z * at(v, KV, b, j, g, d)).sum();
                    out[((b * T + i) * H + h) * D + d] = o as f32;
                }
            }
        }
    }
    out
}

/// The unfused composition of the same attention (the models' path before fusion).
fn unfused(cx: &mut Ctx<'_>, q: &Array, k: &Array, v: &Array) -> Result<Array, SpmdError> {
    let g = H / KV;
    let k5 = cx.broadcast_in_dim(k, &[B, T, KV, g, D], &[0, 1, 2, 4], None)?;
    let v5 = cx.broadcast_in_dim(v, &[B, T, KV, g, D], &[0, 1, 2, 4], None)?;
    let k = cx.reshape(&k5, &[B, T, H, D], None)?;
    let v = cx.reshape(&v5, &[B, T, H, D], None)?;
    let qk = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![3],
        lhs_batch: vec![0, 2],
        rhs_batch: vec![0, 2],
    };
    let scores = cx.dot_general(q, &k, &qk, None)?;
    let probs = cx.causal_softmax(&scores, SCALE)?;
    let pv = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![1],
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
    };
    let out = cx.dot_general(&probs, &v, &pv, None)?;
    cx.transpose(&out, &[0, 2, 1, 3])
}

/// What one device computed: the output and the gradients of `Σ attention ⊙ w` (on host), the
/// collectives the forward issued, and the gradients' types next to the operands'.
struct Run {
    out: Vec<f32>,
    grads: Vec<Vec<f32>>,
    forward_collectives: usize,
    /// The same count around a reshard of `q` to replicated (the probe's mirror).
    mirror_collectives: usize,
    grad_types: Vec<String>,
    operand_types: Vec<String>,
}

/// [`Run`] with `fused` or the composition.
fn loss_grads(cx: &mut Ctx<'_>, specs: [PartitionSpec; 4], fused: bool) -> Result<Run, SpmdError> {
    let (q, k, v, w) = inputs();
    let [sq, skv, sv, sw] = specs;
    let (q, k, v) = (place(cx, &q, sq), place(cx, &k, skv), place(cx, &v, sv));
    let w = place(cx, &w, sw);
    let before = cx.comm().trace().events().len();
    let out = if fused {
        cx.attention(
            &q,
            &k,
            &v,
            &AttentionSpec::causal(SCALE),
            QueryPlaces::default(),
        )?
    } else {
        unfused(cx, &q, &k, &v)?
    };
    let forward_collectives = cx.comm().trace().events().len() - before;
    // The probe's mirror: a gather of the (split) queries to every device is seen by it.
    let before = cx.comm().trace().events().len();
    cx.reshard(&q, &p(&["", "", "", ""], &[], &[]))?;
    let mirror_collectives = cx.comm().trace().events().len() - before;
    let out_host = cx.to_host(&out)?.data().to_vec();
    let operand_types = [&q, &k, &v].iter().map(|a| a.ty().to_string()).collect();
    let (_, grads) = cx.value_and_grad(&[q, k, v], |cx, p| {
        let y = if fused {
            cx.attention(
                &p[0],
                &p[1],
                &p[2],
                &AttentionSpec::causal(SCALE),
                QueryPlaces::default(),
            )?
        } else {
            unfused(cx, &p[0], &p[1], &p[2])?
        };
        let yw = cx.mul(&y, &w)?;
        cx.reduce_sum(&yw, &[0, 1, 2, 3], None)
    })?;
    let grad_types = grads.iter().map(|g| g.ty().to_string()).collect();
    let grads = grads
        .iter()
        .map(|g| Ok(cx.to_host(g)?.data().to_vec()))
        .collect::<Result<_, SpmdError>>()?;
    Ok(Run {
        out: out_host,
        grads,
        forward_collectives,
        mirror_collectives,
        grad_types,
        operand_types,
    })
}

#[test]
fn fused_attention_on_a_split_batch_and_split_heads_matches_the_reference_and_the_composition() {
    let (q, k, v, _) = inputs();
    let want = reference(&q, &k, &v);
    let split = p(&["data", "", "tensor", ""], &[], &[]);
    let whole = p(&["", "", "", ""], &[], &[]);
    let m = mesh(&[("data", 2), ("tensor", 2)]);
    let fused = on_devices(&m, |cx| {
        loss_grads(
            cx,
            [split.clone(), split.clone(), split.clone(), split.clone()],
            true,
        )
    });
    let one = mesh(&[("data", 1)]);
    let composed = on_devices(&one, |cx| {
        loss_grads(
            cx,
            [whole.clone(), whole.clone(), whole.clone(), whole.clone()],
            false,
        )
    });
    let base = &composed[0].0;
    assert_close(
        &base.out,
        &want,
        1e-5,
        "the composition against the f64 loop",
    );
    for (device, (run, _)) in fused.iter().enumerate() {
        assert_close(&run.out, &want, 1e-5, &format!("device {device}: forward"));
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            assert_close(
                &run.grads[i],
                &base.grads[i],
                1e-5,
                &format!("device {device}: {name}"),
            );
        }
        assert_eq!(
            run.forward_collectives, 0,
            "device {device}: the op communicates"
        );
        assert!(
            run.mirror_collectives > 0,
            "device {device}: the probe misses a gather"
        );
        // each gradient laid out like its operand: nothing reduced, nothing left partial
        assert_eq!(run.grad_types, run.operand_types, "device {device}");
    }
}

#[test]
fn type_errors_name_the_op_and_print_the_operands() {
    let m = mesh(&[("data", 2)]);
    let cases: [(PartitionSpec, PartitionSpec, &str); 4] = [
        (
            p(&["", "data", "", ""], &[], &[]),
            p(&["", "data", "", ""], &[], &[]),
            "dimension 1 of k or v is sharded",
        ),
        (
            // A split query sequence needs whole keys reduced over the split's axes.
            p(&["", "data", "", ""], &[], &[]),
            p(&["", "", "", ""], &[], &[]),
            "plus the axes q's sequence is split over",
        ),
        (
            p(&["data", "", "", ""], &[], &[]),
            p(&["", "", "", ""], &[], &[]),
            "split the batch and the heads alike",
        ),
        (
            p(&["", "", "", ""], &[], &[]),
            p(&["", "", "", ""], &["data"], &[]),
            "unreduced",
        ),
    ];
    for (q_spec, kv_spec, says) in cases {
        let errors = on_devices(&m, |cx| {
            let (q, k, v, _) = inputs();
            let q = place_any(cx, &q, q_spec.clone());
            let k = place_any(cx, &k, kv_spec.clone());
            let v = place_any(cx, &v, kv_spec.clone());
            Ok(cx
                .attention(
                    &q,
                    &k,
                    &v,
                    &AttentionSpec::causal(SCALE),
                    QueryPlaces::default(),
                )
                .unwrap_err()
                .to_string())
        });
        let err = &errors[0].0;
        assert!(err.contains("attention") && err.contains(says), "{err}");
        assert!(err.contains("f32[4"), "operand types printed: {err}");
    }
}

/// `value` placed with `spec`; an unreduced spec is made the only way there is, by resharding.
fn place_any(cx: &mut Ctx<'_>, value: &Tensor, spec: PartitionSpec) -> Array {
    if spec.unreduced().is_empty() {
        return place(cx, value, spec);
    }
    let plain = place(cx, value, p(&["", "", "", ""], &[], &[]));
    cx.reshard(&plain, &spec).unwrap()
}
