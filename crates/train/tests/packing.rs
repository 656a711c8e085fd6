//! `packing=true` on token shards: each window's documents are found by their EOS, the target
//! after an EOS is not scored (fewer tokens count), and the model sees the documents (other
//! losses than the same windows unpacked: the mirror); the documents come from the tokens alone,
//! so a packed run keeps `layout_invariant`'s bits across layouts and resumes bit for bit; and packing without delimited documents is refused by name.

use std::path::{Path, PathBuf};

use ferrotext_data::{ShardWriter, TokenizerInfo};
use ferrotext_train::{train, RunOptions, TrainConfig, TrainReport};

const EOS: u32 = 199;

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ferrotext-packing-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Two shards of documents of 3 to 13 tokens (ids below EOS), each ending in EOS.
fn shards(dir: &Path) -> PathBuf {
    let out = dir.join("shards");
    let info = TokenizerInfo {
        sha256: ferrotext_data::format::sha256_hex(b"tokenizer"),
        vocab_size: 200,
        eos_id: EOS,
    };
    let mut w = ShardWriter::create(&out, info, 400).unwrap();
    for d in 0..120u32 {
        let len = 3 + (d * 7) % 11;
        let ids: Vec<u32> = (0..len).map(|i| (d * 31 + i * 17) % EOS).collect();
        w.push_document(&ids).unwrap();
    }
    w.finish("test").unwrap();
    out
}

fn config(data: &Path, extra: &[&str]) -> TrainConfig {
    let path = format!("dataset_path={}", data.display());
    let mut all = vec![
        "vocab_size=200",
        "base_emb_dim=32",
        "base_num_decoder_layers=2",
        "base_num_query_heads=4",
        "base_num_kv_heads=2",
        "head_dim=8",
        "base_mlp_dim=64",
        "max_target_length=24",
        "per_device_batch_size=1",
        "steps=3",
        "dataset_type=shards",
        "dataset_order=sequential",
        &path,
    ];
    all.extend_from_slice(extra);
    let all: Vec<String> = all.iter().map(|s| s.to_string()).collect();
    TrainConfig::load(None, &all).unwrap_or_else(|e| panic!("{e}"))
}

fn losses(r: &TrainReport) -> Vec<u64> {
    r.metrics.iter().map(|m| m.loss.to_bits()).collect()
}

#[test]
fn packed_windows_score_fewer_targets_and_train_other_numbers() {
    let dir = scratch("mirror");
    let data = shards(&dir);
    let out = format!("base_output_directory={}", dir.display());
    let run = |packing: &str| train(&config(&data, &[&out, packing]), &RunOptions::default());
    let (packed, plain) = (run("packing=true").unwrap(), run("packing=false").unwrap());
    for (p, u) in packed.metrics.iter().zip(&plain.metrics) {
        // Every window holds an EOS whose next token is not scored when packed.
        assert!(p.tokens < u.tokens, "{} vs {}", p.tokens, u.tokens);
    }
    assert_ne!(losses(&packed), losses(&plain));
}

#[test]
fn packed_runs_keep_layout_invariance_and_resume_bit_for_bit() {
    let dir = scratch("layouts");
    let data = shards(&dir);
    let out = format!("base_output_directory={}", dir.display());
    let layout = |devices: usize, ga: usize, run: &str, extra: &[&str]| {
        let keys = [
            format!("local_devices={devices}"),
            format!("ici_data_parallelism={devices}"),
            format!("gradient_accumulation_steps={ga}"),
            format!("run_name={run}"),
        ];
        let mut all: Vec<&str> = keys.iter().map(String::as_str).collect();
        all.extend_from_slice(&[
            &out,
            "packing=true",
            "layout_invariant=true",
            "deterministic=true",
        ]);
        all.extend_from_slice(extra);
        config(&data, &all)
    };
    if std::env::var("FERROTEXT_MATMUL").is_ok_and(|k| !k.is_empty() && k != "portable") {
        // A library kernel forced (`.ci/kernel-paths`): deterministic=true is refused there.
        assert!(train(&layout(2, 1, "a", &[]), &RunOptions::default()).is_err());
        return;
    }
    let two = train(&layout(2, 1, "two", &[]), &RunOptions::default()).unwrap();
    let one = train(&layout(1, 2, "one", &[]), &RunOptions::default()).unwrap();
    assert_eq!(losses(&two), losses(&one));
    // Stopped after step 1 and resumed from its checkpoint: the documents come from the
    // tokens the resumed run reads again.
    let ckpt = ["enable_checkpointing=true", "checkpoint_period=1"];
    let stop = RunOptions {
        stop_after_steps: Some(1),
        ..Default::default()
    };
    let first = train(&layout(1, 2, "split", &ckpt), &stop).unwrap();
    let rest = train(&layout(1, 2, "split", &ckpt), &RunOptions::default()).unwrap();
    let mut resumed = losses(&first);
    resumed.extend(losses(&rest));
    assert_eq!(resumed, losses(&one));
}

#[test]
fn packing_without_document_boundaries_is_refused_by_name() {
    let data = PathBuf::from("unused");
    let mut cfg = config(&data, &["packing=true"]);
    cfg.dataset_type = ferrotext_train::DatasetType::Synthetic;
    cfg.dataset_path = String::new();
    let err = cfg.plan().unwrap_err();
    assert!(err.is_usage(), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with("packing"), "{msg}");
    assert!(msg.contains("dataset_type=synthetic"), "{msg}");
}

/// `rope_type: dynamic` grows θ with the rotated sequence's last position: packed documents
/// restart their positions, and a context device holds a slice of them, so both are refused by
/// name (the mirror: the same model unpacked on one context device is taken).
#[test]
fn dynamic_rope_is_refused_with_packing_and_with_context_parallelism() {
    let hf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hf/tests/fixtures/transformers/llama-dynamic-tf5-f32-single");
    let load = format!("load_parameters_path={}", hf.display());
    let refused = |extra: &[&str]| {
        let mut all = vec![
            "dataset_type=shards",
            "dataset_path=unused",
            "max_target_length=24",
        ];
        all.extend_from_slice(extra);
        let all: Vec<String> = all.iter().map(|s| s.to_string()).collect();
        let err = TrainConfig::load(None, &all).unwrap_err();
        assert!(err.is_usage(), "{err}");
        err.to_string()
    };
    assert_eq!(
        refused(&[&load, "packing=true"]),
        "packing=true cannot be used with dynamic RoPE scaling (rope_type `dynamic`): its \
         frequencies follow the sequence's last position, which packed documents restart"
    );
    let context = refused(&[&load, "ici_context_parallelism=2", "ici_data_parallelism=2"]);
    assert!(
        context.starts_with("ici_context_parallelism = 2 cannot be used with dynamic RoPE"),
        "{context}"
    );
    config(&PathBuf::from("unused"), &[&load, "packing=false"]);
    // Another scaling (linear) is position by position: packing takes it.
    let linear = load.replace("llama-dynamic", "llama-linear");
    config(&PathBuf::from("unused"), &[&linear, "packing=true"]);
}
