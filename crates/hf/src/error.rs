//! The one error type of the `hf` crate. Both variants are the user's to fix or the machine's
//! to explain: a model file or directory that cannot be used names its path and the problem; a
//! read or write the system refused names its path and the system's error.

/// Everything reading or writing a Hugging Face model can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HfError {
    /// A model file or directory that cannot be used (the user named it): unreadable,
    /// malformed, or a model this crate cannot express.
    #[error("parameters {path}: {reason}")]
    Params {
        /// The file or directory.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A family preset whose `config.json` keys do not read (a defect of the preset).
    #[error("model preset `{name}`: {reason}")]
    Preset {
        /// The preset's `model_name`.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The system's error.
        source: std::io::Error,
    },
}
