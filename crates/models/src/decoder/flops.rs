//! What a token costs to train, in FLOPs ([`Decoder::flops_per_token`]): the matrix products,
//! counted from the declared weights, and the attention's score and value products, counted from
//! the keys each query sees; and what the backward recomputes under `remat_policy` and
//! `num_vocab_tiling` ([`Decoder::recompute_flops_per_token`]).

use super::{Config, Decoder};
use crate::params::ParamInfo;
use crate::remat::RematPolicy;

impl Decoder {
    /// Training FLOPs per token at sequence length `seq`: 6 per matmul weight (forward and both
    /// backward products; the LM head counts the vocabulary projection, the embedding lookup
    /// counts nothing; of the routed experts only the k a token uses) plus the attention score
    /// and value products (`6·heads·(qk + v)` per key a query sees; a sliding layer counts only
    /// the keys its window leaves), plus the MTP module's ([`crate::mtp::flops_per_token`]). Biases, norms, soft-caps, the RoPE and
    /// the gates' activations are elementwise and count nothing; GeGLU and SwiGLU cost the same
    /// three products; MLA counts its projections as declared (one `q_proj` without the query
    /// latent, `q_a_proj` and `q_b_proj` with it).
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
        // Scores (q·k over the query/key width) and values, forward and backward: 6 each.
        let (qk_width, v_width) = match &c.mla {
            Some(m) => (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim),
            None => (c.head_dim, c.head_dim),
        };
        let keys: f64 = (0..c.base_num_decoder_layers)
            .map(|i| attended_keys(c, i, seq))
            .sum();
        let attention = 6.0 * keys * (c.base_num_query_heads * (qk_width + v_width)) as f64;
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
        let keys: f64 = (0..c.base_num_decoder_layers)
            .map(|i| attended_keys(c, i, seq))
            .sum();
        let attention = 2.0 * keys * (c.base_num_query_heads * (qk + v)) as f64;
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

/// The keys a query of layer `i` is counted to see in a sequence of `seq`: `seq` on a
/// full-attention layer (the usual convention, MaxText's and PaLM's, which does not halve for
/// causality), and on a sliding layer `seq` times the share of the (query, key) pairs the window
/// leaves, so that a window costs what the tiled kernel does (it visits only each row's keys):
/// `w(w+1)/2 + (seq − w)·w` of the `seq(seq+1)/2` causal pairs for a window `w < seq`. (Counting
/// `w` keys, as before, undercounted a window of half the sequence by 1.5×.)
pub(crate) fn attended_keys(c: &Config, i: usize, seq: usize) -> f64 {
    let n = seq as f64;
    match c.window_of(i) {
        Some(w) if w < seq => {
            let w = w as f64;
            let pairs = w * (w + 1.0) / 2.0 + (n - w) * w;
            n * pairs / (n * (n + 1.0) / 2.0)
        }
        _ => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::SlidingWindow;

    /// The window's share is the share of causal (query, key) pairs the kernel visits, counted
    /// one query at a time.
    #[test]
    fn a_window_costs_the_pairs_it_leaves() {
        let c = Config {
            sliding_window: Some(SlidingWindow {
                size: 6,
                layers: vec![true, false],
            }),
            ..Config::default()
        };
        let seq = 16;
        let visited: usize = (0..seq).map(|q| (q + 1).min(6)).sum();
        let all: usize = (0..seq).map(|q| q + 1).sum();
        let want = seq as f64 * visited as f64 / all as f64;
        assert!((attended_keys(&c, 0, seq) - want).abs() < 1e-12);
        assert_eq!(attended_keys(&c, 1, seq), 16.0, "a full layer: seq");
        assert_eq!(
            attended_keys(&c, 0, 4),
            4.0,
            "a window past the sequence: seq"
        );
        // Half the sequence: 57 of the 78 pairs, 0.73 of a full layer (counting w keys: 0.5).
        assert!((attended_keys(&c, 0, 12) - 12.0 * 57.0 / 78.0).abs() < 1e-12);
    }
}
