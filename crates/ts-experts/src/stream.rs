//! Experts streamed from disk into a bounded cache of slots.
//!
//! A slot holds one expert's gate, up and down matrices. `ensure` maps each
//! asked expert to a slot: a hit pins the slot it is in; a miss takes a free or
//! evicted slot (never a pinned one: the protect set), pins it, and queues its
//! three reads on a pool of reader threads. `ExpertSet::get` waits for an
//! expert's reads, so the compute thread works on experts already in while
//! the others are still being read. Reads are positioned reads of the aligned
//! range covering each matrix, with O_DIRECT where the filesystem allows it.

use crate::slots::{EvictionPolicy, SlotCache};
use crate::stats::{LayerCounters, StatsSnapshot};
use crate::{ExpertBytes, ExpertError, ExpertLayout, ExpertSet, ExpertStore, Packer, SetInner};
use std::alloc::Layout;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Where expert bytes are read from.
pub trait ReadSource: Send + Sync {
    /// Fills `buf` from `offset`; both are multiples of [`alignment`](Self::alignment).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Offsets, lengths and buffer addresses must be multiples of this.
    fn alignment(&self) -> usize;
    /// Whether reads bypass the page cache.
    fn direct(&self) -> bool;
    fn path(&self) -> &Path;
}

/// A file read with O_DIRECT (4096-byte alignment), or with plain positioned reads.
pub struct FileSource {
    file: File,
    path: PathBuf,
    direct: bool,
}

const DIRECT_ALIGN: usize = 4096;

impl FileSource {
    /// Opens `path` for O_DIRECT reads when `direct` and the filesystem accepts them,
    /// else for buffered reads.
    pub fn open(path: &Path, direct: bool) -> io::Result<FileSource> {
        if direct && let Ok(file) = File::options().read(true).custom_flags(libc::O_DIRECT).open(path) {
            // Some filesystems accept the flag at open and refuse the read (EINVAL).
            let mut probe = AlignedBuf::new(DIRECT_ALIGN, DIRECT_ALIGN);
            if file.read_at(probe.as_mut_slice(), 0).is_ok() {
                return Ok(FileSource { file, path: path.to_path_buf(), direct: true });
            }
        }
        Ok(FileSource { file: File::open(path)?, path: path.to_path_buf(), direct: false })
    }
}

impl ReadSource for FileSource {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        // O_DIRECT may return fewer bytes at the end of the file; the padding past it stays unused.
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn alignment(&self) -> usize {
        if self.direct { DIRECT_ALIGN } else { 1 }
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct StreamOptions {
    /// Bytes the slots may take together.
    pub cache_bytes: u64,
    pub policy: EvictionPolicy,
    /// Threads issuing reads.
    pub readers: usize,
    /// Try O_DIRECT.
    pub direct_io: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            cache_bytes: 1 << 30,
            policy: EvictionPolicy::DecayedFrequency { half_life: 256.0 },
            readers: 8,
            direct_io: true,
        }
    }
}

/// An owned allocation with a chosen alignment.
struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is plain memory; who may touch it when is governed by the slot protocol.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn new(len: usize, align: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(1), align).expect("valid buffer layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `layout.size()` bytes and exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// Where, inside a slot, each matrix's bytes land: the aligned read's start and
/// length, and the matrix's offset within what was read.
#[derive(Clone, Copy, Debug)]
struct Placement {
    slot_offset: usize,
    read_offset: u64,
    read_len: usize,
    data_skip: usize,
    data_len: usize,
}

fn placements(layout: &crate::LayerLayout, expert: usize, align: usize) -> [Placement; 3] {
    let mut at = 0;
    layout.proj.map(|p| {
        let offset = p.offset(expert);
        let start = offset / align as u64 * align as u64;
        let end = (offset + p.expert_bytes as u64).div_ceil(align as u64) * align as u64;
        let pl = Placement {
            slot_offset: at,
            read_offset: start,
            read_len: (end - start) as usize,
            data_skip: (offset - start) as usize,
            data_len: p.expert_bytes,
        };
        at += pl.read_len;
        pl
    })
}

/// Counts down the reads of one expert; holds the first error.
struct Latch {
    state: Mutex<(usize, Option<io::Error>)>,
    done: Condvar,
}

impl Latch {
    fn new(n: usize) -> Arc<Latch> {
        Arc::new(Latch { state: Mutex::new((n, None)), done: Condvar::new() })
    }

    fn complete(&self, result: io::Result<()>) {
        let mut s = self.state.lock().unwrap();
        s.0 -= 1;
        if let Err(e) = result {
            s.1.get_or_insert(e);
        }
        if s.0 == 0 {
            self.done.notify_all();
        }
    }

    fn is_done(&self) -> bool {
        self.state.lock().unwrap().0 == 0
    }

    /// Waits for every read; the first error, if any, as (kind, message).
    fn wait(&self) -> Result<(), io::Error> {
        let mut s = self.state.lock().unwrap();
        while s.0 > 0 {
            s = self.done.wait(s).unwrap();
        }
        match &s.1 {
            None => Ok(()),
            Some(e) => Err(io::Error::new(e.kind(), e.to_string())),
        }
    }
}

struct ReadJob {
    slot: usize,
    placement: Placement,
    layer: usize,
    /// 0 gate, 1 up, 2 down.
    proj: usize,
    latch: Arc<Latch>,
}

/// Slot bookkeeping, under one lock: the cache's table and per slot the latch
/// of its reads.
struct State {
    cache: SlotCache,
    latch: Vec<Option<Arc<Latch>>>,
}

impl State {
    /// Whether slot `s`'s reads are done and one failed.
    fn failed(&self, s: usize) -> bool {
        self.latch[s].as_ref().is_some_and(|l| l.is_done() && l.wait().is_err())
    }
}

struct Shared {
    source: Box<dyn ReadSource>,
    /// Set by [`ExpertStore::pack`]: the repacking each read matrix gets, and per layer which
    /// projections it repacks.
    repack: std::sync::OnceLock<(Packer, Vec<[bool; 3]>)>,
    slots: Vec<AlignedBuf>,
    queue: Mutex<VecDeque<ReadJob>>,
    queued: Condvar,
    stop: std::sync::atomic::AtomicBool,
    counters: Vec<LayerCounters>,
}

/// Gives slot `s` to expert `e` of `layer` (evicting what it held) and returns
/// the reads that fill it; the slot's latch completes when they are done.
fn assign(st: &mut State, s: usize, layer: usize, e: usize, pl: &[Placement; 3]) -> Vec<ReadJob> {
    st.cache.assign(s, layer, e);
    let latch = Latch::new(3);
    st.latch[s] = Some(latch.clone());
    pl.iter()
        .enumerate()
        .map(|(proj, &placement)| ReadJob { slot: s, placement, layer, proj, latch: latch.clone() })
        .collect()
}

/// A bounded cache of expert slots filled from disk.
pub struct StreamingExperts {
    layout: ExpertLayout,
    shared: Arc<Shared>,
    state: Mutex<State>,
    slot_bytes: usize,
    policy: EvictionPolicy,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl StreamingExperts {
    /// A cache of `opts.cache_bytes` over the experts of `layout`, read from its file.
    pub fn open(layout: ExpertLayout, opts: &StreamOptions) -> Result<StreamingExperts, ExpertError> {
        let source = FileSource::open(&layout.path, opts.direct_io)
            .map_err(|e| ExpertError::Setup(format!("{}: {e}", layout.path.display())))?;
        Self::with_source(layout, opts, Box::new(source))
    }

    /// As [`open`](Self::open), reading through `source` (tests inject failures here).
    pub fn with_source(
        layout: ExpertLayout,
        opts: &StreamOptions,
        source: Box<dyn ReadSource>,
    ) -> Result<StreamingExperts, ExpertError> {
        let align = source.alignment().max(64);
        let slot_bytes = layout
            .layers
            .iter()
            .flatten()
            .map(|l| placements(l, 0, align).iter().map(|p| p.read_len + align).sum::<usize>())
            .max()
            .unwrap_or(0);
        if slot_bytes == 0 {
            return Err(ExpertError::Setup("the model has no routed experts to stream".into()));
        }
        let n_slots = (opts.cache_bytes / slot_bytes as u64) as usize;
        let slots = (0..n_slots).map(|_| AlignedBuf::new(slot_bytes, align)).collect();
        let shared = Arc::new(Shared {
            source,
            repack: std::sync::OnceLock::new(),
            slots,
            queue: Mutex::new(VecDeque::new()),
            queued: Condvar::new(),
            stop: false.into(),
            counters: (0..layout.layers.len()).map(|_| LayerCounters::default()).collect(),
        });
        let readers = (0..opts.readers.max(1))
            .map(|_| {
                let shared = shared.clone();
                std::thread::spawn(move || reader_loop(&shared))
            })
            .collect();
        Ok(StreamingExperts {
            layout,
            state: Mutex::new(State { cache: SlotCache::new(opts.policy, n_slots), latch: vec![None; n_slots] }),
            shared,
            slot_bytes,
            policy: opts.policy,
            readers,
        })
    }

    pub fn slots(&self) -> usize {
        self.shared.slots.len()
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Whether reads bypass the page cache.
    pub fn direct_io(&self) -> bool {
        self.shared.source.direct()
    }

    /// A slot for expert `e` of `layer`, its reads queued in `jobs`: a free one, else the
    /// policy's victim among slots neither pinned nor still being filled (a prefetch holds
    /// no pin while its reads run).
    fn claim(
        &self,
        st: &mut State,
        layer: usize,
        e: usize,
        pl: &[Placement; 3],
        jobs: &mut Vec<ReadJob>,
    ) -> Option<usize> {
        let State { cache, latch } = st;
        let s = cache.claim(layer, e, |s| latch[s].as_ref().is_none_or(|l| l.is_done()))?;
        jobs.extend(assign(st, s, layer, e, pl));
        Some(s)
    }

    /// Queues reads for the reader threads.
    fn submit(&self, jobs: Vec<ReadJob>) {
        if !jobs.is_empty() {
            self.shared.queue.lock().unwrap().extend(jobs);
            self.shared.queued.notify_all();
        }
    }

    fn release(&self, slots: &[usize]) {
        let mut st = self.state.lock().unwrap();
        for &s in slots {
            st.cache.unpin(s);
            // A slot whose read failed holds nothing usable: forget it so the next ask retries.
            if st.failed(s) && !st.cache.pinned(s) {
                st.cache.forget(s);
                st.latch[s] = None;
            }
        }
    }
}

impl Drop for StreamingExperts {
    fn drop(&mut self) {
        self.shared.stop.store(true, Relaxed);
        self.shared.queued.notify_all();
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }
}

fn reader_loop(shared: &Shared) {
    loop {
        let job = {
            let mut q = shared.queue.lock().unwrap();
            loop {
                if let Some(job) = q.pop_front() {
                    break job;
                }
                if shared.stop.load(Relaxed) {
                    return;
                }
                q = shared.queued.wait(q).unwrap();
            }
        };
        let p = job.placement;
        let t = Instant::now();
        // SAFETY: the slot is pinned by the set that queued this job and marked loading;
        // nothing else reads or writes this range until the latch completes.
        let buf = unsafe { std::slice::from_raw_parts_mut(shared.slots[job.slot].ptr.add(p.slot_offset), p.read_len) };
        let result = shared.source.read_at(buf, p.read_offset);
        let c = &shared.counters[job.layer];
        c.read_nanos.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        if result.is_ok() {
            c.bytes_read.fetch_add(p.read_len as u64, Relaxed);
            if let Some((packer, _)) = shared.repack.get().filter(|(_, packs)| packs[job.layer][job.proj]) {
                packer.pack(job.layer, job.proj, &mut buf[p.data_skip..p.data_skip + p.data_len]);
            }
        }
        job.latch.complete(result);
    }
}

/// The experts of one `ensure` on a streaming store.
pub(crate) struct PendingSet<'a> {
    store: &'a StreamingExperts,
    layer: usize,
    /// Per asked expert: its id, slot, placements and the latch of its reads.
    entries: Vec<(usize, usize, [Placement; 3], Arc<Latch>)>,
}

impl PendingSet<'_> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_ready(&self, i: usize) -> bool {
        self.entries[i].3.is_done()
    }

    pub fn get(&self, i: usize) -> Result<ExpertBytes<'_>, ExpertError> {
        let (expert, slot, pl, latch) = &self.entries[i];
        if !latch.is_done() {
            let t = Instant::now();
            let r = latch.wait();
            self.store.shared.counters[self.layer].wait_nanos.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            r
        } else {
            latch.wait()
        }
        .map_err(|error| {
            let p = self.store.layout.layers[self.layer].expect("checked at ensure").proj[0];
            ExpertError::Read {
                path: self.store.shared.source.path().to_path_buf(),
                layer: self.layer,
                expert: *expert,
                offset: p.offset(*expert),
                len: self.store.layout.layers[self.layer].expect("checked").expert_bytes(),
                error,
            }
        })?;
        let base = self.store.shared.slots[*slot].ptr;
        // SAFETY: the reads into this slot are complete and the slot stays pinned while `self` lives.
        let part =
            |p: &Placement| unsafe { std::slice::from_raw_parts(base.add(p.slot_offset + p.data_skip), p.data_len) };
        let packed = self.store.shared.repack.get().map_or([false; 3], |(_, packs)| packs[self.layer]);
        Ok(ExpertBytes { gate: part(&pl[0]), up: part(&pl[1]), down: part(&pl[2]), packed })
    }
}

impl Drop for PendingSet<'_> {
    fn drop(&mut self) {
        // A slot must not be unpinned (and so evictable) while a reader still writes into it.
        for e in &self.entries {
            let _ = e.3.wait();
        }
        let slots: Vec<usize> = self.entries.iter().map(|e| e.1).collect();
        self.store.release(&slots);
    }
}

impl ExpertStore for StreamingExperts {
    fn ensure(&self, layer: usize, ids: &[usize]) -> Result<ExpertSet<'_>, ExpertError> {
        let l = *self.layout.check(layer, ids)?;
        let align = self.shared.source.alignment().max(64);
        if ids.len() > self.slots() {
            return Err(ExpertError::CacheTooSmall {
                layer,
                needed: ids.len(),
                slots: self.slots(),
                min_bytes: (ids.len() * self.slot_bytes) as u64,
            });
        }
        let counters = &self.shared.counters[layer];
        let mut jobs = Vec::new();
        let mut entries: Vec<(usize, usize, [Placement; 3], Arc<Latch>)> = Vec::with_capacity(ids.len());
        // Slots this call takes for misses, to undo if it must refuse.
        let mut taken: Vec<usize> = Vec::new();
        // Prefetched slots still being read cannot be evicted yet: when they are all that
        // stands in the way, this call undoes itself, waits for them and tries again.
        let (hits, misses) = 'retry: loop {
            let mut st = self.state.lock().unwrap();
            let (mut hits, mut misses) = (0, 0);
            st.cache.tick();
            for &e in ids {
                let pl = placements(&l, e, align);
                let slot = match st.cache.lookup(layer, e) {
                    // A slot whose reads failed (a prefetch: no set held it to forget it) is read
                    // again, unless a set still holds it and will report the error itself.
                    Some(s) if !st.cache.pinned(s) && st.failed(s) => {
                        misses += 1;
                        taken.push(s);
                        jobs.extend(assign(&mut st, s, layer, e, &pl));
                        s
                    }
                    Some(s) => {
                        hits += 1;
                        s
                    }
                    None => {
                        misses += 1;
                        let Some(s) = self.claim(&mut st, layer, e, &pl, &mut jobs) else {
                            // No slot can take it: undo this call (its reads were not queued yet).
                            for &(_, slot, _, _) in &entries {
                                st.cache.unpin(slot);
                            }
                            for &slot in &taken {
                                st.cache.forget(slot);
                                st.latch[slot] = None;
                            }
                            entries.clear();
                            taken.clear();
                            jobs.clear();
                            let filling: Vec<Arc<Latch>> = (0..self.slots())
                                .filter(|&s| !st.cache.pinned(s))
                                .filter_map(|s| st.latch[s].clone().filter(|l| !l.is_done()))
                                .collect();
                            drop(st);
                            if !filling.is_empty() {
                                // A failed prefetch is read again when it is asked for.
                                for l in filling {
                                    let _ = l.wait();
                                }
                                continue 'retry;
                            }
                            return Err(ExpertError::CacheTooSmall {
                                layer,
                                needed: ids.len(),
                                slots: self.slots(),
                                min_bytes: (ids.len() * self.slot_bytes) as u64,
                            });
                        };
                        taken.push(s);
                        s
                    }
                };
                st.cache.pin(slot);
                st.cache.touch(slot);
                let latch = st.latch[slot].clone().expect("a cached slot has a latch");
                entries.push((e, slot, pl, latch));
            }
            break (hits, misses);
        };
        counters.hits.fetch_add(hits, Relaxed);
        counters.misses.fetch_add(misses, Relaxed);
        self.submit(jobs);
        Ok(ExpertSet { inner: SetInner::Streamed(PendingSet { store: self, layer, entries }) })
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        let Ok(l) = self.layout.check(layer, ids).copied() else { return };
        let align = self.shared.source.alignment().max(64);
        let mut jobs = Vec::new();
        {
            let mut st = self.state.lock().unwrap();
            for &e in ids {
                if st.cache.lookup(layer, e).is_some() {
                    continue;
                }
                if self.claim(&mut st, layer, e, &placements(&l, e, align), &mut jobs).is_none() {
                    break;
                }
                self.shared.counters[layer].prefetched.fetch_add(1, Relaxed);
            }
        }
        self.submit(jobs);
    }

    /// Matrices are repacked by the reader that reads them; slots read before are dropped.
    fn pack(&mut self, pack: Packer) -> usize {
        let packs: Vec<[bool; 3]> = (0..self.layout.layers.len())
            .map(|layer| std::array::from_fn(|p| self.layout.layers[layer].is_some() && pack.packs(layer, p, true)))
            .collect();
        let count = self
            .layout
            .layers
            .iter()
            .zip(&packs)
            .map(|(l, p)| l.map_or(0, |l| l.n_expert * p.iter().filter(|&&b| b).count()));
        let count: usize = count.sum();
        if count == 0 || self.shared.repack.set((pack, packs)).is_err() {
            return 0;
        }
        // `&mut self`: no set holds a slot; reads still running finish (and may pack) first.
        let mut st = self.state.lock().unwrap();
        for s in 0..self.slots() {
            if let Some(latch) = st.latch[s].take() {
                let _ = latch.wait();
            }
            st.cache.forget(s);
        }
        count
    }

    fn kind(&self) -> &'static str {
        "stream"
    }

    fn capacity(&self) -> usize {
        self.slots()
    }

    fn stats(&self) -> Option<StatsSnapshot> {
        Some(StatsSnapshot {
            layers: self.shared.counters.iter().map(LayerCounters::snapshot).collect(),
            slots: self.slots(),
            slot_bytes: self.slot_bytes,
            source: if self.direct_io() { "O_DIRECT reads" } else { "buffered reads (O_DIRECT unavailable or off)" },
            measures_wait: true,
            policy: self.policy.name(),
        })
    }

    fn resident_bytes(&self) -> u64 {
        (self.slots() * self.slot_bytes) as u64
    }
}
