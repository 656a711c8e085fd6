//! `ferrotext generate` end to end: the default model, trained briefly on the bundled corpus,
//! continues a corpus line with corpus words (the mirror: the same model after one step does
//! not), and every bad input is one `error:` line with exit code 2 and nothing on stdout.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::ferrotext;

/// Trains the default model (GA 1) for `steps` steps with checkpoints into `dir/name`.
fn train(dir: &Path, name: &str, steps: usize) -> PathBuf {
    let out = ferrotext(&[
        "train",
        &format!("steps={steps}"),
        "gradient_accumulation_steps=1",
        "enable_checkpointing=true",
        &format!("base_output_directory={}", dir.display()),
        &format!("run_name={name}"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir.join(name)
}

fn generate(run: &Path, extra: &[&str]) -> Output {
    let run = run.display().to_string();
    let mut args = vec!["generate", "--checkpoint", &run];
    args.extend_from_slice(extra);
    ferrotext(&args)
}

/// `(words of `text` that the bundled corpus uses, all words)`.
fn corpus_words(text: &str) -> (usize, usize) {
    let split = |t: &str| -> Vec<String> {
        t.split(|c: char| !c.is_ascii_alphabetic())
            .filter(|w| !w.is_empty())
            .map(str::to_string)
            .collect()
    };
    let vocabulary: BTreeSet<String> = split(&ferrotext_train::data::bundled_corpus())
        .into_iter()
        .collect();
    let words = split(text);
    let known = words.iter().filter(|w| vocabulary.contains(*w)).count();
    (known, words.len())
}

/// Whether `text` reads as corpus text: at least 6 words, 80% of them the corpus's.
fn recognisable(text: &str) -> bool {
    let (known, all) = corpus_words(text);
    known >= 6 && known * 5 >= all * 4
}

fn continuation(out: &Output, prompt: &str) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.starts_with(prompt),
        "the prompt is printed first: {text:?}"
    );
    text[prompt.len()..].to_string()
}

#[test]
fn the_trained_default_model_continues_a_corpus_line() {
    let dir = std::env::temp_dir().join(format!("ferrotext-generate-{}", std::process::id()));
    let trained = train(&dir, "trained", 150);
    let untrained = train(&dir, "untrained", 1);
    let prompt = "the cat sees";
    let args = [
        "--prompt",
        prompt,
        "--max-new-tokens",
        "60",
        "--temperature",
        "0",
    ];
    let text = continuation(&generate(&trained, &args), prompt);
    assert!(
        recognisable(&text),
        "trained: {text:?} {:?}",
        corpus_words(&text)
    );
    let noise = continuation(&generate(&untrained, &args), prompt);
    assert!(
        !recognisable(&noise),
        "one step already reads as corpus text: {noise:?}"
    );
    // the recomputing reference prints the same greedy text
    let mut slow = args.to_vec();
    slow.push("--no-cache");
    assert_eq!(continuation(&generate(&trained, &slow), prompt), text);
    // a stop token: the newline ends the line
    let line = continuation(
        &generate(&trained, &["--prompt", prompt, "--eos", "10"]),
        prompt,
    );
    assert_eq!(line.matches('\n').count(), 1, "{line:?}");
    assert!(line.trim_end().ends_with('.'), "{line:?}");

    // bad input: one error line, exit 2, nothing on stdout
    let long = "x".repeat(200);
    for (args, says) in [
        (vec!["--prompt", long.as_str()], "context"),
        (vec!["--prompt", "a", "--temperature", "-1"], "temperature"),
        (vec!["--prompt", "a", "--top-p", "1.5"], "top_p"),
        (vec!["--prompt", "a", "--top-p", "0"], "top_p"),
        (
            vec!["--prompt", "a", "--max-new-tokens", "0"],
            "max-new-tokens",
        ),
        (vec!["--prompt", "a", "--eos", "999"], "stop token 999"),
        (vec!["--prompt", "a", "steps=3"], "no config keys"),
        (vec!["--prompt", ""], "empty"),
    ] {
        let out = generate(&trained, &args);
        refused(&out, says, &format!("{args:?}"));
    }
    let out = ferrotext(&["generate", "--prompt", "a"]);
    refused(&out, "nothing to generate from", "no model");
    let missing = dir.join("missing");
    let out = generate(&missing, &["--prompt", "a"]);
    refused(&out, "missing", "a checkpoint that does not exist");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A WordLevel `tokenizer.json` (whitespace pre-tokenizer; decoding joins words with spaces).
const TOKENIZER: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5, ".": 6}, "unk_token": "[UNK]"}
}"#;

#[test]
fn a_hugging_face_directory_generates_with_its_own_tokenizer() {
    let dir = std::env::temp_dir().join(format!("ferrotext-generate-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (text, tok, hf) = (
        dir.join("cat.txt"),
        dir.join("tokenizer.json"),
        dir.join("hf"),
    );
    std::fs::write(&text, "the cat sat on the mat . ".repeat(200)).unwrap();
    std::fs::write(&tok, TOKENIZER).unwrap();
    let out = ferrotext(&[
        "train",
        "steps=40",
        "gradient_accumulation_steps=1",
        "vocab_size=64",
        "dataset_type=text",
        &format!("dataset_path={}", text.display()),
        &format!("tokenizer_path={}", tok.display()),
        &format!("save_parameters_path={}", hf.display()),
        &format!("base_output_directory={}", dir.display()),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // the directory a HF user would hand over: weights, config.json and its tokenizer
    std::fs::copy(&tok, hf.join("tokenizer.json")).unwrap();
    let out = ferrotext(&[
        "generate",
        &format!("load_parameters_path={}", hf.display()),
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "5",
    ]);
    let text = continuation(&out, "the cat");
    assert!(
        text.starts_with(" sat"),
        "the first new word follows a space: {text:?}"
    );
    let words: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(words, ["sat", "on", "the", "mat", "."], "{text:?}");
    // Its end-of-sequence ids as transformers' `generate` takes them: `config.json`'s ("mat",
    // 5) end the text after that word; a `generation_config.json` that names others ("sat", 3)
    // wins over it.
    let generated = |source: &str| {
        let out = ferrotext(&[
            "generate",
            source,
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "5",
        ]);
        continuation(&out, "the cat")
    };
    let config_path = hf.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["eos_token_id"] = serde_json::json!(5);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let from_hf = format!("load_parameters_path={}", hf.display());
    assert_eq!(
        generated(&from_hf).split_whitespace().collect::<Vec<_>>(),
        ["sat", "on", "the", "mat"]
    );
    std::fs::write(
        hf.join("generation_config.json"),
        r#"{"eos_token_id": [3]}"#,
    )
    .unwrap();
    assert_eq!(
        generated(&from_hf).split_whitespace().collect::<Vec<_>>(),
        ["sat"]
    );
    // A checkpoint of a run trained from the directory generates as the directory does: its
    // tokenizer (the run names none) and its end-of-sequence ids.
    let out = ferrotext(&[
        "train",
        "steps=1",
        "learning_rate=1e-30",
        "gradient_accumulation_steps=1",
        "dataset_type=synthetic",
        "enable_checkpointing=true",
        "checkpoint_period=1",
        &from_hf,
        &format!("base_output_directory={}", dir.display()),
        "run_name=tuned",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = dir.join("tuned");
    let text = generated(&format!("--checkpoint={}", run.display()));
    assert_eq!(
        text.split_whitespace().collect::<Vec<_>>(),
        ["sat"],
        "{text:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn refused(out: &Output, says: &str, case: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{case}: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "{case}: stdout {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(stderr.lines().count(), 1, "{case}: {stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains(says),
        "{case}: {stderr}"
    );
}

/// A word-level `tokenizer.json` whose word `t{i}` is token `i`, for `vocab` tokens: prompts and
/// continuations of a fixture's token ids as text.
fn id_words_tokenizer(vocab: usize) -> String {
    let words: Vec<String> = (0..vocab).map(|i| format!("\"t{i}\": {i}")).collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null,
  "decoder": null, "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "t0"}}}}"#,
        words.join(", ")
    )
}

/// Sliding-window models written by transformers (Mistral: a window of 6 on every layer;
/// Gemma 2: on every other layer, with soft-capping): `ferrotext generate` continues the
/// fixture's 8-token prompt past the window with transformers' own 16 greedy tokens, with the
/// key/value cache and without it (`--no-cache`, the full recomputation).
#[test]
fn sliding_window_directories_generate_transformers_greedy_tokens() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hf/tests/fixtures/transformers");
    let dir =
        std::env::temp_dir().join(format!("ferrotext-generate-window-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for variant in ["mistral-tf5-f32-single", "gemma2-tf4-f32-single"] {
        let hf = fixtures.join(variant);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap())
                .unwrap();
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(hf.join("expected.json")).unwrap())
                .unwrap();
        let words = |key: &str| -> Vec<String> {
            let ids = expected[key].as_array().unwrap();
            ids.iter()
                .map(|i| format!("t{}", i.as_u64().unwrap()))
                .collect()
        };
        let tokenizer = dir.join(format!("{variant}.json"));
        let vocab = config["vocab_size"].as_u64().unwrap() as usize;
        std::fs::write(&tokenizer, id_words_tokenizer(vocab)).unwrap();
        let prompt = words("prompt").join(" ");
        for cache in [None, Some("--no-cache")] {
            let mut args = vec![
                "generate".to_string(),
                format!("load_parameters_path={}", hf.display()),
                format!("--tokenizer={}", tokenizer.display()),
                format!("--prompt={prompt}"),
                "--max-new-tokens=16".to_string(),
            ];
            args.extend(cache.map(str::to_string));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let text = continuation(&ferrotext(&args), &prompt);
            let got: Vec<&str> = text.split_whitespace().collect();
            assert_eq!(got, words("greedy_tokens"), "{variant} {cache:?}: {text:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
