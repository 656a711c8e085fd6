//! A model's weights and one batch on a mesh of one device: what the tests that compare a loss
//! or a gradient with a reference computed elsewhere (transformers, finite differences) start
//! from.

use std::sync::Arc;

use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, Ids, SpmdError};
use ferrotext_tensor::Tensor;

/// The one-device mesh (`data` of 1).
pub fn mesh() -> Arc<Mesh> {
    Arc::new(Mesh::explicit([("data", 1)]).expect("a one-device mesh"))
}

/// The rows' `[B, T]` inputs (`row[..T]`) and targets (`row[1..]`), all rows of `T + 1` tokens.
pub fn inputs_and_targets(rows: &[Vec<u32>]) -> ((usize, usize), Vec<u32>, Vec<u32>) {
    let (b, t) = (rows.len(), rows[0].len() - 1);
    let inputs = rows.iter().flat_map(|r| r[..t].to_vec()).collect();
    let targets = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    ((b, t), inputs, targets)
}

/// `values` placed replicated on `cx`'s device, and `rows` as `[B, T]` inputs and targets split
/// over `data` ([`inputs_and_targets`]).
///
/// # Errors
/// A value or an id the context refuses.
pub fn place(
    cx: &mut Ctx<'_>,
    values: &[Tensor],
    rows: &[Vec<u32>],
) -> Result<(Vec<Array>, Ids, Ids), SpmdError> {
    let named = NamedSharding::new(cx.mesh().clone(), PartitionSpec::replicated())?;
    let params = values
        .iter()
        .map(|v| cx.from_global(v, named.clone()))
        .collect::<Result<_, _>>()?;
    let ((b, t), inputs, targets) = inputs_and_targets(rows);
    let spec = PartitionSpec::new([Some("data"), None]);
    let inputs = cx.ids_from_global(&[b, t], spec.clone(), &inputs)?;
    let targets = cx.ids_from_global(&[b, t], spec, &targets)?;
    Ok((params, inputs, targets))
}
