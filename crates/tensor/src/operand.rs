//! What every matrix-product kernel takes: strided operands ([`Operand`]), what it does with its
//! destination ([`Store`]), and how an element it reads becomes the `f32` it multiplies
//! ([`Widen`]). The kernels (`blas.rs`, `portable.rs`, `bf16/dpbf16.rs`) all import this file and
//! it imports none of them.

/// An element type a product reads: `f32`, or `bf16` widened exactly to `f32` as it is read.
pub(crate) trait Widen: Copy + Send + Sync + 'static {
    /// The value as an `f32` (exact: every `bf16` is an `f32`).
    fn widen(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for half::bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// One strided operand: element `(i, j)` at `ptr + i·rs + j·cs`.
pub(crate) struct Operand<T = f32> {
    pub ptr: *const T,
    pub rs: isize,
    pub cs: isize,
}

impl<T> Clone for Operand<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Operand<T> {}

/// What a product does with its destination: overwrite it (`dst = a · b`, its contents not
/// read) or add into it (`dst += a · b`, a BLAS's `beta = 1`: the kernel adds each tile of the
/// product as it finishes it, so the sum costs no separate pass over `dst`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Store {
    /// `dst = a · b`.
    Overwrite,
    /// `dst += a · b`.
    Accumulate,
}
