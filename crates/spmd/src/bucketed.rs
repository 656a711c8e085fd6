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
//! the same collectives in the same order. Sums stay in the tree order and f32, so results are
//! bitwise equal to the per-value path.
//!
//! A plan's reductions (all-reduce and reduce-scatter buckets; never an all-gather) move the
//! element type [`BucketPlan::reduction_wire`] names: `f32` by default, or `bf16` for
//! `grad_dtype=bfloat16` ([`BucketPlan::with_reduction_wire`]), which rounds each member's block
//! once, sums in f32 in the tree order and rounds the sum once (`ferrotext_comm::narrow`): half
//! the bytes, two roundings more, and then no longer bitwise the per-value path.

use ferrotext_comm::CollectiveKind;
use ferrotext_sharding::{ArrayType, DType, PartitionSpec};
use ferrotext_tensor::Tensor;

use crate::array::Array;
use crate::ctx::{chunk_major, from_chunk_major, Ctx};
use crate::error::SpmdError;
use crate::reshard::same_layout;
use crate::rules;

/// What one value's move needs, when it can join a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fused {
    /// All-reduce over the axes.
    AllReduce(Vec<String>),
    /// Reduce-scatter over the axes, scattering along a dimension.
    ReduceScatter(Vec<String>, usize),
    /// All-gather over the axes, concatenating along a dimension.
    AllGather(Vec<String>, usize),
}

impl Fused {
    /// The axes the collective runs over.
    pub(crate) fn axes(&self) -> &[String] {
        match self {
            Fused::AllReduce(a) | Fused::ReduceScatter(a, _) | Fused::AllGather(a, _) => a,
        }
    }

    /// The dimension a reduce-scatter scatters or an all-gather gathers (0 for an all-reduce).
    fn dim(&self) -> usize {
        match self {
            Fused::AllReduce(_) => 0,
            Fused::ReduceScatter(_, d) | Fused::AllGather(_, d) => *d,
        }
    }

    /// Values join one bucket when their collectives are the same kind over the same axes
    /// (whatever dimension each scatters or gathers).
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
    pub(crate) sources: Vec<ArrayType>,
    pub(crate) out_types: Vec<ArrayType>,
    pub(crate) targets: Vec<PartitionSpec>,
    /// Values whose layout does not change (only their type's tags do).
    pub(crate) unchanged: Vec<usize>,
    /// Values no single collective moves: resharded alone.
    pub(crate) alone: Vec<usize>,
    /// Per value, the dimension its collective scatters or gathers (0 for an all-reduce):
    /// values that scatter different dimensions share a bucket, each cut along its own.
    pub(crate) dims: Vec<usize>,
    pub(crate) buckets: Vec<(Fused, Vec<usize>)>,
    /// The element type its reductions move (module docs).
    pub(crate) wire: DType,
}

impl BucketPlan {
    /// This plan with its reductions (all-reduce and reduce-scatter buckets) moving `wire`
    /// elements; all-gathers and values moved alone are unchanged (module docs).
    pub fn with_reduction_wire(mut self, wire: DType) -> BucketPlan {
        self.wire = wire;
        self
    }

    /// The element type the plan's reductions move.
    pub fn reduction_wire(&self) -> DType {
        self.wire
    }

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
        if sources.len() != targets.len() {
            return Err(SpmdError::CountMismatch {
                op: "plan_buckets",
                got: sources.len(),
                what: "values",
                expected: targets.len(),
                per: "targets",
            });
        }
        let mut seen = vec![false; sources.len()];
        if order.len() != sources.len()
            || order
                .iter()
                .any(|&i| i >= seen.len() || std::mem::replace(&mut seen[i], true))
        {
            return Err(SpmdError::BadOrder {
                op: "plan_buckets",
                order: order.to_vec(),
                values: sources.len(),
            });
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
            dims: vec![0; sources.len()],
            buckets: Vec::new(),
            wire: DType::F32,
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
            plan.dims[i] = fused.dim();
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
                a.ok_or(SpmdError::Internal {
                    op: "reshard_planned",
                    invariant: "a value was not moved",
                })
            })
            .collect()
    }

    /// The values of `plan` that are in no bucket, moved (tag-only changes and lone reshards).
    fn move_outside_buckets(
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

    /// Bucket `b` of `plan` moved: the members' local blocks packed, one blocking collective,
    /// unpacked; the members' new values with their indices.
    fn move_planned_bucket(
        &mut self,
        plan: &BucketPlan,
        b: usize,
        xs: &[Array],
    ) -> Result<Vec<(usize, Array)>, SpmdError> {
        check_plan_fits(plan, xs)?;
        let (fused, members) = plan.buckets.get(b).ok_or(SpmdError::NoSuchBucket {
            op: "move_planned_bucket",
            bucket: b,
            buckets: plan.buckets.len(),
        })?;
        let shapes: Vec<Vec<usize>> = members.iter().map(|&i| xs[i].ty().shard_shape()).collect();
        let dims: Vec<usize> = members.iter().map(|&i| plan.dims[i]).collect();
        let packed = if members.iter().any(|&i| xs[i].is_abstract()) {
            None
        } else {
            let (_, n) = self.rank_over(fused.axes())?;
            let total = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
            let owned: Vec<std::borrow::Cow<'_, Tensor>> = members
                .iter()
                .map(|&i| xs[i].local())
                .collect::<Result<_, _>>()?;
            let locals: Vec<&Tensor> = owned.iter().map(|t| &**t).collect();
            Some(pack(fused, &locals, &dims, n, total)?)
        };
        let started = self.issue_bucket(fused, members, plan, shapes, packed, false)?;
        let moved = self.finish_bucket(started)?;
        Ok(members.iter().copied().zip(moved).collect())
    }

    /// Issues a bucket's collective on its `packed` input (the members' blocks in the
    /// collective's layout; `None` in abstract mode, which records it), blocking or on the
    /// background stream. `shapes` are the members' local blocks before the move.
    pub(crate) fn issue_bucket(
        &mut self,
        fused: &Fused,
        members: &[usize],
        plan: &BucketPlan,
        shapes: Vec<Vec<usize>>,
        packed: Option<Vec<f32>>,
        background: bool,
    ) -> Result<StartedBucket, SpmdError> {
        let (kind, axes, wire) = match fused {
            Fused::AllReduce(a) => (CollectiveKind::AllReduce, a, plan.wire),
            Fused::ReduceScatter(a, _) => (CollectiveKind::ReduceScatter, a, plan.wire),
            Fused::AllGather(a, _) => (CollectiveKind::AllGather, a, DType::F32),
        };
        let (_, n) = self.rank_over(axes)?;
        let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
        let mut started = StartedBucket {
            fused: fused.clone(),
            members: members.to_vec(),
            out_types: members.iter().map(|&i| plan.out_types[i].clone()).collect(),
            dims: members.iter().map(|&i| plan.dims[i]).collect(),
            shapes,
            n,
            flight: Flight::Abstract,
        };
        let Some(packed) = packed else {
            let elements = if kind == CollectiveKind::AllGather {
                total * n
            } else {
                total
            };
            self.comm().record_abstract(kind, axes, elements, wire)?;
            return Ok(started);
        };
        if packed.len() != total {
            return Err(SpmdError::CountMismatch {
                op: "issue_bucket",
                got: packed.len(),
                what: "packed elements",
                expected: total,
                per: "elements in the bucket",
            });
        }
        started.flight = if background {
            Flight::Background(match fused {
                Fused::AllReduce(axes) => self.comm().start_all_reduce_as(axes, packed, wire)?,
                Fused::ReduceScatter(axes, _) => {
                    self.comm().start_reduce_scatter_as(axes, packed, wire)?
                }
                Fused::AllGather(axes, _) => self.comm().start_all_gather(axes, packed)?,
            })
        } else {
            Flight::Done(match fused {
                Fused::AllReduce(axes) => {
                    let mut buf = packed;
                    self.comm().all_reduce_as(axes, &mut buf, wire)?;
                    buf
                }
                Fused::ReduceScatter(axes, _) => {
                    let mut mine = vec![0.0; total / n];
                    self.comm()
                        .reduce_scatter_as(axes, &packed, &mut mine, wire)?;
                    mine
                }
                Fused::AllGather(axes, _) => {
                    let mut all = vec![0.0; total * n];
                    self.comm().all_gather(axes, &packed, &mut all)?;
                    all
                }
            })
        };
        Ok(started)
    }

    /// The bucket's values from its collective's output.
    pub(crate) fn finish_bucket(
        &mut self,
        started: StartedBucket,
    ) -> Result<Vec<Array>, SpmdError> {
        let StartedBucket {
            fused,
            out_types,
            dims,
            shapes,
            n,
            flight,
            ..
        } = started;
        let flat = match flight {
            Flight::Abstract => {
                return Ok(out_types
                    .into_iter()
                    .map(|ty| Array::new(ty, None))
                    .collect())
            }
            Flight::Done(flat) => flat,
            Flight::Background(pending) => pending.wait()?,
        };
        let tensors = unpack(&fused, flat, &shapes, &dims, n)?;
        Ok(out_types
            .into_iter()
            .zip(tensors)
            .map(|(ty, t)| Array::new(ty, Some(t)))
            .collect())
    }
}

/// Where a started bucket's collective is.
enum Flight {
    /// Abstract mode: recorded, nothing moves.
    Abstract,
    /// Finished (blocking): its output.
    Done(Vec<f32>),
    /// On the background stream.
    Background(ferrotext_comm::Pending),
}

/// A bucket whose collective has been issued (see [`Ctx::start_buffered_bucket`]).
pub struct StartedBucket {
    fused: Fused,
    members: Vec<usize>,
    out_types: Vec<ArrayType>,
    /// The members' scattered or gathered dimensions.
    dims: Vec<usize>,
    /// The members' local block shapes before the move.
    shapes: Vec<Vec<usize>>,
    /// The group's size.
    n: usize,
    flight: Flight,
}

impl StartedBucket {
    /// The values (indices into the plan's values) the bucket moves.
    pub fn members(&self) -> &[usize] {
        &self.members
    }
}

/// The members' local blocks as the bucket's one collective takes them: back to back (all-reduce,
/// all-gather), or chunk `k` of every block for `k = 0..n` (reduce-scatter: member `r` receives
/// chunk `r` of every value).
fn pack(
    fused: &Fused,
    locals: &[&Tensor],
    dims: &[usize],
    n: usize,
    total: usize,
) -> Result<Vec<f32>, SpmdError> {
    let mut flat = Vec::with_capacity(total);
    match fused {
        Fused::AllReduce(_) | Fused::AllGather(..) => {
            for t in locals {
                flat.extend_from_slice(t.data());
            }
        }
        Fused::ReduceScatter(..) => {
            let split: Vec<(Vec<usize>, std::borrow::Cow<'_, [f32]>)> = locals
                .iter()
                .zip(dims)
                .map(|(t, &dim)| chunk_major(t, dim, n))
                .collect::<Result<_, _>>()?;
            for k in 0..n {
                for (_, data) in &split {
                    let part = data.len() / n;
                    flat.extend_from_slice(&data[k * part..(k + 1) * part]);
                }
            }
        }
    }
    Ok(flat)
}

/// Each member's new local block from the collective's output (`shapes`: the blocks before):
/// views of the output after an all-reduce or a reduce-scatter (no copy), gathered blocks
/// concatenated after an all-gather.
fn unpack(
    fused: &Fused,
    flat: Vec<f32>,
    shapes: &[Vec<usize>],
    dims: &[usize],
    n: usize,
) -> Result<Vec<Tensor>, SpmdError> {
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let total: usize = sizes.iter().sum();
    let mut out = Vec::with_capacity(shapes.len());
    match fused {
        Fused::AllReduce(_) => {
            let flat = std::sync::Arc::new(flat);
            let mut offset = 0;
            for (shape, &size) in shapes.iter().zip(&sizes) {
                out.push(Tensor::view(flat.clone(), offset, shape.clone())?);
                offset += size;
            }
        }
        Fused::ReduceScatter(..) => {
            let flat = std::sync::Arc::new(flat);
            let mut offset = 0;
            for ((shape, &size), &dim) in shapes.iter().zip(&sizes).zip(dims) {
                let mut part_shape = shape.clone();
                part_shape[dim] /= n;
                out.push(Tensor::view(flat.clone(), offset, part_shape)?);
                offset += size / n;
            }
        }
        Fused::AllGather(..) => {
            let mut offset = 0;
            for ((shape, &size), &dim) in shapes.iter().zip(&sizes).zip(dims) {
                // Member k's block of this value, block after block, then along `dim`.
                let mut blocks = Vec::with_capacity(n * size);
                for k in 0..n {
                    let start = k * total + offset;
                    blocks.extend_from_slice(&flat[start..start + size]);
                }
                offset += size;
                out.push(from_chunk_major(blocks, shape, dim, n)?);
            }
        }
    }
    Ok(out)
}

/// `xs` are the values the plan was made for: as many, of the same types.
fn check_plan_fits(plan: &BucketPlan, xs: &[Array]) -> Result<(), SpmdError> {
    if xs.len() != plan.sources.len() {
        return Err(SpmdError::CountMismatch {
            op: "reshard_planned",
            got: xs.len(),
            what: "values",
            expected: plan.sources.len(),
            per: "planned values",
        });
    }
    if let Some((x, want)) = xs.iter().zip(&plan.sources).find(|(x, t)| x.ty() != *t) {
        return Err(SpmdError::TypeMismatch {
            op: "reshard_planned",
            expected: want.to_string(),
            got: x.ty().to_string(),
        });
    }
    Ok(())
}
