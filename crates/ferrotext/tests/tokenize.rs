//! `ferrotext tokenize` and `dataset_type=shards` through the binary: a corpus becomes shards
//! that training reads; a run resumed from a checkpoint (at a step boundary, and inside a step)
//! reads exactly the tokens the uninterrupted run reads — compared token by token through the
//! `FERROTEXT_DATA_TAP` hook of the `fault-injection` build (so that test is compiled with the
//! feature only; the README's test command turns it on) — and moved shards resume while changed
//! shards are refused; bad input is one `error:` line, exit 2, nothing written.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::ferrotext;
mod scratch;
use scratch::scratch;

/// The word-level fixture tokenizer (14 ids: `<|endoftext|>` 0, `[UNK]` 1, 12 words).
fn tokenizer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tests/fixtures/wordlevel.json")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts `out` is bad input: exit 2 and exactly one line, `error: ...` containing `want`.
fn assert_usage(out: &Output, want: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(want),
        "{err}"
    );
}

fn tokenize(inputs: &[&str], out: &Path, extra: &[&str]) -> Output {
    let tok = tokenizer().display().to_string();
    let out = out.display().to_string();
    let mut args = vec!["tokenize", "--tokenizer", &tok, "--output", &out];
    args.extend_from_slice(inputs);
    args.extend_from_slice(extra);
    ferrotext(&args)
}

#[test]
fn bad_input_is_one_error_line_exit_2_and_nothing_written() {
    let dir = scratch("bad");
    let out = dir.join("shards");
    let none = dir.join("*.jsonl").display().to_string();
    assert_usage(&tokenize(&[&none], &out, &[]), "matches no file");
    std::fs::write(
        dir.join("a.jsonl"),
        "{\"text\": \"the cat\"}\n{\"body\": \"x\"}\n",
    )
    .unwrap();
    let a = dir.join("a.jsonl").display().to_string();
    assert_usage(
        &tokenize(&[&a], &out, &[]),
        "a.jsonl line 2: no field `text`",
    );
    assert_usage(
        &tokenize(&[&a], &out, &["--field", "body"]),
        "a.jsonl line 1: no field `body` (it has text)",
    );
    // A model directory whose vocabulary is smaller than the tokenizer's.
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(tokenizer(), model.join("tokenizer.json")).unwrap();
    std::fs::write(model.join("config.json"), "{\"vocab_size\": 12}").unwrap();
    std::fs::write(dir.join("ok.jsonl"), "{\"text\": \"the cat\"}\n").unwrap();
    let ok = dir.join("ok.jsonl").display().to_string();
    let res = ferrotext(&[
        "tokenize",
        &ok,
        "--tokenizer",
        &model.display().to_string(),
        "--output",
        &out.display().to_string(),
    ]);
    assert_usage(&res, "has 14 tokens, more than the model's vocab_size 12");
    // Nothing was written, not even a temporary directory.
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("shards"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // The mirror: good input writes the directory and says so.
    let res = tokenize(&[&ok], &out, &[]);
    assert!(res.status.success(), "{}", stderr(&res));
    let said = String::from_utf8_lossy(&res.stdout);
    assert!(
        said.contains("1 shards, 1 documents, 3 tokens (U16)"),
        "{said}"
    );
    // Training on a directory with a truncated shard: exit 2, one line.
    let shard = out.join("shard_00000.bin");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 2]).unwrap();
    let res = ferrotext(&[
        "train",
        "dataset_type=shards",
        &format!("dataset_path={}", out.display()),
        "vocab_size=64",
        "max_target_length=2",
        "steps=1",
        &format!("base_output_directory={}", dir.display()),
    ]);
    assert_usage(&res, "is 4 bytes, expected 6 (truncated");
}

/// `--no-special-tokens` leaves out the BOS a tokenizer's template puts in front of each
/// document, which `tokenize` adds by default (as transformers' `tokenizer(text)` does): the
/// first document's ids, read back from the shard file, with and without it.
#[test]
fn the_tokenizers_bos_is_written_unless_turned_off() {
    let dir = scratch("bos");
    std::fs::write(dir.join("a.jsonl"), "{\"text\": \"the cat\"}\n").unwrap();
    let a = dir.join("a.jsonl").display().to_string();
    let bos_tokenizer = tokenizer().with_file_name("wordlevel_bos.json");
    let ids = |extra: &[&str], name: &str| {
        let out = dir.join(name);
        let mut args = vec![
            "tokenize".to_string(),
            a.clone(),
            "--tokenizer".into(),
            bos_tokenizer.display().to_string(),
            "--output".into(),
            out.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let res = ferrotext(&args);
        assert!(res.status.success(), "{}", stderr(&res));
        let bytes = std::fs::read(out.join("shard_00000.bin")).unwrap();
        bytes
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect::<Vec<u16>>()
    };
    // `<s>` 14, `the` 2, `cat` 3, EOS 0.
    assert_eq!(ids(&[], "with"), vec![14, 2, 3, 0]);
    assert_eq!(ids(&["--no-special-tokens"], "without"), vec![2, 3, 0]);
}

/// The exact-resume test reads the tokens through the `FERROTEXT_DATA_TAP` hook, which only the
/// `fault-injection` build has.
#[cfg(feature = "fault-injection")]
mod resume {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;
    use std::process::{Command, Output};

    use super::{assert_usage, scratch, stderr, tokenize};

    /// `n` documents of varied sentences from the fixture's words, as jsonl.
    fn corpus(path: &Path, n: usize, salt: usize) {
        const WORDS: [&str; 12] = [
            "the", "cat", "dog", "sees", "a", "bird", "and", "runs", ".", "red", "old", "man",
        ];
        let mut out = String::new();
        for d in 0..n {
            let words: Vec<&str> = (0..6 + (d * 7 + salt) % 9)
                .map(|i| WORDS[(d * 31 + i * 17 + salt * 5 + i * i) % WORDS.len()])
                .collect();
            out.push_str(&format!(
                "{{\"text\": \"{}\", \"id\": {d}}}\n",
                words.join(" ")
            ));
        }
        std::fs::write(path, out).expect("corpus");
    }

    /// Trains the small model on `shards` into `root/run` with `extra` keys, recording the tokens
    /// read into `tap`; asserts success.
    fn train(root: &Path, shards: &Path, tap: &Path, extra: &[&str]) -> Output {
        let mut args: Vec<String> = vec![
            "train".into(),
            "dataset_type=shards".into(),
            format!("dataset_path={}", shards.display()),
            "vocab_size=64".into(),
            "base_emb_dim=32".into(),
            "base_mlp_dim=64".into(),
            "head_dim=8".into(),
            "max_target_length=16".into(),
            "data_shuffle_seed=7".into(),
            "enable_checkpointing=true".into(),
            "checkpoint_period=1".into(),
            format!("base_output_directory={}", root.display()),
            "run_name=run".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Command::new(env!("CARGO_BIN_EXE_ferrotext"))
            .args(&args)
            .env("FERROTEXT_DATA_TAP", tap)
            .output()
            .expect("the ferrotext binary runs")
    }

    /// The tap's lines as index → tokens (each index once: devices that compute the same rows
    /// write the same line; a different line for one index would be a bug and fails here).
    fn read_tap(tap: &Path) -> BTreeMap<u64, String> {
        let mut seen = BTreeMap::new();
        for line in std::fs::read_to_string(tap).unwrap_or_default().lines() {
            let (index, ids) = line.split_once(": ").expect("index: ids");
            let index: u64 = index.parse().expect("an index");
            let before = seen.insert(index, ids.to_string());
            assert!(
                before.is_none_or(|b| b == ids),
                "index {index} read two ways"
            );
        }
        seen
    }

    #[test]
    fn a_resumed_run_reads_exactly_the_tokens_of_the_uninterrupted_run() {
        let dir = scratch("resume");
        let jsonl = dir.join("corpus.jsonl");
        corpus(&jsonl, 300, 0);
        let shards = dir.join("shards");
        let res = tokenize(
            &[&jsonl.display().to_string()],
            &shards,
            &["--shard-tokens", "700"],
        );
        assert!(res.status.success(), "{}", stderr(&res));
        // The uninterrupted run: 4 steps of 4 devices × 2 rows × GA 4 = 32 sequences.
        let whole = dir.join("whole");
        let tap = dir.join("whole.tap");
        let res = train(&whole, &shards, &tap, &["steps=4"]);
        assert!(res.status.success(), "{}", stderr(&res));
        let want = read_tap(&tap);
        assert_eq!(
            want.keys().copied().collect::<Vec<_>>(),
            (0..128).collect::<Vec<_>>()
        );
        // Interrupted after step 2, resumed to step 4 from shards moved to another path.
        let cut = dir.join("cut");
        let (tap1, tap2) = (dir.join("cut1.tap"), dir.join("cut2.tap"));
        let res = train(&cut, &shards, &tap1, &["steps=2"]);
        assert!(res.status.success(), "{}", stderr(&res));
        let moved = dir.join("moved");
        std::fs::rename(&shards, &moved).unwrap();
        let res = train(&cut, &moved, &tap2, &["steps=4"]);
        assert!(res.status.success(), "{}", stderr(&res));
        let (first, second) = (read_tap(&tap1), read_tap(&tap2));
        assert_eq!(
            first.keys().copied().collect::<BTreeSet<_>>(),
            (0..64).collect()
        );
        assert_eq!(
            second.keys().copied().collect::<BTreeSet<_>>(),
            (64..128).collect()
        );
        let mut joined = first.clone();
        joined.extend(second);
        assert_eq!(joined, want, "the resumed run read other tokens");
        // Inside a step: resume from step 1 micro-batch 2 (16 + 32 sequences consumed).
        let mid = dir.join("mid");
        let tap3 = dir.join("mid.tap");
        let res = train(
            &mid,
            &moved,
            &dir.join("mid0.tap"),
            &["steps=2", "checkpoint_micro_batch_period=1"],
        );
        assert!(res.status.success(), "{}", stderr(&res));
        let root = mid.join("run/checkpoints");
        std::fs::remove_dir_all(root.join("step_00000002_micro_000")).unwrap();
        std::fs::write(root.join("latest"), "step_00000001_micro_002").unwrap();
        let res = train(
            &mid,
            &moved,
            &tap3,
            &["steps=4", "checkpoint_micro_batch_period=1"],
        );
        assert!(res.status.success(), "{}", stderr(&res));
        let resumed = read_tap(&tap3);
        assert_eq!(
            resumed.len(),
            128 - 48,
            "reads every sequence not yet consumed, once"
        );
        for (index, ids) in &resumed {
            assert_eq!(Some(ids), want.get(index), "sequence {index}");
        }
        // The mirror: shards that changed under the checkpoint are refused, nothing trained.
        corpus(&jsonl, 300, 1);
        let other = dir.join("other");
        let res = tokenize(
            &[&jsonl.display().to_string()],
            &other,
            &["--shard-tokens", "700"],
        );
        assert!(res.status.success(), "{}", stderr(&res));
        let tap4 = dir.join("changed.tap");
        let res = train(&cut, &other, &tap4, &["steps=6"]);
        assert_usage(&res, "the data changed");
        assert!(read_tap(&tap4).is_empty(), "a refused resume read data");
    }
}
