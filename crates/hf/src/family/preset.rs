//! Family presets (`model_name=`): each family file may declare named models as the
//! `config.json` keys of its class ([`Preset`]), read through the family's own reader with the
//! class's defaults, exactly as a directory written by transformers would be. A published
//! shape is its checkpoint's `config.json`; a CPU-sized one is the same blocks at laptop size.
//!
//! The presets of the first five families (`qwen3-0.6b`, `llama3.2-1b`, ...) predate the
//! registry and stay [`Config::preset`]s in `models`; a name is one or the other, never both
//! (a test checks).

use ferrotext_models::decoder::Config;
use serde_json::Value;

use super::{decoder_config, FAMILIES};
use crate::error::HfError;

/// A named model of a family (`model_name=`).
pub(crate) struct Preset {
    /// The `model_name`.
    pub name: &'static str,
    /// What it is: the published checkpoint whose shape it copies, or what it is for.
    pub about: &'static str,
    /// Its `config.json` keys, `model_type` left out (the family's), as JSON text.
    pub config: &'static str,
}

/// One family preset as [`presets`] lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PresetInfo {
    /// The `model_name`.
    pub name: &'static str,
    /// The family's `model_type`.
    pub model_type: &'static str,
    /// What it is: the published checkpoint whose shape it copies, or what it is for.
    pub about: &'static str,
}

/// Every family preset, in registry order.
pub fn presets() -> Vec<PresetInfo> {
    FAMILIES
        .iter()
        .flat_map(|f| {
            f.presets.iter().map(|p| PresetInfo {
                name: p.name,
                model_type: f.model_type,
                about: p.about,
            })
        })
        .collect()
}

/// The decoder config of the family preset `name`: its `config.json` keys read by its
/// family's reader; `Ok(None)` when no family declares a preset of that name.
///
/// # Errors
/// [`HfError::Preset`] when the preset's keys do not read (a defect of the preset, named with
/// the reader's reason).
pub fn preset(name: &str) -> Result<Option<Config>, HfError> {
    let Some((family, p)) = FAMILIES
        .iter()
        .find_map(|f| f.presets.iter().find(|p| p.name == name).map(|p| (*f, p)))
    else {
        return Ok(None);
    };
    let err = |reason: String| HfError::Preset {
        name: name.to_string(),
        reason,
    };
    let mut v: Value =
        serde_json::from_str(p.config).map_err(|e| err(format!("is not JSON: {e}")))?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| err("is not a JSON object".into()))?;
    obj.insert("model_type".into(), family.model_type.into());
    decoder_config(&v).map(Some).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotext_models::decoder::Decoder;

    fn find(name: &str) -> &'static Preset {
        FAMILIES
            .iter()
            .flat_map(|f| f.presets.iter())
            .find(|p| p.name == name)
            .unwrap()
    }

    /// Every preset reads, builds a model, and names no other preset (of either kind).
    #[test]
    fn every_family_preset_reads_and_builds_under_a_name_of_its_own() {
        let all = presets();
        assert!(all.len() >= 14, "{all:?}");
        let mut names: Vec<&str> = all.iter().map(|p| p.name).collect();
        names.extend_from_slice(Config::PRESETS);
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a preset name used twice");
        for p in &all {
            // Every key is one the family's tables list: a misspelt key would be ignored (as
            // transformers ignores keys its class does not define) and its default taken.
            let kind = super::super::ModelType::from_name(p.model_type).unwrap();
            let keys: Value = serde_json::from_str(find(p.name).config).unwrap();
            for key in keys.as_object().unwrap().keys() {
                assert!(
                    super::super::key_use(kind, key).is_some(),
                    "{}: {key}",
                    p.name
                );
            }
            let cfg = preset(p.name).unwrap().unwrap();
            Decoder::new(cfg.clone()).unwrap_or_else(|e| panic!("{}: {e}", p.name));
            // Export writes it as its own family.
            let kind = super::super::ModelType::of(&cfg).unwrap();
            assert_eq!(kind.name(), p.model_type, "{}", p.name);
        }
        assert!(preset("qwen3-0.6b").unwrap().is_none());
        assert!(preset("gpt5").unwrap().is_none());
    }
}
