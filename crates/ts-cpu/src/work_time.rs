//! Thread time spent in the tasks of the matmuls' parallel regions, a measurement knob's
//! counter (off until [`enable`]): beside the regions' wall time and the thread count it says
//! how long threads waited at a region's start and end (issue 16's "waiting at barriers").

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

static ON: AtomicBool = AtomicBool::new(false);
static BUSY_NS: AtomicU64 = AtomicU64::new(0);
static REGIONS: AtomicU64 = AtomicU64::new(0);

/// Starts counting (for the rest of the process).
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

/// Thread time in tasks so far, summed over threads.
pub fn busy() -> Duration {
    Duration::from_nanos(BUSY_NS.load(Ordering::Relaxed))
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
    let start = Instant::now();
    let out = f();
    BUSY_NS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}
