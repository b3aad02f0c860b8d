//! Element-wise and row-wise f32 operations of the forward pass: norms,
//! activations, softmax, rotary embeddings and attention over a KV cache.
//! Plain loops the compiler vectorises; every fast path elsewhere is tested
//! against these.

/// `out = x / rms(x) * w` for one row; `w = None` scales by 1.
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let scale = (1.0 / (mean_sq + eps as f64).sqrt()) as f32;
    match w {
        Some(w) => out.iter_mut().zip(x).zip(w).for_each(|((o, &v), &g)| *o = v * scale * g),
        None => out.iter_mut().zip(x).for_each(|(o, &v)| *o = v * scale),
    }
}

/// In-place [`rms_norm`] of each `dim`-wide piece of `x` (per-head q/k norms).
pub fn rms_norm_pieces(x: &mut [f32], dim: usize, w: Option<&[f32]>, eps: f32) {
    let mut tmp = vec![0f32; dim];
    for piece in x.chunks_exact_mut(dim) {
        rms_norm(piece, w, eps, &mut tmp);
        piece.copy_from_slice(&tmp);
    }
}

pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, &b)| *a += b);
}

/// `x[r] += bias` for every `bias.len()`-wide row of `x`.
pub fn add_bias_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_inplace(row, bias);
    }
}

pub fn scale_inplace(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// The gated activation applied to `gate` and `up`, written into `gate`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GatedActivation {
    /// `silu(gate) * up`
    SwiGlu,
    /// `gelu_tanh(gate) * up`
    GeGlu,
    /// gpt-oss: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
    /// `g * sigmoid(alpha * g) * (u + 1)`.
    SwiGluClamped { alpha: f32, limit: f32 },
}

pub fn gated_activation(act: GatedActivation, gate: &mut [f32], up: &[f32]) {
    match act {
        GatedActivation::SwiGlu => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = silu(*g) * u),
        GatedActivation::GeGlu => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = gelu_tanh(*g) * u),
        GatedActivation::SwiGluClamped { alpha, limit } => gate.iter_mut().zip(up).for_each(|(g, &u)| {
            let x = g.min(limit);
            let u = u.clamp(-limit, limit);
            *g = x * sigmoid(alpha * x) * (u + 1.0);
        }),
    }
}

/// Softmax in place, max-subtracted, accumulated in f64 for stability.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// How rotary dimensions are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs (2i, 2i+1): llama.cpp's `NORM`, Llama.
    Interleaved,
    /// Halves (i, i + n_rot/2): llama.cpp's `NEOX`, most other families.
    Halves,
}

/// Rotary embedding tables: a frequency per pair (YaRN/linear scaling folded
/// in) and the magnitude scale applied to cos and sin.
#[derive(Clone, Debug)]
pub struct Rope {
    pub layout: RopeLayout,
    /// Rotated dimensions per head (the first `n_rot` of `head_dim`).
    pub n_rot: usize,
    /// Angle per position for pair i: `theta = pos * inv_freq[i]`.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub mscale: f32,
}

impl Rope {
    /// Rotates every `head_dim`-wide head of `x` (one token) at position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: u32) {
        let half = self.n_rot / 2;
        let mut cos_sin = Vec::with_capacity(half);
        for &f in &self.inv_freq {
            let theta = pos as f32 * f;
            cos_sin.push((theta.cos() * self.mscale, theta.sin() * self.mscale));
        }
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(c, s)) in cos_sin.iter().enumerate() {
                let (a, b) = match self.layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::Halves => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// One query head's attention over `n` cached positions.
///
/// `keys` and `values` yield the cached k and v vectors of this head's kv head
/// in position order; `scores` is scratch of length `n`. `sink` is an extra
/// logit that joins the softmax denominator only (gpt-oss). `softcap` caps
/// scores as `c * tanh(s / c)`.
pub struct AttentionParams {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub sink: Option<f32>,
}

pub fn attend<'a>(
    q: &[f32],
    keys: impl Iterator<Item = &'a [f32]>,
    values: impl Iterator<Item = &'a [f32]>,
    p: &AttentionParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    scores.clear();
    for k in keys {
        let mut s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * p.scale;
        if let Some(c) = p.softcap {
            s = c * (s / c).tanh();
        }
        scores.push(s);
    }
    let mut max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if let Some(sink) = p.sink {
        max = max.max(sink);
    }
    let mut denom = p.sink.map_or(0.0, |s| ((s - max) as f64).exp());
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        denom += *s as f64;
    }
    let inv = (1.0 / denom) as f32;
    out.iter_mut().for_each(|o| *o = 0.0);
    for (w, v) in scores.iter().zip(values) {
        let w = w * inv;
        out.iter_mut().zip(v).for_each(|(o, &x)| *o += w * x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, -4.0];
        let w = [0.5f32, 1.0, 2.0, 1.5];
        let mut out = [0f32; 4];
        rms_norm(&x, Some(&w), 1e-6, &mut out);
        let rms = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0f64 + 1e-6).sqrt();
        for i in 0..4 {
            assert!((out[i] as f64 - x[i] as f64 / rms * w[i] as f64).abs() < 1e-6);
        }
    }

    #[test]
    fn softmax_sums_to_one_and_handles_all_masked() {
        let mut x = [1.0f32, 2.0, 3.0];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
        let mut m = [f32::NEG_INFINITY; 2];
        softmax_inplace(&mut m);
        assert!(m.iter().all(|v| *v == f32::NEG_INFINITY));
    }

    #[test]
    fn rope_layouts_rotate_the_right_pairs() {
        let rope = |layout| Rope { layout, n_rot: 4, inv_freq: vec![1.0, 0.5], mscale: 1.0 };
        let mut x = [1.0f32, 0.0, 0.0, 0.0, 7.0];
        rope(RopeLayout::Interleaved).apply(&mut x[..4], 4, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        let mut y = [1.0f32, 0.0, 0.0, 0.0];
        rope(RopeLayout::Halves).apply(&mut y, 4, 1);
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[2] - 1f32.sin()).abs() < 1e-6);
        // Partial rotary: dimensions past n_rot are untouched.
        let mut z = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope(RopeLayout::Halves).apply(&mut z, 6, 3);
        assert_eq!(&z[4..], &[5.0, 6.0]);
    }

    #[test]
    fn sink_only_lowers_the_weights() {
        let q = [1.0f32, 0.0];
        let ks: [&[f32]; 2] = [&[1.0, 0.0], &[0.0, 1.0]];
        let vs: [&[f32]; 2] = [&[1.0, 0.0], &[0.0, 1.0]];
        let mut scores = Vec::new();
        let mut plain = [0f32; 2];
        let p = AttentionParams { scale: 1.0, softcap: None, sink: None };
        attend(&q, ks.iter().copied(), vs.iter().copied(), &p, &mut scores, &mut plain);
        let e = std::f32::consts::E;
        assert!((plain[0] - e / (e + 1.0)).abs() < 1e-6);
        let mut sunk = [0f32; 2];
        let p = AttentionParams { scale: 1.0, softcap: None, sink: Some(0.0) };
        attend(&q, ks.iter().copied(), vs.iter().copied(), &p, &mut scores, &mut sunk);
        assert!((sunk[0] - e / (e + 2.0)).abs() < 1e-6);
    }
}
