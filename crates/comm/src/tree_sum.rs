//! The order in which every reduction of ferrotext adds its members' contributions: a fixed
//! pairwise tree over the members in rank order, in `f32`.
//!
//! The tree over `n` members: one member is its own value; otherwise the first `p` members
//! (`p` the largest power of two below `n`) are summed as a tree, the rest as a tree, and the
//! two added. For 2 and 3 members that is rank order (`(x0 + x1) + x2`); for 4 it is
//! `(x0 + x1) + (x2 + x3)`; for 6, `((x0 + x1) + (x2 + x3)) + (x4 + x5)`.
//!
//! Why a tree and not rank order: the sum of a group of `2^g` consecutive members is a subtree,
//! so a value summed over consecutive blocks first (a device's micro-batches, a process's
//! devices) and over the blocks after gives the bits of one tree over everything. That is what
//! lets a training step's gradient have the same bits on data=4 × GA 1, data=2 × GA 2 and
//! data=1 × GA 4, in one process or over MPI (`layout_invariant=true`). Its error also grows
//! with `log n` instead of `n`. The in-process backend and the MPI pipeline both sum this way,
//! so they stay bitwise equal to each other.

use crate::element::Element;

/// The largest power of two strictly below `n` (for `n ≥ 2`): where the tree over `n` splits.
pub fn tree_split(n: usize) -> usize {
    debug_assert!(n >= 2);
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// `acc` = the tree sum (module docs) of `part(0..n)`, each `acc.len()` long, in `f32`.
/// `scratch` holds the right subtrees' partial sums (grown as needed, reused across calls).
pub(crate) fn tree_sum_into<'a, T: Element + 'a>(
    acc: &mut [f32],
    n: usize,
    part: &dyn Fn(usize) -> &'a [T],
    scratch: &mut Vec<f32>,
) {
    if n == 0 {
        acc.fill(0.0);
        return;
    }
    // The recursion keeps one right subtree per level: at most log2(n) + 1 blocks.
    let levels = (usize::BITS - n.leading_zeros()) as usize;
    if scratch.len() < acc.len() * levels {
        scratch.resize(acc.len() * levels, 0.0);
    }
    subtree(acc, 0, n, part, scratch);
}

fn subtree<'a, T: Element + 'a>(
    acc: &mut [f32],
    lo: usize,
    hi: usize,
    part: &dyn Fn(usize) -> &'a [T],
    scratch: &mut [f32],
) {
    if hi - lo == 1 {
        for (a, &x) in acc.iter_mut().zip(part(lo)) {
            *a = x.to_f32();
        }
        return;
    }
    let mid = lo + tree_split(hi - lo);
    subtree(acc, lo, mid, part, scratch);
    let (right, rest) = scratch.split_at_mut(acc.len());
    subtree(right, mid, hi, part, rest);
    for (a, &r) in acc.iter_mut().zip(right.iter()) {
        *a += r;
    }
}

/// The tree sum of `values` (module docs) in `f32`: the reference the collectives' tests and
/// the engine's own accumulation follow.
pub fn tree_sum_f32(values: &[f32]) -> f32 {
    match values.len() {
        0 => 0.0,
        1 => values[0],
        n => {
            let mid = tree_split(n);
            tree_sum_f32(&values[..mid]) + tree_sum_f32(&values[mid..])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_splits_at_the_largest_power_of_two_below() {
        assert_eq!(
            (2..=9).map(tree_split).collect::<Vec<_>>(),
            [1, 2, 2, 4, 4, 4, 4, 8]
        );
    }

    /// Sums whose f32 result depends on the order: the tree's, written out by hand; two and
    /// three members are rank order; blocks of a power of two are subtrees.
    #[test]
    fn sums_follow_the_tree_written_out() {
        let x = [1e8f32, 1.0, -1e8, 1.0, 3.0, -7.0, 0.5];
        let by_hand = [
            x[0],
            x[0] + x[1],
            (x[0] + x[1]) + x[2],
            (x[0] + x[1]) + (x[2] + x[3]),
            ((x[0] + x[1]) + (x[2] + x[3])) + x[4],
            ((x[0] + x[1]) + (x[2] + x[3])) + (x[4] + x[5]),
            ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + x[6]),
        ];
        let mut scratch = Vec::new();
        for n in 1..=7 {
            let mut acc = [0.0f32; 1];
            let parts: Vec<[f32; 1]> = x[..n].iter().map(|&v| [v]).collect();
            tree_sum_into(&mut acc, n, &|k| &parts[k][..], &mut scratch);
            assert_eq!(acc[0].to_bits(), by_hand[n - 1].to_bits(), "n = {n}");
            assert_eq!(tree_sum_f32(&x[..n]).to_bits(), by_hand[n - 1].to_bits());
        }
        // (x0 + x1) + (x2 + x3) is not rank order here: the mirror.
        assert_ne!(by_hand[3], ((x[0] + x[1]) + x[2]) + x[3]);
        // Blocks of two summed first, then the block sums: the tree's bits.
        let pairs = [x[0] + x[1], x[2] + x[3], x[4] + x[5]];
        assert_eq!(
            tree_sum_f32(&pairs).to_bits(),
            tree_sum_f32(&x[..6]).to_bits()
        );
    }
}
