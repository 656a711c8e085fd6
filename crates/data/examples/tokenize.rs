//! The library call `ferrotext tokenize` makes, without the binary's other layers, for the
//! throughput benchmark (`bench/bench_tokenize.py`): a release build of this crate alone.
//!
//! `cargo run --release -p ferrotext-data --example tokenize -- TOKENIZER OUT INPUT...`
//! prints one JSON line: text bytes, documents, tokens, seconds.

use std::path::PathBuf;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        return Err("usage: tokenize TOKENIZER OUT INPUT...".into());
    }
    let options = ferrotext_data::TokenizeOptions {
        inputs: args[2..].to_vec(),
        field: "text".into(),
        tokenizer: PathBuf::from(&args[0]),
        output: PathBuf::from(&args[1]),
        eos: String::new(),
        special_tokens: true,
        shard_tokens: 100_000_000,
        batch_bytes: 4 << 20,
    };
    let start = Instant::now();
    let mut last = ferrotext_data::Progress::default();
    let manifest = ferrotext_data::tokenize(&options, &mut |p| last = p)?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"text_bytes\": {}, \"documents\": {}, \"tokens\": {}, \"seconds\": {secs:.3}, \"shards\": {}}}",
        last.text_bytes,
        manifest.documents,
        manifest.tokens,
        manifest.shards.len()
    );
    Ok(())
}
