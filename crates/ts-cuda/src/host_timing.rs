//! `TURBOSPARK_HOST_TIMING=1`, a measurement knob: where the host's time goes in a step (in
//! steps that run their ops one by one, as with the expert cache or graphs off, and in replayed
//! ones, whose ops are one launch). Per step: the wall time from one step's start to the next,
//! the kernel launch calls, the waits for routes (each a synchronization with the device), the
//! expert cache's bookkeeping and queued copies, the experts the CPU computes, the step's inputs
//! (built and uploaded), and the wait for its logits with their copy out of page-locked memory;
//! printed every 64 steps.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the host was doing.
#[derive(Clone, Copy)]
pub(crate) enum Phase {
    Launch,
    RouteWait,
    Ensure,
    Prefetch,
    /// Experts the CPU computes (`--expert-misses cpu`): the input's download to the uploads.
    HostExperts,
    /// Of [`Phase::HostExperts`], the wait for the layer's input, its download and the wait
    /// for the last uploads.
    HostInput,
    /// A step's inputs built and queued for upload (tokens, positions, each layer's state).
    StepInputs,
    /// A step's logits on the host: the wait for the step's end and their download, and
    /// the caller's reading them in page-locked memory.
    Logits,
    /// Of [`Phase::Logits`], the caller's reading (a copy out, where it wants its own).
    LogitsRead,
}

/// [`Phase`]s, and those counted inside another (left out of the step's sum).
const PHASES: usize = Phase::LogitsRead as usize + 1;
const NESTED: [Phase; 2] = [Phase::HostInput, Phase::LogitsRead];

#[derive(Default)]
struct Totals {
    /// Time and count per [`Phase`], in its order.
    time: [Duration; PHASES],
    count: [u64; PHASES],
    steps: u64,
    wall: Duration,
    started: Option<Instant>,
}

/// The knob's counters (None when it is off: every call is then one branch).
pub(crate) struct HostTiming(Option<Mutex<Totals>>);

impl HostTiming {
    pub(crate) fn from_env() -> HostTiming {
        HostTiming(std::env::var_os("TURBOSPARK_HOST_TIMING").map(|_| Mutex::new(Totals::default())))
    }

    /// Runs `f`, its time counted under `phase`.
    pub(crate) fn time<T>(&self, phase: Phase, f: impl FnOnce() -> T) -> T {
        let start = self.mark();
        let out = f();
        self.add(phase, start);
        out
    }

    /// Now, where the knob is on: the start of a span [`HostTiming::add`] counts.
    pub(crate) fn mark(&self) -> Option<Instant> {
        self.0.as_ref().map(|_| Instant::now())
    }

    /// Counts the time since `start` (from [`HostTiming::mark`]) under `phase`.
    pub(crate) fn add(&self, phase: Phase, start: Option<Instant>) {
        if let (Some(totals), Some(start)) = (&self.0, start) {
            let mut t = totals.lock().expect("host timing lock");
            t.time[phase as usize] += start.elapsed();
            t.count[phase as usize] += 1;
        }
    }

    /// Marks a step's start (the end of the one before); prints the means every 64 steps.
    pub(crate) fn step_begins(&self) {
        let Some(totals) = &self.0 else { return };
        let mut t = totals.lock().expect("host timing lock");
        let now = Instant::now();
        if let Some(s) = t.started {
            t.wall += now - s;
            t.steps += 1;
            if t.steps.is_multiple_of(64) {
                let n = t.steps as f64;
                let per = |d: Duration| d.as_secs_f64() * 1e3 / n;
                let nested = |i: usize| NESTED.iter().any(|&p| p as usize == i);
                let counted = t.time.iter().enumerate().filter(|&(i, _)| !nested(i)).map(|(_, d)| *d).sum();
                let other = t.wall.saturating_sub(counted);
                eprintln!(
                    "host timing: {} steps, per step {:.3} ms: {:.0} launches {:.3} ms, {:.1} route waits {:.3} ms, \
                     expert cache {:.3} ms ensuring + {:.3} ms prefetching, {:.1} layers of experts on the CPU \
                     {:.3} ms (input {:.3} ms), inputs {:.3} ms, logits {:.3} ms (read {:.3} ms), \
                     other {:.3} ms",
                    t.steps,
                    per(t.wall),
                    t.count[Phase::Launch as usize] as f64 / n,
                    per(t.time[Phase::Launch as usize]),
                    t.count[Phase::RouteWait as usize] as f64 / n,
                    per(t.time[Phase::RouteWait as usize]),
                    per(t.time[Phase::Ensure as usize]),
                    per(t.time[Phase::Prefetch as usize]),
                    t.count[Phase::HostExperts as usize] as f64 / n,
                    per(t.time[Phase::HostExperts as usize]),
                    per(t.time[Phase::HostInput as usize]),
                    per(t.time[Phase::StepInputs as usize]),
                    per(t.time[Phase::Logits as usize]),
                    per(t.time[Phase::LogitsRead as usize]),
                    per(other),
                );
            }
        }
        t.started = Some(now);
    }
}
