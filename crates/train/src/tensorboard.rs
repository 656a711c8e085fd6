//! TensorBoard event files (`tensorboard=true`): each logged step's scalars, in the format
//! TensorBoard's reader expects, so `tensorboard --logdir RUN_DIR` charts a run as it trains.
//!
//! The format is written here directly: `tensorboard-rs`, the crate for it, was last released
//! in 2022, is marked not active by its author and brings ~14 MB of dependencies. A file is a
//! sequence of records — `u64` length, its masked CRC-32C, the bytes, their masked CRC-32C
//! (little-endian) — each holding one `Event` protobuf: the first a `file_version` event
//! (`brain.Event:2`), then one per step with `wall_time`, `step` and a `Summary` of
//! `simple_value`s.
//!
//! Invariant: every record is flushed to the OS when its step is logged, so a killed run keeps
//! every step it logged (TensorBoard ignores a torn last record).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::engine::StepMetrics;
use crate::error::TrainError;

/// Appends events to one event file.
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// A new event file in `dir` (created if needed), named as TensorBoard looks for them
    /// (`events.out.tfevents.<seconds>.ferrotext.<pid>`), opened with its `file_version` event.
    ///
    /// # Errors
    /// [`TrainError::Io`] when the directory or file cannot be written.
    pub fn create(dir: &Path) -> Result<EventWriter, TrainError> {
        let io = |source| TrainError::Io {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let now = wall_time();
        let name = format!(
            "events.out.tfevents.{}.ferrotext.{}",
            now as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::File::create(&path).map_err(io)?;
        let mut writer = EventWriter { path, file };
        let mut event = Vec::new();
        put_f64(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.write_record(&event)?;
        Ok(writer)
    }

    /// Logs `metrics`' scalars at its step: `loss`, `grad_norm`, `learning_rate`, tokens per
    /// second, and `eval_loss` / `eval_perplexity` / `mtp_loss` when present (non-finite values are skipped).
    ///
    /// # Errors
    /// [`TrainError::Io`] when the write fails.
    pub fn step(&mut self, metrics: &StepMetrics) -> Result<(), TrainError> {
        let tokens_per_second = if metrics.seconds > 0.0 {
            metrics.tokens as f64 / metrics.seconds
        } else {
            f64::NAN
        };
        let mut scalars = vec![
            ("train/loss", metrics.loss),
            ("train/grad_norm", metrics.grad_norm),
            ("train/learning_rate", metrics.learning_rate),
            ("train/tokens_per_second", tokens_per_second),
        ];
        if let Some(v) = metrics.eval_loss {
            scalars.push(("eval/loss", v));
        }
        if let Some(v) = metrics.eval_perplexity {
            scalars.push(("eval/perplexity", v));
        }
        if let Some(v) = metrics.mtp_loss {
            scalars.push(("train/mtp_loss", v));
        }
        let mut summary = Vec::new();
        for (tag, value) in scalars.into_iter().filter(|(_, v)| v.is_finite()) {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_f32(&mut v, 2, value as f32);
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_f64(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, metrics.step as u64);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_record(&mut self, data: &[u8]) -> Result<(), TrainError> {
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        record.extend_from_slice(data);
        record.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.file
            .write_all(&record)
            .and_then(|()| self.file.flush())
            .map_err(|source| TrainError::Io {
                path: self.path.display().to_string(),
                source,
            })
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// CRC-32C (Castagnoli, reflected polynomial `0x82F63B78`), bit by bit: event records are small.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's masked CRC: rotated right by 15 and offset, so a CRC of CRCs stays distinct.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xA282_EAD8)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_varint(out, u64::from(field << 3));
    put_varint(out, v);
}

fn put_f64(out: &mut Vec<u8>, field: u32, v: f64) {
    put_varint(out, u64::from(field << 3 | 1));
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_f32(out: &mut Vec<u8>, field: u32, v: f32) {
    put_varint(out, u64::from(field << 3 | 5));
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, u64::from(field << 3 | 2));
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_published_check_values() {
        // RFC 3720 B.4 and the CRC catalogue's check value for "123456789"
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn varints_and_fields_encode_as_protobuf_does() {
        let mut v = Vec::new();
        put_varint_field(&mut v, 2, 300);
        assert_eq!(v, [0x10, 0xAC, 0x02]);
        let mut s = Vec::new();
        put_bytes(&mut s, 1, b"ab");
        assert_eq!(s, [0x0A, 2, b'a', b'b']);
        let mut f = Vec::new();
        put_f32(&mut f, 2, 1.0);
        assert_eq!(f, [0x15, 0, 0, 0x80, 0x3F]);
    }
}
