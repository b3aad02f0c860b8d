//! What computes: the ops the forward pass is written in. The model code is
//! generic over a [`Backend`]; [`Cpu`] is the reference every other backend is
//! tested against, op by op.
//!
//! Activations ([`Backend::Act`]) are row-major `[m][width]` f32 matrices in the
//! backend's memory; an op takes `m` and reads widths from its weights.

use crate::ModelError;
use crate::forward::{Model, Row, Scratch, linear};
use crate::kv::{CpuKv, SeqState};
use crate::tensors::MoeWeights;
use crate::weights::Weight;
use rayon::prelude::*;
use ts_cpu::ops::{self, AttentionParams, GatedActivation, Rope};

/// One layer's attention settings, as the attention op needs them.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape<'a> {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    /// Per query head, an extra logit in the softmax denominator (gpt-oss).
    pub sinks: Option<&'a [f32]>,
}

pub trait Backend: Sized + Send + Sync {
    /// `[m][width]` f32 activations.
    type Act: Send + Sync;
    /// One sequence's keys and values for every layer.
    type Kv: Send + Sync;
    /// Buffers reused across steps.
    type Scratch: Send;

    /// What computes, in a word (`cpu`, `cuda`), for reports.
    fn name(&self) -> &'static str;
    fn scratch(&self, exact_activations: bool) -> Self::Scratch;
    /// Caches for `n_ctx` positions of `model`, filled `max_chunk` rows at a time.
    fn new_kv(&self, model: &Model<Self>, n_ctx: usize, max_chunk: usize) -> Result<Self::Kv, ModelError>;

    /// Called once at the start of each forward step with its rows and sequences.
    fn begin_step(&self, _rows: &[Row], _seqs: &mut [&mut SeqState<Self::Kv>]) -> Result<(), ModelError> {
        Ok(())
    }

    /// Called once at the end of each forward step, after its last op and before
    /// its logits are read.
    fn end_step(&self) -> Result<(), ModelError> {
        Ok(())
    }

    /// Rows `tokens` of the embedding table `table` `[n_vocab][n_embd]`.
    fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Self::Act, ModelError>;
    /// `x[m][k] · wᵀ (+ bias)` for `w` of ggml shape `[k, n_out]` and `bias`
    /// `[n_out]` added to every row; returns `[m][n_out]`.
    fn linear(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: &Self::Act,
        m: usize,
        s: &mut Self::Scratch,
    ) -> Result<Self::Act, ModelError>;
    /// RMS norm of every `piece`-wide piece of `x`, times `w` `[piece]` where given.
    fn rms_norm(&self, x: &mut Self::Act, piece: usize, w: Option<&[f32]>, eps: f32) -> Result<(), ModelError>;
    /// [`Backend::rms_norm`] into a new matrix, `x` untouched.
    fn rms_norm_to(&self, x: &Self::Act, w: &[f32], eps: f32) -> Result<Self::Act, ModelError>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<(), ModelError>;
    fn scale(&self, x: &mut Self::Act, s: f32) -> Result<(), ModelError>;
    /// `c * tanh(x / c)` elementwise.
    fn softcap(&self, x: &mut Self::Act, c: f32) -> Result<(), ModelError>;
    /// `gate = act(gate, up)` elementwise.
    fn gated(&self, act: GatedActivation, gate: &mut Self::Act, up: &Self::Act) -> Result<(), ModelError>;
    /// Rotates each `head_dim` head of row i at `rows[i].pos` with layer `il`'s table `rope`.
    fn rope(&self, il: usize, rope: &Rope, x: &mut Self::Act, head_dim: usize, rows: &[Row]) -> Result<(), ModelError>;
    /// Stores each row's k and v at its position in its sequence's layer-`il`
    /// cache, then attends each row's q over the positions it sees; returns
    /// `[m][n_head * head_dim_v]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        il: usize,
        shape: &AttnShape,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::Kv>],
    ) -> Result<Self::Act, ModelError>;
    /// `y[r] *= sigmoid(gate · x[r])` for rows of `gate.len()` (a sigmoid-gated shared expert).
    fn sigmoid_gate(&self, y: &mut Self::Act, x: &Self::Act, gate: &[f32]) -> Result<(), ModelError>;
    /// The routed experts of MoE layer `il` on the normed input `x` `[m][n_embd]`.
    fn moe(
        &self,
        model: &Model<Self>,
        il: usize,
        w: &MoeWeights,
        x: &Self::Act,
        m: usize,
        s: &mut Self::Scratch,
    ) -> Result<Self::Act, ModelError>;
    /// Rows `rows` of `x` (each `width` wide), in that order.
    fn select_rows(&self, x: &Self::Act, width: usize, rows: &[usize]) -> Result<Self::Act, ModelError>;
    fn to_host(&self, x: &Self::Act) -> Result<Vec<f32>, ModelError>;

    /// Counters of an expert cache the backend keeps itself (a GPU's VRAM cache).
    fn expert_stats(&self) -> Option<ts_experts::StatsSnapshot> {
        None
    }
}

/// The CPU: rayon threads, SIMD kernels of `ts-cpu`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Backend for Cpu {
    type Act = Vec<f32>;
    type Kv = CpuKv;
    type Scratch = Scratch;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn scratch(&self, exact_activations: bool) -> Scratch {
        if exact_activations { Scratch::exact() } else { Scratch::default() }
    }

    fn new_kv(&self, model: &Model<Self>, n_ctx: usize, max_chunk: usize) -> Result<CpuKv, ModelError> {
        Ok(CpuKv::new(&model.cfg, n_ctx, max_chunk))
    }

    fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let e = table.row_len();
        let row_bytes = table.row_bytes();
        let mut x = vec![0f32; tokens.len() * e];
        for (&t, out) in tokens.iter().zip(x.chunks_exact_mut(e)) {
            let t = t as usize;
            ts_quant::dequantize(table.ty, &table.bytes()[t * row_bytes..(t + 1) * row_bytes], out)
                .map_err(|err| ModelError::Compute(format!("{}: {err}", table.name)))?;
        }
        Ok(x)
    }

    fn linear(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: &Vec<f32>,
        m: usize,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::new();
        linear(w, x, m, s, &mut out)?;
        if let Some(b) = bias {
            ops::add_bias_rows(&mut out, b);
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &mut Vec<f32>, piece: usize, w: Option<&[f32]>, eps: f32) -> Result<(), ModelError> {
        ops::rms_norm_pieces(x, piece, w, eps);
        Ok(())
    }

    fn rms_norm_to(&self, x: &Vec<f32>, w: &[f32], eps: f32) -> Result<Vec<f32>, ModelError> {
        let e = w.len();
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(e).zip(x.par_chunks(e)).for_each(|(o, r)| ops::rms_norm(r, Some(w), eps, o));
        Ok(out)
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), ModelError> {
        ops::add_inplace(x, y);
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<(), ModelError> {
        ops::scale_inplace(x, s);
        Ok(())
    }

    fn softcap(&self, x: &mut Vec<f32>, c: f32) -> Result<(), ModelError> {
        x.iter_mut().for_each(|l| *l = c * (*l / c).tanh());
        Ok(())
    }

    fn gated(&self, act: GatedActivation, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<(), ModelError> {
        ops::gated_activation(act, gate, up);
        Ok(())
    }

    fn rope(&self, _il: usize, rope: &Rope, x: &mut Vec<f32>, head_dim: usize, rows: &[Row]) -> Result<(), ModelError> {
        let width = x.len() / rows.len().max(1);
        for (r, xr) in rows.iter().zip(x.chunks_exact_mut(width)) {
            rope.apply(xr, head_dim, r.pos as u32);
        }
        Ok(())
    }

    fn attention(
        &self,
        il: usize,
        shape: &AttnShape,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        rows: &[Row],
        seqs: &mut [&mut SeqState<CpuKv>],
    ) -> Result<Vec<f32>, ModelError> {
        let (hd, hdv) = (shape.head_dim, shape.head_dim_v);
        let (q_dim, kv_dim, v_dim) = (shape.n_head * hd, shape.n_head_kv * hd, shape.n_head_kv * hdv);
        for (i, r) in rows.iter().enumerate() {
            let cache = &mut seqs[r.seq].kv.layers[il];
            cache.store(r.pos, &k[i * kv_dim..(i + 1) * kv_dim], &v[i * v_dim..(i + 1) * v_dim]);
        }
        let group = shape.n_head / shape.n_head_kv;
        let mut out = vec![0f32; rows.len() * shape.n_head * hdv];
        let seqs: &[&mut SeqState<CpuKv>] = seqs;
        out.par_chunks_mut(hdv).enumerate().for_each_init(Vec::new, |scores, (idx, o)| {
            let (i, h) = (idx / shape.n_head, idx % shape.n_head);
            let r = rows[i];
            let cache = &seqs[r.seq].kv.layers[il];
            let kvh = h / group;
            let params =
                AttentionParams { scale: shape.scale, softcap: shape.softcap, sink: shape.sinks.map(|s| s[h]) };
            let visible = cache.visible(r.pos);
            ops::attend(
                &q[i * q_dim + h * hd..i * q_dim + (h + 1) * hd],
                visible.clone().map(|p| cache.key(p, kvh * hd, hd)),
                visible.map(|p| cache.value(p, kvh * hdv, hdv)),
                &params,
                scores,
                o,
            );
        });
        Ok(out)
    }

    fn sigmoid_gate(&self, y: &mut Vec<f32>, x: &Vec<f32>, gate: &[f32]) -> Result<(), ModelError> {
        let e = gate.len();
        for (yr, xr) in y.chunks_exact_mut(e).zip(x.chunks_exact(e)) {
            let dot: f32 = gate.iter().zip(xr).map(|(a, b)| a * b).sum();
            ops::scale_inplace(yr, ops::sigmoid(dot));
        }
        Ok(())
    }

    fn moe(
        &self,
        model: &Model<Self>,
        il: usize,
        w: &MoeWeights,
        x: &Vec<f32>,
        m: usize,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let next = model.prefetch_experts.then(|| model.next_moe_layer(il)).flatten();
        crate::moe::moe_ffn(&model.cfg, il, w, next, model.experts.as_ref(), x, m, s)
    }

    fn select_rows(&self, x: &Vec<f32>, width: usize, rows: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(rows.iter().flat_map(|&i| x[i * width..(i + 1) * width].iter().copied()).collect())
    }

    fn to_host(&self, x: &Vec<f32>) -> Result<Vec<f32>, ModelError> {
        Ok(x.clone())
    }
}
