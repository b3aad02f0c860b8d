//! Routed experts tiered VRAM <- host RAM <- disk: a VRAM cache of slots, each
//! holding one expert's gate, up and down matrices; a miss copies the expert
//! from a pinned host copy of every expert or, when host RAM is short, from
//! the model's CPU expert store (streamed: a RAM cache of its own filled from
//! disk with O_DIRECT reads; mapped: the OS pages), on a copy stream that
//! compute waits on. The same policies and statistics as the CPU's streamed
//! experts.

use crate::device::{CudaError, Gpu};
use cudarc::driver::{CudaEvent, sys};
use cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use ts_experts::{ExpertBytes, ExpertStore, LayerStats, SlotCache, StatsSnapshot};
use ts_model::tensors::{Ffn, MoeWeights};
use ts_model::weights::Weight;
use ts_model::{Model, ModelError};

use crate::CudaOptions;

/// Slot offsets keep each matrix 256-byte aligned (the matvec kernels' loads need 16).
const ALIGN: usize = 256;

/// Where a decode step's misses are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum MissPath {
    /// Copied into a VRAM slot, then computed on the GPU.
    Copy,
    /// Computed by the host's CPU from the pinned host copy while the GPU computes the cached
    /// experts (host_experts.rs); the fraction `share` of the next layer's uncached guesses
    /// (the most likely first) is still copied ahead, so that the copies and the CPU share
    /// the experts not in VRAM. None: [`DEFAULT_SHARE`] (or `TURBOSPARK_PREFETCH_SHARE`, a
    /// measurement knob).
    Cpu { share: Option<f32> },
    /// [`MissPath::Cpu`] where the pinned host copy exists and an expert takes at least
    /// [`CPU_MISS_MIN_BYTES`], else [`MissPath::Copy`]; resolved when the tier is made.
    #[default]
    Auto,
}

/// [`MissPath::Auto`] computes misses on the CPU from experts of this size: gpt-oss-20b's
/// (12.6 MiB) decode 1.4x faster so, qwen3-30b-a3b's (2.9 MiB) 0.6x (0.86x on 2026-12-07, 96
/// against 111 tok/s), where a copy takes less than the CPU's round trip (download, products,
/// upload) a layer (docs/BENCHMARKS.md).
pub const CPU_MISS_MIN_BYTES: usize = 8 << 20;

/// The share of guesses copied ahead with [`MissPath::Cpu`]: the best of 0.25, 0.5 and 0.75
/// on gpt-oss-20b's shape with a quarter of its experts in VRAM (docs/BENCHMARKS.md).
pub const DEFAULT_SHARE: f32 = 0.5;

impl MissPath {
    pub fn on_cpu(self) -> bool {
        matches!(self, MissPath::Cpu { .. })
    }
}

/// Where misses are copied from.
enum HostTier {
    /// Every expert in page-locked memory: copies run at full PCIe speed. The CPU reads the
    /// experts it computes in their GGUF layout, or in its packed one where `packed[layer]`
    /// says (`CudaOptions::packed_host`: each copy into a slot is then put back into GGUF rows
    /// on the copy stream); a separate mirror repacked for the CPU showed no gain across
    /// leases (docs/BENCHMARKS.md, 2026-12-03).
    Pinned { buf: PinnedHostSlice<u8>, offset: HashMap<(usize, usize), usize>, packed: Vec<[bool; 3]> },
    /// The model's expert store (streamed from disk or mapped), asked per miss.
    Store,
}

pub struct ExpertTier {
    arena: CudaSlice<u8>,
    n_slots: usize,
    slot_bytes: usize,
    /// Offsets of gate, up and down inside a slot.
    proj_offset: [usize; 3],
    /// Per layer, bytes of one expert's gate, up and down matrices (types may
    /// differ between layers, as in Q4_K_M files); slots fit the largest.
    proj_bytes: Vec<[usize; 3]>,
    /// Per layer, bytes of one row of each of those matrices.
    proj_row_bytes: Vec<[usize; 3]>,
    /// Which expert each slot holds, and the policy's scores (the CPU cache's type).
    cache: SlotCache,
    host: HostTier,
    copy: Arc<CudaStream>,
    layers: Vec<LayerStats>,
    /// Copies still to be timed: layer, start and end events on the copy stream.
    timing: Vec<(usize, CudaEvent, CudaEvent)>,
    /// Per slot: filled by a prefetch that compute has not yet waited for.
    in_flight: Vec<bool>,
    /// Recorded after the last prefetch's copies: once complete, nothing is in flight.
    prefetches_done: Option<CudaEvent>,
    misses: MissPath,
    /// With [`MissPath::Cpu`], the fraction of a guess's uncached experts copied ahead.
    share: f32,
    /// The fraction of an expert the last guesses' share left over (carried to the next, so
    /// that a share of few experts a guess holds on average).
    share_carry: f32,
}

/// Rows of a panel of the CPU's packed layouts (ts-cpu's panel.rs).
const PANEL_ROWS: usize = 16;

/// The largest panel moe.cu's `ts_unpack_mxfp4_panels` holds in shared memory (without
/// asking the device for more than the default 48 KiB).
const UNPACK_PANEL_MAX: usize = 48 << 10;

/// moe.cu's `UnpackMxfp4`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UnpackMxfp4 {
    w: u64,
    row_bytes: i32,
}

/// Whether expert matrices `w` may sit in the pinned host copy in the CPU's packed layout:
/// MXFP4 (the one layout the device unpacks), packed by this CPU's kernels for one-row
/// products (AVX-512 VNNI: its 16-row panels, not AVX2's 8-row ones), whole panels that fit
/// the unpacking kernel's shared memory.
fn unpacks_on_device(w: &Weight) -> bool {
    let ty = w.ty;
    ty == ts_gguf::GgmlType::MXFP4
        && ts_cpu::Isa::detect() == ts_cpu::Isa::Avx512
        && ts_cpu::packs(ty, w.n_rows())
        && w.n_rows().is_multiple_of(PANEL_ROWS)
        && PANEL_ROWS * w.row_bytes() <= UNPACK_PANEL_MAX
}

/// Packs each matrix `(at, bytes, type, rows, row length)` of `dst` in place for the CPU's
/// kernels, in parallel (the matrices are disjoint and in ascending order).
fn pack_in_place(
    dst: &mut [u8],
    matrices: &[(usize, usize, ts_gguf::GgmlType, usize, usize)],
) -> Result<(), ModelError> {
    use rayon::prelude::*;
    let mut pieces = Vec::with_capacity(matrices.len());
    let (mut rest, mut consumed) = (dst, 0);
    for &(at, bytes, ty, rows, k) in matrices {
        let (piece, tail) = std::mem::take(&mut rest)[at - consumed..].split_at_mut(bytes);
        pieces.push((piece, ty, rows, k));
        (rest, consumed) = (tail, at + bytes);
    }
    pieces.into_par_iter().try_for_each(|(piece, ty, rows, k)| match ts_cpu::pack_rows(ty, piece, rows, k) {
        Ok(true) => Ok(()),
        Ok(false) => Err(ModelError::Compute(format!("cuda: expert tier: {ty:?} {rows}x{k} was not packed"))),
        Err(e) => Err(ModelError::Compute(format!("cuda: expert tier: packing for the CPU: {e}"))),
    })
}

fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// The routed-expert weights of each MoE layer.
fn moe_layers(model: &Model) -> Vec<(usize, &MoeWeights)> {
    model
        .weights
        .layers
        .iter()
        .enumerate()
        .filter_map(|(i, l)| match &l.ffn {
            Ffn::Moe(m) => Some((i, m)),
            Ffn::Dense { .. } => None,
        })
        .collect()
}

impl ExpertTier {
    /// A VRAM cache of `vram_bytes` for `model`'s experts, as `opts` asks; the host tier is
    /// pinned where `opts.pinned_host`, else the model's expert store.
    pub fn new(gpu: &Gpu, model: &Model, vram_bytes: u64, opts: &CudaOptions) -> Result<ExpertTier, ModelError> {
        let (policy, pinned_ok, misses) = (opts.policy, opts.pinned_host, opts.misses);
        if misses.on_cpu() && !pinned_ok {
            return Err(ModelError::Compute(
                "--expert-misses cpu computes experts from a pinned copy in host RAM, and host RAM is short here"
                    .into(),
            ));
        }
        let err = |e: CudaError| ModelError::Compute(format!("cuda: expert cache: {e}"));
        let layers = moe_layers(model);
        if layers.is_empty() {
            return Err(ModelError::Compute("--expert-cache: this model has no routed experts".into()));
        };
        let per = |w: &Weight| w.row_bytes() * w.n_rows();
        let mut proj_bytes = vec![[0usize; 3]; model.weights.layers.len()];
        let mut proj_row_bytes = vec![[0usize; 3]; model.weights.layers.len()];
        let mut largest = [0usize; 3];
        for (il, m) in &layers {
            proj_bytes[*il] = [per(&m.gate_exps), per(&m.up_exps), per(&m.down_exps)];
            proj_row_bytes[*il] = [&m.gate_exps, &m.up_exps, &m.down_exps].map(|w| w.row_bytes());
            for p in 0..3 {
                largest[p] = largest[p].max(proj_bytes[*il][p]);
            }
        }
        let proj_offset = [0, round_up(largest[0]), round_up(largest[0]) + round_up(largest[1])];
        let slot_bytes = proj_offset[2] + round_up(largest[2]);
        let n_used = model.cfg.moe.as_ref().map_or(1, |m| m.n_expert_used);
        let n_slots = (vram_bytes / slot_bytes as u64) as usize;
        if n_slots < n_used {
            return Err(ModelError::Compute(format!(
                "--expert-cache {vram_bytes} bytes holds {n_slots} experts; one token needs {n_used} ({} bytes)",
                n_used * slot_bytes
            )));
        }
        let misses = match misses {
            MissPath::Auto if pinned_ok && slot_bytes >= CPU_MISS_MIN_BYTES => MissPath::Cpu { share: None },
            MissPath::Auto => MissPath::Copy,
            chosen => chosen,
        };
        let arena = gpu.alloc::<u8>(n_slots * slot_bytes).map_err(err)?;
        let host = if pinned_ok {
            // Each expert laid out as in a slot, so that one copy moves it.
            let span = |il: usize| proj_offset[2] + proj_bytes[il][2];
            let total: usize = layers.iter().map(|(il, m)| m.gate_exps.dims[2] * round_up(span(*il))).sum();
            // Write-combined memory is uncached for the CPU's reads: only a tier whose misses
            // the CPU computes reads it there, so only that one takes cached memory.
            let flags = if misses.on_cpu() { 0 } else { sys::CU_MEMHOSTALLOC_WRITECOMBINED };
            let mut buf = unsafe { gpu.ctx.alloc_pinned_with_flags::<u8>(total, flags) }.map_err(|e| err(e.into()))?;
            let dst = buf.as_mut_slice().map_err(|e| err(e.into()))?;
            let mut offset = HashMap::new();
            let mut packed = vec![[false; 3]; model.weights.layers.len()];
            // The matrices the CPU's layout will hold: (at, bytes, type, rows, row length).
            let mut to_pack = Vec::new();
            let mut at = 0;
            for (il, m) in &layers {
                let projs = [&m.gate_exps, &m.up_exps, &m.down_exps];
                packed[*il] = projs.map(|w| misses.on_cpu() && opts.packed_host && unpacks_on_device(w));
                for e in 0..m.gate_exps.dims[2] {
                    offset.insert((*il, e), at);
                    for (p, w) in projs.into_iter().enumerate() {
                        let src = w.matrix_bytes(e);
                        dst[at + proj_offset[p]..at + proj_offset[p] + src.len()].copy_from_slice(src);
                        if packed[*il][p] {
                            to_pack.push((at + proj_offset[p], src.len(), w.ty, w.n_rows(), w.row_len()));
                        }
                    }
                    at += round_up(span(*il));
                }
            }
            pack_in_place(dst, &to_pack)?;
            HostTier::Pinned { buf, offset, packed }
        } else {
            HostTier::Store
        };
        Ok(ExpertTier {
            arena,
            n_slots,
            slot_bytes,
            proj_offset,
            proj_bytes,
            proj_row_bytes,
            cache: SlotCache::new(policy, n_slots),
            host,
            copy: gpu.ctx.new_stream().map_err(|e| err(e.into()))?,
            layers: vec![LayerStats::default(); model.weights.layers.len()],
            timing: Vec::new(),
            in_flight: vec![false; n_slots],
            prefetches_done: None,
            misses,
            share: match misses {
                MissPath::Cpu { share: Some(f) } => f.clamp(0.0, 1.0),
                _ => std::env::var("TURBOSPARK_PREFETCH_SHARE")
                    .ok()
                    .and_then(|v| v.parse::<f32>().ok())
                    .filter(|f| (0.0..=1.0).contains(f))
                    .unwrap_or(DEFAULT_SHARE),
            },
            share_carry: 0.0,
        })
    }

    pub fn slots(&self) -> usize {
        self.n_slots
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn misses(&self) -> MissPath {
        self.misses
    }

    /// Expert `e` of layer `il` in the pinned host copy (GGUF layout), for the CPU to compute.
    pub fn host_expert(&self, il: usize, e: usize) -> Result<ExpertBytes<'_>, ModelError> {
        let HostTier::Pinned { buf, offset, packed } = &self.host else {
            return Err(ModelError::Compute("cuda: experts computed on the CPU need the pinned host copy".into()));
        };
        let all = buf.as_slice().map_err(|e| ModelError::Compute(format!("cuda: {e}")))?;
        let at = offset[&(il, e)];
        let [g, u, d] = self.proj_bytes[il];
        let o = self.proj_offset;
        Ok(ExpertBytes {
            gate: &all[at + o[0]..at + o[0] + g],
            up: &all[at + o[1]..at + o[1] + u],
            down: &all[at + o[2]..at + o[2] + d],
            packed: packed[il],
        })
    }

    pub fn host_tier(&self) -> &'static str {
        match self.host {
            HostTier::Pinned { .. } => "pinned RAM",
            HostTier::Store => "the expert store",
        }
    }

    /// Device address of projection `proj` (0 gate, 1 up, 2 down) in slot 0;
    /// slot s is `slot_bytes * s` further.
    pub fn proj_base(&self, gpu: &Gpu, proj: usize) -> u64 {
        gpu.ptr(&self.arena) + self.proj_offset[proj] as u64
    }

    /// Slots holding `experts` (distinct) of layer `il`, copying in the missing
    /// ones, or (None) leaving them to the CPU where `to_host` and the tier's
    /// [`MissPath`] allow. Everything the compute stream queued before must be finished with
    /// the slots this may evict (the caller synchronised on reading the routes).
    /// On return the compute stream waits for the copies, and for earlier
    /// prefetches into the slots it will read.
    pub fn ensure(
        &mut self,
        gpu: &Gpu,
        il: usize,
        experts: &[usize],
        store: &dyn ExpertStore,
        to_host: bool,
    ) -> Result<Vec<Option<usize>>, ModelError> {
        if experts.len() > self.n_slots {
            return Err(ModelError::Compute(format!(
                "cuda: {} experts asked at once, the cache holds {}",
                experts.len(),
                self.n_slots
            )));
        }
        debug_assert!(
            experts.iter().enumerate().all(|(i, e)| !experts[..i].contains(e)),
            "experts asked twice: {experts:?}"
        );
        self.cache.tick();
        self.settle_timing();
        if self.prefetches_done.as_ref().is_some_and(|ev| ev.is_complete()) {
            self.in_flight.iter_mut().for_each(|f| *f = false);
            self.prefetches_done = None;
        }
        // Hits first, so that no miss evicts an expert this layer reads.
        let mut slots: Vec<Option<usize>> = experts.iter().map(|&e| self.cache.lookup(il, e)).collect();
        let mut wait_prefetch = false;
        for s in slots.iter().flatten() {
            self.layers[il].hits += 1;
            wait_prefetch |= self.in_flight[*s];
        }
        let mut misses: Vec<(usize, usize)> = Vec::new();
        let mut busy = vec![false; self.n_slots];
        slots.iter().flatten().for_each(|&s| busy[s] = true);
        let to_host = to_host && self.misses.on_cpu();
        for i in 0..experts.len() {
            if slots[i].is_none() {
                self.layers[il].misses += 1;
                if to_host {
                    self.layers[il].on_host += 1;
                    continue;
                }
                let s = self.claim(il, experts[i], &busy).expect("more slots than experts asked");
                busy[s] = true;
                misses.push((experts[i], s));
                slots[i] = Some(s);
            }
        }
        for &s in slots.iter().flatten() {
            self.cache.touch(s);
        }
        let copied = self.copy_misses(gpu, il, &misses, store).inspect_err(|_| self.release(&misses))?;
        if copied > 0 || wait_prefetch {
            let cerr = |e: cudarc::driver::DriverError| ModelError::Compute(format!("cuda: {e}"));
            // The copy stream runs in order: this event follows every copy queued so far.
            let done = self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cerr)?;
            gpu.stream.wait(&done).map_err(cerr)?;
            self.in_flight.iter_mut().for_each(|f| *f = false);
            self.prefetches_done = None;
        }
        Ok(slots)
    }

    /// Starts copying `guess`, the experts layer `il` will probably ask for,
    /// into slots other than `keep` (those the current layer reads; nothing
    /// queued on the compute stream may read any other), without making
    /// compute wait; `ensure` waits for them if they are used. Over the CPU's
    /// expert store the store reads them ahead into its RAM cache.
    pub fn prefetch(
        &mut self,
        gpu: &Gpu,
        il: usize,
        guess: &[usize],
        keep: &[usize],
        store: &dyn ExpertStore,
    ) -> Result<(), ModelError> {
        let mut wanted: Vec<usize> = guess.iter().copied().filter(|&e| self.cache.lookup(il, e).is_none()).collect();
        if self.misses.on_cpu() {
            // The guess comes most likely first; the CPU computes the rest if asked.
            let due = wanted.len() as f32 * self.share + self.share_carry;
            let n = (due.floor() as usize).min(wanted.len());
            self.share_carry = (due - n as f32).min(1.0);
            wanted.truncate(n);
        }
        if wanted.is_empty() {
            return Ok(());
        }
        if let HostTier::Store = self.host {
            // Counted as asked: the store skips what its RAM cache already holds.
            self.layers[il].prefetched += wanted.len() as u64;
            store.prefetch(il, &wanted);
            return Ok(());
        }
        // Neither this layer's slots nor guesses already cached are evicted for a guess.
        let mut busy = vec![false; self.n_slots];
        keep.iter()
            .chain(guess.iter().filter_map(|&e| self.cache.lookup(il, e)).collect::<Vec<_>>().iter())
            .for_each(|&s| busy[s] = true);
        let n_busy = busy.iter().filter(|&&b| b).count();
        let mut copies = Vec::new();
        for e in wanted.into_iter().take(self.n_slots.saturating_sub(n_busy)) {
            let Some(s) = self.claim(il, e, &busy) else { break };
            busy[s] = true;
            copies.push((e, s));
        }
        if copies.is_empty() {
            return Ok(());
        }
        self.copy_misses(gpu, il, &copies, store).inspect_err(|_| self.release(&copies))?;
        for &(_, s) in &copies {
            self.in_flight[s] = true;
        }
        self.layers[il].prefetched += copies.len() as u64;
        let cerr = |e: cudarc::driver::DriverError| ModelError::Compute(format!("cuda: {e}"));
        self.prefetches_done = Some(self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cerr)?);
        Ok(())
    }

    /// Forgets the slots of `(expert, slot)` pairs whose copies could not be queued.
    fn release(&mut self, pairs: &[(usize, usize)]) {
        for &(_, s) in pairs {
            self.cache.forget(s);
        }
    }

    /// A slot for expert `e` of layer `il` (free, or the policy's victim among
    /// slots marked in `busy`), entered in the table.
    fn claim(&mut self, il: usize, e: usize, busy: &[bool]) -> Option<usize> {
        self.cache.claim(il, e, |s| !busy[s])
    }

    /// Adds the copy time of finished copies to their layers' read time.
    fn settle_timing(&mut self) {
        let mut pending = Vec::new();
        for (il, a, b) in self.timing.drain(..) {
            if b.is_complete() {
                if let Ok(ms) = a.elapsed_ms(&b) {
                    self.layers[il].read_time += Duration::from_secs_f64(ms as f64 / 1e3);
                }
            } else {
                pending.push((il, a, b));
            }
        }
        self.timing = pending;
    }

    /// Queues the copies of `(expert, slot)` pairs of layer `il` on the copy
    /// stream, timed by a pair of events; returns the bytes queued.
    fn copy_misses(
        &mut self,
        gpu: &Gpu,
        il: usize,
        misses: &[(usize, usize)],
        store: &dyn ExpertStore,
    ) -> Result<u64, ModelError> {
        if misses.is_empty() {
            return Ok(0);
        }
        let cerr = |e: cudarc::driver::DriverError| ModelError::Compute(format!("cuda: {e}"));
        let start = self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cerr)?;
        let copy = |dst: u64, src: &[u8], e: usize| {
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.copy.cu_stream()) }
                .map_err(|err| ModelError::Compute(format!("cuda: copying expert {e} of layer {il}: {err}")))
        };
        let base = |s: usize, p: usize| gpu.ptr(&self.arena) + (s * self.slot_bytes + self.proj_offset[p]) as u64;
        let mut bytes = 0;
        match &self.host {
            HostTier::Pinned { buf, offset, packed } => {
                let all = buf.as_slice().map_err(|e| ModelError::Compute(format!("cuda: {e}")))?;
                let span = self.proj_offset[2] + self.proj_bytes[il][2];
                for &(e, s) in misses {
                    let at = offset[&(il, e)];
                    copy(base(s, 0), &all[at..at + span], e)?;
                    bytes += span as u64;
                    for p in (0..3).filter(|&p| packed[il][p]) {
                        let rows = self.proj_bytes[il][p] / self.proj_row_bytes[il][p];
                        let params = UnpackMxfp4 { w: base(s, p), row_bytes: self.proj_row_bytes[il][p] as i32 };
                        gpu.launch_on_stream(
                            &self.copy,
                            "ts_unpack_mxfp4_panels",
                            ((rows / PANEL_ROWS) as u32, 1, 1),
                            (256, 1, 1),
                            (PANEL_ROWS * self.proj_row_bytes[il][p]) as u32,
                            &params,
                        )
                        .map_err(|err| ModelError::Compute(format!("cuda: expert {e} of layer {il}: {err}")))?;
                    }
                }
            }
            HostTier::Store => {
                // The store reads what it lacks (in parallel) and holds it while the copies are
                // queued; copies from its pageable memory are staged before they return.
                for group in misses.chunks(store.capacity().max(1)) {
                    let ids: Vec<usize> = group.iter().map(|&(e, _)| e).collect();
                    let set = store.ensure(il, &ids)?;
                    for (i, &(e, s)) in group.iter().enumerate() {
                        let expert = set.get(i)?;
                        for (p, src) in [expert.gate, expert.up, expert.down].into_iter().enumerate() {
                            copy(base(s, p), src, e)?;
                            bytes += src.len() as u64;
                        }
                    }
                }
            }
        }
        let end = self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cerr)?;
        self.timing.push((il, start, end));
        self.layers[il].bytes_read += bytes;
        Ok(bytes)
    }

    /// Counters since the tier was made, in the CPU store's shape.
    pub fn stats(&mut self) -> StatsSnapshot {
        self.settle_timing();
        StatsSnapshot {
            layers: self.layers.clone(),
            slots: self.n_slots,
            slot_bytes: self.slot_bytes,
            source: match &self.host {
                HostTier::Pinned { packed, .. } if packed.iter().flatten().any(|&p| p) => {
                    "copies from pinned RAM (MXFP4 held in the CPU's packed layout)"
                }
                HostTier::Pinned { .. } => "copies from pinned RAM",
                HostTier::Store => "copies through the CPU's expert store",
            },
            measures_wait: false,
            policy: self.cache.policy().name(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{PANEL_ROWS, unpacks_on_device};
    use ts_gguf::GgmlType;

    /// moe.cu's `ts_unpack_mxfp4_panels` on the host, byte for byte as its threads write: GGUF
    /// byte `i` of a panel of `row_bytes` rows from the packed panel.
    fn unpack_as_the_kernel(panel: &[u8], row_bytes: usize) -> Vec<u8> {
        (0..PANEL_ROWS * row_bytes)
            .map(|i| {
                let (r, c) = (i / row_bytes, i % row_bytes);
                let (b, j) = (c / 17, c % 17);
                let block = &panel[b * 272..];
                if j == 0 { block[256 + r] } else { block[64 * ((j - 1) >> 2) + 4 * r + ((j - 1) & 3)] }
            })
            .collect()
    }

    /// The kernel's indexing puts matrices packed by ts-cpu's `pack_rows` back into their GGUF
    /// bytes (gpt-oss-20b's expert shapes and the fixture's), and the tier packs them only where
    /// that layout is this CPU's (AVX-512 VNNI; `tools/test.sh` skips this test by name elsewhere).
    #[test]
    fn unpacking_kernel_indexing_restores_gguf_rows() {
        for (rows, k) in [(2880, 2880), (256, 64), (64, 256)] {
            let row_bytes = k / 32 * 17;
            let mut state = 0x1234_5678_u64 ^ rows as u64;
            let gguf: Vec<u8> = (0..rows * row_bytes)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (state >> 33) as u8
                })
                .collect();
            let w = ts_model::weights::Weight::from_bytes("experts", GgmlType::MXFP4, vec![k, rows], gguf.clone());
            assert!(unpacks_on_device(&w), "{rows}x{k}: not held packed");
            let mut packed = gguf.clone();
            assert!(ts_cpu::pack_rows(GgmlType::MXFP4, &mut packed, rows, k).unwrap());
            assert_ne!(packed, gguf, "{rows}x{k}: packing moved nothing");
            for (p, panel) in packed.chunks_exact(PANEL_ROWS * row_bytes).enumerate() {
                let want = &gguf[p * PANEL_ROWS * row_bytes..][..PANEL_ROWS * row_bytes];
                assert!(unpack_as_the_kernel(panel, row_bytes) == want, "{rows}x{k}: panel {p} differs");
            }
        }
    }
}
