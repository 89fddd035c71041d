/* Rows of 32-bit keys sorted in place, ascending as unsigned integers: the top-p filter's
 * sort of a row's log-probabilities (rollout/sample/filters.py), whose bit patterns, all <= 0,
 * sort ascending as the floats sort descending. numpy's sort of a 49,152-key row ran at ~50 M
 * keys a second on a Zen 4 (its comparison sort); a least-significant-digit radix sort makes
 * four passes (one counting all three digits, three moving the keys by one 11-bit digit each:
 * 2,048 counters, in L1), with the row and its scratch in L2. Stable passes over whole digits
 * give exactly the sorted order, so the result is the comparison sort's, bit for bit. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DIGIT_BITS 11
#define BUCKETS (1 << DIGIT_BITS)
#define PASSES 3 /* 3 x 11 bits cover 32 */

static void sort_row(uint32_t *keys, uint32_t *scratch, int64_t n,
                     uint32_t (*count)[BUCKETS]) {
    memset(count, 0, sizeof(uint32_t) * PASSES * BUCKETS);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t x = keys[i];
        count[0][x & (BUCKETS - 1)]++;
        count[1][(x >> DIGIT_BITS) & (BUCKETS - 1)]++;
        count[2][x >> (2 * DIGIT_BITS)]++;
    }
    uint32_t *src = keys, *dst = scratch;
    for (int p = 0; p < PASSES; p++) {
        const int shift = DIGIT_BITS * p;
        /* a digit every key shares (a row of one value; keys whose low bits are all zero)
         * moves nothing */
        if (count[p][(src[0] >> shift) & (BUCKETS - 1)] == (uint32_t)n) continue;
        uint32_t at = 0;
        for (int b = 0; b < BUCKETS; b++) {
            const uint32_t c = count[p][b];
            count[p][b] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) {
            const uint32_t x = src[i];
            dst[count[p][(x >> shift) & (BUCKETS - 1)]++] = x;
        }
        uint32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != keys) memcpy(keys, src, sizeof(uint32_t) * n);
}

/* Each of `rows` rows of n keys (row stride `stride` keys) sorted in place, one after the other
 * on the calling thread: the caller splits rows over its own threads (filters._in_threads,
 * whose pool a forked child replaces; an OpenMP team here would hang a child forked after it
 * ran). Returns 0, or -1 when the scratch could not be allocated (nothing sorted then). */
int radix_sort_u32(uint32_t *keys, int64_t rows, int64_t n, int64_t stride) {
    if (n < 2 || rows < 1) return 0;
    uint32_t *scratch = malloc(sizeof(uint32_t) * n);
    uint32_t(*count)[BUCKETS] = malloc(sizeof(uint32_t) * PASSES * BUCKETS);
    const int failed = scratch == NULL || count == NULL;
    for (int64_t r = 0; r < rows && !failed; r++) sort_row(keys + r * stride, scratch, n, count);
    free(scratch);
    free(count);
    return failed ? -1 : 0;
}
