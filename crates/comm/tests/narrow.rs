//! Reductions of f32 values moved as bf16 (`Communicator::all_reduce_as` and its siblings)
//! against host arithmetic written out here: each member's value rounded to bf16, the four
//! summed as `(x0 + x1) + (x2 + x3)` in f32, the sum rounded once. The blocking and background
//! forms agree, the trace records 2 bytes an element, and `DType::F32` is the plain f32 sum (the
//! mirror).

use std::sync::Arc;

use ferrotext_comm::{run_spmd, CommError, SpmdOptions};
use ferrotext_sharding::{DType, Mesh};
use half::bf16;

/// Member `d`'s value at element `i`: not representable in bf16, so the rounding shows.
fn value(d: usize, i: usize) -> f32 {
    1.0 + (d * 37 + i * 11) as f32 * 1e-3 + 1.0 / 3.0 * (i % 7) as f32
}

fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

#[test]
fn a_bf16_reduction_rounds_each_member_and_the_tree_sum_once() {
    let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
    let n = 40;
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let comm = dev.comm();
        let d = comm.device();
        let mine: Vec<f32> = (0..n).map(|i| value(d, i)).collect();
        let mut blocking = mine.clone();
        comm.all_reduce_as(&["data"], &mut blocking, DType::BF16)?;
        let background = comm
            .start_all_reduce_as(&["data"], mine.clone(), DType::BF16)?
            .wait()?;
        let mut plain = mine.clone();
        comm.all_reduce_as(&["data"], &mut plain, DType::F32)?;
        let mut scattered = vec![0.0; n / 4];
        comm.reduce_scatter_as(&["data"], &mine, &mut scattered, DType::BF16)?;
        let scattered_bg = comm
            .start_reduce_scatter_as(&["data"], mine, DType::BF16)?
            .wait()?;
        Ok::<_, CommError>((
            blocking,
            background,
            plain,
            scattered,
            scattered_bg,
            comm.take_trace(),
        ))
    })
    .unwrap();
    let want: Vec<f32> = (0..n)
        .map(|i| {
            let x: Vec<f32> = (0..4).map(|d| round(value(d, i))).collect();
            round((x[0] + x[1]) + (x[2] + x[3]))
        })
        .collect();
    let want_f32: Vec<f32> = (0..n)
        .map(|i| {
            let x: Vec<f32> = (0..4).map(|d| value(d, i)).collect();
            (x[0] + x[1]) + (x[2] + x[3])
        })
        .collect();
    assert_ne!(want, want_f32, "the rounding shows in these values");
    for (d, (blocking, background, plain, scattered, scattered_bg, trace)) in out.iter().enumerate()
    {
        assert_eq!(blocking, &want, "device {d}");
        assert_eq!(background, &want, "device {d}, background");
        assert_eq!(plain, &want_f32, "device {d}, f32");
        let chunk = &want[d * n / 4..(d + 1) * n / 4];
        assert_eq!(scattered, chunk, "device {d}, reduce-scatter");
        assert_eq!(scattered_bg, chunk, "device {d}, background reduce-scatter");
        let kinds: Vec<(DType, usize)> =
            trace.events().iter().map(|e| (e.dtype, e.bytes)).collect();
        assert_eq!(
            kinds,
            [
                (DType::BF16, 2 * n),
                (DType::BF16, 2 * n),
                (DType::F32, 4 * n),
                (DType::BF16, 2 * n),
                (DType::BF16, 2 * n),
            ]
        );
    }
}

#[test]
fn a_group_of_one_still_rounds_its_value_once() {
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let comm = dev.comm();
        let mut x = vec![value(0, 1), value(0, 2)];
        comm.all_reduce_as(&["data"], &mut x, DType::BF16)?;
        let y = comm
            .start_all_reduce_as(&["data"], vec![value(0, 1), value(0, 2)], DType::BF16)?
            .wait()?;
        Ok::<_, CommError>((x, y))
    })
    .unwrap();
    let want = vec![round(value(0, 1)), round(value(0, 2))];
    assert_ne!(want, vec![value(0, 1), value(0, 2)]);
    assert_eq!(out[0].0, want);
    assert_eq!(out[0].1, want);
}
