//! `Communicator`: one device's handle on the collectives, independent of the backend.
//!
//! The front end does everything that must be the same for every backend, in this order: resolve
//! the mesh axes to a device group (validated), check the buffers fit the collective, record the
//! event in the trace under the current phase, then hand the call to the backend. A group of one
//! device is served here without the backend (copy or no-op) but is still recorded, so traces do
//! not depend on mesh sizes.

use std::sync::Arc;

use ferrotext_sharding::{DType, Mesh};

use crate::backend::{Backend, OpInfo};
use crate::element::{check_wire, round_trip, Buf, BufMut, Element};
use crate::error::CommError;
use crate::stream::{run_work, Pending, Stream, Work};
use crate::trace::{CollectiveKind, Trace, TraceEvent};

/// A profiler span for a foreground collective (the time includes waiting for the group);
/// `None` unless the profiler records this thread.
fn profile_span(op: &OpInfo) -> Option<ferrotext_profile::Span> {
    ferrotext_profile::span_in(op.kind.name(), ferrotext_profile::Phase::Collective).map(|s| {
        s.bytes(op.bytes() as f64)
            .shapes(|| format!("{}[{}] over {}", op.dtype, op.elements, op.axes.join(",")))
    })
}

/// One device's collectives over groups of mesh axes, with its trace and phase labels.
///
/// # Collectives
/// Each method runs over the group of devices that share this device's coordinates on every
/// mesh axis *not* listed (e.g. over `["data"]` on a data×tensor mesh: the devices with the same
/// `tensor` index). Ranks in the group follow the listed axes, first axis major. Every member must
/// make the same call (kind, axes, length, dtype, root) at the same point of its program; results
/// are bitwise identical on every member and from run to run (sums follow a fixed tree over the
/// ranks, `tree_sum`).
pub struct Communicator {
    device: usize,
    mesh: Arc<Mesh>,
    backend: Box<dyn Backend>,
    trace: Trace,
    phases: Vec<String>,
    seq: u64,
    /// The background channel, when the run provides one.
    stream: Option<Stream>,
}

impl Communicator {
    /// A communicator for `device` of `mesh` over `backend`.
    pub fn new(device: usize, mesh: Arc<Mesh>, backend: Box<dyn Backend>) -> Communicator {
        Communicator {
            device,
            mesh,
            backend,
            trace: Trace::new(),
            phases: Vec::new(),
            seq: 0,
            stream: None,
        }
    }

    /// This communicator with a background channel (see [`crate::stream`]) for the `start_*`
    /// collectives; without one they run at once on the blocking backend.
    pub fn with_stream(mut self, stream: Stream) -> Communicator {
        self.stream = Some(stream);
        self
    }

    /// Whether `start_*` collectives run in the background.
    pub fn has_stream(&self) -> bool {
        self.stream.is_some()
    }

    /// Starts an in-place sum of `buf` over `axes` in the background and returns at once;
    /// [`Pending::wait`] gives the summed buffer. Recorded in the trace now, under the current
    /// phase.
    ///
    /// # Errors
    /// Bad axes. Collective failures come from [`Pending::wait`].
    ///
    /// # Collectives
    /// One all-reduce on the background channel, run after every collective started before it.
    pub fn start_all_reduce<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        buf: Vec<f32>,
    ) -> Result<Pending, CommError> {
        self.start_all_reduce_as(axes, buf, DType::F32)
    }

    /// Starts a reduce-scatter in the background: [`Pending::wait`] gives chunk `rank` (length
    /// `input.len() / group`) of the sum of every member's `input`.
    ///
    /// # Errors
    /// Bad axes, or an input the group does not divide.
    ///
    /// # Collectives
    /// One reduce-scatter on the background channel.
    pub fn start_reduce_scatter<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: Vec<f32>,
    ) -> Result<Pending, CommError> {
        self.start_reduce_scatter_as(axes, input, DType::F32)
    }

    /// [`Communicator::start_reduce_scatter`] with `wire` the element type the reduction moves
    /// (see [`crate::narrow`]): the job's input is rounded to it on the stream thread.
    ///
    /// # Errors
    /// As [`Communicator::start_reduce_scatter`].
    ///
    /// # Collectives
    /// One reduce-scatter of `wire` elements on the background channel.
    pub fn start_reduce_scatter_as<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: Vec<f32>,
        wire: DType,
    ) -> Result<Pending, CommError> {
        let op = self.begin_background(CollectiveKind::ReduceScatter, axes, input.len(), wire)?;
        let n = op.group.len();
        if !input.len().is_multiple_of(n) {
            return Err(self.bad(
                &op,
                format!(
                    "input has {} elements, not a multiple of the group",
                    input.len()
                ),
            ));
        }
        if n == 1 {
            return Ok(Pending::done(Ok(round_trip(wire, input))));
        }
        let output_len = input.len() / n;
        Ok(self.submit(
            op,
            Work::ReduceScatter {
                input,
                output_len,
                wire,
            },
        ))
    }

    /// Starts an all-gather in the background: [`Pending::wait`] gives every member's `input`
    /// in rank order.
    ///
    /// # Errors
    /// Bad axes.
    ///
    /// # Collectives
    /// One all-gather on the background channel.
    pub fn start_all_gather<S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: Vec<f32>,
    ) -> Result<Pending, CommError> {
        let n = self.group(axes)?.len();
        let op =
            self.begin_background(CollectiveKind::AllGather, axes, input.len() * n, DType::F32)?;
        if n == 1 {
            return Ok(Pending::done(Ok(input)));
        }
        let output_len = input.len() * n;
        Ok(self.submit(op, Work::AllGather { input, output_len }))
    }

    /// A background job on the stream, or run here at once when there is none.
    pub(crate) fn submit(&mut self, op: OpInfo, work: Work) -> Pending {
        if let Some(stream) = &mut self.stream {
            return stream.submit(op, work);
        }
        Pending::done(run_work(self.backend.as_mut(), &op, work))
    }

    /// [`Communicator::begin_op`] for the background channel: its own sequence numbers (the
    /// stream's backend matches by them), the event in this trace.
    pub(crate) fn begin_background<S: AsRef<str>>(
        &mut self,
        kind: CollectiveKind,
        axes: &[S],
        elements: usize,
        wire: DType,
    ) -> Result<OpInfo, CommError> {
        check_wire(kind, axes, wire)?;
        let Some(seq) = self.stream.as_ref().map(|s| s.seq) else {
            return self.begin_op(kind, axes, elements, wire, 0);
        };
        let main = self.seq;
        self.seq = seq;
        let op = self.begin_op(kind, axes, elements, wire, 0);
        if let Some(stream) = &mut self.stream {
            stream.seq = self.seq;
        }
        self.seq = main;
        op
    }

    /// This device's index in the mesh.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The mesh.
    pub fn mesh(&self) -> &Arc<Mesh> {
        &self.mesh
    }

    /// The devices of this device's group over `axes`, in rank order.
    ///
    /// # Errors
    /// When an axis is unknown or repeated.
    pub fn group<S: AsRef<str>>(&self, axes: &[S]) -> Result<Vec<usize>, CommError> {
        self.mesh
            .group_of(self.device, axes)
            .map_err(|source| CommError::Axes {
                kind: CollectiveKind::Barrier,
                axes: names(axes),
                source: Box::new(source),
            })
    }

    /// Enters a phase: events recorded until the matching [`Communicator::pop_phase`] carry this
    /// label (nested labels are joined with `/`).
    pub fn push_phase(&mut self, label: impl Into<String>) {
        self.phases.push(label.into());
    }

    /// Leaves the innermost phase (no-op when none).
    pub fn pop_phase(&mut self) {
        self.phases.pop();
    }

    /// The phase label in force (empty outside any phase).
    pub fn phase(&self) -> String {
        self.phases.join("/")
    }

    /// This device's trace so far.
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// Takes the trace, leaving an empty one.
    pub fn take_trace(&mut self) -> Trace {
        std::mem::take(&mut self.trace)
    }

    /// In-place sum of `buf` over the group (every member passes the same length).
    ///
    /// # Errors
    /// Bad axes; or any [`CommError`] of the backend (mismatch, peer departed, timeout).
    pub fn all_reduce<T: Element, S: AsRef<str>>(
        &mut self,
        axes: &[S],
        buf: &mut [T],
    ) -> Result<(), CommError> {
        let op = self.begin::<T, S>(CollectiveKind::AllReduce, axes, buf.len(), 0)?;
        let _span = profile_span(&op);
        if op.group.len() == 1 {
            return Ok(());
        }
        self.backend.all_reduce(&op, T::buf_mut(buf))
    }

    /// Sum over the group, scattered: `output` (len M) receives chunk `rank` of the sum of every
    /// member's `input` (len group×M).
    ///
    /// # Errors
    /// [`CommError::BadBuffer`] when `input.len() != group × output.len()`; else as
    /// [`Communicator::all_reduce`].
    pub fn reduce_scatter<T: Element, S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let op = self.begin::<T, S>(CollectiveKind::ReduceScatter, axes, input.len(), 0)?;
        let _span = profile_span(&op);
        self.check_len(
            &op,
            input.len(),
            op.group.len() * output.len(),
            "input",
            "group × output",
        )?;
        self.exchange(&op, input, output, |b, op, i, o| b.reduce_scatter(op, i, o))
    }

    /// Concatenation over the group: `output` (len group×M) receives every member's `input`
    /// (len M) in rank order.
    ///
    /// # Errors
    /// [`CommError::BadBuffer`] when `output.len() != group × input.len()`; else as
    /// [`Communicator::all_reduce`].
    pub fn all_gather<T: Element, S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let op = self.begin::<T, S>(CollectiveKind::AllGather, axes, output.len(), 0)?;
        let _span = profile_span(&op);
        self.check_len(
            &op,
            output.len(),
            op.group.len() * input.len(),
            "output",
            "group × input",
        )?;
        self.exchange(&op, input, output, |b, op, i, o| b.all_gather(op, i, o))
    }

    /// Personalised exchange: both buffers hold group×M elements; chunk `k` of `output` receives
    /// chunk `rank` of member `k`'s `input`.
    ///
    /// # Errors
    /// [`CommError::BadBuffer`] when the lengths differ or are not divisible by the group size;
    /// else as [`Communicator::all_reduce`].
    pub fn all_to_all<T: Element, S: AsRef<str>>(
        &mut self,
        axes: &[S],
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        let op = self.begin::<T, S>(CollectiveKind::AllToAll, axes, input.len(), 0)?;
        let _span = profile_span(&op);
        self.check_len(&op, output.len(), input.len(), "output", "input")?;
        let n = op.group.len();
        let rounded = input.len() / n * n;
        self.check_len(
            &op,
            input.len(),
            rounded,
            "input",
            "a multiple of the group size",
        )?;
        self.exchange(&op, input, output, |b, op, i, o| b.all_to_all(op, i, o))
    }

    /// Copies the buffer of group rank `root` to every member.
    ///
    /// # Errors
    /// [`CommError::BadBuffer`] when `root` is not a rank of the group; else as
    /// [`Communicator::all_reduce`].
    pub fn broadcast<T: Element, S: AsRef<str>>(
        &mut self,
        axes: &[S],
        root: usize,
        buf: &mut [T],
    ) -> Result<(), CommError> {
        let op = self.begin::<T, S>(CollectiveKind::Broadcast, axes, buf.len(), root)?;
        let _span = profile_span(&op);
        if root >= op.group.len() {
            return Err(self.bad(&op, format!("root rank {root} is not in the group")));
        }
        if op.group.len() == 1 {
            return Ok(());
        }
        self.backend.broadcast(&op, T::buf_mut(buf))
    }

    /// Waits until every member of the group has arrived.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub fn barrier<S: AsRef<str>>(&mut self, axes: &[S]) -> Result<(), CommError> {
        let op = self.begin::<f32, S>(CollectiveKind::Barrier, axes, 0, 0)?;
        let _span = profile_span(&op);
        if op.group.len() == 1 {
            return Ok(());
        }
        self.backend.barrier(&op)
    }

    /// Records a collective without moving data: abstract (shape-only) evaluation calls this
    /// where a real run would call the collective, so both produce the same trace.
    ///
    /// # Errors
    /// Bad axes, as the collectives themselves.
    pub fn record_abstract<S: AsRef<str>>(
        &mut self,
        kind: CollectiveKind,
        axes: &[S],
        elements: usize,
        dtype: DType,
    ) -> Result<(), CommError> {
        let op = self.begin_op(kind, axes, elements, dtype, 0)?;
        drop(op);
        Ok(())
    }

    /// The end of a two-buffer collective whose lengths are checked: a group of one copies
    /// `input` to `output` (equal lengths then), a larger one hands both to the backend.
    fn exchange<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
        call: impl FnOnce(&mut dyn Backend, &OpInfo, Buf<'_>, BufMut<'_>) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        if op.group.len() == 1 {
            output.copy_from_slice(input);
            return Ok(());
        }
        call(self.backend.as_mut(), op, T::buf(input), T::buf_mut(output))
    }

    /// Resolves the group, records the event and advances the sequence number.
    fn begin<T: Element, S: AsRef<str>>(
        &mut self,
        kind: CollectiveKind,
        axes: &[S],
        elements: usize,
        root: usize,
    ) -> Result<OpInfo, CommError> {
        self.begin_op(kind, axes, elements, T::DTYPE, root)
    }

    fn begin_op<S: AsRef<str>>(
        &mut self,
        kind: CollectiveKind,
        axes: &[S],
        elements: usize,
        dtype: DType,
        root: usize,
    ) -> Result<OpInfo, CommError> {
        let axes = names(axes);
        let group = self
            .mesh
            .group_of(self.device, &axes)
            .map_err(|source| CommError::Axes {
                kind,
                axes: axes.clone(),
                source: Box::new(source),
            })?;
        let rank = group.iter().position(|&d| d == self.device).unwrap_or(0);
        let op = OpInfo {
            kind,
            seq: self.seq,
            axes,
            rank,
            elements,
            dtype,
            root,
            group,
        };
        self.seq += 1;
        self.trace.record(TraceEvent {
            seq: op.seq,
            kind,
            axes: op.axes.clone(),
            group_size: op.group.len(),
            elements,
            bytes: kind.bytes(elements, dtype),
            dtype,
            phase: self.phase(),
        });
        Ok(op)
    }

    fn check_len(
        &self,
        op: &OpInfo,
        got: usize,
        want: usize,
        what: &str,
        rule: &str,
    ) -> Result<(), CommError> {
        if got == want {
            Ok(())
        } else {
            Err(self.bad(
                op,
                format!("{what} has {got} elements; it must be {rule} = {want}"),
            ))
        }
    }

    fn bad(&self, op: &OpInfo, reason: String) -> CommError {
        CommError::BadBuffer {
            kind: op.kind,
            axes: op.axes.clone(),
            group_size: op.group.len(),
            reason,
        }
    }
}

fn names<S: AsRef<str>>(axes: &[S]) -> Vec<String> {
    axes.iter().map(|a| a.as_ref().to_string()).collect()
}
