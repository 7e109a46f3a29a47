/* bf16 paged attention on AMX tiles (amx.h), included by attention.c where amx_on and
 * D % 32 == 0. The same unit of work as attention.c's attend_unit: query tokens [t0, t1) of
 * one sequence, all G query heads of KV head g, rows r = (token, head), taken 16 at a time
 * (one "chunk": a vector lane per row).
 *
 * Keys go in tiles of AT = 32 aligned at position 0. First, for each unit, the tiles' values
 * are interleaved into pairs (the B layout of P V) and keys that are not 16 whole rows of one
 * block are copied; a tile staged the same way for the unit before (the same prompt and KV
 * head, the same keys) is kept, so a prompt's query blocks stage its context once per thread.
 * Then chunk by chunk, tile by tile:
 *   S^T[j][n] = k_j . q_n             TDPBF16PS, keys as A rows read in place from the pool,
 *                                     the chunk's queries as B (pairs transposed once per unit)
 *   u_j = s_j c with c = scale log2(e): scores in log2 units, masked to keys <= the row's
 *   position (lane n's own)
 *   mt = max_j u_j; the row's reference m moves to mt where it has none yet, or where
 *   mt > m + LAZY2 (then alpha = 2^(m_old - m), and O, l are scaled by it); else it stays
 *   e_j = 2^(s_j c - m) (at most 2^LAZY2, one rounding); l = l * alpha + tree_j e_j
 *                                     (the tree: j + 16, + 8, + 4, + 2, + 1; 2^x is amx_exp2)
 *   P = bf16(e) (VCVTNE2PS2BF16); O += P V  (TDPBF16PS into C tiles that hold the chunk's O
 *                                            across the tiles where D <= 64, else staged in
 *                                            memory, exact both ways)
 * FlashAttention's recurrence (Dao et al. 2022, sec. 3.1) with bf16 probabilities, as its
 * GPU kernels take them, and its rescaling only when a row's max grows by more than LAZY2
 * (FlashAttention-3's lazy rescaling, Shah et al. 2024): O stays in the tiles. Every
 * quantity above is per lane, so per row: a row's bits depend on its own query, position and
 * context only, the same in a prompt chunk, a decode step or any batch. A row whose position
 * is before a tile adds exact zeros (P = 0) or skips it.
 */
#ifndef PDSERVE_ATTENTION_AMX_H
#define PDSERVE_ATTENTION_AMX_H

#include <stdio.h>

#include "amx.h"

#define AT 32 /* keys per tile */

#define LAZY2 11.5f /* a row's reference max (in log2 units: scores x scale x log2 e) moves, and O and l are
                      * rescaled, when a tile's max exceeds it by more (probabilities stay below 2^11.5, e^8) */

/* Work for one thread: sized for QB tokens x G heads, head dim D; the unit's tiles of keys
 * and values grow with its context (amx_attn_tiles). */
typedef struct {
    uint16_t *qt;  /* [chunks][D / 32][16 pairs][16 lanes][2]: each chunk's queries as B tiles */
    float *o;      /* [16][D]: one chunk's O where it is staged in memory */
    float *st;     /* [2][AT][16]: S^T of one chunk's key tile, two tiles in turn */
    uint16_t *p;   /* [16][AT]: the chunk's probabilities as an A tile */
    uint16_t *vt;  /* [tiles][D / 16][16 pairs][16 d][2]: each tile's values as B tiles */
    uint16_t *kp;  /* [tiles][2][16][D]: half tiles of keys copied where they are not 16 rows of one block */
    const uint16_t **ka; /* [tiles][2]: each half tile's keys (16 rows D apart) */
    int32_t *staged; /* [tiles]: how many keys tile jt holds as staged for (staged_table, staged_vh), zeros after; -1: none */
    const int32_t *staged_table;
    const uint16_t *staged_vh;
    int64_t tiles; /* the capacity of vt, kp, ka, staged */
    const int32_t *next_table; /* the next unit this thread takes (its block table, values, last key), or NULL */
    const uint16_t *next_vh;
    int64_t next_last;
    char *tile_mem;
} amx_attn_work;

static size_t amx_attn_work_bytes(int64_t rows, int64_t D) {
    int64_t chunks = (rows + 15) / 16;
    return (size_t)(chunks * D * 16 * 2 + 16 * D * 4 + 2 * AT * 16 * 4 + 16 * AT * 2) + 8 * 64;
}

static amx_attn_work amx_attn_carve(char *mem, int64_t rows, int64_t D) {
    int64_t chunks = (rows + 15) / 16;
    amx_attn_work w;
    memset(&w, 0, sizeof w);
    char *p = (char *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
#define CARVE(field, T, n) w.field = (T *)p, p += (((size_t)(n) * sizeof(T)) + 63) / 64 * 64
    CARVE(qt, uint16_t, chunks * D * 16);
    CARVE(o, float, 16 * D);
    CARVE(st, float, 2 * AT * 16);
    CARVE(p, uint16_t, 16 * AT);
#undef CARVE
    return w;
}

/* No memory for the work: no other path gives these rows' bits, so the process stops, saying
 * why (a replica's supervisor restarts it), rather than answer with other numerics. */
static void amx_attn_out_of_memory(void) {
    fprintf(stderr, "pdserve attention (AMX): out of memory for a unit's work; stopping\n");
    abort();
}

/* Room for `tiles` tiles of keys and values (grown by half again at least, so a batch of
 * rising contexts does not reallocate per unit). Returns 0, or -1 where memory ran out. */
static int amx_attn_tiles(amx_attn_work *w, int64_t tiles, int64_t D) {
    if (tiles <= w->tiles) return 0;
    if (tiles < w->tiles + w->tiles / 2) tiles = w->tiles + w->tiles / 2;
    free(w->tile_mem);
    size_t vt = (size_t)(tiles * D * 32 * 2), kp = (size_t)(tiles * 32 * D * 2), ka = (size_t)(tiles * 2) * sizeof(void *),
           st = (size_t)tiles * sizeof(int32_t);
    w->tile_mem = aligned_alloc(64, (vt + kp + ka + st + 63) / 64 * 64);
    if (!w->tile_mem) return w->tiles = 0, -1;
    w->vt = (uint16_t *)w->tile_mem, w->kp = (uint16_t *)(w->tile_mem + vt), w->ka = (const uint16_t **)(w->tile_mem + vt + kp);
    w->staged = (int32_t *)(w->tile_mem + vt + kp + ka);
    for (int64_t jt = 0; jt < tiles; jt++) w->staged[jt] = -1;
    w->tiles = tiles;
    return 0;
}

/* 2^t for finite t <= LAZY2 (every exponent here is a score's distance below its row's
 * reference max, in units of log2, or two maxima's difference; -inf never reaches it, masks
 * take those lanes): t = n + f with n = round(t) (the 1.5 x 2^23 addend's rounding, to
 * nearest even, exact for |t| < 2^22; below that, 2^n takes the result to 0 anyway) and
 * |f| <= 1/2, 2^f from a degree-5 polynomial (least squares on Chebyshev nodes of
 * [-1/2, 1/2], relative error 1.7e-7, below the bf16 rounding of the probabilities), scaled
 * by 2^n with VSCALEFPS, which also takes n far below the float range to 0. Nine vector ops;
 * a function of t only, so a row's bits stay its own. */
static inline __m512 amx_exp2(__m512 t) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.3218672247603536e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.671698324382305e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550893023610115e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022237956523895e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931468844413757e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

/* l's share of a tile: sum over j < 32 of e[j] in a fixed tree (j + 16, then + 8, + 4, + 2, + 1). */
static inline __m512 tile_sum32(__m512 e[AT]) {
    for (int w = AT / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) e[j] = _mm512_add_ps(e[j], e[j + w]);
    return e[0];
}

/* One tile's softmax step for a chunk, a lane per row: st = S^T [AT keys][16 lanes], raw
 * dot products; c = scale x log2 e, so that u = s c is a score in log2 units; pos: each lane's
 * position (-1: no row); m, l: the lanes' reference max (of u) and sum, updated. Writes P
 * [16 rows][AT] bf16 (the A tile of P V) and alpha[16], the factor on the rows' O; returns the
 * lanes whose O must be scaled by it. The tile's max of u is (max_j s_j) c, exactly (rounding
 * is monotone and c > 0), the max taken in a tree (exact in any order); e_j = 2^(s_j c - m)
 * with one rounding (FMA). full: every row of the chunk sees every key of the tile, so no key
 * is masked (the lanes without a row then compute on zero queries, and nothing reads them);
 * the ops a mask would leave alone are the same, so the bits too. */
static inline __mmask16 softmax_lanes(const float *st, __m512i pos, int64_t j0, float c, float *m, float *l, uint16_t *p, float *alpha,
                                      int full) {
    __m512 s[AT], mx[AT / 2];
    const __m512 mo = _mm512_loadu_ps(m), vc = _mm512_set1_ps(c), ninf = _mm512_set1_ps(-INFINITY);
    __mmask16 valid[AT];
    for (int j = 0; j < AT; j++) {
        valid[j] = full ? (__mmask16)0xffff : _mm512_cmple_epi32_mask(_mm512_set1_epi32((int32_t)(j0 + j)), pos);
        s[j] = _mm512_loadu_ps(st + 16 * j);
        if (!full) s[j] = _mm512_mask_blend_ps(valid[j], ninf, s[j]);
    }
    for (int j = 0; j < AT / 2; j++) mx[j] = _mm512_max_ps(s[j], s[j + AT / 2]);
    for (int w = AT / 4; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) mx[j] = _mm512_max_ps(mx[j], mx[j + w]);
    const __m512 mt = _mm512_mul_ps(mx[0], vc);
    const __mmask16 had = _mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_UQ);
    const __mmask16 first = ~had & _mm512_cmp_ps_mask(mt, ninf, _CMP_NEQ_UQ);
    const __mmask16 grow = had & _mm512_cmp_ps_mask(mt, _mm512_add_ps(mo, _mm512_set1_ps(LAZY2)), _CMP_GT_OQ);
    const __m512 mn = _mm512_mask_mov_ps(mo, first | grow, mt);
    const __m512 al = _mm512_mask_blend_ps(grow, _mm512_set1_ps(1.0f), amx_exp2(_mm512_maskz_sub_ps(grow, mo, mn)));
    _mm512_storeu_ps(m, mn);
    if (full)
        for (int j = 0; j < AT; j++) s[j] = amx_exp2(_mm512_fmsub_ps(s[j], vc, mn));
    else
        for (int j = 0; j < AT; j++) s[j] = _mm512_maskz_mov_ps(valid[j], amx_exp2(_mm512_maskz_fmsub_ps(valid[j], s[j], vc, mn)));
    /* P: pairs of keys as dwords (lane n: e_2i[n], e_2i+1[n]), then a 16 x 16 dword transpose */
    const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005, 0x00160006, 0x00170007,
                                                 0x00180008, 0x00190009, 0x001a000a, 0x001b000b, 0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);
    __m512 pr[16];
    for (int i = 0; i < 16; i++) pr[i] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * i + 1], s[2 * i])));
    transpose16(pr);
    for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)p + 16 * i, pr[i]);
    _mm512_storeu_ps(l, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l), al), tile_sum32(s)));
    _mm512_storeu_ps(alpha, al);
    return grow;
}

/* softmax_lanes for the first `rows` lanes, one row at a time with keys in lanes: the same
 * operations per element (the max is exact in any order; l's tree is tile_sum32's, which is
 * vsum() of keys j + (j + 16)), so the same bits; cheaper when a chunk holds a decode token's
 * few heads. lp: the lanes' positions. */
static inline __mmask16 softmax_rows(const float *st, const int32_t *lp, int rows, int64_t j0, float c, float *m, float *l, uint16_t *p,
                                     float *alpha) {
    const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const __m512 vc = _mm512_set1_ps(c), ninf = _mm512_set1_ps(-INFINITY);
    __mmask16 grows = 0;
    for (int n = 0; n < rows; n++) {
        alpha[n] = 1.0f;
        if (lp[n] < j0) { /* no keys here: P's row is zeros (O adds exact zeros) */
            _mm512_storeu_si512(p + AT * n, _mm512_setzero_si512());
            continue;
        }
        int64_t nv = lp[n] - j0 + 1;
        __mmask16 v0 = nv >= 16 ? 0xffff : (__mmask16)((1u << nv) - 1);
        __mmask16 v1 = nv >= 32 ? 0xffff : nv > 16 ? (__mmask16)((1u << (nv - 16)) - 1) : 0;
        __m512 s0 = _mm512_mask_blend_ps(v0, ninf, _mm512_i32gather_ps(col, st + n, 4));
        __m512 s1 = _mm512_mask_blend_ps(v1, ninf, _mm512_i32gather_ps(col, st + 16 * 16 + n, 4));
        const float mt = _mm_cvtss_f32(_mm_mul_ss(_mm_set_ss(_mm512_reduce_max_ps(_mm512_max_ps(s0, s1))), _mm_set_ss(c))), mo = m[n];
        float mn = mo;
        if (mo == -INFINITY) mn = mt;
        else if (mt > _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(mo), _mm_set_ss(LAZY2)))) {
            mn = mt;
            alpha[n] = _mm512_cvtss_f32(amx_exp2(_mm512_set1_ps(_mm_cvtss_f32(_mm_sub_ss(_mm_set_ss(mo), _mm_set_ss(mn))))));
            grows |= (__mmask16)(1u << n);
        }
        m[n] = mn;
        const __m512 vm = _mm512_set1_ps(mn);
        __m512 e0 = _mm512_maskz_mov_ps(v0, amx_exp2(_mm512_maskz_fmsub_ps(v0, s0, vc, vm)));
        __m512 e1 = _mm512_maskz_mov_ps(v1, amx_exp2(_mm512_maskz_fmsub_ps(v1, s1, vc, vm)));
        _mm512_storeu_si512(p + AT * n, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        l[n] = l[n] * alpha[n] + vsum(_mm512_add_ps(e0, e1));
    }
    return grows;
}

/* O's d-chunk dc (16 columns) of the chunk += P V_dc, in C tile T: resident (D <= 64) in
 * the tile across the key tiles, else loaded from and stored to o. Tile 6 holds P. */
#define AMX_PV(T, dc)                                                                  \
    do {                                                                               \
        if ((dc) < ND) {                                                               \
            if (!resident) amx_load(T, w->o + 16 * (dc), D * 4);                       \
            amx_load(7, vt + (dc) * 512, 64);                                          \
            _tile_dpbf16ps(T, 6, 7);                                                   \
            if (!resident) _tile_stored(T, w->o + 16 * (dc), D * 4);                   \
        }                                                                              \
    } while (0)
#define AMX_O_STORE(T) do { if ((T) < ND) _tile_stored(T, w->o + 16 * (T), D * 4); } while (0)
#define AMX_O_LOAD(T) do { if ((T) < ND) amx_load(T, w->o + 16 * (T), D * 4); } while (0)

/* The rows of keys from .. to (inclusive, none where to < from) of one head through a block
 * table, at out[n ..]: base + slot * D each, the block walked (one division per call, not per
 * key). Returns n plus their count. */
static inline int amx_walk_rows(const uint16_t **out, int n, const int32_t *table, const uint16_t *base, int64_t from, int64_t to, int64_t bs,
                                int64_t D) {
    if (to < from) return n;
    int64_t blk = from / bs, off = from % bs;
    const uint16_t *row = base + ((int64_t)table[blk] * bs + off) * D;
    for (int64_t j = from; j <= to; j++) {
        out[n++] = row;
        if (++off == bs) blk++, off = 0, row = j < to ? base + (int64_t)table[blk] * bs * D : row;
        else row += D;
    }
    return n;
}

/* The keys and values of the unit's tiles [0, ntiles) (keys 0 .. last): half tiles of keys
 * as A tiles (in place where 16 whole rows of one block, else copied with zeros past last)
 * and values as B tiles (row i of d-chunk c interleaves keys 2i and 2i + 1, zeros past last).
 * Each tile's keys are fetched into L2 as its values are read, for the first chunk's S^T;
 * with `ahead` (a unit of one chunk: a decode token, whose KV is rarely in cache) the keys and
 * values two tiles on too, a pair of rows at a time, reaching into the next unit's first
 * tiles at the end. Decode at batch 32, context 512, KV in
 * DRAM: 39 -> 36 ms a step; a 2,048-token prefill, whose KV was just written, loses 8% with
 * it (Xeon, 2026-12-06). */
static void amx_stage_tiles(const attn_args *a, const int32_t *table, const uint16_t *kh, const uint16_t *vh, int64_t last, int ahead,
                            amx_attn_work *w) {
    const int64_t D = a->D, ntiles = last / AT + 1;
    __m512i pair_idx[2]; /* d-chunk c of a value row pair: words 2dd, 2dd + 1 = v_2i[16c + dd], v_2i+1[16c + dd] */
    for (int h = 0; h < 2; h++) {
        uint16_t idx[32];
        for (int dd = 0; dd < 16; dd++) idx[2 * dd] = (uint16_t)(16 * h + dd), idx[2 * dd + 1] = (uint16_t)(32 + 16 * h + dd);
        pair_idx[h] = _mm512_loadu_si512(idx);
    }
    if (w->staged_table && (ahead || w->staged_table != table || w->staged_vh != vh)) /* with none kept, every tile is -1 already */
        for (int64_t jt = 0; jt < w->tiles; jt++) w->staged[jt] = -1;
    w->staged_table = ahead ? 0 : table, w->staged_vh = ahead ? 0 : vh;
    for (int64_t jt = 0; jt < ntiles; jt++) {
        const int64_t j0 = jt * AT, n = last + 1 - j0 < AT ? last + 1 - j0 : AT;
        if (w->staged[jt] == n) continue; /* as this unit would stage it: the same keys, the same zeros after */
        w->staged[jt] = ahead ? -1 : (int32_t)n;
        const uint16_t *kr[AT], *vr[AT];
        amx_walk_rows(vr, 0, table, vh, j0, j0 + n - 1, a->block_size, D);
        for (int64_t j = 0; j < n; j++) kr[j] = vr[j] + (kh - vh);
        for (int hf = 0; hf < 2; hf++) {
            int64_t j = 16 * hf, nh = n - j;
            int whole = nh >= 16; /* 16 rows D apart: one block's (every row checked: blocks of other sizes may line up at the ends only) */
            for (int64_t r = 1; whole && r < 16; r++) whole = kr[j + r] == kr[j] + r * D;
            if (whole) {
                w->ka[2 * jt + hf] = kr[j];
            } else {
                uint16_t *dst = w->kp + (2 * jt + hf) * 16 * D;
                for (int64_t r = 0; r < 16; r++)
                    if (r < nh) memcpy(dst + r * D, kr[j + r], (size_t)D * 2);
                    else memset(dst + r * D, 0, (size_t)D * 2);
                w->ka[2 * jt + hf] = dst;
            }
        }
        uint16_t *vt = w->vt + jt * D * 32;
        const uint16_t *pf[AT]; /* the rows of values two tiles on (keys: the same offset from the keys' pool), asked for into L2 a pair at a time */
        int npf = 0;
        if (ahead) { /* this unit's keys up to its last, then past its last tile, the next unit's first (amx_attn_work.next) */
            const int64_t lo = j0 + 2 * AT, hi = j0 + 3 * AT - 1;
            npf = amx_walk_rows(pf, 0, table, vh, lo, hi < last ? hi : last, a->block_size, D);
            if (w->next_table && hi >= ntiles * AT) {
                const int64_t nlo = lo - ntiles * AT > 0 ? lo - ntiles * AT : 0, nhi = hi - ntiles * AT;
                npf = amx_walk_rows(pf, npf, w->next_table, w->next_vh, nlo, nhi < w->next_last ? nhi : w->next_last, a->block_size, D);
            }
        }
        for (int64_t i = 0; i < AT / 2; i++) {
            for (int64_t q = 2 * i; q < 2 * i + 2 && q < npf; q++)
                for (int64_t x = 0; x < D * 2; x += 64)
                    _mm_prefetch((const char *)pf[q] + x, _MM_HINT_T1), _mm_prefetch((const char *)(pf[q] + (kh - vh)) + x, _MM_HINT_T1);
            if (2 * i < n)
                for (int64_t x = 0; x < D * 2; x += 64) _mm_prefetch((const char *)kr[2 * i] + x, _MM_HINT_T1);
            if (2 * i + 1 < n)
                for (int64_t x = 0; x < D * 2; x += 64) _mm_prefetch((const char *)kr[2 * i + 1] + x, _MM_HINT_T1);
            const uint16_t *v0 = 2 * i < n ? vr[2 * i] : 0, *v1 = 2 * i + 1 < n ? vr[2 * i + 1] : 0;
            for (int64_t z = 0; z < D / 32; z++) {
                __m512i x0 = v0 ? _mm512_loadu_si512(v0 + 32 * z) : _mm512_setzero_si512();
                __m512i x1 = v1 ? _mm512_loadu_si512(v1 + 32 * z) : _mm512_setzero_si512();
                for (int h = 0; h < 2; h++) _mm512_storeu_si512(vt + ((2 * z + h) * 16 + i) * 32, _mm512_permutex2var_epi16(x0, pair_idx[h], x1));
            }
        }
    }
}

/* Returns 0, or -1 where the unit's tiles found no memory (the caller takes another path). */
static int attend_unit_amx(const attn_args *a, int64_t t0, int64_t t1, int64_t g, amx_attn_work *w) {
    const int64_t G = a->heads / a->kv_heads, D = a->D, R = (t1 - t0) * G, chunks = (R + 15) / 16, DK = D / 32, ND = D / 16;
    const int resident = ND <= 4; /* O's C tiles fit tiles 0-3 */
    const float c2 = a->scale * 1.44269504088896341f; /* scores to log2 units */
    const int64_t last = a->positions[t1 - 1];
    if (amx_attn_tiles(w, last / AT + 1, D)) return -1;
    const int32_t *table = a->tables + (int64_t)a->token_seq[t0] * a->max_blocks;
    amx_stage_tiles(a, table, (const uint16_t *)a->k + g * a->kv_head_stride, (const uint16_t *)a->v + g * a->kv_head_stride, last, chunks == 1,
                    w);
    /* queries as B tiles: dword (i, n) of d-chunk dk is row n's dword 16 dk + i (a pair of d) */
    memset(w->qt, 0, (size_t)(chunks * D * 16 * 2));
    for (int64_t c = 0; c < chunks; c++) {
        int32_t lp[16]; /* each lane's position; -1 for lanes past R */
        int64_t chunk_last = -1, chunk_first = INT64_MAX; /* the rows' largest and smallest positions */
        float m[16], l[16];
        for (int n = 0; n < 16; n++) {
            int64_t r = 16 * c + n;
            lp[n] = -1, m[n] = -INFINITY, l[n] = 0.0f;
            if (r >= R) continue;
            int64_t t = t0 + r / G, h = r % G;
            const uint32_t *qr = (const uint32_t *)((const uint16_t *)a->q + t * a->ldq + (g * G + h) * D);
            uint32_t *qt = (uint32_t *)w->qt + c * DK * 256;
            for (int64_t i = 0; i < D / 2; i++) qt[(i / 16) * 256 + (i % 16) * 16 + n] = qr[i];
            lp[n] = (int32_t)a->positions[t];
            chunk_last = a->positions[t];
            if (a->positions[t] < chunk_first) chunk_first = a->positions[t];
        }
        const __m512i pos = _mm512_loadu_si512(lp);
        const int rows = R - 16 * c < 16 ? (int)(R - 16 * c) : 16;
        if (resident) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        } else {
            memset(w->o, 0, (size_t)(16 * D * 4));
        }
        /* S^T of key tile jt: tiles 4, 5 = keys 0-15, 16-31 of the tile x the chunk's 16 lanes.
         * Each tile's is issued before the softmax of the one before it, so that the AMX unit
         * works on it while the vector units work on that softmax (the same operations in the
         * same order per element: the same bits), and stored (to the other of two buffers)
         * right after that softmax, before its P V, so that the AMX queue never holds the next
         * softmax's input behind a P V. A 2,048-token prefill's attention, one thread: 0.88x
         * the time of computing it after the softmax (Xeon, 2026-12-07); the store's place,
         * 0.92x again (Xeon, 2026-12-08). */
#define AMX_QK(jt)                                                 \
        do {                                                       \
            _tile_zero(4);                                         \
            _tile_zero(5);                                         \
            for (int64_t dk = 0; dk < DK; dk++) {                  \
                amx_load(6, w->qt + (c * DK + dk) * 512, 64);      \
                amx_load(7, w->ka[2 * (jt)] + 32 * dk, D * 2);     \
                _tile_dpbf16ps(4, 7, 6);                           \
                amx_load(7, w->ka[2 * (jt) + 1] + 32 * dk, D * 2); \
                _tile_dpbf16ps(5, 7, 6);                           \
            }                                                      \
        } while (0)
        AMX_QK(0);
        _tile_stored(4, w->st, 64);
        _tile_stored(5, w->st + 16 * 16, 64);
        for (int64_t jt = 0; jt * AT <= chunk_last; jt++) {
            const int64_t j0 = jt * AT;
            const int more = j0 + AT <= chunk_last;
            float *st = w->st + (jt & 1) * AT * 16;
            if (more) AMX_QK(jt + 1);
            float alpha[16];
            __mmask16 grow;
            if (rows <= 4) grow = softmax_rows(st, lp, rows, j0, c2, m, l, w->p, alpha);
            else grow = softmax_lanes(st, pos, j0, c2, m, l, w->p, alpha, chunk_first >= j0 + AT - 1);
            grow &= (__mmask16)((1u << rows) - 1); /* lanes without a row keep whatever they hold */
            if (grow) { /* O's rows whose reference max moved, scaled by alpha (in memory, exact both ways) */
                if (resident) {
                    AMX_O_STORE(0);
                    AMX_O_STORE(1);
                    AMX_O_STORE(2);
                    AMX_O_STORE(3);
                }
                for (int n = 0; n < rows; n++)
                    if (grow >> n & 1)
                        for (int64_t d = 0; d < D; d += 16)
                            _mm512_storeu_ps(w->o + n * D + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + n * D + d), _mm512_set1_ps(alpha[n])));
                if (resident) {
                    AMX_O_LOAD(0);
                    AMX_O_LOAD(1);
                    AMX_O_LOAD(2);
                    AMX_O_LOAD(3);
                }
            }
            if (more) { /* the next tile's S^T out before this tile's P V joins the AMX queue */
                _tile_stored(4, w->st + ((jt + 1) & 1) * AT * 16, 64);
                _tile_stored(5, w->st + ((jt + 1) & 1) * AT * 16 + 16 * 16, 64);
            }
            /* O += P V, d-chunk by d-chunk */
            const uint16_t *vt = w->vt + jt * D * 32;
            amx_load(6, w->p, 64);
            for (int64_t dc = 0; dc < ND; dc += 4) {
                AMX_PV(0, dc);
                AMX_PV(1, dc + 1);
                AMX_PV(2, dc + 2);
                AMX_PV(3, dc + 3);
            }
        }
        if (resident) {
            AMX_O_STORE(0);
            AMX_O_STORE(1);
            AMX_O_STORE(2);
            AMX_O_STORE(3);
        }
        for (int n = 0; n < rows; n++) {
            int64_t r = 16 * c + n, t = t0 + r / G, h = r % G;
            uint16_t *out = (uint16_t *)a->out + (t * a->heads + g * G + h) * D;
            const __m512 inv = _mm512_set1_ps(1.0f / l[n]);
            for (int64_t d = 0; d < D; d += 16)
                _mm256_storeu_si256((__m256i *)(out + d), amx_round_bf16(_mm512_mul_ps(_mm512_loadu_ps(w->o + n * D + d), inv)));
        }
    }
    return 0;
}

#undef AMX_QK
#undef AMX_PV
#undef AMX_O_STORE
#undef AMX_O_LOAD

#endif
