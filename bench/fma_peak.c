/* The FMA peak of this CPU (fp32), the limit bench/decode_step.py measures the decode matmuls
 * against: every thread runs 12 independent chains of vector FMAs (more than the FMA latency
 * times the pipes, so they never wait) for `iters` rounds, with the widest vectors the build
 * has. Returns the FLOPs done; the caller times the call. */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS 12

int fma_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 0;
#endif
}

double fma_flops(int64_t iters, int num_threads) {
    double flops = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : flops)
    {
#if defined(__AVX512F__)
        __m512 a[CHAINS];
        const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-7f);
        for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < CHAINS; i++) a[i] = _mm512_fmadd_ps(a[i], b, c);
        __m512 sum = a[0];
        for (int i = 1; i < CHAINS; i++) sum = _mm512_add_ps(sum, a[i]);
        volatile float keep = _mm512_reduce_add_ps(sum);  /* the chains are not dead code */
        (void)keep;
        flops += 2.0 * 16 * CHAINS * iters;
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 a[CHAINS];
        const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-7f);
        for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < CHAINS; i++) a[i] = _mm256_fmadd_ps(a[i], b, c);
        float out[8];
        __m256 sum = a[0];
        for (int i = 1; i < CHAINS; i++) sum = _mm256_add_ps(sum, a[i]);
        _mm256_storeu_ps(out, sum);
        volatile float keep = out[0];
        (void)keep;
        flops += 2.0 * 8 * CHAINS * iters;
#endif
    }
    return flops;
}
