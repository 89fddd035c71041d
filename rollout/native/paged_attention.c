/* Paged attention for the CPU (fp32): every query row attends to its request's context read in
 * place from the KV pool through kv_indices, with no gathered copy of K/V and no padding.
 *
 * Layouts (rollout/attention.py's metadata): a request's queries are consecutive tokens of the
 * flat axis, its context pool slots of kv_indices in position order, the new tokens last. Query i of a
 * request of q_len queries and kv_len keys sits at position p = kv_len - q_len + i and sees
 * keys [max(0, p - window + 1), p] (window 0: all): one contiguous range, so no mask exists.
 *
 * One work item is (request, KV head): its rep = Hq / Hkv query heads read each key once (GQA),
 * and items of sibling samples, adjacent in the batch, run on the same thread one after the
 * other, so the prompt's K/V they share is read from cache rather than memory. Keys go in
 * blocks of BLOCK: scores, an online softmax (running max and sum per row), values. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define BLOCK 64

/* exp(x) for x <= 0 (scores minus their running max): Cody-Waite range reduction and a
 * degree-6 polynomial, ~2 ulp; written without library calls so the compiler vectorises it. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* Rows are taken ROWS at a time (query heads of one KV head): each key or value vector loaded
 * serves them all. With AVX2 that is 3 rows x 4 keys of score accumulators, or 3 rows x 32
 * dimensions of output accumulators: 12 of the 16 vector registers. */
#define ROWS 3

#ifdef __AVX2__
/* Sum of each of 4 vectors, as one 4-lane vector. */
static inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* s[r * BLOCK + j] = q[r] . k[j] for R rows (a constant after inlining) and 4 keys. */
static inline __attribute__((always_inline)) void scores_4keys(
        const float *q, const int R, const float *const k[4], int64_t d, float *s) {
    __m256 a[ROWS][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < 4; t++) a[r][t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 kv[4];
        for (int t = 0; t < 4; t++) kv[t] = _mm256_loadu_ps(k[t] + i);
        for (int r = 0; r < R; r++) {
            __m256 qv = _mm256_loadu_ps(q + r * d + i);
            for (int t = 0; t < 4; t++) a[r][t] = _mm256_fmadd_ps(qv, kv[t], a[r][t]);
        }
    }
    for (int r = 0; r < R; r++) _mm_storeu_ps(s + r * BLOCK, sum4(a[r][0], a[r][1], a[r][2], a[r][3]));
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
            __m256 vv[4];
            for (int t = 0; t < 4; t++) vv[t] = _mm256_loadu_ps(v[j] + c + 8 * t);
            for (int r = 0; r < R; r++) {
                __m256 pj = _mm256_set1_ps(p[r * BLOCK + j]);
                for (int t = 0; t < 4; t++) a[r][t] = _mm256_fmadd_ps(pj, vv[t], a[r][t]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int t = 0; t < 4; t++) _mm256_storeu_ps(o + r * d + c + 8 * t, a[r][t]);
    }
}
#endif

/* Scores of R <= ROWS rows against the block's n keys, into s (row stride BLOCK). */
static inline void block_scores(const float *q, int R, const float *const k[], int64_t n,
                                int64_t d, float *s) {
    int64_t j = 0;
#ifdef __AVX2__
    if (d % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            switch (R) {  /* a constant R per call keeps the accumulators in registers */
                case 3: scores_4keys(q, 3, k + j, d, s + j); break;
                case 2: scores_4keys(q, 2, k + j, d, s + j); break;
                default: scores_4keys(q, 1, k + j, d, s + j);
            }
        }
    }
#endif
    for (; j < n; j++)
        for (int r = 0; r < R; r++) s[r * BLOCK + j] = dot(q + r * d, k[j], d);
}

/* o[r] = o[r] * alpha[r] + sum_j p[r][j] v[j] for R <= ROWS rows over the block's n keys. */
static inline void block_values(float *o, const float *alpha, const float *p,
                                const float *const v[], int64_t n, int64_t d, int R) {
#ifdef __AVX2__
    if (d % 32 == 0) {
        switch (R) {
            case 3: values_32dims(o, alpha, p, v, n, d, 3); return;
            case 2: values_32dims(o, alpha, p, v, n, d, 2); return;
            default: values_32dims(o, alpha, p, v, n, d, 1); return;
        }
    }
#endif
    for (int r = 0; r < R; r++) {
        float *orow = o + r * d;
        for (int64_t i = 0; i < d; i++) orow[i] *= alpha[r];
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < d; i++) orow[i] += p[r * BLOCK + j] * v[j][i];
    }
}

/* The rep rows of one query position over keys [lo, hi) of one request's slots, in blocks of
 * BLOCK keys: scores, each row's online softmax (running max m and sum l), values. The
 * block's keys and values stay in L1 for all rep rows. */
static inline __attribute__((always_inline)) void attend_rows(
        const float *q, float scale, float softcap, const float *k_pool, const float *v_pool,
        const int32_t *slots, int64_t lo, int64_t hi, int64_t kv_row, int64_t rep,
        const int64_t d, float *out, float *qs, float *o, float *s, float *m, float *l,
        float *alpha) {
    for (int64_t r = 0; r < rep; r++) {
        for (int64_t i = 0; i < d; i++) qs[r * d + i] = q[r * d + i] * scale;
        memset(o + r * d, 0, sizeof(float) * d);
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int64_t j0 = lo; j0 < hi; j0 += BLOCK) {
        const int64_t n = hi - j0 < BLOCK ? hi - j0 : BLOCK;
        const float *k[BLOCK], *v[BLOCK];
        for (int64_t j = 0; j < n; j++) {
            k[j] = k_pool + (int64_t)slots[j0 + j] * kv_row;
            v[j] = v_pool + (int64_t)slots[j0 + j] * kv_row;
        }
        for (int64_t r = 0; r < rep; r += ROWS)
            block_scores(qs + r * d, rep - r < ROWS ? rep - r : ROWS, k, n, d, s + r * BLOCK);
        for (int64_t r = 0; r < rep; r++) {
            float *sr = s + r * BLOCK;
            if (softcap > 0.0f)  /* Gemma 2: scores (scale included) squashed before softmax */
                for (int64_t j = 0; j < n; j++) sr[j] = softcap * tanhf(sr[j] / softcap);
            float mx = m[r];
            for (int64_t j = 0; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;
            alpha[r] = m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                float p = exp_nonpositive(sr[j] - mx);
                sr[j] = p;
                sum += p;
            }
            m[r] = mx;
            l[r] = l[r] * alpha[r] + sum;
        }
        for (int64_t r = 0; r < rep; r += ROWS)
            block_values(o + r * d, alpha + r, s + r * BLOCK, v, n, d,
                         rep - r < ROWS ? rep - r : ROWS);
    }
    for (int64_t r = 0; r < rep; r++) {
        float inv = 1.0f / l[r];
        for (int64_t i = 0; i < d; i++) out[r * d + i] = o[r * d + i] * inv;
    }
}

/* attend_rows with d a constant for the common head sizes (fully unrolled d-loops). */
static void attend(const float *q, float scale, float softcap, const float *k_pool,
                   const float *v_pool, const int32_t *slots, int64_t lo, int64_t hi,
                   int64_t kv_row, int64_t rep, int64_t d, float *out, float *work) {
    float *qs = work, *o = qs + rep * d, *s = o + rep * d, *m = s + rep * BLOCK, *l = m + rep,
          *alpha = l + rep;
#define ATTEND(D) attend_rows(q, scale, softcap, k_pool, v_pool, slots, lo, hi, kv_row, rep, \
                              D, out, qs, o, s, m, l, alpha)
    switch (d) {
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(d);
    }
#undef ATTEND
}

/* Requests r < num_requests: queries q_start[r] .. + q_len[r] of the flat token axis, context
 * the slots kv_indices[kv_start[r] .. + kv_len[r]]. q [T, Hq, D] with token stride q_stride
 * (heads contiguous), out [T, Hq, D] contiguous (only the requests' rows written), k_pool and
 * v_pool [slots, Hkv, D] contiguous. */
void paged_attention_f32(const float *q, int64_t q_stride, const float *k_pool,
                         const float *v_pool, float *out, const int32_t *q_start,
                         const int32_t *q_len, const int32_t *kv_start, const int32_t *kv_len,
                         const int32_t *kv_indices, int64_t num_requests, int64_t hq,
                         int64_t hkv, int64_t d, float scale, int64_t window, float softcap,
                         int num_threads) {
    const int64_t rep = hq / hkv, items = num_requests * hkv;
#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: scaled queries, accumulators, a block of scores; max, sum and rescale
         * factor per row. */
        float work[rep * d * 2 + rep * BLOCK + rep * 3];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            int64_t req = item / hkv, h = item % hkv;
            int64_t q0 = q_start[req], nq = q_len[req], nk = kv_len[req];
            const int32_t *slots = kv_indices + kv_start[req];
            for (int64_t i = 0; i < nq; i++) {
                int64_t pos = nk - nq + i;
                int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
                attend(q + (q0 + i) * q_stride + h * rep * d, scale, softcap, k_pool + h * d,
                       v_pool + h * d, slots, lo, pos + 1, hkv * d, rep, d,
                       out + ((q0 + i) * hq + h * rep) * d, work);
            }
        }
    }
}
