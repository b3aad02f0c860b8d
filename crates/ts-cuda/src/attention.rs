//! Attention layers on the device: their KV caches (f32, a ring for sliding
//! layers), rotary embeddings and the attention kernel (ops.cu).

use crate::device::Arg;
use crate::{Act, Cuda, GpuLayerState, GpuState, err};
use ts_cpu::ops::Rope;
use ts_model::backend::AttnShape;
use ts_model::state::ring_slots;
use ts_model::{ModelError, Row};

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
        let step = self.step.lock().expect("step lock");
        let step = step
            .as_ref()
            .filter(|s| s.m == rows.len())
            .ok_or_else(|| ModelError::Compute("cuda: rope outside a step".into()))?;
        let n_heads = x.len / rows.len() / head_dim;
        self.launch(
            "rope",
            ((rows.len() * n_heads) as u32, 1, 1),
            (64, 1, 1),
            &[
                Arg::Ptr(self.p(x)),
                Arg::Ptr(self.gpu.ptr(&step.pos)),
                Arg::Ptr(
                    self.gpu.ptr(
                        self.ropes[il]
                            .as_ref()
                            .ok_or_else(|| ModelError::Compute(format!("cuda: layer {il} has no rope")))?,
                    ),
                ),
                Arg::I32(n_heads as i32),
                Arg::I32(head_dim as i32),
                Arg::I32(rope.n_rot as i32),
                Arg::I32(rope.interleaved as i32),
                Arg::F32(rope.mscale),
            ],
        )
    }

    /// [`ts_model::Backend::attention`].
    pub(crate) fn run_attention(
        &self,
        il: usize,
        shape: &AttnShape,
        q: &Act,
        kv: Option<(&Act, &Act)>,
        rows: &[Row],
    ) -> Result<Act, ModelError> {
        let step = self.step.lock().expect("step lock");
        let step = step
            .as_ref()
            .filter(|s| s.m == rows.len())
            .ok_or_else(|| ModelError::Compute("cuda: attention outside a step".into()))?;
        let m = rows.len();
        let info = self.gpu.ptr(&step.kv) + (il * m * 24) as u64;
        let (kv_dim, v_dim) = (shape.n_head_kv * shape.head_dim, shape.n_head_kv * shape.head_dim_v);
        // A layer sharing another's cache stores nothing (its RowKv entries point at that cache).
        if let Some((k, v)) = kv {
            self.launch(
                "kv_store",
                (m as u32, 1, 1),
                (256, 1, 1),
                &[
                    Arg::Ptr(self.p(k)),
                    Arg::Ptr(self.p(v)),
                    Arg::Ptr(info),
                    Arg::I32(kv_dim as i32),
                    Arg::I32(v_dim as i32),
                ],
            )?;
        }
        let out = self.act(m * shape.n_head * shape.head_dim_v)?;
        let sinks = match shape.sinks {
            Some(s) => self.vptr(s)?,
            None => 0,
        };
        let args = |rows: Option<i32>| {
            let mut a = vec![Arg::Ptr(self.p(q)), Arg::Ptr(self.p(&out)), Arg::Ptr(info)];
            a.extend(rows.map(Arg::I32));
            a.extend([
                Arg::I32(shape.n_head as i32),
                Arg::I32(shape.n_head_kv as i32),
                Arg::I32(shape.head_dim as i32),
                Arg::I32(shape.head_dim_v as i32),
                Arg::F32(shape.scale),
                Arg::F32(shape.softcap.unwrap_or(0.0)),
                Arg::Ptr(sinks),
                Arg::I32(self.windows[il]),
            ]);
            a
        };
        if prompt_attention(shape, rows) {
            let group = shape.n_head / shape.n_head_kv;
            let grid = ((m * group).div_ceil(PROMPT_QUERIES) as u32, shape.n_head_kv as u32, 1);
            self.launch("attention_prompt", grid, (128, 1, 1), &args(Some(m as i32)))?;
            return Ok(out);
        }
        self.launch(
            if shape.head_dim.max(shape.head_dim_v) > 256 { "attention_wide" } else { "attention" },
            (shape.n_head as u32, m as u32, 1),
            (128, 1, 1),
            &args(None),
        )?;
        Ok(out)
    }
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
