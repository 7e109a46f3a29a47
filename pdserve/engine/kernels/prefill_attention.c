/* Causal prefill attention for CPU, bf16, with AVX512-BF16 (VDPBF16PS): the prompt path's
 * attention, rounded as torch's CPU flash attention rounds it, bit for bit.
 *
 * Layouts (element strides):
 *   q:    [q_len, num_heads, head_dim], strides q_stride_pos, q_stride_head (head_dim contiguous)
 *   k, v: per kv head h, key position t: k + h * kv_stride_head + rows[t] (head_dim contiguous)
 *   out:  [q_len, num_heads, head_dim], contiguous
 * Query i (0 <= i < q_len) sees keys 0 .. kv_len - q_len + i (a whole prompt: kv_len = q_len;
 * a chunk after cached tokens: kv_len > q_len). call_kv_len (>= kv_len): the key count of the
 * torch call whose rounding to follow: kv_len for SDPA on this chunk alone, the whole prompt's
 * length for one causal call over the prompt (the reference's prompt forward); it sets the
 * splits' lengths, which decide the exp tail and P @ V's pieces.
 *
 * What torch does (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, torch 2.13, bf16): queries
 * in blocks of 32, 64 or 256 rows (by q_len), keys in splits of 512; per block and split, q @ k.T
 * by the bf16 GEMM cpublas calls (float32 out; not a oneDNN primitive: ONEDNN_VERBOSE shows none),
 * times scale; the row's running max; exp(s - max) with fexp_u20 on 16-key pieces of the split's
 * first (split length / 16) * 16 keys, summed in two accumulators over alternate pieces, added,
 * lanes reduced, then std::exp and a scalar sum for the rest; P rounded to bf16; the running sum
 * and accumulator rescaled by exp(old - new max); P @ V by the GEMM added to the accumulator
 * (beta = 1); last acc * (1 / sum). Probed on this CPU with inputs whose float32 sums cancel
 * only in one order (a 2^24, a 1 and a -2^24 placed in chosen head dims or keys), that GEMM sums
 * - for 4 or more query rows: q.k as one chain over the head dims in order; P @ V as one chain
 *   over the keys in order within pieces of the split (pv_chunks), each piece from zero and then
 *   added to the output;
 * - for 2 or 3 rows (the last block of a prompt): q.k in four chains over d mod 4, combined as
 *   (s0 + s2) + (s1 + s3) (scores_small_block); P @ V in one chain that carries on from the output;
 * - for 1 row: as a decode step (paged_attention.c; paged_prefill.py hands that row over).
 * VDPBF16PS adds a pair's high half first, so K, Q, V and P are packed with the earlier dim or
 * key in the high half: each instruction is two steps of torch's chain, products exact, sums
 * rounded as FMAs (but float32 denormals flushed to zero). Keys a row cannot see are -inf in
 * torch: exp gives 0 and every sum is unchanged, so this kernel skips them; which keys take
 * std::exp depends on the split's length, not the row, and is kept. Outputs equal torch's bit
 * for bit on random inputs of every blocking case (tests/test_engine.py) and on the bundled
 * model's 30 layers at 250-2,048 tokens.
 *
 * Tiles: 12 query rows x 32 keys of scores in 24 accumulators (K packed 16 keys x pair per
 * register), P @ V as (24 / (head_dim / 16)) rows x head_dim (V packed as key pairs), so every
 * VDPBF16PS does 32 useful multiply-adds.
 *
 * Built with cc -O3 -march=native by kernels/__init__.py; one thread per call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "torch_numerics.h"

int prefill_attention_available(void) { return 1; }

#define SCORE_ROWS 12

/* kp: [ceil(n / 32) * 2 groups of 16 keys][head_dim / 2 pairs][16] words: key t's dims 2j (high half), 2j + 1 (low) */
static void pack_k(const uint16_t *k, const int64_t *rows, int64_t n, int64_t head_dim, uint32_t *kp) {
    const int64_t pairs = head_dim / 2, groups = (n + 31) / 32 * 2;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = 0; i < 16; i++) {
            const int64_t t = g * 16 + i;
            uint32_t *dst = kp + g * pairs * 16 + i;
            if (t < n) {
                const uint16_t *src = k + rows[t];
                for (int64_t j = 0; j < pairs; j++) dst[j * 16] = (uint32_t)src[2 * j + 1] | (uint32_t)src[2 * j] << 16;
            } else
                for (int64_t j = 0; j < pairs; j++) dst[j * 16] = 0;
        }
}

/* vp: [ceil(n / 2) pairs][head_dim] words: keys 2t (high half) and 2t + 1 (low) of dim d */
static void pack_v(const uint16_t *v, const int64_t *rows, int64_t n, int64_t head_dim, uint32_t *vp) {
    for (int64_t t = 0; t < (n + 1) / 2; t++) {
        const uint16_t *a = v + rows[2 * t], *b = 2 * t + 1 < n ? v + rows[2 * t + 1] : NULL;
        for (int64_t d = 0; d < head_dim; d++) vp[t * head_dim + d] = (uint32_t)a[d] << 16 | (b ? (uint32_t)b[d] : 0u);
    }
}

/* s[r][0 : n] = scale * q_r . k_t for 12 rows and keys from kp's group 0 (n rounded up to 32) */
static inline __attribute__((always_inline)) void scores_tile(const uint32_t *const q[SCORE_ROWS], const uint32_t *kp, int64_t n,
                                                              const int PAIRS, float scale, float *s, int64_t s_stride) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < n; t += 32) {
        const uint32_t *k0 = kp + (t / 16) * PAIRS * 16, *k1 = k0 + PAIRS * 16;
        __m512 acc[SCORE_ROWS][2];
#pragma GCC unroll 12
        for (int r = 0; r < SCORE_ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int j = 0; j < PAIRS; j++) {
            const __m512bh b0 = (__m512bh)_mm512_loadu_si512(k0 + j * 16), b1 = (__m512bh)_mm512_loadu_si512(k1 + j * 16);
#pragma GCC unroll 12
            for (int r = 0; r < SCORE_ROWS; r++) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)q[r][j]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            }
        }
#pragma GCC unroll 12
        for (int r = 0; r < SCORE_ROWS; r++) {
            _mm512_storeu_ps(s + r * s_stride + t, _mm512_mul_ps(acc[r][0], vscale));
            _mm512_storeu_ps(s + r * s_stride + t + 16, _mm512_mul_ps(acc[r][1], vscale));
        }
    }
}

/* Scores as torch's GEMM sums them for a block of 2 or 3 query rows: four chains over the head
 * dims d mod 4, each in order of d, combined as (s0 + s2) + (s1 + s3); then times scale. Rows
 * 0 .. rows - 1 only; 16 keys per vector, from the same packed K. */
static inline __attribute__((always_inline)) void scores_small_block(const uint32_t *const q[SCORE_ROWS], int64_t rows, const uint32_t *kp,
                                                                     int64_t n, const int PAIRS, float scale, float *s, int64_t s_stride) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < n; t += 16) {
            const uint32_t *kg = kp + (t / 16) * PAIRS * 16;
            __m512 c[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int j = 0; j < PAIRS; j++) { /* dims 2j (high halves) and 2j + 1 (low) */
                const __m512i w = _mm512_loadu_si512(kg + j * 16);
                const float q_even = bf16_to_f32((uint16_t)(q[r][j] >> 16)), q_odd = bf16_to_f32((uint16_t)q[r][j]);
                c[(2 * j) % 4] = _mm512_fmadd_ps(_mm512_set1_ps(q_even), _mm512_castsi512_ps(_mm512_and_si512(w, high)), c[(2 * j) % 4]);
                c[(2 * j + 1) % 4] = _mm512_fmadd_ps(_mm512_set1_ps(q_odd), _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), c[(2 * j + 1) % 4]);
            }
            const __m512 sc = _mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3]));
            _mm512_storeu_ps(s + r * s_stride + t, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
        }
}

/* One row's split: s[0 : live] scores (scaled) -> P pairs p[0 : fill_pairs] (bf16, zero past
 * live; written in pieces of 16 pairs, so p has room up to split / 2). Updates the row's
 * running max and sum as torch does; returns the factor the row's accumulator takes before
 * this split's P @ V. body: keys taking fexp_u20 (torch: the split's length rounded down to
 * 16). live <= 0 (a row of the tile that sees none of this split) changes nothing. */
static float softmax_split(float *s, int64_t live, int64_t body, float *row_max, float *row_sum, uint32_t *p, int64_t fill_pairs) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= live; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
    if (t < live) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << (live - t)) - 1), s + t));
    const float split_max = _mm512_reduce_max_ps(vm);
    const float new_max = split_max > *row_max ? split_max : *row_max;
    float sum = fexp_sum_pieces(s, live < body ? live : body, new_max);
    for (t = body; t < live; t++) {
        s[t] = expf(s[t] - new_max);
        sum += s[t];
    }
    for (t = 0; t < 2 * fill_pairs; t += 32) { /* bf16 pairs, round to nearest even; keys past live are 0 */
        const __mmask16 ma = live - t >= 16 ? (__mmask16)0xffff : live > t ? (__mmask16)((1u << (live - t)) - 1) : 0;
        const __mmask16 mb = live - t >= 32 ? (__mmask16)0xffff : live > t + 16 ? (__mmask16)((1u << (live - t - 16)) - 1) : 0;
        const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(mb, s + t + 16), _mm512_maskz_loadu_ps(ma, s + t));
        _mm512_storeu_si512(p + t / 2, _mm512_rol_epi32((__m512i)w, 16)); /* key t high, t + 1 low */
    }
    const float correction = expf(*row_max - new_max);
    *row_sum = fmaf(correction, *row_sum, sum);
    *row_max = new_max;
    return correction;
}

static inline __attribute__((always_inline)) void pv_pair(const uint32_t *p, int64_t p_stride, const uint32_t *vp, int64_t t, uint32_t mask,
                                                          __m512 acc[12][8], const int ROWS, const int CH) {
    __m512bh b[8];
#pragma GCC unroll 8
    for (int c = 0; c < CH; c++) b[c] = (__m512bh)_mm512_loadu_si512(vp + t * CH * 16 + c * 16);
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; r++) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)(p[r * p_stride + t] & mask));
#pragma GCC unroll 8
        for (int c = 0; c < CH; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
}

/* P_r @ V over keys [k0, k1) of the split (P and V from the split's first pair), ROWS rows of
 * CH x 16 dims: accumulate 0: dst[r] = the chain from zero; 1: dst[r] += the chain from zero
 * (one piece of torch's GEMM); 2: the chain carries on from dst[r] (its GEMM for 2-3 rows). A
 * chunk may start or end inside a pair: the other key's half is masked off. */
static inline __attribute__((always_inline)) void pv_chunk(const uint32_t *p, int64_t p_stride, const uint32_t *vp, int64_t k0, int64_t k1,
                                                           float *dst, int64_t dst_stride, int accumulate, const int ROWS, const int CH) {
    __m512 acc[12][8]; /* ROWS x CH <= 24 used */
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 8
        for (int c = 0; c < CH; c++) acc[r][c] = accumulate == 2 ? _mm512_loadu_ps(dst + r * dst_stride + c * 16) : _mm512_setzero_ps();
    const int64_t t0 = k0 / 2, t1 = (k1 + 1) / 2;
    int64_t t = t0, end = t1;
    if (k0 & 1) pv_pair(p, p_stride, vp, t++, 0x0000ffffu, acc, ROWS, CH); /* key k0 is the pair's low half */
    if ((k1 & 1) && end > t) end--;                                          /* key k1 - 1 is the pair's high half */
    for (; t < end; t++) pv_pair(p, p_stride, vp, t, ~0u, acc, ROWS, CH);
    if (end < t1) pv_pair(p, p_stride, vp, end, 0xffff0000u, acc, ROWS, CH);
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 8
        for (int c = 0; c < CH; c++) {
            float *d = dst + r * dst_stride + c * 16;
            _mm512_storeu_ps(d, accumulate == 1 ? _mm512_add_ps(_mm512_loadu_ps(d), acc[r][c]) : acc[r][c]);
        }
}

/* Where torch's GEMM (the bf16 GEMM cpublas::gemm calls) splits P @ V's reduction over a
 * split of `len` keys into pieces, each summed from zero and then added to the output: probed
 * on torch 2.13 with sums that cancel only within one piece. For a block of 4 or more query
 * rows: one piece up to 192 keys, two halves (the first floor(len / 2)) up to 385, else pieces
 * of 192; for 2 or 3 rows (single_chunk): one piece. Writes the pieces' ends; returns their count. */
static int pv_chunks(int64_t len, int single_chunk, int64_t bounds[3]) {
    if (single_chunk || len <= 192) { bounds[0] = len; return 1; }
    if (len <= 385) { bounds[0] = len / 2; bounds[1] = len; return 2; }
    bounds[0] = 192; bounds[1] = 384; bounds[2] = len; return 3;
}

static inline __attribute__((always_inline)) void attend_head(
    const uint16_t *q, int64_t q_stride_pos, const uint32_t *kp, const uint32_t *vp, int64_t q_len, int64_t kv_len, int64_t call_kv_len, float scale,
    int64_t split, float *s, uint32_t *p, float *dst, uint32_t *qswap, uint16_t *out, int64_t out_stride_pos, int64_t row_begin,
    int64_t row_end, int single_chunk, const int CH) {
    const int PAIRS = CH * 8, PV_ROWS = 24 / CH;
    const int64_t head_dim = CH * 16, offset = kv_len - q_len;
    for (int64_t i0 = row_begin; i0 < row_end; i0 += SCORE_ROWS) {
        const int64_t rows = row_end - i0 < SCORE_ROWS ? row_end - i0 : SCORE_ROWS;
        const uint32_t *qr[SCORE_ROWS];
        float row_max[SCORE_ROWS], row_sum[SCORE_ROWS];
        for (int r = 0; r < SCORE_ROWS; r++) {
            const uint32_t *src = (const uint32_t *)(q + (i0 + (r < rows ? r : rows - 1)) * q_stride_pos);
            for (int j = 0; j < PAIRS; j++) qswap[r * PAIRS + j] = src[j] >> 16 | src[j] << 16; /* dim 2j high, as kp */
            qr[r] = qswap + r * PAIRS;
            row_max[r] = -INFINITY;
            row_sum[r] = 0.f;
        }
        const int64_t last_key = offset + i0 + rows - 1; /* the tile's furthest key */
        for (int64_t n = 0; n <= last_key; n += split) {
            const int64_t split_len = call_kv_len - n < split ? call_kv_len - n : split, body = split_len / 16 * 16;
            const int64_t tile_live = last_key + 1 - n < split_len ? last_key + 1 - n : split_len;
            const int64_t fill_pairs = (tile_live + 1) / 2;
            if (single_chunk) scores_small_block(qr, rows, kp + (n / 16) * PAIRS * 16, tile_live, PAIRS, scale, s, split);
            else scores_tile(qr, kp + (n / 16) * PAIRS * 16, tile_live, PAIRS, scale, s, split);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t live_r = offset + i0 + r + 1 - n, live = live_r < split_len ? live_r : split_len;
                const float correction = softmax_split(s + r * split, live, body, &row_max[r], &row_sum[r], p + r * (split / 2), fill_pairs);
                if (n > 0) {
                    const __m512 c = _mm512_set1_ps(correction);
                    for (int64_t d = 0; d < head_dim; d += 16)
                        _mm512_storeu_ps(dst + r * head_dim + d, _mm512_mul_ps(_mm512_loadu_ps(dst + r * head_dim + d), c));
                }
            }
            for (int64_t r = rows; r < SCORE_ROWS; r++) memset(p + r * (split / 2), 0, sizeof(uint32_t) * fill_pairs);
            int64_t bounds[3];
            const int num_chunks = pv_chunks(split_len, single_chunk, bounds);
            for (int r0 = 0; r0 < rows; r0 += PV_ROWS)
                for (int c = 0, k0 = 0; c < num_chunks && k0 < tile_live; k0 = (int)bounds[c++])
                    pv_chunk(p + r0 * (split / 2), split / 2, vp + (n / 2) * head_dim, k0, bounds[c] < tile_live ? bounds[c] : tile_live,
                             dst + r0 * head_dim, head_dim, single_chunk ? 2 * (n > 0) : n > 0 || c > 0, PV_ROWS, CH);
        }
        for (int64_t r = 0; r < rows; r++) {
            const float inv = 1.f / row_sum[r];
            for (int64_t d = 0; d < head_dim; d++) out[(i0 + r) * out_stride_pos + d] = f32_to_bf16(dst[r * head_dim + d] * inv);
        }
    }
}

/* Output rows row_begin .. row_end - 1 (query indices); single_chunk: these rows form a torch
 * query block of 2 or 3 rows, which its GEMM sums otherwise (scores_small_block, pv_chunks). Returns 0 when head_dim is not 32, 64 or 128,
 * split is not a multiple of 32 or the rows are out of range (nothing written).
 * scratch: prefill_attention_scratch_bytes(...) bytes. */
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride_pos, int64_t q_stride_head, const uint16_t *k, const uint16_t *v,
                           int64_t kv_stride_head, const int64_t *rows, int64_t q_len, int64_t kv_len, int64_t call_kv_len, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, int64_t split, int64_t row_begin, int64_t row_end,
                           int single_chunk, void *scratch, uint16_t *out) {
    if (row_begin < 0 || row_end > q_len || row_begin >= row_end) return 0;
    if ((head_dim != 32 && head_dim != 64 && head_dim != 128) || split % 32 || q_len < 1 || kv_len < q_len || call_kv_len < kv_len) return 0;
    const int64_t group = num_heads / num_kv_heads, kv_pad = (kv_len + 31) / 32 * 32;
    uint32_t *kp = (uint32_t *)scratch;                  /* [kv_pad / 16][head_dim / 2][16] */
    uint32_t *vp = kp + kv_pad * head_dim / 2;           /* [kv_pad / 2][head_dim] */
    float *s = (float *)(vp + kv_pad * head_dim / 2);    /* [12][split] */
    uint32_t *p = (uint32_t *)(s + SCORE_ROWS * split);  /* [12][split / 2] */
    float *dst = (float *)(p + SCORE_ROWS * split / 2);  /* [12][head_dim] */
    uint32_t *qswap = (uint32_t *)(dst + SCORE_ROWS * head_dim); /* [12][head_dim / 2] */
    for (int64_t h = 0; h < num_kv_heads; h++) {
        pack_k(k + h * kv_stride_head, rows, kv_len, head_dim, kp);
        pack_v(v + h * kv_stride_head, rows, kv_len, head_dim, vp);
        for (int64_t g = 0; g < group; g++) {
            const int64_t head = h * group + g;
            const uint16_t *qh = q + head * q_stride_head;
            uint16_t *oh = out + head * head_dim;
            if (head_dim == 32) attend_head(qh, q_stride_pos, kp, vp, q_len, kv_len, call_kv_len, scale, split, s, p, dst, qswap, oh, num_heads * head_dim, row_begin, row_end, single_chunk, 2);
            else if (head_dim == 64) attend_head(qh, q_stride_pos, kp, vp, q_len, kv_len, call_kv_len, scale, split, s, p, dst, qswap, oh, num_heads * head_dim, row_begin, row_end, single_chunk, 4);
            else attend_head(qh, q_stride_pos, kp, vp, q_len, kv_len, call_kv_len, scale, split, s, p, dst, qswap, oh, num_heads * head_dim, row_begin, row_end, single_chunk, 8);
        }
    }
    return 1;
}

#else
int prefill_attention_available(void) { return 0; }
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride_pos, int64_t q_stride_head, const uint16_t *k, const uint16_t *v,
                           int64_t kv_stride_head, const int64_t *rows, int64_t q_len, int64_t kv_len, int64_t call_kv_len, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, int64_t split, int64_t row_begin, int64_t row_end,
                           int single_chunk, void *scratch, uint16_t *out) {
    return 0;
}
#endif

/* bytes of scratch prefill_attention_bf16 needs */
int64_t prefill_attention_scratch_bytes(int64_t kv_len, int64_t head_dim, int64_t split) {
    const int64_t kv_pad = (kv_len + 31) / 32 * 32;
    return 4 * (kv_pad * head_dim + 12 * split + 12 * split / 2 + 12 * head_dim + 12 * head_dim / 2) + 64;
}
