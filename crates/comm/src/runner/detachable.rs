//! [`run_spmd_detachable`]: a run that returns once it has failed, even while a device thread is
//! still busy outside the collectives (its thread is detached and named).

use std::fmt;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::Instant;

use ferrotext_sharding::Mesh;

use super::{
    device_thread, first_failure_or_results, panic_message, run_device, spawn_failure, Device,
    Plan, RunError, SpmdOptions,
};
use crate::cluster::Cluster;

/// Why a [`run_spmd_detachable`] run failed.
#[derive(Debug)]
pub struct RunFailure<E> {
    /// The first device to fail (as [`run_spmd_in`](super::run_spmd_in) reports it).
    pub error: RunError<E>,
    /// This process's devices whose threads were still running a collective timeout after the
    /// failure: they were detached (left running) and the call returned without them.
    pub left_running: Vec<usize>,
}

impl<E: fmt::Display> fmt::Display for RunFailure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.error)?;
        if !self.left_running.is_empty() {
            write!(
                f,
                "; devices {:?} were still running a collective timeout later and were left \
                 behind (their threads are detached)",
                self.left_running
            )?;
        }
        Ok(())
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RunFailure<E> {
    /// As [`RunError`]'s: the device error's own source.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

/// [`run_spmd_in`](super::run_spmd_in) for an owned (`'static`) program, which lets it return once the run has
/// failed even while a device thread is still busy: after the first failure it waits one more
/// collective timeout (and a quarter) for the other devices (those blocked in a collective get
/// their error by then), then detaches the threads still running and reports them in
/// [`RunFailure::left_running`]. A detached thread finishes on its own (its next collective
/// fails at once); under a [`Cluster`] the process should end the job after such a failure
/// rather than tear the cluster down under it.
///
/// # Errors
/// As [`run_spmd_in`](super::run_spmd_in), wrapped in a [`RunFailure`].
pub fn run_spmd_detachable<T, E, F>(
    cluster: Option<&dyn Cluster>,
    mesh: &Arc<Mesh>,
    options: &SpmdOptions,
    program: F,
) -> Result<Vec<T>, RunFailure<E>>
where
    T: Send + 'static,
    E: Send + 'static,
    F: Fn(&mut Device) -> Result<T, E> + Send + Sync + 'static,
{
    let plan = Plan::new(cluster, mesh, options).map_err(|error| RunFailure {
        error,
        left_running: Vec::new(),
    })?;
    let program = Arc::new(program);
    let failures: Arc<Mutex<Vec<usize>>> = Arc::new(Mutex::new(Vec::new()));
    let (sender, outcomes_rx) = mpsc::channel::<(usize, Result<T, RunError<E>>)>();
    let mut handles = Vec::new();
    let mut not_started = None;
    for index in plan.mine.clone() {
        let backend = plan.backend(cluster, index, options);
        let (world, program, failures) = (plan.world.clone(), program.clone(), failures.clone());
        let (mesh, threads, stack, sender) = (
            mesh.clone(),
            plan.threads,
            options.stack_size,
            sender.clone(),
        );
        let spawned = device_thread(index, options).spawn(move || {
            let outcome = run_device(
                index,
                mesh,
                (threads, stack),
                backend,
                &world,
                &*program,
                &failures,
            );
            // No receiver when the run already returned without this device: nobody to tell.
            let _ = sender.send((index, outcome));
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
    drop(sender);

    let failed = not_started.is_some().then(Instant::now);
    let (outcomes, left_running) = wait_for_outcomes(&plan, handles, outcomes_rx, options, failed);
    if let Some(error) = not_started {
        return Err(RunFailure {
            error,
            left_running,
        });
    }
    first_failure_or_results(&failures, outcomes, plan.mine.clone()).map_err(|error| RunFailure {
        error,
        left_running,
    })
}

/// The outcomes of the `handles` (this process's device threads, each sending its outcome on
/// `outcomes_rx`) in device order, and the devices left running: after the first failure
/// (`failed`: already at this instant), each device gets one more collective timeout and a
/// quarter, then the threads still running are detached.
#[allow(clippy::type_complexity)]
fn wait_for_outcomes<T, E>(
    plan: &Plan,
    handles: Vec<(usize, thread::JoinHandle<()>)>,
    outcomes_rx: mpsc::Receiver<(usize, Result<T, RunError<E>>)>,
    options: &SpmdOptions,
    failed: Option<Instant>,
) -> (Vec<Option<Result<T, RunError<E>>>>, Vec<usize>) {
    // Peers blocked in a collective get their error within one timeout (a quarter more for
    // scheduling); whoever is still running then is busy outside the collectives.
    let grace = options
        .collective_timeout
        .saturating_add(options.collective_timeout / 4);
    let mut failed_at = failed;
    let mut outcomes: Vec<Option<Result<T, RunError<E>>>> =
        plan.mine.clone().map(|_| None).collect();
    let mut pending = handles.len();
    while pending > 0 {
        // After a failure, wait at most `grace` more (forever when that overflows `Instant`).
        let deadline = failed_at.and_then(|t| t.checked_add(grace));
        let next = match deadline {
            Some(deadline) => outcomes_rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .ok(),
            None => outcomes_rx.recv().ok(),
        };
        let Some((index, outcome)) = next else { break };
        if outcome.is_err() && failed_at.is_none() {
            failed_at = Some(Instant::now());
        }
        outcomes[index - plan.mine.start] = Some(outcome);
        pending -= 1;
    }
    let mut left_running = Vec::new();
    for (index, handle) in handles {
        let slot = &mut outcomes[index - plan.mine.start];
        if slot.is_some() || handle.is_finished() {
            // Done (or about to be, having sent its outcome): joining does not wait.
            if let Err(payload) = handle.join() {
                slot.get_or_insert(Err(RunError::Panicked {
                    device: index,
                    message: panic_message(payload.as_ref()),
                }));
            }
        } else {
            // Dropping the handle detaches the thread; it owns everything it uses.
            left_running.push(index);
        }
    }
    (outcomes, left_running)
}
