//! Generation: a prompt through the decoder, then one sampled token at a time, each handed to the
//! caller as soon as it is chosen.
//!
//! The model runs on the same mesh machinery as training — a one-device `data=1` mesh, the
//! parameters replicated, the `spmd` ops without a tape — and, by default, through the key/value
//! cache ([`Decoder::decode`]): the prompt is one pass (prefill), every later token one position.
//! With the cache off, every token recomputes the whole context (the reference the cache is
//! tested against, and the benchmark's baseline).
//!
//! Invariants: the same parameters, prompt and [`GenerateOptions`] give the same tokens (the
//! sampler is seeded; greedy breaks ties towards the lower id); the context (prompt + generated)
//! never exceeds [`GenerateOptions::context`]. A decoder computing in bf16 casts its f32
//! weights at use; a generation remembers those casts ([`Ctx::remember_casts`]), so each weight
//! is rounded once per generation rather than once per token, to the same bits.

use std::sync::Arc;
use std::time::Instant;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::decoder::Decoder;
use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{on_device, Array, Ctx};
use ferrotext_tensor::Tensor;

use crate::error::GenerateError;
use crate::sample::{SampleError, Sampler, SamplingParams};

/// What to generate and how.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate after the prompt.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: SamplingParams,
    /// Tokens that end the generation (emitted, then stop): the end-of-sequence ids.
    pub stop_tokens: Vec<u32>,
    /// Most positions the model sees, prompt included (the trained context length).
    pub context: usize,
    /// Decode through the key/value cache (`false`: recompute the whole context per token).
    pub use_cache: bool,
}

/// Why the generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `max_new_tokens` were generated.
    MaxNewTokens,
    /// A stop token was generated (it is the last token).
    StopToken(u32),
    /// The context is full.
    ContextFull,
}

/// The generated tokens and where the time went.
#[derive(Clone, Debug)]
pub struct Generated {
    /// The new tokens, in order (the prompt excluded).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: Stop,
    /// Seconds from the start to the first new token (the prompt's pass; prefill).
    pub first_token_seconds: f64,
    /// Seconds for every later token, each.
    pub token_seconds: Vec<f64>,
}

impl Generated {
    /// Median seconds per token after the first (`None` with fewer than two tokens).
    pub fn median_token_seconds(&self) -> Option<f64> {
        let mut t = self.token_seconds.clone();
        if t.is_empty() {
            return None;
        }
        t.sort_by(f64::total_cmp);
        Some(t[t.len() / 2])
    }
}

fn sampling_error(e: SampleError) -> GenerateError {
    match e {
        SampleError::OutOfRange { name, .. } => GenerateError::usage(name, e.to_string()),
        SampleError::BadLogits(_) => GenerateError::Internal(e.to_string()),
    }
}

impl GenerateOptions {
    /// Checks the options against `prompt` and the model's vocabulary.
    ///
    /// # Errors
    /// [`GenerateError::Usage`] naming the problem: an empty prompt, a prompt that fills the
    /// context, an id beyond the vocabulary, sampling parameters out of range.
    pub fn check(&self, prompt: &[u32], vocab: usize) -> Result<(), GenerateError> {
        Sampler::new(self.sampling.clone()).map_err(sampling_error)?;
        if prompt.is_empty() {
            return Err(GenerateError::usage("prompt", "the prompt is empty"));
        }
        if prompt.len() >= self.context {
            return Err(GenerateError::usage(
                "prompt",
                format!(
                    "the prompt has {} tokens; the context holds {} (max_target_length), so \
                     nothing could be generated",
                    prompt.len(),
                    self.context
                ),
            ));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(GenerateError::usage(
                "prompt",
                format!("the prompt has token id {bad}, beyond the model's vocabulary of {vocab}"),
            ));
        }
        if let Some(&bad) = self.stop_tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(GenerateError::usage(
                "eos",
                format!("stop token {bad} is beyond the model's vocabulary of {vocab}"),
            ));
        }
        Ok(())
    }
}

/// Generates from `prompt` with `decoder` and its `params` (host tensors in
/// [`Decoder::params`] order), calling `on_token` with each new token as soon as it is chosen.
///
/// # Errors
/// As [`GenerateOptions::check`]; a parameter list that does not fit the decoder; a failure of
/// the ops or of `on_token`.
pub fn generate(
    decoder: &Decoder,
    params: &[Tensor],
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: &(dyn Fn(u32) -> Result<(), GenerateError> + Sync),
) -> Result<Generated, GenerateError> {
    let vocab = decoder.config().vocab_size;
    options.check(prompt, vocab)?;
    let infos = decoder.params();
    if infos.len() != params.len() || infos.iter().zip(params).any(|(i, p)| i.shape != p.shape()) {
        return Err(GenerateError::Misuse {
            call: "generate",
            reason: "the parameters do not fit the decoder".into(),
        });
    }
    let mesh = Arc::new(Mesh::explicit([("data", 1)])?);
    let results = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        on_device(dev, |cx| {
            let replicated = NamedSharding::new(mesh.clone(), PartitionSpec::replicated())?;
            let weights: Vec<Array> = params
                .iter()
                .map(|p| cx.from_global(p, replicated.clone()))
                .collect::<Result<_, _>>()?;
            run_loop(cx, decoder, &weights, prompt, options, on_token)
        })
    })?;
    results
        .into_iter()
        .next()
        .ok_or_else(|| GenerateError::Internal("generate: the device returned nothing".into()))
}

/// The loop on the device: prefill, then sample → emit → feed, until a stop.
fn run_loop(
    cx: &mut Ctx<'_>,
    decoder: &Decoder,
    weights: &[Array],
    prompt: &[u32],
    options: &GenerateOptions,
    on_token: &(dyn Fn(u32) -> Result<(), GenerateError> + Sync),
) -> Result<Generated, GenerateError> {
    let mut sampler = Sampler::new(options.sampling.clone()).map_err(sampling_error)?;
    // The weights are f32 and a bf16 decoder casts each at use: once per generation, not once
    // per token (the casts are what made a bf16 token cost more than an f32 one).
    cx.remember_casts(weights);
    let mut cache = decoder.new_cache();
    let mut context: Vec<u32> = prompt.to_vec();
    let mut fed = 0; // positions already in the cache
    let mut tokens = Vec::new();
    let mut token_seconds = Vec::new();
    let mut first_token_seconds = 0.0;
    let start = Instant::now();
    let stop = loop {
        if tokens.len() == options.max_new_tokens {
            break Stop::MaxNewTokens;
        }
        let t0 = Instant::now();
        let row = if options.use_cache {
            let row = last_logits(cx, decoder, weights, &context[fed..], Some(&mut cache))?;
            fed = context.len();
            row
        } else {
            last_logits(cx, decoder, weights, &context, None)?
        };
        let token = sampler.next(&row).map_err(sampling_error)?;
        if tokens.is_empty() {
            first_token_seconds = start.elapsed().as_secs_f64();
        } else {
            token_seconds.push(t0.elapsed().as_secs_f64());
        }
        tokens.push(token);
        on_token(token)?;
        if options.stop_tokens.contains(&token) {
            break Stop::StopToken(token);
        }
        context.push(token);
        // the next token would sit at position `context.len()`: past the trained context
        if context.len() == options.context && tokens.len() < options.max_new_tokens {
            break Stop::ContextFull;
        }
    };
    cx.forget_casts();
    Ok(Generated {
        tokens,
        stop,
        first_token_seconds,
        token_seconds,
    })
}

/// The logits of the last position after feeding `ids` (through `cache` when given: `ids` are
/// then the positions after the cached ones; else `ids` are the whole context).
fn last_logits(
    cx: &mut Ctx<'_>,
    decoder: &Decoder,
    weights: &[Array],
    ids: &[u32],
    cache: Option<&mut ferrotext_models::KvCache>,
) -> Result<Vec<f32>, GenerateError> {
    let ids = cx.ids_from_global(&[1, ids.len()], PartitionSpec::replicated(), ids)?;
    let logits = match cache {
        Some(cache) => decoder.decode(cx, weights, &ids, cache)?,
        None => decoder.logits(cx, weights, &ids)?,
    };
    let logits = cx.to_host(&logits)?;
    let vocab = logits.shape()[2];
    let data = logits.data();
    Ok(data[data.len() - vocab..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: 4,
            sampling: SamplingParams::default(),
            stop_tokens: vec![],
            context: 8,
            use_cache: true,
        }
    }

    #[test]
    fn bad_prompts_and_parameters_name_what_is_wrong() {
        let o = options();
        let err = |o: &GenerateOptions, p: &[u32]| o.check(p, 16).unwrap_err();
        assert!(err(&o, &[]).to_string().contains("empty"));
        let long = err(&o, &[1; 8]);
        assert!(
            long.is_usage() && long.to_string().contains("8 tokens"),
            "{long}"
        );
        assert!(err(&o, &[1, 16]).to_string().contains("token id 16"));
        let mut hot = options();
        hot.sampling.temperature = -1.0;
        let e = err(&hot, &[1]);
        assert!(e.is_usage() && e.to_string().contains("temperature"), "{e}");
        let mut p = options();
        p.sampling.top_p = 0.0;
        assert!(err(&p, &[1]).to_string().contains("top_p"));
        let mut stop = options();
        stop.stop_tokens = vec![99];
        assert!(err(&stop, &[1]).to_string().contains("stop token 99"));
        assert!(o.check(&[1; 7], 16).is_ok());
    }
}
