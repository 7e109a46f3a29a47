/* Linear layers over GGUF quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), included by linear.c.
 *
 * A weight [N, K] in one of these types is kept near its own size (Q4_1: 5 bits a weight,
 * Q8_0: 8.5; Q4_K 6 and Q6_K 10, against their files' 4.5 and 6.6, with float32 scales)
 * and each call widens one panel at a time into the dense panel layout of linear.c, in
 * a per-thread scratch that stays in L2, then runs linear.c's own micro-kernel over it. The
 * widened values are exactly the dense weights the model would hold:
 *   Q8_0  w = d * q              d float16, q int8       (exact in float32)
 *   Q4_0  w = d * (q - 8)        d float16, q 4-bit      (exact)
 *   Q4_1  w = d * q + m          d, m float16, q 4-bit   (d * q exact, one rounding: fma)
 *   Q4_K  w = (d * sc) * q - dmin * m   per 32 weights 6-bit sc, m; d, dmin float16 per 256
 *                                         (the two products exact, one rounding: fma)
 *   Q6_K  w = (d * sc) * (q - 32)       per 16 weights int8 sc; d float16 per 256 (d * sc
 *                                         exact, one rounding)
 * as gguf-py (`gguf.quants`) and transformers de-quantize them in float32, and for bf16 those
 * rounded to nearest even, as torch's `.to(torch.bfloat16)`. So a quantized layer gives the
 * same bits as the dense layer of the de-quantized model, in any batch: the numerics rule
 * holds across a dense prefill pool and a quantized decode pool.
 *
 * Packed form (qlinear_pack): a 64-byte header {type, N, K}, then groups of 16 output rows
 * (N padded with zero rows), each K / 32 blocks of: scales, then for Q4_0, Q4_1, Q4_K: 16
 * bytes per pair of k (row j's byte: k = 2i low nibble, 2i + 1 high), for Q8_0 and Q6_K: 16
 * int8 per k (Q6_K's q - 32). Scales: Q4_0, Q8_0 d[16] float16; Q4_1 d[16], m[16] float16;
 * Q4_K the block's d * sc [16] and -(dmin * m) [16] in float32; Q6_K d * sc [16] float32 for
 * k 0..15 and [16] for 16..31. GGUF's own blocks (ggml-quants.c, as gguf-py reads them) are
 * read once at load; the K-quants' super-blocks of 256 weights become 8 blocks of 32.
 */
#ifndef PDSERVE_LINEAR_Q_H
#define PDSERVE_LINEAR_Q_H

#include <stdlib.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml_type */
#define QG 16 /* output rows per group */
#define QHEAD 64

/* Bytes of GGUF's own block, and the weights it holds. */
static int64_t q_src_block_bytes(int64_t type) {
    return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : type == Q4_K ? 144 : type == Q6_K ? 210 : 0;
}
static int64_t q_src_block_weights(int64_t type) { return type == Q4_K || type == Q6_K ? 256 : 32; }
/* The packed form: bytes of a group's block of 32 k, and where its quants start in it. */
static int64_t q_scale_bytes(int64_t type) { return type == Q4_0 || type == Q8_0 ? 32 : type == Q4_1 ? 64 : type == Q4_K || type == Q6_K ? 128 : 0; }
static int64_t q_block_bytes(int64_t type) {
    const int64_t s = q_scale_bytes(type);
    return !s ? 0 : s + (type == Q8_0 || type == Q6_K ? 512 : 256);
}
static inline int q_int8(int64_t type) { return type == Q8_0 || type == Q6_K; } /* one int8 a weight, w = d * q */
static inline int q_f32_scales(int64_t type) { return type == Q4_K || type == Q6_K; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, f = h & 1023, u;
    if (e == 31) u = s | 0x7f800000u | (f << 13);
    else if (e) u = s | ((e + 112) << 23) | (f << 13);
    else if (!f) u = s;
    else { /* subnormal: renormalize */
        int sh = 0;
        while (!(f & 1024)) f <<= 1, sh++;
        u = s | ((uint32_t)(113 - sh) << 23) | ((f & 1023) << 13);
    }
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Bytes of the packed form, or -1 for a type or shape it does not take (K not a multiple of
 * the type's block: 32, or 256 for the K-quants). */
int64_t qlinear_packed_bytes(int64_t type, int64_t N, int64_t K) {
    if (!q_block_bytes(type) || K % q_src_block_weights(type) || N <= 0) return -1;
    return QHEAD + (N + QG - 1) / QG * (K / 32) * q_block_bytes(type);
}

/* Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 bytes (gguf-py's get_scale_min). */
static void q4k_scale_min(const uint8_t *sc12, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = sc12[j] & 63, *m = sc12[4 + j] & 63;
    } else {
        *sc = (sc12[8 + j - 4] & 15) | ((sc12[j - 4] >> 2) & 0x30);
        *m = (sc12[8 + j - 4] >> 4) | ((sc12[4 + j - 4] >> 2) & 0x30);
    }
}

/* A K-quant row's block b of 32 (its super-block sb = b / 8 at s): the block's scales into o
 * (row j of the group) and its 32 quants into q[32] (Q4_K 0..15, Q6_K q - 32). */
static void qk_block(int64_t type, const uint8_t *s, int64_t b, int j, uint8_t *o, int8_t *q) {
    const int sub = (int)(b % 8);
    uint16_t h;
    if (type == Q4_K) { /* d f16, dmin f16, scales[12], qs[128]: sub-block 2c + t is qs[32c ..] >> 4t */
        int sc, m;
        q4k_scale_min(s + 4, sub, &sc, &m);
        memcpy(&h, s, 2);
        const float d = f16_to_f32(h) * (float)sc;
        memcpy(&h, s + 2, 2);
        const float mn = -(f16_to_f32(h) * (float)m);
        memcpy(o + 4 * j, &d, 4), memcpy(o + 64 + 4 * j, &mn, 4);
        for (int i = 0; i < 32; i++) q[i] = (int8_t)((s[16 + 32 * (sub / 2) + i] >> (4 * (sub % 2))) & 15);
        return;
    }
    /* Q6_K: ql[128], qh[64], scales int8[16], d f16; weight x of the super-block: half hf = x / 128,
     * r = x % 128: low 4 bits ql[64 hf + r % 64] >> 4 (r / 64), high 2 qh[32 hf + r % 32] >> 2 (r / 32) */
    memcpy(&h, s + 208, 2);
    const float d = f16_to_f32(h);
    for (int t = 0; t < 2; t++) {
        const float dt = d * (float)(int8_t)s[192 + 2 * sub + t];
        memcpy(o + 64 * t + 4 * j, &dt, 4);
    }
    for (int i = 0; i < 32; i++) {
        const int x = 32 * sub + i, hf = x / 128, r = x % 128;
        const int lo = (s[64 * hf + r % 64] >> (4 * (r / 64))) & 15, hi = (s[128 + 32 * hf + r % 32] >> (2 * (r / 32))) & 3;
        q[i] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* src: the GGUF tensor's data, N rows of K / 32 blocks; out: qlinear_packed_bytes. Returns 0, or -1. */
int qlinear_pack(int64_t type, const uint8_t *src, int64_t N, int64_t K, uint8_t *out) {
    if (qlinear_packed_bytes(type, N, K) < 0) return -1;
    const int64_t nb = K / 32, sb = q_src_block_bytes(type), bb = q_block_bytes(type), row = K / q_src_block_weights(type) * sb;
    int64_t head[3] = {type, N, K};
    memset(out, 0, QHEAD);
    memcpy(out, head, sizeof head);
    for (int64_t g = 0; g * QG < N; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + QHEAD + (g * nb + b) * bb;
            memset(o, 0, (size_t)bb);
            for (int64_t j = 0; j < QG && g * QG + j < N; j++) {
                if (q_f32_scales(type)) {
                    int8_t q[32];
                    qk_block(type, src + (g * QG + j) * row + b / 8 * sb, b, (int)j, o, q);
                    uint8_t *qo = o + q_scale_bytes(type);
                    for (int k = 0; k < 32; k++)
                        if (type == Q6_K) qo[k * QG + j] = (uint8_t)q[k];
                        else if (k % 2 == 0) qo[k / 2 * QG + j] = (uint8_t)(q[k] | q[k + 1] << 4);
                    continue;
                }
                const uint8_t *s = src + ((g * QG + j) * nb + b) * sb;
                memcpy(o + 2 * j, s, 2); /* d */
                if (type == Q4_1) memcpy(o + 32 + 2 * j, s + 2, 2); /* m */
                const uint8_t *qs = s + (type == Q4_1 ? 4 : 2);
                uint8_t *qo = o + (type == Q4_1 ? 64 : 32);
                if (type == Q8_0)
                    for (int k = 0; k < 32; k++) qo[k * QG + j] = qs[k];
                else
                    for (int i = 0; i < 16; i++) { /* weights k = 2i, 2i + 1 of the block */
                        uint8_t lo = (uint8_t)(2 * i < 16 ? qs[2 * i] & 15 : qs[2 * i - 16] >> 4);
                        uint8_t hi = (uint8_t)(2 * i + 1 < 16 ? qs[2 * i + 1] & 15 : qs[2 * i + 1 - 16] >> 4);
                        qo[i * QG + j] = (uint8_t)(lo | hi << 4);
                    }
            }
        }
    return 0;
}

/* w[16] = the float32 weights of rows n0..n0+15 (one group) at k: the scalar rule everything
 * else must equal. */
static inline void q_weights_scalar(const uint8_t *wq, int64_t g, int64_t k, float *w) {
    const int64_t *h = (const int64_t *)wq, type = h[0], nb = h[2] / 32;
    const uint8_t *o = wq + QHEAD + (g * nb + k / 32) * q_block_bytes(type);
    const int64_t kk = k % 32;
    for (int j = 0; j < QG; j++) {
        float d, m = 0.0f;
        if (q_f32_scales(type)) {
            memcpy(&d, o + (type == Q6_K && kk >= 16 ? 64 : 0) + 4 * j, 4);
            if (type == Q4_K) memcpy(&m, o + 64 + 4 * j, 4);
        } else {
            uint16_t d16, m16 = 0;
            memcpy(&d16, o + 2 * j, 2);
            if (type == Q4_1) memcpy(&m16, o + 32 + 2 * j, 2);
            d = f16_to_f32(d16), m = f16_to_f32(m16);
        }
        const uint8_t *qo = o + q_scale_bytes(type);
        if (q_int8(type)) {
            w[j] = d * (float)(int8_t)qo[kk * QG + j];
        } else {
            const uint8_t byte = qo[kk / 2 * QG + j];
            const int q = kk % 2 ? byte >> 4 : byte & 15;
            w[j] = type == Q4_0 ? d * (float)(q - 8) : fmaf(d, (float)q, m);
        }
    }
}

#if defined(__AVX512F__)
/* The 16 weights of a group at block offsets kk and kk + 1 (kk even), float32. */
static inline void q_weights16(int64_t type, const uint8_t *qo, int64_t kk, __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    if (q_int8(type)) {
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qo + kk * QG)))));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qo + (kk + 1) * QG)))));
        return;
    }
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qo + kk / 2 * QG)));
    __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(b, 4);
    if (type != Q4_0) {
        *w0 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m), *w1 = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m);
    } else {
        const __m512i e = _mm512_set1_epi32(8);
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, e))), *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, e)));
    }
}
/* A group's block scales for k offset kk (16 lanes, one a row): d, and m (Q4_1, Q4_K; else 0). */
static inline void q_scales16(int64_t type, const uint8_t *o, int64_t kk, __m512 *d, __m512 *m) {
    if (q_f32_scales(type)) {
        *d = _mm512_loadu_ps((const float *)(o + (type == Q6_K && kk >= 16 ? 64 : 0)));
        *m = type == Q4_K ? _mm512_loadu_ps((const float *)(o + 64)) : _mm512_setzero_ps();
        return;
    }
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
    *m = type == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32))) : _mm512_setzero_ps();
}
#if defined(__AVX512BF16__)
/* Lane j: (bf16(w0[j]), bf16(w1[j])), rounded to nearest even (VCVTNE2PS2BF16: torch's rounding
 * for every value a block can hold; it would flush float32 subnormals, which no block makes:
 * float16 scales times small integers are 6e-8 or more, or 0). */
static inline __m512i q_pairs_bf16(__m512 w0, __m512 w1) {
    static const uint16_t idx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(idx), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}
#endif
static inline __m512i q_round_bf16(__m512 w) { /* bf16_round on 16 lanes, kept in the upper half */
    __m512i u = _mm512_castps_si512(w);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_and_si512(u, _mm512_set1_epi32((int32_t)0xffff0000u));
}
#endif

/* Stores the weights of columns c..c+15 at k and k + 1 (float32, 16 each) into a dense
 * panel of linear.c's layout (float32 [K, NP]; bf16 [K2, NP, 2] with AVX512-BF16, else [K, NP]),
 * bf16 rounded to nearest even. */
static inline void q_store(void *panel, int64_t k, int64_t c, const float *w0, const float *w1, int bf) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(w0), b = _mm512_loadu_ps(w1);
    if (!bf) {
        _mm512_storeu_ps((float *)panel + k * NP + c, a), _mm512_storeu_ps((float *)panel + (k + 1) * NP + c, b);
        return;
    }
#if defined(__AVX512BF16__)
    _mm512_storeu_si512((uint16_t *)panel + (k / 2 * NP + c) * 2, q_pairs_bf16(a, b)); /* pairs (k, k + 1) */
#else
    const __m512i r0 = q_round_bf16(a), r1 = q_round_bf16(b);
    _mm256_storeu_si256((__m256i *)((uint16_t *)panel + k * NP + c), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r0, 16)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)panel + (k + 1) * NP + c), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r1, 16)));
#endif
#else
    for (int j = 0; j < QG; j++)
        if (bf) ((uint16_t *)panel)[k * NP + c + j] = bf16_round(w0[j]), ((uint16_t *)panel)[(k + 1) * NP + c + j] = bf16_round(w1[j]);
        else ((float *)panel)[k * NP + c + j] = w0[j], ((float *)panel)[(k + 1) * NP + c + j] = w1[j];
#endif
}

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
/* A group's block scales for k offset kk, rows 8h .. 8h + 7: d, and m (Q4_1, Q4_K; else 0). */
static inline void q_scales8(int64_t type, const uint8_t *o, int64_t kk, int h, __m256 *d, __m256 *m) {
    if (q_f32_scales(type)) {
        *d = _mm256_loadu_ps((const float *)(o + (type == Q6_K && kk >= 16 ? 64 : 0)) + 8 * h);
        *m = type == Q4_K ? _mm256_loadu_ps((const float *)(o + 64) + 8 * h) : _mm256_setzero_ps();
        return;
    }
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16 * h)));
    *m = type == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 32 + 16 * h))) : _mm256_setzero_ps();
}
/* q_weights_scalar's values for a group's block at k = 2i, 2i + 1 (4-bit) or k, k + 1 (int8), 8 lanes at a time. */
static inline void q_weights16_avx2(int64_t type, const uint8_t *o, int64_t kk, float *w0, float *w1) {
    const uint8_t *qo = o + q_scale_bytes(type);
    for (int h = 0; h < 2; h++) {
        __m256 d, m;
        q_scales8(type, o, kk, h, &d, &m);
        if (q_int8(type)) {
            for (int t = 0; t < 2; t++) {
                __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qo + (kk + t) * QG + 8 * h)));
                _mm256_storeu_ps((t ? w1 : w0) + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
            continue;
        }
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qo + kk / 2 * QG + 8 * h)));
        __m256i lo = _mm256_and_si256(b, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(b, 4);
        if (type != Q4_0) {
            _mm256_storeu_ps(w0 + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m));
            _mm256_storeu_ps(w1 + 8 * h, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m));
        } else {
            const __m256i e = _mm256_set1_epi32(8);
            _mm256_storeu_ps(w0 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, e))));
            _mm256_storeu_ps(w1 + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, e))));
        }
    }
}
#endif

/* Widens the groups of output rows [n0, n0 + NP) into linear.c's dense panel (q_store's
 * layout); groups past N as zeros, as the dense packing pads. */
static void q_panel(const uint8_t *wq, int64_t n0, int bf, void *panel) {
    const int64_t *h = (const int64_t *)wq, type = h[0], N = h[1], K = h[2], nb = K / 32, bb = q_block_bytes(type);
    float w0[QG], w1[QG];
#if NP % 16
    /* panels narrower than a group (the portable build): each column from the scalar rule */
    for (int64_t k = 0; k < K; k++) {
        q_weights_scalar(wq, n0 / QG, k, w0);
        for (int64_t j = 0; j < NP; j++) {
            const float w = n0 + j < N ? w0[(n0 + j) % QG] : 0.0f;
            if (bf) ((uint16_t *)panel)[k * NP + j] = bf16_round(w);
            else ((float *)panel)[k * NP + j] = w;
        }
    }
    (void)type, (void)nb, (void)bb, (void)w1;
    return;
#endif
    for (int64_t c = 0; c < NP; c += QG) {
        const int64_t g = (n0 + c) / QG;
        if (n0 + c >= N) {
            memset(w0, 0, sizeof w0);
            for (int64_t k = 0; k < K; k += 2) q_store(panel, k, c, w0, w0, bf);
            continue;
        }
#if defined(__AVX512F__)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *o = wq + QHEAD + (g * nb + b) * bb, *qo = o + q_scale_bytes(type);
            __m512 d, m;
            for (int64_t kk = 0; kk < 32; kk += 2) {
                __m512 a, b2;
                if (kk == 0 || (kk == 16 && type == Q6_K)) q_scales16(type, o, kk, &d, &m);
                q_weights16(type, qo, kk, d, m, &a, &b2);
                _mm512_storeu_ps(w0, a), _mm512_storeu_ps(w1, b2);
                q_store(panel, b * 32 + kk, c, w0, w1, bf);
            }
        }
        (void)q_weights_scalar;
#elif defined(__AVX2__) && defined(__F16C__)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t kk = 0; kk < 32; kk += 2) {
                q_weights16_avx2(type, wq + QHEAD + (g * nb + b) * bb, kk, w0, w1);
                q_store(panel, b * 32 + kk, c, w0, w1, bf);
            }
        (void)q_weights_scalar;
#else
        for (int64_t k = 0; k < K; k += 2) {
            q_weights_scalar(wq, g, k, w0), q_weights_scalar(wq, g, k + 1, w1);
            q_store(panel, k, c, w0, w1, bf);
        }
        (void)bb, (void)nb;
#endif
    }
}

#if defined(__AVX512F__)
/* y[r, n0 + j] for r < R (at most MR rows) and j < ncols straight from the blocks of the
 * NP / 16 groups at n0: each output one accumulator over k in order, as tile_f32 and
 * tile_bf16 do on the dense panel, with the same instructions, so the same bits; the
 * weights never leave registers (decode's few rows: no panel to write and read back). */
static inline __attribute__((always_inline)) void q_tile(const uint8_t *wq, int64_t n0, const void *x, int64_t ldx, const void *bias, void *y,
                                                         int64_t ldy, int64_t ncols, int bf, const int R) {
    enum { G = NP / QG };
    const int64_t *h = (const int64_t *)wq, type = h[0], N = h[1], K = h[2], nb = K / 32, bb = q_block_bytes(type);
    int ng = 0;
    const uint8_t *base[G];
    for (int c = 0; c < G && n0 + QG * c < N; c++) base[ng++] = wq + QHEAD + ((n0 / QG + c) * nb) * bb;
    __m512 acc[MR][G];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < G; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 d[G], m[G];
        const uint8_t *qo[G];
        for (int64_t kk = 0; kk < 32; kk += 2) {
            const int64_t k = b * 32 + kk;
            if (kk == 0 || (kk == 16 && type == Q6_K))
                for (int c = 0; c < ng; c++) q_scales16(type, base[c] + b * bb, kk, &d[c], &m[c]), qo[c] = base[c] + b * bb + q_scale_bytes(type);
            __m512 w0[G], w1[G];
            for (int c = 0; c < ng; c++) q_weights16(type, qo[c], kk, d[c], m[c], &w0[c], &w1[c]);
            if (!bf) {
                for (int r = 0; r < R; r++) {
                    const float *xr = (const float *)x + r * ldx + k;
                    const __m512 xa = _mm512_set1_ps(xr[0]), xb = _mm512_set1_ps(xr[1]);
                    for (int c = 0; c < ng; c++) acc[r][c] = _mm512_fmadd_ps(xb, w1[c], _mm512_fmadd_ps(xa, w0[c], acc[r][c]));
                }
                continue;
            }
#if defined(__AVX512BF16__)
            __m512i wp[G];
            for (int c = 0; c < ng; c++) wp[c] = q_pairs_bf16(w0[c], w1[c]);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, (const uint16_t *)x + r * ldx + k, 4);
                const __m512i xv = _mm512_set1_epi32(pair);
                for (int c = 0; c < ng; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wp[c]);
            }
#else
            for (int c = 0; c < ng; c++) w0[c] = _mm512_castsi512_ps(q_round_bf16(w0[c])), w1[c] = _mm512_castsi512_ps(q_round_bf16(w1[c]));
            for (int r = 0; r < R; r++) {
                const uint16_t *xr = (const uint16_t *)x + r * ldx + k;
                const __m512 xa = _mm512_set1_ps(bf16_to_f32(xr[0])), xb = _mm512_set1_ps(bf16_to_f32(xr[1]));
                for (int c = 0; c < ng; c++) acc[r][c] = _mm512_fmadd_ps(xb, w1[c], _mm512_fmadd_ps(xa, w0[c], acc[r][c]));
            }
#endif
        }
    }
    float buf[NP];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < G; c++) _mm512_storeu_ps(buf + QG * c, acc[r][c]);
        if (bf)
            for (int64_t j = 0; j < ncols; j++)
                ((uint16_t *)y)[r * ldy + j] = bf16_round(bias ? buf[j] + bf16_to_f32(((const uint16_t *)bias)[j]) : buf[j]);
        else
            for (int64_t j = 0; j < ncols; j++) ((float *)y)[r * ldy + j] = bias ? buf[j] + ((const float *)bias)[j] : buf[j];
    }
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512F__)
/* q_tile for AVX2 + FMA (NP = 16: one group, two vectors of 8): float32, and bf16 widened as
 * tile_bf16 does there (weights rounded to bf16, products and sums in float32). */
static inline __attribute__((always_inline)) void q_tile(const uint8_t *wq, int64_t n0, const void *x, int64_t ldx, const void *bias, void *y,
                                                         int64_t ldy, int64_t ncols, int bf, const int R) {
    const int64_t *h = (const int64_t *)wq, type = h[0], K = h[2], nb = K / 32, bb = q_block_bytes(type);
    const uint8_t *base = wq + QHEAD + (n0 / QG) * nb * bb;
    const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8), hi16 = _mm256_set1_epi32((int32_t)0xffff0000u);
    __m256 acc[MR][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *o = base + b * bb, *qo = o + q_scale_bytes(type);
        __m256 d[2], m[2];
        for (int64_t kk = 0; kk < 32; kk += 2) {
            const int64_t k = b * 32 + kk;
            if (kk == 0 || (kk == 16 && type == Q6_K))
                for (int v = 0; v < 2; v++) q_scales8(type, o, kk, v, &d[v], &m[v]);
            __m256 w0[2], w1[2];
            for (int v = 0; v < 2; v++) {
                if (q_int8(type)) {
                    w0[v] = _mm256_mul_ps(d[v], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qo + kk * QG + 8 * v)))));
                    w1[v] = _mm256_mul_ps(d[v], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qo + (kk + 1) * QG + 8 * v)))));
                } else {
                    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qo + kk / 2 * QG + 8 * v)));
                    __m256i lo = _mm256_and_si256(q, mask), hi = _mm256_srli_epi32(q, 4);
                    if (type != Q4_0)
                        w0[v] = _mm256_fmadd_ps(d[v], _mm256_cvtepi32_ps(lo), m[v]), w1[v] = _mm256_fmadd_ps(d[v], _mm256_cvtepi32_ps(hi), m[v]);
                    else
                        w0[v] = _mm256_mul_ps(d[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, eight))),
                        w1[v] = _mm256_mul_ps(d[v], _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, eight)));
                }
                if (bf) { /* bf16_round, kept as a float32 with the low half zero */
                    __m256i u0 = _mm256_castps_si256(w0[v]), u1 = _mm256_castps_si256(w1[v]);
                    u0 = _mm256_add_epi32(u0, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u0, 16), _mm256_set1_epi32(1))));
                    u1 = _mm256_add_epi32(u1, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u1, 16), _mm256_set1_epi32(1))));
                    w0[v] = _mm256_castsi256_ps(_mm256_and_si256(u0, hi16)), w1[v] = _mm256_castsi256_ps(_mm256_and_si256(u1, hi16));
                }
            }
            for (int r = 0; r < R; r++) {
                __m256 xa, xb;
                if (bf) {
                    const uint16_t *xr = (const uint16_t *)x + r * ldx + k;
                    xa = _mm256_set1_ps(bf16_to_f32(xr[0])), xb = _mm256_set1_ps(bf16_to_f32(xr[1]));
                } else {
                    const float *xr = (const float *)x + r * ldx + k;
                    xa = _mm256_set1_ps(xr[0]), xb = _mm256_set1_ps(xr[1]);
                }
                for (int v = 0; v < 2; v++) acc[r][v] = _mm256_fmadd_ps(xb, w1[v], _mm256_fmadd_ps(xa, w0[v], acc[r][v]));
            }
        }
    }
    float buf[NP];
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(buf, acc[r][0]), _mm256_storeu_ps(buf + 8, acc[r][1]);
        if (bf)
            for (int64_t j = 0; j < ncols; j++)
                ((uint16_t *)y)[r * ldy + j] = bf16_round(bias ? buf[j] + bf16_to_f32(((const uint16_t *)bias)[j]) : buf[j]);
        else
            for (int64_t j = 0; j < ncols; j++) ((float *)y)[r * ldy + j] = bias ? buf[j] + ((const float *)bias)[j] : buf[j];
    }
}
#define Q_TILE_AVX2 1
#endif

static void *q_scratch(size_t bytes) { /* one per thread, kept between calls */
    static __thread void *buf;
    static __thread size_t size;
    if (bytes > size) {
        free(buf);
        buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        size = buf ? bytes : 0;
    }
    return buf;
}

#endif
