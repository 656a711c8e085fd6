//! Element types the collectives move: `f32`, and `bf16` where it halves the bytes.
//!
//! Sums are computed in `f32` for both (a `bf16` partial sum is widened, added in a fixed order,
//! and rounded once), so results are the same on every device and in every run.

use ferrotext_sharding::DType;
use half::bf16;

/// A borrowed buffer of one of the supported element types.
#[derive(Debug)]
#[non_exhaustive]
pub enum Buf<'a> {
    /// `f32` elements.
    F32(&'a [f32]),
    /// `bf16` elements.
    BF16(&'a [bf16]),
}

/// A mutably borrowed buffer of one of the supported element types.
#[derive(Debug)]
#[non_exhaustive]
pub enum BufMut<'a> {
    /// `f32` elements.
    F32(&'a mut [f32]),
    /// `bf16` elements.
    BF16(&'a mut [bf16]),
}

impl Buf<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(b) => b.len(),
            Buf::BF16(b) => b.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl BufMut<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            BufMut::F32(b) => b.len(),
            BufMut::BF16(b) => b.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// An element type the collectives accept. Sealed: `f32` and `bf16`.
pub trait Element: sealed::Sealed + bytemuck::Pod + Default + Send + Sync + 'static {
    /// Its dtype in the sharding layer's terms (for the trace).
    const DTYPE: DType;
    /// Widen to `f32` (exact for both types).
    fn to_f32(self) -> f32;
    /// Narrow from `f32` (round to nearest even for `bf16`).
    fn from_f32(x: f32) -> Self;
    /// View as a [`Buf`].
    fn buf(s: &[Self]) -> Buf<'_>;
    /// View as a [`BufMut`].
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn buf(s: &[f32]) -> Buf<'_> {
        Buf::F32(s)
    }
    fn buf_mut(s: &mut [f32]) -> BufMut<'_> {
        BufMut::F32(s)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn from_f32(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
    fn buf(s: &[bf16]) -> Buf<'_> {
        Buf::BF16(s)
    }
    fn buf_mut(s: &mut [bf16]) -> BufMut<'_> {
        BufMut::BF16(s)
    }
}
