//! The MPI calls of the message engine, one MPI call each: post a send, post a fixed-size
//! receive, probe for a message, receive a matched message, test requests, and MPI's text for
//! an error code. Each turns MPI's error code into its text (`Err(String)`); the caller decides
//! which `CommError` it becomes.
//!
//! # Invariants
//! * **Who posts**: the caller, on its own thread; these functions keep no state. Every request
//!   they return must be tested to completion by the same caller, or abandoned with its buffer
//!   leaked (the `unsafe` functions' contracts).
//! * **Who matches**: [`probe`] matches at most one message of one (process, tag) and hands back
//!   the only handle that can receive it ([`receive_matched`]); sizes are always counted in
//!   bytes.
//! * Nothing here waits: every call returns at once (`MPI_Isend`, `MPI_Irecv`, `MPI_Improbe`,
//!   `MPI_Imrecv`, `MPI_Test*`). Timeouts belong to the engine's `Waiter`.

use std::os::raw::{c_char, c_int, c_void};

use ::mpi::ffi;

use super::transport::RawComm;
/// Where a message goes to or comes from: a communicator, a process's rank in it and a tag.
#[derive(Clone, Copy)]
pub(crate) struct Address {
    /// The communicator.
    pub(crate) comm: RawComm,
    /// The peer process's rank.
    pub(crate) process: c_int,
    /// The tag.
    pub(crate) tag: c_int,
}

/// The MPI datatype a buffer of words travels as.
#[derive(Clone, Copy)]
pub(crate) enum Unit {
    /// Bytes (`MPI_UINT8_T`, eight to a word): every collective's message.
    Bytes,
    /// Whole words (`MPI_UINT64_T`): the start-up agreement's pairs.
    Words,
}

impl Unit {
    /// The datatype and element count of `words` words, or why MPI cannot count them.
    fn count(self, words: usize) -> Result<(ffi::MPI_Datatype, c_int), String> {
        let bytes = words * 8;
        let (datatype, elements) = match self {
            // SAFETY: `RSMPI_UINT8_T` is an immutable MPI constant.
            Unit::Bytes => (unsafe { ffi::RSMPI_UINT8_T }, bytes),
            // SAFETY: `RSMPI_UINT64_T` is an immutable MPI constant.
            Unit::Words => (unsafe { ffi::RSMPI_UINT64_T }, words),
        };
        let count = c_int::try_from(elements)
            .map_err(|_| format!("a message of {bytes} bytes exceeds MPI's int count"))?;
        Ok((datatype, count))
    }
}

/// A null request (complete from the start).
pub(crate) fn null_request() -> ffi::MPI_Request {
    // SAFETY: `RSMPI_REQUEST_NULL` is an immutable MPI constant.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// An all-zero status, a valid value to be overwritten by MPI.
pub(crate) fn zero_status() -> ffi::MPI_Status {
    // SAFETY: an `MPI_Status` is a plain C struct of integers; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Posts a send of the `words` words at `data` to `to` (`MPI_Isend`).
///
/// # Safety
/// `data` must point to `words` readable words that stay alive and unwritten until the returned
/// request completes (or are leaked, never freed, if the caller stops waiting before).
pub(crate) unsafe fn post_send(
    data: *const u64,
    words: usize,
    unit: Unit,
    to: Address,
) -> Result<ffi::MPI_Request, String> {
    let (datatype, count) = unit.count(words)?;
    let mut request = null_request();
    // SAFETY: the caller keeps the buffer alive and unwritten until the request completes; MPI
    // only reads it; the communicator handle is live (see `RawComm`).
    let rc = unsafe {
        ffi::MPI_Isend(
            data.cast::<c_void>(),
            count,
            datatype,
            to.process,
            to.tag,
            to.comm.0,
            &mut request,
        )
    };
    check(rc)?;
    Ok(request)
}

/// Posts a receive of `words` words from `from` into `data` (`MPI_Irecv`), for messages whose
/// size is fixed by the protocol (the start-up agreement's pairs).
///
/// # Safety
/// `data` must point to `words` writable words that nothing else touches until the returned
/// request completes (or are leaked, never freed, if the caller stops waiting before).
pub(crate) unsafe fn post_receive(
    data: *mut u64,
    words: usize,
    unit: Unit,
    from: Address,
) -> Result<ffi::MPI_Request, String> {
    let (datatype, count) = unit.count(words)?;
    let mut request = null_request();
    // SAFETY: the caller keeps the buffer alive and untouched until the request completes; the
    // communicator handle is live (see `RawComm`).
    let rc = unsafe {
        ffi::MPI_Irecv(
            data.cast::<c_void>(),
            count,
            datatype,
            from.process,
            from.tag,
            from.comm.0,
            &mut request,
        )
    };
    check(rc)?;
    Ok(request)
}

/// A message that has arrived and been matched by [`probe`]: only [`receive_matched`] can take
/// it.
pub(crate) struct Matched {
    message: ffi::MPI_Message,
    count: c_int,
    /// Its size in bytes.
    pub(crate) size: usize,
}

/// Matches the next message from `from` if one has arrived (`MPI_Improbe`, then `MPI_Get_count`
/// in bytes).
pub(crate) fn probe(from: Address) -> Result<Option<Matched>, String> {
    let mut found: c_int = 0;
    // SAFETY: `RSMPI_MESSAGE_NULL` is an immutable MPI constant.
    let mut message = unsafe { ffi::RSMPI_MESSAGE_NULL };
    let mut status = zero_status();
    // SAFETY: the out-pointers point to live locals; the communicator handle is live (see
    // `RawComm`).
    let rc = unsafe {
        ffi::MPI_Improbe(
            from.process,
            from.tag,
            from.comm.0,
            &mut found,
            &mut message,
            &mut status,
        )
    };
    check(rc)?;
    if found == 0 {
        return Ok(None);
    }
    let mut count: c_int = 0;
    // SAFETY: `status` was filled by the successful matched probe; `RSMPI_UINT8_T` is an
    // immutable MPI constant.
    let rc = unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
    check(rc)?;
    // MPI_UNDEFINED (negative) cannot happen for bytes; treat it as an empty message.
    let size = usize::try_from(count).unwrap_or(0);
    Ok(Some(Matched {
        message,
        count,
        size,
    }))
}

/// Receives the matched message into `buf` (`MPI_Imrecv`), consuming the match.
///
/// # Safety
/// `buf` must hold at least `matched.size` bytes, and its heap allocation must stay alive and
/// untouched until the returned request completes (or be leaked, never freed, if the caller
/// stops waiting before; also when this call fails, since whether MPI took it is unknown).
pub(crate) unsafe fn receive_matched(
    mut matched: Matched,
    buf: &mut [u64],
) -> Result<ffi::MPI_Request, String> {
    let mut request = null_request();
    // SAFETY: the buffer holds `words * 8 >= count` bytes and is kept alive by the caller;
    // `message` is the handle the matched probe returned, consumed here.
    let rc = unsafe {
        ffi::MPI_Imrecv(
            buf.as_mut_ptr().cast::<c_void>(),
            matched.count,
            ffi::RSMPI_UINT8_T,
            &mut matched.message,
            &mut request,
        )
    };
    check(rc)?;
    Ok(request)
}

/// Tests every request (null requests count as complete); `Err` with MPI's message on failure.
pub(crate) fn test_all(
    requests: &mut [ffi::MPI_Request],
    statuses: &mut [ffi::MPI_Status],
) -> Result<bool, String> {
    if requests.is_empty() {
        return Ok(true);
    }
    let mut done: c_int = 0;
    let len = c_int::try_from(requests.len()).map_err(|_| "too many requests".to_string())?;
    // SAFETY: `requests` and `statuses` have the same length and stay alive for the call.
    let rc =
        unsafe { ffi::MPI_Testall(len, requests.as_mut_ptr(), &mut done, statuses.as_mut_ptr()) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(first_error(statuses, rc));
    }
    Ok(done != 0)
}

/// Tests `requests` (`MPI_Testsome`); the positions of those that completed go to `indices`
/// (highest first). Completed requests become null.
pub(crate) fn test_some(
    requests: &mut [ffi::MPI_Request],
    indices: &mut Vec<c_int>,
    statuses: &mut Vec<ffi::MPI_Status>,
    completed: &mut Vec<usize>,
) -> Result<(), String> {
    completed.clear();
    let n = requests.len();
    let count = c_int::try_from(n).map_err(|_| "too many requests".to_string())?;
    indices.resize(n, 0);
    statuses.resize(n, zero_status());
    let mut done: c_int = 0;
    // SAFETY: `requests`, `indices` and `statuses` hold `count` elements and stay alive for the
    // call; completed requests are set to MPI_REQUEST_NULL by MPI.
    let rc = unsafe {
        ffi::MPI_Testsome(
            count,
            requests.as_mut_ptr(),
            &mut done,
            indices.as_mut_ptr(),
            statuses.as_mut_ptr(),
        )
    };
    // MPI_UNDEFINED (no active request) or 0: nothing completed.
    let done = usize::try_from(done).unwrap_or(0).min(n);
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(first_error(&statuses[..done], rc));
    }
    completed.extend(
        indices[..done]
            .iter()
            .filter_map(|&i| usize::try_from(i).ok())
            .filter(|&i| i < n),
    );
    completed.sort_unstable_by(|a, b| b.cmp(a));
    Ok(())
}

/// The first error a status reports, else `rc`'s, as text.
fn first_error(statuses: &[ffi::MPI_Status], rc: c_int) -> String {
    statuses
        .iter()
        .map(|s| s.MPI_ERROR)
        .find(|&e| e != ffi::MPI_SUCCESS as c_int)
        .map_or_else(|| error_string(rc), error_string)
}

/// Whether `request` is still live after testing it once more (errors count as complete).
pub(crate) fn pending(request: &mut ffi::MPI_Request) -> bool {
    let mut done: c_int = 0;
    // SAFETY: a live (or already null) request handle; the status is ignored.
    unsafe { ffi::MPI_Test(request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
    done == 0
}

/// `Ok` for `MPI_SUCCESS`, else MPI's text for the code.
pub(crate) fn check(rc: c_int) -> Result<(), String> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(error_string(rc))
    }
}

/// MPI's text for an error code.
pub(crate) fn error_string(code: c_int) -> String {
    let mut text = vec![0 as c_char; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters, as the call requires.
    let rc = unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    let bytes: Vec<u8> = text[..len.max(0) as usize]
        .iter()
        .map(|&c| c as u8)
        .collect();
    format!(
        "{} (MPI error code {code})",
        String::from_utf8_lossy(&bytes)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_refuse_messages_beyond_an_int() {
        let words = (c_int::MAX as usize) / 8 + 1;
        let err = Unit::Bytes.count(words).err();
        assert_eq!(
            err.as_deref(),
            Some(format!("a message of {} bytes exceeds MPI's int count", words * 8).as_str())
        );
        assert!(Unit::Words.count(words).is_ok());
        assert!(Unit::Bytes.count(2).is_ok_and(|(_, c)| c == 16));
    }
}
