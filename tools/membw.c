// Read bandwidth of this machine's memory: sums an array (1 GiB, or the MiB given as the first
// argument: a model's bytes a token, to see what the caches give a set of that size) with
// AVX-512 loads (AVX2 where the build has no AVX-512) on OMP_NUM_THREADS threads, four times
// after one untimed pass (docs/BENCHMARKS.md quotes it beside decode speeds).
// Build and run: gcc -O2 -fopenmp -march=native tools/membw.c -o /tmp/membw && OMP_NUM_THREADS=2 /tmp/membw [MIB]
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX512F__
typedef __m512 vec;
#define WIDTH 16
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vload _mm512_load_ps
static float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef __m256 vec;
#define WIDTH 8
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vload _mm256_load_ps
static float vsum(vec v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#endif

int main(int argc, char** argv) {
    size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 1024;
    if (mib == 0) mib = 1024;
    // Whole passes of four vectors a turn.
    size_t n = mib << 18;
    float* a = aligned_alloc(64, n * 4);
    memset(a, 1, n * 4);
    for (int rep = -1; rep < 4; rep++) {
        double t = omp_get_wtime();
        float total = 0;
#pragma omp parallel reduction(+ : total)
        {
            vec s0 = vzero(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for
            for (size_t i = 0; i < n; i += 4 * WIDTH) {
                s0 = vadd(s0, vload(a + i));
                s1 = vadd(s1, vload(a + i + WIDTH));
                s2 = vadd(s2, vload(a + i + 2 * WIDTH));
                s3 = vadd(s3, vload(a + i + 3 * WIDTH));
            }
            total += vsum(vadd(vadd(s0, s1), vadd(s2, s3)));
        }
        t = omp_get_wtime() - t;
        if (rep >= 0) printf("read %.1f GB/s (checksum %g)\n", n * 4 / t / 1e9, total);
    }
    free(a);
    return 0;
}
