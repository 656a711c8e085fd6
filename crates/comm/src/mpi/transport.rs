//! Non-blocking point-to-point messages between the devices of different (or the same) MPI
//! processes, waited on with a timeout.
//!
//! Every collective of the MPI backend is built from [`Transport::exchange`]: post every send of
//! one step at once (`MPI_Isend`), match each expected message as it arrives (`MPI_Improbe`) and
//! receive it into a buffer of exactly its size (`MPI_Imrecv`), polling until all are done or the
//! timeout passes. Nothing blocks inside MPI, so a peer that never arrives costs at most the
//! timeout.
//!
//! # Invariants
//! * **Addressing**: device `d` lives in process `d / L`; a message from device `s` to device `t`
//!   carries tag `(s mod L)·L + (t mod L)`, so the device threads of one process never see each
//!   other's messages, and MPI's non-overtaking rule keeps each pair's messages in program order.
//! * **Every message starts with a header** (collective number, kind and stage, payload bytes,
//!   sender). A receiver checks it against what it expects, so devices that diverge get a
//!   [`CommError::Mismatch`] instead of summing unrelated data.
//! * **A receive buffer is never smaller than its message**: receives are sized from the matched
//!   probe, so a diverged peer that sends more than expected is a [`CommError::Mismatch`], not a
//!   write past the buffer (Open MPI's shared-memory single-copy path does not truncate).
//! * **MPI only ever touches staging buffers owned here.** They are copied in before the sends
//!   and out after the receives. When a wait times out the requests are still live, so their
//!   buffers are leaked on purpose (MPI may still write them) and the transport refuses all later
//!   work: the process is expected to end (the launcher aborts the job).

use std::os::raw::{c_char, c_int, c_void};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::mpi::ffi;

use crate::communicator::OpInfo;
use crate::error::CommError;
use crate::trace::CollectiveKind;

/// Header words before every payload.
pub(crate) const HEADER_WORDS: usize = 5;
/// Header bytes (payloads start 8-byte aligned after it).
pub(crate) const HEADER_BYTES: usize = HEADER_WORDS * 8;
/// How long a waiting device polls back to back (yielding its core between polls) before it
/// starts to sleep between polls. MPI moves large messages only while someone polls (no progress
/// thread), so sleeping early costs bandwidth: 200 µs naps gave 0.6 GB/s at 64 MiB.
const SPIN: Duration = Duration::from_millis(10);
/// The longest sleep between two polls once spinning is over.
const MAX_NAP: Duration = Duration::from_micros(200);

/// The MPI communicator handle, shareable between device threads.
#[derive(Clone, Copy)]
pub(crate) struct RawComm(pub(crate) ffi::MPI_Comm);

// SAFETY: MPI is initialised with `MPI_THREAD_MULTIPLE` (checked in `MpiCluster::init`), which
// lets any thread use a communicator handle concurrently; the handle itself is an opaque pointer
// that MPI owns and frees only at `MpiCluster` drop, after every device thread has joined.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

/// Bytes this process's devices sent through MPI, by where they went (payload only).
#[derive(Default, Debug)]
pub(crate) struct Counters {
    pub(crate) to_other_processes: AtomicU64,
    pub(crate) within_process: AtomicU64,
}

/// A message to send: its destination device and the staging buffer it comes from.
struct Outgoing {
    dest: usize,
    buffer: usize,
}

/// Staging buffers kept between collectives: a fresh multi-MiB allocation per message costs a
/// page fault per 4 KiB on first touch (most of a large all-reduce's time before the pool).
struct Pool {
    free: Vec<Vec<u64>>,
    /// Buffers kept at most (the largest are kept).
    keep: usize,
}

/// Buffers the pool of whole messages keeps at most.
const POOL_BUFFERS: usize = 16;
/// Buffers the pool of pipeline parts keeps at most: parts are 64–256 KiB under the default
/// eager limit, and a pipelined collective has about 2 MiB of them in flight per peer and lane.
const PART_BUFFERS: usize = 96;

impl Default for Pool {
    fn default() -> Pool {
        Pool {
            free: Vec::new(),
            keep: POOL_BUFFERS,
        }
    }
}

impl Pool {
    /// A buffer of exactly `words` words (contents unspecified but initialised): the smallest free
    /// one that fits, else the largest grown.
    fn take(&mut self, words: usize) -> Vec<u64> {
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

    fn give(&mut self, buffers: impl IntoIterator<Item = Vec<u64>>) {
        self.free.extend(buffers);
        if self.free.len() > self.keep {
            self.free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
            self.free.truncate(self.keep);
        }
    }
}

/// Everything one device sends in one step of a collective (get one from
/// [`Transport::outbox`], which lends it the pooled buffers).
pub(crate) struct Outbox {
    buffers: Vec<Vec<u64>>,
    messages: Vec<Outgoing>,
    pool: Pool,
}

impl Outbox {
    /// Stages `payload` (raw bytes) behind the header; returns its buffer's index.
    pub(crate) fn stage(&mut self, header: [u64; HEADER_WORDS], payload: &[u8]) -> usize {
        let words = HEADER_WORDS + payload.len().div_ceil(8);
        let mut buf = self.pool.take(words);
        buf[..HEADER_WORDS].copy_from_slice(&header);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        bytes[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
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
    buf: Vec<u64>,
    len: usize,
}

impl Received {
    /// The payload bytes (8-byte aligned).
    pub(crate) fn payload(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.buf)[HEADER_BYTES..HEADER_BYTES + self.len]
    }
}

/// One device's end of the MPI transport.
pub(crate) struct Transport {
    comm: RawComm,
    device: usize,
    per_process: usize,
    timeout: Duration,
    counters: Arc<Counters>,
    broken: Option<CommError>,
    pool: Pool,
    /// Staging buffers of pipeline parts (see [`Flight`]).
    parts: Pool,
}

/// The header a message of step `stage` of `op`, sent by `sender`, carries.
pub(crate) fn header(
    op: &OpInfo,
    stage: u8,
    payload_bytes: usize,
    sender: usize,
) -> [u64; HEADER_WORDS] {
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
) -> [u64; HEADER_WORDS] {
    [
        op.seq,
        ((part as u64) << 16) | (u64::from(kind_code(op.kind)) << 8) | u64::from(stage),
        payload_bytes as u64,
        sender as u64,
        op.elements as u64,
    ]
}

fn kind_code(kind: CollectiveKind) -> u8 {
    match kind {
        CollectiveKind::AllReduce => 1,
        CollectiveKind::ReduceScatter => 2,
        CollectiveKind::AllGather => 3,
        CollectiveKind::AllToAll => 4,
        CollectiveKind::Broadcast => 5,
        CollectiveKind::Barrier => 6,
    }
}

impl Transport {
    pub(crate) fn new(
        comm: RawComm,
        device: usize,
        per_process: usize,
        timeout: Duration,
        counters: Arc<Counters>,
    ) -> Transport {
        Transport {
            comm,
            device,
            per_process: per_process.max(1),
            timeout,
            counters,
            broken: None,
            pool: Pool::default(),
            parts: Pool {
                free: Vec::new(),
                keep: PART_BUFFERS,
            },
        }
    }

    /// An empty outbox that stages into this transport's pooled buffers.
    pub(crate) fn outbox(&mut self) -> Outbox {
        Outbox {
            buffers: Vec::new(),
            messages: Vec::new(),
            pool: std::mem::take(&mut self.pool),
        }
    }

    /// Returns received messages' buffers to the pool.
    pub(crate) fn recycle(&mut self, received: Vec<Received>) {
        self.pool.give(received.into_iter().map(|r| r.buf));
    }

    fn process_of(&self, device: usize) -> c_int {
        (device / self.per_process) as c_int
    }

    fn tag(&self, from: usize, to: usize) -> c_int {
        self.lane_tag(from, to, 0)
    }

    /// The tag of lane `lane` from `from` to `to`: lane 0 is [`Transport::tag`], every lane its
    /// own ordered stream between the pair.
    fn lane_tag(&self, from: usize, to: usize, lane: usize) -> c_int {
        let l = self.per_process;
        ((lane * l + from % l) * l + to % l) as c_int
    }

    /// Sends every message of `outbox` and receives one message of `payload_bytes` from each of
    /// `sources`, all at once; returns the received payloads in `sources` order. Every message's
    /// header must be `header(op, stage, bytes, source)`.
    ///
    /// # Errors
    /// [`CommError::Timeout`] naming the sources still missing; [`CommError::Mismatch`] when a
    /// header (or length) is not the expected one; [`CommError::Transport`] for MPI errors;
    /// [`CommError::GroupBroken`] after any earlier failure.
    pub(crate) fn exchange(
        &mut self,
        op: &OpInfo,
        stage: u8,
        outbox: Outbox,
        sources: &[(usize, usize)],
    ) -> Result<Vec<Received>, CommError> {
        if let Some(err) = &self.broken {
            return Err(CommError::GroupBroken {
                group: op.group.clone(),
                cause: err.to_string(),
            });
        }
        let result = self.exchange_inner(op, stage, outbox, sources);
        if let Err(err) = &result {
            self.broken = Some(err.clone());
        }
        result
    }

    fn exchange_inner(
        &mut self,
        op: &OpInfo,
        stage: u8,
        mut outbox: Outbox,
        sources: &[(usize, usize)],
    ) -> Result<Vec<Received>, CommError> {
        self.pool = std::mem::take(&mut outbox.pool);
        let transport_err = |detail: String| CommError::Transport {
            kind: op.kind,
            seq: op.seq,
            detail,
        };
        let mut sends: Vec<ffi::MPI_Request> = Vec::with_capacity(outbox.messages.len());
        for message in &outbox.messages {
            let buf = &outbox.buffers[message.buffer];
            let bytes = buf.len() * 8;
            let count = c_int::try_from(bytes).map_err(|_| {
                transport_err(format!(
                    "a message of {bytes} bytes exceeds MPI's int count"
                ))
            })?;
            // SAFETY: `RSMPI_REQUEST_NULL` is an immutable MPI constant.
            let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: the send buffer is owned by `outbox`, which is leaked if we stop waiting
            // before the request completes; MPI only reads it.
            let rc = unsafe {
                ffi::MPI_Isend(
                    buf.as_ptr().cast::<c_void>(),
                    count,
                    ffi::RSMPI_UINT8_T,
                    self.process_of(message.dest),
                    self.tag(self.device, message.dest),
                    self.comm.0,
                    &mut request,
                )
            };
            if let Err(detail) = check(rc) {
                // Earlier sends are live: MPI may still read their buffers.
                std::mem::forget(outbox);
                return Err(transport_err(detail));
            }
            sends.push(request);
            let counter = if self.process_of(message.dest) == self.process_of(self.device) {
                &self.counters.within_process
            } else {
                &self.counters.to_other_processes
            };
            counter.fetch_add(buf[2], Ordering::Relaxed);
        }
        // Receives are posted only once their message is matched (`MPI_Improbe`), into a buffer
        // of exactly the probed size: a peer that sends more than expected (a diverged program)
        // can never make MPI write past a buffer. The matched message is received by that
        // handle (`MPI_Imrecv`), so no other thread can take it in between.
        // SAFETY: `RSMPI_REQUEST_NULL` is an immutable MPI constant.
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        let mut receives: Vec<ffi::MPI_Request> = vec![null; sources.len()];
        let mut inbox: Vec<Vec<u64>> = sources.iter().map(|_| Vec::new()).collect();
        let mut sizes: Vec<Option<usize>> = vec![None; sources.len()];
        // SAFETY: an `MPI_Status` is a plain C struct of integers; all-zero is a valid value.
        let zero_status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        let mut send_statuses = vec![zero_status; sends.len()];
        let mut recv_statuses = vec![zero_status; receives.len()];
        let started = Instant::now();
        let mut naps = 0u64;
        loop {
            let matched = self.match_receives(sources, &mut receives, &mut inbox, &mut sizes);
            let done = matched.and_then(|all_matched| {
                let sent = test_all(&mut sends, &mut send_statuses)?;
                let got = test_all(&mut receives, &mut recv_statuses)?;
                Ok(all_matched && sent && got)
            });
            match done {
                Ok(true) => break,
                Ok(false) => {}
                Err(detail) => {
                    // MPI may still write the receive buffers and read the send buffers.
                    std::mem::forget(inbox);
                    std::mem::forget(outbox);
                    return Err(transport_err(detail));
                }
            }
            if started.elapsed() >= self.timeout {
                let missing = still_missing(&mut receives, &sizes, sources);
                // MPI may still write the receive buffers and read the send buffers.
                std::mem::forget(inbox);
                std::mem::forget(outbox);
                return Err(CommError::Timeout {
                    kind: op.kind,
                    seq: op.seq,
                    axes: op.axes.clone(),
                    waited: started.elapsed(),
                    missing,
                });
            }
            if started.elapsed() < SPIN {
                std::thread::yield_now();
            } else {
                naps += 1;
                std::thread::sleep(Duration::from_micros(naps.min(200)).min(MAX_NAP));
            }
        }
        self.pool.give(outbox.buffers);
        let mut received = Vec::with_capacity(sources.len());
        let mut mismatch = None;
        for ((&(source, bytes), buf), size) in sources.iter().zip(inbox).zip(sizes) {
            let size = size.unwrap_or(0);
            let expected = header(op, stage, bytes, source);
            let got: [u64; HEADER_WORDS] = buf
                .get(..HEADER_WORDS)
                .and_then(|h| h.try_into().ok())
                .unwrap_or_default();
            if mismatch.is_none() && (size != message_bytes(bytes) || got != expected) {
                mismatch = Some(CommError::Mismatch {
                    seq: op.seq,
                    device: self.device,
                    mine: format!(
                        "{} (expecting {bytes} bytes in step {stage})",
                        op.describe()
                    ),
                    other_device: source,
                    theirs: describe_header(&got, size),
                });
            }
            received.push(Received { buf, len: bytes });
        }
        match mismatch {
            Some(err) => {
                self.recycle(received);
                Err(err)
            }
            None => Ok(received),
        }
    }

    /// Matches the next message of every source without a receive yet and posts its receive
    /// into a buffer of the probed size. Returns whether every source is matched.
    fn match_receives(
        &mut self,
        sources: &[(usize, usize)],
        receives: &mut [ffi::MPI_Request],
        inbox: &mut [Vec<u64>],
        sizes: &mut [Option<usize>],
    ) -> Result<bool, String> {
        let mut all = true;
        for (k, &(source, bytes)) in sources.iter().enumerate() {
            if sizes[k].is_some() {
                continue;
            }
            let mut found: c_int = 0;
            // SAFETY: `RSMPI_MESSAGE_NULL` is an immutable MPI constant.
            let mut message = unsafe { ffi::RSMPI_MESSAGE_NULL };
            // SAFETY: as above, all-zero is a valid `MPI_Status`.
            let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
            // SAFETY: the out-pointers point to live locals; the communicator handle is live
            // (see `RawComm`).
            let rc = unsafe {
                ffi::MPI_Improbe(
                    self.process_of(source),
                    self.tag(source, self.device),
                    self.comm.0,
                    &mut found,
                    &mut message,
                    &mut status,
                )
            };
            check(rc)?;
            if found == 0 {
                all = false;
                continue;
            }
            let mut count: c_int = 0;
            // SAFETY: `status` was filled by the successful matched probe.
            let rc = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
            check(rc)?;
            // MPI_UNDEFINED (negative) cannot happen for bytes; treat it as an empty message.
            let size = usize::try_from(count).unwrap_or(0);
            let words = size.div_ceil(8);
            let buf = if size == message_bytes(bytes) {
                self.pool.take(words)
            } else {
                // A message of the wrong size: receive it whole (its header names the sender's
                // collective) into a buffer of its own size.
                let mut buf = Vec::new();
                buf.try_reserve_exact(words).map_err(|_| {
                    format!(
                        "a mismatched message of {size} bytes from device {source} does not fit \
                         in memory"
                    )
                })?;
                buf.resize(words, 0);
                buf
            };
            inbox[k] = buf;
            sizes[k] = Some(size);
            // SAFETY: the buffer holds `words * 8 >= count` bytes and is owned by `inbox`, which
            // is leaked (never freed) if we stop waiting before the request completes; `message`
            // is the handle the matched probe returned, consumed here.
            let rc = unsafe {
                ffi::MPI_Imrecv(
                    inbox[k].as_mut_ptr().cast::<c_void>(),
                    count,
                    ffi::RSMPI_UINT8_T,
                    &mut message,
                    &mut receives[k],
                )
            };
            check(rc)?;
        }
        Ok(all)
    }
}

/// A staged message: header and payload in a buffer MPI may read while its sends are in flight;
/// shared by the sends of one payload to several devices.
pub(crate) type Staged = Rc<Vec<u64>>;

/// What a [`Flight`] reports back: a send that completed or a receive that completed with the
/// expected header, each with the token it was posted with.
pub(crate) enum Event<K> {
    Sent(K),
    Received(K, Received),
}

/// One request in flight and what it owns.
enum Slot<K> {
    Send {
        token: K,
        buf: Staged,
    },
    Receive {
        token: K,
        source: usize,
        stage: u8,
        expected: [u64; HEADER_WORDS],
        payload: usize,
        size: usize,
        buf: Vec<u64>,
    },
}

/// Many non-blocking messages of one collective in flight at once, posted and completed one by
/// one (the pipelined algorithms' building block; [`Transport::exchange`] is one step at once).
///
/// The same rules as [`Transport::exchange`]: every message carries a header that the receiver
/// checks ([`CommError::Mismatch`]); receives are posted only once matched (`MPI_Improbe`) into a
/// buffer of the probed size; MPI only touches staging buffers owned here. Dropping a flight
/// with requests still live leaks their buffers (MPI may still touch them), and every error
/// marks the transport broken.
pub(crate) struct Flight<'t, K> {
    transport: &'t mut Transport,
    op: &'t OpInfo,
    requests: Vec<ffi::MPI_Request>,
    slots: Vec<Slot<K>>,
    indices: Vec<c_int>,
    statuses: Vec<ffi::MPI_Status>,
    started: Instant,
    last_progress: Instant,
    naps: u64,
}

impl Transport {
    /// A flight of messages for `op`.
    ///
    /// # Errors
    /// [`CommError::GroupBroken`] after any earlier failure of this transport.
    pub(crate) fn flight<'t, K: Copy>(
        &'t mut self,
        op: &'t OpInfo,
    ) -> Result<Flight<'t, K>, CommError> {
        if let Some(err) = &self.broken {
            return Err(CommError::GroupBroken {
                group: op.group.clone(),
                cause: err.to_string(),
            });
        }
        let now = Instant::now();
        Ok(Flight {
            transport: self,
            op,
            requests: Vec::new(),
            slots: Vec::new(),
            indices: Vec::new(),
            statuses: Vec::new(),
            started: now,
            last_progress: now,
            naps: 0,
        })
    }
}

impl<K: Copy> Flight<'_, K> {
    /// Records `err` as the transport's failure and returns it.
    fn fail(&mut self, err: CommError) -> CommError {
        self.transport.broken = Some(err.clone());
        err
    }

    fn transport_err(&mut self, detail: String) -> CommError {
        let err = CommError::Transport {
            kind: self.op.kind,
            seq: self.op.seq,
            detail,
        };
        self.fail(err)
    }

    /// Stages `header` and `payload` (raw bytes) in a pooled part buffer.
    pub(crate) fn stage(&mut self, header: [u64; HEADER_WORDS], payload: &[u8]) -> Staged {
        let mut buf = self
            .transport
            .parts
            .take(HEADER_WORDS + payload.len().div_ceil(8));
        buf[..HEADER_WORDS].copy_from_slice(&header);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        bytes[HEADER_BYTES..HEADER_BYTES + payload.len()].copy_from_slice(payload);
        Rc::new(buf)
    }

    /// Sends `buf` to device `dest` on lane `lane`; [`Event::Sent`] with `token` when done.
    pub(crate) fn send(
        &mut self,
        dest: usize,
        lane: usize,
        buf: &Staged,
        token: K,
    ) -> Result<(), CommError> {
        let bytes = buf.len() * 8;
        let Ok(count) = c_int::try_from(bytes) else {
            return Err(self.transport_err(format!(
                "a message of {bytes} bytes exceeds MPI's int count"
            )));
        };
        // SAFETY: `RSMPI_REQUEST_NULL` is an immutable MPI constant.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        let t = &*self.transport;
        // SAFETY: the buffer is kept alive by the `Rc` stored with the request below until the
        // request completes, or leaked (never freed) if the flight is dropped before; nothing
        // writes it while shared (`Staged` is only read); MPI only reads it.
        let rc = unsafe {
            ffi::MPI_Isend(
                buf.as_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_UINT8_T,
                t.process_of(dest),
                t.lane_tag(t.device, dest, lane),
                t.comm.0,
                &mut request,
            )
        };
        if let Err(detail) = check(rc) {
            return Err(self.transport_err(detail));
        }
        self.requests.push(request);
        self.slots.push(Slot::Send {
            token,
            buf: buf.clone(),
        });
        let counter = if t.process_of(dest) == t.process_of(t.device) {
            &t.counters.within_process
        } else {
            &t.counters.to_other_processes
        };
        counter.fetch_add(buf[2], Ordering::Relaxed);
        Ok(())
    }

    /// Matches the next message from `source` on lane `lane`, if one has arrived, and posts its
    /// receive into a buffer of the probed size; returns whether one was matched. The message
    /// must carry `expected` (step `stage`) and `payload` bytes: when it completes,
    /// [`Flight::poll`] reports it or a [`CommError::Mismatch`].
    pub(crate) fn probe(
        &mut self,
        source: usize,
        lane: usize,
        stage: u8,
        expected: [u64; HEADER_WORDS],
        payload: usize,
        token: K,
    ) -> Result<bool, CommError> {
        let mut found: c_int = 0;
        // SAFETY: `RSMPI_MESSAGE_NULL` is an immutable MPI constant.
        let mut message = unsafe { ffi::RSMPI_MESSAGE_NULL };
        // SAFETY: an `MPI_Status` is a plain C struct of integers; all-zero is a valid value.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        let t = &*self.transport;
        // SAFETY: the out-pointers point to live locals; the communicator handle is live (see
        // `RawComm`).
        let rc = unsafe {
            ffi::MPI_Improbe(
                t.process_of(source),
                t.lane_tag(source, t.device, lane),
                t.comm.0,
                &mut found,
                &mut message,
                &mut status,
            )
        };
        if let Err(detail) = check(rc) {
            return Err(self.transport_err(detail));
        }
        if found == 0 {
            return Ok(false);
        }
        let mut count: c_int = 0;
        // SAFETY: `status` was filled by the successful matched probe.
        let rc = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
        if let Err(detail) = check(rc) {
            return Err(self.transport_err(detail));
        }
        // MPI_UNDEFINED (negative) cannot happen for bytes; treat it as an empty message.
        let size = usize::try_from(count).unwrap_or(0);
        let words = size.div_ceil(8);
        let mut buf = if size == message_bytes(payload) {
            self.transport.parts.take(words)
        } else {
            // A message of the wrong size: receive it whole (its header names the sender's
            // collective) into a buffer of its own size.
            let mut buf = Vec::new();
            if buf.try_reserve_exact(words).is_err() {
                return Err(self.transport_err(format!(
                    "a mismatched message of {size} bytes from device {source} does not fit in \
                     memory"
                )));
            }
            buf.resize(words, 0);
            buf
        };
        // SAFETY: `RSMPI_REQUEST_NULL` is an immutable MPI constant.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the buffer holds `words * 8 >= count` bytes; it moves into `self.slots` below
        // (moving a `Vec` does not move its heap allocation) and is freed only after the request
        // completes, or leaked if the flight is dropped before; `message` is the handle the
        // matched probe returned, consumed here.
        let rc = unsafe {
            ffi::MPI_Imrecv(
                buf.as_mut_ptr().cast::<c_void>(),
                count,
                ffi::RSMPI_UINT8_T,
                &mut message,
                &mut request,
            )
        };
        if let Err(detail) = check(rc) {
            // Whether MPI took the buffer is unknown: leak it.
            std::mem::forget(buf);
            return Err(self.transport_err(detail));
        }
        self.requests.push(request);
        self.slots.push(Slot::Receive {
            token,
            source,
            stage,
            expected,
            payload,
            size,
            buf,
        });
        Ok(true)
    }

    /// Tests every request in flight and appends the completed ones to `events`; returns whether
    /// any completed.
    ///
    /// # Errors
    /// [`CommError::Mismatch`] for a received message whose header or length is not the
    /// expected one; [`CommError::Transport`] for MPI errors.
    pub(crate) fn poll(&mut self, events: &mut Vec<Event<K>>) -> Result<bool, CommError> {
        if self.requests.is_empty() {
            return Ok(false);
        }
        let n = self.requests.len();
        let Ok(count) = c_int::try_from(n) else {
            return Err(self.transport_err("too many requests".into()));
        };
        self.indices.resize(n, 0);
        // SAFETY: as above, all-zero is a valid `MPI_Status`.
        self.statuses.resize(n, unsafe { std::mem::zeroed() });
        let mut done: c_int = 0;
        // SAFETY: `requests`, `indices` and `statuses` hold `count` elements and stay alive for
        // the call; completed requests are set to MPI_REQUEST_NULL by MPI.
        let rc = unsafe {
            ffi::MPI_Testsome(
                count,
                self.requests.as_mut_ptr(),
                &mut done,
                self.indices.as_mut_ptr(),
                self.statuses.as_mut_ptr(),
            )
        };
        if rc != ffi::MPI_SUCCESS as c_int {
            let detail = self.statuses[..usize::try_from(done).unwrap_or(0).min(n)]
                .iter()
                .map(|s| s.MPI_ERROR)
                .find(|&e| e != ffi::MPI_SUCCESS as c_int)
                .map_or_else(|| error_string(rc), error_string);
            return Err(self.transport_err(detail));
        }
        // MPI_UNDEFINED (no active request) or 0: nothing completed.
        let done = usize::try_from(done).unwrap_or(0).min(n);
        if done == 0 {
            return Ok(false);
        }
        let mut completed: Vec<usize> = self.indices[..done]
            .iter()
            .filter_map(|&i| usize::try_from(i).ok())
            .filter(|&i| i < n)
            .collect();
        completed.sort_unstable_by(|a, b| b.cmp(a));
        let mut mismatch = None;
        let mut arrived = Vec::new();
        for i in completed {
            self.requests.swap_remove(i);
            match self.slots.swap_remove(i) {
                Slot::Send { token, buf } => {
                    if let Ok(buf) = Rc::try_unwrap(buf) {
                        self.transport.parts.give([buf]);
                    }
                    events.push(Event::Sent(token));
                }
                Slot::Receive {
                    token,
                    source,
                    stage,
                    expected,
                    payload,
                    size,
                    buf,
                } => {
                    let got: [u64; HEADER_WORDS] = buf
                        .get(..HEADER_WORDS)
                        .and_then(|h| h.try_into().ok())
                        .unwrap_or_default();
                    if size != message_bytes(payload) || got != expected {
                        mismatch.get_or_insert_with(|| CommError::Mismatch {
                            seq: self.op.seq,
                            device: self.transport.device,
                            mine: format!(
                                "{} (expecting {payload} bytes in step {stage}, part {})",
                                self.op.describe(),
                                expected[1] >> 16
                            ),
                            other_device: source,
                            theirs: describe_header(&got, size),
                        });
                    } else {
                        arrived.push((token, Received { buf, len: payload }));
                    }
                }
            }
        }
        events.extend(arrived.into_iter().map(|(t, r)| Event::Received(t, r)));
        self.last_progress = Instant::now();
        self.naps = 0;
        match mismatch {
            Some(err) => Err(self.fail(err)),
            None => Ok(true),
        }
    }

    /// Returns a received message's buffer to the part pool.
    pub(crate) fn recycle(&mut self, received: Received) {
        self.transport.parts.give([received.buf]);
    }

    /// Whether requests are still in flight.
    pub(crate) fn busy(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Called when a round of work made no progress: fails with [`CommError::Timeout`] naming
    /// `missing()` once the transport's timeout has passed since the flight started, else
    /// yields the core (or, after a while without progress, naps briefly).
    pub(crate) fn idle(&mut self, missing: impl FnOnce() -> Vec<usize>) -> Result<(), CommError> {
        let waited = self.started.elapsed();
        if waited >= self.transport.timeout {
            let err = CommError::Timeout {
                kind: self.op.kind,
                seq: self.op.seq,
                axes: self.op.axes.clone(),
                waited,
                missing: missing(),
            };
            return Err(self.fail(err));
        }
        if self.last_progress.elapsed() < SPIN {
            std::thread::yield_now();
        } else {
            self.naps += 1;
            std::thread::sleep(Duration::from_micros(self.naps.min(200)).min(MAX_NAP));
        }
        Ok(())
    }
}

impl<K> Drop for Flight<'_, K> {
    fn drop(&mut self) {
        // Requests still live (an error or timeout stopped the collective): MPI may still read
        // or write their buffers, so they are never freed. Completed ones were removed by `poll`.
        for slot in self.slots.drain(..) {
            match slot {
                Slot::Send { buf, .. } => std::mem::forget(buf),
                Slot::Receive { buf, .. } => std::mem::forget(buf),
            }
        }
        if !self.requests.is_empty() && self.transport.broken.is_none() {
            self.transport.broken = Some(CommError::Transport {
                kind: self.op.kind,
                seq: self.op.seq,
                detail: "a collective stopped with messages in flight".into(),
            });
        }
    }
}

/// Bytes of a message with `payload` payload bytes (header and padding to whole words).
fn message_bytes(payload: usize) -> usize {
    (HEADER_WORDS + payload.div_ceil(8)) * 8
}

/// Tests every request (null requests count as complete); `Err` with MPI's message on failure.
fn test_all(
    requests: &mut [ffi::MPI_Request],
    statuses: &mut [ffi::MPI_Status],
) -> Result<bool, String> {
    if requests.is_empty() {
        return Ok(true);
    }
    let mut done: c_int = 0;
    let len = c_int::try_from(requests.len()).map_err(|_| "too many requests".to_string())?;
    // SAFETY: `requests` and `statuses` have the same length and stay alive for the call.
    let rc =
        unsafe { ffi::MPI_Testall(len, requests.as_mut_ptr(), &mut done, statuses.as_mut_ptr()) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(statuses
            .iter()
            .map(|s| s.MPI_ERROR)
            .find(|&e| e != ffi::MPI_SUCCESS as c_int)
            .map_or_else(|| error_string(rc), error_string));
    }
    Ok(done != 0)
}

/// The sources whose message has not arrived or not completed (tests each once more).
fn still_missing(
    receives: &mut [ffi::MPI_Request],
    sizes: &[Option<usize>],
    sources: &[(usize, usize)],
) -> Vec<usize> {
    let mut missing = Vec::new();
    for ((request, size), &(source, _)) in receives.iter_mut().zip(sizes).zip(sources) {
        if size.is_none() {
            missing.push(source);
            continue;
        }
        let mut done: c_int = 0;
        // SAFETY: a live (or already null) request handle; the status is ignored.
        unsafe { ffi::MPI_Test(request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
        if done == 0 {
            missing.push(source);
        }
    }
    missing
}

fn check(rc: c_int) -> Result<(), String> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(error_string(rc))
    }
}

/// MPI's text for an error code.
pub(crate) fn error_string(code: c_int) -> String {
    let mut text = vec![0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters, as the call requires.
    let rc = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    let bytes: Vec<u8> = text[..len.max(0) as usize]
        .iter()
        .map(|&c| c as u8)
        .collect();
    format!(
        "{} (MPI error code {code})",
        String::from_utf8_lossy(&bytes)
    )
}

fn describe_header(h: &[u64; HEADER_WORDS], received: usize) -> String {
    let kind = match (h[1] >> 8) & 0xff {
        1 => "all_reduce",
        2 => "reduce_scatter",
        3 => "all_gather",
        4 => "all_to_all",
        5 => "broadcast",
        6 => "barrier",
        _ => "an unknown collective",
    };
    format!(
        "{kind} #{} of {} elements (step {}, part {}, {} payload bytes; message of {received} \
         bytes)",
        h[0],
        h[4],
        h[1] & 0xff,
        h[1] >> 16,
        h[2]
    )
}

/// Why [`all_gather_pairs`] failed.
pub(crate) enum GatherError {
    /// These processes' values did not arrive within the timeout.
    Missing {
        missing: Vec<usize>,
        waited: Duration,
    },
    /// MPI reported an error.
    Transport(String),
}

/// The tag of start-up agreements (on their own communicator, so it meets no collective's).
const AGREE_TAG: c_int = 1;

/// Every process's `mine`, in process order, on every process: point-to-point messages to and
/// from every other process of `comm` (`processes` of them, this one `me`), waited on for at most
/// `timeout`. Unlike `MPI_Allgather` this never waits without bound and names who is missing.
pub(crate) fn all_gather_pairs(
    comm: RawComm,
    me: usize,
    processes: usize,
    mine: [u64; 2],
    timeout: Duration,
) -> Result<Vec<[u64; 2]>, GatherError> {
    let count = c_int::try_from(processes)
        .map_err(|_| GatherError::Transport(format!("{processes} processes exceed an MPI rank")))?;
    let mut all = vec![[0u64; 2]; processes];
    if let Some(slot) = all.get_mut(me) {
        *slot = mine;
    }
    let outgoing = Box::new(mine);
    // SAFETY: `RSMPI_REQUEST_NULL` is an immutable MPI constant.
    let null = unsafe { ffi::RSMPI_REQUEST_NULL };
    let mut receives = vec![null; processes];
    let mut sends = vec![null; processes];
    let base = all.as_mut_ptr();
    let posted = (0..count).filter(|&p| p as usize != me).try_for_each(|p| {
        let k = p as usize;
        // SAFETY: `base.add(k)` is element `k < processes` of `all`, two `u64`s, written only by
        // this receive; `all` is leaked (never freed) if we stop waiting before it completes.
        let rc = unsafe {
            ffi::MPI_Irecv(
                base.add(k).cast::<c_void>(),
                2,
                ffi::RSMPI_UINT64_T,
                p,
                AGREE_TAG,
                comm.0,
                &mut receives[k],
            )
        };
        check(rc)?;
        // SAFETY: `outgoing` holds two `u64`s, only read by MPI, and is leaked (never freed) if
        // we stop waiting before the send completes.
        let rc = unsafe {
            ffi::MPI_Isend(
                outgoing.as_ptr().cast::<c_void>(),
                2,
                ffi::RSMPI_UINT64_T,
                p,
                AGREE_TAG,
                comm.0,
                &mut sends[k],
            )
        };
        check(rc)
    });
    // SAFETY: as above, all-zero is a valid `MPI_Status`.
    let zero_status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
    let mut statuses = vec![zero_status; processes];
    let started = Instant::now();
    let outcome = posted.and_then(|()| loop {
        let got = test_all(&mut receives, &mut statuses)?;
        if got && test_all(&mut sends, &mut statuses)? {
            break Ok(None);
        }
        if started.elapsed() >= timeout {
            let sizes: Vec<Option<usize>> = vec![Some(0); processes];
            let pairs: Vec<(usize, usize)> = (0..processes).map(|p| (p, 0)).collect();
            let missing = still_missing(&mut receives, &sizes, &pairs);
            break Ok(Some(missing));
        }
        std::thread::sleep(Duration::from_millis(1));
    });
    match outcome {
        Ok(None) => Ok(all),
        Ok(Some(missing)) => {
            // MPI may still write `all` and read `outgoing`.
            std::mem::forget(all);
            std::mem::forget(outgoing);
            Err(GatherError::Missing {
                missing,
                waited: started.elapsed(),
            })
        }
        Err(detail) => {
            std::mem::forget(all);
            std::mem::forget(outgoing);
            Err(GatherError::Transport(detail))
        }
    }
}
