//! Expert-cache counters, per layer and in total.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Counters of one layer (atomics: readers and the compute thread update them).
#[derive(Default)]
pub(crate) struct LayerCounters {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_read: AtomicU64,
    /// Summed over reads (several run at once, so this can exceed wall time).
    pub read_nanos: AtomicU64,
    /// Time the compute thread spent waiting for reads.
    pub wait_nanos: AtomicU64,
    /// Experts read ahead of being asked for.
    pub prefetched: AtomicU64,
}

impl LayerCounters {
    pub fn snapshot(&self) -> LayerStats {
        LayerStats {
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            read_time: Duration::from_nanos(self.read_nanos.load(Relaxed)),
            wait_time: Duration::from_nanos(self.wait_nanos.load(Relaxed)),
            prefetched: self.prefetched.load(Relaxed),
            on_host: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    pub read_time: Duration,
    pub wait_time: Duration,
    pub prefetched: u64,
    /// Misses computed by the host's CPU where they were (the GPU's cache with
    /// `--expert-misses cpu`), not copied in.
    pub on_host: u64,
}

impl LayerStats {
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 { 0.0 } else { self.hits as f64 / n as f64 }
    }

    fn add(&mut self, o: &LayerStats) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.bytes_read += o.bytes_read;
        self.read_time += o.read_time;
        self.wait_time += o.wait_time;
        self.prefetched += o.prefetched;
        self.on_host += o.on_host;
    }
}

/// All layers' counters at one moment.
#[derive(Clone, Debug, Default)]
pub struct StatsSnapshot {
    /// Indexed by layer; dense layers stay at zero.
    pub layers: Vec<LayerStats>,
    /// Slots in the cache and bytes per slot.
    pub slots: usize,
    pub slot_bytes: usize,
    /// How misses are filled: "O_DIRECT reads", "buffered reads", "copies from pinned RAM", ...
    pub source: &'static str,
    /// Whether `wait_time` is measured (the GPU's cache does not see how long compute waits).
    pub measures_wait: bool,
    pub policy: &'static str,
}

impl StatsSnapshot {
    pub fn total(&self) -> LayerStats {
        let mut t = LayerStats::default();
        self.layers.iter().for_each(|l| t.add(l));
        t
    }

    /// Counts since `earlier` (same store).
    pub fn since(&self, earlier: &StatsSnapshot) -> StatsSnapshot {
        let layers = self
            .layers
            .iter()
            .zip(earlier.layers.iter().chain(std::iter::repeat(&LayerStats::default())))
            .map(|(a, b)| LayerStats {
                hits: a.hits - b.hits,
                misses: a.misses - b.misses,
                bytes_read: a.bytes_read - b.bytes_read,
                read_time: a.read_time.saturating_sub(b.read_time),
                wait_time: a.wait_time.saturating_sub(b.wait_time),
                prefetched: a.prefetched - b.prefetched,
                on_host: a.on_host - b.on_host,
            })
            .collect();
        StatsSnapshot { layers, ..self.clone() }
    }
}
