//! [`Sequences`]: a [`TokenStream`] cut into sequences, in order or shuffled by a seed.
//!
//! Invariant: sequence `index` is a pure function of (stream, length, order, seed, index), so a
//! run that resumes at sequence `k` reads exactly what the uninterrupted run reads from `k` on.
//! The stream is cut into `W = tokens / len` non-overlapping windows (the tail shorter than a
//! window is not read); sequence `index` belongs to epoch `index / W` and takes window
//! `index mod W` (in order) or `π_e(index mod W)` (shuffled), where `π_e` is a permutation of
//! `0..W` drawn from the seed and the epoch: every window once an epoch, in a new order each
//! epoch, computed in O(1) memory (a Feistel network on the next power of four, cycle-walked
//! into range).

use crate::read::TokenStream;

/// How windows are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Window after window in stream order.
    Sequential,
    /// A seeded permutation of the windows, a new one each epoch.
    Shuffled {
        /// The seed.
        seed: u64,
    },
}

/// A stream cut into sequences of one length.
#[derive(Clone, Debug)]
pub struct Sequences {
    stream: TokenStream,
    len: usize,
    windows: u64,
    order: Order,
}

impl Sequences {
    /// `stream` cut into sequences of `len` tokens; `None` when it holds less than one.
    pub fn new(stream: TokenStream, len: usize, order: Order) -> Option<Sequences> {
        let windows = stream.len() / len.max(1) as u64;
        (windows > 0).then_some(Sequences {
            stream,
            len: len.max(1),
            windows,
            order,
        })
    }

    /// Whole windows an epoch.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// The sequence length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a [`Sequences`] holds at least one window).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The stream read.
    pub fn stream(&self) -> &TokenStream {
        &self.stream
    }

    /// The epoch sequence `index` belongs to.
    pub fn epoch(&self, index: u64) -> u64 {
        index / self.windows
    }

    /// The window sequence `index` reads.
    pub fn window(&self, index: u64) -> u64 {
        let (epoch, at) = (index / self.windows, index % self.windows);
        match self.order {
            Order::Sequential => at,
            Order::Shuffled { seed } => permute(at, self.windows, mix(seed, epoch)),
        }
    }

    /// Sequence `index`: `len` tokens.
    pub fn sequence(&self, index: u64) -> Vec<u32> {
        self.stream
            .read(self.window(index) * self.len as u64, self.len)
    }
}

/// SplitMix64's finaliser: a well-mixed 64-bit hash of `a` and `b`.
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a
        .wrapping_add(b.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `x`'s image under a keyed permutation of `0..n` (`x < n`): a four-round balanced Feistel
/// network on `2·h` bits (`4^h ≥ n`), applied again until the value falls below `n` (cycle
/// walking keeps it a permutation of `0..n`; fewer than four tries on average).
pub fn permute(x: u64, n: u64, key: u64) -> u64 {
    if n <= 1 {
        return 0;
    }
    let bits = 64 - (n - 1).leading_zeros();
    let half = bits.div_ceil(2).max(1);
    let mask = (1u64 << half) - 1;
    let mut v = x;
    loop {
        let (mut l, mut r) = (v >> half, v & mask);
        for round in 0..4u64 {
            let f = mix(key ^ round.wrapping_mul(0xA24B_AED4_963E_E407), r) & mask;
            (l, r) = (r, l ^ f);
        }
        v = (l << half) | r;
        if v < n {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_is_a_bijection_for_every_small_n() {
        for n in 1..300u64 {
            let mut seen = vec![false; n as usize];
            for x in 0..n {
                let y = permute(x, n, 42);
                assert!(y < n, "n {n}: {x} -> {y}");
                assert!(!seen[y as usize], "n {n}: {y} twice");
                seen[y as usize] = true;
            }
        }
    }

    #[test]
    fn permute_depends_on_the_key_and_is_not_the_identity() {
        let n = 1000;
        let a: Vec<u64> = (0..n).map(|x| permute(x, n, 1)).collect();
        let b: Vec<u64> = (0..n).map(|x| permute(x, n, 2)).collect();
        assert_ne!(a, b);
        let fixed = a
            .iter()
            .enumerate()
            .filter(|(i, &y)| *i as u64 == y)
            .count();
        // A random permutation has about one fixed point; the identity has 1000.
        assert!(fixed < 20, "{fixed} fixed points");
        assert_eq!(a, (0..n).map(|x| permute(x, n, 1)).collect::<Vec<_>>());
    }
}
