//! `Tensor`: a dense, row-major, contiguous `f32` array on one device, and its structural ops.
//!
//! Invariant: a tensor's elements are the `shape.iter().product()` consecutive elements of its
//! storage from its offset (a rank-0 tensor holds one element). Structural ops (transpose,
//! concat, broadcast, a slice that is not one run of memory) copy, in rows grouped into blocks
//! on the kernel thread budget (a copy has the source's bits whatever the budget); reshape, a
//! contiguous slice (e.g. rows, or a split along the first dimension) and [`Tensor::view`] do
//! not.
//!
//! Storage is shared and copied on write: cloning a tensor (as a reshape of a borrowed value, or
//! a tape keeping an input, does) shares its elements, and the first [`Tensor::data_mut`] of a
//! tensor whose storage is shared copies its own elements out, so a tensor never sees another's
//! writes.

use std::ops::Range;
use std::sync::Arc;

use std::mem::MaybeUninit;

use crate::error::TensorError;
use crate::parallel::{filled, for_each_chunk, kernel_threads, tasks_for, Work};

/// A dense row-major `f32` tensor. See the module docs for the invariant.
#[derive(Clone)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Arc<Vec<f32>>,
    /// Where the elements start in `storage`.
    offset: usize,
    /// The element count (the product of `shape`).
    len: usize,
    /// The packings its products keep, when it keeps them ([`Tensor::keeping_packings`]).
    packings: Option<Arc<Packings>>,
}

/// What an `f32` tensor keeps: the portable kernel's panels.
type Packings = crate::packings::Packings<crate::portable::Panels>;

impl PartialEq for Tensor {
    /// Same shape and elements (wherever they are stored).
    fn eq(&self, other: &Tensor) -> bool {
        self.shape == other.shape && self.data() == other.data()
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .field("data", &self.data())
            .finish()
    }
}

/// Row-major strides of `shape` (in elements).
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// `len` zeros, written. `vec![0.0; len]` leaves fresh pages unmapped; a read maps them to the
/// kernel's shared zero page, and the write after it takes a copy-on-write fault that flushes the
/// TLB on every core running the process (`do_wp_page`, an inter-processor interrupt per 4 KiB —
/// costly in a VM). An accumulator reads each element before writing it, so it is zeroed here
/// with writes: one plain fault per page. The writes are shared over this thread's kernel
/// budget ([`kernel_threads`]): a step's gradient accumulator is zeroed when the step opens,
/// before any kernel, and on one thread the other cores waited (2.4 GB a step for a 0.6B
/// model, 14.7 MB for qwen3-peer), a run a task. A run of at least 1 MiB is written with
/// non-temporal stores: an accumulator is first read long after it is zeroed (after the
/// forward), so caching its lines only costs reading each one before it is written. Under a
/// profiler span `zeros`.
pub fn written_zeros(len: usize) -> Vec<f32> {
    let _span = ferrotext_profile::span("zeros").map(|s| s.bytes((4 * len) as f64));
    let threads = kernel_threads();
    let run = len.div_ceil(tasks_for(len, threads, Work::Light)).max(1);
    // SAFETY: `for_each_chunk` hands every chunk of the buffer to the closure, which writes all
    // of its elements.
    unsafe {
        filled(len, |v| {
            for_each_chunk(v, run, threads, Work::Light, |_, c| {
                if c.len() >= STREAMED_ZEROS {
                    stream_zeros(c);
                } else {
                    c.fill(MaybeUninit::new(0.0));
                }
            })
        })
    }
}

/// Elements from which [`written_zeros`] streams a run (1 MiB of `f32`). glibc's `memset`
/// streams only from 240 MiB on (`x86_non_temporal_threshold` on this 2-core EPYC), and a
/// qwen3-0.6b step's accumulator comes as buckets of ~8 MB: 2.4 GB in 8 MB buffers, each on
/// two threads, took 104–110 ms with `fill` and 67–75 ms streamed.
const STREAMED_ZEROS: usize = 1 << 18;

/// `+0.0` into every element of `run`, with non-temporal stores where the target has them (the
/// lines go to memory without being read into the caches first).
fn stream_zeros(run: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_setzero_ps, _mm_sfence, _mm_stream_ps};
        // SSE is part of x86-64: 16-byte stores from the first 16-byte boundary.
        let head = run.as_ptr().align_offset(16).min(run.len());
        let (head, rest) = run.split_at_mut(head);
        head.fill(MaybeUninit::new(0.0));
        let (body, tail) = rest.split_at_mut(rest.len() / 4 * 4);
        for four in body.chunks_exact_mut(4) {
            // SAFETY: `four` is 4 writable `f32` (16 bytes) at a 16-byte boundary (the first
            // after `head`, then every 16 bytes).
            unsafe { _mm_stream_ps(four.as_mut_ptr().cast::<f32>(), _mm_setzero_ps()) };
        }
        tail.fill(MaybeUninit::new(0.0));
        // Streamed stores are weakly ordered: fence them before the buffer is handed on.
        // SAFETY: SSE is part of x86-64.
        unsafe { _mm_sfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    run.fill(MaybeUninit::new(0.0));
}

impl Tensor {
    /// `data` (of `shape`'s element count) as a tensor of its own.
    pub(crate) fn owned(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        Tensor {
            len: data.len(),
            shape,
            storage: Arc::new(data),
            offset: 0,
            packings: None,
        }
    }

    /// The elements `offset..offset + n` of `storage` (`n` the product of `shape`) as a tensor,
    /// sharing them: how a buffer that holds many values (a gradient bucket) hands each out
    /// without copying.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when they run past the end of `storage`.
    pub fn view(
        storage: Arc<Vec<f32>>,
        offset: usize,
        shape: Vec<usize>,
    ) -> Result<Tensor, TensorError> {
        let len: usize = shape.iter().product();
        if offset
            .checked_add(len)
            .is_none_or(|end| end > storage.len())
        {
            return Err(TensorError::shape(
                "view",
                format!(
                    "{len} elements from {offset} of a storage of {}",
                    storage.len()
                ),
            ));
        }
        Ok(Tensor {
            shape,
            storage,
            offset,
            len,
            packings: None,
        })
    }

    /// A tensor of `shape` holding `data` in row-major order.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `data` has the wrong length.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Tensor, TensorError> {
        let n: usize = shape.iter().product();
        if data.len() != n {
            return Err(TensorError::shape(
                "new",
                format!("shape {shape:?} needs {n} elements, got {}", data.len()),
            ));
        }
        Ok(Tensor::owned(shape, data))
    }

    /// All zeros.
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor::full(shape, 0.0)
    }

    /// All zeros, written to memory: for a buffer that is read before it is written (an
    /// accumulator, an optimizer moment). See [`written_zeros`].
    pub fn accumulator_zeros(shape: &[usize]) -> Tensor {
        Tensor::owned(shape.to_vec(), written_zeros(shape.iter().product()))
    }

    /// Every element `value`.
    pub fn full(shape: &[usize], value: f32) -> Tensor {
        let _span = ferrotext_profile::span("fill")
            .map(|s| s.bytes((4 * shape.iter().product::<usize>()) as f64));
        Tensor::owned(shape.to_vec(), vec![value; shape.iter().product()])
    }

    /// A rank-0 tensor.
    pub fn scalar(value: f32) -> Tensor {
        Tensor::owned(Vec::new(), vec![value])
    }

    /// Element `i` (row-major) is `f(i)`.
    pub fn from_fn(shape: &[usize], f: impl FnMut(usize) -> f32) -> Tensor {
        let n = shape.iter().product();
        Tensor::owned(shape.to_vec(), (0..n).map(f).collect())
    }

    /// A tensor whose element `i` (row-major) is `f(i)`, computed in chunks on up to `threads`
    /// threads of the current rayon pool: the same tensor as [`Tensor::from_fn`] with the same
    /// `f`, since each element depends on its index alone (a seeded initialisation drawn from a
    /// counter-based generator, say).
    pub fn from_index_fn(
        shape: &[usize],
        threads: usize,
        f: impl Fn(usize) -> f32 + Sync,
    ) -> Tensor {
        const CHUNK: usize = 1 << 14;
        let n = shape.iter().product();
        // SAFETY: every chunk of the output is written, element by element.
        let data = unsafe {
            crate::parallel::filled(n, |out| {
                crate::parallel::for_each_chunk(
                    out,
                    CHUNK,
                    threads,
                    crate::parallel::Work::Heavy,
                    |c, chunk| {
                        for (j, x) in chunk.iter_mut().enumerate() {
                            x.write(f(c * CHUNK + j));
                        }
                    },
                );
            })
        };
        Tensor::owned(shape.to_vec(), data)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements, row-major.
    pub fn data(&self) -> &[f32] {
        &self.storage[self.offset..self.offset + self.len]
    }

    /// The elements, row-major, mutable (copied out first when the storage is shared). A tensor
    /// that kept packings lets them go: they hold the elements as they were.
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.packings = None;
        let range = self.offset..self.offset + self.len;
        if Arc::get_mut(&mut self.storage).is_none() {
            self.storage = Arc::new(self.storage[range.clone()].to_vec());
            self.offset = 0;
            return &mut Arc::make_mut(&mut self.storage)[..];
        }
        &mut Arc::make_mut(&mut self.storage)[range]
    }

    /// This tensor (its storage shared, not copied) keeping the packings that products make of
    /// it as their right operand, for as long as any clone of the result lives and until it is
    /// written ([`Tensor::data_mut`]): where this process's products take kept packings
    /// ([`f32_products_keep_packings`](crate::f32_products_keep_packings)), each matrix of it
    /// is packed once and the packing reused after — for a step's weight, which every
    /// micro-batch multiplies by (`x·W` and `dy·Wᵀ`: two packings, each about the tensor's
    /// size). The products' bits are the same either way.
    pub fn keeping_packings(&self) -> Tensor {
        Tensor {
            packings: Some(self.packings.clone().unwrap_or_default()),
            ..self.clone()
        }
    }

    /// How many packings of this tensor its products keep ([`Tensor::keeping_packings`]; 0
    /// when it keeps none).
    pub fn kept_packings(&self) -> usize {
        self.packings.as_ref().map_or(0, |p| p.len())
    }

    /// The packings kept, when this tensor keeps them.
    pub(crate) fn packings(&self) -> Option<&Packings> {
        self.packings.as_deref()
    }

    /// Takes the elements (copied when the storage is shared or holds more).
    pub fn into_data(self) -> Vec<f32> {
        let whole = self.offset == 0 && self.len == self.storage.len();
        let range = self.offset..self.offset + self.len;
        match Arc::try_unwrap(self.storage) {
            Ok(v) if whole => v,
            Ok(v) => v[range].to_vec(),
            Err(shared) => shared[range].to_vec(),
        }
    }

    /// The same elements under another shape with the same element count (no copy).
    ///
    /// # Errors
    /// [`TensorError::Shape`] when the counts differ.
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor, TensorError> {
        let n: usize = shape.iter().product();
        if n != self.len {
            return Err(TensorError::shape(
                "reshape",
                format!("cannot reshape {:?} to {shape:?}", self.shape),
            ));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            ..self
        })
    }

    /// `out[i_perm[0], ..] = self[i_0, ..]`: dimension `d` of the result is dimension `perm[d]` of
    /// `self`.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `perm` is not a permutation of the dimensions.
    pub fn transpose(&self, perm: &[usize]) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("transpose").map(|s| s.bytes(8.0 * self.len as f64));
        check_perm(perm, self.rank())?;
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(self.clone());
        }
        let in_strides = strides(&self.shape);
        let out_shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        let src_strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
        let data = strided_copy(self.data(), 0, &out_shape, &src_strides);
        Ok(Tensor::owned(out_shape, data))
    }

    /// The sub-tensor `ranges[d]` along each dimension.
    ///
    /// # Errors
    /// [`TensorError::Shape`] for a wrong number of ranges or a range out of bounds.
    pub fn slice(&self, ranges: &[Range<usize>]) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("slice")
            .map(|s| s.bytes((8 * ranges.iter().map(|r| r.len()).product::<usize>()) as f64));
        if ranges.len() != self.rank()
            || ranges
                .iter()
                .zip(&self.shape)
                .any(|(r, &n)| r.start > r.end || r.end > n)
        {
            return Err(TensorError::shape(
                "slice",
                format!("ranges {ranges:?} do not fit shape {:?}", self.shape),
            ));
        }
        let st = strides(&self.shape);
        let offset: usize = ranges.iter().zip(&st).map(|(r, s)| r.start * s).sum();
        let out_shape: Vec<usize> = ranges.iter().map(|r| r.end - r.start).collect();
        // One run of memory (single indices on the leading dimensions, then one range, then
        // whole dimensions): a view.
        let first_range = ranges
            .iter()
            .position(|r| r.len() != 1)
            .unwrap_or(ranges.len());
        let contiguous = ranges[first_range.min(ranges.len())..]
            .iter()
            .zip(&self.shape[first_range.min(ranges.len())..])
            .skip(1)
            .all(|(r, &n)| r.start == 0 && r.end == n);
        if contiguous {
            return Tensor::view(self.storage.clone(), self.offset + offset, out_shape);
        }
        let data = strided_copy(self.data(), offset, &out_shape, &st);
        Ok(Tensor::owned(out_shape, data))
    }

    /// `range` along dimension `dim`, everything along the others.
    ///
    /// # Errors
    /// As [`Tensor::slice`].
    pub fn slice_dim(&self, dim: usize, range: Range<usize>) -> Result<Tensor, TensorError> {
        let mut ranges: Vec<Range<usize>> = self.shape.iter().map(|&n| 0..n).collect();
        let slot = ranges
            .get_mut(dim)
            .ok_or_else(|| TensorError::shape("slice_dim", format!("no dimension {dim}")))?;
        *slot = range;
        self.slice(&ranges)
    }

    /// Concatenation along `dim`; the other dimensions must agree.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when there are no parts or their shapes disagree.
    pub fn concat(parts: &[&Tensor], dim: usize) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("concat")
            .map(|s| s.bytes(8.0 * parts.iter().map(|p| p.len).sum::<usize>() as f64));
        let first = parts
            .first()
            .ok_or_else(|| TensorError::shape("concat", "no parts".into()))?;
        let rank = first.rank();
        if dim >= rank
            || parts.iter().any(|p| {
                p.rank() != rank
                    || p.shape
                        .iter()
                        .zip(&first.shape)
                        .enumerate()
                        .any(|(d, (a, b))| d != dim && a != b)
            })
        {
            return Err(TensorError::shape(
                "concat",
                format!(
                    "shapes {:?} do not concatenate along {dim}",
                    parts.iter().map(|p| p.shape.clone()).collect::<Vec<_>>()
                ),
            ));
        }
        let outer: usize = first.shape[..dim].iter().product();
        let inner: usize = first.shape[dim + 1..].iter().product();
        let mut shape = first.shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        // An output row (one index of the dimensions before `dim`) is each part's run in turn.
        let row = shape[dim] * inner;
        // SAFETY: each output row is written whole: the parts' runs along `dim` add up to `row`.
        let data = unsafe {
            rows_filled(outer, row, |o, out_row| {
                let mut at = 0;
                for p in parts {
                    let run = p.shape[dim] * inner;
                    write_copy(&mut out_row[at..at + run], &p.data()[o * run..][..run]);
                    at += run;
                }
            })
        };
        Ok(Tensor::owned(shape, data))
    }

    /// This tensor with `before` zeros ahead of it and `after` zeros behind it along `dim`
    /// (a slice's transpose): the values of concatenating zero tensors around it, written in
    /// one pass.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `dim` is not a dimension.
    pub fn pad_dim(&self, dim: usize, before: usize, after: usize) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("pad").map(|s| s.bytes((8 * self.len) as f64));
        let Some(&n) = self.shape.get(dim) else {
            return Err(TensorError::shape(
                "pad_dim",
                format!("no dimension {dim} in {:?}", self.shape),
            ));
        };
        let inner: usize = self.shape[dim + 1..].iter().product();
        let outer: usize = self.shape[..dim].iter().product();
        let mut shape = self.shape.clone();
        shape[dim] = before + n + after;
        let (run, row) = (n * inner, shape[dim] * inner);
        let zero = |part: &mut [MaybeUninit<f32>]| {
            part.iter_mut().for_each(|o| {
                o.write(0.0);
            })
        };
        // SAFETY: each row is written whole: zeros, the source's run, zeros.
        let data = unsafe {
            rows_filled(outer, row, |o, out_row| {
                let (head, rest) = out_row.split_at_mut(before * inner);
                let (mid, tail) = rest.split_at_mut(run);
                zero(head);
                write_copy(mid, &self.data()[o * run..][..run]);
                zero(tail);
            })
        };
        Ok(Tensor::owned(shape, data))
    }

    /// `n` equal parts along `dim`.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `n` does not divide the dimension.
    pub fn split(&self, dim: usize, n: usize) -> Result<Vec<Tensor>, TensorError> {
        let extent = *self
            .shape
            .get(dim)
            .ok_or_else(|| TensorError::shape("split", format!("no dimension {dim}")))?;
        if n == 0 || extent % n != 0 {
            return Err(TensorError::shape(
                "split",
                format!(
                    "{n} parts do not divide dimension {dim} of {:?}",
                    self.shape
                ),
            ));
        }
        let part = extent / n;
        (0..n)
            .map(|i| self.slice_dim(dim, i * part..(i + 1) * part))
            .collect()
    }

    /// `out[i] = self[i restricted to dims]`: dimension `d` of `self` becomes dimension
    /// `dims[d]` of a tensor of `shape`; every other dimension is broadcast (XLA's
    /// `broadcast_in_dim`). A size-1 dimension of `self` may broadcast to any size.
    ///
    /// # Errors
    /// [`TensorError::Shape`] when `dims` does not map `self` into `shape`.
    pub fn broadcast_in_dim(&self, shape: &[usize], dims: &[usize]) -> Result<Tensor, TensorError> {
        let _span = ferrotext_profile::span("broadcast")
            .map(|s| s.bytes((4 * (self.len + shape.iter().product::<usize>())) as f64));
        let bad = dims.len() != self.rank()
            || dims.windows(2).any(|w| w[0] >= w[1])
            || dims
                .iter()
                .zip(&self.shape)
                .any(|(&d, &n)| d >= shape.len() || (n != shape[d] && n != 1));
        if bad {
            return Err(TensorError::shape(
                "broadcast_in_dim",
                format!(
                    "{:?} with dims {dims:?} does not broadcast to {shape:?}",
                    self.shape
                ),
            ));
        }
        let in_strides = strides(&self.shape);
        let mut src_strides = vec![0; shape.len()];
        for (i, &d) in dims.iter().enumerate() {
            if self.shape[i] != 1 {
                src_strides[d] = in_strides[i];
            }
        }
        let data = strided_copy(self.data(), 0, shape, &src_strides);
        Ok(Tensor::owned(shape.to_vec(), data))
    }
}

fn check_perm(perm: &[usize], rank: usize) -> Result<(), TensorError> {
    let mut seen = vec![false; rank];
    let ok = perm.len() == rank
        && perm
            .iter()
            .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
    if ok {
        Ok(())
    } else {
        Err(TensorError::shape(
            "transpose",
            format!("{perm:?} is not a permutation of {rank} dimensions"),
        ))
    }
}

/// Elements a structural copy moves per block (rows grouped up to about this many).
const COPY_BLOCK: usize = 4096;

/// `src[offset + Σ i_d·strides[d]]` for every index of `shape`, row-major, as a new vector: rows
/// of the innermost dimension (a straight copy when its stride is 1, one value repeated when it
/// is 0) in blocks of about [`COPY_BLOCK`] elements on the kernel thread budget.
pub(crate) fn strided_copy(
    src: &[f32],
    offset: usize,
    shape: &[usize],
    strides: &[usize],
) -> Vec<f32> {
    let len: usize = shape.iter().product();
    let Some((&inner, outer)) = shape.split_last() else {
        return vec![src[offset]];
    };
    if len == 0 {
        return Vec::new();
    }
    let inner_stride = strides[outer.len()];
    let rows = (COPY_BLOCK / inner).max(1);
    // SAFETY: every chunk is visited, and each writes all `inner` elements of each of its rows.
    unsafe {
        filled(len, |out| {
            for_each_chunk(
                out,
                rows * inner,
                kernel_threads(),
                Work::Light,
                |c, block| {
                    // The chunk's first row as an index into the outer dimensions, then stepped.
                    let mut index = vec![0usize; outer.len()];
                    let mut first = c * rows;
                    for (i, &n) in index.iter_mut().zip(outer).rev() {
                        *i = first % n;
                        first /= n;
                    }
                    let mut base =
                        offset + index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
                    for out_row in block.chunks_mut(inner) {
                        match inner_stride {
                            1 => write_copy(out_row, &src[base..base + inner]),
                            0 => out_row.iter_mut().for_each(|o| {
                                o.write(src[base]);
                            }),
                            step => {
                                for (j, o) in out_row.iter_mut().enumerate() {
                                    o.write(src[base + j * step]);
                                }
                            }
                        }
                        // The next row: an odometer over the outer dimensions.
                        for ((i, &n), &stride) in index.iter_mut().zip(outer).zip(strides).rev() {
                            *i += 1;
                            base += stride;
                            if *i < n {
                                break;
                            }
                            base -= stride * n;
                            *i = 0;
                        }
                    }
                },
            )
        })
    }
}

/// `outer` rows of `row` elements, row `o` written by `fill(o, row)`, in blocks of about
/// [`COPY_BLOCK`] elements on the kernel thread budget.
///
/// # Safety
/// `fill` must write every element of the row it is given.
pub(crate) unsafe fn rows_filled(
    outer: usize,
    row: usize,
    fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let rows = (COPY_BLOCK / row.max(1)).max(1);
    // SAFETY: every chunk is visited and each of its rows goes to `fill`, which writes it whole
    // (the caller's contract).
    unsafe {
        filled(outer * row, |out| {
            for_each_chunk(
                out,
                rows * row,
                kernel_threads(),
                Work::Light,
                |c, block| {
                    for (k, out_row) in block.chunks_mut(row.max(1)).enumerate() {
                        fill(c * rows + k, out_row);
                    }
                },
            )
        })
    }
}

/// `dst[i] = src[i]`, every element of `dst` written (`src` as long).
fn write_copy(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        d.write(v);
    }
}

#[cfg(test)]
mod tests;
