//! `tensorboard=true`: the event file holds, record by record with valid masked CRCs, a
//! `file_version` event and then one event per logged step whose scalars are the metrics'
//! values (decoded here with a protobuf reader written for the test); without the key there is
//! no event file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

mod common;

use common::small_config;
use ferrotext_train::tensorboard::masked_crc32c;
use ferrotext_train::{train, RunOptions};

fn run(dir: &Path, tensorboard: bool) -> Vec<ferrotext_train::StepMetrics> {
    let extra = [
        "steps=4".to_string(),
        "eval_interval=2".into(),
        "eval_steps=1".into(),
        "run_name=tb".into(),
        format!("base_output_directory={}", dir.display()),
        format!("tensorboard={tensorboard}"),
    ];
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let report = train(
        &small_config(&extra),
        &RunOptions {
            metrics_path: Some(dir.join("tb").join("metrics.jsonl")),
            ..Default::default()
        },
    )
    .unwrap();
    report.metrics
}

/// The records of a TFRecord file, each CRC checked.
fn records(bytes: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(
            crc,
            masked_crc32c(len_bytes),
            "length CRC of record {}",
            out.len()
        );
        let data = &bytes[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(crc, masked_crc32c(data), "data CRC of record {}", out.len());
        out.push(data);
        at += 16 + len;
    }
    out
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    loop {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7F) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// A protobuf message's fields: `(field, wire type, payload)` (varints as their value's bytes).
fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let key = varint(b, &mut at);
        let (field, wire) = (key >> 3, key & 7);
        let payload = match wire {
            0 => varint(b, &mut at).to_le_bytes().to_vec(),
            1 => {
                at += 8;
                b[at - 8..at].to_vec()
            }
            2 => {
                let n = varint(b, &mut at) as usize;
                at += n;
                b[at - n..at].to_vec()
            }
            5 => {
                at += 4;
                b[at - 4..at].to_vec()
            }
            w => panic!("wire type {w}"),
        };
        out.push((field, wire, payload));
    }
    out
}

/// `(step, tag → value)` of a step event.
fn step_event(event: &[u8]) -> (u64, BTreeMap<String, f32>) {
    let mut step = None;
    let mut scalars = BTreeMap::new();
    for (field, _, payload) in fields(event) {
        match field {
            2 => step = Some(u64::from_le_bytes(payload.try_into().unwrap())),
            5 => {
                for (_, _, value) in fields(&payload) {
                    let f = fields(&value);
                    let tag = String::from_utf8(f[0].2.clone()).unwrap();
                    let v = f32::from_le_bytes(f[1].2.clone().try_into().unwrap());
                    scalars.insert(tag, v);
                }
            }
            _ => {}
        }
    }
    (step.expect("a step"), scalars)
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(dir.join("tb").join("tensorboard")) {
        Ok(entries) => entries.map(|e| e.unwrap().path()).collect(),
        Err(_) => Vec::new(),
    }
}

#[test]
fn event_files_hold_every_logged_step_and_only_when_asked() {
    let dir = std::env::temp_dir().join(format!("ferrotext-tb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let metrics = run(&dir, true);
    let files = event_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let bytes = std::fs::read(&files[0]).unwrap();
    let recs = records(&bytes);
    assert_eq!(recs.len(), 1 + metrics.len());
    let version = fields(recs[0]);
    assert!(version
        .iter()
        .any(|(f, _, p)| *f == 3 && p == b"brain.Event:2"));
    for (m, rec) in metrics.iter().zip(&recs[1..]) {
        let (step, scalars) = step_event(rec);
        assert_eq!(step, m.step as u64);
        assert_eq!(scalars["train/loss"], m.loss as f32);
        assert_eq!(scalars["train/grad_norm"], m.grad_norm as f32);
        assert_eq!(scalars["train/learning_rate"], m.learning_rate as f32);
        assert_eq!(
            scalars.get("eval/loss").copied(),
            m.eval_loss.map(|v| v as f32)
        );
    }
    assert!(metrics.iter().filter(|m| m.eval_loss.is_some()).count() >= 2);

    let off = dir.join("off");
    run(&off, false);
    assert!(
        event_files(&off).is_empty(),
        "no event file without tensorboard=true"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
