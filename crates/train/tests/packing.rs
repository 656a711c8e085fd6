//! `packing=true` on token shards: each window's documents are found by their EOS, the target
//! after an EOS is not scored (fewer tokens count), and the model sees the documents (other
//! losses than the same windows unpacked: the mirror); and packing without delimited documents
//! is refused by name. Layout invariance and resumption of packed runs are in
//! `packing_layout_invariant.rs`, a binary of its own.

use std::path::{Path, PathBuf};

use ferrotext_train::{train, RunOptions, TrainConfig};
mod common;

use common::packed::{config, losses, shards};
use common::scratch::scratch;

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
    // The model's shapes are the directory's (no shape key may say otherwise).
    let load_with = |extra: &[&str]| {
        let mut all = vec![
            "dataset_type=shards",
            "dataset_path=unused",
            "max_target_length=24",
        ];
        all.extend_from_slice(extra);
        let all: Vec<String> = all.iter().map(|s| s.to_string()).collect();
        TrainConfig::load(None, &all)
    };
    let refused = |extra: &[&str]| {
        let err = load_with(extra).unwrap_err();
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
    load_with(&[&load, "packing=false"]).unwrap_or_else(|e| panic!("{e}"));
    // Another scaling (linear) is position by position: packing takes it.
    let linear = load.replace("llama-dynamic", "llama-linear");
    load_with(&[&linear, "packing=true"]).unwrap_or_else(|e| panic!("{e}"));
}
