//! The dropless mixture-of-experts primitives inside a manual region: `take_rows` (sort token
//! copies by expert, and back) and `grouped_matmul` (each expert's rows times its matrix), each
//! with its transpose beside it (a local scatter-add; the grouped products of the cotangent).
//!
//! Rows of `x` (this device's token copies, sorted by expert) come in consecutive groups, one per
//! expert; group `g` multiplies `w[g]`. Group sizes are data (they follow the routing), so they
//! may differ from device to device — the *shapes* do not, which keeps the op typeable: `x` is
//! `[rows, d]`, `w` `[experts, d, f]`, the result `[rows, f]`.
//!
//! Typing is `dot_general`'s inside a region (R6.9, R3.14): operands are first cast to the same
//! varying axes (`match_varying`), neither may be unreduced, and reduced is not propagated. So
//! an expert weight entering `{R:data}` is `reduced_vary_cast` here, and its cotangent leaves
//! the region unreduced — no psum — exactly as a dense weight's.

use ferrotext_sharding::{ArrayType, AxisSet, ManualTags};
use ferrotext_tensor::{
    grouped_matmul, grouped_matmul_backward, grouped_matmul_backward_dw_into,
    grouped_matmul_backward_dx, scatter_rows, take_rows, Tensor, PAD_ROW,
};

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::tape::Backward;

fn manual_only(op: &str, xs: &[&ArrayType]) -> Result<(), SpmdError> {
    if xs.iter().all(|t| t.is_manual()) {
        Ok(())
    } else {
        Err(ShardingTypeError::new(
            K::ShardingMismatch,
            op,
            xs,
            format!("{op} runs inside shard_map, on each device's block"),
        )
        .into())
    }
}

impl Ctx<'_> {
    /// Rows `rows[i]` of this device's block of `x` (dim 0), in that order ([`PAD_ROW`]: a zero
    /// row): the output has `rows.len()` rows and `x`'s tags. The indices are this device's own
    /// (they may differ between devices); in abstract mode only their count matters. Only inside
    /// `shard_map`.
    ///
    /// # Errors
    /// Outside a manual region; an unreduced or rank-0 `x`; an index past `x`'s rows.
    ///
    /// # Collectives
    /// None (the backward is a local scatter-add).
    pub fn take_rows(&mut self, x: &Array, rows: &[u32]) -> Result<Array, SpmdError> {
        let t = x.ty();
        manual_only("take_rows", &[t])?;
        if t.rank() == 0 || !t.manual_tags().unreduced().is_empty() {
            return Err(ShardingTypeError::new(
                K::UnreducedOperand,
                "take_rows",
                &[t],
                "take_rows needs a non-scalar operand that is not unreduced",
            )
            .into());
        }
        if let Some(&bad) = rows
            .iter()
            .find(|&&r| r != PAD_ROW && r as usize >= t.shape()[0])
        {
            return Err(ShardingTypeError::new(
                K::ShapeError,
                "take_rows",
                &[t],
                format!("row {bad} is past the {} rows", t.shape()[0]),
            )
            .into());
        }
        let mut shape = t.shape().to_vec();
        shape[0] = rows.len();
        let ty = ArrayType::manual(
            t.dtype(),
            shape,
            t.sharding().mesh().clone(),
            t.manual_tags().clone(),
        )?;
        let local = match x.local_opt().as_deref() {
            Some(block) => Some(take_rows(block, rows)?),
            None => None,
        };
        self.record(
            Backward::TakeRows {
                x: t.clone(),
                rows: rows.to_vec(),
            },
            &[x],
            Array::new(ty, local),
        )
    }

    /// The cotangent of a recorded `take_rows`: `ct`'s rows added into zeros shaped like `x`.
    pub(crate) fn take_rows_transpose(
        &mut self,
        x: &ArrayType,
        rows: &[u32],
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        let local = match ct.local_opt().as_deref() {
            Some(c) => {
                let src: Tensor = c.clone();
                Some(scatter_rows(x.shape(), rows, &src)?)
            }
            None => None,
        };
        Ok(Array::new(x.to_cotangent(), local))
    }

    /// `y[group g rows] = x[group g rows] · w[g]` on this device's blocks (see the module docs);
    /// `group_sizes` are this device's (they may sum to less than `x`'s rows: the rest is
    /// padding, zero in `y`). Only inside `shard_map`.
    ///
    /// # Errors
    /// Outside a manual region; an unreduced operand; shapes that do not fit
    /// (`x` `[rows, d]`, `w` `[groups, d, f]`, one size per group summing to the rows).
    ///
    /// # Collectives
    /// None, either way (the casts of `match_varying` decide what the backward reduces).
    pub fn grouped_matmul(
        &mut self,
        x: &Array,
        w: &Array,
        group_sizes: &[usize],
    ) -> Result<Array, SpmdError> {
        let (tx, tw) = (x.ty(), w.ty());
        manual_only("grouped_matmul", &[tx, tw])?;
        let cast = self.match_varying(&[x, w])?;
        if cast[0].ty() != tx || cast[1].ty() != tw {
            return self.grouped_matmul(&cast[0], &cast[1], group_sizes);
        }
        if !tx.manual_tags().unreduced().is_empty() || !tw.manual_tags().unreduced().is_empty() {
            return Err(ShardingTypeError::new(
                K::UnreducedOperand,
                "grouped_matmul",
                &[tx, tw],
                "lhs or rhs passed to grouped_matmul cannot be unreduced",
            )
            .into());
        }
        crate::rules::same_dtype("grouped_matmul", tx, tw)?;
        let fits = matches!((tx.shape(), tw.shape()), (&[n, d], &[e, wd, _])
            if wd == d && group_sizes.len() == e && group_sizes.iter().sum::<usize>() <= n);
        if !fits {
            return Err(ShardingTypeError::new(
                K::ShapeError,
                "grouped_matmul",
                &[tx, tw],
                format!(
                    "x must be [rows, d], w [groups, d, f] with one group size per group summing \
                     to at most the rows; got group sizes {group_sizes:?}"
                ),
            )
            .into());
        }
        let shape = vec![tx.shape()[0], tw.shape()[2]];
        let tags = ManualTags::new(
            tx.manual_tags().varying().clone(),
            AxisSet::new(),
            AxisSet::new(),
        )?;
        let ty = ArrayType::manual(tx.dtype(), shape, tx.sharding().mesh().clone(), tags)?;
        let local = match (x.local_opt().as_deref(), w.local_opt().as_deref()) {
            (Some(a), Some(b)) => Some(grouped_matmul(a, b, group_sizes, self.threads())?),
            _ => None,
        };
        self.record(
            Backward::GroupedMatmul {
                x: x.clone(),
                w: w.clone(),
                group_sizes: group_sizes.to_vec(),
            },
            &[x, w],
            Array::new(ty, local),
        )
    }

    /// The cotangents of a recorded `grouped_matmul` (`[dx, dw]`), each only where `need` asks
    /// for it.
    pub(crate) fn grouped_matmul_transpose(
        &mut self,
        x: &Array,
        w: &Array,
        group_sizes: &[usize],
        ct: &Array,
        need: [bool; 2],
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        let threads = self.threads();
        let (dx, dw) = match (
            x.local_opt().as_deref(),
            w.local_opt().as_deref(),
            ct.local_opt().as_deref(),
        ) {
            (Some(a), Some(b), Some(c)) => match need {
                [true, true] => {
                    let (dx, dw) = grouped_matmul_backward(a, b, group_sizes, c, threads)?;
                    (Some(dx), Some(dw))
                }
                [true, false] => (
                    Some(grouped_matmul_backward_dx(a, b, group_sizes, c, threads)?),
                    None,
                ),
                [false, true] => (
                    None,
                    Some(grouped_matmul_backward(a, b, group_sizes, c, threads)?.1),
                ),
                [false, false] => (None, None),
            },
            _ => (None, None),
        };
        let cotangent =
            |need: bool, of: &Array, local| need.then(|| Array::new(of.ty().to_cotangent(), local));
        Ok(vec![cotangent(need[0], x, dx), cotangent(need[1], w, dw)])
    }

    /// The `dw` cotangent of a recorded `grouped_matmul` added into `dest` (the expert weights'
    /// local block, in consecutive equal parts; see [`crate::GradientSink::buffer`]) by the
    /// kernels, when each part holds whole groups. Returns whether it was; on `false` nothing
    /// was touched. No collective either way: the cotangent is the local product.
    ///
    /// # Errors
    /// The kernel's shape errors.
    pub(crate) fn grouped_matmul_transpose_into(
        &mut self,
        x: &Array,
        w: &Array,
        group_sizes: &[usize],
        ct: &Array,
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        match (
            x.local_opt().as_deref(),
            w.local_opt().as_deref(),
            ct.local_opt().as_deref(),
        ) {
            (Some(a), Some(b), Some(c)) => Ok(grouped_matmul_backward_dw_into(
                a,
                b,
                group_sizes,
                c,
                self.threads(),
                dest,
            )?),
            _ => Ok(true),
        }
    }
}
