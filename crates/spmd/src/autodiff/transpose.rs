//! The dispatch of a tape node to its op's transpose: each arm calls the transpose defined
//! beside the op's forward (`elementwise`, `dot`, `shape_ops`, `reshard`, `structural`, `fused`,
//! `attention`, `grouped`, `convert`, `manual`).

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::manual::{enter_region_transpose, exit_region_transpose};
use crate::tape::Backward;

impl Ctx<'_> {
    /// Cotangents of a node's inputs from the cotangent of its output: each arm calls the
    /// transpose defined beside its forward op. `needed[i]` says whether input `i` is being
    /// differentiated (ops that can skip an input's cotangent do, so a constant operand costs no
    /// reduction).
    pub(super) fn transpose_node(
        &mut self,
        backward: &Backward,
        ct: &Array,
        needed: &[bool],
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        let need = |i: usize| needed.get(i).copied().unwrap_or(false);
        let one = |x: Array| vec![Some(x)];
        Ok(match backward {
            // Leaves keep their cotangent; regions are walked by the walk itself (they need the
            // sink).
            Backward::Leaf | Backward::Remat { .. } | Backward::RematOutput { .. } => Vec::new(),
            Backward::Unary { op, x, out } => one(self.unary_transpose(*op, x, out, ct)?),
            Backward::Binary { op, a, b, out } => self
                .binary_transpose(*op, (a, b, out), ct, [need(0), need(1)])?
                .into(),
            Backward::Dot { lhs, rhs, dims } => self
                .dot_general_transpose((lhs, rhs), dims, ct, [need(0), need(1)])?
                .into(),
            Backward::ReduceSum { x, axes } => one(self.reduce_sum_transpose(x, axes, ct)?),
            Backward::Broadcast { x, dims } => one(self.broadcast_in_dim_transpose(ct, x, dims)?),
            Backward::Reshape { x } => one(self.reshape_transpose(x, ct)?),
            Backward::Cast { from } => one(self.cast_transpose(*from, ct)?),
            Backward::Transpose { perm } => one(self.transpose_transpose(perm, ct)?),
            Backward::Reshard { src } => one(self.reshard_transpose(src, ct)?),
            Backward::EnterRegion { outside } => one(enter_region_transpose(outside, ct)),
            Backward::ExitRegion { inside } => one(exit_region_transpose(inside, ct)),
            Backward::Manual { op } => one(self.manual_transpose(op, ct)?),
            Backward::Slice { x, dim, start } => one(self.slice_transpose(x, *dim, *start, ct)?),
            Backward::Concat { types, dim, sizes } => {
                self.concat_transpose(types, *dim, sizes, ct)?
            }
            Backward::Take { table, ids, frozen } => {
                one(self.take_transpose(ct, table, (ids, *frozen))?)
            }
            Backward::Select { mask } => {
                let [da, db] = self.select_transpose(mask, ct)?;
                vec![Some(da), Some(db)]
            }
            Backward::RmsNorm { x, scale, inv_rms } => {
                let (dx, ds) = self.rms_norm_transpose(ct, x, scale, inv_rms, need(1))?;
                vec![Some(dx), ds]
            }
            Backward::Rope {
                rope,
                positions,
                pass,
            } => one(self.rope_transpose(rope, positions, *pass, ct)?),
            Backward::Softmax { out, scale } => one(self.softmax_transpose(out, *scale, ct)?),
            Backward::Glu { g, u, act } => {
                let [dg, du] = self.glu_transpose(g, u, *act, ct)?;
                vec![Some(dg), Some(du)]
            }
            Backward::Attention(a) => {
                let [dq, dk, dv] = self.attention_transpose(
                    [&a.q, &a.k, &a.v, &a.out],
                    a.lse.as_ref(),
                    a.ranges.as_deref(),
                    a.scores,
                    ct,
                )?;
                vec![Some(dq), Some(dk), Some(dv)]
            }
            Backward::HeadLoss(saved) => self
                .head_cross_entropy_transpose(saved, ct, need(1))?
                .into(),
            Backward::GroupedMatmul { x, w, group_sizes } => {
                self.grouped_matmul_transpose(x, w, group_sizes, ct, [need(0), need(1)])?
            }
            Backward::TakeRows { x, rows } => one(self.take_rows_transpose(x, rows, ct)?),
            Backward::CrossEntropy {
                logits,
                targets,
                ce,
                z_loss,
            } => one(self.cross_entropy_transpose(logits, targets, ce.as_ref(), *z_loss, ct)?),
        })
    }
}
