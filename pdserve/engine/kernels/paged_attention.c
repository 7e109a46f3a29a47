/* Paged decode attention for CPU: one query token per sequence, K/V read in place from
 * the block pool (no gather), each K/V row loaded once for all query heads that share it (GQA).
 *
 * Layouts (element strides, row-major):
 *   q:            [batch, num_heads, head_dim], strides q_stride_b, q_stride_h (head_dim contiguous)
 *   k, v:         [num_kv_heads, num_slots, head_dim], head stride cache_stride_h;
 *                 slot = block_tables[b][pos / block_size] * block_size + pos % block_size
 *   block_tables: [batch, max_blocks] int32
 *   context_lens: [batch] int32, tokens of context including the new one (its K/V already stored)
 *   out:          [batch, num_heads, head_dim], contiguous
 *   scratch:      float32, group * (split + 2 * head_dim) + 4 * split elements; group = num_heads / num_kv_heads <= 64
 *
 * Numerics follow torch's CPU flash-attention kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp),
 * which the reference model.generate runs: scores q.k in float32, then scaled; keys taken in splits
 * of `split` tokens (torch: 512) with a running max; exp(s - max) summed in float32 and rounded to
 * the storage dtype before P @ V, which accumulates in float32; output = acc * (1 / sum), rounded
 * once. For bf16 the kernel also follows torch 2.13's operations bit for bit, as measured on this
 * CPU with probes whose sums cancel only in one order: its exp (fexp_u20, not exp_u20), the
 * four-chain order of q.k (scores_bf16), the groups of four rows of P @ V (pv_bf16) and the sum
 * of exps in two accumulators over alternate 16-key pieces (exp_and_sum). On the real model 3 of
 * 3.3 million outputs (8 prompts of 17-2,000 tokens, 25 steps) still differ from torch's by one
 * bf16 step (24 with one accumulator); torch's own result for a head can change with the call's
 * layout. float32 keeps its own order (results within float32 rounding of torch's).
 *
 * Speed: both dtypes have loops specialised for common (head_dim, group) pairs with their
 * accumulators in registers (FAST_CASES, BF16_CASES), and K/V rows, scattered over blocks, are
 * prefetched ahead. With AVX512-BF16, bf16 takes torch's order two terms at a time with
 * VDPBF16PS (scores_bf16_dp, pv_bf16_dp: same bits but for float32 denormals). bf16 at batch
 * 32, context 512, SmolLM2's 9/3 heads x 64 on one Zen 4 core: 0.56 ms per layer with the KV
 * in L3, 1.2-1.3 ms from DRAM (~10 GB/s of KV; 0.9-1.0 ms since the prefetches go to L2 and the
 * pool is on huge pages); before VDPBF16PS 1.0 and 1.8 ms, before the register-resident loops
 * and prefetch 2.5 and 2.1-2.5 ms.
 *
 * Built with cc -O3 -march=native by kernels/__init__.py; one thread per call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "torch_numerics.h"

#define LANES 16 /* independent partial sums: lets the compiler vectorize without -ffast-math */

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef __AVX512F__
#include <immintrin.h>
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

static inline __attribute__((always_inline)) float dot(const float *a, const void *p, int64_t base, int64_t n, int bf16) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(p, base + i, bf16), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * load(p, base + i + j, bf16);
    float s = 0.f;
    for (; i < n; i++) s += a[i] * load(p, base + i, bf16);
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* acc[0:n] += p * row[0:n] */
static inline __attribute__((always_inline)) void axpy(float *acc, float p, const void *row, int64_t base, int64_t n, int bf16) {
#ifdef __AVX512F__
    if (n % 16 == 0) {
        const __m512 pv = _mm512_set1_ps(p);
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load16(row, base + i, bf16), _mm512_loadu_ps(acc + i)));
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) acc[i] += p * load(row, base + i, bf16);
}

/* exp(x) as torch's vectorized CPU softmax computes it (Vectorized<float>::exp_u20 in
 * aten/src/ATen/cpu/vec/vec512/vec512_float.h, "a faster version of exp with ULP=20"):
 * x = n ln2 + r with n = floor(x log2(e) + 1/2), a degree-5 polynomial in r with its
 * fitted coefficients, times 2^(n-1) times 2. Following it, rather than expf, keeps the
 * rounded probabilities equal to the reference's. fmaf compiles to one FMA and the loop
 * that calls this vectorizes. */
static inline float exp_like_torch(float x) {
    const float ln_flt_min = -87.33654475f, ln_flt_max = 88.72283936f;
    const int underflow = x < ln_flt_min;
    x = x > ln_flt_max ? ln_flt_max : (x < ln_flt_min ? ln_flt_min : x);
    const float n = floorf(fmaf(x, 1.44269502f, 0.5f)); /* log2(e) rounded to float: 0x3fb8aa3b */
    const float r = fmaf(-n, 0.693147182f, x);            /* ln(2) as float: 0x3f317218 */
    float p = fmaf(r, 0.00828929059f, 0.0418978221f);
    p = fmaf(r, p, 0.166676521f);
    p = fmaf(r, p, 0.499991506f);
    p = fmaf(r, p, 0.999999701f);
    p = fmaf(r, p, 1.f);
    const int32_t bits = ((int32_t)(n - 1.f) + 127) << 23;
    float pow2;
    memcpy(&pow2, &bits, 4);
    return underflow ? 0.f : p * pow2 * 2.f;
}



/* float32 fast loops on 16-lane (AVX-512) or 8-lane (AVX2 + FMA) vectors. bf16 never takes
 * them: its loops (scores_bf16, pv_bf16) follow torch's summation order instead. */
#if defined(__AVX512F__)
#define FAST_SIMD 1
#define VL 16
typedef __m512 vf;
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, x) _mm512_storeu_ps(p, x)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vset1(x) _mm512_set1_ps(x)
#define vsum(x) _mm512_reduce_add_ps(x)
#define FAST_CASES(X) X(64, 1) X(64, 2) X(64, 3) X(64, 4) X(128, 1) X(128, 2) /* GROUP * HDV <= 16 of 32 registers */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FAST_SIMD 1
#define VL 8
typedef __m256 vf;
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, x) _mm256_storeu_ps(p, x)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vset1(x) _mm256_set1_ps(x)
static inline float vsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define FAST_CASES(X) X(64, 1) X(64, 2) X(64, 3) X(64, 4) X(128, 1) X(128, 2) /* accumulators beyond 16 registers spill to L1 */
#endif

#ifdef FAST_SIMD
/* The two float32 loops of one split for head_dim = VL * HDV and GROUP query heads per K/V
 * head, with every K/V row loaded once and the GROUP accumulators held in registers. */
static inline __attribute__((always_inline)) void scores_fast(
    const float *qf, const float *k, const int64_t *rows, int64_t n, float scale, float *scores, int64_t split,
    float *split_max, const int HDV, const int GROUP) {
    for (int64_t t = 0; t < n; t++) {
        vf kr[16];
        if (t + 16 < n) /* blocks are scattered: fetch a block ahead, the prefetcher cannot guess it */
            for (int i = 0; i < HDV * VL; i += 16) _mm_prefetch((const char *)(k + rows[t + 16] + i), _MM_HINT_T0);
#pragma GCC unroll 16
        for (int i = 0; i < HDV; i++) kr[i] = vload(k + rows[t] + VL * i);
#pragma GCC unroll 8
        for (int g = 0; g < GROUP; g++) {
            vf acc = vmul(vload(qf + g * VL * HDV), kr[0]);
#pragma GCC unroll 16
            for (int i = 1; i < HDV; i++) acc = vfma(vload(qf + g * VL * HDV + VL * i), kr[i], acc);
            const float s = vsum(acc) * scale;
            scores[g * split + t] = s;
            if (s > split_max[g]) split_max[g] = s;
        }
    }
}

static inline __attribute__((always_inline)) void pv_fast(
    const float *scores, int64_t split, const float *v, const int64_t *rows, int64_t n, float *acc_mem,
    const int HDV, const int GROUP) {
    vf acc[8][16];
#pragma GCC unroll 8
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 16
        for (int i = 0; i < HDV; i++) acc[g][i] = vload(acc_mem + (g * HDV + i) * VL);
    for (int64_t t = 0; t < n; t++) {
        vf vr[16];
        if (t + 16 < n)
            for (int i = 0; i < HDV * VL; i += 16) _mm_prefetch((const char *)(v + rows[t + 16] + i), _MM_HINT_T0);
#pragma GCC unroll 16
        for (int i = 0; i < HDV; i++) vr[i] = vload(v + rows[t] + VL * i);
#pragma GCC unroll 8
        for (int g = 0; g < GROUP; g++) {
            const vf p = vset1(scores[g * split + t]);
#pragma GCC unroll 16
            for (int i = 0; i < HDV; i++) acc[g][i] = vfma(p, vr[i], acc[g][i]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 16
        for (int i = 0; i < HDV; i++) vstore(acc_mem + (g * HDV + i) * VL, acc[g][i]);
}

/* Dispatch to a register-resident instance for (head_dim, group); returns 0 where none fits. */
static inline __attribute__((always_inline)) int scores_dispatch(
    const float *qf, const float *k, const int64_t *rows, int64_t n, float scale, float *scores, int64_t split,
    float *split_max, int64_t head_dim, int64_t group) {
#define X(D, G) if (head_dim == D && group == G) { scores_fast(qf, k, rows, n, scale, scores, split, split_max, D / VL, G); return 1; }
    FAST_CASES(X)
#undef X
    return 0;
}
static inline __attribute__((always_inline)) int pv_dispatch(
    const float *scores, int64_t split, const float *v, const int64_t *rows, int64_t n, float *acc, int64_t head_dim,
    int64_t group) {
#define X(D, G) if (head_dim == D && group == G) { pv_fast(scores, split, v, rows, n, acc, D / VL, G); return 1; }
    FAST_CASES(X)
#undef X
    return 0;
}
#else
#define scores_dispatch(...) 0
#define pv_dispatch(...) 0
#endif

/* The keys the next round (next K/V head, or next sequence) starts with: P @ V prefetches them
 * into L2, as the hardware prefetcher cannot guess scattered blocks. k + rows[t], t < n. */
typedef struct {
    const uint16_t *k;
    const int64_t *rows;
    int64_t n;
} next_keys;

/* K/V rows sit in scattered blocks, which the hardware prefetcher cannot guess: the bf16 loops
 * fetch the rows PREFETCH_ROWS ahead into L2 (128 cache lines in flight for head_dim 64). Into
 * L2, not L1: a prefetch into L1 holds one of the core's few L1 miss buffers until DRAM answers,
 * and 64 of them per 16 rows stalled the loop. Measured on one Zen 4 core (batch 32, context
 * 512, 9/3 heads x 64, 30 layers of KV from DRAM, blocks in random order): 38-40 ms with 32
 * rows into L1, 32-34 ms with 64 rows into L2, 27-30 ms with P @ V's rows into L1 (PV_AHEAD)
 * and the pool on huge pages (engine/huge_pages.py) too. */
#define PREFETCH_ROWS 64
#define PV_AHEAD 16 /* P @ V fetches its V rows this far ahead from L2 into L1 */
static inline __attribute__((always_inline)) void prefetch_row(const uint16_t *row, int64_t head_dim) {
    for (int64_t i = 0; i < head_dim; i += 32) __builtin_prefetch(row + i, 0, 2);
}

/* fexp_u20 (below) in scalar C, for builds without AVX-512: the same operations in the same order. */
static inline float fexp_scalar(float x) {
    if (x < -87.33654475f) return 0.f;
    if (x > 88.72283936f) return INFINITY;
    float src = x * 1.44269502f;
    const float frac = src - floorf(src);
    float c = fmaf(frac, -0.079204240219773236f, -0.22433836478672356f);
    c = fmaf(frac, c, 0.30354260500649682f);
    c = fmaf(frac, c, 0.00010703434948458272f);
    src = src - c;
    const int32_t bits = (int32_t)fmaf(8388608.f, src, 8388608.f * 127.f);
    float y;
    memcpy(&y, &bits, 4);
    return y;
}

/* bf16 scores, summed as torch's CPU flash attention sums q.k for bf16 (measured bit for bit
 * against torch 2.13 on this CPU, tests/test_engine.py): products in float32 (exact for bf16
 * inputs), four partial sums over the head dims d = 0, 1, 2, 3 (mod 4), each in order of d,
 * combined as (s0 + s2) + (s1 + s3); then times scale. */
static void scores_bf16(const float *qf, const uint16_t *k, const int64_t *rows, int64_t n, float scale, float *scores,
                        int64_t split, float *split_max, int64_t head_dim, int64_t group) {
    int64_t t = 0;
#ifdef __AVX512F__
    /* four K rows per register: lanes [row0 d..d+3 | row1 | row2 | row3], the chains of one
     * row in its quarter; then (s0 + s2) + (s1 + s3) within each quarter */
    if (head_dim % 16 == 0 && group <= 8)
        for (; t + 4 <= n; t += 4) {
            const uint16_t *r0 = k + rows[t], *r1 = k + rows[t + 1], *r2 = k + rows[t + 2], *r3 = k + rows[t + 3];
            if (t + PREFETCH_ROWS + 4 <= n)
                for (int j = 0; j < 4; j++) prefetch_row(k + rows[t + PREFETCH_ROWS + j], head_dim);
            __m512 acc[8];
            for (int64_t g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
            for (int64_t c = 0; c < head_dim; c += 16) {
                /* 4 x 4 transpose of 64-bit pieces (4 dims each): z[i] = dims c + 4i .. c + 4i + 3 of rows 0-3 */
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(r0 + c)), a1 = _mm256_loadu_si256((const __m256i *)(r1 + c));
                const __m256i a2 = _mm256_loadu_si256((const __m256i *)(r2 + c)), a3 = _mm256_loadu_si256((const __m256i *)(r3 + c));
                const __m256i t0 = _mm256_unpacklo_epi64(a0, a1), t1 = _mm256_unpackhi_epi64(a0, a1);
                const __m256i t2 = _mm256_unpacklo_epi64(a2, a3), t3 = _mm256_unpackhi_epi64(a2, a3);
                const __m256i z[4] = {_mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
                                      _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)};
                for (int i = 0; i < 4; i++) {
                    const __m512 k16 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(z[i]), 16));
                    for (int64_t g = 0; g < group; g++)
                        acc[g] = _mm512_fmadd_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(qf + g * head_dim + c + 4 * i)), k16, acc[g]);
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const __m512 h = _mm512_add_ps(acc[g], _mm512_shuffle_ps(acc[g], acc[g], 0x4E)); /* [s0+s2, s1+s3, s2+s0, s3+s1] */
                const __m512 r = _mm512_add_ps(h, _mm512_shuffle_ps(h, h, 0xB1));                  /* lane 0 of each quarter */
                float out[16];
                _mm512_storeu_ps(out, _mm512_mul_ps(r, _mm512_set1_ps(scale)));
                for (int j = 0; j < 4; j++) {
                    scores[g * split + t + j] = out[4 * j];
                    if (out[4 * j] > split_max[g]) split_max[g] = out[4 * j];
                }
            }
        }
#endif
    for (; t < n; t++) {
        const uint16_t *kr = k + rows[t];
        int64_t g0 = 0;
#ifdef __AVX512F__
        if (head_dim % 4 == 0) /* up to 4 heads at a time: each K row loaded and converted once per 4 heads */
            for (; g0 < group; g0 += 4) {
                const int64_t ng = group - g0 < 4 ? group - g0 : 4;
                __m128 acc[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
                for (int64_t d = 0; d < head_dim; d += 4) {
                    const __m128 k4 = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(kr + d))), 16));
                    for (int64_t g = 0; g < ng; g++) acc[g] = _mm_fmadd_ps(_mm_loadu_ps(qf + (g0 + g) * head_dim + d), k4, acc[g]);
                }
                for (int64_t g = 0; g < ng; g++) {
                    const __m128 half = _mm_add_ps(acc[g], _mm_movehl_ps(acc[g], acc[g])); /* [s0 + s2, s1 + s3, ..] */
                    const float s = (_mm_cvtss_f32(half) + _mm_cvtss_f32(_mm_shuffle_ps(half, half, 1))) * scale;
                    scores[(g0 + g) * split + t] = s;
                    if (s > split_max[g0 + g]) split_max[g0 + g] = s;
                }
            }
#endif
        for (int64_t g = g0; g < group; g++) {
            const float *q = qf + g * head_dim;
            float l[4] = {0.f, 0.f, 0.f, 0.f};
            for (int64_t d = 0; d < head_dim; d++) l[d % 4] += q[d] * bf16_to_f32(kr[d]);
            const float s = ((l[0] + l[2]) + (l[1] + l[3])) * scale;
            scores[g * split + t] = s;
            if (s > split_max[g]) split_max[g] = s;
        }
    }
}

/* acc += P @ V for bf16, summed as torch's CPU flash attention does (measured as above): rows
 * in groups of four (the last padded with zeros), each group summed as (p0 v0 + p2 v2) + (p1 v1
 * + p3 v3) and added to the running float32 accumulator, which carries on from the rescaled
 * result of the previous split. p is already rounded to bf16, so every product is exact. */
static void pv_bf16(const float *scores, int64_t split, const uint16_t *v, const int64_t *rows, int64_t n, float *acc,
                    int64_t head_dim, int64_t group) {
    for (int64_t t = 0; t < n; t += 4) {
        const uint16_t *vr[4];
        if (t + PREFETCH_ROWS + 4 <= n)
            for (int j = 0; j < 4; j++) prefetch_row(v + rows[t + PREFETCH_ROWS + j], head_dim);
        float p[64][4];
        for (int j = 0; j < 4; j++) vr[j] = t + j < n ? v + rows[t + j] : NULL;
        for (int64_t g = 0; g < group; g++)
            for (int j = 0; j < 4; j++) p[g][j] = t + j < n ? scores[g * split + t + j] : 0.f;
        int64_t d = 0;
#ifdef __AVX512F__
        for (; d + 16 <= head_dim; d += 16) {
            __m512 vv[4];
            for (int j = 0; j < 4; j++)
                vv[j] = vr[j] ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[j] + d))), 16))
                              : _mm512_setzero_ps();
            for (int64_t g = 0; g < group; g++) {
                const __m512 s02 = _mm512_fmadd_ps(_mm512_set1_ps(p[g][2]), vv[2], _mm512_mul_ps(_mm512_set1_ps(p[g][0]), vv[0]));
                const __m512 s13 = _mm512_fmadd_ps(_mm512_set1_ps(p[g][3]), vv[3], _mm512_mul_ps(_mm512_set1_ps(p[g][1]), vv[1]));
                float *a = acc + g * head_dim + d;
                _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_add_ps(s02, s13)));
            }
        }
#endif
        for (; d < head_dim; d++) {
            float x[4];
            for (int j = 0; j < 4; j++) x[j] = vr[j] ? bf16_to_f32(vr[j][d]) : 0.f;
            for (int64_t g = 0; g < group; g++) {
                const float s02 = p[g][0] * x[0] + p[g][2] * x[2], s13 = p[g][1] * x[1] + p[g][3] * x[3];
                acc[g * head_dim + d] += s02 + s13;
            }
        }
    }
}

#ifdef __AVX512F__
/* Scores of 16 K rows from four registers of four chains per row (register m: rows m, m + 4,
 * m + 8, m + 12 in its quarters): (s0 + s2) + (s1 + s3) per row, times scale, stored in row
 * order at out[0:16]; returns them. */
static inline __attribute__((always_inline)) __m512 store_16_scores(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float scale, float *out) {
    const __m512 x0 = _mm512_add_ps(a0, _mm512_shuffle_ps(a0, a0, 0x4E)), x1 = _mm512_add_ps(a1, _mm512_shuffle_ps(a1, a1, 0x4E));
    const __m512 x2 = _mm512_add_ps(a2, _mm512_shuffle_ps(a2, a2, 0x4E)), x3 = _mm512_add_ps(a3, _mm512_shuffle_ps(a3, a3, 0x4E));
    /* per quarter [s0 + s2, s1 + s3, s2 + s0, s3 + s1]; gather the first two of each register, then add */
    const __m512 p01 = _mm512_shuffle_ps(x0, x1, 0x44), p23 = _mm512_shuffle_ps(x2, x3, 0x44);
    const __m512 e = _mm512_shuffle_ps(p01, p23, 0x88), o = _mm512_shuffle_ps(p01, p23, 0xDD);
    const __m512 sc = _mm512_mul_ps(_mm512_add_ps(e, o), _mm512_set1_ps(scale)); /* lane j = row j */
    _mm512_storeu_ps(out, sc);
    return sc;
}

/* Before 16 K rows from t: the K rows PREFETCH_ROWS ahead into L2, and these rows' V into L2
 * (a split's V rows, 64 KB, outgrow L1), read next by P @ V. */
static inline __attribute__((always_inline)) void prefetch_16_rows(const uint16_t *k, const uint16_t *v, const int64_t *rows, int64_t t,
                                                                   int64_t n, int64_t head_dim) {
    if (t + PREFETCH_ROWS + 16 <= n)
        for (int j = 0; j < 16; j++) prefetch_row(k + rows[t + PREFETCH_ROWS + j], head_dim);
    for (int j = 0; j < 16; j++)
        for (int64_t i = 0; i < head_dim; i += 32) __builtin_prefetch(v + rows[t + j] + i, 0, 2);
}

/* During P @ V over rows t .. t + 3: the next round's keys t .. t + 3 into L2, found there by its scores. */
static inline __attribute__((always_inline)) void prefetch_next_keys(const next_keys *next, int64_t t, int64_t head_dim) {
    if (next)
        for (int j = 0; j < 4 && t + j < next->n; j++)
            for (int64_t i = 0; i < head_dim; i += 32) __builtin_prefetch(next->k + next->rows[t + j] + i, 0, 2);
}
#endif

#ifdef __AVX512F__
/* The bf16 loops above for head_dim = 16 * CHUNKS and GROUP query heads per K/V head known at
 * compile time, so the accumulators live in registers (the generic loops keep them on the
 * stack, one store-to-load round trip per FMA). Same operations, same order, same bits.
 *
 * Scores, 16 K rows at a time: register m holds rows t + m, t + m + 4, t + m + 8, t + m + 12
 * (one per 128-bit quarter, its four chains over d mod 4), so that one shuffle network turns
 * the four registers into the 16 rows' (s0 + s2) + (s1 + s3) in row order. Returns the rows
 * done (a multiple of 16); scores_bf16 takes the rest. */
static inline __attribute__((always_inline)) int64_t scores_bf16_fixed(
    const float *qf, const uint16_t *k, const uint16_t *v, const int64_t *rows, int64_t n, float scale, float *scores, int64_t split,
    float *split_max, const int CHUNKS, const int GROUP) {
    const int64_t head_dim = 16 * CHUNKS;
    __m512 vmax[4];
    for (int g = 0; g < GROUP; g++) vmax[g] = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        prefetch_16_rows(k, v, rows, t, n, head_dim);
        __m512 acc[4][4];
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++)
#pragma GCC unroll 4
            for (int g = 0; g < GROUP; g++) acc[m][g] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; c++)
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) {
                const uint16_t *r0 = k + rows[t + m], *r1 = k + rows[t + m + 4], *r2 = k + rows[t + m + 8], *r3 = k + rows[t + m + 12];
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(r0 + 16 * c)), a1 = _mm256_loadu_si256((const __m256i *)(r1 + 16 * c));
                const __m256i a2 = _mm256_loadu_si256((const __m256i *)(r2 + 16 * c)), a3 = _mm256_loadu_si256((const __m256i *)(r3 + 16 * c));
                const __m256i t0 = _mm256_unpacklo_epi64(a0, a1), t1 = _mm256_unpackhi_epi64(a0, a1);
                const __m256i t2 = _mm256_unpacklo_epi64(a2, a3), t3 = _mm256_unpackhi_epi64(a2, a3);
                const __m256i z[4] = {_mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
                                      _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)};
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    const __m512 k16 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(z[i]), 16));
#pragma GCC unroll 4
                    for (int g = 0; g < GROUP; g++)
                        acc[m][g] = _mm512_fmadd_ps(_mm512_broadcast_f32x4(_mm_loadu_ps(qf + g * head_dim + 16 * c + 4 * i)), k16, acc[m][g]);
                }
            }
#pragma GCC unroll 4
        for (int g = 0; g < GROUP; g++)
            vmax[g] = _mm512_max_ps(vmax[g], store_16_scores(acc[0][g], acc[1][g], acc[2][g], acc[3][g], scale, scores + g * split + t));
    }
    for (int g = 0; g < GROUP; g++) split_max[g] = fmaxf(split_max[g], _mm512_reduce_max_ps(vmax[g]));
    return t;
}

/* acc += P @ V in pv_bf16's order, the GROUP x CHUNKS accumulators in registers; all n rows. */
static inline __attribute__((always_inline)) void pv_bf16_fixed(
    const float *scores, int64_t split, const uint16_t *v, const next_keys *next, const int64_t *rows, int64_t n, float *acc_mem,
    const int CHUNKS, const int GROUP) {
    const int64_t head_dim = 16 * CHUNKS;
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; c++) acc[g][c] = _mm512_loadu_ps(acc_mem + g * head_dim + 16 * c);
    for (int64_t t = 0; t < n; t += 4) {
        const uint16_t *vr[4];
        prefetch_next_keys(next, t, head_dim);
        float p[4][4];
        for (int j = 0; j < 4; j++) vr[j] = v + rows[t + j < n ? t + j : t]; /* a padded row's p is 0 */
        for (int g = 0; g < GROUP; g++)
            for (int j = 0; j < 4; j++) p[g][j] = t + j < n ? scores[g * split + t + j] : 0.f;
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; c++) {
            __m512 vv[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                vv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[j] + 16 * c))), 16));
            if (t + 4 > n) /* padded rows are zeros, as pv_bf16 pads them */
                for (int j = (int)(n - t); j < 4; j++) vv[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int g = 0; g < GROUP; g++) {
                const __m512 s02 = _mm512_fmadd_ps(_mm512_set1_ps(p[g][2]), vv[2], _mm512_mul_ps(_mm512_set1_ps(p[g][0]), vv[0]));
                const __m512 s13 = _mm512_fmadd_ps(_mm512_set1_ps(p[g][3]), vv[3], _mm512_mul_ps(_mm512_set1_ps(p[g][1]), vv[1]));
                acc[g][c] = _mm512_add_ps(acc[g][c], _mm512_add_ps(s02, s13));
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; c++) _mm512_storeu_ps(acc_mem + g * head_dim + 16 * c, acc[g][c]);
}

#if defined(__AVX512BF16__)
/* The same two loops with VDPBF16PS, which takes bf16 pairs straight from the cache (no
 * conversion) and does two of torch's multiply-adds per lane: it adds the product of the
 * pairs' high halves, then of the low halves, each sum rounded to float32 (round to nearest
 * even), which is torch's chain of FMAs (bf16 products are exact in float32). Checked bit for
 * bit against the FMA chain on 200,000 random 16-term chains with mixed exponents, and with
 * the pair order swapped 24% differ. The instruction treats float32 denormals (below 1.2e-38)
 * as zero, inputs and sums, where torch keeps them: such terms are far below a bf16 step of
 * any sum they join.
 *
 * Scores: for head dims 8m .. 8m + 7 a 128-bit quarter holds one row's four chains j as pairs
 * (low: d = 8m + j + 4, high: d = 8m + j), d then d + 4 as torch's chain j takes them. */
static inline __attribute__((always_inline)) int64_t scores_bf16_dp(
    const float *qf, const uint16_t *k, const uint16_t *v, const int64_t *rows, int64_t n, float scale, float *scores, int64_t split,
    float *split_max, const int CHUNKS, const int GROUP) {
    const int64_t head_dim = 16 * CHUNKS;
    const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(8, 9, 0, 1, 10, 11, 2, 3, 12, 13, 4, 5, 14, 15, 6, 7));
    __m512i qp[4][16]; /* [g][m]: q's pairs for dims 8m .. 8m + 7 in all four quarters */
    for (int g = 0; g < GROUP; g++)
        for (int m = 0; m < head_dim / 8; m++) {
            uint16_t q8[8];
            for (int i = 0; i < 8; i++) { /* qf holds bf16 values exactly: their high halves */
                uint32_t u;
                memcpy(&u, qf + g * head_dim + 8 * m + i, 4);
                q8[i] = (uint16_t)(u >> 16);
            }
            qp[g][m] = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q8)), pairs);
        }
    __m512 vmax[4];
    for (int g = 0; g < GROUP; g++) vmax[g] = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        prefetch_16_rows(k, v, rows, t, n, head_dim);
        __m512 acc[4][4];
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++)
#pragma GCC unroll 4
            for (int g = 0; g < GROUP; g++) acc[m][g] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int c = 0; c < CHUNKS / 2; c++) /* 32 dims: steps 4c .. 4c + 3 */
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++) { /* register m: rows t + m, t + m + 4, t + m + 8, t + m + 12 */
                __m512i r[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    r[i] = _mm512_shuffle_epi8(_mm512_loadu_si512(k + rows[t + m + 4 * i] + 32 * c), pairs);
                /* 4 x 4 transpose of quarters: z[s] = step 4c + s of the four rows */
                const __m512i t0 = _mm512_shuffle_i64x2(r[0], r[1], 0x44), t1 = _mm512_shuffle_i64x2(r[0], r[1], 0xEE);
                const __m512i t2 = _mm512_shuffle_i64x2(r[2], r[3], 0x44), t3 = _mm512_shuffle_i64x2(r[2], r[3], 0xEE);
                const __m512i z[4] = {_mm512_shuffle_i64x2(t0, t2, 0x88), _mm512_shuffle_i64x2(t0, t2, 0xDD),
                                      _mm512_shuffle_i64x2(t1, t3, 0x88), _mm512_shuffle_i64x2(t1, t3, 0xDD)};
#pragma GCC unroll 4
                for (int s4 = 0; s4 < 4; s4++)
#pragma GCC unroll 4
                    for (int g = 0; g < GROUP; g++)
                        acc[m][g] = _mm512_dpbf16_ps(acc[m][g], (__m512bh)qp[g][4 * c + s4], (__m512bh)z[s4]);
            }
#pragma GCC unroll 4
        for (int g = 0; g < GROUP; g++)
            vmax[g] = _mm512_max_ps(vmax[g], store_16_scores(acc[0][g], acc[1][g], acc[2][g], acc[3][g], scale, scores + g * split + t));
    }
    for (int g = 0; g < GROUP; g++) split_max[g] = fmaxf(split_max[g], _mm512_reduce_max_ps(vmax[g]));
    return t;
}

/* P @ V: per group of four rows, (p0 v0 + p2 v2) and (p1 v1 + p3 v3) are one VDPBF16PS each
 * from zero (the first product exact, the sum rounded once, as fma(p2, v2, p0 v0)), then added
 * to the accumulator as pv_bf16 does. V rows 0 and 2 (1 and 3) are interleaved by 16-bit
 * unpacks, so the accumulators hold dims in the order (8L + i | 8L + 4 + i) of each 32; they
 * are put back in order when stored. */
static inline __attribute__((always_inline)) void pv_bf16_dp(
    const float *scores, int64_t split, const uint16_t *v, const next_keys *next, const int64_t *rows, int64_t n, float *acc_mem,
    const int CHUNKS, const int GROUP) {
    const int64_t head_dim = 16 * CHUNKS;
    __m512 acc[4][8]; /* [g][2c]: dims 32c + 8L + i, [g][2c + 1]: 32c + 8L + 4 + i (quarter L, lane i) */
#pragma GCC unroll 4
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 4
        for (int c = 0; c < CHUNKS / 2; c++) {
            const __m512 n0 = _mm512_loadu_ps(acc_mem + g * head_dim + 32 * c), n1 = _mm512_loadu_ps(acc_mem + g * head_dim + 32 * c + 16);
            acc[g][2 * c] = _mm512_shuffle_f32x4(n0, n1, 0x88);
            acc[g][2 * c + 1] = _mm512_shuffle_f32x4(n0, n1, 0xDD);
        }
    for (int64_t t = 0; t < n; t += 4) {
        prefetch_next_keys(next, t, head_dim);
        if (t + PV_AHEAD + 4 <= n)
            for (int j = 0; j < 4; j++)
                for (int64_t i = 0; i < head_dim; i += 32) __builtin_prefetch(v + rows[t + PV_AHEAD + j] + i, 0, 3);
        const int live = n - t < 4 ? (int)(n - t) : 4; /* rows past n: p = 0 and v = 0, as pv_bf16 pads */
        __m512i p02[4], p13[4];
        for (int g = 0; g < GROUP; g++) {
            uint32_t b[4];
            for (int j = 0; j < 4; j++) {
                const float p = j < live ? scores[g * split + t + j] : 0.f;
                memcpy(&b[j], &p, 4);
                b[j] >>= 16; /* p is a bf16 value already */
            }
            p02[g] = _mm512_set1_epi32((int)(b[0] | b[2] << 16));
            p13[g] = _mm512_set1_epi32((int)(b[1] | b[3] << 16));
        }
#pragma GCC unroll 4
        for (int c = 0; c < CHUNKS / 2; c++) {
            __m512i vr[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                vr[j] = j < live ? _mm512_loadu_si512(v + rows[t + j] + 32 * c) : _mm512_setzero_si512();
            const __m512i v02lo = _mm512_unpacklo_epi16(vr[0], vr[2]), v02hi = _mm512_unpackhi_epi16(vr[0], vr[2]);
            const __m512i v13lo = _mm512_unpacklo_epi16(vr[1], vr[3]), v13hi = _mm512_unpackhi_epi16(vr[1], vr[3]);
#pragma GCC unroll 4
            for (int g = 0; g < GROUP; g++) {
                const __m512 z = _mm512_setzero_ps();
                const __m512 lo = _mm512_add_ps(_mm512_dpbf16_ps(z, (__m512bh)p02[g], (__m512bh)v02lo), _mm512_dpbf16_ps(z, (__m512bh)p13[g], (__m512bh)v13lo));
                const __m512 hi = _mm512_add_ps(_mm512_dpbf16_ps(z, (__m512bh)p02[g], (__m512bh)v02hi), _mm512_dpbf16_ps(z, (__m512bh)p13[g], (__m512bh)v13hi));
                acc[g][2 * c] = _mm512_add_ps(acc[g][2 * c], lo);
                acc[g][2 * c + 1] = _mm512_add_ps(acc[g][2 * c + 1], hi);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 4
        for (int c = 0; c < CHUNKS / 2; c++) {
            const __m512 a = _mm512_shuffle_f32x4(acc[g][2 * c], acc[g][2 * c + 1], 0x44); /* lo.L0 lo.L1 hi.L0 hi.L1 */
            const __m512 b = _mm512_shuffle_f32x4(acc[g][2 * c], acc[g][2 * c + 1], 0xEE); /* lo.L2 lo.L3 hi.L2 hi.L3 */
            _mm512_storeu_ps(acc_mem + g * head_dim + 32 * c, _mm512_shuffle_f32x4(a, a, 0xD8));
            _mm512_storeu_ps(acc_mem + g * head_dim + 32 * c + 16, _mm512_shuffle_f32x4(b, b, 0xD8));
        }
}
#define SCORES_BF16 scores_bf16_dp
#define PV_BF16 pv_bf16_dp
#else
#define SCORES_BF16 scores_bf16_fixed
#define PV_BF16 pv_bf16_fixed
#endif

#define BF16_CASES(X) X(32, 1) X(32, 2) X(32, 4) X(64, 1) X(64, 2) X(64, 3) X(64, 4) X(128, 1) X(128, 2)
static inline __attribute__((always_inline)) int64_t scores_bf16_dispatch(
    const float *qf, const uint16_t *k, const uint16_t *v, const int64_t *rows, int64_t n, float scale, float *scores, int64_t split,
    float *split_max, int64_t head_dim, int64_t group) {
#define X(D, G) if (head_dim == D && group == G) return SCORES_BF16(qf, k, v, rows, n, scale, scores, split, split_max, D / 16, G);
    BF16_CASES(X)
#undef X
    return 0;
}
static inline __attribute__((always_inline)) int pv_bf16_dispatch(
    const float *scores, int64_t split, const uint16_t *v, const next_keys *next, const int64_t *rows, int64_t n, float *acc,
    int64_t head_dim, int64_t group) {
#define X(D, G) if (head_dim == D && group == G) { PV_BF16(scores, split, v, next, rows, n, acc, D / 16, G); return 1; }
    BF16_CASES(X)
#undef X
    return 0;
}
#else
#define scores_bf16_dispatch(...) 0
#define pv_bf16_dispatch(...) 0
#endif

/* sc[t] <- exp(sc[t] - max), rounded to bf16 when the KV is bf16 (torch rounds P to the
 * storage dtype before P @ V); returns the float32 sum of the unrounded values. As torch's
 * _exp_reduce_sum_fusion_kernel: 16-lane exps and sums, a tree reduction, then a scalar tail. */
static float exp_and_sum(float *sc, int64_t n, float max, int bf16) {
    const int64_t body = n / 16 * 16;
    float sum;
#ifdef __AVX512F__
    const __m512 vmax = _mm512_set1_ps(max), lo = _mm512_set1_ps(-87.33654475f), hi = _mm512_set1_ps(88.72283936f);
    __m512 acc = _mm512_setzero_ps();
    if (bf16) sum = fexp_sum_pieces(sc, body, max); /* torch's order (torch_numerics.h) */
    else {
    for (int64_t t = 0; t < body; t += 16) {
        const __m512 x0 = _mm512_sub_ps(_mm512_loadu_ps(sc + t), vmax);
        const __mmask16 under = _mm512_cmp_ps_mask(x0, lo, _CMP_LT_OS);
        const __m512 x = _mm512_max_ps(_mm512_min_ps(x0, hi), lo);
        const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269502f), _mm512_set1_ps(0.5f)),
                                              _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);
        __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
        p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
        p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
        p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
        p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.f));
        const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_sub_ps(n, _mm512_set1_ps(1.f))), _mm512_set1_epi32(127)), 23);
        const __m512 pow2 = _mm512_mask_blend_ps(under, _mm512_castsi512_ps(e), _mm512_setzero_ps());
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, pow2), _mm512_set1_ps(2.f));
        acc = _mm512_add_ps(acc, y);
        _mm512_storeu_ps(sc + t, y);
    }
    sum = _mm512_reduce_add_ps(acc);
    }
#else
    float lanes[16] = {0};
    for (int64_t t = 0; t < body; t++) sc[t] = bf16 ? fexp_scalar(sc[t] - max) : exp_like_torch(sc[t] - max);
    for (int64_t t = 0; t < body; t += 16)
        for (int j = 0; j < 16; j++) lanes[j] += sc[t + j];
    for (int step = 8; step > 0; step /= 2)
        for (int j = 0; j < step; j++) lanes[j] += lanes[j + step];
    sum = lanes[0];
#endif
    for (int64_t t = body; t < n; t++) {
        sc[t] = expf(sc[t] - max);
        sum += sc[t];
    }
    if (bf16) {
        int64_t t = 0;
#ifdef __AVX512F__
        for (; t + 16 <= n; t += 16) { /* f32_to_bf16 and back on 16 lanes: round to nearest even, NaN kept */
            const __m512i u = _mm512_loadu_si512(sc + t);
            const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
            r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
            _mm512_storeu_si512(sc + t, _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
        }
#endif
        for (; t < n; t++) sc[t] = bf16_to_f32(f32_to_bf16(sc[t]));
    }
    return sum;
}

/* rows[t] = element offset of position s0 + t's K/V row (head offset `base`), t < n */
static void slots_of(int64_t *rows, int64_t s0, int64_t n, const int32_t *table, int64_t block_size, int64_t head_dim, int64_t base) {
    for (int64_t t = 0, blk = s0 / block_size, off = s0 % block_size; t < n; t++) {
        rows[t] = base + ((int64_t)table[blk] * block_size + off) * head_dim;
        if (++off == block_size) off = 0, blk++;
    }
}

static inline __attribute__((always_inline)) void attend(
    const void *q, int64_t q_stride_b, int64_t q_stride_h, const void *k, const void *v, int64_t cache_stride_h,
    const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens, int64_t batch, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t split, float *scratch,
    void *out, int bf16) {
    const int64_t group = num_heads / num_kv_heads;
    float *scores = scratch;               /* [group, split] */
    float *acc = scores + group * split;   /* [group, head_dim] */
    float *qf = acc + group * head_dim;    /* [group, head_dim] */
    float row_max[64], row_sum[64], split_max[64];
    int64_t *rows = (int64_t *)(qf + group * head_dim); /* [split] element offset of each K/V row */
    int64_t *next_rows = rows + split;                   /* [split] the next sequence's first rows (prefetch) */
    for (int64_t b = 0; b < batch; b++) {
        const int32_t *table = block_tables + b * max_blocks;
        const int64_t ctx = context_lens[b];
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            for (int64_t g = 0; g < group; g++) {
                const int64_t qi = b * q_stride_b + (kvh * group + g) * q_stride_h;
                for (int64_t d = 0; d < head_dim; d++) qf[g * head_dim + d] = load(q, qi + d, bf16);
                memset(acc + g * head_dim, 0, sizeof(float) * head_dim);
                row_max[g] = -INFINITY;
                row_sum[g] = 0.f;
            }
            for (int64_t s0 = 0; s0 < ctx; s0 += split) {
                const int64_t n = ctx - s0 < split ? ctx - s0 : split;
                for (int64_t g = 0; g < group; g++) split_max[g] = -INFINITY;
                slots_of(rows, s0, n, table, block_size, head_dim, kvh * cache_stride_h);
                if (bf16) {
                    const int64_t done = scores_bf16_dispatch(qf, (const uint16_t *)k, (const uint16_t *)v, rows, n, scale, scores, split, split_max, head_dim, group);
                    if (done < n) /* the generic loop for the rest: scores and rows from `done` on */
                        scores_bf16(qf, (const uint16_t *)k, rows + done, n - done, scale, scores + done, split, split_max, head_dim, group);
                }
                else if (!scores_dispatch(qf, (const float *)k, rows, n, scale, scores, split, split_max, head_dim, group))
                for (int64_t t = 0; t < n; t++) { /* scores of every head in the group against one K row */
                    const int64_t row = rows[t];
                    for (int64_t g = 0; g < group; g++) {
                        const float s = dot(qf + g * head_dim, k, row, head_dim, bf16) * scale;
                        scores[g * split + t] = s;
                        if (s > split_max[g]) split_max[g] = s;
                    }
                }
                for (int64_t g = 0; g < group; g++) { /* online softmax across splits */
                    const float new_max = split_max[g] > row_max[g] ? split_max[g] : row_max[g];
                    float *sc = scores + g * split;
                    const float sum = exp_and_sum(sc, n, new_max, bf16);
                    const float correction = expf(row_max[g] - new_max);
                    row_sum[g] = bf16 ? fmaf(correction, row_sum[g], sum) : sum + correction * row_sum[g]; /* torch's build fuses this for bf16 */
                    row_max[g] = new_max;
                    if (s0 > 0)
                        for (int64_t d = 0; d < head_dim; d++) acc[g * head_dim + d] *= correction;
                }
                if (bf16) {
                    next_keys next = {(const uint16_t *)k, next_rows, 0};
                    if (s0 + split >= ctx) { /* the next round's keys: next head's first split, or next sequence's */
                        const int64_t nb = kvh + 1 < num_kv_heads ? b : b + 1, nh = kvh + 1 < num_kv_heads ? kvh + 1 : 0;
                        if (nb < batch) {
                            next.n = context_lens[nb] < split ? context_lens[nb] : split;
                            slots_of(next_rows, 0, next.n, block_tables + nb * max_blocks, block_size, head_dim, nh * cache_stride_h);
                        }
                    }
                    if (!pv_bf16_dispatch(scores, split, (const uint16_t *)v, &next, rows, n, acc, head_dim, group))
                        pv_bf16(scores, split, (const uint16_t *)v, rows, n, acc, head_dim, group);
                }
                else if (!pv_dispatch(scores, split, (const float *)v, rows, n, acc, head_dim, group))
                for (int64_t t = 0; t < n; t++) { /* acc += P @ V, every head in the group per V row */
                    const int64_t row = rows[t];
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * split + t];
                        float *a = acc + g * head_dim;
                        axpy(a, p, v, row, head_dim, bf16);
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const float inv = 1.f / row_sum[g];
                const int64_t oi = (b * num_heads + kvh * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) {
                    const float o = acc[g * head_dim + d] * inv;
                    if (bf16) ((uint16_t *)out)[oi + d] = f32_to_bf16(o);
                    else ((float *)out)[oi + d] = o;
                }
            }
        }
    }
}

#define ARGS                                                                                                 \
    const void *q, int64_t q_stride_b, int64_t q_stride_h, const void *k, const void *v, int64_t cache_stride_h, \
        const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens, int64_t batch,          \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,           \
        int64_t split, float *scratch, void *out
#define PASS                                                                                                 \
    q, q_stride_b, q_stride_h, k, v, cache_stride_h, block_tables, max_blocks, context_lens, batch, num_heads, \
        num_kv_heads, head_dim, block_size, scale, split, scratch, out

void paged_decode_attention_bf16(ARGS) { attend(PASS, 1); }
void paged_decode_attention_f32(ARGS) { attend(PASS, 0); }
