//! `ferrotext tokenize INPUT... --tokenizer T --output DIR`: jsonl / parquet / text files (paths
//! or globs) tokenized with a model's `tokenizer.json` into a directory of token shards that
//! `dataset_type=shards` trains on ([`ferrotext_data::tokenize`]). Batches are encoded on every
//! core; a progress bar shows on a terminal; the directory appears complete or not at all, and
//! bad input (a glob matching nothing, a file without the field, a vocabulary larger than the
//! model's) is one `error:` line, exit code 2, nothing written.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use ferrotext_data::{Progress, TokenizeOptions};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::common::UsageError;

/// `ferrotext tokenize INPUT... --tokenizer PATH --output DIR [--field text] [--eos TOKEN]
/// [--no-special-tokens] [--shard-tokens N] [--report FILE]`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Corpus files or globs (quoted, so the shell leaves them): `.jsonl`/`.json` (one JSON
    /// object a line), `.parquet` (a string column), `.txt` (one document a file).
    #[arg(required = true)]
    inputs: Vec<String>,
    /// The model's `tokenizer.json`, or a Hugging Face model directory holding one (its
    /// `config.json` `vocab_size` must then hold every id, and its `eos_token_id` ends documents).
    #[arg(long)]
    tokenizer: PathBuf,
    /// The shard directory to write (must not exist).
    #[arg(long, short)]
    output: PathBuf,
    /// The text field of jsonl records and parquet rows.
    #[arg(long, default_value = "text")]
    field: String,
    /// The token that ends every document (default: the model's `eos_token_id`, else
    /// `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>`, `<|im_end|>`, `[SEP]`, the first the
    /// vocabulary has).
    #[arg(long, default_value = "")]
    eos: String,
    /// Leave out the tokenizer's own special tokens (the BOS its template puts in front of each
    /// document, as transformers' `tokenizer(text)` does for Llama 3, Gemma and Mistral).
    #[arg(long)]
    no_special_tokens: bool,
    /// Tokens a shard holds (a shard closes after the document that reaches this).
    #[arg(long, default_value_t = 100_000_000)]
    shard_tokens: u64,
    /// MiB of text encoded in one parallel batch.
    #[arg(long, default_value_t = 4.0)]
    batch_mib: f64,
    /// Also write the totals and the throughput as JSON to this file.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// Runs `ferrotext tokenize`.
pub fn run(args: &TokenizeArgs) -> Result<()> {
    if !(args.batch_mib.is_finite() && args.batch_mib > 0.0) {
        return Err(UsageError(format!("--batch-mib must be > 0, got {}", args.batch_mib)).into());
    }
    if args.shard_tokens == 0 {
        return Err(UsageError("--shard-tokens must be at least 1".into()).into());
    }
    let options = TokenizeOptions {
        inputs: args.inputs.clone(),
        field: args.field.clone(),
        tokenizer: args.tokenizer.clone(),
        output: args.output.clone(),
        eos: args.eos.clone(),
        special_tokens: !args.no_special_tokens,
        shard_tokens: args.shard_tokens,
        batch_bytes: (args.batch_mib * 1048576.0) as usize,
    };
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let start = Instant::now();
    let mut last = Progress::default();
    let manifest = ferrotext_data::tokenize(&options, &mut |p| {
        last = p;
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{:.1} MB of text, {} documents, {} tokens ({:.2} MB/s)",
            p.text_bytes as f64 / 1e6,
            p.documents,
            p.tokens,
            p.text_bytes as f64 / 1e6 / secs
        ));
        bar.tick();
    })
    .map_err(|e| -> anyhow::Error {
        // The user's input (exit 2), or a write the machine refused (exit 1).
        if e.is_usage() {
            UsageError(e.to_string()).into()
        } else {
            e.into()
        }
    })?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} shards, {} documents, {} tokens ({:?}); {:.1} MB of text in {secs:.2} s \
         ({:.2} MB/s, {:.0} tokens/s)",
        args.output.display(),
        manifest.shards.len(),
        manifest.documents,
        manifest.tokens,
        manifest.dtype,
        last.text_bytes as f64 / 1e6,
        last.text_bytes as f64 / 1e6 / secs.max(1e-9),
        manifest.tokens as f64 / secs.max(1e-9),
    );
    if let Some(path) = &args.report {
        let report = serde_json::json!({
            "output": args.output.display().to_string(),
            "shards": manifest.shards.len(),
            "documents": manifest.documents,
            "tokens": manifest.tokens,
            "dtype": manifest.dtype,
            "text_bytes": last.text_bytes,
            "seconds": secs,
            "threads": std::thread::available_parallelism().map_or(1, usize::from),
            "special_tokens": !args.no_special_tokens,
        });
        std::fs::write(path, format!("{report:#}\n"))
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}
