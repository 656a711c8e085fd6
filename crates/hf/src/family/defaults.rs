//! What a key absent from `config.json` means: the default of the family's transformers config
//! class, which `from_pretrained` gives every key the file leaves out (`cls(**config_dict)`).
//! A directory whose config omits `norm_topk_prob` is, to transformers, a DeepSeek-V3 that
//! normalizes its top-k weights; reading the key as ferrotext's own default instead would train
//! another model without a word.
//!
//! Invariants:
//! * Each value is the class's default in both generations (transformers 4.57 and 5.x agree on
//!   every one listed); `tests/config_keys.rs` checks them against both generations' dumps in
//!   `tests/fixtures/transformers/keys/`.
//! * Only keys whose default is a value are listed. Keys transformers derives from others when
//!   absent are left to the reader, which derives them the same way: Llama's `head_dim`
//!   (`hidden_size / num_attention_heads`) and `num_key_value_heads` (the head count), the
//!   `head_dim` Qwen2 and Qwen3-MoE read with `getattr` (the same quotient), and the
//!   multi-token-prediction depth (kept only when the weights hold the layer). DeepSeek-V3's
//!   `num_key_value_heads` (128 in its class) is not listed either: MLA gives keys and values one
//!   head per query head and reads no other count, so the reader takes the head count.
//! * A default is filled in only where none of the key's names is present (a key written as
//!   `null` is present: the reader treats it as transformers' `__post_init__` does).

use serde_json::{Map, Value};

use super::{Family, ModelType};

/// One class default: the names a config may use for the key (4.x's first, then 5.x's alias)
/// and the value, as JSON.
pub(crate) type ClassDefault = (&'static [&'static str], &'static str);

/// `[names] => value` entries as [`ClassDefault`]s, after the sizes and the keys every family's class
/// defaults alike: `(vocab_size, hidden_size, intermediate_size, num_hidden_layers,
/// num_attention_heads)`.
macro_rules! defaults {
    (($vocab:literal, $hidden:literal, $mlp:literal, $layers:literal, $heads:literal)
     $(, [$($name:literal),+] => $value:literal)* $(,)?) => {
        &[
            (&["vocab_size"], $vocab),
            (&["hidden_size"], $hidden),
            (&["intermediate_size"], $mlp),
            (&["num_hidden_layers"], $layers),
            (&["num_attention_heads"], $heads),
            (&["rms_norm_eps"], "1e-6"),
            (&["tie_word_embeddings"], "false"),
            $((&[$($name),+], $value),)*
        ]
    };
}

/// transformers' class defaults of `kind`, as `(names, JSON value)`: what each key means when
/// `config.json` leaves it out.
pub fn class_defaults(kind: ModelType) -> &'static [(&'static [&'static str], &'static str)] {
    kind.family().defaults
}

/// `v` with each of `kind`'s class defaults added where the config names the key under none of
/// its names; everything `v` holds is kept as it is. A `v` that is not an object is returned
/// unchanged (the reader refuses it).
pub(super) fn with_class_defaults(family: &Family, v: &Value) -> Value {
    let Some(obj) = v.as_object() else {
        return v.clone();
    };
    let mut out: Map<String, Value> = obj.clone();
    for (names, value) in family.defaults {
        if names.iter().any(|n| obj.contains_key(*n)) {
            continue;
        }
        if let Ok(value) = serde_json::from_str(value) {
            out.insert(names[0].to_string(), value);
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every listed value parses as JSON (a typo would otherwise be skipped silently).
    #[test]
    fn every_default_is_json() {
        for kind in ModelType::all() {
            for (names, value) in class_defaults(kind) {
                assert!(
                    serde_json::from_str::<Value>(value).is_ok(),
                    "{} {names:?}: {value}",
                    kind.name()
                );
            }
        }
    }

    /// A default fills only a key absent under all its names; `null` counts as present.
    #[test]
    fn defaults_fill_only_absent_keys() {
        let v = serde_json::json!({"num_local_experts": 6, "n_group": null, "vocab_size": 300});
        let got = with_class_defaults(&super::super::deepseek_v3::FAMILY, &v);
        assert_eq!(got["num_local_experts"], 6);
        assert!(got.get("n_routed_experts").is_none(), "{got}");
        assert!(got["n_group"].is_null());
        assert_eq!(got["vocab_size"], 300);
        assert_eq!(got["topk_group"], 4);
        assert_eq!(got["norm_topk_prob"], true);
    }
}
