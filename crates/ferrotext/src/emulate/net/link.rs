//! A host link's shape, `RATE[,DELAY]` (`1gbit,100us`), as `tc` takes it.

use std::fmt;
use std::time::Duration;

use anyhow::Result;

use crate::common::UsageError;

/// A link: egress rate and optional one-way delay (`1gbit`, `10gbit,100us`).
#[derive(Clone, Debug, PartialEq)]
pub struct LinkSpec {
    /// Bits per second.
    pub rate_bps: u64,
    /// One-way delay added to every packet a host sends.
    pub delay: Option<Duration>,
    text: String,
}

impl fmt::Display for LinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

fn split_number(s: &str) -> Option<(f64, &str)> {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let value: f64 = s[..end].parse().ok()?;
    (value.is_finite() && value > 0.0).then_some((value, &s[end..]))
}

impl LinkSpec {
    /// Parses `RATE[,DELAY]`: RATE a number with `bit`, `kbit`, `mbit`, `gbit` or `tbit`
    /// (`tc`'s units, decimal), DELAY a number with `us`, `ms` or `s`.
    ///
    /// # Errors
    /// A [`UsageError`] naming what does not parse.
    pub fn parse(text: &str) -> Result<LinkSpec> {
        let bad = |why: &str| -> anyhow::Error {
            UsageError(format!(
                "--link {text:?}: {why} (expected RATE[,DELAY], e.g. 1gbit or 10gbit,100us)"
            ))
            .into()
        };
        let text = text.trim();
        let (rate, delay) = match text.split_once(',') {
            Some((r, d)) => (r.trim(), Some(d.trim())),
            None => (text, None),
        };
        let (value, unit) = split_number(rate).ok_or_else(|| bad("the rate is not a number"))?;
        let scale = match unit.to_ascii_lowercase().as_str() {
            "bit" => 1.0,
            "kbit" => 1e3,
            "mbit" => 1e6,
            "gbit" => 1e9,
            "tbit" => 1e12,
            _ => return Err(bad("the rate's unit is not bit, kbit, mbit, gbit or tbit")),
        };
        let rate_bps = (value * scale).round();
        if !(8_000.0..=1e13).contains(&rate_bps) {
            return Err(bad("the rate must be between 8kbit and 10tbit"));
        }
        let delay = match delay {
            None => None,
            Some(d) => {
                let (value, unit) =
                    split_number(d).ok_or_else(|| bad("the delay is not a number"))?;
                let seconds = match unit.to_ascii_lowercase().as_str() {
                    "us" => value * 1e-6,
                    "ms" => value * 1e-3,
                    "s" => value,
                    _ => return Err(bad("the delay's unit is not us, ms or s")),
                };
                if seconds > 10.0 {
                    return Err(bad("the delay must be at most 10s"));
                }
                Some(Duration::from_secs_f64(seconds))
            }
        };
        Ok(LinkSpec {
            rate_bps: rate_bps as u64,
            delay,
            text: text.to_string(),
        })
    }
}
