#include "launch.cuh"
#include "activation.cuh"
#include "quant.cuh"

// Kernels over GGUF weight rows W[o] of k elements (k a multiple of 32, of 256 for k-quants),
// one set per type <t> of TS_QUANT_TYPES. Weight pointers need the row alignment quant.cuh
// states (2 bytes at most); float and half buffers (x, y, out) must be 16-byte aligned.
//
//   matvec_<t>(w, x, y, n_out, k, m, bias)  y[r][o] = sum_i x[r][i] * W[o][i] (+ bias[o] if not null),
//       r < m, 1 <= m <= 8.
//       block (32, 4), grid (ceil(n_out/4)): block b computes rows 4b..4b+3.
//   moe_matvec_<t>(w, expert_stride, ids, x, x_group, y, n_out, k)
//       slot s = blockIdx.y uses expert ids[s] (W at w + ids[s]*expert_stride bytes), input
//       x + (s / x_group)*k, output y + s*n_out; m = 1; ids[s] < 0 skips the slot.
//       block (32, 4), grid (ceil(n_out/4), n_slots).
//   moe_gate_up_<t>(w_gate, w_up, expert_stride, index, ids, x, x_group, h, n_out, k, gate_bias, up_bias,
//                   kind, alpha, limit)
//       h[s][o] = act(gate_s[o] . x + gate_bias[ids[s]][o], up_s[o] . x + up_bias[ids[s]][o]) with the
//       weights of slot s at w_* + index[s]*expert_stride (biases may be null; index[s] < 0 skips
//       the slot); same grid as moe_matvec.
//   dequant_f16_<t>(w, out, n_rows, k)    out[r][i] = half bits of W[r][i] (round to nearest even).
//   get_rows_<t>(w, ids, out, n, k)       out[r][i] = W[ids[r]][i].
//       Both grid-stride over quarter chunks: any 1-D launch.
//
// Matvec layout: four lanes share a 32-element chunk (dequant8's split), so a warp reads x in
// 64-byte runs, and the block's 128 threads walk the chunks of its 4 rows together: each thread
// loads its x elements once and uses them for all 4 rows (one lane per chunk, or x read again
// per row, made decode bound by L1 rather than by reading the weights). Rows past n_out repeat
// the last row instead of branching, so that the loads of all 4 rows are in flight together.

// Chunks per thread per trip of the matvec loop: more loads in flight.
#ifndef TS_MATVEC_UNROLL
#define TS_MATVEC_UNROLL 2
#endif

__device__ __forceinline__ float ts_warp_sum(float v) {
    TS_UNROLL
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ float ts_dot4(const float* w, float4 x, float acc) {
    acc = fmaf(w[0], x.x, acc);
    acc = fmaf(w[1], x.y, acc);
    acc = fmaf(w[2], x.z, acc);
    return fmaf(w[3], x.w, acc);
}

// Adds chunk c's dot products with the block's rows to acc: x elements loaded once, used for
// every weight row.
template <int M, void (*DQ)(const ts_u8*, int, int, float*)>
__device__ __forceinline__ void ts_matvec_chunk(const ts_u8* __restrict__ w, ts_u64 row_bytes, int rows,
                                                const float* __restrict__ x, int k, int c, int s,
                                                float (&acc)[4][M]) {
    float4 xa[M], xb[M];
    TS_UNROLL
    for (int r = 0; r < M; r++) {
        const float* xr = x + (ts_u64)r * k + 32 * c + 4 * s;
        xa[r] = __ldg(reinterpret_cast<const float4*>(xr));
        xb[r] = __ldg(reinterpret_cast<const float4*>(xr + 16));
    }
    TS_UNROLL
    for (int i = 0; i < 4; i++) {
        // Rows past the end repeat the last one (never written): no branch between the rows'
        // loads, so all of them can be in flight at once.
        float v[8];
        DQ(w + min(i, rows - 1) * row_bytes, c, s, v);
        TS_UNROLL
        for (int r = 0; r < M; r++) acc[i][r] = ts_dot4(v + 4, xb[r], ts_dot4(v, xa[r], acc[i][r]));
    }
}

// The block's `rows` (1..4) weight rows from `w` (row stride row_bytes) against M rows of x
// (stride k): y[r * y_stride + i] for row i, plus bias[i] when bias is not null. Call with all
// 128 threads of a (32, 4) block.
// Each thread takes chunks tid/4 + 32j, TS_MATVEC_UNROLL per trip.
template <int M, void (*DQ)(const ts_u8*, int, int, float*)>
__device__ __forceinline__ void ts_matvec_block(const ts_u8* __restrict__ w, ts_u64 row_bytes, int rows,
                                                const float* __restrict__ x, float* __restrict__ y, int y_stride,
                                                int k, const float* __restrict__ bias) {
    __shared__ float partial[4][4 * M];
    const int tid = threadIdx.y * 32 + threadIdx.x;
    const int s = tid & 3;
    const int n_chunks = k >> 5;
    float acc[4][M];
    TS_UNROLL
    for (int i = 0; i < 4; i++) {
        TS_UNROLL
        for (int r = 0; r < M; r++) acc[i][r] = 0.0f;
    }
    int c = tid >> 2;
    for (; c + 32 * (TS_MATVEC_UNROLL - 1) < n_chunks; c += 32 * TS_MATVEC_UNROLL) {
        TS_UNROLL
        for (int u = 0; u < TS_MATVEC_UNROLL; u++) ts_matvec_chunk<M, DQ>(w, row_bytes, rows, x, k, c + 32 * u, s, acc);
    }
    for (; c < n_chunks; c += 32) ts_matvec_chunk<M, DQ>(w, row_bytes, rows, x, k, c, s, acc);
    TS_UNROLL
    for (int i = 0; i < 4; i++) {
        TS_UNROLL
        for (int r = 0; r < M; r++) {
            const float v = ts_warp_sum(acc[i][r]);
            if (threadIdx.x == 0) partial[threadIdx.y][i * M + r] = v;
        }
    }
    __syncthreads();
    if (tid < 4 * M) {
        const int i = tid / M, r = tid % M;
        if (i < rows) {
            float v = (partial[0][tid] + partial[1][tid]) + (partial[2][tid] + partial[3][tid]);
            if (bias) v += bias[i];
            y[(ts_u64)r * y_stride + i] = v;
        }
    }
    __syncthreads();  // partial is reused by the next call
}

// m rows of x in passes of at most two, so that registers (and occupancy) suit m = 1; later
// passes find the block's weight rows in L2.
template <void (*DQ)(const ts_u8*, int, int, float*)>
__device__ __forceinline__ void ts_matvec(const ts_u8* __restrict__ w, ts_u64 row_bytes, int rows,
                                          const float* __restrict__ x, float* __restrict__ y, int n_out, int k,
                                          int m, const float* __restrict__ bias) {
    for (int r = 0; r < m; r += 2) {
        if (m - r >= 2) {
            ts_matvec_block<2, DQ>(w, row_bytes, rows, x + (ts_u64)r * k, y + (ts_u64)r * n_out, n_out, k, bias);
        } else {
            ts_matvec_block<1, DQ>(w, row_bytes, rows, x + (ts_u64)r * k, y + (ts_u64)r * n_out, n_out, k, bias);
        }
    }
}

// Two floats as IEEE half bits, low element first.
__device__ __forceinline__ ts_u32 ts_pack_h2(float a, float b) { return (ts_u32)ts_f2h(a) | ((ts_u32)ts_f2h(b) << 16); }

#define TS_DEFINE_KERNELS(t, block, bytes)                                                                         \
    extern "C" __global__ void __launch_bounds__(128, 8)                                                           \
        matvec_##t(const ts_u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y, int n_out,     \
                   int k, int m, const float* __restrict__ bias) {                                                  \
        ts_grid_begin();                                                                                            \
        const int o = blockIdx.x * 4;                                                                               \
        if (o >= n_out) return;                                                                                     \
        const ts_u64 rb = ts_row_bytes_##t(k);                                                                      \
        ts_matvec<dequant8_##t>(w + o * rb, rb, min(4, n_out - o), x, y + o, n_out, k, m, bias ? bias + o : bias); \
    }                                                                                                               \
                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 8)                                                           \
        moe_matvec_##t(const ts_u8* __restrict__ w, long long expert_stride, const int* __restrict__ ids,           \
                       const float* __restrict__ x, int x_group, float* __restrict__ y, int n_out, int k) {         \
        ts_grid_begin();                                                                                            \
        const int o = blockIdx.x * 4;                                                                               \
        const int s = blockIdx.y;                                                                                   \
        if (o >= n_out || ids[s] < 0) return; /* a slot of another group of experts */                              \
        const ts_u64 rb = ts_row_bytes_##t(k);                                                                      \
        const ts_u8* wr = w + (long long)ids[s] * expert_stride + o * rb;                                           \
        ts_matvec_block<1, dequant8_##t>(wr, rb, min(4, n_out - o), x + (ts_u64)(s / x_group) * k,                 \
                                         y + (ts_u64)s * n_out + o, 0, k, nullptr);                                 \
    }                                                                                                               \
                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(128, 8) moe_gate_up_##t(                                          \
        const ts_u8* __restrict__ wg, const ts_u8* __restrict__ wu, long long expert_stride,                       \
        const int* __restrict__ index, const int* __restrict__ ids, const float* __restrict__ x, int x_group,      \
        float* __restrict__ h, int n_out, int k, const float* __restrict__ bias_g, const float* __restrict__ bias_u, \
        int kind, float alpha, float limit) {                                                                       \
        ts_grid_begin();                                                                                            \
        __shared__ float gv[4], uv[4];                                                                              \
        const int o = blockIdx.x * 4;                                                                               \
        const int s = blockIdx.y, rows = min(4, n_out - o);                                                         \
        if (o >= n_out || index[s] < 0) return; /* a slot of another group of experts */                            \
        const ts_u64 rb = ts_row_bytes_##t(k);                                                                      \
        const long long at = (long long)index[s] * expert_stride + o * rb;                                          \
        const float* xs = x + (ts_u64)(s / x_group) * k;                                                            \
        ts_matvec_block<1, dequant8_##t>(wg + at, rb, rows, xs, gv, 0, k, nullptr);                                 \
        ts_matvec_block<1, dequant8_##t>(wu + at, rb, rows, xs, uv, 0, k, nullptr);                                 \
        const int i = threadIdx.y * 32 + threadIdx.x;                                                               \
        if (i < rows) {                                                                                             \
            const long long b = (long long)ids[s] * n_out + o + i;                                                  \
            const float g = bias_g ? gv[i] + bias_g[b] : gv[i], u = bias_u ? uv[i] + bias_u[b] : uv[i];            \
            h[(ts_u64)s * n_out + o + i] = ts_gated(kind, g, u, alpha, limit);                                      \
        }                                                                                                           \
    }                                                                                                               \
                                                                                                                    \
    extern "C" __global__ void dequant_f16_##t(const ts_u8* __restrict__ w, unsigned short* __restrict__ out,       \
                                               int n_rows, int k) {                                                 \
        ts_grid_begin();                                                                                            \
        const long long per_row = k >> 3; /* quarter chunks */                                                      \
        const long long total = (long long)n_rows * per_row;                                                        \
        const ts_u64 rb = ts_row_bytes_##t(k);                                                                      \
        for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;                            \
             g += (long long)gridDim.x * blockDim.x) {                                                              \
            const long long r = g / per_row;                                                                        \
            const int q = (int)(g - r * per_row), c = q >> 2, s = q & 3;                                            \
            float v[8];                                                                                             \
            dequant8_##t(w + r * rb, c, s, v);                                                                      \
            unsigned short* o = out + r * k + 32 * c + 4 * s;                                                       \
            *reinterpret_cast<uint2*>(o) = make_uint2(ts_pack_h2(v[0], v[1]), ts_pack_h2(v[2], v[3]));            \
            *reinterpret_cast<uint2*>(o + 16) = make_uint2(ts_pack_h2(v[4], v[5]), ts_pack_h2(v[6], v[7]));       \
        }                                                                                                           \
    }                                                                                                               \
                                                                                                                    \
    extern "C" __global__ void get_rows_##t(const ts_u8* __restrict__ w, const int* __restrict__ ids,              \
                                            float* __restrict__ out, int n, int k) {                                \
        ts_grid_begin();                                                                                            \
        const long long per_row = k >> 3;                                                                           \
        const long long total = (long long)n * per_row;                                                             \
        const ts_u64 rb = ts_row_bytes_##t(k);                                                                      \
        for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;                            \
             g += (long long)gridDim.x * blockDim.x) {                                                              \
            const long long r = g / per_row;                                                                        \
            const int q = (int)(g - r * per_row), c = q >> 2, s = q & 3;                                            \
            float v[8];                                                                                             \
            dequant8_##t(w + (long long)ids[r] * rb, c, s, v);                                                      \
            float* o = out + r * k + 32 * c + 4 * s;                                                                \
            *reinterpret_cast<float4*>(o) = make_float4(v[0], v[1], v[2], v[3]);                                   \
            *reinterpret_cast<float4*>(o + 16) = make_float4(v[4], v[5], v[6], v[7]);                              \
        }                                                                                                           \
    }

TS_QUANT_TYPES(TS_DEFINE_KERNELS)
