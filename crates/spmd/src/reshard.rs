//! `reshard`: move a value between any two shardings of its shape (docs/sharding-rules.md §5.2),
//! issuing the collectives the transition needs and nothing else; its transpose (a reshard of the
//! cotangent onto the source's cotangent type); and [`Ctx::convert`], the data movement every op
//! that communicates goes through.
//!
//! The transition runs in four steps over the mesh axes, each axis handled once:
//! 1. **reduce** the axes unreduced in the source but not the target: by reduce-scatter along a
//!    dimension when the target shards that dimension on exactly those axes appended to its
//!    current partition (U → `P('X')`), else by all-reduce (U → plain, U → R, `U{x,y}` → `U{x}`);
//! 2. **un-shard** the axes a dimension must lose (its partition must become a prefix of the
//!    target's): all-gather them (`P('X')` → R / plain), or, for an axis the target is
//!    unreduced on, keep the own slice in place with zeros elsewhere (`P('X')` → U, no
//!    communication);
//! 3. **slice** locally for axes the target adds to a dimension (R → `P('X')`, free);
//! 4. **zero** for axes the target is unreduced on that the source was replicated on: the
//!    index-0 device of each group keeps the value (plain → U, R → U, free).
//!
//! Reduced is physically replicated, so plain ↔ R is free. Sums stay exact: every step keeps the
//! invariant "the sum over the unreduced axes of the per-device blocks is the value".

use ferrotext_sharding::{ArrayType, AxisSet, Mesh, PartitionSpec};
use ferrotext_tensor::Tensor;

use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::SpmdError;
use crate::rules;
use crate::tape::Backward;

/// True when every device holds the same data under both types: equal partitions and equal
/// unreduced sets (reduced is physically replicated).
pub(crate) fn same_layout(a: &ArrayType, b: &ArrayType) -> bool {
    let (sa, sb) = (a.sharding().spec(), b.sharding().spec());
    a.shape() == b.shape()
        && (0..a.rank()).all(|d| sa.dim(d) == sb.dim(d))
        && sa.unreduced() == sb.unreduced()
        && a.manual_tags() == b.manual_tags()
}

impl Ctx<'_> {
    /// `x` moved onto `target` (same mesh and shape).
    ///
    /// # Errors
    /// A target that is invalid, names Auto axes (R1.17) or does not fit the shape; a failed
    /// collective.
    ///
    /// # Collectives
    /// Per the module docs: all-reduce or reduce-scatter for unreduced axes the target drops,
    /// all-gather for sharded axes it drops, nothing otherwise.
    pub fn reshard(&mut self, x: &Array, target: &PartitionSpec) -> Result<Array, SpmdError> {
        let out = self.reshard_untracked(x, target)?;
        self.record(
            Backward::Reshard {
                src: x.ty().clone(),
            },
            &[x],
            out,
        )
    }

    /// [`Ctx::reshard`] without recording on the tape (transposes and host access use it).
    pub(crate) fn reshard_untracked(
        &mut self,
        x: &Array,
        target: &PartitionSpec,
    ) -> Result<Array, SpmdError> {
        let out_ty = rules::reshard_type(x.ty(), target)?;
        if same_layout(x.ty(), &out_ty) {
            // plain ↔ reduced and other tag-only changes: nothing moves, nothing is copied
            return Ok(x.with_type(out_ty));
        }
        let local = self.convert(x.local_cloned(), x.ty(), &out_ty)?;
        Ok(Array::new(out_ty, local))
    }

    /// The transpose of [`Ctx::reshard`] from `src`: `ct` resharded onto `src`'s cotangent type
    /// (so a reduced → plain cast transposes to a reduction of the unreduced cotangent).
    pub(crate) fn reshard_transpose(
        &mut self,
        src: &ArrayType,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        let target = src.to_cotangent();
        self.reshard_untracked(ct, target.sharding().spec())
    }

    /// The data movement of a reshard from `src` to `dst` (types already checked).
    pub(crate) fn convert(
        &mut self,
        mut local: Option<Tensor>,
        src: &ArrayType,
        dst: &ArrayType,
    ) -> Result<Option<Tensor>, SpmdError> {
        let (mesh, rank, shape) = (src.mesh().clone(), src.rank(), src.shape().to_vec());
        let parts_of = |t: &ArrayType| -> Vec<Vec<String>> {
            (0..rank)
                .map(|d| t.sharding().spec().dim(d).axis_names().to_vec())
                .collect()
        };
        let mut cur = parts_of(src);
        let want = parts_of(dst);
        let mut cur_u: AxisSet = src.sharding().spec().unreduced().clone();
        let dst_u = dst.sharding().spec().unreduced().clone();
        let local_shape = |parts: &[Vec<String>]| shard_shape(&mesh, &shape, parts);
        let in_mesh_order = |set: &AxisSet| -> Vec<String> {
            mesh.axis_names()
                .filter(|a| set.contains(*a))
                .map(str::to_string)
                .collect()
        };

        // 1. reduce
        let mut to_reduce: AxisSet = cur_u.difference(&dst_u).cloned().collect();
        for d in 0..rank {
            if !want[d].starts_with(&cur[d]) || want[d].len() == cur[d].len() {
                continue;
            }
            let extra: Vec<String> = want[d][cur[d].len()..].to_vec();
            if extra.iter().all(|a| to_reduce.contains(a)) {
                local = self.reduce_scatter_dim(&extra, local, &local_shape(&cur), d)?;
                for a in &extra {
                    to_reduce.remove(a);
                    cur_u.remove(a);
                }
                cur[d] = want[d].clone();
            }
        }
        if !to_reduce.is_empty() {
            let axes = in_mesh_order(&to_reduce);
            let elements = local_shape(&cur).iter().product();
            self.all_reduce(&axes, &mut local, elements)?;
            for a in &axes {
                cur_u.remove(a);
            }
        }

        // 2. un-shard what each dimension must lose, minor axes first
        for d in 0..rank {
            let common = cur[d]
                .iter()
                .zip(&want[d])
                .take_while(|(a, b)| a == b)
                .count();
            while cur[d].len() > common {
                let last = cur[d][cur[d].len() - 1].clone();
                if dst_u.contains(&last) {
                    local = self.expand_with_zeros(local, &local_shape(&cur), d, &last)?;
                    cur[d].pop();
                    cur_u.insert(last);
                } else {
                    let mut start = cur[d].len() - 1;
                    while start > common && !dst_u.contains(&cur[d][start - 1]) {
                        start -= 1;
                    }
                    let axes: Vec<String> = cur[d][start..].to_vec();
                    local = self.all_gather_dim(&axes, local, &local_shape(&cur), d)?;
                    cur[d].truncate(start);
                }
            }
        }

        // 3. slice for axes the target adds
        for d in 0..rank {
            if cur[d].len() < want[d].len() {
                let extra: Vec<String> = want[d][cur[d].len()..].to_vec();
                let (index, n) = self.rank_over(&extra)?;
                if let Some(t) = local.take() {
                    let block = t.shape()[d] / n;
                    local = Some(t.slice_dim(d, index * block..(index + 1) * block)?);
                }
                cur[d] = want[d].clone();
            }
        }

        // 4. zero replicas for new unreduced axes the source was replicated on
        let zeroed: AxisSet = dst_u.difference(&cur_u).cloned().collect();
        if !zeroed.is_empty() {
            let (index, _) = self.rank_over(&in_mesh_order(&zeroed))?;
            if index != 0 {
                if let Some(t) = local.as_mut() {
                    t.data_mut().fill(0.0);
                }
            }
        }
        Ok(local)
    }

    /// Dimension `dim` grows by the size of `axis`; this device's block goes to its index along
    /// `axis`, zeros elsewhere (a sharded axis becoming unreduced, no communication).
    fn expand_with_zeros(
        &mut self,
        local: Option<Tensor>,
        local_shape: &[usize],
        dim: usize,
        axis: &str,
    ) -> Result<Option<Tensor>, SpmdError> {
        let (index, n) = self.rank_over(&[axis.to_string()])?;
        let Some(t) = local else { return Ok(None) };
        let zero = Tensor::zeros(local_shape);
        let blocks: Vec<&Tensor> = (0..n)
            .map(|i| if i == index { &t } else { &zero })
            .collect();
        Ok(Some(Tensor::concat(&blocks, dim)?))
    }
}

/// A device's block of an array of `shape` whose dim `d` is split over the axes `parts[d]`.
fn shard_shape(mesh: &Mesh, shape: &[usize], parts: &[Vec<String>]) -> Vec<usize> {
    parts
        .iter()
        .zip(shape)
        .map(|(axes, &n)| {
            n / axes
                .iter()
                .filter_map(|a| mesh.axis(a).map(|x| x.size()))
                .product::<usize>()
        })
        .collect()
}
