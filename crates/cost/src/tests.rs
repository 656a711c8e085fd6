//! The cost model's unit tests: parsing, the ring costs, hierarchy, overlap, the optimizer.

use std::sync::Arc;

use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_train::{plan_step, ShardMode, TrainConfig};

use crate::measure::median;
use crate::price::{overlap_grad_reduce, priced_reductions, step_breakdown};
use crate::*;

const MIB16: f64 = 16.0 * 1024.0 * 1024.0;

fn gbit(g: f64, latency: f64) -> Link {
    Link {
        bytes_per_second: g * 1e9 / 8.0,
        latency_seconds: latency,
    }
}

fn cluster(text: &str) -> ClusterSpec {
    text.parse().expect("a valid cluster spec")
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn parses_the_documented_form() {
    let c = cluster("hosts=2,devices_per_host=4,link=25gbit,10us,intra=200gbit,1us");
    assert_eq!((c.hosts, c.devices_per_host), (2, 4));
    assert_eq!(c.link, Some(gbit(25.0, 10e-6)));
    assert_eq!(c.intra, gbit(200.0, 1e-6));
    assert_eq!(c.link_per, LinkShare::Host);
    let c = cluster("hosts=1,devices_per_host=4,intra=8GB/s");
    assert_eq!(c.link, None);
    assert_eq!(c.intra.bytes_per_second, 8e9);
    assert_eq!(c.intra.latency_seconds, 0.0);
    let c = cluster("devices_per_host=2,hosts=2,link=1Gbit,0,link_per=device,mem=1GiB/s");
    assert_eq!(c.link, Some(gbit(1.0, 0.0)));
    assert_eq!(c.link_per, LinkShare::Device);
    assert_eq!(c.memory_bytes_per_second, 1024.0 * 1024.0 * 1024.0);
}

#[test]
fn parse_errors_name_the_key() {
    let err = |text: &str| text.parse::<ClusterSpec>().expect_err(text);
    assert!(matches!(
        err("hosts=2,devices_per_host=2,link=1gbit,nics=2"),
        ClusterSpecError::UnknownKey { key } if key == "nics"
    ));
    assert!(matches!(
        err("hosts=2,devices_per_host=2"),
        ClusterSpecError::MissingKey { key, .. } if key == "link"
    ));
    assert!(
        matches!(err("devices_per_host=2"), ClusterSpecError::MissingKey { key, .. } if key == "hosts")
    );
    for (text, key) in [
        ("hosts=0,devices_per_host=2", "hosts"),
        ("hosts=two,devices_per_host=2", "hosts"),
        ("hosts=1,devices_per_host=-1", "devices_per_host"),
        ("hosts=2,devices_per_host=2,link=0gbit", "link"),
        ("hosts=2,devices_per_host=2,link=-5gbit", "link"),
        ("hosts=2,devices_per_host=2,link=fast", "link"),
        ("hosts=2,devices_per_host=2,link=25gbps", "link"),
        ("hosts=2,devices_per_host=2,link=25gbit,10", "link"),
        ("hosts=2,devices_per_host=2,link=25gbit,-1us", "link"),
        ("hosts=2,devices_per_host=2,link=nangbit", "link"),
        ("hosts=1,devices_per_host=2,intra=infgbit", "intra"),
        ("hosts=1,devices_per_host=2,mem=0GB/s", "mem"),
        ("hosts=1,devices_per_host=2,link_per=rack", "link_per"),
    ] {
        match err(text) {
            ClusterSpecError::BadValue { key: k, .. } => assert_eq!(k, key, "{text}"),
            other => panic!("{text}: {other:?}"),
        }
        assert!(err(text).to_string().contains(key), "{text}");
    }
    assert!(matches!(
        err("hosts=1,hosts=1,devices_per_host=1"),
        ClusterSpecError::DuplicateKey { key } if key == "hosts"
    ));
    assert!(matches!(
        err("hosts=1,devices_per_host=1,oops"),
        ClusterSpecError::Syntax { .. }
    ));
    assert!(matches!(
        err("hosts=2,devices_per_host=2,link=1gbit,1us,2us"),
        ClusterSpecError::Syntax { .. }
    ));
}

#[test]
fn ring_formulas_by_hand() {
    let link = gbit(8.0, 1e-6); // 1 GB/s
    let b = 1e9;
    // 4 members: all-reduce 2·3/4 s + 6 µs; reduce-scatter / all-gather 3/4 s + 3 µs.
    assert!(close(
        level_seconds(CollectiveKind::AllReduce, 4, b, &link),
        1.5 + 6e-6
    ));
    assert!(close(
        level_seconds(CollectiveKind::ReduceScatter, 4, b, &link),
        0.75 + 3e-6
    ));
    assert!(close(
        level_seconds(CollectiveKind::AllGather, 4, b, &link),
        0.75 + 3e-6
    ));
    assert!(close(
        level_seconds(CollectiveKind::AllToAll, 4, b, &link),
        0.75 + 3e-6
    ));
    assert!(close(
        level_seconds(CollectiveKind::Broadcast, 4, b, &link),
        1.0 + 1e-6
    ));
    assert_eq!(level_seconds(CollectiveKind::AllReduce, 1, b, &link), 0.0);
}

/// 2 hosts × 2 devices, a 16 MiB all-reduce over all four at 1 Gbit/s between hosts.
#[test]
fn hierarchical_all_reduce_by_hand() {
    let span = GroupSpan::of(&[0, 1, 2, 3], 2);
    assert_eq!(
        span,
        GroupSpan {
            members: 4,
            hosts: 2,
            per_host: 2,
            even: true
        }
    );
    // Inside: reduce-scatter of 16 MiB over 2 (1/2 of it at 25 GB/s, 1 µs), then all-gather.
    let inside = 2.0 * (0.5 * MIB16 / 25e9 + 1e-6);
    // Across: an all-reduce of half the bytes (8 MiB) between 2 hosts: 2·(1/2)·8 MiB / β +
    // 2 α, β = 1 Gbit/s per device …
    let per_device = cluster("hosts=2,devices_per_host=2,link=1gbit,10us,link_per=device");
    let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &per_device);
    assert!(close(cost.intra_seconds, inside), "{cost:?}");
    assert!(
        close(cost.link_seconds, (MIB16 / 2.0) / 125e6 + 20e-6),
        "{cost:?}"
    );
    // … or 1 Gbit/s per host, shared by its 2 devices' concurrent stages: twice as long.
    let per_host = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
    let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &per_host);
    assert!(close(cost.intra_seconds, inside));
    assert!(close(cost.link_seconds, MIB16 / 125e6 + 20e-6), "{cost:?}");
    // Reduce-scatter: inside RS of 16 MiB, across RS of 8 MiB; all-gather mirrors it.
    let rs = collective_cost(CollectiveKind::ReduceScatter, MIB16, &span, &per_device);
    assert!(close(rs.intra_seconds, 0.5 * MIB16 / 25e9 + 1e-6));
    assert!(close(rs.link_seconds, 0.5 * (MIB16 / 2.0) / 125e6 + 10e-6));
    let ag = collective_cost(CollectiveKind::AllGather, MIB16, &span, &per_device);
    assert_eq!(ag, rs);
}

#[test]
fn single_host_groups_use_only_intra() {
    let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
    // The pair {0, 1} lives on host 0.
    let span = GroupSpan::of(&[0, 1], 2);
    assert_eq!(span.hosts, 1);
    let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &c);
    assert_eq!(cost.link_seconds, 0.0);
    assert!(close(cost.intra_seconds, MIB16 / 25e9 + 2e-6));
    // One device per host: flat over the link, shared by the host's 2 devices.
    let span = GroupSpan::of(&[0, 2], 2);
    assert_eq!((span.hosts, span.per_host), (2, 1));
    let cost = collective_cost(CollectiveKind::AllReduce, MIB16, &span, &c);
    assert_eq!(cost.intra_seconds, 0.0);
    assert!(close(cost.link_seconds, MIB16 / (125e6 / 2.0) + 20e-6));
}

fn config(items: &[&str]) -> TrainConfig {
    let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
    TrainConfig::load(None, &items).expect("a valid config")
}

#[test]
fn prediction_bytes_equal_the_trace() {
    let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=4"]);
    let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
    let p = predict(&cfg, &c, 50.0).expect("predicts");
    let on = config_on(&cfg, &c).expect("fits");
    let vocab = on.plan().expect("plan").decoder().config().vocab_size;
    let source: Arc<dyn ferrotext_train::data::TokenSource> =
        Arc::from(ferrotext_train::data::source_for(&on, vocab).expect("corpus"));
    let (_, trace) = plan_step(&on.plan().unwrap(), source.clone()).expect("plans");
    let total: usize = trace.events().iter().map(|e| e.bytes).sum();
    assert_eq!(p.collectives.iter().map(|r| r.bytes).sum::<usize>(), total);
    let update = PhasePattern::new("update*");
    for kind in [CollectiveKind::AllReduce, CollectiveKind::ReduceScatter] {
        let rows: usize = p
            .collectives
            .iter()
            .filter(|r| update.matches(&r.phase) && r.kind == kind.name())
            .map(|r| r.bytes)
            .sum();
        assert_eq!(rows, trace.bytes(kind, &update));
    }
    let mut closed = on.clone();
    closed.shard_mode = ShardMode::Auto;
    let (_, closed_trace) = plan_step(&closed.plan().unwrap(), source).expect("plans");
    let total: usize = closed_trace.events().iter().map(|e| e.bytes).sum();
    assert_eq!(
        p.per_micro_batch_collectives
            .iter()
            .map(|r| r.bytes)
            .sum::<usize>(),
        total
    );
}

#[test]
fn the_closed_gate_reduces_in_every_micro_batch() {
    let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=3"]);
    let c = cluster("hosts=4,devices_per_host=1,link=1gbit,10us");
    let p = predict(&cfg, &c, 50.0).expect("predicts");
    assert!(
        p.deferred.deferral.starts_with("on"),
        "{}",
        p.deferred.deferral
    );
    assert!(p.per_micro_batch.deferral.starts_with("off"));
    assert_eq!(p.deferred.micro_batch_gradient_all_reduces, vec![0, 0, 0]);
    let closed = &p.per_micro_batch.micro_batch_gradient_all_reduces;
    assert_eq!(closed.len(), 3);
    assert!(
        closed.iter().all(|&n| n > 0 && n == closed[0]),
        "{closed:?}"
    );
    // Every micro-batch reduces about what the update reduces once when deferred.
    let reduced = |rows: &[CollectiveCost], phase: &str| -> usize {
        rows.iter()
            .filter(|r| r.phase == phase && r.gradient_reduction)
            .map(|r| r.bytes)
            .sum()
    };
    let once = reduced(&p.collectives, "update");
    let each = reduced(&p.per_micro_batch_collectives, "micro_batch 2");
    assert!(each >= once && once > 0, "{each} vs {once}");
}

#[test]
fn deferral_pays_on_a_slow_link_and_not_at_ga_1() {
    let slow = cluster("hosts=2,devices_per_host=2,link=1gbit,50us");
    let ga4 = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=4"]);
    let p = predict(&ga4, &slow, 50.0).expect("predicts");
    assert!(p.deferred_step_ms < p.per_micro_batch_step_ms, "{p:?}");
    assert!(p.ratio < 0.6, "ratio {}", p.ratio);
    assert!(close(p.ratio * p.speedup, 1.0));
    let ga1 = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=1"]);
    let p = predict(&ga1, &slow, 50.0).expect("predicts");
    // The same reductions, once, in the update or in the only micro-batch.
    assert!((p.ratio - 1.0).abs() < 0.2, "ratio {}", p.ratio);
    assert!(p.ratio <= 1.0 + 1e-9, "ratio {}", p.ratio);
}

#[test]
fn compute_and_memory_follow_the_config() {
    let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=2"]);
    let c = cluster("hosts=1,devices_per_host=4,intra=8GB/s");
    let p = predict(&cfg, &c, 10.0).expect("predicts");
    // per_device_batch_size 2 × 128 tokens per device and micro-batch.
    assert_eq!(p.tokens_per_device_per_micro_batch, 256.0);
    let expected = p.flops_per_token * 256.0 / 10e9 * 1e3;
    assert!(close(p.compute_ms_per_micro_batch, expected));
    assert!(close(p.deferred.compute_ms, 2.0 * expected));
    let params = p.parameters as f64 * 4.0;
    assert_eq!(p.memory.parameter_bytes, params);
    assert_eq!(p.memory.accumulator_bytes, params);
    assert_eq!(p.memory.optimizer_bytes, 2.0 * params);
    // ZeRO-1 splits the optimizer state (and the reduced gradients) over data = 4.
    let z = config(&["ici_data_parallelism=4", "shard_optimizer_over_data=true"]);
    let pz = predict(&z, &c, 10.0).expect("predicts");
    assert_eq!(pz.memory.optimizer_bytes, 2.0 * params / 4.0);
    assert!(pz.optimizer_ms < p.optimizer_ms);
    assert!(p.memory.total_bytes > p.memory.activation_bytes);
}

#[test]
fn exposed_reduction_by_hand() {
    // Bytes 1, 1, 2 over a backward of 40 ms: ready at 10, 20, 40; finished at 20, 30, 60.
    let three = [(1.0, 10.0), (1.0, 10.0), (2.0, 20.0)];
    assert_eq!(exposed_after_backward(&three, 40.0), 20.0);
    assert_eq!(exposed_after_backward(&three, 0.0), 40.0);
    // One bucket is ready only when the backward ends: all of it is exposed.
    assert_eq!(exposed_after_backward(&[(4.0, 40.0)], 100.0), 40.0);
    // Link-bound: 4 × 30 ms behind 40 ms, the first starting at 10: 130 − 40.
    assert_eq!(exposed_after_backward(&[(1.0, 30.0); 4], 40.0), 90.0);
    // Many small buckets behind a long backward: only the last one's 1 ms.
    assert_eq!(exposed_after_backward(&[(1.0, 1.0); 100], 200.0), 1.0);
    assert_eq!(exposed_after_backward(&[], 10.0), 0.0);
}

#[test]
fn overlap_hides_the_reduction_behind_the_backward() {
    // Overlapped: the reduction runs in the last micro-batch, in buckets.
    let cfg = config(&[
        "ici_data_parallelism=4",
        "gradient_accumulation_steps=4",
        "overlap_grad_reduce=true",
    ]);
    let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
    let on = config_on(&cfg, &c).expect("fits");
    let mesh = on.mesh().expect("mesh");
    let vocab = on.plan().expect("plan").decoder().config().vocab_size;
    let source: Arc<dyn ferrotext_train::data::TokenSource> =
        Arc::from(ferrotext_train::data::source_for(&on, vocab).expect("corpus"));
    let (_, trace) = plan_step(&on.plan().unwrap(), source).expect("plans");
    let rows = price_trace(&trace, &mesh, &c).expect("prices");
    let reductions = priced_reductions(&trace, &mesh, &c).expect("prices");
    let last: Vec<&(String, f64, f64)> = reductions
        .iter()
        .filter(|r| r.0 == "micro_batch 3")
        .collect();
    assert!(last.len() > 1, "buckets: {last:?}");
    assert_eq!(
        last.len(),
        reductions.len(),
        "nothing outside the last micro-batch"
    );
    let a: f64 = last.iter().map(|r| r.2).sum();
    let breakdown = |compute: f64, overlap: bool| {
        step_breakdown(
            &rows,
            &reductions,
            &trace,
            4,
            compute,
            overlap,
            0.0,
            String::new(),
        )
    };
    assert!(close(breakdown(3.0 * a, false).exposed_reduction_ms, a));
    // A long backward hides all but the last bucket, which is ready only at its end.
    let long = breakdown(30.0 * a, true).exposed_reduction_ms;
    assert!(close(long, last[last.len() - 1].2), "{long}");
    // A short one hides less, and never more than its own length.
    let short = breakdown(0.75 * a, true).exposed_reduction_ms;
    assert!(
        short > long && short >= a - 0.5 * a - 1e-9 && short < a,
        "{short}"
    );
    assert!(overlap_grad_reduce(&on));
}

#[test]
fn a_mesh_that_does_not_fit_the_cluster_is_a_config_error() {
    let cfg = config(&["ici_data_parallelism=4"]);
    let c = cluster("hosts=3,devices_per_host=2,link=1gbit,10us");
    let err = predict(&cfg, &c, 10.0).expect_err("4 ≠ 6");
    match &err {
        CostError::NotOnCluster {
            hosts: 3,
            devices_per_host: 2,
            devices: 6,
            ..
        } => {}
        other => panic!("not NotOnCluster: {other}"),
    }
    assert!(err.is_usage());
    assert!(err.to_string().contains("hosts=3"), "{err}");
    let ok = cluster("hosts=1,devices_per_host=4");
    assert!(matches!(
        predict(&cfg, &ok, 0.0),
        Err(CostError::BadThroughput { gflops }) if gflops == 0.0
    ));
    assert!(matches!(
        predict(&cfg, &ok, f64::NAN),
        Err(CostError::BadThroughput { gflops }) if gflops.is_nan()
    ));
    // The mirror: the same config on a cluster of its size, at a positive throughput.
    assert!(predict(&cfg, &ok, 10.0).is_ok());
}

#[test]
fn thread_budget_by_hand() {
    // 16 cores, 4 devices: 4 threads each, all 4 at once. 2 cores, 4 devices: 1 thread
    // each, 2 at once, so half of a thread each. 3 cores, 2 devices: 1 thread each, both at
    // once (the spare core is not shared out).
    let budget = |cores, devices| {
        let b = device_thread_budget(cores, devices);
        (b.threads, b.concurrent, b.share)
    };
    assert_eq!(budget(16, 4), (4, 4, 1.0));
    assert_eq!(budget(2, 4), (1, 2, 0.5));
    assert_eq!(budget(3, 2), (1, 2, 1.0));
    assert_eq!(budget(8, 3), (2, 3, 1.0));
    assert_eq!(budget(2, 64), (1, 2, 1.0 / 32.0));
    assert_eq!(budget(0, 0), (1, 1, 1.0));
}

#[test]
fn effective_throughput_by_hand() {
    // 6 MFLOP/token × 512 tokens in 0.1 s = 30.72 GFLOP/s.
    let g = effective_gflops(6e6, 512.0, 0.1).expect("positive");
    assert!(close(g, 30.72), "{g}");
    for (tokens, seconds) in [(0.0, 0.1), (512.0, 0.0), (512.0, -1.0), (512.0, f64::NAN)] {
        assert!(
            matches!(
                effective_gflops(6e6, tokens, seconds),
                Err(CostError::NoThroughput { .. })
            ),
            "{tokens} tokens in {seconds} s"
        );
    }
    let mut odd = [3.0, 1.0, 2.0];
    assert_eq!(median(&mut odd), 2.0);
    let mut even = [4.0, 1.0, 3.0, 2.0];
    assert_eq!(median(&mut even), 2.5);
    assert_eq!(median(&mut []), 0.0);
}

#[test]
fn a_measured_throughput_prices_the_micro_batch_it_came_from() {
    // A micro-batch of the cluster's per-device tokens measured at 0.25 s: the predicted
    // compute per micro-batch is those 0.25 s, whatever the FLOPs.
    let cfg = config(&["ici_data_parallelism=4", "gradient_accumulation_steps=2"]);
    let c = cluster("hosts=2,devices_per_host=2,link=1gbit,10us");
    let one = one_device_config(&cfg).expect("one device");
    let plan = one.plan().expect("plans");
    let fpt = plan.decoder().flops_per_token(one.max_target_length);
    let tokens = one.micro_batch_rows() * one.max_target_length;
    let g = effective_gflops(fpt, tokens as f64, 0.25).expect("positive");
    let p = predict(&cfg, &c, g).expect("predicts");
    assert_eq!(p.tokens_per_device_per_micro_batch, tokens as f64);
    assert!(close(p.compute_ms_per_micro_batch, 250.0), "{p:?}");
    assert!(close(p.deferred.compute_ms, 500.0));
    assert_eq!(p.device_gflops_source, "given");
}

#[test]
fn one_device_config_keeps_the_model_and_the_per_device_batch() {
    let cfg = config(&[
        "ici_data_parallelism=4",
        "per_device_batch_size=3",
        "shard_optimizer_over_data=true",
        "max_target_length=64",
    ]);
    let fsdp = config(&["ici_data_parallelism=2", "ici_fsdp_parallelism=2"]);
    assert_eq!(one_device_config(&fsdp).expect("one").devices(), 1);
    let one = one_device_config(&cfg).expect("one device");
    assert_eq!(one.devices(), 1);
    assert_eq!(one.micro_batch_rows(), 3);
    assert_eq!(one.max_target_length, 64);
    assert_eq!(one.model_name, cfg.model_name);
    assert!(!one.shard_optimizer_over_data);
    // A fractional per-device batch becomes whole sequences, at least one.
    let half = config(&[
        "per_device_batch_size=0.5",
        "ici_data_parallelism=2",
        "ici_tensor_parallelism=2",
    ]);
    assert_eq!(one_device_config(&half).expect("one").micro_batch_rows(), 1);
    // The tiny model fits in any machine this runs on.
    assert_eq!(too_big_to_measure(&cfg, 4).expect("plans"), None);
}

/// `grad_dtype=bfloat16` prices the deferred reduction at 2 bytes an element (the trace's
/// bytes): half the update's gradient bytes and about half their link time; the closed gate's
/// per-micro-batch reductions stay f32, so that mode is priced as before (the mirror).
#[test]
fn bf16_gradients_halve_the_deferred_reduction_and_nothing_else() {
    let c = cluster("hosts=2,devices_per_host=1,link=1gbit,10us");
    let keys = [
        "ici_data_parallelism=2",
        "local_devices=2",
        "gradient_accumulation_steps=4",
    ];
    let f = predict(&config(&keys), &c, 50.0).expect("predicts");
    let with_bf16: Vec<&str> = keys
        .iter()
        .copied()
        .chain(["grad_dtype=bfloat16"])
        .collect();
    let b = predict(&config(&with_bf16), &c, 50.0).expect("predicts");
    let update = |p: &Prediction| -> (usize, f64) {
        p.collectives
            .iter()
            .filter(|r| r.phase == "update" && r.gradient_reduction)
            .fold((0, 0.0), |(n, ms), r| (n + r.bytes, ms + r.ms))
    };
    let ((fb, fms), (bb, bms)) = (update(&f), update(&b));
    assert!(fb > 0 && fb == 2 * bb, "{fb} vs {bb}");
    // α–β: the bytes term halves, the latency term (2(n−1)α a collective) does not.
    assert!(bms < 0.55 * fms && bms > 0.45 * fms, "{fms} vs {bms} ms");
    assert!(b.deferred.step_ms < f.deferred.step_ms);
    assert_eq!(b.per_micro_batch_collectives, f.per_micro_batch_collectives);
}
