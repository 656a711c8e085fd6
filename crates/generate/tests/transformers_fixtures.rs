//! Conformance with transformers itself (issue 29 item 4): every checkpoint directory under
//! `crates/hf/tests/fixtures/transformers/` was written by transformers' `save_pretrained` (4.x
//! or 5, f32 or bf16, one file or sharded) with its float64 step-0 loss and 16 greedy tokens in
//! `expected.json`. Each is loaded (config and weights), its loss on the same tokens computed and
//! compared within 1e-6, its greedy tokens compared exactly, then it is exported by ferrotext's
//! writer and reloaded (same loss), the export holding the tensors transformers' own save writes
//! for that model, name for name and shape for shape.
//!
//! Directories this test does not cover are listed in [`NOT_HERE`] with the reason; any other
//! directory is covered, so a new fixture is never skipped silently.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_generate::generate::{generate, GenerateOptions};
use ferrotext_generate::sample::SamplingParams;
use ferrotext_hf as hf;
use ferrotext_models::decoder::Decoder;
use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::on_device;
use ferrotext_tensor::Tensor;
use serde_json::Value;

/// Fixture directories (by name prefix) covered elsewhere, and why.
const NOT_HERE: &[(&str, &str)] = &[(
    "qwen3-tiedown-tf4-",
    "transformers 4.57 overwrites a tied config's stored head of its own with the embedding; \
     ferrotext loads it as 5.x does, keeping the head \
     (`a_tied_config_whose_weights_store_a_head_loads_as_transformers_5_does`)",
)];

/// The allowed distance to transformers' float64 loss.
const LOSS_TOLERANCE: f64 = 1e-6;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../hf/tests/fixtures/transformers")
}

/// The directories under the fixtures that hold a checkpoint (`config.json`), sorted.
fn checkpoints() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn expected(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The rows of token ids an `expected.json` scores.
fn rows_of(want: &Value) -> Vec<Vec<u32>> {
    want["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect()
}

/// Each tensor's stored dtype (`"BF16"`, `"F32"`, ...) and shape across the safetensors files
/// of `dir`, from their JSON headers.
fn stored_tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>)> {
    let mut tensors = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
        for (name, tensor) in header.as_object().unwrap() {
            if let Some(dtype) = tensor.get("dtype").and_then(Value::as_str) {
                let shape = tensor["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap() as usize)
                    .collect();
                tensors.insert(name.clone(), (dtype.to_string(), shape));
            }
        }
    }
    tensors
}

/// The tensors (name and shape) transformers' `save_pretrained` writes for the model it loads
/// from `dir`: what `dir` stores, less what no save writes back (a tied model's stored head; the
/// RoPE frequencies older conversions stored).
fn saved_by_transformers(dir: &Path, tied: bool) -> BTreeMap<String, Vec<usize>> {
    stored_tensors(dir)
        .into_iter()
        .filter(|(name, _)| !(tied && name == "lm_head.weight"))
        .filter(|(name, _)| !name.ends_with("rotary_emb.inv_freq"))
        .map(|(name, (_, shape))| (name, shape))
        .collect()
}

/// How the tensors exported to `out` differ, by name or shape, from those transformers'
/// `save_pretrained` writes for the model of the fixture `dir` (`tied`: its head is tied), or
/// `None`.
fn export_differs(out: &Path, dir: &Path, tied: bool) -> Option<String> {
    let ours: BTreeMap<String, Vec<usize>> = stored_tensors(out)
        .into_iter()
        .map(|(n, (_, shape))| (n, shape))
        .collect();
    let theirs = saved_by_transformers(dir, tied);
    let only = |a: &BTreeMap<String, Vec<usize>>, b: &BTreeMap<String, Vec<usize>>| {
        a.iter()
            .filter(|(n, s)| b.get(*n) != Some(*s))
            .map(|(n, s)| format!("`{n}` {s:?}"))
            .collect::<Vec<_>>()
    };
    (ours != theirs).then(|| {
        format!(
            "the export writes {:?} where transformers writes {:?}",
            only(&ours, &theirs),
            only(&theirs, &ours)
        )
    })
}

/// The decoder and its parameters as read from `dir`.
fn load(dir: &Path) -> (Decoder, Vec<Tensor>) {
    let cfg = hf::read_config(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let decoder = Decoder::new(cfg).unwrap();
    let params = hf::load_directory(dir, &decoder.params())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    (decoder, params)
}

/// The mean next-token cross-entropy over every predicted position of `rows` (all of equal
/// length), from the decoder's f32 logits, summed in f64.
fn loss(decoder: &Decoder, params: &[Tensor], rows: &[Vec<u32>]) -> f64 {
    let (b, t) = (rows.len(), rows[0].len());
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    let logits = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        on_device(dev, |cx| {
            let replicated = NamedSharding::new(mesh.clone(), PartitionSpec::replicated())?;
            let weights = params
                .iter()
                .map(|p| cx.from_global(p, replicated.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            let ids = cx.ids_from_global(&[b, t], PartitionSpec::replicated(), &flat)?;
            let logits = decoder.logits(cx, &weights, &ids)?;
            cx.to_host(&logits)
        })
    })
    .unwrap()
    .remove(0);
    let vocab = logits.shape()[2];
    let mut sum = 0.0;
    for (r, row) in rows.iter().enumerate() {
        for p in 0..t - 1 {
            let at = (r * t + p) * vocab;
            let z: Vec<f64> = logits.data()[at..at + vocab]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let log_sum = max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            sum += log_sum - z[row[p + 1] as usize];
        }
    }
    sum / (b * (t - 1)) as f64
}

fn greedy(decoder: &Decoder, params: &[Tensor], prompt: &[u32], n: usize) -> Vec<u32> {
    let options = GenerateOptions {
        max_new_tokens: n,
        sampling: SamplingParams::default(),
        stop_tokens: vec![],
        context: prompt.len() + n + 1,
        use_cache: true,
    };
    generate(decoder, params, prompt, &options, &|_| Ok(()))
        .unwrap()
        .tokens
}

/// Every covered directory: loss within 1e-6, greedy tokens equal, export and reload equal (a
/// bf16 one also exported in bf16: transformers' dtype for every tensor, and the same loss).
#[test]
fn transformers_checkpoints_load_with_their_loss_and_greedy_tokens_and_export_back() {
    let mut covered = Vec::new();
    let mut failures = Vec::new();
    let scratch =
        std::env::temp_dir().join(format!("ferrotext-tf-fixtures-{}", std::process::id()));
    for dir in checkpoints() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        if NOT_HERE.iter().any(|(prefix, _)| name.starts_with(prefix)) {
            continue;
        }
        let want = expected(&dir);
        let rows = rows_of(&want);
        let (decoder, params) = load(&dir);
        let got = loss(&decoder, &params, &rows);
        let reference = want["loss"].as_f64().unwrap();
        if (got - reference).abs() > LOSS_TOLERANCE {
            failures.push(format!("{name}: loss {got} vs transformers {reference}"));
        }
        eprintln!(
            "{name}: loss {got:.9} transformers {reference:.9} (Δ {:.1e})",
            got - reference
        );
        let tokens = greedy(&decoder, &params, &ids(&want["prompt"]), 16);
        if tokens != ids(&want["greedy_tokens"]) {
            failures.push(format!(
                "{name}: greedy {tokens:?} vs transformers {:?}",
                ids(&want["greedy_tokens"])
            ));
        }
        // Export with ferrotext's writer, read back: the same loss.
        let out = scratch.join(&name);
        hf::save_directory(
            &out,
            decoder.config(),
            &decoder.params(),
            &params,
            ferrotext_sharding::DType::F32,
            hf::DEFAULT_SHARD_BYTES,
        )
        .unwrap();
        // The tensors written are the ones transformers writes for this model.
        if let Some(differ) = export_differs(&out, &dir, decoder.config().logits_via_embedding) {
            failures.push(format!("{name}: {differ}"));
        }
        let (again, reloaded) = load(&out);
        assert_eq!(
            again.config(),
            decoder.config(),
            "{name}: config after export"
        );
        let reread = loss(&again, &reloaded, &rows);
        if reread != got {
            failures.push(format!("{name}: loss after export {reread} vs {got}"));
        }
        // A bf16 checkpoint exported in bf16: the same loss (every value was a bf16 or an f32
        // already), and every tensor in the dtype transformers 5 stored it in (DeepSeek's routers
        // stay float32, `_keep_in_fp32_modules_strict`; 4.57 rounded them to bf16 too, so its
        // directories are no reference for the dtypes).
        if name.contains("-bf16-") {
            let out = scratch.join(format!("{name}-bf16"));
            hf::save_directory(
                &out,
                decoder.config(),
                &decoder.params(),
                &params,
                ferrotext_sharding::DType::BF16,
                hf::DEFAULT_SHARD_BYTES,
            )
            .unwrap();
            let (theirs, ours) = (stored_tensors(&dir), stored_tensors(&out));
            let differ: Vec<String> = theirs
                .iter()
                .filter(|_| name.contains("-tf5-"))
                .filter_map(|(t, (dtype, _))| {
                    let (mine, _) = ours.get(t)?;
                    (mine != dtype).then(|| format!("{t}: {mine} (transformers: {dtype})"))
                })
                .collect();
            if !differ.is_empty() {
                failures.push(format!("{name}: bf16 export stores {}", differ.join(", ")));
            }
            let (again, reloaded) = load(&out);
            let reread = loss(&again, &reloaded, &rows);
            if reread != got {
                failures.push(format!("{name}: loss after bf16 export {reread} vs {got}"));
            }
        }
        covered.push(name);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The families the issue names are all here, in both generations.
    for family in [
        "qwen3-tied",
        "qwen3-tiedcopy",
        "qwen3-untied",
        "qwen3-yarn",
        "qwen3-bias",
        "qwen3-sliding",
        "qwen3_moe",
        "qwen3_moe-sparse",
        "llama3",
        "llama3-invfreq",
        "llama-bias",
        "llama-linear",
        "llama-dynamic",
        "qwen2",
        "qwen2-sliding",
        "deepseek_v3",
        "deepseek_v3-noqlora",
        "mistral",
        "mixtral",
        "qwen2_moe",
        "olmo2",
        "gemma2",
        "gemma3_text",
        "deepseek_v2-lite",
        "deepseek_v2-groups",
    ] {
        for generation in ["-tf4-", "-tf5-"] {
            assert!(
                covered
                    .iter()
                    .any(|c| c.starts_with(family) && c.contains(generation)),
                "no {family}{generation} fixture covered: {covered:?}"
            );
        }
    }
}

/// A tied config (`tie_word_embeddings: true`) whose weights hold `lm_head.weight` anyway, as
/// the Hub's Qwen/Qwen3-0.6B does. A copy of the embedding loads tied; a head of its own loads
/// untied, the model transformers 5 computes (4.57 overwrites the head with the embedding, so
/// its number for that directory is the tied model's); a model tied by hand refuses that head,
/// naming it and the key to set, rather than drop it.
#[test]
fn a_tied_config_whose_weights_store_a_head_loads_as_transformers_5_does() {
    // What transformers loaded: the head is the embedding exactly when ferrotext ties it.
    for name in [
        "qwen3-tiedcopy-tf4-f32-single",
        "qwen3-tiedcopy-tf5-f32-single",
        "qwen3-tiedown-tf5-f32-single",
    ] {
        let dir = fixtures().join(name);
        let tied = hf::read_config(&dir).unwrap().logits_via_embedding;
        assert_eq!(
            tied,
            expected(&dir)["head_is_embedding"].as_bool().unwrap(),
            "{name}"
        );
    }
    // What a run's header says: a head of its own unties the config's tie; nothing else does.
    for (name, untied) in [
        ("qwen3-tiedown-tf4-f32-single", true),
        ("qwen3-tiedown-tf5-f32-single", true),
        ("qwen3-tiedcopy-tf5-f32-single", false),
        ("qwen3-tied-tf5-f32-single", false),
        ("qwen3-untied-tf5-f32-single", false),
    ] {
        assert_eq!(
            hf::head_untied_by_its_weights(&fixtures().join(name)),
            untied,
            "{name}"
        );
    }
    // The same weights written by 4.57: ferrotext's loss is 5.x's, not 4.57's.
    let (old, new) = (
        fixtures().join("qwen3-tiedown-tf4-f32-single"),
        fixtures().join("qwen3-tiedown-tf5-f32-single"),
    );
    let (decoder, params) = load(&old);
    assert!(!decoder.config().logits_via_embedding);
    let got = loss(&decoder, &params, &rows_of(&expected(&old)));
    let (tf5, tf4) = (
        expected(&new)["loss"].as_f64().unwrap(),
        expected(&old)["loss"].as_f64().unwrap(),
    );
    assert!((got - tf5).abs() <= LOSS_TOLERANCE, "{got} vs 5.x {tf5}");
    assert!(
        (got - tf4).abs() > 100.0 * LOSS_TOLERANCE,
        "{got} vs 4.57 {tf4}"
    );
    // Tied by hand, the head of its own is refused by name; the copy loads.
    let tied_by_hand = |dir: &Path| {
        let mut cfg = hf::read_config(dir).unwrap();
        cfg.logits_via_embedding = true;
        let decoder = Decoder::new(cfg).unwrap();
        hf::load_directory(dir, &decoder.params()).map(|p| (decoder, p))
    };
    let err = tied_by_hand(&new).err().unwrap().to_string();
    assert!(
        err.contains("unexpected tensor `lm_head.weight`")
            && err.contains("set logits_via_embedding=false"),
        "{err}"
    );
    let copy = fixtures().join("qwen3-tiedcopy-tf5-f32-single");
    assert!(tied_by_hand(&copy).is_ok());
    // Untied by hand, the copy is read as the head: the same loss as the tie.
    let want = expected(&copy);
    let mut cfg = hf::read_config(&copy).unwrap();
    cfg.logits_via_embedding = false;
    let decoder = Decoder::new(cfg).unwrap();
    let params = hf::load_directory(&copy, &decoder.params()).unwrap();
    let untied = loss(&decoder, &params, &rows_of(&want));
    assert!((untied - want["loss"].as_f64().unwrap()).abs() <= LOSS_TOLERANCE);
}

/// Mirror of the export's tensor check: an export that leaves out a tensor transformers writes
/// (an untied checkpoint written as a tied model, its head dropped) is reported, naming it.
#[test]
fn the_export_check_sees_a_tensor_left_out() {
    let dir = fixtures().join("qwen3-untied-tf5-f32-single");
    let (decoder, params) = load(&dir);
    let head = decoder
        .params()
        .iter()
        .position(|p| p.name == "lm_head.weight")
        .unwrap();
    let mut cfg = decoder.config().clone();
    cfg.logits_via_embedding = true;
    let tied = Decoder::new(cfg).unwrap();
    let mut values = params.clone();
    values.remove(head);
    let out = std::env::temp_dir().join(format!("ferrotext-tf-mirror-{}", std::process::id()));
    hf::save_directory(
        &out,
        tied.config(),
        &tied.params(),
        &values,
        ferrotext_sharding::DType::F32,
        hf::DEFAULT_SHARD_BYTES,
    )
    .unwrap();
    let differ = export_differs(&out, &dir, false);
    let _ = std::fs::remove_dir_all(&out);
    let differ = differ.expect("a head left out is seen");
    assert!(differ.contains("`lm_head.weight` [112, 32]"), "{differ}");
}

/// Mirrors: the comparisons can fail. The `rope_interleave: false` checkpoint run with
/// interleaved pairs, and the transformers 5 qwen3 checkpoint run with the θ its 4.x reader
/// used to fall back to (10000), each miss transformers' loss by far more than the tolerance.
#[test]
fn the_loss_comparison_sees_a_wrong_rotation_and_a_wrong_theta() {
    let off = |name: &str, edit: &dyn Fn(&mut ferrotext_models::decoder::Config)| {
        let dir = fixtures().join(name);
        let want = expected(&dir);
        let rows = rows_of(&want);
        let (decoder, params) = load(&dir);
        let right = loss(&decoder, &params, &rows);
        let mut cfg = decoder.config().clone();
        edit(&mut cfg);
        let wrong = loss(&Decoder::new(cfg).unwrap(), &params, &rows);
        let reference = want["loss"].as_f64().unwrap();
        assert!((right - reference).abs() <= LOSS_TOLERANCE, "{name}");
        (wrong - reference).abs()
    };
    let interleaved = off("deepseek_v3-nointerleave-tf5-f32-single", &|c| {
        if let Some(m) = c.mla.as_mut() {
            m.rope_interleave = true;
        }
    });
    assert!(interleaved > 100.0 * LOSS_TOLERANCE, "{interleaved}");
    let theta = off("qwen3-tied-tf5-f32-single", &|c| {
        c.rope_max_timescale = 10_000.0
    });
    let dir = fixtures().join("qwen3-tied-tf5-f32-single");
    assert_ne!(hf::read_config(&dir).unwrap().rope_max_timescale, 10_000.0);
    assert!(theta > 100.0 * LOSS_TOLERANCE, "{theta}");
}

/// Mirrors of the blocks of issue 44: each turned off (or changed to its neighbour) on a
/// fixture that has it moves the loss by more than 100× the tolerance from transformers'.
#[test]
fn turning_off_each_new_block_misses_transformers_loss() {
    use ferrotext_models::decoder::{Config, MlpActivation};
    use ferrotext_models::router::GroupScore;
    type Edit = fn(&mut Config);
    let cases: &[(&str, &str, Edit)] = &[
        ("gemma2", "attention soft-cap", |c| {
            c.attn_logit_softcapping = None
        }),
        ("gemma2", "final soft-cap", |c| {
            c.final_logit_softcapping = None
        }),
        ("gemma2", "sliding window", |c| c.sliding_window = None),
        ("gemma2", "w instead of 1 + w", |c| c.norm_plus_one = false),
        ("gemma2", "no √d embedding scale", |c| {
            c.scale_embedding = false
        }),
        ("gemma2", "SwiGLU for GeGLU", |c| {
            c.mlp_activation = MlpActivation::Silu
        }),
        ("gemma2", "1/√head_dim scale", |c| {
            c.query_pre_attn_scalar = None
        }),
        ("gemma3_text", "one RoPE for every layer", |c| {
            c.sliding_rope_theta = None
        }),
        ("mistral", "no sliding window", |c| c.sliding_window = None),
        ("qwen3-sliding", "no sliding window", |c| {
            c.sliding_window = None
        }),
        ("llama-linear", "no linear scaling", |c| {
            c.rope_scaling = None
        }),
        ("llama-dynamic", "no dynamic scaling", |c| {
            c.rope_scaling = None
        }),
        ("qwen3-yarn", "no YaRN", |c| c.rope_yarn = None),
        ("mixtral", "no renormalisation", |c| {
            if let Some(m) = c.moe.as_mut() {
                m.norm_topk_prob = false;
            }
        }),
        ("qwen2_moe", "renormalised", |c| {
            if let Some(m) = c.moe.as_mut() {
                m.norm_topk_prob = true;
            }
        }),
        ("deepseek_v2-groups", "groups by their best two", |c| {
            if let Some(m) = c.moe.as_mut() {
                m.groups.score = GroupScore::TopTwoSum;
            }
        }),
        ("deepseek_v2-eps", "latent norms at rms_norm_eps", |c| {
            if let Some(m) = c.mla.as_mut() {
                m.latent_norm_eps = c.normalization_layer_epsilon;
            }
        }),
        ("deepseek_v3-eps", "latent norms at rms_norm_eps", |c| {
            if let Some(m) = c.mla.as_mut() {
                m.latent_norm_eps = c.normalization_layer_epsilon;
            }
        }),
        ("deepseek_v2-lite", "sigmoid instead of softmax", |c| {
            if let Some(m) = c.moe.as_mut() {
                m.score = ferrotext_models::moe::RouterScore::Sigmoid;
            }
        }),
    ];
    let mut report = Vec::new();
    for (variant, what, edit) in cases {
        let dir = fixtures().join(format!("{variant}-tf5-f32-single"));
        let want = expected(&dir);
        let rows = rows_of(&want);
        let (decoder, params) = load(&dir);
        let reference = want["loss"].as_f64().unwrap();
        let right = loss(&decoder, &params, &rows);
        assert!((right - reference).abs() <= LOSS_TOLERANCE, "{variant}");
        let mut cfg = decoder.config().clone();
        edit(&mut cfg);
        assert_ne!(&cfg, decoder.config(), "{variant}: {what} changed nothing");
        let wrong = loss(&Decoder::new(cfg).unwrap(), &params, &rows);
        let off = (wrong - reference).abs();
        eprintln!("{variant}, {what}: Δ {off:.2e}");
        if off <= 100.0 * LOSS_TOLERANCE {
            report.push(format!("{variant}, {what}: Δ {off:.2e}"));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}
