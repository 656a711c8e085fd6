//! Context parallelism: the sequence split over a `context` axis (`[B, T@context, d]`
//! activations; each layer gathers its keys and values over the axis, reduced, so their
//! cotangents come back as a reduce-scatter) gives the loss of the one-device run within 1e-6
//! and its gradients within 1e-5 (relative), for GQA (plain and packed documents) and MLA; its collectives are the gathers in
//! the forward and the reduce-scatters in the backward; the weights' gradients, tagged reduced
//! over `context`, stay per-device partial sums (nothing all-reduced on their path).

use std::sync::Arc;

use ferrotext_comm::{run_spmd, CollectiveKind, PhasePattern, SpmdOptions, Trace};
use ferrotext_models::decoder::{Config, Decoder, LossOptions};
use ferrotext_models::{init_normal, Balanced, Positions};
use ferrotext_sharding::{Mesh, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
mod common;

use common::{tiny_gqa, with_mla};

fn gqa() -> Config {
    tiny_gqa(29, 2)
}

fn mla() -> Config {
    let mut c = with_mla(gqa());
    c.logits_via_embedding = false;
    c
}

const B: usize = 2;
const T: usize = 16;

/// The loss and the gradients (summed over the devices' partials) on a `context`-way split
/// of the sequence, with the weights reduced over it when `tagged`; device 0's trace.
fn run(
    model: &Decoder,
    context: usize,
    tagged: bool,
    (packed, balanced): (bool, bool),
) -> (f32, Vec<Vec<f32>>, Trace) {
    let mesh = Arc::new(Mesh::explicit([("context", context)]).unwrap());
    let vocab = model.config().vocab_size as u32;
    let mut out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let spec = if tagged && context > 1 {
            PartitionSpec::replicated()
                .with_reduced(["context"])
                .unwrap()
        } else {
            PartitionSpec::replicated()
        };
        let params: Vec<Array> = model
            .params()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let ty = cx.array_type(&p.shape, spec.clone())?;
                cx.from_global(&init_normal(p, 7, i), ty.sharding().clone())
            })
            .collect::<Result<_, _>>()?;
        let tokens: Vec<u32> = (0..B * T).map(|i| (i as u32 * 7 + 3) % vocab).collect();
        let targets: Vec<u32> = (0..B * T).map(|i| (i as u32 * 5 + 1) % vocab).collect();
        // Two documents a row when packed: 0..5 and 5..16 in row 0, 0..11 and 11..16 in row 1.
        let in_document: Vec<u32> = (0..B * T)
            .map(|n| {
                let (r, i) = (n / T, n % T);
                let start = if r == 0 { [0, 5] } else { [0, 11] };
                let start = if packed {
                    *start.iter().filter(|&&s| s <= i).max().unwrap()
                } else {
                    0
                };
                (i - start) as u32
            })
            .collect();
        let index: Vec<u32> = (0..B * T).map(|n| (n % T) as u32).collect();
        // Balanced: each row's 2n chunks reordered so device i holds chunks i and 2n−1−i.
        let chunks = 2 * context;
        let order = |v: &[u32]| -> Vec<u32> {
            if !balanced {
                return v.to_vec();
            }
            let size = T / chunks;
            v.chunks(T)
                .flat_map(|row| {
                    (0..chunks).flat_map(move |slot| {
                        let j = (0..chunks)
                            .find(|&j| Balanced::slot_of(j, chunks) == slot)
                            .unwrap();
                        row[j * size..(j + 1) * size].to_vec()
                    })
                })
                .collect()
        };
        let split = PartitionSpec::new([None, Some("context")]);
        let ids = cx.ids_from_global(&[B, T], split.clone(), &order(&tokens))?;
        let tgt = cx.ids_from_global(&[B, T], split.clone(), &order(&targets))?;
        let docs = if packed || balanced {
            Some(Positions {
                in_document: cx.ids_from_global(&[B, T], split.clone(), &order(&in_document))?,
                balanced: balanced
                    .then(|| -> Result<Balanced, SpmdError> {
                        Ok(Balanced {
                            index: cx.ids_from_global(&[B, T], split.clone(), &order(&index))?,
                            chunks,
                        })
                    })
                    .transpose()?,
            })
        } else {
            None
        };
        let options = LossOptions::default();
        let (loss, grads) = cx.value_and_grad(&params, |cx, ps| {
            Ok(model
                .loss(cx, ps, (&ids, docs.as_ref()), &tgt, options)?
                .total)
        })?;
        let grads: Vec<Vec<f32>> = grads
            .iter()
            .map(|g| Ok(g.local()?.data().to_vec()))
            .collect::<Result<_, SpmdError>>()?;
        let trace = cx.comm().take_trace();
        Ok::<_, SpmdError>((loss.scalar()?, grads, trace))
    })
    .unwrap();
    // Partial sums (tagged) add up over the devices; plain gradients are equal everywhere.
    let mut total = out[0].1.clone();
    if tagged {
        for other in &out[1..] {
            for (t, g) in total.iter_mut().zip(&other.1) {
                t.iter_mut().zip(g).for_each(|(a, b)| *a += b);
            }
        }
    }
    let first = out.swap_remove(0);
    (first.0, total, first.2)
}

fn close(a: &[f32], b: &[f32], rel: f32, what: &str) {
    let scale = b.iter().fold(1e-30f32, |m, x| m.max(x.abs()));
    let worst = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= rel * scale.max(1.0),
        "{what}: {worst:e} apart, largest {scale:e}"
    );
}

fn check(cfg: Config, packed: bool) {
    let model = Decoder::new(cfg).unwrap();
    let (loss, grads, _) = run(&model, 1, false, (packed, false));
    for (context, tagged, balanced) in [
        (2, false, false),
        (4, false, true),
        (4, true, false),
        (2, true, true),
    ] {
        let (l, g, trace) = run(&model, context, tagged, (packed, balanced));
        let at = format!("context={context} tagged={tagged} packed={packed} balanced={balanced}");
        close(&[l], &[loss], 1e-6, &format!("{at}: loss"));
        // The gradients add each device's tokens' terms in another order: f32 rounding.
        for (i, (a, b)) in g.iter().zip(&grads).enumerate() {
            close(a, b, 1e-5, &format!("{at}: gradient {i}"));
        }
        let any = PhasePattern::any();
        // Each layer gathers its keys and values, and scatters their cotangents back.
        let layers = model.config().base_num_decoder_layers;
        assert!(
            trace.count(CollectiveKind::AllGather, &any) >= 2 * layers,
            "{at}"
        );
        assert!(
            trace.count(CollectiveKind::ReduceScatter, &any) >= 2 * layers,
            "{at}"
        );
        if tagged {
            // Only the loss's and the scalars' all-reduces: no weight gradient is reduced.
            let large = trace.all_reduces_larger_than(1, &any);
            assert!(large.is_empty(), "{at}: {large:?}");
        } else {
            assert!(
                !trace.all_reduces_larger_than(1, &any).is_empty(),
                "{at}: the mirror"
            );
        }
    }
}

#[test]
fn a_split_sequence_gives_the_one_device_loss_and_gradients_gqa() {
    check(gqa(), false);
    check(gqa(), true);
}

#[test]
fn a_split_sequence_gives_the_one_device_loss_and_gradients_mla() {
    check(mla(), false);
}
