//! `bench generate`: time per generated token with the key/value cache against recomputing the
//! whole context, at a given context length, ABBA-paired in one process.
//!
//! The model has its initial (random) weights: the cost of a token does not depend on what the
//! weights are. Both sides generate the same greedy tokens (checked), so they do the same work
//! apart from the cache.

use std::path::Path;

use anyhow::{ensure, Result};
use ferrotext_generate::generate::{generate, GenerateOptions};
use ferrotext_generate::sample::SamplingParams;
use ferrotext_models::init_normal;
use ferrotext_train::TrainConfig;
use serde::Serialize;

use super::{abba_pair, cores, write_json, Side};
use crate::common::stats::median;

/// One side's measurement of one pair.
#[derive(Serialize)]
struct Sample {
    /// Median seconds per token after the first.
    token_seconds: f64,
    /// Seconds to the first token (the prompt's pass).
    first_token_seconds: f64,
}

#[derive(Serialize)]
struct Report {
    model: String,
    context: usize,
    new_tokens: usize,
    cores: usize,
    cached: Vec<Sample>,
    recomputed: Vec<Sample>,
    cached_ms_per_token: f64,
    recomputed_ms_per_token: f64,
    /// Median over pairs of recomputed / cached per-token time.
    speedup: f64,
}

/// Runs the benchmark: a prompt of `context − new_tokens` tokens, then `new_tokens` tokens,
/// `pairs` ABBA pairs; prints a table and writes JSON to `out`.
///
/// # Errors
/// A model that is not a preset, a context the model cannot hold, or a failed generation.
pub fn run(model: &str, context: usize, new_tokens: usize, pairs: usize, out: &Path) -> Result<()> {
    ensure!(
        new_tokens >= 2 && context > new_tokens,
        crate::common::UsageError(format!(
            "--new-tokens ({new_tokens}) must be at least 2 and below --context ({context})"
        ))
    );
    let config = TrainConfig {
        model_name: model.into(),
        max_target_length: context,
        ..TrainConfig::default()
    };
    let plan = config.plan()?;
    let decoder = plan.decoder();
    let params: Vec<_> = decoder
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| init_normal(p, 1, i))
        .collect();
    let vocab = decoder.config().vocab_size as u32;
    let prompt: Vec<u32> = (0..context - new_tokens)
        .map(|i| (i as u32 * 7919 + 13) % vocab)
        .collect();
    let options = |use_cache| GenerateOptions {
        max_new_tokens: new_tokens,
        sampling: SamplingParams::default(),
        stop_tokens: Vec::new(),
        context,
        use_cache,
    };
    let nothing = |_: u32| Ok(());
    let (mut cached, mut recomputed) = (Vec::new(), Vec::new());
    let mut ratios = Vec::new();
    for i in 0..pairs {
        let (a, b) = abba_pair(i, |side| {
            generate(
                decoder,
                &params,
                &prompt,
                &options(side == Side::A),
                &nothing,
            )
        })?;
        ensure!(
            a.tokens == b.tokens,
            "the cached and recomputed generations differ: {:?} vs {:?}",
            a.tokens,
            b.tokens
        );
        let sample = |g: &ferrotext_generate::generate::Generated| Sample {
            token_seconds: g.median_token_seconds().unwrap_or(0.0),
            first_token_seconds: g.first_token_seconds,
        };
        let (sa, sb) = (sample(&a), sample(&b));
        ratios.push(sb.token_seconds / sa.token_seconds);
        println!(
            "pair {i}: cached {:.2} ms/token, recomputed {:.2} ms/token ({:.1}×)",
            sa.token_seconds * 1e3,
            sb.token_seconds * 1e3,
            sb.token_seconds / sa.token_seconds
        );
        cached.push(sa);
        recomputed.push(sb);
    }
    let report = Report {
        model: model.to_string(),
        context,
        new_tokens,
        cores: cores(),
        cached_ms_per_token: median(cached.iter().map(|s| s.token_seconds * 1e3).collect()),
        recomputed_ms_per_token: median(recomputed.iter().map(|s| s.token_seconds * 1e3).collect()),
        speedup: median(ratios),
        cached,
        recomputed,
    };
    println!(
        "{model} at {context} tokens of context: {:.2} ms/token with the cache, {:.2} ms/token \
         recomputing — {:.1}× (median of {pairs} ABBA pairs)",
        report.cached_ms_per_token, report.recomputed_ms_per_token, report.speedup
    );
    write_json(out, &report)?;
    println!("wrote {}", out.display());
    Ok(())
}
