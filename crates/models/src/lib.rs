/*!
The `models` layer of ferrotext: layers ([`nn`], the mixture-of-experts block [`moe`]) and the
decoder ([`decoder`]: Qwen3, Qwen3-MoE, DeepSeek-V3 with its pieces in [`deepseek`]) written on the
`spmd` ops. It must not know about the training loop: a model declares its parameters (names,
shapes, logical axes, initialisation) and computes a loss from parameters and a batch; the
trainer decides how parameters are laid out and tagged.

# The key decision: parameters come in, typed

A model never chooses its parameters' `reduced` tags. It receives them as [`Array`]s already
placed by the caller, so the same forward pass serves the deferred step (parameters `{R:data}`,
gradients `{U:data}`) and the untagged one, and nothing here can drop a tag.

[`Array`]: ferrotext_spmd::Array
*/
#![deny(missing_docs)]

pub mod decoder;
pub mod deepseek;
pub mod kv_cache;
pub mod moe;
pub mod mtp;
pub mod nn;
mod params;
mod positions;
mod presets;
pub mod remat;
pub mod router;

pub use kv_cache::{KvCache, KvSlot};
pub use params::{init_normal, HfLayout, HfLayoutError, Init, ParamInfo, Rng};
pub use positions::{Balanced, Positions};
pub use remat::RematPolicy;
