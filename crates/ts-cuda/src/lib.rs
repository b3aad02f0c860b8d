//! The CUDA backend: every op of [`ts_model::Backend`] on an NVIDIA GPU.
//!
//! cudarc loads the driver, NVRTC and cuBLAS at run time, so this crate builds
//! and the CPU path runs on machines without CUDA; asking for the GPU there is
//! a clear error. Kernels (`kernels/*.cu`) are compiled once per process by
//! NVRTC for the device's architecture. Weights are uploaded at open in their
//! GGUF block layouts and read directly by the matvec kernels; prefill of 32
//! rows or more dequantizes a weight to f16 and multiplies on the tensor cores
//! with cuBLAS.
//!
//! By role: `device` (context, NVRTC, launches), `step` (a step's buffers, the
//! arena, CUDA graphs, every launch), `matmul` and `matvec_q8` (dense matmuls),
//! `attention` (KV caches, rope, attention), `recurrent` (DeltaNet layers),
//! `moe` (routing and the expert matmuls), `tier` (the VRAM expert cache); `weights` (the
//! model's weights on the device), `norm` (RMS norms); this file holds the backend and the
//! small ops.

mod attention;
pub mod device;
mod host_experts;
pub(crate) mod host_timing;
mod matmul;
mod matvec_q8;
mod moe;
mod moe_mm;
mod norm;
mod recurrent;
mod step;
pub mod tier;
mod weights;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, PinnedHostSlice};
use device::{Arg, CudaError, Gpu};
use moe::{GpuExpertGroup, GpuRoutes, activation_args};
use norm::{NormRows, PairSum};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Mutex;
use step::{ARENA_BYTES, Graphs, Mode, Step};
use tier::{ExpertTier, MissPath};
use ts_cpu::ops::Rope;
use ts_gguf::GgmlType;
use ts_model::backend::ExpertsAt;
use ts_model::backend::{AttnShape, HeadNorm};
use ts_model::config::{AttnLayer, GatedActivation, Mixer, MoeConfig};
use ts_model::tensors::MoeWeights;
use ts_model::weights::Weight;
use ts_model::{Backend, Model, ModelError, Row, SeqState, StepStart};

pub use device::CudaError as Error;
pub use matmul::Matmul;
pub use matvec_q8::q8_suffix;

/// The kernel-name suffix of a weight type the GPU reads directly.
pub fn type_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::MXFP4 => "mxfp4",
        _ => return None,
    })
}

pub(crate) fn err(e: CudaError) -> ModelError {
    ModelError::Compute(e.to_string())
}

/// `[m][width]` f32 (or, for routes, i32) on the device: its own allocation, or
/// a piece of the step arena (decode steps, so that a captured graph's
/// addresses hold on replay).
pub struct Act {
    ptr: u64,
    len: usize,
    _own: Option<CudaSlice<f32>>,
}

/// One layer's state of one sequence on the device, of the layer's kind.
pub enum GpuLayerState {
    /// Keys `[slots][kv_dim]`, values `[slots][v_dim]` and the ring size.
    Kv { k: CudaSlice<f32>, v: CudaSlice<f32>, slots: usize },
    /// An attention layer that reads the keys and values of layer `.0`.
    SharedKv(usize),
    /// A linear-attention layer's convolution window `[conv_kernel - 1][conv_dim]`
    /// and recurrent matrices `[n_v_heads][d_k][d_v]`.
    Recurrent { conv: CudaSlice<f32>, ssm: CudaSlice<f32> },
}

/// One sequence's state on the device, per layer.
pub struct GpuState {
    layers: Vec<GpuLayerState>,
}

/// A device copy of a sequence's recurrent layers' state.
pub struct GpuRecurrent {
    layers: Vec<(CudaSlice<f32>, CudaSlice<f32>)>,
}

/// Buffers reused across steps.
#[derive(Default)]
pub struct GpuScratch {
    /// Multiply in f32 throughout (no f16 tensor-core prefill, no 8-bit activations).
    exact: bool,
}

pub struct Cuda {
    gpu: Gpu,
    /// Device copies of the model's weights by the host address of their first
    /// byte; a weight inside an uploaded range (half of a fused tensor) uses it.
    weights: BTreeMap<usize, CudaSlice<u8>>,
    /// Device copies of norm weights, biases and other f32 vectors, by host address.
    vectors: HashMap<usize, CudaSlice<f32>>,
    /// Per layer: rotary frequencies (attention layers) and sliding window (0 = none).
    ropes: Vec<Option<CudaSlice<f32>>>,
    windows: Vec<i32>,
    step: Mutex<Option<Step>>,
    graphs: Mutex<Graphs>,
    /// The current step's `Mode`, read on every launch (no lock on that path).
    mode: std::sync::atomic::AtomicU8,
    /// Replay single-row steps from a CUDA graph (off when the expert tier needs the host mid-step).
    pub use_graphs: bool,
    /// Activation rows one dense 8-bit matvec launch serves at most (all of a step's, or
    /// `TURBOSPARK_Q8_LAUNCH_ROWS`: a measurement knob for steps of 9-31 rows).
    pub(crate) q8_launch_rows: usize,
    /// Steps of this many rows and more take the dense 8-bit matvec in passes of up to 8 rows
    /// ([`matvec_q8::WIDE_MIN_ROWS`], or `TURBOSPARK_Q8_WIDE_ROWS`: a measurement knob; with
    /// 32 and `TURBOSPARK_Q8_LAUNCH_ROWS=8`, earlier builds' two-row passes, 8 rows a launch).
    pub(crate) q8_wide_rows: usize,
    /// The most rows a step of any sequence made so far may take (`new_state`'s `max_chunk`):
    /// the step buffers hold as many from the first step on ([`step::STEP_ROWS_RESERVED`]).
    pub(crate) largest_chunk: std::sync::atomic::AtomicUsize,
    blas: Option<CudaBlas>,
    /// f16 staging for cuBLAS: a dequantized weight and the activations.
    half: Mutex<(CudaSlice<u16>, CudaSlice<u16>)>,
    /// Bytes of weights on the device.
    pub weight_bytes: usize,
    /// A VRAM cache of experts over a host tier, when they do not all live on the device.
    tier: Option<Mutex<ExpertTier>>,
    /// Groups of experts handed out since the compute stream was last waited for.
    groups_since_sync: std::sync::atomic::AtomicUsize,
    /// Counts the writes to device memory (launches and copies) other than the
    /// 8-bit matvecs', so that [`Cuda::quantized`] can reuse activations quantized
    /// for the previous matvec (q, k and v of one input) while nothing has written since.
    writes: std::sync::atomic::AtomicU64,
    /// The activations the last 8-bit matvec quantized.
    q8_last: Mutex<Option<matvec_q8::Q8Cached>>,
    /// Page-locked host bytes that downloads land in (a step's logits each decode step):
    /// a copy from pageable memory is staged by the driver, slower and allocated anew.
    staging: Mutex<Option<PinnedHostSlice<u8>>>,
    /// Experts of a MoE layer (0 for a dense model).
    n_expert: usize,
    /// `router_route`'s finished blocks per row, `[DEVICE_MOE_ROWS]`, zero between launches.
    route_done: CudaSlice<i32>,
    /// Decode attention's finished runs per (row, head), `[attention::SPLIT_COUNTERS]`, zero
    /// between launches.
    attn_done: CudaSlice<u32>,
    /// Positions a row sees from which a decode attention block takes several query heads
    /// (`device::attention_group_from`; tests set it).
    attn_group_from: usize,
    /// `TURBOSPARK_HOST_TIMING`: the host's time per step by what it was doing.
    host_timing: host_timing::HostTiming,
    /// Rows of the step being run (decode steps may leave cache misses to the CPU).
    step_rows: std::sync::atomic::AtomicUsize,
    /// Buffers of the experts the CPU computes, made at the first such layer.
    host_experts: Mutex<Option<host_experts::HostExperts>>,
}

/// How to place a model on the GPU.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// VRAM for routed experts; `None`: every expert on the device.
    pub expert_cache: Option<u64>,
    pub policy: ts_experts::EvictionPolicy,
    /// Keep a page-locked copy of every expert in host RAM (else copy from the model's expert
    /// store: mapped, or streamed from disk into a RAM cache).
    pub pinned_host: bool,
    /// Where a decode step's cache misses are computed.
    pub misses: MissPath,
    /// With misses computed on the CPU, keep the pinned copy's MXFP4 experts in the CPU's
    /// packed layout (its faster one-row kernels), each copy into a slot put back into GGUF
    /// rows on the device (`TURBOSPARK_TIER_PACKED_HOST=1`, a measurement setting until a
    /// lease compares it).
    pub packed_host: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            expert_cache: None,
            policy: ts_experts::EvictionPolicy::DecayedFrequency { half_life: 256.0 },
            pinned_host: true,
            misses: MissPath::Auto,
            packed_host: false,
        }
    }
}

impl Cuda {
    /// Opens device `ordinal` and uploads every weight of `model`.
    pub fn new(ordinal: usize, model: &Model) -> Result<Cuda, ModelError> {
        Cuda::with_options(ordinal, model, &CudaOptions::default())
    }

    /// Opens device `ordinal` and places `model` as `opts` asks.
    pub fn with_options(ordinal: usize, model: &Model, opts: &CudaOptions) -> Result<Cuda, ModelError> {
        let mut me = Cuda::open(ordinal)?;
        if let Some(bytes) = opts.expert_cache {
            let tier = ExpertTier::new(&me.gpu, model, bytes, opts)?;
            me.tier = Some(Mutex::new(tier));
        }
        me.upload_model(model)?;
        Ok(me)
    }

    /// Counters of the VRAM expert cache, when there is one.
    pub fn tier_stats(&self) -> Option<ts_experts::StatsSnapshot> {
        self.tier.as_ref().map(|t| t.lock().expect("expert tier lock").stats())
    }

    /// Opens device `ordinal` with no weights on it yet.
    pub fn open(ordinal: usize) -> Result<Cuda, ModelError> {
        let gpu = Gpu::open(ordinal).map_err(err)?;
        let blas = device::guard("loading cuBLAS", || CudaBlas::new(gpu.stream.clone())).ok().and_then(|r| r.ok());
        let arena = gpu.alloc(ARENA_BYTES).map_err(err)?;
        let timing = step::ReplayTiming::new(&gpu);
        Ok(Cuda {
            half: Mutex::new((gpu.alloc(1).map_err(err)?, gpu.alloc(1).map_err(err)?)),
            route_done: gpu.zeros(moe::DEVICE_MOE_ROWS).map_err(err)?,
            attn_done: gpu.zeros(attention::SPLIT_COUNTERS).map_err(err)?,
            attn_group_from: device::attention_group_from(),
            gpu,
            weights: BTreeMap::new(),
            vectors: HashMap::new(),
            ropes: Vec::new(),
            windows: Vec::new(),
            step: Mutex::new(None),
            graphs: Mutex::new(Graphs {
                arena,
                arena_used: 0,
                arena_on: false,
                measuring: false,
                overflowed: false,
                transfers_at_start: 0,
                recorded: Default::default(),
                current: None,
                replays: 0,
                warm_ups: 0,
                timing,
            }),
            mode: std::sync::atomic::AtomicU8::new(Mode::Direct as u8),
            use_graphs: std::env::var_os("TURBOSPARK_NO_CUDA_GRAPHS").is_none(),
            q8_launch_rows: std::env::var("TURBOSPARK_Q8_LAUNCH_ROWS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&r| r > 0)
                .unwrap_or(usize::MAX),
            q8_wide_rows: std::env::var("TURBOSPARK_Q8_WIDE_ROWS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&r| r > 1)
                .unwrap_or(matvec_q8::WIDE_MIN_ROWS),
            largest_chunk: std::sync::atomic::AtomicUsize::new(0),
            blas,
            weight_bytes: 0,
            tier: None,
            groups_since_sync: std::sync::atomic::AtomicUsize::new(0),
            writes: std::sync::atomic::AtomicU64::new(0),
            q8_last: Mutex::new(None),
            staging: Mutex::new(None),
            n_expert: 0,
            host_timing: host_timing::HostTiming::from_env(),
            step_rows: std::sync::atomic::AtomicUsize::new(0),
            host_experts: Mutex::new(None),
        })
    }

    /// The device, in words: name, compute capability, memory.
    pub fn describe(&self) -> String {
        let (free, total) = self.gpu.mem_info().unwrap_or((0, 0));
        format!(
            "{} (sm_{}{}), {:.1} GiB weights on the device, {:.1} of {:.1} GiB free{}",
            self.gpu.name,
            self.gpu.arch.0,
            self.gpu.arch.1,
            self.weight_bytes as f64 / (1u64 << 30) as f64,
            free as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64,
            if self.blas.is_some() { "" } else { "; cuBLAS not found, prefill uses the matvec kernels" }
        )
    }

    fn p(&self, a: &Act) -> u64 {
        a.ptr
    }

    /// `n` elements at device address `ptr`, after everything queued so far.
    fn download<T: cudarc::driver::DeviceRepr + Clone>(&self, ptr: u64, n: usize) -> Result<Vec<T>, ModelError> {
        self.download_with(ptr, n, <[T]>::to_vec)
    }

    /// `read` of the `n` elements at device address `ptr` as they land in page-locked memory,
    /// after everything queued so far.
    fn download_with<T: cudarc::driver::DeviceRepr, R>(
        &self,
        ptr: u64,
        n: usize,
        read: impl FnOnce(&[T]) -> R,
    ) -> Result<R, ModelError> {
        let bytes = n * std::mem::size_of::<T>();
        let mut staging = self.staging.lock().expect("staging lock");
        if staging.as_ref().is_none_or(|s| s.len() < bytes) {
            // Cached (not write-combined): the host reads it back.
            let len = bytes.next_power_of_two().max(1 << 20);
            let mut buf = unsafe { self.gpu.ctx.alloc_pinned_with_flags::<u8>(len, 0) }.map_err(|e| err(e.into()))?;
            // SAFETY: `len` bytes were just allocated; zeroed, so that every slice of them is initialized.
            unsafe { std::ptr::write_bytes(buf.as_mut_ptr().map_err(|e| err(e.into()))?, 0, len) };
            *staging = Some(buf);
        }
        let buf = staging.as_mut().expect("staging buffer").as_mut_ptr().map_err(|e| err(e.into()))?;
        // SAFETY: `buf` holds at least `bytes`, page-aligned; nothing else uses it while the lock is held.
        let landed = unsafe { std::slice::from_raw_parts_mut(buf.cast::<T>(), n) };
        unsafe { cudarc::driver::result::memcpy_dtoh_async(landed, ptr, self.gpu.stream.cu_stream()) }
            .map_err(|e| err(e.into()))?;
        self.gpu.sync().map_err(err)?;
        Ok(read(landed))
    }

    fn state_zeros(&self, n: usize) -> Result<CudaSlice<f32>, ModelError> {
        self.gpu
            .zeros::<f32>(n.max(1))
            .map_err(|e| ModelError::Compute(format!("cuda: the state of a sequence does not fit: {e}")))
    }

    /// Queues a copy of `n` floats from `src` to `dst`, both on the device.
    fn copy_floats(&self, dst: u64, src: u64, n: usize) -> Result<(), ModelError> {
        if n == 0 {
            return Ok(());
        }
        self.wrote();
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, n * 4, self.gpu.stream.cu_stream()) }
            .map_err(|e| err(e.into()))
    }

    /// The routes of router logits `[m][n_expert]` brought back to the host
    /// (tests): ids and weights `[m][k]`, the weights times `scale` where given.
    pub fn route_rows(
        &self,
        logits: &Act,
        m: usize,
        moe: &MoeConfig,
        scale: Option<&[f32]>,
    ) -> Result<(Vec<i32>, Vec<f32>), ModelError> {
        let scale = scale.map(|s| self.gpu.upload(s)).transpose().map_err(err)?;
        let r = self.route_on_device(logits, m, moe, scale.as_ref().map_or(0, |s| self.gpu.ptr(s)))?;
        let k = moe.n_expert_used;
        Ok((self.download(r.ids.ptr, m * k)?, self.download(r.wts.ptr, m * k)?))
    }

    /// Uploads host f32 values as an activation (tests).
    pub fn act_from_host(&self, v: &[f32]) -> Result<Act, ModelError> {
        self.wrote();
        let buf = self.gpu.upload(v).map_err(err)?;
        Ok(Act { ptr: self.gpu.ptr(&buf), len: v.len(), _own: Some(buf) })
    }
}

impl Cuda {
    /// `y = x · wᵀ (+ bias)` for `m` rows into `y` `[m][n_out]`.
    fn linear_into(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: &Act,
        m: usize,
        y: &Act,
        exact: bool,
    ) -> Result<(), ModelError> {
        self.matmul(&self.product(w, bias, x, m, y)?, exact)
    }

    /// The product `y = x · wᵀ (+ bias)` of `m` rows, as device addresses.
    fn product(&self, w: &Weight, bias: Option<&[f32]>, x: &Act, m: usize, y: &Act) -> Result<Matmul, ModelError> {
        Ok(Matmul {
            ty: w.ty,
            w: self.wptr(w)?,
            n_out: w.n_rows(),
            k: w.row_len(),
            x: self.p(x),
            m,
            y: self.p(y),
            bias: bias.map_or(Ok(0), |b| self.vptr(b))?,
        })
    }
}

impl Backend for Cuda {
    type Act = Act;
    type State = GpuState;
    type Recurrent = GpuRecurrent;
    type Scratch = GpuScratch;
    type Routes = GpuRoutes;
    type ExpertGroup<'a> = GpuExpertGroup;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Only the CPU's share of the experts (`--expert-misses cpu`) runs on the host's threads.
    fn uses_thread_pool(&self) -> bool {
        self.tier.as_ref().is_some_and(|t| t.lock().expect("expert tier lock").misses().on_cpu())
    }

    /// A one-row step whose misses the CPU computes keeps the pool's threads spinning between
    /// its host experts' parallel regions (`ts_cpu::team`, as the CPU backend's steps do),
    /// so that a region between two layers' GPU work finds them awake.
    fn run_step<R: Send>(&self, rows: usize, step: impl FnOnce() -> R + Send) -> R {
        if rows != 1 || !self.uses_thread_pool() {
            return step();
        }
        // The step runs on one of the pool's threads, as it does without the team
        // (`uses_thread_pool`: the engine installs the pool around it).
        ts_cpu::team::scope(step)
    }

    fn scratch(&self, exact_activations: bool) -> GpuScratch {
        GpuScratch { exact: exact_activations }
    }

    fn warm_ups(&self) -> u64 {
        self.graphs.lock().expect("graph lock").warm_ups
    }

    /// Row counts 2, 4, 8, then multiples of [`matmul::MATVEC_ROWS`] up to the recorded steps'
    /// most: a step of each count is recorded once, where checks of every length from 2 to 17
    /// were mostly first runs (measured, then recorded, each a direct run of hundreds of
    /// launches: 9-11 ms a check of the 0.5B model against 2 ms a plain step on the H200).
    fn padded_rows(&self, m: usize) -> Option<usize> {
        if !self.use_graphs || self.tier.is_some() || m <= 1 || m > step::GRAPH_MAX_ROWS {
            return None;
        }
        let rows =
            if m <= matmul::MATVEC_ROWS { m.next_power_of_two() } else { m.next_multiple_of(matmul::MATVEC_ROWS) };
        Some(rows.min(step::GRAPH_MAX_ROWS))
    }

    fn new_state(&self, model: &Model<Self>, n_ctx: usize, max_chunk: usize) -> Result<GpuState, ModelError> {
        self.largest_chunk.fetch_max(max_chunk.min(n_ctx), std::sync::atomic::Ordering::Relaxed);
        let cfg = &model.cfg;
        let layers = cfg
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Attention(AttnLayer { kv_from: Some(from), .. }) => Ok(GpuLayerState::SharedKv(*from)),
                Mixer::Attention(a) => self.kv_layer(a.sliding_window, a.kv_dim(), a.v_dim(), n_ctx, max_chunk),
                Mixer::DeltaNet => {
                    let d = cfg.delta_net.as_ref().expect("a delta-net config");
                    Ok(GpuLayerState::Recurrent {
                        conv: self.state_zeros(d.conv_state_len())?,
                        ssm: self.state_zeros(d.ssm_state_len())?,
                    })
                }
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(GpuState { layers })
    }

    fn save_recurrent(&self, state: &GpuState) -> Result<GpuRecurrent, ModelError> {
        let mut layers = Vec::new();
        for l in &state.layers {
            if let GpuLayerState::Recurrent { conv, ssm } = l {
                let (c, s) =
                    (self.gpu.alloc::<f32>(conv.len()).map_err(err)?, self.gpu.alloc::<f32>(ssm.len()).map_err(err)?);
                self.copy_floats(self.gpu.ptr(&c), self.gpu.ptr(conv), conv.len())?;
                self.copy_floats(self.gpu.ptr(&s), self.gpu.ptr(ssm), ssm.len())?;
                layers.push((c, s));
            }
        }
        Ok(GpuRecurrent { layers })
    }

    fn restore_recurrent(&self, state: &mut GpuState, saved: &GpuRecurrent) -> Result<(), ModelError> {
        let mut saved = saved.layers.iter();
        for l in &state.layers {
            if let GpuLayerState::Recurrent { conv, ssm } = l {
                let (c, s) =
                    saved.next().ok_or_else(|| ModelError::Compute("cuda: a snapshot of another model".into()))?;
                self.copy_floats(self.gpu.ptr(conv), self.gpu.ptr(c), conv.len())?;
                self.copy_floats(self.gpu.ptr(ssm), self.gpu.ptr(s), ssm.len())?;
            }
        }
        Ok(())
    }

    fn copy_state(&self, src: &GpuState, dst: &mut GpuState, n_past: usize) -> Result<(), ModelError> {
        for (d, s) in dst.layers.iter().zip(&src.layers) {
            match (d, s) {
                (GpuLayerState::Kv { k: dk, v: dv, slots: ds }, GpuLayerState::Kv { k: sk, v: sv, slots: ss }) => {
                    // Rings of the same size hold positions in the same slots: the
                    // first n_past slots, or all of them once the ring has wrapped.
                    if ds != ss {
                        return Err(ModelError::Compute("cuda: copying between sequences of other sizes".into()));
                    }
                    let used = n_past.min(*ss);
                    self.copy_floats(self.gpu.ptr(dk), self.gpu.ptr(sk), sk.len() / ss * used)?;
                    self.copy_floats(self.gpu.ptr(dv), self.gpu.ptr(sv), sv.len() / ss * used)?;
                }
                (GpuLayerState::Recurrent { conv: dc, ssm: dsm }, GpuLayerState::Recurrent { conv: sc, ssm: ss }) => {
                    self.copy_floats(self.gpu.ptr(dc), self.gpu.ptr(sc), sc.len())?;
                    self.copy_floats(self.gpu.ptr(dsm), self.gpu.ptr(ss), ss.len())?;
                }
                (GpuLayerState::SharedKv(_), GpuLayerState::SharedKv(_)) => {}
                _ => return Err(ModelError::Compute("cuda: copying between states of two models".into())),
            }
        }
        Ok(())
    }

    fn begin_step(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<GpuState>],
        scratch: &GpuScratch,
    ) -> Result<StepStart<Act>, ModelError> {
        self.start_step(rows, seqs, scratch, true)
    }

    fn begin_direct_step(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<GpuState>],
        scratch: &GpuScratch,
    ) -> Result<(), ModelError> {
        match self.start_step(rows, seqs, scratch, false)? {
            StepStart::Run => Ok(()),
            StepStart::Replayed { .. } => Err(ModelError::Compute("cuda: a direct step was replayed".into())),
        }
    }

    fn new_mtp_state(&self, model: &Model<Self>, n_ctx: usize) -> Result<GpuState, ModelError> {
        let cfg = &model.cfg;
        let Some(Mixer::Attention(a)) = cfg.nextn_layer.as_ref().map(|l| &l.mixer) else {
            return Err(ModelError::Compute("this model has no multi-token-prediction (nextn) layer".into()));
        };
        if self.tier.is_some() {
            return Err(ModelError::Compute(
                "cuda: --spec-mtp with --expert-cache is not supported (the MTP head's experts are not in the VRAM cache)"
                    .into(),
            ));
        }
        if model.weights.mtp.is_none() || self.ropes.len() <= cfg.n_layer {
            return Err(ModelError::Compute("cuda: the MTP head's weights are not on the device".into()));
        }
        // The trunk's layers hold nothing here (marked as sharing the MTP layer's cache).
        let mut layers: Vec<GpuLayerState> = (0..cfg.n_layer).map(|_| GpuLayerState::SharedKv(cfg.n_layer)).collect();
        layers.push(self.kv_layer(None, a.kv_dim(), a.v_dim(), n_ctx, 1)?);
        Ok(GpuState { layers })
    }

    fn upload(&self, x: &[f32]) -> Result<Act, ModelError> {
        // Counted as a write: an 8-bit copy of what an earlier buffer at this address held is stale.
        self.act_from_host(x)
    }

    fn end_step(&self, logits: Option<&Act>) -> Result<(), ModelError> {
        self.finish_step(logits)
    }

    fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Act, ModelError> {
        let e = table.row_len();
        let step = self.step.lock().expect("step lock");
        let (ids_ptr, _own) = match step.as_ref().filter(|s| s.tokens_host == tokens) {
            Some(s) => (self.gpu.ptr(&s.tokens), None),
            None => {
                let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
                let buf = self.gpu.upload(&ids).map_err(err)?;
                (self.gpu.ptr(&buf), Some(buf))
            }
        };
        drop(step);
        let out = self.act(tokens.len() * e)?;
        let sfx = type_suffix(table.ty).expect("checked at upload");
        self.launch_1d(
            &format!("get_rows_{sfx}"),
            tokens.len() * e / 32,
            &[
                Arg::Ptr(self.wptr(table)?),
                Arg::Ptr(ids_ptr),
                Arg::Ptr(self.p(&out)),
                Arg::I32(tokens.len() as i32),
                Arg::I32(e as i32),
            ],
        )?;
        Ok(out)
    }

    fn linear(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: &Act,
        m: usize,
        s: &mut GpuScratch,
    ) -> Result<Act, ModelError> {
        let y = self.act(m * w.n_rows())?;
        self.linear_into(w, bias, x, m, &y, s.exact)?;
        Ok(y)
    }

    fn linears(
        &self,
        ws: &[(&Weight, Option<&[f32]>)],
        x: &Act,
        m: usize,
        s: &mut GpuScratch,
    ) -> Result<Vec<Act>, ModelError> {
        // Matvec steps only: a cuBLAS GEMM and its f16 staging stay on the main stream.
        if m >= matmul::GEMM_MIN_ROWS || ws.len() < 2 {
            return ws.iter().map(|&(w, bias)| self.linear(w, bias, x, m, s)).collect();
        }
        // The 8-bit copy of x made (or found) once, before the branches, which then find it.
        let k = ws[0].0.row_len();
        if !s.exact && k.is_multiple_of(32) && ws.iter().any(|(w, _)| q8_suffix(w.ty).is_some()) {
            self.quantized(x.ptr, m, k)?;
        }
        // Outputs allocated before the branches (an allocation is ordered on the main stream).
        let ys = ws.iter().map(|(w, _)| self.act(m * w.n_rows())).collect::<Result<Vec<_>, _>>()?;
        let mms =
            ws.iter().zip(&ys).map(|(&(w, bias), y)| self.product(w, bias, x, m, y)).collect::<Result<Vec<_>, _>>()?;
        if !s.exact && self.matvec_q8_multi(&mms)? {
            return Ok(ys);
        }
        self.branches(mms.len(), |i| self.matmul(&mms[i], s.exact))?;
        Ok(ys)
    }

    fn rms_norm(&self, x: &mut Act, piece: usize, w: Option<&[f32]>, eps: f32) -> Result<(), ModelError> {
        let w = w.map_or(Ok(0), |w| self.vptr(w))?;
        self.norm_rows(&NormRows { x: x.ptr, y: 0, w, out: x.ptr, len: x.len, piece, eps, pairs: None }, None)
    }

    fn rms_norm_to(&self, x: &Act, w: &[f32], eps: f32) -> Result<Act, ModelError> {
        let out = self.act(x.len)?;
        let rows =
            NormRows { x: x.ptr, y: 0, w: self.vptr(w)?, out: out.ptr, len: x.len, piece: w.len(), eps, pairs: None };
        self.norm_rows_quantized(&rows)?;
        Ok(out)
    }

    fn add_rms_norm_to(&self, x: &mut Act, y: &Act, w: &[f32], eps: f32) -> Result<Act, ModelError> {
        let out = self.act(x.len)?;
        let rows = NormRows {
            x: x.ptr,
            y: y.ptr,
            w: self.vptr(w)?,
            out: out.ptr,
            len: x.len,
            piece: w.len(),
            eps,
            pairs: None,
        };
        self.norm_rows_quantized(&rows)?;
        Ok(out)
    }

    fn add_combined_rms_norm_to(
        &self,
        x: &mut Act,
        y: &Act,
        routes: &GpuRoutes,
        w: &[f32],
        eps: f32,
    ) -> Result<Act, ModelError> {
        let out = self.act(x.len)?;
        let pairs = PairSum { weights: routes.wts.ptr, index: self.pair_rows(routes), k: routes.k };
        let (piece, w) = (w.len(), self.vptr(w)?);
        let rows = NormRows { x: x.ptr, y: y.ptr, w, out: out.ptr, len: x.len, piece, eps, pairs: Some(pairs) };
        self.norm_rows_quantized(&rows)?;
        Ok(out)
    }

    fn add_rms_norm_route(
        &self,
        x: &mut Act,
        y: &Act,
        w: &[f32],
        eps: f32,
        moe_w: &MoeWeights,
        m: usize,
        moe: &MoeConfig,
        s: &mut GpuScratch,
    ) -> Result<(Act, GpuRoutes), ModelError> {
        if let Some(done) = self.norm_router_route(x, y, w, eps, moe_w, m, moe)? {
            return Ok(done);
        }
        let normed = self.add_rms_norm_to(x, y, w, eps)?;
        let (bias, scale) = (moe_w.router_bias.as_deref(), moe_w.expert_scale.as_deref());
        let routes = self.route_input(&moe_w.router, bias, &normed, m, moe, scale, s)?;
        Ok((normed, routes))
    }

    fn add(&self, x: &mut Act, y: &Act) -> Result<(), ModelError> {
        self.launch_1d("add", x.len, &[Arg::Ptr(self.p(x)), Arg::Ptr(self.p(y)), Arg::I64(x.len as i64)])
    }

    fn scale(&self, x: &mut Act, s: f32) -> Result<(), ModelError> {
        self.launch_1d("scale", x.len, &[Arg::Ptr(self.p(x)), Arg::F32(s), Arg::I64(x.len as i64)])
    }

    fn softcap(&self, x: &mut Act, c: f32) -> Result<(), ModelError> {
        self.launch_1d("softcap", x.len, &[Arg::Ptr(self.p(x)), Arg::F32(c), Arg::I64(x.len as i64)])
    }

    fn gated(&self, act: GatedActivation, gate: &mut Act, up: &Act) -> Result<(), ModelError> {
        let (kind, alpha, limit) = activation_args(act);
        self.launch_1d(
            "gated",
            gate.len,
            &[
                Arg::Ptr(self.p(gate)),
                Arg::Ptr(self.p(up)),
                Arg::I64(gate.len as i64),
                Arg::I32(kind),
                Arg::F32(alpha),
                Arg::F32(limit),
            ],
        )
    }

    fn rope(&self, il: usize, rope: &Rope, x: &mut Act, head_dim: usize, rows: &[Row]) -> Result<(), ModelError> {
        self.run_rope(il, rope, x, head_dim, rows)
    }

    fn store_kv(
        &self,
        il: usize,
        k: &Act,
        v: &Act,
        rows: &[Row],
        _seqs: &mut [&mut SeqState<GpuState>],
    ) -> Result<(), ModelError> {
        self.run_store_kv(il, k, v, rows)
    }

    fn attention(
        &self,
        il: usize,
        shape: &AttnShape,
        q: &Act,
        rows: &[Row],
        _seqs: &mut [&mut SeqState<GpuState>],
        s: &GpuScratch,
    ) -> Result<Act, ModelError> {
        self.run_attention(il, shape, q, rows, s.exact, None)
    }

    fn rope_store(
        &self,
        il: usize,
        rope: &Rope,
        q: &mut Act,
        kv: Option<(&mut Act, &Act)>,
        norm: Option<HeadNorm>,
        head_dim: usize,
        rows: &[Row],
        seqs: &mut [&mut SeqState<GpuState>],
    ) -> Result<(), ModelError> {
        self.run_rope_store(il, rope, q, kv, norm, head_dim, rows, seqs)
    }

    fn rope_store_attention(
        &self,
        il: usize,
        rope: &Rope,
        q: &mut Act,
        kv: Option<(&mut Act, &Act)>,
        norm: Option<HeadNorm>,
        shape: &AttnShape,
        rows: &[Row],
        seqs: &mut [&mut SeqState<GpuState>],
        s: &GpuScratch,
    ) -> Result<Act, ModelError> {
        self.run_rope_store_attention(il, rope, q, kv, norm, shape, rows, seqs, s.exact)
    }

    fn route(
        &self,
        logits: &Act,
        m: usize,
        moe: &MoeConfig,
        expert_scale: Option<&[f32]>,
    ) -> Result<GpuRoutes, ModelError> {
        let scale = expert_scale.map(|s| self.vptr(s)).transpose()?;
        self.route_on_device(logits, m, moe, scale.unwrap_or(0))
    }

    fn route_input(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: &Act,
        m: usize,
        moe: &MoeConfig,
        expert_scale: Option<&[f32]>,
        s: &mut GpuScratch,
    ) -> Result<GpuRoutes, ModelError> {
        let scale = expert_scale.map_or(Ok(0), |v| self.vptr(v))?;
        if let Some(routes) = self.router_route(w, bias, x, m, moe, scale)? {
            return Ok(routes);
        }
        let logits = self.linear(w, bias, x, m, s)?;
        self.route_on_device(&logits, m, moe, scale)
    }

    fn route_ids(&self, routes: &GpuRoutes) -> Result<Vec<usize>, ModelError> {
        // Every router chooses among at most 1024 experts (checked at upload).
        Ok(self.route_ids_host(routes, self.n_expert)?.to_vec())
    }

    fn experts_tiered(&self, _model: &Model<Self>) -> bool {
        self.tier.is_some()
    }

    fn expert_capacity(&self, _model: &Model<Self>) -> usize {
        self.tier.as_ref().map_or(usize::MAX, |t| t.lock().expect("expert tier lock").slots())
    }

    fn ensure_experts<'a>(
        &'a self,
        model: &'a Model<Self>,
        il: usize,
        ids: &[usize],
    ) -> Result<GpuExpertGroup, ModelError> {
        let tier = self.tier.as_ref().ok_or_else(|| ModelError::Compute("cuda: no expert cache".into()))?;
        // A second group of a step may evict slots the kernels queued for the first still read.
        if self.groups_since_sync.fetch_add(1, std::sync::atomic::Ordering::Relaxed) > 0 {
            self.gpu.sync().map_err(err)?;
        }
        let mut t = tier.lock().expect("expert tier lock");
        // A decode step's misses may be left to the CPU, which then reads the layer's input
        // once it is ready (marked before the compute stream is made to wait for copies).
        let to_host =
            t.misses().on_cpu() && self.step_rows.load(std::sync::atomic::Ordering::Relaxed) <= moe::DEVICE_MOE_ROWS;
        let x_ready = match to_host {
            true => Some(self.gpu.stream.record_event(None).map_err(|e| err(e.into()))?),
            false => None,
        };
        let slots = self
            .host_timing
            .time(host_timing::Phase::Ensure, || t.ensure(&self.gpu, il, ids, model.experts.as_ref(), to_host))?;
        Ok(GpuExpertGroup::new(il, slots, x_ready))
    }

    fn expert_matmuls_queue(&self) -> bool {
        true
    }

    fn prefetch_experts(
        &self,
        model: &Model<Self>,
        il: usize,
        ids: &[usize],
        keep: &GpuExpertGroup,
    ) -> Result<(), ModelError> {
        let tier = self.tier.as_ref().ok_or_else(|| ModelError::Compute("cuda: no expert cache".into()))?;
        self.host_timing.time(host_timing::Phase::Prefetch, || {
            tier.lock().expect("expert tier lock").prefetch(&self.gpu, il, ids, &keep.placed(), model.experts.as_ref())
        })
    }

    fn expert_gate_up(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Act,
        routes: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        s: &mut GpuScratch,
    ) -> Result<Act, ModelError> {
        self.gate_up(w, act, x, routes, at, s.exact)
    }

    fn expert_down(
        &self,
        w: &MoeWeights,
        h: &Act,
        routes: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        y: &mut Act,
        s: &mut GpuScratch,
    ) -> Result<(), ModelError> {
        self.down(w, h, routes, at, y, s.exact)
    }

    fn host_experts(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Act,
        routes: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        y: &mut Act,
        s: &mut GpuScratch,
    ) -> Result<(), ModelError> {
        // Only groups that left experts to the host have anything to do (and are timed).
        if !matches!(at, ExpertsAt::Group { group, .. } if group.slots.contains(&None)) {
            return Ok(());
        }
        self.host_timing
            .time(host_timing::Phase::HostExperts, || self.compute_host_experts(w, act, x, routes, at, y, s.exact))
    }

    fn combine(&self, y: &Act, routes: &GpuRoutes, width: usize) -> Result<Act, ModelError> {
        self.combine_rows(y, routes, width)
    }

    fn zeros(&self, n: usize) -> Result<Act, ModelError> {
        Cuda::zeros(self, n)
    }

    fn uninit(&self, n: usize) -> Result<Act, ModelError> {
        self.act(n)
    }

    fn copy(&self, x: &Act) -> Result<Act, ModelError> {
        let out = self.act(x.len)?;
        self.copy_floats(out.ptr, x.ptr, x.len)?;
        Ok(out)
    }

    fn columns(&self, x: &Act, rows: usize, width: usize, start: usize, n: usize) -> Result<Act, ModelError> {
        if start + n > width || x.len < rows * width {
            return Err(ModelError::Compute(format!(
                "cuda: columns {start}..{} of {rows} rows of {width} from {} floats",
                start + n,
                x.len
            )));
        }
        let out = self.act(rows * n)?;
        self.launch(
            "columns",
            (rows as u32, 1, 1),
            (128, 1, 1),
            &[
                Arg::Ptr(self.p(x)),
                Arg::Ptr(self.p(&out)),
                Arg::I32(width as i32),
                Arg::I32(start as i32),
                Arg::I32(n as i32),
            ],
        )?;
        Ok(out)
    }

    fn mul_sigmoid(&self, x: &mut Act, gate: &Act) -> Result<(), ModelError> {
        self.launch_1d("mul_sigmoid", x.len, &[Arg::Ptr(self.p(x)), Arg::Ptr(self.p(gate)), Arg::I64(x.len as i64)])
    }

    fn conv_silu(
        &self,
        il: usize,
        taps: &[f32],
        kernel: usize,
        x: &Act,
        rows: &[Row],
        _seqs: &mut [&mut SeqState<GpuState>],
    ) -> Result<Act, ModelError> {
        self.run_conv_silu(il, taps, kernel, x, rows)
    }

    fn delta_net(
        &self,
        il: usize,
        p: &ts_model::backend::DeltaNetParams,
        qkv: &Act,
        beta: &Act,
        alpha: &Act,
        rows: &[Row],
        _seqs: &mut [&mut SeqState<GpuState>],
    ) -> Result<Act, ModelError> {
        self.run_delta_net(il, p, qkv, beta, alpha, rows)
    }

    fn sigmoid_gate(&self, y: &mut Act, x: &Act, gate: &[f32]) -> Result<(), ModelError> {
        let width = gate.len();
        self.launch(
            "sigmoid_gate_rows",
            ((y.len / width) as u32, 1, 1),
            (256, 1, 1),
            &[Arg::Ptr(self.p(y)), Arg::Ptr(self.p(x)), Arg::Ptr(self.vptr(gate)?), Arg::I32(width as i32)],
        )
    }

    fn select_rows(&self, x: &Act, width: usize, rows: &[usize]) -> Result<Act, ModelError> {
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let idx = self.gpu.upload(&idx).map_err(err)?;
        let out = self.act(rows.len() * width)?;
        self.launch(
            "gather_rows",
            (rows.len() as u32, 1, 1),
            (256, 1, 1),
            &[Arg::Ptr(self.p(x)), Arg::Ptr(self.gpu.ptr(&idx)), Arg::Ptr(self.p(&out)), Arg::I32(width as i32)],
        )?;
        Ok(out)
    }

    fn to_host(&self, x: &Act) -> Result<Vec<f32>, ModelError> {
        self.download(x.ptr, x.len)
    }

    /// Only those rows cross PCIe, each read where it lands in page-locked memory.
    fn read_rows(
        &self,
        x: &Act,
        row_len: usize,
        rows: Range<usize>,
        read: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ModelError> {
        let start = rows.start.saturating_mul(row_len).min(x.len);
        let n = rows.len().saturating_mul(row_len).min(x.len - start);
        let ptr = x.ptr + (start * std::mem::size_of::<f32>()) as u64;
        let read_landed = |landed: &[f32]| {
            self.host_timing.time(host_timing::Phase::LogitsRead, || landed.chunks_exact(row_len).for_each(read))
        };
        self.host_timing.time(host_timing::Phase::Logits, || self.download_with(ptr, n, read_landed))
    }

    fn expert_stats(&self) -> Option<ts_experts::StatsSnapshot> {
        self.tier_stats()
    }
}
