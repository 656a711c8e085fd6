/*!
The `tensor` layer of ferrotext: one device's dense `f32` tensors and the kernels the models
need. It must not know about meshes or collectives: a [`Tensor`] is just this device's block.

Main items: [`Tensor`] (row-major, contiguous; structural ops copy, reshape does not),
elementwise maps with NumPy broadcasting, reductions, [`dot_general`] (on Intel MKL or OpenBLAS
when the machine has one, else the `gemm` crate, or on the portable fixed-order kernel whose bits
do not depend on the processor, [`use_portable_matmul`]: [`matmul_kernel`] says which) with arbitrary batch and
contracting dimensions, and the model kernels (softmax, RMSNorm, RoPE,
SiLU, cross-entropy, gather/scatter-add, top-k), each forward beside its backward.

bf16 (`dtype=bfloat16`): [`Bf16Tensor`] holds activations and matrix-product inputs;
[`round_bf16`] is the one rounding (to nearest even, NaN kept); [`dot_general_bf16`] multiplies
bf16 operands into `f32` on MKL's or OpenBLAS's bf16 product or the portable kernel
([`bf16_matmul_kernel`] says which), or rounds it to bf16 as it is stored
([`dot_general_bf16_rounded`]); the `*_bf16` row, elementwise and fused-attention kernels
([`flash_attention_bf16`] and its backward) compute in `f32` inside and equal the `f32`
kernels' results rounded.

# The key decision: strided views instead of copies for matrix products

Both kernels take a leading dimension (`gemm` any strides), so [`dot_general`] views each
operand as a strided matrix stack whenever its batch, free and contracting dimensions are
contiguous groups — `x·W`,
`x·Wᵀ` and `xᵀ·dy` (the weight gradient) never copy; batch dims keep a stride each, so
attention's `[B, T, H, d]` operands batched over B and H do not copy either. A product can also
be added into an existing buffer by the kernel itself ([`dot_general_accumulate`], BLAS
`beta = 1`): a gradient accumulator takes a weight's gradient without it being stored first.

# Threads

Kernels run on a device's share of the cores, never more: [`dot_general`] and the grouped
products take it as an argument; the row and elementwise kernels read this thread's budget,
set once with [`set_kernel_threads`] (1 until set). A device runs under [`with_kernel_pool`], so
its thread is one of the workers its kernels split over. Work is cut into fixed chunks and sums
across chunks run in order, so every result of this crate's own kernels has the same bits on any
thread count; a product's does on the portable kernel, and on a BLAS where the library computes a
block of rows as it computes the whole product ([`matmul_order_is_fixed`]).

[`cpu_peak`] is the CPU's peak FLOP/s per dtype: cores × one core's FMA throughput, probed once
per process (an EPYC's split 512-bit FMA and a Xeon's two full units report the same features,
so a table cannot tell them apart), best of short windows, so it does not move with how busy
the machine is.

# Example
```
use ferrotext_tensor::{dot_general, DotDims, Tensor};
let x = Tensor::new(vec![2, 3], vec![1., 2., 3., 4., 5., 6.]).unwrap();
let w = Tensor::new(vec![3, 1], vec![1., 0., -1.]).unwrap();
let y = dot_general(&x, &w, &DotDims::matmul(2), 1).unwrap();
assert_eq!(y.data(), &[-2., -2.]);
```
*/
#![deny(missing_docs)]

mod bf16;
mod blas;
mod elementwise;
mod error;
mod fastmath;
pub mod fixed_math;
mod flash;
mod grouped;
mod isa;
mod matmul;
mod nn;
mod operand;
mod optim;
mod packings;
mod parallel;
mod peak;
mod portable;
mod reduce;
mod rope;
mod skip;
mod tensor;

pub use bf16::{
    add_bf16, allow_bf16_fallback, bf16_matmul_kernel, bf16_products_keep_packings,
    causal_softmax_bf16, dot_general_bf16, dot_general_bf16_accumulate, dot_general_bf16_rounded,
    dot_general_bf16_rounded_accumulate_parts, flash_attention_backward_bf16, flash_attention_bf16,
    glu_backward_bf16, glu_bf16, map_bf16, mul_bf16, rms_norm_backward_bf16, rms_norm_bf16,
    rope_bf16, rope_tail_bf16, round_bf16, round_slice, scale_bf16, silu_bf16,
    softmax_backward_bf16, softmax_last_bf16, swiglu_backward_bf16, swiglu_bf16, widen_add_slice,
    widen_bf16, widen_slice, zip_bf16, Bf16Tensor,
};
pub use blas::{
    check_kernel_env, f32_products_keep_packings, matmul_kernel, matmul_order_is_fixed,
    use_portable_matmul,
};
pub use elementwise::{add_assign_rows, add_assign_slice, broadcast_shapes};
pub use error::TensorError;
pub use fixed_math::softcap;
pub use flash::{flash_attention, flash_attention_backward, Flash, KeyRanges, Scores};
pub use grouped::{
    grouped_matmul, grouped_matmul_backward, grouped_matmul_backward_dw_into,
    grouped_matmul_backward_dx, scatter_rows, take_rows, PAD_ROW,
};
pub use isa::instruction_set;
pub use matmul::{dot_general, dot_general_accumulate, dot_general_accumulate_parts, DotDims};
pub use nn::{
    causal_softmax, cross_entropy, cross_entropy_backward, gather, glu, glu_backward, rms_norm,
    rms_norm_backward, rope, scatter_add, scatter_add_into, scatter_add_into_parts, silu,
    silu_backward, softmax_backward_scaled, softmax_last, softmax_last_backward, swiglu,
    swiglu_backward, top_k, CrossEntropy, GluActivation,
};
pub use optim::{adamw_update, sgd_update, sum_of_squares, AdamW};
pub use parallel::{kernel_threads, set_kernel_threads, with_kernel_pool};
pub use peak::{
    cpu_peak, memory_bandwidth, processor_name, product_peak, snap_units, CpuPeak, FmaProbe,
    Probes, ProductProbe,
};
pub use rope::{rope_tail, rope_with, Llama3, PositionScaling, Rope, Yarn};
pub use skip::{report_skipped, SKIPPED_ENV};
pub use tensor::{strides, written_zeros, Tensor};
