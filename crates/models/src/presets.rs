//! The named model presets (`model_name=`): Qwen3 sizes, Qwen3-MoE test and bench shapes,
//! MaxText's DeepSeek-V3 test models, and Llama 3 and Qwen2 (CPU-sized, and the published
//! shapes of Llama 3.2 1B and Qwen2.5 0.5B as configs). Each is a [`Config`]; nothing here is checked until
//! [`Decoder::new`](crate::decoder::Decoder::new).

use crate::decoder::{Config, MlaSettings, MoeSettings};
use crate::moe::RouterScore;
use ferrotext_tensor::{Llama3, Yarn};

impl Config {
    /// A preset by name: `qwen3-tiny` (CPU-sized, byte vocabulary), `qwen3-peer` (the JAX peer
    /// harness's model), `qwen3-0.6b` (the real dims; abstract mode on CPU), `qwen3-moe-tiny`
    /// (qwen3-tiny with 8 routed experts, top-2, one shared expert, the first layer dense),
    /// `qwen3-moe-bench` (many small experts: a large gradient for its FLOPs), `deepseek3-tiny`
    /// (MaxText's: MLA, YaRN, 16 experts top-8) or `deepseek3-1.3b` (its ~1.3B variant; abstract
    /// mode on CPU, or train it with reduced dims), `llama3-tiny` (qwen3-tiny's shape as Llama 3:
    /// no QK-norm, Llama 3 RoPE scaling), `llama3.2-1b` (Llama 3.2 1B's dims), `qwen2-tiny`
    /// (qwen3-tiny's shape as Qwen2: no QK-norm, q/k/v biases) or `qwen2.5-0.5b` (Qwen2.5
    /// 0.5B's dims).
    pub fn preset(name: &str) -> Option<Config> {
        let base = Config::qwen3_tiny();
        let deepseek3_tiny = Config::deepseek3_tiny();
        let moe = Config::qwen3_moe_tiny_experts();
        Some(match name {
            "qwen3-tiny" => base,
            "qwen3-peer" => Config {
                vocab_size: 2048,
                base_emb_dim: 256,
                base_num_decoder_layers: 4,
                base_num_query_heads: 8,
                base_num_kv_heads: 4,
                head_dim: 32,
                base_mlp_dim: 768,
                ..base
            },
            "qwen3-moe-tiny" => Config {
                moe: Some(moe),
                ..base
            },
            "qwen3-moe-bench" => Config {
                base_num_decoder_layers: 2,
                moe: Some(MoeSettings {
                    num_experts: 16,
                    moe_mlp_dim: 64,
                    first_num_dense_layers: 0,
                    ..moe
                }),
                ..base
            },
            "deepseek3-tiny" => deepseek3_tiny,
            // The ~1.3B variant of MaxText's GA integration test
            // (`tests/integration/gradient_accumulation_test.py`).
            "deepseek3-1.3b" => Config {
                base_emb_dim: 1024,
                base_mlp_dim: 2048,
                base_num_decoder_layers: 24,
                moe: deepseek3_tiny.moe.clone().map(|m| MoeSettings {
                    moe_mlp_dim: 1024,
                    first_num_dense_layers: 1,
                    num_experts_per_tok: 2,
                    ..m
                }),
                ..deepseek3_tiny.clone()
            },
            "llama3-tiny" => Config {
                normalization_layer_epsilon: 1e-5,
                ..Config::llama3_2_1b_rope(base)
            },
            "llama3.2-1b" => Config {
                vocab_size: 128_256,
                base_emb_dim: 2048,
                base_num_decoder_layers: 16,
                base_num_query_heads: 32,
                base_num_kv_heads: 8,
                head_dim: 64,
                base_mlp_dim: 8192,
                normalization_layer_epsilon: 1e-5,
                ..Config::llama3_2_1b_rope(base)
            },
            "qwen2-tiny" => Config {
                qk_norm: false,
                qkv_bias: true,
                ..base
            },
            "qwen2.5-0.5b" => Config {
                vocab_size: 151_936,
                base_emb_dim: 896,
                base_num_decoder_layers: 24,
                base_num_query_heads: 14,
                base_num_kv_heads: 2,
                head_dim: 64,
                base_mlp_dim: 4864,
                qk_norm: false,
                qkv_bias: true,
                ..base
            },
            "qwen3-0.6b" => Config {
                vocab_size: 151_936,
                base_emb_dim: 1024,
                base_num_decoder_layers: 28,
                base_num_query_heads: 16,
                base_num_kv_heads: 8,
                head_dim: 128,
                base_mlp_dim: 3072,
                ..base
            },
            _ => return None,
        })
    }

    /// `qwen3-tiny`: CPU-sized, byte vocabulary, tied head; the base the other Qwen3 presets modify.
    fn qwen3_tiny() -> Config {
        Config {
            logits_via_embedding: true,
            rope_max_timescale: 1_000_000.0,
            qk_norm: true,
            ..Config::default()
        }
    }

    /// `base` as Llama 3: no QK-norm, θ 500000 with Llama 3.2's frequency scaling (factor 32,
    /// low/high frequency factors 1 and 4 over an original 8192 positions).
    fn llama3_2_1b_rope(base: Config) -> Config {
        Config {
            qk_norm: false,
            rope_max_timescale: 500_000.0,
            rope_llama3: Some(Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            }),
            ..base
        }
    }

    /// `deepseek3-tiny`, MaxText's (`configs/models/deepseek3-tiny.yml`): MLA with YaRN, 16 experts
    /// top-8 with a sigmoid router, 1 shared expert, the first 3 of 61 layers dense, untied
    /// head.
    fn deepseek3_tiny() -> Config {
        Config {
            vocab_size: 129_280,
            base_emb_dim: 64,
            base_num_decoder_layers: 61,
            base_num_query_heads: 4,
            base_num_kv_heads: 4,
            head_dim: 128,
            base_mlp_dim: 64,
            moe: Some(MoeSettings {
                num_experts: 16,
                num_experts_per_tok: 8,
                moe_mlp_dim: 64,
                shared_experts: 1,
                first_num_dense_layers: 3,
                score: RouterScore::Sigmoid,
                routed_scaling_factor: 2.5,
                routed_bias: true,
                ..MoeSettings::default()
            }),
            mla: Some(MlaSettings {
                q_lora_rank: 32,
                kv_lora_rank: 16,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                rope_interleave: true,
                latent_norm_eps: 1e-6,
            }),
            rope_yarn: Some(Yarn {
                factor: 40.0,
                original_max_position: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
                attention_factor: 1.0,
            }),
            ..Config::default()
        }
    }

    /// The experts of `qwen3-moe-tiny`: 8 routed, top-2 softmax-routed, one shared, the first layer dense.
    fn qwen3_moe_tiny_experts() -> MoeSettings {
        MoeSettings {
            moe_mlp_dim: 96,
            shared_experts: 1,
            first_num_dense_layers: 1,
            ..MoeSettings::default()
        }
    }

    /// The preset names.
    pub const PRESETS: &'static [&'static str] = &[
        "qwen3-tiny",
        "qwen3-peer",
        "qwen3-0.6b",
        "qwen3-moe-tiny",
        "qwen3-moe-bench",
        "deepseek3-tiny",
        "deepseek3-1.3b",
        "llama3-tiny",
        "llama3.2-1b",
        "qwen2-tiny",
        "qwen2.5-0.5b",
    ];
}
