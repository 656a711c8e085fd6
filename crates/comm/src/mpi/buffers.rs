//! The staging buffers MPI reads and writes: pools that keep them between collectives, the
//! outbox of a one-shot exchange, and received messages.
//!
//! # Invariants
//! * **MPI only ever touches buffers from here.** Callers' data is copied into a staged buffer
//!   (header first, see `wire`) before a send and out of a [`Received`] after its receive; no
//!   caller's slice is ever handed to MPI.
//! * A buffer is back in a pool only once MPI is done with it: a send's buffer when its last
//!   send completed, a received one when its reader recycles it. Buffers of requests still live
//!   when a collective stops are leaked by the message engine (`engine`), never pooled or freed.
//! * Every buffer is whole 8-byte words, so payloads start 8-byte aligned behind the header.
//!   The padding after a payload is not cleared: no reader looks past a payload's length.

use std::rc::Rc;

use super::wire::{Header, HEADER_BYTES, HEADER_WORDS};

/// Buffers the pool of whole messages keeps at most.
const POOL_BUFFERS: usize = 16;
/// Buffers the pool of pipeline parts keeps at most: parts are 64–256 KiB under the default
/// eager limit, and a pipelined collective has about 2 MiB of them in flight per peer and lane.
const PART_BUFFERS: usize = 96;

/// Staging buffers kept between collectives: a fresh multi-MiB allocation per message costs a
/// page fault per 4 KiB on first touch (most of a large all-reduce's time before the pool).
pub(crate) struct Pool {
    free: Vec<Vec<u64>>,
    /// Buffers kept at most (the largest are kept).
    keep: usize,
}

impl Default for Pool {
    fn default() -> Pool {
        Pool::whole_messages()
    }
}

impl Pool {
    /// The pool of one-shot exchanges' whole messages.
    pub(crate) fn whole_messages() -> Pool {
        Pool {
            free: Vec::new(),
            keep: POOL_BUFFERS,
        }
    }

    /// The pool of pipelined collectives' parts.
    pub(crate) fn parts() -> Pool {
        Pool {
            free: Vec::new(),
            keep: PART_BUFFERS,
        }
    }

    /// A buffer of exactly `words` words (contents unspecified but initialised): the smallest free
    /// one that fits, else the largest grown.
    pub(crate) fn take(&mut self, words: usize) -> Vec<u64> {
        let fit = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= words)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        let largest = || {
            self.free
                .iter()
                .enumerate()
                .max_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)
        };
        let mut buf = match fit.or_else(largest) {
            Some(i) => self.free.swap_remove(i),
            None => Vec::new(),
        };
        buf.resize(words, 0);
        buf
    }

    /// Keeps `buffers` for later, dropping the smallest beyond the pool's size.
    pub(crate) fn give(&mut self, buffers: impl IntoIterator<Item = Vec<u64>>) {
        self.free.extend(buffers);
        if self.free.len() > self.keep {
            self.free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
            self.free.truncate(self.keep);
        }
    }

    /// `header` and `payload` (raw bytes) in a buffer of this pool, padded to whole words (the
    /// padding is whatever the reused buffer held; receivers never read it).
    pub(crate) fn stage(&mut self, header: Header, payload: &[u8]) -> Vec<u64> {
        let mut buf = self.take(HEADER_WORDS + payload.len().div_ceil(8));
        buf[..HEADER_WORDS].copy_from_slice(&header);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        bytes[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
        buf
    }
}

/// A staged message: header and payload in a buffer MPI may read while its sends are in flight;
/// shared by the sends of one payload to several devices.
pub(crate) type Staged = Rc<Vec<u64>>;

/// A message to send: its destination device and the staging buffer it comes from.
pub(crate) struct Outgoing {
    /// The destination device.
    pub(crate) dest: usize,
    /// Index of its buffer in [`Outbox::buffers`].
    pub(crate) buffer: usize,
}

/// Everything one device sends in one step of a one-shot exchange (get one from
/// `Transport::outbox`, which lends it the pooled buffers).
pub(crate) struct Outbox {
    /// The staged buffers.
    pub(crate) buffers: Vec<Vec<u64>>,
    /// The sends, in the order they are posted.
    pub(crate) messages: Vec<Outgoing>,
    /// The transport's pool of whole messages, lent while staging.
    pub(crate) pool: Pool,
}

impl Outbox {
    /// An empty outbox staging into `pool`.
    pub(crate) fn new(pool: Pool) -> Outbox {
        Outbox {
            buffers: Vec::new(),
            messages: Vec::new(),
            pool,
        }
    }

    /// Stages `payload` (raw bytes) behind the header; returns its buffer's index.
    pub(crate) fn stage(&mut self, header: Header, payload: &[u8]) -> usize {
        let buf = self.pool.stage(header, payload);
        self.buffers.push(buf);
        self.buffers.len() - 1
    }

    /// Sends staged buffer `buffer` to device `dest`.
    pub(crate) fn send(&mut self, dest: usize, buffer: usize) {
        self.messages.push(Outgoing { dest, buffer });
    }
}

/// A received message: header checked, payload bytes at [`Received::payload`].
pub(crate) struct Received {
    /// The whole message (header, payload, padding).
    pub(crate) buf: Vec<u64>,
    /// Payload bytes.
    pub(crate) len: usize,
}

impl Received {
    /// The payload bytes (8-byte aligned).
    pub(crate) fn payload(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.buf)[HEADER_BYTES..HEADER_BYTES + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_reuse_the_smallest_fit_and_keep_the_largest() {
        let mut pool = Pool::whole_messages();
        pool.give([Vec::with_capacity(10), Vec::with_capacity(100)]);
        let b = pool.take(8);
        assert!(b.len() == 8 && b.capacity() >= 10 && b.capacity() < 100);
        let mut parts = Pool::parts();
        parts.give((0..PART_BUFFERS + 5).map(Vec::with_capacity));
        assert_eq!(parts.free.len(), PART_BUFFERS);
        assert!(parts.free.iter().all(|b| b.capacity() >= 5));
    }

    #[test]
    fn staged_messages_hold_header_then_payload() {
        let mut pool = Pool::parts();
        pool.give([vec![u64::MAX; 32]]);
        let buf = pool.stage([1, 2, 3, 4, 5], &[9, 8, 7]);
        assert_eq!(buf.len(), HEADER_WORDS + 1);
        assert_eq!(&buf[..HEADER_WORDS], &[1, 2, 3, 4, 5]);
        let r = Received { buf, len: 3 };
        assert_eq!(r.payload(), &[9, 8, 7]);
    }
}
