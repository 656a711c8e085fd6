//! Tokenizing into shards and reading them back, against ids worked out by hand from the
//! word-level fixture tokenizer (`fixtures/wordlevel.json`: `<|endoftext|>` 0, `[UNK]` 1, then
//! `the` 2, `cat` 3, `dog` 4, `sees` 5, `a` 6, `bird` 7, `and` 8, `runs` 9, `.` 10, `red` 11,
//! `old` 12, `man` 13); and every bad input refused with nothing written.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_data::{
    tokenize, DataError, Order, Sequences, ShardSet, ShardWriter, TokenStream, TokenWidth,
    TokenizeOptions, TokenizerInfo,
};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wordlevel.json")
}

/// A test's scratch directory under cargo's per-target temporary directory, created empty and
/// removed on drop (also when the test fails).
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> Scratch {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ferrotext-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

fn options(inputs: Vec<String>, out: &Path) -> TokenizeOptions {
    TokenizeOptions {
        inputs,
        field: "text".into(),
        tokenizer: fixture(),
        output: out.to_path_buf(),
        eos: String::new(),
        special_tokens: true,
        shard_tokens: 1 << 20,
        batch_bytes: 16,
    }
}

/// A parquet file with one optional UTF-8 column `column` holding `rows` (snappy-compressed).
fn write_parquet(path: &Path, column: &str, rows: &[&str]) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = parquet::schema::parser::parse_message_type(&format!(
        "message doc {{ optional binary {column} (UTF8); required int32 id; }}"
    ))
    .unwrap();
    let props = WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let values: Vec<ByteArray> = rows.iter().map(|r| ByteArray::from(*r)).collect();
    let defs = vec![1i16; rows.len()];
    let mut col = group.next_column().unwrap().unwrap();
    col.typed::<ByteArrayType>()
        .write_batch(&values, Some(&defs), None)
        .unwrap();
    col.close().unwrap();
    let ids: Vec<i32> = (0..rows.len() as i32).collect();
    let mut col = group.next_column().unwrap().unwrap();
    col.typed::<parquet::data_type::Int32Type>()
        .write_batch(&ids, None, None)
        .unwrap();
    col.close().unwrap();
    group.close().unwrap();
    writer.close().unwrap();
}

#[test]
fn jsonl_parquet_and_text_become_the_ids_worked_out_by_hand() {
    let dir = scratch("roundtrip");
    std::fs::write(
        dir.join("a.jsonl"),
        "{\"text\": \"the cat sees a bird .\", \"id\": 1}\n\n{\"text\": \"a dog runs\"}\n",
    )
    .unwrap();
    write_parquet(
        &dir.join("b.parquet"),
        "text",
        &["the red man", "old dog and cat ."],
    );
    std::fs::write(dir.join("c.txt"), "the zebra runs").unwrap();
    let out = dir.join("shards");
    let mut opts = options(
        vec![
            dir.join("a.jsonl").display().to_string(),
            dir.join("*.parquet").display().to_string(),
            dir.join("c.txt").display().to_string(),
        ],
        &out,
    );
    opts.shard_tokens = 8; // close a shard after the document that reaches 8 tokens
    let mut last = ferrotext_data::Progress::default();
    let manifest = tokenize(&opts, &mut |p| last = p).unwrap();
    // Documents, each followed by EOS (0); `zebra` is unknown (1).
    let docs: Vec<Vec<u32>> = vec![
        vec![2, 3, 5, 6, 7, 10, 0],
        vec![6, 4, 9, 0],
        vec![2, 11, 13, 0],
        vec![12, 4, 8, 3, 10, 0],
        vec![2, 1, 9, 0],
    ];
    let all: Vec<u32> = docs.concat();
    assert_eq!(manifest.dtype, TokenWidth::U16);
    assert_eq!(manifest.vocab_size, 14);
    assert_eq!(manifest.eos_id, 0);
    assert_eq!(manifest.documents, 5);
    assert_eq!(manifest.tokens, all.len() as u64);
    assert_eq!((last.documents, last.tokens), (5, all.len() as u64));
    // 7 tokens, then 4 (11 ≥ 8 closes), then 4 + 6 (≥ 8), then 4.
    let per_shard: Vec<u64> = manifest.shards.iter().map(|s| s.documents).collect();
    assert_eq!(per_shard, vec![2, 2, 1]);
    let set = Arc::new(ShardSet::open(&out).unwrap());
    let stream = TokenStream::all(set.clone());
    assert_eq!(stream.read(0, all.len()), all);
    // A read across the boundary of shards 0 and 1 (shard 0 holds 11 tokens).
    assert_eq!(stream.read(9, 4), all[9..13].to_vec());
    // The index: shard 1's documents end at 4 and 10.
    let idx = std::fs::read(out.join("shard_00001.idx")).unwrap();
    let offsets: Vec<u64> = idx
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(offsets, vec![0, 4, 10]);
    // No temporary directory is left beside the output.
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains(".tmp-")), "{names:?}");
}

/// The tokenizer's own template, as transformers' `tokenizer(text)` applies it: a BOS (`<s>`,
/// 14) in front of each document; a template that also appends the EOS does not double the EOS
/// every document ends with; an EOS spelled in the text is text and stays. Ids worked out by
/// hand from the fixtures (`wordlevel_bos.json`: `<s> $A`; `wordlevel_bos_eos.json`: `<s> $A
/// <|endoftext|>`; both `wordlevel.json` plus `<s>`, written by Python's `tokenizers`).
#[test]
fn the_tokenizers_template_puts_its_bos_in_front_once_and_its_eos_is_not_doubled() {
    let dir = scratch("template");
    std::fs::write(
        dir.join("a.jsonl"),
        "{\"text\": \"the cat sees a bird .\"}\n{\"text\": \"a dog <|endoftext|>\"}\n",
    )
    .unwrap();
    let read = |tokenizer: &str, special_tokens: bool| {
        let out = dir.join(format!("{tokenizer}-{special_tokens}"));
        let mut opts = options(vec![dir.join("a.jsonl").display().to_string()], &out);
        opts.tokenizer = fixture().with_file_name(tokenizer);
        opts.special_tokens = special_tokens;
        let manifest = tokenize(&opts, &mut |_| {}).unwrap();
        assert_eq!(manifest.documents, 2);
        let stream = TokenStream::all(Arc::new(ShardSet::open(&out).unwrap()));
        let ids = stream.read(0, manifest.tokens as usize);
        assert_eq!(ids.len() as u64, manifest.tokens);
        ids
    };
    let with_bos = vec![14, 2, 3, 5, 6, 7, 10, 0, 14, 6, 4, 0, 0];
    assert_eq!(read("wordlevel_bos.json", true), with_bos);
    assert_eq!(read("wordlevel_bos_eos.json", true), with_bos);
    // Mirror: without the template, no BOS (and the template's EOS is not there to drop).
    let without = vec![2, 3, 5, 6, 7, 10, 0, 6, 4, 0, 0];
    assert_eq!(read("wordlevel_bos.json", false), without);
    assert_eq!(read("wordlevel_bos_eos.json", false), without);
    // A tokenizer without a template is the same either way.
    assert_eq!(read("wordlevel.json", true), without);
}

#[test]
fn a_vocabulary_past_u16_is_stored_as_u32() {
    let dir = scratch("u32");
    let mk = |vocab: usize, name: &str| {
        let info = TokenizerInfo {
            sha256: "0".repeat(64),
            vocab_size: vocab,
            eos_id: 3,
        };
        let out = dir.join(name);
        let mut w = ShardWriter::create(&out, info, 100).unwrap();
        let big = (vocab - 1) as u32;
        w.push_document(&[big, 7]).unwrap();
        w.finish("t").unwrap();
        let set = Arc::new(ShardSet::open(&out).unwrap());
        (
            set.manifest().dtype,
            TokenStream::all(set).read(0, 3),
            std::fs::metadata(out.join("shard_00000.bin"))
                .unwrap()
                .len(),
        )
    };
    assert_eq!(
        mk(65_536, "small"),
        (TokenWidth::U16, vec![65_535, 7, 3], 6)
    );
    assert_eq!(mk(70_000, "big"), (TokenWidth::U32, vec![69_999, 7, 3], 12));
}

#[test]
fn sequences_in_order_and_shuffled() {
    let dir = scratch("seq");
    let info = TokenizerInfo {
        sha256: "0".repeat(64),
        vocab_size: 1000,
        eos_id: 0,
    };
    let out = dir.join("s");
    let mut w = ShardWriter::create(&out, info, 7).unwrap();
    // Documents 1..=9, 10..=19, ...: 10 ids each with EOS (0) after; shards of ~7 tokens.
    for d in 0..5u32 {
        let ids: Vec<u32> = (1 + 10 * d..10 + 10 * d).collect();
        w.push_document(&ids).unwrap();
    }
    w.finish("t").unwrap();
    let set = Arc::new(ShardSet::open(&out).unwrap());
    assert_eq!(set.len(), 5);
    let stream = TokenStream::all(set);
    let all = stream.read(0, 50);
    let seq = Sequences::new(stream.clone(), 6, Order::Sequential).unwrap();
    assert_eq!(seq.windows(), 8); // 50 tokens / 6, the tail of 2 unread
    assert_eq!(seq.sequence(0), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(seq.sequence(1), vec![7, 8, 9, 0, 11, 12]);
    assert_eq!(seq.sequence(9), seq.sequence(1)); // epoch 1 starts again
    assert_eq!(seq.epoch(9), 1);
    let shuffled = Sequences::new(stream.clone(), 6, Order::Shuffled { seed: 5 }).unwrap();
    for epoch in 0..3u64 {
        let mut windows: Vec<u64> = (0..8).map(|i| shuffled.window(epoch * 8 + i)).collect();
        let order = windows.clone();
        windows.sort_unstable();
        assert_eq!(
            windows,
            (0..8).collect::<Vec<_>>(),
            "epoch {epoch}: {order:?}"
        );
        for i in 0..8 {
            let w = order[i as usize] as usize;
            assert_eq!(
                shuffled.sequence(epoch * 8 + i),
                all[w * 6..w * 6 + 6].to_vec()
            );
        }
    }
    let e0: Vec<u64> = (0..8).map(|i| shuffled.window(i)).collect();
    let e1: Vec<u64> = (8..16).map(|i| shuffled.window(i)).collect();
    assert_ne!(e0, e1, "each epoch has its own order");
    assert_ne!(e0, (0..8).collect::<Vec<_>>());
    assert!(Sequences::new(stream, 51, Order::Sequential).is_none());
}

/// The error and that `out` was not created (nor any temporary directory left beside it).
fn refused(opts: &TokenizeOptions) -> DataError {
    let err = tokenize(opts, &mut |_| {}).unwrap_err();
    assert!(
        !opts.output.exists(),
        "{} was written",
        opts.output.display()
    );
    if let Some(parent) = opts.output.parent() {
        for e in std::fs::read_dir(parent).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!name.contains(".tmp-"), "{name} left behind");
        }
    }
    assert!(err.is_usage());
    err
}

#[test]
fn bad_inputs_are_refused_with_nothing_written() {
    let dir = scratch("bad");
    let out = dir.join("out");
    // A jsonl file whose second record lacks the field: the file, the line and the field.
    std::fs::write(
        dir.join("a.jsonl"),
        "{\"text\": \"the cat\"}\n{\"body\": \"a dog\"}\n",
    )
    .unwrap();
    let err = refused(&options(
        vec![dir.join("a.jsonl").display().to_string()],
        &out,
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("a.jsonl line 2: no field `text` (it has body)"),
        "{msg}"
    );
    // The mirror: with the field everywhere it is written.
    std::fs::write(dir.join("ok.jsonl"), "{\"text\": \"the cat\"}\n").unwrap();
    tokenize(
        &options(vec![dir.join("ok.jsonl").display().to_string()], &out),
        &mut |_| {},
    )
    .unwrap();
    assert!(ShardSet::open(&out).is_ok());
    // The output exists now: refused, and left as it was.
    let before = std::fs::read(out.join("manifest.json")).unwrap();
    let err = tokenize(
        &options(vec![dir.join("ok.jsonl").display().to_string()], &out),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    assert_eq!(std::fs::read(out.join("manifest.json")).unwrap(), before);
    let out = dir.join("out2");
    // A parquet file without the field: the file, the field and the columns it has.
    write_parquet(&dir.join("p.parquet"), "content", &["the cat"]);
    let msg = refused(&options(
        vec![dir.join("p.parquet").display().to_string()],
        &out,
    ))
    .to_string();
    assert!(
        msg.contains("p.parquet: no field `text` (it has content, id)"),
        "{msg}"
    );
    // A field that is not text.
    std::fs::write(dir.join("n.jsonl"), "{\"text\": 5}\n").unwrap();
    let msg = refused(&options(
        vec![dir.join("n.jsonl").display().to_string()],
        &out,
    ))
    .to_string();
    assert!(
        msg.contains("n.jsonl line 1: field `text` is a number"),
        "{msg}"
    );
    // An output whose parent is missing.
    let mut opts = options(vec![dir.join("ok.jsonl").display().to_string()], &out);
    opts.output = dir.join("no-such-dir").join("out");
    let msg = tokenize(&opts, &mut |_| {}).unwrap_err().to_string();
    assert!(msg.contains("no-such-dir is not a directory"), "{msg}");
    assert!(!dir.join("no-such-dir").exists());
    // A glob matching nothing.
    let pattern = dir.join("*.none.jsonl").display().to_string();
    let msg = refused(&options(vec![pattern.clone()], &out)).to_string();
    assert_eq!(msg, format!("{pattern} matches no file"));
    // A tokenizer whose vocabulary exceeds the model's (a model directory's config.json).
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(fixture(), model.join("tokenizer.json")).unwrap();
    std::fs::write(model.join("config.json"), "{\"vocab_size\": 10}").unwrap();
    let mut opts = options(vec![dir.join("ok.jsonl").display().to_string()], &out);
    opts.tokenizer = model.clone();
    let msg = refused(&opts).to_string();
    assert!(
        msg.contains("has 14 tokens, more than the model's vocab_size 10"),
        "{msg}"
    );
    // The mirror: a model as large as the tokenizer is fine.
    std::fs::write(model.join("config.json"), "{\"vocab_size\": 14}").unwrap();
    tokenize(&opts, &mut |_| {}).unwrap();
    assert!(out.exists());
}

/// A two-shard directory to damage, and its paths.
fn two_shards(dir: &Path) -> PathBuf {
    let info = TokenizerInfo {
        sha256: "0".repeat(64),
        vocab_size: 100,
        eos_id: 0,
    };
    let out = dir.join("s");
    let mut w = ShardWriter::create(&out, info, 8).unwrap();
    for d in 1..5u32 {
        w.push_document(&[d, d + 10, d + 20]).unwrap();
    }
    w.finish("t").unwrap();
    out
}

#[test]
fn damaged_shard_directories_are_refused() {
    let dir = scratch("damaged");
    let out = two_shards(&dir);
    assert_eq!(ShardSet::open(&out).unwrap().len(), 2);
    let bin = out.join("shard_00001.bin");
    let idx = out.join("shard_00001.idx");
    let good_bin = std::fs::read(&bin).unwrap();
    let good_idx = std::fs::read(&idx).unwrap();
    let open_err = || ShardSet::open(&out).unwrap_err().to_string();
    // Missing.
    std::fs::remove_file(&bin).unwrap();
    let msg = open_err();
    assert!(msg.starts_with("shard shard_00001.bin of "), "{msg}");
    assert!(msg.contains("is missing"), "{msg}");
    // Truncated by one token.
    std::fs::write(&bin, &good_bin[..good_bin.len() - 2]).unwrap();
    assert!(
        open_err().ends_with("is 14 bytes, expected 16 (truncated or not this manifest's shard)")
    );
    // The same size, one id changed: the checksum.
    let mut changed = good_bin.clone();
    changed[0] ^= 1;
    std::fs::write(&bin, &changed).unwrap();
    assert!(open_err().contains("has SHA-256"), "{}", open_err());
    std::fs::write(&bin, &good_bin).unwrap();
    // An index whose document ends inside a document (same size): not this shard's.
    let mut bad = good_idx.clone();
    bad[8] = 2; // document 0 ends at token 1 (id 13), not 3 (EOS)
    std::fs::write(&idx, &bad).unwrap();
    let msg = open_err();
    assert!(
        msg.contains("does not match its shard: document 0 ends at token 1 with id 13, not EOS 0"),
        "{msg}"
    );
    // An index that stops short of the shard.
    let mut bad = good_idx.clone();
    bad[16] = 7;
    std::fs::write(&idx, &bad).unwrap();
    let msg = open_err();
    assert!(
        msg.contains("offsets run from 0 to 7, expected 0 to the shard's 8 tokens"),
        "{msg}"
    );
    // The mirror: restored, it opens and reads the ids written.
    std::fs::write(&idx, &good_idx).unwrap();
    let set = Arc::new(ShardSet::open(&out).unwrap());
    assert_eq!(TokenStream::all(set).read(8, 4), vec![3, 13, 23, 0]);
}
