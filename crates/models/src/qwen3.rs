//! The decoder under its former names, kept while callers move to [`crate::decoder`]:
//! `qwen3::Qwen3` is [`Decoder`], and `Config`, `MoeSettings`, `MlaSettings`, `ConfigError` are
//! the decoder's.

pub use crate::decoder::{Config, ConfigError, Decoder, MoeSettings};
pub use crate::deepseek::MlaSettings;

/// The former name of [`Decoder`].
pub type Qwen3 = Decoder;
