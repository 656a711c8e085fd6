//! `ferrotext emulate --hosts H --devices-per-host L --link RATE[,DELAY] -- <subcommand ...>`:
//! runs a ferrotext job under `mpirun` on `H` emulated hosts — one network namespace each, on a
//! Linux bridge, each host's egress shaped with `tc` — and reports the bytes that crossed the
//! links per step next to what the MPI transport and the collective trace account for.
//!
//! * **Launch**: `mpirun` runs in the root namespace with `--host ADDR0:L,...` (one process per
//!   host, `local_devices=L` threads each) and `plm_rsh_agent` set to this binary's hidden
//!   `emulate-agent` subcommand, which runs `orted` inside the namespace that owns the address it
//!   is given (and refuses any other address). Both MPI transports are pinned to the run's /24.
//! * **Counting**: the job's processes append their namespace's interface counters and their MPI
//!   byte counts at every step boundary ([`probe`]); per-step numbers are differences between
//!   boundaries, so start-up traffic is not in them.
//! * **Clean-up**: the network is torn down on every way out — success, error, SIGINT/SIGTERM/
//!   SIGHUP (handled: `mpirun` is stopped first) — and each start removes what killed runs left
//!   behind (namespaces, links, run directories named after a PID that is no longer a live
//!   ferrotext). `mpirun` gets SIGTERM if this process dies (`PR_SET_PDEATHSIG`).

mod mpirun;
pub mod net;
pub mod predict;
pub mod probe;

use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use clap::Args;
use ferrotext_comm::human_bytes;
use ferrotext_train::TrainConfig;
use serde::Serialize;

use crate::common::stats::median;

/// `println!` that ignores a closed standard output (`| head`): the report is a courtesy, the
/// teardown after it is not, and a panic would skip it.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}
use crate::common::{config_args, usage};
use net::{LinkSpec, Network};
use predict::Prediction;

/// The variable that maps addresses to namespaces for the agent (`ADDR=NS,...`).
const ENV_HOSTS: &str = "FERROTEXT_EMULATE_HOSTS";

/// Arguments of `ferrotext emulate`.
#[derive(Args)]
pub struct EmulateArgs {
    /// Emulated hosts (one network namespace and one MPI process each).
    #[arg(long)]
    hosts: usize,
    /// Devices per host (`local_devices` of the job: device threads of its process).
    #[arg(long, default_value_t = 1)]
    devices_per_host: usize,
    /// Each host's egress link: `RATE[,DELAY]`, e.g. `1gbit`, `10gbit,100us`.
    #[arg(long, default_value = "1gbit")]
    link: String,
    /// Also write the report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// The ferrotext command to run on the cluster, after `--` (e.g. `train steps=6`).
    #[arg(last = true, required = true)]
    job: Vec<String>,
}

/// Arguments of the hidden `emulate-agent` (what `mpirun` passes its launch agent).
#[derive(Args)]
pub struct AgentArgs {
    /// The host address, then the command to run there.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// A validated request: the cluster's shape and the job to run on it.
pub struct Plan {
    /// Hosts.
    pub hosts: usize,
    /// Devices per host.
    pub local: usize,
    /// The link.
    pub link: LinkSpec,
    /// The job's arguments as the processes get them (`local_devices=L` added to `train`).
    pub job: Vec<String>,
    /// The job's config, for `train`.
    pub config: Option<TrainConfig>,
}

/// Splits `train`'s arguments like `ferrotext train` does: an optional config file, then
/// `key=value` overrides.
fn train_config(args: &[String], extra: &[String]) -> Result<TrainConfig> {
    let (file, overrides) = config_args::split(args);
    let mut overrides = overrides.to_vec();
    overrides.extend(extra.iter().cloned());
    TrainConfig::load(file.as_deref(), &overrides).map_err(|e| usage(e.to_string()))
}

impl Plan {
    /// Checks everything that can be checked without touching the machine: the shape, the link
    /// spec, and for `train` that `H × L` devices form the job's mesh.
    ///
    /// # Errors
    /// A [`UsageError`](crate::common::UsageError) for bad input.
    pub fn new(hosts: usize, local: usize, link: &str, job: &[String]) -> Result<Plan> {
        if hosts == 0 {
            return Err(usage("--hosts must be at least 1"));
        }
        if hosts > 250 {
            return Err(usage("--hosts must be at most 250 (one /24)"));
        }
        if local == 0 {
            return Err(usage("--devices-per-host must be at least 1"));
        }
        let link = LinkSpec::parse(link)?;
        let Some(command) = job.first() else {
            return Err(usage(
                "no job: give the ferrotext command after `--`, e.g. `-- train steps=6`",
            ));
        };
        crate::check_job(job).map_err(usage)?;
        let mut job = job.to_vec();
        let mut config = None;
        if command == "train" {
            for (key, value) in [("local_devices", local), ("num_processes", hosts)] {
                let prefix = format!("{key}=");
                if let Some(given) = job.iter().rev().find_map(|a| a.strip_prefix(&prefix)) {
                    if given.trim() != value.to_string() {
                        return Err(usage(format!(
                            "the job sets {key}={given}, but the emulated cluster has {value} \
                             (--hosts {hosts} --devices-per-host {local})"
                        )));
                    }
                }
            }
            job.push(format!("local_devices={local}"));
            let shape = |e: String| {
                if e.contains("mesh") {
                    usage(format!(
                        "{e} (--hosts {hosts} × --devices-per-host {local} must form the job's \
                         mesh)"
                    ))
                } else {
                    usage(e)
                }
            };
            let cfg = train_config(&job[1..], &[format!("num_processes={hosts}")])
                .map_err(|e| shape(e.to_string()))?;
            cfg.validate().map_err(|e| shape(e.to_string()))?;
            config = Some(cfg);
        }
        Ok(Plan {
            hosts,
            local,
            link,
            job,
            config,
        })
    }
}

/// Stops with one clear line when something this command needs is missing.
///
/// # Errors
/// A [`UsageError`](crate::common::UsageError) naming what is missing.
pub fn preflight() -> Result<()> {
    if !cfg!(feature = "mpi") {
        return Err(usage(
            "emulate runs jobs under mpirun, but this ferrotext was built without MPI; rebuild \
             with `cargo build --release --features mpi`",
        ));
    }
    for (tool, package) in [
        ("ip", "iproute2"),
        ("tc", "iproute2"),
        ("mpirun", "openmpi-bin"),
    ] {
        if net::find_tool(tool).is_none() {
            return Err(usage(format!(
                "emulate needs `{tool}` on PATH (install {package})"
            )));
        }
    }
    if !net::has_net_admin() {
        return Err(usage(
            "emulate needs root or CAP_NET_ADMIN to create network namespaces, links and qdiscs",
        ));
    }
    Ok(())
}

/// The signals that stop a run: the launcher handles them by tearing down
/// ([`install_signal_flag`]), and its set-up and teardown helpers ignore them.
pub(crate) const STOP_SIGNALS: [libc::c_int; 3] = [
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
];

/// SIGINT, SIGTERM and SIGHUP ([`STOP_SIGNALS`]) set the returned flag instead of ending the
/// process, so the network is torn down on the way out.
///
/// # Errors
/// The handlers could not be installed.
pub fn install_signal_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for signal in STOP_SIGNALS {
        signal_hook::flag::register(signal, flag.clone()).context("installing signal handlers")?;
    }
    Ok(flag)
}

/// Per-step traffic of one host.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HostWire {
    /// Host index (MPI process).
    pub host: usize,
    /// Its address.
    pub address: String,
    /// Steps the differences span.
    pub steps_measured: usize,
    /// Bytes its interface sent per step (frames: Ethernet, IP, TCP, MPI headers included).
    pub wire_tx_bytes_per_step: f64,
    /// Bytes its interface received per step.
    pub wire_rx_bytes_per_step: f64,
    /// Packets sent per step.
    pub tx_packets_per_step: f64,
    /// TCP segments retransmitted per step.
    pub tcp_retrans_per_step: f64,
    /// Payload bytes the MPI transport sent to other processes per step.
    pub mpi_bytes_per_step: f64,
}

/// What one job on the emulated cluster gave.
#[derive(Clone, Debug, Serialize)]
pub struct JobRun {
    /// The job's exit code (`None`: ended by a signal).
    pub exit_code: Option<i32>,
    /// Per host.
    pub hosts: Vec<HostWire>,
    /// Process 0's step times (seconds), every step.
    pub step_seconds: Vec<f64>,
    /// Process 0's losses, every step.
    pub losses: Vec<f64>,
    /// The job ran past its time limit and was stopped (`exit_code` is then meaningless).
    pub timed_out: bool,
    /// Hosts whose process had not started [`LAUNCH_DEADLINE`] after `mpirun` did: Open MPI lost
    /// their daemon at launch and would have waited for it forever, so the job was stopped
    /// (`exit_code` is then meaningless). Empty for a job that started.
    pub never_started: Vec<usize>,
}

/// How long every process of a job has to start (MPI's start-up included) before the launch is
/// taken as lost. Open MPI now and then loses one emulated host's daemon (`orted` daemonizes,
/// so its death reaches nobody), and `mpirun` then waits for it forever; a healthy launch of 4
/// hosts starts every process within a few seconds on this 2-core machine.
pub const LAUNCH_DEADLINE: Duration = Duration::from_secs(60);

/// How many times a job is launched while Open MPI loses a host's daemon at launch: by both
/// `emulate` ([`relaunched`]) and `bench cluster`. Such a launch runs nothing of the job (no
/// process gets past MPI's start-up), so launching it again changes nothing but the time.
pub const LAUNCH_ATTEMPTS: usize = 3;

/// `launch(attempt)` (from 1) until every host's process started, at most [`LAUNCH_ATTEMPTS`]
/// times, with a warning before each new launch; the last run is returned as it is (its
/// [`JobRun::never_started`] then names the hosts). An error from `launch` ends it at once.
fn relaunched(mut launch: impl FnMut(usize) -> Result<JobRun>) -> Result<JobRun> {
    let mut attempt = 1;
    loop {
        let run = launch(attempt)?;
        if run.never_started.is_empty() || attempt >= LAUNCH_ATTEMPTS {
            return Ok(run);
        }
        eprintln!(
            "warning: the job never started on host(s) {:?} within {} s (Open MPI lost their \
             daemon at launch) and was stopped; launching it again (attempt {} of {})",
            run.never_started,
            LAUNCH_DEADLINE.as_secs(),
            attempt + 1,
            LAUNCH_ATTEMPTS
        );
        attempt += 1;
    }
}

impl JobRun {
    /// Median step time in ms, the first (warm-up) step left out when there are others.
    pub fn median_step_ms(&self) -> f64 {
        let skip = usize::from(self.step_seconds.len() > 1);
        median(self.step_seconds.iter().skip(skip).copied().collect()) * 1e3
    }

    /// Mean over hosts of the bytes each sent per step.
    pub fn wire_bytes_per_step(&self) -> f64 {
        mean(self.hosts.iter().map(|h| h.wire_tx_bytes_per_step))
    }

    /// Mean over hosts of the MPI payload each sent per step.
    pub fn mpi_bytes_per_step(&self) -> f64 {
        mean(self.hosts.iter().map(|h| h.mpi_bytes_per_step))
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn host_wire(net: &Network, host: usize) -> HostWire {
    let mut samples = probe::read_samples(&net.run_dir(), host);
    samples.sort_by_key(|s| s.step);
    let mut wire = HostWire {
        host,
        address: net.address(host).to_string(),
        ..Default::default()
    };
    if let (Some(first), Some(last)) = (samples.first(), samples.last()) {
        let steps = samples.len() - 1;
        if steps > 0 {
            let per = |a: u64, b: u64| b.saturating_sub(a) as f64 / steps as f64;
            wire.steps_measured = steps;
            wire.wire_tx_bytes_per_step = per(first.tx_bytes, last.tx_bytes);
            wire.wire_rx_bytes_per_step = per(first.rx_bytes, last.rx_bytes);
            wire.tx_packets_per_step = per(first.tx_packets, last.tx_packets);
            wire.tcp_retrans_per_step = per(first.tcp_retrans_segs, last.tcp_retrans_segs);
            wire.mpi_bytes_per_step = per(first.mpi_bytes, last.mpi_bytes);
        }
    }
    wire
}

/// Sends `signal` to `pid` (a process this command started).
fn signal(pid: u32, signal: &str) {
    // A helper: a Ctrl-C to this process's group must not end it before it sends.
    let _ = net::helper("kill")
        .args([signal, &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Ends `mpirun`: SIGTERM (it stops its job), up to 5 s to exit, then SIGKILL; its status.
fn stop_child(child: &mut std::process::Child) -> Result<ExitStatus> {
    signal(child.id(), "-TERM");
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    child.wait().context("waiting for mpirun")
}

/// Runs `job` (ferrotext arguments) on `net` with `local` devices per host under `mpirun`;
/// stops it on `stop`, after `limit` (then [`JobRun::timed_out`] is set), and when a host's
/// process has not started within [`LAUNCH_DEADLINE`] (then [`JobRun::never_started`] names
/// it).
///
/// # Errors
/// `mpirun` could not start, or `stop` was raised (the job is stopped first).
pub fn run_job(
    net: &Network,
    local: usize,
    job: &[String],
    stop: &AtomicBool,
    quiet: bool,
    limit: Option<Duration>,
) -> Result<JobRun> {
    let started = Instant::now();
    let dir = net.run_dir();
    for host in 0..net.hosts() {
        let _ = std::fs::remove_file(probe::file_for(&dir, host));
        let _ = std::fs::remove_file(probe::started_file(&dir, host));
    }
    let mut cmd = mpirun::command(net, local, job, quiet)?;
    let mut child = cmd.spawn().context("starting mpirun")?;
    // For the clean-up of a later start, should this process be killed.
    let _ = std::fs::write(dir.join(net::MPIRUN_PID_FILE), child.id().to_string());
    let mut timed_out = false;
    let mut never_started = Vec::new();
    let mut launched = false;
    let status: ExitStatus = loop {
        if let Some(status) = child.try_wait().context("waiting for mpirun")? {
            break status;
        }
        if limit.is_some_and(|l| started.elapsed() > l) {
            timed_out = true;
            break stop_child(&mut child)?;
        }
        if !launched && started.elapsed() > LAUNCH_DEADLINE {
            never_started = probe::not_started(&dir, net.hosts());
            launched = never_started.is_empty();
            if !launched {
                break stop_child(&mut child)?;
            }
        }
        if stop.load(Ordering::Relaxed) {
            let _ = stop_child(&mut child);
            return Err(anyhow!(
                "interrupted by a signal: the job was stopped and the emulated network removed"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if quiet && !status.success() {
        if let Some(mut err) = child.stderr.take() {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut text);
            eprint!("{text}");
        }
    }
    let hosts: Vec<HostWire> = (0..net.hosts()).map(|h| host_wire(net, h)).collect();
    let mut lead = probe::read_samples(&dir, 0);
    lead.sort_by_key(|s| s.step);
    Ok(JobRun {
        exit_code: status.code(),
        hosts,
        step_seconds: lead.iter().map(|s| s.seconds).collect(),
        losses: lead.iter().map(|s| s.loss).collect(),
        timed_out,
        never_started,
    })
}

#[derive(Serialize)]
struct Report<'a> {
    hosts: usize,
    devices_per_host: usize,
    link: String,
    subnet: String,
    job: &'a [String],
    prediction: Option<&'a Prediction>,
    run: &'a JobRun,
}

fn print_table(run: &JobRun, prediction: Option<&Prediction>) {
    say!("\nbytes on the emulated links per step (differences between step boundaries):");
    say!(
        "{:<5} {:<15} {:>14} {:>14} {:>12} {:>16} {:>15} {:>10} {:>10}",
        "host",
        "address",
        "wire tx/step",
        "wire rx/step",
        "packets/step",
        "MPI payload/step",
        "trace predicts",
        "wire/MPI",
        "retrans"
    );
    for h in &run.hosts {
        let predicted = prediction.map_or("-".to_string(), |p| {
            human_bytes(p.bytes_per_host_per_step as usize)
        });
        let ratio = if h.mpi_bytes_per_step > 0.0 {
            format!("{:.3}", h.wire_tx_bytes_per_step / h.mpi_bytes_per_step)
        } else {
            "-".into()
        };
        say!(
            "{:<5} {:<15} {:>14} {:>14} {:>12.0} {:>16} {:>15} {:>10} {:>10.1}",
            h.host,
            h.address,
            human_bytes(h.wire_tx_bytes_per_step as usize),
            human_bytes(h.wire_rx_bytes_per_step as usize),
            h.tx_packets_per_step,
            human_bytes(h.mpi_bytes_per_step as usize),
            predicted,
            ratio,
            h.tcp_retrans_per_step
        );
    }
    if run.hosts.iter().all(|h| h.steps_measured == 0) {
        say!("(no per-step numbers: they need a `train` job of at least 2 steps)");
    }
}

/// Runs the command.
///
/// # Errors
/// Bad input or a missing tool or privilege ([`UsageError`](crate::common::UsageError)), a failed set-up, a failed job or
/// an interruption; the network is removed in every case.
pub fn run(args: &EmulateArgs) -> Result<()> {
    let stop = install_signal_flag()?;
    let plan = Plan::new(args.hosts, args.devices_per_host, &args.link, &args.job)?;
    if let Some(path) = &args.json {
        // Found before the network is made and the job runs, as a run's own outputs are.
        ferrotext_train::io::check_output_path("--json", path, false)?;
    }
    preflight()?;
    let removed = net::remove_leftovers();
    if !removed.is_empty() {
        eprintln!(
            "removed what killed emulate runs left: {}",
            removed.join(", ")
        );
    }
    let prediction = match &plan.config {
        Some(cfg) => Some(predict::plan(cfg).context("planning one step")?),
        None => None,
    };
    let mut network = Network::create(plan.hosts, &plan.link)?;
    say!(
        "emulated cluster: {} hosts × {} devices, link {}, subnet {} (namespaces {}..)",
        plan.hosts,
        plan.local,
        plan.link,
        network.cidr(),
        network.namespace(0)
    );
    let run = relaunched(|_| run_job(&network, plan.local, &plan.job, &stop, false, None));
    network.teardown();
    let run = run?;
    if !run.never_started.is_empty() {
        return Err(anyhow!(
            "the job never started on host(s) {:?} within {} s in {} launches: Open MPI lost \
             their daemon at launch each time, so the job was stopped and the emulated network \
             removed",
            run.never_started,
            LAUNCH_DEADLINE.as_secs(),
            LAUNCH_ATTEMPTS
        ));
    }
    if plan.config.is_some() {
        print_table(&run, prediction.as_ref());
    }
    if let Some(path) = &args.json {
        let report = Report {
            hosts: plan.hosts,
            devices_per_host: plan.local,
            link: plan.link.to_string(),
            subnet: network.cidr(),
            job: &plan.job,
            prediction: prediction.as_ref(),
            run: &run,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    match run.exit_code {
        Some(0) => Ok(()),
        Some(code) => Err(anyhow!("the job failed (mpirun exited with status {code})")),
        None => Err(anyhow!("the job was ended by a signal")),
    }
}

/// The launch agent: `emulate-agent ADDR COMMAND...` runs COMMAND (a shell command line, as
/// `ssh` would) inside the namespace that owns ADDR in this run; any other address is refused.
///
/// # Errors
/// No address, an address not in this run, or `ip netns exec` could not start.
pub fn agent(args: &AgentArgs) -> Result<()> {
    let (host, command) = args
        .args
        .split_first()
        .ok_or_else(|| usage("emulate-agent: no host address"))?;
    let map = std::env::var(ENV_HOSTS)
        .map_err(|_| usage("emulate-agent runs only under `ferrotext emulate`"))?;
    let ns = map
        .split(',')
        .filter_map(|e| e.split_once('='))
        .find(|(addr, _)| addr == host)
        .map(|(_, ns)| ns.to_string())
        .ok_or_else(|| {
            usage(format!(
                "emulate-agent: {host} is not an address of this emulated cluster"
            ))
        })?;
    let err = std::os::unix::process::CommandExt::exec(
        Command::new("ip")
            .args(["netns", "exec", &ns, "sh", "-c", &command.join(" ")])
            .env_remove(ENV_HOSTS),
    );
    Err(anyhow!(
        "emulate-agent: running `ip netns exec {ns}`: {err}"
    ))
}

#[cfg(test)]
mod tests;
