//! Throughput of rounding `f32` to bf16 (`round_slice`, what every bf16 kernel's output and the
//! step's weight copies go through), on one thread, for a block in L1 (16 Ki elements), a
//! product's band in L2 (64 × 768 as at qwen3-peer's MLP) and a tensor from memory (4 Mi):
//! median of `reps` passes each, in ns per element. Writes `target/bench/bf16_round.json`.
//!
//! ```text
//! cargo run --release -p ferrotext-tensor --example bf16_round -- [reps=200]
//! ```

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::time::Instant;

use ferrotext_tensor::round_slice;
use half::bf16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut reps = 200usize;
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("reps", v)) => reps = v.parse()?,
            _ => return Err(format!("unknown argument {arg:?} (reps=)").into()),
        }
    }
    let mut rows = Vec::new();
    for (name, len) in [("L1", 16 << 10), ("band", 64 * 768), ("memory", 4 << 20)] {
        let src: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut dst = vec![bf16::ZERO; len];
        round_slice(&src, &mut dst);
        let mut times: Vec<f64> = (0..reps)
            .map(|_| {
                let t = Instant::now();
                round_slice(black_box(&src), &mut dst);
                black_box(&dst);
                t.elapsed().as_secs_f64()
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let ns = times[reps / 2] * 1e9 / len as f64;
        println!("{name:>6}: {len:>8} elements, {ns:.3} ns an element");
        rows.push(format!(
            "{{\"case\":\"{name}\",\"elements\":{len},\"ns_per_element\":{ns}}}"
        ));
    }
    std::fs::create_dir_all("target/bench")?;
    std::fs::write(
        "target/bench/bf16_round.json",
        format!(
            "{{\"benchmark\":\"bf16_round\",\"rows\":[{}]}}\n",
            rows.join(",")
        ),
    )?;
    Ok(())
}
