//! Token sources from files: text (byte-level) and pre-tokenized u16/u32, with their errors.

mod common;
use common::scratch::{scratch_path as tmp, Scratch};

use ferrotext_train::data::source_for;
use ferrotext_train::TrainConfig;

fn cfg(items: &[String]) -> TrainConfig {
    let mut all = vec!["max_target_length=8".to_string()];
    all.extend(items.iter().cloned());
    TrainConfig::load(None, &all).unwrap()
}

#[test]
fn text_files_are_byte_tokens() {
    let path = tmp("corpus.txt");
    std::fs::write(&path, "hello world, hello ferrotext!\n".repeat(4)).unwrap();
    let c = cfg(&[
        "dataset_type=text".into(),
        format!("dataset_path={}", path.display()),
    ]);
    let s = source_for(&c, 256).unwrap();
    let seq = s.sequence(3, 9);
    let text = String::from_utf8(seq.iter().map(|&t| t as u8).collect()).unwrap();
    assert!(
        "hello world, hello ferrotext!\n".repeat(5).contains(&text),
        "{text:?}"
    );
    assert_eq!(s.sequence(3, 9), seq, "deterministic");
}

#[test]
fn token_files_read_u16_and_u32_little_endian() {
    let ids: Vec<u32> = (0..100).map(|i| (i * 37) % 1000).collect();
    for (dtype, bytes) in [
        (
            "u16",
            ids.iter()
                .flat_map(|&i| (i as u16).to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
        (
            "u32",
            ids.iter()
                .flat_map(|&i| i.to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
    ] {
        let path = tmp(&format!("tokens.{dtype}"));
        std::fs::write(&path, bytes).unwrap();
        let c = cfg(&[
            "dataset_type=tokens".into(),
            format!("dataset_path={}", path.display()),
            format!("token_dtype={dtype}"),
            "vocab_size=1000".into(),
            "model_name=qwen3-peer".into(),
        ]);
        let s = source_for(&c, 1000).unwrap();
        let seq = s.sequence(0, 9);
        let start = ids.iter().position(|&i| i == seq[0]).unwrap();
        assert_eq!(seq, ids[start..start + 9].to_vec(), "{dtype}");
    }
}

#[test]
fn bad_token_files_are_clear_errors() {
    let odd = tmp("odd.u16");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    let c = cfg(&[
        "dataset_type=tokens".into(),
        format!("dataset_path={}", odd.display()),
    ]);
    assert!(source_for(&c, 256)
        .err()
        .unwrap()
        .to_string()
        .contains("not a whole number of u16 tokens"));
    let big = tmp("big.u16");
    std::fs::write(&big, [0xffu8; 40]).unwrap();
    let c = cfg(&[
        "dataset_type=tokens".into(),
        format!("dataset_path={}", big.display()),
    ]);
    assert!(source_for(&c, 256)
        .err()
        .unwrap()
        .to_string()
        .contains("token id 65535 ≥ vocab_size 256"));
    let short = tmp("short.txt");
    std::fs::write(&short, "abc").unwrap();
    let c = cfg(&[
        "dataset_type=text".into(),
        format!("dataset_path={}", short.display()),
    ]);
    assert!(source_for(&c, 256)
        .err()
        .unwrap()
        .to_string()
        .contains("a sequence needs 9"));
}

/// A small WordLevel `tokenizer.json` in HF's format (whitespace pre-tokenizer).
const TOKENIZER: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [],
  "normalizer": {"type": "Lowercase"},
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5, ".": 6}, "unk_token": "[UNK]"}
}"#;

#[test]
fn hf_tokenizer_files_tokenize_text() {
    let tok = tmp("tokenizer.json");
    std::fs::write(&tok, TOKENIZER).unwrap();
    let text = tmp("cat.txt");
    std::fs::write(&text, "The cat sat on the mat. ".repeat(10)).unwrap();
    let ids = ferrotext_train::data::tokenize(tok.to_str().unwrap(), "the cat sat on the dog .", 7)
        .unwrap();
    assert_eq!(ids, vec![1, 2, 3, 4, 1, 0, 6]);
    // A tokenizer whose template puts `<s>` (14) in front: the text is one document and gets it
    // once, as `ferrotext tokenize` and transformers' `tokenizer(text)` give it.
    let bos = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../data/tests/fixtures/wordlevel_bos.json");
    let ids = ferrotext_train::data::tokenize(bos.to_str().unwrap(), "the cat . the dog", 15);
    assert_eq!(ids.unwrap(), vec![14, 2, 3, 10, 2, 4]);
    let c = cfg(&[
        "dataset_type=text".into(),
        format!("dataset_path={}", text.display()),
        format!("tokenizer_path={}", tok.display()),
        "vocab_size=64".into(),
    ]);
    let s = source_for(&c, 64).unwrap();
    let seq = s.sequence(1, 9);
    assert!(seq.iter().all(|&t| (1..=6).contains(&t)), "{seq:?}");
    // A vocabulary smaller than the tokenizer's ids is refused.
    let err = ferrotext_train::data::tokenize(tok.to_str().unwrap(), "mat", 4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("has 7 tokens, more than the model's vocab_size 4"),
        "{err}"
    );
    let bad = tmp("bad.json");
    std::fs::write(&bad, "{}").unwrap();
    assert!(ferrotext_train::data::tokenize(bad.to_str().unwrap(), "x", 10).is_err());
}

/// A u32 token file holding `0, 1, 2, ...`: every window's content names its own position.
fn counting_file(name: &str, tokens: u32) -> Scratch {
    let path = tmp(name);
    let bytes: Vec<u8> = (0..tokens).flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn sequential_order_reads_consecutive_windows_in_file_order_and_wraps_by_epoch() {
    use ferrotext_train::data::micro_batch;
    // 10 windows of 9 tokens (max_target_length 8), plus 5 tokens that never form a window.
    let path = counting_file("sequential.u32", 95);
    let c = cfg(&[
        "dataset_type=tokens".into(),
        format!("dataset_path={}", path.display()),
        "token_dtype=u32".into(),
        "vocab_size=1000".into(),
        "model_name=qwen3-peer".into(),
        "dataset_order=sequential".into(),
    ]);
    let s = source_for(&c, 1000).unwrap();
    for w in 0..10u32 {
        assert_eq!(
            s.sequence(u64::from(w), 9),
            (9 * w..9 * w + 9).collect::<Vec<_>>()
        );
        assert_eq!(s.epoch(u64::from(w), 9), Some(0));
    }
    // The 11th window is the first again: epoch 1.
    assert_eq!(s.sequence(10, 9), s.sequence(0, 9));
    assert_eq!(s.epoch(10, 9), Some(1));
    assert_eq!(s.epoch(25, 9), Some(2));
    // Micro-batches are contiguous runs of windows: step 1, GA 2, 2 rows → micro 1 of step 1
    // is windows 6 and 7 ([step][micro][row] in file order).
    let rows = micro_batch(s.as_ref(), 1, 1, 2, 2, 8);
    assert_eq!(rows[0], (54..63).collect::<Vec<_>>());
    assert_eq!(rows[1], (63..72).collect::<Vec<_>>());
    // The random order (the default) overlaps windows and has no epoch: the mirror.
    let random = cfg(&[
        "dataset_type=tokens".into(),
        format!("dataset_path={}", path.display()),
        "token_dtype=u32".into(),
        "vocab_size=1000".into(),
        "model_name=qwen3-peer".into(),
    ]);
    let r = source_for(&random, 1000).unwrap();
    assert_eq!(r.epoch(10, 9), None);
    assert!(
        (0..20).any(|i| r.sequence(i, 9)[0] % 9 != 0),
        "random windows start anywhere"
    );
}

#[test]
fn a_data_file_truncated_during_a_run_cannot_fault_the_reader() {
    // The source holds its own copy: with a mapped file, reading past the new end was SIGBUS.
    let path = counting_file("truncated.u32", 4096);
    let c = cfg(&[
        "dataset_type=tokens".into(),
        format!("dataset_path={}", path.display()),
        "token_dtype=u32".into(),
        "vocab_size=5000".into(),
        "model_name=qwen3-peer".into(),
        "dataset_order=sequential".into(),
    ]);
    let s = source_for(&c, 5000).unwrap();
    let before = s.sequence(400, 9);
    std::fs::File::create(&path).unwrap(); // truncate to 0 bytes
    assert_eq!(s.sequence(400, 9), before);
}

#[test]
fn inputs_that_are_not_regular_files_are_refused_without_reading() {
    let fifo = tmp("fifo");
    std::fs::remove_file(&fifo).ok();
    let made = std::process::Command::new("mkfifo").arg(&*fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo");
    let dir = tmp("a-directory");
    std::fs::create_dir_all(&dir).unwrap();
    for (dtype, path) in [
        ("text", fifo.display().to_string()),
        ("tokens", "/dev/zero".into()),
        ("text", dir.display().to_string()),
    ] {
        let c = cfg(&[
            format!("dataset_type={dtype}"),
            format!("dataset_path={path}"),
        ]);
        let err = source_for(&c, 256).err().map(|e| e.to_string());
        assert_eq!(
            err,
            Some(format!("data: cannot open {path}: is not a regular file")),
            "{path}"
        );
    }
    let c = cfg(&["tokenizer_path=/dev/zero".into()]);
    let err = source_for(&c, 256).err().unwrap().to_string();
    assert!(
        err.contains("cannot open /dev/zero: is not a regular file"),
        "{err}"
    );
}
