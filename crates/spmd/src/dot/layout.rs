//! The layouts a `dot_general` computes in: the operand layouts the contraction runs on
//! ([`aligned_dot_types`]), the type of its natural result (partial sums over the contracting
//! axes, [`natural_dot_type`]), and whether operands as they stand already give it
//! ([`natural_as_they_stand`]). Pure functions of types: the same in real and abstract mode.

use ferrotext_sharding::{ArrayType, AxisSet, DimSpec, PartitionSpec};
use ferrotext_tensor::DotDims;

use crate::error::SpmdError;
use crate::reshard::same_layout;
use crate::rules;

/// Whether the product of operands typed `lhs` and `rhs`, its result typed by `out_sharding`,
/// is the contraction's natural result on the operands as they stand: no operand moves, no
/// collective, nothing to convert after — so a kernel can add it into a buffer laid out as the
/// result's local block.
pub(super) fn natural_as_they_stand(
    lhs: &ArrayType,
    rhs: &ArrayType,
    dims: &DotDims,
    out_sharding: &PartitionSpec,
) -> Result<bool, SpmdError> {
    let out_ty = rules::dot_general_type(lhs, rhs, dims, Some(out_sharding))?;
    let (lhs_ty, rhs_ty, contracted) = aligned_dot_types(lhs, rhs, dims)?;
    if !same_layout(lhs, &lhs_ty) || !same_layout(rhs, &rhs_ty) {
        return Ok(false);
    }
    let natural = natural_dot_type(&out_ty, (&lhs_ty, &rhs_ty), dims, contracted)?;
    Ok(same_layout(&natural, &out_ty))
}

/// The type of a contraction's natural result on operands laid out as `lhs_ty` and `rhs_ty`
/// (see [`aligned_dot_types`]): each output dim keeps its operand dim's partition, and the
/// result is partial sums (unreduced) over the `contracted` axes.
pub(super) fn natural_dot_type(
    out_ty: &ArrayType,
    (lhs_ty, rhs_ty): (&ArrayType, &ArrayType),
    dims: &DotDims,
    contracted: AxisSet,
) -> Result<ArrayType, SpmdError> {
    let lf = DotDims::free(lhs_ty.rank(), &dims.lhs_batch, &dims.lhs_contracting);
    let rf = DotDims::free(rhs_ty.rank(), &dims.rhs_batch, &dims.rhs_contracting);
    let partitions: Vec<DimSpec> = dims
        .lhs_batch
        .iter()
        .chain(&lf)
        .map(|&d| lhs_ty.sharding().spec().dim(d).clone())
        .chain(rf.iter().map(|&d| rhs_ty.sharding().spec().dim(d).clone()))
        .collect();
    let natural_spec = PartitionSpec::tagged(partitions, contracted, AxisSet::new())?;
    Ok(rules::make_type(
        "dot_general",
        out_ty,
        out_ty.shape().to_vec(),
        Ok(natural_spec),
    )?)
}

/// The operand layouts a dot_general computes in locally, and the axes its contraction runs over.
///
/// Each contracting pair meets on one partition: the common one, or the sharded side's when the
/// other is replicated (the replicated side is sliced, free), or the lhs's when both are sharded
/// differently (the rhs is resharded). A free dim gives up axes the other operand or a
/// contraction uses (gathered). The natural result is then unreduced over the contraction axes.
pub(super) fn aligned_dot_types(
    lhs: &ArrayType,
    rhs: &ArrayType,
    dims: &DotDims,
) -> Result<(ArrayType, ArrayType, AxisSet), SpmdError> {
    let ls = lhs.sharding().spec();
    let rs = rhs.sharding().spec();
    let lf = DotDims::free(lhs.rank(), &dims.lhs_batch, &dims.lhs_contracting);
    let rf = DotDims::free(rhs.rank(), &dims.rhs_batch, &dims.rhs_contracting);
    let mut lparts: Vec<DimSpec> = (0..lhs.rank()).map(|d| ls.dim(d).clone()).collect();
    let mut rparts: Vec<DimSpec> = (0..rhs.rank()).map(|d| rs.dim(d).clone()).collect();
    // Batch dims meet on the lhs's partition (the rhs's when the lhs is replicated there: the
    // lhs is sliced for free and each device computes its batch slice). When the output type
    // keeps the lhs's replicated batch dim (R3.9), the natural result is sharded where the
    // output is not, and the final reshard all-gathers it.
    for (&l, &r) in dims.lhs_batch.iter().zip(&dims.rhs_batch) {
        meet(&mut lparts, &mut rparts, l, r);
    }
    // Contracting dims meet the same way; the axes they meet on are what the result is a
    // partial sum over.
    let mut contracted = AxisSet::new();
    for (&l, &r) in dims.lhs_contracting.iter().zip(&dims.rhs_contracting) {
        let target = meet(&mut lparts, &mut rparts, l, r);
        contracted.extend(target.axis_names().iter().cloned());
    }
    // Free dims may not use contraction axes, and the rhs's free dims may not use the lhs's axes.
    for &d in &lf {
        lparts[d] = leading_axes(&lparts[d], |a| !contracted.contains(a));
    }
    let lhs_axes = axes_of(&lparts, usize::MAX);
    for &d in &rf {
        rparts[d] = leading_axes(&rparts[d], |a| {
            !contracted.contains(a) && !lhs_axes.contains(a)
        });
    }
    let retag = |t: &ArrayType, parts: Vec<DimSpec>| -> Result<ArrayType, SpmdError> {
        let used: AxisSet = parts
            .iter()
            .flat_map(|p| p.axis_names().iter().cloned())
            .collect();
        let r: AxisSet = t
            .sharding()
            .spec()
            .reduced()
            .difference(&used)
            .cloned()
            .collect();
        let spec = PartitionSpec::tagged(parts, AxisSet::new(), r)?;
        Ok(rules::make_type(
            "dot_general",
            t,
            t.shape().to_vec(),
            Ok(spec),
        )?)
    };
    Ok((retag(lhs, lparts)?, retag(rhs, rparts)?, contracted))
}

/// The axes of every dim of `parts` but `skip`.
fn axes_of(parts: &[DimSpec], skip: usize) -> AxisSet {
    parts
        .iter()
        .enumerate()
        .filter(|(d, _)| *d != skip)
        .flat_map(|(_, p)| p.axis_names().iter().cloned())
        .collect()
}

/// Dim `l` of the lhs and dim `r` of the rhs meet on one partition, which both take and which
/// is returned: the lhs's, or the rhs's where the lhs is replicated; replicated when its axes
/// are used by another dim of either operand.
fn meet(lparts: &mut [DimSpec], rparts: &mut [DimSpec], l: usize, r: usize) -> DimSpec {
    let target = if !lparts[l].is_replicated() {
        lparts[l].clone()
    } else {
        rparts[r].clone()
    };
    let clash = target
        .axis_names()
        .iter()
        .any(|a| axes_of(lparts, l).contains(a) || axes_of(rparts, r).contains(a));
    let target = if clash { DimSpec::Replicated } else { target };
    lparts[l] = target.clone();
    rparts[r] = target.clone();
    target
}

/// The leading axes of `part` that `keep` accepts, up to the first it refuses.
fn leading_axes(part: &DimSpec, keep: impl Fn(&str) -> bool) -> DimSpec {
    DimSpec::axes(
        part.axis_names()
            .iter()
            .take_while(|a| keep(a.as_str()))
            .cloned()
            .collect::<Vec<String>>(),
    )
}
