// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use super::*;
use crate::tensor::Tensor;

fn rand(shape: &[usize], seed: u32) -> Tensor {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    Tensor::from_fn(shape, |_| {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s % 2000) as f32 / 1000.0 - 1.0
    })
}

/// Attention and its cotangents in f64, row by row from the definition: the independent
/// baseline.
struct Reference {
    out: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn reference([q, k, v, dout]: [&Tensor; 4], ranges: &KeyRanges, scores: Scores) -> Reference {
    let d = Dims::of(q.shape(), k.shape(), v.shape(), "reference").unwrap();
    let f = |t: &Tensor| t.data().iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    let (q, k, v, g) = (f(q), f(k), f(v), f(dout));
    let mut r = Reference {
        out: vec![0.0; d.b * d.tq * d.h * d.dv],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
    };
    let (scale, cap) = (f64::from(scores.scale), scores.softcap.map(f64::from));
    for b in 0..d.b {
        for h in 0..d.h {
            let kvh = h / d.group();
            for i in 0..d.tq {
                let (lo, hi) = ranges.range(b, i);
                let qi = Dims::row_at(d.tq, d.h, d.dk, b, h, i);
                let key = |j: usize| Dims::row_at(d.tk, d.kv, d.dk, b, kvh, j);
                let val = |j: usize| Dims::row_at(d.tk, d.kv, d.dv, b, kvh, j);
                let (mut x, mut slope) = (Vec::new(), Vec::new());
                for j in lo..hi {
                    let s: f64 = (0..d.dk).map(|c| q[qi + c] * k[key(j) + c]).sum::<f64>() * scale;
                    match cap {
                        None => {
                            x.push(s);
                            slope.push(1.0);
                        }
                        Some(cap) => {
                            let th = (s / cap).tanh();
                            x.push(cap * th);
                            slope.push(1.0 - th * th);
                        }
                    }
                }
                let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = x.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = x.iter().map(|x| (x - m).exp() / z).collect();
                let oi = Dims::row_at(d.tq, d.h, d.dv, b, h, i);
                for (n, j) in (lo..hi).enumerate() {
                    for c in 0..d.dv {
                        r.out[oi + c] += p[n] * v[val(j) + c];
                        r.dv[val(j) + c] += p[n] * g[oi + c];
                    }
                }
                let dp: Vec<f64> = (lo..hi)
                    .map(|j| (0..d.dv).map(|c| g[oi + c] * v[val(j) + c]).sum())
                    .collect();
                let dot: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                for (n, j) in (lo..hi).enumerate() {
                    let dx = p[n] * (dp[n] - dot) * slope[n] * scale;
                    for c in 0..d.dk {
                        r.dq[qi + c] += dx * k[key(j) + c];
                        r.dk[key(j) + c] += dx * q[qi + c];
                    }
                }
            }
        }
    }
    r
}

/// The largest absolute error, relative to the reference's largest magnitude where that
/// exceeds 1 (a gradient summed over many keys is large; f32 resolves it relatively).
fn max_error(got: &Tensor, want: &[f64]) -> f64 {
    let scale = want.iter().fold(1.0f64, |m, w| m.max(w.abs()));
    got.data()
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .fold(0.0, f64::max)
        / scale
}

struct Case {
    b: usize,
    tq: usize,
    tk: usize,
    h: usize,
    kv: usize,
    dk: usize,
    dv: usize,
}

/// Runs the kernel and its backward on `case` and checks every output against the f64
/// reference within `tol` ([`max_error`]); returns the kernel's outputs.
fn check(case: &Case, ranges: &KeyRanges, scores: Scores, tol: f64) -> [Tensor; 4] {
    let c = case;
    let q = rand(&[c.b, c.tq, c.h, c.dk], 1);
    let k = rand(&[c.b, c.tk, c.kv, c.dk], 2);
    let v = rand(&[c.b, c.tk, c.kv, c.dv], 3);
    let dout = rand(&[c.b, c.tq, c.h, c.dv], 4);
    let want = reference([&q, &k, &v, &dout], ranges, scores);
    let fwd = flash_attention(&q, &k, &v, ranges, scores, 2).unwrap();
    let (dq, dk, dv) =
        flash_attention_backward(&q, &k, &v, &fwd.out, &fwd.lse, &dout, ranges, scores, 2).unwrap();
    for (name, got, want) in [
        ("out", &fwd.out, &want.out),
        ("dq", &dq, &want.dq),
        ("dk", &dk, &want.dk),
        ("dv", &dv, &want.dv),
    ] {
        let e = max_error(got, want);
        assert!(e <= tol, "{name}: max error {e:e} > {tol:e}");
    }
    [fwd.out, dq, dk, dv]
}

const PLAIN: Scores = Scores {
    scale: 0.25,
    softcap: None,
};

/// Causal attention over several query and key blocks (a partial last block of each), with
/// GQA and `dk ≠ dv`, within 1e-6 of f64.
#[test]
fn causal_matches_f64_across_blocks() {
    let case = Case {
        b: 2,
        tq: KEY_BLOCK + QUERY_BLOCK + 7,
        tk: KEY_BLOCK + QUERY_BLOCK + 7,
        h: 4,
        kv: 2,
        dk: 16,
        dv: 8,
    };
    check(&case, &KeyRanges::causal(2, case.tq, None), PLAIN, 1e-6);
}

/// A sliding window, packed documents (a window inside them too) and soft-capped logits,
/// each within 1e-6 of f64.
#[test]
fn windows_documents_and_softcap_match_f64() {
    let t = 2 * QUERY_BLOCK + 5;
    let case = Case {
        b: 2,
        tq: t,
        tk: t,
        h: 2,
        kv: 1,
        dk: 8,
        dv: 8,
    };
    check(&case, &KeyRanges::causal(2, t, Some(37)), PLAIN, 1e-6);
    let starts: Vec<u32> = (0..2 * t)
        .map(|n| {
            let i = n % t;
            let doc_start = if n < t {
                [0, 50, 51, 90]
            } else {
                [0, 3, 70, 100]
            };
            *doc_start.iter().filter(|&&s| s <= i).max().unwrap() as u32
        })
        .collect();
    let docs = KeyRanges::documents(2, t, &starts, None).unwrap();
    check(&case, &docs, PLAIN, 1e-6);
    let docs_window = KeyRanges::documents(2, t, &starts, Some(20)).unwrap();
    check(&case, &docs_window, PLAIN, 1e-6);
    let capped = Scores {
        scale: 0.5,
        softcap: Some(2.0),
    };
    check(&case, &KeyRanges::causal(2, t, None), capped, 1e-6);
}

/// Queries that are a slice of a longer sequence (a context-parallel device's rows) against
/// all its keys: the slice of the whole sequence's attention.
#[test]
fn a_query_slice_against_all_keys_matches_f64() {
    let tk = KEY_BLOCK + 40;
    let whole = KeyRanges::causal(1, tk, None);
    let slice = whole.query_rows(100..100 + QUERY_BLOCK + 3).unwrap();
    let case = Case {
        b: 1,
        tq: QUERY_BLOCK + 3,
        tk,
        h: 2,
        kv: 2,
        dk: 8,
        dv: 4,
    };
    check(&case, &slice, PLAIN, 1e-6);
}

/// The mask matters (the mirror of the tests above): a window changes the output and the
/// gradients from plain causal attention.
#[test]
fn a_window_changes_the_result() {
    let t = QUERY_BLOCK + 9;
    let case = Case {
        b: 1,
        tq: t,
        tk: t,
        h: 2,
        kv: 1,
        dk: 8,
        dv: 8,
    };
    let plain = check(&case, &KeyRanges::causal(1, t, None), PLAIN, 1e-6);
    let windowed = check(&case, &KeyRanges::causal(1, t, Some(8)), PLAIN, 1e-6);
    for (a, b) in plain.iter().zip(&windowed) {
        let diff = a
            .data()
            .iter()
            .zip(b.data())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(diff > 1e-3, "the window moved an output by only {diff:e}");
    }
}

/// The bits do not depend on the thread count (each output element is one task's, summed in
/// its fixed order).
#[test]
fn bits_do_not_depend_on_threads() {
    let (b, t, h, kv, dk) = (2, KEY_BLOCK + 33, 4, 2, 16);
    let q = rand(&[b, t, h, dk], 5);
    let k = rand(&[b, t, kv, dk], 6);
    let v = rand(&[b, t, kv, dk], 7);
    let g = rand(&[b, t, h, dk], 8);
    let r = KeyRanges::causal(b, t, None);
    let run = |threads| {
        let f = flash_attention(&q, &k, &v, &r, PLAIN, threads).unwrap();
        let (dq, dk, dv) =
            flash_attention_backward(&q, &k, &v, &f.out, &f.lse, &g, &r, PLAIN, threads).unwrap();
        [f.out, f.lse, dq, dk, dv]
    };
    let (one, two) = (run(1), run(2));
    for (a, b) in one.iter().zip(&two) {
        assert!(a
            .data()
            .iter()
            .zip(b.data())
            .all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}

/// A thread's kept tiles hold nothing a call reads: after they are filled with NaN (what any
/// stale element would carry into a result), the forward and backward give, in `f32` and in
/// bf16 and with soft-capping (its slopes are made per call), the bits of a thread that never
/// ran one.
#[test]
fn kept_tiles_carry_nothing_into_the_next_call() {
    let (b, t, h, kv, dk) = (1, KEY_BLOCK + 21, 4, 2, 16);
    let (q, k, v, g) = (
        rand(&[b, t, h, dk], 9),
        rand(&[b, t, kv, dk], 10),
        rand(&[b, t, kv, dk], 11),
        rand(&[b, t, h, dk], 12),
    );
    let r = KeyRanges::causal(b, t, Some(90));
    let capped = Scores {
        scale: 0.5,
        softcap: Some(3.0),
    };
    let run = |poison: bool| {
        std::thread::scope(|s| {
            s.spawn(|| {
                if poison {
                    with_tiles(1 << 16, |tiles| tiles.fill(f32::NAN));
                    // The mirror: the next use of the buffer does see the poison.
                    with_tiles(1 << 16, |tiles| assert!(tiles.iter().all(|x| x.is_nan())));
                }
                let mut bits = Vec::new();
                for scores in [PLAIN, capped] {
                    let f = flash_attention(&q, &k, &v, &r, scores, 1).unwrap();
                    let (dq, dk, dv) =
                        flash_attention_backward(&q, &k, &v, &f.out, &f.lse, &g, &r, scores, 1)
                            .unwrap();
                    let w = |x: &Tensor| crate::Bf16Tensor::from_f32(x);
                    let (qb, kb, vb, gb) = (w(&q), w(&k), w(&v), w(&g));
                    let (out, lse) =
                        crate::flash_attention_bf16(&qb, &kb, &vb, &r, scores, 1).unwrap();
                    let (bq, bk, bv) = crate::flash_attention_backward_bf16(
                        &qb, &kb, &vb, &out, &lse, &gb, &r, scores, 1,
                    )
                    .unwrap();
                    for x in [f.out, f.lse, dq, dk, dv, out.to_f32(), lse]
                        .into_iter()
                        .chain([bq, bk, bv].iter().map(crate::Bf16Tensor::to_f32))
                    {
                        assert!(x.data().iter().all(|e| e.is_finite()));
                        bits.extend(x.data().iter().map(|e| e.to_bits()));
                    }
                }
                bits
            })
            .join()
            .unwrap()
        })
    };
    assert_eq!(run(false), run(true));
}

/// Shapes and ranges that do not fit are errors naming the op, and a document start after its
/// position is refused.
#[test]
fn shapes_that_do_not_fit_are_errors() {
    let q = rand(&[1, 4, 2, 8], 1);
    let k = rand(&[1, 4, 3, 8], 2);
    let r = KeyRanges::causal(1, 4, None);
    let e = flash_attention(&q, &k, &k, &r, PLAIN, 1).unwrap_err();
    assert!(e.to_string().contains("flash_attention"), "{e}");
    let k = rand(&[1, 4, 1, 8], 2);
    let wrong = KeyRanges::causal(1, 5, None);
    let e = flash_attention(&q, &k, &k, &wrong, PLAIN, 1).unwrap_err();
    assert!(e.to_string().contains("key ranges"), "{e}");
    assert!(KeyRanges::documents(1, 3, &[0, 2, 1], None).is_err());
}

/// When set, every tile packs its own operands ([`packs_once`] is false): the route a task's
/// whole-operand packings replace, which [`operands_packed_once_give_each_tiles_bits`] compares
/// them with. Another test running meanwhile may take that route too: the same bits.
static TILES_PACK_ALONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(super) fn tiles_pack_alone() -> bool {
    TILES_PACK_ALONE.load(std::sync::atomic::Ordering::Relaxed)
}

/// bf16 attention with its keys, values, queries and output cotangent packed once per task
/// has, bit for bit, the output, log-sum-exps and cotangents of every tile packing its own
/// blocks: over several query and key blocks, grouped heads, odd head dimensions, causal
/// masks, windows and documents (tiles whose keys start inside a panel or pair read them
/// where they are stored), a query slice of a longer sequence, soft-capping, 1 and 2 threads.
#[test]
fn operands_packed_once_give_each_tiles_bits() {
    use super::elem::{Elem, View};
    use crate::bf16::{flash_attention_backward_bf16, flash_attention_bf16, Bf16Tensor};
    use std::sync::atomic::Ordering;
    // Where this process's bf16 product does not pack (not the AVX512_BF16 kernel), both
    // routes are the tiles' own packings: the comparison below still runs, but checks nothing
    // of the packings.
    let zeros = [half::bf16::ZERO; 4];
    if <half::bf16 as Elem>::pack(View::block(&zeros, 2, 2, 2)).is_none() {
        crate::report_skipped(
            "tensor flash::tests::operands_packed_once_give_each_tiles_bits",
            "this process's bf16 product kernel packs no operand once (not the AVX512_BF16 kernel)",
        );
    }
    let t = 2 * KEY_BLOCK + 70;
    // Documents starting at 0, 50, 51 and 300 in the first row, at 0 and 129 in the second.
    let starts: Vec<u32> = (0..2 * t)
        .map(|n| {
            let (row, i) = (n / t, n % t);
            let firsts: &[usize] = if row == 0 {
                &[0, 50, 51, 300]
            } else {
                &[0, 129]
            };
            *firsts.iter().filter(|&&s| s <= i).max().unwrap() as u32
        })
        .collect();
    let cases = [
        // (b, tq, tk, h, kv, dk, dv), the key ranges, soft-capping
        (
            (2, 130, 130, 4, 2, 32, 32),
            KeyRanges::causal(2, 130, None),
            None,
        ),
        (
            (1, t, t, 2, 1, 24, 16),
            KeyRanges::causal(1, t, None),
            Some(5.0),
        ),
        (
            (1, 300, 300, 3, 3, 7, 5),
            KeyRanges::causal(1, 300, None),
            None,
        ),
        (
            (2, t, t, 2, 2, 16, 8),
            KeyRanges::causal(2, t, Some(37)),
            None,
        ),
        (
            (2, t, t, 4, 1, 8, 8),
            KeyRanges::documents(2, t, &starts, None).unwrap(),
            None,
        ),
        (
            (1, QUERY_BLOCK + 67, t, 2, 1, 16, 16),
            KeyRanges::causal(1, t, None)
                .query_rows(200..200 + QUERY_BLOCK + 67)
                .unwrap(),
            None,
        ),
    ];
    for (i, ((b, tq, tk, h, kv, dk, dv), ranges, softcap)) in cases.into_iter().enumerate() {
        let seed = 10 * i as u32;
        let bf16 = |shape: &[usize], s| Bf16Tensor::from_f32(&rand(shape, seed + s));
        let (q, k, v) = (
            bf16(&[b, tq, h, dk], 1),
            bf16(&[b, tk, kv, dk], 2),
            bf16(&[b, tk, kv, dv], 3),
        );
        let dout = bf16(&[b, tq, h, dv], 4);
        let scores = Scores {
            scale: 1.0 / (dk as f32).sqrt(),
            softcap,
        };
        let run = |threads| {
            let (out, lse) = flash_attention_bf16(&q, &k, &v, &ranges, scores, threads).unwrap();
            let grads = flash_attention_backward_bf16(
                &q, &k, &v, &out, &lse, &dout, &ranges, scores, threads,
            )
            .unwrap();
            (out, lse, grads)
        };
        for threads in [1, 2] {
            let packed = run(threads);
            TILES_PACK_ALONE.store(true, Ordering::Relaxed);
            let alone = run(threads);
            TILES_PACK_ALONE.store(false, Ordering::Relaxed);
            assert!(
                packed.0.to_f32().data().iter().any(|&x| x != 0.0),
                "case {i}"
            );
            assert_eq!(packed, alone, "case {i} on {threads} threads");
        }
    }
}
