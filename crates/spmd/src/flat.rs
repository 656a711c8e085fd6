//! Flat bucket buffers: the values a [`BucketPlan`] moves in buckets, held between moves in the
//! layout of their bucket's collective — PyTorch DDP's gradients as views of their bucket — so
//! that accumulating into them writes the collective's input directly and starting a bucket
//! copies nothing.
//!
//! # Invariants
//! * One buffer per bucket of the plan, `Σ` of its members' local block sizes long, laid out as
//!   the bucket's collective takes its input: members back to back (all-reduce, all-gather), or
//!   in `n` segments, segment `k` holding chunk `k` of every member along the scattered
//!   dimension (reduce-scatter over a group of `n`: member `k` receives segment `k`).
//! * Values in no bucket (a tag-only change, or a move no single collective makes) are kept as
//!   [`Array`]s and moved alone, as [`Ctx::reshard_planned`] moves them.
//! * Every value is typed as the plan's source: [`Ctx::accumulate_into`] refuses any other type,
//!   exactly as [`Ctx::accumulate`] does, and [`BucketBuffers::value_mut`] (a value's elements
//!   for a kernel to add into: `Ctx::value_and_grad_into`) gives them only for that type and
//!   only for a value that is one contiguous run in each segment of a buffer not being
//!   reduced.
//! * Sums are the element-wise `f32` additions of one accumulator per value, in the same order,
//!   so moving the buffers is bitwise [`Ctx::reshard_planned`] of the same accumulated arrays.

use ferrotext_sharding::ArrayType;
use ferrotext_tensor::{add_assign_slice, written_zeros, Tensor};

use crate::array::Array;
use crate::bucketed::{BucketPlan, Fused, StartedBucket};
use crate::ctx::{Ctx, Mode};
use crate::error::SpmdError;

/// Where a value lives in its bucket's buffer: `runs` contiguous runs of `run` elements per
/// segment, run `o` of segment `k` at `k · segment + offset + o · run` in the buffer and at
/// `o · run · segments + k · run` in the value's local block (row-major).
#[derive(Clone, Copy, Debug)]
struct Slot {
    bucket: usize,
    offset: usize,
    runs: usize,
    run: usize,
}

/// A bucket's buffer.
#[derive(Debug)]
enum Buffer {
    /// Abstract mode: shapes only.
    Abstract,
    /// The members' accumulated blocks, in the collective's layout.
    Ready {
        data: Vec<f32>,
        /// Segments (the group's size for a reduce-scatter, else 1).
        segments: usize,
    },
    /// Handed to its collective ([`Ctx::start_buffered_bucket`]; in abstract mode, recorded).
    InFlight,
}

/// Values of a [`BucketPlan`] held in flat bucket buffers (see the module docs): what a
/// gradient accumulator is made of.
#[derive(Debug)]
pub struct BucketBuffers {
    types: Vec<ArrayType>,
    slots: Vec<Option<Slot>>,
    buffers: Vec<Buffer>,
    /// The values in no bucket.
    loose: Vec<Option<Array>>,
}

impl BucketBuffers {
    /// The number of values.
    pub fn len(&self) -> usize {
        self.types.len()
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }

    /// Value `i`'s type (the plan's source type).
    pub fn ty(&self, i: usize) -> &ArrayType {
        &self.types[i]
    }

    /// Every value set to zero in place, the buffers kept (a gradient set reused for the next
    /// micro-batch costs a fill, not an allocation and its page faults).
    ///
    /// # Errors
    /// [`SpmdError::BucketInFlight`] when a bucket has been handed to its collective.
    pub fn fill_zero(&mut self) -> Result<(), SpmdError> {
        for (bucket, buffer) in self.buffers.iter_mut().enumerate() {
            match buffer {
                Buffer::Abstract => {}
                Buffer::Ready { data, .. } => data.fill(0.0),
                Buffer::InFlight => {
                    return Err(SpmdError::BucketInFlight {
                        op: "fill_zero",
                        bucket,
                    })
                }
            }
        }
        for value in self.loose.iter_mut().flatten() {
            if !value.is_abstract() {
                value.local_mut()?.data_mut().fill(0.0);
            }
        }
        Ok(())
    }

    /// Value `i`'s elements in place — its local block, row-major, as consecutive parts of
    /// equal length, one per segment of its buffer (one for a value in no bucket) — when its
    /// chunk in each segment is one run (every value of an all-reduce bucket; a value of a
    /// reduce-scatter bucket cut along its leading dimension, or one after only dims of size 1)
    /// and `ty`
    /// is its type: for a kernel to add into (see `Ctx::value_and_grad_into`). `None` for a
    /// value cut into several runs per segment, in a bucket being reduced, abstract, or of
    /// another type.
    pub fn value_mut(&mut self, i: usize, ty: &ArrayType) -> Option<Vec<&mut [f32]>> {
        if self.types.get(i)? != ty {
            return None;
        }
        let Some(slot) = self.slots[i] else {
            let acc = self.loose[i].as_mut()?;
            if acc.is_abstract() {
                return None;
            }
            return acc.local_mut().ok().map(|t| vec![t.data_mut()]);
        };
        match &mut self.buffers[slot.bucket] {
            Buffer::Ready { data, segments } if slot.runs == 1 => {
                // Chunk `k` of the value is its run in segment `k`.
                let segment = (data.len() / *segments).max(1);
                data.chunks_mut(segment)
                    .map(|s| s.get_mut(slot.offset..slot.offset + slot.run))
                    .collect()
            }
            _ => None,
        }
    }

    /// Every value as an [`Array`] (copies of the buffers' blocks; the buffers stay).
    ///
    /// # Errors
    /// [`SpmdError::BucketInFlight`] when a bucket has been handed to its collective.
    pub fn to_arrays(&self) -> Result<Vec<Array>, SpmdError> {
        (0..self.len()).map(|i| self.value(i)).collect()
    }

    /// Value `i` as an [`Array`] (a copy).
    fn value(&self, i: usize) -> Result<Array, SpmdError> {
        let ty = self.types[i].clone();
        let Some(slot) = self.slots[i] else {
            return self.loose[i]
                .clone()
                .ok_or_else(|| internal("a loose value is missing"));
        };
        match &self.buffers[slot.bucket] {
            Buffer::Abstract => Ok(Array::new(ty, None)),
            Buffer::InFlight => Err(SpmdError::BucketInFlight {
                op: "BucketBuffers::to_arrays",
                bucket: slot.bucket,
            }),
            Buffer::Ready { data, segments } => {
                let mut local = vec![0.0f32; slot.runs * slot.run * segments];
                for_each_run(slot, *segments, data.len() / segments, |value, flat| {
                    local[value.clone()].copy_from_slice(&data[flat]);
                });
                let local = Tensor::new(ty.shard_shape(), local)?;
                Ok(Array::new(ty, Some(local)))
            }
        }
    }
}

/// Calls `f(value range, buffer range)` for every run of `slot` in a buffer of `segments`
/// segments of `segment` elements.
fn for_each_run(
    slot: Slot,
    segments: usize,
    segment: usize,
    mut f: impl FnMut(std::ops::Range<usize>, std::ops::Range<usize>),
) {
    for k in 0..segments {
        for o in 0..slot.runs {
            let value = (o * segments + k) * slot.run;
            let flat = k * segment + slot.offset + o * slot.run;
            f(value..value + slot.run, flat..flat + slot.run);
        }
    }
}

/// A broken invariant of the buffers' own bookkeeping (a bug, not bad input).
fn internal(invariant: &'static str) -> SpmdError {
    SpmdError::Internal {
        op: "BucketBuffers",
        invariant,
    }
}

impl Ctx<'_> {
    /// Zero-filled buffers for the values of `plan` (typed as its sources).
    ///
    /// # Errors
    /// A bucket whose group the mesh does not have; a scattered dimension its group does not
    /// divide.
    pub fn bucket_buffers(&self, plan: &BucketPlan) -> Result<BucketBuffers, SpmdError> {
        let mut slots = vec![None; plan.sources.len()];
        let mut buffers = Vec::with_capacity(plan.buckets.len());
        for (b, (fused, members)) in plan.buckets.iter().enumerate() {
            let segments = match fused {
                Fused::ReduceScatter(axes, _) => self.rank_over(axes)?.1,
                Fused::AllReduce(_) | Fused::AllGather(..) => 1,
            };
            let mut offset = 0;
            for &i in members {
                let shape = plan.sources[i].shard_shape();
                let size: usize = shape.iter().product();
                let (runs, run) = match fused {
                    Fused::ReduceScatter(..) => {
                        // Each value is cut along its own dimension.
                        let dim = plan.dims[i];
                        if !shape[dim].is_multiple_of(segments) {
                            return Err(internal(
                                "a scattered dimension its group does not divide",
                            ));
                        }
                        let inner: usize = shape[dim + 1..].iter().product();
                        (shape[..dim].iter().product(), shape[dim] / segments * inner)
                    }
                    Fused::AllReduce(_) | Fused::AllGather(..) => (1, size),
                };
                slots[i] = Some(Slot {
                    bucket: b,
                    offset,
                    runs,
                    run,
                });
                offset += size / segments;
            }
            buffers.push(if self.mode() == Mode::Abstract {
                Buffer::Abstract
            } else {
                Buffer::Ready {
                    data: written_zeros(offset * segments),
                    segments,
                }
            });
        }
        let loose = slots
            .iter()
            .zip(&plan.sources)
            .map(|(slot, ty)| slot.is_none().then(|| self.zeros(ty.clone())))
            .collect();
        Ok(BucketBuffers {
            types: plan.sources.clone(),
            slots,
            buffers,
            loose,
        })
    }

    /// Buffers for `plan` holding `xs` (e.g. a restored accumulator).
    ///
    /// # Errors
    /// As [`Ctx::bucket_buffers`] and [`Ctx::accumulate_into`].
    pub fn bucket_buffers_of(
        &mut self,
        plan: &BucketPlan,
        xs: &[Array],
    ) -> Result<BucketBuffers, SpmdError> {
        if xs.len() != plan.sources.len() {
            return Err(SpmdError::CountMismatch {
                op: "bucket_buffers_of",
                got: xs.len(),
                what: "values",
                expected: plan.sources.len(),
                per: "planned values",
            });
        }
        let mut buffers = self.bucket_buffers(plan)?;
        for (i, x) in xs.iter().enumerate() {
            self.accumulate_into(&mut buffers, i, x)?;
        }
        Ok(buffers)
    }

    /// `into` += `from`, every value, in place: two buffer sets of one plan (the same types and
    /// layout) added element by element — each element `a + b` once, so the bits of adding the
    /// values one by one.
    ///
    /// # Errors
    /// [`SpmdError::PlanMismatch`] for buffers of different plans or a bucket handed to its
    /// collective.
    pub fn add_buffers(
        &mut self,
        into: &mut BucketBuffers,
        from: &BucketBuffers,
    ) -> Result<(), SpmdError> {
        let mismatch = || SpmdError::PlanMismatch { op: "add_buffers" };
        if into.types != from.types || into.buffers.len() != from.buffers.len() {
            return Err(mismatch());
        }
        for (a, b) in into.buffers.iter_mut().zip(&from.buffers) {
            match (a, b) {
                (Buffer::Abstract, Buffer::Abstract) => {}
                (Buffer::Ready { data: a, .. }, Buffer::Ready { data: b, .. })
                    if a.len() == b.len() =>
                {
                    add_assign_slice(a, b);
                }
                _ => return Err(mismatch()),
            }
        }
        for (acc, x) in into.loose.iter_mut().zip(&from.loose) {
            match (acc, x) {
                (Some(acc), Some(x)) => self.accumulate(acc, x)?,
                (None, None) => {}
                _ => return Err(mismatch()),
            }
        }
        Ok(())
    }

    /// Value `i` of `buffers` += `x`, in place: [`Ctx::accumulate`] into the value's place in
    /// its bucket's buffer.
    ///
    /// # Errors
    /// [`SpmdError::AccumulateMismatch`] when `x` is not typed as the value or is on a tape,
    /// [`SpmdError::BucketInFlight`] when its bucket has been handed to its collective.
    pub fn accumulate_into(
        &mut self,
        buffers: &mut BucketBuffers,
        i: usize,
        x: &Array,
    ) -> Result<(), SpmdError> {
        let ty = buffers.types.get(i).ok_or(SpmdError::NoSuchValue {
            op: "accumulate_into",
            index: i,
            values: buffers.types.len(),
        })?;
        let Some(slot) = buffers.slots[i] else {
            let acc = buffers.loose[i]
                .as_mut()
                .ok_or_else(|| internal("a loose value is missing"))?;
            return self.accumulate(acc, x);
        };
        if x.ty() != ty || x.var.is_some() {
            return Err(SpmdError::AccumulateMismatch {
                op: "accumulate",
                acc: ty.to_string(),
                x: x.ty().to_string(),
            });
        }
        match &mut buffers.buffers[slot.bucket] {
            Buffer::Abstract => Ok(()),
            Buffer::InFlight => Err(SpmdError::BucketInFlight {
                op: "accumulate",
                bucket: slot.bucket,
            }),
            Buffer::Ready { data, segments } => {
                let Some(src) = x.local_opt() else {
                    return Ok(());
                };
                let segment = data.len() / *segments;
                let src = src.data();
                if slot.runs == 1 && *segments == 1 {
                    add_assign_slice(&mut data[slot.offset..slot.offset + slot.run], src);
                } else {
                    for_each_run(slot, *segments, segment, |value, flat| {
                        add_assign_slice(&mut data[flat], &src[value]);
                    });
                }
                Ok(())
            }
        }
    }

    /// Starts bucket `b` of `plan` on the device's background stream (see
    /// `ferrotext_comm::stream`) on its buffer itself (no packing) and returns at once; the buffer
    /// belongs to the collective until [`Ctx::reshard_buffers`] finishes it. Buckets started this
    /// way run in start order, on every device the same.
    ///
    /// # Errors
    /// No bucket `b`; a bucket already started; a collective that cannot start.
    ///
    /// # Collectives
    /// The bucket's one collective, on the background channel.
    pub fn start_buffered_bucket(
        &mut self,
        plan: &BucketPlan,
        b: usize,
        buffers: &mut BucketBuffers,
    ) -> Result<StartedBucket, SpmdError> {
        self.issue_buffered_bucket(plan, b, buffers, true)
    }

    fn issue_buffered_bucket(
        &mut self,
        plan: &BucketPlan,
        b: usize,
        buffers: &mut BucketBuffers,
        background: bool,
    ) -> Result<StartedBucket, SpmdError> {
        let (fused, members) = plan.buckets.get(b).ok_or(SpmdError::NoSuchBucket {
            op: "start_buffered_bucket",
            bucket: b,
            buckets: plan.buckets.len(),
        })?;
        let buffer = buffers.buffers.get_mut(b).ok_or(SpmdError::PlanMismatch {
            op: "start_buffered_bucket",
        })?;
        let packed = match std::mem::replace(buffer, Buffer::InFlight) {
            Buffer::Abstract => None,
            Buffer::Ready { data, .. } => Some(data),
            Buffer::InFlight => {
                return Err(SpmdError::BucketStartedTwice {
                    op: "start_buffered_bucket",
                    bucket: b,
                })
            }
        };
        let shapes = members
            .iter()
            .map(|&i| plan.sources[i].shard_shape())
            .collect();
        self.issue_bucket(fused, members, plan, shapes, packed, background)
    }

    /// Every value of `buffers` moved as `plan` says (bitwise [`Ctx::reshard_planned`] of the
    /// same values): loose values alone, the `started` buckets finished, every other bucket's
    /// collective run on its buffer.
    ///
    /// # Errors
    /// Buffers of another plan; a failed collective.
    ///
    /// # Collectives
    /// As [`Ctx::reshard_planned`], less the buckets already started.
    pub fn reshard_buffers(
        &mut self,
        plan: &BucketPlan,
        mut buffers: BucketBuffers,
        started: Vec<StartedBucket>,
    ) -> Result<Vec<Array>, SpmdError> {
        if buffers.types != plan.sources || buffers.buffers.len() != plan.buckets.len() {
            return Err(SpmdError::PlanMismatch {
                op: "reshard_buffers",
            });
        }
        let mut out: Vec<Option<Array>> = vec![None; buffers.len()];
        for &i in &plan.unchanged {
            let x = buffers.loose[i]
                .take()
                .ok_or_else(|| internal("a loose value is missing"))?;
            out[i] = Some(x.with_type(plan.out_types[i].clone()));
        }
        for &i in &plan.alone {
            let x = buffers.loose[i]
                .take()
                .ok_or_else(|| internal("a loose value is missing"))?;
            out[i] = Some(self.reshard_untracked(&x, &plan.targets[i])?);
        }
        for bucket in started {
            let members = bucket.members().to_vec();
            for (i, a) in members.into_iter().zip(self.finish_bucket(bucket)?) {
                out[i] = Some(a);
            }
        }
        for b in 0..plan.buckets.len() {
            if matches!(buffers.buffers[b], Buffer::InFlight) {
                continue;
            }
            let bucket = self.issue_buffered_bucket(plan, b, &mut buffers, false)?;
            let members = bucket.members().to_vec();
            for (i, a) in members.into_iter().zip(self.finish_bucket(bucket)?) {
                out[i] = Some(a);
            }
        }
        out.into_iter()
            .map(|a| a.ok_or_else(|| internal("a value was not moved (a started bucket missing)")))
            .collect()
    }
}
