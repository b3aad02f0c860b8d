// Element-wise and row-wise f32 kernels of the forward pass: norms, bias,
// activations, rotary embeddings, KV-cache stores, attention, MoE routing.
// Each mirrors an op of ts-cpu's ops.rs (the reference it is tested against).
// Matrices are row-major [rows][width].

#define WARP 32
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int n = blockDim.x / WARP;
    v = threadIdx.x < n ? part[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
    __syncthreads();
    float r = part[0];
    __syncthreads();
    return r;
}

// out[p] = x[p] / rms(x[p]) * w for each piece p of `width` (grid.x = pieces).
// w may be null (scale 1). out may alias x. Each thread keeps its first
// RMS_HELD elements in registers between the two passes (all of them when
// blockDim.x >= width / RMS_HELD), so the second pass does not read x again.
#define RMS_HELD 4
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int width, float eps) {
    const float* xp = x + (long long)blockIdx.x * width;
    float* op = out + (long long)blockIdx.x * width;
    float held[RMS_HELD];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RMS_HELD; j++) {
        int i = threadIdx.x + j * blockDim.x;
        held[j] = i < width ? xp[i] : 0.0f;
        ss += held[j] * held[j];
    }
    for (int i = threadIdx.x + RMS_HELD * blockDim.x; i < width; i += blockDim.x) ss += xp[i] * xp[i];
    ss = block_sum(ss);
    float scale = rsqrtf(ss / width + eps);
#pragma unroll
    for (int j = 0; j < RMS_HELD; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i < width) op[i] = held[j] * scale * (w ? w[i] : 1.0f);
    }
    for (int i = threadIdx.x + RMS_HELD * blockDim.x; i < width; i += blockDim.x) op[i] = xp[i] * scale * (w ? w[i] : 1.0f);
}

// x[i] += y[i]
extern "C" __global__ void add(float* x, const float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// x[r][i] += bias[i] for rows of `width`.
extern "C" __global__ void add_bias(float* x, const float* bias, int width, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += bias[i % width];
}

// x[s][i] += bias[ids[s]][i]: per-expert biases of MoE slots s, those with
// mask[s] >= 0 (all when mask is null).
extern "C" __global__ void add_bias_indexed(float* x, const float* bias, const int* ids, const int* mask, int width,
                                            long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        if (!mask || mask[i / width] >= 0) x[i] += bias[(long long)ids[i / width] * width + i % width];
}

extern "C" __global__ void scale(float* x, float s, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= s;
}

extern "C" __global__ void softcap(float* x, float c, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = c * tanhf(x[i] / c);
}

// gate = act(gate, up) (activation.cuh's kinds).
extern "C" __global__ void gated(float* gate, const float* up, long long n, int kind, float alpha, float limit) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        gate[i] = ts_gated(kind, gate[i], up[i], alpha, limit);
}

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

// out[j] = x[rows[j]] for rows of `width`. grid.x = n rows.
extern "C" __global__ void gather_rows(const float* x, const int* rows, float* out, int width) {
    const float* src = x + (long long)rows[blockIdx.x] * width;
    float* dst = out + (long long)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// out[r] = sum_j w[r*k + j] * y[r*k + j] for rows of `width`: a token's k expert outputs.
// grid = (any, m): blocks of a row share its width.
// pair (r, j)'s row of y is index[r*k + j] (its place among the pairs grouped by
// expert), or r*k + j when index is null.
extern "C" __global__ void moe_combine(const float* y, const float* w, const int* index, float* out, int k,
                                       int width) {
    const int r = blockIdx.y;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            long long row = index ? index[r * k + j] : (long long)r * k + j;
            acc += w[r * k + j] * y[row * width + i];
        }
        out[(long long)r * width + i] = acc;
    }
}

#define MAX_EXPERTS 1024

// Routes each row from its router logits [m][n_expert]: gating 0 = softmax then
// top-k, 1 = top-k then softmax over the k; renormalize divides the k weights by
// their sum (floored like llama.cpp); then each weight times its expert's
// scale [n_expert] where scale is not null (Gemma 4). Ties keep the lower
// index. grid.x = m, one warp.
extern "C" __global__ void route(const float* logits, int n_expert, int k, int gating, int renormalize,
                                 const float* scale, int* ids, float* weights) {
    __shared__ float v[MAX_EXPERTS];
    __shared__ float sel_w[64];
    int lane = threadIdx.x;
    const float* l = logits + (long long)blockIdx.x * n_expert;
    float mx = -INFINITY;
    for (int i = lane; i < n_expert; i += WARP) {
        v[i] = l[i];
        mx = fmaxf(mx, l[i]);
    }
    mx = warp_max(mx);
    if (gating == 0) {
        float s = 0.0f;
        for (int i = lane; i < n_expert; i += WARP) {
            v[i] = expf(v[i] - mx);
            s += v[i];
        }
        s = warp_sum(s);
        for (int i = lane; i < n_expert; i += WARP) v[i] /= s;
    }
    __syncwarp();
    for (int j = 0; j < k; j++) {
        float best = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = lane; i < n_expert; i += WARP) {
            if (v[i] > best || (v[i] == best && i < bi)) {
                best = v[i];
                bi = i;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        if (lane == 0) {
            ids[blockIdx.x * k + j] = bi;
            sel_w[j] = best;
            v[bi] = -INFINITY;
        }
        __syncwarp();
    }
    if (lane == 0) {
        if (gating == 1) {
            float m0 = sel_w[0], s = 0.0f;
            for (int j = 0; j < k; j++) {
                sel_w[j] = expf(sel_w[j] - m0);
                s += sel_w[j];
            }
            for (int j = 0; j < k; j++) sel_w[j] /= s;
        }
        if (renormalize) {
            float s = 0.0f;
            for (int j = 0; j < k; j++) s += sel_w[j];
            s = fmaxf(s, 6.103515625e-5f);
            for (int j = 0; j < k; j++) sel_w[j] /= s;
        }
        for (int j = 0; j < k; j++) {
            float w = sel_w[j];
            if (scale) w *= scale[ids[blockIdx.x * k + j]];
            weights[blockIdx.x * k + j] = w;
        }
    }
}

// x[r] *= sigmoid(dot(gate_inp, inp[r])) for rows of `width` (sigmoid-gated shared expert). grid.x = m.
extern "C" __global__ void sigmoid_gate_rows(float* x, const float* inp, const float* gate_inp, int width) {
    const float* ir = inp + (long long)blockIdx.x * width;
    float d = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d += gate_inp[i] * ir[i];
    d = block_sum(d);
    float g = sigmoidf(d);
    float* xr = x + (long long)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) xr[i] *= g;
}

// IEEE half bits of x, rounded to nearest even.
extern "C" __global__ void f32_to_f16(const float* x, unsigned short* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
        out[i] = h;
    }
}

extern "C" __global__ void fill(float* x, float v, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = v;
}

// Columns start..start+n of each width-wide row of x: into out [rows][n].
// grid.x = rows, block 128.
extern "C" __global__ void columns(const float* x, float* out, int width, int start, int n) {
    long long r = blockIdx.x;
    const float* src = x + r * width + start;
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[r * n + i] = src[i];
}

// x[i] *= sigmoid(gate[i])
extern "C" __global__ void mul_sigmoid(float* x, const float* gate, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
