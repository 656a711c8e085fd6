//! One device's end of the MPI transport: its communicator, addressing, timeout, traffic
//! counters and staging pools. What moves on it: one-shot exchanges (`exchange`) and flights of
//! many messages (`engine`), which both take a [`Transport`] and record its first failure.
//!
//! # Invariants
//! * **Who posts, who matches**: only the device thread that owns a [`Transport`] posts, matches
//!   and tests its messages; its communicator and tags (`wire`) keep other threads' messages
//!   apart.
//! * **The first failure breaks the transport**: it is kept, and every later exchange or flight
//!   fails with [`CommError::GroupBroken`] naming it. Requests still live then keep their buffers
//!   forever (MPI may still touch them); the process is expected to end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ::mpi::ffi;

use crate::backend::OpInfo;
use crate::error::CommError;

use super::buffers::{Outbox, Pool, Received};
use super::wire::Addressing;

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
    /// Payload bytes sent to devices of other processes.
    pub(crate) to_other_processes: AtomicU64,
    /// Payload bytes sent through MPI to devices of this process.
    pub(crate) within_process: AtomicU64,
}

impl Counters {
    /// Counts `bytes` of payload sent within this process or to another one.
    pub(crate) fn add(&self, within_process: bool, bytes: u64) {
        let counter = if within_process {
            &self.within_process
        } else {
            &self.to_other_processes
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// One device's end of the MPI transport.
pub(crate) struct Transport {
    /// The communicator its messages travel on.
    pub(super) comm: RawComm,
    /// This device.
    pub(super) device: usize,
    /// Where devices live and how their messages are tagged.
    pub(super) addressing: Addressing,
    /// How long one exchange or flight may wait.
    pub(super) timeout: Duration,
    /// The process's traffic counters.
    pub(super) counters: Arc<Counters>,
    /// The first failure, after which the transport refuses all work.
    pub(super) broken: Option<CommError>,
    /// Staging buffers of whole messages (one-shot exchanges).
    pub(super) pool: Pool,
    /// Staging buffers of pipeline parts (see [`Flight`]).
    pub(super) parts: Pool,
}

impl Transport {
    /// The transport of `device` on `comm`, with `per_process` devices a process, waiting at most
    /// `timeout` for any one exchange, counting its traffic in `counters`.
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
            addressing: Addressing::new(per_process),
            timeout,
            counters,
            broken: None,
            pool: Pool::whole_messages(),
            parts: Pool::parts(),
        }
    }

    /// An empty outbox that stages into this transport's pooled buffers.
    pub(crate) fn outbox(&mut self) -> Outbox {
        Outbox::new(std::mem::take(&mut self.pool))
    }

    /// Returns received messages' buffers to the pool.
    pub(crate) fn recycle(&mut self, received: Vec<Received>) {
        self.pool.give(received.into_iter().map(|r| r.buf));
    }

    /// `Ok` unless an earlier failure broke the transport ([`CommError::GroupBroken`] for `op`).
    pub(super) fn usable(&self, op: &OpInfo) -> Result<(), CommError> {
        match &self.broken {
            Some(err) => Err(CommError::GroupBroken {
                group: op.group.clone(),
                cause: err.to_string(),
            }),
            None => Ok(()),
        }
    }
}
