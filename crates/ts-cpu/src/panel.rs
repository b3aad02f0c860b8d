//! Interleaved weight panels for batches, on AVX-512 VNNI.
//!
//! A panel holds `ROWS` = 16 weight rows unpacked to unsigned bytes and interleaved four
//! elements at a time, `[step][row][4 bytes]`, so that one 512-bit `vpdpbusd` of a panel vector
//! with four activation bytes broadcast to every lane adds a step of each row's dot product to
//! that row's lane. Each lane then sums one (weight row, activation row) pair block by block, and
//! scales are applied to whole vectors of rows. Unpacking a panel (with the transposition it
//! needs) is done once and repaid over every activation row of the batch.
//!
//! The offset that makes signed quants unsigned is taken back through the activations' block
//! sums; k-quant group scales are applied to each group's integer sum with `vpmulld`, and mins
//! or offsets through `vpdpwssd` with the activations' `bsums`. Float weights are widened to
//! f32 panels, `[element][row]`, and multiplied by broadcast activations with FMAs.

use std::arch::x86_64::*;

use ts_gguf::GgmlType;

use crate::activations::{ARow, ActView};
use crate::dispatch::{PackFn, TileFn, decode_asks_ahead};
use crate::floats::{Bf16, F16, F32, FloatFormat};
use crate::kquants::{KCodes, KFormat, Prep, Q2K, Q3K, Q4K, Q5K, Q6K, Q8K_BYTES};
use crate::legacy::{Format, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use crate::mxfp4::Mxfp4;
use crate::simd::{Vnni, read_u32};

/// Weight rows per panel: one 32-bit lane of a 512-bit vector each.
pub(crate) const ROWS: usize = 16;

/// Activation rows per pass over a panel.
const COLS: usize = 4;

/// The smallest batch for which the panel kernel of `ty` beats the direct one (measured).
pub(crate) fn min_batch(ty: GgmlType) -> usize {
    if ty.is_quantized() { 4 } else { 12 }
}

pub(crate) fn kernel(ty: GgmlType) -> Option<TileFn> {
    use GgmlType as T;
    let tile: TileFn = match ty {
        T::F32 => float_tile::<F32>,
        T::F16 => float_tile::<F16>,
        T::BF16 => float_tile::<Bf16>,
        T::Q4_0 => legacy_tile::<Q4_0>,
        T::Q4_1 => legacy_tile::<Q4_1>,
        T::Q5_0 => legacy_tile::<Q5_0>,
        T::Q5_1 => legacy_tile::<Q5_1>,
        T::Q8_0 => legacy_tile::<Q8_0>,
        T::MXFP4 => legacy_tile::<Mxfp4>,
        T::Q2_K => kquant_tile::<Q2K>,
        T::Q3_K => kquant_tile::<Q3K>,
        T::Q4_K => kquant_tile::<Q4K>,
        T::Q5_K => kquant_tile::<Q5K>,
        T::Q6_K => kquant_tile::<Q6K>,
        _ => return None,
    };
    Some(tile)
}

/// The packed layout of `ty`, where it has one: its repacking and the kernel that reads it.
pub(crate) fn packed(ty: GgmlType) -> Option<(PackFn, TileFn)> {
    use GgmlType as T;
    Some(match ty {
        T::MXFP4 => (pack_mxfp4 as PackFn, mxfp4_packed_tile as TileFn),
        T::Q4_0 => (pack_q4_0, q4_0_packed_tile),
        T::Q4_1 => (pack_q4_1, q4_1_packed_tile),
        T::Q5_0 => (pack_q5_0, q5_0_packed_tile),
        T::Q8_0 => (pack_q8_0, q8_0_packed_tile),
        T::Q4_K => (pack_q4k, q4k_packed_tile),
        T::Q6_K => (pack_q6k, q6k_packed_tile),
        _ => return None,
    })
}

/// Transposes 8 vectors of 8 dwords: `v[i]` lane `j` becomes `v[j]` lane `i`.
///
/// # Safety
/// Needs AVX2.
#[inline(always)]
pub(crate) unsafe fn transpose8(v: &mut [__m256i; 8]) {
    unsafe {
        let t: [__m256i; 8] = [
            _mm256_unpacklo_epi32(v[0], v[1]),
            _mm256_unpackhi_epi32(v[0], v[1]),
            _mm256_unpacklo_epi32(v[2], v[3]),
            _mm256_unpackhi_epi32(v[2], v[3]),
            _mm256_unpacklo_epi32(v[4], v[5]),
            _mm256_unpackhi_epi32(v[4], v[5]),
            _mm256_unpacklo_epi32(v[6], v[7]),
            _mm256_unpackhi_epi32(v[6], v[7]),
        ];
        // u[k] holds dword k (low half) and k + 4 (high half) of rows 0-3 (u[k]) or 4-7 (u[k + 4]).
        let u: [__m256i; 8] = [
            _mm256_unpacklo_epi64(t[0], t[2]),
            _mm256_unpackhi_epi64(t[0], t[2]),
            _mm256_unpacklo_epi64(t[1], t[3]),
            _mm256_unpackhi_epi64(t[1], t[3]),
            _mm256_unpacklo_epi64(t[4], t[6]),
            _mm256_unpackhi_epi64(t[4], t[6]),
            _mm256_unpacklo_epi64(t[5], t[7]),
            _mm256_unpackhi_epi64(t[5], t[7]),
        ];
        for k in 0..4 {
            v[k] = _mm256_permute2x128_si256::<0x20>(u[k], u[k + 4]);
            v[k + 4] = _mm256_permute2x128_si256::<0x31>(u[k], u[k + 4]);
        }
    }
}

/// Scratch for one panel, 64-byte aligned, kept by each thread from one call to the next
/// (allocated and zeroed per call, it and the allocator took about 3% of a Gemma 3 prompt).
/// Its bytes are whatever the last call left: every build writes all that its pass reads.
struct Panel(Vec<__m512i>);

thread_local! {
    /// This thread's panel between calls (empty while one is in use).
    static SPARE_PANEL: std::cell::Cell<Vec<__m512i>> = const { std::cell::Cell::new(Vec::new()) };
}

impl Panel {
    fn new(bytes: usize) -> Self {
        let mut v = SPARE_PANEL.take();
        let n = bytes.div_ceil(64);
        if v.len() < n {
            // SAFETY: all-zero bytes are a valid __m512i.
            v.resize(n, unsafe { std::mem::zeroed() });
        }
        Panel(v)
    }

    fn ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr().cast()
    }
}

impl Drop for Panel {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        // The larger one stays (a panel taken while another was in use comes back second).
        let kept = SPARE_PANEL.take();
        SPARE_PANEL.set(if kept.len() >= v.len() { kept } else { v });
    }
}

/// Unpacks quants of 16 rows and stores them interleaved: `rows(r)` gives row `r`'s 32
/// quants (zero past `n`); the 8 steps go to `out + 64 s`, rows 0-7 then rows 8-15.
///
/// # Safety
/// Needs AVX2; `out` points at 512 writable, 32-byte aligned bytes; `rows` may be called for `r < n`.
#[inline(always)]
unsafe fn store_interleaved(out: *mut u8, n: usize, mut rows: impl FnMut(usize) -> __m256i) {
    unsafe {
        for half in 0..2 {
            let mut v = [_mm256_setzero_si256(); 8];
            for (i, v) in v.iter_mut().enumerate() {
                if 8 * half + i < n {
                    *v = rows(8 * half + i);
                }
            }
            transpose8(&mut v);
            for (s, v) in v.iter().enumerate() {
                _mm256_store_si256(out.add(64 * s + 32 * half).cast(), *v);
            }
        }
    }
}

/// 16 bytes of each of 16 rows (`bytes(r)`, zeros for rows `r >= n`) transposed as dwords:
/// `d[t]`'s dword `r` is row `r`'s dword `t`. Built as a 4x4 dword transposition within each
/// 128-bit lane (20 shuffles, where transposing the unpacked 32 bytes a row took 48).
///
/// # Safety
/// Needs AVX-512 F; `bytes(r)` points at 16 readable bytes for `r < n`.
#[inline(always)]
unsafe fn transpose_dwords(n: usize, bytes: impl Fn(usize) -> *const u8) -> [__m512i; 4] {
    unsafe {
        // y[q] holds rows q, q + 4, q + 8 and q + 12, one per 128-bit lane.
        let mut y = [_mm512_setzero_si512(); 4];
        for (q, y) in y.iter_mut().enumerate() {
            let load = |lane: usize| {
                let r = q + 4 * lane;
                if r < n { _mm_loadu_si128(bytes(r).cast()) } else { _mm_setzero_si128() }
            };
            *y = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(load(0)), load(1));
            *y = _mm512_inserti32x4::<2>(*y, load(2));
            *y = _mm512_inserti32x4::<3>(*y, load(3));
        }
        // Lane L of d[t] is dword t of rows 4L to 4L + 3.
        let lo01 = _mm512_unpacklo_epi32(y[0], y[1]);
        let hi01 = _mm512_unpackhi_epi32(y[0], y[1]);
        let lo23 = _mm512_unpacklo_epi32(y[2], y[3]);
        let hi23 = _mm512_unpackhi_epi32(y[2], y[3]);
        [
            _mm512_unpacklo_epi64(lo01, lo23),
            _mm512_unpackhi_epi64(lo01, lo23),
            _mm512_unpacklo_epi64(hi01, hi23),
            _mm512_unpackhi_epi64(hi01, hi23),
        ]
    }
}

/// Low (`high` false) or high nibbles of each byte.
///
/// # Safety
/// Needs AVX-512 F.
#[inline(always)]
unsafe fn nibbles512(v: __m512i, high: bool) -> __m512i {
    unsafe {
        let v = if high { _mm512_srli_epi32::<4>(v) } else { v };
        _mm512_and_si512(v, _mm512_set1_epi8(0x0f))
    }
}

/// [`store_interleaved`] for 4-bit codes, from the packed bytes: `codes(r)` points at row `r`'s
/// 16 bytes, whose low nibbles give 4 steps, stored from `low` on, and whose high nibbles 4 more,
/// stored from `high` on (a legacy block: elements 0-15 and 16-31); `table` maps a code to its
/// unsigned value (None: the code itself). The packed bytes are transposed
/// ([`transpose_dwords`]), then each dword's nibbles give one step each.
///
/// # Safety
/// Needs AVX-512 F and BW; `low` and `high` point at 256 writable, 64-byte aligned bytes;
/// `codes(r)` points at 16 readable bytes for `r < n`.
#[inline(always)]
unsafe fn store_nibble_steps(
    low: *mut u8,
    high: *mut u8,
    n: usize,
    table: Option<[u8; 16]>,
    codes: impl Fn(usize) -> *const u8,
) {
    unsafe {
        let d = transpose_dwords(n, codes);
        let lut = table.map(|t| _mm512_broadcast_i32x4(_mm_loadu_si128(t.as_ptr().cast())));
        let value = |c: __m512i| match lut {
            Some(l) => _mm512_shuffle_epi8(l, c),
            None => c,
        };
        for (t, d) in d.iter().enumerate() {
            _mm512_store_si512(low.add(64 * t).cast(), value(nibbles512(*d, false)));
            _mm512_store_si512(high.add(64 * t).cast(), value(nibbles512(*d, true)));
        }
    }
}

/// A Q6_K super-block's 64 steps of 16 rows, from the packed bits (`block(r)` points at row
/// `r`'s block): per half of 128 elements, `ql[64 h..]` holds elements 0-31 (low nibbles) and
/// 64-95 (high), `ql[64 h + 32..]` elements 32-63 and 96-127, and `qh[32 h..]` the two high
/// bits of element `l`, `l + 32`, `l + 64` and `l + 96` at bits 0, 2, 4 and 6 of byte `l`
/// (ggml's `dequantize_row_q6_K`). Each 16-byte run of the three is transposed once.
///
/// # Safety
/// Needs AVX-512 F and BW; `out` points at 4096 writable, 64-byte aligned bytes; `block(r)`
/// points at a whole Q6_K block for `r < n`.
#[inline(always)]
unsafe fn store_q6k_steps(out: *mut u8, n: usize, block: impl Fn(usize) -> *const u8) {
    unsafe {
        let three = _mm512_set1_epi8(3);
        for half in 0..2 {
            for part in 0..2 {
                let at = |offset: usize| transpose_dwords(n, |r| block(r).add(offset + 16 * part));
                let (a, b, h) = (at(64 * half), at(64 * half + 32), at(128 + 32 * half));
                for t in 0..4 {
                    // Chunk k (32 elements at 32 k of this half): low bits from a (k = 0, 2)
                    // or b (k = 1, 3), low nibbles for k < 2; high bits at 2 k of h.
                    for k in 0..4 {
                        let low = nibbles512(if k % 2 == 0 { a[t] } else { b[t] }, k >= 2);
                        let bits = match k {
                            0 => h[t],
                            1 => _mm512_srli_epi32::<2>(h[t]),
                            2 => _mm512_srli_epi32::<4>(h[t]),
                            _ => _mm512_srli_epi32::<6>(h[t]),
                        };
                        let q = _mm512_or_si512(low, _mm512_slli_epi32::<4>(_mm512_and_si512(bits, three)));
                        _mm512_store_si512(out.add(512 * (4 * half + k) + 64 * (4 * part + t)).cast(), q);
                    }
                }
            }
        }
    }
}

/// Stores the first `n` lanes of `acc[c]` to `out[c][r0..]` for each column `c`, one masked
/// store each: a copy of a variable length was a call to memmove each (3.5% of a SmolLM2
/// prompt).
///
/// # Safety
/// Needs AVX-512 F; every `out[c]` holds `r0 + n` elements, `n <= ROWS`, and `acc` has a
/// vector for each column.
#[inline(always)]
unsafe fn store_rows(acc: &[__m512], out: &mut [&mut [f32]], r0: usize, n: usize) {
    let mask: __mmask16 = if n >= ROWS { !0 } else { (1u16 << n) - 1 };
    for (acc, out) in acc.iter().zip(out.iter_mut()) {
        let dst = &mut out[r0..r0 + n];
        // SAFETY: `dst` holds the `n` lanes the mask writes.
        unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), mask, *acc) };
    }
}

/// Runs `body` with `$cols = $n` over the activation rows, then with `$cols = 4` (if `$n` is
/// larger) and `$cols = 1` for the rest.
macro_rules! each_cols {
    ($m:expr, $n:expr, |$c:ident, $cols:ident| $body:expr) => {{
        let mut $c = 0;
        while $c + $n <= $m {
            {
                const $cols: usize = $n;
                $body;
            }
            $c += $n;
        }
        while $n > 4 && $c + 4 <= $m {
            {
                const $cols: usize = 4;
                $body;
            }
            $c += 4;
        }
        while $c < $m {
            {
                const $cols: usize = 1;
                $body;
            }
            $c += 1;
        }
    }};
}

/// Bytes per 32-element block in a legacy panel: quants, then f32 scales and mins per row.
const LEGACY_BLOCK: usize = 32 * ROWS + 2 * 4 * ROWS;

/// # Safety
/// As [`TileFn`]; needs AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn legacy_tile<F: Format>(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
    let rows = out.first().map_or(0, |o| o.len());
    let m = out.len();
    let nb = x.nb;
    let mut panel = Panel::new(nb * LEGACY_BLOCK);
    let p = panel.ptr();
    for r0 in (0..rows).step_by(ROWS) {
        let n = ROWS.min(rows - r0);
        unsafe {
            build_legacy::<F>(w.as_ptr().add(r0 * row_bytes), row_bytes, n, nb, p);
            each_cols!(m, COLS, |c, C| {
                let a: [ARow; C] = std::array::from_fn(|i| x.arow(c + i));
                let acc = legacy_pass::<F, C>(p, nb, &a);
                store_rows(&acc, &mut out[c..c + C], r0, n);
            });
        }
    }
}

/// # Safety
/// Needs AVX-512 VNNI and what [`legacy_tile`] needs; `n <= ROWS` rows of `nb` blocks at `w`, and a panel of `nb` blocks.
#[inline(always)]
unsafe fn build_legacy<F: Format>(w: *const u8, row_bytes: usize, n: usize, nb: usize, panel: *mut u8) {
    unsafe {
        for b in 0..nb {
            let out = panel.add(b * LEGACY_BLOCK);
            let row = |r: usize| w.add(r * row_bytes + b * F::BYTES);
            match F::NIBBLES {
                Some((at, table)) => store_nibble_steps(out, out.add(256), n, table, |r| row(r).add(at)),
                None => store_interleaved(out, n, |r| F::unsigned_values::<Vnni>(row(r))),
            }
            let mut scales = [0.0f32; ROWS];
            let mut mins = [0.0f32; ROWS];
            for r in 0..n {
                scales[r] = _mm256_cvtss_f32(F::scales(row(r), 1));
                if F::OFFSET_LOG2.is_none() {
                    mins[r] = _mm256_cvtss_f32(F::mins(row(r), 1));
                }
            }
            _mm512_store_ps(out.add(32 * ROWS).cast(), _mm512_loadu_ps(scales.as_ptr()));
            _mm512_store_ps(out.add(36 * ROWS).cast(), _mm512_loadu_ps(mins.as_ptr()));
        }
    }
}

/// One pass of `C` activation rows over a legacy panel: per lane (weight row), the dot product.
///
/// # Safety
/// Needs AVX-512 VNNI; `panel` was built for `nb` blocks and the rows of `a` hold as many.
#[inline(always)]
unsafe fn legacy_pass<F: Format, const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C]) -> [__m512; C] {
    let (a_bytes, a_qs) = F::ACT_BLOCK;
    unsafe {
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            let block = panel.add(b * LEGACY_BLOCK);
            let mut sums = [_mm512_setzero_si512(); C];
            if let Some(log2) = F::OFFSET_LOG2 {
                for c in 0..C {
                    sums[c] = _mm512_set1_epi32(*a[c].neg_sums.add(b) << log2);
                }
            }
            for s in 0..8 {
                let wv = _mm512_load_si512(block.add(64 * s).cast());
                for c in 0..C {
                    let av = _mm512_set1_epi32(read_u32(a[c].q.add(b * a_bytes + a_qs + 4 * s)) as i32);
                    sums[c] = _mm512_dpbusd_epi32(sums[c], wv, av);
                }
            }
            let scales = _mm512_load_ps(block.add(32 * ROWS).cast());
            for c in 0..C {
                let d = _mm512_mul_ps(scales, _mm512_set1_ps(*a[c].d.add(b)));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), d, acc[c]);
            }
            if F::OFFSET_LOG2.is_none() {
                let mins = _mm512_load_ps(block.add(36 * ROWS).cast());
                for c in 0..C {
                    acc[c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(*a[c].s.add(b)), acc[c]);
                }
            }
        }
        acc
    }
}

/// Layout of one super-block in a k-quant panel: quants `[64 steps][ROWS][4]`, then i32 group
/// scales `[16][ROWS]`, i16 correction pairs `[8][ROWS][2]`, and f32 `d` and `dmin` per row.
const K_SCALES: usize = 256 * ROWS;
const K_CORR: usize = K_SCALES + 16 * 4 * ROWS;
const K_D: usize = K_CORR + 8 * 4 * ROWS;
const K_DMIN: usize = K_D + 4 * ROWS;
const K_BLOCK: usize = K_DMIN + 4 * ROWS;

/// # Safety
/// As [`TileFn`]; needs AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn kquant_tile<F: KFormat>(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
    let rows = out.first().map_or(0, |o| o.len());
    let m = out.len();
    let nb = x.nb;
    let mut panel = Panel::new(nb * K_BLOCK);
    let p = panel.ptr();
    for r0 in (0..rows).step_by(ROWS) {
        let n = ROWS.min(rows - r0);
        unsafe {
            build_kquant::<F>(w.as_ptr().add(r0 * row_bytes), row_bytes, n, nb, p);
            each_cols!(m, COLS, |c, C| {
                let a: [ARow; C] = std::array::from_fn(|i| x.arow(c + i));
                let acc = kquant_pass::<F, C>(p, nb, &a);
                store_rows(&acc, &mut out[c..c + C], r0, n);
            });
        }
    }
}

/// # Safety
/// Needs AVX-512 VNNI and what [`kquant_tile`] needs; `n <= ROWS` rows of `nb` super-blocks at `w`, and a panel of `nb` super-blocks.
#[inline(always)]
unsafe fn build_kquant<F: KFormat>(w: *const u8, row_bytes: usize, n: usize, nb: usize, panel: *mut u8) {
    unsafe {
        for b in 0..nb {
            let out = panel.add(b * K_BLOCK);
            let row = |r: usize| w.add(r * row_bytes + b * F::BYTES);
            let mut prep = [Prep::zeroed(); ROWS];
            for (r, prep) in prep.iter_mut().enumerate().take(n) {
                *prep = F::prepare(row(r));
            }
            match F::CODES {
                // 64 elements per 32 bytes: bytes 16 h.. give chunk 2 i's steps 4 h.. from their
                // low nibbles and chunk 2 i + 1's from their high ones.
                KCodes::Nibbles(at) => {
                    for i in 0..4 {
                        for h in 0..2 {
                            let (low, high) = (out.add(512 * 2 * i + 256 * h), out.add(512 * (2 * i + 1) + 256 * h));
                            store_nibble_steps(low, high, n, None, |r| row(r).add(at + 32 * i + 16 * h));
                        }
                    }
                }
                KCodes::Q6K => store_q6k_steps(out, n, row),
                KCodes::Chunks => {
                    for j in 0..8 {
                        store_interleaved(out.add(64 * 8 * j), n, |r| F::chunk::<Vnni>(row(r), &prep[r], j).0);
                    }
                }
            }
            let scales = out.add(K_SCALES).cast::<i32>();
            // The group scales (8 or 16 per row), eight groups per transposition of dwords.
            let group_scales: [[i32; 16]; ROWS] = std::array::from_fn(|r| F::group_scales(&prep[r]));
            for half in 0..256 / F::GROUP / 8 {
                store_interleaved(scales.add(8 * ROWS * half).cast(), ROWS, |r| {
                    _mm256_loadu_si256(group_scales[r][8 * half..].as_ptr().cast())
                });
            }
            let mut d = [0.0f32; ROWS];
            let mut dmin = [0.0f32; ROWS];
            for r in 0..ROWS {
                d[r] = _mm256_cvtss_f32(prep[r].d);
                dmin[r] = _mm256_cvtss_f32(prep[r].dmin);
            }
            // Correction pairs: dword p of each row's `corr`, as steps of 8 interleaved rows.
            store_interleaved(out.add(K_CORR), ROWS, |r| prep[r].corr);
            _mm512_store_ps(out.add(K_D).cast(), _mm512_loadu_ps(d.as_ptr()));
            _mm512_store_ps(out.add(K_DMIN).cast(), _mm512_loadu_ps(dmin.as_ptr()));
        }
    }
}

/// One pass of `C` activation rows over a k-quant panel.
///
/// # Safety
/// Needs AVX-512 VNNI; `panel` was built for `nb` super-blocks and the rows of `a` hold as many.
#[inline(always)]
unsafe fn kquant_pass<F: KFormat, const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C]) -> [__m512; C] {
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); C];
        let steps = F::GROUP / 4;
        for b in 0..nb {
            let block = panel.add(b * K_BLOCK);
            let mut sums = [zero; C];
            for g in 0..256 / F::GROUP {
                let mut group = [zero; C];
                for s in 0..steps {
                    let step = g * steps + s;
                    let wv = _mm512_load_si512(block.add(64 * step).cast());
                    for c in 0..C {
                        let av = _mm512_set1_epi32(read_u32(a[c].q.add(b * Q8K_BYTES + 4 + 4 * step)) as i32);
                        group[c] = _mm512_dpbusd_epi32(group[c], wv, av);
                    }
                }
                let scale = _mm512_load_si512(block.add(K_SCALES + 64 * g).cast());
                for c in 0..C {
                    sums[c] = _mm512_add_epi32(sums[c], _mm512_mullo_epi32(group[c], scale));
                }
            }
            let mut corr = [zero; C];
            for p in 0..8 {
                let cv = _mm512_load_si512(block.add(K_CORR + 64 * p).cast());
                for c in 0..C {
                    let bsums = _mm512_set1_epi32(read_u32(a[c].q.add(b * Q8K_BYTES + 260 + 4 * p)) as i32);
                    corr[c] = _mm512_dpwssd_epi32(corr[c], cv, bsums);
                }
            }
            let d = _mm512_load_ps(block.add(K_D).cast());
            let dmin = _mm512_load_ps(block.add(K_DMIN).cast());
            for c in 0..C {
                let da = _mm512_set1_ps(a[c].q.add(b * Q8K_BYTES).cast::<f32>().read_unaligned());
                if F::OFFSET {
                    let total = _mm512_sub_epi32(sums[c], corr[c]);
                    acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, da), acc[c]);
                } else {
                    acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), _mm512_mul_ps(d, da), acc[c]);
                    acc[c] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(corr[c]), _mm512_mul_ps(dmin, da), acc[c]);
                }
            }
        }
        acc
    }
}

/// Elements per chunk of a float panel (16 rows of f32: 128 KiB, resident in L2).
const FLOAT_CHUNK: usize = 2048;

/// Activation rows per pass over a float panel: 8 chains of FMAs hide their latency.
const FLOAT_COLS: usize = 8;

/// Float weights: 16 rows widened to f32 and interleaved per element, `[k][ROWS]`, taken in
/// chunks of `FLOAT_CHUNK` elements; each activation element is broadcast to an FMA with the
/// 16 rows' weights.
///
/// # Safety
/// As [`TileFn`]; needs AVX2, FMA, F16C and AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn float_tile<F: FloatFormat>(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
    let rows = out.first().map_or(0, |o| o.len());
    let m = out.len();
    let k = x.nb;
    let mut panel = Panel::new(FLOAT_CHUNK.min(k) * 4 * ROWS);
    let p = panel.ptr();
    // SAFETY: all-zero bytes are valid vectors.
    let mut acc: Vec<__m512> = vec![unsafe { std::mem::zeroed() }; m];
    for r0 in (0..rows).step_by(ROWS) {
        let n = ROWS.min(rows - r0);
        acc.fill(_mm512_setzero_ps());
        for k0 in (0..k).step_by(FLOAT_CHUNK) {
            let kc = FLOAT_CHUNK.min(k - k0);
            unsafe {
                build_float::<F>(w.as_ptr().add(r0 * row_bytes + k0 * F::BYTES), row_bytes, n, kc, p);
                each_cols!(m, FLOAT_COLS, |c, C| {
                    let a: [*const f32; C] = std::array::from_fn(|i| x.arow(c + i).q.cast::<f32>().add(k0));
                    float_pass::<C>(p, kc, &a, &mut acc[c..c + C]);
                });
            }
        }
        unsafe { store_rows(&acc, out, r0, n) };
    }
}

/// Widens `kc` elements of `n` rows into the panel, element-major.
///
/// # Safety
/// Needs AVX-512 F; `n <= ROWS` rows holding `kc` elements at `w`, and a panel of `kc` elements.
#[inline(always)]
unsafe fn build_float<F: FloatFormat>(w: *const u8, row_bytes: usize, n: usize, kc: usize, panel: *mut u8) {
    unsafe {
        let full = kc / 8 * 8;
        for i0 in (0..full).step_by(8) {
            store_interleaved(panel.add(4 * ROWS * i0), n, |r| {
                _mm256_castps_si256(F::load8(w.add(r * row_bytes + i0 * F::BYTES)))
            });
        }
        for i in full..kc {
            let out = panel.add(4 * ROWS * i).cast::<f32>();
            for r in 0..ROWS {
                *out.add(r) = if r < n { F::load1(w.add(r * row_bytes + i * F::BYTES)) } else { 0.0 };
            }
        }
    }
}

/// Adds `kc` elements of the panel times `C` activation rows to `acc`. Even and odd elements
/// go to separate sums, so that even one column has two chains of FMAs.
///
/// # Safety
/// Needs AVX-512 F; `panel` holds `kc` elements, each `a[c]` `kc` floats; `acc.len() == C`.
#[inline(always)]
unsafe fn float_pass<const C: usize>(panel: *const u8, kc: usize, a: &[*const f32; C], acc: &mut [__m512]) {
    unsafe {
        let mut sums = [[_mm512_setzero_ps(); C]; 2];
        sums[0].copy_from_slice(acc);
        let mut i = 0;
        while i < kc {
            for (u, sums) in sums.iter_mut().enumerate().take(kc - i) {
                let wv = _mm512_load_ps(panel.add(4 * ROWS * (i + u)).cast());
                for c in 0..C {
                    sums[c] = _mm512_fmadd_ps(wv, _mm512_set1_ps(*a[c].add(i + u)), sums[c]);
                }
            }
            i += 2;
        }
        for c in 0..C {
            acc[c] = _mm512_add_ps(sums[0][c], sums[1][c]);
        }
    }
}

/// Bytes of one 32-element block of a packed MXFP4 panel: the 16 rows' codes transposed by
/// dwords ([`transpose_dwords`], four 64-byte vectors), then their 16 E8M0 scale bytes. The
/// same as the 16 rows' GGUF blocks, so weights are packed in place.
pub(crate) const MXFP4_PACKED_BLOCK: usize = 16 * 17;

/// Repacks MXFP4 rows in place, panel by panel of [`ROWS`] rows, into the layout
/// [`mxfp4_packed_tile`] reads: what [`legacy_tile`] would build per batch, done once (as
/// ik_llama.cpp's run-time repacking does), and kept at 4 bits.
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of 17).
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) unsafe fn pack_mxfp4(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, MXFP4_PACKED_BLOCK, |panel, b, out| {
        // SAFETY: the caller's AVX-512; each row holds block `b`'s 17 bytes.
        let d = unsafe { transpose_dwords(ROWS, |r| panel.as_ptr().add(r * row_bytes + b * 17 + 1)) };
        for (t, d) in d.iter().enumerate() {
            unsafe { _mm512_storeu_si512(out[64 * t..].as_mut_ptr().cast(), *d) };
        }
        for r in 0..ROWS {
            out[256 + r] = panel[r * row_bytes + b * 17];
        }
    });
}

/// Bytes of one 32-element block of a packed Q4_0 panel (16 rows, the same as their GGUF
/// blocks): the rows' 16 code bytes transposed by dwords ([`transpose_dwords`], four 64-byte
/// vectors; vector `t`'s low nibbles are elements `4 t..4 t + 4` of each row, its high nibbles
/// elements `16 + 4 t..`), then the rows' f16 scales.
pub(crate) const Q4_0_PACKED_BLOCK: usize = 16 * 18;
/// Where a packed Q4_0 or Q4_1 block keeps its scales (and Q4_1 its mins after them).
const Q4_SCALES: usize = 256;
const Q4_1_MINS: usize = 288;
/// Bytes of one 32-element block of a packed Q4_1 panel: Q4_0's, then the rows' f16 mins.
pub(crate) const Q4_1_PACKED_BLOCK: usize = 16 * 20;

/// Repacks 4-bit legacy rows in place, panel by panel, into the layout of [`pack_q4_0`]
/// (`with_min` false: blocks of an f16 scale and 16 code bytes) and [`pack_q4_1`] (true: an f16
/// min after the scale).
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of the format's block).
#[inline(always)]
unsafe fn pack_q4(w: &mut [u8], row_bytes: usize, with_min: bool) {
    let (block_bytes, codes) = if with_min { (20, 4) } else { (18, 2) };
    repack_panels(w, row_bytes, ROWS * block_bytes, |panel, b, out| {
        let row = |r: usize| r * row_bytes + b * block_bytes;
        // SAFETY: the caller's AVX-512; each row holds block `b`'s bytes.
        let d = unsafe { transpose_dwords(ROWS, |r| panel.as_ptr().add(row(r) + codes)) };
        for (t, d) in d.iter().enumerate() {
            unsafe { _mm512_storeu_si512(out[64 * t..].as_mut_ptr().cast(), *d) };
        }
        for r in 0..ROWS {
            out[Q4_SCALES + 2 * r..][..2].copy_from_slice(&panel[row(r)..][..2]);
            if with_min {
                out[Q4_1_MINS + 2 * r..][..2].copy_from_slice(&panel[row(r) + 2..][..2]);
            }
        }
    });
}

/// Repacks Q4_0 rows in place, panel by panel, into the layout [`q4_0_packed_tile`] reads.
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of 18).
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) unsafe fn pack_q4_0(w: &mut [u8], row_bytes: usize) {
    unsafe { pack_q4(w, row_bytes, false) }
}

/// Repacks Q4_1 rows in place, panel by panel, into the layout [`q4_1_packed_tile`] reads.
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of 20).
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) unsafe fn pack_q4_1(w: &mut [u8], row_bytes: usize) {
    unsafe { pack_q4(w, row_bytes, true) }
}

/// Bytes of one 32-element block of a packed Q5_0 panel (16 rows, the same as their GGUF
/// blocks): the rows' 16 code bytes transposed by dwords ([`transpose_dwords`], four 64-byte
/// vectors; vector `t`'s low nibbles are elements `4 t..4 t + 4` of each row, its high nibbles
/// elements `16 + 4 t..`), then the fifth bits as eight 64-bit masks `[t][low, high]` whose bit
/// `4 r + i` is row `r`'s bit of element `16 h + 4 t + i` (one masked byte add each), then the
/// rows' f16 scales.
pub(crate) const Q5_0_PACKED_BLOCK: usize = 16 * 22;
/// Where a packed Q5_0 block keeps its fifth bits' masks and its scales.
const Q5_0_MASKS: usize = 256;
const Q5_0_SCALES: usize = 320;

/// Repacks Q5_0 rows in place, panel by panel, into the layout [`q5_0_packed_tile`] reads.
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of 22).
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) unsafe fn pack_q5_0(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, Q5_0_PACKED_BLOCK, |panel, b, out| {
        let row = |r: usize| r * row_bytes + b * 22;
        // SAFETY: the caller's AVX-512; each row holds block `b`'s 22 bytes.
        let d = unsafe { transpose_dwords(ROWS, |r| panel.as_ptr().add(row(r) + 6)) };
        for (t, d) in d.iter().enumerate() {
            unsafe { _mm512_storeu_si512(out[64 * t..].as_mut_ptr().cast(), *d) };
        }
        for t in 0..4 {
            for h in 0..2 {
                let mask = (0..ROWS).fold(0u64, |mask, r| {
                    let qh = u32::from_le_bytes(panel[row(r) + 2..][..4].try_into().expect("4 bytes"));
                    mask | (((qh >> (16 * h + 4 * t)) & 0xf) as u64) << (4 * r)
                });
                out[Q5_0_MASKS + 8 * (2 * t + h)..][..8].copy_from_slice(&mask.to_le_bytes());
            }
        }
        for r in 0..ROWS {
            out[Q5_0_SCALES + 2 * r..][..2].copy_from_slice(&panel[row(r)..][..2]);
        }
    });
}

/// Bytes of one 32-element block of a packed Q8_0 panel (16 rows, the same as their GGUF
/// blocks): the rows' f16 scales, then their 32 quants transposed by dwords (eight 64-byte
/// vectors, vector `s` holding elements `4 s..4 s + 4` of each row). Scales first, as Q4_K's:
/// a pass reads each block in one ascending run.
pub(crate) const Q8_0_PACKED_BLOCK: usize = 16 * 34;
/// Where a packed Q8_0 block keeps its scales and its quants.
const Q8_0_SCALES: usize = 0;
const Q8_0_CODES: usize = 32;

/// Repacks Q8_0 rows in place, panel by panel, into the layout [`q8_0_packed_tile`] reads.
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of 34).
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) unsafe fn pack_q8_0(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, Q8_0_PACKED_BLOCK, |panel, b, out| {
        let row = |r: usize| r * row_bytes + b * 34;
        for half in 0..2 {
            // SAFETY: the caller's AVX-512; each row holds block `b`'s 34 bytes.
            let d = unsafe { transpose_dwords(ROWS, |r| panel.as_ptr().add(row(r) + 2 + 16 * half)) };
            for (t, d) in d.iter().enumerate() {
                unsafe { _mm512_storeu_si512(out[Q8_0_CODES + 256 * half + 64 * t..].as_mut_ptr().cast(), *d) };
            }
        }
        for r in 0..ROWS {
            out[Q8_0_SCALES + 2 * r..][..2].copy_from_slice(&panel[row(r)..][..2]);
        }
    });
}

/// Row `r` (< 16) of a packed panel's block `packed` (Q4_0, Q4_1, Q5_0, Q8_0 or MXFP4, as
/// the `pack_*` functions lay it out) back as its GGUF block, into
/// `out`; false for another type. For reading single rows (an embedding table that is also the
/// packed output head).
pub(crate) fn gguf_block_of_packed(ty: GgmlType, packed: &[u8], r: usize, out: &mut [u8]) -> bool {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            out[..2].copy_from_slice(&packed[Q4_SCALES + 2 * r..][..2]);
            let codes = if ty == GgmlType::Q4_1 {
                out[2..4].copy_from_slice(&packed[Q4_1_MINS + 2 * r..][..2]);
                4
            } else {
                2
            };
            for t in 0..4 {
                out[codes + 4 * t..][..4].copy_from_slice(&packed[64 * t + 4 * r..][..4]);
            }
        }
        GgmlType::Q5_0 => {
            out[..2].copy_from_slice(&packed[Q5_0_SCALES + 2 * r..][..2]);
            let mut qh = 0u32;
            for t in 0..4 {
                out[6 + 4 * t..][..4].copy_from_slice(&packed[64 * t + 4 * r..][..4]);
                for h in 0..2 {
                    let mask =
                        u64::from_le_bytes(packed[Q5_0_MASKS + 8 * (2 * t + h)..][..8].try_into().expect("8 bytes"));
                    qh |= (((mask >> (4 * r)) & 0xf) as u32) << (16 * h + 4 * t);
                }
            }
            out[2..6].copy_from_slice(&qh.to_le_bytes());
        }
        GgmlType::Q8_0 => {
            out[..2].copy_from_slice(&packed[Q8_0_SCALES + 2 * r..][..2]);
            for s in 0..8 {
                out[2 + 4 * s..][..4].copy_from_slice(&packed[Q8_0_CODES + 64 * s + 4 * r..][..4]);
            }
        }
        GgmlType::MXFP4 => {
            out[0] = packed[256 + r];
            for t in 0..4 {
                out[1 + 4 * t..][..4].copy_from_slice(&packed[64 * t + 4 * r..][..4]);
            }
        }
        _ => return false,
    }
    true
}

/// Repacks whole panels of `row_bytes` rows in place: `block(panel, b, out)` writes block `b`
/// of the 16 rows at `panel` into `out` (`block_bytes`, the size of the rows' blocks).
fn repack_panels(w: &mut [u8], row_bytes: usize, block_bytes: usize, block: impl Fn(&[u8], usize, &mut [u8])) {
    let mut packed = vec![0u8; ROWS * row_bytes];
    for panel in w.chunks_exact_mut(ROWS * row_bytes) {
        for (b, out) in packed.chunks_exact_mut(block_bytes).enumerate() {
            block(panel, b, out);
        }
        panel.copy_from_slice(&packed);
    }
}

/// Defines `$name`, the kernel on panels packed as `$pass` reads them, for any number of
/// activation rows: no panel is built, so decode and small batches read the weights once, at
/// 4 bits. The pass asks for the weights ahead of its reads in batches, and in decode where
/// [`decode_asks_ahead`] says, `$decode_ahead` being the format's own choice (see [`q4k_packed_pass`]). (A macro, not a
/// generic over the pass: that measured 1.4x slower, its pass not inlined as well.)
macro_rules! packed_tile {
    ($(#[$doc:meta])* $name:ident, $pass:ident, decode_ahead: $decode_ahead:literal) => {
        packed_tile!($(#[$doc])* $name, $pass[], decode_ahead: $decode_ahead);
    };
    ($(#[$doc:meta])* $name:ident, $pass:ident[$($pg:ty)?], decode_ahead: $decode_ahead:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// As [`TileFn`], with `w` packed and the rows a whole number of panels; needs AVX2,
        /// FMA, F16C and AVX-512 F, BW, VL and VNNI.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(crate) unsafe fn $name(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
            let rows = out.first().map_or(0, |o| o.len());
            let m = out.len();
            let ahead = m > 1 || decode_asks_ahead($decode_ahead);
            for r0 in (0..rows).step_by(ROWS) {
                let p = w[r0 * row_bytes..].as_ptr();
                unsafe {
                    each_cols!(m, COLS, |c, C| {
                        let a: [ARow; C] = std::array::from_fn(|i| x.arow(c + i));
                        let acc = $pass::<$($pg,)? C>(p, x.nb, &a, ahead);
                        store_rows(&acc, &mut out[c..c + C], r0, ROWS);
                    });
                }
            }
        }
    };
}

packed_tile!(
    /// MXFP4 packed by [`pack_mxfp4`].
    mxfp4_packed_tile,
    mxfp4_packed_pass,
    decode_ahead: true
);

packed_tile!(
    /// Q4_K packed by [`pack_q4k`].
    q4k_packed_tile,
    q4k_packed_pass,
    decode_ahead: false
);

/// Defines `$name`, the kernel on Q5_0, Q8_0 or Q6_K rows packed as `$pass` reads them: decode
/// and small batches go to `$direct`, which reads the packed blocks ([`packed_tile!`] over
/// `$pass`); larger batches unpack each panel once into the batch kernel's panel (`$unpack`:
/// [`legacy_tile`]'s, or [`kquant_tile`]'s for Q6_K) and run its pass over it, which unpacks
/// nothing per activation row. Both give the same sums, bit for bit. (The two paths in one
/// function made the packed Q6_K pass 4x slower: 60 -> 260 µs at 4864x1024.)
macro_rules! packed_legacy_tile {
    ($(#[$doc:meta])* $name:ident, $direct:ident, $format:ty, decode_ahead: $decode_ahead:literal) => {
        packed_legacy_tile!($(#[$doc])* $name, $direct, $format, packed_legacy_pass[$format], unpack_legacy[$format],
            legacy_pass, LEGACY_BLOCK, PACKED_UNPACK_MIN, decode_ahead: $decode_ahead);
    };
    ($(#[$doc:meta])* $name:ident, $direct:ident, $format:ty, $pass:ident[$($pg:ty)?], $unpack:ident[$($ug:ty)?],
        $built_pass:ident, $built_block:expr, $from:expr, decode_ahead: $decode_ahead:literal) => {
        packed_tile!(
            /// The packed blocks read on every pass: decode and small batches.
            $direct,
            $pass[$($pg)?],
            decode_ahead: $decode_ahead
        );

        $(#[$doc])*
        ///
        /// # Safety
        /// As [`TileFn`], with `w` packed and the rows a whole number of panels; needs AVX2,
        /// FMA, F16C and AVX-512 F, BW, VL and VNNI.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub(crate) unsafe fn $name(w: &[u8], row_bytes: usize, x: &ActView, out: &mut [&mut [f32]]) {
            let m = out.len();
            if m < $from {
                return unsafe { $direct(w, row_bytes, x, out) };
            }
            let rows = out.first().map_or(0, |o| o.len());
            let nb = x.nb;
            let mut panel = Panel::new(nb * $built_block);
            let built = panel.ptr();
            for r0 in (0..rows).step_by(ROWS) {
                let p = w[r0 * row_bytes..].as_ptr();
                unsafe {
                    $unpack::<$($ug)?>(p, nb, built);
                    each_cols!(m, COLS, |c, C| {
                        let a: [ARow; C] = std::array::from_fn(|i| x.arow(c + i));
                        let acc = $built_pass::<$format, C>(built, nb, &a);
                        store_rows(&acc, &mut out[c..c + C], r0, ROWS);
                    });
                }
            }
        }
    };
}

/// The smallest batch for which a packed Q4_0, Q4_1, Q5_0 or Q8_0 tile unpacks its panels once rather than
/// reading the packed blocks on every pass.
const PACKED_UNPACK_MIN: usize = 32;

/// The same for Q6_K, whose codes cost more to unpack on every pass.
const Q6K_UNPACK_MIN: usize = 2;

packed_legacy_tile!(
    /// Q4_0 packed by [`pack_q4_0`].
    q4_0_packed_tile,
    q4_0_packed_direct,
    Q4_0,
    decode_ahead: true
);

packed_legacy_tile!(
    /// Q4_1 packed by [`pack_q4_1`].
    q4_1_packed_tile,
    q4_1_packed_direct,
    Q4_1,
    decode_ahead: true
);

packed_legacy_tile!(
    /// Q5_0 packed by [`pack_q5_0`].
    q5_0_packed_tile,
    q5_0_packed_direct,
    Q5_0,
    decode_ahead: true
);

packed_legacy_tile!(
    /// Q6_K packed by [`pack_q6k`]: its packed pass unpacks the codes on every pass, so larger
    /// batches unpack each panel once into [`kquant_tile`]'s panel instead.
    q6k_packed_tile,
    q6k_packed_direct,
    Q6K,
    q6k_packed_pass[],
    unpack_q6k[],
    kquant_pass,
    K_BLOCK,
    Q6K_UNPACK_MIN,
    decode_ahead: false
);

packed_legacy_tile!(
    /// Q8_0 packed by [`pack_q8_0`].
    q8_0_packed_tile,
    q8_0_packed_direct,
    Q8_0,
    decode_ahead: false
);

/// A legacy format's packed block ([`pack_q4_0`], [`pack_q4_1`], [`pack_q5_0`], [`pack_q8_0`]):
/// its size, where its f16 scales (and mins) are, and its eight steps as unsigned values (plus the format's offset), step `s`
/// holding elements `4 s..4 s + 4` of each row, as [`legacy_tile`]'s panel does.
trait PackedLegacy: Format {
    const PACKED_BLOCK: usize;
    const PACKED_SCALES: usize;
    /// Where the rows' f16 mins are, for formats with a min (Q4_1).
    const PACKED_MINS: Option<usize> = None;
    /// # Safety
    /// Needs AVX-512 F and BW; `block` points at a whole packed block.
    unsafe fn steps(block: *const u8) -> [__m512i; 8];
}

/// Vector `t`'s low nibbles are step `t`, its high ones step `4 + t`.
///
/// # Safety
/// Needs AVX-512 F and BW; `block` points at a whole packed Q4_0 or Q4_1 block.
#[inline(always)]
unsafe fn q4_steps(block: *const u8) -> [__m512i; 8] {
    unsafe {
        let v: [__m512i; 4] = std::array::from_fn(|t| _mm512_loadu_si512(block.add(64 * t).cast()));
        std::array::from_fn(|s| nibbles512(v[s % 4], s >= 4))
    }
}

impl PackedLegacy for Q4_0 {
    const PACKED_BLOCK: usize = Q4_0_PACKED_BLOCK;
    const PACKED_SCALES: usize = Q4_SCALES;
    #[inline(always)]
    unsafe fn steps(block: *const u8) -> [__m512i; 8] {
        unsafe { q4_steps(block) }
    }
}

impl PackedLegacy for Q4_1 {
    const PACKED_BLOCK: usize = Q4_1_PACKED_BLOCK;
    const PACKED_SCALES: usize = Q4_SCALES;
    const PACKED_MINS: Option<usize> = Some(Q4_1_MINS);
    #[inline(always)]
    unsafe fn steps(block: *const u8) -> [__m512i; 8] {
        unsafe { q4_steps(block) }
    }
}

impl PackedLegacy for Q5_0 {
    const PACKED_BLOCK: usize = Q5_0_PACKED_BLOCK;
    const PACKED_SCALES: usize = Q5_0_SCALES;
    /// Vector `t`'s low nibbles are step `t`, its high ones step `4 + t`, each with its fifth
    /// bits added (one masked byte add).
    #[inline(always)]
    unsafe fn steps(block: *const u8) -> [__m512i; 8] {
        unsafe {
            let fifth = _mm512_set1_epi8(0x10);
            let masks = block.add(Q5_0_MASKS).cast::<u64>();
            let mut steps = [_mm512_setzero_si512(); 8];
            for t in 0..4 {
                let v = _mm512_loadu_si512(block.add(64 * t).cast());
                let (lo, hi) = (nibbles512(v, false), nibbles512(v, true));
                steps[t] = _mm512_mask_add_epi8(lo, masks.add(2 * t).read_unaligned(), lo, fifth);
                steps[4 + t] = _mm512_mask_add_epi8(hi, masks.add(2 * t + 1).read_unaligned(), hi, fifth);
            }
            steps
        }
    }
}

impl PackedLegacy for Q8_0 {
    const PACKED_BLOCK: usize = Q8_0_PACKED_BLOCK;
    const PACKED_SCALES: usize = Q8_0_SCALES;
    /// Vector `s` made unsigned (plus 128).
    #[inline(always)]
    unsafe fn steps(block: *const u8) -> [__m512i; 8] {
        unsafe {
            let flip = _mm512_set1_epi8(-128);
            std::array::from_fn(|s| _mm512_xor_si512(_mm512_loadu_si512(block.add(Q8_0_CODES + 64 * s).cast()), flip))
        }
    }
}

/// The 16 rows' scales of a packed legacy block.
///
/// # Safety
/// Needs AVX-512 F; `block` points at a whole packed block of `F`.
#[inline(always)]
unsafe fn packed_scales<F: PackedLegacy>(block: *const u8) -> __m512 {
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(block.add(F::PACKED_SCALES).cast())) }
}

/// A packed Q4_0, Q4_1, Q5_0 or Q8_0 panel of `nb` blocks unpacked into [`legacy_tile`]'s panel.
///
/// # Safety
/// Needs AVX-512 F and BW; `packed` holds `nb` packed blocks, `panel` room for `nb` legacy
/// blocks, 64-byte aligned.
#[inline(always)]
unsafe fn unpack_legacy<F: PackedLegacy>(packed: *const u8, nb: usize, panel: *mut u8) {
    unsafe {
        for b in 0..nb {
            let (block, out) = (packed.add(b * F::PACKED_BLOCK), panel.add(b * LEGACY_BLOCK));
            for (s, step) in F::steps(block).iter().enumerate() {
                _mm512_store_si512(out.add(64 * s).cast(), *step);
            }
            _mm512_store_ps(out.add(32 * ROWS).cast(), packed_scales::<F>(block));
            if let Some(mins) = F::PACKED_MINS {
                _mm512_store_ps(out.add(36 * ROWS).cast(), _mm512_cvtph_ps(_mm256_loadu_si256(block.add(mins).cast())));
            }
        }
    }
}

/// A packed Q6_K panel of `nb` super-blocks unpacked into [`kquant_tile`]'s panel: the codes'
/// steps as [`store_q6k_steps`] lays them out, the group scales as i32 `[16][row]`, the offset's
/// correction pairs (32 times each pair of scales, as `Q6K::prepare`'s) and `d`; the same
/// values [`build_kquant`] makes from the GGUF blocks.
///
/// # Safety
/// Needs AVX-512 F and BW; `packed` holds `nb` packed super-blocks, `panel` room for `nb`
/// k-quant blocks, 64-byte aligned.
#[inline(always)]
unsafe fn unpack_q6k(packed: *const u8, nb: usize, panel: *mut u8) {
    unsafe {
        let three = _mm512_set1_epi8(3);
        for b in 0..nb {
            let (block, out) = (packed.add(b * Q6K_PACKED_BLOCK), panel.add(b * K_BLOCK));
            let load = |at: usize| _mm512_loadu_si512(block.add(at).cast());
            for half in 0..2 {
                for part in 0..2 {
                    let base = Q6K_CODES + 256 * 3 * (2 * half + part);
                    for t in 0..4 {
                        let (lo, hi, bits) =
                            (load(base + 64 * t), load(base + 256 + 64 * t), load(base + 512 + 64 * t));
                        for k in 0..4 {
                            let low = nibbles512(if k % 2 == 0 { lo } else { hi }, k >= 2);
                            let high = _mm512_srlv_epi32(bits, _mm512_set1_epi32(2 * k as i32));
                            let q = _mm512_or_si512(low, _mm512_slli_epi32::<4>(_mm512_and_si512(high, three)));
                            _mm512_store_si512(out.add(512 * (4 * half + k) + 64 * (4 * part + t)).cast(), q);
                        }
                    }
                }
            }
            let scales: [__m512i; 4] = std::array::from_fn(|j| load(Q6K_SCALES + 64 * j));
            let scale = |g: usize| {
                _mm512_srai_epi32::<24>(_mm512_sllv_epi32(scales[g / 4], _mm512_set1_epi32(24 - 8 * (g % 4) as i32)))
            };
            for g in 0..16 {
                _mm512_store_si512(out.add(K_SCALES + 64 * g).cast(), scale(g));
            }
            for p in 0..8 {
                let (s0, s1) = (_mm512_slli_epi32::<5>(scale(2 * p)), _mm512_slli_epi32::<5>(scale(2 * p + 1)));
                let pair =
                    _mm512_or_si512(_mm512_and_si512(s0, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32::<16>(s1));
                _mm512_store_si512(out.add(K_CORR + 64 * p).cast(), pair);
            }
            _mm512_store_ps(out.add(K_D).cast(), _mm512_cvtph_ps(_mm256_loadu_si256(block.add(Q6K_D).cast())));
            _mm512_store_ps(out.add(K_DMIN).cast(), _mm512_setzero_ps());
        }
    }
}

/// One pass of `C` activation rows over a packed Q4_0, Q4_1, Q5_0 or Q8_0 panel of `nb` blocks:
/// per lane (weight row), the dot product as [`legacy_pass`] computes it from a built panel, bit
/// for bit. `ahead` as for [`q4k_packed_pass`]: on a Zen 4 Q8_0's decode reads faster without
/// the asking since its scales come first (one thread, alternating: Gemma 3's tied head 6.9-7.6 ms a
/// step against 7.6-9.4, the gpt-oss cut's 23.5-24.2 against 24.8-25.6); Q4_0, Q4_1 and Q5_0,
/// whose scales stay after their codes, ask in decode too (without, a Q5_0 head read faster
/// alone but Qwen2.5's products slower in the model).
///
/// # Safety
/// Needs AVX-512 VNNI; `panel` holds `nb` packed blocks and the rows of `a` as many Q8_0 (Q8_1
/// for Q4_1) blocks.
#[inline(always)]
unsafe fn packed_legacy_pass<F: PackedLegacy, const C: usize>(
    panel: *const u8,
    nb: usize,
    a: &[ARow; C],
    ahead: bool,
) -> [__m512; C] {
    let (a_bytes, a_qs) = F::ACT_BLOCK;
    unsafe {
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            let block = panel.add(b * F::PACKED_BLOCK);
            // Into L1, where the other formats' passes prefetch into L2 (`prefetch_ahead_l1`).
            if ahead {
                crate::simd::prefetch_ahead_l1(block, F::PACKED_BLOCK);
            }
            // A signed format's offset is taken back through the block sums.
            let mut sums: [__m512i; C] = match F::OFFSET_LOG2 {
                Some(log2) => std::array::from_fn(|c| _mm512_set1_epi32(*a[c].neg_sums.add(b) << log2)),
                None => [_mm512_setzero_si512(); C],
            };
            for (s, step) in F::steps(block).iter().enumerate() {
                for c in 0..C {
                    let q = a[c].q.add(b * a_bytes + a_qs + 4 * s);
                    sums[c] = _mm512_dpbusd_epi32(sums[c], *step, _mm512_set1_epi32(read_u32(q) as i32));
                }
            }
            let scales = packed_scales::<F>(block);
            for c in 0..C {
                let d = _mm512_mul_ps(scales, _mm512_set1_ps(*a[c].d.add(b)));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), d, acc[c]);
            }
            if let Some(at) = F::PACKED_MINS {
                let mins = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(at).cast()));
                for c in 0..C {
                    acc[c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(*a[c].s.add(b)), acc[c]);
                }
            }
        }
        acc
    }
}

/// One pass of `C` activation rows over a packed MXFP4 panel of `nb` blocks: per lane (weight
/// row), the dot product, with the codes unpacked (a lookup of each nibble) as they are read.
///
/// # Safety
/// Needs AVX-512 VNNI; `panel` holds `nb` packed blocks and the rows of `a` as many Q8_0 blocks.
#[inline(always)]
unsafe fn mxfp4_packed_pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m512; C] {
    unsafe {
        let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(crate::mxfp4::UNSIGNED_VALUES.as_ptr().cast()));
        let value = |c: __m512i| _mm512_shuffle_epi8(lut, c);
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            let block = panel.add(b * MXFP4_PACKED_BLOCK);
            // Decode reads the weights from memory once; a batch's first pass over a panel
            // does too, and its later passes warm the next panel (16 KiB ahead).
            if ahead {
                crate::simd::prefetch_ahead(block, MXFP4_PACKED_BLOCK);
            }
            // Codes are unsigned values plus 16: taken back through the block sums.
            let mut sums: [__m512i; C] = std::array::from_fn(|c| _mm512_set1_epi32(*a[c].neg_sums.add(b) << 4));
            for t in 0..4 {
                let d = _mm512_loadu_si512(block.add(64 * t).cast());
                // Elements 4t.. (low nibbles) and 16 + 4t.. (high) of each row.
                let (lo, hi) = (value(nibbles512(d, false)), value(nibbles512(d, true)));
                for c in 0..C {
                    let q = a[c].q.add(b * 34 + 2);
                    sums[c] = _mm512_dpbusd_epi32(sums[c], lo, _mm512_set1_epi32(read_u32(q.add(4 * t)) as i32));
                    sums[c] = _mm512_dpbusd_epi32(sums[c], hi, _mm512_set1_epi32(read_u32(q.add(16 + 4 * t)) as i32));
                }
            }
            let scales = e8m0_half(_mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(256).cast())));
            for c in 0..C {
                let d = _mm512_mul_ps(scales, _mm512_set1_ps(*a[c].d.add(b)));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), d, acc[c]);
            }
        }
        acc
    }
}

/// Half of each E8M0 scale `2^(e - 127)` (MXFP4 values are stored doubled), from bits as
/// ggml-impl.h's `ggml_e8m0_to_fp32_half`: `(e - 1) << 23`, or `0x200000 << e` below 2.
///
/// # Safety
/// Needs AVX-512 F.
#[inline(always)]
unsafe fn e8m0_half(e: __m512i) -> __m512 {
    unsafe {
        let normal = _mm512_slli_epi32::<23>(_mm512_sub_epi32(e, _mm512_set1_epi32(1)));
        let tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x0020_0000), e);
        let is_normal = _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(1));
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_normal, tiny, normal))
    }
}

/// Bytes of one 256-element super-block of a packed Q4_K panel (16 rows, the same as their GGUF
/// blocks): the rows' 12 scale bytes as three dwords `[j][row]` (192 bytes), each row's `d` and
/// `dmin` as one dword `[row]` (64), then the codes `[chunk pair i][half h][step t][row][4]`
/// (2048; [`transpose_dwords`] of bytes `16 + 32 i + 16 h` of each row, whose low nibbles are
/// chunk `2 i` and high nibbles chunk `2 i + 1`). What a pass reads first comes first, so that
/// it reads each block in one ascending run (see [`q4k_packed_pass`]).
pub(crate) const Q4K_PACKED_BLOCK: usize = 16 * 144;
/// Where a packed Q4_K block keeps its scale dwords, its `d` and `dmin`, and its codes.
const Q4K_SCALES: usize = 0;
const Q4K_D: usize = 192;
const Q4K_CODES: usize = 256;

/// Repacks Q4_K rows in place, panel by panel, into the layout [`q4k_packed_tile`] reads.
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of 144).
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) unsafe fn pack_q4k(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, Q4K_PACKED_BLOCK, |panel, b, out| {
        let row = |r: usize| r * row_bytes + b * 144;
        for i in 0..4 {
            for h in 0..2 {
                // SAFETY: the caller's AVX-512; each row holds super-block `b`'s 144 bytes.
                let d = unsafe { transpose_dwords(ROWS, |r| panel.as_ptr().add(row(r) + 16 + 32 * i + 16 * h)) };
                for (t, d) in d.iter().enumerate() {
                    let at = Q4K_CODES + 512 * i + 256 * h + 64 * t;
                    unsafe { _mm512_storeu_si512(out[at..].as_mut_ptr().cast(), *d) };
                }
            }
        }
        for r in 0..ROWS {
            for j in 0..3 {
                out[Q4K_SCALES + 64 * j + 4 * r..][..4].copy_from_slice(&panel[row(r) + 4 + 4 * j..][..4]);
            }
            out[Q4K_D + 4 * r..][..4].copy_from_slice(&panel[row(r)..][..4]);
        }
    });
}

/// One pass of `C` activation rows (Q8_K) over a packed Q4_K panel of `nb` super-blocks: per
/// lane (weight row), `d Σ_g scale_g (q_g · a_g) - dmin Σ_g min_g bsum_g`, times the
/// activations' `d`. The 6-bit scales and mins are unpacked for all 16 rows at once, as
/// ts-quant's `scale_min_k4` does for one.
///
/// `ahead`: whether to ask for the weights [`crate::simd::PREFETCH_AHEAD`] bytes ahead of the
/// reads. Each block is read in one ascending run, which a Zen 4's prefetchers follow: there
/// decode reads faster without the asking, batches with it (one thread, the qwen3 cut,
/// alternating runs: decode's attention products 3.19-3.33 ms a step without against 3.88-4.08
/// with, its Q4_K down projections faster too; 128-token prompts 429-439 tok/s with, 370-400
/// without). A 16-core Xeon's decode needs the asking (qwen3-30b-a3b 1.2-1.4x faster with it),
/// so [`decode_asks_ahead`] decides per processor (docs/BENCHMARKS.md, twenty-ninth and
/// thirtieth sessions).
///
/// # Safety
/// Needs AVX-512 VNNI; `panel` holds `nb` packed super-blocks and the rows of `a` as many Q8_K
/// blocks.
#[inline(always)]
unsafe fn q4k_packed_pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m512; C] {
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); C];
        let set = |v: u32| _mm512_set1_epi32(v as i32);
        for b in 0..nb {
            let block = panel.add(b * Q4K_PACKED_BLOCK);
            // As in the MXFP4 pass: every pass of a batch, so that later passes warm the next
            // panel. The scales' lines here, each chunk pair's before its codes are read: a
            // block's 36 lines asked for at once read from memory at 77-85% of a plain read on
            // one thread, spread out at 88-99% (Zen 4, `matmul_bench --packed --head 151936,2048`).
            if ahead {
                crate::simd::prefetch_ahead(block.add(Q4K_SCALES), Q4K_CODES - Q4K_SCALES);
            }
            // Words a, b, c of each row's scale bytes; groups 0-3 in the low words, 4-7 in the high.
            let load = |at: usize| _mm512_loadu_si512(block.add(at).cast());
            let (wa, wb, wc) = (load(Q4K_SCALES), load(Q4K_SCALES + 64), load(Q4K_SCALES + 128));
            let top =
                |v: __m512i| _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(v), set(0x0303_0303)));
            let scales = [
                _mm512_and_si512(wa, set(0x3f3f_3f3f)),
                _mm512_or_si512(_mm512_and_si512(wc, set(0x0f0f_0f0f)), top(wa)),
            ];
            let mins = [
                _mm512_and_si512(wb, set(0x3f3f_3f3f)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(wc), set(0x0f0f_0f0f)), top(wb)),
            ];
            // Byte g % 4 of each lane, for group g.
            let byte = |v: &[__m512i; 2], g: usize| {
                _mm512_and_si512(_mm512_srlv_epi32(v[g / 4], set(8 * (g % 4) as u32)), set(0xff))
            };
            let dd = load(Q4K_D);
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
            let mut sums = [zero; C];
            for i in 0..4 {
                if ahead {
                    crate::simd::prefetch_ahead(block.add(Q4K_CODES + 512 * i), 512);
                }
                let (mut lo, mut hi) = ([zero; C], [zero; C]);
                for h in 0..2 {
                    for t in 0..4 {
                        let v = load(Q4K_CODES + 512 * i + 256 * h + 64 * t);
                        let (vl, vh) = (nibbles512(v, false), nibbles512(v, true));
                        let s = 4 * h + t;
                        for c in 0..C {
                            let q = a[c].q.add(b * Q8K_BYTES + 4);
                            let al = _mm512_set1_epi32(read_u32(q.add(32 * (2 * i) + 4 * s)) as i32);
                            let ah = _mm512_set1_epi32(read_u32(q.add(32 * (2 * i + 1) + 4 * s)) as i32);
                            lo[c] = _mm512_dpbusd_epi32(lo[c], vl, al);
                            hi[c] = _mm512_dpbusd_epi32(hi[c], vh, ah);
                        }
                    }
                }
                let (s_lo, s_hi) = (byte(&scales, 2 * i), byte(&scales, 2 * i + 1));
                for c in 0..C {
                    let both = _mm512_add_epi32(_mm512_mullo_epi32(lo[c], s_lo), _mm512_mullo_epi32(hi[c], s_hi));
                    sums[c] = _mm512_add_epi32(sums[c], both);
                }
            }
            // Mins of groups 2j and 2j + 1 as an i16 pair per lane, against the activations'
            // sums over those groups (two bsums of 16 each), also as an i16 pair.
            let pairs: [__m512i; 4] = std::array::from_fn(|j| {
                let (m0, m1) = (byte(&mins, 2 * j), byte(&mins, 2 * j + 1));
                _mm512_or_si512(m0, _mm512_slli_epi32::<16>(m1))
            });
            for c in 0..C {
                let bsums = a[c].q.add(b * Q8K_BYTES + 260).cast::<i16>();
                let group =
                    |g: usize| bsums.add(2 * g).read_unaligned() as i32 + bsums.add(2 * g + 1).read_unaligned() as i32;
                let mut corr = zero;
                for (j, pair) in pairs.iter().enumerate() {
                    let packed = (group(2 * j) as u32 & 0xffff) | (group(2 * j + 1) as u32) << 16;
                    corr = _mm512_dpwssd_epi32(corr, *pair, _mm512_set1_epi32(packed as i32));
                }
                let da = _mm512_set1_ps(a[c].q.add(b * Q8K_BYTES).cast::<f32>().read_unaligned());
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), _mm512_mul_ps(d, da), acc[c]);
                acc[c] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(corr), _mm512_mul_ps(dmin, da), acc[c]);
            }
        }
        acc
    }
}

/// Bytes of one super-block of a packed Q6_K panel (16 rows, the same as their GGUF blocks):
/// the rows' 16 signed group scales as four dword vectors `[j][row]` (256 bytes), the rows' f16
/// `d` (32), then for each half `h` and part `p` of the block the [`transpose_dwords`] of three
/// 16-byte runs of each row (`ql[64 h + 16 p..]`, `ql[64 h + 32 + 16 p..]`, `qh[32 h + 16 p..]`,
/// as [`store_q6k_steps`] reads them; 3072). Read in one ascending run, as Q4_K's.
pub(crate) const Q6K_PACKED_BLOCK: usize = 16 * 210;
/// Where a packed Q6_K block keeps its scales, its `d` and its codes.
const Q6K_SCALES: usize = 0;
const Q6K_D: usize = 256;
const Q6K_CODES: usize = 288;

/// Repacks Q6_K rows in place, panel by panel, into the layout [`q6k_packed_tile`] reads.
///
/// # Safety
/// Needs AVX-512 F and BW; `w` holds whole panels of `row_bytes` rows (`row_bytes` a multiple
/// of 210).
#[target_feature(enable = "avx2,avx512f,avx512bw")]
pub(crate) unsafe fn pack_q6k(w: &mut [u8], row_bytes: usize) {
    repack_panels(w, row_bytes, Q6K_PACKED_BLOCK, |panel, b, out| {
        let row = |r: usize| r * row_bytes + b * 210;
        for half in 0..2 {
            for part in 0..2 {
                for (which, offset) in [64 * half, 64 * half + 32, 128 + 32 * half].into_iter().enumerate() {
                    // SAFETY: the caller's AVX-512; each row holds super-block `b`'s 210 bytes.
                    let d = unsafe { transpose_dwords(ROWS, |r| panel.as_ptr().add(row(r) + offset + 16 * part)) };
                    let at = Q6K_CODES + 256 * (3 * (2 * half + part) + which);
                    for (t, d) in d.iter().enumerate() {
                        unsafe { _mm512_storeu_si512(out[at + 64 * t..].as_mut_ptr().cast(), *d) };
                    }
                }
            }
        }
        for r in 0..ROWS {
            for j in 0..4 {
                out[Q6K_SCALES + 64 * j + 4 * r..][..4].copy_from_slice(&panel[row(r) + 192 + 4 * j..][..4]);
            }
            out[Q6K_D + 2 * r..][..2].copy_from_slice(&panel[row(r) + 208..][..2]);
        }
    });
}

/// One pass of `C` activation rows (Q8_K) over a packed Q6_K panel of `nb` super-blocks: per
/// lane (weight row), `d (Σ_g scale_g (q_g · a_g) - 32 Σ_g scale_g bsum_g)` times the
/// activations' `d` (quants are stored as level + 32), with the 6-bit codes put together as
/// [`store_q6k_steps`] does as they are read.
///
/// `ahead` as for [`q4k_packed_pass`] (one thread, Zen 4, the qwen3 cut's Q6_K down projections
/// in decode: 2.58-2.68 ms a step without against 2.88-2.97 with).
///
/// # Safety
/// Needs AVX-512 VNNI; `panel` holds `nb` packed super-blocks and the rows of `a` as many Q8_K
/// blocks.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // k is the chunk, the shift and the index alike
unsafe fn q6k_packed_pass<const C: usize>(panel: *const u8, nb: usize, a: &[ARow; C], ahead: bool) -> [__m512; C] {
    unsafe {
        let zero = _mm512_setzero_si512();
        let three = _mm512_set1_epi8(3);
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            let block = panel.add(b * Q6K_PACKED_BLOCK);
            // As in the Q4_K pass, spread over the block (one thread from memory: 67-70% of a
            // plain read asked for at once, 90-93% spread).
            if ahead {
                crate::simd::prefetch_ahead(block.add(Q6K_SCALES), Q6K_CODES - Q6K_SCALES);
            }
            let load = |at: usize| _mm512_loadu_si512(block.add(at).cast());
            let scales: [__m512i; 4] = std::array::from_fn(|j| load(Q6K_SCALES + 64 * j));
            // Group g's scale, sign-extended from byte g % 4 of its dword.
            let scale = |g: usize| {
                let v = _mm512_sllv_epi32(scales[g / 4], _mm512_set1_epi32(24 - 8 * (g % 4) as i32));
                _mm512_srai_epi32::<24>(v)
            };
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(Q6K_D).cast()));
            let mut sums = [zero; C];
            for half in 0..2 {
                for part in 0..2 {
                    let base = Q6K_CODES + 256 * 3 * (2 * half + part);
                    if ahead {
                        crate::simd::prefetch_ahead(block.add(base), 768);
                    }
                    let mut groups = [[zero; 4]; C];
                    for t in 0..4 {
                        let (lo, hi, bits) =
                            (load(base + 64 * t), load(base + 256 + 64 * t), load(base + 512 + 64 * t));
                        for k in 0..4 {
                            let low = nibbles512(if k % 2 == 0 { lo } else { hi }, k >= 2);
                            let high = match k {
                                0 => bits,
                                1 => _mm512_srli_epi32::<2>(bits),
                                2 => _mm512_srli_epi32::<4>(bits),
                                _ => _mm512_srli_epi32::<6>(bits),
                            };
                            let q = _mm512_or_si512(low, _mm512_slli_epi32::<4>(_mm512_and_si512(high, three)));
                            // Chunk 4 half + k, step 4 part + t.
                            let at = b * Q8K_BYTES + 4 + 32 * (4 * half + k) + 4 * (4 * part + t);
                            for c in 0..C {
                                let av = _mm512_set1_epi32(read_u32(a[c].q.add(at)) as i32);
                                groups[c][k] = _mm512_dpbusd_epi32(groups[c][k], q, av);
                            }
                        }
                    }
                    for k in 0..4 {
                        let s = scale(2 * (4 * half + k) + part);
                        for c in 0..C {
                            sums[c] = _mm512_add_epi32(sums[c], _mm512_mullo_epi32(groups[c][k], s));
                        }
                    }
                }
            }
            // Scales of groups 2p and 2p + 1 as an i16 pair per lane, against the bsums pair.
            let pairs: [__m512i; 8] = std::array::from_fn(|p| {
                let (s0, s1) = (scale(2 * p), scale(2 * p + 1));
                _mm512_or_si512(_mm512_and_si512(s0, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32::<16>(s1))
            });
            for c in 0..C {
                let mut corr = zero;
                for (p, pair) in pairs.iter().enumerate() {
                    let bsums = read_u32(a[c].q.add(b * Q8K_BYTES + 260 + 4 * p)) as i32;
                    corr = _mm512_dpwssd_epi32(corr, *pair, _mm512_set1_epi32(bsums));
                }
                let total = _mm512_sub_epi32(sums[c], _mm512_slli_epi32::<5>(corr));
                let da = _mm512_set1_ps(a[c].q.add(b * Q8K_BYTES).cast::<f32>().read_unaligned());
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, da), acc[c]);
            }
        }
        acc
    }
}
