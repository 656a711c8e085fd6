//! Indexing kernels: gather along an axis, its adjoint scatter-add (into a new tensor, into a
//! buffer, or into parts of one), and top-k over the last dimension.
//!
//! Invariants: scatter-add adds rows in index order, so repeated indices sum in a fixed order;
//! top-k is descending with ties to the lower index.

use super::last_dim;
use crate::error::TensorError;
use crate::tensor::Tensor;

/// `out = x` indexed by `indices` along `axis` (XLA's gather of whole slices): the result has
/// `indices.len()` entries along `axis`.
///
/// # Errors
/// `axis` out of range or an index out of bounds.
pub fn gather(x: &Tensor, axis: usize, indices: &[u32]) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("gather").map(|s| {
        s.bytes(
            (x.shape()
                .get(axis)
                .map_or(0, |&e| 8 * indices.len() * (x.len() / e.max(1)))) as f64,
        )
    });
    let extent = *x
        .shape()
        .get(axis)
        .ok_or_else(|| TensorError::shape("gather", format!("no axis {axis}")))?;
    if let Some(i) = indices.iter().find(|&&i| i as usize >= extent) {
        return Err(TensorError::shape(
            "gather",
            format!("index {i} out of bounds for {extent}"),
        ));
    }
    let outer: usize = x.shape()[..axis].iter().product();
    let inner: usize = x.shape()[axis + 1..].iter().product();
    let mut shape = x.shape().to_vec();
    shape[axis] = indices.len();
    let mut data = Vec::with_capacity(outer * indices.len() * inner);
    for o in 0..outer {
        for &i in indices {
            let start = (o * extent + i as usize) * inner;
            data.extend_from_slice(&x.data()[start..start + inner]);
        }
    }
    Tensor::new(shape, data)
}

/// Backward of [`gather`]: a zero tensor of `shape` with each slice of `src` added at its index
/// along `axis` (repeated indices accumulate, in order).
///
/// # Errors
/// Shapes disagree or an index is out of bounds.
pub fn scatter_add(
    shape: &[usize],
    axis: usize,
    indices: &[u32],
    src: &Tensor,
) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("scatter_add")
        .map(|s| s.bytes((4 * (shape.iter().product::<usize>() + 2 * src.len())) as f64));
    let extent = *shape
        .get(axis)
        .ok_or_else(|| TensorError::shape("scatter_add", format!("no axis {axis}")))?;
    let mut want = shape.to_vec();
    want[axis] = indices.len();
    if src.shape() != want.as_slice() || indices.iter().any(|&i| i as usize >= extent) {
        return Err(TensorError::shape(
            "scatter_add",
            format!(
                "src {:?} with {} indices into {shape:?}",
                src.shape(),
                indices.len()
            ),
        ));
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = Tensor::zeros(shape);
    for o in 0..outer {
        for (k, &i) in indices.iter().enumerate() {
            let dst = (o * extent + i as usize) * inner;
            let s = (o * indices.len() + k) * inner;
            for (d, &v) in out.data_mut()[dst..dst + inner]
                .iter_mut()
                .zip(&src.data()[s..s + inner])
            {
                *d += v;
            }
        }
    }
    Ok(out)
}

/// `dest += scatter_add(src)` along axis 0, bit for bit: the source rows bound for each table
/// row (`indices[k]` for row `k` of `src`, `indices.len()` rows of `width`) are summed first,
/// in order from `0.0`, as [`scatter_add`] sums them into a zero table, and that sum is added
/// into the row of `dest`; for a gradient accumulator that takes an embedding table's gradient
/// without a zero table.
///
/// # Errors
/// `dest` or `src` not a whole number of rows of `width`, a length mismatch, or an index out of
/// bounds (then nothing is added).
pub fn scatter_add_into(
    dest: &mut [f32],
    width: usize,
    indices: &[u32],
    src: &[f32],
) -> Result<(), TensorError> {
    // One part holds whole rows whenever `dest` does (checked inside).
    scatter_add_into_parts(&mut [dest], width, indices, src).map(|_| ())
}

/// [`scatter_add_into`] into a table held in `parts` of equal length, in order (part `j` holds
/// elements `j·len/p .. (j+1)·len/p`, as a reduce-scatter bucket keeps a value's chunk `j` in
/// its segment `j`): each row's sum goes into the part holding that row, with the same bits.
/// Returns `false`, having touched nothing, when the parts are unequal or a part does not hold
/// whole rows.
///
/// # Errors
/// As [`scatter_add_into`], for the table the parts make up.
pub fn scatter_add_into_parts(
    parts: &mut [&mut [f32]],
    width: usize,
    indices: &[u32],
    src: &[f32],
) -> Result<bool, TensorError> {
    let _span = ferrotext_profile::span("scatter_add").map(|s| s.bytes((12 * src.len()) as f64));
    let part = parts.first().map_or(0, |p| p.len());
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if width == 0 && len == 0 && src.is_empty() {
        return Ok(true);
    }
    let rows = len.checked_div(width).unwrap_or(0);
    if width == 0
        || len != rows * width
        || src.len() != indices.len() * width
        || indices.iter().any(|&i| i as usize >= rows)
    {
        return Err(TensorError::shape(
            "scatter_add_into",
            format!(
                "{} source elements at {} indices into {len} elements in rows of {width}",
                src.len(),
                indices.len(),
            ),
        ));
    }
    if indices.is_empty() {
        return Ok(true);
    }
    if !part.is_multiple_of(width) || parts.iter().any(|p| p.len() != part) {
        return Ok(false);
    }
    // Every index is below `rows` ≥ 1, so the parts hold at least one row each.
    let rows_per_part = part / width;
    // Source rows grouped by table row, each group in source order (a stable sort).
    let mut order: Vec<usize> = (0..indices.len()).collect();
    order.sort_by_key(|&k| indices[k]);
    let mut sum = vec![0.0f32; width];
    for group in order.chunk_by(|&a, &b| indices[a] == indices[b]) {
        sum.fill(0.0);
        for &k in group {
            for (s, &v) in sum.iter_mut().zip(&src[k * width..(k + 1) * width]) {
                *s += v;
            }
        }
        let row = indices[group[0]] as usize;
        let at = (row % rows_per_part) * width;
        let dest = &mut parts[row / rows_per_part][at..at + width];
        for (d, &s) in dest.iter_mut().zip(&sum) {
            *d += s;
        }
    }
    Ok(true)
}

/// Up to this `k`, [`top_k`] keeps the best k in a sorted buffer; above, it selects then sorts.
const TOP_K_INSERTION_MAX: usize = 16;

/// The `k` largest entries of each row (last dim), descending; ties go to the lower index.
/// Returns the values `[.., k]` and their indices.
///
/// # Errors
/// `k` is 0 or larger than the row.
pub fn top_k(x: &Tensor, k: usize) -> Result<(Tensor, Vec<u32>), TensorError> {
    let _span = ferrotext_profile::span("top_k").map(|s| s.bytes((4 * x.len()) as f64));
    let n = last_dim(x, "top_k")?;
    if k == 0 || k > n {
        return Err(TensorError::shape(
            "top_k",
            format!("k = {k} for rows of {n}"),
        ));
    }
    let rows = x.len() / n;
    let mut values = Vec::with_capacity(rows * k);
    let mut indices = Vec::with_capacity(rows * k);
    // The order is total (value by `total_cmp`, descending, then index ascending), so a partial
    // selection gives exactly the first k of a full sort: for small k an insertion into the
    // k best so far (O(n·k), no allocation per row), else a select-nth then a sort of k.
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    let mut order: Vec<u32> = Vec::new();
    for row in x.data().chunks(n) {
        if k <= TOP_K_INSERTION_MAX {
            best.clear();
            for (i, &v) in row.iter().enumerate() {
                // Later indices lose ties, so a candidate must beat strictly.
                if best.len() == k && v.total_cmp(&best[k - 1].0).is_le() {
                    continue;
                }
                let at = best.partition_point(|&(b, _)| v.total_cmp(&b).is_le());
                best.insert(at, (v, i as u32));
                best.truncate(k);
            }
            values.extend(best.iter().map(|&(v, _)| v));
            indices.extend(best.iter().map(|&(_, i)| i));
        } else {
            let before =
                |&a: &u32, &b: &u32| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b));
            order.clear();
            order.extend(0..n as u32);
            if k < n {
                order.select_nth_unstable_by(k - 1, before);
            }
            order[..k].sort_unstable_by(before);
            for &i in &order[..k] {
                values.push(row[i as usize]);
                indices.push(i);
            }
        }
    }
    let mut shape = x.shape().to_vec();
    *shape.last_mut().unwrap_or(&mut 0) = k; // ok: rank ≥ 1 checked by last_dim
    Ok((Tensor::new(shape, values)?, indices))
}
