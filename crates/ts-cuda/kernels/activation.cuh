// Activations shared by the fused MoE kernel (matmul.cu, which includes this
// file) and the element-wise kernels (ops.cu, compiled after it); each mirrors
// ts-cpu's ops.rs.
#ifndef TS_ACTIVATION_CUH
#define TS_ACTIVATION_CUH

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// act(gate, up): kind 0 SwiGLU, 1 GeGLU (tanh approximation), 2 gpt-oss's clamped SwiGLU.
__device__ __forceinline__ float ts_gated(int kind, float g, float u, float alpha, float limit) {
    if (kind == 0) return g * sigmoidf(g) * u;
    if (kind == 1) {
        float t = tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g));
        return 0.5f * g * (1.0f + t) * u;
    }
    float x = fminf(g, limit);
    float v = fminf(fmaxf(u, -limit), limit);
    return x * sigmoidf(alpha * x) * (v + 1.0f);
}

#endif
