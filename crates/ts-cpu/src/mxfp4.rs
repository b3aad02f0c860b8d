//! MXFP4: 32 E2M1 codes with a power-of-two scale, against Q8_0 activations. The codes are
//! looked up (`pshufb`) as doubled E2M1 values plus 16, small unsigned integers, and run through
//! the legacy kernels like Q5_0.

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

/// E2M1 values doubled, by 4-bit code (ggml-common.h `kvalues_mxfp4`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of the E8M0 scale `2^(e - 127)`, built from bits as ggml-impl.h
/// `ggml_e8m0_to_fp32_half` does (values are stored doubled); the reference for the vector
/// version in the kernels.
#[cfg(test)]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e - 1) as u32) << 23 };
    f32::from_bits(bits)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::VALUES;
    use crate::legacy::Format;
    use crate::simd::{Dot, nibbles};

    pub(crate) struct Mxfp4;

    impl Format for Mxfp4 {
        const BYTES: usize = 17;
        const OFFSET_LOG2: Option<i32> = Some(4);
        const MAX_UNSIGNED: u8 = 28;
        const NIBBLES: Option<(usize, Option<[u8; 16]>)> = Some((1, Some(UNSIGNED_VALUES)));
        #[inline(always)]
        unsafe fn scales_strided(p: *const u8, stride: usize, n: usize) -> __m256 {
            unsafe {
                let mut bytes = 0u64;
                for i in 0..n {
                    bytes |= (*p.add(i * stride) as u64) << (8 * i);
                }
                // Kept in a general register: LLVM would otherwise insert byte by byte.
                let bytes = std::hint::black_box(bytes);
                let e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64));
                let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes);
                _mm256_and_ps(e8m0_half_lanes(e), _mm256_castsi256_ps(live))
            }
        }
        #[inline(always)]
        unsafe fn unsigned_values<I: Dot>(p: *const u8) -> __m256i {
            unsafe {
                let table = _mm_loadu_si128(UNSIGNED_VALUES.as_ptr().cast());
                _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), nibbles(p.add(1)))
            }
        }
    }

    /// `e8m0_half` of each 32-bit lane's exponent byte: `(e - 1) << 23` as float bits, or
    /// `0x200000 << e` below 2.
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    pub(crate) unsafe fn e8m0_half_lanes(e: __m256i) -> __m256 {
        unsafe {
            let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
            let tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
            let is_normal = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(1));
            _mm256_castsi256_ps(_mm256_blendv_epi8(tiny, normal, is_normal))
        }
    }

    /// [`VALUES`] plus 16.
    pub(crate) const UNSIGNED_VALUES: [u8; 16] = {
        let mut out = [0u8; 16];
        let mut i = 0;
        while i < 16 {
            out[i] = (VALUES[i] + 16) as u8;
            i += 1;
        }
        out
    };
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use std::arch::x86_64::*;

    use super::e8m0_half;
    use super::x86::Mxfp4;
    use crate::legacy::Format;

    #[test]
    fn vector_scales_match_e8m0_half() {
        assert!(crate::Isa::Avx2.is_available(), "this test checks the AVX2 path: the machine has no AVX2");
        for e0 in (0..=255u8).step_by(8) {
            let blocks: Vec<u8> = (0..8).flat_map(|i| [e0 + i].into_iter().chain([0u8; 16])).collect();
            let mut got = [0.0f32; 8];
            // SAFETY: AVX2 is available and `blocks` holds 8 blocks.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), Mxfp4::scales(blocks.as_ptr(), 8)) };
            for (i, got) in got.iter().enumerate() {
                assert_eq!(got.to_bits(), e8m0_half(e0 + i as u8).to_bits(), "e = {}", e0 + i as u8);
            }
        }
    }
}
