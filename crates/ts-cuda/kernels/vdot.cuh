// Integer dot products of GGUF weight rows with activations quantized to 8 bits.
//
// Activations (TsQ8): each row of k floats in blocks of 32, x[i] ~ d * q[i] with
// d = max|x| / 127 and q = round(x / d) (0 where d is 0); per block ds = (d, d * sum(q)).
// q is int8 [rows][k], ds [rows][k / 32]. The layout follows what llama.cpp's MMVQ reads
// (block_q8_1), with d and the sum kept in f32.
//
//   vdot_<t>::dot<M>(row, u, x, acc)  acc[r] += the dot product of unit u of the row at `row`
//       (32 of its weights) with the same elements of activation row r < M.
// A unit is the weights one lane reads at once: a whole block for the 32-element types; for
// the k-quants 32 weights whose quant bytes are contiguous (half of two chunks for Q4_K and
// Q5_K, a quarter of four for Q6_K), so no byte is loaded twice. Units per row: k / 32.
//
// Weights are decoded to int8 (nibbles, offsets folded into a per-block correction) and
// multiplied four at a time with dp4a; the block scales multiply the integer sums once.
//
//   vdot_<t>::frag(row, c, s)  elements 4s..4s+3 and 16+4s..16+4s+3 of 32-element chunk c of
//       the row as int8 (TsFrag): the part of an int8 tensor-core fragment one lane holds.
//   vdot_<t>::split  whether the chunk's two halves have scales of their own (Q6_K).
// Also compiles as host C++17 (tests/vdot_host.cpp).

#pragma once

#include "quant.cuh"

#ifdef TS_HOST
struct ts_f2 {
    float x, y;
};
#else
typedef float2 ts_f2;
#endif

struct TsQ8 {
    const signed char* q;
    const ts_f2* ds;
    int k;
};

// Signed 8-bit dot product of the four bytes of a and b, plus c.
__device__ __forceinline__ int ts_dp4a(int a, int b, int c) {
#ifdef TS_HOST
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
#else
    return __dp4a(a, b, c);
#endif
}

// Sum of the four signed bytes of b, plus c.
__device__ __forceinline__ int ts_sum4(int b, int c) { return ts_dp4a(0x01010101, b, c); }

// N int8 activations (N = 8 or 16) at p: aligned to N bytes.
template <int N>
__device__ __forceinline__ void ts_xq(const signed char* p, int* v) {
#ifdef TS_HOST
    memcpy(v, p, N);
#else
    if (N == 16) {
        const int4 t = __ldg(reinterpret_cast<const int4*>(p));
        v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
        const int2 t = __ldg(reinterpret_cast<const int2*>(p));
        v[0] = t.x, v[1] = t.y;
    }
#endif
}

__device__ __forceinline__ ts_f2 ts_xds(const ts_f2* p) {
#ifdef TS_HOST
    return *p;
#else
    return __ldg(p);
#endif
}

#ifndef TS_HOST
// Quantizes element i of a row (v) into q[i], its warp's 32 consecutive elements (i of lane 0
// a multiple of 32) forming one block, whose (d, sum) lane 0 writes to ds[i / 32]. Every lane
// of the warp must call it. The one definition of the format on the device.
__device__ __forceinline__ void ts_q8_store_warp(float v, long long i, signed char* q, float2* ds) {
#if __CUDA_ARCH__ >= 800
    // The warp's max |v| as the largest bit pattern (non-negative floats order as their bits;
    // fmaxf below would differ only for a NaN) and the sum of the quants: one reduction each.
    const float amax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(v))));
#else
    float amax = fabsf(v);
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
#endif
    const float d = amax / 127.0f;
    const int qi = d == 0.0f ? 0 : (int)roundf(v / d);
#if __CUDA_ARCH__ >= 800
    const int sum = __reduce_add_sync(0xffffffffu, qi);
#else
    int sum = qi;
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
#endif
    q[i] = (signed char)qi;
    if ((threadIdx.x & 31) == 0) ds[i >> 5] = make_float2(d, d * (float)sum);
}
#endif

// Elements 4s..4s+3 (q[0]) and 16+4s..16+4s+3 (q[1]) of a 32-element chunk as int8, one
// per byte: the weights are d[h] * q[h] + m (m times the activations' block sum corrects
// what the int8 values leave out).
struct TsFrag {
    ts_u32 q[2];
    float d[2];
    float m;
};

// Four nibbles or five-bit values as int8 minus an offset: (q + 128 - o) ^ 128 per byte,
// no carries between bytes for q < o + 128.
__device__ __forceinline__ ts_u32 ts_minus(ts_u32 q, ts_u32 o) { return (q + (128u - o) * 0x01010101u) ^ 0x80808080u; }

__device__ __forceinline__ TsFrag ts_frag(ts_u32 q0, ts_u32 q1, float d0, float d1, float m) {
    TsFrag f;
    f.q[0] = q0, f.q[1] = q1, f.d[0] = d0, f.d[1] = d1, f.m = m;
    return f;
}

// Activation row r of x: its quants and its blocks' (d, sum).
__device__ __forceinline__ const signed char* ts_xrow(const TsQ8& x, int r) { return x.q + (ts_u64)r * x.k; }
__device__ __forceinline__ const ts_f2* ts_xds_row(const TsQ8& x, int r) { return x.ds + (ts_u64)r * (x.k >> 5); }

// ---- 32-element blocks: unit u is block u ----

// The nibble blocks: byte j of the 16 quant bytes holds element j (low) and j + 16 (high).
// sum(q * xq) over the block for lo[4] (elements 0..15) and hi[4] (16..31).
__device__ __forceinline__ int ts_dot_halves(const ts_u32* lo, const ts_u32* hi, const int* xv) {
    int s = 0;
    TS_UNROLL
    for (int i = 0; i < 4; i++) s = ts_dp4a((int)lo[i], xv[i], ts_dp4a((int)hi[i], xv[4 + i], s));
    return s;
}

// Block u of a 32-element type whose quants are lo (elements 0..15) and hi (16..31), with
// x = d * q + c: acc[r] += d * dx * sum(q * xq) + c * dx * sum(xq) (the second factor is the
// activations' block sum, ds.y).
template <int M>
__device__ __forceinline__ void ts_dot_block(const ts_u32* lo, const ts_u32* hi, int u, const TsQ8& x, float d,
                                             float c, float (&acc)[M]) {
    TS_UNROLL
    for (int r = 0; r < M; r++) {
        int xv[8];
        ts_xq<16>(ts_xrow(x, r) + 32 * u, xv);
        ts_xq<16>(ts_xrow(x, r) + 32 * u + 16, xv + 4);
        const ts_f2 ds = ts_xds(ts_xds_row(x, r) + u);
        acc[r] += d * ds.x * (float)ts_dot_halves(lo, hi, xv) + c * ds.y;
    }
}

// Q8_0 (34 bytes: f16 d, then 32 int8 quants): x = q * d. A block starts on a word or 2 bytes
// past one; it is read as the nine aligned words holding it (the last may reach past the
// block, not past its own aligned word). Returns d; q[i] holds elements 4i..4i+3.
__device__ __forceinline__ float ts_q8_0_block(const ts_u8* b, ts_u32 (&q)[8]) {
    const bool on = (ts_addr(b) & 3) == 0;
    const ts_u8* a = on ? b : b - 2;
    ts_u32 w[9];
    TS_UNROLL
    for (int i = 0; i < 9; i++) w[i] = ts_ld32(a + 4 * i);
    TS_UNROLL
    for (int i = 0; i < 8; i++) q[i] = on ? ts_funnel(w[i], w[i + 1], 16) : w[i + 1];
    return ts_h2f(on ? w[0] & 0xffffu : w[0] >> 16);
}

struct vdot_q8_0 {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q8_0(k); }
    static const bool split = false;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        const ts_u8* b = row + (ts_u64)c * 34;
        const float d = ts_h2f(ts_ld16(b));
        return ts_frag(ts_ldu32(b + 2 + 4 * s), ts_ldu32(b + 18 + 4 * s), d, d, 0.0f);
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        ts_u32 q[8];
        const float d = ts_q8_0_block(row + (ts_u64)u * 34, q);
        ts_dot_block<M>(q, q + 4, u, x, d, 0.0f, acc);
    }
};

// Q4_0: x = (q - 8) * d.
struct vdot_q4_0 {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q4_0(k); }
    static const bool split = false;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        const ts_u8* b = row + (ts_u64)c * 18;
        const float d = ts_h2f(ts_ld16(b));
        const ts_u32 q = ts_ldu32(b + 2 + 4 * s);
        return ts_frag(ts_minus(q & 0x0f0f0f0fu, 8), ts_minus((q >> 4) & 0x0f0f0f0fu, 8), d, d, 0.0f);
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        const ts_u8* b = row + (ts_u64)u * 18;
        const float d = ts_h2f(ts_ld16(b));
        ts_u32 q[4], lo[4], hi[4];
        ts_ld_16(b + 2, q);
        TS_UNROLL
        for (int i = 0; i < 4; i++) lo[i] = q[i] & 0x0f0f0f0fu, hi[i] = (q[i] >> 4) & 0x0f0f0f0fu;
        ts_dot_block<M>(lo, hi, u, x, d, -8.0f * d, acc);
    }
};

// Q4_1: x = q * d + m.
struct vdot_q4_1 {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q4_1(k); }
    static const bool split = false;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        const ts_u8* b = row + (ts_u64)c * 20;
        const ts_u32 dm = ts_ldu32(b), q = ts_ldu32(b + 4 + 4 * s);
        const float d = ts_h2f(dm & 0xffff);
        return ts_frag(q & 0x0f0f0f0fu, (q >> 4) & 0x0f0f0f0fu, d, d, ts_h2f(dm >> 16));
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        const ts_u8* b = row + (ts_u64)u * 20;
        const ts_u32 dm = ts_ldu32(b);
        const float d = ts_h2f(dm & 0xffff), m = ts_h2f(dm >> 16);
        ts_u32 q[4], lo[4], hi[4];
        ts_ld_16(b + 4, q);
        TS_UNROLL
        for (int i = 0; i < 4; i++) lo[i] = q[i] & 0x0f0f0f0fu, hi[i] = (q[i] >> 4) & 0x0f0f0f0fu;
        ts_dot_block<M>(lo, hi, u, x, d, m, acc);
    }
};

// Q5_0: x = (q - 16) * d, q's fifth bit from qh.
struct vdot_q5_0 {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q5_0(k); }
    static const bool split = false;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        const ts_u8* b = row + (ts_u64)c * 22;
        const float d = ts_h2f(ts_ld16(b));
        const ts_u32 qh = ts_ldu32(b + 2), q = ts_ldu32(b + 6 + 4 * s);
        return ts_frag(ts_minus((q & 0x0f0f0f0fu) | ts_spread4(qh >> (4 * s)), 16),
                       ts_minus(((q >> 4) & 0x0f0f0f0fu) | ts_spread4(qh >> (16 + 4 * s)), 16), d, d, 0.0f);
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        const ts_u8* b = row + (ts_u64)u * 22;
        const float d = ts_h2f(ts_ld16(b));
        const ts_u32 qh = ts_ldu32(b + 2);
        ts_u32 q[4], lo[4], hi[4];
        ts_ld_16(b + 6, q);
        TS_UNROLL
        for (int i = 0; i < 4; i++) {
            lo[i] = (q[i] & 0x0f0f0f0fu) | ts_spread4(qh >> (4 * i));
            hi[i] = ((q[i] >> 4) & 0x0f0f0f0fu) | ts_spread4(qh >> (16 + 4 * i));
        }
        ts_dot_block<M>(lo, hi, u, x, d, -16.0f * d, acc);
    }
};

// Q5_1: x = q * d + m, q's fifth bit from qh.
struct vdot_q5_1 {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q5_1(k); }
    static const bool split = false;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        const ts_u8* b = row + (ts_u64)c * 24;
        ts_u32 h[2];
        ts_ld_8(b, h);
        const float d = ts_h2f(h[0] & 0xffff);
        const ts_u32 q = ts_ldu32(b + 8 + 4 * s);
        return ts_frag((q & 0x0f0f0f0fu) | ts_spread4(h[1] >> (4 * s)),
                       ((q >> 4) & 0x0f0f0f0fu) | ts_spread4(h[1] >> (16 + 4 * s)), d, d, ts_h2f(h[0] >> 16));
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        const ts_u8* b = row + (ts_u64)u * 24;
        ts_u32 h[2];
        ts_ld_8(b, h);
        const float d = ts_h2f(h[0] & 0xffff), m = ts_h2f(h[0] >> 16);
        ts_u32 q[4], lo[4], hi[4];
        ts_ld_16(b + 8, q);
        TS_UNROLL
        for (int i = 0; i < 4; i++) {
            lo[i] = (q[i] & 0x0f0f0f0fu) | ts_spread4(h[1] >> (4 * i));
            hi[i] = ((q[i] >> 4) & 0x0f0f0f0fu) | ts_spread4(h[1] >> (16 + 4 * i));
        }
        ts_dot_block<M>(lo, hi, u, x, d, m, acc);
    }
};

// A 17-byte MXFP4 block at b: returns its exponent byte and puts its 16 quant bytes in q, read
// as the five aligned words holding the block (the last may reach past the block, not past
// its own aligned word).
__device__ __forceinline__ ts_u32 ts_mxfp4_block(const ts_u8* b, ts_u32 (&q)[4]) {
    const int mis = (int)(ts_addr(b) & 3);
    const ts_u8* a = b - mis;
    ts_u32 w[5];
    TS_UNROLL
    for (int i = 0; i < 5; i++) w[i] = ts_ld32(a + 4 * i);
    TS_UNROLL
    for (int i = 0; i < 4; i++) q[i] = ts_funnel_clamped(w[i], w[i + 1], 8 * mis + 8);
    return (w[0] >> (8 * mis)) & 0xffu;
}

// MXFP4: the E2M1 codes through the doubled table as int8, times the halved E8M0 scale.
struct vdot_mxfp4 {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_mxfp4(k); }
    static const bool split = false;
    static __device__ __forceinline__ float scale(ts_u32 e) {
        return ts_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    }
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        const ts_u8* b = row + (ts_u64)c * 17;
        const float d = scale(ts_ldu8(b));
        ts_u32 lo, hi;
        ts_mxfp4_word(ts_ldu32(b + 1 + 4 * s), lo, hi);
        return ts_frag(lo, hi, d, d, 0.0f);
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        ts_u32 q[4], lo[4], hi[4];
        const float d = scale(ts_mxfp4_block(row + (ts_u64)u * 17, q));
        TS_UNROLL
        for (int i = 0; i < 4; i++) ts_mxfp4_word(q[i], lo[i], hi[i]);
        ts_dot_block<M>(lo, hi, u, x, d, 0.0f, acc);
    }
};

// ---- k-quants: unit u is part (u & 7) of superblock u >> 3 ----

// Q4_K and Q5_K: part v = 2i + h holds elements 16h..16h+15 of chunks 2i (low nibbles of
// qs[32i + 16h + l]) and 2i + 1 (high nibbles). x = scale * q - min per chunk, so a half
// chunk's sum is dx * (scale * sum(q * xq) - min * sum(xq)).
template <int M>
__device__ __forceinline__ void ts_dot_k4_part(const ts_u32* hd, const ts_u32* lo, const ts_u32* hi, int sb, int v,
                                               const TsQ8& x, float (&acc)[M]) {
    const int i = v >> 1, h = v & 1;
    float sc0, mn0, sc1, mn1;
    ts_k4_scale_min(hd, 2 * i, &sc0, &mn0);
    ts_k4_scale_min(hd, 2 * i + 1, &sc1, &mn1);
    const int c0 = 8 * sb + 2 * i;  // x block of chunk 2i; c0 + 1 of chunk 2i + 1
    TS_UNROLL
    for (int r = 0; r < M; r++) {
        int xa[4], xb[4];
        ts_xq<16>(ts_xrow(x, r) + 32 * c0 + 16 * h, xa);
        ts_xq<16>(ts_xrow(x, r) + 32 * c0 + 32 + 16 * h, xb);
        int sa = 0, sb_ = 0, na = 0, nb = 0;
        TS_UNROLL
        for (int n = 0; n < 4; n++) {
            sa = ts_dp4a((int)lo[n], xa[n], sa);
            sb_ = ts_dp4a((int)hi[n], xb[n], sb_);
            na = ts_sum4(xa[n], na);
            nb = ts_sum4(xb[n], nb);
        }
        const ts_f2 da = ts_xds(ts_xds_row(x, r) + c0), db = ts_xds(ts_xds_row(x, r) + c0 + 1);
        acc[r] += da.x * (sc0 * (float)sa - mn0 * (float)na) + db.x * (sc1 * (float)sb_ - mn1 * (float)nb);
    }
}

// Q4_K and Q5_K fragments: chunk c's low four bits (qs at byte qs_at of a superblock of `bytes`)
// with its scale and min.
__device__ __forceinline__ TsFrag ts_k4_frag(const ts_u8* row, int c, int s, int bytes, int qs_at) {
    const ts_u8* b = row + (ts_u64)(c >> 3) * bytes;
    const int j = c & 7, sh = 4 * (j & 1);
    ts_u32 h[4];
    ts_ld_16(b, h);
    float scale, min;
    ts_k4_scale_min(h, j, &scale, &min);
    const ts_u8* q = b + qs_at + 32 * (j >> 1) + 4 * s;
    return ts_frag((ts_ldu32(q) >> sh) & 0x0f0f0f0fu, (ts_ldu32(q + 16) >> sh) & 0x0f0f0f0fu, scale, scale, -min);
}

struct vdot_q4_k {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q4_k(k); }
    static const bool split = false;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) { return ts_k4_frag(row, c, s, 144, 16); }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        const int sb = u >> 3, v = u & 7;
        const ts_u8* b = row + (ts_u64)sb * 144;
        ts_u32 hd[4], q[4], lo[4], hi[4];
        ts_ld_16(b, hd);
        ts_ld_16(b + 16 + 32 * (v >> 1) + 16 * (v & 1), q);
        TS_UNROLL
        for (int n = 0; n < 4; n++) lo[n] = q[n] & 0x0f0f0f0fu, hi[n] = (q[n] >> 4) & 0x0f0f0f0fu;
        ts_dot_k4_part<M>(hd, lo, hi, sb, v, x, acc);
    }
};

// Q5_K: the fifth bit of element 32j + l is bit j of qh[l].
struct vdot_q5_k {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q5_k(k); }
    static const bool split = false;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        TsFrag f = ts_k4_frag(row, c, s, 176, 48);
        const ts_u8* b = row + (ts_u64)(c >> 3) * 176;
        const int j = c & 7;
        f.q[0] |= ((ts_ldu32(b + 16 + 4 * s) >> j) & 0x01010101u) << 4;
        f.q[1] |= ((ts_ldu32(b + 32 + 4 * s) >> j) & 0x01010101u) << 4;
        return f;
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        const int sb = u >> 3, v = u & 7, i = v >> 1, h = v & 1;
        const ts_u8* b = row + (ts_u64)sb * 176;
        ts_u32 hd[4], qh[4], q[4], lo[4], hi[4];
        ts_ld_16(b, hd);
        ts_ld_16(b + 16 + 16 * h, qh);
        ts_ld_16(b + 48 + 32 * i + 16 * h, q);
        TS_UNROLL
        for (int n = 0; n < 4; n++) {
            lo[n] = (q[n] & 0x0f0f0f0fu) | (((qh[n] >> (2 * i)) & 0x01010101u) << 4);
            hi[n] = ((q[n] >> 4) & 0x0f0f0f0fu) | (((qh[n] >> (2 * i + 1)) & 0x01010101u) << 4);
        }
        ts_dot_k4_part<M>(hd, lo, hi, sb, v, x, acc);
    }
};

// Q6_K: part v = 4n + p holds elements l0 = 8p .. l0 + 7 of the four chunks 4n + c of half n:
// low bits in ql[64n + l] (c = 0, 2: low, high nibble) and ql[64n + 32 + l] (c = 1, 3), high
// bits in qh[32n + l] >> 2c. x = d * sc * (q - 32), sc one int8 per 16 elements.
struct vdot_q6_k {
    static __device__ __forceinline__ ts_u64 row_bytes(int k) { return ts_row_bytes_q6_k(k); }
    static const bool split = true;
    static __device__ __forceinline__ TsFrag frag(const ts_u8* row, int c, int s) {
        const ts_u8* b = row + (ts_u64)(c >> 3) * 210;
        const int j = c & 7, half = j >> 2, r = j & 3, lsh = 4 * (r >> 1), hsh = 2 * r;
        const ts_u8* ql = b + 64 * half + 32 * (r & 1) + 4 * s;
        const ts_u8* qh = b + 128 + 32 * half + 4 * s;
        const ts_u32 sc = ts_ld16(b + 192 + 2 * j);
        const float d = ts_h2f(ts_ld16(b + 208));
        const ts_u32 u0 = ((ts_ldu32(ql) >> lsh) & 0x0f0f0f0fu) | (((ts_ldu32(qh) >> hsh) & 0x03030303u) << 4);
        const ts_u32 u1 = ((ts_ldu32(ql + 16) >> lsh) & 0x0f0f0f0fu) | (((ts_ldu32(qh + 16) >> hsh) & 0x03030303u) << 4);
        return ts_frag(ts_minus(u0, 32), ts_minus(u1, 32), ts_mul(d, (float)(signed char)(sc & 0xff)),
                       ts_mul(d, (float)(signed char)(sc >> 8)), 0.0f);
    }
    template <int M>
    static __device__ __forceinline__ void dot(const ts_u8* row, int u, const TsQ8& x, float (&acc)[M]) {
        const int sb = u >> 3, v = u & 7, n = v >> 2, l0 = 8 * (v & 3), g = (v & 3) >> 1;
        const ts_u8* b = row + (ts_u64)sb * 210;
        ts_u32 qa[2], qb[2], qh[2], sc[2];
        ts_ld_8(b + 64 * n + l0, qa);
        ts_ld_8(b + 64 * n + 32 + l0, qb);
        ts_ld_8(b + 128 + 32 * n + l0, qh);
        ts_ld_8(b + 192 + 8 * n, sc);  // chunk 4n + c, group g: byte 2c + g
        const float d = ts_h2f(ts_ld16(b + 208));
        ts_u32 w[4][2];
        TS_UNROLL
        for (int t = 0; t < 2; t++) {
            w[0][t] = (qa[t] & 0x0f0f0f0fu) | ((qh[t] & 0x03030303u) << 4);
            w[1][t] = (qb[t] & 0x0f0f0f0fu) | (((qh[t] >> 2) & 0x03030303u) << 4);
            w[2][t] = ((qa[t] >> 4) & 0x0f0f0f0fu) | (((qh[t] >> 4) & 0x03030303u) << 4);
            w[3][t] = ((qb[t] >> 4) & 0x0f0f0f0fu) | (((qh[t] >> 6) & 0x03030303u) << 4);
        }
        float scale[4];
        TS_UNROLL
        for (int c = 0; c < 4; c++) scale[c] = d * (float)(signed char)(sc[c >> 1] >> (8 * (2 * (c & 1) + g)));
        const int c0 = 8 * sb + 4 * n;  // x block of chunk 4n
        TS_UNROLL
        for (int r = 0; r < M; r++) {
            float s = 0.0f;
            TS_UNROLL
            for (int c = 0; c < 4; c++) {
                int xv[2];
                ts_xq<8>(ts_xrow(x, r) + 32 * (c0 + c) + l0, xv);
                const int qx = ts_dp4a((int)w[c][0], xv[0], ts_dp4a((int)w[c][1], xv[1], 0));
                const int sx = ts_sum4(xv[0], ts_sum4(xv[1], 0));
                s += scale[c] * ts_xds(ts_xds_row(x, r) + c0 + c).x * (float)(qx - 32 * sx);
            }
            acc[r] += s;
        }
    }
};

// The types with an integer dot product (the others multiply f32 activations).
#define TS_Q8_TYPES(X) \
    X(q8_0)            \
    X(q4_0)            \
    X(q4_1)            \
    X(q5_0)            \
    X(q5_1)            \
    X(q4_k)            \
    X(q5_k)            \
    X(q6_k)            \
    X(mxfp4)
