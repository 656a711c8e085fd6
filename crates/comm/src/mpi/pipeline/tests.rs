use super::*;
use crate::mpi::eager::{part_message_bytes, DEFAULT_EAGER_LIMIT_BYTES};

#[test]
fn large_blocks_take_eager_sized_parts_and_small_ones_stay_pipelined() {
    // Under the default limit (256 KiB messages): an 8 MiB block of f32 takes parts at the
    // limit; a 400 KB block (a parameter's all-reduce between 2 hosts) stays in 64 KiB parts,
    // 7 of them; a 1.6 MB block is cut in 8.
    let raised = DEFAULT_EAGER_LIMIT_BYTES - PML_HEADER_ALLOWANCE;
    assert_eq!(
        part_elements_within(raised, 4, 2 << 20),
        (raised - HEADER_BYTES) / 4
    );
    let p = part_elements_within(raised, 4, 100_000);
    assert!(HEADER_BYTES + p * 4 <= MIN_PART_MESSAGE_BYTES);
    assert_eq!(100_000usize.div_ceil(p), 7);
    assert_eq!(
        400_000usize.div_ceil(part_elements_within(raised, 4, 400_000)),
        8
    );
    // Under the limit in force every part is one eager message; never an empty part.
    assert!(HEADER_BYTES + part_elements(4, 2 << 20) * 4 <= part_message_bytes());
    assert!(part_elements(4, 3) >= 1);
    assert!(part_elements(2, 0) >= 1);
}

#[test]
fn parts_cover_every_block_once_in_order() {
    for elem in [2, 4] {
        for len in [0, 1, 15, 4096, 100_000, 3_000_000] {
            for n in 1..6 {
                let blocks: Vec<Range<usize>> =
                    (0..n).map(|k| crate::local::chunk(len, n, k)).collect();
                let largest = blocks.iter().map(|b| b.len()).max().unwrap_or(0);
                let p = part_elements(elem, largest);
                assert!(HEADER_BYTES + p * elem <= part_message_bytes());

                for b in &blocks {
                    let mut at = b.start;
                    for s in 0..parts(b.len(), p) {
                        let range = part(b, p, s);
                        assert_eq!(range.start, at, "len {len} n {n} part {s}");
                        assert!(!range.is_empty() || b.is_empty());
                        at = range.end;
                    }
                    assert_eq!(at, b.end);
                }
            }
        }
    }
}

#[test]
fn sums_follow_the_tree_order_with_own_part_inserted() {
    // 1e8 + 1 - 1e8 + 1 depends on the order in f32: the tree (a + b) + (c + d) gives 0,
    // rank order 1.
    let a = [1e8f32; 5000];
    let b = [1f32; 5000];
    let c = [-1e8f32; 5000];
    let d = [1f32; 5000];
    let reference: Vec<f32> = (0..5000).map(|i| (a[i] + b[i]) + (c[i] + d[i])).collect();
    assert_ne!(reference[0], ((a[0] + b[0]) + c[0]) + d[0]);
    for r in 0..4 {
        let parts = [&a[..], &b[..], &c[..], &d[..]];
        let others: Vec<&[f32]> = (0..4).filter(|&k| k != r).map(|k| parts[k]).collect();
        let mut out = parts[r].to_vec();
        sum_in_tree_order(&mut out, None, r, &others);
        assert_eq!(out, reference, "in place, r = {r}");
        let mut out = vec![7f32; 5000];
        sum_in_tree_order(&mut out, Some(parts[r]), r, &others);
        assert_eq!(out, reference, "from input, r = {r}");
    }
}
