/* Paged causal attention over the KV pool, for prompt chunks and decode tokens alike.
 *
 * Token t of sequence s at position p attends to its sequence's keys 0..p, read in place
 * from the pool through s's block table. Keys go in tiles of KT, aligned at position 0, with
 * an online softmax (running max m, sum l, accumulator acc; FlashAttention's recurrence,
 * Dao et al. 2022, eq. in sec. 3.1). Every query row is computed by itself in this one fixed
 * order, so its output depends on p and its context only: the same bits whether the token
 * is in a whole prompt, a chunk of it, a decode step, a batch of 1 or 64, or recomputed after
 * preemption. The query heads that share a KV head, and up to QB consecutive tokens of a
 * sequence, are done together (each key and value widened once for all their rows), which
 * changes no row's sums.
 *
 * Layouts: q [T, heads, D] (token stride ldq elements, heads contiguous D apart);
 * k_cache, v_cache [kv_heads, slots, D] (slot = block * block_size + offset);
 * block_tables [S, max_blocks] int32; token_seq [T] int32 (row of block_tables);
 * positions [T] int64; out [T, heads, D] contiguous. bf != 0: q, K, V, out are bf16
 * (uint16_t), math in float32, out rounded once.
 *
 * bf16 with D % 32 == 0 takes attention_amx.h where AMX is on, else attention_dp.h where the
 * CPU has AVX512-BF16: the same units and invariance, with bf16 products and probabilities.
 * Two options, per call: a sliding window W (row p sees keys max(0, p - W + 1) .. p, HF's
 * kv_idx > q_idx - sliding_window; Mistral, Gemma) and soft-capping c (each scaled score s
 * becomes c tanh(s / c), Gemma 2's attn_logit_softcapping). A row with a window starts at the
 * tile holding its first key and masks the keys before it in that tile: which tiles a row
 * reads and how, is still a function of its position only. AMX leaves both to the
 * AVX512-BF16 path.
 * Every path asks for the next tile's keys and values ahead (into L2), a few rows at a time
 * between the current tile's pieces of work (prefetch_rows): a head's keys fill a 4 KiB page
 * every 32 (bf16) or 16 (float32) keys, and hardware prefetchers stop at pages.
 */
#include <float.h>
#include <stdlib.h>

#include "parallel.h"
#include "simd.h"

#define KT 16        /* keys per tile */
#define MAX_GROUP 32 /* query heads per KV head */
#define MAX_D 256
#define QB 32 /* query tokens per unit: a tile is widened once for all their rows */
#define RB 4  /* rows per block of a prompt chunk (float32, AVX-512): each key and value vector loaded once for them */
#define PV_RB RB

/* exp(x) for 16 floats in place (simd.h's vexp; expf where there are no vectors). */
static void exp16(float *x) {
#if VL > 1
    for (int h = 0; h < 16; h += VL) vstore(x + h, vexp(vload(x + h)));
#else
    for (int i = 0; i < 16; i++) x[i] = expf(x[i]);
#endif
}

/* A row of n elements (float32 or bf16) widened into float32 dst. */
static inline void widen_row(float *dst, const void *src, int64_t n, int bf) {
    int64_t d = 0;
    if (bf)
        for (; d + VL <= n; d += VL) vstore(dst + d, vload_bf16((const uint16_t *)src + d));
    else
        for (; d + VL <= n; d += VL) vstore(dst + d, vload((const float *)src + d));
    for (; d < n; d++) dst[d] = ld(src, d, bf);
}

#if defined(__AVX512F__)
/* In-register transpose of 16 rows of 16 floats: out[i][j] = in[j][i]. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xDD);
        t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
    }
}

/* The tile's keys transposed, kt[d][j] = k_j[d] (zeros past n): a permutation, no rounding. */
static void transpose_keys(float *kt, const char *const *kr, int64_t n, int64_t D, int bf) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < n ? (bf ? vload_bf16((const uint16_t *)kr[j] + d0) : _mm512_loadu_ps((const float *)kr[j] + d0)) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t i = 0; i < 16; i++) _mm512_storeu_ps(kt + (d0 + i) * KT, r[i]);
    }
}

#endif

/* s[j] = q . k_j for the tile's keys j < n (0 past n). Each is one vector accumulator over d
 * in chunks of VL (lane l sums d = l, l + VL, ... in order), its lanes then added in vsum()'s
 * tree: on AVX-512 (D a multiple of 16) by a network that sums 16 keys' lanes at once in that
 * same tree, elsewhere by vsum() per key (then the D % VL tail in order). Keys are widened
 * from kr[j] as they are read. */
static inline void tile_scores(float *s, const float *q, const char *const *kr, int64_t n, int64_t D, int bf) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        __m512 a[16];
        for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) { /* chunk by chunk across the keys: 16 independent chains */
            __m512 qc = _mm512_loadu_ps(q + c);
            if (n == 16 && bf)
                for (int j = 0; j < 16; j++) a[j] = _mm512_fmadd_ps(qc, vload_bf16((const uint16_t *)kr[j] + c), a[j]);
            else if (n == 16)
                for (int j = 0; j < 16; j++) a[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps((const float *)kr[j] + c), a[j]);
            else
                for (int j = 0; j < 16; j++)
                    if (j < n) a[j] = _mm512_fmadd_ps(qc, bf ? vload_bf16((const uint16_t *)kr[j] + c) : _mm512_loadu_ps((const float *)kr[j] + c), a[j]);
        }
        __m512 x[8], y[4], z[2];
        for (int i = 0; i < 8; i++) /* lane i + lane i + 8 (vsum's first step) */
            x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
        for (int i = 0; i < 4; i++) /* + lane i + 4 */
            y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88), _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
        for (int i = 0; i < 2; i++) /* + lane i + 2 */
            z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44), _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
        __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD)); /* + lane 1 */
        /* lane 4k + i holds key 4i + k */
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_storeu_ps(s, _mm512_permutexvar_ps(order, w));
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (D % 8 == 0) { /* 8 keys at a time: one accumulator each, their lanes added by a network in vsum()'s tree */
        for (int64_t j0 = 0; j0 < KT; j0 += 8) {
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < D; c += 8) {
                __m256 qc = _mm256_loadu_ps(q + c);
                if (n == KT && !bf)
                    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps((const float *)kr[j0 + j] + c), a[j]);
                else if (n == KT)
                    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qc, vload_bf16((const uint16_t *)kr[j0 + j] + c), a[j]);
                else
                    for (int j = 0; j < 8; j++)
                        if (j0 + j < n) a[j] = _mm256_fmadd_ps(qc, bf ? vload_bf16((const uint16_t *)kr[j0 + j] + c) : _mm256_loadu_ps((const float *)kr[j0 + j] + c), a[j]);
            }
            __m256 t[4], u[2];
            for (int i = 0; i < 4; i++) /* lane i + lane i + 4, two keys a vector */
                t[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20), _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
            for (int i = 0; i < 2; i++) /* + lane i + 2 */
                u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
            __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD)); /* + lane 1: keys 0 2 4 6 | 1 3 5 7 */
            _mm256_storeu_ps(s + j0, _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        return;
    }
#endif
    for (int64_t j = 0; j < KT; j++) {
        if (j >= n) {
            s[j] = 0.0f;
            continue;
        }
        vf acc = vzero();
        int64_t c = 0;
        for (; c + VL <= D; c += VL)
            acc = vfma(vload(q + c), bf ? vload_bf16((const uint16_t *)kr[j] + c) : vload((const float *)kr[j] + c), acc);
        float t = vsum(acc);
        for (; c < D; c++) t = fmaf(q[c], ld(kr[j], c, bf), t);
        s[j] = t;
    }
}

#if defined(__AVX512F__)
/* The 16-key network's first three levels on 8 keys (one half of a tile): z holds their
 * partial lane sums as tile_scores' z[half]. */
static inline __attribute__((always_inline)) void net8(__m512 *a, __m512 *z) {
    __m512 x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88), _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    *z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
}
/* The network's last level over the two halves' z, stored as 16 scores in key order. */
static inline void net_store(float *s, __m512 z0, __m512 z1) {
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); /* lane 4k + i holds key 4i + k */
    _mm512_storeu_ps(s, _mm512_permutexvar_ps(order, _mm512_add_ps(_mm512_shuffle_ps(z0, z1, 0x88), _mm512_shuffle_ps(z0, z1, 0xDD))));
}
/* tile_scores for three rows at once (three query heads of one token) over a full tile of
 * 16 keys, D % 16 == 0: each key chunk is widened once for the three. Per row and key the
 * same FMAs in the same order and the same lane tree as tile_scores, so the same bits. */
static void tile_scores3_full(float s[3][KT], const float *q0, const float *q1, const float *q2, const char *const *kr, int64_t D, int bf) {
    __m512 z[2][3];
    for (int half = 0; half < 2; half++) {
        __m512 a0[8], a1[8], a2[8];
        for (int j = 0; j < 8; j++) a0[j] = a1[j] = a2[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            __m512 x0 = _mm512_loadu_ps(q0 + c), x1 = _mm512_loadu_ps(q1 + c), x2 = _mm512_loadu_ps(q2 + c);
            for (int j = 0; j < 8; j++) {
                const char *p = kr[half * 8 + j];
                __m512 k = bf ? vload_bf16((const uint16_t *)p + c) : _mm512_loadu_ps((const float *)p + c);
                a0[j] = _mm512_fmadd_ps(x0, k, a0[j]);
                a1[j] = _mm512_fmadd_ps(x1, k, a1[j]);
                a2[j] = _mm512_fmadd_ps(x2, k, a2[j]);
            }
        }
        net8(a0, &z[half][0]); net8(a1, &z[half][1]); net8(a2, &z[half][2]);
    }
    for (int r = 0; r < 3; r++) net_store(s[r], z[0][r], z[1][r]);
}
#endif

/* One row's online-softmax step over a tile (FlashAttention's recurrence, Dao et al. 2022,
 * sec. 3.1): s[lo .. nr) are its scores (s has KT floats; lo > 0 where a window starts inside
 * the tile), m, l its running max and sum, acc its [D] accumulator. acc is rescaled where the
 * max grew; s becomes the probabilities exp(s - m) on [lo, nr), zeros before lo (past nr:
 * zeros, or unused). */
static inline __attribute__((always_inline)) void softmax_row(float *s, int64_t lo, int64_t nr, float *m, float *l, float *acc, int64_t D) {
#if defined(__AVX512F__) && KT == 16
    __mmask16 mk = (__mmask16)(((1u << nr) - 1) & ~((1u << lo) - 1)); /* in registers: lanes outside [lo, nr) masked out */
    __m512 sv = _mm512_mask_blend_ps(mk, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(s));
    float mt = _mm512_reduce_max_ps(sv);
#else
    float mt = -INFINITY;
    for (int64_t j = lo; j < nr; j++) mt = s[j] > mt ? s[j] : mt;
#endif
    float mn = *m > mt ? *m : mt;
    if (*m != mn && *m != -INFINITY) { /* rescale what came before */
        float alpha = expf(*m - mn);
        *l *= alpha;
        vf av = vset1(alpha);
        int64_t d = 0;
        for (; d + VL <= D; d += VL) vstore(acc + d, vmul(vload(acc + d), av));
        for (; d < D; d++) acc[d] *= alpha;
    }
    *m = mn;
#if defined(__AVX512F__) && KT == 16
    __m512 e = _mm512_maskz_mov_ps(mk, vexp(_mm512_maskz_sub_ps(mk, sv, _mm512_set1_ps(mn))));
    *l += _mm512_reduce_add_ps(e);
    _mm512_storeu_ps(s, e);
#else
    for (int64_t j = 0; j < KT; j++) s[j] = j < nr ? s[j] - mn : 0.0f;
    exp16(s);
    for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
    for (int64_t j = lo; j < nr; j++) *l += s[j];
#endif
}

/* acc_i[d] += sum over j < nr_i of p_i[j] v_j[d] for NR rows (NR a constant, so that their
 * chains interleave), j in order for every element: each value vector is loaded once for the
 * rows that take it. Every element's sum is the same chain of FMAs whatever NR, so the bits
 * do not depend on which rows share the call. v: the tile's KT value rows in float32. */
static inline __attribute__((always_inline)) void pv_rows(const int NR, float *const *p, const int64_t *nr, float *const *acc,
                                                          const float *const *v, int64_t D) {
    int64_t nmin = KT;
    for (int i = 0; i < NR; i++) nmin = nr[i] < nmin ? nr[i] : nmin;
    int64_t d = 0;
    for (; d + 4 * VL <= D; d += 4 * VL) { /* four vectors a row: independent chains hide the FMA latency */
        vf o[PV_RB][4];
        for (int i = 0; i < NR; i++)
            for (int k = 0; k < 4; k++) o[i][k] = vload(acc[i] + d + k * VL);
        for (int64_t j = 0; j < nmin; j++) {
            const float *vj = v[j] + d;
            const vf v0 = vload(vj), v1 = vload(vj + VL), v2 = vload(vj + 2 * VL), v3 = vload(vj + 3 * VL);
            for (int i = 0; i < NR; i++) {
                const vf pj = vset1(p[i][j]);
                o[i][0] = vfma(pj, v0, o[i][0]), o[i][1] = vfma(pj, v1, o[i][1]), o[i][2] = vfma(pj, v2, o[i][2]), o[i][3] = vfma(pj, v3, o[i][3]);
            }
        }
        for (int i = 0; i < NR; i++) { /* a row's keys past the shortest row's (the diagonal tile) */
            for (int64_t j = nmin; j < nr[i]; j++) {
                const vf pj = vset1(p[i][j]);
                const float *vj = v[j] + d;
                o[i][0] = vfma(pj, vload(vj), o[i][0]), o[i][1] = vfma(pj, vload(vj + VL), o[i][1]);
                o[i][2] = vfma(pj, vload(vj + 2 * VL), o[i][2]), o[i][3] = vfma(pj, vload(vj + 3 * VL), o[i][3]);
            }
            for (int k = 0; k < 4; k++) vstore(acc[i] + d + k * VL, o[i][k]);
        }
    }
    for (int i = 0; i < NR; i++) {
        float *ar = acc[i];
        const float *s = p[i];
        int64_t e = d;
        for (; e + VL <= D; e += VL) {
            vf o = vload(ar + e);
            for (int64_t j = 0; j < nr[i]; j++) o = vfma(vset1(s[j]), vload(v[j] + e), o);
            vstore(ar + e, o);
        }
        for (; e < D; e++)
            for (int64_t j = 0; j < nr[i]; j++) ar[e] = fmaf(s[j], v[j][e], ar[e]);
    }
}

#if defined(__AVX512F__)
/* tile_scores' sums for NR rows at once (NR a constant), keys in lanes over the transposed
 * keys kt: lane-class accumulators c_l (l = d mod 16, d in order) then vsum()'s tree over l
 * (l + 8, + 4, + 2, + 1), evaluated depth first so that few classes are live, each kt vector
 * loaded once for the NR rows. Each key's sums are the very operations tile_scores does for
 * it (addition commutes), so the bits are the same. D % 16 == 0. */
static inline __attribute__((always_inline)) void ts_cls(const int NR, __m512 *c, const float *const *q, const float *kt, int l, int64_t D) {
    for (int r = 0; r < NR; r++) c[r] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const __m512 k = _mm512_loadu_ps(kt + (d0 + l) * KT);
        for (int r = 0; r < NR; r++) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d0 + l]), k, c[r]);
    }
}
#define TS_LEVEL(name, lower, step)                                                                                                 \
    static inline __attribute__((always_inline)) void name(const int NR, __m512 *o, const float *const *q, const float *kt, int l, \
                                                           int64_t D) {                                                        \
        __m512 a[RB], b[RB];                                                                                                    \
        lower(NR, a, q, kt, l, D), lower(NR, b, q, kt, l + step, D);                                                           \
        for (int r = 0; r < NR; r++) o[r] = _mm512_add_ps(a[r], b[r]);                                                          \
    }
TS_LEVEL(ts_t, ts_cls, 8) /* c_l + c_l+8 */
TS_LEVEL(ts_u, ts_t, 4)   /* t_l + t_l+4 */
TS_LEVEL(ts_v, ts_u, 2)   /* u_l + u_l+2 */
TS_LEVEL(ts_s, ts_v, 1)   /* v_0 + v_1 */
static inline __attribute__((always_inline)) void scores_transposed_rows(const int NR, float *const *s, const float *const *q, const float *kt, int64_t D) {
    __m512 o[RB];
    ts_s(NR, o, q, kt, 0, D);
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(s[r], o[r]);
}
#endif

/* Soft-capping of n scaled scores in place (n % VL == 0): s = cap tanh(s / cap), as HF's
 * Gemma 2 (``tanh(scores / softcap) * softcap``). */
static inline void softcap_scores(float *s, int64_t n, float cap) {
    const vf c = vset1(cap);
    for (int64_t j = 0; j < n; j += VL) vstore(s + j, vmul(vtanh(vdiv(vload(s + j), c)), c));
}

typedef struct {
    const void *q, *k, *v;
    void *out;
    const int32_t *tables, *token_seq;
    const int64_t *positions;
    const int64_t *blocks; /* [num_units + 1] first token of each query block */
    int64_t ldq, kv_head_stride, max_blocks, heads, kv_heads, D, block_size, num_units;
    float scale;
    int bf;
    int64_t window; /* keys per row, or 0: all of 0 .. p */
    float softcap;  /* or 0: none */
} attn_args;

/* The first key row p sees. */
static inline int64_t first_key(const attn_args *a, int64_t p) { return a->window > 0 && p >= a->window ? p - a->window + 1 : 0; }

/* The K and V rows (row bytes D * es) of one head's keys j0 .. j0 + KT - 1, those up to last,
 * through a sequence's block table. Returns how many there are. */
static inline int64_t tile_rows(const attn_args *a, const int32_t *table, const char *kh, const char *vh, int64_t j0, int64_t last,
                                const char **kr, const char **vr) {
    const int64_t n = last + 1 - j0 < KT ? last + 1 - j0 : KT, row = a->D * (a->bf ? 2 : 4);
    int64_t blk = j0 / a->block_size, off = j0 % a->block_size; /* walked, not divided, per key */
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = (int64_t)table[blk] * a->block_size + off;
        kr[j] = kh + slot * row, vr[j] = vh + slot * row;
        if (++off == a->block_size) blk++, off = 0;
    }
    return n;
}

/* The next tile's rows asked for ahead (into L2): its V rows, then its K rows, *done .. upto - 1
 * of those 2n, a few at a time between the current tile's pieces of work. A head's keys fill a
 * 4 KiB page every 32 (bf16) or 16 (float32) keys and hardware prefetchers stop at pages; and a
 * whole tile's prefetches at once fill the core's miss buffers and stall it until they return
 * (decode at batch 32, context 512, on the AVX512-BF16 EPYC: 8.4 GB/s of KV at once, 13 spread,
 * attention_dp.h), so they go out in parts. */
static inline void prefetch_rows(const char *const *kn, const char *const *vn, int64_t n, int64_t *done, int64_t upto, int64_t row) {
    for (; *done < upto; ++*done) {
        const char *p = *done < n ? vn[*done] : kn[*done - n];
        for (int64_t x = 0; x < row; x += 64) _mm_prefetch(p + x, _MM_HINT_T1);
    }
}

/* One unit: query tokens [t0, t1) of one sequence (consecutive positions), all G query heads
 * of KV head g. Rows r = (token, head). For each tile of KT keys, bf16 V is widened to
 * vt[KT][D] (float32 V is read in place; K goes to kt[KT][D], transposed, when the rows are
 * many), then every row:
 *   s[j] = q . k_j                  (tile_scores: lanes over d, then vsum()'s tree)
 *   masked to keys <= the row's position; m, l, acc updated as FlashAttention's recurrence;
 *   acc[d] += p_j * v_j[d]          (j in order)
 * Nothing here depends on which other rows share the unit. */
static void attend_unit(const attn_args *a, int64_t t0, int64_t t1, int64_t g, float *work) {
    const int64_t G = a->heads / a->kv_heads, D = a->D, es = a->bf ? 2 : 4, R = (t1 - t0) * G;
    float *q = work, *acc = q + R * D, *kt = acc + R * D, *vt = kt + D * KT, *m = vt + KT * D, *l = m + R;
    int64_t rowpos[QB * MAX_GROUP];
    const int32_t *table = a->tables + (int64_t)a->token_seq[t0] * a->max_blocks;
    const char *kh = (const char *)a->k + g * a->kv_head_stride * es, *vh = (const char *)a->v + g * a->kv_head_stride * es;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h = 0; h < G; h++) {
            int64_t r = (t - t0) * G + h;
            const char *qr = (const char *)a->q + (t * a->ldq + (g * G + h) * D) * es;
            for (int64_t d = 0; d < D; d++) q[r * D + d] = ld(qr, d, a->bf) * a->scale, acc[r * D + d] = 0.0f;
            m[r] = -INFINITY, l[r] = 0.0f, rowpos[r] = a->positions[t];
        }
    const int64_t last = a->positions[t1 - 1], start = first_key(a, a->positions[t0]) / KT * KT; /* the unit's first tile */
    int transposed = 0; /* many rows on AVX-512: keys transposed once, scores as outer products */
#if defined(__AVX512F__)
    transposed = R >= 8 && D % 16 == 0;
#endif
    const char *kr[KT], *vr[KT], *kn[KT], *vn[KT];
    int64_t n = tile_rows(a, table, kh, vh, start, last, kr, vr);
    for (int64_t j0 = start; j0 <= last; j0 += KT) {
        const int64_t nn = j0 + KT <= last ? tile_rows(a, table, kh, vh, j0 + KT, last, kn, vn) : 0, np = 2 * nn; /* the next tile */
        int64_t pf = 0;                                                                                           /* its rows asked for */
        prefetch_rows(kn, vn, nn, &pf, np / 4, D * es);
        const float *vf32[KT]; /* the tile's values in float32: read in place, or widened once for every row (bf16) */
        for (int64_t j = 0; j < n; j++)
            if (a->bf) widen_row(vt + j * D, vr[j], D, 1), vf32[j] = vt + j * D;
            else vf32[j] = (const float *)vr[j];
        prefetch_rows(kn, vn, nn, &pf, np / 2, D * es);
#if defined(__AVX512F__)
        if (transposed) transpose_keys(kt, kr, n, D, a->bf); /* keys too, transposed, when the rows are many */
#endif
        float s3[3][KT];
        const int grouped = !transposed && VL == 16 && D % 16 == 0 && n == KT && G % 3 == 0;
#if defined(__AVX512F__)
        if (transposed) { /* RB rows at a time: each transposed key and each value loaded once for them */
            for (int64_t r0 = 0; r0 < R; r0 += RB) {
                float sb[RB][KT], *sl[RB], *al[RB];
                const float *ql[RB];
                int64_t nl[RB], ll[RB];
                int live = 0;
                for (int64_t r = r0; r < R && r < r0 + RB; r++) {
                    const int64_t nr = rowpos[r] + 1 - j0 < KT ? rowpos[r] + 1 - j0 : KT; /* this row's keys in the tile */
                    const int64_t lo = first_key(a, rowpos[r]) - j0;                       /* and the first of them */
                    if (nr <= 0 || lo >= KT) continue;
                    sl[live] = sb[live], al[live] = acc + r * D, ql[live] = q + r * D, nl[live] = nr, ll[live] = lo > 0 ? lo : 0, live++;
                }
                if (live == RB) scores_transposed_rows(RB, sl, ql, kt, D);
                else
                    for (int i = 0; i < live; i++) scores_transposed_rows(1, sl + i, ql + i, kt, D);
                for (int i = 0; i < live; i++) {
                    for (int64_t j = nl[i]; j < KT; j++) sl[i][j] = 0.0f;
                    if (a->softcap > 0) softcap_scores(sl[i], KT, a->softcap);
                    const int64_t r = (al[i] - acc) / D;
                    softmax_row(sl[i], ll[i], nl[i], m + r, l + r, al[i], D);
                }
                int i = 0;
                if (live == RB) pv_rows(RB, sl, nl, al, vf32, D), i = RB;
                for (; i < live; i++) pv_rows(1, sl + i, nl + i, al + i, vf32, D);
                prefetch_rows(kn, vn, nn, &pf, np / 2 + np / 2 * (r0 + RB < R ? r0 + RB : R) / R, D * es);
            }
        } else
#endif
        for (int64_t r = 0; r < R; r++) {
            int64_t p = rowpos[r], nr = p + 1 - j0 < KT ? p + 1 - j0 : KT, lo = first_key(a, p) - j0; /* this row's keys in the tile */
            const float *qr = q + r * D;
#if defined(__AVX512F__)
            if (grouped && r % 3 == 0) tile_scores3_full(s3, qr, qr + D, qr + 2 * D, kr, D, a->bf);
#endif
            if (nr <= 0 || lo >= KT) continue;
            float *s = s3[r % 3];
            if (!grouped) tile_scores(s, qr, kr, nr, D, a->bf); /* (grouped: s3[r % 3] was filled with its group) */
            if (a->softcap > 0) softcap_scores(s, KT, a->softcap);
            float *ar = acc + r * D;
            softmax_row(s, lo > 0 ? lo : 0, nr, m + r, l + r, ar, D);
            pv_rows(1, &s, &nr, &ar, vf32, D);
            prefetch_rows(kn, vn, nn, &pf, np / 2 + np / 2 * (r + 1) / R, D * es);
        }
        prefetch_rows(kn, vn, nn, &pf, np, D * es);
        memcpy(kr, kn, sizeof kr), memcpy(vr, vn, sizeof vr), n = nn;
    }
    for (int64_t r = 0; r < R; r++) {
        int64_t t = t0 + r / G, h = r % G;
        char *o = (char *)a->out + (t * a->heads + g * G + h) * D * es;
        float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) st(o, d, acc[r * D + d] * inv, a->bf);
    }
}


/* The unit at place i of the thread split: the two ends of the unit list alternate (first,
 * last, second, ...), so that contiguous ranges of places mix a prompt's early query blocks,
 * which see few keys, with its late ones, which see many. Which thread runs a unit changes
 * none of its bits. */
static inline int64_t unit_at(const attn_args *a, int64_t i) {
    int64_t n = a->num_units;
    return i % 2 == 0 ? i / 2 : n - 1 - i / 2;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__)
#include "attention_amx.h" /* bf16 on AMX tiles where the kernel grants them (amx_on) */

static int attend_range_amx(const attn_args *a, int64_t begin, int64_t end) {
    if (!a->bf || !amx_on || a->D % 32 || a->window || a->softcap > 0) return 0; /* windows, soft-caps: the AVX512-BF16 path */
    char *mem = malloc(amx_attn_work_bytes(QB * (a->heads / a->kv_heads), a->D));
    if (!mem) amx_attn_out_of_memory();
    amx_attn_work w = amx_attn_carve(mem, QB * (a->heads / a->kv_heads), a->D);
    const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure(rows);
    /* the range's units a KV head at a time, so that the query blocks of one prompt and head
     * follow each other and reuse the tiles staged for them (amx_attn_work.staged) */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(end - begin)), n = 0;
    if (!order) amx_attn_out_of_memory();
    for (int64_t g = 0; g < a->kv_heads; g++)
        for (int64_t i = begin; i < end; i++)
            if (unit_at(a, i) % a->kv_heads == g) order[n++] = unit_at(a, i);
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++) {
        int64_t unit = order[i], b = unit / a->kv_heads, g = unit % a->kv_heads;
        w.next_table = 0;
        if (i + 1 < n) { /* where its first keys are, to ask for them ahead */
            int64_t nu = order[i + 1], nb = nu / a->kv_heads, t0 = a->blocks[nb];
            w.next_table = a->tables + (int64_t)a->token_seq[t0] * a->max_blocks;
            w.next_vh = (const uint16_t *)a->v + (nu % a->kv_heads) * a->kv_head_stride;
            w.next_last = a->positions[a->blocks[nb + 1] - 1];
        }
        ok = attend_unit_amx(a, a->blocks[b], a->blocks[b + 1], g, &w) == 0;
    }
    _tile_release();
    free(order);
    free(w.tile_mem);
    free(mem);
    if (!ok) amx_attn_out_of_memory();
    return 1;
}
#else
static int attend_range_amx(const attn_args *a, int64_t begin, int64_t end) { (void)a, (void)begin, (void)end; return 0; }
#endif

#if defined(__AVX512BF16__)
#include "attention_dp.h" /* bf16 on VDPBF16PS dot products */
#else
static int attend_range_dp(const attn_args *a, int64_t begin, int64_t end) { (void)a, (void)begin, (void)end; return 0; }
#endif

static void attend_range(const void *args, int64_t begin, int64_t end) {
    const attn_args *a = (const attn_args *)args;
    if (attend_range_amx(a, begin, end) || attend_range_dp(a, begin, end)) return;
    const int64_t G = a->heads / a->kv_heads, D = a->D, R = QB * G;
    float *work = 0; /* 64-byte aligned: each row's vectors in whole cache lines */
    if (posix_memalign((void **)&work, 64, sizeof(float) * (size_t)(2 * R * D + 2 * D * KT + 2 * R))) abort();
    for (int64_t i = begin; i < end; i++) { /* unit = query block * kv_heads + kv head */
        int64_t unit = unit_at(a, i), b = unit / a->kv_heads, g = unit % a->kv_heads;
        attend_unit(a, a->blocks[b], a->blocks[b + 1], g, work);
    }
    free(work);
}

/* Stores the step's new keys and values (k_new, v_new: [T, kv_heads, D], token stride ldkv
 * elements, heads D apart) into their slots (none when slots is NULL), then attends, each row
 * to its last `window` keys (0: all) with scores soft-capped at `softcap` (0: none). Returns
 * 0, or -1 for a head layout it does not take (group > MAX_GROUP, D > MAX_D). */
int paged_attention_windowed(const void *q, int64_t T, int64_t ldq, int64_t heads, int64_t kv_heads, int64_t D, void *k_cache,
                             void *v_cache, int64_t kv_head_stride, const void *k_new, const void *v_new, int64_t ldkv, const int64_t *slots,
                             const int32_t *block_tables, int64_t max_blocks, const int32_t *token_seq, const int64_t *positions,
                             int64_t block_size, float scale, void *out, int bf, int64_t nthreads, int64_t window, float softcap) {
    if (heads % kv_heads || heads / kv_heads > MAX_GROUP || D > MAX_D || T <= 0) return T <= 0 ? 0 : -1;
    const int64_t es = bf ? 2 : 4;
    for (int64_t t = 0; slots && t < T; t++)
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t dst = (g * kv_head_stride + slots[t] * D) * es, src = (t * ldkv + g * D) * es;
            memcpy((char *)k_cache + dst, (const char *)k_new + src, (size_t)(D * es));
            memcpy((char *)v_cache + dst, (const char *)v_new + src, (size_t)(D * es));
        }
    /* query blocks: up to QB consecutive tokens of one sequence, positions one apart */
    int64_t *blocks = malloc(sizeof(int64_t) * (size_t)(T + 1)), nb = 0;
    for (int64_t t = 0; t < T; t++)
        if (t == 0 || token_seq[t] != token_seq[t - 1] || positions[t] != positions[t - 1] + 1 || t - blocks[nb - 1] >= QB)
            blocks[nb++] = t;
    blocks[nb] = T;
    attn_args a = {q, k_cache, v_cache, out, block_tables, token_seq, positions, blocks, ldq, kv_head_stride, max_blocks, heads, kv_heads, D, block_size,
                   nb * kv_heads, scale, bf, window > 0 ? window : 0, softcap > 0 ? softcap : 0.0f};
    parallel_ranges(attend_range, &a, nb * kv_heads, 1, nthreads);
    free(blocks);
    return 0;
}

/* paged_attention_windowed over every key 0 .. p, no soft-capping (decoder.c's). */
int paged_attention(const void *q, int64_t T, int64_t ldq, int64_t heads, int64_t kv_heads, int64_t D, void *k_cache,
                    void *v_cache, int64_t kv_head_stride, const void *k_new, const void *v_new, int64_t ldkv, const int64_t *slots,
                    const int32_t *block_tables, int64_t max_blocks, const int32_t *token_seq, const int64_t *positions,
                    int64_t block_size, float scale, void *out, int bf, int64_t nthreads) {
    return paged_attention_windowed(q, T, ldq, heads, kv_heads, D, k_cache, v_cache, kv_head_stride, k_new, v_new, ldkv, slots, block_tables,
                                    max_blocks, token_seq, positions, block_size, scale, out, bf, nthreads, 0, 0.0f);
}
