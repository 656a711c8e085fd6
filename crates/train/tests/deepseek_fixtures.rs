//! DeepSeek-V3 as transformers writes it (issue 29 items 2 and 3), against the fixtures of
//! `crates/hf/tests/fixtures/transformers/` (made by `make_fixtures.py` with transformers'
//! `save_pretrained` and a float64 forward): group-limited routing (`n_group` 4, `topk_group`
//! 2), a trained `e_score_correction_bias` and `routed_scaling_factor` 2.5 give transformers'
//! step-0 loss within 2e-5 and its 16 greedy tokens; export → reload gives the same values. A
//! directory with the multi-token-prediction layer loads it (`mtp_num_layers` 1) and gives the
//! reference MTP loss; a model without the module refuses it by name, never drops it.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_hf as hf;
use ferrotext_models::decoder::{Decoder, LossOptions};
use ferrotext_sharding::DType;
use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx};
use ferrotext_tensor::Tensor;
use serde_json::Value;

mod common;

use common::one_device;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hf/tests/fixtures/transformers")
        .join(name)
}

fn expected(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// ferrotext's logits `[rows·len][vocab]` of `rows` equal-length rows, on one device.
fn logits(model: &Decoder, values: &[Tensor], rows: &[Vec<u32>]) -> Vec<Vec<f64>> {
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
    let (b, t) = (rows.len(), rows[0].len());
    let flat: Vec<u32> = rows.concat();
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let named = NamedSharding::new(mesh.clone(), PartitionSpec::replicated())?;
        let params: Vec<Array> = values
            .iter()
            .map(|v| cx.from_global(v, named.clone()))
            .collect::<Result<_, _>>()?;
        let batch = PartitionSpec::new([Some("data"), None]);
        let ids = cx.ids_from_global(&[b, t], batch, &flat)?;
        let logits = model.logits(&mut cx, &params, &ids)?;
        cx.to_host(&logits)
    })
    .unwrap();
    let vocab = model.config().vocab_size;
    out[0]
        .data()
        .chunks(vocab)
        .map(|r| r.iter().map(|&x| f64::from(x)).collect())
        .collect()
}

/// Mean next-token cross-entropy over every predicted position (transformers' definition in
/// `expected.json`), in f64 from the logits.
fn mean_loss(model: &Decoder, values: &[Tensor], rows: &[Vec<u32>]) -> f64 {
    let t = rows[0].len();
    let all = logits(model, values, rows);
    let mut sum = 0.0;
    let mut n = 0;
    for (r, row) in rows.iter().enumerate() {
        for i in 0..t - 1 {
            let z = &all[r * t + i];
            let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + z.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            sum += lse - z[row[i + 1] as usize];
            n += 1;
        }
    }
    sum / n as f64
}

/// 16 greedy tokens after `prompt`, each from a full forward pass (argmax, ties to the lower id).
fn greedy(model: &Decoder, values: &[Tensor], prompt: &[u32]) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..16 {
        // Two copies of the row: a batch of one does not reshape on a `data` mesh axis.
        let all = logits(model, values, &[seq.clone(), seq.clone()]);
        let last = &all[seq.len() - 1];
        let mut best = 0;
        for (i, &x) in last.iter().enumerate() {
            if x > last[best] {
                best = i;
            }
        }
        seq.push(best as u32);
    }
    seq[prompt.len()..].to_vec()
}

fn load(dir: &Path) -> (Decoder, Vec<Tensor>) {
    let cfg = hf::read_config(dir).unwrap_or_else(|e| panic!("{e}"));
    let model = Decoder::new(cfg).unwrap();
    let values = hf::load_directory(dir, &model.params()).unwrap_or_else(|e| panic!("{e}"));
    (model, values)
}

fn check_groups(name: &str) {
    let dir = fixture(name);
    let want = expected(&dir);
    let (model, values) = load(&dir);
    let m = model.config().moe.as_ref().unwrap();
    assert_eq!(
        (m.groups.n_routing_groups, m.groups.topk_routing_group),
        (4, 2)
    );
    assert!(m.routed_bias);
    // The trained bias is read: nonzero.
    let k = model
        .params()
        .iter()
        .position(|p| p.name == "model.layers.1.mlp.gate.e_score_correction_bias")
        .unwrap();
    assert!(values[k].data().iter().any(|&b| b != 0.0));
    let rows = rows_of(&want);
    let loss = mean_loss(&model, &values, &rows);
    let reference = want["loss"].as_f64().unwrap();
    eprintln!("{name}: loss {loss:.7} transformers {reference:.7}");
    assert!(
        (loss - reference).abs() <= 2e-5,
        "{name}: loss {loss} vs transformers' {reference}"
    );
    // Mirrors: without the group limit, or without the bias, the loss is not transformers'.
    let mut no_groups = model.config().clone();
    if let Some(m) = no_groups.moe.as_mut() {
        m.groups = Default::default();
    }
    let off = mean_loss(&Decoder::new(no_groups).unwrap(), &values, &rows);
    assert!(
        (off - reference).abs() > 2e-5,
        "{name}: groups change nothing"
    );
    let mut zero_bias = values.clone();
    zero_bias[k] = Tensor::zeros(zero_bias[k].shape());
    let off = mean_loss(&model, &zero_bias, &rows);
    assert!(
        (off - reference).abs() > 2e-5,
        "{name}: the bias changes nothing"
    );
    let tokens = greedy(&model, &values, &ids(&want["prompt"]));
    assert_eq!(tokens, ids(&want["greedy_tokens"]), "{name}");
    // Export and reload: the same config and values (the bias included).
    let out = std::env::temp_dir().join(format!("ferrotext-ds-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&out).ok();
    hf::save_directory(
        &out,
        model.config(),
        &model.params(),
        &values,
        DType::F32,
        u64::MAX,
    )
    .unwrap();
    let (again, reloaded) = load(&out);
    assert_eq!(again.config(), model.config());
    assert_eq!(reloaded, values);
    std::fs::remove_dir_all(&out).ok();
}

#[test]
fn deepseek_groups_bias_and_scaling_match_transformers_f32() {
    check_groups("deepseek_v3-groups-tf5-f32-single");
    check_groups("deepseek_v3-groups-tf4-f32-single");
}

#[test]
fn deepseek_groups_bias_and_scaling_match_transformers_bf16_sharded() {
    check_groups("deepseek_v3-groups-tf5-bf16-sharded");
}

/// The loss sums of `rows` (inputs `r[..t]`, targets `r[1..]`) on one device: the main
/// model's cross-entropy sum, the MTP module's, and the training objective's total.
fn loss_parts(model: &Decoder, values: &[Tensor], rows: &[Vec<u32>]) -> (f64, f64, f64) {
    let out = run_spmd(&one_device::mesh(), &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let (params, inputs, targets) = one_device::place(&mut cx, values, rows)?;
        let main = model.loss_sum(&mut cx, &params, &inputs, &targets)?;
        let with_mtp = LossOptions {
            partial: false,
            with_mtp: true,
        };
        let parts = model.loss(&mut cx, &params, (&inputs, None), &targets, with_mtp)?;
        let mtp = match &parts.mtp {
            Some(m) => m.scalar()?,
            None => f32::NAN,
        };
        Ok::<_, ferrotext_spmd::SpmdError>(Tensor::from_fn(&[3], |i| {
            [
                main.scalar().unwrap_or(f32::NAN),
                mtp,
                parts.total.scalar().unwrap_or(f32::NAN),
            ][i]
        }))
    })
    .unwrap();
    let d = out[0].data();
    (f64::from(d[0]), f64::from(d[1]), f64::from(d[2]))
}

fn rows_of(want: &Value) -> Vec<Vec<u32>> {
    want["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect()
}

/// A directory whose checkpoint has the multi-token-prediction layer (`model.layers.2.*`), in
/// both config generations and both dtypes, loads through the normal path (`read_config` →
/// `mtp_num_layers` 1 → the decoder's weight map): its MTP loss is the reference's `mtp_loss`
/// and its main loss transformers' `loss`, each within 2e-5, the objective is
/// `main + 0.1 × MTP mean` in sum form (`T / (T − 1)` per MTP sum), and the greedy tokens are
/// transformers' (generation ignores the module).
#[test]
fn mtp_directories_load_and_give_the_reference_losses() {
    for name in [
        "deepseek_v3-mtp-tf4-f32-single",
        "deepseek_v3-mtp-tf4-bf16-sharded",
        "deepseek_v3-mtp-tf5-f32-single",
        "deepseek_v3-mtp-tf5-bf16-sharded",
    ] {
        let dir = fixture(name);
        let want = expected(&dir);
        let (model, values) = load(&dir);
        assert_eq!(model.config().mtp_num_layers, 1, "{name}");
        let names: Vec<String> = model.params().into_iter().map(|p| p.name).collect();
        assert!(names.contains(&"model.layers.2.eh_proj.weight".to_string()));
        let rows = rows_of(&want);
        let (b, t) = (rows.len(), rows[0].len() - 1);
        let (main, mtp, total) = loss_parts(&model, &values, &rows);
        let main_mean = main / (b * t) as f64;
        let mtp_mean = mtp / (b * (t - 1)) as f64;
        let (ref_main, ref_mtp) = (
            want["loss"].as_f64().unwrap(),
            want["mtp_loss"].as_f64().unwrap(),
        );
        eprintln!("{name}: loss {main_mean:.7} ({ref_main:.7}) mtp {mtp_mean:.7} ({ref_mtp:.7})");
        assert!(
            (main_mean - ref_main).abs() <= 2e-5,
            "{name}: {main_mean} vs {ref_main}"
        );
        assert!(
            (mtp_mean - ref_mtp).abs() <= 2e-5,
            "{name}: {mtp_mean} vs {ref_mtp}"
        );
        // The objective by hand: the main sum plus 0.1 × the MTP mean per main token.
        let by_hand = main + 0.1 * mtp_mean * (b * t) as f64;
        assert!(
            (total - by_hand).abs() <= 1e-4 * by_hand.abs(),
            "{name}: {total} vs {by_hand}"
        );
        assert!(
            (total - main).abs() > 1e-3,
            "{name}: the MTP term is in the objective"
        );
        // Generation ignores the module: transformers' 16 greedy tokens.
        let tokens = greedy(&model, &values, &ids(&want["prompt"]));
        assert_eq!(tokens, ids(&want["greedy_tokens"]), "{name}");
    }
}

/// The same directory read as a model without the module (`mtp_num_layers` 0) is refused,
/// naming the layer and the key that keeps it, rather than loaded without it.
#[test]
fn a_multi_token_prediction_layer_is_refused_not_dropped() {
    let dir = fixture("deepseek_v3-mtp-tf5-f32-single");
    let mut cfg = hf::read_config(&dir).unwrap();
    cfg.mtp_num_layers = 0;
    let model = Decoder::new(cfg).unwrap();
    let e = hf::load_directory(&dir, &model.params())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("multi-token-prediction layer `model.layers.2.*`")
            && e.contains("set mtp_num_layers=1"),
        "{e}"
    );
}

/// transformers 5 writes `num_nextn_predict_layers: 1` without the layer: such a directory is
/// the main model (`mtp_num_layers` 0, as the mirror above reads 1 where the layer is); a model
/// that asks for the module there is told the directory has none, the missing tensor named.
#[test]
fn a_declared_layer_without_tensors_is_the_main_model_alone() {
    let dir = fixture("deepseek_v3-groups-tf5-f32-single");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(text.contains("\"num_nextn_predict_layers\": 1"));
    let cfg = hf::read_config(&dir).unwrap();
    assert_eq!(cfg.mtp_num_layers, 0);
    let mut with = cfg.clone();
    with.mtp_num_layers = 1;
    let model = Decoder::new(with).unwrap();
    let e = hf::load_directory(&dir, &model.params())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no multi-token-prediction layer")
            && e.contains("`model.layers.2.eh_proj.weight`"),
        "{e}"
    );
}

/// An MTP directory with one of the layer's tensors missing, or one of the wrong shape: one
/// error naming it (the directory written from the fixture's values, the tensor left out or
/// cut).
#[test]
fn a_broken_mtp_layer_is_named() {
    let (model, values) = load(&fixture("deepseek_v3-mtp-tf5-f32-single"));
    let infos = model.params();
    let k = infos
        .iter()
        .position(|p| p.name == "model.layers.2.enorm.weight")
        .unwrap();
    let out = std::env::temp_dir().join(format!("ferrotext-mtp-broken-{}", std::process::id()));
    let save = |infos: &[ferrotext_models::ParamInfo], values: &[Tensor]| {
        std::fs::remove_dir_all(&out).ok();
        hf::save_directory(&out, model.config(), infos, values, DType::F32, u64::MAX).unwrap();
    };
    // Missing: written without `enorm`.
    let (mut i2, mut v2) = (infos.clone(), values.clone());
    i2.remove(k);
    v2.remove(k);
    save(&i2, &v2);
    assert_eq!(hf::read_config(&out).unwrap().mtp_num_layers, 1);
    let e = hf::load_directory(&out, &infos).unwrap_err().to_string();
    assert!(
        e.contains("1 missing tensor(s)") && e.contains("`model.layers.2.enorm.weight`"),
        "{e}"
    );
    // Wrong shape: `enorm` written with 31 values instead of 32.
    let (mut i3, mut v3) = (infos.clone(), values.clone());
    i3[k].shape = vec![31];
    v3[k] = Tensor::from_fn(&[31], |_| 1.0);
    save(&i3, &v3);
    let e = hf::load_directory(&out, &infos).unwrap_err().to_string();
    assert!(
        e.contains("`model.layers.2.enorm.weight` has shape [31]"),
        "{e}"
    );
    // Mirror: written whole, it loads to the same values.
    save(&infos, &values);
    assert_eq!(hf::load_directory(&out, &infos).unwrap(), values);
    std::fs::remove_dir_all(&out).ok();
}

/// The MTP module (`ferrotext_models::mtp`) on the published tensor names, reading the main
/// model's embedding and head (the layer's stored copies read as the sharing), gives the
/// fixture's `mtp_loss` (a float64 reference of the module on the stored copies, checked there
/// against transformers 5's own `MtpModel`) within 2e-5; the main model's loss is unchanged by
/// the extra layer.
#[test]
fn the_mtp_module_gives_the_reference_mtp_loss() {
    use ferrotext_models::mtp::{mtp_loss_sum, Mtp, Shared};
    for name in [
        "deepseek_v3-mtp-tf5-f32-single",
        "deepseek_v3-mtp-tf5-bf16-sharded",
    ] {
        let dir = fixture(name);
        let want = expected(&dir);
        let mut cfg = hf::read_config(&dir).unwrap();
        cfg.mtp_num_layers = 0;
        let model = Decoder::new(cfg.clone()).unwrap();
        let main = model.params();
        let main_infos = &main;
        let mut infos = main.clone();
        infos.extend(Mtp::declare(&cfg).params());
        let values = hf::load_directory(&dir, &infos).unwrap_or_else(|e| panic!("{e}"));
        let (main_values, mtp_values) = values.split_at(main.len());
        let rows = rows_of(&want);
        let loss = mean_loss(&model, main_values, &rows);
        assert!(
            (loss - want["loss"].as_f64().unwrap()).abs() <= 2e-5,
            "{name}"
        );
        let (b, t) = (rows.len(), rows[0].len() - 1);
        let inputs: Vec<u32> = rows.iter().flat_map(|r| r[..t].to_vec()).collect();
        let next: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
        let labels: Vec<u32> = rows
            .iter()
            .flat_map(|r| {
                let mut l = r[2..].to_vec();
                l.push(ferrotext_spmd::IGNORE_INDEX);
                l
            })
            .collect();
        let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
        let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
            let mut cx = Ctx::new(dev.comm(), 1);
            let named = NamedSharding::new(mesh.clone(), PartitionSpec::replicated())?;
            let place = |cx: &Ctx<'_>, vs: &[Tensor]| -> Result<Vec<Array>, _> {
                vs.iter()
                    .map(|v| cx.from_global(v, named.clone()))
                    .collect()
            };
            let main = place(&cx, main_values)?;
            let mtp = place(&cx, mtp_values)?;
            let at = |name: &str| main_infos.iter().position(|p| p.name == name).unwrap();
            let shared = Shared {
                table: &main[at("model.embed_tokens.weight")],
                head: &main[at("lm_head.weight")],
                tied: false,
            };
            let spec = PartitionSpec::new([Some("data"), None]);
            let id = |cx: &mut Ctx<'_>, v: &[u32]| cx.ids_from_global(&[b, t], spec.clone(), v);
            let (inputs, next, labels) = (
                id(&mut cx, &inputs)?,
                id(&mut cx, &next)?,
                id(&mut cx, &labels)?,
            );
            let hidden = model.hidden(&mut cx, &main, &inputs)?;
            let sum = mtp_loss_sum(&mut cx, &cfg, (&mtp, shared), &hidden, &next, &labels)?;
            sum.scalar()
        })
        .unwrap();
        let mtp = f64::from(out[0]) / (b * (t - 1)) as f64;
        let reference = want["mtp_loss"].as_f64().unwrap();
        eprintln!("{name}: mtp loss {mtp:.7} reference {reference:.7}");
        assert!(
            (mtp - reference).abs() <= 2e-5,
            "{name}: {mtp} vs {reference}"
        );
    }
}
