//! Shared test helpers: the reference vector files, aligned buffers, a seeded generator and
//! the dot product tolerance.

#![allow(dead_code)]

use std::collections::HashMap;
use std::ops::Deref;
use std::path::PathBuf;

use ts_quant::{GgmlType, dequantize};

/// Every type ts-quant handles, in the order the generator writes them.
pub const TYPES: [GgmlType; 16] = {
    use GgmlType::*;
    [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, MXFP4]
};

/// Weight types: those with a dot product.
pub fn weight_types() -> impl Iterator<Item = GgmlType> {
    TYPES.into_iter().filter(|t| !matches!(t, GgmlType::Q8_1 | GgmlType::Q8_K))
}

/// Bytes in 8-byte aligned storage, so block views never fail on alignment.
pub struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    pub fn new(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        AlignedBytes { words, len: bytes.len() }
    }

    pub fn zeroed(len: usize) -> Self {
        AlignedBytes { words: vec![0u64; len.div_ceil(8)], len }
    }

    pub fn as_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }
}

impl Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }
}

/// One `<TYPE>.tsqv` file of tools/quant-vectors: named byte records (format in its README).
pub struct Vectors {
    pub ty: GgmlType,
    records: HashMap<String, Vec<u8>>,
}

impl Vectors {
    pub fn load(ty: GgmlType) -> Self {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(format!("{}.tsqv", ty.name()));
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(&data[..8], b"TSQV0001", "{}: bad magic", path.display());
        let mut records = HashMap::new();
        let mut at = 8;
        while at < data.len() {
            let name_len = u16::from_le_bytes(data[at..at + 2].try_into().unwrap()) as usize;
            let name = std::str::from_utf8(&data[at + 2..at + 2 + name_len]).unwrap().to_owned();
            at += 2 + name_len;
            let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize;
            records.insert(name, data[at + 4..at + 4 + len].to_vec());
            at += 4 + len;
        }
        let vectors = Vectors { ty, records };
        assert_eq!(vectors.text("type"), ty.name());
        vectors
    }

    pub fn has(&self, name: &str) -> bool {
        self.records.contains_key(name)
    }

    pub fn bytes(&self, name: &str) -> AlignedBytes {
        AlignedBytes::new(self.records.get(name).unwrap_or_else(|| panic!("{}: no record {name}", self.ty)))
    }

    pub fn f32s(&self, name: &str) -> Vec<f32> {
        self.bytes(name).chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    pub fn u32(&self, name: &str) -> u32 {
        u32::from_le_bytes(self.bytes(name)[..4].try_into().unwrap())
    }

    pub fn text(&self, name: &str) -> String {
        String::from_utf8(self.bytes(name).to_vec()).unwrap()
    }
}

pub use ts_testkit::Rng;

pub fn dequantized(ty: GgmlType, bytes: &[u8], elements: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; elements];
    dequantize(ty, bytes, &mut out).unwrap_or_else(|e| panic!("{ty}: {e}"));
    out
}

/// `sum_i max|w in block(i)| * |a_i|` over dequantized rows: the scale of the rounding errors
/// a blocked dot product can make (see [`dot_tolerance`]).
pub fn dot_magnitude(ty: GgmlType, weights: &[f32], activations: &[f32]) -> f64 {
    let block = ty.block_size() as usize;
    weights
        .chunks(block)
        .zip(activations.chunks(block))
        .map(|(w, a)| {
            let w_max = w.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs()));
            w_max * a.iter().map(|&v| (v as f64).abs()).sum::<f64>()
        })
        .sum()
}

/// Error allowed between two ways of computing the dot product of `weights` and `activations`
/// (dequantized values), when they differ only in float summation order and in rounding the
/// per-block scale products.
///
/// Each of the `n_terms` partial sums (one per block, one per element for float types) is
/// within a few roundings of exact, and summing them in any order adds at most `n_terms`
/// roundings of the running magnitude. Block terms of min-offset formats are differences of
/// a scale term and a min term, each bounded by `max|w in block| * sum|a|` for weights made by
/// a quantizer, hence the block maximum in place of `|w|`:
///
/// `tolerance = 4 * (n_terms + 8) * eps_f32 * sum_i max|w in block(i)| * |a_i|`
pub fn dot_tolerance(ty: GgmlType, weights: &[f32], activations: &[f32]) -> f64 {
    let n_terms = weights.len() / ty.block_size() as usize;
    4.0 * (n_terms as f64 + 8.0) * f32::EPSILON as f64 * dot_magnitude(ty, weights, activations)
}

/// Exact (f64) dot product of dequantized rows.
pub fn exact_dot(weights: &[f32], activations: &[f32]) -> f64 {
    weights.iter().zip(activations).map(|(&w, &a)| w as f64 * a as f64).sum()
}

/// Quantizer input rebuilt bit for bit from the generator's `bulk_input` (see gen.py): integers
/// below 2^24 times powers of two, drawn per group of `group` elements.
pub fn bulk_input(seed: u64, n_elements: usize, group: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut out = Vec::with_capacity(n_elements);
    while out.len() < n_elements {
        let p = rng.next_u64();
        let scale = f32::from_bits(((p & 31) as u32 + 127 - 32) << 23);
        let offset = [0i64, 1 << 17, -(1 << 17), 1 << 15][(p >> 5 & 3) as usize];
        let zero_below = [0u64, 1 << 15, 7 << 13, 0][(p >> 7 & 3) as usize];
        for _ in 0..group {
            let r = rng.next_u64();
            let v = if r >> 48 < zero_below {
                0
            } else {
                (r & 0xffff) as i64 + (r >> 16 & 0xffff) as i64 + (r >> 32 & 0xffff) as i64 - 98302 + offset
            };
            out.push(v as f32 * scale);
        }
    }
    out
}

/// Byte offsets of the f16 scale fields in each block (ggml-common.h).
fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q8_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

fn finite_f16(h: u16) -> u16 {
    if h & 0x7c00 == 0x7c00 { h & 0x83ff } else { h }
}

/// Random blocks rebuilt bit for bit from the generator's `bulk_random_blocks`.
pub fn bulk_random_blocks(seed: u64, ty: GgmlType, n_bytes: usize) -> AlignedBytes {
    let mut rng = Rng::new(seed);
    let bytes: Vec<u8> = (0..n_bytes.div_ceil(8)).flat_map(|_| rng.next_u64().to_le_bytes()).take(n_bytes).collect();
    let mut out = AlignedBytes::new(&bytes);
    let raw = out.as_mut();
    let u16_at = |raw: &[u8], at: usize| u16::from_le_bytes([raw[at], raw[at + 1]]);
    let u32_at = |raw: &[u8], at: usize| u32::from_le_bytes(raw[at..at + 4].try_into().unwrap());
    match ty {
        GgmlType::F32 => {
            for at in (0..n_bytes).step_by(4) {
                let u = u32_at(raw, at);
                let u = if u & 0x7f80_0000 == 0x7f80_0000 { u & 0xbfff_ffff } else { u };
                raw[at..at + 4].copy_from_slice(&u.to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for at in (0..n_bytes).step_by(2) {
                let h = u16_at(raw, at);
                let h = match ty {
                    GgmlType::F16 => finite_f16(h),
                    _ if h & 0x7f80 == 0x7f80 => h & 0xbfff,
                    _ => h,
                };
                raw[at..at + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        _ => {
            for block in (0..n_bytes).step_by(ty.type_size() as usize) {
                for &off in f16_scale_offsets(ty) {
                    let h = finite_f16(u16_at(raw, block + off));
                    raw[block + off..block + off + 2].copy_from_slice(&h.to_le_bytes());
                }
                if ty == GgmlType::Q8_K {
                    let u = u32_at(raw, block);
                    let e = u >> 23 & 0xff;
                    let e = if !(100..=150).contains(&e) { 100 + e % 51 } else { e };
                    raw[block..block + 4].copy_from_slice(&((u & 0x807f_ffff) | e << 23).to_le_bytes());
                }
            }
        }
    }
    out
}

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
