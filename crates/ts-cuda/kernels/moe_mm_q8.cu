// Grouped expert matmuls with 8-bit activations (vdot.cuh), for steps of many rows (a prompt):
// ggml's mul_mat_id for a batch. The host orders the (row, slot) pairs by expert and cuts each
// expert's pairs into tiles of at most TS_MM_TILE; one launch per projection multiplies every
// tile, each weight unit decoded once per tile instead of once per pair.
//
//   gather_quantize_q8_1(x, rows, q, ds, width, n)   q[p] = TsQ8 of x[rows[p]], n = pairs * width
//   moe_mm_q8_<t>(MoeMmQ8)              y[p] = W_e . x[p] (+ bias[e]) for each tile's pairs p
//   moe_mm_gate_up_q8_<t>(MoeMmGateUpQ8) h[p] = act(gate_e . x[p] + gate_bias[e], up_e . x[p] + up_bias[e])
//
// Activations and outputs are in the grouped order. The activations have TS_MM_TILE rows after
// the last pair that are read by a short tile and never used. Layout as matvec_q8.cu: a group
// of `lanes` lanes shares a weight row; grid x over the output rows, y over the tiles.

#define TS_MM_TILE 8

// A tile (int4): x the expert's index among the weights (expert, or cache slot), y the expert
// (bias rows), z its first pair in the grouped order, w its pair count (1 .. TS_MM_TILE).

// Kernel parameters (crates/ts-cuda/src/moe_mm.rs mirrors them).
struct MoeMmQ8 {
    const ts_u8* w;  // expert (slot) 0
    const int4* tiles;
    const signed char* xq;
    const float2* xds;
    float* y;  // [pairs][n_out]
    const float* bias;  // [n_expert][n_out] or null
    long long expert_stride;  // bytes
    int n_out, k, lanes;
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
    int n_out, k, lanes;
    int kind;  // activation.cuh
    float alpha, limit;
};

extern "C" __global__ void gather_quantize_q8_1(const float* __restrict__ x, const int* __restrict__ rows,
                                                signed char* __restrict__ q, float2* __restrict__ ds, int width,
                                                long long n) {
    // width is a multiple of 32, so each warp's block lies in one row.
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long p = i / width;
        ts_q8_store_warp(x[(long long)rows[p] * width + (i - p * width)], i, q, ds);
    }
}

// The tile's activations: TS_MM_TILE rows from its first pair.
__device__ __forceinline__ TsQ8 ts_mm_tile_x(const signed char* xq, const float2* xds, int4 t, int k) {
    return TsQ8{xq + (ts_u64)t.z * k, xds + (ts_u64)t.z * (k >> 5), k};
}

template <class V>
__device__ __forceinline__ void ts_moe_mm_q8(const MoeMmQ8& p) {
    const int4 t = p.tiles[blockIdx.y];
    const TsQ8Lane l = ts_q8_lane(p.n_out, p.lanes);
    float acc[TS_MM_TILE];
    ts_q8_row<V, TS_MM_TILE>(p.w + t.x * p.expert_stride, l, ts_mm_tile_x(p.xq, p.xds, t, p.k), p.lanes, acc);
    if (l.live && l.j == 0) {
        const float b = p.bias ? p.bias[(ts_u64)t.y * p.n_out + l.row] : 0.0f;
        TS_UNROLL
        for (int r = 0; r < TS_MM_TILE; r++)
            if (r < t.w) p.y[(ts_u64)(t.z + r) * p.n_out + l.row] = acc[r] + b;
    }
}

template <class V>
__device__ __forceinline__ void ts_moe_mm_gate_up_q8(const MoeMmGateUpQ8& p) {
    const int4 t = p.tiles[blockIdx.y];
    const TsQ8Lane l = ts_q8_lane(p.n_out, p.lanes);
    const TsQ8 x = ts_mm_tile_x(p.xq, p.xds, t, p.k);
    const long long at = t.x * p.expert_stride + (long long)l.row * V::row_bytes(p.k);
    float g[TS_MM_TILE], u[TS_MM_TILE];
    TS_UNROLL
    for (int r = 0; r < TS_MM_TILE; r++) g[r] = 0.0f, u[r] = 0.0f;
    const int units = p.k >> 5;
    for (int c = l.j; c < units; c += p.lanes) {
        V::template dot<TS_MM_TILE>(p.w_gate + at, c, x, g);
        V::template dot<TS_MM_TILE>(p.w_up + at, c, x, u);
    }
    TS_UNROLL
    for (int r = 0; r < TS_MM_TILE; r++) g[r] = ts_lanes_sum(g[r], p.lanes), u[r] = ts_lanes_sum(u[r], p.lanes);
    if (l.live && l.j == 0) {
        const long long bi = (long long)t.y * p.n_out + l.row;
        const float gb = p.gate_bias ? p.gate_bias[bi] : 0.0f, ub = p.up_bias ? p.up_bias[bi] : 0.0f;
        TS_UNROLL
        for (int r = 0; r < TS_MM_TILE; r++)
            if (r < t.w) p.h[(ts_u64)(t.z + r) * p.n_out + l.row] = ts_gated(p.kind, g[r] + gb, u[r] + ub, p.alpha, p.limit);
    }
}

#define TS_DEFINE_MM_Q8_KERNELS(t)                                                                         \
    extern "C" __global__ void __launch_bounds__(128) moe_mm_q8_##t(const MoeMmQ8 p) { ts_moe_mm_q8<vdot_##t>(p); } \
    extern "C" __global__ void __launch_bounds__(128) moe_mm_gate_up_q8_##t(const MoeMmGateUpQ8 p) {      \
        ts_moe_mm_gate_up_q8<vdot_##t>(p);                                                                 \
    }

TS_Q8_TYPES(TS_DEFINE_MM_Q8_KERNELS)
