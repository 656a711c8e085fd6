//! The families of issue 44 in the trainer, from their CPU-sized presets (random weights): every
//! family preset plans and each `-tiny` one learns; the deferred run gives the untagged run's
//! weights; a mid-step resume is bitwise; ZeRO-1 gives the replicated optimizer's weights (and
//! `layout_invariant` keeps its bits across layouts: `layout_invariant.rs`, whose process runs
//! every product on the portable kernel); the MoE families' experts split over
//! `expert`; Gemma's blocks (soft-capping, a sliding window, the sandwich norms, Gemma 3's local
//! RoPE), OLMo 2's QK-norm over all heads and Mistral's windows train under `data` × `tensor`,
//! `fsdp` and `context` with the weights of the data-parallel run.

use std::path::PathBuf;
use std::sync::Arc;

use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions};
use ferrotext_spmd::Ctx;
use ferrotext_train::data::{source_for, TokenSource};
use ferrotext_train::{train, Engine, RunOptions, TrainConfig, TrainError, TrainReport};

mod common;
use common::{adamw_weight_bound, feed, max_abs_diff, max_rel_diff, COMPARABLE_ADAM_EPS};

/// The dense new families' CPU-sized presets.
const DENSE: [&str; 4] = ["mistral-tiny", "gemma2-tiny", "gemma3-tiny", "olmo2-tiny"];
/// The MoE new families' CPU-sized presets.
const MOE: [&str; 3] = ["mixtral-tiny", "qwen2-moe-tiny", "deepseek2-tiny"];

/// SGD whose weights are linear in the gradient, so they show a gradient's difference as it is.
const SGD: [&str; 3] = [
    "opt_type=sgd",
    "learning_rate=0.5",
    "gradient_clipping_threshold=0",
];

/// The preset `model` as it is (width 128, 2 layers, bytes) on 16-token synthetic sequences, one
/// per device per micro-batch, 3 steps of GA 2 on the default 4 devices, plus `extra`.
fn config(model: &str, extra: &[&str]) -> TrainConfig {
    let mut all: Vec<String> = [
        "max_target_length=16",
        "per_device_batch_size=1",
        "steps=3",
        "gradient_accumulation_steps=2",
        "dataset_type=synthetic",
        "grad_bucket_mb=1e-9",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    all.push(format!("model_name={model}"));
    all.extend(extra.iter().map(|s| s.to_string()));
    TrainConfig::load(None, &all).unwrap_or_else(|e| panic!("{model}: {e}"))
}

fn run(model: &str, extra: &[&str]) -> TrainReport {
    let options = RunOptions {
        return_params: true,
        ..Default::default()
    };
    train(&config(model, extra), &options).unwrap_or_else(|e| panic!("{model}: {e}"))
}

fn with<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    [a, b].concat()
}

#[test]
fn every_family_preset_plans_and_each_tiny_one_learns() {
    let presets = ferrotext_hf::presets();
    assert_eq!(presets.len(), 14, "{presets:?}");
    for p in &presets {
        let plan = config(p.name, &[])
            .plan()
            .unwrap_or_else(|e| panic!("{p:?}: {e}"));
        assert!(plan.decoder().param_count() > 0, "{}", p.name);
        if !p.name.ends_with("-tiny") {
            continue;
        }
        let keys = [
            "dataset_type=corpus",
            "steps=6",
            "learning_rate=0.01",
            "max_target_length=32",
        ];
        let r = train(&config(p.name, &keys), &RunOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", p.name));
        let (first, last) = (r.metrics[0].loss, r.metrics[5].loss);
        assert!(last < first - 0.1, "{}: loss {first} -> {last}", p.name);
    }
}

/// The deferral on (gradients `{U:data}` across micro-batches, one reduction in `update`) and
/// off (`shard_mode=auto`, reduced in every micro-batch): the same sums in another order.
#[test]
fn deferred_and_untagged_runs_give_the_same_weights() {
    for model in DENSE.iter().chain(&MOE) {
        let deferred = run(model, &SGD);
        let untagged = run(model, &with(&SGD, &["shard_mode=auto"]));
        assert!(
            deferred.gate.is_open() && !untagged.gate.is_open(),
            "{model}"
        );
        let mb = PhasePattern::new("micro_batch*");
        let early = deferred.trace.all_reduces_larger_than(1, &mb);
        assert!(
            early.is_empty(),
            "{model}: reduced inside micro-batches: {early:?}"
        );
        let d = max_rel_diff(&deferred, &untagged);
        eprintln!("{model}: deferred vs untagged {d:.1e}");
        assert!(d <= 4e-6, "{model}: max relative weight difference {d}");
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-newfam-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

/// 1.5 steps, a checkpoint, a fresh engine restores it and finishes the step and one more: the
/// losses and weights of the uninterrupted run, to the bit.
fn mid_step_round_trip(model: &str, extra: &[&str]) {
    let cfg = config(model, &with(&["opt_type=adamw"], extra));
    let root = scratch(model);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let step = |cx: &mut Ctx<'_>, e: &mut Engine, s: u64| -> Result<u64, TrainError> {
        for micro in 0..2 {
            feed(cx, e, source.as_ref(), &cfg, s, micro)?;
        }
        Ok(e.update(cx)?.loss.to_bits())
    };
    let results = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let mut a = Engine::new(&mut cx, &plan, None)?;
        let want: Vec<u64> = (0..3)
            .map(|s| step(&mut cx, &mut a, s))
            .collect::<Result<_, _>>()?;
        let mut b = Engine::new(&mut cx, &plan, None)?;
        step(&mut cx, &mut b, 0)?;
        feed(&mut cx, &mut b, source.as_ref(), &cfg, 1, 0)?;
        b.save_checkpoint(&mut cx, &root)?;
        drop(b);
        let mut c = Engine::new(&mut cx, &plan, None)?;
        c.restore_checkpoint(&mut cx, &root)?;
        assert_eq!(c.pending_micro_steps(), 1);
        feed(&mut cx, &mut c, source.as_ref(), &cfg, 1, 1)?;
        let got = vec![
            want[0],
            c.update(&mut cx)?.loss.to_bits(),
            step(&mut cx, &mut c, 2)?,
        ];
        Ok::<_, TrainError>((
            want,
            got,
            a.params_to_host(&mut cx)?,
            c.params_to_host(&mut cx)?,
        ))
    })
    .unwrap_or_else(|e| panic!("{model}: {e}"));
    let (want, got, a, c) = &results[0];
    assert_eq!(want, got, "{model} {extra:?}: losses after the resume");
    assert!(a == c, "{model} {extra:?}: weights after the resume");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_mid_step_resume_is_bitwise_dense_and_moe() {
    for model in ["gemma2-tiny", "qwen2-moe-tiny", "deepseek2-tiny"] {
        mid_step_round_trip(model, &[]);
    }
    mid_step_round_trip("olmo2-tiny", &["shard_mode=auto"]);
    mid_step_round_trip("mixtral-tiny", &["shard_optimizer_over_data=true"]);
}

/// ZeRO-1's weights are the replicated optimizer's: bitwise where a product's bits depend on
/// its operands alone (the portable kernel: `layout_invariant.rs` checks that; MKL and `gemm`
/// give 0 here too), within [`adamw_weight_bound`] on a kernel whose bits follow where the
/// buffers lie (see [`COMPARABLE_ADAM_EPS`]). The bound sees a learning rate 1% off (the
/// mirror).
#[test]
fn zero1_gives_the_replicated_optimizer_weights() {
    let bound = adamw_weight_bound(0.01);
    let adamw = |lr| ["opt_type=adamw", lr, COMPARABLE_ADAM_EPS];
    for model in ["gemma2-tiny", "mixtral-tiny", "deepseek2-tiny"] {
        let plain = run(model, &adamw("learning_rate=0.01"));
        let zero1 = run(
            model,
            &with(
                &adamw("learning_rate=0.01"),
                &["shard_optimizer_over_data=true"],
            ),
        );
        assert!(zero1.zero1.is_open(), "{model}");
        let update = PhasePattern::new("update*");
        let scatters = zero1.trace.count(CollectiveKind::ReduceScatter, &update);
        assert_eq!(
            scatters,
            zero1.params.len() * 3,
            "{model}: one per parameter and step"
        );
        let d = max_abs_diff(&zero1, &plain);
        eprintln!("{model}: ZeRO-1 vs replicated {d:.1e}");
        assert!(d <= bound, "{model}: max absolute weight difference {d}");
    }
    let plain = run("gemma2-tiny", &adamw("learning_rate=0.01"));
    let off = run("gemma2-tiny", &adamw("learning_rate=0.0101"));
    let d = max_abs_diff(&off, &plain);
    assert!(d > bound, "a learning rate 1% off moved the weights by {d}");
}

/// data=2 × expert=2 against data=4: the experts split over `expert` (all-to-alls in every
/// micro-batch, nothing larger than the loss all-reduced there), the weights the same.
#[test]
fn moe_families_split_their_experts_over_the_expert_axis() {
    for model in MOE {
        let data4 = run(model, &SGD);
        let split = ["ici_data_parallelism=2", "ici_expert_parallelism=2"];
        let ep = run(model, &with(&SGD, &split));
        assert!(ep.gate.is_open(), "{model}");
        for micro in 0..2 {
            let phase = PhasePattern::new(format!("micro_batch {micro}"));
            assert!(
                ep.trace.all_reduces_larger_than(1, &phase).is_empty(),
                "{model}"
            );
            assert!(
                ep.trace.count(CollectiveKind::AllToAll, &phase) > 0,
                "{model}"
            );
        }
        let d = max_rel_diff(&ep, &data4);
        eprintln!("{model}: expert=2 vs data=4 {d:.1e}");
        assert!(d <= 1e-5, "{model}: max relative weight difference {d}");
    }
}

/// Gemma 2 (soft-caps, a window of 8 on the first layer, sandwich norms, GeGLU), Gemma 3 (per-
/// head `1 + w` QK-norm, a local RoPE on the sliding layer), OLMo 2 (post-norms, a QK-norm over
/// all heads, whose statistic needs the heads `tensor` splits) and Mistral (a window on every
/// layer) on data=2 × tensor=2, × fsdp=2 and × context=2 (each device a half of every sequence:
/// the windows' key ranges from global positions): the weights of the data=4 run. OLMo 2's rows
/// are gathered over `tensor` for the statistic; without the gather `rms_norm` refuses the split
/// rows as a type error, so it cannot go silently wrong (checked by hand:
/// `f32[4@data,16,128@tensor]`).
#[test]
fn dense_families_train_under_tensor_fsdp_and_context_parallelism() {
    for model in ["gemma2-tiny", "gemma3-tiny", "olmo2-tiny", "mistral-tiny"] {
        let data4 = run(model, &SGD);
        for axis in ["tensor", "fsdp", "context"] {
            let split = format!("ici_{axis}_parallelism=2");
            let r = run(model, &with(&SGD, &["ici_data_parallelism=2", &split]));
            if model == "olmo2-tiny" {
                let norm = r
                    .params
                    .iter()
                    .find(|p| p.name.ends_with("self_attn.q_norm.weight"));
                assert_eq!(
                    norm.map(|p| p.shape.clone()),
                    Some(vec![128]),
                    "all heads' scale"
                );
            }
            let d = max_rel_diff(&r, &data4);
            eprintln!("{model}: data2×{axis}2 vs data4 {d:.1e}");
            assert!(
                d <= 1e-5,
                "{model} {axis}: max relative weight difference {d}"
            );
        }
    }
}

/// Training FLOPs per token computed here from the config's dimensions alone (not from the
/// declared weights, as `flops_per_token` counts them): 6 per multiply-add of each matrix a
/// token goes through (the head included, the embedding lookup not; biases, norms, soft-caps
/// and the gates' activations none; GeGLU's three products as SwiGLU's; of the routed experts
/// the k a token uses) and `6·heads·(qk + v)` per key a query sees, a window's keys counted as
/// the share of causal (query, key) pairs it leaves, query by query.
fn flops_from_dims(c: &ferrotext_models::decoder::Config, seq: usize) -> f64 {
    let (d, h, kv) = (c.base_emb_dim, c.base_num_query_heads, c.base_num_kv_heads);
    let mut matmul = d * c.vocab_size;
    let mut attention = 0.0;
    for i in 0..c.base_num_decoder_layers {
        let (qk, v) = match &c.mla {
            Some(m) => {
                let (qk, r) = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank);
                matmul += match m.q_lora_rank {
                    0 => d * h * qk,
                    q => d * q + q * h * qk,
                };
                matmul +=
                    d * (r + m.qk_rope_head_dim) + r * h * (m.qk_nope_head_dim + m.v_head_dim);
                matmul += h * m.v_head_dim * d;
                (qk, m.v_head_dim)
            }
            None => {
                matmul += d * h * c.head_dim + 2 * d * kv * c.head_dim + h * c.head_dim * d;
                (c.head_dim, c.head_dim)
            }
        };
        matmul += match c.moe.as_ref().filter(|_| c.is_moe_layer(i)) {
            None => 3 * d * c.base_mlp_dim,
            Some(m) => {
                let gate = usize::from(m.shared_expert_gate) * d;
                d * m.num_experts
                    + 3 * d * (m.num_experts_per_tok * m.moe_mlp_dim)
                    + 3 * d * c.shared_mlp_dim()
                    + gate
            }
        };
        let window = c.window_of(i).unwrap_or(usize::MAX);
        let visited: usize = (0..seq).map(|q| (q + 1).min(window)).sum();
        let keys = seq as f64 * visited as f64 / (seq * (seq + 1) / 2) as f64;
        attention += 6.0 * (h * (qk + v)) as f64 * keys;
    }
    6.0 * matmul as f64 + attention
}

/// `plan` counts each new block as the dimensions say, for every family preset (published
/// shapes at their own context lengths, windows shorter than it: Mistral's and Gemma's) and the
/// decoder's own with biases (Qwen2) and MLA with the query latent (DeepSeek-V3).
#[test]
fn plan_counts_the_flops_of_every_new_block() {
    let mut names: Vec<&str> = ferrotext_hf::presets().iter().map(|p| p.name).collect();
    names.extend_from_slice(&["qwen2.5-0.5b", "deepseek3-tiny", "llama3.2-1b"]);
    for name in names {
        for seq in [16, 8192] {
            let len = format!("max_target_length={seq}");
            let plan = config(name, &[&len]).plan().unwrap();
            let got = plan.decoder().flops_per_token(seq);
            let want = flops_from_dims(plan.decoder().config(), seq);
            let rel = (got - want).abs() / want;
            assert!(rel < 1e-12, "{name} at {seq}: {got} vs {want}");
        }
    }
    // Mistral 7B at 8192 tokens: its 4096 window costs 3/4 of full attention, not 1/2.
    let plan = config("mistral-7b", &["max_target_length=8192"])
        .plan()
        .unwrap();
    let windowed = plan.decoder().flops_per_token(8192);
    let mut full = plan.decoder().config().clone();
    full.sliding_window = None;
    let full = flops_from_dims(&full, 8192);
    let attention_full = 6.0 * 32.0 * 256.0 * 8192.0 * 32.0;
    let share = 1.0 - (full - windowed) / attention_full;
    assert!((share - 0.75).abs() < 1e-3, "{share}");
}

/// Gemma 2's final soft-cap keeps the capped logits beside the raw ones: the plan counts one
/// more `[tokens, vocab]` f32 array (one tile's under `num_vocab_tiling`) than the same model
/// without the cap.
#[test]
fn plan_counts_the_final_soft_cap_s_logits() {
    let dir = scratch("softcap-memory");
    let gemma = ferrotext_hf::preset("gemma2-tiny").unwrap().unwrap();
    let capped = ferrotext_hf::hf_config_json(&gemma, "float32").unwrap();
    let mut plain = capped.clone();
    plain["final_logit_softcapping"] = serde_json::Value::Null;
    let activations = |json: &serde_json::Value, name: &str, tiles: &str| {
        let at = dir.join(name);
        std::fs::create_dir_all(&at).unwrap();
        std::fs::write(at.join("config.json"), json.to_string()).unwrap();
        let load = format!("load_parameters_path={}", at.display());
        let plan = config("gemma2-tiny", &[&load, tiles]).plan().unwrap();
        plan.memory_per_device().unwrap().activation_bytes
    };
    // 16 tokens a device, a vocabulary of 256, f32; 4 tiles of 4 tokens.
    for (tiles, extra) in [("num_vocab_tiling=1", 16.0), ("num_vocab_tiling=4", 4.0)] {
        let more = activations(&capped, "capped", tiles) - activations(&plain, "plain", tiles);
        assert_eq!(more, extra * 256.0 * 4.0, "{tiles}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
