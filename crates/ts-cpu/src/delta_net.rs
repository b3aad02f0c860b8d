//! Gated DeltaNet kernels (Yang et al., arXiv:2412.06464) on f32: the causal
//! depthwise convolution before it, and the gated delta rule for one value
//! head over consecutive positions, token by token (the reference) and in
//! chunks of 64 (the same numbers in another order, as transformers'
//! `torch_chunk_gated_delta_rule` computes them; docs/FAMILIES.md §6.3-6.4).

use crate::ops::{axpy, dot, silu};

/// Causal depthwise convolution of `x` `[n][channels]` with `taps`
/// `[channels][kernel]` (the last tap on the current input), then SiLU, into
/// `out` `[n][channels]`. `window` `[kernel - 1][channels]` holds the inputs
/// before `x`, oldest first, and is left holding the last `kernel - 1` inputs.
pub fn conv_silu(x: &[f32], taps: &[f32], kernel: usize, window: &mut [f32], out: &mut [f32]) {
    let channels = taps.len() / kernel;
    let n = x.len() / channels;
    let held = kernel - 1;
    // The window and the new inputs, one matrix `[held + n][channels]`.
    let mut ext = Vec::with_capacity((held + n) * channels);
    ext.extend_from_slice(window);
    ext.extend_from_slice(x);
    for t in 0..n {
        let o = &mut out[t * channels..(t + 1) * channels];
        for (c, o) in o.iter_mut().enumerate() {
            let w = &taps[c * kernel..(c + 1) * kernel];
            let mut acc = 0f32;
            for (tau, &wt) in w.iter().enumerate() {
                acc += wt * ext[(t + tau) * channels + c];
            }
            *o = silu(acc);
        }
    }
    window.copy_from_slice(&ext[n * channels..]);
}

/// One value head's inputs at `n` consecutive positions.
pub struct HeadInputs<'a> {
    /// `[n][d_k]`: queries, L2-normalised and scaled by `1/sqrt(d_k)`.
    pub q: &'a [f32],
    /// `[n][d_k]`: keys, L2-normalised.
    pub k: &'a [f32],
    /// `[n][d_v]`.
    pub v: &'a [f32],
    /// `[n]`: the log of each position's decay (`<= 0`).
    pub g: &'a [f32],
    /// `[n]`: each position's write strength, in (0, 1).
    pub beta: &'a [f32],
}

/// The recurrence, one position at a time, on `state` `S` `[d_k][d_v]`:
/// `S <- e^g S`; `S <- S + k (beta (v - Sᵀk))ᵀ`; `o = Sᵀq`, into `out` `[n][d_v]`.
pub fn delta_rule_recurrent(h: &HeadInputs, d_k: usize, d_v: usize, state: &mut [f32], out: &mut [f32]) {
    let n = h.g.len();
    let mut kv = vec![0f32; d_v];
    let mut sq = vec![0f32; d_v];
    for t in 0..n {
        let (q, k, v) = (&h.q[t * d_k..(t + 1) * d_k], &h.k[t * d_k..(t + 1) * d_k], &h.v[t * d_v..(t + 1) * d_v]);
        let decay = h.g[t].exp();
        kv.fill(0.0);
        sq.fill(0.0);
        // A read-only pass: Sᵀk and Sᵀq of the old S (the decay is applied to the sums).
        for i in 0..d_k {
            let row = &state[i * d_v..(i + 1) * d_v];
            axpy(&mut kv, k[i], row);
            axpy(&mut sq, q[i], row);
        }
        // delta = beta (v - e^g Sᵀk); Sᵀq of the new S is e^g Sᵀq + delta (k·q).
        let kq = dot(k, q);
        let o = &mut out[t * d_v..(t + 1) * d_v];
        for j in 0..d_v {
            kv[j] = h.beta[t] * (v[j] - decay * kv[j]);
            o[j] = decay * sq[j] + kv[j] * kq;
        }
        // One read-write pass: S <- e^g S + k deltaᵀ.
        for i in 0..d_k {
            let row = &mut state[i * d_v..(i + 1) * d_v];
            row.iter_mut().zip(&kv).for_each(|(s, &d)| *s = decay * *s + k[i] * d);
        }
    }
}

/// Positions per chunk of [`delta_rule_chunked`].
pub const CHUNK: usize = 64;

/// The same recurrence computed a chunk of [`CHUNK`] positions at a time: per
/// chunk with cumulative log-decay `G`, `A[t][s] = beta_t (k_t·k_s) e^(G_t - G_s)`
/// below the diagonal, `U = (I + A)⁻¹ diag(beta) V`, `W = (I + A)⁻¹ diag(beta e^G) K`;
/// then from the incoming `S`: `V' = U - W S`,
/// `O = diag(e^G) Q S + ((Q Kᵀ) ⊙ Γ) V'` (`Γ[t][s] = e^(G_t - G_s)`, s <= t), and
/// `S <- e^(G_last) S + Σ_t e^(G_last - G_t) k_t v'_tᵀ`.
pub fn delta_rule_chunked(h: &HeadInputs, d_k: usize, d_v: usize, state: &mut [f32], out: &mut [f32]) {
    let n = h.g.len();
    let mut cum = vec![0f32; CHUNK];
    let mut a = vec![0f32; CHUNK * CHUNK];
    let mut u = vec![0f32; CHUNK * d_v];
    let mut w = vec![0f32; CHUNK * d_k];
    for c0 in (0..n).step_by(CHUNK) {
        let c = CHUNK.min(n - c0);
        let q = &h.q[c0 * d_k..(c0 + c) * d_k];
        let k = &h.k[c0 * d_k..(c0 + c) * d_k];
        let v = &h.v[c0 * d_v..(c0 + c) * d_v];
        let (g, beta) = (&h.g[c0..c0 + c], &h.beta[c0..c0 + c]);
        let mut acc = 0f32;
        for t in 0..c {
            acc += g[t];
            cum[t] = acc;
        }
        let kt = |t: usize| &k[t * d_k..(t + 1) * d_k];
        for t in 0..c {
            for s in 0..t {
                a[t * CHUNK + s] = beta[t] * dot(kt(t), kt(s)) * (cum[t] - cum[s]).exp();
            }
        }
        // Forward substitution: (I + A) U = diag(beta) V, (I + A) W = diag(beta e^G) K.
        for t in 0..c {
            let (done, rest) = u.split_at_mut(t * d_v);
            let ut = &mut rest[..d_v];
            ut.iter_mut().zip(&v[t * d_v..(t + 1) * d_v]).for_each(|(o, &x)| *o = beta[t] * x);
            for s in 0..t {
                axpy(ut, -a[t * CHUNK + s], &done[s * d_v..(s + 1) * d_v]);
            }
            let (done, rest) = w.split_at_mut(t * d_k);
            let wt = &mut rest[..d_k];
            let scale = beta[t] * cum[t].exp();
            wt.iter_mut().zip(kt(t)).for_each(|(o, &x)| *o = scale * x);
            for s in 0..t {
                axpy(wt, -a[t * CHUNK + s], &done[s * d_k..(s + 1) * d_k]);
            }
        }
        // V' = U - W S (in u), and the inter-chunk part of O: e^G_t q_t S.
        let o = &mut out[c0 * d_v..(c0 + c) * d_v];
        for t in 0..c {
            let (ut, ot) = (&mut u[t * d_v..(t + 1) * d_v], &mut o[t * d_v..(t + 1) * d_v]);
            ot.fill(0.0);
            let decay = cum[t].exp();
            for i in 0..d_k {
                let row = &state[i * d_v..(i + 1) * d_v];
                axpy(ut, -w[t * d_k + i], row);
                axpy(ot, decay * q[t * d_k + i], row);
            }
        }
        // The intra-chunk part: Σ_{s<=t} (q_t·k_s) e^(G_t - G_s) v'_s.
        for t in 0..c {
            let qt = &q[t * d_k..(t + 1) * d_k];
            let ot = &mut o[t * d_v..(t + 1) * d_v];
            for s in 0..=t {
                axpy(ot, dot(qt, kt(s)) * (cum[t] - cum[s]).exp(), &u[s * d_v..(s + 1) * d_v]);
            }
        }
        // The state carried to the next chunk.
        let last = cum[c - 1];
        let decay = last.exp();
        state.iter_mut().for_each(|s| *s *= decay);
        for t in 0..c {
            let f = (last - cum[t]).exp();
            let ut = &u[t * d_v..(t + 1) * d_v];
            for i in 0..d_k {
                axpy(&mut state[i * d_v..(i + 1) * d_v], f * k[t * d_k + i], ut);
            }
        }
    }
}

/// `x / sqrt(Σx² + eps)`, in place (the q/k normalisation of the delta rule).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = (1.0 / (sum + eps as f64).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `ln(1 + e^x)`, or `x` above 20 (as torch and ggml).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// q, k, v, g and beta of `n` positions.
    type Inputs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

    fn inputs(n: usize, d_k: usize, d_v: usize, seed: u32) -> Inputs {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let mut q: Vec<f32> = (0..n * d_k).map(|_| next()).collect();
        let mut k: Vec<f32> = (0..n * d_k).map(|_| next()).collect();
        for t in 0..n {
            l2_normalize(&mut q[t * d_k..(t + 1) * d_k], 1e-6);
            l2_normalize(&mut k[t * d_k..(t + 1) * d_k], 1e-6);
        }
        q.iter_mut().for_each(|v| *v /= (d_k as f32).sqrt());
        let v = (0..n * d_v).map(|_| 2.0 * next()).collect();
        let g = (0..n).map(|_| -softplus(2.0 * next()) * 0.5).collect();
        let beta = (0..n).map(|_| 0.5 + next()).collect();
        (q, k, v, g, beta)
    }

    /// A plain transcription of the recurrence in f64, for both forms to meet.
    fn reference(h: &HeadInputs, d_k: usize, d_v: usize, state: &mut [f64]) -> Vec<f64> {
        let n = h.g.len();
        let mut out = vec![0f64; n * d_v];
        for t in 0..n {
            for s in state.iter_mut() {
                *s *= (h.g[t] as f64).exp();
            }
            for j in 0..d_v {
                let kv: f64 = (0..d_k).map(|i| state[i * d_v + j] * h.k[t * d_k + i] as f64).sum();
                let delta = h.beta[t] as f64 * (h.v[t * d_v + j] as f64 - kv);
                for i in 0..d_k {
                    state[i * d_v + j] += h.k[t * d_k + i] as f64 * delta;
                }
            }
            for j in 0..d_v {
                out[t * d_v + j] = (0..d_k).map(|i| state[i * d_v + j] * h.q[t * d_k + i] as f64).sum();
            }
        }
        out
    }

    #[test]
    fn recurrent_and_chunked_forms_agree_with_the_definition() {
        for (n, d_k, d_v) in [(1, 8, 8), (63, 16, 8), (64, 16, 16), (150, 32, 16), (200, 16, 32)] {
            let (q, k, v, g, beta) = inputs(n, d_k, d_v, n as u32);
            let h = HeadInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            // A state from earlier positions.
            let start: Vec<f32> = (0..d_k * d_v).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.05).collect();
            let mut want_state: Vec<f64> = start.iter().map(|&s| s as f64).collect();
            let want = reference(&h, d_k, d_v, &mut want_state);
            let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
            for chunked in [false, true] {
                let mut state = start.clone();
                let mut out = vec![0f32; n * d_v];
                if chunked {
                    delta_rule_chunked(&h, d_k, d_v, &mut state, &mut out);
                } else {
                    delta_rule_recurrent(&h, d_k, d_v, &mut state, &mut out);
                }
                let err = out.iter().zip(&want).fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
                assert!(err <= 1e-5 * scale, "n {n} chunked {chunked}: output error {err:e} of {scale:e}");
                let serr = state.iter().zip(&want_state).fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
                assert!(serr <= 1e-5, "n {n} chunked {chunked}: state error {serr:e}");
            }
        }
    }

    #[test]
    fn convolution_carries_its_window() {
        let (channels, kernel) = (3, 4);
        let taps: Vec<f32> = (0..channels * kernel).map(|i| 0.1 * i as f32 - 0.4).collect();
        let x: Vec<f32> = (0..5 * channels).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut whole = vec![0f32; x.len()];
        let mut window = vec![0f32; (kernel - 1) * channels];
        conv_silu(&x, &taps, kernel, &mut window, &mut whole);
        // The same inputs one at a time, the window carried between calls.
        let mut window2 = vec![0f32; (kernel - 1) * channels];
        for t in 0..5 {
            let mut o = vec![0f32; channels];
            conv_silu(&x[t * channels..(t + 1) * channels], &taps, kernel, &mut window2, &mut o);
            assert_eq!(o, whole[t * channels..(t + 1) * channels]);
        }
        assert_eq!(window, window2);
        // Position 4, channel 1 by the definition: taps on inputs 1..=4.
        let want: f32 = (0..kernel).map(|tau| taps[kernel + tau] * x[(1 + tau) * channels + 1]).sum();
        assert!((whole[4 * channels + 1] - silu(want)).abs() < 1e-6);
    }
}
