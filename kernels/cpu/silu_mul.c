/* The gated MLP's activation for the CPU (fp32): silu(gate) * up in one pass, where torch takes
 * two ops (silu into a new tensor, then the product into another), each a pass over memory and
 * dispatch of its own; at a decode step's sizes that is 1-2 % of the step. */
#include <stdint.h>

#include "exp_approx.h"

/* out[r, i] = gate[r, i] / (1 + exp(-gate[r, i])) * up[r, i] for rows of dim values; gate and
 * up rows with their own strides (the two halves of a fused gate-up output), out contiguous. */
void silu_mul_f32(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
                  float *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * dim;
        /* Below -88 (exp(-g) overflows from -88.72) silu is taken as g * 0: torch's g / inf,
         * NaN at -inf as torch's; between -88.72 and -88 torch gives ~5e-37 instead of 0. */
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = (g[i] < -88.0f ? g[i] * 0.0f : g[i] / (1.0f + exp_approx(-g[i]))) * u[i];
    }
}
