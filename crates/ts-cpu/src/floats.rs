//! F32, F16 and BF16 weights against f32 activations, with f32 products and sums.
//!
//! llama.cpp rounds the activations to F16 or BF16 for these weights; keeping them f32 costs
//! nothing here (the weights dominate memory traffic) and is more accurate.

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::marker::PhantomData;

    use crate::activations::ARow;
    use crate::dispatch::RowsDot;
    use crate::simd::{f16_to_f32, hsum_ps, prefetch_ahead, read_u16};

    /// A float weight format: how to widen it to f32.
    pub(crate) trait FloatFormat {
        const BYTES: usize;
        /// Eight elements at `p` as f32.
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C; `p` points at 8 readable elements.
        unsafe fn load8(p: *const u8) -> __m256;
        /// # Safety
        /// Needs AVX2, FMA and F16C; `p` points at 1 readable element.
        unsafe fn load1(p: *const u8) -> f32;
    }

    pub(crate) struct F32;
    pub(crate) struct F16;
    pub(crate) struct Bf16;

    impl FloatFormat for F32 {
        const BYTES: usize = 4;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            unsafe { _mm256_loadu_ps(p.cast()) }
        }
        #[inline(always)]
        unsafe fn load1(p: *const u8) -> f32 {
            unsafe { p.cast::<f32>().read_unaligned() }
        }
    }

    impl FloatFormat for F16 {
        const BYTES: usize = 2;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
        #[inline(always)]
        unsafe fn load1(p: *const u8) -> f32 {
            unsafe { f16_to_f32(p) }
        }
    }

    impl FloatFormat for Bf16 {
        const BYTES: usize = 2;
        #[inline(always)]
        unsafe fn load8(p: *const u8) -> __m256 {
            unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))) }
        }
        #[inline(always)]
        unsafe fn load1(p: *const u8) -> f32 {
            unsafe { f32::from_bits((read_u16(p) as u32) << 16) }
        }
    }

    /// Adds elements `i .. i + 8` of `R` weight rows times `C` activation rows to `acc`.
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; the rows hold elements `i .. i + 8`.
    #[inline(always)]
    unsafe fn step<F: FloatFormat, const R: usize, const C: usize>(
        w: *const u8,
        row_bytes: usize,
        a: &[ARow; C],
        i: usize,
        acc: &mut [[__m256; C]; R],
    ) {
        unsafe {
            let mut wv = [_mm256_setzero_ps(); R];
            for (r, wv) in wv.iter_mut().enumerate() {
                *wv = F::load8(w.add(r * row_bytes + i * F::BYTES));
            }
            for c in 0..C {
                let av = _mm256_loadu_ps(a[c].q.cast::<f32>().add(i));
                for r in 0..R {
                    acc[r][c] = _mm256_fmadd_ps(wv[r], av, acc[r][c]);
                }
            }
        }
    }

    /// The direct kernel for float format `F`.
    pub(crate) struct Floats<F>(PhantomData<F>);

    impl<F: FloatFormat> RowsDot for Floats<F> {
        /// `n` is the number of elements per row.
        #[inline(always)]
        unsafe fn dot<const R: usize, const C: usize>(
            w: *const u8,
            row_bytes: usize,
            a: &[ARow; C],
            n: usize,
        ) -> [[f32; C]; R] {
            unsafe {
                // Small tiles get four accumulators per pair of rows: FMA latency would bound a
                // single chain. Tiles of 4 pairs or more have chains enough.
                let mut acc = [[[_mm256_setzero_ps(); C]; R]; 4];
                let mut i = 0;
                while R * C < 4 && i + 32 <= n {
                    for r in 0..R {
                        prefetch_ahead(w.add(r * row_bytes + i * F::BYTES), 32 * F::BYTES);
                    }
                    for (u, acc) in acc.iter_mut().enumerate() {
                        step::<F, R, C>(w, row_bytes, a, i + 8 * u, acc);
                    }
                    i += 32;
                }
                while i + 8 <= n {
                    step::<F, R, C>(w, row_bytes, a, i, &mut acc[0]);
                    i += 8;
                }
                let mut out = [[0.0f32; C]; R];
                for r in 0..R {
                    for c in 0..C {
                        let mut tail = 0.0f32;
                        for j in i..n {
                            tail += F::load1(w.add(r * row_bytes + j * F::BYTES)) * *a[c].q.cast::<f32>().add(j);
                        }
                        let pairs =
                            [_mm256_add_ps(acc[0][r][c], acc[1][r][c]), _mm256_add_ps(acc[2][r][c], acc[3][r][c])];
                        out[r][c] = hsum_ps(_mm256_add_ps(pairs[0], pairs[1])) + tail;
                    }
                }
                out
            }
        }
    }
}
