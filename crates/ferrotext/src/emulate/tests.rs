use super::*;

/// A process that heeds SIGTERM ends at once; one that ignores it is killed after the grace
/// period. Either way its status comes back and it is reaped.
#[test]
fn stop_child_ends_a_process_that_would_run_on() {
    let mut polite = Command::new("sleep").arg("100").spawn().expect("sleep");
    let started = Instant::now();
    let status = stop_child(&mut polite).expect("stopped");
    assert!(!status.success());
    assert!(started.elapsed() < Duration::from_secs(4));
    let mut stubborn = Command::new("sh")
        .args(["-c", "trap '' TERM; exec sleep 100"])
        .spawn()
        .expect("sh");
    std::thread::sleep(Duration::from_millis(200));
    let status = stop_child(&mut stubborn).expect("killed");
    assert!(!status.success());
    assert!(stubborn.try_wait().expect("reaped").is_some());
}

/// A run whose hosts all started, or whose `never_started` names the hosts that did not.
fn job_run(never_started: Vec<usize>) -> JobRun {
    JobRun {
        exit_code: Some(0),
        hosts: Vec::new(),
        step_seconds: Vec::new(),
        losses: Vec::new(),
        timed_out: false,
        never_started,
    }
}

/// A lost launch is launched again until one starts; a launch that started is not launched
/// again (the mirror); after `LAUNCH_ATTEMPTS` lost ones the last is returned, naming its
/// hosts; an error ends the launches at once.
#[test]
fn a_lost_launch_is_launched_again_up_to_the_attempts() {
    let mut attempts = Vec::new();
    let run = relaunched(|a| {
        attempts.push(a);
        Ok(job_run(if a < 2 { vec![1] } else { Vec::new() }))
    })
    .expect("a run");
    assert_eq!(attempts, [1, 2]);
    assert!(run.never_started.is_empty());

    let mut attempts = Vec::new();
    relaunched(|a| {
        attempts.push(a);
        Ok(job_run(Vec::new()))
    })
    .expect("a run");
    assert_eq!(attempts, [1], "a job that started runs once");

    let mut attempts = Vec::new();
    let run = relaunched(|a| {
        attempts.push(a);
        Ok(job_run(vec![0, 3]))
    })
    .expect("a run");
    assert_eq!(attempts, (1..=LAUNCH_ATTEMPTS).collect::<Vec<_>>());
    assert_eq!(run.never_started, [0, 3]);

    let mut attempts = Vec::new();
    let failed = relaunched(|a| {
        attempts.push(a);
        Err(anyhow!("mpirun could not start"))
    });
    assert!(failed.is_err());
    assert_eq!(attempts, [1]);
}
