//! Issue 16, the per-micro-batch mode's extra bytes: with a tied LM head, the embedding table's
//! gradient has two contributions (the lookup and the head). They are summed on each device and
//! all-reduced once per micro-batch, not once per use, so a micro-batch reduces exactly the
//! parameter bytes. Mirror: the untied model has two tables of that size, and the same probe
//! finds two reductions of it.

use ferrotext_comm::{CollectiveKind, PhasePattern, TraceEvent};
use ferrotext_train::{Deferral, TrainReport};
mod common;

use common::run;

/// `small_config`'s dims: vocab 256, d 32, 2 layers, 4 query / 2 kv heads of 8, MLP 64.
const TABLE: usize = 256 * 32;
/// One layer by hand: input norm 32; q [32, 4·8], k and v [32, 2·8], o [4·8, 32]; q_norm and
/// k_norm 8 each; post-attention norm 32; gate and up [32, 64], down [64, 32].
const LAYER: usize = 32 + 32 * 32 + 2 * (32 * 16) + 32 * 32 + 2 * 8 + 32 + 3 * (32 * 64);
/// Two layers, the final norm and the embedding table (tied: also the head).
const TIED: usize = 2 * LAYER + 32 + TABLE;
/// Three steps, so each micro-batch phase label occurs three times.
const STEPS: usize = 3;

/// Gradient all-reduces of micro-batch `micro` over all steps: every all-reduce
/// but the 1-element loss sum (the q/k norm scales have 8 elements, so a size cut-off of 8 would
/// miss them).
fn gradient_all_reduces(r: &TrainReport, micro: usize) -> Vec<TraceEvent> {
    let phase = PhasePattern::new(format!("micro_batch {micro}"));
    r.trace
        .filter(CollectiveKind::AllReduce, &phase)
        .filter(|e| e.elements > 1)
        .cloned()
        .collect()
}

fn per_micro_batch(extra: &[&str]) -> TrainReport {
    let mut all = vec!["gradient_accumulation_steps=4", "shard_mode=auto"];
    all.extend_from_slice(extra);
    let r = run(&all);
    assert!(matches!(&r.gate, Deferral::Closed(_)), "{:?}", r.gate);
    r
}

#[test]
fn tied_table_is_reduced_once_per_micro_batch() {
    let r = per_micro_batch(&[]);
    let declared: usize = r
        .params
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .sum();
    assert_eq!(declared, TIED, "the hand count matches the declared shapes");
    for micro in 0..4 {
        let reduced = gradient_all_reduces(&r, micro);
        let bytes: usize = reduced.iter().map(|e| e.bytes).sum();
        assert_eq!(
            bytes,
            TIED * 4 * STEPS,
            "micro-batch {micro}: the f32 parameter bytes"
        );
        assert_eq!(reduced.len(), r.params.len() * STEPS, "one per parameter");
        let table = reduced.iter().filter(|e| e.elements == TABLE).count();
        assert_eq!(table, STEPS, "micro-batch {micro}: the table once per step");
    }
}

#[test]
fn mirror_untied_head_is_a_second_table_reduction() {
    let r = per_micro_batch(&["logits_via_embedding=false"]);
    let head = r
        .params
        .iter()
        .find(|p| p.name == "lm_head.weight")
        .expect("an untied head");
    assert_eq!(head.shape.iter().product::<usize>(), TABLE);
    for micro in 0..4 {
        let reduced = gradient_all_reduces(&r, micro);
        let bytes: usize = reduced.iter().map(|e| e.bytes).sum();
        assert_eq!(
            bytes,
            (TIED + TABLE) * 4 * STEPS,
            "micro-batch {micro}: the f32 parameter bytes, the head included"
        );
        let tables = reduced.iter().filter(|e| e.elements == TABLE).count();
        assert_eq!(tables, 2 * STEPS, "micro-batch {micro}: embedding and head");
    }
}

#[test]
fn deferred_tied_table_still_waits_for_the_update() {
    let r = run(&["gradient_accumulation_steps=4"]);
    assert!(r.gate.is_open());
    for micro in 0..4 {
        assert!(
            gradient_all_reduces(&r, micro).is_empty(),
            "micro-batch {micro}"
        );
    }
    let update = PhasePattern::new("update");
    assert_eq!(
        r.trace.bytes(CollectiveKind::AllReduce, &update),
        TIED * 4 * STEPS,
        "every gradient, the table once, once per step"
    );
}
