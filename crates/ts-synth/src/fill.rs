//! Random tensor data without quantizing anything: random bytes for the quants, then each
//! block's scale fields set so that the dequantized values have the wanted spread and a
//! mean of zero (or, for token embeddings, a chosen mean per group of 32 elements).

use crate::SynthError;
use crate::rng::{Rng, derive};
use half::f16;
use rayon::prelude::*;
use ts_gguf::GgmlType;

/// Bytes generated per task; whole blocks, each task seeded by its index, so the output
/// does not depend on the number of threads.
const CHUNK_BYTES: usize = 1 << 20;

/// Root mean square of `q - 8`, q uniform in 0..16.
const RMS_Q4: f64 = 4.636_809_247_747_852; // sqrt(21.5)
/// Root mean square of `q - 16`, q uniform in 0..32.
const RMS_Q5: f64 = 9.246_621_004_453_464; // sqrt(85.5)
/// Standard deviation of q uniform in 0..16 (Q4_K) and 0..32 (Q5_K, Q6_K embeddings).
const SD_U4: f64 = 4.609_772_228_646_444; // sqrt(21.25)
const SD_U5: f64 = 9.233_092_656_309_694; // sqrt(85.25)
/// Root mean square of `q - 32`, q uniform in 0..64.
const RMS_Q6: f64 = 18.479_718_612_576_28; // sqrt(341.5)
/// Root mean square of a random `i8` with -128 replaced by 0.
const RMS_I8: f64 = 73.467_680_651_484_23; // sqrt(5397.5)
/// Standard deviation of a random `i8` shifted right by one (-64..64).
const SD_I7: f64 = 36.949_289_573_686_87; // sqrt(1365.25)
/// Root mean square of the MXFP4 code values (twice E2M1, as ggml stores them).
const RMS_MXFP4: f64 = 5.852_349_955_359_813; // sqrt(34.25)
/// The group scale of the k-quants written here (a 6-bit field).
const K_SCALE: u8 = 16;
/// The Q6_K group scale magnitude; its sign is random per group of 16.
const Q6_SCALE: i8 = 4;

/// Packs 6-bit group scales and mins as ggml's `get_scale_min_k4` reads them.
pub fn pack_scale_min_k4(scale: [u8; 8], min: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (scale[j] & 63) | ((scale[j + 4] >> 4) << 6);
        q[j + 4] = (min[j] & 63) | ((min[j + 4] >> 4) << 6);
        q[j + 8] = (scale[j + 4] & 0x0f) | ((min[j + 4] & 0x0f) << 4);
    }
    q
}

/// The 16-byte head (`d`, `dmin`, scales) of a Q4_K or Q5_K block.
fn k_head(d: f16, dmin: f16, min: [u8; 8]) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..2].copy_from_slice(&d.to_le_bytes());
    h[2..4].copy_from_slice(&dmin.to_le_bytes());
    h[4..16].copy_from_slice(&pack_scale_min_k4([K_SCALE; 8], min));
    h
}

/// How the scale fields of zero-mean random weights are set, per type.
#[derive(Clone, Debug)]
pub enum WeightCodec {
    F32 {
        std: f32,
    },
    F16 {
        std: f32,
    },
    /// `x = ±d·(q − 8)`: a random sign per block cancels the −0.5 mean of `q − 8`.
    Q4_0 {
        d: f16,
    },
    /// `x = ±d·(q − 16)`, q a random 5-bit value; as Q4_0, a random sign per block.
    Q5_0 {
        d: f16,
    },
    /// `x = d·q` with q a random `i8`, −128 replaced by 0 so the mean is zero.
    Q8_0 {
        d: f16,
    },
    /// Q4_K and Q5_K: one head for every block, scale 16 and min 16 per group, and
    /// `dmin = d·(levels − 1)/2`, so `d·16·q − dmin·16` is centred.
    KQuant {
        head: [u8; 16],
    },
    /// `x = d·(±4)·(q − 32)` with a random sign per group of 16.
    Q6K {
        d: f16,
    },
    /// `x = code·2^(e−128)`; e is `e_low + 1` in a fraction `threshold/256` of the blocks,
    /// else `e_low`, so the mean square is the wanted one.
    Mxfp4 {
        e_low: u8,
        threshold: u16,
    },
}

/// The types [`WeightCodec`] writes.
pub const WEIGHT_TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::MXFP4,
];

impl WeightCodec {
    /// Scale fields for values of standard deviation `std`.
    pub fn new(ty: GgmlType, std: f64) -> Result<WeightCodec, SynthError> {
        Ok(match ty {
            GgmlType::F32 => WeightCodec::F32 { std: std as f32 },
            GgmlType::F16 => WeightCodec::F16 { std: std as f32 },
            GgmlType::Q4_0 => WeightCodec::Q4_0 { d: f16::from_f64(std / RMS_Q4) },
            GgmlType::Q5_0 => WeightCodec::Q5_0 { d: f16::from_f64(std / RMS_Q5) },
            GgmlType::Q8_0 => WeightCodec::Q8_0 { d: f16::from_f64(std / RMS_I8) },
            GgmlType::Q4_K => {
                let d = f16::from_f64(std / (K_SCALE as f64 * SD_U4));
                WeightCodec::KQuant { head: k_head(d, f16::from_f64(d.to_f64() * 7.5), [K_SCALE; 8]) }
            }
            GgmlType::Q5_K => {
                let d = f16::from_f64(std / (K_SCALE as f64 * SD_U5));
                WeightCodec::KQuant { head: k_head(d, f16::from_f64(d.to_f64() * 15.5), [K_SCALE; 8]) }
            }
            GgmlType::Q6_K => WeightCodec::Q6K { d: f16::from_f64(std / (Q6_SCALE as f64 * RMS_Q6)) },
            GgmlType::MXFP4 => {
                let scale = std / RMS_MXFP4;
                let e = scale.log2().floor();
                let low = e.exp2();
                let p = ((scale / low).powi(2) - 1.0) / 3.0;
                WeightCodec::Mxfp4 { e_low: (e + 128.0) as u8, threshold: (p * 256.0).round() as u16 }
            }
            other => {
                return Err(SynthError::Internal(format!("random {other} weights are not implemented")));
            }
        })
    }

    /// Fills `out` (whole blocks of `ty`) from stream `seed`.
    pub fn fill(&self, ty: GgmlType, seed: u64, out: &mut [u8]) {
        let block = ty.type_size() as usize;
        let chunk = (CHUNK_BYTES / block).max(1) * block;
        out.par_chunks_mut(chunk).enumerate().for_each(|(i, piece)| {
            let mut rng = Rng::new(derive(seed, i as u64));
            match self {
                WeightCodec::F32 { std } => {
                    for v in piece.chunks_exact_mut(4) {
                        v.copy_from_slice(&((rng.normal() as f32) * std).to_le_bytes());
                    }
                }
                WeightCodec::F16 { std } => {
                    for v in piece.chunks_exact_mut(2) {
                        v.copy_from_slice(&f16::from_f32(rng.normal() as f32 * std).to_le_bytes());
                    }
                }
                _ => {
                    rng.fill(piece);
                    self.set_scales(piece, block);
                }
            }
        });
    }

    /// Writes the scale fields of every block of `piece`, taking random signs and choices
    /// from the random bytes they replace.
    fn set_scales(&self, piece: &mut [u8], block: usize) {
        match *self {
            WeightCodec::F32 { .. } | WeightCodec::F16 { .. } => {}
            WeightCodec::Q4_0 { d } | WeightCodec::Q5_0 { d } => {
                let (plus, minus) = (d.to_le_bytes(), (-d).to_le_bytes());
                for b in piece.chunks_exact_mut(block) {
                    let d = if b[0] & 1 == 0 { plus } else { minus };
                    b[..2].copy_from_slice(&d);
                }
            }
            WeightCodec::Q8_0 { d } => {
                for b in piece.chunks_exact_mut(block) {
                    b[..2].copy_from_slice(&d.to_le_bytes());
                    for q in &mut b[2..] {
                        if *q == 0x80 {
                            *q = 0;
                        }
                    }
                }
            }
            WeightCodec::KQuant { head } => {
                for b in piece.chunks_exact_mut(block) {
                    b[..16].copy_from_slice(&head);
                }
            }
            WeightCodec::Q6K { d } => {
                for b in piece.chunks_exact_mut(block) {
                    // ql[128], qh[64], scales[16], d
                    for s in &mut b[192..208] {
                        *s = if *s & 1 == 0 { Q6_SCALE as u8 } else { (-Q6_SCALE) as u8 };
                    }
                    b[208..210].copy_from_slice(&d.to_le_bytes());
                }
            }
            WeightCodec::Mxfp4 { e_low, threshold } => {
                for b in piece.chunks_exact_mut(block) {
                    b[0] = if (b[0] as u16) < threshold { e_low + 1 } else { e_low };
                }
            }
        }
    }
}

/// Token embeddings: each row is a common vector, constant over groups of 32 elements,
/// plus the row's own zero-mean random part.
#[derive(Clone, Debug)]
pub struct EmbeddingCodec {
    kind: EmbeddingKind,
    /// The mean of element j over rows (the common vector), as the type stores it.
    pub mean: Vec<f32>,
}

#[derive(Clone, Debug)]
enum EmbeddingKind {
    F32 {
        std: f32,
    },
    /// `x = d·((r >> 1) + offset[group])`, r a random `i8`.
    Q8_0 {
        d: f16,
        offsets: Vec<i8>,
    },
    /// One head per super-block of a row; the mins set each group's mean.
    Q4K {
        heads: Vec<[u8; 16]>,
    },
    /// `x = d·4·(q − 32)` with `q = (r & 31) + base + [r >> 5 < eighths]`, r a random
    /// byte and `(base, eighths)` the group's offset in steps of 1/8.
    Q6K {
        d: f16,
        offsets: Vec<(u8, u8)>,
    },
}

/// The types [`EmbeddingCodec`] writes.
pub const EMBEDDING_TYPES: [GgmlType; 4] = [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];

impl EmbeddingCodec {
    /// Rows of `n_embd` elements: random part of standard deviation `std`, and the mean
    /// `level[g]` on group g of 32 elements (as close as the type allows).
    pub fn new(ty: GgmlType, n_embd: usize, std: f64, level: &[f64]) -> Result<EmbeddingCodec, SynthError> {
        assert_eq!(level.len() * 32, n_embd);
        let (kind, mean) = match ty {
            GgmlType::F32 => {
                let mean = level.iter().flat_map(|&l| [l as f32; 32]).collect();
                (EmbeddingKind::F32 { std: std as f32 }, mean)
            }
            GgmlType::Q8_0 => {
                let d = f16::from_f64(std / SD_I7);
                let offsets: Vec<i8> =
                    level.iter().map(|&l| (l / d.to_f64()).round().clamp(-63.0, 63.0) as i8).collect();
                // (r >> 1) is uniform in -64..64, mean -0.5.
                let mean = offsets.iter().flat_map(|&o| [(d.to_f32() * (o as f32 - 0.5)); 32]).collect();
                (EmbeddingKind::Q8_0 { d, offsets }, mean)
            }
            GgmlType::Q4_K => {
                if !n_embd.is_multiple_of(256) {
                    return Err(SynthError::Internal(format!("Q4_K embeddings need n_embd % 256 == 0, got {n_embd}")));
                }
                let d = f16::from_f64(std / (K_SCALE as f64 * SD_U4));
                let d1 = d.to_f32() * K_SCALE as f32;
                let centre = d1 as f64 * 7.5;
                let top = level.iter().fold(0f64, |m, l| m.max(l.abs()));
                if top > centre {
                    return Err(SynthError::Internal(format!(
                        "Q4_K embedding mean {top} is beyond what the mins reach ({centre})"
                    )));
                }
                let dmin = f16::from_f64((centre + top) / 63.0);
                let mut heads = Vec::new();
                let mut mean = Vec::with_capacity(n_embd);
                for groups in level.chunks_exact(8) {
                    let min: [u8; 8] =
                        std::array::from_fn(|g| ((centre - groups[g]) / dmin.to_f64()).round().clamp(0.0, 63.0) as u8);
                    for &m in &min {
                        // ggml: y = (d·scale)·q − (dmin·min), q uniform in 0..16.
                        let m1 = dmin.to_f32() * m as f32;
                        mean.extend([(d1 as f64 * 7.5 - m1 as f64) as f32; 32]);
                    }
                    heads.push(k_head(d, dmin, min));
                }
                (EmbeddingKind::Q4K { heads }, mean)
            }
            GgmlType::Q6_K => {
                if !n_embd.is_multiple_of(256) {
                    return Err(SynthError::Internal(format!("Q6_K embeddings need n_embd % 256 == 0, got {n_embd}")));
                }
                let d = f16::from_f64(std / (Q6_SCALE as f64 * SD_U5));
                let step = d.to_f64() * Q6_SCALE as f64;
                // q − 32 has mean base + eighths/8 − 16.5 (r & 31 is uniform in 0..32).
                let offsets: Vec<(u8, u8)> = level
                    .iter()
                    .map(|&l| {
                        let eighths = ((l / step + 16.5) * 8.0).round().clamp(0.0, 256.0) as u16;
                        ((eighths / 8) as u8, (eighths % 8) as u8)
                    })
                    .collect();
                let mean = offsets
                    .iter()
                    .flat_map(|&(b, e)| [(step * (b as f64 + e as f64 / 8.0 - 16.5)) as f32; 32])
                    .collect();
                (EmbeddingKind::Q6K { d, offsets }, mean)
            }
            other => return Err(SynthError::Internal(format!("{other} embeddings are not implemented"))),
        };
        Ok(EmbeddingCodec { kind, mean })
    }

    /// Fills `out` (whole rows) from stream `seed`.
    pub fn fill(&self, ty: GgmlType, seed: u64, out: &mut [u8]) {
        let block = ty.type_size() as usize;
        let per_block = ty.block_size() as usize;
        let row_blocks = self.mean.len() / per_block;
        let blocks_per_chunk = (CHUNK_BYTES / block).max(1);
        out.par_chunks_mut(blocks_per_chunk * block).enumerate().for_each(|(i, piece)| {
            let mut rng = Rng::new(derive(seed, i as u64));
            let first = i * blocks_per_chunk;
            match &self.kind {
                EmbeddingKind::F32 { std } => {
                    let n = self.mean.len();
                    for (j, v) in piece.chunks_exact_mut(4).enumerate() {
                        let x = self.mean[(first + j) % n] + rng.normal() as f32 * std;
                        v.copy_from_slice(&x.to_le_bytes());
                    }
                }
                EmbeddingKind::Q8_0 { d, offsets } => {
                    rng.fill(piece);
                    for (j, b) in piece.chunks_exact_mut(block).enumerate() {
                        let offset = offsets[(first + j) % row_blocks];
                        b[..2].copy_from_slice(&d.to_le_bytes());
                        for q in &mut b[2..] {
                            *q = (((*q as i8) >> 1) + offset) as u8;
                        }
                    }
                }
                EmbeddingKind::Q4K { heads } => {
                    rng.fill(piece);
                    for (j, b) in piece.chunks_exact_mut(block).enumerate() {
                        b[..16].copy_from_slice(&heads[(first + j) % row_blocks]);
                    }
                }
                EmbeddingKind::Q6K { d, offsets } => {
                    let mut q = [0u8; 256];
                    for (j, b) in piece.chunks_exact_mut(block).enumerate() {
                        let groups = &offsets[(first + j) % row_blocks * 8..][..8];
                        rng.fill(&mut q);
                        for (i, q) in q.iter_mut().enumerate() {
                            let (base, eighths) = groups[i / 32];
                            *q = (*q & 31) + base + u8::from(*q >> 5 < eighths);
                        }
                        pack_q6k(&q, b);
                        b[192..208].fill(Q6_SCALE as u8);
                        b[208..210].copy_from_slice(&d.to_le_bytes());
                    }
                }
            }
        });
    }
}

/// Writes 256 six-bit values into a Q6_K block's `ql[128]` and `qh[64]` as
/// ggml's `dequantize_row_q6_K` reads them: per half of 128, element l, l+32,
/// l+64, l+96 share `qh[l]`; low nibbles of l and l+64 share `ql[l]`, of l+32
/// and l+96 `ql[l+32]`.
fn pack_q6k(q: &[u8; 256], block: &mut [u8]) {
    for half in 0..2 {
        let (y, ql, qh) = (&q[128 * half..], 64 * half, 128 + 32 * half);
        for l in 0..32 {
            let (a, b, c, e) = (y[l], y[l + 32], y[l + 64], y[l + 96]);
            block[ql + l] = (a & 15) | ((c & 15) << 4);
            block[ql + l + 32] = (b & 15) | ((e & 15) << 4);
            block[qh + l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_min_packing_matches_ggml() {
        let scale = [1, 17, 33, 63, 0, 16, 40, 63];
        let min = [63, 2, 16, 30, 63, 9, 48, 31];
        let q = pack_scale_min_k4(scale, min);
        // get_scale_min_k4
        for j in 0..8 {
            let (d, m) = if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
            };
            assert_eq!((d, m), (scale[j], min[j]), "group {j}");
        }
    }
}
