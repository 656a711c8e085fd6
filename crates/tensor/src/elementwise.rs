//! Elementwise kernels: unary maps and binary ops with NumPy broadcasting.
//!
//! Layout: any shape, row-major. Time goes to memory traffic: maps, equal-shape binary ops and
//! `add_assign` are straight loops the compiler vectorises, for AVX-512 where the CPU has it,
//! in fixed blocks on the kernel thread budget; broadcasting goes through a strided gather first.

use crate::error::TensorError;
use crate::fastmath::vectorized;
use crate::parallel::{filled, for_each_chunk, kernel_threads, Work};
use crate::tensor::Tensor;

impl Tensor {
    /// `f` applied to every element, in fixed blocks on the kernel thread budget (each element
    /// computed alike, so the bits do not depend on it).
    pub fn map(&self, f: impl Fn(f32) -> f32 + Sync) -> Tensor {
        let _span =
            ferrotext_profile::span("elementwise").map(|s| s.bytes((8 * self.len()) as f64));
        // SAFETY: every block is visited and `self` is as long as the output, so each block
        // writes all its elements.
        let y = unsafe {
            filled(self.len(), |y| {
                for_each_chunk(y, BLOCK, kernel_threads(), Work::Light, |c, run| {
                    let x = &self.data()[c * BLOCK..];
                    vectorized(
                        #[inline(always)]
                        || {
                            for (o, &x) in run.iter_mut().zip(x) {
                                o.write(f(x));
                            }
                        },
                    );
                })
            })
        };
        let shape = self.shape().to_vec();
        Tensor::new(shape, y).unwrap_or_else(|_| unreachable!("same count")) // ok: length kept
    }

    /// `f(a, b)` elementwise with NumPy broadcasting (shapes aligned at the right; size-1
    /// dimensions stretch). Equal shapes run on the kernel thread budget in fixed blocks, the
    /// output written once (each element computed alike, so the bits do not depend on the
    /// budget); other shapes are broadcast to the common shape first.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when the shapes do not broadcast.
    pub fn zip_with(
        &self,
        other: &Tensor,
        f: impl Fn(f32, f32) -> f32 + Sync,
    ) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("elementwise")
            .map(|s| s.bytes((12 * self.len().max(other.len())) as f64));
        if self.shape() != other.shape() {
            let shape = broadcast_shapes(self.shape(), other.shape())?;
            let a = self.broadcast_to(&shape)?;
            let b = other.broadcast_to(&shape)?;
            return a.zip_with(&b, f);
        }
        // SAFETY: every block is visited and both inputs are as long as the output (equal
        // shapes), so each block writes all its elements.
        let y = unsafe {
            filled(self.len(), |y| {
                for_each_chunk(y, BLOCK, kernel_threads(), Work::Light, |c, run| {
                    let (a, b) = (&self.data()[c * BLOCK..], &other.data()[c * BLOCK..]);
                    vectorized(
                        #[inline(always)]
                        || {
                            for ((o, &a), &b) in run.iter_mut().zip(a).zip(b) {
                                o.write(f(a, b));
                            }
                        },
                    );
                })
            })
        };
        Tensor::new(self.shape().to_vec(), y)
    }

    /// This tensor broadcast (NumPy rules) to `shape`.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when it does not broadcast.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("broadcast")
            .map(|s| s.bytes((4 * (self.len() + shape.iter().product::<usize>())) as f64));
        if self.rank() > shape.len() {
            return Err(TensorError::shape(
                "broadcast_to",
                format!("{:?} has more dimensions than {shape:?}", self.shape()),
            ));
        }
        let dims: Vec<usize> = (shape.len() - self.rank()..shape.len()).collect();
        self.broadcast_in_dim(shape, &dims)
    }

    /// `self + other` (broadcasting).
    ///
    /// # Errors
    /// As [`Tensor::zip_with`].
    pub fn add(&self, other: &Tensor) -> Result<Tensor, TensorError> {
        self.zip_with(other, |a, b| a + b)
    }

    /// `self - other` (broadcasting).
    ///
    /// # Errors
    /// As [`Tensor::zip_with`].
    pub fn sub(&self, other: &Tensor) -> Result<Tensor, TensorError> {
        self.zip_with(other, |a, b| a - b)
    }

    /// `self * other` (broadcasting).
    ///
    /// # Errors
    /// As [`Tensor::zip_with`].
    pub fn mul(&self, other: &Tensor) -> Result<Tensor, TensorError> {
        self.zip_with(other, |a, b| a * b)
    }

    /// `self / other` (broadcasting).
    ///
    /// # Errors
    /// As [`Tensor::zip_with`].
    pub fn div(&self, other: &Tensor) -> Result<Tensor, TensorError> {
        self.zip_with(other, |a, b| a / b)
    }

    /// `self += other` for equal shapes, in place (gradient accumulation).
    ///
    /// # Errors
    /// [`TensorError::Shape`] when the shapes differ.
    pub fn add_assign(&mut self, other: &Tensor) -> Result<(), TensorError> {
        if self.shape() != other.shape() {
            return Err(TensorError::shape(
                "add_assign",
                format!("{:?} += {:?}", self.shape(), other.shape()),
            ));
        }
        add_assign_slice(self.data_mut(), other.data());
        Ok(())
    }

    /// Every element times `k`.
    pub fn scale(&self, k: f32) -> Tensor {
        self.map(|x| x * k)
    }
}

/// Elementwise kernels split their data into blocks of this many elements.
const BLOCK: usize = 4096;

/// The NumPy broadcast of two shapes.
///
/// # Errors
/// [`TensorError::Shape`] when a pair of dimensions differs and neither is 1.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, TensorError> {
    let rank = a.len().max(b.len());
    let at = |s: &[usize], i: usize| (i + s.len()).checked_sub(rank).map_or(1, |j| s[j]);
    (0..rank)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            _ => Err(TensorError::shape(
                "broadcast",
                format!("shapes {a:?} and {b:?} do not broadcast"),
            )),
        })
        .collect()
}

/// `dst[i] += src[i]` for `i < dst.len()` (`src` at least as long), in place, on the kernel
/// budget's threads: the accumulation kernel of [`Tensor::add_assign`], for buffers that are not
/// tensors (a gradient bucket's flat buffer).
pub fn add_assign_slice(dst: &mut [f32], src: &[f32]) {
    let _span = ferrotext_profile::span("elementwise").map(|s| s.bytes((12 * src.len()) as f64));
    for_each_chunk(dst, BLOCK, kernel_threads(), Work::Light, |c, run| {
        let src = &src[c * BLOCK..];
        vectorized(
            #[inline(always)]
            || {
                for (a, &b) in run.iter_mut().zip(src) {
                    *a += b;
                }
            },
        );
    });
}

/// `dst[r][offset..offset + w] += src[r]` for every row `r`, with `dst` in rows of `dst_row`
/// elements and `src` in rows of `w`: a slice's cotangent added into the value it was cut from,
/// in one pass (rows grouped into blocks of about `BLOCK` elements on the kernel budget).
///
/// # Panics
/// When the rows do not fit (`offset + w > dst_row`, or `src` has another number of rows): a
/// bug in the caller.
pub fn add_assign_rows(dst: &mut [f32], dst_row: usize, offset: usize, src: &[f32], w: usize) {
    let _span = ferrotext_profile::span("elementwise").map(|s| s.bytes((12 * src.len()) as f64));
    let rows = dst.len().checked_div(dst_row).unwrap_or(0);
    // A caller's bug otherwise: the shapes are checked where the slice was typed.
    let fits = offset + w <= dst_row && src.len() == rows * w && dst.len() == rows * dst_row;
    assert!(fits, "add_assign_rows: rows that do not fit"); // ok: caller's invariant
    if w == 0 {
        return;
    }
    let per_chunk = (BLOCK / dst_row).max(1);
    for_each_chunk(
        dst,
        per_chunk * dst_row,
        kernel_threads(),
        Work::Light,
        |c, block| {
            let src = &src[c * per_chunk * w..];
            vectorized(
                #[inline(always)]
                || {
                    for (row, part) in block.chunks_mut(dst_row).zip(src.chunks(w)) {
                        for (a, &b) in row[offset..offset + w].iter_mut().zip(part) {
                            *a += b;
                        }
                    }
                },
            );
        },
    );
}

#[cfg(test)]
// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        let a = Tensor::from_fn(&[2, 3], |i| i as f32);
        let b = Tensor::new(vec![3], vec![10., 20., 30.]).unwrap();
        assert_eq!(a.add(&b).unwrap().data(), &[10., 21., 32., 13., 24., 35.]);
        let c = Tensor::new(vec![2, 1], vec![1., 2.]).unwrap();
        assert_eq!(a.mul(&c).unwrap().data(), &[0., 1., 2., 6., 8., 10.]);
        assert_eq!(
            broadcast_shapes(&[4, 1, 3], &[5, 1]).unwrap(),
            vec![4, 5, 3]
        );
        assert!(a.add(&Tensor::zeros(&[2])).is_err());
    }

    /// The threaded maps and arithmetic give the bits of a plain loop, on 1 to 3 threads.
    #[test]
    fn threaded_arithmetic_matches_a_plain_loop() {
        for len in [1usize, 7, 4099, 40_009] {
            let a = Tensor::from_fn(&[len], |i| (i as f32 * 0.37).sin());
            let b = Tensor::from_fn(&[len], |i| 1.5 + (i as f32 * 0.11).cos());
            for threads in [1, 2, 3] {
                crate::set_kernel_threads(threads);
                let plain = |f: fn(f32, f32) -> f32| -> Vec<f32> {
                    a.data()
                        .iter()
                        .zip(b.data())
                        .map(|(&x, &y)| f(x, y))
                        .collect()
                };
                assert_eq!(a.add(&b).unwrap().data(), plain(|x, y| x + y));
                assert_eq!(a.sub(&b).unwrap().data(), plain(|x, y| x - y));
                assert_eq!(a.mul(&b).unwrap().data(), plain(|x, y| x * y));
                assert_eq!(a.div(&b).unwrap().data(), plain(|x, y| x / y));
                assert_eq!(a.scale(0.3).data(), plain(|x, _| x * 0.3));
                assert_eq!(a.zip_with(&b, f32::max).unwrap().data(), plain(f32::max));
                assert_eq!(a.map(f32::exp).data(), plain(|x, _| x.exp()));
                assert_eq!(
                    a.map(|x| 1.0 / (1.0 + x * x).sqrt()).data(),
                    plain(|x, _| 1.0 / (1.0 + x * x).sqrt())
                );
                let mut c = a.clone();
                c.add_assign(&b).unwrap();
                assert_eq!(c.data(), plain(|x, y| x + y));
            }
        }
        crate::set_kernel_threads(1);
    }

    #[test]
    fn unary_and_in_place() {
        let mut a = Tensor::new(vec![2], vec![1., -2.]).unwrap();
        assert_eq!(a.map(f32::abs).data(), &[1., 2.]);
        a.add_assign(&Tensor::new(vec![2], vec![1., 1.]).unwrap())
            .unwrap();
        assert_eq!(a.data(), &[2., -1.]);
        assert_eq!(a.scale(2.).data(), &[4., -2.]);
    }

    #[test]
    fn add_assign_rows_adds_each_row_into_its_window_only() {
        for (rows, dst_row, offset, w) in
            [(3, 5, 1, 2), (1000, 40, 8, 32), (7, 4, 0, 4), (2, 3, 3, 0)]
        {
            let dst0: Vec<f32> = (0..rows * dst_row).map(|i| i as f32 * 0.5).collect();
            let src: Vec<f32> = (0..rows * w).map(|i| 100.0 + i as f32).collect();
            let mut want = dst0.clone();
            for r in 0..rows {
                for j in 0..w {
                    want[r * dst_row + offset + j] += src[r * w + j];
                }
            }
            for threads in [1, 2] {
                let mut dst = dst0.clone();
                crate::parallel::with_kernel_pool(threads, "t", 1 << 20, || {
                    add_assign_rows(&mut dst, dst_row, offset, &src, w)
                });
                assert_eq!(dst, want, "{rows}×{dst_row} at {offset}+{w} on {threads}");
            }
        }
    }
}
