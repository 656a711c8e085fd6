//! [`DataError`]: everything reading a corpus, tokenizing it, or reading token shards can fail
//! with, each variant carrying the values a user needs to fix the input (the path, the shard, the
//! field, what was expected and what was found).

use std::path::{Path, PathBuf};

/// Everything the data layer can fail with. Every variant but [`DataError::Write`] is the user's
/// input (a file, a field, a pattern they named): [`DataError::is_usage`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A file the user named cannot be opened or read.
    #[error("cannot open {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// An output cannot be written (the machine refused: not the user's input).
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// An input pattern matched no file.
    #[error("{pattern} matches no file")]
    NoMatch {
        /// The pattern (or path) as given.
        pattern: String,
    },
    /// An input pattern that is not a glob.
    #[error("{pattern} is not a valid glob: {reason}")]
    BadPattern {
        /// The pattern as given.
        pattern: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An input whose name does not say its format.
    #[error(
        "{} has an unknown format: name it .jsonl, .json, .parquet or .txt",
        path.display()
    )]
    UnknownFormat {
        /// The file.
        path: PathBuf,
    },
    /// A record without the text field.
    #[error("{}{}: no field `{field}`{}", path.display(), at_line(*line), found_fields(found))]
    MissingField {
        /// The file.
        path: PathBuf,
        /// The field asked for (`--field`).
        field: String,
        /// The line (jsonl, 1-based), if the format has lines.
        line: Option<u64>,
        /// The fields the record or file does have.
        found: Vec<String>,
    },
    /// A record whose text field is not a string.
    #[error("{}{}: field `{field}` is {found}, not a string", path.display(), at_line(*line))]
    NotText {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// The line (jsonl, 1-based), if the format has lines.
        line: Option<u64>,
        /// What the field holds instead (`a number`, `binary data`, ...).
        found: String,
    },
    /// A file that is not the format its name says (bad JSON, not parquet, not UTF-8).
    #[error("{}{}: {reason}", path.display(), at_line(*line))]
    Parse {
        /// The file.
        path: PathBuf,
        /// The line (jsonl, 1-based), if known.
        line: Option<u64>,
        /// What the parser said.
        reason: String,
    },
    /// A tokenizer that cannot be used.
    #[error("tokenizer {}: {reason}", path.display())]
    Tokenizer {
        /// The `tokenizer.json` (or model directory).
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tokenizer whose ids do not fit the model's embedding table.
    #[error(
        "tokenizer {} has {tokenizer_vocab} tokens, more than the model's vocab_size \
         {model_vocab}: its ids would index past the embedding table",
        path.display()
    )]
    VocabTooLarge {
        /// The tokenizer (or the shard directory that records it).
        path: PathBuf,
        /// Its vocabulary (added tokens included).
        tokenizer_vocab: usize,
        /// The model's `vocab_size`.
        model_vocab: usize,
    },
    /// The output directory already exists (nothing is overwritten).
    #[error("{} already exists; remove it or choose another --output", path.display())]
    OutputExists {
        /// The directory.
        path: PathBuf,
    },
    /// The corpus holds no document.
    #[error("{what} holds no document")]
    Empty {
        /// The inputs, as given.
        what: String,
    },
    /// A shard directory's `manifest.json` that cannot be used: a field with the wrong value.
    #[error("{}: `{field}` is {found}, expected {expected}", path.display())]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// The field.
        field: String,
        /// What it should be.
        expected: String,
        /// What it is.
        found: String,
    },
    /// A shard the manifest lists is not in its directory.
    #[error("shard {shard} of {} is missing ({source})", dir.display())]
    MissingShard {
        /// The shard directory.
        dir: PathBuf,
        /// The shard's file name.
        shard: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// A shard or index file whose size is not the one the manifest records.
    #[error(
        "{} is {found} bytes, expected {expected} (truncated or not this manifest's shard)",
        path.display()
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The size the manifest implies.
        expected: u64,
        /// Its size.
        found: u64,
    },
    /// An index that does not describe its shard.
    #[error("index {} does not match its shard: {reason}", path.display())]
    IndexMismatch {
        /// The index file.
        path: PathBuf,
        /// What disagrees (with the expected and found values).
        reason: String,
    },
    /// A file whose SHA-256 is not the one the manifest records.
    #[error("{} has SHA-256 {found}, the manifest records {expected}: it changed since it was written", path.display())]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The recorded digest.
        expected: String,
        /// The file's digest.
        found: String,
    },
    /// Data too short for what is asked of it (a sequence, a split).
    #[error("{what} has {tokens} tokens; {need}")]
    TooShort {
        /// The data (a path, `the training shards`, ...).
        what: String,
        /// Its tokens.
        tokens: u64,
        /// What was needed, as a phrase (`a sequence needs 129`).
        need: String,
    },
    /// A token id beyond the model's vocabulary.
    #[error("{} holds token id {id} ≥ vocab_size {vocab}", path.display())]
    TokenOutOfRange {
        /// The file.
        path: PathBuf,
        /// The id.
        id: u64,
        /// The model's vocabulary.
        vocab: usize,
    },
    /// Any other input that cannot be used, named by its path.
    #[error("{}: {reason}", path.display())]
    Invalid {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

impl DataError {
    /// True when the user's input is at fault (exit code 2); false for a write the machine
    /// refused.
    pub fn is_usage(&self) -> bool {
        !matches!(self, DataError::Write { .. })
    }

    /// A [`DataError::Read`] of `path`.
    pub fn read(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
        move |source| DataError::Read {
            path: path.to_path_buf(),
            source,
        }
    }

    /// A [`DataError::Write`] of `path`.
    pub fn write(path: &Path) -> impl Fn(std::io::Error) -> DataError + '_ {
        move |source| DataError::Write {
            path: path.to_path_buf(),
            source,
        }
    }

    /// A [`DataError::Invalid`] of `path`.
    pub fn invalid(path: impl Into<PathBuf>, reason: impl Into<String>) -> DataError {
        DataError::Invalid {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// ` line N` when there is a line.
fn at_line(line: Option<u64>) -> String {
    line.map_or_else(String::new, |l| format!(" line {l}"))
}

/// ` (it has a, b, c)` when there are fields to list.
fn found_fields(found: &[String]) -> String {
    if found.is_empty() {
        return String::new();
    }
    let shown: Vec<&str> = found.iter().take(8).map(String::as_str).collect();
    let more = if found.len() > 8 { ", ..." } else { "" };
    format!(" (it has {}{more})", shown.join(", "))
}
