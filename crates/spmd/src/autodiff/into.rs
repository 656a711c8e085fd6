//! Which leaves a node's transpose may add into a gradient buffer in place, and the adding.
//!
//! A leaf whose whole cotangent comes from one node — used once there and by no other node,
//! directly or through ops that only retype (each value on the way used once), or (a product's
//! operand) through the bf16 cast of an `f32` weight — can have that node's transpose add it
//! straight into the sink's buffer, with no cotangent array stored and read back. A leaf with
//! several contributions is handed their sum instead, so the buffer's sum is the handed path's.
//!
//! One exception keeps the handed path's bits with two contributions: a tied embedding table,
//! read by a `take` (the lookup) and, through its bf16 cast, by a product (the LM head). The
//! handed path adds `acc + (w + rows)`: the head's rounded product `w` widened, the lookup's
//! rows added into it, the sum into the buffer. Into the buffer, the product adds `w` to every
//! row the lookup does not touch (`acc + w`, the same bits); the touched rows are saved and set
//! to `-0.0` first (`-0.0 + w` is `w` for every `w`), the lookup's rows are added into them when
//! the walk reaches it, and the saved rows are added back when the table's cotangent is final
//! (`tied`, called from `walk`).

use std::collections::HashMap;

use ferrotext_sharding::DType;

use super::uses::Uses;
use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::tape::{Backward, Tape};

/// A leaf whose whole cotangent a node gives through its input `side` (sink parameter `k`,
/// tape value `leaf`); `through_cast`: the input is the leaf's bf16 cast ([`leaf_through_cast`]);
/// `tied_take`: the leaf's other contribution comes later in the walk from this `take` node
/// ([`tied_through_cast`]; only with `through_cast`).
#[derive(Clone, Copy)]
pub(super) struct Into {
    pub(super) side: usize,
    pub(super) k: usize,
    pub(super) leaf: usize,
    pub(super) through_cast: bool,
    pub(super) tied_take: Option<usize>,
}

/// The leaves whose whole cotangent node `i` gives (see the module docs), given the
/// contributions `cts` the walk has gathered so far.
pub(super) fn sink_targets(tape: &Tape, uses: &Uses, cts: &[Option<Array>], i: usize) -> Vec<Into> {
    let node = &tape.nodes[i];
    node.inputs
        .iter()
        .enumerate()
        .filter_map(|(side, v)| {
            let v = (*v)?;
            if let Some(&k) = uses.leaf_of.get(&v) {
                let here = node.inputs.iter().flatten().filter(|&&u| u == v).count();
                let alone = uses.first_use[v] == Some(i) && cts[v].is_none() && here == 1;
                return alone.then_some(Into {
                    side,
                    k,
                    leaf: v,
                    through_cast: false,
                    tied_take: None,
                });
            }
            if !adds_in_place(&node.backward) {
                return None;
            }
            // Through ops that only retype, or (a product's operand) through the bf16 cast of
            // an `f32` weight, whose rounded cotangent the product's transpose then widens into
            // the weight's buffer itself.
            let (leaf, through_cast, tied_take) = match leaf_through_retypes(tape, &uses.uses, v) {
                Some(leaf) => (leaf, false, None),
                None if matches!(node.backward, Backward::Dot { .. }) => {
                    match leaf_through_cast(tape, &uses.uses, &uses.leaf_of, v) {
                        Some(leaf) => (leaf, true, None),
                        None => {
                            let (leaf, take) = tied_through_cast(tape, uses, v)?;
                            (leaf, true, Some(take))
                        }
                    }
                }
                None => return None,
            };
            let k = *uses.leaf_of.get(&leaf)?;
            cts[leaf].is_none().then_some(Into {
                side,
                k,
                leaf,
                through_cast,
                tied_take,
            })
        })
        .collect()
}

impl Ctx<'_> {
    /// Adds the node's contribution to input `side`'s cotangent into `dest` (that input's local
    /// block, row-major, in consecutive parts of equal length; see [`GradientSink::buffer`](super::GradientSink::buffer)),
    /// where the op can do so itself — a `dot_general`'s transposed product or a `take`'s rows
    /// (part by part when each holds whole rows), a slice into its window (one part) —
    /// and it needs no collective; returns whether it did (`false`: `dest` untouched). Only the
    /// first two go into a sink's buffer ([`adds_in_place`]).
    pub(super) fn add_contribution_into(
        &mut self,
        backward: &Backward,
        ct: &Array,
        side: usize,
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        match (backward, dest) {
            (Backward::Dot { lhs, rhs, dims }, dest) => {
                self.dot_general_transpose_into((lhs, rhs), dims, ct, side, dest)
            }
            (Backward::Take { table, ids, frozen }, dest) => {
                self.take_transpose_into(ct, table, (ids, *frozen), dest)
            }
            (Backward::GroupedMatmul { x, w, group_sizes }, dest) if side == 1 => {
                self.grouped_matmul_transpose_into(x, w, group_sizes, ct, dest)
            }
            (Backward::Cast { from }, dest) => self.cast_transpose_into(*from, ct, dest),
            (Backward::Slice { x, dim, start }, [whole]) => {
                self.slice_transpose_into(x, *dim, *start, ct, whole)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// Ops whose transpose can add a contribution into a buffer in place
/// ([`Ctx::add_contribution_into`]).
pub(super) fn adds_in_place(backward: &Backward) -> bool {
    matches!(
        backward,
        Backward::Dot { .. }
            | Backward::Take { .. }
            | Backward::GroupedMatmul { .. }
            | Backward::Cast { .. }
    )
}

/// The `f32` leaf behind value `v` when `v` is its cast to bf16 (a weight cast at use), directly
/// or through ops that only retype, every value on the way used exactly once: the leaf's
/// cotangent is then `v`'s, widened.
fn leaf_through_cast(
    tape: &Tape,
    uses: &[usize],
    leaf_of: &HashMap<usize, usize>,
    v: usize,
) -> Option<usize> {
    let node = &tape.nodes[v];
    if uses[v] != 1 || !matches!(node.backward, Backward::Cast { from: DType::F32 }) {
        return None;
    }
    let [Some(u)] = node.inputs[..] else {
        return None;
    };
    if leaf_of.contains_key(&u) {
        return (uses[u] == 1).then_some(u);
    }
    leaf_through_retypes(tape, uses, u)
}

/// The tied table behind value `v` and the `take` that also reads it: `v` is the bf16 cast of
/// an `f32` leaf, used once, and the leaf's only other use is as the table of a `take` earlier
/// on the tape (walked after `v`'s reader), which reads it once (see the module docs).
fn tied_through_cast(tape: &Tape, uses: &Uses, v: usize) -> Option<(usize, usize)> {
    let node = &tape.nodes[v];
    if uses.uses[v] != 1 || !matches!(node.backward, Backward::Cast { from: DType::F32 }) {
        return None;
    }
    let [Some(leaf)] = node.inputs[..] else {
        return None;
    };
    if !uses.leaf_of.contains_key(&leaf) || uses.uses[leaf] != 2 {
        return None;
    }
    let take = uses.first_use[leaf].filter(|&t| t < v)?;
    let reader = &tape.nodes[take];
    let reads = reader
        .inputs
        .iter()
        .flatten()
        .filter(|&&u| u == leaf)
        .count();
    (matches!(reader.backward, Backward::Take { .. })
        && reader.inputs.first() == Some(&Some(leaf))
        && reads == 1)
        .then_some((leaf, take))
}

/// The leaf behind value `v` through a chain of ops that only retype ([`retypes_only`]), when
/// every value on the way, `v` and the leaf included, is used exactly once on the tape: the
/// leaf's cotangent is then `v`'s, retyped, with the same local block.
fn leaf_through_retypes(tape: &Tape, uses: &[usize], v: usize) -> Option<usize> {
    let mut at = v;
    loop {
        let node = &tape.nodes[at];
        if uses[at] != 1 {
            return None;
        }
        if matches!(node.backward, Backward::Leaf) {
            return (at != v).then_some(at);
        }
        if !retypes_only(&node.backward) {
            return None;
        }
        let [Some(input)] = node.inputs[..] else {
            return None;
        };
        at = input;
    }
}

/// Ops whose transpose only retypes the cotangent, its local block unchanged: entering and
/// leaving a region, and the pcasts between reduced, varying and unreduced. A leaf seen
/// through a chain of them (each value used once) still has its whole cotangent from the op
/// at the end of the chain, so that op may add it into the leaf's buffer.
fn retypes_only(backward: &Backward) -> bool {
    use crate::manual::AxisState::{Reduced, Unreduced, Varying};
    match backward {
        Backward::EnterRegion { .. } | Backward::ExitRegion { .. } => true,
        Backward::Manual {
            op: crate::manual::op::ManualOp::Pcast { from, to, .. },
        } => matches!((from, to), (Reduced, Varying) | (Varying, Unreduced)),
        _ => false,
    }
}
