//! `TURBOSPARK_CPU_TIMING=1`, a measurement knob: where a CPU step's wall time goes, by kind of
//! op (the weight products, the output head, attention, routing, the experts' products; the
//! rest is norms, rotations, cache stores, small ops and the host's work), and how long threads were idle during the phases that run
//! products (their wall time times the thread count, less the threads' time in the products'
//! tasks, `ts_cpu::work_time`: waits at a region's start and end, and the phase's serial work
//! such as quantizing the input or choosing experts). One-row steps (decode) only, each from its
//! start to the next step's; printed as means per step every 64 of them (issue 16's decode
//! profile).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What a step was doing.
#[derive(Clone, Copy)]
pub(crate) enum Phase {
    /// Dense weight products: attention's q/k/v/o, dense FFNs, shared experts.
    Products,
    /// The output head (`[n_vocab][n_embd]`).
    Head,
    /// Attention over the cache.
    Attention,
    /// The router's product and the choice of experts.
    Route,
    ExpertGateUp,
    ExpertDown,
}

const PHASES: usize = 6;
/// The phases that run products in parallel regions.
const REGIONS: [Phase; 5] = [Phase::Products, Phase::Head, Phase::Route, Phase::ExpertGateUp, Phase::ExpertDown];

#[derive(Default)]
struct Totals {
    time: [Duration; PHASES],
    /// The step in progress's phases, added to `time` when it ends if it was a one-row step.
    pending: [Duration; PHASES],
    /// Rows of the step in progress.
    rows: usize,
    steps: u64,
    wall: Duration,
    /// Threads' time in products' tasks during the counted steps, and the counter at the
    /// step in progress's start.
    busy: Duration,
    busy_at_step: Duration,
    started: Option<Instant>,
    /// The pool's threads the counts are for (`bench -t 4,8,16` changes pools: counts restart).
    threads: usize,
}

/// The knob's counters (None when it is off: every call is then one branch).
pub(crate) struct CpuTiming(Option<Mutex<Totals>>);

/// The process's counters: the CPU backend is a unit type.
pub(crate) fn timing() -> &'static CpuTiming {
    static TIMING: std::sync::OnceLock<CpuTiming> = std::sync::OnceLock::new();
    TIMING.get_or_init(|| {
        let on = std::env::var_os("TURBOSPARK_CPU_TIMING").is_some();
        if on {
            ts_cpu::work_time::enable();
        }
        CpuTiming(on.then(|| Mutex::new(Totals::default())))
    })
}

impl CpuTiming {
    /// Runs `f`, its wall time counted under `phase`.
    pub(crate) fn time<T>(&self, phase: Phase, f: impl FnOnce() -> T) -> T {
        let Some(totals) = &self.0 else { return f() };
        let start = Instant::now();
        let out = f();
        totals.lock().expect("cpu timing lock").pending[phase as usize] += start.elapsed();
        out
    }

    /// Marks the start of a step of `rows` rows (the end of the one before); only one-row
    /// steps (decode) are counted; prints the means every 64 of them.
    pub(crate) fn step_begins(&self, rows: usize) {
        let Some(totals) = &self.0 else { return };
        let mut guard = totals.lock().expect("cpu timing lock");
        let t = &mut *guard;
        let now = Instant::now();
        let threads = rayon::current_num_threads();
        if t.threads != threads {
            *t = Totals { threads, ..Totals::default() };
        }
        let busy_now = ts_cpu::work_time::busy();
        if let Some(s) = t.started.filter(|_| t.rows == 1) {
            t.wall += now - s;
            t.busy += busy_now.saturating_sub(t.busy_at_step);
            t.steps += 1;
            for p in 0..PHASES {
                t.time[p] += t.pending[p];
            }
            if t.steps.is_multiple_of(64) {
                eprintln!("{}", t.report());
            }
        }
        t.pending = Default::default();
        t.busy_at_step = busy_now;
        t.rows = rows;
        t.started = Some(now);
    }
}

impl Totals {
    fn report(&self) -> String {
        let n = self.steps as f64;
        let per = |d: Duration| d.as_secs_f64() * 1e3 / n;
        let phase = |p: Phase| per(self.time[p as usize]);
        let other = self.wall.saturating_sub(self.time.iter().sum());
        let threads = self.threads as f64;
        let regions: Duration = REGIONS.iter().map(|&p| self.time[p as usize]).sum();
        let busy = self.busy;
        let waited = (per(regions) * threads - per(busy)).max(0.0);
        format!(
            "cpu timing: {} steps, per step {:.3} ms: products {:.3}, head {:.3}, attention {:.3}, routing {:.3}, \
             experts gate/up {:.3} and down {:.3}, the rest (norms, small ops, host) {:.3}; during the products \
             {} threads were idle {:.3} of {:.3} thread-ms ({:.0}%)",
            self.steps,
            per(self.wall),
            phase(Phase::Products),
            phase(Phase::Head),
            phase(Phase::Attention),
            phase(Phase::Route),
            phase(Phase::ExpertGateUp),
            phase(Phase::ExpertDown),
            per(other),
            threads,
            waited,
            per(regions) * threads,
            100.0 * waited / (per(regions) * threads).max(1e-9),
        )
    }
}
