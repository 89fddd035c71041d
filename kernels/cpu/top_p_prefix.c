/* The top-p filter's scan of sorted rows (rollout/sample/filters.py `_prefix_exact`), fused:
 * for each row of the reference's probabilities p (the softmax of the sorted, top-k-masked
 * values, descending), the running mass before each position as the reference computes it, and
 * the length of the kept prefix. In torch ops the scan takes some six passes over [rows, vocab]
 * (cumsum, the difference, two comparisons, their union, a first-true); here it is part of one.
 *
 * The same bits as the torch ops: torch's CPU cumsum of float32 adds each element to a double
 * accumulator in order and rounds each partial sum to float, and `cum - p` is one float
 * subtraction, compared with the float top_p. No multiply-add is involved, so contraction
 * cannot change a bit. */
#include <stdint.h>

/* Per row r (probs row stride `stride`): the first position i > 0 whose mass before it,
 * (float)cum_i - p_i, reaches top_p[r] or that is past the top-k survivors (i >= k[r]),
 * examining positions < length; length if there is none and length == vocab (the whole row is
 * kept), else -1. The scan stops at that position: a peaked row reads a few of its values. */
void top_p_prefix_f32(const float *probs, int64_t rows, int64_t stride, int64_t vocab,
                      int64_t length, const int64_t *k, const float *top_p, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * stride, tp = top_p[r];
        const int64_t end = length < k[r] ? length : k[r];
        double acc = p[0];
        int64_t i = 1;
        for (; i < end; i++) {
            acc += (double)p[i];
            if ((float)acc - p[i] >= tp) break;
        }
        out[r] = i < length ? i : (length == vocab ? length : -1);
    }
}
