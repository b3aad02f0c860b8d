// Gated DeltaNet kernels (qwen35moe, qwen3next): the causal convolution and
// the gated delta rule over each sequence's recurrent state. Mirrors
// ts-cpu's delta_net.rs (the reference they are tested against). A step's
// rows are grouped into runs, one per sequence, positions in order.

// One sequence's rows in a step: run_rows[start .. start + len]; fresh: its
// first row is at position 0 (its state starts from zero).
struct RunInfo {
    int start;
    int len;
    int fresh;
    int pad;
};

// A recurrent layer's state of a row's sequence is in that layer's RowKv
// (ops.cu): k = the conv window [kernel - 1][channels], v = per value head the
// matrix S stored transposed, [n_v][d_v][d_k] (column j of S contiguous).

__device__ __forceinline__ float dn_silu(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float dn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// One channel of one run: its K taps and K-1 held inputs in registers (K is
// a template parameter so that the arrays stay out of local memory).
template <int K>
__device__ __forceinline__ void conv_channel(const float* x, float* out, const float* taps, int channels, int c,
                                             const int* rows, RunInfo ri, float* win) {
    float w[K], hist[K];
#pragma unroll
    for (int t = 0; t < K; t++) w[t] = taps[(long long)c * K + t];
#pragma unroll
    for (int t = 0; t < K - 1; t++) hist[t] = ri.fresh ? 0.0f : win[(long long)t * channels + c];
    for (int i = 0; i < ri.len; i++) {
        long long row = rows[ri.start + i];
        float xv = x[row * channels + c];
        // The last tap multiplies the current input.
        float acc = w[K - 1] * xv;
#pragma unroll
        for (int t = 0; t < K - 1; t++) acc += w[t] * hist[t];
        out[row * channels + c] = dn_silu(acc);
#pragma unroll
        for (int t = 0; t < K - 2; t++) hist[t] = hist[t + 1];
        hist[K - 2] = xv;
    }
#pragma unroll
    for (int t = 0; t < K - 1; t++) win[(long long)t * channels + c] = hist[t];
}

// out = silu(causal depthwise conv(x)) per channel, carrying each run's window.
// x, out [m][channels]; taps [channels][kernel], 2 <= kernel <= 8.
// grid = (ceil(channels / 256), n_runs), block 256.
extern "C" __global__ void conv_silu(const float* x, float* out, const float* taps, int channels, int kernel,
                                     const int* run_rows, const RunInfo* runs, const RowKv* info) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    RunInfo ri = runs[blockIdx.y];
    float* win = (float*)info[run_rows[ri.start]].k;
    switch (kernel) {
        case 2: conv_channel<2>(x, out, taps, channels, c, run_rows, ri, win); break;
        case 3: conv_channel<3>(x, out, taps, channels, c, run_rows, ri, win); break;
        case 4: conv_channel<4>(x, out, taps, channels, c, run_rows, ri, win); break;
        case 5: conv_channel<5>(x, out, taps, channels, c, run_rows, ri, win); break;
        case 6: conv_channel<6>(x, out, taps, channels, c, run_rows, ri, win); break;
        case 7: conv_channel<7>(x, out, taps, channels, c, run_rows, ri, win); break;
        case 8: conv_channel<8>(x, out, taps, channels, c, run_rows, ri, win); break;
    }
}

// Per row, the q and k heads of the convolved qkv [m][conv_dim] L2-normalised
// (x / sqrt(sum x^2 + eps)), q also times q_scale, into qk [m][2 * nk * dk].
// grid = (m, 2 * nk), block 32.
extern "C" __global__ void l2_norm_heads(const float* qkv, float* qk, int conv_dim, int nk, int dk, float eps,
                                         float q_scale) {
    int r = blockIdx.x, h = blockIdx.y;
    const float* x = qkv + (long long)r * conv_dim + h * dk;
    float* o = qk + (long long)r * 2 * nk * dk + h * dk;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dk; i += WARP) ss += x[i] * x[i];
    ss = warp_sum(ss);
    float s = rsqrtf(ss + eps) * (h < nk ? q_scale : 1.0f);
    for (int i = threadIdx.x; i < dk; i += WARP) o[i] = x[i] * s;
}

#define DN_WARPS 4
#define DN_MAX_HELD 8

// The gated delta rule, token by token, for the runs' rows: per value head h
// (reading key head kh), S <- e^g S; S <- S + k (beta (v - Sᵀk))ᵀ; o = Sᵀq.
// beta = sigmoid(beta_raw), g = a[h] * softplus(alpha + dt_bias[h]).
// qk [m][2*nk*dk] normalised; qkv [m][conv_dim] (v at 2*nk*dk); beta_raw,
// alpha [m][nv]; out [m][nv*dv]. tiled: kh = h % nk, else h / (nv / nk).
// grid = (nv, n_runs, ceil(dv / DN_WARPS)), block = 32 * DN_WARPS: a warp per
// column j of S, each lane holding S[lane + 32 t][j].
extern "C" __global__ void delta_rule(const float* qk, const float* qkv, const float* beta_raw, const float* alpha,
                                      const float* a, const float* dt_bias, float* out, int conv_dim, int nk, int nv,
                                      int dk, int dv, int tiled, const int* run_rows, const RunInfo* runs,
                                      const RowKv* info) {
    int h = blockIdx.x;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int j = blockIdx.z * DN_WARPS + warp;
    if (j >= dv) return;
    RunInfo ri = runs[blockIdx.y];
    float* col = (float*)info[run_rows[ri.start]].v + ((long long)h * dv + j) * dk;
    int kh = tiled ? h % nk : h / (nv / nk);
    float s[DN_MAX_HELD];
#pragma unroll
    for (int t = 0; t < DN_MAX_HELD; t++) {
        int i = lane + t * WARP;
        s[t] = (i < dk && !ri.fresh) ? col[i] : 0.0f;
    }
    float ah = a[h], dth = dt_bias[h];
    for (int n = 0; n < ri.len; n++) {
        long long row = run_rows[ri.start + n];
        const float* q = qk + row * 2 * nk * dk + kh * dk;
        const float* k = qk + row * 2 * nk * dk + (nk + kh) * dk;
        float v = qkv[row * conv_dim + 2 * nk * dk + h * dv + j];
        float beta = 1.0f / (1.0f + expf(-beta_raw[row * nv + h]));
        float decay = expf(ah * dn_softplus(alpha[row * nv + h] + dth));
        float kv = 0.0f;
#pragma unroll
        for (int t = 0; t < DN_MAX_HELD; t++) {
            int i = lane + t * WARP;
            if (i < dk) {
                s[t] *= decay;
                kv += s[t] * k[i];
            }
        }
        kv = warp_sum(kv);
        float delta = beta * (v - kv);
        float o = 0.0f;
#pragma unroll
        for (int t = 0; t < DN_MAX_HELD; t++) {
            int i = lane + t * WARP;
            if (i < dk) {
                s[t] += k[i] * delta;
                o += s[t] * q[i];
            }
        }
        o = warp_sum(o);
        if (lane == 0) out[row * nv * dv + h * dv + j] = o;
    }
#pragma unroll
    for (int t = 0; t < DN_MAX_HELD; t++) {
        int i = lane + t * WARP;
        if (i < dk) col[i] = s[t];
    }
}
