//! The routed experts' products on the CPU: a one-row step's flat regions (every expert's gate
//! and up in one, their down products in another), a prompt's experts as parallel tasks (whole
//! experts a thread, or rayon tasks whose products split again), and the expert functions the
//! GPU's host experts call too.

use super::*;

/// A prompt's rows `x` `[m][n_embd]` quantized once for every expert where gate and up take
/// the same 8-bit activations (each expert then gathers its rows' blocks); None where each
/// expert gathers its rows as floats.
pub(super) fn prompt_rows_quantized(
    w: &MoeWeights,
    x: &[f32],
    routes: &CpuRoutes,
    s: &Scratch,
) -> Result<Option<ts_cpu::QuantizedRows>, ModelError> {
    if !shares_activations(w, s) {
        return Ok(None);
    }
    let e = w.gate_exps.row_len();
    let mut xq = ts_cpu::QuantizedRows::new();
    xq.quantize(w.gate_exps.ty, &x[..routes.ids.len() / routes.k.max(1) * e], e)
        .map_err(|err| ModelError::Compute(format!("{}: {err}", w.gate_exps.name)))?;
    Ok(Some(xq))
}

/// Expert `ex`'s h for `pairs` (pair p is row p / k of `x`), `[pairs][n_ff_exp]`: from the
/// rows' blocks in `quantized` where there are, else from their floats.
#[allow(clippy::too_many_arguments)]
pub(super) fn hidden_of_pairs(
    w: &MoeWeights,
    act: GatedActivation,
    x: &[f32],
    quantized: Option<&ts_cpu::QuantizedRows>,
    k: usize,
    (ex, bytes): (usize, &ExpertBytes<'_>),
    pairs: &[usize],
    s: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let rows = pairs.iter().map(|&p| p / k);
    match quantized {
        Some(xq) => {
            hold_quantized_rows(s, xq, &rows.collect::<Vec<_>>())?;
            expert_hidden_held(w, act, ex, bytes, s)
        }
        None => expert_hidden(w, act, ex, bytes, &gather_rows(x, w.gate_exps.row_len(), rows), pairs.len(), s),
    }
}

/// Whether a prompt's experts run gate/up and down on one task each (`TURBOSPARK_FUSED_EXPERTS=0`,
/// a measurement knob, keeps the two regions).
pub(super) fn fused_experts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TURBOSPARK_FUSED_EXPERTS").as_deref() != Ok("0"))
}

/// Expert `ex`'s `act(gate · x + bias) * (up · x + bias)` for the `n` rows `xs`
/// `[n][n_embd]` on the CPU: `[n][n_ff_exp]`.
pub fn expert_hidden(
    w: &MoeWeights,
    act: GatedActivation,
    ex: usize,
    bytes: &ExpertBytes<'_>,
    xs: &[f32],
    n: usize,
    s: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let f = w.gate_exps.n_rows();
    let (mut g, mut u) = (Vec::new(), Vec::new());
    linear_bytes(&w.gate_exps, bytes.gate, bytes.packed[0], f, xs, n, s, &mut g)?;
    if shares_activations(w, s) {
        // The gate's quantized rows serve the up product too.
        return hidden_from(w, act, ex, bytes, g, s);
    }
    linear_bytes(&w.up_exps, bytes.up, bytes.packed[1], f, xs, n, s, &mut u)?;
    finish_hidden(w, act, ex, 0..w.gate_exps.n_rows(), &mut g, &mut u);
    Ok(g)
}

/// Whether an expert's gate and up products take the same 8-bit activations (of one type, not
/// exact), so that its rows are quantized once for both.
pub(super) fn shares_activations(w: &MoeWeights, s: &Scratch) -> bool {
    activations_of(w.up_exps.ty) == activations_of(w.gate_exps.ty) && !s.exact_activations
}

/// [`expert_hidden`] of the rows `s.xq` holds, quantized for the gate's type (where
/// [`shares_activations`]).
pub(super) fn expert_hidden_held(
    w: &MoeWeights,
    act: GatedActivation,
    ex: usize,
    bytes: &ExpertBytes<'_>,
    s: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let mut g = Vec::new();
    linear_bytes_again(&w.gate_exps, bytes.gate, bytes.packed[0], w.gate_exps.n_rows(), s, &mut g)?;
    hidden_from(w, act, ex, bytes, g, s)
}

/// The up product of the rows `s.xq` holds, then `act(g, u)` with the gate's `g`.
pub(super) fn hidden_from(
    w: &MoeWeights,
    act: GatedActivation,
    ex: usize,
    bytes: &ExpertBytes<'_>,
    mut g: Vec<f32>,
    s: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let mut u = Vec::new();
    linear_bytes_again(&w.up_exps, bytes.up, bytes.packed[1], w.up_exps.n_rows(), s, &mut u)?;
    finish_hidden(w, act, ex, 0..w.gate_exps.n_rows(), &mut g, &mut u);
    Ok(g)
}

/// Expert `ex`'s gate and up products with their biases, then `g = act(g, u)`: rows of its
/// hidden's elements `cols` (`[n][n_ff_exp]` for `0..n_ff_exp`).
pub(super) fn finish_hidden(
    w: &MoeWeights,
    act: GatedActivation,
    ex: usize,
    cols: std::ops::Range<usize>,
    g: &mut [f32],
    u: &mut [f32],
) {
    let f = w.gate_exps.n_rows();
    let run = ex * f + cols.start..ex * f + cols.end;
    if let Some(b) = &w.gate_bias {
        ops::add_bias_rows(g, &b[run.clone()]);
    }
    if let Some(b) = &w.up_bias {
        ops::add_bias_rows(u, &b[run]);
    }
    gated_activation(act, g, u);
}

/// Expert `ex`'s down products `[n][n_embd]` with their bias.
pub(super) fn finish_output(w: &MoeWeights, ex: usize, d: &mut [f32]) {
    let e = w.down_exps.n_rows();
    if let Some(b) = &w.down_bias {
        ops::add_bias_rows(d, &b[ex * e..(ex + 1) * e]);
    }
}

/// Expert `ex`'s `down · h + bias` for the `n` rows `hs` `[n][n_ff_exp]` on the CPU:
/// `[n][n_embd]`.
pub fn expert_output(
    w: &MoeWeights,
    ex: usize,
    bytes: &ExpertBytes<'_>,
    hs: &[f32],
    n: usize,
    s: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let e = w.down_exps.n_rows();
    let mut d = Vec::new();
    linear_bytes(&w.down_exps, bytes.down, bytes.packed[2], e, hs, n, s, &mut d)?;
    finish_output(w, ex, &mut d);
    Ok(d)
}

/// Steps of at least this many rows run their experts in memory as parallel tasks, each
/// expert's matmuls on one task (a prompt's experts have few rows each: split within an
/// expert, the threads met at every one of its matmuls). Fewer rows (decode) split each
/// expert's matmuls over the threads instead (measured faster there, third session).
pub(super) const PARALLEL_EXPERT_ROWS: usize = 16;

/// Copies row j of each expert's result `(pairs, rows [pairs.len()][width])` into row
/// `pairs[j]` of `dst` `[n][width]` (every pair belongs to one expert); rows no result names
/// are left as they are.
pub(super) fn scatter_rows(dst: &mut [f32], width: usize, results: &[(Vec<usize>, Vec<f32>)]) {
    let mut from: Vec<Option<&[f32]>> = vec![None; dst.len() / width.max(1)];
    for (pairs, rows) in results {
        for (&p, row) in pairs.iter().zip(rows.chunks_exact(width)) {
            from[p] = Some(row);
        }
    }
    let copy = |(row, src): (&mut [f32], &Option<&[f32]>)| {
        if let Some(src) = src {
            row.copy_from_slice(src);
        }
    };
    if dst.len() >= PARALLEL_COPY_FLOATS {
        dst.par_chunks_mut(width).zip(&from).for_each(copy);
    } else {
        dst.chunks_mut(width).zip(&from).for_each(copy);
    }
}

/// The rows `[pairs][width]` of a MoE layer's expert outputs, handed to the experts' tasks:
/// each writes only its own pairs' rows.
struct PairRows(*mut f32, usize);

// SAFETY: tasks write disjoint rows (see `experts_with_their_rows`).
unsafe impl Sync for PairRows {}

impl PairRows {
    /// Row `p`.
    ///
    /// # Safety
    /// Row `p` lies within the rows this was made from, which outlive the returned slice,
    /// and no other thread reads or writes it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, p: usize) -> &mut [f32] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(p * self.1), self.1) }
    }
}

/// Whether a prompt's `experts` (those with pairs) run one whole expert a thread, each
/// expert's products on its thread alone, rather than as rayon tasks whose products split
/// further over idle threads (`TURBOSPARK_WHOLE_EXPERTS`: `1` always, `0` never, else where
/// there are at least [`WHOLE_EXPERTS_PER_THREAD`] experts a thread to balance the load).
pub(super) fn whole_experts(experts: usize) -> bool {
    static KNOB: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let knob = *KNOB.get_or_init(|| match std::env::var("TURBOSPARK_WHOLE_EXPERTS").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    });
    knob.unwrap_or(experts >= WHOLE_EXPERTS_PER_THREAD * rayon::current_num_threads())
}

/// See [`whole_experts`].
pub(super) const WHOLE_EXPERTS_PER_THREAD: usize = 4;

/// Rows `rows` of `x` (rows of `k`), one after another: whole-row copies (an iterator over
/// their elements cost 2% of qwen3's prefill on two cores).
pub(super) fn gather_rows(x: &[f32], k: usize, rows: impl ExactSizeIterator<Item = usize>) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * k);
    for r in rows {
        out.extend_from_slice(&x[r * k..(r + 1) * k]);
    }
    out
}

/// Each pair's expert and its bytes, in pair order, where [`DecodeProducts::Flat`] applies: a
/// one-row step with 8-bit activations whose experts are all in memory now; else None.
pub(super) fn flat_experts<'a>(
    w: &'a MoeWeights,
    routes: &CpuRoutes,
    at: &'a ExpertsAt<'_, ExpertSet<'_>>,
    s: &Scratch,
) -> Result<Option<Vec<(usize, ExpertBytes<'a>)>>, ModelError> {
    if decode_products() != DecodeProducts::Flat || s.exact_activations || routes.ids.len() != routes.k {
        return Ok(None);
    }
    let mut experts = Vec::with_capacity(routes.ids.len());
    for &ex in &routes.ids {
        let bytes = match at {
            ExpertsAt::Stacked => ExpertBytes {
                gate: w.gate_exps.matrix_bytes(ex),
                up: w.up_exps.matrix_bytes(ex),
                down: w.down_exps.matrix_bytes(ex),
                packed: [false; 3],
            },
            ExpertsAt::Group { ids, group, .. } => match ids.iter().position(|&id| id == ex) {
                Some(i) if group.is_ready(i) => group.get(i)?,
                _ => return Ok(None),
            },
        };
        experts.push((ex, bytes));
    }
    Ok(Some(experts))
}

/// [`Backend::expert_gate_up`] of a one-row step, every product in one parallel region:
/// `[pairs][n_ff_exp]`, the floats of [`expert_hidden`].
pub(super) fn flat_gate_up(
    w: &MoeWeights,
    act: GatedActivation,
    x: &[f32],
    experts: &[(usize, ExpertBytes<'_>)],
) -> Result<Vec<f32>, ModelError> {
    flat_hidden(w, act, x, experts, None)
}

/// Each expert's hidden `[pairs][n_ff_exp]` of the one row `x`, its gate and up products in one
/// parallel region, each task finishing its rows (biases, activation) and, with `down_inputs`,
/// quantizing them for down (one row each): the floats of [`expert_hidden`].
fn flat_hidden(
    w: &MoeWeights,
    act: GatedActivation,
    x: &[f32],
    experts: &[(usize, ExpertBytes<'_>)],
    down_inputs: Option<&mut [ts_cpu::QuantizedRows]>,
) -> Result<Vec<f32>, ModelError> {
    let (e, f) = (w.gate_exps.row_len(), w.gate_exps.n_rows());
    let cerr = |e: ts_cpu::CpuError| ModelError::Compute(format!("{}: {e}", w.gate_exps.name));
    let xg = quantized_row(w.gate_exps.ty, &x[..e]).map_err(cerr)?;
    let xu = match activations_of(w.up_exps.ty) == activations_of(w.gate_exps.ty) {
        true => None,
        false => Some(quantized_row(w.up_exps.ty, &x[..e]).map_err(cerr)?),
    };
    let xu = xu.as_ref().unwrap_or(&xg);
    let (mut g, mut u) =
        timing().time(Phase::Outputs, || (vec![0f32; experts.len() * f], vec![0f32; experts.len() * f]));
    let mut down_inputs = down_inputs.map(|q| q.iter_mut());
    let mut pairs = Vec::with_capacity(experts.len());
    for ((_, bytes), (gp, up)) in experts.iter().zip(g.chunks_mut(f).zip(u.chunks_mut(f))) {
        pairs.push(ts_cpu::GatedMatvec {
            gate: ts_cpu::Matvec {
                weight_ty: w.gate_exps.ty,
                w: bytes.gate,
                n_out: f,
                k: e,
                packed: bytes.packed[0],
                x: &xg,
                out: gp,
            },
            up: ts_cpu::Matvec {
                weight_ty: w.up_exps.ty,
                w: bytes.up,
                n_out: f,
                k: e,
                packed: bytes.packed[1],
                x: xu,
                out: up,
            },
            down: down_inputs.as_mut().and_then(|q| q.next()).map(|q| (w.down_exps.ty, q)),
        });
    }
    let finish = |pair: usize, start: usize, g: &mut [f32], u: &mut [f32]| {
        finish_hidden(w, act, experts[pair].0, start..start + g.len(), g, u)
    };
    ts_cpu::gated_matvecs(&mut pairs, &finish).map_err(cerr)?;
    Ok(g)
}

/// [`Backend::expert_down`] of a one-row step, every product in one parallel region: each
/// pair's row of `y` `[pairs][n_embd]`, the floats of [`expert_output`].
pub(super) fn flat_down(
    w: &MoeWeights,
    h: &[f32],
    experts: &[(usize, ExpertBytes<'_>)],
    y: &mut [f32],
) -> Result<(), ModelError> {
    let f = w.down_exps.row_len();
    let cerr = |e: ts_cpu::CpuError| ModelError::Compute(format!("{}: {e}", w.down_exps.name));
    let hq = h
        .chunks(f)
        .take(experts.len())
        .map(|hp| quantized_row(w.down_exps.ty, hp))
        .collect::<Result<Vec<_>, _>>()
        .map_err(cerr)?;
    flat_down_of(w, &hq, experts, y)
}

/// The down products of a one-row step's experts in one parallel region, from each pair's
/// hidden quantized for down (`hq`): each pair's row of `y` `[pairs][n_embd]`.
fn flat_down_of(
    w: &MoeWeights,
    hq: &[ts_cpu::QuantizedRows],
    experts: &[(usize, ExpertBytes<'_>)],
    y: &mut [f32],
) -> Result<(), ModelError> {
    let (e, f) = (w.down_exps.n_rows(), w.down_exps.row_len());
    let cerr = |e: ts_cpu::CpuError| ModelError::Compute(format!("{}: {e}", w.down_exps.name));
    let mut products: Vec<ts_cpu::Matvec<'_>> = experts
        .iter()
        .zip(hq)
        .zip(y.chunks_mut(e))
        .map(|(((_, bytes), x), out)| ts_cpu::Matvec {
            weight_ty: w.down_exps.ty,
            w: bytes.down,
            n_out: e,
            k: f,
            packed: bytes.packed[2],
            x,
            out,
        })
        .collect();
    ts_cpu::matvecs(&mut products).map_err(cerr)?;
    for ((ex, _), yp) in experts.iter().zip(y.chunks_mut(e)) {
        finish_output(w, *ex, yp);
    }
    Ok(())
}

/// A one-row step's routed experts (each with its bytes) applied to `x` `[n_embd]` in two
/// parallel regions: every gate and up product in one (each task finishing its rows of the
/// hidden and quantizing them for down), every down product in the other. Each pair's row of
/// `y` `[pairs][n_embd]`, the floats of [`expert_hidden`] then [`expert_output`].
pub(super) fn flat_experts_ffn(
    w: &MoeWeights,
    act: GatedActivation,
    x: &[f32],
    experts: &[(usize, ExpertBytes<'_>)],
    y: &mut [f32],
) -> Result<(), ModelError> {
    let mut hq: Vec<ts_cpu::QuantizedRows> = experts.iter().map(|_| ts_cpu::QuantizedRows::new()).collect();
    timing().time(Phase::ExpertGateUp, || flat_hidden(w, act, x, experts, Some(&mut hq)))?;
    timing().time(Phase::ExpertDown, || flat_down_of(w, &hq, experts, y))
}

/// Experts `experts` (each with its bytes) applied to the one row `x` `[n_embd]` with 8-bit
/// activations, as a one-row step's flat products run them ([`flat_experts_ffn`]). Returns
/// `[experts][n_embd]`. The GPU's misses computed on the host take this path.
pub fn experts_of_one_row(
    w: &MoeWeights,
    act: GatedActivation,
    x: &[f32],
    experts: &[(usize, ExpertBytes<'_>)],
) -> Result<Vec<f32>, ModelError> {
    let mut y = vec![0f32; experts.len() * w.down_exps.n_rows()];
    flat_experts_ffn(w, act, x, experts, &mut y)?;
    Ok(y)
}

/// Calls `f(expert, its bytes, its pairs, scratch)` for each expert `at` that some pair of
/// `routes` goes to and hands each result to `sink` with the expert's pairs: the experts
/// already in memory first (so that reads of the others overlap with their work), in
/// parallel for steps of [`PARALLEL_EXPERT_ROWS`] rows or more (each task with a scratch of
/// `s`'s mode), then the others as their reads complete.
pub(super) fn map_experts<T: Send>(
    w: &MoeWeights,
    routes: &CpuRoutes,
    at: &ExpertsAt<'_, ExpertSet<'_>>,
    s: &mut Scratch,
    f: impl Fn(usize, ExpertBytes<'_>, &[usize], &mut Scratch) -> Result<T, ModelError> + Sync,
    mut sink: impl FnMut(&[usize], T),
) -> Result<(), ModelError> {
    let n_expert = w.gate_exps.dims[2];
    let mut pairs_of: Vec<Vec<usize>> = vec![Vec::new(); n_expert];
    for (p, &ex) in routes.ids.iter().enumerate() {
        pairs_of[ex].push(p);
    }
    // The experts in memory now, and (for a group still being read) the indices of the rest.
    let (ready, pending): (Vec<(usize, ExpertBytes<'_>)>, Vec<usize>) = match at {
        ExpertsAt::Stacked => {
            let ready = (0..n_expert)
                .filter(|&ex| !pairs_of[ex].is_empty())
                .map(|ex| {
                    let bytes = ExpertBytes {
                        gate: w.gate_exps.matrix_bytes(ex),
                        up: w.up_exps.matrix_bytes(ex),
                        down: w.down_exps.matrix_bytes(ex),
                        packed: [false; 3],
                    };
                    (ex, bytes)
                })
                .collect();
            (ready, Vec::new())
        }
        ExpertsAt::Group { ids, group, .. } => {
            let (now, later): (Vec<usize>, Vec<usize>) =
                (0..ids.len()).filter(|&i| !pairs_of[ids[i]].is_empty()).partition(|&i| group.is_ready(i));
            let now = now.into_iter().map(|i| Ok((ids[i], group.get(i)?))).collect::<Result<_, ModelError>>()?;
            (now, later)
        }
    };
    let tasks =
        routes.ids.len() / routes.k.max(1) >= PARALLEL_EXPERT_ROWS || decode_products() == DecodeProducts::Tasks;
    if tasks && ready.len() > 1 && whole_experts(ready.len()) {
        // Each thread takes one whole expert at a time, the experts with the most pairs first,
        // and runs its products by itself.
        let mut order: Vec<usize> = (0..ready.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(pairs_of[ready[i].0].len()));
        let slots: Vec<std::sync::Mutex<Option<Result<T, ModelError>>>> =
            ready.iter().map(|_| std::sync::Mutex::new(None)).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let base: &Scratch = s;
        ts_cpu::team::for_each(rayon::current_num_threads().min(ready.len()), &|_| {
            let mut sc = base.same_mode();
            ts_cpu::team::on_this_thread(|| {
                while let Some(&i) = order.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                    let (ex, bytes) = ready[i];
                    let r = f(ex, bytes, &pairs_of[ex], &mut sc);
                    *slots[i].lock().expect("an expert's slot") = Some(r);
                }
            })
        });
        for (&(ex, _), slot) in ready.iter().zip(slots) {
            sink(&pairs_of[ex], slot.into_inner().expect("an expert's slot").expect("every expert ran")?);
        }
    } else if tasks && ready.len() > 1 {
        use rayon::prelude::*;
        let results: Vec<Result<T, ModelError>> =
            ready.par_iter().map_init(|| s.same_mode(), |sc, &(ex, bytes)| f(ex, bytes, &pairs_of[ex], sc)).collect();
        for (&(ex, _), r) in ready.iter().zip(results) {
            sink(&pairs_of[ex], r?);
        }
    } else {
        for &(ex, bytes) in &ready {
            sink(&pairs_of[ex], f(ex, bytes, &pairs_of[ex], s)?);
        }
    }
    if let ExpertsAt::Group { ids, group, .. } = at {
        for i in pending {
            let ex = ids[i];
            sink(&pairs_of[ex], f(ex, group.get(i)?, &pairs_of[ex], s)?);
        }
    }
    Ok(())
}

/// A prompt's experts each running gate/up and then down on one task and writing their pairs'
/// rows of `y` `[pairs][n_embd]` themselves ([`Backend::expert_ffn`] on the CPU).
pub(super) fn experts_with_their_rows(
    w: &MoeWeights,
    act: GatedActivation,
    x: &[f32],
    routes: &CpuRoutes,
    at: &ExpertsAt<'_, ExpertSet<'_>>,
    y: &mut [f32],
    s: &mut Scratch,
) -> Result<(), ModelError> {
    let e = w.down_exps.n_rows();
    check_rows(y, routes.ids.len() * e, e)?;
    let quantized = prompt_rows_quantized(w, x, routes, s)?;
    let rows = PairRows(y.as_mut_ptr(), e);
    let rows = &rows;
    // Each expert writes its own pairs' rows of `y`, from its task.
    let ffn = |ex: usize, bytes: ExpertBytes<'_>, pairs: &[usize], s: &mut Scratch| {
        let h = hidden_of_pairs(w, act, x, quantized.as_ref(), routes.k, (ex, &bytes), pairs, s)?;
        let d = expert_output(w, ex, &bytes, &h, pairs.len(), s)?;
        for (&p, src) in pairs.iter().zip(d.chunks_exact(e)) {
            // SAFETY: `y` holds `routes.ids.len()` rows (checked above) and is borrowed
            // mutably for this call; the experts' pair lists split the pairs, so no
            // other task writes row `p`.
            unsafe { rows.row(p) }.copy_from_slice(src);
        }
        Ok(())
    };
    map_experts(w, routes, at, s, ffn, |_, ()| {})
}
