//! Errors of the `spmd` layer: typed sharding errors raised before any compute or communication,
//! and wrappers of the lower layers' errors.

use std::fmt;

use ferrotext_comm::CommError;
use ferrotext_sharding::{ArrayType, ShardingError};
use ferrotext_tensor::TensorError;

/// The kind of a sharding type error; the names are those of `docs/conformance-format.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TypeErrorKind {
    /// A spec or sharding that cannot exist (tag overlaps a partition, unknown axis, axis used
    /// twice, tag on a non-explicit axis, reduced ∩ unreduced).
    InvalidSpec,
    /// The op does not accept an unreduced operand.
    UnreducedOperand,
    /// Operands unreduced over different axis sets, or unreduced mixed with not-unreduced where
    /// that would need a hidden reduction.
    UnreducedMismatch,
    /// Reduced sets differ, or an operand is replicated on an axis another is reduced on.
    ReducedConflict,
    /// Contracting dims sharded on both sides and no `out_sharding`.
    AmbiguousContraction,
    /// `out_sharding` asks for unreduced but the contracting dims are sharded differently.
    ContractingMismatch,
    /// `out_sharding`'s unreduced axes differ from the axes the contraction runs over.
    UnreducedNotContracting,
    /// Batch dims sharded differently.
    BatchMismatch,
    /// Operands sharded incompatibly.
    ShardingMismatch,
    /// Shapes do not fit the op, or a dim is not divisible by its axes.
    ShapeError,
}

impl TypeErrorKind {
    /// The FORMAT.md name (`invalid_spec`, `unreduced_operand`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TypeErrorKind::InvalidSpec => "invalid_spec",
            TypeErrorKind::UnreducedOperand => "unreduced_operand",
            TypeErrorKind::UnreducedMismatch => "unreduced_mismatch",
            TypeErrorKind::ReducedConflict => "reduced_conflict",
            TypeErrorKind::AmbiguousContraction => "ambiguous_contraction",
            TypeErrorKind::ContractingMismatch => "contracting_mismatch",
            TypeErrorKind::UnreducedNotContracting => "unreduced_not_contracting",
            TypeErrorKind::BatchMismatch => "batch_mismatch",
            TypeErrorKind::ShardingMismatch => "sharding_mismatch",
            TypeErrorKind::ShapeError => "shape_error",
        }
    }
}

impl fmt::Display for TypeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A program that does not type-check under the explicit-sharding rules. Raised before any
/// compute or communication of the op, on every device alike (types are the same everywhere).
///
/// Prints as "`op`: rule (got `f32[8@data,4]{U:fsdp}`, ...)".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardingTypeError {
    /// Which rule was broken.
    pub kind: TypeErrorKind,
    /// The op, e.g. `dot_general`.
    pub op: String,
    /// The operand types, printed.
    pub operands: Vec<String>,
    /// The rule and the fix, in words.
    pub message: String,
}

impl ShardingTypeError {
    pub(crate) fn new(
        kind: TypeErrorKind,
        op: &str,
        operands: &[&ArrayType],
        message: impl Into<String>,
    ) -> ShardingTypeError {
        ShardingTypeError {
            kind,
            op: op.to_string(),
            operands: operands.iter().map(|t| t.to_string()).collect(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ShardingTypeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {}", self.op, self.message)?;
        if !self.operands.is_empty() {
            f.write_str(" (got ")?;
            for (i, t) in self.operands.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "`{t}`")?;
            }
            f.write_str(")")?;
        }
        Ok(())
    }
}

impl std::error::Error for ShardingTypeError {}

/// Everything an `spmd` operation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpmdError {
    /// The program does not type-check (nothing was computed or communicated).
    #[error(transparent)]
    Type(#[from] ShardingTypeError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A local kernel refused its arguments (a bug in a rule if the types checked).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// Host access to a value whose per-device data is not the value (docs/design.md §4.4).
    #[error(
        "cannot read `{ty}` on the host: it is unreduced, so each device holds only a partial \
         sum; call `reshard` to a spec without unreduced axes first"
    )]
    HostAccessUnreduced {
        /// The array type.
        ty: String,
    },
    /// An abstract (shape-only) array was asked for data.
    #[error("`{ty}` is abstract (shape only): it carries no data")]
    NoData {
        /// The array type.
        ty: String,
    },
    /// The arguments are not those the op needs (wrong count, unknown op, mismatched mesh).
    #[error("`{op}`: {reason}")]
    BadArgument {
        /// The op.
        op: String,
        /// What is wrong.
        reason: String,
    },
}

impl From<ShardingError> for ShardingTypeError {
    fn from(err: ShardingError) -> ShardingTypeError {
        let kind = match err {
            ShardingError::Indivisible { .. } | ShardingError::RankTooSmall { .. } => {
                TypeErrorKind::ShapeError
            }
            _ => TypeErrorKind::InvalidSpec,
        };
        ShardingTypeError {
            kind,
            op: "sharding".into(),
            operands: Vec::new(),
            message: err.to_string(),
        }
    }
}

impl From<ShardingError> for SpmdError {
    fn from(err: ShardingError) -> SpmdError {
        SpmdError::Type(err.into())
    }
}

impl SpmdError {
    /// The type error inside, if this is one.
    pub fn type_error(&self) -> Option<&ShardingTypeError> {
        match self {
            SpmdError::Type(t) => Some(t),
            _ => None,
        }
    }
}
