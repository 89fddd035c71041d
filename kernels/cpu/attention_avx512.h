/* The wide path of paged_attention.c (a shared prefix's keys on the lanes, WIDE_ROWS rows or
 * more) in 16-lane vectors, for cores that issue two 512-bit FMAs a cycle: there the AVX2
 * loops use half of the FMA width (the prompt part ran at 125-136 GFLOP/s on an Intel Xeon
 * whose two cores issue ~500, docs/benchmarks.md). A Zen 4 splits each 512-bit FMA in two
 * 256-bit halves, so it keeps the AVX2 loops (GCC 12 calls it znver3 with AVX-512).
 *
 * The same bits as the AVX2 loops: a score is one chain of FMAs over the dimensions from zero
 * in its own lane, an output element one chain over the keys from o * alpha, whatever the
 * vector width or the rows sharing a tile (tests/kernels/test_attention_isa.py). Included by
 * paged_attention.c after attention_avx2.h. */
#if defined(__AVX512F__) && !defined(ATTENTION_512)  /* a build may set it, to compare */
#if defined(__znver4__) || defined(__znver3__)
#define ATTENTION_512 0
#else
#define ATTENTION_512 1
#endif
#endif
#if defined(__AVX512F__) && ATTENTION_512
#define WIDE_512 1
#define IN_ZMM(x) __asm__("" : "+v"(x))

/* The lanes of a block's 16-key vector t that hold keys (n keys in all). */
static inline __mmask16 keys_mask(int64_t n, int t) {
    const int64_t left = n - 16 * t;
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* s[r * BLOCK + 16 t ..] = q[r] . keys 16 t .. 16 t + 15 of kt for R <= 6 rows and V <= 4
 * vectors of keys (constants after inlining; the last vector's lanes past n neither read nor
 * written): 24 accumulators, 4 key vectors and a broadcast, 29 of the 32 registers. */
static inline __attribute__((always_inline)) void scores_on_lanes_512(
        const float *q, const int R, const float *kt, int64_t d, const int V, int64_t n,
        float *s) {
    __m512 a[6][4];
    __mmask16 mask[4];
    for (int t = 0; t < V; t++) mask[t] = keys_mask(n, t);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < V; t++) a[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
        __m512 kv[4];
        for (int t = 0; t < V; t++) {
            kv[t] = _mm512_maskz_loadu_ps(mask[t], kt + i * BLOCK + 16 * t);
            IN_ZMM(kv[t]);
        }
        for (int r = 0; r < R; r++) {
            const __m512 qb = _mm512_set1_ps(q[r * d + i]);
            for (int t = 0; t < V; t++) a[r][t] = _mm512_fmadd_ps(qb, kv[t], a[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < V; t++) _mm512_mask_storeu_ps(s + r * BLOCK + 16 * t, mask[t], a[r][t]);
}

/* Scores of R rows (any number) against the transposed block kt of n keys, into s: 6 rows by
 * the block's key vectors at a time. */
static inline void block_scores_on_lanes_512(const float *q, int64_t R, const float *kt,
                                             int64_t n, int64_t d, float *s) {
    const int V = (int)((n + 15) / 16);
    for (int64_t r = 0; r < R; r += 6) {
        const int rows = R - r < 6 ? (int)(R - r) : 6;
        const float *qr = q + r * d;
        float *sr = s + r * BLOCK;
        switch (rows * 8 + V) {  /* constant shapes keep the accumulators in registers */
#define SHAPE(RR, VV) case RR * 8 + VV: scores_on_lanes_512(qr, RR, kt, d, VV, n, sr); break
#define SHAPES(RR) SHAPE(RR, 4); SHAPE(RR, 3); SHAPE(RR, 2); SHAPE(RR, 1)
            SHAPES(6); SHAPES(5); SHAPES(4); SHAPES(3); SHAPES(2);
            SHAPE(1, 4); SHAPE(1, 3); SHAPE(1, 2); default: SHAPE(1, 1);
#undef SHAPES
#undef SHAPE
        }
    }
}

/* o[r] = o[r] * alpha[r] + sum_j p[r * BLOCK + j] v[j] for R <= 4 rows (a constant after
 * inlining), 64 dimensions at a time held in registers across all n keys: 16 accumulators, R
 * broadcasts and a value vector. */
static inline __attribute__((always_inline)) void values_64dims_512(
        float *o, const float *alpha, const float *p, const float *const v[], int64_t n,
        int64_t d, const int R) {
    for (int64_t c = 0; c < d; c += 64) {
        __m512 a[4][4];
        for (int r = 0; r < R; r++) {
            const __m512 scale = _mm512_set1_ps(alpha[r]);
            for (int t = 0; t < 4; t++)
                a[r][t] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c + 16 * t), scale);
        }
        for (int64_t j = 0; j < n; j++) {
            __m512 pj[4];
            for (int r = 0; r < R; r++) pj[r] = _mm512_set1_ps(p[r * BLOCK + j]);
            for (int t = 0; t < 4; t++) {
                __m512 vv = _mm512_loadu_ps(v[j] + c + 16 * t);
                IN_ZMM(vv);
                for (int r = 0; r < R; r++) a[r][t] = _mm512_fmadd_ps(pj[r], vv, a[r][t]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < 4; t++) _mm512_storeu_ps(o + r * d + c + 16 * t, a[r][t]);
    }
}

/* values_64dims_512 for R rows (any number), 4 at a time; d a multiple of 64. */
static inline void block_values_512(float *o, const float *alpha, const float *p,
                                    const float *const v[], int64_t n, int64_t d, int64_t R) {
    for (int64_t r = 0; r < R; r += 4) {
        float *orow = o + r * d;
        const float *ar = alpha + r, *pr = p + r * BLOCK;
        switch (R - r < 4 ? R - r : 4) {
            case 4: values_64dims_512(orow, ar, pr, v, n, d, 4); break;
            case 3: values_64dims_512(orow, ar, pr, v, n, d, 3); break;
            case 2: values_64dims_512(orow, ar, pr, v, n, d, 2); break;
            default: values_64dims_512(orow, ar, pr, v, n, d, 1); break;
        }
    }
}
#endif
