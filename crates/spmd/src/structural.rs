//! Structural ops on global arrays and their transposes: `slice` ↔ zero padding, `concat` ↔
//! slices, `take` (gather along the leading axis by an index array, the embedding lookup) ↔
//! `scatter_add`, and `select` ↔ a select of the cotangent against zeros; `take` reads
//! [`Ids`](crate::Ids) index arrays.
//!
//! All are linear in their data operands, so unreduced and reduced tags pass through
//! (docs/sharding-rules.md §3.5); a sliced or concatenated dimension must not be sharded (reshard
//! first), which keeps every op local. `take` follows R3.27 with docs/design.md §4.2's deviation: a
//! table reduced on an axis the indices are sharded on is used locally, and its cotangent comes
//! back unreduced on that axis.

use std::borrow::Cow;

use ferrotext_sharding::{ArrayType, AxisSet, DType, DimSpec, NamedSharding, PartitionSpec};
use ferrotext_tensor::Tensor;

use crate::array::Array;
use crate::ctx::{Ctx, Mode};
use crate::error::{ShardingTypeError, SpmdError, TypeErrorKind as K};
use crate::ids::Ids;
use crate::rules;
use crate::tape::Backward;

fn type_error(kind: K, op: &str, xs: &[&ArrayType], message: impl Into<String>) -> SpmdError {
    ShardingTypeError::new(kind, op, xs, message).into()
}

fn sharded_over_devices(ty: &ArrayType, dim: usize) -> bool {
    ty.sharding().dim_parts(dim).map_or(true, |n| n > 1)
}

impl Ctx<'_> {
    /// An index array from this device's block, typed `u32[shape]` with `spec`.
    ///
    /// # Errors
    /// A spec that does not fit, or a block of the wrong length.
    pub fn ids_from_local(
        &self,
        shape: &[usize],
        spec: PartitionSpec,
        local: Vec<u32>,
    ) -> Result<Ids, SpmdError> {
        let ty = ArrayType::new(
            DType::U32,
            shape.to_vec(),
            NamedSharding::new(self.mesh().clone(), spec)?,
        )?;
        if ty.sharding().spec().is_tagged() {
            return Err(type_error(
                K::InvalidSpec,
                "ids",
                &[&ty],
                "index arrays cannot be reduced or unreduced (R3.27)",
            ));
        }
        let n: usize = ty.shard_shape().iter().product();
        if local.len() != n {
            return Err(SpmdError::ShardLength {
                op: "ids_from_local",
                ty: ty.to_string(),
                expected: n,
                got: local.len(),
            });
        }
        Ok(Ids::new(ty, (self.mode() == Mode::Real).then_some(local)))
    }

    /// The index array `global` laid out by `spec` (each device keeps its block).
    ///
    /// # Errors
    /// As [`Ctx::ids_from_local`].
    pub fn ids_from_global(
        &self,
        shape: &[usize],
        spec: PartitionSpec,
        global: &[u32],
    ) -> Result<Ids, SpmdError> {
        let as_f32 = Tensor::new(shape.to_vec(), global.iter().map(|&i| i as f32).collect())?;
        let named = NamedSharding::new(self.mesh().clone(), spec.clone())?;
        let ranges = named.shard_ranges(shape, self.device())?;
        let block = as_f32.slice(&ranges)?;
        self.ids_from_local(
            shape,
            spec,
            block.data().iter().map(|&v| v as u32).collect(),
        )
    }

    /// `x[.., start..end, ..]` along `dim`.
    ///
    /// # Errors
    /// `shape_error` for a range out of bounds; `sharding_mismatch` when `dim` is sharded (and the
    /// range is not the whole dim).
    pub fn slice(
        &mut self,
        x: &Array,
        dim: usize,
        start: usize,
        end: usize,
    ) -> Result<Array, SpmdError> {
        let t = x.ty();
        if dim >= t.rank() || start > end || end > t.shape()[dim] {
            return Err(type_error(
                K::ShapeError,
                "slice",
                &[t],
                format!("{start}..{end} along dim {dim} of {:?}", t.shape()),
            ));
        }
        if (start, end) != (0, t.shape()[dim]) && sharded_over_devices(t, dim) {
            return Err(type_error(
                K::ShardingMismatch,
                "slice",
                &[t],
                format!("dimension {dim} is sharded; reshard it to replicated before slicing"),
            ));
        }
        let mut shape = t.shape().to_vec();
        shape[dim] = end - start;
        let ty = rules::make_type("slice", t, shape, Ok(t.sharding().spec().clone()))?;
        let local = x
            .local_opt()
            .as_deref()
            .map(|l| l.slice_dim(dim, start..end))
            .transpose()?;
        let out = Array::new(ty, local);
        self.record(
            Backward::Slice {
                x: t.clone(),
                dim,
                start,
            },
            &[x],
            out,
        )
    }

    /// Concatenation along `dim` of arrays with the same sharding (tags included, R3.24).
    ///
    /// # Errors
    /// `sharding_mismatch` for different shardings or a sharded `dim`; `shape_error` for shapes
    /// that do not concatenate.
    pub fn concat(&mut self, xs: &[&Array], dim: usize) -> Result<Array, SpmdError> {
        let first = xs.first().ok_or(SpmdError::NoOperands { op: "concat" })?;
        let t0 = first.ty();
        let types: Vec<&ArrayType> = xs.iter().map(|x| x.ty()).collect();
        if let Some(other) = xs.iter().find(|x| x.ty().dtype() != t0.dtype()) {
            rules::same_dtype("concat", t0, other.ty())?;
        }
        if xs.iter().any(|x| x.ty().sharding() != t0.sharding()) {
            return Err(type_error(
                K::ShardingMismatch,
                "concat",
                &types,
                "All operands should have the same sharding (R3.24)",
            ));
        }
        if dim >= t0.rank() || sharded_over_devices(t0, dim) {
            return Err(type_error(
                K::ShardingMismatch,
                "concat",
                &types,
                format!("cannot concatenate along dimension {dim}: out of range or sharded"),
            ));
        }
        let parts: Vec<Tensor> = xs
            .iter()
            .filter_map(|x| x.local_opt().as_deref().cloned())
            .collect();
        let mut shape = t0.shape().to_vec();
        shape[dim] = xs.iter().map(|x| x.shape()[dim]).sum();
        if xs.iter().any(|x| {
            x.ty().rank() != t0.rank()
                || (0..t0.rank()).any(|d| d != dim && x.shape()[d] != t0.shape()[d])
        }) {
            return Err(type_error(
                K::ShapeError,
                "concat",
                &types,
                "shapes do not concatenate",
            ));
        }
        let ty = rules::make_type("concat", t0, shape, Ok(t0.sharding().spec().clone()))?;
        let local = if parts.len() == xs.len() {
            let refs: Vec<&Tensor> = parts.iter().collect();
            Some(Tensor::concat(&refs, dim)?)
        } else {
            None
        };
        let sizes = xs.iter().map(|x| x.shape()[dim]).collect();
        let out = Array::new(ty, local);
        self.record(
            Backward::Concat {
                types: xs.iter().map(|x| x.ty().clone()).collect(),
                dim,
                sizes,
            },
            xs,
            out,
        )
    }

    /// Rows of `table` (dim 0) picked by `ids`: the output is `ids.shape ++ table.shape[1..]`,
    /// laid out like the ids then like the table's other dims (the embedding lookup).
    ///
    /// # Errors
    /// R3.27: an unreduced table; a table sharded along dim 0; an axis used twice.
    ///
    /// # Collectives
    /// None forward. Backward: the per-device scatter-adds are partial sums over the ids' axes,
    /// kept unreduced for a table reduced on them, else all-reduced.
    pub fn take(&mut self, table: &Array, ids: &Ids) -> Result<Array, SpmdError> {
        self.take_with(table, ids, None)
    }

    /// [`Ctx::take`] whose backward leaves row `frozen` of the table out: the rows read are
    /// `take`'s, bit for bit, and the positions whose id is `frozen` pass no cotangent back, so
    /// that row's gradient gets nothing from this lookup (transformers' `nn.Embedding` with a
    /// `padding_idx`: the pad token's row learns only from a head tied to the table).
    ///
    /// # Errors
    /// As [`Ctx::take`].
    pub fn take_frozen(
        &mut self,
        table: &Array,
        ids: &Ids,
        frozen: u32,
    ) -> Result<Array, SpmdError> {
        self.take_with(table, ids, Some(frozen))
    }

    /// [`Ctx::take`], with the row its backward leaves out, if any.
    fn take_with(
        &mut self,
        table: &Array,
        ids: &Ids,
        frozen: Option<u32>,
    ) -> Result<Array, SpmdError> {
        let t = table.ty();
        if !t.sharding().spec().unreduced().is_empty() {
            return Err(type_error(
                K::UnreducedOperand,
                "take",
                &[t],
                "gather cannot take an unreduced operand (R3.27)",
            ));
        }
        if t.rank() == 0 || sharded_over_devices(t, 0) {
            return Err(type_error(
                K::ShardingMismatch,
                "take",
                &[t],
                "the gathered dimension must be replicated; reshard the table first",
            ));
        }
        let ids_axes = rules::sharded_axes(ids.ty());
        let mut shape = ids.ty().shape().to_vec();
        shape.extend_from_slice(&t.shape()[1..]);
        let mut partitions: Vec<DimSpec> = ids.ty().sharding().spec().partitions().to_vec();
        partitions.extend((1..t.rank()).map(|d| t.sharding().spec().dim(d).clone()));
        let reduced: AxisSet = t
            .sharding()
            .spec()
            .reduced()
            .difference(&ids_axes)
            .cloned()
            .collect();
        let spec = PartitionSpec::tagged(partitions, AxisSet::new(), reduced);
        let ty = rules::make_type("take", t, shape, spec.map_err(ShardingTypeError::from))?;
        let local = match (table.local_opt().as_deref(), ids.local()) {
            (Some(tb), Some(ix)) => {
                let rows = ferrotext_tensor::gather(tb, 0, ix)?;
                let local_shape = ty.shard_shape();
                Some(rows.reshape(&local_shape)?)
            }
            _ => None,
        };
        let out = Array::new(ty, local);
        self.record(
            Backward::Take {
                table: t.clone(),
                ids: ids.clone(),
                frozen,
            },
            &[table],
            out,
        )
    }

    /// The type of a take's rows as its transpose adds them into the table's cotangent in
    /// place ([`Ctx::take_transpose_into`]), `None` when they need a collective first (their
    /// layout is not the cotangent's).
    ///
    /// # Errors
    /// A type the rules refuse.
    pub(crate) fn take_transpose_in_place(
        &self,
        table: &ArrayType,
        ids: &Ids,
    ) -> Result<Option<ArrayType>, SpmdError> {
        let natural = self.take_transpose_type(table, ids)?;
        Ok(crate::reshard::same_layout(&natural, &table.to_cotangent()).then_some(natural))
    }

    /// The type of [`Ctx::take_transpose`]'s natural result: each device adds its own rows,
    /// partial over the ids' axes.
    fn take_transpose_type(&self, table: &ArrayType, ids: &Ids) -> Result<ArrayType, SpmdError> {
        let ids_axes = rules::sharded_axes(ids.ty());
        let mut partitions = vec![DimSpec::Replicated];
        partitions.extend((1..table.rank()).map(|d| table.sharding().spec().dim(d).clone()));
        let spec = PartitionSpec::tagged(partitions, ids_axes, AxisSet::new())?;
        Ok(rules::make_type(
            "take",
            table,
            table.shape().to_vec(),
            Ok(spec),
        )?)
    }

    /// The transpose of [`Ctx::take`]: `ct` rows added into a zero table of type `table`'s
    /// cotangent.
    pub(crate) fn take_transpose(
        &mut self,
        ct: &Array,
        table: &ArrayType,
        (ids, frozen): (&Ids, Option<u32>),
    ) -> Result<Array, SpmdError> {
        let target = table.to_cotangent();
        let rows = table.shape()[0];
        let natural = self.take_transpose_type(table, ids)?;
        let local = match (ct.local_opt().as_deref(), ids.local()) {
            (Some(c), Some(ix)) => {
                let local_shape = natural.shard_shape();
                let width: usize = local_shape[1..].iter().product();
                let (ix, kept) = kept_rows(ix, c.data(), width, frozen);
                let src = Tensor::new(vec![ix.len(), width], kept.into_owned())?;
                let added = ferrotext_tensor::scatter_add(&[rows, width], 0, &ix, &src)?;
                Some(added.reshape(&local_shape)?)
            }
            _ => None,
        };
        let local = self.convert(local, &natural, &target)?;
        Ok(Array::new(target, local))
    }

    /// [`Ctx::take_transpose`] added into `dest` (the table cotangent's local block, in
    /// consecutive equal parts; see [`crate::GradientSink::buffer`]) instead of into a zero
    /// table, when the rows' natural type is the cotangent's (no collective after) and each part
    /// holds whole rows. Returns whether it was; on `false` nothing was touched.
    ///
    /// # Errors
    /// As [`Ctx::take_transpose`]; `dest` not the size of the local block.
    pub(crate) fn take_transpose_into(
        &mut self,
        ct: &Array,
        table: &ArrayType,
        (ids, frozen): (&Ids, Option<u32>),
        dest: &mut [&mut [f32]],
    ) -> Result<bool, SpmdError> {
        let Some(natural) = self.take_transpose_in_place(table, ids)? else {
            return Ok(false);
        };
        match (ct.local_opt().as_deref(), ids.local()) {
            (Some(c), Some(ix)) => {
                let width: usize = natural.shard_shape()[1..].iter().product();
                let (ix, kept) = kept_rows(ix, c.data(), width, frozen);
                Ok(ferrotext_tensor::scatter_add_into_parts(
                    dest, width, &ix, &kept,
                )?)
            }
            _ => Ok(true),
        }
    }

    /// `mask ? a : b` elementwise, where `mask` holds 0 or 1 and every operand has the same type
    /// (tags included, docs/sharding-rules.md §3.2, select).
    ///
    /// # Errors
    /// `sharding_mismatch` when the types differ; `unreduced_operand` for a tagged mask.
    pub fn select(&mut self, mask: &Array, a: &Array, b: &Array) -> Result<Array, SpmdError> {
        let types = [mask.ty(), a.ty(), b.ty()];
        if a.ty() != b.ty()
            || mask.shape() != a.shape()
            || mask.ty().sharding().spec().partitions() != a.ty().sharding().spec().partitions()
        {
            return Err(type_error(
                K::ShardingMismatch,
                "select",
                &types,
                "select cases must have the same shardings",
            ));
        }
        if mask.ty().sharding().spec().is_tagged() {
            return Err(type_error(
                K::UnreducedOperand,
                "select",
                &types,
                "the predicate of select cannot be tagged",
            ));
        }
        let local = match (
            mask.local_opt().as_deref(),
            a.local_opt().as_deref(),
            b.local_opt().as_deref(),
        ) {
            (Some(m), Some(x), Some(y)) => Some(select_local(m, x, y)?),
            _ => None,
        };
        let out = Array::new(a.ty().clone(), local);
        self.record(Backward::Select { mask: mask.clone() }, &[a, b], out)
    }

    /// The transpose of [`Ctx::slice`] of `x` from `start` along `dim`: `ct` padded with zeros
    /// (zeros keep an unreduced cotangent's sum exact, R9.1).
    pub(crate) fn slice_transpose(
        &mut self,
        x: &ArrayType,
        dim: usize,
        start: usize,
        ct: &Array,
    ) -> Result<Array, SpmdError> {
        let local = match ct.local_opt().as_deref() {
            Some(c) => {
                let full = x.to_cotangent().shard_shape();
                let after = full[dim] - start - c.shape()[dim];
                Some(c.pad_dim(dim, start, after)?)
            }
            None => None,
        };
        Ok(Array::new(x.to_cotangent(), local))
    }

    /// [`Ctx::slice_transpose`] added into `dest`, the local block of a cotangent `x` already
    /// has: `ct` goes into its slice of `dest`, and nothing else is touched (where the padded
    /// transpose added zeros). The same values as adding the padded transpose (R4.4), without
    /// the zero-padded copy and the full-size add; a `-0.0` outside the slice stays `-0.0`.
    pub(crate) fn slice_transpose_into(
        &mut self,
        x: &ArrayType,
        dim: usize,
        start: usize,
        ct: &Array,
        dest: &mut [f32],
    ) -> Result<(), SpmdError> {
        let Some(c) = ct.local_opt() else {
            return Ok(());
        };
        let full = x.to_cotangent().shard_shape();
        let (outer, inner): (usize, usize) = (
            full[..dim].iter().product(),
            full[dim + 1..].iter().product(),
        );
        let (n, whole) = (c.shape()[dim] * inner, full[dim] * inner);
        if dest.len() != outer * whole || c.len() != outer * n || start * inner + n > whole {
            return Err(SpmdError::Internal {
                op: "slice",
                invariant: "a cotangent that does not fit the sliced value",
            });
        }
        ferrotext_tensor::add_assign_rows(dest, whole, start * inner, c.data(), n);
        Ok(())
    }

    /// The transpose of [`Ctx::concat`] of operands typed `types` with `sizes` along `dim`: `ct`
    /// sliced back into one cotangent per operand.
    pub(crate) fn concat_transpose(
        &mut self,
        types: &[ArrayType],
        dim: usize,
        sizes: &[usize],
        ct: &Array,
    ) -> Result<Vec<Option<Array>>, SpmdError> {
        let mut out = Vec::with_capacity(types.len());
        let mut offset = 0;
        for (t, &n) in types.iter().zip(sizes) {
            let local = ct
                .local_opt()
                .as_deref()
                .map(|c| c.slice_dim(dim, offset..offset + n))
                .transpose()?;
            out.push(Some(Array::new(t.to_cotangent(), local)));
            offset += n;
        }
        Ok(out)
    }

    /// The transpose of [`Ctx::select`] by `mask`: the cotangents of `a` (`mask ? ct : 0`) and
    /// `b` (`mask ? 0 : ct`).
    pub(crate) fn select_transpose(
        &mut self,
        mask: &Array,
        ct: &Array,
    ) -> Result<[Array; 2], SpmdError> {
        let (da, db) = match (mask.local_opt().as_deref(), ct.local_opt().as_deref()) {
            (Some(m), Some(c)) => {
                let zero = Tensor::zeros(c.shape());
                (
                    Some(select_local(m, c, &zero)?),
                    Some(select_local(m, &zero, c)?),
                )
            }
            _ => (None, None),
        };
        Ok([
            Array::new(ct.ty().clone(), da),
            Array::new(ct.ty().clone(), db),
        ])
    }
}

/// `m ? x : y` on local blocks.
/// The ids and the cotangent rows (`width` elements each, one per id) a take's transpose
/// scatters: all of them, or, with a `frozen` row, those whose id is not it (borrowed when none
/// is; also when the lengths disagree, which the scatter then reports).
fn kept_rows<'a>(
    ids: &'a [u32],
    rows: &'a [f32],
    width: usize,
    frozen: Option<u32>,
) -> (Cow<'a, [u32]>, Cow<'a, [f32]>) {
    let frozen = frozen.filter(|f| ids.contains(f) && rows.len() == ids.len() * width);
    let Some(frozen) = frozen else {
        return (Cow::Borrowed(ids), Cow::Borrowed(rows));
    };
    let (mut kept_ids, mut kept) = (
        Vec::with_capacity(ids.len()),
        Vec::with_capacity(rows.len()),
    );
    for (k, &id) in ids.iter().enumerate() {
        if id != frozen {
            kept_ids.push(id);
            kept.extend_from_slice(&rows[k * width..(k + 1) * width]);
        }
    }
    (Cow::Owned(kept_ids), Cow::Owned(kept))
}

fn select_local(m: &Tensor, x: &Tensor, y: &Tensor) -> Result<Tensor, SpmdError> {
    let xm = x.zip_with(m, |v, k| if k != 0.0 { v } else { 0.0 })?;
    let ym = y.zip_with(m, |v, k| if k != 0.0 { 0.0 } else { v })?;
    Ok(xm.add(&ym)?)
}
