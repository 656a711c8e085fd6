//! `[config.toml] key=value ...`: the arguments `train`, `plan`, `generate` and `emulate` take
//! to describe a `train` config.

use std::path::PathBuf;

use ferrotext_train::{TrainConfig, TrainError};

/// Splits `[config.toml] key=value ...`: a first argument without `=` is the config file, the
/// rest are the overrides.
pub fn split(args: &[String]) -> (Option<PathBuf>, &[String]) {
    match args.first() {
        Some(first) if !first.contains('=') => (Some(PathBuf::from(first)), &args[1..]),
        _ => (None, args),
    }
}

/// The config of `[config.toml] key=value ...`, each value of the right type but not yet checked
/// together ([`TrainConfig::parse`]).
///
/// # Errors
/// As [`TrainConfig::parse`]: an unknown key, a value of the wrong type, an unreadable file.
pub fn parse_config(args: &[String]) -> Result<TrainConfig, TrainError> {
    let (file, overrides) = split(args);
    TrainConfig::parse(file.as_deref(), overrides)
}

/// The value of the last `key=value` override in `args` that names `key` exactly (untrimmed).
pub fn last_value<'a>(args: &'a [String], key: &str) -> Option<&'a str> {
    args.iter()
        .filter_map(|a| a.strip_prefix(key)?.strip_prefix('='))
        .next_back()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_first_argument_without_equals_is_the_file() {
        let args = strings(&["run.toml", "steps=3"]);
        let (file, rest) = split(&args);
        assert_eq!(file, Some(PathBuf::from("run.toml")));
        assert_eq!(rest, &args[1..]);
        let args = strings(&["steps=3", "x"]);
        assert_eq!(split(&args), (None, &args[..]));
        assert_eq!(split(&[]), (None, &[][..]));
    }

    #[test]
    fn the_last_override_of_a_key_wins() {
        let args = strings(&[
            "num_processes=2",
            "steps=1",
            "num_processes=4",
            "num_processesx=9",
        ]);
        assert_eq!(last_value(&args, "num_processes"), Some("4"));
        assert_eq!(last_value(&args, "local_devices"), None);
    }
}
