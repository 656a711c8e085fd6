//! What a backend implements: [`Backend`] (collectives on type-erased buffers) or
//! [`TypedBackend`] (one generic method per collective, dispatched on the element type once, here),
//! what it is told of each call ([`OpInfo`]), and [`NoTransport`] for abstract programs.
//!
//! This file sits below the [`crate::Communicator`] front end and the background stream that both
//! hand calls to a backend; it imports neither.

use ferrotext_sharding::DType;

use crate::element::{Buf, BufMut, Element};
use crate::error::CommError;
use crate::trace::CollectiveKind;

/// What a backend is told about one collective (already validated by the front end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpInfo {
    /// What it does.
    pub kind: CollectiveKind,
    /// Position in this device's sequence of collectives (identical on every device of a correct
    /// SPMD program).
    pub seq: u64,
    /// The mesh axes of the group, as listed by the caller.
    pub axes: Vec<String>,
    /// The group's devices in rank order (see `Mesh::group_of`).
    pub group: Vec<usize>,
    /// This device's rank in `group`.
    pub rank: usize,
    /// Elements of the full buffer (as in [`TraceEvent::elements`](crate::TraceEvent::elements)).
    pub elements: usize,
    /// Element type.
    pub dtype: DType,
    /// Root rank of a broadcast (0 otherwise).
    pub root: usize,
}

impl OpInfo {
    /// Its bytes as the trace records them ([`CollectiveKind::bytes`]).
    pub fn bytes(&self) -> usize {
        self.kind.bytes(self.elements, self.dtype)
    }

    /// A short description for error messages: `all_reduce over [data] of 1024 f32`.
    pub fn describe(&self) -> String {
        let root = if self.kind == CollectiveKind::Broadcast {
            format!(" from rank {}", self.root)
        } else {
            String::new()
        };
        format!(
            "{} over {:?} of {} {}{root}",
            self.kind, self.axes, self.elements, self.dtype
        )
    }
}

/// A transport that moves the bytes: the in-process [`crate::LocalBackend`] and the MPI backend
/// (both through [`TypedBackend`]), NCCL later. Called only for groups of two or more devices,
/// with buffers already checked.
///
/// Every method must either complete on every member of the group or return an error on every
/// member within the backend's timeout.
pub trait Backend: Send {
    /// In-place sum over the group.
    ///
    /// # Errors
    /// As the trait docs.
    fn all_reduce(&mut self, op: &OpInfo, buf: BufMut<'_>) -> Result<(), CommError>;
    /// `output` (len M) = chunk `rank` of the sum of every member's `input` (len group×M).
    ///
    /// # Errors
    /// As the trait docs.
    fn reduce_scatter(
        &mut self,
        op: &OpInfo,
        input: Buf<'_>,
        output: BufMut<'_>,
    ) -> Result<(), CommError>;
    /// `output` (len group×M) = every member's `input` (len M), in rank order.
    ///
    /// # Errors
    /// As the trait docs.
    fn all_gather(
        &mut self,
        op: &OpInfo,
        input: Buf<'_>,
        output: BufMut<'_>,
    ) -> Result<(), CommError>;
    /// Chunk `k` of `output` = chunk `rank` of member `k`'s `input` (equal lengths, group×M).
    ///
    /// # Errors
    /// As the trait docs.
    fn all_to_all(
        &mut self,
        op: &OpInfo,
        input: Buf<'_>,
        output: BufMut<'_>,
    ) -> Result<(), CommError>;
    /// Every member's `buf` = the root's.
    ///
    /// # Errors
    /// As the trait docs.
    fn broadcast(&mut self, op: &OpInfo, buf: BufMut<'_>) -> Result<(), CommError>;
    /// Waits for every member.
    ///
    /// # Errors
    /// As the trait docs.
    fn barrier(&mut self, op: &OpInfo) -> Result<(), CommError>;
}

/// A [`Backend`] written once, generically over the element type: a transport implements these
/// and gets [`Backend`] from the blanket impl below, which is the one place a [`Buf`]/[`BufMut`]
/// is matched to its typed slice (and a mixed-type call refused). The contract is
/// [`Backend`]'s, method for method.
pub trait TypedBackend: Send {
    /// [`Backend::all_reduce`] on a typed buffer.
    ///
    /// # Errors
    /// As [`Backend`]'s docs.
    fn all_reduce_typed<T: Element>(&mut self, op: &OpInfo, buf: &mut [T])
        -> Result<(), CommError>;
    /// [`Backend::reduce_scatter`] on typed buffers.
    ///
    /// # Errors
    /// As [`Backend`]'s docs.
    fn reduce_scatter_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError>;
    /// [`Backend::all_gather`] on typed buffers.
    ///
    /// # Errors
    /// As [`Backend`]'s docs.
    fn all_gather_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError>;
    /// [`Backend::all_to_all`] on typed buffers.
    ///
    /// # Errors
    /// As [`Backend`]'s docs.
    fn all_to_all_typed<T: Element>(
        &mut self,
        op: &OpInfo,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError>;
    /// [`Backend::broadcast`] on a typed buffer.
    ///
    /// # Errors
    /// As [`Backend`]'s docs.
    fn broadcast_typed<T: Element>(&mut self, op: &OpInfo, buf: &mut [T]) -> Result<(), CommError>;
    /// [`Backend::barrier`] (no elements; named apart so it never shadows it).
    ///
    /// # Errors
    /// As [`Backend`]'s docs.
    fn group_barrier(&mut self, op: &OpInfo) -> Result<(), CommError>;
}

/// Input and output of one call have different element types.
fn mixed_types(op: &OpInfo) -> CommError {
    CommError::BadBuffer {
        kind: op.kind,
        axes: op.axes.clone(),
        group_size: op.group.len(),
        reason: "input and output have different element types".into(),
    }
}

/// The dtype dispatch, once for every [`TypedBackend`].
impl<B: TypedBackend> Backend for B {
    fn all_reduce(&mut self, op: &OpInfo, buf: BufMut<'_>) -> Result<(), CommError> {
        match buf {
            BufMut::F32(b) => self.all_reduce_typed(op, b),
            BufMut::BF16(b) => self.all_reduce_typed(op, b),
        }
    }

    fn reduce_scatter(
        &mut self,
        op: &OpInfo,
        input: Buf<'_>,
        output: BufMut<'_>,
    ) -> Result<(), CommError> {
        match (input, output) {
            (Buf::F32(i), BufMut::F32(o)) => self.reduce_scatter_typed(op, i, o),
            (Buf::BF16(i), BufMut::BF16(o)) => self.reduce_scatter_typed(op, i, o),
            _ => Err(mixed_types(op)),
        }
    }

    fn all_gather(
        &mut self,
        op: &OpInfo,
        input: Buf<'_>,
        output: BufMut<'_>,
    ) -> Result<(), CommError> {
        match (input, output) {
            (Buf::F32(i), BufMut::F32(o)) => self.all_gather_typed(op, i, o),
            (Buf::BF16(i), BufMut::BF16(o)) => self.all_gather_typed(op, i, o),
            _ => Err(mixed_types(op)),
        }
    }

    fn all_to_all(
        &mut self,
        op: &OpInfo,
        input: Buf<'_>,
        output: BufMut<'_>,
    ) -> Result<(), CommError> {
        match (input, output) {
            (Buf::F32(i), BufMut::F32(o)) => self.all_to_all_typed(op, i, o),
            (Buf::BF16(i), BufMut::BF16(o)) => self.all_to_all_typed(op, i, o),
            _ => Err(mixed_types(op)),
        }
    }

    fn broadcast(&mut self, op: &OpInfo, buf: BufMut<'_>) -> Result<(), CommError> {
        match buf {
            BufMut::F32(b) => self.broadcast_typed(op, b),
            BufMut::BF16(b) => self.broadcast_typed(op, b),
        }
    }

    fn barrier(&mut self, op: &OpInfo) -> Result<(), CommError> {
        self.group_barrier(op)
    }
}

/// A backend for abstract (shape-only) programs: it moves nothing, and any data-carrying call is
/// an error. Pair it with [`Communicator::record_abstract`](crate::Communicator::record_abstract).
pub struct NoTransport;

impl NoTransport {
    fn refuse(op: &OpInfo) -> CommError {
        CommError::BadBuffer {
            kind: op.kind,
            axes: op.axes.clone(),
            group_size: op.group.len(),
            reason: "this communicator is abstract (shape only) and carries no data".into(),
        }
    }
}

impl Backend for NoTransport {
    fn all_reduce(&mut self, op: &OpInfo, _: BufMut<'_>) -> Result<(), CommError> {
        Err(Self::refuse(op))
    }
    fn reduce_scatter(&mut self, op: &OpInfo, _: Buf<'_>, _: BufMut<'_>) -> Result<(), CommError> {
        Err(Self::refuse(op))
    }
    fn all_gather(&mut self, op: &OpInfo, _: Buf<'_>, _: BufMut<'_>) -> Result<(), CommError> {
        Err(Self::refuse(op))
    }
    fn all_to_all(&mut self, op: &OpInfo, _: Buf<'_>, _: BufMut<'_>) -> Result<(), CommError> {
        Err(Self::refuse(op))
    }
    fn broadcast(&mut self, op: &OpInfo, _: BufMut<'_>) -> Result<(), CommError> {
        Err(Self::refuse(op))
    }
    fn barrier(&mut self, op: &OpInfo) -> Result<(), CommError> {
        Err(Self::refuse(op))
    }
}
