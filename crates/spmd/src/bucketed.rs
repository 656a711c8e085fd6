//! Bucketed resharding: many values moved at once, with one collective per bucket of values
//! that need the same collective, instead of one per value — what data-parallel systems do with
//! their gradients (PyTorch DDP's 25 MB buckets).
//!
//! Every value is typed exactly as [`Ctx::reshard`] types it (the same rule, the same errors);
//! only the data movement is fused. Three transitions are bucketed, each a single collective over
//! a set of axes `A` applied to every member's local blocks, packed back to back:
//! * **all-reduce**: the source is unreduced over `A` and the target has the same partitions
//!   without `A` (`{U:data}` → plain, the deferred gradient reduction);
//! * **reduce-scatter**: as above, but the target also shards one dimension over `A` appended to
//!   its partition (`{U:data}` → the ZeRO-1 shard); each member's block of every value is cut
//!   into rank-ordered chunks along that dimension and the chunks of all values for one member
//!   are packed together, so member `r` receives chunk `r` of every value;
//! * **all-gather**: one dimension loses trailing axes `A` (the ZeRO-1 shard → plain).
//!
//! Any other transition runs alone through [`Ctx::reshard`]. Values join buckets in the order
//! given, a bucket closes when the next value would take it past the byte budget (a value larger
//! than the budget is a bucket of its own), so every device forms the same buckets and issues
//! the same collectives in the same order. Sums stay in rank order and f32, so results are
//! bitwise equal to the per-value path.

use ferrotext_comm::CollectiveKind;
use ferrotext_sharding::{ArrayType, DType, PartitionSpec};
use ferrotext_tensor::Tensor;

use crate::array::Array;
use crate::ctx::{chunk_major, Ctx};
use crate::error::SpmdError;
use crate::reshard::same_layout;
use crate::rules;

/// What one value's move needs, when it can join a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Fused {
    /// All-reduce over the axes.
    AllReduce(Vec<String>),
    /// Reduce-scatter over the axes, scattering along a dimension.
    ReduceScatter(Vec<String>, usize),
    /// All-gather over the axes, concatenating along a dimension.
    AllGather(Vec<String>, usize),
}

impl Fused {
    /// Values join one bucket when their collectives are the same kind over the same axes.
    fn bucket_key(&self) -> (u8, &[String]) {
        match self {
            Fused::AllReduce(a) => (0, a),
            Fused::ReduceScatter(a, _) => (1, a),
            Fused::AllGather(a, _) => (2, a),
        }
    }
}

/// The axes of `set` in mesh order.
fn in_mesh_order(ty: &ArrayType, set: &ferrotext_sharding::AxisSet) -> Vec<String> {
    ty.mesh()
        .axis_names()
        .filter(|a| set.contains(*a))
        .map(str::to_string)
        .collect()
}

/// The single collective that moves `src` to `dst`, when there is one (see the module docs).
fn classify(src: &ArrayType, dst: &ArrayType) -> Option<Fused> {
    let (s, d) = (src.sharding().spec(), dst.sharding().spec());
    if src.manual_tags() != dst.manual_tags() || !d.unreduced().is_subset(s.unreduced()) {
        return None;
    }
    let dropped: ferrotext_sharding::AxisSet =
        s.unreduced().difference(d.unreduced()).cloned().collect();
    let axes = in_mesh_order(src, &dropped);
    let changed: Vec<usize> = (0..src.rank()).filter(|&i| s.dim(i) != d.dim(i)).collect();
    match (axes.is_empty(), changed.as_slice()) {
        (false, []) => Some(Fused::AllReduce(axes)),
        (false, &[dim]) => {
            let (from, to) = (s.dim(dim).axis_names(), d.dim(dim).axis_names());
            (to.starts_with(from) && to[from.len()..] == axes[..])
                .then_some(Fused::ReduceScatter(axes, dim))
        }
        (true, &[dim]) => {
            let (from, to) = (s.dim(dim).axis_names(), d.dim(dim).axis_names());
            if !from.starts_with(to) || from.len() == to.len() {
                return None;
            }
            let lost = from[to.len()..].to_vec();
            // Gathered in rank order, first axis major: the lost axes must be in mesh order.
            let ordered: Vec<String> = src
                .mesh()
                .axis_names()
                .filter(|a| lost.iter().any(|l| l == a))
                .map(str::to_string)
                .collect();
            (ordered == lost).then_some(Fused::AllGather(lost, dim))
        }
        _ => None,
    }
}

/// How a set of values moves onto their targets: which values travel together in which bucket.
/// Built once (it depends on types only) and reused every step; every device builds the same
/// plan from the same types.
#[derive(Clone, Debug)]
pub struct BucketPlan {
    sources: Vec<ArrayType>,
    out_types: Vec<ArrayType>,
    targets: Vec<PartitionSpec>,
    /// Values whose layout does not change (only their type's tags do).
    unchanged: Vec<usize>,
    /// Values no single collective moves: resharded alone.
    alone: Vec<usize>,
    buckets: Vec<(Fused, Vec<usize>)>,
}

impl BucketPlan {
    /// The buckets' members (indices into the values), in the order the plan runs them.
    pub fn buckets(&self) -> impl Iterator<Item = &[usize]> + '_ {
        self.buckets.iter().map(|(_, m)| m.as_slice())
    }

    /// The number of buckets.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }
}

impl Ctx<'_> {
    /// The plan for moving values of types `sources` onto `targets` in buckets of at most
    /// `bucket_bytes`, filling buckets in the order `order` lists the values (e.g. reversed, so
    /// the gradients a backward pass finishes first share the first bucket).
    ///
    /// # Errors
    /// As [`Ctx::reshard`]'s typing for any value; lengths that differ; an `order` that is not
    /// a permutation of the values.
    pub fn plan_buckets(
        &self,
        sources: &[ArrayType],
        targets: &[PartitionSpec],
        bucket_bytes: usize,
        order: &[usize],
    ) -> Result<BucketPlan, SpmdError> {
        let bad = |reason: String| SpmdError::BadArgument {
            op: "plan_buckets".into(),
            reason,
        };
        if sources.len() != targets.len() {
            return Err(bad(format!(
                "{} values but {} targets",
                sources.len(),
                targets.len()
            )));
        }
        let mut seen = vec![false; sources.len()];
        if order.len() != sources.len()
            || order
                .iter()
                .any(|&i| i >= seen.len() || std::mem::replace(&mut seen[i], true))
        {
            return Err(bad("the order must list every value once".into()));
        }
        let out_types = sources
            .iter()
            .zip(targets)
            .map(|(x, t)| rules::reshard_type(x, t))
            .collect::<Result<Vec<_>, _>>()?;
        let mut plan = BucketPlan {
            sources: sources.to_vec(),
            out_types,
            targets: targets.to_vec(),
            unchanged: Vec::new(),
            alone: Vec::new(),
            buckets: Vec::new(),
        };
        // (the fused collective, the value indices, the bucket's bytes)
        let mut open: Vec<(Fused, Vec<usize>, usize)> = Vec::new();
        for &i in order {
            let (src, dst) = (&sources[i], &plan.out_types[i]);
            if same_layout(src, dst) {
                plan.unchanged.push(i);
                continue;
            }
            let Some(fused) = classify(src, dst) else {
                plan.alone.push(i);
                continue;
            };
            let bytes = src.shard_shape().iter().product::<usize>() * 4;
            let slot = open
                .iter()
                .position(|(f, _, _)| f.bucket_key() == fused.bucket_key());
            match slot {
                Some(s) if open[s].2 + bytes <= bucket_bytes || open[s].1.is_empty() => {
                    open[s].1.push(i);
                    open[s].2 += bytes;
                }
                Some(s) => {
                    let (f, members, _) = open.remove(s);
                    plan.buckets.push((f, members));
                    open.push((fused, vec![i], bytes));
                }
                None => open.push((fused, vec![i], bytes)),
            }
        }
        plan.buckets
            .extend(open.into_iter().map(|(f, m, _)| (f, m)));
        Ok(plan)
    }

    /// Each `xs[i]` moved onto `targets[i]`, as [`Ctx::reshard`] would, with the collectives
    /// fused into buckets of at most `bucket_bytes` filled in value order (see the module docs).
    ///
    /// # Errors
    /// As [`Ctx::reshard`] for any value (checked for every value before anything moves);
    /// `xs` and `targets` of different lengths; a failed collective.
    ///
    /// # Collectives
    /// One all-reduce, reduce-scatter or all-gather per bucket; values that no bucket fits
    /// issue their own [`Ctx::reshard`] collectives. Not differentiable: for use outside
    /// [`Ctx::value_and_grad`] (an optimizer's reduction).
    pub fn reshard_bucketed(
        &mut self,
        xs: &[Array],
        targets: &[PartitionSpec],
        bucket_bytes: usize,
    ) -> Result<Vec<Array>, SpmdError> {
        let types: Vec<ArrayType> = xs.iter().map(|x| x.ty().clone()).collect();
        let order: Vec<usize> = (0..xs.len()).collect();
        let plan = self.plan_buckets(&types, targets, bucket_bytes, &order)?;
        self.reshard_planned(&plan, xs)
    }

    /// `xs` moved as `plan` says: values resharded alone first, then each bucket in order.
    ///
    /// # Errors
    /// Values whose types are not those the plan was made for; a failed collective.
    ///
    /// # Collectives
    /// As [`Ctx::reshard_bucketed`].
    pub fn reshard_planned(
        &mut self,
        plan: &BucketPlan,
        xs: &[Array],
    ) -> Result<Vec<Array>, SpmdError> {
        let mut out: Vec<Option<Array>> = vec![None; xs.len()];
        self.move_outside_buckets(plan, xs, &mut out)?;
        for b in 0..plan.buckets.len() {
            for (i, a) in self.move_planned_bucket(plan, b, xs)? {
                out[i] = Some(a);
            }
        }
        out.into_iter()
            .map(|a| {
                a.ok_or_else(|| SpmdError::BadArgument {
                    op: "reshard_planned".into(),
                    reason: "a value was not moved".into(),
                })
            })
            .collect()
    }

    /// The values of `plan` that are in no bucket, moved (tag-only changes and lone reshards).
    ///
    /// # Errors
    /// As [`Ctx::reshard`].
    pub fn move_outside_buckets(
        &mut self,
        plan: &BucketPlan,
        xs: &[Array],
        out: &mut [Option<Array>],
    ) -> Result<(), SpmdError> {
        check_plan_fits(plan, xs)?;
        for &i in &plan.unchanged {
            out[i] = Some(xs[i].with_type(plan.out_types[i].clone()));
        }
        for &i in &plan.alone {
            out[i] = Some(self.reshard_untracked(&xs[i], &plan.targets[i])?);
        }
        Ok(())
    }

    /// Bucket `b` of `plan` moved: its members' new values, with their indices.
    ///
    /// # Errors
    /// Values whose types are not those the plan was made for; a failed collective.
    ///
    /// # Collectives
    /// The bucket's one collective.
    pub fn move_planned_bucket(
        &mut self,
        plan: &BucketPlan,
        b: usize,
        xs: &[Array],
    ) -> Result<Vec<(usize, Array)>, SpmdError> {
        check_plan_fits(plan, xs)?;
        let (fused, members) = plan.buckets.get(b).ok_or_else(|| SpmdError::BadArgument {
            op: "move_planned_bucket".into(),
            reason: format!("no bucket {b}"),
        })?;
        let moved = self.move_bucket(fused, xs, &plan.out_types, members)?;
        Ok(members.iter().copied().zip(moved).collect())
    }

    /// One bucket: pack the members' local blocks, one collective, unpack.
    fn move_bucket(
        &mut self,
        fused: &Fused,
        xs: &[Array],
        out_types: &[ArrayType],
        members: &[usize],
    ) -> Result<Vec<Array>, SpmdError> {
        let sizes: Vec<usize> = members
            .iter()
            .map(|&i| xs[i].ty().shard_shape().iter().product())
            .collect();
        let total: usize = sizes.iter().sum();
        let abstract_mode = members.iter().any(|&i| xs[i].is_abstract());
        let (kind, axes) = match fused {
            Fused::AllReduce(a) => (CollectiveKind::AllReduce, a),
            Fused::ReduceScatter(a, _) => (CollectiveKind::ReduceScatter, a),
            Fused::AllGather(a, _) => (CollectiveKind::AllGather, a),
        };
        let (_, n) = self.rank_over(axes)?;
        if abstract_mode {
            let elements = if kind == CollectiveKind::AllGather {
                total * n
            } else {
                total
            };
            self.comm()
                .record_abstract(kind, axes, elements, DType::F32)?;
            return Ok(members
                .iter()
                .map(|&i| Array::new(out_types[i].clone(), None))
                .collect());
        }
        let locals: Vec<&Tensor> = members
            .iter()
            .map(|&i| xs[i].local())
            .collect::<Result<_, _>>()?;
        let outputs: Vec<Tensor> = match fused {
            Fused::AllReduce(axes) => {
                let mut flat = Vec::with_capacity(total);
                for t in &locals {
                    flat.extend_from_slice(t.data());
                }
                self.comm().all_reduce(axes, &mut flat)?;
                let mut rest = flat.as_slice();
                let mut out = Vec::with_capacity(locals.len());
                for t in &locals {
                    let (mine, tail) = rest.split_at(t.len());
                    out.push(Tensor::new(t.shape().to_vec(), mine.to_vec())?);
                    rest = tail;
                }
                out
            }
            Fused::ReduceScatter(axes, dim) => {
                // Chunk k of every value, for k = 0..n, back to back.
                let split: Vec<(Vec<usize>, Vec<f32>)> = locals
                    .iter()
                    .map(|t| chunk_major(t, *dim, n))
                    .collect::<Result<_, _>>()?;
                let mut flat = Vec::with_capacity(total);
                for k in 0..n {
                    for ((_, data), &size) in split.iter().zip(&sizes) {
                        let part = size / n;
                        flat.extend_from_slice(&data[k * part..(k + 1) * part]);
                    }
                }
                let mut mine = vec![0.0; total / n];
                self.comm().reduce_scatter(axes, &flat, &mut mine)?;
                let mut rest = mine.as_slice();
                let mut out = Vec::with_capacity(locals.len());
                for ((shape, _), &size) in split.iter().zip(&sizes) {
                    let (part, tail) = rest.split_at(size / n);
                    out.push(Tensor::new(shape.clone(), part.to_vec())?);
                    rest = tail;
                }
                out
            }
            Fused::AllGather(axes, dim) => {
                let mut flat = Vec::with_capacity(total);
                for t in &locals {
                    flat.extend_from_slice(t.data());
                }
                let mut all = vec![0.0; total * n];
                self.comm().all_gather(axes, &flat, &mut all)?;
                let mut out = Vec::with_capacity(locals.len());
                let mut offset = 0;
                for t in &locals {
                    let blocks: Vec<Tensor> = (0..n)
                        .map(|k| {
                            let start = k * total + offset;
                            Tensor::new(t.shape().to_vec(), all[start..start + t.len()].to_vec())
                        })
                        .collect::<Result<_, _>>()?;
                    offset += t.len();
                    let refs: Vec<&Tensor> = blocks.iter().collect();
                    out.push(Tensor::concat(&refs, *dim)?);
                }
                out
            }
        };
        Ok(members
            .iter()
            .zip(outputs)
            .map(|(&i, t)| Array::new(out_types[i].clone(), Some(t)))
            .collect())
    }
}

/// `xs` are the values the plan was made for: as many, of the same types.
fn check_plan_fits(plan: &BucketPlan, xs: &[Array]) -> Result<(), SpmdError> {
    let bad = |reason: String| SpmdError::BadArgument {
        op: "reshard_planned".into(),
        reason,
    };
    if xs.len() != plan.sources.len() {
        return Err(bad(format!(
            "{} values for a plan of {}",
            xs.len(),
            plan.sources.len()
        )));
    }
    if let Some((x, want)) = xs.iter().zip(&plan.sources).find(|(x, t)| x.ty() != *t) {
        return Err(bad(format!(
            "a value of type `{}` where the plan has `{want}`",
            x.ty()
        )));
    }
    Ok(())
}
