// Decoding of GGUF tensor rows straight from the file's bytes.
//
// Block layouts follow ggml's block definitions (ggml-common.h) as implemented in ts-quant
// (crates/ts-quant/src/blocks.rs and friends); the decoders give the same floats as
// ts_quant::dequantize, bit for bit (tests/dequant_host.rs checks this on the host).
//
//   dequant8_<t>(row, chunk, s, w)  s in 0..4: w[0..4) = elements 4s..4s+3 and w[4..8) =
//       elements 16+4s..16+4s+3 of chunk `chunk` (elements chunk*32 .. chunk*32+32) of the row
//       at `row`. Four lanes decode a chunk together, so that lanes read x and the weights in
//       runs (the kernels' layout); the split matches the nibble packing of the 4-bit types.
//   dequant32_<t>(row, chunk, w)    w[0..32) = the whole chunk (the four dequant8 calls).
// A chunk is one block for the 32-element types and one eighth of a 256-element superblock
// for the k-quants.
//
// Alignment: blocks are often only 2-byte aligned (Q4_0 is 18 bytes, Q6_K 210) or not at all
// (MXFP4, 17), so fields are read as the aligned 32-bit words that hold them and shifted into
// place, or with 8- and 16-byte loads where the address allows. Only whole aligned words
// holding some byte of the row are read. Rows need 2-byte alignment where the type has f16
// fields, none otherwise.
//
// Also compiles as host C++17 (the test harness): loads become memcpy, intrinsics portable code.

#pragma once

#if !defined(__CUDACC__) && !defined(__CUDACC_RTC__)
#define TS_HOST 1
#include <cassert>
#include <cstdint>
#include <cstring>
#ifndef __device__
#define __device__
#endif
#ifndef __forceinline__
#define __forceinline__ inline
#endif
#define TS_UNROLL
#else
#define TS_UNROLL _Pragma("unroll")
#endif

// Cache operators of weight loads. The wide loads of aligned fields skip L1 (weights are read
// once per step). The word loads of misaligned blocks (MXFP4's 17 bytes, Q8_0's 34, Q6_K's
// 210) go through L1: neighbouring lanes read the same sectors again, word by word (H200,
// tg128: gpt-oss-20b 327 -> 369 tok/s, qwen3-30b-a3b 271 -> 277). Measurement knobs
// (TURBOSPARK_NVRTC_DEFINES): TS_ALIGNED_L1, TS_WORD_NO_L1.
#ifdef TS_ALIGNED_L1
#define TS_LD_ALIGNED "ld.global.nc"
#else
#define TS_LD_ALIGNED "ld.global.nc.L1::no_allocate"
#endif
#ifdef TS_WORD_NO_L1
#define TS_LD_WORD "ld.global.nc.L1::no_allocate"
#else
#define TS_LD_WORD "ld.global.nc"
#endif

typedef unsigned char ts_u8;
typedef unsigned short ts_u16;
typedef unsigned int ts_u32;
typedef unsigned long long ts_u64;

// name, elements per block, bytes per block
#define TS_QUANT_TYPES(X) \
    X(f32, 1, 4)          \
    X(f16, 1, 2)          \
    X(bf16, 1, 2)         \
    X(q8_0, 32, 34)       \
    X(q4_0, 32, 18)       \
    X(q4_1, 32, 20)       \
    X(q5_0, 32, 22)       \
    X(q5_1, 32, 24)       \
    X(q2_k, 256, 84)      \
    X(q3_k, 256, 110)     \
    X(q4_k, 256, 144)     \
    X(q5_k, 256, 176)     \
    X(q6_k, 256, 210)     \
    X(mxfp4, 32, 17)

// ---- primitives: the only code that differs between device and host ----

__device__ __forceinline__ ts_u64 ts_addr(const void* p) {
#ifdef TS_HOST
    return (ts_u64)(uintptr_t)p;
#else
    return (ts_u64)p;
#endif
}

// Weight loads (read-only; streamed once, so not kept in L1). p must be aligned to the width.
__device__ __forceinline__ ts_u16 ts_ld16(const ts_u8* p) {
#ifdef TS_HOST
    assert((ts_addr(p) & 1) == 0);
    ts_u16 v;
    memcpy(&v, p, 2);
    return v;
#else
    ts_u16 v;
    asm(TS_LD_WORD ".u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ ts_u32 ts_ld32(const ts_u8* p) {
#ifdef TS_HOST
    assert((ts_addr(p) & 3) == 0);
    ts_u32 v;
    memcpy(&v, p, 4);
    return v;
#else
    ts_u32 v;
    asm(TS_LD_WORD ".u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ void ts_ld64(const ts_u8* p, ts_u32* w) {
#ifdef TS_HOST
    assert((ts_addr(p) & 7) == 0);
    memcpy(w, p, 8);
#else
    asm(TS_LD_ALIGNED ".v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
#endif
}

__device__ __forceinline__ void ts_ld128(const ts_u8* p, ts_u32* w) {
#ifdef TS_HOST
    assert((ts_addr(p) & 15) == 0);
    memcpy(w, p, 16);
#else
    asm(TS_LD_ALIGNED ".v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
        : "l"(p));
#endif
}

// Low 32 bits of (hi:lo) >> s, s in 0..31.
__device__ __forceinline__ ts_u32 ts_funnel(ts_u32 lo, ts_u32 hi, int s) {
#ifdef TS_HOST
    return (ts_u32)((((ts_u64)hi << 32) | lo) >> (s & 31));
#else
    return __funnelshift_r(lo, hi, s);
#endif
}

// The same for s in 0..=32 (32 gives hi).
__device__ __forceinline__ ts_u32 ts_funnel_clamped(ts_u32 lo, ts_u32 hi, int s) {
#ifdef TS_HOST
    return (ts_u32)((((ts_u64)hi << 32) | lo) >> s);
#else
    return __funnelshift_rc(lo, hi, s);
#endif
}

// Byte permute: byte n of the result is byte (s >> 4n) & 7 of the pool y:x (selector bit 3 unused here).
__device__ __forceinline__ ts_u32 ts_prmt(ts_u32 x, ts_u32 y, ts_u32 s) {
#ifdef TS_HOST
    const ts_u64 pool = ((ts_u64)y << 32) | x;
    ts_u32 r = 0;
    for (int n = 0; n < 4; n++) {
        const ts_u32 sel = (s >> (4 * n)) & 15;
        assert(sel < 8);
        r |= (ts_u32)((pool >> (8 * sel)) & 0xff) << (8 * n);
    }
    return r;
#else
    return __byte_perm(x, y, s);
#endif
}

__device__ __forceinline__ float ts_as_float(ts_u32 u) {
#ifdef TS_HOST
    float f;
    memcpy(&f, &u, 4);
    return f;
#else
    return __uint_as_float(u);
#endif
}

__device__ __forceinline__ ts_u32 ts_as_u32(float f) {
#ifdef TS_HOST
    ts_u32 u;
    memcpy(&u, &f, 4);
    return u;
#else
    return __float_as_uint(f);
#endif
}

// Rounded float ops that the device compiler must not fuse into FMAs (the reference rounds each).
__device__ __forceinline__ float ts_mul(float a, float b) {
#ifdef TS_HOST
    return a * b;
#else
    return __fmul_rn(a, b);
#endif
}

__device__ __forceinline__ float ts_add(float a, float b) {
#ifdef TS_HOST
    return a + b;
#else
    return __fadd_rn(a, b);
#endif
}

__device__ __forceinline__ float ts_sub(float a, float b) {
#ifdef TS_HOST
    return a - b;
#else
    return __fsub_rn(a, b);
#endif
}

// IEEE half bits to float (exact; NaN keeps its payload and is made quiet, like the half crate).
__device__ __forceinline__ float ts_h2f(ts_u32 h16) {
#ifdef TS_HOST
    const ts_u32 h = h16 & 0xffff;
    const ts_u32 sign = (h & 0x8000u) << 16;
    const ts_u32 exp = (h >> 10) & 0x1f;
    ts_u32 man = h & 0x3ff;
    ts_u32 bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man ? 0x00400000u | (man << 13) : 0u);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        int e = 113;  // subnormal: normalize the mantissa
        while (!(man & 0x400)) {
            man <<= 1;
            e--;
        }
        bits = sign | ((ts_u32)e << 23) | ((man & 0x3ff) << 13);
    }
    return ts_as_float(bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((ts_u16)h16));
    return f;
#endif
}

__device__ __forceinline__ float ts_bf2f(ts_u32 b16) { return ts_as_float((b16 & 0xffff) << 16); }

// Float to IEEE half bits, round to nearest even; overflow gives infinity, NaN 0x7e00 (+sign).
__device__ __forceinline__ ts_u16 ts_f2h(float f) {
#ifdef TS_HOST
    const ts_u32 x = ts_as_u32(f);
    const ts_u32 sign = (x >> 16) & 0x8000u;
    const ts_u32 a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (ts_u16)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (ts_u16)(sign | 0x7c00u);  // >= 65520 rounds to infinity
    if (a >= 0x38800000u) {                                  // normal half
        const ts_u32 m = a - (112u << 23);
        return (ts_u16)(sign | ((m + 0xfffu + ((m >> 13) & 1)) >> 13));
    }
    const int e = (int)(a >> 23);
    if (e == 0) return (ts_u16)sign;  // f32 subnormals are far below half's range
    const ts_u32 man = (a & 0x7fffffu) | 0x800000u;
    const int shift = 126 - e;  // value = man * 2^-shift units of 2^-24; shift >= 14
    if (shift > 24) return (ts_u16)sign;
    ts_u32 q = man >> shift;
    const ts_u32 rem = man & ((1u << shift) - 1);
    const ts_u32 half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return (ts_u16)(sign | q);
#else
    ts_u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// ---- loads of fields at any alignment ----

// The 32-bit little-endian value at p (any alignment): the aligned words holding it, shifted.
__device__ __forceinline__ ts_u32 ts_ldu32(const ts_u8* p) {
    const int mis = (int)(ts_addr(p) & 3);
    const ts_u8* a = p - mis;
#ifdef TS_HOST
    const ts_u32 lo = ts_ld32(a);
    const ts_u32 hi = mis ? ts_ld32(a + 4) : 0u;
#else
    // The second word as a predicated load, not a branch, so loads can be scheduled early.
    ts_u32 lo, hi;
    asm("{\n\t.reg .pred p;\n\t"
        "setp.ne.s32 p, %3, 0;\n\t"
        "mov.b32 %1, 0;\n\t"
        TS_LD_WORD ".u32 %0, [%2];\n\t"
        "@p " TS_LD_WORD ".u32 %1, [%2+4];\n\t}"
        : "=r"(lo), "=r"(hi)
        : "l"(a), "r"(mis));
#endif
    return ts_funnel(lo, hi, 8 * mis);
}

__device__ __forceinline__ ts_u32 ts_ldu8(const ts_u8* p) {
    const int mis = (int)(ts_addr(p) & 3);
    return (ts_ld32(p - mis) >> (8 * mis)) & 0xff;
}

// 8 or 16 bytes at p: one wide load when p is aligned for it (the usual case), else the
// aligned words holding them, shifted. On the device both are predicated loads in straight-line
// code, so that the loads of several rows can be in flight together.
template <int N>
__device__ __forceinline__ void ts_ld_wide(const ts_u8* p, ts_u32* w) {
    constexpr int W = N / 4;
#ifdef TS_HOST
    if ((ts_addr(p) & (N - 1)) == 0) {
        if (N == 16) {
            ts_ld128(p, w);
        } else {
            ts_ld64(p, w);
        }
    } else {
        for (int i = 0; i < W; i++) w[i] = ts_ldu32(p + 4 * i);
    }
#else
    const ts_u64 a = ts_addr(p);
    const int mis = (int)(a & 3);
    const ts_u8* base = p - mis;
    ts_u32 v[W], r[W + 1];
    if (N == 16) {
        asm("{\n\t.reg .pred al, un, sh;\n\t.reg .b64 t;\n\t"
            "and.b64 t, %9, 15;\n\tsetp.eq.u64 al, t, 0;\n\tsetp.ne.u64 un, t, 0;\n\t"
            "setp.ne.s32 sh, %11, 0;\n\t"
            "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
            "mov.b32 %4, 0;\n\tmov.b32 %5, 0;\n\tmov.b32 %6, 0;\n\tmov.b32 %7, 0;\n\tmov.b32 %8, 0;\n\t"
            "@al " TS_LD_ALIGNED ".v4.u32 {%0, %1, %2, %3}, [%9];\n\t"
            "@un " TS_LD_WORD ".u32 %4, [%10];\n\t"
            "@un " TS_LD_WORD ".u32 %5, [%10+4];\n\t"
            "@un " TS_LD_WORD ".u32 %6, [%10+8];\n\t"
            "@un " TS_LD_WORD ".u32 %7, [%10+12];\n\t"
            "@sh " TS_LD_WORD ".u32 %8, [%10+16];\n\t}"
            : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]), "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]),
              "=r"(r[4])
            : "l"(p), "l"(base), "r"(mis));
    } else {
        asm("{\n\t.reg .pred al, un, sh;\n\t.reg .b64 t;\n\t"
            "and.b64 t, %5, 7;\n\tsetp.eq.u64 al, t, 0;\n\tsetp.ne.u64 un, t, 0;\n\t"
            "setp.ne.s32 sh, %7, 0;\n\t"
            "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\tmov.b32 %4, 0;\n\t"
            "@al " TS_LD_ALIGNED ".v2.u32 {%0, %1}, [%5];\n\t"
            "@un " TS_LD_WORD ".u32 %2, [%6];\n\t"
            "@un " TS_LD_WORD ".u32 %3, [%6+4];\n\t"
            "@sh " TS_LD_WORD ".u32 %4, [%6+8];\n\t}"
            : "=r"(v[0]), "=r"(v[1]), "=r"(r[0]), "=r"(r[1]), "=r"(r[2])
            : "l"(p), "l"(base), "r"(mis));
    }
    const bool aligned = (a & (N - 1)) == 0;
    TS_UNROLL
    for (int i = 0; i < W; i++) w[i] = aligned ? v[i] : ts_funnel(r[i], r[i + 1], 8 * mis);
#endif
}

__device__ __forceinline__ void ts_ld_8(const ts_u8* p, ts_u32* w) { ts_ld_wide<8>(p, w); }
__device__ __forceinline__ void ts_ld_16(const ts_u8* p, ts_u32* w) { ts_ld_wide<16>(p, w); }

// ---- element conversion ----

// 2^23 + byte i of u, exactly: cheaper than an integer-to-float conversion.
#define TS_MAGIC 8388608.0f
__device__ __forceinline__ float ts_byte_f(ts_u32 u, int i) {
    return ts_as_float(ts_prmt(u, 0x4b000000u, 0x7540u | (ts_u32)i));
}

// w[0..4) = (byte_i(u) - bias) * d, with each step rounded like the reference.
__device__ __forceinline__ void ts_put4(float* w, ts_u32 u, float bias, float d) {
    TS_UNROLL
    for (int i = 0; i < 4; i++) w[i] = ts_mul(ts_sub(ts_byte_f(u, i), TS_MAGIC + bias), d);
}

// w[0..4) = byte_i(u) * d + m (Q4_1, Q5_1).
__device__ __forceinline__ void ts_put4_dm(float* w, ts_u32 u, float d, float m) {
    TS_UNROLL
    for (int i = 0; i < 4; i++) w[i] = ts_add(ts_mul(ts_sub(ts_byte_f(u, i), TS_MAGIC), d), m);
}

// w[0..4) = scale * byte_i(u) - min (k-quants with mins).
__device__ __forceinline__ void ts_put4_sm(float* w, ts_u32 u, float scale, float min) {
    TS_UNROLL
    for (int i = 0; i < 4; i++) w[i] = ts_sub(ts_mul(scale, ts_sub(ts_byte_f(u, i), TS_MAGIC)), min);
}

// Bits 0..3 of x moved to bit 4 of bytes 0..3 (the fifth bit of four Q5 quants).
__device__ __forceinline__ ts_u32 ts_spread4(ts_u32 x) { return ((x & 15u) * 0x02040810u) & 0x10101010u; }

// ---- plain float types: a chunk is 32 consecutive elements ----

__device__ __forceinline__ void dequant8_f32(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* p = row + (ts_u64)chunk * 128 + 16 * s;
    ts_u32 v[8];
    ts_ld_16(p, v);
    ts_ld_16(p + 64, v + 4);
    TS_UNROLL
    for (int i = 0; i < 8; i++) w[i] = ts_as_float(v[i]);
}

__device__ __forceinline__ void dequant8_f16(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* p = row + (ts_u64)chunk * 64 + 8 * s;
    ts_u32 v[4];
    ts_ld_8(p, v);
    ts_ld_8(p + 32, v + 2);
    TS_UNROLL
    for (int i = 0; i < 4; i++) {
        w[2 * i] = ts_h2f(v[i] & 0xffff);
        w[2 * i + 1] = ts_h2f(v[i] >> 16);
    }
}

__device__ __forceinline__ void dequant8_bf16(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* p = row + (ts_u64)chunk * 64 + 8 * s;
    ts_u32 v[4];
    ts_ld_8(p, v);
    ts_ld_8(p + 32, v + 2);
    TS_UNROLL
    for (int i = 0; i < 4; i++) {
        w[2 * i] = ts_as_float(v[i] << 16);
        w[2 * i + 1] = ts_as_float(v[i] & 0xffff0000u);
    }
}

// ---- 32-element blocks ----
// Quants of Q4/Q5/MXFP4 blocks: byte j holds element j (low nibble) and j + 16 (high nibble),
// so qs word s gives elements 4s..4s+3 and 16+4s..16+4s+3.

// Q8_0 (34 bytes): f16 d, 32 x i8 q; x = q * d.
__device__ __forceinline__ void dequant8_q8_0(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)chunk * 34;
    const float d = ts_h2f(ts_ld16(b));
    ts_put4(w, ts_ldu32(b + 2 + 4 * s) ^ 0x80808080u, 128.0f, d);  // q + 128 is unsigned
    ts_put4(w + 4, ts_ldu32(b + 18 + 4 * s) ^ 0x80808080u, 128.0f, d);
}

// Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; x = (q - 8) * d.
__device__ __forceinline__ void dequant8_q4_0(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)chunk * 18;
    const float d = ts_h2f(ts_ld16(b));
    const ts_u32 q = ts_ldu32(b + 2 + 4 * s);
    ts_put4(w, q & 0x0f0f0f0fu, 8.0f, d);
    ts_put4(w + 4, (q >> 4) & 0x0f0f0f0fu, 8.0f, d);
}

// Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; x = q * d + m.
__device__ __forceinline__ void dequant8_q4_1(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)chunk * 20;
    const ts_u32 dm = ts_ldu32(b);
    const float d = ts_h2f(dm & 0xffff), m = ts_h2f(dm >> 16);
    const ts_u32 q = ts_ldu32(b + 4 + 4 * s);
    ts_put4_dm(w, q & 0x0f0f0f0fu, d, m);
    ts_put4_dm(w + 4, (q >> 4) & 0x0f0f0f0fu, d, m);
}

// Q5_0 (22 bytes): f16 d, u32 qh (bit j: fifth bit of element j), 16 bytes of nibbles;
// x = (q - 16) * d.
__device__ __forceinline__ void dequant8_q5_0(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)chunk * 22;
    const float d = ts_h2f(ts_ld16(b));
    const ts_u32 qh = ts_ldu32(b + 2);
    const ts_u32 q = ts_ldu32(b + 6 + 4 * s);
    ts_put4(w, (q & 0x0f0f0f0fu) | ts_spread4(qh >> (4 * s)), 16.0f, d);
    ts_put4(w + 4, ((q >> 4) & 0x0f0f0f0fu) | ts_spread4(qh >> (16 + 4 * s)), 16.0f, d);
}

// Q5_1 (24 bytes): f16 d, f16 m, u32 qh, 16 bytes of nibbles; x = q * d + m.
__device__ __forceinline__ void dequant8_q5_1(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)chunk * 24;
    ts_u32 h[2];
    ts_ld_8(b, h);
    const float d = ts_h2f(h[0] & 0xffff), m = ts_h2f(h[0] >> 16);
    const ts_u32 q = ts_ldu32(b + 8 + 4 * s);
    ts_put4_dm(w, (q & 0x0f0f0f0fu) | ts_spread4(h[1] >> (4 * s)), d, m);
    ts_put4_dm(w + 4, ((q >> 4) & 0x0f0f0f0fu) | ts_spread4(h[1] >> (16 + 4 * s)), d, m);
}

// MXFP4 (17 bytes): E8M0 exponent e, 16 bytes of E2M1 codes; x = kvalues[q] * 2^(e-128)
// (the int table holds the fp4 values doubled, so the scale is halved, as in ts-quant).
// The eight E2M1 codes of MXFP4 quant word q (byte j: one element's code low, the element 16
// on's high) as int8 doubled fp4 values: lo gets the low codes' values by byte, hi the high
// ones'. Byte permutes look each magnitude up among the positive and among the negative
// values; a third permute picks by the code's sign bit.
__device__ __forceinline__ void ts_mxfp4_word(ts_u32 q, ts_u32& lo, ts_u32& hi) {
    const ts_u32 pos0 = 0x03020100u, pos1 = 0x0c080604u;  // 0 1 2 3 4 6 8 12
    const ts_u32 neg0 = 0xfdfeff00u, neg1 = 0xf4f8fafcu;  // the same negated
    const ts_u32 mag = q & 0x77777777u;  // nibble n: code n's magnitude (n even: a low code)
    const ts_u32 neg = (q & 0x88888888u) >> 1;  // nibble n: 4 where code n is negative
    // Values of the codes of bytes 0 and 1 (low, high, low, high), then of bytes 2 and 3.
    const ts_u32 a = ts_prmt(ts_prmt(pos0, pos1, mag), ts_prmt(neg0, neg1, mag), 0x3210u | (neg & 0xffffu));
    const ts_u32 m16 = mag >> 16;
    const ts_u32 b = ts_prmt(ts_prmt(pos0, pos1, m16), ts_prmt(neg0, neg1, m16), 0x3210u | (neg >> 16));
    lo = ts_prmt(a, b, 0x6420u);
    hi = ts_prmt(a, b, 0x7531u);
}

__device__ __forceinline__ void dequant8_mxfp4(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)chunk * 17;
    const ts_u32 e = ts_ldu8(b);
    const float d = ts_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    ts_u32 lo, hi;
    ts_mxfp4_word(ts_ldu32(b + 1 + 4 * s), lo, hi);
    ts_put4(w, lo ^ 0x80808080u, 128.0f, d);  // value + 128 is unsigned
    ts_put4(w + 4, hi ^ 0x80808080u, 128.0f, d);
}

// ---- k-quants: 256-element superblocks; chunk j = chunk & 7 of superblock chunk >> 3 ----
// Elements 4s.. and 16+4s.. of a chunk are bytes 4s.. and 16+4s.. of its 32 quant bytes.

// Q2_K (84 bytes): scales[16] (scale low nibble, min high nibble per 16 elements), qs[64],
// f16 d, f16 dmin. Chunk j: qs byte 32*(j/4) + l, bits 2*(j%4); x = d*sc * q - dmin*mn.
__device__ __forceinline__ void dequant8_q2_k(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)(chunk >> 3) * 84;
    const int j = chunk & 7;
    const ts_u8* q = b + 16 + 32 * (j >> 2) + 4 * s;
    const ts_u32 sc = ts_ld16(b + 2 * j);  // groups 2j, 2j+1
    const ts_u32 dm = ts_ldu32(b + 80);
    const float d = ts_h2f(dm & 0xffff), dmin = ts_h2f(dm >> 16);
    const int sh = 2 * (j & 3);
    ts_put4_sm(w, (ts_ldu32(q) >> sh) & 0x03030303u, ts_mul(d, (float)(sc & 15)), ts_mul(dmin, (float)((sc >> 4) & 15)));
    ts_put4_sm(w + 4, (ts_ldu32(q + 16) >> sh) & 0x03030303u, ts_mul(d, (float)((sc >> 8) & 15)),
               ts_mul(dmin, (float)((sc >> 12) & 15)));
}

// Q3_K (110 bytes): hmask[32], qs[64], scales[12], f16 d. Chunk j: low 2 bits as in Q2_K, high
// bit = bit j of hmask[l]; x = d*(sc - 32) * (q - 4). Six-bit scale g: low 4 bits in nibble g/8
// of byte g%8, high 2 bits at bit 2*(g/4) of byte 8 + g%4.
__device__ __forceinline__ void dequant8_q3_k(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)(chunk >> 3) * 110;
    const int j = chunk & 7;
    const ts_u8* q = b + 32 + 32 * (j >> 2) + 4 * s;
    const ts_u32 lo = ts_ld16(b + 96 + (2 * j & 7)) >> (j < 4 ? 0 : 4);  // groups 2j, 2j+1
    const ts_u32 hi = ts_ld16(b + 104 + (2 * j & 3)) >> (2 * (j >> 1));
    const float d = ts_h2f(ts_ld16(b + 108));
    const int sc0 = (int)((lo & 15) | ((hi & 3) << 4)) - 32;
    const int sc1 = (int)(((lo >> 8) & 15) | (((hi >> 8) & 3) << 4)) - 32;
    const int sh = 2 * (j & 3);
    const ts_u32 u0 = ((ts_ldu32(q) >> sh) & 0x03030303u) | (((ts_ldu32(b + 4 * s) >> j) & 0x01010101u) << 2);
    const ts_u32 u1 = ((ts_ldu32(q + 16) >> sh) & 0x03030303u) | (((ts_ldu32(b + 16 + 4 * s) >> j) & 0x01010101u) << 2);
    ts_put4(w, u0, 4.0f, ts_mul(d, (float)sc0));
    ts_put4(w + 4, u1, 4.0f, ts_mul(d, (float)sc1));
}

// Q4_K / Q5_K header (16 bytes): f16 d, f16 dmin, 12 bytes of six-bit scales and mins for the
// 8 chunks (get_scale_min_k4). Gives chunk j's scale d*sc and min dmin*mn.
__device__ __forceinline__ void ts_k4_scale_min(const ts_u32* h, int j, float* scale, float* min) {
    const int sh = 8 * (j & 3);
    const ts_u32 a0 = (h[1] >> sh) & 0xff, a1 = (h[2] >> sh) & 0xff, a2 = (h[3] >> sh) & 0xff;
    const ts_u32 sc = j < 4 ? a0 & 63 : (a2 & 15) | ((a0 >> 6) << 4);
    const ts_u32 mn = j < 4 ? a1 & 63 : (a2 >> 4) | ((a1 >> 6) << 4);
    *scale = ts_mul(ts_h2f(h[0] & 0xffff), (float)sc);
    *min = ts_mul(ts_h2f(h[0] >> 16), (float)mn);
}

// Q4_K (144 bytes): header, qs[128]; chunks 2i and 2i+1 share qs[32i..32i+32) (low, high nibbles).
__device__ __forceinline__ void dequant8_q4_k(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)(chunk >> 3) * 144;
    const int j = chunk & 7;
    ts_u32 h[4];
    ts_ld_16(b, h);
    float scale, min;
    ts_k4_scale_min(h, j, &scale, &min);
    const ts_u8* q = b + 16 + 32 * (j >> 1) + 4 * s;
    const int sh = 4 * (j & 1);
    ts_put4_sm(w, (ts_ldu32(q) >> sh) & 0x0f0f0f0fu, scale, min);
    ts_put4_sm(w + 4, (ts_ldu32(q + 16) >> sh) & 0x0f0f0f0fu, scale, min);
}

// Q5_K (176 bytes): header, qh[32] (element 32j+l: bit j of qh[l]), qs[128] as in Q4_K.
__device__ __forceinline__ void dequant8_q5_k(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)(chunk >> 3) * 176;
    const int j = chunk & 7;
    ts_u32 h[4];
    ts_ld_16(b, h);
    float scale, min;
    ts_k4_scale_min(h, j, &scale, &min);
    const ts_u8* q = b + 48 + 32 * (j >> 1) + 4 * s;
    const int sh = 4 * (j & 1);
    const ts_u32 u0 = ((ts_ldu32(q) >> sh) & 0x0f0f0f0fu) | (((ts_ldu32(b + 16 + 4 * s) >> j) & 0x01010101u) << 4);
    const ts_u32 u1 = ((ts_ldu32(q + 16) >> sh) & 0x0f0f0f0fu) | (((ts_ldu32(b + 32 + 4 * s) >> j) & 0x01010101u) << 4);
    ts_put4_sm(w, u0, scale, min);
    ts_put4_sm(w + 4, u1, scale, min);
}

// Q6_K (210 bytes): ql[128], qh[64], i8 scales[16] (one per 16 elements), f16 d.
// Chunk j = 4*half + r: low 4 bits in ql[64*half + 32*(r&1) + l] >> 4*(r>>1),
// high 2 bits in qh[32*half + l] >> 2r; x = d*sc * (q - 32).
__device__ __forceinline__ void dequant8_q6_k(const ts_u8* row, int chunk, int s, float w[8]) {
    const ts_u8* b = row + (ts_u64)(chunk >> 3) * 210;
    const int j = chunk & 7, half = j >> 2, r = j & 3;
    const ts_u8* ql = b + 64 * half + 32 * (r & 1) + 4 * s;
    const ts_u8* qh = b + 128 + 32 * half + 4 * s;
    const ts_u32 sc = ts_ld16(b + 192 + 2 * j);
    const float d = ts_h2f(ts_ld16(b + 208));
    const int lsh = 4 * (r >> 1), hsh = 2 * r;
    const ts_u32 u0 = ((ts_ldu32(ql) >> lsh) & 0x0f0f0f0fu) | (((ts_ldu32(qh) >> hsh) & 0x03030303u) << 4);
    const ts_u32 u1 = ((ts_ldu32(ql + 16) >> lsh) & 0x0f0f0f0fu) | (((ts_ldu32(qh + 16) >> hsh) & 0x03030303u) << 4);
    ts_put4(w, u0, 32.0f, ts_mul(d, (float)(signed char)(sc & 0xff)));
    ts_put4(w + 4, u1, 32.0f, ts_mul(d, (float)(signed char)(sc >> 8)));
}

// Whole chunks, and the bytes of a row of k elements, for each type.
#define TS_PER_TYPE(t, block, bytes)                                                    \
    __device__ __forceinline__ void dequant32_##t(const ts_u8* row, int chunk, float w[32]) { \
        TS_UNROLL                                                                       \
        for (int s = 0; s < 4; s++) {                                                   \
            float v[8];                                                                 \
            dequant8_##t(row, chunk, s, v);                                             \
            TS_UNROLL                                                                   \
            for (int i = 0; i < 4; i++) {                                               \
                w[4 * s + i] = v[i];                                                    \
                w[16 + 4 * s + i] = v[4 + i];                                           \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
    __device__ __forceinline__ ts_u64 ts_row_bytes_##t(int k) { return (ts_u64)(k / (block)) * (bytes); }
TS_QUANT_TYPES(TS_PER_TYPE)
#undef TS_PER_TYPE
