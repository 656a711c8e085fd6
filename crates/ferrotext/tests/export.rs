//! `ferrotext export` through the binary: a trained run's checkpoint becomes a Hugging Face
//! directory holding exactly the checkpoint's parameters (read back through the library, and
//! trained from by `load_parameters_path`), the checkpoint is left untouched, and bad input gets
//! one error line, exit code 2, and nothing written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrotext_hf as hf;
use ferrotext_models::decoder::Decoder;
use ferrotext_models::ParamInfo;
use ferrotext_tensor::Tensor;
use ferrotext_train::io;

mod common;
use common::ferrotext;

/// A small qwen3-tiny, fast to train.
const MODEL: [&str; 4] = [
    "base_emb_dim=32",
    "base_mlp_dim=64",
    "head_dim=8",
    "max_target_length=16",
];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-export-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `ferrotext train` into `root/run` with the small model and `extra` keys; asserts success.
fn train(root: &Path, run: &str, extra: &[String]) {
    let mut args = vec![
        "train".to_string(),
        format!("base_output_directory={}", root.display()),
        format!("run_name={run}"),
    ];
    args.extend(MODEL.iter().map(|s| s.to_string()));
    args.extend_from_slice(extra);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let res = ferrotext(&argv);
    assert!(
        res.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&res.stderr)
    );
}

/// A run `root/a` of two steps with a checkpoint after each, and its final parameters in
/// `root/final.safetensors`.
fn trained(root: &Path) -> PathBuf {
    train(
        root,
        "a",
        &[
            "steps=2".into(),
            "enable_checkpointing=true".into(),
            "checkpoint_period=1".into(),
            format!(
                "save_parameters_path={}",
                root.join("final.safetensors").display()
            ),
        ],
    );
    root.join("a")
}

/// Every file under `dir`, with its bytes.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut files = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("readable") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).expect("readable");
                files.insert(path, bytes);
            }
        }
    }
    files
}

/// The model of a HF directory and its parameters, through the library.
fn load_hf(dir: &Path) -> (Vec<ParamInfo>, Vec<Tensor>) {
    let cfg = hf::read_config(dir).expect("config.json");
    let infos = Decoder::new(cfg).expect("valid model").params();
    let values = io::load_parameters(dir, &infos).expect("loads");
    (infos, values)
}

/// `x` rounded to bfloat16, to nearest even (finite `x`).
fn bf16_round(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

fn checkpoint(run: &Path, step: usize) -> PathBuf {
    run.join(format!("checkpoints/step_{step:08}_micro_000"))
}

/// The `loss` of the first line of a run's metrics, as written.
fn first_loss(run: &Path) -> String {
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics");
    let line: serde_json::Value =
        serde_json::from_str(metrics.lines().next().expect("a line")).expect("JSON");
    line["loss"].to_string()
}

#[test]
fn a_checkpoint_exports_as_a_hf_directory_holding_its_parameters() {
    let root = scratch("ok");
    let run = trained(&root);
    let before = snapshot(&run.join("checkpoints"));

    // The latest checkpoint of the run directory, f32: exactly the checkpoint's values.
    let out = root.join("hf");
    let res = ferrotext(&["export", &run.to_string_lossy(), &out.to_string_lossy()]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(stdout.contains("exported step 2 of"), "{stdout}");
    assert!(stdout.contains("qwen3 (float32)"), "{stdout}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config"))
            .expect("JSON");
    assert_eq!(config["model_type"], "qwen3");
    assert_eq!(config["hidden_size"], 32);
    assert!(out.join("model.safetensors").is_file());
    let (infos, exported) = load_hf(&out);
    let saved = io::load_parameters(&checkpoint(&run, 2).join("params.safetensors"), &infos)
        .expect("checkpoint parameters");
    assert_eq!(exported, saved);
    let last = io::load_parameters(&root.join("final.safetensors"), &infos).expect("final");
    assert_eq!(exported, last);

    // A named step, bf16, sharded: the step's values rounded to bf16.
    let out16 = root.join("hf16");
    let res = ferrotext(&[
        "export",
        &run.join("checkpoints").to_string_lossy(),
        &out16.to_string_lossy(),
        "--step",
        "1",
        "--dtype",
        "bf16",
        "--max-shard-bytes",
        "20000",
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out16.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("JSON");
    let shards: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .expect("a map")
        .values()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(shards.len() >= 2, "{shards:?}");
    let (_, exported16) = load_hf(&out16);
    let step1 = io::load_parameters(&checkpoint(&run, 1).join("params.safetensors"), &infos)
        .expect("checkpoint parameters");
    let rounded: Vec<Tensor> = step1
        .iter()
        .map(|t| {
            let data = t.data().iter().map(|&x| bf16_round(x)).collect();
            Tensor::new(t.shape().to_vec(), data).expect("same shape")
        })
        .collect();
    assert_eq!(exported16, rounded);
    assert_ne!(exported16, exported);

    // Exporting again replaces the earlier export (a model directory).
    let res = ferrotext(&[
        "export",
        &checkpoint(&run, 2).to_string_lossy(),
        &out16.to_string_lossy(),
    ]);
    assert!(res.status.success());
    assert_eq!(load_hf(&out16).1, exported);

    // The checkpoints were only read.
    assert_eq!(snapshot(&run.join("checkpoints")), before);

    // A run started from the export starts where one started from the final parameters does:
    // the same first loss, to the last digit.
    train(
        &root,
        "from-export",
        &[
            "steps=1".into(),
            format!("load_parameters_path={}", out.display()),
        ],
    );
    train(
        &root,
        "from-final",
        &[
            "steps=1".into(),
            format!(
                "load_parameters_path={}",
                root.join("final.safetensors").display()
            ),
        ],
    );
    assert_eq!(
        first_loss(&root.join("from-export")),
        first_loss(&root.join("from-final"))
    );
    // ... and not where a fresh start does: the export was loaded.
    assert_ne!(first_loss(&root.join("from-export")), first_loss(&run));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn bad_exports_get_one_error_line_exit_2_and_write_nothing() {
    let root = scratch("bad");
    let run = trained(&root);
    let before = snapshot(&run.join("checkpoints"));
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).expect("dir");
    let busy = root.join("busy");
    std::fs::create_dir_all(&busy).expect("dir");
    std::fs::write(busy.join("notes.txt"), "mine").expect("file");
    // A copy of the last checkpoint with one byte of its parameters changed.
    let broken = root.join("broken/step_00000002_micro_000");
    std::fs::create_dir_all(&broken).expect("dir");
    for (path, bytes) in snapshot(&checkpoint(&run, 2)) {
        let name = path.file_name().expect("a name");
        std::fs::write(broken.join(name), bytes).expect("copy");
    }
    let mut params = std::fs::read(broken.join("params.safetensors")).expect("params");
    let last = params.len() - 1;
    params[last] ^= 1;
    std::fs::write(broken.join("params.safetensors"), params).expect("write");

    let out = root.join("out");
    let inside = checkpoint(&run, 2).join("hf");
    let beside = checkpoint(&run, 1).join("hf");
    let in_root = run.join("checkpoints/x");
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let cases: Vec<(Vec<String>, &Path, &str)> = vec![
        (vec![s(&empty), s(&out)], &out, "holds no checkpoint"),
        (
            vec![s(&root.join("nowhere")), s(&out)],
            &out,
            "is not a directory",
        ),
        (
            vec![s(&run), s(&out), "--step".into(), "7".into()],
            &out,
            "has no checkpoint of step 7 at a step boundary (steps here: 1, 2)",
        ),
        (
            vec![
                s(&checkpoint(&run, 2)),
                s(&out),
                "--step".into(),
                "1".into(),
            ],
            &out,
            "is the checkpoint of step 2, not of --step 1",
        ),
        (
            vec![s(&broken), s(&out)],
            &out,
            "checksum mismatch: the file is corrupt or was modified",
        ),
        (
            vec![s(&run), s(&out), "--dtype".into(), "f16".into()],
            &out,
            "--dtype must be float32 or bfloat16 (or f32, bf16), got `f16`",
        ),
        (
            vec![s(&run), s(&inside)],
            &inside,
            "lies inside the checkpoint",
        ),
        (
            vec![s(&run), s(&beside)],
            &beside,
            "lies inside the checkpoint directory",
        ),
        (
            vec![s(&run.join("checkpoints/../checkpoints")), s(&in_root)],
            &in_root,
            "lies inside the checkpoint directory",
        ),
        (
            vec![s(&run), s(&busy)],
            &busy,
            "exists and is not a model directory (no config.json): not replaced",
        ),
        // An output that cannot be written is found before the checkpoint is read.
        (
            vec![s(&run), "/proc/ferrotext-export".into()],
            Path::new("/proc/ferrotext-export"),
            "OUT_DIR: /proc/ferrotext-export cannot be written",
        ),
        (
            vec![s(&run), s(&out), "--max-shard-bytes".into(), "0".into()],
            &out,
            "--max-shard-bytes must be at least 1",
        ),
    ];
    for (args, target, needle) in cases {
        let mut argv = vec!["export"];
        argv.extend(args.iter().map(String::as_str));
        let res = ferrotext(&argv);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        if target == busy {
            assert_eq!(
                std::fs::read_dir(&busy).expect("dir").count(),
                1,
                "{args:?}: left alone"
            );
        } else {
            assert!(!target.exists(), "{args:?} wrote {}", target.display());
        }
        // Nothing beside the target either (no temporary directory left behind).
        let stray: Vec<_> = std::fs::read_dir(&root)
            .expect("dir")
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(stray.is_empty(), "{args:?}: {stray:?}");
        assert_eq!(snapshot(&run.join("checkpoints")), before, "{args:?}");
    }
    std::fs::remove_dir_all(&root).ok();
}

/// A copy in `root/source` of transformers' llama3 directory (a fixture), to edit.
fn llama3_source(root: &Path) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hf/tests/fixtures/transformers/llama3-untied-tf5-f32-single");
    let source = root.join("source");
    std::fs::create_dir_all(&source).expect("source dir");
    for entry in std::fs::read_dir(&fixture).expect("fixture") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, source.join(path.file_name().expect("name"))).expect("copy");
    }
    source
}

/// `ferrotext train` of one step from the HF directory `source` into `root/r`, saving the final
/// parameters as the directory `root/final`, with `extra` keys.
fn train_from(source: &Path, root: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "train".to_string(),
        format!("load_parameters_path={}", source.display()),
        format!("base_output_directory={}", root.display()),
        "run_name=r".into(),
        "steps=1".into(),
        format!("save_parameters_path={}", root.join("final").display()),
        "local_devices=1".into(),
        "ici_data_parallelism=1".into(),
        "per_device_batch_size=1".into(),
        "max_target_length=16".into(),
        "dataset_type=synthetic".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    ferrotext(&argv)
}

/// A model trained from a Hugging Face directory is saved and exported declaring what that
/// directory declared beyond the decoder, as transformers' own `save_pretrained` of the loaded
/// model would: its special tokens (a list of stop tokens included), its context
/// (`max_position_embeddings`, which no family default matches here), its
/// `generation_config.json` and its tokenizer's files, byte for byte. The mirror: a model from a
/// preset declares the family's defaults (no token ids, its family's context), no generation
/// defaults and no tokenizer.
#[test]
fn a_model_from_a_hf_directory_keeps_what_that_directory_declared() {
    let root = scratch("declared");
    let source = llama3_source(&root);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).expect("config"))
            .expect("json");
    let declared = serde_json::json!({
        "bos_token_id": 3,
        "eos_token_id": [5, 7],
        "pad_token_id": 0,
        "max_position_embeddings": 1000,
    });
    for (k, v) in declared.as_object().expect("object") {
        config[k] = v.clone();
    }
    std::fs::write(source.join("config.json"), config.to_string()).expect("write");
    let generation =
        br#"{"bos_token_id": 3, "eos_token_id": [5, 7], "do_sample": true, "temperature": 0.6}"#;
    std::fs::write(source.join("generation_config.json"), generation).expect("write");
    // A tokenizer beside it (a word-level one written by Python's tokenizers).
    let tokenizer = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tests/fixtures/wordlevel_bos.json"),
    )
    .expect("tokenizer");
    let tokenizer_config = br#"{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}"#;
    std::fs::write(source.join("tokenizer.json"), &tokenizer).expect("write");
    std::fs::write(source.join("tokenizer_config.json"), tokenizer_config).expect("write");
    let files: [(&str, &[u8]); 3] = [
        ("generation_config.json", generation),
        ("tokenizer.json", &tokenizer),
        ("tokenizer_config.json", tokenizer_config),
    ];
    let res = train_from(
        &source,
        &root,
        &["enable_checkpointing=true", "checkpoint_period=1"],
    );
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let out = root.join("exported");
    let res = ferrotext(&[
        "export",
        &root.join("r").display().to_string(),
        &out.display().to_string(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let read = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config"))
            .expect("json")
    };
    for dir in [out.clone(), root.join("final")] {
        let written = read(&dir);
        for (k, v) in declared.as_object().expect("object") {
            assert_eq!(&written[k], v, "{}: {k}", dir.display());
        }
        for (name, bytes) in files {
            assert_eq!(
                std::fs::read(dir.join(name)).expect("declared file"),
                bytes,
                "{}: {name}",
                dir.display()
            );
        }
    }
    // The mirror: a preset's export declares none of it.
    let preset = trained(&root.join("preset"));
    let out = root.join("preset-exported");
    let res = ferrotext(&[
        "export",
        &preset.display().to_string(),
        &out.display().to_string(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let written = read(&out);
    for k in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        assert!(
            written.get(k).is_none(),
            "a preset declares no {k}: {written}"
        );
    }
    assert_eq!(
        written["max_position_embeddings"], 40960,
        "qwen3's own context"
    );
    for (name, _) in files {
        assert!(!out.join(name).exists(), "a preset has no {name}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// A source directory whose `generation_config.json` does not read fails a run that would save
/// a directory from it before it trains (one `error:` line naming the file, exit 2), not after.
#[test]
fn a_source_whose_generation_config_does_not_read_fails_before_training() {
    let root = scratch("bad-generation-config");
    let source = llama3_source(&root);
    std::fs::write(source.join("generation_config.json"), b"{not json").expect("write");
    let res = train_from(&source, &root, &[]);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert_eq!(res.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("generation_config.json"), "{stderr}");
    assert!(!root.join("r").join("metrics.jsonl").exists(), "it trained");
    let _ = std::fs::remove_dir_all(&root);
}
