//! The part of a step's host work that does not depend on values: one device's step run in
//! abstract mode (the same program: its ops' type rules, the tape and the backward walk; shapes
//! only, no kernel, nothing communicated), repeated on this thread. It bounds what caching the
//! type rules could save, as a number that does not move with the machine's memory and clock
//! states the way a whole step does (a real step's host work also allocates and frees the
//! tensors' buffers, which this does not count). Median of `reps` steps after one warm-up;
//! writes `target/bench/host_step.json`.
//!
//! ```text
//! cargo run --release -p ferrotext-train --example host_step -- [reps=20] [KEY=VALUE …]
//! ```
//! Keys are `train`'s, after the defaults `model_name=qwen3-peer ici_data_parallelism=1
//! local_devices=1 gradient_accumulation_steps=4 dtype=bfloat16` (a later key wins).

use std::sync::Arc;
use std::time::Instant;

use ferrotext_spmd::Ctx;
use ferrotext_train::data::{source_for, TokenSource};
use ferrotext_train::{TrainConfig, Trainer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut reps = 20usize;
    let mut items: Vec<String> = [
        "model_name=qwen3-peer",
        "ici_data_parallelism=1",
        "local_devices=1",
        "gradient_accumulation_steps=4",
        "dtype=bfloat16",
    ]
    .map(String::from)
    .to_vec();
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("reps", v)) => reps = v.parse()?,
            Some(_) => items.push(arg),
            None => return Err(format!("expected KEY=VALUE, got {arg:?}").into()),
        }
    }
    let cfg = TrainConfig::load(None, &items)?;
    let plan = cfg.plan()?;
    let vocab = plan.decoder().config().vocab_size;
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, vocab)?);
    let mut comm = ferrotext_comm::Communicator::new(
        0,
        plan.compute_mesh().clone(),
        Box::new(ferrotext_comm::NoTransport),
    );
    let mut cx = Ctx::new_abstract(&mut comm);
    let mut trainer = Trainer::new(&mut cx, &plan, source, None)?;
    trainer.step(&mut cx)?;
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            trainer
                .step(&mut cx)
                .map(|_| t.elapsed().as_secs_f64() * 1e6)
        })
        .collect::<Result<_, _>>()?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "host step (abstract): median {median:.0} µs over {} steps (min {:.0}, max {:.0})",
        times.len(),
        times[0],
        times[times.len() - 1]
    );
    std::fs::create_dir_all("target/bench")?;
    let json = serde_json::json!({
        "benchmark": "host_step",
        "keys": items,
        "steps": times.len(),
        "median_us": median,
        "min_us": times[0],
        "max_us": times[times.len() - 1],
    });
    std::fs::write("target/bench/host_step.json", format!("{json}\n"))?;
    Ok(())
}
