//! Collectives on the in-process backend against a serial reference, on meshes (4), (2,2) and
//! (2,1,2), over every subset of axes; failure handling; the exact trace of a known sequence.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrotext_comm::{
    run_spmd, CollectiveKind, CommError, PhasePattern, RunError, SpmdOptions, TraceEvent,
};
use ferrotext_sharding::{DType, Mesh};
use half::bf16;

fn meshes() -> Vec<Arc<Mesh>> {
    vec![
        Arc::new(Mesh::explicit([("a", 4)]).unwrap()),
        Arc::new(Mesh::explicit([("a", 2), ("b", 2)]).unwrap()),
        Arc::new(Mesh::explicit([("a", 2), ("b", 1), ("c", 2)]).unwrap()),
    ]
}

/// Every subset of the mesh's axes in mesh order, plus each multi-axis subset reversed (rank order
/// then runs the other way).
fn axis_subsets(mesh: &Mesh) -> Vec<Vec<String>> {
    let names: Vec<String> = mesh.axis_names().map(str::to_string).collect();
    let mut subsets = Vec::new();
    for bits in 0..(1u32 << names.len()) {
        let subset: Vec<String> = names
            .iter()
            .enumerate()
            .filter(|(i, _)| bits & (1 << i) != 0)
            .map(|(_, n)| n.clone())
            .collect();
        if subset.len() > 1 {
            subsets.push(subset.iter().rev().cloned().collect());
        }
        subsets.push(subset);
    }
    subsets
}

/// Values with mixed magnitudes, so a different summation order would change the bits.
fn data(device: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = ((device * 7919 + i * 104_729) % 1000) as f32 / 7.0;
            if i % 3 == 0 {
                x * 1e-3
            } else {
                x * (1.0 + device as f32)
            }
        })
        .collect()
}

fn opts() -> SpmdOptions {
    SpmdOptions::default().with_timeout(Duration::from_secs(20))
}

/// The sum over the group in the tree order over its ranks, written out as a recursion
/// (`tree_sum`'s definition), the reference every backend must match bit for bit.
fn serial_sum(group: &[usize], len: usize) -> Vec<f32> {
    if group.len() == 1 {
        return data(group[0], len);
    }
    let split = ferrotext_comm::tree_sum::tree_split(group.len());
    let (left, right) = (
        serial_sum(&group[..split], len),
        serial_sum(&group[split..], len),
    );
    left.iter().zip(&right).map(|(a, b)| a + b).collect()
}

#[test]
fn all_reduce_matches_serial_reference_on_every_mesh_and_axis_subset() {
    for mesh in meshes() {
        for axes in axis_subsets(&mesh) {
            for len in [0, 1, 17, 1000, 9000] {
                let results = run_spmd(&mesh, &opts(), |dev| {
                    let mut x = data(dev.index(), len);
                    dev.comm().all_reduce(&axes, &mut x)?;
                    Ok::<_, CommError>(x)
                })
                .unwrap();
                for (d, got) in results.iter().enumerate() {
                    let group = mesh.group_of(d, &axes).unwrap();
                    let want = serial_sum(&group, len);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "mesh {mesh} axes {axes:?} len {len} device {d}"
                    );
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_all_gather_and_all_to_all_match_serial_reference() {
    for mesh in meshes() {
        for axes in axis_subsets(&mesh) {
            let m = 37; // per-rank chunk, not a multiple of anything
            let results = run_spmd(&mesh, &opts(), |dev| {
                let n = dev.comm().group(&axes)?.len();
                let input = data(dev.index(), n * m);
                let mut scattered = vec![0.0; m];
                dev.comm().reduce_scatter(&axes, &input, &mut scattered)?;
                let mut gathered = vec![0.0; n * m];
                dev.comm().all_gather(&axes, &scattered, &mut gathered)?;
                let mut reduced = input.clone();
                dev.comm().all_reduce(&axes, &mut reduced)?;
                let mut exchanged = vec![0.0; n * m];
                dev.comm().all_to_all(&axes, &input, &mut exchanged)?;
                Ok::<_, CommError>((scattered, gathered, reduced, exchanged))
            })
            .unwrap();
            for (d, (scattered, gathered, reduced, exchanged)) in results.iter().enumerate() {
                let group = mesh.group_of(d, &axes).unwrap();
                let n = group.len();
                let rank = group.iter().position(|&g| g == d).unwrap();
                let total = serial_sum(&group, n * m);
                assert_eq!(
                    scattered,
                    &total[rank * m..(rank + 1) * m],
                    "{mesh} {axes:?} d{d}"
                );
                // reduce-scatter ∘ all-gather is an all-reduce, bit for bit.
                assert_eq!(gathered, reduced, "{mesh} {axes:?} d{d}");
                assert_eq!(gathered, &total);
                // all-to-all: chunk k comes from member k's chunk `rank`.
                for (k, &src) in group.iter().enumerate() {
                    let theirs = data(src, n * m);
                    assert_eq!(
                        &exchanged[k * m..(k + 1) * m],
                        &theirs[rank * m..(rank + 1) * m]
                    );
                }
            }
        }
    }
}

#[test]
fn all_to_all_twice_is_the_identity() {
    let mesh = Arc::new(Mesh::explicit([("a", 2), ("b", 2)]).unwrap());
    let results = run_spmd(&mesh, &opts(), |dev| {
        let input = data(dev.index(), 4 * 5);
        let mut once = vec![0.0; 20];
        let mut twice = vec![0.0; 20];
        dev.comm().all_to_all(&["a", "b"], &input, &mut once)?;
        dev.comm().all_to_all(&["a", "b"], &once, &mut twice)?;
        Ok::<_, CommError>((input, once, twice))
    })
    .unwrap();
    for (input, once, twice) in results {
        assert_ne!(input, once);
        assert_eq!(input, twice);
    }
}

#[test]
fn broadcast_and_barrier() {
    for mesh in meshes() {
        for axes in axis_subsets(&mesh) {
            let results = run_spmd(&mesh, &opts(), |dev| {
                let group = dev.comm().group(&axes)?;
                let root = group.len() - 1;
                let mut x = data(dev.index(), 50);
                dev.comm().barrier(&axes)?;
                dev.comm().broadcast(&axes, root, &mut x)?;
                Ok::<_, CommError>((x, group[root]))
            })
            .unwrap();
            for (x, root_device) in results {
                assert_eq!(x, data(root_device, 50));
            }
        }
    }
}

#[test]
fn results_are_bitwise_identical_across_devices_and_runs() {
    let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
    let run = || {
        run_spmd(&mesh, &opts(), |dev| {
            let mut x = data(dev.index(), 100_003);
            dev.comm().all_reduce(&["data"], &mut x)?;
            Ok::<_, CommError>(x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>())
        })
        .unwrap()
    };
    let first = run();
    assert!(first.iter().all(|x| x == &first[0]));
    assert_eq!(first, run());
}

#[test]
fn bf16_all_reduce_sums_in_f32_and_rounds_once() {
    let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
    let results = run_spmd(&mesh, &opts(), |dev| {
        let mut x: Vec<bf16> = data(dev.index(), 300)
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        dev.comm().all_reduce(&["data"], &mut x)?;
        Ok::<_, CommError>(x)
    })
    .unwrap();
    let want: Vec<bf16> = (0..300)
        .map(|i| {
            let s: f32 = (0..4)
                .map(|d| bf16::from_f32(data(d, 300)[i]).to_f32())
                .sum();
            bf16::from_f32(s)
        })
        .collect();
    for got in results {
        assert_eq!(got, want);
    }
}

fn fast() -> SpmdOptions {
    SpmdOptions::default().with_timeout(Duration::from_secs(2))
}

#[test]
fn a_device_that_returns_early_fails_its_peers_promptly() {
    let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
    let start = Instant::now();
    let err = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        if dev.index() == 2 {
            return Err(CommError::BadBuffer {
                kind: CollectiveKind::Barrier,
                axes: vec![],
                group_size: 1,
                reason: "device 2 gives up".into(),
            });
        }
        let mut x = vec![1.0f32; 10];
        dev.comm().all_reduce(&["data"], &mut x)?;
        Ok(())
    })
    .unwrap_err();
    // The root cause is reported, not the peers' consequences, and nobody waited for the 300 s
    // default timeout.
    assert_eq!(err.device(), 2);
    assert!(err.to_string().contains("device 2 gives up"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn peers_see_the_departure() {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let outcome = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        if dev.index() == 0 {
            return Ok(None); // leaves without the collective
        }
        let mut x = vec![1.0f32; 4];
        Ok::<_, CommError>(Some(dev.comm().all_reduce(&["data"], &mut x)))
    })
    .unwrap();
    match &outcome[1] {
        Some(Err(CommError::PeerDeparted {
            departed: 0,
            kind: CollectiveKind::AllReduce,
            ..
        })) => {}
        other => panic!("expected PeerDeparted, got {other:?}"),
    }
}

#[test]
fn a_panicking_device_becomes_an_error_not_a_hang() {
    let mesh = Arc::new(Mesh::explicit([("a", 2), ("b", 2)]).unwrap());
    let start = Instant::now();
    let err = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        if dev.index() == 3 {
            panic!("kernel bug on device 3");
        }
        let mut x = vec![1.0f32; 10];
        dev.comm().all_reduce(&["a", "b"], &mut x)?;
        Ok::<_, CommError>(())
    })
    .unwrap_err();
    match err {
        RunError::Panicked { device: 3, message } => assert!(message.contains("kernel bug")),
        other => panic!("expected the panic of device 3, got {other}"),
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn different_collectives_at_the_same_point_are_a_mismatch_on_every_device() {
    let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
    // Same kind, different length.
    let outcome = run_spmd(&mesh, &fast(), |dev| {
        let mut x = vec![1.0f32; if dev.index() == 1 { 11 } else { 10 }];
        Ok::<_, CommError>(dev.comm().all_reduce(&["data"], &mut x))
    })
    .unwrap();
    for r in &outcome {
        assert!(
            matches!(r, Err(CommError::Mismatch { seq: 0, .. })),
            "{r:?}"
        );
    }
    // Different kind.
    let outcome = run_spmd(&mesh, &fast(), |dev| {
        let mut x = vec![1.0f32; 8];
        Ok::<_, CommError>(if dev.index() == 0 {
            dev.comm().broadcast(&["data"], 0, &mut x)
        } else {
            dev.comm().all_reduce(&["data"], &mut x)
        })
    })
    .unwrap();
    for r in &outcome {
        let msg = r.as_ref().unwrap_err().to_string();
        assert!(
            msg.contains("collective mismatch at collective #0"),
            "{msg}"
        );
    }
}

#[test]
fn different_axes_are_detected_without_waiting_for_the_timeout() {
    let mesh = Arc::new(Mesh::explicit([("data", 2), ("tensor", 2)]).unwrap());
    let start = Instant::now();
    // Device 0 reduces over `tensor` (group {0, 1}), the others over both axes (all four): no
    // group can complete, and the first device to notice must name the mismatch.
    let err = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let axes: &[&str] = if dev.index() == 0 {
            &["tensor"]
        } else {
            &["data", "tensor"]
        };
        let mut x = vec![1.0f32; 8];
        dev.comm().all_reduce(axes, &mut x)
    })
    .unwrap_err();
    match err {
        RunError::Device {
            error: CommError::Mismatch { mine, theirs, .. },
            ..
        } => {
            let both = format!("{mine} / {theirs}");
            assert!(
                both.contains("[\"tensor\"]") && both.contains("[\"data\", \"tensor\"]"),
                "{both}"
            );
        }
        other => panic!("expected a mismatch, got {other}"),
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_peer_that_never_arrives_times_out() {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let outcome = run_spmd(
        &mesh,
        &SpmdOptions::default().with_timeout(timeout),
        |dev| {
            if dev.index() == 1 {
                // Busy elsewhere for longer than the timeout, then joins too late.
                std::thread::sleep(Duration::from_millis(1500));
            }
            let mut x = vec![1.0f32; 4];
            Ok::<_, CommError>(dev.comm().all_reduce(&["data"], &mut x))
        },
    )
    .unwrap();
    match &outcome[0] {
        Err(CommError::Timeout {
            missing, waited, ..
        }) => {
            assert_eq!(missing, &vec![1]);
            assert!(*waited >= timeout);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // The late device finds the group broken instead of waiting again.
    assert!(
        matches!(outcome[1], Err(CommError::Timeout { .. })),
        "{:?}",
        outcome[1]
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn bad_buffers_and_axes_are_rejected_before_communicating() {
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    let outcome = run_spmd(&mesh, &fast(), |dev| {
        let c = dev.comm();
        let mut out = vec![0.0f32; 3];
        Ok::<_, CommError>(vec![
            c.all_reduce(&["nope"], &mut out),
            c.reduce_scatter(&["data"], &[1.0; 4], &mut out),
            c.all_gather(&["data"], &[1.0; 4], &mut out),
            c.broadcast(&["data"], 1, &mut out),
        ])
    })
    .unwrap();
    let errs: Vec<String> = outcome[0]
        .iter()
        .map(|r| r.as_ref().unwrap_err().to_string())
        .collect();
    assert!(
        errs[0].contains("mesh axis `nope` is not in the mesh"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].contains("input has 4 elements; it must be group × output = 3"),
        "{}",
        errs[1]
    );
    assert!(
        errs[2].contains("output has 3 elements; it must be group × input = 4"),
        "{}",
        errs[2]
    );
    assert!(
        errs[3].contains("root rank 1 is not in the group"),
        "{}",
        errs[3]
    );
}

#[test]
fn the_trace_records_a_known_sequence_exactly() {
    let mesh = Arc::new(Mesh::explicit([("data", 2), ("tensor", 2)]).unwrap());
    let traces = run_spmd(&mesh, &opts(), |dev| {
        let c = dev.comm();
        for micro in 0..2 {
            c.push_phase(format!("micro_batch {micro}"));
            let mut loss = [1.0f32];
            c.all_reduce(&["data"], &mut loss)?;
            c.pop_phase();
        }
        c.push_phase("update");
        let grads = vec![1.0f32; 64];
        let mut shard = vec![0.0f32; 32];
        c.reduce_scatter(&["data"], &grads, &mut shard)?;
        c.push_phase("gather");
        let mut params = vec![0.0f32; 64];
        c.all_gather(&["data"], &shard, &mut params)?;
        c.pop_phase();
        c.pop_phase();
        let mut bf = vec![bf16::ONE; 6];
        c.all_reduce(&["data", "tensor"], &mut bf)?;
        c.barrier(&["tensor"])?;
        Ok::<_, CommError>(c.take_trace())
    })
    .unwrap();
    let ev =
        |seq, kind, axes: &[&str], group_size, elements, dtype: DType, phase: &str| TraceEvent {
            seq,
            kind,
            axes: axes.iter().map(|a| a.to_string()).collect(),
            group_size,
            elements,
            bytes: elements * dtype.size_bytes(),
            dtype,
            phase: phase.to_string(),
        };
    use CollectiveKind::*;
    let want = vec![
        ev(0, AllReduce, &["data"], 2, 1, DType::F32, "micro_batch 0"),
        ev(1, AllReduce, &["data"], 2, 1, DType::F32, "micro_batch 1"),
        ev(2, ReduceScatter, &["data"], 2, 64, DType::F32, "update"),
        ev(3, AllGather, &["data"], 2, 64, DType::F32, "update/gather"),
        ev(4, AllReduce, &["data", "tensor"], 4, 6, DType::BF16, ""),
        ev(5, Barrier, &["tensor"], 2, 0, DType::F32, ""),
    ];
    for trace in &traces {
        assert_eq!(trace.events(), want.as_slice());
    }
    let t = &traces[0];
    assert_eq!(
        t.all_reduces_larger_than(8, &PhasePattern::new("micro_batch*"))
            .len(),
        0
    );
    assert_eq!(t.count(ReduceScatter, &PhasePattern::new("update*")), 1);
    assert_eq!(t.bytes(AllGather, &PhasePattern::any()), 256);
}

/// A cluster of `processes` processes in which this one is `process`, whose "remote" transport is
/// the local backend: enough to run groups that stay inside the process.
struct FakeCluster {
    process: usize,
    processes: usize,
}

impl ferrotext_comm::Cluster for FakeCluster {
    fn process(&self) -> usize {
        self.process
    }
    fn processes(&self) -> usize {
        self.processes
    }
    fn processes_on_this_host(&self) -> usize {
        self.processes
    }
    fn describe(&self) -> String {
        "fake".into()
    }
    fn backend(
        &self,
        _device: usize,
        _devices_per_process: usize,
        _timeout: Duration,
        local: ferrotext_comm::LocalBackend,
    ) -> Box<dyn ferrotext_comm::Backend> {
        Box::new(local)
    }
    fn stream_backend(
        &self,
        _device: usize,
        _devices_per_process: usize,
        _timeout: Duration,
        local: ferrotext_comm::LocalBackend,
    ) -> Box<dyn ferrotext_comm::Backend> {
        Box::new(local)
    }
    fn agree(&self, _what: &str, _bytes: &[u8], _timeout: Duration) -> Result<(), CommError> {
        Ok(())
    }
}

#[test]
fn a_process_runs_its_own_consecutive_devices() {
    let mesh = Arc::new(Mesh::explicit([("data", 2), ("tensor", 2)]).unwrap());
    let cluster = FakeCluster {
        process: 1,
        processes: 2,
    };
    let results =
        ferrotext_comm::run_spmd_in(Some(&cluster), &mesh, &SpmdOptions::default(), |dev| {
            // `tensor` groups stay inside a process: devices {2, 3} here.
            let mut x = vec![dev.index() as f32; 3];
            dev.comm().all_reduce(&["tensor"], &mut x)?;
            Ok::<_, CommError>((dev.index(), x[0]))
        })
        .unwrap();
    assert_eq!(results, vec![(2, 5.0), (3, 5.0)]);
}

#[test]
fn a_mesh_that_does_not_split_over_the_processes_is_refused() {
    let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
    let cluster = FakeCluster {
        process: 0,
        processes: 3,
    };
    let err = ferrotext_comm::run_spmd_in(Some(&cluster), &mesh, &SpmdOptions::default(), |_| {
        Ok::<_, CommError>(())
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "a mesh of 4 devices cannot be split evenly over 3 processes"
    );
}

/// A device busy far longer than the timeout, outside any collective: `run_spmd` would join it;
/// the detachable run returns a little after its peer times out and names it as left running.
#[test]
fn a_stalled_device_is_left_behind_and_named() {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let timeout = Duration::from_millis(300);
    // Device 1 blocks until this sender is dropped, at the end of the test.
    let (release, blocked) = std::sync::mpsc::channel::<()>();
    let blocked = std::sync::Mutex::new(blocked);
    let start = Instant::now();
    let err = ferrotext_comm::run_spmd_detachable(
        None,
        &mesh,
        &SpmdOptions::default().with_timeout(timeout),
        move |dev| {
            if dev.index() == 1 {
                let _ = blocked.lock().map(|rx| rx.recv());
            }
            let mut x = vec![1.0f32; 4];
            dev.comm().all_reduce(&["data"], &mut x)
        },
    )
    .unwrap_err();
    let elapsed = start.elapsed();
    assert_eq!(err.left_running, vec![1], "{err}");
    match &err.error {
        RunError::Device {
            device: 0,
            error: CommError::Timeout { missing, .. },
        } => assert_eq!(missing, &vec![1]),
        other => panic!("expected device 0's timeout, got {other}"),
    }
    assert!(
        err.to_string().contains("devices [1] were still running"),
        "{err}"
    );
    // Returned at all, long before device 1 (blocked for good) could have finished.
    assert!(elapsed < 20 * timeout, "took {elapsed:?}");
    drop(release);
}

#[test]
fn a_detachable_run_that_succeeds_returns_every_result() {
    let mesh = Arc::new(Mesh::explicit([("data", 4)]).unwrap());
    let results = ferrotext_comm::run_spmd_detachable(None, &mesh, &opts(), |dev| {
        let mut x = vec![dev.index() as f32; 3];
        dev.comm().all_reduce(&["data"], &mut x)?;
        Ok::<_, CommError>(x[0])
    })
    .unwrap();
    assert_eq!(results, vec![6.0; 4]);
}

#[test]
fn timeouts_that_are_not_a_number_of_seconds_are_errors_not_panics() {
    for bad in [f64::NAN, f64::INFINITY, -1.0, 0.0, 1e30, 1e10] {
        let err = SpmdOptions::default().with_timeout_secs(bad).unwrap_err();
        assert!(
            matches!(err, CommError::InvalidOption { .. }),
            "{bad}: {err:?}"
        );
        assert!(err.to_string().contains("collective timeout"), "{err}");
    }
    let ok = SpmdOptions::default().with_timeout_secs(1.5).unwrap();
    assert_eq!(ok.collective_timeout, Duration::from_millis(1500));
    assert_eq!(
        ferrotext_comm::collective_timeout(31_536_000.0).unwrap(),
        ferrotext_comm::MAX_COLLECTIVE_TIMEOUT
    );
}

/// A device thread the operating system refuses to start (here: a stack it cannot map) is an
/// error naming the device, from both runners; it used to panic in `run_spmd_in`.
#[test]
fn a_device_thread_that_cannot_start_is_an_error_not_a_panic() {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let options = SpmdOptions {
        stack_size: 1 << 60,
        ..opts()
    };
    let err = run_spmd(&mesh, &options, |dev| {
        let mut x = vec![1.0f32; 4];
        dev.comm().all_reduce(&["data"], &mut x)
    })
    .unwrap_err();
    assert_eq!(err.device(), 0);
    assert!(err.to_string().contains("could not be started"), "{err}");
    let err = ferrotext_comm::run_spmd_detachable(None, &mesh, &options, |dev| {
        let mut x = vec![1.0f32; 4];
        dev.comm().all_reduce(&["data"], &mut x)
    })
    .unwrap_err();
    assert!(err.to_string().contains("could not be started"), "{err}");
    assert!(err.left_running.is_empty());
}

/// Background collectives: started in order, they run on the device's stream while the device
/// goes on (even into blocking collectives of its own), and give the blocking collectives'
/// results bit for bit.
#[test]
fn background_collectives_match_the_blocking_ones_and_do_not_meet_them() {
    let mesh = Arc::new(Mesh::explicit([("data", 2), ("tensor", 2)]).unwrap());
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let comm = dev.comm();
        assert!(comm.has_stream());
        let d = comm.device() as f32;
        let data: Vec<f32> = (0..1001).map(|i| (i as f32 * 0.1 + d).sin()).collect();
        // Start three background jobs, then run blocking collectives on the same groups while
        // they are in flight: separate channels, so no mismatch.
        let reduce = comm.start_all_reduce(&["data"], data.clone())?;
        let scatter = comm.start_reduce_scatter(&["data", "tensor"], data[..1000].to_vec())?;
        let gather = comm.start_all_gather(&["tensor"], data[..10].to_vec())?;
        let mut blocking = data.clone();
        comm.all_reduce(&["data"], &mut blocking)?;
        let mut scattered = vec![0.0; 250];
        comm.reduce_scatter(&["data", "tensor"], &data[..1000], &mut scattered)?;
        let mut gathered = vec![0.0; 20];
        comm.all_gather(&["tensor"], &data[..10], &mut gathered)?;
        Ok::<_, CommError>((
            reduce.wait()? == blocking,
            scatter.wait()? == scattered,
            gather.wait()? == gathered,
            comm.take_trace().events().len(),
        ))
    })
    .unwrap();
    for (reduced, scattered, gathered, events) in out {
        assert!(reduced && scattered && gathered);
        assert_eq!(events, 6, "background collectives are in the trace too");
    }
}

/// A background collective whose peer never starts it fails within the timeout.
#[test]
fn a_background_collective_without_its_peer_times_out() {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let opts = SpmdOptions::default().with_timeout(std::time::Duration::from_millis(300));
    let out = run_spmd(&mesh, &opts, |dev| {
        let comm = dev.comm();
        if comm.device() == 1 {
            std::thread::sleep(std::time::Duration::from_millis(600));
            return Ok::<_, CommError>(None);
        }
        Ok(Some(
            comm.start_all_reduce(&["data"], vec![1.0; 8])?.wait()?,
        ))
    });
    let err = out.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        err.contains("timed out") || err.contains("departed") || err.contains("left"),
        "{err}"
    );
}
