/* A weight copy that checks itself (rollout/colocation/checksum.py): dst = src, with the
 * wrapping sum of src's bytes as 32-bit words, the same sum read back from dst, and whether
 * dst holds a non-finite value, all in one pass over memory.
 *
 * The copy goes in blocks that fit in L2: a block is read from src (summed as it is read) and
 * written to dst, then read back from dst while it is still in the cache (summed and checked),
 * so the checks cost cache reads and adds, not two or three more trips to memory. The sums are
 * those of checksum.bit_sum: the bytes as little-endian 32-bit words, wrapping (so any order of
 * adding, threads included, gives the same value), and a 2-byte tail as one sign-extended 16-bit
 * value. Non-finite: an element whose exponent bits (`exp_mask`, per element: 0x7f800000 for
 * fp32, 0x7f80 for bf16, 0x7c00 for fp16) are all ones. */
#include <stdint.h>
#include <string.h>

#define BLOCK_WORDS 8192 /* 32 KiB of each side a block */

/* The sum of n words of d and whether one holds a non-finite element: one pass, vectorised
 * (wrapping adds and compares). */
static inline uint32_t sum_finite(const uint32_t *restrict d, int64_t n, int elem_size,
                                  uint32_t mask, uint32_t *bad) {
    uint32_t c = 0, b = 0;
    if (elem_size == 4) {
        for (int64_t i = 0; i < n; i++) {
            c += d[i];
            b |= (d[i] & mask) == mask;
        }
    } else {
        const uint32_t hi = mask << 16;
        for (int64_t i = 0; i < n; i++) {
            c += d[i];
            b |= ((d[i] & mask) == mask) | ((d[i] & hi) == hi);
        }
    }
    *bad |= b;
    return c;
}

/* src and dst: nbytes each (a multiple of elem_size, 2 or 4; 4-byte aligned, as torch's
 * allocations and their whole-tensor views are). */
void checked_copy(const void *src, void *dst, int64_t nbytes, int elem_size, uint32_t exp_mask,
                  int32_t *src_sum, int32_t *dst_sum, int32_t *non_finite, int num_threads) {
    const int64_t words = nbytes / 4;
    /* restrict: the two tensors do not overlap (the caller's copy is between weights), so the
     * copy loop vectorises without alias checks */
    const uint32_t *restrict s = (const uint32_t *)src;
    uint32_t *restrict d = (uint32_t *)dst;
    const int64_t blocks = (words + BLOCK_WORDS - 1) / BLOCK_WORDS;
    uint32_t sum_s = 0, sum_d = 0, bad = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    reduction(+ : sum_s, sum_d) reduction(| : bad)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t lo = b * BLOCK_WORDS;
        const int64_t n = words - lo < BLOCK_WORDS ? words - lo : BLOCK_WORDS;
        uint32_t a = 0, flagged = 0;
        for (int64_t i = 0; i < n; i++) {
            a += s[lo + i];
            d[lo + i] = s[lo + i];
        }
        sum_s += a;
        sum_d += sum_finite(d + lo, n, elem_size, exp_mask, &flagged);
        bad |= flagged;
    }
    if (nbytes % 4) { /* one 2-byte element left */
        int16_t t;
        memcpy((char *)dst + words * 4, (const char *)src + words * 4, 2);
        memcpy(&t, (const char *)src + words * 4, 2);
        sum_s += (uint32_t)(int32_t)t;
        memcpy(&t, (const char *)dst + words * 4, 2);
        sum_d += (uint32_t)(int32_t)t;
        bad |= ((uint16_t)t & exp_mask) == exp_mask;
    }
    *src_sum = (int32_t)sum_s;
    *dst_sum = (int32_t)sum_d;
    *non_finite = (int32_t)bad;
}
