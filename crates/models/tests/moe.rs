//! The MoE block: the sparse dropless path equals the dense masked reference (forward and every
//! gradient) on data=1, data=4, expert=2 and data2×expert2 (expert parallelism) with both router
//! scores; its gradients equal central finite differences; and expert weights tagged `{R:data}`
//! leave the region `{U:data}` with no all-reduce, while the mirror (tags withheld) finds one per
//! weight.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions, Trace};
use ferrotext_models::moe::{
    moe_dense, moe_sparse, MoeConfig, MoeOptions, MoeWeights, RouterScore,
};
use ferrotext_sharding::{DimSpec, Mesh, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;

const B: usize = 4;
const T: usize = 3;
const D: usize = 6;
const E: usize = 4;
const K: usize = 2;
const F: usize = 5;
const S: usize = 3;

fn value(shape: &[usize], seed: usize, scale: f32) -> Tensor {
    Tensor::from_fn(shape, |i| {
        let h = (i * 2654435761 + seed * 40503) % 1000;
        (h as f32 / 1000.0 - 0.5) * scale
    })
}

/// x, then router, wi_0, wi_1, wo, shared gate, up, down.
fn values() -> Vec<Tensor> {
    vec![
        value(&[B, T, D], 1, 2.0),
        value(&[D, E], 2, 1.5),
        value(&[E, D, F], 3, 1.0),
        value(&[E, D, F], 4, 1.0),
        value(&[E, F, D], 5, 1.0),
        value(&[D, S], 6, 1.0),
        value(&[D, S], 7, 1.0),
        value(&[S, D], 8, 1.0),
    ]
}

fn config(score: RouterScore) -> MoeConfig {
    MoeConfig {
        num_experts: E,
        num_experts_per_tok: K,
        score,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
        load_balance_loss_weight: 0.1,
        // DeepSeek-V3's routing for the sigmoid router: 2 groups of 2 experts, one group per
        // token (so both of a token's experts come from the group with the best pair).
        groups: match score {
            RouterScore::Sigmoid => ferrotext_models::router::GroupLimit {
                n_routing_groups: 2,
                topk_routing_group: 1,
                ..Default::default()
            },
            RouterScore::Softmax => ferrotext_models::router::GroupLimit::default(),
        },
    }
}

fn bias(score: RouterScore) -> Option<Vec<f32>> {
    (score == RouterScore::Sigmoid).then(|| vec![0.3, -0.2, 0.0, 0.1])
}

#[derive(Clone, Copy, PartialEq)]
enum Path {
    Sparse { withhold_tags: bool },
    Dense,
}

struct Run {
    loss: f32,
    /// The load-balance loss alone.
    balance: f32,
    /// Gradients of x and every weight, reduced to plain.
    grads: Vec<Tensor>,
    /// The weights' gradient types before reduction.
    grad_types: Vec<String>,
    trace: Trace,
}

/// A mesh and how the block is laid out on it.
#[derive(Clone, Copy)]
struct Layout {
    /// Mesh axes; the batch is split over all of them.
    axes: &'static [(&'static str, usize)],
    /// The axes the expert kernels' expert dim is split over (sparse path only).
    experts: &'static [&'static str],
}

const fn data(n: usize) -> Layout {
    Layout {
        axes: match n {
            1 => &[("data", 1)],
            _ => &[("data", 4)],
        },
        experts: &[],
    }
}

/// `sum(moe(x) ⊙ c)` and its gradients on a `data=devices` mesh; weights `{R:data}` when `tagged`.
fn run(devices: usize, path: Path, score: RouterScore, tagged: bool, vals: &[Tensor]) -> Run {
    run_on(data(devices), path, score, tagged, vals)
}

/// `sum(moe(x) ⊙ c)` and its gradients on `layout`; weights reduced over every batch axis (but
/// the ones their own dims are split over) when `tagged`.
fn run_on(layout: Layout, path: Path, score: RouterScore, tagged: bool, vals: &[Tensor]) -> Run {
    let mesh = Arc::new(Mesh::explicit(layout.axes.iter().copied()).unwrap());
    let batch_axes: Vec<&str> = layout.axes.iter().map(|a| a.0).collect();
    let c = value(&[B, T, D], 9, 1.0);
    let opts = SpmdOptions::default().with_timeout(Duration::from_secs(60));
    let mut runs = run_spmd(&mesh, &opts, |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let batch = PartitionSpec::new([
            DimSpec::axes(batch_axes.clone()),
            DimSpec::Replicated,
            DimSpec::Replicated,
        ]);
        let tags = |split: &[&str]| -> Vec<String> {
            let reduced = batch_axes.iter().filter(|a| tagged && !split.contains(a));
            reduced.map(|a| a.to_string()).collect()
        };
        let weight_spec = PartitionSpec::replicated().with_reduced(tags(&[]))?;
        let experts = if matches!(path, Path::Sparse { .. }) {
            layout.experts
        } else {
            &[]
        };
        let expert_spec =
            PartitionSpec::new([DimSpec::axes(experts.to_vec())]).with_reduced(tags(experts))?;
        let place = |cx: &Ctx<'_>, v: &Tensor, spec: &PartitionSpec| -> Result<Array, SpmdError> {
            let ty = cx.array_type(v.shape(), spec.clone())?;
            cx.from_global(v, ty.sharding().clone())
        };
        let mut params = vec![place(&cx, &vals[0], &batch)?];
        for (i, v) in vals.iter().enumerate().skip(1) {
            let spec = if (2..=4).contains(&i) {
                &expert_spec
            } else {
                &weight_spec
            };
            params.push(place(&cx, v, spec)?);
        }
        let c = place(&cx, &c, &batch)?;
        let cfg = config(score);
        let balance_value = std::sync::Mutex::new(f32::NAN);
        cx.comm().push_phase("step");
        let (loss, grads) = cx.value_and_grad(&params, |cx, p| {
            let weights = MoeWeights {
                router: p[1].clone(),
                router_bias: bias(score),
                wi_0: p[2].clone(),
                wi_1: p[3].clone(),
                wo: p[4].clone(),
                shared: Some([p[5].clone(), p[6].clone(), p[7].clone()]),
                shared_gate: None,
            };
            let out = match path {
                Path::Sparse { withhold_tags } => {
                    moe_sparse(cx, &cfg, &p[0], &weights, MoeOptions { withhold_tags })?
                }
                Path::Dense => moe_dense(cx, &cfg, &p[0], &weights)?,
            };
            let yc = cx.mul(&out.y, &c)?;
            let sum = cx.reduce_sum(&yc, &[0, 1, 2], None)?;
            let balance = out.load_balance_loss.expect("the loss is on");
            *balance_value.lock().unwrap() = balance.scalar()?;
            cx.add(&sum, &balance)
        })?;
        cx.comm().pop_phase();
        let grad_types = grads[1..].iter().map(|g| g.ty().to_string()).collect();
        let mut host = Vec::new();
        for g in &grads {
            let plain = cx.reshard(g, &g.ty().sharding().spec().without_tags())?;
            host.push(cx.to_host(&plain)?);
        }
        let loss = loss.scalar()?;
        let balance = *balance_value.lock().unwrap();
        Ok::<_, SpmdError>(Run {
            loss,
            balance,
            grads: host,
            grad_types,
            trace: cx.comm().take_trace(),
        })
    })
    .unwrap_or_else(|e| panic!("run failed: {e}"));
    runs.swap_remove(0)
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

const NAMES: [&str; 8] = [
    "x",
    "router",
    "wi_0",
    "wi_1",
    "wo",
    "shared_gate",
    "shared_up",
    "shared_down",
];

#[test]
fn sparse_path_equals_the_dense_reference_with_gradients() {
    let vals = values();
    for score in [RouterScore::Softmax, RouterScore::Sigmoid] {
        for devices in [1, 4] {
            let sparse = run(
                devices,
                Path::Sparse {
                    withhold_tags: false,
                },
                score,
                true,
                &vals,
            );
            let dense = run(devices, Path::Dense, score, true, &vals);
            assert!((sparse.loss - dense.loss).abs() <= 1e-5 * (1.0 + dense.loss.abs()));
            for (i, name) in NAMES.iter().enumerate() {
                let what = format!("{score:?} data={devices} d{name}");
                assert_close(sparse.grads[i].data(), dense.grads[i].data(), 1e-5, &what);
            }
            // Every expert got some tokens and some none of a token's copies: the routing
            // matters (a router gradient of zero would hide a broken gate path).
            assert!(sparse.grads[1].data().iter().any(|&g| g.abs() > 1e-3));
        }
    }
}

/// The load-balance loss on the host from the raw values: softmax scores, top-2 per token,
/// per-sequence density and mean score, `weight · E² · mean over (sequence, expert)`.
fn host_balance_loss(vals: &[Tensor]) -> f32 {
    let (x, wr) = (&vals[0], &vals[1]);
    let mut total = 0.0f64;
    for b in 0..B {
        let mut density = [0.0f64; E];
        let mut mean = [0.0f64; E];
        for t in 0..T {
            let row = &x.data()[(b * T + t) * D..(b * T + t + 1) * D];
            let logits: Vec<f64> = (0..E)
                .map(|e| {
                    (0..D)
                        .map(|k| f64::from(row[k] * wr.data()[k * E + e]))
                        .sum()
                })
                .collect();
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let exps: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let z: f64 = exps.iter().sum();
            let mut order: Vec<usize> = (0..E).collect();
            order.sort_by(|&i, &j| exps[j].total_cmp(&exps[i]));
            for &e in &order[..K] {
                density[e] += 1.0 / T as f64;
            }
            for e in 0..E {
                mean[e] += exps[e] / z / T as f64;
            }
        }
        total += (0..E).map(|e| density[e] * mean[e]).sum::<f64>();
    }
    (0.1 * (E * E) as f64 * total / (B * E) as f64) as f32
}

#[test]
fn load_balance_loss_equals_the_host_computation() {
    let vals = values();
    let want = host_balance_loss(&vals);
    for devices in [1, 4] {
        for path in [
            Path::Sparse {
                withhold_tags: false,
            },
            Path::Dense,
        ] {
            let r = run(devices, path, RouterScore::Softmax, true, &vals);
            assert!(
                (r.balance - want).abs() <= 1e-5 * want.abs(),
                "{} vs {want}",
                r.balance
            );
        }
    }
}

#[test]
fn expert_parallel_path_equals_the_dense_reference_with_gradients() {
    let vals = values();
    let layouts = [
        Layout {
            axes: &[("expert", 2)],
            experts: &["expert"],
        },
        Layout {
            axes: &[("data", 2), ("expert", 2)],
            experts: &["expert"],
        },
        Layout {
            axes: &[("data", 2), ("expert", 2)],
            experts: &["data", "expert"],
        },
    ];
    for layout in layouts {
        for score in [RouterScore::Softmax, RouterScore::Sigmoid] {
            let sparse = run_on(
                layout,
                Path::Sparse {
                    withhold_tags: false,
                },
                score,
                true,
                &vals,
            );
            let dense = run_on(layout, Path::Dense, score, true, &vals);
            let what = format!(
                "{score:?} on {:?}, experts over {:?}",
                layout.axes, layout.experts
            );
            assert!(
                (sparse.loss - dense.loss).abs() <= 1e-5 * (1.0 + dense.loss.abs()),
                "{what}"
            );
            for (i, name) in NAMES.iter().enumerate() {
                assert_close(
                    sparse.grads[i].data(),
                    dense.grads[i].data(),
                    1e-5,
                    &format!("{what}: d{name}"),
                );
            }
            // The expert kernels' gradients stay split by expert and unreduced over the rest.
            assert!(
                sparse.grad_types[1].starts_with("f32[4@"),
                "{}",
                sparse.grad_types[1]
            );
            // Tokens travelled: rows out, rows back, counts — and nothing was all-reduced but
            // the loss.
            let step = PhasePattern::new("step");
            assert!(
                sparse.trace.count(CollectiveKind::AllToAll, &step) >= 3,
                "{what}"
            );
            assert!(
                sparse.trace.all_reduces_larger_than(1, &step).is_empty(),
                "{what}: {}",
                sparse.trace
            );
        }
    }
}

#[test]
fn sparse_gradients_match_finite_differences() {
    let vals = values();
    let score = RouterScore::Softmax;
    let base = run(
        1,
        Path::Sparse {
            withhold_tags: false,
        },
        score,
        false,
        &vals,
    );
    for (p, name) in NAMES.iter().enumerate() {
        // x and the router also decide the routing, which is piecewise constant: a smaller step
        // keeps every top-k choice where it is.
        let h = if p <= 1 { 1e-3f32 } else { 1e-2 };
        for i in [0, vals[p].len() / 2, vals[p].len() - 1] {
            let loss_at = |delta: f32| {
                let mut v = vals.clone();
                v[p].data_mut()[i] += delta;
                f64::from(
                    run(
                        1,
                        Path::Sparse {
                            withhold_tags: false,
                        },
                        score,
                        false,
                        &v,
                    )
                    .loss,
                )
            };
            let fd = (loss_at(h) - loss_at(-h)) / (2.0 * f64::from(h));
            let got = f64::from(base.grads[p].data()[i]);
            assert!(
                (fd - got).abs() <= 2e-3 * (1.0 + fd.abs()),
                "d{name}[{i}]: fd {fd} vs {got}"
            );
        }
    }
}

#[test]
fn tagged_expert_weights_leave_the_region_unreduced_without_an_all_reduce() {
    let vals = values();
    let tagged = run(
        4,
        Path::Sparse {
            withhold_tags: false,
        },
        RouterScore::Sigmoid,
        true,
        &vals,
    );
    for (ty, name) in tagged.grad_types.iter().zip(&NAMES[1..]) {
        assert!(ty.ends_with("{U:data}"), "d{name}: {ty}");
    }
    let step = PhasePattern::new("step");
    // The only all-reduces of the step are 1-element ones: the loss sum over the batch and the
    // load-balance loss's psum in the region.
    assert!(
        tagged.trace.all_reduces_larger_than(1, &step).is_empty(),
        "{}",
        tagged.trace
    );
    assert_eq!(tagged.trace.count(CollectiveKind::AllReduce, &step), 2);

    // Mirror: tags withheld before the region (a rebuilt spec) — every weight's gradient is
    // psummed inside the step, expert kernels included.
    let withheld = run(
        4,
        Path::Sparse {
            withhold_tags: true,
        },
        RouterScore::Sigmoid,
        true,
        &vals,
    );
    let big: Vec<usize> = withheld
        .trace
        .all_reduces_larger_than(1, &step)
        .iter()
        .map(|e| e.elements)
        .collect();
    for size in [D * E, E * D * F, E * D * F, E * F * D, D * S, D * S, S * D] {
        assert!(
            big.contains(&size),
            "an all-reduce of {size} elements in {big:?}"
        );
    }
    assert_eq!(big.len(), 7, "{big:?}");
    // Same numbers either way.
    assert!((tagged.loss - withheld.loss).abs() <= 1e-6 * (1.0 + tagged.loss.abs()));
    for (i, name) in NAMES.iter().enumerate() {
        assert_close(tagged.grads[i].data(), withheld.grads[i].data(), 1e-5, name);
    }
}
