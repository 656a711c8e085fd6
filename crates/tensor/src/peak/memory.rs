//! The memory bandwidth probe: the bytes a second this machine's cores stream to and from
//! memory, the other side of the roofline (the profiler's per-op `roof` column).
//!
//! Every core adds a buffer into another (`dst += src`, 12 bytes an element: two reads, one
//! write), the buffers together [`BYTES`] (larger than the last-level caches of the machines
//! this runs on, so the stream comes from memory), all cores starting each window together
//! (a [`Barrier`]) since they share the memory bus; a window lasts as long as its slowest core,
//! and the best of [`WINDOWS`] counts (a window another process disturbed is slower, never
//! faster). Ops on data that fits in cache can beat this figure.

use std::sync::{Barrier, OnceLock};
use std::time::Instant;

/// Bytes of all the buffers together (source and destination over all cores).
const BYTES: usize = 256 << 20;

/// Windows timed; the best counts.
const WINDOWS: usize = 6;

/// This machine's streaming memory bandwidth over `cores` threads, bytes a second, measured on
/// the first call (about a quarter of a second and 256 MiB of memory, freed after) and kept
/// for the process.
pub fn memory_bandwidth(cores: usize) -> f64 {
    static BANDWIDTH: OnceLock<f64> = OnceLock::new();
    *BANDWIDTH.get_or_init(|| measure(cores.max(1)))
}

fn measure(cores: usize) -> f64 {
    let per_core = BYTES / 8 / cores;
    let barrier = Barrier::new(cores);
    let times: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cores)
            .map(|_| {
                s.spawn(|| {
                    let src = vec![1.0f32; per_core];
                    let mut dst = vec![0.0f32; per_core];
                    // A first pass touches every page.
                    stream_add(&mut dst, &src);
                    (0..WINDOWS)
                        .map(|_| {
                            barrier.wait();
                            let start = Instant::now();
                            stream_add(&mut dst, &src);
                            std::hint::black_box(&dst);
                            start.elapsed().as_secs_f64()
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let best = (0..WINDOWS)
        .map(|w| times.iter().map(|t| t[w]).fold(0.0, f64::max))
        .fold(f64::MAX, f64::min);
    (12 * per_core * times.len()) as f64 / best.max(1e-9)
}

/// `dst += src`, a plain loop the compiler vectorises.
fn stream_add(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bandwidth_is_measured_and_plausible() {
        let bw = memory_bandwidth(1);
        // Between a slow DIMM's 1 GB/s and an HBM part's 2 TB/s.
        assert!((1e9..2e12).contains(&bw), "{bw}");
        assert_eq!(memory_bandwidth(1), bw, "measured once");
    }
}
