//! A forward step on the device: its row buffers (tokens, positions, each
//! layer's cache pointers, the recurrent layers' runs), the activation arena of
//! one-row steps, and their recording as a CUDA graph replayed on later steps
//! (whose ops the model then does not call); kernel launches go through here.

use crate::device::Arg;
use crate::host_timing::Phase;
use crate::recurrent::DELTA_CHUNK;
use crate::{Act, Cuda, GpuLayerState, GpuScratch, GpuState, err};
use cudarc::driver::CudaSlice;
use ts_model::{ModelError, Row, SeqState, StepStart};

/// Per forward step, in buffers that keep their addresses from step to step:
/// each row's token and position, and per layer each row's cache (`RowKv` of
/// ops.cu: k pointer, v pointer, slots | pos << 32).
pub(crate) struct Step {
    pub(crate) m: usize,
    pub(crate) tokens_host: Vec<u32>,
    pub(crate) tokens: CudaSlice<i32>,
    pub(crate) pos: CudaSlice<i32>,
    pub(crate) kv: CudaSlice<u64>,
    /// For recurrent layers: the rows grouped by sequence (`run_rows`), and per
    /// run `RunInfo` of delta_net.cu (start, len, fresh, first chunk); `n_runs`
    /// of them, `n_chunks` chunks of `DELTA_CHUNK` rows in all, the longest run
    /// `longest` rows.
    pub(crate) run_rows: CudaSlice<i32>,
    pub(crate) runs: CudaSlice<i32>,
    pub(crate) n_runs: usize,
    pub(crate) n_chunks: usize,
    pub(crate) longest: usize,
    /// Per layer, the most cache slots any row's sequence has there (0: no cache).
    pub(crate) slots: Vec<usize>,
}

/// A recurrent layer's view of the step: device addresses of its rows' `RowKv`s,
/// the rows grouped by sequence and the `RunInfo`s, and the runs' counts.
#[derive(Clone, Copy)]
pub(crate) struct Runs {
    pub(crate) info: u64,
    pub(crate) rows: u64,
    pub(crate) runs: u64,
    pub(crate) n: usize,
    pub(crate) n_chunks: usize,
    pub(crate) longest: usize,
}

/// Bytes of the arena recorded steps allocate their activations from.
pub(crate) const ARENA_BYTES: usize = 256 << 20;

/// Rows the step buffers hold from the first step on, at least (and as many as the sequences
/// made so far may take in a step, `Cuda::largest_chunk`): a step of more rows moves them, and
/// every recording made against them is dropped (on the H200 the fixtures' prompts of 33 rows
/// and more dropped what `Engine::warm_up_steps` had recorded). A few KiB a layer.
pub(crate) const STEP_ROWS_RESERVED: usize = 512;

/// The most rows of a recorded step: below cuBLAS's (whose staging is not in the arena).
pub(crate) const GRAPH_MAX_ROWS: usize = crate::matmul::GEMM_MIN_ROWS - 1;

/// How launches are treated during a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Mode {
    /// Launched as they come.
    Direct = 0,
    /// Recorded into a CUDA graph (the first single-row step).
    Capture = 1,
}

/// What a recorded step's launches depend on beyond the device data they read (tokens,
/// positions, cache addresses, which the step uploads first): its row count, which rows share
/// a sequence (each row the index of its sequence's first row: prompt attention and the
/// recurrent layers' runs), whether the rows want logits, exact activations, and per layer
/// the most cache slots (decode attention's split).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct StepKey {
    m: usize,
    sequences: Vec<u32>,
    logits: bool,
    exact: bool,
    slots: Vec<usize>,
}

/// What is known of a kind of step.
pub(crate) enum Recording {
    /// A step of several rows ran once directly, its activations in the arena, to see that
    /// they fit there and that it made no host transfer; recorded on its next occurrence if so.
    Measured { fits: bool },
    /// Recorded: replayed from now on; where it leaves its logits (arena address, length).
    Graph { graph: SendGraph, logits: Option<(u64, usize)> },
}

/// Steps recorded once and replayed: one launch instead of hundreds. One-row steps are
/// recorded at their first occurrence; steps of up to [`GRAPH_MAX_ROWS`] rows (several
/// sequences decoding, a draft's verification) at their second, after a measured run.
pub(crate) struct Graphs {
    pub(crate) arena: CudaSlice<u8>,
    pub(crate) arena_used: usize,
    pub(crate) arena_on: bool,
    /// The current step measures its arena use: past the arena, it allocates instead.
    pub(crate) measuring: bool,
    /// The measured step outgrew the arena.
    pub(crate) overflowed: bool,
    /// The device's transfer count when the measured step began.
    pub(crate) transfers_at_start: u64,
    pub(crate) recorded: std::collections::HashMap<StepKey, Recording>,
    /// The kind of the step being recorded or measured.
    pub(crate) current: Option<StepKey>,
    /// Steps run from a recording so far (its first launch included).
    pub(crate) replays: u64,
    /// Steps run to be measured or recorded so far ([`ts_model::Backend::warm_ups`]).
    pub(crate) warm_ups: u64,
    /// `TURBOSPARK_STEP_TIMING`: a measurement knob timing each replay on the device.
    pub(crate) timing: Option<ReplayTiming>,
}

/// Where a replayed step's time goes: the host's launch call, the graph on the
/// device between events around it, and the same graph replayed back to back.
pub(crate) struct ReplayTiming {
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
    pending: bool,
    replays: u64,
    host_launch_s: f64,
    device_ms: f64,
}

impl ReplayTiming {
    pub(crate) fn new(gpu: &crate::device::Gpu) -> Option<ReplayTiming> {
        std::env::var_os("TURBOSPARK_STEP_TIMING")?;
        let event = || gpu.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).ok();
        Some(ReplayTiming {
            start: event()?,
            end: event()?,
            pending: false,
            replays: 0,
            host_launch_s: 0.0,
            device_ms: 0.0,
        })
    }

    /// Launches `graph` between the two events; every 64 replays prints the means, and at
    /// the 32nd also times 16 replays back to back (a one-row step is idempotent).
    fn launch(
        &mut self,
        graph: &cudarc::driver::CudaGraph,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<(), ModelError> {
        let e = |e: cudarc::driver::DriverError| err(e.into());
        if self.pending {
            self.device_ms += self.start.elapsed_ms(&self.end).map_err(e)? as f64;
            self.replays += 1;
        }
        if self.replays == 32 && self.pending {
            self.start.record(stream).map_err(e)?;
            for _ in 0..16 {
                graph.launch().map_err(e)?;
            }
            self.end.record(stream).map_err(e)?;
            let ms = self.start.elapsed_ms(&self.end).map_err(e)? / 16.0;
            let mut nodes = 0usize;
            unsafe { cudarc::driver::sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut nodes) };
            eprintln!("step timing: {nodes} graph nodes; 16 replays back to back {ms:.3} ms each");
        }
        self.start.record(stream).map_err(e)?;
        let t = std::time::Instant::now();
        graph.launch().map_err(e)?;
        self.host_launch_s += t.elapsed().as_secs_f64();
        self.end.record(stream).map_err(e)?;
        self.pending = true;
        if self.replays > 0 && self.replays.is_multiple_of(64) {
            let n = self.replays as f64;
            eprintln!(
                "step timing: {} replays, host launch call {:.1} us, graph on the device {:.3} ms",
                self.replays,
                self.host_launch_s / (n + 1.0) * 1e6,
                self.device_ms / n
            );
        }
        Ok(())
    }
}

pub(crate) struct SendGraph(cudarc::driver::CudaGraph);

// SAFETY: used only under the `Graphs` mutex, on the backend's one stream.
unsafe impl Send for SendGraph {}
unsafe impl Sync for SendGraph {}

impl Cuda {
    /// `len` 4-byte elements: from the step arena when it is on, else a new allocation.
    pub(crate) fn act(&self, len: usize) -> Result<Act, ModelError> {
        let mut g = self.graphs.lock().expect("graph lock");
        if g.arena_on {
            let bytes = (len * 4).div_ceil(256) * 256;
            if g.arena_used + bytes <= ARENA_BYTES {
                let ptr = self.gpu.ptr(&g.arena) + g.arena_used as u64;
                g.arena_used += bytes;
                return Ok(Act { ptr, len, _own: None });
            }
            if !g.measuring {
                return Err(ModelError::Compute(format!(
                    "cuda: a recorded step needs more than the {} MiB activation arena",
                    ARENA_BYTES >> 20
                )));
            }
            // The rest of a measured step allocates; it will not be recorded.
            g.overflowed = true;
            g.arena_on = false;
        }
        drop(g);
        let buf = self.gpu.alloc::<f32>(len).map_err(err)?;
        Ok(Act { ptr: self.gpu.ptr(&buf), len, _own: Some(buf) })
    }

    /// `len` zeros ([`Cuda::act`]).
    pub(crate) fn zeros(&self, len: usize) -> Result<Act, ModelError> {
        let a = self.act(len)?;
        self.launch_1d("fill", len, &[Arg::Ptr(a.ptr), Arg::F32(0.0), Arg::I64(len as i64)])?;
        Ok(a)
    }

    fn mode(&self) -> Mode {
        match self.mode.load(std::sync::atomic::Ordering::Relaxed) {
            1 => Mode::Capture,
            _ => Mode::Direct,
        }
    }

    fn set_mode(&self, m: Mode) {
        self.mode.store(m as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// Launches kernel `name`.
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[Arg],
    ) -> Result<(), ModelError> {
        self.wrote();
        self.host_timing.time(Phase::Launch, || self.gpu.launch(name, grid, block, 0, args)).map_err(err)
    }

    /// Runs `work(i)` for each i < `n`, spreading the launches of each over the device's
    /// streams (`Gpu::branches`): each side stream starts after what the main stream has
    /// queued, and the main stream then waits for all of them, so independent launches (the
    /// projections of one input) overlap on the device, also in a recorded step's graph.
    /// `work` may only launch kernels (no copies, no cuBLAS: those stay on the main stream).
    pub(crate) fn branches<T>(
        &self,
        n: usize,
        mut work: impl FnMut(usize) -> Result<T, ModelError>,
    ) -> Result<Vec<T>, ModelError> {
        let used = n.min(self.gpu.branches);
        for i in 1..used {
            self.gpu.fork(i).map_err(err)?;
        }
        let mut out = Vec::with_capacity(n);
        let mut result = Ok(());
        for i in 0..n {
            self.gpu.launch_on(i % used);
            match work(i) {
                Ok(v) => out.push(v),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.gpu.launch_on(0);
        for i in 1..used {
            self.gpu.join(i).map_err(err)?;
        }
        result.map(|()| out)
    }

    /// Notes a write to device memory (see `writes`).
    pub(crate) fn wrote(&self) {
        self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// [`Gpu::launch_with`](device::Gpu::launch_with): a kernel whose parameter is one struct.
    pub(crate) fn launch_with<P: Copy>(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        params: &P,
    ) -> Result<(), ModelError> {
        self.wrote();
        self.host_timing.time(Phase::Launch, || self.gpu.launch_with(name, grid, block, params)).map_err(err)
    }

    pub(crate) fn launch_1d(&self, name: &str, n: usize, args: &[Arg]) -> Result<(), ModelError> {
        self.wrote();
        self.host_timing.time(Phase::Launch, || self.gpu.launch_1d(name, n, args)).map_err(err)
    }

    /// Ends a capture a failed step left open, dropping what it recorded; that kind of step
    /// then runs directly.
    fn abandon_capture(&self, g: &mut Graphs) {
        if self.mode() == Mode::Capture {
            let _ = self.gpu.stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            if let Some(key) = g.current.take() {
                g.recorded.insert(key, Recording::Measured { fits: false });
            }
        }
        self.set_mode(Mode::Direct);
    }

    /// The current step's per-row state of layer `il` (`RowKv`s), its rows grouped
    /// by sequence and the runs (`RunInfo`s): device addresses, and the run count.
    pub(crate) fn runs_of(&self, il: usize, rows: &[Row]) -> Result<Runs, ModelError> {
        let step = self.step.lock().expect("step lock");
        let st = step
            .as_ref()
            .filter(|s| s.m == rows.len() && s.n_runs > 0)
            .ok_or_else(|| ModelError::Compute("cuda: a recurrent layer outside a step".into()))?;
        Ok(Runs {
            info: self.gpu.ptr(&st.kv) + (il * rows.len() * 24) as u64,
            rows: self.gpu.ptr(&st.run_rows),
            runs: self.gpu.ptr(&st.runs),
            n: st.n_runs,
            n_chunks: st.n_chunks,
            longest: st.longest,
        })
    }

    /// [`ts_model::Backend::begin_step`]: a one-row step recorded before is replayed here.
    pub(crate) fn start_step(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<GpuState>],
        scratch: &GpuScratch,
        replayable: bool,
    ) -> Result<StepStart<Act>, ModelError> {
        self.host_timing.step_begins();
        let inputs_from = self.host_timing.mark();
        self.wrote();
        // Drops the last step's quantized activations here, not inside a capture (a buffer
        // of a many-row step freed while recording is an invalid graph).
        self.q8_last.lock().expect("q8 lock").take();
        let mut g = self.graphs.lock().expect("graph lock");
        self.abandon_capture(&mut g);
        let m = rows.len();
        self.step_rows.store(m, std::sync::atomic::Ordering::Relaxed);
        let n_layer = seqs.first().map_or(0, |s| s.state.layers.len());
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let pos: Vec<i32> = rows.iter().map(|r| r.pos as i32).collect();
        let mut kv = Vec::with_capacity(n_layer * m * 3);
        let mut layer_slots = vec![0; n_layer];
        for il in 0..n_layer {
            for r in rows {
                let layers = &seqs[r.seq].state.layers;
                // A layer sharing another's keys and values reads (and stores nothing into) its cache.
                let own = match &layers[il] {
                    GpuLayerState::SharedKv(from) => &layers[*from],
                    other => other,
                };
                kv.extend(match own {
                    GpuLayerState::Kv { k, v, slots } => {
                        layer_slots[il] = layer_slots[il].max(*slots);
                        [self.gpu.ptr(k), self.gpu.ptr(v), *slots as u64 | (r.pos as u64) << 32]
                    }
                    GpuLayerState::SharedKv(_) => [0, 0, (r.pos as u64) << 32],
                    GpuLayerState::Recurrent { conv, ssm } => {
                        [self.gpu.ptr(conv), self.gpu.ptr(ssm), (r.pos as u64) << 32]
                    }
                });
            }
        }
        // Recurrent layers read each sequence's rows in order, as runs.
        let recurrent =
            seqs.first().is_some_and(|s| s.state.layers.iter().any(|l| matches!(l, GpuLayerState::Recurrent { .. })));
        let (mut run_rows, mut runs) = (Vec::new(), Vec::new());
        let (mut n_chunks, mut longest) = (0, 0);
        if recurrent {
            for run in ts_model::state::sequence_runs(rows, seqs)? {
                let len = run.rows.len();
                runs.extend([run_rows.len() as i32, len as i32, run.fresh as i32, n_chunks as i32]);
                run_rows.extend(run.rows.iter().map(|&i| i as i32));
                n_chunks += len.div_ceil(DELTA_CHUNK);
                longest = longest.max(len);
            }
        }
        let mut step = self.step.lock().expect("step lock");
        // The buffers keep their addresses while they are large enough; a graph
        // recorded against older ones is dropped when they move.
        let fits = step.as_ref().is_some_and(|s| s.tokens.len() >= m && s.kv.len() >= kv.len().max(1));
        if !fits {
            // Room for every recorded size at once: growing batches keep their recordings.
            let cap = m.max(STEP_ROWS_RESERVED).max(self.largest_chunk.load(std::sync::atomic::Ordering::Relaxed));
            *step = Some(Step {
                m,
                tokens_host: Vec::new(),
                tokens: self.gpu.alloc(cap).map_err(err)?,
                pos: self.gpu.alloc(cap).map_err(err)?,
                kv: self.gpu.alloc((n_layer * cap * 3).max(1)).map_err(err)?,
                run_rows: self.gpu.alloc(cap).map_err(err)?,
                runs: self.gpu.alloc(4 * cap).map_err(err)?,
                n_runs: 0,
                n_chunks: 0,
                longest: 0,
                slots: Vec::new(),
            });
            g.recorded.clear();
        }
        let st = step.as_mut().expect("step buffers");
        st.m = m;
        st.n_runs = runs.len() / 4;
        st.n_chunks = n_chunks;
        st.longest = longest;
        st.slots = layer_slots;
        st.tokens_host = tokens.clone();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let stream = self.gpu.stream.cu_stream();
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.gpu.ptr(&st.tokens), &ids, stream)
                .and_then(|()| cudarc::driver::result::memcpy_htod_async(self.gpu.ptr(&st.pos), &pos, stream))
                .and_then(|()| cudarc::driver::result::memcpy_htod_async(self.gpu.ptr(&st.kv), &kv, stream))
                .and_then(|()| match recurrent {
                    true => cudarc::driver::result::memcpy_htod_async(self.gpu.ptr(&st.run_rows), &run_rows, stream)
                        .and_then(|()| {
                            cudarc::driver::result::memcpy_htod_async(self.gpu.ptr(&st.runs), &runs, stream)
                        }),
                    false => Ok(()),
                })
        }
        .map_err(|e| err(e.into()))?;
        self.host_timing.add(Phase::StepInputs, inputs_from);
        // Pageable copies return once the bytes are staged; the kernels after them see them in order.
        g.arena_used = 0;
        g.arena_on = m == 1;
        (g.measuring, g.overflowed, g.current) = (false, false, None);
        // A step that must run its ops (hidden states handed back, the MTP head) is neither
        // replayed nor recorded.
        let key = self.step_key(rows, scratch.exact, &st.slots).filter(|_| replayable);
        drop(step);
        let Some(key) = key else { return Ok(StepStart::Run) };
        let g = &mut *g;
        match g.recorded.get(&key) {
            Some(Recording::Graph { graph, logits }) => {
                self.host_timing.time(Phase::Launch, || match &mut g.timing {
                    Some(t) => t.launch(&graph.0, &self.gpu.stream),
                    None => graph.0.launch().map_err(|e| err(e.into())),
                })?;
                g.replays += 1;
                g.arena_on = false;
                let logits = logits.map(|(ptr, len)| Act { ptr, len, _own: None });
                Ok(StepStart::Replayed { logits })
            }
            Some(Recording::Measured { fits: false }) => {
                g.arena_on = false;
                Ok(StepStart::Run)
            }
            None if m > 1 => {
                // Run directly once, on the arena, watching for overflow and host transfers.
                g.arena_on = true;
                g.measuring = true;
                g.warm_ups += 1;
                g.transfers_at_start = self.gpu.transfers.load(std::sync::atomic::Ordering::Relaxed);
                g.current = Some(key);
                Ok(StepStart::Run)
            }
            _ => {
                g.arena_on = true;
                g.current = Some(key);
                g.warm_ups += 1;
                self.gpu
                    .stream
                    .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(|e| err(e.into()))?;
                self.set_mode(Mode::Capture);
                Ok(StepStart::Run)
            }
        }
    }

    /// The kind of step `rows` are, if such steps can be recorded: graphs on, no expert
    /// cache (its copies and slot lookups are host work), at most [`GRAPH_MAX_ROWS`] rows, and
    /// every row or none wanting logits (choosing some is an upload).
    fn step_key(&self, rows: &[Row], exact: bool, slots: &[usize]) -> Option<StepKey> {
        let m = rows.len();
        let logits = rows.first()?.logits;
        if !self.use_graphs || self.tier.is_some() || m > GRAPH_MAX_ROWS || rows.iter().any(|r| r.logits != logits) {
            return None;
        }
        let sequences = rows.iter().map(|r| rows.iter().position(|o| o.seq == r.seq).unwrap_or(0) as u32).collect();
        Some(StepKey { m, sequences, logits, exact, slots: slots.to_vec() })
    }

    /// Steps run from a recorded graph so far (tests: that recording happened).
    pub fn graph_replays(&self) -> u64 {
        self.graphs.lock().expect("graph lock").replays
    }

    /// [`ts_model::Backend::end_step`]: a recorded step's graph is launched here.
    pub(crate) fn finish_step(&self, logits: Option<&Act>) -> Result<(), ModelError> {
        let mut g = self.graphs.lock().expect("graph lock");
        let mode = self.mode();
        self.set_mode(Mode::Direct);
        match mode {
            Mode::Capture => {
                let key = g.current.take();
                let graph = self
                    .gpu
                    .stream
                    .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
                    .map_err(|e| err(e.into()))
                    .and_then(|g| g.ok_or_else(|| ModelError::Compute("cuda: the step recorded no work".into())))
                    .and_then(|graph| graph.launch().map_err(|e| err(e.into())).map(|()| graph));
                match (graph, key) {
                    (Ok(graph), Some(key)) => {
                        let logits = logits.map(|l| (l.ptr, l.len));
                        g.recorded.insert(key, Recording::Graph { graph: SendGraph(graph), logits });
                        g.replays += 1;
                    }
                    (Ok(_), None) => {}
                    (Err(e), key) => {
                        // That kind of step runs directly from now on.
                        if let Some(key) = key {
                            g.recorded.insert(key, Recording::Measured { fits: false });
                        }
                        (g.arena_on, g.measuring) = (false, false);
                        return Err(e);
                    }
                }
            }
            Mode::Direct => {
                if g.measuring
                    && let Some(key) = g.current.take()
                {
                    let transfers = self.gpu.transfers.load(std::sync::atomic::Ordering::Relaxed);
                    let fits = !g.overflowed && transfers == g.transfers_at_start;
                    g.recorded.insert(key, Recording::Measured { fits });
                }
            }
        }
        (g.arena_on, g.measuring, g.current) = (false, false, None);
        Ok(())
    }
}
