/* bf16 paged attention on AMX tiles (amx.h), included by attention.c where amx_on and
 * D % 32 == 0. The same unit of work as attention.c's attend_unit: query tokens [t0, t1) of
 * one sequence, all G query heads of KV head g, rows r = (token, head), taken 16 at a time
 * (one "chunk": a vector lane per row).
 *
 * Keys go in tiles of AT = 32 aligned at position 0. For each tile and chunk:
 *   S^T[j][n] = k_j . q_n             TDPBF16PS, keys as A rows read in place from the pool,
 *                                     the chunk's queries as B (pairs transposed once per unit)
 *   s = S^T * scale, masked to keys <= the row's position (lane n's own)
 *   mt = max_j s_j; mn = max(m, mt); alpha = exp(m - mn) where m moves (else 1); m = mn
 *   e_j = exp(s_j - mn); l = l * alpha + tree_j e_j   (the tree: j + 16, + 8, + 4, + 2, + 1)
 *                                     exp is amx_exp (ten vector ops, ~2e-7 relative)
 *   P = bf16(e) (VCVTNE2PS2BF16); O = O * alpha + P V  (TDPBF16PS, V pairs interleaved once
 *                                                       per tile for every chunk)
 * FlashAttention's recurrence (Dao et al. 2022, sec. 3.1) with bf16 probabilities, as its
 * GPU kernels take them. Every quantity above is per lane, so per row: a row's bits depend on
 * its own query, position and context only, the same in a prompt chunk, a decode step or
 * any batch. A row whose position is before the tile skips it entirely.
 */
#ifndef PDSERVE_ATTENTION_AMX_H
#define PDSERVE_ATTENTION_AMX_H

#include "amx.h"

#define AT 32 /* keys per tile */

/* Work for one thread: sized for QB tokens x G heads, head dim D. */
typedef struct {
    uint16_t *qt;  /* [chunks][D / 32][16 pairs][16 lanes][2]: each chunk's queries as B tiles */
    float *o;      /* [chunks * 16][D] the rows' accumulators */
    uint16_t *vt;  /* [D / 16][16 pairs][16 d][2]: the tile's values as B tiles */
    uint16_t *kp;  /* [2][16][D]: a half tile of keys copied where it is not whole in one block */
    float *st;     /* [AT][16]: S^T of one chunk */
    uint16_t *p;   /* [16][AT]: the chunk's probabilities as an A tile */
    float *pv;     /* [16][D] */
} amx_attn_work;

static size_t amx_attn_work_bytes(int64_t rows, int64_t D) {
    int64_t chunks = (rows + 15) / 16;
    return (size_t)(chunks * D * 16 * 2 + chunks * 16 * D * 4 + D * 32 * 2 + 2 * 16 * D * 2 + AT * 16 * 4 + 16 * AT * 2 + 16 * D * 4) + 8 * 64;
}

static amx_attn_work amx_attn_carve(char *mem, int64_t rows, int64_t D) {
    int64_t chunks = (rows + 15) / 16;
    amx_attn_work w;
    char *p = (char *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
#define CARVE(field, T, n) w.field = (T *)p, p += (((size_t)(n) * sizeof(T)) + 63) / 64 * 64
    CARVE(qt, uint16_t, chunks * D * 16);
    CARVE(o, float, chunks * 16 * D);
    CARVE(vt, uint16_t, D * 32);
    CARVE(kp, uint16_t, 2 * 16 * D);
    CARVE(st, float, AT * 16);
    CARVE(p, uint16_t, 16 * AT);
    CARVE(pv, float, 16 * D);
#undef CARVE
    return w;
}

/* exp(x) for x <= 0 (every exponent here is a score less the running max): 2^t with
 * t = x log2(e) split as n + f, |f| <= 1/2, 2^f from Cephes' exp2f polynomial (relative
 * error ~2e-7, below the bf16 rounding of the probabilities), scaled by 2^n with VSCALEFPS,
 * which also takes t far below the float range to 0. Ten vector ops against simd.h vexp's
 * twenty; a function of x only, so a row's bits stay its own. */
static inline __m512 amx_exp(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.535336188319500e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.339887440266574e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.618437357674640e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550332471162809e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.402264791363012e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931472028550421e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* l's share of a tile: sum over j < 32 of e[j] in a fixed tree (j + 16, then + 8, + 4, + 2, + 1). */
static inline __m512 tile_sum32(__m512 e[AT]) {
    for (int w = AT / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) e[j] = _mm512_add_ps(e[j], e[j + w]);
    return e[0];
}

/* One tile's softmax step for a chunk, a lane per row: st = S^T [AT keys][16 lanes]; pos:
 * each lane's position (-1: no row); m, l: the lanes' running max and sum, updated. Writes
 * P [16 rows][AT] bf16 (the A tile of P V) and alpha[16], the factor on the rows' O.
 * full: every row of the chunk sees every key of the tile, so no key is masked (the lanes
 * without a row then compute on zero queries, and nothing reads them); the ops a mask would
 * leave alone are the same, so the bits too. */
static inline void softmax_lanes(const float *st, __m512i pos, int64_t j0, float scale, float *m, float *l, uint16_t *p, float *alpha,
                                 int full) {
    __m512 s[AT], mt = _mm512_set1_ps(-INFINITY), mo = _mm512_loadu_ps(m);
    __mmask16 valid[AT];
    for (int j = 0; j < AT; j++) {
        valid[j] = full ? (__mmask16)0xffff : _mm512_cmple_epi32_mask(_mm512_set1_epi32((int32_t)(j0 + j)), pos);
        s[j] = _mm512_mul_ps(_mm512_loadu_ps(st + 16 * j), _mm512_set1_ps(scale));
        if (!full) s[j] = _mm512_mask_blend_ps(valid[j], _mm512_set1_ps(-INFINITY), s[j]);
        mt = _mm512_max_ps(mt, s[j]);
    }
    __m512 mn = _mm512_max_ps(mo, mt);
    __mmask16 moves = _mm512_cmp_ps_mask(mo, mn, _CMP_NEQ_UQ) & _mm512_cmp_ps_mask(mo, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
    __m512 al = _mm512_mask_blend_ps(moves, _mm512_set1_ps(1.0f), amx_exp(_mm512_maskz_sub_ps(moves, mo, mn)));
    __mmask16 live = _mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ); /* lanes with keys so far */
    _mm512_storeu_ps(m, _mm512_mask_mov_ps(mo, live, mn));
    if (full)
        for (int j = 0; j < AT; j++) s[j] = amx_exp(_mm512_sub_ps(s[j], mn));
    else
        for (int j = 0; j < AT; j++) s[j] = _mm512_maskz_mov_ps(valid[j], amx_exp(_mm512_maskz_sub_ps(valid[j], s[j], mn)));
    /* P: pairs of keys as dwords (lane n: e_2i[n], e_2i+1[n]), then a 16 x 16 dword transpose */
    const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005, 0x00160006, 0x00170007,
                                                 0x00180008, 0x00190009, 0x001a000a, 0x001b000b, 0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
    __m512 pr[16];
    for (int i = 0; i < 16; i++) pr[i] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * i + 1], s[2 * i])));
    transpose16(pr);
    for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)p + 16 * i, pr[i]);
    _mm512_storeu_ps(l, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l), al), tile_sum32(s)));
    _mm512_storeu_ps(alpha, al);
}

/* softmax_lanes for the first `rows` lanes, one row at a time with keys in lanes: the same
 * operations per element (the max is exact in any order; l's tree is tile_sum32's, which is
 * vsum() of keys j + (j + 16)), so the same bits; cheaper when a chunk holds a decode token's
 * few heads. lp: the lanes' positions. */
static inline void softmax_rows(const float *st, const int32_t *lp, int rows, int64_t j0, float scale, float *m, float *l, uint16_t *p, float *alpha) {
    const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for (int n = 0; n < rows; n++) {
        alpha[n] = 1.0f;
        if (lp[n] < j0) continue; /* no keys here: the row skips the tile */
        int64_t nv = lp[n] - j0 + 1;
        __mmask16 v0 = nv >= 16 ? 0xffff : (__mmask16)((1u << nv) - 1);
        __mmask16 v1 = nv >= 32 ? 0xffff : nv > 16 ? (__mmask16)((1u << (nv - 16)) - 1) : 0;
        __m512 s0 = _mm512_mask_blend_ps(v0, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(_mm512_i32gather_ps(col, st + n, 4), _mm512_set1_ps(scale)));
        __m512 s1 = _mm512_mask_blend_ps(v1, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(_mm512_i32gather_ps(col, st + 16 * 16 + n, 4), _mm512_set1_ps(scale)));
        float mt = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)), mo = m[n], mn = mo > mt ? mo : mt;
        float al = mo != mn && mo != -INFINITY ? _mm512_cvtss_f32(amx_exp(_mm512_set1_ps(mo - mn))) : 1.0f;
        if (mn != -INFINITY) m[n] = mn;
        __m512 e0 = _mm512_maskz_mov_ps(v0, amx_exp(_mm512_maskz_sub_ps(v0, s0, _mm512_set1_ps(mn))));
        __m512 e1 = _mm512_maskz_mov_ps(v1, amx_exp(_mm512_maskz_sub_ps(v1, s1, _mm512_set1_ps(mn))));
        _mm512_storeu_si512(p + AT * n, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        l[n] = l[n] * al + vsum(_mm512_add_ps(e0, e1));
        alpha[n] = al;
    }
}

static void attend_unit_amx(const attn_args *a, int64_t t0, int64_t t1, int64_t g, amx_attn_work *w) {
    const int64_t G = a->heads / a->kv_heads, D = a->D, R = (t1 - t0) * G, chunks = (R + 15) / 16, DK = D / 32;
    const int32_t *table = a->tables + (int64_t)a->token_seq[t0] * a->max_blocks;
    const uint16_t *kh = (const uint16_t *)a->k + g * a->kv_head_stride, *vh = (const uint16_t *)a->v + g * a->kv_head_stride;
    __m512i pos[MAX_GROUP * QB / 16]; /* each lane's position; -1 for lanes past R */
    float m[MAX_GROUP * QB], l[MAX_GROUP * QB]; /* each row's running max and sum */
    int64_t chunk_last[MAX_GROUP * QB / 16]; /* the largest position in the chunk */
    int64_t chunk_first[MAX_GROUP * QB / 16]; /* the smallest position of a row in the chunk */
    /* queries as B tiles: dword (i, n) of d-chunk dk is row n's dword 16 dk + i (a pair of d) */
    memset(w->qt, 0, (size_t)(chunks * D * 16 * 2));
    for (int64_t c = 0; c < chunks; c++) {
        int32_t lane_pos[16];
        chunk_last[c] = -1;
        chunk_first[c] = INT64_MAX;
        for (int n = 0; n < 16; n++) {
            int64_t r = 16 * c + n;
            lane_pos[n] = -1;
            if (r >= R) continue;
            int64_t t = t0 + r / G, h = r % G;
            const uint32_t *qr = (const uint32_t *)((const uint16_t *)a->q + t * a->ldq + (g * G + h) * D);
            uint32_t *qt = (uint32_t *)w->qt + c * DK * 256;
            for (int64_t i = 0; i < D / 2; i++) qt[(i / 16) * 256 + (i % 16) * 16 + n] = qr[i];
            lane_pos[n] = (int32_t)a->positions[t];
            chunk_last[c] = a->positions[t];
            if (a->positions[t] < chunk_first[c]) chunk_first[c] = a->positions[t];
        }
        pos[c] = _mm512_loadu_si512(lane_pos);
        for (int n = 0; n < 16; n++) m[16 * c + n] = -INFINITY, l[16 * c + n] = 0.0f;
    }
    memset(w->o, 0, (size_t)(chunks * 16 * D * 4));
    /* d-chunk c of a value row pair: words 2dd, 2dd + 1 = v_2i[16c + dd], v_2i+1[16c + dd] */
    __m512i pair_idx[2];
    for (int h = 0; h < 2; h++) {
        uint16_t idx[32];
        for (int dd = 0; dd < 16; dd++) idx[2 * dd] = (uint16_t)(16 * h + dd), idx[2 * dd + 1] = (uint16_t)(32 + 16 * h + dd);
        pair_idx[h] = _mm512_loadu_si512(idx);
    }
    memset(w->p, 0, 16 * AT * 2);
    const int64_t last = a->positions[t1 - 1];
    for (int64_t j0 = 0; j0 <= last; j0 += AT) {
        int64_t n = last + 1 - j0 < AT ? last + 1 - j0 : AT;
        const uint16_t *kr[AT], *vr[AT];
        const char *pfk[AT / 2], *pfv[AT / 2];
        int64_t npf = 0;
        if (a->block_size % 16 == 0) { /* a half tile is 16 slots of one block: two look-ups */
            for (int64_t hf = 0; hf < 2; hf++) {
                int64_t j = j0 + 16 * hf;
                if (j > last) break; /* no keys here (nor two tiles on) */
                int64_t slot = (int64_t)table[j / a->block_size] * a->block_size + j % a->block_size;
                for (int64_t r = 0; r < 16; r++) kr[16 * hf + r] = kh + (slot + r) * D, vr[16 * hf + r] = vh + (slot + r) * D;
                j += 2 * AT;
                if (j > last) continue;
                slot = (int64_t)table[j / a->block_size] * a->block_size + j % a->block_size;
                for (int64_t r = 0; r < 16 && j + r <= last; r += 2, npf++)
                    pfk[npf] = (const char *)(kh + (slot + r) * D), pfv[npf] = (const char *)(vh + (slot + r) * D);
            }
        } else {
            int64_t blk = j0 / a->block_size, off = j0 % a->block_size;
            for (int64_t j = 0; j < n; j++) {
                int64_t slot = (int64_t)table[blk] * a->block_size + off;
                kr[j] = kh + slot * D, vr[j] = vh + slot * D;
                if (++off == a->block_size) blk++, off = 0;
            }
            /* the tile two ahead: its keys' and values' rows, fetched into L2 a pair of keys at a
             * time during the value interleave below (spread out, so the requests stay in flight) */
            for (int64_t j = j0 + 2 * AT; j < j0 + 3 * AT && j <= last; j += 2, npf++) {
                int64_t slot = (int64_t)table[j / a->block_size] * a->block_size + j % a->block_size;
                pfk[npf] = (const char *)(kh + slot * D), pfv[npf] = (const char *)(vh + slot * D);
            }
        }
        /* keys as A tiles: 16 rows in place where they are whole and one block apart, else copied */
        const uint16_t *ka[2];
        for (int hf = 0; hf < 2; hf++) {
            int64_t j = 16 * hf, nh = n - j;
            if (nh >= 16 && kr[j + 15] == kr[j] + 15 * D) {
                ka[hf] = kr[j];
                continue;
            }
            uint16_t *dst = w->kp + hf * 16 * D;
            for (int64_t r = 0; r < 16; r++)
                if (r < nh) memcpy(dst + r * D, kr[j + r], (size_t)D * 2);
                else memset(dst + r * D, 0, (size_t)D * 2);
            ka[hf] = dst;
        }
        /* values as B tiles: row i of d-chunk c interleaves keys 2i and 2i + 1 (zeros past n) */
        for (int64_t i = 0; i < AT / 2; i++) {
            if (i < npf) /* keys j and j + 1 (a block holds an even count of slots: one more row on) */
                for (int64_t x = 0; x < D * 2 * (1 + (a->block_size % 2 == 0)); x += 64) {
                    _mm_prefetch(pfk[i] + x, _MM_HINT_T1);
                    _mm_prefetch(pfv[i] + x, _MM_HINT_T1);
                }
            const uint16_t *v0 = 2 * i < n ? vr[2 * i] : 0, *v1 = 2 * i + 1 < n ? vr[2 * i + 1] : 0;
            for (int64_t z = 0; z < D / 32; z++) {
                __m512i x0 = v0 ? _mm512_loadu_si512(v0 + 32 * z) : _mm512_setzero_si512();
                __m512i x1 = v1 ? _mm512_loadu_si512(v1 + 32 * z) : _mm512_setzero_si512();
                for (int h = 0; h < 2; h++) _mm512_storeu_si512(w->vt + ((2 * z + h) * 16 + i) * 32, _mm512_permutex2var_epi16(x0, pair_idx[h], x1));
            }
        }
        for (int64_t c = 0; c < chunks; c++) {
            if (chunk_last[c] < j0) continue; /* every row of the chunk is before this tile */
            /* S^T: tiles 0, 1 = keys 0-15, 16-31 of the tile x the chunk's 16 lanes */
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t dk = 0; dk < DK; dk++) {
                amx_load(2, w->qt + (c * DK + dk) * 512, 64);
                amx_load(3, ka[0] + 32 * dk, D * 2);
                _tile_dpbf16ps(0, 3, 2);
                amx_load(4, ka[1] + 32 * dk, D * 2);
                _tile_dpbf16ps(1, 4, 2);
            }
            _tile_stored(0, w->st, 64);
            _tile_stored(1, w->st + 16 * 16, 64);
            /* the softmax step: a lane per row, or row by row where the chunk has few (decode) */
            float alpha[16];
            int32_t lp[16];
            _mm512_storeu_si512(lp, pos[c]);
            int rows = R - 16 * c < 16 ? (int)(R - 16 * c) : 16;
            if (rows <= 4) softmax_rows(w->st, lp, rows, j0, a->scale, m + 16 * c, l + 16 * c, w->p, alpha);
            else if (chunk_first[c] >= j0 + AT - 1) softmax_lanes(w->st, pos[c], j0, a->scale, m + 16 * c, l + 16 * c, w->p, alpha, 1);
            else softmax_lanes(w->st, pos[c], j0, a->scale, m + 16 * c, l + 16 * c, w->p, alpha, 0);
            /* O = O * alpha + P V, d-chunk by d-chunk */
            amx_load(5, w->p, 64);
            for (int64_t dc = 0; dc < D / 16; dc += 4) { /* four independent C tiles (0-3) at a time */
                _tile_zero(0);
                amx_load(6, w->vt + dc * 512, 64);
                _tile_dpbf16ps(0, 5, 6);
                if (dc + 1 < D / 16) {
                    _tile_zero(1);
                    amx_load(7, w->vt + (dc + 1) * 512, 64);
                    _tile_dpbf16ps(1, 5, 7);
                }
                if (dc + 2 < D / 16) {
                    _tile_zero(2);
                    amx_load(6, w->vt + (dc + 2) * 512, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_zero(3);
                    amx_load(7, w->vt + (dc + 3) * 512, 64);
                    _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, w->pv + 16 * dc, D * 4);
                if (dc + 1 < D / 16) _tile_stored(1, w->pv + 16 * (dc + 1), D * 4);
                if (dc + 2 < D / 16) {
                    _tile_stored(2, w->pv + 16 * (dc + 2), D * 4);
                    _tile_stored(3, w->pv + 16 * (dc + 3), D * 4);
                }
            }
            for (int nn = 0; nn < rows; nn++) {
                if (lp[nn] < j0) continue; /* this row's keys end before the tile */
                float *o = w->o + (16 * c + nn) * D;
                const __m512 av = _mm512_set1_ps(alpha[nn]);
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), av, _mm512_loadu_ps(w->pv + nn * D + d)));
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        int64_t t = t0 + r / G, h = r % G;
        uint16_t *out = (uint16_t *)a->out + (t * a->heads + g * G + h) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int64_t d = 0; d < D; d += 16) _mm256_storeu_si256((__m256i *)(out + d), amx_round_bf16(_mm512_mul_ps(_mm512_loadu_ps(w->o + r * D + d), inv)));
    }
}

#endif
