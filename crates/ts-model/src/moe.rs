//! The routed half of the MoE FFN on the CPU: route each row to its top-k
//! experts, run each selected expert once on all the rows that chose it, and
//! sum the weighted outputs. (Shared experts are dense FFNs: forward.rs.)

use crate::ModelError;
use crate::config::{ArchConfig, Gating, MoeConfig};
use crate::forward::{Scratch, linear, linear_bytes};
use crate::tensors::MoeWeights;
use ts_cpu::ops;
use ts_experts::ExpertStore;

/// The k experts a row goes to, with their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Indices of the k largest values, largest first; ties keep the lower index.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Routes one row from its router logits (bias already added).
pub fn route(moe: &MoeConfig, logits: &[f32]) -> Route {
    let k = moe.n_expert_used;
    let (experts, mut weights) = match moe.gating {
        Gating::Softmax => {
            let mut probs = logits.to_vec();
            ops::softmax_inplace(&mut probs);
            let sel = top_k(&probs, k);
            let w = sel.iter().map(|&e| probs[e]).collect();
            (sel, w)
        }
        Gating::SoftmaxOverTopK => {
            let sel = top_k(logits, k);
            let mut w: Vec<f32> = sel.iter().map(|&e| logits[e]).collect();
            ops::softmax_inplace(&mut w);
            (sel, w)
        }
    };
    if moe.renormalize {
        // llama.cpp clamps the sum from below (build_moe_ffn).
        let sum = weights.iter().sum::<f32>().max(6.103_515_6e-5);
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    Route { experts, weights }
}

/// Output `[m][n_embd]` of the routed experts for the normed input `x` `[m][n_embd]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_ffn(
    cfg: &ArchConfig,
    layer: usize,
    w: &MoeWeights,
    next: Option<(usize, &MoeWeights)>,
    store: &dyn ExpertStore,
    x: &[f32],
    m: usize,
    scratch: &mut Scratch,
) -> Result<Vec<f32>, ModelError> {
    let moe = cfg.moe.as_ref().expect("MoE weights imply a MoE config");
    let e = cfg.n_embd;

    let mut logits = Vec::new();
    linear(&w.router, x, m, scratch, &mut logits)?;
    if let Some(b) = &w.router_bias {
        ops::add_bias_rows(&mut logits, b);
    }
    let routes: Vec<Route> = logits.chunks_exact(moe.n_expert).map(|l| route(moe, l)).collect();

    // Rows per expert, so each selected expert is read once for the whole step.
    let mut rows_of: Vec<Vec<(usize, f32)>> = vec![Vec::new(); moe.n_expert];
    for (row, r) in routes.iter().enumerate() {
        for (&ex, &wt) in r.experts.iter().zip(&r.weights) {
            rows_of[ex].push((row, wt));
        }
    }
    let used: Vec<usize> = (0..moe.n_expert).filter(|&ex| !rows_of[ex].is_empty()).collect();

    let mut out = vec![0f32; m * e];
    let (mut xs, mut g, mut u, mut d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // A chunk whose experts exceed the store's slots goes in groups that fit.
    for (gi, group) in used.chunks(store.capacity().max(1)).enumerate() {
        let set = store.ensure(layer, group)?;
        if gi == 0
            && let Some((next_layer, next_w)) = next
        {
            // The next MoE layer's router applied to this layer's input guesses its experts;
            // their reads queue behind this layer's and overlap with its compute.
            let mut next_logits = Vec::new();
            linear(&next_w.router, x, m, scratch, &mut next_logits)?;
            if let Some(b) = &next_w.router_bias {
                ops::add_bias_rows(&mut next_logits, b);
            }
            let mut guess: Vec<usize> =
                next_logits.chunks_exact(moe.n_expert).flat_map(|l| route(moe, l).experts).collect();
            guess.sort_unstable();
            guess.dedup();
            store.prefetch(next_layer, &guess);
        }
        // Experts already in memory first, so reads of the others overlap with their compute.
        let (ready, pending): (Vec<usize>, Vec<usize>) = (0..group.len()).partition(|&i| set.is_ready(i));
        for i in ready.into_iter().chain(pending) {
            let ex = group[i];
            let bytes = set.get(i)?;
            expert_ffn(cfg, w, ex, &bytes, &rows_of[ex], x, scratch, &mut out, [&mut xs, &mut g, &mut u, &mut d])?;
        }
    }

    Ok(out)
}

/// One expert on the rows routed to it, added into `out` with each row's weight.
#[allow(clippy::too_many_arguments)]
fn expert_ffn(
    cfg: &ArchConfig,
    w: &MoeWeights,
    ex: usize,
    bytes: &ts_experts::ExpertBytes,
    rows: &[(usize, f32)],
    x: &[f32],
    scratch: &mut Scratch,
    out: &mut [f32],
    [xs, g, u, d]: [&mut Vec<f32>; 4],
) -> Result<(), ModelError> {
    let e = cfg.n_embd;
    let f = cfg.moe.as_ref().expect("MoE config").n_ff_exp;
    let me = rows.len();
    xs.clear();
    for &(row, _) in rows {
        xs.extend_from_slice(&x[row * e..(row + 1) * e]);
    }
    linear_bytes(&w.gate_exps, bytes.gate, f, xs, me, scratch, g)?;
    linear_bytes(&w.up_exps, bytes.up, f, xs, me, scratch, u)?;
    if let Some(b) = &w.gate_bias {
        ops::add_bias_rows(g, &b[ex * f..(ex + 1) * f]);
    }
    if let Some(b) = &w.up_bias {
        ops::add_bias_rows(u, &b[ex * f..(ex + 1) * f]);
    }
    crate::cpu::gated_activation(cfg.ffn_act, g, u);
    linear_bytes(&w.down_exps, bytes.down, e, g, me, scratch, d)?;
    if let Some(b) = &w.down_bias {
        ops::add_bias_rows(d, &b[ex * e..(ex + 1) * e]);
    }
    for (j, &(row, wt)) in rows.iter().enumerate() {
        let o = &mut out[row * e..(row + 1) * e];
        o.iter_mut().zip(&d[j * e..(j + 1) * e]).for_each(|(o, &v)| *o += wt * v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(gating: Gating, renormalize: bool) -> MoeConfig {
        MoeConfig { n_expert: 4, n_expert_used: 2, n_ff_exp: 8, gating, renormalize, shared: None }
    }

    #[test]
    fn softmax_then_top_k() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let r = route(&moe(Gating::Softmax, false), &logits);
        assert_eq!(r.experts, vec![1, 2]);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((r.weights[0] - 3f32.exp() / z).abs() < 1e-6);
        let r = route(&moe(Gating::Softmax, true), &logits);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((r.weights[0] - 3f32.exp() / (3f32.exp() + 2f32.exp())).abs() < 1e-6);
    }

    #[test]
    fn top_k_then_softmax() {
        let r = route(&moe(Gating::SoftmaxOverTopK, false), &[0.5, -1.0, 4.0, 3.0]);
        assert_eq!(r.experts, vec![2, 3]);
        assert!((r.weights[0] - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }
}
