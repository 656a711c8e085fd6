//! Reductions over chosen axes.
//!
//! Sums accumulate in f64 in index order over the reduced axes and round to f32 once, so the
//! same input always gives the same bits and a long sum (a gradient norm over millions of
//! elements) keeps f32's precision instead of losing it to rounding at every add.

use crate::error::TensorError;
use crate::tensor::Tensor;

impl Tensor {
    /// Sum over `axes` (removed from the shape; any order, no repeats).
    ///
    /// # Errors
    /// [`TensorError::Shape`] for an axis out of range or repeated.
    pub fn sum_axes(&self, axes: &[usize]) -> Result<Tensor, TensorError> {
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
        // Move kept axes first, reduced axes last, then sum contiguous runs.
        let perm: Vec<usize> = (0..rank)
            .filter(|&d| !reduced[d])
            .chain((0..rank).filter(|&d| reduced[d]))
            .collect();
        let moved = self.transpose(&perm)?;
        let out_shape: Vec<usize> = (0..rank)
            .filter(|&d| !reduced[d])
            .map(|d| self.shape()[d])
            .collect();
        let run: usize = axes.iter().map(|&a| self.shape()[a]).product();
        let data = if run == 0 {
            vec![0.0; out_shape.iter().product()]
        } else {
            moved
                .data()
                .chunks(run)
                .map(|c| sum_f64(c) as f32)
                .collect()
        };
        Tensor::new(out_shape, data)
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
