//! Widening one HF tensor's stored bytes into its place in a parameter's f32 buffer, fused with
//! the `[out, in]` → `[in, out]` transpose: one pass over the file bytes, no intermediate copy.
//!
//! Layouts: a stored tensor is row-major little-endian F32, BF16 or F16. A plain part is copied
//! element for element. A transposed part is stored `[C, R]` (HF's `[out, in]`) and becomes the
//! row-major `[R, C]` block `out[r·C + c] = stored[c·R + r]` ([`ferrotext_models::ParamInfo`]'s
//! orientation). Callers split a part into runs of whole output rows, so every call writes one
//! contiguous slice and the calls can run on separate threads.
//!
//! Where the time goes: memory traffic. The transpose is tiled ([`TILE`]² elements): a tile's
//! stored rows are decoded contiguously into a small buffer (vectorised widening), checked for
//! non-finite values there, and written out as contiguous runs of [`TILE`] elements, so both the
//! file bytes and the output are touched in whole cache lines.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

/// The edge of a transpose tile: a 64×64 f32 tile (16 KiB) stays in L1.
pub(super) const TILE: usize = 64;

/// The stored element types a HF tensor may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stored {
    /// IEEE single.
    F32,
    /// bfloat16: the top half of an f32, so widening is exact.
    Bf16,
    /// IEEE half.
    F16,
}

impl Stored {
    /// Bytes per element.
    pub(super) fn size(self) -> usize {
        match self {
            Stored::F32 => 4,
            Stored::Bf16 | Stored::F16 => 2,
        }
    }
}

/// Widens `src` (exactly `dst.len()` stored elements) into `dst`.
pub(super) fn decode(src: &[u8], kind: Stored, dst: &mut [f32]) {
    match kind {
        Stored::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Stored::Bf16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        Stored::F16 => {
            // Through an aligned bit buffer, so `half` can use F16C where the CPU has it.
            let mut bits = [0u16; 256];
            for (d, s) in dst.chunks_mut(bits.len()).zip(src.chunks(2 * bits.len())) {
                let n = d.len();
                for (b, c) in bits[..n].iter_mut().zip(s.chunks_exact(2)) {
                    *b = u16::from_le_bytes([c[0], c[1]]);
                }
                bits[..n]
                    .reinterpret_cast::<half::f16>()
                    .convert_to_f32_slice(d);
            }
        }
    }
}

/// The index of the first non-finite value of `x` (a branch-free scan first: values are almost
/// always finite).
fn first_non_finite(x: &[f32]) -> Option<usize> {
    if x.iter().fold(true, |all, v| all & v.is_finite()) {
        return None;
    }
    x.iter().position(|v| !v.is_finite())
}

/// A non-finite stored value: its flat index in the stored tensor, and the value.
pub(super) type NonFinite = (usize, f32);

/// `dst[i] = stored[first + i]` for the plain part `src` (all of its bytes).
///
/// # Errors
/// The first non-finite value (`dst` is then partly written).
pub(super) fn plain(
    src: &[u8],
    kind: Stored,
    first: usize,
    dst: &mut [f32],
) -> Result<(), NonFinite> {
    const CHUNK: usize = 16 * 1024;
    let size = kind.size();
    for (k, d) in dst.chunks_mut(CHUNK).enumerate() {
        let start = (first + k * CHUNK) * size;
        decode(&src[start..start + d.len() * size], kind, d);
        if let Some(i) = first_non_finite(d) {
            return Err((first + k * CHUNK + i, d[i]));
        }
    }
    Ok(())
}

/// Rows `r0..r0 + dst.len() / cols` of the `[rows, cols]` block whose stored tensor `src` (all
/// of its bytes) is `[cols, rows]`: `dst[(r − r0)·cols + c] = stored[c·rows + r]`.
///
/// # Errors
/// The first non-finite value met, by stored index within a tile (`dst` is then partly
/// written).
pub(super) fn transposed(
    src: &[u8],
    kind: Stored,
    rows: usize,
    cols: usize,
    r0: usize,
    dst: &mut [f32],
) -> Result<(), NonFinite> {
    let size = kind.size();
    let n = dst.len() / cols.max(1);
    let mut tile = [0.0f32; TILE * TILE];
    // Tile (c0, rt): stored rows c0..c0+w, stored columns rt..rt+h; tile[(c − c0)·TILE + (r − rt)].
    for c0 in (0..cols).step_by(TILE) {
        let w = TILE.min(cols - c0);
        for rt in (r0..r0 + n).step_by(TILE) {
            let h = TILE.min(r0 + n - rt);
            for c in 0..w {
                let start = ((c0 + c) * rows + rt) * size;
                let t = &mut tile[c * TILE..c * TILE + h];
                decode(&src[start..start + h * size], kind, t);
                if let Some(i) = first_non_finite(t) {
                    return Err(((c0 + c) * rows + rt + i, t[i]));
                }
            }
            for r in 0..h {
                let out = &mut dst[(rt - r0 + r) * cols + c0..][..w];
                for (c, o) in out.iter_mut().enumerate() {
                    *o = tile[c * TILE + r];
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `values` stored as `kind` bytes.
    fn stored(values: &[f32], kind: Stored) -> Vec<u8> {
        values
            .iter()
            .flat_map(|&x| match kind {
                Stored::F32 => x.to_le_bytes().to_vec(),
                Stored::Bf16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
                Stored::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
            })
            .collect()
    }

    /// What a plain element-by-element widening gives.
    fn widened(values: &[f32], kind: Stored) -> Vec<f32> {
        values
            .iter()
            .map(|&x| match kind {
                Stored::F32 => x,
                Stored::Bf16 => half::bf16::from_f32(x).to_f32(),
                Stored::F16 => half::f16::from_f32(x).to_f32(),
            })
            .collect()
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect()
    }

    #[test]
    fn plain_matches_element_by_element_widening() {
        for kind in [Stored::F32, Stored::Bf16, Stored::F16] {
            let v = values(40_000);
            let src = stored(&v, kind);
            let mut out = vec![0.0; 40_000 - 1000];
            plain(&src, kind, 1000, &mut out).unwrap();
            assert_eq!(out, widened(&v, kind)[1000..], "{kind:?}");
        }
    }

    #[test]
    fn transposed_matches_a_plain_transpose_for_every_row_split() {
        // Sizes that are and are not multiples of the tile, split into uneven row runs.
        for (rows, cols) in [(1, 1), (3, 130), (130, 3), (64, 64), (129, 200), (200, 65)] {
            for kind in [Stored::F32, Stored::Bf16, Stored::F16] {
                let v = values(rows * cols);
                let src = stored(&v, kind);
                let w = widened(&v, kind);
                let want: Vec<f32> = (0..rows * cols)
                    .map(|k| w[(k % cols) * rows + k / cols])
                    .collect();
                let mut out = vec![f32::NAN; rows * cols];
                let mut r0 = 0;
                for part in out.chunks_mut(cols * (rows / 3).max(1)) {
                    transposed(&src, kind, rows, cols, r0, part).unwrap();
                    r0 += part.len() / cols;
                }
                assert_eq!(out, want, "{rows}×{cols} {kind:?}");
            }
        }
    }

    #[test]
    fn non_finite_values_are_found_with_their_stored_index() {
        let mut v = values(300 * 70);
        v[12_345] = f32::INFINITY;
        let src = stored(&v, Stored::Bf16);
        let mut out = vec![0.0; v.len()];
        assert_eq!(
            plain(&src, Stored::Bf16, 0, &mut out),
            Err((12_345, f32::INFINITY))
        );
        let e = transposed(&src, Stored::Bf16, 300, 70, 0, &mut out).unwrap_err();
        assert_eq!(e.0, 12_345);
        v[12_345] = f32::NAN;
        let src = stored(&v, Stored::F32);
        assert_eq!(plain(&src, Stored::F32, 0, &mut out).unwrap_err().0, 12_345);
    }
}
