//! The conformance runner: type-rule cases generated from JAX (with ferrotext's deviations),
//! one JSON object per line (format: `docs/conformance-format.md`), evaluated in abstract mode —
//! forward type, and the cotangent types after a backward pass seeded with the output's
//! cotangent type.

use std::sync::Arc;

use ferrotext_comm::{Communicator, NoTransport};
use ferrotext_sharding::{AxisType, DType, DimSpec, Mesh, PartitionSpec};
use ferrotext_tensor::DotDims;
use serde::Deserialize;
use serde_json::Value;

use crate::array::Array;
use crate::ctx::Ctx;

use crate::error::SpmdError;
use crate::rules::{self, BinaryOp, UnaryOp};

/// A spec as written in a case: partitions (`null`, a name, or a list of names), unreduced and
/// reduced axes.
#[derive(Clone, Debug, Deserialize)]
pub struct CaseSpec {
    p: Vec<Value>,
    #[serde(default)]
    u: Vec<String>,
    #[serde(default)]
    r: Vec<String>,
}

/// One operand.
#[derive(Clone, Debug, Deserialize)]
pub struct CaseArg {
    shape: Vec<usize>,
    dtype: String,
    spec: CaseSpec,
}

/// One case (see `docs/conformance-format.md`).
#[derive(Clone, Debug, Deserialize)]
pub struct Case {
    /// Unique id.
    pub id: String,
    /// The rule exercised.
    #[serde(default)]
    pub rule: String,
    mesh: Vec<(String, usize, String)>,
    op: String,
    args: Vec<CaseArg>,
    #[serde(default)]
    params: Value,
    expect: Value,
    #[serde(default)]
    grad: Option<Value>,
}

/// What a case evaluated to: a printed type or an error kind, per operand for the backward pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The printed output type(s).
    Types(Vec<String>),
    /// A type error of this kind (FORMAT.md name), with its message.
    Error(String, String),
}

/// Totals of a run.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Cases that matched.
    pub passed: usize,
    /// `(case id, what differed)` for each case that did not.
    pub failures: Vec<(String, String)>,
}

/// A case line that cannot be read.
fn bad(reason: impl Into<String>) -> SpmdError {
    SpmdError::BadCase {
        reason: reason.into(),
    }
}

fn to_spec(spec: &CaseSpec) -> Result<Result<PartitionSpec, SpmdError>, SpmdError> {
    let mut dims = Vec::new();
    for p in &spec.p {
        dims.push(match p {
            Value::Null => DimSpec::Replicated,
            Value::String(s) => DimSpec::axis(s.clone()),
            Value::Array(items) => DimSpec::axes(
                items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| bad("axis name"))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            other => return Err(bad(format!("bad partition {other}"))),
        });
    }
    Ok(PartitionSpec::tagged(dims, spec.u.clone(), spec.r.clone()).map_err(SpmdError::from))
}

fn mesh_of(case: &Case) -> Result<Arc<Mesh>, SpmdError> {
    let axes = case
        .mesh
        .iter()
        .map(|(n, s, t)| {
            let ty = match t.as_str() {
                "explicit" => AxisType::Explicit,
                "auto" => AxisType::Auto,
                "manual" => AxisType::Manual,
                other => return Err(bad(format!("axis type {other}"))),
            };
            Ok((n.clone(), *s, ty))
        })
        .collect::<Result<Vec<_>, SpmdError>>()?;
    Ok(Arc::new(Mesh::new(axes)?))
}

fn dims_param(params: &Value, key: &str) -> Result<Vec<usize>, SpmdError> {
    params
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| bad(format!("missing `{key}`")))?
        .iter()
        .map(|v| {
            v.as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("bad `{key}`")))
        })
        .collect()
}

fn out_sharding(params: &Value) -> Result<Option<Result<PartitionSpec, SpmdError>>, SpmdError> {
    match params.get("out_sharding") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let spec: CaseSpec =
                serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))?;
            Ok(Some(to_spec(&spec)?))
        }
    }
}

/// Applies the case's op to `xs` on `cx`.
fn apply(cx: &mut Ctx<'_>, case: &Case, xs: &[Array]) -> Result<Array, SpmdError> {
    let arg = |i: usize| xs.get(i).ok_or_else(|| bad("missing operand"));
    let p = &case.params;
    let out = out_sharding(p)?.transpose()?;
    let out = out.as_ref();
    match case.op.as_str() {
        "spec" => Ok(arg(0)?.clone()),
        "neg" => cx.unary(UnaryOp::Neg, arg(0)?),
        "exp" => cx.unary(UnaryOp::Exp, arg(0)?),
        "sin" => cx.unary(UnaryOp::Sin, arg(0)?),
        "tanh" => cx.unary(UnaryOp::Tanh, arg(0)?),
        "add" => cx.binary(BinaryOp::Add, arg(0)?, arg(1)?),
        "sub" => cx.binary(BinaryOp::Sub, arg(0)?, arg(1)?),
        "mul" => cx.binary(BinaryOp::Mul, arg(0)?, arg(1)?),
        "div" => cx.binary(BinaryOp::Div, arg(0)?, arg(1)?),
        "dot_general" => {
            let dims = DotDims {
                lhs_contracting: dims_param(p, "lhs_contracting")?,
                rhs_contracting: dims_param(p, "rhs_contracting")?,
                lhs_batch: dims_param(p, "lhs_batch")?,
                rhs_batch: dims_param(p, "rhs_batch")?,
            };
            cx.dot_general(arg(0)?, arg(1)?, &dims, out)
        }
        "reduce_sum" => cx.reduce_sum(arg(0)?, &dims_param(p, "axes")?, out),
        "broadcast_in_dim" => cx.broadcast_in_dim(
            arg(0)?,
            &dims_param(p, "shape")?,
            &dims_param(p, "broadcast_dimensions")?,
            out,
        ),
        "reshape" => cx.reshape(arg(0)?, &dims_param(p, "new_sizes")?, out),
        "transpose" => cx.transpose(arg(0)?, &dims_param(p, "permutation")?),
        "reshard" => {
            let target = out.ok_or_else(|| bad("reshard needs out_sharding"))?;
            cx.reshard(arg(0)?, target)
        }
        other => Err(bad(format!("unknown op `{other}`"))),
    }
}

fn outcome_of(result: Result<Vec<String>, SpmdError>) -> Result<Outcome, SpmdError> {
    match result {
        Ok(types) => Ok(Outcome::Types(types)),
        Err(SpmdError::Type(e)) => Ok(Outcome::Error(e.kind.name().to_string(), e.to_string())),
        Err(other) => Err(other),
    }
}

/// Evaluates one case: the forward outcome and, when the case asks, the backward outcome.
///
/// # Errors
/// A malformed case (not a type error: those are outcomes).
pub fn evaluate(case: &Case) -> Result<(Outcome, Option<Outcome>), SpmdError> {
    let mesh = mesh_of(case)?;
    let mut comm = Communicator::new(0, mesh.clone(), Box::new(NoTransport));
    let mut cx = Ctx::new_abstract(&mut comm);
    let mut args = Vec::new();
    for a in &case.args {
        let dtype =
            DType::from_short_name(&a.dtype).ok_or_else(|| bad(format!("dtype {}", a.dtype)))?;
        let ty = to_spec(&a.spec)?
            .and_then(|spec| Ok(rules::array_type(&mesh, dtype, a.shape.clone(), spec)?));
        match ty {
            Ok(ty) => args.push(cx.abstract_array(ty)),
            Err(e) => return Ok((outcome_of(Err(e))?, None)),
        }
    }
    let forward = outcome_of(apply(&mut cx, case, &args).map(|out| vec![out.ty().to_string()]))?;
    let backward = match (&case.grad, &forward) {
        (Some(_), Outcome::Types(_)) => Some(outcome_of(
            cx.vjp(
                &args,
                |cx, xs| apply(cx, case, xs),
                |cx, out| Ok(cx.abstract_array(out.ty().to_cotangent())),
            )
            .map(|(_, grads)| grads.iter().map(|g| g.ty().to_string()).collect()),
        )?),
        _ => None,
    };
    Ok((forward, backward))
}

fn expected(v: &Value) -> Result<Outcome, SpmdError> {
    if let Some(t) = v.get("type").and_then(Value::as_str) {
        return Ok(Outcome::Types(vec![t.to_string()]));
    }
    if let Some(types) = v.get("expect").and_then(Value::as_array) {
        return Ok(Outcome::Types(
            types
                .iter()
                .map(|t| t.as_str().unwrap_or("null").to_string())
                .collect(),
        ));
    }
    if let Some(k) = v.get("error").and_then(Value::as_str) {
        return Ok(Outcome::Error(k.to_string(), String::new()));
    }
    Err(bad(format!("cannot read expectation {v}")))
}

fn matches(want: &Outcome, got: &Outcome) -> bool {
    match (want, got) {
        (Outcome::Types(w), Outcome::Types(g)) => w == g,
        (Outcome::Error(w, _), Outcome::Error(g, _)) => w == g,
        _ => false,
    }
}

fn describe(o: &Outcome) -> String {
    match o {
        Outcome::Types(t) => t.join(", "),
        Outcome::Error(k, m) if m.is_empty() => format!("error {k}"),
        Outcome::Error(k, m) => format!("error {k} ({m})"),
    }
}

/// Runs one case; `Err` says what differed.
pub fn check(case: &Case) -> Result<(), String> {
    let (forward, backward) = evaluate(case).map_err(|e| format!("cannot evaluate: {e}"))?;
    let want = expected(&case.expect).map_err(|e| e.to_string())?;
    if !matches(&want, &forward) {
        return Err(format!(
            "forward: want {}, got {}",
            describe(&want),
            describe(&forward)
        ));
    }
    if let (Some(g), Some(got)) = (&case.grad, &backward) {
        let want = expected(g).map_err(|e| e.to_string())?;
        if !matches(&want, got) {
            return Err(format!(
                "grad: want {}, got {}",
                describe(&want),
                describe(got)
            ));
        }
    }
    Ok(())
}

/// Runs every case of a JSONL text.
///
/// # Errors
/// A line that is not a case.
pub fn run_jsonl(text: &str) -> Result<Summary, SpmdError> {
    let mut summary = Summary::default();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let case: Case =
            serde_json::from_str(line).map_err(|e| bad(format!("line {}: {e}", i + 1)))?;
        match check(&case) {
            Ok(()) => summary.passed += 1,
            Err(why) => summary.failures.push((case.id.clone(), why)),
        }
    }
    Ok(summary)
}
