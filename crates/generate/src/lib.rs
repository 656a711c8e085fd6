/*!
Generation from a trained decoder: the prompt through the model once (prefill), then one sampled
token at a time through the key/value cache, each handed to the caller as soon as it is chosen;
the token choice (greedy, temperature, top-k, top-p); and text to ids and back.

| file | what it owns |
|---|---|
| `generate.rs` | [`generate::generate`]: the loop on a one-device mesh, with or without the cache |
| `sample.rs` | [`sample::Sampler`]: the next token from a row of logits, seeded |
| `text.rs` | [`text::TextCodec`] (a `tokenizer.json`, or bytes) and [`text::StreamDecoder`] |
| `error.rs` | [`GenerateError`], with its usage class |

This crate knows models and the mesh machinery, never the training loop: it runs on the same
`spmd` ops as training, without a tape.
*/

mod error;
pub mod generate;
pub mod sample;
pub mod text;

pub use error::GenerateError;
