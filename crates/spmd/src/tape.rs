//! The autodiff tape: what each recorded op keeps for its transpose ([`Backward`]), and the
//! recorded ops of one differentiated function ([`Tape`]).
//!
//! Plain data: the tape knows the ops' kinds and saved operands, not how they run; the reverse
//! walk (`autodiff`) reads it and dispatches each node to the transpose defined beside its
//! forward op. Every device records the same tape (same program, same types), so the walk
//! issues the same collectives in the same order everywhere.

use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;

use ferrotext_sharding::{ArrayType, DType};
use ferrotext_tensor::{CrossEntropy, DotDims, GluActivation, KeyRanges, Rope, Scores, Tensor};

use crate::array::Array;
use crate::ids::Ids;
use crate::manual::op::ManualOp;
use crate::rules::head_loss::HeadLoss;
use crate::rules::{BinaryOp, UnaryOp};

/// What a recorded op needs for its transpose.
#[derive(Debug)]
pub(crate) enum Backward {
    Leaf,
    Unary {
        op: UnaryOp,
        x: Array,
        out: Array,
    },
    Binary {
        op: BinaryOp,
        a: Array,
        b: Array,
        out: Array,
    },
    Dot {
        lhs: Array,
        rhs: Array,
        dims: DotDims,
    },
    ReduceSum {
        x: ArrayType,
        axes: Vec<usize>,
    },
    Broadcast {
        x: ArrayType,
        dims: Vec<usize>,
    },
    Reshape {
        x: ArrayType,
    },
    Cast {
        from: DType,
    },
    Transpose {
        perm: Vec<usize>,
    },
    Reshard {
        src: ArrayType,
    },
    EnterRegion {
        outside: ArrayType,
    },
    ExitRegion {
        inside: ArrayType,
    },
    Manual {
        op: ManualOp,
    },
    Slice {
        x: ArrayType,
        dim: usize,
        start: usize,
    },
    Concat {
        types: Vec<ArrayType>,
        dim: usize,
        sizes: Vec<usize>,
    },
    Take {
        table: ArrayType,
        ids: Ids,
        /// A row whose lookups pass no cotangent back ([`crate::Ctx::take_frozen`]).
        frozen: Option<u32>,
    },
    Select {
        mask: Array,
    },
    RmsNorm {
        x: Array,
        scale: Array,
        inv_rms: Vec<f32>,
    },
    Rope {
        rope: Rope,
        positions: Vec<usize>,
        /// Leading elements of each head passed through unrotated.
        pass: usize,
    },
    Softmax {
        out: Array,
        scale: f32,
    },
    Glu {
        g: Array,
        u: Array,
        act: GluActivation,
    },
    /// The tiled attention (boxed: it keeps four operands).
    Attention(Box<AttentionSaved>),
    /// The LM head's cross-entropy over tiles of tokens (boxed: it keeps its operands).
    HeadLoss(Box<HeadLossSaved>),
    /// A rematerialized region (`crate::remat`): its first output; the region itself is a
    /// `remat::Region`, held opaquely.
    Remat {
        region: Arc<dyn Any + Send + Sync>,
        outputs: usize,
    },
    /// Output `index ≥ 1` of the region whose first output is this node's input: its cotangent
    /// joins the region's when the walk reaches it.
    RematOutput {
        index: usize,
    },
    GroupedMatmul {
        x: Array,
        w: Array,
        group_sizes: Vec<usize>,
    },
    TakeRows {
        x: ArrayType,
        rows: Vec<u32>,
    },
    CrossEntropy {
        logits: ArrayType,
        targets: Ids,
        ce: Option<CrossEntropy>,
        z_loss: f32,
    },
}

/// What the tiled attention keeps for its transpose.
#[derive(Debug)]
pub(crate) struct AttentionSaved {
    pub(crate) q: Array,
    pub(crate) k: Array,
    pub(crate) v: Array,
    /// The output as stored (its row sums with the cotangent enter the backward).
    pub(crate) out: Array,
    /// `[B, H, T]` log-sum-exps of this device's rows (`None` in abstract mode).
    pub(crate) lse: Option<Tensor>,
    pub(crate) ranges: Option<Arc<KeyRanges>>,
    pub(crate) scores: Scores,
}

/// What the tiled LM head's cross-entropy keeps for its transpose: its operands (no logits).
#[derive(Debug)]
pub(crate) struct HeadLossSaved {
    pub(crate) h: Array,
    pub(crate) w: Array,
    pub(crate) targets: Ids,
    pub(crate) spec: HeadLoss,
}

/// One recorded op: the tape values it read (`None`: an input not being differentiated), what
/// its transpose needs, and its output's type. Its own value is its index on the tape.
#[derive(Debug)]
pub(crate) struct Node {
    pub(crate) inputs: Vec<Option<usize>>,
    pub(crate) backward: Backward,
    pub(crate) ty: ArrayType,
}

/// The recorded ops of one differentiated function, in execution order.
#[derive(Debug, Default)]
pub(crate) struct Tape {
    pub(crate) nodes: Vec<Node>,
}

impl Tape {
    /// Appends `node`; returns its value (index).
    pub(crate) fn push(&mut self, node: Node) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }
}

/// What a rematerialized region keeps from its forward pass (JAX's checkpoint policies, as
/// MaxText's `remat_policy` names them): nothing (`full`), every product without batch
/// dimensions (`minimal`: the projections' outputs), and values named by
/// `Ctx::checkpoint_name` (`query_proj`, `key_proj`, `value_proj`, `out_proj`, `mlpwi`,
/// `mlpwo`, `context`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavePolicy {
    /// Keep the outputs of `dot_general`s without batch dimensions.
    pub dots_without_batch: bool,
    /// Keep the values named so.
    pub names: Vec<&'static str>,
}

impl SavePolicy {
    /// Saves nothing: the whole region is recomputed (`full`).
    pub fn nothing() -> SavePolicy {
        SavePolicy::default()
    }

    pub(crate) fn saves_op(&self, backward: &Backward) -> bool {
        self.dots_without_batch
            && matches!(backward, Backward::Dot { dims, .. } if dims.lhs_batch.is_empty())
    }
}

/// A context's rematerialization state: recording a region's forward (what to save, and what
/// was), or replaying it (what was saved).
#[derive(Debug)]
pub(crate) enum RematState {
    Forward {
        policy: SavePolicy,
        saved: HashMap<usize, Array>,
    },
    Replay {
        saved: HashMap<usize, Array>,
    },
}
