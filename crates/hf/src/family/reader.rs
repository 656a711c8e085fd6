//! The reader every family's `config.json` goes through: [`Keys`] reads a key as the type it
//! must be (a missing or mistyped required key is an error naming it) and collects what the
//! decoder does not compute (`unsupported`), so that everything a config asks and the decoder
//! has not is refused together, in one sentence.

use serde_json::Value;

/// Reads keys of one `config.json`, remembering what it cannot use.
pub(crate) struct Keys<'a> {
    /// The config (with its class's defaults filled in).
    pub v: &'a Value,
    /// What the decoder does not compute, each `key=value (why)`; refused together.
    pub unsupported: Vec<String>,
}

impl<'a> Keys<'a> {
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|x| !x.is_null())
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize, String> {
        self.get(key)
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| format!("`{key}` is missing or not a non-negative integer"))
    }

    /// An integer written under `key` (4.x) or `alias` (5.x); both only when equal.
    pub(crate) fn usize_alias(&mut self, key: &str, alias: &str) -> Result<usize, String> {
        match (self.get(key), self.get(alias)) {
            (Some(_), Some(_)) => {
                let (a, b) = (self.usize(key)?, self.usize(alias)?);
                if a != b {
                    self.unsupported
                        .push(format!("{key}={a} and {alias}={b} (two different counts)"));
                }
                Ok(a)
            }
            (None, Some(_)) => self.usize(alias),
            _ => self.usize(key),
        }
    }

    pub(crate) fn usize_or(&self, key: &str, default: usize) -> Result<usize, String> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize(key),
        }
    }

    /// A finite number (as f32), `default` when absent.
    pub(crate) fn f32_or(&self, key: &str, default: f32) -> Result<f32, String> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => {
                let v = x
                    .as_f64()
                    .map(|x| x as f32)
                    .ok_or_else(|| format!("`{key}` is not a number"))?;
                if v.is_finite() {
                    Ok(v)
                } else {
                    Err(format!("`{key}` = {x} is not a finite 32-bit float"))
                }
            }
        }
    }

    /// A positive finite number, `default` when absent: the scales and rates a model divides by
    /// or raises to a power (a zero or negative one trains on NaN, not an error).
    pub(crate) fn positive_or(&self, key: &str, default: f32) -> Result<f32, String> {
        let v = self.f32_or(key, default)?;
        if v > 0.0 {
            Ok(v)
        } else {
            Err(format!("`{key}` must be a positive number, got {v}"))
        }
    }

    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| format!("`{key}` is not a boolean")),
        }
    }

    /// Records `key=value` as unsupported unless it is absent or the number `allowed` (`0` and
    /// `0.0` alike).
    pub(crate) fn only_number(&mut self, key: &str, allowed: f64) {
        if let Some(x) = self.get(key) {
            if x.as_f64() != Some(allowed) {
                self.unsupported.push(format!("{key}={x}"));
            }
        }
    }

    /// Records `key=value` as unsupported unless it is absent or equal to `allowed`.
    pub(crate) fn only(&mut self, key: &str, allowed: Value) {
        if let Some(x) = self.get(key) {
            if *x != allowed {
                self.unsupported.push(format!("{key}={x}"));
            }
        }
    }
}

/// A float as JSON, written in its shortest round-tripping decimal form (`1e-6`, not
/// `9.99999997e-7`).
pub(crate) fn num(x: f32) -> Value {
    x.to_string()
        .parse::<f64>()
        .map_or(Value::Null, Value::from)
}
