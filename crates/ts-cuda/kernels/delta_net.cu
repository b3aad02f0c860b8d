// Gated DeltaNet kernels (qwen35moe, qwen3next): the causal convolution and
// the gated delta rule over each sequence's recurrent state. Mirrors
// ts-cpu's delta_net.rs (the reference they are tested against). A step's
// rows are grouped into runs, one per sequence, positions in order.

// One sequence's rows in a step: run_rows[start .. start + len]; fresh: its
// first row is at position 0 (its state starts from zero); chunk0: the index
// of its first chunk of DN_CHUNK rows among all runs' chunks (chunked form).
struct RunInfo {
    int start;
    int len;
    int fresh;
    int chunk0;
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
    ts_grid_begin();
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

// The same as conv_silu with a thread per (row, channel): each output reads
// its kernel - 1 predecessors from the run's rows or, before the run, from the
// window, which conv_window then advances. grid = (ceil(channels / 256),
// n_runs, ceil(longest run / 64)), block 256; each thread takes up to 64 rows.
extern "C" __global__ void conv_silu_rows(const float* x, float* out, const float* taps, int channels, int kernel,
                                          const int* run_rows, const RunInfo* runs, const RowKv* info) {
    ts_grid_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    RunInfo ri = runs[blockIdx.y];
    if (c >= channels || (int)blockIdx.z * 64 >= ri.len) return;
    const float* win = (const float*)info[run_rows[ri.start]].k;
    const float* w = taps + (long long)c * kernel;
    int end = min(ri.len, (int)blockIdx.z * 64 + 64);
    for (int i = blockIdx.z * 64; i < end; i++) {
        float acc = 0.0f;
        for (int t = 0; t < kernel; t++) {
            // Tap t reads the input kernel - 1 - t rows back.
            int p = i - (kernel - 1) + t;
            float xv = p >= 0 ? x[(long long)run_rows[ri.start + p] * channels + c]
                              : (ri.fresh ? 0.0f : win[(long long)(kernel - 1 + p) * channels + c]);
            acc += w[t] * xv;
        }
        out[(long long)run_rows[ri.start + i] * channels + c] = dn_silu(acc);
    }
}

// After conv_silu_rows: each run's window becomes its last kernel - 1 inputs
// (taking from the old window what the run is too short to give).
// grid = (ceil(channels / 256), n_runs), block 256.
extern "C" __global__ void conv_window(const float* x, int channels, int kernel, const int* run_rows,
                                       const RunInfo* runs, const RowKv* info) {
    ts_grid_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    RunInfo ri = runs[blockIdx.y];
    float* win = (float*)info[run_rows[ri.start]].k;
    for (int t = 0; t < kernel - 1; t++) {
        // Slot t takes input len - (kernel - 1) + t; a negative one is old slot t + len (> t: not yet overwritten).
        int p = ri.len - (kernel - 1) + t;
        float v = p >= 0 ? x[(long long)run_rows[ri.start + p] * channels + c]
                         : (ri.fresh ? 0.0f : win[(long long)(t + ri.len) * channels + c]);
        win[(long long)t * channels + c] = v;
    }
}

// Per row, the q and k heads of the convolved qkv [m][conv_dim] L2-normalised
// (x / sqrt(sum x^2 + eps)), q also times q_scale, into qk [m][2 * nk * dk].
// grid = (m, 2 * nk), block 32.
extern "C" __global__ void l2_norm_heads(const float* qkv, float* qk, int conv_dim, int nk, int dk, float eps,
                                         float q_scale) {
    ts_grid_begin();
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
    ts_grid_begin();
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

// The chunked form of delta_rule (ts-cpu's delta_rule_chunked, the same
// algebra): per chunk of DN_CHUNK rows of a run, with cumulative log-decay G,
// A[t][s] = beta_t (k_t.k_s) e^(G_t - G_s) (s < t), W = (I + A)^-1 diag(beta e^G) K,
// U = (I + A)^-1 diag(beta) V and M[t][s] = (q_t.k_s) e^(G_t - G_s) (s <= t)
// depend on the inputs only (delta_chunk_prep, every chunk at once); then in
// order, from the incoming state S: V' = U - W S, O = diag(e^G) Q S + M V',
// S <- e^(G_last) S + sum_t e^(G_last - G_t) k_t v'_t^T (delta_chunk_scan).
#define DN_CHUNK 64

// Floats of one (chunk, value head) of the prepared buffer: G[64], WT[dk][64],
// QT[dk][64] (q_t e^(G_t)), UT[dv][64], MT[64][64] (MT[s][t] = M[t][s]).
__device__ __forceinline__ long long dn_prep_floats(int dk, int dv) {
    return DN_CHUNK + (long long)DN_CHUNK * (2 * dk + dv) + DN_CHUNK * DN_CHUNK;
}

// grid = (nv, n_runs, ceil(longest run / DN_CHUNK)), block 256 (8 warps).
extern "C" __global__ void delta_chunk_prep(const float* qk, const float* qkv, const float* beta_raw,
                                            const float* alpha, const float* a, const float* dt_bias, float* prep,
                                            int conv_dim, int nk, int nv, int dk, int dv, int tiled,
                                            const int* run_rows, const RunInfo* runs) {
    ts_grid_begin();
    int h = blockIdx.x, ch = blockIdx.z;
    RunInfo ri = runs[blockIdx.y];
    int c0 = ch * DN_CHUNK;
    if (c0 >= ri.len) return;
    int c = min(DN_CHUNK, ri.len - c0);
    int kh = tiled ? h % nk : h / (nv / nk);
    float* G = prep + ((long long)(ri.chunk0 + ch) * nv + h) * dn_prep_floats(dk, dv);
    float* WT = G + DN_CHUNK;
    float* QT = WT + (long long)DN_CHUNK * dk;
    float* UT = QT + (long long)DN_CHUNK * dk;
    float* MT = UT + (long long)DN_CHUNK * dv;
    __shared__ float sG[DN_CHUNK], sBeta[DN_CHUNK], sA[DN_CHUNK][DN_CHUNK + 1];
    __shared__ int sRow[DN_CHUNK];
    int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP, n_warps = blockDim.x / WARP;
    if (tid < DN_CHUNK) {
        float g = 0.0f, beta = 0.0f;
        int row = 0;
        if (tid < c) {
            row = run_rows[ri.start + c0 + tid];
            beta = 1.0f / (1.0f + expf(-beta_raw[(long long)row * nv + h]));
            g = a[h] * dn_softplus(alpha[(long long)row * nv + h] + dt_bias[h]);
        }
        sG[tid] = g;
        sBeta[tid] = beta;
        sRow[tid] = row;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.0f;
        for (int t = 0; t < DN_CHUNK; t++) {
            acc += sG[t];
            sG[t] = acc;
        }
    }
    __syncthreads();
    if (tid < DN_CHUNK) G[tid] = sG[tid];
    // A and M: a warp per row t, its lanes across the key dimension.
    long long stride = 2LL * nk * dk;
    for (int t = warp; t < DN_CHUNK; t += n_warps) {
        for (int s = lane; s < DN_CHUNK; s += WARP) sA[t][s] = 0.0f;
        if (t >= c) continue;
        const float* qt = qk + sRow[t] * stride + kh * dk;
        const float* kt = qk + sRow[t] * stride + (nk + kh) * dk;
        float qh[DN_MAX_HELD], kh_[DN_MAX_HELD];
#pragma unroll
        for (int m = 0; m < DN_MAX_HELD; m++) {
            int i = lane + m * WARP;
            qh[m] = i < dk ? qt[i] : 0.0f;
            kh_[m] = i < dk ? kt[i] : 0.0f;
        }
        __syncwarp();
#pragma unroll 4
        for (int s = 0; s <= t; s++) {
            const float* ks = qk + sRow[s] * stride + (nk + kh) * dk;
            float kk = 0.0f, qk_ = 0.0f;
#pragma unroll
            for (int m = 0; m < DN_MAX_HELD; m++) {
                int i = lane + m * WARP;
                float v = i < dk ? ks[i] : 0.0f;
                kk += kh_[m] * v;
                qk_ += qh[m] * v;
            }
            kk = warp_sum(kk);
            qk_ = warp_sum(qk_);
            if (lane == 0) {
                float decay = expf(sG[t] - sG[s]);
                if (s < t) sA[t][s] = sBeta[t] * kk * decay;
                MT[s * DN_CHUNK + t] = qk_ * decay;
            }
        }
    }
    __syncthreads();
    // Forward substitution, a thread per column of [K | V]: x_t = b_t - sum_{s<t} A[t][s] x_s.
    for (int col = tid; col < dk + dv; col += blockDim.x) {
        float x[DN_CHUNK];
#pragma unroll
        for (int t = 0; t < DN_CHUNK; t++) {
            float b = 0.0f;
            if (t < c) {
                long long row = sRow[t];
                b = col < dk ? sBeta[t] * expf(sG[t]) * qk[row * stride + (nk + kh) * dk + col]
                             : sBeta[t] * qkv[row * conv_dim + 2 * nk * dk + h * dv + (col - dk)];
            }
#pragma unroll
            for (int s = 0; s < t; s++) b -= sA[t][s] * x[s];
            x[t] = b;
        }
        float* dst = col < dk ? WT + (long long)col * DN_CHUNK : UT + (long long)(col - dk) * DN_CHUNK;
#pragma unroll
        for (int t = 0; t < DN_CHUNK; t++) dst[t] = x[t];
        if (col < dk) {
#pragma unroll 8
            for (int t = 0; t < c; t++) QT[(long long)col * DN_CHUNK + t] = qk[sRow[t] * stride + kh * dk + col] * expf(sG[t]);
        }
    }
}

#define DN_SCAN_COLS 2
#define DN_SCAN_WARPS 8

// grid = (nv, n_runs, ceil(dv / (DN_SCAN_COLS * DN_SCAN_WARPS))), block 32 * DN_SCAN_WARPS:
// a warp per DN_SCAN_COLS columns of S (dv a multiple of DN_SCAN_COLS), its lanes
// over the rows of a chunk (t = lane, lane + 32), then over the key dimension.
extern "C" __global__ void delta_chunk_scan(const float* qk, const float* prep, float* out, int nk, int nv, int dk,
                                            int dv, int tiled, const int* run_rows, const RunInfo* runs,
                                            const RowKv* info) {
    ts_grid_begin();
    int h = blockIdx.x;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int j0 = (blockIdx.z * DN_SCAN_WARPS + warp) * DN_SCAN_COLS;
    if (j0 >= dv) return;
    RunInfo ri = runs[blockIdx.y];
    int kh = tiled ? h % nk : h / (nv / nk);
    __shared__ float sS[DN_SCAN_WARPS][DN_SCAN_COLS][256];
    float(*S)[256] = sS[warp];
    float* cols = (float*)info[run_rows[ri.start]].v + ((long long)h * dv + j0) * dk;
    for (int jj = 0; jj < DN_SCAN_COLS; jj++)
        for (int i = lane; i < dk; i += WARP) S[jj][i] = ri.fresh ? 0.0f : cols[(long long)jj * dk + i];
    __syncwarp();
    long long stride = 2LL * nk * dk;
    for (int ch = 0; ch * DN_CHUNK < ri.len; ch++) {
        int c0 = ch * DN_CHUNK, c = min(DN_CHUNK, ri.len - c0);
        const float* G = prep + ((long long)(ri.chunk0 + ch) * nv + h) * dn_prep_floats(dk, dv);
        const float* WT = G + DN_CHUNK;
        const float* QT = WT + (long long)DN_CHUNK * dk;
        const float* UT = QT + (long long)DN_CHUNK * dk;
        const float* MT = UT + (long long)DN_CHUNK * dv;
        // W S and e^G Q S for rows lane and lane + 32.
        float pw[2][DN_SCAN_COLS] = {}, pq[2][DN_SCAN_COLS] = {};
#pragma unroll 4
        for (int i = 0; i < dk; i++) {
            float w0 = WT[i * DN_CHUNK + lane], w1 = WT[i * DN_CHUNK + lane + WARP];
            float q0 = QT[i * DN_CHUNK + lane], q1 = QT[i * DN_CHUNK + lane + WARP];
#pragma unroll
            for (int jj = 0; jj < DN_SCAN_COLS; jj++) {
                float sv = S[jj][i];
                pw[0][jj] += w0 * sv;
                pw[1][jj] += w1 * sv;
                pq[0][jj] += q0 * sv;
                pq[1][jj] += q1 * sv;
            }
        }
        // This lane's rows (t = lane, lane + 32), for the others to read by shuffle.
        int row0 = lane < c ? run_rows[ri.start + c0 + lane] : 0;
        int row1 = lane + WARP < c ? run_rows[ri.start + c0 + lane + WARP] : 0;
        float vp[2][DN_SCAN_COLS], o[2][DN_SCAN_COLS];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int t = lane + e * WARP;
#pragma unroll
            for (int jj = 0; jj < DN_SCAN_COLS; jj++) {
                vp[e][jj] = t < c ? UT[(long long)(j0 + jj) * DN_CHUNK + t] - pw[e][jj] : 0.0f;
                o[e][jj] = pq[e][jj];
            }
        }
        // O += M V' (s <= t), v'_s from lane s % 32 of half s / 32.
#pragma unroll
        for (int half = 0; half < 2; half++) {
#pragma unroll 4
            for (int sl = 0; sl < WARP; sl++) {
                int s = half * WARP + sl;
                if (s >= c) break;
                float m0 = MT[s * DN_CHUNK + lane], m1 = MT[s * DN_CHUNK + lane + WARP];
#pragma unroll
                for (int jj = 0; jj < DN_SCAN_COLS; jj++) {
                    float vs = __shfl_sync(0xffffffffu, vp[half][jj], sl);
                    if (s <= lane) o[0][jj] += m0 * vs;
                    if (s <= lane + WARP) o[1][jj] += m1 * vs;
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int t = lane + e * WARP;
            if (t < c) {
                long long row = e ? row1 : row0;
#pragma unroll
                for (int jj = 0; jj < DN_SCAN_COLS; jj++) out[row * nv * dv + h * dv + j0 + jj] = o[e][jj];
            }
        }
        // S <- e^(G_last) S + sum_t e^(G_last - G_t) k_t v'_t^T, lanes over the key dimension.
        float last = G[c - 1];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int t = lane + e * WARP;
            float f = t < c ? expf(last - G[t]) : 0.0f;
#pragma unroll
            for (int jj = 0; jj < DN_SCAN_COLS; jj++) vp[e][jj] *= f;
        }
        float decay = expf(last);
        float acc[DN_MAX_HELD][DN_SCAN_COLS];
#pragma unroll
        for (int m = 0; m < DN_MAX_HELD; m++) {
            int i = lane + m * WARP;
#pragma unroll
            for (int jj = 0; jj < DN_SCAN_COLS; jj++) acc[m][jj] = i < dk ? decay * S[jj][i] : 0.0f;
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
#pragma unroll 4
            for (int sl = 0; sl < WARP; sl++) {
                int s = half * WARP + sl;
                if (s >= c) break;
                long long row = __shfl_sync(0xffffffffu, half ? row1 : row0, sl);
                const float* ks = qk + row * stride + (nk + kh) * dk;
                float u[DN_SCAN_COLS];
#pragma unroll
                for (int jj = 0; jj < DN_SCAN_COLS; jj++) u[jj] = __shfl_sync(0xffffffffu, vp[half][jj], sl);
#pragma unroll
                for (int m = 0; m < DN_MAX_HELD; m++) {
                    int i = lane + m * WARP;
                    if (i < dk) {
                        float kv = ks[i];
#pragma unroll
                        for (int jj = 0; jj < DN_SCAN_COLS; jj++) acc[m][jj] += kv * u[jj];
                    }
                }
            }
        }
        __syncwarp();
#pragma unroll
        for (int m = 0; m < DN_MAX_HELD; m++) {
            int i = lane + m * WARP;
            if (i < dk) {
#pragma unroll
                for (int jj = 0; jj < DN_SCAN_COLS; jj++) S[jj][i] = acc[m][jj];
            }
        }
        __syncwarp();
    }
    for (int jj = 0; jj < DN_SCAN_COLS; jj++)
        for (int i = lane; i < dk; i += WARP) cols[(long long)jj * dk + i] = S[jj][i];
}
