// Attention kernels: rotary embeddings, the KV-cache stores and attention itself.
// Each mirrors an op of ts-cpu's ops.rs. Uses ops.cu's helpers (ops.cu comes first in the one compiled source).

// Rotary embedding of every head of `x` [m][n_heads * head_dim] in place.
// pos[m]; inv_freq[n_rot/2]; interleaved pairs (2i, 2i+1) or halves (i, i + n_rot/2).
// grid.x = m * n_heads, block.x >= n_rot / 2 (looped).
extern "C" __global__ void rope(float* x, const int* pos, const float* inv_freq, int n_heads, int head_dim,
                                int n_rot, int interleaved, float mscale) {
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
    RowKv ri = info[blockIdx.x];
    int slot = ri.pos % ri.slots;
    float* kd = (float*)ri.k + (long long)slot * kv_dim;
    float* vd = (float*)ri.v + (long long)slot * v_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) kd[i] = k[(long long)blockIdx.x * kv_dim + i];
    for (int i = threadIdx.x; i < v_dim; i += blockDim.x) vd[i] = v[(long long)blockIdx.x * v_dim + i];
}

#define ATTN_WARPS 4

// One query head of one row over the positions it sees (its window, or all
// up to its position), online softmax per warp, warps combined at the end.
// q [m][n_head*hd], out [m][n_head*hdv]; grid = (n_head, m), block = 32*ATTN_WARPS.
// sinks [n_head] or null: an extra logit in the denominator only. Heads of up
// to MAX_HEAD_DIM (`attention`: 256; `attention_wide`: 512, gemma4's global layers).
template <int MAX_HEAD_DIM>
__device__ __forceinline__ void attention_head(const float* q, float* out, const RowKv* info, int n_head,
                                               int n_head_kv, int hd, int hdv, float scale, float softcap,
                                               const float* sinks, int window) {
    int h = blockIdx.x, r = blockIdx.y;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    RowKv ri = info[r];
    int kvh = h / (n_head / n_head_kv);
    int kv_dim = n_head_kv * hd, v_dim = n_head_kv * hdv;
    const float* qh = q + (long long)r * n_head * hd + h * hd;
    const float* K = (const float*)ri.k + kvh * hd;
    const float* V = (const float*)ri.v + kvh * hdv;

    __shared__ float qs[MAX_HEAD_DIM];
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = qh[i];
    __syncthreads();

    int first = window > 0 ? max(0, ri.pos + 1 - window) : 0;
    float mx = -INFINITY, sum = 0.0f;
    float acc[MAX_HEAD_DIM / WARP];
#pragma unroll
    for (int j = 0; j < MAX_HEAD_DIM / WARP; j++) acc[j] = 0.0f;

    for (int p = first + warp; p <= ri.pos; p += ATTN_WARPS) {
        int slot = p % ri.slots;
        const float* kp = K + (long long)slot * kv_dim;
        float d = 0.0f;
        for (int i = lane; i < hd; i += WARP) d += qs[i] * kp[i];
        float s = warp_sum(d) * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        float nm = fmaxf(mx, s);
        float corr = expf(mx - nm), e = expf(s - nm);
        sum = sum * corr + e;
        const float* vp = V + (long long)slot * v_dim;
#pragma unroll
        for (int j = 0; j < MAX_HEAD_DIM / WARP; j++) {
            int i = lane + j * WARP;
            if (i < hdv) acc[j] = acc[j] * corr + e * vp[i];
        }
        mx = nm;
    }

    __shared__ float wmax[ATTN_WARPS], wsum[ATTN_WARPS];
    __shared__ float wacc[ATTN_WARPS][MAX_HEAD_DIM];
    if (lane == 0) {
        wmax[warp] = mx;
        wsum[warp] = sum;
    }
#pragma unroll
    for (int j = 0; j < MAX_HEAD_DIM / WARP; j++) {
        int i = lane + j * WARP;
        if (i < hdv) wacc[warp][i] = acc[j];
    }
    __syncthreads();
    float M = sinks ? sinks[h] : -INFINITY;
    for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, wmax[w]);
    float denom = sinks ? expf(sinks[h] - M) : 0.0f;
    for (int w = 0; w < ATTN_WARPS; w++)
        if (wmax[w] > -INFINITY) denom += wsum[w] * expf(wmax[w] - M);
    float* o = out + (long long)r * n_head * hdv + h * hdv;
    for (int i = threadIdx.x; i < hdv; i += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (wmax[w] > -INFINITY) v += wacc[w][i] * expf(wmax[w] - M);
        o[i] = v / denom;
    }
}

extern "C" __global__ void attention(const float* q, float* out, const RowKv* info, int n_head, int n_head_kv, int hd,
                                     int hdv, float scale, float softcap, const float* sinks, int window) {
    attention_head<256>(q, out, info, n_head, n_head_kv, hd, hdv, scale, softcap, sinks, window);
}

extern "C" __global__ void attention_wide(const float* q, float* out, const RowKv* info, int n_head, int n_head_kv,
                                          int hd, int hdv, float scale, float softcap, const float* sinks,
                                          int window) {
    attention_head<512>(q, out, info, n_head, n_head_kv, hd, hdv, scale, softcap, sinks, window);
}
