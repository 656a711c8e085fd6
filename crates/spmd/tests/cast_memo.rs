//! Remembered casts (`Ctx::remember_casts`): a step's weights, cast to bf16 in every
//! micro-batch, are converted once and the later casts share that storage; the values and the
//! gradients are those of casting afresh each time (the baseline here: the same program with no
//! memo), and nothing is shared where no array was registered or after `forget_casts`.

mod common;

use common::*;
use ferrotext_sharding::DType;
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::{DotDims, Tensor};

fn w_value() -> Tensor {
    Tensor::from_fn(&[16, 4], |i| ((i * 13 % 29) as f32 - 14.0) * 0.0237)
}

fn x_value(micro: usize) -> Tensor {
    Tensor::from_fn(&[8, 16], |i| ((i * 37 % 23 + micro) as f32 - 11.0) * 0.0731)
}

/// Three micro-batches of `Σ (cast(x)·cast(w))²`, the weight `{R:data}` on data=2: each
/// micro-batch's gradient (f32, unreduced) and whether each micro-batch's cast of `w` shared
/// the first one's storage.
fn micro_batches(
    cx: &mut Ctx<'_>,
    remember: bool,
) -> Result<(Vec<Vec<f32>>, Vec<bool>), SpmdError> {
    let w = place(cx, &w_value(), p(&["", ""], &[], &["data"]));
    if remember {
        cx.remember_casts(std::slice::from_ref(&w));
    }
    let mut first: Option<Array> = None;
    let (mut grads, mut shared) = (Vec::new(), Vec::new());
    for micro in 0..3 {
        let x = place(cx, &x_value(micro), p(&["data", ""], &[], &[]));
        let mut cast_w = None;
        let (_, g) = cx.value_and_grad(std::slice::from_ref(&w), |cx, ps| {
            let xb = cx.cast(&x, DType::BF16)?;
            let wb = cx.cast(&ps[0], DType::BF16)?;
            cast_w = Some(wb.clone());
            let y = cx.dot_general_preferred(&xb, &wb, &DotDims::matmul(2), None, DType::F32)?;
            let y2 = cx.mul(&y, &y)?;
            cx.reduce_sum(&y2, &[0, 1], None)
        })?;
        let wb = cast_w.ok_or(SpmdError::Internal {
            op: "test",
            invariant: "the program ran",
        })?;
        shared.push(first.as_ref().is_some_and(|f| f.shares_storage(&wb)));
        first.get_or_insert(wb);
        grads.push(g[0].local()?.data().to_vec());
    }
    cx.forget_casts();
    Ok((grads, shared))
}

#[test]
fn a_remembered_weight_is_cast_once_and_trains_as_if_cast_each_time() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let m = mesh(&[("data", 2)]);
    let memo = on_devices(&m, |cx| micro_batches(cx, true));
    let fresh = on_devices(&m, |cx| micro_batches(cx, false));
    for (((g_memo, shared_memo), _), ((g_fresh, shared_fresh), _)) in memo.iter().zip(&fresh) {
        assert_eq!(
            shared_memo,
            &vec![false, true, true],
            "micro-batches 2 and 3 reuse the first cast"
        );
        assert_eq!(
            shared_fresh,
            &vec![false, false, false],
            "the mirror: with nothing registered every cast is its own"
        );
        for (a, b) in g_memo.iter().zip(g_fresh) {
            let (a, b): (Vec<u32>, Vec<u32>) = (
                a.iter().map(|v| v.to_bits()).collect(),
                b.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(a, b, "the gradients are bitwise those of casting afresh");
        }
        assert_ne!(
            g_memo[0], g_memo[1],
            "the micro-batches differ (the test can tell)"
        );
    }
}

#[test]
fn forgetting_casts_computes_them_again_and_a_retyped_source_hits() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let m = mesh(&[("data", 2)]);
    let out = on_devices(&m, |cx| {
        let w = place(cx, &w_value(), p(&["", ""], &[], &[]));
        cx.remember_casts(std::slice::from_ref(&w));
        let a = cx.cast(&w, DType::BF16)?;
        // The `{R:data}` view shares the storage: the same conversion, under its own type.
        let tagged = cx.reshard(&w, &p(&["", ""], &[], &["data"]))?;
        let b = cx.cast(&tagged, DType::BF16)?;
        cx.forget_casts();
        let c = cx.cast(&w, DType::BF16)?;
        let same_bits = a.local()?.data() == c.local()?.data();
        Ok((
            a.shares_storage(&b),
            b.ty().to_string(),
            a.shares_storage(&c),
            same_bits,
        ))
    });
    for ((hit, ty, after_forget, same_bits), _) in out {
        assert!(hit, "a retyped view of a remembered array reuses its cast");
        assert_eq!(ty, "bf16[16,4]{R:data}", "under the view's own type");
        assert!(
            !after_forget,
            "after forget_casts the cast is computed again"
        );
        assert!(same_bits, "to the same values");
    }
}
