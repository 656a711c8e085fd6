//! The portable kernel's route for `f32` products by a row-major matrix: one matrix (no batch)
//! whose left operand's rows are contiguous — a layer's `x·W` and `dy·Wᵀ` — with the right
//! operand packed whole once for all the product's row blocks, or read from the packing it
//! keeps ([`Tensor::keeping_packings`]: a step's weight, packed once for all its
//! micro-batches).
//!
//! Invariants:
//! * The route runs where [`crate::blas::kept_packing_isa`] names an instruction set: always on
//!   the portable kernel, and beside a BLAS where that function says. Which products take it
//!   follows their layout alone, so whether an operand keeps packings changes no bit: each
//!   element is the portable kernel's one chain over the contraction from `+0`, whoever packed
//!   the panels.
//! * A kept packing is read only by a product that reads the operand in place (not a copy the
//!   stacks made of another layout). A whole packing made for one call is at most
//!   [`FRESH_PACKING_MAX_BYTES`]; past that each row block packs a panel at a time.
//! * A product's rows are split into blocks on the threads as on the portable kernel; each
//!   block's rows are its rows of the whole (the kernel's invariant).

use std::mem::MaybeUninit;
use std::sync::Arc;

use super::Stacks;
use crate::blas::MIN_BLOCK_ROWS;
use crate::operand::{Product, Store};
use crate::portable::{self, Isa, Panels};
use crate::tensor::Tensor;

/// The largest packing of a right operand made for one product (its memory is outside what a
/// run's plan counts; an LM head's table, 151,936 × 1,024 values, would be 622 MB).
const FRESH_PACKING_MAX_BYTES: usize = 32 << 20;

/// How the route reads a product's right operand.
pub(crate) enum RightPanels {
    /// Packed whole: kept with the operand, or made for this product.
    Whole(Arc<Panels>),
    /// Packed a panel at a time by each row block (too large to pack whole for one product).
    ByPanel,
}

/// The route's instruction set and right panels for the product of `s` (its right operand
/// `rhs`), packing them now (on up to `threads` threads) if they are neither kept nor too large;
/// `None` when the route does not take the product (module docs).
pub(crate) fn route(rhs: &Tensor, s: &Stacks<'_>, threads: usize) -> Option<(Isa, RightPanels)> {
    let isa = crate::blas::kept_packing_isa()?;
    let (m, k, n) = (s.a.rows.0, s.a.cols.0, s.b.cols.0);
    let a_rows_contiguous = s.a.cols.1 == 1 || k == 1;
    if s.batch != 1 || !a_rows_contiguous || m == 0 || k == 0 || n == 0 {
        return None;
    }
    let (at, b) = s.b.first_matrix();
    let in_place =
        matches!(&s.b.data, std::borrow::Cow::Borrowed(d) if d.as_ptr() == rhs.data().as_ptr());
    let pack = || {
        let _span = ferrotext_profile::span("pack_f32").map(|span| span.bytes((8 * k * n) as f64));
        // SAFETY: `b` is a k×n matrix at these strides inside the stack's data (its
        // invariant), which is `rhs`'s storage where `in_place`.
        unsafe { Panels::pack(b, k, n, threads) }
    };
    let panels = match rhs.packings() {
        Some(kept) if in_place => RightPanels::Whole(kept.get_or_pack(at, pack)),
        _ if k * n.next_multiple_of(portable::NR) * size_of::<f32>() <= FRESH_PACKING_MAX_BYTES => {
            RightPanels::Whole(Arc::new(pack()))
        }
        _ => RightPanels::ByPanel,
    };
    Some((isa, panels))
}

/// The product of `s` (one matrix: [`route`] took it) into `dst` (`m × n`, row-major), stored
/// per `store`, on `isa` with `b` read from `panels`, its rows in up to `threads` blocks.
pub(crate) fn product(
    s: &Stacks<'_>,
    (isa, panels): (Isa, &RightPanels),
    threads: usize,
    dst: &mut [MaybeUninit<f32>],
    store: Store,
) {
    let (m, k, n) = (s.a.rows.0, s.a.cols.0, s.b.cols.0);
    debug_assert!(s.batch == 1 && dst.len() >= m * n);
    let p = Product {
        m,
        n,
        k,
        a: s.a.first_matrix().1,
        b: s.b.first_matrix().1,
        dst: dst.as_mut_ptr().cast::<f32>(),
        ldc: n,
        store,
    };
    let whole = match panels {
        RightPanels::Whole(panels) => Some(&**panels),
        RightPanels::ByPanel => None,
    };
    let t = threads.min(m / MIN_BLOCK_ROWS).max(1);
    if t == 1 {
        // SAFETY: the stacks' views are in bounds (their invariant), `dst` holds the m×n
        // output (written, or initialised under `Accumulate`), and `whole` is `b`'s.
        unsafe { portable::gemm_kept(isa, p, whole) };
        return;
    }
    let block = |block| {
        // SAFETY: a block of rows of the product above; `whole` is its `b`'s.
        unsafe { portable::gemm_kept(isa, block, whole) }
    };
    // SAFETY: as above; each block writes its own rows of `dst`.
    unsafe { p.for_each_row_block(m.div_ceil(t), block) };
}
