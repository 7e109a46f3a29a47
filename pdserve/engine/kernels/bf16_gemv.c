/* Many bf16 GEMVs over one weight: out[m] = W x[m] for each row m, every row summed exactly as
 * oneDNN sums a lone row (M = 1), so a batched decode step rounds as the reference's one-token
 * forward does. oneDNN's bf16 GEMV on AVX512-BF16 (measured on this CPU through torch 2.13 with
 * inputs whose sums cancel in only one order) takes K in blocks of 512; within a block one
 * float32 accumulator per output takes the products pair by pair with VDPBF16PS (k = 2i + 1 then
 * 2i, each add rounded); the block sums are added in order. The same instruction is used here,
 * so its rounding is the hardware's, whatever it is. oneDNN's GEMM (M >= 2) sums otherwise: for
 * K = 1536, about one row in ten then differs in one output from the M = 1 result.
 *
 * Layouts:
 *   x:   [M, K] bf16, row stride x_stride (elements)
 *   wp:  uint32 pairs (W[n, 2i], W[n, 2i + 1]) in the low and high half, in tiles of 64 outputs
 *        (the last may be narrower), each tile [K / 2, width] and contiguous: pack_pairs()
 *   out: [M, N] bf16, contiguous
 * K must be even and N a multiple of 16.
 *
 * Built with cc -O3 -march=native by kernels/__init__.py; one thread per call.
 */
#include <stdint.h>
#include <string.h>

#define K_BLOCK 512 /* oneDNN's K block for this GEMV */
#define ROWS 4      /* rows per pass over a weight tile */
#define TILE 4      /* 16-output registers per tile: 64 outputs */

int bf16_gemv_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Tile of outputs n0 .. n0 + width: wp[n0 * K / 2 + i * width + (n - n0)] = W[n, 2i] | W[n, 2i + 1] << 16
 * for W: [N, K] bf16 row-major; a tile's weights are contiguous, so a pass over it streams. */
void pack_pairs(const uint16_t *w, int64_t n_out, int64_t k, uint32_t *wp) {
    for (int64_t n0 = 0; n0 < n_out; n0 += 16 * TILE) {
        const int64_t width = n_out - n0 < 16 * TILE ? n_out - n0 : 16 * TILE;
        uint32_t *tile = wp + n0 * (k / 2);
        for (int64_t i = 0; i < k / 2; i++)
            for (int64_t n = 0; n < width; n++)
                tile[i * width + n] = (uint32_t)w[(n0 + n) * k + 2 * i] | (uint32_t)w[(n0 + n) * k + 2 * i + 1] << 16;
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as oneDNN's conversion */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __m512bh pair_of(const uint16_t *x, int64_t i) {
    uint32_t p;
    memcpy(&p, x + 2 * i, 4);
    return (__m512bh)_mm512_set1_epi32((int)p);
}

void bf16_gemv_rows(const uint16_t *x, int64_t x_stride, int64_t m_rows, int64_t k, const uint32_t *wp, int64_t n_out,
                    uint16_t *out, float *scratch /* [ROWS * TILE * 16] */) {
    const int64_t pairs = k / 2, block_pairs = K_BLOCK / 2;
    for (int64_t n0 = 0; n0 < n_out; n0 += 16 * TILE) {
        const int64_t tiles = (n_out - n0) / 16 < TILE ? (n_out - n0) / 16 : TILE, width = 16 * tiles;
        const uint32_t *tile = wp + n0 * (k / 2);
        for (int64_t m0 = 0; m0 < m_rows; m0 += ROWS) {
            const int64_t rows = m_rows - m0 < ROWS ? m_rows - m0 : ROWS;
            __m512 total[ROWS][TILE];
            for (int64_t b0 = 0; b0 < pairs; b0 += block_pairs) {
                const int64_t b1 = b0 + block_pairs < pairs ? b0 + block_pairs : pairs;
                __m512 acc[ROWS][TILE];
                for (int r = 0; r < ROWS; r++)
                    for (int t = 0; t < TILE; t++) acc[r][t] = _mm512_setzero_ps();
                for (int64_t i = b0; i < b1; i++) {
                    __m512bh w[TILE];
                    for (int t = 0; t < tiles; t++) w[t] = (__m512bh)_mm512_loadu_si512(tile + i * width + 16 * t);
                    for (int r = 0; r < rows; r++) {
                        const __m512bh xb = pair_of(x + (m0 + r) * x_stride, i);
                        for (int t = 0; t < tiles; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, w[t]);
                    }
                }
                for (int r = 0; r < rows; r++)
                    for (int t = 0; t < tiles; t++) total[r][t] = b0 == 0 ? acc[r][t] : _mm512_add_ps(total[r][t], acc[r][t]);
            }
            for (int r = 0; r < rows; r++)
                for (int t = 0; t < tiles; t++) {
                    _mm512_storeu_ps(scratch, total[r][t]);
                    uint16_t *o = out + (m0 + r) * n_out + n0 + 16 * t;
                    for (int j = 0; j < 16; j++) o[j] = f32_to_bf16(scratch[j]);
                }
        }
    }
}
#else
void bf16_gemv_rows(const uint16_t *x, int64_t x_stride, int64_t m_rows, int64_t k, const uint32_t *wp, int64_t n_out,
                    uint16_t *out, float *scratch) {
    (void)x; (void)x_stride; (void)m_rows; (void)k; (void)wp; (void)n_out; (void)out; (void)scratch;
}
#endif
