//! The k-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and their activation format Q8_K, all in
//! super-blocks of 256 elements.
//!
//! Quantizers follow `quantize_row_*_ref` and their helpers (`make_qkx2_quants`,
//! `make_q3_quants`, `make_qx_quants`) in ggml-quants.c operation for operation, so their
//! output matches llama.cpp's byte for byte. Each dot product is one integer sum per
//! super-block (group sums times group scales), then one float expression per super-block;
//! min terms use the activations' `bsums`, as ggml-cpu/quants.c does.

use std::array;

use bytemuck::Zeroable;
use half::f16;

use crate::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K, QK_K};
use crate::convert::{f32_to_f16, nearest_int, signed_absmax};
use crate::{Codec, Dot};

/// Groups whose largest magnitude is below this are quantized as all zero (ggml-quants.c).
const GROUP_MAX_EPS: f32 = 1e-15;

/// 2-bit field of element `e` when four 32-element rows share each byte of a 128-element half
/// (Q2_K and the low bits of Q3_K).
fn two_bits(qs: &[u8; 64], e: usize) -> u8 {
    (qs[e / 128 * 32 + e % 32] >> (2 * (e % 128 / 32))) & 3
}

/// Inverse of [`two_bits`] for levels in 0..4.
fn pack_two_bits(levels: &[u8; QK_K]) -> [u8; 64] {
    array::from_fn(|i| {
        let (half, l) = (i / 32, i % 32);
        let base = half * 128 + l;
        levels[base] | (levels[base + 32] << 2) | (levels[base + 64] << 4) | (levels[base + 96] << 6)
    })
}

/// Scale and min of group `g` (0..8) from the 12 packed 6-bit values of Q4_K and Q5_K
/// (ggml-quants.c `get_scale_min_k4`).
fn scale_min_k4(g: usize, packed: &[u8; 12]) -> (u8, u8) {
    if g < 4 {
        (packed[g] & 63, packed[g + 4] & 63)
    } else {
        ((packed[g + 4] & 0x0f) | ((packed[g - 4] >> 6) << 4), (packed[g + 4] >> 4) | ((packed[g] >> 6) << 4))
    }
}

/// Packs 6-bit scales and mins, the inverse of [`scale_min_k4`].
fn pack_scale_min_k4(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for g in 0..8 {
        let (ls, lm) = (scales[g], mins[g]);
        if g < 4 {
            packed[g] = ls;
            packed[g + 4] = lm;
        } else {
            packed[g + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[g - 4] |= (ls >> 4) << 6;
            packed[g] |= (lm >> 4) << 6;
        }
    }
    packed
}

/// The 16 signed 6-bit group scales of Q3_K: low 4 bits in bytes 0..8 (two per byte), high
/// 2 bits in bytes 8..12.
fn q3k_scales(packed: &[u8; 12]) -> [i32; 16] {
    array::from_fn(|g| {
        let low = if g < 8 { packed[g] & 0x0f } else { packed[g - 8] >> 4 };
        let high = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    })
}

/// Sum over groups of `scale(g) * (weights . activations within group g)`.
fn grouped_dot(weights: &[i32; QK_K], activations: &[i8; QK_K], group: usize, scale: impl Fn(usize) -> i32) -> i32 {
    weights
        .chunks_exact(group)
        .zip(activations.chunks_exact(group))
        .enumerate()
        .map(|(g, (w, a))| scale(g) * w.iter().zip(a).map(|(&w, &a)| w * a as i32).sum::<i32>())
        .sum()
}

/// Sum of the activations of each 32-element group times that group's min (Q4_K, Q5_K).
fn min_term_k4(packed: &[u8; 12], activations: &BlockQ8K) -> i32 {
    (0..16).map(|j| activations.bsums[j] as i32 * scale_min_k4(j / 2, packed).1 as i32).sum()
}

/// Scale and min for one group of a min-offset format, searching scales around
/// `nmax / (max - min)` for the smallest weighted error (ggml-quants.c `make_qkx2_quants`).
/// Returns `(scale, -min)` and leaves the chosen levels in `levels`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    levels: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let error = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels[..n].fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        levels[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        best_error += weights[i] * error(scale * levels[i] as f32 + min - x[i]);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut trial = [0u8; 32];
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            trial[i] = l as u8;
            let (w, l) = (weights[i], l as f32);
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                cur_error += weights[i] * error(this_scale * trial[i] as f32 + this_min - x[i]);
            }
            if cur_error < best_error {
                levels[..n].copy_from_slice(&trial[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric scale for one Q3_K group, refined by coordinate descent on the x²-weighted error
/// (ggml-quants.c `make_q3_quants` with rmse). Levels are left offset by `nmax`.
fn make_q3_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        levels[i] = l as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let old = levels[i] as f32;
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != levels[i] as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        levels[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for l in levels.iter_mut() {
        *l += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Symmetric scale for one Q6_K group: the x²-weighted least-squares scale, trying 18
/// perturbations of `nmax / max` (ggml-quants.c `make_qx_quants`, rmse_type 1).
/// Levels are left offset by `nmax`.
fn make_qx_quants(nmax: i32, x: &[f32], levels: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let set_levels = |iscale: f32, levels: &mut [i8]| {
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = (nmax + nearest_int(iscale * v).clamp(-nmax, nmax - 1)) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    set_levels(iscale, levels);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for step in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(nmax as f32 + 0.1 * step as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set_levels(iscale, levels);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

impl BlockQ2K {
    fn levels(&self) -> [i32; QK_K] {
        array::from_fn(|e| two_bits(&self.qs, e) as i32)
    }
}

impl Codec for BlockQ2K {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let dmin = self.dmin.to_f32();
        let levels = self.levels();
        for (g, (out, q)) in out.chunks_exact_mut(16).zip(levels.chunks_exact(16)).enumerate() {
            let scale = d * (self.scales[g] & 0x0f) as f32;
            let min = dmin * (self.scales[g] >> 4) as f32;
            for (o, &q) in out.iter_mut().zip(q) {
                *o = scale * q as f32 - min;
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        const SCALE_MAX: f32 = 15.0;
        let mut levels = [0u8; QK_K];
        let mut scales = [0.0f32; 16];
        let mut mins = [0.0f32; 16];
        let mut max_scale = 0.0f32;
        let mut max_min = 0.0f32;
        for g in 0..16 {
            let xg = &x[16 * g..16 * g + 16];
            let weights: [f32; 16] = array::from_fn(|l| xg[l].abs());
            let (scale, min) = make_qkx2_quants(3, xg, &weights, &mut levels[16 * g..], -0.5, 0.1, 15, true);
            scales[g] = scale;
            mins[g] = min;
            if scale > max_scale {
                max_scale = scale;
            }
            if min > max_min {
                max_min = min;
            }
        }
        let mut block = BlockQ2K::zeroed();
        if max_scale > 0.0 {
            let iscale = SCALE_MAX / max_scale;
            for (packed, &scale) in block.scales.iter_mut().zip(&scales) {
                *packed = nearest_int(iscale * scale) as u8;
            }
            block.d = f32_to_f16(max_scale / SCALE_MAX);
        }
        if max_min > 0.0 {
            let iscale = SCALE_MAX / max_min;
            for (packed, &min) in block.scales.iter_mut().zip(&mins) {
                *packed |= (nearest_int(iscale * min) << 4) as u8;
            }
            block.dmin = f32_to_f16(max_min / SCALE_MAX);
        }
        for g in 0..16 {
            let d = block.d.to_f32() * (block.scales[g] & 0x0f) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = block.dmin.to_f32() * (block.scales[g] >> 4) as f32;
            for i in 16 * g..16 * g + 16 {
                levels[i] = nearest_int((x[i] + dm) / d).clamp(0, 3) as u8;
            }
        }
        block.qs = pack_two_bits(&levels);
        block
    }
}

impl Dot<BlockQ8K> for BlockQ2K {
    fn dot(&self, a: &BlockQ8K) -> f32 {
        let min_sum: i32 = (0..16).map(|g| a.bsums[g] as i32 * (self.scales[g] >> 4) as i32).sum();
        let sum = grouped_dot(&self.levels(), &a.qs, 16, |g| (self.scales[g] & 0x0f) as i32);
        let d = a.d * self.d.to_f32();
        let dmin = a.d * self.dmin.to_f32();
        d * sum as f32 - dmin * min_sum as f32
    }
}

impl BlockQ3K {
    /// Signed levels in -4..4: the high bit set means no offset.
    fn levels(&self) -> [i32; QK_K] {
        array::from_fn(|e| {
            let high = self.hmask[e % 32] & (1 << (e / 32)) != 0;
            two_bits(&self.qs, e) as i32 - if high { 0 } else { 4 }
        })
    }
}

impl Codec for BlockQ3K {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let scales = q3k_scales(&self.scales);
        let levels = self.levels();
        for (g, (out, q)) in out.chunks_exact_mut(16).zip(levels.chunks_exact(16)).enumerate() {
            let scale = d * scales[g] as f32;
            for (o, &q) in out.iter_mut().zip(q) {
                *o = scale * q as f32;
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let mut levels = [0i8; QK_K];
        let mut scales = [0.0f32; 16];
        let mut max_scale = 0.0f32;
        let mut amax = 0.0f32;
        for g in 0..16 {
            scales[g] = make_q3_quants(4, &x[16 * g..16 * g + 16], &mut levels[16 * g..16 * g + 16]);
            if scales[g].abs() > amax {
                amax = scales[g].abs();
                max_scale = scales[g];
            }
        }
        let mut block = BlockQ3K::zeroed();
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (g, &scale) in scales.iter().enumerate() {
                let l = (nearest_int(iscale * scale) as i8 as i32).clamp(-32, 31) + 32;
                if g < 8 {
                    block.scales[g] = (l & 0x0f) as u8;
                } else {
                    block.scales[g - 8] |= ((l & 0x0f) << 4) as u8;
                }
                block.scales[8 + g % 4] |= ((l >> 4) << (2 * (g / 4))) as u8;
            }
            block.d = f32_to_f16(1.0 / iscale);
        }
        for (g, &scale) in q3k_scales(&block.scales).iter().enumerate() {
            let d = block.d.to_f32() * scale as f32;
            if d == 0.0 {
                continue;
            }
            for i in 16 * g..16 * g + 16 {
                levels[i] = (nearest_int(x[i] / d).clamp(-4, 3) + 4) as i8;
            }
        }
        let mut low = [0u8; QK_K];
        for (e, (&l, low)) in levels.iter().zip(low.iter_mut()).enumerate() {
            *low = if l > 3 {
                block.hmask[e % 32] |= 1 << (e / 32);
                (l - 4) as u8
            } else {
                l as u8
            };
        }
        block.qs = pack_two_bits(&low);
        block
    }
}

impl Dot<BlockQ8K> for BlockQ3K {
    fn dot(&self, a: &BlockQ8K) -> f32 {
        let scales = q3k_scales(&self.scales);
        let sum = grouped_dot(&self.levels(), &a.qs, 16, |g| scales[g]);
        (self.d.to_f32() * a.d) * sum as f32
    }
}

/// Scales, mins and levels of Q4_K and Q5_K: weighted min-offset fits per 32-element group,
/// the group scales and mins themselves quantized to 6 bits (quantize_row_q4_K_ref and
/// quantize_row_q5_K_ref differ only in `nmax` and the search range).
fn quantize_k4(x: &[f32], nmax: i32, rmin: f32, nstep: i32) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let mut levels = [0u8; QK_K];
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for g in 0..8 {
        let xg = &x[32 * g..32 * g + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xg {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = array::from_fn(|l| av_x + xg[l].abs());
        let (scale, min) = make_qkx2_quants(nmax, xg, &weights, &mut levels[32 * g..], rmin, 0.1, nstep, false);
        scales[g] = scale;
        mins[g] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let scale_levels: [u8; 8] = array::from_fn(|g| (nearest_int(inv_scale * scales[g]) as u8).min(63));
    let min_levels: [u8; 8] = array::from_fn(|g| (nearest_int(inv_min * mins[g]) as u8).min(63));
    let packed = pack_scale_min_k4(&scale_levels, &min_levels);
    let d = f32_to_f16(max_scale / 63.0);
    let dmin = f32_to_f16(max_min / 63.0);
    for g in 0..8 {
        let (sc, m) = scale_min_k4(g, &packed);
        let scale = d.to_f32() * sc as f32;
        if scale == 0.0 {
            continue;
        }
        let offset = dmin.to_f32() * m as f32;
        for i in 32 * g..32 * g + 32 {
            levels[i] = nearest_int((x[i] + offset) / scale).clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, levels)
}

fn dequantize_k4(d: f16, dmin: f16, packed: &[u8; 12], levels: &[i32; QK_K], out: &mut [f32]) {
    let (d, dmin) = (d.to_f32(), dmin.to_f32());
    for (g, (out, q)) in out.chunks_exact_mut(32).zip(levels.chunks_exact(32)).enumerate() {
        let (sc, m) = scale_min_k4(g, packed);
        let scale = d * sc as f32;
        let min = dmin * m as f32;
        for (o, &q) in out.iter_mut().zip(q) {
            *o = scale * q as f32 - min;
        }
    }
}

fn dot_k4(d: f16, dmin: f16, packed: &[u8; 12], levels: &[i32; QK_K], a: &BlockQ8K) -> f32 {
    let sum = grouped_dot(levels, &a.qs, 32, |g| scale_min_k4(g, packed).0 as i32);
    let min_sum = min_term_k4(packed, a);
    (d.to_f32() * a.d) * sum as f32 - (dmin.to_f32() * a.d) * min_sum as f32
}

impl BlockQ4K {
    fn levels(&self) -> [i32; QK_K] {
        array::from_fn(|e| ((self.qs[e / 64 * 32 + e % 32] >> (4 * (e / 32 % 2))) & 0x0f) as i32)
    }
}

impl Codec for BlockQ4K {
    fn dequantize(&self, out: &mut [f32]) {
        dequantize_k4(self.d, self.dmin, &self.scales, &self.levels(), out);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, dmin, scales, levels) = quantize_k4(x, 15, -1.0, 20);
        let qs = array::from_fn(|i| {
            let base = i / 32 * 64 + i % 32;
            levels[base] | (levels[base + 32] << 4)
        });
        BlockQ4K { d, dmin, scales, qs }
    }
}

impl Dot<BlockQ8K> for BlockQ4K {
    fn dot(&self, a: &BlockQ8K) -> f32 {
        dot_k4(self.d, self.dmin, &self.scales, &self.levels(), a)
    }
}

impl BlockQ5K {
    fn levels(&self) -> [i32; QK_K] {
        array::from_fn(|e| {
            let low = (self.qs[e / 64 * 32 + e % 32] >> (4 * (e / 32 % 2))) & 0x0f;
            let high = (self.qh[e % 32] >> (e / 32)) & 1;
            (low | (high << 4)) as i32
        })
    }
}

impl Codec for BlockQ5K {
    fn dequantize(&self, out: &mut [f32]) {
        dequantize_k4(self.d, self.dmin, &self.scales, &self.levels(), out);
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, dmin, scales, levels) = quantize_k4(x, 31, -0.5, 15);
        let mut qh = [0u8; 32];
        for (e, &l) in levels.iter().enumerate() {
            qh[e % 32] |= (l >> 4) << (e / 32);
        }
        let qs = array::from_fn(|i| {
            let base = i / 32 * 64 + i % 32;
            (levels[base] & 0x0f) | ((levels[base + 32] & 0x0f) << 4)
        });
        BlockQ5K { d, dmin, scales, qh, qs }
    }
}

impl Dot<BlockQ8K> for BlockQ5K {
    fn dot(&self, a: &BlockQ8K) -> f32 {
        dot_k4(self.d, self.dmin, &self.scales, &self.levels(), a)
    }
}

impl BlockQ6K {
    /// Signed levels in -32..32. Element `e` sits in half `e / 128`, row `k = e % 128 / 32`:
    /// low 4 bits in a nibble of `ql` (rows 0 and 2 share bytes, as do rows 1 and 3), high 2 bits
    /// at bit `2k` of a `qh` byte.
    fn levels(&self) -> [i32; QK_K] {
        array::from_fn(|e| {
            let (half, k, l) = (e / 128, e % 128 / 32, e % 32);
            let low = (self.ql[half * 64 + (k % 2) * 32 + l] >> (4 * (k / 2))) & 0x0f;
            let high = (self.qh[half * 32 + l] >> (2 * k)) & 3;
            (low | (high << 4)) as i32 - 32
        })
    }
}

impl Codec for BlockQ6K {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let levels = self.levels();
        for (g, (out, q)) in out.chunks_exact_mut(16).zip(levels.chunks_exact(16)).enumerate() {
            let scale = d * self.scales[g] as f32;
            for (o, &q) in out.iter_mut().zip(q) {
                *o = scale * q as f32;
            }
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let mut levels = [0i8; QK_K];
        let mut scales = [0.0f32; 16];
        let mut max_scale = 0.0f32;
        let mut max_abs_scale = 0.0f32;
        for g in 0..16 {
            let scale = make_qx_quants(32, &x[16 * g..16 * g + 16], &mut levels[16 * g..16 * g + 16]);
            scales[g] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        let mut block = BlockQ6K::zeroed();
        if max_abs_scale < GROUP_MAX_EPS {
            return block;
        }
        let iscale = -128.0 / max_scale;
        block.d = f32_to_f16(1.0 / iscale);
        for (packed, &scale) in block.scales.iter_mut().zip(&scales) {
            *packed = nearest_int(iscale * scale).min(127) as i8;
        }
        for g in 0..16 {
            let d = block.d.to_f32() * block.scales[g] as f32;
            if d == 0.0 {
                continue;
            }
            for i in 16 * g..16 * g + 16 {
                levels[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as i8;
            }
        }
        let levels = levels.map(|l| l as u8);
        for half in 0..2 {
            for l in 0..32 {
                let at = |k: usize| levels[half * 128 + k * 32 + l];
                block.ql[half * 64 + l] = (at(0) & 0x0f) | ((at(2) & 0x0f) << 4);
                block.ql[half * 64 + l + 32] = (at(1) & 0x0f) | ((at(3) & 0x0f) << 4);
                block.qh[half * 32 + l] =
                    (at(0) >> 4) | ((at(1) >> 4) << 2) | ((at(2) >> 4) << 4) | ((at(3) >> 4) << 6);
            }
        }
        block
    }
}

impl Dot<BlockQ8K> for BlockQ6K {
    fn dot(&self, a: &BlockQ8K) -> f32 {
        let sum = grouped_dot(&self.levels(), &a.qs, 16, |g| self.scales[g] as i32);
        (self.d.to_f32() * a.d) * sum as f32
    }
}

impl Codec for BlockQ8K {
    fn dequantize(&self, out: &mut [f32]) {
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = self.d * q as f32;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let (max, amax) = signed_absmax(x);
        let mut block = BlockQ8K::zeroed();
        if amax == 0.0 {
            return block;
        }
        let iscale = -127.0 / max;
        for (q, &v) in block.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, group) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
            *sum = group.iter().map(|&q| q as i16).sum();
        }
        block.d = 1.0 / iscale;
        block
    }
}
