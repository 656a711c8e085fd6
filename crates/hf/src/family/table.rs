//! What `config.json`'s reader does with each key a family's transformers config class defines
//! (4.x and 5 together): read, refused when its value asks for math the decoder does not do, or
//! irrelevant to the math, each with its reason. Here: the kinds of use ([`KeyUse`]), the tables
//! every family shares (the keys of every `PretrainedConfig`, the decoder's sizes and switches,
//! the Qwen families' sliding window) and the lookup over a family's tables; each family file
//! holds its own. `tests/config_keys.rs` walks transformers' own key lists
//! (`tests/fixtures/transformers/keys/`) against the tables and probes every entry: a read key's
//! probe value changes the decoder config, a refused key's bad value is refused naming the key.
//!
//! Invariant: a key is listed exactly when the family's reader (its file, `common.rs`,
//! `rope.rs`) handles it as said; the tables are the documentation, the probes keep them
//! honest.

use super::ModelType;

/// What the reader does with one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyUse {
    /// Read into the decoder config.
    Read {
        /// A valid value (JSON) that changes the decoder config from the preset's.
        probe: &'static str,
    },
    /// Read, and refused unless its value is one the decoder computes.
    Refused {
        /// A value (JSON) the reader refuses, naming the key.
        bad: &'static str,
        /// Why that value is refused.
        reason: &'static str,
    },
    /// Not read: it does not change the math of the loss or of generation.
    Irrelevant(&'static str),
}

use KeyUse::{Irrelevant, Read, Refused};

const NOT_MATH: &str = "bookkeeping of transformers' config object; no math reads it";
const TOKENS: &str = "a token id of generation and tokenization; the forward pass does not read it";
const GENERATE: &str = "a generation setting (ferrotext generate takes its own flags)";

/// Keys every `PretrainedConfig` carries (`to_dict`), none of which the decoder's math reads.
pub(super) const GENERIC: &[(&str, KeyUse)] = &[
    ("_name_or_path", Irrelevant(NOT_MATH)),
    ("transformers_version", Irrelevant(NOT_MATH)),
    ("model_type", Irrelevant("read first: it chooses this table")),
    ("architectures", Irrelevant(NOT_MATH)),
    ("torch_dtype", Irrelevant("the stored dtype; each tensor's header is read instead")),
    ("dtype", Irrelevant("the stored dtype; each tensor's header is read instead")),
    ("use_bfloat16", Irrelevant(NOT_MATH)),
    ("return_dict", Irrelevant(NOT_MATH)),
    ("output_hidden_states", Irrelevant(NOT_MATH)),
    ("output_attentions", Irrelevant(NOT_MATH)),
    ("torchscript", Irrelevant(NOT_MATH)),
    ("pruned_heads", Irrelevant("empty in every saved model; pruning is not applied on load")),
    ("chunk_size_feed_forward", Irrelevant("chunking the MLP computes the same values")),
    ("is_encoder_decoder", Irrelevant(NOT_MATH)),
    ("is_decoder", Irrelevant(NOT_MATH)),
    ("cross_attention_hidden_size", Irrelevant(NOT_MATH)),
    ("add_cross_attention", Irrelevant(NOT_MATH)),
    ("tie_encoder_decoder", Irrelevant(NOT_MATH)),
    ("finetuning_task", Irrelevant(NOT_MATH)),
    ("id2label", Irrelevant("labels of a classification head, which a causal LM has not")),
    ("label2id", Irrelevant("labels of a classification head, which a causal LM has not")),
    ("num_labels", Irrelevant("labels of a classification head, which a causal LM has not")),
    ("task_specific_params", Irrelevant(NOT_MATH)),
    ("problem_type", Irrelevant(NOT_MATH)),
    ("tokenizer_class", Irrelevant(NOT_MATH)),
    ("prefix", Irrelevant(NOT_MATH)),
    ("tf_legacy_loss", Irrelevant(NOT_MATH)),
    ("bos_token_id", Irrelevant(TOKENS)),
    ("eos_token_id", Irrelevant(TOKENS)),
    // transformers' `nn.Embedding(padding_idx = pad_token_id)`: that row gets no gradient
    // from the lookups (`Config::pad_token_id`).
    ("pad_token_id", Read { probe: "5" }),
    ("sep_token_id", Irrelevant(TOKENS)),
    ("decoder_start_token_id", Irrelevant(TOKENS)),
    ("max_length", Irrelevant(GENERATE)),
    ("min_length", Irrelevant(GENERATE)),
    ("do_sample", Irrelevant(GENERATE)),
    ("early_stopping", Irrelevant(GENERATE)),
    ("num_beams", Irrelevant(GENERATE)),
    ("num_beam_groups", Irrelevant(GENERATE)),
    ("diversity_penalty", Irrelevant(GENERATE)),
    ("temperature", Irrelevant(GENERATE)),
    ("top_k", Irrelevant(GENERATE)),
    ("top_p", Irrelevant(GENERATE)),
    ("typical_p", Irrelevant(GENERATE)),
    ("repetition_penalty", Irrelevant(GENERATE)),
    ("length_penalty", Irrelevant(GENERATE)),
    ("no_repeat_ngram_size", Irrelevant(GENERATE)),
    ("encoder_no_repeat_ngram_size", Irrelevant(GENERATE)),
    ("bad_words_ids", Irrelevant(GENERATE)),
    ("num_return_sequences", Irrelevant(GENERATE)),
    ("output_scores", Irrelevant(GENERATE)),
    ("return_dict_in_generate", Irrelevant(GENERATE)),
    ("forced_bos_token_id", Irrelevant(GENERATE)),
    ("forced_eos_token_id", Irrelevant(GENERATE)),
    ("remove_invalid_values", Irrelevant(GENERATE)),
    ("exponential_decay_length_penalty", Irrelevant(GENERATE)),
    ("suppress_tokens", Irrelevant(GENERATE)),
    ("begin_suppress_tokens", Irrelevant(GENERATE)),
    ("use_cache", Irrelevant("whether transformers keeps a key/value cache; same values")),
    ("initializer_range", Irrelevant("the initialisation of a new model; a loaded one has its weights")),
    ("max_position_embeddings", Irrelevant(
        "no table is sized by it: RoPE is computed for any position (YaRN's own check is in rope.rs)",
    )),
    ("attn_implementation", Irrelevant("eager, sdpa and flash compute the same attention")),
    ("_attn_implementation_autoset", Irrelevant(NOT_MATH)),
];

/// The sizes and the norm every family reads, and the switches the decoder refuses.
pub(super) const DECODER: &[(&str, KeyUse)] = &[
    ("vocab_size", Read { probe: "300" }),
    ("hidden_size", Read { probe: "96" }),
    ("intermediate_size", Read { probe: "100" }),
    ("num_hidden_layers", Read { probe: "3" }),
    ("num_attention_heads", Read { probe: "8" }),
    ("num_key_value_heads", Read { probe: "1" }),
    ("rms_norm_eps", Read { probe: "1e-4" }),
    ("rope_theta", Read { probe: "12345.0" }),
    ("hidden_act", Refused {
        bad: "\"gelu\"",
        reason: "the MLP's gate is SiLU (SwiGLU) only",
    }),
    ("attention_dropout", Refused {
        bad: "0.1",
        reason: "dropout is not built (0 in every published config)",
    }),
    ("attention_bias", Refused {
        bad: "true",
        reason: "biases on q/k/v/o: the output projection's bias is not built",
    }),
    ("pretraining_tp", Irrelevant(
        "transformers' forward no longer reads it; it sliced the same matmuls",
    )),
    ("output_router_logits", Refused {
        bad: "true",
        reason: "transformers then adds its load-balance loss; ferrotext's is load_balance_loss_weight",
    }),
    ("partial_rotary_factor", Refused {
        bad: "0.5",
        reason: "RoPE turns the whole head",
    }),
];

/// The Qwen families' sliding-window keys, read (`qwen2`, `qwen3`).
pub(super) const QWEN_WINDOW: &[(&str, KeyUse)] = &[
    ("use_sliding_window", Read { probe: "true" }),
    (
        "sliding_window",
        Irrelevant("read only with use_sliding_window (a probe of it alone changes nothing)"),
    ),
    (
        "max_window_layers",
        Irrelevant("read only with use_sliding_window and no layer_types"),
    ),
    (
        "layer_types",
        Refused {
            bad: "[\"sliding_attention\", \"full_attention\"]",
            reason: "sliding layers without use_sliding_window: transformers then has no window",
        },
    ),
];

/// The Qwen MoE families' sliding-window keys, refused (`qwen3_moe`, `qwen2_moe`).
pub(super) const QWEN_MOE_WINDOW: &[(&str, KeyUse)] = &[
    ("use_sliding_window", Refused {
        bad: "true",
        reason: "sliding windows are read for the dense Qwen families only",
    }),
    ("sliding_window", Irrelevant(
        "read by transformers only for sliding layers (use_sliding_window / layer_types), refused",
    )),
    ("max_window_layers", Irrelevant(
        "read by transformers only with use_sliding_window, refused",
    )),
    ("layer_types", Refused {
        bad: "[\"sliding_attention\", \"full_attention\"]",
        reason: "only full_attention layers",
    }),
];

/// What the reader does with `key` of a `kind` config; `None` for a key no table lists (one
/// transformers' class for `kind` does not define, which the reader ignores as transformers
/// does).
pub fn key_use(kind: ModelType, key: &str) -> Option<KeyUse> {
    tables(kind)
        .flat_map(|t| t.iter())
        .find(|(k, _)| *k == key)
        .map(|(_, u)| *u)
}

/// Every key the tables list for `kind` with what the reader does with it, the family's own
/// first (a key listed twice is reported once, as [`key_use`] answers).
pub fn listed_keys(kind: ModelType) -> Vec<(&'static str, KeyUse)> {
    let mut out: Vec<(&'static str, KeyUse)> = Vec::new();
    for (key, u) in tables(kind).flat_map(|t| t.iter()) {
        if !out.iter().any(|(k, _)| k == key) {
            out.push((key, *u));
        }
    }
    out
}

/// The family's tables, most specific first, then [`GENERIC`] (every family's last resort).
fn tables(kind: ModelType) -> impl Iterator<Item = &'static [(&'static str, KeyUse)]> {
    kind.family().keys.iter().copied().chain([GENERIC])
}
