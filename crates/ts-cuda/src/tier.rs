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
use ts_experts::{EvictionPolicy, ExpertStore, LayerStats, SlotScores, StatsSnapshot};
use ts_model::tensors::{Ffn, MoeWeights};
use ts_model::weights::Weight;
use ts_model::{Model, ModelError};

/// Slot offsets keep each matrix 256-byte aligned (the matvec kernels' loads need 16).
const ALIGN: usize = 256;

/// Where misses are copied from.
enum HostTier {
    /// Every expert in page-locked memory: copies run at full PCIe speed.
    Pinned { buf: PinnedHostSlice<u8>, offset: HashMap<(usize, usize), usize> },
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
    table: HashMap<(usize, usize), usize>,
    owner: Vec<Option<(usize, usize)>>,
    scores: SlotScores,
    host: HostTier,
    copy: Arc<CudaStream>,
    layers: Vec<LayerStats>,
    policy: EvictionPolicy,
    /// Copies still to be timed: layer, start and end events on the copy stream.
    timing: Vec<(usize, CudaEvent, CudaEvent)>,
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
    /// A VRAM cache of `vram_bytes` for `model`'s experts; the host tier is
    /// pinned when `pinned_ok`, else the model's expert store.
    pub fn new(
        gpu: &Gpu,
        model: &Model,
        vram_bytes: u64,
        policy: EvictionPolicy,
        pinned_ok: bool,
    ) -> Result<ExpertTier, ModelError> {
        let err = |e: CudaError| ModelError::Compute(format!("cuda: expert cache: {e}"));
        let layers = moe_layers(model);
        if layers.is_empty() {
            return Err(ModelError::Compute("--expert-cache: this model has no routed experts".into()));
        };
        let per = |w: &Weight| w.row_bytes() * w.n_rows();
        let mut proj_bytes = vec![[0usize; 3]; model.weights.layers.len()];
        let mut largest = [0usize; 3];
        for (il, m) in &layers {
            proj_bytes[*il] = [per(&m.gate_exps), per(&m.up_exps), per(&m.down_exps)];
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
        let arena = gpu.alloc::<u8>(n_slots * slot_bytes).map_err(err)?;
        let host = if pinned_ok {
            let total: usize =
                layers.iter().map(|(il, m)| m.gate_exps.dims[2] * proj_bytes[*il].iter().sum::<usize>()).sum();
            let mut buf = unsafe { gpu.ctx.alloc_pinned::<u8>(total) }.map_err(|e| err(e.into()))?;
            let dst = buf.as_mut_slice().map_err(|e| err(e.into()))?;
            let mut offset = HashMap::new();
            let mut at = 0;
            for (il, m) in &layers {
                for e in 0..m.gate_exps.dims[2] {
                    offset.insert((*il, e), at);
                    for w in [&m.gate_exps, &m.up_exps, &m.down_exps] {
                        let src = w.matrix_bytes(e);
                        dst[at..at + src.len()].copy_from_slice(src);
                        at += src.len();
                    }
                }
            }
            HostTier::Pinned { buf, offset }
        } else {
            HostTier::Store
        };
        Ok(ExpertTier {
            arena,
            n_slots,
            slot_bytes,
            proj_offset,
            proj_bytes,
            table: HashMap::new(),
            owner: vec![None; n_slots],
            scores: SlotScores::new(policy, n_slots),
            host,
            copy: gpu.ctx.new_stream().map_err(|e| err(e.into()))?,
            layers: vec![LayerStats::default(); model.weights.layers.len()],
            policy,
            timing: Vec::new(),
        })
    }

    pub fn slots(&self) -> usize {
        self.n_slots
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
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

    /// Slots holding `experts` of layer `il`, copying in the missing ones.
    /// Everything the compute stream queued before must be finished with the
    /// slots this may evict (the caller synchronised on reading the routes).
    /// On return the compute stream waits for the copies.
    pub fn ensure(
        &mut self,
        gpu: &Gpu,
        il: usize,
        experts: &[usize],
        store: &dyn ExpertStore,
    ) -> Result<Vec<usize>, ModelError> {
        if experts.len() > self.n_slots {
            return Err(ModelError::Compute(format!(
                "cuda: {} experts asked at once, the cache holds {}",
                experts.len(),
                self.n_slots
            )));
        }
        self.scores.clock += 1;
        self.settle_timing();
        let cerr = |e: cudarc::driver::DriverError| ModelError::Compute(format!("cuda: {e}"));
        let start = gpu.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cerr)?;
        start.record(&self.copy).map_err(cerr)?;
        let mut slots = Vec::with_capacity(experts.len());
        let mut misses: Vec<(usize, usize)> = Vec::new();
        let mut copied = 0u64;
        for &e in experts {
            let slot = match self.table.get(&(il, e)).copied() {
                Some(s) => {
                    self.layers[il].hits += 1;
                    s
                }
                None => {
                    self.layers[il].misses += 1;
                    let busy = &slots;
                    let free = (0..self.n_slots).find(|&s| self.owner[s].is_none());
                    let s = match free {
                        Some(s) => s,
                        None => self
                            .scores
                            .victim((0..self.n_slots).filter(|s| !busy.contains(s)))
                            .expect("more slots than experts asked"),
                    };
                    if let Some(old) = self.owner[s].take() {
                        self.table.remove(&old);
                    }
                    misses.push((e, s));
                    copied += self.proj_bytes[il].iter().sum::<usize>() as u64;
                    self.owner[s] = Some((il, e));
                    self.table.insert((il, e), s);
                    self.scores.reset(s);
                    s
                }
            };
            self.scores.touch(slot);
            slots.push(slot);
        }
        self.copy_misses(gpu, il, &misses, store)?;
        if copied > 0 {
            let done = self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(cerr)?;
            gpu.stream.wait(&done).map_err(cerr)?;
            self.layers[il].bytes_read += copied;
            self.timing.push((il, start, done));
        }
        Ok(slots)
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

    /// Queues the copies of `(expert, slot)` pairs of layer `il` on the copy stream.
    fn copy_misses(
        &self,
        gpu: &Gpu,
        il: usize,
        misses: &[(usize, usize)],
        store: &dyn ExpertStore,
    ) -> Result<(), ModelError> {
        let copy = |dst: u64, src: &[u8], e: usize| {
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.copy.cu_stream()) }
                .map_err(|err| ModelError::Compute(format!("cuda: copying expert {e} of layer {il}: {err}")))
        };
        let base = |s: usize, p: usize| gpu.ptr(&self.arena) + (s * self.slot_bytes + self.proj_offset[p]) as u64;
        match &self.host {
            HostTier::Pinned { buf, offset } => {
                let all = buf.as_slice().map_err(|e| ModelError::Compute(format!("cuda: {e}")))?;
                for &(e, s) in misses {
                    let mut at = offset[&(il, e)];
                    for p in 0..3 {
                        let n = self.proj_bytes[il][p];
                        copy(base(s, p), &all[at..at + n], e)?;
                        at += n;
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
                        let bytes = set.get(i)?;
                        for (p, src) in [bytes.gate, bytes.up, bytes.down].into_iter().enumerate() {
                            copy(base(s, p), src, e)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Counters since the tier was made, in the CPU store's shape.
    pub fn stats(&mut self) -> StatsSnapshot {
        self.settle_timing();
        StatsSnapshot {
            layers: self.layers.clone(),
            slots: self.n_slots,
            slot_bytes: self.slot_bytes,
            direct_io: false,
            policy: self.policy.name(),
        }
    }
}
