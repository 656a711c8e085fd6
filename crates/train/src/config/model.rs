//! The decoder's config a [`TrainConfig`] asks for: the preset named by `model_name` (the
//! decoder's own or a model family's, see [`TrainConfig::preset`]), or the
//! `config.json` of a Hugging Face directory in `load_parameters_path`) with the model and MoE
//! keys applied on top.
//!
//! Invariant: only [`TrainConfig::plan`] builds it (once); MoE keys on a dense model are a usage
//! error, never ignored.

use std::path::Path;

use ferrotext_models::decoder;

use super::TrainConfig;
use crate::error::TrainError;

/// A key that sets a size of the model's weights: its name, the run's value (`None`: unset)
/// and the field of `C` it sets.
type ShapeKey<C> = (&'static str, Option<usize>, fn(&mut C) -> &mut usize);

impl TrainConfig {
    /// The Hugging Face directory the model comes from: `load_parameters_path` when it names a
    /// directory; `None` for a preset (or parameters from one `.safetensors` file).
    pub fn hf_source(&self) -> Option<&Path> {
        let dir = Path::new(&self.load_parameters_path);
        (!self.load_parameters_path.is_empty() && dir.is_dir()).then_some(dir)
    }

    /// What the model's source directory declares beyond the decoder (its special tokens,
    /// context, generation defaults and tokenizer), for a directory saved from it to declare the
    /// same; nothing for a model from a preset.
    ///
    /// # Errors
    /// The source's `config.json`, `generation_config.json` or tokenizer files cannot be read.
    pub(crate) fn source_declarations(&self) -> Result<ferrotext_hf::Declared, TrainError> {
        match self.hf_source() {
            Some(dir) => Ok(ferrotext_hf::Declared::of_directory(dir)?),
            None => Ok(ferrotext_hf::Declared::none()),
        }
    }

    /// The decoder's config: the preset with the overrides applied. Only
    /// [`TrainConfig::plan`] calls it (once); everything else reads the plan's decoder.
    ///
    /// # Errors
    /// An unknown preset, MoE keys that do not fit the preset, or a Hugging Face directory
    /// whose `config.json` is not usable.
    pub(crate) fn model(&self) -> Result<decoder::Config, TrainError> {
        let mut m = match self.hf_source() {
            Some(hf_dir) => {
                let m = ferrotext_hf::read_config(hf_dir)?;
                self.refuse_shape_overrides(&m, hf_dir)?;
                m
            }
            None => self.preset()?,
        };
        for (_, value, field) in self.shape_keys() {
            if let Some(v) = value {
                *field(&mut m) = v;
            }
        }
        if let Some(t) = self.logits_via_embedding {
            m.logits_via_embedding = t;
        }
        m.z_loss_multiplier = self.z_loss_multiplier as f32;
        m.mtp_num_layers = self.mtp_num_layers;
        m.mtp_loss_scaling_factor = self.mtp_loss_scaling_factor as f32;
        self.apply_moe(&mut m)?;
        Ok(m)
    }

    /// The keys that set sizes of the decoder's weights, each with the run's value and the
    /// decoder config's field.
    fn shape_keys(&self) -> [ShapeKey<decoder::Config>; 7] {
        [
            ("vocab_size", self.vocab_size, |m| &mut m.vocab_size),
            ("base_emb_dim", self.base_emb_dim, |m| &mut m.base_emb_dim),
            (
                "base_num_decoder_layers",
                self.base_num_decoder_layers,
                |m| &mut m.base_num_decoder_layers,
            ),
            ("base_num_query_heads", self.base_num_query_heads, |m| {
                &mut m.base_num_query_heads
            }),
            ("base_num_kv_heads", self.base_num_kv_heads, |m| {
                &mut m.base_num_kv_heads
            }),
            ("head_dim", self.head_dim, |m| &mut m.head_dim),
            ("base_mlp_dim", self.base_mlp_dim, |m| &mut m.base_mlp_dim),
        ]
    }

    /// The keys that set sizes of an MoE layer's weights, as [`TrainConfig::shape_keys`].
    fn moe_shape_keys(&self) -> [ShapeKey<decoder::MoeSettings>; 4] {
        [
            ("num_experts", self.num_experts, |m| &mut m.num_experts),
            ("moe_mlp_dim", self.moe_mlp_dim, |m| &mut m.moe_mlp_dim),
            ("shared_experts", self.shared_experts, |m| {
                &mut m.shared_experts
            }),
            ("first_num_dense_layers", self.first_num_dense_layers, |m| {
                &mut m.first_num_dense_layers
            }),
        ]
    }

    /// A key that sets a weight's shape to other than what the Hugging Face directory `dir`
    /// holds (its `config.json`, read into `from_dir`): refused before anything is loaded, naming
    /// the key and the directory's value, since the parameters come from that directory and
    /// would not fit (the loader would only report the tensors, against `config.json`). A key
    /// set to the directory's own value changes nothing and passes. (`logits_via_embedding` is
    /// left to the loader: set false, a tied directory's embedding, or its stored copy of it,
    /// loads as a head of its own; set true over a head of its own, the loader refuses that
    /// head by name.)
    ///
    /// # Errors
    /// [`TrainError::Usage`] for the first such key.
    fn refuse_shape_overrides(
        &self,
        from_dir: &decoder::Config,
        dir: &Path,
    ) -> Result<(), TrainError> {
        let refuse = |key: &str, set: String, held: String| {
            TrainError::usage(
                key,
                format!(
                    "{key} = {set} does not fit the model in {}, {held}: its weights are loaded \
                     from that directory, in its shapes; leave {key} unset",
                    dir.display()
                ),
            )
        };
        let (mut dense, mut moe) = (from_dir.clone(), from_dir.moe.clone());
        let dense_keys = self
            .shape_keys()
            .map(|(key, value, field)| (key, value, Some(*field(&mut dense))));
        let moe_keys = self
            .moe_shape_keys()
            .map(|(key, value, field)| (key, value, moe.as_mut().map(|m| *field(m))));
        for (key, value, held) in dense_keys.into_iter().chain(moe_keys) {
            match (value, held) {
                (Some(v), Some(h)) if v != h => {
                    return Err(refuse(
                        key,
                        v.to_string(),
                        format!("whose config.json has {h}"),
                    ))
                }
                (Some(v), None) => return Err(refuse(key, v.to_string(), "a dense model".into())),
                _ => {}
            }
        }
        Ok(())
    }

    /// The preset `model_name` names: one of the decoder's own ([`decoder::Config::preset`]) or
    /// a model family's (`mistral-7b`, `gemma2-tiny`, ...; [`ferrotext_hf::presets`]), read from
    /// its `config.json` keys by the family's reader.
    fn preset(&self) -> Result<decoder::Config, TrainError> {
        let name = &self.model_name;
        if let Some(m) = decoder::Config::preset(name) {
            return Ok(m);
        }
        ferrotext_hf::preset(name)?.ok_or_else(|| {
            let families = ferrotext_hf::presets();
            let mut all: Vec<&str> = decoder::Config::PRESETS.to_vec();
            all.extend(families.iter().map(|p| p.name));
            TrainError::usage(
                "model_name",
                format!(
                    "model_name `{name}` is not a preset (one of {})",
                    all.join(", ")
                ),
            )
        })
    }

    /// The MoE keys on top of the preset's feed-forward.
    fn apply_moe(&self, m: &mut decoder::Config) -> Result<(), TrainError> {
        let any_key = self.num_experts.is_some()
            || self.num_experts_per_tok.is_some()
            || self.moe_mlp_dim.is_some()
            || self.shared_experts.is_some()
            || self.first_num_dense_layers.is_some()
            || self.routed_score_func.is_some()
            || self.routed_scaling_factor.is_some()
            || self.norm_topk_prob.is_some()
            || self.load_balance_loss_weight.is_some()
            || self.routed_bias.is_some()
            || self.n_routing_groups.is_some()
            || self.topk_routing_group.is_some()
            || self.routed_bias_update_rate != 0.0
            || self.moe_withhold_tags;
        if m.moe.is_none() && self.num_experts.is_none() {
            if any_key {
                return Err(TrainError::usage(
                    "num_experts",
                    format!(
                        "MoE keys need an MoE model: set num_experts or pick an MoE preset \
                         (model_name `{}` is dense)",
                        self.model_name
                    ),
                ));
            }
            return Ok(());
        }
        let mut moe = m.moe.clone().unwrap_or(decoder::MoeSettings {
            moe_mlp_dim: m.base_mlp_dim,
            ..decoder::MoeSettings::default()
        });
        for (_, value, field) in self.moe_shape_keys() {
            if let Some(v) = value {
                *field(&mut moe) = v;
            }
        }
        let set = |field: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut moe.num_experts_per_tok, self.num_experts_per_tok);
        if let Some(f) = &self.routed_score_func {
            moe.score = match f.as_str() {
                "softmax" => ferrotext_models::moe::RouterScore::Softmax,
                "sigmoid" => ferrotext_models::moe::RouterScore::Sigmoid,
                other => {
                    return Err(TrainError::usage(
                        "routed_score_func",
                        format!("routed_score_func must be `softmax` or `sigmoid`, got `{other}`"),
                    ))
                }
            };
        }
        if let Some(f) = self.routed_scaling_factor {
            moe.routed_scaling_factor = f as f32;
        }
        if let Some(n) = self.norm_topk_prob {
            moe.norm_topk_prob = n;
        }
        if let Some(w) = self.load_balance_loss_weight {
            if !(w >= 0.0 && w.is_finite()) {
                return Err(TrainError::usage(
                    "load_balance_loss_weight",
                    format!("load_balance_loss_weight must be ≥ 0, got {w}"),
                ));
            }
            moe.load_balance_loss_weight = w as f32;
        }
        if let Some(b) = self.routed_bias {
            moe.routed_bias = b;
        }
        set(&mut moe.groups.n_routing_groups, self.n_routing_groups);
        set(&mut moe.groups.topk_routing_group, self.topk_routing_group);
        if self.routed_bias_update_rate > 0.0 && !moe.routed_bias {
            return Err(TrainError::usage(
                "routed_bias_update_rate",
                format!(
                    "routed_bias_update_rate = {} moves the router selection biases, and this \
                     model has none: set routed_bias=true",
                    self.routed_bias_update_rate
                ),
            ));
        }
        moe.withhold_tags = self.moe_withhold_tags;
        m.moe = Some(moe);
        Ok(())
    }
}
