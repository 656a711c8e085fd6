//! Incremental decoding against full recomputation: feeding a sequence through the key/value
//! cache (a prompt, then one token at a time, then a chunk) gives, at every position, the logits
//! of one forward over the whole sequence — for GQA (tied and untied), MoE, and DeepSeek's MLA
//! with YaRN. The mirror: a cache that forgot its positions (cleared mid-sequence) no longer
//! matches, so the comparison can fail.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::decoder::{Config, Decoder};
use ferrotext_models::init_normal;
use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::Tensor;

const LEN: usize = 11;

fn model(preset: &str, tied: Option<bool>) -> Decoder {
    let mut cfg = Config::preset(preset).unwrap();
    cfg.base_num_decoder_layers = cfg.base_num_decoder_layers.min(3);
    if let Some(tied) = tied {
        cfg.logits_via_embedding = tied;
    }
    Decoder::new(cfg).unwrap()
}

/// Logits `[B, LEN, V]` of a full forward, and of the same tokens fed through the cache in
/// `chunks` (lengths summing to `LEN`), each on host; `clear_at` forgets the cache before that
/// chunk (the mirror case).
fn full_and_cached(
    model: &Decoder,
    chunks: &[usize],
    clear_at: Option<usize>,
) -> (Tensor, Vec<Tensor>) {
    let values: Vec<Tensor> = model
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| init_normal(p, 11, i))
        .collect();
    let vocab = model.config().vocab_size as u32;
    let batch = 2;
    let tokens: Vec<u32> = (0..batch * LEN)
        .map(|i| (i as u32 * 37 + 5) % vocab)
        .collect();
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let replicated = NamedSharding::new(mesh.clone(), PartitionSpec::replicated()).unwrap();
        let params: Vec<Array> = values
            .iter()
            .map(|v| cx.from_global(v, replicated.clone()))
            .collect::<Result<_, _>>()?;
        let spec = PartitionSpec::replicated();
        let ids = cx.ids_from_global(&[batch, LEN], spec.clone(), &tokens)?;
        let full = model.logits(&mut cx, &params, &ids)?;
        let full = cx.to_host(&full)?;
        let mut cache = model.new_cache();
        let mut parts = Vec::new();
        let mut at = 0;
        for (i, &n) in chunks.iter().enumerate() {
            if clear_at == Some(i) {
                cache.clear();
            }
            let chunk: Vec<u32> = (0..batch)
                .flat_map(|b| tokens[b * LEN + at..b * LEN + at + n].to_vec())
                .collect();
            let ids = cx.ids_from_global(&[batch, n], spec.clone(), &chunk)?;
            let logits = model.decode(&mut cx, &params, &ids, &mut cache)?;
            parts.push(cx.to_host(&logits)?);
            at += n;
        }
        if clear_at.is_none() {
            assert_eq!(cache.len(), LEN, "the cache holds every position fed");
        }
        Ok::<_, SpmdError>((full, parts))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// The largest difference between the cached logits and the full forward's, position by
/// position.
fn max_gap(full: &Tensor, parts: &[Tensor]) -> f32 {
    let mut at = 0;
    let mut gap = 0f32;
    for part in parts {
        let n = part.shape()[1];
        let want = full
            .slice(&[0..full.shape()[0], at..at + n, 0..full.shape()[2]])
            .unwrap();
        for (a, b) in part.data().iter().zip(want.data()) {
            gap = gap.max((a - b).abs());
        }
        at += n;
    }
    gap
}

/// A prompt of 4, single tokens, and a chunk of 2 (several new positions over a cache).
fn chunks() -> Vec<usize> {
    let c = vec![4, 1, 1, 1, 2, 1, 1];
    assert_eq!(c.iter().sum::<usize>(), LEN);
    c
}

#[test]
fn cached_decoding_matches_full_recomputation_for_every_attention_and_mlp() {
    for (preset, tied) in [
        ("qwen3-tiny", Some(true)),
        ("qwen3-tiny", Some(false)),
        ("qwen3-moe-tiny", None),
        ("deepseek3-tiny", None),
    ] {
        let m = model(preset, tied);
        let (full, parts) = full_and_cached(&m, &chunks(), None);
        let scale = full.data().iter().fold(0f32, |a, v| a.max(v.abs()));
        let gap = max_gap(&full, &parts);
        assert!(scale > 0.0, "{preset}: all-zero logits prove nothing");
        assert!(
            gap <= 1e-5 * scale.max(1.0),
            "{preset} tied={tied:?}: gap {gap}"
        );
    }
}

#[test]
fn a_cache_that_lost_its_positions_no_longer_matches() {
    let m = model("qwen3-tiny", None);
    // clearing before the 3rd chunk: positions 5.. see no past and sit at the wrong RoPE angle
    let (full, parts) = full_and_cached(&m, &chunks(), Some(2));
    let gap = max_gap(&full, &parts);
    assert!(
        gap > 1e-3,
        "gap {gap}: the comparison cannot tell a broken cache"
    );
}

#[test]
fn a_cache_for_another_depth_is_refused() {
    let m = model("qwen3-tiny", None);
    let cache = ferrotext_models::KvCache::new(m.config().base_num_decoder_layers + 1);
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    let err = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let ids = cx.ids_from_global(&[1, 1], PartitionSpec::replicated(), &[3])?;
        m.decode(&mut cx, &[], &ids, &mut cache.clone()).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("the cache has"), "{err}");
}
