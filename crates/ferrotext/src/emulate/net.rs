//! The emulated network: one namespace per host on a Linux bridge, each host's egress shaped with
//! `tc`; names derived from this process's PID so a later run can find and remove the leftovers of
//! a killed one.
//!
//! # Invariants
//! * Every name this module creates starts with one of the run prefixes below followed by the
//!   creating process's PID; nothing else is ever deleted.
//! * The subnet is a private /24 that overlaps no route and no address of the machine, so the
//!   jobs' traffic can only go to the namespaces' addresses (and the bridge's `.254`).
//! * [`Network`] tears everything down when dropped (and [`Network::teardown`] is idempotent).

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::common::UsageError;

mod link;

pub use link::LinkSpec;

/// Namespace names: `ftxemu-<pid>-h<i>`.
const NS_PREFIX: &str = "ftxemu-";
/// Bridge names: `fxb<pid>`.
const BRIDGE_PREFIX: &str = "fxb";
/// Root-namespace veth ends: `fxv<pid>h<i>`.
const VETH_PREFIX: &str = "fxv";
/// Namespace-side veth ends before they move: `fxn<pid>h<i>`.
const PEER_PREFIX: &str = "fxn";
/// The file in the run directory that holds `mpirun`'s PID.
pub const MPIRUN_PID_FILE: &str = "mpirun.pid";
/// The interface name every host sees inside its namespace.
pub const HOST_IF: &str = "ftx0";
/// The run directory (agent map, probe files): `<tmp>/ferrotext-emulate-<pid>`.
const RUN_DIR_PREFIX: &str = "ferrotext-emulate-";

/// Finds `tool` on `PATH`.
pub fn find_tool(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|p| p.is_file())
}

/// True when this process may create namespaces and links (CAP_NET_ADMIN in its effective set;
/// root normally has it).
pub fn has_net_admin() -> bool {
    const CAP_NET_ADMIN: u32 = 12;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_NET_ADMIN) != 0)
}

/// Runs `program args`, failing with its stderr.
fn sh(program: &str, args: &[&str]) -> Result<String> {
    let out = helper(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `program args`, ignoring failure (teardown of what may already be gone).
fn quiet(program: &str, args: &[&str]) {
    let _ = helper(program).args(args).output();
}

/// A set-up or teardown helper (`ip`, `tc`, `kill`) in a process group of its own, ignoring
/// the signals the launcher handles ([`STOP_SIGNALS`](super::STOP_SIGNALS)): a Ctrl-C sent to
/// the launcher's group (pressed again while it tears down) reaches the launcher, which handles
/// it, and not the helper halfway through removing a namespace or listing its processes — an
/// `ip netns pids` killed there would read as "no processes left".
///
/// The group alone left a window: a signal sent to the launcher's group between the helper's
/// start and its `setpgid` stayed pending while glibc's `posix_spawn` reset the launcher's
/// handlers to the default, and killed the helper before it ran when its mask was restored (a
/// teardown's `ip netns del` died so under a stream of Ctrl-C, and left a namespace behind).
/// The `pre_exec` hook makes std start the helper by `fork` and `exec`: until the `exec` a
/// signal finds the launcher's own handler (which sets a flag), and the helper execs with these
/// signals ignored.
pub(super) fn helper(program: &str) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    cmd.process_group(0);
    // SAFETY: the hook only calls `signal`, which is async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            for sig in super::STOP_SIGNALS {
                if libc::signal(sig, libc::SIG_IGN) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd
}

/// The names of one run's objects.
#[derive(Clone, Debug)]
struct Names {
    pid: u32,
}

impl Names {
    fn namespace(&self, host: usize) -> String {
        format!("{NS_PREFIX}{}-h{host}", self.pid)
    }
    fn bridge(&self) -> String {
        format!("{BRIDGE_PREFIX}{}", self.pid)
    }
    fn veth(&self, host: usize) -> String {
        format!("{VETH_PREFIX}{}h{host}", self.pid)
    }
    fn peer(&self, host: usize) -> String {
        format!("{PEER_PREFIX}{}h{host}", self.pid)
    }
    fn run_dir(&self) -> PathBuf {
        std::env::temp_dir().join(format!("{RUN_DIR_PREFIX}{}", self.pid))
    }
}

/// The PID a name of ours carries, when it is one of ours.
fn owner_of(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix(NS_PREFIX)
        .map(|r| r.split('-').next().unwrap_or(""))
        .or_else(|| name.strip_prefix(BRIDGE_PREFIX))
        .or_else(|| {
            name.strip_prefix(VETH_PREFIX)
                .or_else(|| name.strip_prefix(PEER_PREFIX))
                .map(|r| r.split('h').next().unwrap_or(""))
        })?;
    rest.parse().ok()
}

/// True when `pid` is a live emulate launcher: a `ferrotext` process, or any binary started as
/// `… emulate …` (a copy under another name owns its run as much); a reused PID running
/// something else does not count.
fn alive(pid: u32) -> bool {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    owns_a_run(comm.trim(), &cmdline)
}

/// Whether a process named `comm` with NUL-separated `cmdline` may own an emulate run.
fn owns_a_run(comm: &str, cmdline: &[u8]) -> bool {
    let subcommand = cmdline.split(|&b| b == 0).nth(1).unwrap_or_default();
    comm == "ferrotext" || subcommand == b"emulate" || subcommand == b"emulate-agent"
}

/// Namespaces of emulate runs that exist now (every one, live owner or not).
pub fn our_namespaces() -> Vec<String> {
    sh("ip", &["netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(NS_PREFIX) && owner_of(n).is_some())
        .map(str::to_string)
        .collect()
}

/// Links (bridges, veth ends) of emulate runs in this namespace.
pub fn our_links() -> Vec<String> {
    sh("ip", &["-o", "link", "show"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(':').nth(1))
        .map(|n| n.trim().split('@').next().unwrap_or("").to_string())
        .filter(|n| {
            [BRIDGE_PREFIX, VETH_PREFIX, PEER_PREFIX]
                .iter()
                .any(|p| n.starts_with(p))
                && owner_of(n).is_some()
        })
        .collect()
}

/// Ends the processes inside namespace `ns` (they were started there by an emulate run):
/// SIGTERM, then SIGKILL for those still there after a grace period.
fn end_processes_in(ns: &str, grace: Duration) {
    let pids = |ns: &str| -> Vec<String> {
        sh("ip", &["netns", "pids", ns])
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    let first = pids(ns);
    if first.is_empty() {
        return;
    }
    for pid in &first {
        quiet("kill", &["-TERM", pid]);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if pids(ns).is_empty() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in pids(ns) {
        quiet("kill", &["-KILL", &pid]);
    }
}

/// Removes what killed emulate runs left behind: their namespaces (and the processes still in
/// them), links and run directories. Returns what it removed.
pub fn remove_leftovers() -> Vec<String> {
    let mut removed = Vec::new();
    // First the killed run's `mpirun` (it can hang once its daemons are gone): its PID is in the
    // run directory, and its command line names that directory.
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(owner) = name
                .strip_prefix(RUN_DIR_PREFIX)
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            let pid_file = entry.path().join(MPIRUN_PID_FILE);
            let Some(pid) = std::fs::read_to_string(&pid_file)
                .ok()
                .and_then(|p| p.trim().parse::<u32>().ok())
            else {
                continue;
            };
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let ours =
                String::from_utf8_lossy(&cmdline).contains(&entry.path().display().to_string());
            if !alive(owner) && ours {
                quiet("kill", &["-KILL", &pid.to_string()]);
                removed.push(format!("mpirun (pid {pid})"));
            }
        }
    }
    for ns in our_namespaces() {
        if owner_of(&ns).is_some_and(|pid| !alive(pid)) {
            end_processes_in(&ns, Duration::from_secs(2));
            quiet("ip", &["netns", "del", &ns]);
            removed.push(ns);
        }
    }
    for link in our_links() {
        if owner_of(&link).is_some_and(|pid| !alive(pid)) {
            quiet("ip", &["link", "del", &link]);
            removed.push(link);
        }
    }
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name
                .strip_prefix(RUN_DIR_PREFIX)
                .and_then(|p| p.parse::<u32>().ok())
            {
                if !alive(pid) && std::fs::remove_dir_all(entry.path()).is_ok() {
                    removed.push(name);
                }
            }
        }
    }
    removed
}

/// An IPv4 prefix `net/len`.
#[derive(Clone, Copy, Debug)]
struct Prefix {
    net: u32,
    len: u32,
}

impl Prefix {
    fn parse(text: &str) -> Option<Prefix> {
        let (addr, len) = match text.split_once('/') {
            Some((a, l)) => (a, l.parse().ok()?),
            None => (text, 32),
        };
        let addr: Ipv4Addr = addr.parse().ok()?;
        (len <= 32).then_some(Prefix {
            net: u32::from(addr),
            len,
        })
    }

    fn overlaps(&self, other: &Prefix) -> bool {
        let len = self.len.min(other.len);
        let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
        self.net & mask == other.net & mask
    }
}

/// Every destination of every IPv4 route (all tables, the default route excepted) and every
/// address on the machine.
fn taken_prefixes() -> Result<Vec<Prefix>> {
    const ROUTE_TYPES: &[&str] = &[
        "unicast",
        "local",
        "broadcast",
        "multicast",
        "anycast",
        "unreachable",
        "blackhole",
        "prohibit",
        "throw",
        "nat",
    ];
    let mut taken = Vec::new();
    for line in sh("ip", &["-4", "-o", "route", "show", "table", "all"])?.lines() {
        let mut words = line.split_whitespace();
        let mut dest = words.next().unwrap_or("");
        if ROUTE_TYPES.contains(&dest) {
            dest = words.next().unwrap_or("");
        }
        if let Some(p) = Prefix::parse(dest) {
            taken.push(p);
        }
    }
    for line in sh("ip", &["-4", "-o", "addr", "show"])?.lines() {
        let mut words = line.split_whitespace();
        if words.any(|w| w == "inet") {
            if let Some(p) = words.next().and_then(Prefix::parse) {
                taken.push(p);
                taken.push(Prefix {
                    net: p.net,
                    len: 32,
                });
            }
        }
    }
    Ok(taken)
}

/// A private /24 (`10.x.y.0`, x in 128..=254) that overlaps nothing in `taken`, starting from a
/// place derived from `seed` so concurrent runs rarely try the same one.
fn free_subnet(taken: &[Prefix], seed: u32) -> Option<Ipv4Addr> {
    const SPAN: u32 = 127 * 256;
    (0..SPAN).find_map(|k| {
        let i = (seed.wrapping_mul(2_654_435_761) % SPAN + k) % SPAN;
        let candidate = Ipv4Addr::new(10, 128 + (i / 256) as u8, (i % 256) as u8, 0);
        let prefix = Prefix {
            net: u32::from(candidate),
            len: 24,
        };
        (!taken.iter().any(|t| t.overlaps(&prefix))).then_some(candidate)
    })
}

/// The emulated network of one run; dropped, it is torn down.
pub struct Network {
    names: Names,
    hosts: usize,
    subnet: Ipv4Addr,
    link: LinkSpec,
    torn_down: bool,
}

impl Network {
    /// Creates `hosts` namespaces on a bridge, each host's egress shaped to `link`.
    ///
    /// # Errors
    /// An `ip`/`tc` command failed (what was created so far is removed before returning), or
    /// no free private /24 was found.
    pub fn create(hosts: usize, link: &LinkSpec) -> Result<Network> {
        let names = Names {
            pid: std::process::id(),
        };
        let taken = taken_prefixes()?;
        let subnet = free_subnet(&taken, names.pid)
            .context("no private /24 in 10.128.0.0/9 is free of routes on this machine")?;
        let mut net = Network {
            names,
            hosts,
            subnet,
            link: link.clone(),
            torn_down: false,
        };
        net.build()?; // on error, `net` drops here and removes what exists
        Ok(net)
    }

    fn build(&mut self) -> Result<()> {
        std::fs::create_dir_all(self.run_dir()).context("creating the run directory")?;
        let bridge = self.names.bridge();
        let cidr = format!("{}/24", self.bridge_address());
        sh("ip", &["link", "add", &bridge, "type", "bridge"])?;
        let _ = std::fs::write(
            format!("/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6"),
            "1",
        );
        sh("ip", &["addr", "add", &cidr, "dev", &bridge])?;
        sh("ip", &["link", "set", &bridge, "up"])?;
        for host in 0..self.hosts {
            let ns = self.names.namespace(host);
            let (veth, peer) = (self.names.veth(host), self.names.peer(host));
            let addr = format!("{}/24", self.address(host));
            sh("ip", &["netns", "add", &ns])?;
            // No IPv6 chatter (router solicitations, DAD) in the byte counts.
            quiet(
                "ip",
                &[
                    "netns",
                    "exec",
                    &ns,
                    "sysctl",
                    "-q",
                    "-w",
                    "net.ipv6.conf.all.disable_ipv6=1",
                ],
            );
            sh(
                "ip",
                &["link", "add", &veth, "type", "veth", "peer", "name", &peer],
            )?;
            sh("ip", &["link", "set", &peer, "netns", &ns])?;
            sh("ip", &["-n", &ns, "link", "set", &peer, "name", HOST_IF])?;
            sh("ip", &["-n", &ns, "addr", "add", &addr, "dev", HOST_IF])?;
            sh("ip", &["-n", &ns, "link", "set", HOST_IF, "up"])?;
            sh("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
            let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{veth}/disable_ipv6"), "1");
            sh("ip", &["link", "set", &veth, "master", &bridge])?;
            sh("ip", &["link", "set", &veth, "up"])?;
            self.shape(&ns)?;
        }
        Ok(())
    }

    /// `tbf` at the link rate on the host's egress, under a `netem` delay when one is given.
    fn shape(&self, ns: &str) -> Result<()> {
        let rate = format!("{}bit", self.link.rate_bps);
        let burst = format!("{}b", tbf_burst_bytes(self.link.rate_bps));
        let peak = format!("{}bit", self.link.rate_bps + self.link.rate_bps / 100);
        let mut tbf = vec!["tbf", "rate", &rate, "burst", &burst, "latency", "100ms"];
        if self.link.rate_bps <= PEAK_CAPPED_MAX_BPS {
            tbf.extend(["peakrate", &peak, "mtu", PEAK_BUCKET_BYTES]);
        }
        match self.link.delay {
            None => {
                let mut args = vec!["-n", ns, "qdisc", "add", "dev", HOST_IF, "root"];
                args.extend(tbf);
                sh("tc", &args)?;
            }
            Some(delay) => {
                let delay = format!("{}us", delay.as_micros().max(1));
                sh(
                    "tc",
                    &[
                        "-n", ns, "qdisc", "add", "dev", HOST_IF, "root", "handle", "1:", "netem",
                        "delay", &delay, "limit", "100000",
                    ],
                )
                .map_err(|e| {
                    if e.to_string().contains("unknown") {
                        UsageError(format!(
                            "the link delay needs the kernel's netem qdisc (sch_netem), which \
                             this machine lacks; give the link without a delay ({e})"
                        ))
                        .into()
                    } else {
                        e
                    }
                })?;
                let mut args = vec![
                    "-n", ns, "qdisc", "add", "dev", HOST_IF, "parent", "1:", "handle", "2:",
                ];
                args.extend(tbf);
                sh("tc", &args)?;
            }
        }
        Ok(())
    }

    /// Hosts in the network.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// The subnet as `a.b.c.0/24`.
    pub fn cidr(&self) -> String {
        format!("{}/24", self.subnet)
    }

    /// Host `i`'s address: `.i+1`.
    pub fn address(&self, host: usize) -> Ipv4Addr {
        let o = self.subnet.octets();
        Ipv4Addr::new(o[0], o[1], o[2], host as u8 + 1)
    }

    /// The bridge's address (`.254`), where `mpirun` in the root namespace is reached.
    pub fn bridge_address(&self) -> Ipv4Addr {
        let o = self.subnet.octets();
        Ipv4Addr::new(o[0], o[1], o[2], 254)
    }

    /// Host `i`'s namespace.
    pub fn namespace(&self, host: usize) -> String {
        self.names.namespace(host)
    }

    /// The run directory (removed at teardown).
    pub fn run_dir(&self) -> PathBuf {
        self.names.run_dir()
    }

    /// Ends every process left in the namespaces, deletes the veths, namespaces and bridge, and
    /// removes the run directory. Idempotent; ignores what is already gone.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        for host in 0..self.hosts {
            end_processes_in(&self.names.namespace(host), Duration::from_secs(3));
        }
        for host in 0..self.hosts {
            // Deleting the root end removes the pair now (a namespace's own links go with it
            // only once the kernel gets to it).
            quiet("ip", &["link", "del", &self.names.veth(host)]);
            quiet("ip", &["link", "del", &self.names.peer(host)]);
            quiet("ip", &["netns", "del", &self.names.namespace(host)]);
        }
        quiet("ip", &["link", "del", &self.names.bridge()]);
        let _ = std::fs::remove_dir_all(self.run_dir());
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Links up to this rate also cap `tbf`'s peak rate at the link rate (+1%, as `tbf` needs a peak
/// above the rate), so a sender that was idle cannot burst its bucket at veth speed: measured on
/// 2 hosts at 1 Gbit/s, qwen3-peer per-micro-batch at GA 4 took 805 ms a step with the bucket
/// alone and 877 ms with the cap (the cost model: 888 ms), while a 16 MiB all-reduce kept 96% of
/// the link. Above it, pacing single 64 KiB packets outruns the qdisc's timer (10 Gbit/s: 66%
/// of the link with the cap, 85% without), so only the bucket applies.
const PEAK_CAPPED_MAX_BPS: u64 = 2_500_000_000;

/// The peak bucket: one GSO packet of 64 KiB plus headers.
const PEAK_BUCKET_BYTES: &str = "70000";

/// The token bucket of a host's `tbf`: 1 ms of traffic at the link's rate, at least 128 KiB (two
/// 64 KiB GSO packets). A real link never sends faster than its rate; the bucket lets a sender
/// that was idle do so for one bucket's worth, so it is kept as small as the shaper allows at
/// full rate. With the earlier 4 ms / 512 KiB bucket, per-parameter all-reduces separated by
/// compute passed mostly at veth speed (qwen3-peer per-micro-batch at GA 4, 2 hosts at 1 Gbit/s:
/// 682 ms a step, against 893 ms with this bucket and 865 ms from the cost model), and a 4 MiB
/// all-reduce at 10 Gbit/s ran 10% faster than the link.
fn tbf_burst_bytes(rate_bps: u64) -> u64 {
    (rate_bps / 8 / 1000).max(128 * 1024)
}

#[cfg(test)]
mod tests;
