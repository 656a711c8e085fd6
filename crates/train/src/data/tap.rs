//! A test hook of `fault-injection` builds: with `FERROTEXT_DATA_TAP=FILE` in the environment,
//! every sequence a source built by [`super::source_for`] hands out is appended to `FILE` as a
//! line `index: id id id ...`, so a test can compare the tokens two runs read (a resumed run
//! against an uninterrupted one), not just their losses. Devices that each compute the global
//! batch write the same line more than once; readers compare the set of lines.

use std::io::Write;
use std::sync::Mutex;

use super::TokenSource;
use crate::error::TrainError;

/// `source`, recording to `FERROTEXT_DATA_TAP` when it is set.
pub(super) fn wrap(source: Box<dyn TokenSource>) -> Result<Box<dyn TokenSource>, TrainError> {
    let Some(path) = std::env::var_os("FERROTEXT_DATA_TAP") else {
        return Ok(source);
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|source| TrainError::Io {
            path: path.to_string_lossy().into_owned(),
            source,
        })?;
    Ok(Box::new(Tapped {
        inner: source,
        file: Mutex::new(file),
    }))
}

/// A source whose sequences are also written to a file.
struct Tapped {
    inner: Box<dyn TokenSource>,
    file: Mutex<std::fs::File>,
}

impl TokenSource for Tapped {
    fn sequence(&self, index: u64, len: usize) -> Vec<u32> {
        let ids = self.inner.sequence(index, len);
        let line: Vec<String> = ids.iter().map(u32::to_string).collect();
        if let Ok(mut f) = self.file.lock() {
            // A test hook: a failed write shows as a missing line in the test's comparison.
            let _ = writeln!(f, "{index}: {}", line.join(" "));
        }
        ids
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn contiguous_micro_batches(&self) -> bool {
        self.inner.contiguous_micro_batches()
    }
    fn epoch(&self, index: u64, len: usize) -> Option<u64> {
        self.inner.epoch(index, len)
    }
    fn eos(&self) -> Option<u32> {
        self.inner.eos()
    }
}
