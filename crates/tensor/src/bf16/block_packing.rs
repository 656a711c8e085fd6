//! An operand packed once for many products that each read a block of it: the tiled
//! attention's keys and values (and, backward, its queries and output cotangent), which every
//! query block's tiles read again. Packed per tile, the keys of a causal head at 2,048 tokens
//! were packed 16 times over, `pack_b` 13% of the attention's time (`perf record` of
//! `examples/flash`, `shape=qwen3-0.6b-2k`).
//!
//! Invariants:
//! * A packing exists only where this process's bf16 product is ferrotext's AVX512_BF16 kernel
//!   (the one whose packing is known here); elsewhere [`BlockPacking::of`] is `None` and every
//!   product reads its operands as stored.
//! * [`product_in`] gives the bits of [`super::product`] on the block: where the packing's
//!   words are the block's packing it reads them ([`super::dpbf16::PackedB::window`]),
//!   elsewhere (a block starting inside a pair or panel) it runs [`super::product`] itself.

use half::bf16;

use crate::operand::{Operand, Product};

/// A `k`×`n` bf16 operand packed whole for the products that read blocks of it.
pub(crate) struct BlockPacking {
    #[cfg(target_arch = "x86_64")]
    packed: super::dpbf16::PackedB,
}

impl BlockPacking {
    /// `b` (`k`×`n`, any strides) packed on this thread, where this process's bf16 product
    /// is the AVX512_BF16 kernel; `None` elsewhere.
    ///
    /// # Safety
    /// `b`'s `k` rows of `n` elements are readable.
    pub(crate) unsafe fn of(b: Operand<bf16>, k: usize, n: usize) -> Option<BlockPacking> {
        #[cfg(target_arch = "x86_64")]
        if matches!(super::choice::choice(false), super::choice::Choice::Own(_)) {
            // SAFETY: the caller's contract; `Own` is chosen only where the CPU has
            // AVX512_BF16.
            let packed = unsafe { super::dpbf16::pack_b_kept(b, k, n, 1) };
            return Some(BlockPacking { packed });
        }
        let _ = (b, k, n);
        None
    }
}

/// The product `p` on this thread, its `b` rows `row0..row0 + p.k` and columns
/// `col0..col0 + p.n` of the operand `packed` was made of: read from the packing where it
/// holds the block's words, else packed by the product itself. The bits of
/// [`super::product`] either way.
///
/// # Safety
/// As [`super::product`]; `p.b` is that block of `packed`'s operand.
pub(crate) unsafe fn product_in(
    p: Product<bf16>,
    packed: &BlockPacking,
    (row0, col0): (usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(window) = packed.packed.window(row0, col0, p.k, p.n) {
        // SAFETY: the caller's contract: the window is `p.b`'s block of the packed operand,
        // packed by the AVX512_BF16 kernel, which this CPU has (`BlockPacking::of`).
        return unsafe { super::dpbf16::gemm_window(p, window) };
    }
    let _ = (packed, row0, col0);
    // SAFETY: the caller's contract.
    unsafe { super::product(p, gemm::Parallelism::None) }
}
