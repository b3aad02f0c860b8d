//! x86 building blocks shared by the kernels. Every function here is `#[inline(always)]` so
//! that it is compiled into, and with the target features of, the kernel that calls it.

use std::arch::x86_64::*;

/// How far ahead of the bytes a kernel reads next their row is prefetched. Past a row's end
/// that is the next row's start: a matrix's rows are stored one after another and decode
/// reads them in order. On a 2-core Xeon (AVX-512) one thread's decode of a qwen3 shape went
/// from 12.3 to 21.6 tokens/s (512: 14.7, 4096: 18.6, 32768: 20.4); the hardware prefetcher
/// alone keeps too few lines in flight.
pub(crate) const PREFETCH_AHEAD: usize = 16384;

/// Prefetches into L2 the `len` bytes [`PREFETCH_AHEAD`] past `p` (a hint: addresses past
/// the mapping are harmless). Into L2, not L1: on a 2-core AMD EPYC (Zen 4) the packed Q4_K
/// rows read from memory at 10.7 GB/s with L1 prefetches and 19.8 with L2 ones (one thread,
/// `matmul_bench --packed --head 151936,2048`), and one thread's decode of the qwen3 cut went
/// from 26.2 to 37.3 tokens/s (docs/BENCHMARKS.md; likely the L1 requests took the miss
/// buffers that the loads the kernel waits on need).
///
/// # Safety
/// Needs SSE; `p` points into the weights being read.
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead(p: *const u8, len: usize) {
    unsafe { prefetch_ahead_into::<_MM_HINT_T1>(p, len) }
}

/// [`prefetch_ahead`] into L1, for the packed Q4_0, Q4_1, Q5_0 and Q8_0 passes (Q8_0's decode
/// only where `dispatch::decode_asks_ahead` says, since its scales moved before its quants): on the 2-core
/// AMD EPYC (Zen 4) one thread read a packed Q8_0 head of 201088x2880 from memory at 27-29 GB/s
/// with L1 prefetches against 23-24 with L2 ones (MXFP4's pass, left on L2, 25-26 against
/// 26-27), and one thread's decode of the gpt-oss cut went from 20.4 to 22.2-24.8 tokens/s
/// (docs/BENCHMARKS.md, twenty-first session); 2 threads level. Not yet measured on a Xeon.
///
/// # Safety
/// Needs SSE; `p` points into the weights being read.
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead_l1(p: *const u8, len: usize) {
    unsafe { prefetch_ahead_into::<_MM_HINT_T0>(p, len) }
}

/// Each line of the `len` bytes [`PREFETCH_AHEAD`] past `p`, with `_mm_prefetch`'s `HINT`.
///
/// # Safety
/// Needs SSE.
#[inline(always)]
unsafe fn prefetch_ahead_into<const HINT: i32>(p: *const u8, len: usize) {
    let ahead = p.wrapping_add(PREFETCH_AHEAD);
    for line in (0..len).step_by(64) {
        unsafe { _mm_prefetch::<HINT>(ahead.wrapping_add(line).cast()) };
    }
}

/// The integer dot product step, per instruction set.
pub(crate) trait Dot {
    /// The largest unsigned byte [`Dot::dpbusd`] multiplies exactly by any quantized activation.
    const MAX_UNSIGNED: u8;
    /// `acc` plus, per 32-bit lane, the four products of the unsigned bytes of `u` with the
    /// signed bytes of `s`. The AVX2 form sums pairs in i16 first, which is exact when
    /// `u <= 128` and `|s| <= 127`; every caller stays in that range.
    ///
    /// # Safety
    /// Needs the instruction set of `Self`.
    unsafe fn dpbusd(acc: __m256i, u: __m256i, s: __m256i) -> __m256i;
    /// `acc` plus, per 32-bit lane, the two products of the i16 lanes of `a` and `b`.
    ///
    /// # Safety
    /// Needs the instruction set of `Self`.
    unsafe fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
    /// `v` plus `byte` in byte `i` wherever bit `i` of `bits` is set.
    ///
    /// # Safety
    /// Needs the instruction set of `Self`.
    unsafe fn add_where(v: __m256i, bits: u32, byte: i8) -> __m256i;
    /// From 16 i16 lanes `s`: `s[2 j]` in the low 8 lanes, `s[2 j + 1]` in the high 8.
    ///
    /// # Safety
    /// Needs the instruction set of `Self`; `j < 8`.
    unsafe fn pair_lanes(s: __m256i, j: usize) -> __m256i;
}

/// AVX2 with FMA and F16C.
pub(crate) struct Avx2;

/// AVX-512 VNNI on 256-bit vectors (`vpdpbusd`), with AVX2, FMA and F16C.
pub(crate) struct Vnni;

impl Dot for Avx2 {
    const MAX_UNSIGNED: u8 = 128;
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))) }
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)) }
    }
    #[inline(always)]
    unsafe fn add_where(v: __m256i, bits: u32, byte: i8) -> __m256i {
        unsafe { _mm256_add_epi8(v, _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(byte))) }
    }
    #[inline(always)]
    unsafe fn pair_lanes(s: __m256i, j: usize) -> __m256i {
        unsafe {
            // Both lanes are in one 128-bit half: copy it to both, then pick within each.
            let half = if j < 4 { _mm256_permute4x64_epi64::<0x44>(s) } else { _mm256_permute4x64_epi64::<0xee>(s) };
            let lo = (4 * j % 16) as i16;
            let pick =
                _mm256_set_m128i(_mm_set1_epi16(((lo + 3) << 8) | (lo + 2)), _mm_set1_epi16(((lo + 1) << 8) | lo));
            _mm256_shuffle_epi8(half, pick)
        }
    }
}

impl Dot for Vnni {
    const MAX_UNSIGNED: u8 = 255;
    #[inline(always)]
    unsafe fn dpbusd(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        unsafe { _mm256_dpbusd_epi32(acc, u, s) }
    }
    #[inline(always)]
    unsafe fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_dpwssd_epi32(acc, a, b) }
    }
    #[inline(always)]
    unsafe fn add_where(v: __m256i, bits: u32, byte: i8) -> __m256i {
        unsafe { _mm256_mask_add_epi8(v, bits, v, _mm256_set1_epi8(byte)) }
    }
    #[inline(always)]
    unsafe fn pair_lanes(s: __m256i, j: usize) -> __m256i {
        // vpermw measured slower on Zen 4 than the two AVX2 shuffles.
        unsafe { Avx2::pair_lanes(s, j) }
    }
}

/// # Safety
/// Needs AVX.
#[inline(always)]
pub(crate) unsafe fn hsum_ps(v: __m256) -> f32 {
    unsafe {
        let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
    }
}

/// # Safety
/// Needs AVX2.
#[inline(always)]
pub(crate) unsafe fn hsum_epi32(v: __m256i) -> i32 {
    unsafe {
        let x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let x = _mm_add_epi32(x, _mm_unpackhi_epi64(x, x));
        _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x)))
    }
}

/// Reads a little-endian u16 at any alignment.
///
/// # Safety
/// `p` points at 2 readable bytes.
#[inline(always)]
pub(crate) unsafe fn read_u16(p: *const u8) -> u16 {
    unsafe { p.cast::<u16>().read_unaligned() }
}

/// # Safety
/// `p` points at 4 readable bytes.
#[inline(always)]
pub(crate) unsafe fn read_u32(p: *const u8) -> u32 {
    unsafe { p.cast::<u32>().read_unaligned() }
}

/// The f16 at `p` in all lanes, as f32.
///
/// # Safety
/// Needs AVX2 and F16C; `p` points at 2 readable bytes.
#[inline(always)]
pub(crate) unsafe fn bcast_f16(p: *const u8) -> __m256 {
    unsafe { _mm256_cvtph_ps(_mm_set1_epi16(read_u16(p) as i16)) }
}

/// # Safety
/// Needs F16C; `p` points at 2 readable bytes.
#[inline(always)]
pub(crate) unsafe fn f16_to_f32(p: *const u8) -> f32 {
    unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(read_u16(p) as i32))) }
}

/// # Safety
/// Needs AVX; `p` points at 32 readable bytes.
#[inline(always)]
pub(crate) unsafe fn loadu(p: *const u8) -> __m256i {
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// 16 bytes of packed nibbles as 32 bytes: the low nibbles, then the high nibbles.
///
/// # Safety
/// Needs AVX2; `p` points at 16 readable bytes.
#[inline(always)]
pub(crate) unsafe fn nibbles(p: *const u8) -> __m256i {
    unsafe {
        let both = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()));
        let shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f))
    }
}

/// The f16 values at `p`, `p + stride`, ... (`n <= 8` of them; lanes past `n` are zero), as f32.
///
/// # Safety
/// Needs AVX and F16C; `p + i * stride` points at 2 readable bytes for `i < n <= 8`.
#[inline(always)]
pub(crate) unsafe fn gather_f16(p: *const u8, stride: usize, n: usize) -> __m256 {
    unsafe {
        // Packed in general registers: narrow stores into a buffer would stall the wide load.
        let mut words = [0u64; 2];
        for i in 0..n {
            words[i / 4] |= (read_u16(p.add(i * stride)) as u64) << (16 * (i % 4));
        }
        _mm256_cvtph_ps(_mm_set_epi64x(words[1] as i64, words[0] as i64))
    }
}

/// `n <= 8` floats at `p`; lanes past `n` are zero and their memory is not read.
///
/// # Safety
/// Needs AVX; `p` points at `n <= 8` readable floats.
#[inline(always)]
pub(crate) unsafe fn load_ps_n(p: *const f32, n: usize) -> __m256 {
    unsafe {
        if n == 8 {
            _mm256_loadu_ps(p)
        } else {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes))
        }
    }
}

/// Byte `i` is 0xff where bit `i` of `bits` is set, else 0.
///
/// # Safety
/// Needs AVX2.
#[inline(always)]
pub(crate) unsafe fn bits_to_bytes(bits: u32) -> __m256i {
    unsafe {
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select)
    }
}
