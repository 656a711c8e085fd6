//! The MPI message engine: the one place that posts sends, matches and receives messages, tests
//! requests and waits with a timeout. The one-shot exchange (`transport`), the pipelined
//! collectives (`pipeline`) and the start-up agreement (`startup`) are uses of it.
//!
//! Two layers:
//! * **Calls** (`calls`: `post_send`, `post_receive`, `probe`, `receive_matched`, `test_all`,
//!   `pending`) wrap one MPI call each and turn its error code into MPI's text; the start-up
//!   agreement uses them directly (two bare words to and from every process), with a [`Waiter`].
//! * **[`Flight`]** (here): the messages of one collective in flight, each send counted in the
//!   traffic counters, each receive posted once its message is matched, completions reported as
//!   events. Its [`Waiter`] is the one wait loop with a timeout.
//!
//! # Invariants
//! * **Who posts**: the device thread that owns the [`Flight`] (through its `Transport`) posts
//!   every send and receive of it and is the only one to test them; nothing is posted for it by
//!   another thread, and MPI progresses only while that thread polls.
//! * **Who matches**: a receive is posted only once its message has arrived and been matched
//!   (`MPI_Improbe`, on the sender's process and the pair's lane tag), and it is received by that
//!   match's handle (`MPI_Imrecv`), so no other thread can take the message in between. The
//!   buffer is sized from the probe: a message of the expected size gets a pooled buffer, one of
//!   any other size a buffer of its own size (allocated fallibly), so a peer that sends more than
//!   expected is a `CommError::Mismatch`, never a write past a buffer (Open MPI's shared-memory
//!   single-copy path does not truncate).
//! * **Headers are checked on completion**: [`Flight::poll`] fails at the first message whose
//!   header or length is not the expected one; [`Flight::collect`] hands back unchecked
//!   [`Arrival`]s for a caller that checks them in its own order ([`Arrival::check`]).
//! * **What a timeout means**: the [`Waiter`] counts from the start of the wait. Once the
//!   timeout has passed it reports how long it waited and the caller fails with the devices (or
//!   processes) it still waited for; requests still live then are abandoned, never cancelled.
//! * **Buffers of live requests are never freed**: MPI may still read or write them, so a
//!   [`Flight`] dropped with requests live leaks their buffers and marks its transport broken;
//!   every error of a flight marks it broken too, and a broken transport refuses all later work
//!   (the process is expected to end: the launcher aborts the job).

use std::os::raw::c_int;
use std::rc::Rc;
use std::time::{Duration, Instant};

use ::mpi::ffi;

use crate::backend::OpInfo;
use crate::error::CommError;

use super::buffers::{Pool, Received, Staged};
use super::calls::{post_send, probe, receive_matched, test_some, Address, Unit};
use super::transport::Transport;
use super::wire::{describe_header, header_in, message_bytes, part_of, payload_of, Header};

/// How long a waiting device polls back to back (yielding its core between polls) before it
/// starts to sleep between polls. MPI moves large messages only while someone polls (no progress
/// thread), so sleeping early costs bandwidth: 200 µs naps gave 0.6 GB/s at 64 MiB.
const SPIN: Duration = Duration::from_millis(10);
/// The longest sleep between two polls once spinning is over.
const MAX_NAP: Duration = Duration::from_micros(200);

/// How a [`Waiter`] spends the time between two polls.
#[derive(Clone, Copy)]
pub(crate) enum Pace {
    /// Yield the core between polls for [`SPIN`] since the last progress, then nap 1, 2, …
    /// up to 200 µs: collectives, whose large messages move only while someone polls.
    SpinThenNap,
    /// Sleep this long between polls: the start-up agreement, where nothing is urgent.
    Sleep(Duration),
}

/// The one wait loop's clock: a timeout counted from the start of the wait, and the pace of
/// polling until then.
pub(crate) struct Waiter {
    timeout: Duration,
    pace: Pace,
    started: Instant,
    last_progress: Instant,
    naps: u64,
}

impl Waiter {
    /// A wait that starts now and may last `timeout`.
    pub(crate) fn new(timeout: Duration, pace: Pace) -> Waiter {
        let now = Instant::now();
        Waiter {
            timeout,
            pace,
            started: now,
            last_progress: now,
            naps: 0,
        }
    }

    /// Records progress: spinning starts over.
    pub(crate) fn progressed(&mut self) {
        self.last_progress = Instant::now();
        self.naps = 0;
    }

    /// How long the wait has lasted once the timeout has passed; `None` before.
    pub(crate) fn expired(&self) -> Option<Duration> {
        let waited = self.started.elapsed();
        (waited >= self.timeout).then_some(waited)
    }

    /// How long the wait has lasted.
    pub(crate) fn waited(&self) -> Duration {
        self.started.elapsed()
    }

    /// Lets time pass before the next poll, at the wait's pace.
    pub(crate) fn pause(&mut self) {
        match self.pace {
            Pace::SpinThenNap if self.last_progress.elapsed() < SPIN => std::thread::yield_now(),
            Pace::SpinThenNap => {
                self.naps += 1;
                std::thread::sleep(Duration::from_micros(self.naps.min(200)).min(MAX_NAP));
            }
            Pace::Sleep(nap) => std::thread::sleep(nap),
        }
    }
}

/// Which of the transport's pools a flight's buffers come from and go back to.
#[derive(Clone, Copy)]
pub(crate) enum PoolKind {
    /// Whole messages of a one-shot exchange.
    Whole,
    /// Parts of a pipelined collective.
    Parts,
}

/// How a mismatch names the message this device expected.
#[derive(Clone, Copy)]
pub(crate) enum Expecting {
    /// A one-shot exchange's message: its step.
    Step,
    /// A pipelined collective's part: its step and part.
    Part,
}

/// A completed receive whose header is not checked yet.
pub(crate) struct Arrival {
    source: usize,
    stage: u8,
    expected: Header,
    payload: usize,
    size: usize,
    buf: Vec<u64>,
}

impl Arrival {
    /// The received message when its header and length are the expected ones; else the
    /// [`CommError::Mismatch`] that `device`, running `op`, reports, and the buffer to recycle.
    pub(crate) fn check(
        self,
        op: &OpInfo,
        device: usize,
        naming: Expecting,
    ) -> Result<Received, (CommError, Vec<u64>)> {
        let got = header_in(&self.buf);
        if self.size == message_bytes(self.payload) && got == self.expected {
            return Ok(Received {
                buf: self.buf,
                len: self.payload,
            });
        }
        let (payload, stage) = (self.payload, self.stage);
        let mine = match naming {
            Expecting::Step => format!(
                "{} (expecting {payload} bytes in step {stage})",
                op.describe()
            ),
            Expecting::Part => format!(
                "{} (expecting {payload} bytes in step {stage}, part {})",
                op.describe(),
                part_of(&self.expected)
            ),
        };
        let err = CommError::Mismatch {
            seq: op.seq,
            device,
            mine,
            other_device: self.source,
            theirs: describe_header(&got, self.size),
        };
        Err((err, self.buf))
    }
}

/// What a [`Flight`] reports back: a send that completed or a receive that completed with the
/// expected header, each with the token it was posted with.
pub(crate) enum Event<K> {
    /// The send posted with this token completed.
    Sent(K),
    /// The receive posted with this token completed with the expected header.
    Received(K, Received),
}

/// A completion before any header is checked ([`Flight::collect`]).
pub(crate) enum Completion<K> {
    /// The send posted with this token completed.
    Sent(K),
    /// The receive posted with this token completed; its header is unchecked.
    Arrived(K, Arrival),
}

/// One request in flight and what it owns.
enum Slot<K> {
    Send { token: K, buf: Staged },
    Receive { token: K, arrival: Arrival },
}

/// Many non-blocking messages of one collective in flight at once, posted and completed one by
/// one (see the module docs for its rules).
pub(crate) struct Flight<'t, K> {
    transport: &'t mut Transport,
    op: &'t OpInfo,
    pool: PoolKind,
    requests: Vec<ffi::MPI_Request>,
    slots: Vec<Slot<K>>,
    indices: Vec<c_int>,
    statuses: Vec<ffi::MPI_Status>,
    completed: Vec<usize>,
    waiter: Waiter,
}

impl<'t, K: Copy> Flight<'t, K> {
    /// A flight of messages for `op` on `transport`, its buffers from `pool`, its timeout the
    /// transport's, counted from now.
    pub(crate) fn new(transport: &'t mut Transport, op: &'t OpInfo, pool: PoolKind) -> Self {
        let waiter = Waiter::new(transport.timeout, Pace::SpinThenNap);
        Flight {
            transport,
            op,
            pool,
            requests: Vec::new(),
            slots: Vec::new(),
            indices: Vec::new(),
            statuses: Vec::new(),
            completed: Vec::new(),
            waiter,
        }
    }
}

impl<K: Copy> Flight<'_, K> {
    /// Records `err` as the transport's failure and returns it.
    fn fail(&mut self, err: CommError) -> CommError {
        self.transport.broken = Some(err.clone());
        err
    }

    /// An MPI failure of this flight's collective, recorded as the transport's.
    fn transport_err(&mut self, detail: String) -> CommError {
        let err = CommError::Transport {
            kind: self.op.kind,
            seq: self.op.seq,
            detail,
        };
        self.fail(err)
    }

    /// The flight's pool.
    fn pool(&mut self) -> &mut Pool {
        match self.pool {
            PoolKind::Whole => &mut self.transport.pool,
            PoolKind::Parts => &mut self.transport.parts,
        }
    }

    /// The address of `peer`'s end of lane `lane`: messages to it, or with `incoming` from it.
    fn address(&self, peer: usize, lane: usize, incoming: bool) -> Address {
        let t = &*self.transport;
        let (from, to) = if incoming {
            (peer, t.device)
        } else {
            (t.device, peer)
        };
        Address {
            comm: t.comm,
            process: t.addressing.process_of(peer),
            tag: t.addressing.lane_tag(from, to, lane),
        }
    }

    /// Stages `header` and `payload` (raw bytes) in a buffer of the flight's pool.
    pub(crate) fn stage(&mut self, header: Header, payload: &[u8]) -> Staged {
        Rc::new(self.pool().stage(header, payload))
    }

    /// Sends `buf` to device `dest` on lane `lane` and adds its payload bytes to the traffic
    /// counters; [`Event::Sent`] with `token` when done.
    pub(crate) fn send(
        &mut self,
        dest: usize,
        lane: usize,
        buf: &Staged,
        token: K,
    ) -> Result<(), CommError> {
        let to = self.address(dest, lane, false);
        // SAFETY: the buffer is kept alive by the `Rc` stored with the request below until the
        // request completes, or leaked (never freed) if the flight is dropped before; nothing
        // writes it while shared (`Staged` is only read).
        let posted = unsafe { post_send(buf.as_ptr(), buf.len(), Unit::Bytes, to) };
        let request = match posted {
            Ok(request) => request,
            Err(detail) => return Err(self.transport_err(detail)),
        };
        self.requests.push(request);
        self.slots.push(Slot::Send {
            token,
            buf: buf.clone(),
        });
        let t = &*self.transport;
        let within = t.addressing.same_process(dest, t.device);
        t.counters.add(within, payload_of(buf));
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
        expected: Header,
        payload: usize,
        token: K,
    ) -> Result<bool, CommError> {
        let matched = match probe(self.address(source, lane, true)) {
            Ok(Some(matched)) => matched,
            Ok(None) => return Ok(false),
            Err(detail) => return Err(self.transport_err(detail)),
        };
        let size = matched.size;
        let mut buf = match receive_buffer(self.pool(), size, message_bytes(payload), source) {
            Ok(buf) => buf,
            Err(detail) => return Err(self.transport_err(detail)),
        };
        // SAFETY: the buffer holds `size` bytes; it moves into `self.slots` below (moving a `Vec`
        // does not move its heap allocation) and is freed only after the request completes, or
        // leaked if the flight is dropped before.
        let request = match unsafe { receive_matched(matched, &mut buf) } {
            Ok(request) => request,
            Err(detail) => {
                // Whether MPI took the buffer is unknown: leak it.
                std::mem::forget(buf);
                return Err(self.transport_err(detail));
            }
        };
        self.requests.push(request);
        let arrival = Arrival {
            source,
            stage,
            expected,
            payload,
            size,
            buf,
        };
        self.slots.push(Slot::Receive { token, arrival });
        Ok(true)
    }

    /// Tests every request in flight once and appends the completed ones to `out`, unchecked,
    /// a send's buffer back to the pool once its last send completed; returns whether any
    /// completed. Does not count as progress for the wait (see [`Flight::poll`]).
    ///
    /// # Errors
    /// [`CommError::Transport`] for MPI errors.
    pub(crate) fn collect(&mut self, out: &mut Vec<Completion<K>>) -> Result<bool, CommError> {
        match self.test(out) {
            Ok(any) => Ok(any),
            Err(detail) => Err(self.transport_err(detail)),
        }
    }

    /// [`Flight::collect`] that leaves the transport as it is on an MPI error (reported as
    /// nothing completed): a last look before failing for another reason.
    pub(crate) fn settle(&mut self, out: &mut Vec<Completion<K>>) {
        let _ = self.test(out);
    }

    /// `MPI_Testsome` over the flight's requests; see [`Flight::collect`].
    fn test(&mut self, out: &mut Vec<Completion<K>>) -> Result<bool, String> {
        if self.requests.is_empty() {
            return Ok(false);
        }
        let mut completed = std::mem::take(&mut self.completed);
        let tested = test_some(
            &mut self.requests,
            &mut self.indices,
            &mut self.statuses,
            &mut completed,
        );
        for &i in &completed {
            self.requests.swap_remove(i);
            match self.slots.swap_remove(i) {
                Slot::Send { token, buf } => {
                    if let Ok(buf) = Rc::try_unwrap(buf) {
                        self.pool().give([buf]);
                    }
                    out.push(Completion::Sent(token));
                }
                Slot::Receive { token, arrival } => out.push(Completion::Arrived(token, arrival)),
            }
        }
        let any = !completed.is_empty();
        self.completed = completed;
        tested.map(|()| any)
    }

    /// Tests every request in flight and appends the completed ones to `events` (sends first,
    /// then receives); returns whether any completed, which counts as progress for the wait.
    ///
    /// # Errors
    /// [`CommError::Mismatch`] for a received message whose header or length is not the
    /// expected one; [`CommError::Transport`] for MPI errors.
    pub(crate) fn poll(&mut self, events: &mut Vec<Event<K>>) -> Result<bool, CommError> {
        let mut completions = Vec::new();
        if !self.collect(&mut completions)? {
            return Ok(false);
        }
        let mut mismatch = None;
        let mut arrived = Vec::new();
        for completion in completions {
            match completion {
                Completion::Sent(token) => events.push(Event::Sent(token)),
                Completion::Arrived(token, arrival) => {
                    match arrival.check(self.op, self.transport.device, Expecting::Part) {
                        Ok(received) => arrived.push(Event::Received(token, received)),
                        Err((err, _)) => {
                            mismatch.get_or_insert(err);
                        }
                    }
                }
            }
        }
        events.extend(arrived);
        self.waiter.progressed();
        match mismatch {
            Some(err) => Err(self.fail(err)),
            None => Ok(true),
        }
    }

    /// Returns a received message's buffer to the flight's pool.
    pub(crate) fn recycle(&mut self, received: Received) {
        self.pool().give([received.buf]);
    }

    /// Whether requests are still in flight.
    pub(crate) fn busy(&self) -> bool {
        !self.requests.is_empty()
    }

    /// How long the flight has waited once its timeout has passed; `None` before.
    pub(crate) fn expired(&self) -> Option<Duration> {
        self.waiter.expired()
    }

    /// How long the flight has lasted.
    pub(crate) fn waited(&self) -> Duration {
        self.waiter.waited()
    }

    /// Lets time pass before the next poll (see [`Pace::SpinThenNap`]).
    pub(crate) fn pause(&mut self) {
        self.waiter.pause();
    }

    /// The [`CommError::Timeout`] of this flight's collective after `waited`, naming `missing`,
    /// recorded as the transport's failure.
    pub(crate) fn timed_out(&mut self, waited: Duration, missing: Vec<usize>) -> CommError {
        let err = CommError::Timeout {
            kind: self.op.kind,
            seq: self.op.seq,
            axes: self.op.axes.clone(),
            waited,
            missing,
        };
        self.fail(err)
    }

    /// Called when a round of work made no progress: fails with [`CommError::Timeout`] naming
    /// `missing()` once the transport's timeout has passed since the flight started, else
    /// pauses (see [`Pace::SpinThenNap`]).
    pub(crate) fn idle(&mut self, missing: impl FnOnce() -> Vec<usize>) -> Result<(), CommError> {
        if let Some(waited) = self.waiter.expired() {
            return Err(self.timed_out(waited, missing()));
        }
        self.waiter.pause();
        Ok(())
    }
}

impl<K> Drop for Flight<'_, K> {
    fn drop(&mut self) {
        // Requests still live (an error or timeout stopped the collective): MPI may still read
        // or write their buffers, so they are never freed. Completed ones were removed by `test`.
        for slot in self.slots.drain(..) {
            match slot {
                Slot::Send { buf, .. } => std::mem::forget(buf),
                Slot::Receive { arrival, .. } => std::mem::forget(arrival.buf),
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

/// A buffer for a matched message of `size` bytes that should be `expected` bytes: pooled when it
/// is, else one of its own size (received whole, its header names the sender's collective),
/// allocated fallibly since a diverged peer chose its size.
fn receive_buffer(
    pool: &mut Pool,
    size: usize,
    expected: usize,
    source: usize,
) -> Result<Vec<u64>, String> {
    let words = size.div_ceil(8);
    if size == expected {
        return Ok(pool.take(words));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(words).map_err(|_| {
        format!("a mismatched message of {size} bytes from device {source} does not fit in memory")
    })?;
    buf.resize(words, 0);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_spin_then_nap_and_expire_after_their_timeout() {
        let mut w = Waiter::new(Duration::from_millis(30), Pace::SpinThenNap);
        assert!(w.expired().is_none());
        w.pause();
        assert_eq!(w.naps, 0, "spinning yields, it does not nap");
        w.last_progress -= SPIN;
        w.pause();
        w.pause();
        assert_eq!(w.naps, 2);
        w.progressed();
        assert_eq!(w.naps, 0);
        std::thread::sleep(Duration::from_millis(30));
        assert!(w.expired().is_some_and(|d| d >= Duration::from_millis(30)));
        let mut s = Waiter::new(Duration::ZERO, Pace::Sleep(Duration::from_millis(1)));
        assert!(s.expired().is_some());
        s.pause();
        assert_eq!(s.naps, 0);
    }

    #[test]
    fn wrong_sized_messages_get_their_own_buffer() {
        let mut pool = Pool::parts();
        pool.give([vec![0; 64]]);
        let fits = receive_buffer(&mut pool, 80, 80, 3).ok();
        assert!(fits.is_some_and(|b| b.len() == 10 && b.capacity() == 64));
        let other = receive_buffer(&mut pool, 81, 80, 3).ok();
        assert!(other.is_some_and(|b| b.len() == 11));
        let err = receive_buffer(&mut pool, usize::MAX - 7, 80, 3).err();
        assert!(err.is_some_and(|e| e.contains("from device 3 does not fit in memory")));
    }
}
