/* The gated MLP's activation for the CPU (fp32): silu(gate) * up in one pass, where torch takes
 * two ops (silu into a new tensor, then the product into another), each a pass over memory and
 * dispatch of its own; at a decode step's sizes that is 1-2 % of the step. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x), x clamped to [-87, 88] where exp is a normal float (silu needs no more): Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp, written without library
 * calls so the compiler vectorises it. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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

/* out[r, i] = gate[r, i] / (1 + exp(-gate[r, i])) * up[r, i] for rows of dim values; gate and
 * up rows with their own strides (the two halves of a fused gate-up output), out contiguous. */
void silu_mul_f32(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride,
                  float *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * dim;
        /* Below -88 exp(-g) is past the float range: silu is g * 0 there, as torch's g / inf
         * (NaN at -inf, as torch's). */
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = (g[i] < -88.0f ? g[i] * 0.0f : g[i] / (1.0f + exp_clamped(-g[i]))) * u[i];
    }
}
