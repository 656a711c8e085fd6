//! `run_spmd`: run one program on every device of a mesh, one thread per device.
//!
//! Every device thread gets a [`Device`] (its index, coordinates, thread budget and
//! [`Communicator`]) and runs the same closure. The run ends when every device has returned; a
//! device that fails or panics is marked departed at once, so peers blocked in a collective with
//! it get an error instead of hanging (see [`crate::LocalBackend`]). [`run_spmd_in`] runs this
//! process's share of a mesh that spans several processes (a [`Cluster`]).

use std::fmt;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use ferrotext_sharding::Mesh;

use crate::backend::Backend;
use crate::cluster::Cluster;
use crate::communicator::Communicator;
use crate::error::CommError;
use crate::local::{LocalBackend, World};
use crate::stream::Stream;

mod detachable;

pub use detachable::{run_spmd_detachable, RunFailure};

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

/// The longest collective timeout [`collective_timeout`] accepts: one year (a longer one is a
/// typo, and `Instant` arithmetic must not overflow).
pub const MAX_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

/// A collective timeout of `seconds` (a user's number: a flag, a config value), validated.
///
/// # Errors
/// [`CommError::InvalidOption`] unless `seconds` is finite, greater than 0 and at most
/// [`MAX_COLLECTIVE_TIMEOUT`] (NaN, infinities, negative values, 1e30 are refused, never a panic).
pub fn collective_timeout(seconds: f64) -> Result<Duration, CommError> {
    let max = MAX_COLLECTIVE_TIMEOUT.as_secs_f64();
    if seconds.is_finite() && seconds > 0.0 && seconds <= max {
        if let Ok(timeout) = Duration::try_from_secs_f64(seconds) {
            return Ok(timeout);
        }
    }
    Err(CommError::InvalidOption {
        what: "collective timeout".into(),
        reason: format!(
            "{seconds} seconds: it must be a number of seconds greater than 0 and at most {max} \
             (one year)"
        ),
    })
}

impl SpmdOptions {
    /// These options with another collective timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> SpmdOptions {
        self.collective_timeout = timeout;
        self
    }

    /// These options with a collective timeout of `seconds`, validated by
    /// [`collective_timeout`].
    ///
    /// # Errors
    /// [`CommError::InvalidOption`] for NaN, infinite, non-positive or absurdly large values.
    pub fn with_timeout_secs(self, seconds: f64) -> Result<SpmdOptions, CommError> {
        Ok(self.with_timeout(collective_timeout(seconds)?))
    }
}

/// The thread budget of each of `devices` devices sharing this machine: `cores / devices`, at
/// least 1 (docs/design.md §3).
pub fn default_threads_per_device(devices: usize) -> usize {
    let cores = thread::available_parallelism().map_or(1, |n| n.get());
    (cores / devices.max(1)).max(1)
}

/// One device's view of the run.
pub struct Device {
    index: usize,
    coords: Vec<usize>,
    threads: usize,
    stack_size: usize,
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

    /// The mesh.
    pub fn mesh(&self) -> &Arc<Mesh> {
        self.comm.mesh()
    }

    /// Threads its kernels may use.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The stack size of its thread, in bytes ([`SpmdOptions::stack_size`]): what any thread
    /// running this device's program on its behalf needs too.
    pub fn stack_size(&self) -> usize {
        self.stack_size
    }

    /// Its communicator.
    pub fn comm(&mut self) -> &mut Communicator {
        &mut self.comm
    }
}

/// Why a run failed: the *first* device to fail, with its error (later failures are usually
/// consequences, e.g. peers seeing it depart).
#[derive(Debug)]
pub enum RunError<E> {
    /// The device's closure returned an error.
    Device {
        /// Which device.
        device: usize,
        /// Its error.
        error: E,
    },
    /// The device's closure panicked (a bug in ferrotext; reported, never hung on), or its thread
    /// could not be started.
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

impl<E> RunError<E> {
    /// The device that failed first.
    pub fn device(&self) -> usize {
        match self {
            RunError::Device { device, .. } | RunError::Panicked { device, .. } => *device,
            RunError::Placement { .. } => 0,
        }
    }
}

impl<E: fmt::Display> fmt::Display for RunError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::Device { device, error } => write!(f, "device {device}: {error}"),
            RunError::Panicked { device, message } => {
                write!(f, "device {device} panicked: {message}")
            }
            RunError::Placement { devices, processes } => write!(
                f,
                "a mesh of {devices} devices cannot be split evenly over {processes} processes"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RunError<E> {
    /// The device error's own source: the error itself is already part of the message, so an
    /// error chain (`{:#}`) prints it once.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RunError::Device { error, .. } => error.source(),
            RunError::Panicked { .. } | RunError::Placement { .. } => None,
        }
    }
}

/// Runs `program` on every device of `mesh` (one thread each, in-process collectives) and returns
/// the results in device order.
///
/// # Errors
/// The first device to fail, in time order ([`RunError`]). A panic on a device is caught and
/// returned, and never leaves peers hanging: they fail their pending collective at once.
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
) -> Result<Vec<T>, RunError<E>>
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
/// Every device thread is joined before this returns (the program may borrow from the caller),
/// so a device stuck outside the collectives — in its own computation — keeps this call waiting
/// after its peers have failed; [`run_spmd_detachable`] returns instead.
///
/// # Errors
/// [`RunError::Placement`] when the mesh does not split evenly over the processes; a device
/// whose thread the operating system refused to start ([`RunError::Panicked`] naming it; its
/// peers fail at once); else as [`run_spmd`] (failures of devices in other processes reach this
/// one as collective errors).
pub fn run_spmd_in<T, E, F>(
    cluster: Option<&dyn Cluster>,
    mesh: &Arc<Mesh>,
    options: &SpmdOptions,
    program: F,
) -> Result<Vec<T>, RunError<E>>
where
    T: Send,
    E: Send,
    F: Fn(&mut Device) -> Result<T, E> + Sync,
{
    let plan = Plan::new(cluster, mesh, options)?;
    // Devices in the order they failed: the first is the root cause.
    let failures: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let mut outcomes: Vec<Option<Result<T, RunError<E>>>> =
        plan.mine.clone().map(|_| None).collect();
    let mut not_started = None;

    thread::scope(|scope| {
        let mut handles = Vec::new();
        for index in plan.mine.clone() {
            let backend = plan.backend(cluster, index, options);
            let (world, program, failures) = (&plan.world, &program, &failures);
            let (mesh, threads, stack) = (mesh.clone(), plan.threads, options.stack_size);
            let spawned = device_thread(index, options).spawn_scoped(scope, move || {
                run_device(
                    index,
                    mesh,
                    (threads, stack),
                    backend,
                    world,
                    program,
                    failures,
                )
            });
            match spawned {
                Ok(handle) => handles.push((index, handle)),
                Err(err) => {
                    plan.never_started(index);
                    not_started = Some(spawn_failure(index, &err));
                    break;
                }
            }
        }
        for (index, handle) in handles {
            outcomes[index - plan.mine.start] = Some(handle.join().unwrap_or_else(|payload| {
                Err(RunError::Panicked {
                    device: index,
                    message: panic_message(payload.as_ref()),
                })
            }));
        }
    });

    if let Some(err) = not_started {
        return Err(err);
    }
    first_failure_or_results(&failures, outcomes, plan.mine)
}

/// What a run sets up before it starts its device threads.
struct Plan {
    /// This process's devices.
    mine: Range<usize>,
    per_process: usize,
    world: Arc<Worlds>,
    threads: usize,
}

/// The rendezvous spaces of one run: the devices' blocking collectives, and their background
/// streams' (so a background job never meets a blocking one).
struct Worlds {
    main: Arc<World>,
    stream: Arc<World>,
}

impl Worlds {
    /// `device` is gone from both.
    fn depart(&self, device: usize) {
        self.main.depart(device);
        self.stream.depart(device);
    }
}

/// A device's two backends: blocking collectives, and its background stream's.
type Backends = (Box<dyn Backend>, Box<dyn Backend>);

impl Plan {
    fn new<E>(
        cluster: Option<&dyn Cluster>,
        mesh: &Arc<Mesh>,
        options: &SpmdOptions,
    ) -> Result<Plan, RunError<E>> {
        let n = mesh.device_count();
        let (process, processes) = cluster.map_or((0, 1), |c| (c.process(), c.processes()));
        if processes == 0 || !n.is_multiple_of(processes) {
            return Err(RunError::Placement {
                devices: n,
                processes,
            });
        }
        let per_process = n / processes;
        let hosts_share = cluster.map_or(1, |c| c.processes_on_this_host().max(1));
        let threads = options
            .threads_per_device
            .unwrap_or_else(|| default_threads_per_device(per_process.saturating_mul(hosts_share)))
            .max(1);
        Ok(Plan {
            mine: process * per_process..(process + 1) * per_process,
            per_process,
            world: Arc::new(Worlds {
                main: Arc::new(World::new(mesh, options.collective_timeout)),
                stream: Arc::new(World::new(mesh, options.collective_timeout)),
            }),
            threads,
        })
    }

    /// The backends of `device` (made here, so the device thread does not borrow the cluster).
    fn backend(
        &self,
        cluster: Option<&dyn Cluster>,
        device: usize,
        options: &SpmdOptions,
    ) -> Backends {
        let main = LocalBackend::new(device, self.world.main.clone());
        let stream = LocalBackend::new(device, self.world.stream.clone());
        let timeout = options.collective_timeout;
        match cluster {
            Some(c) => (
                c.backend(device, self.per_process, timeout, main),
                c.stream_backend(device, self.per_process, timeout, stream),
            ),
            None => (Box::new(main), Box::new(stream)),
        }
    }

    /// Marks devices `from..` of this process departed: their threads never started, so peers
    /// waiting for them fail at once instead of at the timeout.
    fn never_started(&self, from: usize) {
        for device in from..self.mine.end {
            self.world.depart(device);
        }
    }
}

/// `comm` with a background stream on `backend`; without one (the OS refused its thread) the
/// background collectives run in the foreground, with the same results.
fn with_stream(comm: Communicator, device: usize, backend: Box<dyn Backend>) -> Communicator {
    match Stream::new(device, backend) {
        Ok(stream) => comm.with_stream(stream),
        Err(_) => comm,
    }
}

fn device_thread(index: usize, options: &SpmdOptions) -> thread::Builder {
    thread::Builder::new()
        .name(format!("ferrotext-device-{index}"))
        .stack_size(options.stack_size)
}

fn spawn_failure<E>(device: usize, err: &std::io::Error) -> RunError<E> {
    RunError::Panicked {
        device,
        message: format!(
            "its thread could not be started ({err}): more device threads than this machine \
             allows (use fewer devices per process, or a smaller stack size)"
        ),
    }
}

/// One device thread's life: build its [`Device`], run `program` (a panic is caught), record a
/// failure, then depart so peers stop waiting for it.
fn run_device<T, E, F>(
    index: usize,
    mesh: Arc<Mesh>,
    (threads, stack_size): (usize, usize),
    backend: Backends,
    world: &Worlds,
    program: &F,
    failures: &Mutex<Vec<usize>>,
) -> Result<T, RunError<E>>
where
    F: Fn(&mut Device) -> Result<T, E>,
{
    let coords = mesh.coords(index).unwrap_or_default();
    let mut device = Device {
        index,
        coords,
        threads,
        stack_size,
        comm: with_stream(Communicator::new(index, mesh, backend.0), index, backend.1),
    };
    let outcome = match catch_unwind(AssertUnwindSafe(|| program(&mut device))) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(RunError::Device {
            device: index,
            error,
        }),
        Err(payload) => Err(RunError::Panicked {
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
}

/// The first device to fail (in time order) if any, else every result in device order.
fn first_failure_or_results<T, E>(
    failures: &Mutex<Vec<usize>>,
    mut outcomes: Vec<Option<Result<T, RunError<E>>>>,
    mine: Range<usize>,
) -> Result<Vec<T>, RunError<E>> {
    let order: Vec<usize> = failures.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for device in order {
        if let Some(slot) = outcomes.get_mut(device - mine.start) {
            if let Some(Err(err)) = slot.take() {
                return Err(err);
            }
        }
    }
    outcomes
        .into_iter()
        .zip(mine)
        .map(|(o, device)| {
            o.unwrap_or_else(|| {
                Err(RunError::Panicked {
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
