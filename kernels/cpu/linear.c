/* Projections for the CPU (fp32): y = x W^T with W packed once into panels of 16 output
 * columns, k-major (panel p holds W's rows 16p .. 16p + 15, interleaved: wp[(p k + i) 16 + j]
 * = W[16 p + j][i], the last panel padded with zeros).
 *
 * A panel is one stream of k cache lines; a block of x's rows runs over it, each element of a
 * row broadcast against the panel's vectors. With AVX2: 6 rows, a panel as two 8-lane vectors,
 * 12 accumulators (2 loads and 6 broadcasts per 12 FMAs), everything in the 16 registers. With
 * AVX-512: 8 rows over three panels at once (12 over two on a Zen 4), a panel as one 16-lane
 * vector, 24 accumulators in the 32 registers (3 loads and 8 broadcasts per 24 FMAs): fewer
 * loads per FMA, which is what kept the AVX2 block at ~70 % of a Zen 4's FMA peak (the 512-bit
 * one reaches ~85 %, docs/benchmarks.md). The panels (k x 64 bytes each) stay in L1/L2 for all
 * the row blocks, so the weights come from memory once per call. Threads take even runs of
 * panels.
 *
 * Every output element is one chain of FMAs over i = 0 .. k-1 from zero, whatever the vector
 * width, the row block or the other rows: the two ISAs give the same bits, and a row's result
 * does not depend on the batch (the portable path's too, at the end). */
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

#if defined(__AVX512F__)
/* The register block: ROW_BLOCK_512 rows x PANELS_512 adjacent panels (a group), one 16-lane
 * accumulator each (the group's weight vectors and a broadcast take other registers). On an
 * Intel Xeon with two 512-bit FMA ports 8 x 3 runs the decode step's shapes 3-8 % faster than
 * 12 x 2, whose loop also reloads two row strides from the stack every input (too few general
 * registers for 12 row pointers); the Zen 4 keeps the 12 x 2 it was measured with
 * (docs/benchmarks.md). Any shape gives the same bits (each element's chain is the same); a
 * build may set them (-DROW_BLOCK_512=r -DPANELS_512=p: tests/kernels/test_panels_isa.py). */
#if defined(__znver4__) || defined(__znver3__)  /* a znver3 with AVX-512 is a Zen 4 */
#define ZEN4_512 1
#else
#define ZEN4_512 0
#endif
#ifndef ROW_BLOCK_512
#define ROW_BLOCK_512 (ZEN4_512 ? 12 : 8)
#endif
#ifndef PANELS_512
#define PANELS_512 (ZEN4_512 ? 2 : 3)
#endif
#if ROW_BLOCK_512 * PANELS_512 + PANELS_512 + 1 > 32 || PANELS_512 > 4 || ROW_BLOCK_512 > 12
#error "the AVX-512 register block must fit the 32 vector registers (4 panels, 12 rows at most)"
#endif
/* Inputs a group of panels is run over before the next row block. 128 (x 64 bytes a panel) stay
 * in L1 for all the row blocks: +5-10 % on the LM head of an Intel Xeon with two 512-bit FMA
 * ports, whose panels come from memory (the layers' within noise). A Zen 4 (GCC 12 calls it
 * znver3 with AVX-512; GCC 13 znver4) issues one 512-bit FMA a cycle, in two 256-bit halves:
 * there the group runs whole from L2 (1 MB a core) and the chunks only cost, 11 % of a decode
 * step's projections (docs/benchmarks.md). The chunking never changes a bit (each chain goes on
 * through y), so a build may set it (-DK_CHUNK_512=n: tests/kernels/test_panels_isa.py). */
#ifndef K_CHUNK_512
#define K_CHUNK_512 (ZEN4_512 ? INT32_MAX : 128)
#endif
/* With chunks, a chunk's first row block waits for its panel slice from memory (each group of
 * every layer is new to the cache): the slice after it (the group's next chunk, else the next
 * group's first) is asked into L2 while the row blocks before it run, a share of its lines per
 * row block. On the Intel Xeon the step's projections went 112-116 -> 97-106 ms (59 -> 66-71 %
 * of the FMA peak, docs/benchmarks.md). Measured there only: the Zen 4's whole-k loop keeps
 * none. A hint, never a bit of the result; -DPREFETCH_512=0|1 overrides. */
#ifndef PREFETCH_512
#define PREFETCH_512 (K_CHUNK_512 < INT32_MAX)
#endif
#define IN_ZMM(x) __asm__("" : "+v"(x))
#define ROW_BLOCKS(m) ((m) > 0 ? ((m) + ROW_BLOCK_512 - 1) / ROW_BLOCK_512 : 1)

static inline __mmask16 columns_mask(int64_t left) {
    return left >= PANEL ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}

/* Inputs k0 .. k0 + kc of y[r][0..cols) (= or += alpha *) x[r] . panels for R rows and P
 * (1 .. PANELS_512) adjacent panels (R, P constants after inlining; cols counts the columns of
 * the P panels that exist). A chunk after the first continues each FMA chain from the partial
 * sums stored in y, so a chunked product is the same chain as an unchunked one, bit for bit;
 * `add` runs every k in one chunk (y holds the base output there). */
static inline __attribute__((always_inline)) void panel_rows_512(
        const float *x, int64_t x_stride, int64_t k, int64_t k0, int64_t kc,
        const float *panel, float *y, int64_t y_stride, int64_t cols, const int R, const int P,
        const int add, const float alpha) {
    __m512 a[ROW_BLOCK_512][PANELS_512];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++)
            a[r][q] = k0 == 0 ? _mm512_setzero_ps()
                              : _mm512_maskz_loadu_ps(columns_mask(cols - q * PANEL),
                                                      y + r * y_stride + q * PANEL);
    for (int64_t i = k0; i < k0 + kc; i++) {
        __m512 w[PANELS_512];
        for (int q = 0; q < P; q++) {
            w[q] = _mm512_loadu_ps(panel + (q * k + i) * PANEL);
            IN_ZMM(w[q]);
        }
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * x_stride + i]);
            for (int q = 0; q < P; q++) a[r][q] = _mm512_fmadd_ps(xb, w[q], a[r][q]);
        }
    }
    const __m512 scale = _mm512_set1_ps(alpha);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < P; q++) {
            const __mmask16 mask = columns_mask(cols - q * PANEL);
            float *yq = y + r * y_stride + q * PANEL;
            /* an FMA per element, as the AVX2 path's tail: the same rounding */
            const __m512 out = add ? _mm512_fmadd_ps(scale, a[r][q],
                                                     _mm512_maskz_loadu_ps(mask, yq))
                                   : a[r][q];
            _mm512_mask_storeu_ps(yq, mask, out);
        }
}

/* One row block against P panels: every (rows, panels, add) its own instance, constants in
 * the hot loop. */
#define PANELS_CASE(R, P) case P: \
    if (add) panel_rows_512(xr, x_stride, k, k0, kc, panel, yr, y_stride, cols, R, P, 1, alpha); \
    else panel_rows_512(xr, x_stride, k, k0, kc, panel, yr, y_stride, cols, R, P, 0, alpha); \
    break
#if PANELS_512 == 4
#define BY_PANELS(R) PANELS_CASE(R, 4); PANELS_CASE(R, 3); PANELS_CASE(R, 2); default: \
    PANELS_CASE(R, 1)
#elif PANELS_512 == 3
#define BY_PANELS(R) PANELS_CASE(R, 3); PANELS_CASE(R, 2); default: PANELS_CASE(R, 1)
#elif PANELS_512 == 2
#define BY_PANELS(R) PANELS_CASE(R, 2); default: PANELS_CASE(R, 1)
#else
#define BY_PANELS(R) default: PANELS_CASE(R, 1)
#endif
#define ROWS(R) case R: if (R <= ROW_BLOCK_512) { switch (np) { BY_PANELS(R); } } break

static void panels_times(const float *x, int64_t x_stride, int64_t m, int64_t k,
                         const float *wp, int64_t n, float *y, int64_t y_stride, int add,
                         float alpha, int num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    /* Each thread a run of panels as even as can be (its groups, the last maybe fewer panels):
     * by groups, 576 outputs (9 groups of 4) would give one of 2 threads a fifth more work. */
    const int parts = panels < num_threads ? (int)(panels > 0 ? panels : 1) : num_threads;
    /* k == 0 still runs one (empty) chunk: y = 0, or y unchanged with add */
    const int64_t chunk = add ? (k > 0 ? k : 1) : K_CHUNK_512;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int part = 0; part < parts; part++) {
        const int64_t end = panels * (part + 1) / parts;
        for (int64_t p = panels * part / parts; p < end; p += PANELS_512) {
            const int np = end - p < PANELS_512 ? (int)(end - p) : PANELS_512;
            const float *panel = wp + p * k * PANEL;
            const int64_t col0 = p * PANEL;
            const int64_t cols = n - col0 < np * PANEL ? n - col0 : np * PANEL;
            for (int64_t k0 = 0; k0 == 0 || k0 < k; k0 += chunk) {
                const int64_t kc = k - k0 < chunk ? k - k0 : chunk;
                /* the next slice's inputs nk0 .. nk0 + lines, a line of each of its panels: the
                 * group's next chunk, else the thread's next group's first (a panel past them
                 * is another thread's, or past the end: a prefetch never faults) */
                const int64_t nk0 = k0 + kc < k ? k0 + kc : 0;
                const float *next = nk0 ? panel : panel + np * k * PANEL;
                const int64_t lines = !PREFETCH_512 || (!nk0 && p + np >= end) ? 0
                                      : k - nk0 < chunk ? k - nk0 : chunk;
                const int64_t per_block = (lines + ROW_BLOCKS(m) - 1) / ROW_BLOCKS(m);
                for (int64_t r = 0; r < m; r += ROW_BLOCK_512) {
                    const int64_t l0 = r / ROW_BLOCK_512 * per_block;
                    for (int64_t l = l0; l < l0 + per_block && l < lines; l++)
                        for (int q = 0; q < (nk0 ? np : PANELS_512); q++)
                            _mm_prefetch((const char *)(next + (q * k + nk0 + l) * PANEL),
                                         _MM_HINT_T1);
                    const float *xr = x + r * x_stride;
                    float *yr = y + r * y_stride + col0;
                    switch (m - r < ROW_BLOCK_512 ? (int)(m - r) : ROW_BLOCK_512) {
                        ROWS(12); ROWS(11); ROWS(10); ROWS(9); ROWS(8); ROWS(7); ROWS(6);
                        ROWS(5); ROWS(4); ROWS(3); ROWS(2); default: ROWS(1);
                    }
                }
            }
        }
    }
}
#undef ROWS
#undef BY_PANELS
#undef PANELS_CASE
#elif defined(__AVX2__) && defined(__FMA__)
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

#else
/* Without AVX2 and FMA (ARM, older x86): plain C over the same panels and row blocks, each
 * row's 16 accumulators one vector loop the compiler widens to the CPU's lanes. Slower than
 * oneDNN's layout is likely, so the default mode keeps that (linear.py: tuned); what this path
 * is for is the batch-invariant mode, which needs a row's bits independent of the other rows:
 * each output element is still one chain over i = 0 .. k-1 from zero (the compiler may not
 * reassociate it; it contracts each step into an FMA where the CPU has one). */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, int64_t k, const float *panel, float *y,
        int64_t y_stride, int64_t cols, const int R, const int add, const float alpha) {
    float a[ROW_BLOCK][PANEL] = {{0}};
    for (int64_t i = 0; i < k; i++) {
        const float *w = panel + i * PANEL;
        for (int r = 0; r < R; r++) {
            const float xb = x[r * x_stride + i];
#pragma omp simd
            for (int j = 0; j < PANEL; j++) a[r][j] += xb * w[j];
        }
    }
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < cols; c++) {
            float *out = y + r * y_stride + c;
            *out = add ? fmaf(alpha, a[r][c], *out) : a[r][c];
        }
}
#endif

#if !defined(__AVX512F__)
/* The AVX2 and the portable paths: threads take panels, each runs its row blocks. */
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
#endif

/* 1 where the products run on the intrinsics above (AVX2 and FMA, AVX-512), measured faster
 * than oneDNN's layout; 0 on the portable path. */
int linear_tuned(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] (contiguous) = x [m, k] (rows x_stride apart) times the packed weight's transpose. */
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
