//! Row and elementwise kernels on bf16 activations: each reads bf16, computes in `f32` with the
//! `f32` kernel's own code, and rounds what it writes.
//!
//! Invariant: the output is, bit for bit, [`round_bf16`](super::round_bf16) of the `f32` kernel
//! on the widened inputs (statistics a backward keeps, such as RMSNorm's inverse RMS, stay
//! `f32`). Inputs are widened a chunk of whole rows at a time (about `nn`'s block of 4096
//! elements; a causal softmax's whole `[Tq, Tk]` blocks) into a scratch `f32` tensor, so no
//! `f32` copy of a whole activation is ever made; the `f32` kernels compute each row alike in
//! any chunk, so chunking does not change a bit. SwiGLU and GeGLU, elementwise, call the `f32`
//! kernel's element function (`nn::swiglu_value`, `nn::geglu_grads`, …) on each widened element into a
//! block of 1024 `f32` that is rounded as a whole (`super::rounded_blocks`), as `zip_bf16` does
//! for the residual add. Chunks run on the kernel thread budget.

use std::mem::MaybeUninit;
use std::sync::Mutex;

use half::bf16;

use super::{
    round_into, rounded_blocks, rounded_blocks2, widen_bf16, widen_slice, zip_bf16, Bf16Tensor,
};
use crate::error::TensorError;
use crate::fastmath::vectorized;
use crate::nn::{
    causal_softmax, geglu_grads, geglu_value, rms_norm_backward_slices, rms_norm_slices, silu,
    softmax_backward_scaled, softmax_last, swiglu_grads, swiglu_value, GluActivation, RowOut,
};
#[cfg(doc)]
use crate::nn::{rms_norm, rms_norm_backward};
use crate::parallel::{filled, for_each_chunk, for_each_chunk2, kernel_threads, Work};
#[cfg(doc)]
use crate::rope::rope_tail;
use crate::rope::{rope_tail_slices, Rope};
use crate::tensor::Tensor;

/// Elements a chunk of rows is made of, at least (as `nn`'s row kernels group rows).
const CHUNK: usize = 4096;

/// Whole rows of `n` per chunk: about [`CHUNK`] elements, at least one row.
fn chunk_elements(n: usize) -> usize {
    (CHUNK / n.max(1)).max(1) * n.max(1)
}

/// `len` elements of `t` from `at`, widened, as an `f32` tensor of rows of `n`.
fn widened(t: &Bf16Tensor, at: usize, len: usize, n: usize) -> Tensor {
    let mut out = vec![0.0f32; len];
    widen_slice(&t.data()[at..at + len], &mut out);
    Tensor::owned(vec![len / n.max(1), n], out)
}

/// Keeps the first error a chunk reports.
fn keep(first: &Mutex<Option<TensorError>>, e: TensorError) {
    if let Ok(mut slot) = first.lock() {
        slot.get_or_insert(e);
    }
}

/// A tensor of `shape` computed chunk by chunk: `f` takes each chunk of `inputs` (whole rows of
/// `n`, `chunk` elements, widened) and returns that chunk of the output in `f32`, rounded here.
fn by_chunks(
    shape: &[usize],
    n: usize,
    chunk: usize,
    inputs: &[&Bf16Tensor],
    f: impl Fn(&[Tensor]) -> Result<Tensor, TensorError> + Sync,
) -> Result<Bf16Tensor, TensorError> {
    let len: usize = shape.iter().product();
    let first = Mutex::new(None);
    // SAFETY: the chunks cover the output; a chunk whose kernel fails is zeroed, so every
    // element is written (and the error is returned, the output dropped).
    let data = unsafe {
        filled(len, |data| {
            for_each_chunk(data, chunk, kernel_threads(), Work::Heavy, |c, out| {
                let parts: Vec<Tensor> = inputs
                    .iter()
                    .map(|t| widened(t, c * chunk, out.len(), n))
                    .collect();
                match f(&parts) {
                    Ok(y) if y.len() == out.len() => round_into(y.data(), out),
                    result => {
                        out.fill(MaybeUninit::new(bf16::ZERO));
                        keep(
                            &first,
                            result.err().unwrap_or_else(|| {
                                TensorError::shape("bf16 rows", format!("a chunk from rows of {n}"))
                            }),
                        );
                    }
                }
            })
        })
    };
    match first.into_inner().ok().flatten() {
        Some(e) => Err(e),
        None => Bf16Tensor::new(shape.to_vec(), data),
    }
}

/// The last dimension's length, or an error naming `op`.
fn last(x: &Bf16Tensor, op: &'static str) -> Result<usize, TensorError> {
    match x.shape().last() {
        Some(&n) if n > 0 => Ok(n),
        _ => Err(TensorError::shape(
            op,
            format!("needs a non-empty last dimension, got {:?}", x.shape()),
        )),
    }
}

fn same(a: &Bf16Tensor, b: &Bf16Tensor, op: &'static str) -> Result<(), TensorError> {
    if a.shape() != b.shape() {
        return Err(TensorError::shape(
            op,
            format!("{:?} vs {:?}", a.shape(), b.shape()),
        ));
    }
    Ok(())
}

impl RowOut for bf16 {
    /// The rows in `f32`, rounded from there.
    type Scratch = Vec<MaybeUninit<f32>>;

    #[inline(always)]
    fn store_row(
        out: &mut [MaybeUninit<bf16>],
        scratch: &mut Vec<MaybeUninit<f32>>,
        fill: impl FnOnce(&mut [MaybeUninit<f32>]),
    ) {
        // Grown uninitialised: `fill` writes every element before it is read (a zeroing
        // `resize` was one more pass over each chunk's rows).
        if scratch.len() < out.len() {
            scratch.reserve(out.len() - scratch.len());
            // SAFETY: the capacity was reserved, and `MaybeUninit` needs no initialisation.
            unsafe { scratch.set_len(out.len()) };
        }
        let row = &mut scratch[..out.len()];
        fill(row);
        // SAFETY: `fill` wrote every element of `row` (the trait's contract);
        // `[MaybeUninit<f32>]` and `[f32]` share a layout.
        let row = unsafe { &*(row as *const [MaybeUninit<f32>] as *const [f32]) };
        round_into(row, out);
    }
}

/// [`rms_norm`] on bf16 rows: `y` rounded to bf16, each row's inverse RMS in `f32`; the mean
/// square is summed in `f32`, and the scale (a master weight) is `f32`. The `f32` kernel's own
/// code (`nn::rms_norm_slices`), each element widened as it is read (no widened copy of a row)
/// and a chunk of output rows computed into `f32` scratch and rounded from there.
///
/// # Errors
/// `scale` is not the last dim's length, or an empty last dimension.
pub fn rms_norm_bf16(
    x: &Bf16Tensor,
    scale: &Tensor,
    eps: f32,
) -> Result<(Bf16Tensor, Vec<f32>), TensorError> {
    let _span = ferrotext_profile::span("rms_norm_bf16").map(|s| s.bytes((4 * x.len()) as f64));
    let n = last(x, "rms_norm_bf16")?;
    if scale.shape() != [n] {
        return Err(TensorError::shape(
            "rms_norm_bf16",
            format!("scale {:?} for rows of {n}", scale.shape()),
        ));
    }
    let (y, inv) = rms_norm_slices(x.data(), scale.data(), eps, widen_bf16);
    Ok((Bf16Tensor::new(x.shape().to_vec(), y)?, inv))
}

/// [`rms_norm_backward`] for bf16 `x` and `dy`: `dx` rounded to bf16, `dscale` in `f32`
/// (a master weight's gradient). The `f32` kernel's own code (`nn::rms_norm_backward_slices`) on
/// elements widened as they are read: its groups of rows and its order of adding their partial
/// `dscale`s, so the same bits.
///
/// # Errors
/// Shapes disagree.
pub fn rms_norm_backward_bf16(
    x: &Bf16Tensor,
    scale: &Tensor,
    inv_rms: &[f32],
    dy: &Bf16Tensor,
) -> Result<(Bf16Tensor, Tensor), TensorError> {
    let _span =
        ferrotext_profile::span("rms_norm_backward_bf16").map(|s| s.bytes((6 * x.len()) as f64));
    same(x, dy, "rms_norm_backward_bf16")?;
    let n = last(x, "rms_norm_backward_bf16")?;
    crate::nn::statistics_fit(x.len(), n, scale, inv_rms, "rms_norm_backward_bf16")?;
    let (dx, dscale) =
        rms_norm_backward_slices((x.data(), dy.data()), scale.data(), inv_rms, widen_bf16);
    Ok((
        Bf16Tensor::new(x.shape().to_vec(), dx)?,
        Tensor::new(vec![n], dscale)?,
    ))
}

/// [`softmax_last`] on bf16 rows (max, exponentials and sum in `f32`).
///
/// # Errors
/// An empty last dimension.
pub fn softmax_last_bf16(x: &Bf16Tensor) -> Result<Bf16Tensor, TensorError> {
    let _span = ferrotext_profile::span("softmax_last_bf16").map(|s| s.bytes((4 * x.len()) as f64));
    let n = last(x, "softmax_last_bf16")?;
    by_chunks(x.shape(), n, chunk_elements(n), &[x], |p| {
        softmax_last(&p[0])
    })
}

/// [`causal_softmax`] of `scale·x` on bf16 scores `[.., Tq, Tk]`, `Tk ≥ Tq`.
///
/// # Errors
/// Rank below 2, or fewer keys than queries.
pub fn causal_softmax_bf16(x: &Bf16Tensor, scale: f32) -> Result<Bf16Tensor, TensorError> {
    let r = x.shape().len();
    if r < 2 || x.shape()[r - 1] < x.shape()[r - 2] || x.shape()[r - 1] == 0 {
        return Err(TensorError::shape(
            "causal_softmax_bf16",
            format!("needs [.., Tq, Tk] with Tk ≥ Tq, got {:?}", x.shape()),
        ));
    }
    let _span =
        ferrotext_profile::span("causal_softmax_bf16").map(|s| s.bytes((4 * x.len()) as f64));
    let (tq, tk) = (x.shape()[r - 2], x.shape()[r - 1]);
    // Whole [Tq, Tk] blocks per chunk: the f32 kernel finds a row's place by its index.
    by_chunks(x.shape(), tk, (tq * tk).max(1), &[x], |p| {
        let block = p[0]
            .clone()
            .reshape(&[p[0].len() / (tq * tk).max(1), tq, tk])?;
        causal_softmax(&block, scale)
    })
}

/// [`swiglu`](crate::swiglu) (`silu(g) ⊙ u`) on bf16 inputs.
///
/// # Errors
/// Shapes differ.
pub fn swiglu_bf16(g: &Bf16Tensor, u: &Bf16Tensor) -> Result<Bf16Tensor, TensorError> {
    glu_bf16(g, u, GluActivation::Silu)
}

/// [`swiglu_backward`](crate::swiglu_backward) on bf16 `g`, `u` and `dy`: `(dg, du)` rounded to bf16.
///
/// # Errors
/// Shapes differ.
pub fn swiglu_backward_bf16(
    g: &Bf16Tensor,
    u: &Bf16Tensor,
    dy: &Bf16Tensor,
) -> Result<(Bf16Tensor, Bf16Tensor), TensorError> {
    glu_backward_bf16(g, u, dy, GluActivation::Silu)
}

/// [`glu`](crate::glu) (`act(g) ⊙ u`) on bf16 inputs.
///
/// # Errors
/// Shapes differ.
pub fn glu_bf16(
    g: &Bf16Tensor,
    u: &Bf16Tensor,
    act: GluActivation,
) -> Result<Bf16Tensor, TensorError> {
    match act {
        GluActivation::Silu => glu_bf16_with(g, u, "swiglu_bf16", swiglu_value),
        GluActivation::GeluTanh => glu_bf16_with(g, u, "geglu_bf16", geglu_value),
    }
}

/// [`glu_backward`](crate::glu_backward) on bf16 `g`, `u` and `dy`: `(dg, du)` rounded to bf16.
///
/// # Errors
/// Shapes differ.
pub fn glu_backward_bf16(
    g: &Bf16Tensor,
    u: &Bf16Tensor,
    dy: &Bf16Tensor,
    act: GluActivation,
) -> Result<(Bf16Tensor, Bf16Tensor), TensorError> {
    match act {
        GluActivation::Silu => {
            glu_backward_bf16_with(g, u, dy, "swiglu_backward_bf16", swiglu_grads)
        }
        GluActivation::GeluTanh => {
            glu_backward_bf16_with(g, u, dy, "geglu_backward_bf16", geglu_grads)
        }
    }
}

/// [`glu_bf16`] with the `f32` kernel's element function `value`.
fn glu_bf16_with(
    g: &Bf16Tensor,
    u: &Bf16Tensor,
    name: &'static str,
    value: impl Fn(f32, f32) -> f32 + Copy + Sync,
) -> Result<Bf16Tensor, TensorError> {
    let _span = ferrotext_profile::span(name).map(|s| s.bytes((6 * g.len()) as f64));
    same(g, u, name)?;
    // Elementwise: the f32 kernel's own element function on the widened pair, a block of 1024
    // at a time, each block rounded at once — no scratch tensors.
    // SAFETY: the chunks cover the output, and `g`, `u` are as long, so each writes all of its
    // own.
    let y = unsafe {
        filled(g.len(), |y| {
            for_each_chunk(y, CHUNK, kernel_threads(), Work::Heavy, |c, out| {
                rounded_blocks(out, |at, block| {
                    let from = c * CHUNK + at;
                    let (gs, us) = (&g.data()[from..], &u.data()[from..]);
                    vectorized(
                        #[inline(always)]
                        || {
                            for ((o, &a), &b) in block.iter_mut().zip(gs).zip(us) {
                                *o = value(widen_bf16(a), widen_bf16(b));
                            }
                        },
                    );
                });
            })
        })
    };
    Bf16Tensor::new(g.shape().to_vec(), y)
}

/// [`glu_backward_bf16`] with the `f32` kernel's element function `grads`.
fn glu_backward_bf16_with(
    g: &Bf16Tensor,
    u: &Bf16Tensor,
    dy: &Bf16Tensor,
    name: &'static str,
    grads: impl Fn(f32, f32, f32) -> (f32, f32) + Copy + Sync,
) -> Result<(Bf16Tensor, Bf16Tensor), TensorError> {
    let _span = ferrotext_profile::span(name).map(|s| s.bytes((10 * g.len()) as f64));
    same(g, u, name)?;
    same(g, dy, name)?;
    let n = g.len();
    let mut du = Vec::with_capacity(n);
    // SAFETY: the chunks cover both outputs, and `g`, `u`, `dy` are as long, so each chunk
    // writes all of its own elements of `dg` and of `du` (whose length is set only after).
    let dg = unsafe {
        filled(n, |dg| {
            for_each_chunk2(
                dg,
                CHUNK,
                &mut du.spare_capacity_mut()[..n],
                CHUNK,
                kernel_threads(),
                Work::Heavy,
                |c, dgs, dus| {
                    rounded_blocks2((dgs, dus), |at, dg_block, du_block| {
                        let from = c * CHUNK + at;
                        let (gs, us, dys) =
                            (&g.data()[from..], &u.data()[from..], &dy.data()[from..]);
                        vectorized(
                            #[inline(always)]
                            || {
                                for (((dg, du), &gv), (&uv, &dyv)) in dg_block
                                    .iter_mut()
                                    .zip(du_block.iter_mut())
                                    .zip(gs)
                                    .zip(us.iter().zip(dys))
                                {
                                    (*dg, *du) =
                                        grads(widen_bf16(gv), widen_bf16(uv), widen_bf16(dyv));
                                }
                            },
                        );
                    });
                },
            )
        })
    };
    // SAFETY: every element of `du` was written above.
    unsafe { du.set_len(n) };
    Ok((
        Bf16Tensor::new(g.shape().to_vec(), dg)?,
        Bf16Tensor::new(g.shape().to_vec(), du)?,
    ))
}

/// [`softmax_backward_scaled`] on bf16 `y` and `dy` (the row sum in `f32`), `dx` rounded.
///
/// # Errors
/// Shapes differ, or an empty last dimension.
pub fn softmax_backward_bf16(
    y: &Bf16Tensor,
    dy: &Bf16Tensor,
    scale: f32,
) -> Result<Bf16Tensor, TensorError> {
    same(y, dy, "softmax_backward_bf16")?;
    let _span =
        ferrotext_profile::span("softmax_backward_bf16").map(|s| s.bytes((6 * y.len()) as f64));
    let n = last(y, "softmax_backward_bf16")?;
    by_chunks(y.shape(), n, chunk_elements(n), &[y, dy], |p| {
        softmax_backward_scaled(&p[0], &p[1], scale)
    })
}

/// [`silu`] on bf16 inputs.
///
/// # Errors
/// None in practice (`silu` has none); the chunk plumbing's shape check is kept.
pub fn silu_bf16(x: &Bf16Tensor) -> Result<Bf16Tensor, TensorError> {
    by_chunks(x.shape(), 1, CHUNK, &[x], |p| Ok(silu(&p[0])))
}

/// `a + b` elementwise (the residual stream) on bf16 tensors of one shape, summed in `f32`.
///
/// # Errors
/// Shapes differ.
pub fn add_bf16(a: &Bf16Tensor, b: &Bf16Tensor) -> Result<Bf16Tensor, TensorError> {
    same(a, b, "add_bf16")?;
    zip_bf16(a, b, |x, y| x + y)
}

/// [`rope_with`](crate::rope_with) on bf16 `x: [.., seq, heads, head_dim]`: the rotation in
/// `f32`, rounded once.
///
/// # Errors
/// As [`rope_with`](crate::rope_with).
pub fn rope_bf16(
    x: &Bf16Tensor,
    positions: &[usize],
    rope: &Rope,
    inverse: bool,
) -> Result<Bf16Tensor, TensorError> {
    rope_tail_bf16(x, positions, rope, inverse, 0)
}

/// [`rope_tail`] on bf16 `x: [.., seq, heads, head_dim]` (the first `pass` elements of each
/// head passed through): the rotation in `f32`, rounded once. The `f32` kernel's own code
/// (`rope::rope_tail_slices`), each element widened as it is read and each head rounded at
/// once.
///
/// # Errors
/// As [`rope_tail`].
pub fn rope_tail_bf16(
    x: &Bf16Tensor,
    positions: &[usize],
    rope: &Rope,
    inverse: bool,
    pass: usize,
) -> Result<Bf16Tensor, TensorError> {
    let _span = ferrotext_profile::span("rope_bf16").map(|s| s.bytes((4 * x.len()) as f64));
    let y = rope_tail_slices::<bf16, bf16>(
        x.data(),
        x.shape(),
        positions,
        rope,
        (inverse, pass),
        widen_bf16,
    )?;
    Bf16Tensor::new(x.shape().to_vec(), y)
}
