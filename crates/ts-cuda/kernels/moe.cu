// The routed experts' small kernels: routing, per-expert biases, gathering a
// step's rows by expert and the weighted combine (the matmuls are in matmul.cu and
// matvec_q8.cu). Uses ops.cu's helpers (ops.cu comes first in the one compiled source).

// x[s][i] += bias[ids[s]][i]: per-expert biases of MoE slots s, those with
// mask[s] >= 0 (all when mask is null).
extern "C" __global__ void add_bias_indexed(float* x, const float* bias, const int* ids, const int* mask, int width,
                                            long long n) {
    ts_grid_begin();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        if (!mask || mask[i / width] >= 0) x[i] += bias[(long long)ids[i / width] * width + i % width];
}

// out[j] = x[rows[j]] for rows of `width`. grid.x = n rows.
extern "C" __global__ void gather_rows(const float* x, const int* rows, float* out, int width) {
    ts_grid_begin();
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
    ts_grid_begin();
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

// The warp's largest (value, index), ties to the lower index, left in every lane. From sm_80
// two reductions: the largest value as an ordered key (-0 taken as +0, as the float compare
// does), then the lowest index of the lanes holding it; before, five rounds of shuffles.
__device__ __forceinline__ void ts_warp_argmax(float& best, int& bi) {
#if __CUDA_ARCH__ >= 800
    const unsigned bits = __float_as_uint(best + 0.0f);
    const unsigned key = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
    const unsigned top = __reduce_max_sync(0xffffffffu, key);
    bi = __reduce_min_sync(0xffffffffu, key == top ? bi : 0x7fffffff);
    best = __uint_as_float(top & 0x80000000u ? top & 0x7fffffffu : ~top);
#else
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ob > best || (ob == best && oi < bi)) {
            best = ob;
            bi = oi;
        }
    }
#endif
}

// ts_route_row for at most 32 * PL experts and k <= 32, the logits in registers (PL per lane)
// and selection j held by lane j: no shared memory, no lane-0 loops.
template <int PL>
__device__ __forceinline__ void ts_route_regs(const float* l, int row, int n_expert, int k, int gating,
                                              int renormalize, const float* scale, int* ids, float* weights) {
    const int lane = threadIdx.x & 31;
    float v[PL];
    float mx = -INFINITY;
    TS_UNROLL
    for (int j = 0; j < PL; j++) {
        const int i = lane + 32 * j;
        v[j] = i < n_expert ? __ldcg(l + i) : -INFINITY;
        mx = fmaxf(mx, v[j]);
    }
    mx = warp_max(mx);
    if (gating == 0) {
        float s = 0.0f;
        TS_UNROLL
        for (int j = 0; j < PL; j++) {
            if (lane + 32 * j < n_expert) {
                v[j] = expf(v[j] - mx);
                s += v[j];
            }
        }
        s = warp_sum(s);
        TS_UNROLL
        for (int j = 0; j < PL; j++)
            if (lane + 32 * j < n_expert) v[j] /= s;
    }
    float my_w = 0.0f;
    int my_id = 0;
    for (int sel = 0; sel < k; sel++) {
        float best = -INFINITY;
        int bi = 0x7fffffff;
        TS_UNROLL
        for (int j = 0; j < PL; j++) {
            // Ascending indices: a tie keeps the lower; an expert is taken even at -inf (as
            // the shared-memory path does), never a slot past n_expert.
            if (lane + 32 * j < n_expert && (v[j] > best || (v[j] == best && bi == 0x7fffffff))) {
                best = v[j];
                bi = lane + 32 * j;
            }
        }
        ts_warp_argmax(best, bi);
        if (lane == sel) my_w = best, my_id = bi;
        TS_UNROLL
        for (int j = 0; j < PL; j++)
            if (bi == lane + 32 * j) v[j] = -INFINITY;
    }
    const bool mine = lane < k;
    if (gating == 1) {
        const float m0 = __shfl_sync(0xffffffffu, my_w, 0);  // the first selection is the largest
        my_w = mine ? expf(my_w - m0) : 0.0f;
        my_w /= warp_sum(my_w);
    }
    if (renormalize) my_w /= fmaxf(warp_sum(mine ? my_w : 0.0f), 6.103515625e-5f);
    if (mine) {
        ids[row * k + lane] = my_id;
        weights[row * k + lane] = scale ? my_w * scale[my_id] : my_w;
    }
}

// Routes row `row` from its router logits l [n_expert]: gating 0 = softmax then
// top-k, 1 = top-k then softmax over the k; renormalize divides the k weights by
// their sum (floored like llama.cpp); then each weight times its expert's
// scale [n_expert] where scale is not null (Gemma 4). Ties keep the lower
// index. Run by one warp (the first of its block); the logits are read past L1, so
// that those another block just wrote are seen.
__device__ void ts_route_row(const float* l, int row, int n_expert, int k, int gating, int renormalize,
                             const float* scale, int* ids, float* weights) {
    if (k <= 32 && n_expert <= 256) {
        if (n_expert <= 32) {
            ts_route_regs<1>(l, row, n_expert, k, gating, renormalize, scale, ids, weights);
        } else if (n_expert <= 64) {
            ts_route_regs<2>(l, row, n_expert, k, gating, renormalize, scale, ids, weights);
        } else if (n_expert <= 128) {
            ts_route_regs<4>(l, row, n_expert, k, gating, renormalize, scale, ids, weights);
        } else {
            ts_route_regs<8>(l, row, n_expert, k, gating, renormalize, scale, ids, weights);
        }
        return;
    }
    __shared__ float v[MAX_EXPERTS];
    __shared__ float sel_w[64];
    int lane = threadIdx.x;
    float mx = -INFINITY;
    for (int i = lane; i < n_expert; i += WARP) {
        v[i] = __ldcg(l + i);
        mx = fmaxf(mx, v[i]);
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
        ts_warp_argmax(best, bi);
        if (lane == 0) {
            ids[row * k + j] = bi;
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
            if (scale) w *= scale[ids[row * k + j]];
            weights[row * k + j] = w;
        }
    }
}

// `ts_route_row` for each row of logits [m][n_expert]. grid.x = m, one warp.
extern "C" __global__ void route(const float* logits, int n_expert, int k, int gating, int renormalize,
                                 const float* scale, int* ids, float* weights) {
    ts_grid_begin();
    ts_route_row(logits + (long long)blockIdx.x * n_expert, blockIdx.x, n_expert, k, gating, renormalize, scale, ids,
                 weights);
}

// router_route's parameters (crates/ts-cuda/src/moe.rs mirrors them).
struct RouterRoute {
    const float* w;  // [n_expert][n_embd] f32, n_embd a multiple of 4
    const float* bias;  // [n_expert] or null
    const float* x;  // [m][n_embd]
    float* logits;  // [m][n_expert]
    int* done;  // [m] zeros: blocks of each row finished (the last one puts the 0 back)
    const float* scale;  // as `route`
    int* ids;  // [m][k]
    float* weights;  // [m][k]
    int n_expert, n_embd, k, gating, renormalize;
};

// Logit e of row r (acc, before the bias) written by block (e, r) of a router kernel; the row's
// last block to finish routes the row as `route` does.
__device__ __forceinline__ void ts_router_finish(const RouterRoute& p, int e, int r, float acc) {
    __shared__ int last;
    if (threadIdx.x == 0) {
        p.logits[(long long)r * p.n_expert + e] = acc + (p.bias ? p.bias[e] : 0.0f);
        __threadfence();
        last = atomicAdd(p.done + r, 1) == p.n_expert - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) p.done[r] = 0;
    if (threadIdx.x < WARP)
        ts_route_row(p.logits + (long long)r * p.n_expert, r, p.n_expert, p.k, p.gating, p.renormalize, p.scale, p.ids,
                     p.weights);
}

// The router and the routing of few rows in one launch: block (e, r) writes logit e of row
// r, x[r] . w[e] + bias[e]; the row's last block to finish routes the row as `route` does.
// grid (n_expert, m), block 128 or 256 (device::router_threads; any multiple of 32 up to 1,024).
extern "C" __global__ void router_route(const RouterRoute p) {
    ts_grid_begin();
    const int e = blockIdx.x, r = blockIdx.y;
    const float4* w = (const float4*)(p.w + (long long)e * p.n_embd);
    const float4* x = (const float4*)(p.x + (long long)r * p.n_embd);
    float acc = 0.0f;
    for (int i = threadIdx.x; i < p.n_embd / 4; i += blockDim.x) {
        const float4 a = w[i], b = x[i];
        acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    ts_router_finish(p, e, r, block_sum(acc));
}

// norm_router_route's parameters (crates/ts-cuda/src/moe.rs mirrors them).
struct NormRouterRoute {
    RouterRoute route;  // route.x: the residual rows x [m][n_embd] before the add
    const float* y;  // [m][n_embd]: added to x
    const float* norm;  // [n_embd]: the norm's weights
    float* x_out;  // [m][n_embd]: x + y
    float* normed;  // [m][n_embd]: rms_norm(x + y) * norm
    signed char* q;  // [m][n_embd] and ds [m][n_embd / 32]: normed's 8-bit copy
    float2* ds;
    float eps;
};

#define NR_HELD 4

// The FFN's residual add and norm (rms_norm with y, and its 8-bit copy) fused with
// router_route, for few rows: block (e, r) sums the squares of x[r] + y[r] itself (every block
// of the row in the same order, so all agree on the scale) and takes logit e from the normed
// row, elements normed as rms_norm does; blocks e, e + n_expert, ... also write 32-element
// chunks e, e + n_expert, ... of x_out, normed and its 8-bit copy. n_embd a multiple of 32.
// grid (n_expert, m), block 128 or 256 (device::router_threads; any multiple of 32 up to 1,024).
extern "C" __global__ void norm_router_route(const NormRouterRoute p) {
    ts_grid_begin();
    const RouterRoute& rr = p.route;
    const int e = blockIdx.x, r = blockIdx.y, n4 = rr.n_embd / 4;
    const long long at = (long long)r * rr.n_embd;
    const float4* w = (const float4*)(rr.w + (long long)e * rr.n_embd);
    const float4* x = (const float4*)(rr.x + at);
    const float4* y = (const float4*)(p.y + at);
    const float4* nw = (const float4*)p.norm;
    // The first NR_HELD float4s of each thread stay in registers between the two passes,
    // every load of them issued before the block sum.
    float4 held[NR_HELD], wheld[NR_HELD], rheld[NR_HELD];
    float ss = 0.0f;
    TS_UNROLL
    for (int j = 0; j < NR_HELD; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f), nv = s, wv = s;
        if (i < n4) {
            const float4 a = x[i], b = y[i];
            nv = nw[i], wv = w[i];
            s = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
        }
        held[j] = s, wheld[j] = nv, rheld[j] = wv;
        ss += s.x * s.x + s.y * s.y + s.z * s.z + s.w * s.w;
    }
    for (int i = threadIdx.x + NR_HELD * blockDim.x; i < n4; i += blockDim.x) {
        const float4 a = x[i], b = y[i];
        ss += (a.x + b.x) * (a.x + b.x) + (a.y + b.y) * (a.y + b.y) + (a.z + b.z) * (a.z + b.z) +
              (a.w + b.w) * (a.w + b.w);
    }
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / rr.n_embd + p.eps);
    float acc = 0.0f;
    TS_UNROLL
    for (int j = 0; j < NR_HELD; j++) {
        const float4 s = held[j], nv = wheld[j], wv = rheld[j];
        acc += wv.x * (s.x * scale * nv.x) + wv.y * (s.y * scale * nv.y) + wv.z * (s.z * scale * nv.z) +
               wv.w * (s.w * scale * nv.w);
    }
    for (int i = threadIdx.x + NR_HELD * blockDim.x; i < n4; i += blockDim.x) {
        const float4 a = x[i], b = y[i], nv = nw[i], wv = w[i];
        acc += wv.x * ((a.x + b.x) * scale * nv.x) + wv.y * ((a.y + b.y) * scale * nv.y) +
               wv.z * ((a.z + b.z) * scale * nv.z) + wv.w * ((a.w + b.w) * scale * nv.w);
    }
    if (threadIdx.x < WARP) {
        const float* xs = rr.x + at;
        const float* ys = p.y + at;
        for (int c = e; c < rr.n_embd / 32; c += rr.n_expert) {
            const int i = 32 * c + threadIdx.x;
            const float s = xs[i] + ys[i];
            const float v = s * scale * p.norm[i];
            p.x_out[at + i] = s;
            p.normed[at + i] = v;
            ts_q8_store_warp(v, i, p.q + at, p.ds + at / 32);
        }
    }
    ts_router_finish(rr, e, r, block_sum(acc));
}

// moe_group_pairs' parameters (crates/ts-cuda/src/moe.rs mirrors them).
struct MoeGroupPairs {
    const int* ids;  // [n] = [m][k]: each (row, slot) pair's expert
    int* grouped;  // [3][n]: the pairs in expert order, their rows (pair / k), each pair's place
    int* chunks;  // [max_chunks][3]: (expert, first place, rows), at most `chunk` rows each
    int* count;  // [1]: how many chunks were written
    int n, k, n_expert, chunk;
};

// A step's (row, slot) pairs grouped by expert on the device, for the chunked expert matvecs
// of matvec_q8.cu: what moe.rs's host grouping computes, without the round trip. Within an
// expert the pairs' order is the atomics' (each pair's result does not depend on it).
// One block of 256 threads; n_expert <= MAX_EXPERTS.
extern "C" __global__ void __launch_bounds__(256) moe_group_pairs(const MoeGroupPairs p) {
    ts_grid_begin();
    __shared__ int count[MAX_EXPERTS], start[MAX_EXPERTS], first_chunk[MAX_EXPERTS], fill[MAX_EXPERTS];
    for (int e = threadIdx.x; e < p.n_expert; e += blockDim.x) count[e] = 0, fill[e] = 0;
    __syncthreads();
    // The router writes ids below n_expert; clamped all the same, so that no write strays.
    for (int i = threadIdx.x; i < p.n; i += blockDim.x) atomicAdd(&count[min(max(p.ids[i], 0), p.n_expert - 1)], 1);
    __syncthreads();
    if (threadIdx.x < WARP) {
        // Exclusive scans of pairs and chunks over the experts: lane l takes a run of them.
        const int lane = threadIdx.x, per = (p.n_expert + WARP - 1) / WARP;
        const int e0 = min(lane * per, p.n_expert), e1 = min(e0 + per, p.n_expert);
        int pairs = 0, chunks = 0;
        for (int e = e0; e < e1; e++) pairs += count[e], chunks += (count[e] + p.chunk - 1) / p.chunk;
        int ps = pairs, cs = chunks;
        for (int o = 1; o < WARP; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, ps, o), b = __shfl_up_sync(0xffffffffu, cs, o);
            if (lane >= o) ps += a, cs += b;
        }
        ps -= pairs, cs -= chunks;
        for (int e = e0; e < e1; e++) {
            start[e] = ps, first_chunk[e] = cs;
            ps += count[e], cs += (count[e] + p.chunk - 1) / p.chunk;
        }
        if (lane == WARP - 1) *p.count = cs;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < p.n_expert; e += blockDim.x) {
        int* ch = p.chunks + 3 * first_chunk[e];
        for (int at = start[e]; at < start[e] + count[e]; at += p.chunk, ch += 3)
            ch[0] = e, ch[1] = at, ch[2] = min(p.chunk, start[e] + count[e] - at);
    }
    for (int i = threadIdx.x; i < p.n; i += blockDim.x) {
        const int e = min(max(p.ids[i], 0), p.n_expert - 1);
        const int place = start[e] + atomicAdd(&fill[e], 1);
        p.grouped[place] = i;
        p.grouped[p.n + place] = i / p.k;
        p.grouped[2 * p.n + i] = place;
    }
}

// ts_unpack_mxfp4_panels's parameters (tier.rs's UnpackMxfp4 mirrors them).
struct UnpackMxfp4 {
    ts_u8* w;  // [n_rows][row_bytes], n_rows a multiple of 16: packed in, GGUF rows out
    int row_bytes;  // 17 bytes a 32-element block
};

// An MXFP4 matrix of a VRAM expert slot copied from a host copy in the CPU's packed layout
// (ts-cpu panel.rs, pack_mxfp4: per 16-row panel and 32-element block, 272 bytes: four
// groups of the 16 rows' code dwords, dword t of row r at 64 t + 4 r, then the rows' scale
// bytes at 256 + r) put back into GGUF rows (per row and block, the scale byte, then the 16
// code bytes) in place: one panel a thread block, through 16 * row_bytes of shared memory.
extern "C" __global__ void ts_unpack_mxfp4_panels(const UnpackMxfp4 p) {
    extern __shared__ ts_u8 unpack_panel[];
    ts_grid_begin();
    ts_u8* w = p.w + (ts_u64)blockIdx.x * 16 * p.row_bytes;
    const int n = 16 * p.row_bytes;
    for (int i = threadIdx.x; i < n; i += blockDim.x) unpack_panel[i] = w[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int r = i / p.row_bytes, c = i - r * p.row_bytes, b = c / 17, j = c - b * 17;
        const ts_u8* block = unpack_panel + b * 272;
        w[i] = j == 0 ? block[256 + r] : block[64 * ((j - 1) >> 2) + 4 * r + ((j - 1) & 3)];
    }
}
