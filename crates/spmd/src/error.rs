//! Errors of the `spmd` layer: typed sharding errors raised before any compute or communication,
//! and wrappers of the lower layers' errors.
//!
//! Invariant: every variant carries the values it names (the op, the printed operand types,
//! the counts, the bucket) as fields, so a caller can match on them; the printed sentence is
//! built from those fields alone.

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
    /// Operands of different dtypes where the op takes one (no implicit promotion: a `convert`
    /// says where precision changes).
    DTypeMismatch,
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
            TypeErrorKind::DTypeMismatch => "dtype_mismatch",
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
    /// R4.3's check failed: a cotangent of type `got` where `expected` was due, typed by what
    /// differs (unreduced axes, reduced axes, shape, else the sharding).
    pub(crate) fn cotangent(op: &str, expected: &ArrayType, got: &ArrayType) -> ShardingTypeError {
        let (es, gs) = (expected.sharding().spec(), got.sharding().spec());
        let kind = if es.unreduced() != gs.unreduced() {
            TypeErrorKind::UnreducedMismatch
        } else if es.reduced() != gs.reduced() {
            TypeErrorKind::ReducedConflict
        } else if expected.shape() != got.shape() {
            TypeErrorKind::ShapeError
        } else {
            TypeErrorKind::ShardingMismatch
        };
        ShardingTypeError::new(
            kind,
            op,
            &[got],
            format!("Expected cotangent type {expected} but got {got}"),
        )
    }

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
    /// An op got a different number of things than it needs (inputs and `in_specs`, values
    /// and targets, layers of a cache and of a decoder).
    #[error("`{op}`: {got} {what} for {expected} {per}")]
    CountMismatch {
        /// The op.
        op: &'static str,
        /// How many it got.
        got: usize,
        /// What it got (`inputs`).
        what: &'static str,
        /// How many it needs.
        expected: usize,
        /// What fixes the number (`in_specs`).
        per: &'static str,
    },
    /// A key/value cache made for a model of another depth.
    #[error("`{op}`: the cache has {cache} layers, the decoder {model}")]
    CacheLayers {
        /// The op.
        op: &'static str,
        /// The cache's layers.
        cache: usize,
        /// The model's layers.
        model: usize,
    },
    /// An op got fewer values than it consumes, and the number it needs is not known up front.
    #[error("`{op}`: too few {what} ({got})")]
    TooFew {
        /// The op.
        op: &'static str,
        /// What is short (`parameters`).
        what: &'static str,
        /// How many it got.
        got: usize,
    },
    /// An op got no operands where it needs at least one.
    #[error("`{op}`: no operands")]
    NoOperands {
        /// The op.
        op: &'static str,
    },
    /// A value's type is not the one its place was made for (a plan's source type).
    #[error("`{op}`: a value of type `{got}` where the plan has `{expected}`")]
    TypeMismatch {
        /// The op.
        op: &'static str,
        /// The type the place was made for.
        expected: String,
        /// The value's type.
        got: String,
    },
    /// `acc += x` with two different types, or with either on an autodiff tape.
    #[error("`{op}`: `{acc}` += `{x}`: needs one type on both sides and neither on a tape")]
    AccumulateMismatch {
        /// The op.
        op: &'static str,
        /// The accumulator's type.
        acc: String,
        /// The added value's type.
        x: String,
    },
    /// A value read or written while its bucket is handed to its collective.
    #[error("`{op}`: bucket {bucket} is being reduced; its values are not readable or writable")]
    BucketInFlight {
        /// The op.
        op: &'static str,
        /// The bucket.
        bucket: usize,
    },
    /// A bucket handed to its collective a second time.
    #[error("`{op}`: bucket {bucket} started twice")]
    BucketStartedTwice {
        /// The op.
        op: &'static str,
        /// The bucket.
        bucket: usize,
    },
    /// A bucket index the plan does not have.
    #[error("`{op}`: no bucket {bucket} (the plan has {buckets})")]
    NoSuchBucket {
        /// The op.
        op: &'static str,
        /// The index asked for.
        bucket: usize,
        /// How many buckets the plan has.
        buckets: usize,
    },
    /// A value index the buffers do not have.
    #[error("`{op}`: no value {index} (the buffers hold {values})")]
    NoSuchValue {
        /// The op.
        op: &'static str,
        /// The index asked for.
        index: usize,
        /// How many values there are.
        values: usize,
    },
    /// Bucket buffers used with a plan (or other buffers) they were not made for, or one of
    /// them being reduced.
    #[error("`{op}`: needs buffers of this plan, none of them being reduced")]
    PlanMismatch {
        /// The op.
        op: &'static str,
    },
    /// A bucket order that does not list every value exactly once.
    #[error("`{op}`: the order must list every value once (got {order:?} for {values} values)")]
    BadOrder {
        /// The op.
        op: &'static str,
        /// The order given.
        order: Vec<usize>,
        /// How many values there are.
        values: usize,
    },
    /// A value that must be a scalar (one element) is not.
    #[error("`{op}`: needs a scalar, got `{ty}`")]
    NotScalar {
        /// The op.
        op: &'static str,
        /// The value's type.
        ty: String,
    },
    /// The op has no transpose rule, so a gradient cannot flow through it.
    #[error("`{op}` has no transpose; it cannot be differentiated")]
    NotDifferentiable {
        /// The op.
        op: &'static str,
    },
    /// An unreduced value built directly instead of by `reshard` (docs/design.md §4.5).
    #[error(
        "`{op}`: cannot build `{ty}` directly: only `reshard` makes a value unreduced \
         (docs/design.md §4.5); build it plain and reshard"
    )]
    UnreducedConstruction {
        /// The op.
        op: &'static str,
        /// The type asked for.
        ty: String,
    },
    /// A non-zero constant typed unreduced: it would be summed over the unreduced axes.
    #[error(
        "`full`: a constant {value} typed `{ty}` would be summed over its unreduced axes \
         (JAX's R9.2); build it plain and `reshard`"
    )]
    UnreducedConstant {
        /// The constant.
        value: f32,
        /// The type asked for.
        ty: String,
    },
    /// A local shard whose shape is not the type's shard shape.
    #[error("`{op}`: a shard of `{ty}` has shape {expected:?}, got {got:?}")]
    ShardShape {
        /// The op.
        op: &'static str,
        /// The array type.
        ty: String,
        /// The type's shard shape.
        expected: Vec<usize>,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A local block whose length is not the type's shard size.
    #[error("`{op}`: a block of `{ty}` has {expected} elements, got {got}")]
    ShardLength {
        /// The op.
        op: &'static str,
        /// The type.
        ty: String,
        /// The type's shard size.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A dimension index past a shape's rank.
    #[error("`{op}`: no dimension {dim} in {shape:?}")]
    NoDimension {
        /// The op.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The shape.
        shape: Vec<usize>,
    },
    /// A dimension that does not split into the parts asked for.
    #[error("`{op}`: {parts} parts do not divide dimension {dim} of {shape:?}")]
    Indivisible {
        /// The op.
        op: &'static str,
        /// How many parts.
        parts: usize,
        /// The dimension.
        dim: usize,
        /// The shape.
        shape: Vec<usize>,
    },
    /// `out_sharding` given to an op inside a `shard_map` body, where every op is local.
    #[error("`{op}`: `out_sharding` {spec} is not allowed inside a shard_map body")]
    OutShardingInManual {
        /// The op.
        op: &'static str,
        /// The spec given, printed.
        spec: String,
    },
    /// Weights of an optional block on a model config without that block's settings.
    #[error("`{op}`: {block} weights on a config without {block} settings")]
    MissingSettings {
        /// The op.
        op: &'static str,
        /// The block (`MoE`, `MLA`).
        block: &'static str,
    },
    /// A setting of an op out of its range.
    #[error("`{op}`: {key} = {value} with {limit} {of}")]
    SettingOutOfRange {
        /// The op.
        op: &'static str,
        /// The setting (`num_experts_per_tok`).
        key: &'static str,
        /// Its value.
        value: usize,
        /// The bound it must stay within (`1..=limit`).
        limit: usize,
        /// What the bound counts (`experts`).
        of: &'static str,
    },
    /// A weight whose shape does not fit the op's settings.
    #[error("`{op}`: {name} must be {expected}, got {got}")]
    WeightShape {
        /// The op.
        op: &'static str,
        /// The weight (`wi_0`).
        name: &'static str,
        /// The shape it must have (`[8, _, _]`).
        expected: String,
        /// What it has (its type, or its shape).
        got: String,
    },
    /// Two operands that must be split alike are not.
    #[error("`{op}`: {rule}: `{first}` vs `{other}`")]
    SplitMismatch {
        /// The op.
        op: &'static str,
        /// What must hold (`the expert kernels must split their expert dim alike`).
        rule: &'static str,
        /// The first operand's type.
        first: String,
        /// The operand that differs.
        other: String,
    },
    /// Expert parallelism over an axis that does not also split the batch.
    #[error(
        "`{op}`: expert parallelism over `{axis}` needs the batch split over it too; x is `{x}`"
    )]
    ExpertAxisNotOnBatch {
        /// The op.
        op: &'static str,
        /// The expert axis.
        axis: String,
        /// The input's type.
        x: String,
    },
    /// Experts that do not split evenly over the devices of the expert axes.
    #[error("`{op}`: {experts} experts do not split over {devices} devices of {axes:?}")]
    ExpertsIndivisible {
        /// The op.
        op: &'static str,
        /// How many experts.
        experts: usize,
        /// How many devices the expert axes span.
        devices: usize,
        /// The expert axes.
        axes: Vec<String>,
    },
    /// A loss with no per-device partial sum (it depends on the whole micro-batch).
    #[error(
        "`{op}`: an auxiliary loss depends on the whole micro-batch and has no per-device \
         partial sum"
    )]
    NoPartialSum {
        /// The op.
        op: &'static str,
    },
    /// A conformance case that cannot be read (docs/conformance-format.md).
    #[error("`conformance`: {reason}")]
    BadCase {
        /// What is wrong with the case.
        reason: String,
    },
    /// A caller's callback (a gradient sink, a hook) stopped the walk with its own reason.
    #[error("`{op}`: {reason}")]
    Stopped {
        /// The callback.
        op: &'static str,
        /// Why it stopped.
        reason: String,
    },
    /// An invariant of the op's own bookkeeping broke: a bug in ferrotext, not bad input.
    #[error("`{op}`: {invariant}")]
    Internal {
        /// The op.
        op: &'static str,
        /// The invariant, as the fact that was found instead.
        invariant: &'static str,
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
