//! Q2_K, Q3_K, Q4_K, Q5_K and Q6_K: 256-element super-blocks with group scales, against Q8_K
//! activations.
//!
//! Every format is unpacked 32 elements at a time to unsigned bytes (`maddubs` needs one
//! unsigned side), the pair sums are multiplied by the group scales with `madd`, and what the
//! unsigned form adds (an offset, or the format's mins) is taken back once per super-block from
//! the activations' group sums (`bsums`), as llama.cpp's x86 code does for Q6_K.

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::marker::PhantomData;

    use crate::activations::ARow;
    use crate::dispatch::RowsDot;
    use crate::simd::{Dot, bcast_f16, hsum_ps, loadu, prefetch_ahead, read_u32};

    /// Per-row, per-super-block data decoded before the quants.
    #[derive(Clone, Copy)]
    pub(crate) struct Prep {
        /// Group scales in i16 lanes: 16 (groups of 16), or 8 repeated in each half (groups of 32).
        pub scales: __m256i,
        /// What to subtract per group of 16, in i16 lanes, times the activations' `bsums`.
        pub corr: __m256i,
        pub d: __m256,
        /// Factor of the correction for formats with mins.
        pub dmin: __m256,
        /// High bits (`hmask` or `qh`) where the format has them.
        pub high: __m256i,
    }

    impl Prep {
        /// All lanes zero (what rows past the end of a panel use).
        pub fn zeroed() -> Prep {
            // SAFETY: vectors of all-zero bits are valid.
            unsafe { std::mem::zeroed() }
        }
    }

    /// How a batch panel gets a k-quant block's codes (`panel.rs`).
    pub(crate) enum KCodes {
        /// Chunk by chunk, from [`KFormat::chunk`].
        Chunks,
        /// 4-bit codes at this offset, 32 bytes per 64 elements: the first 32 in the low
        /// nibbles and the next 32 in the high ones (Q4_K); transposed while packed.
        Nibbles(usize),
        /// Q6_K's low nibbles and high bit pairs, transposed while packed.
        Q6K,
    }

    /// A k-quant format.
    pub(crate) trait KFormat {
        const BYTES: usize;
        /// The correction is an offset scaled by `d` (Q3_K, Q6_K), not mins scaled by `dmin`.
        const OFFSET: bool;
        /// # Safety
        /// Needs AVX2, FMA and F16C; `p` points at a whole block.
        unsafe fn prepare(p: *const u8) -> Prep;
        /// Elements `32 j .. 32 j + 32` as unsigned bytes, and their group scales in i16 lanes.
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C (and what `I` needs); `p` points at the whole block `prep` was made from; `j < 8`.
        unsafe fn chunk<I: Dot>(p: *const u8, prep: &Prep, j: usize) -> (__m256i, __m256i);
        /// Elements per group scale: 16 or 32.
        const GROUP: usize;
        /// The largest unsigned code [`KFormat::chunk`] returns.
        const MAX_UNSIGNED: u8;
        /// How a panel is built from a block's codes.
        const CODES: KCodes = KCodes::Chunks;
        /// The group scales (the first `256 / GROUP`).
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C.
        #[inline(always)]
        unsafe fn group_scales(prep: &Prep) -> [i32; 16] {
            let mut out = [0i32; 16];
            unsafe {
                if Self::GROUP == 16 {
                    let high = _mm256_extracti128_si256::<1>(prep.scales);
                    _mm256_storeu_si256(
                        out.as_mut_ptr().cast(),
                        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(prep.scales)),
                    );
                    _mm256_storeu_si256(out[8..].as_mut_ptr().cast(), _mm256_cvtepi16_epi32(high));
                } else {
                    _mm256_storeu_si256(
                        out.as_mut_ptr().cast(),
                        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(prep.scales)),
                    );
                }
            }
            out
        }
    }

    pub(crate) struct Q2K;
    pub(crate) struct Q3K;
    pub(crate) struct Q4K;
    pub(crate) struct Q5K;
    pub(crate) struct Q6K;

    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn shift_right_16(v: __m256i, n: usize) -> __m256i {
        unsafe { _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32)) }
    }

    /// Scale of group `j` in all lanes, from 8 i16 in each half.
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn group_scale(scales: __m256i, j: usize) -> __m256i {
        unsafe { _mm256_shuffle_epi8(scales, _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16)) }
    }

    /// Two bits at `shift` of each byte.
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn two_bits(v: __m256i, shift: usize) -> __m256i {
        unsafe { _mm256_and_si256(shift_right_16(v, shift), _mm256_set1_epi8(3)) }
    }

    /// Bit `bit` of each byte, moved to `to`.
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn one_bit(v: __m256i, bit: usize, to: i32) -> __m256i {
        unsafe {
            let b = _mm256_and_si256(shift_right_16(v, bit), _mm256_set1_epi8(1));
            _mm256_sll_epi16(b, _mm_cvtsi32_si128(to))
        }
    }

    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn nibble(v: __m256i, high: bool) -> __m256i {
        unsafe {
            let v = if high { _mm256_srli_epi16::<4>(v) } else { v };
            _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
        }
    }

    impl KFormat for Q2K {
        const BYTES: usize = 84;
        const OFFSET: bool = false;
        const GROUP: usize = 16;
        const MAX_UNSIGNED: u8 = 3;
        #[inline(always)]
        unsafe fn prepare(p: *const u8) -> Prep {
            unsafe {
                let raw = _mm_loadu_si128(p.cast());
                let mask = _mm_set1_epi8(0x0f);
                let mins = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
                Prep {
                    scales: _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask)),
                    corr: _mm256_cvtepu8_epi16(mins),
                    d: bcast_f16(p.add(80)),
                    dmin: bcast_f16(p.add(82)),
                    high: _mm256_setzero_si256(),
                }
            }
        }
        #[inline(always)]
        unsafe fn chunk<I: Dot>(p: *const u8, prep: &Prep, j: usize) -> (__m256i, __m256i) {
            unsafe {
                let q = two_bits(loadu(p.add(16 + 32 * (j / 4))), 2 * (j % 4));
                (q, I::pair_lanes(prep.scales, j))
            }
        }
    }

    impl KFormat for Q3K {
        const BYTES: usize = 110;
        const OFFSET: bool = true;
        const GROUP: usize = 16;
        const MAX_UNSIGNED: u8 = 7;
        #[inline(always)]
        unsafe fn prepare(p: *const u8) -> Prep {
            unsafe {
                // Low 4 bits: bytes 0..8, low nibbles for groups 0..8, high nibbles for 8..16.
                let packed = _mm_loadl_epi64(p.add(96).cast());
                let mask = _mm_set1_epi8(0x0f);
                let low =
                    _mm_unpacklo_epi64(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16::<4>(packed), mask));
                // High 2 bits: group g in byte 8 + g % 4 at bit 2 (g / 4).
                let high_bytes = _mm_set1_epi32(read_u32(p.add(104)) as i32);
                let high = _mm_and_si128(_mm_srlv_epi32(high_bytes, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
                let scales = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16::<4>(high)), _mm_set1_epi8(32));
                let scales = _mm256_cvtepi8_epi16(scales);
                Prep {
                    scales,
                    // Quants are stored as level + 4.
                    corr: _mm256_slli_epi16::<2>(scales),
                    d: bcast_f16(p.add(108)),
                    dmin: _mm256_setzero_ps(),
                    high: loadu(p),
                }
            }
        }
        #[inline(always)]
        unsafe fn chunk<I: Dot>(p: *const u8, prep: &Prep, j: usize) -> (__m256i, __m256i) {
            unsafe {
                let low = two_bits(loadu(p.add(32 + 32 * (j / 4))), 2 * (j % 4));
                let q = _mm256_or_si256(low, one_bit(prep.high, j, 2));
                (q, I::pair_lanes(prep.scales, j))
            }
        }
    }

    /// The 8 six-bit scales and mins of Q4_K and Q5_K, as bytes (ts-quant `scale_min_k4`).
    ///
    /// # Safety
    /// Needs AVX2; `p` points at 12 readable bytes.
    #[inline(always)]
    pub(crate) unsafe fn scales_mins_k4(p: *const u8) -> (__m128i, __m128i) {
        unsafe {
            let (a, b, c) = (read_u32(p), read_u32(p.add(4)), read_u32(p.add(8)));
            let six = 0x3f3f_3f3f;
            let top = |x: u32| ((x >> 6) & 0x0303_0303) << 4;
            let scales_hi = (c & 0x0f0f_0f0f) | top(a);
            let mins_hi = ((c >> 4) & 0x0f0f_0f0f) | top(b);
            let scales = _mm_set_epi32(0, 0, scales_hi as i32, (a & six) as i32);
            let mins = _mm_set_epi32(0, 0, mins_hi as i32, (b & six) as i32);
            (scales, mins)
        }
    }

    /// # Safety
    /// Needs AVX2, FMA and F16C; `p` points at a whole Q4_K or Q5_K block.
    #[inline(always)]
    unsafe fn prepare_k4(p: *const u8, high: __m256i) -> Prep {
        unsafe {
            let (scales, mins) = scales_mins_k4(p.add(4));
            Prep {
                scales: _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales)),
                // One min per group of 32 covers two groups of 16.
                corr: _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins)),
                d: bcast_f16(p),
                dmin: bcast_f16(p.add(2)),
                high,
            }
        }
    }

    impl KFormat for Q4K {
        const BYTES: usize = 144;
        const OFFSET: bool = false;
        const GROUP: usize = 32;
        const MAX_UNSIGNED: u8 = 15;
        const CODES: KCodes = KCodes::Nibbles(16);
        #[inline(always)]
        unsafe fn prepare(p: *const u8) -> Prep {
            unsafe { prepare_k4(p, _mm256_setzero_si256()) }
        }
        #[inline(always)]
        unsafe fn chunk<I: Dot>(p: *const u8, prep: &Prep, j: usize) -> (__m256i, __m256i) {
            unsafe {
                let q = nibble(loadu(p.add(16 + 32 * (j / 2))), j % 2 == 1);
                (q, group_scale(prep.scales, j))
            }
        }
    }

    impl KFormat for Q5K {
        const BYTES: usize = 176;
        const OFFSET: bool = false;
        const GROUP: usize = 32;
        const MAX_UNSIGNED: u8 = 31;
        #[inline(always)]
        unsafe fn prepare(p: *const u8) -> Prep {
            unsafe { prepare_k4(p, loadu(p.add(16))) }
        }
        #[inline(always)]
        unsafe fn chunk<I: Dot>(p: *const u8, prep: &Prep, j: usize) -> (__m256i, __m256i) {
            unsafe {
                let low = nibble(loadu(p.add(48 + 32 * (j / 2))), j % 2 == 1);
                let q = _mm256_or_si256(low, one_bit(prep.high, j, 4));
                (q, group_scale(prep.scales, j))
            }
        }
    }

    impl KFormat for Q6K {
        const BYTES: usize = 210;
        const OFFSET: bool = true;
        const GROUP: usize = 16;
        const MAX_UNSIGNED: u8 = 63;
        const CODES: KCodes = KCodes::Q6K;
        #[inline(always)]
        unsafe fn prepare(p: *const u8) -> Prep {
            unsafe {
                let scales = _mm_loadu_si128(p.add(192).cast());
                let scales = _mm256_cvtepi8_epi16(scales);
                Prep {
                    scales,
                    // Quants are stored as level + 32.
                    corr: _mm256_slli_epi16::<5>(scales),
                    d: bcast_f16(p.add(208)),
                    dmin: _mm256_setzero_ps(),
                    high: _mm256_setzero_si256(),
                }
            }
        }
        #[inline(always)]
        unsafe fn chunk<I: Dot>(p: *const u8, prep: &Prep, j: usize) -> (__m256i, __m256i) {
            unsafe {
                // Rows k = 0..4 of each half: low nibbles of ql[32 (k % 2)..] (k < 2) or high
                // nibbles (k >= 2); two bits at 2 k of qh.
                let (half, k) = (j / 4, j % 4);
                let low = nibble(loadu(p.add(64 * half + 32 * (k % 2))), k >= 2);
                let high = two_bits(loadu(p.add(128 + 32 * half)), 2 * k);
                let q = _mm256_or_si256(low, _mm256_slli_epi16::<4>(high));
                (q, I::pair_lanes(prep.scales, j))
            }
        }
    }

    /// The direct kernel for k-quant format `F` on instruction set `I`.
    pub(crate) struct KQuant<F, I>(PhantomData<(F, I)>);

    impl<F: KFormat, I: Dot> RowsDot for KQuant<F, I> {
        #[inline(always)]
        unsafe fn dot<const R: usize, const C: usize>(
            w: *const u8,
            row_bytes: usize,
            a: &[ARow; C],
            nb: usize,
        ) -> [[f32; C]; R] {
            unsafe { dot::<F, I, R, C>(w, row_bytes, a, nb) }
        }
    }

    /// Bytes of a Q8_K block; its quants start at 4, its group sums at 260.
    pub(crate) const Q8K_BYTES: usize = 292;

    /// `R` weight rows (`row_bytes` apart, `nb` super-blocks each) times `C` activation rows.
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C (and AVX-512 VNNI for `I = Vnni`); the rows must hold `nb`
    /// super-blocks.
    #[inline(always)]
    unsafe fn dot<F: KFormat, I: Dot, const R: usize, const C: usize>(
        w: *const u8,
        row_bytes: usize,
        a: &[ARow; C],
        nb: usize,
    ) -> [[f32; C]; R] {
        unsafe {
            let zero = _mm256_setzero_si256();
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            for b in 0..nb {
                for r in 0..R {
                    prefetch_ahead(w.add(r * row_bytes + b * F::BYTES), F::BYTES);
                }
                let mut prep = [Prep::zeroed(); R];
                for (r, prep) in prep.iter_mut().enumerate() {
                    *prep = F::prepare(w.add(r * row_bytes + b * F::BYTES));
                }
                let mut sums = [[zero; C]; R];
                for j in 0..8 {
                    let mut q = [zero; R];
                    let mut scales = [zero; R];
                    for r in 0..R {
                        (q[r], scales[r]) = F::chunk::<I>(w.add(r * row_bytes + b * F::BYTES), &prep[r], j);
                    }
                    for c in 0..C {
                        let av = loadu(a[c].q.add(b * Q8K_BYTES + 4 + 32 * j));
                        for r in 0..R {
                            sums[r][c] = I::dpwssd(sums[r][c], _mm256_maddubs_epi16(q[r], av), scales[r]);
                        }
                    }
                }
                for c in 0..C {
                    let block = a[c].q.add(b * Q8K_BYTES);
                    let da = _mm256_set1_ps(block.cast::<f32>().read_unaligned());
                    let bsums = loadu(block.add(260));
                    for r in 0..R {
                        let corr = _mm256_madd_epi16(prep[r].corr, bsums);
                        let d = _mm256_mul_ps(prep[r].d, da);
                        if F::OFFSET {
                            let total = _mm256_sub_epi32(sums[r][c], corr);
                            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), d, acc[r][c]);
                        } else {
                            let dmin = _mm256_mul_ps(prep[r].dmin, da);
                            acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][c]), d, acc[r][c]);
                            acc[r][c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), dmin, acc[r][c]);
                        }
                    }
                }
            }
            let mut out = [[0.0f32; C]; R];
            for r in 0..R {
                for c in 0..C {
                    out[r][c] = hsum_ps(acc[r][c]);
                }
            }
            out
        }
    }
}
