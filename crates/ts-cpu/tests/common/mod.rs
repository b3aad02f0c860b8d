//! Test data and references shared by the ts-cpu tests.

#![allow(dead_code)]

use ts_cpu::GgmlType;

/// Every weight type ts-cpu multiplies.
pub const TYPES: [GgmlType; 14] = {
    use GgmlType::*;
    [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4]
};

pub use ts_testkit::Rng;

/// Gaussian values whose scale changes every 256 elements, as activations and weights vary.
pub fn rows(rng: &mut Rng, n: usize) -> Vec<f32> {
    const SCALES: [f32; 4] = [1.0, 30.0, 0.25, 4.0];
    (0..n).map(|i| rng.normal() * SCALES[i / 256 % 4] + if i % 1000 < 300 { 0.5 } else { 0.0 }).collect()
}

/// Bytes in 8-byte aligned storage, optionally starting `offset` bytes in.
pub struct Aligned {
    words: Vec<u64>,
    offset: usize,
    len: usize,
}

impl Aligned {
    pub fn new(bytes: &[u8], offset: usize) -> Self {
        let mut words = vec![0u64; (bytes.len() + offset).div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[offset..offset + bytes.len()].copy_from_slice(bytes);
        Aligned { words, offset, len: bytes.len() }
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[self.offset..self.offset + self.len]
    }
}

/// Byte offsets of the f16 scales in each block (ggml-common.h).
fn f16_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// `n_rows` weight rows of `k`: quantized Gaussian rows, or (with `random`) arbitrary bytes
/// with finite scales of moderate size.
pub fn weights(rng: &mut Rng, ty: GgmlType, n_rows: usize, k: usize, random: bool) -> Vec<u8> {
    let bytes = ty.bytes_for((n_rows * k) as u64).unwrap() as usize;
    if !random {
        let x = rows(rng, n_rows * k);
        let mut out = Aligned::new(&vec![0u8; bytes], 0);
        let dst = bytemuck::cast_slice_mut::<u64, u8>(&mut out.words);
        ts_quant::quantize(ty, &x, &mut dst[..bytes]).unwrap();
        return out.bytes().to_vec();
    }
    let mut raw: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
    let block = ty.type_size() as usize;
    match ty {
        GgmlType::F32 => {
            for c in raw.chunks_exact_mut(4) {
                c.copy_from_slice(&(rng.normal() * 3.0).to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for c in raw.chunks_exact_mut(2) {
                let v = rng.normal() * 3.0;
                let bits = if ty == GgmlType::F16 {
                    half::f16::from_f32(v).to_bits()
                } else {
                    half::bf16::from_f32(v).to_bits()
                };
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        GgmlType::MXFP4 => {
            for b in raw.chunks_exact_mut(block) {
                b[0] = 110 + b[0] % 30;
            }
        }
        _ => {
            for b in raw.chunks_exact_mut(block) {
                for &at in f16_offsets(ty) {
                    let d = half::f16::from_f32((rng.normal() * 0.05).clamp(-60000.0, 60000.0));
                    b[at..at + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
        }
    }
    raw
}

pub fn dequantized(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let aligned = Aligned::new(bytes, 0);
    let mut out = vec![0.0f32; n];
    ts_quant::dequantize(ty, aligned.bytes(), &mut out).unwrap();
    out
}

/// Magnitude of the rounding errors of a blocked dot product: `sum_i max|w in block(i)| * |a_i|`,
/// with blocks of the weight type (elements for float types).
pub fn magnitude(ty: GgmlType, w: &[f32], a: &[f32]) -> f64 {
    let block = ty.block_size() as usize;
    w.chunks(block)
        .zip(a.chunks(block))
        .map(|(w, a)| {
            let w_max = w.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs()));
            w_max * a.iter().map(|&v| (v as f64).abs()).sum::<f64>()
        })
        .sum()
}

/// Error allowed between two summation orders of the same block terms, as ts-quant's
/// property tests derive it: `4 (n_terms + 8) eps * magnitude`, where `n_terms` is the number
/// of blocks (elements for float types). SIMD kernels sum 8 lanes per block, which adds a few
/// roundings per term, well inside the factor 4.
pub fn tolerance(ty: GgmlType, w: &[f32], a: &[f32]) -> f64 {
    let n_terms = w.len() / ty.block_size() as usize;
    4.0 * (n_terms as f64 + 8.0) * f32::EPSILON as f64 * magnitude(ty, w, a)
}

pub fn exact_dot(w: &[f32], a: &[f32]) -> f64 {
    w.iter().zip(a).map(|(&w, &a)| w as f64 * a as f64).sum()
}
