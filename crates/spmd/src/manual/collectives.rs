//! The casts and collectives inside a region (docs/sharding-rules.md §6.4) and their transposes:
//! `pcast` (free casts between axis states), `psum`, `psum_scatter`, `all_gather`, `all_to_all`,
//! and the automatic casts an n-ary op inserts for missing varying axes (R6.10,
//! [`Ctx::match_varying`]).
//!
//! Each primitive is one [`ManualOp`](super::op::ManualOp): [`Ctx::manual_untracked`] types it and moves the data,
//! [`Ctx::manual_transpose`] maps it to its transpose primitive — `pvary` ↔ `psum`,
//! `reduced_vary_cast` ↔ `vary_unreduced_cast`, `psum_scatter` ↔ `all_gather`, `all_to_all` ↔
//! `all_to_all` with the dims swapped.

use ferrotext_sharding::{ArrayType, AxisSet};
use ferrotext_tensor::Tensor;

use super::op::{GatherTo, ManualOp};
use super::typing::{manual_type, set, state_of, type_error, with_state, AxisState};
use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::{SpmdError, TypeErrorKind as K};
use crate::tape::Backward;

impl Ctx<'_> {
    /// `pcast(x, axes, to)`: a free cast between states (docs/sharding-rules.md §6.4): invarying →
    /// varying (`pvary`), reduced → varying, varying → unreduced, invarying → reduced.
    ///
    /// # Errors
    /// Any other pair ("Unsupported pcast"); axes in mixed states.
    pub fn pcast(&mut self, x: &Array, axes: &[&str], to: AxisState) -> Result<Array, SpmdError> {
        let axes: Vec<String> = axes.iter().map(|a| a.to_string()).collect();
        let from = state_of("pcast", x.ty(), &axes)?;
        self.manual(ManualOp::Pcast { axes, from, to }, x)
    }

    /// `psum(x, axes)` of a varying or unreduced value: an all-reduce; the result is invarying.
    ///
    /// # Errors
    /// A reduced or invarying value on `axes`.
    pub fn psum(&mut self, x: &Array, axes: &[&str]) -> Result<Array, SpmdError> {
        let axes: Vec<String> = axes.iter().map(|a| a.to_string()).collect();
        let from = state_of("psum", x.ty(), &axes)?;
        self.manual(ManualOp::Psum { axes, from }, x)
    }

    /// `psum_scatter(x, axes)` along `dim`: unreduced or varying → varying, dim divided by the
    /// group size.
    ///
    /// # Errors
    /// A reduced or invarying value; an indivisible dim.
    pub fn psum_scatter(
        &mut self,
        x: &Array,
        axes: &[&str],
        dim: usize,
    ) -> Result<Array, SpmdError> {
        let axes: Vec<String> = axes.iter().map(|a| a.to_string()).collect();
        let from = state_of("psum_scatter", x.ty(), &axes)?;
        self.manual(ManualOp::PsumScatter { axes, dim, from }, x)
    }

    /// `all_gather(x, axes, to=...)` along `dim` of a varying value.
    ///
    /// # Errors
    /// A value not varying on `axes`.
    pub fn all_gather(
        &mut self,
        x: &Array,
        axes: &[&str],
        dim: usize,
        to: GatherTo,
    ) -> Result<Array, SpmdError> {
        let axes: Vec<String> = axes.iter().map(|a| a.to_string()).collect();
        self.manual(ManualOp::AllGather { axes, dim, to }, x)
    }

    /// `all_to_all(x, axes)`: chunk `j` of dim `split` goes to group member `j`; the chunks
    /// received concatenate along `concat`. Varying in, varying out.
    ///
    /// # Errors
    /// A value not varying on `axes`; `split` not divisible by the group size.
    pub fn all_to_all(
        &mut self,
        x: &Array,
        axes: &[&str],
        split: usize,
        concat: usize,
    ) -> Result<Array, SpmdError> {
        let axes: Vec<String> = axes.iter().map(|a| a.to_string()).collect();
        self.manual(
            ManualOp::AllToAll {
                axes,
                split,
                concat,
            },
            x,
        )
    }

    fn manual(&mut self, op: ManualOp, x: &Array) -> Result<Array, SpmdError> {
        let out = self.manual_untracked(&op, x)?;
        self.record(Backward::Manual { op }, &[x], out)
    }

    /// Type and data of a manual primitive.
    pub(crate) fn manual_untracked(
        &mut self,
        op: &ManualOp,
        x: &Array,
    ) -> Result<Array, SpmdError> {
        let t = x.ty();
        if !t.is_manual() {
            return Err(type_error(
                K::InvalidSpec,
                "manual collective",
                t,
                "only valid inside a shard_map body",
            ));
        }
        match op {
            ManualOp::Pcast { axes, from, to } => pcast_untracked(x, axes, *from, *to),
            ManualOp::Psum { axes, from: _ } => self.psum_untracked(x, axes),
            ManualOp::PsumScatter { axes, dim, from: _ } => {
                self.psum_scatter_untracked(x, axes, *dim)
            }
            ManualOp::AllGather { axes, dim, to } => self.all_gather_untracked(x, axes, *dim, *to),
            ManualOp::AllToAll {
                axes,
                split,
                concat,
            } => self.all_to_all_untracked(x, axes, *split, *concat),
            ManualOp::LocalSlice { axes, dim } => self.local_slice_untracked(x, axes, *dim),
        }
    }

    /// `psum`'s type and data: an all-reduce of a varying or unreduced value.
    fn psum_untracked(&mut self, x: &Array, axes: &[String]) -> Result<Array, SpmdError> {
        let t = x.ty();
        need("psum", t, axes, &[AxisState::Varying, AxisState::Unreduced])?;
        let mut local = x.local_cloned();
        self.all_reduce(axes, &mut local, t.element_count())?;
        Ok(Array::new(
            manual_type(
                t,
                t.shape().to_vec(),
                with_state(t, axes, AxisState::Invarying)?,
            )?,
            local,
        ))
    }

    /// `psum_scatter`'s type and data: a reduce-scatter along `dim`.
    fn psum_scatter_untracked(
        &mut self,
        x: &Array,
        axes: &[String],
        dim: usize,
    ) -> Result<Array, SpmdError> {
        let t = x.ty();
        let shape = t.shape().to_vec();
        need(
            "psum_scatter",
            t,
            axes,
            &[AxisState::Varying, AxisState::Unreduced],
        )?;
        dim_ok(t, dim)?;
        let g = self.rank_over(axes)?.1;
        if !shape[dim].is_multiple_of(g) {
            return Err(type_error(
                K::ShapeError,
                "psum_scatter",
                t,
                format!("dimension {dim} is not divisible by {g}"),
            ));
        }
        let local = self.reduce_scatter_dim(axes, x.local_cloned(), &shape, dim)?;
        let mut out_shape = shape.clone();
        out_shape[dim] /= g;
        Ok(Array::new(
            manual_type(t, out_shape, with_state(t, axes, AxisState::Varying)?)?,
            local,
        ))
    }

    /// `all_gather`'s type and data: an all-gather along `dim` of a varying value.
    fn all_gather_untracked(
        &mut self,
        x: &Array,
        axes: &[String],
        dim: usize,
        to: GatherTo,
    ) -> Result<Array, SpmdError> {
        let t = x.ty();
        let shape = t.shape().to_vec();
        need("all_gather", t, axes, &[AxisState::Varying])?;
        dim_ok(t, dim)?;
        let g = self.rank_over(axes)?.1;
        let local = self.all_gather_dim(axes, x.local_cloned(), &shape, dim)?;
        let mut out_shape = shape.clone();
        out_shape[dim] *= g;
        let state = match to {
            GatherTo::Varying => AxisState::Varying,
            GatherTo::Reduced => AxisState::Reduced,
            GatherTo::Invarying => AxisState::Invarying,
        };
        Ok(Array::new(
            manual_type(t, out_shape, with_state(t, axes, state)?)?,
            local,
        ))
    }

    /// `all_to_all`'s type and data: chunks of `split` exchanged, concatenated on `concat`.
    fn all_to_all_untracked(
        &mut self,
        x: &Array,
        axes: &[String],
        split: usize,
        concat: usize,
    ) -> Result<Array, SpmdError> {
        let t = x.ty();
        let shape = t.shape().to_vec();
        need("all_to_all", t, axes, &[AxisState::Varying])?;
        dim_ok(t, split)?;
        dim_ok(t, concat)?;
        let g = self.rank_over(axes)?.1;
        if !shape[split].is_multiple_of(g) {
            return Err(type_error(
                K::ShapeError,
                "all_to_all",
                t,
                format!("dimension {split} is not divisible by {g}"),
            ));
        }
        let mut out_shape = shape.clone();
        out_shape[split] /= g;
        out_shape[concat] *= g;
        let local = self.all_to_all_dims(axes, x.local_cloned(), &shape, split, concat)?;
        Ok(Array::new(
            manual_type(t, out_shape, t.manual_tags().clone())?,
            local,
        ))
    }

    /// The local slice's type and data: this device's block along `dim` of an invarying value.
    fn local_slice_untracked(
        &mut self,
        x: &Array,
        axes: &[String],
        dim: usize,
    ) -> Result<Array, SpmdError> {
        let t = x.ty();
        let shape = t.shape().to_vec();
        need("dynamic_slice", t, axes, &[AxisState::Invarying])?;
        dim_ok(t, dim)?;
        let (index, g) = self.rank_over(axes)?;
        let block = shape[dim] / g;
        let local = match x.local_opt().as_deref() {
            Some(l) => Some(l.slice_dim(dim, index * block..(index + 1) * block)?),
            None => None,
        };
        let mut out_shape = shape.clone();
        out_shape[dim] = block;
        Ok(Array::new(
            manual_type(t, out_shape, with_state(t, axes, AxisState::Varying)?)?,
            local,
        ))
    }

    /// The transpose of a manual primitive, applied to `ct` (docs/sharding-rules.md §6.4's table).
    pub(crate) fn manual_transpose(
        &mut self,
        op: &ManualOp,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        use AxisState::*;
        let t = match op {
            ManualOp::Pcast { axes, from, to } => match (from, to) {
                (Invarying, Varying) => ManualOp::Psum {
                    axes: axes.clone(),
                    from: Varying,
                },
                (Reduced, Varying) => ManualOp::Pcast {
                    axes: axes.clone(),
                    from: Varying,
                    to: Unreduced,
                },
                (Varying, Unreduced) => ManualOp::Pcast {
                    axes: axes.clone(),
                    from: Reduced,
                    to: Varying,
                },
                _ => ManualOp::Psum {
                    axes: axes.clone(),
                    from: Unreduced,
                },
            },
            ManualOp::Psum { axes, from } => match from {
                Unreduced => ManualOp::Pcast {
                    axes: axes.clone(),
                    from: Invarying,
                    to: Reduced,
                },
                _ => ManualOp::Pcast {
                    axes: axes.clone(),
                    from: Invarying,
                    to: Varying,
                },
            },
            ManualOp::PsumScatter { axes, dim, from } => ManualOp::AllGather {
                axes: axes.clone(),
                dim: *dim,
                to: if *from == Unreduced {
                    GatherTo::Reduced
                } else {
                    GatherTo::Varying
                },
            },
            ManualOp::AllGather { axes, dim, to } => match to {
                GatherTo::Varying => ManualOp::PsumScatter {
                    axes: axes.clone(),
                    dim: *dim,
                    from: Varying,
                },
                GatherTo::Reduced => ManualOp::PsumScatter {
                    axes: axes.clone(),
                    dim: *dim,
                    from: Unreduced,
                },
                GatherTo::Invarying => ManualOp::LocalSlice {
                    axes: axes.clone(),
                    dim: *dim,
                },
            },
            ManualOp::AllToAll {
                axes,
                split,
                concat,
            } => ManualOp::AllToAll {
                axes: axes.clone(),
                split: *concat,
                concat: *split,
            },
            ManualOp::LocalSlice { axes, dim } => ManualOp::AllGather {
                axes: axes.clone(),
                dim: *dim,
                to: GatherTo::Invarying,
            },
        };
        // The transpose of a local slice is zero-padding followed by a sum over the group, i.e.
        // an invarying all-gather of the blocks; every other transpose is the primitive above.
        self.manual_untracked(&t, ct)
    }

    /// R6.10: before an n-ary op inside a region, cast each operand missing some of the others'
    /// varying axes: `reduced_vary_cast` when it is reduced on exactly those axes, else `pvary`.
    ///
    /// # Errors
    /// An operand reduced on only some of the missing axes ("pvary cannot accept args which are
    /// reduced").
    pub(crate) fn match_varying(&mut self, xs: &[&Array]) -> Result<Vec<Array>, SpmdError> {
        let union: AxisSet = xs
            .iter()
            .flat_map(|x| x.ty().manual_tags().varying().iter().cloned())
            .collect();
        let mut out = Vec::with_capacity(xs.len());
        for x in xs {
            let m = x.ty().manual_tags();
            let missing: Vec<String> = union.difference(m.varying()).cloned().collect();
            if missing.is_empty() {
                out.push((*x).clone());
                continue;
            }
            let missing_set = set(&missing);
            let from = if *m.reduced() == missing_set {
                AxisState::Reduced
            } else if !m.reduced().is_disjoint(&missing_set)
                || !m.unreduced().is_disjoint(&missing_set)
            {
                return Err(type_error(
                    K::ReducedConflict,
                    "pvary",
                    x.ty(),
                    format!("pvary cannot accept args which are reduced or unreduced on axes {missing:?}"),
                ));
            } else {
                AxisState::Invarying
            };
            out.push(self.manual(
                ManualOp::Pcast {
                    axes: missing,
                    from,
                    to: AxisState::Varying,
                },
                x,
            )?);
        }
        Ok(out)
    }

    /// All-to-all of local blocks along `split` → `concat` (mode-aware, like the other helpers).
    fn all_to_all_dims(
        &mut self,
        axes: &[String],
        local: Option<Tensor>,
        local_shape: &[usize],
        split: usize,
        concat: usize,
    ) -> Result<Option<Tensor>, SpmdError> {
        let (_, n) = self.rank_over(axes)?;
        let elements: usize = local_shape.iter().product();
        let Some(t) = local else {
            self.comm().record_abstract(
                ferrotext_comm::CollectiveKind::AllToAll,
                axes,
                elements,
                ferrotext_sharding::DType::F32,
            )?;
            return Ok(None);
        };
        let (part_shape, send) = crate::ctx::chunk_major(&t, split, n)?;
        let mut recv = vec![0.0; elements];
        self.comm().all_to_all(axes, &send, &mut recv)?;
        Ok(Some(crate::ctx::from_chunk_major(
            recv,
            &part_shape,
            concat,
            n,
        )?))
    }
}

/// `pcast`'s type (its data is `x`'s): a free cast of `axes` from `from` to `to`.
fn pcast_untracked(
    x: &Array,
    axes: &[String],
    from: AxisState,
    to: AxisState,
) -> Result<Array, SpmdError> {
    let t = x.ty();
    need("pcast", t, axes, &[from])?;
    use AxisState::*;
    let supported = matches!(
        (from, to),
        (Invarying, Varying) | (Reduced, Varying) | (Varying, Unreduced) | (Invarying, Reduced)
    );
    if !supported {
        return Err(type_error(
            K::InvalidSpec,
            "pcast",
            t,
            format!("Unsupported pcast from={}, to='{}'", from.name(), to.name()),
        ));
    }
    Ok(Array::new(
        manual_type(t, t.shape().to_vec(), with_state(t, axes, to)?)?,
        x.local_cloned(),
    ))
}

/// `t`'s state on `axes`, which primitive `name` accepts only in one of `states`.
fn need(
    name: &str,
    t: &ArrayType,
    axes: &[String],
    states: &[AxisState],
) -> Result<AxisState, SpmdError> {
    let s = state_of(name, t, axes)?;
    if !states.contains(&s) {
        return Err(type_error(
            K::InvalidSpec,
            name,
            t,
            format!(
                "{name} cannot accept args which are {} on axes {axes:?}",
                s.name()
            ),
        ));
    }
    Ok(s)
}

/// `dim` is a dimension of `t`.
fn dim_ok(t: &ArrayType, dim: usize) -> Result<(), SpmdError> {
    if dim >= t.shape().len() {
        return Err(type_error(
            K::ShapeError,
            "collective",
            t,
            format!("no dimension {dim}"),
        ));
    }
    Ok(())
}
