//! Thread time spent in the tasks of the matmuls' parallel regions, a measurement knob's
//! counter (off until [`enable`]): beside the regions' wall time and the thread count it says
//! how long threads waited at a region's start and end (issue 16's "waiting at barriers").
//!
//! Each thread adds its tasks' time to a line of its own, under the phase its caller set
//! ([`set_phase`]); the sums are read once a step ([`busy_by_phase`]). A team's regions are
//! also timed from their leader ([`Regions`]: each region's wall time and the leader's wait at
//! its end) and from their followers (how long after its start each saw a region begin). With one
//! counter that every thread added to, and read around every timed op, the knob lengthened a Xeon
//! host's 16-thread decode steps by about 0.2 ms; with these lines, by about 0.05 (2026-12-07,
//! docs/BENCHMARKS.md); with the finer phases of the twenty-fourth session by 0.2 again, most of
//! it (a guess, not measured apart) the followers reading the phase from the line the step's
//! thread wrote six times a product: team regions now carry their leader's phase to their items,
//! and the values the leader writes sit in lines of their own.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::team::Padded;

/// Phases a caller may count apart; the last is time outside any phase it set.
pub const PHASES: usize = 16;
/// The phase tasks count under while no caller has set one.
pub const NO_PHASE: usize = PHASES - 1;
/// Lines of counters: threads past this many share lines (still counted: additions).
const SLOTS: usize = 64;

/// One thread's time in tasks by phase, in nanoseconds: 16 counters, one 128-byte block.
#[repr(align(128))]
struct Slot([AtomicU64; PHASES]);

// Each value alone in its cache lines (`Padded`): every thread reads `ON`, the leader writes
// the others once a region or more, and none of those writes may take the line of a value
// others read.
static ON: Padded<AtomicBool> = Padded(AtomicBool::new(false));
/// The phase the step's thread set; a team's region carries it to its items ([`item_in_phase`]).
static PHASE: Padded<AtomicUsize> = Padded(AtomicUsize::new(NO_PHASE));
static BUSY_NS: [Slot; SLOTS] = [const { Slot([const { AtomicU64::new(0) }; PHASES]) }; SLOTS];
static REGIONS: Padded<AtomicU64> = Padded(AtomicU64::new(0));
/// A team's regions by phase, from their leader: wall time and the wait at their ends (ns).
static REGION_WALL_NS: [AtomicU64; PHASES] = [const { AtomicU64::new(0) }; PHASES];
static LEADER_WAIT_NS: [AtomicU64; PHASES] = [const { AtomicU64::new(0) }; PHASES];
/// When the region in progress began ([`now_ns`]), for its followers' lag.
static PUBLISHED_NS: Padded<AtomicU64> = Padded(AtomicU64::new(0));

/// Not in a team region's item: tasks count under [`PHASE`].
const NO_ITEM: usize = usize::MAX;

thread_local! {
    /// The phase of the team region whose item this thread is running ([`NO_ITEM`] outside one).
    static ITEM_PHASE: std::cell::Cell<usize> = const { std::cell::Cell::new(NO_ITEM) };
}
/// Per thread: its lags behind the regions' starts and its delays joining teams, each a sum in
/// ns and a count (at [`LAGS`] and [`JOINS`]).
static FOLLOWER: [Slot; SLOTS] = [const { Slot([const { AtomicU64::new(0) }; PHASES]) }; SLOTS];
const LAGS: usize = 0;
const JOINS: usize = 2;

/// This thread's line of `lines`.
fn my_line(lines: &[Slot; SLOTS]) -> &[AtomicU64; PHASES] {
    &lines[rayon::current_thread_index().map_or(0, |i| i + 1) % SLOTS].0
}

/// Adds `ns` to this thread's sum at `at` of [`FOLLOWER`], and one to the count after it.
fn follower_counts(at: usize, ns: u64) {
    let line = my_line(&FOLLOWER);
    line[at].fetch_add(ns, Ordering::Relaxed);
    line[at + 1].fetch_add(1, Ordering::Relaxed);
}

/// Starts counting (for the rest of the process).
pub fn enable() {
    ON.0.store(true, Ordering::Relaxed);
}

/// Counts the tasks begun from now on under `phase` (below [`PHASES`]); returns the phase
/// before, to be set again when this one ends. Set by the thread that starts the regions,
/// before it starts them: a team's region carries it to its items, and a task outside one
/// reads it after it has seen its region begin.
pub fn set_phase(phase: usize) -> usize {
    PHASE.0.swap(phase.min(NO_PHASE), Ordering::Relaxed)
}

/// Thread time in tasks so far, by phase, summed over threads.
pub fn busy_by_phase() -> [Duration; PHASES] {
    std::array::from_fn(|p| Duration::from_nanos(BUSY_NS.iter().map(|s| s.0[p].load(Ordering::Relaxed)).sum()))
}

/// Parallel regions begun so far (`team::for_each` calls of two items or more).
pub fn regions() -> u64 {
    REGIONS.0.load(Ordering::Relaxed)
}

/// Counts a parallel region begun, when counting is on.
#[inline]
pub(crate) fn region() {
    if ON.0.load(Ordering::Relaxed) {
        REGIONS.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// Nanoseconds since the process's first call: one clock for every thread.
fn now_ns() -> u64 {
    static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A team region's timing on its leader, from [`region_begins`] (None when counting is off).
pub(crate) struct RegionClock {
    phase: usize,
    start: u64,
    own_done: u64,
}

/// The leader of a team's region marks its start, before it publishes the region.
#[inline]
pub(crate) fn region_begins() -> Option<RegionClock> {
    if !ON.0.load(Ordering::Relaxed) {
        return None;
    }
    let start = now_ns();
    PUBLISHED_NS.0.store(start, Ordering::Relaxed);
    Some(RegionClock { phase: PHASE.0.load(Ordering::Relaxed), start, own_done: start })
}

/// The leader has run the items it could find and starts waiting for the others' to end.
#[inline]
pub(crate) fn leader_waits(clock: &mut Option<RegionClock>) {
    if let Some(c) = clock {
        c.own_done = now_ns();
    }
}

/// Every item of the region has run.
#[inline]
pub(crate) fn region_ends(clock: Option<RegionClock>) {
    if let Some(c) = clock {
        let end = now_ns();
        REGION_WALL_NS[c.phase].fetch_add(end - c.start, Ordering::Relaxed);
        LEADER_WAIT_NS[c.phase].fetch_add(end - c.own_done, Ordering::Relaxed);
    }
}

/// A follower has seen a region begin (its lag behind the leader's start counted, unless it
/// is back from leading it: `led`).
#[inline]
pub(crate) fn follower_sees_region(led: bool) {
    if ON.0.load(Ordering::Relaxed) && !led {
        follower_counts(LAGS, now_ns().saturating_sub(PUBLISHED_NS.0.load(Ordering::Relaxed)));
    }
}

/// When the newest team formed ([`now_ns`]), for its followers' arrival.
static FORMED_NS: AtomicU64 = AtomicU64::new(0);
/// Teams formed, the latest follower's arrival in the newest, and the sum of those of the
/// teams before it (ns).
static TEAMS: AtomicU64 = AtomicU64::new(0);
static LATEST_JOIN_NS: AtomicU64 = AtomicU64::new(0);
static LATEST_JOINS_NS: AtomicU64 = AtomicU64::new(0);

/// A team forms: every thread of its pool is called to it.
#[inline]
pub(crate) fn team_forms() {
    if ON.0.load(Ordering::Relaxed) {
        FORMED_NS.store(now_ns(), Ordering::Relaxed);
        TEAMS.fetch_add(1, Ordering::Relaxed);
        LATEST_JOINS_NS.fetch_add(LATEST_JOIN_NS.swap(0, Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// A follower has joined the newest team (its delay behind the team's forming counted, unless
/// it formed it: `formed`, a leader joining as a follower once its scope is over).
#[inline]
pub(crate) fn follower_joins(formed: bool) {
    if ON.0.load(Ordering::Relaxed) && !formed {
        let late = now_ns().saturating_sub(FORMED_NS.load(Ordering::Relaxed));
        follower_counts(JOINS, late);
        LATEST_JOIN_NS.fetch_max(late, Ordering::Relaxed);
    }
}

/// A team's regions so far, as their leaders and followers timed them.
#[derive(Clone, Copy, Default, Debug)]
pub struct Regions {
    /// Wall time of the regions begun under each phase.
    pub wall: [Duration; PHASES],
    /// Of that, the leader's wait for the other threads' items to end.
    pub leader_wait: [Duration; PHASES],
    /// Followers' lag behind the regions' starts, summed, and how many they saw.
    pub lag: Duration,
    pub seen: u64,
    /// Teams formed; followers' delays joining them, summed, and how many joined.
    pub teams: u64,
    pub joins: Duration,
    pub joined: u64,
    /// The sum over teams (but the newest) of their latest follower's delay.
    pub latest_joins: Duration,
}

impl Regions {
    /// What was counted between `earlier` and these counts, added to `into`.
    pub fn add_since(&self, earlier: &Regions, into: &mut Regions) {
        for p in 0..PHASES {
            into.wall[p] += self.wall[p].saturating_sub(earlier.wall[p]);
            into.leader_wait[p] += self.leader_wait[p].saturating_sub(earlier.leader_wait[p]);
        }
        into.lag += self.lag.saturating_sub(earlier.lag);
        into.seen += self.seen - earlier.seen;
        into.teams += self.teams - earlier.teams;
        into.joins += self.joins.saturating_sub(earlier.joins);
        into.joined += self.joined - earlier.joined;
        into.latest_joins += self.latest_joins.saturating_sub(earlier.latest_joins);
    }
}

/// [`Regions`] so far.
pub fn team_regions() -> Regions {
    let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Ordering::Relaxed));
    let sum = |at: usize| FOLLOWER.iter().map(|s| s.0[at].load(Ordering::Relaxed)).sum::<u64>();
    Regions {
        wall: std::array::from_fn(|p| ns(&REGION_WALL_NS[p])),
        leader_wait: std::array::from_fn(|p| ns(&LEADER_WAIT_NS[p])),
        lag: Duration::from_nanos(sum(LAGS)),
        seen: sum(LAGS + 1),
        teams: TEAMS.load(Ordering::Relaxed),
        joins: Duration::from_nanos(sum(JOINS)),
        joined: sum(JOINS + 1),
        latest_joins: ns(&LATEST_JOINS_NS),
    }
}

/// Runs one task of a parallel region, its time counted when counting is on.
#[inline]
pub fn task<T>(f: impl FnOnce() -> T) -> T {
    if !ON.0.load(Ordering::Relaxed) {
        return f();
    }
    let phase = match ITEM_PHASE.with(std::cell::Cell::get) {
        NO_ITEM => PHASE.0.load(Ordering::Relaxed),
        phase => phase,
    };
    let start = Instant::now();
    let out = f();
    my_line(&BUSY_NS)[phase].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    out
}

/// The phase the step's thread set last, for a team region to carry to its items.
pub(crate) fn current_phase() -> usize {
    PHASE.0.load(Ordering::Relaxed)
}

/// Runs an item of a team region whose leader's phase was `phase`: its tasks count under it,
/// read from the region rather than from [`PHASE`] (whose line the step's thread writes).
pub(crate) fn item_in_phase<T>(phase: usize, f: impl FnOnce() -> T) -> T {
    if !ON.0.load(Ordering::Relaxed) {
        return f();
    }
    let _phase = crate::team::set_for_now(&ITEM_PHASE, phase);
    f()
}
