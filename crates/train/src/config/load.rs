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
        let mut table = match file {
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
        for item in overrides {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| TrainError::NotKeyValue {
                    argument: item.clone(),
                })?;
            table.insert(key.trim().to_string(), parse_value(value.trim()));
        }
        let config: TrainConfig =
            toml::Value::Table(table.clone())
                .try_into()
                .map_err(|e: toml::de::Error| {
                    let (key, reason) = name_the_key(&table, &e);
                    TrainError::usage(key, reason)
                })?;
        Ok(config)
    }
}
