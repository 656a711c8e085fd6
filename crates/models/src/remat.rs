//! What the decoder's backward keeps of each layer (MaxText's `remat_policy`): every layer is a
//! rematerialized region ([`ferrotext_spmd::Ctx::remat`]) whose policy names what its forward
//! saves; the rest is recomputed from the layer's input in the backward, with the same bits.
//!
//! The names follow MaxText's (`layers/decoders.py`), each a JAX checkpoint policy:
//!
//! | policy | kept besides each layer's input |
//! |---|---|
//! | `none` | everything (no region: today's tape) |
//! | `full` | nothing |
//! | `minimal` | every product without batch dims: the q, k, v, o and MLP projections |
//! | `save_dot_except_mlp` | the q, k, v and o projections |
//! | `save_dot_except_mlpwi` | the q, k, v and o projections and the MLP's down projection |
//! | `save_qkv_proj` | the q, k and v projections |
//! | `save_out_proj` | the o projection |
//!
//! MaxText's `*_with_context` policies, which also keep the attention's output, are not offered:
//! the tiled attention's backward needs its log-sum-exps beside the output, which a saved value
//! does not carry.

use ferrotext_spmd::SavePolicy;

/// A layer's rematerialization policy (see the module docs); written as MaxText writes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RematPolicy {
    /// Keep everything; no recomputation.
    #[default]
    None,
    /// Keep only each layer's input.
    Full,
    /// Keep the products without batch dimensions.
    Minimal,
    /// Keep the attention projections.
    SaveDotExceptMlp,
    /// Keep the attention projections and the MLP's down projection.
    SaveDotExceptMlpwi,
    /// Keep the q, k, v projections.
    SaveQkvProj,
    /// Keep the output projection.
    SaveOutProj,
}

/// The name a layer gives the query projection's output.
pub(crate) const QUERY_PROJ: &str = "query_proj";
/// The key projection's output.
pub(crate) const KEY_PROJ: &str = "key_proj";
/// The value projection's output.
pub(crate) const VALUE_PROJ: &str = "value_proj";
/// The attention output projection's output.
pub(crate) const OUT_PROJ: &str = "out_proj";
/// The MLP's gate projection's output.
pub(crate) const MLPWI_0: &str = "mlpwi_0";
/// The MLP's up projection's output.
pub(crate) const MLPWI_1: &str = "mlpwi_1";
/// The MLP's down projection's output.
pub(crate) const MLPWO: &str = "mlpwo";

impl RematPolicy {
    /// Every policy, in the order the key's help lists them.
    pub const ALL: [RematPolicy; 7] = [
        RematPolicy::None,
        RematPolicy::Full,
        RematPolicy::Minimal,
        RematPolicy::SaveDotExceptMlp,
        RematPolicy::SaveDotExceptMlpwi,
        RematPolicy::SaveQkvProj,
        RematPolicy::SaveOutProj,
    ];

    /// MaxText's name.
    pub fn name(self) -> &'static str {
        match self {
            RematPolicy::None => "none",
            RematPolicy::Full => "full",
            RematPolicy::Minimal => "minimal",
            RematPolicy::SaveDotExceptMlp => "save_dot_except_mlp",
            RematPolicy::SaveDotExceptMlpwi => "save_dot_except_mlpwi",
            RematPolicy::SaveQkvProj => "save_qkv_proj",
            RematPolicy::SaveOutProj => "save_out_proj",
        }
    }

    /// The policy named `name`, if any.
    pub fn parse(name: &str) -> Option<RematPolicy> {
        RematPolicy::ALL.into_iter().find(|p| p.name() == name)
    }

    /// What a layer's region saves; `None` for [`RematPolicy::None`] (no region).
    pub fn save_policy(self) -> Option<SavePolicy> {
        let attention = [QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ];
        let names = |n: &[&'static str]| SavePolicy {
            dots_without_batch: false,
            names: n.to_vec(),
        };
        Some(match self {
            RematPolicy::None => return None,
            RematPolicy::Full => SavePolicy::nothing(),
            RematPolicy::Minimal => SavePolicy {
                dots_without_batch: true,
                names: Vec::new(),
            },
            RematPolicy::SaveDotExceptMlp => names(&attention),
            RematPolicy::SaveDotExceptMlpwi => {
                names(&[QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ, MLPWO])
            }
            RematPolicy::SaveQkvProj => names(&[QUERY_PROJ, KEY_PROJ, VALUE_PROJ]),
            RematPolicy::SaveOutProj => names(&[OUT_PROJ]),
        })
    }

    /// Which of a dense GQA layer's products the policy keeps: `[q, k, v, o, gate, up, down]`.
    pub fn saved_products(self) -> [bool; 7] {
        let attention = [true, true, true, true, false, false, false];
        match self {
            RematPolicy::None | RematPolicy::Minimal => [true; 7],
            RematPolicy::Full => [false; 7],
            RematPolicy::SaveDotExceptMlp => attention,
            RematPolicy::SaveDotExceptMlpwi => [true, true, true, true, false, false, true],
            RematPolicy::SaveQkvProj => [true, true, true, false, false, false, false],
            RematPolicy::SaveOutProj => [false, false, false, true, false, false, false],
        }
    }

    /// Elements per token a policy keeps of a dense layer's products, for a layer whose query
    /// projection is `q` wide, key and value projections `kv` each, model `d` and MLP `f`
    /// (what the memory plan counts besides the layer's input).
    pub fn kept_widths(self, q: usize, kv: usize, d: usize, f: usize) -> usize {
        if self == RematPolicy::None {
            return 0;
        }
        let widths = [q, kv, kv, d, f, f, d];
        self.saved_products()
            .iter()
            .zip(widths)
            .filter(|(kept, _)| **kept)
            .map(|(_, w)| w)
            .sum()
    }
}

impl std::fmt::Display for RematPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_only_none_has_no_region() {
        for p in RematPolicy::ALL {
            assert_eq!(RematPolicy::parse(p.name()), Some(p));
            assert_eq!(p.save_policy().is_none(), p == RematPolicy::None);
        }
        assert_eq!(RematPolicy::parse("minimal_with_context"), None);
    }
}
