//! The one-shot exchange that most collectives of the MPI backend are one step of, and the
//! flights of the pipelined ones, on a device's [`Transport`].
//!
//! [`Transport::exchange`] posts every send of one step at once and receives one message from
//! each expected source, all on the message engine (`engine`): sends counted in the traffic
//! counters, receives posted once matched into buffers of the probed size, one wait with the
//! transport's timeout. Nothing blocks inside MPI, so a peer that never arrives costs at most the
//! timeout.
//!
//! # Invariants
//! * **An exchange checks headers only once everything has arrived**, in the order of its
//!   sources: the [`CommError::Mismatch`] it reports names the first source (in that order) whose
//!   message is not the expected one, and a source that never sends makes it a
//!   [`CommError::Timeout`] even when another's message was wrong.
//! * **What a timeout means**: the exchange did not complete within the transport's timeout,
//!   counted from the start of the exchange; the error names the sources whose message was not
//!   matched or not fully received (in the order given; none when only sends were left).

use std::rc::Rc;

use crate::backend::OpInfo;
use crate::error::CommError;

use super::buffers::{Outbox, Received};
use super::engine::{Arrival, Completion, Expecting, Flight, PoolKind};
use super::transport::Transport;
use super::wire::header;

/// What a message of an exchange is, in its flight.
#[derive(Clone, Copy)]
enum Token {
    /// One of the outbox's sends.
    Send,
    /// The message from source `k`.
    Receive(usize),
}

impl Transport {
    /// A flight of messages for `op` (the pipelined collectives'), its buffers from the part pool.
    ///
    /// # Errors
    /// [`CommError::GroupBroken`] after any earlier failure of this transport.
    pub(crate) fn flight<'t, K: Copy>(
        &'t mut self,
        op: &'t OpInfo,
    ) -> Result<Flight<'t, K>, CommError> {
        self.usable(op)?;
        Ok(Flight::new(self, op, PoolKind::Parts))
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
        self.usable(op)?;
        let result = self.exchange_inner(op, stage, outbox, sources);
        if let Err(err) = &result {
            self.broken = Some(err.clone());
        }
        result
    }

    /// [`Transport::exchange`] on a usable transport: one flight, its sends posted first, then
    /// rounds of matching, testing and waiting until every message is in, then the headers.
    /// Completions are collected without counting as progress, so the exchange spins for the
    /// first moments of its wait and naps after, however its messages come in.
    fn exchange_inner(
        &mut self,
        op: &OpInfo,
        stage: u8,
        mut outbox: Outbox,
        sources: &[(usize, usize)],
    ) -> Result<Vec<Received>, CommError> {
        self.pool = std::mem::take(&mut outbox.pool);
        let mut flight = Flight::new(self, op, PoolKind::Whole);
        post_outbox(&mut flight, outbox)?;
        let mut arrivals: Vec<Option<Arrival>> = sources.iter().map(|_| None).collect();
        let mut matched = vec![false; sources.len()];
        let mut completions = Vec::new();
        loop {
            let all_matched = match_sources(&mut flight, op, stage, sources, &mut matched)?;
            flight.collect(&mut completions)?;
            file_arrivals(&mut completions, &mut arrivals);
            if all_matched && !flight.busy() {
                break;
            }
            if flight.expired().is_some() {
                // One more look, as a receive may have completed since.
                flight.settle(&mut completions);
                file_arrivals(&mut completions, &mut arrivals);
                let missing = sources
                    .iter()
                    .zip(&arrivals)
                    .filter(|(_, a)| a.is_none())
                    .map(|(&(source, _), _)| source)
                    .collect();
                let waited = flight.waited();
                return Err(flight.timed_out(waited, missing));
            }
            flight.pause();
        }
        drop(flight);
        self.check_arrivals(op, arrivals)
    }

    /// Every source's message once its header is checked, in `sources` order; the first
    /// mismatch (in that order) otherwise, every buffer back in the pool.
    fn check_arrivals(
        &mut self,
        op: &OpInfo,
        arrivals: Vec<Option<Arrival>>,
    ) -> Result<Vec<Received>, CommError> {
        let mut received = Vec::with_capacity(arrivals.len());
        let mut mismatch = None;
        // Every arrival is in: the exchange ended with every source matched and nothing busy.
        for arrival in arrivals.into_iter().flatten() {
            match arrival.check(op, self.device, Expecting::Step) {
                Ok(r) => received.push(r),
                Err((err, buf)) => {
                    mismatch.get_or_insert(err);
                    self.pool.give([buf]);
                }
            }
        }
        match mismatch {
            Some(err) => {
                self.recycle(received);
                Err(err)
            }
            None => Ok(received),
        }
    }
}

/// Posts every send of `outbox`, in order; its buffers go back to the pool as their last send
/// completes (at once for a buffer no send uses).
fn post_outbox(flight: &mut Flight<'_, Token>, outbox: Outbox) -> Result<(), CommError> {
    let staged: Vec<_> = outbox.buffers.into_iter().map(Rc::new).collect();
    for message in &outbox.messages {
        if let Some(buf) = staged.get(message.buffer) {
            flight.send(message.dest, 0, buf, Token::Send)?;
        }
    }
    for buf in staged {
        if let Ok(buf) = Rc::try_unwrap(buf) {
            flight.recycle(Received { buf, len: 0 });
        }
    }
    Ok(())
}

/// Matches the next message of every source not matched yet and posts its receive; returns
/// whether every source is matched.
fn match_sources(
    flight: &mut Flight<'_, Token>,
    op: &OpInfo,
    stage: u8,
    sources: &[(usize, usize)],
    matched: &mut [bool],
) -> Result<bool, CommError> {
    let mut all = true;
    for (k, &(source, bytes)) in sources.iter().enumerate() {
        if matched[k] {
            continue;
        }
        let expected = header(op, stage, bytes, source);
        matched[k] = flight.probe(source, 0, stage, expected, bytes, Token::Receive(k))?;
        all &= matched[k];
    }
    Ok(all)
}

/// Moves the completed receives among `completions` to their source's place in `arrivals`.
fn file_arrivals(completions: &mut Vec<Completion<Token>>, arrivals: &mut [Option<Arrival>]) {
    for completion in completions.drain(..) {
        if let Completion::Arrived(Token::Receive(k), arrival) = completion {
            if let Some(place) = arrivals.get_mut(k) {
                *place = Some(arrival);
            }
        }
    }
}
