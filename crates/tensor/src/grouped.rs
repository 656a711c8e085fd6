//! Grouped (ragged) matrix products: the rows of `x` come in consecutive groups, and group `g`
//! multiplies expert matrix `w[g]` — the dropless mixture-of-experts product after tokens are
//! sorted by expert. Each group is one matrix product on views of the rows and the expert's
//! matrix (no copies; the same kernel call, so the same bits, as `dot_general` on copies);
//! empty groups cost nothing. Rows after the last group are padding (fixed-size exchange
//! buffers): their output is zero.
//!
//! Also the row gathers that sort and unsort token copies, where [`PAD_ROW`] stands for a zero
//! row (padding of a fixed-size buffer).

use crate::error::TensorError;
use std::mem::MaybeUninit;

use crate::fastmath::vectorized;
use crate::matmul::{gemm_views_accumulate, gemm_views_uninit, MatView};
use crate::parallel::filled;
use crate::tensor::{rows_filled, Tensor};

/// A row index meaning "a zero row" in [`take_rows`] (and skipped by [`scatter_rows`]).
pub const PAD_ROW: u32 = u32::MAX;

/// Rows `rows[i]` of `x` along dim 0 (a zero row for [`PAD_ROW`]).
///
/// # Errors
/// A rank-0 `x` or an index past its rows.
pub fn take_rows(x: &Tensor, rows: &[u32]) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("take_rows")
        .map(|s| s.bytes((8 * rows.len() * x.shape().last().copied().unwrap_or(0)) as f64));
    let (&n, rest) = x
        .shape()
        .split_first()
        .ok_or_else(|| TensorError::shape("take_rows", "a scalar has no rows".into()))?;
    if let Some(bad) = rows.iter().find(|&&r| r != PAD_ROW && r as usize >= n) {
        return Err(TensorError::shape("take_rows", format!("row {bad} of {n}")));
    }
    let width: usize = rest.iter().product();
    // SAFETY: each row is written whole: a copy of a row of `x`, or zeros.
    let data = unsafe {
        rows_filled(rows.len(), width, |i, out| match rows[i] {
            PAD_ROW => out.iter_mut().for_each(|o| {
                o.write(0.0);
            }),
            r => {
                let start = r as usize * width;
                for (o, &v) in out.iter_mut().zip(&x.data()[start..start + width]) {
                    o.write(v);
                }
            }
        })
    };
    let mut shape = x.shape().to_vec();
    shape[0] = rows.len();
    Tensor::new(shape, data)
}

/// The transpose of [`take_rows`]: zeros of `shape` with row `i` of `src` added into row
/// `rows[i]` ([`PAD_ROW`] rows dropped).
///
/// # Errors
/// `src` not `[rows.len(), shape[1..]]`, or an index past `shape[0]`.
pub fn scatter_rows(shape: &[usize], rows: &[u32], src: &Tensor) -> Result<Tensor, TensorError> {
    let _span = ferrotext_profile::span("scatter_rows")
        .map(|s| s.bytes((4 * (shape.iter().product::<usize>() + 2 * src.len())) as f64));
    let n = shape.first().copied().unwrap_or(0);
    let width: usize = shape.iter().skip(1).product();
    if src.len() != rows.len() * width || rows.iter().any(|&r| r != PAD_ROW && r as usize >= n) {
        return Err(TensorError::shape(
            "scatter_rows",
            format!(
                "src {:?} with {} rows into {shape:?}",
                src.shape(),
                rows.len()
            ),
        ));
    }
    let mut out = Tensor::zeros(shape);
    // In index order (a row may be a target more than once); each row's add is one vector loop.
    let data = out.data_mut();
    vectorized(
        #[inline(always)]
        || {
            for (i, &r) in rows.iter().enumerate() {
                if r != PAD_ROW {
                    let dst = &mut data[r as usize * width..(r as usize + 1) * width];
                    for (d, &v) in dst.iter_mut().zip(&src.data()[i * width..(i + 1) * width]) {
                        *d += v;
                    }
                }
            }
        },
    );
    Ok(out)
}

fn check(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
) -> Result<(usize, usize, usize), TensorError> {
    let (&[n, d], &[e, wd, f]) = (x.shape(), w.shape()) else {
        return Err(TensorError::shape(
            op,
            format!(
                "x must be [rows, d] and w [groups, d, f], got {:?} and {:?}",
                x.shape(),
                w.shape()
            ),
        ));
    };
    if wd != d || group_sizes.len() != e || group_sizes.iter().sum::<usize>() > n {
        return Err(TensorError::shape(
            op,
            format!(
                "x {:?}, w {:?}: needs w's d = x's d and {e} group sizes summing to at most {n}, got {group_sizes:?}",
                x.shape(),
                w.shape()
            ),
        ));
    }
    Ok((d, f, e))
}

/// `y[rows of group g] = x[rows of group g] · w[g]`: `x` is `[rows, d]` with its rows in
/// `group_sizes.len()` consecutive groups (rows after them are padding, `y` zero there), `w` is
/// `[groups, d, f]`, `y` is `[rows, f]`.
///
/// # Errors
/// Shapes that do not fit, or group sizes that do not sum to the rows.
pub fn grouped_matmul(
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
    threads: usize,
) -> Result<Tensor, TensorError> {
    let (d, f, _) = check("grouped_matmul", x, w, group_sizes)?;
    let rows: usize = group_sizes.iter().sum();
    let _span = ferrotext_profile::span("grouped_matmul").map(|s| {
        s.flops(2.0 * (rows * d * f) as f64)
            .bytes(4.0 * (rows * (d + f) + w.len()) as f64)
            .shapes(|| format!("{:?} x {:?}", x.shape(), w.shape()))
    });
    let n = x.shape()[0];
    // SAFETY: each group's rows are written whole by its product, and the padding rows after
    // the groups (`rows..n`) are zero-filled: every element is written.
    let y = unsafe {
        filled(n * f, |y| {
            let mut row = 0;
            for (g, &size) in group_sizes.iter().enumerate() {
                if size > 0 {
                    // y_g [size, f] = x_g [size, d] · w[g] [d, f], all views into the inputs.
                    let xg = view(&x.data()[row * d..(row + size) * d], size, d, d, 1);
                    let wg = view(&w.data()[g * d * f..(g + 1) * d * f], d, f, f, 1);
                    gemm_views_uninit(&mut y[row * f..(row + size) * f], xg, wg, threads);
                }
                row += size;
            }
            y[rows * f..].fill(MaybeUninit::new(0.0));
        })
    };
    Tensor::new(vec![x.shape()[0], f], y)
}

fn view(data: &[f32], rows: usize, cols: usize, rs: usize, cs: usize) -> MatView<'_> {
    MatView {
        data,
        rows,
        cols,
        rs,
        cs,
    }
}

/// The cotangents of [`grouped_matmul`]: `dx` (`[rows, d]`, group `g` = `dy_g · w[g]ᵀ`) and
/// `dw` (`[groups, d, f]`, `dw[g] = x_gᵀ · dy_g`, zero for empty groups).
///
/// # Errors
/// As [`grouped_matmul`], or a `dy` that is not `[rows, f]`.
pub fn grouped_matmul_backward(
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
    dy: &Tensor,
    threads: usize,
) -> Result<(Tensor, Tensor), TensorError> {
    let dims = backward_dims("grouped_matmul_backward", x, w, group_sizes, dy)?;
    let _span = backward_span(x, w, group_sizes, dims, 2);
    let dx = dx_of(w, group_sizes, dy, dims, threads)?;
    let (_, d, f, e) = dims;
    let mut dw: Vec<f32> = Vec::with_capacity(e * d * f);
    let dw_out = &mut dw.spare_capacity_mut()[..e * d * f];
    let mut row = 0;
    for (g, &size) in group_sizes.iter().enumerate() {
        let dw_g = &mut dw_out[g * d * f..(g + 1) * d * f];
        if size == 0 {
            dw_g.fill(MaybeUninit::new(0.0));
            continue;
        }
        let (xgt, dyg) = dw_operands(x, dy, row, size, d, f);
        gemm_views_uninit(dw_g, xgt, dyg, threads);
        row += size;
    }
    // SAFETY: every group's block of `dw` was written by its product, an empty group's block
    // zero-filled: all elements are initialised.
    unsafe { dw.set_len(e * d * f) };
    Ok((dx, Tensor::new(vec![e, d, f], dw)?))
}

/// The `dx` cotangent of [`grouped_matmul`] alone (see [`grouped_matmul_backward`]), for a
/// backward whose `dw` goes elsewhere ([`grouped_matmul_backward_dw_into`]) or is not needed.
///
/// # Errors
/// As [`grouped_matmul_backward`].
pub fn grouped_matmul_backward_dx(
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
    dy: &Tensor,
    threads: usize,
) -> Result<Tensor, TensorError> {
    let dims = backward_dims("grouped_matmul_backward", x, w, group_sizes, dy)?;
    let _span = backward_span(x, w, group_sizes, dims, 1);
    dx_of(w, group_sizes, dy, dims, threads)
}

/// `dw += ` the `dw` cotangent of [`grouped_matmul`] (`[groups, d, f]`, see
/// [`grouped_matmul_backward`]), with `dw` held in `parts` of equal length, in order (a
/// reduce-scatter bucket keeps chunk `j` of a value in its segment `j`): each group's product
/// is added into its block by the kernel (BLAS `beta = 1`), so an accumulator takes expert
/// gradients without them being stored first; an empty group adds nothing. Returns `false`,
/// having touched nothing, when the parts are unequal or a part does not hold whole groups.
///
/// # Errors
/// As [`grouped_matmul_backward`], or parts that do not add up to `dw`'s size.
pub fn grouped_matmul_backward_dw_into(
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
    dy: &Tensor,
    threads: usize,
    parts: &mut [&mut [f32]],
) -> Result<bool, TensorError> {
    let dims = backward_dims("grouped_matmul_backward", x, w, group_sizes, dy)?;
    let (_, d, f, e) = dims;
    let held: usize = parts.iter().map(|p| p.len()).sum();
    if held != e * d * f {
        return Err(TensorError::shape(
            "grouped_matmul_backward",
            format!("dw of {held} elements for [{e}, {d}, {f}]"),
        ));
    }
    let block = d * f;
    let part = parts.first().map_or(0, |p| p.len());
    if block == 0 || part == 0 {
        // Nothing to add (no elements in dw).
        return Ok(true);
    }
    if !part.is_multiple_of(block) || parts.iter().any(|p| p.len() != part) {
        return Ok(false);
    }
    let _span = backward_span(x, w, group_sizes, dims, 1);
    let per_part = part / block;
    let mut row = 0;
    for (g, &size) in group_sizes.iter().enumerate() {
        if size == 0 {
            continue;
        }
        let at = (g % per_part) * block;
        let dw_g = &mut parts[g / per_part][at..at + block];
        let (xgt, dyg) = dw_operands(x, dy, row, size, d, f);
        gemm_views_accumulate(dw_g, xgt, dyg, threads);
        row += size;
    }
    Ok(true)
}

/// `(n, d, f, groups)` of a grouped product's backward, checked (`dy` must be `[n, f]`).
fn backward_dims(
    op: &'static str,
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
    dy: &Tensor,
) -> Result<(usize, usize, usize, usize), TensorError> {
    let (d, f, e) = check(op, x, w, group_sizes)?;
    let n = x.shape()[0];
    if dy.shape() != [n, f] {
        return Err(TensorError::shape(
            op,
            format!("dy must be [{n}, {f}], got {:?}", dy.shape()),
        ));
    }
    Ok((n, d, f, e))
}

/// The profiler's span for `products` of the backward's two (dx = dy·wᵀ, dw = xᵀ·dy) over the
/// groups' rows.
fn backward_span(
    x: &Tensor,
    w: &Tensor,
    group_sizes: &[usize],
    (_, d, f, _): (usize, usize, usize, usize),
    products: usize,
) -> Option<ferrotext_profile::Span> {
    let rows: usize = group_sizes.iter().sum();
    ferrotext_profile::span("grouped_matmul_backward").map(|s| {
        s.flops(2.0 * products as f64 * (rows * d * f) as f64)
            .bytes(4.0 * (2 * rows * (d + f) + 2 * w.len()) as f64)
            .shapes(|| format!("{:?} x {:?}", x.shape(), w.shape()))
    })
}

/// `dx` (`[n, d]`): group `g`'s rows are `dy_g · w[g]ᵀ`, the padding rows zero.
fn dx_of(
    w: &Tensor,
    group_sizes: &[usize],
    dy: &Tensor,
    (n, d, f, _): (usize, usize, usize, usize),
    threads: usize,
) -> Result<Tensor, TensorError> {
    let rows: usize = group_sizes.iter().sum();
    let mut dx: Vec<f32> = Vec::with_capacity(n * d);
    let dx_out = &mut dx.spare_capacity_mut()[..n * d];
    let mut row = 0;
    for (g, &size) in group_sizes.iter().enumerate() {
        if size == 0 {
            continue;
        }
        let dys = &dy.data()[row * f..(row + size) * f];
        let ws = &w.data()[g * d * f..(g + 1) * d * f];
        // dx_g [size, d] = dy_g [size, f] · w[g]ᵀ ([f, d]: a transposed view)
        let (dyg, wgt) = (view(dys, size, f, f, 1), view(ws, f, d, 1, f));
        gemm_views_uninit(&mut dx_out[row * d..(row + size) * d], dyg, wgt, threads);
        row += size;
    }
    dx_out[rows * d..].fill(MaybeUninit::new(0.0));
    // SAFETY: every group's rows of `dx` were written by its product and the padding rows
    // zero-filled: all elements are initialised.
    unsafe { dx.set_len(n * d) };
    Tensor::new(vec![n, d], dx)
}

/// Group `g`'s operands of `dw[g] = x_gᵀ · dy_g` (`size` rows from `row`): `x_gᵀ` (`[d, size]`,
/// a transposed view) and `dy_g` (`[size, f]`).
fn dw_operands<'a>(
    x: &'a Tensor,
    dy: &'a Tensor,
    row: usize,
    size: usize,
    d: usize,
    f: usize,
) -> (MatView<'a>, MatView<'a>) {
    let xs = &x.data()[row * d..(row + size) * d];
    let dys = &dy.data()[row * f..(row + size) * f];
    (view(xs, d, size, 1, d), view(dys, size, f, f, 1))
}

#[cfg(test)]
// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn t(shape: &[usize], seed: usize) -> Tensor {
        Tensor::from_fn(shape, |i| (((i * 7 + seed * 13) % 17) as f32 - 8.0) * 0.125)
    }

    /// Row by row against a plain triple loop, including an empty group.
    #[test]
    fn each_group_uses_its_own_matrix() {
        let (x, w, sizes) = (t(&[6, 3], 1), t(&[3, 3, 2], 2), [2usize, 0, 4]);
        let y = grouped_matmul(&x, &w, &sizes, 1).unwrap();
        let groups = [0, 0, 2, 2, 2, 2];
        for (r, &group) in groups.iter().enumerate() {
            for c in 0..2 {
                let want: f32 = (0..3)
                    .map(|k| x.data()[r * 3 + k] * w.data()[group * 6 + k * 2 + c])
                    .sum();
                assert!((y.data()[r * 2 + c] - want).abs() < 1e-6);
            }
        }
        assert!(grouped_matmul(&x, &w, &[2, 2, 3], 1).is_err());
        // Padding rows after the groups come out zero.
        let padded = grouped_matmul(&x, &w, &[2, 0, 3], 1).unwrap();
        assert_eq!(&padded.data()[..10], &y.data()[..10]);
        assert_eq!(&padded.data()[10..], &[0.0, 0.0]);
    }

    /// The in-place views give the bits of `dot_general` on copied slices (the former code).
    #[test]
    fn views_match_products_of_copies_bitwise() {
        use crate::matmul::{dot_general, DotDims};
        let (x, w, sizes) = (t(&[41, 13], 1), t(&[3, 13, 7], 2), [17usize, 0, 19]);
        let dy = t(&[41, 7], 3);
        let y = grouped_matmul(&x, &w, &sizes, 1).unwrap();
        let (dx, dw) = grouped_matmul_backward(&x, &w, &sizes, &dy, 1).unwrap();
        let (wt, xt) = (
            DotDims {
                lhs_contracting: vec![1],
                rhs_contracting: vec![1],
                ..DotDims::default()
            },
            DotDims {
                lhs_contracting: vec![0],
                rhs_contracting: vec![0],
                ..DotDims::default()
            },
        );
        let mut row = 0;
        for (g, &size) in sizes.iter().enumerate() {
            let xg = x.slice_dim(0, row..row + size).unwrap();
            let dyg = dy.slice_dim(0, row..row + size).unwrap();
            let wg = w.slice_dim(0, g..g + 1).unwrap().reshape(&[13, 7]).unwrap();
            let want = dot_general(&xg, &wg, &DotDims::matmul(2), 1).unwrap();
            assert_eq!(&y.data()[row * 7..(row + size) * 7], want.data());
            let want = dot_general(&dyg, &wg, &wt, 1).unwrap();
            assert_eq!(&dx.data()[row * 13..(row + size) * 13], want.data());
            let want = if size > 0 {
                dot_general(&xg, &dyg, &xt, 1).unwrap().into_data()
            } else {
                vec![0.0; 13 * 7]
            };
            assert_eq!(&dw.data()[g * 91..(g + 1) * 91], want.as_slice());
            row += size;
        }
        assert_eq!(&y.data()[36 * 7..], &[0.0; 35], "padding rows are zero");
    }

    #[test]
    fn take_rows_and_scatter_rows_are_transposes() {
        let x = t(&[3, 2], 7);
        let rows = [2, PAD_ROW, 0, 2];
        let y = take_rows(&x, &rows).unwrap();
        assert_eq!(&y.data()[..2], &x.data()[4..6]);
        assert_eq!(&y.data()[2..4], &[0.0, 0.0]);
        let ct = t(&[4, 2], 8);
        let back = scatter_rows(&[3, 2], &rows, &ct).unwrap();
        // <take(x), ct> = <x, scatter(ct)>
        let lhs: f32 = y.data().iter().zip(ct.data()).map(|(a, b)| a * b).sum();
        let rhs: f32 = x.data().iter().zip(back.data()).map(|(a, b)| a * b).sum();
        assert!((lhs - rhs).abs() < 1e-5);
        assert!(take_rows(&x, &[3]).is_err());
    }

    /// A gather big enough to be split gives the rows it names (zeros for padding), on 1 to 3
    /// kernel threads.
    #[test]
    fn take_rows_gives_the_named_rows_on_any_budget() {
        let x = t(&[300, 64], 9);
        let rows: Vec<u32> = (0..1600u32)
            .map(|i| if i % 7 == 3 { PAD_ROW } else { (i * 37) % 300 })
            .collect();
        let want: Vec<f32> = rows
            .iter()
            .flat_map(|&r| match r {
                PAD_ROW => vec![0.0; 64],
                r => x.data()[r as usize * 64..][..64].to_vec(),
            })
            .collect();
        for threads in [1, 2, 3] {
            let y = crate::parallel::with_kernel_pool(threads, "t", 1 << 20, || {
                take_rows(&x, &rows).unwrap()
            });
            assert_eq!(y.shape(), &[1600, 64]);
            assert_eq!(y.data(), want.as_slice(), "{threads} threads");
        }
    }

    /// The backward against finite differences of `sum(y ⊙ dy)`, in f64.
    #[test]
    fn backward_matches_finite_differences() {
        let (x, w, sizes) = (t(&[5, 3], 3), t(&[2, 3, 4], 4), [3usize, 2]);
        let dy = t(&[5, 4], 5);
        let (dx, dw) = grouped_matmul_backward(&x, &w, &sizes, &dy, 1).unwrap();
        let objective = |x: &Tensor, w: &Tensor| -> f64 {
            let y = grouped_matmul(x, w, &sizes, 1).unwrap();
            y.data()
                .iter()
                .zip(dy.data())
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum()
        };
        let h = 1e-2f32;
        for i in 0..x.len() {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp.data_mut()[i] += h;
            xm.data_mut()[i] -= h;
            let fd = (objective(&xp, &w) - objective(&xm, &w)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(dx.data()[i])).abs() < 1e-3, "dx[{i}]");
        }
        for i in 0..w.len() {
            let (mut wp, mut wm) = (w.clone(), w.clone());
            wp.data_mut()[i] += h;
            wm.data_mut()[i] -= h;
            let fd = (objective(&x, &wp) - objective(&x, &wm)) / (2.0 * f64::from(h));
            assert!((fd - f64::from(dw.data()[i])).abs() < 1e-3, "dw[{i}]");
        }
    }

    /// `dx` alone is the backward's `dx` to the bit; `dw` added into an accumulator — whole, or
    /// in parts of whole groups — is the start plus the backward's `dw` (an empty group adds
    /// nothing); parts that cut a group or are unequal are left untouched (`false`).
    #[test]
    fn dx_alone_and_dw_into_parts_match_the_backward() {
        let (x, w, sizes) = (t(&[40, 24], 6), t(&[4, 24, 16], 7), [9usize, 0, 20, 7]);
        let dy = t(&[40, 16], 8);
        let (dx, dw) = grouped_matmul_backward(&x, &w, &sizes, &dy, 1).unwrap();
        let alone = grouped_matmul_backward_dx(&x, &w, &sizes, &dy, 1).unwrap();
        assert_eq!(alone, dx, "dx alone");
        let start: Vec<f32> = (0..dw.len()).map(|i| (i as f32 * 0.13).cos()).collect();
        for p in [1, 2, 4] {
            for threads in [1, 2] {
                let mut acc = start.clone();
                let mut parts: Vec<&mut [f32]> = acc.chunks_mut(dw.len() / p).collect();
                assert!(
                    grouped_matmul_backward_dw_into(&x, &w, &sizes, &dy, threads, &mut parts)
                        .unwrap()
                );
                for (i, ((a, s), g)) in acc.iter().zip(&start).zip(dw.data()).enumerate() {
                    assert!(
                        (a - (s + g)).abs() <= 1e-5 * (1.0 + g.abs()),
                        "{p} parts, [{i}]"
                    );
                }
                let empty = 24 * 16..2 * 24 * 16;
                assert_eq!(
                    &acc[empty.clone()],
                    &start[empty],
                    "an empty group adds nothing"
                );
            }
        }
        // 3 parts of 512 elements cut the groups of 384; unequal parts likewise.
        let mut acc = start.clone();
        let mut cut: Vec<&mut [f32]> = acc.chunks_mut(512).collect();
        assert!(!grouped_matmul_backward_dw_into(&x, &w, &sizes, &dy, 1, &mut cut).unwrap());
        let (a, b) = acc.split_at_mut(384);
        assert!(!grouped_matmul_backward_dw_into(&x, &w, &sizes, &dy, 1, &mut [a, b]).unwrap());
        assert_eq!(acc, start, "untouched");
        let mut short = vec![0.0f32; 10];
        assert!(
            grouped_matmul_backward_dw_into(&x, &w, &sizes, &dy, 1, &mut [&mut short]).is_err()
        );
    }
}
