//! What every matrix-product kernel takes: strided operands ([`Operand`]), what it does with its
//! destination ([`Store`]), and how an element it reads becomes the `f32` it multiplies
//! ([`Widen`]). The kernels (`blas.rs`, `portable.rs`, `bf16/dpbf16.rs`) all import this file and
//! it imports none of them.

/// An element type a product reads: `f32`, or `bf16` widened exactly to `f32` as it is read.
pub(crate) trait Widen: Copy + Send + Sync + 'static {
    /// True when reading an element takes more than a load (`bf16`: a shift into an `f32`).
    const WIDENS: bool;

    /// The value as an `f32` (exact: every `bf16` is an `f32`).
    fn widen(self) -> f32;
}

impl Widen for f32 {
    const WIDENS: bool = false;

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for half::bf16 {
    const WIDENS: bool = true;

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

/// One matrix product as every kernel takes it: `dst = a · b` (or `+=`, per `store`) for `a`
/// m×k and `b` k×n into `dst`'s `m` rows of `n` elements, `ldc ≥ n` apart (`ldc = n`: a
/// row-major m×n output; more: a block of a larger output). `D` is the destination's element:
/// `f32`, or `bf16` for a product rounded as it is stored.
pub(crate) struct Product<T = f32, D = f32> {
    /// Rows of `a` and of `dst`.
    pub m: usize,
    /// Columns of `b` and of `dst`.
    pub n: usize,
    /// The contraction: columns of `a`, rows of `b`.
    pub k: usize,
    /// The left operand, m×k.
    pub a: Operand<T>,
    /// The right operand, k×n.
    pub b: Operand<T>,
    /// The destination's first element.
    pub dst: *mut D,
    /// Elements between the destination's rows.
    pub ldc: usize,
    /// Overwrite or add into the destination.
    pub store: Store,
}

impl<T, D> Clone for Product<T, D> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T, D> Copy for Product<T, D> {}

impl<T, D> Product<T, D> {
    /// Rows `start..start + rows` of this product: the same `b`, `a`'s and `dst`'s rows from
    /// `start` (pointer arithmetic only; nothing is read).
    pub(crate) fn rows(self, start: usize, rows: usize) -> Self {
        Product {
            m: rows,
            a: Operand {
                ptr: self.a.ptr.wrapping_offset(start as isize * self.a.rs),
                ..self.a
            },
            dst: self.dst.wrapping_add(start * self.ldc),
            ..self
        }
    }

    /// This product with its destination seen as bytes (for a kernel that stores either
    /// element type, as its own flag says).
    pub(crate) fn into_bytes(self) -> Product<T, u8> {
        Product {
            dst: self.dst.cast(),
            m: self.m,
            n: self.n,
            k: self.k,
            a: self.a,
            b: self.b,
            ldc: self.ldc,
            store: self.store,
        }
    }

    /// This product's blocks of `rows` rows (the last one shorter), each a product of its own,
    /// run by `f` on the rayon pool, one block a task.
    ///
    /// # Safety
    /// The product's operands and destination are valid as the kernels require (see
    /// `crate::blas::sgemm`); `f` touches only its block's rows of `dst`, so the blocks write
    /// disjoint rows while they read all of `b` and their own rows of `a`.
    pub(crate) unsafe fn for_each_row_block(self, rows: usize, f: impl Fn(Self) + Sync)
    where
        T: Sync,
        D: Send,
    {
        /// The product crossing threads: every block reads its rows of `a`, all of `b`, and
        /// writes its own rows of `dst` (the caller's contract).
        struct Shared<T, D>(Product<T, D>);
        // SAFETY: see the struct's doc; the pointers are only read through or written
        // through disjoint row ranges.
        unsafe impl<T: Sync, D: Send> Sync for Shared<T, D> {}
        let shared = Shared(self);
        let block = |start: usize| {
            let whole = &shared;
            f(whole.0.rows(start, rows.min(whole.0.m - start)));
        };
        use rayon::prelude::*;
        (0..self.m)
            .step_by(rows.max(1))
            .collect::<Vec<_>>()
            .into_par_iter()
            .with_max_len(1)
            .for_each(block);
    }
}
