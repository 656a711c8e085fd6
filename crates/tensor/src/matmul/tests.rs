//! `dot_general`'s tests: a plain triple-loop reference on layouts that need and do not need
//! copies, accumulation, strided batch dims on any thread count, bad dimension numbers.

use super::*;

/// Plain triple loop over the same dimension numbers.
fn reference(lhs: &Tensor, rhs: &Tensor, dims: &DotDims) -> Tensor {
    let out_shape = dims.output_shape(lhs.shape(), rhs.shape()).unwrap();
    let lf = DotDims::free(lhs.rank(), &dims.lhs_batch, &dims.lhs_contracting);
    let rf = DotDims::free(rhs.rank(), &dims.rhs_batch, &dims.rhs_contracting);
    let ls = strides(lhs.shape());
    let rs = strides(rhs.shape());
    let csizes: Vec<usize> = dims
        .lhs_contracting
        .iter()
        .map(|&d| lhs.shape()[d])
        .collect();
    let ccount: usize = csizes.iter().product();
    Tensor::from_fn(&out_shape, |flat| {
        let mut idx = vec![0; out_shape.len()];
        let mut rest = flat;
        for d in (0..out_shape.len()).rev() {
            idx[d] = rest % out_shape[d];
            rest /= out_shape[d];
        }
        let nb = dims.lhs_batch.len();
        let mut acc = 0.0f64;
        for c in 0..ccount {
            let mut cidx = vec![0; csizes.len()];
            let mut r = c;
            for j in (0..csizes.len()).rev() {
                cidx[j] = r % csizes[j];
                r /= csizes[j];
            }
            let mut lo = 0;
            let mut ro = 0;
            for (j, (&l, &rr)) in dims.lhs_batch.iter().zip(&dims.rhs_batch).enumerate() {
                lo += idx[j] * ls[l];
                ro += idx[j] * rs[rr];
            }
            for (j, &l) in lf.iter().enumerate() {
                lo += idx[nb + j] * ls[l];
            }
            for (j, &r2) in rf.iter().enumerate() {
                ro += idx[nb + lf.len() + j] * rs[r2];
            }
            for (j, (&l, &r2)) in dims
                .lhs_contracting
                .iter()
                .zip(&dims.rhs_contracting)
                .enumerate()
            {
                lo += cidx[j] * ls[l];
                ro += cidx[j] * rs[r2];
            }
            acc += lhs.data()[lo] as f64 * rhs.data()[ro] as f64;
        }
        acc as f32
    })
}

fn rand(shape: &[usize], seed: u32) -> Tensor {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    Tensor::from_fn(shape, |_| {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s % 2000) as f32 / 1000.0 - 1.0
    })
}

fn close(a: &Tensor, b: &Tensor) {
    assert_eq!(a.shape(), b.shape());
    for (x, y) in a.data().iter().zip(b.data()) {
        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{x} vs {y}");
    }
}

#[test]
fn matches_reference_on_layouts_that_need_and_do_not_need_copies() {
    let cases: Vec<(Vec<usize>, Vec<usize>, DotDims)> = vec![
        // x·W
        (vec![5, 7], vec![7, 3], DotDims::matmul(2)),
        // x·Wᵀ
        (
            vec![5, 7],
            vec![3, 7],
            DotDims {
                lhs_contracting: vec![1],
                rhs_contracting: vec![1],
                ..Default::default()
            },
        ),
        // xᵀ·dy over two leading (batch, seq) dims: the weight gradient
        (
            vec![2, 3, 4],
            vec![2, 3, 5],
            DotDims {
                lhs_contracting: vec![0, 1],
                rhs_contracting: vec![0, 1],
                ..Default::default()
            },
        ),
        // attention scores: [B,H,T,D]·[B,H,S,D] over D, batch (B,H)
        (
            vec![2, 3, 4, 5],
            vec![2, 3, 6, 5],
            DotDims {
                lhs_contracting: vec![3],
                rhs_contracting: vec![3],
                lhs_batch: vec![0, 1],
                rhs_batch: vec![0, 1],
            },
        ),
        // a permuted layout that needs a copy: batch in the middle
        (
            vec![4, 2, 3],
            vec![3, 2, 5],
            DotDims {
                lhs_contracting: vec![2],
                rhs_contracting: vec![0],
                lhs_batch: vec![1],
                rhs_batch: vec![1],
            },
        ),
        // outer product and an empty contraction
        (vec![3], vec![4], DotDims::default()),
        (vec![3, 0], vec![0, 2], DotDims::matmul(2)),
    ];
    for (i, (ls, rs, dims)) in cases.into_iter().enumerate() {
        let a = rand(&ls, i as u32);
        let b = rand(&rs, 100 + i as u32);
        for threads in [1, 2] {
            close(
                &dot_general(&a, &b, &dims, threads).unwrap(),
                &reference(&a, &b, &dims),
            );
        }
    }
    // A big enough product to run multithreaded.
    let a = rand(&[96, 80], 7);
    let b = rand(&[80, 72], 8);
    close(
        &dot_general(&a, &b, &DotDims::matmul(2), 2).unwrap(),
        &reference(&a, &b, &DotDims::matmul(2)),
    );
}

/// A weight gradient's dimension numbers: `xᵀ·dy` contracting batch and sequence.
fn weight_gradient() -> DotDims {
    DotDims {
        lhs_contracting: vec![0, 1],
        rhs_contracting: vec![0, 1],
        ..Default::default()
    }
}

/// `dot_general_accumulate` adds the product into what the output held: against
/// `start + reference` on a weight gradient's layout (large enough to split over threads),
/// a batched one and an empty contraction, the same bits on 1, 2 and 3 threads; and a
/// wrongly sized output is an error that leaves it untouched.
#[test]
fn accumulating_adds_the_product_into_the_output() {
    let wgrad = weight_gradient();
    let batched = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![3],
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
    };
    let cases = [
        (vec![4, 64, 96], vec![4, 64, 80], wgrad),
        (vec![2, 3, 40, 24], vec![2, 3, 36, 24], batched),
        (vec![3, 0], vec![0, 2], DotDims::matmul(2)),
    ];
    for (i, (ls, rs, dims)) in cases.into_iter().enumerate() {
        let a = rand(&ls, 10 + i as u32);
        let b = rand(&rs, 20 + i as u32);
        let want = reference(&a, &b, &dims);
        let start = rand(want.shape(), 30 + i as u32);
        let sum = Tensor::new(
            want.shape().to_vec(),
            want.data()
                .iter()
                .zip(start.data())
                .map(|(w, c)| w + c)
                .collect(),
        )
        .unwrap();
        let mut first: Option<Vec<f32>> = None;
        for threads in [1, 2, 3] {
            let mut out = start.data().to_vec();
            dot_general_accumulate(&a, &b, &dims, threads, &mut out).unwrap();
            close(
                &Tensor::new(want.shape().to_vec(), out.clone()).unwrap(),
                &sum,
            );
            match &first {
                None => first = Some(out),
                Some(f) => assert_eq!(&out, f, "threads {threads}"),
            }
        }
    }
    let (a, b) = (rand(&[5, 7], 1), rand(&[7, 3], 2));
    let mut short = vec![1.0f32; 14];
    assert!(dot_general_accumulate(&a, &b, &DotDims::matmul(2), 1, &mut short).is_err());
    assert!(short.iter().all(|&x| x == 1.0));
}

/// A result held in equal parts (a reduce-scatter bucket's segments) takes the product part
/// by part when every part holds whole rows — rows of a plain product, and bands that
/// cross batch entries — and is left untouched (`false`) when a part would cut a row.
#[test]
fn accumulating_into_parts_adds_each_part_its_rows_or_touches_nothing() {
    let wgrad = weight_gradient();
    let batched = DotDims {
        lhs_contracting: vec![2],
        rhs_contracting: vec![1],
        lhs_batch: vec![0],
        rhs_batch: vec![0],
    };
    // (lhs, rhs, dims, parts): the weight gradient [96, 80] in 4 parts of 24 rows; a batch
    // of 3 entries of 6 rows in 2 parts of 9 rows (each crossing an entry's end).
    let cases = [
        (vec![4, 64, 96], vec![4, 64, 80], wgrad.clone(), 4),
        (vec![3, 6, 70], vec![3, 70, 40], batched, 2),
        (vec![4, 64, 96], vec![4, 64, 80], wgrad.clone(), 1),
    ];
    for (i, (ls, rs, dims, p)) in cases.into_iter().enumerate() {
        let a = rand(&ls, 40 + i as u32);
        let b = rand(&rs, 50 + i as u32);
        let want = reference(&a, &b, &dims);
        let start = rand(want.shape(), 60 + i as u32);
        let mut first: Option<Vec<f32>> = None;
        for threads in [1, 2, 3] {
            let mut out = start.data().to_vec();
            let part = out.len() / p;
            let mut parts: Vec<&mut [f32]> = out.chunks_mut(part).collect();
            assert!(dot_general_accumulate_parts(&a, &b, &dims, threads, &mut parts).unwrap());
            for ((o, w), s) in out.iter().zip(want.data()).zip(start.data()) {
                assert!((o - (w + s)).abs() <= 1e-4 * (1.0 + w.abs()), "case {i}");
            }
            match &first {
                None => first = Some(out),
                Some(f) => assert_eq!(&out, f, "case {i}, threads {threads}"),
            }
        }
    }
    // 96·80 elements in 3 parts of 2560: 32 rows of 80 each, whole rows; in 5 parts of 1536
    // (19.2 rows) a part would cut a row.
    let (a, b) = (rand(&[4, 64, 96], 1), rand(&[4, 64, 80], 2));
    let mut out = vec![1.0f32; 96 * 80];
    let mut parts: Vec<&mut [f32]> = out.chunks_mut(2560).collect();
    assert!(dot_general_accumulate_parts(&a, &b, &wgrad, 1, &mut parts).unwrap());
    let mut out = vec![1.0f32; 96 * 80];
    let mut parts: Vec<&mut [f32]> = out.chunks_mut(1536).collect();
    assert!(!dot_general_accumulate_parts(&a, &b, &wgrad, 1, &mut parts).unwrap());
    assert!(out.iter().all(|&x| x == 1.0), "nothing touched");
    // Parts that do not add up to the result are an error.
    let mut short = vec![1.0f32; 80];
    assert!(dot_general_accumulate_parts(&a, &b, &wgrad, 1, &mut [&mut short]).is_err());
}

/// Attention's operands batched over (B, H) of `[B, T, H, d]` are strided views: the result
/// is the reference's, equal to multiplying explicitly transposed copies (to the bit on the
/// portable kernel; another layout may take another BLAS kernel), and the same bits on 1 or
/// 3 threads (the batch runs in parallel, one call per entry).
#[test]
fn strided_batch_dims_need_no_copy_and_do_not_depend_on_threads() {
    let (b, t, h, d) = (3, 17, 5, 7);
    let q = rand(&[b, t, h, d], 11);
    let k = rand(&[b, t, h, d], 12);
    let qk = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![3],
        lhs_batch: vec![0, 2],
        rhs_batch: vec![0, 2],
    };
    let st = strides(q.shape());
    let stack = as_stack(&q, &[0, 2], &[1], &[3]).unwrap();
    assert!(
        matches!(stack.data, std::borrow::Cow::Borrowed(_)),
        "no copy"
    );
    assert_eq!(stack.batch, vec![(b, st[0] as isize), (h, st[2] as isize)]);
    let y = dot_general(&q, &k, &qk, 1).unwrap();
    close(&y, &reference(&q, &k, &qk));
    let qt = q.transpose(&[0, 2, 1, 3]).unwrap();
    let kt = k.transpose(&[0, 2, 1, 3]).unwrap();
    let contiguous = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![3],
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
    };
    crate::portable::assert_equal_across_routes(
        &dot_general(&qt, &kt, &contiguous, 1).unwrap(),
        &y,
        "transposed copies",
    );
    // probs·v over the key index, with v strided: [B,H,T,T]·[B,T,H,d]
    let p = rand(&[b, h, t, t], 13);
    let pv = DotDims {
        lhs_contracting: vec![3],
        rhs_contracting: vec![1],
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 2],
    };
    let out = dot_general(&p, &k, &pv, 1).unwrap();
    close(&out, &reference(&p, &k, &pv));
    for threads in [2, 3, 8] {
        assert_eq!(dot_general(&q, &k, &qk, threads).unwrap(), y);
        assert_eq!(dot_general(&p, &k, &pv, threads).unwrap(), out);
    }
    // big enough that the batch loop runs in parallel
    let q = rand(&[2, 64, 8, 32], 14);
    let k = rand(&[2, 64, 8, 32], 15);
    let one = dot_general(&q, &k, &qk, 1).unwrap();
    close(&one, &reference(&q, &k, &qk));
    for threads in [2, 5] {
        assert_eq!(dot_general(&q, &k, &qk, threads).unwrap(), one);
    }
}

#[test]
fn bad_dimension_numbers_are_errors() {
    let a = Tensor::zeros(&[2, 3]);
    let b = Tensor::zeros(&[4, 2]);
    assert!(dot_general(&a, &b, &DotDims::matmul(2), 1).is_err());
    let dup = DotDims {
        lhs_contracting: vec![1, 1],
        rhs_contracting: vec![0, 1],
        ..Default::default()
    };
    assert!(dot_general(&a, &Tensor::zeros(&[3, 3]), &dup, 1).is_err());
}

/// A weight that keeps its packings (`Tensor::keeping_packings`), multiplied as `x·W` and as
/// `dy·Wᵀ`, several times each on one and two threads: where this process's products take the
/// portable kernel's route it packs each layout once (two packings) and gives the portable
/// kernel's bits — each element one chain of fused multiply-adds from +0 in index order,
/// computed here by hand — as does the weight as stored (the route follows the layout, not the
/// packings); elsewhere it keeps nothing and matches the reference within a tolerance. A
/// batched product or an operand the stacks must copy keeps nothing. Written in place, the
/// weight lets its packings go and its products read the new values (a stale packing would
/// give the old product). Mirror: the same weight not keeping packings keeps none.
#[test]
fn a_weight_keeping_its_packings_packs_once_per_layout() {
    let (m, k, n) = (70, 45, 50);
    let x = rand(&[m, k], 31);
    let dy = rand(&[m, n], 32);
    let w = rand(&[k, n], 33);
    let kept = w.keeping_packings();
    let backward = DotDims {
        lhs_contracting: vec![1],
        rhs_contracting: vec![1],
        ..DotDims::default()
    };
    let route = crate::f32_products_keep_packings();
    // The chains: element (i, j) is fma over l in order from +0.
    let chains = |a: &Tensor, b: &dyn Fn(usize, usize) -> f32, cols: usize| {
        let depth = a.shape()[1];
        Tensor::from_fn(&[a.shape()[0], cols], |flat| {
            let (i, j) = (flat / cols, flat % cols);
            (0..depth).fold(0.0f32, |acc, l| {
                a.data()[i * depth + l].mul_add(b(l, j), acc)
            })
        })
    };
    let forward_chains = chains(&x, &|l, j| w.data()[l * n + j], n);
    let backward_chains = chains(&dy, &|l, j| w.data()[j * n + l], k);
    for threads in [1, 2, 1] {
        let forward = dot_general(&x, &kept, &DotDims::matmul(2), threads).unwrap();
        let back = dot_general(&dy, &kept, &backward, threads).unwrap();
        if route {
            assert_eq!(forward, forward_chains, "x·W on {threads} threads");
            assert_eq!(back, backward_chains, "dy·Wᵀ on {threads} threads");
            let stored = dot_general(&x, &w, &DotDims::matmul(2), threads).unwrap();
            assert_eq!(stored, forward_chains, "x·W, the weight as stored");
            let stored = dot_general(&dy, &w, &backward, threads).unwrap();
            assert_eq!(stored, backward_chains, "dy·Wᵀ, the weight as stored");
        } else {
            close(&forward, &reference(&x, &w, &DotDims::matmul(2)));
            close(&back, &reference(&dy, &w, &backward));
        }
        assert_eq!(kept.kept_packings(), if route { 2 } else { 0 });
    }
    // A clone shares the packings; a reshape of it reads the same storage and keeps them.
    assert_eq!(
        kept.clone().reshape(&[k * n]).unwrap().kept_packings(),
        kept.kept_packings()
    );
    // A stack of two weights ([2, k, n] batched with [2, m, k]) is not taken.
    let pair = Tensor::from_fn(&[2, k, n], |i| {
        w.data()[i % (k * n)] * if i < k * n { 1.0 } else { -0.5 }
    });
    let stacked = pair.keeping_packings();
    let batched = DotDims {
        lhs_contracting: vec![2],
        rhs_contracting: vec![1],
        lhs_batch: vec![0],
        rhs_batch: vec![0],
    };
    let xb = Tensor::from_fn(&[2, m, k], |i| x.data()[i % (m * k)]);
    close(
        &dot_general(&xb, &stacked, &batched, 1).unwrap(),
        &reference(&xb, &pair, &batched),
    );
    // Written in place: the packings go, and the product is the new weight's.
    let mut written = kept.clone();
    written.data_mut()[0] += 1.0;
    assert_eq!(written.kept_packings(), 0);
    let fresh = dot_general(&x, &written, &DotDims::matmul(2), 1).unwrap();
    close(&fresh, &reference(&x, &written, &DotDims::matmul(2)));
    assert_ne!(
        fresh, forward_chains,
        "the written weight's product differs"
    );
    // Mirror: the weight as stored keeps nothing.
    dot_general(&x, &w, &DotDims::matmul(2), 1).unwrap();
    assert_eq!(w.kept_packings(), 0);
    assert_eq!(stacked.kept_packings(), 0);
}
