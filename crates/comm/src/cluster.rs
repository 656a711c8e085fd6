//! `Cluster`: the processes one SPMD run spans.
//!
//! A mesh of `P·L` devices runs as `P` processes of `L` device threads each; device `d` lives in
//! process `d / L` (local devices are the *minor* end of the row-major device order, so the last
//! mesh axes stay inside a process, as devices inside one host do). Inside a process, devices
//! talk through the in-process backend; a `Cluster` supplies the backend for groups that cross
//! processes. Without a cluster, every device is a thread of this process ([`crate::run_spmd`]).

use std::time::Duration;

use crate::backend::Backend;
use crate::error::CommError;
use crate::local::LocalBackend;

/// The processes of a multi-process run (MPI today; anything that moves bytes between processes
/// fits). Every process of a run must hold an equal cluster and run the same program.
pub trait Cluster: Sync {
    /// This process's index, `0..processes()`.
    fn process(&self) -> usize;

    /// How many processes the run spans.
    fn processes(&self) -> usize;

    /// How many of them run on this host (they share its cores).
    fn processes_on_this_host(&self) -> usize;

    /// A short description for logs: `MPI (Open MPI v4.1.4), 4 processes`.
    fn describe(&self) -> String;

    /// The backend of `device` (one of this process's `devices_per_process` devices): `local`
    /// serves groups inside this process, the cluster's transport the others. Collectives wait at
    /// most `timeout` for their peers.
    fn backend(
        &self,
        device: usize,
        devices_per_process: usize,
        timeout: Duration,
        local: LocalBackend,
    ) -> Box<dyn Backend>;

    /// The backend of `device`'s background stream ([`crate::stream`]): like
    /// [`Cluster::backend`], but its messages never meet the blocking collectives' (its own
    /// communicator or tag space), since both run at the same time.
    fn stream_backend(
        &self,
        device: usize,
        devices_per_process: usize,
        timeout: Duration,
        local: LocalBackend,
    ) -> Box<dyn Backend>;

    /// Checks that every process passes the same `bytes` (a config, a mesh): `Ok` on every
    /// process, or on every process the same error naming `what` and the processes that differ
    /// from process 0. Call it from one thread per process, outside any SPMD run. Waits at most
    /// `timeout` for the other processes.
    ///
    /// # Errors
    /// [`CommError::Disagreement`]; [`CommError::ProcessesMissing`] naming the processes that did
    /// not arrive within `timeout`; or a transport failure.
    fn agree(&self, what: &str, bytes: &[u8], timeout: Duration) -> Result<(), CommError>;
}

/// The environment variables an MPI launcher sets in every process it starts: Open MPI's
/// `mpirun` (`OMPI_COMM_WORLD_*`), PMIx launchers (Open MPI 5, Slurm's `srun --mpi=pmix`),
/// PMI launchers (MPICH's Hydra, Intel MPI, `srun --mpi=pmi2`), and Intel MPI's own.
pub const MPI_LAUNCHER_VARIABLES: [&str; 7] = [
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MPI_LOCALNRANKS",
    "MPI_LOCALRANKID",
];

/// True when this process was started by an MPI launcher (one of [`MPI_LAUNCHER_VARIABLES`] is
/// set). One list for every build: a binary with MPI joins the job, one without refuses to run
/// as one of several independent copies.
pub fn started_by_mpi_launcher() -> bool {
    MPI_LAUNCHER_VARIABLES
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}
