//! Where a qwen3-peer micro-batch's time goes, kernel by kernel.
//!
//! Times every tensor kernel a qwen3-peer micro-batch calls (vocab 2048, d 256, 4 layers, 8 query
//! / 4 kv heads of 32, MLP 768, seq 64, 8 sequences = 512 tokens per micro-batch), on one
//! device's shapes for `data=D` (`8/D` sequences per device), forward and backward, and ranks
//! them by time per micro-batch (ms per call × calls per micro-batch). MoE kernels
//! (deepseek3-tiny shapes: 16 experts of 64×64, top-8) are timed apart, outside the total.
//!
//! ```text
//! cargo run --release -p ferrotext-tensor --example kernels -- [data=1] [threads=1] [ms=200]
//! ```
//! Each kernel runs for about `ms` milliseconds per repetition, 7 repetitions; the fastest is
//! reported. The peak FLOP/s the CPU states is printed first. Compare builds as ratios within
//! one sitting, alternating: the machine is shared.

use std::hint::black_box;
use std::time::Instant;

use ferrotext_tensor::{
    causal_softmax, cpu_peak, cross_entropy, cross_entropy_backward, dot_general, grouped_matmul,
    grouped_matmul_backward, rms_norm, rms_norm_backward, rope, set_kernel_threads,
    softmax_backward_scaled, swiglu, swiglu_backward, take_rows, top_k, DotDims, Tensor,
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

/// Seconds per call of `f`: the fastest of 7 repetitions of about `ms` milliseconds each (the
/// least disturbed by other work on a shared machine).
fn time(ms: f64, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    f();
    let once = start.elapsed().as_secs_f64().max(1e-7);
    let iters = ((ms / 1e3 / once) as usize).clamp(1, 100_000);
    let mut reps: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .collect();
    reps.sort_by(f64::total_cmp);
    reps[0]
}

struct Row {
    name: String,
    calls: usize,
    secs: f64,
    flops: f64,
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
    set_kernel_threads(threads);
    let peak = cpu_peak();
    println!("stated peak: {peak}");
    let (b, t, d, h, kv, hd, mlp, vocab, layers) = (8 / data, 64, 256, 8, 4, 32, 768, 2048, 4);
    let n = b * t;
    println!("qwen3-peer, data={data}: {b} sequences × {t} = {n} tokens per device, {threads} kernel threads");
    let mut rows: Vec<Row> = Vec::new();
    let mut add = |name: String, calls: usize, flops: f64, f: &mut dyn FnMut()| {
        let secs = time(ms, f);
        rows.push(Row {
            name,
            calls,
            secs,
            flops,
        });
    };

    // Matrix products: per linear, the forward x·W, then dx = dy·Wᵀ and dW = xᵀ·dy.
    let xt = DotDims {
        lhs_contracting: vec![0],
        rhs_contracting: vec![0],
        ..DotDims::default()
    };
    let wt = DotDims {
        lhs_contracting: vec![1],
        rhs_contracting: vec![1],
        ..DotDims::default()
    };
    // (k, n, uses per micro-batch)
    let linears = [
        (d, h * hd + 2 * kv * hd, layers), // q, k, v (timed as one product of their widths)
        (h * hd, d, layers),               // o
        (d, 2 * mlp, layers),              // gate, up
        (mlp, d, layers),                  // down
    ];
    for &(k, m_out, uses) in &linears {
        let x = rand(&[n, k], 1);
        let w = rand(&[k, m_out], 2);
        let dy = rand(&[n, m_out], 3);
        let fl = 2.0 * (n * k * m_out) as f64;
        add(
            format!("gemm x·W [{n},{k}]·[{k},{m_out}]"),
            uses,
            fl,
            &mut || {
                black_box(dot_general(&x, &w, &DotDims::matmul(2), threads).unwrap());
            },
        );
        add(
            format!("gemm dy·Wᵀ [{n},{m_out}]·[{k},{m_out}]ᵀ"),
            uses,
            fl,
            &mut || {
                black_box(dot_general(&dy, &w, &wt, threads).unwrap());
            },
        );
        add(
            format!("gemm xᵀ·dy [{n},{k}]ᵀ·[{n},{m_out}]"),
            uses,
            fl,
            &mut || {
                black_box(dot_general(&x, &dy, &xt, threads).unwrap());
            },
        );
    }
    // The tied head: logits = x·Eᵀ, dx = dlogits·E, dE = dlogitsᵀ·x.
    {
        let x = rand(&[n, d], 4);
        let e = rand(&[vocab, d], 5);
        let dl = rand(&[n, vocab], 6);
        let fl = 2.0 * (n * d * vocab) as f64;
        add(
            format!("gemm logits x·Eᵀ [{n},{d}]·[{vocab},{d}]ᵀ"),
            1,
            fl,
            &mut || {
                black_box(dot_general(&x, &e, &wt, threads).unwrap());
            },
        );
        add(
            format!("gemm dlogits·E [{n},{vocab}]·[{vocab},{d}]"),
            1,
            fl,
            &mut || {
                black_box(dot_general(&dl, &e, &DotDims::matmul(2), threads).unwrap());
            },
        );
        add(
            format!("gemm dlogitsᵀ·x [{n},{vocab}]ᵀ·[{n},{d}]"),
            1,
            fl,
            &mut || {
                black_box(dot_general(&dl, &x, &xt, threads).unwrap());
            },
        );
    }
    // Attention, as models::nn::causal_attention issues it, and its transposes.
    {
        let q = rand(&[b, t, h, hd], 7);
        let k = rand(&[b, t, h, hd], 8);
        let v = rand(&[b, t, h, hd], 9);
        let scores = rand(&[b, h, t, t], 10);
        let qk = DotDims {
            lhs_contracting: vec![3],
            rhs_contracting: vec![3],
            lhs_batch: vec![0, 2],
            rhs_batch: vec![0, 2],
        };
        let pv = DotDims {
            lhs_contracting: vec![3],
            rhs_contracting: vec![1],
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
        };
        // dq = dscores·k: [B,H,T,T]·[B,T,H,hd] over (B,H), contracting the key index.
        let dq = DotDims {
            lhs_contracting: vec![3],
            rhs_contracting: vec![1],
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
        };
        // dk = dscoresᵀ·q: contracting the query index.
        let dk = DotDims {
            lhs_contracting: vec![2],
            rhs_contracting: vec![1],
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 2],
        };
        let fl = 2.0 * (b * h * t * t * hd) as f64;
        add(
            format!("attn scores q·kᵀ [{b},{t},{h},{hd}]"),
            layers,
            fl,
            &mut || {
                black_box(dot_general(&q, &k, &qk, threads).unwrap());
            },
        );
        add(
            format!("attn probs·v [{b},{h},{t},{t}]"),
            layers,
            fl,
            &mut || {
                black_box(dot_general(&scores, &v, &pv, threads).unwrap());
            },
        );
        add("attn dq = dS·k".into(), layers, fl, &mut || {
            black_box(dot_general(&scores, &k, &dq, threads).unwrap());
        });
        add("attn dk = dSᵀ·q".into(), layers, fl, &mut || {
            black_box(dot_general(&scores, &q, &dk, threads).unwrap());
        });
        add("attn dprobs = dout·vᵀ".into(), layers, fl, &mut || {
            black_box(dot_general(&q, &v, &qk, threads).unwrap());
        });
        add("attn dv = probsᵀ·dout".into(), layers, fl, &mut || {
            black_box(dot_general(&scores, &q, &dk, threads).unwrap());
        });
        add(
            format!("causal_softmax [{b},{h},{t},{t}]"),
            layers,
            0.0,
            &mut || {
                black_box(causal_softmax(&scores, 0.17).unwrap());
            },
        );
        let y = causal_softmax(&scores, 0.17).unwrap();
        add("causal_softmax backward".into(), layers, 0.0, &mut || {
            black_box(softmax_backward_scaled(&y, &scores, 0.17).unwrap());
        });
        let o = rand(&[b, h, t, hd], 11);
        add(
            "attn out transpose [B,H,T,hd]→[B,T,H,hd]".into(),
            2 * layers,
            0.0,
            &mut || {
                black_box(o.transpose(&[0, 2, 1, 3]).unwrap());
            },
        );
        let kk = rand(&[b, t, kv, hd], 12);
        add(
            "GQA broadcast k/v [B,T,KV,hd]→[B,T,H,hd]".into(),
            2 * layers,
            0.0,
            &mut || {
                black_box(
                    kk.broadcast_in_dim(&[b, t, kv, h / kv, hd], &[0, 1, 2, 4])
                        .unwrap(),
                );
            },
        );
        let k5 = rand(&[b, t, kv, h / kv, hd], 13);
        add(
            "GQA unbroadcast (sum over group)".into(),
            2 * layers,
            0.0,
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
        add(format!("{name} [{rows_},{width}]"), uses, 0.0, &mut || {
            black_box(rms_norm(&x, &s, 1e-6).unwrap());
        });
        let (_, inv) = rms_norm(&x, &s, 1e-6).unwrap();
        add(format!("{name} backward"), uses, 0.0, &mut || {
            black_box(rms_norm_backward(&x, &s, &inv, &dy).unwrap());
        });
    }
    // RoPE on q and k, forward and (inverse) backward.
    {
        let positions: Vec<usize> = (0..t).collect();
        let q = rand(&[b, t, h, hd], 17);
        let k = rand(&[b, t, kv, hd], 18);
        add(
            format!("rope q [{b},{t},{h},{hd}] (fwd+bwd)"),
            2 * layers,
            0.0,
            &mut || {
                black_box(rope(&q, &positions, 1e6, false).unwrap());
            },
        );
        add(
            format!("rope k [{b},{t},{kv},{hd}] (fwd+bwd)"),
            2 * layers,
            0.0,
            &mut || {
                black_box(rope(&k, &positions, 1e6, false).unwrap());
            },
        );
    }
    // SwiGLU and the elementwise residual adds / gradient accumulation.
    {
        let g = rand(&[n, mlp], 19);
        let u = rand(&[n, mlp], 20);
        add(format!("swiglu [{n},{mlp}]"), layers, 0.0, &mut || {
            black_box(swiglu(&g, &u).unwrap());
        });
        add("swiglu backward".into(), layers, 0.0, &mut || {
            black_box(swiglu_backward(&g, &u, &g).unwrap());
        });
        let x = rand(&[n, d], 21);
        let y = rand(&[n, d], 22);
        // residual adds forward (2/layer) and cotangent adds backward (~4/layer)
        add(format!("add [{n},{d}]"), 6 * layers, 0.0, &mut || {
            black_box(x.add(&y).unwrap());
        });
    }
    // Cross-entropy over the logits, forward and backward.
    {
        let logits = rand(&[n, vocab], 23);
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37) % vocab as u32).collect();
        let mask = vec![1.0f32; n];
        add(format!("cross_entropy [{n},{vocab}]"), 1, 0.0, &mut || {
            black_box(cross_entropy(&logits, &targets, &mask, 0.0).unwrap());
        });
        let ce = cross_entropy(&logits, &targets, &mask, 0.0).unwrap();
        add("cross_entropy backward".into(), 1, 0.0, &mut || {
            black_box(cross_entropy_backward(&ce, &targets, &mask, 0.0, 1.0).unwrap());
        });
    }
    // The embedding lookup.
    {
        let e = rand(&[vocab, d], 24);
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 97) % vocab as u32).collect();
        add(
            format!("take_rows embedding [{vocab},{d}] × {n}"),
            1,
            0.0,
            &mut || {
                black_box(take_rows(&e, &ids).unwrap());
            },
        );
    }
    report(&rows, &peak.to_string(), peak.flops());

    // MoE kernels on deepseek3-tiny shapes (not part of qwen3-peer).
    let mut moe: Vec<Row> = Vec::new();
    let (experts, top, dm, fm) = (16, 8, 64, 64);
    let copies = n * top;
    let x = rand(&[copies, dm], 25);
    let w = rand(&[experts, dm, fm], 26);
    let dy = rand(&[copies, fm], 27);
    let sizes = vec![copies / experts; experts];
    let fl = 2.0 * (copies * dm * fm) as f64;
    let mut add_moe = |name: String, flops: f64, f: &mut dyn FnMut()| {
        moe.push(Row {
            name,
            calls: 1,
            secs: time(ms, f),
            flops,
        });
    };
    add_moe(
        format!("grouped_matmul [{copies},{dm}]·{experts}×[{dm},{fm}]"),
        fl,
        &mut || {
            black_box(grouped_matmul(&x, &w, &sizes, threads).unwrap());
        },
    );
    add_moe("grouped_matmul backward".into(), 2.0 * fl, &mut || {
        black_box(grouped_matmul_backward(&x, &w, &sizes, &dy, threads).unwrap());
    });
    let scores = rand(&[n, experts], 28);
    add_moe(format!("top_k [{n},{experts}] k={top}"), 0.0, &mut || {
        black_box(top_k(&scores, top).unwrap());
    });
    let order: Vec<u32> = (0..copies as u32)
        .map(|i| (i * 7919) % copies as u32)
        .collect();
    add_moe(format!("take_rows sort [{copies},{dm}]"), 0.0, &mut || {
        black_box(take_rows(&x, &order).unwrap());
    });
    println!("\nMoE kernels (deepseek3-tiny shapes, {n} tokens; not in the total above):");
    report(&moe, "", 0.0);
}

fn report(rows: &[Row], _peak: &str, peak_flops: f64) {
    let total: f64 = rows.iter().map(|r| r.secs * r.calls as f64).sum();
    let mut order: Vec<&Row> = rows.iter().collect();
    order.sort_by(|a, b| (b.secs * b.calls as f64).total_cmp(&(a.secs * a.calls as f64)));
    println!(
        "{:<48} {:>6} {:>10} {:>10} {:>7} {:>9}",
        "kernel", "calls", "ms/call", "ms/mb", "share", "GFLOP/s"
    );
    for r in order {
        let per_mb = r.secs * r.calls as f64;
        let gf = if r.flops > 0.0 {
            format!("{:.1}", r.flops / r.secs / 1e9)
        } else {
            "-".into()
        };
        println!(
            "{:<48} {:>6} {:>10.4} {:>10.3} {:>6.1}% {:>9}",
            r.name,
            r.calls,
            r.secs * 1e3,
            per_mb * 1e3,
            100.0 * per_mb / total,
            gf
        );
    }
    let flops: f64 = rows.iter().map(|r| r.flops * r.calls as f64).sum();
    println!(
        "total {:.3} ms per micro-batch, {:.2} GFLOP, {:.1} GFLOP/s{}",
        total * 1e3,
        flops / 1e9,
        flops / total / 1e9,
        if peak_flops > 0.0 && flops > 0.0 {
            format!(
                " = {:.1}% of the stated peak",
                100.0 * flops / total / peak_flops
            )
        } else {
            String::new()
        }
    );
}
