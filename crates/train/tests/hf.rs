//! Hugging Face directories in and out (issue 15), and HF names throughout saved files (issue 13):
//! save → load gives identical values; a reference forward written here from the HF model
//! definitions (f64, reading only the saved files by HF names) gives ferrotext's logits; every
//! malformed directory gets one clear error.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;
use common::scratch::{scratch, Scratch};

use ferrotext_comm::{run_spmd, SpmdOptions};
use ferrotext_hf as hf;
use ferrotext_models::decoder::{Config, Decoder, MoeSettings};
use ferrotext_models::deepseek::MlaSettings;
use ferrotext_models::moe::RouterScore;
use ferrotext_models::{ParamInfo, Rng};
use ferrotext_sharding::DType;
use ferrotext_sharding::{Mesh, NamedSharding, PartitionSpec};
use ferrotext_spmd::{Array, Ctx};
use ferrotext_tensor::Tensor;
use ferrotext_train::io;
use safetensors::SafeTensors;
use serde_json::Value;

fn dense() -> Config {
    Config {
        vocab_size: 50,
        base_emb_dim: 16,
        base_num_decoder_layers: 2,
        base_num_query_heads: 4,
        base_num_kv_heads: 2,
        head_dim: 8,
        base_mlp_dim: 24,
        logits_via_embedding: true,
        qk_norm: true,
        ..Config::default()
    }
}

/// Qwen3-MoE: 4 experts top-2, renormalised, the first layer dense, untied head.
fn moe() -> Config {
    Config {
        base_num_decoder_layers: 3,
        logits_via_embedding: false,
        moe: Some(MoeSettings {
            num_experts: 4,
            moe_mlp_dim: 12,
            first_num_dense_layers: 1,
            ..MoeSettings::default()
        }),
        ..dense()
    }
}

/// DeepSeek-V3-shaped: MLA, sigmoid router, a shared expert.
fn deepseek() -> Config {
    let mut c = moe();
    c.head_dim = 2;
    c.qk_norm = false;
    c.mla = Some(MlaSettings {
        q_lora_rank: 6,
        kv_lora_rank: 4,
        qk_nope_head_dim: 4,
        qk_rope_head_dim: 2,
        v_head_dim: 3,
        rope_interleave: true,
        latent_norm_eps: 1e-6,
    });
    if let Some(m) = c.moe.as_mut() {
        m.score = RouterScore::Sigmoid;
        m.shared_experts = 1;
        m.routed_scaling_factor = 2.5;
        m.routed_bias = true;
    }
    c
}

/// Random values for every parameter: matrices N(0, 0.3²), norm scales 1 + N(0, 0.1²).
fn values(infos: &[ParamInfo], seed: u64) -> Vec<Tensor> {
    infos
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut rng = Rng::new(seed, i as u64);
            let norm = p.shape.len() == 1;
            Tensor::from_fn(&p.shape, |_| {
                let z = rng.normal() as f32;
                if norm {
                    1.0 + 0.1 * z
                } else {
                    0.3 * z
                }
            })
        })
        .collect()
}

fn model(cfg: &Config) -> (Decoder, Vec<ParamInfo>, Vec<Tensor>) {
    let d = Decoder::new(cfg.clone()).unwrap();
    let infos = d.params();
    let v = values(&infos, 7);
    (d, infos, v)
}

/// Every tensor of a saved directory (or file), by name, read with `safetensors` alone.
struct Files {
    tensors: BTreeMap<String, (Vec<usize>, Vec<f64>)>,
}

impl Files {
    fn read(path: &Path) -> Files {
        let files: Vec<PathBuf> = if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            if index.exists() {
                let v: Value =
                    serde_json::from_str(&std::fs::read_to_string(index).unwrap()).unwrap();
                let mut f: Vec<String> = v["weight_map"]
                    .as_object()
                    .unwrap()
                    .values()
                    .map(|x| x.as_str().unwrap().to_string())
                    .collect();
                f.sort();
                f.dedup();
                f.into_iter().map(|n| path.join(n)).collect()
            } else {
                vec![path.join("model.safetensors")]
            }
        } else {
            vec![path.to_path_buf()]
        };
        let mut tensors = BTreeMap::new();
        for file in files {
            let bytes = std::fs::read(file).unwrap();
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                let data: Vec<f64> = match view.dtype() {
                    safetensors::Dtype::F32 => view
                        .data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                        .collect(),
                    safetensors::Dtype::BF16 => view
                        .data()
                        .chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f64())
                        .collect(),
                    other => panic!("{other:?}"),
                };
                tensors.insert(name, (view.shape().to_vec(), data));
            }
        }
        Files { tensors }
    }

    fn get(&self, name: &str) -> &[f64] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("no tensor `{name}`"))
            .1
    }

    fn shape(&self, name: &str) -> &[usize] {
        &self.tensors[name].0
    }
}

// ---------------------------------------------------------------------------------------------
// Issue 13: HF names and orientation in every saved file.

#[test]
fn a_saved_moe_mla_file_uses_hf_names_and_orientation() {
    let dir = scratch("names");
    let (_, infos, vals) = model(&deepseek());
    let path = dir.join("p.safetensors");
    io::save_parameters(&path, &infos, &vals).unwrap();
    let files = Files::read(&path);
    let by_name = |n: &str| {
        let k = infos.iter().position(|p| p.name == n).unwrap();
        &vals[k]
    };
    // A matrix `[in, out]` here is HF's `[out, in]`: HF[o][i] = ours[i][o].
    for (ours, theirs) in [
        (
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        ),
        (
            "model.layers.2.mlp.gate.weight",
            "model.layers.2.mlp.gate.weight",
        ),
        (
            "model.layers.2.mlp.shared_expert.down_proj.weight",
            "model.layers.2.mlp.shared_experts.down_proj.weight",
        ),
        ("lm_head.weight", "lm_head.weight"),
    ] {
        let v = by_name(ours);
        let (r, c) = (v.shape()[0], v.shape()[1]);
        assert_eq!(files.shape(theirs), &[c, r], "{theirs}");
        let hf = files.get(theirs);
        for i in 0..r {
            for o in 0..c {
                assert_eq!(hf[o * r + i], v.data()[i * c + o] as f64, "{theirs}");
            }
        }
    }
    // Stacked experts `[E, in, out]` are E tensors `[out, in]`.
    let up = by_name("model.layers.1.mlp.experts.up_proj");
    let (e, d, f) = (up.shape()[0], up.shape()[1], up.shape()[2]);
    for x in 0..e {
        let name = format!("model.layers.1.mlp.experts.{x}.up_proj.weight");
        assert_eq!(files.shape(&name), &[f, d]);
        let hf = files.get(&name);
        for i in 0..d {
            for o in 0..f {
                assert_eq!(hf[o * d + i], up.data()[(x * d + i) * f + o] as f64);
            }
        }
    }
    // No name that HF does not know: nothing stacked, nothing renamed.
    for name in files.tensors.keys() {
        assert!(
            !name.ends_with("_proj") && !name.contains("shared_expert."),
            "{name}"
        );
    }
    let hf_count: usize = infos.iter().map(|p| p.hf_tensors().len()).sum();
    assert_eq!(files.tensors.len(), hf_count);
    // And back: identical values.
    assert_eq!(io::load_parameters(&path, &infos).unwrap(), vals);
    std::fs::remove_dir_all(&dir).ok();
}

// ---------------------------------------------------------------------------------------------
// Issue 15: directories.

fn roundtrip(
    cfg: &Config,
    dtype: DType,
    shard_bytes: u64,
) -> (Scratch, Vec<ParamInfo>, Vec<Tensor>) {
    let out = scratch(&format!(
        "rt-{}-{dtype:?}-{shard_bytes}",
        cfg.base_num_decoder_layers
    ))
    .at("model");
    let (_, infos, vals) = model(cfg);
    hf::save_directory(&out, cfg, &infos, &vals, dtype, shard_bytes).unwrap();
    assert_eq!(hf::read_config(&out).unwrap(), *cfg);
    let loaded = io::load_parameters(&out, &infos).unwrap();
    let kind = hf::ModelType::of(cfg).unwrap();
    let expect: Vec<Tensor> = match dtype {
        DType::BF16 => vals
            .iter()
            .zip(&infos)
            .map(|(t, info)| {
                // DeepSeek's routers stay f32, as transformers 5 stores them.
                if info.hf_tensors().iter().all(|(n, _)| kind.keeps_f32(n)) {
                    return t.clone();
                }
                let data = t
                    .data()
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_f32())
                    .collect();
                Tensor::new(t.shape().to_vec(), data).unwrap()
            })
            .collect(),
        _ => vals.clone(),
    };
    assert_eq!(loaded, expect);
    (out, infos, vals)
}

#[test]
fn save_then_load_gives_identical_values_single_and_sharded() {
    for cfg in [dense(), moe(), deepseek()] {
        let (out, _, _) = roundtrip(&cfg, DType::F32, hf::DEFAULT_SHARD_BYTES);
        assert!(out.join("model.safetensors").is_file());
        assert!(!out.join("model.safetensors.index.json").exists());
        // Sharded: every shard at most 4 KB unless one tensor is larger.
        let (out, _, _) = roundtrip(&cfg, DType::F32, 4096);
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let shards: std::collections::BTreeSet<&str> = index["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(shards.len() > 2, "{shards:?}");
        for s in shards {
            assert!(out.join(s).is_file(), "{s}");
        }
        std::fs::remove_dir_all(out.parent().unwrap()).ok();
    }
}

#[test]
fn bf16_directories_hold_bf16_and_load_as_the_rounded_values() {
    let (out, _, _) = roundtrip(&moe(), DType::BF16, 8192);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "qwen3_moe");
    assert_eq!(config["torch_dtype"], "bfloat16");
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let first = index["weight_map"]["model.embed_tokens.weight"]
        .as_str()
        .unwrap();
    let bytes = std::fs::read(out.join(first)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.tensor("model.embed_tokens.weight").unwrap().dtype(),
        safetensors::Dtype::BF16
    );
    std::fs::remove_dir_all(out.parent().unwrap()).ok();
}

#[test]
fn a_single_bf16_or_f16_file_loads_as_a_parameter_file() {
    // A lone `model.safetensors` named as a file (not its directory): the same values as the
    // directory gives (bf16 rounding included), through the file path of `load_parameters`.
    for cfg in [dense(), deepseek()] {
        let (out, infos, _) = roundtrip(&cfg, DType::BF16, hf::DEFAULT_SHARD_BYTES);
        let from_dir = io::load_parameters(&out, &infos).unwrap();
        let file = out.join("model.safetensors");
        assert_eq!(io::load_parameters(&file, &infos).unwrap(), from_dir);
        // F16 too: the file rewritten with every tensor in half precision
        let bytes = std::fs::read(&file).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let halves: Vec<(String, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                // bf16, or f32 where the family keeps a tensor so (DeepSeek's routers)
                let values: Vec<f32> = match view.dtype() {
                    safetensors::Dtype::BF16 => view
                        .data()
                        .chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect(),
                    _ => view
                        .data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                };
                let data = values
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                    .collect();
                (name, view.shape().to_vec(), data)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = halves
            .iter()
            .map(|(n, shape, d)| {
                let v =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F16, shape.clone(), d)
                        .unwrap();
                (n.clone(), v)
            })
            .collect();
        let f16_file = out.parent().unwrap().join("params-f16.safetensors");
        std::fs::write(&f16_file, safetensors::serialize(views, &None).unwrap()).unwrap();
        let from_f16 = io::load_parameters(&f16_file, &infos).unwrap();
        for (a, b) in from_f16.iter().zip(&from_dir) {
            for (x, y) in a.data().iter().zip(b.data()) {
                assert_eq!(*x, half::f16::from_f32(*y).to_f32());
            }
        }
        // A tensor the model does not have is refused, by name.
        let err = io::load_parameters(&file, &infos[..infos.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("unexpected tensor"), "{err}");
        std::fs::remove_dir_all(out.parent().unwrap()).ok();
    }
}

// ---------------------------------------------------------------------------------------------
// The reference forward, from the HF definitions (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`),
// in f64, reading the saved directory by HF names only.

const B: usize = 2;
const T: usize = 6;

fn tokens(vocab: usize) -> Vec<u32> {
    (0..B * T).map(|i| ((i * 17 + 5) % vocab) as u32).collect()
}

/// `y[o] = Σ_i W[o][i] x[i]` for HF's `W: [out, in]`.
fn linear(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let inp = x.len();
    (0..out)
        .map(|o| (0..inp).map(|i| w[o * inp + i] * x[i]).sum())
        .collect()
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, s)| v * r * s).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// `rotate_half` RoPE of one head vector at position `pos`.
fn rope(x: &mut [f64], pos: usize, theta: f64) {
    let half = x.len() / 2;
    for i in 0..half {
        let freq = theta.powf(-2.0 * i as f64 / x.len() as f64);
        let (s, c) = (pos as f64 * freq).sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

fn swiglu(f: &Files, prefix: &str, h: &[f64], width: usize) -> Vec<f64> {
    let g = linear(f.get(&format!("{prefix}.gate_proj.weight")), h, width);
    let u = linear(f.get(&format!("{prefix}.up_proj.weight")), h, width);
    let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
    linear(f.get(&format!("{prefix}.down_proj.weight")), &a, h.len())
}

/// Logits `[B·T][vocab]` of the HF model in `dir`.
fn reference_logits(dir: &Path, ids: &[u32]) -> Vec<Vec<f64>> {
    let c: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let f = Files::read(dir);
    let n = |k: &str| c[k].as_u64().unwrap() as usize;
    let (vocab, d, layers) = (n("vocab_size"), n("hidden_size"), n("num_hidden_layers"));
    let (heads, kv, hd) = (
        n("num_attention_heads"),
        n("num_key_value_heads"),
        n("head_dim"),
    );
    let eps = c["rms_norm_eps"].as_f64().unwrap();
    let theta = c["rope_theta"].as_f64().unwrap();
    let moe = c["model_type"] == "qwen3_moe";
    let dense_layers: Vec<usize> = c["mlp_only_layers"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap() as usize).collect())
        .unwrap_or_default();
    let embed = f.get("model.embed_tokens.weight");
    let mut out = Vec::new();
    for b in 0..B {
        let seq = &ids[b * T..(b + 1) * T];
        let mut x: Vec<Vec<f64>> = seq
            .iter()
            .map(|&t| embed[t as usize * d..(t as usize + 1) * d].to_vec())
            .collect();
        for l in 0..layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            // attention
            let mut q = Vec::new();
            let mut k = Vec::new();
            let mut v = Vec::new();
            for (pos, xt) in x.iter().enumerate() {
                let h = rms_norm(xt, f.get(&p("input_layernorm.weight")), eps);
                let mut qt = linear(f.get(&p("self_attn.q_proj.weight")), &h, heads * hd);
                let mut kt = linear(f.get(&p("self_attn.k_proj.weight")), &h, kv * hd);
                let vt = linear(f.get(&p("self_attn.v_proj.weight")), &h, kv * hd);
                for head in qt.chunks_mut(hd) {
                    let normed = rms_norm(head, f.get(&p("self_attn.q_norm.weight")), eps);
                    head.copy_from_slice(&normed);
                    rope(head, pos, theta);
                }
                for head in kt.chunks_mut(hd) {
                    let normed = rms_norm(head, f.get(&p("self_attn.k_norm.weight")), eps);
                    head.copy_from_slice(&normed);
                    rope(head, pos, theta);
                }
                q.push(qt);
                k.push(kt);
                v.push(vt);
            }
            let group = heads / kv;
            for t in 0..T {
                let mut attn = vec![0.0; heads * hd];
                for h in 0..heads {
                    let g = h / group;
                    let qh = &q[t][h * hd..(h + 1) * hd];
                    let scores: Vec<f64> = (0..=t)
                        .map(|s| {
                            let kh = &k[s][g * hd..(g + 1) * hd];
                            qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (s, w) in e.iter().enumerate() {
                        for j in 0..hd {
                            attn[h * hd + j] += w / z * v[s][g * hd + j];
                        }
                    }
                }
                let o = linear(f.get(&p("self_attn.o_proj.weight")), &attn, d);
                for j in 0..d {
                    x[t][j] += o[j];
                }
            }
            // feed-forward
            for xt in x.iter_mut() {
                let h = rms_norm(xt, f.get(&p("post_attention_layernorm.weight")), eps);
                let y = if moe && !dense_layers.contains(&l) {
                    let e = n("num_experts");
                    let logits = linear(f.get(&p("mlp.gate.weight")), &h, e);
                    let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let ex: Vec<f64> = logits.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = ex.iter().sum();
                    let probs: Vec<f64> = ex.iter().map(|v| v / z).collect();
                    let mut order: Vec<usize> = (0..e).collect();
                    order.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]));
                    let top = &order[..n("num_experts_per_tok")];
                    let norm: f64 = if c["norm_topk_prob"].as_bool().unwrap() {
                        top.iter().map(|&i| probs[i]).sum()
                    } else {
                        1.0
                    };
                    let mut y = vec![0.0; d];
                    for &i in top {
                        let yi = swiglu(
                            &f,
                            &p(&format!("mlp.experts.{i}")),
                            &h,
                            n("moe_intermediate_size"),
                        );
                        for j in 0..d {
                            y[j] += probs[i] / norm * yi[j];
                        }
                    }
                    y
                } else {
                    swiglu(&f, &p("mlp"), &h, n("intermediate_size"))
                };
                for j in 0..d {
                    xt[j] += y[j];
                }
            }
        }
        let head = if c["tie_word_embeddings"].as_bool().unwrap() {
            embed
        } else {
            f.get("lm_head.weight")
        };
        for xt in &x {
            let h = rms_norm(xt, f.get("model.norm.weight"), eps);
            out.push(linear(head, &h, vocab));
        }
    }
    out
}

/// ferrotext's logits `[B·T][vocab]` for `values` on one device.
fn ferrotext_logits(model: &Decoder, values: &[Tensor], ids: &[u32]) -> Vec<Vec<f64>> {
    let mesh = Arc::new(Mesh::explicit([("data", 1)]).unwrap());
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
        let batch = PartitionSpec::new([Some("data"), None]);
        let ids = cx.ids_from_global(&[B, T], batch, ids)?;
        let logits = model.logits(&mut cx, &params, &ids)?;
        cx.to_host(&logits)
    })
    .unwrap();
    let logits = out.into_iter().next().unwrap();
    let vocab = model.config().vocab_size;
    logits
        .data()
        .chunks(vocab)
        .map(|r| r.iter().map(|&x| x as f64).collect())
        .collect()
}

fn check_reference_forward(cfg: &Config) {
    let dir = scratch(&format!("ref-{}", cfg.moe.is_some()));
    let (model, infos, vals) = model(cfg);
    let out = dir.join("model");
    hf::save_directory(&out, cfg, &infos, &vals, DType::F32, 4096).unwrap();
    let ids = tokens(cfg.vocab_size);
    let want = reference_logits(&out, &ids);
    let got = ferrotext_logits(&model, &vals, &ids);
    let mut worst = 0.0f64;
    for (w, g) in want.iter().zip(&got) {
        for (a, b) in w.iter().zip(g) {
            worst = worst.max((a - b).abs());
        }
    }
    let spread = want.iter().flatten().fold(0.0f64, |m, x| m.max(x.abs()));
    assert!(spread > 0.1, "logits too small to compare: {spread}");
    assert!(
        worst <= 1e-4,
        "max |Δlogit| = {worst} (max |logit| {spread})"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn reference_forward_from_the_saved_files_matches_dense() {
    check_reference_forward(&dense());
}

#[test]
fn reference_forward_from_the_saved_files_matches_moe() {
    check_reference_forward(&moe());
}

// ---------------------------------------------------------------------------------------------
// Bad input: one clear error each.

fn load_error(dir: &Path) -> String {
    let result = hf::read_config(dir)
        .map_err(ferrotext_train::TrainError::from)
        .and_then(|cfg| {
            let infos = Decoder::new(cfg).unwrap().params();
            io::load_parameters(dir, &infos)
        });
    let msg = result.unwrap_err().to_string();
    assert_eq!(msg.lines().count(), 1, "{msg}");
    msg
}

/// A fresh sharded copy of the MoE model to break.
fn sharded(name: &str) -> Scratch {
    let out = scratch(name).at("model");
    let (_, infos, vals) = model(&moe());
    hf::save_directory(&out, &moe(), &infos, &vals, DType::F32, 4096).unwrap();
    out
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn malformed_directories_get_one_clear_error_each() {
    // a missing index entry
    let out = sharded("bad-index");
    edit_json(&out.join("model.safetensors.index.json"), |v| {
        v["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove("model.layers.1.mlp.experts.2.up_proj.weight");
    });
    let e = load_error(&out);
    assert!(
        e.contains("1 missing tensor(s) (not in model.safetensors.index.json): `model.layers.1.mlp.experts.2.up_proj.weight`"),
        "{e}"
    );
    // a shard that does not exist
    let out = sharded("bad-shard");
    edit_json(&out.join("model.safetensors.index.json"), |v| {
        v["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors".into();
    });
    let e = load_error(&out);
    assert!(
        e.contains("shard `model-00099-of-00099.safetensors` listed in model.safetensors.index.json cannot be read"),
        "{e}"
    );
    // a header that does not parse
    let out = sharded("bad-header");
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = index["weight_map"]["model.norm.weight"]
        .as_str()
        .unwrap()
        .to_string();
    std::fs::write(out.join(&shard), b"\xff\xff\xff\xff not a header").unwrap();
    let e = load_error(&out);
    assert!(
        e.contains(&format!("`{shard}`: the safetensors header does not parse")),
        "{e}"
    );
    // an unsupported dtype
    let dir = scratch("bad-dtype");
    let (_, infos, vals) = model(&dense());
    let out = dir.join("model");
    hf::save_directory(&out, &dense(), &infos, &vals, DType::F32, u64::MAX).unwrap();
    let file = Files::read(&out);
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors
        .iter()
        .map(|(n, (s, d))| {
            let bytes = d.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect();
            (n.clone(), safetensors::Dtype::F32, s.clone(), bytes)
        })
        .collect();
    for t in owned.iter_mut().filter(|t| t.0 == "model.norm.weight") {
        t.1 = safetensors::Dtype::F64;
        t.3 = t.3.iter().flat_map(|&b| [b, 0]).collect();
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &out.join("model.safetensors")).unwrap();
    let e = load_error(&out);
    assert!(
        e.contains("`model.norm.weight` is F64 (supported: F32, BF16, F16)"),
        "{e}"
    );
    // shapes that do not match config.json
    let out = sharded("bad-shape");
    edit_json(&out.join("config.json"), |v| {
        v["moe_intermediate_size"] = 10.into()
    });
    let e = load_error(&out);
    assert!(
        e.contains("`model.layers.1.mlp.experts.0.gate_proj.weight` has shape [12, 16], config.json needs [10, 16]"),
        "{e}"
    );
    assert!(e.contains("more"), "{e}");
    // an unknown model_type, and unsupported features, named
    let out = sharded("bad-type");
    edit_json(&out.join("config.json"), |v| {
        v["model_type"] = "gpt2".into()
    });
    let e = load_error(&out);
    // The list grows with the family registry: its first entries and every family are named.
    assert!(
        e.contains("model_type `gpt2` is not supported (qwen3, qwen3_moe, deepseek_v3, llama"),
        "{e}"
    );
    assert!(
        hf::ModelType::all().iter().all(|t| e.contains(t.name())),
        "{e}"
    );
    edit_json(&out.join("config.json"), |v| {
        v["model_type"] = "qwen3_moe".into();
        v["layer_types"] = serde_json::json!(["sliding_attention", "full_attention"]);
    });
    let e = load_error(&out);
    assert!(
        e.contains("features the decoder does not have: layer_types="),
        "{e}"
    );
    // an unexpected tensor
    let dir = scratch("bad-extra");
    let (_, mut infos, mut vals) = model(&dense());
    let out = dir.join("model");
    let mut extra = infos[1].clone();
    extra.name = "model.layers.0.mystery.weight".into();
    extra.hf = ferrotext_models::HfLayout::Tensor {
        name: extra.name.clone(),
        transposed: false,
    };
    infos.push(extra);
    vals.push(vals[1].clone());
    hf::save_directory(&out, &dense(), &infos, &vals, DType::F32, u64::MAX).unwrap();
    let e = load_error(&out);
    assert!(
        e.contains("1 unexpected tensor(s): `model.layers.0.mystery.weight`"),
        "{e}"
    );
}

#[test]
fn a_model_no_hf_family_expresses_is_refused_before_anything_is_written() {
    let dir = scratch("refused");
    let mut cfg = moe();
    if let Some(m) = cfg.moe.as_mut() {
        m.shared_experts = 1;
    }
    let (_, infos, vals) = model(&cfg);
    let out = dir.join("model");
    let e = hf::save_directory(&out, &cfg, &infos, &vals, DType::F32, u64::MAX)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shared_experts=1 (qwen3_moe has none)"), "{e}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).ok();
}

// ---------------------------------------------------------------------------------------------
// DeepSeek-V3's router selection bias.

/// Rewrites the file of directory `out` that holds `name` (by the index), with `f` applied to the
/// list of `(name, dtype, shape, bytes)` of that file.
#[allow(clippy::type_complexity)]
fn rewrite_file_of(
    out: &Path,
    name: &str,
    f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let file = out.join(index["weight_map"][name].as_str().unwrap());
    let bytes = std::fs::read(&file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    f(&mut owned);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &file).unwrap();
}

/// DeepSeek-V3's router selection bias is a parameter (`routed_bias`): written under
/// `mlp.gate.e_score_correction_bias` with its values, read back with them (a nonzero bias is
/// the published model's, not an error); a model built without it writes zeros, which every
/// router reads as no bias.
#[test]
fn deepseek_v3_directories_carry_the_selection_bias_values() {
    let (out, infos, vals) = roundtrip(&deepseek(), DType::F32, 4096);
    let files = Files::read(&out);
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let bias = |l: usize| format!("model.layers.{l}.mlp.gate.e_score_correction_bias");
    assert!(!files.tensors.contains_key(&bias(0)));
    for l in [1, 2] {
        let k = infos.iter().position(|p| p.name == bias(l)).unwrap();
        assert_eq!(files.shape(&bias(l)), [4], "{}", bias(l));
        let want: Vec<f64> = vals[k].data().iter().map(|&x| f64::from(x)).collect();
        assert_eq!(files.get(&bias(l)), want.as_slice());
        assert!(want.iter().any(|&x| x != 0.0));
        assert!(index["weight_map"][bias(l)].is_string());
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "deepseek_v3");
    assert_eq!(config["topk_method"], "noaux_tc");
    // Mirror: without `routed_bias` the directory still carries the tensor, as zeros.
    let mut plain = deepseek();
    if let Some(m) = plain.moe.as_mut() {
        m.routed_bias = false;
    }
    let (_, infos, vals) = model(&plain);
    let dir = scratch("no-routed-bias").at("model");
    hf::save_directory(&dir, &plain, &infos, &vals, DType::F32, u64::MAX).unwrap();
    let zeros = Files::read(&dir);
    assert_eq!(zeros.get(&bias(2)), [0.0; 4].as_slice());
    // qwen3_moe's router has no such bias.
    let (qwen, _, _) = roundtrip(&moe(), DType::F32, u64::MAX);
    assert!(!Files::read(&qwen)
        .tensors
        .keys()
        .any(|n| n.ends_with("e_score_correction_bias")));
    // A bias of the wrong shape, and one for a layer without a router, are refused.
    rewrite_file_of(&out, &bias(2), |tensors| {
        for t in tensors.iter_mut().filter(|t| t.0 == bias(2)) {
            t.2 = vec![3];
            t.3 = vec![0; 12];
        }
    });
    let e = load_error(&out);
    assert!(
        e.contains(&format!(
            "`{}` has shape [3], config.json needs [4]",
            bias(2)
        )),
        "{e}"
    );
    rewrite_file_of(&out, &bias(2), |tensors| {
        for t in tensors.iter_mut().filter(|t| t.0 == bias(2)) {
            t.2 = vec![4];
            t.3 = vec![0; 16];
        }
        tensors.push((bias(0), safetensors::Dtype::F32, vec![4], vec![0; 16]));
    });
    let mut index = index;
    index["weight_map"][bias(0)] = index["weight_map"][bias(2)].clone();
    std::fs::write(
        out.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    let e = load_error(&out);
    assert!(
        e.contains(&format!("1 unexpected tensor(s): `{}`", bias(0))),
        "{e}"
    );
    std::fs::remove_dir_all(out.parent().unwrap()).ok();
    std::fs::remove_dir_all(dir.parent().unwrap()).ok();
    std::fs::remove_dir_all(qwen.parent().unwrap()).ok();
}

/// A key that sets a weight's shape, on a model loaded from a HF directory, is refused when
/// it differs from the directory's `config.json` — before anything is loaded, naming the key
/// and the directory's value (the loader would only list the tensors, against
/// `config.json`). The mirror: each key set to the directory's own value plans.
#[test]
fn shape_keys_that_contradict_the_source_directory_are_refused_by_name() {
    let dir = sharded("shape-keys");
    let plan = |extra: &[String]| {
        let mut overrides = vec![
            format!("load_parameters_path={}", dir.display()),
            "dataset_type=synthetic".to_string(),
        ];
        overrides.extend_from_slice(extra);
        ferrotext_train::TrainConfig::parse(None, &overrides).and_then(|c| c.plan())
    };
    assert!(plan(&[]).is_ok(), "{:?}", plan(&[]).err());
    let m = moe();
    let e = m.moe.clone().unwrap();
    let held: [(&str, usize); 11] = [
        ("vocab_size", m.vocab_size),
        ("base_emb_dim", m.base_emb_dim),
        ("base_num_decoder_layers", m.base_num_decoder_layers),
        ("base_num_query_heads", m.base_num_query_heads),
        ("base_num_kv_heads", m.base_num_kv_heads),
        ("head_dim", m.head_dim),
        ("base_mlp_dim", m.base_mlp_dim),
        ("num_experts", e.num_experts),
        ("moe_mlp_dim", e.moe_mlp_dim),
        ("shared_experts", e.shared_experts),
        ("first_num_dense_layers", e.first_num_dense_layers),
    ];
    for (key, value) in held {
        let same = plan(&[format!("{key}={value}")]);
        assert!(same.is_ok(), "{key}={value}: {:?}", same.err());
        let other = value + 2;
        let err = plan(&[format!("{key}={other}")]).expect_err(key);
        let msg = err.to_string();
        assert!(
            matches!(&err, ferrotext_train::TrainError::Usage { key: k, .. } if k == key),
            "{key}: {msg}"
        );
        assert!(
            msg.contains(&format!("{key} = {other} does not fit the model in"))
                && msg.contains(&format!("whose config.json has {value}")),
            "{msg}"
        );
    }
}
