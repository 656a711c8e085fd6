//! The MPI backend of one device: local groups through shared memory, groups across processes
//! through [`Transport`], hierarchically where the group has several devices in each process.
//!
//! # Algorithms (group of `n` members; `P` processes holding `m` members each)
//! * **Inside one process**: the in-process backend, unchanged.
//! * **Flat** (every member a separate MPI peer): member `r` owns chunk `r`. An all-reduce sends
//!   chunk `k` to member `k`, sums the `n` copies of its own chunk in the tree order over the
//!   ranks (`tree_sum`) in `f32`, then
//!   sends the sum to everyone — the in-process backend's algorithm, so a flat MPI all-reduce is
//!   bitwise equal to the in-process one. All-reduce, reduce-scatter and all-gather run
//!   pipelined (`pipeline`: chunks cut into parts in flight at once, each part summed and sent on
//!   as soon as it has arrived); all-to-all, broadcast and barrier are one step of sends.
//! * **Hierarchical** (`m > 1` in every process): reduce-scatter inside the process, flat
//!   collective between the `P` members that hold the same part, all-gather inside the process.
//!   Only `1/m` of the buffer leaves each device for another process. Sums are then a tree over
//!   each process's devices, then one over the processes: with a power-of-two `m` that is the
//!   flat tree's order bit for bit (a block of `m` consecutive ranks is a subtree); otherwise a
//!   fixed order of its own, deterministic run to run. All-to-all, broadcast and barrier always
//!   run flat.
//!
//! # Invariants
//! * Every message across processes goes through this device's one [`Transport`]: a one-shot
//!   exchange (all-to-all, broadcast, barrier) or a pipelined flight (`pipeline`); the backend
//!   itself never calls MPI. Stages inside a process go through the in-process backend.
//! * A failed collective breaks this backend's transport: every later collective of the backend
//!   across processes fails with the first failure (`CommError::GroupBroken`).
//! * Each cross-process stage waits at most the transport's timeout (a hierarchical collective's
//!   local stages wait under the in-process backend's own).

use crate::backend::{OpInfo, TypedBackend};
use crate::element::Element;
use crate::error::CommError;
use crate::local::{chunk, LocalBackend};
use crate::trace::CollectiveKind;

use super::buffers::Received;
use super::pipeline::{pipelined, Data};
use super::transport::Transport;
use super::wire::header;

/// How a group is laid out over processes, from one member's point of view.
enum Layout {
    /// Every member is in this process.
    Local,
    /// Members talk to each other directly through MPI.
    Flat,
    /// `m` members in each of `P` processes.
    Hierarchical(Hierarchy),
}

/// A group of `m` members in each of `P` processes, from one member's point of view.
struct Hierarchy {
    /// This process's members (devices), in group order.
    local: Vec<usize>,
    /// Group positions: `members[p][j]` is member `j` of the `p`-th process (in order of first
    /// appearance in the group).
    members: Vec<Vec<usize>>,
    /// This device's process position `p` and local position `j`.
    p: usize,
    j: usize,
}

impl Hierarchy {
    /// The op a stage inside this process runs as (same sequence number, its own group).
    fn local_stage(&self, op: &OpInfo, kind: CollectiveKind, elements: usize) -> OpInfo {
        OpInfo {
            kind,
            seq: op.seq,
            axes: op.axes.clone(),
            group: self.local.clone(),
            rank: self.j,
            elements,
            dtype: op.dtype,
            root: 0,
        }
    }

    /// The op of the cross-process stage: the `j`-th member of every process, this device at
    /// rank `p`.
    fn cross_stage(&self, op: &OpInfo, elements: usize) -> OpInfo {
        OpInfo {
            group: self.members.iter().map(|l| op.group[l[self.j]]).collect(),
            rank: self.p,
            elements,
            ..op.clone()
        }
    }

    /// `(group position, packed block)` of every member: blocks in [local position][process]
    /// order, so a local stage over the packed buffer hands member `j` the blocks of every
    /// process's member `j`.
    fn packed_blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let procs = self.members.len();
        self.members.iter().enumerate().flat_map(move |(q, list)| {
            list.iter()
                .enumerate()
                .map(move |(i, &g)| (g, i * procs + q))
        })
    }
}

/// One device's MPI backend (see the module docs).
pub(crate) struct MpiBackend {
    local: LocalBackend,
    transport: Transport,
    device: usize,
    per_process: usize,
    hierarchical: bool,
}

impl MpiBackend {
    /// The backend of `device` (`per_process` devices a process): `local` inside its process,
    /// `transport` across processes, hierarchically when `hierarchical` and the group allows.
    pub(crate) fn new(
        local: LocalBackend,
        transport: Transport,
        device: usize,
        per_process: usize,
        hierarchical: bool,
    ) -> MpiBackend {
        MpiBackend {
            local,
            transport,
            device,
            per_process: per_process.max(1),
            hierarchical,
        }
    }

    fn layout(&self, op: &OpInfo) -> Layout {
        let mut procs: Vec<(usize, Vec<usize>)> = Vec::new();
        for (position, &d) in op.group.iter().enumerate() {
            let proc = d / self.per_process;
            match procs.iter_mut().find(|(p, _)| *p == proc) {
                Some((_, list)) => list.push(position),
                None => procs.push((proc, vec![position])),
            }
        }
        if procs.len() == 1 {
            return Layout::Local;
        }
        let m = procs[0].1.len();
        if m == 1 || !self.hierarchical || procs.iter().any(|(_, l)| l.len() != m) {
            return Layout::Flat;
        }
        let mine = self.device / self.per_process;
        let p = procs.iter().position(|(q, _)| *q == mine).unwrap_or(0);
        let j = procs[p].1.iter().position(|&g| g == op.rank).unwrap_or(0);
        Layout::Hierarchical(Hierarchy {
            local: procs[p].1.iter().map(|&g| op.group[g]).collect(),
            members: procs.into_iter().map(|(_, l)| l).collect(),
            p,
            j,
        })
    }
}

impl TypedBackend for MpiBackend {
    fn all_reduce_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        buf: &mut [T],
    ) -> Result<(), CommError> {
        match self.layout(op) {
            Layout::Local => self.local.all_reduce_typed(op, buf),
            Layout::Flat => flat_all_reduce(&mut self.transport, op, buf),
            Layout::Hierarchical(h) => {
                let m = h.local.len();
                let part = buf.len().div_ceil(m);
                // Pad only when the buffer does not split evenly over the local members.
                let mut padded = Vec::new();
                if buf.len() != part * m {
                    padded = vec![T::default(); part * m];
                    padded[..buf.len()].copy_from_slice(buf);
                }
                let mut mine = vec![T::default(); part];
                let rs = h.local_stage(op, CollectiveKind::ReduceScatter, part * m);
                let whole: &mut [T] = if padded.is_empty() { buf } else { &mut padded };
                self.local.reduce_scatter_typed(&rs, whole, &mut mine)?;
                flat_all_reduce(&mut self.transport, &h.cross_stage(op, part), &mut mine)?;
                let ag = h.local_stage(op, CollectiveKind::AllGather, part * m);
                self.local.all_gather_typed(&ag, &mine, whole)?;
                if !padded.is_empty() {
                    let len = buf.len();
                    buf.copy_from_slice(&padded[..len]);
                }
                Ok(())
            }
        }
    }

    fn reduce_scatter_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        match self.layout(op) {
            Layout::Local => self.local.reduce_scatter_typed(op, input, output),
            Layout::Flat => flat_reduce_scatter(&mut self.transport, op, input, output),
            Layout::Hierarchical(h) => {
                let (m, procs, size) = (h.local.len(), h.members.len(), output.len());
                let mut packed = vec![T::default(); input.len()];
                for (g, at) in h.packed_blocks() {
                    packed[at * size..(at + 1) * size]
                        .copy_from_slice(&input[g * size..(g + 1) * size]);
                }
                let mut mine = vec![T::default(); procs * size];
                let stage = h.local_stage(op, CollectiveKind::ReduceScatter, m * procs * size);
                self.local
                    .reduce_scatter_typed(&stage, &packed, &mut mine)?;
                let cross = h.cross_stage(op, procs * size);
                flat_reduce_scatter(&mut self.transport, &cross, &mine, output)
            }
        }
    }

    fn all_gather_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        match self.layout(op) {
            Layout::Local => self.local.all_gather_typed(op, input, output),
            Layout::Flat => flat_all_gather(&mut self.transport, op, input, output),
            Layout::Hierarchical(h) => {
                let (m, procs, size) = (h.local.len(), h.members.len(), input.len());
                let cross = h.cross_stage(op, procs * size);
                let mut across = vec![T::default(); procs * size];
                flat_all_gather(&mut self.transport, &cross, input, &mut across)?;
                let mut packed = vec![T::default(); m * procs * size];
                let stage = h.local_stage(op, CollectiveKind::AllGather, m * procs * size);
                self.local.all_gather_typed(&stage, &across, &mut packed)?;
                for (g, at) in h.packed_blocks() {
                    output[g * size..(g + 1) * size]
                        .copy_from_slice(&packed[at * size..(at + 1) * size]);
                }
                Ok(())
            }
        }
    }

    fn all_to_all_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        if let Layout::Local = self.layout(op) {
            return self.local.all_to_all_typed(op, input, output);
        }
        let n = op.group.len();
        let size = input.len() / n;
        let me = self.device;
        let mut outbox = self.transport.outbox();
        for (k, &d) in op.group.iter().enumerate() {
            if k != op.rank {
                let bytes = bytes_of(&input[k * size..(k + 1) * size]);
                let b = outbox.stage(header(op, 0, bytes.len(), me), bytes);
                outbox.send(d, b);
            }
        }
        let sources = peers(op, size * std::mem::size_of::<T>());
        let received = self.transport.exchange(op, 0, outbox, &sources)?;
        let mut it = received.iter();
        for k in 0..n {
            let dst = &mut output[k * size..(k + 1) * size];
            if k == op.rank {
                dst.copy_from_slice(&input[k * size..(k + 1) * size]);
            } else if let Some(r) = it.next() {
                dst.copy_from_slice(typed::<T>(r));
            }
        }
        self.transport.recycle(received);
        Ok(())
    }

    fn broadcast_typed<T: Element>(&mut self, op: &OpInfo, buf: &mut [T]) -> Result<(), CommError> {
        if let Layout::Local = self.layout(op) {
            return self.local.broadcast_typed(op, buf);
        }
        let me = self.device;
        let bytes = std::mem::size_of_val(buf);
        if op.rank == op.root {
            let mut outbox = self.transport.outbox();
            let b = outbox.stage(header(op, 0, bytes, me), bytes_of(buf));
            for (k, &d) in op.group.iter().enumerate() {
                if k != op.rank {
                    outbox.send(d, b);
                }
            }
            self.transport.exchange(op, 0, outbox, &[])?;
        } else {
            let outbox = self.transport.outbox();
            let received = self
                .transport
                .exchange(op, 0, outbox, &[(op.group[op.root], bytes)])?;
            if let Some(r) = received.first() {
                buf.copy_from_slice(typed::<T>(r));
            }
            self.transport.recycle(received);
        }
        Ok(())
    }

    fn group_barrier(&mut self, op: &OpInfo) -> Result<(), CommError> {
        if let Layout::Local = self.layout(op) {
            return self.local.group_barrier(op);
        }
        let mut outbox = self.transport.outbox();
        let b = outbox.stage(header(op, 0, 0, self.device), &[]);
        for (k, &d) in op.group.iter().enumerate() {
            if k != op.rank {
                outbox.send(d, b);
            }
        }
        self.transport
            .exchange(op, 0, outbox, &peers(op, 0))
            .map(|_| ())
    }
}

fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn typed<T: Element>(r: &Received) -> &[T] {
    bytemuck::cast_slice(r.payload())
}

/// Every member but this one, each sending `bytes`.
fn peers(op: &OpInfo, bytes: usize) -> Vec<(usize, usize)> {
    op.group
        .iter()
        .enumerate()
        .filter(|&(k, _)| k != op.rank)
        .map(|(_, &d)| (d, bytes))
        .collect()
}

/// Flat all-reduce over `op.group` (this device at `op.rank`), steps 0 and 1: member `k` owns
/// chunk `k` (the in-process backend's chunks), see [`pipelined`].
fn flat_all_reduce<T: Element>(
    transport: &mut Transport,
    op: &OpInfo,
    buf: &mut [T],
) -> Result<(), CommError> {
    let n = op.group.len();
    let blocks: Vec<_> = (0..n).map(|k| chunk(buf.len(), n, k)).collect();
    let data = Data::AllReduce(buf);
    pipelined(transport, op, 0, &op.group, op.rank, &blocks, data)
}

/// `n` consecutive blocks of `size` elements: member `k`'s part of a reduce-scatter's input or
/// an all-gather's output.
fn equal_blocks(n: usize, size: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).map(|k| k * size..(k + 1) * size).collect()
}

/// Flat reduce-scatter over `op.group`: `output` = block `op.rank` of the tree-order sum of every
/// member's `input`.
fn flat_reduce_scatter<T: Element>(
    transport: &mut Transport,
    op: &OpInfo,
    input: &[T],
    output: &mut [T],
) -> Result<(), CommError> {
    let blocks = equal_blocks(op.group.len(), output.len());
    let data = Data::ReduceScatter { input, output };
    pipelined(transport, op, 0, &op.group, op.rank, &blocks, data)
}

/// Flat all-gather over `op.group`: block `k` of `output` = member `k`'s `input`.
fn flat_all_gather<T: Element>(
    transport: &mut Transport,
    op: &OpInfo,
    input: &[T],
    output: &mut [T],
) -> Result<(), CommError> {
    let blocks = equal_blocks(op.group.len(), input.len());
    let data = Data::AllGather { input, output };
    pipelined(transport, op, 0, &op.group, op.rank, &blocks, data)
}
