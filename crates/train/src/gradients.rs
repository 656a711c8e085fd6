//! Gradients between the backward pass and the optimizer, in two types so that partial sums can
//! never reach the optimizer (or a reader) unreduced:
//!
//! * [`PartialGradients`] — the accumulator: summed over micro-batches, possibly still
//!   per-device partial sums (`{U:data}` when deferral is open). Its only way out is
//!   [`PartialGradients::reduce`], the step's reduction.
//! * [`Gradients`] — reduced, in each parameter's target layout: what
//!   [`crate::Optimizer::apply`] takes.
//!
//! This module sits below both the engine and the optimizer, so neither imports the other.

use std::sync::Arc;

use ferrotext_spmd::{Array, BucketBuffers, BucketPlan, Ctx, Mode, StartedBucket};
use ferrotext_tensor::sum_of_squares;

use crate::error::TrainError;

/// Gradients summed over micro-batches, possibly still per-device partial sums (`{U:data}`).
///
/// Opaque on purpose: it has no accessor, and the optimizer takes only [`Gradients`], so the one
/// way to use it is [`PartialGradients::reduce`] — the step's reduction.
///
/// The legitimate path compiles — reduce, then apply:
///
/// ```no_run
/// # fn ok(
/// #     cx: &mut ferrotext_spmd::Ctx<'_>,
/// #     opt: &mut ferrotext_train::Optimizer,
/// #     params: &mut [ferrotext_spmd::Array],
/// #     partial: ferrotext_train::PartialGradients,
/// # ) -> Result<(), ferrotext_train::TrainError> {
/// let reduced = partial.reduce(cx)?;
/// opt.apply(0.1, 1.0, params, &reduced, &[])?;
/// # Ok(())
/// # }
/// ```
///
/// ```compile_fail
/// # fn misuse(partial: ferrotext_train::PartialGradients) {
/// // Partial sums cannot be read...
/// let first = &partial.grads[0];
/// # }
/// ```
///
/// ```compile_fail
/// # fn misuse(opt: &mut ferrotext_train::Optimizer, params: &mut [ferrotext_spmd::Array],
/// #           partial: &ferrotext_train::PartialGradients) {
/// // ...nor handed to the optimizer without the reduction.
/// opt.apply(0.1, 1.0, params, partial, &[]).unwrap();
/// # }
/// ```
pub struct PartialGradients {
    /// The accumulated values, in their buckets' flat buffers (the reduction's input as it
    /// stands: a bucket starts without packing).
    pub(crate) grads: BucketBuffers,
    /// How the reduction runs: gradients in buckets, filled from the last parameter back (the
    /// order a backward pass finishes them).
    pub(crate) plan: Arc<BucketPlan>,
    /// Buckets whose reduction already started (overlap), in start order.
    pub(crate) started: Vec<StartedBucket>,
}

impl PartialGradients {
    /// Zeros of the plan's source types (the accumulator's), to be reduced by `plan`.
    ///
    /// # Errors
    /// A plan whose buckets the device's mesh cannot hold.
    pub(crate) fn zeros(cx: &Ctx<'_>, plan: Arc<BucketPlan>) -> Result<Self, TrainError> {
        Ok(PartialGradients {
            grads: cx.bucket_buffers(&plan)?,
            plan,
            started: Vec::new(),
        })
    }

    /// Accumulated values (a restored checkpoint's), to be reduced by `plan`.
    ///
    /// # Errors
    /// Values not typed as the plan's sources.
    pub(crate) fn from_arrays(
        cx: &mut Ctx<'_>,
        grads: &[Array],
        plan: Arc<BucketPlan>,
    ) -> Result<Self, TrainError> {
        Ok(PartialGradients {
            grads: cx.bucket_buffers_of(&plan, grads)?,
            plan,
            started: Vec::new(),
        })
    }

    /// The reduction: every gradient resharded to its target layout — the parameter's own (an
    /// all-reduce of each unreduced gradient) or, under ZeRO-1, its `data` shard (a
    /// reduce-scatter) — in buckets of the configured size (`grad_bucket_mb`), each collective
    /// run on its bucket's buffer in place; buckets the backward already started are waited
    /// for; nothing moves for gradients already reduced but a local slice. Bitwise equal to one
    /// reshard per gradient.
    ///
    /// # Errors
    /// A collective failure.
    ///
    /// # Collectives
    /// One all-reduce (ZeRO-1: reduce-scatter) over `data` per bucket of `{U:data}` gradients,
    /// in parameter order; none when they are already reduced.
    pub fn reduce(self, cx: &mut Ctx<'_>) -> Result<Gradients, TrainError> {
        let PartialGradients {
            grads,
            plan,
            started,
        } = self;
        Ok(Gradients {
            grads: cx.reshard_buffers(&plan, grads, started)?,
        })
    }
}

/// A step's gradients and loss as a pairwise tree over its micro-batches, for
/// `layout_invariant=true`: each micro-batch's gradients start from zero (a *unit*) and its loss
/// is this device's partial sum; two subtrees of equal size are added as soon as both are
/// complete — a binary counter, which sums the units in `ferrotext_comm::tree_sum`'s order.
/// With a power-of-two GA a device's micro-batches end as one subtree, and the update's
/// all-reduce (the same tree over the devices) completes the step's sum: the bits of one tree
/// over every unit, whatever the layout.
///
/// A unit whose left sibling is a single unit on this device (an odd unit of the step) is
/// added by the backward straight into that sibling's buffers, with no zero fill and no merge
/// pass, and the bits are the merge's: the backward adds each element of a unit's gradient
/// exactly once (a parameter's whole gradient is either added by its product's kernel or
/// handed over summed, see `Ctx::value_and_grad_into`), so a fresh unit holds `+0 + g`, which
/// is never `-0`; and for any `a` that is not `-0`, `a + g` equals `a + (+0 + g)` (the two
/// differ only when `g = -0`, where both give `a`, or `+0` for `a = +0`).
///
/// Memory: at most `log2(GA) + 1` gradient sets live at once (the nodes), plus the unit the
/// backward fills.
pub(crate) struct UnitTree {
    nodes: Vec<UnitNode>,
    /// Gradient sets freed by merges, reused for the next units.
    spare: Vec<PartialGradients>,
    /// The unit the backward is filling, between [`UnitTree::open_unit`] and
    /// [`UnitTree::close_unit`].
    open: Option<OpenUnit>,
}

/// Where the open unit's gradients go.
enum OpenUnit {
    /// Into the newest node, a single unit: the open unit is its right sibling.
    IntoLeftSibling,
    /// Into a gradient set of its own, from zero.
    Fresh(PartialGradients),
}

/// A complete subtree of `2^level` units.
pub(crate) struct UnitNode {
    /// The subtree holds `2^level` units.
    pub level: u32,
    /// Its gradients' sum, this device's (unreduced over `data`).
    pub grads: PartialGradients,
    /// Its loss partial sum, this device's.
    pub loss: Array,
}

impl UnitNode {
    /// `self` (the earlier units) + `right` (the later ones), in `self`'s buffers; `right`'s
    /// gradient set goes to `spare`.
    fn merge(
        mut self,
        cx: &mut Ctx<'_>,
        right: UnitNode,
        spare: &mut Vec<PartialGradients>,
    ) -> Result<UnitNode, TrainError> {
        cx.add_buffers(&mut self.grads.grads, &right.grads.grads)?;
        spare.push(right.grads);
        Ok(UnitNode {
            level: self.level.max(right.level) + 1,
            loss: cx.add(&self.loss, &right.loss)?,
            grads: self.grads,
        })
    }
}

impl UnitTree {
    /// No units yet; `spare` holds gradient sets of the same plan to reuse (the last step's).
    pub(crate) fn new(spare: Vec<PartialGradients>) -> UnitTree {
        UnitTree {
            nodes: Vec::new(),
            spare,
            open: None,
        }
    }

    /// A tree continued from `nodes` (a checkpoint's, oldest first; each level below the one
    /// before it, as the binary counter leaves them).
    ///
    /// # Errors
    /// Levels that no sequence of units leaves.
    pub(crate) fn from_nodes(nodes: Vec<UnitNode>) -> Result<UnitTree, TrainError> {
        if nodes.windows(2).any(|w| w[0].level <= w[1].level) {
            return Err(TrainError::Internal(
                "a unit tree's levels must fall from the oldest node to the newest".into(),
            ));
        }
        Ok(UnitTree {
            nodes,
            spare: Vec::new(),
            open: None,
        })
    }

    /// The complete subtrees so far, oldest first (what a checkpoint inside a step keeps).
    ///
    /// # Errors
    /// A unit still open (a checkpoint is only taken between micro-batches).
    pub(crate) fn nodes(&self) -> Result<&[UnitNode], TrainError> {
        if self.open.is_some() {
            return Err(TrainError::Internal(
                "a unit tree read while a unit is open".into(),
            ));
        }
        Ok(&self.nodes)
    }

    /// Opens the next unit and returns the gradient set the backward adds it into: its left
    /// sibling's when that is a single unit (see the type's docs), else zeros of `plan` (a set
    /// a merge freed, refilled, or a new one).
    ///
    /// # Errors
    /// A unit already open; a plan whose buckets the device's mesh cannot hold.
    pub(crate) fn open_unit(
        &mut self,
        cx: &Ctx<'_>,
        plan: &Arc<BucketPlan>,
    ) -> Result<&mut PartialGradients, TrainError> {
        if self.open.is_some() {
            return Err(TrainError::Internal("a unit opened twice".into()));
        }
        let open = match self.nodes.last() {
            Some(top) if top.level == 0 => OpenUnit::IntoLeftSibling,
            _ => OpenUnit::Fresh(match self.spare.pop() {
                Some(mut unit) => {
                    unit.grads.fill_zero()?;
                    unit
                }
                None => PartialGradients::zeros(cx, plan.clone())?,
            }),
        };
        let open = self.open.insert(open);
        match open {
            OpenUnit::Fresh(grads) => Ok(grads),
            OpenUnit::IntoLeftSibling => self
                .nodes
                .last_mut()
                .map(|top| &mut top.grads)
                .ok_or_else(|| TrainError::Internal("a unit tree lost a node".into())),
        }
    }

    /// Closes the open unit, whose loss partial sum is `loss`, and adds complete subtrees of
    /// equal size.
    ///
    /// # Errors
    /// No unit open; an op failure adding subtrees.
    pub(crate) fn close_unit(&mut self, cx: &mut Ctx<'_>, loss: Array) -> Result<(), TrainError> {
        let lost = || TrainError::Internal("a unit tree lost a node".into());
        let mut node = match self.open.take() {
            None => return Err(TrainError::Internal("no unit is open".into())),
            Some(OpenUnit::Fresh(grads)) => UnitNode {
                level: 0,
                grads,
                loss,
            },
            // The gradients are summed already; the loss follows the merge.
            Some(OpenUnit::IntoLeftSibling) => {
                let left = self.nodes.pop().ok_or_else(lost)?;
                UnitNode {
                    level: 1,
                    loss: cx.add(&left.loss, &loss)?,
                    grads: left.grads,
                }
            }
        };
        while self.nodes.last().is_some_and(|top| top.level == node.level) {
            let left = self.nodes.pop().ok_or_else(lost)?;
            node = left.merge(cx, node, &mut self.spare)?;
        }
        self.nodes.push(node);
        Ok(())
    }

    /// The sum of every unit (the complete subtrees added from the newest, smallest one
    /// back, as the tree over a count that is not a power of two adds them), the loss's, and
    /// the gradient sets left to reuse; `None` before the first unit.
    ///
    /// # Errors
    /// A unit still open; an op failure adding subtrees.
    pub(crate) fn finish(mut self, cx: &mut Ctx<'_>) -> Result<Option<FinishedTree>, TrainError> {
        self.nodes()?;
        let Some(mut right) = self.nodes.pop() else {
            return Ok(None);
        };
        while let Some(left) = self.nodes.pop() {
            right = left.merge(cx, right, &mut self.spare)?;
        }
        Ok(Some(FinishedTree {
            grads: right.grads,
            loss: right.loss,
            spare: self.spare,
        }))
    }
}

/// A step's summed tree: [`UnitTree::finish`]'s result.
pub(crate) struct FinishedTree {
    /// Every unit's gradients, summed on this device (still unreduced over `data`).
    pub grads: PartialGradients,
    /// This device's loss partial sum over its units.
    pub loss: Array,
    /// Gradient sets to reuse for the next step's units.
    pub spare: Vec<PartialGradients>,
}

/// Reduced gradients in the parameters' layout: what the optimizer takes.
pub struct Gradients {
    grads: Vec<Array>,
}

impl Gradients {
    /// The gradients, in parameter order.
    pub fn arrays(&self) -> &[Array] {
        &self.grads
    }

    /// Each gradient resharded to its spec in `specs` — from replicated to a device's slice,
    /// which moves nothing (ZeRO-1's optimizer slices under `layout_invariant`).
    ///
    /// # Errors
    /// A spec the gradient cannot take.
    ///
    /// # Collectives
    /// None when every change is replicated → sharded.
    pub(crate) fn sliced(
        self,
        cx: &mut Ctx<'_>,
        specs: &[ferrotext_sharding::PartitionSpec],
    ) -> Result<Gradients, TrainError> {
        let grads = self
            .grads
            .into_iter()
            .zip(specs)
            .map(|(g, spec)| {
                if g.ty().sharding().spec() == spec {
                    Ok(g)
                } else {
                    cx.reshard(&g, spec).map_err(TrainError::from)
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(Gradients { grads })
    }

    /// Elements of this device's shards of every gradient (the profiler's byte counts).
    pub(crate) fn local_elements(&self) -> usize {
        self.arrays()
            .iter()
            .map(|g| g.ty().shard_shape().iter().product::<usize>())
            .sum()
    }

    /// Σ of the squares of every gradient, in f64 and the same whatever the layout (so ZeRO-1,
    /// FSDP and replicated runs clip by the same factor): each device sums its own shard of
    /// each gradient in f64; shards of the gradients split over the same mesh axes are combined
    /// in one exact exchange over those axes; replicated gradients need none.
    ///
    /// The exchange is an all-reduce of a zero buffer with one `(hi, lo)` f32 slot per member,
    /// each member writing its f64 partial into its own slot: every sum in it adds zeros to one
    /// value, so every member receives every partial exactly (to 48 bits) and adds them in rank
    /// order.
    ///
    /// # Errors
    /// A collective failure.
    ///
    /// # Collectives
    /// One all-reduce of `2 × group` elements per distinct set of axes the gradients are split
    /// over (none when nothing is split).
    pub fn squared_norm(&self, cx: &mut Ctx<'_>) -> Result<f64, TrainError> {
        // Part of the update: the profiler counts it with the optimizer.
        let _span = ferrotext_profile::span_in("grad_norm", ferrotext_profile::Phase::Optimizer)
            .map(|s| s.bytes((4 * self.local_elements()) as f64));
        let mut by_axes: std::collections::BTreeMap<Vec<String>, f64> = Default::default();
        for g in self.arrays() {
            let axes: Vec<String> = g
                .ty()
                .sharding()
                .spec()
                .partition_axes()
                .map(str::to_string)
                .collect();
            let local = if g.is_abstract() {
                0.0
            } else {
                sum_of_squares(g.local()?.data())
            };
            *by_axes.entry(axes).or_default() += local;
        }
        let mut total = 0.0;
        for (axes, partial) in by_axes {
            let group = cx.comm().group(&axes)?;
            if group.len() == 1 {
                total += partial;
                continue;
            }
            if cx.mode() == Mode::Abstract {
                cx.comm().record_abstract(
                    ferrotext_comm::CollectiveKind::AllReduce,
                    &axes,
                    2 * group.len(),
                    ferrotext_sharding::DType::F32,
                )?;
                continue;
            }
            let rank = group
                .iter()
                .position(|&d| d == cx.comm().device())
                .ok_or_else(|| TrainError::Internal("device outside its own group".into()))?;
            let mut slots = vec![0.0f32; 2 * group.len()];
            let hi = partial as f32;
            slots[2 * rank] = hi;
            slots[2 * rank + 1] = (partial - f64::from(hi)) as f32;
            cx.comm().all_reduce(&axes, &mut slots)?;
            total += slots
                .chunks_exact(2)
                .map(|p| f64::from(p[0]) + f64::from(p[1]))
                .sum::<f64>();
        }
        Ok(total)
    }
}
