//! A step's threads kept spinning between parallel regions (pools of [`DEFAULT_MIN_THREADS`]
//! threads and more; `TURBOSPARK_CPU_TEAM=1` or `0` forces it on or off): [`scope`] runs a
//! step with every thread of the current rayon pool in its team; inside it, [`for_each`] hands
//! items to threads that are already awake, as ggml's threadpool does between ops, where a
//! rayon region may find its threads asleep. The team outlives its scope: its followers
//! linger for [`linger`] after a step, yielding their cores each turn (ggml's threads poll
//! between graphs too), so the next step finds them awake instead of waking each (tens of µs a
//! step). Outside a scope
//! (or off) [`for_each`] is a rayon parallel loop. Which thread runs which item never changes
//! an item's floats.

use rayon::prelude::*;
use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU8, AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::sync::{Arc, Mutex};

/// Pools of this many threads and more run steps as a team unless told otherwise. On
/// a 2-vCPU AMD EPYC (2026-12-06, docs/BENCHMARKS.md) a team with contiguous shares decoded
/// SmolLM2 at 1.06x rayon's regions and Qwen2.5-0.5B level (medians of six interleaved runs);
/// on the device machine's 16 Xeon cores (2026-12-03) the team's first form, handing out one
/// item at a time, gave qwen3 1.08x / 1.11x and gpt-oss 0.92x / 1.23x at 8 / 16 threads.
pub const DEFAULT_MIN_THREADS: usize = 2;

/// Whether a pool of `threads` threads runs steps as a team: `TURBOSPARK_CPU_TEAM`
/// (`0`, `false`, `off` or `no`: off; anything else on), else from [`DEFAULT_MIN_THREADS`]
/// threads where the machine has a core for each (spinning threads sharing cores stall).
pub fn enabled(threads: usize) -> bool {
    static KNOB: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let knob = *KNOB.get_or_init(|| {
        let v = std::env::var("TURBOSPARK_CPU_TEAM").ok()?;
        Some(!["0", "false", "off", "no"].contains(&v.trim().to_ascii_lowercase().as_str()))
    });
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    knob.unwrap_or(threads >= DEFAULT_MIN_THREADS && threads <= cores)
}

/// One region's work: items `0..n`, each seat's share in the team's [`Share`]s. It lives on
/// its leader's stack for the length of [`for_each`], which returns only once every item has
/// run: a thread that took an item may read it until it has counted that item as run.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    /// The timing knob's phase its items' tasks count under (`work_time::item_in_phase`).
    phase: usize,
    /// An item's panic, raised again on the leader once the region is over.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// A value alone in its cache lines (two, for the adjacent-line prefetcher), so that a
/// thread's writes to it do not take lines another thread reads.
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

/// Holds a thread-local `Cell` at a value until dropped (a panic's unwinding too), then puts
/// back what it held before.
pub(crate) struct Restore<T: Copy + 'static> {
    key: &'static std::thread::LocalKey<Cell<T>>,
    before: T,
}

/// Sets `key` to `value` on this thread for as long as the returned guard lives.
pub(crate) fn set_for_now<T: Copy>(key: &'static std::thread::LocalKey<Cell<T>>, value: T) -> Restore<T> {
    Restore { key, before: key.with(|c| c.replace(value)) }
}

impl<T: Copy> Drop for Restore<T> {
    fn drop(&mut self) {
        self.key.with(|c| c.set(self.before));
    }
}

/// A seat's items of the region in progress, `front..back` packed as two u32s: its thread
/// takes them from the front, one at a time, and threads with none left take them from the
/// back. Contiguous shares keep each thread on its own stretch of a matrix's rows and its
/// atomics in its own cache line; stealing at the end evens out a late or slow thread.
type Share = Padded<AtomicU64>;

fn pack(front: usize, back: usize) -> u64 {
    front as u64 | (back as u64) << 32
}

/// One item of `share`: its first (its own thread) or its last (another thread, its own
/// share done), or none where it is empty. Acquire: reading a share the leader filled (a
/// release, or a take after it) makes its region's [`Signals::job`] visible.
fn take(share: &Share, from_back: bool) -> Option<usize> {
    let mut v = share.0.load(Relaxed);
    loop {
        let (front, back) = (v as u32 as usize, (v >> 32) as usize);
        if front >= back {
            return None;
        }
        let (item, left) = if from_back { (back - 1, pack(front, back - 1)) } else { (front, pack(front + 1, back)) };
        match share.0.compare_exchange_weak(v, left, Acquire, Relaxed) {
            Ok(_) => return Some(item),
            Err(now) => v = now,
        }
    }
}

/// The leader's signals, written by it alone once a region and read by every follower: one
/// cache line to fetch when a region begins.
struct Signals {
    /// Bumped for every region, so that a spinning thread notices a new one.
    generation: AtomicU64,
    /// The region in progress. Set before the shares are filled, so a thread that took an
    /// item reads its region here: the region cannot end, and no other be set, while one of
    /// its items has not been counted in `ran`.
    job: AtomicPtr<Job<'static>>,
    /// [`IDLE`], [`BUSY`] or [`CLOSED`].
    state: AtomicU8,
}

/// A team's states: between scopes (its followers lingering), running one (its leader's), or
/// ended (its followers leave; the next scope forms a new team).
const IDLE: u8 = 0;
const BUSY: u8 = 1;
const CLOSED: u8 = 2;

/// How long a team's followers stay awake after a scope for the next (`TURBOSPARK_TEAM_LINGER_US`,
/// a measurement knob; 2 ms by default: a server's or a decode loop's host work between two
/// steps is tens of µs, and after a longer pause the threads sleep as rayon's do).
pub fn linger() -> std::time::Duration {
    static LINGER: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *LINGER.get_or_init(|| {
        let us = std::env::var("TURBOSPARK_TEAM_LINGER_US").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
        std::time::Duration::from_micros(us)
    })
}

/// What a team's threads share. A region costs the leader one store to each seat's
/// share and one to the signals, and each thread one store to its own `ran`: no counter
/// that every thread writes (with 16 threads such a line bounced between the cores three
/// times a region, and the leader's sequentially consistent stores each waited for one).
struct Team {
    signals: Padded<Signals>,
    /// Set up once for the team (read by every thread; the leader's seat set by each scope).
    seats: Padded<Seats>,
    /// Items handed out by the team's leaders (one at a time).
    issued: Padded<AtomicUsize>,
}

/// The team's fixed facts, apart from the lines written a region.
struct Seats {
    /// Each seat's share of the region in progress, set by the leader before it publishes
    /// the region (seats are the threads' indices in their pool).
    shares: Vec<Share>,
    /// Items each seat has run in this team, written by that seat alone (release: the
    /// items' writes come with it); the leader sums them to know when a region is done.
    ran: Vec<Padded<AtomicUsize>>,
    /// The seat of the scope in progress's leader (of the last scope, between scopes).
    leader: AtomicUsize,
    /// Whether each seat's thread is following the team (in [`follow`]; its leader may be too,
    /// having taken its scope's step from there).
    present: Vec<Padded<AtomicBool>>,
    /// Calls to follow ([`call_the_absent`]) not yet taken by their threads.
    calls_on_the_way: AtomicUsize,
}

impl Team {
    /// A team of `threads` seats, running its first scope.
    fn new(threads: usize) -> Team {
        Team {
            signals: Padded(Signals {
                generation: AtomicU64::new(0),
                job: AtomicPtr::new(std::ptr::null_mut()),
                state: AtomicU8::new(BUSY),
            }),
            seats: Padded(Seats {
                shares: (0..threads).map(|_| Padded(AtomicU64::new(0))).collect(),
                ran: (0..threads).map(|_| Padded(AtomicUsize::new(0))).collect(),
                leader: AtomicUsize::new(0),
                present: (0..threads).map(|_| Padded(AtomicBool::new(false))).collect(),
                calls_on_the_way: AtomicUsize::new(0),
            }),
            issued: Padded(AtomicUsize::new(0)),
        }
    }

    fn ran_in_all(&self) -> usize {
        self.seats.0.ran.iter().map(|r| r.0.load(Acquire)).sum()
    }

    /// Takes the team for a scope, if it is between scopes.
    fn begin(&self) -> bool {
        self.signals.0.state.compare_exchange(IDLE, BUSY, Acquire, Relaxed).is_ok()
    }
}

thread_local! {
    /// The scope this thread leads (only the thread running a scope's body hands out regions).
    static LEADS: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// The team this pool thread last joined or formed.
    static TEAM: std::cell::RefCell<Option<Arc<Team>>> = const { std::cell::RefCell::new(None) };
    /// Whether this thread runs its [`for_each`] regions by itself ([`on_this_thread`]).
    static ALONE: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread leads a scope or follows a team: a call to follow (a broadcast
    /// job, which rayon runs on a thread that waits in a `join` too) is dropped there.
    static SERVING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `body` with every [`for_each`] inside it on this thread, item after item: for work
/// that is already one of many parallel tasks (an expert of a prompt's MoE layer), whose
/// products would otherwise be cut into pieces small enough for the stealing to cost more
/// than it evens out. The items' floats are the same either way.
pub fn on_this_thread<R>(body: impl FnOnce() -> R) -> R {
    let _alone = set_for_now(&ALONE, true);
    body()
}

/// Runs `body` with every thread of the current rayon pool spinning for its [`for_each`]
/// regions; `body` itself runs on one of them. Off ([`enabled`]), `body` alone.
pub fn scope<R: Send>(body: impl FnOnce() -> R + Send) -> R {
    let threads = rayon::current_num_threads();
    if threads < 2 || !enabled(threads) {
        return body();
    }
    lead(body)
}

/// [`scope`]'s work, on a thread of the pool: the team this thread last joined leads again if it
/// is between scopes; else a new team forms (every thread of the pool called to it; `body`
/// starts at once, the followers joining as they come). A scope inside a scope, or beside
/// another scope of the same team, runs `body` with rayon's regions.
fn lead<R: Send>(body: impl FnOnce() -> R + Send) -> R {
    let Some(me) = rayon::current_thread_index() else {
        // Onto a thread of the pool: the leader is one of the team.
        return rayon::scope(|_| lead(body));
    };
    if !LEADS.with(Cell::get).is_null() {
        return body();
    }
    let threads = rayon::current_num_threads();
    let last = TEAM.with(|t| t.borrow().clone()).filter(|t| t.seats.0.shares.len() == threads);
    let team = match last {
        Some(team) if team.begin() => team,
        Some(team) if team.signals.0.state.load(Acquire) == BUSY => return body(),
        _ => {
            crate::work_time::team_forms();
            let team = Arc::new(Team::new(threads));
            TEAM.with(|t| *t.borrow_mut() = Some(team.clone()));
            team
        }
    };
    team.seats.0.leader.store(me, Relaxed);
    call_the_absent(&team, me);
    LEADS.with(|l| l.set(&*team));
    let serving = set_for_now(&SERVING, true);
    let result = std::panic::catch_unwind(AssertUnwindSafe(body));
    drop(serving);
    LEADS.with(|l| l.set(std::ptr::null()));
    team.signals.0.state.store(IDLE, Release);
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Calls every thread of the pool to follow `team` where a seat but the leader's (`me`) is
/// empty and no call is on its way: a thread already in the team, or leading (a leader's own
/// call runs once its scope is over, or inside it while it waits for rayon work, where it is
/// dropped), takes the call and goes on. So does a thread that runs the call while it waits
/// in a `join` inside a team's item: following there would hold up the item, and with it the
/// scope, for good (2026-12-07: a verification step's experts, `par_gated` in an item).
fn call_the_absent(team: &Arc<Team>, me: usize) {
    let seats = &team.seats.0;
    let absent = seats.present.iter().enumerate().any(|(seat, p)| seat != me && !p.0.load(Relaxed));
    if !absent || seats.calls_on_the_way.load(Relaxed) > 0 {
        return;
    }
    seats.calls_on_the_way.fetch_add(seats.shares.len(), Relaxed);
    let called = team.clone();
    rayon::spawn_broadcast(move |ctx| {
        called.seats.0.calls_on_the_way.fetch_sub(1, Relaxed);
        let seat = ctx.index();
        // A leader serves its team while it leads (LEADS set): SERVING covers it.
        if !SERVING.with(Cell::get) && !called.seats.0.present[seat].0.load(Relaxed) {
            follow(&called, seat);
        }
    });
}

/// A thread of the pool in `team` (at `seat`): runs each region's items, and between them the
/// pool's other work (a step handed to the pool is led from here), until the team has been
/// between scopes for [`linger`], or has begun no region for [`LEAVE_A_BUSY_TEAM`] inside one
/// (its seat left empty: the leader's look through every share runs what would have been its
/// items). The second is what ends a call to follow that a thread took while it waited in a
/// `join` whose work was not the team's (a stolen half of a parallel loop inside an item): there
/// it holds up that `join` for a while, not for good.
fn follow(team: &Arc<Team>, seat: usize) {
    let _serving = set_for_now(&SERVING, true);
    /// The seat is taken for the length of the loop (a panic's unwinding too).
    struct Present<'a>(&'a AtomicBool);
    impl Drop for Present<'_> {
        fn drop(&mut self) {
            self.0.store(false, Relaxed);
        }
    }
    team.seats.0.present[seat].0.store(true, Relaxed);
    let _present = Present(&team.seats.0.present[seat].0);
    crate::work_time::follower_joins(team.seats.0.leader.load(Relaxed) == seat);
    TEAM.with(|t| *t.borrow_mut() = Some(team.clone()));
    let signals = &team.signals.0;
    let mut seen = 0u64;
    let mut idle = 0u32;
    let mut idle_since: Option<std::time::Instant> = None;
    loop {
        let g = signals.generation.load(Acquire);
        if g != seen {
            seen = g;
            (idle, idle_since) = (0, None);
            crate::work_time::follower_sees_region(team.seats.0.leader.load(Relaxed) == seat);
            take_items(team, seat, g);
            continue;
        }
        let state = signals.state.load(Acquire);
        if state == CLOSED {
            return;
        }
        // The pool's other work (a step to lead, a `join` inside one) is taken here too, looked
        // for every few turns: a look reads the other threads' deques.
        let every = look_every();
        if every > 0 && idle.is_multiple_of(every) && rayon::yield_now() == Some(rayon::Yield::Executed) {
            (idle, idle_since) = (0, None);
            continue;
        }
        // Wrapping: a count stuck at its top would never look or leave again.
        idle = idle.wrapping_add(1);
        if idle.is_multiple_of(256) {
            let waited = idle_since.get_or_insert_with(std::time::Instant::now).elapsed();
            let closed = || signals.state.compare_exchange(IDLE, CLOSED, Relaxed, Relaxed).is_ok();
            if (state == IDLE && waited >= linger() && closed()) || (state == BUSY && waited >= LEAVE_A_BUSY_TEAM) {
                return;
            }
        }
        // Between scopes the step's caller may be waiting for a core (it wakes when a step ends,
        // outside the pool, while every thread of the pool lingers here): yield it each turn.
        if idle < 1 << 16 && state == BUSY {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// How long a follower waits for a busy team's next region before it leaves its seat: far
/// longer than a step's gaps between regions (a GPU step's host experts come every fraction of
/// a millisecond), short enough that a call to follow taken inside a `join` holds it up little.
const LEAVE_A_BUSY_TEAM: std::time::Duration = std::time::Duration::from_millis(100);

/// How many spins a waiting follower makes between its looks for the pool's other work
/// (`TURBOSPARK_TEAM_LOOK_EVERY`, a measurement knob: a look reads every thread's deque; 0
/// never looks, so a `join` inside a step runs on its own thread and a step handed to the
/// pool waits for a team's end).
fn look_every() -> u32 {
    static EVERY: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *EVERY.get_or_init(|| std::env::var("TURBOSPARK_TEAM_LOOK_EVERY").ok().and_then(|v| v.parse().ok()).unwrap_or(16))
}

/// Followers look for items left in this many seats' shares after their own (the leader
/// in all): the 16-thread regions of a small model's decode lost a microsecond each to every
/// thread reading every share (on the H100 host's Xeon, `team_regions`).
const NEIGHBOURS: usize = 3;

/// Runs items of region `generation` from `seat`'s share, then from the next seats' (from
/// their backs: [`NEIGHBOURS`] of them, all where `seat` leads) until none is left or the next
/// region has begun (whose own share comes first), counting them in `seat`'s `ran` as they
/// finish (its own share's at once, so the leader need not wait for this thread's look
/// through the others'). The leader looking through every share is what makes sure that
/// every item runs, whichever threads are held up.
fn take_items(team: &Team, seat: usize, generation: u64) {
    let seats = &team.seats.0;
    let mine = &seats.ran[seat].0;
    let run = |i: usize| {
        // SAFETY: the item taken keeps its region, whose job this is, from ending until it is
        // counted below (see `Signals::job`).
        let job = unsafe { &*team.signals.0.job.load(Acquire) };
        if let Err(panic) =
            std::panic::catch_unwind(AssertUnwindSafe(|| crate::work_time::item_in_phase(job.phase, || (job.f)(i))))
        {
            job.panic.lock().expect("team panic").get_or_insert(panic);
        }
    };
    let mut ran = 0;
    while let Some(i) = take(&seats.shares[seat], false) {
        run(i);
        ran += 1;
    }
    if ran > 0 {
        mine.store(mine.load(Relaxed) + ran, Release);
    }
    let n = seats.shares.len();
    let looks = if seat == seats.leader.load(Relaxed) { n - 1 } else { NEIGHBOURS.min(n - 1) };
    for other in (1..=looks).map(|d| (seat + d) % n) {
        if team.signals.0.generation.load(Relaxed) != generation {
            return;
        }
        while let Some(i) = take(&seats.shares[other], true) {
            run(i);
            mine.store(mine.load(Relaxed) + 1, Release);
        }
    }
}

/// Runs `f(i)` for every `i` in `0..n` over the threads: the scope's spinning threads where
/// this thread leads one, else a rayon parallel loop.
pub fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    if ALONE.with(Cell::get) {
        (0..n).for_each(f);
        return;
    }
    if n >= 2 {
        crate::work_time::region();
    }
    let team = LEADS.with(|l| l.get());
    if team.is_null() || n < 2 {
        if n == 1 {
            f(0);
        } else {
            (0..n).into_par_iter().for_each(f);
        }
        return;
    }
    // SAFETY: the scope that set `LEADS` is still running its body on this thread.
    let team = unsafe { &*team };
    let job = Job { f, phase: crate::work_time::current_phase(), panic: Mutex::new(None) };
    let seats = &team.seats.0;
    let count = seats.shares.len();
    assert!(n < u32::MAX as usize, "a region of {n} items");
    let mut clock = crate::work_time::region_begins();
    let issued = team.issued.0.load(Relaxed) + n;
    team.issued.0.store(issued, Relaxed);
    // SAFETY: only the lifetime is erased; `job` outlives every use (see `Signals::job`).
    let ptr = unsafe { std::mem::transmute::<*const Job<'_>, *mut Job<'static>>(&job) };
    team.signals.0.job.store(ptr, Relaxed);
    for (seat, share) in seats.shares.iter().enumerate() {
        share.0.store(pack(seat * n / count, (seat + 1) * n / count), Release);
    }
    // A store, not an addition: the leader alone writes it, and a locked addition would wait
    // for every share's store to reach its line first.
    let generation = team.signals.0.generation.load(Relaxed) + 1;
    team.signals.0.generation.store(generation, Release);
    let leader = seats.leader.load(Relaxed);
    // Nested regions inside an item run on the item's thread.
    LEADS.with(|l| l.set(std::ptr::null()));
    take_items(team, leader, generation);
    LEADS.with(|l| l.set(team));
    crate::work_time::leader_waits(&mut clock);
    while team.ran_in_all() < issued {
        std::hint::spin_loop();
    }
    crate::work_time::region_ends(clock);
    if let Some(panic) = job.panic.into_inner().expect("team panic") {
        std::panic::resume_unwind(panic);
    }
}

/// [`for_each`] over `out` in chunks of `chunk` elements (the last may be shorter): item `i`
/// writes chunk `i` and nothing else.
pub fn for_each_chunk<T: Send>(out: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    /// The output, handed across threads: each item takes only its own chunk.
    struct Chunks<T>(*mut T, usize);
    // SAFETY: items write disjoint chunks (below), and `T: Send` lets them move to other threads.
    unsafe impl<T: Send> Sync for Chunks<T> {}
    let (len, chunk) = (out.len(), chunk.max(1));
    let base = Chunks(out.as_mut_ptr(), len);
    let base = &base;
    for_each(len.div_ceil(chunk), &|i| {
        let start = i * chunk;
        // SAFETY: `out` is borrowed mutably for this call and item `i` alone takes
        // `start..start + chunk` (within `len`).
        let piece = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), chunk.min(base.1 - start)) };
        f(i, piece);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::SeqCst;

    /// Every item runs once, inside a scope and out, in regions back to back; a region's
    /// nested `for_each` runs too; the scope hands back its body's value.
    #[test]
    fn every_item_runs_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let counts: Vec<AtomicUsize> = (0..97).map(|_| AtomicUsize::new(0)).collect();
        let region = |n: usize| for_each(n, &|i| _ = counts[i].fetch_add(1, SeqCst));
        let rounds = pool.install(|| {
            lead(|| {
                for n in [97, 1, 0, 5, 97] {
                    region(n);
                }
                for_each(4, &|_| region(3));
                7
            })
        });
        assert_eq!(rounds, 7);
        let got: Vec<usize> = counts.iter().map(|c| c.load(SeqCst)).collect();
        let want: Vec<usize> =
            (0..97).map(|i| 2 + usize::from(i < 1) + usize::from(i < 5) + if i < 3 { 4 } else { 0 }).collect();
        assert_eq!(got, want);
        // Outside a scope: rayon.
        region(10);
        assert_eq!(counts[9].load(SeqCst), 3);
    }

    /// An item's panic reaches the scope's caller once the region is over, and the pool runs
    /// a scope again after it.
    #[test]
    fn a_panicking_item_reaches_the_caller_and_the_pool_recovers() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let ran = AtomicUsize::new(0);
        let failed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            pool.install(|| {
                lead(|| {
                    for_each(8, &|i| {
                        assert_ne!(i, 5, "item 5 fails");
                        ran.fetch_add(1, SeqCst);
                    })
                })
            })
        }));
        assert!(failed.is_err());
        assert_eq!(ran.load(SeqCst), 7, "the other items still ran");
        let again = AtomicUsize::new(0);
        pool.install(|| lead(|| for_each(8, &|_| _ = again.fetch_add(1, SeqCst))));
        assert_eq!(again.load(SeqCst), 8);
    }

    /// A thread held up in its first item has the rest of its share run by the others.
    #[test]
    fn a_held_up_threads_share_is_run_by_the_others() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let counts: Vec<AtomicUsize> = (0..60).map(|_| AtomicUsize::new(0)).collect();
        let by_leader = AtomicUsize::new(0);
        pool.install(|| {
            lead(|| {
                let leader = std::thread::current().id();
                for_each(60, &|i| {
                    counts[i].fetch_add(1, SeqCst);
                    if std::thread::current().id() == leader && by_leader.fetch_add(1, SeqCst) == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(200));
                    }
                })
            })
        });
        assert!(counts.iter().all(|c| c.load(SeqCst) == 1), "every item once");
        assert_eq!(by_leader.load(SeqCst), 1, "the leader's other 19 items went to the two others");
    }

    /// With more threads than a follower looks through, a follower held up in its first item
    /// has the rest of its share run by the others (the leader looks through every share).
    #[test]
    fn a_held_up_followers_share_is_run_by_the_others() {
        let threads = NEIGHBOURS + 4;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let n = 10 * threads;
        let counts: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        let held = Mutex::new(None);
        let ran_by = Mutex::new(std::collections::HashMap::new());
        pool.install(|| {
            lead(|| {
                let leader = std::thread::current().id();
                for_each(n, &|i| {
                    counts[i].fetch_add(1, SeqCst);
                    let me = std::thread::current().id();
                    *ran_by.lock().unwrap().entry(me).or_insert(0) += 1;
                    if me == leader {
                        // Until a follower has started (this machine may have fewer cores).
                        while held.lock().unwrap().is_none() {
                            std::thread::yield_now();
                        }
                        return;
                    }
                    let first_follower = *held.lock().unwrap().get_or_insert(me) == me;
                    if first_follower && ran_by.lock().unwrap()[&me] == 1 {
                        std::thread::sleep(std::time::Duration::from_millis(200));
                    }
                })
            })
        });
        assert!(counts.iter().all(|c| c.load(SeqCst) == 1), "every item once");
        let held = held.into_inner().unwrap().expect("a follower ran an item");
        assert_eq!(ran_by.into_inner().unwrap()[&held], 1, "the held-up follower's other 9 items went to the others");
    }

    /// Inside `on_this_thread` a region's items run on the calling thread, in order, in a scope
    /// (here on a follower, as a whole-expert task does) and out; the flag is back after it.
    #[test]
    fn on_this_thread_runs_a_region_on_the_caller_in_order() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let alone = |n: usize| {
            let me = std::thread::current().id();
            let seen = Mutex::new(Vec::new());
            on_this_thread(|| {
                for_each(n, &|i| {
                    assert_eq!(std::thread::current().id(), me, "item {i} ran on another thread");
                    seen.lock().unwrap().push(i);
                })
            });
            assert!(!ALONE.with(Cell::get), "the flag outlived its body");
            seen.into_inner().unwrap()
        };
        let want: Vec<usize> = (0..40).collect();
        assert_eq!(pool.install(|| alone(40)), want);
        let from_items = Mutex::new(Vec::new());
        pool.install(|| lead(|| for_each(6, &|_| from_items.lock().unwrap().push(alone(40)))));
        assert_eq!(from_items.into_inner().unwrap(), vec![want.clone(); 6]);
    }

    /// Scopes handed to the pool back to back from outside it (as an engine's steps are) find
    /// the team of the scope before them: its followers linger between scopes.
    #[test]
    fn back_to_back_scopes_reuse_their_team() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let step = || {
            pool.install(|| {
                lead(|| {
                    let sum = AtomicUsize::new(0);
                    for_each(30, &|i| _ = sum.fetch_add(i, SeqCst));
                    assert_eq!(sum.into_inner(), 435);
                    TEAM.with(|t| t.borrow().clone()).expect("the leader's team")
                })
            })
        };
        let teams: Vec<Arc<Team>> = (0..50).map(|_| step()).collect();
        let reused = teams.windows(2).filter(|w| Arc::ptr_eq(&w[0], &w[1])).count();
        // Not every one: a loaded machine may hold the caller up past the linger.
        assert!(reused > 0, "no scope found its team from the scope before");
    }

    /// Rayon loops inside a scope's body, while its team forms, neither hang nor lose work: the
    /// leader's own call to follow, run while the body waits for rayon work, is dropped.
    #[test]
    fn rayon_work_inside_a_forming_team_ends() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for round in 0..20 {
            let got = pool.install(|| {
                lead(|| {
                    let a: usize = (0..1000usize).into_par_iter().map(|i| i % 7).sum();
                    let n = AtomicUsize::new(0);
                    for_each(12, &|_| _ = n.fetch_add(1, SeqCst));
                    let b: usize = (0..1000usize).into_par_iter().map(|i| i % 5).sum();
                    (a, n.into_inner(), b)
                })
            });
            assert_eq!(got, (2997, 12, 2000), "round {round}");
        }
    }

    /// Each item gets its own chunk, the last one shorter, in a scope and out.
    #[test]
    fn chunks_cover_the_output_once() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for in_scope in [false, true] {
            let mut out = vec![0f32; 23];
            let fill =
                |out: &mut [f32]| for_each_chunk(out, 5, &|i, c| c.iter_mut().for_each(|v| *v += i as f32 + 1.0));
            pool.install(|| if in_scope { lead(|| fill(&mut out)) } else { fill(&mut out) });
            let want: Vec<f32> = (0..23).map(|j| (j / 5) as f32 + 1.0).collect();
            assert_eq!(out, want, "in a scope: {in_scope}");
        }
    }

    /// A team region's tasks count under the phase its leader set, on every thread that runs
    /// one of its items, and a task outside any region under the leader's phase as before.
    #[test]
    fn a_regions_tasks_count_under_its_leaders_phase() {
        use crate::work_time;
        work_time::enable();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        // Phase 13: no other test sets it (tests of this binary run at once).
        const MINE: usize = 13;
        let before = work_time::busy_by_phase()[MINE];
        let items = AtomicUsize::new(0);
        pool.install(|| {
            lead(|| {
                let outer = work_time::set_phase(MINE);
                for _ in 0..20 {
                    for_each(9, &|_| {
                        work_time::task(|| {
                            let t = std::time::Instant::now();
                            while t.elapsed() < std::time::Duration::from_micros(50) {}
                            items.fetch_add(1, SeqCst);
                        })
                    });
                }
                work_time::set_phase(outer);
            })
        });
        assert_eq!(items.into_inner(), 180);
        // 180 tasks of 50 µs each: at least 9 ms counted under the leader's phase.
        let counted = work_time::busy_by_phase()[MINE] - before;
        assert!(counted >= std::time::Duration::from_millis(9), "{counted:?}");
    }

    /// Items that run parallel loops of their own (a `join` waiting on the item's thread) while
    /// the team forms anew, its call to follow reaching threads inside those `join`s: every
    /// scope ends (a thread that took the call there drops it, or leaves after a linger).
    #[test]
    fn items_with_parallel_loops_while_a_team_forms_end() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
            for round in 0..400 {
                let got = pool.install(|| {
                    lead(|| {
                        let sums: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
                        for_each(4, &|i| {
                            let s: usize =
                                (0..(i + 1) * 100_000usize).into_par_iter().with_max_len(500).map(|j| j % 3).sum();
                            sums[i].store(s, SeqCst);
                        });
                        sums.iter().map(|s| s.load(SeqCst)).sum::<usize>()
                    })
                });
                let want: usize = (1..=4).map(|i| (0..i * 100_000usize).map(|j| j % 3).sum::<usize>()).sum();
                assert_eq!(got, want, "round {round}");
                // Past the linger: the next scope's team calls its threads again.
                std::thread::sleep(linger() + std::time::Duration::from_millis(1));
            }
            done.send(()).unwrap();
        });
        finished.recv_timeout(std::time::Duration::from_secs(120)).expect("a scope did not end within 120 s");
    }
}
