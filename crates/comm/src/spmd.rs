//! `run_spmd`: run one program on every device of a mesh, one thread per device.
//!
//! Every device thread gets a [`Device`] (its index, coordinates, thread budget and
//! [`Communicator`]) and runs the same closure. The run ends when every device has returned; a
//! device that fails or panics is marked departed at once, so peers blocked in a collective with
//! it get an error instead of hanging (see [`crate::LocalBackend`]). [`run_spmd_in`] runs this
//! process's share of a mesh that spans several processes (a [`Cluster`]).

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use ferrotext_sharding::Mesh;

use crate::cluster::Cluster;
use crate::communicator::{Backend, Communicator};
use crate::local::{LocalBackend, World};

/// How a run is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpmdOptions {
    /// How long a device waits in a collective for its peers before the collective fails.
    pub collective_timeout: Duration,
    /// Kernel threads per device; `None` = `cores / devices`, at least 1 (never oversubscribe).
    pub threads_per_device: Option<usize>,
    /// Stack size of each device thread in bytes.
    pub stack_size: usize,
}

impl Default for SpmdOptions {
    /// A 300 s collective timeout (long enough for a slow micro-batch on a peer), automatic thread
    /// budget, 16 MiB stacks.
    fn default() -> SpmdOptions {
        SpmdOptions {
            collective_timeout: Duration::from_secs(300),
            threads_per_device: None,
            stack_size: 16 << 20,
        }
    }
}

impl SpmdOptions {
    /// These options with another collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> SpmdOptions {
        self.collective_timeout = timeout;
        self
    }
}

/// The thread budget of each of `devices` devices sharing this machine: `cores / devices`, at
/// least 1 (DESIGN §3).
pub fn default_threads_per_device(devices: usize) -> usize {
    let cores = thread::available_parallelism().map_or(1, |n| n.get());
    (cores / devices.max(1)).max(1)
}

/// One device's view of the run.
pub struct Device {
    index: usize,
    coords: Vec<usize>,
    threads: usize,
    comm: Communicator,
}

impl Device {
    /// This device's index in the mesh (row-major).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Its coordinates along each mesh axis, in mesh order.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }

    /// Its coordinate along `axis`, if the mesh has that axis.
    pub fn coord(&self, axis: &str) -> Option<usize> {
        self.comm.mesh().axis_index(axis).map(|p| self.coords[p])
    }

    /// The mesh.
    pub fn mesh(&self) -> &Arc<Mesh> {
        self.comm.mesh()
    }

    /// Threads its kernels may use.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Its communicator.
    pub fn comm(&mut self) -> &mut Communicator {
        &mut self.comm
    }

    /// Its communicator, read-only (trace, phase).
    pub fn comm_ref(&self) -> &Communicator {
        &self.comm
    }
}

/// Why a run failed: the *first* device to fail, with its error (later failures are usually
/// consequences, e.g. peers seeing it depart).
#[derive(Debug)]
pub enum SpmdError<E> {
    /// The device's closure returned an error.
    Device {
        /// Which device.
        device: usize,
        /// Its error.
        error: E,
    },
    /// The device's closure panicked (a bug in ferrotext; reported, never hung on).
    Panicked {
        /// Which device.
        device: usize,
        /// The panic message.
        message: String,
    },
    /// The mesh cannot be split evenly over the cluster's processes (nothing ran).
    Placement {
        /// Devices of the mesh.
        devices: usize,
        /// Processes of the cluster.
        processes: usize,
    },
}

impl<E> SpmdError<E> {
    /// The device that failed first.
    pub fn device(&self) -> usize {
        match self {
            SpmdError::Device { device, .. } | SpmdError::Panicked { device, .. } => *device,
            SpmdError::Placement { .. } => 0,
        }
    }
}

impl<E: fmt::Display> fmt::Display for SpmdError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpmdError::Device { device, error } => write!(f, "device {device}: {error}"),
            SpmdError::Panicked { device, message } => {
                write!(f, "device {device} panicked: {message}")
            }
            SpmdError::Placement { devices, processes } => write!(
                f,
                "a mesh of {devices} devices cannot be split evenly over {processes} processes"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for SpmdError<E> {
    /// The device error's own source: the error itself is already part of the message, so an
    /// error chain (`{:#}`) prints it once.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SpmdError::Device { error, .. } => error.source(),
            SpmdError::Panicked { .. } | SpmdError::Placement { .. } => None,
        }
    }
}

/// Runs `program` on every device of `mesh` (one thread each, in-process collectives) and returns
/// the results in device order.
///
/// # Errors
/// The first device to fail, in time order ([`SpmdError`]). A panic on a device is caught and
/// returned, and never leaves peers hanging: they fail their pending collective at once.
///
/// # Panics
/// Only if the operating system cannot spawn a thread.
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use ferrotext_comm::{run_spmd, SpmdOptions};
/// use ferrotext_sharding::Mesh;
///
/// let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
/// let sums = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
///     let mut x = vec![dev.index() as f32; 3];
///     dev.comm().all_reduce(&["data"], &mut x)?;
///     Ok::<_, ferrotext_comm::CommError>(x)
/// })
/// .unwrap();
/// assert!(sums.iter().all(|x| x == &vec![6.0; 3]));
/// ```
pub fn run_spmd<T, E, F>(
    mesh: &Arc<Mesh>,
    options: &SpmdOptions,
    program: F,
) -> Result<Vec<T>, SpmdError<E>>
where
    T: Send,
    E: Send,
    F: Fn(&mut Device) -> Result<T, E> + Sync,
{
    run_spmd_in(None, mesh, options, program)
}

/// Runs `program` on this process's devices of `mesh`: all of them without a cluster, else the
/// `devices / processes` consecutive devices of this process (see [`Cluster`]). Results come back
/// for this process's devices, in device order.
///
/// # Errors
/// [`SpmdError::Placement`] when the mesh does not split evenly over the processes; else as
/// [`run_spmd`] (failures of devices in other processes reach this one as collective errors).
///
/// # Panics
/// Only if the operating system cannot spawn a thread.
pub fn run_spmd_in<T, E, F>(
    cluster: Option<&dyn Cluster>,
    mesh: &Arc<Mesh>,
    options: &SpmdOptions,
    program: F,
) -> Result<Vec<T>, SpmdError<E>>
where
    T: Send,
    E: Send,
    F: Fn(&mut Device) -> Result<T, E> + Sync,
{
    let n = mesh.device_count();
    let (process, processes) = cluster.map_or((0, 1), |c| (c.process(), c.processes()));
    if processes == 0 || n % processes != 0 {
        return Err(SpmdError::Placement {
            devices: n,
            processes,
        });
    }
    let per_process = n / processes;
    let mine = process * per_process..(process + 1) * per_process;
    let world = Arc::new(World::new(mesh, options.collective_timeout));
    let hosts_share = cluster.map_or(1, |c| c.processes_on_this_host().max(1));
    let threads = options
        .threads_per_device
        .unwrap_or_else(|| default_threads_per_device(per_process * hosts_share))
        .max(1);
    // Devices in the order they failed: the first is the root cause.
    let failures: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let mut outcomes: Vec<Option<Result<T, SpmdError<E>>>> = mine.clone().map(|_| None).collect();

    thread::scope(|scope| {
        let handles: Vec<_> = mine
            .clone()
            .map(|index| {
                let (world, program, failures) = (world.clone(), &program, &failures);
                let mesh = mesh.clone();
                thread::Builder::new()
                    .name(format!("ferrotext-device-{index}"))
                    .stack_size(options.stack_size)
                    .spawn_scoped(scope, move || {
                        let coords = mesh.coords(index).unwrap_or_default();
                        let local = LocalBackend::new(index, world.clone());
                        let backend: Box<dyn Backend> = match cluster {
                            Some(c) => {
                                c.backend(index, per_process, options.collective_timeout, local)
                            }
                            None => Box::new(local),
                        };
                        let mut device = Device {
                            index,
                            coords,
                            threads,
                            comm: Communicator::new(index, mesh, backend),
                        };
                        let outcome = match catch_unwind(AssertUnwindSafe(|| program(&mut device)))
                        {
                            Ok(Ok(value)) => Ok(value),
                            Ok(Err(error)) => Err(SpmdError::Device {
                                device: index,
                                error,
                            }),
                            Err(payload) => Err(SpmdError::Panicked {
                                device: index,
                                message: panic_message(payload.as_ref()),
                            }),
                        };
                        if outcome.is_err() {
                            failures
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push(index);
                        }
                        world.depart(index);
                        outcome
                    })
                    .expect("the OS refused to spawn a device thread") // ok: not input-dependent
            })
            .collect();
        for (slot, (index, handle)) in mine.clone().zip(handles).enumerate() {
            outcomes[slot] = Some(handle.join().unwrap_or_else(|payload| {
                Err(SpmdError::Panicked {
                    device: index,
                    message: panic_message(payload.as_ref()),
                })
            }));
        }
    });

    let first_failure = failures
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .first()
        .copied();
    if let Some(device) = first_failure {
        if let Some(Some(Err(err))) = outcomes.get_mut(device - mine.start).map(Option::take) {
            return Err(err);
        }
    }
    outcomes
        .into_iter()
        .zip(mine)
        .map(|(o, device)| {
            o.unwrap_or_else(|| {
                Err(SpmdError::Panicked {
                    device,
                    message: "device thread produced no result".into(),
                })
            })
        })
        .collect()
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}
