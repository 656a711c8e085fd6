//! The cluster a prediction is for, as `plan --cluster` gives it: hosts, devices per host, the
//! host link and the link inside a host (bandwidth, latency), whether devices share their host's
//! link, and the memory bandwidth the optimizer streams at. Parsing refuses any key or unit it
//! does not know, naming it.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// `intra` when `--cluster` does not give it: 200 Gbit/s, 1 µs (an NVLink-class link between
/// devices of one host).
pub const DEFAULT_INTRA: Link = Link {
    bytes_per_second: 200e9 / 8.0,
    latency_seconds: 1e-6,
};

/// Memory bandwidth of a device when `--cluster` does not give `mem`: 20 GB/s (a CPU device's
/// share of a host's memory bandwidth, about this machine's single-thread memcpy).
pub const DEFAULT_MEMORY_BYTES_PER_SECOND: f64 = 20e9;

/// One level's link: bandwidth and latency (α–β). Both are finite; the bandwidth is positive and
/// the latency is not negative.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Link {
    /// β, bytes per second.
    pub bytes_per_second: f64,
    /// α, seconds per message.
    pub latency_seconds: f64,
}

/// Who shares a host's `link`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkShare {
    /// One link per host, shared by its devices (the emulated cluster; `link_per=host`).
    Host,
    /// One link per device (a NIC per GPU; `link_per=device`).
    Device,
}

/// The cluster of a prediction, parsed from `hosts=H,devices_per_host=L,link=25gbit,10us[,
/// intra=200gbit,1us][,mem=20GB/s][,link_per=host|device]`. A parsed spec always has `hosts ≥ 1`,
/// `devices_per_host ≥ 1`, positive finite rates and a `link` when `hosts > 1`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterSpec {
    /// Hosts (processes of the job).
    pub hosts: usize,
    /// Devices of each host.
    pub devices_per_host: usize,
    /// The link between hosts (`None` only for one host).
    pub link: Option<Link>,
    /// The link between devices of one host.
    pub intra: Link,
    /// Whether `link` is per host or per device.
    pub link_per: LinkShare,
    /// A device's memory bandwidth, bytes per second (prices the optimizer).
    pub memory_bytes_per_second: f64,
}

/// Why a `--cluster` string does not parse; each names the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterSpecError {
    /// A key the cluster spec does not have.
    #[error("--cluster: unknown key `{key}` (known: hosts, devices_per_host, link, intra, mem, link_per)")]
    UnknownKey {
        /// The key as given.
        key: String,
    },
    /// A required key is missing.
    #[error("--cluster: missing `{key}`{why}")]
    MissingKey {
        /// The key.
        key: String,
        /// Why it is needed (may be empty).
        why: String,
    },
    /// A key given twice.
    #[error("--cluster: `{key}` given twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },
    /// A value that does not parse or is out of range.
    #[error("--cluster: {key}=`{value}`: {reason}")]
    BadValue {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What is wrong.
        reason: String,
    },
    /// A part that is not `key=value` and does not continue a link value.
    #[error("--cluster: `{part}` is not key=value")]
    Syntax {
        /// The part as given.
        part: String,
    },
}

const KEYS: [&str; 6] = [
    "hosts",
    "devices_per_host",
    "link",
    "intra",
    "mem",
    "link_per",
];

impl FromStr for ClusterSpec {
    type Err = ClusterSpecError;

    /// Parses `key=value` parts separated by commas; a `link` or `intra` value is a rate with an
    /// optional latency after a comma (`25gbit,10us`). Rates: `bit`, `kbit`, `mbit`, `gbit`,
    /// `tbit` (decimal, any case) or `B/s`, `kB/s`, `MB/s`, `GB/s`, `TB/s`, `KiB/s`, `MiB/s`,
    /// `GiB/s`; latencies: `ns`, `us`, `µs`, `ms`, `s` (a bare `0` too; absent: 0).
    fn from_str(text: &str) -> Result<ClusterSpec, ClusterSpecError> {
        let mut given: Vec<(String, String)> = Vec::new();
        for part in text.split(',').map(str::trim) {
            match part.split_once('=') {
                Some((key, value)) => {
                    let key = key.trim();
                    if !KEYS.contains(&key) {
                        return Err(ClusterSpecError::UnknownKey { key: key.into() });
                    }
                    if given.iter().any(|(k, _)| k == key) {
                        return Err(ClusterSpecError::DuplicateKey { key: key.into() });
                    }
                    given.push((key.into(), value.trim().into()));
                }
                None => match given.last_mut() {
                    // `link=25gbit,10us`: the latency continues the previous link value.
                    Some((key, value))
                        if (key == "link" || key == "intra")
                            && !value.contains(',')
                            && !part.is_empty() =>
                    {
                        value.push(',');
                        value.push_str(part);
                    }
                    _ => return Err(ClusterSpecError::Syntax { part: part.into() }),
                },
            }
        }
        let get = |key: &str| {
            given
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let count = |key: &str| -> Result<usize, ClusterSpecError> {
            let value = get(key).ok_or_else(|| ClusterSpecError::MissingKey {
                key: key.into(),
                why: String::new(),
            })?;
            match value.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(bad(key, value, "must be a whole number ≥ 1")),
            }
        };
        let hosts = count("hosts")?;
        let devices_per_host = count("devices_per_host")?;
        let link = get("link").map(|v| parse_link("link", v)).transpose()?;
        if hosts > 1 && link.is_none() {
            return Err(ClusterSpecError::MissingKey {
                key: "link".into(),
                why: format!(" (hosts = {hosts}: the link between hosts, e.g. link=25gbit,10us)"),
            });
        }
        let intra = match get("intra") {
            Some(v) => parse_link("intra", v)?,
            None => DEFAULT_INTRA,
        };
        let memory_bytes_per_second = match get("mem") {
            Some(v) => parse_rate("mem", v)?,
            None => DEFAULT_MEMORY_BYTES_PER_SECOND,
        };
        let link_per = match get("link_per") {
            None | Some("host") => LinkShare::Host,
            Some("device") => LinkShare::Device,
            Some(other) => return Err(bad("link_per", other, "must be `host` or `device`")),
        };
        Ok(ClusterSpec {
            hosts,
            devices_per_host,
            link,
            intra,
            link_per,
            memory_bytes_per_second,
        })
    }
}

fn bad(key: &str, value: &str, reason: &str) -> ClusterSpecError {
    ClusterSpecError::BadValue {
        key: key.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

/// `25gbit,10us` → a [`Link`].
fn parse_link(key: &str, value: &str) -> Result<Link, ClusterSpecError> {
    let (rate, latency) = match value.split_once(',') {
        Some((r, l)) => (r.trim(), Some(l.trim())),
        None => (value.trim(), None),
    };
    let bytes_per_second = parse_rate(key, rate)?;
    let latency_seconds = match latency {
        Some(l) => parse_latency(key, l)?,
        None => 0.0,
    };
    Ok(Link {
        bytes_per_second,
        latency_seconds,
    })
}

/// Splits `25gbit` into (25, "gbit").
fn number_and_unit(text: &str) -> (&str, &str) {
    let end = text
        .find(|c: char| {
            !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+')
        })
        .unwrap_or(text.len());
    // An exponent sign only counts after an `e`; `1e9bit` parses, `gbit` alone does not.
    (&text[..end], &text[end..])
}

/// A rate in bytes per second; finite and positive.
fn parse_rate(key: &str, text: &str) -> Result<f64, ClusterSpecError> {
    let (number, unit) = number_and_unit(text);
    let value: f64 = number.parse().map_err(|_| {
        bad(
            key,
            text,
            "the rate must be a number with a unit, e.g. 25gbit or 12.5GB/s",
        )
    })?;
    let bits = match unit.to_ascii_lowercase().as_str() {
        "bit" => Some(1.0),
        "kbit" => Some(1e3),
        "mbit" => Some(1e6),
        "gbit" => Some(1e9),
        "tbit" => Some(1e12),
        _ => None,
    };
    let scale = match (bits, unit) {
        (Some(b), _) => b / 8.0,
        (None, "B/s") => 1.0,
        (None, "kB/s" | "KB/s") => 1e3,
        (None, "MB/s") => 1e6,
        (None, "GB/s") => 1e9,
        (None, "TB/s") => 1e12,
        (None, "KiB/s") => 1024.0,
        (None, "MiB/s") => 1024.0 * 1024.0,
        (None, "GiB/s") => 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(bad(
                key,
                text,
                "unknown rate unit (bit, kbit, mbit, gbit, tbit; B/s, kB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s)",
            ))
        }
    };
    let rate = value * scale;
    if !(rate.is_finite() && rate > 0.0) {
        return Err(bad(key, text, "the rate must be positive and finite"));
    }
    Ok(rate)
}

/// A latency in seconds; finite and not negative.
fn parse_latency(key: &str, text: &str) -> Result<f64, ClusterSpecError> {
    let (number, unit) = number_and_unit(text);
    let value: f64 = number.parse().map_err(|_| {
        bad(
            key,
            text,
            "the latency must be a number with a unit, e.g. 10us",
        )
    })?;
    let per_second = match unit {
        "ns" => 1e9,
        "us" | "µs" => 1e6,
        "ms" => 1e3,
        "s" => 1.0,
        "" if value == 0.0 => 1.0,
        _ => return Err(bad(key, text, "unknown latency unit (ns, us, ms, s)")),
    };
    let latency = value / per_second;
    if !(latency.is_finite() && latency >= 0.0) {
        return Err(bad(
            key,
            text,
            "the latency must be finite and not negative",
        ));
    }
    Ok(latency)
}

impl ClusterSpec {
    /// Devices of the cluster: `hosts × devices_per_host`.
    pub fn devices(&self) -> usize {
        self.hosts.saturating_mul(self.devices_per_host)
    }

    /// The bandwidth one device's cross-host stage sees: the link's, divided by the host's
    /// devices when they share it ([`LinkShare::Host`]).
    pub(crate) fn cross_link(&self) -> Link {
        let link = self.link.unwrap_or(self.intra);
        let share = match self.link_per {
            LinkShare::Host => self.devices_per_host as f64,
            LinkShare::Device => 1.0,
        };
        Link {
            bytes_per_second: link.bytes_per_second / share,
            latency_seconds: link.latency_seconds,
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.3} Gbit/s, {:.1} µs",
            self.bytes_per_second * 8.0 / 1e9,
            self.latency_seconds * 1e6
        )
    }
}
