//! Thread time spent in the tasks of the matmuls' parallel regions, a measurement knob's
//! counter (off until [`enable`]): beside the regions' wall time and the thread count it says
//! how long threads waited at a region's start and end (issue 16's "waiting at barriers").
//!
//! Each thread adds its tasks' time to a line of its own, under the phase its caller set
//! ([`set_phase`]); the sums are read once a step ([`busy_by_phase`]). With one counter that
//! every thread added to, and read around every timed op, the knob lengthened a Xeon host's
//! decode steps (2026-12-07: 1.87 / 1.73 / 2.35 ms at 16 / 8 / 4 threads without it, 2.09 /
//! 2.44 / 2.71 with it); how much of that this layout takes away is not yet measured there.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Phases a caller may count apart; the last is time outside any phase it set.
pub const PHASES: usize = 16;
/// The phase tasks count under while no caller has set one.
pub const NO_PHASE: usize = PHASES - 1;
/// Lines of counters: threads past this many share lines (still counted: additions).
const SLOTS: usize = 64;

/// One thread's time in tasks by phase, in nanoseconds: 16 counters, one 128-byte block.
#[repr(align(128))]
struct Slot([AtomicU64; PHASES]);

static ON: AtomicBool = AtomicBool::new(false);
static PHASE: AtomicUsize = AtomicUsize::new(NO_PHASE);
static BUSY_NS: [Slot; SLOTS] = [const { Slot([const { AtomicU64::new(0) }; PHASES]) }; SLOTS];
static REGIONS: AtomicU64 = AtomicU64::new(0);

/// Starts counting (for the rest of the process).
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

/// Counts the tasks begun from now on under `phase` (below [`PHASES`]); returns the phase
/// before, to be set again when this one ends. Set by the thread that starts the regions,
/// before it starts them: a task reads the phase after it has seen its region begin.
pub fn set_phase(phase: usize) -> usize {
    PHASE.swap(phase.min(NO_PHASE), Ordering::Relaxed)
}

/// Thread time in tasks so far, by phase, summed over threads.
pub fn busy_by_phase() -> [Duration; PHASES] {
    std::array::from_fn(|p| Duration::from_nanos(BUSY_NS.iter().map(|s| s.0[p].load(Ordering::Relaxed)).sum()))
}

/// Parallel regions begun so far (`team::for_each` calls of two items or more).
pub fn regions() -> u64 {
    REGIONS.load(Ordering::Relaxed)
}

/// Counts a parallel region begun, when counting is on.
#[inline]
pub(crate) fn region() {
    if ON.load(Ordering::Relaxed) {
        REGIONS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs one task of a parallel region, its time counted when counting is on.
#[inline]
pub fn task<T>(f: impl FnOnce() -> T) -> T {
    if !ON.load(Ordering::Relaxed) {
        return f();
    }
    let phase = PHASE.load(Ordering::Relaxed);
    let start = Instant::now();
    let out = f();
    let slot = rayon::current_thread_index().map_or(0, |i| i + 1) % SLOTS;
    BUSY_NS[slot].0[phase].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}
