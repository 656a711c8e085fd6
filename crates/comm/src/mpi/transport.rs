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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ::mpi::ffi;

use crate::communicator::OpInfo;
use crate::error::CommError;
use crate::trace::CollectiveKind;

/// Header words before every payload.
const HEADER_WORDS: usize = 4;
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
#[derive(Default)]
struct Pool {
    free: Vec<Vec<u64>>,
}

/// Buffers the pool keeps at most (the largest are kept).
const POOL_BUFFERS: usize = 16;

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
        if self.free.len() > POOL_BUFFERS {
            self.free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
            self.free.truncate(POOL_BUFFERS);
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
}

/// The header a message of step `stage` of `op`, sent by `sender`, carries.
pub(crate) fn header(op: &OpInfo, stage: u8, payload_bytes: usize, sender: usize) -> [u64; 4] {
    [
        op.seq,
        (u64::from(kind_code(op.kind)) << 8) | u64::from(stage),
        payload_bytes as u64,
        sender as u64,
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
        ((from % self.per_process) * self.per_process + to % self.per_process) as c_int
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
    let kind = match h[1] >> 8 {
        1 => "all_reduce",
        2 => "reduce_scatter",
        3 => "all_gather",
        4 => "all_to_all",
        5 => "broadcast",
        6 => "barrier",
        _ => "an unknown collective",
    };
    format!(
        "{kind} #{} (step {}, {} payload bytes; message of {received} bytes)",
        h[0],
        h[1] & 0xff,
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
