//! Generation in bf16 (issue 30 item 4) on the transformers checkpoints of
//! `crates/hf/tests/fixtures/transformers/`: the same weights, the decoder computing in bf16
//! (`Decoder::with_compute_dtype`), greedy through the key/value cache.
//!
//! The comparison made: for each f32 fixture, the teacher-forced f32 logits `x` and bf16 logits
//! `y` along the f32 greedy sequence. At each position the f32 choice `t` stays bf16's choice
//! whenever, for every other token `j`, `x_t − x_j > |x_t − y_t| + |x_j − y_j|`; the smallest
//! value of `x_t − x_j − |x_t − y_t| − |x_j − y_j|` over the positions and tokens is the
//! fixture's `slack`. Where the slack is positive, no choice can move, so the bf16 greedy tokens
//! (through the key/value cache) must equal the f32 ones; elsewhere they may differ, and the test
//! reports them (measured here: about half the fixtures qualify; of the others, llama3-tied and
//! qwen3_moe-nonorm differ). At least one fixture must qualify, and bf16 must move the logits,
//! or the test compares nothing.
//!
//! The largest change `Δ` bf16 makes to any logit (0.05–0.14 here) is printed beside the f32
//! `margin` (best minus second best): `Δ` alone is above every fixture's margin, which is why
//! the slack, not `2Δ < margin`, decides.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_generate::generate::{generate, GenerateOptions};
use ferrotext_generate::sample::SamplingParams;
use ferrotext_hf as hf;
use ferrotext_models::decoder::Decoder;
use ferrotext_sharding::{DType, Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::on_device;
use ferrotext_tensor::Tensor;
use serde_json::Value;

/// Fixture prefixes left out: covered by the router and MTP tests (as in
/// `transformers_fixtures.rs`).
const NOT_HERE: &[&str] = &["deepseek_v3-groups-", "deepseek_v3-mtp-"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../hf/tests/fixtures/transformers")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The logits `[t, vocab]` of one row of tokens, through the full forward.
fn logits(decoder: &Decoder, params: &[Tensor], row: &[u32]) -> Tensor {
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        on_device(dev, |cx| {
            let replicated = NamedSharding::new(mesh.clone(), PartitionSpec::replicated())?;
            let weights = params
                .iter()
                .map(|p| cx.from_global(p, replicated.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            let ids = cx.ids_from_global(&[1, row.len()], PartitionSpec::replicated(), row)?;
            let logits = decoder.logits(cx, &weights, &ids)?;
            cx.to_host(&logits)
        })
    })
    .unwrap()
    .remove(0)
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

/// One fixture's comparison.
struct Compared {
    name: String,
    margin: f32,
    delta: f32,
    slack: f32,
    equal: bool,
}

fn compare(dir: &Path) -> Compared {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let cfg = hf::read_config(dir).unwrap();
    let f32_decoder = Decoder::new(cfg).unwrap();
    let params = hf::load_directory(dir, &f32_decoder.params()).unwrap();
    let bf16_decoder = f32_decoder.clone().with_compute_dtype(DType::BF16).unwrap();
    let prompt = ids(&want["prompt"]);
    let n = ids(&want["greedy_tokens"]).len();
    let f32_tokens = greedy(&f32_decoder, &params, &prompt, n);
    let bf16_tokens = greedy(&bf16_decoder, &params, &prompt, n);
    let mut row = prompt.clone();
    row.extend(&f32_tokens[..n - 1]);
    let (a, b) = (
        logits(&f32_decoder, &params, &row),
        logits(&bf16_decoder, &params, &row),
    );
    let vocab = a.shape()[2];
    let (mut margin, mut delta, mut slack) = (f32::INFINITY, 0.0f32, f32::INFINITY);
    // Positions prompt.len()-1 .. row.len()-1 predict the greedy tokens.
    for p in prompt.len() - 1..row.len() {
        let (x, y) = (
            &a.data()[p * vocab..(p + 1) * vocab],
            &b.data()[p * vocab..(p + 1) * vocab],
        );
        let mut sorted = x.to_vec();
        sorted.sort_by(|u, v| v.total_cmp(u));
        margin = margin.min(sorted[0] - sorted[1]);
        let top = (0..vocab)
            .max_by(|&i, &j| x[i].total_cmp(&x[j]).then(j.cmp(&i)))
            .unwrap();
        let moved = |i: usize| (x[i] - y[i]).abs();
        for j in (0..vocab).filter(|&j| j != top) {
            slack = slack.min(x[top] - x[j] - moved(top) - moved(j));
        }
        for (u, v) in x.iter().zip(y) {
            delta = delta.max((u - v).abs());
        }
    }
    Compared {
        name,
        margin,
        delta,
        slack,
        equal: f32_tokens == bf16_tokens,
    }
}

#[test]
fn bf16_greedy_tokens_equal_the_f32_ones_wherever_the_margins_allow() {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").is_file())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            name.contains("-f32-") && !NOT_HERE.iter().any(|x| name.starts_with(x))
        })
        .collect();
    dirs.sort();
    let mut qualified = 0;
    let mut failures = Vec::new();
    for dir in &dirs {
        let c = compare(dir);
        let allows = c.slack > 0.0;
        eprintln!(
            "{}: margin {:.4}, bf16 Δ {:.4}, slack {:.4}: {}, tokens {}",
            c.name,
            c.margin,
            c.delta,
            c.slack,
            if allows { "must agree" } else { "may differ" },
            if c.equal { "equal" } else { "differ" }
        );
        // bf16 must change the logits at all, or this compares f32 with itself.
        if c.delta == 0.0 {
            failures.push(format!("{}: bf16 logits are the f32 ones", c.name));
        }
        if allows {
            qualified += 1;
            if !c.equal {
                failures.push(format!("{}: tokens differ within the margin", c.name));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(qualified > 0, "no fixture's margin allows the comparison");
}
