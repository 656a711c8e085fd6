//! The user's mistakes: [`UsageError`] is the one error type `main` maps to exit code 2.

/// An error the user caused (bad flag value, bad mesh): exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// `message` as a [`UsageError`] inside an [`anyhow::Error`] (what the commands return).
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}
