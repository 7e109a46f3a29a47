/* Batch-invariant linear layers: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]).
 *
 * Weights are packed once (linear_pack_*) into panels of NP output columns, k-major:
 * panel p holds w[p*NP : (p+1)*NP, :] as [K, NP] (float32, and bf16 without AVX512-BF16) or
 * [ceil(K/2), NP, 2] (bf16 pairs for vdpbf16ps). N is padded to a whole panel with zeros.
 *
 * The micro-kernel is an outer product: a tile of MR rows x NP columns keeps MR * NP / VL
 * accumulators in registers, and for each k broadcasts x[r, k] against the panel's row k
 * (GotoBLAS' register blocking; each weight vector feeds MR FMAs). Each output y[m, n] is one
 * accumulator that adds x[m, k] * w[n, k] for k = 0, 1, ..., K-1 in order (bf16 with
 * vdpbf16ps: pairs k = 2i, 2i+1 in order), then the bias. That order depends on K only:
 * not on M, on the row's place in the batch, on the tile, nor on the thread count (threads
 * split panels). So a token's outputs are the same bits alone, in any batch, in a prefill or
 * a decode step: what tests/unit/test_batch_invariance.py checks end to end.
 *
 * A panel ([K, NP]: 147 KB at K = 576 in float32) stays in L2 while all row tiles pass it.
 * dtypes: float32 (x, w, y float32); bf16 (x, w, bias, y bf16; sums in float32, y rounded to
 * nearest even once). Without AVX512-BF16, bf16 weights widen to float32 in registers: half
 * the weight bytes of float32 on AVX2, where torch's own bf16 matmul is a slow loop.
 *
 * qlinear_* take a GGUF's quantized blocks instead (linear_q.h): widened to exactly the
 * de-quantized weights and summed by the same micro-kernels, so the same bits.
 */
#include "parallel.h"
#include "simd.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#include "linear_amx.h" /* bf16 on AMX tiles where the kernel grants them (amx_on) */
#else
static const int amx_on = 0;
#endif

#ifndef NC
#if VL == 16
#define NC 4 /* vectors per panel row: MR * NC accumulators + NC weights + 1 broadcast registers */
#elif VL == 8
#define NC 2
#else
#define NC 4
#endif
#endif
#ifndef MR
#define MR 6 /* rows per tile */
#endif
#define NP (NC * VL) /* columns per panel */

typedef struct {
    const void *x, *w, *bias;
    void *y;
    int64_t M, K, N, ldx, ldy;
    int64_t mb, blocks; /* rows per row block (a multiple of MR), row blocks per panel */
} linear_args;


/* Elements of the packed weight for [N, K] (dtype bf16 != 0 or float32). */
int64_t linear_packed_numel(int64_t N, int64_t K, int bf) {
#ifdef PDSERVE_LINEAR_AMX_H
    if (bf && amx_on) return amx_packed_numel(N, K);
#endif
    int64_t np = (N + NP - 1) / NP;
    return np * NP * (bf ? 2 * ((K + 1) / 2) : K);
}

void linear_pack_f32(const float *w, int64_t N, int64_t K, int64_t ldw, float *out) {
    for (int64_t p = 0; p * NP < N; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NP; j++) {
                int64_t n = p * NP + j;
                out[(p * K + k) * NP + j] = n < N ? w[n * ldw + k] : 0.0f;
            }
}

void linear_pack_bf16(const uint16_t *w, int64_t N, int64_t K, int64_t ldw, uint16_t *out) {
#ifdef PDSERVE_LINEAR_AMX_H
    if (amx_on) {
        amx_pack(w, N, K, ldw, out);
        return;
    }
#endif
    int64_t K2 = (K + 1) / 2;
    for (int64_t p = 0; p * NP < N; p++)
        for (int64_t j = 0; j < NP; j++) {
            int64_t n = p * NP + j;
            for (int64_t k = 0; k < 2 * K2; k++) {
                uint16_t v = n < N && k < K ? w[n * ldw + k] : 0;
#if defined(__AVX512BF16__)
                out[((p * K2 + k / 2) * NP + j) * 2 + k % 2] = v; /* [K2, NP, 2] */
#else
                out[(p * 2 * K2 + k) * NP + j] = v; /* [K (+1), NP] */
#endif
            }
        }
}

static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const float *wp, int64_t K, const float *bias,
                                                           float *y, int64_t ldy, int64_t ncols, const int R) {
    vf acc[MR][NC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = vzero();
    for (int64_t k = 0; k < K; k++) {
        vf wv[NC];
        for (int c = 0; c < NC; c++) wv[c] = vload(wp + k * NP + c * VL);
        for (int r = 0; r < R; r++) {
            vf xv = vset1(x[r * ldx + k]);
            for (int c = 0; c < NC; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
        }
    }
    float buf[NP];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < NC; c++) vstore(buf + c * VL, acc[r][c]);
        for (int64_t j = 0; j < ncols; j++) y[r * ldy + j] = bias ? buf[j] + bias[j] : buf[j];
    }
}

static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t K,
                                                            const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t ncols, const int R) {
    int64_t K2 = (K + 1) / 2;
#if defined(__AVX512BF16__)
    __m512 acc[MR][NC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; k2++) {
        __m512i wv[NC];
        for (int c = 0; c < NC; c++) wv[c] = _mm512_loadu_si512((const void *)(wp + (k2 * NP + c * VL) * 2));
        for (int r = 0; r < R; r++) {
            const uint16_t *xr = x + r * ldx + 2 * k2;
            int32_t pair = 2 * k2 + 1 < K ? *(const int32_t *)xr : (int32_t)xr[0]; /* odd K: (x[K-1], 0) */
            __m512i xv = _mm512_set1_epi32(pair);
            for (int c = 0; c < NC; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
        }
    }
#else
    vf acc[MR][NC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = vzero();
    for (int64_t k = 0; k < K; k++) {
        vf wv[NC];
        for (int c = 0; c < NC; c++) wv[c] = vload_bf16(wp + k * NP + c * VL);
        for (int r = 0; r < R; r++) {
            vf xv = vset1(bf16_to_f32(x[r * ldx + k]));
            for (int c = 0; c < NC; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
        }
    }
    (void)K2;
#endif
    float buf[NP];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < NC; c++) vstore(buf + c * VL, acc[r][c]);
        for (int64_t j = 0; j < ncols; j++) y[r * ldy + j] = bf16_round(bias ? buf[j] + bf16_to_f32(bias[j]) : buf[j]);
    }
}

#define CASE(TILE, R) \
    case R: TILE(xp, a->ldx, wp, a->K, bp, yp, a->ldy, ncols, R); break;

/* Every row tile of x in rows [m0, m1) against the panel wp (columns n .. n + ncols). */
#define ROW_TILES_IN(TILE, T, m0, m1)                                                               \
    for (int64_t m = (m0); m < (m1); m += MR) {                                                     \
        const T *xp = (const T *)a->x + m * a->ldx;                                                 \
        T *yp = (T *)a->y + m * a->ldy + n;                                                         \
        switch ((m1) - m < MR ? (int)((m1) - m) : MR) {                                             \
            CASE(TILE, 1) CASE(TILE, 2) CASE(TILE, 3) CASE(TILE, 4) CASE(TILE, 5)                   \
            default: TILE(xp, a->ldx, wp, a->K, bp, yp, a->ldy, ncols, MR);                         \
            break;                                                                                  \
        }                                                                                           \
    }
#define ROW_TILES(TILE, T) ROW_TILES_IN(TILE, T, 0, a->M)

/* Units u in [begin, end): panel u / blocks, row block u % blocks (consecutive units share a
 * panel, which stays in cache). Which unit a thread takes changes no output's sum. */
#define RANGE(NAME, TILE, T, PANEL_NUMEL)                                                           \
    static void NAME(const void *args, int64_t begin, int64_t end) {                                \
        const linear_args *a = (const linear_args *)args;                                           \
        for (int64_t u = begin; u < end; u++) {                                                     \
            const int64_t p = u / a->blocks, m0 = u % a->blocks * a->mb;                            \
            const int64_t m1 = m0 + a->mb < a->M ? m0 + a->mb : a->M;                               \
            int64_t n = p * NP, ncols = a->N - n < NP ? a->N - n : NP;                              \
            const T *wp = (const T *)a->w + p * (PANEL_NUMEL);                                      \
            const T *bp = a->bias ? (const T *)a->bias + n : 0;                                     \
            ROW_TILES_IN(TILE, T, m0, m1)                                                           \
        }                                                                                           \
    }

RANGE(range_f32, tile_f32, float, a->K * NP)
RANGE(range_bf16, tile_bf16, uint16_t, 2 * ((a->K + 1) / 2) * NP)

#include "linear_q.h" /* GGUF quantized weights, widened a panel at a time into the tiles above */

typedef struct {
    const void *x, *bias;
    const uint8_t *wq;
    void *y;
    int64_t M, K, N, ldx, ldy;
} qlinear_args;

/* Up to MR rows: q_tile straight from the blocks (where AVX-512 has it); returns 0 otherwise. */
static int q_fused(const qlinear_args *a, int64_t p_begin, int64_t p_end, int bf) {
#if (defined(__AVX512F__) && VL == 16) || defined(Q_TILE_AVX2)
    if (a->M > MR) return 0;
    const int64_t es = bf ? 2 : 4;
    for (int64_t p = p_begin; p < p_end; p++) {
        int64_t n = p * NP, ncols = a->N - n < NP ? a->N - n : NP;
        const char *bp = a->bias ? (const char *)a->bias + n * es : 0;
        char *yp = (char *)a->y + n * es;
        switch ((int)a->M) {
        case 1: q_tile(a->wq, n, a->x, a->ldx, bp, yp, a->ldy, ncols, bf, 1); break;
        case 2: q_tile(a->wq, n, a->x, a->ldx, bp, yp, a->ldy, ncols, bf, 2); break;
        case 3: q_tile(a->wq, n, a->x, a->ldx, bp, yp, a->ldy, ncols, bf, 3); break;
        case 4: q_tile(a->wq, n, a->x, a->ldx, bp, yp, a->ldy, ncols, bf, 4); break;
        case 5: q_tile(a->wq, n, a->x, a->ldx, bp, yp, a->ldy, ncols, bf, 5); break;
        default: q_tile(a->wq, n, a->x, a->ldx, bp, yp, a->ldy, ncols, bf, MR); break;
        }
    }
    return 1;
#else
    (void)a, (void)p_begin, (void)p_end, (void)bf;
    return 0;
#endif
}

#define QRANGE(NAME, TILE, T, BF)                                                                   \
    static void NAME(const void *args, int64_t p_begin, int64_t p_end) {                            \
        const qlinear_args *a = (const qlinear_args *)args;                                         \
        if (q_fused(a, p_begin, p_end, BF)) return;                                                 \
        T *wp = (T *)q_scratch(sizeof(T) * (size_t)(2 * ((a->K + 1) / 2) * NP));                   \
        if (!wp) abort(); /* a few hundred KB: out of memory */                                     \
        for (int64_t p = p_begin; p < p_end; p++) {                                                 \
            int64_t n = p * NP, ncols = a->N - n < NP ? a->N - n : NP;                              \
            const T *bp = a->bias ? (const T *)a->bias + n : 0;                                     \
            q_panel(a->wq, n, BF, wp);                                                              \
            ROW_TILES(TILE, T)                                                                      \
        }                                                                                           \
    }

QRANGE(qrange_f32, tile_f32, float, 0)
QRANGE(qrange_bf16, tile_bf16, uint16_t, 1)

/* out: [N, K] float32, the weights qlinear_f32 computes with (a panel at a time, as it does). */
void qlinear_dequant(const uint8_t *wq, float *out) {
    const int64_t *h = (const int64_t *)wq, N = h[1], K = h[2];
    float *panel = q_scratch(sizeof(float) * (size_t)(K * NP));
    if (!panel) abort();
    for (int64_t n0 = 0; n0 < N; n0 += NP) {
        q_panel(wq, n0, 0, panel);
        for (int64_t j = 0; j < NP && n0 + j < N; j++)
            for (int64_t k = 0; k < K; k++) out[(n0 + j) * K + k] = panel[k * NP + j];
    }
}

/* The call's panels over threads (one thread below 2^18 multiply-adds); a: a linear_args or
 * qlinear_args, whose M, K, N sit at the same place in both. */
#define split_panels(fn, a, nthreads)                                                                  \
    parallel_ranges(fn, a, ((a)->N + NP - 1) / NP, 1, (a)->M * (a)->N * (a)->K < (1 << 18) ? 1 : (nthreads))

/* linear_f32 / linear_bf16 over a qlinear_pack'd weight wq ([N, K], N and K in its header):
 * the same bits as those over the de-quantized weight, except bf16 where AMX is on (the
 * dense path runs on tiles there; callers keep dense weights, ops.py ``quantized_ok``). */
void qlinear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wq, int64_t N, const float *bias, float *y,
                int64_t ldy, int64_t nthreads) {
    qlinear_args a = {x, bias, wq, y, M, K, N, ldx, ldy};
    split_panels(qrange_f32, &a, nthreads);
}

void qlinear_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *wq, int64_t N, const uint16_t *bias,
                 uint16_t *y, int64_t ldy, int64_t nthreads) {
    qlinear_args a = {x, bias, wq, y, M, K, N, ldx, ldy};
    split_panels(qrange_bf16, &a, nthreads);
}

/* Units of work for nthreads: each panel's rows in `blocks` row blocks of `mb` rows (a
 * multiple of MR), enough of them that the threads' shares come out even (a layer of 576
 * outputs has 9 panels: 5 and 4 over two threads, a prefill's 256 rows split give 1.8x ->
 * about 2x), none smaller than a few tiles. */
static void split_rows(linear_args *a, int64_t nthreads) {
    const int64_t panels = (a->N + NP - 1) / NP, want = 16 * nthreads, min_rows = 4 * MR;
    int64_t blocks = nthreads > 1 && panels < want ? (want + panels - 1) / panels : 1;
    if (blocks > (a->M + min_rows - 1) / min_rows) blocks = (a->M + min_rows - 1) / min_rows;
    if (blocks < 1) blocks = 1;
    a->mb = ((a->M + blocks - 1) / blocks + MR - 1) / MR * MR;
    a->blocks = (a->M + a->mb - 1) / a->mb;
}

#define split_units(fn, a, nthreads)                                                                   \
    parallel_ranges(fn, a, ((a)->N + NP - 1) / NP * (a)->blocks, 1, (a)->M * (a)->N * (a)->K < (1 << 18) ? 1 : (nthreads))

/* x: [M, K] (row stride ldx elements); wp: packed [N, K] (linear_pack_*); bias: [N] or NULL;
 * y: [M, N] (row stride ldy). nthreads >= 1 split the panels and, where there are few, the rows. */
void linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp, int64_t N, const float *bias, float *y,
                int64_t ldy, int64_t nthreads) {
    linear_args a = {x, wp, bias, y, M, K, N, ldx, ldy, M, 1};
    split_rows(&a, nthreads);
    split_units(range_f32, &a, nthreads);
}

void linear_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t N, const uint16_t *bias,
                 uint16_t *y, int64_t ldy, int64_t nthreads) {
#ifdef PDSERVE_LINEAR_AMX_H
    if (amx_on) {
        amx_linear(x, M, K, ldx, wp, N, bias, y, ldy, nthreads);
        return;
    }
#endif
    linear_args a = {x, wp, bias, y, M, K, N, ldx, ldy, M, 1};
    split_rows(&a, nthreads);
    split_units(range_bf16, &a, nthreads);
}

/* A SwiGLU MLP's gate-up projection and activation in one pass where AMX is on: x: [M, K]
 * bf16 (row stride ldx); wp: packed [2I, K] (gate rows, then up rows); bias: [2I] or NULL;
 * act: [M, I] (row stride ldact) = silu(gate) * up, the same bits as linear_bf16 into
 * [M, 2I] then pointwise.c's silu_mul (linear_amx.h). Returns 0, or -1 where it does not
 * apply (no AMX, or I % 32 != 0): then nothing is written. */
int linear_silu_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *wp, int64_t I, const uint16_t *bias,
                     uint16_t *act, int64_t ldact, int64_t nthreads) {
#ifdef PDSERVE_LINEAR_AMX_H
    if (amx_on && I % NQ == 0) {
        amx_linear_silu(x, M, K, ldx, wp, I, bias, act, ldact, nthreads);
        return 0;
    }
#endif
    (void)x, (void)M, (void)K, (void)ldx, (void)wp, (void)I, (void)bias, (void)act, (void)ldact, (void)nthreads;
    return -1;
}

/* The path the kernels take for a dtype (bf != 0: bf16): "amx_bf16" for bf16 where AMX is
 * on (linear_amx.h, attention_amx.h), else the vector ISA (simd_isa). */
const char *linear_isa(int bf) { return bf && amx_on ? "amx_bf16" : simd_isa(); }

/* The most FMA work one thread can issue: 24 independent chains of the micro-kernel's
 * instruction (vdpbf16ps for bf != 0 on AVX512-BF16, else the float32 vector FMA; bf16
 * without the instruction runs float32 FMAs too; bf16 on AMX: 24 TDPBF16PS). Returns a value
 * so the work is kept; FLOPs = iters * 24 * fma_flops_per_instruction(bf). */
float fma_peak_probe(int64_t iters, int bf) {
    vf acc[24];
    for (int i = 0; i < 24; i++) acc[i] = vset1((float)i * 1e-3f);
    vf a = vset1(1.0000001f), b = vset1(0.9999999f);
#ifdef PDSERVE_LINEAR_AMX_H
    if (bf && amx_on) return amx_peak_probe(iters);
#endif
#if defined(__AVX512BF16__)
    if (bf) {
        __m512 c[24];
        for (int i = 0; i < 24; i++) c[i] = acc[i];
        __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < 24; i++) c[i] = _mm512_dpbf16_ps(c[i], x, y);
        float s = 0;
        for (int i = 0; i < 24; i++) s += vsum(c[i]);
        return s;
    }
#endif
    (void)bf;
    for (int64_t t = 0; t < iters; t++)
        for (int i = 0; i < 24; i++) acc[i] = vfma(a, acc[i], b);
    float s = 0;
    for (int i = 0; i < 24; i++) s += vsum(acc[i]);
    return s;
}

int64_t fma_flops_per_instruction(int bf) {
    if (bf && amx_on) return 16 * 16 * 32 * 2; /* one TDPBF16PS */
#if defined(__AVX512BF16__)
    if (bf) return VL * 4;
#endif
    (void)bf;
    return VL * 2;
}
