/* bf16 linear layers on AMX tiles (amx.h), included by linear.c where amx_on.
 *
 * Packed weight: K padded to KT = 32 and N to NQ = 32 with zeros; panel q (32 output columns)
 * is KB = Kp / 32 steps of two 1 KB B tiles, [kb][t][16 pairs][16 columns][2] (the VNNI pair
 * layout TDPBF16PS reads): tile (q, kb, t)[i][n][j] = w[32q + 16t + n][32kb + 2i + j].
 *
 * y[m, n] sums its pairs for kb = 0, 1, ..., KB - 1 in order from its own row of x and column
 * of w (amx.h), so a row's bits do not depend on the batch, the block or the thread split:
 * the same invariance as the vector kernels, with another (fixed) order. The zero padding
 * adds exact zeros. A block is 32 rows x 32 columns (four C tiles, two A and two B tiles per
 * k step); see amx_panel for the order of blocks.
 *
 * amx_linear_silu is the gate-up projection of a SwiGLU MLP with the activation applied as it
 * stores: panel q of the gate (columns 32q ..) and panel q + I / 32 of the up projection
 * (columns I + 32q ..) are summed for the same rows, each rounded to bf16 as amx_linear
 * stores it, and silu(gate) * up (simd.h's vsilu_mul, as pointwise.c's silu_mul) is what is
 * written. The same bits as amx_linear then silu_mul, without the [M, 2I] intermediate
 * written and read back.
 */
#ifndef PDSERVE_LINEAR_AMX_H
#define PDSERVE_LINEAR_AMX_H

#include "amx.h"

#define KT 32 /* k per tile step (16 bf16 pairs) */
#define NQ 32 /* output columns per panel: two B tiles */
#define MB 32 /* rows per block: two A tiles */

/* Tiles 0-3: C (rows r0, r0, r1, r1); 4, 5: A (r0, r1 rows); 6, 7: B. */
static void amx_configure_block(int rows) {
    int r0 = rows < 16 ? rows : 16, r1 = rows > 16 ? rows - 16 : 0;
    const int t[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    amx_configure(t);
}

static inline int64_t amx_packed_numel(int64_t N, int64_t K) {
    return (N + NQ - 1) / NQ * NQ * ((K + KT - 1) / KT * KT);
}

static void amx_pack(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, uint16_t *out) {
    int64_t KB = (K + KT - 1) / KT;
    for (int64_t q = 0; q * NQ < N; q++)
        for (int64_t kb = 0; kb < KB; kb++)
            for (int t = 0; t < 2; t++)
                for (int i = 0; i < KT / 2; i++)
                    for (int n = 0; n < 16; n++)
                        for (int j = 0; j < 2; j++) {
                            int64_t col = q * NQ + 16 * t + n, k = kb * KT + 2 * i + j;
                            *out++ = col < N && k < K ? w[col * ldw + k] : 0;
                        }
}

/* y[r, 32q .. 32q + ncols) for r < rows from the float32 block c[32][32], + bias, in bf16. */
static inline void amx_store(const float *c, int rows, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t ncols) {
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2 && 16 * h < ncols; h++) {
            int64_t nc = ncols - 16 * h < 16 ? ncols - 16 * h : 16;
            __mmask16 mk = (__mmask16)((1u << nc) - 1);
            __m512 v = _mm512_loadu_ps(c + r * NQ + 16 * h);
            if (bias) v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, bias + 16 * h)), 16)));
            _mm256_mask_storeu_epi16(y + r * ldy + 16 * h, mk, amx_round_bf16(v));
        }
}

/* Lines of the next panel that amx_block asks into L2 as it goes: `per` a k step, from `line`
 * up to `lines`. */
typedef struct {
    const char *next;
    int64_t line, lines, per;
} amx_prefetch;

/* One block of rows <= 32 (tiles configured for them) against panel wq, k steps [kb0, kb1):
 * C starts at zero (kb0 == 0) or from the float32 block c, and is stored back to c. x rows of
 * stride ldx elements. The last k step, when K is short of a multiple of 32, reads a
 * zero-padded copy of its columns. Staging C in memory between calls is exact (float32 both
 * ways), so a row's sum runs over kb = 0, 1, ... in order whatever the chunking. pf: the
 * next panel's lines to ask for, pf->per of them before each k step. */
static inline void amx_block(const uint16_t *x, int64_t ldx, int64_t K, const uint16_t *wq, int rows, float *c, int64_t kb0,
                             int64_t kb1, amx_prefetch *pf) {
    int64_t KB = K / KT, tail = K - KB * KT;
    uint16_t pad[MB * KT] __attribute__((aligned(64)));
    if (kb0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        if (rows > 16) {
            _tile_zero(2);
            _tile_zero(3);
        }
    } else {
        amx_load(0, c, NQ * 4);
        amx_load(1, c + 16, NQ * 4);
        if (rows > 16) {
            amx_load(2, c + 16 * NQ, NQ * 4);
            amx_load(3, c + 16 * NQ + 16, NQ * 4);
        }
    }
    for (int64_t kb = kb0; kb < kb1; kb++) {
        const uint16_t *b = wq + kb * 2 * 512, *xa = x + kb * KT;
        int64_t lda = ldx;
        if (kb == KB) { /* the short last step */
            memset(pad, 0, sizeof pad);
            for (int r = 0; r < rows; r++) memcpy(pad + r * KT, xa + r * ldx, (size_t)tail * 2);
            xa = pad;
            lda = KT;
        }
        for (int64_t e = pf->line + pf->per < pf->lines ? pf->line + pf->per : pf->lines; pf->line < e; pf->line++)
            _mm_prefetch(pf->next + 64 * pf->line, _MM_HINT_T1);
        amx_load(4, xa, lda * 2);
        amx_load(6, b, 64);
        amx_load(7, b + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows > 16) {
            amx_load(5, xa + 16 * lda, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, NQ * 4);
    _tile_stored(1, c + 16, NQ * 4);
    if (rows > 16) {
        _tile_stored(2, c + 16 * NQ, NQ * 4);
        _tile_stored(3, c + 16 * NQ + 16, NQ * 4);
    }
}

typedef struct {
    const uint16_t *x, *w, *bias;
    uint16_t *y;
    int64_t M, K, N, ldx, ldy;
    int64_t mc;     /* rows per chunk */
    int64_t silu;   /* 0, or I: y = silu(gate) * up, [M, I], from panels q and q + I / NQ (amx_linear_silu) */
    int64_t panels; /* the units of the column split: panels, or gate-up panel pairs */
} amx_args;

#define MC_MAX 256 /* rows per chunk at most: the chunk's float32 C blocks (32 KB, twice with silu) sit on the stack */
#define KC 8       /* k steps per pass over a chunk's row blocks: the panel's 16 KB of B stay in L1 */

/* Rows per chunk for K: the chunk's activations stay in L2 (<= 1 MB) across the panels. */
static inline int64_t amx_chunk_rows(int64_t K) {
    int64_t Kp = (K + KT - 1) / KT * KT, MC = (1024 * 1024 / (Kp * 2)) / MB * MB;
    return MC < MB ? MB : MC > MC_MAX ? MC_MAX : MC;
}

/* Rows [mc, mce) of one chunk against panel wq, into c ([rows][32] float32): the chunk's row
 * blocks take KC k steps at a time, so each B tile pair is read from L1 by every block instead
 * of from L2 (1.1-1.2x over one block's whole K at a time on the bundled model's shapes at
 * 256 rows, within run-to-run noise at 2,048 rows; a Sapphire Rapids core, 2026-12-02).
 * `next` (the panel after this one, or NULL) is asked into L2, a few lines every k step, so
 * that its read from DRAM runs under this panel's tile products: a step's weights come from
 * DRAM once per forward. The qkv and o projections of the bundled model at 256 rows took
 * 0.89-0.93x the time with it (one thread, 30 layers' weights in turn; the larger two within
 * noise; Xeon, 2026-12-07); spread over the k steps rather than asked at each block's start,
 * the 30 layers' projections at 32 rows took 17.8 ms against 20.8 (11.9 GB/s of weights
 * against 10.2; 1 row: 15.4 against 16.2 ms; Xeon, 2026-12-07). *config: the rows the tiles
 * are configured for. */
static inline void amx_panel(const amx_args *a, int64_t mc, int64_t mce, const uint16_t *wq, float *c, const char *next, int *config) {
    const int64_t KB = (a->K + KT - 1) / KT, kc = mce - mc > MB ? KC : KB; /* one block: no B to share, K in one pass */
    const int64_t steps = KB * ((mce - mc + MB - 1) / MB), lines = KB * 2 * 1024 / 64; /* k steps of all the blocks */
    amx_prefetch pf = {next, 0, next ? lines : 0, lines / steps + 1};
    for (int64_t k0 = 0; k0 < KB; k0 += kc)
        for (int64_t m = mc; m < mce; m += MB) {
            int rows = mce - m < MB ? (int)(mce - m) : MB;
            if (rows != *config) {
                amx_configure_block(rows);
                *config = rows;
            }
            amx_block(a->x + m * a->ldx, a->ldx, a->K, wq, rows, c + (m - mc) * NQ, k0, KB < k0 + kc ? KB : k0 + kc, &pf);
        }
}

/* y[r, 32q .. 32q + 32) for r < rows = silu(bf16(cg + bias_g)) * bf16(cu + bias_u), in bf16:
 * amx_store's rounding of each, then simd.h's vsilu_mul (rounded as it is stored). */
static inline void amx_store_silu(const float *cg, const float *cu, int rows, const uint16_t *bg, const uint16_t *bu, uint16_t *y, int64_t ldy) {
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) {
            __m512 g = _mm512_loadu_ps(cg + r * NQ + 16 * h), u = _mm512_loadu_ps(cu + r * NQ + 16 * h);
            if (bg) g = _mm512_add_ps(g, vload_bf16(bg + 16 * h)), u = _mm512_add_ps(u, vload_bf16(bu + 16 * h));
            vstore_bf16(y + r * ldy + 16 * h, vsilu_mul(vround_bf16(g), vround_bf16(u), 1));
        }
}

/* Rows [m_begin, m_end) against panels (or gate-up panel pairs) [q_begin, q_end). Rows go in
 * chunks (amx_chunk_rows); per panel, amx_panel. */
static void amx_tile(const amx_args *a, int64_t m_begin, int64_t m_end, int64_t q_begin, int64_t q_end) {
    const int64_t KB = (a->K + KT - 1) / KT, MC = a->mc, P = KB * 2 * 512, QI = a->silu / NQ; /* P: a panel's elements */
    float c[MC_MAX * NQ] __attribute__((aligned(64)));
    float cu[MC_MAX * NQ] __attribute__((aligned(64))); /* the up panel's, with silu */
    int config = -1; /* rows of the loaded config: 32 (full) or the tail's */
    for (int64_t mc = m_begin; mc < m_end; mc += MC) {
        int64_t mce = m_end < mc + MC ? m_end : mc + MC;
        for (int64_t q = q_begin; q < q_end; q++) {
            /* the next panel (the next chunk's first, after the last) */
            const char *next = (const char *)(q + 1 < q_end ? a->w + (q + 1) * P : mce < m_end ? a->w + q_begin * P : 0);
            if (a->silu) {
                amx_panel(a, mc, mce, a->w + q * P, c, (const char *)(a->w + (q + QI) * P), &config);
                amx_panel(a, mc, mce, a->w + (q + QI) * P, cu, next, &config);
                for (int64_t m = mc; m < mce; m += MB)
                    amx_store_silu(c + (m - mc) * NQ, cu + (m - mc) * NQ, mce - m < MB ? (int)(mce - m) : MB, a->bias ? a->bias + q * NQ : 0,
                                   a->bias ? a->bias + a->silu + q * NQ : 0, a->y + m * a->ldy + q * NQ, a->ldy);
                continue;
            }
            amx_panel(a, mc, mce, a->w + q * P, c, next, &config);
            int64_t ncols = a->N - q * NQ < NQ ? a->N - q * NQ : NQ;
            for (int64_t m = mc; m < mce; m += MB)
                amx_store(c + (m - mc) * NQ, mce - m < MB ? (int)(mce - m) : MB, a->bias ? a->bias + q * NQ : 0,
                          a->y + m * a->ldy + q * NQ, a->ldy, ncols);
        }
    }
    _tile_release();
}

/* Every row against panels [q_begin, q_end). */
static void amx_range(const void *args, int64_t q_begin, int64_t q_end) {
    const amx_args *a = (const amx_args *)args;
    amx_tile(a, 0, a->M, q_begin, q_end);
}

/* Row chunks [c_begin, c_end) against every panel: each thread keeps its chunk's
 * activations in its own L2, as one thread does (a panel split streams all of x per panel
 * range once x outgrows L2). */
static void amx_row_range(const void *args, int64_t c_begin, int64_t c_end) {
    const amx_args *a = (const amx_args *)args;
    int64_t end = c_end * a->mc < a->M ? c_end * a->mc : a->M;
    amx_tile(a, c_begin * a->mc, end, 0, a->panels);
}

/* Splits a's rows among nthreads where there are two or more chunks (amx_chunk_rows) per
 * thread: each thread keeps its chunk's activations in its own L2, as one thread does, and
 * reads the weight once per chunk (and where there are too few panels for the threads, in
 * chunks made small enough for two a thread). Else it splits the panels: each thread reads its share of
 * the weight once per chunk, where a row split would have each read all of it (the weight
 * comes from DRAM once per forward in a prefill, and with a few hundred rows that read is what
 * a row split would double). A row's bits are the same either way (amx.h). Two threads on a
 * Sapphire Rapids VM, bf16: 2,048 rows of the bundled model's o and down projections 1.8-1.9x
 * one thread, against 1.2-1.3x with the panel split (best of 80 calls, 2026-12-06); a
 * 256-token prefill of the bundled model's 30 layers 0.95x the time of the row split in 64-row
 * chunks (2026-12-07). */
static void amx_split(amx_args *a, int64_t nthreads) {
    if (a->M * a->N * a->K < (1 << 18)) nthreads = 1;
    if (nthreads > 1 && (a->M + a->mc - 1) / a->mc < 2 * nthreads && a->panels < 2 * nthreads && a->M >= 2 * nthreads * MB) {
        /* too few panels to share (a narrow output): rows in smaller chunks, two a thread */
        a->mc = ((a->M + 2 * nthreads - 1) / (2 * nthreads) + MB - 1) / MB * MB;
    }
    if (nthreads > 1 && (a->M + a->mc - 1) / a->mc >= 2 * nthreads) {
        parallel_ranges(amx_row_range, a, (a->M + a->mc - 1) / a->mc, 1, nthreads);
        return;
    }
    parallel_ranges(amx_range, a, a->panels, 1, nthreads);
}

/* x: [M, K] bf16 (row stride ldx); wp: amx_pack'd [N, K]; bias [N] or NULL; y: [M, N]
 * (row stride ldy). nthreads split the rows or the panels (amx_split). */
static void amx_linear(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N, const uint16_t *bias,
                       uint16_t *y, int64_t ldy, int64_t nthreads) {
    amx_args a = {x, wp, bias, y, M, K, N, ldx, ldy, amx_chunk_rows(K), 0, (N + NQ - 1) / NQ};
    amx_split(&a, nthreads);
}

/* The gate-up projection with SwiGLU's activation (see the top): x: [M, K] bf16 (row stride
 * ldx); wp: amx_pack'd [2I, K], gate rows then up rows; bias [2I] or NULL; act: [M, I] (row
 * stride ldact) = silu(x Wg^T + bg) * (x Wu^T + bu). I % 32 == 0 (each panel all gate or all
 * up). */
static void amx_linear_silu(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t I, const uint16_t *bias,
                            uint16_t *act, int64_t ldact, int64_t nthreads) {
    amx_args a = {x, wp, bias, act, M, K, 2 * I, ldx, ldact, amx_chunk_rows(K), I, I / NQ};
    amx_split(&a, nthreads);
}

/* The most TDPBF16PS work one thread can issue: iters x 24 tile products (16 x 16 x 32, 16,384
 * FLOPs each), rotating over four C tiles. Returns a value so the work is kept. */
static float amx_peak_probe(int64_t iters) {
    amx_configure_block(32);
    uint16_t a[16 * 32] __attribute__((aligned(64)));
    float c[16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) a[i] = 0x3f80; /* 1.0 */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    amx_load(4, a, 64);
    amx_load(5, a, 64);
    amx_load(6, a, 64);
    amx_load(7, a, 64);
    for (int64_t i = 0; i < iters; i++)
        for (int r = 0; r < 6; r++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0];
}

#endif
