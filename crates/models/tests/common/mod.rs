//! Small decoders shared by the model tests.
#![allow(dead_code)]

use ferrotext_models::decoder::{Config, MlaSettings};

/// A Qwen3-style GQA decoder small enough for exact tests: `vocab` tokens, `layers` layers of
/// width 16, 4 query heads over 2 key/value heads of 4, an MLP of 24.
pub fn tiny_gqa(vocab: usize, layers: usize) -> Config {
    let mut c = Config::preset("qwen3-tiny").unwrap();
    c.vocab_size = vocab;
    c.base_emb_dim = 16;
    c.base_num_decoder_layers = layers;
    c.base_num_query_heads = 4;
    c.base_num_kv_heads = 2;
    c.head_dim = 4;
    c.base_mlp_dim = 24;
    c
}

/// `base` with DeepSeek's multi-head latent attention (a query latent of 6, a key/value latent
/// of 4, 4 + 4 query/key dims, values of 3, interleaved RoPE) instead of GQA and its QK-norm.
pub fn with_mla(mut c: Config) -> Config {
    c.qk_norm = false;
    c.mla = Some(MlaSettings {
        q_lora_rank: 6,
        kv_lora_rank: 4,
        qk_nope_head_dim: 4,
        qk_rope_head_dim: 4,
        v_head_dim: 3,
        rope_interleave: true,
        latent_norm_eps: 1e-6,
    });
    c
}
