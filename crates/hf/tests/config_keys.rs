//! `config.json` in both generations, and every key of each family pinned: transformers' own key
//! lists (`fixtures/transformers/keys/<model_type>-<gen>.json`, written by transformers' config
//! classes) are all in the reader's table, and each table entry is probed against a preset
//! written out by ferrotext: a read key's probe changes the decoder config, a refused key's bad
//! value is refused naming the key, an irrelevant key's changed value changes nothing.

// Test data and reference values, computed and compared within this process: the C
// library's bits are fine here (`clippy.toml`).
#![allow(clippy::disallowed_methods)]

use std::path::Path;

use ferrotext_hf::{
    class_defaults, config_from_json, hf_config_json, key_use, listed_keys, KeyUse, ModelType,
};
use ferrotext_models::decoder::Config;
use serde_json::{json, Value};

/// The config each family's probes start from: a preset for the first five (qwen3_moe without
/// the shared expert it has not), else the family's f32 fixture written by transformers 4.x.
fn baseline(kind: ModelType) -> Config {
    let name = match kind.name() {
        "qwen3" => "qwen3-tiny",
        "qwen3_moe" => "qwen3-moe-tiny",
        "deepseek_v3" => "deepseek3-tiny",
        "llama" => "llama3-tiny",
        "qwen2" => "qwen2-tiny",
        other => return fixture_config(other),
    };
    let mut cfg = Config::preset(name).unwrap();
    if let Some(m) = cfg.moe.as_mut().filter(|_| kind.name() == "qwen3_moe") {
        m.shared_experts = 0;
    }
    if let Some(a) = cfg.mla {
        cfg.head_dim = a.qk_rope_head_dim;
    }
    cfg
}

/// The decoder config of the last (by name) 4.x f32 fixture of `model_type`.
fn fixture_config(model_type: &str) -> Config {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().to_string();
            n.contains("-tf4-f32-")
                && std::fs::read_to_string(p.join("config.json"))
                    .ok()
                    .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                    .is_some_and(|v| v["model_type"] == model_type)
        })
        .collect();
    dirs.sort();
    let dir = dirs
        .last()
        .unwrap_or_else(|| panic!("no fixture of {model_type}"));
    ferrotext_hf::read_config(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// The family named `name`.
fn family(name: &str) -> ModelType {
    ModelType::from_name(name).unwrap_or_else(|| panic!("no family {name}"))
}

/// `v` (4.x form, as ferrotext writes it) in transformers 5's form: `rope_theta` and
/// `rope_scaling` folded into `rope_parameters` (`type` becoming `rope_type`), the expert count
/// as `num_local_experts`, `torch_dtype` as `dtype`.
fn to_v5(v: &Value) -> Value {
    let mut v = v.clone();
    let obj = v.as_object_mut().unwrap();
    let mut rope = match obj.remove("rope_scaling") {
        Some(Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    if let Some(t) = rope.remove("type") {
        rope.insert("rope_type".into(), t);
    }
    rope.entry("rope_type").or_insert(json!("default"));
    rope.insert("rope_theta".into(), obj.remove("rope_theta").unwrap());
    obj.insert("rope_parameters".into(), Value::Object(rope));
    // transformers 5's alias of the expert count, where its class has one.
    let aliased = match obj["model_type"].as_str() {
        Some("qwen3_moe") => Some("num_experts"),
        Some("deepseek_v3") => Some("n_routed_experts"),
        _ => None,
    };
    if let Some(n) = aliased.and_then(|old| obj.remove(old)) {
        obj.insert("num_local_experts".into(), n);
    }
    // transformers 5's alias of the MTP depth (its attribute map), probed in that form.
    if let Some(n) = obj.remove("num_nextn_predict_layers") {
        obj.insert("num_mtp_layers".into(), n);
    }
    if let Some(d) = obj.remove("torch_dtype") {
        obj.insert("dtype".into(), d);
    }
    v
}

/// The silent bug: transformers 5's qwen3 keeps θ in `rope_parameters`; it was read as
/// the default 10000.
#[test]
fn qwen3_theta_under_rope_parameters_is_read() {
    let v4 = hf_config_json(&baseline(family("qwen3")), "float32").unwrap();
    let v5 = to_v5(&v4);
    assert!(v5.get("rope_theta").is_none());
    assert_eq!(v5["rope_parameters"]["rope_theta"], json!(1_000_000.0));
    let cfg = config_from_json(&v5).unwrap();
    assert_eq!(cfg.rope_max_timescale, 1_000_000.0);
    let mut no_theta = v5.clone();
    no_theta["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("rope_theta");
    assert_eq!(
        config_from_json(&no_theta).unwrap().rope_max_timescale,
        10_000.0,
        "mirror: without θ anywhere, transformers' default"
    );
}

/// Every family's preset reads the same from its 4.x and its 5 form.
#[test]
fn both_generations_read_to_the_same_config() {
    for kind in ModelType::all() {
        let cfg = baseline(kind);
        let v4 = hf_config_json(&cfg, "float32").unwrap();
        assert_eq!(config_from_json(&v4).unwrap(), cfg, "{} 4.x", kind.name());
        let v5 = to_v5(&v4);
        assert_eq!(
            config_from_json(&v5).unwrap(),
            cfg,
            "{} 5: {v5}",
            kind.name()
        );
    }
}

/// The llama3 scaling and DeepSeek's YaRN arrive in full, from either generation.
#[test]
fn scaled_rope_keys_arrive_in_full() {
    let l = baseline(family("llama")).rope_llama3.unwrap();
    assert_eq!(
        (
            l.factor,
            l.low_freq_factor,
            l.high_freq_factor,
            l.original_max_position
        ),
        (32.0, 1.0, 4.0, 8192)
    );
    let v5 = to_v5(&hf_config_json(&baseline(family("llama")), "float32").unwrap());
    assert_eq!(v5["rope_parameters"]["rope_type"], json!("llama3"));
    let cfg = config_from_json(&v5).unwrap();
    assert_eq!(cfg.rope_llama3, Some(l));
    assert_eq!(cfg.rope_max_timescale, 500_000.0);
    let y = baseline(family("deepseek_v3")).rope_yarn.unwrap();
    let v5 = to_v5(&hf_config_json(&baseline(family("deepseek_v3")), "float32").unwrap());
    assert_eq!(v5["rope_parameters"]["rope_type"], json!("yarn"));
    assert_eq!(config_from_json(&v5).unwrap().rope_yarn, Some(y));
}

/// `deepseek_v3`'s `rope_interleave` is read (default true, as transformers').
#[test]
fn rope_interleave_is_read_with_transformers_default() {
    let mut v = hf_config_json(&baseline(family("deepseek_v3")), "float32").unwrap();
    v["rope_interleave"] = json!(false);
    let cfg = config_from_json(&v).unwrap();
    assert!(!cfg.mla.unwrap().rope_interleave);
    assert!(!cfg.rope().interleaved);
    v.as_object_mut().unwrap().remove("rope_interleave");
    let cfg = config_from_json(&v).unwrap();
    assert!(cfg.mla.unwrap().rope_interleave && cfg.rope().interleaved);
}

fn refusal(v: &Value) -> String {
    config_from_json(v).expect_err("refused")
}

/// Two generations that disagree, a key the rope type does not define, a type the family has
/// not: each refused, named with its value.
#[test]
fn conflicting_or_unknown_rope_keys_are_refused_by_name() {
    let v4 = hf_config_json(&baseline(family("qwen3")), "float32").unwrap();
    let mut both = to_v5(&v4);
    both["rope_theta"] = json!(10_000.0);
    assert!(
        refusal(&both).contains("rope_theta=10000 and rope_parameters.rope_theta=1000000"),
        "{}",
        refusal(&both)
    );
    both["rope_theta"] = json!(1_000_000.0);
    assert!(config_from_json(&both).is_ok(), "mirror: agreeing θ");
    let mut odd = to_v5(&v4);
    odd["rope_parameters"]["factor"] = json!(2.0);
    assert!(refusal(&odd).contains("rope_parameters.factor=2.0 (not read for rope_type default)"));
    let mut longrope = to_v5(&v4);
    longrope["rope_parameters"]["rope_type"] = json!("longrope");
    assert!(refusal(&longrope).contains(
        "rope_parameters.rope_type=\"longrope\" (qwen3 reads default or linear or dynamic or \
         yarn or llama3)"
    ));
    let mut llama3_in_deepseek =
        to_v5(&hf_config_json(&baseline(family("deepseek_v3")), "f").unwrap());
    llama3_in_deepseek["rope_parameters"] =
        to_v5(&hf_config_json(&baseline(family("llama")), "f").unwrap())["rope_parameters"].clone();
    assert!(refusal(&llama3_in_deepseek)
        .contains("rope_type=\"llama3\" (deepseek_v3 reads default or yarn)"));
    let mut llama3 = to_v5(&hf_config_json(&baseline(family("llama")), "f").unwrap());
    assert!(
        config_from_json(&llama3).is_ok(),
        "mirror: a whole llama3 object"
    );
    let parameters = llama3["rope_parameters"].as_object_mut().unwrap();
    parameters.remove("original_max_position_embeddings");
    assert!(
        refusal(&llama3).contains("rope_type llama3 needs `original_max_position_embeddings`"),
        "{}",
        refusal(&llama3)
    );
    let mut moe = to_v5(&hf_config_json(&baseline(family("qwen3_moe")), "f").unwrap());
    moe["num_experts"] = json!(5);
    assert!(refusal(&moe).contains("num_experts=5 and num_local_experts=8"));
    let mut ds = hf_config_json(&baseline(family("deepseek_v3")), "f").unwrap();
    ds["rope_scaling"]["truncate"] = json!(false);
    assert!(
        refusal(&ds).contains("rope_scaling.truncate=false"),
        "{}",
        refusal(&ds)
    );
}

/// YaRN's two mscales as transformers uses them (hand-computed for factor 40):
/// `get_mscale(40, m) = 0.1·m·ln 40 + 1`; the softmax takes `get_mscale(40, mscale_all_dim)²`,
/// the rotation `get_mscale(40, mscale) / get_mscale(40, mscale_all_dim)`, or
/// `get_mscale(40, 1)` when either is missing (and then the softmax nothing).
#[test]
fn yarn_mscales_split_between_the_softmax_and_the_rotation_as_transformers_does() {
    let base = hf_config_json(&baseline(family("deepseek_v3")), "f").unwrap();
    let ln40 = 40f32.ln();
    let yarn = |edit: &dyn Fn(&mut serde_json::Map<String, Value>)| {
        let mut v = base.clone();
        let rs = v["rope_scaling"].as_object_mut().unwrap();
        rs.remove("attention_factor");
        edit(rs);
        config_from_json(&v).unwrap().rope_yarn.unwrap()
    };
    let y = yarn(&|rs| {
        rs.insert("mscale".into(), json!(1.0));
        rs.insert("mscale_all_dim".into(), json!(0.8));
    });
    assert_eq!(y.mscale, 0.8);
    let want = (0.1 * ln40 + 1.0) / (0.08 * ln40 + 1.0);
    assert!(
        (y.attention_factor - want).abs() < 1e-6,
        "{}",
        y.attention_factor
    );
    let y = yarn(&|rs| {
        rs.remove("mscale_all_dim");
    });
    assert_eq!(y.mscale, 0.0);
    assert!((y.attention_factor - (0.1 * ln40 + 1.0)).abs() < 1e-6);
    let y = yarn(&|rs| {
        rs.insert("attention_factor".into(), json!(0.5));
    });
    assert_eq!(y.attention_factor, 0.5, "given, it wins");
    let y = yarn(&|_| {});
    assert_eq!((y.mscale, y.attention_factor), (1.0, 1.0), "equal mscales");
}

/// A value standing for "changed" of the same JSON kind as `x` (a number +1, a bool flipped).
fn changed(x: Option<&Value>) -> Value {
    match x {
        Some(Value::Bool(b)) => json!(!b),
        Some(Value::Number(n)) => json!(n.as_f64().unwrap() + 1.0),
        Some(Value::String(s)) => json!(format!("{s}-changed")),
        Some(Value::Array(_)) => json!([]),
        _ => json!(7),
    }
}

/// Every table entry of every family, probed: read keys change the config, refused values are
/// refused naming the key, irrelevant keys change nothing.
#[test]
fn every_listed_key_does_what_the_table_says() {
    for kind in ModelType::all() {
        let cfg = baseline(kind);
        let v4 = hf_config_json(&cfg, "float32").unwrap();
        let v5 = to_v5(&v4);
        for (key, u) in listed_keys(kind) {
            let at = format!("{} `{key}` ({u:?})", kind.name());
            // The 5.x-only keys are probed in the 5.x form, the others in the 4.x one.
            let base = if ["rope_parameters", "num_local_experts", "num_mtp_layers"].contains(&key)
            {
                &v5
            } else {
                &v4
            };
            let mut v = base.clone();
            match u {
                KeyUse::Read { probe } => {
                    // A per-layer list describes the old layer count: a count probe drops it.
                    if key == "num_hidden_layers" {
                        v.as_object_mut().unwrap().remove("layer_types");
                    }
                    // An alias is probed alone: the name it stands for is removed.
                    if key == "num_experts" {
                        for canonical in ["n_routed_experts", "num_local_experts"] {
                            v.as_object_mut().unwrap().remove(canonical);
                        }
                    }
                    // A baseline already holding the probe's value (a fixture written the
                    // other way round) is probed with the value it does not hold.
                    let probe: Value = serde_json::from_str(probe).unwrap();
                    v[key] = if base.get(key) == Some(&probe) {
                        changed(Some(&probe))
                    } else {
                        probe
                    };
                    let got = config_from_json(&v).unwrap_or_else(|e| panic!("{at}: {e}"));
                    assert_ne!(got, cfg, "{at}: the probe changed nothing");
                }
                KeyUse::Refused { bad, .. } => {
                    v[key] = serde_json::from_str(bad).unwrap();
                    let err = config_from_json(&v).expect_err(&at);
                    assert!(err.contains(key), "{at}: {err}");
                }
                KeyUse::Irrelevant(_) if key == "model_type" => {} // chooses the family itself
                KeyUse::Irrelevant(_) => {
                    v[key] = changed(base.get(key));
                    let got = config_from_json(&v).unwrap_or_else(|e| panic!("{at}: {e}"));
                    assert_eq!(got, cfg, "{at}");
                }
            }
        }
    }
}

/// transformers' own key lists: every key its config class defines for each supported type, in
/// each generation, is in the reader's table.
#[test]
fn every_key_transformers_defines_is_pinned() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers/keys");
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        let Some((model_type, _generation)) = stem.rsplit_once('-') else {
            continue;
        };
        let Some(kind) = ModelType::from_name(model_type) else {
            continue; // a type ferrotext does not read: refused whole by model_type
        };
        let text = std::fs::read_to_string(&path).unwrap();
        let list: Value = serde_json::from_str(&text).unwrap();
        // `defaults`: `to_dict()` of a default config; `attribute_map`: the aliases a
        // config.json may use for them.
        let keys: Vec<String> = ["defaults", "attribute_map"]
            .iter()
            .filter_map(|part| list.get(part).and_then(Value::as_object))
            .flat_map(|m| m.keys().cloned())
            .collect();
        assert!(!keys.is_empty(), "{}", path.display());
        let missing: Vec<&String> = keys.iter().filter(|k| key_use(kind, k).is_none()).collect();
        assert!(missing.is_empty(), "{stem}: keys not pinned: {missing:?}");
        seen.push(stem);
    }
    for kind in ModelType::all() {
        assert!(
            seen.iter()
                .any(|s| s.starts_with(&format!("{}-", kind.name()))),
            "no key list for {} in {} (have {seen:?})",
            kind.name(),
            dir.display()
        );
    }
}

/// The MTP depth: 1 is read (either name), 2 is refused naming the key and the value, and an
/// export writes the model's depth back under the published name.
#[test]
fn the_mtp_depth_is_read_and_two_is_refused() {
    let mut cfg = baseline(family("deepseek_v3"));
    cfg.mtp_num_layers = 1;
    let v4 = hf_config_json(&cfg, "float32").unwrap();
    assert_eq!(v4["num_nextn_predict_layers"], 1);
    assert_eq!(config_from_json(&v4).unwrap().mtp_num_layers, 1);
    assert_eq!(config_from_json(&to_v5(&v4)).unwrap().mtp_num_layers, 1);
    let mut two = v4.clone();
    two["num_nextn_predict_layers"] = 2.into();
    let e = config_from_json(&two).unwrap_err();
    assert!(e.contains("num_nextn_predict_layers=2"), "{e}");
    // No other family has the layer in transformers: its export is refused, naming it.
    let mut qwen = baseline(family("qwen3"));
    qwen.mtp_num_layers = 1;
    let e = hf_config_json(&qwen, "float32").unwrap_err();
    assert!(e.contains("mtp_num_layers=1 in qwen3"), "{e}");
}

/// transformers' dumps of each family's default config, per generation:
/// `(stem, kind, defaults)` from `fixtures/transformers/keys/<model_type>-<gen>.json`.
fn default_dumps() -> Vec<(String, ModelType, Value)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers/keys");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        let Some(kind) = stem
            .rsplit_once('-')
            .and_then(|(t, _)| ModelType::from_name(t))
        else {
            continue;
        };
        let list: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        out.push((stem, kind, list["defaults"].clone()));
    }
    assert_eq!(out.len(), 2 * ModelType::all().len(), "{out:?}");
    out
}

/// The value transformers' dump gives a key under any of its names.
fn dumped<'a>(dump: &'a Value, names: &[&str]) -> Option<&'a Value> {
    names.iter().find_map(|n| dump.get(*n))
}

/// The reader's defaults are transformers' class defaults, in both generations: each listed
/// value equals the one transformers' own dump holds for the key.
#[test]
fn the_class_defaults_are_transformers_own() {
    for (stem, kind, dump) in default_dumps() {
        for (names, value) in class_defaults(kind) {
            let ours: Value = serde_json::from_str(value).unwrap();
            let theirs = dumped(&dump, names).unwrap_or_else(|| panic!("{stem}: {names:?}"));
            let equal = match (ours.as_f64(), theirs.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => ours == *theirs,
            };
            assert!(
                equal,
                "{stem} {names:?}: ours {ours}, transformers {theirs}"
            );
        }
    }
}

/// A `config.json` holding only its `model_type` reads as transformers' whole default config
/// (every key written out, as its dump has them): a key left out means the class default.
/// The MTP depth is set aside: transformers 5's default declares one layer, which
/// `read_config` keeps only when the weights hold it, and a config alone cannot say.
#[test]
fn a_config_of_its_model_type_alone_reads_as_transformers_default_config() {
    for (stem, kind, dump) in default_dumps() {
        let from_dump = config_from_json(&dump).map(|mut c| {
            c.mtp_num_layers = 0;
            c
        });
        let alone = config_from_json(&json!({ "model_type": kind.name() }));
        if from_dump.is_err() {
            // transformers' default config itself has no model (deepseek_v2's class leaves
            // num_experts_per_tok unset): neither reads.
            assert!(alone.is_err(), "{stem}: {alone:?}");
            continue;
        }
        assert_eq!(alone, from_dump, "{stem}");
        assert!(alone.is_ok(), "{stem}: {alone:?}");
    }
}

/// Key by key, on the directories transformers itself wrote (`fixtures/transformers/*/`): a
/// listed key removed reads as the key written with transformers' default (4.x dump for the
/// 4.x directories, 5's for 5's), and the default differs from what the directory has where
/// it can, so the check is not of a key nobody reads.
#[test]
fn each_key_left_out_reads_as_transformers_class_default() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers");
    let dumps = default_dumps();
    let mut checked = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
            continue;
        };
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let written: Value = serde_json::from_str(&text).unwrap();
        let kind = ModelType::from_name(written["model_type"].as_str().unwrap()).unwrap();
        let generation = if name.contains("-tf4-") { "tf4" } else { "tf5" };
        let (_, _, dump) = dumps
            .iter()
            .find(|(s, k, _)| *k == kind && s.ends_with(generation))
            .unwrap();
        for (names, _) in class_defaults(kind) {
            let key = names
                .iter()
                .find(|n| written.get(**n).is_some())
                .unwrap_or(&names[0]);
            let mut with_default = written.clone();
            with_default[*key] = dumped(dump, names).unwrap().clone();
            let mut left_out = written.clone();
            for n in *names {
                left_out.as_object_mut().unwrap().remove(*n);
            }
            assert_eq!(
                config_from_json(&left_out),
                config_from_json(&with_default),
                "{name}: `{key}` left out"
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked}");
}

/// The silent ones the rule fixes (a DeepSeek-V3 or Qwen3 config leaving out a key whose
/// transformers default is not ferrotext's preset value), and the `null` forms transformers'
/// `__post_init__` resolves from other keys.
#[test]
fn keys_left_out_take_the_class_default_and_null_ones_are_derived() {
    let mut v = hf_config_json(&baseline(family("deepseek_v3")), "float32").unwrap();
    for key in [
        "norm_topk_prob",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "n_shared_experts",
        "first_k_dense_replace",
    ] {
        v.as_object_mut().unwrap().remove(key);
    }
    let m = config_from_json(&v).unwrap().moe.unwrap();
    assert!(m.norm_topk_prob);
    assert_eq!(m.routed_scaling_factor, 2.5);
    assert_eq!(
        (m.groups.n_routing_groups, m.groups.topk_routing_group),
        (8, 4)
    );
    assert_eq!((m.shared_experts, m.first_num_dense_layers), (1, 3));

    let mut v = hf_config_json(&baseline(family("qwen3")), "float32").unwrap();
    let heads = v["num_attention_heads"].as_u64().unwrap() as usize;
    assert_ne!(
        heads, 32,
        "the probe needs a head count other than the default"
    );
    for key in ["head_dim", "num_key_value_heads"] {
        v.as_object_mut().unwrap().remove(key);
    }
    let cfg = config_from_json(&v).unwrap();
    assert_eq!((cfg.head_dim, cfg.base_num_kv_heads), (128, 32));
    v["num_key_value_heads"] = Value::Null;
    assert_eq!(config_from_json(&v).unwrap().base_num_kv_heads, heads);

    // Llama derives both from the sizes when they are left out.
    let mut v = hf_config_json(&baseline(family("llama")), "float32").unwrap();
    for key in ["head_dim", "num_key_value_heads"] {
        v.as_object_mut().unwrap().remove(key);
    }
    let cfg = config_from_json(&v).unwrap();
    assert_eq!(cfg.head_dim, cfg.base_emb_dim / cfg.base_num_query_heads);
    assert_eq!(cfg.base_num_kv_heads, cfg.base_num_query_heads);
}

/// Readers that derive YaRN's rotation factor from the two mscales and ignore
/// `attention_factor` (DeepSeek's own modeling code, vLLM: `mscale` defaults to 1 there) get
/// from an exported DeepSeek config the factor they get from transformers' own directory, and
/// the softmax the same `mscale_all_dim`: for every DeepSeek YaRN fixture (V2-Lite's equal
/// mscales 0.707, V3's 1.0 against 0.8).
#[test]
fn exported_deepseek_yarn_gives_mscale_readers_the_same_rotation() {
    // DeepSeek's `yarn_get_mscale`, in f64.
    let get_mscale = |factor: f64, m: f64| {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * m * factor.ln() + 1.0
        }
    };
    let rotation = |rope: &Value| {
        let factor = rope["factor"].as_f64().unwrap();
        let m = rope.get("mscale").and_then(Value::as_f64).unwrap_or(1.0);
        let all = rope
            .get("mscale_all_dim")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        (get_mscale(factor, m) / get_mscale(factor, all), all)
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers");
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
            continue;
        };
        let theirs: Value = serde_json::from_str(&text).unwrap();
        let Some(rope) = ["rope_scaling", "rope_parameters"]
            .iter()
            .filter_map(|k| theirs.get(*k))
            .find(|r| r.get("mscale_all_dim").is_some())
        else {
            continue;
        };
        let cfg = ferrotext_hf::read_config(&dir).unwrap();
        let ours = hf_config_json(&cfg, "float32").unwrap();
        let (want, want_all) = rotation(rope);
        let (got, got_all) = rotation(&ours["rope_scaling"]);
        assert!(
            (got - want).abs() < 1e-6 && (got_all - want_all).abs() < 1e-6,
            "{name}: an mscale reader's rotation {got} (mscale_all_dim {got_all}) against \
             {want} ({want_all}) from transformers' directory; written {}",
            ours["rope_scaling"]
        );
        seen.push(name);
    }
    for family in ["deepseek_v2-yarn", "deepseek_v3-yarn"] {
        assert!(
            seen.iter().any(|s| s.starts_with(family)),
            "no {family} fixture: {seen:?}"
        );
    }
}

/// An exported Qwen config's `max_window_layers` slides, for readers of that key alone
/// (transformers without `layer_types`: the layers from it on), the layers its `layer_types`
/// names, for every Qwen sliding fixture (its first layer full, the rest sliding); and a
/// pattern no `max_window_layers` says (sliding, then full) is written as the layer count.
#[test]
fn exported_max_window_layers_slides_the_layers_layer_types_names() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers");
    let mut seen = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        if !name.starts_with("qwen") || !name.contains("-sliding-") {
            continue;
        }
        let cfg = ferrotext_hf::read_config(&dir).unwrap();
        let v = hf_config_json(&cfg, "float32").unwrap();
        let from = v["max_window_layers"].as_u64().unwrap() as usize;
        let by_key: Vec<bool> = (0..cfg.base_num_decoder_layers)
            .map(|i| i >= from)
            .collect();
        let by_types: Vec<bool> = v["layer_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t == "sliding_attention")
            .collect();
        assert_eq!(by_key, by_types, "{name}: {v}");
        assert!(
            by_types.contains(&true) && by_types.contains(&false),
            "{name}"
        );
        // The same config with the pattern the other way round.
        let mut flipped = cfg.clone();
        let w = flipped.sliding_window.as_mut().unwrap();
        w.layers = by_types.iter().map(|s| !s).collect();
        let v = hf_config_json(&flipped, "float32").unwrap();
        assert_eq!(
            v["max_window_layers"].as_u64().unwrap() as usize,
            cfg.base_num_decoder_layers,
            "{name}"
        );
        seen += 1;
    }
    assert!(
        seen >= 4,
        "the qwen2/qwen3 sliding fixtures of both generations: {seen}"
    );
}

/// A qwen2_moe model with a `head_dim` other than hidden_size / heads (read from a transformers
/// 5 directory, whose attention reads the key) is written with it and reads back the same; one
/// with the derived head dimension is written without the key, as transformers writes it.
#[test]
fn a_qwen2_moe_head_dim_of_its_own_is_written_and_reads_back() {
    let mut cfg = fixture_config("qwen2_moe");
    let derived = cfg.base_emb_dim / cfg.base_num_query_heads;
    assert_eq!(cfg.head_dim, derived);
    let v = hf_config_json(&cfg, "float32").unwrap();
    assert!(v.get("head_dim").is_none(), "{v}");
    cfg.head_dim = derived + 4;
    let v = hf_config_json(&cfg, "float32").unwrap();
    assert_eq!(v["head_dim"], derived + 4);
    assert_eq!(config_from_json(&v).unwrap(), cfg);
}
