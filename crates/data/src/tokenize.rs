//! Tokenizing a corpus into a shard directory.
//!
//! The pipeline: expand the inputs and check every file has the field ([`crate::input`]); load
//! the tokenizer (a `tokenizer.json`, or a Hugging Face model directory whose `config.json`
//! bounds the vocabulary); then a reader thread parses documents into batches of about
//! [`TokenizeOptions::batch_bytes`] while each batch before it is encoded in parallel on every
//! core by the `tokenizers` crate's `encode_batch_fast` (the output keeps the input order), its
//! ids written document by document through [`ShardWriter`]. Invariant: the output appears only complete
//! (see [`crate::write`]); every input error is found before it would be published.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use crate::error::DataError;
use crate::format::{sha256_hex, ShardManifest};
use crate::input::{expand, for_each_document, precheck};
use crate::write::{ShardWriter, TokenizerInfo};
use ferrotext_files::read_regular;

/// EOS names tried, in order, when neither `--eos` nor the model's config names one.
const EOS_NAMES: &[&str] = &[
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|im_end|>",
    "[SEP]",
];

/// What to tokenize and where to write it.
#[derive(Clone, Debug)]
pub struct TokenizeOptions {
    /// Files or globs (`.jsonl`, `.parquet`, `.txt`).
    pub inputs: Vec<String>,
    /// The text field of jsonl records and parquet rows.
    pub field: String,
    /// A `tokenizer.json`, or a Hugging Face model directory holding one.
    pub tokenizer: PathBuf,
    /// The output directory (must not exist).
    pub output: PathBuf,
    /// The EOS token's text (empty: the model's `eos_token_id`, else a known name).
    pub eos: String,
    /// Encode each document with the tokenizer's own special tokens: its post-processor's
    /// template, as transformers' `tokenizer(text)` applies it (Llama 3's `<|begin_of_text|>`,
    /// Gemma's and Mistral's BOS in front; Qwen's template adds nothing). A template that also
    /// ends a document with the EOS is not doubled by the EOS every document ends with.
    pub special_tokens: bool,
    /// Tokens a shard holds (a shard closes after the document that reaches this).
    pub shard_tokens: u64,
    /// Input bytes encoded per parallel batch.
    pub batch_bytes: usize,
}

/// Progress so far, after each batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct Progress {
    /// Input text bytes tokenized.
    pub text_bytes: u64,
    /// Documents written.
    pub documents: u64,
    /// Tokens written (EOS included).
    pub tokens: u64,
}

/// A loaded tokenizer and what the shards record about it.
pub struct LoadedTokenizer {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The `tokenizer.json` read.
    pub path: PathBuf,
    /// SHA-256 (hex) of its bytes.
    pub sha256: String,
    /// Its vocabulary, added tokens included.
    pub vocab_size: usize,
    /// The model directory's `config.json` `vocab_size`, when a directory was given.
    pub model_vocab: Option<usize>,
    /// The model directory's `config.json` `eos_token_id`, when it has one.
    pub model_eos: Option<u32>,
}

/// Loads the tokenizer at `path` (a `tokenizer.json` or a model directory holding one) and
/// checks its vocabulary fits the model's, when the directory's `config.json` names one.
///
/// # Errors
/// [`DataError::Read`], [`DataError::Tokenizer`], [`DataError::VocabTooLarge`].
pub fn load_tokenizer(path: &Path) -> Result<LoadedTokenizer, DataError> {
    let (file, config) = if path.is_dir() {
        (path.join("tokenizer.json"), Some(path.join("config.json")))
    } else {
        (path.to_path_buf(), None)
    };
    let bytes = read_regular(&file).map_err(DataError::read(&file))?;
    let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Tokenizer {
        path: file.clone(),
        reason: e.to_string(),
    })?;
    let vocab_size = tokenizer.get_vocab_size(true);
    let (mut model_vocab, mut model_eos) = (None, None);
    if let Some(config) = config.filter(|c| c.exists()) {
        let text = read_regular(&config).map_err(DataError::read(&config))?;
        let value: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| DataError::Parse {
                path: config.clone(),
                line: None,
                reason: e.to_string(),
            })?;
        model_vocab = value
            .get("vocab_size")
            .and_then(serde_json::Value::as_u64)
            .map(|v| v as usize);
        model_eos = match value.get("eos_token_id") {
            Some(serde_json::Value::Array(ids)) => ids.first().and_then(serde_json::Value::as_u64),
            Some(v) => v.as_u64(),
            None => None,
        }
        .map(|v| v as u32);
    }
    if let Some(model) = model_vocab {
        check_vocab(&file, vocab_size, model)?;
    }
    Ok(LoadedTokenizer {
        tokenizer,
        path: file,
        sha256: sha256_hex(&bytes),
        vocab_size,
        model_vocab,
        model_eos,
    })
}

/// Sends the documents of `files` to `tx` in batches of about `limit` bytes, in order, then
/// the first error if any; stops when the receiver is gone.
fn read_batches(
    files: &[(std::path::PathBuf, crate::input::Format)],
    field: &str,
    limit: usize,
    tx: &std::sync::mpsc::SyncSender<Result<Vec<String>, DataError>>,
) {
    let stopped = || DataError::invalid("", "the encoder stopped");
    let mut batch = Vec::new();
    let mut bytes = 0usize;
    let mut read = || -> Result<(), DataError> {
        for (path, format) in files {
            for_each_document(path, *format, field, &mut |doc| {
                bytes += doc.len();
                batch.push(doc);
                if bytes >= limit {
                    bytes = 0;
                    tx.send(Ok(std::mem::take(&mut batch)))
                        .map_err(|_| stopped())?;
                }
                Ok(())
            })?;
        }
        if !batch.is_empty() {
            tx.send(Ok(std::mem::take(&mut batch)))
                .map_err(|_| stopped())?;
        }
        Ok(())
    };
    if let Err(e) = read() {
        // The receiver may be gone (it stopped first); then nobody needs the error.
        let _ = tx.send(Err(e));
    }
}

/// A tokenizer of `tokenizer_vocab` ids fits a model of `model_vocab`.
///
/// # Errors
/// [`DataError::VocabTooLarge`].
pub fn check_vocab(
    path: &Path,
    tokenizer_vocab: usize,
    model_vocab: usize,
) -> Result<(), DataError> {
    if tokenizer_vocab > model_vocab {
        return Err(DataError::VocabTooLarge {
            path: path.to_path_buf(),
            tokenizer_vocab,
            model_vocab,
        });
    }
    Ok(())
}

/// The EOS id: `eos` by name, else the model's `eos_token_id`, else the first known name the
/// vocabulary has.
///
/// # Errors
/// [`DataError::Tokenizer`] for a name the vocabulary lacks, or when none is found.
pub fn eos_id(t: &LoadedTokenizer, eos: &str) -> Result<u32, DataError> {
    if !eos.is_empty() {
        return t
            .tokenizer
            .token_to_id(eos)
            .ok_or_else(|| DataError::Tokenizer {
                path: t.path.clone(),
                reason: format!("has no token `{eos}` (--eos)"),
            });
    }
    if let Some(id) = t.model_eos.filter(|&id| (id as usize) < t.vocab_size) {
        return Ok(id);
    }
    EOS_NAMES
        .iter()
        .find_map(|name| t.tokenizer.token_to_id(name))
        .ok_or_else(|| DataError::Tokenizer {
            path: t.path.clone(),
            reason: format!(
                "has none of the usual EOS tokens ({}): name it with --eos",
                EOS_NAMES.join(", ")
            ),
        })
}

/// A document's ids before the EOS the writer appends: the encoding's, less a last EOS that
/// the tokenizer's template added (a special token, not text that spelled it).
fn document_ids(e: &tokenizers::Encoding, eos: u32) -> &[u32] {
    let ids = e.get_ids();
    let template_eos = ids.last() == Some(&eos) && e.get_special_tokens_mask().last() == Some(&1);
    if template_eos {
        &ids[..ids.len() - 1]
    } else {
        ids
    }
}

/// Tokenizes the corpus `options` names into a new shard directory, calling `progress` after
/// each batch with the totals so far; returns the manifest written.
///
/// # Errors
/// Any [`DataError`]: every input problem before the output is published (nothing is left
/// under the output's name).
pub fn tokenize(
    options: &TokenizeOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<ShardManifest, DataError> {
    let files = expand(&options.inputs)?;
    precheck(&files, &options.field)?;
    let loaded = load_tokenizer(&options.tokenizer)?;
    let eos = eos_id(&loaded, &options.eos)?;
    let info = TokenizerInfo {
        sha256: loaded.sha256.clone(),
        vocab_size: loaded.vocab_size,
        eos_id: eos,
    };
    let mut writer = ShardWriter::create(&options.output, info, options.shard_tokens)?;
    let mut done = Progress::default();
    let limit = options.batch_bytes.max(1);
    std::thread::scope(|scope| -> Result<(), DataError> {
        // One reader thread parses batch `k + 1` while every core encodes batch `k`; the
        // channel keeps the batches in corpus order. An error on this side drops the receiver,
        // which stops the reader at its next send.
        let (tx, rx) = std::sync::mpsc::sync_channel(2);
        let (files, field) = (&files, options.field.as_str());
        scope.spawn(move || read_batches(files, field, limit, &tx));
        for batch in rx {
            let batch: Vec<String> = batch?;
            let text_bytes: usize = batch.iter().map(String::len).sum();
            let encodings = loaded
                .tokenizer
                .encode_batch_fast(batch, options.special_tokens)
                .map_err(|e| DataError::Tokenizer {
                    path: loaded.path.clone(),
                    reason: e.to_string(),
                })?;
            for e in &encodings {
                let ids = document_ids(e, eos);
                writer.push_document(ids)?;
                done.tokens += ids.len() as u64 + 1;
            }
            done.documents += encodings.len() as u64;
            done.text_bytes += text_bytes as u64;
            progress(done);
        }
        Ok(())
    })?;
    writer.finish(&options.inputs.join(" "))
}
