//! Which instruction set the kernels that dispatch on the processor run on: the portable
//! matrix product ([`crate::portable`]) and the row kernels compiled for AVX-512 where the CPU
//! has it ([`crate::fastmath`]'s `vectorized`, the optimizer's sums of squares).
//!
//! Every set gives the same bits (the portable kernel's chains are fused multiply-adds, which
//! round exactly once on every set; the row kernels are the same IEEE operations in the same
//! order, which Rust never fuses), so a run's numbers do not depend on the processor.
//! `FERROTEXT_PORTABLE_ISA=avx512|avx2|scalar` forces one set for all of them, which is how a
//! test shows that on one machine; a run says which set ran ([`instruction_set`]). A forced set
//! this processor does not have is refused by [`crate::check_kernel_env`], never replaced in
//! silence (a caller that skips that check gets the widest set the processor has, which
//! [`instruction_set`] names).

use std::sync::OnceLock;

/// The environment variable that forces an instruction set.
pub(crate) const ENV: &str = "FERROTEXT_PORTABLE_ISA";

/// An instruction set the processor-dispatching kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512F with FMA.
    Avx512,
    /// AVX2 with FMA.
    Avx2,
    /// No vector extension past baseline x86-64 (SSE2): the portable kernel's `f32::mul_add`
    /// (a hardware FMA where the target has one, else libm's), the row kernels as compiled.
    Scalar,
}

impl Isa {
    /// This process's set: the one `FERROTEXT_PORTABLE_ISA` forces when the CPU has it, else
    /// the widest this CPU has. Read once.
    pub(crate) fn detect() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| match forced() {
            Ok(Some(isa)) => isa,
            _ => Isa::best(),
        })
    }

    /// The widest set this CPU has.
    pub(crate) fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Whether a CPU whose widest set is `best` can run `self`.
    fn runs_on(self, best: Isa) -> bool {
        match (self, best) {
            (Isa::Scalar, _) | (_, Isa::Avx512) => true,
            (Isa::Avx2, best) => best == Isa::Avx2,
            (Isa::Avx512, _) => false,
        }
    }

    /// For run headers: `AVX-512`, `AVX2` or `scalar`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "AVX-512",
            Isa::Avx2 => "AVX2",
            Isa::Scalar => "scalar",
        }
    }

    /// The value `FERROTEXT_PORTABLE_ISA` takes for this set.
    fn key(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Scalar => "scalar",
        }
    }
}

/// The set `FERROTEXT_PORTABLE_ISA` forces (`None` when unset or empty).
///
/// # Errors
/// A value that names no set, or a set this CPU does not have: one line saying so.
pub(crate) fn forced() -> Result<Option<Isa>, String> {
    let value = match std::env::var(ENV) {
        Ok(v) if !v.is_empty() => v,
        Ok(_) | Err(std::env::VarError::NotPresent) => return Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(format!("{ENV} is not UTF-8; it takes avx512, avx2, scalar"))
        }
    };
    parse(&value, Isa::best()).map(Some)
}

/// The set `value` names, on a CPU whose widest set is `best`.
///
/// # Errors
/// As [`forced`].
fn parse(value: &str, best: Isa) -> Result<Isa, String> {
    let all = [Isa::Avx512, Isa::Avx2, Isa::Scalar];
    let Some(isa) = all.into_iter().find(|i| i.key() == value) else {
        return Err(format!(
            "{ENV}={value} names nothing this build knows; it takes avx512, avx2, scalar"
        ));
    };
    if !isa.runs_on(best) {
        return Err(format!(
            "{ENV}={value} asks for {}, which this processor does not have (it runs {}); \
             force a narrower set or leave it unset",
            isa.name(),
            best.name()
        ));
    }
    Ok(isa)
}

/// The instruction set this process's processor-dispatching kernels run on (the portable
/// matrix product, the row kernels), for run headers: `AVX-512`, or `AVX2 (forced by
/// FERROTEXT_PORTABLE_ISA)`.
pub fn instruction_set() -> String {
    let isa = Isa::detect();
    match forced() {
        Ok(Some(_)) => format!("{} (forced by {ENV})", isa.name()),
        _ => isa.name().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A named set runs where the processor has it; a wider one than the processor's widest is
    /// refused naming both, never replaced; a misspelling is refused listing the names.
    #[test]
    fn a_forced_set_runs_only_where_the_processor_has_it() {
        for best in [Isa::Avx512, Isa::Avx2, Isa::Scalar] {
            assert_eq!(parse("scalar", best), Ok(Isa::Scalar));
        }
        assert_eq!(parse("avx512", Isa::Avx512), Ok(Isa::Avx512));
        assert_eq!(parse("avx2", Isa::Avx512), Ok(Isa::Avx2));
        let refused = parse("avx512", Isa::Avx2).unwrap_err();
        assert!(
            refused.contains("asks for AVX-512, which this processor does not have (it runs AVX2)"),
            "{refused}"
        );
        assert!(parse("avx2", Isa::Scalar).is_err());
        let unknown = parse("sse2", Isa::Avx512).unwrap_err();
        assert!(unknown.contains("takes avx512, avx2, scalar"), "{unknown}");
    }
}
