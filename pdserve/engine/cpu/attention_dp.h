/* bf16 paged attention on AVX512-BF16 dot products (VDPBF16PS), included by attention.c
 * where the compiler targets AVX512-BF16. Every bf16 unit with D % 32 == 0 takes it there,
 * unless AMX does (attention_amx.h). The unit is attend_unit's: query tokens [t0, t1) of one
 * sequence, all G query heads of KV head g, rows r = (token, head). Keys go in tiles of
 * DT = 32 aligned at position 0; per tile and row, with bf16 products summed in float32:
 *   s_j = scale * (q . k_j)      q and k_j as stored (bf16). Lane i of an accumulator sums
 *                                the pairs (32c + 2i, 32c + 2i + 1), c = 0, 1, ... in order
 *                                (one VDPBF16PS each), then the lanes add in vsum()'s tree
 *   s_j = c tanh(s_j / c)        where soft-capping is on (cap c)
 *   mask to keys <= the row's position (and, with a window, from its first key: tiles
 *   before the one holding it skipped); m, l as attend_unit (l sums the float32 e_j)
 *   acc[d] += p_j v_j[d] + p_j+1 v_j+1[d]   pairs j = 0, 2, ..., 30 in order, p = bf16(e)
 * FlashAttention's recurrence (Dao et al. 2022, sec. 3.1) with bf16 probabilities, as the
 * AMX path and GPU kernels take them. Two layouts give the scores the same bits: keys read
 * in place, 16 key accumulators reduced by attention.c's shuffle network (few rows, as a
 * decode step), or the tile's key pairs transposed once, kt[pair][key], and 16 pair-class
 * accumulators per row reduced by the same tree (many rows, as a prompt chunk: three rows
 * share each load of the transposed keys, and six each load of the values). Keys and
 * values past the tile's end read as zeros and get p = 0, which adds +0 to acc; acc is never
 * -0 (it starts at +0, exact cancellation rounds to +0, and the rescale adds +0), so the sums
 * a row does past its own last key change no bits. A row's bits therefore
 * depend on its query, position and context only: the same in a prompt, a chunk of it, a
 * decode step or any batch.
 */
#ifndef PDSERVE_ATTENTION_DP_H
#define PDSERVE_ATTENTION_DP_H

#define DT 32 /* keys per tile */
#define DP_RB 6 /* rows per block of a prompt chunk: each value pair loaded once for their P V */
#define PFH _MM_HINT_T1 /* into L2: on the AVX512-BF16 EPYC, T0's few L1 fill buffers stalled (decode at
                         * batch 32, context 512: 7.7 GB/s with T1 or T2, 5.6 with T0, 5.2 with none) */

static inline __m512 dpbf(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

static inline __m512i bcast_pair(const uint16_t *p) { /* (p[0], p[1]) in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* s[r][j] = q_r . k_j (unscaled) for three rows and the tile's 16 keys kr[j] (bf16 rows of D,
 * D % 32 == 0): key accumulators, each key chunk loaded once for the three rows. */
static void dp_scores3(float s[3][DT], int64_t half16, const uint16_t *q0, const uint16_t *q1, const uint16_t *q2, const char *const *kr, int64_t D) {
    __m512 z[2][3];
    for (int half = 0; half < 2; half++) {
        __m512 a0[8], a1[8], a2[8];
        for (int j = 0; j < 8; j++) a0[j] = a1[j] = a2[j] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 32) {
            __m512i x0 = _mm512_loadu_si512(q0 + c), x1 = _mm512_loadu_si512(q1 + c), x2 = _mm512_loadu_si512(q2 + c);
            for (int j = 0; j < 8; j++) {
                __m512i k = _mm512_loadu_si512((const uint16_t *)kr[half * 8 + j] + c);
                a0[j] = dpbf(a0[j], x0, k), a1[j] = dpbf(a1[j], x1, k), a2[j] = dpbf(a2[j], x2, k);
            }
        }
        net8(a0, &z[half][0]), net8(a1, &z[half][1]), net8(a2, &z[half][2]);
    }
    for (int r = 0; r < 3; r++) net_store(s[r] + half16, z[0][r], z[1][r]);
}

/* The tile's key pairs transposed: kt[p * KT + j] = (k_j[2p], k_j[2p + 1]), p < D / 2 (a
 * permutation of 32-bit elements, no rounding). */
static void dp_transpose_keys(uint32_t *kt, const char *const *kr, int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512 r[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_castsi512_ps(_mm512_loadu_si512((const uint16_t *)kr[j] + d0));
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)(kt + (d0 / 2 + i) * KT), r[i]);
    }
}

/* dp_scores3's sums from the transposed pairs, for NR <= 3 rows at once (the tile's 16 keys of kt
 * in lanes): pair-class sums c_i (pair p = 16c + i, c in order) then the same tree over i
 * (i + 8, + 4, + 2, + 1), evaluated depth first so that few classes are live and each kt
 * vector is loaded once for the NR rows. Addition commutes, so the bits are the tree's. */
static inline __attribute__((always_inline)) void dp_cls(const int NR, __m512 *c, const uint16_t *const *q, const uint32_t *kt, int i, int64_t D) {
    for (int r = 0; r < NR; r++) c[r] = _mm512_setzero_ps();
    for (int64_t p = i; p < D / 2; p += 16) {
        const __m512i k = _mm512_loadu_si512(kt + p * KT);
        for (int r = 0; r < NR; r++) c[r] = dpbf(c[r], bcast_pair(q[r] + 2 * p), k);
    }
}
#define DP_LEVEL(name, lower, step)                                                                                             \
    static inline __attribute__((always_inline)) void name(const int NR, __m512 *o, const uint16_t *const *q, const uint32_t *kt, int i, \
                                                           int64_t D) {                                                             \
        __m512 a[3], b[3];                                                                                                           \
        lower(NR, a, q, kt, i, D), lower(NR, b, q, kt, i + step, D);                                                                 \
        for (int r = 0; r < NR; r++) o[r] = _mm512_add_ps(a[r], b[r]);                                                               \
    }
DP_LEVEL(dp_t, dp_cls, 8) /* c_i + c_i+8 */
DP_LEVEL(dp_u, dp_t, 4)   /* t_i + t_i+4 */
DP_LEVEL(dp_v, dp_u, 2)   /* u_i + u_i+2 */
DP_LEVEL(dp_s, dp_v, 1)   /* v_0 + v_1 */
static inline __attribute__((always_inline)) void dp_scores_transposed(const int NR, float *const *s, const uint16_t *const *q, const uint32_t *kt, int64_t D) {
    __m512 o[3];
    dp_s(NR, o, q, kt, 0, D);
    for (int r = 0; r < NR; r++) _mm512_storeu_ps(s[r], o[r]);
}

/* acc's layout: each 32 elements d0 .. d0 + 31 of a row (d0 % 32 == 0) sit as two vectors, the
 * lanes of _mm512_unpacklo_epi16 / _mm512_unpackhi_epi16 of two value rows' bf16 elements
 * d0 .. d0 + 31: lane i of the first holds d0 + 8 (i / 4) + i % 4, of the second that + 4.
 * Each element's sums are the same whatever lane holds it: the layout is a permutation, undone
 * as the row is written out. */

/* The tile's values in key pairs, in acc's layout: vp[jp * D + d0 ..] the unpack lo then hi of
 * v_2jp's and v_2jp+1's elements d0 .. d0 + 31, jp < DT / 2 (a permutation, no rounding). For
 * many rows, which then share each load; few rows pair the values in registers instead. */
static void dp_pair_values(uint32_t *vp, const char *const *vr, int64_t D) {
    for (int jp = 0; jp < DT / 2; jp++)
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const __m512i x = _mm512_loadu_si512((const uint16_t *)vr[2 * jp] + d0), y = _mm512_loadu_si512((const uint16_t *)vr[2 * jp + 1] + d0);
            _mm512_storeu_si512(vp + jp * D + d0, _mm512_unpacklo_epi16(x, y));
            _mm512_storeu_si512(vp + jp * D + d0 + 16, _mm512_unpackhi_epi16(x, y));
        }
}

/* One tile's softmax step and P V for NR rows at once (NR a constant, so that the rows'
 * independent chains interleave). s[i]: row i's DT unscaled scores; its keys in the tile are
 * lo[i] .. nr[i] - 1 (0 <= lo < nr <= DT); m[i], l[i], acc[i]: its running max, sum and [D]
 * accumulator (in acc's layout), updated. vp: dp_pair_values' pairs, or NULL to pair the value
 * rows vr[j] in registers. cap: the soft-cap, or 0. */
static inline __attribute__((always_inline)) void dp_rows(const int NR, float *const *s, const int64_t *lo, const int64_t *nr, float *const *m,
                                                          float *const *l, float *const *acc, const uint32_t *vp, const char *const *vr, int64_t D, __m512 scale,
                                                          float cap) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    uint16_t pb[DP_RB][DT];
    int np = DT / 4; /* key pairs with a probability for some row */
    for (int i = 0; i < NR; i++) {
        const uint32_t below = lo[i] >= 32 ? 0xFFFFFFFFu : (1u << lo[i]) - 1; /* the keys before the window, as bits */
        const __mmask16 m0 = (__mmask16)((nr[i] >= 16 ? 0xFFFFu : (1u << nr[i]) - 1) & ~below);
        const __mmask16 m1 = (__mmask16)((nr[i] >= 32 ? 0xFFFFu : nr[i] > 16 ? (1u << (nr[i] - 16)) - 1 : 0) & ~(below >> 16));
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(s[i]), scale), x1 = _mm512_mul_ps(_mm512_loadu_ps(s[i] + 16), scale);
        if (cap > 0) {
            const __m512 c = _mm512_set1_ps(cap);
            x0 = _mm512_mul_ps(vtanh(_mm512_div_ps(x0, c)), c), x1 = _mm512_mul_ps(vtanh(_mm512_div_ps(x1, c)), c);
        }
        const __m512 s0 = _mm512_mask_blend_ps(m0, ninf, x0), s1 = _mm512_mask_blend_ps(m1, ninf, x1);
        const float mt = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)), mo = *m[i], mn = mo > mt ? mo : mt;
        if (mo != mn && mo != -INFINITY) { /* rescale what came before */
            const float alpha = expf(mo - mn);
            *l[i] *= alpha;
            for (int64_t d = 0; d < D; d += 16) /* + 0: an alpha that underflows makes no -0 */
                _mm512_storeu_ps(acc[i] + d, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(acc[i] + d), _mm512_set1_ps(alpha)), _mm512_setzero_ps()));
        }
        *m[i] = mn;
        const __m512 mv = _mm512_set1_ps(mn);
        const __m512 e0 = _mm512_maskz_mov_ps(m0, vexp(_mm512_maskz_sub_ps(m0, s0, mv)));
        const __m512 e1 = _mm512_maskz_mov_ps(m1, vexp(_mm512_maskz_sub_ps(m1, s1, mv)));
        *l[i] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        _mm512_storeu_si512(pb[i], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        if (nr[i] > 16) np = DT / 2;
    }
    /* acc += sum over key pairs of p V, pairs in order (a row's pairs past its keys have p = 0):
     * each pair's two value rows interleaved in acc's layout, read from vp or unpacked here */
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
        __m512 o[DP_RB][4];
        for (int i = 0; i < NR; i++)
            for (int k = 0; k < 4; k++) o[i][k] = _mm512_loadu_ps(acc[i] + d + 16 * k);
        for (int jp = 0; jp < np; jp++) {
            __m512i v0, v1, v2, v3;
            if (vp) {
                const uint32_t *v = vp + jp * D + d;
                v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + 16), v2 = _mm512_loadu_si512(v + 32), v3 = _mm512_loadu_si512(v + 48);
            } else {
                const uint16_t *x = (const uint16_t *)vr[2 * jp] + d, *y = (const uint16_t *)vr[2 * jp + 1] + d;
                const __m512i x0 = _mm512_loadu_si512(x), y0 = _mm512_loadu_si512(y), x1 = _mm512_loadu_si512(x + 32), y1 = _mm512_loadu_si512(y + 32);
                v0 = _mm512_unpacklo_epi16(x0, y0), v1 = _mm512_unpackhi_epi16(x0, y0);
                v2 = _mm512_unpacklo_epi16(x1, y1), v3 = _mm512_unpackhi_epi16(x1, y1);
            }
            for (int i = 0; i < NR; i++) {
                const __m512i p = bcast_pair(pb[i] + 2 * jp);
                o[i][0] = dpbf(o[i][0], p, v0), o[i][1] = dpbf(o[i][1], p, v1), o[i][2] = dpbf(o[i][2], p, v2), o[i][3] = dpbf(o[i][3], p, v3);
            }
        }
        for (int i = 0; i < NR; i++)
            for (int k = 0; k < 4; k++) _mm512_storeu_ps(acc[i] + d + 16 * k, o[i][k]);
    }
    for (; d < D; d += 32) /* D % 64 == 32: the last 32 elements */
        for (int i = 0; i < NR; i++) {
            __m512 o0 = _mm512_loadu_ps(acc[i] + d), o1 = _mm512_loadu_ps(acc[i] + d + 16);
            for (int jp = 0; jp < np; jp++) {
                const __m512i p = bcast_pair(pb[i] + 2 * jp);
                if (vp) {
                    o0 = dpbf(o0, p, _mm512_loadu_si512(vp + jp * D + d)), o1 = dpbf(o1, p, _mm512_loadu_si512(vp + jp * D + d + 16));
                } else {
                    const __m512i x = _mm512_loadu_si512((const uint16_t *)vr[2 * jp] + d), y = _mm512_loadu_si512((const uint16_t *)vr[2 * jp + 1] + d);
                    o0 = dpbf(o0, p, _mm512_unpacklo_epi16(x, y)), o1 = dpbf(o1, p, _mm512_unpackhi_epi16(x, y));
                }
            }
            _mm512_storeu_ps(acc[i] + d, o0), _mm512_storeu_ps(acc[i] + d + 16, o1);
        }
}

/* The K and V rows of one head's keys j0 .. j0 + DT - 1 (those up to last; the rest read
 * zeros) through a sequence's block table. Returns how many are real. */
static inline int64_t dp_tile_rows(const attn_args *a, const int32_t *table, const char *kh, const char *vh, int64_t j0, int64_t last,
                                   const char **kr, const char **vr) {
    static const uint16_t zeros[MAX_D] = {0};
    const int64_t n = last + 1 - j0 < DT ? last + 1 - j0 : DT, row = a->D * 2;
    for (int64_t j = 0; j < n;) { /* runs of keys in one block */
        const int64_t o = (j0 + j) % a->block_size, run = a->block_size - o < n - j ? a->block_size - o : n - j;
        const int64_t slot = (int64_t)table[(j0 + j) / a->block_size] * a->block_size + o;
        for (int64_t x = 0; x < run; x++, j++) kr[j] = kh + (slot + x) * row, vr[j] = vh + (slot + x) * row;
    }
    for (int64_t j = n < 0 ? 0 : n; j < DT; j++) kr[j] = vr[j] = (const char *)zeros;
    return n < 0 ? 0 : n;
}

/* The next tile's K and V rows asked for ahead (into L2), keys *done .. upto - 1, a few at a
 * time between the current tile's pieces of work. Each 4 KiB page holds 32 keys of one head
 * and hardware prefetchers stop at page ends, so without this every tile waits on DRAM; and
 * a whole tile's 128 prefetches at once fill the core's miss buffers and stall it until they
 * return (decode at batch 32, context 512, on the AVX512-BF16 EPYC: 8.4 GB/s at once, more
 * when spread), so they go out in parts. */
static inline void dp_prefetch(const char *const *kn, const char *const *vn, int64_t n, int64_t *done, int64_t upto, int64_t D) {
    for (; *done < upto; ++*done) { /* V rows first: the tile's first work reads them */
        const char *p = *done < n ? vn[*done] : kn[*done - n];
        for (int64_t x = 0; x < D * 2; x += 64) _mm_prefetch(p + x, PFH);
    }
}

/* Per-thread work for units of up to R rows of head dim D. */
static size_t dp_work_bytes(int64_t R, int64_t D) { return sizeof(float) * (size_t)(R * D + 2 * R) + sizeof(uint32_t) * (size_t)(D * DT + DT / 2 * D) + 64; }

/* kn0, vn0, nn0: the first tile of the unit the thread does next (its rows, how many), asked
 * for during this unit's last tile. */
static void attend_unit_dp(const attn_args *a, int64_t t0, int64_t t1, int64_t g, char *work, const char *const *kn0, const char *const *vn0,
                           int64_t nn0) {
    const int64_t G = a->heads / a->kv_heads, D = a->D, R = (t1 - t0) * G;
    float *acc = (float *)work, *m = acc + R * D, *l = m + R;
    uint32_t *kt = (uint32_t *)(l + R), *vp = kt + D * DT; /* kt: two halves of [D / 2][16] */
    const uint16_t *qr[QB * MAX_GROUP];
    int64_t rowpos[QB * MAX_GROUP];
    const int32_t *table = a->tables + (int64_t)a->token_seq[t0] * a->max_blocks;
    const char *kh = (const char *)a->k + g * a->kv_head_stride * 2, *vh = (const char *)a->v + g * a->kv_head_stride * 2;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h = 0; h < G; h++) {
            int64_t r = (t - t0) * G + h;
            qr[r] = (const uint16_t *)a->q + t * a->ldq + (g * G + h) * D;
            m[r] = -INFINITY, l[r] = 0.0f, rowpos[r] = a->positions[t];
        }
    memset(acc, 0, sizeof(float) * (size_t)(R * D));
    const int64_t last = a->positions[t1 - 1], start = first_key(a, a->positions[t0]) / DT * DT; /* the unit's first tile */
    const int transposed = R >= 8; /* many rows: keys transposed once per tile */
    const __m512 scale = _mm512_set1_ps(a->scale);
    const char *kr[DT], *vr[DT], *kn[DT], *vn[DT];
    int64_t n = dp_tile_rows(a, table, kh, vh, start, last, kr, vr);
    for (int64_t j0 = start; j0 <= last; j0 += DT) {
        int64_t nn = 0, pf = 0; /* the next tile: its keys, and how many asked for so far */
        const char *const *kq = kn, *const *vq = vn;
        if (j0 + DT <= last) nn = dp_tile_rows(a, table, kh, vh, j0 + DT, last, kn, vn);
        else kq = kn0, vq = vn0, nn = nn0;
        dp_prefetch(kq, vq, nn, &pf, 2 * nn < 16 ? 2 * nn : 16, D);
        if (transposed) dp_pair_values(vp, vr, D);
        dp_prefetch(kq, vq, nn, &pf, 2 * nn < 32 ? 2 * nn : 32, D);
        if (transposed) dp_transpose_keys(kt, kr, D), dp_transpose_keys(kt + D / 2 * 16, kr + 16, D);
        float s6[DP_RB][DT];
        const int64_t rb = transposed ? DP_RB : 3; /* rows per block: PV shares each V load among them */
        for (int64_t r0 = 0; r0 < R; r0 += rb) {
            const int64_t nrow = R - r0 < rb ? R - r0 : rb;
            for (int64_t b = 0; b < nrow; b += 3) { /* scores, three rows at a time */
                const int64_t r = r0 + b, nb = nrow - b < 3 ? nrow - b : 3;
                const uint16_t *q3[3] = {qr[r], qr[nb > 1 ? r + 1 : r], qr[nb > 2 ? r + 2 : r]};
                if (!transposed) {
                    dp_scores3(s6 + b, 0, q3[0], q3[1], q3[2], kr, D);
                    dp_prefetch(kq, vq, nn, &pf, 2 * nn < pf + 16 ? 2 * nn : pf + 16, D);
                    if (n > 16) dp_scores3(s6 + b, 16, q3[0], q3[1], q3[2], kr + 16, D);
                } else {
                    float *lo[3] = {s6[b], s6[b + 1], s6[b + 2]}, *hi[3] = {s6[b] + 16, s6[b + 1] + 16, s6[b + 2] + 16};
                    dp_scores_transposed(3, lo, q3, kt, D);
                    if (rowpos[r + nb - 1] + 1 - j0 > 16) dp_scores_transposed(3, hi, q3, kt + D / 2 * 16, D);
                }
            }
            dp_prefetch(kq, vq, nn, &pf, 2 * nn < pf + 16 ? 2 * nn : pf + 16, D);
            float *sl[DP_RB], *ml[DP_RB], *ll[DP_RB], *al[DP_RB];
            int64_t nl[DP_RB], lw[DP_RB];
            int live = 0;
            for (int64_t i = 0; i < nrow; i++) {
                const int64_t r = r0 + i, nr = rowpos[r] + 1 - j0 < DT ? rowpos[r] + 1 - j0 : DT; /* this row's keys in the tile */
                const int64_t lo = first_key(a, rowpos[r]) - j0;                                   /* and the first of them */
                if (nr <= 0 || lo >= DT) continue;
                sl[live] = s6[i], nl[live] = nr, lw[live] = lo > 0 ? lo : 0, ml[live] = m + r, ll[live] = l + r, al[live] = acc + r * D, live++;
            }
            const float cap = a->softcap;
            const uint32_t *tvp = transposed ? vp : NULL;
            int i = 0;
            if (live == DP_RB) dp_rows(DP_RB, sl, lw, nl, ml, ll, al, tvp, vr, D, scale, cap), i = DP_RB;
            for (; i + 3 <= live; i += 3) dp_rows(3, sl + i, lw + i, nl + i, ml + i, ll + i, al + i, tvp, vr, D, scale, cap);
            for (; i < live; i++) dp_rows(1, sl + i, lw + i, nl + i, ml + i, ll + i, al + i, tvp, vr, D, scale, cap);
        }
        dp_prefetch(kq, vq, nn, &pf, 2 * nn, D);
        memcpy(kr, kn, sizeof kr), memcpy(vr, vn, sizeof vr), n = nn;
    }
    /* lanes of (lo, hi) in natural order: d0 + 0..15 are lo 0-3, hi 0-3, lo 4-7, hi 4-7, then 8-15 */
    const __m512i dp_nat_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i dp_nat_hi = _mm512_add_epi32(dp_nat_lo, _mm512_set1_epi32(8));
    for (int64_t r = 0; r < R; r++) {
        int64_t t = t0 + r / G, h = r % G;
        uint16_t *o = (uint16_t *)a->out + (t * a->heads + g * G + h) * D;
        float inv = 1.0f / l[r];
        float nat[MAX_D]; /* acc's row in natural order, times inv */
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0), vinv), hi = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + 16), vinv);
            _mm512_storeu_ps(nat + d0, _mm512_permutex2var_ps(lo, dp_nat_lo, hi)), _mm512_storeu_ps(nat + d0 + 16, _mm512_permutex2var_ps(lo, dp_nat_hi, hi));
        }
        for (int64_t d = 0; d < D; d++) o[d] = bf16_round(nat[d]);
    }
}

static int attend_range_dp(const attn_args *a, int64_t begin, int64_t end) {
    if (!a->bf || a->D % 32) return 0;
    char *work = 0; /* 64-byte aligned: the accumulator rows' vectors each in one cache line */
    if (posix_memalign((void **)&work, 64, dp_work_bytes(QB * (a->heads / a->kv_heads), a->D))) return 0;
    const char *kn0[DT], *vn0[DT];
    for (int64_t i = begin; i < end; i++) {
        int64_t unit = unit_at(a, i), b = unit / a->kv_heads, g = unit % a->kv_heads, nn0 = 0;
        if (i + 1 < end) { /* the next unit's first tile, asked for during this unit's last */
            int64_t nu = unit_at(a, i + 1), nb = nu / a->kv_heads, ng = nu % a->kv_heads;
            nn0 = dp_tile_rows(a, a->tables + (int64_t)a->token_seq[a->blocks[nb]] * a->max_blocks, (const char *)a->k + ng * a->kv_head_stride * 2,
                               (const char *)a->v + ng * a->kv_head_stride * 2, first_key(a, a->positions[a->blocks[nb]]) / DT * DT,
                               a->positions[a->blocks[nb + 1] - 1], kn0, vn0);
        }
        attend_unit_dp(a, a->blocks[b], a->blocks[b + 1], g, work, kn0, vn0, nn0);
    }
    free(work);
    return 1;
}

#endif
