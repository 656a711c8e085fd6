/*!
Token shards: a corpus of jsonl / parquet / text files tokenized into a directory of shards, and
that directory read back memory-mapped as a stream of tokens.

This layer knows files, tokenizers and token ids; it knows nothing of models, meshes or the
training loop (`train` builds its token sources on it; the `ferrotext tokenize` command drives
[`tokenize`]).

Brief overview:
* [`tokenize`] with [`TokenizeOptions`]: inputs ([`input`]: paths or globs, a text field) →
  batches encoded in parallel by the `tokenizers` crate → [`ShardWriter`], which publishes the
  directory atomically.
* [`ShardSet::open`]: a directory verified (sizes, indexes, checksums) and mapped;
  [`TokenStream`]: some of its shards as one stream; [`Sequences`]: that stream cut into
  windows, in order or shuffled by a seed ([`Order`]).
* [`DataError`]: every failure, naming the path, the shard, the field, the expected and found
  values.

The key decision: a sequence is a pure function of the directory's content (its
[`ShardSet::fingerprint`]), the order, the seed and the sequence's index, so a resumed run reads
exactly what the uninterrupted run reads, and a checkpoint can refuse data that changed.

```
use std::sync::Arc;
# fn main() -> Result<(), ferrotext_data::DataError> {
# let dir = std::env::temp_dir().join(format!("ferrotext-data-doc-{}", std::process::id()));
# let info = ferrotext_data::TokenizerInfo { sha256: "0".repeat(64), vocab_size: 10, eos_id: 0 };
let mut w = ferrotext_data::ShardWriter::create(&dir, info, 1 << 20)?;
w.push_document(&[5, 6, 7])?;
w.push_document(&[8])?;
w.finish("doc")?;
let set = Arc::new(ferrotext_data::ShardSet::open(&dir)?);
let stream = ferrotext_data::TokenStream::all(set);
assert_eq!(stream.read(0, 6), vec![5, 6, 7, 0, 8, 0]);
# std::fs::remove_dir_all(&dir).ok();
# Ok(())
# }
```
*/

mod error;
pub mod format;
pub mod input;
mod order;
mod read;
mod tokenize;
mod write;

pub use error::DataError;
pub use format::{ShardEntry, ShardManifest, TokenWidth};
pub use order::{permute, Order, Sequences};
pub use read::{ShardSet, TokenStream};
pub use tokenize::{
    check_vocab, eos_id, load_tokenizer, tokenize, LoadedTokenizer, Progress, TokenizeOptions,
};
pub use write::{ShardWriter, TokenizerInfo};
