//! Element-wise and row-wise f32 operations of the forward pass: norms,
//! activations, softmax, rotary embeddings and attention over a KV cache.
//! Plain loops the compiler vectorises; every fast path elsewhere is tested
//! against these.

/// `out = x / rms(x) * w` for one row; `w = None` scales by 1.
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let mean_sq = sum_of_squares(x) / x.len() as f64;
    let scale = (1.0 / (mean_sq + eps as f64).sqrt()) as f32;
    match w {
        Some(w) => out.iter_mut().zip(x).zip(w).for_each(|((o, &v), &g)| *o = v * scale * g),
        None => out.iter_mut().zip(x).for_each(|(o, &v)| *o = v * scale),
    }
}

/// `Σ x²` in f64, in 8 lanes that loops vectorise (term by term, a chain of dependent f64
/// adds: 2.6% of a SmolLM2 prompt).
fn sum_of_squares(x: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for j in 0..8 {
            lanes[j] += c[j] as f64 * c[j] as f64;
        }
    }
    it.remainder().iter().map(|&v| v as f64 * v as f64).sum::<f64>() + lanes.iter().sum::<f64>()
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

/// `e^x` for f32 in a form loops vectorise: `x = n ln2 + r` with `|r| <= ln2 / 2`, then a
/// degree-7 Taylor polynomial for `e^r` (truncation below 6e-9 relative) scaled by `2^n`
/// built in the exponent bits. Inputs are clamped to [-87.3, 88] (so 2^n stays a normal
/// float); NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting rounds to an integer
    let x = x.clamp(-87.3, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // n as an integer from t's bits (t lies in [2^23, 2^24), where the bits count in ones):
    // `n as i32`, a saturating cast, kept loops from vectorising (a compare and two moves a
    // lane; `gated` took 5.8% of a SmolLM2 prompt).
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    p * f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`), with `tanh(u) = 1 - 2 / (e^{2u} + 1)`.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    let tanh = 1.0 - 2.0 / (exp(2.0 * u) + 1.0);
    0.5 * x * (1.0 + tanh)
}

/// `gate = silu(gate) * up` (SwiGLU), in parallel on the current rayon pool.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    par_gated(gate, up, Glu::Silu)
}

/// `gate = gelu_tanh(gate) * up` (GeGLU).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    par_gated(gate, up, Glu::GeluTanh)
}

/// gpt-oss's clamped SwiGLU: `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`,
/// `gate = g * sigmoid(alpha * g) * (u + 1)`.
pub fn swiglu_clamped(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    par_gated(gate, up, Glu::SiluClamped { alpha, limit })
}

/// Which of the kernels above runs (private: the model's config names activations).
#[derive(Clone, Copy)]
enum Glu {
    Silu,
    GeluTanh,
    SiluClamped { alpha: f32, limit: f32 },
}

fn par_gated(gate: &mut [f32], up: &[f32], glu: Glu) {
    use rayon::prelude::*;
    const CHUNK: usize = 4096;
    gate.par_chunks_mut(CHUNK).zip(up.par_chunks(CHUNK)).for_each(|(g, u)| {
        #[cfg(target_arch = "x86_64")]
        if crate::Isa::detect() != crate::Isa::Scalar {
            // SAFETY: AVX2 and FMA are available.
            return unsafe { x86::gated(glu, g, u) };
        }
        gated_plain(glu, g, u)
    });
}

#[inline(always)]
fn gated_plain(glu: Glu, gate: &mut [f32], up: &[f32]) {
    match glu {
        Glu::Silu => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = silu(*g) * u),
        Glu::GeluTanh => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = gelu_tanh(*g) * u),
        Glu::SiluClamped { alpha, limit } => gate.iter_mut().zip(up).for_each(|(g, &u)| {
            let x = g.min(limit);
            let u = u.clamp(-limit, limit);
            *g = x * sigmoid(alpha * x) * (u + 1.0);
        }),
    }
}

/// `x[i] = e^(x[i] - max)` in place; returns the sum (f64).
pub fn exp_shifted(x: &mut [f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detect() != crate::Isa::Scalar {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { x86::exp_shifted(x, max) };
    }
    exp_shifted_plain(x, max)
}

#[inline(always)]
fn exp_shifted_plain(x: &mut [f32], max: f32) -> f64 {
    x.iter_mut().for_each(|v| *v = exp(*v - max));
    x.iter().map(|&v| v as f64).sum()
}

/// The largest element of `x` (-inf for an empty slice; NaNs are passed over), in lanes of 8
/// that loops vectorise, where `fold(f32::max)` is a chain of dependent compares.
pub fn max_of(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for j in 0..8 {
            lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
        }
    }
    it.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

/// The first index of the largest element of `x` and that element; `(0, -inf)` for an empty
/// slice or one of NaNs only (a NaN is never the largest). A pass for the largest in lanes of 8,
/// then one for where it first is, 64 elements compared at once before any is looked at one
/// by one: a vocabulary of 151,936 logits in 10-26 µs wherever the largest is (element by
/// element, the second pass took 1.5 ns an element up to the largest: 120 µs on average).
pub fn argmax(x: &[f32]) -> (usize, f32) {
    let max = max_of(x);
    let first = |c: &[f32]| c.iter().position(|&v| v == max);
    let mut runs = x.chunks_exact(64);
    let mut start = 0;
    for run in &mut runs {
        if run.iter().fold(false, |hit, &v| hit | (v == max))
            && let Some(i) = first(run)
        {
            return (start + i, max);
        }
        start += run.len();
    }
    (first(runs.remainder()).map_or(0, |i| start + i), max)
}

/// `Σ e^(x[i] - max)`, the terms with [`exp`] summed in lanes of 8 over runs of 1,024, the runs
/// in f64: a softmax's denominator without writing `x` (a vocabulary of logits in about 0.1 ms,
/// against 1.4 ms for f64 `exp` term by term).
pub fn sum_exp_shifted(x: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detect() != crate::Isa::Scalar {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { x86::sum_exp_shifted(x, max) };
    }
    sum_exp_shifted_plain(x, max)
}

#[inline(always)]
fn sum_exp_shifted_plain(x: &[f32], max: f32) -> f64 {
    let mut total = 0f64;
    for run in x.chunks(1024) {
        let mut lanes = [0f32; 8];
        let mut it = run.chunks_exact(8);
        for c in &mut it {
            for j in 0..8 {
                lanes[j] += exp(c[j] - max);
            }
        }
        let tail: f32 = it.remainder().iter().map(|&v| exp(v - max)).sum();
        total += lanes.iter().map(|&v| v as f64).sum::<f64>() + tail as f64;
    }
    total
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

/// Rotary embedding tables: a frequency per pair (YaRN/linear scaling folded
/// in) and the magnitude scale applied to cos and sin.
#[derive(Clone, Debug)]
pub struct Rope {
    /// Pairs are adjacent dimensions (2i, 2i+1), llama.cpp's `NORM`; else halves
    /// (i, i + n_rot/2), its `NEOX`.
    pub interleaved: bool,
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
                let (a, b) = if self.interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// An element of a key or value cache: f32, or IEEE half (half the bytes a position reads;
/// llama.cpp's and ik_llama.cpp's default cache type).
pub trait KvElement: Copy + Send + Sync + 'static {
    /// Whether the element is an f16 (else an f32).
    const HALF: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// The slice itself where its elements are f32.
    fn as_f32s(s: &[Self]) -> Option<&[f32]>;
}

impl KvElement for f32 {
    const HALF: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn as_f32s(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}

impl KvElement for half::f16 {
    const HALF: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> half::f16 {
        half::f16::from_f32(x)
    }
    fn as_f32s(_: &[half::f16]) -> Option<&[f32]> {
        None
    }
}

/// `Σ a[i] b[i]` for a row `b` of a cache.
fn dot_kv<K: KvElement>(a: &[f32], b: &[K]) -> f32 {
    match K::as_f32s(b) {
        Some(b) => dot(a, b),
        None => a.iter().zip(b).map(|(x, y)| x * y.to_f32()).sum(),
    }
}

/// `y += a x` for a row `x` of a cache.
fn axpy_kv<V: KvElement>(y: &mut [f32], a: f32, x: &[V]) {
    match V::as_f32s(x) {
        Some(x) => axpy(y, a, x),
        None => y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x.to_f32()),
    }
}

/// `Σ a[i] b[i]`, vectorised where the CPU allows (8 partial sums, so the
/// result may differ from a sequential sum in the last bits).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detect() != crate::Isa::Scalar {
        // SAFETY: AVX2 and FMA are available (checked by `Isa::detect`).
        return unsafe { x86::dot(a, b) };
    }
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a * x`.
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detect() != crate::Isa::Scalar {
        // SAFETY: AVX2 and FMA are available.
        return unsafe { x86::axpy(y, a, x) };
    }
    y.iter_mut().zip(x).for_each(|(y, &x)| *y += a * x);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::KvElement;
    use std::arch::x86_64::*;

    /// Eight elements of a cache row at `p` as floats.
    ///
    /// # Safety
    /// Needs AVX and, for f16, F16C; eight elements readable at `p`.
    #[inline(always)]
    unsafe fn load8<T: KvElement>(p: *const T) -> __m256 {
        unsafe { if T::HALF { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) } else { _mm256_loadu_ps(p.cast()) } }
    }

    /// The plain loop compiled for AVX2, which it vectorises.
    ///
    /// # Safety
    /// Needs AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gated(glu: super::Glu, gate: &mut [f32], up: &[f32]) {
        super::gated_plain(glu, gate, up)
    }

    /// # Safety
    /// Needs AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_shifted(x: &mut [f32], max: f32) -> f64 {
        let whole = x.len() / 8 * 8;
        let m = _mm256_set1_ps(max);
        let at = x.as_mut_ptr();
        // SAFETY: every i < whole starts 8 floats of `x`.
        let mut total = unsafe {
            lane_sums(whole, |i| {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(at.add(i)), m));
                _mm256_storeu_ps(at.add(i), e);
                e
            })
        };
        for v in &mut x[whole..] {
            *v = super::exp(*v - max);
            total += *v as f64;
        }
        total
    }

    /// `Σ term(i)` for i = 0, 8, .. below `whole` (each term 8 lanes), summed in lanes over runs
    /// of 1,024 elements and the runs in f64: a sum of many terms without a chain of dependent
    /// f64 adds (term by term, that took most of a long prompt's softmax time).
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn lane_sums(whole: usize, mut term: impl FnMut(usize) -> __m256) -> f64 {
        let mut total = 0f64;
        for run in (0..whole).step_by(1024) {
            let mut lanes = [0f32; 8];
            // SAFETY: AVX2 is available (the caller's promise); `lanes` holds 8 floats.
            unsafe {
                let mut acc = _mm256_setzero_ps();
                for i in (run..(run + 1024).min(whole)).step_by(8) {
                    acc = _mm256_add_ps(acc, term(i));
                }
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
            }
            total += lanes.iter().map(|&v| v as f64).sum::<f64>();
        }
        total
    }

    /// [`super::exp`] on 8 lanes (the same steps, the polynomial with fused multiply-adds).
    ///
    /// # Safety
    /// Needs AVX2 and FMA.
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        unsafe {
            let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.0));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                x,
                _mm256_set1_ps(std::f32::consts::LOG2_E),
            ));
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
            let mut p = _mm256_set1_ps(1.0 / 5040.0);
            for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
            _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
        }
    }

    /// # Safety
    /// Needs AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sum_exp_shifted(x: &[f32], max: f32) -> f64 {
        let whole = x.len() / 8 * 8;
        let m = _mm256_set1_ps(max);
        // SAFETY: every i < whole starts 8 floats of `x`.
        let total = unsafe { lane_sums(whole, |i| exp8(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), m))) };
        total + x[whole..].iter().map(|&v| super::exp(v - max) as f64).sum::<f64>()
    }

    /// # Safety
    /// Needs AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        unsafe { dot_inline(a, b) }
    }

    /// [`dot`]'s body, compiled into (and with the features of) its caller; `b` a row of a
    /// cache of any element type.
    ///
    /// # Safety
    /// Needs AVX2 and FMA, and F16C for f16.
    #[inline(always)]
    unsafe fn dot_inline<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
        let n = a.len().min(b.len());
        let mut i = 0;
        // SAFETY: every load reads 8 elements below `n`.
        unsafe {
            let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            while i + 16 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), load8(b.as_ptr().add(i)), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i + 8)), load8(b.as_ptr().add(i + 8)), s1);
                i += 16;
            }
            if i + 8 <= n {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), load8(b.as_ptr().add(i)), s0);
                i += 8;
            }
            let s = _mm256_add_ps(s0, s1);
            let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_add_ss(h, _mm_movehdup_ps(h));
            let mut total = _mm_cvtss_f32(h);
            while i < n {
                total += a[i] * b[i].to_f32();
                i += 1;
            }
            total
        }
    }

    /// [`super::attend`] for heads of whole vectors of 8: scores four keys at a time (the
    /// query's vector loaded once for the four, their four sums reduced together) and values
    /// four positions at a time (the output's vector loaded and stored once for the four), not a
    /// call with its own reduction for every position. A SmolLM2 prompt spent 23% of its time
    /// in attention a position at a time (docs/BENCHMARKS.md, fourteenth session).
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `q.len()` and `out.len()` are multiples of 8, and every key
    /// is as long as `q`, every value as `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend<'a, K: KvElement, V: KvElement>(
        q: &[f32],
        keys: impl Iterator<Item = &'a [K]>,
        values: impl Iterator<Item = &'a [V]>,
        p: &super::AttentionParams,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) -> f32 {
        let (hd, hdv) = (q.len(), out.len());
        scores.clear();
        let mut four: [&[K]; 4] = [&[]; 4];
        let mut held = 0;
        let mut ahead = Ahead::new();
        for k in keys {
            assert_eq!(k.len(), hd, "a key as long as the query");
            ahead.next(k);
            four[held] = k;
            held += 1;
            if held == 4 {
                // SAFETY: the four keys hold hd floats, a multiple of 8.
                let sums = unsafe { dot4(q, &four) };
                scores.extend(sums.iter().map(|&d| super::capped(d, p)));
                held = 0;
            }
        }
        for k in &four[..held] {
            scores.push(super::capped(unsafe { dot_inline(q, k) }, p));
        }
        let (inv, lse) = super::softmax_weights(scores, p);
        out.iter_mut().for_each(|o| *o = 0.0);
        let mut weights = scores.iter();
        let mut four: [&[V]; 4] = [&[]; 4];
        held = 0;
        let mut w4 = [0f32; 4];
        let mut ahead = Ahead::new();
        for v in values {
            let Some(&w) = weights.next() else { break };
            assert_eq!(v.len(), hdv, "a value as long as the output");
            ahead.next(v);
            four[held] = v;
            w4[held] = w * inv;
            held += 1;
            if held == 4 {
                // SAFETY: the four values hold hdv floats, a multiple of 8.
                unsafe { axpy4(out, &w4, &four) };
                held = 0;
            }
        }
        for (v, &w) in four[..held].iter().zip(&w4) {
            unsafe { axpy_inline(out, w, v) };
        }
        lse
    }

    /// [`super::attend_group`] for heads of whole vectors of 8: each key and value is read once
    /// for every query head of its group (a KV head's keys at depth overflow L2, so a head at a
    /// time read them from memory once a head); scores take four keys at a time (each query's
    /// vector loaded once for the four, their sums reduced together) and values four positions
    /// at a time (each output vector loaded and stored once for the four). A SmolLM2 prompt
    /// spent 23% of its time in attention a position at a time (docs/BENCHMARKS.md).
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `q` holds `heads.len()` heads and `out` as many outputs,
    /// each a multiple of 8 floats; every key is one head of `q` long, every value one head of
    /// `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_group<'a, K: KvElement, V: KvElement>(
        q: &[f32],
        keys: impl Iterator<Item = &'a [K]>,
        values: impl Iterator<Item = &'a [V]>,
        heads: &[super::AttentionParams],
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) -> [f32; super::MAX_GROUP] {
        let g_n = heads.len();
        let (hd, hdv) = (q.len() / g_n, out.len() / g_n);
        // Scores position by position (all heads of a position together), then turned head by
        // head into `weights` for each head's softmax.
        scores.clear();
        scores.reserve(2 * g_n * keys.size_hint().0);
        let mut four: [&[K]; 4] = [&[]; 4];
        let mut held = 0;
        let take = |four: &[&[K]], scores: &mut Vec<f32>| {
            let at = scores.len();
            scores.resize(at + four.len() * g_n, 0.0);
            for g in 0..g_n {
                let qg = &q[g * hd..(g + 1) * hd];
                let sums = if four.len() == 4 {
                    // SAFETY: four keys of hd floats, a multiple of 8.
                    unsafe { dot4(qg, &[four[0], four[1], four[2], four[3]]) }
                } else {
                    let mut one = [0f32; 4];
                    for (j, k) in four.iter().enumerate() {
                        one[j] = unsafe { dot_inline(qg, k) };
                    }
                    one
                };
                for j in 0..four.len() {
                    scores[at + j * g_n + g] = super::capped(sums[j], &heads[g]);
                }
            }
        };
        let mut ahead = Ahead::new();
        for k in keys {
            assert_eq!(k.len(), hd, "a key as long as a query head");
            ahead.next(k);
            four[held] = k;
            held += 1;
            if held == 4 {
                take(&four, scores);
                held = 0;
            }
        }
        take(&four[..held], scores);
        let n = scores.len() / g_n;
        let (first, inv, lse) = super::head_weights(scores, heads);
        let weights = &scores[first..];
        out.iter_mut().for_each(|o| *o = 0.0);
        let mut four: [&[V]; 4] = [&[]; 4];
        held = 0;
        let mut at = 0;
        let mut ahead = Ahead::new();
        for v in values.take(n) {
            assert_eq!(v.len(), hdv, "a value as long as an output head");
            ahead.next(v);
            four[held] = v;
            held += 1;
            if held == 4 {
                for g in 0..g_n {
                    let w = &weights[g * n + at..g * n + at + 4];
                    let w4 = [w[0] * inv[g], w[1] * inv[g], w[2] * inv[g], w[3] * inv[g]];
                    // SAFETY: four values of hdv floats, a multiple of 8.
                    unsafe { axpy4(&mut out[g * hdv..(g + 1) * hdv], &w4, &four) };
                }
                at += 4;
                held = 0;
            }
        }
        for (j, v) in four[..held].iter().enumerate() {
            for g in 0..g_n {
                unsafe { axpy_inline(&mut out[g * hdv..(g + 1) * hdv], weights[g * n + at + j] * inv[g], v) };
            }
        }
        lse
    }

    /// Rows of the cache this many positions ahead are asked for while a row is read: the rows
    /// of one KV head are a cache row apart (all heads of a position together), a stride the
    /// hardware's prefetchers followed too slowly (SmolLM2 at 2,048 positions, one thread:
    /// attention read its f16 keys and values at 4.3 GB/s, docs/BENCHMARKS.md).
    const ROWS_AHEAD: isize = 12;

    /// Where consecutive rows of an iterator of cache rows lie, so that each row read asks
    /// for the one [`ROWS_AHEAD`] rows on (a hint: a row past the cache's end, or a ring's
    /// wrap, only asks for a line nobody reads).
    struct Ahead {
        last: usize,
        stride: isize,
    }

    impl Ahead {
        fn new() -> Ahead {
            Ahead { last: 0, stride: 0 }
        }

        /// Prefetches the row `ROWS_AHEAD` strides past `row` (its lines into L1).
        #[inline(always)]
        fn next<T>(&mut self, row: &[T]) {
            let at = row.as_ptr() as usize;
            if self.last != 0 {
                self.stride = at.wrapping_sub(self.last) as isize;
            }
            self.last = at;
            let ahead = (row.as_ptr() as *const u8).wrapping_offset(self.stride.wrapping_mul(ROWS_AHEAD));
            for line in (0..std::mem::size_of_val(row)).step_by(64) {
                // SAFETY: a prefetch reads nothing and faults on no address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast()) };
            }
        }
    }

    /// The dot products of `q` with four keys.
    ///
    /// # Safety
    /// Needs AVX2 and FMA (and F16C for f16); `q` and every key hold the same multiple of 8
    /// elements.
    #[inline(always)]
    unsafe fn dot4<K: KvElement>(q: &[f32], k: &[&[K]; 4]) -> [f32; 4] {
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in (0..q.len()).step_by(8) {
                let qv = _mm256_loadu_ps(q.as_ptr().add(i));
                for j in 0..4 {
                    acc[j] = _mm256_fmadd_ps(qv, load8(k[j].as_ptr().add(i)), acc[j]);
                }
            }
            // Pairwise sums of the four, then the two halves: lanes 0-3 are the four totals.
            let h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
            let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            let mut out = [0f32; 4];
            _mm_storeu_ps(out.as_mut_ptr(), sums);
            out
        }
    }

    /// `y += w[0] v[0] + ... + w[3] v[3]`.
    ///
    /// # Safety
    /// Needs AVX2 and FMA (and F16C for f16); `y` and every `v` hold the same multiple of 8
    /// elements.
    #[inline(always)]
    unsafe fn axpy4<V: KvElement>(y: &mut [f32], w: &[f32; 4], v: &[&[V]; 4]) {
        unsafe {
            let wv = w.map(|w| _mm256_set1_ps(w));
            for i in (0..y.len()).step_by(8) {
                let p = y.as_mut_ptr().add(i);
                let mut acc = _mm256_loadu_ps(p);
                for j in 0..4 {
                    acc = _mm256_fmadd_ps(wv[j], load8(v[j].as_ptr().add(i)), acc);
                }
                _mm256_storeu_ps(p, acc);
            }
        }
    }

    /// # Safety
    /// Needs AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        unsafe { axpy_inline(y, a, x) }
    }

    /// [`axpy`]'s body, compiled into (and with the features of) its caller; `x` a row of a
    /// cache of any element type.
    ///
    /// # Safety
    /// Needs AVX2 and FMA, and F16C for f16.
    #[inline(always)]
    unsafe fn axpy_inline<T: KvElement>(y: &mut [f32], a: f32, x: &[T]) {
        let n = y.len().min(x.len());
        let mut i = 0;
        // SAFETY: every load and store touches 8 elements below `n`.
        unsafe {
            let av = _mm256_set1_ps(a);
            while i + 8 <= n {
                let p = y.as_mut_ptr().add(i);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(av, load8(x.as_ptr().add(i)), _mm256_loadu_ps(p)));
                i += 8;
            }
        }
        while i < n {
            y[i] += a * x[i].to_f32();
            i += 1;
        }
    }
}

/// One query head's attention over `n` cached positions.
///
/// `keys` and `values` yield the cached k and v vectors of this head's kv head
/// in position order; `scores` is scratch of length `n`. `sink` is an extra
/// logit that joins the softmax denominator only (gpt-oss). `softcap` caps
/// scores as `c * tanh(s / c)`.
#[derive(Clone, Copy)]
pub struct AttentionParams {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub sink: Option<f32>,
}

pub fn attend<'a, K: KvElement, V: KvElement>(
    q: &[f32],
    keys: impl Iterator<Item = &'a [K]>,
    values: impl Iterator<Item = &'a [V]>,
    p: &AttentionParams,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_group(q, keys, values, std::slice::from_ref(p), scores, out);
}

/// The most query heads [`attend_group`] takes at once.
pub const MAX_GROUP: usize = 16;

/// [`attend`] for the query heads that share one KV head (`q`: `heads.len()` heads, `out` as
/// many outputs, head after head; `heads[g]` head g's scale, cap and sink), every key and value
/// read once for all of them. Each head's output is [`attend`]'s for that head alone. Keys
/// and values are rows of a cache of f32 or f16 ([`KvElement`]). Returns each head's
/// `ln Σ e^s` over its positions (and sink), which [`merge_runs`] takes.
pub fn attend_group<'a, K: KvElement, V: KvElement>(
    q: &[f32],
    keys: impl Iterator<Item = &'a [K]>,
    values: impl Iterator<Item = &'a [V]>,
    heads: &[AttentionParams],
    scores: &mut Vec<f32>,
    out: &mut [f32],
) -> [f32; MAX_GROUP] {
    let g_n = heads.len();
    assert!((1..=MAX_GROUP).contains(&g_n), "{g_n} query heads in one group");
    let (hd, hdv) = (q.len() / g_n, out.len() / g_n);
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detect() != crate::Isa::Scalar && hd.is_multiple_of(8) && hdv.is_multiple_of(8) {
        // SAFETY: AVX2 and FMA are available (checked by `Isa::detect`); the heads are whole
        // vectors of 8.
        return unsafe {
            match heads {
                [one] => {
                    let mut lse = [0.0; MAX_GROUP];
                    lse[0] = x86::attend(q, keys, values, one, scores, out);
                    lse
                }
                _ => x86::attend_group(q, keys, values, heads, scores, out),
            }
        };
    }
    scores.clear();
    for k in keys {
        scores.extend(heads.iter().enumerate().map(|(g, p)| capped(dot_kv(&q[g * hd..(g + 1) * hd], k), p)));
    }
    let n = scores.len() / g_n;
    let (first, inv, lse) = head_weights(scores, heads);
    let weights = &scores[first..];
    out.iter_mut().for_each(|o| *o = 0.0);
    for (p, v) in values.take(n).enumerate() {
        for g in 0..g_n {
            axpy_kv(&mut out[g * hdv..(g + 1) * hdv], weights[g * n + p] * inv[g], v);
        }
    }
    lse
}

/// One head's attention over its positions from [`attend_group`]'s outputs over runs of them
/// (each run without the sink): `runs[r]` is run r's output `[hdv]` and `ln Σ e^s` over its
/// positions; `sink` the head's sink logit. Writes into `out` `[hdv]` the output over all the
/// runs together, as one call over every position gives it up to rounding.
pub fn merge_runs<'a>(runs: impl Iterator<Item = (&'a [f32], f32)> + Clone, sink: Option<f32>, out: &mut [f32]) {
    let max = runs.clone().map(|(_, lse)| lse).fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
    let total: f64 = runs.clone().map(|(_, lse)| ((lse - max) as f64).exp()).sum::<f64>()
        + sink.map_or(0.0, |s| ((s - max) as f64).exp());
    out.iter_mut().for_each(|o| *o = 0.0);
    for (o_r, lse) in runs {
        let w = (((lse - max) as f64).exp() / total) as f32;
        out.iter_mut().zip(o_r).for_each(|(o, &x)| *o += w * x);
    }
}

/// A group's scores, held position by position (`scores[p * heads.len() + g]`), made into
/// each head's softmax weights, head after head (a lone head's where they are, a group's
/// after them): returns where the weights start, each head's factor that makes its
/// weights (with its sink) sum to 1, and the log of each head's sum before it.
fn head_weights(scores: &mut Vec<f32>, heads: &[AttentionParams]) -> (usize, [f32; MAX_GROUP], [f32; MAX_GROUP]) {
    let g_n = heads.len();
    let n = scores.len() / g_n;
    let first = if g_n == 1 { 0 } else { n * g_n };
    if g_n > 1 {
        scores.resize(2 * n * g_n, 0.0);
        let (by_position, weights) = scores.split_at_mut(n * g_n);
        for g in 0..g_n {
            for (p, w) in weights[g * n..(g + 1) * n].iter_mut().enumerate() {
                *w = by_position[p * g_n + g];
            }
        }
    }
    let (mut inv, mut lse) = ([0f32; MAX_GROUP], [0f32; MAX_GROUP]);
    for (g, p) in heads.iter().enumerate() {
        (inv[g], lse[g]) = softmax_weights(&mut scores[first + g * n..first + (g + 1) * n], p);
    }
    (first, inv, lse)
}

/// One query's attention weights in place: `scores`, its dot products with the positions it
/// sees, scaled and capped as [`attend`] takes them, then each `e^(s - max)` over their sum
/// (with the sink in the denominator), the weights [`attend`] gives the values.
pub fn attention_weights(scores: &mut [f32], p: &AttentionParams) {
    // The cap's test outside the loop, so that the common case is a plain scaling loop.
    match p.softcap {
        None => scale_inplace(scores, p.scale),
        Some(_) => scores.iter_mut().for_each(|s| *s = capped(*s, p)),
    }
    let (inv, _) = softmax_weights(scores, p);
    scale_inplace(scores, inv);
}

/// A score as attention takes it: scaled, then capped where the model caps.
#[inline(always)]
fn capped(dot: f32, p: &AttentionParams) -> f32 {
    let s = dot * p.scale;
    p.softcap.map_or(s, |c| c * (s / c).tanh())
}

/// Turns `scores` into `e^(s - max)` in place; returns the factor that makes them (with the
/// sink, where there is one) sum to 1, and the log of their sum before it (`max + ln(sum)`,
/// for [`merge_runs`]).
fn softmax_weights(scores: &mut [f32], p: &AttentionParams) -> (f32, f32) {
    let mut max = max_of(scores);
    if let Some(sink) = p.sink {
        max = max.max(sink);
    }
    let mut denom = p.sink.map_or(0.0, |s| ((s - max) as f64).exp());
    denom += exp_shifted(scores, max);
    ((1.0 / denom) as f32, (max as f64 + denom.ln()) as f32)
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
        let rope = |interleaved| Rope { interleaved, n_rot: 4, inv_freq: vec![1.0, 0.5], mscale: 1.0 };
        let mut x = [1.0f32, 0.0, 0.0, 0.0, 7.0];
        rope(true).apply(&mut x[..4], 4, 1);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        let mut y = [1.0f32, 0.0, 0.0, 0.0];
        rope(false).apply(&mut y, 4, 1);
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[2] - 1f32.sin()).abs() < 1e-6);
        // Partial rotary: dimensions past n_rot are untouched.
        let mut z = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope(false).apply(&mut z, 6, 3);
        assert_eq!(&z[4..], &[5.0, 6.0]);
    }

    /// Each term within 4e-6 of f64's exp and the sum within 1e-6 (relative), at lengths
    /// around the lanes of 8 and the runs of 1,024.
    #[test]
    fn exp_shifted_matches_f64() {
        for n in [1, 7, 8, 9, 1023, 1024, 1031, 3000] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2003) as f32 / 97.0 - 12.0).collect();
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut got = x.clone();
            let sum = exp_shifted(&mut got, max);
            let want: Vec<f64> = x.iter().map(|&v| (v as f64 - max as f64).exp()).collect();
            for (g, w) in got.iter().zip(&want) {
                assert!((*g as f64 - w).abs() <= 4e-6 * w, "n {n}: {g} against {w}");
            }
            let want_sum: f64 = want.iter().sum();
            assert!((sum - want_sum).abs() <= 1e-6 * want_sum, "n {n}: sum {sum} against {want_sum}");
        }
    }

    #[test]
    fn argmax_and_softmax_sum_match_plain_loops() {
        let x: Vec<f32> = (0..151_939).map(|i| ((i * 7919) % 2003) as f32 / 97.0 - 9.0).collect();
        let want_max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want_at = x.iter().position(|&v| v == want_max).unwrap();
        assert_eq!(argmax(&x), (want_at, want_max));
        let want: f64 = x.iter().map(|&v| (v as f64 - want_max as f64).exp()).sum();
        let got = sum_exp_shifted(&x, want_max);
        assert!((got - want).abs() <= 1e-6 * want, "{got} against {want}");
        // Ties go to the first; NaNs are never the largest; empty is (0, -inf).
        assert_eq!(argmax(&[1.0, 3.0, f32::NAN, 3.0]), (1, 3.0));
        assert_eq!(argmax(&[]), (0, f32::NEG_INFINITY));
        assert_eq!(argmax(&[f32::NAN; 9]), (0, f32::NEG_INFINITY));
        // The largest in each place of a run of 64, in the tail after the runs, twice.
        for at in [0, 1, 63, 64, 65, 127, 151_935, 151_938] {
            let mut y = x.clone();
            y[at] = 100.0;
            y[(at + 3) % x.len()] = f32::NAN;
            assert_eq!(argmax(&y), (at, 100.0), "largest at {at}");
            y[151_938] = 100.0;
            assert_eq!(argmax(&y), (at, 100.0), "largest at {at} and at the end");
        }
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        for i in -87_000..87_900 {
            let x = i as f32 * 1e-3 + 0.000_37;
            let want = (x as f64).exp();
            worst = worst.max(((exp(x) as f64 - want) / want).abs());
        }
        assert!(worst < 4e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-1e4) < 1e-37 && exp(1e4).is_finite());
    }

    #[test]
    fn activations_match_libm() {
        for i in -2000..2000 {
            let x = i as f32 * 0.01;
            let gelu = 0.5 * x as f64 * (1.0 + (0.797_884_560_8 * (x as f64 + 0.044_715 * (x as f64).powi(3))).tanh());
            assert!((gelu_tanh(x) as f64 - gelu).abs() < 1e-6 * (1.0 + gelu.abs()), "gelu {x}");
            let silu_ref = x as f64 / (1.0 + (-x as f64).exp());
            assert!((silu(x) as f64 - silu_ref).abs() < 1e-6 * (1.0 + silu_ref.abs()), "silu {x}");
        }
    }

    #[test]
    fn dot_and_axpy_match_plain_loops() {
        for n in [0, 1, 7, 8, 15, 16, 17, 64, 100, 257] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5 * (1.0 + want.abs()), "n={n}");
            let mut y = b.clone();
            axpy(&mut y, 0.5, &a);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
            }
        }
    }

    /// Attention against a plain f64 softmax and sum, for head sizes the vector path takes
    /// (64, 128; positions not a multiple of 4) and one it leaves to the plain loops (40).
    #[test]
    fn attend_matches_a_plain_softmax() {
        let cases = [(64, 1, None), (64, 7, None), (128, 13, Some(30.0)), (40, 6, None)];
        for ((hd, n, softcap), half) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
            let x = |i: usize, f: f32| (i as f32 * f).sin() * 2.0;
            // An f16 cache holds the rows rounded: the reference takes the rounded values.
            let kv = |v: f32| if half { half::f16::from_f32(v).to_f32() } else { v };
            let q: Vec<f32> = (0..hd).map(|i| x(i, 0.37)).collect();
            let ks: Vec<Vec<f32>> = (0..n).map(|p| (0..hd).map(|i| kv(x(i + 97 * p, 0.11))).collect()).collect();
            let vs: Vec<Vec<f32>> = (0..n).map(|p| (0..hd).map(|i| kv(x(i + 31 * p, 0.23))).collect()).collect();
            let p = AttentionParams { scale: 0.125, softcap, sink: Some(0.5) };
            let mut out = vec![0f32; hd];
            if half {
                let f16s = |rows: &[Vec<f32>]| -> Vec<Vec<half::f16>> {
                    rows.iter().map(|r| r.iter().map(|&v| half::f16::from_f32(v)).collect()).collect()
                };
                let (ks, vs) = (f16s(&ks), f16s(&vs));
                attend(&q, ks.iter().map(|k| &k[..]), vs.iter().map(|v| &v[..]), &p, &mut Vec::new(), &mut out);
            } else {
                attend(&q, ks.iter().map(|k| &k[..]), vs.iter().map(|v| &v[..]), &p, &mut Vec::new(), &mut out);
            }
            let logits: Vec<f64> = ks
                .iter()
                .map(|k| {
                    let s = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * 0.125;
                    softcap.map_or(s, |c: f32| c as f64 * (s / c as f64).tanh())
                })
                .collect();
            let max = logits.iter().copied().fold(0.5f64, f64::max);
            let denom = (0.5 - max).exp() + logits.iter().map(|l| (l - max).exp()).sum::<f64>();
            for i in 0..hd {
                let want: f64 = logits.iter().zip(&vs).map(|(l, v)| (l - max).exp() / denom * v[i] as f64).sum();
                assert!(
                    (out[i] as f64 - want).abs() < 1e-5,
                    "hd {hd}, {n} positions, f16 {half}, element {i}: {} against {want}",
                    out[i]
                );
            }
        }
    }

    /// A group's heads each get what [`attend`] gives that head alone, bit for bit (so a row's
    /// attention does not depend on whether its step groups heads), on the vector path (64)
    /// and the plain one (40), over f32 and f16 caches.
    #[test]
    fn attend_group_gives_each_head_its_own_attention() {
        for (hd, n) in [(64, 11), (64, 4), (40, 5), (128, 37)] {
            let x = |i: usize, f: f32| (i as f32 * f).sin() * 2.0;
            let g_n = 3;
            let q: Vec<f32> = (0..g_n * hd).map(|i| x(i, 0.29)).collect();
            let ks: Vec<Vec<f32>> = (0..n).map(|p| (0..hd).map(|i| x(i + 53 * p, 0.13)).collect()).collect();
            let vs: Vec<Vec<f32>> = (0..n).map(|p| (0..hd).map(|i| x(i + 17 * p, 0.31)).collect()).collect();
            let heads: Vec<AttentionParams> = (0..g_n)
                .map(|g| AttentionParams {
                    scale: 0.125,
                    softcap: Some(20.0),
                    sink: (g != 1).then_some(g as f32 * 0.3),
                })
                .collect();
            fn check<T: KvElement>(q: &[f32], ks: &[Vec<T>], vs: &[Vec<T>], heads: &[AttentionParams], what: &str) {
                let hd = q.len() / heads.len();
                let mut together = vec![0f32; q.len()];
                let (keys, values) = (ks.iter().map(|k| &k[..]), vs.iter().map(|v| &v[..]));
                attend_group(q, keys, values, heads, &mut Vec::new(), &mut together);
                for (g, p) in heads.iter().enumerate() {
                    let mut alone = vec![0f32; hd];
                    let (keys, values) = (ks.iter().map(|k| &k[..]), vs.iter().map(|v| &v[..]));
                    attend(&q[g * hd..(g + 1) * hd], keys, values, p, &mut Vec::new(), &mut alone);
                    assert_eq!(&together[g * hd..(g + 1) * hd], &alone[..], "{what}, head {g}");
                }
            }
            let what = format!("hd {hd}, {n} positions");
            check(&q, &ks, &vs, &heads, &format!("{what}, f32 cache"));
            // An f16 cache too (its rows converted as they are read).
            let half = |rows: &[Vec<f32>]| -> Vec<Vec<half::f16>> {
                rows.iter().map(|r| r.iter().map(|&v| half::f16::from_f32(v)).collect()).collect()
            };
            check(&q, &half(&ks), &half(&vs), &heads, &format!("{what}, f16 cache"));
        }
    }

    /// A group's positions attended in runs (without sinks) and merged give each head what one
    /// call over every position gives (with its sink and cap), to rounding.
    #[test]
    fn runs_merged_match_one_pass() {
        let (hd, n, g_n) = (64, 37, 3);
        let x = |i: usize, f: f32| (i as f32 * f).sin() * 2.0;
        let q: Vec<f32> = (0..g_n * hd).map(|i| x(i, 0.29)).collect();
        let ks: Vec<Vec<f32>> = (0..n).map(|p| (0..hd).map(|i| x(i + 53 * p, 0.13)).collect()).collect();
        let vs: Vec<Vec<f32>> = (0..n).map(|p| (0..hd).map(|i| x(i + 17 * p, 0.31)).collect()).collect();
        let heads: Vec<AttentionParams> = (0..g_n)
            .map(|g| AttentionParams { scale: 0.125, softcap: Some(20.0), sink: (g != 1).then_some(g as f32 * 0.3) })
            .collect();
        let mut whole = vec![0f32; g_n * hd];
        attend_group(&q, ks.iter().map(|k| &k[..]), vs.iter().map(|v| &v[..]), &heads, &mut Vec::new(), &mut whole);
        for cuts in [vec![0, 18, n], vec![0, 1, 20, n], vec![0, 12, 24, 36, n]] {
            let unsunk: Vec<AttentionParams> = heads.iter().map(|h| AttentionParams { sink: None, ..*h }).collect();
            let runs: Vec<(Vec<f32>, [f32; MAX_GROUP])> = cuts
                .windows(2)
                .map(|c| {
                    let mut o = vec![0f32; g_n * hd];
                    let (keys, values) = (ks[c[0]..c[1]].iter().map(|k| &k[..]), vs[c[0]..c[1]].iter().map(|v| &v[..]));
                    let lse = attend_group(&q, keys, values, &unsunk, &mut Vec::new(), &mut o);
                    (o, lse)
                })
                .collect();
            for (g, h) in heads.iter().enumerate() {
                let mut merged = vec![0f32; hd];
                merge_runs(runs.iter().map(|(o, lse)| (&o[g * hd..(g + 1) * hd], lse[g])), h.sink, &mut merged);
                for (i, (a, b)) in merged.iter().zip(&whole[g * hd..(g + 1) * hd]).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "cuts {cuts:?}, head {g}, element {i}: {a} against {b}"
                    );
                }
            }
        }
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
