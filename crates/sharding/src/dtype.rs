//! [`DType`]: the element type of an array, and the one precision type of ferrotext — the
//! precision keys (`dtype`, `weight_dtype`, `grad_dtype`, `save_parameters_dtype`), the element
//! type a reduction moves, and a saved file's tensors all name their dtype with it.
//!
//! Invariant: a dtype is spelled two ways, its short name (`bf16`, as printed in array types
//! `bf16[8@data,4]`) and its long name (`bfloat16`, MaxText's and NumPy's, as config files and
//! Hugging Face's `torch_dtype` write it); [`DType::parse`] is the one parser and takes either,
//! and a serialized dtype is its long name. Which dtypes a key *accepts* is the key's check,
//! made where the key is validated.

use std::fmt;

/// Element type of an array. The sharding layer only needs its name and width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16.
    BF16,
    /// 16-bit IEEE float.
    F16,
    /// 32-bit signed integer.
    I32,
    /// 32-bit unsigned integer.
    U32,
}

/// Every dtype with its short and long names, in the order errors list them.
const NAMES: [(DType, &str, &str); 5] = [
    (DType::F32, "f32", "float32"),
    (DType::BF16, "bf16", "bfloat16"),
    (DType::F16, "f16", "float16"),
    (DType::I32, "i32", "int32"),
    (DType::U32, "u32", "uint32"),
];

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The short name used in printed types (`f32`, `bf16`, ...).
    pub fn short_name(self) -> &'static str {
        NAMES.iter().find(|n| n.0 == self).map_or("?", |n| n.1)
    }

    /// The long name (`float32`, `bfloat16`, `float16`, `int32`, `uint32`): MaxText's and
    /// NumPy's, and Hugging Face's `torch_dtype`.
    pub fn name(self) -> &'static str {
        NAMES.iter().find(|n| n.0 == self).map_or("?", |n| n.2)
    }

    /// The dtype either of its names spells (`bf16` or `bfloat16`, `f32` or `float32`, ...).
    ///
    /// # Examples
    /// ```
    /// use ferrotext_sharding::DType;
    /// assert_eq!(DType::parse("bf16"), DType::parse("bfloat16"));
    /// assert_eq!(DType::parse("float32"), Some(DType::F32));
    /// assert_eq!(DType::parse("half"), None);
    /// ```
    pub fn parse(name: &str) -> Option<DType> {
        NAMES
            .iter()
            .find(|n| n.1 == name || n.2 == name)
            .map(|n| n.0)
    }

    /// Bits of significand a float keeps, the implicit one included (f32: 24, f16: 11, bf16: 8);
    /// `None` for an integer type. A dtype with fewer is narrower.
    pub fn mantissa_bits(self) -> Option<u32> {
        match self {
            DType::F32 => Some(24),
            DType::F16 => Some(11),
            DType::BF16 => Some(8),
            DType::I32 | DType::U32 => None,
        }
    }
}

/// `long (short)` for every dtype, as a refused name lists them.
fn all_names() -> String {
    let names: Vec<String> = NAMES.iter().map(|n| format!("{} ({})", n.2, n.1)).collect();
    match names.split_last() {
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

impl fmt::Display for DType {
    /// The short name, as array types print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.short_name())
    }
}

impl serde::Serialize for DType {
    /// The long name (`bfloat16`).
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for DType {
    /// Either name ([`DType::parse`]).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let name = String::deserialize(d)?;
        DType::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!("unknown dtype `{name}`: expected {}", all_names()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_names_parse_to_one_value_and_print_back() {
        for (dtype, short, long) in NAMES {
            assert_eq!(DType::parse(short), Some(dtype));
            assert_eq!(DType::parse(long), Some(dtype));
            assert_eq!(dtype.to_string(), short);
            assert_eq!(dtype.name(), long);
        }
        assert_eq!(DType::parse("BF16"), None);
        assert_eq!(DType::parse("fp32"), None);
        assert_eq!((DType::F32.size_bytes(), DType::BF16.size_bytes()), (4, 2));
    }

    #[test]
    fn serde_writes_the_long_name_and_reads_either() {
        assert_eq!(serde_json::to_string(&DType::BF16).unwrap(), "\"bfloat16\"");
        let short: DType = serde_json::from_str("\"bf16\"").unwrap();
        let long: DType = serde_json::from_str("\"bfloat16\"").unwrap();
        assert_eq!((short, long), (DType::BF16, DType::BF16));
        let err = serde_json::from_str::<DType>("\"half\"").unwrap_err();
        assert!(
            err.to_string().starts_with(
                "unknown dtype `half`: expected float32 (f32), bfloat16 (bf16), float16 (f16), \
                 int32 (i32) or uint32 (u32)"
            ),
            "{err}"
        );
        #[derive(serde::Deserialize)]
        struct Keys {
            dtype: DType,
        }
        let keys: Keys = toml::from_str("dtype = \"f32\"").unwrap();
        assert_eq!(keys.dtype, DType::F32);
    }

    #[test]
    fn narrower_floats_keep_fewer_bits() {
        let bits = |d: DType| d.mantissa_bits().unwrap();
        assert!(bits(DType::BF16) < bits(DType::F16));
        assert!(bits(DType::F16) < bits(DType::F32));
        assert_eq!(DType::U32.mantissa_bits(), None);
    }
}
