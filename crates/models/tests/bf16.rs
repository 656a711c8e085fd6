//! Every family computes in bf16 (`Decoder::with_compute_dtype`): the loss and the gradients of
//! a bf16 forward stay within bf16's rounding of the f32 run on the same weights and tokens
//! (dense Qwen3, Llama 3, Qwen2 with biases, Qwen3-MoE, DeepSeek's MLA + MoE), the gradients
//! stay f32, and bf16 is not a no-op (the losses differ). The baseline is the f32 run.

use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_models::decoder::{Config, Decoder};
use ferrotext_models::init_normal;
use ferrotext_sharding::{DType, Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx, SpmdError};
use ferrotext_tensor::{Bf16Tensor, Tensor};

const B: usize = 4;
const T: usize = 8;

/// Loss, gradients (reduced to plain, on the host) and their types, on data=2.
fn loss_and_grads(model: &Decoder, values: &[Tensor]) -> (f32, Vec<Tensor>, Vec<String>) {
    let mesh = Arc::new(Mesh::explicit([("data", 2)]).unwrap());
    let vocab = model.config().vocab_size;
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let params: Vec<Array> = values
            .iter()
            .map(|v| {
                cx.from_global(
                    v,
                    NamedSharding::new(mesh.clone(), PartitionSpec::replicated()).unwrap(),
                )
            })
            .collect::<Result<_, _>>()?;
        let seq: Vec<u32> = (0..B * (T + 1))
            .map(|i| ((i * 7 + 3) % vocab) as u32)
            .collect();
        let inputs: Vec<u32> = (0..B)
            .flat_map(|b| seq[b * (T + 1)..b * (T + 1) + T].to_vec())
            .collect();
        let targets: Vec<u32> = (0..B)
            .flat_map(|b| seq[b * (T + 1) + 1..(b + 1) * (T + 1)].to_vec())
            .collect();
        let batch = PartitionSpec::new([Some("data"), None]);
        let ids = cx.ids_from_global(&[B, T], batch.clone(), &inputs)?;
        let tgt = cx.ids_from_global(&[B, T], batch, &targets)?;
        let (loss, grads) =
            cx.value_and_grad(&params, |cx, ps| model.loss_sum(cx, ps, &ids, &tgt))?;
        let types = grads.iter().map(|g| g.ty().to_string()).collect();
        let grads = grads
            .iter()
            .map(|g| cx.to_host(g))
            .collect::<Result<Vec<_>, _>>()?;
        Ok::<_, SpmdError>((loss.scalar()?, grads, types))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    out.into_iter().next().unwrap()
}

fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt()
}

fn check_family(name: &str) {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let mut cfg = Config::preset(name).unwrap();
    if let Some(moe) = cfg.moe.as_mut() {
        // deepseek3-tiny is 61 layers deep: at random init its gradients grow ~5× more through
        // them, and so does any perturbation (bf16's or another). Four layers keep the test
        // quick and about rounding, not about that amplification.
        cfg.base_num_decoder_layers = cfg.base_num_decoder_layers.min(4);
        moe.first_num_dense_layers = moe.first_num_dense_layers.min(1);
    }
    let f32_model = Decoder::new(cfg).unwrap();
    let bf16_model = f32_model.clone().with_compute_dtype(DType::BF16).unwrap();
    assert_eq!(bf16_model.compute_dtype(), DType::BF16);
    let values: Vec<Tensor> = f32_model
        .params()
        .iter()
        .enumerate()
        .map(|(i, info)| init_normal(info, 7, i))
        .collect();
    let (l32, g32, _) = loss_and_grads(&f32_model, &values);
    let (l16, g16, types) = loss_and_grads(&bf16_model, &values);
    // How much this model's gradients move when only its weights are rounded to bf16 (an f32
    // run): its sensitivity. A router at random init flips selections under perturbations that
    // small, so MoE gradients move by tens of % from the rounding alone.
    let rounded: Vec<Tensor> = values
        .iter()
        .map(|t| Bf16Tensor::from_f32(t).to_f32())
        .collect();
    let (_, g_rounded, _) = loss_and_grads(&f32_model, &rounded);
    assert!(l32.is_finite() && l16.is_finite(), "{name}: {l32} {l16}");
    assert_ne!(l16, l32, "{name}: bf16 computes something else than f32");
    // The loss: bf16 rounds each activation by at most 2⁻⁹ relative; over a few layers the
    // loss moves by well under 1%.
    assert!(
        ((l16 - l32) / l32).abs() < 1e-2,
        "{name}: loss {l16} (bf16) vs {l32} (f32)"
    );
    for (i, (((a, b), r), ty)) in g16.iter().zip(&g32).zip(&g_rounded).zip(&types).enumerate() {
        assert!(ty.starts_with("f32["), "{name}: gradient {i} is {ty}");
        let (na, nb) = (norm(a.data()), norm(b.data()));
        let gap = |x: &Tensor| -> f64 {
            let d: Vec<f32> = x.data().iter().zip(b.data()).map(|(p, q)| p - q).collect();
            norm(&d)
        };
        // Within a few % of the gradient (bf16 activations), or within twice what rounding the
        // weights alone does, or tiny absolutely for a gradient that is zero (a selection bias).
        let (bf16_gap, rounding_gap) = (gap(a), gap(r));
        assert!(
            bf16_gap <= 6e-2 * nb + 2.0 * rounding_gap + 1e-5,
            "{name}: gradient {i} ({ty}): |bf16 - f32| = {bf16_gap} of |f32| = {nb} \
             (|bf16| = {na}; rounding the weights alone moves it {rounding_gap})"
        );
    }
}

#[test]
fn qwen3_dense_tied_computes_in_bf16() {
    check_family("qwen3-tiny");
}

#[test]
fn llama3_computes_in_bf16() {
    check_family("llama3-tiny");
}

#[test]
fn qwen2_with_qkv_biases_computes_in_bf16() {
    check_family("qwen2-tiny");
}

#[test]
fn qwen3_moe_computes_in_bf16() {
    check_family("qwen3-moe-tiny");
}

#[test]
fn deepseek_mla_and_moe_compute_in_bf16() {
    check_family("deepseek3-tiny");
}
