//! What computes: the ops the forward pass is written in. The model code is
//! generic over a [`Backend`]; [`crate::Cpu`] is the reference every other
//! backend is tested against, op by op.
//!
//! Activations ([`Backend::Act`]) are row-major `[m][width]` f32 matrices in the
//! backend's memory; an op takes `m` and reads widths from its weights.

use crate::ModelError;
use crate::config::{DeltaNetConfig, GatedActivation, MoeConfig};
use crate::forward::{Model, Row};
use crate::state::SeqState;
use crate::tensors::MoeWeights;
use crate::weights::Weight;
use std::ops::Range;
use ts_cpu::ops::Rope;

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

/// Per-head RMS norm of queries and keys before their rotary embedding (Qwen3's
/// `attn_q_norm`, `attn_k_norm`).
#[derive(Clone, Copy, Debug)]
pub struct HeadNorm<'a> {
    /// `[head_dim]` scales of the query heads, of the key heads; None: no scale.
    pub q: Option<&'a [f32]>,
    pub k: Option<&'a [f32]>,
    pub eps: f32,
}

/// Where the experts of an expert matmul are.
pub enum ExpertsAt<'a, G> {
    /// The stacked `*_exps` tensors in the backend's memory, indexed by expert id.
    Stacked,
    /// Entry i of `group` holds expert `ids[i]`; pairs routed to other experts
    /// are left alone. `routes` are the routes' ids on the host, `[m][k]`.
    Group { ids: &'a [usize], group: &'a G, routes: &'a [usize] },
}

/// The settings of one Gated DeltaNet layer's recurrence.
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetParams<'a> {
    pub shape: &'a DeltaNetConfig,
    /// `[n_v_heads]`: `-exp(A_log)`.
    pub a: &'a [f32],
    /// `[n_v_heads]`.
    pub dt_bias: &'a [f32],
    /// Of the q and k L2 norms.
    pub eps: f32,
}

/// [`Backend::rope_store`] as its ops one by one: the norms, the rotations, the store.
#[allow(clippy::too_many_arguments)]
pub fn rope_store_by_ops<B: Backend>(
    be: &B,
    il: usize,
    rope: &Rope,
    q: &mut B::Act,
    kv: Option<(&mut B::Act, &B::Act)>,
    norm: Option<HeadNorm>,
    head_dim: usize,
    rows: &[Row],
    seqs: &mut [&mut SeqState<B::State>],
) -> Result<(), ModelError> {
    if let Some(n) = norm {
        be.rms_norm(q, head_dim, n.q, n.eps)?;
    }
    be.rope(il, rope, q, head_dim, rows)?;
    if let Some((k, v)) = kv {
        if let Some(n) = norm {
            be.rms_norm(k, head_dim, n.k, n.eps)?;
        }
        be.rope(il, rope, k, head_dim, rows)?;
        be.store_kv(il, k, v, rows, seqs)?;
    }
    Ok(())
}

/// How a forward step starts ([`Backend::begin_step`]).
pub enum StepStart<A> {
    /// The step's ops are to be called.
    Run,
    /// The backend has queued a recording of an earlier step of the same kind for these
    /// rows; `logits` is where that step leaves its logits, if it has any.
    Replayed { logits: Option<A> },
}

pub trait Backend: Sized + Send + Sync {
    /// `[m][width]` f32 activations.
    type Act: Send + Sync;
    /// One sequence's state for every layer (keys and values, recurrent state).
    type State: Send + Sync;
    /// A copy of a sequence's recurrent layers' state (attention layers rewind by position).
    type Recurrent: Send + Sync;
    /// Buffers reused across steps.
    type Scratch: Send;
    /// Each row's k routed experts and their weights.
    type Routes;
    /// Experts a tier made available for one layer, pinned while this lives.
    type ExpertGroup<'a>
    where
        Self: 'a;

    /// What computes, in a word (`cpu`, `cuda`), for reports.
    fn name(&self) -> &'static str;
    /// Whether the ops run on the caller's thread pool (rayon): else a step need not be
    /// handed to the pool's threads, a wake-up each way.
    fn uses_thread_pool(&self) -> bool {
        true
    }
    fn scratch(&self, exact_activations: bool) -> Self::Scratch;
    /// The rows (at least `m`) a step of `m` consecutive rows of one sequence is best run as,
    /// every row computing logits, where steps of a few row counts are cheaper than the rest
    /// (the GPU replays a recorded step per row count and kind of logits); `None` where steps
    /// run as they come. Rows past `m` are padding; logits nobody asked for are not read
    /// (`Model::padded`).
    fn padded_rows(&self, m: usize) -> Option<usize> {
        let _ = m;
        None
    }
    /// Steps so far that ran to be recorded (the GPU runs each kind of step once or twice
    /// before replaying it): their time says nothing of later steps of their kind.
    fn warm_ups(&self) -> u64 {
        0
    }
    /// Makes steps with `s` compute every row as a one-row step would, bit for bit
    /// (speculative decoding's checking steps), where the backend's batch kernels differ.
    fn rows_alone(&self, s: &mut Self::Scratch) {
        let _ = s;
    }
    /// State for `n_ctx` positions of `model`, filled `max_chunk` rows at a time.
    fn new_state(&self, model: &Model<Self>, n_ctx: usize, max_chunk: usize) -> Result<Self::State, ModelError>;
    /// A copy of the recurrent layers' state.
    fn save_recurrent(&self, state: &Self::State) -> Result<Self::Recurrent, ModelError>;
    /// Puts back what [`Backend::save_recurrent`] copied.
    fn restore_recurrent(&self, state: &mut Self::State, saved: &Self::Recurrent) -> Result<(), ModelError>;
    /// Makes `dst` a copy of `src`'s first `n_past` positions.
    fn copy_state(&self, src: &Self::State, dst: &mut Self::State, n_past: usize) -> Result<(), ModelError>;

    /// Runs a step of `rows` rows (`step`: the model's forward pass) as the backend's threads
    /// want it run: the CPU keeps its threads spinning between a step's parallel regions
    /// (`ts_cpu::team`; `TURBOSPARK_CPU_TEAM=0|1` forces it).
    fn run_step<R: Send>(&self, rows: usize, step: impl FnOnce() -> R + Send) -> R {
        let _ = rows;
        step()
    }

    /// Called once at the start of each forward step with its rows, sequences and
    /// the scratch its ops will get (whose mode can choose the kernels). A backend that
    /// recorded an earlier step of the same kind may queue that recording for these rows
    /// and answer [`StepStart::Replayed`]: the step's ops are then not called.
    fn begin_step(
        &self,
        _rows: &[Row],
        _seqs: &mut [&mut SeqState<Self::State>],
        _scratch: &Self::Scratch,
    ) -> Result<StepStart<Self::Act>, ModelError> {
        Ok(StepStart::Run)
    }

    /// [`Backend::begin_step`] for a step whose ops must all be called: one that hands back
    /// more than logits (the trunk's hidden states) or runs the MTP head. A backend that
    /// records steps neither replays nor records it.
    fn begin_direct_step(
        &self,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::State>],
        scratch: &Self::Scratch,
    ) -> Result<(), ModelError> {
        match self.begin_step(rows, seqs, scratch)? {
            StepStart::Run => Ok(()),
            StepStart::Replayed { .. } => {
                Err(ModelError::Compute(format!("{}: a step that must run was replayed", self.name())))
            }
        }
    }

    /// The state of one MTP sequence of `n_ctx` positions: the keys and values of the MTP
    /// head's layer (block `n_layer`), and nothing for the trunk's layers.
    fn new_mtp_state(&self, model: &Model<Self>, n_ctx: usize) -> Result<Self::State, ModelError> {
        let _ = (model, n_ctx);
        Err(ModelError::Compute(format!("the {} backend does not run multi-token-prediction heads", self.name())))
    }

    /// Called once at the end of each forward step whose ops ran, after its last op and
    /// before its logits (`[rows wanting logits][n_vocab]`, if any) are read.
    fn end_step(&self, _logits: Option<&Self::Act>) -> Result<(), ModelError> {
        Ok(())
    }

    /// `x` `[m][width]` from the host into the backend's memory (the MTP head's hidden-state
    /// input, which the host keeps between steps).
    fn upload(&self, x: &[f32]) -> Result<Self::Act, ModelError>;
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
    /// Several projections of one input `x` `[m][k]` (`x · wᵀ (+ bias)` for each
    /// `(w, bias)` of `ws`): [`Backend::linear`] one after the other, which a backend may
    /// overlap (q, k and v of an attention layer).
    fn linears(
        &self,
        ws: &[(&Weight, Option<&[f32]>)],
        x: &Self::Act,
        m: usize,
        s: &mut Self::Scratch,
    ) -> Result<Vec<Self::Act>, ModelError> {
        ws.iter().map(|&(w, bias)| self.linear(w, bias, x, m, s)).collect()
    }
    /// A dense FFN's gate and up projections of `x` `[m][k]`: [`Backend::linear`] twice, which
    /// a backend may run as [`Backend::linears`] (the CPU: one region in decode, the rows
    /// quantized once in prompts).
    fn gate_up(
        &self,
        gate: &Weight,
        up: &Weight,
        x: &Self::Act,
        m: usize,
        s: &mut Self::Scratch,
    ) -> Result<(Self::Act, Self::Act), ModelError> {
        Ok((self.linear(gate, None, x, m, s)?, self.linear(up, None, x, m, s)?))
    }
    /// A dense FFN `down · act(gate · x, up · x)` of `x` `[m][k]`: [`Backend::gate_up`],
    /// [`Backend::gated`] and [`Backend::linear`], which a backend may fuse (the CPU's one-row
    /// steps finish each run of the hidden on the thread that computed it).
    #[allow(clippy::too_many_arguments)]
    fn dense_ffn(
        &self,
        gate: &Weight,
        up: &Weight,
        down: &Weight,
        act: GatedActivation,
        x: &Self::Act,
        m: usize,
        s: &mut Self::Scratch,
    ) -> Result<Self::Act, ModelError> {
        dense_ffn_in_steps(self, gate, up, down, act, x, m, s)
    }
    /// RMS norm of every `piece`-wide piece of `x`, times `w` `[piece]` where given.
    fn rms_norm(&self, x: &mut Self::Act, piece: usize, w: Option<&[f32]>, eps: f32) -> Result<(), ModelError>;
    /// [`Backend::rms_norm`] into a new matrix, `x` untouched.
    fn rms_norm_to(&self, x: &Self::Act, w: &[f32], eps: f32) -> Result<Self::Act, ModelError>;
    /// `x += y`, then [`Backend::rms_norm_to`] of the sum (a residual add and the next norm,
    /// which a backend may do in one kernel; the same floats either way).
    fn add_rms_norm_to(&self, x: &mut Self::Act, y: &Self::Act, w: &[f32], eps: f32) -> Result<Self::Act, ModelError> {
        self.add(x, y)?;
        self.rms_norm_to(x, w, eps)
    }
    /// [`Backend::add_rms_norm_to`] of `x` and the routed experts' outputs `y`
    /// `[m * k][width]` summed per row by `routes` ([`Backend::combine`]): the MoE output
    /// added by the next norm, which a backend may do in one kernel.
    fn add_combined_rms_norm_to(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        routes: &Self::Routes,
        w: &[f32],
        eps: f32,
    ) -> Result<Self::Act, ModelError> {
        let sum = self.combine(y, routes, w.len())?;
        self.add_rms_norm_to(x, &sum, w, eps)
    }
    /// [`Backend::add_rms_norm_to`], then [`Backend::route_input`] of its output by the
    /// router of `moe_w` (`[n_embd] -> [n_expert]`, its bias and expert scales): the normed
    /// rows and their routes, which a backend may make in one kernel.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_route(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        w: &[f32],
        eps: f32,
        moe_w: &MoeWeights,
        m: usize,
        moe: &MoeConfig,
        s: &mut Self::Scratch,
    ) -> Result<(Self::Act, Self::Routes), ModelError> {
        let normed = self.add_rms_norm_to(x, y, w, eps)?;
        let (bias, scale) = (moe_w.router_bias.as_deref(), moe_w.expert_scale.as_deref());
        let routes = self.route_input(&moe_w.router, bias, &normed, m, moe, scale, s)?;
        Ok((normed, routes))
    }
    /// `x += y`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act) -> Result<(), ModelError>;
    fn scale(&self, x: &mut Self::Act, s: f32) -> Result<(), ModelError>;
    /// `c * tanh(x / c)` elementwise.
    fn softcap(&self, x: &mut Self::Act, c: f32) -> Result<(), ModelError>;
    /// `gate = act(gate, up)` elementwise.
    fn gated(&self, act: GatedActivation, gate: &mut Self::Act, up: &Self::Act) -> Result<(), ModelError>;
    /// Rotates each `head_dim` head of row i at `rows[i].pos` with layer `il`'s table `rope`.
    fn rope(&self, il: usize, rope: &Rope, x: &mut Self::Act, head_dim: usize, rows: &[Row]) -> Result<(), ModelError>;
    /// Stores each row's k `[m][n_head_kv * head_dim]` and v `[m][n_head_kv * head_dim_v]`
    /// at its position in its sequence's layer-`il` cache.
    fn store_kv(
        &self,
        il: usize,
        k: &Self::Act,
        v: &Self::Act,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::State>],
    ) -> Result<(), ModelError>;
    /// Attends each row's q over the positions it sees in layer `il`'s cache (or in the
    /// cache of the earlier layer it shares); returns `[m][n_head * head_dim_v]`. The
    /// scratch says whether the step asked for exact (f32) arithmetic.
    fn attention(
        &self,
        il: usize,
        shape: &AttnShape,
        q: &Self::Act,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::State>],
        scratch: &Self::Scratch,
    ) -> Result<Self::Act, ModelError>;
    /// A layer's queries and keys made ready and its keys and values stored: `q` and `k`
    /// per-head RMS-normed where `norm` is given, both rotated by layer `il`'s `rope` at each
    /// row's position, then k and v stored ([`Backend::store_kv`]); `kv` is None for a layer
    /// that shares an earlier layer's cache. A backend may do all of it in one kernel.
    #[allow(clippy::too_many_arguments)]
    fn rope_store(
        &self,
        il: usize,
        rope: &Rope,
        q: &mut Self::Act,
        kv: Option<(&mut Self::Act, &Self::Act)>,
        norm: Option<HeadNorm>,
        head_dim: usize,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::State>],
    ) -> Result<(), ModelError> {
        rope_store_by_ops(self, il, rope, q, kv, norm, head_dim, rows, seqs)
    }
    /// [`Backend::rope_store`] then [`Backend::attention`] over the rotated queries
    /// (`shape.head_dim` the heads' width); a backend may do both in one kernel.
    #[allow(clippy::too_many_arguments)]
    fn rope_store_attention(
        &self,
        il: usize,
        rope: &Rope,
        q: &mut Self::Act,
        kv: Option<(&mut Self::Act, &Self::Act)>,
        norm: Option<HeadNorm>,
        shape: &AttnShape,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::State>],
        scratch: &Self::Scratch,
    ) -> Result<Self::Act, ModelError> {
        self.rope_store(il, rope, q, kv, norm, shape.head_dim, rows, seqs)?;
        self.attention(il, shape, q, rows, seqs, scratch)
    }
    /// A copy of `x`.
    fn copy(&self, x: &Self::Act) -> Result<Self::Act, ModelError>;
    /// Columns `start..start + n` of each of the `rows` rows of `x` (each `width`
    /// wide): `[rows][n]` (a gated attention's queries or gates, a layer's slice
    /// of the per-layer inputs).
    fn columns(
        &self,
        x: &Self::Act,
        rows: usize,
        width: usize,
        start: usize,
        n: usize,
    ) -> Result<Self::Act, ModelError>;
    /// `x *= sigmoid(gate)` elementwise.
    fn mul_sigmoid(&self, x: &mut Self::Act, gate: &Self::Act) -> Result<(), ModelError>;
    /// Causal depthwise convolution of `x` `[m][channels]` with `taps`
    /// `[channels][kernel]` over each row's sequence's layer-`il` window, then
    /// SiLU; the windows move on.
    fn conv_silu(
        &self,
        il: usize,
        taps: &[f32],
        kernel: usize,
        x: &Self::Act,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::State>],
    ) -> Result<Self::Act, ModelError>;
    /// The gated delta rule of layer `il` over each row's sequence's recurrent
    /// state: `qkv` `[m][conv_dim]` (convolved q, k and v heads), `beta` and
    /// `alpha` `[m][n_v_heads]` (raw projections); q and k L2-normalised,
    /// `beta = sigmoid(beta)`, decay `e^g` with `g = a * softplus(alpha + dt_bias)`.
    /// Returns `[m][n_v_heads * d_v]`.
    #[allow(clippy::too_many_arguments)]
    fn delta_net(
        &self,
        il: usize,
        p: &DeltaNetParams,
        qkv: &Self::Act,
        beta: &Self::Act,
        alpha: &Self::Act,
        rows: &[Row],
        seqs: &mut [&mut SeqState<Self::State>],
    ) -> Result<Self::Act, ModelError>;
    /// `y[r] *= sigmoid(gate · x[r])` for rows of `gate.len()` (a sigmoid-gated shared expert).
    fn sigmoid_gate(&self, y: &mut Self::Act, x: &Self::Act, gate: &[f32]) -> Result<(), ModelError>;
    /// Each row's k experts and their weights from router logits
    /// `[m][n_expert]` (bias added): gating, top-k (ties to the lower id),
    /// renormalisation as `moe` says; then each weight times its expert's
    /// `expert_scale` `[n_expert]` where given.
    fn route(
        &self,
        logits: &Self::Act,
        m: usize,
        moe: &MoeConfig,
        expert_scale: Option<&[f32]>,
    ) -> Result<Self::Routes, ModelError>;
    /// Routes each row of `x` `[m][n_embd]` by the router `w` (`[n_embd] -> [n_expert]`,
    /// plus `bias`): [`Backend::linear`] then [`Backend::route`], which a backend may do in
    /// one kernel.
    #[allow(clippy::too_many_arguments)]
    fn route_input(
        &self,
        w: &Weight,
        bias: Option<&[f32]>,
        x: &Self::Act,
        m: usize,
        moe: &MoeConfig,
        expert_scale: Option<&[f32]>,
        s: &mut Self::Scratch,
    ) -> Result<Self::Routes, ModelError> {
        let logits = self.linear(w, bias, x, m, s)?;
        self.route(&logits, m, moe, expert_scale)
    }
    /// The routes' expert ids, `[m][k]`, on the host.
    fn route_ids(&self, routes: &Self::Routes) -> Result<Vec<usize>, ModelError>;
    /// Whether routed experts come through a tier of slots ([`Backend::ensure_experts`])
    /// rather than all living in the backend's memory as the stacked tensors.
    fn experts_tiered(&self, model: &Model<Self>) -> bool;
    /// The most experts one group from the tier may hold.
    fn expert_capacity(&self, model: &Model<Self>) -> usize;
    /// Makes experts `ids` of layer `il` available, pinned while the group lives.
    fn ensure_experts<'a>(
        &'a self,
        model: &'a Model<Self>,
        il: usize,
        ids: &[usize],
    ) -> Result<Self::ExpertGroup<'a>, ModelError>;
    /// Whether the expert matmuls only queue their work (a GPU's launches), so that a
    /// prefetch asked after them overlaps with their compute; false where the calls
    /// compute, and a prefetch must come first to overlap with them.
    fn expert_matmuls_queue(&self) -> bool {
        false
    }
    /// Starts bringing experts `ids` of layer `il` in early (guesses), sparing `keep`'s slots.
    fn prefetch_experts(
        &self,
        model: &Model<Self>,
        il: usize,
        ids: &[usize],
        keep: &Self::ExpertGroup<'_>,
    ) -> Result<(), ModelError>;
    /// `act(gate_e · x[r] + bias) * (up_e · x[r] + bias)` for every (row r, slot j)
    /// pair of `routes` whose expert `e` is `at`: `[m * k][n_ff_exp]` (the
    /// expert-indexed matmul of ggml's `mul_mat_id`, gate and up together).
    #[allow(clippy::too_many_arguments)]
    fn expert_gate_up(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Self::Act,
        routes: &Self::Routes,
        at: &ExpertsAt<'_, Self::ExpertGroup<'_>>,
        s: &mut Self::Scratch,
    ) -> Result<Self::Act, ModelError>;
    /// `y[p] = down_e · h[p] + bias` for the pairs `at`, into `y` `[m * k][n_embd]`
    /// (other pairs' rows left as they are).
    #[allow(clippy::too_many_arguments)]
    fn expert_down(
        &self,
        w: &MoeWeights,
        h: &Self::Act,
        routes: &Self::Routes,
        at: &ExpertsAt<'_, Self::ExpertGroup<'_>>,
        y: &mut Self::Act,
        s: &mut Self::Scratch,
    ) -> Result<(), ModelError>;
    /// [`Backend::expert_gate_up`] then [`Backend::expert_down`] for the pairs `at`, into `y`
    /// (a backend may run each expert's two steps together). Default: the two calls.
    #[allow(clippy::too_many_arguments)]
    fn expert_ffn(
        &self,
        w: &MoeWeights,
        act: GatedActivation,
        x: &Self::Act,
        routes: &Self::Routes,
        at: &ExpertsAt<'_, Self::ExpertGroup<'_>>,
        y: &mut Self::Act,
        s: &mut Self::Scratch,
    ) -> Result<(), ModelError> {
        let h = self.expert_gate_up(w, act, x, routes, at, s)?;
        self.expert_down(w, &h, routes, at, y, s)
    }
    /// `y[p]` for the pairs of group `at` whose experts the backend left to the host's CPU
    /// (a GPU's cache misses computed where the expert is, not copied in), as
    /// `expert_gate_up` then `expert_down` would write them. Asked after the group's matmuls
    /// and the next layer's prefetch, so that the device and the copies run meanwhile.
    /// Default: the group left nothing to the host.
    #[allow(clippy::too_many_arguments)]
    fn host_experts(
        &self,
        _w: &MoeWeights,
        _act: GatedActivation,
        _x: &Self::Act,
        _routes: &Self::Routes,
        _at: &ExpertsAt<'_, Self::ExpertGroup<'_>>,
        _y: &mut Self::Act,
        _s: &mut Self::Scratch,
    ) -> Result<(), ModelError> {
        Ok(())
    }
    /// `out[r] = Σ_j weight[r][j] · y[r * k + j]`, in the order of j (so the sum
    /// does not depend on how the experts were grouped): `[m][width]`.
    fn combine(&self, y: &Self::Act, routes: &Self::Routes, width: usize) -> Result<Self::Act, ModelError>;
    /// `[n]` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Act, ModelError>;
    /// `[n]` floats whose values are unspecified (every one is written before it is read).
    fn uninit(&self, n: usize) -> Result<Self::Act, ModelError> {
        self.zeros(n)
    }
    /// Rows `rows` of `x` (each `width` wide), in that order.
    fn select_rows(&self, x: &Self::Act, width: usize, rows: &[usize]) -> Result<Self::Act, ModelError>;
    fn to_host(&self, x: &Self::Act) -> Result<Vec<f32>, ModelError>;
    /// Hands `read` each of the rows `rows` of `row_len` of `x` (those it holds), in order,
    /// where they are on the host: a GPU's rows in the page-locked memory they land in, read
    /// there and not copied again (as llama.cpp's logits are), valid only during the call.
    fn read_rows(
        &self,
        x: &Self::Act,
        row_len: usize,
        rows: Range<usize>,
        read: &mut dyn FnMut(&[f32]),
    ) -> Result<(), ModelError> {
        host_rows(&self.to_host(x)?, row_len, rows).for_each(read);
        Ok(())
    }
    /// The rows `rows` of `row_len` of `x` (those it holds) on the host, one Vec per row.
    fn rows_to_host(&self, x: &Self::Act, row_len: usize, rows: Range<usize>) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut out = Vec::new();
        self.read_rows(x, row_len, rows, &mut |row| out.push(row.to_vec()))?;
        Ok(out)
    }

    /// Counters of an expert cache the backend keeps itself (a GPU's VRAM cache).
    fn expert_stats(&self) -> Option<ts_experts::StatsSnapshot> {
        None
    }
}

/// Rows `rows` of `row_len` floats of `held` (those it holds): what [`Backend::read_rows`]
/// reads once the floats are on the host.
pub fn host_rows(held: &[f32], row_len: usize, rows: Range<usize>) -> impl Iterator<Item = &[f32]> {
    held.chunks_exact(row_len).skip(rows.start).take(rows.len())
}

/// [`Backend::dense_ffn`] as its three steps: [`Backend::gate_up`], [`Backend::gated`],
/// [`Backend::linear`] (the default, and a fusing backend's way for what it does not fuse).
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_ffn_in_steps<B: Backend>(
    be: &B,
    gate: &Weight,
    up: &Weight,
    down: &Weight,
    act: GatedActivation,
    x: &B::Act,
    m: usize,
    s: &mut B::Scratch,
) -> Result<B::Act, ModelError> {
    let (mut g, u) = be.gate_up(gate, up, x, m, s)?;
    be.gated(act, &mut g, &u)?;
    be.linear(down, None, &g, m, s)
}
