//! Malformed Hugging Face directories through the binary (issue 15, "bad input"): for `ferrotext
//! train load_parameters_path=DIR`, every one gets exactly one `error:` line, exit code 2, and no
//! run directory. The library pins the messages in `crates/train/tests/hf.rs`; this pins what the
//! user sees.

use std::path::{Path, PathBuf};

use ferrotext_hf as hf;
use ferrotext_models::decoder::Decoder;
use ferrotext_sharding::DType;
use ferrotext_train::io;
use serde_json::Value;

mod common;
use common::ferrotext;

/// A small qwen3-tiny, fast to train.
const MODEL: [&str; 5] = [
    "base_emb_dim=32",
    "base_mlp_dim=64",
    "head_dim=8",
    "max_target_length=16",
    "steps=1",
];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotext-hfin-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `ferrotext train` of the small model into `out/run`, loading `params`.
fn train_from(out: &Path, params: &Path) -> std::process::Output {
    let base = format!("base_output_directory={}", out.display());
    let load = format!("load_parameters_path={}", params.display());
    let mut args = vec!["train", &base, "run_name=run", &load];
    args.extend(MODEL);
    ferrotext(&args)
}

/// Copies the flat directory `from` to `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("dir");
    for entry in std::fs::read_dir(from).expect("readable") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, to.join(path.file_name().expect("a name"))).expect("copy");
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("JSON");
    f(&mut v);
    std::fs::write(path, serde_json::to_vec(&v).expect("JSON")).expect("write");
}

/// Rewrites the header of the safetensors file `path` (the data stays as it is).
fn edit_header(path: &Path, f: impl FnOnce(&mut Value)) {
    let bytes = std::fs::read(path).expect("readable");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("a header");
    f(&mut header);
    let mut text = serde_json::to_vec(&header).expect("JSON");
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).expect("write");
}

/// The shard of a sharded directory that holds `name`.
fn shard_of(dir: &Path, name: &str) -> PathBuf {
    let index: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("JSON");
    dir.join(index["weight_map"][name].as_str().expect("listed"))
}

#[test]
fn malformed_hf_directories_get_one_error_line_exit_2_and_no_run_directory() {
    let root = scratch("bad");
    // A good directory, written by `train` itself, and a sharded copy of it.
    let good = root.join("good");
    let res = ferrotext(&[
        "train",
        &format!("base_output_directory={}", root.join("first").display()),
        "run_name=run",
        &format!("save_parameters_path={}", good.display()),
        MODEL[0],
        MODEL[1],
        MODEL[2],
        MODEL[3],
        MODEL[4],
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let sharded = root.join("sharded");
    let cfg = hf::read_config(&good).expect("config.json");
    let decoder = Decoder::new(cfg).expect("valid");
    let infos = decoder.params();
    let values = io::load_parameters(&good, &infos).expect("loads");
    hf::save_directory(
        &sharded,
        decoder.config(),
        &infos,
        &values,
        DType::BF16,
        20_000,
    )
    .expect("saved");
    // Both load.
    for dir in [&good, &sharded] {
        let out = root.join("ok");
        let res = train_from(&out, dir);
        assert!(
            res.status.success(),
            "{}",
            String::from_utf8_lossy(&res.stderr)
        );
        std::fs::remove_dir_all(&out).ok();
    }

    type Break = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, bool, Break, &str)> =
        vec![
        (
            "missing-index-entry",
            true,
            Box::new(|d: &Path| {
                edit_json(&d.join("model.safetensors.index.json"), |v| {
                    v["weight_map"]
                        .as_object_mut()
                        .expect("a map")
                        .remove("model.norm.weight");
                })
            }),
            "1 missing tensor(s) (not in model.safetensors.index.json): `model.norm.weight`",
        ),
        (
            "missing-shard",
            true,
            Box::new(|d: &Path| {
                edit_json(&d.join("model.safetensors.index.json"), |v| {
                    v["weight_map"]["model.norm.weight"] =
                        "model-00099-of-00099.safetensors".into();
                })
            }),
            "shard `model-00099-of-00099.safetensors` listed in model.safetensors.index.json \
             cannot be read",
        ),
        (
            "header",
            true,
            Box::new(|d: &Path| {
                std::fs::write(shard_of(d, "model.norm.weight"), b"\xff\xff\xff\xff not one")
                    .expect("write")
            }),
            "the safetensors header does not parse",
        ),
        (
            "dtype",
            false,
            Box::new(|d: &Path| {
                edit_header(&d.join("model.safetensors"), |h| {
                    h["model.norm.weight"]["dtype"] = "I32".into();
                })
            }),
            "`model.norm.weight` is I32 (supported: F32, BF16, F16)",
        ),
        (
            "shape",
            true,
            Box::new(|d: &Path| {
                edit_json(&d.join("config.json"), |v| v["num_key_value_heads"] = 4.into())
            }),
            "`model.layers.0.self_attn.k_proj.weight` has shape [16, 32], config.json needs \
             [32, 32]",
        ),
        (
            "renamed",
            false,
            Box::new(|d: &Path| {
                edit_header(&d.join("model.safetensors"), |h| {
                    let map = h.as_object_mut().expect("a map");
                    let t = map.remove("model.norm.weight").expect("present");
                    map.insert("model.final_norm.weight".into(), t);
                })
            }),
            "1 missing tensor(s) (not in model.safetensors): `model.norm.weight`; 1 unexpected \
             tensor(s): `model.final_norm.weight`",
        ),
        (
            "non-finite",
            false,
            Box::new(|d: &Path| {
                let path = d.join("model.safetensors");
                let mut bytes = std::fs::read(&path).expect("readable");
                let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
                let header: Value = serde_json::from_slice(&bytes[8..8 + n]).expect("a header");
                let at = header["model.norm.weight"]["data_offsets"][0]
                    .as_u64()
                    .expect("an offset") as usize
                    + 8
                    + n
                    + 4 * 3;
                bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
                std::fs::write(&path, bytes).expect("write");
            }),
            "`model.norm.weight` holds a non-finite value (NaN) at flat index 3",
        ),
        (
            "model-type",
            false,
            Box::new(|d: &Path| {
                edit_json(&d.join("config.json"), |v| v["model_type"] = "gpt2".into())
            }),
            // The list grows with the family registry: its first entries are pinned.
            "model_type `gpt2` is not supported (qwen3, qwen3_moe, deepseek_v3, llama",
        ),
        (
            "feature",
            true,
            Box::new(|d: &Path| {
                edit_json(&d.join("config.json"), |v| {
                    v["mlp_bias"] = true.into();
                    v["partial_rotary_factor"] = 0.5.into();
                })
            }),
            "model_type `qwen3` with features the decoder does not have: \
             partial_rotary_factor=0.5, mlp_bias=true",
        ),
        (
            // A value that would train on NaN is refused before anything runs.
            "rope-theta",
            false,
            Box::new(|d: &Path| {
                edit_json(&d.join("config.json"), |v| v["rope_theta"] = (-1.0).into())
            }),
            "`rope_theta` must be a positive number, got -1",
        ),
        (
            "config-not-json",
            false,
            Box::new(|d: &Path| std::fs::write(d.join("config.json"), "{").expect("write")),
            "config.json: is not JSON",
        ),
        (
            "no-weights",
            false,
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("model.safetensors")).expect("remove")
            }),
            "has neither model.safetensors nor model.safetensors.index.json",
        ),
    ];
    for (name, from_sharded, break_it, needle) in cases {
        let dir = root.join(name);
        copy_dir(if from_sharded { &sharded } else { &good }, &dir);
        break_it(&dir);
        let out = root.join(format!("{name}-out"));
        let res = train_from(&out, &dir);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{name}: {stderr}");
        assert!(stderr.starts_with("error: "), "{name}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{name}: one line: {stderr}");
        assert!(stderr.contains(needle), "{name}: {stderr}");
        assert!(!out.exists(), "{name}: wrote {}", out.display());
    }
    std::fs::remove_dir_all(&root).ok();
}
