//! MPI: devices in several processes, on one host or many (`mpirun -n P ferrotext ...`).
//!
//! [`MpiCluster`] initialises MPI (with `MPI_THREAD_MULTIPLE`: every device thread talks to MPI
//! on its own) and is the [`Cluster`] a run spans: process `p` of `P` runs devices
//! `p·L .. (p+1)·L` of a `P·L`-device mesh. Collectives inside a process stay in shared memory;
//! the others go through non-blocking MPI point-to-point messages. The trace is recorded by the
//! [`crate::Communicator`] front end as for every backend, so an MPI run's trace equals the
//! in-process run's.
//!
//! # Files
//! | file | job |
//! |---|---|
//! | `backend` | which algorithm a collective runs (in-process, flat, hierarchical) |
//! | `pipeline` | the pipelined all-reduce, reduce-scatter and all-gather |
//! | `transport` | one device's end of MPI, and the one-shot exchange (all-to-all, broadcast, barrier) |
//! | `engine` | the message engine every MPI message goes through: sends with their traffic counts, matched receives, the wait with its timeout |
//! | `calls` | the engine's MPI calls, one each (post, probe, receive, test, error text) |
//! | `startup` | the start-up agreement's gather |
//! | `buffers` | staging buffers, their pools, outboxes and received messages |
//! | `wire` | headers, tags and kind codes |
//!
//! # Invariants
//! * Every process must run the same program on the same mesh; [`Cluster::agree`] checks inputs
//!   at start-up, message headers check every collective after that.
//! * Nothing waits inside MPI without a bound: a collective that does not complete within the
//!   run's timeout fails with [`CommError::Timeout`] naming the devices it waited for, a start-up
//!   agreement with [`CommError::ProcessesMissing`] naming the processes. (Only `MPI_Init` and
//!   `MPI_Finalize`, which synchronise inside Open MPI, are out of our hands.) A process
//!   that died is normally reported sooner by `mpirun` itself, which ends the job.
//! * `MpiCluster` must be created and dropped on the main thread (MPI finalises on drop).

mod backend;
mod buffers;
mod calls;
mod eager;
mod engine;
mod exchange;
mod pipeline;
mod startup;
mod transport;
mod wire;

use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ::mpi::environment::Universe;
use ::mpi::ffi;
use ::mpi::raw::AsRaw;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::Communicator as _;
use ::mpi::Threading;

use crate::backend::Backend;
use crate::cluster::Cluster;
use crate::error::CommError;
use crate::local::LocalBackend;

use backend::MpiBackend;
use calls::error_string;
use startup::{all_gather_pairs, GatherError};
use transport::{Counters, RawComm, Transport};

/// A handle on a process's MPI byte counters ([`MpiCluster::traffic_meter`]).
pub struct TrafficMeter(Arc<Counters>);

impl TrafficMeter {
    /// Bytes sent through MPI so far.
    pub fn read(&self) -> MpiTraffic {
        MpiTraffic {
            to_other_processes: self.0.to_other_processes.load(Ordering::Relaxed),
            within_process: self.0.within_process.load(Ordering::Relaxed),
        }
    }
}

/// Bytes this process's devices have sent through MPI since start-up (payload only, headers
/// excluded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpiTraffic {
    /// To devices of other processes: what crosses the network between hosts.
    pub to_other_processes: u64,
    /// To other devices of this process (only flat collectives send these through MPI).
    pub within_process: u64,
}

/// This process's membership in an MPI job (see the module docs).
pub struct MpiCluster {
    // Field order is drop order: the communicators are freed before the universe finalises MPI.
    comm: SimpleCommunicator,
    raw: RawComm,
    /// Start-up agreements' own communicator (their messages never meet a collective's).
    control: SimpleCommunicator,
    /// The background streams' communicator (their messages never meet a blocking
    /// collective's, which run at the same time); kept to be freed in order, used through
    /// `stream_raw`.
    _stream: SimpleCommunicator,
    stream_raw: RawComm,
    process: usize,
    processes: usize,
    on_this_host: usize,
    library: String,
    hierarchical: bool,
    counters: Arc<Counters>,
    _universe: Universe,
}

// SAFETY: MPI runs with `MPI_THREAD_MULTIPLE` (checked in `init`), so its handles may be used from
// any thread concurrently. Device threads only copy the raw communicator handle and update atomic
// counters; the handles are freed on drop, which (documented) happens on the main thread after
// every SPMD run has joined its device threads.
unsafe impl Sync for MpiCluster {}

impl MpiCluster {
    /// True when this process was started by an MPI launcher ([`crate::started_by_mpi_launcher`]).
    pub fn launched_by_mpirun() -> bool {
        crate::started_by_mpi_launcher()
    }

    /// Initialises MPI for this process with full thread support.
    ///
    /// # Errors
    /// When MPI was already initialised, or the library cannot give `MPI_THREAD_MULTIPLE`
    /// ([`CommError::Transport`]).
    pub fn init() -> Result<MpiCluster, CommError> {
        let fail = |detail: String| CommError::Transport {
            kind: crate::CollectiveKind::Barrier,
            seq: 0,
            detail,
        };
        // Parts of pipelined collectives are sent eagerly only under the TCP transport's eager
        // limit (see `eager::part_message_bytes`); ask for ours unless the user set one. This
        // runs before MPI starts and, in the binary, before any other thread does (`main`
        // detects the launch first), as changing the environment requires.
        eager::default_eager_limit();
        let (universe, threading) = ::mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| fail("MPI is already initialised in this process".into()))?;
        if threading != Threading::Multiple {
            return Err(fail(format!(
                "the MPI library gives {threading:?} thread support; ferrotext needs Multiple \
                 (each device thread calls MPI)"
            )));
        }
        let world = universe.world();
        let comm = world.duplicate();
        let control = world.duplicate();
        let stream = world.duplicate();
        for c in [&comm, &control, &stream] {
            // SAFETY: `c` is a live communicator; ERRORS_RETURN makes MPI report errors as codes
            // (turned into `CommError`s) instead of aborting the process.
            let rc = unsafe { ffi::MPI_Comm_set_errhandler(c.as_raw(), ffi::RSMPI_ERRORS_RETURN) };
            if rc != ffi::MPI_SUCCESS as i32 {
                return Err(fail(error_string(rc)));
            }
        }
        let on_this_host = world.split_shared(world.rank()).size() as usize;
        let library = ::mpi::environment::library_version()
            .ok()
            .and_then(|v| v.split(',').next().map(|l| l.trim().to_string()))
            .unwrap_or_else(|| "MPI".into());
        Ok(MpiCluster {
            raw: RawComm(comm.as_raw()),
            process: comm.rank() as usize,
            processes: comm.size() as usize,
            comm,
            control,
            stream_raw: RawComm(stream.as_raw()),
            _stream: stream,
            on_this_host,
            library,
            hierarchical: true,
            counters: Arc::new(Counters::default()),
            _universe: universe,
        })
    }

    /// A backend whose messages across processes travel on communicator `raw`.
    fn backend_on(
        &self,
        raw: RawComm,
        device: usize,
        devices_per_process: usize,
        timeout: Duration,
        local: LocalBackend,
    ) -> Box<dyn Backend> {
        let transport = Transport::new(
            raw,
            device,
            devices_per_process,
            timeout,
            self.counters.clone(),
        );
        Box::new(MpiBackend::new(
            local,
            transport,
            device,
            devices_per_process,
            self.hierarchical,
        ))
    }

    /// With `false`, every collective across processes runs flat (each device an MPI peer of
    /// every other) instead of hierarchically; for comparisons and tests.
    pub fn set_hierarchical(&mut self, on: bool) {
        self.hierarchical = on;
    }

    /// Bytes sent through MPI so far.
    pub fn traffic(&self) -> MpiTraffic {
        self.traffic_meter().read()
    }

    /// A handle on this process's MPI byte counters that can be kept and read anywhere (a
    /// per-step probe).
    pub fn traffic_meter(&self) -> TrafficMeter {
        TrafficMeter(self.counters.clone())
    }

    /// Ends every process of the job (`MPI_Abort`): the way out after an error, since peers may
    /// be blocked waiting for this process.
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }
}

impl Cluster for MpiCluster {
    fn process(&self) -> usize {
        self.process
    }

    fn processes(&self) -> usize {
        self.processes
    }

    fn processes_on_this_host(&self) -> usize {
        self.on_this_host
    }

    fn describe(&self) -> String {
        format!("MPI ({}), {} processes", self.library, self.processes)
    }

    fn backend(
        &self,
        device: usize,
        devices_per_process: usize,
        timeout: Duration,
        local: LocalBackend,
    ) -> Box<dyn Backend> {
        self.backend_on(self.raw, device, devices_per_process, timeout, local)
    }

    fn stream_backend(
        &self,
        device: usize,
        devices_per_process: usize,
        timeout: Duration,
        local: LocalBackend,
    ) -> Box<dyn Backend> {
        self.backend_on(self.stream_raw, device, devices_per_process, timeout, local)
    }

    fn agree(&self, what: &str, bytes: &[u8], timeout: Duration) -> Result<(), CommError> {
        let mut hasher = DefaultHasher::new();
        hasher.write(bytes);
        let mine = [hasher.finish(), bytes.len() as u64];
        let control = RawComm(self.control.as_raw());
        let all = all_gather_pairs(control, self.process, self.processes, mine, timeout).map_err(
            |e| match e {
                GatherError::Missing { missing, waited } => CommError::ProcessesMissing {
                    what: what.into(),
                    waited,
                    missing,
                },
                GatherError::Transport(detail) => CommError::Transport {
                    kind: crate::CollectiveKind::Barrier,
                    seq: 0,
                    detail: format!("agreeing on {what}: {detail}"),
                },
            },
        )?;
        let differing: Vec<usize> = (1..self.processes)
            .filter(|&p| all.get(p) != all.first())
            .collect();
        if differing.is_empty() {
            Ok(())
        } else {
            Err(CommError::Disagreement {
                what: what.into(),
                differing,
            })
        }
    }
}
