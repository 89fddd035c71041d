/* exp(x) for the kernels' vectorised loops (softmax, SiLU): x clamped to [-87, 88], where exp
 * is a normal float; Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp from libm's.
 * Written without library calls so the compiler vectorises the loops that call it. */
#ifndef ROLLOUT_EXP_APPROX_H
#define ROLLOUT_EXP_APPROX_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_approx(float x) {
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
    /* NaN fails both clamps and stays NaN (so does the result, through p); converting it to an
     * int would be undefined, so the exponent takes 0 for it. */
    int32_t bits = ((int32_t)(n == n ? n : 0.0f) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
