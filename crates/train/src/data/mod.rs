//! Token sources and the batch layout.
//!
//! Every source is a deterministic function from a sequence index to `max_target_length + 1`
//! tokens, so step `s` of a run always sees the same sequences (resume loses or repeats nothing)
//! and every device can compute the global batch and keep its block. The global batch of step `s`
//! holds sequences `s·R .. (s+1)·R` (R = micro-batch rows × G); a micro-batch's rows are split
//! over the batch mesh axes in order, so each device holds a contiguous block of them.
//!
//! Which sequences form micro-batch `i`:
//! * `dataset_order=random` (windows at seeded random offsets, and the synthetic data):
//!   **strided, like MaxText** — micro-batch `i` takes rows `i, i+G, i+2G, ...` of the step, so
//!   each device's rows of the whole step are one contiguous block of the global batch;
//! * `dataset_order=sequential` (consecutive, non-overlapping windows in file order):
//!   **contiguous** — micro-batch `i` takes rows `i·r .. (i+1)·r` (r rows per micro-batch), so a
//!   file laid out `[step][micro-batch][row][max_target_length + 1]` is read exactly as written
//!   (the layout PyTorch DDP loaders and the torch peer use), each device reading a contiguous
//!   block of every micro-batch. The window index wraps at the end of the file; each wrap is one
//!   epoch.
//!
//! * `dataset_type=shards` (a directory `ferrotext tokenize` wrote, `shards.rs`): the training
//!   shards read as one stream cut into non-overlapping windows, in order (`sequential`, micro-
//!   batches contiguous) or by a seeded permutation of the windows, a new one each epoch
//!   (`random`, strided); held-out data is whole shards (`eval_split`, `eval_shards`).
//!
//! Text and token files are read into memory (not mapped), so a file truncated or rewritten
//! while a run reads it cannot fault the process; only regular files are accepted (a FIFO or
//! `/dev/zero` would block or read without bound). Shard directories are mapped: they are
//! verified against their manifest's checksums when the run opens them, and are never rewritten
//! (`ferrotext tokenize` publishes a new directory); a checkpoint records their
//! [`fingerprint`] and a resume refuses data that changed.

use std::path::Path;

use ferrotext_data::DataError;
use ferrotext_models::Rng;

use crate::config::{DatasetOrder, DatasetType, TrainConfig};
use crate::error::TrainError;

mod shards;
#[cfg(feature = "fault-injection")]
mod tap;

pub(crate) use shards::shard_list_from_any;
pub use shards::{eval_shard_list, fingerprint, ShardWindows};

/// A deterministic source of token sequences.
pub trait TokenSource: Send + Sync {
    /// Sequence `index`, `len` tokens long.
    fn sequence(&self, index: u64, len: usize) -> Vec<u32>;
    /// Largest token id + 1.
    fn vocab_size(&self) -> usize;
    /// Whether micro-batches take contiguous runs of sequence indices (sequential reading)
    /// rather than strided ones (see the module docs).
    fn contiguous_micro_batches(&self) -> bool {
        false
    }
    /// The epoch sequence `index` belongs to, for sources that wrap around their data in order.
    fn epoch(&self, _index: u64, _len: usize) -> Option<u64> {
        None
    }
    /// The id that ends every document, for sources whose documents are delimited (token
    /// shards): what `packing=true` finds the document boundaries by. `None`: no boundaries.
    fn eos(&self) -> Option<u32> {
        None
    }
}

/// Arithmetic sequences `start + stride·i mod vocab` with 10% noise (the JAX peer's data).
pub struct Synthetic {
    seed: u64,
    vocab: usize,
}

impl TokenSource for Synthetic {
    fn sequence(&self, index: u64, len: usize) -> Vec<u32> {
        let mut rng = Rng::new(self.seed, index);
        let v = self.vocab as u64;
        let start = rng.below(v);
        let stride = 1 + rng.below(v.min(16) - 1);
        (0..len as u64)
            .map(|i| {
                if rng.uniform() < 0.1 {
                    rng.below(v) as u32
                } else {
                    ((start + stride * i) % v) as u32
                }
            })
            .collect()
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
}

/// Windows of a token stream (text bytes or a token file): at pseudo-random offsets, or
/// consecutive and non-overlapping in file order.
pub struct Windows {
    seed: u64,
    data: Vec<u8>,
    width: usize,
    vocab: usize,
    order: DatasetOrder,
}

impl Windows {
    fn token(&self, i: usize) -> u32 {
        let b = &self.data;
        match self.width {
            1 => b[i] as u32,
            2 => u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32,
            _ => u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
        }
    }
    fn len(&self) -> usize {
        self.data.len() / self.width
    }
    /// Whole windows of `len` tokens in the data (at least 1: sources check the length).
    fn windows(&self, len: usize) -> u64 {
        (self.len() / len.max(1)).max(1) as u64
    }
}

impl TokenSource for Windows {
    fn sequence(&self, index: u64, len: usize) -> Vec<u32> {
        let start = match self.order {
            DatasetOrder::Random => {
                let mut rng = Rng::new(self.seed, index);
                rng.below((self.len() - len + 1) as u64) as usize
            }
            DatasetOrder::Sequential => (index % self.windows(len)) as usize * len,
        };
        (start..start + len).map(|i| self.token(i)).collect()
    }
    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn contiguous_micro_batches(&self) -> bool {
        self.order == DatasetOrder::Sequential
    }
    fn epoch(&self, index: u64, len: usize) -> Option<u64> {
        (self.order == DatasetOrder::Sequential).then(|| index / self.windows(len))
    }
}

/// The bundled corpus: about 400 KB of English-like sentences from a small grammar, generated
/// deterministically (no download). Word order, agreement and punctuation give a small model
/// structure it visibly learns.
pub fn bundled_corpus() -> String {
    const SUBJECTS: &[&str] = &[
        "the cat",
        "a dog",
        "the old man",
        "my sister",
        "the small bird",
        "a farmer",
        "the teacher",
        "our neighbour",
        "the red fox",
        "a child",
    ];
    const VERBS: &[&str] = &[
        "sees", "likes", "follows", "feeds", "paints", "finds", "watches", "helps", "calls",
        "visits",
    ];
    const OBJECTS: &[&str] = &[
        "the garden",
        "a river",
        "the blue house",
        "some bread",
        "the market",
        "a letter",
        "the quiet road",
        "the moon",
        "an apple",
        "the school",
    ];
    const TIMES: &[&str] = &[
        "every morning",
        "at night",
        "on sunday",
        "after lunch",
        "in winter",
        "before dawn",
    ];
    const NUMBERS: &[&str] = &[
        "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    ];
    let mut rng = Rng::new(7, 7);
    let mut out = String::with_capacity(420_000);
    while out.len() < 400_000 {
        let pick = |rng: &mut Rng, xs: &[&'static str]| xs[rng.below(xs.len() as u64) as usize];
        match rng.below(4) {
            0 => {
                let n = rng.below(6) as usize;
                out.push_str("count: ");
                out.push_str(&NUMBERS[n..n + 4].join(" "));
                out.push_str(".\n");
            }
            _ => {
                let s = pick(&mut rng, SUBJECTS);
                let v = pick(&mut rng, VERBS);
                let o = pick(&mut rng, OBJECTS);
                let t = pick(&mut rng, TIMES);
                out.push_str(&format!("{s} {v} {o} {t}.\n"));
            }
        }
    }
    out
}

/// The token source a config asks for.
///
/// # Errors
/// [`TrainError::Data`] for a missing, empty or too-short file, a token file whose length is not
/// a whole number of tokens, or token ids beyond the model's vocabulary.
pub fn source_for(config: &TrainConfig, vocab: usize) -> Result<Box<dyn TokenSource>, TrainError> {
    let source: Box<dyn TokenSource> = match build(config, vocab)? {
        Built::Synthetic(s) => Box::new(s),
        Built::Windows(w) if config.eval_split > 0.0 => Box::new(w.held_out(config, Part::Train)?),
        Built::Windows(w) => Box::new(w),
        Built::Shards(set) => Box::new(ShardWindows::train(set, config, vocab)?),
    };
    #[cfg(feature = "fault-injection")]
    let source = tap::wrap(source)?;
    Ok(source)
}

/// The held-out source evaluation reads (`None` when `eval_interval` is 0): the
/// `eval_dataset_path` file, else the last `eval_split` of the training data, else (synthetic
/// data) a stream of its own. Held-out files and splits are read in order, window after window.
///
/// # Errors
/// As [`source_for`], and a split that leaves either part shorter than one sequence.
pub fn eval_source_for(
    config: &TrainConfig,
    vocab: usize,
) -> Result<Option<Box<dyn TokenSource>>, TrainError> {
    if config.eval_interval == 0 {
        return Ok(None);
    }
    if !config.eval_dataset_path.is_empty() {
        let mut eval = config.clone();
        eval.dataset_path = config.eval_dataset_path.clone();
        if eval.dataset_type == DatasetType::Corpus {
            eval.dataset_type = DatasetType::Text;
        }
        eval.eval_split = 0.0;
        eval.eval_shards = String::new();
        eval.dataset_order = DatasetOrder::Sequential;
        return match build(&eval, vocab)? {
            Built::Shards(set) => Ok(Some(Box::new(ShardWindows::all_in_order(
                set, &eval, vocab,
            )?))),
            _ => source_for(&eval, vocab).map(Some),
        };
    }
    Ok(Some(match build(config, vocab)? {
        Built::Synthetic(s) => Box::new(Synthetic {
            seed: s.seed ^ EVAL_STREAM,
            vocab,
        }),
        Built::Windows(w) => Box::new(w.held_out(config, Part::Eval)?),
        Built::Shards(set) => Box::new(ShardWindows::eval(set, config, vocab)?),
    }))
}

/// The seed offset of synthetic data's evaluation stream.
const EVAL_STREAM: u64 = 0xE7A1_0000_0000_0001;

/// A source before any split.
enum Built {
    Synthetic(Synthetic),
    Windows(Windows),
    Shards(std::sync::Arc<ferrotext_data::ShardSet>),
}

/// Which side of `eval_split` a source reads.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    Train,
    Eval,
}

impl Windows {
    /// The first `1 − eval_split` of the tokens (training) or the rest (evaluation, read in
    /// order); the cut is at a token boundary.
    fn held_out(mut self, config: &TrainConfig, part: Part) -> Result<Windows, TrainError> {
        let need = config.max_target_length + 1;
        let total = self.len();
        let cut = ((total as f64) * (1.0 - config.eval_split)).floor() as usize;
        let (kept, what) = match part {
            Part::Train => (cut, "training"),
            Part::Eval => (total - cut, "evaluation"),
        };
        if kept < need {
            return Err(DataError::TooShort {
                what: format!("the {what} part of eval_split = {}", config.eval_split),
                tokens: kept as u64,
                need: format!("a sequence needs {need}"),
            }
            .into());
        }
        let bytes = cut * self.width;
        self.data = match part {
            Part::Train => self.data[..bytes].to_vec(),
            Part::Eval => self.data[bytes..].to_vec(),
        };
        if part == Part::Eval {
            self.order = DatasetOrder::Sequential;
        }
        Ok(self)
    }
}

/// The source before any split: the one place that reads the data a config names.
fn build(config: &TrainConfig, vocab: usize) -> Result<Built, TrainError> {
    let seed = config.data_shuffle_seed;
    let order = config.dataset_order;
    let need = config.max_target_length + 1;
    let open = |path: &str| -> Result<Vec<u8>, TrainError> {
        ferrotext_files::read_regular(Path::new(path))
            .map_err(|e| DataError::read(Path::new(path))(e).into())
    };
    let check_len = |tokens: usize, what: &str| -> Result<(), TrainError> {
        if tokens < need {
            return Err(DataError::TooShort {
                what: what.to_string(),
                tokens: tokens as u64,
                need: format!("a sequence needs {need}"),
            }
            .into());
        }
        Ok(())
    };
    if !config.tokenizer_path.is_empty()
        && matches!(config.dataset_type, DatasetType::Corpus | DatasetType::Text)
    {
        let text = match config.dataset_type {
            DatasetType::Text => {
                String::from_utf8(open(&config.dataset_path)?).map_err(|e| DataError::Parse {
                    path: config.dataset_path.clone().into(),
                    line: None,
                    reason: format!("not UTF-8 text: {e}"),
                })?
            }
            _ => bundled_corpus(),
        };
        let ids = tokenize(&config.tokenizer_path, &text, vocab)?;
        check_len(ids.len(), "the tokenized text")?;
        let data: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        return Ok(Built::Windows(Windows {
            seed,
            data,
            width: 4,
            vocab,
            order,
        }));
    }
    Ok(match config.dataset_type {
        DatasetType::Synthetic => Built::Synthetic(Synthetic { seed, vocab }),
        DatasetType::Shards => Built::Shards(shards::open(config, vocab)?),
        DatasetType::Corpus => {
            let bytes = bundled_corpus().into_bytes();
            check_len(bytes.len(), "the bundled corpus")?;
            Built::Windows(Windows {
                seed,
                data: bytes,
                width: 1,
                vocab,
                order,
            })
        }
        DatasetType::Text => {
            let map = open(&config.dataset_path)?;
            check_len(map.len(), &config.dataset_path)?;
            Built::Windows(Windows {
                seed,
                data: map,
                width: 1,
                vocab,
                order,
            })
        }
        DatasetType::Tokens => {
            let map = open(&config.dataset_path)?;
            Built::Windows(token_windows(config, vocab, map, check_len)?)
        }
    })
}

/// The windows of a token file's bytes `data` (`dataset_type=tokens`): whole tokens of
/// `token_dtype`, each below `vocab`, at least one sequence of them (`check_len`).
fn token_windows(
    config: &TrainConfig,
    vocab: usize,
    data: Vec<u8>,
    check_len: impl Fn(usize, &str) -> Result<(), TrainError>,
) -> Result<Windows, TrainError> {
    let (seed, order) = (config.data_shuffle_seed, config.dataset_order);
    let width = config.token_dtype.width();
    if !data.len().is_multiple_of(width) {
        return Err(DataError::invalid(
            &config.dataset_path,
            format!(
                "has {} bytes, not a whole number of {} tokens",
                data.len(),
                config.token_dtype.name()
            ),
        )
        .into());
    }
    let w = Windows {
        seed,
        data,
        width,
        vocab,
        order,
    };
    check_len(w.len(), &config.dataset_path)?;
    if let Some(bad) = (0..w.len())
        .map(|i| w.token(i))
        .find(|&t| t as usize >= vocab)
    {
        return Err(DataError::TokenOutOfRange {
            path: config.dataset_path.clone().into(),
            id: u64::from(bad),
            vocab,
        }
        .into());
    }
    Ok(w)
}

/// `text` encoded with the HF tokenizer at `path` (the `tokenizers` crate: BPE, WordPiece,
/// Unigram, WordLevel, as the file says), as one document: with the tokenizer's own special
/// tokens, as `ferrotext tokenize` and transformers' `tokenizer(text)` encode a document.
///
/// # Errors
/// [`TrainError::Data`] for a file that is not a tokenizer, or ids beyond `vocab`.
pub fn tokenize(path: &str, text: &str, vocab: usize) -> Result<Vec<u32>, TrainError> {
    let file = Path::new(path);
    let bytes = ferrotext_files::read_regular(file).map_err(DataError::read(file))?;
    let tokenizer_err = |e: tokenizers::Error| DataError::Tokenizer {
        path: file.to_path_buf(),
        reason: e.to_string(),
    };
    let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(tokenizer_err)?;
    let encoding = tokenizer.encode(text, true).map_err(tokenizer_err)?;
    let ids = encoding.get_ids().to_vec();
    if ids.iter().any(|&t| t as usize >= vocab) {
        return Err(DataError::VocabTooLarge {
            path: file.to_path_buf(),
            tokenizer_vocab: tokenizer.get_vocab_size(true),
            model_vocab: vocab,
        }
        .into());
    }
    Ok(ids)
}

/// The rows of micro-batch `micro` of step `step`, each `len + 1` tokens, in micro-batch order.
pub fn micro_batch(
    source: &dyn TokenSource,
    step: u64,
    micro: usize,
    ga: usize,
    rows: usize,
    len: usize,
) -> Vec<Vec<u32>> {
    (0..rows)
        .map(|r| source.sequence(sequence_index(source, step, micro, r, ga, rows), len + 1))
        .collect()
}

/// Micro-batch `micro` of step `step` laid out in units (`layout_invariant=true`): row `r`
/// belongs to device `r / per_device`, whose micro-batch `micro` is unit `device × ga + micro`,
/// and unit `u` holds the step's sequences `u × per_device .. (u + 1) × per_device`. So a unit
/// reads the same sequences whatever the layout: data=4 × GA 1 and data=1 × GA 4 cut a step
/// into the same four units, and each device's micro-batches are consecutive units.
pub fn micro_batch_of_units(
    source: &dyn TokenSource,
    step: u64,
    micro: usize,
    ga: usize,
    rows: usize,
    per_device: usize,
    len: usize,
) -> Vec<Vec<u32>> {
    let per_device = per_device.max(1);
    (0..rows)
        .map(|r| {
            let unit = (r / per_device) * ga + micro;
            let in_step = unit * per_device + r % per_device;
            source.sequence(step * (rows * ga) as u64 + in_step as u64, len + 1)
        })
        .collect()
}

/// The sequence index of row `row` of micro-batch `micro` of step `step` (see the module docs:
/// strided, or contiguous for sequential sources).
pub fn sequence_index(
    source: &dyn TokenSource,
    step: u64,
    micro: usize,
    row: usize,
    ga: usize,
    rows: usize,
) -> u64 {
    let in_step = if source.contiguous_micro_batches() {
        micro * rows + row
    } else {
        row * ga + micro
    };
    step * (rows * ga) as u64 + in_step as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_deterministic_and_in_range() {
        let s = Synthetic {
            seed: 3,
            vocab: 100,
        };
        assert_eq!(s.sequence(5, 10), s.sequence(5, 10));
        assert_ne!(s.sequence(5, 10), s.sequence(6, 10));
        assert!(s.sequence(1, 50).iter().all(|&t| t < 100));
        let corpus = bundled_corpus();
        assert_eq!(corpus, bundled_corpus());
        assert!(corpus.len() >= 400_000 && corpus.is_ascii());
    }

    #[test]
    fn units_read_the_same_sequences_on_every_layout() {
        let s = Synthetic { seed: 0, vocab: 50 };
        // 8 sequences a step, 2 a device's micro-batch: data=4 × GA 1, data=2 × GA 2 and
        // data=1 × GA 4.
        let units = |data: usize, ga: usize| -> Vec<Vec<Vec<u32>>> {
            let mut by_unit = vec![Vec::new(); data * ga];
            for micro in 0..ga {
                let rows = micro_batch_of_units(&s, 3, micro, ga, data * 2, 2, 5);
                for (d, chunk) in rows.chunks(2).enumerate() {
                    by_unit[d * ga + micro] = chunk.to_vec();
                }
            }
            by_unit
        };
        let want = units(4, 1);
        assert_eq!(units(2, 2), want);
        assert_eq!(units(1, 4), want);
        // Unit u is the step's sequences 2u and 2u + 1.
        assert_eq!(
            want[3],
            vec![s.sequence(3 * 8 + 6, 6), s.sequence(3 * 8 + 7, 6)]
        );
    }

    #[test]
    fn micro_batches_are_strided() {
        let s = Synthetic { seed: 0, vocab: 50 };
        let (ga, rows) = (4, 3);
        let mb1 = micro_batch(&s, 2, 1, ga, rows, 5);
        // row r of micro-batch 1 is global row r·G + 1 of step 2
        for (r, row) in mb1.iter().enumerate() {
            assert_eq!(row, &s.sequence(2 * 12 + (r * ga + 1) as u64, 6));
        }
    }
}
