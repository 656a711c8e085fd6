//! [`ShardSet`]: a shard directory opened, verified and memory-mapped; [`TokenStream`]: some of
//! its shards read as one stream of tokens.
//!
//! Invariants: [`ShardSet::open`] checks everything [`crate::format`] promises before it
//! returns (sizes, then each index against its shard, then every checksum), so a set that opens
//! reads exactly the tokens `tokenize` wrote; its [`ShardSet::fingerprint`] (the SHA-256 of the
//! manifest, which holds every shard's checksum) names that content. The shards are mapped, not
//! read: they must not be rewritten while a run reads them (a shard truncated under a running
//! process faults it, as with any mapped file; `tokenize` never rewrites a published directory).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::DataError;
use crate::format::{
    is_plain_name, sha256_hex, ShardManifest, TokenWidth, FORMAT, FORMAT_VERSION, MANIFEST,
};
use ferrotext_files::{open_regular, read_regular};

/// One mapped shard.
struct Mapped {
    /// `None` for a shard of no bytes (which cannot be mapped; `tokenize` writes none).
    map: Option<Mmap>,
    tokens: u64,
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// A verified, memory-mapped shard directory.
pub struct ShardSet {
    dir: PathBuf,
    manifest: ShardManifest,
    fingerprint: String,
    shards: Vec<Mapped>,
}

impl std::fmt::Debug for ShardSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardSet")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tokens", &self.manifest.tokens)
            .finish()
    }
}

impl ShardSet {
    /// Opens the shard directory `dir` and verifies it (module docs).
    ///
    /// # Errors
    /// [`DataError::Read`] for a missing or unreadable manifest, [`DataError::Parse`] for one
    /// that is not a manifest, [`DataError::Manifest`] for a wrong field,
    /// [`DataError::MissingShard`], [`DataError::Truncated`], [`DataError::IndexMismatch`],
    /// [`DataError::Checksum`].
    pub fn open(dir: &Path) -> Result<ShardSet, DataError> {
        let path = dir.join(MANIFEST);
        let text = read_regular(&path).map_err(DataError::read(&path))?;
        let fingerprint = sha256_hex(&text);
        let manifest: ShardManifest =
            serde_json::from_slice(&text).map_err(|e| DataError::Parse {
                path: path.clone(),
                line: None,
                reason: format!("not a shard manifest: {e}"),
            })?;
        check_manifest(&path, &manifest)?;
        let mut shards = Vec::with_capacity(manifest.shards.len());
        for entry in &manifest.shards {
            let file_path = dir.join(&entry.file);
            let file = open_regular(&file_path).map_err(|source| DataError::MissingShard {
                dir: dir.to_path_buf(),
                shard: entry.file.clone(),
                source,
            })?;
            let size = file.metadata().map_err(DataError::read(&file_path))?.len();
            let expected = entry.tokens * manifest.dtype.width() as u64;
            if size != expected {
                return Err(DataError::Truncated {
                    path: file_path,
                    expected,
                    found: size,
                });
            }
            let map = if size == 0 {
                None
            } else {
                // SAFETY: the file is a regular file opened read-only; shard directories are
                // immutable once published (module docs), and the map is only read as bytes.
                Some(unsafe { Mmap::map(&file) }.map_err(DataError::read(&file_path))?)
            };
            let mapped = Mapped {
                map,
                tokens: entry.tokens,
            };
            check_index(dir, entry, &manifest, mapped.bytes())?;
            let found = sha256_hex(mapped.bytes());
            if found != entry.sha256 {
                return Err(DataError::Checksum {
                    path: file_path,
                    expected: entry.sha256.clone(),
                    found,
                });
            }
            shards.push(mapped);
        }
        Ok(ShardSet {
            dir: dir.to_path_buf(),
            manifest,
            fingerprint,
            shards,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The manifest.
    pub fn manifest(&self) -> &ShardManifest {
        &self.manifest
    }

    /// SHA-256 (hex) of `manifest.json`: names the directory's whole content (every shard's
    /// checksum is in it).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The number of shards.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// True for a directory of no shard (never, for one that opened: `tokenize` writes at least
    /// one).
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// Token `i` of shard `shard` (in range: callers index within [`TokenStream`]).
    fn token(&self, shard: usize, i: u64) -> u32 {
        let b = self.shards[shard].bytes();
        let i = i as usize;
        match self.manifest.dtype {
            TokenWidth::U16 => u32::from(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
            TokenWidth::U32 => {
                u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
            }
        }
    }
}

/// The manifest's own fields: format, version, names, the dtype against the vocabulary, the
/// totals against the shards.
fn check_manifest(path: &Path, m: &ShardManifest) -> Result<(), DataError> {
    let wrong = |field: &str, expected: String, found: String| DataError::Manifest {
        path: path.to_path_buf(),
        field: field.into(),
        expected,
        found,
    };
    if m.format != FORMAT {
        return Err(wrong(
            "format",
            format!("`{FORMAT}`"),
            format!("`{}`", m.format),
        ));
    }
    if m.format_version != FORMAT_VERSION {
        return Err(wrong(
            "format_version",
            FORMAT_VERSION.to_string(),
            m.format_version.to_string(),
        ));
    }
    if m.dtype == TokenWidth::U16 && m.vocab_size > 1 << 16 {
        return Err(wrong(
            "dtype",
            format!("u32 for vocab_size {}", m.vocab_size),
            "u16".into(),
        ));
    }
    if u64::from(m.eos_id) >= m.vocab_size as u64 {
        return Err(wrong(
            "eos_id",
            format!("below vocab_size {}", m.vocab_size),
            m.eos_id.to_string(),
        ));
    }
    if m.shards.is_empty() {
        return Err(wrong("shards", "at least one shard".into(), "none".into()));
    }
    for s in &m.shards {
        for name in [&s.file, &s.index] {
            if !is_plain_name(name) {
                return Err(wrong(
                    "shards",
                    "file names inside the directory".into(),
                    format!("`{name}`"),
                ));
            }
        }
    }
    let tokens: u64 = m.shards.iter().map(|s| s.tokens).sum();
    if tokens != m.tokens {
        return Err(wrong(
            "tokens",
            format!("{tokens} (the sum of its shards')"),
            m.tokens.to_string(),
        ));
    }
    let documents: u64 = m.shards.iter().map(|s| s.documents).sum();
    if documents != m.documents {
        return Err(wrong(
            "documents",
            format!("{documents} (the sum of its shards')"),
            m.documents.to_string(),
        ));
    }
    Ok(())
}

/// Shard `entry`'s index against its bytes: its size, rising offsets from 0 to the shard's
/// tokens, every document ending in EOS, then its checksum.
fn check_index(
    dir: &Path,
    entry: &crate::format::ShardEntry,
    m: &ShardManifest,
    shard: &[u8],
) -> Result<(), DataError> {
    let path = dir.join(&entry.index);
    let bytes = match read_regular(&path) {
        Ok(b) => b,
        Err(source) => {
            return Err(DataError::MissingShard {
                dir: dir.to_path_buf(),
                shard: entry.index.clone(),
                source,
            })
        }
    };
    let expected = (entry.documents + 1) * 8;
    if bytes.len() as u64 != expected {
        return Err(DataError::Truncated {
            path,
            expected,
            found: bytes.len() as u64,
        });
    }
    let mismatch = |reason: String| DataError::IndexMismatch {
        path: path.clone(),
        reason,
    };
    let offsets: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect();
    let (first, last) = (offsets[0], offsets[offsets.len() - 1]);
    if first != 0 || last != entry.tokens {
        return Err(mismatch(format!(
            "its offsets run from {first} to {last}, expected 0 to the shard's {} tokens",
            entry.tokens
        )));
    }
    let width = m.dtype.width();
    for (doc, w) in offsets.windows(2).enumerate() {
        if w[1] <= w[0] {
            return Err(mismatch(format!(
                "document {doc} runs from token {} to {}: offsets must rise",
                w[0], w[1]
            )));
        }
        let at = (w[1] - 1) as usize * width;
        let id = match m.dtype {
            TokenWidth::U16 => u32::from(u16::from_le_bytes([shard[at], shard[at + 1]])),
            TokenWidth::U32 => {
                u32::from_le_bytes([shard[at], shard[at + 1], shard[at + 2], shard[at + 3]])
            }
        };
        if id != m.eos_id {
            return Err(mismatch(format!(
                "document {doc} ends at token {} with id {id}, not EOS {}",
                w[1] - 1,
                m.eos_id
            )));
        }
    }
    let found = sha256_hex(&bytes);
    if found != entry.index_sha256 {
        return Err(DataError::Checksum {
            path,
            expected: entry.index_sha256.clone(),
            found,
        });
    }
    Ok(())
}

/// Some shards of a [`ShardSet`], in a given order, read as one stream of tokens.
#[derive(Clone, Debug)]
pub struct TokenStream {
    set: Arc<ShardSet>,
    parts: Vec<usize>,
    /// Stream offset of each part's first token, then the total.
    starts: Vec<u64>,
}

impl TokenStream {
    /// Shards `parts` of `set`, in that order.
    ///
    /// # Errors
    /// [`DataError::Invalid`] for a shard number the set does not have.
    pub fn new(set: Arc<ShardSet>, parts: Vec<usize>) -> Result<TokenStream, DataError> {
        if let Some(&p) = parts.iter().find(|&&p| p >= set.len()) {
            return Err(DataError::invalid(
                set.dir(),
                format!("has shards 0..{}, not shard {p}", set.len()),
            ));
        }
        Ok(TokenStream::of_valid(set, parts))
    }

    /// Every shard of `set`, in order.
    pub fn all(set: Arc<ShardSet>) -> TokenStream {
        let parts = (0..set.len()).collect();
        TokenStream::of_valid(set, parts)
    }

    /// The stream of `parts`, each one of `set`'s shards.
    fn of_valid(set: Arc<ShardSet>, parts: Vec<usize>) -> TokenStream {
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut total = 0u64;
        for &p in &parts {
            starts.push(total);
            total += set.shards[p].tokens;
        }
        starts.push(total);
        TokenStream { set, parts, starts }
    }

    /// Tokens in the stream.
    pub fn len(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// True for a stream of no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shards read, in order.
    pub fn parts(&self) -> &[usize] {
        &self.parts
    }

    /// The set read.
    pub fn set(&self) -> &Arc<ShardSet> {
        &self.set
    }

    /// Tokens `start .. start + len` of the stream, across shard boundaries; a range past the
    /// end is cut there.
    pub fn read(&self, start: u64, len: usize) -> Vec<u32> {
        let end = (start + len as u64).min(self.len());
        let mut out = Vec::with_capacity(len);
        let mut at = start;
        // The part holding `start`: the last whose first token is at or before it.
        let mut part = self
            .starts
            .partition_point(|&s| s <= start)
            .saturating_sub(1);
        while at < end && part < self.parts.len() {
            let shard_end = self.starts[part + 1];
            let shard = self.parts[part];
            let from = at - self.starts[part];
            let to = end.min(shard_end) - self.starts[part];
            out.extend((from..to).map(|i| self.set.token(shard, i)));
            at = end.min(shard_end);
            part += 1;
        }
        out
    }
}
