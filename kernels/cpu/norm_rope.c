/* RMSNorm and rotary embedding for the CPU (fp32), one pass each where torch takes six to
 * eight small ops (cast, square, mean, add, rsqrt, two multiplies; two cats, a negation,
 * three multiplies and adds per tensor), each a pass over memory and ~10 us of dispatch: at a
 * decode step's sizes the dispatch is most of their cost. */
#include <math.h>
#include <stdint.h>

static inline void norm_row(const float *xr, const float *w, float *o, int64_t dim, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * w[i];
}

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w (the weight as given: Gemma's 1 + w is the
 * caller's), rows of x with stride x_stride, out contiguous. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows,
                  int64_t dim, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * x_stride, w, out + r * dim, dim, eps);
}

/* The residual stream's step and the next norm in one pass: sum[r] = x[r] + delta[r] (the
 * float adds torch makes), out[r] = the RMSNorm of sum[r]; sum and out contiguous. */
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *delta,
                      int64_t delta_stride, const float *w, float *sum, float *out, int64_t rows,
                      int64_t dim, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride, *dr = delta + r * delta_stride;
        float *sr = sum + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) sr[i] = xr[i] + dr[i];
        norm_row(sr, w, out + r * dim, dim, eps);
    }
}

/* Rotates, in place, the first rot dimensions of every head of x [tokens, heads, head_dim]
 * (token stride x_stride, heads contiguous) by the token's cos/sin [tokens, rot] rows:
 *     x1' = x1 cos1 - x2 sin1,   x2' = x2 cos2 + x1 sin2   (halves of the rotated part),
 * each product and sum rounded as torch's separate ops round them (no fused multiply-add), so
 * the result is the torch path's bit for bit: the file is compiled with -ffp-contract=off
 * (kernels/cpu/__init__.py FILE_FLAGS), whatever the compiler's default. */
static void rotate(
        float *x, int64_t x_stride, int64_t heads, int64_t head_dim, const float *cos,
        const float *sin, int64_t t, int64_t rot) {
    const int64_t half = rot / 2;
    const float *c = cos + t * rot, *s = sin + t * rot;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + t * x_stride + h * head_dim, *b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            const float p = x1 * c[i], q = -x2 * s[i];
            const float u = x2 * c[half + i], v = x1 * s[half + i];
            a[i] = p + q;
            b[i] = u + v;
        }
    }
}

void rotary_f32(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride,
                int64_t k_heads, int64_t head_dim, const float *cos, const float *sin,
                int64_t tokens, int64_t rot, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        rotate(q, q_stride, q_heads, head_dim, cos, sin, t, rot);
        rotate(k, k_stride, k_heads, head_dim, cos, sin, t, rot);
    }
}
