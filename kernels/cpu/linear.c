/* Projections for the CPU (fp32): y = x W^T with W packed once into panels of 16 output
 * columns, k-major (panel p holds W's rows 16p .. 16p + 15, interleaved: wp[(p k + i) 16 + j]
 * = W[16 p + j][i], the last panel padded with zeros).
 *
 * A panel is one stream of k cache lines; 6 rows of x at a time run over it, each element of a
 * row broadcast against the panel's two vectors: 12 accumulators, 2 vector loads and 6
 * broadcasts per 12 FMAs, everything in the 16 AVX2 registers. The panel (k x 64 bytes) stays
 * in L1/L2 for all the row blocks, so the weights come from memory once per call. Threads take
 * panels. Each row's sums run in one fixed order whatever the other rows are: a row's result
 * does not depend on the batch. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define PANEL 16
#define ROW_BLOCK 6

void pack_panels_f32(const float *w, int64_t n, int64_t k, float *wp, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * k * PANEL;
        for (int64_t j = 0; j < PANEL; j++) {
            const int64_t row = p * PANEL + j;
            if (row < n)
                for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = w[row * k + i];
            else
                for (int64_t i = 0; i < k; i++) dst[i * PANEL + j] = 0.0f;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define IN_REGISTER(x) __asm__("" : "+x"(x))  /* see paged_attention.c */

/* y[r][0..cols) = x[r] . panel for R rows (a constant after inlining), rows x_stride apart;
 * with `add`, y[r][0..cols) += alpha * (x[r] . panel) instead, one rounding per element (an
 * FMA, the tail's too). */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, int64_t k, const float *panel, float *y,
        int64_t y_stride, int64_t cols, const int R, const int add, const float alpha) {
    __m256 a[ROW_BLOCK][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 w0 = _mm256_loadu_ps(panel + i * PANEL), w1 = _mm256_loadu_ps(panel + i * PANEL + 8);
        IN_REGISTER(w0);
        IN_REGISTER(w1);
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + i);
            a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *yr = y + r * y_stride;
        if (cols == PANEL && !add) {
            _mm256_storeu_ps(yr, a[r][0]);
            _mm256_storeu_ps(yr + 8, a[r][1]);
        } else if (cols == PANEL) {
            const __m256 scale = _mm256_set1_ps(alpha);
            _mm256_storeu_ps(yr, _mm256_fmadd_ps(scale, a[r][0], _mm256_loadu_ps(yr)));
            _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(scale, a[r][1], _mm256_loadu_ps(yr + 8)));
        } else {  /* the last panel of a width not a multiple of 16 */
            float full[PANEL];
            _mm256_storeu_ps(full, a[r][0]);
            _mm256_storeu_ps(full + 8, a[r][1]);
            if (add)
                for (int64_t c = 0; c < cols; c++) yr[c] = fmaf(alpha, full[c], yr[c]);
            else
                memcpy(yr, full, sizeof(float) * cols);
        }
    }
}

static void panels_times(const float *x, int64_t x_stride, int64_t m, int64_t k,
                         const float *wp, int64_t n, float *y, int64_t y_stride, int add,
                         float alpha, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        const float *panel = wp + p * k * PANEL;
        const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        for (int64_t r = 0; r < m; r += ROW_BLOCK) {
            const float *xr = x + r * x_stride;
            float *yr = y + r * y_stride + p * PANEL;
            /* `add` a constant in each instance: the stores differ, the hot loop must not */
#define ROWS(R, ADD) case R: panel_rows(xr, x_stride, k, panel, yr, y_stride, cols, R, ADD, \
                                        alpha); break
            if (add) {
                switch (m - r < ROW_BLOCK ? m - r : ROW_BLOCK) {
                    ROWS(6, 1); ROWS(5, 1); ROWS(4, 1); ROWS(3, 1); ROWS(2, 1); default: ROWS(1, 1);
                }
            } else {
                switch (m - r < ROW_BLOCK ? m - r : ROW_BLOCK) {
                    ROWS(6, 0); ROWS(5, 0); ROWS(4, 0); ROWS(3, 0); ROWS(2, 0); default: ROWS(1, 0);
                }
            }
#undef ROWS
        }
    }
}

/* y [m, n] (contiguous) = x [m, k] (rows x_stride apart) times the packed weight's transpose.
 * Only in a build with AVX2 and FMA: without them the symbol is absent and its torch path runs
 * (kernels/cpu/__init__.py binds each entry point on its own). */
void linear_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *wp,
                int64_t n, float *y, int num_threads) {
    panels_times(x, x_stride, m, k, wp, n, y, n, 0, 1.0f, num_threads);
}

/* y [m, n] (rows y_stride apart) += alpha * x [m, k] times the packed weight's transpose: a
 * LoRA block's expand added into its rows of the base projection's output, in place. */
void linear_add_f32(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *wp,
                    int64_t n, float *y, int64_t y_stride, float alpha, int num_threads) {
    panels_times(x, x_stride, m, k, wp, n, y, y_stride, 1, alpha, num_threads);
}
#endif
