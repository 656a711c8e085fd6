//! Multi-token prediction in training (`mtp_num_layers`, `mtp_loss_scaling_factor`; issue 29
//! item 3): the objective's gradient is the main loss's plus `factor · T/(T−1)` times the MTP
//! sum's, and matches central finite differences; factor 0 leaves the shared parameters
//! bitwise those of a run without the module (factor 0.1 does not); the reported loss is the
//! main mean plus `factor × mtp_loss`, both fall in training, and the deferral still holds (in
//! abstract mode too); ZeRO-1 carries the module; a resume (at a step boundary or mid-step)
//! is bitwise; a bf16 run trains it; a DeepSeek-V3 directory with the layer trains and exports with it, and
//! refuses to load without `mtp_num_layers=1`; bad values are usage errors naming the key. The
//! module shares the main model's embedding and head: its loss has a gradient on them, the
//! objective and its gradient at a published layout are transformers 5's `MtpModel`'s (tied), the
//! export writes the published layer's copies of them, and a layer whose copies differ is
//! refused, named.

use std::path::{Path, PathBuf};

use ferrotext_comm::{run_spmd, PhasePattern, SpmdOptions};
use ferrotext_models::decoder::LossOptions;
use ferrotext_spmd::{Ctx, SpmdError};
use ferrotext_tensor::Tensor;
use ferrotext_train::data::{micro_batch, source_for};
use ferrotext_train::{train, Engine, RunOptions, TrainConfig, TrainError, TrainReport};
mod common;

use common::small_config;

/// The training objective: the module's term too.
const MTP: LossOptions = LossOptions {
    partial: false,
    with_mtp: true,
};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-mtp-{}-{name}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    dir
}

fn run(extra: &[&str]) -> TrainReport {
    let mut all = vec!["learning_rate=0.01", "steps=3"];
    all.extend_from_slice(extra);
    train(
        &small_config(&all),
        &RunOptions {
            return_params: true,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Which scalar a gradient is taken of.
#[derive(Clone, Copy)]
enum Of {
    Total,
    Main,
    Mtp,
}

/// The value and gradient of `of` at `values` on one device, for one micro-batch of `rows`.
fn value_and_grad(
    cfg: &TrainConfig,
    values: &[Tensor],
    rows: &[Vec<u32>],
    of: Of,
) -> (f64, Vec<Tensor>) {
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let model = plan.decoder().clone();
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let (params, inputs, targets) = common::one_device::place(&mut cx, values, rows)?;
        let (v, g) = cx.value_and_grad(&params, |cx, ps| match of {
            Of::Total => Ok(model.loss(cx, ps, (&inputs, None), &targets, MTP)?.total),
            Of::Main => model.loss_sum(cx, ps, &inputs, &targets),
            Of::Mtp => model
                .loss(cx, ps, (&inputs, None), &targets, MTP)?
                .mtp
                .ok_or(SpmdError::Internal {
                    op: "mtp test",
                    invariant: "the model has the module",
                }),
        })?;
        let grads = g
            .iter()
            .map(|a| cx.to_host(a))
            .collect::<Result<Vec<_>, _>>()?;
        Ok::<_, SpmdError>((f64::from(v.scalar()?), grads))
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

/// The initial parameters of `cfg`'s run and the rows of its first micro-batch.
fn start(cfg: &TrainConfig) -> (Vec<Tensor>, Vec<Vec<u32>>) {
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let values = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let engine = Engine::new(&mut cx, &plan, None)?;
        engine.params_to_host(&mut cx)
    })
    .unwrap()
    .remove(0);
    let source = source_for(cfg, 256).unwrap();
    let rows = micro_batch(
        source.as_ref(),
        0,
        0,
        1,
        cfg.micro_batch_rows(),
        cfg.max_target_length,
    );
    (values, rows)
}

/// The objective's gradient is the main loss's plus `0.3 · T/(T−1)` times the MTP sum's, and
/// its components on the module, the shared trunk, the embedding and the head match central
/// finite differences of the objective; the module's own loss has a gradient on the main
/// model's embedding and head (it reads them: shared, not copies). With the head untied and
/// tied to the embedding.
#[test]
fn the_objective_gradient_is_right() {
    for (tie, head) in [
        ("logits_via_embedding=false", "lm_head.weight"),
        ("logits_via_embedding=true", "model.embed_tokens.weight"),
    ] {
        objective_gradient_is_right(tie, head);
    }
}

fn objective_gradient_is_right(tie: &str, head: &str) {
    let cfg = small_config(&[
        "local_devices=1",
        "mtp_num_layers=1",
        "mtp_loss_scaling_factor=0.3",
        tie,
    ]);
    let (values, rows) = start(&cfg);
    let t = rows[0].len() - 1;
    let (_, total) = value_and_grad(&cfg, &values, &rows, Of::Total);
    let (_, main) = value_and_grad(&cfg, &values, &rows, Of::Main);
    let (_, mtp) = value_and_grad(&cfg, &values, &rows, Of::Mtp);
    let w = 0.3 * t as f32 / (t - 1) as f32;
    let names: Vec<String> = cfg
        .plan()
        .unwrap()
        .params()
        .iter()
        .map(|p| p.name.clone())
        .collect();
    for (i, name) in names.iter().enumerate() {
        let scale = total[i].data().iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (j, &g) in total[i].data().iter().enumerate() {
            let by_parts = main[i].data()[j] + w * mtp[i].data()[j];
            assert!(
                (g - by_parts).abs() <= 1e-4 * scale,
                "{tie}: {name}[{j}]: {g} vs {by_parts}"
            );
        }
    }
    // The module's loss reaches the main model's embedding and head.
    for shared in ["model.embed_tokens.weight", head] {
        let i = names.iter().position(|n| n == shared).unwrap();
        let largest = mtp[i].data().iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(
            largest > 1e-4,
            "{tie}: the MTP loss's gradient on {shared}: {largest}"
        );
    }
    assert!(
        !names
            .iter()
            .any(|n| n.ends_with("embed_tokens.weight") && n != "model.embed_tokens.weight"),
        "{tie}: no embedding of the module's own"
    );
    // Central differences of the objective (f32 forward, h = 1e-2) at each probed tensor's
    // element of largest gradient: the module's own weights, the shared head and embedding, the
    // trunk.
    let probes = [
        "model.layers.2.eh_proj.weight",
        "model.layers.2.enorm.weight",
        "model.layers.2.hnorm.weight",
        "model.layers.2.shared_head.norm.weight",
        head,
        "model.embed_tokens.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    .map(|name| {
        let g = total[names.iter().position(|n| n == name).unwrap()].data();
        let largest = (0..g.len()).max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()));
        (name, largest.unwrap())
    });
    let h = 1e-2f32;
    for (name, j) in probes {
        let i = names.iter().position(|n| n == name).unwrap();
        let at = |d: f32| {
            let mut v = values.clone();
            let mut data = v[i].data().to_vec();
            data[j] += d;
            v[i] = Tensor::new(v[i].shape().to_vec(), data).unwrap();
            value_and_grad(&cfg, &v, &rows, Of::Total).0
        };
        let fd = (at(h) - at(-h)) / (2.0 * f64::from(h));
        let g = f64::from(total[i].data()[j]);
        assert!(
            (fd - g).abs() <= 2e-3 + 2e-2 * g.abs(),
            "{tie}: {name}[{j}]: finite differences {fd} vs the gradient {g}"
        );
        assert!(
            g.abs() > 1e-4,
            "{tie}: {name}[{j}]: a probe that could be wrong"
        );
    }
}

/// Factor 0: the shared parameters and the losses are bitwise those of a run without the
/// module (4 devices, GA 2: the deferral path). The mirror: factor 0.1 moves both.
#[test]
fn factor_zero_trains_the_main_model_bitwise_as_without_the_module() {
    let layout = ["local_devices=4", "gradient_accumulation_steps=2"];
    let plain = run(&layout);
    let zero = run(&[
        &layout[..],
        &["mtp_num_layers=1", "mtp_loss_scaling_factor=0"],
    ]
    .concat());
    let some = run(&[
        &layout[..],
        &["mtp_num_layers=1", "mtp_loss_scaling_factor=0.1"],
    ]
    .concat());
    let n = plain.params.len();
    assert!(zero.params.len() > n);
    let (p, z, s) = (
        plain.values.as_ref().unwrap(),
        zero.values.as_ref().unwrap(),
        some.values.as_ref().unwrap(),
    );
    assert_eq!(
        &z[..n],
        &p[..],
        "factor 0: the shared weights are the plain run's"
    );
    let bits = |r: &TrainReport| {
        r.metrics
            .iter()
            .map(|m| m.loss.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&zero), bits(&plain));
    assert_ne!(
        &s[..n],
        &p[..],
        "mirror: factor 0.1 changes the shared weights"
    );
    assert_ne!(bits(&some), bits(&plain));
    assert!(plain.metrics.iter().all(|m| m.mtp_loss.is_none()));
    assert!(zero.metrics.iter().all(|m| m.mtp_loss.is_some()));
}

/// The reported loss is the main mean plus `factor × mtp_loss` (step 0 against a run without
/// the module, which has the same initial trunk and data); both losses fall over 24 steps; the
/// deferral holds: no all-reduce of more than one element inside micro-batches.
#[test]
fn both_losses_fall_and_the_loss_adds_the_scaled_mtp_loss() {
    let layout = [
        "local_devices=4",
        "gradient_accumulation_steps=2",
        "steps=30",
    ];
    let plain = run(&layout);
    let with = run(&[
        &layout[..],
        &["mtp_num_layers=1", "mtp_loss_scaling_factor=0.25"],
    ]
    .concat());
    let (m0, p0) = (&with.metrics[0], &plain.metrics[0]);
    let mtp0 = m0.mtp_loss.unwrap();
    let by_hand = p0.loss + 0.25 * mtp0;
    assert!(
        (m0.loss - by_hand).abs() <= 1e-5 * by_hand,
        "{} vs {by_hand}",
        m0.loss
    );
    let last = with.metrics.last().unwrap();
    eprintln!(
        "loss {:.4} → {:.4}, mtp_loss {mtp0:.4} → {:.4}",
        m0.loss,
        last.loss,
        last.mtp_loss.unwrap()
    );
    assert!(last.loss < m0.loss - 0.05);
    assert!(last.mtp_loss.unwrap() < mtp0 - 0.05);
    assert!(with.gate.is_open());
    let big = with
        .trace
        .all_reduces_larger_than(1, &PhasePattern::new("micro_batch*"));
    assert!(big.is_empty(), "all-reduces inside micro-batches: {big:?}");
    // The metrics line carries it.
    let line = serde_json::to_value(last).unwrap();
    assert!(line["mtp_loss"].as_f64().is_some());
    assert!(serde_json::to_value(&plain.metrics[0])
        .unwrap()
        .get("mtp_loss")
        .is_none());
}

/// Resumed from a step-boundary checkpoint, a run with the module has the uninterrupted run's
/// losses and MTP losses bit for bit, and its final weights (the module's included).
#[test]
fn a_resumed_run_with_the_module_is_bitwise() {
    let base = scratch("resume");
    let dir = format!("base_output_directory={}", base.display());
    let common = [
        "mtp_num_layers=1",
        "gradient_accumulation_steps=2",
        "steps=4",
        &dir,
    ];
    let checkpoints = [
        "enable_checkpointing=true",
        "checkpoint_period=1",
        "run_name=split",
    ];
    let whole = run(&[&common[..], &["run_name=whole"]].concat());
    let cfg = small_config(&[&common[..], &checkpoints[..], &["learning_rate=0.01"]].concat());
    let first = train(
        &cfg,
        &RunOptions {
            stop_after_steps: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    let rest = train(
        &cfg,
        &RunOptions {
            return_params: true,
            ..Default::default()
        },
    )
    .unwrap();
    let bits = |ms: &[ferrotext_train::StepMetrics]| {
        ms.iter()
            .map(|m| (m.loss.to_bits(), m.mtp_loss.map(f64::to_bits)))
            .collect::<Vec<_>>()
    };
    let mut resumed = bits(&first.metrics);
    resumed.extend(bits(&rest.metrics));
    assert_eq!(rest.first_step, 2);
    assert_eq!(resumed, bits(&whole.metrics));
    assert_eq!(rest.values, whole.values);
    std::fs::remove_dir_all(&base).ok();
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hf/tests/fixtures/transformers")
        .join(name)
}

/// A DeepSeek-V3 directory's keys for a short run on one device (its vocabulary, 128).
fn hf_config(dir: &Path, extra: &[&str]) -> Result<TrainConfig, TrainError> {
    let mut all: Vec<String> = vec![
        format!("load_parameters_path={}", dir.display()),
        "max_target_length=16".into(),
        "per_device_batch_size=2".into(),
        "local_devices=1".into(),
        "steps=2".into(),
        "learning_rate=0.01".into(),
        "dataset_type=synthetic".into(),
    ];
    all.extend(extra.iter().map(|s| s.to_string()));
    TrainConfig::load(None, &all)
}

/// The published layer trains with `mtp_num_layers=1` (the MTP loss reported) and the run's
/// weights export with it: transformers' names and `num_nextn_predict_layers` 1, read back to
/// the same values. Without the key the directory is refused, saying how to keep the layer.
#[test]
fn a_directory_with_the_layer_trains_exports_and_is_never_dropped() {
    let dir = fixture("deepseek_v3-mtp-tf5-f32-single");
    let refused = hf_config(&dir, &[]).and_then(|c| train(&c, &RunOptions::default()).map(drop));
    let e = refused.unwrap_err();
    assert!(e.is_usage(), "{e}");
    assert!(e.to_string().contains("set mtp_num_layers=1"), "{e}");
    let cfg = hf_config(&dir, &["mtp_num_layers=1"]).unwrap();
    let report = train(
        &cfg,
        &RunOptions {
            return_params: true,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(report
        .metrics
        .iter()
        .all(|m| m.mtp_loss.is_some_and(f64::is_finite)));
    let values = report.values.unwrap();
    let plan = cfg.plan().unwrap();
    let out = scratch("export");
    ferrotext_hf::save_directory(
        &out,
        plan.decoder().config(),
        plan.params(),
        &values,
        ferrotext_sharding::DType::F32,
        u64::MAX,
    )
    .unwrap();
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["num_nextn_predict_layers"], 1);
    let again = ferrotext_hf::read_config(&out).unwrap();
    assert_eq!(again.mtp_num_layers, 1);
    // The published layer's copies, written from the main model's tensors.
    let layer = plan.decoder().config().base_num_decoder_layers;
    let tensors = stored_tensors(&out.join("model.safetensors"));
    for (copy, of) in [
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("shared_head.head.weight", "lm_head.weight"),
    ] {
        let copy = format!("model.layers.{layer}.{copy}");
        assert!(tensors.contains_key(&copy), "{copy} written");
        assert_eq!(tensors[&copy], tensors[of], "{copy} is {of}'s copy");
    }
    // In bf16 and in shards of 20 kB (the copies in other files than what they copy, some of
    // them): the copies load as the sharing, to the values of the bf16 export's main tensors.
    let bf16 = scratch("export-bf16");
    ferrotext_hf::save_directory(
        &bf16,
        plan.decoder().config(),
        plan.params(),
        &values,
        ferrotext_sharding::DType::BF16,
        20_000,
    )
    .unwrap();
    assert!(bf16.join("model.safetensors.index.json").is_file());
    let read = ferrotext_hf::load_directory(&bf16, plan.params()).unwrap();
    assert_eq!(read.len(), values.len());
    std::fs::remove_dir_all(&bf16).ok();
    assert_eq!(
        ferrotext_hf::load_directory(&out, plan.params()).unwrap(),
        values
    );
    std::fs::remove_dir_all(&out).ok();
}

/// A stored tensor: its dtype, shape and bytes.
type Stored = (safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Every tensor of a safetensors file, by name.
fn stored_tensors(path: &Path) -> std::collections::BTreeMap<String, Stored> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// The published layer stores copies of the embedding and head; a layer whose copy has values
/// of its own (trained apart from the main model) is refused, naming the copy and what it should
/// copy, for each of the two. The mirror: the fixture as written (copies) loads.
#[test]
fn a_layer_whose_copies_are_its_own_is_refused_by_name() {
    let fixture = fixture("deepseek_v3-mtp-tf5-f32-single");
    let cfg = hf_config(&fixture, &["mtp_num_layers=1"]).unwrap();
    let plan = cfg.plan().unwrap();
    assert!(ferrotext_hf::load_directory(&fixture, plan.params()).is_ok());
    let layer = plan.decoder().config().base_num_decoder_layers;
    for (copy, of) in [
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("shared_head.head.weight", "lm_head.weight"),
    ] {
        let copy = format!("model.layers.{layer}.{copy}");
        let dir = scratch("own-copy");
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "generation_config.json"] {
            std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
        }
        let mut tensors = stored_tensors(&fixture.join("model.safetensors"));
        let (dtype, _, bytes) = tensors.get_mut(&copy).unwrap();
        assert_eq!(*dtype, safetensors::Dtype::F32);
        // One element of the copy moved by its lowest mantissa bit.
        bytes[0] ^= 1;
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, (dtype, shape, b))| {
                let v = safetensors::tensor::TensorView::new(*dtype, shape.clone(), b);
                (n.clone(), v.unwrap())
            })
            .collect();
        safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
        let e = ferrotext_hf::load_directory(&dir, plan.params())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("`{copy}` is not a copy of `{of}`")),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The training objective and its gradient at a DeepSeek-V3 directory with the layer are
/// transformers': `objective/deepseek_v3-mtp-tf5-f32-single.json` holds them as transformers 5's
/// `DeepseekV3ForCausalLM` and its `MtpModel` (tied to the main embedding and head) compute them
/// in float64 (`mtp_objective.py`): the objective within 1e-5, and every gradient transformers
/// has (bar the routed experts, which it fuses into a layout of its own) in its norm and first 8
/// elements within 1e-4 of the norm. The mirror: the embedding's gradient of the main loss
/// alone (what a module with a copy of its own would leave on the main embedding) is not the
/// reference's.
#[test]
fn the_objective_and_its_gradient_are_transformers_mtp_models() {
    let dir = fixture("deepseek_v3-mtp-tf5-f32-single");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("objective").join("deepseek_v3-mtp-tf5-f32-single.json"))
            .unwrap(),
    )
    .unwrap();
    let factor = reference["factor"].as_f64().unwrap();
    let cfg = hf_config(
        &dir,
        &[
            "mtp_num_layers=1",
            &format!("mtp_loss_scaling_factor={factor}"),
        ],
    )
    .unwrap();
    let plan = cfg.plan().unwrap();
    let values = ferrotext_hf::load_directory(&dir, plan.params()).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let rows: Vec<Vec<u32>> = expected["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect();
    let tokens = (rows.len() * (rows[0].len() - 1)) as f64;
    let (sum, total) = value_and_grad(&cfg, &values, &rows, Of::Total);
    let objective = reference["objective"].as_f64().unwrap();
    assert!(
        (sum / tokens - objective).abs() <= 1e-5,
        "objective {} vs transformers' {objective}",
        sum / tokens
    );
    // Every gradient in the checkpoint's layout and names, as a mean over the tokens.
    let in_hf = |grads: &[Tensor]| -> std::collections::BTreeMap<String, Vec<f64>> {
        plan.params()
            .iter()
            .zip(grads)
            .flat_map(|(info, g)| info.to_hf(g).unwrap())
            .map(|(name, t)| {
                let mean = t.data().iter().map(|&x| f64::from(x) / tokens).collect();
                (name, mean)
            })
            .collect()
    };
    let ours = in_hf(&total);
    let norm = |g: &[f64]| g.iter().map(|x| x * x).sum::<f64>().sqrt();
    let gradients = reference["gradients"].as_object().unwrap();
    assert!(
        gradients.len() >= 40,
        "{} reference gradients",
        gradients.len()
    );
    for (name, want) in gradients {
        let g = ours
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let want_norm = want["norm"].as_f64().unwrap();
        let tol = 1e-4 * want_norm + 1e-8;
        assert!(
            (norm(g) - want_norm).abs() <= tol,
            "{name}: gradient norm {} vs transformers' {want_norm}",
            norm(g)
        );
        for (j, w) in want["first"].as_array().unwrap().iter().enumerate() {
            let w = w.as_f64().unwrap();
            assert!(
                (g[j] - w).abs() <= tol,
                "{name}[{j}]: {} vs transformers' {w}",
                g[j]
            );
        }
    }
    let (_, main) = value_and_grad(&cfg, &values, &rows, Of::Main);
    let embedding = "model.embed_tokens.weight";
    let want = gradients[embedding]["norm"].as_f64().unwrap();
    let alone = norm(&in_hf(&main)[embedding]);
    assert!(
        (alone - want).abs() > 1e-4 * want + 1e-8,
        "mirror: the main loss alone gives the embedding a gradient of norm {alone}, the \
         reference {want}"
    );
}

/// A depth of 2 and a negative or non-finite factor: usage errors naming the key; the mirrors
/// (depth 1, factor 0) are accepted.
#[test]
fn bad_mtp_values_are_usage_errors_naming_the_key() {
    let check = |args: &[&str]| {
        let all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        TrainConfig::load(None, &all).and_then(|c| c.plan().map(drop))
    };
    for (arg, key) in [
        ("mtp_num_layers=2", "mtp_num_layers"),
        ("mtp_loss_scaling_factor=-0.1", "mtp_loss_scaling_factor"),
        ("mtp_loss_scaling_factor=nan", "mtp_loss_scaling_factor"),
        ("mtp_loss_scaling_factor=inf", "mtp_loss_scaling_factor"),
    ] {
        let e = check(&["dataset_type=synthetic", arg]).unwrap_err();
        assert!(e.is_usage() && e.to_string().contains(key), "{arg}: {e}");
    }
    check(&[
        "dataset_type=synthetic",
        "mtp_num_layers=1",
        "mtp_loss_scaling_factor=0",
    ])
    .unwrap();
}

/// ZeRO-1 carries the module's parameters with no special path: its weights (the module's
/// included) match the replicated optimizer's (within `common::adamw_weight_bound`), as the
/// plain model's do.
#[test]
fn zero1_carries_the_module() {
    let mtp = ["mtp_num_layers=1", common::COMPARABLE_ADAM_EPS];
    let plain = run(&mtp);
    let zero1 = run(&[&mtp[..], &["shard_optimizer_over_data=true"]].concat());
    assert!(zero1.zero1.is_open());
    let d = common::max_abs_diff(&zero1, &plain);
    assert!(
        d <= common::adamw_weight_bound(0.01),
        "max absolute weight difference {d}"
    );
    let n = plain.params.len();
    assert_eq!(
        plain.params[n - 1].name,
        "model.layers.2.shared_head.norm.weight"
    );
}

/// Abstract mode (`ferrotext plan`) types a step with the module on 4 devices: the deferral
/// holds there too (no gradient all-reduce inside a micro-batch).
#[test]
fn an_abstract_step_types_the_module() {
    let cfg = small_config(&["mtp_num_layers=1", "gradient_accumulation_steps=2"]);
    let plan = cfg.plan().unwrap();
    let source = source_for(&cfg, 256).unwrap();
    let (gate, trace) = ferrotext_train::plan_step(&plan, source.into()).unwrap();
    assert!(gate.is_open());
    let big = trace.all_reduces_larger_than(1, &PhasePattern::new("micro_batch*"));
    assert!(big.is_empty(), "{big:?}");
    assert!(!trace
        .all_reduces_larger_than(1, &PhasePattern::new("update*"))
        .is_empty());
}

/// A bf16 run (`dtype=bfloat16`) trains the module too: finite losses, and other numbers than
/// the float32 run's.
#[test]
fn a_bf16_run_trains_the_module() {
    // `.ci/kernel-paths` runs this on kernels without a bf16 product (OpenBLAS as Debian
    // builds it, gemm): the bf16 products run on ferrotext's own kernel there.
    ferrotext_tensor::allow_bf16_fallback().unwrap();
    let f32_run = run(&["mtp_num_layers=1"]);
    let bf16 = run(&["mtp_num_layers=1", "dtype=bfloat16"]);
    for m in &bf16.metrics {
        assert!(
            m.loss.is_finite() && m.mtp_loss.is_some_and(f64::is_finite),
            "{m:?}"
        );
    }
    assert_ne!(bf16.metrics[0].mtp_loss, f32_run.metrics[0].mtp_loss);
}

/// A checkpoint in the middle of a step with the module on: the restored engine finishes the
/// step with the uninterrupted run's loss and weights, bit for bit.
#[test]
fn a_mid_step_resume_with_the_module_is_bitwise() {
    let cfg = small_config(&[
        "mtp_num_layers=1",
        "gradient_accumulation_steps=2",
        "learning_rate=0.01",
    ]);
    let root = scratch("mid-step");
    let plan = cfg.plan().unwrap();
    let mesh = plan.compute_mesh().clone();
    let source: std::sync::Arc<dyn ferrotext_train::data::TokenSource> =
        std::sync::Arc::from(source_for(&cfg, 256).unwrap());
    let out = run_spmd(&mesh, &SpmdOptions::default(), |dev| {
        let mut cx = Ctx::new(dev.comm(), 1);
        let s = source.as_ref();
        let mut a = Engine::new(&mut cx, &plan, None)?;
        let mut a_losses = Vec::new();
        for step in 0..2u64 {
            for micro in 0..2 {
                common::feed(&mut cx, &mut a, s, &cfg, step, micro)?;
            }
            a_losses.push(a.update(&mut cx)?.loss.to_bits());
        }
        let mut b = Engine::new(&mut cx, &plan, None)?;
        for micro in 0..2 {
            common::feed(&mut cx, &mut b, s, &cfg, 0, micro)?;
        }
        b.update(&mut cx)?;
        common::feed(&mut cx, &mut b, s, &cfg, 1, 0)?;
        b.save_checkpoint(&mut cx, &root)?;
        drop(b);
        let mut c = Engine::new(&mut cx, &plan, None)?;
        c.restore_checkpoint(&mut cx, &root)?;
        common::feed(&mut cx, &mut c, s, &cfg, 1, 1)?;
        let last = c.update(&mut cx)?;
        assert_eq!(last.loss.to_bits(), a_losses[1]);
        assert!(last.mtp_loss.is_some());
        Ok::<_, TrainError>((a.params_to_host(&mut cx)?, c.params_to_host(&mut cx)?))
    })
    .unwrap();
    let (a, c) = &out[0];
    assert_eq!(
        a, c,
        "weights after a mid-step save and restore are bitwise equal"
    );
    std::fs::remove_dir_all(&root).ok();
}
