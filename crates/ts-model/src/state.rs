//! Per-sequence state, per layer of the kind the layer's mixer needs: keys and
//! values for an attention layer (a ring just large enough for a sliding
//! window plus one prefill chunk, else the whole context), a convolution
//! window and a recurrent matrix for a linear-attention layer. A recurrent
//! state cannot be rewound, so callers keep snapshots where they may want to
//! return (the end of a prompt, before a speculative step).

use crate::ModelError;
use crate::config::{ArchConfig, AttnLayer, DeltaNetConfig, LayerConfig, Mixer};
use crate::forward::Row;

/// The element type of the CPU's key and value caches (`-ctk`/`-ctv`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// f32: a float32 run's values exactly (`--exact-activations`, and the library's default).
    #[default]
    F32,
    /// IEEE half: half the bytes a position reads and holds (llama.cpp's default).
    F16,
}

impl KvType {
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 => 2,
        }
    }
}

/// A layer's keys `[slots][kv_dim]` and values `[slots][v_dim]`, in the cache's type.
#[derive(Clone)]
pub enum KvRows {
    F32 { k: Vec<f32>, v: Vec<f32> },
    F16 { k: Vec<half::f16>, v: Vec<half::f16> },
}

/// Keys and values of one layer, `[slots][kv_dim]` and `[slots][v_dim]`.
#[derive(Clone)]
pub struct LayerCache {
    rows: KvRows,
    slots: usize,
    kv_dim: usize,
    v_dim: usize,
    window: Option<usize>,
}

/// A layer's cache read as elements of `T` (f32 or f16): [`LayerCache::rows`].
#[derive(Clone, Copy)]
pub struct KvView<'a, T> {
    k: &'a [T],
    v: &'a [T],
    cache: &'a LayerCache,
}

impl<'a, T> KvView<'a, T> {
    /// The `width`-wide slice at `offset` of the key stored for `pos`.
    pub fn key(&self, pos: usize, offset: usize, width: usize) -> &'a [T] {
        let s = self.cache.slot(pos) * self.cache.kv_dim + offset;
        &self.k[s..s + width]
    }

    pub fn value(&self, pos: usize, offset: usize, width: usize) -> &'a [T] {
        let s = self.cache.slot(pos) * self.cache.v_dim + offset;
        &self.v[s..s + width]
    }
}

impl LayerCache {
    pub(crate) fn new(kv: KvType, slots: usize, kv_dim: usize, v_dim: usize, window: Option<usize>) -> LayerCache {
        let rows = match kv {
            KvType::F32 => KvRows::F32 { k: vec![0.0; slots * kv_dim], v: vec![0.0; slots * v_dim] },
            KvType::F16 => {
                // Zeroed bits, so that the pages stay untouched until written (as f32's zeros).
                use half::vec::HalfBitsVecExt;
                let zeros = |n: usize| vec![0u16; n].reinterpret_into::<half::f16>();
                KvRows::F16 { k: zeros(slots * kv_dim), v: zeros(slots * v_dim) }
            }
        };
        LayerCache { rows, slots, kv_dim, v_dim, window }
    }

    /// The ring's slot of `pos`. Positions below the ring's length (every position of a cache
    /// as long as the context) skip the division: attention asks for two slots a position
    /// (SmolLM2's attention at 2,048 positions 6.5-7.6 ms a step against 7.2-7.4 with it).
    #[inline]
    fn slot(&self, pos: usize) -> usize {
        if pos < self.slots { pos } else { pos % self.slots }
    }

    pub fn store(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let s = self.slot(pos);
        let (kr, vr) = (s * self.kv_dim..(s + 1) * self.kv_dim, s * self.v_dim..(s + 1) * self.v_dim);
        match &mut self.rows {
            KvRows::F32 { k: kc, v: vc } => {
                kc[kr].copy_from_slice(k);
                vc[vr].copy_from_slice(v);
            }
            KvRows::F16 { k: kc, v: vc } => {
                use half::slice::HalfFloatSliceExt;
                kc[kr].convert_from_f32_slice(k);
                vc[vr].convert_from_f32_slice(v);
            }
        }
    }

    /// Positions a query at `pos` attends to.
    pub fn visible(&self, pos: usize) -> std::ops::RangeInclusive<usize> {
        let first = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        first..=pos
    }

    /// The keys and values as stored: f32 or f16 rows, each read through a [`KvView`].
    pub fn rows(&self) -> &KvRows {
        &self.rows
    }

    /// A view of this cache's rows `k` and `v` (taken from [`LayerCache::rows`]).
    pub fn view<'a, T>(&'a self, k: &'a [T], v: &'a [T]) -> KvView<'a, T> {
        KvView { k, v, cache: self }
    }

    /// Copies the positions `0..n_past` (those the ring still holds) of `src`, a cache of the
    /// same type.
    fn copy_from(&mut self, src: &LayerCache, n_past: usize) {
        let n = n_past.min(self.slots);
        let first = n_past - n;
        let (kd, vd) = (self.kv_dim, self.v_dim);
        let slots: Vec<(usize, usize)> = (first..n_past).map(|pos| (self.slot(pos), src.slot(pos))).collect();
        fn copy<T: Copy>(d: &mut [T], s: &[T], slots: &[(usize, usize)], w: usize) {
            for &(ds, ss) in slots {
                d[ds * w..(ds + 1) * w].copy_from_slice(&s[ss * w..(ss + 1) * w]);
            }
        }
        match (&mut self.rows, &src.rows) {
            (KvRows::F32 { k, v }, KvRows::F32 { k: sk, v: sv }) => {
                copy(k, sk, &slots, kd);
                copy(v, sv, &slots, vd);
            }
            (KvRows::F16 { k, v }, KvRows::F16 { k: sk, v: sv }) => {
                copy(k, sk, &slots, kd);
                copy(v, sv, &slots, vd);
            }
            _ => unreachable!("two states of one model and cache type"),
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.rows {
            KvRows::F32 { k, v } => (k.len() + v.len()) * size_of::<f32>(),
            KvRows::F16 { k, v } => (k.len() + v.len()) * size_of::<half::f16>(),
        }
    }
}

/// A linear-attention layer's state after the positions run so far.
#[derive(Clone, Debug, PartialEq)]
pub struct RecurrentState {
    /// The last `conv_kernel - 1` inputs of the causal convolution, oldest
    /// first, `[conv_kernel - 1][conv_dim]`.
    pub conv: Vec<f32>,
    /// Per value head the matrix `S`, `[n_v_heads][d_k][d_v]`.
    pub ssm: Vec<f32>,
}

impl RecurrentState {
    pub fn zeros(d: &DeltaNetConfig) -> RecurrentState {
        RecurrentState { conv: vec![0.0; d.conv_state_len()], ssm: vec![0.0; d.ssm_state_len()] }
    }

    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.ssm.len()) * size_of::<f32>()
    }
}

/// One layer's state, of the layer's kind.
#[derive(Clone)]
pub enum LayerState {
    Kv(LayerCache),
    /// An attention layer that reads the keys and values of layer `.0` (Gemma 4's shared tail).
    SharedKv(usize),
    Recurrent(RecurrentState),
}

impl LayerState {
    pub fn bytes(&self) -> usize {
        match self {
            LayerState::Kv(c) => c.bytes(),
            LayerState::SharedKv(_) => 0,
            LayerState::Recurrent(r) => r.bytes(),
        }
    }
}

/// Slots of an attention layer with sliding window `window` (None: full context).
pub fn ring_slots(window: Option<usize>, n_ctx: usize, max_chunk: usize) -> usize {
    match window {
        Some(w) => (w + max_chunk.max(1) - 1).min(n_ctx),
        None => n_ctx,
    }
    .max(1)
}

/// Bytes of one layer's state for `n_ctx` positions (what [`CpuState::new`] allocates).
fn layer_bytes(cfg: &ArchConfig, l: &LayerConfig, n_ctx: usize, max_chunk: usize, kv: KvType) -> usize {
    match &l.mixer {
        Mixer::Attention(a) if a.kv_from.is_some() => 0,
        Mixer::Attention(a) => ring_slots(a.sliding_window, n_ctx, max_chunk) * (a.kv_dim() + a.v_dim()) * kv.bytes(),
        Mixer::DeltaNet => {
            cfg.delta_net.as_ref().map_or(0, |d| d.conv_state_len() + d.ssm_state_len()) * size_of::<f32>()
        }
    }
}

/// The CPU's state of one sequence: one per layer.
#[derive(Clone)]
pub struct CpuState {
    pub layers: Vec<LayerState>,
}

impl CpuState {
    /// State for `n_ctx` positions, taken `max_chunk` rows at a time.
    pub fn new(cfg: &ArchConfig, n_ctx: usize, max_chunk: usize, kv: KvType) -> CpuState {
        let layers = cfg
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(AttnLayer { kv_from: Some(from), .. }) => LayerState::SharedKv(*from),
                Mixer::Attention(a) => {
                    let slots = ring_slots(a.sliding_window, n_ctx, max_chunk);
                    LayerState::Kv(LayerCache::new(kv, slots, a.kv_dim(), a.v_dim(), a.sliding_window))
                }
                Mixer::DeltaNet => {
                    LayerState::Recurrent(RecurrentState::zeros(cfg.delta_net.as_ref().expect("a delta-net config")))
                }
            })
            .collect();
        CpuState { layers }
    }

    /// An MTP sequence's state ([`crate::Backend::new_mtp_state`]): the MTP layer's cache at
    /// index `n_layer`; each trunk layer holds nothing (marked as sharing that cache, which no
    /// trunk layer reads in such a state).
    pub fn for_mtp(cfg: &ArchConfig, n_ctx: usize, kv: KvType) -> Result<CpuState, ModelError> {
        let Some(Mixer::Attention(a)) = cfg.nextn_layer.as_ref().map(|l| &l.mixer) else {
            return Err(ModelError::Compute("this model has no multi-token-prediction (nextn) layer".into()));
        };
        let slots = n_ctx.max(1);
        let mut layers = vec![LayerState::SharedKv(cfg.n_layer); cfg.n_layer];
        layers.push(LayerState::Kv(LayerCache::new(kv, slots, a.kv_dim(), a.v_dim(), None)));
        Ok(CpuState { layers })
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerState::bytes).sum()
    }

    /// The recurrent layers' states (attention layers rewind by position).
    pub fn snapshot(&self) -> Vec<RecurrentState> {
        self.layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Recurrent(r) => Some(r.clone()),
                LayerState::Kv(_) | LayerState::SharedKv(_) => None,
            })
            .collect()
    }

    /// Puts back the recurrent layers' states of a [`CpuState::snapshot`].
    pub fn restore(&mut self, snap: &[RecurrentState]) {
        let mut saved = snap.iter();
        for l in &mut self.layers {
            if let LayerState::Recurrent(r) = l {
                r.clone_from(saved.next().expect("a snapshot of this model"));
            }
        }
    }

    /// Becomes a copy of `src`'s first `n_past` positions.
    pub fn copy_from(&mut self, src: &CpuState, n_past: usize) {
        for (d, s) in self.layers.iter_mut().zip(&src.layers) {
            match (d, s) {
                (LayerState::Kv(d), LayerState::Kv(s)) => d.copy_from(s, n_past),
                (LayerState::Recurrent(d), LayerState::Recurrent(s)) => d.clone_from(s),
                (LayerState::SharedKv(_), LayerState::SharedKv(_)) => {}
                _ => unreachable!("two states of one model"),
            }
        }
    }
}

/// The state of one sequence: per-layer state (of the backend's kind `S`) and
/// how many positions it holds.
pub struct SeqState<S = CpuState> {
    pub state: S,
    /// Positions `0..n_past` are in the state.
    pub n_past: usize,
    /// The most positions this sequence may hold.
    pub n_ctx: usize,
    /// The most rows one step may bring (a sliding-window layer's ring keeps its window plus
    /// this many less one): padding stays within it.
    pub max_chunk: usize,
}

/// Where a sequence was: its length and its recurrent layers' states, from
/// [`crate::Model::snapshot`]. An attention-only model's snapshot holds no data.
pub struct Snapshot<P> {
    pub n_past: usize,
    pub recurrent: P,
}

impl<S> SeqState<S> {
    /// Forgets every position (the memory stays allocated; a recurrent layer
    /// starts again from zero when a sequence's next row is at position 0).
    pub fn clear(&mut self) {
        self.n_past = 0;
    }
}

impl SeqState {
    /// CPU state for `n_ctx` positions, taken `max_chunk` rows at a time, f32 caches.
    pub fn new(cfg: &ArchConfig, n_ctx: usize, max_chunk: usize) -> SeqState {
        SeqState { state: CpuState::new(cfg, n_ctx, max_chunk, KvType::F32), n_past: 0, n_ctx, max_chunk }
    }

    pub fn bytes(&self) -> usize {
        self.state.bytes()
    }

    /// Bytes of state for `n_ctx` positions with caches of type `kv` (what
    /// [`CpuState::new`] allocates).
    pub fn bytes_for(cfg: &ArchConfig, n_ctx: usize, max_chunk: usize, kv: KvType) -> usize {
        cfg.layers.iter().map(|l| layer_bytes(cfg, l, n_ctx, max_chunk, kv)).sum()
    }
}

/// The rows of one sequence in a step, for layers that read them in order.
#[derive(Clone, Debug)]
pub struct SeqRun {
    /// Index into the step's sequences.
    pub seq: usize,
    /// Indices into the step's rows, positions ascending and consecutive.
    pub rows: Vec<usize>,
    /// The first row is at position 0: a recurrent state starts from zero.
    pub fresh: bool,
}

/// Groups a step's rows by sequence, checking what a recurrent layer needs:
/// each sequence's rows at consecutive positions that continue the sequence
/// (or start it again at 0).
pub fn sequence_runs<S>(rows: &[Row], seqs: &[&mut SeqState<S>]) -> Result<Vec<SeqRun>, ModelError> {
    let mut runs: Vec<SeqRun> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        match runs.iter_mut().find(|run| run.seq == r.seq) {
            Some(run) => {
                let last = rows[*run.rows.last().expect("a run has rows")].pos;
                if r.pos != last + 1 {
                    return Err(ModelError::Compute(format!(
                        "sequence {}: a recurrent layer needs consecutive positions, got {} after {last}",
                        r.seq, r.pos
                    )));
                }
                run.rows.push(i);
            }
            None => {
                let n_past = seqs[r.seq].n_past;
                if r.pos != 0 && r.pos != n_past {
                    return Err(ModelError::Compute(format!(
                        "sequence {}: a recurrent layer holds {n_past} positions and cannot go to position {}",
                        r.seq, r.pos
                    )));
                }
                runs.push(SeqRun { seq: r.seq, rows: vec![i], fresh: r.pos == 0 });
            }
        }
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f16 cache takes half an f32 one's bytes and gives back each stored element rounded
    /// to f16, at the ring slot of its position.
    #[test]
    fn an_f16_cache_holds_rounded_rows_in_half_the_bytes() {
        let mut c32 = LayerCache::new(KvType::F32, 4, 8, 16, None);
        let mut c16 = LayerCache::new(KvType::F16, 4, 8, 16, None);
        assert_eq!(2 * c16.bytes(), c32.bytes());
        let k: Vec<f32> = (0..8).map(|i| 0.1 * i as f32 + 1e-4).collect();
        let v: Vec<f32> = (0..16).map(|i| -0.3 * i as f32 + 7e-5).collect();
        for c in [&mut c32, &mut c16] {
            c.store(5, &k, &v);
        }
        let KvRows::F32 { k: k32, v: v32 } = c32.rows() else { panic!("an f32 cache") };
        let view = c32.view(k32, v32);
        assert_eq!((view.key(5, 0, 8), view.value(5, 8, 8)), (&k[..], &v[8..]));
        let KvRows::F16 { k: k16, v: v16 } = c16.rows() else { panic!("an f16 cache") };
        let view = c16.view(k16, v16);
        let round = |x: &[f32]| x.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>();
        assert_eq!((view.key(5, 0, 8), view.value(5, 8, 8)), (&round(&k)[..], &round(&v[8..])[..]));
        // Position 5 is slot 1 of 4: position 1 reads the same row.
        assert_eq!(view.key(1, 0, 8), &round(&k)[..]);
    }
}
