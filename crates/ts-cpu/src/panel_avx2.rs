//! Interleaved weight panels for batches on AVX2 without VNNI, and the packed layouts (weight
//! rows repacked once at load into such panels' steps, read for any batch, decode included).
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
use crate::dispatch::{PackFn, TileFn, decode_asks_ahead};
use crate::kquants::{KFormat, Prep, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K_BYTES, scales_mins_k4};
use crate::legacy::{Format, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::mxfp4::{Mxfp4, UNSIGNED_VALUES, e8m0_half_lanes};
use crate::panel::transpose8;
use crate::simd::{Avx2, prefetch_ahead, read_u32};

/// Weight rows per panel: one 32-bit lane of a 256-bit vector each.
pub(crate) const ROWS: usize = 8;

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

/// The packed layout of `ty` on AVX2, where it has one: its repacking and the kernel that reads it.
pub(crate) fn packed(ty: GgmlType) -> Option<(PackFn, TileFn)> {
    match ty {
        GgmlType::MXFP4 => Some((pack_mxfp4 as PackFn, packed_tile::<PackedMxfp4> as TileFn)),
        GgmlType::Q4_K => Some((pack_q4k as PackFn, packed_tile::<PackedQ4K> as TileFn)),
        GgmlType::Q4_0 => Some((pack_legacy::<Q4_0> as PackFn, packed_tile::<PackedLegacy<Q4_0>> as TileFn)),
        GgmlType::Q4_1 => Some((pack_legacy::<Q4_1> as PackFn, packed_tile::<PackedLegacy<Q4_1>> as TileFn)),
        GgmlType::Q5_0 => Some((pack_legacy::<Q5_0> as PackFn, packed_tile::<PackedLegacy<Q5_0>> as TileFn)),
        GgmlType::Q8_0 => Some((pack_legacy::<Q8_0> as PackFn, packed_tile::<PackedLegacy<Q8_0>> as TileFn)),
        _ => None,
    }
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

/// One pass of `C` activation rows over a panel: a built panel ([`PanelKind`]) or a packed
/// one read as it is ([`PackedPass`]).
trait PanelPass {
    /// Activation rows per pass over a panel, at most 4: as many as AVX2's 16 vector registers
    /// hold with their 16- and 32-bit sums (measured: 3 for the legacy blocks, 4 for k-quants).
    const COLS: usize;
    /// Per lane (weight row), the dot product with each of the `C` activation rows. `ahead`:
    /// whether a pass over packed rows, read from memory, asks for them ahead of its reads (a
    /// built panel, in the cache, never does).
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `panel` holds `nb` blocks and the rows of `a` as many.
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m256; C];
}

/// A kind of panel: its bytes per block and how it is built from weight rows.
trait PanelKind: PanelPass {
    /// Panel bytes per block (per super-block for the k-quants).
    const BLOCK: usize;
    /// Unpacks `n <= ROWS` rows of `nb` blocks at `w` into the panel (rows past `n` zero).
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `n` rows of `nb` blocks at `w`, `row_bytes` apart; `panel`
    /// holds `nb * BLOCK` writable, 32-byte aligned bytes.
    unsafe fn build(w: *const u8, row_bytes: usize, n: usize, nb: usize, panel: *mut u8);
}

/// Every activation row of `a` against the panel at `panel`, `P::COLS` at a time, into lanes
/// `r0 .. r0 + n` of their outputs.
///
/// # Safety
/// Needs AVX2, FMA and F16C; as [`PanelPass::pass`]; every output holds `r0 + n` lanes.
#[inline(always)]
unsafe fn passes<P: PanelPass>(
    panel: *const u8,
    nb: usize,
    a: &[ARow],
    ahead: bool,
    out: &mut [&mut [f32]],
    r0: usize,
    n: usize,
) {
    let m = a.len();
    let mut c = 0;
    while c < m {
        let cols = (m - c).min(P::COLS);
        unsafe {
            match cols {
                4 => store_rows(&P::pass::<4>(panel, nb, &[a[c], a[c + 1], a[c + 2], a[c + 3]], ahead), out, c, r0, n),
                3 => store_rows(&P::pass::<3>(panel, nb, &[a[c], a[c + 1], a[c + 2]], ahead), out, c, r0, n),
                2 => store_rows(&P::pass::<2>(panel, nb, &[a[c], a[c + 1]], ahead), out, c, r0, n),
                _ => store_rows(&P::pass::<1>(panel, nb, &[a[c]], ahead), out, c, r0, n),
            }
        }
        c += cols;
    }
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
            passes::<P>(p, nb, &a, false, out, r0, n);
        }
    }
}

/// Whether `F`'s panel keeps its codes signed: unsigned, they would overflow `maddubs`.
const fn signed<F: Format>() -> bool {
    F::MAX_UNSIGNED > 128
}

impl<F: Format> PanelKind for Legacy<F> {
    const BLOCK: usize = BLOCK;
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
}

impl<F: Format> PanelPass for Legacy<F> {
    const COLS: usize = 3;
    #[inline(always)]
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m256; C] {
        unsafe { legacy_pass::<F, Self, C>(panel, nb, a, ahead) }
    }
}

/// Where a legacy pass finds each block's steps (four elements of each of the 8 rows, as
/// [`Legacy`]'s panel holds them: unsigned values, or signed ones for Q8_0), scales and mins:
/// a panel built per batch, or rows packed once at load ([`PackedLegacy`]).
trait LegacyBlocks<F: Format> {
    /// Bytes per block.
    const BLOCK: usize;
    /// Step `s` (< 8) of the block at `block`.
    ///
    /// # Safety
    /// Needs AVX2; `block` points at a whole block.
    unsafe fn step(block: *const u8, s: usize) -> __m256i;
    /// The rows' scales.
    ///
    /// # Safety
    /// Needs AVX2 and F16C; `block` points at a whole block.
    unsafe fn scales(block: *const u8) -> __m256;
    /// The rows' mins (formats with a min).
    ///
    /// # Safety
    /// As [`LegacyBlocks::scales`].
    unsafe fn mins(block: *const u8) -> __m256;
}

impl<F: Format> LegacyBlocks<F> for Legacy<F> {
    const BLOCK: usize = BLOCK;
    #[inline(always)]
    unsafe fn step(block: *const u8, s: usize) -> __m256i {
        unsafe { _mm256_load_si256(block.add(32 * s).cast()) }
    }
    #[inline(always)]
    unsafe fn scales(block: *const u8) -> __m256 {
        unsafe { _mm256_load_ps(block.add(256).cast()) }
    }
    #[inline(always)]
    unsafe fn mins(block: *const u8) -> __m256 {
        unsafe { _mm256_load_ps(block.add(256 + 4 * ROWS).cast()) }
    }
}

/// One pass of `C` activation rows over `nb` blocks of a legacy format `F` laid out as `B`
/// says: per lane (weight row), its dot product with each activation row. The integer sums
/// and the float steps are the same for every `B` holding the same rows.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `panel` holds `nb` blocks of `B` and the rows of `a` as many.
#[inline(always)]
unsafe fn legacy_pass<F: Format, B: LegacyBlocks<F>, const C: usize>(
    panel: *const u8,
    nb: usize,
    a: &[ARow; C],
    ahead: bool,
) -> [__m256; C] {
    let (a_bytes, a_qs) = F::ACT_BLOCK;
    let signed = signed::<F>();
    let widen = if signed { 1 } else { steps_per_widening(F::MAX_UNSIGNED as usize) };
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let block = panel.add(b * B::BLOCK);
            if ahead {
                prefetch_ahead(block, B::BLOCK);
            }
            // Each lane is a whole row's sum: the offset times the block's sum comes off once.
            let mut sums: [__m256i; C] = std::array::from_fn(|c| match F::OFFSET_LOG2 {
                Some(log2) if !signed => _mm256_set1_epi32(*a[c].neg_sums.add(b) << log2),
                _ => _mm256_setzero_si256(),
            });
            for s0 in (0..8).step_by(widen) {
                let mut pairs = [_mm256_setzero_si256(); C];
                for s in s0..s0 + widen {
                    let wv = B::step(block, s);
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
            let scales = B::scales(block);
            for c in 0..C {
                let d = _mm256_mul_ps(scales, _mm256_set1_ps(*a[c].d.add(b)));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), d, acc[c]);
            }
            if F::OFFSET_LOG2.is_none() {
                let mins = B::mins(block);
                for c in 0..C {
                    acc[c] = _mm256_fmadd_ps(mins, _mm256_set1_ps(*a[c].s.add(b)), acc[c]);
                }
            }
        }
        acc
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
}

impl<F: KFormat> PanelPass for KQuant<F> {
    const COLS: usize = 4;
    #[inline(always)]
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], _ahead: bool) -> [__m256; C] {
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

/// Bytes of one Q4_K super-block of a packed panel: those of its 8 rows' blocks.
const Q4K_PACKED: usize = ROWS * 144;
/// Where a packed super-block keeps its groups' scales and mins: 12 bytes a group.
const Q4K_PACKED_SCALES: usize = 1024;
/// Where it keeps the rows' `d`, then their `dmin` (f16 each).
const Q4K_PACKED_D: usize = 1120;

/// Repacks Q4_K rows in place, 8 rows (a panel) at a time, at the same size: per super-block of
/// a panel (1,152 bytes) the codes of two steps per vector, `[group g][i < 4][row][4 bytes]` with
/// step `8 g + i` in the low nibbles and step `8 g + i + 4` in the high ones (the panel's
/// steps, four elements each); then per group the 8 rows' 6-bit scales, each with its min's low
/// two bits on top (8 bytes), and the mins' high nibbles, row r at bit 4 r (4 bytes); then the
/// rows' `d` and `dmin`. The pass reads it with two masks a vector and no transposition.
///
/// # Safety
/// Needs AVX2; `w` holds whole panels of rows of `row_bytes`, a multiple of 144.
unsafe fn pack_q4k(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, 144, |blocks, out| {
        let mut nibbles = [0u32; 8];
        for (r, blk) in blocks.iter().enumerate() {
            let (mut scales, mut mins) = ([0u8; 16], [0u8; 16]);
            // SAFETY: the caller has AVX2; the block's 12 scale bytes are readable.
            unsafe {
                let (sc, mn) = scales_mins_k4(blk.as_ptr().add(4));
                _mm_storeu_si128(scales.as_mut_ptr().cast(), sc);
                _mm_storeu_si128(mins.as_mut_ptr().cast(), mn);
            }
            for g in 0..8 {
                // Group g's elements are the low (even g) or high (odd g) nibbles of
                // qs[32 (g / 2)..][..32]: steps 8 g + i from byte 4 i, 8 g + i + 4 from 16 + 4 i.
                let (qs, shift) = (&blk[16 + 32 * (g / 2)..][..32], 4 * (g % 2));
                for i in 0..4 {
                    for e in 0..4 {
                        let (lo, hi) = ((qs[4 * i + e] >> shift) & 15, (qs[16 + 4 * i + e] >> shift) & 15);
                        out[32 * (4 * g + i) + 4 * r + e] = lo | (hi << 4);
                    }
                }
                out[Q4K_PACKED_SCALES + 12 * g + r] = scales[g] | ((mins[g] & 3) << 6);
                nibbles[g] |= ((mins[g] >> 2) as u32) << (4 * r);
            }
            out[Q4K_PACKED_D + 2 * r..][..2].copy_from_slice(&blk[..2]);
            out[Q4K_PACKED_D + 16 + 2 * r..][..2].copy_from_slice(&blk[2..4]);
        }
        for (g, n) in nibbles.iter().enumerate() {
            out[Q4K_PACKED_SCALES + 12 * g + 8..][..4].copy_from_slice(&n.to_le_bytes());
        }
    });
}

/// Repacks each panel of `w` (8 rows of `row_bytes`, blocks of `block_bytes`) in place: block
/// `b` of the panel's 8 rows, given to `pack` together, become its bytes `b * 8 * block_bytes`
/// onwards (`8 * block_bytes` of them).
fn repack_panels(w: &mut [u8], row_bytes: usize, block_bytes: usize, mut pack: impl FnMut(&[&[u8]; ROWS], &mut [u8])) {
    let packed = ROWS * block_bytes;
    for panel in w.chunks_exact_mut(ROWS * row_bytes) {
        let src = panel.to_vec();
        for b in 0..row_bytes / block_bytes {
            let blocks: [&[u8]; ROWS] = std::array::from_fn(|r| &src[r * row_bytes + b * block_bytes..][..block_bytes]);
            pack(&blocks, &mut panel[b * packed..(b + 1) * packed]);
        }
    }
}

/// One pass of `C` activation rows over a packed Q4_K panel ([`pack_q4k`]): the floats of
/// [`KQuant`]'s pass over the panel built from the same rows, bit for bit (the integer sums
/// are exact in any order; the float steps are the same).
///
/// # Safety
/// Needs AVX2, FMA and F16C; `panel` holds `nb` packed super-blocks and the rows of `a` as many.
#[inline(always)]
unsafe fn q4k_packed_pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m256; C] {
    unsafe {
        let zero = _mm256_setzero_si256();
        let low4 = _mm256_set1_epi8(0x0f);
        let nibble_shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let block = panel.add(b * Q4K_PACKED);
            if ahead {
                prefetch_ahead(block, Q4K_PACKED);
            }
            let aq = |c: usize, at: usize| read_u32(a[c].q.add(b * Q8K_BYTES + at)) as i32;
            let mut sums = [zero; C];
            let mut corr = [zero; C];
            for g in 0..8 {
                let at = block.add(Q4K_PACKED_SCALES + 12 * g);
                let packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at.cast()));
                let scale = _mm256_and_si256(packed, _mm256_set1_epi32(63));
                let high = _mm256_srlv_epi32(_mm256_set1_epi32(read_u32(at.add(8)) as i32), nibble_shifts);
                let min = _mm256_or_si256(
                    _mm256_srli_epi32::<6>(packed),
                    _mm256_slli_epi32::<2>(_mm256_and_si256(high, _mm256_set1_epi32(15))),
                );
                // Each as the same 16-bit value twice, for `madd` with a pair of sums.
                let scale = _mm256_or_si256(scale, _mm256_slli_epi32::<16>(scale));
                let min = _mm256_or_si256(min, _mm256_slli_epi32::<16>(min));
                let mut pairs = [zero; C];
                for i in 0..4 {
                    let v = _mm256_loadu_si256(block.add(32 * (4 * g + i)).cast());
                    let lo = _mm256_and_si256(v, low4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                    for (c, pair) in pairs.iter_mut().enumerate() {
                        let al = _mm256_set1_epi32(aq(c, 4 + 4 * (8 * g + i)));
                        let ah = _mm256_set1_epi32(aq(c, 4 + 4 * (8 * g + i + 4)));
                        *pair = _mm256_add_epi16(*pair, _mm256_maddubs_epi16(lo, al));
                        *pair = _mm256_add_epi16(*pair, _mm256_maddubs_epi16(hi, ah));
                    }
                }
                for c in 0..C {
                    sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(pairs[c], scale));
                    // The group's min times its two 16-element activation sums.
                    corr[c] = _mm256_add_epi32(corr[c], _mm256_madd_epi16(min, _mm256_set1_epi32(aq(c, 260 + 4 * g))));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(block.add(Q4K_PACKED_D).cast()));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(block.add(Q4K_PACKED_D + 16).cast()));
            for c in 0..C {
                let da = _mm256_set1_ps(a[c].q.add(b * Q8K_BYTES).cast::<f32>().read_unaligned());
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), _mm256_mul_ps(d, da), acc[c]);
                acc[c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr[c]), _mm256_mul_ps(dmin, da), acc[c]);
            }
        }
        acc
    }
}

/// A packed layout, passed over as it is ([`PanelPass`]); for layouts whose pass unpacks more
/// than a built panel's, from how many activation rows a tile unpacks each packed panel into a
/// [`PackedPass::Panel`] once and passes over that instead.
trait PackedPass: PanelPass {
    /// The panel [`PackedPass::unpack`] builds.
    type Panel: PanelKind;
    /// The batch from which it is used (never, by default).
    const UNPACK_FROM: usize = usize::MAX;
    /// Writes the `Self::Panel` panel of the packed panel at `packed` (`nb` blocks).
    ///
    /// # Safety
    /// Needs AVX2, FMA and F16C; `panel` holds `nb * Self::Panel::BLOCK` writable, 32-byte
    /// aligned bytes.
    unsafe fn unpack(packed: *const u8, nb: usize, panel: *mut u8) {
        let _ = (packed, nb, panel);
        unreachable!("a packed layout without an unpacking is passed over as it is")
    }
}

struct PackedQ4K;
struct PackedMxfp4;

impl PanelPass for PackedQ4K {
    const COLS: usize = 4;
    #[inline(always)]
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m256; C] {
        unsafe { q4k_packed_pass::<C>(panel, nb, a, ahead) }
    }
}

impl PackedPass for PackedQ4K {
    type Panel = KQuant<Q4K>;
}

impl PanelPass for PackedMxfp4 {
    const COLS: usize = 3;
    #[inline(always)]
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m256; C] {
        unsafe { mxfp4_packed_pass::<C>(panel, nb, a, ahead) }
    }
}

impl PackedPass for PackedMxfp4 {
    type Panel = Legacy<Mxfp4>;
    /// Its pass looks each code up again for every pass of 3 activation rows: from 6 rows an
    /// unpacked panel is cheaper (one thread, 16384 x 2880: packed 33-41 GMAC/s at 16 rows
    /// against the GGUF panel's 41-56).
    const UNPACK_FROM: usize = 6;
    #[inline(always)]
    unsafe fn unpack(packed: *const u8, nb: usize, panel: *mut u8) {
        unsafe {
            let low4 = _mm256_set1_epi8(0x0f);
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(UNSIGNED_VALUES.as_ptr().cast()));
            for b in 0..nb {
                let block = packed.add(b * MXFP4_PACKED);
                let out = panel.add(b * BLOCK);
                for i in 0..4 {
                    let v = _mm256_loadu_si256(block.add(32 * i).cast());
                    let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low4));
                    let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4));
                    _mm256_store_si256(out.add(32 * i).cast(), lo);
                    _mm256_store_si256(out.add(32 * (i + 4)).cast(), hi);
                }
                let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(block.add(128).cast()));
                _mm256_store_ps(out.add(256).cast(), e8m0_half_lanes(e));
            }
        }
    }
}

/// Packed rows times every activation row, `P::COLS` at a time. The passes over packed rows
/// ask for them ahead of their reads, in decode where `--decode-prefetch` says
/// ([`decode_asks_ahead`]; on AVX2 every format's own choice is to ask).
///
/// # Safety
/// As [`TileFn`]; needs AVX2, FMA and F16C; the rows are whole packed panels.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn packed_tile<P: PackedPass>(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
    let rows = out.first().map_or(0, |o| o.len());
    let m = out.len();
    let ahead = m > 1 || decode_asks_ahead(true);
    let nb = x.nb;
    let a: Vec<ARow> = (0..m).map(|c| x.arow(c)).collect();
    let unpacked = m >= P::UNPACK_FROM;
    let mut scratch = vec![_mm256_setzero_si256(); if unpacked { (nb * P::Panel::BLOCK).div_ceil(32) } else { 0 }];
    let panel: *mut u8 = scratch.as_mut_ptr().cast();
    for r0 in (0..rows).step_by(ROWS) {
        let n = ROWS.min(rows - r0);
        unsafe {
            let p = w.as_ptr().add(r0 * row_bytes);
            if unpacked {
                P::unpack(p, nb, panel);
                passes::<P::Panel>(panel, nb, &a, false, out, r0, n);
            } else {
                passes::<P>(p, nb, &a, ahead, out, r0, n);
            }
        }
    }
}

/// Bytes of one MXFP4 block of a packed panel: those of its 8 rows' blocks.
const MXFP4_PACKED: usize = ROWS * 17;

/// Repacks MXFP4 rows in place, 8 rows (a panel) at a time, at the same size: per block of a
/// panel (136 bytes) the codes of two steps per vector, `[i < 4][row][4 bytes]` with step `i`
/// in the low nibbles and step `i + 4` in the high ones (each row's quant bytes as they are,
/// transposed by dwords), then the rows' E8M0 scale bytes.
///
/// # Safety
/// Needs AVX2; `w` holds whole panels of rows of `row_bytes`, a multiple of 17.
unsafe fn pack_mxfp4(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, 17, |blocks, out| {
        for (r, blk) in blocks.iter().enumerate() {
            // Element j is the low nibble of qs[j] (j < 16) and element j + 16 its high nibble:
            // steps i and i + 4 of a row are its quant bytes 4 i .. 4 i + 3 as they are.
            for i in 0..4 {
                out[32 * i + 4 * r..][..4].copy_from_slice(&blk[1 + 4 * i..][..4]);
            }
            out[128 + r] = blk[0];
        }
    });
}

/// One pass of `C` activation rows over a packed MXFP4 panel ([`pack_mxfp4`]): the floats of
/// [`Legacy`]'s pass over the panel built from the same rows, bit for bit.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `panel` holds `nb` packed blocks and the rows of `a` as many.
#[inline(always)]
unsafe fn mxfp4_packed_pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m256; C] {
    unsafe {
        let low4 = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(UNSIGNED_VALUES.as_ptr().cast()));
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let block = panel.add(b * MXFP4_PACKED);
            if ahead {
                prefetch_ahead(block, MXFP4_PACKED);
            }
            // Q8_0 activation blocks: d, then the quants from byte 2. Values carry +16: the
            // block sum times 16 comes off first.
            let aq = |c: usize, s: usize| read_u32(a[c].q.add(b * 34 + 2 + 4 * s)) as i32;
            let mut sums: [__m256i; C] = std::array::from_fn(|c| _mm256_set1_epi32(*a[c].neg_sums.add(b) << 4));
            // Steps 0-3 from the low nibbles, then 4-7 from the high ones: four steps' pair
            // sums fit 16 bits (values up to 28).
            for high in [false, true] {
                let mut pairs = [_mm256_setzero_si256(); C];
                for i in 0..4 {
                    let v = _mm256_loadu_si256(block.add(32 * i).cast());
                    let codes = if high { _mm256_srli_epi16::<4>(v) } else { v };
                    let w = _mm256_shuffle_epi8(table, _mm256_and_si256(codes, low4));
                    let s = if high { i + 4 } else { i };
                    for (c, pair) in pairs.iter_mut().enumerate() {
                        *pair = _mm256_add_epi16(*pair, _mm256_maddubs_epi16(w, _mm256_set1_epi32(aq(c, s))));
                    }
                }
                for c in 0..C {
                    sums[c] = _mm256_add_epi32(sums[c], _mm256_madd_epi16(pairs[c], ones));
                }
            }
            let e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(block.add(128).cast()));
            let scales = e8m0_half_lanes(e);
            for c in 0..C {
                let d = _mm256_mul_ps(scales, _mm256_set1_ps(*a[c].d.add(b)));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), d, acc[c]);
            }
        }
        acc
    }
}

/// A 32-element block format packed in place at load, 8 rows (a panel) at a time, at the same
/// size ([`pack_legacy`]): per block of a panel the rows' codes as the steps of [`Legacy`]'s
/// panel, transposed by dwords, and their f16 scales (and mins): what [`Legacy`]'s `build`
/// makes per batch (a gather and a transposition a block), done once.
trait PackedLegacyFormat: Format {
    /// Where a packed block keeps its rows' f16 scales.
    const PACKED_SCALES: usize;
    /// Where it keeps their f16 mins (formats with a min).
    const PACKED_MINS: usize = 0;
    /// The batch from which a tile unpacks each packed panel into [`Legacy`]'s once: where a
    /// step costs more than a load, passes of 3 activation rows would redo it.
    const UNPACK_FROM: usize;
    /// Step `s` (< 8) of a packed block, as [`Legacy`]'s panel holds it.
    ///
    /// # Safety
    /// Needs AVX2; `block` points at a whole packed block.
    unsafe fn packed_step(block: *const u8, s: usize) -> __m256i;
    /// The 8 rows' blocks `blocks` packed into `out` (`ROWS * BYTES` bytes).
    fn pack_block(blocks: &[&[u8]; ROWS], out: &mut [u8]);
    /// Row `r`'s GGUF block back from the packed block `packed`, into `out`.
    fn gguf_block(packed: &[u8], r: usize, out: &mut [u8]);
}

/// Where a packed 4-bit block keeps its codes: vector `i < 4` holds each row's code bytes
/// `4 i..4 i + 4` (`[i][row][4 bytes]`), so its low nibbles are step `i` and its high ones
/// step `4 + i` (elements `j` and `16 + j` share byte `j`).
const NIBBLE_CODES: usize = 0;

/// Step `s` of the 4-bit codes at `codes` ([`NIBBLE_CODES`]).
///
/// # Safety
/// Needs AVX2; `codes` points at 128 readable bytes.
#[inline(always)]
unsafe fn nibble_step(codes: *const u8, s: usize) -> __m256i {
    unsafe {
        let v = _mm256_loadu_si256(codes.add(32 * (s % 4)).cast());
        let v = if s < 4 { v } else { _mm256_srli_epi16::<4>(v) };
        _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
    }
}

/// The code bytes of 8 rows' blocks (16 each, at `at` in each block) into [`NIBBLE_CODES`]'s
/// layout, and back.
fn pack_nibbles(blocks: &[&[u8]; ROWS], at: usize, out: &mut [u8]) {
    for (r, blk) in blocks.iter().enumerate() {
        for i in 0..4 {
            out[NIBBLE_CODES + 32 * i + 4 * r..][..4].copy_from_slice(&blk[at + 4 * i..][..4]);
        }
    }
}

fn unpack_nibbles(packed: &[u8], r: usize, out: &mut [u8]) {
    for i in 0..4 {
        out[4 * i..][..4].copy_from_slice(&packed[NIBBLE_CODES + 32 * i + 4 * r..][..4]);
    }
}

/// The 8 rows' f16 values at `at` of each block (scales or mins) side by side at `to`.
fn pack_halves(blocks: &[&[u8]; ROWS], at: usize, out: &mut [u8], to: usize) {
    for (r, blk) in blocks.iter().enumerate() {
        out[to + 2 * r..][..2].copy_from_slice(&blk[at..][..2]);
    }
}

/// Q4_0: codes, then the rows' scales.
impl PackedLegacyFormat for Q4_0 {
    const PACKED_SCALES: usize = 128;
    const UNPACK_FROM: usize = 8;
    #[inline(always)]
    unsafe fn packed_step(block: *const u8, s: usize) -> __m256i {
        unsafe { nibble_step(block.add(NIBBLE_CODES), s) }
    }
    fn pack_block(blocks: &[&[u8]; ROWS], out: &mut [u8]) {
        pack_nibbles(blocks, 2, out);
        pack_halves(blocks, 0, out, Self::PACKED_SCALES);
    }
    fn gguf_block(packed: &[u8], r: usize, out: &mut [u8]) {
        out[..2].copy_from_slice(&packed[Self::PACKED_SCALES + 2 * r..][..2]);
        unpack_nibbles(packed, r, &mut out[2..]);
    }
}

/// Q4_1: codes, then the rows' scales, then their mins.
impl PackedLegacyFormat for Q4_1 {
    const PACKED_SCALES: usize = 128;
    const PACKED_MINS: usize = 144;
    const UNPACK_FROM: usize = 8;
    #[inline(always)]
    unsafe fn packed_step(block: *const u8, s: usize) -> __m256i {
        unsafe { nibble_step(block.add(NIBBLE_CODES), s) }
    }
    fn pack_block(blocks: &[&[u8]; ROWS], out: &mut [u8]) {
        pack_nibbles(blocks, 4, out);
        pack_halves(blocks, 0, out, Self::PACKED_SCALES);
        pack_halves(blocks, 2, out, Self::PACKED_MINS);
    }
    fn gguf_block(packed: &[u8], r: usize, out: &mut [u8]) {
        out[..2].copy_from_slice(&packed[Self::PACKED_SCALES + 2 * r..][..2]);
        out[2..4].copy_from_slice(&packed[Self::PACKED_MINS + 2 * r..][..2]);
        unpack_nibbles(packed, r, &mut out[4..]);
    }
}

/// Where a packed Q5_0 block keeps its fifth bits: byte `4 r + e` holds in bit `s` row `r`'s
/// fifth bit of element `e` of step `s` (its `qh` bit `4 s + e`), so one shift and one mask
/// give a step's bits in place (0x10).
const Q5_0_FIFTH: usize = 128;

/// Q5_0: codes, the fifth bits, then the rows' scales.
impl PackedLegacyFormat for Q5_0 {
    const PACKED_SCALES: usize = 160;
    const UNPACK_FROM: usize = 6;
    #[inline(always)]
    unsafe fn packed_step(block: *const u8, s: usize) -> __m256i {
        unsafe {
            let fifth = _mm256_loadu_si256(block.add(Q5_0_FIFTH).cast());
            // Bit s of each byte to bit 4: bits moved in from the neighbouring byte of a
            // 16-bit lane land below bit 4 (left shifts of at most 4) or above it (right
            // shifts of at most 3), and the mask drops them.
            let at4 = match s {
                0 => _mm256_slli_epi16::<4>(fifth),
                1 => _mm256_slli_epi16::<3>(fifth),
                2 => _mm256_slli_epi16::<2>(fifth),
                3 => _mm256_slli_epi16::<1>(fifth),
                4 => fifth,
                5 => _mm256_srli_epi16::<1>(fifth),
                6 => _mm256_srli_epi16::<2>(fifth),
                _ => _mm256_srli_epi16::<3>(fifth),
            };
            _mm256_or_si256(nibble_step(block.add(NIBBLE_CODES), s), _mm256_and_si256(at4, _mm256_set1_epi8(0x10)))
        }
    }
    fn pack_block(blocks: &[&[u8]; ROWS], out: &mut [u8]) {
        pack_nibbles(blocks, 6, out);
        for (r, blk) in blocks.iter().enumerate() {
            let qh = u32::from_le_bytes(blk[2..6].try_into().expect("4 bytes"));
            for e in 0..4 {
                out[Q5_0_FIFTH + 4 * r + e] =
                    (0..8).fold(0u8, |byte, s| byte | ((((qh >> (4 * s + e)) & 1) as u8) << s));
            }
        }
        pack_halves(blocks, 0, out, Self::PACKED_SCALES);
    }
    fn gguf_block(packed: &[u8], r: usize, out: &mut [u8]) {
        out[..2].copy_from_slice(&packed[Self::PACKED_SCALES + 2 * r..][..2]);
        let mut qh = 0u32;
        for e in 0..4 {
            let byte = packed[Q5_0_FIFTH + 4 * r + e];
            for s in 0..8 {
                qh |= (((byte >> s) & 1) as u32) << (4 * s + e);
            }
        }
        out[2..6].copy_from_slice(&qh.to_le_bytes());
        unpack_nibbles(packed, r, &mut out[6..]);
    }
}

/// Where a packed Q8_0 block keeps its codes: the rows' scales come first, so that a pass
/// reads the block in one ascending run; vector `s` holds each row's quants `4 s..4 s + 4`.
const Q8_0_CODES: usize = 16;

/// Q8_0: the rows' scales, then their signed quants by steps.
impl PackedLegacyFormat for Q8_0 {
    const PACKED_SCALES: usize = 0;
    /// Its steps are loads, as a built panel's.
    const UNPACK_FROM: usize = usize::MAX;
    #[inline(always)]
    unsafe fn packed_step(block: *const u8, s: usize) -> __m256i {
        unsafe { _mm256_loadu_si256(block.add(Q8_0_CODES + 32 * s).cast()) }
    }
    fn pack_block(blocks: &[&[u8]; ROWS], out: &mut [u8]) {
        pack_halves(blocks, 0, out, Self::PACKED_SCALES);
        for (r, blk) in blocks.iter().enumerate() {
            for s in 0..8 {
                out[Q8_0_CODES + 32 * s + 4 * r..][..4].copy_from_slice(&blk[2 + 4 * s..][..4]);
            }
        }
    }
    fn gguf_block(packed: &[u8], r: usize, out: &mut [u8]) {
        out[..2].copy_from_slice(&packed[Self::PACKED_SCALES + 2 * r..][..2]);
        for s in 0..8 {
            out[2 + 4 * s..][..4].copy_from_slice(&packed[Q8_0_CODES + 32 * s + 4 * r..][..4]);
        }
    }
}

/// Rows of `F` packed by [`pack_legacy`].
struct PackedLegacy<F>(PhantomData<F>);

impl<F: PackedLegacyFormat> LegacyBlocks<F> for PackedLegacy<F> {
    const BLOCK: usize = ROWS * F::BYTES;
    #[inline(always)]
    unsafe fn step(block: *const u8, s: usize) -> __m256i {
        unsafe { F::packed_step(block, s) }
    }
    #[inline(always)]
    unsafe fn scales(block: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(block.add(F::PACKED_SCALES).cast())) }
    }
    #[inline(always)]
    unsafe fn mins(block: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(block.add(F::PACKED_MINS).cast())) }
    }
}

impl<F: PackedLegacyFormat> PanelPass for PackedLegacy<F> {
    const COLS: usize = 3;
    #[inline(always)]
    unsafe fn pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m256; C] {
        unsafe { legacy_pass::<F, Self, C>(panel, nb, a, ahead) }
    }
}

impl<F: PackedLegacyFormat> PackedPass for PackedLegacy<F> {
    type Panel = Legacy<F>;
    const UNPACK_FROM: usize = F::UNPACK_FROM;
    #[inline(always)]
    unsafe fn unpack(packed: *const u8, nb: usize, panel: *mut u8) {
        unsafe {
            for b in 0..nb {
                let (block, out) = (packed.add(b * ROWS * F::BYTES), panel.add(b * BLOCK));
                for s in 0..8 {
                    _mm256_store_si256(out.add(32 * s).cast(), F::packed_step(block, s));
                }
                _mm256_store_ps(out.add(256).cast(), <Self as LegacyBlocks<F>>::scales(block));
                if F::OFFSET_LOG2.is_none() {
                    _mm256_store_ps(out.add(256 + 4 * ROWS).cast(), <Self as LegacyBlocks<F>>::mins(block));
                }
            }
        }
    }
}

/// Repacks rows of `F` in place, 8 rows (a panel) at a time, at the same size, into
/// [`PackedLegacyFormat`]'s layout.
///
/// # Safety
/// Needs AVX2 (as every [`PackFn`]); `w` holds whole panels of rows of `row_bytes`, a multiple
/// of `F::BYTES`.
unsafe fn pack_legacy<F: PackedLegacyFormat>(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, F::BYTES, F::pack_block);
}

/// Row `r` (< 8) of a packed panel's block `packed` (Q4_0, Q4_1, Q5_0, Q8_0 or MXFP4, as
/// this file's packings lay them out) back as its GGUF block, into `out`; false for another
/// type. For reading single rows (an embedding table that is also the packed output head).
pub(crate) fn gguf_block_of_packed(ty: GgmlType, packed: &[u8], r: usize, out: &mut [u8]) -> bool {
    match ty {
        GgmlType::Q4_0 => Q4_0::gguf_block(packed, r, out),
        GgmlType::Q4_1 => Q4_1::gguf_block(packed, r, out),
        GgmlType::Q5_0 => Q5_0::gguf_block(packed, r, out),
        GgmlType::Q8_0 => Q8_0::gguf_block(packed, r, out),
        GgmlType::MXFP4 => {
            out[0] = packed[128 + r];
            for i in 0..4 {
                out[1 + 4 * i..][..4].copy_from_slice(&packed[32 * i + 4 * r..][..4]);
            }
        }
        _ => return false,
    }
    true
}
