//! slice, concat, take (embedding lookup) and select: values, gradients, type errors; and R7.2.

mod common;

use common::*;
use ferrotext_comm::{CollectiveKind, PhasePattern};
use ferrotext_sharding::PartitionSpec;
use ferrotext_spmd::{Array, Ctx, SpmdError, TypeErrorKind};
use ferrotext_tensor::{DotDims, Tensor};

fn sum_sq(cx: &mut Ctx<'_>, y: &Array) -> Result<Array, SpmdError> {
    let y2 = cx.mul(y, y)?;
    let axes: Vec<usize> = (0..y.ty().rank()).collect();
    cx.reduce_sum(&y2, &axes, None)
}

#[test]
fn slice_and_concat_values_and_gradients() {
    let m = mesh(&[("data", 2)]);
    let results = on_devices(&m, |cx| {
        let x = place(cx, &iota(&[4, 6]), p(&["data", ""], &[], &[]));
        let (_, g) = cx.value_and_grad(std::slice::from_ref(&x), |cx, xs| {
            let a = cx.slice(&xs[0], 1, 1, 3)?;
            let b = cx.slice(&xs[0], 1, 4, 6)?;
            let c = cx.concat(&[&a, &b], 1)?;
            sum_sq(cx, &c)
        })?;
        let err = cx.slice(&x, 0, 0, 1).unwrap_err();
        assert_eq!(
            err.type_error().unwrap().kind,
            TypeErrorKind::ShardingMismatch
        );
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    // d/dx sum(c²) = 2x on the kept columns 1,2,4,5 and 0 on columns 0,3.
    let want: Vec<f32> = (0..24)
        .map(|i| {
            if matches!(i % 6, 0 | 3) {
                0.0
            } else {
                2.0 * i as f32
            }
        })
        .collect();
    for (g, _) in results {
        assert_eq!(g, want);
    }
}

/// Two overlapping slices of one value: the walk adds the second slice's cotangent into the
/// first's contribution in place (no zero-padded copy); the sum is R4.4's, checked against hand
/// values, for a sharded value and for a reduced one (whose gradient stays a partial sum).
#[test]
fn slices_of_one_value_add_their_cotangents_into_one_contribution() {
    let x = Tensor::from_fn(&[4, 5], |i| 0.25 * i as f32 - 1.0);
    let c = Tensor::from_fn(&[4, 3], |i| 0.5 * (i % 7) as f32);
    for reduced in [false, true] {
        let m = mesh(&[("data", 2)]);
        let results = on_devices(&m, |cx| {
            let spec = if reduced {
                p(&["", ""], &[], &["data"])
            } else {
                p(&["data", ""], &[], &[])
            };
            let xs = place(cx, &x, spec.clone());
            let cs = place(cx, &c, spec);
            let (_, g) = cx.value_and_grad(std::slice::from_ref(&xs), |cx, v| {
                // Columns 0..3 squared, columns 2..5 times `c`: column 2 gets both.
                let a = cx.slice(&v[0], 1, 0, 3)?;
                let b = cx.slice(&v[0], 1, 2, 5)?;
                let bc = cx.mul(&b, &cs)?;
                let lin = cx.reduce_sum(&bc, &[0, 1], None)?;
                let sq = sum_sq(cx, &a)?;
                cx.add(&sq, &lin)
            })?;
            let ty = g[0].ty().to_string();
            let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
            Ok((local(&full), ty))
        });
        // d/dx: 2x on columns 0..3, plus c on columns 2..5 (for a reduced value, the sum of
        // the devices' partials).
        let want: Vec<f32> = (0..20)
            .map(|i| {
                let (r, col) = (i / 5, i % 5);
                let mut g = 0.0;
                if col < 3 {
                    g += 2.0 * x.data()[i];
                }
                if col >= 2 {
                    g += c.data()[r * 3 + col - 2];
                }
                g
            })
            .collect();
        for ((g, ty), _) in results {
            let expect_ty = if reduced {
                "f32[4,5]{U:data}"
            } else {
                "f32[4@data,5]"
            };
            assert_eq!(ty, expect_ty);
            assert_close(&g, &want, 1e-6, "overlapping slices' gradient");
        }
    }
}

#[test]
fn slice_keeps_an_unreduced_tag_and_pads_its_cotangent_with_zeros() {
    let m = mesh(&[("data", 2)]);
    let results = on_devices(&m, |cx| {
        let plain = place(cx, &iota(&[6]), PartitionSpec::replicated());
        let u = cx.reshard(&plain, &p(&[""], &["data"], &[]))?;
        let s = cx.slice(&u, 0, 2, 5)?;
        assert_eq!(s.ty().to_string(), "f32[3]{U:data}");
        let full = cx.reshard(&s, &PartitionSpec::replicated())?;
        Ok(local(&full))
    });
    for (v, _) in results {
        assert_eq!(v, vec![2., 3., 4.]);
    }
}

/// The gradient of an untied lookup ([`table_gradient`]), with each device's trace.
fn lookup(table_reduced: bool) -> Vec<((Vec<f32>, String), ferrotext_comm::Trace)> {
    table_gradient(table_reduced, None, false)
}

fn host_lookup_grad() -> Vec<f32> {
    let mut g = vec![0f32; 15];
    for &i in &[4usize, 0, 4, 2, 1, 1, 3, 0] {
        for j in 0..3 {
            g[i * 3 + j] += 2.0 * 0.1 * (i * 3 + j) as f32;
        }
    }
    g
}

/// The head's input in [`table_gradient`]: `[2, 4, 3]`, split over `data`.
fn head_input() -> Tensor {
    Tensor::from_fn(&[2, 4, 3], |i| 0.01 * i as f32 - 0.1)
}

/// On two devices, the table's gradient (replicated) and its type, of `Σ rows²` for a lookup of
/// the 5×3 table at `[4, 0, 4, 2, 1, 1, 3, 0]` (split over `data`; [`Ctx::take_frozen`] at
/// `frozen` when given), plus, when `tied`, `Σ x·tableᵀ` ([`head_input`]: a head reading the
/// same table). The table reduced over `data`, or plain.
fn table_gradient(
    reduced: bool,
    frozen: Option<u32>,
    tied: bool,
) -> Vec<((Vec<f32>, String), ferrotext_comm::Trace)> {
    let m = mesh(&[("data", 2)]);
    on_devices(&m, |cx| {
        let spec = if reduced {
            p(&["", ""], &[], &["data"])
        } else {
            p(&["", ""], &[], &[])
        };
        let table = place(cx, &Tensor::from_fn(&[5, 3], |i| 0.1 * i as f32), spec);
        let ids = cx.ids_from_global(
            &[2, 4],
            p(&["data", ""], &[], &[]),
            &[4, 0, 4, 2, 1, 1, 3, 0],
        )?;
        let xs = place(cx, &head_input(), p(&["data", "", ""], &[], &[]));
        let head = DotDims {
            lhs_contracting: vec![2],
            rhs_contracting: vec![1],
            ..DotDims::default()
        };
        cx.comm().push_phase("step");
        let (_, g) = cx.value_and_grad(&[table], |cx, ts| {
            // The take is recorded first, so the walk reaches it last, after the product.
            let rows = match frozen {
                Some(row) => cx.take_frozen(&ts[0], &ids, row)?,
                None => cx.take(&ts[0], &ids)?,
            };
            assert_eq!(rows.ty().to_string(), "f32[2@data,4,3]");
            let looked = sum_sq(cx, &rows)?;
            if !tied {
                return Ok(looked);
            }
            let logits = cx.dot_general(&xs, &ts[0], &head, None)?;
            let linear = cx.reduce_sum(&logits, &[0, 1, 2], None)?;
            cx.add(&looked, &linear)
        })?;
        cx.comm().pop_phase();
        let ty = g[0].ty().to_string();
        let full = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        Ok((local(&full), ty))
    })
}

/// [`table_gradient`] by hand: the lookup's rows (none for the frozen row) and, tied, the column
/// sums of `x` on every row (d/dt Σ x·tᵀ).
fn host_table_gradient(frozen: Option<u32>, tied: bool) -> Vec<f32> {
    let x = head_input();
    let colsum: Vec<f32> = (0..3)
        .map(|j| (0..8).map(|r| x.data()[r * 3 + j]).sum())
        .collect();
    host_lookup_grad()
        .iter()
        .enumerate()
        .map(|(i, &g)| {
            let looked = if Some((i / 3) as u32) == frozen {
                0.0
            } else {
                g
            };
            if tied {
                looked + colsum[i % 3]
            } else {
                looked
            }
        })
        .collect()
}

/// `take_frozen` reads the rows `take` reads, bit for bit, and its lookups pass nothing back to
/// the frozen row (transformers' `padding_idx`); every other row's gradient is the host's. Tied
/// to a head, the frozen row still gets the head's part, and only it. For a reduced table (the
/// gradient unreduced, added in place) and a plain one (all-reduced).
#[test]
fn a_frozen_take_reads_the_same_rows_and_passes_nothing_back_to_its_row() {
    let m = mesh(&[("data", 2)]);
    let rows = on_devices(&m, |cx| {
        let table = place(
            cx,
            &Tensor::from_fn(&[5, 3], |i| 0.1 * i as f32),
            p(&["", ""], &[], &[]),
        );
        let ids = cx.ids_from_global(
            &[2, 4],
            p(&["data", ""], &[], &[]),
            &[4, 0, 4, 2, 1, 1, 3, 0],
        )?;
        Ok((
            local(&cx.take(&table, &ids)?),
            local(&cx.take_frozen(&table, &ids, 4)?),
        ))
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for ((plain, frozen), _) in rows {
        assert_eq!(bits(&frozen), bits(&plain), "the rows take reads");
    }
    for reduced in [true, false] {
        for tied in [false, true] {
            let want = host_table_gradient(Some(4), tied);
            for ((g, _), _) in table_gradient(reduced, Some(4), tied) {
                assert_close(&g, &want, 1e-6, "frozen table grad");
                if !tied {
                    assert!(g[12..15].iter().all(|&g| g == 0.0));
                }
            }
        }
    }
    // The mirror: the host's gradient of `take` moves the row.
    assert!(host_lookup_grad()[12..15].iter().all(|&g| g != 0.0));
}

/// A table used by a `take` and by a product (a tied embedding and its output head): the take's
/// rows are added into the product's contribution in place; the gradient is the host's,
/// `{U:data}` for a reduced table and all-reduced for a plain one.
#[test]
fn a_take_adds_its_rows_into_the_tables_other_contribution() {
    for reduced in [true, false] {
        for ((g, ty), _) in table_gradient(reduced, None, true) {
            let tagged = if reduced { "{U:data}" } else { "" };
            assert_eq!(ty, format!("f32[5,3]{tagged}"));
            assert_close(
                &g,
                &host_table_gradient(None, true),
                1e-6,
                "tied table grad",
            );
        }
    }
}

#[test]
fn take_of_a_reduced_table_gives_an_unreduced_gradient_without_communication() {
    for ((g, ty), trace) in lookup(true) {
        assert_eq!(ty, "f32[5,3]{U:data}");
        assert_close(&g, &host_lookup_grad(), 1e-6, "embedding grad");
        assert!(trace
            .all_reduces_larger_than(1, &PhasePattern::new("step"))
            .is_empty());
    }
}

#[test]
fn mirror_take_of_a_plain_table_all_reduces_its_gradient() {
    for ((g, ty), trace) in lookup(false) {
        assert_eq!(ty, "f32[5,3]");
        assert_close(&g, &host_lookup_grad(), 1e-6, "embedding grad");
        let big = trace.all_reduces_larger_than(1, &PhasePattern::new("step"));
        assert_eq!(big.len(), 1);
        assert_eq!(big[0].elements, 15);
    }
}

#[test]
fn select_routes_values_and_gradients() {
    let m = mesh(&[("data", 2)]);
    let results = on_devices(&m, |cx| {
        let mask = place(
            cx,
            &Tensor::from_fn(&[4], |i| (i % 2) as f32),
            p(&["data"], &[], &[]),
        );
        let a = place(cx, &Tensor::full(&[4], 3.0), p(&["data"], &[], &[]));
        let b = place(cx, &Tensor::full(&[4], 5.0), p(&["data"], &[], &[]));
        let (v, g) = cx.value_and_grad(&[a, b], |cx, xs| {
            let s = cx.select(&mask, &xs[0], &xs[1])?;
            sum_sq(cx, &s)
        })?;
        let ga = cx.reshard(&g[0], &PartitionSpec::replicated())?;
        let gb = cx.reshard(&g[1], &PartitionSpec::replicated())?;
        Ok((v.scalar()?, local(&ga), local(&gb)))
    });
    for ((v, ga, gb), _) in results {
        assert_eq!(v, 2.0 * 9.0 + 2.0 * 25.0);
        assert_eq!(ga, vec![0., 6., 0., 6.]);
        assert_eq!(gb, vec![10., 0., 10., 0.]);
    }
}

/// R7.2: an unreduced gradient cannot be accumulated into a plain accumulator.
#[test]
fn accumulating_unreduced_into_plain_is_an_error() {
    let m = mesh(&[("data", 2)]);
    let results = on_devices(&m, |cx| {
        let acc = cx.zeros(cx.array_type(&[3], PartitionSpec::replicated())?);
        let g = cx.zeros(cx.array_type(&[3], p(&[""], &["data"], &[]))?);
        let err = cx.add(&acc, &g).unwrap_err();
        let t = err.type_error().unwrap().clone();
        Ok((
            t.kind,
            t.to_string(),
            cx.comm()
                .trace()
                .count(CollectiveKind::AllReduce, &PhasePattern::any()),
        ))
    });
    for ((kind, msg, n), _) in results {
        assert_eq!(kind, TypeErrorKind::UnreducedMismatch);
        assert!(msg.contains("rhs is unreduced while lhs is not"), "{msg}");
        assert_eq!(n, 0, "the error is raised before any communication");
    }
}
