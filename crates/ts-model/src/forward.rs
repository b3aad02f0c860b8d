//! The transformer, written once for every family from shared blocks:
//! norm, attention over the KV cache, dense FFN, MoE FFN. A forward step takes
//! rows (token, position, sequence) from one or several sequences; every
//! weight matrix is read once per step for all rows.

use crate::ModelError;
use crate::config::{ArchConfig, QkNorm, RopeScaling};
use crate::kv::SeqState;
use crate::moe;
use crate::tensors::{Ffn, LayerWeights, ModelWeights};
use crate::weights::Weight;
use rayon::prelude::*;
use ts_cpu::QuantizedRows;
use ts_cpu::ops::{self, AttentionParams, Rope};
use ts_experts::ExpertStore;

/// One token to run: its id, its position and the sequence it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub token: u32,
    pub pos: usize,
    /// Index into the `seqs` slice given to [`Model::forward`].
    pub seq: usize,
    /// Whether this row's logits are wanted.
    pub logits: bool,
}

/// Buffers reused across steps, and how matmuls treat activations.
#[derive(Default)]
pub struct Scratch {
    xq: QuantizedRows,
    dequantized: Vec<f32>,
    /// Keep activations in f32 for every weight type (weights dequantized on
    /// the fly) instead of quantizing them to 8 bits as llama.cpp does: slower,
    /// and equal to a float32 reference run on the dequantized weights.
    pub exact_activations: bool,
}

impl Scratch {
    pub fn exact() -> Scratch {
        Scratch { exact_activations: true, ..Scratch::default() }
    }
}

/// `out[m][n_out] = x[m][k] · Wᵀ`, with `W` of shape `[k, n_out]` in ggml order.
pub fn linear(w: &Weight, x: &[f32], m: usize, scratch: &mut Scratch, out: &mut Vec<f32>) -> Result<(), ModelError> {
    linear_bytes(w, w.bytes(), w.n_rows(), x, m, scratch, out)
}

/// [`linear`] over explicit bytes of `n_out` rows of `w`'s type (one expert of a stacked tensor).
pub fn linear_bytes(
    w: &Weight,
    bytes: &[u8],
    n_out: usize,
    x: &[f32],
    m: usize,
    scratch: &mut Scratch,
    out: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let k = w.row_len();
    out.resize(m * n_out, 0.0);
    let err = |e: String| ModelError::Compute(format!("{}: {e}", w.name));
    let (ty, bytes) = if scratch.exact_activations && w.ty != ts_gguf::GgmlType::F32 {
        scratch.dequantized.resize(n_out * k, 0.0);
        ts_quant::dequantize(w.ty, bytes, &mut scratch.dequantized).map_err(|e| err(e.to_string()))?;
        (ts_gguf::GgmlType::F32, bytemuck::cast_slice::<f32, u8>(&scratch.dequantized))
    } else {
        (w.ty, bytes)
    };
    scratch.xq.quantize(ty, &x[..m * k], k).map_err(|e| err(e.to_string()))?;
    ts_cpu::matmul(ty, bytes, n_out, k, &scratch.xq, out).map_err(|e| err(e.to_string()))
}

/// Rotary tables for one layer's settings (frequencies with scaling folded
/// in); `freq_factors` divide the frequencies (Llama 3's `rope_freqs`).
pub fn build_rope(cfg: &crate::config::RopeConfig, freq_factors: Option<&[f32]>) -> Rope {
    let n = cfg.n_rot;
    let base = cfg.freq_base as f64;
    let extrapolated: Vec<f64> =
        (0..n / 2).map(|i| base.powf(-2.0 * i as f64 / n as f64) / freq_factors.map_or(1.0, |f| f[i] as f64)).collect();
    let (inv_freq, mscale): (Vec<f64>, f64) = match cfg.scaling {
        RopeScaling::None => (extrapolated, 1.0),
        RopeScaling::Linear { factor } => (extrapolated.iter().map(|f| f / factor as f64).collect(), 1.0),
        RopeScaling::Yarn { factor, original_context, beta_fast, beta_slow, truncate } => {
            // YaRN (arXiv:2309.00071): dimension i keeps its original frequency when it turns
            // more than beta_fast times over the original context, is interpolated by 1/factor
            // below beta_slow, and ramps linearly between (ggml_rope_yarn_corr_dims).
            let factor = factor as f64;
            let corr = |rotations: f64| {
                n as f64 * (original_context as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
            };
            let (mut lo, mut hi) = (corr(beta_fast as f64), corr(beta_slow as f64));
            if truncate {
                lo = lo.floor();
                hi = hi.ceil();
            }
            let (lo, hi) = (lo.max(0.0), hi.min(n as f64 - 1.0));
            let freqs = extrapolated
                .iter()
                .enumerate()
                .map(|(i, &f)| {
                    let keep = 1.0 - ((i as f64 - lo) / (hi - lo).max(0.001)).clamp(0.0, 1.0);
                    f / factor * (1.0 - keep) + f * keep
                })
                .collect();
            (freqs, 1.0 + 0.1 * factor.ln())
        }
    };
    Rope {
        layout: cfg.layout,
        n_rot: n,
        inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
        mscale: (mscale * cfg.attn_factor as f64) as f32,
    }
}

/// A model ready to run: configuration, weights and per-layer rotary tables.
pub struct Model {
    pub cfg: ArchConfig,
    pub weights: ModelWeights,
    pub experts: Box<dyn ExpertStore>,
    /// Guess the next MoE layer's experts from this layer's input and start reading them.
    pub prefetch_experts: bool,
    ropes: Vec<Rope>,
}

impl Model {
    pub fn new(cfg: ArchConfig, weights: ModelWeights, experts: Box<dyn ExpertStore>) -> Model {
        let ropes = cfg.layers.iter().map(|l| build_rope(&l.rope, weights.rope_freqs.as_deref())).collect();
        Model { cfg, weights, experts, prefetch_experts: false, ropes }
    }

    /// The next layer after `il` with routed experts, and its weights.
    fn next_moe_layer(&self, il: usize) -> Option<(usize, &crate::tensors::MoeWeights)> {
        self.weights.layers.iter().enumerate().skip(il + 1).find_map(|(i, l)| match &l.ffn {
            Ffn::Moe(w) => Some((i, w)),
            Ffn::Dense { .. } => None,
        })
    }

    /// Runs `rows` through the model, updating each row's sequence cache, and
    /// returns the logits of the rows that asked for them, in row order.
    pub fn forward(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState],
        scratch: &mut Scratch,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.cfg;
        let m = rows.len();
        let e = cfg.n_embd;
        for r in rows {
            let seq = seqs
                .get(r.seq)
                .ok_or_else(|| ModelError::Compute(format!("row names sequence {} of {}", r.seq, seqs.len())))?;
            if r.pos >= seq.n_ctx {
                return Err(ModelError::ContextFull { pos: r.pos, n_ctx: seq.n_ctx });
            }
            if r.token as usize >= cfg.n_vocab {
                return Err(ModelError::TokenOutOfRange { token: r.token, n_vocab: cfg.n_vocab });
            }
        }

        let mut x = self.embed(rows)?;
        let mut normed = vec![0f32; m * e];
        let mut tmp = Vec::new();
        for (il, layer) in self.weights.layers.iter().enumerate() {
            rms_norm_rows(&x, &layer.attn_norm, cfg.rms_eps, &mut normed);
            let mut attn = self.attention(il, layer, rows, seqs, &normed, scratch)?;
            linear(&layer.wo, &attn, m, scratch, &mut tmp)?;
            std::mem::swap(&mut attn, &mut tmp);
            if let Some(b) = &layer.bo {
                ops::add_bias_rows(&mut attn, b);
            }
            if let Some(w) = &layer.attn_post_norm {
                rms_norm_rows_inplace(&mut attn, w, cfg.rms_eps);
            }
            ops::add_inplace(&mut x, &attn);

            rms_norm_rows(&x, &layer.ffn_norm, cfg.rms_eps, &mut normed);
            let mut ffn = match &layer.ffn {
                Ffn::Dense { gate, up, down } => dense_ffn(cfg, gate, up, down, &normed, m, scratch)?,
                Ffn::Moe(w) => {
                    let next = self.prefetch_experts.then(|| self.next_moe_layer(il)).flatten();
                    moe::moe_ffn(cfg, il, w, next, self.experts.as_ref(), &normed, m, scratch)?
                }
            };
            if let Some(w) = &layer.ffn_post_norm {
                rms_norm_rows_inplace(&mut ffn, w, cfg.rms_eps);
            }
            ops::add_inplace(&mut x, &ffn);
        }
        for r in rows {
            let s = &mut seqs[r.seq];
            s.n_past = s.n_past.max(r.pos + 1);
        }
        self.output(rows, &x, scratch)
    }

    /// Token embeddings, `[m][n_embd]`, scaled where the family does.
    fn embed(&self, rows: &[Row]) -> Result<Vec<f32>, ModelError> {
        let table = &self.weights.token_embd;
        let e = self.cfg.n_embd;
        let row_bytes = table.row_bytes();
        let mut x = vec![0f32; rows.len() * e];
        for (r, out) in rows.iter().zip(x.chunks_exact_mut(e)) {
            let t = r.token as usize;
            ts_quant::dequantize(table.ty, &table.bytes()[t * row_bytes..(t + 1) * row_bytes], out)
                .map_err(|err| ModelError::Compute(format!("{}: {err}", table.name)))?;
        }
        if let Some(s) = self.cfg.embed_scale {
            ops::scale_inplace(&mut x, s);
        }
        Ok(x)
    }

    /// Self-attention of every row; returns `[m][n_head * head_dim_v]`.
    fn attention(
        &self,
        il: usize,
        layer: &LayerWeights,
        rows: &[Row],
        seqs: &mut [&mut SeqState],
        normed: &[f32],
        scratch: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        let cfg = &self.cfg;
        let m = rows.len();
        let (hd, hdv) = (cfg.head_dim, cfg.head_dim_v);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        linear(&layer.wq, normed, m, scratch, &mut q)?;
        linear(&layer.wk, normed, m, scratch, &mut k)?;
        linear(&layer.wv, normed, m, scratch, &mut v)?;
        for (t, b) in [(&mut q, &layer.bq), (&mut k, &layer.bk), (&mut v, &layer.bv)] {
            if let Some(b) = b {
                ops::add_bias_rows(t, b);
            }
        }
        let (q_dim, kv_dim, v_dim) = (cfg.q_dim(), cfg.kv_dim(), cfg.v_dim());
        match cfg.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead => {
                ops::rms_norm_pieces(&mut q, hd, layer.q_norm.as_deref(), cfg.rms_eps);
                ops::rms_norm_pieces(&mut k, hd, layer.k_norm.as_deref(), cfg.rms_eps);
            }
            QkNorm::Full => {
                ops::rms_norm_pieces(&mut q, q_dim, layer.q_norm.as_deref(), cfg.rms_eps);
                ops::rms_norm_pieces(&mut k, kv_dim, layer.k_norm.as_deref(), cfg.rms_eps);
            }
        }
        let rope = &self.ropes[il];
        for (i, r) in rows.iter().enumerate() {
            rope.apply(&mut q[i * q_dim..(i + 1) * q_dim], hd, r.pos as u32);
            rope.apply(&mut k[i * kv_dim..(i + 1) * kv_dim], hd, r.pos as u32);
            let cache = &mut seqs[r.seq].layers[il];
            cache.store(r.pos, &k[i * kv_dim..(i + 1) * kv_dim], &v[i * v_dim..(i + 1) * v_dim]);
        }

        let group = cfg.n_head / cfg.n_head_kv;
        let mut out = vec![0f32; m * cfg.n_head * hdv];
        let seqs: &[&mut SeqState] = seqs;
        out.par_chunks_mut(hdv).enumerate().for_each_init(Vec::new, |scores, (idx, o)| {
            let (i, h) = (idx / cfg.n_head, idx % cfg.n_head);
            let r = rows[i];
            let cache = &seqs[r.seq].layers[il];
            let kvh = h / group;
            let params =
                AttentionParams { scale: cfg.attn_scale, softcap: None, sink: layer.sinks.as_ref().map(|s| s[h]) };
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

    /// Final norm and output head for the rows that want logits.
    fn output(&self, rows: &[Row], x: &[f32], scratch: &mut Scratch) -> Result<Vec<Vec<f32>>, ModelError> {
        let e = self.cfg.n_embd;
        let wanted: Vec<usize> = rows.iter().enumerate().filter(|(_, r)| r.logits).map(|(i, _)| i).collect();
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let mut normed = vec![0f32; wanted.len() * e];
        for (j, &i) in wanted.iter().enumerate() {
            ops::rms_norm(
                &x[i * e..(i + 1) * e],
                Some(&self.weights.output_norm),
                self.cfg.rms_eps,
                &mut normed[j * e..(j + 1) * e],
            );
        }
        let mut logits = Vec::new();
        linear(&self.weights.output, &normed, wanted.len(), scratch, &mut logits)?;
        if let Some(b) = &self.weights.output_bias {
            ops::add_bias_rows(&mut logits, b);
        }
        if let Some(c) = self.cfg.final_softcap {
            logits.iter_mut().for_each(|l| *l = c * (*l / c).tanh());
        }
        Ok(logits.chunks_exact(self.cfg.n_vocab).map(<[f32]>::to_vec).collect())
    }
}

pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let e = w.len();
    out.par_chunks_mut(e).zip(x.par_chunks(e)).for_each(|(o, r)| ops::rms_norm(r, Some(w), eps, o));
}

fn rms_norm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    ops::rms_norm_pieces(x, w.len(), Some(w), eps);
}

/// `down(act(gate · x) * (up · x))` for `m` rows.
pub fn dense_ffn(
    cfg: &ArchConfig,
    gate: &Weight,
    up: &Weight,
    down: &Weight,
    x: &[f32],
    m: usize,
    scratch: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let (mut g, mut u, mut out) = (Vec::new(), Vec::new(), Vec::new());
    linear(gate, x, m, scratch, &mut g)?;
    linear(up, x, m, scratch, &mut u)?;
    ops::gated_activation(cfg.ffn_act, &mut g, &u);
    linear(down, &g, m, scratch, &mut out)?;
    Ok(out)
}
