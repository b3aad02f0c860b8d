//! Interleaved weight panels for batches on AVX2 without VNNI.
//!
//! A panel holds `ROWS` = 8 weight rows unpacked to unsigned bytes and interleaved four
//! elements at a time, `[step][row][4 bytes]` (as panel.rs's, at half the width), with each
//! block's scales per row. `maddubs` of a panel vector with four activation bytes broadcast
//! gives each row's two pair sums of the step in its 16-bit lanes; steps are summed in 16 bits
//! while they cannot overflow (all 8 of a 32-element block for 4-bit codes, 4 for 5-bit ones,
//! 2 for 6-bit ones), then widened with `madd`: by ones for the 32-element formats (about 12
//! instructions per block of 8 rows and one activation row, where the direct kernel spends
//! about 6 per row), by the group scale for the k-quants (one `madd` widens and scales).
//! Offsets and mins come off through the activations' block sums, as in panel.rs. Q8_0's
//! codes do not fit `maddubs` as unsigned bytes: its panel keeps them signed, and each step
//! multiplies their magnitudes by the activations carrying their signs (legacy.rs's trick).

use std::arch::x86_64::*;
use std::marker::PhantomData;

use ts_gguf::GgmlType;

use crate::activations::{ARow, ActView};
use crate::dispatch::TileFn;
use crate::kquants::{KFormat, Prep, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K_BYTES};
use crate::legacy::{Format, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::mxfp4::Mxfp4;
use crate::panel::transpose8;
use crate::simd::{Avx2, prefetch_ahead, read_u32};

/// Weight rows per panel: one 32-bit lane of a 256-bit vector each.
const ROWS: usize = 8;

/// Bytes per block in a panel: 8 steps of 32 bytes, then f32 scales and mins per row.
const BLOCK: usize = 8 * 32 + 2 * 4 * ROWS;

/// The smallest batch for which the panel kernel beats the direct one.
pub(crate) fn min_batch(_ty: GgmlType) -> usize {
    4
}

pub(crate) fn kernel(ty: GgmlType) -> Option<TileFn> {
    use GgmlType as T;
    let tile: TileFn = match ty {
        T::Q4_0 => tile::<Legacy<Q4_0>>,
        T::Q4_1 => tile::<Legacy<Q4_1>>,
        T::Q5_0 => tile::<Legacy<Q5_0>>,
        T::Q5_1 => tile::<Legacy<Q5_1>>,
        T::Q8_0 => tile::<Legacy<Q8_0>>,
        T::MXFP4 => tile::<Legacy<Mxfp4>>,
        T::Q2_K => tile::<KQuant<Q2K>>,
        T::Q3_K => tile::<KQuant<Q3K>>,
        T::Q4_K => tile::<KQuant<Q4K>>,
        T::Q5_K => tile::<KQuant<Q5K>>,
        T::Q6_K => tile::<KQuant<Q6K>>,
        _ => return None,
    };
    Some(tile)
}

/// Steps (of four elements) whose `maddubs` sums add up in 16 bits without overflow for codes
/// up to `max`: each is at most `2 * max * 128` (Q8_K activations reach -128); a power of two.
const fn steps_per_widening(max: usize) -> usize {
    let steps = i16::MAX as usize / (2 * max * 128);
    if steps >= 8 {
        8
    } else if steps >= 4 {
        4
    } else if steps >= 2 {
        2
    } else {
        1
    }
}

/// A kind of panel: its bytes per block, how it is built from weight rows, and one pass of `C`
/// activation rows over it.
trait PanelKind {
    /// Panel bytes per block (per super-block for the k-quants).
    const BLOCK: usize;
    /// Activation rows per pass over a panel, at most 4: as many as AVX2's 16 vector registers
    /// hold with their 16- and 32-bit sums (measured: 3 for the legacy blocks, 4 for k-quants).
    const COLS: usize;
    /// Unpacks `n <= ROWS` rows of `nb` blocks at `w` into the panel (rows past `n` zero).
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `n` rows of `nb` blocks at `w`, `row_bytes` apart; `panel`
    /// holds `nb * BLOCK` writable, 32-byte aligned bytes.
    unsafe fn build(w: *const u8, row_bytes: usize, n: usize, nb: usize, panel: *mut u8);
    /// Per lane (weight row), the dot product with each of the `C` activation rows.
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `panel` was built for `nb` blocks and the rows of `a` hold as many.
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C]) -> [__m256; C];
}

/// The 32-element block formats.
struct Legacy<F>(PhantomData<F>);

/// The k-quants.
struct KQuant<F>(PhantomData<F>);

/// Every `ROWS` weight rows built into a panel, then every activation row multiplied against it,
/// `P::COLS` at a time.
///
/// # Safety
/// As [`TileFn`]; needs AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<P: PanelKind>(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
    let rows = out.first().map_or(0, |o| o.len());
    let m = out.len();
    let nb = x.nb;
    // 32-byte aligned scratch for one panel.
    let mut panel = vec![_mm256_setzero_si256(); (nb * P::BLOCK).div_ceil(32)];
    let p: *mut u8 = panel.as_mut_ptr().cast();
    let a: Vec<ARow> = (0..m).map(|c| x.arow(c)).collect();
    for r0 in (0..rows).step_by(ROWS) {
        let n = ROWS.min(rows - r0);
        unsafe {
            P::build(w.as_ptr().add(r0 * row_bytes), row_bytes, n, nb, p);
            let mut c = 0;
            while c < m {
                let cols = (m - c).min(P::COLS);
                match cols {
                    4 => store_rows(&P::pass::<4>(p, nb, &[a[c], a[c + 1], a[c + 2], a[c + 3]]), out, c, r0, n),
                    3 => store_rows(&P::pass::<3>(p, nb, &[a[c], a[c + 1], a[c + 2]]), out, c, r0, n),
                    2 => store_rows(&P::pass::<2>(p, nb, &[a[c], a[c + 1]]), out, c, r0, n),
                    _ => store_rows(&P::pass::<1>(p, nb, &[a[c]]), out, c, r0, n),
                }
                c += cols;
            }
        }
    }
}

/// Whether `F`'s panel keeps its codes signed: unsigned, they would overflow `maddubs`.
const fn signed<F: Format>() -> bool {
    F::MAX_UNSIGNED > 128
}

impl<F: Format> PanelKind for Legacy<F> {
    const BLOCK: usize = BLOCK;
    const COLS: usize = 3;
    #[inline(always)]
    unsafe fn build(w: *const u8, row_bytes: usize, n: usize, nb: usize, panel: *mut u8) {
        unsafe {
            for b in 0..nb {
                let out = panel.add(b * BLOCK);
                let row = |r: usize| w.add(r * row_bytes + b * F::BYTES);
                let mut v = [_mm256_setzero_si256(); 8];
                for (r, v) in v.iter_mut().enumerate().take(n) {
                    // The weights stream from memory once per batch: fetched ahead as decode does.
                    prefetch_ahead(row(r), F::BYTES);
                    *v = if signed::<F>() { F::signed_values(row(r)) } else { F::unsigned_values::<Avx2>(row(r)) };
                }
                // v[s] becomes step s: elements 4s..4s+3 of every row.
                transpose8(&mut v);
                for (s, v) in v.iter().enumerate() {
                    _mm256_store_si256(out.add(32 * s).cast(), *v);
                }
                _mm256_store_ps(out.add(256).cast(), F::scales_strided(row(0), row_bytes, n));
                if F::OFFSET_LOG2.is_none() {
                    _mm256_store_ps(out.add(256 + 4 * ROWS).cast(), F::mins_strided(row(0), row_bytes, n));
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C]) -> [__m256; C] {
        // Q8_1 blocks (formats with a min) are d, s, qs; Q8_0 blocks d, qs.
        let (a_bytes, a_qs) = if F::OFFSET_LOG2.is_none() { (36, 4) } else { (34, 2) };
        let signed = signed::<F>();
        let widen = if signed { 1 } else { steps_per_widening(F::MAX_UNSIGNED as usize) };
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); C];
            for b in 0..nb {
                let block = panel.add(b * BLOCK);
                // Each lane is a whole row's sum: the offset times the block's sum comes off once.
                let mut sums: [__m256i; C] = std::array::from_fn(|c| match F::OFFSET_LOG2 {
                    Some(log2) if !signed => _mm256_set1_epi32(*a[c].neg_sums.add(b) << log2),
                    _ => _mm256_setzero_si256(),
                });
                for s0 in (0..8).step_by(widen) {
                    let mut pairs = [_mm256_setzero_si256(); C];
                    for s in s0..s0 + widen {
                        let wv = _mm256_load_si256(block.add(32 * s).cast());
                        let uw = if signed { _mm256_abs_epi8(wv) } else { wv };
                        for c in 0..C {
                            let av = _mm256_set1_epi32(read_u32(a[c].q.add(b * a_bytes + a_qs + 4 * s)) as i32);
                            let av = if signed { _mm256_sign_epi8(av, wv) } else { av };
                            pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(uw, av));
                        }
                    }
                    for c in 0..C {
                        sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(pairs[c], ones));
                    }
                }
                let scales = _mm256_load_ps(block.add(256).cast());
                for c in 0..C {
                    let d = _mm256_mul_ps(scales, _mm256_set1_ps(*a[c].d.add(b)));
                    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), d, acc[c]);
                }
                if F::OFFSET_LOG2.is_none() {
                    let mins = _mm256_load_ps(block.add(256 + 4 * ROWS).cast());
                    for c in 0..C {
                        acc[c] = _mm256_fmadd_ps(mins, _mm256_set1_ps(*a[c].s.add(b)), acc[c]);
                    }
                }
            }
            acc
        }
    }
}

/// Layout of one super-block in a k-quant panel: quants `[64 steps][ROWS][4]`, the group scales
/// as i16 pairs `[16][ROWS][2]` (both halves the scale: `madd` by them widens and scales), the
/// correction pairs `[8][ROWS][2]` (i16, against pairs of the activations' `bsums`), and f32 `d`
/// and `dmin` per row.
const K_SCALES: usize = 256 * ROWS;
const K_CORR: usize = K_SCALES + 16 * 4 * ROWS;
const K_D: usize = K_CORR + 8 * 4 * ROWS;
const K_DMIN: usize = K_D + 4 * ROWS;
const K_BLOCK: usize = K_DMIN + 4 * ROWS;

impl<F: KFormat> PanelKind for KQuant<F> {
    const BLOCK: usize = K_BLOCK;
    const COLS: usize = 4;
    #[inline(always)]
    unsafe fn build(w: *const u8, row_bytes: usize, n: usize, nb: usize, panel: *mut u8) {
        unsafe {
            for b in 0..nb {
                let out = panel.add(b * K_BLOCK);
                let row = |r: usize| w.add(r * row_bytes + b * F::BYTES);
                let mut prep = [Prep::zeroed(); ROWS];
                for (r, prep) in prep.iter_mut().enumerate().take(n) {
                    prefetch_ahead(row(r), F::BYTES);
                    *prep = F::prepare(row(r));
                }
                let zero = _mm256_setzero_si256();
                for j in 0..8 {
                    let mut v = [zero; 8];
                    for (r, v) in v.iter_mut().enumerate().take(n) {
                        *v = F::chunk::<Avx2>(row(r), &prep[r], j).0;
                    }
                    transpose8(&mut v);
                    for (s, v) in v.iter().enumerate() {
                        _mm256_store_si256(out.add(32 * (8 * j + s)).cast(), *v);
                    }
                }
                let scales = out.add(K_SCALES).cast::<i32>();
                for (r, prep) in prep.iter().enumerate() {
                    let group_scales = F::group_scales(prep);
                    for (g, &sc) in group_scales.iter().enumerate().take(256 / F::GROUP) {
                        *scales.add(ROWS * g + r) = (sc & 0xffff) | (sc << 16);
                    }
                }
                // Dword p of each row's `corr` (its groups 2p and 2p + 1), rows side by side.
                let mut corr: [__m256i; 8] = std::array::from_fn(|r| prep[r].corr);
                transpose8(&mut corr);
                for (p, v) in corr.iter().enumerate() {
                    _mm256_store_si256(out.add(K_CORR + 32 * p).cast(), *v);
                }
                let d: [f32; ROWS] = std::array::from_fn(|r| _mm256_cvtss_f32(prep[r].d));
                let dmin: [f32; ROWS] = std::array::from_fn(|r| _mm256_cvtss_f32(prep[r].dmin));
                _mm256_store_ps(out.add(K_D).cast(), _mm256_loadu_ps(d.as_ptr()));
                _mm256_store_ps(out.add(K_DMIN).cast(), _mm256_loadu_ps(dmin.as_ptr()));
            }
        }
    }

    #[inline(always)]
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C]) -> [__m256; C] {
        let group_steps = F::GROUP / 4;
        let widen = steps_per_widening(F::MAX_UNSIGNED as usize).min(group_steps);
        unsafe {
            let zero = _mm256_setzero_si256();
            let mut acc = [_mm256_setzero_ps(); C];
            for b in 0..nb {
                let block = panel.add(b * K_BLOCK);
                let aq = |c: usize, at: usize| read_u32(a[c].q.add(b * Q8K_BYTES + at)) as i32;
                let mut sums = [zero; C];
                for g in 0..256 / F::GROUP {
                    let scale = _mm256_load_si256(block.add(K_SCALES + 32 * g).cast());
                    for s0 in (g * group_steps..(g + 1) * group_steps).step_by(widen) {
                        let mut pairs = [zero; C];
                        for s in s0..s0 + widen {
                            let wv = _mm256_load_si256(block.add(32 * s).cast());
                            for (c, pair) in pairs.iter_mut().enumerate() {
                                let av = _mm256_set1_epi32(aq(c, 4 + 4 * s));
                                *pair = _mm256_add_epi16(*pair, _mm256_maddubs_epi16(wv, av));
                            }
                        }
                        for c in 0..C {
                            sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(pairs[c], scale));
                        }
                    }
                }
                let mut corr = [zero; C];
                for p in 0..8 {
                    let cv = _mm256_load_si256(block.add(K_CORR + 32 * p).cast());
                    for (c, corr) in corr.iter_mut().enumerate() {
                        *corr = _mm256_add_epi32(*corr, _mm256_madd_epi16(cv, _mm256_set1_epi32(aq(c, 260 + 4 * p))));
                    }
                }
                let d = _mm256_load_ps(block.add(K_D).cast());
                let dmin = _mm256_load_ps(block.add(K_DMIN).cast());
                for c in 0..C {
                    let da = _mm256_set1_ps(a[c].q.add(b * Q8K_BYTES).cast::<f32>().read_unaligned());
                    if F::OFFSET {
                        let total = _mm256_sub_epi32(sums[c], corr[c]);
                        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, da), acc[c]);
                    } else {
                        acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), _mm256_mul_ps(d, da), acc[c]);
                        acc[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr[c]), _mm256_mul_ps(dmin, da), acc[c]);
                    }
                }
            }
            acc
        }
    }
}

/// Stores the first `n` lanes of each `acc[c]` to `out[c0 + c][r0..]`.
///
/// # Safety
/// Needs AVX; every `out[c0 + c]` holds `r0 + n` elements, `n <= ROWS`.
#[inline(always)]
unsafe fn store_rows<const C: usize>(acc: &[__m256; C], out: &mut [&mut [f32]], c0: usize, r0: usize, n: usize) {
    let mut lanes = [0.0f32; ROWS];
    for (c, acc) in acc.iter().enumerate() {
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *acc) };
        out[c0 + c][r0..r0 + n].copy_from_slice(&lanes[..n]);
    }
}
