//! The precision keys, MaxText's names and meanings: `dtype` (the activations between ops and
//! the matmul inputs), `weight_dtype` (the master weights and the optimizer state), `grad_dtype`
//! (the gradient accumulator and the deferred reduction), and `matmul_bf16_fallback` (bf16
//! products on another kernel when the one the user named has none).
//!
//! Invariants: a config that passed [`TrainConfig::plan`] has `dtype` and `grad_dtype` in
//! {`bfloat16`, `float32`} and `weight_dtype` = `float32` (what is built: master weights,
//! optimizer state and accumulator stay f32, the model converts weights to bf16 at use), and
//! never `grad_dtype=bfloat16` with `layout_invariant=true`. `grad_dtype=bfloat16` changes only the
//! deferred reduction: each device's f32 accumulator is rounded to bf16 once when the step's
//! reduction starts, the reduction moves bf16 and adds in f32, its result is rounded once and
//! widened for the optimizer (`ferrotext_comm::narrow`). The
//! bf16 kernel is fixed once per process by [`TrainConfig::select_bf16_kernel`], before any
//! product runs; nothing here runs a product.

use std::fmt;

use ferrotext_sharding::DType;

use super::TrainConfig;
use crate::error::{PrecisionProblem, TrainError};

/// The dtypes a precision key accepts, in words, as its error lists them: `float16` parses (it is
/// a [`DType`]) but no key builds it.
pub(crate) const DTYPE_CHOICES: &str = "bfloat16 or float32";

/// `value` of precision key `key` when it is one that is built (`float32`, `bfloat16`).
///
/// # Errors
/// [`TrainError::NotAChoice`] for any other dtype, naming the key and the value.
pub(crate) fn built(key: &'static str, value: DType) -> Result<DType, TrainError> {
    match value {
        DType::F32 | DType::BF16 => Ok(value),
        other => Err(TrainError::NotAChoice {
            key,
            value: other.name().to_string(),
            choices: DTYPE_CHOICES,
        }),
    }
}

/// The three precision keys of a checked config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Precision {
    /// `dtype`: the activations between ops and the matmul inputs.
    pub dtype: DType,
    /// `weight_dtype`: the master weights and the optimizer state (float32).
    pub weight_dtype: DType,
    /// `grad_dtype`: the deferred reduction (float32, or bfloat16 on the wire; the accumulator
    /// over micro-batches is float32 either way).
    pub grad_dtype: DType,
}

impl fmt::Display for Precision {
    /// `dtype bfloat16 (activations, matmul inputs), weight_dtype float32 (master weights,
    /// optimizer state), grad_dtype float32 (accumulator, reduction)`.
    /// With `grad_dtype=bfloat16`, the last part says what it means: `grad_dtype bfloat16 (f32
    /// accumulator; bf16 deferred reduction: each device's sum and the total rounded once a
    /// step)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let grads = if self.grad_dtype == DType::BF16 {
            "f32 accumulator; bf16 deferred reduction: each device's sum and the total rounded \
             once a step"
        } else {
            "accumulator, reduction"
        };
        write!(
            f,
            "dtype {} (activations, matmul inputs), weight_dtype {} (master weights, optimizer \
             state), grad_dtype {} ({grads})",
            self.dtype.name(),
            self.weight_dtype.name(),
            self.grad_dtype.name()
        )
    }
}

impl TrainConfig {
    /// The precision keys, checked: each a dtype name, `weight_dtype` neither narrower than
    /// `dtype` nor other than float32, `grad_dtype=bfloat16` not with `layout_invariant=true`.
    ///
    /// # Errors
    /// [`TrainError::NotAChoice`] for a dtype that is not `bfloat16` or `float32`;
    /// [`TrainError::Precision`] for a combination that is not built, naming the key, the value
    /// and why.
    pub fn precision(&self) -> Result<Precision, TrainError> {
        let dtype = built("dtype", self.dtype)?;
        let weight_dtype = built("weight_dtype", self.weight_dtype)?;
        let grad_dtype = built("grad_dtype", self.grad_dtype)?;
        let refuse = |key: &'static str, value: DType, problem: PrecisionProblem| {
            Err(TrainError::Precision {
                key,
                value: value.name().to_string(),
                problem,
            })
        };
        if weight_dtype.mantissa_bits() < dtype.mantissa_bits() {
            return refuse(
                "weight_dtype",
                weight_dtype,
                PrecisionProblem::NarrowerThanDtype {
                    dtype: dtype.name(),
                },
            );
        }
        if weight_dtype != DType::F32 {
            return refuse(
                "weight_dtype",
                weight_dtype,
                PrecisionProblem::MasterWeightsAreFloat32,
            );
        }
        if grad_dtype == DType::BF16 && self.layout_invariant {
            return refuse(
                "grad_dtype",
                grad_dtype,
                PrecisionProblem::NotLayoutInvariant,
            );
        }
        Ok(Precision {
            dtype,
            weight_dtype,
            grad_dtype,
        })
    }

    /// Fixes this process's bf16 matrix-product kernel for a `dtype=bfloat16` run, before any
    /// product runs, and returns what computes bf16 products (for the run header); `None` for a
    /// float32 run, which leaves the choice alone. With `matmul_bf16_fallback=true`, a kernel
    /// without a bf16 product (named by `FERROTEXT_MATMUL`) hands bf16 products to ferrotext's
    /// own kernel; without it, such a kernel is refused.
    ///
    /// # Errors
    /// [`TrainError::Precision`] (`dtype`, [`PrecisionProblem::NoBf16Product`]) naming the
    /// kernel; the precision keys' own errors ([`TrainConfig::precision`]).
    pub fn select_bf16_kernel(&self) -> Result<Option<String>, TrainError> {
        if self.precision()?.dtype != DType::BF16 {
            return Ok(None);
        }
        let chosen = if self.matmul_bf16_fallback {
            ferrotext_tensor::allow_bf16_fallback()
        } else {
            ferrotext_tensor::bf16_matmul_kernel()
        };
        match chosen {
            Ok(kernel) => Ok(Some(kernel)),
            Err(ferrotext_tensor::TensorError::NoBf16Product { kernel }) => {
                Err(TrainError::Precision {
                    key: "dtype",
                    value: DType::BF16.name().to_string(),
                    problem: PrecisionProblem::NoBf16Product { kernel },
                })
            }
            Err(other) => Err(other.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(dtype: &str, weight: &str, grad: &str) -> TrainConfig {
        let parse = |name: &str| DType::parse(name).unwrap();
        TrainConfig {
            dtype: parse(dtype),
            weight_dtype: parse(weight),
            grad_dtype: parse(grad),
            ..TrainConfig::default()
        }
    }

    #[test]
    fn the_built_combinations_pass_and_print_their_roles() {
        let p = with("bfloat16", "float32", "float32").precision().unwrap();
        assert_eq!(p.dtype, DType::BF16);
        assert_eq!(
            p.to_string(),
            "dtype bfloat16 (activations, matmul inputs), weight_dtype float32 (master \
             weights, optimizer state), grad_dtype float32 (accumulator, reduction)"
        );
        let f = with("float32", "float32", "float32").precision().unwrap();
        assert_eq!(f.dtype, DType::F32);
    }

    #[test]
    fn bf16_gradients_are_built_but_not_with_layout_invariant() {
        let p = with("bfloat16", "float32", "bfloat16").precision().unwrap();
        assert_eq!(p.grad_dtype, DType::BF16);
        assert!(p.to_string().ends_with(
            "grad_dtype bfloat16 (f32 accumulator; bf16 deferred reduction: each device's sum and \
             the total rounded once a step)"
        ));
        let invariant = TrainConfig {
            layout_invariant: true,
            ..with("bfloat16", "float32", "bfloat16")
        };
        let err = invariant.precision().unwrap_err();
        assert!(matches!(
            err,
            TrainError::Precision {
                key: "grad_dtype",
                problem: PrecisionProblem::NotLayoutInvariant,
                ..
            }
        ));
        let text = err.to_string();
        assert!(
            text.starts_with("grad_dtype=bfloat16 with layout_invariant=true"),
            "{text}"
        );
        // The mirror: f32 gradients are layout-invariant.
        let f32_grads = TrainConfig {
            layout_invariant: true,
            ..with("bfloat16", "float32", "float32")
        };
        assert!(f32_grads.precision().is_ok());
    }

    #[test]
    fn narrower_master_weights_are_told_apart_from_bf16_master_weights() {
        let narrower = with("float32", "bfloat16", "float32").precision();
        assert!(matches!(
            narrower,
            Err(TrainError::Precision {
                key: "weight_dtype",
                problem: PrecisionProblem::NarrowerThanDtype { dtype: "float32" },
                ..
            })
        ));
        let same = with("bfloat16", "bfloat16", "float32").precision();
        assert!(matches!(
            same,
            Err(TrainError::Precision {
                problem: PrecisionProblem::MasterWeightsAreFloat32,
                ..
            })
        ));
    }
}
