//! What a model's source directory declares beyond the decoder: the `config.json` keys the
//! decoder does not compute but readers act on ([`DECLARED_KEYS`]: the special tokens
//! transformers' `generate` starts and stops on, the context the model advertises), its
//! `generation_config.json` and its tokenizer's files ([`DECLARED_FILES`]). An export writes
//! them back as the source had them, as transformers' own `save_pretrained` of a loaded model
//! (and of its tokenizer) does, so the exported directory loads with `AutoTokenizer` too; a
//! model from a preset declares none, and its export writes the family's defaults.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::HfError;
use crate::CONFIG_FILE;

/// The generation defaults of a HF directory (sampling settings, the stop tokens).
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The `config.json` keys an export copies from the source directory, when the source sets
/// them; none of them changes what the decoder computes that the model's config did not read
/// from the same value (`max_position_embeddings` where a RoPE reads it; `pad_token_id`, whose
/// embedding row learns nothing from its lookups, `Config::pad_token_id`).
pub const DECLARED_KEYS: &[&str] = &[
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_position_embeddings",
];

/// The files an export copies from the source directory, byte for byte, when it has them: the
/// generation defaults and every file of a tokenizer transformers saves (fast and slow, BPE and
/// SentencePiece, the chat template).
pub const DECLARED_FILES: &[&str] = &[
    GENERATION_CONFIG_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// A source directory's declarations, to write into an exported one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Declared {
    /// Each of [`DECLARED_KEYS`] the source's `config.json` sets (a `null` is not a setting).
    pub keys: Map<String, Value>,
    /// Each of [`DECLARED_FILES`] the source has, by name, with its bytes.
    pub files: Vec<(String, Vec<u8>)>,
}

impl Declared {
    /// Nothing declared: the export writes the family's defaults (a model from a preset).
    pub fn none() -> Declared {
        Declared::default()
    }

    /// What the HF directory `dir` declares.
    ///
    /// # Errors
    /// [`HfError::Params`] when its `config.json` cannot be read or is not a JSON object, one of
    /// its [`DECLARED_FILES`] cannot be read, or its `generation_config.json` is not JSON (a
    /// file that transformers could not read either).
    pub fn of_directory(dir: &Path) -> Result<Declared, HfError> {
        let err = |path: &Path, reason: String| HfError::Params {
            path: path.display().to_string(),
            reason,
        };
        let config_path = dir.join(CONFIG_FILE);
        let text = ferrotext_files::read_regular_to_string(&config_path)
            .map_err(|e| err(&config_path, e.to_string()))?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| err(&config_path, format!("not JSON: {e}")))?;
        let object = config
            .as_object()
            .ok_or_else(|| err(&config_path, "not a JSON object".into()))?;
        let keys = DECLARED_KEYS
            .iter()
            .filter_map(|k| {
                let v = object.get(*k).filter(|v| !v.is_null())?;
                Some((k.to_string(), v.clone()))
            })
            .collect();
        let mut files = Vec::new();
        for name in DECLARED_FILES {
            let path = dir.join(name);
            if !path.exists() {
                continue;
            }
            let bytes =
                ferrotext_files::read_regular(&path).map_err(|e| err(&path, e.to_string()))?;
            if *name == GENERATION_CONFIG_FILE {
                serde_json::from_slice::<Value>(&bytes)
                    .map_err(|e| err(&path, format!("not JSON: {e}")))?;
            }
            files.push((name.to_string(), bytes));
        }
        Ok(Declared { keys, files })
    }

    /// `config` (a `config.json` object) with the declared keys written over the family's.
    pub(crate) fn applied_to(&self, mut config: Value) -> Value {
        if let Some(object) = config.as_object_mut() {
            for (k, v) in &self.keys {
                object.insert(k.clone(), v.clone());
            }
        }
        config
    }
}
