// Programmatic dependent launch (sm_90 and later; device.rs launches with the stream
// serialization attribute there). A kernel may then be scheduled while the one before it on
// the stream is still running: every kernel first waits for that one's writes (griddepcontrol
// .wait), then lets the next kernel be scheduled, so that the next launch's latency is spent
// while this one runs. A kernel must not read or write memory before ts_grid_begin (a prefetch,
// a hint that binds nothing, may come first: matvec_q8.cu's TS_Q8_EARLY, whose variant 2 also
// reads what the kernel two before wrote, complete before this one can be scheduled; so may a
// read of what the host copied before the step, as decode attention's blocks without work do
// before leaving).
__device__ __forceinline__ void ts_grid_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
