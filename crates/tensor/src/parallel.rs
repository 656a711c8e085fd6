//! The kernel thread budget, set in one visible place, and the deterministic chunked parallel
//! loop the row and elementwise kernels share.
//!
//! A device runs under [`with_kernel_pool`] with its share of the cores (`cores / local_devices`,
//! docs/design.md §3), which sets its thread's budget ([`set_kernel_threads`]); every kernel that
//! takes no explicit `threads` argument then runs on that many threads (1 until set, so a caller
//! that never sets it gets single-threaded kernels). [`crate::dot_general`] keeps its explicit
//! argument.
//!
//! Invariant: results never depend on the thread count. Work is cut into chunks of a fixed
//! size that depends only on the shape, each chunk is computed by exactly the same code
//! whichever thread runs it, and anything summed across chunks is summed in chunk order after
//! the parallel part. The threads are the rayon pool the caller runs on, as those of `gemm`'s
//! `Parallelism::Rayon` are: the device's own pool, of its budget's size, under
//! [`with_kernel_pool`] (its thread is then one of the workers), else rayon's global pool.
//! A kernel uses `threads` tasks, each taking a contiguous run of chunks.

use std::cell::Cell;
use std::mem::MaybeUninit;

use rayon::prelude::*;

thread_local! {
    static KERNEL_THREADS: Cell<usize> = const { Cell::new(1) };
}

/// Sets this thread's kernel thread budget (at least 1) for kernels that take no explicit
/// `threads` argument. Results do not depend on it, only speed.
pub fn set_kernel_threads(threads: usize) {
    KERNEL_THREADS.with(|t| t.set(threads.max(1)));
}

/// This thread's kernel thread budget (1 unless [`set_kernel_threads`] was called).
pub fn kernel_threads() -> usize {
    KERNEL_THREADS.with(Cell::get)
}

/// Runs `f` under a kernel budget of `threads` (at least 1), and returns what it returns.
///
/// With more than one thread, `f` runs on a rayon pool of its own with `threads` workers
/// (named `{name}-{i}`, each with a `stack_bytes` stack), so the thread running `f` is one of
/// the workers its kernels split over: a parallel kernel runs one part on that thread and
/// hands the rest to the pool's other workers, instead of handing every part to the global
/// pool and sleeping until they finish. While `f` runs, the other workers stay awake
/// (`KeepAwake`). The calling thread waits meanwhile. When the pool cannot be made (no
/// threads left), `f` runs here on the global pool, with the same results: results never
/// depend on the pool.
pub fn with_kernel_pool<R, F>(threads: usize, name: &str, stack_bytes: usize, f: F) -> R
where
    R: Send,
    F: FnOnce() -> R + Send,
{
    let threads = threads.max(1);
    if threads > 1 {
        let prefix = name.to_string();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("{prefix}-{i}"))
            .stack_size(stack_bytes)
            .build();
        if let Ok(pool) = pool {
            return pool.install(|| {
                set_kernel_threads(threads);
                let _awake = KeepAwake::start(threads - 1);
                f()
            });
        }
    }
    set_kernel_threads(threads);
    f()
}

/// Keeps a device pool's other workers awake while the device program runs: each loops taking
/// whatever part of a kernel is pending in the pool (`rayon::yield_now`), and yields its core
/// when there is none, instead of going to sleep. A device's pool has cores of its own (its
/// budget is its share), and the program hands it parts back to back (every split product,
/// attention, row kernel), so a sleeping worker was woken hundreds of times a micro-batch —
/// a futex wake and an interprocessor interrupt each, tens of µs on a virtual machine — and the
/// part often ran late or went back to the program's thread. Measured (qwen3-peer, data=1,
/// GA 4, 7 alternated pairs): 214–240 → 189–217 ms a step. Yielding the core when idle lets any
/// other thread on it (a communication stream) run. A worker that has found nothing for
/// [`IDLE_BEFORE_NAPS`] naps [`NAP`] at a time instead ([`Idle`]): the gaps between a step's
/// kernels are tens of µs, but start-up, checkpoints and the host's work between steps are
/// seconds of one thread, which a yielding worker spent in `sched_yield` (a one-step
/// qwen3-0.6b run: 103 M calls, 5.9 M with naps). Dropping it (also on a panic) releases the
/// workers.
struct KeepAwake {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl KeepAwake {
    /// Occupies `workers` of the current pool's workers (called on one of them).
    fn start(workers: usize) -> KeepAwake {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        for _ in 0..workers {
            let stop = stop.clone();
            rayon::spawn(move || {
                let mut idle = Idle::default();
                while !stop.load(Ordering::Relaxed) {
                    let found = rayon::yield_now() == Some(rayon::Yield::Executed);
                    match idle.next(found, std::time::Instant::now()) {
                        Wait::Again => {}
                        Wait::Yield => std::thread::yield_now(),
                        Wait::Nap => std::thread::sleep(NAP),
                    }
                }
            });
        }
        KeepAwake { stop }
    }
}

/// How long a kept-awake worker yields its core between looks for work before it naps: far
/// above the gaps between a step's kernels (tens of µs; the longest, the host's work between
/// micro-batches, under 2 ms at qwen3-peer), far below start-up's or a checkpoint's seconds.
const IDLE_BEFORE_NAPS: std::time::Duration = std::time::Duration::from_millis(5);

/// How long a worker idle past [`IDLE_BEFORE_NAPS`] sleeps between looks: the most a kernel's
/// first part waits for it after a long idle stretch (the program's thread runs the part itself
/// when it gets there first).
const NAP: std::time::Duration = std::time::Duration::from_micros(200);

/// What a kept-awake worker does after a look for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    /// It ran a part: look again at once.
    Again,
    /// Nothing, for less than [`IDLE_BEFORE_NAPS`]: yield the core, then look again.
    Yield,
    /// Nothing for [`IDLE_BEFORE_NAPS`] or longer: sleep [`NAP`], then look again.
    Nap,
}

/// A kept-awake worker's idle stretch: since when it has found no work.
#[derive(Default)]
struct Idle {
    since: Option<std::time::Instant>,
}

impl Idle {
    /// What to do after a look at `now` that `found` work or not.
    fn next(&mut self, found: bool, now: std::time::Instant) -> Wait {
        if found {
            self.since = None;
            return Wait::Again;
        }
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) < IDLE_BEFORE_NAPS {
            Wait::Yield
        } else {
            Wait::Nap
        }
    }
}

impl Drop for KeepAwake {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How much a kernel computes per element, which sets how large a part must be before it is
/// worth handing to another thread. A device's workers are kept awake ([`KeepAwake`]), so
/// handing a part over costs a queue push and a steal, not a wake-up (which cost tens of µs:
/// with sleeping workers, a residual add of 128 Ki elements split in two took 3–5× its
/// one-thread time, and the minimum part was 256 Ki elements). Measured with the workers awake
/// (`cargo run --release -p ferrotext-tensor --example kernels -- threads=2`, qwen3-peer's
/// data=1 shapes, 256 Ki → 32 Ki elements a light part, 64 Ki → 16 Ki a heavy one): add
/// [512,256] 0.016 → 0.0075 ms, RMSNorm 0.028 → 0.015 ms, its backward 0.058 → 0.039 ms,
/// QK-norm 0.052 → 0.033 ms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Work {
    /// A few arithmetic operations per element (adds, scales, norms, rotations): bound by
    /// memory, ~0.1–0.3 ns an element.
    Light,
    /// An exponential (or a small product) per element (softmax, SiLU, cross-entropy,
    /// attention rows): several ns an element.
    Heavy,
}

impl Work {
    /// The fewest elements a part of this kind of kernel gets.
    const fn min_per_task(self) -> usize {
        match self {
            Work::Light => 1 << 15,
            Work::Heavy => 1 << 14,
        }
    }
}

/// How many tasks to split `elements` of `work` into under a budget of `threads`: as many as
/// the budget allows with each at least [`Work::min_per_task`], and 1 below two such parts.
pub(crate) fn tasks_for(elements: usize, threads: usize, work: Work) -> usize {
    let min = work.min_per_task();
    if threads <= 1 || elements < 2 * min {
        1
    } else {
        threads.min(elements / min).max(1)
    }
}

/// A vector of `len` elements that `fill` writes, handed to it uninitialised: a kernel's output
/// that every element of is computed needs no zeroing pass first (a freed block the allocator
/// hands back is not zero, so `vec![0.0; len]` is a `memset`: one more write of the whole
/// output, on kernels bound by memory).
///
/// # Safety
/// `fill` must write every one of the `len` elements.
pub(crate) unsafe fn filled<T>(len: usize, fill: impl FnOnce(&mut [MaybeUninit<T>])) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    fill(&mut v.spare_capacity_mut()[..len]);
    // SAFETY: the caller's contract: all `len` elements are written.
    unsafe { v.set_len(len) };
    v
}

/// `f(chunk_index, chunk)` over `data` cut into chunks of `chunk` elements (the last may be
/// shorter), on up to `threads` tasks. Each chunk sees the same call whatever `threads` is.
pub(crate) fn for_each_chunk<T, F>(data: &mut [T], chunk: usize, threads: usize, work: Work, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync,
{
    let chunk = chunk.max(1);
    let tasks = tasks_for(data.len(), threads, work);
    if tasks == 1 {
        for (i, c) in data.chunks_mut(chunk).enumerate() {
            f(i, c);
        }
        return;
    }
    let chunks = data.len().div_ceil(chunk);
    let per_task = chunks.div_ceil(tasks) * chunk;
    data.par_chunks_mut(per_task)
        .enumerate()
        .for_each(|(task, run)| {
            let first = task * per_task / chunk;
            for (i, c) in run.chunks_mut(chunk).enumerate() {
                f(first + i, c);
            }
        });
}

/// `f(i)` for every `i < count`, on up to `threads` tasks of consecutive indices, the split
/// sized as [`tasks_for`] sizes `elements` of `work` (the whole call's, not one index's): for
/// kernels whose outputs are not one buffer cut in chunks (the tiled attention writes rows
/// interleaved across heads). Each index sees the same call whatever `threads` is.
pub(crate) fn for_each_index<F>(count: usize, elements: usize, threads: usize, work: Work, f: F)
where
    F: Fn(usize) + Sync,
{
    let tasks = tasks_for(elements, threads, work).min(count.max(1));
    if tasks <= 1 {
        (0..count).for_each(f);
        return;
    }
    let per_task = count.div_ceil(tasks);
    (0..tasks).into_par_iter().for_each(|task| {
        (task * per_task..((task + 1) * per_task).min(count)).for_each(&f);
    });
}

/// Like [`for_each_chunk`] over two equally chunked buffers (`a` in chunks of `chunk_a`, `b`
/// in chunks of `chunk_b`, the same number of chunks).
pub(crate) fn for_each_chunk2<A, B, F>(
    a: &mut [A],
    chunk_a: usize,
    b: &mut [B],
    chunk_b: usize,
    threads: usize,
    work: Work,
    f: F,
) where
    A: Send,
    B: Send,
    F: Fn(usize, &mut [A], &mut [B]) + Sync,
{
    let (chunk_a, chunk_b) = (chunk_a.max(1), chunk_b.max(1));
    let chunks = a.len().div_ceil(chunk_a);
    let tasks = tasks_for(a.len() + b.len(), threads, work).min(chunks.max(1));
    if tasks == 1 {
        for (i, (ca, cb)) in a.chunks_mut(chunk_a).zip(b.chunks_mut(chunk_b)).enumerate() {
            f(i, ca, cb);
        }
        return;
    }
    let per_task = chunks.div_ceil(tasks);
    a.par_chunks_mut(per_task * chunk_a)
        .zip(b.par_chunks_mut(per_task * chunk_b))
        .enumerate()
        .for_each(|(task, (ra, rb))| {
            for (i, (ca, cb)) in ra
                .chunks_mut(chunk_a)
                .zip(rb.chunks_mut(chunk_b))
                .enumerate()
            {
                f(task * per_task + i, ca, cb);
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker yields through an idle stretch shorter than [`IDLE_BEFORE_NAPS`], naps past it,
    /// and any part it runs starts the stretch again (times given, not measured).
    #[test]
    fn an_idle_worker_yields_then_naps_and_work_wakes_it() {
        let t0 = std::time::Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        let mut idle = Idle::default();
        assert_eq!(idle.next(false, at(0)), Wait::Yield);
        assert_eq!(idle.next(false, at(4)), Wait::Yield);
        assert_eq!(idle.next(false, at(5)), Wait::Nap);
        assert_eq!(idle.next(false, at(500)), Wait::Nap);
        assert_eq!(idle.next(true, at(501)), Wait::Again);
        assert_eq!(idle.next(false, at(502)), Wait::Yield);
        assert_eq!(idle.next(false, at(506)), Wait::Yield);
        assert_eq!(idle.next(false, at(507)), Wait::Nap);
    }

    #[test]
    fn every_chunk_is_visited_once_with_its_index_whatever_the_threads() {
        for len in [0usize, 1, 7, (1 << 16) - 1, (1 << 17) * 3 + 5] {
            for chunk in [1usize, 3, 64, 1000] {
                let want: Vec<f32> = (0..len).map(|i| (i / chunk) as f32).collect();
                for threads in [1, 2, 3, 8] {
                    let mut data = vec![-1.0f32; len];
                    for_each_chunk(&mut data, chunk, threads, Work::Heavy, |i, c| {
                        c.fill(i as f32)
                    });
                    assert_eq!(data, want, "len {len} chunk {chunk} threads {threads}");
                    let mut b = vec![-1.0f32; len.div_ceil(chunk)];
                    let mut a = vec![-1.0f32; len];
                    for_each_chunk2(
                        &mut a,
                        chunk,
                        &mut b,
                        1,
                        threads,
                        Work::Heavy,
                        |i, ca, cb| {
                            ca.fill(i as f32);
                            cb[0] = i as f32;
                        },
                    );
                    assert_eq!(a, want);
                    assert!(b.iter().enumerate().all(|(i, &v)| v == i as f32));
                }
            }
        }
    }

    #[test]
    fn a_kernel_pool_runs_the_program_on_one_of_its_own_workers_under_the_budget() {
        let inside = with_kernel_pool(3, "test-kernel-pool", 1 << 20, || {
            (
                rayon::current_thread_index().is_some(),
                rayon::current_num_threads(),
                kernel_threads(),
                std::thread::current().name().map(str::to_owned),
            )
        });
        assert!(inside.0, "the program runs on a worker of the pool");
        assert_eq!((inside.1, inside.2), (3, 3));
        assert!(inside.3.is_some_and(|n| n.starts_with("test-kernel-pool-")));
        // A budget of one needs no pool: the program runs right here.
        let here = std::thread::current().id();
        let one = with_kernel_pool(1, "unused", 1 << 20, || {
            (std::thread::current().id(), kernel_threads())
        });
        assert_eq!(one, (here, 1));
        // The same chunks, whichever pool runs them.
        let mut a = vec![0.0f32; (1 << 18) * 4 + 3];
        let mut b = a.clone();
        with_kernel_pool(2, "test-kernel-pool", 1 << 20, || {
            for_each_chunk(&mut a, 1000, kernel_threads(), Work::Light, |i, c| {
                c.fill(i as f32)
            })
        });
        for_each_chunk(&mut b, 1000, 1, Work::Light, |i, c| c.fill(i as f32));
        assert_eq!(a, b);
    }

    /// The workers a device pool keeps awake are released when the program ends, and when it
    /// panics: no thread of the pool is left after it (they would spin forever otherwise).
    #[test]
    fn the_workers_kept_awake_are_released_on_return_and_on_panic() {
        let alive = |prefix: &str| -> usize {
            std::fs::read_dir("/proc/self/task")
                .map(|tasks| {
                    tasks
                        .filter_map(Result::ok)
                        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                        .filter(|name| name.starts_with(prefix))
                        .count()
                })
                .unwrap_or(0)
        };
        let gone_soon = |prefix: &str| {
            let start = std::time::Instant::now();
            while alive(prefix) > 0 && start.elapsed() < std::time::Duration::from_secs(10) {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            alive(prefix)
        };
        // The pool's threads are seen while it runs (at least the program's own).
        let during = with_kernel_pool(3, "awake-ok", 1 << 20, || alive("awake-ok"));
        assert!(during >= 1, "{during}");
        assert_eq!(gone_soon("awake-ok"), 0);
        let panicked = std::panic::catch_unwind(|| {
            with_kernel_pool(3, "awake-panic", 1 << 20, || -> () {
                panic!("the program failed")
            })
        });
        assert!(panicked.is_err());
        assert_eq!(gone_soon("awake-panic"), 0);
    }

    /// Hand-computed from the per-part minimums (32 Ki light, 16 Ki heavy elements): a light
    /// kernel of just under 64 Ki elements stays on one thread and one of 128 Ki splits, a heavy
    /// one splits from 32 Ki, and no kernel gets more parts than its budget or any part below
    /// its minimum.
    #[test]
    fn the_split_follows_the_kind_of_work() {
        assert_eq!(tasks_for((1 << 16) - 1, 2, Work::Light), 1);
        assert_eq!(tasks_for(1 << 17, 2, Work::Light), 2);
        assert_eq!(tasks_for(1 << 15, 2, Work::Heavy), 2);
        assert_eq!(tasks_for((1 << 15) - 1, 2, Work::Heavy), 1);
        assert_eq!(tasks_for(3 << 14, 8, Work::Heavy), 3);
        assert_eq!(tasks_for(1 << 30, 1, Work::Heavy), 1);
    }

    #[test]
    fn the_budget_is_per_thread_and_at_least_one() {
        set_kernel_threads(0);
        assert_eq!(kernel_threads(), 1);
        set_kernel_threads(3);
        assert_eq!(kernel_threads(), 3);
        std::thread::spawn(|| assert_eq!(kernel_threads(), 1))
            .join()
            .unwrap();
        set_kernel_threads(1);
    }
}
