//! Pipelined flat collectives across processes: all-reduce, and its halves reduce-scatter and
//! all-gather, with every block cut into parts that travel as separate messages so that the wire
//! is busy while parts are staged, summed and copied.
//!
//! # Algorithm (group of `n` members, this one `r`; block `k` owned by member `k`)
//! * **Reduce step**: every member sends part `s` of its block `k` to member `k` (lane 0); the
//!   owner sums part `s` of its block as soon as it has arrived from all `n − 1` others.
//! * **Gather step**: the owner sends each summed part to every other member (lane 1 in an
//!   all-reduce, lane 0 in an all-gather, which has no reduce step) as soon as it is summed, so
//!   the gather of early parts overlaps the reduction of later ones.
//! * Sends are posted a window of parts ahead, receives as soon as their message is matched, and
//!   the calling thread polls (`MPI_Testsome`) in a tight loop while it waits: progress does not
//!   depend on any other thread.
//!
//! # Invariants
//! * **Who posts**: the member's own thread, through one engine `Flight` per collective: every
//!   part's send (counted in the traffic counters), every receive.
//! * **Who matches**: each member matches the parts it expects from each other member in part
//!   order, one lane per step; MPI's non-overtaking rule on a (sender, lane tag) pair makes part
//!   `s` the next message there. A part whose header or size is not the expected one fails the
//!   collective with `CommError::Mismatch` as soon as it completes.
//! * **What a timeout means**: no round made progress and the transport's timeout has passed
//!   since the collective started; the error names the members whose parts have not all
//!   arrived, or, when every part is in, those whose receives of this member's sends are still
//!   open (sorted by device).
//!
//! # Why the sums are bitwise those of the in-process backend
//! Part `s` of block `r` is summed by its owner alone, from every member's *input* (never a
//! partial sum), element by element in the tree order over ranks `0, 1, …, n − 1`
//! (`tree_sum.rs`), accumulating in `f32` and rounding once: exactly `local.rs`'s order. Parts only cut the block into ranges; the sum of an
//! element never depends on which part it is in. Every other member receives the owner's result
//! verbatim.
//!
//! # Bytes
//! Per member `2(n−1)/n` of the buffer leave (and arrive) in an all-reduce, the bandwidth optimum
//! of a ring, but without forwarding: on a switched network each link carries the same bytes as a
//! ring's, and the sums keep the tree order. Every part carries a [`part_header`] (40 bytes per
//! part of 64–256 KiB: 0.06–0.02 %).

use std::ops::Range;

use crate::backend::OpInfo;
use crate::element::Element;
use crate::error::CommError;

use super::buffers::Received;
use super::eager::{part_message_bytes, PML_HEADER_ALLOWANCE};
use super::engine::{Event, Flight};
use super::transport::Transport;
use super::wire::{part_header, HEADER_BYTES};

/// Bytes sent ahead to each member (and of summed parts being gathered) before their sends
/// complete. On 2 emulated hosts at 10 Gbit/s a window of 256 KiB (200 µs of the link) drained
/// whenever a process lost its core for longer than that: the all-reduce reached 74–78 % of the
/// link at 4 MiB, against 82–85 % with 2 MiB (64 KiB parts), the same at 1 Gbit/s.
const WINDOW_BYTES: usize = 2 << 20;

/// Parts in flight per member: [`WINDOW_BYTES`] of them, at least 4.
fn window() -> usize {
    (WINDOW_BYTES / part_message_bytes()).max(4)
}

/// What a pipelined collective reads and writes (ranges are in the layout of `blocks`).
pub(crate) enum Data<'a, T> {
    /// In place: every member's buffer becomes the tree-order sum.
    AllReduce(&'a mut [T]),
    /// `output` (block `r`'s length) = block `r` of the tree-order sum of every `input`.
    ReduceScatter { input: &'a [T], output: &'a mut [T] },
    /// Block `k` of `output` = member `k`'s `input` (block `r`'s length).
    AllGather { input: &'a [T], output: &'a mut [T] },
}

impl<T: Element> Data<'_, T> {
    /// This member's contribution to `range` (of any block in a reduction, of its own block in
    /// a gather); `base` is the start of its own block.
    fn contribution(&self, range: Range<usize>, base: usize) -> &[T] {
        match self {
            Data::AllReduce(buf) => &buf[range],
            Data::ReduceScatter { input, .. } => &input[range],
            Data::AllGather { input, .. } => &input[range.start - base..range.end - base],
        }
    }

    /// Where a gathered `range` of another member's block goes.
    fn gathered(&mut self, range: Range<usize>) -> &mut [T] {
        match self {
            Data::AllReduce(buf) => &mut buf[range],
            Data::AllGather { output, .. } => &mut output[range],
            Data::ReduceScatter { output, .. } => &mut output[..0],
        }
    }

    /// Sums `range` of this member's block: `others` are the other members' parts in rank order.
    fn sum(&mut self, range: Range<usize>, base: usize, r: usize, others: &[&[T]]) {
        match self {
            Data::AllReduce(buf) => sum_in_tree_order(&mut buf[range], None, r, others),
            Data::ReduceScatter { input, output } => sum_in_tree_order(
                &mut output[range.start - base..range.end - base],
                Some(&input[range]),
                r,
                others,
            ),
            Data::AllGather { .. } => {}
        }
    }
}

/// What a message in flight is.
#[derive(Clone, Copy)]
enum Token {
    /// A reduce-step part sent to member `k`.
    ReduceOut { k: usize },
    /// A gather-step part sent to member `k`.
    GatherOut { k: usize },
    /// Part `part` of this member's block from member `k`.
    ReduceIn { k: usize, part: usize },
    /// Part `part` of member `k`'s block from member `k`.
    GatherIn { k: usize, part: usize },
}

/// The smallest part a block is cut into (Open MPI's default eager limit, less the PML's header):
/// smaller parts only add messages.
const MIN_PART_MESSAGE_BYTES: usize = (64 << 10) - PML_HEADER_ALLOWANCE;

/// Parts a block is cut into at least, while they stay above [`MIN_PART_MESSAGE_BYTES`]: with
/// fewer, the gather of a block's first part waits for too much of its reduction (under a raised
/// eager limit; at the default one every part is already that small).
const MIN_PARTS_PER_BLOCK: usize = 8;

/// Elements of `elem` bytes per part for blocks of at most `largest` elements: an eighth of the
/// block, between [`MIN_PART_MESSAGE_BYTES`] and [`part_message_bytes`] (every member computes
/// it from the same layout, so all agree).
fn part_elements(elem: usize, largest: usize) -> usize {
    part_elements_within(part_message_bytes(), elem, largest)
}

/// [`part_elements`] for parts of at most `message_bytes`.
fn part_elements_within(message_bytes: usize, elem: usize, largest: usize) -> usize {
    let elem = elem.max(1);
    let most = ((message_bytes - HEADER_BYTES) / elem).max(1);
    let least = ((MIN_PART_MESSAGE_BYTES - HEADER_BYTES) / elem).clamp(1, most);
    largest.div_ceil(MIN_PARTS_PER_BLOCK).clamp(least, most)
}

/// Parts of a block of `len` elements (at least one, so an empty block still sends a header).
fn parts(len: usize, per_part: usize) -> usize {
    len.div_ceil(per_part).max(1)
}

/// Part `s` of `block`.
fn part(block: &Range<usize>, per_part: usize, s: usize) -> Range<usize> {
    let start = (block.start + s * per_part).min(block.end);
    start..(start + per_part).min(block.end)
}

/// Runs one pipelined collective over `members` (this device is `members[r]`); block `k` of the
/// layout is `blocks[k]`. Steps `stage` (reduce) and `stage + 1` (gather) of `op`; an all-gather
/// alone uses `stage`.
///
/// Each round: take what completed, sum the parts that are complete, post gather and reduce
/// sends a window ahead, match whatever has arrived; a round that did none of these waits (and
/// fails once the transport's timeout has passed since the collective started).
///
/// # Errors
/// As [`Transport::exchange`]: [`CommError::Timeout`] naming the members still missing,
/// [`CommError::Mismatch`], [`CommError::Transport`], [`CommError::GroupBroken`].
pub(crate) fn pipelined<T: Element>(
    transport: &mut Transport,
    op: &OpInfo,
    stage: u8,
    members: &[usize],
    r: usize,
    blocks: &[Range<usize>],
    mut data: Data<'_, T>,
) -> Result<(), CommError> {
    let plan = Plan::new::<T>(op, stage, members, r, blocks, &data);
    if let Data::AllGather { input, output } = &mut data {
        output[plan.own.clone()].copy_from_slice(input);
    }
    let mut run = Run {
        state: State::new(&plan),
        plan,
        data,
    };
    let mut flight = transport.flight::<Token>(op)?;
    let mut events = Vec::new();
    loop {
        let mut progressed = flight.poll(&mut events)?;
        run.absorb(&mut flight, &mut events);
        progressed |= run.sum_ready(&mut flight);
        progressed |= run.spread_ready(&mut flight)?;
        progressed |= run.send_reduce_parts(&mut flight)?;
        progressed |= run.match_arrivals(&mut flight)?;
        if run.finished() && !flight.busy() {
            return Ok(());
        }
        if !progressed {
            flight.idle(|| run.missing())?;
        }
    }
}

/// What every round of a pipelined collective reads and never changes.
struct Plan<'p> {
    op: &'p OpInfo,
    /// The reduce step's stage (an all-gather's only one).
    stage: u8,
    members: &'p [usize],
    /// This member's rank.
    r: usize,
    blocks: &'p [Range<usize>],
    /// Whether there is a reduce step (all-reduce, reduce-scatter).
    reduce: bool,
    /// Whether there is a gather step (all-reduce, all-gather).
    gather: bool,
    /// The gather step's lane and stage.
    gather_lane: usize,
    gather_stage: u8,
    /// Bytes of an element.
    elem: usize,
    /// Elements of a part.
    per_part: usize,
    /// Parts in flight per member.
    window: usize,
    /// Parts of every block.
    nparts: Vec<usize>,
    /// This member's block and its parts.
    own: Range<usize>,
    own_parts: usize,
    /// This device.
    me: usize,
    /// The other members' ranks, from `r + 1` round.
    others: Vec<usize>,
}

impl<'p> Plan<'p> {
    fn new<T: Element>(
        op: &'p OpInfo,
        stage: u8,
        members: &'p [usize],
        r: usize,
        blocks: &'p [Range<usize>],
        data: &Data<'_, T>,
    ) -> Plan<'p> {
        let n = members.len();
        let (reduce, gather) = match data {
            Data::AllReduce(_) => (true, true),
            Data::ReduceScatter { .. } => (true, false),
            Data::AllGather { .. } => (false, true),
        };
        let (gather_lane, gather_stage) = if reduce { (1, stage + 1) } else { (0, stage) };
        let elem = std::mem::size_of::<T>();
        let largest = blocks.iter().map(|b| b.len()).max().unwrap_or(0);
        let per_part = part_elements(elem, largest);
        let nparts: Vec<usize> = blocks.iter().map(|b| parts(b.len(), per_part)).collect();
        Plan {
            op,
            stage,
            members,
            r,
            blocks,
            reduce,
            gather,
            gather_lane,
            gather_stage,
            elem,
            per_part,
            window: window(),
            own: blocks[r].clone(),
            own_parts: nparts[r],
            nparts,
            me: members[r],
            others: (1..n).map(|i| (r + i) % n).collect(),
        }
    }
}

/// How far a pipelined collective has come, per member `k`.
struct State {
    /// Reduce step: parts of block `k` sent to member `k`, and those of them not yet complete.
    sent: Vec<usize>,
    open_reduce: Vec<usize>,
    /// Reduce step: parts of this member's block matched and arrived from member `k`.
    probed_in: Vec<usize>,
    got_in: Vec<usize>,
    /// Reduce step: the arrived parts of this member's block (by part, then member), and how
    /// many have arrived of each part.
    arrived: Vec<Vec<Option<Received>>>,
    count: Vec<usize>,
    /// Parts of this member's block ready to gather (summed, or all of them in an all-gather).
    ready: usize,
    /// Gather step: own parts sent to everyone, and gather sends not yet complete.
    spread: usize,
    open_gather: usize,
    /// Gather step: parts of block `k` matched and arrived from member `k`.
    probed_out: Vec<usize>,
    got_out: Vec<usize>,
    /// Sends to member `k` not yet complete (both steps).
    open: Vec<usize>,
}

impl State {
    fn new(plan: &Plan<'_>) -> State {
        let n = plan.members.len();
        let reduced_parts = if plan.reduce { plan.own_parts } else { 0 };
        State {
            sent: vec![0; n],
            open_reduce: vec![0; n],
            probed_in: vec![0; n],
            got_in: vec![0; n],
            arrived: (0..reduced_parts)
                .map(|_| (0..n).map(|_| None).collect())
                .collect(),
            count: vec![0; reduced_parts],
            ready: if plan.reduce { 0 } else { plan.own_parts },
            spread: 0,
            open_gather: 0,
            probed_out: vec![0; n],
            got_out: vec![0; n],
            open: vec![0; n],
        }
    }
}

/// One pipelined collective under way: its plan, its state and its data.
struct Run<'p, 'd, T> {
    plan: Plan<'p>,
    state: State,
    data: Data<'d, T>,
}

impl<T: Element> Run<'_, '_, T> {
    /// Takes in the completed sends and receives of `events`: gathered parts are copied out at
    /// once, reduce-step parts kept until their part is complete.
    fn absorb(&mut self, flight: &mut Flight<'_, Token>, events: &mut Vec<Event<Token>>) {
        let (plan, st) = (&self.plan, &mut self.state);
        for event in events.drain(..) {
            match event {
                Event::Sent(Token::ReduceOut { k }) => {
                    st.open[k] -= 1;
                    st.open_reduce[k] -= 1;
                }
                Event::Sent(Token::GatherOut { k }) => {
                    st.open[k] -= 1;
                    st.open_gather -= 1;
                }
                Event::Received(Token::ReduceIn { k, part }, msg) => {
                    st.arrived[part][k] = Some(msg);
                    st.count[part] += 1;
                    st.got_in[k] += 1;
                }
                Event::Received(Token::GatherIn { k, part: s }, msg) => {
                    self.data
                        .gathered(part(&plan.blocks[k], plan.per_part, s))
                        .copy_from_slice(bytemuck::cast_slice(msg.payload()));
                    flight.recycle(msg);
                    st.got_out[k] += 1;
                }
                Event::Sent(_) | Event::Received(..) => {}
            }
        }
    }

    /// Sums every part of this member's block that has arrived from everyone, in part order;
    /// returns whether any was.
    fn sum_ready(&mut self, flight: &mut Flight<'_, Token>) -> bool {
        let (plan, st) = (&self.plan, &mut self.state);
        let n = plan.members.len();
        let mut progressed = false;
        while plan.reduce && st.ready < plan.own_parts && st.count[st.ready] == n - 1 {
            let msgs: Vec<Received> = std::mem::take(&mut st.arrived[st.ready])
                .into_iter()
                .flatten()
                .collect();
            let parts_in_order: Vec<&[T]> = msgs
                .iter()
                .map(|m| bytemuck::cast_slice(m.payload()))
                .collect();
            let range = part(&plan.own, plan.per_part, st.ready);
            self.data
                .sum(range, plan.own.start, plan.r, &parts_in_order);
            for m in msgs {
                flight.recycle(m);
            }
            st.ready += 1;
            progressed = true;
        }
        progressed
    }

    /// Posts the gather sends of ready parts to every other member, a window ahead; returns
    /// whether any was posted.
    fn spread_ready(&mut self, flight: &mut Flight<'_, Token>) -> Result<bool, CommError> {
        let (plan, st) = (&self.plan, &mut self.state);
        let mut progressed = false;
        while plan.gather
            && st.spread < st.ready
            && st.open_gather < plan.window * (plan.members.len() - 1)
        {
            let range = part(&plan.own, plan.per_part, st.spread);
            let payload: &[u8] =
                bytemuck::cast_slice(self.data.contribution(range, plan.own.start));
            let header = part_header(
                plan.op,
                plan.gather_stage,
                st.spread,
                payload.len(),
                plan.me,
            );
            let staged = flight.stage(header, payload);
            for &k in &plan.others {
                let token = Token::GatherOut { k };
                flight.send(plan.members[k], plan.gather_lane, &staged, token)?;
                st.open[k] += 1;
                st.open_gather += 1;
            }
            st.spread += 1;
            progressed = true;
        }
        Ok(progressed)
    }

    /// Posts the reduce sends of every other member's block, a window ahead per member; returns
    /// whether any was posted.
    fn send_reduce_parts(&mut self, flight: &mut Flight<'_, Token>) -> Result<bool, CommError> {
        let (plan, st) = (&self.plan, &mut self.state);
        let mut progressed = false;
        if !plan.reduce {
            return Ok(false);
        }
        for &k in &plan.others {
            while st.sent[k] < plan.nparts[k] && st.open_reduce[k] < plan.window {
                let range = part(&plan.blocks[k], plan.per_part, st.sent[k]);
                let payload: &[u8] =
                    bytemuck::cast_slice(self.data.contribution(range, plan.own.start));
                let header = part_header(plan.op, plan.stage, st.sent[k], payload.len(), plan.me);
                let staged = flight.stage(header, payload);
                flight.send(plan.members[k], 0, &staged, Token::ReduceOut { k })?;
                st.sent[k] += 1;
                st.open[k] += 1;
                st.open_reduce[k] += 1;
                progressed = true;
            }
        }
        Ok(progressed)
    }

    /// Matches whatever has arrived from every other member, in part order per step and lane;
    /// returns whether anything was matched.
    fn match_arrivals(&mut self, flight: &mut Flight<'_, Token>) -> Result<bool, CommError> {
        let (plan, st) = (&self.plan, &mut self.state);
        let mut progressed = false;
        for &k in &plan.others {
            let source = plan.members[k];
            while plan.reduce && st.probed_in[k] < plan.own_parts {
                let s = st.probed_in[k];
                let bytes = part(&plan.own, plan.per_part, s).len() * plan.elem;
                let expected = part_header(plan.op, plan.stage, s, bytes, source);
                let token = Token::ReduceIn { k, part: s };
                if !flight.probe(source, 0, plan.stage, expected, bytes, token)? {
                    break;
                }
                st.probed_in[k] += 1;
                progressed = true;
            }
            while plan.gather && st.probed_out[k] < plan.nparts[k] {
                let s = st.probed_out[k];
                let bytes = part(&plan.blocks[k], plan.per_part, s).len() * plan.elem;
                let (lane, stage) = (plan.gather_lane, plan.gather_stage);
                let expected = part_header(plan.op, stage, s, bytes, source);
                let token = Token::GatherIn { k, part: s };
                if !flight.probe(source, lane, stage, expected, bytes, token)? {
                    break;
                }
                st.probed_out[k] += 1;
                progressed = true;
            }
        }
        Ok(progressed)
    }

    /// Whether every part is summed, spread, sent and in (the flight may still be busy).
    fn finished(&self) -> bool {
        let (plan, st) = (&self.plan, &self.state);
        st.ready == plan.own_parts
            && (!plan.gather || st.spread == plan.own_parts)
            && plan.others.iter().all(|&k| {
                (!plan.reduce || (st.sent[k] == plan.nparts[k] && st.got_in[k] == plan.own_parts))
                    && (!plan.gather || st.got_out[k] == plan.nparts[k])
            })
    }

    /// The members a timed-out collective waited for: those whose parts have not all arrived,
    /// else those whose sends are still open, in device order.
    fn missing(&self) -> Vec<usize> {
        let (plan, st) = (&self.plan, &self.state);
        let waiting = |k: &usize| {
            (plan.reduce && st.got_in[*k] < plan.own_parts)
                || (plan.gather && st.got_out[*k] < plan.nparts[*k])
        };
        let mut missing: Vec<usize> = plan
            .others
            .iter()
            .filter(|k| waiting(k))
            .map(|&k| plan.members[k])
            .collect();
        if missing.is_empty() {
            // Everything arrived; sends still wait for their receivers.
            missing = plan
                .others
                .iter()
                .filter(|&&k| st.open[k] > 0)
                .map(|&k| plan.members[k])
                .collect();
        }
        missing.sort_unstable();
        missing
    }
}

/// Elements summed per block (16 KiB of `f32` accumulators, as in the in-process backend).
const BLOCK: usize = 4096;

/// `out` = the sum, in the tree order of [`crate::tree_sum`] over the ranks and in `f32`, of
/// the `others` (every member's part but this one's, in rank order) with this member's part —
/// `own`, or `out`'s current value when `None` — inserted at rank `r`: the in-process backend's
/// order, so results are bitwise equal to it.
pub(crate) fn sum_in_tree_order<T: Element>(
    out: &mut [T],
    own: Option<&[T]>,
    r: usize,
    others: &[&[T]],
) {
    let mut acc = [0f32; BLOCK];
    let mut scratch = Vec::new();
    let mut start = 0;
    while start < out.len() {
        let end = (start + BLOCK).min(out.len());
        let acc = &mut acc[..end - start];
        {
            let mine: &[T] = match own {
                Some(own) => &own[start..end],
                None => &out[start..end],
            };
            let part = |k: usize| -> &[T] {
                match k.cmp(&r) {
                    std::cmp::Ordering::Equal => mine,
                    std::cmp::Ordering::Less => &others[k][start..end],
                    std::cmp::Ordering::Greater => &others[k - 1][start..end],
                }
            };
            crate::tree_sum::tree_sum_into(acc, others.len() + 1, &part, &mut scratch);
        }
        for (d, &a) in out[start..end].iter_mut().zip(acc.iter()) {
            *d = T::from_f32(a);
        }
        start = end;
    }
}

#[cfg(test)]
mod tests;
