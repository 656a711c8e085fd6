//! The in-process backend: devices are threads of one process, collectives go through shared
//! memory.
//!
//! # Algorithm
//! A collective is two rendezvous of its group with the work in between:
//! 1. *entry*: each member publishes pointers to its buffers and a description of its call; the
//!    last to arrive checks that all descriptions agree;
//! 2. *work*: member `r` owns chunk `r` of the data. For an all-reduce it reads chunk `r` of every
//!    member's buffer, sums them in the tree order of `tree_sum.rs` into a small f32 block, and writes the block back
//!    into chunk `r` of *every* member's buffer. Each device thus reads and writes the buffer size
//!    once — the traffic of a memcpy — and adds 1/N of the data. Reduce-scatter, all-gather,
//!    all-to-all and broadcast are the matching reads and copies;
//! 3. *exit*: nobody returns (and reuses its buffers) until every member has finished.
//!
//! Invariants that make the raw-pointer work sound: between entry and exit, chunk `r` of any
//! buffer a member writes is written by exactly one device (rank `r`, or the owner for outputs
//! that only the owner fills), and nothing a device reads is written by anyone during the work
//! phase. Buffers stay borrowed by their owner's blocked call until the exit rendezvous.
//!
//! # Failures
//! Waiting is bounded: a member that left the program (returned, failed, panicked), a member that
//! sits at the same sequence number in a *different* collective, or the timeout breaks the group,
//! and every member then gets the same [`CommError`]. A broken group stays broken.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferrotext_sharding::Mesh;

use crate::backend::{OpInfo, TypedBackend};
use crate::element::Element;
use crate::error::CommError;

/// Elements summed per block: 16 KiB of f32 accumulators stay in L1.
const BLOCK: usize = 4096;
/// Chunk boundaries are multiples of this many elements (a 64-byte cache line of f32), so two
/// devices never write the same cache line of a buffer.
const ALIGN: usize = 16;
/// How often a waiting device re-checks for departed or mismatched peers when nobody wakes it.
const POLL: Duration = Duration::from_millis(20);
/// How long a waiting device spins before it sleeps, when every device has a core of its own.
/// Waking a sleeping thread costs tens of microseconds; most rendezvous complete sooner.
const SPIN: Duration = Duration::from_micros(50);

/// State shared by all device threads of one SPMD run.
pub(crate) struct World {
    timeout: Duration,
    /// Busy-spin before sleeping (only when the devices do not outnumber the cores; otherwise the
    /// waiter yields instead).
    spin: bool,
    groups: Mutex<BTreeMap<Vec<usize>, Arc<Group>>>,
    /// Per device: the collective it is blocked in, if any.
    board: Vec<Mutex<Option<OpInfo>>>,
    departed: Vec<AtomicBool>,
}

impl World {
    pub(crate) fn new(mesh: &Mesh, timeout: Duration) -> World {
        let n = mesh.device_count();
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        World {
            timeout,
            spin: n <= cores,
            groups: Mutex::new(BTreeMap::new()),
            board: (0..n).map(|_| Mutex::new(None)).collect(),
            departed: (0..n).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    /// Marks `device` as gone and wakes every group it belongs to, so peers stop waiting for it.
    pub(crate) fn depart(&self, device: usize) {
        if let Some(flag) = self.departed.get(device) {
            flag.store(true, Ordering::SeqCst);
        }
        let groups: Vec<Arc<Group>> = lock(&self.groups)
            .values()
            .filter(|g| g.members.contains(&device))
            .cloned()
            .collect();
        for group in groups {
            let _state = lock(&group.state);
            group.wake.notify_all();
        }
    }

    fn group(&self, members: &[usize]) -> Arc<Group> {
        lock(&self.groups)
            .entry(members.to_vec())
            .or_insert_with(|| {
                Arc::new(Group {
                    members: members.to_vec(),
                    epoch: AtomicU64::new(0),
                    state: Mutex::new(GroupState {
                        epoch: 0,
                        present: vec![false; members.len()],
                        slots: vec![Slot::default(); members.len()],
                        broken: None,
                    }),
                    wake: Condvar::new(),
                })
            })
            .clone()
    }
}

/// Poison-tolerant lock: a panicking device thread must not take the others down with it; the
/// state behind these locks is only ever left consistent (every update is a single assignment).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Group {
    members: Vec<usize>,
    /// Mirror of `state.epoch` for spinning without the lock (written under the lock).
    epoch: AtomicU64,
    state: Mutex<GroupState>,
    wake: Condvar,
}

struct GroupState {
    /// Completed rendezvous.
    epoch: u64,
    /// Who has arrived at the current rendezvous.
    present: Vec<bool>,
    /// Published at entry: one per rank.
    slots: Vec<Slot>,
    /// The failure that broke the group, returned to everyone from now on.
    broken: Option<CommError>,
}

/// One member's published buffers (addresses, so the state is `Send`) and call.
#[derive(Clone, Default)]
struct Slot {
    src: usize,
    dst: usize,
    op: Option<OpInfo>,
}

/// The in-process shared-memory backend of one device. See the module docs.
pub struct LocalBackend {
    device: usize,
    world: Arc<World>,
    acc: Vec<f32>,
}

impl LocalBackend {
    pub(crate) fn new(device: usize, world: Arc<World>) -> LocalBackend {
        LocalBackend {
            device,
            world,
            acc: vec![0.0; BLOCK],
        }
    }

    /// Entry rendezvous: publish, wait for all, return everyone's slots.
    fn enter(
        &self,
        group: &Group,
        op: &OpInfo,
        src: usize,
        dst: usize,
    ) -> Result<Vec<Slot>, CommError> {
        *lock(&self.world.board[self.device]) = Some(op.clone());
        let slot = Slot {
            src,
            dst,
            op: Some(op.clone()),
        };
        let result = self.rendezvous(group, op, Some(slot));
        *lock(&self.world.board[self.device]) = None;
        result
    }

    /// Exit rendezvous.
    fn exit(&self, group: &Group, op: &OpInfo) -> Result<(), CommError> {
        self.rendezvous(group, op, None).map(|_| ())
    }

    fn rendezvous(
        &self,
        group: &Group,
        op: &OpInfo,
        slot: Option<Slot>,
    ) -> Result<Vec<Slot>, CommError> {
        let mut state = lock(&group.state);
        if let Some(err) = &state.broken {
            return Err(err.clone());
        }
        let entering = slot.is_some();
        if let Some(slot) = slot {
            state.slots[op.rank] = slot;
        }
        state.present[op.rank] = true;
        let epoch = state.epoch;
        if state.present.iter().all(|&p| p) {
            if entering {
                if let Some(err) = mismatch(&group.members, &state.slots) {
                    return Err(break_group(&mut state, &group.wake, err));
                }
            }
            state.present.iter_mut().for_each(|p| *p = false);
            state.epoch += 1;
            group.epoch.store(state.epoch, Ordering::Release);
            group.wake.notify_all();
            return Ok(state.slots.clone());
        }
        let start = Instant::now();
        {
            drop(state);
            // Spin (or, when devices outnumber cores, yield to the peers we wait for) before
            // sleeping on the condition variable.
            while group.epoch.load(Ordering::Acquire) == epoch && start.elapsed() < SPIN {
                if self.world.spin {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            state = lock(&group.state);
            if state.epoch != epoch {
                return Ok(state.slots.clone());
            }
        }
        loop {
            let (guard, _) = group
                .wake
                .wait_timeout(state, POLL)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            state = guard;
            if state.epoch != epoch {
                return Ok(state.slots.clone());
            }
            if let Some(err) = &state.broken {
                return Err(err.clone());
            }
            if let Some(err) = self.stalled(group, &state, op, start) {
                return Err(break_group(&mut state, &group.wake, err));
            }
        }
    }

    /// Why the members still missing will never arrive, if we can tell.
    fn stalled(
        &self,
        group: &Group,
        state: &GroupState,
        op: &OpInfo,
        start: Instant,
    ) -> Option<CommError> {
        let missing: Vec<usize> = group
            .members
            .iter()
            .zip(&state.present)
            .filter(|(_, &p)| !p)
            .map(|(&d, _)| d)
            .collect();
        for &d in &missing {
            if self.world.departed[d].load(Ordering::SeqCst) {
                return Some(CommError::PeerDeparted {
                    kind: op.kind,
                    seq: op.seq,
                    departed: d,
                });
            }
            if let Some(theirs) = lock(&self.world.board[d]).as_ref() {
                if theirs.seq == op.seq && !same_call(theirs, op) {
                    return Some(CommError::Mismatch {
                        seq: op.seq,
                        device: self.device,
                        mine: op.describe(),
                        other_device: d,
                        theirs: theirs.describe(),
                    });
                }
            }
        }
        let waited = start.elapsed();
        (waited >= self.world.timeout).then(|| CommError::Timeout {
            kind: op.kind,
            seq: op.seq,
            axes: op.axes.clone(),
            waited,
            missing,
        })
    }

    fn run<T: Element>(
        &mut self,
        op: &OpInfo,
        src: *const T,
        dst: *mut T,
        work: impl FnOnce(&mut [f32], &[Slot]),
    ) -> Result<(), CommError> {
        let group = self.world.group(&op.group);
        let slots = self.enter(&group, op, src as usize, dst as usize)?;
        work(&mut self.acc, &slots);
        self.exit(&group, op)
    }
}

/// Same collective, ignoring which member is asking.
fn same_call(a: &OpInfo, b: &OpInfo) -> bool {
    a.kind == b.kind
        && a.seq == b.seq
        && a.axes == b.axes
        && a.group == b.group
        && a.elements == b.elements
        && a.dtype == b.dtype
        && a.root == b.root
}

fn mismatch(members: &[usize], slots: &[Slot]) -> Option<CommError> {
    let first = slots.first()?.op.as_ref()?;
    for (&device, slot) in members.iter().zip(slots).skip(1) {
        let theirs = slot.op.as_ref()?;
        if !same_call(first, theirs) {
            return Some(CommError::Mismatch {
                seq: first.seq.min(theirs.seq),
                device: members[0],
                mine: first.describe(),
                other_device: device,
                theirs: theirs.describe(),
            });
        }
    }
    None
}

fn break_group(state: &mut GroupState, wake: &Condvar, err: CommError) -> CommError {
    state.broken = Some(err.clone());
    wake.notify_all();
    err
}

/// Chunk `r` of `len` elements split over `n` owners, cache-line aligned.
pub(crate) fn chunk(len: usize, n: usize, r: usize) -> std::ops::Range<usize> {
    let size = len.div_ceil(n).div_ceil(ALIGN) * ALIGN;
    let start = (r * size).min(len);
    start..((r + 1) * size).min(len)
}

/// Sums `range` of every source (in the tree order of [`crate::tree_sum`], in f32) and writes
/// the result to `range` of every destination.
///
/// # Safety
/// Every `srcs[k]` and `dsts[k]` must be valid for `range`; during the call no other thread may
/// write `range` of any source or access `range` of any destination.
unsafe fn sum_blocks<T: Element>(
    srcs: &[*const T],
    src_offset: usize,
    dsts: &[*mut T],
    dst_offset: usize,
    len: usize,
    acc: &mut [f32],
) {
    let mut scratch = Vec::new();
    let mut done = 0;
    while done < len {
        let n = BLOCK.min(len - done);
        let acc = &mut acc[..n];
        // SAFETY: the caller guarantees every source is valid for this range and unwritten
        // meanwhile.
        let part =
            |k: usize| unsafe { std::slice::from_raw_parts(srcs[k].add(src_offset + done), n) };
        crate::tree_sum::tree_sum_into(acc, srcs.len(), &part, &mut scratch);
        for &dst in dsts {
            // SAFETY: the caller guarantees exclusive access to this range of `dst`.
            let block = unsafe { std::slice::from_raw_parts_mut(dst.add(dst_offset + done), n) };
            for (d, &a) in block.iter_mut().zip(acc.iter()) {
                *d = T::from_f32(a);
            }
        }
        done += n;
    }
}

fn ptrs<T>(slots: &[Slot], pick: impl Fn(&Slot) -> usize) -> Vec<*mut T> {
    slots.iter().map(|s| pick(s) as *mut T).collect()
}

impl TypedBackend for LocalBackend {
    fn all_reduce_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        buf: &mut [T],
    ) -> Result<(), CommError> {
        let len = buf.len();
        let ptr = buf.as_mut_ptr();
        self.run(op, ptr, ptr, |acc, slots| {
            let bufs: Vec<*mut T> = ptrs(slots, |s| s.dst);
            let srcs: Vec<*const T> = bufs.iter().map(|&p| p as *const T).collect();
            let mine = chunk(len, slots.len(), op.rank);
            // SAFETY: every member published a buffer of `len` elements (checked at entry) that its
            // owner does not touch until the exit rendezvous; chunk `rank` of every buffer is read
            // and written only by this device (the chunks of distinct ranks are disjoint).
            unsafe { sum_blocks(&srcs, mine.start, &bufs, mine.start, mine.len(), acc) };
        })
    }

    fn reduce_scatter_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let m = output.len();
        let out = output.as_mut_ptr();
        self.run(op, input.as_ptr(), out, |acc, slots| {
            let srcs: Vec<*const T> = slots.iter().map(|s| s.src as *const T).collect();
            // SAFETY: inputs (group×m elements each) are only read during the work phase; `out` is
            // this device's own output, touched by nobody else.
            unsafe { sum_blocks(&srcs, op.rank * m, &[out], 0, m, acc) };
        })
    }

    fn all_gather_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let m = input.len();
        let out = output.as_mut_ptr();
        self.run(op, input.as_ptr(), out, |_, slots| {
            for (k, slot) in slots.iter().enumerate() {
                // SAFETY: member k's input has m elements and is only read during the work phase;
                // `out` (group×m elements) is this device's own output.
                unsafe { std::ptr::copy_nonoverlapping(slot.src as *const T, out.add(k * m), m) };
            }
        })
    }

    fn all_to_all_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let m = input.len() / op.group.len();
        let out = output.as_mut_ptr();
        self.run(op, input.as_ptr(), out, |_, slots| {
            for (k, slot) in slots.iter().enumerate() {
                let src = slot.src as *const T;
                // SAFETY: member k's input has group×m elements and is only read during the work
                // phase; `out` (group×m elements) is this device's own output.
                unsafe { std::ptr::copy_nonoverlapping(src.add(op.rank * m), out.add(k * m), m) };
            }
        })
    }

    fn broadcast_typed<T: Element>(&mut self, op: &OpInfo, buf: &mut [T]) -> Result<(), CommError> {
        let len = buf.len();
        let ptr = buf.as_mut_ptr();
        self.run(op, ptr, ptr, |_, slots| {
            if op.rank != op.root {
                let root = slots[op.root].src as *const T;
                // SAFETY: the root's buffer has `len` elements and is only read during the work
                // phase (the root copies nothing); `ptr` is this device's own buffer.
                unsafe { std::ptr::copy_nonoverlapping(root, ptr, len) };
            }
        })
    }

    fn group_barrier(&mut self, op: &OpInfo) -> Result<(), CommError> {
        let group = self.world.group(&op.group);
        self.enter(&group, op, 0, 0).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_once_and_are_aligned() {
        for len in [0, 1, 15, 16, 17, 100, 1000, 4097] {
            for n in 1..6 {
                let mut covered = 0;
                for r in 0..n {
                    let c = chunk(len, n, r);
                    assert_eq!(c.start, covered, "len {len} n {n} r {r}");
                    assert!(c.start.is_multiple_of(ALIGN) || c.start == len);
                    covered = c.end;
                }
                assert_eq!(covered, len);
            }
        }
    }
}
