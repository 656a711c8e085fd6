//! The collective trace: every collective a device issues, with its phase.
//!
//! This is ferrotext's equivalent of reading optimised HLO: tests read it to prove where
//! reductions happen ("no all-reduce larger than 8 elements in any micro-batch phase"), and the
//! trainer prints its per-phase summary. Events are recorded in issue order on the issuing device;
//! because every device runs the same program, the traces of all devices agree on kinds, axes,
//! sizes and phases.

use std::collections::BTreeMap;
use std::fmt;

use ferrotext_sharding::DType;

/// What a collective does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CollectiveKind {
    /// Sum over the group; every member gets the total.
    AllReduce,
    /// Sum over the group; member `r` gets chunk `r` of the total.
    ReduceScatter,
    /// Member `r`'s buffer becomes chunk `r` of everyone's output.
    AllGather,
    /// Chunk `j` of member `i`'s input becomes chunk `i` of member `j`'s output.
    AllToAll,
    /// The root's buffer is copied to every member.
    Broadcast,
    /// Every member waits for all others.
    Barrier,
}

impl CollectiveKind {
    /// Every kind, in the order MPI message headers number them ([`CollectiveKind::code`]).
    pub const ALL: [CollectiveKind; 6] = [
        CollectiveKind::AllReduce,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllGather,
        CollectiveKind::AllToAll,
        CollectiveKind::Broadcast,
        CollectiveKind::Barrier,
    ];

    /// The name printed in traces and tables (`all_reduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Barrier => "barrier",
        }
    }

    /// Its code in an MPI message header: its place in [`CollectiveKind::ALL`], from 1 (0
    /// names no collective).
    pub fn code(self) -> u8 {
        CollectiveKind::ALL
            .iter()
            .position(|&k| k == self)
            .map_or(0, |i| i as u8 + 1)
    }

    /// The kind whose [`CollectiveKind::code`] is `code`.
    pub fn from_code(code: u8) -> Option<CollectiveKind> {
        let index = usize::from(code.checked_sub(1)?);
        CollectiveKind::ALL.get(index).copied()
    }

    /// The bytes each of `members` devices sends in the bandwidth-optimal (ring) form of this
    /// collective on a buffer of `bytes` (the trace's full buffer, [`TraceEvent::bytes`]):
    /// all-reduce `2(n−1)/n·N` (a reduce-scatter then an all-gather), reduce-scatter, all-gather
    /// and all-to-all `(n−1)/n·N`, broadcast `N` (pipelined), barrier nothing. The cost model
    /// prices these over a link; the emulator's per-host prediction counts them.
    pub fn ring_bytes(self, members: f64, bytes: f64) -> f64 {
        let n = members;
        match self {
            CollectiveKind::AllReduce => 2.0 * (n - 1.0) / n * bytes,
            CollectiveKind::ReduceScatter
            | CollectiveKind::AllGather
            | CollectiveKind::AllToAll => (n - 1.0) / n * bytes,
            CollectiveKind::Broadcast => bytes,
            CollectiveKind::Barrier => 0.0,
        }
    }

    /// The messages one member waits for in turn in the same form (each pays a link's
    /// latency): all-reduce and barrier `2(n−1)`, reduce-scatter, all-gather and all-to-all
    /// `n−1`, broadcast 1.
    pub fn ring_steps(self, members: f64) -> f64 {
        let n = members;
        match self {
            CollectiveKind::AllReduce | CollectiveKind::Barrier => 2.0 * (n - 1.0),
            CollectiveKind::ReduceScatter
            | CollectiveKind::AllGather
            | CollectiveKind::AllToAll => n - 1.0,
            CollectiveKind::Broadcast => 1.0,
        }
    }

    /// Bytes of a collective of `elements` elements of `dtype` as the trace records them
    /// (`elements` counted as [`TraceEvent`] says, per kind).
    pub fn bytes(self, elements: usize, dtype: DType) -> usize {
        elements * dtype.size_bytes()
    }
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One recorded collective.
///
/// `elements` counts the *full* buffer of the operation on one device: the buffer summed by an
/// all-reduce, the input of a reduce-scatter, the output of an all-gather, the buffer of an
/// all-to-all or broadcast, 0 for a barrier. `bytes = elements × dtype width`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TraceEvent {
    /// Position in this device's sequence of collectives (0-based).
    pub seq: u64,
    /// What it does.
    pub kind: CollectiveKind,
    /// The mesh axes of the group, as the caller listed them.
    pub axes: Vec<String>,
    /// Devices in the group.
    pub group_size: usize,
    /// Elements of the full buffer (see the type docs).
    pub elements: usize,
    /// `elements` × dtype width.
    pub bytes: usize,
    /// Element type.
    pub dtype: DType,
    /// The phase label in force (`micro_batch 3`, `update`, nested labels joined by `/`; empty when
    /// none).
    pub phase: String,
}

/// A glob over phase labels where `*` matches any run of characters (`micro_batch*`,
/// `*update*`); without `*` it must match the whole label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhasePattern(String);

impl PhasePattern {
    /// A pattern from its glob text.
    pub fn new(glob: impl Into<String>) -> PhasePattern {
        PhasePattern(glob.into())
    }

    /// Matches every phase.
    pub fn any() -> PhasePattern {
        PhasePattern("*".into())
    }

    /// True when `phase` matches.
    pub fn matches(&self, phase: &str) -> bool {
        glob_match(self.0.as_bytes(), phase.as_bytes())
    }
}

impl From<&str> for PhasePattern {
    fn from(glob: &str) -> PhasePattern {
        PhasePattern::new(glob)
    }
}

fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    match pattern.split_first() {
        None => text.is_empty(),
        Some((b'*', rest)) => (0..=text.len()).any(|i| glob_match(rest, &text[i..])),
        Some((c, rest)) => text.first() == Some(c) && glob_match(rest, &text[1..]),
    }
}

/// Count and bytes of one kind of collective in one phase.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PhaseKindTotal {
    /// Number of collectives.
    pub count: usize,
    /// Sum of their `bytes`.
    pub bytes: usize,
}

/// A device's recorded collectives, in issue order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    events: Vec<TraceEvent>,
}

impl Trace {
    /// An empty trace.
    pub fn new() -> Trace {
        Trace::default()
    }

    /// Appends an event (backends and abstract evaluation record through this).
    pub fn record(&mut self, event: TraceEvent) {
        self.events.push(event);
    }

    /// All events in issue order.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// Forgets every event.
    pub fn clear(&mut self) {
        self.events.clear();
    }

    /// Events of `kind` in phases matching `phase`.
    pub fn filter<'a>(
        &'a self,
        kind: CollectiveKind,
        phase: &'a PhasePattern,
    ) -> impl Iterator<Item = &'a TraceEvent> + 'a {
        self.events
            .iter()
            .filter(move |e| e.kind == kind && phase.matches(&e.phase))
    }

    /// Number of `kind` collectives in phases matching `phase`.
    pub fn count(&self, kind: CollectiveKind, phase: &PhasePattern) -> usize {
        self.filter(kind, phase).count()
    }

    /// Bytes moved by `kind` collectives in phases matching `phase`.
    pub fn bytes(&self, kind: CollectiveKind, phase: &PhasePattern) -> usize {
        self.filter(kind, phase).map(|e| e.bytes).sum()
    }

    /// All-reduces with more than `min_elements` elements in phases matching `phase`: the probe
    /// for "gradients were reduced inside a micro-batch".
    pub fn all_reduces_larger_than(
        &self,
        min_elements: usize,
        phase: &PhasePattern,
    ) -> Vec<&TraceEvent> {
        self.events
            .iter()
            .filter(|e| {
                e.kind == CollectiveKind::AllReduce
                    && e.elements > min_elements
                    && phase.matches(&e.phase)
            })
            .collect()
    }

    /// Count and bytes per (phase, kind), phases in order of first appearance, kinds in their
    /// declared order.
    pub fn summary(&self) -> Vec<(String, CollectiveKind, PhaseKindTotal)> {
        let mut phase_order: Vec<&str> = Vec::new();
        let mut totals: BTreeMap<(usize, CollectiveKind), PhaseKindTotal> = BTreeMap::new();
        for e in &self.events {
            let p = match phase_order.iter().position(|p| *p == e.phase) {
                Some(p) => p,
                None => {
                    phase_order.push(&e.phase);
                    phase_order.len() - 1
                }
            };
            let t = totals.entry((p, e.kind)).or_default();
            t.count += 1;
            t.bytes += e.bytes;
        }
        totals
            .into_iter()
            .map(|((p, kind), t)| (phase_order[p].to_string(), kind, t))
            .collect()
    }

    /// The summary as an aligned text table (`phase | collective | count | bytes`).
    pub fn summary_table(&self) -> String {
        let rows: Vec<[String; 4]> = self
            .summary()
            .into_iter()
            .map(|(phase, kind, t)| {
                [
                    display_phase(&phase).to_string(),
                    kind.to_string(),
                    t.count.to_string(),
                    human_bytes(t.bytes),
                ]
            })
            .collect();
        aligned_table(&["phase", "collective", "count", "bytes"], &rows)
    }
}

/// Every event, one row each: `seq | phase | collective | axes | group | elements | bytes | dtype`.
impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows: Vec<[String; 8]> = self
            .events
            .iter()
            .map(|e| {
                [
                    e.seq.to_string(),
                    display_phase(&e.phase).to_string(),
                    e.kind.to_string(),
                    if e.axes.is_empty() {
                        "()".to_string()
                    } else {
                        e.axes.join(",")
                    },
                    e.group_size.to_string(),
                    e.elements.to_string(),
                    human_bytes(e.bytes),
                    e.dtype.to_string(),
                ]
            })
            .collect();
        f.write_str(&aligned_table(
            &[
                "seq",
                "phase",
                "collective",
                "axes",
                "group",
                "elements",
                "bytes",
                "dtype",
            ],
            &rows,
        ))
    }
}

fn display_phase(phase: &str) -> &str {
    if phase.is_empty() {
        "-"
    } else {
        phase
    }
}

/// `1.5 MiB`-style sizes for tables.
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Left-aligned text columns, two spaces apart, with a rule under the header.
fn aligned_table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| -> String {
        let padded: Vec<String> = cells
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_string() + "\n"
    };
    let mut out = line(&mut header.iter().copied());
    out += &line(
        &mut widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    );
    for row in rows {
        out += &line(&mut row.iter().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod kind_tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_name_every_kind_once() {
        for (i, kind) in CollectiveKind::ALL.into_iter().enumerate() {
            assert_eq!(kind.code(), i as u8 + 1);
            assert_eq!(CollectiveKind::from_code(kind.code()), Some(kind));
        }
        assert_eq!(CollectiveKind::from_code(0), None);
        assert_eq!(CollectiveKind::from_code(7), None);
        let mut names: Vec<_> = CollectiveKind::ALL.iter().map(|k| k.name()).collect();
        names.dedup();
        assert_eq!(names.len(), 6);
    }

    #[test]
    fn a_ring_all_reduce_moves_a_reduce_scatter_and_an_all_gather() {
        let (n, bytes) = (4.0, 1024.0);
        let rs = CollectiveKind::ReduceScatter.ring_bytes(n, bytes);
        let ag = CollectiveKind::AllGather.ring_bytes(n, bytes);
        assert_eq!(rs, 768.0);
        assert_eq!(CollectiveKind::AllReduce.ring_bytes(n, bytes), rs + ag);
        assert_eq!(
            CollectiveKind::AllReduce.ring_steps(n),
            CollectiveKind::ReduceScatter.ring_steps(n) + CollectiveKind::AllGather.ring_steps(n)
        );
        assert_eq!(CollectiveKind::Barrier.ring_bytes(n, bytes), 0.0);
        assert_eq!(CollectiveKind::AllReduce.bytes(10, DType::BF16), 20);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, kind: CollectiveKind, elements: usize, phase: &str) -> TraceEvent {
        TraceEvent {
            seq,
            kind,
            axes: vec!["data".into()],
            group_size: 4,
            elements,
            bytes: elements * 4,
            dtype: DType::F32,
            phase: phase.into(),
        }
    }

    #[test]
    fn globs() {
        let p = PhasePattern::new("micro_batch*");
        assert!(p.matches("micro_batch 0"));
        assert!(p.matches("micro_batch"));
        assert!(!p.matches("update"));
        assert!(PhasePattern::new("*update*").matches("step 1/update/zero1"));
        assert!(PhasePattern::new("update").matches("update"));
        assert!(!PhasePattern::new("update").matches("update/zero1"));
        assert!(PhasePattern::any().matches(""));
    }

    #[test]
    fn queries_and_summary() {
        let mut t = Trace::new();
        t.record(event(0, CollectiveKind::AllReduce, 1, "micro_batch 0"));
        t.record(event(1, CollectiveKind::AllReduce, 100, "micro_batch 1"));
        t.record(event(2, CollectiveKind::AllReduce, 100, "update"));
        t.record(event(3, CollectiveKind::AllGather, 10, "update"));
        let mb = PhasePattern::new("micro_batch*");
        assert_eq!(t.count(CollectiveKind::AllReduce, &mb), 2);
        assert_eq!(t.bytes(CollectiveKind::AllReduce, &mb), 404);
        let big = t.all_reduces_larger_than(8, &mb);
        assert_eq!(big.len(), 1);
        assert_eq!(big[0].seq, 1);
        let s = t.summary();
        assert_eq!(s.len(), 4);
        assert_eq!(s[2].0, "update");
        assert_eq!(s[2].1, CollectiveKind::AllReduce);
        assert_eq!(
            s[3],
            (
                "update".into(),
                CollectiveKind::AllGather,
                PhaseKindTotal {
                    count: 1,
                    bytes: 40
                }
            )
        );
        let table = t.summary_table();
        assert!(table.starts_with("phase          collective  count  bytes\n"));
        assert!(table.contains("update         all_gather  1      40 B\n"));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(4096), "4.0 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }
}
