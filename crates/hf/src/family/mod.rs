//! Model families: each HF `model_type` the decoder runs is one file here, holding everything
//! that is the family's own and nothing else: its `config.json` reader for both transformers
//! generations (4.x and 5) with its config class's defaults, the table of what the reader does
//! with each key its class defines (read, refused naming the key, or irrelevant to the math),
//! the mapping of those keys onto the decoder's typed building blocks, what a decoder config
//! must be for the family to express it (export), the keys export writes, and its weights' HF
//! names where they differ from the decoder's.
//!
//! # Adding a family
//! A file `<model_type>.rs` with its `pub(super) const FAMILY: Family`, its `mod` line and one
//! entry in [`FAMILIES`] below, and its tests (a fixture variant written by transformers, its key
//! lists). Nothing else changes: loading, export, the key tests and the fixture tests all walk
//! the registry.
//!
//! # Why the families live in `hf`
//! A family's reader parses `config.json` and its key table cites transformers' classes: that is
//! knowledge of a file format, which the `models` layer must not have (docs/design.md §2). The
//! building blocks a family maps onto (attention variants, norms, MLPs, routers) are the
//! decoder's, in `models`, and know nothing of families; `hf` already depends on `models`, so a
//! family file sees both sides of its mapping and nothing has to depend on `hf` to run a model.
//!
//! Invariants: every key a family's transformers config class defines is read, refused when its
//! value asks for math the decoder does not do (named with the value), or irrelevant to the
//! math; `table.rs` holds the tables every family shares, each family file its own, and
//! `tests/config_keys.rs` walks transformers' own key lists against them. Keys a class does not
//! define are ignored, as transformers ignores them. A key the file leaves out takes the class's
//! default, as `from_pretrained` gives it (`defaults.rs`). The RoPE keys, in either generation,
//! are read in `rope.rs`.

#[macro_use]
mod defaults;
mod common;
mod preset;
mod reader;
mod rope;
mod table;

// The families, one file each; [`FAMILIES`] lists them.
mod deepseek_v2;
mod deepseek_v3;
mod gemma2;
mod gemma3_text;
mod llama;
mod mistral;
mod mixtral;
mod olmo2;
mod qwen2;
mod qwen2_moe;
mod qwen3;
mod qwen3_moe;

pub use defaults::class_defaults;
pub(crate) use preset::Preset;
pub use preset::{preset, presets, PresetInfo};
pub(crate) use reader::Keys;
pub use table::{key_use, listed_keys, KeyUse};

use std::path::Path;

use ferrotext_models::decoder::Config;
use ferrotext_models::ParamInfo;
use serde_json::Value;

use crate::error::HfError;

/// Every family, in the order export tries them (the first that expresses a model writes it)
/// and messages list them.
const FAMILIES: &[&Family] = &[
    &qwen3::FAMILY,
    &qwen3_moe::FAMILY,
    &deepseek_v3::FAMILY,
    &llama::FAMILY,
    &qwen2::FAMILY,
    &mistral::FAMILY,
    &mixtral::FAMILY,
    &qwen2_moe::FAMILY,
    &olmo2::FAMILY,
    &gemma2::FAMILY,
    &gemma3_text::FAMILY,
    &deepseek_v2::FAMILY,
];

/// One family: what its file declares (see the module docs).
pub(crate) struct Family {
    /// `config.json`'s `model_type`.
    pub model_type: &'static str,
    /// The key tables of its config class, most specific first ([`table::GENERIC`] is every
    /// family's last resort).
    pub keys: &'static [&'static [(&'static str, KeyUse)]],
    /// transformers' class defaults: what a key means when `config.json` leaves it out.
    pub defaults: &'static [defaults::ClassDefault],
    /// The RoPE types it reads besides `default`.
    pub rope_types: &'static [&'static str],
    /// Its YaRN is DeepSeek's (4.x takes the factor from the positions' ratio: refused unless
    /// the two agree).
    pub deepseek_yarn: bool,
    /// The config whose RoPE keys hold the full-attention layers' RoPE, when it is not the
    /// config itself (Gemma 3's per-layer-type `rope_parameters`); `None`: the config.
    pub rope_view: fn(&Value) -> Option<Value>,
    /// The decoder config of a `config.json` of this family (its RoPE keys are read after, by
    /// `rope.rs`, for every family alike); what the decoder does not compute goes to
    /// `Keys::unsupported`.
    pub read: fn(&mut Keys<'_>) -> Result<Config, String>,
    /// Why this family cannot express `cfg` (empty: it can), each `feature (why)`.
    pub misfit: fn(&Config) -> Vec<String>,
    /// The `config.json` keys of `cfg` beyond the ones every family writes
    /// ([`common::base_json`]).
    pub write: fn(&Config) -> Value,
    /// A tensor its checkpoints store after `info` that no parameter declares (`info`, all the
    /// parameters): DeepSeek-V3's zero router selection bias.
    pub extra_tensor: ExtraTensor,
    /// Its checkpoints' name of a tensor the decoder names `name` (HF's usual names), `None`
    /// where they are the same (Mixtral's `block_sparse_moe.experts.{e}.w1`, ...).
    pub rename: fn(&str) -> Option<String>,
    /// Its named models (`model_name=`), as `config.json` keys its reader reads.
    pub presets: &'static [Preset],
    /// The tensors its `save_pretrained` stores as float32 whatever the model's dtype (by the
    /// end of their checkpoint name, after [`Family::rename`]): transformers 5's
    /// `_keep_in_fp32_modules_strict`, DeepSeek's router weight and selection bias.
    pub kept_f32: &'static [&'static str],
}

/// A family's [`Family::extra_tensor`]: the `(name, shape)` of a tensor its checkpoints store
/// after a parameter (`info`, all the parameters) that no parameter declares.
pub(crate) type ExtraTensor = fn(&ParamInfo, &[ParamInfo]) -> Option<(String, Vec<usize>)>;

/// The config itself holds the RoPE keys (every family but Gemma 3).
pub(crate) fn same_rope_view(_: &Value) -> Option<Value> {
    None
}

/// The decoder's names are the checkpoints' (every family but Mixtral).
pub(crate) fn no_rename(_: &str) -> Option<String> {
    None
}

/// The checkpoint names of the HF directory `dir`'s family (read from its `config.json`'s
/// `model_type`): the decoder's names unless its family renames them. A directory without a
/// readable `config.json` or of no known family keeps the decoder's names.
pub(crate) fn checkpoint_names(dir: &Path) -> fn(&str) -> Option<String> {
    let text = ferrotext_files::read_regular_to_string(&dir.join(super::CONFIG_FILE)).ok();
    let model_type = text
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get("model_type")?.as_str().map(str::to_string));
    model_type
        .and_then(|t| ModelType::from_name(&t))
        .map_or(no_rename, |k| k.family().rename)
}

/// No tensor beyond the declared ones (most families).
pub(crate) fn no_extra_tensor(_: &ParamInfo, _: &[ParamInfo]) -> Option<(String, Vec<usize>)> {
    None
}

/// A HF `model_type` the decoder runs: one entry of the family registry.
#[derive(Clone, Copy)]
pub struct ModelType(&'static Family);

impl PartialEq for ModelType {
    fn eq(&self, other: &ModelType) -> bool {
        self.name() == other.name()
    }
}

impl Eq for ModelType {}

impl std::fmt::Debug for ModelType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelType({})", self.name())
    }
}

impl ModelType {
    /// The `model_type` string.
    pub fn name(self) -> &'static str {
        self.0.model_type
    }

    /// Whether this family's `save_pretrained` stores the checkpoint tensor `name` as float32
    /// whatever the model's dtype (its family's `kept_f32`: DeepSeek's routers), so a bf16 export
    /// stores it so too.
    pub fn keeps_f32(self, name: &str) -> bool {
        self.0
            .kept_f32
            .iter()
            .any(|end| name == *end || name.ends_with(&format!(".{end}")))
    }

    /// The type named `name` (`config.json`'s `model_type`).
    pub fn from_name(name: &str) -> Option<ModelType> {
        FAMILIES
            .iter()
            .find(|f| f.model_type == name)
            .map(|f| ModelType(f))
    }

    /// Every type, in the order the messages list them and export tries them.
    pub fn all() -> Vec<ModelType> {
        FAMILIES.iter().map(|f| ModelType(f)).collect()
    }

    /// The family a decoder config belongs to in HF's terms: the first in [`ModelType::all`]'s
    /// order that expresses it.
    ///
    /// # Errors
    /// A config no HF family expresses, naming for each family the features it lacks.
    pub fn of(cfg: &Config) -> Result<ModelType, String> {
        let mut why = Vec::new();
        for family in FAMILIES {
            let misfit = (family.misfit)(cfg);
            if misfit.is_empty() {
                return Ok(ModelType(family));
            }
            why.push(format!("{}: {}", family.model_type, misfit.join(", ")));
        }
        Err(format!(
            "no Hugging Face model_type fits this model: {}",
            why.join("; ")
        ))
    }

    /// The family's declarations.
    pub(crate) fn family(self) -> &'static Family {
        self.0
    }
}

/// The decoder config of the HF directory `dir` (its `config.json`).
///
/// # Errors
/// [`HfError::Params`] naming `config.json`: unreadable, not JSON, an unknown `model_type`,
/// a missing or mistyped key, or features the decoder does not have (all named in one error).
///
/// A declared multi-token-prediction layer (`num_nextn_predict_layers` = 1) is kept
/// (`mtp_num_layers` = 1) only when the directory's weights hold a tensor under
/// `model.layers.{num_hidden_layers}.`: transformers 5 writes 1 without the layer, and such a
/// directory is the main model alone. A partial layer is then named, missing, at load.
///
/// A tied head (`tie_word_embeddings` true) whose directory stores an `lm_head.weight` with
/// values of its own, not a copy of the embedding, is read untied (`logits_via_embedding`
/// false), as transformers loads it: the stored head is the model's.
pub fn read_config(dir: &Path) -> Result<Config, HfError> {
    let path = dir.join(super::CONFIG_FILE);
    let err = |reason: String| HfError::Params {
        path: path.display().to_string(),
        reason,
    };
    let text = ferrotext_files::read_regular_to_string(&path)
        .map_err(|e| err(format!("cannot read: {e}")))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| err(format!("is not JSON: {e}")))?;
    let mut cfg = decoder_config(&value).map_err(err)?;
    if cfg.mtp_num_layers > 0 {
        let prefix = format!("model.layers.{}.", cfg.base_num_decoder_layers);
        let names = crate::shards::tensor_names(dir).map_err(|reason| HfError::Params {
            path: dir.display().to_string(),
            reason,
        })?;
        if names.is_some_and(|n| !n.iter().any(|n| n.starts_with(&prefix))) {
            cfg.mtp_num_layers = 0;
        }
    }
    if cfg.logits_via_embedding {
        let head = crate::tied::directory_head(dir).map_err(|reason| HfError::Params {
            path: dir.display().to_string(),
            reason,
        })?;
        cfg.logits_via_embedding = head != crate::tied::StoredHead::Own;
    }
    Ok(cfg)
}

/// The decoder config of a parsed `config.json` (what [`read_config`] reads from a file).
///
/// # Errors
/// As [`read_config`], as one sentence: an unknown `model_type`, a missing or mistyped key, or
/// every feature the decoder does not have, each named with its value.
pub fn config_from_json(v: &Value) -> Result<Config, String> {
    decoder_config(v)
}

/// The decoder config of a parsed `config.json`: the family's `model_type`, its reader, then
/// the RoPE keys; the features the decoder does not have are collected and refused together.
fn decoder_config(v: &Value) -> Result<Config, String> {
    let model_type = v
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or("`model_type` is missing")?;
    let kind = ModelType::from_name(model_type).ok_or_else(|| {
        let names: Vec<&str> = FAMILIES.iter().map(|f| f.model_type).collect();
        let (last, rest) = names.split_last().unwrap_or((&"", &[]));
        format!(
            "model_type `{model_type}` is not supported ({} or {last})",
            rest.join(", ")
        )
    })?;
    let family = kind.family();
    // A key the file leaves out means what it means to transformers: its class's default.
    let v = &defaults::with_class_defaults(family, v);
    let mut k = Keys {
        v,
        unsupported: Vec::new(),
    };
    let mut cfg = (family.read)(&mut k)?;
    let view = (family.rope_view)(v);
    let rope = match &view {
        None => rope::read(&mut k, family)?,
        Some(view) => {
            let mut rk = Keys {
                v: view,
                unsupported: Vec::new(),
            };
            let rope = rope::read(&mut rk, family)?;
            k.unsupported.append(&mut rk.unsupported);
            rope
        }
    };
    cfg.rope_max_timescale = rope.theta.unwrap_or(cfg.rope_max_timescale);
    cfg.rope_yarn = rope.yarn;
    cfg.rope_llama3 = rope.llama3;
    cfg.rope_scaling = rope.scaling;

    if !k.unsupported.is_empty() {
        return Err(format!(
            "model_type `{model_type}` with features the decoder does not have: {}",
            k.unsupported.join(", ")
        ));
    }
    Ok(cfg)
}

/// The `config.json` of `cfg` (`torch_dtype` set to `dtype`, e.g. `bfloat16`): the keys every
/// family writes, then its family's own.
///
/// # Errors
/// A config no HF family expresses (see [`ModelType::of`]).
pub fn hf_config_json(cfg: &Config, dtype: &str) -> Result<Value, String> {
    let kind = ModelType::of(cfg)?;
    let mut v = common::base_json(cfg, kind.name(), dtype);
    if let (Some(obj), Value::Object(more)) = (v.as_object_mut(), (kind.family().write)(cfg)) {
        obj.extend(more);
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn roundtrip(name: &str) {
        let cfg = Config::preset(name).unwrap();
        let v = hf_config_json(&cfg, "float32").unwrap();
        assert_eq!(decoder_config(&v).unwrap(), cfg, "{name}: {v}");
    }

    #[test]
    fn presets_survive_config_json() {
        for name in [
            "qwen3-tiny",
            "qwen3-0.6b",
            "llama3-tiny",
            "llama3.2-1b",
            "qwen2-tiny",
            "qwen2.5-0.5b",
        ] {
            roundtrip(name);
        }
        let mut moe = Config::preset("qwen3-moe-tiny").unwrap();
        if let Some(m) = moe.moe.as_mut() {
            m.shared_experts = 0;
        }
        let v = hf_config_json(&moe, "float32").unwrap();
        assert_eq!(decoder_config(&v).unwrap(), moe);
        let mut ds = Config::preset("deepseek3-tiny").unwrap();
        ds.head_dim = ds.mla.unwrap().qk_rope_head_dim;
        let v = hf_config_json(&ds, "bfloat16").unwrap();
        assert_eq!(decoder_config(&v).unwrap(), ds);
        if let Some(m) = ds.mla.as_mut() {
            m.rope_interleave = false;
        }
        let v = hf_config_json(&ds, "bfloat16").unwrap();
        assert_eq!(v["rope_interleave"], json!(false));
        assert_eq!(decoder_config(&v).unwrap(), ds);
    }

    #[test]
    fn unknown_model_types_and_features_are_named() {
        let err = decoder_config(&json!({"model_type": "gpt2"})).unwrap_err();
        assert!(
            err.starts_with(
                "model_type `gpt2` is not supported (qwen3, qwen3_moe, deepseek_v3, llama"
            ) && err.contains("qwen2"),
            "{err}"
        );
        assert!(err.ends_with(')'), "{err}");
        let mut moe = Config::preset("qwen3-moe-tiny").unwrap();
        if let Some(m) = moe.moe.as_mut() {
            m.shared_experts = 0;
        }
        let mut v = hf_config_json(&moe, "float32").unwrap();
        v["attention_bias"] = json!(true);
        v["use_sliding_window"] = json!(true);
        assert_eq!(
            decoder_config(&v).unwrap_err(),
            "model_type `qwen3_moe` with features the decoder does not have: attention_bias=true \
             (biases on q, k, v and o: the output projection's bias is not built), \
             use_sliding_window=true"
        );
        let mut v = hf_config_json(&Config::preset("qwen3-tiny").unwrap(), "float32").unwrap();
        v["rope_theta"] = json!(-1.0);
        assert_eq!(
            decoder_config(&v).unwrap_err(),
            "`rope_theta` must be a positive number, got -1"
        );
        v["rope_theta"] = json!(1e300);
        assert_eq!(
            decoder_config(&v).unwrap_err(),
            "`rope_theta` = 1e+300 is not a finite 32-bit float"
        );
        let moe = Config::preset("qwen3-moe-tiny").unwrap();
        assert!(ModelType::of(&moe)
            .unwrap_err()
            .contains("shared_experts=1 (qwen3_moe has none)"));
    }

    /// transformers' latent norms keep RMSNorm's default ε whatever `rms_norm_eps` says (the
    /// `deepseek_v*-eps` fixtures hold the losses); a model whose latent ε differs is no
    /// DeepSeek of transformers', and export says so rather than writing it silently wrong.
    #[test]
    fn mla_latent_norms_keep_transformers_epsilon() {
        let mut ds = Config::preset("deepseek3-tiny").unwrap();
        ds.head_dim = ds.mla.unwrap().qk_rope_head_dim;
        let mut v = hf_config_json(&ds, "float32").unwrap();
        v["rms_norm_eps"] = json!(0.1);
        let mut cfg = decoder_config(&v).unwrap();
        assert_eq!(cfg.normalization_layer_epsilon, 0.1);
        assert_eq!(cfg.mla.unwrap().latent_norm_eps, 1e-6);
        if let Some(m) = cfg.mla.as_mut() {
            m.latent_norm_eps = 0.1;
        }
        let err = ModelType::of(&cfg).unwrap_err();
        assert!(
            err.contains("deepseek_v3: latent_norm_eps=0.1 (deepseek_v3 fixes the latent norms' epsilon at 1e-6)"),
            "{err}"
        );
    }
}
