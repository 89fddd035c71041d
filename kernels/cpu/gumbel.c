/* Gumbel-max sampling over [rows, vocab] candidates with the counter noise of
 * rollout/sample/noise.py: the token of row r is the first argmax over t of
 *     s[t] = cand[t] + G(u[t]),   G(u) = -log(-log(u)),   u[t] from hash(key[r] ^ hash(t)),
 * the same tokens as the torch path bit for bit, at a fraction of its twenty-odd passes over
 * [rows, vocab].
 *
 * Torch's float32 `log` on the CPU is MKL's vmsLn. Calling it on every token would cost two
 * logarithms a token; instead each row goes twice over its tokens:
 *  1. s^[t] = cand[t] + G^(u[t]) with G^ a vectorised approximation, and its maximum M^;
 *  2. only tokens with s^[t] >= M^ - tol get the exact s[t] (vmsLn, handed in as `vlog` with
 *     torch's mode), and the first maximal exact s wins.
 * With b >= |G^(u) - G(u)| for every u (u takes only 2^23 values: gumbel.py measures b over all
 * of them at load, with this file's own code) and tol = 2b + two roundings, the exact winner's
 * s^ is within tol of M^, so it is among the tokens checked, and so is every token tying it.
 * Typically one token per row gets the exact noise. A NaN candidate wins at once, as in
 * torch.argmax. Needs AVX2 (gumbel.py falls back to torch without it). */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef void (*vlog_fn)(int n, const float *a, float *r, int64_t mode);

#define CHUNK 1024

/* Only with AVX2 and FMA: without them this file defines nothing, and the sampler's torch path
 * runs (kernels/cpu/__init__.py binds each entry point on its own). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* lowbias32 (counter_noise.mix32) on 8 lanes */
static inline __m256i mix32_8(__m256i x) {
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int32_t)0x846CA68Bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* The top 23 bits of a hash as a uniform (m + 0.5) / 2^23: exact in float. */
static inline __m256 uniform_8(__m256i h) {
    __m256i m = _mm256_and_si256(_mm256_srli_epi32(h, 9), _mm256_set1_epi32(0x7FFFFF));
    return _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0.5f)),
                         _mm256_set1_ps(1.0f / 8388608.0f));
}

/* log(x) for normal x > 0 to ~1e-7 relative: x = 2^e m with m in [sqrt(1/2), sqrt(2)), then
 * log m = 2 atanh(f / (2 + f)), f = m - 1, by its odd series to s^9. */
static inline __m256 approx_log_8(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(0x3F800000)));
    __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_sub_epi32(e, _mm256_castps_si256(big));  /* big lanes are -1 */
    __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
    __m256 s = _mm256_div_ps(f, _mm256_add_ps(f, _mm256_set1_ps(2.0f)));
    __m256 s2 = _mm256_mul_ps(s, s);
    __m256 p = _mm256_set1_ps(2.0f / 9.0f);
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(2.0f / 7.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(2.0f / 5.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(2.0f / 3.0f));
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(2.0f));
    __m256 ef = _mm256_cvtepi32_ps(e);
    /* e ln 2 in two parts (the high one exact for |e| < 2^11) */
    __m256 r = _mm256_fmadd_ps(ef, _mm256_set1_ps(-2.12194440e-4f), _mm256_mul_ps(p, s));
    return _mm256_fmadd_ps(ef, _mm256_set1_ps(0.693359375f), r);
}

static inline __m256 approx_gumbel_8(__m256 u) {
    __m256 neg = _mm256_set1_ps(-0.0f);
    return _mm256_xor_ps(approx_log_8(_mm256_xor_ps(approx_log_8(u), neg)), neg);
}

static inline __m256i tokens_8(int64_t t) {
    return _mm256_add_epi32(_mm256_set1_epi32((int32_t)t), _mm256_setr_epi32(0, 1, 2, 3, 4, 5,
                                                                               6, 7));
}

/* The hash bits of tokens t .. t + 7 of the row with this key: the token mixed before the key
 * (noise.token_bits says why). */
static inline __m256i token_bits_8(uint32_t key, int64_t t) {
    return mix32_8(_mm256_xor_si256(_mm256_set1_epi32((int32_t)key), mix32_8(tokens_8(t))));
}

/* Vectors of tokens whose noise is computed side by side: one vector's noise is a chain of some
 * 150 cycles of dependent operations (the hash's multiplies, two divisions, two polynomials),
 * longer than the out-of-order window overlaps with the next vectors', so one vector at a time
 * left the cores mostly waiting; UNROLL chains interleaved stage by stage keep the units busy
 * (bench/sampling.py; docs/benchmarks.md). Each chain's lanes are computed as before: the same
 * bits. */
#define UNROLL 8

/* s^ for tokens t0 .. t0 + n of a row (n <= CHUNK; lanes past n read -inf), into s. */
static inline void approx_scores(const float *c, uint32_t key, int64_t t0, int n, float *s) {
    int i = 0;
    for (; i + 8 * UNROLL <= n; i += 8 * UNROLL) {
        __m256 g[UNROLL];
        for (int u = 0; u < UNROLL; u++)
            g[u] = uniform_8(token_bits_8(key, t0 + i + 8 * u));
        for (int u = 0; u < UNROLL; u++)
            g[u] = _mm256_xor_ps(approx_log_8(g[u]), _mm256_set1_ps(-0.0f));
        for (int u = 0; u < UNROLL; u++)
            g[u] = _mm256_xor_ps(approx_log_8(g[u]), _mm256_set1_ps(-0.0f));
        for (int u = 0; u < UNROLL; u++)
            _mm256_storeu_ps(s + i + 8 * u,
                             _mm256_add_ps(_mm256_loadu_ps(c + t0 + i + 8 * u), g[u]));
    }
    for (; i < n; i += 8) {
        __m256 cv;
        if (i + 8 <= n) {
            cv = _mm256_loadu_ps(c + t0 + i);
        } else {
            float tail[8];
            for (int j = 0; j < 8; j++) tail[j] = i + j < n ? c[t0 + i + j] : -INFINITY;
            cv = _mm256_loadu_ps(tail);
        }
        _mm256_storeu_ps(s + i, _mm256_add_ps(cv, approx_gumbel_8(uniform_8(token_bits_8(
            key, t0 + i)))));
    }
}

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

/* The exact noise of one token, as torch computes it. */
static inline float exact_gumbel(uint32_t key, int64_t t, vlog_fn vlog, int64_t mode) {
    uint32_t h = mix32(key ^ mix32((uint32_t)t));
    float u = ((float)((h >> 9) & 0x7FFFFFu) + 0.5f) * (1.0f / 8388608.0f), l, x;
    vlog(1, &u, &l, mode);
    x = -l;
    vlog(1, &x, &l, mode);
    return -l;
}

/* Row r: its token, given the scores' bound b. */
static int64_t row_argmax(const float *c, int64_t vocab, uint32_t key, float bound, vlog_fn vlog,
                          int64_t mode) {
    float s[CHUNK], chunk_max[(vocab + CHUNK - 1) / CHUNK];
    __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (int64_t t0 = 0, k = 0; t0 < vocab; t0 += CHUNK, k++) {
        const int n = vocab - t0 < CHUNK ? (int)(vocab - t0) : CHUNK;
        __m256 cm = _mm256_set1_ps(-INFINITY);
        approx_scores(c, key, t0, n, s);
        for (int i = 0; i < n; i += 8) {  /* the padded lanes hold -inf */
            __m256 v = _mm256_loadu_ps(s + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            cm = _mm256_max_ps(cm, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, cm);
        chunk_max[k] = lanes[0];
        for (int j = 1; j < 8; j++) chunk_max[k] = fmaxf(chunk_max[k], lanes[j]);
        mx = _mm256_max_ps(mx, cm);
    }
    if (_mm256_movemask_ps(nan)) {  /* s^ is NaN exactly where the candidate is */
        for (int64_t t = 0; t < vocab; t++)
            if (c[t] != c[t]) return t;
    }
    float lanes[8], top;
    _mm256_storeu_ps(lanes, mx);
    top = lanes[0];
    for (int j = 1; j < 8; j++) top = fmaxf(top, lanes[j]);
    /* Non-finite maxima (every candidate -inf) take the exact score of every token. */
    const float floor = isfinite(top) ? top - (2.0f * bound + (fabsf(top) + 1.0f) * 0x1p-20f)
                                      : -INFINITY;
    float best = 0.0f;
    int64_t best_at = -1;
    for (int64_t t0 = 0, k = 0; t0 < vocab; t0 += CHUNK, k++) {
        if (chunk_max[k] < floor) continue;
        const int n = vocab - t0 < CHUNK ? (int)(vocab - t0) : CHUNK;
        approx_scores(c, key, t0, n, s);
        for (int i = 0; i < n; i++) {
            if (s[i] < floor) continue;
            float exact = c[t0 + i] + exact_gumbel(key, t0 + i, vlog, mode);
            if (best_at < 0 || exact > best) {
                best = exact;
                best_at = t0 + i;
            }
        }
    }
    return best_at;
}

/* keys[r]: counter_noise.row_keys of row r; cand rows with stride row_stride. */
void gumbel_argmax_f32(const float *cand, int64_t rows, int64_t vocab, int64_t row_stride,
                       const int32_t *keys, float bound, int64_t *tokens, vlog_fn vlog,
                       int64_t mode, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++)
        tokens[r] = row_argmax(cand + r * row_stride, vocab, (uint32_t)keys[r], bound, vlog,
                               mode);
}

/* For the bound: G^ and the exact G of every uniform u_m = (m + 0.5) / 2^23, m < 2^23,
 * through the kernel's own code (approx) and vmsLn (exact). */
void gumbel_all_uniforms(float *approx, float *exact, vlog_fn vlog, int64_t mode) {
    const int64_t n = 1 << 23;
    for (int64_t m = 0; m < n; m += 8) {
        __m256 u = uniform_8(_mm256_slli_epi32(tokens_8(m), 9));
        _mm256_storeu_ps(approx + m, approx_gumbel_8(u));
        _mm256_storeu_ps(exact + m, u);
    }
    for (int64_t m = 0; m < n; m += CHUNK) {
        float l[CHUNK];
        vlog(CHUNK, exact + m, l, mode);
        for (int i = 0; i < CHUNK; i++) l[i] = -l[i];
        vlog(CHUNK, l, exact + m, mode);
        for (int i = 0; i < CHUNK; i++) exact[m + i] = -exact[m + i];
    }
}
#endif
