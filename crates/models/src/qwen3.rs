//! The decoder's configuration types under their former path, kept while callers move to
//! [`crate::decoder`]: `Config`, `MoeSettings`, `ConfigError` are the decoder's, `MlaSettings`
//! DeepSeek's. The model itself is [`Decoder`]; it has no other name.

pub use crate::decoder::{Config, ConfigError, Decoder, MoeSettings};
pub use crate::deepseek::MlaSettings;
