// Attention kernels: rotary embeddings, the KV-cache stores (rope_store: both, with the
// per-head norms, in one launch) and attention itself.
// Each mirrors an op of ts-cpu's ops.rs. Uses ops.cu's helpers (ops.cu comes first in the one compiled source).

// Rotary embedding of every head of `x` [m][n_heads * head_dim] in place.
// pos[m]; inv_freq[n_rot/2]; interleaved pairs (2i, 2i+1) or halves (i, i + n_rot/2).
// grid.x = m * n_heads, block.x >= n_rot / 2 (looped).
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int n_heads, int head_dim,
                                int n_rot, int interleaved, float mscale) {
    ts_grid_begin();
    int row = blockIdx.x / n_heads;
    float* h = x + (long long)blockIdx.x * head_dim;
    int half = n_rot / 2;
    float p = (float)pos[row];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float theta = p * inv_freq[i];
        float s, c;
        sincosf(theta, &s, &c);
        c *= mscale;
        s *= mscale;
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float x0 = h[a], x1 = h[b];
        h[a] = x0 * c - x1 * s;
        h[b] = x0 * s + x1 * c;
    }
}

// Where one row's keys and values go for one layer: its sequence's ring of
// `slots` positions, and the row's position.
struct RowKv {
    unsigned long long k;  // float* [slots][kv_dim]
    unsigned long long v;  // float* [slots][v_dim]
    int slots;
    int pos;
};

// Stores row r's k [kv_dim] and v [v_dim] at slot pos % slots. grid.x = m.
extern "C" __global__ void kv_store(const float* k, const float* v, const RowKv* info, int kv_dim, int v_dim) {
    ts_grid_begin();
    RowKv ri = info[blockIdx.x];
    int slot = ri.pos % ri.slots;
    float* kd = (float*)ri.k + (long long)slot * kv_dim;
    float* vd = (float*)ri.v + (long long)slot * v_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) kd[i] = k[(long long)blockIdx.x * kv_dim + i];
    for (int i = threadIdx.x; i < v_dim; i += blockDim.x) vd[i] = v[(long long)blockIdx.x * v_dim + i];
}

// Heads of at most this many elements take `rope_store`.
#define ROPE_STORE_MAX_HEAD 512

// rope_store's parameters (crates/ts-cuda/src/attention.rs mirrors them).
struct RopeStore {
    float* q;  // [m][n_head * head_dim]
    float* k;  // [m][n_head_kv * head_dim], or null for a layer sharing another's cache
    const float* v;  // [m][n_head_kv * head_dim_v]
    const float* q_scale;  // [head_dim] or null (no scale)
    const float* k_scale;
    const int* pos;  // [m]
    const float* inv_freq;  // [n_rot / 2]
    const RowKv* info;  // [m]
    int m, n_head, n_head_kv, head_dim, head_dim_v, n_rot, interleaved, norm;
    float mscale, eps;
};

// Pair i of head h rotated by (c, s): elements 2i and 2i + 1 (interleaved) or i and i + half.
__device__ __forceinline__ void rotate_pair(float* h, int i, int half, int interleaved, float c, float s) {
    const int a = interleaved ? 2 * i : i;
    const int o = interleaved ? 2 * i + 1 : i + half;
    const float x0 = h[a], x1 = h[o];
    h[a] = x0 * c - x1 * s;
    h[o] = x0 * s + x1 * c;
}

// Head `x` [len] made ready in shared `h` [len]: RMS-normed (times `w` where not null) where
// `p.norm` is set, then rotated at position `at` as `rope` rotates it. Every thread of the
// block calls it; h is whole on return.
__device__ __forceinline__ void ready_head(float* h, const float* x, int len, const RopeStore& p, const float* w, float at) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        const float v = x[i];
        h[i] = v;
        ss += v * v;
    }
    if (p.norm) {
        // block_sum synchronizes, so h is whole after it.
        const float scale = rsqrtf(block_sum(ss) / len + p.eps);
        for (int i = threadIdx.x; i < len; i += blockDim.x) h[i] = h[i] * scale * (w ? w[i] : 1.0f);
    }
    __syncthreads();
    const int half = p.n_rot / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(at * p.inv_freq[i], &s, &c);
        rotate_pair(h, i, half, p.interleaved, c * p.mscale, s * p.mscale);
    }
    __syncthreads();
}

// Stores the ready key head `kh` [head_dim] and value head `vs` [head_dim_v] of row `row`'s
// KV head `head` at the row's cache slot (as kv_store does).
__device__ __forceinline__ void store_kv_head(const RopeStore& p, int row, int head, const float* kh, const float* vs) {
    const RowKv ri = p.info[row];
    const long long slot = ri.pos % ri.slots;
    float* kd = (float*)ri.k + (slot * p.n_head_kv + head) * p.head_dim;
    for (int i = threadIdx.x; i < p.head_dim; i += blockDim.x) kd[i] = kh[i];
    float* vd = (float*)ri.v + (slot * p.n_head_kv + head) * p.head_dim_v;
    for (int i = threadIdx.x; i < p.head_dim_v; i += blockDim.x) vd[i] = vs[i];
}

// A layer's queries and keys made ready and its keys and values stored, in one launch:
// block b < m * n_head takes query head b, the blocks after it the key heads. A head is
// made ready (ready_head) and written back; a key head is also stored at its row's cache
// slot with the same head of v. grid.x = m * (n_head + n_head_kv) (n_head without keys),
// block 128.
extern "C" __global__ void rope_store(const RopeStore p) {
    ts_grid_begin();
    __shared__ float h[ROPE_STORE_MAX_HEAD];
    const int n_q = p.m * p.n_head;
    const bool key = (int)blockIdx.x >= n_q;
    const int heads = key ? p.n_head_kv : p.n_head;
    const int b = key ? blockIdx.x - n_q : blockIdx.x;
    const int row = b / heads, head = b % heads;
    float* x = (key ? p.k : p.q) + (long long)b * p.head_dim;
    ready_head(h, x, p.head_dim, p, key ? p.k_scale : p.q_scale, (float)p.pos[row]);
    for (int i = threadIdx.x; i < p.head_dim; i += blockDim.x) x[i] = h[i];
    if (key) store_kv_head(p, row, head, h, p.v + (long long)b * p.head_dim_v);
}

// Warps of a decode attention block (device.rs's attention_warps sets it).
#ifndef ATTN_WARPS
#define ATTN_WARPS 16
#endif
// Runs a split decode attention has at most (attention.rs's MAX_SPLIT; more blocks leave).
#define ATTN_MAX_RUNS 64
// Positions scored together: their weights wait in shared memory for the values' pass
// (device.rs's attention_tile sets it).
#ifndef ATTN_TILE
#define ATTN_TILE 128
#endif
// Lanes that share one position's dot products in the scores' pass.
#define ATTN_GROUP 8
// Elements a thread of the combining block sums at once.
#define ATTN_COMBINE 2
// Query heads whose warps' sums are added in one round at the end (16 KiB of shared memory).
#define ATTN_HEADS_AT_ONCE(max_head_dim) \
    (4096 / (ATTN_WARPS * (max_head_dim)) > 0 ? 4096 / (ATTN_WARPS * (max_head_dim)) : 1)

// A decode attention launch: grid (n_head, m, n_split), block 32 * ATTN_WARPS. Block b takes
// query head b alone while its row sees fewer than group_from positions; from there on the
// block of every heads_per_block-th head of a KV head's group takes that head and the next
// ones of its group (up to heads_per_block), and the blocks between leave at once.
struct DecodeAttn {
    const float* q;  // [m][n_head * hd]
    float* out;  // [m][n_head * hdv]
    const RowKv* info;  // [m]
    const float* sinks;  // [n_head] or null: an extra logit in the denominator only
    signed char* oq;  // with ods, not null: out also quantized to 8 bits (hdv a multiple of 32)
    float2* ods;
    float* partial;  // n_split > 1: [m][n_head][n_split][2 + hdv] (max, sum, weighted values)
    unsigned int* done;  // n_split > 1: [m * n_head] counters, zero between launches
    int n_head, n_head_kv, hd, hdv, window, heads_per_block, group_from;
    float scale, softcap;
    // With rope.k not null, the rows' queries and new keys as the projections left them:
    // each block makes its query heads and their KV head's new key ready itself (rope_store's
    // work, for rows of distinct sequences: a row sees no other row's new key), attends the
    // row's own position with that key and rope.v's value, and the first block of each KV
    // head (split 0) stores them in the cache.
    RopeStore rope;
};

__device__ __forceinline__ float4 attn_scaled(float4 a, float c) {
    return make_float4(a.x * c, a.y * c, a.z * c, a.w * c);
}

__device__ __forceinline__ float4 attn_fma4(float e, float4 v, float4 a) {
    return make_float4(a.x + e * v.x, a.y + e * v.y, a.z + e * v.z, a.w + e * v.w);
}

__device__ __forceinline__ float attn_dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// Elements i .. i + 3 of a value row of hdv (zeros past it): one 16-byte load where rows
// start on 16 bytes (hdv a multiple of 4).
__device__ __forceinline__ float4 attn_load4(const float* v, int i, int hdv, bool vec) {
    if (vec) return *(const float4*)(v + i);
    return make_float4(v[i], i + 1 < hdv ? v[i + 1] : 0.0f, i + 2 < hdv ? v[i + 2] : 0.0f,
                       i + 3 < hdv ? v[i + 3] : 0.0f);
}

// Head `h` [len] in shared memory made ready by one warp (ready_head's work): RMS-normed
// (times `w` [len] where not null) where `p.norm` is set, then rotated by the row's
// cos / sin [n_rot / 2] (mscale in them).
__device__ __forceinline__ void ready_head_warp(float* h, int len, const RopeStore& p, const float* w,
                                                const float* cos_t, const float* sin_t) {
    const int lane = threadIdx.x % WARP;
    if (p.norm) {
        float ss = 0.0f;
        for (int i = lane; i < len; i += WARP) ss += h[i] * h[i];
        const float scale = rsqrtf(warp_sum(ss) / len + p.eps);
        for (int i = lane; i < len; i += WARP) h[i] = h[i] * scale * (w ? w[i] : 1.0f);
        __syncwarp();
    }
    const int half = p.n_rot / 2;
    for (int i = lane; i < half; i += WARP) rotate_pair(h, i, half, p.interleaved, cos_t[i], sin_t[i]);
    __syncwarp();
}

// Sums of G values over the ATTN_GROUP lanes of a group: lane j of the group is left with
// value j % G's sum. Lanes G or more apart add their values whole; then each level halves
// what a lane holds (the lane with bit o set keeps the upper half): 7 shuffles for 8 values.
template <int G>
__device__ __forceinline__ float attn_group_sums(float (&d)[G], int in_group) {
#pragma unroll
    for (int o = ATTN_GROUP / 2; o >= G; o >>= 1)
#pragma unroll
        for (int j = 0; j < G; j++) d[j] += __shfl_xor_sync(0xffffffffu, d[j], o);
#pragma unroll
    for (int n = G; n > 1; n >>= 1) {
        const int o = n / 2;
        const bool upper = in_group & o;
#pragma unroll
        for (int k = 0; k < n / 2; k++) {
            const float send = upper ? d[k] : d[k + o];
            const float keep = upper ? d[k + o] : d[k];
            d[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
        }
    }
    return d[0];
}

// Query heads h0 .. h0 + g - 1 (g <= G; h0 the in_kv-th of its group) of KV head kvh for one
// row, over the positions they see (their window, or all up to the row's position), ATTN_TILE
// positions at a time; each key and value is read once for the block's heads (blocks of one
// query head read them 6-8 times over in grouped-query models). Groups of ATTN_GROUP lanes
// score one position for every head (a tile's keys all in flight at once), warp j % ATTN_WARPS
// takes head j's tile max and weights, then each warp adds every ATTN_WARPS-th position's
// values to every head's sums; running maxima and sums rescale the sums from tile to tile,
// and the warps' sums are added at the end. With n_split = gridDim.z > 1
// the positions are cut into at most n_split runs of equally many whole tiles, one per block
// (long contexts: more blocks at work, each a short chain of loads); blocks past the last run
// leave at once. With one run its block writes the output; with more, each leaves its maxima,
// sums and weighted values in `partial`, and the run that finishes last (`done`) combines
// them and resets its counter. Heads of up to MAX_HEAD_DIM; `wacc`
// [ATTN_HEADS_AT_ONCE][ATTN_WARPS][MAX_HEAD_DIM] is shared memory for the warps' sums.
template <int MAX_HEAD_DIM, int G>
__device__ __forceinline__ void attention_heads(const DecodeAttn& p, const RowKv ri, int seen_first, int tiles,
                                                int h0, int g, int kvh, int in_kv,
                                                float (*wacc)[ATTN_WARPS][MAX_HEAD_DIM]) {
    static_assert(G <= ATTN_GROUP && ATTN_WARPS * WARP >= ATTN_MAX_RUNS, "attention launch shape");
    const int n_head = p.n_head, n_head_kv = p.n_head_kv, hd = p.hd, hdv = p.hdv;
    const float scale = p.scale, softcap = p.softcap;
    const int r = blockIdx.y;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int kv_dim = n_head_kv * hd, v_dim = n_head_kv * hdv;
    const float* K = (const float*)ri.k + kvh * hd;
    const float* V = (const float*)ri.v + kvh * hdv;

    __shared__ __align__(16) float qs[G][MAX_HEAD_DIM];
    __shared__ __align__(16) float k_new[MAX_HEAD_DIM];
    __shared__ float weight[G][ATTN_TILE];
    __shared__ float head_corr[G];
    // This block's run of whole tiles; runs past the last tile (a short sequence in a long
    // cache) leave at once, and the runs that have positions combine among themselves.
    const int n_split = min((int)gridDim.z, ATTN_MAX_RUNS), split = blockIdx.z;
    const int tiles_per_split = (tiles + n_split - 1) / n_split;
    const int runs = (tiles + tiles_per_split - 1) / tiles_per_split;
    if (split >= runs) return;
    const int first = seen_first + split * tiles_per_split * ATTN_TILE;
    const int last = min((int)ri.pos, first + tiles_per_split * ATTN_TILE - 1);

    // The block's query heads (contiguous in q), and where this launch makes them ready the
    // KV head's new key (at position `fresh`) beside them, its norms' weights and the row's
    // rotation: all loads in flight at once (16 bytes a load where heads allow).
    const bool fused = p.rope.k != nullptr;
    const float* qh = p.q + ((long long)r * n_head + h0) * hd;
    const float* kh = fused ? p.rope.k + (long long)r * kv_dim + kvh * hd : nullptr;
    if (hd % 4 == 0) {
        const int n4 = hd / 4;
#pragma unroll 4
        for (int i = threadIdx.x; i < (g + fused) * n4; i += blockDim.x) {
            const int j = i / n4, e = 4 * (i - j * n4);
            const float4 x = *(const float4*)(j < g ? qh + j * hd + e : kh + e);
            *(float4*)(j < g ? &qs[j][e] : &k_new[e]) = x;
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < (g + fused) * hd; i += blockDim.x) {
            const int j = i / hd, e = i - j * hd;
            if (j < g) qs[j][e] = qh[i];
            else k_new[e] = kh[e];
        }
    }
    __shared__ float w_q[MAX_HEAD_DIM], w_k[MAX_HEAD_DIM], cos_t[MAX_HEAD_DIM / 2], sin_t[MAX_HEAD_DIM / 2];
    if (fused) {
        const float at = (float)p.rope.pos[r];
        for (int i = threadIdx.x; i < p.rope.n_rot / 2; i += blockDim.x) {
            float s, c;
            sincosf(at * p.rope.inv_freq[i], &s, &c);
            cos_t[i] = c * p.rope.mscale;
            sin_t[i] = s * p.rope.mscale;
        }
        if (p.rope.norm)
            for (int i = threadIdx.x; i < hd; i += blockDim.x) {
                if (p.rope.q_scale) w_q[i] = p.rope.q_scale[i];
                if (p.rope.k_scale) w_k[i] = p.rope.k_scale[i];
            }
    }
    __syncthreads();
    const float* v_new = nullptr;
    int fresh = -1;
    if (fused) {
        for (int j = warp; j <= g; j += ATTN_WARPS) {
            const float* w = j < g ? (p.rope.q_scale ? w_q : nullptr) : (p.rope.k_scale ? w_k : nullptr);
            ready_head_warp(j < g ? qs[j] : k_new, hd, p.rope, w, cos_t, sin_t);
        }
        __syncthreads();
        v_new = p.rope.v + (long long)r * v_dim + kvh * hdv;
        fresh = (int)ri.pos;
        if (in_kv == 0 && split == 0) store_kv_head(p.rope, r, kvh, k_new, v_new);
    }

    // Keys read 4 floats at a time where every head's keys start on 16 bytes.
    const bool vec = hd % 4 == 0;
    const int pgroup = threadIdx.x / ATTN_GROUP, in_group = threadIdx.x % ATTN_GROUP;
    const int pgroups = blockDim.x / ATTN_GROUP;
    // Head j's running max and sum, held by every lane of warp j % ATTN_WARPS.
    constexpr int OWN = (G + ATTN_WARPS - 1) / ATTN_WARPS;
    float mx[OWN], sum[OWN];
#pragma unroll
    for (int k = 0; k < OWN; k++) mx[k] = -INFINITY, sum[k] = 0.0f;
    // Head j's weighted values' sums: element c of acc[j][u] is dimension 128 u + 4 lane + c.
    const bool vec_v = hdv % 4 == 0;
    float4 acc[G][MAX_HEAD_DIM / 128];
#pragma unroll
    for (int j = 0; j < G; j++)
#pragma unroll
        for (int u = 0; u < MAX_HEAD_DIM / 128; u++) acc[j][u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The fast paths' loads: a position's key (value) row, or the fresh position's unrotated
    // key (its value) where this launch makes it ready; every address a global one, read
    // through the read-only path (the one cache row this launch writes, the fresh one, is not
    // read), so that a pass's loads are all issued before the first is used.
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float* k_fresh = fused ? kh : K;
    const float* v_fresh = fused ? v_new : V;

    for (int start = first; start <= last; start += ATTN_TILE) {
        const int n = min(ATTN_TILE, last + 1 - start);
        if (vec) {
            // Group pgroup scores positions pgroup, pgroup + PGROUPS, ... of the tile; the
            // KC chunks a lane takes of AHEAD positions' keys are in flight together.
            constexpr int PGROUPS = ATTN_WARPS * WARP / ATTN_GROUP;
            constexpr int KC = MAX_HEAD_DIM / (4 * ATTN_GROUP);
            constexpr int PER = (ATTN_TILE + PGROUPS - 1) / PGROUPS;
            constexpr int AHEAD = KC >= 8 ? 1 : (PER < 8 / KC ? PER : 8 / KC);
#pragma unroll
            for (int s0 = 0; s0 < PER; s0 += AHEAD) {
                float4 k4[AHEAD][KC];
#pragma unroll
                for (int a = 0; a < AHEAD; a++) {
                    const int t = pgroup + PGROUPS * (s0 + a), at = start + min(t, n - 1);
                    const float* kp = at == fresh ? k_fresh : K + (long long)(at % ri.slots) * kv_dim;
#pragma unroll
                    for (int c = 0; c < KC; c++) {
                        const int i = 4 * in_group + 4 * ATTN_GROUP * c;
                        k4[a][c] = t < n && i < hd ? __ldg((const float4*)(kp + i)) : zero4;
                    }
                }
#pragma unroll
                for (int a = 0; a < AHEAD; a++) {
                    const int t = pgroup + PGROUPS * (s0 + a);
                    float d[G];
#pragma unroll
                    for (int j = 0; j < G; j++) d[j] = 0.0f;
                    const bool own = start + t == fresh;
#pragma unroll
                    for (int c = 0; c < KC; c++) {
                        const int i = 4 * in_group + 4 * ATTN_GROUP * c;
                        if (i < hd) {
                            const float4 k = own ? *(const float4*)(&k_new[i]) : k4[a][c];
#pragma unroll
                            for (int j = 0; j < G; j++)
                                if (j < g) d[j] += attn_dot4(*(const float4*)(&qs[j][i]), k);
                        }
                    }
                    const float dot = attn_group_sums<G>(d, in_group);
                    if (t < n && in_group < g) {
                        float s = dot * scale;
                        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                        weight[in_group][t] = s;
                    }
                }
            }
        } else {
            // Whole warps go round together (the groups' shuffles name every lane).
            for (int base = 0; base < n; base += pgroups) {
                const int t = base + pgroup;
                float d[G];
#pragma unroll
                for (int j = 0; j < G; j++) d[j] = 0.0f;
                if (t < n) {
                    const float* kp = start + t == fresh ? k_new : K + (long long)((start + t) % ri.slots) * kv_dim;
                    for (int i = in_group; i < hd; i += ATTN_GROUP) {
                        const float k = kp[i];
#pragma unroll
                        for (int j = 0; j < G; j++)
                            if (j < g) d[j] += qs[j][i] * k;
                    }
                }
                const float dot = attn_group_sums<G>(d, in_group);
                if (t < n && in_group < g) {
                    float s = dot * scale;
                    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                    weight[in_group][t] = s;
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < OWN; k++) {
            const int j = warp + k * ATTN_WARPS;
            if (j < g) {
                float tile_max = -INFINITY;
                for (int t = lane; t < n; t += WARP) tile_max = fmaxf(tile_max, weight[j][t]);
                const float new_max = fmaxf(mx[k], warp_max(tile_max));
                float tile_sum = 0.0f;
                for (int t = lane; t < n; t += WARP) {
                    const float e = expf(weight[j][t] - new_max);
                    weight[j][t] = e;
                    tile_sum += e;
                }
                const float corr = expf(mx[k] - new_max);
                sum[k] = sum[k] * corr + warp_sum(tile_sum);
                mx[k] = new_max;
                if (lane == 0) head_corr[j] = corr;
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < G; j++) {
            const float corr = j < g ? head_corr[j] : 0.0f;
#pragma unroll
            for (int u = 0; u < MAX_HEAD_DIM / 128; u++) acc[j][u] = attn_scaled(acc[j][u], corr);
        }
        if (vec_v) {
            // Warp w adds positions w, w + ATTN_WARPS, ... of the tile, four elements a lane a
            // load, the loads of VAHEAD positions in flight together.
            constexpr int VU = MAX_HEAD_DIM / 128;
            constexpr int VPER = (ATTN_TILE + ATTN_WARPS - 1) / ATTN_WARPS;
            constexpr int VAHEAD = VU >= 8 ? 1 : (VPER < 8 / VU ? VPER : 8 / VU);
#pragma unroll
            for (int s0 = 0; s0 < VPER; s0 += VAHEAD) {
                float4 v4[VAHEAD][VU];
#pragma unroll
                for (int a = 0; a < VAHEAD; a++) {
                    const int t = warp + ATTN_WARPS * (s0 + a), at = start + min(t, n - 1);
                    const float* vp = at == fresh ? v_fresh : V + (long long)(at % ri.slots) * v_dim;
#pragma unroll
                    for (int u = 0; u < VU; u++) {
                        const int i = 128 * u + 4 * lane;
                        v4[a][u] = t < n && i < hdv ? __ldg((const float4*)(vp + i)) : zero4;
                    }
                }
#pragma unroll
                for (int a = 0; a < VAHEAD; a++) {
                    const int t = warp + ATTN_WARPS * (s0 + a);
                    if (t >= n) break;
#pragma unroll
                    for (int j = 0; j < G; j++) {
                        const float e = j < g ? weight[j][t] : 0.0f;
#pragma unroll
                        for (int u = 0; u < VU; u++) acc[j][u] = attn_fma4(e, v4[a][u], acc[j][u]);
                    }
                }
            }
        } else {
            for (int t = warp; t < n; t += ATTN_WARPS) {
                float e[G];
#pragma unroll
                for (int j = 0; j < G; j++) e[j] = j < g ? weight[j][t] : 0.0f;
                const float* vp = start + t == fresh ? v_new : V + (long long)((start + t) % ri.slots) * v_dim;
#pragma unroll
                for (int u = 0; u < MAX_HEAD_DIM / 128; u++) {
                    const int i = 128 * u + 4 * lane;
                    if (i < hdv) {
                        const float4 v4 = attn_load4(vp, i, hdv, false);
#pragma unroll
                        for (int j = 0; j < G; j++)
                            if (j < g) acc[j][u] = attn_fma4(e[j], v4, acc[j][u]);
                    }
                }
            }
        }
        // The next tile's scores overwrite the weights.
        __syncthreads();
    }

    // Each head's warps' sums added, ATTN_HEADS_AT_ONCE heads a round, then its output (one
    // run) or its part (several).
    __shared__ float head_max[G], head_sum[G];
#pragma unroll
    for (int k = 0; k < OWN; k++) {
        const int j = warp + k * ATTN_WARPS;
        if (j < g && lane == 0) head_max[j] = mx[k], head_sum[j] = sum[k];
    }
    const long long head0 = (long long)r * n_head + h0;
    constexpr int HB = ATTN_HEADS_AT_ONCE(MAX_HEAD_DIM);
#pragma unroll
    for (int j0 = 0; j0 < G; j0 += HB) {
        if (j0 >= g) break;
        const int hb = min(HB, g - j0);
        // The previous round's readers are done with wacc (and the maxima are visible).
        __syncthreads();
#pragma unroll
        for (int b = 0; b < HB && j0 + b < G; b++) {
            if (b >= hb) break;
#pragma unroll
            for (int u = 0; u < MAX_HEAD_DIM / 128; u++) {
                const int i = 128 * u + 4 * lane;
                const float4 x = acc[j0 + b][u];
                const float a[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                for (int c = 0; c < 4; c++)
                    if (i + c < hdv) wacc[b][warp][i + c] = a[c];
            }
        }
        __syncthreads();
        // Element f of the round: head j0 + f / hdv's dimension f % hdv. With oq, hdv is a
        // multiple of 32: whole warps take part in each 8-bit block.
        for (int f = threadIdx.x; f < hb * hdv; f += blockDim.x) {
            const int b = f / hdv, i = f - b * hdv, j = j0 + b;
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; w++) v += wacc[b][w][i];
            if (runs == 1) {
                // With a sink the denominator gains exp(sink); all taken relative to the larger max.
                const float sink = p.sinks ? p.sinks[h0 + j] : -INFINITY;
                const float top = fmaxf(head_max[j], sink);
                const float keep = expf(head_max[j] - top);
                const float denom = head_sum[j] * keep + (p.sinks ? expf(sink - top) : 0.0f);
                const long long o = (head0 + j) * hdv + i;
                v = v * keep / denom;
                p.out[o] = v;
                if (p.oq) ts_q8_store_warp(v, o, p.oq, p.ods);
            } else {
                float* part = p.partial + ((head0 + j) * n_split + split) * (2 + hdv);
                if (i == 0) {
                    part[0] = head_max[j];
                    part[1] = head_sum[j];
                }
                part[2 + i] = v;
            }
        }
    }
    if (runs == 1) return;
    // Parts written before the count; the last block to count reads them all.
    __threadfence();
    __syncthreads();
    __shared__ bool last_block;
    if (threadIdx.x == 0) last_block = atomicAdd(p.done + head0, 1u) == (unsigned)runs - 1;
    __syncthreads();
    if (!last_block) return;
    __threadfence();
    // Each run's max and sum read once, each run's weight exp(max - top) and each head's
    // denominator taken once by a thread of the head's (in the order of the runs), then every
    // element's sum over the runs. The block's heads' outputs are contiguous: g * hdv from
    // the first's.
    __shared__ float run_w[G][ATTN_MAX_RUNS], run_sum[G][ATTN_MAX_RUNS];
    __shared__ float denom_all[G];
    for (int i = threadIdx.x; i < g * runs; i += blockDim.x) {
        const int j = i / runs, s = i - j * runs;
        const float* part = p.partial + ((head0 + j) * n_split + s) * (2 + hdv);
        run_w[j][s] = __ldcg(part);
        run_sum[j][s] = __ldcg(part + 1);
    }
    __syncthreads();
    if (threadIdx.x < g) {
        const int j = threadIdx.x;
        const float sink = p.sinks ? p.sinks[h0 + j] : -INFINITY;
        float top = sink;
        for (int s = 0; s < runs; s++) top = fmaxf(top, run_w[j][s]);
        float denom = p.sinks ? expf(sink - top) : 0.0f;
        for (int s = 0; s < runs; s++) {
            const float m_s = run_w[j][s];
            run_w[j][s] = m_s > -INFINITY ? expf(m_s - top) : 0.0f;
            denom += run_sum[j][s] * run_w[j][s];
        }
        denom_all[j] = denom;
    }
    __syncthreads();
    const long long o0 = head0 * hdv;
    // Each thread sums up to ATTN_COMBINE elements at once over eight runs at a time (their
    // loads in flight together).
    // With oq, g * hdv is a multiple of 32: whole warps take part in each 8-bit block.
    for (int f0 = threadIdx.x; f0 < g * hdv; f0 += ATTN_COMBINE * blockDim.x) {
        float v[ATTN_COMBINE];
        const float* parts[ATTN_COMBINE];
        float* w[ATTN_COMBINE];
        bool live[ATTN_COMBINE];
#pragma unroll
        for (int k = 0; k < ATTN_COMBINE; k++) {
            const int f = f0 + k * blockDim.x, j = min(f, g * hdv - 1) / hdv;
            live[k] = f < g * hdv;
            parts[k] = p.partial + (head0 + j) * n_split * (2 + hdv) + 2 + (f - j * hdv);
            w[k] = run_w[j];
            v[k] = 0.0f;
        }
#pragma unroll 8
        for (int s = 0; s < runs; s++)
#pragma unroll
            for (int k = 0; k < ATTN_COMBINE; k++)
                if (live[k]) v[k] += __ldcg(parts[k] + s * (2 + hdv)) * w[k][s];
#pragma unroll
        for (int k = 0; k < ATTN_COMBINE; k++) {
            const int f = f0 + k * blockDim.x;
            if (f < g * hdv) {
                const float x = v[k] / denom_all[f / hdv];
                p.out[o0 + f] = x;
                if (p.oq) ts_q8_store_warp(x, o0 + f, p.oq, p.ods);
            }
        }
    }
    if (threadIdx.x == 0) p.done[head0] = 0;
}

// Where a decode attention block's row looks: the first position it sees (its window's start),
// the tiles from there to its own position, and the query heads a block takes (`G` at most).
struct AttnRow {
    int seen_first, tiles, per_block;
};

template <int G>
__device__ __forceinline__ AttnRow attn_row(const DecodeAttn& p, const RowKv& ri) {
    const int seen_first = p.window > 0 ? max(0, (int)ri.pos + 1 - p.window) : 0;
    const int per_block = (int)ri.pos - seen_first + 1 >= p.group_from ? min(G, p.heads_per_block) : 1;
    return AttnRow{seen_first, ((int)ri.pos - seen_first) / ATTN_TILE + 1, per_block};
}

// Block blockIdx.x's heads: query head blockIdx.x alone (attention_heads<.., 1>: no work for
// heads it does not have) while its row sees fewer than group_from positions, else with up to
// heads_per_block - 1 after it in its KV head's group (at most G) where it is the first of
// them, and none where it is not.
template <int MAX_HEAD_DIM, int G>
__device__ __forceinline__ void attention_blocks(const DecodeAttn& p) {
    __shared__ float wacc[ATTN_HEADS_AT_ONCE(MAX_HEAD_DIM)][ATTN_WARPS][MAX_HEAD_DIM];
    const RowKv ri = p.info[blockIdx.y];
    const AttnRow a = attn_row<G>(p, ri);
    const int seen_first = a.seen_first, tiles = a.tiles, per_block = a.per_block;
    const int group = p.n_head / p.n_head_kv, h0 = blockIdx.x, kvh = h0 / group, in_kv = h0 % group;
    // A block without work (none of the heads, or a run past the row's last tile: a short row in
    // a long cache; the runs are attention_heads') leaves before waiting for the kernel before
    // it, so that it holds no SM's room while that one runs: qwen3-30b-a3b tg128 in a cache of
    // 4,096 positions 381-384 tok/s against 367-369 (H100). Before the wait it reads only the
    // rows' RowKv, which the host copied before the step's first kernel (launch.cuh).
    const int n_split = min((int)gridDim.z, ATTN_MAX_RUNS);
    if ((int)blockIdx.z * ((tiles + n_split - 1) / n_split) >= tiles || (G > 1 && per_block > 1 && in_kv % per_block != 0))
        return;
    ts_grid_begin();
    if (G == 1 || per_block == 1) {
        attention_heads<MAX_HEAD_DIM, 1>(p, ri, seen_first, tiles, h0, 1, kvh, in_kv, wacc);
    } else if constexpr (G > 1) {
        attention_heads<MAX_HEAD_DIM, G>(p, ri, seen_first, tiles, h0, min(per_block, group - in_kv), kvh, in_kv,
                                         wacc);
    }
}

// Heads of up to 128 (most models), up to 8 query heads a block.
extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS) attention(const DecodeAttn p) {
    attention_blocks<128, 8>(p);
}

// Heads of up to 256, up to 4 query heads a block.
extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS) attention_256(const DecodeAttn p) {
    attention_blocks<256, 4>(p);
}

// Heads of up to 512 (gemma4's global layers), one query head a block.
extern "C" __global__ void __launch_bounds__(32 * ATTN_WARPS) attention_wide(const DecodeAttn p) {
    attention_blocks<512, 1>(p);
}

// Attention for a prompt: rows of one sequence, heads and values of at most 128. A block takes
// 32 queries of one KV head (query j: flat index 32 * blockIdx.x + j over (row, head in the
// group), rows m, n_head / n_head_kv heads per group; blockIdx.y the KV head) and walks the
// positions they see 16 at a time, each tile of keys and values read once into shared memory
// for all 32 (the per-row kernel above reads them once per query). A warp owns 8 queries; the
// two half-warps split the scores' dot products (even and odd elements), lane % 16 the
// position, and each key or value element read from shared memory serves the 8 queries.
// Same arguments as `attention` plus m; grid (ceil(m * group / 32), n_head_kv), block 128.
#define PROMPT_TILE 16
#define PROMPT_QUERIES 32
#define PROMPT_MAX_HEAD 128

extern "C" __global__ void __launch_bounds__(128)
    attention_prompt(const float* q, float* out, const RowKv* info, int m, int n_head, int n_head_kv, int hd,
                     int hdv, float scale, float softcap, const float* sinks, int window) {
    ts_grid_begin();
    const int group = n_head / n_head_kv, kvh = blockIdx.y;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, pl = lane & 15, half = lane >> 4;
    const int n_flat = m * group, flat0 = blockIdx.x * PROMPT_QUERIES;
    const int kv_dim = n_head_kv * hd, v_dim = n_head_kv * hdv;
    __shared__ float qs[PROMPT_QUERIES][PROMPT_MAX_HEAD];
    // Row stride hd + 2: the 32 lanes' (position, parity) pairs fall in distinct banks.
    __shared__ float ks[PROMPT_TILE][PROMPT_MAX_HEAD + 2];
    __shared__ float vs[PROMPT_TILE][PROMPT_MAX_HEAD];
    __shared__ float ps[4][8][PROMPT_TILE];
    __shared__ int range[2];

    for (int i = threadIdx.x; i < PROMPT_QUERIES * hd; i += blockDim.x) {
        const int j = i / hd, e = i - j * hd, flat = flat0 + j;
        const int row = flat / group, h = kvh * group + flat % group;
        qs[j][e] = flat < n_flat ? q[((long long)row * n_head + h) * hd + e] : 0.0f;
    }
    if (threadIdx.x == 0) {
        int lo = 0x7fffffff, hi = -1;
        for (int row = flat0 / group; row <= (min(flat0 + PROMPT_QUERIES, n_flat) - 1) / group; row++) {
            const int pos = info[row].pos;
            lo = min(lo, window > 0 ? max(0, pos + 1 - window) : 0);
            hi = max(hi, pos);
        }
        range[0] = lo, range[1] = hi;
    }
    __syncthreads();
    const RowKv seq = info[0];
    const float* K = (const float*)seq.k + kvh * hd;
    const float* V = (const float*)seq.v + kvh * hdv;

    // This warp's queries: position, first position seen, running max, sum and output.
    int qpos[8], qfirst[8];
    float mx[8], sum[8], acc[8][PROMPT_MAX_HEAD / WARP];
#pragma unroll
    for (int qq = 0; qq < 8; qq++) {
        const int flat = flat0 + warp * 8 + qq;
        const int pos = flat < n_flat ? info[flat / group].pos : -1;
        qpos[qq] = pos;
        qfirst[qq] = window > 0 ? max(0, pos + 1 - window) : 0;
        mx[qq] = -INFINITY, sum[qq] = 0.0f;
#pragma unroll
        for (int j = 0; j < PROMPT_MAX_HEAD / WARP; j++) acc[qq][j] = 0.0f;
    }

    for (int p0 = range[0]; p0 <= range[1]; p0 += PROMPT_TILE) {
        __syncthreads();
        for (int i = threadIdx.x; i < PROMPT_TILE * hd; i += blockDim.x) {
            const int l = i / hd, e = i - l * hd, p = p0 + l;
            ks[l][e] = p <= range[1] ? K[(long long)(p % seq.slots) * kv_dim + e] : 0.0f;
        }
        for (int i = threadIdx.x; i < PROMPT_TILE * hdv; i += blockDim.x) {
            const int l = i / hdv, e = i - l * hdv, p = p0 + l;
            vs[l][e] = p <= range[1] ? V[(long long)(p % seq.slots) * v_dim + e] : 0.0f;
        }
        __syncthreads();
        // Scores of the warp's 8 queries at position p0 + pl, each key element read once for all 8.
        float d[8];
#pragma unroll
        for (int qq = 0; qq < 8; qq++) d[qq] = 0.0f;
#pragma unroll 4
        for (int e = half; e < hd; e += 2) {
            const float kv = ks[pl][e];
#pragma unroll
            for (int qq = 0; qq < 8; qq++) d[qq] += qs[warp * 8 + qq][e] * kv;
        }
        const int p = p0 + pl;
#pragma unroll
        for (int qq = 0; qq < 8; qq++) {
            float s = (d[qq] + __shfl_xor_sync(0xffffffffu, d[qq], 16)) * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            const bool seen = p >= qfirst[qq] && p <= qpos[qq];
            float tmax = seen ? s : -INFINITY;
            for (int off = 8; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            const float nm = fmaxf(mx[qq], tmax);
            // nm is -inf only while the query has seen no position (then nothing is seen here either).
            const float corr = nm == -INFINITY ? 1.0f : expf(mx[qq] - nm), e = seen ? expf(s - nm) : 0.0f;
            float es = e;
            for (int off = 8; off > 0; off >>= 1) es += __shfl_xor_sync(0xffffffffu, es, off);
            sum[qq] = sum[qq] * corr + es;
            mx[qq] = nm;
            if (half == 0) ps[warp][qq][pl] = e;
#pragma unroll
            for (int j = 0; j < PROMPT_MAX_HEAD / WARP; j++) acc[qq][j] *= corr;
        }
        __syncwarp();
        // Values: each row of the tile read once for all 8 queries.
        for (int l = 0; l < PROMPT_TILE; l++) {
            float v[PROMPT_MAX_HEAD / WARP];
#pragma unroll
            for (int j = 0; j < PROMPT_MAX_HEAD / WARP; j++) v[j] = lane + j * WARP < hdv ? vs[l][lane + j * WARP] : 0.0f;
#pragma unroll
            for (int qq = 0; qq < 8; qq++) {
                const float w = ps[warp][qq][l];
#pragma unroll
                for (int j = 0; j < PROMPT_MAX_HEAD / WARP; j++) acc[qq][j] += w * v[j];
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int qq = 0; qq < 8; qq++) {
        const int flat = flat0 + warp * 8 + qq;
        if (flat >= n_flat) continue;
        const int row = flat / group, h = kvh * group + flat % group;
        const float top = sinks ? fmaxf(sinks[h], mx[qq]) : mx[qq];
        const float keep = expf(mx[qq] - top);
        const float denom = sum[qq] * keep + (sinks ? expf(sinks[h] - top) : 0.0f);
        float* o = out + ((long long)row * n_head + h) * hdv;
#pragma unroll
        for (int j = 0; j < PROMPT_MAX_HEAD / WARP; j++)
            if (lane + j * WARP < hdv) o[lane + j * WARP] = acc[qq][j] * keep / denom;
    }
}

// ---- Prompt attention on the f16 tensor cores ----
//
// attention_prompt_mma_<HD>(PromptAttn): as attention_prompt, for heads of HD (64 or 128, keys
// and values alike), with Q.K and P.V as mma.m16n8k16 (f16 inputs, f32 sums): a block takes
// 64 query rows (flat: row * group + head within the KV head's group) of one KV head, a warp
// 16 of them; keys and values come in tiles of 64 positions, converted to f16 in shared memory
// (values transposed, so each lane's B fragment is one 32-bit load). Online softmax in f32 per
// query row over the tiles, as in FlashAttention-2 (Dao, 2023): the score accumulators' layout
// is the A fragment of the P.V product, so P never leaves registers.
// Fragment layouts (PTX ISA, mma.m16n8k16 .f16): lane = 4g + s; A a0 (row g, k 2s..2s+1),
// a1 (row g + 8), a2 (row g, k 2s + 8..), a3 (row g + 8, k 2s + 8..); B b0 (k 2s..2s+1, col g),
// b1 (k 2s + 8.., col g); C c0 c1 (row g, cols 2s, 2s + 1), c2 c3 (row g + 8).

#define FA_ROWS 64
#define FA_KEYS 64
#define FA_THREADS 128  // the launch's block

// attention_prompt_mma's parameters (crates/ts-cuda/src/attention.rs mirrors them).
struct PromptAttn {
    const float* q;  // [m][n_head * hd]
    float* out;  // [m][n_head * hd]
    const RowKv* info;  // [m], one sequence
    const float* sinks;  // [n_head] or null
    int m, n_head, n_head_kv, hd;
    float scale, softcap;
    int window;  // 0: none
};

// Two floats as f16x2 (lo in the low half).
__device__ __forceinline__ ts_u32 ts_half2(float lo, float hi) {
    ts_u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void ts_mma_f16(float (&c)[4], ts_u32 a0, ts_u32 a1, ts_u32 a2, ts_u32 a3, ts_u32 b0,
                                           ts_u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int HD>
__device__ __forceinline__ void ts_attention_prompt_mma(const PromptAttn& p) {
    // Row strides padded by 8 halves: the lanes' 32-bit fragment loads fall in distinct banks.
    __shared__ __align__(16) ts_u32 ks[FA_KEYS][(HD + 8) / 2];  // keys: [position][element pair]
    __shared__ ts_u32 vt[HD][(FA_KEYS + 8) / 2];  // values transposed: [element][position pair]
    __shared__ int range[2];
    const int group = p.n_head / p.n_head_kv, kvh = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, s = lane & 3;
    const int n_flat = p.m * group, flat0 = blockIdx.x * FA_ROWS;
    const int kv_dim = p.n_head_kv * HD;
    if (threadIdx.x == 0) {
        int lo = 0x7fffffff, hi = -1;
        for (int row = flat0 / group; row <= (min(flat0 + FA_ROWS, n_flat) - 1) / group; row++) {
            const int pos = p.info[row].pos;
            lo = min(lo, p.window > 0 ? max(0, pos + 1 - p.window) : 0);
            hi = max(hi, pos);
        }
        range[0] = lo, range[1] = hi;
    }
    // This lane's two query rows (h = 0: g, h = 1: g + 8 of the warp's 16): position, first
    // position seen (-1 and 0 past the last row), and their q as A fragments.
    int qpos[2], qfirst[2];
    ts_u32 qa[HD / 16][4];
    TS_UNROLL
    for (int h = 0; h < 2; h++) {
        const int flat = flat0 + warp * 16 + g + 8 * h;
        const bool live = flat < n_flat;
        const int row = live ? flat / group : 0, head = kvh * group + (live ? flat % group : 0);
        qpos[h] = live ? p.info[row].pos : -1;
        qfirst[h] = p.window > 0 ? max(0, qpos[h] + 1 - p.window) : 0;
        const float* qr = p.q + ((long long)row * p.n_head + head) * HD;
        TS_UNROLL
        for (int kb = 0; kb < HD / 16; kb++) {
            const float2 lo = live ? *reinterpret_cast<const float2*>(qr + 16 * kb + 2 * s) : make_float2(0.0f, 0.0f);
            const float2 hi = live ? *reinterpret_cast<const float2*>(qr + 16 * kb + 8 + 2 * s) : make_float2(0.0f, 0.0f);
            qa[kb][h] = ts_half2(lo.x, lo.y);
            qa[kb][2 + h] = ts_half2(hi.x, hi.y);
        }
    }
    // The warp's span of positions: tiles outside it are skipped (the block's loads go on).
    int wlo = min(qpos[0] < 0 ? 0x7fffffff : qfirst[0], qpos[1] < 0 ? 0x7fffffff : qfirst[1]);
    int whi = max(qpos[0], qpos[1]);
    for (int off = 16; off > 0; off >>= 1) {
        wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, off));
        whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, off));
    }
    float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.0f, 0.0f};
    float o[HD / 8][4];
    TS_UNROLL
    for (int db = 0; db < HD / 8; db++) o[db][0] = o[db][1] = o[db][2] = o[db][3] = 0.0f;
    __syncthreads();
    const RowKv seq = p.info[0];
    const float* K = (const float*)seq.k + kvh * HD;
    const float* V = (const float*)seq.v + kvh * HD;
    for (int p0 = range[0]; p0 <= range[1]; p0 += FA_KEYS) {
        // The tile's slots: one modulo a tile (a ring wraps at most once within a tile).
        const int base = p0 % seq.slots;
        const auto slot = [&](int l) {
            if (seq.slots < FA_KEYS) return (p0 + l) % seq.slots;
            return base + l >= seq.slots ? base + l - seq.slots : base + l;
        };
        // Every load of a tile's keys in flight before any is converted, then its values'
        // (issued one after another, each load waited on alone, they made the kernel 1.27 ms
        // a layer at 2,048 positions of qwen3-30b-a3b on the H200).
        // Keys: four elements a thread, a warp's lanes along one position's row.
        constexpr int K_LOADS = FA_KEYS * HD / 4 / FA_THREADS;
        float4 kr[K_LOADS];
        TS_UNROLL
        for (int it = 0; it < K_LOADS; it++) {
            const int i = it * FA_THREADS + threadIdx.x, l = i / (HD / 4), e = 4 * (i % (HD / 4));
            kr[it] = p0 + l <= range[1] ? __ldg(reinterpret_cast<const float4*>(K + (long long)slot(l) * kv_dim + e))
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        __syncthreads();  // the previous tile is no longer read
        TS_UNROLL
        for (int it = 0; it < K_LOADS; it++) {
            const int i = it * FA_THREADS + threadIdx.x, l = i / (HD / 4), e = 4 * (i % (HD / 4));
            *reinterpret_cast<uint2*>(&ks[l][e / 2]) =
                make_uint2(ts_half2(kr[it].x, kr[it].y), ts_half2(kr[it].z, kr[it].w));
        }
        // Values: a thread takes positions 2pp and 2pp + 1 at elements 4eq .. 4eq + 3; a warp's
        // lanes cover 16 position pairs by 2 element quads, so that its transposed stores
        // fall in distinct banks (word 36 * e + pp: bank 16 * (eq & 1) + pp + 4 * (e & 3)).
        constexpr int V_LOADS = FA_KEYS / 2 * HD / 4 / FA_THREADS;
        float4 vr[V_LOADS][2];
        TS_UNROLL
        for (int it = 0; it < V_LOADS; it++) {
            const int i = it * FA_THREADS + threadIdx.x, j = i >> 5, lane_i = i & 31;
            const int lp = 2 * ((j & 1) * 16 + (lane_i & 15)), e = 4 * ((j >> 1) * 2 + (lane_i >> 4));
            TS_UNROLL
            for (int t = 0; t < 2; t++)
                vr[it][t] = p0 + lp + t <= range[1]
                                ? __ldg(reinterpret_cast<const float4*>(V + (long long)slot(lp + t) * kv_dim + e))
                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        TS_UNROLL
        for (int it = 0; it < V_LOADS; it++) {
            const int i = it * FA_THREADS + threadIdx.x, j = i >> 5, lane_i = i & 31;
            const int lp = 2 * ((j & 1) * 16 + (lane_i & 15)), e = 4 * ((j >> 1) * 2 + (lane_i >> 4));
            const float4 v0 = vr[it][0], v1 = vr[it][1];
            vt[e][lp / 2] = ts_half2(v0.x, v1.x);
            vt[e + 1][lp / 2] = ts_half2(v0.y, v1.y);
            vt[e + 2][lp / 2] = ts_half2(v0.z, v1.z);
            vt[e + 3][lp / 2] = ts_half2(v0.w, v1.w);
        }
        __syncthreads();
        if (p0 > whi || p0 + FA_KEYS - 1 < wlo) continue;
        // Scores of the warp's 16 rows at the tile's 64 positions.
        float sc[FA_KEYS / 8][4];
        TS_UNROLL
        for (int nb = 0; nb < FA_KEYS / 8; nb++) {
            sc[nb][0] = sc[nb][1] = sc[nb][2] = sc[nb][3] = 0.0f;
            TS_UNROLL
            for (int kb = 0; kb < HD / 16; kb++)
                ts_mma_f16(sc[nb], qa[kb][0], qa[kb][1], qa[kb][2], qa[kb][3], ks[8 * nb + g][8 * kb + s],
                           ks[8 * nb + g][8 * kb + 4 + s]);
        }
        // Scale, cap, mask; the rows' new maxima over the quad's lanes.
        float tmax[2] = {-INFINITY, -INFINITY};
        TS_UNROLL
        for (int nb = 0; nb < FA_KEYS / 8; nb++)
            TS_UNROLL
            for (int i = 0; i < 4; i++) {
                const int h = i >> 1, pos = p0 + 8 * nb + 2 * s + (i & 1);
                float v = sc[nb][i] * p.scale;
                if (p.softcap > 0.0f) v = p.softcap * tanhf(v / p.softcap);
                v = pos >= qfirst[h] && pos <= qpos[h] ? v : -INFINITY;
                sc[nb][i] = v;
                tmax[h] = fmaxf(tmax[h], v);
            }
        float corr[2];
        TS_UNROLL
        for (int h = 0; h < 2; h++) {
            tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
            tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
            const float nm = fmaxf(mx[h], tmax[h]);
            // nm is -inf only while the row has seen no position (then nothing here either).
            corr[h] = nm == -INFINITY ? 1.0f : expf(mx[h] - nm);
            mx[h] = nm;
            sum[h] *= corr[h];
        }
        TS_UNROLL
        for (int nb = 0; nb < FA_KEYS / 8; nb++)
            TS_UNROLL
            for (int i = 0; i < 4; i++) {
                const int h = i >> 1;
                const float e = sc[nb][i] == -INFINITY ? 0.0f : expf(sc[nb][i] - mx[h]);
                sc[nb][i] = e;
                sum[h] += e;
            }
        TS_UNROLL
        for (int db = 0; db < HD / 8; db++) {
            o[db][0] *= corr[0], o[db][1] *= corr[0];
            o[db][2] *= corr[1], o[db][3] *= corr[1];
        }
        // O += P V: positions 16kk.. are score blocks 2kk and 2kk + 1.
        TS_UNROLL
        for (int kk = 0; kk < FA_KEYS / 16; kk++) {
            const ts_u32 a0 = ts_half2(sc[2 * kk][0], sc[2 * kk][1]), a1 = ts_half2(sc[2 * kk][2], sc[2 * kk][3]);
            const ts_u32 a2 = ts_half2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            const ts_u32 a3 = ts_half2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
            TS_UNROLL
            for (int db = 0; db < HD / 8; db++)
                ts_mma_f16(o[db], a0, a1, a2, a3, vt[8 * db + g][8 * kk + s], vt[8 * db + g][8 * kk + 4 + s]);
        }
    }
    TS_UNROLL
    for (int h = 0; h < 2; h++) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        const int flat = flat0 + warp * 16 + g + 8 * h;
        if (flat >= n_flat) continue;
        const int row = flat / group, head = kvh * group + flat % group;
        const float top = p.sinks ? fmaxf(p.sinks[head], mx[h]) : mx[h];
        const float keep = expf(mx[h] - top);
        const float scale = keep / (sum[h] * keep + (p.sinks ? expf(p.sinks[head] - top) : 0.0f));
        float* out = p.out + ((long long)row * p.n_head + head) * HD;
        TS_UNROLL
        for (int db = 0; db < HD / 8; db++)
            *reinterpret_cast<float2*>(out + 8 * db + 2 * s) = make_float2(o[db][2 * h] * scale, o[db][2 * h + 1] * scale);
    }
}

// Blocks an SM the 64-wide kernel's registers are fitted to (a measurement knob: 4 keeps the
// occupancy it had before its tile loads were batched, spilling 16 bytes; 2 lets them be 162).
#ifndef FA_MIN_BLOCKS_64
#define FA_MIN_BLOCKS_64 4
#endif
extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS_64) attention_prompt_mma_64(const PromptAttn p) {
    ts_grid_begin();
    ts_attention_prompt_mma<64>(p);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS) attention_prompt_mma_128(const PromptAttn p) {
    ts_grid_begin();
    ts_attention_prompt_mma<128>(p);
}
