//! Where a qwen3-peer micro-batch's time goes, kernel by kernel, and what this crate's changes
//! gained on each.
//!
//! Times every tensor kernel a qwen3-peer micro-batch calls (vocab 2048, d 256, 4 layers, 8 query
//! / 4 kv heads of 32, MLP 768, seq 64, 8 sequences = 512 tokens per micro-batch), on one
//! device's shapes for `data=D` (`8/D` sequences per device), forward and backward, and ranks
//! them by time per micro-batch (ms per call × calls per micro-batch). Each kernel is timed
//! beside the code it replaced ("old": the serial loop, i.e. the same kernel on one thread, or
//! the former copy / sort / transpose written out below), in alternating ~1 ms groups in one
//! process, so the median paired ratio holds on a busy machine even when absolute times do not. The attention block (unfused
//! with copies, unfused with strided views, tiled), the optimizer's kernels (SGD, AdamW and the
//! grad norm's sum of squares over qwen3-peer's 3.67 M parameters) and the MoE kernels
//! (deepseek3-tiny shapes) are timed apart, outside the total. The kernels run as a device runs them: on a pool of
//! `threads` workers that this thread is one of (`with_kernel_pool`).
//!
//! ```text
//! cargo run --release -p ferrotext-tensor --example kernels -- [data=1] [threads=1] [ms=200]
//! ```

// A benchmark's printed figures (a geometric mean): the C library's bits are fine here
// (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::time::Instant;

use ferrotext_tensor::{adamw_update, sgd_update, sum_of_squares, AdamW};
use ferrotext_tensor::{
    causal_softmax, cpu_peak, cross_entropy, cross_entropy_backward, dot_general, flash_attention,
    flash_attention_backward, grouped_matmul, grouped_matmul_backward, kernel_threads, rms_norm,
    rms_norm_backward, rope, set_kernel_threads, softmax_backward_scaled, softmax_last, swiglu,
    swiglu_backward, take_rows, top_k, with_kernel_pool, DotDims, KeyRanges, Scores, Tensor,
};

fn rand(shape: &[usize], seed: u32) -> Tensor {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    Tensor::from_fn(shape, |_| {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s % 2000) as f32 / 1000.0 - 1.0
    })
}

/// Seconds per call of `old` and `new` and the median ratio new/old: the two are timed in
/// alternating groups of about 1 ms (old, new, old, new, …) for about `ms` milliseconds each,
/// so both see the same machine load; the times are each side's fastest group (the least
/// disturbed on a shared machine), the ratio the median over the pairs. With no `old`, only
/// `new` is timed (ratio 1).
fn time2(ms: f64, mut old: Option<&mut dyn FnMut()>, new: &mut dyn FnMut()) -> (f64, f64, f64) {
    let group_for = |f: &mut dyn FnMut()| {
        f();
        let start = Instant::now();
        f();
        let once = start.elapsed().as_secs_f64().max(1e-7);
        ((1e-3 / once) as usize).clamp(1, 10_000)
    };
    let run = |f: &mut dyn FnMut(), iters: usize| {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        t.elapsed().as_secs_f64() / iters as f64
    };
    let g_new = group_for(new);
    let g_old = old.as_mut().map_or(0, |f| group_for(*f));
    let (mut best_old, mut best_new) = (f64::INFINITY, f64::INFINITY);
    let mut ratios = Vec::new();
    let start = Instant::now();
    let budget = ms / 1e3 * if old.is_some() { 2.0 } else { 1.0 };
    while ratios.len() < 5 || start.elapsed().as_secs_f64() < budget {
        let o = old.as_mut().map(|f| run(*f, g_old));
        let n = run(new, g_new);
        best_new = best_new.min(n);
        if let Some(o) = o {
            best_old = best_old.min(o);
            ratios.push(n / o);
        } else {
            ratios.push(1.0);
        }
    }
    ratios.sort_by(f64::total_cmp);
    let ratio = ratios[ratios.len() / 2];
    (
        if old.is_some() { best_old } else { best_new },
        best_new,
        ratio,
    )
}

/// `f` on one kernel thread: the serial loop the threaded kernels replaced (same row code).
fn serial<T>(f: impl FnOnce() -> T) -> T {
    let threads = kernel_threads();
    set_kernel_threads(1);
    let out = f();
    set_kernel_threads(threads);
    out
}

/// The former copy path of `dot_general` for operands whose batch dims do not nest: transpose
/// each into `[batch, rows, cols]` first.
fn copy_then_dot(l: &Tensor, lp: &[usize], r: &Tensor, rp: &[usize], d: &DotDims) -> Tensor {
    let (l, r) = (l.transpose(lp).unwrap(), r.transpose(rp).unwrap());
    dot_general(&l, &r, d, 1).unwrap()
}

/// The former `sum_axes`: move the reduced axes last (a copy), then sum each run in f64.
fn old_sum_axes(t: &Tensor, axes: &[usize]) -> Vec<f32> {
    let rank = t.rank();
    let perm: Vec<usize> = (0..rank)
        .filter(|d| !axes.contains(d))
        .chain(axes.iter().copied())
        .collect();
    let run: usize = axes.iter().map(|&a| t.shape()[a]).product();
    let moved = t.transpose(&perm).unwrap();
    moved
        .data()
        .chunks(run)
        .map(|c| c.iter().map(|&x| f64::from(x)).sum::<f64>() as f32)
        .collect()
}

/// The former `top_k`: sort every whole row.
fn old_top_k(x: &Tensor, k: usize) -> Vec<u32> {
    let n = *x.shape().last().unwrap();
    let mut out = Vec::new();
    let mut order: Vec<u32> = Vec::with_capacity(n);
    for row in x.data().chunks(n) {
        order.clear();
        order.extend(0..n as u32);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        out.extend_from_slice(&order[..k]);
    }
    out
}

/// The former `cross_entropy`: a softmax pass, then a second pass for log Z and the loss.
fn old_cross_entropy(logits: &Tensor, targets: &[u32], mask: &[f32]) -> (Tensor, f64) {
    let probs = serial(|| softmax_last(logits).unwrap());
    let v = logits.shape()[1];
    let mut loss = 0.0f64;
    for ((row, &t), &m) in logits.data().chunks(v).zip(targets).zip(mask) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
        let lz = max as f64 + sum.ln();
        if m != 0.0 {
            loss += m as f64 * (lz - row[t as usize] as f64);
        }
    }
    (probs, loss)
}

/// The former grouped product: copy each group's rows and expert matrix, then `dot_general`.
fn old_grouped(x: &Tensor, w: &Tensor, sizes: &[usize], threads: usize) -> Vec<f32> {
    let (d, f) = (w.shape()[1], w.shape()[2]);
    let mut y = vec![0.0f32; x.shape()[0] * f];
    let mut row = 0;
    for (g, &size) in sizes.iter().enumerate() {
        let xg = x.slice_dim(0, row..row + size).unwrap();
        let wg = w.slice_dim(0, g..g + 1).unwrap().reshape(&[d, f]).unwrap();
        let yg = dot_general(&xg, &wg, &DotDims::matmul(2), threads).unwrap();
        y[row * f..(row + size) * f].copy_from_slice(yg.data());
        row += size;
    }
    y
}

/// An attention product: name, lhs, the permutation that copies it to `[B, H, T, d]`, rhs,
/// the strided dimension numbers and those on the copies.
type Product<'a> = (
    &'a str,
    &'a Tensor,
    &'a [usize],
    &'a Tensor,
    &'a DotDims,
    &'a DotDims,
);

struct Row {
    name: String,
    calls: usize,
    /// The code before this change (the same code when unchanged).
    old: f64,
    secs: f64,
    /// Median paired ratio new/old.
    ratio: f64,
    flops: f64,
}

struct Bench {
    ms: f64,
    rows: Vec<Row>,
}

impl Bench {
    fn add(
        &mut self,
        name: String,
        calls: usize,
        flops: f64,
        old: Option<&mut dyn FnMut()>,
        new: &mut dyn FnMut(),
    ) {
        let (old, secs, ratio) = time2(self.ms, old, new);
        self.rows.push(Row {
            name,
            calls,
            old,
            secs,
            ratio,
            flops,
        });
    }
}

fn dims(lc: usize, rc: usize, lb: &[usize], rb: &[usize]) -> DotDims {
    DotDims {
        lhs_contracting: vec![lc],
        rhs_contracting: vec![rc],
        lhs_batch: lb.to_vec(),
        rhs_batch: rb.to_vec(),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |key: &str, default: usize| -> usize {
        args.iter()
            .find_map(|a| a.strip_prefix(&format!("{key}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (data, threads, ms) = (arg("data", 1), arg("threads", 1), arg("ms", 200) as f64);
    // The shapes below are built from these three alone; checked here, every kernel call on them
    // is valid, so the benchmark's `unwrap`s cannot fail (ok: a developer benchmark, no files).
    if ![1, 2, 4, 8].contains(&data) || threads == 0 || ms <= 0.0 {
        eprintln!(
            "error: data must be 1, 2, 4 or 8 (8 sequences split over it), threads and ms ≥ 1"
        );
        std::process::exit(2);
    }
    with_kernel_pool(threads, "kernels", 64 << 20, || measure(data, threads, ms));
}

/// The measurements of `main`, on the device pool.
fn measure(data: usize, threads: usize, ms: f64) {
    let peak = cpu_peak();
    println!("peak: {peak}");
    let (b, t, d, h, kv, hd, mlp, vocab, layers) = (8 / data, 64, 256, 8, 4, 32, 768, 2048, 4);
    let n = b * t;
    println!(
        "qwen3-peer, data={data}: {b} sequences × {t} = {n} tokens per device, {threads} kernel threads"
    );
    let mut bench = Bench {
        ms,
        rows: Vec::new(),
    };

    // Matrix products: per linear, the forward x·W, then dx = dy·Wᵀ and dW = xᵀ·dy.
    let (xt, wt) = (dims(0, 0, &[], &[]), dims(1, 1, &[], &[]));
    let linears = [
        (d, h * hd + 2 * kv * hd), // q, k, v (timed as one product of their widths)
        (h * hd, d),               // o
        (d, 2 * mlp),              // gate, up
        (mlp, d),                  // down
    ];
    for &(k, m_out) in &linears {
        let x = rand(&[n, k], 1);
        let w = rand(&[k, m_out], 2);
        let dy = rand(&[n, m_out], 3);
        let fl = 2.0 * (n * k * m_out) as f64;
        let mm = DotDims::matmul(2);
        bench.add(
            format!("gemm x·W [{n},{k}]·[{k},{m_out}]"),
            layers,
            fl,
            None,
            &mut || {
                black_box(dot_general(&x, &w, &mm, threads).unwrap());
            },
        );
        let name = format!("gemm dy·Wᵀ [{n},{m_out}]·[{k},{m_out}]ᵀ");
        bench.add(name, layers, fl, None, &mut || {
            black_box(dot_general(&dy, &w, &wt, threads).unwrap());
        });
        let name = format!("gemm xᵀ·dy [{n},{k}]ᵀ·[{n},{m_out}]");
        bench.add(name, layers, fl, None, &mut || {
            black_box(dot_general(&x, &dy, &xt, threads).unwrap());
        });
    }
    // The tied head: logits = x·Eᵀ, dx = dlogits·E, dE = dlogitsᵀ·x.
    {
        let x = rand(&[n, d], 4);
        let e = rand(&[vocab, d], 5);
        let dl = rand(&[n, vocab], 6);
        let fl = 2.0 * (n * d * vocab) as f64;
        let mm = DotDims::matmul(2);
        bench.add(
            format!("gemm logits x·Eᵀ [{n},{d}]·[{vocab},{d}]ᵀ"),
            1,
            fl,
            None,
            &mut || {
                black_box(dot_general(&x, &e, &wt, threads).unwrap());
            },
        );
        bench.add(
            format!("gemm dlogits·E [{n},{vocab}]·[{vocab},{d}]"),
            1,
            fl,
            None,
            &mut || {
                black_box(dot_general(&dl, &e, &mm, threads).unwrap());
            },
        );
        bench.add(
            format!("gemm dlogitsᵀ·x [{n},{vocab}]ᵀ·[{n},{d}]"),
            1,
            fl,
            None,
            &mut || {
                black_box(dot_general(&dl, &x, &xt, threads).unwrap());
            },
        );
    }
    // Attention as models::nn::causal_attention issues it today (k, v broadcast to H heads),
    // and the products of its backward; "old" copies the strided operands first.
    {
        let q = rand(&[b, t, h, hd], 7);
        let k = rand(&[b, t, h, hd], 8);
        let v = rand(&[b, t, h, hd], 9);
        let s = rand(&[b, h, t, t], 10);
        let (qk, pv, dk) = (
            dims(3, 3, &[0, 2], &[0, 2]),
            dims(3, 1, &[0, 1], &[0, 2]),
            dims(2, 1, &[0, 1], &[0, 2]),
        );
        // the same products on contiguous copies [B, H, T, d]
        let (qkc, pvc, dkc) = (
            dims(3, 3, &[0, 1], &[0, 1]),
            dims(3, 2, &[0, 1], &[0, 1]),
            dims(2, 2, &[0, 1], &[0, 1]),
        );
        let fl = 2.0 * (b * h * t * t * hd) as f64;
        let perm = [0, 2, 1, 3];
        let id = [0, 1, 2, 3];
        let products: [Product<'_>; 6] = [
            ("attn scores q·kᵀ", &q, &perm, &k, &qk, &qkc),
            ("attn dprobs = dout·vᵀ", &q, &perm, &v, &qk, &qkc),
            ("attn probs·v", &s, &id, &v, &pv, &pvc),
            ("attn dq = dS·k", &s, &id, &k, &pv, &pvc),
            ("attn dk = dSᵀ·q", &s, &id, &q, &dk, &dkc),
            ("attn dv = probsᵀ·dout", &s, &id, &q, &dk, &dkc),
        ];
        for (name, l, lp, r, strided, copied) in products {
            bench.add(
                format!("{name} [{b},{t},{h},{hd}]"),
                layers,
                fl,
                Some(&mut || {
                    black_box(copy_then_dot(l, lp, r, &perm, copied));
                }),
                &mut || {
                    black_box(dot_general(l, r, strided, threads).unwrap());
                },
            );
        }
        bench.add(
            format!("causal_softmax [{b},{h},{t},{t}]"),
            layers,
            0.0,
            Some(&mut || {
                black_box(serial(|| causal_softmax(&s, 0.17).unwrap()));
            }),
            &mut || {
                black_box(causal_softmax(&s, 0.17).unwrap());
            },
        );
        let y = causal_softmax(&s, 0.17).unwrap();
        bench.add(
            "causal_softmax backward".into(),
            layers,
            0.0,
            Some(&mut || {
                black_box(serial(|| softmax_backward_scaled(&y, &s, 0.17).unwrap()));
            }),
            &mut || {
                black_box(softmax_backward_scaled(&y, &s, 0.17).unwrap());
            },
        );
        let o = rand(&[b, h, t, hd], 11);
        bench.add(
            "attn out transpose [B,H,T,hd]→[B,T,H,hd]".into(),
            2 * layers,
            0.0,
            None,
            &mut || {
                black_box(o.transpose(&[0, 2, 1, 3]).unwrap());
            },
        );
        let kk = rand(&[b, t, kv, hd], 12);
        bench.add(
            "GQA broadcast k/v [B,T,KV,hd]→[B,T,H,hd]".into(),
            2 * layers,
            0.0,
            None,
            &mut || {
                black_box(
                    kk.broadcast_in_dim(&[b, t, kv, h / kv, hd], &[0, 1, 2, 4])
                        .unwrap(),
                );
            },
        );
        let k5 = rand(&[b, t, kv, h / kv, hd], 13);
        bench.add(
            "GQA unbroadcast dk/dv (sum over group)".into(),
            2 * layers,
            0.0,
            Some(&mut || {
                black_box(old_sum_axes(&k5, &[3]));
            }),
            &mut || {
                black_box(k5.sum_axes(&[3]).unwrap());
            },
        );
    }
    // Norms: two RMSNorms of x per layer + the final one; QK-norm on q and k rows.
    for (name, rows_, width, uses) in [
        ("rms_norm x", n, d, 2 * layers + 1),
        ("rms_norm q (QK-norm)", n * h, hd, layers),
        ("rms_norm k (QK-norm)", n * kv, hd, layers),
    ] {
        let x = rand(&[rows_, width], 14);
        let s = rand(&[width], 15);
        let dy = rand(&[rows_, width], 16);
        bench.add(
            format!("{name} [{rows_},{width}]"),
            uses,
            0.0,
            Some(&mut || {
                black_box(serial(|| rms_norm(&x, &s, 1e-6).unwrap()));
            }),
            &mut || {
                black_box(rms_norm(&x, &s, 1e-6).unwrap());
            },
        );
        let (_, inv) = rms_norm(&x, &s, 1e-6).unwrap();
        bench.add(
            format!("{name} backward"),
            uses,
            0.0,
            Some(&mut || {
                black_box(serial(|| rms_norm_backward(&x, &s, &inv, &dy).unwrap()));
            }),
            &mut || {
                black_box(rms_norm_backward(&x, &s, &inv, &dy).unwrap());
            },
        );
    }
    // RoPE on q and k, forward and (inverse) backward.
    {
        let positions: Vec<usize> = (0..t).collect();
        for (name, heads) in [("rope q", h), ("rope k", kv)] {
            let x = rand(&[b, t, heads, hd], 17);
            bench.add(
                format!("{name} [{b},{t},{heads},{hd}] (fwd+bwd)"),
                2 * layers,
                0.0,
                Some(&mut || {
                    black_box(serial(|| rope(&x, &positions, 1e6, false).unwrap()));
                }),
                &mut || {
                    black_box(rope(&x, &positions, 1e6, false).unwrap());
                },
            );
        }
    }
    // SwiGLU and the elementwise residual adds / gradient accumulation.
    {
        let g = rand(&[n, mlp], 19);
        let u = rand(&[n, mlp], 20);
        bench.add(
            format!("swiglu [{n},{mlp}]"),
            layers,
            0.0,
            Some(&mut || {
                black_box(serial(|| swiglu(&g, &u).unwrap()));
            }),
            &mut || {
                black_box(swiglu(&g, &u).unwrap());
            },
        );
        bench.add(
            "swiglu backward".into(),
            layers,
            0.0,
            Some(&mut || {
                black_box(serial(|| swiglu_backward(&g, &u, &g).unwrap()));
            }),
            &mut || {
                black_box(swiglu_backward(&g, &u, &g).unwrap());
            },
        );
        let x = rand(&[n, d], 21);
        let y = rand(&[n, d], 22);
        // residual adds forward (2/layer) and cotangent adds backward (~4/layer)
        bench.add(
            format!("add [{n},{d}]"),
            6 * layers,
            0.0,
            Some(&mut || {
                black_box(x.zip_with(&y, |a, b| a + b).unwrap());
            }),
            &mut || {
                black_box(x.add(&y).unwrap());
            },
        );
    }
    // Cross-entropy over the logits, forward and backward.
    {
        let logits = rand(&[n, vocab], 23);
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37) % vocab as u32).collect();
        let mask = vec![1.0f32; n];
        bench.add(
            format!("cross_entropy [{n},{vocab}]"),
            1,
            0.0,
            Some(&mut || {
                black_box(old_cross_entropy(&logits, &targets, &mask));
            }),
            &mut || {
                black_box(cross_entropy(&logits, &targets, &mask, 0.0).unwrap());
            },
        );
        let ce = cross_entropy(&logits, &targets, &mask, 0.0).unwrap();
        bench.add(
            "cross_entropy backward".into(),
            1,
            0.0,
            Some(&mut || {
                black_box(serial(|| {
                    cross_entropy_backward(&ce, &targets, &mask, 0.0, 1.0).unwrap()
                }));
            }),
            &mut || {
                black_box(cross_entropy_backward(&ce, &targets, &mask, 0.0, 1.0).unwrap());
            },
        );
    }
    // The embedding lookup.
    {
        let e = rand(&[vocab, d], 24);
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 97) % vocab as u32).collect();
        bench.add(
            format!("take_rows embedding [{vocab},{d}] × {n}"),
            1,
            0.0,
            None,
            &mut || {
                black_box(take_rows(&e, &ids).unwrap());
            },
        );
    }
    report(&bench.rows, peak.flops());

    // The attention block of one layer, forward and backward, three ways.
    let mut att = Bench {
        ms,
        rows: Vec::new(),
    };
    {
        let q = rand(&[b, t, h, hd], 30);
        let k = rand(&[b, t, kv, hd], 31);
        let v = rand(&[b, t, kv, hd], 32);
        let dout = rand(&[b, t, h, hd], 33);
        let scale = 1.0 / (hd as f32).sqrt();
        let g = h / kv;
        let fl = 2.0 * 6.0 * (b * h * t * t * hd) as f64;
        let perm = [0, 2, 1, 3];
        // unfused: broadcast k, v; scores; softmax; probs·v; transpose; and the backward's
        // four products, softmax backward, transposes and the group sums.
        let unfused = |copies: bool| {
            let prod = |l: &Tensor, lp: &[usize], r: &Tensor, s: &DotDims, c: &DotDims| {
                if copies {
                    copy_then_dot(l, lp, r, &perm, c)
                } else {
                    dot_general(l, r, s, threads).unwrap()
                }
            };
            let wide = |x: &Tensor| {
                x.broadcast_in_dim(&[b, t, kv, g, hd], &[0, 1, 2, 4])
                    .unwrap()
                    .reshape(&[b, t, h, hd])
                    .unwrap()
            };
            let (kw, vw) = (wide(&k), wide(&v));
            let (qk, qkc) = (dims(3, 3, &[0, 2], &[0, 2]), dims(3, 3, &[0, 1], &[0, 1]));
            let (pv, pvc) = (dims(3, 1, &[0, 1], &[0, 2]), dims(3, 2, &[0, 1], &[0, 1]));
            let (dk, dkc) = (dims(2, 1, &[0, 1], &[0, 2]), dims(2, 2, &[0, 1], &[0, 1]));
            let id = [0, 1, 2, 3];
            let sc = prod(&q, &perm, &kw, &qk, &qkc);
            let p = causal_softmax(&sc, scale).unwrap();
            black_box(prod(&p, &id, &vw, &pv, &pvc).transpose(&perm).unwrap());
            let dp = prod(&dout, &perm, &vw, &qk, &qkc);
            let ds = softmax_backward_scaled(&p, &dp, scale).unwrap();
            black_box(prod(&ds, &id, &kw, &pv, &pvc).transpose(&perm).unwrap());
            let dkw = prod(&ds, &id, &q, &dk, &dkc).transpose(&perm).unwrap();
            let dvw = prod(&p, &id, &dout, &dk, &dkc).transpose(&perm).unwrap();
            for x in [dkw, dvw] {
                let x5 = x.reshape(&[b, t, kv, g, hd]).unwrap();
                black_box(if copies {
                    old_sum_axes(&x5, &[3])
                } else {
                    x5.sum_axes(&[3]).unwrap().into_data()
                });
            }
        };
        let ranges = KeyRanges::causal(b, t, None);
        let scores = Scores {
            scale,
            softcap: None,
        };
        let mut fused = || {
            let a = flash_attention(&q, &k, &v, &ranges, scores, threads).unwrap();
            black_box(
                flash_attention_backward(
                    &q, &k, &v, &a.out, &a.lse, &dout, &ranges, scores, threads,
                )
                .unwrap(),
            );
        };
        att.add(
            "unfused (strided views) vs unfused with copies".into(),
            layers,
            fl,
            Some(&mut || serial(|| unfused(true))),
            &mut || unfused(false),
        );
        att.add(
            "tiled vs unfused with copies".into(),
            layers,
            fl,
            Some(&mut || serial(|| unfused(true))),
            &mut fused,
        );
    }
    println!("\nattention block, forward + backward, one layer ({b}×{t}, {h}/{kv} heads of {hd}); not in the total above:");
    report(&att.rows, 0.0);

    optimizer(ms);

    // MoE kernels on deepseek3-tiny shapes (not part of qwen3-peer).
    let mut moe = Bench {
        ms,
        rows: Vec::new(),
    };
    let (experts, top, dm, fm) = (16, 8, 64, 64);
    let copies = n * top;
    let x = rand(&[copies, dm], 25);
    let w = rand(&[experts, dm, fm], 26);
    let dy = rand(&[copies, fm], 27);
    let sizes = vec![copies / experts; experts];
    let fl = 2.0 * (copies * dm * fm) as f64;
    moe.add(
        format!("grouped_matmul [{copies},{dm}]·{experts}×[{dm},{fm}]"),
        1,
        fl,
        Some(&mut || {
            black_box(old_grouped(&x, &w, &sizes, threads));
        }),
        &mut || {
            black_box(grouped_matmul(&x, &w, &sizes, threads).unwrap());
        },
    );
    moe.add(
        "grouped_matmul backward".into(),
        1,
        2.0 * fl,
        None,
        &mut || {
            black_box(grouped_matmul_backward(&x, &w, &sizes, &dy, threads).unwrap());
        },
    );
    let scores = rand(&[n, experts], 28);
    moe.add(
        format!("top_k [{n},{experts}] k={top}"),
        1,
        0.0,
        Some(&mut || {
            black_box(old_top_k(&scores, top));
        }),
        &mut || {
            black_box(top_k(&scores, top).unwrap());
        },
    );
    let order: Vec<u32> = (0..copies as u32)
        .map(|i| (i * 7919) % copies as u32)
        .collect();
    moe.add(
        format!("take_rows sort [{copies},{dm}]"),
        1,
        0.0,
        None,
        &mut || {
            black_box(take_rows(&x, &order).unwrap());
        },
    );
    println!("\nMoE kernels (deepseek3-tiny shapes, {n} tokens; not in the total above):");
    report(&moe.rows, 0.0);
}

/// The optimizer's kernels over a replicated qwen3-peer (3,672,576 parameters as one buffer):
/// each beside the serial loop it replaced, with the bytes each moves.
fn optimizer(ms: f64) {
    let n = 3_672_576;
    let (mut w, g) = (
        rand(&[n], 11).data().to_vec(),
        rand(&[n], 12).data().to_vec(),
    );
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut opt = Bench {
        ms,
        rows: Vec::new(),
    };
    let k = 1e-9f32;
    let (mut w_old, mut m_old, mut v_old) = (w.clone(), m.clone(), v.clone());
    opt.add(
        format!("sgd_update [{n}] (12 B an element)"),
        1,
        0.0,
        Some(&mut || {
            for (w, &d) in w_old.iter_mut().zip(&g) {
                *w -= k * d;
            }
        }),
        &mut || sgd_update(&mut w, &g, k),
    );
    let c = AdamW {
        b1: 0.9,
        b2: 0.95,
        step: 1e-9,
        c2_sqrt: 0.2,
        eps: 1e-8,
        decay: 0.0,
        grad_scale: 1.0,
    };
    opt.add(
        format!("adamw_update [{n}] (20 B an element)"),
        1,
        0.0,
        Some(&mut || {
            for (((w, &raw), mm), vv) in w_old.iter_mut().zip(&g).zip(&mut m_old).zip(&mut v_old) {
                let d = raw * c.grad_scale;
                *mm = c.b1 * *mm + (1.0 - c.b1) * d;
                *vv = c.b2 * *vv + (1.0 - c.b2) * d * d;
                *w -= c.step * *mm / (vv.sqrt() / c.c2_sqrt + c.eps) + c.decay * *w;
            }
        }),
        &mut || adamw_update(&mut w, &g, &mut m, &mut v, c),
    );
    opt.add(
        format!("sum_of_squares [{n}] (4 B an element)"),
        1,
        0.0,
        Some(&mut || {
            // The former grad-norm loop: 8 f64 lanes, baseline x86-64.
            let mut lanes = [0f64; 8];
            for chunk in g.chunks_exact(8) {
                for (lane, &x) in lanes.iter_mut().zip(chunk) {
                    *lane += f64::from(x) * f64::from(x);
                }
            }
            black_box(lanes.iter().sum::<f64>());
        }),
        &mut || {
            black_box(sum_of_squares(&g));
        },
    );
    println!(
        "\noptimizer kernels (qwen3-peer's parameters as one buffer; not in the total above):"
    );
    report(&opt.rows, 0.0);
}

fn report(rows: &[Row], peak_flops: f64) {
    let total: f64 = rows.iter().map(|r| r.secs * r.calls as f64).sum();
    let total_old: f64 = rows.iter().map(|r| r.old * r.calls as f64).sum();
    let mut order: Vec<&Row> = rows.iter().collect();
    order.sort_by(|a, b| (b.secs * b.calls as f64).total_cmp(&(a.secs * a.calls as f64)));
    println!(
        "{:<48} {:>5} {:>9} {:>9} {:>6} {:>8} {:>9} {:>9}",
        "kernel", "calls", "ms/call", "ms/mb", "share", "GFLOP/s", "old ms", "new/old"
    );
    for r in order {
        let per_mb = r.secs * r.calls as f64;
        let gf = if r.flops > 0.0 {
            format!("{:.1}", r.flops / r.secs / 1e9)
        } else {
            "-".into()
        };
        println!(
            "{:<48} {:>5} {:>9.4} {:>9.3} {:>5.1}% {:>8} {:>9.4} {:>9.2}",
            r.name,
            r.calls,
            r.secs * 1e3,
            per_mb * 1e3,
            100.0 * per_mb / total,
            gf,
            r.old * 1e3,
            r.ratio
        );
    }
    let flops: f64 = rows.iter().map(|r| r.flops * r.calls as f64).sum();
    println!(
        "total {:.3} ms per micro-batch (old code {:.3} ms; with each kernel's median paired ratio: {:.2}), {:.2} GFLOP, {:.1} GFLOP/s{}",
        total * 1e3,
        total_old * 1e3,
        rows.iter().map(|r| r.old * r.ratio * r.calls as f64).sum::<f64>() / total_old,
        flops / 1e9,
        flops / total / 1e9,
        if peak_flops > 0.0 && flops > 0.0 {
            format!(" = {:.1}% of the peak", 100.0 * flops / total / peak_flops)
        } else {
            String::new()
        }
    );
}
