//! The CPU backend: rayon threads over the SIMD kernels of `ts-cpu`; the
//! reference every other backend is tested against, op by op.

use crate::ModelError;
use crate::backend::{AttnShape, Backend, DeltaNetParams, ExpertsAt, StepStart};
use crate::config::{GatedActivation, MoeConfig};
use crate::cpu_timing::{Phase, timing};
use crate::forward::{Model, Row, Scratch, hold_quantized_rows, linear, linear_bytes, linear_bytes_again};
use crate::state::{CpuState, KvRows, KvView, LayerState, RecurrentState, SeqState, sequence_runs};
use crate::tensors::MoeWeights;
use crate::weights::Weight;
use rayon::prelude::*;
use ts_cpu::delta_net::{self as dn, HeadInputs};
use ts_cpu::ops::{self, AttentionParams, Rope};
use ts_experts::{ExpertBytes, ExpertSet};

mod experts;
use experts::{
    PARALLEL_EXPERT_ROWS, experts_with_their_rows, flat_down, flat_experts, flat_experts_ffn, flat_gate_up,
    fused_experts, gather_rows, hidden_of_pairs, map_experts, prompt_rows_quantized, scatter_rows,
};
pub use experts::{expert_hidden, expert_output, experts_of_one_row};

/// The CPU: rayon threads, SIMD kernels of `ts-cpu`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Backend for Cpu {
    type Act = Vec<f32>;
    type State = CpuState;
    type Recurrent = Vec<RecurrentState>;
    type Scratch = Scratch;
    type Routes = CpuRoutes;
    type ExpertGroup<'a> = ExpertSet<'a>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn scratch(&self, exact_activations: bool) -> Scratch {
        if exact_activations { Scratch::exact() } else { Scratch::default() }
    }

    /// Every step runs as a team: prompt steps too, whose matmuls are team regions (SmolLM2
    /// pp512 on two threads +9-16%, Qwen2.5 +5-7%, the gpt-oss cut level; sixteenth session).
    fn run_step<R: Send>(&self, _rows: usize, step: impl FnOnce() -> R + Send) -> R {
        ts_cpu::team::scope(step)
    }

    fn begin_step(
        &self,
        rows: &[Row],
        _seqs: &mut [&mut SeqState<CpuState>],
        _scratch: &Scratch,
    ) -> Result<StepStart<Vec<f32>>, ModelError> {
        timing().step_begins(rows.len());
        Ok(StepStart::Run)
    }

    fn rows_alone(&self, s: &mut Scratch) {
        s.rows_alone = true;
    }

    fn new_state(&self, model: &Model<Self>, n_ctx: usize, max_chunk: usize) -> Result<CpuState, ModelError> {
        Ok(CpuState::new(&model.cfg, n_ctx, max_chunk, model.kv_type))
    }

    fn save_recurrent(&self, state: &CpuState) -> Result<Vec<RecurrentState>, ModelError> {
        Ok(state.snapshot())
    }

    fn restore_recurrent(&self, state: &mut CpuState, saved: &Vec<RecurrentState>) -> Result<(), ModelError> {
        state.restore(saved);
        Ok(())
    }

    fn copy_state(&self, src: &CpuState, dst: &mut CpuState, n_past: usize) -> Result<(), ModelError> {
        dst.copy_from(src, n_past);
        Ok(())
    }

    fn new_mtp_state(&self, model: &Model<Self>, n_ctx: usize) -> Result<CpuState, ModelError> {
        CpuState::for_mtp(&model.cfg, n_ctx, model.kv_type)
    }

    fn upload(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        Ok(x.to_vec())
    }

    fn embed(&self, table: &Weight, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let e = table.row_len();
        let row_bytes = table.row_bytes();
        let mut x = vec![0f32; tokens.len() * e];
        let err = |err: String| ModelError::Compute(format!("{}: {err}", table.name));
        // A table that is also the packed output head: each row read back in its GGUF blocks.
        let mut row = Vec::new();
        for (&t, out) in tokens.iter().zip(x.chunks_exact_mut(e)) {
            let t = t as usize;
            let bytes = match table.is_packed() {
                true => {
                    ts_cpu::packed_row(table.ty, table.bytes(), table.n_rows(), e, t, &mut row)
                        .map_err(|e| err(e.to_string()))?;
                    &row[..]
                }
                false => &table.bytes()[t * row_bytes..(t + 1) * row_bytes],
            };
            ts_quant::dequantize(table.ty, bytes, out).map_err(|e| err(e.to_string()))?;
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
        timing().time(phase_of(w), || {
            let mut out = Vec::new();
            linear(w, x, m, s, &mut out)?;
            if let Some(b) = bias {
                ops::add_bias_rows(&mut out, b);
            }
            Ok(out)
        })
    }

    fn linears(
        &self,
        ws: &[(&Weight, Option<&[f32]>)],
        x: &Vec<f32>,
        m: usize,
        s: &mut Scratch,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if m > 1 && !s.exact_activations {
            return timing().time(Phase::Products, || batch_linears(ws, x, m, s));
        }
        if m != 1 || s.exact_activations || ws.len() < 2 || decode_products() != DecodeProducts::Flat {
            return ws.iter().map(|&(w, bias)| self.linear(w, bias, x, m, s)).collect();
        }
        timing().time(Phase::Products, || flat_linears(ws, x))
    }

    fn gate_up(
        &self,
        gate: &Weight,
        up: &Weight,
        x: &Vec<f32>,
        m: usize,
        s: &mut Scratch,
    ) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let mut both = self.linears(&[(gate, None), (up, None)], x, m, s)?.into_iter();
        match (both.next(), both.next()) {
            (Some(g), Some(u)) => Ok((g, u)),
            _ => Err(ModelError::Compute(format!("{} and {}: two products expected", gate.name, up.name))),
        }
    }

    /// A one-row step's gate and up in one region, each task finishing its rows of the hidden
    /// and quantizing them for down ([`flat_dense_ffn`]); batches as the default.
    fn dense_ffn(
        &self,
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        act: GatedActivation,
        x: &Vec<f32>,
        m: usize,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        if m != 1 || s.exact_activations || decode_products() != DecodeProducts::Flat || !hidden_in_runs() {
            return crate::backend::dense_ffn_in_steps(self, gate, up, down, act, x, m, s);
        }
        timing().time(Phase::Products, || flat_dense_ffn(gate, up, down, act, x, s))
    }

    /// Pieces normed 64 at a time over the threads (per-head q/k norms of a prompt's rows).
    fn rms_norm(&self, x: &mut Vec<f32>, piece: usize, w: Option<&[f32]>, eps: f32) -> Result<(), ModelError> {
        timing().time(Phase::Norm, || {
            const PIECES: usize = 64;
            if piece == 0 {
                return Ok(());
            }
            let whole = x.len() / piece * piece;
            ts_cpu::team::for_each_chunk(&mut x[..whole], PIECES * piece, &|_, xs| {
                ops::rms_norm_pieces(xs, piece, w, eps)
            });
            Ok(())
        })
    }

    fn rms_norm_to(&self, x: &Vec<f32>, w: &[f32], eps: f32) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::Norm, || {
            let e = w.len();
            let mut out = zeroed(x.len() / e.max(1) * e);
            for_each_row_piece(&mut out, &mut [], e, &|r, o, _| ops::rms_norm(&x[r * e..(r + 1) * e], Some(w), eps, o));
            Ok(out)
        })
    }

    fn add(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), ModelError> {
        timing().time(Phase::SmallOps, || {
            in_pieces_with(x, y, &|x, y| ops::add_inplace(x, y));
            Ok(())
        })
    }

    fn scale(&self, x: &mut Vec<f32>, s: f32) -> Result<(), ModelError> {
        timing().time(Phase::SmallOps, || {
            in_pieces(x, &|x| ops::scale_inplace(x, s));
            Ok(())
        })
    }

    fn softcap(&self, x: &mut Vec<f32>, c: f32) -> Result<(), ModelError> {
        timing().time(Phase::SmallOps, || {
            in_pieces(x, &|x| x.iter_mut().for_each(|l| *l = c * (*l / c).tanh()));
            Ok(())
        })
    }

    fn gated(&self, act: GatedActivation, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<(), ModelError> {
        timing().time(Phase::SmallOps, || {
            // Over the threads already (ts-cpu's pieces of 4,096).
            gated_activation(act, gate, up);
            Ok(())
        })
    }

    /// Rows rotated 8 at a time over the threads (one by one on the step's thread, this was a
    /// serial part of a prompt).
    fn rope(&self, _il: usize, rope: &Rope, x: &mut Vec<f32>, head_dim: usize, rows: &[Row]) -> Result<(), ModelError> {
        timing().time(Phase::Rope, || {
            const ROWS: usize = 8;
            let width = x.len() / rows.len().max(1);
            if width == 0 {
                return Ok(());
            }
            let x = &mut x[..rows.len() * width];
            ts_cpu::team::for_each_chunk(x, ROWS * width, &|i, xs| {
                for (r, xr) in rows[i * ROWS..].iter().zip(xs.chunks_exact_mut(width)) {
                    rope.apply(xr, head_dim, r.pos as u32);
                }
            });
            Ok(())
        })
    }

    fn store_kv(
        &self,
        il: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        rows: &[Row],
        seqs: &mut [&mut SeqState<CpuState>],
    ) -> Result<(), ModelError> {
        timing().time(Phase::Rope, || {
            let (kv_dim, v_dim) = (k.len() / rows.len().max(1), v.len() / rows.len().max(1));
            for (i, r) in rows.iter().enumerate() {
                let cache = kv_cache_mut(seqs[r.seq], il)?;
                cache.store(r.pos, &k[i * kv_dim..(i + 1) * kv_dim], &v[i * v_dim..(i + 1) * v_dim]);
            }
            Ok(())
        })
    }

    fn attention(
        &self,
        il: usize,
        shape: &AttnShape,
        q: &Vec<f32>,
        rows: &[Row],
        seqs: &mut [&mut SeqState<CpuState>],
        _scratch: &Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::Attention, || {
            let (hd, hdv) = (shape.head_dim, shape.head_dim_v);
            let q_dim = shape.n_head * hd;
            if let Some(r) = rows.iter().find(|r| read_kv(&seqs[r.seq].state, il).is_none()) {
                return Err(ModelError::Compute(format!("layer {il} of sequence {} keeps no keys and values", r.seq)));
            }
            let one_run = rows.windows(2).all(|w| w[1].seq == w[0].seq && w[1].pos == w[0].pos + 1);
            if let (Some(first), Some(last)) = (rows.first(), rows.last())
                && rows.len() >= PROMPT_ATTENTION_ROWS
                && one_run
                && prompt_attention()
            {
                let cache = read_kv(&seqs[first.seq].state, il).expect("checked above");
                if cache.visible(last.pos).count() >= PROMPT_ATTENTION_POSITIONS {
                    return match cache.rows() {
                        KvRows::F32 { k, v } => run_attention(shape, q, rows, cache.view(k, v), cache),
                        KvRows::F16 { k, v } => run_attention(shape, q, rows, cache.view(k, v), cache),
                    };
                }
            }
            let group = shape.n_head / shape.n_head_kv;
            let mut out = vec![0f32; rows.len() * shape.n_head * hdv];
            let seqs: &[&mut SeqState<CpuState>] = seqs;
            // One item a (row, KV head) with the query heads it serves, each key and value read
            // once for them (a KV head's keys at depth overflow L2), where that leaves no thread
            // without an item, even unevenly (SmolLM2's 3 KV heads on 2 threads at 2,048
            // positions: attention 6.3-6.9 -> 5.1-5.2 ms a step against 9 items of one head);
            // else one a (row, head). Items are `ts_cpu::team` regions (a rayon loop outside a
            // step's team); each writes its own heads' floats of `out`.
            let grouped = group <= ops::MAX_GROUP && rows.len() * shape.n_head_kv >= rayon::current_num_threads();
            let cache_of = |r: &Row| read_kv(&seqs[r.seq].state, il).expect("checked above");
            let runs = split_runs(shape, rows, &cache_of);
            if runs >= 2 {
                return Ok(attention_in_runs(shape, q, rows, &cache_of, runs, out));
            }
            let per_item = if grouped { group } else { 1 };
            ts_cpu::team::for_each_chunk(&mut out, per_item * hdv, &|idx, o| {
                let items_per_row = shape.n_head / per_item;
                let (i, h0) = (idx / items_per_row, (idx % items_per_row) * per_item);
                let r = rows[i];
                let cache = cache_of(&r);
                let kvh = h0 / group;
                let mut heads =
                    [AttentionParams { scale: shape.scale, softcap: shape.softcap, sink: None }; ops::MAX_GROUP];
                for (g, head) in heads[..per_item].iter_mut().enumerate() {
                    head.sink = shape.sinks.map(|s| s[h0 + g]);
                }
                let qs = &q[i * q_dim + h0 * hd..i * q_dim + (h0 + per_item) * hd];
                let item = Item { q: qs, heads: &heads[..per_item], visible: cache.visible(r.pos), kvh, hd, hdv };
                item.attend(cache, o);
            });
            Ok(out)
        })
    }

    fn copy(&self, x: &Vec<f32>) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::SmallOps, || Ok(x.clone()))
    }

    fn columns(&self, x: &Vec<f32>, rows: usize, width: usize, start: usize, n: usize) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::SmallOps, || {
            if start + n > width || x.len() < rows * width {
                return Err(ModelError::Compute(format!(
                    "columns {start}..{} of {rows} rows of {width} from {} floats",
                    start + n,
                    x.len()
                )));
            }
            Ok(x.chunks_exact(width).take(rows).flat_map(|r| &r[start..start + n]).copied().collect())
        })
    }

    fn mul_sigmoid(&self, x: &mut Vec<f32>, gate: &Vec<f32>) -> Result<(), ModelError> {
        timing().time(Phase::SmallOps, || {
            in_pieces_with(x, gate, &|x, gate| x.iter_mut().zip(gate).for_each(|(x, &g)| *x *= ops::sigmoid(g)));
            Ok(())
        })
    }

    fn conv_silu(
        &self,
        il: usize,
        taps: &[f32],
        kernel: usize,
        x: &Vec<f32>,
        rows: &[Row],
        seqs: &mut [&mut SeqState<CpuState>],
    ) -> Result<Vec<f32>, ModelError> {
        let channels = taps.len() / kernel;
        let runs = sequence_runs(rows, seqs)?;
        let mut out = vec![0f32; x.len()];
        for run in &runs {
            let st = recurrent_mut(seqs[run.seq], il)?;
            if run.fresh {
                st.conv.fill(0.0);
            }
            let xs: Vec<f32> =
                run.rows.iter().flat_map(|&i| x[i * channels..(i + 1) * channels].iter().copied()).collect();
            let mut o = vec![0f32; xs.len()];
            ts_cpu::delta_net::conv_silu(&xs, taps, kernel, &mut st.conv, &mut o);
            for (j, &i) in run.rows.iter().enumerate() {
                out[i * channels..(i + 1) * channels].copy_from_slice(&o[j * channels..(j + 1) * channels]);
            }
        }
        Ok(out)
    }

    fn delta_net(
        &self,
        il: usize,
        p: &DeltaNetParams,
        qkv: &Vec<f32>,
        beta: &Vec<f32>,
        alpha: &Vec<f32>,
        rows: &[Row],
        seqs: &mut [&mut SeqState<CpuState>],
    ) -> Result<Vec<f32>, ModelError> {
        delta_net(il, p, qkv, beta, alpha, rows, seqs)
    }

    fn sigmoid_gate(&self, y: &mut Vec<f32>, x: &Vec<f32>, gate: &[f32]) -> Result<(), ModelError> {
        timing().time(Phase::SmallOps, || {
            let e = gate.len();
            for (yr, xr) in y.chunks_exact_mut(e).zip(x.chunks_exact(e)) {
                let dot: f32 = gate.iter().zip(xr).map(|(a, b)| a * b).sum();
                ops::scale_inplace(yr, ops::sigmoid(dot));
            }
            Ok(())
        })
    }

    fn route(
        &self,
        logits: &Vec<f32>,
        m: usize,
        moe: &MoeConfig,
        expert_scale: Option<&[f32]>,
    ) -> Result<CpuRoutes, ModelError> {
        timing().time(Phase::Route, || {
            let (k, n) = (moe.n_expert_used, moe.n_expert);
            if logits.len() < m * n {
                return Err(ModelError::Compute(format!("{} router logits for {m} rows of {n}", logits.len())));
            }
            let (mut ids, mut weights) = (vec![0usize; m * k], vec![0f32; m * k]);
            // Rows `first..` of the routes into `ids` and `weights` (their k entries each).
            let route_rows = |first: usize, ids: &mut [usize], weights: &mut [f32]| {
                for (i, (ids, weights)) in ids.chunks_exact_mut(k).zip(weights.chunks_exact_mut(k)).enumerate() {
                    let r = first + i;
                    let route = crate::moe::route(moe, &logits[r * n..(r + 1) * n], expert_scale);
                    ids.copy_from_slice(&route.experts);
                    weights.copy_from_slice(&route.weights);
                }
            };
            if m < PARALLEL_EXPERT_ROWS || k == 0 {
                route_rows(0, &mut ids, &mut weights);
            } else {
                // A prompt's rows over the threads, a few at a time.
                const ROWS: usize = 4;
                let pieces: Vec<std::sync::Mutex<(&mut [usize], &mut [f32])>> =
                    ids.chunks_mut(ROWS * k).zip(weights.chunks_mut(ROWS * k)).map(std::sync::Mutex::new).collect();
                ts_cpu::team::for_each(pieces.len(), &|i| {
                    let mut piece = pieces[i].lock().expect("a piece of routes");
                    let (ids, weights) = &mut *piece;
                    route_rows(i * ROWS, ids, weights);
                });
            }
            Ok(CpuRoutes { ids, weights, k })
        })
    }

    fn route_ids(&self, routes: &CpuRoutes) -> Result<Vec<usize>, ModelError> {
        Ok(routes.ids.clone())
    }

    fn experts_tiered(&self, _model: &Model<Self>) -> bool {
        // Every placement goes through the store, which counts hits and overlaps reads.
        true
    }

    fn expert_capacity(&self, model: &Model<Self>) -> usize {
        model.experts.capacity()
    }

    fn ensure_experts<'a>(
        &'a self,
        model: &'a Model<Self>,
        il: usize,
        ids: &[usize],
    ) -> Result<ExpertSet<'a>, ModelError> {
        Ok(model.experts.ensure(il, ids)?)
    }

    fn prefetch_experts(
        &self,
        model: &Model<Self>,
        il: usize,
        ids: &[usize],
        _keep: &ExpertSet<'_>,
    ) -> Result<(), ModelError> {
        model.experts.prefetch(il, ids);
        Ok(())
    }

    fn expert_gate_up(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Vec<f32>,
        routes: &CpuRoutes,
        at: &ExpertsAt<'_, ExpertSet<'_>>,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::ExpertGateUp, || {
            if let Some(experts) = flat_experts(w, routes, at, s)? {
                return flat_gate_up(w, act, x, &experts);
            }
            let f = w.gate_exps.n_rows();
            let mut h = zeroed(routes.ids.len() * f);
            let quantized = prompt_rows_quantized(w, x, routes, s)?;
            let gate_up = |ex: usize, bytes: ExpertBytes<'_>, pairs: &[usize], s: &mut Scratch| {
                hidden_of_pairs(w, act, x, quantized.as_ref(), routes.k, (ex, &bytes), pairs, s)
            };
            let mut done = Vec::new();
            map_experts(w, routes, at, s, gate_up, |pairs, g| done.push((pairs.to_vec(), g)))?;
            timing().time(Phase::Combine, || scatter_rows(&mut h, f, &done));
            Ok(h)
        })
    }

    /// A prompt's experts each run gate/up and then down on one task (no `h` for every pair
    /// written, then read back, and one parallel region a layer instead of two); a one-row
    /// step's flat products keep the two regions.
    fn expert_ffn(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Vec<f32>,
        routes: &CpuRoutes,
        at: &ExpertsAt<'_, ExpertSet<'_>>,
        y: &mut Vec<f32>,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        if !fused_experts() || routes.ids.len() / routes.k.max(1) < PARALLEL_EXPERT_ROWS {
            if let Some(experts) = flat_experts(w, routes, at, s)?.filter(|_| hidden_in_runs()) {
                return flat_experts_ffn(w, act, x, &experts, y);
            }
            let h = self.expert_gate_up(w, act, x, routes, at, s)?;
            return self.expert_down(w, &h, routes, at, y, s);
        }
        timing().time(Phase::ExpertsFused, || experts_with_their_rows(w, act, x, routes, at, y, s))
    }

    fn expert_down(
        &self,
        w: &MoeWeights,
        h: &Vec<f32>,
        routes: &CpuRoutes,
        at: &ExpertsAt<'_, ExpertSet<'_>>,
        y: &mut Vec<f32>,
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        timing().time(Phase::ExpertDown, || {
            if let Some(experts) = flat_experts(w, routes, at, s)? {
                return flat_down(w, h, &experts, y);
            }
            let (e, f) = (w.down_exps.n_rows(), w.down_exps.row_len());
            // One expert's outputs for its pairs, `[pairs][e]`.
            let down = |ex: usize, bytes: ExpertBytes<'_>, pairs: &[usize], s: &mut Scratch| {
                let hs = gather_rows(h, f, pairs.iter().copied());
                expert_output(w, ex, &bytes, &hs, pairs.len(), s)
            };
            let mut done = Vec::new();
            map_experts(w, routes, at, s, down, |pairs, d| done.push((pairs.to_vec(), d)))?;
            timing().time(Phase::Combine, || scatter_rows(y, e, &done));
            Ok(())
        })
    }

    fn combine(&self, y: &Vec<f32>, routes: &CpuRoutes, width: usize) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::Combine, || {
            let mut out = zeroed(routes.ids.len() / routes.k.max(1) * width);
            for_each_row_piece(&mut out, &mut [], width, &|r, o, _| combined_row(y, routes, r, o));
            Ok(out)
        })
    }

    /// Each row's residual add and norm in one pass, rows over the threads.
    fn add_rms_norm_to(&self, x: &mut Vec<f32>, y: &Vec<f32>, w: &[f32], eps: f32) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::Norm, || {
            let e = w.len();
            check_rows(x, y.len(), e)?;
            let mut out = zeroed(x.len());
            for_each_row_piece(x, &mut out, e, &|r, xr, o| {
                ops::add_inplace(xr, &y[r * e..(r + 1) * e]);
                ops::rms_norm(xr, Some(w), eps, o);
            });
            Ok(out)
        })
    }

    /// Each row's weighted sum of its experts' outputs, residual add and norm in one pass
    /// (the sum first, in [`Backend::combine`]'s order, then added: the same floats).
    fn add_combined_rms_norm_to(
        &self,
        x: &mut Vec<f32>,
        y: &Vec<f32>,
        routes: &CpuRoutes,
        w: &[f32],
        eps: f32,
    ) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::Norm, || {
            let e = w.len();
            check_rows(x, routes.ids.len() / routes.k.max(1) * e, e)?;
            let mut out = zeroed(x.len());
            for_each_row_piece(x, &mut out, e, &|r, xr, o| {
                combined_row(y, routes, r, o);
                ops::add_inplace(xr, o);
                ops::rms_norm(xr, Some(w), eps, o);
            });
            Ok(out)
        })
    }

    fn uninit(&self, n: usize) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::SmallOps, || Ok(zeroed(n)))
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::SmallOps, || Ok(zeroed(n)))
    }

    fn select_rows(&self, x: &Vec<f32>, width: usize, rows: &[usize]) -> Result<Vec<f32>, ModelError> {
        timing().time(Phase::SmallOps, || Ok(gather_rows(x, width, rows.iter().copied())))
    }

    fn to_host(&self, x: &Vec<f32>) -> Result<Vec<f32>, ModelError> {
        Ok(x.clone())
    }

    /// Straight from `x`, not cloned first.
    fn read_rows(
        &self,
        x: &Vec<f32>,
        row_len: usize,
        rows: std::ops::Range<usize>,
        read: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ModelError> {
        crate::backend::host_rows(x, row_len, rows).for_each(read);
        Ok(())
    }
}

/// Layer `il`'s keys and values in `seq`, or an error for a layer of another kind.
fn kv_cache_mut(seq: &mut SeqState<CpuState>, il: usize) -> Result<&mut crate::state::LayerCache, ModelError> {
    match seq.state.layers.get_mut(il) {
        Some(LayerState::Kv(c)) => Ok(c),
        _ => Err(ModelError::Compute(format!("layer {il} keeps no keys and values"))),
    }
}

/// The keys and values layer `il` reads in `state`: its own, or those of the earlier
/// layer it shares; None for a layer of another kind.
fn read_kv(state: &CpuState, il: usize) -> Option<&crate::state::LayerCache> {
    let from = match state.layers.get(il)? {
        LayerState::SharedKv(from) => *from,
        _ => il,
    };
    match state.layers.get(from)? {
        LayerState::Kv(c) => Some(c),
        _ => None,
    }
}

/// Each row's k experts and weights, `[m][k]` each.
pub struct CpuRoutes {
    pub ids: Vec<usize>,
    pub weights: Vec<f32>,
    pub k: usize,
}

/// Row copies and sums over at least this many floats are split over the threads (a prompt's
/// expert outputs, `[pairs][n_embd]`: 8 MiB a layer for 128 rows of qwen3-30b-a3b); one thread
/// copying them was serial time that grew with the thread count's share of the rest.
const PARALLEL_COPY_FLOATS: usize = 1 << 16;

/// Projections of the `m` rows `x` (a prompt's q, k and v), its rows quantized once for all
/// the weights that take the same 8-bit activations (each other weight quantizes them again).
fn batch_linears(
    ws: &[(&Weight, Option<&[f32]>)],
    x: &[f32],
    m: usize,
    s: &mut Scratch,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let mut outs = Vec::with_capacity(ws.len());
    let mut held: Option<(ts_gguf::GgmlType, usize)> = None;
    for &(w, bias) in ws {
        let mut out = Vec::new();
        let wants = (ts_cpu::activation_type(w.ty).ok(), w.row_len());
        match held {
            Some((ty, k)) if wants == (Some(ty), k) => {
                linear_bytes_again(w, w.bytes(), w.is_packed(), w.n_rows(), s, &mut out)?
            }
            _ => {
                linear(w, x, m, s, &mut out)?;
                held = wants.0.map(|ty| (ty, wants.1));
            }
        }
        if let Some(b) = bias {
            ops::add_bias_rows(&mut out, b);
        }
        outs.push(out);
    }
    Ok(outs)
}

/// `n` zeros, written over the threads where there are many (one thread zeroing a prompt's
/// 8 MiB of expert outputs was serial time a layer).
fn zeroed(n: usize) -> Vec<f32> {
    let mut v = Vec::new();
    crate::forward::resize_zeroed(&mut v, n);
    v
}

/// `f` on pieces of `x` over the threads where it holds [`PARALLEL_COPY_FLOATS`] floats or more
/// (an element-wise op, so the pieces give the floats one call would).
fn in_pieces(x: &mut [f32], f: &(dyn Fn(&mut [f32]) + Sync)) {
    ts_cpu::team::for_each_chunk(x, PARALLEL_COPY_FLOATS, &|_, xs| f(xs));
}

/// `f` on pieces of `x` and the same elements of `y` (cut to the shorter), as [`in_pieces`].
fn in_pieces_with(x: &mut [f32], y: &[f32], f: &(dyn Fn(&mut [f32], &[f32]) + Sync)) {
    let n = x.len().min(y.len());
    ts_cpu::team::for_each_chunk(&mut x[..n], PARALLEL_COPY_FLOATS, &|i, xs| {
        f(xs, &y[i * PARALLEL_COPY_FLOATS..][..xs.len()])
    });
}

/// Row `r`'s sum of its k pairs' outputs `y` `[m * k][width]` into `o` (zeros), slot by slot:
/// the same order for any split.
fn combined_row(y: &[f32], routes: &CpuRoutes, r: usize, o: &mut [f32]) {
    let (k, width) = (routes.k.max(1), o.len());
    for (p, &wt) in routes.weights.iter().enumerate().skip(r * k).take(k) {
        o.iter_mut().zip(&y[p * width..(p + 1) * width]).for_each(|(o, &v)| *o += wt * v);
    }
}

/// An error unless `x` holds whole rows of `width` and `other` floats as many.
fn check_rows(x: &[f32], other: usize, width: usize) -> Result<(), ModelError> {
    if width == 0 || !x.len().is_multiple_of(width) || other != x.len() {
        return Err(ModelError::Compute(format!("rows of {width} over {} and {other} floats", x.len())));
    }
    Ok(())
}

/// What [`for_each_row_piece`] calls for each row: its index, then its rows of the two outputs.
type RowFn<'a> = dyn Fn(usize, &mut [f32], &mut [f32]) + Sync + 'a;

/// Rows handed out a few at a time over the threads: `f(r, row r of a, row r of b)` for each
/// row of `a` `[m][width]`, with `b` the same shape or empty (then `f` gets an empty row).
fn for_each_row_piece(a: &mut [f32], b: &mut [f32], width: usize, f: &RowFn<'_>) {
    /// Rows an item takes: a few KiB of each.
    const ROWS: usize = 4;
    let rows = a.len() / width.max(1);
    let run = |first: usize, a: &mut [f32], b: &mut [f32]| {
        for (i, ar) in a.chunks_exact_mut(width).enumerate() {
            let br = if b.is_empty() { &mut [][..] } else { &mut b[i * width..(i + 1) * width] };
            f(first + i, ar, br);
        }
    };
    if rows * width < PARALLEL_COPY_FLOATS {
        return run(0, a, b);
    }
    let pieces: Vec<std::sync::Mutex<(&mut [f32], &mut [f32])>> = match b.is_empty() {
        true => a.chunks_mut(ROWS * width).map(|a| std::sync::Mutex::new((a, &mut [][..]))).collect(),
        false => a.chunks_mut(ROWS * width).zip(b.chunks_mut(ROWS * width)).map(std::sync::Mutex::new).collect(),
    };
    ts_cpu::team::for_each(pieces.len(), &|i| {
        let mut piece = pieces[i].lock().expect("a piece of rows");
        let (a, b) = &mut *piece;
        run(i * ROWS, a, b);
    });
}

thread_local! {
    /// A thread's attention scores, reused from head to head.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows from which a step of one sequence's consecutive rows (a prompt) takes its attention
/// as two matmuls a KV head on the CPU's batch kernels ([`run_attention`]) instead of dot
/// products a position and head, where its last row sees [`PROMPT_ATTENTION_POSITIONS`] or
/// more: attention took 43% of a SmolLM2 512-token prompt so (`perf`). Two threads, SmolLM2,
/// with every step of 32 rows or more so: pp2048 +27-32%, pp1024 +8-9%, pp512 level, pp128
/// 5-8% slower (fifteenth session).
const PROMPT_ATTENTION_ROWS: usize = 32;

/// Positions the last row of a prompt step sees from which [`run_attention`] is taken, where
/// it measured faster (two threads, one step a prompt, sixteenth session: pp512 +1-8% on the
/// three real models; pp128 and pp256 2-10% slower).
const PROMPT_ATTENTION_POSITIONS: usize = 512;

/// Whether prompts take [`run_attention`] (`TURBOSPARK_PROMPT_ATTENTION=0`, a measurement
/// knob, keeps them on the items of one row each).
fn prompt_attention() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TURBOSPARK_PROMPT_ATTENTION").as_deref() != Ok("0"))
}

/// The element type of a cache as a weight type of the CPU's matmuls, and its bytes.
trait KvWeight: ops::KvElement {
    const TYPE: ts_gguf::GgmlType;
    fn bytes(rows: &[Self]) -> &[u8];
}

impl KvWeight for f32 {
    const TYPE: ts_gguf::GgmlType = ts_gguf::GgmlType::F32;
    fn bytes(rows: &[f32]) -> &[u8] {
        bytemuck::cast_slice(rows)
    }
}

impl KvWeight for half::f16 {
    const TYPE: ts_gguf::GgmlType = ts_gguf::GgmlType::F16;
    fn bytes(rows: &[half::f16]) -> &[u8] {
        bytemuck::cast_slice(rows)
    }
}

/// Attention of `rows`, consecutive positions of one sequence whose keys and values `kv` (in
/// `cache`) hold, per KV head as llama.cpp's graph has it without flash attention: the scores
/// `S = Q Kᵀ` of the head's query heads (`[rows × group][positions]`, the keys as weight
/// rows), each row's weights over the positions it sees ([`ops::attention_weights`]; others
/// 0), then `O = P V` (V transposed into weight rows of positions, padded to 32). Output
/// `[rows][n_head × head_dim_v]`, each head's floats those of [`ops::attend`] in another
/// order of sums.
fn run_attention<T: KvWeight>(
    shape: &AttnShape,
    q: &[f32],
    rows: &[Row],
    kv: KvView<'_, T>,
    cache: &crate::state::LayerCache,
) -> Result<Vec<f32>, ModelError> {
    let (n_head, hdv) = (shape.n_head, shape.head_dim_v);
    let mut out = vec![0f32; rows.len() * n_head * hdv];
    let layer = LayerKv { shape, kv, cache };
    let mut buffers = BlockBuffers::default();
    // Blocks of rows, each over the positions its last row sees: scores past a block's last
    // row (masked for all of it) are not computed.
    let block = PROMPT_ATTENTION_BLOCK;
    for (b, rs) in rows.chunks(block).enumerate() {
        let q_dim = n_head * shape.head_dim;
        let o_dim = n_head * hdv;
        let qb = &q[b * block * q_dim..(b * block + rs.len()) * q_dim];
        let ob = &mut out[b * block * o_dim..(b * block + rs.len()) * o_dim];
        attention_block(&layer, qb, rs, ob, &mut buffers)?;
    }
    Ok(out)
}

/// [`attention_block`]'s working buffers, kept from block to block (each grows to the largest
/// block's size once, instead of being zeroed for every block): a KV head's keys `[n_pos][hd]`
/// and values transposed `[hdv][n_pad]`, the block's queries `[rows × group][hd]`, scores `[rows
/// × group][n_pad]` and outputs `[rows × group][hdv]`, and the activation rows made of them.
struct BlockBuffers<T> {
    keys: Vec<T>,
    values_t: Vec<T>,
    queries: Vec<f32>,
    scores: Vec<f32>,
    o: Vec<f32>,
    x: ts_cpu::QuantizedRows,
}

impl<T> Default for BlockBuffers<T> {
    fn default() -> Self {
        BlockBuffers {
            keys: Vec::new(),
            values_t: Vec::new(),
            queries: Vec::new(),
            scores: Vec::new(),
            o: Vec::new(),
            x: ts_cpu::QuantizedRows::new(),
        }
    }
}

/// Rows a matmul of [`run_attention`] takes at once (SmolLM2 pp2048, 2 threads: 16 rows 733-741
/// tok/s, 32 762-862, 64 780-906, 128 828-933, 256 875-877, 512 796-825).
const PROMPT_ATTENTION_BLOCK: usize = 128;

/// A layer's attention shape and its cache, read as `T`.
struct LayerKv<'a, T> {
    shape: &'a AttnShape<'a>,
    kv: KvView<'a, T>,
    cache: &'a crate::state::LayerCache,
}

/// [`run_attention`] of one block of rows (queries `q` `[rows][n_head × head_dim]`) into
/// `out` `[rows][n_head × head_dim_v]`.
fn attention_block<T: KvWeight>(
    layer: &LayerKv<'_, T>,
    q: &[f32],
    rows: &[Row],
    out: &mut [f32],
    buffers: &mut BlockBuffers<T>,
) -> Result<(), ModelError> {
    let LayerKv { shape, kv, cache } = *layer;
    let (hd, hdv, n_head) = (shape.head_dim, shape.head_dim_v, shape.n_head);
    let group = n_head / shape.n_head_kv;
    let m = rows.len();
    let first = *cache.visible(rows[0].pos).start();
    let last = rows[m - 1].pos;
    let n_pos = last + 1 - first;
    let n_pad = n_pos.next_multiple_of(32);
    let cerr = |e: ts_cpu::CpuError| ModelError::Compute(format!("prompt attention: {e}"));
    // Every element of each is written for each KV head before it is read (the values' and
    // the scores' padding too: the weights past a row's last position are set to 0).
    let BlockBuffers { keys, values_t, queries, scores, o, x } = buffers;
    keys.resize(n_pos * hd, T::from_f32(0.0));
    values_t.resize(hdv * n_pad, T::from_f32(0.0));
    queries.resize(m * group * hd, 0.0);
    scores.resize(m * group * n_pad, 0.0);
    o.resize(m * group * hdv, 0.0);
    for kvh in 0..shape.n_head_kv {
        // The head's keys gathered and its values transposed, spread over the threads (on one,
        // they were a serial part of a long prompt).
        const POSITIONS: usize = 64;
        ts_cpu::team::for_each_chunk(keys, POSITIONS * hd, &|i, ks| {
            for (j, k) in ks.chunks_exact_mut(hd).enumerate() {
                k.copy_from_slice(kv.key(first + i * POSITIONS + j, kvh * hd, hd));
            }
        });
        // Eight rows of the transpose an item: each position's slot found once for them.
        const DIMS: usize = 8;
        ts_cpu::team::for_each_chunk(values_t, DIMS * n_pad, &|i, rows| {
            let n_dims = rows.len() / n_pad;
            for p in 0..n_pos {
                let v = kv.value(first + p, kvh * hdv + i * DIMS, n_dims);
                for (d, &x) in v.iter().enumerate() {
                    rows[d * n_pad + p] = x;
                }
            }
            for row in rows.chunks_exact_mut(n_pad) {
                row[n_pos..].fill(T::from_f32(0.0));
            }
        });
        // Query rows (row i, head j of the group), i major, 16 rows an item (on one thread,
        // this copy and the outputs' below were a serial part of a prompt).
        const ROWS: usize = 16;
        ts_cpu::team::for_each_chunk(queries, ROWS * group * hd, &|c, qs| {
            for (j, qr) in qs.chunks_exact_mut(group * hd).enumerate() {
                let at = (c * ROWS + j) * n_head * hd + kvh * group * hd;
                qr.copy_from_slice(&q[at..at + group * hd]);
            }
        });
        x.quantize(T::TYPE, queries, hd).map_err(cerr)?;
        ts_cpu::matmul_strided(T::TYPE, T::bytes(keys), n_pos, hd, x, scores, n_pad).map_err(cerr)?;
        ts_cpu::team::for_each_chunk(scores, group * n_pad, &|i, row| {
            let seen = cache.visible(rows[i].pos);
            let (from, to) = (seen.start() - first, seen.end() + 1 - first);
            for (j, s) in row.chunks_exact_mut(n_pad).enumerate() {
                let p = AttentionParams {
                    scale: shape.scale,
                    softcap: shape.softcap,
                    sink: shape.sinks.map(|s| s[kvh * group + j]),
                };
                ops::attention_weights(&mut s[from..to], &p);
                s[..from].fill(0.0);
                s[to..].fill(0.0);
            }
        });
        x.quantize(T::TYPE, scores, n_pad).map_err(cerr)?;
        ts_cpu::matmul(T::TYPE, T::bytes(values_t), hdv, n_pad, x, o).map_err(cerr)?;
        let o = &*o;
        ts_cpu::team::for_each_chunk(&mut out[..m * n_head * hdv], ROWS * n_head * hdv, &|c, outs| {
            for (j, out_row) in outs.chunks_exact_mut(n_head * hdv).enumerate() {
                let from = (c * ROWS + j) * group * hdv;
                out_row[kvh * group * hdv..(kvh + 1) * group * hdv].copy_from_slice(&o[from..from + group * hdv]);
            }
        });
    }
    Ok(())
}

/// Each row's layer cache.
type CacheOf<'a> = dyn Fn(&Row) -> &'a crate::state::LayerCache + Sync + 'a;

/// The fewest positions a run of [`attention_in_runs`] takes.
const RUN_MIN_POSITIONS: usize = 256;

/// Runs a decode step's (row, KV head) items split their positions into: where there are fewer
/// such items than threads (Gemma 3's one KV head), each thread reads its own run of a KV
/// head's cache once instead of each query head reading all of it; 1 where that does not
/// apply or the rows see too few positions.
fn split_runs(shape: &AttnShape, rows: &[Row], cache_of: &CacheOf<'_>) -> usize {
    let (threads, items) = (rayon::current_num_threads(), rows.len() * shape.n_head_kv);
    if shape.n_head / shape.n_head_kv > ops::MAX_GROUP || items == 0 || items >= threads {
        return 1;
    }
    let shortest = rows.iter().map(|r| cache_of(r).visible(r.pos).count()).min().unwrap_or(0);
    threads.div_ceil(items).min(shortest / RUN_MIN_POSITIONS).max(1)
}

/// A decode step's attention with each (row, KV head)'s positions in `runs` runs, one item
/// each, then each head's runs merged ([`ops::merge_runs`], the sink counted once there) into
/// `out` `[rows][n_head][hdv]` (zeros).
fn attention_in_runs(
    shape: &AttnShape,
    q: &[f32],
    rows: &[Row],
    cache_of: &CacheOf<'_>,
    runs: usize,
    mut out: Vec<f32>,
) -> Vec<f32> {
    let (hd, hdv, n_kv) = (shape.head_dim, shape.head_dim_v, shape.n_head_kv);
    let group = shape.n_head / n_kv;
    let q_dim = shape.n_head * hd;
    // Each run's outputs `[group][hdv]`, then its heads' `ln Σ e^s`.
    let part = group * (hdv + 1);
    let mut parts = vec![0f32; rows.len() * n_kv * runs * part];
    let heads = [AttentionParams { scale: shape.scale, softcap: shape.softcap, sink: None }; ops::MAX_GROUP];
    ts_cpu::team::for_each_chunk(&mut parts, part, &|idx, chunk| {
        let (item, run) = (idx / runs, idx % runs);
        let (i, kvh) = (item / n_kv, item % n_kv);
        let r = rows[i];
        let cache = cache_of(&r);
        let seen = cache.visible(r.pos);
        let (first, n) = (*seen.start(), seen.count());
        let (from, to) = (first + run * n / runs, first + (run + 1) * n / runs);
        let h0 = kvh * group;
        let qs = &q[i * q_dim + h0 * hd..i * q_dim + (h0 + group) * hd];
        let item = Item { q: qs, heads: &heads[..group], visible: from..=to - 1, kvh, hd, hdv };
        let (o, lse) = chunk.split_at_mut(group * hdv);
        lse.copy_from_slice(&item.attend(cache, o)[..group]);
    });
    let parts = &parts;
    ts_cpu::team::for_each_chunk(&mut out, group * hdv, &|item, o| {
        let at = item * runs * part;
        for g in 0..group {
            let each = (0..runs).map(|r| {
                let c = &parts[at + r * part..at + (r + 1) * part];
                (&c[g * hdv..(g + 1) * hdv], c[group * hdv + g])
            });
            let sink = shape.sinks.map(|s| s[(item % n_kv) * group + g]);
            ops::merge_runs(each, sink, &mut o[g * hdv..(g + 1) * hdv]);
        }
    });
    out
}

/// One attention item of a step: the query heads `q` `[heads][hd]` of one row that share KV
/// head `kvh`, over the positions `visible`.
struct Item<'a> {
    q: &'a [f32],
    heads: &'a [AttentionParams],
    visible: std::ops::RangeInclusive<usize>,
    kvh: usize,
    hd: usize,
    hdv: usize,
}

impl Item<'_> {
    /// The heads' outputs `[heads][hdv]` into `out` from `cache` (rows of f32 or f16); returns
    /// each head's `ln Σ e^s` ([`ops::attend_group`]).
    fn attend(&self, cache: &crate::state::LayerCache, out: &mut [f32]) -> [f32; ops::MAX_GROUP] {
        match cache.rows() {
            KvRows::F32 { k, v } => self.attend_rows(cache.view(k, v), out),
            KvRows::F16 { k, v } => self.attend_rows(cache.view(k, v), out),
        }
    }

    fn attend_rows<T: ops::KvElement>(&self, kv: KvView<'_, T>, out: &mut [f32]) -> [f32; ops::MAX_GROUP] {
        let (kvh, hd, hdv) = (self.kvh, self.hd, self.hdv);
        SCORES.with_borrow_mut(|scores| {
            ops::attend_group(
                self.q,
                self.visible.clone().map(|p| kv.key(p, kvh * hd, hd)),
                self.visible.clone().map(|p| kv.value(p, kvh * hdv, hdv)),
                self.heads,
                scores,
                out,
            )
        })
    }
}

/// The kind of op a product with `w` is, for `TURBOSPARK_CPU_TIMING`: the output head, a
/// router, or a weight product.
fn phase_of(w: &Weight) -> Phase {
    if w.name.starts_with("output") || w.name.starts_with("token_embd") {
        Phase::Head
    } else if w.name.contains("ffn_gate_inp") {
        Phase::Route
    } else {
        Phase::Products
    }
}

/// How a one-row step (decode) runs its products over the threads (`TURBOSPARK_DECODE_PRODUCTS`,
/// a measurement knob; `flat` by default since the 16-core machine's sweep, docs/BENCHMARKS.md).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum DecodeProducts {
    /// `split`: each product is its own parallel region over the threads (24 a layer for top-8).
    Split,
    /// `tasks`: each expert a parallel task, its products split further over idle threads.
    Tasks,
    /// `flat`: all the experts' gate and up products in one region, their down products in
    /// another, and the attention's q, k and v in one (`ts_cpu::matvecs`).
    Flat,
}

fn decode_products() -> DecodeProducts {
    static MODE: std::sync::OnceLock<DecodeProducts> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("TURBOSPARK_DECODE_PRODUCTS").as_deref() {
        Ok("tasks") => DecodeProducts::Tasks,
        Ok("split") => DecodeProducts::Split,
        _ => DecodeProducts::Flat,
    })
}

/// Whether a one-row step's gate/up tasks finish their rows of the hidden and quantize them
/// for down ([`ts_cpu::gated_matvecs`]); `TURBOSPARK_HIDDEN_IN_RUNS=0`, a measurement knob,
/// finishes and quantizes the hidden on the step's thread after the region, as before
/// 2026-12-07 (the same floats).
fn hidden_in_runs() -> bool {
    static IN_RUNS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IN_RUNS.get_or_init(|| std::env::var("TURBOSPARK_HIDDEN_IN_RUNS").map_or(true, |v| v.trim() != "0"))
}

/// The activations weights of `ty` take (two weight types of one activation type take the same
/// quantized row); `ty` itself where the CPU has none, whose quantizing then says so.
fn activations_of(ty: ts_gguf::GgmlType) -> ts_gguf::GgmlType {
    ts_cpu::activation_type(ty).unwrap_or(ty)
}

/// One activation row `x` quantized for weights of `ty`.
fn quantized_row(ty: ts_gguf::GgmlType, x: &[f32]) -> Result<ts_cpu::QuantizedRows, ts_cpu::CpuError> {
    timing().time(Phase::Quantize, || {
        let mut q = ts_cpu::QuantizedRows::new();
        q.quantize(ty, x, x.len())?;
        Ok(q)
    })
}

/// [`Backend::linears`] of one row in one parallel region ([`DecodeProducts::Flat`]): the
/// floats of one [`linear`] each, the row quantized once per activation type (Q4_K_M's Q4_K q
/// and k and Q6_K v share their Q8_K row).
fn flat_linears(ws: &[(&Weight, Option<&[f32]>)], x: &[f32]) -> Result<Vec<Vec<f32>>, ModelError> {
    let k = x.len();
    let cerr = |e: ts_cpu::CpuError| ModelError::Compute(format!("{}: {e}", ws[0].0.name));
    let mut quantized: Vec<(ts_gguf::GgmlType, ts_cpu::QuantizedRows)> = Vec::new();
    for (w, _) in ws {
        if w.row_len() != k {
            return Err(ModelError::Compute(format!("{}: rows of {} for an input of {k}", w.name, w.row_len())));
        }
        if !quantized.iter().any(|(ty, _)| *ty == activations_of(w.ty)) {
            quantized.push((activations_of(w.ty), quantized_row(w.ty, x).map_err(cerr)?));
        }
    }
    let mut outs: Vec<Vec<f32>> =
        timing().time(Phase::Outputs, || ws.iter().map(|(w, _)| vec![0f32; w.n_rows()]).collect());
    let mut products: Vec<ts_cpu::Matvec<'_>> = ws
        .iter()
        .zip(outs.iter_mut())
        .map(|((w, _), out)| ts_cpu::Matvec {
            weight_ty: w.ty,
            w: w.bytes(),
            n_out: w.n_rows(),
            k,
            packed: w.is_packed(),
            x: &quantized.iter().find(|(ty, _)| *ty == activations_of(w.ty)).expect("quantized for every type").1,
            out,
        })
        .collect();
    ts_cpu::matvecs(&mut products).map_err(cerr)?;
    for ((_, bias), out) in ws.iter().zip(outs.iter_mut()) {
        if let Some(b) = bias {
            ops::add_bias_rows(out, b);
        }
    }
    Ok(outs)
}

/// `down · act(gate · x, up · x)` of the one row `x` in two parallel regions: gate and up,
/// each task finishing its rows of the hidden and quantizing them for down into `s`
/// ([`ts_cpu::gated_matvecs`]), then down ([`linear_bytes_again`]). The floats of
/// [`Backend::dense_ffn`]'s default.
fn flat_dense_ffn(
    gate: &Weight,
    up: &Weight,
    down: &Weight,
    act: GatedActivation,
    x: &[f32],
    s: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let (k, f) = (x.len(), gate.n_rows());
    fn cerr(w: &Weight) -> impl Fn(ts_cpu::CpuError) -> ModelError + '_ {
        move |e| ModelError::Compute(format!("{}: {e}", w.name))
    }
    for (w, row) in [(gate, k), (up, k), (down, f)] {
        if w.row_len() != row {
            return Err(ModelError::Compute(format!("{}: rows of {} for an input of {row}", w.name, w.row_len())));
        }
    }
    let xg = quantized_row(gate.ty, x).map_err(cerr(gate))?;
    let xu = match activations_of(up.ty) == activations_of(gate.ty) {
        true => None,
        false => Some(quantized_row(up.ty, x).map_err(cerr(up))?),
    };
    let (mut h, mut u) = timing().time(Phase::Outputs, || (vec![0f32; f], vec![0f32; up.n_rows()]));
    let mut pair = [ts_cpu::GatedMatvec {
        gate: ts_cpu::Matvec {
            weight_ty: gate.ty,
            w: gate.bytes(),
            n_out: f,
            k,
            packed: gate.is_packed(),
            x: &xg,
            out: &mut h,
        },
        up: ts_cpu::Matvec {
            weight_ty: up.ty,
            w: up.bytes(),
            n_out: up.n_rows(),
            k,
            packed: up.is_packed(),
            x: xu.as_ref().unwrap_or(&xg),
            out: &mut u,
        },
        down: Some((down.ty, &mut s.xq)),
    }];
    ts_cpu::gated_matvecs(&mut pair, &|_, _, g, u| gated_activation(act, g, u)).map_err(cerr(gate))?;
    let mut y = Vec::new();
    linear_bytes_again(down, down.bytes(), down.is_packed(), down.n_rows(), s, &mut y)?;
    Ok(y)
}

/// Layer `il`'s recurrent state in `seq`, or an error for a layer of another kind.
pub(crate) fn recurrent_mut(seq: &mut SeqState<CpuState>, il: usize) -> Result<&mut RecurrentState, ModelError> {
    match seq.state.layers.get_mut(il) {
        Some(LayerState::Recurrent(r)) => Ok(r),
        _ => Err(ModelError::Compute(format!("layer {il} keeps no recurrent state"))),
    }
}

/// `gate = act(gate, up)` with the CPU kernel of `act`.
pub fn gated_activation(act: GatedActivation, gate: &mut [f32], up: &[f32]) {
    match act {
        GatedActivation::SwiGlu => ops::swiglu(gate, up),
        GatedActivation::GeGlu => ops::geglu(gate, up),
        GatedActivation::SwiGluClamped { alpha, limit } => ops::swiglu_clamped(gate, up, alpha, limit),
    }
}

/// [`Backend::delta_net`] on the CPU: per sequence and value head, its rows
/// run through the recurrence, or in chunks when there are many of them.
fn delta_net(
    il: usize,
    p: &DeltaNetParams,
    qkv: &[f32],
    beta: &[f32],
    alpha: &[f32],
    rows: &[Row],
    seqs: &mut [&mut SeqState<CpuState>],
) -> Result<Vec<f32>, ModelError> {
    let d = p.shape;
    let (nk, nv, dk, dv) = (d.n_k_heads, d.n_v_heads, d.d_k, d.d_v);
    let (conv_dim, m) = (d.conv_dim(), rows.len());
    let runs = sequence_runs(rows, seqs)?;
    // Per row: q and k heads normalised (q also scaled by 1/sqrt(d_k)), beta and the log-decay g.
    let mut qk = vec![0f32; m * 2 * nk * dk];
    let q_scale = 1.0 / (dk as f32).sqrt();
    qk.par_chunks_mut(2 * nk * dk).zip(qkv.par_chunks(conv_dim)).for_each(|(o, x)| {
        o.copy_from_slice(&x[..2 * nk * dk]);
        for (h, head) in o.chunks_exact_mut(dk).enumerate() {
            dn::l2_normalize(head, p.eps);
            if h < nk {
                head.iter_mut().for_each(|v| *v *= q_scale);
            }
        }
    });
    let b: Vec<f32> = beta.iter().map(|&x| ops::sigmoid(x)).collect();
    let g: Vec<f32> =
        alpha.iter().enumerate().map(|(i, &x)| p.a[i % nv] * dn::softplus(x + p.dt_bias[i % nv])).collect();

    // One task per (sequence, value head), each owning that head's state.
    let mut tasks: Vec<(&crate::state::SeqRun, usize, &mut [f32])> = Vec::new();
    for (si, seq) in seqs.iter_mut().enumerate() {
        let Some(run) = runs.iter().find(|r| r.seq == si) else { continue };
        let st = recurrent_mut(seq, il)?;
        if run.fresh {
            st.ssm.fill(0.0);
        }
        tasks.extend(st.ssm.chunks_mut(dk * dv).enumerate().map(|(h, s)| (run, h, s)));
    }
    let outs: Vec<(&crate::state::SeqRun, usize, Vec<f32>)> = tasks
        .into_par_iter()
        .map(|(run, h, state)| {
            let kh = d.key_head(h);
            let gather = |src: &[f32], width: usize, stride: usize, at: usize| -> Vec<f32> {
                run.rows.iter().flat_map(|&i| src[i * stride + at..i * stride + at + width].iter().copied()).collect()
            };
            let q = gather(&qk, dk, 2 * nk * dk, kh * dk);
            let k = gather(&qk, dk, 2 * nk * dk, (nk + kh) * dk);
            let v = gather(qkv, dv, conv_dim, 2 * nk * dk + h * dv);
            let gh = gather(&g, 1, nv, h);
            let bh = gather(&b, 1, nv, h);
            let inputs = HeadInputs { q: &q, k: &k, v: &v, g: &gh, beta: &bh };
            let mut out = vec![0f32; run.rows.len() * dv];
            if run.rows.len() >= dn::CHUNK {
                dn::delta_rule_chunked(&inputs, dk, dv, state, &mut out);
            } else {
                dn::delta_rule_recurrent(&inputs, dk, dv, state, &mut out);
            }
            (run, h, out)
        })
        .collect();
    let mut out = vec![0f32; m * nv * dv];
    for (run, h, o) in outs {
        for (j, &i) in run.rows.iter().enumerate() {
            out[i * nv * dv + h * dv..i * nv * dv + (h + 1) * dv].copy_from_slice(&o[j * dv..(j + 1) * dv]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{KvType, LayerCache};

    /// The row ops over pieces of rows (the weighted sum of each row's experts, the residual
    /// add and the norm in one pass; the add and norm alone; plain norms and adds) give the
    /// floats of the plain serial loops, bit for bit, on a prompt's sizes in a team of threads
    /// and out of one.
    #[test]
    fn row_ops_in_pieces_match_the_serial_ops() {
        let (m, k, width) = (96, 4, 1024);
        let v = |i: usize, f: f32| ((i as f32) * f).sin();
        let x0: Vec<f32> = (0..m * width).map(|i| v(i, 0.37)).collect();
        let y: Vec<f32> = (0..m * k * width).map(|i| v(i, 0.11)).collect();
        let w: Vec<f32> = (0..width).map(|i| 1.0 + v(i, 0.7) / 4.0).collect();
        let routes = CpuRoutes {
            ids: (0..m * k).map(|p| p % 7).collect(),
            weights: (0..m * k).map(|p| 0.1 + v(p, 0.3).abs()).collect(),
            k,
        };
        // The serial reference: each row's sum slot by slot, then x + sum, then the norm.
        let mut want_x = x0.clone();
        let mut want = vec![0f32; m * width];
        for r in 0..m {
            let mut sum = vec![0f32; width];
            for j in 0..k {
                let (p, wt) = (r * k + j, routes.weights[r * k + j]);
                sum.iter_mut().zip(&y[p * width..(p + 1) * width]).for_each(|(o, &y)| *o += wt * y);
            }
            let row = &mut want_x[r * width..(r + 1) * width];
            ops::add_inplace(row, &sum);
            ops::rms_norm(row, Some(&w), 1e-6, &mut want[r * width..(r + 1) * width]);
        }
        // Two threads: a team wherever the machine has two cores (CI's and ours).
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for team in [false, true] {
            let run = || {
                let mut x = x0.clone();
                let normed = Cpu.add_combined_rms_norm_to(&mut x, &y, &routes, &w, 1e-6).unwrap();
                let mut x2 = x0.clone();
                let sum = Cpu.combine(&y, &routes, width).unwrap();
                let normed2 = Cpu.add_rms_norm_to(&mut x2, &sum, &w, 1e-6).unwrap();
                let plain = Cpu.rms_norm_to(&x2, &w, 1e-6).unwrap();
                (x, normed, x2, normed2, plain)
            };
            let (x, normed, x2, normed2, plain) = pool.install(|| if team { ts_cpu::team::scope(run) } else { run() });
            let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same(&x, &want_x) && same(&x2, &want_x), "residual rows, team {team}");
            assert!(same(&normed, &want) && same(&normed2, &want) && same(&plain, &want), "normed rows, team {team}");
        }
        // Mismatched lengths are refused by name.
        let err = Cpu.add_rms_norm_to(&mut x0.clone(), &y, &w, 1e-6).unwrap_err();
        assert!(err.to_string().contains("rows of"), "{err}");
    }

    /// Smooth test values in [-1, 1].
    fn smooth(i: usize, f: f32) -> f32 {
        (i as f32 * f).sin()
    }

    /// An attention of `n_head` heads of `hd` over `n_head_kv` KV heads, scale 0.125.
    fn test_shape(
        n_head: usize,
        n_head_kv: usize,
        hd: usize,
        softcap: Option<f32>,
        sinks: Option<&[f32]>,
    ) -> AttnShape<'_> {
        AttnShape { n_head, n_head_kv, head_dim: hd, head_dim_v: hd, scale: 0.125, softcap, sinks }
    }

    /// A cache of `slots` rows of `width` keys and values holding positions `0..end` of smooth values.
    fn filled_cache(kv_type: KvType, slots: usize, width: usize, window: Option<usize>, end: usize) -> LayerCache {
        let mut cache = LayerCache::new(kv_type, slots, width, width, window);
        for pos in 0..end {
            let k: Vec<f32> = (0..width).map(|i| 2.0 * smooth(i + 131 * pos, 0.07)).collect();
            let v: Vec<f32> = (0..width).map(|i| smooth(i + 37 * pos, 0.13)).collect();
            cache.store(pos, &k, &v);
        }
        cache
    }

    /// The largest difference between `got` `[rows][n_head][head_dim]` and what an item of one
    /// head ([`Item::attend`]) gives each row and head over the positions it sees.
    fn worst_against_one_item_a_head(
        shape: &AttnShape,
        q: &[f32],
        rows: &[Row],
        cache: &LayerCache,
        got: &[f32],
    ) -> f32 {
        let (n_head, hd) = (shape.n_head, shape.head_dim);
        let mut worst = 0f32;
        for (i, r) in rows.iter().enumerate() {
            for h in 0..n_head {
                let kvh = h / (n_head / shape.n_head_kv);
                let p = AttentionParams { scale: shape.scale, softcap: shape.softcap, sink: shape.sinks.map(|s| s[h]) };
                let qh = &q[(i * n_head + h) * hd..(i * n_head + h + 1) * hd];
                let item = Item { q: qh, heads: &[p], visible: cache.visible(r.pos), kvh, hd, hdv: hd };
                let mut want = vec![0f32; hd];
                item.attend(cache, &mut want);
                let at = (i * n_head + h) * hd;
                for (g, w) in got[at..at + hd].iter().zip(&want) {
                    worst = worst.max((g - w).abs());
                }
            }
        }
        worst
    }

    /// A decode step's attention in runs of positions merged ([`attention_in_runs`]) gives each
    /// head what an item of that head alone gives over every position it sees, within f32
    /// rounding: one and two KV heads, f32 and f16 caches, a sliding window's ring, sinks and a
    /// soft cap, two rows of one sequence.
    #[test]
    fn attention_in_runs_matches_one_item_a_head() {
        let hd = 64;
        for (n_head, n_head_kv, kv_type, window, softcap, sunk) in [
            (4, 1, KvType::F32, None, None, false),
            (4, 1, KvType::F16, None, Some(20.0), true),
            (6, 2, KvType::F32, Some(600), None, true),
        ] {
            let sinks: Vec<f32> = (0..n_head).map(|h| 0.3 * h as f32 - 0.5).collect();
            let shape = test_shape(n_head, n_head_kv, hd, softcap, sunk.then_some(&sinks[..]));
            let end = 1400;
            let slots = crate::state::ring_slots(window, 4096, 2);
            let cache = filled_cache(kv_type, slots, n_head_kv * hd, window, end);
            let rows: Vec<Row> = (end - 2..end).map(|pos| Row { token: 0, pos, seq: 0, logits: true }).collect();
            let q: Vec<f32> = (0..rows.len() * n_head * hd).map(|i| 3.0 * smooth(i, 0.011)).collect();
            for runs in [2, 3] {
                let out = vec![0f32; rows.len() * n_head * hd];
                let got = attention_in_runs(&shape, &q, &rows, &|_| &cache, runs, out);
                let worst = worst_against_one_item_a_head(&shape, &q, &rows, &cache, &got);
                assert!(
                    worst < 1e-5,
                    "{n_head}/{n_head_kv} heads, {kv_type:?}, window {window:?}, {runs} runs: {worst}"
                );
            }
        }
    }

    /// A prompt's attention as two matmuls a KV head ([`run_attention`]) gives each row and
    /// head what an item of one head ([`ops::attend_group`]) gives it over the positions it
    /// sees, within f32 summation order: f32 and f16 caches, a sliding window's ring, sinks and a soft cap.
    #[test]
    fn prompt_attention_by_matmuls_matches_attend() {
        let (n_head, n_head_kv, hd) = (6, 2, 64);
        let sinks: Vec<f32> = (0..n_head).map(|h| 0.3 * h as f32 - 0.5).collect();
        for (kv_type, window, softcap, sunk) in [
            (KvType::F32, None, None, false),
            (KvType::F16, None, Some(20.0), true),
            (KvType::F32, Some(300), None, true),
        ] {
            let shape = test_shape(n_head, n_head_kv, hd, softcap, sunk.then_some(&sinks[..]));
            // Positions 0..700; the step's rows 140..700 in blocks of [`PROMPT_ATTENTION_BLOCK`],
            // or with the window the last 64 of them, in a ring of 363 slots (wrapped).
            let (first_row, end) = (if window.is_some() { 636 } else { 140 }, 700);
            let slots = crate::state::ring_slots(window, 4096, end - first_row);
            assert!(window.is_none() || slots < end);
            let cache = filled_cache(kv_type, slots, n_head_kv * hd, window, end);
            let rows: Vec<Row> = (first_row..end).map(|pos| Row { token: 0, pos, seq: 0, logits: false }).collect();
            let q: Vec<f32> = (0..rows.len() * n_head * hd).map(|i| 3.0 * smooth(i, 0.011)).collect();
            let got = match cache.rows() {
                KvRows::F32 { k, v } => run_attention(&shape, &q, &rows, cache.view(k, v), &cache),
                KvRows::F16 { k, v } => run_attention(&shape, &q, &rows, cache.view(k, v), &cache),
            }
            .unwrap();
            let worst = worst_against_one_item_a_head(&shape, &q, &rows, &cache, &got);
            assert!(worst < 2e-5, "{kv_type:?}, window {window:?}: largest difference {worst:e}");
        }
    }
}
