//! The autodiff tape: what each recorded op keeps for its transpose ([`Backward`]), and the
//! recorded ops of one differentiated function ([`Tape`]).
//!
//! Plain data: the tape knows the ops' kinds and saved operands, not how they run; the reverse
//! walk (`autodiff`) reads it and dispatches each node to the transpose defined beside its
//! forward op. Every device records the same tape (same program, same types), so the walk
//! issues the same collectives in the same order everywhere.

use ferrotext_sharding::{ArrayType, DType};
use ferrotext_tensor::{CrossEntropy, DotDims, Rope, Tensor};

use crate::array::Array;
use crate::ids::Ids;
use crate::manual::op::ManualOp;
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
    Swiglu {
        g: Array,
        u: Array,
    },
    CausalAttention {
        q: Array,
        k: Array,
        v: Array,
        probs: Option<Tensor>,
        scale: f32,
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
