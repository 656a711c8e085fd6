use super::*;

/// A run's owner is recognised under another binary name when it was started as
/// `… emulate`, so a second start does not take a live run's network for leftovers; a
/// reused PID running something else (the mirror) is not an owner.
#[test]
fn an_owner_is_a_ferrotext_or_an_emulate_launcher_under_any_name() {
    assert!(owns_a_run("ferrotext", b"/x/ferrotext\0train\0"));
    assert!(owns_a_run(
        "ferrotext-mpi",
        b"./ferrotext-mpi\0emulate\0--hosts\x002\0"
    ));
    assert!(owns_a_run("ft", b"/opt/ft\0emulate-agent\0"));
    assert!(!owns_a_run("sleep", b"sleep\x00100\0"));
    assert!(!owns_a_run("bash", b"bash\0-c\0echo emulate\0"));
    assert!(!owns_a_run("", b""));
}

#[test]
fn the_bucket_is_a_millisecond_of_traffic_and_at_least_two_gso_packets() {
    assert_eq!(tbf_burst_bytes(10_000_000_000), 1_250_000);
    assert_eq!(tbf_burst_bytes(1_000_000_000), 128 * 1024);
    assert_eq!(tbf_burst_bytes(100_000_000), 128 * 1024);
}

#[test]
fn link_specs_parse() {
    let l = LinkSpec::parse("1gbit,100us").unwrap();
    assert_eq!(l.rate_bps, 1_000_000_000);
    assert_eq!(l.delay, Some(Duration::from_micros(100)));
    assert_eq!(LinkSpec::parse("10gbit").unwrap().rate_bps, 10_000_000_000);
    assert_eq!(LinkSpec::parse("2.5Gbit").unwrap().rate_bps, 2_500_000_000);
    for bad in [
        "",
        "fast",
        "1gb",
        "0gbit",
        "1gbit,",
        "1gbit,5parsecs",
        "-1mbit",
    ] {
        assert!(LinkSpec::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn names_carry_their_owner() {
    let n = Names { pid: 4_194_303 };
    for name in [n.namespace(3), n.bridge(), n.veth(12), n.peer(12)] {
        assert_eq!(owner_of(&name), Some(4_194_303), "{name}");
        assert!(name.len() <= 15 || name.starts_with(NS_PREFIX), "{name}");
    }
    assert_eq!(owner_of("fxbridge"), None);
    assert_eq!(owner_of("eth0"), None);
}

#[test]
fn the_subnet_avoids_every_route() {
    let taken: Vec<Prefix> = ["10.128.0.0/16", "10.129.7.0/24", "192.0.2.0/24"]
        .iter()
        .filter_map(|p| Prefix::parse(p))
        .collect();
    for seed in 0..200 {
        let s = free_subnet(&taken, seed).unwrap();
        let p = Prefix {
            net: u32::from(s),
            len: 24,
        };
        assert!(!taken.iter().any(|t| t.overlaps(&p)), "{s}");
    }
    // A /9 route over the whole range leaves nothing.
    let all = [Prefix::parse("10.128.0.0/9").unwrap()];
    assert_eq!(free_subnet(&all, 1), None);
}

/// Waits until `child` runs `program` (it has passed its `exec`), at most 10 s.
fn wait_exec(child: &std::process::Child, program: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read_to_string(format!("/proc/{}/comm", child.id()))
        .map_or(true, |comm| comm.trim() != program)
    {
        assert!(Instant::now() < deadline, "{program} did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A child with each signal's default action, whatever this process inherited (a test run in
/// the background of a shell ignores SIGINT, and so would its children).
fn plain_sleep() -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new("sleep");
    cmd.arg("30");
    // SAFETY: only `signal`, async-signal-safe, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            for sig in super::super::STOP_SIGNALS {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    cmd
}

/// A set-up or teardown helper lives through each signal that stops a run (a Ctrl-C to the
/// launcher's group reaches a helper in the instant before its `setpgid`: a teardown's
/// `ip netns del` died so and left a namespace behind); the mirror, a child with the default
/// actions, dies of it.
#[test]
fn a_helper_outlives_the_signals_that_stop_a_run() {
    for sig in super::super::STOP_SIGNALS {
        let mut helped = helper("sleep").arg("30").spawn().expect("sleep");
        let mut plain = plain_sleep().spawn().expect("sleep");
        wait_exec(&helped, "sleep");
        wait_exec(&plain, "sleep");
        for child in [&helped, &plain] {
            // SAFETY: `kill` on the PID of a child this test started and has not reaped.
            assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
        }
        let status = plain.wait().expect("the plain child ends");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(sig),
            "the mirror dies of signal {sig}"
        );
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            helped.try_wait().expect("wait").is_none(),
            "a helper ended on signal {sig}"
        );
        helped.kill().expect("SIGKILL");
        helped.wait().expect("reaped");
    }
}
