//! Milliseconds per generated token through the key/value cache, f32 against bf16 compute
//! (`Decoder::with_compute_dtype`), on a preset with its initial weights (the cost of a token
//! does not depend on the weights), the two dtypes alternated in ABBA pairs in one process so
//! their ratio holds on a shared machine. Prints each pair and the medians; writes
//! `target/bench/decode_dtype.json`.
//!
//! ```text
//! cargo run --release -p ferrotext-generate --example decode_dtype -- [model=qwen3-tiny] [context=256] [new=64] [pairs=4]
//! ```

use ferrotext_generate::generate::{generate, GenerateOptions};
use ferrotext_generate::sample::SamplingParams;
use ferrotext_models::decoder::{Config, Decoder};
use ferrotext_models::init_normal;
use ferrotext_sharding::DType;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut model, mut context, mut new, mut pairs) = ("qwen3-tiny".to_string(), 256, 64, 4);
    for arg in std::env::args().skip(1) {
        match arg.split_once('=') {
            Some(("model", v)) => model = v.into(),
            Some(("context", v)) => context = v.parse()?,
            Some(("new", v)) => new = v.parse()?,
            Some(("pairs", v)) => pairs = v.parse()?,
            _ => {
                return Err(
                    format!("unknown argument {arg:?} (model=, context=, new=, pairs=)").into(),
                )
            }
        }
    }
    let config = Config::preset(&model).ok_or(format!("no preset {model:?}"))?;
    let f32_decoder = Decoder::new(config.clone())?;
    let bf16_decoder = Decoder::new(config)?.with_compute_dtype(DType::BF16)?;
    let params: Vec<_> = f32_decoder
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| init_normal(p, 1, i))
        .collect();
    let vocab = f32_decoder.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..context - new)
        .map(|i| (i as u32 * 7919 + 13) % vocab)
        .collect();
    let options = GenerateOptions {
        max_new_tokens: new,
        sampling: SamplingParams::default(),
        stop_tokens: Vec::new(),
        context,
        use_cache: true,
    };
    let run = |decoder: &Decoder| -> Result<f64, Box<dyn std::error::Error>> {
        let g = generate(decoder, &params, &prompt, &options, &|_| Ok(()))?;
        Ok(g.median_token_seconds().unwrap_or(f64::NAN) * 1e3)
    };
    let (mut f, mut b) = (Vec::new(), Vec::new());
    for p in 0..pairs {
        let (x, y) = if p % 2 == 0 {
            let x = run(&f32_decoder)?;
            (x, run(&bf16_decoder)?)
        } else {
            let y = run(&bf16_decoder)?;
            (run(&f32_decoder)?, y)
        };
        println!(
            "pair {p}: f32 {x:.3} ms/token, bf16 {y:.3} ms/token (bf16/f32 time {:.2})",
            y / x
        );
        f.push(x);
        b.push(y);
    }
    let (fm, bm) = (median(f), median(b));
    println!(
        "{model}, {context} tokens of context, {new} new: f32 {fm:.3} ms/token, bf16 {bm:.3} \
         ms/token; bf16/f32 tokens/s {:.2} (medians of {pairs} ABBA pairs)",
        fm / bm
    );
    std::fs::create_dir_all("target/bench")?;
    std::fs::write(
        "target/bench/decode_dtype.json",
        format!(
            "{{\"model\":\"{model}\",\"context\":{context},\"new_tokens\":{new},\"f32_ms_per_token\":{fm:.4},\"bf16_ms_per_token\":{bm:.4},\"bf16_over_f32_tokens_per_s\":{:.3}}}\n",
            fm / bm
        ),
    )?;
    Ok(())
}
