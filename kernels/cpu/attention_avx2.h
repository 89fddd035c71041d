/* The AVX2 + FMA part of paged_attention.c's score and value loops: register blocking over a
 * block's keys for the rows of a work item (included by paged_attention.c after ROWS and
 * WIDE_ROWS; static inline, so it is compiled there, under that file's flags). */
#if defined(__AVX2__) && defined(__FMA__)
/* A vector loaded once and used by several FMAs stays in its register: left to itself GCC folds
 * the load into every FMA that uses it, and the repeated loads, not the FMAs, then bound the
 * loop (a third slower on Zen 3). */
#define IN_REGISTER(x) __asm__("" : "+x"(x))

/* Sum of each of 4 vectors, as one 4-lane vector. */
static inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* q . k summed as scores_keys sums each of its scores (8 lanes of FMAs over d, then sum4's
 * tree), for the keys a block's register tiles leave over: so a score's bits do not depend on
 * which rows or keys shared its tile (the batch-invariant mode relies on it). */
static inline float dot_lanes(const float *q, const float *k, int64_t d) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
    const __m256 zero = _mm256_setzero_ps();
    return _mm_cvtss_f32(sum4(a, zero, zero, zero));
}

/* s[r * BLOCK + j] = q[r] . k[j] for R rows and K keys (constants after inlining): R x K
 * accumulators and the R query and K key vectors of a step all in registers (3 x 3 or 2 x 4:
 * 15 or 14 of 16; 3 x 4 would spill). */
static inline __attribute__((always_inline)) void scores_keys(
        const float *q, const int R, const float *const k[], int64_t d, const int K, float *s) {
    __m256 a[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++) a[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 kv[4], qv[ROWS];
        for (int t = 0; t < K; t++) {
            kv[t] = _mm256_loadu_ps(k[t] + i);
            IN_REGISTER(kv[t]);
        }
        for (int r = 0; r < R; r++) {
            qv[r] = _mm256_loadu_ps(q + r * d + i);
            IN_REGISTER(qv[r]);
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < K; t++) a[r][t] = _mm256_fmadd_ps(qv[r], kv[t], a[r][t]);
    }
    const __m128i first3 = _mm_setr_epi32(-1, -1, -1, 0);
    for (int r = 0; r < R; r++) {
        const __m128 sums = sum4(a[r][0], a[r][1], a[r][2], a[r][3]);
        if (K == 4) _mm_storeu_ps(s + r * BLOCK, sums);
        else _mm_maskstore_ps(s + r * BLOCK, first3, sums);  /* a[r][3] is zero */
    }
}

/* o[r] = o[r] * alpha[r] + sum_j p[r * BLOCK + j] v[j] for R rows, 32 dimensions at a time
 * held in registers across all n keys. */
static inline __attribute__((always_inline)) void values_32dims(
        float *o, const float *alpha, const float *p, const float *const v[], int64_t n,
        int64_t d, const int R) {
    for (int64_t c = 0; c < d; c += 32) {
        __m256 a[ROWS][4];
        for (int r = 0; r < R; r++) {
            __m256 scale = _mm256_set1_ps(alpha[r]);
            for (int t = 0; t < 4; t++)
                a[r][t] = _mm256_mul_ps(_mm256_loadu_ps(o + r * d + c + 8 * t), scale);
        }
        for (int64_t j = 0; j < n; j++) {
            /* 12 accumulators, R broadcasts and one value vector: 16 registers. Holding all 4
             * value vectors instead needs 17, and the one accumulator spilled to the stack
             * serialises the loop on store-to-load forwarding (3x slower). */
            __m256 pj[ROWS];
            for (int r = 0; r < R; r++) pj[r] = _mm256_broadcast_ss(p + r * BLOCK + j);
            for (int t = 0; t < 4; t++) {
                __m256 vv = _mm256_loadu_ps(v[j] + c + 8 * t);
                IN_REGISTER(vv);
                for (int r = 0; r < R; r++) a[r][t] = _mm256_fmadd_ps(pj[r], vv, a[r][t]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < 4; t++) _mm256_storeu_ps(o + r * d + c + 8 * t, a[r][t]);
    }
}

/* kt[i * BLOCK + j] = k[j][i] for the block's n keys, columns n .. up to a multiple of 8 zero:
 * the keys on the lanes, so that many rows' scores need no horizontal sums. 8 x 8 tiles. */
static inline void transpose_block(const float *const k[], int64_t n, int64_t d, float *kt) {
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        for (int64_t i0 = 0; i0 < d; i0 += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++)
                r[t] = j0 + t < n ? _mm256_loadu_ps(k[j0 + t] + i0) : _mm256_setzero_ps();
            __m256 a[8], b[8];
            for (int t = 0; t < 8; t += 2) {
                a[t] = _mm256_unpacklo_ps(r[t], r[t + 1]);
                a[t + 1] = _mm256_unpackhi_ps(r[t], r[t + 1]);
            }
            for (int t = 0; t < 8; t += 4) {
                b[t] = _mm256_shuffle_ps(a[t], a[t + 2], 0x44);
                b[t + 1] = _mm256_shuffle_ps(a[t], a[t + 2], 0xEE);
                b[t + 2] = _mm256_shuffle_ps(a[t + 1], a[t + 3], 0x44);
                b[t + 3] = _mm256_shuffle_ps(a[t + 1], a[t + 3], 0xEE);
            }
            for (int t = 0; t < 4; t++) {
                _mm256_storeu_ps(kt + (i0 + t) * BLOCK + j0,
                                 _mm256_permute2f128_ps(b[t], b[t + 4], 0x20));
                _mm256_storeu_ps(kt + (i0 + t + 4) * BLOCK + j0,
                                 _mm256_permute2f128_ps(b[t], b[t + 4], 0x31));
            }
        }
    }
}

/* s[r * BLOCK + 8 t ..] = q[r] . keys 8 t .. 8 t + 7 of kt, for R <= 4 rows and V <= 3 vectors
 * of keys (constants after inlining): R x V accumulators, V key vectors and a broadcast query
 * element, 16 registers at most, so nothing is reloaded within an element's FMAs. */
static inline __attribute__((always_inline)) void scores_on_lanes(
        const float *q, const int R, const float *kt, int64_t d, const int V, float *s) {
    __m256 a[4][3];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < V; t++) a[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
        __m256 kv[3];
        for (int t = 0; t < V; t++) {
            kv[t] = _mm256_loadu_ps(kt + i * BLOCK + 8 * t);
            IN_REGISTER(kv[t]);
        }
        for (int r = 0; r < R; r++) {
            const __m256 qb = _mm256_broadcast_ss(q + r * d + i);
            for (int t = 0; t < V; t++) a[r][t] = _mm256_fmadd_ps(qb, kv[t], a[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < V; t++) _mm256_storeu_ps(s + r * BLOCK + 8 * t, a[r][t]);
}

/* Scores of R rows (any number) against the transposed block kt of n keys, into s: 4 rows by
 * 3 key vectors at a time. */
static inline void block_scores_on_lanes(const float *q, int64_t R, const float *kt, int64_t n,
                                         int64_t d, float *s) {
    const int64_t vectors = (n + 7) / 8;
    for (int64_t r = 0; r < R; r += 4) {
        const int64_t rows = R - r < 4 ? R - r : 4;
        for (int64_t t = 0; t < vectors; t += 3) {
            const int64_t v = vectors - t < 3 ? vectors - t : 3;
            const float *qr = q + r * d, *kv = kt + 8 * t;
            float *sr = s + r * BLOCK + 8 * t;
            switch (rows * 4 + v) {  /* constant shapes keep the accumulators in registers */
#define SHAPE(RR, VV) case RR * 4 + VV: scores_on_lanes(qr, RR, kv, d, VV, sr); break
                SHAPE(4, 3); SHAPE(4, 2); SHAPE(4, 1);
                SHAPE(3, 3); SHAPE(3, 2); SHAPE(3, 1);
                SHAPE(2, 3); SHAPE(2, 2); SHAPE(2, 1);
                SHAPE(1, 3); SHAPE(1, 2); default: SHAPE(1, 1);
#undef SHAPE
            }
        }
    }
}
#endif
