//! How this process was started: alone (every device a thread here), or as one process of an MPI
//! job (`mpirun -n P ferrotext ...`, built with `--features mpi`).
//!
//! Under MPI, process 0 prints and writes; every process runs the same command. An error in any
//! process ends the whole job (`MPI_Abort`), since its peers may be waiting for it.

use anyhow::Result;
use ferrotext_comm::Cluster;

#[cfg(not(feature = "mpi"))]
use crate::common::UsageError;

/// The launch of this process.
pub struct Launch {
    #[cfg(feature = "mpi")]
    mpi: Option<ferrotext_comm::mpi::MpiCluster>,
}

impl Launch {
    /// Detects the launcher: MPI when started by `mpirun`/`srun`, else alone.
    ///
    /// # Errors
    /// Started by an MPI launcher but built without the `mpi` feature, or MPI failed to start.
    pub fn detect() -> Result<Launch> {
        #[cfg(feature = "mpi")]
        {
            use ferrotext_comm::mpi::MpiCluster;
            let mpi = if MpiCluster::launched_by_mpirun() {
                Some(MpiCluster::init()?)
            } else {
                None
            };
            Ok(Launch { mpi })
        }
        #[cfg(not(feature = "mpi"))]
        {
            if ferrotext_comm::started_by_mpi_launcher() {
                return Err(UsageError(
                    "started by an MPI launcher, but this ferrotext was built without MPI; \
                     rebuild with `cargo build --release --features mpi`"
                        .into(),
                )
                .into());
            }
            Ok(Launch {})
        }
    }

    /// The cluster, when this process is one of several.
    pub fn cluster(&self) -> Option<&dyn Cluster> {
        #[cfg(feature = "mpi")]
        {
            self.mpi.as_ref().map(|c| c as &dyn Cluster)
        }
        #[cfg(not(feature = "mpi"))]
        {
            None
        }
    }

    /// The MPI cluster itself (traffic counters, hierarchy switch).
    #[cfg(feature = "mpi")]
    pub fn mpi(&self) -> Option<&ferrotext_comm::mpi::MpiCluster> {
        self.mpi.as_ref()
    }

    /// The MPI cluster, mutably.
    #[cfg(feature = "mpi")]
    pub fn mpi_mut(&mut self) -> Option<&mut ferrotext_comm::mpi::MpiCluster> {
        self.mpi.as_mut()
    }

    /// This process's index (0 alone).
    pub fn process(&self) -> usize {
        self.cluster().map_or(0, |c| c.process())
    }

    /// Processes of the job (1 alone).
    pub fn processes(&self) -> usize {
        self.cluster().map_or(1, |c| c.processes())
    }

    /// True for the process that prints and writes (process 0).
    pub fn is_leader(&self) -> bool {
        self.process() == 0
    }

    /// Ends the job after `message` was printed, when peers could be waiting for this process;
    /// returns otherwise (the caller exits with `code`).
    pub fn end_job_on_error(&self, code: u8) {
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            if mpi.processes() > 1 {
                mpi.abort(i32::from(code));
            }
        }
        let _ = code;
    }
}
