//! Remembered casts (`Ctx::remember_casts`): a step's weights, cast to bf16 in every
//! micro-batch, are converted once and the later casts share that storage; the values and the
//! gradients are those of casting afresh each time (the baseline here: the same program with no
//! memo), and nothing is shared where no array was registered or after `forget_casts`. With
//! `Ctx::remember_casts_and_packings` the remembered cast also keeps its products' packing of
//! it (one, for `x·w`), to the same bits.

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

/// What a run of [`micro_batches`] registers.
#[derive(Clone, Copy, PartialEq)]
enum Remember {
    Nothing,
    Casts,
    CastsAndPackings,
}

/// What [`micro_batches`] observes: each micro-batch's gradient, whether each micro-batch's
/// cast shared the first one's storage, and how many packings the last cast keeps.
type Observed = (Vec<Vec<f32>>, Vec<bool>, usize);

/// Three micro-batches of `Σ (cast(x)·cast(w))²`, the weight `{R:data}` on data=2: each
/// micro-batch's gradient (f32, unreduced), whether each micro-batch's cast of `w` shared
/// the first one's storage, and how many packings the last cast of `w` keeps.
fn micro_batches(cx: &mut Ctx<'_>, remember: Remember) -> Result<Observed, SpmdError> {
    let w = place(cx, &w_value(), p(&["", ""], &[], &["data"]));
    match remember {
        Remember::Nothing => {}
        Remember::Casts => cx.remember_casts(std::slice::from_ref(&w)),
        Remember::CastsAndPackings => cx.remember_casts_and_packings(std::slice::from_ref(&w)),
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
    let kept = first
        .as_ref()
        .and_then(Array::local_bf16)
        .map_or(0, |w| w.kept_packings());
    cx.forget_casts();
    Ok((grads, shared, kept))
}

#[test]
fn a_remembered_weight_is_cast_once_and_trains_as_if_cast_each_time() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let m = mesh(&[("data", 2)]);
    let memo = on_devices(&m, |cx| micro_batches(cx, Remember::Casts));
    let fresh = on_devices(&m, |cx| micro_batches(cx, Remember::Nothing));
    for (((g_memo, shared_memo, _), _), ((g_fresh, shared_fresh, _), _)) in memo.iter().zip(&fresh)
    {
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

/// `remember_casts_and_packings`: the remembered cast keeps the forward product's packing of
/// it where the bf16 kernel packs (ferrotext's AVX512_BF16 kernel), and the gradients keep the
/// bits of casting afresh; the mirror, `remember_casts` alone, keeps none.
#[test]
fn a_remembered_weight_keeps_its_packing_when_asked_to_the_same_bits() {
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let m = mesh(&[("data", 2)]);
    let packed = on_devices(&m, |cx| micro_batches(cx, Remember::CastsAndPackings));
    let casts = on_devices(&m, |cx| micro_batches(cx, Remember::Casts));
    let fresh = on_devices(&m, |cx| micro_batches(cx, Remember::Nothing));
    let packs = ferrotext_tensor::bf16_products_keep_packings();
    if !packs {
        // The gradients' bits and the mirror are still checked; only the count is moot.
        ferrotext_tensor::report_skipped(
            "spmd cast_memo::a_remembered_weight_keeps_its_packing_…: the packing kept",
            "this process's bf16 kernel packs no operand (not ferrotext's AVX512_BF16 kernel)",
        );
    }
    for (((g_packed, shared, kept), _), (((_, _, kept_casts), _), ((g_fresh, _, _), _))) in
        packed.iter().zip(casts.iter().zip(&fresh))
    {
        assert_eq!(
            shared,
            &vec![false, true, true],
            "the cast is remembered too"
        );
        assert_eq!(
            *kept,
            usize::from(packs),
            "x·w's packing of w, where the kernel packs"
        );
        assert_eq!(
            *kept_casts, 0,
            "the mirror: remembered casts alone keep no packing"
        );
        let bits = |g: &[Vec<f32>]| -> Vec<Vec<u32>> {
            g.iter()
                .map(|v| v.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert_eq!(
            bits(g_packed),
            bits(g_fresh),
            "the gradients of casting afresh"
        );
    }
}

/// Three micro-batches of `Σ (x·w)²` in f32 with the gradients of both `x` and `w`, the weight
/// `{R:data}` on data=2 as given (`keeping_packings` or not): each micro-batch's two gradients
/// and how many packings the weight keeps after.
fn f32_micro_batches(cx: &mut Ctx<'_>, keep: bool) -> Result<(Vec<Vec<f32>>, usize), SpmdError> {
    let placed = place(cx, &w_value(), p(&["", ""], &[], &["data"]));
    let w = if keep {
        placed.keeping_packings()
    } else {
        placed
    };
    let mut grads = Vec::new();
    for micro in 0..3 {
        let x = place(cx, &x_value(micro), p(&["data", ""], &[], &[]));
        let (_, g) = cx.value_and_grad(&[w.clone(), x], |cx, ps| {
            let y = cx.dot_general(&ps[1], &ps[0], &DotDims::matmul(2), None)?;
            let y2 = cx.mul(&y, &y)?;
            cx.reduce_sum(&y2, &[0, 1], None)
        })?;
        for g in &g {
            grads.push(g.local()?.data().to_vec());
        }
    }
    let kept = w.local()?.kept_packings();
    Ok((grads, kept))
}

/// An f32 weight that keeps its packings (`Array::keeping_packings`, as a step's weights do
/// where the f32 products take them) keeps two — `x·w`'s and the `x` gradient's `dy·wᵀ` — and
/// trains as the weight as stored does: bitwise on the portable kernel, whose kept route is the
/// same chains, within a float tolerance beside a BLAS. Mirror: as stored, it keeps none.
#[test]
fn an_f32_weight_keeping_its_packings_keeps_one_per_layout_and_trains_the_same() {
    let m = mesh(&[("data", 2)]);
    let kept = on_devices(&m, |cx| f32_micro_batches(cx, true));
    let plain = on_devices(&m, |cx| f32_micro_batches(cx, false));
    let route = ferrotext_tensor::f32_products_keep_packings();
    for (((g_kept, n_kept), _), ((g_plain, n_plain), _)) in kept.iter().zip(&plain) {
        assert_eq!(*n_kept, if route { 2 } else { 0 }, "x·w's and dy·wᵀ's");
        assert_eq!(*n_plain, 0, "the mirror: as stored it keeps none");
        assert_ne!(
            g_kept[0], g_kept[2],
            "the micro-batches differ (the test can tell)"
        );
        for (a, b) in g_kept.iter().zip(g_plain) {
            if ferrotext_tensor::matmul_order_is_fixed() {
                assert_eq!(a, b, "bitwise on the portable kernel");
            }
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
            }
        }
    }
}
