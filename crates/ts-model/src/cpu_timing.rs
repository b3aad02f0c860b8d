//! `TURBOSPARK_CPU_TIMING=1`, a measurement knob: where a CPU step's wall time goes, by kind of
//! op (the weight products, the output head, attention, routing, the experts' products, norms,
//! rotations with cache stores, the experts' combine, small ops; the rest is the host's work
//! between them), and how long threads were idle during the phases that run
//! products (their wall time times the thread count, less the threads' time in the products'
//! tasks, `ts_cpu::work_time`: waits at a region's start and end, and the phase's serial work
//! such as quantizing the input or choosing experts), and the team's regions as their leader
//! and followers saw them (`ts_cpu::work_time::team_regions`). Each step from its start to the next
//! step's; one-row steps (decode) and batches (prompts) counted apart, printed as means per
//! step every 64 decode steps and every 8 batches (issue 16's profiles).

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
    /// A prompt's experts, gate/up and down on one task each.
    ExpertsFused,
    /// RMS norms (with a following residual add or copy where a backend fuses them).
    Norm,
    /// Rotary embeddings (with per-head norms) and the stores into the KV cache.
    Rope,
    /// The sum of each row's expert outputs, weighted.
    Combine,
    /// Residual adds, scales, activations, copies and selections of rows or columns.
    SmallOps,
    /// A one-row step's activations quantized for its products (inside their phase, on the
    /// step's thread).
    Quantize,
    /// Products' outputs allocated and zeroed before their regions (inside their phase, on the
    /// step's thread).
    Outputs,
}

const PHASES: usize = 13;
const _: () = assert!(PHASES < ts_cpu::work_time::NO_PHASE, "ts_cpu::work_time counts each phase apart");
/// The phases that run products in parallel regions.
const REGIONS: [Phase; 6] =
    [Phase::Products, Phase::Head, Phase::Route, Phase::ExpertGateUp, Phase::ExpertDown, Phase::ExpertsFused];

/// The counted steps of one kind (decode or batches).
#[derive(Default)]
struct Counts {
    time: [Duration; PHASES],
    steps: u64,
    /// Rows of all the steps.
    rows: u64,
    wall: Duration,
    /// Threads' time in products' tasks during each phase of the steps.
    busy: [Duration; PHASES],
    /// Parallel regions of all the steps (`ts_cpu::work_time::regions`).
    regions: u64,
    /// The team's regions of all the steps, from their leaders and followers.
    team: ts_cpu::work_time::Regions,
}

#[derive(Default)]
struct Totals {
    /// One-row steps, and steps of several rows.
    decode: Counts,
    batches: Counts,
    /// The step in progress's phases, added to its kind's counts when it ends.
    pending: [Duration; PHASES],
    /// The threads' time in tasks by phase when the step in progress began
    /// (`ts_cpu::work_time::busy_by_phase`).
    busy_at_start: [Duration; ts_cpu::work_time::PHASES],
    /// Rows of the step in progress.
    rows: usize,
    started: Option<Instant>,
    /// The region count when the step in progress began.
    regions_at_start: u64,
    /// The team's regions when the step in progress began.
    team_at_start: ts_cpu::work_time::Regions,
    /// The pool's threads the counts are for (`bench -t 4,8,16` changes pools: counts restart).
    threads: usize,
}

/// The knob's counters (None when it is off: every call is then one branch).
pub(crate) struct CpuTiming(Option<Mutex<Totals>>);

thread_local! {
    /// Wall time of the phases timed inside the one in progress on this thread.
    static INNER: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::ZERO) };
}

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
    /// Runs `f`, its wall time and the threads' time in tasks meanwhile counted under `phase`.
    /// A phase timed inside another (the experts' scatter inside their products) is taken out
    /// of the outer one's time, and its tasks counted under it alone.
    pub(crate) fn time<T>(&self, phase: Phase, f: impl FnOnce() -> T) -> T {
        let Some(totals) = &self.0 else { return f() };
        let outer_phase = ts_cpu::work_time::set_phase(phase as usize);
        let start = Instant::now();
        let inner = INNER.with(|i| i.replace(Duration::ZERO));
        let out = f();
        let took = start.elapsed();
        ts_cpu::work_time::set_phase(outer_phase);
        let nested = INNER.with(|i| i.replace(inner + took));
        totals.lock().expect("cpu timing lock").pending[phase as usize] += took.saturating_sub(nested);
        out
    }

    /// Marks the start of a step of `rows` rows (the end of the one before, counted with its
    /// kind); prints a kind's means every 64 decode steps or 8 batches.
    pub(crate) fn step_begins(&self, rows: usize) {
        let Some(totals) = &self.0 else { return };
        let mut guard = totals.lock().expect("cpu timing lock");
        let t = &mut *guard;
        let now = Instant::now();
        let threads = rayon::current_num_threads();
        if t.threads != threads {
            *t = Totals { threads, ..Totals::default() };
        }
        let regions = ts_cpu::work_time::regions();
        let busy = ts_cpu::work_time::busy_by_phase();
        let team = ts_cpu::work_time::team_regions();
        if let Some(s) = t.started.filter(|_| t.rows > 0) {
            let (counts, every) = if t.rows == 1 { (&mut t.decode, 64) } else { (&mut t.batches, 8) };
            counts.wall += now - s;
            counts.regions += regions - t.regions_at_start;
            counts.steps += 1;
            counts.rows += t.rows as u64;
            for (p, (time, pending)) in counts.time.iter_mut().zip(t.pending).enumerate() {
                *time += pending;
                counts.busy[p] += busy[p].saturating_sub(t.busy_at_start[p]);
            }
            team.add_since(&t.team_at_start, &mut counts.team);
            if counts.steps.is_multiple_of(every) {
                eprintln!("{}", counts.report(t.threads));
            }
        }
        t.pending = Default::default();
        t.busy_at_start = busy;
        t.rows = rows;
        t.started = Some(now);
        t.regions_at_start = regions;
        t.team_at_start = team;
    }
}

impl Counts {
    fn report(&self, threads: usize) -> String {
        let n = self.steps as f64;
        let per = |d: Duration| d.as_secs_f64() * 1e3 / n;
        let phase = |p: Phase| per(self.time[p as usize]);
        let other = self.wall.saturating_sub(self.time.iter().sum());
        let kind = match self.rows / self.steps.max(1) {
            1 => String::new(),
            rows => format!(" of {rows} rows"),
        };
        let threads = threads as f64;
        // Thread-ms of a phase's wall time, and those in no task (waits, serial work).
        let offered = |p: Phase| phase(p) * threads;
        let idle = |p: Phase| (offered(p) - per(self.busy[p as usize])).max(0.0);
        let percent = |part: f64, of: f64| 100.0 * part / of.max(1e-9);
        let each = REGIONS.iter().map(|&p| format!("{:.0}%", percent(idle(p), offered(p)))).collect::<Vec<_>>();
        let (waited, regions) = REGIONS.iter().fold((0.0, 0.0), |(w, r), &p| (w + idle(p), r + offered(p)));
        let team = &self.team;
        let team_wall = per(team.wall.iter().sum());
        let team_line = format!(
            "; the team's regions {:.3} ms a step (products' {:.3}, head's {:.3}, attention's {:.3}), their leader waiting at \
             their ends {:.3}; a follower began a region {:.2} µs after its start (mean of {:.0} a step); {:.2} teams \
             formed a step, a follower joining one {:.1} µs after it formed (the last {:.1})",
            team_wall,
            per(team.wall[Phase::Products as usize]),
            per(team.wall[Phase::Head as usize]),
            per(team.wall[Phase::Attention as usize]),
            per(team.leader_wait.iter().sum()),
            team.lag.as_secs_f64() * 1e6 / team.seen.max(1) as f64,
            team.seen as f64 / n,
            team.teams as f64 / n,
            team.joins.as_secs_f64() * 1e6 / team.joined.max(1) as f64,
            team.latest_joins.as_secs_f64() * 1e6 / team.teams.max(1) as f64,
        );
        format!(
            "cpu timing: {} steps{kind}, per step {:.3} ms in {:.0} parallel regions: products {:.3}, head {:.3}, attention {:.3}, routing {:.3}, \
             experts gate/up {:.3} and down {:.3}, experts fused {:.3}, norms {:.3}, rope and cache stores {:.3}, combine {:.3}, \
             small ops {:.3}, quantizing one-row inputs {:.3}, zeroing products' outputs {:.3}, the rest (host) {:.3}; during the products \
             {} threads were idle {:.3} of {:.3} thread-ms ({:.0}%; products / head / routing / gate-up / down / fused {}){}",
            self.steps,
            per(self.wall),
            self.regions as f64 / n,
            phase(Phase::Products),
            phase(Phase::Head),
            phase(Phase::Attention),
            phase(Phase::Route),
            phase(Phase::ExpertGateUp),
            phase(Phase::ExpertDown),
            phase(Phase::ExpertsFused),
            phase(Phase::Norm),
            phase(Phase::Rope),
            phase(Phase::Combine),
            phase(Phase::SmallOps),
            phase(Phase::Quantize),
            phase(Phase::Outputs),
            per(other),
            threads,
            waited,
            regions,
            percent(waited, regions),
            each.join(" / "),
            if team.seen > 0 || team_wall > 0.0 { team_line } else { String::new() },
        )
    }
}
