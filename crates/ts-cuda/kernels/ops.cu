// Element-wise and row-wise f32 kernels of the forward pass: norms, bias,
// activations, copies; the helpers the other kernel files use (warp and block sums).
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

// rms_norm's parameters (crates/ts-cuda/src/lib.rs's NormRows mirrors them).
struct RmsNorm {
    float* x;  // [pieces][width]
    const float* y;  // [pieces][width]; with pair_w the routed experts' rows [pieces * k][width]; null: no add
    const float* w;  // [width] or null (scale 1)
    float* out;  // [pieces][width]; may alias x without y
    signed char* q;  // [pieces][width] and ds [pieces][width / 32], or null: out's 8-bit copy
    float2* ds;
    const float* pair_w;  // [pieces][k]: the experts' weights, or null (y is rows)
    const int* pair_index;  // [pieces * k]: pair (r, j)'s row of y, or null (row r * k + j)
    int k, width;
    float eps;
};

// Element i of what is added to x in piece blockIdx.x: y's row (ADD 1), or the weighted sum of
// the piece's k expert rows of y in the order of j (ADD 2: moe_combine's floats).
template <int ADD>
__device__ __forceinline__ float ts_norm_y(const RmsNorm& p, int i) {
    const int r = blockIdx.x;
    if (ADD == 1) return p.y[(long long)r * p.width + i];
    float acc = 0.0f;
    for (int j = 0; j < p.k; j++) {
        const long long row = p.pair_index ? p.pair_index[r * p.k + j] : (long long)r * p.k + j;
        acc += p.pair_w[r * p.k + j] * p.y[row * p.width + i];
    }
    return acc;
}

// out[p] = x[p] / rms(x[p]) * w for each piece p of `width` (grid.x = pieces), after
// x[p] += y[p] when ADD (the residual add fused into the next norm: one kernel, and the
// same floats as `add` then `rms_norm`; ADD 2 also sums the routed experts' rows first, the
// floats of `moe_combine` then `add`); and, where q is not null (width a multiple of 32),
// out also quantized to 8 bits into q and ds, as quantize_q8_1 would. Each thread keeps its
// first RMS_HELD elements in registers between the two passes (all of them when
// blockDim.x >= width / RMS_HELD), so the second pass does not read x again.
#define RMS_HELD 4
template <int ADD>
__device__ __forceinline__ void ts_rms_norm(const RmsNorm& p) {
    const int width = p.width;
    float* xp = p.x + (long long)blockIdx.x * width;
    float* op = p.out + (long long)blockIdx.x * width;
    signed char* qp = p.q ? p.q + (long long)blockIdx.x * width : nullptr;
    float2* dp = p.q ? p.ds + (long long)blockIdx.x * (width / 32) : nullptr;
    const float* w = p.w;
    float held[RMS_HELD], wheld[RMS_HELD];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RMS_HELD; j++) {
        int i = threadIdx.x + j * blockDim.x;
        // The weights are loaded with x, not after the block sum: one memory wait less.
        wheld[j] = i < width && w ? w[i] : 1.0f;
        held[j] = i < width ? xp[i] : 0.0f;
        if (ADD && i < width) {
            held[j] += ts_norm_y<ADD>(p, i);
            xp[i] = held[j];
        }
        ss += held[j] * held[j];
    }
    for (int i = threadIdx.x + RMS_HELD * blockDim.x; i < width; i += blockDim.x) {
        float v = xp[i];
        if (ADD) {
            v += ts_norm_y<ADD>(p, i);
            xp[i] = v;  // read back below by this same thread
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    float scale = rsqrtf(ss / width + p.eps);
    // With q, `i < width` is the same for a whole warp (width and blockDim.x are multiples of 32).
#pragma unroll
    for (int j = 0; j < RMS_HELD; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i < width) {
            const float v = held[j] * scale * wheld[j];
            op[i] = v;
            if (qp) ts_q8_store_warp(v, i, qp, dp);
        }
    }
    for (int i = threadIdx.x + RMS_HELD * blockDim.x; i < width; i += blockDim.x) {
        const float v = xp[i] * scale * (w ? w[i] : 1.0f);
        op[i] = v;
        if (qp) ts_q8_store_warp(v, i, qp, dp);
    }
}

extern "C" __global__ void rms_norm(const RmsNorm p) {
    ts_grid_begin();
    if (!p.y) {
        ts_rms_norm<0>(p);
    } else if (p.pair_w) {
        ts_rms_norm<2>(p);
    } else {
        ts_rms_norm<1>(p);
    }
}

// x[i] += y[i]
extern "C" __global__ void add(float* x, const float* y, long long n) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// x[r][i] += bias[i] for rows of `width`.
extern "C" __global__ void add_bias(float* x, const float* bias, int width, long long n) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += bias[i % width];
}

extern "C" __global__ void scale(float* x, float s, long long n) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= s;
}

extern "C" __global__ void softcap(float* x, float c, long long n) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = c * tanhf(x[i] / c);
}

// gate = act(gate, up) (activation.cuh's kinds).
extern "C" __global__ void gated(float* gate, const float* up, long long n, int kind, float alpha, float limit) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        gate[i] = ts_gated(kind, gate[i], up[i], alpha, limit);
}

// x[r] *= sigmoid(dot(gate_inp, inp[r])) for rows of `width` (sigmoid-gated shared expert). grid.x = m.
extern "C" __global__ void sigmoid_gate_rows(float* x, const float* inp, const float* gate_inp, int width) {
    ts_grid_begin();
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
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
        out[i] = h;
    }
}

extern "C" __global__ void fill(float* x, float v, long long n) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = v;
}

// Columns start..start+n of each width-wide row of x: into out [rows][n].
// grid.x = rows, block 128.
extern "C" __global__ void columns(const float* x, float* out, int width, int start, int n) {
    ts_grid_begin();
    long long r = blockIdx.x;
    const float* src = x + r * width + start;
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[r * n + i] = src[i];
}

// x[i] *= sigmoid(gate[i])
extern "C" __global__ void mul_sigmoid(float* x, const float* gate, long long n) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= 1.0f / (1.0f + expf(-gate[i]));
}
