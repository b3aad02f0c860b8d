//! Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: 32-element blocks with an f16 scale, against Q8_0 or
//! Q8_1 activations. One generic kernel multiplies `R` weight rows by `C` activation rows,
//! unpacking each weight block once for all `C` rows.
//!
//! Quants are multiplied as unsigned bytes by the signed activations (`vpdpbusd`, or
//! `maddubs` + `madd` on AVX2). Signed formats are offset to unsigned and the offset times the
//! activations' block sum, kept with the activations, is taken back; Q8_0 on AVX2, whose
//! offset bytes would saturate `maddubs`'s i16 sums, multiplies |w| by the activations carrying
//! w's sign instead (llama.cpp's `mul_sum_i8_pairs` idea).

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::marker::PhantomData;

    use crate::activations::ARow;
    use crate::dispatch::RowsDot;
    use crate::simd::{Dot, gather_f16, hsum_ps, load_ps_n, loadu, nibbles, prefetch_ahead, read_u32};

    /// A 32-element block format.
    pub(crate) trait Format {
        const BYTES: usize;
        /// log2 of the offset [`Format::unsigned_values`] adds to the signed quants, or `None`
        /// for formats with a min (unsigned quants, `x = d q + m`, against Q8_1 activations).
        const OFFSET_LOG2: Option<i32>;
        /// The largest value [`Format::unsigned_values`] returns.
        const MAX_UNSIGNED: u8;
        /// Bytes of one block of the activations this format multiplies, and where its quants
        /// start: Q8_1 (d, s, qs) for formats with a min, Q8_0 (d, qs) for the others.
        const ACT_BLOCK: (usize, usize) = if Self::OFFSET_LOG2.is_none() { (36, 4) } else { (34, 2) };
        /// For 4-bit formats: where a block keeps its 16 bytes of codes (element `i` in byte
        /// `i`'s low nibble, element `i + 16` in its high nibble), and each code's unsigned
        /// value when that is not the code itself.
        const NIBBLES: Option<(usize, Option<[u8; 16]>)> = None;
        /// Scales of the `n <= 8` blocks at `p`, `p + stride`, ..., in lanes `0..n` (lanes past
        /// `n` zero).
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C; a whole block at each of the `n <= 8` places.
        #[inline(always)]
        unsafe fn scales_strided(p: *const u8, stride: usize, n: usize) -> __m256 {
            unsafe { gather_f16(p, stride, n) }
        }
        /// Mins of the `n <= 8` blocks at `p`, `p + stride`, ..., for formats with a min.
        ///
        /// # Safety
        /// As [`Format::scales_strided`].
        #[inline(always)]
        unsafe fn mins_strided(p: *const u8, stride: usize, n: usize) -> __m256 {
            unsafe { gather_f16(p.add(2), stride, n) }
        }
        /// Scales of the `n <= 8` blocks from `p` on, in lanes `0..n`.
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C; `p` points at `n <= 8` whole blocks.
        #[inline(always)]
        unsafe fn scales(p: *const u8, n: usize) -> __m256 {
            unsafe { Self::scales_strided(p, Self::BYTES, n) }
        }
        /// Mins of the `n <= 8` blocks from `p` on, for formats with a min.
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C; `p` points at `n <= 8` whole blocks.
        #[inline(always)]
        unsafe fn mins(p: *const u8, n: usize) -> __m256 {
            unsafe { Self::mins_strided(p, Self::BYTES, n) }
        }
        /// The 32 quants in element order as unsigned bytes (offset by `1 << OFFSET_LOG2`).
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C (and what `I` needs); `p` points at a whole block.
        unsafe fn unsigned_values<I: Dot>(p: *const u8) -> __m256i;
        /// The 32 quants as signed bytes, where `unsigned_values` exceed what `I` multiplies.
        ///
        /// # Safety
        /// Needs AVX2, FMA and F16C; `p` points at a whole block.
        unsafe fn signed_values(p: *const u8) -> __m256i {
            let _ = p;
            unreachable!("only formats with large unsigned values have signed values")
        }
    }

    /// Whether `I` multiplies `F`'s unsigned quants exactly; if not, the signed quants are used.
    const fn unsigned_fits<F: Format, I: Dot>() -> bool {
        F::MAX_UNSIGNED <= I::MAX_UNSIGNED
    }

    pub(crate) struct Q4_0;
    pub(crate) struct Q4_1;
    pub(crate) struct Q5_0;
    pub(crate) struct Q5_1;
    pub(crate) struct Q8_0;

    impl Format for Q4_0 {
        const BYTES: usize = 18;
        const OFFSET_LOG2: Option<i32> = Some(3);
        const MAX_UNSIGNED: u8 = 15;
        const NIBBLES: Option<(usize, Option<[u8; 16]>)> = Some((2, None));
        #[inline(always)]
        unsafe fn unsigned_values<I: Dot>(p: *const u8) -> __m256i {
            unsafe { nibbles(p.add(2)) }
        }
    }

    impl Format for Q4_1 {
        const BYTES: usize = 20;
        const OFFSET_LOG2: Option<i32> = None;
        const MAX_UNSIGNED: u8 = 15;
        const NIBBLES: Option<(usize, Option<[u8; 16]>)> = Some((4, None));
        #[inline(always)]
        unsafe fn unsigned_values<I: Dot>(p: *const u8) -> __m256i {
            unsafe { nibbles(p.add(4)) }
        }
    }

    impl Format for Q5_0 {
        const BYTES: usize = 22;
        const OFFSET_LOG2: Option<i32> = Some(4);
        const MAX_UNSIGNED: u8 = 31;
        #[inline(always)]
        unsafe fn unsigned_values<I: Dot>(p: *const u8) -> __m256i {
            unsafe { I::add_where(nibbles(p.add(6)), read_u32(p.add(2)), 0x10) }
        }
    }

    impl Format for Q5_1 {
        const BYTES: usize = 24;
        const OFFSET_LOG2: Option<i32> = None;
        const MAX_UNSIGNED: u8 = 31;
        #[inline(always)]
        unsafe fn unsigned_values<I: Dot>(p: *const u8) -> __m256i {
            unsafe { I::add_where(nibbles(p.add(8)), read_u32(p.add(4)), 0x10) }
        }
    }

    impl Format for Q8_0 {
        const BYTES: usize = 34;
        const OFFSET_LOG2: Option<i32> = Some(7);
        const MAX_UNSIGNED: u8 = 255;
        #[inline(always)]
        unsafe fn unsigned_values<I: Dot>(p: *const u8) -> __m256i {
            unsafe { _mm256_xor_si256(Self::signed_values(p), _mm256_set1_epi8(-128)) }
        }
        #[inline(always)]
        unsafe fn signed_values(p: *const u8) -> __m256i {
            unsafe { loadu(p.add(2)) }
        }
    }

    /// The direct kernel for format `F` on instruction set `I`.
    pub(crate) struct Legacy<F, I>(PhantomData<(F, I)>);

    impl<F: Format, I: Dot> RowsDot for Legacy<F, I> {
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

    /// `R` weight rows (`row_bytes` apart, `nb` blocks each) times `C` activation rows.
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C (and AVX-512 VNNI for `I = Vnni`); the rows must hold `nb` blocks.
    #[inline(always)]
    unsafe fn dot<F: Format, I: Dot, const R: usize, const C: usize>(
        w: *const u8,
        row_bytes: usize,
        a: &[ARow; C],
        nb: usize,
    ) -> [[f32; C]; R] {
        unsafe {
            // Even and odd blocks go to separate accumulators, so that a single pair of rows is
            // not held up by the latency of one chain of FMAs; every tile shape sums a pair in
            // the same order, so a row's result does not depend on its batch (`matmul_rows_alone`).
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            let mut acc_odd = [[_mm256_setzero_ps(); C]; R];
            // Per block lane: min times the activations' s, for formats with a min.
            let mut mins = [[_mm256_setzero_ps(); C]; R];
            let mut b0 = 0;
            while b0 + 8 <= nb {
                group::<F, I, R, C>(w, row_bytes, a, b0, 8, &mut acc, &mut acc_odd, &mut mins);
                b0 += 8;
            }
            // Fixed-size groups unroll fully; widths like 896 leave a group of 4.
            if b0 + 4 <= nb {
                group::<F, I, R, C>(w, row_bytes, a, b0, 4, &mut acc, &mut acc_odd, &mut mins);
                b0 += 4;
            }
            if b0 < nb {
                group::<F, I, R, C>(w, row_bytes, a, b0, nb - b0, &mut acc, &mut acc_odd, &mut mins);
            }
            let mut out = [[0.0f32; C]; R];
            for r in 0..R {
                for c in 0..C {
                    let sum = _mm256_add_ps(acc[r][c], acc_odd[r][c]);
                    out[r][c] = hsum_ps(_mm256_add_ps(sum, mins[r][c]));
                }
            }
            out
        }
    }

    /// Adds blocks `b0 .. b0 + n` (`n <= 8`) to `acc` (odd blocks to `acc_odd`) and `mins`. The
    /// group's weight scales are converted together and multiplied by the activations' scales
    /// in one vector, kept in memory, from where each block broadcasts its lane (cheaper than
    /// converting one f16 per block, and no registers held).
    ///
    /// # Safety
    /// As [`dot`], for blocks `b0 .. b0 + n`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn group<F: Format, I: Dot, const R: usize, const C: usize>(
        w: *const u8,
        row_bytes: usize,
        a: &[ARow; C],
        b0: usize,
        n: usize,
        acc: &mut [[__m256; C]; R],
        acc_odd: &mut [[__m256; C]; R],
        mins: &mut [[__m256; C]; R],
    ) {
        unsafe {
            let mut scales = [[[0.0f32; 8]; C]; R];
            for r in 0..R {
                let p = w.add(r * row_bytes + b0 * F::BYTES);
                prefetch_ahead(p, n * F::BYTES);
                let dw = F::scales(p, n);
                let has_min = F::OFFSET_LOG2.is_none();
                let mw = if has_min { F::mins(p, n) } else { _mm256_setzero_ps() };
                for c in 0..C {
                    _mm256_storeu_ps(scales[r][c].as_mut_ptr(), _mm256_mul_ps(dw, load_ps_n(a[c].d.add(b0), n)));
                    if has_min {
                        mins[r][c] = _mm256_fmadd_ps(mw, load_ps_n(a[c].s.add(b0), n), mins[r][c]);
                    }
                }
            }
            let mut i = 0;
            while i + 2 <= n {
                block::<F, I, R, C>(w, row_bytes, a, b0 + i, i, &scales, acc);
                block::<F, I, R, C>(w, row_bytes, a, b0 + i + 1, i + 1, &scales, acc_odd);
                i += 2;
            }
            if i < n {
                block::<F, I, R, C>(w, row_bytes, a, b0 + i, i, &scales, acc);
            }
        }
    }

    /// Adds block `b` of `R` weight rows times `C` activation rows to `acc`, with
    /// `scales[r][c][lane]` as each pair's scale.
    ///
    /// # Safety
    /// As [`dot`], for block `b`.
    #[inline(always)]
    unsafe fn block<F: Format, I: Dot, const R: usize, const C: usize>(
        w: *const u8,
        row_bytes: usize,
        a: &[ARow; C],
        b: usize,
        lane: usize,
        scales: &[[[f32; 8]; C]; R],
        acc: &mut [[__m256; C]; R],
    ) {
        let (a_bytes, a_qs) = F::ACT_BLOCK;
        let signed = !unsigned_fits::<F, I>();
        unsafe {
            let zero = _mm256_setzero_si256();
            let mut q = [zero; R];
            let mut abs_q = [zero; R];
            for r in 0..R {
                let p = w.add(r * row_bytes + b * F::BYTES);
                if signed {
                    q[r] = F::signed_values(p);
                    abs_q[r] = _mm256_abs_epi8(q[r]);
                } else {
                    q[r] = F::unsigned_values::<I>(p);
                }
            }
            for c in 0..C {
                let av = loadu(a[c].q.add(b * a_bytes + a_qs));
                // Eight lanes of -sum << (log2 - 3) take back the offset times the sum.
                let init = match F::OFFSET_LOG2 {
                    Some(log2) if !signed => _mm256_set1_epi32(*a[c].neg_sums.add(b) << (log2 - 3)),
                    _ => zero,
                };
                for r in 0..R {
                    let sums = if signed {
                        I::dpbusd(zero, abs_q[r], _mm256_sign_epi8(av, q[r]))
                    } else {
                        I::dpbusd(init, q[r], av)
                    };
                    let scale = _mm256_broadcast_ss(&scales[r][c][lane]);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][c]);
                }
            }
        }
    }
}
