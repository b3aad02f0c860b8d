//! The transformer, written once for every family from shared blocks:
//! norm, attention over the KV cache, dense FFN, MoE FFN. A forward step takes
//! rows (token, position, sequence) from one or several sequences; every
//! weight matrix is read once per step for all rows.

use crate::Cpu;
use crate::ModelError;
use crate::backend::{AttnShape, Backend, HeadNorm, StepStart};
use crate::config::{ArchConfig, GatedActivation, LayerConfig, QkNorm, RopeLayout, RopeScaling};
use crate::state::{SeqState, Snapshot};
use crate::tensors::{AttnWeights, Ffn, LayerWeights, MixerWeights, ModelWeights, MoeWeights};
use crate::weights::Weight;
use std::ops::Range;
use ts_cpu::QuantizedRows;
use ts_cpu::ops::Rope;
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

/// A step's rows as the backend runs them ([`Model::padded`]): each computing logits, and
/// which of those rows' logits the caller asked for.
struct PaddedRows {
    rows: Vec<Row>,
    read: Range<usize>,
}

/// Buffers reused across steps, and how matmuls treat activations.
#[derive(Default)]
pub struct Scratch {
    /// The last product's activations, quantized (what [`linear_bytes_again`] reads).
    pub(crate) xq: QuantizedRows,
    /// Keep activations in f32 for every weight type (weights dequantized on
    /// the fly) instead of quantizing them to 8 bits as llama.cpp does: slower,
    /// and equal to a float32 reference run on the dequantized weights.
    pub exact_activations: bool,
    /// Compute every row as a one-row step would, bit for bit (no batch kernels): the
    /// checking steps of speculative decoding, whose rows must give what one-row steps give.
    pub rows_alone: bool,
}

impl Scratch {
    pub fn exact() -> Scratch {
        Scratch { exact_activations: true, ..Scratch::default() }
    }

    /// A new scratch that computes as this one does (its mode, not its buffers).
    pub fn same_mode(&self) -> Scratch {
        Scratch { exact_activations: self.exact_activations, rows_alone: self.rows_alone, ..Scratch::default() }
    }

    /// ts-cpu's matmul for this scratch's mode (`rows_alone`: no batch kernels).
    fn cpu_matmul(&self) -> CpuMatmul {
        if self.rows_alone { ts_cpu::matmul_rows_alone } else { ts_cpu::matmul }
    }
}

/// The signature of [`ts_cpu::matmul`] and [`ts_cpu::matmul_rows_alone`].
type CpuMatmul = fn(ts_gguf::GgmlType, &[u8], usize, usize, &QuantizedRows, &mut [f32]) -> Result<(), ts_cpu::CpuError>;

/// `out[m][n_out] = x[m][k] · Wᵀ`, with `W` of shape `[k, n_out]` in ggml order.
pub fn linear(w: &Weight, x: &[f32], m: usize, scratch: &mut Scratch, out: &mut Vec<f32>) -> Result<(), ModelError> {
    linear_bytes(w, w.bytes(), w.is_packed(), w.n_rows(), x, m, scratch, out)
}

/// [`linear`] over explicit bytes of `n_out` rows of `w`'s type (one expert of a stacked
/// tensor), in the GGUF layout or, with `packed`, the CPU's packed one
/// ([`Model::pack_experts`], which takes 8-bit activations only).
#[allow(clippy::too_many_arguments)]
pub fn linear_bytes(
    w: &Weight,
    bytes: &[u8],
    packed: bool,
    n_out: usize,
    x: &[f32],
    m: usize,
    scratch: &mut Scratch,
    out: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let k = w.row_len();
    outputs_zeroed(out, m, n_out);
    let err = |e: String| ModelError::Compute(format!("{}: {e}", w.name));
    if scratch.exact_activations && w.ty != ts_gguf::GgmlType::F32 {
        if packed {
            return Err(err("matrices packed for the CPU take 8-bit activations, not exact ones".into()));
        }
        return linear_dequantized(w, bytes, n_out, x, m, scratch, out).map_err(err);
    }
    scratch.xq.quantize(w.ty, &x[..m * k], k).map_err(|e| err(e.to_string()))?;
    matmul_quantized(w, bytes, packed, n_out, scratch, out)
}

/// [`linear_bytes`] of the activations `scratch.xq` already holds, quantized for a weight of
/// `w`'s type (another matrix of that type, of the same input: an expert's up after its gate).
pub fn linear_bytes_again(
    w: &Weight,
    bytes: &[u8],
    packed: bool,
    n_out: usize,
    scratch: &mut Scratch,
    out: &mut Vec<f32>,
) -> Result<(), ModelError> {
    let held_for = ts_cpu::activation_type(w.ty).ok();
    if scratch.exact_activations || scratch.xq.k() != w.row_len() || held_for != Some(scratch.xq.ty()) {
        return Err(ModelError::Compute(format!("{}: no 8-bit activations of its rows held", w.name)));
    }
    outputs_zeroed(out, scratch.xq.m(), n_out);
    matmul_quantized(w, bytes, packed, n_out, scratch, out)
}

/// Makes the activations `scratch` holds for [`linear_bytes_again`] rows `rows` of `xq` (a
/// batch quantized once, each expert taking its rows' blocks).
pub(crate) fn hold_quantized_rows(
    scratch: &mut Scratch,
    xq: &ts_cpu::QuantizedRows,
    rows: &[usize],
) -> Result<(), ModelError> {
    scratch.xq.gather(xq, rows).map_err(|e| ModelError::Compute(format!("activation rows: {e}")))
}

/// `out` `[m][n_out]` = `scratch.xq` · `bytes`' rows, through the packed or the GGUF layout's kernels.
fn matmul_quantized(
    w: &Weight,
    bytes: &[u8],
    packed: bool,
    n_out: usize,
    scratch: &Scratch,
    out: &mut [f32],
) -> Result<(), ModelError> {
    let k = w.row_len();
    let result = match packed {
        true => ts_cpu::matmul_packed(w.ty, bytes, n_out, k, &scratch.xq, out, n_out),
        false => scratch.cpu_matmul()(w.ty, bytes, n_out, k, &scratch.xq, out),
    };
    result.map_err(|e| ModelError::Compute(format!("{}: {e}", w.name)))
}

/// `v` made `n` long, new elements 0: past [`ZERO_OVER_THREADS`] floats the zeros are written
/// over the threads (a prompt's fresh product outputs, zeroed on the step's thread, held the
/// others waiting).
/// [`resize_zeroed`] of a product's output `[m][n_out]`; one row's timed as such by the CPU's
/// timing knob (on the step's thread: a batch's experts run this on the team's).
fn outputs_zeroed(v: &mut Vec<f32>, m: usize, n_out: usize) {
    use crate::cpu_timing::{Phase, timing};
    match m {
        1 => timing().time(Phase::Outputs, || resize_zeroed(v, n_out)),
        _ => resize_zeroed(v, m * n_out),
    }
}

pub(crate) fn resize_zeroed(v: &mut Vec<f32>, n: usize) {
    /// Floats from which zeroing is spread over the threads (256 KiB), and an item's share.
    const ZERO_OVER_THREADS: usize = 64 << 10;
    if n <= v.len() || n - v.len() < ZERO_OVER_THREADS {
        v.resize(n, 0.0);
        return;
    }
    let len = v.len();
    v.reserve(n - len);
    let fresh = &mut v.spare_capacity_mut()[..n - len];
    ts_cpu::team::for_each_chunk(fresh, ZERO_OVER_THREADS, &|_, part| {
        part.iter_mut().for_each(|x| _ = x.write(0.0));
    });
    // SAFETY: elements `len..n` were each written just above.
    unsafe { v.set_len(n) };
}

/// Floats of dequantized weight per tile of [`linear_dequantized`]: 128 KiB, in cache.
const DEQUANTIZED_TILE: usize = 32 * 1024;

/// [`linear_bytes`] with f32 activations for a weight stored in another type:
/// tiles of rows are dequantized to f32 and multiplied in parallel, so the
/// matrix is never expanded whole (that cost a pass over 4x its bytes per call).
fn linear_dequantized(
    w: &Weight,
    bytes: &[u8],
    n_out: usize,
    x: &[f32],
    m: usize,
    scratch: &mut Scratch,
    out: &mut [f32],
) -> Result<(), String> {
    use rayon::prelude::*;
    let (k, row_bytes) = (w.row_len(), w.row_bytes());
    if k == 0 || bytes.len() != n_out * row_bytes || x.len() < m * k {
        return Err(format!(
            "{} rows of {k} elements need {} weight bytes and {} activations; got {} and {}",
            n_out,
            n_out * row_bytes,
            m * k,
            bytes.len(),
            x.len()
        ));
    }
    if m == 0 || n_out == 0 {
        return Ok(());
    }
    let tile = (DEQUANTIZED_TILE / k).max(1);
    scratch.xq.quantize(ts_gguf::GgmlType::F32, &x[..m * k], k).map_err(|e| e.to_string())?;
    let xq = &scratch.xq;
    let matmul = scratch.cpu_matmul();
    let starts: Vec<usize> = (0..n_out).step_by(tile).collect();
    // Per tile: its rows' results for each activation row, [m][rows].
    let parts: Vec<Result<Vec<f32>, String>> = starts
        .par_iter()
        .map_init(Vec::new, |weights: &mut Vec<f32>, &r0| {
            let rows = tile.min(n_out - r0);
            weights.resize(rows * k, 0.0);
            ts_quant::dequantize(w.ty, &bytes[r0 * row_bytes..(r0 + rows) * row_bytes], weights)
                .map_err(|e| e.to_string())?;
            let mut y = vec![0f32; m * rows];
            matmul(ts_gguf::GgmlType::F32, bytemuck::cast_slice(weights), rows, k, xq, &mut y)
                .map_err(|e| e.to_string())?;
            Ok(y)
        })
        .collect();
    for (&r0, part) in starts.iter().zip(parts) {
        let part = part?;
        let rows = tile.min(n_out - r0);
        for i in 0..m {
            out[i * n_out + r0..i * n_out + r0 + rows].copy_from_slice(&part[i * rows..(i + 1) * rows]);
        }
    }
    Ok(())
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
        interleaved: cfg.layout == RopeLayout::Interleaved,
        n_rot: n,
        inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
        mscale: (mscale * cfg.attn_factor as f64) as f32,
    }
}

/// A model ready to run on backend `B`: configuration, weights, where routed
/// experts live, and the rotary tables of each attention layer.
pub struct Model<B: Backend = Cpu> {
    pub cfg: ArchConfig,
    pub weights: ModelWeights,
    pub experts: Box<dyn ExpertStore>,
    /// Guess the next MoE layer's experts from this layer's input and start reading them.
    pub prefetch_experts: bool,
    /// The element type of the CPU's key and value caches (f32 unless set; the GPU keeps its own).
    pub kv_type: crate::state::KvType,
    /// Per layer, for attention layers.
    pub ropes: Vec<Option<Rope>>,
    pub backend: B,
    /// Expert matrices repacked for the CPU's kernels ([`Model::pack_experts`]).
    packed_experts: usize,
    /// Dense matrices repacked for the CPU's kernels ([`Model::pack_dense`]).
    packed_dense: usize,
}

/// The CPU's packed layout ([`ts_cpu::pack_rows`]) for each MoE layer's expert matrices:
/// per layer, (type, rows, row length) of one expert's gate, up and down.
struct CpuRepack {
    shapes: Vec<Option<[(ts_gguf::GgmlType, usize, usize); 3]>>,
}

impl ts_experts::Repack for CpuRepack {
    /// Repacked on every read only where that gains ([`ts_cpu::repacks_as_read`]): streamed
    /// experts serve mostly decode (Q4_K streamed under a memory limit decoded 6% slower
    /// repacked: the readers' repacking shares the cores).
    fn packs(&self, layer: usize, proj: usize, on_every_read: bool) -> bool {
        self.shapes.get(layer).copied().flatten().is_some_and(|s| {
            let (ty, n_rows, _) = s[proj];
            ts_cpu::packs(ty, n_rows) && (!on_every_read || ts_cpu::repacks_as_read(ty))
        })
    }

    fn pack(&self, layer: usize, proj: usize, bytes: &mut [u8]) {
        let (ty, n_rows, row_len) = self.shapes[layer].expect("a MoE layer")[proj];
        // `packs` said yes and the shapes were checked at load: bytes marked packed but left
        // as they were would be silent garbage, so a refusal here is a bug that stops.
        let done = ts_cpu::pack_rows(ty, bytes, n_rows, row_len);
        assert!(matches!(done, Ok(true)), "layer {layer} projection {proj}: {done:?}");
    }
}

impl Model {
    pub fn new(cfg: ArchConfig, weights: ModelWeights, experts: Box<dyn ExpertStore>) -> Model {
        // The MTP layer's table, where there is one, is entry `n_layer`.
        let ropes = cfg
            .layers
            .iter()
            .chain(cfg.nextn_layer.as_ref())
            .map(|l| {
                l.attention()
                    .map(|a| build_rope(&a.rope, weights.rope_freqs.as_deref().filter(|_| a.rope_freq_factors)))
            })
            .collect();
        Model {
            cfg,
            weights,
            experts,
            prefetch_experts: false,
            kv_type: Default::default(),
            ropes,
            backend: Cpu,
            packed_experts: 0,
            packed_dense: 0,
        }
    }

    /// Repacks the routed experts the store holds in memory into the CPU's packed layout where
    /// its kernels have one ([`ts_cpu::pack_rows`]: MXFP4, Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q8_0), so that no
    /// batch builds their panels again and decode reads them through the packed kernel:
    /// resident ones now, streamed ones as their slots fill where that gains
    /// ([`ts_cpu::repacks_as_read`]: MXFP4, Q4_0, Q4_1, Q5_0, Q8_0 on AVX-512 VNNI). Returns how many matrices are
    /// (or will be) repacked. The model then stays on the CPU (`into_backend` refuses it) and
    /// needs 8-bit activations (not `--exact-activations`).
    pub fn pack_experts(&mut self) -> usize {
        let shapes = self
            .weights
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Moe(w) => Some([&w.gate_exps, &w.up_exps, &w.down_exps].map(|t| (t.ty, t.n_rows(), t.row_len()))),
                Ffn::Dense { .. } => None,
            })
            .collect();
        self.packed_experts += self.experts.pack(std::sync::Arc::new(CpuRepack { shapes }));
        self.packed_experts
    }

    /// Repacks the dense matrices whose one-row products the CPU's packed kernels run faster
    /// ([`crate::weights::pack_for_cpu`]: Q4_0, Q4_1, Q5_0, Q8_0 and MXFP4 on AVX2 and AVX-512
    /// VNNI, and there the layers' Q4_K and Q6_K ones too) into memory the process owns: the mixers' projections, dense
    /// and shared-expert FFNs, the output head (where it is the embedding table too, the
    /// lookups then read it back from the packed copy; not a Q4_K or Q6_K head,
    /// [`ts_cpu::dense_packed_is_faster`]), and the MTP head's.
    /// At most `budget` bytes are copied (the memory the process may still take: a dense model
    /// larger than memory keeps paging through its mapping instead); a matrix that would pass it
    /// stays mapped. Returns how many matrices were packed and how many left for the budget.
    /// As after [`Model::pack_experts`], the model stays on the CPU and needs 8-bit activations.
    pub fn pack_dense(&mut self, budget: u64) -> Result<(usize, usize), ModelError> {
        fn layer_matrices(l: &mut LayerWeights) -> Vec<&mut Weight> {
            let mut out: Vec<&mut Weight> = match &mut l.mixer {
                MixerWeights::Attention(a) => {
                    [Some(&mut a.wq), a.wk.as_mut(), a.wv.as_mut(), Some(&mut a.wo)].into_iter().flatten().collect()
                }
                MixerWeights::DeltaNet(d) => vec![&mut d.qkv, &mut d.gate, &mut d.beta, &mut d.alpha, &mut d.out],
            };
            match &mut l.ffn {
                Ffn::Dense { gate, up, down } => out.extend([gate, up, down]),
                Ffn::Moe(m) => {
                    out.extend(m.shared.as_mut().into_iter().flat_map(|s| [&mut s.gate, &mut s.up, &mut s.down]))
                }
            }
            out
        }
        let w = &mut self.weights;
        // A tied head is the embedding table: the lookups then read the packed copy too
        // (`ts_cpu::packed_row`), so that the mapped table is not brought back page by page.
        let tied = w.output.file_offset().is_some() && w.output.file_offset() == w.token_embd.file_offset();
        let head_packs = |m: &Weight| ts_cpu::packed_row_is_faster(m.ty);
        let mut matrices: Vec<&mut Weight> = Vec::new();
        if head_packs(&w.output) {
            matrices.push(&mut w.output);
        }
        for l in &mut w.layers {
            matrices.extend(layer_matrices(l));
        }
        if let Some(mtp) = &mut w.mtp {
            matrices.extend([&mut mtp.eh_proj_embd, &mut mtp.eh_proj_hidden]);
            matrices.extend(mtp.head.as_mut().filter(|h| head_packs(h)));
            matrices.extend(layer_matrices(&mut mtp.layer));
        }
        let (mut within, mut left, mut copied) = (Vec::new(), 0, 0u64);
        for m in matrices.into_iter().filter(|m| m.packs_for_cpu()) {
            let size = m.bytes().len() as u64;
            if copied + size > budget {
                left += 1;
                continue;
            }
            copied += size;
            within.push(m);
        }
        let n = crate::weights::pack_for_cpu(&mut within).map_err(ModelError::Compute)?;
        if tied && w.output.is_packed() {
            w.token_embd = w.output.clone();
        }
        self.packed_dense += n;
        Ok((n, left))
    }

    /// The same model on another backend, built by `make` from this one.
    pub fn into_backend<B: Backend>(
        self,
        make: impl FnOnce(&Model) -> Result<B, ModelError>,
    ) -> Result<Model<B>, ModelError> {
        if self.packed_experts + self.packed_dense > 0 {
            return Err(ModelError::Compute(format!(
                "{} matrices are packed for the CPU; open the model again for another backend",
                self.packed_experts + self.packed_dense
            )));
        }
        let backend = make(&self)?;
        let Model { cfg, weights, experts, prefetch_experts, kv_type, ropes, .. } = self;
        Ok(Model {
            cfg,
            weights,
            experts,
            prefetch_experts,
            kv_type,
            ropes,
            backend,
            packed_experts: 0,
            packed_dense: 0,
        })
    }
}

impl<B: Backend> Model<B> {
    /// The next layer after `il` with routed experts, and its weights.
    pub fn next_moe_layer(&self, il: usize) -> Option<(usize, &crate::tensors::MoeWeights)> {
        self.weights.layers.iter().enumerate().skip(il + 1).find_map(|(i, l)| match &l.ffn {
            Ffn::Moe(w) => Some((i, w)),
            Ffn::Dense { .. } => None,
        })
    }

    /// A new, empty sequence of `n_ctx` positions, filled `max_chunk` rows at a time.
    pub fn new_sequence(&self, n_ctx: usize, max_chunk: usize) -> Result<SeqState<B::State>, ModelError> {
        Ok(SeqState { state: self.backend.new_state(self, n_ctx, max_chunk)?, n_past: 0, n_ctx, max_chunk })
    }

    /// Whether some layer keeps a recurrent state (which cannot be rewound).
    pub fn is_recurrent(&self) -> bool {
        self.cfg.delta_net.is_some()
    }

    /// Where `seq` is now, to come back to with [`Model::restore`] (after its
    /// recurrent layers have moved on; attention layers only rewind).
    pub fn snapshot(&self, seq: &SeqState<B::State>) -> Result<Snapshot<B::Recurrent>, ModelError> {
        Ok(Snapshot { n_past: seq.n_past, recurrent: self.backend.save_recurrent(&seq.state)? })
    }

    /// Takes `seq` back to a snapshot of its own.
    pub fn restore(&self, seq: &mut SeqState<B::State>, snap: &Snapshot<B::Recurrent>) -> Result<(), ModelError> {
        self.backend.restore_recurrent(&mut seq.state, &snap.recurrent)?;
        seq.n_past = snap.n_past;
        Ok(())
    }

    /// Makes `dst` a copy of `src` (the prompt of several choices, read once).
    pub fn copy_sequence(&self, src: &SeqState<B::State>, dst: &mut SeqState<B::State>) -> Result<(), ModelError> {
        if dst.n_ctx < src.n_past {
            return Err(ModelError::ContextFull { pos: src.n_past, n_ctx: dst.n_ctx });
        }
        self.backend.copy_state(&src.state, &mut dst.state, src.n_past)?;
        dst.n_past = src.n_past;
        Ok(())
    }

    /// The plan of block `il`: a trunk layer, or the MTP head's layer at `n_layer`.
    fn plan(&self, il: usize) -> &LayerConfig {
        match self.cfg.layers.get(il) {
            Some(l) => l,
            None => self.cfg.nextn_layer.as_ref().expect("block n_layer is the MTP layer"),
        }
    }

    /// Checks that every row names one of `seqs`, fits its context and holds a token of the vocabulary.
    fn check_rows(&self, rows: &[Row], seqs: &[&mut SeqState<B::State>]) -> Result<(), ModelError> {
        for r in rows {
            let seq = seqs
                .get(r.seq)
                .ok_or_else(|| ModelError::Compute(format!("row names sequence {} of {}", r.seq, seqs.len())))?;
            if r.pos >= seq.n_ctx {
                return Err(ModelError::ContextFull { pos: r.pos, n_ctx: seq.n_ctx });
            }
            if r.token as usize >= self.cfg.n_vocab {
                return Err(ModelError::TokenOutOfRange { token: r.token, n_vocab: self.cfg.n_vocab });
            }
        }
        Ok(())
    }

    /// Runs `rows` through the model, updating each row's sequence cache, and
    /// returns the logits of the rows that asked for them, in row order.
    pub fn forward(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<B::State>],
        scratch: &mut B::Scratch,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let (logits, read, _) = self.run_trunk(rows, seqs, scratch, false)?;
        self.logits_to_host(logits, read)
    }

    /// [`Model::forward`], handing `read` each logits row where the backend leaves it on the
    /// host ([`Backend::read_rows`]: a GPU's page-locked landing memory), not copied again.
    pub fn forward_read(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<B::State>],
        scratch: &mut B::Scratch,
        read: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ModelError> {
        match self.run_trunk(rows, seqs, scratch, false)? {
            (Some(l), rows, _) => self.backend.read_rows(&l, self.cfg.n_vocab, rows, read),
            (None, ..) => Ok(()),
        }
    }

    /// [`Model::forward`], also handing back every row's final-normed hidden state (after
    /// `output_norm`, what the MTP head reads), `[rows][n_embd]`. Such a step always runs
    /// its ops (a backend does not replay a recording for it).
    pub fn forward_hidden(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<B::State>],
        scratch: &mut B::Scratch,
    ) -> Result<(Vec<Vec<f32>>, Vec<f32>), ModelError> {
        let (logits, read, hidden) = self.run_trunk(rows, seqs, scratch, true)?;
        Ok((self.logits_to_host(logits, read)?, hidden.expect("asked for the hidden states")))
    }

    /// The trunk's step: the logits of the rows that want them (still the backend's), the
    /// rows among them the caller asked for and, with `hidden`, every row's final-normed hidden
    /// state (nothing computed for it otherwise).
    fn run_trunk(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<B::State>],
        scratch: &mut B::Scratch,
        hidden: bool,
    ) -> Result<TrunkOutput<B::Act>, ModelError> {
        let cfg = &self.cfg;
        let be = &self.backend;
        self.check_rows(rows, seqs)?;
        let wanted = rows.len();
        let padded = self.padded(rows, seqs, hidden);
        // The rows of logits the caller asked for, among those the step computes.
        let read = padded.as_ref().map_or(0..wanted, |p| p.read.clone());
        let rows = padded.as_ref().map_or(rows, |p| &p.rows);
        let m = rows.len();
        if hidden {
            be.begin_direct_step(rows, seqs, scratch)?;
        } else if let StepStart::Replayed { logits } = be.begin_step(rows, seqs, scratch)? {
            advance(&rows[..wanted], seqs);
            return Ok((logits, read, None));
        }
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let mut x = be.embed(&self.weights.token_embd, &tokens)?;
        if let Some(s) = cfg.embed_scale {
            be.scale(&mut x, s)?;
        }
        let per_layer_inputs = self.per_layer_inputs(&tokens, &x, scratch)?;
        // A layer's FFN output not yet added into x: added by the next layer's first norm.
        let mut pending: Option<FfnOut<B>> = None;
        for (il, layer) in self.weights.layers.iter().enumerate() {
            let (norm, eps) = (&layer.attn_norm, cfg.rms_eps);
            let normed = match pending.take() {
                Some(FfnOut::Rows(ffn)) => be.add_rms_norm_to(&mut x, &ffn, norm, eps)?,
                Some(FfnOut::Routed { y, routes }) => be.add_combined_rms_norm_to(&mut x, &y, &routes, norm, eps)?,
                None => be.rms_norm_to(&x, norm, eps)?,
            };
            let ffn = self.block(il, layer, rows, seqs, &mut x, &normed, scratch)?;
            if layer.per_layer.is_none() && layer.output_scale.is_none() {
                pending = Some(ffn);
                continue;
            }
            be.add(&mut x, &ffn.rows(be, cfg.n_embd)?)?;
            if let (Some(pw), Some(inputs)) = (&layer.per_layer, &per_layer_inputs) {
                let p = cfg.per_layer_input;
                let pl = be.columns(inputs, m, p * cfg.n_layer, il * p, p)?;
                let mut g = be.linear(&pw.inp_gate, None, &x, m, scratch)?;
                be.gated(GatedActivation::GeGlu, &mut g, &pl)?;
                let mut y = be.linear(&pw.proj, None, &g, m, scratch)?;
                be.rms_norm(&mut y, cfg.n_embd, Some(&pw.post_norm), cfg.rms_eps)?;
                be.add(&mut x, &y)?;
            }
            if let Some(s) = layer.output_scale {
                be.scale(&mut x, s)?;
            }
        }
        if let Some(ffn) = pending {
            be.add(&mut x, &ffn.rows(be, cfg.n_embd)?)?;
        }
        let (logits, hidden) = match hidden {
            false => (self.output(rows, &x, scratch)?, None),
            true => {
                let normed = be.rms_norm_to(&x, &self.weights.output_norm, cfg.rms_eps)?;
                let logits = self.head(rows, &normed, &self.weights.output, scratch)?;
                (logits, Some(normed))
            }
        };
        be.end_step(logits.as_ref())?;
        // Only a step that ran (or was recorded and launched) moves its sequences on; past
        // padding rows' positions, which the next step writes again.
        advance(&rows[..wanted], seqs);
        let hidden = hidden.map(|h| be.to_host(&h)).transpose()?;
        Ok((logits, read, hidden))
    }

    /// `rows` as the backend runs them better ([`Backend::padded_rows`]: the GPU replays one
    /// recorded step per row count and kind of logits): every row computing logits, with
    /// padding rows after them. Only for the rows of one sequence at consecutive positions
    /// that all want logits (a checking step) or only the last does (a short prompt, a draft
    /// model reading a check's tokens), with room in its cache, and no recurrent layers
    /// (their state would take in the padding) nor hidden states asked for, and no more rows
    /// than the cache and a step may hold. A padding row repeats the last token at the next
    /// positions.
    fn padded(&self, rows: &[Row], seqs: &[&mut SeqState<B::State>], hidden: bool) -> Option<PaddedRows> {
        let (first, last) = (rows.first()?, rows.last()?);
        let m = rows.len();
        let consecutive = m > 1 && rows.iter().enumerate().all(|(i, r)| r.seq == first.seq && r.pos == first.pos + i);
        let all_logits = rows.iter().all(|r| r.logits);
        let last_only = last.logits && rows[..m - 1].iter().all(|r| !r.logits);
        if !consecutive || !(all_logits || last_only) || hidden || self.is_recurrent() {
            return None;
        }
        let seq = &seqs[first.seq];
        // Within the cache, and within a step's rows (a sliding window's ring holds no more).
        let n = self.backend.padded_rows(m)?.min(seq.n_ctx - first.pos).min(seq.max_chunk.max(m));
        if n == m && all_logits {
            return None;
        }
        let pad = (1..=n - m).map(|k| Row { pos: last.pos + k, ..*last });
        let rows = rows.iter().map(|r| Row { logits: true, ..*r }).chain(pad).collect();
        Some(PaddedRows { rows, read: if all_logits { 0..m } else { m - 1..m } })
    }

    /// Block `il`'s mixer on `normed` (its input `x` after the block's first norm), added into
    /// `x`, then its FFN on the second norm: the FFN's output, not yet added.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        il: usize,
        layer: &crate::tensors::LayerWeights,
        rows: &[Row],
        seqs: &mut [&mut SeqState<B::State>],
        x: &mut B::Act,
        normed: &B::Act,
        scratch: &mut B::Scratch,
    ) -> Result<FfnOut<B>, ModelError> {
        let (cfg, be, m) = (&self.cfg, &self.backend, rows.len());
        let mut attn = match &layer.mixer {
            MixerWeights::Attention(w) => self.attention(il, w, rows, seqs, normed, scratch)?,
            MixerWeights::DeltaNet(w) => self.delta_net(il, w, rows, seqs, normed, scratch)?,
        };
        if let Some(w) = &layer.attn_post_norm {
            be.rms_norm(&mut attn, w.len(), Some(w), cfg.rms_eps)?;
        }
        let (norm, eps) = (&layer.ffn_norm, cfg.rms_eps);
        let ffn = match &layer.ffn {
            Ffn::Dense { gate, up, down } => {
                let normed = be.add_rms_norm_to(x, &attn, norm, eps)?;
                FfnOut::Rows(self.dense_ffn(gate, up, down, &normed, m, scratch)?)
            }
            // Routed by the normed rows themselves: the norm and the router may be one kernel.
            Ffn::Moe(w) if w.input_norm.is_none() && w.router_norm.is_none() => {
                let moe = cfg.moe.as_ref().expect("MoE weights imply a MoE config");
                let (normed, routes) = be.add_rms_norm_route(x, &attn, norm, eps, w, m, moe, scratch)?;
                self.moe_ffn(il, w, x, &normed, Some(routes), m, scratch)?
            }
            Ffn::Moe(w) => {
                let normed = be.add_rms_norm_to(x, &attn, norm, eps)?;
                self.moe_ffn(il, w, x, &normed, None, m, scratch)?
            }
        };
        match &layer.ffn_post_norm {
            Some(w) => {
                let mut ffn = ffn.rows(be, cfg.n_embd)?;
                be.rms_norm(&mut ffn, w.len(), Some(w), eps)?;
                Ok(FfnOut::Rows(ffn))
            }
            None => Ok(ffn),
        }
    }

    /// One step of the MTP head ([`crate::tensors::MtpWeights`]): row i pairs the token
    /// `rows[i].token` (x at t + 1) with `hidden[i]` (`[n_embd]`, the trunk's final-normed
    /// hidden state at t, or the head's own `hidden` output of the row before when
    /// chaining guesses) at position `rows[i].pos` of its sequence, an MTP sequence
    /// ([`Model::new_mtp_sequence`]) whose cache the row's keys and values go into. Returns
    /// the logits of the rows that want them (guesses for t + 2) and every row's `hidden`
    /// output. The sequences' `n_past` are left to the caller.
    pub fn mtp_forward(
        &self,
        rows: &[Row],
        hidden: &[f32],
        seqs: &mut [&mut SeqState<B::State>],
        scratch: &mut B::Scratch,
    ) -> Result<MtpOutput, ModelError> {
        let (cfg, be) = (&self.cfg, &self.backend);
        let mtp = self
            .weights
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::Compute("this model has no multi-token-prediction (nextn) layer".into()))?;
        let (m, e, il) = (rows.len(), cfg.n_embd, cfg.n_layer);
        if hidden.len() != m * e {
            return Err(ModelError::Compute(format!("MTP: {} hidden floats for {m} rows of {e}", hidden.len())));
        }
        self.check_rows(rows, seqs)?;
        be.begin_direct_step(rows, seqs, scratch)?;
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let mut x = be.embed(mtp.embed_tokens.as_ref().unwrap_or(&self.weights.token_embd), &tokens)?;
        if let Some(s) = cfg.embed_scale {
            be.scale(&mut x, s)?;
        }
        be.rms_norm(&mut x, e, Some(&mtp.enorm), cfg.rms_eps)?;
        let mut h = be.upload(hidden)?;
        be.rms_norm(&mut h, e, Some(&mtp.hnorm), cfg.rms_eps)?;
        // eh_proj · [e; h], as the sum of its two halves' products.
        let mut u = be.linear(&mtp.eh_proj_embd, None, &x, m, scratch)?;
        let from_hidden = be.linear(&mtp.eh_proj_hidden, None, &h, m, scratch)?;
        be.add(&mut u, &from_hidden)?;
        let layer = &mtp.layer;
        let normed = be.rms_norm_to(&u, &layer.attn_norm, cfg.rms_eps)?;
        if !matches!(layer.mixer, MixerWeights::Attention(_)) {
            return Err(ModelError::Compute("MTP: the layer is not an attention layer".into()));
        }
        let ffn = self.block(il, layer, rows, seqs, &mut u, &normed, scratch)?;
        be.add(&mut u, &ffn.rows(be, e)?)?;
        let out = be.rms_norm_to(&u, &mtp.shared_head_norm, cfg.rms_eps)?;
        let logits = self.head(rows, &out, mtp.head.as_ref().unwrap_or(&self.weights.output), scratch)?;
        be.end_step(logits.as_ref())?;
        Ok(MtpOutput { logits: self.logits_to_host(logits, 0..usize::MAX)?, hidden: be.to_host(&out)? })
    }

    /// A new MTP sequence of `n_ctx` positions: the cache of the MTP head's layer only.
    pub fn new_mtp_sequence(&self, n_ctx: usize) -> Result<SeqState<B::State>, ModelError> {
        if self.weights.mtp.is_none() {
            return Err(ModelError::Compute("this model has no multi-token-prediction (nextn) layer".into()));
        }
        Ok(SeqState { state: self.backend.new_mtp_state(self, n_ctx)?, n_past: 0, n_ctx, max_chunk: n_ctx })
    }

    /// Rows `rows` of a step's logits (those asked for: padding rows and rows computed only
    /// for a recorded step are left on the device), on the host, one Vec per row.
    fn logits_to_host(&self, logits: Option<B::Act>, rows: Range<usize>) -> Result<Vec<Vec<f32>>, ModelError> {
        match logits {
            None => Ok(Vec::new()),
            Some(l) => self.backend.rows_to_host(&l, self.cfg.n_vocab, rows),
        }
    }

    /// A MoE layer's FFN for the residual stream `x` and its FFN-normed `normed`,
    /// `[m][n_embd]`: the routed experts and any dense FFN beside them (a shared
    /// expert; Gemma 4's MLP, with the experts' input, router input and both
    /// outputs normed on their own), routed by `routes` where the norm made them.
    #[allow(clippy::too_many_arguments)]
    fn moe_ffn(
        &self,
        il: usize,
        w: &MoeWeights,
        x: &B::Act,
        normed: &B::Act,
        routes: Option<B::Routes>,
        m: usize,
        scratch: &mut B::Scratch,
    ) -> Result<FfnOut<B>, ModelError> {
        let (be, eps) = (&self.backend, self.cfg.rms_eps);
        let expert_in = w.input_norm.as_ref().map(|n| be.rms_norm_to(x, n, eps)).transpose()?;
        let router_in = w.router_norm.as_ref().map(|n| be.rms_norm_to(x, n, eps)).transpose()?;
        let expert_in = expert_in.as_ref().unwrap_or(normed);
        let router_in = router_in.as_ref().unwrap_or(expert_in);
        let (y, routes) = self.routed_experts(il, w, expert_in, router_in, routes, m, scratch)?;
        if w.output_norm.is_none() && w.shared.is_none() {
            return Ok(FfnOut::Routed { y, routes });
        }
        let mut out = be.combine(&y, &routes, self.cfg.n_embd)?;
        if let Some(n) = &w.output_norm {
            be.rms_norm(&mut out, n.len(), Some(n), eps)?;
        }
        if let Some(sh) = &w.shared {
            let mut y = self.dense_ffn(&sh.gate, &sh.up, &sh.down, normed, m, scratch)?;
            if let Some(gate) = &sh.gate_inp {
                be.sigmoid_gate(&mut y, normed, gate)?;
            }
            if let Some(n) = &sh.post_norm {
                be.rms_norm(&mut y, n.len(), Some(n), eps)?;
            }
            be.add(&mut out, &y)?;
        }
        Ok(FfnOut::Rows(out))
    }

    /// Every layer's per-layer input for these tokens and their scaled
    /// embeddings `x`, `[m][L·P]` (Gemma 4's E models; None for other models).
    fn per_layer_inputs(
        &self,
        tokens: &[u32],
        x: &B::Act,
        scratch: &mut B::Scratch,
    ) -> Result<Option<B::Act>, ModelError> {
        let Some(w) = &self.weights.per_layer_input else { return Ok(None) };
        let (be, cfg, m) = (&self.backend, &self.cfg, tokens.len());
        let p = cfg.per_layer_input;
        let mut t = be.embed(&w.token_embd, tokens)?;
        be.scale(&mut t, (p as f32).sqrt())?;
        let mut c = be.linear(&w.model_proj, None, x, m, scratch)?;
        be.scale(&mut c, 1.0 / (cfg.n_embd as f32).sqrt())?;
        be.rms_norm(&mut c, p, Some(&w.proj_norm), cfg.rms_eps)?;
        be.add(&mut c, &t)?;
        be.scale(&mut c, std::f32::consts::FRAC_1_SQRT_2)?;
        Ok(Some(c))
    }

    /// `down(act(gate · x) * (up · x))` for `m` rows.
    pub fn dense_ffn(
        &self,
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        x: &B::Act,
        m: usize,
        scratch: &mut B::Scratch,
    ) -> Result<B::Act, ModelError> {
        self.backend.dense_ffn(gate, up, down, self.cfg.ffn_act, x, m, scratch)
    }

    /// Self-attention of every row, through the output projection; returns `[m][n_embd]`.
    fn attention(
        &self,
        il: usize,
        layer: &AttnWeights,
        rows: &[Row],
        seqs: &mut [&mut SeqState<B::State>],
        normed: &B::Act,
        scratch: &mut B::Scratch,
    ) -> Result<B::Act, ModelError> {
        let cfg = &self.cfg;
        let be = &self.backend;
        let m = rows.len();
        let a = self.plan(il).attention().expect("an attention layer");
        let (hd, hdv) = (a.head_dim, a.head_dim_v);
        // The projections of one input together (a backend may overlap them). A layer sharing an
        // earlier layer's keys and values computes only its queries; without a V projection
        // (Gemma 4's global layers) V is the raw K projection.
        let mut projections = vec![(&layer.wq, layer.bq.as_deref())];
        let own_kv = match (&layer.wk, a.kv_from) {
            (Some(wk), None) => {
                projections.push((wk, layer.bk.as_deref()));
                projections.extend(layer.wv.as_ref().map(|wv| (wv, layer.bv.as_deref())));
                true
            }
            _ => false,
        };
        let mut out = be.linears(&projections, normed, m, scratch)?.into_iter();
        let q = out.next().expect("the query projection");
        let mut kv = match (own_kv, out.next()) {
            (true, Some(k)) => {
                let v = match out.next() {
                    Some(v) => v,
                    None => be.copy(&k)?,
                };
                Some((k, v))
            }
            _ => None,
        };
        // A gated attention's query projection holds per head [q | gate].
        let (mut q, gate) = match cfg.attn_output_gate {
            true => {
                (be.columns(&q, m * cfg.n_head, 2 * hd, 0, hd)?, Some(be.columns(&q, m * cfg.n_head, 2 * hd, hd, hd)?))
            }
            false => (q, None),
        };
        // Per-head norms go with the rotary embedding (one kernel where the backend can);
        // a norm over all heads comes first, on its own.
        let norm = match cfg.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead => {
                Some(HeadNorm { q: layer.q_norm.as_deref(), k: layer.k_norm.as_deref(), eps: cfg.rms_eps })
            }
            QkNorm::Full => {
                be.rms_norm(&mut q, cfg.n_head * hd, layer.q_norm.as_deref(), cfg.rms_eps)?;
                if let Some((k, _)) = &mut kv {
                    be.rms_norm(k, a.kv_dim(), layer.k_norm.as_deref(), cfg.rms_eps)?;
                }
                None
            }
        };
        if let Some((_, v)) = &mut kv
            && cfg.family().v_norm
        {
            be.rms_norm(v, hdv, None, cfg.rms_eps)?;
        }
        let rope = self.ropes[il].as_ref().expect("an attention layer has a rope table");
        let shape = AttnShape {
            n_head: cfg.n_head,
            n_head_kv: a.n_head_kv,
            head_dim: hd,
            head_dim_v: hdv,
            scale: cfg.attn_scale,
            softcap: None,
            sinks: layer.sinks.as_deref(),
        };
        let kv = kv.as_mut().map(|(k, v)| (k, &*v));
        let mut out = be.rope_store_attention(il, rope, &mut q, kv, norm, &shape, rows, seqs, scratch)?;
        if let Some(g) = &gate {
            be.mul_sigmoid(&mut out, g)?;
        }
        be.linear(&layer.wo, layer.bo.as_deref(), &out, m, scratch)
    }

    /// Final norm and output head for the rows that want logits, `[wanted][n_vocab]`.
    fn output(&self, rows: &[Row], x: &B::Act, scratch: &mut B::Scratch) -> Result<Option<B::Act>, ModelError> {
        if rows.iter().all(|r| !r.logits) {
            return Ok(None);
        }
        let normed = self.backend.rms_norm_to(x, &self.weights.output_norm, self.cfg.rms_eps)?;
        self.head(rows, &normed, &self.weights.output, scratch)
    }

    /// The output head `head` over already normed rows `normed` `[rows][n_embd]`, for the
    /// rows that want logits, `[wanted][n_vocab]`.
    fn head(
        &self,
        rows: &[Row],
        normed: &B::Act,
        head: &Weight,
        scratch: &mut B::Scratch,
    ) -> Result<Option<B::Act>, ModelError> {
        let be = &self.backend;
        let wanted: Vec<usize> = rows.iter().enumerate().filter(|(_, r)| r.logits).map(|(i, _)| i).collect();
        if wanted.is_empty() {
            return Ok(None);
        }
        let selected;
        let normed = if wanted.len() == rows.len() {
            normed
        } else {
            selected = be.select_rows(normed, self.cfg.n_embd, &wanted)?;
            &selected
        };
        let mut logits = be.linear(head, self.weights.output_bias.as_deref(), normed, wanted.len(), scratch)?;
        if let Some(c) = self.cfg.final_softcap {
            be.softcap(&mut logits, c)?;
        }
        Ok(Some(logits))
    }
}

/// A trunk step's logits on the backend, which of their rows the caller asked for, and its
/// rows' final-normed hidden states where asked for.
type TrunkOutput<A> = (Option<A>, Range<usize>, Option<Vec<f32>>);

/// A block's FFN output, not yet added into the residual stream: rows `[m][n_embd]`, or
/// the routed experts' outputs per (row, slot) pair `[m * k][n_embd]` with their routes, which
/// the next norm sums as it adds them ([`Backend::add_combined_rms_norm_to`]).
enum FfnOut<B: Backend> {
    Rows(B::Act),
    Routed { y: B::Act, routes: B::Routes },
}

impl<B: Backend> FfnOut<B> {
    /// The output as rows of `width`.
    fn rows(self, be: &B, width: usize) -> Result<B::Act, ModelError> {
        match self {
            FfnOut::Rows(a) => Ok(a),
            FfnOut::Routed { y, routes } => be.combine(&y, &routes, width),
        }
    }
}

/// What one step of the MTP head gives.
pub struct MtpOutput {
    /// `[wanted][n_vocab]`: the logits of the rows that asked for them, in row order.
    pub logits: Vec<Vec<f32>>,
    /// `[rows][n_embd]`: every row's output after `shared_head_norm` (the hidden input of
    /// the next guess when chaining).
    pub hidden: Vec<f32>,
}

/// Each row's sequence now holds its position.
fn advance<S>(rows: &[Row], seqs: &mut [&mut SeqState<S>]) {
    for r in rows {
        let s = &mut seqs[r.seq];
        s.n_past = s.n_past.max(r.pos + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ts_gguf::GgmlType;

    /// f32 activations against a quantized weight whose rows do not fill the
    /// last tile, several activation rows: the same as a float64 product with
    /// the weight dequantized whole.
    #[test]
    fn exact_linear_matches_the_dequantized_product() {
        let (n_out, k, m) = (3 * (DEQUANTIZED_TILE / 512) + 5, 512, 3);
        let mut rng = ts_testkit::Rng::new(11);
        let values = rng.normals(n_out * k, 0.05, 0.0);
        let row_bytes = k / 256 * 144;
        let mut bytes = vec![0u8; n_out * row_bytes];
        ts_quant::quantize(GgmlType::Q4_K, &values, &mut bytes).unwrap();
        let mut wf = vec![0f32; n_out * k];
        ts_quant::dequantize(GgmlType::Q4_K, &bytes, &mut wf).unwrap();
        let w = Weight::from_bytes("w", GgmlType::Q4_K, vec![k, n_out], bytes);
        let x = rng.normals(m * k, 1.0, 0.0);
        let mut out = Vec::new();
        linear(&w, &x, m, &mut Scratch::exact(), &mut out).unwrap();
        for r in 0..m {
            for o in 0..n_out {
                let want: f64 = (0..k).map(|i| wf[o * k + i] as f64 * x[r * k + i] as f64).sum();
                let got = out[r * n_out + o] as f64;
                assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {r} out {o}: {got} vs {want}");
            }
        }
        // Bytes that do not hold the rows are an error, not a panic.
        let short = Weight::from_bytes("short", GgmlType::Q4_K, vec![k, n_out], vec![0u8; row_bytes]);
        let err = linear(&short, &x, m, &mut Scratch::exact(), &mut out).unwrap_err();
        assert!(err.to_string().contains("short"), "{err}");
    }
}
