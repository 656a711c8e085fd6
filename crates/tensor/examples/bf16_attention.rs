//! Time of the fused causal attention on bf16 activations two ways, alternated in one process:
//! the widened route an op without a bf16 kernel takes (q, k, v and the output cotangent widened
//! to `f32` whole, the `f32` kernel, the outputs rounded whole) against the bf16 kernels
//! (`causal_attention_bf16`, `causal_attention_backward_bf16`: each head's rows widened in its
//! task, its outputs rounded in place). Both give the same bits (the tensor crate's tests).
//!
//! Shapes: qwen3-peer (512 tokens, 8 q / 4 kv heads of 32) and qwen3-0.6b (2 × 256 tokens, 16 q /
//! 8 kv heads of 128), on one thread.
//!
//! ```text
//! cargo run --release -p ferrotext-tensor --example bf16_attention -- [pairs=9]
//! ```

use std::hint::black_box;
use std::time::Instant;

use ferrotext_tensor::{
    causal_attention, causal_attention_backward, causal_attention_backward_bf16,
    causal_attention_bf16, Bf16Tensor, Tensor,
};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn input(shape: &[usize], seed: usize) -> Bf16Tensor {
    Bf16Tensor::from_f32(&Tensor::from_fn(shape, |i| {
        ((i * 7 + seed * 13) % 101) as f32 * 0.02 - 1.0
    }))
}

/// Median seconds of `a` and `b`, run in alternating pairs.
fn pairs(n: usize, a: &dyn Fn(), b: &dyn Fn()) -> (f64, f64) {
    let time = |f: &dyn Fn()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    a();
    b();
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for p in 0..n {
        if p % 2 == 0 {
            ta.push(time(a));
            tb.push(time(b));
        } else {
            tb.push(time(b));
            ta.push(time(a));
        }
    }
    (median(ta), median(tb))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut n = 9usize;
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("pairs", v)) => n = v.parse()?,
            _ => return Err(format!("unknown argument {arg:?} (pairs=)").into()),
        }
    }
    for (name, b, t, h, kv, d) in [
        ("qwen3-peer", 1, 512, 8, 4, 32),
        ("qwen3-0.6b", 2, 256, 16, 8, 128),
    ] {
        let (q, k, v) = (
            input(&[b, t, h, d], 1),
            input(&[b, t, kv, d], 2),
            input(&[b, t, kv, d], 3),
        );
        let dout = input(&[b, t, h, d], 4);
        let scale = 1.0 / (d as f32).sqrt();
        let (_, probs) = causal_attention_bf16(&q, &k, &v, scale, 1)?;
        let widened_fwd = || {
            let a = causal_attention(&q.to_f32(), &k.to_f32(), &v.to_f32(), scale, 1).ok();
            black_box(a.map(|a| (Bf16Tensor::from_f32(&a.out), a.probs)));
        };
        let native_fwd = || {
            black_box(causal_attention_bf16(&q, &k, &v, scale, 1).ok());
        };
        let widened_bwd = || {
            let g = causal_attention_backward(
                &q.to_f32(),
                &k.to_f32(),
                &v.to_f32(),
                &probs,
                &dout.to_f32(),
                scale,
                1,
            )
            .ok();
            black_box(g.map(|(a, b, c)| {
                (
                    Bf16Tensor::from_f32(&a),
                    Bf16Tensor::from_f32(&b),
                    Bf16Tensor::from_f32(&c),
                )
            }));
        };
        let native_bwd = || {
            black_box(causal_attention_backward_bf16(&q, &k, &v, &probs, &dout, scale, 1).ok());
        };
        let (wf, nf) = pairs(n, &widened_fwd, &native_fwd);
        let (wb, nb) = pairs(n, &widened_bwd, &native_bwd);
        println!(
            "{name}: forward widened {:.2} ms, bf16 {:.2} ms (×{:.2}); backward widened {:.2} ms, bf16 {:.2} ms (×{:.2})",
            wf * 1e3,
            nf * 1e3,
            nf / wf,
            wb * 1e3,
            nb * 1e3,
            nb / wb
        );
    }
    Ok(())
}
