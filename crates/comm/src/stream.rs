//! Background collectives: a device's second channel, for reductions that overlap compute.
//!
//! A [`Stream`] is a thread of the device with a backend of its own (its own rendezvous space
//! in-process, its own MPI communicator across processes), so what runs on it never interleaves
//! with the device's blocking collectives. [`crate::Communicator::start_all_reduce`] and its
//! siblings hand it a job and return a [`Pending`] at once; the stream runs jobs one after
//! another in the order they were started — the same order on every device of a correct SPMD
//! program — and [`Pending::wait`] returns the result.
//!
//! Invariants: a job owns its buffers (moved in, handed back), so nothing is shared with the
//! device thread while it runs; every job completes or fails within the backend's timeout, so a
//! wait is bounded; the results are those of the blocking collective on the same data, bit for
//! bit (the same backend algorithms run them).

use std::sync::mpsc;
use std::thread::JoinHandle;

use ferrotext_sharding::DType;

use crate::backend::{Backend, OpInfo};
use crate::element::{narrowed, widen_into, Element};
use crate::error::CommError;
use crate::trace::CollectiveKind;

/// What a background job does with its buffer.
pub(crate) enum Work {
    /// In-place sum, with the element type on the wire (`bf16`: rounded here, on the stream
    /// thread, summed in `f32`, the result rounded once and widened back).
    AllReduce(Vec<f32>, DType),
    /// Sum, scattered: the output holds `output_len` elements.
    ReduceScatter {
        /// This member's input (group × output).
        input: Vec<f32>,
        /// Elements of the output.
        output_len: usize,
        /// The element type on the wire, as for [`Work::AllReduce`].
        wire: DType,
    },
    /// Concatenation: the output holds `output_len` elements.
    AllGather {
        /// This member's input.
        input: Vec<f32>,
        /// Elements of the output (group × input).
        output_len: usize,
    },
}

struct Job {
    op: OpInfo,
    work: Work,
    done: mpsc::Sender<Result<Vec<f32>, CommError>>,
}

/// A device's background channel (see the module docs).
pub struct Stream {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    /// The stream's own collective sequence (its backend matches jobs by it).
    pub(crate) seq: u64,
}

impl Stream {
    /// A stream running its jobs on `backend` (a backend of its own: see the module docs).
    ///
    /// # Errors
    /// The OS refused the thread.
    pub fn new(device: usize, mut backend: Box<dyn Backend>) -> Result<Stream, CommError> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("ferrotext-stream-{device}"))
            .spawn(move || {
                for job in inbox {
                    let result = run_work(backend.as_mut(), &job.op, job.work);
                    // The waiter may have given up (its device failed): nothing to tell.
                    let _ = job.done.send(result);
                }
            })
            .map_err(|e| CommError::InvalidOption {
                what: "the background stream".into(),
                reason: format!("its thread could not be started: {e}"),
            })?;
        Ok(Stream {
            jobs: Some(jobs),
            thread: Some(thread),
            seq: 0,
        })
    }

    /// Hands `work` to the stream thread.
    pub(crate) fn submit(&mut self, op: OpInfo, work: Work) -> Pending {
        let (done, result) = mpsc::channel();
        let describe = op.describe();
        let seq = op.seq;
        let kind = op.kind;
        match &self.jobs {
            Some(jobs) if jobs.send(Job { op, work, done }).is_ok() => Pending {
                state: State::Running(result),
                describe,
                kind,
                seq,
            },
            _ => Pending::failed(kind, seq, describe, "the stream thread has stopped"),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Closing the channel ends the thread once its queue is done; it is not joined, so a
        // device whose peers are gone does not wait here (its jobs fail within the timeout).
        self.jobs.take();
        drop(self.thread.take());
    }
}

/// Runs `work` on `backend` now and hands back its output buffer (the stream thread's loop, and
/// a communicator without a stream).
pub(crate) fn run_work(
    backend: &mut dyn Backend,
    op: &OpInfo,
    work: Work,
) -> Result<Vec<f32>, CommError> {
    match work {
        Work::AllReduce(mut buf, DType::F32) => {
            backend.all_reduce(op, f32::buf_mut(&mut buf))?;
            Ok(buf)
        }
        // `check_wire` refused every other type when the job was made.
        Work::AllReduce(mut buf, _) => {
            let mut wire = narrowed(&buf);
            backend.all_reduce(op, half::bf16::buf_mut(&mut wire))?;
            widen_into(&wire, &mut buf);
            Ok(buf)
        }
        Work::ReduceScatter {
            input,
            output_len,
            wire: DType::F32,
        } => {
            let mut out = vec![0.0f32; output_len];
            backend.reduce_scatter(op, f32::buf(&input), f32::buf_mut(&mut out))?;
            Ok(out)
        }
        Work::ReduceScatter {
            input, output_len, ..
        } => {
            let input = narrowed(&input);
            let mut out = vec![half::bf16::ZERO; output_len];
            backend.reduce_scatter(op, half::bf16::buf(&input), half::bf16::buf_mut(&mut out))?;
            let mut wide = vec![0.0f32; output_len];
            widen_into(&out, &mut wide);
            Ok(wide)
        }
        Work::AllGather { input, output_len } => {
            let mut out = vec![0.0f32; output_len];
            backend.all_gather(op, f32::buf(&input), f32::buf_mut(&mut out))?;
            Ok(out)
        }
    }
}

enum State {
    Running(mpsc::Receiver<Result<Vec<f32>, CommError>>),
    Done(Result<Vec<f32>, CommError>),
}

/// A background collective in flight: [`Pending::wait`] gives its result.
pub struct Pending {
    state: State,
    describe: String,
    kind: CollectiveKind,
    seq: u64,
}

impl Pending {
    /// An already finished collective (a group of one, or a communicator without a stream).
    pub(crate) fn done(result: Result<Vec<f32>, CommError>) -> Pending {
        Pending {
            state: State::Done(result),
            describe: String::new(),
            kind: CollectiveKind::AllReduce,
            seq: 0,
        }
    }

    fn failed(kind: CollectiveKind, seq: u64, describe: String, detail: &str) -> Pending {
        Pending {
            state: State::Done(Err(CommError::Transport {
                kind,
                seq,
                detail: detail.into(),
            })),
            describe,
            kind,
            seq,
        }
    }

    /// Whether the result is in (a [`Pending::wait`] would not block).
    pub fn is_done(&mut self) -> bool {
        if let State::Running(rx) = &self.state {
            match rx.try_recv() {
                Ok(result) => self.state = State::Done(result),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.state = State::Done(Err(self.lost()));
                }
            }
        }
        true
    }

    /// The collective's output (the reduced buffer, this member's scattered part, or the
    /// gathered whole).
    ///
    /// # Errors
    /// The collective's own error (mismatch, departed peer, timeout), or a stream thread that
    /// stopped.
    pub fn wait(self) -> Result<Vec<f32>, CommError> {
        let _span = ferrotext_profile::span_in("stream_wait", ferrotext_profile::Phase::Collective);
        let lost = self.lost();
        match self.state {
            State::Done(result) => result,
            State::Running(rx) => rx.recv().unwrap_or(Err(lost)),
        }
    }

    fn lost(&self) -> CommError {
        CommError::Transport {
            kind: self.kind,
            seq: self.seq,
            detail: format!(
                "the background stream stopped before finishing {}",
                self.describe
            ),
        }
    }
}
