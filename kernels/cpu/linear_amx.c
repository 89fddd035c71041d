/* Projections of bf16 weights on CPUs with AMX (Intel Sapphire Rapids and later): y (fp32) =
 * x W^T, x and W bf16, for the batch-invariant mode (packed_linear.AmxPanels), where oneDNN's
 * own AMX kernels round a row by how many rows share its call.
 *
 * W is packed once into panels of 16 output columns whose inputs come in pairs, the layout an
 * AMX B tile loads (panel p, pair i: wp[((p kp + i) 16 + j) 2 + h] = W[16 p + j][2 i + h]),
 * kp a multiple of 16 pairs (32 inputs: one tile's depth) and the panels even in number (they
 * go in twos), zeros past k and n. x comes with rows a multiple of 16 and kp pairs a row
 * (x_stride values apart): padded with zeros by the caller where its own are not.
 *
 * Each C tile element is its own chain: tdpbf16ps adds, for each of its 32 inputs in order,
 * the exact product (8-bit significands) to the fp32 element, and a tile row reads its own x
 * row only. The chain runs over the tiles' depth steps in order from zero, the same whatever
 * the number of rows, the row block or the thread: a row's bits do not depend on the batch.
 *
 * A thread takes a pair of panels (two B tiles) for every block of 32 rows (two A tiles, one
 * where the rows fit in 16): four C tiles accumulate, the panels read once from memory and
 * then from L2 for the next row block. */
#include <stdint.h>
#include <string.h>
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define PANEL 16
#define DEPTH 16  /* pairs a tile holds: 32 inputs */

/* w [n, k] bf16 (as uint16) into wp, kp pairs a panel (a multiple of DEPTH, >= ceil(k / 2)),
 * `panels` panels (even, >= ceil(n / 16)). */
void pack_panels_amx(const uint16_t *w, int64_t n, int64_t k, int64_t kp, int64_t panels,
                     uint16_t *wp, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < PANEL; j++) {
            const int64_t row = p * PANEL + j;
            uint16_t *dst = wp + p * kp * PANEL * 2 + j * 2;
            for (int64_t c = 0; c < 2 * kp; c++)
                dst[c / 2 * PANEL * 2 + c % 2] = row < n && c < k ? w[row * k + c] : 0;
        }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux lends a process the tile registers only when asked (as oneDNN asks before its own AMX
 * kernels): 1 when granted, 0 where refused (an old kernel, a hypervisor without them). */
int amx_ready(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* C tiles 0-3 (row tile r, panel q: tile 2r + q), A tiles 4-5, B tiles 6-7. */
static void configure(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* The valid part of one stored C tile into y. */
static void store(const float *tile, float *y, int64_t n, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) memcpy(y + r * n, tile + r * PANEL, sizeof(float) * cols);
}

/* One block of 16 R rows (R = 1 or 2) over a pair of panels; x, y at the block's first row. */
static inline __attribute__((always_inline)) void block(
        const uint16_t *x, int64_t x_stride, int64_t kp, const uint16_t *panel, float *y,
        int64_t n, int64_t rows, int64_t col0, const int R) {
    const uint16_t *second = panel + kp * PANEL * 2;
    const int64_t stride = x_stride * sizeof(uint16_t);
    _tile_zero(0);
    _tile_zero(1);
    if (R == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t s = 0; s < kp / DEPTH; s++) {
        _tile_loadd(4, x + s * DEPTH * 2, stride);
        _tile_loadd(6, panel + s * DEPTH * PANEL * 2, PANEL * 2 * sizeof(uint16_t));
        _tile_loadd(7, second + s * DEPTH * PANEL * 2, PANEL * 2 * sizeof(uint16_t));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (R == 2) {
            _tile_loadd(5, x + 16 * x_stride + s * DEPTH * 2, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float tile[16 * PANEL];
#define OUT(T, r, q) do { \
        const int64_t left = n - col0 - (q) * PANEL, cols = left < PANEL ? left : PANEL; \
        const int64_t here = rows - (r) * 16 < 16 ? rows - (r) * 16 : 16; \
        if (cols > 0 && here > 0) { \
            _tile_stored(T, tile, PANEL * sizeof(float)); \
            store(tile, y + (r) * 16 * n + col0 + (q) * PANEL, n, here, cols); \
        } \
    } while (0)
    OUT(0, 0, 0);
    OUT(1, 0, 1);
    if (R == 2) {
        OUT(2, 1, 0);
        OUT(3, 1, 1);
    }
#undef OUT
}

/* y [m, n] (fp32, contiguous) = x [mp, 2 kp] (bf16, rows x_stride apart, padded as above:
 * mp = m rounded up to 16) times the packed weight's transpose; `panels` as packed. 0, or -1
 * (y untouched) where the tile registers are not granted: a tile instruction would kill the
 * process. */
int linear_amx_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t kp,
                    const uint16_t *wp, int64_t n, int64_t panels, float *y, int num_threads) {
    if (!amx_ready()) return -1;
    const int64_t pairs = panels / 2, blocks = (m + 31) / 32;
#pragma omp parallel num_threads(num_threads)
    {
        configure();  /* the tile configuration is each thread's own */
#pragma omp for collapse(2) schedule(static)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t rows = m - 32 * b < 32 ? m - 32 * b : 32;
                const uint16_t *xb = x + 32 * b * x_stride;
                const uint16_t *panel = wp + 2 * p * kp * PANEL * 2;
                float *yb = y + 32 * b * n;
                if (rows > 16)
                    block(xb, x_stride, kp, panel, yb, n, rows, 2 * p * PANEL, 2);
                else
                    block(xb, x_stride, kp, panel, yb, n, rows, 2 * p * PANEL, 1);
            }
        _tile_release();
    }
    return 0;
}
#endif
