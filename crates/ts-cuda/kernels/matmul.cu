#include "quant.cuh"

// Kernels over GGUF weight rows W[o] of k elements (k a multiple of 32, of 256 for k-quants),
// one set per type <t> of TS_QUANT_TYPES. Weight pointers need the row alignment quant.cuh
// states (2 bytes at most); float and half buffers (x, y, out) must be 16-byte aligned.
//
//   matvec_<t>(w, x, y, n_out, k, m)      y[r][o] = sum_i x[r][i] * W[o][i], r < m, 1 <= m <= 8.
//       block (32, 4): one warp per output row o = blockIdx.x*4 + threadIdx.y;
//       grid (ceil(n_out/4)). Lanes take chunks lane, lane+32, ...; each chunk is decoded
//       once into registers and dotted with the m rows of x.
//   moe_matvec_<t>(w, expert_stride, ids, x, x_group, y, n_out, k)
//       slot s = blockIdx.y uses expert ids[s] (W at w + ids[s]*expert_stride bytes), input
//       x + (s / x_group)*k, output y + s*n_out; m = 1. block (32, 4), grid (ceil(n_out/4), n_slots).
//   dequant_f16_<t>(w, out, n_rows, k)    out[r][i] = half bits of W[r][i] (round to nearest even).
//   get_rows_<t>(w, ids, out, n, k)       out[r][i] = W[ids[r]][i].
//       Both grid-stride over 32-element chunks: any 1-D launch.

#define TS_MATVEC_MAX_ROWS 8

__device__ __forceinline__ float ts_warp_sum(float v) {
    TS_UNROLL
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// One warp: M rows of x (row stride k) against weight row `wrow`; lane r < M writes y[r*y_stride].
template <int M, void (*DQ)(const ts_u8*, int, float*)>
__device__ __forceinline__ void ts_matvec_warp(const ts_u8* __restrict__ wrow, const float* __restrict__ x,
                                               float* __restrict__ y, int y_stride, int k) {
    const int lane = threadIdx.x;
    const int n_chunks = k >> 5;
    float acc[M];
    TS_UNROLL
    for (int r = 0; r < M; r++) acc[r] = 0.0f;
    for (int c = lane; c < n_chunks; c += 32) {
        float w[32];
        DQ(wrow, c, w);
        TS_UNROLL
        for (int r = 0; r < M; r++) {
            const float4* xv = reinterpret_cast<const float4*>(x + (ts_u64)r * k + 32 * c);
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            TS_UNROLL
            for (int i = 0; i < 8; i++) {
                const float4 v = __ldg(xv + i);
                s0 = fmaf(w[4 * i], v.x, s0);
                s1 = fmaf(w[4 * i + 1], v.y, s1);
                s2 = fmaf(w[4 * i + 2], v.z, s2);
                s3 = fmaf(w[4 * i + 3], v.w, s3);
            }
            acc[r] += (s0 + s1) + (s2 + s3);
        }
    }
    TS_UNROLL
    for (int r = 0; r < M; r++) {
        const float s = ts_warp_sum(acc[r]);
        if (lane == r) y[(ts_u64)r * y_stride] = s;
    }
}

template <void (*DQ)(const ts_u8*, int, float*)>
__device__ __forceinline__ void ts_matvec(const ts_u8* __restrict__ wrow, const float* __restrict__ x,
                                          float* __restrict__ y, int n_out, int k, int m) {
    switch (m) {
        case 1: ts_matvec_warp<1, DQ>(wrow, x, y, n_out, k); break;
        case 2: ts_matvec_warp<2, DQ>(wrow, x, y, n_out, k); break;
        case 3: ts_matvec_warp<3, DQ>(wrow, x, y, n_out, k); break;
        case 4: ts_matvec_warp<4, DQ>(wrow, x, y, n_out, k); break;
        case 5: ts_matvec_warp<5, DQ>(wrow, x, y, n_out, k); break;
        case 6: ts_matvec_warp<6, DQ>(wrow, x, y, n_out, k); break;
        case 7: ts_matvec_warp<7, DQ>(wrow, x, y, n_out, k); break;
        case 8: ts_matvec_warp<8, DQ>(wrow, x, y, n_out, k); break;
        default: break;
    }
}

// Two float halves packed as IEEE half bits, low element first.
__device__ __forceinline__ ts_u32 ts_pack_h2(float a, float b) { return (ts_u32)ts_f2h(a) | ((ts_u32)ts_f2h(b) << 16); }

#define TS_DEFINE_KERNELS(t, block, bytes)                                                                        \
    extern "C" __global__ void __launch_bounds__(128)                                                             \
        matvec_##t(const ts_u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n_out,    \
                   int k, int m) {                                                                                 \
        const int o = blockIdx.x * 4 + threadIdx.y;                                                                \
        if (o >= n_out) return;                                                                                    \
        ts_matvec<dequant32_##t>(w + (ts_u64)o * ts_row_bytes_##t(k), x, y + o, n_out, k, m);                      \
    }                                                                                                              \
                                                                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                                             \
        moe_matvec_##t(const ts_u8* __restrict__ w, long long expert_stride, const int* __restrict__ ids,          \
                       const float* __restrict__ x, int x_group, float* __restrict__ y, int n_out, int k) {        \
        const int o = blockIdx.x * 4 + threadIdx.y;                                                                \
        if (o >= n_out) return;                                                                                    \
        const int s = blockIdx.y;                                                                                  \
        const ts_u8* wrow = w + (long long)ids[s] * expert_stride + (ts_u64)o * ts_row_bytes_##t(k);               \
        ts_matvec_warp<1, dequant32_##t>(wrow, x + (ts_u64)(s / x_group) * k, y + (ts_u64)s * n_out + o, 0, k);    \
    }                                                                                                              \
                                                                                                                   \
    extern "C" __global__ void dequant_f16_##t(const ts_u8* __restrict__ w, unsigned short* __restrict__ out,      \
                                               int n_rows, int k) {                                                \
        const int per_row = k >> 5;                                                                                \
        const long long total = (long long)n_rows * per_row;                                                       \
        const ts_u64 row_bytes = ts_row_bytes_##t(k);                                                              \
        for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;                           \
             g += (long long)gridDim.x * blockDim.x) {                                                             \
            const long long r = g / per_row;                                                                       \
            const int c = (int)(g - r * per_row);                                                                  \
            float v[32];                                                                                           \
            dequant32_##t(w + r * row_bytes, c, v);                                                                \
            uint4* dst = reinterpret_cast<uint4*>(out + r * k + 32 * c);                                           \
            TS_UNROLL                                                                                              \
            for (int i = 0; i < 4; i++) {                                                                          \
                dst[i] = make_uint4(ts_pack_h2(v[8 * i], v[8 * i + 1]), ts_pack_h2(v[8 * i + 2], v[8 * i + 3]),    \
                                    ts_pack_h2(v[8 * i + 4], v[8 * i + 5]), ts_pack_h2(v[8 * i + 6], v[8 * i + 7])); \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
                                                                                                                   \
    extern "C" __global__ void get_rows_##t(const ts_u8* __restrict__ w, const int* __restrict__ ids,             \
                                            float* __restrict__ out, int n, int k) {                               \
        const int per_row = k >> 5;                                                                                \
        const long long total = (long long)n * per_row;                                                            \
        const ts_u64 row_bytes = ts_row_bytes_##t(k);                                                              \
        for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;                           \
             g += (long long)gridDim.x * blockDim.x) {                                                             \
            const long long r = g / per_row;                                                                       \
            const int c = (int)(g - r * per_row);                                                                  \
            float v[32];                                                                                           \
            dequant32_##t(w + (long long)ids[r] * row_bytes, c, v);                                                \
            float4* dst = reinterpret_cast<float4*>(out + r * k + 32 * c);                                         \
            TS_UNROLL                                                                                              \
            for (int i = 0; i < 8; i++) dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]); \
        }                                                                                                          \
    }

TS_QUANT_TYPES(TS_DEFINE_KERNELS)
