//! Tiled attention in bf16 against the products it is made of: the forward and backward of
//! causal `flash_attention_bf16` at a layer's shapes, timed on a kernel pool of `threads`
//! workers (as a device runs them), with the GFLOP/s of the tiles it computes beside the
//! product kernel's own rate on as many cores (`product_peak`). Where the first is a small
//! share of the second, the time goes to what surrounds the products (the online softmax's
//! passes, rounding and packing), not to the products.
//!
//! Shapes: qwen3-peer (batch 2 × 128 tokens, 8 query / 4 kv heads of 32), qwen3-0.6b (2 ×
//! 256, 16 / 8 heads of 128) and qwen3-0.6b-2k (1 × 2048, a long-sequence step's). The tiles' FLOPs count every score a query block's key tiles
//! cover (blocks of 64 query rows against every key up to their last row: key tiles are clipped
//! there), two products a score forward and five backward. Writes
//! `target/bench/flash.json`.
//!
//! ```text
//! cargo run --release -p ferrotext-tensor --example flash -- [threads=1] [reps=200] [shape=NAME]
//! ```

use std::hint::black_box;
use std::time::Instant;

use ferrotext_tensor::{
    flash_attention_backward_bf16, flash_attention_bf16, product_peak, with_kernel_pool,
    Bf16Tensor, KeyRanges, Scores, Tensor,
};

/// One attention shape: its name, batch, tokens, query heads, kv heads and head dimension.
type Shape = (&'static str, usize, usize, usize, usize, usize);

const SHAPES: [Shape; 3] = [
    ("qwen3-peer", 2, 128, 8, 4, 32),
    ("qwen3-0.6b", 2, 256, 16, 8, 128),
    ("qwen3-0.6b-2k", 1, 2048, 16, 8, 128),
];

/// Query rows of a tile (the kernel's `QUERY_BLOCK`).
const QUERY_BLOCK: usize = 64;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Scores a causal head's tiles cover: each query block against every key up to its last row
/// (its key tiles are clipped there).
fn tile_scores(t: usize) -> usize {
    (0..t)
        .step_by(QUERY_BLOCK)
        .map(|r0| {
            let rows = QUERY_BLOCK.min(t - r0);
            rows * (r0 + rows)
        })
        .sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut threads, mut reps, mut only) = (1usize, 200usize, None::<String>);
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("threads", v)) => threads = v.parse()?,
            Some(("reps", v)) => reps = v.parse()?,
            Some(("shape", v)) => only = Some(v.to_string()),
            _ => return Err(format!("unknown argument {arg:?} (threads=, reps=, shape=)").into()),
        }
    }
    let peak = product_peak(true, threads).ok_or("the bf16 product kernel is refused here")?;
    eprintln!("products: {}", peak.describe(true));
    let mut rows = Vec::new();
    for (name, b, t, h, kv, d) in SHAPES {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let operand = |shape: &[usize], seed: usize| {
            Bf16Tensor::from_f32(&Tensor::from_fn(shape, |i| {
                ((i * 7 + seed) % 101) as f32 * 0.02 - 1.0
            }))
        };
        let (q, k, v) = (
            operand(&[b, t, h, d], 1),
            operand(&[b, t, kv, d], 2),
            operand(&[b, t, kv, d], 3),
        );
        let dout = operand(&[b, t, h, d], 4);
        let ranges = KeyRanges::causal(b, t, None);
        let scores = Scores {
            scale: 1.0 / (d as f32).sqrt(),
            softcap: None,
        };
        // Fewer repetitions at the larger shapes (a call's work grows with `d·t²`).
        let reps = (reps * 32 * 128 * 128 / (d * t * t)).max(3);
        let run = || -> Result<(f64, f64), ferrotext_tensor::TensorError> {
            let (mut forward, mut backward) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                let start = Instant::now();
                let (out, lse) = flash_attention_bf16(&q, &k, &v, &ranges, scores, threads)?;
                let middle = Instant::now();
                black_box(flash_attention_backward_bf16(
                    &q, &k, &v, &out, &lse, &dout, &ranges, scores, threads,
                )?);
                forward.push((middle - start).as_secs_f64());
                backward.push(middle.elapsed().as_secs_f64());
            }
            Ok((median(forward), median(backward)))
        };
        let (forward, backward) = with_kernel_pool(threads, "flash", 16 << 20, run)?;
        let product_flops = (2 * b * h * tile_scores(t) * d) as f64;
        let rate = |products: f64, secs: f64| products * product_flops / secs / 1e9;
        let (fwd_rate, bwd_rate) = (rate(2.0, forward), rate(5.0, backward));
        let share = |r: f64| 100.0 * r * 1e9 / peak.flops;
        eprintln!(
            "{name:<10} [{b}, {t}, {h}/{kv}, {d}]  forward {:>8.1} µs {fwd_rate:>6.1} GFLOP/s ({:.0}% of the products')  backward {:>8.1} µs {bwd_rate:>6.1} GFLOP/s ({:.0}%)",
            forward * 1e6,
            share(fwd_rate),
            backward * 1e6,
            share(bwd_rate),
        );
        rows.push(format!(
            "{{\"shape\":\"{name}\",\"batch\":{b},\"tokens\":{t},\"heads\":{h},\"kv_heads\":{kv},\"head_dim\":{d},\"forward_us\":{:.1},\"backward_us\":{:.1},\"forward_gflops\":{fwd_rate:.2},\"backward_gflops\":{bwd_rate:.2}}}",
            forward * 1e6,
            backward * 1e6
        ));
    }
    std::fs::create_dir_all("target/bench")?;
    let path = "target/bench/flash.json";
    std::fs::write(
        path,
        format!(
            "{{\"benchmark\":\"flash\",\"threads\":{threads},\"product_gflops\":{:.2},\"rows\":[{}]}}\n",
            peak.flops / 1e9,
            rows.join(",")
        ),
    )?;
    eprintln!("wrote {path}");
    Ok(())
}
