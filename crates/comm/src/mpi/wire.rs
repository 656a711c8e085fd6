//! What travels between devices: message headers, the tags that address them, and the codes
//! that name a collective on the wire.
//!
//! Nothing here calls MPI; the message engine (`engine`) and the start-up agreement (`startup`)
//! put these words and tags on the wire.
//!
//! # Invariants
//! * **Addressing**: device `d` lives in process `d / L` (`L` devices a process). A message from
//!   device `s` to device `t` on lane `λ` carries tag `(λ·L + s mod L)·L + t mod L`, so the device
//!   threads of one process never see each other's messages, and MPI's non-overtaking rule keeps
//!   each pair's messages of one lane in program order. Lane 0 is the one-shot exchange's and the
//!   reduce step's, lane 1 the gather step of a pipelined all-reduce.
//! * **Every collective's message starts with a header** of [`HEADER_WORDS`] words: collective
//!   number; part, kind code and step; payload bytes; sender; the collective's element count.
//!   The receiver compares it, word for word, with the header it expects, so devices that
//!   diverge get a `CommError::Mismatch` instead of summing unrelated data.
//! * A message of `p` payload bytes is [`message_bytes`]`(p)` long: header, payload, zero padding
//!   to whole 8-byte words. The traffic counters count the header's payload word, never the
//!   header or the padding.
//! * Start-up agreements carry no header: two bare words on [`AGREE_TAG`] of their own
//!   communicator, which no collective uses.

use std::os::raw::c_int;

use crate::backend::OpInfo;
use crate::trace::CollectiveKind;

/// Header words before every payload.
pub(crate) const HEADER_WORDS: usize = 5;
/// Header bytes (payloads start 8-byte aligned after it).
pub(crate) const HEADER_BYTES: usize = HEADER_WORDS * 8;

/// The header words of one message.
pub(crate) type Header = [u64; HEADER_WORDS];

/// The tag of start-up agreements (on their own communicator, so it meets no collective's).
pub(crate) const AGREE_TAG: c_int = 1;

/// The header a message of step `stage` of `op`, sent by `sender`, carries.
pub(crate) fn header(op: &OpInfo, stage: u8, payload_bytes: usize, sender: usize) -> Header {
    part_header(op, stage, 0, payload_bytes, sender)
}

/// The header of pipeline part `part` of step `stage` of `op`: collective number; part, kind and
/// step; payload bytes; sender; the collective's element count (so peers that disagree on the
/// buffer's length differ in the first message, not only when their parts' sizes part ways).
pub(crate) fn part_header(
    op: &OpInfo,
    stage: u8,
    part: usize,
    payload_bytes: usize,
    sender: usize,
) -> Header {
    [
        op.seq,
        ((part as u64) << 16) | (u64::from(op.kind.code()) << 8) | u64::from(stage),
        payload_bytes as u64,
        sender as u64,
        op.elements as u64,
    ]
}

/// The part number a header carries.
pub(crate) fn part_of(h: &Header) -> u64 {
    h[1] >> 16
}

/// The payload bytes a staged message's header announces (what the traffic counters add); 0 for
/// a buffer too short to hold a header.
pub(crate) fn payload_of(message: &[u64]) -> u64 {
    message.get(2).copied().unwrap_or(0)
}

/// The header at the start of a received message; zeros where the message is shorter.
pub(crate) fn header_in(message: &[u64]) -> Header {
    message
        .get(..HEADER_WORDS)
        .and_then(|h| h.try_into().ok())
        .unwrap_or_default()
}

/// Bytes of a message with `payload` payload bytes (header and padding to whole words).
pub(crate) fn message_bytes(payload: usize) -> usize {
    (HEADER_WORDS + payload.div_ceil(8)) * 8
}

/// A received header described for a `CommError::Mismatch` (`received`: the message's bytes).
pub(crate) fn describe_header(h: &Header, received: usize) -> String {
    let kind = CollectiveKind::from_code(((h[1] >> 8) & 0xff) as u8)
        .map_or("an unknown collective", CollectiveKind::name);
    format!(
        "{kind} #{} of {} elements (step {}, part {}, {} payload bytes; message of {received} \
         bytes)",
        h[0],
        h[4],
        h[1] & 0xff,
        part_of(h),
        h[2]
    )
}

/// Where devices live and how their messages are tagged (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Addressing {
    /// Devices a process (`L`, at least 1).
    per_process: usize,
}

impl Addressing {
    /// The addressing of a run with `per_process` devices a process (0 counts as 1).
    pub(crate) fn new(per_process: usize) -> Addressing {
        Addressing {
            per_process: per_process.max(1),
        }
    }

    /// The MPI rank of the process that holds `device`.
    pub(crate) fn process_of(&self, device: usize) -> c_int {
        (device / self.per_process) as c_int
    }

    /// Whether two devices live in the same process.
    pub(crate) fn same_process(&self, a: usize, b: usize) -> bool {
        self.process_of(a) == self.process_of(b)
    }

    /// The tag of lane `lane` from `from` to `to`: every lane its own ordered stream between the
    /// pair.
    pub(crate) fn lane_tag(&self, from: usize, to: usize, lane: usize) -> c_int {
        let l = self.per_process;
        ((lane * l + from % l) * l + to % l) as c_int
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op() -> OpInfo {
        OpInfo {
            kind: CollectiveKind::AllGather,
            seq: 7,
            axes: vec!["data".into()],
            group: vec![0, 1],
            rank: 0,
            elements: 12,
            dtype: ferrotext_sharding::DType::F32,
            root: 0,
        }
    }

    #[test]
    fn headers_describe_themselves() {
        let h = part_header(&op(), 1, 3, 24, 5);
        assert_eq!(part_of(&h), 3);
        assert_eq!(payload_of(&h), 24);
        assert_eq!(header(&op(), 1, 24, 5)[1] & 0xffff, h[1] & 0xffff);
        assert_eq!(
            describe_header(&h, message_bytes(24)),
            "all_gather #7 of 12 elements (step 1, part 3, 24 payload bytes; message of 64 bytes)"
        );
        assert_eq!(header_in(&h[..2]), [0; HEADER_WORDS]);
        assert_eq!(header_in(&h), h);
        assert_eq!(message_bytes(0), HEADER_BYTES);
        assert_eq!(message_bytes(1), HEADER_BYTES + 8);
    }

    #[test]
    fn tags_separate_pairs_and_lanes() {
        let a = Addressing::new(2);
        assert_eq!(a.process_of(3), 1);
        assert!(a.same_process(2, 3) && !a.same_process(1, 2));
        let mut tags: Vec<c_int> = (0..2)
            .flat_map(|lane| (0..2).flat_map(move |s| (0..2).map(move |t| (s, t, lane))))
            .map(|(s, t, lane)| a.lane_tag(s, t + 2, lane))
            .collect();
        let all = tags.len();
        tags.sort_unstable();
        tags.dedup();
        assert_eq!(tags.len(), all);
        assert_eq!(Addressing::new(0).lane_tag(4, 9, 0), 0);
    }
}
