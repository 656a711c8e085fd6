//! Every command's `--dtype`: the words of the precision keys (`bfloat16` or `bf16`, `float32` or
//! `f32`), read by the one parser ([`DType::parse`]).

use ferrotext_sharding::DType;

use super::usage::UsageError;

/// `value` of `--dtype` when it names one of `accepted`.
///
/// # Errors
/// A [`UsageError`] naming the flag, the value and the accepted names (both spellings).
pub fn dtype_flag(value: &str, accepted: &[DType]) -> Result<DType, UsageError> {
    DType::parse(value)
        .filter(|d| accepted.contains(d))
        .ok_or_else(|| {
            let long: Vec<&str> = accepted.iter().map(|d| d.name()).collect();
            let short: Vec<&str> = accepted.iter().map(|d| d.short_name()).collect();
            UsageError(format!(
                "--dtype must be {} (or {}), got `{value}`",
                long.join(" or "),
                short.join(", ")
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn either_spelling_is_taken_and_others_are_refused_naming_both() {
        let both = [DType::BF16, DType::F32];
        assert_eq!(dtype_flag("bf16", &both).unwrap(), DType::BF16);
        assert_eq!(dtype_flag("bfloat16", &both).unwrap(), DType::BF16);
        assert_eq!(dtype_flag("float32", &both).unwrap(), DType::F32);
        assert_eq!(
            dtype_flag("float16", &both).unwrap_err().to_string(),
            "--dtype must be bfloat16 or float32 (or bf16, f32), got `float16`"
        );
        assert!(dtype_flag("half", &both).is_err());
    }
}
