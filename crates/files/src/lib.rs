//! Opening the files a run reads — configs, data, tokenizers, parameters, Hugging Face
//! directories, checkpoints, the metrics it continues — so that no input can block the run or
//! read without bound.
//!
//! Invariant: a file is read only after the handle it is read through was found to be a
//! regular file. It is opened without blocking (`O_NONBLOCK`: opening a FIFO for reading would
//! otherwise wait for a writer forever) and checked with `fstat` on that same handle, so a
//! FIFO, a device such as `/dev/zero`, a directory or a socket is refused before a byte is read,
//! and swapping the path between a check and the open changes nothing. On a regular file the
//! flag has no effect.

use std::fs::File;
use std::io::{Error, ErrorKind, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The regular file at `path`, opened for reading.
///
/// # Errors
/// What the system said (missing, no permission), or [`ErrorKind::InvalidInput`] "is not a
/// regular file" for anything else at that path.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "is not a regular file"));
    }
    Ok(file)
}

/// The bytes of the regular file at `path` ([`open_regular`]).
///
/// # Errors
/// As [`open_regular`], and a failed read.
pub fn read_regular(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut file = open_regular(path)?;
    let mut bytes = Vec::with_capacity(file.metadata().map_or(0, |m| m.len() as usize));
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The text of the regular file at `path` ([`open_regular`]).
///
/// # Errors
/// As [`read_regular`], and [`ErrorKind::InvalidData`] for bytes that are not UTF-8.
pub fn read_regular_to_string(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read_regular(path)?)
        .map_err(|_| Error::new(ErrorKind::InvalidData, "is not UTF-8 text"))
}

/// The bytes of the regular file at `path`, as [`read_regular`], with the error as the one line
/// a user sees: the path and the problem (missing, not a regular file, unreadable).
///
/// # Errors
/// That line.
pub fn read_named(path: &Path) -> Result<Vec<u8>, String> {
    let shown = path.display();
    read_regular(path).map_err(|e| match e.kind() {
        ErrorKind::InvalidInput => format!("{shown} {e}"),
        _ => format!("cannot open {shown}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO, a directory and a character device are refused at once (a plain read of the
    /// FIFO would block here forever); a regular file reads whole.
    #[test]
    fn only_regular_files_are_read() {
        let dir = std::env::temp_dir().join(format!("ferrotext-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        for path in [fifo.as_path(), dir.as_path(), Path::new("/dev/zero")] {
            let err = read_regular(path).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{}", path.display());
            assert_eq!(err.to_string(), "is not a regular file");
        }
        let file = dir.join("plain");
        std::fs::write(&file, "text").unwrap();
        assert_eq!(read_regular_to_string(&file).unwrap(), "text");
        assert_eq!(
            read_regular(&dir.join("missing")).unwrap_err().kind(),
            ErrorKind::NotFound
        );
        std::fs::remove_dir_all(dir).ok();
    }
}
