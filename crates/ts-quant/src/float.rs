//! The plain float types F32, F16 and BF16, read from little-endian bytes at any alignment.

use half::f16;

use crate::convert::{bf16_bits_to_f32, f32_to_bf16_bits, f32_to_f16};

/// Element decoders for the float types; lengths are checked by the caller.
pub fn f32_at(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

pub fn f16_at(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
}

pub fn bf16_at(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(2).map(|c| bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
}

pub fn dequantize(values: impl Iterator<Item = f32>, dst: &mut [f32]) {
    for (out, v) in dst.iter_mut().zip(values) {
        *out = v;
    }
}

pub fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (out, v) in dst.chunks_exact_mut(4).zip(src) {
        out.copy_from_slice(&v.to_le_bytes());
    }
}

pub fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (out, v) in dst.chunks_exact_mut(2).zip(src) {
        out.copy_from_slice(&f32_to_f16(*v).to_le_bytes());
    }
}

pub fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (out, v) in dst.chunks_exact_mut(2).zip(src) {
        out.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
    }
}

/// Dot product of two float rows: exact f64 products summed in f64, rounded once to f32.
pub fn dot(weights: impl Iterator<Item = f32>, activations: impl Iterator<Item = f32>) -> f32 {
    weights.zip(activations).map(|(w, a)| w as f64 * a as f64).sum::<f64>() as f32
}
