//! Attention layers on the device: their KV caches (f32, a ring for sliding
//! layers), rotary embeddings and the attention kernel (ops.cu).

use crate::device::Arg;
use crate::{Act, Cuda, GpuLayerState, GpuState, err};
use ts_cpu::ops::Rope;
use ts_model::backend::{AttnShape, HeadNorm};
use ts_model::state::ring_slots;
use ts_model::{ModelError, Row, SeqState};

impl Cuda {
    /// Caches for `n_ctx` positions of attention layers with these sliding windows,
    /// filled `max_chunk` rows at a time (a sliding layer keeps a ring, as on the CPU).
    pub fn kv_for(
        &self,
        windows: &[Option<usize>],
        kv_dim: usize,
        v_dim: usize,
        n_ctx: usize,
        max_chunk: usize,
    ) -> Result<GpuState, ModelError> {
        let layers = windows.iter().map(|&w| self.kv_layer(w, kv_dim, v_dim, n_ctx, max_chunk));
        Ok(GpuState { layers: layers.collect::<Result<_, _>>()? })
    }

    pub(crate) fn kv_layer(
        &self,
        window: Option<usize>,
        kv_dim: usize,
        v_dim: usize,
        n_ctx: usize,
        max_chunk: usize,
    ) -> Result<GpuLayerState, ModelError> {
        let slots = ring_slots(window, n_ctx, max_chunk);
        Ok(GpuLayerState::Kv { k: self.state_zeros(slots * kv_dim)?, v: self.state_zeros(slots * v_dim)?, slots })
    }

    /// Sets the positions a row sees from which a decode attention block takes several query
    /// heads of one KV head (0: always; `usize::MAX`: never), so that tests cover both.
    pub fn set_attention_group_from(&mut self, positions: usize) {
        self.attn_group_from = positions;
    }

    /// Adds a layer's rotary frequencies and sliding window (tests build layers by hand).
    pub fn push_rope(&mut self, inv_freq: &[f32], window: Option<usize>) -> Result<(), ModelError> {
        self.ropes.push(Some(self.gpu.upload(inv_freq).map_err(err)?));
        self.windows.push(window.unwrap_or(0) as i32);
        Ok(())
    }

    /// [`ts_model::Backend::rope`].
    pub(crate) fn run_rope(
        &self,
        il: usize,
        rope: &Rope,
        x: &mut Act,
        head_dim: usize,
        rows: &[Row],
    ) -> Result<(), ModelError> {
        let n_heads = x.len / rows.len() / head_dim;
        self.launch(
            "rope",
            ((rows.len() * n_heads) as u32, 1, 1),
            (64, 1, 1),
            &[
                Arg::Ptr(self.p(x)),
                Arg::Ptr(self.step_rows(rows.len())?.0),
                Arg::Ptr(self.rope_table(il)?),
                Arg::I32(n_heads as i32),
                Arg::I32(head_dim as i32),
                Arg::I32(rope.n_rot as i32),
                Arg::I32(rope.interleaved as i32),
                Arg::F32(rope.mscale),
            ],
        )
    }

    /// The device address of layer `il`'s rotary frequencies.
    fn rope_table(&self, il: usize) -> Result<u64, ModelError> {
        let table = self.ropes.get(il).and_then(Option::as_ref);
        table.map(|t| self.gpu.ptr(t)).ok_or_else(|| ModelError::Compute(format!("cuda: layer {il} has no rope")))
    }

    /// [`ts_model::Backend::store_kv`].
    pub(crate) fn run_store_kv(&self, il: usize, k: &Act, v: &Act, rows: &[Row]) -> Result<(), ModelError> {
        let m = rows.len();
        let info = self.row_kv(il, m)?;
        self.launch(
            "kv_store",
            (m as u32, 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(self.p(k)),
                Arg::Ptr(self.p(v)),
                Arg::Ptr(info),
                Arg::I32((k.len / m) as i32),
                Arg::I32((v.len / m) as i32),
            ],
        )
    }

    /// The device address of layer `il`'s `RowKv`s in a step of `m` rows.
    fn row_kv(&self, il: usize, m: usize) -> Result<u64, ModelError> {
        Ok(self.step_rows(m)?.1 + (il * m * 24) as u64)
    }

    /// The device addresses of the current step's positions `[m]` and `RowKv`s, for an
    /// attention layer's op over its `m` rows.
    fn step_rows(&self, m: usize) -> Result<(u64, u64), ModelError> {
        let step = self.step.lock().expect("step lock");
        let step = step
            .as_ref()
            .filter(|s| s.m == m)
            .ok_or_else(|| ModelError::Compute("cuda: an attention layer outside a step".into()))?;
        Ok((self.gpu.ptr(&step.pos), self.gpu.ptr(&step.kv)))
    }

    /// [`ts_model::Backend::rope_store`] in one launch (`rope_store` of attention.cu), for
    /// heads of at most 512; larger ones take the ops one by one.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_rope_store(
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
        let m = rows.len();
        if !rope_store_fits(head_dim, rope) || m == 0 {
            return ts_model::backend::rope_store_by_ops(self, il, rope, q, kv, norm, head_dim, rows, seqs);
        }
        let params = self.rope_store_params(il, rope, q, kv.as_ref().map(|(k, v)| (&**k, *v)), norm, head_dim, m)?;
        self.launch_with(
            "rope_store",
            ((m * (params.n_head + params.n_head_kv) as usize) as u32, 1, 1),
            (128, 1, 1),
            &params,
        )
    }

    /// `rope_store`'s parameters for `m` rows of queries `q` and keys and values `kv`.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_params(
        &self,
        il: usize,
        rope: &Rope,
        q: &Act,
        kv: Option<(&Act, &Act)>,
        norm: Option<HeadNorm>,
        head_dim: usize,
        m: usize,
    ) -> Result<RopeStore, ModelError> {
        let n_head = q.len / m / head_dim;
        let (n_head_kv, head_dim_v) = match &kv {
            Some((k, v)) => (k.len / m / head_dim, v.len * head_dim / k.len),
            None => (0, 0),
        };
        let ptr_of = |v: Option<&[f32]>| v.map_or(Ok(0), |v| self.vptr(v));
        Ok(RopeStore {
            q: self.p(q),
            k: kv.as_ref().map_or(0, |(k, _)| self.p(k)),
            v: kv.as_ref().map_or(0, |(_, v)| self.p(v)),
            q_scale: ptr_of(norm.and_then(|n| n.q))?,
            k_scale: ptr_of(norm.and_then(|n| n.k))?,
            pos: self.step_rows(m)?.0,
            inv_freq: self.rope_table(il)?,
            info: self.row_kv(il, m)?,
            m: m as i32,
            n_head: n_head as i32,
            n_head_kv: n_head_kv as i32,
            head_dim: head_dim as i32,
            head_dim_v: head_dim_v as i32,
            n_rot: rope.n_rot as i32,
            interleaved: rope.interleaved as i32,
            norm: norm.is_some() as i32,
            mscale: rope.mscale,
            eps: norm.map_or(0.0, |n| n.eps),
        })
    }

    /// [`ts_model::Backend::rope_store_attention`]: where the decode attention kernel takes
    /// the rows (few rows, each of its own sequence, heads of at most 256, the layer's own
    /// keys), it also does rope_store's work, one launch instead of two; else the two ops.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_rope_store_attention(
        &self,
        il: usize,
        rope: &Rope,
        q: &mut Act,
        kv: Option<(&mut Act, &Act)>,
        norm: Option<HeadNorm>,
        shape: &AttnShape,
        rows: &[Row],
        seqs: &mut [&mut SeqState<GpuState>],
        exact: bool,
    ) -> Result<Act, ModelError> {
        let m = rows.len();
        let own_sequences = rows.iter().enumerate().all(|(i, r)| rows[..i].iter().all(|o| o.seq != r.seq));
        // Heads of at most 256: the wide kernel's fused path has not run on a GPU.
        let fused = kv.is_some()
            && m > 0
            && own_sequences
            && shape.head_dim.max(shape.head_dim_v) <= 256
            && rope_store_fits(shape.head_dim, rope)
            && self.decode_attention(shape, rows, exact);
        if !fused {
            self.run_rope_store(il, rope, q, kv, norm, shape.head_dim, rows, seqs)?;
            return self.run_attention(il, shape, q, rows, exact, None);
        }
        let params =
            self.rope_store_params(il, rope, q, kv.as_ref().map(|(k, v)| (&**k, *v)), norm, shape.head_dim, m)?;
        self.run_attention(il, shape, q, rows, exact, Some(params))
    }

    /// Whether `run_attention` takes `rows` by the decode kernel (not a prompt's).
    fn decode_attention(&self, shape: &AttnShape, rows: &[Row], exact: bool) -> bool {
        prompt_mma_head(shape, rows, exact).is_none() && !prompt_attention(shape, rows)
    }

    /// [`ts_model::Backend::attention`]; `exact`: f32 throughout (no tensor cores).
    /// With `rope` (decode rows only), the kernel also does rope_store's work
    /// ([`Cuda::run_rope_store_attention`]).
    pub(crate) fn run_attention(
        &self,
        il: usize,
        shape: &AttnShape,
        q: &Act,
        rows: &[Row],
        exact: bool,
        rope: Option<RopeStore>,
    ) -> Result<Act, ModelError> {
        let m = rows.len();
        let info = self.row_kv(il, m)?;
        let out = self.act(m * shape.n_head * shape.head_dim_v)?;
        let sinks = match shape.sinks {
            Some(s) => self.vptr(s)?,
            None => 0,
        };
        if let Some(hd) = prompt_mma_head(shape, rows, exact) {
            let params = PromptAttn {
                q: self.p(q),
                out: self.p(&out),
                info,
                sinks,
                m: m as i32,
                n_head: shape.n_head as i32,
                n_head_kv: shape.n_head_kv as i32,
                hd: hd as i32,
                scale: shape.scale,
                softcap: shape.softcap.unwrap_or(0.0),
                window: self.windows[il],
            };
            let group = shape.n_head / shape.n_head_kv;
            let grid = ((m * group).div_ceil(PROMPT_MMA_ROWS) as u32, shape.n_head_kv as u32, 1);
            self.launch_with(&format!("attention_prompt_mma_{hd}"), grid, (128, 1, 1), &params)?;
            return Ok(out);
        }
        if prompt_attention(shape, rows) {
            let group = shape.n_head / shape.n_head_kv;
            let grid = ((m * group).div_ceil(PROMPT_QUERIES) as u32, shape.n_head_kv as u32, 1);
            let args = [
                Arg::Ptr(self.p(q)),
                Arg::Ptr(self.p(&out)),
                Arg::Ptr(info),
                Arg::I32(m as i32),
                Arg::I32(shape.n_head as i32),
                Arg::I32(shape.n_head_kv as i32),
                Arg::I32(shape.head_dim as i32),
                Arg::I32(shape.head_dim_v as i32),
                Arg::F32(shape.scale),
                Arg::F32(shape.softcap.unwrap_or(0.0)),
                Arg::Ptr(sinks),
                Arg::I32(self.windows[il]),
            ];
            self.launch("attention_prompt", grid, (128, 1, 1), &args)?;
            return Ok(out);
        }
        // Few rows: the output's 8-bit copy for the output projection's matvec, written here.
        let q8 = match m < crate::matmul::GEMM_MIN_ROWS && shape.head_dim_v.is_multiple_of(32) {
            true => Some(self.q8_buffer(m, shape.n_head * shape.head_dim_v)?),
            false => None,
        };
        // The split is fixed by the cache's size, not the position: a recorded step replays it.
        let slots = self.step.lock().expect("step lock").as_ref().and_then(|s| s.slots.get(il).copied()).unwrap_or(0);
        let n_split = match m * shape.n_head <= SPLIT_COUNTERS {
            true => slots
                .div_ceil(crate::device::attention_tile())
                .min(crate::device::attention_max_split(MAX_SPLIT))
                .min(SPLIT_RUNS / (m * shape.n_head).max(1))
                .max(1),
            false => 1,
        };
        let partial = match n_split > 1 {
            true => Some(self.act(m * shape.n_head * n_split * (2 + shape.head_dim_v))?),
            false => None,
        };
        let (kernel, heads_per_block) = decode_kernel(shape);
        let params = DecodeAttn {
            q: self.p(q),
            out: self.p(&out),
            info,
            sinks,
            oq: q8.as_ref().map_or(0, |(q, _)| q.q(0)),
            ods: q8.as_ref().map_or(0, |(q, _)| q.ds(0)),
            partial: partial.as_ref().map_or(0, |a| self.p(a)),
            done: self.gpu.ptr(&self.attn_done),
            n_head: shape.n_head as i32,
            n_head_kv: shape.n_head_kv as i32,
            hd: shape.head_dim as i32,
            hdv: shape.head_dim_v as i32,
            window: self.windows[il],
            heads_per_block: heads_per_block as i32,
            group_from: self.attn_group_from.min(i32::MAX as usize) as i32,
            scale: shape.scale,
            softcap: shape.softcap.unwrap_or(0.0),
            rope: rope.unwrap_or_default(),
        };
        self.launch_with(
            kernel,
            (shape.n_head as u32, m as u32, n_split as u32),
            ((32 * crate::device::attention_warps()) as u32, 1, 1),
            &params,
        )?;
        if let Some((q, buf)) = q8 {
            self.remember_quantized(out.ptr, q, buf);
        }
        Ok(out)
    }
}

/// Counters of decode attention's split runs (`Cuda::attn_done`): rows x query heads.
pub(crate) const SPLIT_COUNTERS: usize = 4096;
// A split decode attention: the live positions of a cache of n slots are cut evenly over at
// most n / tile runs (`device::attention_tile`, 128 positions), one block each working at once.
// With four tiles a run and at most 16 runs, decode on the H200 lost 56% of its speed from
// position 0 to 2048 (qwen3-30b-a3b: 319 to 142 tok/s), llama.cpp 7%.
/// Runs a decode attention is split into at most (64 tiles: 8,192 positions at one tile a run;
/// attention.cu's ATTN_MAX_RUNS).
const MAX_SPLIT: usize = 64;
/// Runs of one launch at most (rows x query heads x runs): each layer's partial sums take
/// room in the step's arena until the step ends, so more rows get fewer runs (one row of 32
/// heads 64, eight rows 16: no more room than at most 16 runs took before).
const SPLIT_RUNS: usize = 4096;

/// The decode attention kernel for heads of this size, and the query heads of one KV head a
/// block takes where a row sees `device::attention_group_from` positions or more: at most the
/// kernel's (8 for heads of up to 128, 4 up to 256, 1 up to 512), its group's, and
/// `device::attention_heads`.
fn decode_kernel(shape: &AttnShape) -> (&'static str, usize) {
    let (kernel, most) = match shape.head_dim.max(shape.head_dim_v) {
        0..=128 => ("attention", 8),
        129..=256 => ("attention_256", 4),
        _ => ("attention_wide", 1),
    };
    (kernel, most.min(crate::device::attention_heads()).min(shape.n_head / shape.n_head_kv).max(1))
}

/// attention.cu's `DecodeAttn`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DecodeAttn {
    q: u64,
    out: u64,
    info: u64,
    sinks: u64,
    oq: u64,
    ods: u64,
    partial: u64,
    done: u64,
    n_head: i32,
    n_head_kv: i32,
    hd: i32,
    hdv: i32,
    window: i32,
    heads_per_block: i32,
    group_from: i32,
    scale: f32,
    softcap: f32,
    rope: RopeStore,
}

const _: () = assert!(std::mem::size_of::<DecodeAttn>() == 208);

/// attention.cu's `ROPE_STORE_MAX_HEAD`.
const ROPE_STORE_MAX_HEAD: usize = 512;

/// Whether attention.cu's `ready_head` takes heads of `head_dim` rotated by `rope`.
fn rope_store_fits(head_dim: usize, rope: &Rope) -> bool {
    head_dim <= ROPE_STORE_MAX_HEAD && rope.n_rot <= head_dim
}

/// attention.cu's `RopeStore`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct RopeStore {
    q: u64,
    k: u64,
    v: u64,
    q_scale: u64,
    k_scale: u64,
    pos: u64,
    inv_freq: u64,
    info: u64,
    m: i32,
    n_head: i32,
    n_head_kv: i32,
    head_dim: i32,
    head_dim_v: i32,
    n_rot: i32,
    interleaved: i32,
    norm: i32,
    mscale: f32,
    eps: f32,
}

/// attention.cu's `PromptAttn`.
#[repr(C)]
#[derive(Clone, Copy)]
struct PromptAttn {
    q: u64,
    out: u64,
    info: u64,
    sinks: u64,
    m: i32,
    n_head: i32,
    n_head_kv: i32,
    hd: i32,
    scale: f32,
    softcap: f32,
    window: i32,
}

const _: () = assert!(std::mem::size_of::<PromptAttn>() == 64);

/// Query rows per block of attention.cu's `attention_prompt_mma_*` (`FA_ROWS`).
const PROMPT_MMA_ROWS: usize = 64;

/// The head size whose `attention_prompt_mma_<hd>` takes these rows: a prompt as for
/// [`prompt_attention`], keys and values of one size, 64 or 128, and f16 arithmetic allowed.
fn prompt_mma_head(shape: &AttnShape, rows: &[Row], exact: bool) -> Option<usize> {
    let hd = shape.head_dim;
    (!exact && prompt_attention(shape, rows) && shape.head_dim_v == hd && matches!(hd, 64 | 128)).then_some(hd)
}

/// Queries per block of attention.cu's `attention_prompt`.
const PROMPT_QUERIES: usize = 32;

/// Whether `attention_prompt` takes these rows: at least 16 of one sequence (a prompt), heads
/// and values of at most 128 (its shared memory), whole groups of query heads per KV head.
fn prompt_attention(shape: &AttnShape, rows: &[Row]) -> bool {
    rows.len() >= 16
        && rows.iter().all(|r| r.seq == rows[0].seq)
        && shape.head_dim <= 128
        && shape.head_dim_v <= 128
        && shape.head_dim.is_multiple_of(2)
        && shape.n_head.is_multiple_of(shape.n_head_kv)
}
