//! One dimension's layout ([`DimSpec`]), the axis sets a spec's tags are ([`AxisSet`]), and how
//! Python prints them (JAX's error texts quote these forms).
//!
//! This file sits below `spec.rs`, `mesh.rs` and `error.rs` and imports none of them, so the
//! error type can name partitions without importing the spec that checks them.

use std::collections::BTreeSet;
use std::fmt;

/// A set of mesh axis names (the `unreduced` or `reduced` set of a spec).
///
/// Ordered by name so that iteration is deterministic; printing in *mesh* order is done where a
/// mesh is known ([`crate::ArrayType`]).
pub type AxisSet = BTreeSet<String>;

/// How one array dimension is laid out: replicated, or split over one or more mesh axes (the first
/// listed axis major).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DimSpec {
    /// Not split (`None` in JAX).
    Replicated,
    /// Split over these axes, major first; never empty.
    Sharded(Vec<String>),
}

impl DimSpec {
    /// The dimension split over one axis.
    pub fn axis(name: impl Into<String>) -> DimSpec {
        DimSpec::Sharded(vec![name.into()])
    }

    /// The dimension split over `names` (major first); canonicalised, so no names means
    /// [`DimSpec::Replicated`] (R1.10).
    pub fn axes<S: Into<String>>(names: impl IntoIterator<Item = S>) -> DimSpec {
        let names: Vec<String> = names.into_iter().map(Into::into).collect();
        if names.is_empty() {
            DimSpec::Replicated
        } else {
            DimSpec::Sharded(names)
        }
    }

    /// The axes this dimension is split over (empty when replicated).
    pub fn axis_names(&self) -> &[String] {
        match self {
            DimSpec::Replicated => &[],
            DimSpec::Sharded(names) => names,
        }
    }

    /// True when the dimension is not split.
    pub fn is_replicated(&self) -> bool {
        matches!(self, DimSpec::Replicated)
    }
}

impl From<&str> for DimSpec {
    fn from(name: &str) -> DimSpec {
        DimSpec::axis(name)
    }
}

impl From<Option<&str>> for DimSpec {
    fn from(name: Option<&str>) -> DimSpec {
        name.map_or(DimSpec::Replicated, DimSpec::axis)
    }
}

impl<const N: usize> From<[&str; N]> for DimSpec {
    fn from(names: [&str; N]) -> DimSpec {
        DimSpec::axes(names)
    }
}

/// Python's repr of one partition entry: `None`, `'x'` or `('x', 'y')`.
impl fmt::Display for DimSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DimSpec::Replicated => f.write_str("None"),
            DimSpec::Sharded(names) if names.len() == 1 => write!(f, "'{}'", names[0]),
            DimSpec::Sharded(names) => {
                f.write_str("(")?;
                for (i, n) in names.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "'{n}'")?;
                }
                f.write_str(")")
            }
        }
    }
}

/// A partitions tuple printed as Python does: `('x', None)`, `('x',)`, `()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionsRepr(pub Vec<DimSpec>);

impl fmt::Display for PartitionsRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("(")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        if self.0.len() == 1 {
            f.write_str(",")?;
        }
        f.write_str(")")
    }
}

/// An axis set printed as a Python set literal: `{'x', 'y'}`.
pub(crate) struct SetRepr<'a>(pub &'a AxisSet);

impl fmt::Display for SetRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, a) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "'{a}'")?;
        }
        f.write_str("}")
    }
}

/// An axis set printed as Python's `frozenset({'x', 'y'})`, as JAX's messages do.
pub(crate) struct FrozenSetRepr<'a>(pub &'a AxisSet);

impl fmt::Display for FrozenSetRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("frozenset()")
        } else {
            write!(f, "frozenset({})", SetRepr(self.0))
        }
    }
}
