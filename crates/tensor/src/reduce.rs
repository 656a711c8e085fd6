//! Reductions over chosen axes.
//!
//! Sums accumulate in f64 in index order over the reduced axes and round to f32 once, so the
//! same input always gives the same bits and a long sum (a gradient norm over millions of
//! elements) keeps f32's precision instead of losing it to rounding at every add.

use crate::error::TensorError;
use crate::fastmath::vectorized;
use crate::tensor::Tensor;

impl Tensor {
    /// Sum over `axes` (removed from the shape; any order, no repeats).
    ///
    /// # Errors
    /// [`TensorError::Shape`] for an axis out of range or repeated.
    pub fn sum_axes(&self, axes: &[usize]) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("sum_axes").map(|s| s.bytes((4 * self.len()) as f64));
        let rank = self.rank();
        let mut reduced = vec![false; rank];
        for &a in axes {
            if a >= rank || std::mem::replace(&mut reduced[a], true) {
                return Err(TensorError::shape(
                    "sum_axes",
                    format!("axes {axes:?} for rank {rank}"),
                ));
            }
        }
        let out_shape: Vec<usize> = (0..rank)
            .filter(|&d| !reduced[d])
            .map(|d| self.shape()[d])
            .collect();
        let run: usize = axes.iter().map(|&a| self.shape()[a]).product();
        if rank == 0 {
            return Ok(self.clone());
        }
        if run == 0 || self.is_empty() {
            return Tensor::new(out_shape.clone(), vec![0.0; out_shape.iter().product()]);
        }
        let acc = self.sum_streaming(&reduced, out_shape.iter().product());
        Tensor::new(out_shape, acc.into_iter().map(|v| v as f32).collect())
    }

    /// One pass over the data in memory order, adding each element into its output's f64
    /// accumulator (no transpose copy). For a fixed output element the reduced indices arrive in
    /// row-major order, so each sum runs in index order over the reduced axes, from -0.0 as
    /// `Iterator::sum` does: the same bits as summing each output's elements in a list.
    fn sum_streaming(&self, reduced: &[bool], out_len: usize) -> Vec<f64> {
        let shape = self.shape();
        let rank = shape.len();
        // The output stride of each input dim (0 for reduced dims).
        let mut out_stride = vec![0usize; rank];
        let mut s = 1;
        for d in (0..rank).rev() {
            if !reduced[d] {
                out_stride[d] = s;
                s *= shape[d];
            }
        }
        let mut acc = vec![-0.0f64; out_len];
        let inner = shape[rank - 1];
        let inner_kept = !reduced[rank - 1];
        let mut idx = vec![0usize; rank - 1];
        // The output offset of the current input row.
        let mut o = 0usize;
        // Compiled for AVX-512 where the CPU has it: a kept inner dimension adds a whole row of
        // accumulators at once (each still gets its terms in index order).
        vectorized(
            #[inline(always)]
            || {
                for row in self.data().chunks_exact(inner) {
                    if inner_kept {
                        for (a, &x) in acc[o..o + inner].iter_mut().zip(row) {
                            *a += f64::from(x);
                        }
                    } else {
                        let a = &mut acc[o];
                        for &x in row {
                            *a += f64::from(x);
                        }
                    }
                    // Next input row: an odometer over the outer dims.
                    for d in (0..rank - 1).rev() {
                        idx[d] += 1;
                        o += out_stride[d];
                        if idx[d] < shape[d] {
                            break;
                        }
                        o -= out_stride[d] * shape[d];
                        idx[d] = 0;
                    }
                }
            },
        );
        acc
    }

    /// Sum of every element (rank-0 result).
    pub fn sum_all(&self) -> Tensor {
        Tensor::scalar(sum_f64(self.data()) as f32)
    }
}

/// Σ `xs` accumulated in f64, in index order.
fn sum_f64(xs: &[f32]) -> f64 {
    xs.iter().map(|&x| f64::from(x)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_match_hand_computed_values() {
        let t = Tensor::from_fn(&[2, 3, 2], |i| i as f32);
        assert_eq!(t.sum_axes(&[1]).unwrap().data(), &[6., 9., 24., 27.]);
        assert_eq!(t.sum_axes(&[0, 2]).unwrap().data(), &[14., 22., 30.]);
        assert_eq!(t.sum_axes(&[2, 0, 1]).unwrap().data(), &[66.]);
        assert_eq!(t.sum_all().data(), &[66.]);
        assert!(t.sum_axes(&[1, 1]).is_err());
    }

    /// The streaming sum against summing each output's elements, gathered in index order, on
    /// odd shapes and every subset of axes: the same bits.
    #[test]
    fn streaming_sums_match_gathered_sums_bitwise() {
        for shape in [
            vec![1],
            vec![7],
            vec![3, 1, 5],
            vec![2, 3, 4, 5],
            vec![5, 2, 3, 2, 7],
        ] {
            let t = Tensor::from_fn(&shape, |i| ((i * 7919 % 1013) as f32 - 500.0) * 0.013);
            let rank = shape.len();
            for mask in 0..(1u32 << rank) {
                let axes: Vec<usize> = (0..rank).filter(|&d| mask >> d & 1 == 1).collect();
                let kept: Vec<usize> = (0..rank).filter(|&d| mask >> d & 1 == 0).collect();
                let got = t.sum_axes(&axes).unwrap();
                let perm: Vec<usize> = kept.iter().chain(&axes).copied().collect();
                let moved = t.transpose(&perm).unwrap();
                let run: usize = axes.iter().map(|&a| shape[a]).product();
                let want: Vec<f32> = moved
                    .data()
                    .chunks(run)
                    .map(|c| c.iter().map(|&x| f64::from(x)).sum::<f64>() as f32)
                    .collect();
                assert_eq!(got.data(), want, "{shape:?} over {axes:?}");
                let want_shape: Vec<usize> = kept.iter().map(|&d| shape[d]).collect();
                assert_eq!(got.shape(), want_shape);
            }
        }
        assert_eq!(
            Tensor::scalar(2.5).sum_axes(&[]).unwrap(),
            Tensor::scalar(2.5)
        );
        assert_eq!(
            Tensor::zeros(&[2, 0, 3]).sum_axes(&[1]).unwrap().data(),
            &[0.0; 6]
        );
        assert_eq!(Tensor::zeros(&[0, 3]).sum_axes(&[1]).unwrap().shape(), &[0]);
    }

    #[test]
    fn long_sums_keep_f32_precision() {
        // 4M copies of 0.1: a left-to-right f32 sum drifts by ~2% (each add rounds at the
        // running total's magnitude); the f64 accumulator is within one f32 rounding.
        let n = 1usize << 22;
        let t = Tensor::full(&[n], 0.1);
        let exact = n as f64 * f64::from(0.1f32);
        let all = f64::from(t.sum_all().data()[0]);
        let axes = f64::from(t.sum_axes(&[0]).unwrap().data()[0]);
        for got in [all, axes] {
            assert!(((got - exact) / exact).abs() < 1e-7, "{got} vs {exact}");
        }
    }
}
