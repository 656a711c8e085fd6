//! `shard_map`: the region boundary and its transposes.
//!
//! On the way in, axes in an in_spec's partitions become varying and its tags stay tags (R6.5);
//! on the way out the body's tags must equal the out_spec's and its varying axes must be those
//! the out_spec shards on (R6.6). The boundary moves no data and adds no collective (R6.14), in
//! either direction: a cotangent crosses it with swapped tags (R6.13).

use ferrotext_sharding::{ArrayType, AxisSet, ManualTags, PartitionSpec};

use super::typing::{manual_mesh, type_error};
use crate::array::Array;
use crate::ctx::Ctx;
use crate::error::{SpmdError, TypeErrorKind as K};
use crate::tape::Backward;

impl Ctx<'_> {
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
            return Err(SpmdError::CountMismatch {
                op: "shard_map",
                got: inputs.len(),
                what: "inputs",
                expected: in_specs.len(),
                per: "in_specs",
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
            return Err(SpmdError::CountMismatch {
                op: "shard_map",
                got: outputs.len(),
                what: "values returned by the body",
                expected: out_specs.len(),
                per: "out_specs",
            });
        }
        let mut results = Vec::with_capacity(outputs.len());
        for (y, spec) in outputs.iter().zip(out_specs) {
            check_region_output(y, spec)?;
            let mut shape = y.ty().shape().to_vec();
            for (d, dim) in spec.partitions().iter().enumerate() {
                if let Some(n) = shape.get_mut(d) {
                    *n *= self.mesh().axes_size(dim.axis_names())?;
                }
            }
            let ty = self
                .array_type(&shape, spec.clone())?
                .with_dtype(y.ty().dtype());
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
}

/// R6.6: a region output `y` leaves under `spec` only with `spec`'s unreduced and reduced axes,
/// and sharded exactly on the axes it is varying on.
fn check_region_output(y: &Array, spec: &PartitionSpec) -> Result<(), SpmdError> {
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
    Ok(())
}

/// The transpose of entering a region from `outside`: the cotangent leaves typed as `outside`'s
/// cotangent, no data moved (R6.13, R6.14).
pub(crate) fn enter_region_transpose(outside: &ArrayType, ct: &Array) -> Array {
    ct.with_type(outside.to_cotangent())
}

/// The transpose of leaving a region from `inside`: the cotangent enters typed as `inside`'s
/// cotangent, no data moved (R6.13, R6.14).
pub(crate) fn exit_region_transpose(inside: &ArrayType, ct: &Array) -> Array {
    ct.with_type(inside.to_cotangent())
}
