//! The process's CPU time, user and system, for the steps' metrics: how much of a step the
//! kernel took (page faults of fresh buffers, thread wake-ups, copies into sockets) is something
//! a run reports, not something found with a profiler. Process-wide (every thread), from
//! `getrusage(RUSAGE_SELF)`; `None` where the platform has none.

use serde::Serialize;

/// CPU seconds spent by the whole process, split by where they ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CpuTime {
    /// In user space (ferrotext's own code and its libraries).
    pub user: f64,
    /// In the kernel on the process's behalf (page faults, system calls).
    pub system: f64,
}

impl CpuTime {
    /// The process's CPU time so far; `None` when `getrusage` is unavailable or fails.
    pub fn now() -> Option<CpuTime> {
        #[cfg(unix)]
        {
            let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
            // SAFETY: `getrusage` writes a `rusage` into the pointer it is given and nothing else.
            let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
            if rc != 0 {
                return None;
            }
            // SAFETY: `getrusage` returned 0, so it filled the struct (which was zeroed anyway).
            let usage = unsafe { usage.assume_init() };
            let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
            Some(CpuTime {
                user: seconds(usage.ru_utime),
                system: seconds(usage.ru_stime),
            })
        }
        #[cfg(not(unix))]
        {
            None
        }
    }

    /// The CPU time between `earlier` and `self` (never negative).
    pub fn since(self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            user: (self.user - earlier.user).max(0.0),
            system: (self.system - earlier.system).max(0.0),
        }
    }

    /// The system share of the total (0 when there was none).
    pub fn system_fraction(&self) -> f64 {
        let total = self.user + self.system;
        if total > 0.0 {
            self.system / total
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_moves_forward_with_work_and_the_fraction_is_a_share() {
        let start = CpuTime::now().expect("getrusage works on this platform");
        // Busy user-space work: user time grows by a visible amount.
        let mut x = 0u64;
        let t = std::time::Instant::now();
        while t.elapsed().as_millis() < 50 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let d = CpuTime::now().expect("getrusage").since(start);
        assert!(d.user > 0.01, "50 ms of spinning shows as user time: {d:?}");
        let f = CpuTime {
            user: 3.0,
            system: 1.0,
        }
        .system_fraction();
        assert!((f - 0.25).abs() < 1e-12);
        assert_eq!(CpuTime::default().system_fraction(), 0.0);
    }
}
