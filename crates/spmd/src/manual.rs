//! `shard_map`: a manual region over every mesh axis, with JAX's varying / invarying / unreduced
//! / reduced typing inside (spec §6), its casts and collectives, and their transposes.
//!
//! Inside the region each value is this device's block, typed by [`ManualTags`]: per axis it is
//! *varying* (devices differ), *invarying* (identical), *unreduced* (partial sums) or *reduced*
//! (identical, gradient unreduced). The boundary maps an outside type to an inside one: axes in
//! the in_spec partitions become varying, the in_spec tags stay tags (R6.5); on the way out the
//! body's tags must equal the out_spec's and its varying axes must be those the out_spec shards
//! on (R6.6). The boundary moves no data and adds no collective (R6.14).
//!
//! Ops inside need equal varying sets (R6.9); a missing varying axis is cast in automatically
//! (R6.10): `reduced_vary_cast` when the operand is reduced on exactly those axes (transpose:
//! `vary_unreduced_cast`, free), else `pvary` (transpose: **psum**). That is the whole story of
//! MoE expert weights: tagged `{R:data}` they reach the `data`-varying tokens through a free
//! cast and their gradients leave the region `{U:data}`; untagged, a `pvary` puts an all-reduce
//! over `data` into every backward pass.

use std::sync::Arc;

use ferrotext_sharding::{ArrayType, AxisSet, AxisType, ManualTags, Mesh, PartitionSpec};
use ferrotext_tensor::{dot_general, DotDims, Tensor};

use crate::array::Array;
use crate::autodiff::Backward;
use crate::ctx::Ctx;
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::rules::BinaryOp;

/// The state of a value along some manual axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisState {
    /// Devices hold different values.
    Varying,
    /// Devices hold the same value.
    Invarying,
    /// Devices hold partial sums.
    Unreduced,
    /// Devices hold the same value; its gradient is unreduced.
    Reduced,
}

impl AxisState {
    fn name(self) -> &'static str {
        match self {
            AxisState::Varying => "varying",
            AxisState::Invarying => "invarying",
            AxisState::Unreduced => "unreduced",
            AxisState::Reduced => "reduced",
        }
    }
}

/// What an `all_gather` inside a region produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GatherTo {
    /// Gathered and still varying (transpose: `psum_scatter`).
    Varying,
    /// Gathered and reduced (transpose: `psum_scatter` of an unreduced cotangent).
    Reduced,
    /// Gathered and invarying (transpose: a local slice).
    Invarying,
}

/// A manual-region primitive, with what its transpose needs.
#[derive(Clone, Debug)]
pub(crate) enum ManualOp {
    /// `psum` over axes the value is varying on (`psum_invariant`) or unreduced on
    /// (`unreduced_psum`): an all-reduce; the result is invarying.
    Psum { axes: Vec<String>, from: AxisState },
    /// Reduce-scatter along `dim`: unreduced → varying, or varying → varying.
    PsumScatter {
        axes: Vec<String>,
        dim: usize,
        from: AxisState,
    },
    /// All-gather along `dim` from varying.
    AllGather {
        axes: Vec<String>,
        dim: usize,
        to: GatherTo,
    },
    /// All-to-all: chunk `j` of `split` goes to member `j`, received chunks concatenate on
    /// `concat`. Varying → varying.
    AllToAll {
        axes: Vec<String>,
        split: usize,
        concat: usize,
    },
    /// A free cast (`pvary`, `reduced_vary_cast`, `vary_unreduced_cast`, `preduced`).
    Pcast {
        axes: Vec<String>,
        from: AxisState,
        to: AxisState,
    },
    /// This device's block along `dim`: invarying → varying (transpose of an invarying gather).
    LocalSlice { axes: Vec<String>, dim: usize },
}

fn set(axes: &[String]) -> AxisSet {
    axes.iter().cloned().collect()
}

fn type_error(kind: K, op: &str, x: &ArrayType, message: impl Into<String>) -> SpmdError {
    ShardingTypeError::new(kind, op, &[x], message).into()
}

/// The state of `t` along `axes` (all must agree).
fn state_of(op: &str, t: &ArrayType, axes: &[String]) -> Result<AxisState, SpmdError> {
    let m = t.manual_tags();
    let state = |a: &String| {
        if m.varying().contains(a) {
            AxisState::Varying
        } else if m.unreduced().contains(a) {
            AxisState::Unreduced
        } else if m.reduced().contains(a) {
            AxisState::Reduced
        } else {
            AxisState::Invarying
        }
    };
    let first = axes.first().map(state).unwrap_or(AxisState::Invarying);
    if axes.iter().any(|a| state(a) != first) {
        return Err(type_error(
            K::InvalidSpec,
            op,
            t,
            format!(
                "`{op}` can only accept axis names which all correspond to one of varying, \
                 unreduced, reduced or invarying state of the input; got axes {axes:?}"
            ),
        ));
    }
    Ok(first)
}

/// `t`'s tags with `axes` moved to `state`.
fn with_state(t: &ArrayType, axes: &[String], state: AxisState) -> Result<ManualTags, SpmdError> {
    let m = t.manual_tags();
    let axes = set(axes);
    let strip = |s: &AxisSet| -> AxisSet { s.difference(&axes).cloned().collect() };
    let (mut v, mut u, mut r) = (strip(m.varying()), strip(m.unreduced()), strip(m.reduced()));
    match state {
        AxisState::Varying => v.extend(axes),
        AxisState::Unreduced => u.extend(axes),
        AxisState::Reduced => r.extend(axes),
        AxisState::Invarying => {}
    }
    Ok(ManualTags::new(v, u, r)?)
}

fn manual_type(
    template: &ArrayType,
    shape: Vec<usize>,
    tags: ManualTags,
) -> Result<ArrayType, SpmdError> {
    Ok(ArrayType::manual(
        template.dtype(),
        shape,
        template.sharding().mesh().clone(),
        tags,
    )?)
}

/// The mesh with every axis `Manual`.
fn manual_mesh(mesh: &Mesh) -> Result<Arc<Mesh>, SpmdError> {
    Ok(Arc::new(mesh.with_all_axis_types(AxisType::Manual)))
}

// ---------------------------------------------------------------------------------------------
// Type rules inside a region

pub(crate) fn manual_unary_type(
    op: &str,
    linear: bool,
    x: &ArrayType,
) -> Result<ArrayType, SpmdError> {
    if !linear && !x.manual_tags().unreduced().is_empty() {
        return Err(type_error(
            K::UnreducedOperand,
            op,
            x,
            format!("unreduced rule for {op} is not implemented (only linear ops take unreduced values, R6.12)"),
        ));
    }
    Ok(x.clone())
}

pub(crate) fn manual_binary_type(
    op: BinaryOp,
    a: &ArrayType,
    b: &ArrayType,
) -> Result<ArrayType, SpmdError> {
    let name = op.name();
    let shape = ferrotext_tensor::broadcast_shapes(a.shape(), b.shape())
        .map_err(|e| ShardingTypeError::new(K::ShapeError, name, &[a, b], e.to_string()))?;
    let (ma, mb) = (a.manual_tags(), b.manual_tags());
    if ma.varying() != mb.varying() {
        return Err(ShardingTypeError::new(
            K::ShardingMismatch,
            name,
            &[a, b],
            format!("Primitive {name} requires varying manual axes to match (R6.9)"),
        )
        .into());
    }
    // R3.1/R3.2 inside (R6.11).
    let nonempty: Vec<&AxisSet> = [ma.reduced(), mb.reduced()]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect();
    if nonempty.len() == 2 && nonempty[0] != nonempty[1] {
        return Err(ShardingTypeError::new(
            K::ReducedConflict,
            name,
            &[a, b],
            "All inputs should be reduced across the same mesh axes",
        )
        .into());
    }
    let r: AxisSet = nonempty.first().map(|s| (*s).clone()).unwrap_or_default();
    for m in [ma, mb] {
        if r.iter()
            .any(|x| !m.reduced().contains(x) && !m.unreduced().contains(x))
        {
            return Err(ShardingTypeError::new(
                K::ReducedConflict,
                name,
                &[a, b],
                "Inputs cannot be replicated on the same axes that another input is reduced on",
            )
            .into());
        }
    }
    let (ua, ub) = (ma.unreduced(), mb.unreduced());
    let (u, r) = match op {
        BinaryOp::Add | BinaryOp::Sub => {
            if ua != ub {
                return Err(ShardingTypeError::new(
                    K::UnreducedMismatch,
                    name,
                    &[a, b],
                    format!("lhs and rhs to `{name}` must be unreduced along the same mesh axes"),
                )
                .into());
            }
            (ua.clone(), r)
        }
        BinaryOp::Mul | BinaryOp::Div => {
            if !ub.is_empty() && (op == BinaryOp::Div || !ua.is_empty()) {
                return Err(ShardingTypeError::new(
                    K::UnreducedOperand,
                    name,
                    &[a, b],
                    format!("`{name}` cannot take these unreduced operands"),
                )
                .into());
            }
            let (u, other_r) = if !ua.is_empty() {
                (ua, mb.reduced())
            } else {
                (ub, ma.reduced())
            };
            if !u.is_empty() && u != other_r {
                return Err(ShardingTypeError::new(
                    K::UnreducedMismatch,
                    name,
                    &[a, b],
                    "the other operand should be reduced along the same axes this one is unreduced on",
                )
                .into());
            }
            (u.clone(), r.difference(u).cloned().collect())
        }
        BinaryOp::Max => {
            if !ua.is_empty() || !ub.is_empty() {
                return Err(ShardingTypeError::new(
                    K::UnreducedOperand,
                    name,
                    &[a, b],
                    "`max` cannot take an unreduced operand",
                )
                .into());
            }
            (AxisSet::new(), r)
        }
    };
    manual_type(a, shape, ManualTags::new(ma.varying().clone(), u, r)?)
}

impl Ctx<'_> {
    // -----------------------------------------------------------------------------------------
    // The region

    /// Runs `body` on this device's blocks of `inputs` (manual over every mesh axis) and returns
    /// its outputs laid out by `out_specs`.
    ///
    /// # Errors
    /// R6.3: an in_spec that differs from its argument's spec (tags included); R6.6: a body
    /// output whose unreduced/reduced axes differ from its out_spec's, or that is varying on an
    /// axis the out_spec does not shard on (or invarying on one it does); any error of the body.
    ///
    /// # Collectives
    /// None at the boundary (R6.14); the body's collectives and, in the backward pass, the psums
    /// of transposed `pvary` casts.
    pub fn shard_map<F>(
        &mut self,
        inputs: &[Array],
        in_specs: &[PartitionSpec],
        out_specs: &[PartitionSpec],
        body: F,
    ) -> Result<Vec<Array>, SpmdError>
    where
        F: FnOnce(&mut Ctx<'_>, &[Array]) -> Result<Vec<Array>, SpmdError>,
    {
        if inputs.len() != in_specs.len() {
            return Err(SpmdError::BadArgument {
                op: "shard_map".into(),
                reason: format!("{} inputs but {} in_specs", inputs.len(), in_specs.len()),
            });
        }
        let mesh = manual_mesh(self.mesh())?;
        let mut inside = Vec::with_capacity(inputs.len());
        for (x, spec) in inputs.iter().zip(in_specs) {
            let arg_spec = x.ty().sharding().spec();
            if arg_spec != spec {
                return Err(type_error(
                    K::ShardingMismatch,
                    "shard_map",
                    x.ty(),
                    format!(
                        "in_specs passed to shard_map: {spec} does not match the specs of the input: \
                         {arg_spec}. in_specs may be omitted (they are inferred from the arguments); \
                         to reshard inputs, `reshard` them before the shard_map (R6.3)"
                    ),
                ));
            }
            let tags = ManualTags::new(
                spec.partition_axes().map(str::to_string).collect(),
                spec.unreduced().clone(),
                spec.reduced().clone(),
            )?;
            let ty = ArrayType::manual(x.ty().dtype(), x.ty().shard_shape(), mesh.clone(), tags)?;
            let y = x.with_type(ty);
            inside.push(self.record(
                Backward::EnterRegion {
                    outside: x.ty().clone(),
                },
                &[x],
                y,
            )?);
        }
        let outputs = body(self, &inside)?;
        if outputs.len() != out_specs.len() {
            return Err(SpmdError::BadArgument {
                op: "shard_map".into(),
                reason: format!(
                    "the body returned {} values for {} out_specs",
                    outputs.len(),
                    out_specs.len()
                ),
            });
        }
        let mut results = Vec::with_capacity(outputs.len());
        for (y, spec) in outputs.iter().zip(out_specs) {
            let m = y.ty().manual_tags();
            let sharded: AxisSet = spec.partition_axes().map(str::to_string).collect();
            if m.unreduced() != spec.unreduced() || m.reduced() != spec.reduced() {
                return Err(type_error(
                    K::UnreducedMismatch,
                    "shard_map",
                    y.ty(),
                    format!(
                        "out_specs passed to shard_map should be equal to the unreduced and reduced \
                         present on the out_aval. Got out_specs={spec} (R6.6; cast with `pcast` first)"
                    ),
                ));
            }
            if m.varying() != &sharded {
                return Err(type_error(
                    K::ShardingMismatch,
                    "shard_map",
                    y.ty(),
                    format!(
                        "out_specs {spec} must shard exactly on the axes the output is varying on \
                         (an unmentioned varying axis cannot be replicated, R6.6)"
                    ),
                ));
            }
            let mut shape = y.ty().shape().to_vec();
            for (d, dim) in spec.partitions().iter().enumerate() {
                if let Some(n) = shape.get_mut(d) {
                    *n *= self.mesh().axes_size(dim.axis_names())?;
                }
            }
            let ty = self.array_type(&shape, spec.clone())?;
            let out = y.with_type(ty);
            results.push(self.record(
                Backward::ExitRegion {
                    inside: y.ty().clone(),
                },
                &[y],
                out,
            )?);
        }
        Ok(results)
    }

    // -----------------------------------------------------------------------------------------
    // Casts and collectives

    /// `pcast(x, axes, to)`: a free cast between states (§6.4): invarying → varying (`pvary`),
    /// reduced → varying, varying → unreduced, invarying → reduced.
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
        let need =
            |name: &str, axes: &[String], states: &[AxisState]| -> Result<AxisState, SpmdError> {
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
            };
        let n = |cx: &Ctx<'_>, axes: &[String]| cx.rank_over(axes).map(|(_, n)| n);
        let shape = t.shape().to_vec();
        let dim_ok = |dim: usize| -> Result<(), SpmdError> {
            if dim >= shape.len() {
                return Err(type_error(
                    K::ShapeError,
                    "collective",
                    t,
                    format!("no dimension {dim}"),
                ));
            }
            Ok(())
        };
        Ok(match op {
            ManualOp::Pcast { axes, from, to } => {
                need("pcast", axes, &[*from])?;
                use AxisState::*;
                let supported = matches!(
                    (from, to),
                    (Invarying, Varying)
                        | (Reduced, Varying)
                        | (Varying, Unreduced)
                        | (Invarying, Reduced)
                );
                if !supported {
                    return Err(type_error(
                        K::InvalidSpec,
                        "pcast",
                        t,
                        format!("Unsupported pcast from={}, to='{}'", from.name(), to.name()),
                    ));
                }
                Array::new(
                    manual_type(t, shape, with_state(t, axes, *to)?)?,
                    x.local_cloned(),
                )
            }
            ManualOp::Psum { axes, from } => {
                need("psum", axes, &[AxisState::Varying, AxisState::Unreduced])?;
                let _ = from;
                let mut local = x.local_cloned();
                self.all_reduce(axes, &mut local, t.element_count())?;
                Array::new(
                    manual_type(t, shape, with_state(t, axes, AxisState::Invarying)?)?,
                    local,
                )
            }
            ManualOp::PsumScatter { axes, dim, from } => {
                need(
                    "psum_scatter",
                    axes,
                    &[AxisState::Varying, AxisState::Unreduced],
                )?;
                let _ = from;
                dim_ok(*dim)?;
                let g = n(self, axes)?;
                if shape[*dim] % g != 0 {
                    return Err(type_error(
                        K::ShapeError,
                        "psum_scatter",
                        t,
                        format!("dimension {dim} is not divisible by {g}"),
                    ));
                }
                let local = self.reduce_scatter_dim(axes, x.local_cloned(), &shape, *dim)?;
                let mut out_shape = shape.clone();
                out_shape[*dim] /= g;
                Array::new(
                    manual_type(t, out_shape, with_state(t, axes, AxisState::Varying)?)?,
                    local,
                )
            }
            ManualOp::AllGather { axes, dim, to } => {
                need("all_gather", axes, &[AxisState::Varying])?;
                dim_ok(*dim)?;
                let g = n(self, axes)?;
                let local = self.all_gather_dim(axes, x.local_cloned(), &shape, *dim)?;
                let mut out_shape = shape.clone();
                out_shape[*dim] *= g;
                let state = match to {
                    GatherTo::Varying => AxisState::Varying,
                    GatherTo::Reduced => AxisState::Reduced,
                    GatherTo::Invarying => AxisState::Invarying,
                };
                Array::new(
                    manual_type(t, out_shape, with_state(t, axes, state)?)?,
                    local,
                )
            }
            ManualOp::AllToAll {
                axes,
                split,
                concat,
            } => {
                need("all_to_all", axes, &[AxisState::Varying])?;
                dim_ok(*split)?;
                dim_ok(*concat)?;
                let g = n(self, axes)?;
                if shape[*split] % g != 0 {
                    return Err(type_error(
                        K::ShapeError,
                        "all_to_all",
                        t,
                        format!("dimension {split} is not divisible by {g}"),
                    ));
                }
                let mut out_shape = shape.clone();
                out_shape[*split] /= g;
                out_shape[*concat] *= g;
                let local =
                    self.all_to_all_dims(axes, x.local_cloned(), &shape, *split, *concat)?;
                Array::new(manual_type(t, out_shape, t.manual_tags().clone())?, local)
            }
            ManualOp::LocalSlice { axes, dim } => {
                need("dynamic_slice", axes, &[AxisState::Invarying])?;
                dim_ok(*dim)?;
                let (index, g) = self.rank_over(axes)?;
                let block = shape[*dim] / g;
                let local = match x.local_opt() {
                    Some(l) => Some(l.slice_dim(*dim, index * block..(index + 1) * block)?),
                    None => None,
                };
                let mut out_shape = shape.clone();
                out_shape[*dim] = block;
                Array::new(
                    manual_type(t, out_shape, with_state(t, axes, AxisState::Varying)?)?,
                    local,
                )
            }
        })
    }

    /// The transpose of a manual primitive, applied to `ct` (§6.4's table).
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

    // -----------------------------------------------------------------------------------------
    // Local ops inside a region (types per §6.3; data is this device's block)

    pub(crate) fn manual_dot(
        &mut self,
        lhs: &Array,
        rhs: &Array,
        dims: &DotDims,
    ) -> Result<Array, SpmdError> {
        let (l, r) = (lhs.ty(), rhs.ty());
        if !l.manual_tags().unreduced().is_empty() || !r.manual_tags().unreduced().is_empty() {
            return Err(ShardingTypeError::new(
                K::UnreducedOperand,
                "dot_general",
                &[l, r],
                "lhs or rhs passed to dot_general cannot be unreduced",
            )
            .into());
        }
        if l.manual_tags().varying() != r.manual_tags().varying() {
            return Err(ShardingTypeError::new(
                K::ShardingMismatch,
                "dot_general",
                &[l, r],
                "varying manual axes must match (R6.9)",
            )
            .into());
        }
        let shape = dims.output_shape(l.shape(), r.shape()).map_err(|e| {
            ShardingTypeError::new(K::ShapeError, "dot_general", &[l, r], e.to_string())
        })?;
        // R3.14: reduced is not propagated through a dot.
        let tags = ManualTags::new(
            l.manual_tags().varying().clone(),
            AxisSet::new(),
            AxisSet::new(),
        )?;
        let ty = manual_type(l, shape, tags)?;
        let local = match (lhs.local_opt(), rhs.local_opt()) {
            (Some(a), Some(b)) => Some(dot_general(a, b, dims, self.threads())?),
            _ => None,
        };
        Ok(Array::new(ty, local))
    }

    pub(crate) fn manual_local(
        &mut self,
        x: &Array,
        shape: Vec<usize>,
        local: Option<Tensor>,
    ) -> Result<Array, SpmdError> {
        Ok(Array::new(
            manual_type(x.ty(), shape, x.ty().manual_tags().clone())?,
            local,
        ))
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
        let chunk = elements / n;
        let blocks: Vec<Tensor> = (0..n)
            .map(|k| {
                Tensor::new(
                    part_shape.clone(),
                    recv[k * chunk..(k + 1) * chunk].to_vec(),
                )
            })
            .collect::<Result<_, _>>()?;
        let refs: Vec<&Tensor> = blocks.iter().collect();
        Ok(Some(Tensor::concat(&refs, concat)?))
    }
}
