//! The on-disk format of a shard directory.
//!
//! ```text
//! DIR/manifest.json        what the directory holds (below); the last file written
//! DIR/shard_00000.bin      little-endian u16 or u32 token ids, each document followed by EOS
//! DIR/shard_00000.idx      little-endian u64 document offsets into the shard, in tokens:
//!                          documents + 1 entries, the first 0, the last the shard's tokens
//! ```
//!
//! Invariants (checked by [`crate::ShardSet::open`]): every shard listed exists with exactly
//! `tokens × width` bytes and the SHA-256 recorded; its index has `documents + 1` rising offsets
//! from 0 to `tokens`, each document ending in the EOS id; the manifest's totals are the sums of
//! its shards'. A directory is published by renaming a complete temporary one, so a directory
//! under the final name always reads.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// `manifest.json`'s `format` value.
pub const FORMAT: &str = "ferrotext-token-shards";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";

/// The id width of a shard directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenWidth {
    /// Two bytes a token (a vocabulary of at most 65 536).
    U16,
    /// Four bytes a token.
    U32,
}

impl TokenWidth {
    /// The narrowest width that holds every id of a `vocab`-token vocabulary.
    pub fn for_vocab(vocab: usize) -> TokenWidth {
        if vocab <= 1 << 16 {
            TokenWidth::U16
        } else {
            TokenWidth::U32
        }
    }

    /// Its name as the `token_dtype` key and the manifest write it (`u16`, `u32`).
    pub fn name(self) -> &'static str {
        match self {
            TokenWidth::U16 => "u16",
            TokenWidth::U32 => "u32",
        }
    }

    /// Bytes a token.
    pub fn width(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// One shard as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The token file (`shard_00000.bin`).
    pub file: String,
    /// The index file (`shard_00000.idx`).
    pub index: String,
    /// Tokens in the shard (EOS included).
    pub tokens: u64,
    /// Documents in the shard.
    pub documents: u64,
    /// SHA-256 (hex) of the token file.
    pub sha256: String,
    /// SHA-256 (hex) of the index file.
    pub index_sha256: String,
}

/// `manifest.json` of a shard directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardManifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`FORMAT_VERSION`].
    pub format_version: u32,
    /// SHA-256 (hex) of the `tokenizer.json` bytes that made the shards.
    pub tokenizer_sha256: String,
    /// The tokenizer's vocabulary, added tokens included (every id is below it).
    pub vocab_size: usize,
    /// The id that ends every document.
    pub eos_id: u32,
    /// The id width.
    pub dtype: TokenWidth,
    /// Tokens in all shards.
    pub tokens: u64,
    /// Documents in all shards.
    pub documents: u64,
    /// The shards, in corpus order.
    pub shards: Vec<ShardEntry>,
}

/// The file names of shard `i`.
pub fn shard_names(i: usize) -> (String, String) {
    (format!("shard_{i:05}.bin"), format!("shard_{i:05}.idx"))
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A name that stays inside its directory.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && !name.contains(['/', '\\'])
        && name != "."
        && name != ".."
        && !name.starts_with('.')
}
