//! The one error type of the `comm` layer.

use std::time::Duration;

use ferrotext_sharding::{DType, ShardingError};

use crate::trace::CollectiveKind;

/// Why a collective did not complete.
///
/// Every failure of a collective reaches *every* member of its group as one of these (the member
/// that caused it may see another variant), within the configured timeout: a collective never
/// hangs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// The group's axes are not valid on the mesh.
    #[error("`{kind}` over axes {axes:?}: {source}")]
    Axes {
        /// The collective.
        kind: CollectiveKind,
        /// The axes given.
        axes: Vec<String>,
        /// Why they are invalid (boxed: keeps `Result<_, CommError>` small on the hot path).
        source: Box<ShardingError>,
    },
    /// The buffers do not fit the collective (checked before any communication).
    #[error("`{kind}` over axes {axes:?} on a group of {group_size}: {reason}")]
    BadBuffer {
        /// The collective.
        kind: CollectiveKind,
        /// The axes given.
        axes: Vec<String>,
        /// Devices in the group.
        group_size: usize,
        /// What does not fit.
        reason: String,
    },
    /// A reduction of `f32` values asked to travel as an element type the collectives do not
    /// move (only `f32` and `bf16`).
    #[error("`{kind}` over axes {axes:?}: f32 values travel as f32 or bf16, not {dtype}")]
    WireDType {
        /// The collective.
        kind: CollectiveKind,
        /// The axes given.
        axes: Vec<String>,
        /// The element type asked for.
        dtype: DType,
    },
    /// Members of the group issued different collectives at the same point of the program.
    #[error(
        "collective mismatch at collective #{seq}: device {device} issued {mine} but device \
         {other_device} issued {theirs}; every device must issue the same collectives in the same order"
    )]
    Mismatch {
        /// Position in the devices' sequences of collectives.
        seq: u64,
        /// A device whose call is shown as `mine`.
        device: usize,
        /// Its call, described.
        mine: String,
        /// A device that disagrees.
        other_device: usize,
        /// Its call, described.
        theirs: String,
    },
    /// A member of the group left the program (returned, failed or panicked) while others waited.
    #[error(
        "`{kind}` (collective #{seq}) cannot complete: device {departed} has already left the \
         program (it returned, failed or panicked)"
    )]
    PeerDeparted {
        /// The collective.
        kind: CollectiveKind,
        /// Its position in the sequence.
        seq: u64,
        /// The device that left.
        departed: usize,
    },
    /// Not every member arrived within the timeout.
    #[error(
        "`{kind}` (collective #{seq}) over axes {axes:?} timed out after {waited:?}: devices \
         {missing:?} never arrived"
    )]
    Timeout {
        /// The collective.
        kind: CollectiveKind,
        /// Its position in the sequence.
        seq: u64,
        /// The axes given.
        axes: Vec<String>,
        /// How long this device waited.
        waited: Duration,
        /// Members that had not arrived.
        missing: Vec<usize>,
    },
    /// An earlier collective on this group failed; the group cannot be used again.
    #[error("the device group {group:?} is broken by an earlier failure: {cause}")]
    GroupBroken {
        /// The group's devices.
        group: Vec<usize>,
        /// The first failure, printed.
        cause: String,
    },
    /// The processes of a multi-process run were started with different inputs.
    #[error(
        "the processes of this run disagree on {what}: processes {differing:?} differ from \
         process 0; start every process with the same arguments"
    )]
    Disagreement {
        /// What was compared (`the config`, `the mesh`).
        what: String,
        /// The processes whose value differs from process 0's.
        differing: Vec<usize>,
    },
    /// An option of the run (a timeout, a size) is out of range; nothing ran.
    #[error("invalid {what}: {reason}")]
    InvalidOption {
        /// The option.
        what: String,
        /// Why it is refused.
        reason: String,
    },
    /// Not every process of a multi-process run reached a start-up agreement in time.
    #[error(
        "the processes of this run did not all reach the agreement on {what} within {waited:?}: \
         processes {missing:?} never arrived (failed or stuck before it)"
    )]
    ProcessesMissing {
        /// What was being compared (`the config`).
        what: String,
        /// How long this process waited.
        waited: Duration,
        /// The processes that had not arrived.
        missing: Vec<usize>,
    },
    /// The transport between processes reported an error.
    #[error("`{kind}` (collective #{seq}): the transport failed: {detail}")]
    Transport {
        /// The collective.
        kind: CollectiveKind,
        /// Its position in the sequence.
        seq: u64,
        /// The transport's message.
        detail: String,
    },
}
