//! `dataset_type=shards`: the windows a training and an evaluation source read from a shard
//! directory, against the token stream the test wrote (counting ids, so every window names its
//! own position), and the configs refused.

use ferrotext_data::{ShardWriter, TokenizerInfo};
use ferrotext_train::data::{eval_source_for, micro_batch, source_for};
use ferrotext_train::TrainConfig;

mod common;
use common::scratch::{scratch_path as tmp, Scratch};

const EOS: u32 = 999;

/// Five shards, each two documents of 8 counting ids plus EOS (18 tokens a shard, 90 in all):
/// shard `s` holds `[18s+1 ..= 18s+8, EOS, 18s+10 ..= 18s+17, EOS]`. Returns the directory and
/// the whole stream.
fn five_shards(name: &str) -> (Scratch, Vec<u32>) {
    let out = tmp(name);
    let _ = std::fs::remove_dir_all(&out);
    let info = TokenizerInfo {
        sha256: ferrotext_data::format::sha256_hex(b"tokenizer"),
        vocab_size: 1000,
        eos_id: EOS,
    };
    let mut w = ShardWriter::create(&out, info, 18).unwrap();
    let mut stream = Vec::new();
    for s in 0..5u32 {
        for d in 0..2u32 {
            let first = 18 * s + 9 * d + 1;
            let ids: Vec<u32> = (first..first + 8).collect();
            w.push_document(&ids).unwrap();
            stream.extend_from_slice(&ids);
            stream.push(EOS);
        }
    }
    w.finish("test").unwrap();
    (out, stream)
}

fn cfg(dir: &std::path::Path, items: &[&str]) -> TrainConfig {
    let mut all = vec![
        "max_target_length=8".to_string(),
        "dataset_type=shards".into(),
        format!("dataset_path={}", dir.display()),
        "vocab_size=1000".into(),
        "model_name=qwen3-peer".into(),
    ];
    all.extend(items.iter().map(|s| s.to_string()));
    TrainConfig::load(None, &all).unwrap()
}

#[test]
fn shards_in_order_are_read_window_after_window_across_shard_boundaries() {
    let (dir, stream) = five_shards("ordered");
    let s = source_for(&cfg(&dir, &["dataset_order=sequential"]), 1000).unwrap();
    // 90 tokens: 10 windows of 9; window 2 spans shards 0 and 1.
    for w in 0..10u64 {
        let at = 9 * w as usize;
        assert_eq!(s.sequence(w, 9), stream[at..at + 9].to_vec(), "window {w}");
        assert_eq!(s.epoch(w, 9), Some(0));
    }
    assert_eq!(s.sequence(10, 9), stream[..9].to_vec());
    assert_eq!(s.epoch(13, 9), Some(1));
    // Contiguous micro-batches: step 1, GA 2, 2 rows → micro 1 is windows 6 and 7.
    let rows = micro_batch(s.as_ref(), 1, 1, 2, 2, 8);
    assert_eq!(rows, vec![stream[54..63].to_vec(), stream[63..72].to_vec()]);
}

#[test]
fn shuffled_shards_read_every_window_once_an_epoch_in_a_seeded_order() {
    let (dir, stream) = five_shards("shuffled");
    let windows = |seed: &str| -> Vec<Vec<usize>> {
        let s = source_for(&cfg(&dir, &[seed]), 1000).unwrap();
        (0..3u64)
            .map(|epoch| {
                (0..10u64)
                    .map(|i| {
                        let seq = s.sequence(epoch * 10 + i, 9);
                        // Each window is one of the ten, found by its content.
                        let w = (0..10)
                            .find(|w| stream[9 * w..9 * w + 9] == seq[..])
                            .expect("a window of the stream");
                        assert_eq!(s.epoch(epoch * 10 + i, 9), Some(epoch));
                        w
                    })
                    .collect()
            })
            .collect()
    };
    let a = windows("data_shuffle_seed=1");
    for order in &a {
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>(), "{order:?}");
    }
    assert_ne!(a[0], a[1], "a new order each epoch");
    assert_ne!(a[0], (0..10).collect::<Vec<_>>(), "not the file order");
    assert_eq!(a, windows("data_shuffle_seed=1"), "deterministic");
    assert_ne!(a, windows("data_shuffle_seed=2"), "the seed decides");
}

#[test]
fn held_out_shards_are_whole_and_never_trained_on() {
    let (dir, stream) = five_shards("held-out");
    let shard = |s: usize| stream[18 * s..18 * s + 18].to_vec();
    // eval_split = 0.2 of 5 shards: shard 4 is held out.
    let c = cfg(
        &dir,
        &[
            "dataset_order=sequential",
            "eval_split=0.2",
            "eval_interval=1",
        ],
    );
    let train = source_for(&c, 1000).unwrap();
    let eval = eval_source_for(&c, 1000).unwrap().unwrap();
    let trained: Vec<u32> = (0..8).flat_map(|w| train.sequence(w, 9)).collect();
    assert_eq!(trained, stream[..72].to_vec());
    assert_eq!(
        train.sequence(8, 9),
        stream[..9].to_vec(),
        "wraps within shards 0-3"
    );
    assert_eq!(
        [eval.sequence(0, 9), eval.sequence(1, 9)].concat(),
        shard(4)
    );
    // eval_shards = 3,1: shards 1 and 3 held out (in shard order), 0, 2, 4 trained.
    let c = cfg(
        &dir,
        &[
            "dataset_order=sequential",
            "eval_shards=3,1",
            "eval_interval=1",
        ],
    );
    let train = source_for(&c, 1000).unwrap();
    let eval = eval_source_for(&c, 1000).unwrap().unwrap();
    let trained: Vec<u32> = (0..6).flat_map(|w| train.sequence(w, 9)).collect();
    assert_eq!(trained, [shard(0), shard(2), shard(4)].concat());
    let evaluated: Vec<u32> = (0..4).flat_map(|w| eval.sequence(w, 9)).collect();
    assert_eq!(evaluated, [shard(1), shard(3)].concat());
}

#[test]
fn shard_configs_that_cannot_work_are_refused() {
    let (dir, _) = five_shards("refused");
    let err = |c: &TrainConfig, vocab: usize| source_for(c, vocab).err().unwrap().to_string();
    // The shards' vocabulary (1000) exceeds the model's.
    let c = cfg(&dir, &["vocab_size=500"]);
    let msg = err(&c, 500);
    assert!(
        msg.contains("has 1000 tokens, more than the model's vocab_size 500"),
        "{msg}"
    );
    // A shard the directory lacks, and every shard held out.
    let c = cfg(&dir, &["eval_shards=7", "eval_interval=1"]);
    assert!(err(&c, 1000).contains("shard 7 is not there (the directory has shards 0..5)"));
    let c = cfg(&dir, &["eval_shards=0,1,2,3,4", "eval_interval=1"]);
    assert!(err(&c, 1000).contains("holds out 5 of the 5 shards"));
    // A tokenizer other than the one that made the shards.
    let tok = tmp("other-tokenizer.json");
    std::fs::write(&tok, b"another tokenizer").unwrap();
    let c = cfg(&dir, &[&format!("tokenizer_path={}", tok.display())]);
    assert!(err(&c, 1000).contains("`tokenizer_sha256` is"));
    // The mirror: the tokenizer that made them.
    std::fs::write(&tok, b"tokenizer").unwrap();
    assert!(source_for(
        &cfg(&dir, &[&format!("tokenizer_path={}", tok.display())]),
        1000
    )
    .is_ok());
    // eval_shards on other data.
    let bad = TrainConfig::load(None, &["eval_shards=1".into(), "eval_interval=1".into()])
        .unwrap_err()
        .to_string();
    assert!(
        bad.contains("eval_shards names shards of a shard directory"),
        "{bad}"
    );
}
