//! Token shards of short EOS-delimited documents and the small model that packs them, for the
//! packing tests.

use std::path::{Path, PathBuf};

use ferrotext_data::{ShardWriter, TokenizerInfo};
use ferrotext_train::{TrainConfig, TrainReport};

/// The documents' end-of-sequence id.
pub const EOS: u32 = 199;

/// Two shards of documents of 3 to 13 tokens (ids below EOS), each ending in EOS.
pub fn shards(dir: &Path) -> PathBuf {
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

pub fn config(data: &Path, extra: &[&str]) -> TrainConfig {
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

pub fn losses(r: &TrainReport) -> Vec<u64> {
    r.metrics.iter().map(|m| m.loss.to_bits()).collect()
}
