//! The 32-element formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1.
//!
//! Quantizers follow the `quantize_row_*_ref` functions of ggml-quants.c operation for
//! operation (same float expressions, same rounding and truncation), so their output matches
//! llama.cpp's byte for byte. Dot products follow ggml-cpu/quants.c's scalar code: an integer
//! sum per block, then one float expression per block.

use crate::blocks::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1};
use crate::convert::{f32_to_f16, signed_absmax};
use crate::{Codec, Dot};

/// Smallest and largest element, starting from the extreme floats as ggml does.
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// C's float-to-small-integer conversion for values known to be in range: truncation.
fn truncate(x: f32) -> i32 {
    x as i32
}

/// Low nibble holds element `j`, high nibble element `j + 16`.
fn nibbles(qs: &[u8; 16]) -> impl Iterator<Item = (usize, i32, i32)> + '_ {
    qs.iter().enumerate().map(|(j, &q)| (j, (q & 0x0f) as i32, (q >> 4) as i32))
}

/// Fifth bits of elements `j` and `j + 16`, already shifted to 0x10.
fn high_bits(qh: u32, j: usize) -> (i32, i32) {
    ((((qh >> j) << 4) & 0x10) as i32, ((qh >> (j + 12)) & 0x10) as i32)
}

impl Codec for BlockQ4_0 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, lo, hi) in nibbles(&self.qs) {
            out[j] = (lo - 8) as f32 * d;
            out[j + 16] = (hi - 8) as f32 * d;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let d = signed_absmax(x).0 / -8.0;
        let id = inverse_or_zero(d);
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            let q0 = truncate(x[j] * id + 8.5).min(15) as u8;
            let q1 = truncate(x[j + 16] * id + 8.5).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
        BlockQ4_0 { d: f32_to_f16(d), qs }
    }
}

impl Codec for BlockQ4_1 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let m = self.m.to_f32();
        for (j, lo, hi) in nibbles(&self.qs) {
            out[j] = lo as f32 * d + m;
            out[j + 16] = hi as f32 * d + m;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse_or_zero(d);
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            let q0 = truncate((x[j] - min) * id + 0.5).min(15) as u8;
            let q1 = truncate((x[j + 16] - min) * id + 0.5).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
        BlockQ4_1 { d: f32_to_f16(d), m: f32_to_f16(min), qs }
    }
}

impl Codec for BlockQ5_0 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let qh = u32::from_le_bytes(self.qh);
        for (j, lo, hi) in nibbles(&self.qs) {
            let (h0, h1) = high_bits(qh, j);
            out[j] = ((lo | h0) - 16) as f32 * d;
            out[j + 16] = ((hi | h1) - 16) as f32 * d;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let d = signed_absmax(x).0 / -16.0;
        let id = inverse_or_zero(d);
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for (j, q) in qs.iter_mut().enumerate() {
            let q0 = truncate(x[j] * id + 16.5).min(31) as u32;
            let q1 = truncate(x[j + 16] * id + 16.5).min(31) as u32;
            *q = ((q0 & 0x0f) | ((q1 & 0x0f) << 4)) as u8;
            qh |= ((q0 & 0x10) >> 4) << j;
            qh |= ((q1 & 0x10) >> 4) << (j + 16);
        }
        BlockQ5_0 { d: f32_to_f16(d), qh: qh.to_le_bytes(), qs }
    }
}

impl Codec for BlockQ5_1 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        let m = self.m.to_f32();
        let qh = u32::from_le_bytes(self.qh);
        for (j, lo, hi) in nibbles(&self.qs) {
            let (h0, h1) = high_bits(qh, j);
            out[j] = (lo | h0) as f32 * d + m;
            out[j + 16] = (hi | h1) as f32 * d + m;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse_or_zero(d);
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for (j, q) in qs.iter_mut().enumerate() {
            // ggml converts straight to uint8_t here, without clamping to 31.
            let q0 = truncate((x[j] - min) * id + 0.5) as u8 as u32;
            let q1 = truncate((x[j + 16] - min) * id + 0.5) as u8 as u32;
            *q = ((q0 & 0x0f) | ((q1 & 0x0f) << 4)) as u8;
            qh |= ((q0 & 0x10) >> 4) << j;
            qh |= ((q1 & 0x10) >> 4) << (j + 16);
        }
        BlockQ5_1 { d: f32_to_f16(d), m: f32_to_f16(min), qh: qh.to_le_bytes(), qs }
    }
}

/// Scale and rounded quants shared by Q8_0 and Q8_1: `d = amax / 127`, `q = round(x / d)`.
fn quantize_q8(x: &[f32]) -> (f32, [i8; 32]) {
    let amax = x.iter().fold(0.0f32, |m, v| if m > v.abs() { m } else { v.abs() });
    let d = amax / 127.0;
    let id = inverse_or_zero(d);
    let mut qs = [0i8; 32];
    for (q, v) in qs.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    (d, qs)
}

impl Codec for BlockQ8_0 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = quantize_q8(x);
        BlockQ8_0 { d: f32_to_f16(d), qs }
    }
}

impl Codec for BlockQ8_1 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = quantize_q8(x);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        BlockQ8_1 { d: f32_to_f16(d), s: f32_to_f16(sum as f32 * d), qs }
    }
}

/// Integer dot products of the two 16-element halves of a 32-element block.
fn half_sums(w: impl Fn(usize) -> (i32, i32), a: &[i8; 32]) -> i32 {
    let mut sum0 = 0i32;
    let mut sum1 = 0i32;
    for j in 0..16 {
        let (w0, w1) = w(j);
        sum0 += w0 * a[j] as i32;
        sum1 += w1 * a[j + 16] as i32;
    }
    sum0 + sum1
}

impl Dot<BlockQ8_0> for BlockQ4_0 {
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        let sum = half_sums(|j| ((self.qs[j] & 0x0f) as i32 - 8, (self.qs[j] >> 4) as i32 - 8), &a.qs);
        sum as f32 * self.d.to_f32() * a.d.to_f32()
    }
}

impl Dot<BlockQ8_1> for BlockQ4_1 {
    fn dot(&self, a: &BlockQ8_1) -> f32 {
        let sum = half_sums(|j| ((self.qs[j] & 0x0f) as i32, (self.qs[j] >> 4) as i32), &a.qs);
        (self.d.to_f32() * a.d.to_f32()) * sum as f32 + self.m.to_f32() * a.s.to_f32()
    }
}

impl Dot<BlockQ8_0> for BlockQ5_0 {
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        let qh = u32::from_le_bytes(self.qh);
        let sum = half_sums(
            |j| {
                let (h0, h1) = high_bits(qh, j);
                (((self.qs[j] & 0x0f) as i32 | h0) - 16, ((self.qs[j] >> 4) as i32 | h1) - 16)
            },
            &a.qs,
        );
        (self.d.to_f32() * a.d.to_f32()) * sum as f32
    }
}

impl Dot<BlockQ8_1> for BlockQ5_1 {
    fn dot(&self, a: &BlockQ8_1) -> f32 {
        let qh = u32::from_le_bytes(self.qh);
        let sum = half_sums(
            |j| {
                let (h0, h1) = high_bits(qh, j);
                ((self.qs[j] & 0x0f) as i32 | h0, (self.qs[j] >> 4) as i32 | h1)
            },
            &a.qs,
        );
        (self.d.to_f32() * a.d.to_f32()) * sum as f32 + self.m.to_f32() * a.s.to_f32()
    }
}

impl Dot<BlockQ8_0> for BlockQ8_0 {
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        let sum: i32 = self.qs.iter().zip(&a.qs).map(|(&w, &x)| w as i32 * x as i32).sum();
        sum as f32 * (self.d.to_f32() * a.d.to_f32())
    }
}
