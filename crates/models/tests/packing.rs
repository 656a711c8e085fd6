//! Packed documents: a window holding several documents, with each token's segment id and
//! position, gives every document the loss it has run alone as its own sequence (within 1e-6,
//! f32), for GQA with QK-norm and for MLA with YaRN; the mirror: the same window without the
//! document boundaries gives the later documents other losses.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::decoder::{Config, Decoder, LossOptions};
use ferrotext_models::{init_normal, Positions};
use ferrotext_sharding::{Mesh, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, IGNORE_INDEX};
mod common;

use common::{tiny_gqa, with_mla};

fn gqa() -> Config {
    tiny_gqa(31, 2)
}

fn mla() -> Config {
    with_mla(gqa())
}

/// One row of tokens with its documents: `(start, end)` of each, end exclusive.
struct Window {
    tokens: Vec<u32>,
    docs: Vec<(usize, usize)>,
}

/// Rows of segment ids and rows of positions.
type DocRows<'a> = (&'a [Vec<u32>], &'a [Vec<u32>]);

/// The loss sum of `inputs` → `targets` (rows of equal length), on 2 devices splitting the
/// rows, with `docs` `(segment ids, positions)` per row when given.
fn loss(
    model: &Decoder,
    inputs: &[Vec<u32>],
    targets: &[Vec<u32>],
    docs: Option<DocRows<'_>>,
) -> f32 {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let (b, t) = (inputs.len(), inputs[0].len());
    let flat = |rows: &[Vec<u32>]| rows.concat();
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let params: Vec<Array> = model
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let v = init_normal(p, 9, i);
                let ty = cx.array_type(p.shape.as_slice(), PartitionSpec::replicated())?;
                cx.from_global(&v, ty.sharding().clone())
            })
            .collect::<Result<_, _>>()?;
        let batch = PartitionSpec::new([Some("data"), None]);
        let ids = cx.ids_from_global(&[b, t], batch.clone(), &flat(inputs))?;
        let tgt = cx.ids_from_global(&[b, t], batch.clone(), &flat(targets))?;
        let docs = match docs {
            Some((_, pos)) => Some(Positions {
                in_document: cx.ids_from_global(&[b, t], batch.clone(), &flat(pos))?,
                balanced: None,
            }),
            None => None,
        };
        let sum = model.loss(
            &mut cx,
            &params,
            (&ids, docs.as_ref()),
            &tgt,
            LossOptions::default(),
        )?;
        sum.total.scalar()
    })
    .unwrap();
    out[0]
}

/// Inputs and targets of a window (the targets shifted; a target past a document's end is not
/// scored), and its segment ids and positions.
fn packed(w: &Window) -> [Vec<u32>; 4] {
    let t = w.tokens.len() - 1;
    let mut targets = w.tokens[1..].to_vec();
    let (mut seg, mut pos) = (vec![0; t], vec![0; t]);
    for (k, &(s, e)) in w.docs.iter().enumerate() {
        for i in s..e.min(t) {
            seg[i] = k as u32 + 1;
            pos[i] = (i - s) as u32;
        }
        if e <= t {
            targets[e - 1] = IGNORE_INDEX;
        }
    }
    [w.tokens[..t].to_vec(), targets, seg, pos]
}

/// `targets` with every position outside `range` not scored.
fn only(targets: &[u32], range: (usize, usize)) -> Vec<u32> {
    (0..targets.len())
        .map(|i| {
            if (range.0..range.1).contains(&i) {
                targets[i]
            } else {
                IGNORE_INDEX
            }
        })
        .collect()
}

fn check(cfg: Config) {
    let model = Decoder::new(cfg).unwrap();
    let windows = [
        Window {
            tokens: (0..17).map(|i| (i * 7 + 2) % 31).collect(),
            docs: vec![(0, 5), (5, 12), (12, 16)],
        },
        Window {
            tokens: (0..17).map(|i| (i * 11 + 5) % 31).collect(),
            docs: vec![(0, 3), (3, 16)],
        },
    ];
    let rows: Vec<[Vec<u32>; 4]> = windows.iter().map(packed).collect();
    let col = |k: usize| rows.iter().map(|r| r[k].clone()).collect::<Vec<_>>();
    let (inputs, targets, seg, pos) = (col(0), col(1), col(2), col(3));
    for (r, w) in windows.iter().enumerate() {
        for &(s, e) in &w.docs {
            // The document alone: its own row, padded by repeating it on the other (unscored)
            // row so both devices hold a row.
            let alone_in = vec![inputs[r][s..e].to_vec(); 2];
            let alone_tg = vec![targets[r][s..e].to_vec(), vec![IGNORE_INDEX; e - s]];
            let want = loss(&model, &alone_in, &alone_tg, None);
            let mut masked = vec![vec![IGNORE_INDEX; targets[0].len()]; 2];
            masked[r] = only(&targets[r], (s, e));
            let got = loss(&model, &inputs, &masked, Some((&seg, &pos)));
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "row {r}, document {s}..{e}: packed {got}, alone {want}"
            );
            // The mirror: without the boundaries, a later document sees the earlier ones.
            if s > 0 {
                let unpacked = loss(&model, &inputs, &masked, None);
                assert!(
                    (unpacked - want).abs() > 1e-3,
                    "row {r}, document {s}..{e}: {unpacked} without packing"
                );
            }
        }
    }
}

#[test]
fn each_packed_document_has_its_own_loss_gqa() {
    check(gqa());
}

#[test]
fn each_packed_document_has_its_own_loss_mla() {
    check(mla());
}
