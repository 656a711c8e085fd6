//! Element types the collectives move: `f32`, and `bf16` where it halves the bytes.
//!
//! Sums are computed in `f32` for both (a `bf16` partial sum is widened, added in a fixed order,
//! and rounded once), so results are the same on every device and in every run.

use ferrotext_sharding::DType;
use half::bf16;

use crate::error::CommError;
use crate::trace::CollectiveKind;

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

/// Refuses a reduction of `f32` values that would travel as anything but `f32` or `bf16` (the
/// element types above): checked before anything moves.
pub(crate) fn check_wire<S: AsRef<str>>(
    kind: CollectiveKind,
    axes: &[S],
    wire: DType,
) -> Result<(), CommError> {
    match wire {
        DType::F32 | DType::BF16 => Ok(()),
        dtype => Err(CommError::WireDType {
            kind,
            axes: axes.iter().map(|a| a.as_ref().to_string()).collect(),
            dtype,
        }),
    }
}

/// `x` rounded to `bf16` (nearest even).
pub(crate) fn narrowed(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// `out` = `x` widened (exact).
pub(crate) fn widen_into(x: &[bf16], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.to_f32();
    }
}

/// `x` rounded to `wire` and widened back: the identity for `f32`, each value rounded once to
/// `bf16` otherwise (what a group of one gives for a reduction as `wire`; [`check_wire`] has
/// refused any other type).
pub(crate) fn round_trip(wire: DType, mut x: Vec<f32>) -> Vec<f32> {
    if wire != DType::F32 {
        for v in &mut x {
            *v = bf16::from_f32(*v).to_f32();
        }
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rounding to nearest even, against the bits written out: 1 + 2⁻⁸ is a tie between 1 and
    /// 1 + 2⁻⁷ and goes to 1 (even); 1 + 3·2⁻⁹ rounds up.
    #[test]
    fn the_round_trip_rounds_to_nearest_even_and_f32_is_the_identity() {
        let x = vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-9), -3.5];
        assert_eq!(
            round_trip(DType::BF16, x.clone()),
            vec![1.0, 1.0 + 2f32.powi(-7), -3.5]
        );
        assert_eq!(round_trip(DType::F32, x.clone()), x);
    }

    #[test]
    fn a_wire_other_than_f32_or_bf16_is_refused_naming_it() {
        assert!(check_wire(CollectiveKind::AllReduce, &["data"], DType::BF16).is_ok());
        let err = check_wire(CollectiveKind::AllReduce, &["data"], DType::F16).unwrap_err();
        assert_eq!(
            err.to_string(),
            "`all_reduce` over axes [\"data\"]: f32 values travel as f32 or bf16, not f16"
        );
    }
}
