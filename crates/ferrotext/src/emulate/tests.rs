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
