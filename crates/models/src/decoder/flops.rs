//! What a decoder computes, counted: training FLOPs per token (the model's own, and what the
//! backward recomputes under `remat_policy` and `num_vocab_tiling`), for the plan, the cost
//! model and the MFU a run prints.

use super::Decoder;
use crate::params::ParamInfo;
use crate::remat::RematPolicy;

impl Decoder {
    /// Training FLOPs per token at sequence length `seq`: 6 per matmul weight (forward and both
    /// backward products; the LM head counts the vocabulary projection, the embedding lookup
    /// counts nothing; of the routed experts only the k a token uses) plus the attention score and
    /// value products (12·layers·seq·heads·head_dim), plus the MTP module's
    /// ([`crate::mtp::flops_per_token`]).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let c = &self.cfg;
        let embedding = c.vocab_size * c.base_emb_dim;
        // The matrices (rank ≥ 2) of the main model but the embedding; norms, biases and the
        // routers' selection biases are added, not multiplied, and count nothing.
        let mtp = c.mtp_num_layers > 0;
        let main: Vec<ParamInfo> = match (mtp, &self.weights.mtp) {
            (true, Some(m)) => {
                let skip = m.params().len();
                let all = self.params();
                all[..all.len() - skip].to_vec()
            }
            _ => self.params(),
        };
        let matrices: usize = main
            .iter()
            .filter(|p| p.shape.len() >= 2 && p.name != self.weights.embed_tokens.name)
            .map(|p| p.shape.iter().product::<usize>())
            .sum();
        let lm_head = if c.logits_via_embedding { embedding } else { 0 };
        // A token runs k of the E routed experts: only their weights count.
        let idle_experts: usize = match &c.moe {
            Some(m) => {
                let layers = (0..c.base_num_decoder_layers)
                    .filter(|&i| c.is_moe_layer(i))
                    .count();
                let per_expert = 3 * c.base_emb_dim * m.moe_mlp_dim;
                layers * (m.num_experts - m.num_experts_per_tok) * per_expert
            }
            None => 0,
        };
        let matmul_weights = matrices - idle_experts + lm_head;
        // Scores (q·k over the query/key width) and values, forward and backward: 6 each; a
        // sliding layer's query sees at most its window.
        let (qk_width, v_width) = match &c.mla {
            Some(m) => (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim),
            None => (c.head_dim, c.head_dim),
        };
        let keys: usize = (0..c.base_num_decoder_layers)
            .map(|i| c.window_of(i).map_or(seq, |w| w.min(seq)))
            .sum();
        let attention = 6.0 * (keys * c.base_num_query_heads * (qk_width + v_width)) as f64;
        6.0 * matmul_weights as f64 + attention + crate::mtp::flops_per_token(c, seq)
    }

    /// FLOPs per token the backward spends recomputing what it did not keep, at sequence length
    /// `seq` (on top of [`Decoder::flops_per_token`], which counts the model's own):
    /// under a `remat_policy`, each layer's forward products the policy does not save (2 per
    /// weight) and its attention's forward products (the tiled attention's output is never
    /// saved); with `num_vocab_tiling > 1`, the head's logits again (2 per head weight).
    pub fn recompute_flops_per_token(&self, seq: usize) -> f64 {
        let c = &self.cfg;
        let head = if self.vocab_tiles > 1 {
            2.0 * (c.vocab_size * c.base_emb_dim) as f64
        } else {
            0.0
        };
        if self.remat == RematPolicy::None {
            return head;
        }
        let (qk, v) = match &c.mla {
            Some(m) => (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim),
            None => (c.head_dim, c.head_dim),
        };
        let keys: usize = (0..c.base_num_decoder_layers)
            .map(|i| c.window_of(i).map_or(seq, |w| w.min(seq)))
            .sum();
        let attention = 2.0 * (keys * c.base_num_query_heads * (qk + v)) as f64;
        // The layers' products per token, forward (2 per weight), less those the policy saves
        // (counted for a dense GQA layer's seven projections; MoE experts' grouped products
        // and MLA's latents are recomputed under every policy but `none`).
        let layer_forward = (self.flops_per_token(seq) - 3.0 * attention) / 3.0
            - 2.0 * (c.vocab_size * c.base_emb_dim) as f64;
        let (d, f) = (c.base_emb_dim, c.base_mlp_dim);
        let (q, kv) = (
            c.base_num_query_heads * c.head_dim,
            c.base_num_kv_heads * c.head_dim,
        );
        let sizes = [d * q, d * kv, d * kv, q * d, d * f, d * f, f * d];
        let dense = c.mla.is_none() && c.moe.is_none();
        let saved: usize = match dense {
            true => (self.remat.saved_products().iter().zip(sizes))
                .filter(|(kept, _)| **kept)
                .map(|(_, n)| n)
                .sum(),
            false => 0,
        };
        let products = (layer_forward - 2.0 * (saved * c.base_num_decoder_layers) as f64).max(0.0);
        head + products + attention
    }
}
