//! Per-sequence attention state: a KV cache per layer. A sliding-window
//! layer keeps a ring just large enough for its window plus one prefill
//! chunk; a full layer keeps the whole context.

use crate::config::ArchConfig;

/// Keys and values of one layer, f32, `[slots][kv_dim]` each.
pub struct LayerCache {
    k: Vec<f32>,
    v: Vec<f32>,
    slots: usize,
    kv_dim: usize,
    v_dim: usize,
    window: Option<usize>,
}

impl LayerCache {
    fn slot(&self, pos: usize) -> usize {
        pos % self.slots
    }

    pub fn store(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let s = self.slot(pos);
        self.k[s * self.kv_dim..(s + 1) * self.kv_dim].copy_from_slice(k);
        self.v[s * self.v_dim..(s + 1) * self.v_dim].copy_from_slice(v);
    }

    /// Positions a query at `pos` attends to.
    pub fn visible(&self, pos: usize) -> std::ops::RangeInclusive<usize> {
        let first = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        first..=pos
    }

    /// The `width`-wide slice at `offset` of the key stored for `pos`.
    pub fn key(&self, pos: usize, offset: usize, width: usize) -> &[f32] {
        let s = self.slot(pos) * self.kv_dim + offset;
        &self.k[s..s + width]
    }

    pub fn value(&self, pos: usize, offset: usize, width: usize) -> &[f32] {
        let s = self.slot(pos) * self.v_dim + offset;
        &self.v[s..s + width]
    }

    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * size_of::<f32>()
    }
}

/// Positions a layer's cache holds: the context, or for a sliding layer its
/// window plus one chunk (so a chunk's first query still finds its window).
fn slots_for(layer: &crate::config::LayerConfig, n_ctx: usize, max_chunk: usize) -> usize {
    ring_slots(layer.sliding_window, n_ctx, max_chunk)
}

/// Slots of a layer with sliding window `window` (None: full context).
pub fn ring_slots(window: Option<usize>, n_ctx: usize, max_chunk: usize) -> usize {
    match window {
        Some(w) => (w + max_chunk.max(1) - 1).min(n_ctx),
        None => n_ctx,
    }
    .max(1)
}

/// The CPU's caches of one sequence: one per layer.
pub struct CpuKv {
    pub layers: Vec<LayerCache>,
}

impl CpuKv {
    /// Caches for `n_ctx` positions, taken `max_chunk` rows at a time.
    pub fn new(cfg: &ArchConfig, n_ctx: usize, max_chunk: usize) -> CpuKv {
        let layers = cfg
            .layers
            .iter()
            .map(|l| {
                let slots = slots_for(l, n_ctx, max_chunk);
                LayerCache {
                    k: vec![0.0; slots * cfg.kv_dim()],
                    v: vec![0.0; slots * cfg.v_dim()],
                    slots,
                    kv_dim: cfg.kv_dim(),
                    v_dim: cfg.v_dim(),
                    window: l.sliding_window,
                }
            })
            .collect();
        CpuKv { layers }
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerCache::bytes).sum()
    }
}

/// The state of one sequence: its caches (of the backend's kind `K`) and how
/// many positions they hold.
pub struct SeqState<K = CpuKv> {
    pub kv: K,
    /// Positions `0..n_past` are in the cache.
    pub n_past: usize,
    /// The most positions this sequence may hold.
    pub n_ctx: usize,
}

impl SeqState {
    /// CPU caches for `n_ctx` positions, taken `max_chunk` rows at a time.
    pub fn new(cfg: &ArchConfig, n_ctx: usize, max_chunk: usize) -> SeqState {
        SeqState { kv: CpuKv::new(cfg, n_ctx, max_chunk), n_past: 0, n_ctx }
    }

    pub fn bytes(&self) -> usize {
        self.kv.bytes()
    }

    /// Bytes of f32 keys and values for `n_ctx` positions (what [`SeqState::new`] allocates).
    pub fn bytes_for(cfg: &ArchConfig, n_ctx: usize, max_chunk: usize) -> usize {
        cfg.layers
            .iter()
            .map(|l| slots_for(l, n_ctx, max_chunk) * (cfg.kv_dim() + cfg.v_dim()) * size_of::<f32>())
            .sum()
    }
}

impl<K> SeqState<K> {
    /// Forgets every position (the memory stays allocated).
    pub fn clear(&mut self) {
        self.n_past = 0;
    }
}
