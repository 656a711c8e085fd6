//! `remat_policy` in whole runs: every policy trains the losses and final weights of
//! `remat_policy=none` bit for bit — deferred on data=2 with gradient accumulation (the
//! gradients go into the accumulator's buffers through the replay), in float32 and bfloat16,
//! and on a MoE model with a load-balance loss — and the recomputation happens: the trace has
//! collectives labelled `recompute` only when a policy is on (the mirror).

mod common;
use common::run;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_train::{train, RunOptions, TrainReport};

fn bits(r: &TrainReport) -> (Vec<u64>, Vec<Vec<u32>>) {
    let losses = r.metrics.iter().map(|m| m.loss.to_bits()).collect();
    let values = r
        .values
        .as_ref()
        .unwrap()
        .iter()
        .map(|t| t.data().iter().map(|v| v.to_bits()).collect())
        .collect();
    (losses, values)
}

const POLICIES: [&str; 4] = ["full", "minimal", "save_dot_except_mlp", "save_out_proj"];

fn same_bits_across_policies(extra: &[&str]) {
    let with = |policy: &str| {
        let key = format!("remat_policy={policy}");
        let mut all: Vec<&str> = extra.to_vec();
        all.push(&key);
        bits(&run(&all))
    };
    let none = with("none");
    for policy in POLICIES {
        assert_eq!(with(policy), none, "{policy} {extra:?}");
    }
}

#[test]
fn deferred_runs_train_the_same_bits_under_every_policy() {
    let deferred = [
        "local_devices=2",
        "ici_data_parallelism=2",
        "gradient_accumulation_steps=2",
    ];
    same_bits_across_policies(&deferred);
    let mut bf16 = deferred.to_vec();
    bf16.push("dtype=bfloat16");
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    same_bits_across_policies(&bf16);
}

#[test]
fn a_moe_run_trains_the_same_bits_under_every_policy() {
    same_bits_across_policies(&[
        "num_experts=4",
        "num_experts_per_tok=2",
        "moe_mlp_dim=16",
        "load_balance_loss_weight=0.01",
        "gradient_accumulation_steps=2",
    ]);
}

#[test]
fn the_trace_shows_the_recomputation_only_under_a_policy() {
    let traced = |policy: &str| {
        let key = format!("remat_policy={policy}");
        // The tied embedding's all-reduce and the loss's are outside the layers; a tensor axis
        // puts a collective inside each layer, which the replay issues again.
        let cfg = common::small_config(&[
            "local_devices=2",
            "ici_tensor_parallelism=2",
            "ici_data_parallelism=1",
            &key,
        ]);
        let report = train(&cfg, &RunOptions::default()).unwrap();
        report
            .trace
            .count(CollectiveKind::AllReduce, &PhasePattern::new("*recompute*"))
            + report
                .trace
                .count(CollectiveKind::AllGather, &PhasePattern::new("*recompute*"))
    };
    assert_eq!(traced("none"), 0);
    assert!(traced("full") > 0);
}
