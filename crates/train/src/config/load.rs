//! Loading a config: an optional TOML file, then `key=value` overrides (later ones win), each
//! value deserialized into its key's type.
//!
//! Invariant: a value of the wrong type or an unknown key is a usage error naming that key (and,
//! for an unknown one, the nearest known names), one line; nothing here checks values together.

use std::path::Path;

use super::TrainConfig;
use crate::error::TrainError;

/// A `key=value` override's value as TOML: integer, float, boolean, or string.
fn parse_value(text: &str) -> toml::Value {
    if let Ok(i) = text.parse::<i64>() {
        return toml::Value::Integer(i);
    }
    if let Ok(f) = text.parse::<f64>() {
        return toml::Value::Float(f);
    }
    match text {
        "true" | "True" => toml::Value::Boolean(true),
        "false" | "False" => toml::Value::Boolean(false),
        _ => toml::Value::String(text.to_string()),
    }
}

/// The key whose value failed to deserialize and `err`'s message naming it (serde's message
/// names the expected type but not the field): each key is tried alone to find it.
fn name_the_key(table: &toml::Table, err: &toml::de::Error) -> (String, String) {
    let message = err.message().replace('\n', " ");
    for (key, value) in table {
        let alone: toml::Table = [(key.clone(), value.clone())].into_iter().collect();
        if let Err(e) = toml::Value::Table(alone).try_into::<TrainConfig>() {
            let first = e.message().lines().next().unwrap_or_default().to_string();
            if first.starts_with("unknown field") {
                // serde lists every field; the user wants the one they meant.
                return (key.clone(), crate::keys::unknown_key_message(key));
            }
            let form = crate::keys::find(key)
                .map_or(String::new(), |k| format!(" (`{key}` takes {})", k.form));
            return (key.clone(), format!("{key} = {value}: {first}{form}"));
        }
    }
    (String::new(), message)
}

impl TrainConfig {
    /// The config from an optional TOML file and `key=value` overrides (later ones win),
    /// validated.
    ///
    /// # Errors
    /// [`TrainError::Usage`] with one line naming the key (an unknown key, a value of the wrong
    /// type, any [`TrainConfig::validate`] failure), or as [`TrainConfig::parse`] for a file or
    /// an argument that cannot be used.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<TrainConfig, TrainError> {
        let config = TrainConfig::parse(file, overrides)?;
        config.validate()?;
        Ok(config)
    }

    /// The config from an optional TOML file and `key=value` overrides (later ones win), each
    /// value of the right type but not yet checked together: [`TrainConfig::plan`] does that.
    ///
    /// # Errors
    /// [`TrainError::Usage`] naming the key (an unknown key, a value of the wrong type);
    /// [`TrainError::ConfigUnreadable`], [`TrainError::ConfigNotUtf8`] or
    /// [`TrainError::ConfigSyntax`] for a file that cannot be used, [`TrainError::NotKeyValue`]
    /// for an argument that is not `key=value`.
    pub fn parse(file: Option<&Path>, overrides: &[String]) -> Result<TrainConfig, TrainError> {
        let table = match file {
            Some(path) => {
                let shown = || path.display().to_string();
                let bytes = ferrotext_files::read_named(path).map_err(|reason| {
                    TrainError::ConfigUnreadable {
                        path: shown(),
                        reason,
                    }
                })?;
                let text = String::from_utf8(bytes)
                    .map_err(|_| TrainError::ConfigNotUtf8 { path: shown() })?;
                text.parse::<toml::Table>()
                    .map_err(|e| TrainError::ConfigSyntax {
                        path: shown(),
                        message: e.message().to_string(),
                    })?
            }
            None => toml::Table::new(),
        };
        overridden(table, overrides)
    }

    /// This config with `key=value` overrides on top (later ones win), validated as
    /// [`TrainConfig::load`] validates: how a caller that builds its config as values (a
    /// benchmark) applies a user's `--set` items.
    ///
    /// # Errors
    /// As [`TrainConfig::load`] for the overrides.
    pub fn with_overrides(&self, overrides: &[String]) -> Result<TrainConfig, TrainError> {
        let table = toml::Table::try_from(self)
            .map_err(|e| TrainError::Internal(format!("a config as TOML: {e}")))?;
        let config = overridden(table, overrides)?;
        config.validate()?;
        Ok(config)
    }

    /// Every key whose value differs from its default, as the `key=value` items that give
    /// this config back ([`TrainConfig::load`] of them is this config): what a child
    /// `ferrotext train` is handed to run it. Keys in name order.
    pub fn to_overrides(&self) -> Vec<String> {
        let object = |c: &TrainConfig| match serde_json::to_value(c) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        let defaults = object(&TrainConfig::default());
        object(self)
            .into_iter()
            .filter(|(key, value)| defaults.get(key) != Some(value) && !value.is_null())
            .map(|(key, value)| match value {
                serde_json::Value::String(s) => format!("{key}={s}"),
                other => format!("{key}={other}"),
            })
            .collect()
    }
}

/// `table` with `key=value` `overrides` on top, each value deserialized into its key's type.
fn overridden(mut table: toml::Table, overrides: &[String]) -> Result<TrainConfig, TrainError> {
    for item in overrides {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| TrainError::NotKeyValue {
                argument: item.clone(),
            })?;
        table.insert(key.trim().to_string(), parse_value(value.trim()));
    }
    toml::Value::Table(table.clone())
        .try_into()
        .map_err(|e: toml::de::Error| {
            let (key, reason) = name_the_key(&table, &e);
            TrainError::usage(key, reason)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DatasetType;

    /// A config built as values, handed on as `key=value` items and read back, is the same
    /// config; and overrides on a built config win over its values.
    #[test]
    fn a_built_config_survives_its_overrides_and_takes_new_ones() {
        let built = TrainConfig {
            model_name: "qwen3-peer".into(),
            per_device_batch_size: 1.0,
            learning_rate: 0.001,
            dataset_type: DatasetType::Synthetic,
            dtype: ferrotext_sharding::DType::BF16,
            base_emb_dim: Some(96),
            run_name: "a run".into(),
            ..TrainConfig::default()
        };
        let items = built.to_overrides();
        assert!(
            items.contains(&"learning_rate=0.001".to_string()),
            "{items:?}"
        );
        assert!(items.contains(&"dtype=bfloat16".to_string()), "{items:?}");
        assert!(!items.iter().any(|i| i.starts_with("steps=")), "{items:?}");
        assert_eq!(TrainConfig::parse(None, &items).unwrap(), built);
        let more = built
            .with_overrides(&["steps=7".into(), "learning_rate=0.5".into()])
            .unwrap();
        assert_eq!((more.steps, more.learning_rate), (7, 0.5));
        assert_eq!(more.base_emb_dim, Some(96));
        // The mirror: a bad override is refused as `load` refuses it.
        let err = built.with_overrides(&["steps=0".into()]).unwrap_err();
        assert!(err.is_usage(), "{err}");
    }
}
