//! `dataset_type=shards`: a directory `ferrotext tokenize` wrote, read memory-mapped.
//!
//! Invariants: the directory is verified when the run opens it (`ShardSet::open`: sizes,
//! indexes, checksums) and its tokenizer's vocabulary must fit the model's; training reads the
//! shards not held out, evaluation the held-out ones (whole shards: `eval_shards`, else the last
//! `⌈eval_split × shards⌉`), so no token is in both. Sequence `index` is a pure function of the
//! directory's content, the order, the seed and the index (`ferrotext_data::order`), which is
//! what makes a resume exact; the checkpoint records the directory's [`fingerprint`].

use std::path::Path;
use std::sync::Arc;

use ferrotext_data::{check_vocab, permute, DataError, ShardSet, TokenStream};

use super::TokenSource;
use crate::config::{DatasetOrder, TrainConfig};
use crate::error::TrainError;

/// The shard directory `dataset_path` names, verified, its vocabulary checked against the
/// model's `vocab` and (when `tokenizer_path` is set) its tokenizer against that file.
pub(super) fn open(config: &TrainConfig, vocab: usize) -> Result<Arc<ShardSet>, TrainError> {
    let dir = Path::new(&config.dataset_path);
    let set = ShardSet::open(dir)?;
    let m = set.manifest();
    check_vocab(dir, m.vocab_size, vocab)?;
    if !config.tokenizer_path.is_empty() {
        let path = Path::new(&config.tokenizer_path);
        let bytes = ferrotext_files::read_regular(path).map_err(DataError::read(path))?;
        let sha = ferrotext_data::format::sha256_hex(&bytes);
        if sha != m.tokenizer_sha256 {
            return Err(DataError::Manifest {
                path: dir.join(ferrotext_data::format::MANIFEST),
                field: "tokenizer_sha256".into(),
                expected: format!("{sha} (tokenizer_path {})", path.display()),
                found: m.tokenizer_sha256.clone(),
            }
            .into());
        }
    }
    Ok(Arc::new(set))
}

/// SHA-256 (hex) of the `manifest.json` of the shard directory a `shards` config reads (`None`
/// for other data): it names the directory's whole content, since the manifest holds every
/// shard's checksum and the run verified the shards against it.
///
/// # Errors
/// [`TrainError::Data`] for a manifest that cannot be read.
pub fn fingerprint(config: &TrainConfig) -> Result<Option<String>, TrainError> {
    if config.dataset_type != crate::config::DatasetType::Shards {
        return Ok(None);
    }
    let path = Path::new(&config.dataset_path).join(ferrotext_data::format::MANIFEST);
    let bytes = ferrotext_files::read_regular(&path).map_err(DataError::read(&path))?;
    Ok(Some(ferrotext_data::format::sha256_hex(&bytes)))
}

/// The shards held out for evaluation, in order: `eval_shards` (a comma list of shard numbers),
/// else the last `⌈eval_split × shards⌉`, else none.
///
/// # Errors
/// [`TrainError::Usage`] for a list that does not parse, names a shard the directory lacks or
/// twice, or holds out every shard.
pub fn eval_shard_list(config: &TrainConfig, shards: usize) -> Result<Vec<usize>, TrainError> {
    let list: Vec<usize> = if !config.eval_shards.trim().is_empty() {
        let mut list = Vec::new();
        for item in config.eval_shards.split(',') {
            let n: usize = item.trim().parse().map_err(|_| {
                TrainError::usage(
                    "eval_shards",
                    format!(
                        "eval_shards = `{}`: `{}` is not a shard number (a comma list such as 3,4)",
                        config.eval_shards,
                        item.trim()
                    ),
                )
            })?;
            if n >= shards || list.contains(&n) {
                return Err(TrainError::usage(
                    "eval_shards",
                    format!(
                        "eval_shards = `{}`: shard {n} is {} (the directory has shards 0..{shards})",
                        config.eval_shards,
                        if n >= shards { "not there" } else { "named twice" }
                    ),
                ));
            }
            list.push(n);
        }
        list.sort_unstable();
        list
    } else if config.eval_split > 0.0 {
        let k = ((config.eval_split * shards as f64).ceil() as usize).max(1);
        (shards.saturating_sub(k)..shards).collect()
    } else {
        Vec::new()
    };
    if !list.is_empty() && list.len() >= shards {
        let key = if config.eval_shards.trim().is_empty() {
            "eval_split"
        } else {
            "eval_shards"
        };
        return Err(TrainError::usage(
            key,
            format!(
                "{key} holds out {} of the {shards} shards of {}, leaving none for training: \
                 tokenize into more shards (--shard-tokens) or set eval_dataset_path",
                list.len(),
                config.dataset_path
            ),
        ));
    }
    Ok(list)
}

/// `eval_shards` as written: a string (`"3,4"`), one number (`eval_shards=3` parses as an
/// integer) or an array of numbers, kept as the comma list [`eval_shard_list`] reads.
pub(crate) fn shard_list_from_any<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<String, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Any {
        Text(String),
        One(u64),
        Many(Vec<u64>),
    }
    let any: Any = serde::Deserialize::deserialize(d)
        .map_err(|_| serde::de::Error::custom("expected shard numbers: \"3,4\", 3 or [3, 4]"))?;
    Ok(match any {
        Any::Text(s) => s,
        Any::One(n) => n.to_string(),
        Any::Many(ns) => ns.iter().map(u64::to_string).collect::<Vec<_>>().join(","),
    })
}

/// Non-overlapping windows of some shards read as one stream: in order, or by a seeded
/// permutation of the windows, a new one each epoch (module docs of `ferrotext_data::order`).
pub struct ShardWindows {
    stream: TokenStream,
    order: DatasetOrder,
    seed: u64,
    vocab: usize,
}

impl ShardWindows {
    /// The training shards (every shard not held out), in the config's order.
    pub(super) fn train(
        set: Arc<ShardSet>,
        config: &TrainConfig,
        vocab: usize,
    ) -> Result<Self, TrainError> {
        let held = eval_shard_list(config, set.len())?;
        let parts = (0..set.len()).filter(|p| !held.contains(p)).collect();
        let order = config.dataset_order;
        ShardWindows::of(set, parts, config, vocab, order, "the training shards")
    }

    /// The held-out shards, in order.
    pub(super) fn eval(
        set: Arc<ShardSet>,
        config: &TrainConfig,
        vocab: usize,
    ) -> Result<Self, TrainError> {
        let held = eval_shard_list(config, set.len())?;
        let order = DatasetOrder::Sequential;
        ShardWindows::of(set, held, config, vocab, order, "the held-out shards")
    }

    /// Every shard, in order (a separate evaluation directory).
    pub(super) fn all_in_order(
        set: Arc<ShardSet>,
        config: &TrainConfig,
        vocab: usize,
    ) -> Result<Self, TrainError> {
        let parts = (0..set.len()).collect();
        let order = DatasetOrder::Sequential;
        ShardWindows::of(set, parts, config, vocab, order, "the shards")
    }

    /// Shards `parts` of `set` in `order`, at least one sequence long.
    fn of(
        set: Arc<ShardSet>,
        parts: Vec<usize>,
        config: &TrainConfig,
        vocab: usize,
        order: DatasetOrder,
        what: &str,
    ) -> Result<Self, TrainError> {
        let dir = set.dir().display().to_string();
        let stream = TokenStream::new(set, parts)?;
        let need = config.max_target_length as u64 + 1;
        if stream.len() < need {
            return Err(DataError::TooShort {
                what: format!("{what} of {dir} ({:?})", stream.parts()),
                tokens: stream.len(),
                need: format!("a sequence needs {need}"),
            }
            .into());
        }
        Ok(ShardWindows {
            stream,
            order,
            seed: config.data_shuffle_seed,
            vocab,
        })
    }

    /// Whole windows of `len` tokens an epoch (at least 1: the constructors check the length).
    fn windows(&self, len: usize) -> u64 {
        (self.stream.len() / len.max(1) as u64).max(1)
    }

    /// The window sequence `index` of length `len` reads.
    pub fn window(&self, index: u64, len: usize) -> u64 {
        let windows = self.windows(len);
        let (epoch, at) = (index / windows, index % windows);
        match self.order {
            DatasetOrder::Sequential => at,
            DatasetOrder::Random => permute(at, windows, epoch_key(self.seed, epoch)),
        }
    }
}

/// The permutation key of `epoch` under `seed`.
fn epoch_key(seed: u64, epoch: u64) -> u64 {
    seed.rotate_left(17) ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl TokenSource for ShardWindows {
    fn sequence(&self, index: u64, len: usize) -> Vec<u32> {
        self.stream.read(self.window(index, len) * len as u64, len)
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn contiguous_micro_batches(&self) -> bool {
        self.order == DatasetOrder::Sequential
    }
    fn epoch(&self, index: u64, len: usize) -> Option<u64> {
        Some(index / self.windows(len))
    }
    fn eos(&self) -> Option<u32> {
        Some(self.stream.set().manifest().eos_id)
    }
}
