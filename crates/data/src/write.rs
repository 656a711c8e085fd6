//! [`ShardWriter`]: documents in, a shard directory out, published atomically.
//!
//! Invariant: everything is written under a temporary name beside the output
//! (`.NAME.tmp-PID`), each file fsynced, the manifest last; only then is the temporary directory
//! renamed to the output's name. A crash or an error leaves no directory under that name (the
//! temporary one is removed on error or drop), so a directory that exists under the final name
//! is complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::DataError;
use crate::format::{
    hex, shard_names, ShardEntry, ShardManifest, TokenWidth, FORMAT, FORMAT_VERSION, MANIFEST,
};

/// What the manifest says about the tokenizer.
#[derive(Clone, Debug)]
pub struct TokenizerInfo {
    /// SHA-256 (hex) of its `tokenizer.json`.
    pub sha256: String,
    /// Its vocabulary, added tokens included.
    pub vocab_size: usize,
    /// The id that ends every document.
    pub eos_id: u32,
}

/// The shard being written.
struct OpenShard {
    file: BufWriter<File>,
    hash: Sha256,
    offsets: Vec<u64>,
    tokens: u64,
}

/// Writes documents into shards of about `shard_tokens` tokens (a shard ends after the document
/// that reaches it; documents are never split) and publishes the directory with
/// [`ShardWriter::finish`].
pub struct ShardWriter {
    out: PathBuf,
    tmp: PathBuf,
    info: TokenizerInfo,
    dtype: TokenWidth,
    shard_tokens: u64,
    shards: Vec<ShardEntry>,
    open: Option<OpenShard>,
    buffer: Vec<u8>,
    finished: bool,
}

impl ShardWriter {
    /// A writer for the directory `out`, which must not exist yet.
    ///
    /// # Errors
    /// [`DataError::OutputExists`]; [`DataError::Invalid`] when `out`'s parent is not a
    /// directory; [`DataError::Write`] when the temporary directory cannot be made.
    pub fn create(
        out: &Path,
        info: TokenizerInfo,
        shard_tokens: u64,
    ) -> Result<ShardWriter, DataError> {
        if out.symlink_metadata().is_ok() {
            return Err(DataError::OutputExists {
                path: out.to_path_buf(),
            });
        }
        let name = out
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| DataError::invalid(out, "is not a directory name"))?;
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !parent.is_dir() {
            return Err(DataError::invalid(
                out,
                format!("cannot be made: {} is not a directory", parent.display()),
            ));
        }
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(DataError::write(&tmp))?;
        }
        std::fs::create_dir(&tmp).map_err(DataError::write(&tmp))?;
        Ok(ShardWriter {
            out: out.to_path_buf(),
            tmp,
            dtype: TokenWidth::for_vocab(info.vocab_size),
            info,
            shard_tokens: shard_tokens.max(1),
            shards: Vec::new(),
            open: None,
            buffer: Vec::new(),
            finished: false,
        })
    }

    /// The id width the shards get.
    pub fn dtype(&self) -> TokenWidth {
        self.dtype
    }

    /// Appends one document (its ids, then EOS).
    ///
    /// # Errors
    /// [`DataError::Write`]; [`DataError::Invalid`] for an id at or beyond the vocabulary.
    pub fn push_document(&mut self, ids: &[u32]) -> Result<(), DataError> {
        let vocab = self.info.vocab_size as u64;
        if let Some(&bad) = ids.iter().find(|&&t| u64::from(t) >= vocab) {
            return Err(DataError::invalid(
                &self.out,
                format!("the tokenizer produced id {bad} ≥ its vocabulary {vocab}"),
            ));
        }
        if self.open.is_none() {
            let (file, _) = shard_names(self.shards.len());
            let path = self.tmp.join(&file);
            let f = File::create(&path).map_err(DataError::write(&path))?;
            self.open = Some(OpenShard {
                file: BufWriter::with_capacity(1 << 20, f),
                hash: Sha256::new(),
                offsets: vec![0],
                tokens: 0,
            });
        }
        self.buffer.clear();
        let eos = self.info.eos_id;
        match self.dtype {
            TokenWidth::U16 => {
                for &t in ids.iter().chain(std::iter::once(&eos)) {
                    self.buffer.extend_from_slice(&(t as u16).to_le_bytes());
                }
            }
            TokenWidth::U32 => {
                for &t in ids.iter().chain(std::iter::once(&eos)) {
                    self.buffer.extend_from_slice(&t.to_le_bytes());
                }
            }
        }
        let full = {
            let shard = self
                .open
                .as_mut()
                .ok_or_else(|| DataError::invalid(&self.tmp, "no open shard (internal error)"))?;
            let path = self.tmp.join(shard_names(self.shards.len()).0);
            shard
                .file
                .write_all(&self.buffer)
                .map_err(DataError::write(&path))?;
            shard.hash.update(&self.buffer);
            shard.tokens += ids.len() as u64 + 1;
            shard.offsets.push(shard.tokens);
            shard.tokens >= self.shard_tokens
        };
        if full {
            self.close_shard()?;
        }
        Ok(())
    }

    /// Closes the open shard: flushes and fsyncs it, writes its index, records it.
    fn close_shard(&mut self) -> Result<(), DataError> {
        let Some(shard) = self.open.take() else {
            return Ok(());
        };
        let (file, index) = shard_names(self.shards.len());
        let path = self.tmp.join(&file);
        let f = shard.file.into_inner().map_err(|e| DataError::Write {
            path: path.clone(),
            source: e.into_error(),
        })?;
        f.sync_all().map_err(DataError::write(&path))?;
        let idx_bytes: Vec<u8> = shard.offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        let idx_path = self.tmp.join(&index);
        write_synced(&idx_path, &idx_bytes)?;
        self.shards.push(ShardEntry {
            file,
            index,
            tokens: shard.tokens,
            documents: shard.offsets.len() as u64 - 1,
            sha256: hex(&shard.hash.finalize()),
            index_sha256: crate::format::sha256_hex(&idx_bytes),
        });
        Ok(())
    }

    /// Closes the last shard, writes the manifest and publishes the directory under its final
    /// name; returns the manifest.
    ///
    /// # Errors
    /// [`DataError::Empty`] when no document was pushed; [`DataError::OutputExists`] when the
    /// output appeared meanwhile; [`DataError::Write`].
    pub fn finish(mut self, inputs: &str) -> Result<ShardManifest, DataError> {
        self.close_shard()?;
        if self.shards.is_empty() {
            return Err(DataError::Empty {
                what: inputs.to_string(),
            });
        }
        let manifest = ShardManifest {
            format: FORMAT.into(),
            format_version: FORMAT_VERSION,
            tokenizer_sha256: self.info.sha256.clone(),
            vocab_size: self.info.vocab_size,
            eos_id: self.info.eos_id,
            dtype: self.dtype,
            tokens: self.shards.iter().map(|s| s.tokens).sum(),
            documents: self.shards.iter().map(|s| s.documents).sum(),
            shards: self.shards.clone(),
        };
        let text = serde_json::to_vec_pretty(&manifest)
            .map_err(|e| DataError::invalid(&self.tmp, format!("manifest: {e}")))?;
        write_synced(&self.tmp.join(MANIFEST), &text)?;
        sync_dir(&self.tmp)?;
        if self.out.symlink_metadata().is_ok() {
            return Err(DataError::OutputExists {
                path: self.out.clone(),
            });
        }
        std::fs::rename(&self.tmp, &self.out).map_err(DataError::write(&self.out))?;
        self.finished = true;
        if let Some(parent) = self.out.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
        Ok(manifest)
    }
}

impl Drop for ShardWriter {
    /// An unfinished writer removes its temporary directory (best effort: a crash leaves it,
    /// under a name no reader opens).
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Writes `bytes` to `path` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let mut f = File::create(path).map_err(DataError::write(path))?;
    f.write_all(bytes).map_err(DataError::write(path))?;
    f.sync_all().map_err(DataError::write(path))
}

/// Fsyncs the directory `path` (a rename in it is durable after this).
fn sync_dir(path: &Path) -> Result<(), DataError> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(DataError::write(path))
}
