/* Paged attention for the CPU (fp32): every query row attends to its request's context read in
 * place from the KV pool through kv_indices, with no gathered copy of K/V and no padding.
 *
 * Layouts (rollout/attention/sdpa.py's metadata): a request's queries are consecutive tokens of the
 * flat axis, its context pool slots of kv_indices in position order, the new tokens last. Query
 * i of a request of q_len queries and kv_len keys sits at position p = kv_len - q_len + i and
 * sees keys [max(0, p - window + 1), p] (window 0: all): one contiguous range, so no mask.
 *
 * One work item is a chunk of consecutive requests (plan_chunks): the slots they all begin
 * with (a prompt its samples share, a system prompt every request starts with) are read once
 * per KV head for all their rows, so each key loaded serves the query heads of every query of
 * the chunk (GQA x siblings); then each query goes on alone over the rest of its context. Keys go in blocks of BLOCK: scores, an online softmax (running max and sum per
 * row), values. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define BLOCK 64

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
/* From this many rows a block's keys are transposed once (keys on the lanes) for all of them:
 * their scores then need no horizontal sums. */
#define WIDE_ROWS 12

#include "attention_avx2.h"
#include "attention_avx512.h"

/* A decode's own keys (the private suffix) sit in runs of consecutive slots at best
 * (KVManager.alloc_decodes), one token of each sample after the other at worst, and each
 * KV head's part of a slot is a fraction of its row: the hardware prefetchers follow little of
 * it, and the suffixes were read at half the memory's bandwidth. While a block's scores run,
 * the key and value rows AHEAD keys further on are asked for, into L2 (prefetcht2; t1 the
 * same): on a Zen 4 the suffixes' K/V then come at 23-28 GB/s instead of 16-18
 * (bench/attention_kernel.py; the cores stream 33). Into L1 (prefetcht0) they came no faster
 * than without: the L1's few outstanding misses, not the distance, were the limit. A build
 * may set the distance (-DAHEAD=n; past every context it asks for nothing), to compare. */
#ifndef AHEAD
#define AHEAD 32
#endif

static inline __attribute__((always_inline)) void prefetch_row(const float *p, int64_t d) {
    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(p + i, 0, 1);
}

/* The rows of keys t in [j, j + keys) of the block AHEAD keys on (ka, va: na of them). Inlined
 * (d a constant): as a call it asked for nothing faster than no prefetch at all. */
static inline __attribute__((always_inline)) void prefetch_ahead(
        const float *const ka[], const float *const va[], int64_t na, int64_t j, int64_t keys,
        int64_t d) {
    for (int64_t t = j; t < j + keys && t < na; t++) {
        prefetch_row(ka[t], d);
        prefetch_row(va[t], d);
    }
}

/* Scores of R <= ROWS rows against the block's n keys, into s (row stride BLOCK); the keys and
 * values AHEAD on (ka, va) are asked for meanwhile. */
static inline void block_scores(const float *q, int R, const float *const k[],
                                const float *const ka[], const float *const va[], int64_t na,
                                int64_t n, int64_t d, float *s) {
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        /* constant shapes per call keep the accumulators in registers */
        if (R == 3)
            for (; j + 3 <= n; j += 3) {
                prefetch_ahead(ka, va, na, j, 3, d);
                scores_keys(q, 3, k + j, d, 3, s + j);
            }
        else
            for (; j + 4 <= n; j += 4) {
                prefetch_ahead(ka, va, na, j, 4, d);
                if (R == 2) scores_keys(q, 2, k + j, d, 4, s + j);
                else scores_keys(q, 1, k + j, d, 4, s + j);
            }
    }
    if (d % 8 == 0) {
        for (; j < n; j++)
            for (int r = 0; r < R; r++) s[r * BLOCK + j] = dot_lanes(q + r * d, k[j], d);
        return;
    }
#endif
    for (; j < n; j++)
        for (int r = 0; r < R; r++) s[r * BLOCK + j] = dot(q + r * d, k[j], d);
}

/* o[r] = o[r] * alpha[r] + sum_j p[r][j] v[j] for R <= ROWS rows over the block's n keys. */
static inline void block_values(float *o, const float *alpha, const float *p,
                                const float *const v[], int64_t n, int64_t d, int R) {
#if defined(__AVX2__) && defined(__FMA__)
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

/* Rows r < R (scaled queries qs, accumulators o, running max m and sum l) over keys [lo, hi)
 * of `slots`, in blocks of BLOCK keys: scores, each row's online softmax, values. The block's
 * keys and values stay in L1 for all R rows: R is the query heads of a KV head of one query,
 * or of every query of a chunk of requests over the prefix they share. */
static inline __attribute__((always_inline)) void attend_range(
        const float *qs, int64_t R, float softcap, const float *k_pool, const float *v_pool,
        const int32_t *slots, int64_t lo, int64_t hi, int64_t kv_row, const int64_t d,
        float *o, float *s, float *m, float *l, float *alpha, float *kt) {
    for (int64_t j0 = lo; j0 < hi; j0 += BLOCK) {
        const int64_t n = hi - j0 < BLOCK ? hi - j0 : BLOCK;
        /* the keys AHEAD on, asked for by the narrow path (the wide one's prefix is
         * compute-bound: no prefetch changed it) */
        const int64_t a0 = j0 + AHEAD,
                      na = kt != NULL || hi - a0 < 0 ? 0 : hi - a0 < BLOCK ? hi - a0 : BLOCK;
        const float *k[BLOCK], *v[BLOCK], *ka[BLOCK], *va[BLOCK];
        for (int64_t j = 0; j < n; j++) {
            k[j] = k_pool + (int64_t)slots[j0 + j] * kv_row;
            v[j] = v_pool + (int64_t)slots[j0 + j] * kv_row;
        }
        for (int64_t j = 0; j < na; j++) {
            ka[j] = k_pool + (int64_t)slots[a0 + j] * kv_row;
            va[j] = v_pool + (int64_t)slots[a0 + j] * kv_row;
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (kt != NULL) {
            transpose_block(k, n, d, kt);
#ifdef WIDE_512
            block_scores_on_lanes_512(qs, R, kt, n, d, s);
#else
            block_scores_on_lanes(qs, R, kt, n, d, s);
#endif
        } else
#endif
            for (int64_t r = 0; r < R; r += ROWS)
                block_scores(qs + r * d, R - r < ROWS ? R - r : ROWS, k, ka, va,
                             r == 0 ? na : 0, n, d, s + r * BLOCK);  /* asked for once */
        for (int64_t r = 0; r < R; r++) {
            float *sr = s + r * BLOCK;
            if (softcap > 0.0f)  /* Gemma 2: scores (scale included) squashed before softmax */
                for (int64_t j = 0; j < n; j++) sr[j] = softcap * tanhf(sr[j] / softcap);
            float mx = m[r];
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < n; j++) mx = sr[j] > mx ? sr[j] : mx;
            alpha[r] = m[r] == -INFINITY ? 0.0f : exp_approx(m[r] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                float p = exp_approx(sr[j] - mx);
                sr[j] = p;
                sum += p;
            }
            m[r] = mx;
            l[r] = l[r] * alpha[r] + sum;
        }
#ifdef WIDE_512
        if (kt != NULL && d % 64 == 0) {
            block_values_512(o, alpha, s, v, n, d, R);
            continue;
        }
#endif
        for (int64_t r = 0; r < R; r += ROWS)
            block_values(o + r * d, alpha + r, s + r * BLOCK, v, n, d,
                         R - r < ROWS ? R - r : ROWS);
    }
}

/* Per-request arguments of a step (see paged_attention_f32). */
typedef struct {
    const int32_t *q_start, *q_len, *kv_start, *kv_len, *kv_indices;
} Requests;

/* Requests first .. first + count of one chunk: every query's Hq rows, KV-head-major, then
 * member-major, query-major. The chunk's `prefix` slots, the same for all of them and seen
 * whole by every row, are read once per KV head for all its rows; then each query's rows go
 * on over the rest of its own context (keys [max(lo, prefix), pos], lo the window's first),
 * their running softmax state carried over, every KV head of a key read one after the other
 * (one pool row). */
static inline __attribute__((always_inline)) void attend_chunk(
        const float *q, int64_t q_stride, float scale, float softcap, const float *k_pool,
        const float *v_pool, float *out, Requests rq, int64_t first, int64_t count,
        int64_t prefix, int64_t hq, int64_t hkv, const int64_t d, int64_t window, float *work,
        int64_t max_rows, int invariant) {
    const int64_t rep = hq / hkv, kv_row = hkv * d;
    float *qs = work, *o = qs + max_rows * d, *s = o + max_rows * d, *m = s + max_rows * BLOCK,
          *l = m + max_rows, *alpha = l + max_rows, *kt = alpha + max_rows;
    int64_t R = 0;  /* rows per KV head */
    for (int64_t req = first; req < first + count; req++) {
        R += rq.q_len[req] * rep;
        /* A window that starts past the first key leaves the prefix to each row. */
        if (window > 0 && rq.kv_len[req] > window) prefix = 0;
    }
    /* Batch-invariant: a row's key blocks start at multiples of BLOCK whether or not it shares
     * a prefix, and every row's scores take the same tiles, so its online softmax rounds alike
     * alone and in any chunk. */
    if (invariant) prefix -= prefix % BLOCK;
    for (int64_t h = 0, row = 0; h < hkv; h++) {
        for (int64_t req = first; req < first + count; req++) {
            for (int64_t i = 0; i < rq.q_len[req]; i++, row += rep) {
                const float *qi = q + (rq.q_start[req] + i) * q_stride + h * rep * d;
                for (int64_t r = 0; r < rep; r++) {
                    for (int64_t x = 0; x < d; x++) qs[(row + r) * d + x] = qi[r * d + x] * scale;
                    memset(o + (row + r) * d, 0, sizeof(float) * d);
                    m[row + r] = -INFINITY;
                    l[row + r] = 0.0f;
                }
            }
        }
        if (prefix > 0)
            attend_range(qs + h * R * d, R, softcap, k_pool + h * d, v_pool + h * d,
                         rq.kv_indices + rq.kv_start[first], 0, prefix, kv_row, d,
                         o + h * R * d, s, m + h * R, l + h * R, alpha,
                         R >= WIDE_ROWS && d % 8 == 0 && !invariant ? kt : NULL);
    }
    for (int64_t req = first, row = 0; req < first + count; req++) {
        const int64_t nq = rq.q_len[req], nk = rq.kv_len[req];
        for (int64_t i = 0; i < nq; i++, row += rep) {
            const int64_t pos = nk - nq + i;
            int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
            lo = lo > prefix ? lo : prefix;
            for (int64_t h = 0; h < hkv; h++) {
                const int64_t at = h * R + row;
                attend_range(qs + at * d, rep, softcap, k_pool + h * d, v_pool + h * d,
                             rq.kv_indices + rq.kv_start[req], lo, pos + 1, kv_row, d,
                             o + at * d, s, m + at, l + at, alpha, NULL);
                float *dst = out + ((rq.q_start[req] + i) * hq + h * rep) * d;
                for (int64_t r = 0; r < rep; r++) {
                    const float inv = 1.0f / l[at + r];
                    for (int64_t x = 0; x < d; x++) dst[r * d + x] = o[(at + r) * d + x] * inv;
                }
            }
        }
    }
}

/* Chunks of consecutive requests that attend together, written to first/count/prefix (room for
 * num_requests each); returns how many. A chunk takes requests while its rows (queries x rep)
 * stay within max_rows and its requests within max_requests; its prefix is the longest run of
 * leading slots all its members hold and every query of theirs sees (the shared system prompt,
 * a prompt's samples, an extend chunk's earlier context). */
int64_t plan_chunks(const int32_t *q_len, const int32_t *kv_start, const int32_t *kv_len,
                    const int32_t *kv_indices, int64_t num_requests, int64_t rep,
                    int64_t max_rows, int64_t max_requests, int32_t *first, int32_t *count,
                    int32_t *prefix) {
    int64_t chunks = 0;
    for (int64_t req = 0; req < num_requests;) {
        const int32_t *lead = kv_indices + kv_start[req];
        int64_t rows = q_len[req] * rep, common = kv_len[req] - q_len[req], n = 1;
        while (req + n < num_requests && n < max_requests &&
               rows + q_len[req + n] * rep <= max_rows) {
            const int64_t b = req + n;
            const int32_t *slots = kv_indices + kv_start[b];
            const int64_t seen = kv_len[b] - q_len[b];
            int64_t j = 0;
            while (j < common && j < seen && slots[j] == lead[j]) j++;
            if (j == 0) break;  /* nothing in common: a new chunk */
            common = j;
            rows += q_len[b] * rep;
            n++;
        }
        first[chunks] = (int32_t)req;
        count[chunks] = (int32_t)n;
        /* one request's several queries share its context before them, too */
        prefix[chunks] = (int32_t)(n > 1 || q_len[req] > 1 ? common : 0);
        chunks++;
        req += n;
    }
    return chunks;
}

/* Requests r < num_requests: queries q_start[r] .. + q_len[r] of the flat token axis, context
 * the slots kv_indices[kv_start[r] .. + kv_len[r]], in the chunks of plan_chunks. q [T, Hq, D]
 * with token stride q_stride (heads contiguous), out [T, Hq, D] contiguous (only the requests'
 * rows written), k_pool and v_pool [slots, Hkv, D] contiguous.
 *
 * First the step's own K/V go into the pool: token t's k_new/v_new rows ([Hkv, D] contiguous,
 * token strides k_stride/v_stride) into slot new_slots[t] (negative: padding, skipped), every
 * thread a share, all done before any thread attends. In the same parallel region as the
 * attention they cost no dispatch of their own; two torch index_copy_ calls a layer took
 * ~2 ms of a batch-128 step on one thread. `invariant` (EngineConfig.batch_invariant): each
 * row's result is the same whatever chunk it is attended in (see attend_chunk). Returns -1, or
 * the first token whose slot is past the pool's num_slots (then nothing is written or
 * computed), or -2 when a thread's workspace could not be allocated (the K/V stored, that
 * thread's rows not attended). */
int64_t paged_attention_f32(const float *q, int64_t q_stride, float *k_pool, float *v_pool,
                         float *out, const int32_t *q_start, const int32_t *q_len,
                         const int32_t *kv_start, const int32_t *kv_len,
                         const int32_t *kv_indices, const int32_t *chunk_first,
                         const int32_t *chunk_count, const int32_t *chunk_prefix,
                         int64_t num_chunks, int64_t hq, int64_t hkv, int64_t d, float scale,
                         int64_t window, float softcap, const float *k_new, int64_t k_stride,
                         const float *v_new, int64_t v_stride, const int64_t *new_slots,
                         int64_t num_new, int64_t num_slots, int invariant,
                         int num_threads) {
    for (int64_t t = 0; t < num_new; t++)
        if (new_slots[t] >= num_slots) return t;  /* nothing written: index_copy_ would raise */
    const Requests rq = {q_start, q_len, kv_start, kv_len, kv_indices};
    int64_t max_rows = 0;  /* of a chunk, every KV head's */
    for (int64_t c = 0; c < num_chunks; c++) {
        int64_t rows = 0;
        for (int64_t req = chunk_first[c]; req < chunk_first[c] + chunk_count[c]; req++)
            rows += q_len[req] * hq;
        max_rows = rows > max_rows ? rows : max_rows;
    }
    int out_of_memory = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: scaled queries and accumulators, a block of scores, and each row's max,
         * sum and rescale factor. */
        float *work = malloc(sizeof(float) * (max_rows * (2 * d + BLOCK + 3) + d * BLOCK));
        if (!work) {
#pragma omp atomic write
            out_of_memory = 1;
        }
        const int64_t kv_row = hkv * d;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_new; t++) {
            if (new_slots[t] < 0) continue;
            memcpy(k_pool + new_slots[t] * kv_row, k_new + t * k_stride, sizeof(float) * kv_row);
            memcpy(v_pool + new_slots[t] * kv_row, v_new + t * v_stride, sizeof(float) * kv_row);
        }  /* the loop's barrier: every new key is in the pool before anyone reads it */
#pragma omp for schedule(static)
        for (int64_t c = 0; c < num_chunks; c++) {
            if (!work) continue;  /* the caller raises MemoryError */
#define CHUNK(D) attend_chunk(q, q_stride, scale, softcap, k_pool, v_pool, out, rq,         \
                              chunk_first[c], chunk_count[c], chunk_prefix[c], hq, hkv, D, \
                              window, work, max_rows, invariant)
            switch (d) {  /* a constant d for the common head sizes (unrolled d-loops) */
                case 64: CHUNK(64); break;
                case 128: CHUNK(128); break;
                default: CHUNK(d);
            }
#undef CHUNK
        }
        free(work);
    }
    return out_of_memory ? -2 : -1;
}
