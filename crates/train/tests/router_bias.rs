//! DeepSeek-V3's aux-loss-free balancing through the engine (`routed_bias_update_rate`): after a
//! step every router selection bias moved by `rate · sign(mean load − load)`, against loads
//! counted here by a separate forward pass; the loads are summed over devices (data=4 × GA 2
//! gives the biases of 1 device × GA 8, bitwise); a mid-step checkpoint keeps the step's loads
//! (bitwise resume); the deferral still holds (no reduction inside micro-batches, one
//! `layers × experts` all-reduce in the update); a positive rate without biases is refused.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, PhasePattern, SpmdOptions};
use ferrotext_models::decoder::LossOptions;
use ferrotext_sharding::{NamedSharding, PartitionSpec};
use ferrotext_spmd::Ctx;
use ferrotext_train::data::{micro_batch, source_for, TokenSource};
use ferrotext_train::{bias_update, train, Engine, RunOptions, TrainConfig, TrainError};
mod common;

use common::{feed, small_config};

/// A rate of 2⁻⁶: biases move by exactly representable steps.
const RATE: f32 = 1.0 / 64.0;

/// `small_config`'s model with a DeepSeek-style router: 8 sigmoid-scored experts in 4 groups
/// (top-2 groups), top-2, a selection bias per MoE layer (layer 0 dense, layer 1 MoE).
fn config(extra: &[&str]) -> TrainConfig {
    let mut all = vec![
        "num_experts=8",
        "num_experts_per_tok=2",
        "moe_mlp_dim=16",
        "shared_experts=1",
        "first_num_dense_layers=1",
        "routed_score_func=sigmoid",
        "routed_scaling_factor=2.5",
        "routed_bias=true",
        "n_routing_groups=4",
        "topk_routing_group=2",
        "routed_bias_update_rate=0.015625",
        "learning_rate=0.01",
        "steps=3",
    ];
    all.extend_from_slice(extra);
    small_config(&all)
}

const BIAS: &str = "model.layers.1.mlp.gate.e_score_correction_bias";

fn bias_index(cfg: &TrainConfig) -> usize {
    let plan = cfg.plan().unwrap();
    plan.params().iter().position(|p| p.name == BIAS).unwrap()
}

/// One device, GA 2: the bias after step 0 against the loads of a separate forward pass over
/// the step's two micro-batches with the initial weights (zero bias).
#[test]
fn one_step_moves_each_bias_by_the_rate_against_the_load() {
    let cfg = config(&["local_devices=1", "gradient_accumulation_steps=2"]);
    let k = bias_index(&cfg);
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut engine = Engine::new(&mut cx, &plan, None)?;
            let initial = engine.params_to_host(&mut cx)?;
            // The loads, counted by the model alone on the step's rows.
            let mut loads = vec![0f32; 8];
            let named = NamedSharding::new(cx.mesh().clone(), PartitionSpec::replicated())?;
            let params = initial
                .iter()
                .map(|t| cx.from_global(t, named.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            for micro in 0..2 {
                let rows = micro_batch(
                    source.as_ref(),
                    0,
                    micro,
                    2,
                    cfg.micro_batch_rows(),
                    cfg.max_target_length,
                );
                let len = cfg.max_target_length;
                let inputs: Vec<u32> = rows.iter().flat_map(|r| r[..len].to_vec()).collect();
                let targets: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
                let spec = engine.batch_spec().clone();
                let shape = [rows.len(), len];
                let inputs = cx.ids_from_global(&shape, spec.clone(), &inputs)?;
                let targets = cx.ids_from_global(&shape, spec, &targets)?;
                let options = LossOptions::default();
                let l = plan
                    .decoder()
                    .loss(&mut cx, &params, (&inputs, None), &targets, options)?
                    .loads;
                for (a, b) in loads.iter_mut().zip(&l[0]) {
                    *a += b;
                }
            }
            for micro in 0..2 {
                feed(&mut cx, &mut engine, source.as_ref(), &cfg, 0, micro)?;
            }
            engine.update(&mut cx)?;
            Ok((initial, engine.params_to_host(&mut cx)?, loads))
        },
    )
    .unwrap();
    let (initial, after, loads) = &results[0];
    assert!(initial[k].data().iter().all(|&b| b == 0.0));
    // 2 micro-batches × 16 tokens × top-2.
    assert_eq!(loads.iter().sum::<f32>(), 64.0);
    let mean = 8.0;
    let want: Vec<f32> = loads
        .iter()
        .map(|&l| {
            if l < mean {
                RATE
            } else if l > mean {
                -RATE
            } else {
                0.0
            }
        })
        .collect();
    assert_eq!(after[k].data(), want.as_slice(), "loads {loads:?}");
    assert!(
        want.iter().any(|&b| b != 0.0),
        "some expert is off the mean"
    );
    // The library's rule agrees with the hand rule above.
    let mut lib = vec![0.0; 8];
    bias_update(&mut lib, loads, RATE);
    assert_eq!(lib, want);
}

fn biases_after(extra: &[&str]) -> (ferrotext_train::TrainReport, Vec<f32>) {
    let cfg = config(extra);
    let k = bias_index(&cfg);
    let report = train(
        &cfg,
        &RunOptions {
            return_params: true,
            ..Default::default()
        },
    )
    .unwrap();
    let bias = report.values.as_ref().unwrap()[k].data().to_vec();
    (report, bias)
}

/// The step's loads are summed over every device and micro-batch: data=4 × GA 2 and 1 device ×
/// GA 8 read the same 8 sequences a step and end with the same biases, bit for bit; with the
/// rate at 0 the biases stay zero (the mirror).
#[test]
fn loads_are_summed_over_devices_and_micro_batches() {
    let (_, four) = biases_after(&["local_devices=4", "gradient_accumulation_steps=2"]);
    let (_, one) = biases_after(&["local_devices=1", "gradient_accumulation_steps=8"]);
    assert_eq!(four, one);
    assert!(four.iter().any(|&b| b != 0.0));
    // Every bias is a whole number of steps of the rate (3 steps: at most 3 away from 0).
    for b in &four {
        let steps = b / RATE;
        assert!(steps.fract() == 0.0 && steps.abs() <= 3.0, "{b}");
    }
    let (_, still) = biases_after(&[
        "local_devices=4",
        "gradient_accumulation_steps=2",
        "routed_bias_update_rate=0",
    ]);
    assert!(still.iter().all(|&b| b == 0.0));
}

/// The deferral holds with the router state: no all-reduce of more than one element inside
/// micro-batches, and in each update one all-reduce of the loads (1 MoE layer × 8 experts).
#[test]
fn balancing_keeps_the_deferral_and_adds_one_small_all_reduce_per_step() {
    let (report, _) = biases_after(&["local_devices=4", "gradient_accumulation_steps=2"]);
    assert!(report.gate.is_open());
    let mb = PhasePattern::new("micro_batch*");
    let big = report.trace.all_reduces_larger_than(1, &mb);
    assert!(big.is_empty(), "all-reduces inside micro-batches: {big:?}");
    let update = PhasePattern::new("update*");
    let loads = report
        .trace
        .all_reduces_larger_than(7, &update)
        .into_iter()
        .filter(|e| e.elements == 8)
        .count();
    assert_eq!(loads, 3, "one load all-reduce per step");
}

/// A checkpoint in the middle of a step keeps the step's loads: the resumed run ends with the
/// uninterrupted run's weights and biases, bit for bit.
#[test]
fn mid_step_resume_keeps_the_loads_bitwise() {
    let cfg = config(&["local_devices=4", "gradient_accumulation_steps=2"]);
    let root = std::env::temp_dir().join(format!("ferrotext-router-bias-{}", std::process::id()));
    std::fs::remove_dir_all(&root).ok();
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: Arc<dyn TokenSource> = Arc::from(source_for(&cfg, 256).unwrap());
    let results = run_spmd(
        &mesh,
        &SpmdOptions::default(),
        |dev| -> Result<_, TrainError> {
            let mut cx = Ctx::new(dev.comm(), 1);
            let mut a = Engine::new(&mut cx, &plan, None)?;
            for step in 0..2u64 {
                for micro in 0..2 {
                    feed(&mut cx, &mut a, source.as_ref(), &cfg, step, micro)?;
                }
                a.update(&mut cx)?;
            }
            let mut b = Engine::new(&mut cx, &plan, None)?;
            for micro in 0..2 {
                feed(&mut cx, &mut b, source.as_ref(), &cfg, 0, micro)?;
            }
            b.update(&mut cx)?;
            feed(&mut cx, &mut b, source.as_ref(), &cfg, 1, 0)?;
            b.save_checkpoint(&mut cx, &root)?;
            drop(b);
            let mut c = Engine::new(&mut cx, &plan, None)?;
            c.restore_checkpoint(&mut cx, &root)?;
            feed(&mut cx, &mut c, source.as_ref(), &cfg, 1, 1)?;
            c.update(&mut cx)?;
            Ok((a.params_to_host(&mut cx)?, c.params_to_host(&mut cx)?))
        },
    )
    .unwrap();
    let (a, c) = &results[0];
    let k = bias_index(&cfg);
    assert!(a[k].data().iter().any(|&b| b != 0.0));
    assert_eq!(a, c, "weights and biases after a mid-step save and restore");
    let manifest = std::fs::read_to_string(
        ferrotext_train::checkpoint::latest(&root)
            .unwrap()
            .unwrap()
            .join("manifest.json"),
    )
    .unwrap();
    assert!(manifest.contains("pending_expert_loads"), "{manifest}");
    std::fs::remove_dir_all(&root).ok();
}

/// A positive rate on a model without selection biases is a usage error naming the key.
#[test]
fn a_rate_without_biases_is_refused() {
    let mut all: Vec<String> = common::SMALL.iter().map(|s| s.to_string()).collect();
    all.extend(
        [
            "num_experts=4",
            "num_experts_per_tok=2",
            "routed_bias_update_rate=0.01",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let e = TrainConfig::load(None, &all)
        .and_then(|cfg| cfg.plan().map(|_| ()))
        .unwrap_err();
    assert!(
        e.to_string().contains(
            "routed_bias_update_rate = 0.01 moves the router selection biases, and this model \
             has none: set routed_bias=true"
        ),
        "{e}"
    );
}
