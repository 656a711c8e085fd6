//! What `config.json`'s reader does with each key a family's transformers config class defines
//! (4.x and 5 together): read, refused when its value asks for math the decoder does not do, or
//! irrelevant to the math, each with its reason. `tests/config_keys.rs` walks transformers' own
//! key lists (`tests/fixtures/transformers/keys/`) against this table and probes every entry:
//! a read key's probe value changes the decoder config, a refused key's bad value is refused
//! naming the key.
//!
//! Invariant: a key is listed here exactly when the reader in `config.rs`/`rope.rs` handles it
//! as said; the table is the documentation, the probes keep it honest.

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
const GENERIC: &[(&str, KeyUse)] = &[
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
    ("pad_token_id", Irrelevant(TOKENS)),
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
const DECODER: &[(&str, KeyUse)] = &[
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

/// The Qwen families' sliding-window keys.
const QWEN_WINDOW: &[(&str, KeyUse)] = &[
    ("use_sliding_window", Refused {
        bad: "true",
        reason: "sliding-window attention is not built",
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

const QWEN3: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    (
        "rope_scaling",
        Refused {
            bad: "{\"rope_type\": \"linear\", \"factor\": 2.0}",
            reason: "qwen3 reads default RoPE only",
        },
    ),
    (
        "rope_parameters",
        Read {
            probe: "{\"rope_type\": \"default\", \"rope_theta\": 12345.0}",
        },
    ),
];

const QWEN2: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    (
        "rope_scaling",
        Refused {
            bad:
                "{\"type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}",
            reason: "qwen2 reads default RoPE only (Qwen2.5's long-context YaRN is not built)",
        },
    ),
    (
        "rope_parameters",
        Read {
            probe: "{\"rope_type\": \"default\", \"rope_theta\": 12345.0}",
        },
    ),
];

const LLAMA: &[(&str, KeyUse)] = &[
    ("head_dim", Read { probe: "16" }),
    ("tie_word_embeddings", Read { probe: "false" }),
    (
        "mlp_bias",
        Refused {
            bad: "true",
            reason: "MLP biases are not built (Llama 3 has none)",
        },
    ),
    (
        "rope_scaling",
        Read {
            probe: "{\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, \
                \"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 8192}",
        },
    ),
    (
        "rope_parameters",
        Read {
            probe: "{\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, \
                \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, \
                \"original_max_position_embeddings\": 8192}",
        },
    ),
];

const QWEN3_MOE: &[(&str, KeyUse)] = &[
    ("num_experts", Read { probe: "6" }),
    ("num_local_experts", Read { probe: "6" }),
    ("num_experts_per_tok", Read { probe: "3" }),
    ("moe_intermediate_size", Read { probe: "40" }),
    ("norm_topk_prob", Read { probe: "false" }),
    ("mlp_only_layers", Read { probe: "[]" }),
    (
        "decoder_sparse_step",
        Refused {
            bad: "2",
            reason: "MoE layers only after a leading run of dense ones",
        },
    ),
    (
        "router_aux_loss_coef",
        Irrelevant("weighs the load-balance loss, added only with output_router_logits (refused)"),
    ),
];

const DEEPSEEK_V3: &[(&str, KeyUse)] = &[
    ("max_position_embeddings", Refused {
        bad: "12345",
        reason: "with YaRN, transformers 4.x takes the factor from max_position_embeddings / \
                 original_max_position_embeddings and 5 the rope factor as written: they must \
                 agree",
    }),
    ("tie_word_embeddings", Read { probe: "true" }),
    ("head_dim", Irrelevant("transformers sets it to qk_rope_head_dim")),
    ("qk_head_dim", Irrelevant("transformers sets it to qk_nope_head_dim + qk_rope_head_dim")),
    // The MTP depth (2 and more refused); `read_config` keeps it only when the weights hold
    // the layer, since transformers 5 writes 1 without it.
    ("num_nextn_predict_layers", Read { probe: "1" }),
    ("num_mtp_layers", Read { probe: "1" }),
    ("q_lora_rank", Read { probe: "8" }),
    ("kv_lora_rank", Read { probe: "8" }),
    ("qk_nope_head_dim", Read { probe: "64" }),
    ("qk_rope_head_dim", Read { probe: "32" }),
    ("v_head_dim", Read { probe: "64" }),
    ("rope_interleave", Read { probe: "false" }),
    ("n_routed_experts", Read { probe: "12" }),
    ("num_local_experts", Read { probe: "12" }),
    ("n_shared_experts", Read { probe: "2" }),
    ("num_experts_per_tok", Read { probe: "4" }),
    ("moe_intermediate_size", Read { probe: "40" }),
    ("first_k_dense_replace", Read { probe: "1" }),
    ("norm_topk_prob", Read { probe: "false" }),
    ("routed_scaling_factor", Read { probe: "1.5" }),
    ("n_group", Read { probe: "4" }),
    ("topk_group", Read { probe: "2" }),
    ("scoring_func", Refused {
        bad: "\"softmax\"",
        reason: "deepseek_v3's router is sigmoid",
    }),
    ("moe_layer_freq", Refused {
        bad: "2",
        reason: "MoE layers only after a leading run of dense ones",
    }),
    ("ep_size", Irrelevant("DeepSeek's own expert-parallel degree; transformers' forward does not read it")),
    ("aux_loss_alpha", Irrelevant("DeepSeek's own training loss weight; transformers' forward does not read it")),
    ("seq_aux", Irrelevant("DeepSeek's own training loss switch; transformers' forward does not read it")),
    ("rope_scaling", Read {
        probe: "{\"type\": \"yarn\", \"factor\": 40.0, \"original_max_position_embeddings\": 4096, \
                \"beta_fast\": 16.0, \"beta_slow\": 1.0, \"mscale\": 1.0, \"mscale_all_dim\": 0.8}",
    }),
    ("rope_parameters", Read {
        probe: "{\"rope_type\": \"yarn\", \"rope_theta\": 10000.0, \"factor\": 40.0, \
                \"original_max_position_embeddings\": 4096, \"beta_fast\": 16.0, \
                \"beta_slow\": 1.0, \"mscale\": 1.0, \"mscale_all_dim\": 1.0}",
    }),
];

/// The tables of `kind`, most specific first.
fn tables(kind: ModelType) -> [&'static [(&'static str, KeyUse)]; 4] {
    match kind {
        ModelType::Qwen3 => [QWEN3, QWEN_WINDOW, DECODER, GENERIC],
        ModelType::Qwen3Moe => [QWEN3_MOE, QWEN3, QWEN_WINDOW, DECODER],
        ModelType::Qwen2 => [QWEN2, QWEN_WINDOW, DECODER, GENERIC],
        ModelType::Llama => [LLAMA, DECODER, GENERIC, &[]],
        ModelType::DeepseekV3 => [DEEPSEEK_V3, DECODER, GENERIC, &[]],
    }
}

/// What the reader does with `key` of a `kind` config; `None` for a key no table lists (one
/// transformers' class for `kind` does not define, which the reader ignores as transformers
/// does).
pub fn key_use(kind: ModelType, key: &str) -> Option<KeyUse> {
    let specific = tables(kind)
        .into_iter()
        .flat_map(|t| t.iter())
        .find(|(k, _)| *k == key)
        .map(|(_, u)| *u);
    // qwen3_moe's four tables leave GENERIC out; it is every family's last resort.
    specific.or_else(|| GENERIC.iter().find(|(k, _)| *k == key).map(|(_, u)| *u))
}

/// Every key the tables list for `kind` with what the reader does with it, the family's own
/// first (a key listed twice is reported once, as [`key_use`] answers).
pub fn listed_keys(kind: ModelType) -> Vec<(&'static str, KeyUse)> {
    let mut out: Vec<(&'static str, KeyUse)> = Vec::new();
    for (key, u) in tables(kind)
        .into_iter()
        .chain([GENERIC])
        .flat_map(|t| t.iter())
    {
        if !out.iter().any(|(k, _)| k == key) {
            out.push((key, *u));
        }
    }
    out
}
