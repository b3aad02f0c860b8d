// Read bandwidth of this machine's memory: sums a 1 GiB array with AVX-512 loads on
// OMP_NUM_THREADS threads, four times (docs/BENCHMARKS.md quotes it beside decode speeds).
// Build and run: gcc -O2 -fopenmp -mavx512f tools/membw.c -o /tmp/membw && OMP_NUM_THREADS=2 /tmp/membw
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
    size_t n = (size_t)1 << 28;
    float* a = aligned_alloc(64, n * 4);
    memset(a, 1, n * 4);
    for (int rep = 0; rep < 4; rep++) {
        double t = omp_get_wtime();
        float total = 0;
#pragma omp parallel reduction(+ : total)
        {
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for
            for (size_t i = 0; i < n; i += 64) {
                s0 = _mm512_add_ps(s0, _mm512_load_ps(a + i));
                s1 = _mm512_add_ps(s1, _mm512_load_ps(a + i + 16));
                s2 = _mm512_add_ps(s2, _mm512_load_ps(a + i + 32));
                s3 = _mm512_add_ps(s3, _mm512_load_ps(a + i + 48));
            }
            total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        }
        t = omp_get_wtime() - t;
        printf("read %.1f GB/s (checksum %g)\n", n * 4 / t / 1e9, total);
    }
    free(a);
    return 0;
}
