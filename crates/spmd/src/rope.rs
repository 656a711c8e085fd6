//! Rotary position embeddings and their transpose: any variant ([`ferrotext_tensor::Rope`]:
//! rotate-half or interleaved pairs, YaRN, Llama 3 scaling), on the whole head or its tail
//! (DeepSeek's `[nope | rope]` queries), at positions `start..start + seq` (a key/value cache's
//! new tokens) or at each token's own (packed documents restart theirs). Linear, so tags pass
//! through; rotations are orthogonal, so the transpose turns the other way.

use ferrotext_sharding::ArrayType;

use crate::array::{bf16_operands, Array};
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::ids::Ids;
use crate::tape::Backward;

fn type_error(kind: K, op: &str, xs: &[&ArrayType], message: impl Into<String>) -> SpmdError {
    ShardingTypeError::new(kind, op, xs, message).into()
}

/// The type rule of a rotation: `[.., seq, heads, head_dim]` with an even `head_dim − pass`,
/// the head width whole (the sequence may be split: each device rotates its positions).
fn check_rope(t: &ArrayType, pass: usize) -> Result<(), SpmdError> {
    const OP: &str = "rope";
    let head_dim = t.shape().last().copied().unwrap_or(0);
    if t.rank() < 3 || pass > head_dim || !(head_dim - pass).is_multiple_of(2) {
        return Err(type_error(
            K::ShapeError,
            OP,
            &[t],
            if pass == 0 {
                "needs [.., seq, heads, even head_dim]".to_string()
            } else {
                format!("needs [.., seq, heads, head_dim ≥ {pass}] with an even head_dim − {pass}")
            },
        ));
    }
    for d in [t.rank() - 1] {
        if t.sharding().dim_parts(d)? > 1 {
            return Err(type_error(
                K::ShardingMismatch,
                OP,
                &[t],
                format!("dimension {d} is sharded; reshard it first"),
            ));
        }
    }
    Ok(())
}

/// `x`'s shard rotated (`rope_tail` at `positions`, turned back when `inverse`) as an array of
/// `x`'s type: a bf16 shard on the bf16 kernel (no widened copy), else in `f32`.
fn rope_local(
    x: &Array,
    positions: &[usize],
    rope: &ferrotext_tensor::Rope,
    inverse: bool,
    pass: usize,
) -> Result<Array, SpmdError> {
    if let Some(b) = bf16_operands(x.ty(), &[x]) {
        let y = ferrotext_tensor::rope_tail_bf16(b[0], positions, rope, inverse, pass)?;
        return Array::from_bf16(x.ty().clone(), Some(y));
    }
    let local = x
        .local_opt()
        .as_deref()
        .map(|v| ferrotext_tensor::rope_tail(v, positions, rope, inverse, pass))
        .transpose()?;
    Ok(Array::new(x.ty().clone(), local))
}

impl Ctx<'_> {
    /// Rotary position embedding (rotate-half) on `x: [.., seq, heads, head_dim]` at positions
    /// `0..seq` with base `theta`. Linear, so tags pass through.
    ///
    /// # Errors
    /// As [`Ctx::rope_with`].
    pub fn rope(&mut self, x: &Array, theta: f32) -> Result<Array, SpmdError> {
        self.rope_with(x, &ferrotext_tensor::Rope::standard(theta))
    }

    /// Rotary position embedding of any variant (YaRN, interleaved pairs) on
    /// `x: [.., seq, heads, head_dim]` at positions `0..seq`. Linear, so tags pass through.
    ///
    /// # Errors
    /// A sharded seq or head_dim dim; a shape that is not `[.., seq, heads, even head_dim]`.
    pub fn rope_with(
        &mut self,
        x: &Array,
        rope: &ferrotext_tensor::Rope,
    ) -> Result<Array, SpmdError> {
        self.rope_from(x, rope, 0)
    }

    /// [`Ctx::rope_with`] at positions `start..start + seq`: the new tokens of a sequence whose
    /// first `start` positions are already in a key/value cache.
    ///
    /// # Errors
    /// As [`Ctx::rope_with`].
    pub fn rope_from(
        &mut self,
        x: &Array,
        rope: &ferrotext_tensor::Rope,
        start: usize,
    ) -> Result<Array, SpmdError> {
        self.rope_tail_from(x, rope, start, 0)
    }

    /// [`Ctx::rope_from`] on the last `head_dim − pass` elements of each head, the first `pass`
    /// passed through unchanged (DeepSeek's `[nope | rope]` query heads): the bits of slicing
    /// the tail off, rotating it and concatenating it back, in one pass over `x`.
    ///
    /// # Errors
    /// As [`Ctx::rope_with`], or `pass` above head_dim or an odd `head_dim − pass`.
    pub fn rope_tail_from(
        &mut self,
        x: &Array,
        rope: &ferrotext_tensor::Rope,
        start: usize,
        pass: usize,
    ) -> Result<Array, SpmdError> {
        check_rope(x.ty(), pass)?;
        let t = x.ty();
        // A sequence split over devices (context parallelism): this device's positions.
        let seq = t.sharding().shard_ranges(t.shape(), self.device())?[t.rank() - 3].clone();
        let positions: Vec<usize> = (start + seq.start..start + seq.end).collect();
        self.rope_at_positions(x, rope, positions, pass)
    }

    /// [`Ctx::rope_tail_from`] at each token's own position: `positions` (`u32[B, T]`, the
    /// batch split as `x`'s) gives it per row and index — packed documents' positions restart
    /// at each document.
    ///
    /// # Errors
    /// As [`Ctx::rope_tail_from`]; positions whose shape or split is not `x`'s `[B, T]`.
    pub fn rope_tail_at(
        &mut self,
        x: &Array,
        rope: &ferrotext_tensor::Rope,
        positions: &Ids,
        pass: usize,
    ) -> Result<Array, SpmdError> {
        check_rope(x.ty(), pass)?;
        let (t, p) = (x.ty(), positions.ty());
        if t.rank() != 4
            || p.shape() != &t.shape()[..2]
            || p.sharding().spec().dim(0) != t.sharding().spec().dim(0)
        {
            return Err(type_error(
                K::ShardingMismatch,
                "rope",
                &[t, p],
                "needs positions [B, T] split over the batch as x [B, T, heads, head_dim] is",
            ));
        }
        let positions = positions
            .local()
            .map_or_else(Vec::new, |ids| ids.iter().map(|&p| p as usize).collect());
        self.rope_at_positions(x, rope, positions, pass)
    }

    /// The rotation of `x` at `positions` (one per sequence index, or per row and index),
    /// recorded.
    fn rope_at_positions(
        &mut self,
        x: &Array,
        rope: &ferrotext_tensor::Rope,
        positions: Vec<usize>,
        pass: usize,
    ) -> Result<Array, SpmdError> {
        let out = rope_local(x, &positions, rope, false, pass)?;
        self.record(
            Backward::Rope {
                rope: *rope,
                positions,
                pass,
            },
            &[x],
            out,
        )
    }

    /// The transpose of [`Ctx::rope_tail_from`] at `positions`: rotations are orthogonal, so
    /// the transpose turns the other way (and passes the same elements through).
    pub(crate) fn rope_transpose(
        &mut self,
        rope: &ferrotext_tensor::Rope,
        positions: &[usize],
        pass: usize,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        rope_local(ct, positions, rope, true, pass)
    }
}
