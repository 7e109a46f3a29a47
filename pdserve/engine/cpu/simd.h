/* One vector abstraction for pdserve's CPU kernels, chosen at build time (-march=native).
 *
 * VL float lanes: 16 (AVX-512F), 8 (AVX2 + FMA) or 1 (portable C). Every reduction in the
 * kernels is written over these: lane j of an accumulator sums elements j, j + VL, j + 2VL,
 * ... in order, then vsum() adds the lanes in a fixed tree. The order depends on nothing but
 * the row's own length, which is what makes the kernels batch invariant.
 *
 * bf16 values are uint16_t holding the top half of a float32 (Brain float, as torch's
 * bfloat16); bf16_round() rounds to nearest even as torch does (c10/util/BFloat16.h).
 */
#ifndef PDSERVE_SIMD_H
#define PDSERVE_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
#define VL 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vset1(float a) { return a; }
static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf a) { *p = a; }
static inline vf vfma(vf a, vf b, vf c) { return fmaf(a, b, c); }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline float vsum(vf a) { return a; }
static inline vf vload_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
#endif

/* A float row of either dtype: bf != 0 means uint16_t bf16 elements. */
static inline float ld(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = bf16_round(v);
    else ((float *)p)[i] = v;
}

/* The ISA this build runs: reported to Python (engine.json, logs). */
static inline const char *simd_isa(void) {
#if defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

#endif
