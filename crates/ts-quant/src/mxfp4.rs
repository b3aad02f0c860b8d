//! MXFP4: 4-bit E2M1 codes with a shared E8M0 scale per 32 elements.
//!
//! The quantizer follows `quantize_row_mxfp4_ref` in ggml-quants.c: the scale exponent is
//! `floor(log2(amax)) - 2`, so the largest code (6) covers amax, and each element takes the
//! nearest representable value (the first code on ties).

use crate::blocks::{BlockMxfp4, BlockQ8_0};
use crate::convert::{MXFP4_VALUES, e8m0_to_f32_half};
use crate::{Codec, Dot};

fn nearest_code(x: f32, d: f32) -> u8 {
    let mut best = 0u8;
    let mut best_error = (MXFP4_VALUES[0] as f32 * d - x).abs();
    for (code, &v) in MXFP4_VALUES.iter().enumerate().skip(1) {
        let error = (v as f32 * d - x).abs();
        if error < best_error {
            best = code as u8;
            best_error = error;
        }
    }
    best
}

impl Codec for BlockMxfp4 {
    fn dequantize(&self, out: &mut [f32]) {
        let d = e8m0_to_f32_half(self.e);
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = MXFP4_VALUES[(q & 0x0f) as usize] as f32 * d;
            out[j + 16] = MXFP4_VALUES[(q >> 4) as usize] as f32 * d;
        }
    }

    fn quantize(x: &[f32]) -> Self {
        let amax = x.iter().fold(0.0f32, |m, v| if m < v.abs() { v.abs() } else { m });
        // Float to uint8_t in C truncates through a 32-bit integer.
        let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0) as i32 as u8 } else { 0 };
        let d = e8m0_to_f32_half(e);
        let qs = std::array::from_fn(|j| nearest_code(x[j], d) | (nearest_code(x[j + 16], d) << 4));
        BlockMxfp4 { e, qs }
    }
}

impl Dot<BlockQ8_0> for BlockMxfp4 {
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        let mut sum_low = 0i32;
        let mut sum_high = 0i32;
        for (j, &q) in self.qs.iter().enumerate() {
            sum_low += a.qs[j] as i32 * MXFP4_VALUES[(q & 0x0f) as usize] as i32;
            sum_high += a.qs[j + 16] as i32 * MXFP4_VALUES[(q >> 4) as usize] as i32;
        }
        let d = a.d.to_f32() * e8m0_to_f32_half(self.e);
        d * (sum_low + sum_high) as f32
    }
}
