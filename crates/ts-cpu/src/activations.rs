//! Activation rows quantized for the dot products, with per-block side data the kernels use.

use bytemuck::{Pod, Zeroable};
use rayon::prelude::*;
use ts_gguf::GgmlType;

use crate::dispatch::Isa;
use crate::{CpuError, activation_type};

/// 64 bytes, so that the quantized rows start on a cache line.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Activation rows quantized to what a weight type pairs with ([`ts_quant::vec_dot_type`]):
/// Q8_0, Q8_1 or Q8_K blocks, bit-identical to [`ts_quant::quantize`], or plain f32 for float
/// weights. A reusable buffer: it grows on demand and never shrinks.
#[derive(Clone)]
pub struct QuantizedRows {
    ty: GgmlType,
    k: usize,
    m: usize,
    row_bytes: usize,
    data: Vec<Line>,
    /// Per 32-element block of Q8_0 and Q8_1 rows: `d` as f32.
    d: Vec<f32>,
    /// Per Q8_1 block: `s` as f32.
    s: Vec<f32>,
    /// Per Q8_0 block: minus the sum of its quants, for weights stored with an offset.
    neg_sums: Vec<i32>,
}

impl Default for QuantizedRows {
    fn default() -> Self {
        Self::new()
    }
}

impl QuantizedRows {
    pub fn new() -> Self {
        QuantizedRows {
            ty: GgmlType::F32,
            k: 0,
            m: 0,
            row_bytes: 0,
            data: Vec::new(),
            d: Vec::new(),
            s: Vec::new(),
            neg_sums: Vec::new(),
        }
    }

    /// Quantizes the rows of `x` (`m = x.len() / k` rows of `k`) for weights of `weight_ty`,
    /// in parallel over rows on the current rayon pool.
    pub fn quantize(&mut self, weight_ty: GgmlType, x: &[f32], k: usize) -> Result<(), CpuError> {
        self.quantize_with_isa(Isa::detect(), weight_ty, x, k)
    }

    pub(crate) fn quantize_with_isa(
        &mut self,
        isa: Isa,
        weight_ty: GgmlType,
        x: &[f32],
        k: usize,
    ) -> Result<(), CpuError> {
        let ty = activation_type(weight_ty)?;
        let block = ty.block_size() as usize;
        if k == 0 || !k.is_multiple_of(block) || !k.is_multiple_of(weight_ty.block_size() as usize) {
            let block_size = block.max(weight_ty.block_size() as usize);
            return Err(CpuError::PartialBlock { ty: weight_ty, k, block_size });
        }
        if !x.len().is_multiple_of(k) {
            return Err(CpuError::WrongLength {
                what: "activations (elements)",
                expected: x.len().div_ceil(k) * k,
                actual: x.len(),
            });
        }
        let m = x.len() / k;
        self.resize(ty, k, m);
        let nb = k / block;
        let row_bytes = self.row_bytes;
        let side = self.side_len();
        if m == 0 {
            return Ok(());
        }
        let bytes = &mut bytemuck::cast_slice_mut::<Line, u8>(&mut self.data)[..m * row_bytes];
        if ty == GgmlType::F32 {
            // Little-endian floats are their own bytes: copied in pieces of 64 KiB spread over
            // the threads (element by element on one, this was a serial part of a long
            // prompt's attention, whose scores come here).
            #[cfg(target_endian = "little")]
            {
                const PIECE: usize = 64 << 10;
                let src: &[u8] = bytemuck::cast_slice(x);
                crate::team::for_each_chunk(bytes, PIECE, &|i, out| {
                    out.copy_from_slice(&src[i * PIECE..i * PIECE + out.len()])
                });
            }
            #[cfg(not(target_endian = "little"))]
            for (out, v) in bytes.chunks_exact_mut(4).zip(x) {
                out.copy_from_slice(&v.to_le_bytes());
            }
            return Ok(());
        }
        let rows = bytes
            .par_chunks_mut(row_bytes)
            .zip(x.par_chunks(k))
            .zip(self.d[..side].par_chunks_mut(nb))
            .zip(self.s[..side].par_chunks_mut(nb))
            .zip(self.neg_sums[..side].par_chunks_mut(nb));
        let work_per_row = k;
        rows.with_min_len((16384 / work_per_row).max(1))
            .try_for_each(|((((out, x), d), s), neg_sums)| quantize_row(isa, ty, x, Side { out, d, s, neg_sums }))
    }

    /// Makes `self` one row of `k` activations for weights of `weight_ty`, to be quantized a
    /// run of whole blocks at a time by several threads at once ([`RowRuns::quantize`]); None
    /// where the activations' blocks are not 32 elements (Q8_K's 256, or floats).
    pub(crate) fn row_runs(
        &mut self,
        isa: Isa,
        weight_ty: GgmlType,
        k: usize,
    ) -> Result<Option<RowRuns<'_>>, CpuError> {
        let ty = activation_type(weight_ty)?;
        let block = ty.block_size() as usize;
        if block != RowRuns::BLOCK {
            return Ok(None);
        }
        if k == 0 || !k.is_multiple_of(block) || !k.is_multiple_of(weight_ty.block_size() as usize) {
            let block_size = block.max(weight_ty.block_size() as usize);
            return Err(CpuError::PartialBlock { ty: weight_ty, k, block_size });
        }
        self.resize(ty, k, 1);
        let side = self.side_len();
        Ok(Some(RowRuns {
            isa,
            ty,
            k,
            out: bytemuck::cast_slice_mut::<Line, u8>(&mut self.data).as_mut_ptr(),
            d: self.d[..side].as_mut_ptr(),
            s: self.s[..side].as_mut_ptr(),
            neg_sums: self.neg_sums[..side].as_mut_ptr(),
            _rows: std::marker::PhantomData,
        }))
    }

    /// Makes `self` hold `m` rows of `k` elements of `ty`, growing the buffers if needed.
    fn resize(&mut self, ty: GgmlType, k: usize, m: usize) {
        self.ty = ty;
        self.k = k;
        self.m = m;
        self.row_bytes = k / ty.block_size() as usize * ty.type_size() as usize;
        let lines = (m * self.row_bytes).div_ceil(64);
        if self.data.len() < lines {
            self.data.resize(lines, Line([0; 64]));
        }
        let side = self.side_len();
        for v in [&mut self.d, &mut self.s] {
            if v.len() < side {
                v.resize(side, 0.0);
            }
        }
        if self.neg_sums.len() < side {
            self.neg_sums.resize(side, 0);
        }
    }

    /// Entries of each side array in use: one per block (none for F32).
    fn side_len(&self) -> usize {
        if self.ty == GgmlType::F32 { 0 } else { self.m * (self.k / self.ty.block_size() as usize) }
    }

    /// Makes `self` the rows `rows` of `src`, in that order (repeats allowed): for instance the
    /// tokens a MoE layer routes to one expert, so that a batch is quantized once for all experts.
    pub fn gather(&mut self, src: &QuantizedRows, rows: &[usize]) -> Result<(), CpuError> {
        if let Some(&row) = rows.iter().find(|&&r| r >= src.m) {
            return Err(CpuError::RowOutOfRange { row, m: src.m });
        }
        self.resize(src.ty, src.k, rows.len());
        let row_bytes = self.row_bytes;
        let nb = if self.ty == GgmlType::F32 { 0 } else { self.k / self.ty.block_size() as usize };
        let bytes = &mut bytemuck::cast_slice_mut::<Line, u8>(&mut self.data)[..rows.len() * row_bytes];
        for (i, &r) in rows.iter().enumerate() {
            bytes[i * row_bytes..(i + 1) * row_bytes].copy_from_slice(src.row(r));
            self.d[i * nb..(i + 1) * nb].copy_from_slice(&src.d[r * nb..(r + 1) * nb]);
            self.s[i * nb..(i + 1) * nb].copy_from_slice(&src.s[r * nb..(r + 1) * nb]);
            self.neg_sums[i * nb..(i + 1) * nb].copy_from_slice(&src.neg_sums[r * nb..(r + 1) * nb]);
        }
        Ok(())
    }

    /// The activation format: Q8_0, Q8_1, Q8_K or F32.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Elements per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Number of rows.
    pub fn m(&self) -> usize {
        self.m
    }

    /// The bytes of row `i` in ggml's layout for [`QuantizedRows::ty`] (f32 little-endian for F32).
    ///
    /// # Panics
    /// If `i >= m`.
    pub fn row(&self, i: usize) -> &[u8] {
        &self.bytes()[i * self.row_bytes..(i + 1) * self.row_bytes]
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<Line, u8>(&self.data)[..self.m * self.row_bytes]
    }

    pub(crate) fn view(&self) -> ActView<'_> {
        let side = self.side_len();
        ActView {
            ty: self.ty,
            nb: self.k / self.ty.block_size() as usize,
            row_bytes: self.row_bytes,
            bytes: self.bytes(),
            d: &self.d[..side],
            s: &self.s[..side],
            neg_sums: &self.neg_sums[..side],
        }
    }
}

/// Borrowed activations as the kernels see them.
#[derive(Clone, Copy)]
pub(crate) struct ActView<'a> {
    pub ty: GgmlType,
    /// Blocks per row (elements per row for F32).
    pub nb: usize,
    pub row_bytes: usize,
    pub bytes: &'a [u8],
    pub d: &'a [f32],
    pub s: &'a [f32],
    pub neg_sums: &'a [i32],
}

/// Pointers to one activation row and its side data, for the SIMD kernels.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct ARow {
    pub q: *const u8,
    pub d: *const f32,
    pub s: *const f32,
    pub neg_sums: *const i32,
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl ActView<'_> {
    /// Row `i`'s pointers (inlined: the panel kernels ask for each row on every pass).
    #[inline(always)]
    pub fn arow(&self, i: usize) -> ARow {
        let side = if self.ty == GgmlType::F32 { 0 } else { i * self.nb };
        ARow {
            q: self.bytes[i * self.row_bytes..].as_ptr(),
            d: self.d[side..].as_ptr(),
            s: self.s[side..].as_ptr(),
            neg_sums: self.neg_sums[side..].as_ptr(),
        }
    }
}

/// One row of [`QuantizedRows`] (from [`QuantizedRows::row_runs`]) that threads quantize a run
/// of 32-element blocks each: the same bytes as quantizing the whole row at once.
pub(crate) struct RowRuns<'a> {
    isa: Isa,
    ty: GgmlType,
    k: usize,
    out: *mut u8,
    d: *mut f32,
    s: *mut f32,
    neg_sums: *mut i32,
    _rows: std::marker::PhantomData<&'a mut QuantizedRows>,
}

// SAFETY: the row's buffers are borrowed mutably for 'a, and each caller of `quantize` writes
// only its own run's blocks (its contract).
unsafe impl Sync for RowRuns<'_> {}

impl RowRuns<'_> {
    /// Elements a block.
    pub(crate) const BLOCK: usize = 32;

    /// Quantizes `x`, the row's elements `start..start + x.len()`.
    ///
    /// # Safety
    /// No other call at the same time takes any of the same blocks.
    pub(crate) unsafe fn quantize(&self, start: usize, x: &[f32]) -> Result<(), CpuError> {
        let (b0, nb) = (start / Self::BLOCK, x.len() / Self::BLOCK);
        if !start.is_multiple_of(Self::BLOCK) || !x.len().is_multiple_of(Self::BLOCK) || start + x.len() > self.k {
            return Err(CpuError::WrongLength {
                what: "a run of activations (elements)",
                expected: nb * Self::BLOCK,
                actual: x.len(),
            });
        }
        let block_bytes = self.ty.type_size() as usize;
        // SAFETY: blocks b0..b0 + nb lie within the row (checked above), and no other call
        // takes them (the caller's promise).
        let side = unsafe {
            Side {
                out: std::slice::from_raw_parts_mut(self.out.add(b0 * block_bytes), nb * block_bytes),
                d: std::slice::from_raw_parts_mut(self.d.add(b0), nb),
                s: std::slice::from_raw_parts_mut(self.s.add(b0), nb),
                neg_sums: std::slice::from_raw_parts_mut(self.neg_sums.add(b0), nb),
            }
        };
        quantize_row(self.isa, self.ty, x, side)
    }
}

/// One row's outputs.
struct Side<'a> {
    out: &'a mut [u8],
    d: &'a mut [f32],
    s: &'a mut [f32],
    neg_sums: &'a mut [i32],
}

fn quantize_row(isa: Isa, ty: GgmlType, x: &[f32], side: Side) -> Result<(), CpuError> {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: `isa` is available (Isa values other than Scalar are only used after detection),
        // and the slices have the lengths of one row.
        match ty {
            GgmlType::Q8_K => unsafe { simd_q8::q8k_row(x, side.out)? },
            _ => unsafe { simd_q8::q8_row(ty == GgmlType::Q8_1, x, side)? },
        }
        return Ok(());
    }
    let _ = isa;
    if ty == GgmlType::Q8_K {
        ts_quant::quantize(ty, x, side.out)?;
    } else {
        quantize_q8_runtime(ty, x, side.out);
        fill_side(ty, side);
    }
    Ok(())
}

/// Q8_0 / Q8_1 activations as llama.cpp's CPU backend makes them at run time
/// (`ggml-cpu/arch/x86/quants.c: quantize_row_q8_0/q8_1`), which differs from the
/// reference quantizer used for weights: `id = 127 / amax` rather than `1 / (amax / 127)`,
/// rounding half to even rather than away from zero, and `s = d * Σq` from the f32 `d`.
/// Matching it keeps logits equal to llama.cpp's where a value sits on a rounding boundary.
pub fn quantize_q8_runtime(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    let block_bytes = ty.type_size() as usize;
    let qs_at = block_bytes - 32;
    for (xb, block) in x.chunks_exact(32).zip(out.chunks_exact_mut(block_bytes)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in block[qs_at..].iter_mut().zip(xb) {
            let r = (v * id).round_ties_even().clamp(-128.0, 127.0) as i32;
            sum += r;
            *q = r as i8 as u8;
        }
        block[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
        if ty == GgmlType::Q8_1 {
            block[2..4].copy_from_slice(&half::f16::from_f32(d * sum as f32).to_le_bytes());
        }
    }
}

/// Side data of Q8_0 / Q8_1 blocks from their bytes.
fn fill_side(ty: GgmlType, side: Side) {
    let block_bytes = ty.type_size() as usize;
    let qs_at = block_bytes - 32;
    let f16_at = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    for (i, block) in side.out.chunks_exact(block_bytes).enumerate() {
        side.d[i] = f16_at(block, 0);
        if ty == GgmlType::Q8_1 {
            side.s[i] = f16_at(block, 2);
        }
        side.neg_sums[i] = -block[qs_at..].iter().map(|&q| q as i8 as i32).sum::<i32>();
    }
}

/// AVX2 quantizers reproducing ts-quant's reference quantizers bit for bit. Blocks holding
/// non-finite values, or whose scale has no finite inverse, go through the reference code.
#[cfg(target_arch = "x86_64")]
mod simd_q8 {
    use std::arch::x86_64::*;

    use ts_gguf::GgmlType;
    use ts_quant::QuantError;

    use super::{Side, fill_side};
    use crate::simd::hsum_epi32;

    /// Loads 8 floats, returning them and their absolute values.
    ///
    /// # Safety
    /// Needs AVX2; `p` points at 8 readable floats.
    #[inline(always)]
    unsafe fn load_abs(p: *const f32) -> (__m256, __m256) {
        unsafe {
            let v = _mm256_loadu_ps(p);
            (v, _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff))))
        }
    }

    /// Lane-wise maximum of absolute values, compared as integers: for non-negative floats that
    /// orders like the values, and infinities and NaNs come out above every finite value.
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn max_bits(acc: __m256i, abs: __m256) -> __m256i {
        unsafe { _mm256_max_epi32(acc, _mm256_castps_si256(abs)) }
    }

    /// The largest lane of [`max_bits`].
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn reduce_max(bits: __m256i) -> u32 {
        unsafe {
            let x = _mm_max_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256::<1>(bits));
            let x = _mm_max_epi32(x, _mm_unpackhi_epi64(x, x));
            let x = _mm_max_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
            _mm_cvtsi128_si32(x) as u32
        }
    }

    /// The largest lane of [`max_bits`] as a float, or `None` if some value was not finite.
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn finite_max(bits: __m256i) -> Option<f32> {
        let max = unsafe { reduce_max(bits) };
        (max < 0x7f80_0000).then(|| f32::from_bits(max))
    }

    /// Eight floats rounded to f16 bits (nearest even, as `f16::from_f32` for values that are
    /// not NaN), and those f16 values as f32.
    ///
    /// # Safety
    /// Needs F16C.
    #[inline(always)]
    unsafe fn to_f16x8(x: __m256) -> ([u16; 8], [f32; 8]) {
        let (mut bits, mut back) = ([0u16; 8], [0.0f32; 8]);
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x);
            _mm_storeu_si128(bits.as_mut_ptr().cast(), h);
            _mm256_storeu_ps(back.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        (bits, back)
    }

    /// Packs 32 i32 in -128..=127 into 32 bytes in order.
    ///
    /// # Safety
    /// Needs AVX2.
    #[inline(always)]
    unsafe fn pack_i8(q: [__m256i; 4]) -> __m256i {
        unsafe {
            let a = _mm256_packs_epi32(q[0], q[1]);
            let b = _mm256_packs_epi32(q[2], q[3]);
            let bytes = _mm256_packs_epi16(a, b);
            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
        }
    }

    /// One row of Q8_0 (or Q8_1 with `with_s`) blocks and their side data, 8 blocks at a time:
    /// the blocks' maxima are gathered first, so that the scale arithmetic (divisions, f16
    /// rounding) runs on vectors instead of once per block on the critical path.
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `side` holds one row for `x`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8_row(with_s: bool, x: &[f32], side: Side) -> Result<(), QuantError> {
        let (ty, block_bytes) = if with_s { (GgmlType::Q8_1, 36) } else { (GgmlType::Q8_0, 34) };
        let qs_at = block_bytes - 32;
        let nb = x.len() / 32;
        for b0 in (0..nb).step_by(8) {
            let n = 8.min(nb - b0);
            let xs = &x[32 * b0..32 * (b0 + n)];
            let out = &mut side.out[block_bytes * b0..block_bytes * (b0 + n)];
            // SAFETY: `xs` holds `n` blocks of 32 floats, `out` `n` blocks.
            let (d16, d, sums, s16, s, usable) = unsafe {
                let mut max = [0u32; 8];
                for (i, max) in max.iter_mut().enumerate().take(n) {
                    let p = xs.as_ptr().add(32 * i);
                    let mut bits = _mm256_setzero_si256();
                    for j in 0..4 {
                        bits = max_bits(bits, load_abs(p.add(8 * j)).1);
                    }
                    *max = reduce_max(bits);
                }
                let max = _mm256_loadu_si256(max.as_ptr().cast());
                let finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f80_0000), max);
                let maxf = _mm256_castsi256_ps(max);
                let d = _mm256_div_ps(maxf, _mm256_set1_ps(127.0));
                // llama.cpp's runtime quantizer: id = 127 / max (0 for an all-zero block).
                let nonzero = _mm256_cmp_ps::<_CMP_NEQ_OQ>(maxf, _mm256_setzero_ps());
                let id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(127.0), maxf), nonzero);
                let id_finite = _mm256_cmp_ps::<_CMP_LT_OQ>(id, _mm256_set1_ps(f32::INFINITY));
                let usable = _mm256_movemask_ps(_mm256_and_ps(_mm256_castsi256_ps(finite), id_finite)) as u32;
                let mut ids = [0.0f32; 8];
                _mm256_storeu_ps(ids.as_mut_ptr(), id);
                let mut sums = [0i32; 8];
                for i in 0..n {
                    if usable & (1 << i) == 0 {
                        continue;
                    }
                    let p = xs.as_ptr().add(32 * i);
                    let idv = _mm256_set1_ps(ids[i]);
                    let mut q = [_mm256_setzero_si256(); 4];
                    for (j, q) in q.iter_mut().enumerate() {
                        // Round half to even, as the default MXCSR rounding of cvtps does.
                        *q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(8 * j)), idv));
                    }
                    let block = out[block_bytes * i..].as_mut_ptr();
                    _mm256_storeu_si256(block.add(qs_at).cast(), pack_i8(q));
                    sums[i] = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
                }
                let sums_v = _mm256_loadu_si256(sums.as_ptr().cast());
                let (s16, s) = to_f16x8(_mm256_mul_ps(_mm256_cvtepi32_ps(sums_v), d));
                let (d16, d) = to_f16x8(d);
                (d16, d, sums, s16, s, usable)
            };
            for i in 0..n {
                let (b, block) = (b0 + i, &mut out[block_bytes * i..block_bytes * (i + 1)]);
                if usable & (1 << i) == 0 {
                    super::quantize_q8_runtime(ty, &xs[32 * i..32 * (i + 1)], block);
                    let (d, s, neg_sums) = (&mut side.d[b..b + 1], &mut side.s[b..b + 1], &mut side.neg_sums[b..b + 1]);
                    fill_side(ty, Side { out: block, d, s, neg_sums });
                    continue;
                }
                block[..2].copy_from_slice(&d16[i].to_le_bytes());
                side.d[b] = d[i];
                side.neg_sums[b] = -sums[i];
                if with_s {
                    block[2..4].copy_from_slice(&s16[i].to_le_bytes());
                    side.s[b] = s[i];
                }
            }
        }
        Ok(())
    }

    /// One row of Q8_K blocks.
    ///
    /// # Safety
    /// Needs AVX2 and FMA; `out` holds one row for `x`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q8k_row(x: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
        for (xb, out) in x.chunks_exact(256).zip(out.chunks_exact_mut(292)) {
            let p = xb.as_ptr();
            // SAFETY: `xb` holds 256 floats, `out` one block.
            let done = unsafe {
                let mut bits = _mm256_setzero_si256();
                for i in 0..32 {
                    bits = max_bits(bits, load_abs(p.add(8 * i)).1);
                }
                let amax = finite_max(bits);
                if amax.is_none() {
                    false
                } else if amax == Some(0.0) {
                    out.fill(0);
                    true
                } else {
                    // The first element of largest magnitude sets the sign, as in the reference.
                    let target = _mm256_set1_ps(amax.unwrap_or(0.0));
                    let mut first = 0;
                    for i in 0..32 {
                        let (_, a) = load_abs(p.add(8 * i));
                        let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(a, target));
                        if hit != 0 {
                            first = 8 * i + hit.trailing_zeros() as usize;
                            break;
                        }
                    }
                    let iscale = -127.0 / xb[first];
                    if !iscale.is_finite() {
                        false
                    } else {
                        quantize_q8k_block(xb, iscale, out);
                        true
                    }
                }
            };
            if !done {
                ts_quant::quantize(GgmlType::Q8_K, xb, out)?;
            }
        }
        Ok(())
    }

    /// Quants `nearest_int(iscale * x).min(127)` (ggml's magic-number rounding), group sums and `d`.
    ///
    /// # Safety
    /// Needs AVX2; `x` holds 256 finite floats, `out` one Q8_K block, and `iscale` is finite.
    #[inline(always)]
    unsafe fn quantize_q8k_block(x: &[f32], iscale: f32, out: &mut [u8]) {
        unsafe {
            let scale = _mm256_set1_ps(iscale);
            let magic = _mm256_set1_ps(12_582_912.0);
            let p = x.as_ptr();
            let mut bsums = [0i16; 16];
            for chunk in 0..8 {
                let mut q = [_mm256_setzero_si256(); 4];
                for (j, q) in q.iter_mut().enumerate() {
                    let y = _mm256_mul_ps(scale, _mm256_loadu_ps(p.add(32 * chunk + 8 * j)));
                    let bits =
                        _mm256_and_si256(_mm256_castps_si256(_mm256_add_ps(y, magic)), _mm256_set1_epi32(0x007f_ffff));
                    *q = _mm256_min_epi32(
                        _mm256_sub_epi32(bits, _mm256_set1_epi32(0x0040_0000)),
                        _mm256_set1_epi32(127),
                    );
                }
                _mm256_storeu_si256(out[4 + 32 * chunk..].as_mut_ptr().cast(), pack_i8(q));
                bsums[2 * chunk] = hsum_epi32(_mm256_add_epi32(q[0], q[1])) as i16;
                bsums[2 * chunk + 1] = hsum_epi32(_mm256_add_epi32(q[2], q[3])) as i16;
            }
            out[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
            for (o, s) in out[260..].chunks_exact_mut(2).zip(bsums) {
                o.copy_from_slice(&s.to_le_bytes());
            }
        }
    }
}
