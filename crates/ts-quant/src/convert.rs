//! Scalar conversions shared by the formats, each matching ggml's bit for bit.

use half::f16;

/// f32 to f16, rounding to nearest even. NaN becomes the quiet NaN `0x7e00` with the input's
/// sign, as `ggml_compute_fp32_to_fp16` (ggml-impl.h) does.
pub fn f32_to_f16(x: f32) -> f16 {
    if x.is_nan() {
        let sign = ((x.to_bits() >> 16) & 0x8000) as u16;
        return f16::from_bits(sign | 0x7e00);
    }
    f16::from_f32(x)
}

/// f32 to bf16 bits, rounding to nearest even, NaN forced quiet (ggml_compute_fp32_to_bf16).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x40) as u16;
    }
    (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The element of largest magnitude (the first on ties) and that magnitude, as the ggml
/// quantizers find it.
pub fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

/// Round to nearest, ties to even, by adding 1.5 * 2^23 (ggml-quants.c `nearest_int`).
/// Meant for |x| < 2^22, like the original; larger inputs give the same garbage as ggml's.
pub fn nearest_int(x: f32) -> i32 {
    let shifted = x + 12_582_912.0;
    (shifted.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Half of the E8M0 scale `2^(e - 127)`, as a float built from bits; MXFP4 codes are stored
/// doubled (ggml-impl.h `ggml_e8m0_to_fp32_half`).
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e - 1) as u32) << 23 };
    f32::from_bits(bits)
}

/// E2M1 values doubled, indexed by the 4-bit MXFP4 code (ggml-common.h `kvalues_mxfp4`).
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-2.6), -3);
        assert_eq!(nearest_int(31.49), 31);
    }

    #[test]
    fn bf16_rounds_to_nearest_even_and_quiets_nan() {
        assert_eq!(f32_to_bf16_bits(1.0), 0x3f80);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x7f80_0001)), 0x7fc0);
    }

    #[test]
    fn e8m0_half_covers_subnormals() {
        assert_eq!(e8m0_to_f32_half(127), 0.5);
        assert_eq!(e8m0_to_f32_half(0), 2f64.powi(-128) as f32);
        assert_eq!(e8m0_to_f32_half(1), 2f64.powi(-127) as f32);
    }
}
