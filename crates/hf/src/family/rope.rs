//! The RoPE keys of a `config.json`, in both generations: transformers 4.x writes a top-level
//! `rope_theta` and a `rope_scaling` object (`type` or `rope_type`); transformers 5 writes one
//! `rope_parameters` object holding `rope_theta` and `rope_type` and the type's own keys.
//!
//! Invariants: every key of the RoPE object is read or refused (a key the type does not define,
//! or a value the decoder does not compute, is recorded as unsupported, named with its value);
//! when a config carries both generations they must agree, else the disagreement is refused.
//! Which types a family may use: `default` for all, and those its file lists (`rope_types`:
//! every GQA family reads transformers' `linear`, `dynamic`, `yarn` and `llama3`, as its rotary
//! embedding does through `ROPE_INIT_FUNCTIONS`).

use ferrotext_tensor::{Llama3, PositionScaling, Yarn};
use serde_json::{Map, Value};

use super::{Family, Keys};

/// The RoPE of a config: θ and at most one frequency scaling.
#[derive(Debug, Default)]
pub(super) struct RopeRead {
    /// θ (`rope_theta`).
    pub theta: Option<f32>,
    /// YaRN (`deepseek_v3`).
    pub yarn: Option<Yarn>,
    /// Llama 3 scaling.
    pub llama3: Option<Llama3>,
    /// `linear` or `dynamic` scaling.
    pub scaling: Option<PositionScaling>,
}

/// The RoPE types of transformers' `ROPE_INIT_FUNCTIONS` that the decoder computes, for the
/// families whose rotary embedding reads them (every GQA family).
pub(super) const GQA_ROPE_TYPES: &[&str] = &["linear", "dynamic", "yarn", "llama3"];

/// The keys each RoPE type defines (besides `rope_type`/`type` and `rope_theta`).
fn type_keys(rope_type: &str) -> &'static [&'static str] {
    match rope_type {
        "linear" | "dynamic" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        ],
        _ => &[],
    }
}

/// The RoPE of the config in `k` for a `family` model, in whichever generation it is written;
/// what the decoder does not compute is recorded in `k.unsupported`.
///
/// # Errors
/// A mistyped or out-of-range value (a θ that is not a positive number, a factor missing).
pub(super) fn read(k: &mut Keys<'_>, family: &Family) -> Result<RopeRead, String> {
    let (object, name) = match rope_object(k)? {
        Some(x) => x,
        None => {
            let theta = Some(k.positive_or("rope_theta", 10_000.0)?);
            return Ok(RopeRead {
                theta,
                ..RopeRead::default()
            });
        }
    };
    let rk = Keys {
        v: &object,
        unsupported: Vec::new(),
    };
    // θ: inside the object (5.x), at the top (4.x), or both when they agree.
    let theta = match (rk.get("rope_theta"), k.get("rope_theta")) {
        (Some(_), Some(top)) if rk.get("rope_theta") != Some(top) => {
            let inner = rk.positive_or("rope_theta", 10_000.0)?;
            let outer = k.positive_or("rope_theta", 10_000.0)?;
            if inner != outer {
                k.unsupported.push(format!(
                    "rope_theta={outer} and {name}.rope_theta={inner} (two different θ)"
                ));
            }
            inner
        }
        (Some(_), _) => rk.positive_or("rope_theta", 10_000.0)?,
        (None, _) => k.positive_or("rope_theta", 10_000.0)?,
    };
    let rope_type = match (rk.get("rope_type"), rk.get("type")) {
        (Some(a), Some(b)) if a != b => {
            k.unsupported
                .push(format!("{name}.rope_type={a} and {name}.type={b} disagree"));
            return Ok(RopeRead::default());
        }
        (Some(t), _) | (None, Some(t)) => t
            .as_str()
            .ok_or_else(|| format!("`{name}.rope_type` = {t} is not a string"))?
            .to_string(),
        (None, None) => "default".to_string(),
    };
    let allowed = rope_type == "default" || family.rope_types.contains(&rope_type.as_str());
    if !allowed {
        let reads = match family.rope_types {
            [] => "default only".to_string(),
            types => format!("default or {}", types.join(" or ")),
        };
        k.unsupported.push(format!(
            "{name}.rope_type=\"{rope_type}\" ({} reads {reads})",
            family.model_type,
        ));
        return Ok(RopeRead::default());
    }
    for (key, value) in object.as_object().into_iter().flatten() {
        let known = ["rope_type", "type", "rope_theta"].contains(&key.as_str())
            || type_keys(&rope_type).contains(&key.as_str());
        if !known && !value.is_null() {
            k.unsupported.push(format!(
                "{name}.{key}={value} (not read for rope_type {rope_type})"
            ));
        }
    }
    let mut out = RopeRead {
        theta: Some(theta),
        ..RopeRead::default()
    };
    match rope_type.as_str() {
        "llama3" => out.llama3 = Some(llama3(&rk)?),
        "yarn" => out.yarn = Some(yarn(k, &rk, name, family.deepseek_yarn)?),
        "linear" => {
            out.scaling = Some(PositionScaling::Linear {
                factor: need_factor(&rk, "linear")?,
            })
        }
        "dynamic" => {
            out.scaling = Some(PositionScaling::Dynamic {
                factor: need_factor(&rk, "dynamic")?,
                max_position: k.usize("max_position_embeddings")?,
            })
        }
        _ => {}
    }
    Ok(out)
}

/// The RoPE object of the config and the key it came from: `rope_parameters` (5.x) or
/// `rope_scaling` (4.x); both only when every key of `rope_scaling` is in `rope_parameters` with
/// the same value (the older key kept beside the newer), else the two are refused.
fn rope_object(k: &mut Keys<'_>) -> Result<Option<(Value, &'static str)>, String> {
    let object = |key: &str, v: &Value| -> Result<Map<String, Value>, String> {
        v.as_object()
            .cloned()
            .ok_or_else(|| format!("`{key}` = {v} is not an object"))
    };
    match (k.get("rope_parameters"), k.get("rope_scaling")) {
        (None, None) => Ok(None),
        (Some(p), None) => Ok(Some((
            Value::Object(object("rope_parameters", p)?),
            "rope_parameters",
        ))),
        (None, Some(s)) => Ok(Some((
            Value::Object(object("rope_scaling", s)?),
            "rope_scaling",
        ))),
        (Some(p), Some(s)) => {
            let (p, s) = (object("rope_parameters", p)?, object("rope_scaling", s)?);
            let agree = s.iter().all(|(key, v)| {
                p.get(key) == Some(v)
                    || (key == "type" && p.get("rope_type") == Some(v))
                    || (key == "rope_type" && p.get("type") == Some(v))
            });
            if !agree {
                k.unsupported.push(format!(
                    "rope_scaling={} and rope_parameters={} disagree",
                    Value::Object(s),
                    Value::Object(p.clone())
                ));
            }
            Ok(Some((Value::Object(p), "rope_parameters")))
        }
    }
}

/// The `factor` a `linear` or `dynamic` RoPE requires, as transformers requires it.
fn need_factor(rk: &Keys<'_>, rope_type: &str) -> Result<f32, String> {
    if rk.get("factor").is_none() {
        return Err(format!("rope_type {rope_type} needs `factor`"));
    }
    rk.positive_or("factor", 1.0)
}

/// Llama 3's scaling: every key required, as transformers requires them.
fn llama3(rk: &Keys<'_>) -> Result<Llama3, String> {
    let need = |key: &str| -> Result<f32, String> {
        if rk.get(key).is_none() {
            return Err(format!("rope_type llama3 needs `{key}`"));
        }
        rk.positive_or(key, 1.0)
    };
    let l = Llama3 {
        factor: need("factor")?,
        low_freq_factor: need("low_freq_factor")?,
        high_freq_factor: need("high_freq_factor")?,
        original_max_position: match rk.get("original_max_position_embeddings") {
            // transformers 4.x fails on a KeyError; 5.x fills in `max_position_embeddings`, which
            // its own check then calls wrong (it must be the smaller): refused, and said where.
            None => return Err("rope_type llama3 needs `original_max_position_embeddings`".into()),
            Some(_) => rk.usize("original_max_position_embeddings")?,
        },
    };
    if l.high_freq_factor <= l.low_freq_factor {
        return Err(format!(
            "rope_type llama3 needs high_freq_factor > low_freq_factor, got {} and {}",
            l.high_freq_factor, l.low_freq_factor
        ));
    }
    Ok(l)
}

/// transformers' `get_mscale(scale, mscale)`: `0.1·mscale·ln(scale) + 1`, 1 for `scale ≤ 1`.
fn get_mscale(scale: f32, mscale: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * ferrotext_tensor::fixed_math::ln(scale) + 1.0
    }
}

/// The `mscale` to write beside `y`'s `mscale_all_dim` so that a reader deriving the rotation's
/// factor from the two (`get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`, as
/// DeepSeek's own code and vLLM do, ignoring `attention_factor`) gets `y.attention_factor`:
/// `mscale_all_dim` itself when the factor is 1 (or the factor `≤ 1`, where neither matters),
/// else the one solution, in f64 and rounded once.
pub(super) fn mscale_for_rotation(y: &Yarn) -> f32 {
    if y.factor <= 1.0 || y.attention_factor == 1.0 {
        return y.mscale;
    }
    let tenth_ln = 0.1 * ferrotext_tensor::fixed_math::ln_f64(f64::from(y.factor));
    let all_dim = f64::from(get_mscale(y.factor, y.mscale));
    ((f64::from(y.attention_factor) * all_dim - 1.0) / tenth_ln) as f32
}

/// YaRN as transformers computes it (`_compute_yarn_parameters`): `sin` and `cos` times
/// `attention_factor`, given or derived (`get_mscale(factor, mscale) / get_mscale(factor,
/// mscale_all_dim)` when both are set and nonzero, else `get_mscale(factor, 1)`); `mscale_all_dim`
/// kept for DeepSeek's attention, whose softmax scale it multiplies by `get_mscale(factor,
/// mscale_all_dim)²` (GQA attention never reads it). Refused: a ramp not truncated to whole dims
/// (`truncate: false`), and for DeepSeek (`deepseek`) a `max_position_embeddings` other than
/// `original_max_position_embeddings × factor` (its 4.x code takes the factor from that ratio,
/// 5 the one written, so no one model is what both compute).
fn yarn(k: &mut Keys<'_>, rk: &Keys<'_>, name: &str, deepseek: bool) -> Result<Yarn, String> {
    let factor = rk.positive_or("factor", 1.0)?;
    let non_negative = |key: &str| -> Result<f32, String> {
        let v = rk.f32_or(key, 0.0)?;
        if v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("`{name}.{key}` must not be negative, got {v}"))
        }
    };
    let (mscale, mscale_all_dim) = (non_negative("mscale")?, non_negative("mscale_all_dim")?);
    let attention_factor = match rk.get("attention_factor") {
        Some(_) => rk.positive_or("attention_factor", 1.0)?,
        None if mscale > 0.0 && mscale_all_dim > 0.0 => {
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        }
        None => get_mscale(factor, 1.0),
    };
    if !rk.bool_or("truncate", true)? {
        k.unsupported.push(format!(
            "{name}.truncate=false (the ramp is computed on whole dims)"
        ));
    }
    let y = Yarn {
        factor,
        // transformers falls back on `max_position_embeddings` when the object has none.
        original_max_position: match rk.get("original_max_position_embeddings") {
            Some(_) => rk.usize("original_max_position_embeddings")?,
            None => k.usize("max_position_embeddings")?,
        },
        beta_fast: rk.positive_or("beta_fast", 32.0)?,
        beta_slow: rk.positive_or("beta_slow", 1.0)?,
        mscale: mscale_all_dim,
        attention_factor,
    };
    // DeepSeek's own 4.x code takes the factor from the positions' ratio; the generic YaRN of
    // both generations reads the factor as written.
    if let Some(max) = k
        .get("max_position_embeddings")
        .and_then(Value::as_f64)
        .filter(|_| deepseek)
    {
        let ratio = max / y.original_max_position as f64;
        if (ratio - f64::from(y.factor)).abs() > 1e-6 * ratio.abs().max(1.0) {
            k.unsupported.push(format!(
                "max_position_embeddings={max} with {name}.factor={} and \
                 original_max_position_embeddings={} (transformers 4.x takes the factor {ratio} \
                 from their ratio, transformers 5 the factor as written: the two compute \
                 different models)",
                y.factor, y.original_max_position
            ));
        }
    }
    Ok(y)
}
