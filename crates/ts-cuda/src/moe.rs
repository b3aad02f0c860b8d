//! The routed experts' ops on the GPU, the primitives of ts-model's one MoE
//! flow: routing on the device, the expert-indexed matmuls (ggml's
//! `mul_mat_id`) over the stacked tensors or over the VRAM cache's slots, and
//! the weighted sum. A step of at most [`DEVICE_MOE_ROWS`] rows runs every
//! (row, slot) pair as one slot of an expert-indexed matvec, without a host
//! round trip (so decode steps replay as a CUDA graph); steps of up to
//! [`CHUNKED_MOE_ROWS`] rows group the pairs by expert on the device and multiply
//! chunks of one expert's rows with 8-bit matvecs (several sequences decoding at
//! once); larger steps group pairs by expert on the host and multiply every
//! expert's pairs in one grouped launch per projection (moe_mm.rs), or, for exact
//! activations and types without integer dot products, each expert once on its rows.

use crate::device::Arg;
use crate::matmul::{GEMM_MIN_ROWS, MATVEC_ROWS};
use crate::matvec_q8::{IndexedMatvec, MoeChunkGateUpQ8, MoeChunkQ8, MoeGateUpQ8, q8_suffix};
use crate::moe_mm::{MoeMmGateUpQ8, MoeMmQ8};
use crate::{Act, Cuda, Matmul, err, type_suffix};
use cudarc::driver::CudaSlice;
use std::sync::OnceLock;
use ts_gguf::GgmlType;
use ts_model::ModelError;
use ts_model::backend::ExpertsAt;
use ts_model::config::{GatedActivation, Gating, MoeConfig};
use ts_model::tensors::MoeWeights;
use ts_model::weights::Weight;

/// Steps of at most this many rows run their experts as expert-indexed matvecs on
/// the device; larger ones group rows by expert on the host.
pub const DEVICE_MOE_ROWS: usize = 8;

/// Steps of more than [`DEVICE_MOE_ROWS`] and at most this many rows group their pairs
/// by expert on the device and run chunked matvecs (where the types allow): every expert's
/// weights read once, no host round trip. From [`GEMM_MIN_ROWS`] on, the tensor cores.
pub const CHUNKED_MOE_ROWS: usize = GEMM_MIN_ROWS - 1;

/// Each row's k experts `ids` (i32) and weights `wts`, `[m][k]` on the device;
/// once asked for, the ids on the host and the pairs grouped by expert.
pub struct GpuRoutes {
    pub(crate) ids: Act,
    pub(crate) wts: Act,
    pub(crate) m: usize,
    pub(crate) k: usize,
    host: OnceLock<Vec<usize>>,
    grouping: OnceLock<Grouping>,
    chunked: OnceLock<ChunkedPairs>,
    /// The grouped kernels' tiles of the last group of experts multiplied.
    pub(crate) tiles: std::sync::Mutex<Option<crate::moe_mm::Tiles>>,
}

/// A step's (row, slot) pairs ordered by expert, for many-row steps: expert e's
/// pairs are `pairs[offsets[e]..offsets[e + 1]]`; on the device the pairs, their
/// rows (`pair / k`) and each pair's place in that order, one upload for every
/// expert. Many-row steps keep `h` and `y` in that order (each expert's rows
/// contiguous, multiplied in place), and `combine` reads `y` through the places.
struct Grouping {
    offsets: Vec<usize>,
    device: CudaSlice<i32>,
}

impl GpuRoutes {
    /// Routes of `m` rows, `k` each, whose ids and weights a kernel writes into `ids` and `wts`.
    fn new(ids: Act, wts: Act, m: usize, k: usize) -> GpuRoutes {
        GpuRoutes {
            ids,
            wts,
            m,
            k,
            host: OnceLock::new(),
            grouping: OnceLock::new(),
            chunked: OnceLock::new(),
            tiles: Default::default(),
        }
    }

    /// The routes' expert ids `[m][k]` (i32) on the device.
    pub fn ids(&self) -> &Act {
        &self.ids
    }

    /// The routes' weights `[m][k]` on the device.
    pub fn weights(&self) -> &Act {
        &self.wts
    }
}

/// A step's pairs grouped by expert on the device (moe.cu's `moe_group_pairs`), for the
/// chunked matvecs: `grouped` `[3][m * k]` i32 as [`Grouping`]'s device array, `chunks`
/// `[max_chunks][3]` (expert, first place, rows) and then their count.
struct ChunkedPairs {
    grouped: Act,
    chunks: Act,
    max_chunks: usize,
}

impl ChunkedPairs {
    /// Each grouped pair's row (device address of `[m * k]` i32).
    fn rows(&self, pairs: usize) -> u64 {
        self.grouped.ptr + (4 * pairs) as u64
    }

    /// Each pair's place in the grouped order (device address of `[m * k]` i32).
    fn places(&self, pairs: usize) -> u64 {
        self.grouped.ptr + (8 * pairs) as u64
    }

    /// The device address of the chunk count.
    fn count(&self) -> u64 {
        self.chunks.ptr + (12 * self.max_chunks) as u64
    }
}

/// moe.cu's `MoeGroupPairs`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeGroupPairs {
    ids: u64,
    grouped: u64,
    chunks: u64,
    count: u64,
    n: i32,
    k: i32,
    n_expert: i32,
    chunk: i32,
}

impl Grouping {
    /// The device address of each grouped pair's row, `[m * k]` i32.
    fn rows(&self, gpu: &crate::device::Gpu, r: &GpuRoutes) -> u64 {
        gpu.ptr(&self.device) + (4 * r.m * r.k) as u64
    }
}

/// The experts of a many-row step: each (expert, its index among the projections'
/// matrices: the expert in the stacked tensors, its slot in the VRAM cache), and per
/// projection (gate, up, down) the address of matrix 0 and the bytes between matrices.
struct GroupedExperts {
    experts: Vec<(usize, usize)>,
    proj: [(u64, usize); 3],
}

/// Experts the VRAM cache holds for layer `il`: `slots[i]` holds the group's i-th
/// expert, or None where the host's CPU computes it (host_experts.rs; `x_ready` then
/// marks the layer's input on the compute stream); once made, each pair's slot on the
/// device (-1 for another group's or the host's).
pub struct GpuExpertGroup {
    pub(crate) il: usize,
    pub(crate) slots: Vec<Option<usize>>,
    pub(crate) x_ready: Option<cudarc::driver::CudaEvent>,
    slot_of: OnceLock<CudaSlice<i32>>,
}

impl GpuExpertGroup {
    pub(crate) fn new(il: usize, slots: Vec<Option<usize>>, x_ready: Option<cudarc::driver::CudaEvent>) -> Self {
        GpuExpertGroup { il, slots, x_ready, slot_of: OnceLock::new() }
    }

    /// The slots of the experts in VRAM.
    pub(crate) fn placed(&self) -> Vec<usize> {
        self.slots.iter().flatten().copied().collect()
    }
}

/// Where one projection of the experts of a matmul is: the address of expert
/// (or slot) 0, the bytes between experts, and per (row, slot) pair the index
/// into them (device `[m * k]` i32, negative for pairs of another group).
struct Source {
    base: u64,
    stride: usize,
    index: u64,
}

/// Per projection (gate, up, down) its [`Source`].
struct Sources {
    proj: [Source; 3],
}

impl Cuda {
    /// Each row's k experts and weights from router logits `[m][n_expert]`, on the device.
    /// Routes `[m][n_expert]` logits on the device; `scale` is the device address
    /// of the per-expert output scales, or 0 for none.
    pub(crate) fn route_on_device(
        &self,
        logits: &Act,
        m: usize,
        moe: &MoeConfig,
        scale: u64,
    ) -> Result<GpuRoutes, ModelError> {
        let k = moe.n_expert_used;
        let ids = self.act(m * k)?;
        let wts = self.act(m * k)?;
        // Writes only the routes: the layer's normed input keeps its 8-bit copy for the experts.
        self.keeping_quantized(&[(ids.ptr, 4 * m * k), (wts.ptr, 4 * m * k)], || {
            self.launch(
                "route",
                (m as u32, 1, 1),
                (32, 1, 1),
                &[
                    Arg::Ptr(self.p(logits)),
                    Arg::I32(moe.n_expert as i32),
                    Arg::I32(k as i32),
                    Arg::I32(gating_code(moe.gating)),
                    Arg::I32(moe.renormalize as i32),
                    Arg::Ptr(scale),
                    Arg::Ptr(ids.ptr),
                    Arg::Ptr(self.p(&wts)),
                ],
            )
        })?;
        Ok(GpuRoutes::new(ids, wts, m, k))
    }

    /// `router_route`'s parameters for `m` rows at device address `x` and its outputs (logits,
    /// ids, weights); None where that kernel does not apply (more than [`DEVICE_MOE_ROWS`]
    /// rows, a router not f32, rows of a width not a multiple of 4).
    fn router_params(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: u64,
        m: usize,
        moe: &MoeConfig,
        scale: u64,
    ) -> Result<Option<(RouterRoute, [Act; 3])>, ModelError> {
        let (n_embd, n_expert, k) = (w.row_len(), w.n_rows(), moe.n_expert_used);
        if m == 0
            || m > DEVICE_MOE_ROWS
            || w.ty != GgmlType::F32
            || !n_embd.is_multiple_of(4)
            || n_expert != moe.n_expert
        {
            return Ok(None);
        }
        let (logits, ids, wts) = (self.act(m * n_expert)?, self.act(m * k)?, self.act(m * k)?);
        let p = RouterRoute {
            w: self.wptr(w)?,
            bias: bias.map_or(Ok(0), |b| self.vptr(b))?,
            x,
            logits: logits.ptr,
            done: self.gpu.ptr(&self.route_done),
            scale,
            ids: ids.ptr,
            weights: wts.ptr,
            n_expert: n_expert as i32,
            n_embd: n_embd as i32,
            k: k as i32,
            gating: gating_code(moe.gating),
            renormalize: moe.renormalize as i32,
        };
        Ok(Some((p, [logits, ids, wts])))
    }

    /// Routes of at most [`DEVICE_MOE_ROWS`] rows of `x` by an f32 router `w` in one launch
    /// (`router_route`: the logits, then the routing by the last block of each row); None
    /// where that kernel does not apply ([`Cuda::router_params`]), for the router matmul and
    /// `route` one after the other.
    pub(crate) fn router_route(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: &Act,
        m: usize,
        moe: &MoeConfig,
        scale: u64,
    ) -> Result<Option<GpuRoutes>, ModelError> {
        let Some((p, [logits, ids, wts])) = self.router_params(w, bias, x.ptr, m, moe, scale)? else {
            return Ok(None);
        };
        let (n_expert, k) = (p.n_expert as usize, p.k as usize);
        // Writes only the routes: the layer's normed input keeps its 8-bit copy for the experts.
        let writes = [(logits.ptr, 4 * m * n_expert), (ids.ptr, 4 * m * k), (wts.ptr, 4 * m * k), (p.done, 4 * m)];
        self.keeping_quantized(&writes, || {
            self.launch_with(
                "router_route",
                (n_expert as u32, m as u32, 1),
                (crate::device::router_threads(n_expert), 1, 1),
                &p,
            )
        })?;
        Ok(Some(GpuRoutes::new(ids, wts, m, k)))
    }

    /// `x += y`, the sum normed by `norm` (with its 8-bit copy) and routed by `moe_w`'s f32
    /// router in one launch (`norm_router_route`), x then at a new address; None where
    /// `router_route` does not apply or the width is not a multiple of 32.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_router_route(
        &self,
        x: &mut Act,
        y: &Act,
        norm: &[f32],
        eps: f32,
        moe_w: &MoeWeights,
        m: usize,
        moe: &MoeConfig,
    ) -> Result<Option<(Act, GpuRoutes)>, ModelError> {
        let n_embd = moe_w.router.row_len();
        if !n_embd.is_multiple_of(32) || norm.len() != n_embd || x.len != m * n_embd || y.len != x.len {
            return Ok(None);
        }
        let scale = moe_w.expert_scale.as_deref().map_or(Ok(0), |v| self.vptr(v))?;
        let bias = moe_w.router_bias.as_deref();
        let Some((route, [_logits, ids, wts])) = self.router_params(&moe_w.router, bias, x.ptr, m, moe, scale)? else {
            return Ok(None);
        };
        let (x_out, normed) = (self.act(x.len)?, self.act(x.len)?);
        let (q, q_buf) = self.q8_buffer(m, n_embd)?;
        let p = NormRouterRoute {
            route,
            y: y.ptr,
            norm: self.vptr(norm)?,
            x_out: x_out.ptr,
            normed: normed.ptr,
            q: q.q(0),
            ds: q.ds(0),
            eps,
        };
        let block = (crate::device::router_threads(route.n_expert as usize), 1, 1);
        self.launch_with("norm_router_route", (route.n_expert as u32, m as u32, 1), block, &p)?;
        self.remember_quantized(normed.ptr, q, q_buf);
        *x = x_out;
        Ok(Some((normed, GpuRoutes::new(ids, wts, m, route.k as usize))))
    }

    /// The routes' expert ids on the host (the first ask waits for the step so
    /// far), checked to be below `n_expert`.
    pub(crate) fn route_ids_host<'r>(&self, r: &'r GpuRoutes, n_expert: usize) -> Result<&'r [usize], ModelError> {
        if let Some(ids) = r.host.get() {
            return Ok(ids);
        }
        let ids: Vec<i32> =
            self.host_timing.time(crate::host_timing::Phase::RouteWait, || self.download(r.ids.ptr, r.m * r.k))?;
        self.groups_since_sync.store(0, std::sync::atomic::Ordering::Relaxed);
        let ids = ids.into_iter().map(|e| checked_expert(e, n_expert)).collect::<Result<Vec<usize>, _>>()?;
        Ok(r.host.get_or_init(|| ids))
    }

    /// The 8-bit kernel suffixes (gate and up, down) when `r`'s experts run as chunked
    /// matvecs: a step of more than [`DEVICE_MOE_ROWS`] and at most [`CHUNKED_MOE_ROWS`] rows,
    /// the stacked experts, 8-bit activations, integer dot products for all three projections.
    /// (`moe_group_pairs` holds up to 1024 experts in shared memory: the most `Cuda::new` takes.)
    fn chunked_suffixes(
        &self,
        w: &MoeWeights,
        r: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        exact: bool,
    ) -> Option<(&'static str, &'static str)> {
        let rows = DEVICE_MOE_ROWS + 1..=CHUNKED_MOE_ROWS;
        if exact || !rows.contains(&r.m) || !matches!(at, ExpertsAt::Stacked) || w.gate_exps.ty != w.up_exps.ty {
            return None;
        }
        Some((q8_suffix(w.gate_exps.ty)?, q8_suffix(w.down_exps.ty)?))
    }

    /// The pairs of `r` grouped by expert on the device (one launch, made once per routes).
    fn chunked_pairs<'r>(&self, r: &'r GpuRoutes, n_expert: usize) -> Result<&'r ChunkedPairs, ModelError> {
        if let Some(c) = r.chunked.get() {
            return Ok(c);
        }
        let pairs = r.m * r.k;
        let max_chunks = pairs.min(n_expert + pairs / MATVEC_ROWS);
        let (grouped, chunks) = (self.act(3 * pairs)?, self.act(3 * max_chunks + 1)?);
        let c = ChunkedPairs { grouped, chunks, max_chunks };
        let p = MoeGroupPairs {
            ids: r.ids.ptr,
            grouped: c.grouped.ptr,
            chunks: c.chunks.ptr,
            count: c.count(),
            n: pairs as i32,
            k: r.k as i32,
            n_expert: n_expert as i32,
            chunk: MATVEC_ROWS as i32,
        };
        self.launch_with("moe_group_pairs", (1, 1, 1), (256, 1, 1), &p)?;
        Ok(r.chunked.get_or_init(|| c))
    }

    /// The pairs of `r` grouped by expert (made once per routes).
    fn grouping<'r>(&self, r: &'r GpuRoutes, n_expert: usize) -> Result<&'r Grouping, ModelError> {
        if let Some(g) = r.grouping.get() {
            return Ok(g);
        }
        let ids = self.route_ids_host(r, n_expert)?;
        let mut offsets = vec![0usize; n_expert + 1];
        for &e in ids {
            offsets[e + 1] += 1;
        }
        for e in 0..n_expert {
            offsets[e + 1] += offsets[e];
        }
        let mut next = offsets.clone();
        let n = ids.len();
        let mut pairs = vec![0i32; 3 * n];
        for (p, &e) in ids.iter().enumerate() {
            pairs[next[e]] = p as i32;
            pairs[n + next[e]] = (p / r.k) as i32;
            pairs[2 * n + p] = next[e] as i32;
            next[e] += 1;
        }
        let device = self.gpu.upload(&pairs).map_err(err)?;
        Ok(r.grouping.get_or_init(|| Grouping { offsets, device }))
    }

    /// Where gate, up and down of the experts `at` are for the pairs of `r`.
    fn sources(
        &self,
        w: &MoeWeights,
        r: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
    ) -> Result<Sources, ModelError> {
        let ws = [&w.gate_exps, &w.up_exps, &w.down_exps];
        match at {
            ExpertsAt::Stacked => {
                let mut proj = Vec::with_capacity(3);
                for t in ws {
                    proj.push(Source { base: self.wptr(t)?, stride: t.matrix_stride(), index: r.ids.ptr });
                }
                let proj: [Source; 3] = proj.try_into().map_err(|_| ModelError::Compute("three projections".into()))?;
                Ok(Sources { proj })
            }
            ExpertsAt::Group { ids, group, routes } => {
                let tier = self.tier.as_ref().ok_or_else(|| ModelError::Compute("cuda: no expert cache".into()))?;
                let t = tier.lock().expect("expert tier lock");
                let index = match group.slot_of.get() {
                    Some(index) => index,
                    None => {
                        // Each pair's slot, or -1 for a pair whose expert is in another group.
                        let slot_of: Vec<i32> = routes
                            .iter()
                            .map(|e| {
                                ids.iter().position(|g| g == e).and_then(|i| group.slots[i]).map_or(-1, |s| s as i32)
                            })
                            .collect();
                        let index = self.gpu.upload(&slot_of).map_err(err)?;
                        group.slot_of.get_or_init(|| index)
                    }
                };
                let at = self.gpu.ptr(index);
                let stride = t.slot_bytes();
                let proj = [0, 1, 2].map(|p| Source { base: t.proj_base(&self.gpu, p), stride, index: at });
                Ok(Sources { proj })
            }
        }
    }

    /// [`ts_model::Backend::expert_gate_up`].
    pub(crate) fn gate_up(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Act,
        r: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        exact: bool,
    ) -> Result<Act, ModelError> {
        let (e, f) = (w.gate_exps.row_len(), w.gate_exps.n_rows());
        let (pairs, k) = (r.m * r.k, r.k);
        let h = self.act(pairs * f)?;
        let bias = |b: &Option<Vec<f32>>| b.as_ref().map_or(Ok(0), |b| self.vptr(b));
        if let Some((sfx, _)) = self.chunked_suffixes(w, r, at, exact) {
            // h in the order of the pairs grouped by expert, as below, grouped on the device.
            let c = self.chunked_pairs(r, w.gate_exps.dims[2])?;
            let (xq, _buf) = self.gather_quantized(x, c.rows(pairs), pairs, e)?;
            let (kind, alpha, limit) = activation_args(act);
            let p = MoeChunkGateUpQ8 {
                w_gate: self.wptr(&w.gate_exps)?,
                w_up: self.wptr(&w.up_exps)?,
                chunks: c.chunks.ptr,
                count: c.count(),
                h: self.p(&h),
                gate_bias: bias(&w.gate_bias)?,
                up_bias: bias(&w.up_bias)?,
                expert_stride: w.gate_exps.matrix_stride() as i64,
                n_out: f as i32,
                k: e as i32,
                kind,
                alpha,
                limit,
                ..Default::default()
            };
            self.chunk_gate_up_q8(sfx, p, c.max_chunks, &xq)?;
            return Ok(h);
        }
        if r.m > DEVICE_MOE_ROWS {
            // h in the order of the pairs grouped by expert: each expert's rows in place.
            let (kind, alpha, limit) = activation_args(act);
            let sfx = q8_suffix(w.gate_exps.ty).filter(|_| !exact && w.gate_exps.ty == w.up_exps.ty);
            if let Some(sfx) = sfx {
                let (g, grouped) = self.grouped_experts(w, r, at)?;
                if !grouped.experts.is_empty() {
                    // Every expert's tiles in one launch (gate and up of one type: one stride).
                    let tiles = self.tiles(r, &g.offsets, &grouped.experts)?;
                    let (xq, _buf) = self.gather_quantized(x, g.rows(&self.gpu, r), pairs, e)?;
                    let p = MoeMmGateUpQ8 {
                        w_gate: grouped.proj[0].0,
                        w_up: grouped.proj[1].0,
                        h: self.p(&h),
                        gate_bias: bias(&w.gate_bias)?,
                        up_bias: bias(&w.up_bias)?,
                        expert_stride: grouped.proj[0].1 as i64,
                        n_out: f as i32,
                        k: e as i32,
                        kind,
                        alpha,
                        limit,
                        ..Default::default()
                    };
                    self.moe_mm_gate_up_q8(sfx, p, tiles, &xq)?;
                }
                return Ok(h);
            }
            self.by_expert(w, r, at, |base, ex, start, me, rows_d| {
                let xs = self.act(me * e)?;
                self.gather(x, rows_d, &xs, me, e)?;
                let g = self.p(&h) + (4 * start * f) as u64;
                let u = self.act(me * f)?;
                let gate =
                    Matmul { ty: w.gate_exps.ty, w: base[0], n_out: f, k: e, x: self.p(&xs), m: me, y: g, bias: 0 };
                self.matmul(&gate, exact)?;
                self.matmul(&Matmul { ty: w.up_exps.ty, w: base[1], y: self.p(&u), ..gate }, exact)?;
                for (t, b) in [(g, &w.gate_bias), (self.p(&u), &w.up_bias)] {
                    if let Some(b) = b {
                        self.bias_rows(t, self.vptr(b)? + (ex * f * 4) as u64, me, f)?;
                    }
                }
                self.launch_1d(
                    "gated",
                    me * f,
                    &[
                        Arg::Ptr(g),
                        Arg::Ptr(self.p(&u)),
                        Arg::I64((me * f) as i64),
                        Arg::I32(kind),
                        Arg::F32(alpha),
                        Arg::F32(limit),
                    ],
                )
            })?;
            return Ok(h);
        }
        let src = self.sources(w, r, at)?;
        if w.gate_exps.ty == w.up_exps.ty {
            // Gate, up, their biases and the activation in one kernel (same type: same stride).
            let (kind, alpha, limit) = activation_args(act);
            if !exact && let Some(sfx) = q8_suffix(w.gate_exps.ty) {
                let p = MoeGateUpQ8 {
                    w_gate: src.proj[0].base,
                    w_up: src.proj[1].base,
                    index: src.proj[0].index,
                    ids: r.ids.ptr,
                    h: self.p(&h),
                    gate_bias: bias(&w.gate_bias)?,
                    up_bias: bias(&w.up_bias)?,
                    expert_stride: src.proj[0].stride as i64,
                    x_group: k as i32,
                    n_out: f as i32,
                    k: e as i32,
                    kind,
                    alpha,
                    limit,
                    ..Default::default()
                };
                self.gate_up_q8(sfx, p, x, pairs)?;
                return Ok(h);
            }
            let sfx = type_suffix(w.gate_exps.ty).expect("checked at upload");
            self.launch(
                &format!("moe_gate_up_{sfx}"),
                (f.div_ceil(4) as u32, pairs as u32, 1),
                (32, 4, 1),
                &[
                    Arg::Ptr(src.proj[0].base),
                    Arg::Ptr(src.proj[1].base),
                    Arg::I64(src.proj[0].stride as i64),
                    Arg::Ptr(src.proj[0].index),
                    Arg::Ptr(r.ids.ptr),
                    Arg::Ptr(self.p(x)),
                    Arg::I32(k as i32),
                    Arg::Ptr(self.p(&h)),
                    Arg::I32(f as i32),
                    Arg::I32(e as i32),
                    Arg::Ptr(bias(&w.gate_bias)?),
                    Arg::Ptr(bias(&w.up_bias)?),
                    Arg::I32(kind),
                    Arg::F32(alpha),
                    Arg::F32(limit),
                ],
            )?;
            return Ok(h);
        }
        let (mut g, u) = (self.act(pairs * f)?, self.act(pairs * f)?);
        for (t, p, out, b) in [(&w.gate_exps, 0, &g, &w.gate_bias), (&w.up_exps, 1, &u, &w.up_bias)] {
            let mv = IndexedMatvec {
                ty: t.ty,
                w: src.proj[p].base,
                expert_stride: src.proj[p].stride,
                index: src.proj[p].index,
                x_group: k,
                y: self.p(out),
                bias: bias(b)?,
                ids: r.ids.ptr,
                n_out: f,
                k: e,
                slots: pairs,
            };
            self.indexed_matvec(&mv, x, exact)?;
        }
        ts_model::Backend::gated(self, act, &mut g, &u)?;
        Ok(g)
    }

    /// [`ts_model::Backend::expert_down`].
    pub(crate) fn down(
        &self,
        w: &MoeWeights,
        h: &Act,
        r: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        y: &Act,
        exact: bool,
    ) -> Result<(), ModelError> {
        let (e, f) = (w.down_exps.n_rows(), w.down_exps.row_len());
        let pairs = r.m * r.k;
        if let Some((_, sfx)) = self.chunked_suffixes(w, r, at, exact) {
            // h and y in the grouped order of `gate_up`'s chunks.
            let c = self.chunked_pairs(r, w.down_exps.dims[2])?;
            let hq = self.quantized(self.p(h), pairs, f)?;
            let p = MoeChunkQ8 {
                w: self.wptr(&w.down_exps)?,
                chunks: c.chunks.ptr,
                count: c.count(),
                y: self.p(y),
                bias: w.down_bias.as_ref().map_or(Ok(0), |b| self.vptr(b))?,
                expert_stride: w.down_exps.matrix_stride() as i64,
                n_out: e as i32,
                k: f as i32,
                ..Default::default()
            };
            return self.keeping_quantized(&[(p.y, 4 * pairs * e)], || self.chunk_matvec_q8(sfx, p, c.max_chunks, &hq));
        }
        if r.m > DEVICE_MOE_ROWS {
            // h and y in the order of the pairs grouped by expert (see `Grouping`).
            let sfx = q8_suffix(w.down_exps.ty).filter(|_| !exact);
            if let Some(sfx) = sfx {
                let (g, grouped) = self.grouped_experts(w, r, at)?;
                if !grouped.experts.is_empty() {
                    let tiles = self.tiles(r, &g.offsets, &grouped.experts)?;
                    let (hq, _buf) = self.quantized_padded(self.p(h), pairs, f)?;
                    let p = MoeMmQ8 {
                        w: grouped.proj[2].0,
                        y: self.p(y),
                        bias: w.down_bias.as_ref().map_or(Ok(0), |b| self.vptr(b))?,
                        expert_stride: grouped.proj[2].1 as i64,
                        n_out: e as i32,
                        k: f as i32,
                        ..Default::default()
                    };
                    self.moe_mm_q8(sfx, p, tiles, &hq)?;
                }
                return Ok(());
            }
            return self.by_expert(w, r, at, |base, ex, start, me, _rows| {
                let (hs, d) = (self.p(h) + (4 * start * f) as u64, self.p(y) + (4 * start * e) as u64);
                let down = Matmul { ty: w.down_exps.ty, w: base[2], n_out: e, k: f, x: hs, m: me, y: d, bias: 0 };
                self.matmul(&down, exact)?;
                match &w.down_bias {
                    Some(b) => self.bias_rows(d, self.vptr(b)? + (ex * e * 4) as u64, me, e),
                    None => Ok(()),
                }
            });
        }
        let src = self.sources(w, r, at)?;
        let mv = IndexedMatvec {
            ty: w.down_exps.ty,
            w: src.proj[2].base,
            expert_stride: src.proj[2].stride,
            index: src.proj[2].index,
            x_group: 1,
            y: self.p(y),
            bias: w.down_bias.as_ref().map_or(Ok(0), |b| self.vptr(b))?,
            ids: r.ids.ptr,
            n_out: e,
            k: f,
            slots: pairs,
        };
        self.indexed_matvec(&mv, h, exact || down_in_f32())
    }

    /// Device address of each (row, slot) pair's row of the experts' outputs `y`, `[m * k]`
    /// (many-row steps leave y in the order of the pairs grouped by expert), or 0 where pair
    /// `r * k + j` is row `r * k + j`.
    pub(crate) fn pair_rows(&self, r: &GpuRoutes) -> u64 {
        match (r.chunked.get(), r.grouping.get()) {
            (Some(c), _) => c.places(r.m * r.k),
            (None, Some(g)) if r.m > DEVICE_MOE_ROWS => self.gpu.ptr(&g.device) + (8 * r.m * r.k) as u64,
            _ => 0,
        }
    }

    /// `out[r] = Σ_j wts[r][j] · y[pair (r, j)]`, `[m][width]`.
    pub(crate) fn combine_rows(&self, y: &Act, r: &GpuRoutes, width: usize) -> Result<Act, ModelError> {
        let out = self.act(r.m * width)?;
        let index = self.pair_rows(r);
        self.launch(
            "moe_combine",
            (width.div_ceil(256) as u32, r.m as u32, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(self.p(y)),
                Arg::Ptr(self.p(&r.wts)),
                Arg::Ptr(index),
                Arg::Ptr(self.p(&out)),
                Arg::I32(r.k as i32),
                Arg::I32(width as i32),
            ],
        )?;
        Ok(out)
    }

    /// `x[r] += bias` for `n` rows of `width` at device address `x`.
    fn bias_rows(&self, x: u64, bias: u64, n: usize, width: usize) -> Result<(), ModelError> {
        self.launch_1d(
            "add_bias",
            n * width,
            &[Arg::Ptr(x), Arg::Ptr(bias), Arg::I32(width as i32), Arg::I64((n * width) as i64)],
        )
    }

    /// `mv` on activations `x`: 8-bit unless `exact` or the type has no integer dot products
    /// (then the bias in a kernel of its own).
    fn indexed_matvec(&self, mv: &IndexedMatvec, x: &Act, exact: bool) -> Result<(), ModelError> {
        if !exact && let Some(sfx) = q8_suffix(mv.ty) {
            return self.indexed_matvec_q8(sfx, mv, x);
        }
        let sfx = type_suffix(mv.ty).expect("checked at upload");
        self.launch(
            &format!("moe_matvec_{sfx}"),
            (mv.n_out.div_ceil(4) as u32, mv.slots as u32, 1),
            (32, 4, 1),
            &[
                Arg::Ptr(mv.w),
                Arg::I64(mv.expert_stride as i64),
                Arg::Ptr(mv.index),
                Arg::Ptr(self.p(x)),
                Arg::I32(mv.x_group as i32),
                Arg::Ptr(mv.y),
                Arg::I32(mv.n_out as i32),
                Arg::I32(mv.k as i32),
            ],
        )?;
        if mv.bias == 0 {
            return Ok(());
        }
        // y[s] += bias[ids[s]] for the slots whose index is not negative.
        let n = mv.slots * mv.n_out;
        self.launch_1d(
            "add_bias_indexed",
            n,
            &[
                Arg::Ptr(mv.y),
                Arg::Ptr(mv.bias),
                Arg::Ptr(mv.ids),
                Arg::Ptr(mv.index),
                Arg::I32(mv.n_out as i32),
                Arg::I64(n as i64),
            ],
        )
    }

    /// The experts `at` with pairs in `r` (many-row steps), with the pairs grouped by expert.
    fn grouped_experts<'r>(
        &self,
        w: &MoeWeights,
        r: &'r GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
    ) -> Result<(&'r Grouping, GroupedExperts), ModelError> {
        let n_expert = w.gate_exps.dims[2];
        let g = self.grouping(r, n_expert)?;
        let used = |e: usize| g.offsets[e + 1] > g.offsets[e];
        let grouped = match at {
            ExpertsAt::Stacked => {
                let mut proj = [(0u64, 0usize); 3];
                for (p, t) in [&w.gate_exps, &w.up_exps, &w.down_exps].into_iter().enumerate() {
                    proj[p] = (self.wptr(t)?, t.matrix_stride());
                }
                GroupedExperts { experts: (0..n_expert).filter(|&e| used(e)).map(|e| (e, e)).collect(), proj }
            }
            ExpertsAt::Group { ids, group, .. } => {
                let tier = self.tier.as_ref().ok_or_else(|| ModelError::Compute("cuda: no expert cache".into()))?;
                let t = tier.lock().expect("expert tier lock");
                GroupedExperts {
                    // Many-row steps leave nothing to the host.
                    experts: ids
                        .iter()
                        .zip(&group.slots)
                        .filter_map(|(&e, &s)| Some((e, s?)))
                        .filter(|&(e, _)| used(e))
                        .collect(),
                    proj: [0, 1, 2].map(|p| (t.proj_base(&self.gpu, p), t.slot_bytes())),
                }
            }
        };
        Ok((g, grouped))
    }

    /// Calls `f(per projection the expert's address, expert, its first place among
    /// the pairs grouped by expert, its pair count, their rows on the device)` for
    /// each expert `at` with pairs in `r` (many-row steps).
    fn by_expert(
        &self,
        w: &MoeWeights,
        r: &GpuRoutes,
        at: &ExpertsAt<'_, GpuExpertGroup>,
        mut f: impl FnMut([u64; 3], usize, usize, usize, u64) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let (g, grouped) = self.grouped_experts(w, r, at)?;
        let rows = g.rows(&self.gpu, r);
        for &(ex, index) in &grouped.experts {
            let (start, n) = (g.offsets[ex], g.offsets[ex + 1] - g.offsets[ex]);
            f(
                grouped.proj.map(|(base, stride)| base + (index * stride) as u64),
                ex,
                start,
                n,
                rows + (4 * start) as u64,
            )?;
        }
        Ok(())
    }

    /// `out[j] = x[rows[j]]` for `n` rows of `width` (`rows` a device address).
    fn gather(&self, x: &Act, rows: u64, out: &Act, n: usize, width: usize) -> Result<(), ModelError> {
        self.launch(
            "gather_rows",
            (n as u32, 1, 1),
            (256, 1, 1),
            &[Arg::Ptr(self.p(x)), Arg::Ptr(rows), Arg::Ptr(self.p(out)), Arg::I32(width as i32)],
        )
    }
}

/// moe.cu's `gating` argument.
fn gating_code(g: Gating) -> i32 {
    match g {
        Gating::Softmax => 0,
        Gating::SoftmaxOverTopK => 1,
    }
}

/// moe.cu's `RouterRoute`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RouterRoute {
    w: u64,
    bias: u64,
    x: u64,
    logits: u64,
    done: u64,
    scale: u64,
    ids: u64,
    weights: u64,
    n_expert: i32,
    n_embd: i32,
    k: i32,
    gating: i32,
    renormalize: i32,
}

/// moe.cu's `NormRouterRoute`.
#[repr(C)]
#[derive(Clone, Copy)]
struct NormRouterRoute {
    route: RouterRoute,
    y: u64,
    norm: u64,
    x_out: u64,
    normed: u64,
    q: u64,
    ds: u64,
    eps: f32,
}

/// The kernels' encoding of a gated activation: kind (activation.cuh), alpha, limit.
pub(crate) fn activation_args(act: GatedActivation) -> (i32, f32, f32) {
    match act {
        GatedActivation::SwiGlu => (0, 0.0, 0.0),
        GatedActivation::GeGlu => (1, 0.0, 0.0),
        GatedActivation::SwiGluClamped { alpha, limit } => (2, alpha, limit),
    }
}

/// A routed expert id from the device, checked to be below `n_expert`.
fn checked_expert(e: i32, n_expert: usize) -> Result<usize, ModelError> {
    usize::try_from(e)
        .ok()
        .filter(|&e| e < n_expert)
        .ok_or_else(|| ModelError::Compute(format!("cuda: router chose expert {e} of {n_expert}")))
}

/// A measurement knob, `TURBOSPARK_DOWN_F32=1`: a step of few rows multiplies the experts' down
/// projections with h in f32 (the exact kernels), so no `quantize_q8_1` launch comes between the
/// gate/up kernel and down's.
fn down_in_f32() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TURBOSPARK_DOWN_F32").is_some())
}
