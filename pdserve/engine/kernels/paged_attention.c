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
 *   scratch:      float32, group * (split + 2 * head_dim) + 2 * split elements; group = num_heads / num_kv_heads <= 64
 *
 * Numerics follow torch's CPU flash-attention kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp),
 * which the reference model.generate runs: scores q.k in float32, then scaled; keys taken in splits
 * of `split` tokens (torch: 512) with a running max; exp(s - max) summed in float32 and rounded to
 * the storage dtype before P @ V, which accumulates in float32; output = acc * (1 / sum), rounded
 * once. Only the float32 summation order and the exp implementation differ.
 *
 * Built with cc -O3 -march=native by kernels/__init__.py; one thread per call.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16 /* independent partial sums: lets the compiler vectorize without -ffast-math */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

#ifdef __AVX512F__
/* The two loops of one split for head_dim = 16 * HDV and GROUP query heads per K/V head, with
 * every K/V row loaded and converted once and the GROUP accumulators held in registers. */
static inline __attribute__((always_inline)) void scores_fast(
    const float *qf, const void *k, const int64_t *rows, int64_t n, float scale, float *scores, int64_t split,
    float *split_max, int bf16, const int HDV, const int GROUP) {
    for (int64_t t = 0; t < n; t++) {
        __m512 kr[8];
        if (t + 16 < n) /* blocks are scattered: fetch a block ahead, the prefetcher cannot guess it */
            for (int i = 0; i < HDV; i += 4) _mm_prefetch((const char *)k + (rows[t + 16] + 16 * i) * (bf16 ? 2 : 4), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int i = 0; i < HDV; i++) kr[i] = load16(k, rows[t] + 16 * i, bf16);
#pragma GCC unroll 8
        for (int g = 0; g < GROUP; g++) {
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + g * 16 * HDV), kr[0]);
#pragma GCC unroll 8
            for (int i = 1; i < HDV; i++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * 16 * HDV + 16 * i), kr[i], acc);
            const float s = _mm512_reduce_add_ps(acc) * scale;
            scores[g * split + t] = s;
            if (s > split_max[g]) split_max[g] = s;
        }
    }
}

static inline __attribute__((always_inline)) void pv_fast(
    const float *scores, int64_t split, const void *v, const int64_t *rows, int64_t n, float *acc_mem, int bf16,
    const int HDV, const int GROUP) {
    __m512 acc[8][8];
#pragma GCC unroll 8
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 8
        for (int i = 0; i < HDV; i++) acc[g][i] = _mm512_loadu_ps(acc_mem + (g * HDV + i) * 16);
    for (int64_t t = 0; t < n; t++) {
        __m512 vr[8];
        if (t + 16 < n)
            for (int i = 0; i < HDV; i += 4) _mm_prefetch((const char *)v + (rows[t + 16] + 16 * i) * (bf16 ? 2 : 4), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int i = 0; i < HDV; i++) vr[i] = load16(v, rows[t] + 16 * i, bf16);
#pragma GCC unroll 8
        for (int g = 0; g < GROUP; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * split + t]);
#pragma GCC unroll 8
            for (int i = 0; i < HDV; i++) acc[g][i] = _mm512_fmadd_ps(p, vr[i], acc[g][i]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 8
        for (int i = 0; i < HDV; i++) _mm512_storeu_ps(acc_mem + (g * HDV + i) * 16, acc[g][i]);
}

/* Dispatch to a register-resident instance; returns 0 where none fits (GROUP * HDV > 16). */
#define FAST_CASES(X) X(4, 1) X(4, 2) X(4, 3) X(4, 4) X(8, 1) X(8, 2)
static inline __attribute__((always_inline)) int scores_dispatch(
    const float *qf, const void *k, const int64_t *rows, int64_t n, float scale, float *scores, int64_t split,
    float *split_max, int bf16, int64_t head_dim, int64_t group) {
#define X(H, G) if (head_dim == 16 * H && group == G) { scores_fast(qf, k, rows, n, scale, scores, split, split_max, bf16, H, G); return 1; }
    FAST_CASES(X)
#undef X
    return 0;
}
static inline __attribute__((always_inline)) int pv_dispatch(
    const float *scores, int64_t split, const void *v, const int64_t *rows, int64_t n, float *acc, int bf16,
    int64_t head_dim, int64_t group) {
#define X(H, G) if (head_dim == 16 * H && group == G) { pv_fast(scores, split, v, rows, n, acc, bf16, H, G); return 1; }
    FAST_CASES(X)
#undef X
    return 0;
}
#else
#define scores_dispatch(...) 0
#define pv_dispatch(...) 0
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
#else
    float lanes[16] = {0};
    for (int64_t t = 0; t < body; t++) sc[t] = exp_like_torch(sc[t] - max);
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
    if (bf16)
        for (int64_t t = 0; t < n; t++) sc[t] = bf16_to_f32(f32_to_bf16(sc[t]));
    return sum;
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
                for (int64_t t = 0; t < n; t++) {
                    const int64_t pos = s0 + t;
                    rows[t] = kvh * cache_stride_h + ((int64_t)table[pos / block_size] * block_size + pos % block_size) * head_dim;
                }
                if (!scores_dispatch(qf, k, rows, n, scale, scores, split, split_max, bf16, head_dim, group))
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
                    row_sum[g] = sum + correction * row_sum[g];
                    row_max[g] = new_max;
                    if (s0 > 0)
                        for (int64_t d = 0; d < head_dim; d++) acc[g * head_dim + d] *= correction;
                }
                if (!pv_dispatch(scores, split, v, rows, n, acc, bf16, head_dim, group))
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
