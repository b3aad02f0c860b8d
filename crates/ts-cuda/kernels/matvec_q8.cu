#include "vdot.cuh"

// Matvecs of quantized weights with 8-bit activations (vdot.cuh), for steps of few rows:
// decode, and the expert-indexed matvecs of the MoE flow. One set per type of TS_Q8_TYPES.
//
//   quantize_q8_1(x, q, ds, n)   x f32 [n] (n a multiple of 32) to TsQ8; any 1-D launch.
//   matvec_q8_<t>(MatvecQ8)      y[r][o] = W[o] . x[r] (+ bias[o]) for r < m.
//   matvec_q8_wide_<t>(MatvecQ8) the same for steps of three rows and more, up to eight a pass.
//   matvec_q8_multi(MatvecQ8Multi) matvec_q8_<t> of up to four weights of any types, one input.
//   moe_matvec_q8_<t>(MoeMatvecQ8), moe_gate_up_q8_<t>(MoeGateUpQ8): as moe_matvec_<t> and
//       moe_gate_up_<t> of matmul.cu, the expert's bias rows added in the same kernel.
//   moe_chunk_q8_<t>(MoeChunkQ8), moe_chunk_gate_up_q8_<t>(MoeChunkGateUpQ8): the same for
//       chunks of one expert's rows (moe_group_pairs), each expert's weights read once.
// Layout: a group of `lanes` (4, 8, 16 or 32) lanes of a warp shares a weight row, each lane
// taking units j, j + lanes, ... (vdot.cuh), so that a row of few units still keeps a warp
// busy; a block is (32, 4): 4 * 32 / lanes rows. Grid x: ceil(n_out / rows per block); y:
// slots (MoE). (Two rows per group, sharing their activation loads, measured slower on the
// H200: qwen3-30b-a3b decode 196 against 205 tok/s, half the groups.)

// Units per trip of a lane's loop (a measurement knob: TURBOSPARK_NVRTC_DEFINES=TS_Q8_UNROLL=N).
#ifndef TS_Q8_UNROLL
#define TS_Q8_UNROLL 2
#endif
#define TS_PRAGMA_TEXT(x) _Pragma(#x)
#define TS_PRAGMA(x) TS_PRAGMA_TEXT(x)

// Sum over each group of `lanes` lanes (a power of two).
__device__ __forceinline__ float ts_lanes_sum(float v, int lanes) {
    for (int off = lanes >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, signed char* __restrict__ q,
                                         float2* __restrict__ ds, long long n) {
    ts_grid_begin();
    // Warps cover whole blocks of 32: blockDim.x and the stride are multiples of 32.
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        ts_q8_store_warp(x[i], i, q, ds);
}

// This thread's place: its group's weight row (clamped to the last, so that every lane takes
// part in the shuffles), whether that row exists, and its first unit.
struct TsQ8Lane {
    int row;
    bool live;
    int j;
};

__device__ __forceinline__ TsQ8Lane ts_q8_lane_at(int block, int n_out, int lanes) {
    const int o = (block * 4 + (int)threadIdx.y) * (32 / lanes) + (int)threadIdx.x / lanes;
    return TsQ8Lane{min(o, n_out - 1), o < n_out, (int)threadIdx.x & (lanes - 1)};
}

__device__ __forceinline__ TsQ8Lane ts_q8_lane(int n_out, int lanes) { return ts_q8_lane_at(blockIdx.x, n_out, lanes); }

// Asks L2 for lines j, j + lanes, ... (128 bytes each) of a row of `bytes`: a hint that binds
// no value.
__device__ __forceinline__ void ts_prefetch_row_l2(const ts_u8* row, ts_u64 bytes, int j, int lanes) {
    for (ts_u64 off = (ts_u64)j * 128; off < bytes; off += (ts_u64)lanes * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
}

// A measurement knob (TURBOSPARK_NVRTC_DEFINES=TS_Q8_PREFETCH=1 for L2, 2 for L1): each lane
// asks for its share of the row's 128-byte lines before the first unit's loads, so that a row's
// bytes are all requested at once (a decode launch is bound by the loads in flight: Nsight
// Compute on qwen3's expert gate/up, docs/BENCHMARKS.md).
#ifndef TS_Q8_PREFETCH
#define TS_Q8_PREFETCH 0
#endif
__device__ __forceinline__ void ts_q8_prefetch_row(const ts_u8* row, ts_u64 bytes, int j, int lanes) {
#if TS_Q8_PREFETCH == 2
    for (ts_u64 off = (ts_u64)j * 128; off < bytes; off += (ts_u64)lanes * 128)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(row + off));
#elif TS_Q8_PREFETCH
    ts_prefetch_row_l2(row, bytes, j, lanes);
#endif
}

// A measurement knob (TURBOSPARK_NVRTC_DEFINES=TS_Q8_EARLY=1): a dense matvec asks L2 for its
// lane's share of its weight row before waiting for the kernel before it (ts_grid_begin), so
// that the fetch overlaps that kernel's end where the launch was early. A prefetch binds no
// value: the row's loads after the wait see what the kernels before wrote (an expert cache's
// slots are filled by copies, never by the kernel before). TS_Q8_EARLY=2 also has an expert
// down projection do so for its slot's expert: the slot's index was written by the router two
// kernels back, complete before the gate/up kernel between them let this one be scheduled.
#ifndef TS_Q8_EARLY
#define TS_Q8_EARLY 0
#endif
template <class V>
__device__ __forceinline__ void ts_q8_early(const ts_u8* w, int n_out, int k, int lanes) {
#if TS_Q8_EARLY
    if (w == nullptr) return;
    const TsQ8Lane l = ts_q8_lane(n_out, lanes);
    const ts_u64 bytes = V::row_bytes(k);
    ts_prefetch_row_l2(w + l.row * bytes, bytes, l.j, lanes);
#endif
}

// acc[r] = the lane's row (at w + row * row_bytes) . activation row r of x, summed over the
// group's lanes.
template <class V, int M>
__device__ __forceinline__ void ts_q8_row(const ts_u8* __restrict__ w, const TsQ8Lane& l, const TsQ8& x, int lanes,
                                          float (&acc)[M]) {
    const ts_u8* row = w + l.row * V::row_bytes(x.k);
    ts_q8_prefetch_row(row, V::row_bytes(x.k), l.j, lanes);
    TS_UNROLL
    for (int r = 0; r < M; r++) acc[r] = 0.0f;
    const int units = x.k >> 5;
    // Two units per trip, so that their loads are in flight together: a build with this
    // measured 205 tok/s of qwen3-30b-a3b decode on the H200, one without it 187.
    TS_PRAGMA(unroll TS_Q8_UNROLL)
    for (int u = l.j; u < units; u += lanes) V::template dot<M>(row, u, x, acc);
    TS_UNROLL
    for (int r = 0; r < M; r++) acc[r] = ts_lanes_sum(acc[r], lanes);
}

// Kernel parameters (crates/ts-cuda/src/matvec_q8.rs mirrors them).
struct MatvecQ8 {
    const ts_u8* w;
    const signed char* xq;
    const float2* xds;
    float* y;
    const float* bias;  // [n_out] or null
    int n_out, k, m, lanes;
};

struct MoeMatvecQ8 {
    const ts_u8* w;  // expert 0 (or slot 0)
    const int* index;  // [slots]: expert (slot) of each slot s; negative skips it
    const signed char* xq;
    const float2* xds;
    float* y;  // [slots][n_out]
    const float* bias;  // [n_expert][n_out] or null
    const int* ids;  // [slots]: the routed expert (bias rows)
    long long expert_stride;  // bytes
    int x_group;  // slot s reads activation row s / x_group
    int n_out, k, lanes;
};

struct MoeGateUpQ8 {
    const ts_u8* w_gate;
    const ts_u8* w_up;
    const int* index;  // as MoeMatvecQ8
    const int* ids;  // [slots]: the routed expert (bias rows)
    const signed char* xq;
    const float2* xds;
    float* h;  // [slots][n_out]
    const float* gate_bias;  // [n_expert][n_out] or null
    const float* up_bias;
    long long expert_stride;
    int x_group, n_out, k, lanes;
    int kind;  // activation.cuh
    float alpha, limit;
};

// Activation rows r0 .. r0 + M - 1 of a MatvecQ8.
template <class V, int M>
__device__ __forceinline__ void ts_matvec_q8_rows(const MatvecQ8& p, const TsQ8Lane& l, int r0) {
    const TsQ8 x{p.xq + (ts_u64)r0 * p.k, p.xds + (ts_u64)r0 * (p.k >> 5), p.k};
    float acc[M];
    ts_q8_row<V, M>(p.w, l, x, p.lanes, acc);
    if (l.live && l.j == 0) {
        const float b = p.bias ? p.bias[l.row] : 0.0f;
        TS_UNROLL
        for (int r = 0; r < M; r++) p.y[(ts_u64)(r0 + r) * p.n_out + l.row] = acc[r] + b;
    }
}

// m rows in passes of at most two, so that registers (and occupancy) suit m = 1; `block` is
// the block's place among the launch's blocks for p.
template <class V>
__device__ __forceinline__ void ts_matvec_q8_at(const MatvecQ8& p, int block) {
    const TsQ8Lane l = ts_q8_lane_at(block, p.n_out, p.lanes);
    for (int r0 = 0; r0 < p.m; r0 += 2) {
        if (p.m - r0 >= 2) {
            ts_matvec_q8_rows<V, 2>(p, l, r0);
        } else {
            ts_matvec_q8_rows<V, 1>(p, l, r0);
        }
    }
}

template <class V>
__device__ __forceinline__ void ts_matvec_q8(const MatvecQ8& p) {
    ts_matvec_q8_at<V>(p, blockIdx.x);
}

// Up to MULTI_PARTS matvecs of one input (a layer's q, k and v) in one launch, each of its own
// type: blocks first_block .. of the next part's first_block - 1 take part i, as matvec_q8_<t>
// would with the same lanes (the same sums, bit for bit). One launch instead of one a stream
// joined by events keeps the chain of dependent launches (launch.cuh) unbroken.
#define MULTI_PARTS 4
#define TS_Q8_ID(t) TS_Q8_ID_##t,
enum TsQ8Id { TS_Q8_TYPES(TS_Q8_ID) };

struct MatvecQ8Part {
    const ts_u8* w;
    float* y;  // [m][n_out]
    const float* bias;  // [n_out] or null
    int n_out, type, lanes, first_block;  // type: a TsQ8Id
};

// Kernel parameters (crates/ts-cuda/src/matvec_q8.rs mirrors them).
struct MatvecQ8Multi {
    MatvecQ8Part part[MULTI_PARTS];
    const signed char* xq;  // [m][k] and [m][k / 32]: the input's 8-bit copy
    const float2* xds;
    int parts, k, m;
};

extern "C" __global__ void __launch_bounds__(128) matvec_q8_multi(const MatvecQ8Multi p) {
    // The block's part, chosen with constant indices (no copy of the parameters to memory).
    MatvecQ8Part t = p.part[0];
    TS_UNROLL
    for (int i = 1; i < MULTI_PARTS; i++)
        if (i < p.parts && (int)blockIdx.x >= p.part[i].first_block) t = p.part[i];
    ts_grid_begin();
    const MatvecQ8 mv{t.w, p.xq, p.xds, t.y, t.bias, t.n_out, p.k, p.m, t.lanes};
    const int block = (int)blockIdx.x - t.first_block;
    switch (t.type) {
#define TS_Q8_MULTI_CASE(ty)                       \
    case TS_Q8_ID_##ty:                            \
        ts_matvec_q8_at<vdot_##ty>(mv, block);     \
        break;
        TS_Q8_TYPES(TS_Q8_MULTI_CASE)
    }
}

// Steps of several rows (checks of guesses, a few sequences' decode) in passes of up to eight,
// each row's weights read once a pass: a kernel of its own, whose eight sums' registers the
// one-row launches do not pay for. A row's sum is the one-row kernel's, bit for bit (the same
// units in the same order per lane, the same lane sums).
template <class V>
__device__ __forceinline__ void ts_matvec_q8_wide(const MatvecQ8& p) {
    const TsQ8Lane l = ts_q8_lane(p.n_out, p.lanes);
    int r0 = 0;
    for (; p.m - r0 >= 8; r0 += 8) ts_matvec_q8_rows<V, 8>(p, l, r0);
    if (p.m - r0 >= 4) {
        ts_matvec_q8_rows<V, 4>(p, l, r0);
        r0 += 4;
    }
    if (p.m - r0 >= 2) {
        ts_matvec_q8_rows<V, 2>(p, l, r0);
        r0 += 2;
    }
    if (r0 < p.m) ts_matvec_q8_rows<V, 1>(p, l, r0);
}

template <class V>
__device__ __forceinline__ void ts_moe_matvec_q8(const MoeMatvecQ8& p) {
    const int s = blockIdx.y;
    const int e = p.index[s];
    if (e < 0) return;  // a slot of another group of experts
    const TsQ8Lane l = ts_q8_lane(p.n_out, p.lanes);
    const int xr = s / p.x_group;
    const TsQ8 x{p.xq + (ts_u64)xr * p.k, p.xds + (ts_u64)xr * (p.k >> 5), p.k};
    float acc[1];
    ts_q8_row<V, 1>(p.w + e * p.expert_stride, l, x, p.lanes, acc);
    if (l.live && l.j == 0)
        p.y[(ts_u64)s * p.n_out + l.row] = p.bias ? acc[0] + p.bias[(ts_u64)p.ids[s] * p.n_out + l.row] : acc[0];
}

template <class V>
__device__ __forceinline__ void ts_moe_gate_up_q8(const MoeGateUpQ8& p) {
    const int s = blockIdx.y;
    const int e = p.index[s];
    if (e < 0) return;
    const TsQ8Lane l = ts_q8_lane(p.n_out, p.lanes);
    const int xr = s / p.x_group;
    const TsQ8 x{p.xq + (ts_u64)xr * p.k, p.xds + (ts_u64)xr * (p.k >> 5), p.k};
    // Gate and up rows in one loop: both rows' loads in flight together.
    const long long at = e * p.expert_stride + (long long)l.row * V::row_bytes(p.k);
    ts_q8_prefetch_row(p.w_gate + at, V::row_bytes(p.k), l.j, p.lanes);
    ts_q8_prefetch_row(p.w_up + at, V::row_bytes(p.k), l.j, p.lanes);
    float g[1] = {0.0f}, u[1] = {0.0f};
    const int units = p.k >> 5;
    TS_PRAGMA(unroll TS_Q8_UNROLL)
    for (int c = l.j; c < units; c += p.lanes) {
        V::template dot<1>(p.w_gate + at, c, x, g);
        V::template dot<1>(p.w_up + at, c, x, u);
    }
    const float gs = ts_lanes_sum(g[0], p.lanes), us = ts_lanes_sum(u[0], p.lanes);
    if (l.live && l.j == 0) {
        const long long bi = (long long)p.ids[s] * p.n_out + l.row;
        const float gv = p.gate_bias ? gs + p.gate_bias[bi] : gs;
        const float uv = p.up_bias ? us + p.up_bias[bi] : us;
        p.h[(ts_u64)s * p.n_out + l.row] = ts_gated(p.kind, gv, uv, p.alpha, p.limit);
    }
}

// The chunked expert matvecs (steps of a few rows per expert, moe.rs): block row y takes
// chunk y of moe_group_pairs (expert, first place, rows), whose activation rows are
// consecutive in the grouped order, and reads the expert's weights once for them; blocks past
// the chunk count return. Outputs go to the same places.
struct MoeChunkQ8 {
    const ts_u8* w;  // expert 0
    const int* chunks;  // [][3] (expert, first place, rows)
    const int* count;  // [1] chunks
    const signed char* xq;  // [places][k], grouped order
    const float2* xds;
    float* y;  // [places][n_out]
    const float* bias;  // [n_expert][n_out] or null
    long long expert_stride;  // bytes
    int n_out, k, lanes;
};

struct MoeChunkGateUpQ8 {
    const ts_u8* w_gate;
    const ts_u8* w_up;
    const int* chunks;  // as MoeChunkQ8
    const int* count;
    const signed char* xq;
    const float2* xds;
    float* h;  // [places][n_out]
    const float* gate_bias;  // [n_expert][n_out] or null
    const float* up_bias;
    long long expert_stride;
    int n_out, k, lanes;
    int kind;  // activation.cuh
    float alpha, limit;
};

template <class V>
__device__ __forceinline__ void ts_moe_chunk_q8(const MoeChunkQ8& p) {
    if ((int)blockIdx.y >= *p.count) return;
    const int* ch = p.chunks + 3 * blockIdx.y;
    const int e = ch[0], at = ch[1];
    const MatvecQ8 mv{p.w + e * p.expert_stride,
                      p.xq + (ts_u64)at * p.k,
                      p.xds + (ts_u64)at * (p.k >> 5),
                      p.y + (ts_u64)at * p.n_out,
                      p.bias ? p.bias + (ts_u64)e * p.n_out : nullptr,
                      p.n_out,
                      p.k,
                      ch[2],
                      p.lanes};
    ts_matvec_q8<V>(mv);
}

// Gate and up of activation rows r0 .. r0 + M - 1 (places) of expert e, their biases and the
// activation.
template <class V, int M>
__device__ __forceinline__ void ts_chunk_gate_up_rows(const MoeChunkGateUpQ8& p, const TsQ8Lane& l, int e, int r0) {
    const TsQ8 x{p.xq + (ts_u64)r0 * p.k, p.xds + (ts_u64)r0 * (p.k >> 5), p.k};
    const long long at = e * p.expert_stride + (long long)l.row * V::row_bytes(p.k);
    float g[M], u[M];
    TS_UNROLL
    for (int r = 0; r < M; r++) g[r] = 0.0f, u[r] = 0.0f;
    const int units = p.k >> 5;
    TS_PRAGMA(unroll TS_Q8_UNROLL)
    for (int c = l.j; c < units; c += p.lanes) {
        V::template dot<M>(p.w_gate + at, c, x, g);
        V::template dot<M>(p.w_up + at, c, x, u);
    }
    TS_UNROLL
    for (int r = 0; r < M; r++) g[r] = ts_lanes_sum(g[r], p.lanes), u[r] = ts_lanes_sum(u[r], p.lanes);
    if (l.live && l.j == 0) {
        const long long bi = (long long)e * p.n_out + l.row;
        const float gb = p.gate_bias ? p.gate_bias[bi] : 0.0f, ub = p.up_bias ? p.up_bias[bi] : 0.0f;
        TS_UNROLL
        for (int r = 0; r < M; r++)
            p.h[(ts_u64)(r0 + r) * p.n_out + l.row] = ts_gated(p.kind, g[r] + gb, u[r] + ub, p.alpha, p.limit);
    }
}

// A chunk's rows in passes of at most two (as ts_matvec_q8).
template <class V>
__device__ __forceinline__ void ts_moe_chunk_gate_up_q8(const MoeChunkGateUpQ8& p) {
    if ((int)blockIdx.y >= *p.count) return;
    const int* ch = p.chunks + 3 * blockIdx.y;
    const int e = ch[0], end = ch[1] + ch[2];
    const TsQ8Lane l = ts_q8_lane(p.n_out, p.lanes);
    for (int r0 = ch[1]; r0 < end; r0 += 2) {
        if (end - r0 >= 2) {
            ts_chunk_gate_up_rows<V, 2>(p, l, e, r0);
        } else {
            ts_chunk_gate_up_rows<V, 1>(p, l, e, r0);
        }
    }
}

#define TS_DEFINE_Q8_KERNELS(t)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) matvec_q8_##t(const MatvecQ8 p) {                              \
        ts_q8_early<vdot_##t>(p.w, p.n_out, p.k, p.lanes);                                                            \
        ts_grid_begin();                                                                                              \
        ts_matvec_q8<vdot_##t>(p);                                                                                    \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) matvec_q8_wide_##t(const MatvecQ8 p) {                         \
        ts_q8_early<vdot_##t>(p.w, p.n_out, p.k, p.lanes);                                                            \
        ts_grid_begin();                                                                                              \
        ts_matvec_q8_wide<vdot_##t>(p);                                                                               \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) moe_matvec_q8_##t(const MoeMatvecQ8 p) {                       \
        if (TS_Q8_EARLY >= 2) {                                                                                       \
            const int e = p.index[blockIdx.y];                                                                        \
            ts_q8_early<vdot_##t>(e < 0 ? nullptr : p.w + e * p.expert_stride, p.n_out, p.k, p.lanes);               \
        }                                                                                                             \
        ts_grid_begin();                                                                                              \
        ts_moe_matvec_q8<vdot_##t>(p);                                                                                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) moe_gate_up_q8_##t(const MoeGateUpQ8 p) {                      \
        ts_grid_begin();                                                                                              \
        ts_moe_gate_up_q8<vdot_##t>(p);                                                                               \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) moe_chunk_q8_##t(const MoeChunkQ8 p) {                         \
        ts_grid_begin();                                                                                              \
        ts_moe_chunk_q8<vdot_##t>(p);                                                                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) moe_chunk_gate_up_q8_##t(const MoeChunkGateUpQ8 p) {           \
        ts_grid_begin();                                                                                              \
        ts_moe_chunk_gate_up_q8<vdot_##t>(p);                                                                         \
    }

TS_Q8_TYPES(TS_DEFINE_Q8_KERNELS)
