//! The `mpirun` command of an emulated job: one process per host on the namespaces' addresses,
//! launched through `ferrotext emulate-agent`, with Open MPI pinned to the run's subnet.

use std::process::{Command, Stdio};

use anyhow::{Context, Result};

use super::net::{self, Network};
use super::{probe, usage, ENV_HOSTS};

/// The `mpirun` command that runs `job` (ferrotext arguments) on `net` with `local` devices per
/// host (`quiet`: its output dropped, its errors kept for a failed run); it ends its job when
/// this process dies.
///
/// # Errors
/// This executable's path cannot be found or holds white space.
pub(super) fn command(net: &Network, local: usize, job: &[String], quiet: bool) -> Result<Command> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let exe = exe
        .to_str()
        .filter(|e| !e.contains(char::is_whitespace))
        .ok_or_else(|| usage("emulate needs this executable's path without spaces"))?
        .to_string();
    let dir = net.run_dir();
    let hosts: Vec<String> = (0..net.hosts())
        .map(|h| format!("{}:{local}", net.address(h)))
        .collect();
    let map: Vec<String> = (0..net.hosts())
        .map(|h| format!("{}={}", net.address(h), net.namespace(h)))
        .collect();
    let cidr = net.cidr();
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &net.hosts().to_string(), "--host", &hosts.join(",")])
        .args(["--map-by", "ppr:1:node", "--bind-to", "none"])
        .args(["--mca", "plm_rsh_agent", &format!("{exe} emulate-agent")])
        .args(["--mca", "plm_rsh_no_tree_spawn", "1"])
        .args(["--mca", "btl", "tcp,self"])
        .args(["--mca", "btl_tcp_if_include", &cidr])
        .args(["--mca", "oob_tcp_if_include", &cidr])
        // The two workarounds: orted's hwloc topology write segfaults now and then; a direct
        // route avoids the routing tree for a handful of daemons.
        .args(["--mca", "rtc", "^hwloc", "--mca", "routed", "direct"])
        .args(["-x", &format!("{}={}", probe::ENV_IF, net::HOST_IF)])
        .args(["-x", &format!("{}={}", probe::ENV_DIR, dir.display())])
        .arg(&exe)
        .args(job)
        .env(ENV_HOSTS, map.join(","))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null());
    if quiet {
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    }
    // mpirun ends its job when this process dies, even by SIGKILL.
    // SAFETY: `prctl` is async-signal-safe and touches no memory of the parent; the closure runs
    // between fork and exec and only makes that call.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}
