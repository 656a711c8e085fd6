//! [`KeyRanges`]: which keys each query row sees, as one contiguous range per row.
//!
//! Every mask the decoders use is such a range: causal attention sees keys `0..=i`; a sliding
//! window of `w` sees `i+1−w..=i`; packed documents see from their document's first token; a
//! query block of a longer sequence (context parallelism) sees up to its global position.
//! Invariant (checked at construction): every row sees at least one key, and every range lies
//! inside the keys.

use crate::error::TensorError;

/// The keys each query row sees: row `i` of batch row `b` sees keys `lo ..= hi` (see the module
/// docs). Built once per forward pass and shared by every layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRanges {
    batch: usize,
    queries: usize,
    keys: usize,
    /// `[B, Tq]`: the first key each row sees.
    lo: Vec<u32>,
    /// `[B, Tq]`: the last key each row sees.
    hi: Vec<u32>,
}

impl KeyRanges {
    /// Causal attention over `t` positions in each of `batch` rows, each query seeing at most
    /// the `window` keys up to its own position (`None`: all of them).
    pub fn causal(batch: usize, t: usize, window: Option<usize>) -> KeyRanges {
        let row: Vec<(u32, u32)> = (0..t)
            .map(|i| (first_seen(i, 0, window), i as u32))
            .collect();
        let lo = (0..batch).flat_map(|_| row.iter().map(|r| r.0)).collect();
        let hi = (0..batch).flat_map(|_| row.iter().map(|r| r.1)).collect();
        KeyRanges {
            batch,
            queries: t,
            keys: t,
            lo,
            hi,
        }
    }

    /// Causal attention within documents: `starts` (`[batch, t]`) gives, for each position, the
    /// position its document starts at (itself for a document's first token); a query sees the
    /// keys of its own document up to itself, at most `window` of them.
    ///
    /// # Errors
    /// `starts` of another length, or a start after its position.
    pub fn documents(
        batch: usize,
        t: usize,
        starts: &[u32],
        window: Option<usize>,
    ) -> Result<KeyRanges, TensorError> {
        if starts.len() != batch * t {
            return Err(TensorError::shape(
                "KeyRanges::documents",
                format!("{} document starts for {batch} rows of {t}", starts.len()),
            ));
        }
        let places: Vec<(u32, u32)> = starts
            .iter()
            .enumerate()
            .map(|(n, &s)| ((n % t.max(1)) as u32, s))
            .collect();
        KeyRanges::places(batch, t, &places, window)
    }

    /// Each query's own index `hi` and the first key it may see `lo` (`places`, `[batch ×
    /// queries]` pairs `(hi, lo)`: its document's start), over `keys` keys, at most `window`
    /// keys each: the general form (a load-balanced context split's reordered rows, packed
    /// documents).
    ///
    /// # Errors
    /// `places` not a whole number of rows, an index past the keys, or a start after its index.
    pub fn places(
        batch: usize,
        keys: usize,
        places: &[(u32, u32)],
        window: Option<usize>,
    ) -> Result<KeyRanges, TensorError> {
        let queries = places.len() / batch.max(1);
        let bad = places
            .iter()
            .find(|&&(hi, lo)| hi as usize >= keys || lo > hi);
        if queries * batch != places.len() || bad.is_some() {
            return Err(TensorError::shape(
                "KeyRanges::places",
                format!(
                    "{} query places for {batch} rows over {keys} keys (first bad: {bad:?})",
                    places.len()
                ),
            ));
        }
        let lo = places
            .iter()
            .map(|&(hi, lo)| first_seen(hi as usize, lo as usize, window))
            .collect();
        let hi = places.iter().map(|&(hi, _)| hi).collect();
        Ok(KeyRanges {
            batch,
            queries,
            keys,
            lo,
            hi,
        })
    }

    /// The ranges of query rows `rows` (a slice of the queries), over all the keys: the ranges
    /// a device holding that slice of the sequence uses against the gathered keys.
    ///
    /// # Errors
    /// A range outside the queries.
    pub fn query_rows(&self, rows: std::ops::Range<usize>) -> Result<KeyRanges, TensorError> {
        if rows.end > self.queries || rows.start > rows.end {
            return Err(TensorError::shape(
                "KeyRanges::query_rows",
                format!("rows {rows:?} of {} queries", self.queries),
            ));
        }
        let pick = |v: &[u32]| -> Vec<u32> {
            (0..self.batch)
                .flat_map(|b| v[b * self.queries + rows.start..b * self.queries + rows.end].iter())
                .copied()
                .collect()
        };
        Ok(KeyRanges {
            batch: self.batch,
            queries: rows.len(),
            keys: self.keys,
            lo: pick(&self.lo),
            hi: pick(&self.hi),
        })
    }

    /// Batch rows.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Query rows per batch row.
    pub fn queries(&self) -> usize {
        self.queries
    }

    /// Keys per batch row.
    pub fn keys(&self) -> usize {
        self.keys
    }

    /// The keys row `i` of batch row `b` sees: `lo..hi` (end exclusive).
    #[inline]
    pub(crate) fn range(&self, b: usize, i: usize) -> (usize, usize) {
        let n = b * self.queries + i;
        (self.lo[n] as usize, self.hi[n] as usize + 1)
    }

    /// The keys some row of `rows` (of batch row `b`) sees: from the smallest first key to the
    /// largest last one, end exclusive (`(0, 0)` for no rows).
    pub(crate) fn span(&self, b: usize, rows: std::ops::Range<usize>) -> (usize, usize) {
        rows.map(|i| self.range(b, i))
            .reduce(|(l, h), (a, c)| (l.min(a), h.max(c)))
            .unwrap_or((0, 0))
    }

    /// Checks the ranges against the shapes of one call.
    pub(crate) fn check(
        &self,
        b: usize,
        tq: usize,
        tk: usize,
        op: &'static str,
    ) -> Result<(), TensorError> {
        if (self.batch, self.queries, self.keys) != (b, tq, tk) {
            return Err(TensorError::shape(
                op,
                format!(
                    "key ranges for {} rows of {} queries over {} keys, got q/k of {b} rows, {tq} \
                     queries, {tk} keys",
                    self.batch, self.queries, self.keys
                ),
            ));
        }
        Ok(())
    }
}

/// The first key position `i` sees in a document starting at `start` under `window`.
fn first_seen(i: usize, start: usize, window: Option<usize>) -> u32 {
    let by_window = window.map_or(0, |w| (i + 1).saturating_sub(w.max(1)));
    start.max(by_window) as u32
}
