//! The routed half of the MoE FFN, written once over backend ops (route, the
//! tier's groups of experts, expert-indexed matmuls, combine), and the
//! routing rule every backend's route op follows. (Shared experts are dense
//! FFNs: forward.rs.)

use crate::ModelError;
use crate::backend::{Backend, ExpertsAt};
use crate::config::{Gating, MoeConfig};
use crate::forward::Model;
use crate::tensors::MoeWeights;
use ts_cpu::ops;

/// The k experts a row goes to, with their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Indices of the k largest values, largest first; ties keep the lower index.
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    // Larger first, ties by index: a total order, so selecting the k first and sorting them
    // gives what sorting every index gives (a full sort of 128 experts was most of a
    // prompt's routing time).
    let order = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..values.len()).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_by(order);
    idx
}

/// Routes one row from its router logits (bias already added); each weight is
/// then multiplied by its expert's `expert_scale` where given (Gemma 4).
pub fn route(moe: &MoeConfig, logits: &[f32], expert_scale: Option<&[f32]>) -> Route {
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
    if let Some(scale) = expert_scale {
        weights.iter_mut().zip(&experts).for_each(|(w, &e)| *w *= scale[e]);
    }
    Route { experts, weights }
}

impl<B: Backend> Model<B> {
    /// The routed experts of MoE layer `il` for the normed input `x`
    /// `[m][n_embd]`, routed by `router_x` (`x` itself but for Gemma 4) unless `routes`
    /// are given, written once for every backend: route; then, where the
    /// experts come through a tier, the used experts in groups the tier holds
    /// (the next MoE layer's guessed experts started early), and each group's
    /// expert-indexed matmuls. Returns each (row, slot) pair's output `[m * k][n_embd]`
    /// and the routes that weigh them ([`Backend::combine`] sums them).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn routed_experts(
        &self,
        il: usize,
        w: &MoeWeights,
        x: &B::Act,
        router_x: &B::Act,
        routes: Option<B::Routes>,
        m: usize,
        scratch: &mut B::Scratch,
    ) -> Result<(B::Act, B::Routes), ModelError> {
        let be = &self.backend;
        let moe = self.cfg.moe.as_ref().expect("MoE weights imply a MoE config");
        let act = self.cfg.ffn_act;
        let e = self.cfg.n_embd;
        let routes = match routes {
            Some(r) => r,
            None => be.route_input(
                &w.router,
                w.router_bias.as_deref(),
                router_x,
                m,
                moe,
                w.expert_scale.as_deref(),
                scratch,
            )?,
        };
        // Each (row, slot) pair's expert output, `[m * k][n_embd]`, summed per row at the end.
        let pairs = m * moe.n_expert_used;
        if !be.experts_tiered(self) {
            // Every pair is written at once.
            let mut y = be.uninit(pairs * e)?;
            let at = ExpertsAt::Stacked;
            be.expert_ffn(w, act, x, &routes, &at, &mut y, scratch)?;
            return Ok((y, routes));
        }
        // The next MoE layer's router applied to this layer's input guesses its experts.
        let guess = match self.prefetch_experts.then(|| self.next_moe_layer(il)).flatten() {
            Some((next, nw)) => {
                Some((next, be.route_input(&nw.router, nw.router_bias.as_deref(), router_x, m, moe, None, scratch)?))
            }
            None => None,
        };
        let ids = be.route_ids(&routes)?;
        // The guesses come back with the routes, before the copies of this layer's misses
        // are queued (a GPU would wait for those copies to read them). A big batch's guess
        // is most of the next layer's experts: reading them early only churns the cache and
        // makes the next layer wait for all of them (measured on the H200: qwen3-30b-a3b
        // pp512 with a quarter of the experts in VRAM, 331 tok/s guessing, 395 without), so
        // only a guess of one token's worth, or at most a quarter of a layer's experts, is fetched.
        let most = moe.n_expert_used.max(moe.n_expert / 4);
        let guess = match guess {
            Some((next, g)) => Some((next, first_seen(&be.route_ids(&g)?))).filter(|(_, g)| g.len() <= most),
            None => None,
        };
        let used = distinct(&ids);
        let capacity = be.expert_capacity(self).max(1);
        // In one group every pair is written; in several, each writes its own.
        let mut y = if used.len() <= capacity { be.uninit(pairs * e)? } else { be.zeros(pairs * e)? };
        let queued = be.expert_matmuls_queue();
        for (gi, group) in used.chunks(capacity).enumerate() {
            let set = be.ensure_experts(self, il, group)?;
            // The guesses' reads or copies queue behind this layer's and overlap with its
            // compute: asked before the matmuls where those compute, after them where they
            // only queue (the device computes while the host chooses the slots).
            let prefetch = |set: &B::ExpertGroup<'_>| match &guess {
                Some((next, g)) if gi == 0 => be.prefetch_experts(self, *next, g, set),
                _ => Ok(()),
            };
            if !queued {
                prefetch(&set)?;
            }
            let at = ExpertsAt::Group { ids: group, group: &set, routes: &ids };
            be.expert_ffn(w, act, x, &routes, &at, &mut y, scratch)?;
            if queued {
                prefetch(&set)?;
            }
            be.host_experts(w, act, x, &routes, &at, &mut y, scratch)?;
        }
        Ok((y, routes))
    }
}

/// The distinct values of `ids` in the order they first appear (a row's routes come most
/// likely first, so a one-row guess stays in that order).
fn first_seen(ids: &[usize]) -> Vec<usize> {
    let mut seen = vec![false; ids.iter().max().map_or(0, |&m| m + 1)];
    ids.iter().copied().filter(|&e| !std::mem::replace(&mut seen[e], true)).collect()
}

/// The distinct values of `ids`, ascending.
fn distinct(ids: &[usize]) -> Vec<usize> {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    v
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
        let r = route(&moe(Gating::Softmax, false), &logits, None);
        assert_eq!(r.experts, vec![1, 2]);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((r.weights[0] - 3f32.exp() / z).abs() < 1e-6);
        let r = route(&moe(Gating::Softmax, true), &logits, None);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!((r.weights[0] - 3f32.exp() / (3f32.exp() + 2f32.exp())).abs() < 1e-6);
    }

    /// The selection gives every k what sorting all the values (larger first, ties by index)
    /// gives, ties and negative zeros included.
    #[test]
    fn top_k_is_the_first_k_of_the_full_order() {
        let mut rng = ts_testkit::Rng::new(7);
        for n in [1usize, 2, 8, 60, 128, 257] {
            // Values from a few levels, so that many tie.
            let values: Vec<f32> =
                (0..n).map(|_| [-0.0, 0.0, 1.5, -2.0, 3.25][(rng.next_u64() % 5) as usize]).collect();
            let mut all: Vec<usize> = (0..n).collect();
            all.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
            for k in 0..=n {
                assert_eq!(top_k(&values, k), all[..k], "n {n}, k {k}");
            }
        }
    }

    #[test]
    fn guesses_keep_the_order_they_first_appear_in() {
        // Two rows' routes, each most likely first: the first row's order, then the new ones.
        assert_eq!(first_seen(&[7, 2, 9, 2, 5, 7]), vec![7, 2, 9, 5]);
        assert_eq!(distinct(&[7, 2, 9, 2, 5, 7]), vec![2, 5, 7, 9]);
        assert!(first_seen(&[]).is_empty());
    }

    #[test]
    fn top_k_then_softmax() {
        let r = route(&moe(Gating::SoftmaxOverTopK, false), &[0.5, -1.0, 4.0, 3.0], None);
        assert_eq!(r.experts, vec![2, 3]);
        assert!((r.weights[0] - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn expert_scale_multiplies_after_renormalising() {
        // Gemma 4: softmax over all experts, top-k, renormalise, then times
        // the chosen expert's learned scale (so the weights no longer sum to 1).
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let scale = [10.0f32, 0.5, 2.0, 7.0];
        let r = route(&moe(Gating::Softmax, true), &logits, Some(&scale));
        assert_eq!(r.experts, vec![1, 2]);
        let (a, b) = (3f32.exp(), 2f32.exp());
        assert!((r.weights[0] - 0.5 * a / (a + b)).abs() < 1e-6);
        assert!((r.weights[1] - 2.0 * b / (a + b)).abs() < 1e-6);
    }
}
