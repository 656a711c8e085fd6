//! The bf16 row and elementwise kernels a decoder layer runs around its products (RMSNorm,
//! RoPE, SwiGLU and GeGLU (Gemma's gated unit, timed at the same shapes), forward and backward), each alone on a kernel pool of `threads` workers as a
//! device runs them: median µs a call and the bytes it must move ÷ that time. Where a kernel's
//! GB/s is far below the memory's, it is bound by its arithmetic or by its dispatch, not by
//! its traffic.
//!
//! `kernel=PART` times only the kernels whose name contains `PART` (`rope`, `swiglu`, …).
//!
//! Shapes: qwen3-peer (2 × 128 tokens, d_model 256, MLP 768, 8 / 4 heads of 32) and qwen3-0.6b
//! (2 × 256 tokens, 1,024, 3,072, 16 / 8 heads of 128). Writes `target/bench/rows.json`.
//!
//! ```text
//! cargo run --release -p ferrotext-tensor --example rows -- [threads=2] [reps=300] [shape=NAME] [kernel=PART]
//! ```

use std::hint::black_box;
use std::time::Instant;

use ferrotext_tensor::{
    glu_backward_bf16, glu_bf16, rms_norm_backward_bf16, rms_norm_bf16, rope_bf16,
    swiglu_backward_bf16, swiglu_bf16, with_kernel_pool, Bf16Tensor, GluActivation, Rope, Tensor,
    TensorError,
};

/// GeGLU's activation.
const GELU: GluActivation = GluActivation::GeluTanh;

/// One layer's shape: name, batch, tokens, d_model, MLP width, query heads, kv heads, head dim.
type Shape = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

const SHAPES: [Shape; 2] = [
    ("qwen3-peer", 2, 128, 256, 768, 8, 4, 32),
    ("qwen3-0.6b", 2, 256, 1024, 3072, 16, 8, 128),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn operand(shape: &[usize], seed: usize) -> Bf16Tensor {
    Bf16Tensor::from_f32(&Tensor::from_fn(shape, |i| {
        ((i * 7 + seed) % 101) as f32 * 0.02 - 1.0
    }))
}

/// Median seconds of `reps` calls of `f`.
fn time(reps: usize, mut f: impl FnMut() -> Result<(), TensorError>) -> Result<f64, TensorError> {
    f()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut threads, mut reps, mut only) = (2usize, 300usize, None::<String>);
    let mut kernels = None::<String>;
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("threads", v)) => threads = v.parse()?,
            Some(("reps", v)) => reps = v.parse()?,
            Some(("shape", v)) => only = Some(v.to_string()),
            Some(("kernel", v)) => kernels = Some(v.to_string()),
            _ => {
                return Err(
                    format!("unknown argument {arg:?} (threads=, reps=, shape=, kernel=)").into(),
                )
            }
        }
    }
    let mut rows = Vec::new();
    for (name, b, t, d, mlp, h, kv, hd) in SHAPES {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let reps = (reps * 256 * 128 / (d * t)).max(5);
        let x = operand(&[b, t, d], 1);
        let dy = operand(&[b, t, d], 2);
        let scale = Tensor::from_fn(&[d], |i| 1.0 + i as f32 * 1e-3);
        let q = operand(&[b, t, h, hd], 3);
        let dq = operand(&[b, t, h, hd], 4);
        let qk = operand(&[b, t, kv, hd], 5);
        let qn_scale = Tensor::from_fn(&[hd], |i| 1.0 + i as f32 * 1e-3);
        let g = operand(&[b, t, mlp], 6);
        let u = operand(&[b, t, mlp], 7);
        let dm = operand(&[b, t, mlp], 8);
        let positions: Vec<usize> = (0..t).collect();
        let rope = Rope::standard(1e6);
        let (_, inv) = rms_norm_bf16(&x, &scale, 1e-6)?;
        let (_, q_inv) = rms_norm_bf16(&q, &qn_scale, 1e-6)?;
        // (kernel, elements it reads and writes in bytes, the call)
        type Case<'a> = (
            &'static str,
            usize,
            Box<dyn FnMut() -> Result<(), TensorError> + Send + 'a>,
        );
        let cases: Vec<Case> = vec![
            (
                "rms_norm layer",
                4 * x.len(),
                Box::new(|| rms_norm_bf16(&x, &scale, 1e-6).map(|r| drop(black_box(r)))),
            ),
            (
                "rms_norm_backward layer",
                6 * x.len(),
                Box::new(|| {
                    rms_norm_backward_bf16(&x, &scale, &inv, &dy).map(|r| drop(black_box(r)))
                }),
            ),
            (
                "rms_norm qk-norm",
                4 * q.len(),
                Box::new(|| rms_norm_bf16(&q, &qn_scale, 1e-6).map(|r| drop(black_box(r)))),
            ),
            (
                "rms_norm_backward qk-norm",
                6 * q.len(),
                Box::new(|| {
                    rms_norm_backward_bf16(&q, &qn_scale, &q_inv, &dq).map(|r| drop(black_box(r)))
                }),
            ),
            (
                "rope queries",
                4 * q.len(),
                Box::new(|| rope_bf16(&q, &positions, &rope, false).map(|r| drop(black_box(r)))),
            ),
            (
                "rope keys backward",
                4 * qk.len(),
                Box::new(|| rope_bf16(&qk, &positions, &rope, true).map(|r| drop(black_box(r)))),
            ),
            (
                "swiglu",
                6 * g.len(),
                Box::new(|| swiglu_bf16(&g, &u).map(|r| drop(black_box(r)))),
            ),
            (
                "swiglu_backward",
                10 * g.len(),
                Box::new(|| swiglu_backward_bf16(&g, &u, &dm).map(|r| drop(black_box(r)))),
            ),
            (
                "geglu",
                6 * g.len(),
                Box::new(|| glu_bf16(&g, &u, GELU).map(|r| drop(black_box(r)))),
            ),
            (
                "geglu_backward",
                10 * g.len(),
                Box::new(|| glu_backward_bf16(&g, &u, &dm, GELU).map(|r| drop(black_box(r)))),
            ),
        ];
        let timed = with_kernel_pool(threads, "rows", 16 << 20, || {
            cases
                .into_iter()
                .filter(|(kernel, ..)| kernels.as_deref().is_none_or(|k| kernel.contains(k)))
                .map(|(kernel, bytes, mut call)| Ok((kernel, bytes, time(reps, &mut call)?)))
                .collect::<Result<Vec<_>, TensorError>>()
        })?;
        for (kernel, bytes, secs) in timed {
            let gbs = bytes as f64 / secs / 1e9;
            eprintln!(
                "{name:<10} {kernel:<26} {:>9.1} µs {gbs:>6.1} GB/s",
                secs * 1e6
            );
            rows.push(format!(
                "{{\"shape\":\"{name}\",\"kernel\":\"{kernel}\",\"bytes\":{bytes},\"us\":{:.2},\"gb_per_s\":{gbs:.2}}}",
                secs * 1e6
            ));
        }
    }
    std::fs::create_dir_all("target/bench")?;
    let path = "target/bench/rows.json";
    std::fs::write(
        path,
        format!(
            "{{\"benchmark\":\"rows\",\"threads\":{threads},\"rows\":[{}]}}\n",
            rows.join(",")
        ),
    )?;
    eprintln!("wrote {path}");
    Ok(())
}
