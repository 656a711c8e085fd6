//! The AVX512_BF16 kernel's packing: the layout-specific packings against the element-wise one
//! and a hand-packed example, and the reused packing buffers against fresh ones.

use half::bf16;

use super::*;

/// Distinct bf16 values (so a word read from the wrong place shows).
fn values(len: usize) -> Vec<bf16> {
    (0..len)
        .map(|i| bf16::from_f32(((i * 37 + 11) % 997) as f32 - 498.0))
        .collect()
}

fn op(data: &[bf16], rs: usize, cs: usize) -> Operand<bf16> {
    Operand {
        ptr: data.as_ptr(),
        rs: rs as isize,
        cs: cs as isize,
    }
}

/// The product `dst = a · b` (or `+=`) of `(m, n, k)` into `dst`'s row-major m×n.
fn prod<D>(
    (m, n, k): (usize, usize, usize),
    a: Operand<bf16>,
    b: Operand<bf16>,
    dst: *mut D,
    store: Store,
) -> Product<bf16, D> {
    Product {
        m,
        n,
        k,
        a,
        b,
        dst,
        ldc: n,
        store,
    }
}

/// Whether this CPU runs the kernel (AVX512_BF16); when not, the test `name` reports itself
/// skipped (the kernel's instructions have no other route to check them on).
fn runs_here(name: &str) -> bool {
    let here = available();
    if !here {
        crate::report_skipped(
            &format!("tensor bf16::dpbf16::tests::{name}"),
            "this processor has no AVX512_BF16",
        );
    }
    here
}

/// A buffer of `len` words of garbage, so a word a packing leaves unwritten shows.
fn garbage(len: usize) -> Vec<u32> {
    vec![0xDEAD_BEEF; len]
}

#[test]
fn packing_a_hand_made_block_gives_its_pairs() {
    if !runs_here("packing_a_hand_made_block_gives_its_pairs") {
        return;
    }
    // b is 3×2 row-major [[1, 2], [3, 4], [5, 6]]; packed: pair 0 of column c is
    // (b[0, c], b[1, c]), pair 1 is (b[2, c], 0); columns 2..32 zero.
    let b: Vec<bf16> = (1..=6).map(|x| bf16::from_f32(x as f32)).collect();
    let w = |lo: f32, hi: f32| {
        u32::from(bf16::from_f32(lo).to_bits()) | (u32::from(bf16::from_f32(hi).to_bits()) << 16)
    };
    let mut expected = vec![0u32; 2 * NR];
    expected[0] = w(1.0, 3.0);
    expected[1] = w(2.0, 4.0);
    expected[NR] = w(5.0, 0.0);
    expected[NR + 1] = w(6.0, 0.0);
    // The same matrix stored column-major: [[1, 3, 5], [2, 4, 6]].
    let bt: Vec<bf16> = [1, 3, 5, 2, 4, 6]
        .iter()
        .map(|&x| bf16::from_f32(x as f32))
        .collect();
    for (data, rs, cs) in [(&b, 2, 1), (&bt, 1, 3)] {
        let mut out = garbage(2 * NR);
        // SAFETY: the CPU has the features; the block is the whole 3×2 matrix.
        unsafe { pack_b(op(data, rs, cs), 0, 3, 0, 2, slots(&mut out)) };
        assert_eq!(out, expected, "b with strides ({rs}, {cs})");
    }
    // a is 2×3 row-major [[1, 2, 3], [4, 5, 6]]: pair q of row r at q·MR + r.
    let mut out = garbage(2 * MR);
    // SAFETY: as above.
    unsafe { pack_a(op(&b, 3, 1), 0, 2, 0, 3, &mut out) };
    assert_eq!(
        [out[0], out[1], out[MR], out[MR + 1]],
        [w(1.0, 2.0), w(4.0, 5.0), w(3.0, 0.0), w(6.0, 0.0)]
    );
}

/// Every layout's packing writes the words the element-wise packing writes, over a block that
/// starts inside the operand, with an odd contraction and a partial last panel or tile; and
/// the mirror: reading the operand with its strides swapped packs other words.
#[test]
fn packing_is_the_element_wise_packing() {
    if !runs_here("packing_is_the_element_wise_packing") {
        return;
    }
    for (rows, cols, l0, kc, j0, nc) in [
        (9usize, 70usize, 2usize, 7usize, 3usize, 61usize),
        (40, 100, 0, 40, 0, 100),
        (1, 33, 0, 1, 1, 32),
        (600, 530, 512, 88, 0, 530),
        // Whole blocks of 8 pairs and of 8 columns, odd offsets, an odd pair at the end.
        (24, 64, 1, 17, 5, 48),
        (32, 40, 0, 32, 0, 40),
    ] {
        // `b`: `rows` × `cols` (contraction × columns), row-major, column-major and padded.
        let data = values((rows + 3) * (cols + 5));
        let kp = kc.div_ceil(2);
        let len = kp * nc.div_ceil(NR) * NR;
        for (rs, cs) in [(cols, 1), (1, rows), (cols + 5, 1), (1, rows + 3)] {
            let (mut fast, mut slow) = (garbage(len), garbage(len));
            // SAFETY: the block lies inside `data` with these strides; the CPU has the features.
            unsafe {
                pack_b(op(&data, rs, cs), l0, kc, j0, nc, slots(&mut fast));
                pack_b_strided(op(&data, rs, cs), l0, kc, j0, nc, slots(&mut slow));
            }
            assert_eq!(fast, slow, "b {rows}×{cols} strides ({rs}, {cs})");
        }
        // `a`: the same `rows` × `cols` matrix read as rows × contraction, in tiles of `MR`
        // rows (the last partial), over columns j0..j0+nc of the contraction.
        let kp = nc.div_ceil(2);
        for (rs, cs) in [(cols + 5, 1), (1, rows + 3)] {
            let (mut fast, mut slow) = (garbage(kp * MR), garbage(kp * MR));
            for t in 0..rows.div_ceil(MR) {
                let (i0, r) = (t * MR, MR.min(rows - t * MR));
                // SAFETY: rows i0..i0+r, columns j0..j0+nc are inside `data` as `a`.
                unsafe {
                    pack_a(op(&data, rs, cs), i0, r, j0, nc, &mut fast);
                    pack_a_strided(op(&data, rs, cs), i0, r, j0, nc, &mut slow);
                }
                assert_eq!(
                    fast, slow,
                    "a tile {t} of {rows}×{cols} strides ({rs}, {cs})"
                );
            }
        }
    }
    // The mirror: the same data with the strides swapped is another matrix, other words.
    let data = values(16 * 16);
    let (mut one, mut other) = (garbage(8 * NR), garbage(8 * NR));
    // SAFETY: both are 16×16 views of `data`.
    unsafe {
        pack_b(op(&data, 16, 1), 0, 16, 0, 16, slots(&mut one));
        pack_b(op(&data, 1, 16), 0, 16, 0, 16, slots(&mut other));
    }
    assert_ne!(one, other);
}

/// `dst = a·b` through [`gemm`] or [`gemm_rounded`] (`rounded`: widened back), row-major.
fn product(m: usize, n: usize, k: usize, a: &[bf16], b: &[bf16], rounded: bool) -> Vec<f32> {
    let mut dst = vec![f32::NAN; m * n];
    // SAFETY: `a` is m×k and `b` k×n row-major, `dst` m×n; the CPU has the features.
    unsafe {
        if rounded {
            let packed = pack_b_whole(op(b, n, 1), k, n, 1);
            let mut out = vec![bf16::NAN; m * n];
            gemm_rounded(m, op(a, k, 1), &packed, out.as_mut_ptr(), n);
            dst = out.iter().map(|x| x.to_f32()).collect();
        } else {
            let whole = (m, n, k);
            gemm(prod(
                whole,
                op(a, k, 1),
                op(b, n, 1),
                dst.as_mut_ptr(),
                Store::Overwrite,
            ));
        }
    }
    dst
}

/// `(k, n)` of the whole packings the tests make, in each of the two layouts a rounded
/// product's `b` comes in: widths that split into runs of whole panels and not (a last panel
/// part empty), odd contractions, each larger than the one before.
const WHOLE_PACKINGS: [(usize, usize); 4] = [(7, 70), (64, 32), (33, 97), (130, 257)];

/// A product after a larger one on the same thread (its packing buffers hold the larger one's
/// words) gives the bits it gives on a fresh thread; and the mirror: the two products differ,
/// so stale words would show.
#[test]
fn packing_on_several_threads_gives_one_threads_words() {
    if !runs_here("packing_on_several_threads_gives_one_threads_words") {
        return;
    }
    for (k, n) in WHOLE_PACKINGS {
        let data = values(k * n);
        for (rs, cs) in [(n, 1), (1, k)] {
            let one = {
                // SAFETY: `data` holds k×n elements at these strides.
                let packed = unsafe { pack_b_whole(op(&data, rs, cs), k, n, 1) };
                packed.data.clone()
            };
            for threads in [2, 3, 8] {
                // SAFETY: as above.
                let packed = unsafe { pack_b_whole(op(&data, rs, cs), k, n, threads) };
                assert_eq!(
                    packed.data, one,
                    "{k}×{n}, strides ({rs}, {cs}), {threads} threads"
                );
            }
        }
    }
}

/// A packing into a new buffer (a kept packing's: grown without being zeroed first, and holding
/// no more words than the packing) and into a thread's buffer (grown by each larger shape, after
/// a packing of 1×1) hold exactly the words `pack_b` writes over a buffer of garbage, which
/// shows any word it does not write.
#[test]
fn a_packing_into_a_grown_buffer_holds_the_packed_words() {
    if !runs_here("a_packing_into_a_grown_buffer_holds_the_packed_words") {
        return;
    }
    for (k, n) in WHOLE_PACKINGS {
        let data = values(k * n);
        for (rs, cs) in [(n, 1), (1, k)] {
            let len = k.div_ceil(2) * n.div_ceil(NR) * NR;
            let mut expected = garbage(len);
            // SAFETY: `data` holds k×n elements at these strides; the CPU has the features.
            unsafe { pack_b(op(&data, rs, cs), 0, k, 0, n, slots(&mut expected)) };
            for threads in [1, 2] {
                // SAFETY: as above.
                let kept = unsafe { pack_b_kept(op(&data, rs, cs), k, n, threads) };
                assert_eq!(kept.data, expected, "kept {k}×{n} ({rs}, {cs}), {threads}");
                // A thread's buffer after a packing of 1×1 (shorter: grown for this one).
                // SAFETY: as above; the 1×1 block is inside `data`.
                drop(unsafe { pack_b_whole(op(&data, rs, cs), 1, 1, threads) });
                // SAFETY: as above.
                let whole = unsafe { pack_b_whole(op(&data, rs, cs), k, n, threads) };
                assert_eq!(whole.data[..len], expected, "whole {k}×{n} ({rs}, {cs})");
            }
        }
    }
}

#[test]
fn a_shared_whole_packing_gives_the_blockwise_products_bits() {
    if !runs_here("a_shared_whole_packing_gives_the_blockwise_products_bits") {
        return;
    }
    // Several blocks of the contraction (`KC`, the last one odd) and of the columns (`NC`,
    // the last panel part empty), rows not a multiple of `MR`; row- and column-major `b`;
    // overwriting and accumulating; rows taken from inside the product, as a band is.
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (m, n, k) in [(19usize, 545usize, 1031usize), (8, 32, 2), (70, 97, 512)] {
        let (a, b) = (values(m * k), values(k * n));
        let aop = op(&a, k, 1);
        for (rs, cs) in [(n, 1), (1, k)] {
            let bop = op(&b, rs, cs);
            for store in [Store::Overwrite, Store::Accumulate] {
                let start: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 - 2.0).collect();
                let (mut blockwise, mut shared) = (start.clone(), start.clone());
                // SAFETY: `a` m×k row-major, `b` k×n at these strides, `dst` m×n; the CPU has
                // the features (`runs_here`).
                unsafe {
                    gemm(prod((m, n, k), aop, bop, blockwise.as_mut_ptr(), store));
                    let packed = pack_b_whole(bop, k, n, 2);
                    // Two bands of rows, as a product's row blocks share the packing.
                    let half = m / 2;
                    for (first, rows) in [(0, half), (half, m - half)] {
                        let band = prod(
                            (rows, n, k),
                            op(&a[first * k..], k, 1),
                            bop,
                            shared.as_mut_ptr().add(first * n),
                            store,
                        );
                        gemm_packed(band, &packed);
                    }
                }
                assert_eq!(
                    bits(&shared),
                    bits(&blockwise),
                    "{m}×{n}×{k}, strides ({rs}, {cs}), {store:?}"
                );
            }
        }
    }
}

#[test]
fn a_window_of_a_packing_gives_its_blocks_bits() {
    if !runs_here("a_window_of_a_packing_gives_its_blocks_bits") {
        return;
    }
    // An operand over several blocks of the contraction (`KC`) and panels (`NR`), row- and
    // column-major; windows from its first row and panel and from inside it, as wide as it or
    // narrower, a last panel part used, an odd last row at the operand's end; overwriting and
    // accumulating. Each against `gemm` of the same block read where it is stored.
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (rows, cols) = (1101usize, 150usize);
    let b = values(rows * cols);
    let windows = [
        (0, 0, rows, cols),
        (2, 32, 1098, 118),
        (64, 64, 256, 33),
        (10, 96, 1090, 1),
        (1096, 0, 5, 150),
        (0, 128, 64, 22),
    ];
    for (rs, cs) in [(cols, 1), (1, rows)] {
        let whole = op(&b, rs, cs);
        // SAFETY: `b` is rows×cols at these strides; the CPU has the features (`runs_here`).
        let packed = unsafe { pack_b_whole(whole, rows, cols, 2) };
        for (row0, col0, k, n) in windows {
            let m = 19;
            let a = values(m * k);
            let block = op(&b[row0 * rs + col0 * cs..], rs, cs);
            let window = packed.window(row0, col0, k, n).expect("an aligned window");
            for store in [Store::Overwrite, Store::Accumulate] {
                let start: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 - 2.0).collect();
                let (mut stored, mut windowed) = (start.clone(), start.clone());
                // SAFETY: `a` m×k row-major, the block k×n inside `b`, `dst` m×n; the window
                // is that block's; the CPU has the features.
                unsafe {
                    gemm(prod(
                        (m, n, k),
                        op(&a, k, 1),
                        block,
                        stored.as_mut_ptr(),
                        store,
                    ));
                    let p = prod((m, n, k), op(&a, k, 1), block, windowed.as_mut_ptr(), store);
                    gemm_window(p, window);
                }
                let label = format!("window {row0}+{k} × {col0}+{n}, strides ({rs}, {cs})");
                assert_eq!(bits(&windowed), bits(&stored), "{label}, {store:?}");
            }
        }
    }
    // Windows whose words are not the block's packing are refused: an odd first row or a
    // first column inside a panel (the packing's pairs and panels start elsewhere), an odd
    // last row inside the operand (its pair holds the next row, not pack_b's zero), and any
    // past the operand.
    // SAFETY: as above.
    let packed = unsafe { pack_b_whole(op(&b, cols, 1), rows, cols, 1) };
    for (row0, col0, k, n) in [
        (1, 0, 2, 32),
        (0, 16, 2, 32),
        (0, 0, 3, 32),
        (1098, 0, 4, 32),
        (0, 128, 2, 23),
    ] {
        let label = format!("window {row0}+{k} × {col0}+{n}");
        assert!(packed.window(row0, col0, k, n).is_none(), "{label}");
    }
    assert!(packed.window(1097, 0, 4, 32).is_none(), "an odd first row");
    assert!(
        packed.window(1096, 0, 5, 32).is_some(),
        "the mirror: the last rows, odd"
    );
}

#[test]
fn reused_packing_buffers_give_a_fresh_threads_bits() {
    if !runs_here("reused_packing_buffers_give_a_fresh_threads_bits") {
        return;
    }
    let (big, small) = ((70, 600, 530), (9, 33, 7));
    for rounded in [false, true] {
        let run = move |(m, n, k): (usize, usize, usize)| {
            product(m, n, k, &values(m * k), &values(k * n), rounded)
        };
        let fresh = std::thread::spawn(move || run(small)).join().ok();
        let warm = std::thread::spawn(move || {
            let large = run(big);
            (large, run(small))
        })
        .join()
        .ok();
        let (Some(fresh), Some((large, warm))) = (fresh, warm) else {
            panic!("a product thread panicked");
        };
        assert_eq!(warm, fresh, "rounded: {rounded}");
        assert_ne!(large[..fresh.len()], fresh[..], "rounded: {rounded}");
        assert!(fresh.iter().all(|x| x.is_finite()));
    }
}

/// One or two rows of `a` against a row-major `b` ([`few_rows`], no packing) give the packed
/// kernel's bits ([`gemm`], [`gemm_rounded`]), overwriting and accumulating, for `a` stored
/// either way and `b` with padded rows, on odd contractions and partial 32-column chunks; the
/// mirrors: accumulating moves the result, and a `b` strided both ways or three rows are not
/// taken.
#[test]
fn one_row_is_the_packed_products_bits() {
    if !runs_here("one_row_is_the_packed_products_bits") {
        return;
    }
    for (m, n, k) in [
        (1, 1, 1),
        (1, 33, 7),
        (2, 70, 64),
        (1, 31, 1030),
        (2, 600, 513),
    ] {
        let (a, b) = (values(m * k + 3 * k), values((k + 5) * (n + 5)));
        let start: Vec<f32> = (0..m * n).map(|i| (i % 13) as f32 * 0.25 - 1.5).collect();
        let layouts = [
            ((k, 1), (n + 5, 1)),
            ((1, m + 3), (1, k + 5)),
            ((k, 1), (1, k)),
        ];
        for ((ars, acs), (brs, bcs)) in layouts {
            let (aop, bop) = (op(&a, ars, acs), op(&b, brs, bcs));
            for store in [Store::Overwrite, Store::Accumulate] {
                let (mut packed, mut direct) = (start.clone(), start.clone());
                // SAFETY: `a` is m×k and `b` k×n with these strides; outputs m×n.
                let taken = unsafe {
                    gemm(prod((m, n, k), aop, bop, packed.as_mut_ptr(), store));
                    few_rows(
                        prod((m, n, k), aop, bop, direct.as_mut_ptr().cast(), store),
                        false,
                    )
                };
                assert!(taken);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&direct),
                    bits(&packed),
                    "{m}×{n}×{k} {store:?} a ({ars}, {acs}) b ({brs}, {bcs})"
                );
                if store == Store::Accumulate {
                    let mut fresh = start.clone();
                    // SAFETY: as above.
                    unsafe {
                        let dst = fresh.as_mut_ptr().cast();
                        few_rows(prod((m, n, k), aop, bop, dst, Store::Overwrite), false)
                    };
                    assert_ne!(bits(&fresh), bits(&direct), "accumulating moves the result");
                }
            }
            let mut rounded = vec![bf16::NAN; m * n];
            let mut direct = vec![bf16::NAN; m * n];
            // SAFETY: as above, bf16 outputs.
            unsafe {
                let packed = pack_b_whole(bop, k, n, 1);
                gemm_rounded(m, aop, &packed, rounded.as_mut_ptr(), n);
                let dst = direct.as_mut_ptr().cast();
                assert!(few_rows(
                    prod((m, n, k), aop, bop, dst, Store::Overwrite),
                    true
                ));
            }
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&direct), bits(&rounded), "rounded {m}×{n}×{k}");
        }
    }
    let (a, b) = (values(3 * 8), values(16 * 16));
    let mut out = vec![0.0f32; 3 * 8];
    // SAFETY: `a` 3×8, `b` 8×8 (every other element of every other row of `b`, or row-major);
    // nothing is written when the shape is not taken.
    unsafe {
        let dst = out.as_mut_ptr().cast::<u8>();
        let (a, strided_b, b) = (op(&a, 8, 1), op(&b, 32, 2), op(&b, 8, 1));
        let strided = few_rows(prod((1, 8, 8), a, strided_b, dst, Store::Overwrite), false);
        let three = few_rows(prod((3, 8, 8), a, b, dst, Store::Overwrite), false);
        assert!(!strided && !three);
    }
    assert!(out.iter().all(|&x| x == 0.0));
}

/// `a` packed whole (columns outer, the contraction's blocks inner) and packed one block of the
/// contraction at a time (again for each block of columns) give the same bits, and each is, bit
/// for bit, the widening of [`gemm_rounded`]'s product, whose tiles run the whole contraction
/// in one chain (a loop written apart); the mirror: accumulating onto a start moves the result.
#[test]
fn packing_a_whole_or_a_block_at_a_time_gives_one_chain() {
    if !runs_here("packing_a_whole_or_a_block_at_a_time_gives_one_chain") {
        return;
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Several blocks of the contraction (the last odd) and of the columns, rows not a multiple
    // of `MR`; a row- and a column-major `b`.
    for (m, n, k) in [(19usize, 1100usize, 1031usize), (9, 600, 513)] {
        let (a, b) = (values(m * k), values(k * n));
        for (rs, cs) in [(n, 1), (1, k)] {
            let bop = op(&b, rs, cs);
            let run = |whole_a: bool, store: Store, start: f32| {
                let mut dst = vec![start; m * n];
                let mut apack = garbage(a_words(m, k, whole_a));
                let mut bpack = garbage(KC.div_ceil(2) * NC);
                // SAFETY: `a` m×k row-major, `b` k×n at these strides, `dst` m×n; the buffers
                // hold `a`'s packing and a block of `b`; the CPU has the features.
                unsafe {
                    let p = prod((m, n, k), op(&a, k, 1), bop, dst.as_mut_ptr(), store);
                    gemm_blocks(p, Lhs::Packed(&mut apack, whole_a), Rhs::Blocks(&mut bpack));
                }
                dst
            };
            let whole = run(true, Store::Overwrite, f32::NAN);
            let blockwise = run(false, Store::Overwrite, f32::NAN);
            let label = format!("{m}×{n}×{k}, strides ({rs}, {cs})");
            assert_eq!(bits(&whole), bits(&blockwise), "{label}");
            let mut rounded = vec![bf16::NAN; m * n];
            // SAFETY: as above; `rounded` is m×n.
            unsafe {
                let packed = pack_b_whole(bop, k, n, 1);
                gemm_rounded(m, op(&a, k, 1), &packed, rounded.as_mut_ptr(), n);
            }
            let widened: Vec<bf16> = whole.iter().map(|&x| bf16::from_f32(x)).collect();
            assert_eq!(widened, rounded, "{label}");
            let moved = run(false, Store::Accumulate, 1.0e3);
            assert_ne!(
                bits(&moved),
                bits(&whole),
                "{label}: accumulating onto a start"
            );
            assert_eq!(
                bits(&moved),
                bits(&run(true, Store::Accumulate, 1.0e3)),
                "{label}: accumulating"
            );
        }
    }
}

/// A row-major `a` read where it is stored gives the packed route's bits: over several blocks
/// of the contraction and of the columns, rows not a multiple of `MR`, rows further apart than
/// the contraction (a head's rows inside `[T, H, d]`, as the tiled attention reads them),
/// overwriting and accumulating, against `b` packed a block at a time and whole. And the
/// public entry takes that route exactly where `reads_a_in_place` says.
#[test]
fn reading_a_in_place_gives_the_packed_bits() {
    if !runs_here("reading_a_in_place_gives_the_packed_bits") {
        return;
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (m, n, k, rs) in [
        (19usize, 600usize, 1030usize, 1030usize),
        (64, 64, 32, 256),
        (61, 128, 64, 200),
        (3, 40, 2, 7),
    ] {
        let (a, b) = (values(m * rs), values(k * n));
        let (aop, bop) = (op(&a, rs, 1), op(&b, n, 1));
        let run = |lhs_in_place: bool, whole_b: bool, store: Store| {
            let mut dst: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32).collect();
            let mut apack = garbage(a_words(m, k, false));
            let mut bpack = garbage(KC.div_ceil(2) * NC);
            let lhs = if lhs_in_place {
                Lhs::InPlace
            } else {
                Lhs::Packed(&mut apack, false)
            };
            // SAFETY: `a` m×k at row stride `rs`, `b` k×n row-major, `dst` m×n; the buffers
            // hold a block of `a`'s and `b`'s packings; `k` is even; the CPU has the features.
            unsafe {
                let p = prod((m, n, k), aop, bop, dst.as_mut_ptr(), store);
                if whole_b {
                    let packed = pack_b_whole(bop, k, n, 1);
                    gemm_blocks(p, lhs, Rhs::Whole(Window::whole(&packed)));
                } else {
                    gemm_blocks(p, lhs, Rhs::Blocks(&mut bpack));
                }
            }
            dst
        };
        for store in [Store::Overwrite, Store::Accumulate] {
            for whole_b in [false, true] {
                let label = format!("{m}×{n}×{k}, row stride {rs}, {store:?}, whole b {whole_b}");
                let packed = run(false, whole_b, store);
                assert!(packed.iter().any(|&x| x != 0.0), "{label}");
                assert_eq!(bits(&run(true, whole_b, store)), bits(&packed), "{label}");
            }
        }
    }
    let (a, b) = (values(64 * 32), values(32 * 64));
    let dst = std::ptr::null_mut::<f32>();
    let with = |a, n, k| prod((64, n, k), a, op(&b, n, 1), dst, Store::Overwrite);
    assert!(reads_a_in_place(&with(op(&a, 32, 1), 64, 32)));
    assert!(
        !reads_a_in_place(&with(op(&a, 32, 1), 64, 31)),
        "an odd contraction"
    );
    assert!(
        !reads_a_in_place(&with(op(&a, 1, 64), 64, 32)),
        "a column-major a"
    );
    assert!(
        !reads_a_in_place(&with(op(&a, 32, 1), NC + 1, 32)),
        "more than one column block"
    );
}

/// A rounded product's rows packed and run a chunk of tiles at a time (one tile, three, or all
/// of them at once) give the same bits, and they are `gemm`'s widened product rounded (a loop
/// written apart: blocks of the contraction continued through its `f32` destination); the
/// mirror: a product with one element of `a` changed moves its row.
#[test]
fn a_rounded_product_in_chunks_of_tiles_gives_gemms_bits() {
    if !runs_here("a_rounded_product_in_chunks_of_tiles_gives_gemms_bits") {
        return;
    }
    for (m, n, k) in [(43usize, 70usize, 1031usize), (17, 33, 6)] {
        let (a, b) = (values(m * k), values(k * n));
        let tiles = m.div_ceil(MR);
        let rounded = |a: &[bf16], chunk: usize| {
            let mut out = vec![bf16::NAN; m * n];
            let mut apack = garbage(chunk * k.div_ceil(2) * MR);
            // SAFETY: `a` m×k and `b` k×n row-major, `out` m×n; `apack` holds `chunk` tiles;
            // the CPU has the features.
            unsafe {
                let packed = pack_b_whole(op(&b, n, 1), k, n, 1);
                rounded_tiles(
                    m,
                    op(a, k, 1),
                    &packed,
                    (&mut apack, chunk),
                    RoundedOut::Store(out.as_mut_ptr(), n),
                );
            }
            out
        };
        let whole = rounded(&a, tiles);
        let want: Vec<bf16> = product(m, n, k, &a, &b, false)
            .iter()
            .map(|&x| bf16::from_f32(x))
            .collect();
        assert_eq!(whole, want, "{m}×{n}×{k}: against gemm");
        for chunk in [1, 3] {
            assert_eq!(
                rounded(&a, chunk),
                whole,
                "{m}×{n}×{k}, chunks of {chunk} tiles"
            );
        }
        let mut moved = a.clone();
        moved[(m - 1) * k] = bf16::from_f32(1000.0);
        let other = rounded(&moved, 3);
        assert_ne!(
            other[(m - 1) * n..],
            whole[(m - 1) * n..],
            "{m}×{n}×{k}: the mirror"
        );
    }
}
