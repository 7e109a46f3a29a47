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
#include <stdlib.h>
#include <string.h>

#define K_BLOCK 512 /* oneDNN's K block for this GEMV */
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

/* Pairs i0 .. i1 of one K block for rows m0 .. m0 + R against one tile of 16 * T outputs, the
 * R x T accumulators in registers (R * T <= 24 of 32). A K block is taken in pieces of
 * SUB_PAIRS, each piece for all rows in turn, so the piece of the tile (16 KB) stays in L1:
 * between pieces the accumulators wait in `part` (float32, so the chain of adds is unchanged);
 * at the end of the K block they are added in block order into the totals `total`, exactly as
 * oneDNN adds its block sums. part and total: [R, 64] float32, row stride 64. */
static inline __attribute__((always_inline)) void piece_rows(
    const uint16_t *x, int64_t x_stride, const uint32_t *tile, int64_t width, int64_t i0, int64_t i1, float *part,
    float *total, int block_start, int block_end, int first_block, const int R, const int T, const char *next_piece) {
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = block_start ? _mm512_setzero_ps() : _mm512_loadu_ps(part + r * 16 * TILE + 16 * t);
    for (int64_t i = i0; i < i1; i++) {
        if (next_piece) /* pair i's share of the next piece: T lines of 64 bytes, into L2 */
            for (int l = 0; l < T; l++) __builtin_prefetch(next_piece + (i - i0) * width * 4 + 64 * l, 0, 2);
        __m512bh w[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) w[t] = (__m512bh)_mm512_loadu_si512(tile + i * width + 16 * t);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512bh xb = pair_of(x + r * x_stride, i);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, w[t]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int64_t j = r * 16 * TILE + 16 * t;
            if (!block_end) _mm512_storeu_ps(part + j, acc[r][t]);
            else _mm512_storeu_ps(total + j, first_block ? acc[r][t] : _mm512_add_ps(_mm512_loadu_ps(total + j), acc[r][t]));
        }
}

#define ROWS 6        /* rows per pass over a piece of a weight tile: 6 x 4 accumulators */
/* From this many rows, the first row group's pass over a piece also fetches the next piece
 * (the next 16 KB of the packed weights: pieces, tiles and, in exact_gemv's arena, layers
 * follow each other in memory) into L2, while the other groups still compute on this one.
 * Measured on one Zen 4 core over the bundled model's 211 layers (weights from DRAM, one
 * process, alternating): 12 rows 25.1 -> 20.4 ms, 16 rows 29.7 -> 24.9, 32 rows 50.3 -> 46.0,
 * 64 rows 92.5 -> 88.0; 8 rows the same; 1 and 4 rows slower (10.1 -> 13.4, 12.0 -> 16.7 ms:
 * there the loop streams at the memory's pace and the hardware prefetcher does better alone). */
#define PREFETCH_MIN_ROWS 12
#define SUB_PAIRS 64  /* pairs per piece: 64 x 64 outputs x 4 bytes = 16 KB of weights */
#define CASE_T(R, T) case T: piece_rows(xr, x_stride, tile, width, i0, i1, part, tot, i0 == b0, i1 == b1, b0 == 0, R, T, \
                                        g == 0 && m_rows >= PREFETCH_MIN_ROWS ? (const char *)(tile + i1 * width) : NULL); break;
#define CASE_R(R) case R: switch (tiles) { CASE_T(R, 1) CASE_T(R, 2) CASE_T(R, 3) CASE_T(R, 4) } break;

/* [2, M, 64] float32 per thread (totals, then running sums), kept between calls. Returns NULL if out of memory. */
static float *scratch_for(int64_t m_rows) {
    static __thread float *buf;
    static __thread int64_t cap;
    if (2 * m_rows * 16 * TILE > cap) {
        free(buf);
        cap = 2 * m_rows * 16 * TILE;
        buf = malloc(sizeof(float) * cap);
        if (!buf) cap = 0;
    }
    return buf;
}

/* Returns 0, or -1 if scratch memory could not be had (out is then unwritten). */
int bf16_gemv_rows(const uint16_t *x, int64_t x_stride, int64_t m_rows, int64_t k, const uint32_t *wp, int64_t n_out,
                   uint16_t *out) {
    const int64_t pairs = k / 2, block_pairs = K_BLOCK / 2;
    float *scratch = scratch_for(m_rows);
    if (!scratch) return -1;
    const int64_t groups = (m_rows + ROWS - 1) / ROWS; /* rows split evenly: 32 = 6 + 6 + 5 + 5 + 5 + 5 */
#define rows_in(g) (m_rows / groups + ((g) < m_rows % groups))
    for (int64_t n0 = 0; n0 < n_out; n0 += 16 * TILE) {
        const int64_t tiles = (n_out - n0) / 16 < TILE ? (n_out - n0) / 16 : TILE, width = 16 * tiles;
        const uint32_t *tile = wp + n0 * (k / 2);
        for (int64_t b0 = 0; b0 < pairs; b0 += block_pairs) {
            const int64_t b1 = b0 + block_pairs < pairs ? b0 + block_pairs : pairs;
            for (int64_t i0 = b0; i0 < b1; i0 += SUB_PAIRS) {
                const int64_t i1 = i0 + SUB_PAIRS < b1 ? i0 + SUB_PAIRS : b1;
                for (int64_t g = 0, m0 = 0; g < groups; m0 += rows_in(g), g++) {
                    const uint16_t *xr = x + m0 * x_stride;
                    float *tot = scratch + m0 * 16 * TILE, *part = scratch + (m_rows + m0) * 16 * TILE;
                    switch (rows_in(g)) { CASE_R(1) CASE_R(2) CASE_R(3) CASE_R(4) CASE_R(5) CASE_R(6) }
                }
            }
        }
        for (int64_t m = 0; m < m_rows; m++) {
            uint16_t *o = out + m * n_out + n0;
            for (int64_t j = 0; j < width; j++) o[j] = f32_to_bf16(scratch[m * 16 * TILE + j]);
        }
    }
    return 0;
}
/* The core's bf16 dot-product peak, for bench/hardware.py: `iters` rounds of 24 independent
 * VDPBF16PS chains (64 FLOP each), enough to hide the instruction's latency. Returns a sum of
 * the results, so that the compiler keeps the work. */
float bf16_dot_peak_probe(int64_t iters) {
    __m512 acc[24];
    for (int c = 0; c < 24; c++) acc[c] = _mm512_setzero_ps();
    __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3c003c00); /* 1.0, 2^-7 */
    for (int64_t i = 0; i < iters; i++) {
        __asm__ volatile("" : "+v"(x), "+v"(y)); /* opaque inputs: no folding across rounds */
#pragma GCC unroll 24
        for (int c = 0; c < 24; c++) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
    }
    float total = 0.f;
    for (int c = 0; c < 24; c++) total += _mm512_reduce_add_ps(acc[c]);
    return total;
}
#else
float bf16_dot_peak_probe(int64_t iters) {
    (void)iters;
    return -1.f;
}

int bf16_gemv_rows(const uint16_t *x, int64_t x_stride, int64_t m_rows, int64_t k, const uint32_t *wp, int64_t n_out,
                   uint16_t *out) {
    (void)x; (void)x_stride; (void)m_rows; (void)k; (void)wp; (void)n_out; (void)out;
    return -1;
}
#endif
