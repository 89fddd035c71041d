/* The top-p filter's scan of sorted rows (rollout/sample/filters.py `_prefix_exact`), fused:
 * for each row of the reference's probabilities p (the softmax of the sorted, top-k-masked
 * values, descending), the running mass before each position as the reference computes it, and
 * the length of the kept prefix. In torch ops the scan took some eight passes over [rows, vocab]
 * (cumsum, the differences, two comparisons, their union, a first-true, a count): most of a
 * top-p step whose rows are sorted whole; here it is one pass.
 *
 * The same bits as the torch ops: torch's CPU cumsum of float32 adds each element to a double
 * accumulator in order and rounds each partial sum to float, and `cum - p` is one float
 * subtraction, compared with the float top_p. No multiply-add is involved, so contraction
 * cannot change a bit. */
#include <stdint.h>

/* Per row r (probs row stride `stride`): examining positions < length, position i > 0 is
 * dropped when its mass before it, (float)cum_i - p_i, reaches top_p[r] or i >= k[r]; result
 * the first dropped position (length if none) when every later position < length is dropped
 * too and everything past `length` is dropped as well (length == vocab, k[r] <= length, or the
 * last cumsum reaches top_p + slack: see _prefix_exact), else -1. */
void top_p_prefix_f32(const float *probs, int64_t rows, int64_t stride, int64_t vocab,
                      int64_t length, const int64_t *k, const float *top_p, double slack,
                      int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *p = probs + r * stride, tp = top_p[r];
        double acc = 0.0;
        float cum = 0.0f;
        int64_t first = length, dropped = 0;
        for (int64_t i = 0; i < length; i++) {
            acc += (double)p[i];
            cum = (float)acc;
            const float before = cum - p[i];
            if (i > 0 && (before >= tp || i >= k[r])) {
                dropped++;
                if (first == length) first = i;
            }
        }
        const int prefix = dropped == length - first;
        const int rest = length == vocab || k[r] <= length || (double)cum >= (double)tp + slack;
        out[r] = prefix && rest ? first : -1;
    }
}
