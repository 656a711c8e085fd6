use super::*;

#[test]
fn contiguous_slices_are_views_and_writes_to_them_copy_only_their_elements() {
    let a = Tensor::from_fn(&[4, 3], |i| i as f32);
    let rows = a.slice_dim(0, 1..3).expect("rows");
    assert_eq!(
        rows.data().as_ptr(),
        a.data()[3..].as_ptr(),
        "rows are a view"
    );
    assert_eq!(
        rows,
        Tensor::new(vec![2, 3], (3..9).map(|i| i as f32).collect()).unwrap()
    );
    let one = a.slice(&[2..3, 1..3]).expect("part of one row");
    assert_eq!(
        one.data().as_ptr(),
        a.data()[7..].as_ptr(),
        "one row's run is a view"
    );
    let cols = a.slice_dim(1, 0..2).expect("columns");
    assert_eq!(
        cols.data(),
        &[0.0, 1.0, 3.0, 4.0, 6.0, 7.0, 9.0, 10.0],
        "columns copy"
    );
    let mut written = rows.clone();
    written.data_mut()[0] = -1.0;
    assert_eq!(written.data(), &[-1.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    assert_eq!(
        a.data()[3],
        3.0,
        "the storage's other holders are untouched"
    );
    assert_eq!(rows.into_data(), vec![3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    let storage = std::sync::Arc::new((0..10).map(|i| i as f32).collect::<Vec<f32>>());
    let v = Tensor::view(storage.clone(), 4, vec![2, 2]).expect("fits");
    assert_eq!(v.data(), &[4.0, 5.0, 6.0, 7.0]);
    assert!(Tensor::view(storage, 8, vec![3]).is_err(), "past the end");
}

#[test]
fn clones_share_storage_until_one_is_written() {
    let a = Tensor::from_fn(&[2, 3], |i| i as f32);
    let mut b = a.clone();
    assert_eq!(
        a.data().as_ptr(),
        b.data().as_ptr(),
        "a clone copies nothing"
    );
    let r = a.clone().reshape(&[3, 2]).expect("same count");
    assert_eq!(r.data().as_ptr(), a.data().as_ptr(), "nor does a reshape");
    b.data_mut()[0] = 9.0;
    assert_ne!(
        a.data().as_ptr(),
        b.data().as_ptr(),
        "a write to a shared tensor copies"
    );
    assert_eq!((a.data()[0], b.data()[0], r.data()[0]), (0.0, 9.0, 0.0));
    let sole = b.data().as_ptr();
    b.data_mut()[1] = 8.0;
    assert_eq!(
        b.data().as_ptr(),
        sole,
        "a tensor that shares nothing is written in place"
    );
    assert_eq!(r.into_data(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(a.data(), &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
}

fn iota(shape: &[usize]) -> Tensor {
    Tensor::from_fn(shape, |i| i as f32)
}

#[test]
fn transpose_matches_index_arithmetic() {
    let t = iota(&[2, 3, 4]);
    let p = t.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(p.shape(), &[4, 2, 3]);
    for a in 0..2 {
        for b in 0..3 {
            for c in 0..4 {
                assert_eq!(p.data()[c * 6 + a * 3 + b], t.data()[a * 12 + b * 4 + c]);
            }
        }
    }
    assert!(t.transpose(&[0, 0, 1]).is_err());
}

#[test]
fn slice_concat_split_round_trip() {
    let t = iota(&[4, 6]);
    let parts = t.split(1, 3).unwrap();
    assert_eq!(parts[1].data(), &[2., 3., 8., 9., 14., 15., 20., 21.]);
    let refs: Vec<&Tensor> = parts.iter().collect();
    assert_eq!(Tensor::concat(&refs, 1).unwrap(), t);
    let rows = t.split(0, 2).unwrap();
    assert_eq!(Tensor::concat(&[&rows[0], &rows[1]], 0).unwrap(), t);
    assert_eq!(
        t.slice(&[1..3, 4..6]).unwrap().data(),
        &[10., 11., 16., 17.]
    );
    assert!(t.split(1, 4).is_err());
    assert!(t.slice(&[0..5, 0..1]).is_err());
}

#[test]
fn broadcast_in_dim_repeats_missing_dims() {
    let b = Tensor::new(vec![3], vec![1., 2., 3.]).unwrap();
    let out = b.broadcast_in_dim(&[2, 3], &[1]).unwrap();
    assert_eq!(out.data(), &[1., 2., 3., 1., 2., 3.]);
    let col = Tensor::new(vec![2, 1], vec![5., 6.]).unwrap();
    let out = col.broadcast_in_dim(&[2, 3], &[0, 1]).unwrap();
    assert_eq!(out.data(), &[5., 5., 5., 6., 6., 6.]);
    assert_eq!(
        Tensor::scalar(7.)
            .broadcast_in_dim(&[2], &[])
            .unwrap()
            .data(),
        &[7., 7.]
    );
    assert!(b.broadcast_in_dim(&[3, 2], &[1]).is_err());
}

/// Every element of `shape`, row-major, from its index.
fn by_index(shape: &[usize], f: impl Fn(&[usize]) -> f32) -> Vec<f32> {
    let mut out = Vec::new();
    let mut index = vec![0; shape.len()];
    for _ in 0..shape.iter().product::<usize>() {
        out.push(f(&index));
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    out
}

/// Transposes, strided slices, broadcasts, concatenations and paddings big enough to be cut
/// into many blocks give the elements index arithmetic names (a padding: the concatenation
/// with zero tensors), on 1 to 3 kernel threads.
#[test]
fn structural_copies_match_index_arithmetic_on_any_budget() {
    // 100 800 elements: split into 3 parts on 3 threads.
    let shape = [6, 70, 5, 48];
    let t = iota(&shape);
    let at = |i: &[usize]| t.data()[((i[0] * 70 + i[1]) * 5 + i[2]) * 48 + i[3]];
    let want_t = by_index(&[6, 5, 70, 48], |i| at(&[i[0], i[2], i[1], i[3]]));
    let want_t2 = by_index(&[48, 70, 6, 5], |i| at(&[i[2], i[1], i[3], i[0]]));
    let want_slice = by_index(&[4, 60, 5, 32], |i| {
        at(&[i[0] + 1, i[1] + 5, i[2], i[3] + 8])
    });
    let row = Tensor::from_fn(&[70, 1, 48], |i| -(i as f32));
    let want_b = by_index(&shape, |i| row.data()[i[1] * 48 + i[3]]);
    let col = Tensor::from_fn(&[6, 70, 5, 1], |i| i as f32 + 0.5);
    let want_col = by_index(&shape, |i| col.data()[(i[0] * 70 + i[1]) * 5 + i[2]]);
    let (a, b) = (
        t.slice_dim(3, 0..24).unwrap(),
        t.slice_dim(3, 24..48).unwrap(),
    );
    for threads in [1, 2, 3] {
        crate::parallel::with_kernel_pool(threads, "t", 1 << 20, || {
            assert_eq!(t.transpose(&[0, 2, 1, 3]).unwrap().data(), want_t);
            assert_eq!(t.transpose(&[3, 1, 0, 2]).unwrap().data(), want_t2);
            let sliced = t.slice(&[1..5, 5..65, 0..5, 8..40]).unwrap();
            assert_eq!(sliced.data(), want_slice);
            assert_eq!(
                row.broadcast_in_dim(&shape, &[1, 2, 3]).unwrap().data(),
                want_b
            );
            assert_eq!(
                col.broadcast_in_dim(&shape, &[0, 1, 2, 3]).unwrap().data(),
                want_col
            );
            assert_eq!(Tensor::concat(&[&a, &b], 3).unwrap(), t);
            let (c, d) = (t.slice_dim(2, 0..2).unwrap(), t.slice_dim(2, 2..5).unwrap());
            assert_eq!(Tensor::concat(&[&c, &d], 2).unwrap(), t);
            let (z0, z1) = (
                Tensor::zeros(&[6, 70, 2, 48]),
                Tensor::zeros(&[6, 70, 1, 48]),
            );
            let padded = Tensor::concat(&[&z0, &d, &z1], 2).unwrap();
            assert_eq!(d.pad_dim(2, 2, 1).unwrap(), padded);
            let (z0, z1) = (Tensor::zeros(&[6, 70, 5, 5]), Tensor::zeros(&[6, 70, 5, 0]));
            let padded = Tensor::concat(&[&z0, &b, &z1], 3).unwrap();
            assert_eq!(b.pad_dim(3, 5, 0).unwrap(), padded);
            assert!(b.pad_dim(4, 1, 1).is_err());
        });
    }
}

#[test]
fn reshape_keeps_data_and_checks_counts() {
    let t = iota(&[2, 3]).reshape(&[3, 2]).unwrap();
    assert_eq!(t.shape(), &[3, 2]);
    assert_eq!(t.data()[5], 5.0);
    assert!(t.reshape(&[4]).is_err());
    assert!(Tensor::new(vec![2], vec![1.0]).is_err());
}

/// `written_zeros` writes every element, shared over a kernel pool's threads or on one: `+0.0`
/// in each, at lengths one task zeroes, lengths split over two tasks (evenly and not), runs
/// streamed, and none. Each call
/// follows the freeing of a block of NaN of its size, which the allocator hands back to it
/// (its thread's cache, `mmap` off in the binary and a reused heap block otherwise), so an
/// element the writes missed would read NaN.
#[test]
fn written_zeros_writes_every_element_on_any_budget() {
    // One task's run (below two of `Work::Light`'s least part), runs split over two tasks
    // with an odd length (the second run shorter), and runs streamed (from `STREAMED_ZEROS`;
    // the second run of an odd split starts off a 16-byte boundary).
    let lengths = [
        0,
        1,
        (1 << 16) - 1,
        1 << 16,
        3 * (1 << 16) + 5,
        super::STREAMED_ZEROS,
        (1 << 20) + 1,
        (1 << 20) + 7,
    ];
    for threads in [1, 2] {
        crate::with_kernel_pool(threads, "zeros-test", 1 << 20, || {
            for &len in &lengths {
                drop(std::hint::black_box(vec![f32::NAN; len]));
                let z = written_zeros(len);
                assert_eq!(z.len(), len);
                assert!(z.iter().all(|x| x.to_bits() == 0), "{len} on {threads}");
            }
        });
    }
}
