//! Counters for `GET /metrics` (Prometheus text format).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub requests_done: AtomicU64,
    pub rejected: AtomicU64,
    pub cancelled: AtomicU64,
    pub errors: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens found already in a slot's cache (not read again).
    pub prompt_tokens_cached: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Jobs waiting for a slot.
    pub queued: AtomicU64,
    /// Jobs being generated.
    pub busy: AtomicU64,
    pub decode_steps: AtomicU64,
    /// Rows of all decode steps, and their time (for tokens per second).
    pub decode_rows: AtomicU64,
    pub decode_nanos: AtomicU64,
    /// Prompt lookup's guesses checked, and those the model kept.
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    /// Rows and time of the last few seconds of steps, for the current rate.
    recent: Mutex<Vec<(Instant, usize, Duration)>>,
}

impl Metrics {
    pub fn record_step(&self, rows: usize, took: Duration) {
        self.decode_steps.fetch_add(1, Relaxed);
        self.decode_rows.fetch_add(rows as u64, Relaxed);
        self.decode_nanos.fetch_add(took.as_nanos() as u64, Relaxed);
        let mut r = self.recent.lock().expect("metrics lock");
        let now = Instant::now();
        r.push((now, rows, took));
        r.retain(|(t, _, _)| now.duration_since(*t) < Duration::from_secs(10));
    }

    /// Generated tokens per second over the last 10 s of wall time.
    fn recent_tps(&self) -> f64 {
        let r = self.recent.lock().expect("metrics lock");
        let rows: usize = r.iter().map(|(_, n, _)| n).sum();
        match r.first() {
            Some((t0, _, d0)) => rows as f64 / (t0.elapsed() + *d0).as_secs_f64().max(1e-3),
            None => 0.0,
        }
    }

    /// The Prometheus exposition, with expert-cache counters when there are any.
    pub fn render(&self, experts: Option<(u64, u64, u64)>, slots: usize, active: u64) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            s += &format!(
                "# HELP turbospark_{name} {help}\n# TYPE turbospark_{name} {kind}\nturbospark_{name} {value}\n"
            );
        };
        let g = |a: &AtomicU64| a.load(Relaxed).to_string();
        metric("requests_total", "counter", "Requests received.", g(&self.requests));
        metric("requests_done_total", "counter", "Requests that finished generating.", g(&self.requests_done));
        metric("requests_rejected_total", "counter", "Requests answered with an error status.", g(&self.rejected));
        metric(
            "requests_cancelled_total",
            "counter",
            "Requests whose client went away mid-generation.",
            g(&self.cancelled),
        );
        metric("errors_total", "counter", "Generations that failed.", g(&self.errors));
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", g(&self.prompt_tokens));
        metric(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from a slot's cache.",
            g(&self.prompt_tokens_cached),
        );
        metric("completion_tokens_total", "counter", "Tokens generated.", g(&self.completion_tokens));
        metric("queue_depth", "gauge", "Requests waiting for a slot.", g(&self.queued));
        metric("slots", "gauge", "Sequences decoded together at most.", slots.to_string());
        metric("slots_busy", "gauge", "Requests being generated.", active.to_string());
        metric("decode_steps_total", "counter", "Batched decode steps.", g(&self.decode_steps));
        metric("spec_drafted_total", "counter", "Guessed tokens checked (--spec-ngram).", g(&self.spec_drafted));
        metric("spec_accepted_total", "counter", "Guessed tokens the model kept.", g(&self.spec_accepted));
        let rows = self.decode_rows.load(Relaxed) as f64;
        let secs = self.decode_nanos.load(Relaxed) as f64 / 1e9;
        metric(
            "decode_tokens_per_second",
            "gauge",
            "Tokens per second of decode steps since start (rows / step time).",
            format!("{:.2}", if secs > 0.0 { rows / secs } else { 0.0 }),
        );
        metric(
            "recent_tokens_per_second",
            "gauge",
            "Tokens generated per second of wall time over the last 10 s.",
            format!("{:.2}", self.recent_tps()),
        );
        if let Some((hits, misses, bytes)) = experts {
            metric("expert_cache_hits_total", "counter", "Routed-expert cache hits.", hits.to_string());
            metric("expert_cache_misses_total", "counter", "Routed-expert cache misses.", misses.to_string());
            metric("expert_bytes_read_total", "counter", "Bytes of experts read into the cache.", bytes.to_string());
        }
        s
    }
}
