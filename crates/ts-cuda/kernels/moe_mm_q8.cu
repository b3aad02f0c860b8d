// Grouped expert matmuls with 8-bit activations on the int8 tensor cores, for steps of many
// rows (a prompt): ggml's mul_mat_id for a batch. The host orders the (row, slot) pairs by
// expert and cuts each expert's pairs into tiles of at most 8 * NT pairs; one launch per
// projection multiplies every tile, each weight chunk decoded once per tile (vdot.cuh's frag).
//
//   gather_quantize_q8_1(x, rows, q, ds, width, n)   q[p] = TsQ8 of x[rows[p]], n = pairs * width
//   moe_mm_q8_<t>_<P>(MoeMmQ8)              y[p] = W_e . x[p] (+ bias[e]) for each tile's pairs p
//   moe_mm_gate_up_q8_<t>_<P>(MoeMmGateUpQ8) h[p] = act(gate_e . x[p] + gate_bias[e], up_e . x[p] + up_bias[e])
//   (P = 8 * NT, the tile's most pairs.)
//
// Activations and outputs are in the grouped order. The activations have P rows after the
// last pair that a short tile reads and never uses. A warp computes 16 weight rows of one
// tile: per 32-element chunk, mma m16n8k32 (or two m16n8k16 where the chunk's halves have
// scales of their own) of the rows' int8 fragment with each 8 pairs' activations, then the
// chunk's scales. grid x over 16 * TS_MMA_WARPS output rows, y over the tiles; block 32 x TS_MMA_WARPS.

#define TS_MMA_WARPS 4
// Chunks of the tile's activations staged in shared memory at a time, read there by the
// block's warps (each read them from global memory before: L1-bound, 4 times over).
#define TS_MMA_STAGE 8
// A pair's staged row: TS_MMA_STAGE chunks of 32 int8 and 16 bytes of padding, so that the 8
// pairs and 4 words a fragment load reads fall in distinct banks.
#define TS_MMA_XROW (32 * TS_MMA_STAGE + 16)
// A pair's staged scales: TS_MMA_STAGE float2 and one of padding (the 4 pairs a lane group
// reads fall in distinct banks).
#define TS_MMA_DSROW (TS_MMA_STAGE + 1)

// A tile (int4): x the expert's index among the weights (expert, or cache slot), y the expert
// (bias rows), z its first pair in the grouped order, w its pair count (1 .. P).

// Kernel parameters (crates/ts-cuda/src/moe_mm.rs mirrors them).
struct MoeMmQ8 {
    const ts_u8* w;  // expert (slot) 0
    const int4* tiles;
    const signed char* xq;
    const float2* xds;
    float* y;  // [pairs][n_out]
    const float* bias;  // [n_expert][n_out] or null
    long long expert_stride;  // bytes
    int n_out, k;
};

struct MoeMmGateUpQ8 {
    const ts_u8* w_gate;
    const ts_u8* w_up;
    const int4* tiles;
    const signed char* xq;
    const float2* xds;
    float* h;  // [pairs][n_out]
    const float* gate_bias;  // [n_expert][n_out] or null
    const float* up_bias;
    long long expert_stride;
    int n_out, k;
    int kind;  // activation.cuh
    float alpha, limit;
};

// c += A (16 x 32 int8: a0 rows 0-7 k 0-15 part, a1 rows 8-15, a2/a3 the k 16-31 part) times
// B (32 x 8 int8), the lane layout of PTX's mma.m16n8k32 (c0, c1: row g, columns 2s, 2s+1;
// c2, c3: row g + 8; g = lane / 4, s = lane % 4).
__device__ __forceinline__ void ts_mma_k32(int (&c)[4], ts_u32 a0, ts_u32 a1, ts_u32 a2, ts_u32 a3, ts_u32 b0,
                                           ts_u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same over 16 of k (mma.m16n8k16).
__device__ __forceinline__ void ts_mma_k16(int (&c)[4], ts_u32 a0, ts_u32 a1, ts_u32 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
}

// The tile's activations for chunks c0 .. c0 + TS_MMA_STAGE - 1 (those below `units`), for
// every pair of the tile (P rows; rows past the tile's pairs hold what the buffer holds
// there, never used): xs [P][TS_MMA_XROW] bytes, ds [P][TS_MMA_DSROW].
template <int NT>
__device__ __forceinline__ void ts_mma_stage(const signed char* xq, const float2* xds, int k, int c0,
                                             signed char* xs, float2* ds) {
    const int units = k >> 5, n = min(TS_MMA_STAGE, units - c0);
    // 16 bytes at a time: a chunk is two.
    for (int i = threadIdx.x; i < 8 * NT * n * 2; i += blockDim.x) {
        const int pair = i / (2 * n), part = i - pair * 2 * n;
        *reinterpret_cast<int4*>(xs + pair * TS_MMA_XROW + 16 * part) =
            __ldg(reinterpret_cast<const int4*>(xq + (ts_u64)pair * k + 32 * c0 + 16 * part));
    }
    for (int i = threadIdx.x; i < 8 * NT * n; i += blockDim.x) {
        const int pair = i / n, c = i - pair * n;
        ds[pair * TS_MMA_DSROW + c] = __ldg(xds + (ts_u64)pair * units + c0 + c);
    }
}

// acc[w][n][i] += chunk c of weight rows g (fa[w]) and g + 8 (fb[w]) of W matrices times the
// tile's pairs 8n + 2s and 8n + 2s + 1 (i = 0, 1: row g; 2, 3: row g + 8), for the tile's
// activations staged by ts_mma_stage (cs: the chunk's place among them; each loaded once for
// the W matrices).
template <class V, int NT, int W>
__device__ __forceinline__ void ts_mma_chunk(const TsFrag (&fa)[W], const TsFrag (&fb)[W], const signed char* xs,
                                             const float2* ds, int cs, float (&acc)[W][NT][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, s = lane & 3;
    TS_UNROLL
    for (int n = 0; n < NT; n++) {
        const int* xb = reinterpret_cast<const int*>(xs + (8 * n + g) * TS_MMA_XROW + 32 * cs + 4 * s);
        const ts_u32 b0 = (ts_u32)xb[0], b1 = (ts_u32)xb[4];
        const float2 x0 = ds[(8 * n + 2 * s) * TS_MMA_DSROW + cs];
        const float2 x1 = ds[(8 * n + 2 * s + 1) * TS_MMA_DSROW + cs];
        TS_UNROLL
        for (int w = 0; w < W; w++) {
            int r[4] = {0, 0, 0, 0};
            float v[4];
            if (V::split) {
                int r1[4] = {0, 0, 0, 0};
                ts_mma_k16(r, fa[w].q[0], fb[w].q[0], b0);
                ts_mma_k16(r1, fa[w].q[1], fb[w].q[1], b1);
                v[0] = fa[w].d[0] * (float)r[0] + fa[w].d[1] * (float)r1[0];
                v[1] = fa[w].d[0] * (float)r[1] + fa[w].d[1] * (float)r1[1];
                v[2] = fb[w].d[0] * (float)r[2] + fb[w].d[1] * (float)r1[2];
                v[3] = fb[w].d[0] * (float)r[3] + fb[w].d[1] * (float)r1[3];
            } else {
                ts_mma_k32(r, fa[w].q[0], fb[w].q[0], fa[w].q[1], fb[w].q[1], b0, b1);
                v[0] = fa[w].d[0] * (float)r[0];
                v[1] = fa[w].d[0] * (float)r[1];
                v[2] = fb[w].d[0] * (float)r[2];
                v[3] = fb[w].d[0] * (float)r[3];
            }
            acc[w][n][0] += x0.x * v[0] + fa[w].m * x0.y;
            acc[w][n][1] += x1.x * v[1] + fa[w].m * x1.y;
            acc[w][n][2] += x0.x * v[2] + fb[w].m * x0.y;
            acc[w][n][3] += x1.x * v[3] + fb[w].m * x1.y;
        }
    }
}

// This warp's 16 rows (from row0) of the tile: its lane's two rows' bytes offset (rows past
// n_out repeat the last row; their results are not stored).
struct TsMmaRows {
    int row0;
    long long a, b;
};

template <class V>
__device__ __forceinline__ TsMmaRows ts_mma_rows(int n_out, int k) {
    const int g = (threadIdx.x & 31) >> 2;
    const int row0 = (blockIdx.x * TS_MMA_WARPS + (threadIdx.x >> 5)) * 16;
    const long long rb = (long long)V::row_bytes(k);
    return TsMmaRows{row0, min(row0 + g, n_out - 1) * rb, min(row0 + g + 8, n_out - 1) * rb};
}

// out[(first + p) * n_out + row] = f(acc for pair p, row, i) for the lane's rows and pairs below w.
template <int NT, class F>
__device__ __forceinline__ void ts_mma_store(int row0, int n_out, int first, int w, F f) {
    const int lane = threadIdx.x & 31, g = lane >> 2, s = lane & 3;
    TS_UNROLL
    for (int n = 0; n < NT; n++)
        TS_UNROLL
        for (int i = 0; i < 4; i++) {
            const int p = 8 * n + 2 * s + (i & 1), row = row0 + g + 8 * (i >> 1);
            if (p < w && row < n_out) f(n, i, (ts_u64)(first + p) * n_out + row, row);
        }
}

template <class V, int NT>
__device__ __forceinline__ void ts_moe_mm_q8(const MoeMmQ8& p) {
    __shared__ __align__(16) signed char xs[8 * NT * TS_MMA_XROW];
    __shared__ float2 ds[8 * NT * TS_MMA_DSROW];
    const int4 t = p.tiles[blockIdx.y];
    // Warps past n_out still stage activations for the others (their rows repeat the last).
    const TsMmaRows rows = ts_mma_rows<V>(p.n_out, p.k);
    const ts_u8* w = p.w + t.x * p.expert_stride;
    const signed char* xq = p.xq + (ts_u64)t.z * p.k;
    const float2* xds = p.xds + (ts_u64)t.z * (p.k >> 5);
    const int s = threadIdx.x & 3, units = p.k >> 5;
    float acc[1][NT][4];
    TS_UNROLL
    for (int n = 0; n < NT; n++) acc[0][n][0] = acc[0][n][1] = acc[0][n][2] = acc[0][n][3] = 0.0f;
    for (int c0 = 0; c0 < units; c0 += TS_MMA_STAGE) {
        __syncthreads();  // the previous stage is no longer read
        ts_mma_stage<NT>(xq, xds, p.k, c0, xs, ds);
        __syncthreads();
        const int n = min(TS_MMA_STAGE, units - c0);
#pragma unroll 2
        for (int cs = 0; cs < n; cs++) {
            const TsFrag fa[1] = {V::frag(w + rows.a, c0 + cs, s)}, fb[1] = {V::frag(w + rows.b, c0 + cs, s)};
            ts_mma_chunk<V, NT, 1>(fa, fb, xs, ds, cs, acc);
        }
    }
    const float* bias = p.bias ? p.bias + (ts_u64)t.y * p.n_out : nullptr;
    ts_mma_store<NT>(rows.row0, p.n_out, t.z, t.w, [&](int n, int i, ts_u64 at, int row) {
        p.y[at] = acc[0][n][i] + (bias ? bias[row] : 0.0f);
    });
}

template <class V, int NT>
__device__ __forceinline__ void ts_moe_mm_gate_up_q8(const MoeMmGateUpQ8& p) {
    __shared__ __align__(16) signed char xs[8 * NT * TS_MMA_XROW];
    __shared__ float2 ds[8 * NT * TS_MMA_DSROW];
    const int4 t = p.tiles[blockIdx.y];
    // Warps past n_out still stage activations for the others (their rows repeat the last).
    const TsMmaRows rows = ts_mma_rows<V>(p.n_out, p.k);
    const long long at = t.x * p.expert_stride;
    const ts_u8 *wg = p.w_gate + at, *wu = p.w_up + at;
    const signed char* xq = p.xq + (ts_u64)t.z * p.k;
    const float2* xds = p.xds + (ts_u64)t.z * (p.k >> 5);
    const int s = threadIdx.x & 3, units = p.k >> 5;
    float acc[2][NT][4];  // gate, up
    TS_UNROLL
    for (int n = 0; n < NT; n++)
        TS_UNROLL
        for (int i = 0; i < 4; i++) acc[0][n][i] = 0.0f, acc[1][n][i] = 0.0f;
    for (int c0 = 0; c0 < units; c0 += TS_MMA_STAGE) {
        __syncthreads();  // the previous stage is no longer read
        ts_mma_stage<NT>(xq, xds, p.k, c0, xs, ds);
        __syncthreads();
        const int n = min(TS_MMA_STAGE, units - c0);
        for (int cs = 0; cs < n; cs++) {
            const int c = c0 + cs;
            const TsFrag fa[2] = {V::frag(wg + rows.a, c, s), V::frag(wu + rows.a, c, s)};
            const TsFrag fb[2] = {V::frag(wg + rows.b, c, s), V::frag(wu + rows.b, c, s)};
            ts_mma_chunk<V, NT, 2>(fa, fb, xs, ds, cs, acc);
        }
    }
    const ts_u64 bi = (ts_u64)t.y * p.n_out;
    ts_mma_store<NT>(rows.row0, p.n_out, t.z, t.w, [&](int n, int i, ts_u64 at, int row) {
        const float gb = p.gate_bias ? p.gate_bias[bi + row] : 0.0f, ub = p.up_bias ? p.up_bias[bi + row] : 0.0f;
        p.h[at] = ts_gated(p.kind, acc[0][n][i] + gb, acc[1][n][i] + ub, p.alpha, p.limit);
    });
}

extern "C" __global__ void gather_quantize_q8_1(const float* __restrict__ x, const int* __restrict__ rows,
                                                signed char* __restrict__ q, float2* __restrict__ ds, int width,
                                                long long n) {
    ts_grid_begin();
    // width is a multiple of 32, so each warp's block lies in one row.
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / width;
        ts_q8_store_warp(x[(long long)rows[p] * width + (i - p * width)], i, q, ds);
    }
}

#define TS_DEFINE_MM_Q8_TILE(t, nt, pairs)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * TS_MMA_WARPS) moe_mm_q8_##t##_##pairs(const MoeMmQ8 p) {     \
        ts_grid_begin();                                                                                    \
        ts_moe_mm_q8<vdot_##t, nt>(p);                                                                      \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * TS_MMA_WARPS) moe_mm_gate_up_q8_##t##_##pairs(           \
        const MoeMmGateUpQ8 p) {                                                                            \
        ts_grid_begin();                                                                                    \
        ts_moe_mm_gate_up_q8<vdot_##t, nt>(p);                                                              \
    }
#define TS_DEFINE_MM_Q8_KERNELS(t) TS_DEFINE_MM_Q8_TILE(t, 4, 32)

TS_Q8_TYPES(TS_DEFINE_MM_Q8_KERNELS)
