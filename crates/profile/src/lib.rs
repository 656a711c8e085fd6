//! The profiler: what every device thread spent a step on.
//!
//! Recording is off unless [`enable`] was called; then each thread that called [`begin_thread`]
//! records a [`Span`] for every instrumented op it runs, until [`end_thread`] hands the events
//! back. Off, an instrumented op pays one relaxed atomic load ([`span`] returns `None`), so the
//! hooks can stay in the hot paths.
//!
//! Invariants:
//! - spans on one thread nest (a span ends before the span that was open when it started); each
//!   event carries its *exclusive* time (`self_ns` = duration − time in the spans nested in it),
//!   so the exclusive times of one thread's events never sum to more than its wall time;
//! - all threads share one clock origin (the first use of the profiler in the process), so a
//!   trace lines up the devices;
//! - the phase of an op is the thread's current [`Phase`] (set by [`phase_scope`]) unless the span
//!   names its own (collectives and the optimizer do).

mod chrome;
mod report;

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

pub use chrome::chrome_trace;
pub use report::{Report, Roofline, Row, Totals, STEP_KIND};

/// What part of a step an op belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The backward pass (transpose rules).
    Backward,
    /// A collective, including the time spent waiting for the other members.
    Collective,
    /// The optimizer update.
    Optimizer,
    /// Anything else that was instrumented (data loading, packing, the loop itself).
    Other,
}

impl Phase {
    /// The name used in tables and traces (`forward`, `backward`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Collective => "collective",
            Phase::Optimizer => "optimizer",
            Phase::Other => "other",
        }
    }
}

/// One finished span on one device thread.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// The device (or thread label) that ran it.
    pub device: usize,
    /// The op kind (`matmul`, `softmax`, `all_reduce`, `step`, ...).
    pub kind: &'static str,
    /// The part of the step it belongs to.
    pub phase: Phase,
    /// The training step it ran in, when the loop marked one ([`set_step`]).
    pub step: Option<usize>,
    /// Operand shapes as text (`f32[512,256] x f32[256,768]`), empty when not given.
    pub shapes: String,
    /// Start, in nanoseconds since the profiler's clock origin.
    pub start_ns: u64,
    /// Wall time from start to end.
    pub dur_ns: u64,
    /// Wall time minus the time of the spans nested in this one.
    pub self_ns: u64,
    /// Floating-point operations, when known (0 otherwise).
    pub flops: f64,
    /// Bytes read and written (or sent, for a collective), when known (0 otherwise).
    pub bytes: f64,
    /// Nesting depth: 0 for a span opened with no other span open on the thread.
    pub depth: usize,
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static ORIGIN: OnceLock<Instant> = OnceLock::new();

fn now_ns() -> u64 {
    let origin = *ORIGIN.get_or_init(Instant::now);
    // A process runs far less than 584 years, so the nanoseconds fit in u64.
    origin.elapsed().as_nanos() as u64
}

/// Turns recording on for threads that call [`begin_thread`] from now on.
pub fn enable() {
    ORIGIN.get_or_init(Instant::now);
    ENABLED.store(true, Ordering::Relaxed);
}

/// Turns recording off; open recorders keep what they have and record nothing more.
pub fn disable() {
    ENABLED.store(false, Ordering::Relaxed);
}

/// Whether recording is on (one relaxed load).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

struct Open {
    start_ns: u64,
    child_ns: u64,
}

struct Recorder {
    device: usize,
    phase: Phase,
    step: Option<usize>,
    paused: bool,
    open: Vec<Open>,
    events: Vec<Event>,
}

thread_local! {
    static RECORDER: RefCell<Option<Recorder>> = const { RefCell::new(None) };
}

/// Starts recording on this thread, labelled `device`, discarding anything recorded before.
/// Does nothing while the profiler is off.
pub fn begin_thread(device: usize) {
    if !enabled() {
        return;
    }
    RECORDER.with(|r| {
        *r.borrow_mut() = Some(Recorder {
            device,
            phase: Phase::Forward,
            step: None,
            paused: true,
            open: Vec::new(),
            events: Vec::new(),
        })
    });
}

/// Stops recording on this thread and returns its events in the order they ended.
pub fn end_thread() -> Vec<Event> {
    RECORDER.with(|r| {
        r.borrow_mut()
            .take()
            .map(|rec| rec.events)
            .unwrap_or_default()
    })
}

static COLLECTED: Mutex<Vec<Event>> = Mutex::new(Vec::new());

/// Stops recording on this thread and adds its events to the process's collection, for
/// [`take_collected`] (device threads end before the caller reads the profile).
pub fn finish_thread() {
    let events = end_thread();
    if !events.is_empty() {
        // A poisoned lock only means another thread panicked while pushing; keep its events.
        let mut all = COLLECTED.lock().unwrap_or_else(|e| e.into_inner());
        all.extend(events);
    }
}

/// Takes every event that [`finish_thread`] collected in this process.
pub fn take_collected() -> Vec<Event> {
    let mut all = COLLECTED.lock().unwrap_or_else(|e| e.into_inner());
    std::mem::take(&mut *all)
}

/// Marks the step the thread is in (`Some`) and records from now on, or pauses recording
/// (`None`) — the loop marks the steps the user chose (`profile_steps`).
pub fn set_step(step: Option<usize>) {
    with_recorder(|rec| {
        rec.step = step;
        rec.paused = step.is_none();
    });
}

fn with_recorder(f: impl FnOnce(&mut Recorder)) {
    if !enabled() {
        return;
    }
    RECORDER.with(|r| {
        if let Some(rec) = r.borrow_mut().as_mut() {
            f(rec)
        }
    });
}

fn recording() -> bool {
    enabled() && RECORDER.with(|r| r.borrow().as_ref().is_some_and(|rec| !rec.paused))
}

/// Sets the thread's phase until the returned guard drops (then the previous phase returns).
/// The autodiff walk sets [`Phase::Backward`]; ops recorded meanwhile take that phase.
pub fn phase_scope(phase: Phase) -> PhaseGuard {
    let mut previous = None;
    with_recorder(|rec| previous = Some(std::mem::replace(&mut rec.phase, phase)));
    PhaseGuard { previous }
}

/// Restores the previous phase on drop (see [`phase_scope`]).
#[must_use = "the phase lasts until the guard drops"]
pub struct PhaseGuard {
    previous: Option<Phase>,
}

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            with_recorder(|rec| rec.phase = previous);
        }
    }
}

/// An open span; it is recorded when dropped. Create it with [`span`] or [`span_in`].
#[must_use = "a span measures until it drops"]
pub struct Span {
    kind: &'static str,
    phase: Option<Phase>,
    shapes: String,
    flops: f64,
    bytes: f64,
}

impl Span {
    /// Attaches the operand shapes (text, built only when recording).
    pub fn shapes(mut self, shapes: impl FnOnce() -> String) -> Span {
        self.shapes = shapes();
        self
    }

    /// Attaches the op's floating-point operation count.
    pub fn flops(mut self, flops: f64) -> Span {
        self.flops = flops;
        self
    }

    /// Attaches the bytes the op reads and writes (or sends).
    pub fn bytes(mut self, bytes: f64) -> Span {
        self.bytes = bytes;
        self
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let end_ns = now_ns();
        let shapes = std::mem::take(&mut self.shapes);
        with_recorder(|rec| {
            let Some(open) = rec.open.pop() else { return };
            let dur_ns = end_ns.saturating_sub(open.start_ns);
            if let Some(parent) = rec.open.last_mut() {
                parent.child_ns += dur_ns;
            }
            rec.events.push(Event {
                device: rec.device,
                kind: self.kind,
                phase: self.phase.unwrap_or(rec.phase),
                step: rec.step,
                shapes,
                start_ns: open.start_ns,
                dur_ns,
                self_ns: dur_ns.saturating_sub(open.child_ns),
                flops: self.flops,
                bytes: self.bytes,
                depth: rec.open.len(),
            });
        });
    }
}

/// Opens a span of op `kind` in the thread's current phase; `None` (nothing recorded, nothing
/// allocated) unless this thread is recording.
#[inline]
pub fn span(kind: &'static str) -> Option<Span> {
    if !enabled() {
        return None;
    }
    open_span(kind, None)
}

/// Opens a span of op `kind` in `phase` whatever the thread's current phase (collectives, the
/// optimizer); `None` unless this thread is recording.
#[inline]
pub fn span_in(kind: &'static str, phase: Phase) -> Option<Span> {
    if !enabled() {
        return None;
    }
    open_span(kind, Some(phase))
}

fn open_span(kind: &'static str, phase: Option<Phase>) -> Option<Span> {
    if !recording() {
        return None;
    }
    let start_ns = now_ns();
    with_recorder(|rec| {
        rec.open.push(Open {
            start_ns,
            child_ns: 0,
        })
    });
    Some(Span {
        kind,
        phase,
        shapes: String::new(),
        flops: 0.0,
        bytes: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::sleep;
    use std::time::Duration;

    // The switch is process-wide, so the tests that turn it on run in one test function.
    #[test]
    fn spans_nest_phases_scope_and_off_records_nothing() {
        // Off: nothing is recorded, even on a thread that asked.
        begin_thread(0);
        assert!(span("matmul").is_none());
        assert!(end_thread().is_empty());

        enable();
        begin_thread(3);
        // Paused until a step is marked.
        assert!(span("matmul").is_none());
        set_step(Some(7));
        {
            let _outer = span("dot").map(|s| s.flops(100.0));
            sleep(Duration::from_millis(20));
            {
                let _inner = span_in("all_reduce", Phase::Collective);
                sleep(Duration::from_millis(20));
            }
            let _back = phase_scope(Phase::Backward);
            let _t = span("dot_transpose");
        }
        let _s = span("after_guard");
        drop(_s);
        set_step(None);
        assert!(span("paused").is_none());
        let events = end_thread();
        disable();

        let kinds: Vec<_> = events.iter().map(|e| (e.kind, e.phase, e.depth)).collect();
        assert_eq!(
            kinds,
            [
                ("all_reduce", Phase::Collective, 1),
                ("dot_transpose", Phase::Backward, 1),
                ("dot", Phase::Forward, 0),
                ("after_guard", Phase::Forward, 0),
            ]
        );
        let dot = &events[2];
        let reduce = &events[0];
        assert!(events.iter().all(|e| e.device == 3 && e.step == Some(7)));
        assert!(reduce.dur_ns >= 20_000_000);
        assert!(dot.dur_ns >= reduce.dur_ns + 20_000_000);
        // Exclusive time: the outer span's own time excludes both children.
        assert_eq!(dot.self_ns, dot.dur_ns - reduce.dur_ns - events[1].dur_ns);
        assert_eq!(dot.flops, 100.0);
    }
}
