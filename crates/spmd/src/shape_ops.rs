//! The shape ops and their transposes: `reduce_sum` ↔ `broadcast_in_dim` (each is the other's
//! transpose), `reshape` ↔ `reshape` back, `transpose` ↔ the inverse permutation.
//!
//! Owns: each op's forward — type from [`crate::rules`], the natural local result resharded onto
//! the output type — and its transpose, emitted with the input's cotangent type as
//! `out_sharding` (R4.3). A sum over a sharded dim yields partial sums that the output type
//! reduces or keeps unreduced; a broadcast's transpose is such a sum. Inside `shard_map` every
//! op here is local and takes no `out_sharding`.
//!
//! bf16: a reshape whose shards reshape in place into the output's layout shares the bf16
//! storage (no copy), and a transpose permutes the bf16 shard; other reshapes widen, move and
//! round (exact: the values are bf16 already).

use ferrotext_sharding::{ArrayType, DimSpec, PartitionSpec};

use crate::array::bf16_operands;
use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::manual::typing::{manual_local, manual_without_out_sharding};
use crate::rules;
use crate::tape::Backward;

impl Ctx<'_> {
    /// Sum over `axes` (R3.16–R3.18).
    ///
    /// # Errors
    /// The reduce_sum type errors.
    ///
    /// # Collectives
    /// An all-reduce (or reduce-scatter) over the axes of summed sharded dims that the output
    /// does not keep unreduced; none otherwise.
    pub fn reduce_sum(
        &mut self,
        x: &Array,
        axes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        let out = self.reduce_sum_untracked(x, axes, out_sharding)?;
        self.record(
            Backward::ReduceSum {
                x: x.ty().clone(),
                axes: axes.to_vec(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn reduce_sum_untracked(
        &mut self,
        x: &Array,
        axes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        if x.ty().is_manual() {
            manual_without_out_sharding("reduce_sum", x, out_sharding)?;
            let shape = rules::reduce_sum_type(x.ty(), axes, None)?.shape().to_vec();
            let local = x
                .local_opt()
                .as_deref()
                .map(|t| t.sum_axes(axes))
                .transpose()?;
            return manual_local(x, shape, local);
        }
        let out_ty = rules::reduce_sum_type(x.ty(), axes, out_sharding)?;
        let spec = x.ty().sharding().spec();
        let mut u = spec.unreduced().clone();
        let mut partitions = Vec::new();
        for d in 0..x.ty().rank() {
            if axes.contains(&d) {
                u.extend(spec.dim(d).axis_names().iter().cloned());
            } else {
                partitions.push(spec.dim(d).clone());
            }
        }
        let natural_spec = PartitionSpec::tagged(partitions, u, spec.reduced().clone())?;
        let natural = rules::make_type(
            "reduce_sum",
            &out_ty,
            out_ty.shape().to_vec(),
            Ok(natural_spec),
        )?;
        let local = match x.local_opt().as_deref() {
            Some(t) => Some(t.sum_axes(axes)?),
            None => None,
        };
        let local = self.convert(local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `x` broadcast to `shape`, its dim `i` becoming dim `dims[i]` (R3.22).
    ///
    /// # Errors
    /// The broadcast_in_dim type errors.
    ///
    /// # Collectives
    /// None for new dims (sliced locally); gathers only when `out_sharding` un-shards an operand
    /// dim.
    pub fn broadcast_in_dim(
        &mut self,
        x: &Array,
        shape: &[usize],
        dims: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        let out = self.broadcast_in_dim_untracked(x, shape, dims, out_sharding)?;
        self.record(
            Backward::Broadcast {
                x: x.ty().clone(),
                dims: dims.to_vec(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn broadcast_in_dim_untracked(
        &mut self,
        x: &Array,
        shape: &[usize],
        dims: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        if x.ty().is_manual() {
            manual_without_out_sharding("broadcast_in_dim", x, out_sharding)?;
            rules::broadcast_in_dim_type(x.ty(), shape, dims, None)?;
            let local = x
                .local_opt()
                .as_deref()
                .map(|t| t.broadcast_in_dim(shape, dims))
                .transpose()?;
            return manual_local(x, shape.to_vec(), local);
        }
        let out_ty = rules::broadcast_in_dim_type(x.ty(), shape, dims, out_sharding)?;
        let natural = rules::broadcast_in_dim_type(x.ty(), shape, dims, None)?;
        let local = match x.local_opt().as_deref() {
            Some(t) => {
                let local_shape = natural.shard_shape();
                Some(t.broadcast_in_dim(&local_shape, dims)?)
            }
            None => None,
        };
        let local = self.convert(local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `x` with a new shape of the same size (R3.23).
    ///
    /// # Errors
    /// The reshape type errors.
    ///
    /// # Collectives
    /// None when every shard stays local (the usual merge or split of a dim sharded on its major
    /// part); otherwise the gathers and slices of the equivalent reshard.
    pub fn reshape(
        &mut self,
        x: &Array,
        new_sizes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        let out = self.reshape_untracked(x, new_sizes, out_sharding)?;
        self.record(Backward::Reshape { x: x.ty().clone() }, &[x], out)
    }

    pub(crate) fn reshape_untracked(
        &mut self,
        x: &Array,
        new_sizes: &[usize],
        out_sharding: Option<&PartitionSpec>,
    ) -> Result<Array, SpmdError> {
        if x.ty().is_manual() {
            manual_without_out_sharding("reshape", x, out_sharding)?;
            rules::reshape_type(x.ty(), new_sizes, None)?;
            let local = x
                .local_opt()
                .as_deref()
                .map(|t| t.clone().reshape(new_sizes))
                .transpose()?;
            return manual_local(x, new_sizes.to_vec(), local);
        }
        let out_ty = rules::reshape_type(x.ty(), new_sizes, out_sharding)?;
        if let Some(b) = bf16_operands(&out_ty, &[x]) {
            // Each shard reshaped in place into the output's own layout: a bf16 view, no copy.
            let natural = rules::reshape_type(x.ty(), new_sizes, None)?;
            if rules::local_reshape_partitions(x.ty(), new_sizes).is_some() && natural == out_ty {
                let local = b[0].reshaped(&out_ty.shard_shape())?;
                return Array::from_bf16(out_ty, Some(local));
            }
        }
        let spec = x.ty().sharding().spec();
        // Either reshape each shard in place, or gather the partitions first.
        let (src_ty, src_local) = if rules::local_reshape_partitions(x.ty(), new_sizes).is_some() {
            (x.ty().clone(), x.local_cloned())
        } else {
            let unsharded = PartitionSpec::tagged(
                Vec::<DimSpec>::new(),
                spec.unreduced().clone(),
                spec.reduced().clone(),
            )?;
            let ty = rules::reshard_type(x.ty(), &unsharded)?;
            let local = self.convert(x.local_cloned(), x.ty(), &ty)?;
            (ty, local)
        };
        let natural = rules::reshape_type(&src_ty, new_sizes, None)?;
        let local = match src_local {
            Some(t) => Some(t.reshape(&natural.shard_shape())?),
            None => None,
        };
        let local = self.convert(local, &natural, &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// `x` with its dims permuted: output dim `d` is input dim `perm[d]`.
    ///
    /// # Errors
    /// `shape_error` when `perm` is not a permutation.
    pub fn transpose(&mut self, x: &Array, perm: &[usize]) -> Result<Array, SpmdError> {
        let out = self.transpose_untracked(x, perm)?;
        self.record(
            Backward::Transpose {
                perm: perm.to_vec(),
            },
            &[x],
            out,
        )
    }

    pub(crate) fn transpose_untracked(
        &mut self,
        x: &Array,
        perm: &[usize],
    ) -> Result<Array, SpmdError> {
        let ty = rules::transpose_type(x.ty(), perm)?;
        if let Some(b) = bf16_operands(&ty, &[x]).filter(|_| !x.ty().is_manual()) {
            return Array::from_bf16(ty, Some(b[0].transpose(perm)?));
        }
        let local = match x.local_opt().as_deref() {
            Some(t) => Some(t.transpose(perm)?),
            None => None,
        };
        if x.ty().is_manual() {
            return manual_local(x, ty.shape().to_vec(), local);
        }
        Ok(Array::new(ty, local))
    }

    /// The transpose of [`Ctx::reduce_sum`] over `axes` of `x`: `ct` broadcast back to `x`'s
    /// shape, typed as `x`'s cotangent.
    pub(crate) fn reduce_sum_transpose(
        &mut self,
        x: &ArrayType,
        axes: &[usize],
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        let kept: Vec<usize> = (0..x.rank()).filter(|d| !axes.contains(d)).collect();
        if x.is_manual() {
            let local = match ct.local_opt().as_deref() {
                Some(t) => Some(t.broadcast_in_dim(x.shape(), &kept)?),
                None => None,
            };
            return Ok(Array::new(x.to_cotangent(), local));
        }
        let target = x.to_cotangent();
        self.broadcast_in_dim_untracked(ct, x.shape(), &kept, Some(target.sharding().spec()))
    }

    /// The transpose of [`Ctx::broadcast_in_dim`] of `x` along `dims`: `ct` summed over the new
    /// (and stretched) dims, typed as `x`'s cotangent.
    pub(crate) fn broadcast_in_dim_transpose(
        &mut self,
        ct: &Array,
        x: &ArrayType,
        dims: &[usize],
    ) -> Result<Array, SpmdError> {
        if x.is_manual() {
            let summed: Vec<usize> = (0..ct.ty().rank()).filter(|d| !dims.contains(d)).collect();
            let local = match ct.local_opt().as_deref() {
                Some(t) => Some(t.sum_axes(&summed)?.reshape(x.shape())?),
                None => None,
            };
            return Ok(Array::new(x.to_cotangent(), local));
        }
        self.unbroadcast_in_dim(ct, x, dims)
    }

    /// Transpose of `broadcast_in_dim(x → ct's shape, dims)`: `reduce_sum` over the new dims
    /// (and the stretched size-1 dims) with the cotangent type as `out_sharding`.
    fn unbroadcast_in_dim(
        &mut self,
        ct: &Array,
        x: &ArrayType,
        dims: &[usize],
    ) -> Result<Array, SpmdError> {
        let target = x.to_cotangent();
        let tspec = target.sharding().spec();
        let stretched: Vec<usize> = (0..x.rank())
            .filter(|&i| x.shape()[i] == 1 && ct.shape()[dims[i]] != 1)
            .collect();
        let summed: Vec<usize> = (0..ct.ty().rank())
            .filter(|d| !dims.contains(d) || stretched.iter().any(|&i| dims[i] == *d))
            .collect();
        if stretched.is_empty() {
            return self.reduce_sum_untracked(ct, &summed, Some(tspec));
        }
        let kept_spec = PartitionSpec::tagged(
            (0..x.rank())
                .filter(|i| !stretched.contains(i))
                .map(|i| tspec.dim(i).clone()),
            tspec.unreduced().clone(),
            tspec.reduced().clone(),
        )?;
        let s = self.reduce_sum_untracked(ct, &summed, Some(&kept_spec))?;
        self.reshape_untracked(&s, x.shape(), Some(tspec))
    }

    /// The transpose of [`Ctx::reshape`] of `x`: `ct` reshaped back, typed as `x`'s cotangent.
    pub(crate) fn reshape_transpose(
        &mut self,
        x: &ArrayType,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        if x.is_manual() {
            let local = match ct.local_opt().as_deref() {
                Some(t) => Some(t.clone().reshape(x.shape())?),
                None => None,
            };
            return Ok(Array::new(x.to_cotangent(), local));
        }
        let target = x.to_cotangent();
        self.reshape_untracked(ct, x.shape(), Some(target.sharding().spec()))
    }

    /// The transpose of [`Ctx::transpose`] by `perm`: `ct` permuted by the inverse.
    pub(crate) fn transpose_transpose(
        &mut self,
        perm: &[usize],
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        let mut inverse = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        self.transpose_untracked(ct, &inverse)
    }
}
