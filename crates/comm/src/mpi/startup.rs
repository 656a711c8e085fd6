//! The start-up agreement's gather: every process's pair of words (a hash and a length), on every
//! process, before any collective runs (`MpiCluster::agree`).
//!
//! # Invariants
//! * **Who posts**: the thread that calls `MpiCluster::agree`, once per agreement, on the cluster's own
//!   control communicator and [`AGREE_TAG`], so these messages never meet a collective's. It
//!   posts one receive from and one send to every other process at once, on the message engine's
//!   calls (`calls`); no headers, no traffic counters (this is not a collective's traffic).
//! * **Who matches**: nothing is probed: each receive names its process and is exactly two
//!   words, the protocol's fixed size, into that process's place of the result (a longer
//!   message is MPI's truncation error, reported as [`GatherError::Transport`]).
//! * **What a timeout means**: unlike `MPI_Allgather` this never waits without bound. The
//!   engine's [`Waiter`] polls every millisecond; once `timeout` has passed since the sends were
//!   posted, [`GatherError::Missing`] names the processes whose value has not arrived (tested
//!   once more). Buffers of requests still live then are leaked, never freed: MPI may still
//!   touch them, and the process is expected to end.

use std::os::raw::c_int;
use std::time::Duration;

use ::mpi::ffi;

use super::calls::{
    null_request, pending, post_receive, post_send, test_all, zero_status, Address, Unit,
};
use super::engine::{Pace, Waiter};
use super::transport::RawComm;
use super::wire::AGREE_TAG;

/// How long the agreement sleeps between two polls.
const POLL_EVERY: Duration = Duration::from_millis(1);

/// Why [`all_gather_pairs`] failed.
pub(crate) enum GatherError {
    /// These processes' values did not arrive within the timeout.
    Missing {
        /// The processes, in order.
        missing: Vec<usize>,
        /// How long this process waited.
        waited: Duration,
    },
    /// MPI reported an error.
    Transport(String),
}

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
    let mut receives = vec![null_request(); processes];
    let mut sends = vec![null_request(); processes];
    let base = all.as_mut_ptr();
    let posted = (0..count).filter(|&p| p as usize != me).try_for_each(|p| {
        let k = p as usize;
        let peer = Address {
            comm,
            process: p,
            tag: AGREE_TAG,
        };
        // SAFETY: `base.add(k)` is element `k < processes` of `all`, two `u64`s, written only by
        // this receive; `all` is leaked (never freed) if we stop waiting before it completes.
        receives[k] = unsafe { post_receive(base.add(k).cast::<u64>(), 2, Unit::Words, peer) }?;
        // SAFETY: `outgoing` holds two `u64`s, only read by MPI, and is leaked (never freed) if
        // we stop waiting before the send completes.
        sends[k] = unsafe { post_send(outgoing.as_ptr(), 2, Unit::Words, peer) }?;
        Ok(())
    });
    let mut waiter = Waiter::new(timeout, Pace::Sleep(POLL_EVERY));
    let outcome = posted.and_then(|()| wait(&mut receives, &mut sends, &mut waiter));
    match outcome {
        Ok(None) => Ok(all),
        Ok(Some(missing)) => {
            // MPI may still write `all` and read `outgoing`.
            std::mem::forget(all);
            std::mem::forget(outgoing);
            Err(GatherError::Missing {
                missing,
                waited: waiter.waited(),
            })
        }
        Err(detail) => {
            std::mem::forget(all);
            std::mem::forget(outgoing);
            Err(GatherError::Transport(detail))
        }
    }
}

/// Polls until every receive and then every send is complete (`None`), or the wait expires:
/// the processes whose receive is still live.
fn wait(
    receives: &mut [ffi::MPI_Request],
    sends: &mut [ffi::MPI_Request],
    waiter: &mut Waiter,
) -> Result<Option<Vec<usize>>, String> {
    let mut statuses = vec![zero_status(); receives.len()];
    loop {
        let got = test_all(receives, &mut statuses)?;
        if got && test_all(sends, &mut statuses)? {
            return Ok(None);
        }
        if waiter.expired().is_some() {
            let missing = (0..receives.len())
                .filter(|&p| pending(&mut receives[p]))
                .collect();
            return Ok(Some(missing));
        }
        waiter.pause();
    }
}
